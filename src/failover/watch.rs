//! The failure watch: at every reconcile tick and on every lost link, per
//! hosted group, who may stand for election, when the lost master's lease
//! is out, and whether to re-form a group that lost its majority.

mod quiet;

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use openraft::ServerState;

use super::epoch::step_down;
use super::rules::{by_seniority, core_quit, reform_voters, reformer, still_leads};
use super::split::{quorum, wall_ms, MajorityStretch};
use super::{ha_of, Busy};
use crate::failover::{Failover, Host, QueueGroup};
use crate::ids::NodeId;
use crate::metadata::{MetaState, QueueMeta};
use crate::wire::ask;

/// Stand this long after the lost master's lease has run out on the other
/// voters: a vote asked for inside the lease is refused, and the refused
/// candidate would wait a whole election timeout before asking again.
const LEASE_MARGIN: Duration = Duration::from_millis(50);

/// How often the replica that stands asks for votes again while no master
/// is known: a voter that has not yet seen the death refuses the first ask.
const ELECT_RETRY: Duration = Duration::from_millis(100);

type Metrics = openraft::RaftMetrics<NodeId, openraft::BasicNode>;

/// What the failure watch keeps about one replica of a group. Only the
/// watch writes it (its rounds, and the election timer a round starts):
/// the state is private to this module, behind one lock, never held
/// across an await; while it is held only quiescence's lists, the peers'
/// records and the link's record of lost links are read, and none of
/// them reaches back here. The split verdict reads how
/// long a majority has been kept ([`GroupWatch::kept_since`]).
pub(crate) struct GroupWatch {
    state: Mutex<State>,
}

struct State {
    /// When a majority of the group's voters last answered pings, and
    /// since when without a break.
    majority: MajorityStretch,
    /// Since when this replica has known no master.
    leaderless_since: Option<Instant>,
    /// Since when the master this replica follows has not answered pings.
    master_lost_since: Option<Instant>,
    /// An election is timed to start when the lost master's lease is out.
    elect_at: Option<Instant>,
    /// As master: since when the group has been settled at (term, last
    /// log index), for quiescence.
    settled: Option<(Instant, quiet::Mark)>,
    /// As follower: the quiet master last seen in reach, its term, and
    /// when (its node's pings are the group's heartbeats).
    quiet_master: Option<(NodeId, u64, Instant)>,
    /// The group's Raft metrics, as the watch last looked at them.
    metrics: tokio::sync::watch::Receiver<Metrics>,
    /// Quiet at the watch's last full look, and as of which
    /// `Quiescence::world_of` the group, with whether a majority of voters
    /// was in reach: while neither that nor the group's metrics changed,
    /// the next rounds only extend the majority stretch.
    passed: Option<((u64, u64), bool)>,
}

impl GroupWatch {
    pub(crate) fn new(metrics: tokio::sync::watch::Receiver<Metrics>) -> Self {
        let state = State {
            majority: MajorityStretch::new(Instant::now()),
            leaderless_since: None,
            master_lost_since: None,
            elect_at: None,
            settled: None,
            quiet_master: None,
            metrics,
            passed: None,
        };
        GroupWatch { state: Mutex::new(state) }
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("poisoned")
    }

    /// Since when (wall clock, ms) a majority of the group's voters has
    /// answered without a break, while one still does.
    pub(super) fn kept_since(&self, now: Instant, failure_timeout: Duration) -> Option<u64> {
        self.state().majority.kept_since(now, failure_timeout)
    }
}

impl<H: Host> Failover<H> {
    /// Peers answering pings, by a round at most a few hundred
    /// milliseconds old (`peers`).
    pub(super) async fn reachable(&self, state: &MetaState) -> BTreeSet<NodeId> {
        if let Some(reach) = self.peers().fresh_reach() {
            return reach;
        }
        let peers: Vec<NodeId> = state.nodes.keys().copied().filter(|id| *id != self.id()).collect();
        let round = self.peers().round(&self.0, &peers).await;
        for id in &round.dead {
            self.after_death(*id).await;
        }
        if round.changed {
            self.quiescence().world_changed();
        }
        round.reach
    }

