//! What nodes say to each other over the node link (`crate::link`, which
//! carries it without knowing it): Raft's messages stamped with their group
//! and epoch, forwarded queue and metadata operations, liveness pings, and
//! the questions behind the API's cluster-wide views. Also openraft's
//! network in these words (`raft_net`) and a client for tools and tests
//! (`client`).

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
use crate::metadata::{MetaCmd, MetaReply};
use crate::queue::confirm_gate::Standing;
use crate::queue::epoch::{Epoch, EpochReport, ForkRecord};
use crate::queue::proposer::Lane;
use crate::queue::{QueueCmd, QueueReply};
use crate::raft::types::TypeConfig;

/// A node's list of the groups it leads quietly, (group, term), at a
/// generation of one life of the node.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct QuietList {
    pub incarnation: u64,
    pub gen: u64,
    pub groups: Vec<(GroupId, u64)>,
    /// The node is refilling a data dir set aside as damaged: its replicas
    /// hold less than their masters counted them to, and wait for appends.
    pub refilling: bool,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum RpcRequest {
    Append {
        group: GroupId,
        epoch: Epoch,
        from: NodeId,
        req: AppendEntriesRequest<TypeConfig>,
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
        req: InstallSnapshotRequest<TypeConfig>,
    },
    /// Queue operations for the master of `group`; answered after confirm.
    /// A receiver that does not host the group (yet) answers `NotLeader`.
    Queue {
        group: GroupId,
        cmds: Vec<QueueCmd>,
        /// Where they wait at the master (consumers' gets and settlements
        /// go ahead of queued publishes).
        lane: Lane,
    },
    /// The members (voters and learners) of `group` as the receiver's replica
    /// sees them; `None` if it hosts none, or (with `epoch`) none of that
    /// epoch. A replica moved away asks this to learn that the membership
    /// change excluding it is in effect: only a replica of its own epoch
    /// can say so (a minority's fork has a membership of its own).
    Members {
        group: GroupId,
        epoch: Option<crate::queue::epoch::Epoch>,
    },
    /// A liveness ping from node `from`, which holds the receiver's list of
    /// quietly led groups at `have` (incarnation, generation): the answer
    /// carries the list only if it changed since. `mine`: the sender's own
    /// list, when the receiver has not yet said it holds its latest.
    Liveness {
        from: NodeId,
        have: Option<(u64, u64)>,
        mine: Option<QuietList>,
    },
    /// This node's AMQP connections and consumers (for the API's listings).
    Clients,
    /// Close this node's AMQP connection `id`, telling its client `reason`
    /// (the management API's `DELETE /api/connections/{name}`).
    CloseConnection {
        id: u64,
        reason: String,
    },
    /// Which of these owners of unacked messages (made on the receiver,
    /// `owners.rs`) are still alive: a master gives back the messages of
    /// the others.
    Owners {
        owners: Vec<u64>,
        /// Per owner, a queue and the tags of it recorded as delivered to
        /// that owner: the answer names those its holder never got.
        held: Vec<(u64, String, Vec<u64>)>,
    },
    /// This node's memory and disk readings (for `/api/nodes`).
    Readings,
    /// The metadata leader's last applied index: a node that waits until it
    /// has applied as far reads its own writes made through other nodes.
    MetaIndex,
    /// Whether the receiver's storage holds anything of `group` (a vote, a
    /// log entry), started or not: a founder back on an empty data dir
    /// asks before it founds a group again.
    Holds {
        group: GroupId,
    },
    /// A metadata change for the metadata leader.
    Meta {
        cmd: MetaCmd,
    },
    /// Library-level requests from tools and tests using the link as a client.
    Client(ClientRequest),
    /// The fork record of the receiver's epoch of `group` (a stale replica
    /// asks before healing).
    Fork {
        group: GroupId,
    },
    /// The receiver's replica's log as a record of its history (the leader
    /// ids of its entries): a replica whose fork yields finds with it what
    /// the winning epoch already has.
    History {
        group: GroupId,
    },
    /// The receiver's replica is in `defeated`, an epoch formed by a
    /// minority while the group `winner` kept its majority and kept going:
    /// it must hand back what it holds to `winner`'s master and rejoin it.
    Yield {
        group: GroupId,
        defeated: Epoch,
        winner: Epoch,
        from: NodeId,
    },
    /// Messages a stale replica hands back, for the master of `epoch`.
    Handback {
        group: GroupId,
        epoch: Epoch,
        batches: Vec<(Option<crate::queue::types::Origin>, Vec<crate::queue::Message>)>,
    },
    /// A replica catching up after a snapshot asks the master of `group`
    /// for message bodies in `ranges` (about `max_bytes` of them; none: a
    /// report only) and tells how its bodies stand. `totals`: also count
    /// the bytes still to fetch.
    Bodies {
        group: GroupId,
        from: NodeId,
        standing: Standing,
        ranges: Vec<(u64, u64)>,
        max_bytes: u32,
        totals: bool,
    },
    /// Start (`run`) or stop fetching missing bodies: the `sync` and
    /// `cancel_sync` actions, sent to every replica of the queue.
    SyncControl {
        group: GroupId,
        run: bool,
    },
    /// A master handing over (stopping, or a rebalance) asks its successor
    /// to stand for election now.
    Elect {
        group: GroupId,
        /// The master handing over.
        from: NodeId,
        /// It is stopping: confirms need not wait for it.
        leaving: bool,
    },
    /// A node that is stopping tells each peer before it moves its
    /// masterships: confirms stop waiting for its replicas, and groups
    /// settle without them.
    Departing {
        from: NodeId,
        /// The life it stops (a late notice must not mark the next one).
        incarnation: u64,
    },
    /// A node asks to join the cluster (sent to any member; answered by the
    /// metadata leader once the node is a voter of the metadata group and
    /// registered).
    Join {
        info: crate::metadata::NodeInfo,
    },
    /// Remove a stopped node from the cluster (for the metadata leader).
    Forget {
        id: NodeId,
    },
    /// Hand mastership of `group` over to `to` (a rebalance), answered once
    /// `to` leads or the move failed.
    MoveMaster {
        group: GroupId,
        to: NodeId,
    },
    /// This node's message counters and their window (the overview's
    /// `message_stats`). Last, so the other requests keep their tags.
    Flows,
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
    /// The receiver's incarnation and the generation of its list of quietly
    /// led groups; the list (group, term) unless the asker has it.
    Liveness {
        incarnation: u64,
        gen: u64,
        groups: Option<Vec<(GroupId, u64)>>,
        /// As in [`QuietList`].
        refilling: bool,
    },
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
