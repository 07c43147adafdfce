//! What nodes say to each other over the node link (`crate::link`, which
//! carries it without knowing it): Raft's messages stamped with their group
//! and epoch, forwarded queue and metadata operations, liveness pings, and
//! the questions behind the API's cluster-wide views. Each request but
//! Raft's is a type in `ask` paired with the one answer it expects, so a
//! caller gets that answer typed. Also openraft's network in these words
//! (`raft_net`) and a client for tools and tests (`client`).

pub mod ask;
pub mod client;
pub mod raft_net;

use openraft::error::{InstallSnapshotError, RaftError};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use serde::{Deserialize, Serialize};

use crate::ids::{GroupId, NodeId};

use crate::error::NodeError;
use crate::metadata::{MetaReply, MetaTypes};
use crate::queue::confirm_gate::Standing;
use crate::queue::epoch::{Epoch, EpochReport, ForkRecord};
use crate::queue::{QueueCmd, QueueReply, QueueTypes};

pub use crate::peers::quiet::QuietList;

/// Raft's messages, stamped with their group and epoch, then the requests
/// of [`ask`].
#[derive(Debug, Serialize, Deserialize)]
pub enum RpcRequest {
    Append {
        group: GroupId,
        epoch: Epoch,
        from: NodeId,
        req: Appends,
    },
    Vote {
        group: GroupId,
        epoch: Epoch,
        from: NodeId,
        req: VoteRequest<NodeId>,
    },
    Snapshot {
        group: GroupId,
        epoch: Epoch,
        from: NodeId,
        req: Installs,
    },
    Queue(ask::Queue),
    Members(ask::Members),
    Liveness(ask::Liveness),
    Clients(ask::Clients),
    CloseConnection(ask::CloseConnection),
    Owners(ask::Owners),
    Readings(ask::Readings),
    MetaIndex(ask::MetaIndex),
    Holds(ask::Holds),
    Meta(ask::Meta),
    /// Library-level requests from tools and tests using the link as a client.
    Client(ClientRequest),
    Fork(ask::Fork),
    History(ask::History),
    Yield(ask::Yield),
    Handback(ask::Handback),
    Bodies(ask::Bodies),
    SyncControl(ask::SyncControl),
    Elect(ask::Elect),
    Departing(ask::Departing),
    Join(ask::Join),
    Forget(ask::Forget),
    MoveMaster(ask::MoveMaster),
    /// Last, so the other requests keep their tags.
    Flows(ask::Flows),
    Reply(ask::Reply),
    Merge(ask::Merge),
}

/// Entries for a queue group or for the metadata group: each kind's log
/// holds its own commands only.
#[derive(Debug, Serialize, Deserialize)]
pub enum Appends {
    Queue(AppendEntriesRequest<QueueTypes>),
    Meta(AppendEntriesRequest<MetaTypes>),
}

/// A snapshot chunk for a queue group or for the metadata group.
#[derive(Debug, Serialize, Deserialize)]
pub enum Installs {
    Queue(InstallSnapshotRequest<QueueTypes>),
    Meta(InstallSnapshotRequest<MetaTypes>),
}

#[derive(Debug, Serialize, Deserialize)]
pub enum RpcResponse {
    Append(Result<AppendEntriesResponse<NodeId>, RaftError<NodeId>>),
    Vote(Result<VoteResponse<NodeId>, RaftError<NodeId>>),
    /// With a queue replica's standing once the last chunk is installed:
    /// the master must know the replica lacks the bodies the snapshot
    /// names before openraft counts the replica as matching it.
    Snapshot(Result<InstallSnapshotResponse<NodeId>, RaftError<NodeId, InstallSnapshotError>>, Option<Box<Standing>>),
    Queue(Result<Vec<QueueReply>, NodeError>),
    /// The reply and the log index of the change, so the caller can wait
    /// until it has applied it locally.
    Meta(Result<(MetaReply, u64), NodeError>),
    Client(Result<ClientReply, NodeError>),
    Members(Option<std::collections::BTreeSet<NodeId>>),
    Liveness(ask::Alive),
    MetaIndex(Option<u64>),
    Holds(bool),
    Clients(Vec<crate::clients::ConnectionInfo>, Vec<crate::clients::ConsumerInfo>),
    Readings(crate::alarms::Readings),
    /// The live subset of the owners asked about, and per live owner and
    /// queue the tags asked about that its holder does not know.
    Owners(Vec<u64>, Vec<(u64, String, Vec<u64>)>),
    /// The receiver does not host this group (yet): the sender retries later.
    UnknownGroup(GroupId),
    /// The receiver's replica is in a newer epoch than the sender's.
    NewerEpoch(Epoch),
    /// What the receiver's replica tells of its epoch, if it hosts one.
    Fork(Option<EpochReport>),
    History(Option<ForkRecord>),
    Bodies(Result<BodyChunk, NodeError>),
    Moved(Result<(), NodeError>),
    Member(Result<(), NodeError>),
    /// Whether the receiver had the connection asked to close.
    Closed(bool),
    Done,
    Flows(crate::rates::Flows),
    /// Whether the receiver had the direct reply-to consumer a reply was for.
    Replied(bool),
}

/// One encoded message body, as the master stores it.
#[derive(Debug, Serialize, Deserialize)]
pub struct Body {
    pub seq: u64,
    #[serde(with = "serde_bytes")]
    pub data: Vec<u8>,
}

/// The master's answer to [`RpcRequest::Bodies`].
#[derive(Debug, Serialize, Deserialize)]
pub struct BodyChunk {
    pub bodies: Vec<Body>,
    /// Where to continue; `None`: the ranges asked for are done.
    pub next: Option<u64>,
    /// The master's applied index after reading: a body it did not have was
    /// consumed at or before it, so the replica must apply that far before
    /// it may count as synchronised.
    pub applied: Option<u64>,
    pub bytes_total: Option<u64>,
}

/// Requests a client (test, tool) may send to any node.
#[derive(Debug, Serialize, Deserialize)]
pub enum ClientRequest {
    /// Declare a queue on the given replicas (empty: placed by policy).
    DeclareQueue {
        name: String,
        replicas: Vec<NodeId>,
    },
    DeleteQueue {
        name: String,
    },
    /// Queue status as this node sees it locally. `declared`: asked by a
    /// declare of the queue, which counts as a use of it (`x-expires`).
    QueueInfo {
        name: String,
        declared: bool,
    },
    /// Queue operations, forwarded by the receiving node to the master.
    QueueOp {
        queue: String,
        cmds: Vec<QueueCmd>,
    },
}

#[derive(Debug, Serialize, Deserialize)]
pub enum ClientReply {
    Declared(crate::metadata::QueueMeta),
    Deleted,
    QueueInfo(Box<crate::api::QueueInfo>),
    Queue(Vec<QueueReply>),
}
