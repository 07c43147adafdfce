//! The requests a node asks a peer, each paired once with the one kind of
//! answer it expects ([`Ask`]): a caller writes `ask(peer, Holds { group })`
//! and gets a `bool`, or the answer of another kind to look at (a replica
//! in a newer epoch, a group not hosted yet).
//!
//! Raft's own messages are not here: openraft's network speaks them
//! (`raft_net`).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use super::{BodyChunk, ClientReply, ClientRequest, QuietList, RpcRequest, RpcResponse};
use crate::error::NodeError;
use crate::ids::{GroupId, NodeId};
use crate::link::transport::CallError;
use crate::metadata::{MetaCmd, MetaReply};
use crate::queue::confirm_gate::Standing;
use crate::queue::epoch::{Epoch, EpochReport, ForkRecord};
use crate::queue::proposer::Lane;
use crate::queue::types::Origin;
use crate::queue::{Holdings, Message, QueueCmd, QueueReply};

/// A request and the answer it expects.
pub trait Ask: Into<RpcRequest> {
    type Reply;
    /// The expected answer, or the answer back if it is of another kind.
    fn reply(answer: RpcResponse) -> Result<Self::Reply, RpcResponse>;
}

/// Why a peer asked gave no answer of the kind the request expects.
#[derive(Debug, thiserror::Error)]
pub enum AskError {
    #[error(transparent)]
    Call(#[from] CallError),
    /// An answer of another kind: a replica in a newer epoch, a group not
    /// hosted yet, or a peer that does not speak this request.
    #[error("unexpected reply {0:?}")]
    Other(Box<RpcResponse>),
}

/// The answer `A` expects, or [`AskError::Other`] with the one that came.
pub fn typed<A: Ask>(answer: RpcResponse) -> Result<A::Reply, AskError> {
    A::reply(answer).map_err(|other| AskError::Other(Box::new(other)))
}

impl From<AskError> for NodeError {
    fn from(e: AskError) -> Self {
        match e {
            AskError::Call(e) => NodeError::Unavailable(e.to_string()),
            other @ AskError::Other(_) => NodeError::Invalid(other.to_string()),
        }
    }
}

/// Queue operations for the master of `group`; answered after confirm.
/// A receiver that does not host the group (yet) answers `NotLeader`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Queue {
    pub group: GroupId,
    /// The epoch of the sender's replica of the group, if it hosts one:
    /// only a replica of that epoch runs the operations. Delivery tags and
    /// message numbers mean something in one epoch only, and an ack run by
    /// a minority's fork about to yield is lost to the group that goes on.
    pub epoch: Option<Epoch>,
    pub cmds: Vec<QueueCmd>,
    /// Where they wait at the master (consumers' gets and settlements go
    /// ahead of queued publishes).
    pub lane: Lane,
}

/// The members (voters and learners) of `group` as the receiver's replica
/// sees them; `None` if it hosts none, or (with `epoch`) none of that
/// epoch. A replica moved away asks this to learn that the membership
/// change excluding it is in effect: only a replica of its own epoch can
/// say so (a minority's fork has a membership of its own).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Members {
    pub group: GroupId,
    pub epoch: Option<Epoch>,
}

/// A liveness ping from node `from`, which holds the receiver's list of
/// quietly led groups at `have` (incarnation, generation): the answer
/// carries the list only if it changed since. `mine`: the sender's own
/// list, when the receiver has not yet said it holds its latest.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Liveness {
    pub from: NodeId,
    pub have: Option<(u64, u64)>,
    pub mine: Option<QuietList>,
}

/// The answer to [`Liveness`].
pub use crate::peers::quiet::Alive;

/// This node's AMQP connections and consumers (for the API's listings).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Clients;

/// Close this node's AMQP connection `id`, telling its client `reason`
/// (the management API's `DELETE /api/connections/{name}`); answered with
/// whether the receiver had it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CloseConnection {
    pub id: u64,
    pub reason: String,
}

