//! A running node: its storage, its Raft groups (the metadata group and one
//! per hosted queue replica), the node link, and the library API that the
//! front ends and tests use.
//!
//! Any node serves any queue: an operation on a queue whose master is
//! elsewhere is forwarded over the node link to the master, which answers
//! after the confirm.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openraft::ServerState;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use mirrorq_storage::{DbOptions, NodeDb};

use crate::alarms::{Alarms, Watermark};
pub use crate::api::{DeclareOpts, GroupRaftMetrics, QueueInfo};
use crate::clients::Clients;
use crate::error::NodeError;
use crate::ids::{GroupId, NodeId, METADATA_GROUP};
use crate::link::transport::Transport;
use crate::metadata::MetaRaft;
use crate::metadata::MetaState;
use crate::metrics::Metrics;
use crate::owners::Owners;
use crate::queue::replicas::Replicas;
use crate::queue::QueueRaft;
use crate::queue::QueueReply;
pub use crate::timing::{Timing, DEFAULT_CONSUMER_TIMEOUT};
use crate::wire::raft_net::EpochNews;

mod forward;
mod host;
mod inbound;
mod knobs;
mod lifecycle;
mod liveness;
mod members;
mod meta_ops;
mod queue_ops;
mod reconcile;
mod refill;
mod sweeps;
#[cfg(feature = "test-hooks")]
mod test_hooks;
mod told;
mod views;

#[cfg(feature = "test-hooks")]
pub use knobs::TestKnobs;
pub use queue_ops::{stored_all, stored_count};
use sweeps::{body_fetch, deadletter};

/// Everything a node needs to start.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Unique id >= 1.
    pub node_id: NodeId,
    /// Shown in every API. Default `mirrorq@<id>`.
    pub node_name: String,
    pub data_dir: PathBuf,
    /// Where the node link listens; also the address peers dial.
    pub raft_listen: String,
    /// Initial members of a new cluster (id -> raft address). Empty: this node
    /// alone. Ignored once the data dir holds a cluster.
    pub cluster: BTreeMap<NodeId, String>,
    /// Join a running cluster through this member (raft address) instead of
    /// founding one. Ignored once the data dir holds a cluster.
    pub join: Option<String>,
    pub timing: Timing,
    /// sled page cache in bytes.
    pub cache_bytes: u64,
    /// Size at which the write-ahead log moves on to a new segment file.
    pub wal_segment_bytes: u64,
    /// Message bytes a catching-up mirror fetches per request.
    pub sync_batch_bytes: usize,
    /// Memory use above which publishers are blocked.
    pub memory_high_watermark: Watermark,
    /// Free disk below which publishers are blocked.
    pub disk_free_limit: u64,
    /// AMQP connections this node keeps open at most; 0: no limit.
    pub max_connections: usize,
    /// Proved both ways on every node-link connection (`link/auth.rs`).
    pub cluster_secret: Option<crate::link::auth::ClusterSecret>,
    /// Mutual TLS on every node-link connection (`--tls-node-link`).
    pub link_tls: Option<Arc<crate::tls::LinkTls>>,
    /// Faults and pauses of tests (`knobs.rs`).
    #[cfg(feature = "test-hooks")]
    pub test: TestKnobs,
}

impl NodeConfig {
    pub fn new(node_id: NodeId, data_dir: impl Into<PathBuf>, raft_listen: impl Into<String>) -> Self {
        Self {
            node_id,
            node_name: format!("mirrorq@{node_id}"),
            data_dir: data_dir.into(),
            raft_listen: raft_listen.into(),
            cluster: BTreeMap::new(),
            join: None,
            timing: Timing::default(),
            cache_bytes: DbOptions::default().cache_bytes,
            wal_segment_bytes: DbOptions::default().wal_segment_bytes,
            sync_batch_bytes: 1 << 20,
            memory_high_watermark: Watermark::default(),
            disk_free_limit: crate::alarms::DEFAULT_DISK_FREE_LIMIT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            cluster_secret: None,
            link_tls: None,
            #[cfg(feature = "test-hooks")]
            test: TestKnobs::default(),
        }
    }
}

/// The wait for the replies of operations started with [`Node::submit`].
pub type Submitted = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Vec<QueueReply>, NodeError>> + Send>>;

/// What a group's Raft reports, whatever kind of group it is.
type RaftMetrics = watch::Receiver<openraft::RaftMetrics<NodeId, openraft::BasicNode>>;

use crate::failover::{self, QueueGroup};

