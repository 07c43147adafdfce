//! The node link: node-to-node transport (one multiplexed TCP connection
//! per peer), its frames, the server that answers it, and the beacon that
//! carries pings. It knows nothing of the node nor of what the frames say
//! (`crate::wire`): requests and replies are any serde types, and inbound
//! requests go to an [`server::RpcHandler`] the node implements.

pub mod auth;
pub mod beacon;
pub mod faults;
pub mod frame;
pub mod server;
pub mod transport;
