//! A running node: its storage, its Raft groups (the metadata group and one
//! per hosted queue replica), the node link, and the library API that the
//! front ends and tests use.
//!
//! Any node serves any queue: an operation on a queue whose master is
//! elsewhere is forwarded over the node link to the master, which answers
//! after the confirm.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use openraft::error::{ClientWriteError, RaftError};
use openraft::{BasicNode, ChangeMembers, ServerState};
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use mirrorq_storage::{DbOptions, NodeDb, SmSpace};

use crate::alarms::{Alarms, Watermark};
pub use crate::api::{DeclareOpts, GroupRaftMetrics, QueueInfo};
use crate::clients::{Clients, ConnectionInfo, ConsumerInfo};
use crate::error::{NodeError, ServerError};
use crate::ids::{GroupId, NodeId, METADATA_GROUP};
use crate::link::rpc::{ClientReply, ClientRequest, RpcRequest, RpcResponse};
use crate::link::server::{self, RpcHandler};
use crate::link::transport::{CallError, Transport};
use crate::metadata::{
    routing, Args, Binding, ExchangeMeta, MetaCmd, MetaMachine, MetaReply, MetaState, NodeInfo, Policy, QueueMeta,
};
use crate::metrics::Metrics;
use crate::owners::Owners;
use crate::queue::catchup::Plan;
use crate::queue::epoch::Epoch;
use crate::queue::proposer::{Answer, Lane, Proposer};
use crate::queue::sync::{self, SyncState};
use crate::queue::{Delivery, Message, QueueCmd, QueueMachine, QueueReply, QueueStats};
use crate::raft::network::{EpochNews, NetworkFactory};
use crate::raft::state_machine::StateMachine;
use crate::raft::types::{LogStore, Raft, Request, Response};

mod catchup;
mod compaction;
mod deadletter;
mod failover;
mod members;
mod reaper;
mod rebalance;
mod split;
mod told;

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
    /// Keep a copy of sled's file as of its last sync, so that
    /// [`Node::crash`] loses what a power cut would (tests only).
    #[doc(hidden)]
    pub crash_image: bool,
}

/// Time limits. Defaults suit a loaded 2-core machine running three nodes.
#[derive(Debug, Clone)]
pub struct Timing {
    pub heartbeat: Duration,
    pub election_min: Duration,
    pub election_max: Duration,
    /// A replica that has not caught up with where the master was this long
    /// ago stops counting as synchronised (confirms stop waiting for it).
    pub sync_timeout: Duration,
    /// How long an operation may look for a reachable master.
    pub op_timeout: Duration,
    /// How long a queue's replicas may be without a reachable majority of
    /// their group before the most senior one left re-forms it
    /// (`ha-promote-on-failure: always`).
    pub failure_timeout: Duration,
}

impl Default for Timing {
    fn default() -> Self {
        Self {
            heartbeat: Duration::from_millis(250),
            election_min: Duration::from_millis(1000),
            election_max: Duration::from_millis(2000),
            sync_timeout: Duration::from_secs(5),
            op_timeout: Duration::from_secs(15),
            failure_timeout: Duration::from_secs(5),
        }
    }
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
            crash_image: false,
        }
    }
}

/// The wait for the replies of operations started with [`Node::submit`].
pub type Submitted = std::pin::Pin<Box<dyn std::future::Future<Output = Result<Vec<QueueReply>, NodeError>> + Send>>;

/// One hosted queue replica.
struct QueueGroup {
    meta: QueueMeta,
    /// The epoch this replica is in; fixed for the life of this Raft instance
    /// (re-forming and healing restart the group).
    epoch: Epoch,
    /// Last time a majority of the group's voters answered pings.
    majority_seen: Mutex<Instant>,
    /// Since when (wall clock, ms) a majority has been in reach without a
    /// break as long as the failure timeout: a group that kept its
    /// majority from before a minority re-formed it keeps the queue.
    majority_since: Mutex<Option<u64>>,
    /// When a master of this replica's epoch last sent it entries or a
    /// heartbeat.
    master_heard: Mutex<Option<Instant>>,
    /// Since when this replica has known no master.
    leaderless_since: Mutex<Option<Instant>>,
    /// Since when the master this replica follows has not answered pings.
    master_lost_since: Mutex<Option<Instant>>,
    /// An election is timed to start when the lost master's lease is out.
    elect_timed: AtomicBool,
    raft: Raft,
    /// A membership change towards the metadata's replicas is under way.
    changing: AtomicBool,
    proposer: Proposer,
    sync: watch::Receiver<SyncState>,
    stats: watch::Receiver<QueueStats>,
    sm: StateMachine<QueueMachine>,
    /// Bodies this replica still lacks (`None`: it has them all).
    plan: watch::Receiver<Option<Plan>>,
    /// A `sync` action asked this replica to fetch what it lacks.
    sync_run: watch::Sender<bool>,
    /// As master: members fetching bodies, by their reports.
    catching: sync::CatchingUp,
    stop: CancellationToken,
}

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
    meta_raft: Raft,
    meta: watch::Receiver<Arc<MetaState>>,
    groups: RwLock<HashMap<GroupId, Arc<QueueGroup>>>,
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
    /// Peers' reports of newer epochs of our groups.
    news: mpsc::UnboundedSender<EpochNews>,
    /// Groups being re-formed or healed: not (re)started meanwhile.
    busy: Mutex<HashSet<GroupId>>,
    /// Peers that answered the last round of pings, and when it ran.
    reach: Mutex<Option<(Instant, BTreeSet<NodeId>)>>,
    /// When each peer last answered a ping (the start of that round).
    seen: Mutex<HashMap<NodeId, Instant>>,
    /// Peers known down (the complement of `reach`, plus masters that
    /// announced their stop): confirms do not wait for them at a new term.
    down: sync::Down,
    /// Set once a graceful stop starts handing masterships over: no replica
    /// here stands for election any more.
    leaving: AtomicBool,
    /// Groups whose replica here must not stand for election until then
    /// (it just handed mastership over in a rebalance).
    quiet: Mutex<HashMap<GroupId, Instant>>,
    stop: CancellationToken,
    /// Cancelled first thing in a graceful stop (and with `stop`): clients
    /// are told to leave before masterships move.
    closing: CancellationToken,
}

/// Handle to a running node. Clones share it.
#[derive(Clone)]
pub struct Node {
    inner: Arc<Inner>,
}

const NODE_ID_KEY: &str = "node_id";
const INCARNATION_KEY: &str = "incarnation";

/// A learner this close to the end of the master's log may become a voter.
const CATCH_UP_SLACK: u64 = 64;

impl Node {
    /// Open the data dir, start every group it holds, listen on the node link
    /// and (for a new cluster) bootstrap the metadata group.
    pub async fn start(cfg: NodeConfig) -> Result<Node, ServerError> {
        Self::start_with(cfg, None).await
    }

    /// [`Node::start`] on an already bound node-link listener (tests bind
    /// every node's port first, so no other process can take it meanwhile).
    pub async fn start_with_listener(cfg: NodeConfig, listener: std::net::TcpListener) -> Result<Node, ServerError> {
        Self::start_with(cfg, Some(listener)).await
    }

