//! A replica fetching the message bodies its installed snapshot left out
//! (see `queue::catchup`), and the master's side: serving those bodies and
//! keeping the replicas' reports, which take them out of the synchronised
//! set until they have everything.
//!
//! The fetch runs beside the queue: the master reads bodies from sled
//! without the state machine's lock and the replica stores each chunk
//! between two applies, so publishing and consuming go on meanwhile.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mirrorq_storage::SmSpace;

use crate::error::NodeError;
use crate::ids::{GroupId, NodeId};
use crate::node::{Inner, Node, QueueGroup};
use crate::queue::catchup::Plan;
use crate::queue::confirm_gate::Standing;
use crate::queue::QueueMachine;
use crate::queue::QueueRaft;
use crate::raft::state_machine::stored_applied;
use crate::wire::ask;
use crate::wire::{Body, BodyChunk};

/// Most ranges named in one request (a plan is usually one or two).
const RANGES_PER_REQUEST: usize = 64;
/// How often a replica that is behind reports to the master.
const REPORT_EVERY: Duration = Duration::from_secs(1);
/// Shortest and longest wait before asking again after an answer that
/// brought nothing this replica lacks.
const STALL_MIN: Duration = Duration::from_millis(50);
const STALL_MAX: Duration = Duration::from_secs(2);
/// How often progress is logged.
const LOG_EVERY: Duration = Duration::from_secs(5);

/// The ranges of `plan` one request names.
fn head(plan: &Plan) -> &[(u64, u64)] {
    &plan.missing[..plan.missing.len().min(RANGES_PER_REQUEST)]
}

/// Marks a replica that joined an existing queue as a new mirror: with
/// `ha-sync-mode: manual` its catch-up waits for a `sync` action. Replicas
/// that were members before (restarted, healed) always catch up at once:
/// fetching never stops the queue, so there is no reason to make them wait.
pub(in crate::node) fn new_mirror_key(group: GroupId) -> String {
    format!("new-mirror.{group}")
}

/// Before a new mirror joins a `manual` queue: snapshot the master's state
/// and purge the log it covers, so the mirror is sent the snapshot (the
/// queue's index without bodies) and then only entries after it: it holds
/// what is published from now on, as in RabbitMQ. If the purge does not
/// happen in time the mirror replicates the log instead and so ends up
/// synchronised by itself.
pub(in crate::node) async fn snapshot_and_purge(raft: &QueueRaft, queue: &str) {
    let applied = raft.metrics().borrow().last_applied.map(|l| l.index);
    let Some(applied) = applied else { return };
    let limit = Some(Duration::from_secs(5));
    let _ = raft.trigger().snapshot().await;
    let snap =
        raft.wait(limit).metrics(|m| m.snapshot.is_some_and(|s| s.index >= applied), "snapshot for a new mirror").await;
    let Ok(m) = snap else {
        tracing::warn!(queue, "no snapshot in time: the new mirror replicates the whole log");
        return;
    };
    let upto = m.snapshot.map_or(applied, |s| s.index);
    let _ = raft.trigger().purge_log(upto).await;
    let purged =
        raft.wait(limit).metrics(|m| m.purged.is_some_and(|p| p.index >= upto), "log purged for a new mirror").await;
    if purged.is_err() {
        tracing::warn!(queue, "log not purged in time: the new mirror replicates it");
    }
}

/// A catch-up's fetching, from one chunk to the next.
struct Fetching {
    /// When progress was last logged.
    last_log: Instant,
    /// When the master last heard how this replica stands.
    last_report: Option<Instant>,
    /// The master's applied index after each read: applying that far
    /// makes every body it lacked gone here too.
    must_apply: Option<u64>,
    /// Wait between asks that bring nothing.
    stalled: Duration,
}

