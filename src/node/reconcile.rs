//! Bringing hosted replicas in line with the metadata, every half second and
//! on each change: start and stop queue groups, steer their membership
//! toward the wanted replicas, then watch for failures.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;
use mirrorq_storage::SmSpace;
use openraft::{BasicNode, ChangeMembers, CommittedLeaderId, Entry, EntryPayload, LogId, Membership, Vote};

use super::failover::Busy;
use super::{body_fetch, deadletter, failover, Node, QueueGroup, CATCH_UP_SLACK};
use crate::error::ServerError;
use crate::ids::{GroupId, NodeId};
use crate::metadata::{ChangeFeed, MetaState, QueueMeta, Touched};
use crate::queue::epoch::Epoch;
use crate::queue::epoch::FOUNDING_TERM;
use crate::queue::replica::{Parts, Replica};
use crate::queue::{confirm_gate, QueueMachine};
use crate::queue::{QueueLog as LogStore, QueueRaft as Raft, QueueTypes};
use crate::raft::state_machine::StateMachine;
use crate::wire::ask;
use crate::wire::raft_net::NetworkFactory;

/// Replicas started at once by one round.
const STARTS_AT_ONCE: usize = 16;
/// Replicas started by one round; the next round starts right after it
/// (the failure watch runs between them, so a restart with thousands of
/// replicas to start does not hold up failover).
const STARTS_PER_ROUND: usize = 256;
/// The failure watch goes over every hosted group, so a burst of metadata
/// changes (declares) runs it no more often than the half-second tick,
/// which runs it anyway.
const WATCH_AT_MOST_EVERY: Duration = Duration::from_millis(500);

/// What the reconciler's last look over every queue left: while it left
/// nothing to start or stop and no replica was taken out since, a tick
/// does not look again (with ten thousand queues, looking costs more than
/// all else an idle node does).
#[derive(Debug, Default)]
pub(super) struct Sweep {
    settled: bool,
    /// `Replicas::removals` when the look began.
    removals: u64,
    /// Replicas are left to start and this round started some: the next
    /// round comes at once.
    more: bool,
    /// This round looked at every queue (not a declare's or a delete's).
    full: bool,
    /// The metadata the last round saw: where a queue deleted since still
    /// tells its group.
    last: Option<Arc<MetaState>>,
}

/// What one round does to the hosted groups.
struct Work {
    to_start: Vec<QueueMeta>,
    to_stop: Vec<Arc<QueueGroup>>,
    to_steer: Vec<Arc<QueueGroup>>,
    /// More replicas are left to start than one round starts.
    more: bool,
}

/// This node's replica's queue, if the metadata still has it.
fn queue_of<'a>(state: &'a MetaState, g: &QueueGroup) -> Option<&'a QueueMeta> {
    state.queues.get(&g.meta.name).filter(|q| q.group == g.meta.group)
}

impl Node {
    /// Keep the hosted groups equal to the metadata's wish.
    pub(super) fn spawn_reconciler(&self, mut feed: ChangeFeed) {
        self.spawn_founding_floor();
        let node = self.clone();
        tokio::spawn(async move {
            // Also on a timer: a replica leaves only once the group's
            // membership no longer has it, and masters move.
            let mut tick = tokio::time::interval(Duration::from_millis(500));
            // What each failing group last reported: a failure that repeats
            // every round is logged once, and counted.
            let mut told: HashMap<GroupId, String> = HashMap::new();
            let mut last_watch: Option<Instant> = None;
            let mut ticked = true;
            let mut sweep = Sweep::default();
            loop {
                let (state, touched) = feed.latest();
                // A declare or a delete changes no other queue: the failure
                // watch's verdicts on the others stand.
                if touched == Touched::All {
                    node.inner.quiescence.world_changed();
                }
                let failed = node.reconcile(&state, &touched, &mut sweep).await;
                sweep.last = Some(state.clone());
                // A declare's round looks at its own queues only.
                if sweep.full && !sweep.more {
                    node.inner.replicas_started.send_if_modified(|s| !std::mem::replace(s, true));
                }
                if node.inner.watch_due() && (ticked || last_watch.is_none_or(|t| t.elapsed() >= WATCH_AT_MOST_EVERY)) {
                    last_watch = Some(Instant::now());
                    node.inner.failover.want_watch();
                }
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
                if sweep.more {
                    ticked = false;
                    tokio::task::yield_now().await;
                    continue;
                }
                ticked = tokio::select! {
                    biased;
                    _ = node.inner.stop.cancelled() => return,
                    r = feed.changed() => if r.is_err() { return } else { false },
                    _ = tick.tick() => true,
                };
            }
        });
    }