struct Inner {
    id: NodeId,
    name: String,
    addr: String,
    db: NodeDb,
    transport: Arc<Transport>,
    /// openraft's settings for queue groups (the metadata group's differ).
    queue_raft_config: Arc<openraft::Config>,
    timing: Timing,
    catch_up_bytes: usize,
    meta_raft: MetaRaft,
    meta: watch::Receiver<Arc<MetaState>>,
    /// The replicas hosted here.
    groups: Replicas<failover::Tracked>,
    /// See `NodeConfig::test`.
    #[cfg(feature = "test-hooks")]
    knobs: knobs::Knobs,
    /// Orders the standings this node's replicas give ([`confirm_gate::Standing::seq`]).
    standings: std::sync::atomic::AtomicU64,
    /// Last master seen per group, so forwarding starts at the right node.
    hints: Mutex<HashMap<GroupId, NodeId>>,
    /// AMQP clients connected here.
    clients: Arc<Clients>,
    /// Who may hold unacked messages from here, and which of them live.
    owners: Arc<Owners>,
    /// Repeating failures already logged.
    told: told::Told,
    /// Memory and disk alarms, which block publishers.
    alarms: Arc<Alarms>,
    /// What the front ends count, for `/metrics`.
    metrics: Metrics,
    /// Samples of those counters and of the queues mastered here, for
    /// the API's message rates (`rates.rs`).
    rates: crate::rates::Sampler,
    /// Peers' reports of newer epochs of our groups, for failover's task.
    news: mpsc::UnboundedSender<EpochNews>,
    /// Asks to yield a minority's fork, for failover's task.
    yields: mpsc::UnboundedSender<failover::YieldAsk>,
    /// What failover keeps node-wide (busy groups, asks for a watch run,
    /// the stop's hand-over, replicas that must not stand).
    failover: failover::Shared,
    /// Whether each peer is alive: the one owner of that fact.
    peers: crate::peers::Peers,
    /// Set once every replica the metadata named at this node's start is
    /// running. Until then its replicas report to no master: a master that
    /// counted one synchronised would wait for its acknowledgements, slow
    /// while this node starts thousands of replicas (at 10,000 queues every
    /// busy queue's confirms stalled for about a second at each return).
    replicas_started: watch::Sender<bool>,
    /// On a data dir that replaced a damaged one, until every replica here
    /// is filled: what each group's leader had committed when it was first
    /// heard (`refill.rs`). `None` on any other dir, and once filled.
    refill: Mutex<Option<refill::Targets>>,
    /// On a data dir that started empty, the last queue group id declared
    /// before it did: every group above it was declared since, so this
    /// node cannot have founded it on an earlier dir. Known (below
    /// `u64::MAX`) once its first life caught up with the metadata leader
    /// (`Node::spawn_founding_floor`), and kept; 0 on any other dir.
    founding_floor: std::sync::atomic::AtomicU64,
    /// Groups mastered here that send no heartbeats, and what peers
    /// announce of theirs.
    quiescence: crate::peers::quiet::Quiescence,
    stop: CancellationToken,
    /// Cancelled first thing in a graceful stop (and with `stop`): clients
    /// are told to leave before masterships move.
    closing: CancellationToken,
    /// Cancelled when the node must stop on its own (fail-stop: its storage
    /// failed, or its metadata group's Raft core quit), before it stops.
    failed: CancellationToken,
    /// Set once the stop has run: a second caller (the fail-stop watch and
    /// `mirrorq serve` both stop a failed node) waits for the first.
    stopped_once: tokio::sync::OnceCell<()>,
}

/// Handle to a running node. Clones share it.
#[derive(Clone)]
pub struct Node {
    inner: Arc<Inner>,
}

/// Far above what one node serves well, and below a typical descriptor
/// limit raised for a server: a flood of clients meets a clear refusal
/// rather than a node out of file descriptors.
pub const DEFAULT_MAX_CONNECTIONS: usize = 65_535;

const NODE_ID_KEY: &str = "node_id";
/// What a data dir holds is in this format (log entries, state machines):
/// a dir written in another is refused, never read as this one, whose
/// decoding could take an entry of one format for a command of the other.
const FORMAT: u32 = 4;
const FORMAT_KEY: &str = "format";
const INCARNATION_KEY: &str = "incarnation";
/// `Inner::founding_floor` of a data dir that started empty: empty while
/// not known yet, then the group id. Absent on a dir that never started
/// empty here, which founds freely: its replicas' own storage says what
/// it founded.
const FOUNDING_FLOOR_KEY: &str = "founding-floor";
/// Present on a data dir that replaced a damaged one: the node waits to be
/// refilled by the cluster it belonged to and never founds a new one, even
/// when every member's dir was damaged at once (each would otherwise start
/// a new, empty cluster and answer 404 for every queue).
const REFILL_KEY: &str = "refill";

