//! # mirrorq-storage
//!
//! One sled database per node holds the Raft logs, votes and state-machine data
//! of every Raft group the node hosts (each queue's group and the cluster
//! metadata group). This crate knows sled and openraft's v2 storage traits and
//! nothing about AMQP or queues.
//!
//! ## Layout
//!
//! - [`db`]: opening a data dir (lock file, sled config, trees) and dropping groups.
//! - [`flusher`]: group commit. One thread batches every waiting append of every
//!   group into one `flush` + `fdatasync` and only then completes them.
//! - [`log_store`]: [`LogStore`], openraft's `RaftLogStorage` for one group.
//! - [`space`]: [`SmSpace`], the key space a group's state machine writes into.
//! - [`batch`]: [`Batch`], a state-machine step's writes, made crash-atomic by
//!   a redo record rather than a sled batch when small.
//! - [`keys`]: the on-disk key encoding shared by all of the above.
//!
//! ## Why the sync is ours
//!
//! sled's `flush()` ends in `sync_file_range`, which is not a durable fsync on
//! Linux (spacejam/sled#1452). The flusher therefore calls `flush()` and then
//! `sync_data()` on sled's data file; nothing that a publisher confirm depends
//! on is reported durable before that returns. A failed sync is fatal: the
//! flusher fails every waiter and every later request, and raises
//! [`NodeDb::fatal`], on which the node stops.

pub mod batch;
pub mod db;
pub mod error;
pub mod flusher;
pub mod keys;
pub mod log_store;
pub mod space;

pub use batch::Batch;
pub use db::{DbOptions, NodeDb};
pub use error::StorageError;
pub use flusher::{Flusher, FlusherStats};
pub use log_store::LogStore;
pub use space::SmSpace;

/// Raft group identifier. Group 0 is the cluster metadata group; queue groups
/// get ids from the metadata state machine.
pub type GroupId = u64;