    /// One round: start, stop and steer the hosted groups (the failure
    /// watch runs after it). A group that fails is reported and the others go on (one
    /// replica that cannot start must not keep every other queue on the
    /// node from failing over).
    /// `touched`: the queues whose metadata changed since the last round
    /// (none on a tick). Their replicas get the policy's settings again and
    /// their masters steer membership; the others only when not quiet (a
    /// quiet group's membership cannot have moved since it settled: a
    /// change is an entry, which wakes it). A tick looks over every queue
    /// for replicas to start or stop only while the last look left some,
    /// or a replica was taken out since: a start that failed, or waited
    /// for a heal, is retried then.
    pub(super) async fn reconcile(
        &self,
        state: &MetaState,
        touched: &Touched,
        sweep: &mut Sweep,
    ) -> Vec<(GroupId, ServerError)> {
        let mut failed = Vec::new();
        let removals = self.inner.groups.removals();
        // A declare or a delete looks at its own queues only; a tick, or a
        // change to policies or nodes, at every one.
        let nothing = BTreeSet::new();
        let names = match touched {
            Touched::Some(names) => Some(names),
            Touched::None if sweep.settled && sweep.removals == removals => Some(&nothing),
            Touched::None | Touched::All => None,
        };
        // Whatever this round leaves undone makes the next tick look again;
        // a round that looked at some queues only vouches for no others.
        let (mut settled, removals) = match names {
            None => (true, removals),
            Some(_) => (sweep.settled, sweep.removals),
        };
        let concerned = self.concerned(state, touched, sweep.last.as_deref());
        let Work { to_start, to_stop, to_steer, more } =
            self.round_work(state, touched, names, concerned.as_deref(), &mut settled);
        // Moved away but still a member in our own view: the final
        // membership entry never reaches a removed node, so ask the replicas
        // that stay whether the change excluding us is in effect. (Moves
        // come with a policy or node change, or show at the next tick.)
        let moved = match names {
            Some(_) => Vec::new(),
            None => self.moved_away(state),
        };
        settled &= to_stop.is_empty() && moved.is_empty();
        self.drop_moved(moved, &mut failed).await;
        // What the queue's policy and arguments ask of its publishes holds
        // from the next publish on, so it is set at every change (the
        // failure watch runs less often); a replica started since got it
        // at its start.
        if *touched != Touched::None {
            self.set_publish_limits(state, touched, concerned.as_deref());
        }
        for g in to_steer {
            if let Some(q) = queue_of(state, &g) {
                self.steer_membership(g.clone(), q, state);
            }
        }
        self.stop_replicas(to_stop, &mut failed).await;
        let started_any = self.start_replicas(to_start, state, &mut failed, &mut settled).await;
        // Replicas that cannot start wait for the next tick, not spin.
        *sweep = Sweep { settled, removals, more: more && started_any, full: names.is_none(), last: sweep.last.take() };
        failed
    }

    /// The hosted groups a declare or a delete may concern: found by the
    /// queues' names, in this metadata and in the `last` round's (which
    /// still has a queue deleted since, or the group of one declared
    /// again); with ten thousand groups, going over all of them at every
    /// declare cost more than the declare. A name in neither (declared
    /// and deleted between two rounds) makes this round go over all.
    fn concerned(
        &self,
        state: &MetaState,
        touched: &Touched,
        last: Option<&MetaState>,
    ) -> Option<Vec<Arc<QueueGroup>>> {
        match touched {
            Touched::Some(names) => {
                let groups = self.inner.groups.read();
                let mut found = BTreeMap::new();
                let mut unknown = false;
                for name in names {
                    let now = state.queues.get(name).map(|q| q.group);
                    let before = last.and_then(|l| l.queues.get(name)).map(|q| q.group);
                    unknown |= now.is_none() && before.is_none();
                    for gid in now.into_iter().chain(before) {
                        if let Some(g) = groups.get(&gid) {
                            found.insert(gid, g.clone());
                        }
                    }
                }
                (!unknown).then(|| found.into_values().collect())
            }
            Touched::None | Touched::All => None,
        }
    }

