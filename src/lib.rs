//! # mirrorq
//!
//! RabbitMQ-style mirrored queues rebuilt on Raft: every queue is a Raft
//! group whose leader is the master and whose followers are the mirrors; the
//! cluster metadata is one more Raft group over all nodes. A publish is
//! confirmed only once every synchronised replica has it on disk.
//!
//! ## Layout
//!
//! - [`node`]: a running node, its groups, and the library API
//!   (declare, publish, get, ack, nack, purge, delete, shutdown).
//! - [`queue`]: the queue state machine (pure [`queue::state`], on disk
//!   [`queue::sm`]), batching into entries ([`queue::proposer`]) and the
//!   synchronised-replica tracking behind confirms ([`queue::confirm_gate`]).
//! - [`metadata`]: the cluster metadata state machine.
//! - [`raft`]: type config, state-machine adapter, node-to-node wire format,
//!   outbound network and inbound server shared by all groups.
//! - [`amqp`]: the AMQP 0-9-1 front end (amq-protocol frames) over the node API.
//! - [`http`]: the management HTTP API (axum), RabbitMQ's field names.
//! - [`metrics`]: Prometheus metrics for `GET /metrics`.
//! - [`rates`]: message rates over a sample window (the API's `message_stats`).
//! - [`alarms`]: memory and disk alarms that block publishers.
//! - [`client`]: a client of the node link, for tools and tests.
//! - [`config`], [`cli`], [`serve`]: the `mirrorq serve` command.
//! - [`perf`]: `mirrorq perf`, an AMQP load generator (lapin).
//! - [`ctl`]: `mirrorq ctl`, the HTTP API from the command line.
//! - `mirrorq-storage` (the `storage/` crate): sled, group commit, openraft's
//!   log storage.
//!
//! How a publish flows is written up in `docs/architecture.md`.

pub mod alarms;
pub mod amqp;
pub mod api;
pub mod cli;
pub mod clients;
pub mod config;
pub mod ctl;
pub mod error;
pub mod http;
pub mod ids;
pub mod link;
pub mod log_throttle;
pub mod message;
pub mod metadata;
pub mod metrics;
pub mod node;
pub mod owners;
pub mod perf;
pub mod queue;
pub mod raft;
pub mod rates;
pub mod serve;
pub mod tls;

pub use error::{NodeError, ServerError};
pub use node::{Node, NodeConfig, QueueInfo, Timing};
pub use queue::{Delivery, Message, QueueCmd, QueueReply};