    /// Decide, per hosted group, who may stand for election, and whether
    /// to re-form a group that lost its majority.
    pub(super) async fn watch_failures(&self, state: &MetaState) {
        let listed_at = self.replicas().removals();
        let groups: Vec<Arc<QueueGroup>> = self.replicas().all();
        self.watch_groups(state, groups, Some(listed_at)).await
    }

    /// The failure watch over `groups`, a list taken when it began: a heal
    /// (news of a newer epoch) and the reconciler change the table while a
    /// run goes on, so a group re-formed, rejoined or stopped meanwhile is
    /// skipped here and refused by `take_out` further on. `listed_at`:
    /// `Replicas::removals` read before the list was taken; a group in it
    /// stops being current only when one is taken out of the table (or the
    /// node stops), so until then the table need not be looked up for each
    /// group (`None`: look each up).
    pub(crate) async fn watch_groups(&self, state: &MetaState, groups: Vec<Arc<QueueGroup>>, listed_at: Option<u64>) {
        if groups.is_empty() {
            return;
        }
        let mut reach = self.reachable(state).await;
        let mut present = self.present(state);
        let refilling = self.quiescence().refilling_peers();
        let timing = &self.timing();
        for g in groups {
            if self.stopping().is_cancelled() {
                return;
            }
            if listed_at != Some(self.replicas().removals()) && !self.replicas().is_current(&g) {
                continue;
            }
            let world = self.quiescence().world_of(g.meta.group);
            if self.passed_over(&g, world) {
                continue;
            }
            let quit = core_quit(&g.ext.watch.state().metrics);
            if let Some(why) = quit {
                self.fail_replica(g, why, &reach).await;
                continue;
            }
            // By name: no table of every queue built at every round.
            let Some(q) = state.queues.get(&g.meta.name).filter(|q| q.group == g.meta.group) else { continue };
            let ha = ha_of(state, q);
            let m = g.ext.watch.state().metrics.borrow_and_update().clone();
            let voters: BTreeSet<NodeId> = m.membership_config.membership().voter_ids().collect();
            // Watched whether or not this replica carries the queue yet: a
            // mirror that becomes a carrier (its catch-up done) just as a
            // partition starts must count the group's time without a
            // majority from the partition, not from its own start, which
            // made it re-form 2 s into a partition.
            let majority = quorum(m.membership_config.membership().get_joint_config(), |v| reach.contains(&v));
            let now = Instant::now();
            let seen = {
                let mut s = g.ext.watch.state();
                s.majority.observe(majority, now, wall_ms(), timing.failure_timeout);
                s.majority.seen()
            };
            let members = carriers(&m, &voters, q);
            if !members.contains(&self.id()) {
                continue;
            }
            let alive: BTreeSet<NodeId> = members.intersection(&reach).copied().collect();
            let alive_voter_set: BTreeSet<NodeId> = voters.intersection(&reach).copied().collect();
            let senior_voter = by_seniority(q, &alive_voter_set).first().copied();
            self.steer_quiet(&g, &m, &present, &refilling);
            let hold = if m.state != ServerState::Leader {
                self.held_by_quiet_master(&g, &m, &voters, &reach, now)
            } else {
                None
            };
            let held = hold.is_some();
            if held {
                rest_while_held(&g);
            }

            // Seniority: while the master is away, only the most senior
            // replica still reachable stands for election, so it wins
            // whenever its log is up to date (a synchronised mirror's is). If
            // no one has won after a while, everyone may stand again: a
            // lagging senior must not keep the queue without a master.
            if !held && !g.hush.is_quiet() {
                g.raft.runtime_config().tick(true);
            }
            if !held && m.state != ServerState::Leader && !self.shared().leaving.load(Ordering::Acquire) {
                self.steer_election(&g, q, &m, &voters, &reach, senior_voter, now);
            }

            // Quiet, with a majority in reach (nothing here is waiting for
            // a timeout to run out): the next rounds pass it over quickly
            // while nothing changes.
            let quiet = (m.state == ServerState::Leader && g.hush.is_quiet()) || hold == Some(true);
            if quiet && majority {
                g.ext.watch.state().passed = Some((world, majority));
            }

            // Re-form: no majority reachable for the failure timeout, the
            // policy allows it, and we are the most senior replica left.
            let due = (!majority && ha.promote_on_failure_always && g.plan.borrow().is_none())
                .then(|| self.reform_due(q, &m, &voters, &reach, &alive, now.duration_since(seen)))
                .flatten();
            if let Some(at_once) = due {
                self.reform_and_tell(g, q, state, &voters, &alive, at_once).await;
                // A re-form may take seconds: the groups after it are judged
                // on fresh pings, not on this round's.
                reach = self.reachable(state).await;
                present = self.present(state);
            }
        }
    }

