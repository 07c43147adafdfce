//! # mirrorq
//!
//! RabbitMQ-style mirrored queues rebuilt on Raft: every queue is a Raft
//! group whose leader is the master and whose followers are the mirrors; the
//! cluster metadata is one more Raft group over all nodes. A publish is
//! confirmed only once every synchronised replica has it on disk.
//!
//! ## Layout
//!
//! Leaves, imported by everything above them:
//! - [`ids`]: node and group identities; [`message`]: a message as stored,
//!   and its AMQP properties; [`error`]: the API's errors.
//! - [`timing`]: a node's time limits (elections, sync, failover, consumers).
//!
//! Not a leaf: [`api`], value types of the library API that also travel
//! between nodes, names [`queue`]'s sync progress and epoch, [`metadata`]'s
//! queue arguments and [`rates`]' flows, so it sits above those three and
//! below [`wire`], [`node`] and the front ends.
//!
//! The data and control planes:
//! - [`link`]: the node link (one multiplexed TCP connection per peer, its
//!   frames, the server that answers it, liveness pings on their own
//!   beacon); it carries requests and replies of any serde type and knows
//!   nothing of what they say.
//! - [`raft`]: what every group shares, generic over what its entries
//!   carry: the type configuration and the state-machine adapter. It
//!   knows no queue or metadata type; [`queue::QueueTypes`] and
//!   [`metadata::MetaTypes`] instantiate it, so a queue's log cannot hold
//!   a metadata command.
//! - [`queue`]: the queue state machine (pure [`queue::state`], on disk
//!   [`queue::sm`]), batching into entries ([`queue::proposer`]) and the
//!   synchronised-replica tracking behind confirms ([`queue::confirm_gate`]),
//!   one hosted replica with all of that ([`queue::replica`]) and a node's
//!   table of them ([`queue::replicas`]).
//! - [`metadata`]: the cluster metadata state machine (exchanges, queues,
//!   bindings, policies, users) and its routing.
//! - [`peers`]: whether each peer is alive (pings, refused dials, notices
//!   of departure), decided in one place and published as one view; and
//!   the quiet-group lists the pings carry ([`peers::quiet`]).
//! - [`owners`]: who holds a queue's unacknowledged messages.
//! - [`wire`]: what nodes say to each other over the link (Raft's messages
//!   by group and epoch, forwarded operations, pings, the API's
//!   cluster-wide questions; each request a type of [`wire::ask`] paired
//!   with the answer it expects), each group's openraft network in those
//!   words, and a client for tools and tests.
//! - [`failover`]: what a node does when replicas fail, as one task over
//!   the replica table: the failure watch (who stands, when a lost
//!   master's lease is out), re-forming a group that lost its majority,
//!   healing and split verdicts between epochs, handing mastership over on
//!   a graceful stop or a rebalance. It reads liveness from [`peers`] and
//!   acts through its [`failover::Host`], which the node implements; it
//!   knows no node.
//! - [`node`]: a running node, its replicas and the library API (declare,
//!   publish, get, ack, nack, purge, delete, shutdown): start-up and stop,
//!   forwarding to masters, the reconciler that places replicas, failover's
//!   host, catch-up and the background sweeps (`node/sweeps/`).
//!
//! Front ends and the command line:
//! - [`amqp`]: the AMQP 0-9-1 front end (amq-protocol frames) over the node API.
//! - [`http`]: the management HTTP API (axum), RabbitMQ's field names, and
//!   the web UI; [`clients`]: the connections, channels and consumers it lists.
//! - [`metrics`]: Prometheus metrics for `GET /metrics`; [`rates`]: message
//!   rates over a sample window (the API's `message_stats`); [`alarms`]:
//!   memory and disk alarms that block publishers; [`log_throttle`]: a
//!   failure that repeats is logged once and counted.
//! - [`tls`]: AMQPS and HTTPS with rustls.
//! - [`config`], [`cli`], [`serve`]: the `mirrorq serve` command;
//!   [`perf`]: `mirrorq perf`, an AMQP load generator (lapin); [`ctl`]:
//!   `mirrorq ctl`, the HTTP API from the command line.
//! - `mirrorq-storage` (the `storage/` crate): the node's write-ahead log of
//!   every group's entries, sled for votes, purge points and state, group
//!   commit (one fdatasync for every waiter) and openraft's log storage;
//!   it knows nothing of AMQP or queues.
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
pub mod failover;
pub mod http;
pub mod ids;
pub mod link;
pub mod log_throttle;
pub mod message;
pub mod metadata;
pub mod metrics;
pub mod node;
pub mod owners;
pub mod peers;
pub mod perf;
pub mod queue;
pub mod raft;
pub mod rates;
pub mod serve;
pub mod timing;
pub mod tls;
pub mod wire;

pub use error::{NodeError, ServerError};
pub use node::{Node, NodeConfig, QueueInfo, Timing};
pub use queue::{Delivery, Message, QueueCmd, QueueReply};
