//! Start-up (storage, identity, the metadata group, the node link's
//! server, the background tasks) and shutdown, graceful or a crash for tests.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mirrorq_storage::{DbOptions, NodeDb, SmSpace, StorageError};
use openraft::BasicNode;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::{
    told, Inner, Node, NodeConfig, Timing, FORMAT, FORMAT_KEY, FOUNDING_FLOOR_KEY, INCARNATION_KEY, NODE_ID_KEY,
    REFILL_KEY,
};
use crate::alarms::Alarms;
use crate::error::ServerError;
use crate::ids::{NodeId, METADATA_GROUP};
use crate::link::beacon::Beacon;
use crate::link::server;
use crate::link::transport::Transport;
use crate::metadata::{ChangeFeed, MetaCmd, MetaMachine, MetaState, NodeInfo};
use crate::metadata::{MetaLog, MetaRaft};
use crate::metrics::Metrics;
use crate::owners::Owners;
use crate::queue::epoch::Epoch;
use crate::raft::state_machine::StateMachine;
use crate::wire::raft_net::{EpochNews, NetworkFactory};

/// What failover's task is fed from outside it: peers' news of newer
/// epochs (the Raft network's refusals) and asks to yield.
type Failing = (mpsc::UnboundedReceiver<EpochNews>, mpsc::UnboundedReceiver<crate::failover::YieldAsk>);

/// Open the data dir; one a power cut or a failing disk has damaged is set
/// aside (kept whole) for an empty one, which the cluster refills like a new
/// mirror's. A node with no peer to refill it refuses to start instead: it
/// would otherwise go on as if it had never held anything.
fn open_or_set_aside(cfg: &NodeConfig) -> Result<NodeDb, ServerError> {
    let opts = DbOptions { cache_bytes: cfg.cache_bytes, wal_segment_bytes: cfg.wal_segment_bytes };
    // Damage found by the first reads (sled reads its file lazily) is
    // damage found at open.
    let err = match NodeDb::open(&cfg.data_dir, &opts).and_then(|db| first_look(db, &cfg.data_dir)) {
        Ok(db) => return Ok(db),
        Err(e) => e,
    };
    let has_peers = cfg.join.is_some() || cfg.cluster.keys().any(|id| *id != cfg.node_id);
    if !err.is_damage() || !has_peers {
        return Err(err.into());
    }
    let aside = mirrorq_storage::set_aside(&cfg.data_dir)?;
    tracing::error!(
        error = %err,
        kept = %aside.display(),
        "the data dir is damaged: set aside whole; this node starts empty and its peers refill it"
    );
    let db = NodeDb::open(&cfg.data_dir, &opts)?;
    db.put_node_value(REFILL_KEY, &[])?;
    Ok(db)
}