    /// Re-form `g`, and say how that went (`at_once`: without waiting
    /// out the failure timeout, every voter out of reach being dead).
    async fn reform_and_tell(
        &self,
        g: Arc<QueueGroup>,
        q: &QueueMeta,
        state: &MetaState,
        voters: &BTreeSet<NodeId>,
        alive: &BTreeSet<NodeId>,
        at_once: bool,
    ) {
        match self.reform(g, q.clone(), state).await {
            Ok(false) => {}
            Ok(true) => {
                tracing::warn!(queue = %q.name, ?voters, ?alive, at_once, "no majority of the queue's replicas (out of reach for the failure timeout, or dead): re-formed it");
                self.metrics().queue_reforms.inc();
                self.cleared(q.group, "re-form");
            }
            Err(e) => {
                if self.repeated(q.group, "re-form", &e.to_string()) {
                    tracing::error!(queue = %q.name, error = %e, "re-forming the queue failed; retrying (told once until it changes)");
                }
            }
        }
    }

    /// A quiet group whose metrics and world (`Quiescence::world_of`) are
    /// as at the last full look, with nothing else to do: its majority
    /// stretch is extended, and it is passed over.
    fn passed_over(&self, g: &QueueGroup, world: (u64, u64)) -> bool {
        let passed = g.ext.watch.state().passed.take();
        let Some((was, majority)) = passed else { return false };
        let (metrics_changed, state_now) = {
            let s = g.ext.watch.state();
            let m = &s.metrics;
            let state_now = m.borrow().state;
            (m.has_changed().unwrap_or(true), state_now)
        };
        let unchanged = was == world && !self.shared().leaving.load(Ordering::Acquire) && !metrics_changed;
        let still_quiet = g.hush.is_quiet() || state_now != ServerState::Leader;
        if !(unchanged && still_quiet) {
            return false;
        }
        // Watched without a gap, as the split rule needs.
        let mut s = g.ext.watch.state();
        s.majority.observe(majority, Instant::now(), wall_ms(), self.timing().failure_timeout);
        s.passed = Some((was, majority));
        true
    }

    /// As follower with no quiet master standing in: whether this replica
    /// stands for election, and when, once the master it followed is lost.
    #[allow(clippy::too_many_arguments)]
    fn steer_election(
        &self,
        g: &Arc<QueueGroup>,
        q: &QueueMeta,
        m: &Metrics,
        voters: &BTreeSet<NodeId>,
        reach: &BTreeSet<NodeId>,
        senior_voter: Option<NodeId>,
        now: Instant,
    ) {
        let timing = &self.timing();
        // Leaderless also while the last master known is out of
        // reach: a senior replica that never received the group's
        // log (it was down when the queue was declared) knows no
        // members and never stands, and a synchronised mirror
        // deferring to it would leave the queue without a master
        // until the old one came back.
        let leaderless_since = {
            let mut s = g.ext.watch.state();
            let l = &mut s.leaderless_since;
            // A leader sends at least a heartbeat per interval;
            // an election timeout without one is a master that
            // no longer leads, as openraft's own timer counts it.
            let heard = g.ext.heard.master_at().is_some_and(|t| now.duration_since(t) < timing.election_max);
            match m.current_leader.filter(|l| still_leads(*l, self.id(), reach, voters, heard)) {
                Some(_) => *l = None,
                None => {
                    l.get_or_insert(now);
                }
            }
            *l
        };
        let leaderless_long = leaderless_since.is_some_and(|t| now.duration_since(t) > timing.election_max * 3);
        // A replica still fetching bodies never stands: it cannot
        // serve what it does not have.
        let complete = g.plan.borrow().is_none();
        let may = complete && !self.shared().is_quiet(q.group);
        let stand = may && (senior_voter == Some(self.id()) || leaderless_long);
        g.raft.runtime_config().elect(stand);
        // A follower of a master that was alive waits out the
        // master's lease and then a whole election timeout more
        // before standing (openraft), 3-4 s by default. The pings
        // already tell the master is gone: stand as soon as the lease
        // has run out on the other voters too. Their lease runs from
        // the master's last heartbeat, so from no later than its
        // death; when the link to it broke after its last answered
        // ping (a killed process's sockets close at once), that
        // moment bounds its death, else the moment the pings failed.
        let lost_since = {
            let mut s = g.ext.watch.state();
            let l = &mut s.master_lost_since;
            match m.current_leader.filter(|leader| !reach.contains(leader)) {
                Some(leader) => Some(*l.get_or_insert_with(|| self.peers().died_by(&self.0, leader, now))),
                None => {
                    *l = None;
                    None
                }
            }
        };
        if let (true, Some(lost), Some(leader)) =
            (stand && m.state != ServerState::Candidate, lost_since, m.current_leader)
        {
            // A master whose process is gone holds no lease: the
            // other voters forget it as they see the death
            // (`liveness`), and whoever has not yet refuses only
            // the first ask.
            let at = if self.is_dead(leader) { now } else { lost + timing.election_max + LEASE_MARGIN };
            self.elect_after_lease(g, leader, at);
        }
    }

