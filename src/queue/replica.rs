//! One hosted queue replica, as the data plane sees it: its Raft, the
//! machine over its space, and what it runs as master (the proposer, the
//! confirm gate, the consumers' ranking). One instance lives from its
//! start to its shut-down; a re-formed or healed group is a new instance.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use openraft::ServerState;
use prometheus_client::metrics::counter::Counter;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use super::catchup::Plan;
use super::confirm_gate::{self, CatchingUp, SyncState};
use super::epoch::Epoch;
use super::hush::Hush;
use super::proposer::{Answer, DeadLetterSink, Lane, Proposer, PARK_MAX};
use super::ranking::Ranking;
use super::{QueueCmd, QueueMachine, QueueRaft, QueueReply, QueueStats};
use crate::error::NodeError;
use crate::ids::NodeId;
use crate::metadata::QueueMeta;
use crate::peers::PeerNews;
use crate::raft::state_machine::StateMachine;

/// A replica and, in `ext`, what the layers above keep for this instance
/// of it (the node keeps its failure watch's state there), so that it
/// lives and dies with the instance.
pub struct Replica<X> {
    pub meta: QueueMeta,
    /// The epoch this replica is in; fixed for the life of this Raft
    /// instance (re-forming and healing start a new one).
    pub epoch: Epoch,
    pub raft: QueueRaft,
    /// A membership change towards the metadata's replicas is under way.
    pub changing: AtomicBool,
    /// Whether this replica leads, as its confirm gate last saw the
    /// metrics: lets a scan over every replica skip the followers without
    /// a look at each one's metrics ([`Replica::is_leader`]).
    pub leading: Arc<AtomicBool>,
    /// Its heartbeats, off while it is quiet.
    pub hush: Arc<Hush>,
    pub proposer: Proposer,
    pub sync: watch::Receiver<SyncState>,
    pub stats: watch::Receiver<QueueStats>,
    pub sm: StateMachine<QueueMachine>,
    /// Bodies this replica still lacks (`None`: it has them all).
    pub plan: watch::Receiver<Option<Plan>>,
    /// A `sync` action asked this replica to fetch what it lacks.
    pub sync_run: watch::Sender<bool>,
    /// As master: members fetching bodies, by their reports.
    pub catching: CatchingUp,
    /// As master: which registered consumers are asking, by priority.
    pub ranking: Ranking,
    /// As master: when the queue was last used (for `x-expires`).
    pub used: Mutex<Instant>,
    pub stop: CancellationToken,
    pub ext: X,
}

/// What a replica's machinery is started from: its Raft, already running
/// over its log and machine, and what the node lends it.
pub struct Parts {
    pub meta: QueueMeta,
    pub epoch: Epoch,
    pub raft: QueueRaft,
    pub sm: StateMachine<QueueMachine>,
    /// Shared with the Raft's network, which records the snapshots' answers.
    pub catching: CatchingUp,
    /// How long a replica may lag before it is no longer synchronised.
    pub sync_timeout: Duration,
    pub peers: watch::Receiver<PeerNews>,
    /// Counts each leadership taken (node-wide).
    pub leaderships: Counter,
    pub dead_letters: DeadLetterSink,
    pub stop: CancellationToken,
}

impl<X> Replica<X> {
    /// Start the confirm gate and the proposer of a replica whose Raft runs.
    pub async fn start(p: Parts, ext: X) -> Self {
        let (stats, plan) = p.sm.with(|m| (m.stats(), m.plan())).await;
        let leading = Arc::new(AtomicBool::new(false));
        let sync = confirm_gate::spawn(
            p.meta.group,
            p.raft.clone(),
            p.sync_timeout,
            p.peers,
            p.catching.clone(),
            confirm_gate::Leadership { taken: p.leaderships, now: leading.clone() },
            p.stop.clone(),
        );
        let hush = Arc::new(Hush::new(p.raft.clone()));
        let proposer = Proposer::spawn(
            p.raft.clone(),
            hush.clone(),
            sync.clone(),
            p.sync_timeout,
            p.dead_letters,
            stats.clone(),
            p.stop.clone(),
        );
        Self {
            meta: p.meta,
            epoch: p.epoch,
            raft: p.raft,
            changing: AtomicBool::new(false),
            leading,
            hush,
            proposer,
            sync,
            stats,
            sm: p.sm,
            plan,
            sync_run: watch::channel(false).0,
            catching: p.catching,
            ranking: Ranking::default(),
            used: Mutex::new(Instant::now()),
            stop: p.stop,
            ext,
        }
    }