/// The opened dir as this node left it, or the damage that shows.
fn first_look(db: NodeDb, data_dir: &std::path::Path) -> Result<NodeDb, StorageError> {
    if db.get_node_value(NODE_ID_KEY)?.is_some() || db.get_node_value(REFILL_KEY)?.is_some() {
        return Ok(db);
    }
    // Every start writes the node's id to sled, durably, before any group
    // writes to the log: a log beside a sled without it is a sled that lost
    // what it held (sled 0.34 can open a damaged file as empty, without an
    // error), votes given included.
    let groups = db.wal().groups();
    if groups.is_empty() {
        // New beside a dir set aside: the power went between the two (or
        // the mark's write failed), and this is the refill's dir.
        if mirrorq_storage::was_set_aside(data_dir) {
            db.put_node_value(REFILL_KEY, &[])?;
        }
        return Ok(db);
    }
    Err(StorageError::SledEmptied { path: data_dir.join("sled"), groups })
}

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

    /// Start-up, phase by phase, in the order of their effects: storage
    /// first (the rest reads and writes it), a crash's step-downs before
    /// any group starts, the background tasks once the node link serves.
    pub(super) async fn start_with(cfg: NodeConfig, bound: Option<std::net::TcpListener>) -> Result<Node, ServerError> {
        if cfg.node_id == 0 {
            return Err(ServerError::Config("--node-id must be >= 1".into()));
        }
        let started = Instant::now();
        let (db, refill) = open_storage(&cfg, started)?;
        step_down_after_crash(&db, cfg.node_id)?;
        let (incarnation, founding_floor) = begin_life(&db)?;
        let (listener, addr) = bind_link(&cfg, bound).await?;
        let (raft_config, queue_raft_config) = raft_configs(&cfg.timing)?;
        let stop = CancellationToken::new();
        let (beacon, transport) = start_transport(&cfg, &stop)?;
        let (news, news_rx) = mpsc::unbounded_channel();
        let (yields, yields_rx) = mpsc::unbounded_channel();
        let (meta_raft, meta, feed) = start_metadata(&cfg, &db, raft_config, &news, &transport).await?;

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
            groups: Default::default(),
            #[cfg(feature = "test-hooks")]
            knobs: super::knobs::Knobs::new(&cfg.test),
            standings: Default::default(),
            hints: Mutex::new(HashMap::new()),
            clients: Arc::new(crate::clients::Clients::with_limit(cfg.max_connections)),
            owners: Arc::new(Owners::new(cfg.node_id, incarnation)),
            told: told::Told::default(),
            alarms: Arc::new(Alarms::new(&cfg.data_dir, cfg.memory_high_watermark, cfg.disk_free_limit)),
            metrics: Metrics::default(),
            rates: Default::default(),
            news,
            yields,
            peers: crate::peers::Peers::new(cfg.node_id),
            failover: Default::default(),
            replicas_started: tokio::sync::watch::Sender::new(false),
            refill: Mutex::new(refill.then(HashMap::new)),
            founding_floor: std::sync::atomic::AtomicU64::new(founding_floor),
            quiescence: crate::peers::quiet::Quiescence::new(incarnation),
            closing: stop.child_token(),
            failed: CancellationToken::new(),
            stopped_once: tokio::sync::OnceCell::new(),
            stop,
        });

        serve_link(&inner, listener, &beacon, &cfg);
        let joining = bootstrap_metadata(&cfg, &meta_raft, refill, &addr).await?;
        let node = Node { inner };
        node.spawn_tasks(cfg.join.clone().filter(|_| joining), feed, (news_rx, yields_rx));
        tracing::info!(
            id = cfg.node_id,
            %addr,
            data_dir = %cfg.data_dir.display(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "node started"
        );
        Ok(node)
    }

    /// The node's background tasks; `join`: the member to join the cluster
    /// through, for a new node joining one.
    fn spawn_tasks(&self, join: Option<String>, feed: ChangeFeed, failing: Failing) {
        if let Some(via) = join {
            self.spawn_join(via);
        }
        self.spawn_refill_watch();
        self.spawn_reconciler(feed);
        self.spawn_registration();
        self.spawn_fatal_watch();
        self.spawn_metadata_leadership_count();
        self.spawn_log_compactor();
        self.spawn_reaper();
        self.spawn_expirer();
        self.spawn_liveness();
        self.failover().run(failing.0, failing.1);
        self.spawn_rate_sampler();
    }

    /// Stop the node: masterships handed over (`ha-promote-on-shutdown`), no
    /// new work, every group shut down, storage synced.
    pub async fn shutdown(&self) {
        self.inner.stopped_once.get_or_init(|| self.stop_once()).await;
    }

    async fn stop_once(&self) {
        self.inner.closing.cancel();
        let successors = self.failover().prepare_hand_over();
        self.failover().announce_departure().await;
        // Move each mastership while this node can still vote for its
        // successor (which then wins at once); what does not move in time
        // is handed over the slow way below, after the groups stop.
        let successors = self.failover().move_masters_away(successors).await;
        self.inner.stop.cancel();
        let groups: Vec<_> = self.inner.groups.drain();
        // All at once: one after another, thousands of groups took minutes.
        futures::future::join_all(groups.iter().map(|g| {
            g.stop.cancel();
            g.shut_down()
        }))
        .await;
        self.failover().hand_over(successors).await;
        self.inner.transport.close_all();
        let _ = self.inner.meta_raft.shutdown().await;
        if let Err(e) = self.inner.db.flusher().sync().await {
            tracing::error!(error = %e, "final sync failed");
            return;
        }
        let db = self.inner.db.clone();
        match tokio::task::spawn_blocking(move || db.mark_clean_stop()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(error = %e, "the stop cannot be recorded as clean"),
            Err(e) => tracing::error!(error = %e, "the stop cannot be recorded as clean"),
        }
    }

    /// Stop the node (fail-stop) when its storage fails, or when the
    /// metadata group's Raft core quits (a storage error in it: a queue's
    /// replica restarts on its own, a node without its metadata cannot).
    pub(super) fn spawn_fatal_watch(&self) {
        let node = self.clone();
        let mut fatal = self.inner.db.fatal();
        let mut meta = self.inner.meta_raft.metrics();
        tokio::spawn(async move {
            // The storage layer said why when it raised the flag.
            let storage = async {
                if fatal.wait_for(|f| f.is_some()).await.is_err() {
                    // The storage is gone: a stop is under way.
                    std::future::pending::<()>().await;
                }
            };
            let metadata = async {
                // Not a shutdown's `Stopped`: only a core that quit on its
                // own, or whose metrics ended without a word (its task
                // panicked).
                let why = match meta
                    .wait_for(|m| matches!(&m.running_state, Err(f) if !matches!(f, openraft::error::Fatal::Stopped)))
                    .await
                {
                    Ok(m) => m.running_state.as_ref().err().map(|e| e.to_string()).unwrap_or_default(),
                    Err(_) => "its task ended".to_string(),
                };
                tracing::error!(reason = %why, "the metadata group's Raft core quit: stopping the node (fail-stop)");
            };
            tokio::select! {
                // A stop under way (a shutdown, a test's crash) first: what
                // fails after it is not news.
                biased;
                _ = node.inner.stop.cancelled() => return,
                () = storage => {}
                () = metadata => {}
            }
            node.inner.failed.cancel();
            node.shutdown().await;
        });
    }

    /// Count the metadata group's leaderships won here (`/metrics`): an
    /// election with nothing wrong is a false alarm worth seeing.
    fn spawn_metadata_leadership_count(&self) {
        let node = self.clone();
        let mut m = self.inner.meta_raft.metrics();
        tokio::spawn(async move {
            let mut led: Option<u64> = None;
            loop {
                tokio::select! {
                    _ = node.inner.stop.cancelled() => return,
                    r = m.changed() => if r.is_err() { return },
                }
                let (state, term) = {
                    let now = m.borrow_and_update();
                    (now.state, now.current_term)
                };
                if state == openraft::ServerState::Leader && led != Some(term) {
                    led = Some(term);
                    node.inner.metrics.metadata_leaderships.inc();
                }
            }
        });
    }

    /// Announce this node's name and address in the metadata until it sticks.
    pub(super) fn spawn_registration(&self) {
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
}

