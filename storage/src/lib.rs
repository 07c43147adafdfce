//! # mirrorq-storage
//!
//! One write-ahead log per node holds the Raft entries of every Raft group the
//! node hosts (each queue's group and the cluster metadata group); one sled
//! database holds their votes and state-machine data. This crate knows sled,
//! its own log files and openraft's v2 storage traits, and nothing about AMQP
//! or queues.
//!
//! ## Layout
//!
//! - [`db`]: opening a data dir (lock file, sled config, trees) and dropping groups.
//! - [`wal`]: [`Wal`], the segment files every group's entries are appended to.
//! - [`flusher`]: group commit. One thread batches every waiting append of every
//!   group into one `fdatasync` of the log (and, for what needs it, a sled
//!   `flush` + `fdatasync`) and only then completes them; it also reclaims
//!   log segments.
//! - [`log_store`]: [`LogStore`], openraft's `RaftLogStorage` for one group.
//! - [`space`]: [`SmSpace`], the key space a group's state machine writes into.
//! - [`batch`]: [`Batch`], a state-machine step's writes, made crash-atomic by
//!   a redo record rather than a sled batch when small.
//! - [`keys`]: the on-disk key encoding shared by all of the above.
//! - `fsync`: directory syncs, and the test crash that loses what they did not cover.
//!
//! ## Why the sync is ours
//!
//! sled's `flush()` ends in `sync_file_range`, which is not a durable fsync on
//! Linux (spacejam/sled#1452). The flusher therefore calls `flush()` and then
//! `sync_data()` on sled's data file when sled's writes must be durable
//! (votes, snapshots, node values, before log segments are removed). A
//! publisher confirm depends only on log entries, which are durable once the
//! flusher's `fdatasync` of the log segment returns. A failed sync is fatal: the
//! flusher fails every waiter and every later request, and raises
//! [`NodeDb::fatal`], on which the node stops.

pub mod batch;
pub mod db;
pub mod error;
pub mod flusher;
mod fsync;
pub mod keys;
pub mod log_store;
pub mod space;
pub mod wal;

pub use batch::Batch;
pub use db::{set_aside, was_set_aside, DbOptions, NodeDb};
pub use error::StorageError;
pub use flusher::{Flusher, FlusherStats};
pub use log_store::{Durability, LogStore};
pub use space::SmSpace;
pub use wal::{Wal, WalError};

/// Raft group identifier. Group 0 is the cluster metadata group; queue groups
/// get ids from the metadata state machine.
pub type GroupId = u64;