    /// Whether this replica re-forms its group, which has had no majority
    /// in reach for `without_majority`: it is the most senior replica
    /// left, and that has lasted the failure timeout, or every voter out
    /// of reach is dead. `Some(at_once)`: it does, `at_once` if without
    /// waiting out the failure timeout.
    fn reform_due(
        &self,
        q: &QueueMeta,
        m: &Metrics,
        voters: &BTreeSet<NodeId>,
        reach: &BTreeSet<NodeId>,
        alive: &BTreeSet<NodeId>,
        without_majority: Duration,
    ) -> Option<bool> {
        let timing = &self.timing();
        // Every voter out of reach seen dead (its port refuses a dial)
        // is no partition that may heal into a second master: no need
        // to wait (the classic demo serves at once).
        // Dead means gone after being up in this node's life: a peer
        // not heard from since this node started may just not be up
        // yet (every node back from a whole-cluster power cut), and
        // re-forming alone then forks the queue on whichever node
        // came up first, which a damaged dir set aside can strand. It
        // was up if it answered a ping or a link to it broke; after a
        // failure timeout here, a refusing port is a death either way.
        let all_dead = voters
            .iter()
            .filter(|v| !reach.contains(v))
            .all(|v| self.peers().gone_for_sure(&self.0, *v, timing.failure_timeout));
        let wait = if all_dead { Duration::ZERO } else { timing.failure_timeout };
        let due = without_majority >= wait
            && reformer(&q.replicas, &reform_voters(m.membership_config.membership().get_joint_config(), reach), alive)
                == Some(self.id());
        due.then_some(all_dead && without_majority < timing.failure_timeout)
    }