/// A learner this close to the end of the master's log may become a voter.
const CATCH_UP_SLACK: u64 = 64;

impl Node {
    pub fn id(&self) -> NodeId {
        self.inner.id
    }
    pub fn name(&self) -> &str {
        &self.inner.name
    }
    /// The node-link address peers and clients dial.
    pub fn raft_addr(&self) -> &str {
        &self.inner.addr
    }
    pub fn db(&self) -> &NodeDb {
        &self.inner.db
    }
    /// Outbound network hooks (tests hold a peer's traffic back with them).
    pub fn transport(&self) -> &Transport {
        &self.inner.transport
    }
    pub fn metadata(&self) -> Arc<MetaState> {
        self.inner.meta.borrow().clone()
    }
    /// The metadata, announced on every applied change.
    pub fn watch_metadata(&self) -> watch::Receiver<Arc<MetaState>> {
        self.inner.meta.clone()
    }
    /// Cancelled when the node stops (shutdown or a fatal disk error).
    pub fn stopped(&self) -> CancellationToken {
        self.inner.stop.clone()
    }

    /// Cancelled when the node begins to stop, before it hands its
    /// masterships over: the AMQP front end stops accepting and closes its
    /// connections (320, as RabbitMQ does on shutdown), so no client is
    /// served by a node on its way out.
    pub fn closing(&self) -> CancellationToken {
        self.inner.closing.clone()
    }

    /// Cancelled when the node begins to stop on its own (fail-stop), before
    /// the stop: the process must then exit even if the stop never ends.
    pub fn failed(&self) -> CancellationToken {
        self.inner.failed.clone()
    }

    /// Begin closing: cancel [`Node::closing`] ([`Node::shutdown`] does it too).
    pub fn close_clients(&self) {
        self.inner.closing.cancel();
    }

    /// The local replica's Raft handle of a queue, if this node hosts one.
    pub fn queue_raft(&self, name: &str) -> Option<QueueRaft> {
        let q = self.metadata().queues.get(name)?.group;
        self.inner.groups.get(q).map(|g| g.raft.clone())
    }

    /// This node's AMQP client registry.
    /// Memory and disk alarms (`connection.blocked`).
    pub fn alarms(&self) -> &Alarms {
        &self.inner.alarms
    }

    /// Counters the front ends keep, for `/metrics`.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// Owners of deliveries made on this node.
    pub fn owners(&self) -> &Arc<Owners> {
        &self.inner.owners
    }

    pub fn clients(&self) -> &Arc<Clients> {
        &self.inner.clients
    }

    /// How long an AMQP delivery may stay unacked where its queue sets no
    /// limit of its own (`--consumer-timeout`); `None`: no limit.
    pub fn consumer_timeout(&self) -> Option<Duration> {
        self.inner.timing.consumer_timeout
    }
}

impl Inner {
    /// `what` failed again for `group` with `text`: counted; true if it is
    /// news (first time, or another text), which the caller logs.
    fn repeated(&self, group: GroupId, what: &'static str, text: &str) -> bool {
        self.metrics.repeated_failures.inc();
        self.told.first(group, what, text)
    }

    /// Delete this node's replica of a group (it left the group or the
    /// queue was deleted).
    fn drop_replica(&self, group: GroupId) -> Result<(), mirrorq_storage::StorageError> {
        self.db.drop_group(group)?;
        failover::forget(&self.db, group)?;
        self.db.remove_node_value(&body_fetch::new_mirror_key(group))
    }

    /// Take `g` out of the hosted groups so its holder can stop it, if it
    /// is still the replica hosted: a caller whose view is older (a failure
    /// watch that listed the groups before another task re-formed or
    /// rejoined one) gets `false` and must leave the group alone. Taking
    /// out the newer replica would leave it running unseen, writing to the
    /// log that the caller then rewrites.
    fn take_out(&self, g: &Arc<QueueGroup>) -> bool {
        // Its followers must not stay held by a master no longer here: the
        // watch that would withdraw it looks only at the hosted groups.
        self.groups.take_out(g, || {
            self.quiescence.withdraw(g.meta.group);
        })
    }

    /// What the Raft of `group` here reports, whatever kind of group it is.
    fn metrics_of(&self, group: GroupId) -> Option<RaftMetrics> {
        if group == METADATA_GROUP {
            return Some(self.meta_raft.metrics());
        }
        self.groups.get(group).map(|g| g.raft.metrics())
    }
}

impl Node {
    /// Is this node the master of the queue right now?
    pub fn is_master(&self, queue: &str) -> bool {
        self.queue_raft(queue).map(|r| r.metrics().borrow().state == ServerState::Leader).unwrap_or(false)
    }
}
