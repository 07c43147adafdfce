//! Raft plumbing shared by every group, whatever its entries: the type
//! configuration, generic over them, and the state machine adapter over a
//! group's space (each group's network is `wire::raft_net`). Knows no
//! queue or metadata type: those modules instantiate it.

pub mod state_machine;
pub mod types;