    /// What a round does, from one look at the table: the replicas it
    /// starts, the groups it stops and those whose membership it steers
    /// (of `concerned`, else of those `names`, else of all).
    fn round_work(
        &self,
        state: &MetaState,
        touched: &Touched,
        names: Option<&BTreeSet<String>>,
        concerned: Option<&[Arc<QueueGroup>]>,
        settled: &mut bool,
    ) -> Work {
        let me = self.id();
        let wants = |q: &QueueMeta| q.replicas.contains(&me);
        let groups = self.inner.groups.read();
        let startable = |q: &&QueueMeta| wants(q) && !groups.contains_key(&q.group);
        let mut to_start: Vec<QueueMeta> = match names {
            Some(names) => names.iter().filter_map(|n| state.queues.get(n)).filter(startable).cloned().collect(),
            None => state.queues.values().filter(startable).cloned().collect(),
        };
        let wanted = to_start.len();
        to_start.retain(|q| !self.inner.failover.is_busy(q.group));
        let more = to_start.len() > STARTS_PER_ROUND;
        to_start.truncate(STARTS_PER_ROUND);
        *settled &= to_start.len() == wanted;
        // Deleted, or moved away and already out of the group's
        // membership (so stopping cannot cost the group a vote).
        let stoppable = |g: &Arc<QueueGroup>| queue_of(state, g).is_none_or(|q| !wants(q) && !g.is_member(me));
        let (to_stop, to_steer) = match concerned {
            Some(concerned) => (
                concerned.iter().filter(|g| stoppable(g)).cloned().collect(),
                concerned.iter().filter(|g| g.is_leader(me)).cloned().collect(),
            ),
            None => (
                groups
                    .values()
                    .filter(|g| names.is_none_or(|n| n.contains(&g.meta.name)))
                    .filter(|g| stoppable(g))
                    .cloned()
                    .collect(),
                groups
                    .values()
                    .filter(|g| (!g.hush.is_quiet() || touched.contains(&g.meta.name)) && g.is_leader(me))
                    .cloned()
                    .collect(),
            ),
        };
        Work { to_start, to_stop, to_steer, more }
    }

    /// Hosted groups whose queue no longer wants a replica here while our
    /// own view still has this node a member; with the replicas that stay.
    fn moved_away(&self, state: &MetaState) -> Vec<(Arc<QueueGroup>, Vec<NodeId>)> {
        let me = self.id();
        let wants = |q: &QueueMeta| q.replicas.contains(&me);
        self.inner
            .groups
            .read()
            .values()
            .filter_map(|g| {
                queue_of(state, g).filter(|q| !wants(q) && g.is_member(me)).map(|q| (g.clone(), q.replicas.clone()))
            })
            .collect()
    }

    /// Drop each replica in `moved` once a replica that stays says the
    /// membership excludes this node.
    async fn drop_moved(&self, moved: Vec<(Arc<QueueGroup>, Vec<NodeId>)>, failed: &mut Vec<(GroupId, ServerError)>) {
        for (g, stay) in moved {
            if !self.excluded_by_peers(g.meta.group, g.epoch, &stay).await {
                continue;
            }
            // Not while a re-form or a heal holds it (they may replace it).
            let Some(_busy) = Busy::take(&self.inner.failover.busy, g.meta.group) else { continue };
            if self.inner.take_out(&g) {
                g.stop.cancel();
                g.shut_down().await;
                match self.inner.drop_replica(g.meta.group) {
                    Ok(()) => tracing::info!(queue = %g.meta.name, "queue replica moved away"),
                    Err(e) => failed.push((g.meta.group, e.into())),
                }
            }
        }
    }

    /// The touched queues' publish limits, on their replicas here (of
    /// `concerned`, else of all).
    fn set_publish_limits(&self, state: &MetaState, touched: &Touched, concerned: Option<&[Arc<QueueGroup>]>) {
        let set_limits = |g: &QueueGroup| {
            if let Some(q) = queue_of(state, g).filter(|_| touched.contains(&g.meta.name)) {
                g.proposer.set_min_synchronised(failover::ha_of(state, q).min_synchronised.unwrap_or(0));
                g.proposer.set_limits(deadletter::limits_of(state, q));
            }
        };
        match concerned {
            Some(concerned) => concerned.iter().for_each(|g| set_limits(g)),
            None => self.inner.groups.read().values().for_each(|g| set_limits(g)),
        }
    }

