//! Value types of the library API (`node::Node`) that also travel on the
//! node link: what a caller declares with and what it is told about a queue.

use serde::{Deserialize, Serialize};

use crate::ids::{GroupId, NodeId};
use crate::queue::catchup::SyncProgress;
use crate::queue::epoch::Epoch;

/// Options of `Node::declare_queue_with`.
#[derive(Debug, Clone, Default)]
pub struct DeclareOpts {
    /// `x-queue-master-locator`: `Some(true)` min-masters, `Some(false)` client-local.
    pub min_masters: Option<bool>,
    /// The AMQP connection owning an exclusive queue.
    pub exclusive_owner: Option<u64>,
    /// Delete the queue when its last consumer goes away.
    pub auto_delete: bool,
    /// Declared not durable. Shown as declared; the queue is kept on disk
    /// and across restarts all the same (mirrorq never drops messages a
    /// restart could keep).
    pub transient: bool,
    /// Validated declare arguments (TTL, max length, dead-lettering).
    pub args: crate::metadata::QueueArgs,
}

/// One hosted replica's Raft figures.
#[derive(Debug, Clone)]
pub struct GroupRaftMetrics {
    pub queue: String,
    pub term: u64,
    /// Last log index applied here (committed, as far as this replica knows).
    pub committed: Option<u64>,
    pub leader: Option<NodeId>,
    /// The incarnation of the group this replica is in: after a split,
    /// replicas of one queue in different epochs have not healed yet.
    pub epoch: Epoch,
}

/// A queue as this node sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueInfo {
    pub name: String,
    pub group: GroupId,
    pub replicas: Vec<NodeId>,
    /// Is this node a replica?
    pub local: bool,
    /// Master as known locally (replicas only).
    pub leader: Option<NodeId>,
    pub ready: u64,
    pub unacked: u64,
    /// Last log index applied locally.
    pub applied: Option<u64>,
    /// This node is the master and has applied an entry of its own term, so
    /// its counts include all its predecessor committed (a master just
    /// elected may not have applied its predecessor's last entries yet).
    #[serde(default)]
    pub settled: bool,
    /// Synchronised voters (only when this node is the master): members
    /// with every confirmed message that count in the group's majority. A
    /// learner caught up is not listed until it is a voter.
    pub synchronised: Vec<NodeId>,
    /// Members still fetching message bodies, as they last reported (only
    /// when this node is the master).
    #[serde(default)]
    pub catching_up: Vec<(NodeId, SyncProgress)>,
    /// Messages published, delivered and acked, with the start of the
    /// window their rates span (only when this node is the master: the
    /// samples are taken there).
    #[serde(default)]
    pub flows: Option<crate::rates::Flows>,
    /// The single active consumer, as `(owner, number)` (a queue with
    /// `x-single-active-consumer`; as its replica here has applied).
    #[serde(default)]
    pub active_consumer: Option<(u64, u64)>,
}
