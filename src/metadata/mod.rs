//! Cluster metadata: which nodes exist, which queues exist on which
//! replicas, exchanges and bindings. A Raft group over every node (group 0); every node applies it
//! and answers reads from its local copy.

pub mod access;
mod machine;
pub mod names;
pub mod policy;
pub mod queue_args;
pub mod routing;
mod state;

pub use access::{Access, Permission, User, Vhost};
pub use machine::{ChangeFeed, MetaMachine, Touched};
pub use policy::{ApplyTo, Policy};
pub use queue_args::QueueArgs;
pub use routing::{ArgValue, Args, Binding, ExchangeKind, ExchangeMeta};
pub use state::{MetaCmd, MetaReply, MetaState, NodeInfo, QueueMeta};

/// openraft's types for the metadata group: an entry is one command.
pub type MetaTypes = crate::raft::types::Group<MetaCmd, MetaReply>;
pub type MetaRaft = openraft::Raft<MetaTypes>;
pub type MetaLog = mirrorq_storage::LogStore<MetaTypes>;