    async fn stop_replicas(&self, to_stop: Vec<Arc<QueueGroup>>, failed: &mut Vec<(GroupId, ServerError)>) {
        for g in to_stop {
            let Some(_busy) = Busy::take(&self.inner.failover.busy, g.meta.group) else { continue };
            if !self.inner.take_out(&g) {
                continue;
            }
            g.stop.cancel();
            g.shut_down().await;
            match self.inner.drop_replica(g.meta.group) {
                Ok(()) => tracing::info!(queue = %g.meta.name, "queue replica removed"),
                Err(e) => failed.push((g.meta.group, e.into())),
            }
        }
    }

    /// Start the replicas of `to_start`; whether any started. One that
    /// fails leaves the round unsettled.
    async fn start_replicas(
        &self,
        to_start: Vec<QueueMeta>,
        state: &MetaState,
        failed: &mut Vec<(GroupId, ServerError)>,
        settled: &mut bool,
    ) -> bool {
        // Started side by side: each start waits on its own group's tasks
        // and on sled, and a burst of declares (or a restart) brings many.
        let starts = to_start.into_iter().map(|q| async move {
            // A heal may have begun since the list was made.
            if self.inner.failover.is_busy(q.group) {
                return Some(None);
            }
            let group = q.group;
            self.start_group(q, state).await.err().map(|e| Some((group, e)))
        });
        let mut starting = futures::stream::iter(starts).buffer_unordered(STARTS_AT_ONCE);
        let mut started_any = false;
        while let Some(r) = starting.next().await {
            match r {
                Some(left) => {
                    *settled = false;
                    failed.extend(left);
                }
                None => started_any = true,
            }
        }
        started_any
    }