/// Open the data dir (set aside if damaged) and check it is this node's;
/// whether it waits for the cluster to refill it.
fn open_storage(cfg: &NodeConfig, started: Instant) -> Result<(NodeDb, bool), ServerError> {
    let db = open_or_set_aside(cfg)?;
    let refill = db.get_node_value(REFILL_KEY)?.is_some();
    tracing::info!(elapsed_ms = started.elapsed().as_millis() as u64, "storage opened");
    #[cfg(feature = "test-hooks")]
    if cfg.test.crash_image {
        db.keep_crash_image().map_err(|e| ServerError::Config(format!("crash image: {e}")))?;
    }
    match db.get_node_value(NODE_ID_KEY)? {
        Some(b) => {
            let found = u64::from_be_bytes(b.as_slice().try_into().unwrap_or([0; 8]));
            if found != cfg.node_id {
                return Err(ServerError::WrongNode { path: cfg.data_dir.clone(), found, configured: cfg.node_id });
            }
            let format = db.get_node_value(FORMAT_KEY)?;
            if format.as_deref() != Some(&FORMAT.to_be_bytes()[..]) {
                let found = format.and_then(|b| b.try_into().ok()).map(u32::from_be_bytes);
                return Err(ServerError::Format { path: cfg.data_dir.clone(), found, reads: FORMAT });
            }
        }
        None => {
            // The format first: a start cut short between the two leaves a
            // dir without a node id, which the next start takes for new.
            db.put_node_value(FORMAT_KEY, &FORMAT.to_be_bytes())?;
            db.put_node_value(NODE_ID_KEY, &cfg.node_id.to_be_bytes())?;
        }
    }
    Ok((db, refill))
}

