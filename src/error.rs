//! Errors of the node's API, as callers (and forwarding peers) see them.

use serde::{Deserialize, Serialize};

use crate::ids::NodeId;

/// Why a queue or metadata operation did not complete. Serializable: a node
/// forwarding an operation to the master passes the master's error on as is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum NodeError {
    /// This node is not the group's leader; retry at `leader` if known.
    #[error("not the leader (leader: {leader:?})")]
    NotLeader { leader: Option<NodeId> },
    #[error("no queue named '{0}'")]
    NoSuchQueue(String),
    /// No master (or metadata leader) could be reached in time.
    #[error("unavailable: {0}")]
    Unavailable(String),
    #[error("invalid request: {0}")]
    Invalid(String),
    /// No such exchange, binding target, ... (AMQP 404).
    #[error("not found: {0}")]
    NotFound(String),
    /// Conflicts with what exists (AMQP 406).
    #[error("precondition failed: {0}")]
    Conflict(String),
    /// Not permitted, e.g. a reserved name (AMQP 403).
    #[error("refused: {0}")]
    Refused(String),
    /// The entry was written but leadership changed before every replica
    /// confirmed it: the outcome is unknown and the publisher should resend
    /// (at-least-once), exactly as after a `basic.nack`.
    #[error("not confirmed: {0}")]
    Unconfirmed(String),
    #[error("node is stopping")]
    Stopped,
}

/// Errors starting a node.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error(transparent)]
    Storage(#[from] mirrorq_storage::StorageError),
    #[error(
        "data dir {path} belongs to node {found}, not node {configured}; use --node-id {found} or another --data-dir"
    )]
    WrongNode { path: std::path::PathBuf, found: NodeId, configured: NodeId },
    #[error(
        "data dir {path} was written in format {} and this build reads format {reads}; start the build that wrote it (or another --data-dir)",
        found.map_or("1 (unmarked)".to_string(), |f| f.to_string())
    )]
    Format { path: std::path::PathBuf, found: Option<u32>, reads: u32 },
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("raft: {0}")]
    Raft(String),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("cannot start the beacon thread: {0}")]
    Beacon(#[source] std::io::Error),
}
