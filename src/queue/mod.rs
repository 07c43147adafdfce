//! Queues: the deterministic state ([`state`]), its commands ([`types`]), its
//! on-disk state machine ([`sm`]), and the per-group machinery on the master
//! that batches operations into entries and holds confirms until every
//! synchronised replica has them ([`proposer`], [`confirm_gate`]); and the epochs
//! a group goes through when it is re-formed after losing its majority ([`epoch`]);
//! the bodies a replica still has to fetch after a snapshot ([`catchup`]);
//! how bodies and deliveries are laid out on disk ([`bodies`], [`runs`]);
//! a quiet group's heartbeats, off until its next entry ([`hush`]); which
//! consumers a master serves first by their priorities ([`ranking`]); one
//! hosted replica with all of that ([`replica`]) and a node's table of them
//! ([`replicas`]).

mod bodies;
pub mod catchup;
pub mod confirm_gate;
pub mod epoch;
pub mod hush;
mod keys;
pub mod proposer;
pub mod ranking;
pub mod replica;
pub mod replicas;
mod runs;
pub mod sm;
pub mod state;
pub mod types;

pub use sm::{QueueMachine, QueueStats};
pub use types::{Delivery, Holdings, Message, MsgState, QueueCmd, QueueReply};

/// What one entry of a queue group's log carries: every operation that
/// arrived while the previous entry was in flight. Shared: an entry is read
/// back to apply it and once per mirror to replicate it (from the log
/// store's recent entries), and a copy of its messages each time would cost
/// what decoding did.
pub type Cmds = std::sync::Arc<Vec<QueueCmd>>;
/// openraft's types for queue groups: an entry is [`Cmds`], applying it
/// answers one reply per operation.
pub type QueueTypes = crate::raft::types::Group<Cmds, Vec<QueueReply>>;
pub type QueueRaft = openraft::Raft<QueueTypes>;
pub type QueueLog = mirrorq_storage::LogStore<QueueTypes>;