fn step_down_after_crash(db: &NodeDb, me: NodeId) -> Result<(), ServerError> {
    if !db.started_clean() {
        // Before any group starts: see `LogStore::step_down_after_crash`.
        // It goes over every group's vote, queue or metadata, whose
        // format is the same in both.
        let led = MetaLog::step_down_after_crash(db, me).map_err(|e| ServerError::Raft(e.to_string()))?;
        if !led.is_empty() {
            tracing::warn!(
                groups = led.len(),
                "the last stop was not clean: the groups this node led go to an election, which a replica \
                 with every committed entry wins"
            );
        }
    }
    Ok(())
}

/// Record this start's life; it and the founding floor
/// (`Inner::founding_floor`).
fn begin_life(db: &NodeDb) -> Result<(u64, u64), ServerError> {
    // A new life: owners of unacked messages made before are dead.
    let stored = db.get_node_value(INCARNATION_KEY)?;
    let stored = stored.map(|b| u64::from_be_bytes(b.as_slice().try_into().unwrap_or([0; 8])));
    // An empty data dir: which queues were declared before it is not
    // known until the metadata leader says (before the first life).
    if stored.is_none() {
        db.put_node_value(FOUNDING_FLOOR_KEY, &[])?;
    }
    let founding_floor = match db.get_node_value(FOUNDING_FLOOR_KEY)? {
        None => 0,
        Some(b) => b.as_slice().try_into().map_or(u64::MAX, u64::from_be_bytes),
    };
    let incarnation = next_life(stored, unix_millis());
    db.put_node_value(INCARNATION_KEY, &incarnation.to_be_bytes())?;
    Ok((incarnation, founding_floor))
}

/// The node link's listener (`bound`, or bound here) and its address.
async fn bind_link(
    cfg: &NodeConfig,
    bound: Option<std::net::TcpListener>,
) -> Result<(TcpListener, String), ServerError> {
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
    Ok((listener, addr))
}

/// The metadata group's Raft config, and the queue groups'.
fn raft_configs(t: &Timing) -> Result<(Arc<openraft::Config>, Arc<openraft::Config>), ServerError> {
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
    Ok((Arc::new(raft_config), queue_raft_config))
}

/// The beacon (with its watch on this runtime) and the node link's
/// transport to the peers.
fn start_transport(cfg: &NodeConfig, stop: &CancellationToken) -> Result<(Arc<Beacon>, Arc<Transport>), ServerError> {
    let beacon = Arc::new(Beacon::start(stop.child_token()).map_err(ServerError::Beacon)?);
    // A node whose runtime makes no progress for the failure timeout is
    // as good as gone to its peers.
    beacon.watch_this_runtime(cfg.timing.failure_timeout);
    let transport = Arc::new(
        Transport::with_beacon(beacon.clone()).with_secret(cfg.cluster_secret.clone()).with_tls(cfg.link_tls.clone()),
    );
    Ok((beacon, transport))
}