    /// Does a replica of `group` in our `epoch` on one of `peers` say the
    /// membership excludes this node? Replicas of another epoch are not
    /// asked about ours: else a minority's fork that dropped this node from
    /// its own membership would make a replica of the majority's epoch
    /// delete itself, and lose what that epoch had confirmed.
    pub(super) async fn excluded_by_peers(&self, group: GroupId, epoch: Epoch, peers: &[NodeId]) -> bool {
        let deadline = Instant::now() + Duration::from_secs(1);
        for peer in peers.iter().filter(|p| **p != self.id()) {
            let req = ask::Members { group, epoch: Some(epoch) };
            if let Ok(Some(members)) = self.inner.ask(*peer, req, deadline).await {
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
    pub(super) fn steer_membership(&self, g: Arc<QueueGroup>, q: &QueueMeta, state: &MetaState) {
        let wanted: BTreeSet<NodeId> = q.replicas.iter().copied().collect();
        let (voters, all): (BTreeSet<NodeId>, BTreeSet<NodeId>) = {
            let rx = g.raft.metrics();
            let m = rx.borrow();
            let membership = m.membership_config.membership();
            (membership.voter_ids().collect(), membership.nodes().map(|(id, _)| *id).collect())
        };
        if voters == wanted && all == wanted {
            return;
        }
        let q = q.clone();
        if g.changing.swap(true, Ordering::AcqRel) {
            return;
        }
        let addrs: BTreeMap<NodeId, String> = state.nodes.values().map(|n| (n.id, n.raft_addr.clone())).collect();
        let manual = !failover::ha_of(state, &q).sync_automatic;
        let held = self.inner.promotions_held();
        let inner = self.inner.clone();
        tokio::spawn(async move {
            let result: Result<(), String> = async {
                if manual && wanted.difference(&all).next().is_some() {
                    body_fetch::snapshot_and_purge(&g.raft, &q.name).await;
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
                    .filter(|id| {
                        voters.contains(id) || (!held && matched(id).is_some_and(|i| i + CATCH_UP_SLACK >= last))
                    })
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

    /// On a data dir that started empty, learn the last queue group id
    /// declared before it (`Inner::founding_floor`) as soon as a metadata
    /// leader is known: queues declared between the start and then count
    /// as older, which only makes their founder ask.
    fn spawn_founding_floor(&self) {
        if self.inner.founding_floor.load(Ordering::Acquire) != u64::MAX {
            return;
        }
        let node = self.clone();
        tokio::spawn(async move {
            let mut m = node.inner.meta_raft.metrics();
            loop {
                let led = m.wait_for(|m| m.current_leader.is_some());
                tokio::select! {
                    _ = node.inner.stop.cancelled() => return,
                    r = led => if r.is_err() { return },
                }
                if node.meta_caught_up().await {
                    let floor = node.metadata().next_group;
                    match node.inner.db.put_node_value_async(super::FOUNDING_FLOOR_KEY, &floor.to_be_bytes()).await {
                        Ok(()) => node.inner.founding_floor.store(floor, Ordering::Release),
                        Err(e) => tracing::error!(error = %e, "cannot record which queues predate this data dir"),
                    }
                    return;
                }
                tokio::select! {
                    _ = node.inner.stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        });
    }

    /// Whether the founder may found `group` on a blank replica without
    /// asking: the queue was declared during this life, so this node saw
    /// it new and founds it for the first time.
    fn founds_freely(&self, group: GroupId) -> bool {
        group > self.inner.founding_floor.load(Ordering::Acquire)
    }

    /// A blank replica of a queue declared before this life: its founder may
    /// have founded it in an earlier life, on a data dir since emptied or
    /// replaced, and led it since; founding it again would lead term 1 once
    /// more and write other entries at indexes its replicas hold. So it
    /// founds only if no other replica's storage holds anything of the
    /// group, and otherwise starts blank, to be filled by the group's
    /// master. An error while some replica cannot tell (it is retried).
    async fn founded_before(&self, q: &QueueMeta) -> Result<bool, ServerError> {
        let me = self.id();
        let others: BTreeSet<NodeId> = q.replicas.iter().chain(&q.initial).copied().filter(|id| *id != me).collect();
        let deadline = Instant::now() + Duration::from_secs(1);
        for peer in others {
            match self.inner.ask(peer, ask::Holds { group: q.group }, deadline).await {
                Ok(false) => {}
                Ok(true) => return Ok(true),
                _ => {
                    return Err(ServerError::Raft(format!(
                        "cannot tell whether queue '{}' ran before this node's data dir: node {peer} did not answer",
                        q.name
                    )))
                }
            }
        }
        Ok(false)
    }

    pub(super) async fn start_group(&self, q: QueueMeta, state: &MetaState) -> Result<(), ServerError> {
        self.inner.start_hold(&q.name).await;
        let started = Instant::now();
        let db = &self.inner.db;
        let epoch = failover::load_epoch(db, q.group, self.id())?;
        let mut log = LogStore::new(db.clone(), q.group);
        let sm = StateMachine::<QueueMachine>::open(SmSpace::new(db.clone(), q.group), self.id())?
            .applying_durable(log.durability());
        let founded = self.found_if_first(&q, state, epoch, &mut log).await?;
        let catching = confirm_gate::CatchingUp::default();
        let raft = self.new_queue_raft(q.group, epoch, log, &sm, &catching).await?;
        let parts = Parts {
            meta: q.clone(),
            epoch,
            raft: raft.clone(),
            sm,
            catching,
            sync_timeout: self.inner.timing.sync_timeout,
            peers: self.inner.peers.subscribe(),
            leaderships: self.inner.metrics.queue_leaderships.clone(),
            dead_letters: deadletter::sink(Arc::downgrade(&self.inner), q.name.clone()),
            stop: self.inner.stop.child_token(),
        };
        let tracked = failover::Tracked {
            heard: failover::Heard::new(),
            watch: failover::GroupWatch::new(raft.metrics()),
            split: failover::SplitMemory::default(),
        };
        let group = Arc::new(Replica::start(parts, tracked).await);
        group.proposer.set_min_synchronised(failover::ha_of(state, &q).min_synchronised.unwrap_or(0));
        group.proposer.set_limits(deadletter::limits_of(state, &q));
        self.register(&group).await?;

        // A mirror added after the declare starts blank and is filled by
        // its master; one that joined a re-formed epoch waits for that
        // epoch's master.
        let pristine = !raft.is_initialized().await.map_err(|e| ServerError::Raft(e.to_string()))?;
        if pristine && epoch == Epoch::default() && !q.initial.contains(&self.id()) {
            db.put_node_value(&body_fetch::new_mirror_key(q.group), &[])?;
        }
        // A restarted replica does not stand on its own timer: its master
        // may be a quiet one, which sends no heartbeats to hear; this node
        // learns so from the master's node, and the failure watch decides
        // at its next round (with ten thousand such replicas, standing on
        // the timer brought an election per queue at every restart).
        if !(pristine || founded) || group.plan.borrow().is_some() || self.inner.failover.is_quiet(q.group) {
            raft.runtime_config().elect(false);
        }
        self.spawn_catch_up(group.clone());
        self.spawn_expiry(group);
        tracing::info!(queue = %q.name, group = q.group, %epoch, founded, elapsed_ms = started.elapsed().as_millis() as u64, "queue replica started");
        Ok(())
    }

    /// Whether this replica founded its group, on `log`, just now.
    async fn found_if_first(
        &self,
        q: &QueueMeta,
        state: &MetaState,
        epoch: Epoch,
        log: &mut LogStore,
    ) -> Result<bool, ServerError> {
        // A new queue's group is founded already led: its designated master
        // writes the membership and the blank entry of term 1, then a
        // committed vote for itself in term 1, which is what winning the
        // first election would have left, and starts as leader. Its mirrors
        // start blank and take that log (and the vote with it) from its
        // first append, so they know no members, and cannot stand, before
        // the master has reached them. An election per queue (a vote synced
        // on every node, then a blank entry) cost a third of a declare.
        // Never twice: `found` leaves a replica that ever held anything
        // alone, and `initial` is emptied once the founder leaves the
        // replicas (which deletes its replica), so a master moved away and
        // back starts blank and is filled by the group's leader.
        let me = self.id();
        let mut founding = epoch == Epoch::default() && q.initial.first() == Some(&me);
        if founding && !self.founds_freely(q.group) && log.is_blank().map_err(|e| ServerError::Raft(e.to_string()))? {
            founding = !self.founded_before(q).await?;
        }
        let founded = founding
            && log
                .found(&Vote::new_committed(FOUNDING_TERM, me), founding_log(q, state, me))
                .await
                .map_err(|e| ServerError::Raft(e.to_string()))?;
        Ok(founded)
    }

    /// The Raft of a queue replica on its stored `log` and `sm`.
    async fn new_queue_raft(
        &self,
        group: GroupId,
        epoch: Epoch,
        log: LogStore,
        sm: &StateMachine<QueueMachine>,
        catching: &confirm_gate::CatchingUp,
    ) -> Result<Raft, ServerError> {
        let raft = Raft::new(
            self.id(),
            self.inner.queue_raft_config.clone(),
            NetworkFactory {
                group,
                epoch,
                me: self.id(),
                news: self.inner.news.clone(),
                transport: self.inner.transport.clone(),
                catching: Some(catching.clone()),
            },
            log,
            sm.clone(),
        )
        .await
        .map_err(|e| ServerError::Raft(e.to_string()))?;
        sm.enable_snapshot_transfer();
        Ok(raft)
    }

    /// Put a started replica in the table; an error, with the replica shut
    /// down again, if it may not run.
    async fn register(&self, group: &Arc<QueueGroup>) -> Result<(), ServerError> {
        // A node that stops (its table emptied) or a replica started by
        // someone else meanwhile: this one must not run unseen beside it.
        if !self.inner.groups.add(group, || self.inner.stop.is_cancelled()) {
            group.stop.cancel();
            group.shut_down().await;
            return Err(ServerError::Raft("the node is stopping, or the replica was started meanwhile".into()));
        }
        Ok(())
    }
}

/// The log a new queue's group is founded with by its designated master:
/// the membership (its replicas now, all voters) at index 0 of term 0,
/// where openraft's `initialize` puts it, then the blank entry a leader
/// appends on winning term 1, already there so that the master starts with
/// nothing of its own to write.
fn founding_log(q: &QueueMeta, state: &MetaState, master: NodeId) -> Vec<Entry<QueueTypes>> {
    let nodes: BTreeMap<NodeId, BasicNode> = q
        .replicas
        .iter()
        .map(|id| {
            let addr = state.nodes.get(id).map(|n| n.raft_addr.clone()).unwrap_or_default();
            (*id, BasicNode { addr })
        })
        .collect();
    let voters = nodes.keys().copied().collect::<BTreeSet<_>>();
    vec![
        Entry { log_id: LogId::default(), payload: EntryPayload::Membership(Membership::new(vec![voters], nodes)) },
        Entry { log_id: LogId::new(CommittedLeaderId::new(FOUNDING_TERM, master), 1), payload: EntryPayload::Blank },
    ]
}