/// Which of these owners of unacked messages (made on the receiver,
/// `owners.rs`) are still alive: a master gives back the messages of the
/// others.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Owners {
    pub owners: Vec<u64>,
    /// Per owner, a queue and the tags of it recorded as delivered to that
    /// owner: the answer names those its holder never got.
    pub held: Vec<(u64, String, Vec<u64>)>,
}

/// This node's memory and disk readings (for `/api/nodes`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Readings;

/// The metadata leader's last applied index: a node that waits until it
/// has applied as far reads its own writes made through other nodes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MetaIndex;

/// Whether the receiver's storage holds anything of `group` (a vote, a log
/// entry), started or not: a founder back on an empty data dir asks before
/// it founds a group again.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Holds {
    pub group: GroupId,
}

/// A metadata change for the metadata leader; answered with the reply and
/// the log index of the change, so the caller can wait until it has
/// applied it locally.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Meta {
    pub cmd: MetaCmd,
}

/// The fork record of the receiver's epoch of `group` (a stale replica asks
/// before healing).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Fork {
    pub group: GroupId,
}

/// The receiver's replica's log as a record of its history (the leader ids
/// of its entries): a replica whose fork yields finds with it what the
/// winning epoch already has.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct History {
    pub group: GroupId,
}

/// The receiver's replica is in `defeated`, an epoch formed by a minority
/// while the group `winner` kept its majority and kept going: it must hand
/// back what it holds to `winner`'s master and rejoin it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Yield {
    pub group: GroupId,
    pub defeated: Epoch,
    pub winner: Epoch,
    pub from: NodeId,
}

/// Messages a stale replica hands back, for the master of `epoch`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Handback {
    pub group: GroupId,
    pub epoch: Epoch,
    pub batches: Vec<HandbackBatch>,
}

/// Messages handed back together: the old-epoch entry that published
/// them, if known, and each message with its own key, if known
/// (`QueueCmd::HandbackKeyed`).
pub type HandbackBatch = (Option<Origin>, Vec<(Option<Origin>, Message)>);

/// What a replica rejoining the epoch `epoch` holds of the messages the
/// two epochs share, for that epoch's master to drop the rest
/// (`QueueCmd::Merge`); answered as a [`Handback`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Merge {
    pub group: GroupId,
    pub epoch: Epoch,
    pub holdings: Holdings,
}

/// The answer to a [`Handback`].
#[derive(Debug)]
pub enum Handed {
    /// The receiver's master took the messages, or could not.
    Answered(Result<Vec<QueueReply>, NodeError>),
    /// The receiver's replica is in a newer epoch still.
    NewerEpoch(Epoch),
}

/// A replica catching up after a snapshot asks the master of `group` for
/// message bodies in `ranges` (about `max_bytes` of them; none: a report
/// only) and tells how its bodies stand. `totals`: also count the bytes
/// still to fetch.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Bodies {
    pub group: GroupId,
    pub from: NodeId,
    pub standing: Standing,
    pub ranges: Vec<(u64, u64)>,
    pub max_bytes: u32,
    pub totals: bool,
}

/// Start (`run`) or stop fetching missing bodies: the `sync` and
/// `cancel_sync` actions, sent to every replica of the queue.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SyncControl {
    pub group: GroupId,
    pub run: bool,
}

/// A master handing over (stopping, or a rebalance) asks its successor to
/// stand for election now.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Elect {
    pub group: GroupId,
    /// The master handing over.
    pub from: NodeId,
    /// It is stopping: confirms need not wait for it.
    pub leaving: bool,
}

/// A node that is stopping tells each peer before it moves its
/// masterships: confirms stop waiting for its replicas, and groups settle
/// without them.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Departing {
    pub from: NodeId,
    /// The life it stops (a late notice must not mark the next one).
    pub incarnation: u64,
}

/// A node asks to join the cluster (sent to any member; answered by the
/// metadata leader once the node is a voter of the metadata group and
/// registered).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Join {
    pub info: crate::metadata::NodeInfo,
}