/// The metadata group's Raft on its stored log and state machine; the
/// metadata's watch and its change feed.
async fn start_metadata(
    cfg: &NodeConfig,
    db: &NodeDb,
    raft_config: Arc<openraft::Config>,
    news: &mpsc::UnboundedSender<EpochNews>,
    transport: &Arc<Transport>,
) -> Result<(MetaRaft, watch::Receiver<Arc<MetaState>>, ChangeFeed), ServerError> {
    let meta_log = MetaLog::new(db.clone(), METADATA_GROUP);
    let meta_sm = StateMachine::<MetaMachine>::open(SmSpace::new(db.clone(), METADATA_GROUP), cfg.node_id)?
        .applying_durable(meta_log.durability());
    let (meta, feed) = meta_sm.with(|m| (m.subscribe(), m.feed())).await;
    let meta_raft = MetaRaft::new(
        cfg.node_id,
        raft_config,
        NetworkFactory {
            group: METADATA_GROUP,
            epoch: Epoch::default(),
            me: cfg.node_id,
            news: news.clone(),
            transport: transport.clone(),
            catching: None,
        },
        meta_log,
        meta_sm.clone(),
    )
    .await
    .map_err(|e| ServerError::Raft(e.to_string()))?;
    meta_sm.enable_snapshot_transfer();
    Ok((meta_raft, meta, feed))
}

/// Serve the node link, and watch memory and disk.
fn serve_link(inner: &Arc<Inner>, listener: TcpListener, beacon: &Beacon, cfg: &NodeConfig) {
    let gate = Arc::new(server::Gate::new(
        cfg.cluster_secret.clone(),
        cfg.link_tls.clone(),
        inner.metrics.link_refused.clone(),
    ));
    server::serve(listener, inner.clone(), beacon, gate, inner.stop.clone());
    inner.alarms.clone().spawn(inner.stop.clone());
    spawn_disk_full_alarm(inner, cfg.wal_segment_bytes);
}

/// On a data dir that holds no cluster yet: found one (every listed node
/// does so alike), or wait to be refilled; whether the node joins one
/// instead.
async fn bootstrap_metadata(
    cfg: &NodeConfig,
    meta_raft: &MetaRaft,
    refill: bool,
    addr: &str,
) -> Result<bool, ServerError> {
    let pristine = !meta_raft.is_initialized().await.map_err(|e| ServerError::Raft(e.to_string()))?;
    let joining = pristine && cfg.join.is_some();
    if pristine && refill {
        tracing::warn!("this data dir replaced a damaged one: waiting for the cluster to refill it");
    } else if pristine && !joining {
        let mut members: BTreeMap<NodeId, BasicNode> =
            cfg.cluster.iter().map(|(id, a)| (*id, BasicNode { addr: a.clone() })).collect();
        if members.is_empty() {
            members.insert(cfg.node_id, BasicNode { addr: addr.to_string() });
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
    Ok(joining)
}

/// Raise the disk alarm as soon as the write-ahead log meets a full disk,
/// until a segment's worth is free beyond the limit.
fn spawn_disk_full_alarm(inner: &Arc<Inner>, segment_bytes: u64) {
    let mut full = inner.db.wal().no_space();
    let (alarms, stop) = (inner.alarms.clone(), inner.stop.clone());
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                r = full.changed() => if r.is_err() { return },
            }
            alarms.disk_full(segment_bytes);
        }
    });
}

/// This start's life (incarnation): one more than the last, and on a fresh
/// data dir the clock's milliseconds rather than 1, so that a node back on
/// an emptied dir is not taken for its first life (peers that heard that
/// life say it is stopping would think so still, and ignore its replicas'
/// reports; its consumers' owner ids would be that life's).
fn next_life(stored: Option<u64>, now_ms: u64) -> u64 {
    match stored {
        Some(last) => last.wrapping_add(1),
        None => now_ms.max(1),
    }
}

fn unix_millis() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_data_dir_starts_its_lives_from_the_clock_not_from_one() {
        let first = next_life(None, 1_796_480_000_000);
        assert_eq!(next_life(Some(first), 1_796_480_000_500), first + 1, "a restart is the next life");
        // The dir emptied after a few lives and the node started again.
        let again = next_life(None, 1_796_490_000_000);
        assert!(again > first + 1, "a node back on an empty dir taken for an earlier life");
        assert_eq!(next_life(None, 0), 1, "no clock: still a life");
    }
}