    /// Fail this node's replica `g`, whose Raft core quit (`why`), and
    /// not the node: its other replicas go on. A quit core answers nothing
    /// and its metrics stand still, so a quiet master would go on
    /// announcing the group and its followers would wait for it for good.
    /// The replica is taken out, which withdraws that announcement; it is
    /// shut down, and the reconciler starts it again from its disk. A
    /// replica that led starts again as a follower (its vote for itself
    /// no longer committed, as after a crash) that does not stand for a
    /// while, and asks the most senior other voter in `reach` to stand
    /// now: the others would wait for this senior one first, and a fault
    /// that persists must not make it take the mastership back, only to
    /// quit again.
    pub(super) async fn fail_replica(&self, g: Arc<QueueGroup>, why: String, reach: &BTreeSet<NodeId>) {
        let (group, me) = (g.meta.group, self.id());
        // A re-form or a heal holds it: it replaces the replica anyway.
        let Some(_busy) = Busy::take(&self.shared().busy, group) else { return };
        if !self.take_out(&g) {
            return;
        }
        if self.repeated(group, "core", &why) {
            tracing::error!(queue = %g.meta.name, error = %why, "the queue replica's Raft core quit: the replica stops, starts again as a follower and stands for no election for a while (told once until it changes)");
        }
        self.shared().quiet.lock().expect("poisoned").insert(group, Instant::now() + self.timing().election_max * 4);
        let m = g.ext.watch.state().metrics.borrow().clone();
        g.stop.cancel();
        g.shut_down().await;
        if let Err(e) = step_down(self.db().clone(), group, me).await {
            tracing::error!(queue = %g.meta.name, error = %e, "cannot step the failed replica down; it may lead again when it starts");
        }
        if m.current_leader != Some(me) {
            return;
        }
        let others: BTreeSet<NodeId> =
            m.membership_config.membership().voter_ids().filter(|v| *v != me && reach.contains(v)).collect();
        let Some(to) = by_seniority(&g.meta, &others).first().copied() else { return };
        let node = self.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(2);
            let _ = node.ask(to, ask::Elect { group, from: me, leaving: false }, deadline).await;
        });
    }

    /// Stand for election at `at` (now if it has passed; an earlier `at`
    /// given meanwhile moves it), if the master is still lost then and no
    /// one has won meanwhile: timed rather than left to the next reconcile,
    /// which may come half a second late. Against a master whose process is
    /// gone, ask again while no one wins, for up to an election timeout: a
    /// voter that has not yet seen the death still keeps its lease and
    /// refuses.
    pub(super) fn elect_after_lease(&self, g: &Arc<QueueGroup>, lost_leader: NodeId, at: Instant) {
        {
            let mut s = g.ext.watch.state();
            let slot = &mut s.elect_at;
            match *slot {
                Some(t) if t <= at => return,
                Some(_) => {
                    *slot = Some(at);
                    return;
                }
                None => *slot = Some(at),
            }
        }
        let g = g.clone();
        let node = self.clone();
        tokio::spawn(async move {
            let stop = node.stopping().clone();
            loop {
                let Some(at) = g.ext.watch.state().elect_at else { return };
                let now = Instant::now();
                if now >= at {
                    break;
                }
                // In steps, so that an earlier time set meanwhile is kept.
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep((at - now).min(Duration::from_millis(50))) => {}
                }
            }
            // Until the lease would have run out on every voter anyway: a
            // voter slow to see the death (a loaded machine) refuses a few
            // asks, and after the last one openraft's own timer would wait
            // out a whole election timeout more.
            let until = Instant::now() + node.timing().election_max;
            let mut ask = 0u32;
            while Instant::now() < until {
                ask += 1;
                // A candidate knows no leader, so the reconcile has stopped
                // counting the master as lost by the next ask: a later ask
                // goes on the death alone.
                let lost =
                    if ask == 1 { g.ext.watch.state().master_lost_since.is_some() } else { node.is_dead(lost_leader) };
                if stop.is_cancelled() || !lost {
                    break;
                }
                let m = g.raft.metrics().borrow().clone();
                let waiting = match m.state {
                    ServerState::Follower => m.current_leader == Some(lost_leader),
                    // Still asking since the last round: it was refused.
                    ServerState::Candidate => ask > 1,
                    _ => false,
                };
                if !waiting {
                    break;
                }
                g.raft.runtime_config().tick(true);
                let _ = g.raft.trigger().elect().await;
                if !node.is_dead(lost_leader) {
                    break;
                }
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(ELECT_RETRY * ask.min(3)) => {}
                }
            }
            g.ext.watch.state().elect_at = None;
        });
    }
}

/// A quiet group's master answers for it: its node answers pings and
/// announces the group in our term. The replica's timers have nothing to
/// do until then.
fn rest_while_held(g: &QueueGroup) {
    g.raft.runtime_config().elect(false);
    g.raft.runtime_config().tick(false);
    let mut s = g.ext.watch.state();
    s.leaderless_since = None;
    s.master_lost_since = None;
}

/// The members of `m`'s membership that may carry the queue on: its
/// `voters`, and the learners that are wanted replicas (`q`), which may
/// have every confirmed message too (confirms wait for caught-up
/// learners), so may carry it on when no voter is left.
fn carriers(m: &Metrics, voters: &BTreeSet<NodeId>, q: &QueueMeta) -> BTreeSet<NodeId> {
    m.membership_config
        .membership()
        .nodes()
        .map(|(id, _)| *id)
        .filter(|id| voters.contains(id) || q.replicas.contains(id))
        .collect()
}
