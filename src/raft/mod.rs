//! Raft plumbing shared by every group: the type configuration, the state
//! machine adapter, and each group's openraft network over the node link.

pub mod network;
pub mod state_machine;
pub mod types;