/// Remove a stopped node from the cluster (for the metadata leader).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Forget {
    pub id: NodeId,
}

/// Hand mastership of `group` over to `to` (a rebalance), answered once
/// `to` leads or the move failed.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MoveMaster {
    pub group: GroupId,
    pub to: NodeId,
}

/// This node's message counters and their window (the overview's
/// `message_stats`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Flows;

/// A reply for a direct reply-to consumer on the receiver
/// (`amq.rabbitmq.reply-to`), which the receiver's name for it (`to`)
/// names; answered with whether the consumer was there.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Reply {
    pub to: String,
    pub message: Message,
}

/// Pairs each request with its variant of [`RpcRequest`] and its answer.
macro_rules! asks {
    ($($req:ident => $reply:ty { $($answer:pat => $out:expr),+ })*) => {$(
        impl From<$req> for RpcRequest {
            fn from(req: $req) -> Self {
                RpcRequest::$req(req)
            }
        }
        impl Ask for $req {
            type Reply = $reply;
            fn reply(answer: RpcResponse) -> Result<$reply, RpcResponse> {
                match answer {
                    $($answer => Ok($out),)+
                    other => Err(other),
                }
            }
        }
    )*};
}

asks! {
    Queue => Result<Vec<QueueReply>, NodeError> { RpcResponse::Queue(r) => r }
    Members => Option<BTreeSet<NodeId>> { RpcResponse::Members(m) => m }
    Liveness => Alive { RpcResponse::Liveness(a) => a }
    Clients => (Vec<crate::clients::ConnectionInfo>, Vec<crate::clients::ConsumerInfo>) {
        RpcResponse::Clients(c, k) => (c, k)
    }
    CloseConnection => bool { RpcResponse::Closed(had) => had }
    Owners => (Vec<u64>, Vec<(u64, String, Vec<u64>)>) { RpcResponse::Owners(live, unknown) => (live, unknown) }
    Readings => crate::alarms::Readings { RpcResponse::Readings(r) => r }
    MetaIndex => Option<u64> { RpcResponse::MetaIndex(i) => i }
    Holds => bool { RpcResponse::Holds(held) => held }
    Meta => Result<(MetaReply, u64), NodeError> { RpcResponse::Meta(r) => r }
    Fork => Option<EpochReport> { RpcResponse::Fork(r) => r }
    History => Option<ForkRecord> { RpcResponse::History(r) => r }
    Yield => () { RpcResponse::Done => () }
    Handback => Handed {
        RpcResponse::Queue(r) => Handed::Answered(r),
        RpcResponse::NewerEpoch(epoch) => Handed::NewerEpoch(epoch)
    }
    Merge => Handed {
        RpcResponse::Queue(r) => Handed::Answered(r),
        RpcResponse::NewerEpoch(epoch) => Handed::NewerEpoch(epoch)
    }
    Bodies => Result<BodyChunk, NodeError> { RpcResponse::Bodies(r) => r }
    SyncControl => () { RpcResponse::Done => () }
    Elect => () { RpcResponse::Done => () }
    Departing => () { RpcResponse::Done => () }
    Join => Result<(), NodeError> { RpcResponse::Member(r) => r }
    Forget => Result<(), NodeError> { RpcResponse::Member(r) => r }
    MoveMaster => Result<(), NodeError> { RpcResponse::Moved(r) => r }
    Flows => crate::rates::Flows { RpcResponse::Flows(f) => f }
    Reply => bool { RpcResponse::Replied(took) => took }
}

impl From<ClientRequest> for RpcRequest {
    fn from(req: ClientRequest) -> Self {
        RpcRequest::Client(req)
    }
}

impl Ask for ClientRequest {
    type Reply = Result<ClientReply, NodeError>;
    fn reply(answer: RpcResponse) -> Result<Self::Reply, RpcResponse> {
        match answer {
            RpcResponse::Client(r) => Ok(r),
            other => Err(other),
        }
    }
}
