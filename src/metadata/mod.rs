//! Cluster metadata: which nodes exist and which queues exist on which
//! replicas. A Raft group over every node (group 0); every node applies it
//! and answers reads from its local copy.

mod machine;
mod state;

pub use machine::MetaMachine;
pub use state::{MetaCmd, MetaReply, MetaState, NodeInfo, QueueMeta};