    /// Operations on this replica, answered once applied; only its
    /// master's proposer takes them.
    pub async fn run(&self, cmds: Vec<QueueCmd>, lane: Lane) -> Result<Vec<QueueReply>, NodeError> {
        let lane = match cmds.as_slice() {
            [QueueCmd::Get { owner, consumer: Some(c), .. }] if self.stats.borrow().ranked => {
                match self.ranked_get((*owner, c.number), c.priority, lane).await {
                    Some(lane) => lane,
                    None => return Ok(vec![QueueReply::Got { msgs: Vec::new(), remaining: 0 }]),
                }
            }
            _ => lane,
        };
        self.enqueue(cmds, lane).await?.await.unwrap_or(Err(NodeError::Stopped))
    }

    /// Put operations in this replica's proposer, in call order within
    /// their lane ([`Lane`]).
    pub async fn enqueue(&self, cmds: Vec<QueueCmd>, lane: Lane) -> Result<Answer, NodeError> {
        if cmds.iter().any(uses_queue) {
            *self.used.lock().expect("poisoned") = Instant::now();
        }
        self.proposer.enqueue(cmds, lane).await
    }

    /// A consumer's get of a queue with registered consumers
    /// ([`super::ranking`]), before it is proposed: `None` when it is not
    /// this consumer's turn (another is the single active one, or one of a
    /// higher priority is asking), answered empty without an entry; else
    /// the lane to propose it in.
    async fn ranked_get(&self, who: (u64, u64), priority: i32, lane: Lane) -> Option<Lane> {
        let _asking = self.ranking.begin(who, priority);
        let mut stats = self.stats.clone();
        if stats.borrow().active_consumer.is_some_and(|active| active != who) {
            // Waits for the registrations to change rather than asking again at once.
            let _ = tokio::time::timeout(PARK_MAX, stats.changed()).await;
            return None;
        }
        let lane = if lane == Lane::Parked {
            // Parked in the proposer, it would be served by the next
            // publish even if a consumer of a higher priority asked
            // meanwhile: it waits for messages here instead.
            let ready = tokio::time::timeout(PARK_MAX, stats.wait_for(|s| s.ready > 0)).await;
            if !ready.is_ok_and(|r| r.is_ok()) {
                return None;
            }
            Lane::Consumer
        } else {
            lane
        };
        if self.ranking.outranked(priority) {
            tokio::time::sleep(super::ranking::RECENT).await;
            if self.ranking.outranked(priority) {
                return None;
            }
        }
        Some(lane)
    }

    /// Stop the replica's Raft and close its state machine, so no write of
    /// this instance lands after this (see [`StateMachine::close`]).
    pub async fn shut_down(&self) {
        let _ = self.raft.shutdown().await;
        self.sm.close().await;
    }

    pub fn is_member(&self, id: NodeId) -> bool {
        self.raft.metrics().borrow().membership_config.membership().get_node(&id).is_some()
    }

    /// Whether node `id` (this one) leads the replica's group now.
    pub fn is_leader(&self, id: NodeId) -> bool {
        // Set a moment after the metrics show a new leadership, and cleared
        // a moment after they show its end: the metrics decide whenever it
        // is set.
        if !self.leading.load(Ordering::Acquire) {
            return false;
        }
        let rx = self.raft.metrics();
        let m = rx.borrow();
        m.state == ServerState::Leader && m.current_leader == Some(id)
    }
}

/// Does this command count as using the queue (for `x-expires`)?
fn uses_queue(cmd: &QueueCmd) -> bool {
    matches!(
        cmd,
        QueueCmd::Get { .. }
            | QueueCmd::Consume { .. }
            | QueueCmd::Status
            | QueueCmd::Ack { .. }
            | QueueCmd::AckOf { .. }
            | QueueCmd::Nack { .. }
            | QueueCmd::NackOf { .. }
    )
}