    async fn start_with(cfg: NodeConfig, bound: Option<std::net::TcpListener>) -> Result<Node, ServerError> {
        if cfg.node_id == 0 {
            return Err(ServerError::Config("--node-id must be >= 1".into()));
        }
        let started = Instant::now();
        let db = NodeDb::open(
            &cfg.data_dir,
            &DbOptions { cache_bytes: cfg.cache_bytes, wal_segment_bytes: cfg.wal_segment_bytes },
        )?;
        tracing::info!(elapsed_ms = started.elapsed().as_millis() as u64, "storage opened");
        if cfg.crash_image {
            db.keep_crash_image().map_err(|e| ServerError::Config(format!("crash image: {e}")))?;
        }
        match db.get_node_value(NODE_ID_KEY)? {
            Some(b) => {
                let found = u64::from_be_bytes(b.as_slice().try_into().unwrap_or([0; 8]));
                if found != cfg.node_id {
                    return Err(ServerError::WrongNode { path: cfg.data_dir.clone(), found, configured: cfg.node_id });
                }
            }
            None => db.put_node_value(NODE_ID_KEY, &cfg.node_id.to_be_bytes())?,
        }

        // A new life: owners of unacked messages made before are dead.
        let incarnation = match db.get_node_value(INCARNATION_KEY)? {
            Some(b) => u64::from_be_bytes(b.as_slice().try_into().unwrap_or([0; 8])).wrapping_add(1),
            None => 1,
        };
        db.put_node_value(INCARNATION_KEY, &incarnation.to_be_bytes())?;

        let listen_err = |source| ServerError::Listen { addr: cfg.raft_listen.clone(), source };
        let listener = match bound {
            Some(l) => {
                l.set_nonblocking(true).map_err(listen_err)?;
                TcpListener::from_std(l).map_err(listen_err)?
            }
            None => TcpListener::bind(&cfg.raft_listen).await.map_err(listen_err)?,
        };
        let addr = listener
            .local_addr()
            .map_err(|source| ServerError::Listen { addr: cfg.raft_listen.clone(), source })?
            .to_string();

        let t = &cfg.timing;
        let raft_config = openraft::Config {
            cluster_name: "mirrorq".into(),
            heartbeat_interval: t.heartbeat.as_millis() as u64,
            election_timeout_min: t.election_min.as_millis() as u64,
            election_timeout_max: t.election_max.as_millis() as u64,
            install_snapshot_timeout: 10_000,
            max_payload_entries: 64,
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(crate::raft::state_machine::SNAPSHOT_EVERY),
            max_in_snapshot_log_to_keep: 256,
            ..Default::default()
        }
        .validate()
        .map_err(|e| ServerError::Config(e.to_string()))?;
        // A queue's mirrors learn a commit index with the next entry (or the
        // next heartbeat) instead of in a round trip of its own: a confirm
        // waits for every replica's append, never for a mirror's apply, and
        // at one message in flight that extra round trip held the next
        // entry back (openraft sends one AppendEntries at a time per mirror).
        // The metadata group keeps telling commits at once: every node
        // routes from its own applied copy of the metadata.
        let queue_raft_config = Arc::new(openraft::Config { commit_rides_on_next_append: true, ..raft_config.clone() });
        let raft_config = Arc::new(raft_config);
        let transport = Arc::new(Transport::new());
        let (news, news_rx) = mpsc::unbounded_channel();

        let meta_sm = StateMachine::<MetaMachine>::open(SmSpace::new(db.clone(), METADATA_GROUP), cfg.node_id)?;
        let meta = meta_sm.with(|m| m.subscribe()).await;
        let meta_raft = Raft::new(
            cfg.node_id,
            raft_config.clone(),
            NetworkFactory {
                group: METADATA_GROUP,
                epoch: Epoch::default(),
                me: cfg.node_id,
                news: news.clone(),
                transport: transport.clone(),
            },
            LogStore::new(db.clone(), METADATA_GROUP),
            meta_sm.clone(),
        )
        .await
        .map_err(|e| ServerError::Raft(e.to_string()))?;
        meta_sm.enable_snapshot_transfer();

        let stop = CancellationToken::new();
        let inner = Arc::new(Inner {
            id: cfg.node_id,
            name: cfg.node_name.clone(),
            addr: addr.clone(),
            db: db.clone(),
            transport,
            queue_raft_config,
            timing: cfg.timing.clone(),
            catch_up_bytes: cfg.sync_batch_bytes.max(1),
            meta_raft: meta_raft.clone(),
            meta,
            groups: RwLock::new(HashMap::new()),
            hints: Mutex::new(HashMap::new()),
            clients: Arc::default(),
            owners: Arc::new(Owners::new(cfg.node_id, incarnation)),
            told: told::Told::default(),
            alarms: Arc::new(Alarms::new(&cfg.data_dir, cfg.memory_high_watermark, cfg.disk_free_limit)),
            metrics: Metrics::default(),
            news,
            busy: Mutex::default(),
            reach: Mutex::default(),
            seen: Mutex::default(),
            down: sync::Down::default(),
            leaving: AtomicBool::new(false),
            quiet: Mutex::default(),
            closing: stop.child_token(),
            stop,
        });

        tokio::spawn(server::serve(listener, inner.clone(), inner.stop.clone()));
        inner.alarms.clone().spawn(inner.stop.clone());

        let pristine = !meta_raft.is_initialized().await.map_err(|e| ServerError::Raft(e.to_string()))?;
        let joining = pristine && cfg.join.is_some();
        if pristine && !joining {
            let mut members: BTreeMap<NodeId, BasicNode> =
                cfg.cluster.iter().map(|(id, a)| (*id, BasicNode { addr: a.clone() })).collect();
            if members.is_empty() {
                members.insert(cfg.node_id, BasicNode { addr: addr.clone() });
            }
            if !members.contains_key(&cfg.node_id) {
                return Err(ServerError::Config(format!("--cluster does not list this node ({})", cfg.node_id)));
            }
            // Every node of a new cluster does this with the same list, which
            // openraft allows: they hold one election among themselves.
            if let Err(e) = meta_raft.initialize(members).await {
                tracing::info!(error = %e, "metadata group already initialized");
            }
        }

        let node = Node { inner };
        if let (true, Some(via)) = (joining, cfg.join.clone()) {
            node.spawn_join(via);
        }
        node.spawn_reconciler();
        node.spawn_epoch_watch(news_rx);
        node.spawn_registration();
        node.spawn_fatal_watch();
        node.spawn_log_compactor();
        node.spawn_reaper();
        tracing::info!(
            id = cfg.node_id,
            %addr,
            data_dir = %cfg.data_dir.display(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "node started"
        );
        Ok(node)
    }

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
    pub fn metadata_raft(&self) -> &Raft {
        &self.inner.meta_raft
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

    /// Begin closing: cancel [`Node::closing`] ([`Node::shutdown`] does it too).
    pub fn close_clients(&self) {
        self.inner.closing.cancel();
    }

    /// The local replica's Raft handle of a queue, if this node hosts one.
    pub fn queue_raft(&self, name: &str) -> Option<Raft> {
        let q = self.metadata().queues.get(name)?.group;
        self.inner.groups.read().expect("poisoned").get(&q).map(|g| g.raft.clone())
    }

    /// Declare a queue replicated on `replicas` (the first is the initial
    /// master), or, with `replicas` empty, placed by the effective policy as
    /// RabbitMQ would (no policy: one replica, here). Returns when its group
    /// has a master and answers.
    pub async fn declare_queue(&self, name: &str, replicas: Vec<NodeId>) -> Result<QueueMeta, NodeError> {
        self.declare_queue_reporting(name, replicas).await.map(|(q, _)| q)
    }

    /// [`Node::declare_queue`], also telling whether this call created it.
    pub async fn declare_queue_reporting(
        &self,
        name: &str,
        replicas: Vec<NodeId>,
    ) -> Result<(QueueMeta, bool), NodeError> {
        self.declare_queue_with(name, replicas, DeclareOpts::default()).await
    }

    /// Declare with AMQP's extras: master locator and exclusive owner.
    pub async fn declare_queue_with(
        &self,
        name: &str,
        replicas: Vec<NodeId>,
        opts: DeclareOpts,
    ) -> Result<(QueueMeta, bool), NodeError> {
        if name.is_empty() || name.len() > 255 {
            return Err(NodeError::Invalid("queue name must be 1 to 255 bytes".into()));
        }
        // An existing queue needs no metadata write, so a node cut off from
        // the metadata majority still answers declares of the queues it
        // serves (as every client library declares before it uses a queue).
        if let Some(q) = self.metadata().queues.get(name).cloned() {
            self.queue_op(name, vec![QueueCmd::Status]).await?;
            return Ok((q, false));
        }
        // Placement needs this node in the metadata; right after start its
        // registration may still be on its way.
        let mut meta = self.inner.meta.clone();
        let me = self.id();
        let _ = tokio::time::timeout(self.inner.timing.op_timeout, meta.wait_for(|m| m.nodes.contains_key(&me))).await;
        let cmd = MetaCmd::DeclareQueue {
            name: name.to_string(),
            replicas,
            durable: true,
            declared_on: self.id(),
            locator: opts.min_masters,
            exclusive_owner: opts.exclusive_owner,
            auto_delete: opts.auto_delete,
            args: opts.args,
        };
        let reply = self.meta_write(cmd).await?;
        let q = match reply {
            MetaReply::Queue(q) => (q, false),
            MetaReply::NewQueue(q) => (q, true),
            MetaReply::Invalid(why) => return Err(NodeError::Invalid(why)),
            other => return Err(NodeError::Invalid(format!("unexpected metadata reply {other:?}"))),
        };
        // Answering a status proves the group elected a master.
        self.queue_op(name, vec![QueueCmd::Status]).await?;
        Ok(q)
    }

    /// Add or replace a policy; queues it matches are re-placed. `true`
    /// when the policy is new.
    pub async fn set_policy(&self, p: Policy) -> Result<bool, NodeError> {
        let name = p.name.clone();
        let reply = self.meta_write(MetaCmd::SetPolicy(p)).await?;
        let created = reply == MetaReply::Created;
        meta_result(reply, || format!("policy '{name}'")).map(|_| created)
    }

    pub async fn clear_policy(&self, name: &str) -> Result<(), NodeError> {
        let (vhost, bare) = crate::metadata::names::split(name);
        meta_result(self.meta_write(MetaCmd::ClearPolicy { name: name.to_string() }).await?, || {
            format!("no policy '{bare}' in vhost '{vhost}'")
        })
    }

    /// A change to users, vhosts or permissions; `true` when it made
    /// something new.
    pub async fn meta_change(&self, cmd: MetaCmd, not_found: impl FnOnce() -> String) -> Result<bool, NodeError> {
        let reply = self.meta_write(cmd).await?;
        let created = reply == MetaReply::Created;
        meta_result(reply, not_found).map(|_| created)
    }

    /// The queue as its master sees it (counts, synchronised mirrors), asked
    /// over the node link when the master is elsewhere.
    pub async fn master_view(&self, name: &str) -> Result<QueueInfo, NodeError> {
        let q = self.find_queue(name).await?;
        let mut target = self.leader_guess(&q);
        for _ in 0..3 {
            let info = if target == self.id() {
                self.queue_info(name)?
            } else {
                let deadline = Instant::now() + Duration::from_secs(2);
                match self
                    .inner
                    .call(target, &RpcRequest::Client(ClientRequest::QueueInfo { name: name.into() }), deadline)
                    .await
                {
                    Ok(RpcResponse::Client(Ok(ClientReply::QueueInfo(i)))) => i,
                    Ok(RpcResponse::Client(Err(e))) => return Err(e),
                    _ => return Err(NodeError::Unavailable(format!("node {target} did not answer"))),
                }
            };
            match info.leader {
                Some(l) if l != target && info.local => target = l,
                _ => return Ok(info),
            }
        }
        Err(NodeError::Unavailable(format!("no master of '{name}' found")))
    }

    /// This node's AMQP client registry.
    /// Memory and disk alarms (`connection.blocked`).
    pub fn alarms(&self) -> &Alarms {
        &self.inner.alarms
    }

    /// Memory and disk readings of node `id` (this one's own, or asked over
    /// the node link; `None` if it does not answer in time).
    pub async fn readings_of(&self, id: NodeId, limit: Duration) -> Option<crate::alarms::Readings> {
        if id == self.id() {
            return Some(self.alarms().readings());
        }
        match self.inner.call(id, &RpcRequest::Readings, Instant::now() + limit).await {
            Ok(RpcResponse::Readings(r)) => Some(r),
            _ => None,
        }
    }

    /// Counters the front ends keep, for `/metrics`.
    pub fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }

    /// Raft figures of every queue replica hosted here.
    pub fn local_raft_metrics(&self) -> Vec<GroupRaftMetrics> {
        let by_group: HashMap<GroupId, String> =
            self.metadata().queues.values().map(|q| (q.group, q.name.clone())).collect();
        let groups: Vec<Arc<QueueGroup>> = self.inner.groups.read().expect("poisoned").values().cloned().collect();
        groups
            .iter()
            .filter_map(|g| {
                let queue = by_group.get(&g.meta.group)?.clone();
                let m = g.raft.metrics().borrow().clone();
                Some(GroupRaftMetrics {
                    queue,
                    term: m.current_term,
                    committed: m.last_applied.map(|l| l.index),
                    leader: m.current_leader,
                })
            })
            .collect()
    }

    /// Owners of deliveries made on this node.
    pub fn owners(&self) -> &Arc<Owners> {
        &self.inner.owners
    }

    pub fn clients(&self) -> &Arc<Clients> {
        &self.inner.clients
    }

    /// AMQP connections and consumers of every reachable node.
    pub async fn cluster_clients(&self) -> (Vec<ConnectionInfo>, Vec<ConsumerInfo>) {
        let (mut conns, mut consumers) = self.inner.clients.snapshot();
        let peers: Vec<NodeId> = self.metadata().nodes.keys().copied().filter(|id| *id != self.id()).collect();
        // All at once: a peer that does not answer costs the deadline once.
        let deadline = Instant::now() + Duration::from_millis(1000);
        let asks = peers.iter().map(|peer| self.inner.call(*peer, &RpcRequest::Clients, deadline));
        for answer in futures::future::join_all(asks).await {
            if let Ok(RpcResponse::Clients(c, k)) = answer {
                conns.extend(c);
                consumers.extend(k);
            }
        }
        (conns, consumers)
    }

    /// The consumers of `queue` on every node that answers.
    pub async fn consumers_of(&self, queue: &str) -> Vec<ConsumerInfo> {
        self.cluster_clients().await.1.into_iter().filter(|k| k.queue == queue).collect()
    }

    /// An auto-delete queue lost a consumer here: delete it if no node has
    /// a consumer on it any more (RabbitMQ: when its last consumer goes).
    pub async fn consumer_gone(&self, queue: &str) {
        let auto = self.metadata().queues.get(queue).is_some_and(|q| q.auto_delete);
        if !auto {
            return;
        }
        let (_, consumers) = self.cluster_clients().await;
        if consumers.iter().any(|c| c.queue == queue) {
            return;
        }
        match self.delete_queue(queue).await {
            Ok(()) => tracing::info!(queue, "auto-delete queue deleted after its last consumer"),
            Err(NodeError::NoSuchQueue(_)) => {}
            Err(e) => tracing::warn!(queue, error = %e, "could not auto-delete queue"),
        }
    }

    /// Does node `id` answer on the node link?
    pub async fn ping(&self, id: NodeId, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        matches!(
            self.inner.call(id, &RpcRequest::Members { group: METADATA_GROUP }, deadline).await,
            Ok(RpcResponse::Members(_))
        )
    }

    /// Voters of the queue's group as this node's replica sees them.
    pub fn queue_members(&self, queue: &str) -> Option<BTreeSet<NodeId>> {
        self.queue_raft(queue).map(|r| r.metrics().borrow().membership_config.membership().voter_ids().collect())
    }

    /// Declare an exchange (idempotent for the same type).
    pub async fn declare_exchange(&self, ex: ExchangeMeta) -> Result<(), NodeError> {
        let name = ex.name.clone();
        meta_result(self.meta_write(MetaCmd::DeclareExchange(ex)).await?, || format!("exchange '{name}'"))
    }

    pub async fn delete_exchange(&self, name: &str, if_unused: bool) -> Result<(), NodeError> {
        meta_result(self.meta_write(MetaCmd::DeleteExchange { name: name.to_string(), if_unused }).await?, || {
            format!("no exchange '{name}' in vhost '/'")
        })
    }

    pub async fn bind(&self, b: Binding) -> Result<(), NodeError> {
        let what = format!("no exchange '{}' or queue '{}' in vhost '/'", b.exchange, b.queue);
        meta_result(self.meta_write(MetaCmd::Bind(b)).await?, || what)
    }

    pub async fn unbind(&self, b: Binding) -> Result<(), NodeError> {
        meta_result(self.meta_write(MetaCmd::Unbind(b)).await?, || "binding".into())
    }

    /// The queues a message reaches, decided from the local metadata.
    /// `None`: no such exchange.
    pub fn route(&self, exchange: &str, routing_key: &str, headers: &Args) -> Option<Vec<String>> {
        let meta = self.metadata();
        let queues = |q: &str| meta.queues.contains_key(q);
        routing::route(&meta.exchanges, &meta.bindings, &queues, exchange, routing_key, headers)
    }

    pub async fn delete_queue(&self, name: &str) -> Result<(), NodeError> {
        match self.meta_write(MetaCmd::DeleteQueue { name: name.to_string() }).await? {
            MetaReply::Ok => Ok(()),
            MetaReply::NotFound => Err(NodeError::NoSuchQueue(name.to_string())),
            other => Err(NodeError::Invalid(format!("unexpected metadata reply {other:?}"))),
        }
    }

    /// Publish messages to a queue; resolves once every synchronised replica
    /// has them on disk.
    pub async fn publish(&self, queue: &str, msgs: Vec<Message>) -> Result<(), NodeError> {
        // Consumers are sent the stored properties as they are.
        if let Some(bad) = msgs.iter().position(|m| !crate::message::valid_properties(&m.properties)) {
            return Err(NodeError::Invalid(format!(
                "message {bad}: properties are not an AMQP property list (message::encode_properties makes one)"
            )));
        }
        let replies = self.queue_op(queue, vec![QueueCmd::Enqueue { msgs }]).await?;
        stored_all(queue, &replies)
    }

    /// Take up to `max` messages. With `auto_ack` they are gone at once;
    /// otherwise they wait for [`Node::ack`] / [`Node::nack`] under `owner`.
    pub async fn get(&self, queue: &str, owner: u64, max: u32, auto_ack: bool) -> Result<Vec<Delivery>, NodeError> {
        self.fetch(queue, owner, max, auto_ack).await.map(|(msgs, _)| msgs)
    }

    /// A consumer's get: with nothing ready at the master it waits there
    /// (briefly) for the next entry and takes what that entry publishes
    /// (`proposer::Lane::Parked`); answers empty if nothing came.
    pub async fn consumer_get(
        &self,
        queue: &str,
        owner: u64,
        max: u32,
        auto_ack: bool,
    ) -> Result<Vec<Delivery>, NodeError> {
        self.fetch_in(queue, owner, max, auto_ack, Lane::Parked).await.map(|(msgs, _)| msgs)
    }

    /// A consumer's get of messages known to be ready: it goes into the
    /// master's next entry ahead of publishes waiting there ([`Lane::Consumer`]).
    /// Also answers how many ready messages remain.
    pub async fn consumer_fetch(
        &self,
        queue: &str,
        owner: u64,
        max: u32,
        auto_ack: bool,
    ) -> Result<(Vec<Delivery>, u64), NodeError> {
        self.fetch_in(queue, owner, max, auto_ack, Lane::Consumer).await
    }

    /// [`Node::get`], also answering how many ready messages remain.
    pub async fn fetch(
        &self,
        queue: &str,
        owner: u64,
        max: u32,
        auto_ack: bool,
    ) -> Result<(Vec<Delivery>, u64), NodeError> {
        self.fetch_in(queue, owner, max, auto_ack, Lane::Arrival).await
    }

    async fn fetch_in(
        &self,
        queue: &str,
        owner: u64,
        max: u32,
        auto_ack: bool,
        lane: Lane,
    ) -> Result<(Vec<Delivery>, u64), NodeError> {
        match self.queue_op_in(queue, vec![QueueCmd::Get { owner, max, auto_ack }], lane).await?.pop() {
            Some(QueueReply::Got { msgs, remaining }) => Ok((msgs, remaining)),
            other => Err(NodeError::Invalid(format!("unexpected reply {other:?}"))),
        }
    }

    pub async fn ack(&self, queue: &str, tags: Vec<u64>) -> Result<QueueReply, NodeError> {
        self.single(queue, QueueCmd::Ack { tags }).await
    }

    pub async fn nack(&self, queue: &str, tags: Vec<u64>, requeue: bool) -> Result<QueueReply, NodeError> {
        self.single(queue, QueueCmd::Nack { tags, requeue }).await
    }

    pub async fn purge(&self, queue: &str) -> Result<u64, NodeError> {
        match self.single(queue, QueueCmd::Purge).await? {
            QueueReply::Purged { count } => Ok(count),
            other => Err(NodeError::Invalid(format!("unexpected reply {other:?}"))),
        }
    }

    /// Ready and unacknowledged counts, read through the master's log.
    pub async fn status(&self, queue: &str) -> Result<(u64, u64), NodeError> {
        match self.single(queue, QueueCmd::Status).await? {
            QueueReply::Status { ready, unacked } => Ok((ready, unacked)),
            other => Err(NodeError::Invalid(format!("unexpected reply {other:?}"))),
        }
    }

    async fn single(&self, queue: &str, cmd: QueueCmd) -> Result<QueueReply, NodeError> {
        self.queue_op(queue, vec![cmd]).await?.pop().ok_or_else(|| NodeError::Invalid("empty reply".into()))
    }

    /// Ready messages in the local replica of `queue` (the master's count
    /// where this node masters it, a little behind elsewhere).
    pub fn ready_hint(&self, queue: &str) -> Option<u64> {
        let group = self.metadata().queues.get(queue)?.group;
        self.inner.groups.read().expect("poisoned").get(&group).map(|g| g.stats.borrow().ready)
    }

    /// Wait until the local replica of `queue` shows ready messages, at most
    /// `limit` (just `limit` when this node hosts no replica).
    pub async fn wait_for_messages(&self, queue: &str, limit: Duration) {
        let group = self.metadata().queues.get(queue).map(|q| q.group);
        let stats = group.and_then(|g| self.inner.groups.read().expect("poisoned").get(&g).map(|g| g.stats.clone()));
        match stats {
            Some(mut rx) => {
                let _ = tokio::time::timeout(limit, rx.wait_for(|s| s.ready > 0)).await;
            }
            None => tokio::time::sleep(limit).await,
        }
    }

    /// The queue as this node sees it, without asking anyone.
    pub fn queue_info(&self, name: &str) -> Result<QueueInfo, NodeError> {
        let meta = self.metadata();
        let q = meta.queues.get(name).ok_or_else(|| NodeError::NoSuchQueue(name.to_string()))?;
        let group = self.inner.groups.read().expect("poisoned").get(&q.group).cloned();
        let mut info = QueueInfo {
            name: q.name.clone(),
            group: q.group,
            replicas: q.replicas.clone(),
            local: group.is_some(),
            leader: None,
            ready: 0,
            unacked: 0,
            applied: None,
            synchronised: Vec::new(),
            catching_up: Vec::new(),
        };
        if let Some(g) = group {
            let m = g.raft.metrics().borrow().clone();
            info.leader = m.current_leader;
            info.applied = m.last_applied.map(|l| l.index);
            let s = *g.stats.borrow();
            (info.ready, info.unacked) = (s.ready, s.unacked);
            info.synchronised = g.sync.borrow().synchronised.iter().copied().collect();
            if g.is_leader(self.id()) {
                info.catching_up = sync::catching_up(&g.catching).into_iter().collect();
            }
        }
        Ok(info)
    }

    /// Start queue operations at the queue's master and return the wait for
    /// their replies. Operations started one after another (awaiting each
    /// start) reach the queue's log in that order, as AMQP requires for one
    /// channel's publishes, while their confirms are awaited concurrently.
    /// Only a change of master between start and commit can reorder them.
    pub async fn submit(&self, queue: &str, cmds: Vec<QueueCmd>) -> Result<Submitted, NodeError> {
        self.submit_in(queue, cmds, Lane::Arrival).await
    }

    /// [`Node::submit`] in `lane` at the master: [`Lane::Consumer`] for a
    /// consumer's settlements, which need not wait behind queued publishes.
    pub async fn submit_in(&self, queue: &str, cmds: Vec<QueueCmd>, lane: Lane) -> Result<Submitted, NodeError> {
        let q = self.metadata().queues.get(queue).cloned().ok_or_else(|| NodeError::NoSuchQueue(queue.to_string()))?;
        let target = self.leader_guess(&q);
        let fast: Option<Result<Answer, NodeError>> =
            if target == self.id() { Some(self.inner.local_enqueue(q.group, cmds.clone(), lane).await) } else { None };
        let node = self.clone();
        let queue = queue.to_string();
        match fast {
            Some(Ok(answer)) => Ok(Box::pin(async move {
                match answer.await.unwrap_or(Err(NodeError::Stopped)) {
                    Err(NodeError::NotLeader { .. }) => node.queue_op_in(&queue, cmds, lane).await,
                    other => other,
                }
            })),
            Some(Err(_)) => Ok(Box::pin(async move { node.queue_op_in(&queue, cmds, lane).await })),
            None => {
                let addr =
                    if self.inner.transport.control.is_blocked(target) { None } else { self.inner.addr_of(target) };
                let Some(addr) = addr else {
                    return Ok(Box::pin(async move { node.queue_op_in(&queue, cmds, lane).await }));
                };
                let req = RpcRequest::Queue { group: q.group, cmds, lane };
                match self.inner.transport.start_call(&addr, &req).await {
                    Ok(rx) => {
                        let RpcRequest::Queue { cmds, .. } = req else { unreachable!() };
                        let timeout = self.inner.timing.op_timeout;
                        Ok(Box::pin(async move {
                            match tokio::time::timeout(timeout, rx).await {
                                Ok(Ok(RpcResponse::Queue(Err(NodeError::NotLeader { .. })))) => {
                                    node.queue_op_in(&queue, cmds, lane).await
                                }
                                Ok(Ok(RpcResponse::Queue(r))) => r,
                                Ok(Ok(other)) => Err(NodeError::Invalid(format!("unexpected reply {other:?}"))),
                                Ok(Err(_)) => Err(NodeError::Unavailable(format!("connection to {addr} lost"))),
                                Err(_) => Err(NodeError::Unavailable(format!("no answer from {addr} in time"))),
                            }
                        }))
                    }
                    Err(_) => {
                        let RpcRequest::Queue { cmds, .. } = req else { unreachable!() };
                        Ok(Box::pin(async move { node.queue_op_in(&queue, cmds, lane).await }))
                    }
                }
            }
        }
    }

    /// Run queue operations at the queue's master, wherever it is.
    pub async fn queue_op(&self, queue: &str, cmds: Vec<QueueCmd>) -> Result<Vec<QueueReply>, NodeError> {
        self.queue_op_in(queue, cmds, Lane::Arrival).await
    }

    /// [`Node::queue_op`] in `lane` at the master ([`Lane`]).
    async fn queue_op_in(&self, queue: &str, cmds: Vec<QueueCmd>, lane: Lane) -> Result<Vec<QueueReply>, NodeError> {
        let deadline = Instant::now() + self.inner.timing.op_timeout;
        let q = self.metadata().queues.get(queue).cloned().ok_or_else(|| NodeError::NoSuchQueue(queue.to_string()))?;
        let mut target = self.leader_guess(&q);
        let mut attempt = 0usize;
        loop {
            let result = if target == self.id() {
                self.inner.local_queue_op(q.group, cmds.clone(), lane).await
            } else {
                let req = RpcRequest::Queue { group: q.group, cmds: cmds.clone(), lane };
                match self.inner.call(target, &req, deadline).await {
                    Ok(RpcResponse::Queue(r)) => r,
                    Ok(other) => Err(NodeError::Invalid(format!("unexpected reply {other:?}"))),
                    // Not sent: safe to try elsewhere.
                    Err(CallError::Unreachable(..)) => Err(NodeError::NotLeader { leader: None }),
                    // Sent, outcome unknown: the caller decides whether to resend.
                    Err(e) => Err(NodeError::Unavailable(e.to_string())),
                }
            };
            // A replica that stopped under the operation (re-forming,
            // healing, moved away) is about to be replaced: look for the
            // master again. Unless the operation takes messages: it may
            // have been applied before the stop, and a second get would
            // take more (an auto-ack get's first messages were lost so).
            // (A replica here that stopped to re-form or heal drops the gets
            // it never applied: those may go again.)
            let takes = cmds.iter().any(|c| matches!(c, QueueCmd::Get { .. }))
                && !(target == self.id() && self.inner.busy.lock().expect("poisoned").contains(&q.group));
            let result = match result {
                Err(NodeError::Stopped) if takes => Err(NodeError::Unavailable(format!(
                    "the master of '{queue}' stopped with the get in flight; it may have been served"
                ))),
                Err(NodeError::Stopped) if !self.inner.stop.is_cancelled() => {
                    Err(NodeError::NotLeader { leader: None })
                }
                other => other,
            };
            match result {
                Err(NodeError::NotLeader { leader }) => {
                    // Deleted meanwhile (its group gone on the master): say
                    // so now rather than look for a master until the deadline.
                    if !self.metadata().queues.get(queue).is_some_and(|m| m.group == q.group) {
                        return Err(NodeError::NoSuchQueue(queue.to_string()));
                    }
                    if Instant::now() >= deadline {
                        return Err(NodeError::Unavailable(format!("no master of '{queue}' reachable")));
                    }
                    attempt += 1;
                    target = match leader {
                        Some(l) if l != target => l,
                        _ => {
                            // No hint: wait for an election, then try the
                            // new master or else the next replica.
                            let wait = Duration::from_millis(50 * attempt.min(10) as u64);
                            match self.new_leader(q.group, target, wait).await {
                                Some(l) => l,
                                None => q.replicas[attempt % q.replicas.len()],
                            }
                        }
                    };
                }
                Ok(r) => {
                    self.inner.hints.lock().expect("poisoned").insert(q.group, target);
                    return Ok(r);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// A leader of `group` other than `not`, as this node's replica learns
    /// of it within `wait` (at once when an election ends: a publisher
    /// waiting out a failover goes on as soon as there is a new master,
    /// not at its next retry). `None` after `wait` or without a replica here.
    async fn new_leader(&self, group: GroupId, not: NodeId, wait: Duration) -> Option<NodeId> {
        let g = self.inner.groups.read().expect("poisoned").get(&group).cloned();
        let Some(g) = g else {
            tokio::time::sleep(wait).await;
            return None;
        };
        let mut metrics = g.raft.metrics();
        let found = tokio::time::timeout(wait, async {
            metrics.wait_for(|m| m.current_leader.is_some_and(|l| l != not)).await.ok().and_then(|m| m.current_leader)
        })
        .await;
        found.ok().flatten()
    }

    fn leader_guess(&self, q: &QueueMeta) -> NodeId {
        if let Some(g) = self.inner.groups.read().expect("poisoned").get(&q.group) {
            if let Some(l) = g.raft.metrics().borrow().current_leader {
                return l;
            }
        }
        if let Some(h) = self.inner.hints.lock().expect("poisoned").get(&q.group) {
            return *h;
        }
        q.replicas[0]
    }

    /// Catch up with the metadata leader: wait (briefly) until this node has
    /// applied everything the leader had applied when asked, so a change
    /// made through another node is visible here. Without a reachable leader
    /// it returns at once and reads stay local (CONTRACT 5).
    pub async fn meta_barrier(&self) {
        let m = self.inner.meta_raft.metrics().borrow().clone();
        let Some(leader) = m.current_leader else { return };
        if leader == self.id() {
            return;
        }
        let deadline = Instant::now() + Duration::from_millis(1000);
        if let Ok(RpcResponse::MetaIndex(Some(index))) = self.inner.call(leader, &RpcRequest::MetaIndex, deadline).await
        {
            let _ = self
                .inner
                .meta_raft
                .wait(Some(Duration::from_secs(2)))
                .applied_index_at_least(Some(index), "metadata barrier")
                .await;
        }
    }

    /// The queue's metadata, catching up with the leader before saying it
    /// does not exist.
    pub async fn find_queue(&self, name: &str) -> Result<QueueMeta, NodeError> {
        if let Some(q) = self.metadata().queues.get(name) {
            return Ok(q.clone());
        }
        self.meta_barrier().await;
        self.metadata().queues.get(name).cloned().ok_or_else(|| NodeError::NoSuchQueue(name.to_string()))
    }

    /// [`Node::route`], catching up with the metadata leader before calling a
    /// message unroutable or an exchange missing.
    pub async fn route_fresh(&self, exchange: &str, routing_key: &str, headers: &Args) -> Option<Vec<String>> {
        match self.route(exchange, routing_key, headers) {
            Some(q) if !q.is_empty() => Some(q),
            _ => {
                self.meta_barrier().await;
                self.route(exchange, routing_key, headers)
            }
        }
    }

    /// Write to the metadata group through its leader, then wait until this
    /// node has applied it (so local reads see the change).
    pub async fn meta_write(&self, cmd: MetaCmd) -> Result<MetaReply, NodeError> {
        let deadline = Instant::now() + self.inner.timing.op_timeout;
        let mut attempt = 0u64;
        loop {
            let leader = self.inner.meta_raft.metrics().borrow().current_leader;
            let result = match leader {
                Some(l) if l == self.id() => self.inner.local_meta_write(cmd.clone()).await,
                Some(l) => match self.inner.call(l, &RpcRequest::Meta { cmd: cmd.clone() }, deadline).await {
                    Ok(RpcResponse::Meta(r)) => r,
                    Ok(other) => Err(NodeError::Invalid(format!("unexpected reply {other:?}"))),
                    Err(CallError::Unreachable(..)) => Err(NodeError::NotLeader { leader: None }),
                    Err(e) => Err(NodeError::Unavailable(e.to_string())),
                },
                None => Err(NodeError::NotLeader { leader: None }),
            };
            match result {
                Ok((reply, index)) => {
                    let wait = deadline.saturating_duration_since(Instant::now());
                    self.inner
                        .meta_raft
                        .wait(Some(wait))
                        .applied_index_at_least(Some(index), "metadata change applied locally")
                        .await
                        .map_err(|e| NodeError::Unavailable(e.to_string()))?;
                    return Ok(reply);
                }
                Err(NodeError::NotLeader { .. }) if Instant::now() < deadline => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(20 * attempt.min(10))).await;
                }
                Err(NodeError::NotLeader { .. }) => {
                    return Err(NodeError::Unavailable("no metadata majority reachable".into()))
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Stop the node: masterships handed over (`ha-promote-on-shutdown`), no
    /// new work, every group shut down, storage synced.
    pub async fn shutdown(&self) {
        self.inner.closing.cancel();
        let successors = self.prepare_hand_over();
        // Move each mastership while this node can still vote for its
        // successor (which then wins at once); what does not move in time
        // is handed over the slow way below, after the groups stop.
        let successors = self.move_masters_away(successors).await;
        self.inner.stop.cancel();
        let groups: Vec<_> = self.inner.groups.write().expect("poisoned").drain().map(|(_, g)| g).collect();
        for g in groups {
            g.stop.cancel();
            let _ = g.raft.shutdown().await;
        }
        self.hand_over(successors).await;
        self.inner.transport.close_all();
        let _ = self.inner.meta_raft.shutdown().await;
        if let Err(e) = self.inner.db.flusher().sync().await {
            tracing::error!(error = %e, "final sync failed");
        }
    }

    /// Stop abruptly, as a crash would: tasks end, connections drop, no
    /// final sync or handover happens, and storage loses everything not
    /// synced (the write-ahead log is cut back to its last sync, sled's
    /// memory is lost, and with `crash_image` so is what sled wrote since
    /// its last sync). For in-process failure tests; the node's handles
    /// must not be used afterwards.
    pub async fn crash(&self) {
        self.inner.stop.cancel();
        self.inner.transport.close_all();
        if let Err(e) = self.inner.db.crash_for_tests() {
            tracing::error!(error = %e, "crash of the storage failed");
        }
        let groups: Vec<_> = self.inner.groups.write().expect("poisoned").drain().map(|(_, g)| g).collect();
        for g in groups {
            let _ = g.raft.shutdown().await;
        }
        let _ = self.inner.meta_raft.shutdown().await;
    }

    /// Number of message bodies in this replica's applied state for `queue`.
    pub fn local_stored_count(&self, queue: &str) -> Result<usize, NodeError> {
        let q = self.metadata().queues.get(queue).cloned().ok_or_else(|| NodeError::NoSuchQueue(queue.into()))?;
        QueueMachine::stored_messages(&SmSpace::new(self.inner.db.clone(), q.group))
            .map(|m| m.len())
            .map_err(|e| NodeError::Unavailable(e.to_string()))
    }

    /// Number of log entries this replica keeps for `queue` (not yet purged).
    pub async fn local_log_len(&self, queue: &str) -> Result<usize, NodeError> {
        use openraft::storage::RaftLogStorage;
        use openraft::RaftLogReader;
        let q = self.metadata().queues.get(queue).cloned().ok_or_else(|| NodeError::NoSuchQueue(queue.into()))?;
        let mut log = LogStore::new(self.inner.db.clone(), q.group);
        let mut reader = log.get_log_reader().await;
        let entries = reader.try_get_log_entries(..).await.map_err(|e| NodeError::Unavailable(e.to_string()))?;
        Ok(entries.len())
    }

    /// Every message this replica holds for `queue`: in its applied state and
    /// in its log, whether applied yet or not. Reads only the local disk.
    pub async fn local_messages(&self, queue: &str) -> Result<Vec<Message>, NodeError> {
        use openraft::storage::RaftLogStorage;
        use openraft::RaftLogReader;
        let q = self.metadata().queues.get(queue).cloned().ok_or_else(|| NodeError::NoSuchQueue(queue.into()))?;
        let mut out = QueueMachine::stored_messages(&SmSpace::new(self.inner.db.clone(), q.group))
            .map_err(|e| NodeError::Unavailable(e.to_string()))?;
        let mut log = LogStore::new(self.inner.db.clone(), q.group);
        let mut reader = log.get_log_reader().await;
        let entries = reader.try_get_log_entries(..).await.map_err(|e| NodeError::Unavailable(e.to_string()))?;
        for e in entries {
            if let openraft::EntryPayload::Normal(Request::Queue(cmds)) = e.payload {
                for c in std::sync::Arc::unwrap_or_clone(cmds) {
                    if let QueueCmd::Enqueue { msgs } | QueueCmd::EnqueueExpiring { msgs, .. } = c {
                        out.extend(msgs);
                    }
                }
            }
        }
        Ok(out)
    }

    fn spawn_fatal_watch(&self) {
        let node = self.clone();
        let mut fatal = self.inner.db.fatal();
        tokio::spawn(async move {
            tokio::select! {
                _ = node.inner.stop.cancelled() => {}
                r = async { fatal.wait_for(|f| f.is_some()).await.map(|_| ()) } => if r.is_ok() {
                    tracing::error!("stopping the node after a storage failure");
                    node.shutdown().await;
                }
            }
        });
    }

    /// Announce this node's name and address in the metadata until it sticks.
    fn spawn_registration(&self) {
        let node = self.clone();
        tokio::spawn(async move {
            let info = NodeInfo { id: node.id(), name: node.inner.name.clone(), raft_addr: node.inner.addr.clone() };
            loop {
                if node.metadata().nodes.get(&info.id) == Some(&info) {
                    return;
                }
                tokio::select! {
                    _ = node.inner.stop.cancelled() => return,
                    r = node.meta_write(MetaCmd::RegisterNode(info.clone())) => if r.is_ok() { return },
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        });
    }

    /// Keep the hosted groups equal to the metadata's wish.
    fn spawn_reconciler(&self) {
        let node = self.clone();
        let mut meta = self.inner.meta.clone();
        tokio::spawn(async move {
            // Also on a timer: a replica leaves only once the group's
            // membership no longer has it, and masters move.
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            // What each failing group last reported: a failure that repeats
            // every round is logged once, and counted.
            let mut told: HashMap<GroupId, String> = HashMap::new();
            loop {
                let state = meta.borrow_and_update().clone();
                let failed = node.reconcile(&state).await;
                let now_failing: HashSet<GroupId> = failed.iter().map(|(g, _)| *g).collect();
                for (group, e) in failed {
                    node.inner.metrics.reconcile_failures.inc();
                    let text = e.to_string();
                    if told.get(&group) != Some(&text) {
                        tracing::error!(group, error = %text, "cannot start or stop a queue replica; retrying (told once until it changes)");
                        told.insert(group, text);
                    }
                }
                told.retain(|group, _| {
                    let still = now_failing.contains(group);
                    if !still {
                        tracing::info!(group, "queue replica no longer failing");
                    }
                    still
                });
                tokio::select! {
                    _ = node.inner.stop.cancelled() => return,
                    r = meta.changed() => if r.is_err() { return },
                    _ = tick.tick() => {}
                }
            }
        });
    }

    /// One round: start, stop and steer the hosted groups, then watch for
    /// failures. A group that fails is reported and the others go on (one
    /// replica that cannot start must not keep every other queue on the
    /// node from failing over).
    async fn reconcile(&self, state: &MetaState) -> Vec<(GroupId, ServerError)> {
        let mut failed = Vec::new();
        let wanted: HashMap<GroupId, &QueueMeta> =
            state.queues.values().filter(|q| q.replicas.contains(&self.id())).map(|q| (q.group, q)).collect();
        let exists: HashMap<GroupId, &QueueMeta> = state.queues.values().map(|q| (q.group, q)).collect();
        let (to_start, to_stop, to_steer): (Vec<QueueMeta>, Vec<Arc<QueueGroup>>, Vec<Arc<QueueGroup>>) = {
            let groups = self.inner.groups.read().expect("poisoned");
            (
                {
                    let busy = self.inner.busy.lock().expect("poisoned");
                    wanted
                        .values()
                        .filter(|q| !groups.contains_key(&q.group) && !busy.contains(&q.group))
                        .map(|q| (*q).clone())
                        .collect()
                },
                groups
                    .values()
                    .filter(|g| {
                        // Deleted, or moved away and already out of the group's
                        // membership (so stopping cannot cost the group a vote).
                        !exists.contains_key(&g.meta.group)
                            || (!wanted.contains_key(&g.meta.group) && !g.is_member(self.id()))
                    })
                    .cloned()
                    .collect(),
                groups.values().filter(|g| g.is_leader(self.id())).cloned().collect(),
            )
        };
        // Moved away but still a member in our own view: the final
        // membership entry never reaches a removed node, so ask the replicas
        // that stay whether the change excluding us is in effect.
        let moved: Vec<(Arc<QueueGroup>, Vec<NodeId>)> = {
            let groups = self.inner.groups.read().expect("poisoned");
            groups
                .values()
                .filter(|g| !wanted.contains_key(&g.meta.group) && g.is_member(self.id()))
                .filter_map(|g| exists.get(&g.meta.group).map(|q| (g.clone(), q.replicas.clone())))
                .collect()
        };
        for (g, stay) in moved {
            if self.excluded_by_peers(g.meta.group, &stay).await {
                self.inner.groups.write().expect("poisoned").remove(&g.meta.group);
                g.stop.cancel();
                let _ = g.raft.shutdown().await;
                match self.inner.drop_replica(g.meta.group) {
                    Ok(()) => tracing::info!(queue = %g.meta.name, "queue replica moved away"),
                    Err(e) => failed.push((g.meta.group, e.into())),
                }
            }
        }
        for g in to_steer {
            if let Some(q) = exists.get(&g.meta.group) {
                self.steer_membership(g, (*q).clone(), state);
            }
        }
        for g in to_stop {
            self.inner.groups.write().expect("poisoned").remove(&g.meta.group);
            g.stop.cancel();
            let _ = g.raft.shutdown().await;
            match self.inner.drop_replica(g.meta.group) {
                Ok(()) => tracing::info!(queue = %g.meta.name, "queue replica removed"),
                Err(e) => failed.push((g.meta.group, e.into())),
            }
        }
        for q in to_start {
            // A heal may have begun since the list was made.
            if self.inner.busy.lock().expect("poisoned").contains(&q.group) {
                continue;
            }
            let group = q.group;
            if let Err(e) = self.start_group(q, state).await {
                failed.push((group, e));
            }
        }
        self.watch_failures(state).await;
        failed
    }

    async fn excluded_by_peers(&self, group: GroupId, peers: &[NodeId]) -> bool {
        let deadline = Instant::now() + Duration::from_secs(1);
        for peer in peers.iter().filter(|p| **p != self.id()) {
            if let Ok(RpcResponse::Members(Some(members))) =
                self.inner.call(*peer, &RpcRequest::Members { group }, deadline).await
            {
                if !members.contains(&self.id()) {
                    return true;
                }
            }
        }
        false
    }

    /// As master, move the group's membership to the metadata's replica set,
    /// one step per call: new replicas join as learners; learners that have
    /// caught up become voters (one joint-consensus change); unwanted ones
    /// go. A replica that is down stays a learner until it returns, so the
    /// voters are always replicas that answer and the change can commit.
    fn steer_membership(&self, g: Arc<QueueGroup>, q: QueueMeta, state: &MetaState) {
        let wanted: BTreeSet<NodeId> = q.replicas.iter().copied().collect();
        let m = g.raft.metrics().borrow().clone();
        let voters: BTreeSet<NodeId> = m.membership_config.membership().voter_ids().collect();
        let all: BTreeSet<NodeId> = m.membership_config.membership().nodes().map(|(id, _)| *id).collect();
        if voters == wanted && all == wanted {
            return;
        }
        if g.changing.swap(true, Ordering::AcqRel) {
            return;
        }
        let addrs: BTreeMap<NodeId, String> = state.nodes.values().map(|n| (n.id, n.raft_addr.clone())).collect();
        let manual = !failover::ha_of(state, &q).sync_automatic;
        let inner = self.inner.clone();
        tokio::spawn(async move {
            let result: Result<(), String> = async {
                if manual && wanted.difference(&all).next().is_some() {
                    catchup::snapshot_and_purge(&g.raft, &q.name).await;
                }
                for id in wanted.difference(&all) {
                    let addr = addrs.get(id).cloned().ok_or_else(|| format!("no address for node {id}"))?;
                    tracing::info!(queue = %q.name, node = id, "adding a mirror; it catches up as a learner");
                    g.raft.add_learner(*id, BasicNode { addr }, false).await.map_err(|e| e.to_string())?;
                }
                let m = g.raft.metrics().borrow().clone();
                let last = m.last_log_index.unwrap_or(0);
                let matched =
                    |id: &NodeId| m.replication.as_ref().and_then(|r| r.get(id).cloned().flatten()).map(|l| l.index);
                // Voters that stay, and learners close enough to the end of
                // the log to be waited for without stalling commits.
                let next: BTreeSet<NodeId> = wanted
                    .iter()
                    .copied()
                    .filter(|id| voters.contains(id) || matched(id).is_some_and(|i| i + CATCH_UP_SLACK >= last))
                    .collect();
                // No voter leaves while a replica that stays lacks bodies
                // (a new mirror fetching what its snapshot left out): the
                // one leaving may hold their only other copy, and a group of
                // replicas that all lack bodies has no one to stand.
                let complete = {
                    let book = g.catching.read().expect("poisoned");
                    next.iter().all(|id| *id == m.id || book.complete_in(m.current_term, *id))
                };
                let next: BTreeSet<NodeId> = if complete { next } else { next.union(&voters).copied().collect() };
                if !next.is_empty() && next != voters {
                    g.raft
                        .change_membership(ChangeMembers::ReplaceAllVoters(next.clone()), true)
                        .await
                        .map_err(|e| e.to_string())?;
                    tracing::info!(queue = %q.name, voters = ?next, "queue membership changed");
                }
                let m = g.raft.metrics().borrow().clone();
                let voters: BTreeSet<NodeId> = m.membership_config.membership().voter_ids().collect();
                let gone: BTreeSet<NodeId> = m
                    .membership_config
                    .membership()
                    .nodes()
                    .map(|(id, _)| *id)
                    .filter(|id| !wanted.contains(id) && !voters.contains(id))
                    .collect();
                if !gone.is_empty() {
                    g.raft
                        .change_membership(ChangeMembers::RemoveNodes(gone.clone()), false)
                        .await
                        .map_err(|e| e.to_string())?;
                    tracing::info!(queue = %q.name, removed = ?gone, "replicas left the queue");
                }
                Ok(())
            }
            .await;
            match result {
                Ok(()) => inner.told.cleared(q.group, "membership"),
                Err(e) => {
                    if inner.repeated(q.group, "membership", &e) {
                        tracing::warn!(queue = %q.name, error = %e, "membership change did not complete; will retry (told once until it changes)");
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
            }
            g.changing.store(false, Ordering::Release);
        });
    }

    async fn start_group(&self, q: QueueMeta, state: &MetaState) -> Result<(), ServerError> {
        let started = Instant::now();
        let db = &self.inner.db;
        let epoch = failover::load_epoch(db, q.group, self.id())?;
        let sm = StateMachine::<QueueMachine>::open(SmSpace::new(db.clone(), q.group), self.id())?;
        let (stats, plan) = sm.with(|m| (m.stats(), m.plan())).await;
        let raft = Raft::new(
            self.id(),
            self.inner.queue_raft_config.clone(),
            NetworkFactory {
                group: q.group,
                epoch,
                me: self.id(),
                news: self.inner.news.clone(),
                transport: self.inner.transport.clone(),
            },
            LogStore::new(db.clone(), q.group),
            sm.clone(),
        )
        .await
        .map_err(|e| ServerError::Raft(e.to_string()))?;
        sm.enable_snapshot_transfer();
        let stop = self.inner.stop.child_token();
        let catching = sync::CatchingUp::default();
        let sync = sync::spawn(
            q.group,
            raft.clone(),
            self.inner.timing.sync_timeout,
            self.inner.down.clone(),
            catching.clone(),
            stop.clone(),
        );
        let proposer = Proposer::spawn(
            raft.clone(),
            sync.clone(),
            self.inner.timing.sync_timeout,
            deadletter::sink(Arc::downgrade(&self.inner), q.name.clone()),
            stats.clone(),
            stop.clone(),
        );
        proposer.set_limits(deadletter::limits_of(state, &q));
        let group = Arc::new(QueueGroup {
            meta: q.clone(),
            epoch,
            majority_seen: Mutex::new(Instant::now()),
            majority_since: Mutex::new(None),
            master_heard: Mutex::new(None),
            leaderless_since: Mutex::new(None),
            master_lost_since: Mutex::new(None),
            elect_timed: AtomicBool::new(false),
            raft: raft.clone(),
            changing: AtomicBool::new(false),
            proposer,
            sync,
            stats,
            sm,
            plan,
            sync_run: watch::channel(false).0,
            catching,
            stop,
        });
        self.inner.groups.write().expect("poisoned").insert(q.group, group.clone());

        // The designated master starts a new group; the others wait to be
        // contacted. A restarted replica finds its group already initialized,
        // and one that joined a re-formed epoch waits for that epoch's master.
        let pristine = !raft.is_initialized().await.map_err(|e| ServerError::Raft(e.to_string()))?;
        if pristine && epoch == Epoch::default() && !q.initial.contains(&self.id()) {
            db.put_node_value(&catchup::new_mirror_key(q.group), &[])?;
        }
        if group.plan.borrow().is_some() || self.inner.is_quiet(q.group) {
            raft.runtime_config().elect(false);
        }
        self.spawn_catch_up(group.clone());
        self.spawn_expiry(group);
        if pristine && epoch == Epoch::default() && q.initial.first() == Some(&self.id()) {
            let members: BTreeMap<NodeId, BasicNode> = q
                .initial
                .iter()
                .map(|id| {
                    let addr = state.nodes.get(id).map(|n| n.raft_addr.clone()).unwrap_or_default();
                    (*id, BasicNode { addr })
                })
                .collect();
            if let Err(e) = raft.initialize(members).await {
                tracing::info!(queue = %q.name, error = %e, "queue group already initialized");
            }
        }
        tracing::info!(queue = %q.name, group = q.group, %epoch, pristine, elapsed_ms = started.elapsed().as_millis() as u64, "queue replica started");
        Ok(())
    }
}

/// How many messages the enqueues among `replies` stored: a queue that is
/// full (`x-overflow: reject-publish`) stores a batch's first ones only.
pub fn stored_count(replies: &[QueueReply]) -> u64 {
    replies.iter().map(|r| if let QueueReply::Enqueued { count } = r { *count as u64 } else { 0 }).sum()
}

/// A publish's replies: `Err` if the queue refused any of its messages
/// (`x-overflow: reject-publish` at `x-max-length`).
pub fn stored_all(queue: &str, replies: &[QueueReply]) -> Result<(), NodeError> {
    if replies.iter().any(|r| matches!(r, QueueReply::Enqueued { count: 0 })) {
        return Err(NodeError::Refused(format!("queue '{queue}' is full (x-overflow: reject-publish)")));
    }
    Ok(())
}

fn meta_result(reply: MetaReply, not_found: impl FnOnce() -> String) -> Result<(), NodeError> {
    match reply {
        MetaReply::Ok | MetaReply::Created | MetaReply::Queue(_) | MetaReply::NewQueue(_) => Ok(()),
        MetaReply::NotFound => Err(NodeError::NotFound(not_found())),
        MetaReply::Invalid(why) => Err(NodeError::Invalid(why)),
        MetaReply::Conflict(why) => Err(NodeError::Conflict(why)),
        MetaReply::Refused(why) => Err(NodeError::Refused(why)),
    }
}

impl QueueGroup {
    fn is_member(&self, id: NodeId) -> bool {
        self.raft.metrics().borrow().membership_config.membership().get_node(&id).is_some()
    }
    fn is_leader(&self, id: NodeId) -> bool {
        let rx = self.raft.metrics();
        let m = rx.borrow();
        m.state == ServerState::Leader && m.current_leader == Some(id)
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
        self.db.remove_node_value(&failover::term_floor_key(group))?;
        self.db.remove_node_value(&catchup::new_mirror_key(group))
    }

    fn addr_of(&self, id: NodeId) -> Option<String> {
        if let Some(n) = self.meta.borrow().nodes.get(&id) {
            return Some(n.raft_addr.clone());
        }
        // Before registration completes, the metadata membership knows it.
        self.meta_raft.metrics().borrow().membership_config.membership().get_node(&id).map(|n| n.addr.clone())
    }

    /// When the link to `id` broke by itself, if it is broken now.
    fn link_lost_at(&self, id: NodeId) -> Option<Instant> {
        self.transport.link_lost_at(&self.addr_of(id)?)
    }

    async fn call(&self, target: NodeId, req: &RpcRequest, deadline: Instant) -> Result<RpcResponse, CallError> {
        if self.transport.control.is_blocked(target) {
            return Err(CallError::Unreachable(format!("node {target}"), "blocked by test hook".into()));
        }
        let addr = self
            .addr_of(target)
            .ok_or_else(|| CallError::Unreachable(format!("node {target}"), "address unknown".into()))?;
        let wait = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
        self.transport.call(&addr, req, wait).await
    }

    async fn local_queue_op(
        &self,
        group: GroupId,
        cmds: Vec<QueueCmd>,
        lane: Lane,
    ) -> Result<Vec<QueueReply>, NodeError> {
        self.local_enqueue(group, cmds, lane).await?.await.unwrap_or(Err(NodeError::Stopped))
    }

    /// Put operations in this node's proposer for `group`, in call order
    /// within their lane ([`Lane`]).
    async fn local_enqueue(&self, group: GroupId, cmds: Vec<QueueCmd>, lane: Lane) -> Result<Answer, NodeError> {
        let g = self.groups.read().expect("poisoned").get(&group).cloned();
        match g {
            Some(g) => g.proposer.enqueue(cmds, lane).await,
            None => Err(NodeError::NotLeader { leader: None }),
        }
    }

    async fn local_meta_write(&self, cmd: MetaCmd) -> Result<(MetaReply, u64), NodeError> {
        match self.meta_raft.client_write(Request::Meta(cmd)).await {
            Ok(resp) => match resp.data {
                Response::Meta(r) => Ok((r, resp.log_id.index)),
                other => Err(NodeError::Invalid(format!("metadata group answered {other:?}"))),
            },
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => {
                Err(NodeError::NotLeader { leader: f.leader_id })
            }
            Err(e) => Err(NodeError::Unavailable(e.to_string())),
        }
    }

    fn raft_of(&self, group: GroupId) -> Option<Raft> {
        if group == METADATA_GROUP {
            return Some(self.meta_raft.clone());
        }
        self.groups.read().expect("poisoned").get(&group).map(|g| g.raft.clone())
    }
}

impl Inner {
    /// The local Raft of `group` if the sender is in the same epoch. A
    /// sender in an older epoch is told ours; one in a newer epoch means
    /// this replica must heal before it takes part again.
    fn raft_in_epoch(&self, group: GroupId, epoch: Epoch, from: NodeId) -> Result<Raft, RpcResponse> {
        if group == METADATA_GROUP {
            return Ok(self.meta_raft.clone());
        }
        let g = self.groups.read().expect("poisoned").get(&group).cloned();
        match g {
            None => Err(RpcResponse::UnknownGroup(group)),
            Some(g) if g.epoch == epoch => Ok(g.raft.clone()),
            Some(g) if g.epoch > epoch => Err(RpcResponse::NewerEpoch(g.epoch)),
            Some(_) => {
                let _ = self.news.send(EpochNews { group, epoch, from });
                Err(RpcResponse::UnknownGroup(group))
            }
        }
    }
}

impl RpcHandler for Inner {
    async fn admit(self: Arc<Self>, req: RpcRequest) -> server::Completion {
        if let RpcRequest::Queue { group, cmds, lane } = req {
            return match self.local_enqueue(group, cmds, lane).await {
                Ok(answer) => {
                    Box::pin(async move { RpcResponse::Queue(answer.await.unwrap_or(Err(NodeError::Stopped))) })
                }
                Err(e) => Box::pin(std::future::ready(RpcResponse::Queue(Err(e)))),
            };
        }
        Box::pin(self.handle(req))
    }
}

impl Inner {
    async fn handle(self: Arc<Self>, req: RpcRequest) -> RpcResponse {
        match req {
            RpcRequest::Append { group, epoch, from, req } => match self.raft_in_epoch(group, epoch, from) {
                Ok(r) => {
                    if let Some(g) = self.groups.read().expect("poisoned").get(&group) {
                        *g.master_heard.lock().expect("poisoned") = Some(Instant::now());
                    }
                    self.metrics.appends_received.inc();
                    RpcResponse::Append(r.append_entries(req).await)
                }
                Err(refusal) => refusal,
            },
            RpcRequest::Vote { group, epoch, from, req } => match self.raft_in_epoch(group, epoch, from) {
                Ok(r) => RpcResponse::Vote(r.vote(req).await),
                Err(refusal) => refusal,
            },
            RpcRequest::Snapshot { group, epoch, from, req } => match self.raft_in_epoch(group, epoch, from) {
                Ok(r) => RpcResponse::Snapshot(r.install_snapshot(req).await),
                Err(refusal) => refusal,
            },
            RpcRequest::Fork { group } => {
                let rec = self.fork_record(group);
                let formed = rec.as_ref().and_then(|r| split::formed_at(&self.db, group, r.epoch));
                RpcResponse::Fork(rec, formed)
            }
            RpcRequest::History { group } => RpcResponse::History(self.history(group).await),
            RpcRequest::Yield { group, defeated, winner, from } => {
                let node = Node { inner: self };
                tokio::spawn(async move { node.yield_to(group, defeated, winner, from).await });
                RpcResponse::Done
            }
            RpcRequest::Handback { group, epoch, batches } => {
                let g = self.groups.read().expect("poisoned").get(&group).cloned();
                match g {
                    Some(g) if g.epoch == epoch => {
                        let cmds =
                            batches.into_iter().map(|(origin, msgs)| QueueCmd::Handback { origin, msgs }).collect();
                        RpcResponse::Queue(self.local_queue_op(group, cmds, Lane::Arrival).await)
                    }
                    // The epoch moved on again: the sender must heal into this one.
                    Some(g) if g.epoch > epoch => RpcResponse::NewerEpoch(g.epoch),
                    _ => RpcResponse::Queue(Err(NodeError::NotLeader { leader: None })),
                }
            }
            RpcRequest::Bodies { group, from, ranges, max_bytes, totals, report } => {
                RpcResponse::Bodies(self.serve_bodies(group, from, ranges, max_bytes, totals, report).await)
            }
            RpcRequest::SyncControl { group, run } => {
                self.sync_control(group, run);
                RpcResponse::Done
            }
            RpcRequest::Join { info } => {
                let node = Node { inner: self };
                RpcResponse::Member(node.admit(info).await)
            }
            RpcRequest::Forget { id } => {
                let node = Node { inner: self };
                RpcResponse::Member(node.forget_locally(id).await)
            }
            RpcRequest::MoveMaster { group, to } => {
                let node = Node { inner: self };
                RpcResponse::Moved(node.move_master(group, to, false).await)
            }
            RpcRequest::Elect { group, from, leaving } => {
                if leaving {
                    self.down.write().expect("poisoned").insert(from);
                }
                let g = self.groups.read().expect("poisoned").get(&group).cloned();
                // A replica still fetching bodies never stands, asked or not:
                // as master it would answer gets without those bodies.
                if let Some(r) = g.filter(|g| g.plan.borrow().is_none()).map(|g| g.raft.clone()) {
                    // The other mirrors refuse votes until the lease of the
                    // old master's last heartbeat runs out: keep standing
                    // until someone leads, a little longer than that lease.
                    let (me, until) = (self.id, Instant::now() + self.timing.election_max * 2);
                    let step = self.timing.heartbeat;
                    tokio::spawn(async move {
                        while Instant::now() < until {
                            let m = r.metrics().borrow().clone();
                            if m.current_leader.is_some_and(|l| l != from) || m.state == ServerState::Leader {
                                return;
                            }
                            if m.state != ServerState::Candidate {
                                let _ = r.trigger().elect().await;
                            }
                            tokio::time::sleep(step).await;
                        }
                        tracing::debug!(node = me, "gave up standing after a handover");
                    });
                }
                RpcResponse::Done
            }
            RpcRequest::Queue { group, cmds, lane } => RpcResponse::Queue(self.local_queue_op(group, cmds, lane).await),
            RpcRequest::Clients => {
                let (c, k) = self.clients.snapshot();
                RpcResponse::Clients(c, k)
            }
            RpcRequest::Owners { owners, held } => RpcResponse::Owners(
                self.owners.alive_of(&owners),
                held.into_iter()
                    .map(|(owner, queue, tags)| (owner, self.owners.unknown(owner, &queue, &tags)))
                    .filter(|(_, unknown)| !unknown.is_empty())
                    .collect(),
            ),
            RpcRequest::Readings => RpcResponse::Readings(self.alarms.readings()),
            RpcRequest::MetaIndex => {
                let m = self.meta_raft.metrics().borrow().clone();
                RpcResponse::MetaIndex(if m.current_leader == Some(self.id) {
                    m.last_applied.map(|l| l.index)
                } else {
                    None
                })
            }
            // A replica that has received no membership yet (a new mirror
            // not yet reached by the master) knows nothing: it must not look
            // like a group that excludes the asker, which would then drop
            // what may be the only complete copy of the queue.
            RpcRequest::Members { group } => RpcResponse::Members(self.raft_of(group).and_then(|r| {
                let m = r.metrics().borrow().membership_config.clone();
                m.log_id().is_some().then(|| m.membership().nodes().map(|(id, _)| *id).collect())
            })),
            RpcRequest::Meta { cmd } => {
                let leader = self.meta_raft.metrics().borrow().current_leader;
                RpcResponse::Meta(if leader == Some(self.id) {
                    self.local_meta_write(cmd).await
                } else {
                    Err(NodeError::NotLeader { leader })
                })
            }
            RpcRequest::Client(c) => {
                let node = Node { inner: self };
                RpcResponse::Client(node.client_request(c).await)
            }
        }
    }
}

impl Node {
    async fn client_request(&self, req: ClientRequest) -> Result<ClientReply, NodeError> {
        match req {
            ClientRequest::DeclareQueue { name, replicas } => {
                self.declare_queue(&name, replicas).await.map(ClientReply::Declared)
            }
            ClientRequest::DeleteQueue { name } => self.delete_queue(&name).await.map(|_| ClientReply::Deleted),
            ClientRequest::QueueInfo { name } => self.queue_info(&name).map(ClientReply::QueueInfo),
            ClientRequest::QueueOp { queue, cmds } => self.queue_op(&queue, cmds).await.map(ClientReply::Queue),
        }
    }

    /// Is this node the master of the queue right now?
    pub fn is_master(&self, queue: &str) -> bool {
        self.queue_raft(queue).map(|r| r.metrics().borrow().state == ServerState::Leader).unwrap_or(false)
    }
}