impl Node {
    /// Run the catch-up of one hosted replica until its group stops.
    pub(in crate::node) fn spawn_catch_up(&self, g: Arc<QueueGroup>) {
        let node = self.clone();
        tokio::spawn(async move {
            let stop = g.stop.clone();
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = node.catch_up(g) => {}
            }
        });
    }

    /// Runs for every replica, mostly waiting: what it awaits only while
    /// working (reports, fetches, the finish) is boxed, so the waiting task
    /// holds none of it.
    async fn catch_up(&self, g: Arc<QueueGroup>) {
        let mut plan_rx = g.plan.clone();
        let mut run_rx = g.sync_run.subscribe();
        let mut metrics = g.raft.metrics();
        let mut started = self.inner.replicas_started.subscribe();
        // The master this replica last reported to, and its term: a master
        // re-elected in a new term has forgotten the reports of the old one.
        let mut told: Option<(NodeId, u64)> = None;
        let began = Instant::now();
        let mut fetch =
            Fetching { last_log: Instant::now(), last_report: None, must_apply: None, stalled: Duration::ZERO };
        loop {
            let Some(plan) = plan_rx.borrow_and_update().clone() else {
                // Complete: say so to each new master, which counts this
                // replica as synchronised only after hearing it.
                let master = {
                    let m = metrics.borrow_and_update();
                    m.current_leader.filter(|l| *l != self.id()).map(|l| (l, m.current_term))
                };
                // A node that is stopping stays silent: a master that counted
                // it as synchronised would wait for it after it is gone. So
                // does one still starting its replicas, until it is done.
                let leaving = self.inner.failover.is_leaving();
                let ready = *started.borrow_and_update();
                if master.is_some() && master != told && !leaving && ready {
                    match Box::pin(self.report(&g, false)).await {
                        Ok(standing) if standing.behind.is_none() => told = master,
                        // A snapshot came since the plan was looked at:
                        // told behind, it is fetched next.
                        Ok(_) | Err(_) => {
                            tokio::time::sleep(Duration::from_millis(100)).await;
                            continue;
                        }
                    }
                }
                tokio::select! {
                    r = plan_rx.changed() => if r.is_err() { return },
                    r = metrics.changed() => if r.is_err() { return },
                    r = started.changed(), if !ready => if r.is_err() { return },
                }
                continue;
            };
            told = None;
            g.raft.runtime_config().elect(false);
            if plan.is_done() {
                self.try_finish_catch_up(&g, &plan, fetch.must_apply, began).await;
                continue;
            }
            let running = *run_rx.borrow_and_update() || !self.waits_for_sync(&g);
            if !running {
                if fetch.last_report.is_none_or(|t| t.elapsed() >= REPORT_EVERY)
                    && Box::pin(self.report(&g, false)).await.is_ok()
                {
                    fetch.last_report = Some(Instant::now());
                }
                tokio::select! {
                    _ = plan_rx.changed() => {}
                    _ = run_rx.changed() => {}
                    _ = metrics.changed() => fetch.last_report = None,
                    _ = tokio::time::sleep(REPORT_EVERY) => {}
                }
                continue;
            }
            self.fetch_chunk(&g, &plan, &mut fetch).await;
        }
    }

    /// Finish a catch-up whose `plan` has everything; on an error, wait a
    /// little before the caller looks again.
    async fn try_finish_catch_up(&self, g: &QueueGroup, plan: &Plan, must_apply: Option<u64>, began: Instant) {
        match Box::pin(self.finish_catch_up(g, must_apply)).await {
            // A snapshot installed meanwhile brought more to fetch.
            Ok(false) => {}
            Ok(true) => {
                self.inner.told.cleared(g.meta.group, "finish catch-up");
                self.inner.told.cleared(g.meta.group, "store bodies");
                tracing::info!(queue = %g.meta.name, messages = plan.msgs_done, bytes = plan.bytes_done,
                    elapsed_ms = began.elapsed().as_millis() as u64, "mirror synchronised");
                let _ = g.sync_run.send(false);
            }
            Err(e) => {
                if self.inner.repeated(g.meta.group, "finish catch-up", &e.to_string()) {
                    tracing::warn!(queue = %g.meta.name, error = %e, "cannot finish the catch-up yet (told once until it changes)");
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }

    /// Fetch and store the next chunk of `plan`'s bodies.
    async fn fetch_chunk(&self, g: &QueueGroup, plan: &Plan, f: &mut Fetching) {
        let chunk = self.inner.catch_up_bytes as u32;
        match Box::pin(self.ask_bodies(g, plan, chunk, plan.bytes_total.is_none())).await {
            Ok(c) => {
                f.last_report = Some(Instant::now());
                f.must_apply = f.must_apply.max(c.applied);
                let upto = c.next.unwrap_or_else(|| head(plan).last().map_or(0, |r| r.1));
                let bodies: Vec<(u64, Vec<u8>)> = c.bodies.into_iter().map(|b| (b.seq, b.data)).collect();
                let r = Box::pin(g.sm.with_mut(|m, space| m.fill(space, &bodies, upto, c.bytes_total))).await;
                if let Err(e) = r {
                    if self.inner.repeated(g.meta.group, "store bodies", &e.to_string()) {
                        tracing::error!(queue = %g.meta.name, error = %e, "cannot store fetched bodies (told once until it changes)");
                    }
                    tokio::time::sleep(Duration::from_millis(500)).await;
                } else if g.plan.borrow().as_ref().is_some_and(|p| p.missing == plan.missing) {
                    // The master sent nothing this replica still lacks.
                    // Once this replica has applied as far as the master
                    // had when it read, what stays is lacking there too:
                    // say so, and keep asking (a new master may have it).
                    let applied = g.raft.metrics().borrow().last_applied.map(|l| l.index);
                    if applied >= f.must_apply {
                        let held = plan.missing.iter().map(|(s, e)| e - s).sum::<u64>();
                        let why = format!("the master has no body for {held} held messages");
                        if self.inner.repeated(g.meta.group, "store bodies", &why) {
                            tracing::warn!(queue = %g.meta.name, messages = held, "the master has no body for messages this replica holds: not synchronised until one does (told once until it changes)");
                        }
                    }
                    f.stalled = (f.stalled * 2).clamp(STALL_MIN, STALL_MAX);
                    tokio::time::sleep(f.stalled).await;
                } else {
                    f.stalled = Duration::ZERO;
                }
                if f.last_log.elapsed() >= LOG_EVERY {
                    f.last_log = Instant::now();
                    if let Some(p) = g.plan.borrow().as_ref() {
                        tracing::info!(queue = %g.meta.name, messages_done = p.msgs_done, messages_total = p.msgs_total,
                            bytes_done = p.bytes_done, bytes_total = ?p.bytes_total, "mirror synchronising");
                    }
                }
            }
            Err(e) => {
                tracing::debug!(queue = %g.meta.name, error = %e, "no bodies from the master yet");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }

    /// A new mirror of a `manual` queue waits for a `sync` action.
    pub(in crate::node) fn waits_for_sync(&self, g: &QueueGroup) -> bool {
        let new = matches!(self.inner.db.get_node_value(&new_mirror_key(g.meta.group)), Ok(Some(_)));
        new && !crate::failover::ha_of(&self.metadata(), &g.meta).sync_automatic
    }

    async fn finish_catch_up(&self, g: &QueueGroup, must_apply: Option<u64>) -> Result<bool, NodeError> {
        let unavailable = |e: &dyn std::fmt::Display| NodeError::Unavailable(e.to_string());
        if must_apply.is_some() {
            g.raft
                .wait(Some(Duration::from_secs(5)))
                .applied_index_at_least(must_apply, "catch-up applied as far as the master had")
                .await
                .map_err(|e| unavailable(&e))?;
        }
        let space = g.sm.space().await;
        // Bodies durable before the plan goes: a crash in between only
        // repeats this step.
        space.sync().await.map_err(|e| unavailable(&e))?;
        if !g.sm.with_mut(|m, space| m.finish_catch_up(space)).await.map_err(|e| unavailable(&e))? {
            return Ok(false);
        }
        space.sync().await.map_err(|e| unavailable(&e))?;
        self.inner.db.remove_node_value(&new_mirror_key(g.meta.group)).map_err(|e| unavailable(&e))?;
        Ok(true)
    }

    /// Tell the master how this replica stands (`running`: fetching),
    /// fetching nothing; what was told.
    async fn report(&self, g: &QueueGroup, running: bool) -> Result<Standing, NodeError> {
        let standing = self.inner.standing(g, running).await;
        self.call_master(g, standing, Vec::new(), 0, false).await.map(|_| standing)
    }

    /// Ask the master for the next chunk of `plan`'s bodies.
    async fn ask_bodies(
        &self,
        g: &QueueGroup,
        plan: &Plan,
        max_bytes: u32,
        totals: bool,
    ) -> Result<BodyChunk, NodeError> {
        let standing = self.inner.standing(g, true).await;
        self.call_master(g, standing, head(plan).to_vec(), max_bytes, totals).await
    }

    /// Ask the master this replica's Raft follows, and no other: a
    /// redirect or a guess could reach the master of another epoch, whose
    /// sequence numbers name other messages. So this is not
    /// [`Node::forward`]; the catch-up loop tries again.
    async fn call_master(
        &self,
        g: &QueueGroup,
        standing: Standing,
        ranges: Vec<(u64, u64)>,
        max_bytes: u32,
        totals: bool,
    ) -> Result<BodyChunk, NodeError> {
        self.inner.bodies_hold().await;
        let req = ask::Bodies { group: g.meta.group, from: self.id(), standing, ranges, max_bytes, totals };
        let master = g.raft.metrics().borrow().current_leader;
        let Some(master) = master.filter(|m| *m != self.id()) else {
            return Err(NodeError::NotLeader { leader: None });
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        self.inner.ask(master, req, deadline).await?
    }

    /// Start (`run`) or stop fetching the bodies the queue's mirrors lack:
    /// the `sync` and `cancel_sync` actions. Every replica is told; a
    /// replica that is down catches up by itself when it returns (it was a
    /// member before, see [`new_mirror_key`]).
    pub async fn sync_queue(&self, name: &str, run: bool) -> Result<(), NodeError> {
        let q = self.find_queue(name).await?;
        for r in &q.replicas {
            if *r == self.id() {
                self.inner.sync_control(q.group, run);
                continue;
            }
            let deadline = Instant::now() + Duration::from_secs(2);
            let req = ask::SyncControl { group: q.group, run };
            if let Err(e) = self.inner.ask(*r, req, deadline).await {
                tracing::warn!(queue = name, node = r, error = %e, "replica not told to sync");
            }
        }
        Ok(())
    }
}

impl Inner {
    /// How `g`'s bodies stand now (`running`: fetching), for its master.
    pub(in crate::node) async fn standing(&self, g: &QueueGroup, running: bool) -> Standing {
        // Read before the look: a master of a later term than this never
        // counts it (see `Standing::term`).
        let term = g.raft.metrics().borrow().current_term;
        let life = self.quiescence.incarnation();
        // Under the state machine's lock, which every change of the plan
        // (an install, a fetched chunk, the finish) holds: the plan, and
        // the order of this look among those changes.
        g.sm.with(|_| Standing {
            term,
            life,
            seq: self.standings.fetch_add(1, Ordering::AcqRel),
            behind: g.plan.borrow().as_ref().map(|plan| plan.progress(running)),
        })
        .await
    }

    pub(in crate::node) fn sync_control(&self, group: GroupId, run: bool) {
        if let Some(g) = self.groups.get(group) {
            g.sync_run.send_replace(run);
        }
    }

    /// Master side of [`ask::Bodies`].
    pub(in crate::node) async fn serve_bodies(
        &self,
        group: GroupId,
        (from, standing): (NodeId, Standing),
        ranges: Vec<(u64, u64)>,
        max_bytes: u32,
        totals: bool,
    ) -> Result<BodyChunk, NodeError> {
        let g = self.groups.get(group);
        let Some(g) = g else { return Err(NodeError::NotLeader { leader: None }) };
        if !g.is_leader(self.id) {
            return Err(NodeError::NotLeader { leader: g.raft.metrics().borrow().current_leader });
        }
        let term = g.raft.metrics().borrow().current_term;
        g.catching.write().expect("poisoned").record(term, from, standing);
        if ranges.is_empty() {
            return Ok(BodyChunk { bodies: Vec::new(), next: None, applied: None, bytes_total: None });
        }
        let space = SmSpace::new(self.db.clone(), group);
        let read = tokio::task::spawn_blocking(move || {
            let total = if totals { Some(QueueMachine::bytes_in(&space, &ranges)?) } else { None };
            let (bodies, next) = QueueMachine::read_bodies(&space, &ranges, max_bytes as usize)?;
            // Read after the bodies, from the same store the applies write
            // atomically with their removals: covers every body not found.
            let applied = stored_applied(&space)?.map(|l| l.index);
            Ok::<_, mirrorq_storage::StorageError>((bodies, next, total, applied))
        })
        .await
        .map_err(|e| NodeError::Unavailable(e.to_string()))?;
        let (bodies, next, bytes_total, applied) = read.map_err(|e| NodeError::Unavailable(e.to_string()))?;
        Ok(BodyChunk {
            bodies: bodies.into_iter().map(|(seq, data)| Body { seq, data }).collect(),
            next,
            applied,
            bytes_total,
        })
    }
}
