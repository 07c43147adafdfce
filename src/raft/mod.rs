//! Raft plumbing shared by every group: the type configuration, the state
//! machine adapter, the node-to-node wire format, the outbound network and
//! the inbound server.

pub mod network;
pub mod rpc;
pub mod server;
pub mod state_machine;
pub mod types;
