//! The one Raft type configuration shared by every group on a node.

use std::io::Cursor;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::metadata::{MetaCmd, MetaReply};
use crate::queue::{QueueCmd, QueueReply};

use crate::ids::NodeId;

/// What a Raft entry carries. Queue groups only see `Queue`, the metadata
/// group only `Meta`; sharing one type lets one network and one router carry
/// every group.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Request {
    Meta(MetaCmd),
    /// A batch: every operation that arrived while the previous entry was in
    /// flight. Shared: an entry is read back to apply it and once per mirror
    /// to replicate it (from the log store's recent entries), and a copy of
    /// its messages each time would cost what decoding did.
    Queue(Arc<Vec<QueueCmd>>),
}

// One per applied entry, handed straight to the waiting caller; the metadata
// replies are rare and boxing them would only move the size to the heap.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Response {
    Meta(MetaReply),
    Queue(Vec<QueueReply>),
    /// Blank and membership entries, and requests sent to the wrong kind of group.
    None,
}

openraft::declare_raft_types!(
    pub TypeConfig:
        D = Request,
        R = Response,
        NodeId = NodeId,
        Node = openraft::BasicNode,
        SnapshotData = Cursor<Vec<u8>>,
);

pub type Raft = openraft::Raft<TypeConfig>;
pub type LogStore = mirrorq_storage::LogStore<TypeConfig>;
