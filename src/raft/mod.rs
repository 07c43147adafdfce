//! Raft plumbing shared by every group: the type configuration and the
//! state machine adapter (each group's network is `wire::raft_net`).

pub mod state_machine;
pub mod types;
