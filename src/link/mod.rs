//! The node link: node-to-node transport (one multiplexed TCP connection
//! per peer), its wire format, the server that answers it, and a client for
//! tools and tests. It knows nothing of the node: inbound requests go to an
//! [`server::RpcHandler`] the node implements.

pub mod auth;
pub mod beacon;
pub mod client;
pub mod faults;
pub mod rpc;
pub mod server;
pub mod transport;
