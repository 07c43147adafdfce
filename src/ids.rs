//! The identities everything else names: nodes and Raft groups. A leaf:
//! it imports nothing of the crate.

/// A node of the cluster (`--node-id`), never 0.
pub type NodeId = u64;

/// A Raft group on a node: the metadata group or one queue's.
pub use mirrorq_storage::GroupId;

/// Group 0 is the cluster metadata group, over all nodes.
pub const METADATA_GROUP: GroupId = 0;
