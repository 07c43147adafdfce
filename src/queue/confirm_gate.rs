//! Which replicas are synchronised, and up to which log index every one of
//! them has the group's entries on disk.
//!
//! openraft's leader knows, per member, the last log id that member has
//! durably appended (followers answer AppendEntries only after their fsync;
//! the leader's own entry follows its own fsync). A confirm may fire once
//! every *synchronised* member has the entry.
//!
//! A member stays synchronised while it keeps up: it must have reached the
//! leader's last log index as it was `timeout` ago. A member that is down or
//! stalled falls out after `timeout` (so confirms do not stall forever). It
//! comes back in by itself once it has every entry confirmed without it, so a
//! synchronised member always holds every confirmed message. A member whose
//! node said it is stopping falls out at once, and comes back only on a
//! report from its node's next life ([`CatchUpBook::forget`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use openraft::ServerState;
use prometheus_client::metrics::counter::Counter;
use serde::{Deserialize, Serialize};
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

use super::catchup::SyncProgress;
use super::QueueRaft as Raft;
use crate::ids::NodeId;
use crate::peers::PeerNews;

/// Published after every change of the group's metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SyncState {
    /// The node's current term.
    pub term: u64,
    /// `Some(term)` while this node is the leader.
    pub leader_term: Option<u64>,
    /// Highest index every synchronised member has durably (leader only).
    pub confirmed: Option<u64>,
    /// Members (voters and learners) of the group.
    pub members: BTreeSet<NodeId>,
    /// Members currently synchronised (leader only; the leader included).
    pub synchronised: BTreeSet<NodeId>,
}

impl SyncState {
    /// Is `index`, written as leader in `term`, on every synchronised disk?
    /// `Err` when leadership of `term` is over: the outcome is unknown.
    pub fn confirms(&self, term: u64, index: u64) -> Option<Result<(), ()>> {
        if self.term > term {
            return Some(Err(()));
        }
        if self.leader_term == Some(term) && self.confirmed >= Some(index) {
            return Some(Ok(()));
        }
        None
    }
}

/// Leader's samples of its own last log index over time.
struct Samples {
    term: u64,
    points: VecDeque<(Instant, u64)>,
}

impl Samples {
    fn record(&mut self, now: Instant, last: u64, timeout: Duration) {
        if self.points.back().is_none_or(|(t, _)| now.duration_since(*t) >= Duration::from_millis(20)) {
            self.points.push_back((now, last));
        }
        // Keep exactly one point older than `timeout`: it is the threshold.
        while self.points.len() >= 2 && now.duration_since(self.points[1].0) >= timeout {
            self.points.pop_front();
        }
    }

    /// The index a member must have reached to count as synchronised.
    fn threshold(&self, now: Instant, timeout: Duration) -> Option<u64> {
        match self.points.front() {
            Some((t, idx)) if now.duration_since(*t) >= timeout => Some(*idx),
            _ => None,
        }
    }
}

/// How long a member may sit behind the leader without progress before the
/// leader writes an empty entry to restart replication to it.
const STALL: Duration = Duration::from_millis(500);

/// What, besides its metrics and reports, must wake a master's gate.
#[derive(Debug, PartialEq, Eq)]
struct Wakeups {
    /// Look again every tick.
    tick: bool,
    /// Look again when what the node knows of its peers changes.
    on_peers: bool,
}

impl Wakeups {
    /// `busy`: in the grace period after takeover, or a member still
    /// fetching bodies. Otherwise time changes nothing for a member out of
    /// the synchronised set: it comes back in on a report, on its progress
    /// (both wake the gate anyway), or once it no longer counts as
    /// stopping, which only the news of its peers tells. Ticking for such
    /// a member (a stopping node stays silent, a dead one says nothing)
    /// kept thousands of new masters waking ten times a second while a
    /// node of a rolling restart was away. A lagging member still
    /// synchronised must be timed out, and one that is up (stopping or
    /// not: it may be needed for a commit) may need a kick; a lagging
    /// member that is down is kicked when it returns.
    fn of<'a>(
        lagging: impl Iterator<Item = &'a NodeId> + Clone,
        in_sync: &BTreeSet<NodeId>,
        members: &BTreeSet<NodeId>,
        peers: &PeerNews,
        busy: bool,
    ) -> Wakeups {
        let timed = lagging.clone().any(|id| in_sync.contains(id) || !peers.down.contains(id));
        Wakeups {
            tick: timed || (busy && in_sync != members),
            on_peers: in_sync != members || lagging.into_iter().any(|id| peers.down.contains(id)),
        }
    }
}

/// How a replica's message bodies stand, as it tells its master: with
/// each request for bodies, in a report, and in its answer to a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Standing {
    /// The replica's term when it looked: a master counts the replica as
    /// heard only in that term, so a look taken before a snapshot from an
    /// earlier leadership was installed never counts in a later one.
    pub term: u64,
    /// The life (node incarnation) of the replica's node.
    pub life: u64,
    /// Orders one life's standings: drawn from a node-wide counter while
    /// the replica's state machine is locked, so it follows the order of
    /// the installs and fetches that change the answer. A master keeps
    /// only the newest, whatever order they arrive in: a look taken before
    /// an install, sent on another path than its answer, cannot undo it.
    pub seq: u64,
    /// What it still lacks (`None`: it has every body its state refers
    /// to, and its log holds the rest).
    pub behind: Option<SyncProgress>,
}

impl Standing {
    fn order(&self) -> (u64, u64) {
        (self.life, self.seq)
    }
}

/// What members told this node, as their master, about their message
/// bodies. Every member reports to each new master (and every second while
/// it is fetching): a master admits a member to the synchronised set only
/// once it has heard from it in its own term, so it never counts a member
/// that still lacks bodies just because its log is complete. Confirms are
/// not delayed by this: in the first `sync_timeout` of a term they wait for
/// every member that answers anyway.
///
/// A snapshot moves a member's match past entries it never received: its
/// answer is recorded here (by the master's network, `wire::raft_net`)
/// before openraft reads it, so a gate that sees the new match sees the
/// member behind too. Within one leadership openraft advances a match past
/// the leader's purged log only on a snapshot's answer, so no report can
/// lose that race.
#[derive(Debug, Default)]
pub struct CatchUpBook {
    /// Members still fetching, their last report and when it came.
    behind: HashMap<NodeId, (SyncProgress, Instant)>,
    /// Members heard from in `term`, and the life (node incarnation) each
    /// last reported from.
    heard: BTreeMap<NodeId, u64>,
    term: u64,
    /// The newest standing taken per member ([`Standing::order`]).
    newest: HashMap<NodeId, (u64, u64)>,
    /// Members whose node said, in this life, that it is stopping: reports
    /// from that life no longer count.
    stopping: HashMap<NodeId, u64>,
    /// Wakes the confirm gate at each report: a report changes no Raft
    /// metric, and a gate with nothing to wait for does not tick.
    reported: Arc<Notify>,
}

pub type CatchingUp = Arc<RwLock<CatchUpBook>>;

impl CatchUpBook {
    /// `from`'s standing, come to this node as master of `term` (a report)
    /// or as the leader of `term` that sent it a snapshot (the answer).
    /// One older than a standing already taken is dropped.
    pub fn record(&mut self, term: u64, from: NodeId, standing: Standing) {
        if self.newest.get(&from).is_some_and(|newest| *newest > standing.order()) {
            return;
        }
        self.newest.insert(from, standing.order());
        if term > self.term {
            self.term = term;
            self.heard.clear();
        }
        // One sent before its node said it is stopping, and come after.
        let counts = standing.term == term && term == self.term;
        if counts && self.stopping.get(&from) != Some(&standing.life) {
            self.heard.insert(from, standing.life);
        }
        self.reported.notify_one();
        match standing.behind {
            Some(p) => {
                self.behind.insert(from, (p, Instant::now()));
            }
            None => {
                self.behind.remove(&from);
            }
        }
    }

    /// `id`'s node said, in its life `life`, that it is stopping: forget
    /// what it reported (not what it said it lacks), which takes it out of
    /// the synchronised set. It comes back on a report from a later life,
    /// sent once that node has started every replica, so no confirm waits
    /// on a node still starting thousands of them. (A later life already
    /// heard is kept: the notice came late. A node back on an empty data
    /// dir starts its lives from the clock, so they still come later.)
    pub fn forget(&mut self, id: NodeId, life: u64) {
        self.stopping.insert(id, life);
        if self.heard.get(&id).is_some_and(|heard| *heard <= life) {
            self.heard.remove(&id);
            self.reported.notify_one();
        }
    }

    fn heard_in(&self, term: u64, id: NodeId) -> bool {
        self.term == term && self.heard.contains_key(&id)
    }

    /// Has `id` told this node, as master of `term`, that it has every body?
    pub fn complete_in(&self, term: u64, id: NodeId) -> bool {
        self.heard_in(term, id) && !self.behind.contains_key(&id)
    }
}

/// The members that reported being behind and have not reported being
/// complete since. A report does not expire: a member that went silent
/// while fetching (partitioned, paused, dead) still lacks bodies, and
/// counting it as synchronised would let it lead and serve messages it
/// does not have. It leaves this list only by saying it is complete.
pub fn catching_up(c: &CatchingUp) -> BTreeMap<NodeId, SyncProgress> {
    c.read().expect("poisoned").behind.iter().map(|(id, (p, _))| (*id, *p)).collect()
}

/// What the gate reports of this replica's leaderships.
pub struct Leadership {
    /// Counts each leadership taken (node-wide).
    pub taken: Counter,
    /// Whether the replica leads now, as the gate last saw its metrics:
    /// for the node's scans over every group.
    pub now: Arc<AtomicBool>,
}

/// Watch `raft`'s metrics and publish the group's [`SyncState`] until `stop`.
///
/// Also un-sticks replication: openraft 0.9 drops replication events while it
/// backs off from an unreachable member, and on an idle queue nothing new
/// comes to replicate, so a member that comes back would stay behind (and
/// unsynchronised) until the next publish. An empty entry wakes it up.
pub fn spawn(
    group: u64,
    raft: Raft,
    timeout: Duration,
    mut peers: watch::Receiver<PeerNews>,
    catching: CatchingUp,
    leadership: Leadership,
    stop: CancellationToken,
) -> watch::Receiver<SyncState> {
    let Leadership { taken: leaderships, now: leading } = leadership;
    let (tx, rx) = watch::channel(SyncState::default());
    tokio::spawn(async move {
        let mut metrics = raft.metrics();
        let reports = catching.read().expect("poisoned").reported.clone();
        let mut tick = tokio::time::interval(Duration::from_millis(100));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Only a master with something that time can change (a member
        // lagging or catching up, the grace period, a threshold still
        // moving) looks again on its own; otherwise metrics changes wake
        // it. Thousands of idle replicas each waking ten times a second
        // were most of an idle node's CPU.
        let mut ticking = true;
        // A member out of the synchronised set, or down and lagging: news
        // of the peers (a return, a stop that is over) may let it in, or
        // call for a kick.
        let mut on_peers = false;
        // Copied only when it changed: a busy group's gate runs at every
        // acknowledgement.
        let mut news = peers.borrow_and_update().clone();
        let mut news_came = false;
        let mut gate = Gate::new(group, raft, timeout, catching, leaderships);
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                r = metrics.changed() => if r.is_err() { return },
                _ = reports.notified() => {}
                _ = tick.tick(), if ticking => {}
                // `changed` marks the news seen: copy it below.
                r = peers.changed(), if on_peers => if r.is_err() { return } else { news_came = true },
            }
            let now = Instant::now();
            if std::mem::take(&mut news_came) || peers.has_changed().unwrap_or(false) {
                news = peers.borrow_and_update().clone();
            }
            let m = metrics.borrow_and_update().clone();
            leading.store(m.state == ServerState::Leader && m.current_leader == Some(m.id), Ordering::Release);
            let members: BTreeSet<NodeId> = m.membership_config.membership().nodes().map(|(id, _)| *id).collect();
            let mut st = SyncState { term: m.current_term, members, ..SyncState::default() };
            ticking = false;
            on_peers = false;
            if let (ServerState::Leader, Some(repl)) = (m.state, m.replication.as_ref()) {
                let wake = gate.lead(&m, repl, &news, now, &mut st);
                (ticking, on_peers) = (wake.tick, wake.on_peers);
            }
            tx.send_if_modified(|cur| {
                if *cur != st {
                    *cur = st;
                    true
                } else {
                    false
                }
            });
        }
    });
    rx
}

type Metrics = openraft::RaftMetrics<NodeId, openraft::BasicNode>;
/// Per member, the last log id it has durably appended, as the leader knows.
type Matched = BTreeMap<NodeId, Option<openraft::LogId<NodeId>>>;

/// What a master's gate keeps from one look to the next (a new leadership
/// resets most of it: [`Gate::take_over`]).
struct Gate {
    group: u64,
    raft: Raft,
    timeout: Duration,
    catching: CatchingUp,
    leaderships: Counter,
    samples: Samples,
    /// Per lagging member: the index it was at, and since when.
    lagging: HashMap<NodeId, (Option<u64>, Instant)>,
    last_kick: Instant,
    in_sync: BTreeSet<NodeId>,
    /// Log index a member must reach to (re)join, set at takeover.
    floor: Option<u64>,
    grace_until: Instant,
    /// Members gone or stopping at some point of this leadership: the
    /// grace period no longer waits for them. One back from a restart
    /// acknowledges slowly while its node starts every replica (every
    /// busy queue that changed master at its stop stalled for about a
    /// second at its return), and joins by its report as any other. A
    /// member merely out of reach (a missed ping) is still waited for.
    away: BTreeSet<NodeId>,
    /// The synchronised set as last logged.
    reported: BTreeSet<NodeId>,
}

impl Gate {
    fn new(group: u64, raft: Raft, timeout: Duration, catching: CatchingUp, leaderships: Counter) -> Self {
        Self {
            group,
            raft,
            timeout,
            catching,
            leaderships,
            samples: Samples { term: 0, points: VecDeque::new() },
            lagging: HashMap::new(),
            last_kick: Instant::now(),
            in_sync: BTreeSet::new(),
            floor: None,
            grace_until: Instant::now(),
            away: BTreeSet::new(),
            reported: BTreeSet::new(),
        }
    }

    /// One look as leader: fill in `st`'s synchronised set and confirmed
    /// index, and say what must wake the gate next.
    fn lead(&mut self, m: &Metrics, repl: &Matched, news: &PeerNews, now: Instant, st: &mut SyncState) -> Wakeups {
        if self.samples.term != m.current_term {
            self.take_over(m, now);
        }
        if now < self.grace_until {
            let gone = news.gone.iter().chain(&news.departed);
            self.away.extend(gone.filter(|id| st.members.contains(id)));
        }
        self.samples.record(now, m.last_log_index.unwrap_or(0), self.timeout);
        self.kick_if_stalled(&st.members, repl, m.last_log_index, &news.down, now);
        let behind = catching_up(&self.catching);
        let confirmed = self.resync(m, repl, &st.members, &news.departed, &behind, now);
        if self.in_sync != self.reported {
            tracing::info!(group = self.group, term = m.current_term, synchronised = ?self.in_sync, was = ?self.reported, "synchronised replicas changed");
            self.reported = self.in_sync.clone();
        }
        // With every member synchronised and none behind the last
        // index, neither the grace period's end nor a rising
        // threshold (never above the last index) can change
        // anything: metrics changes wake it, and a just-founded
        // group does not tick ten times a second for a timeout.
        // (The samples lose nothing: the index moves only with the
        // metrics.)
        // A report from a member since removed stays in the book.
        let members_behind = behind.keys().any(|id| st.members.contains(id));
        let busy = now < self.grace_until || members_behind;
        let wake = Wakeups::of(self.lagging.keys(), &self.in_sync, &st.members, news, busy);
        st.synchronised = self.in_sync.clone();
        st.confirmed = confirmed;
        st.leader_term = Some(m.current_term);
        wake
    }

    /// New leadership: only the leader is known to hold every confirmed
    /// message. The others join once they reach the leader's log as it was
    /// at takeover; until then, and for one timeout at most, confirms wait
    /// for them too.
    fn take_over(&mut self, m: &Metrics, now: Instant) {
        self.samples = Samples { term: m.current_term, points: VecDeque::new() };
        self.leaderships.inc();
        self.in_sync = BTreeSet::from([m.id]);
        self.floor = m.last_log_index;
        self.grace_until = now + self.timeout;
        self.away.clear();
    }

    /// Track the members behind `last`, and write an empty entry if one
    /// that is up made no progress for [`STALL`].
    fn kick_if_stalled(
        &mut self,
        members: &BTreeSet<NodeId>,
        repl: &Matched,
        last: Option<u64>,
        down_now: &BTreeSet<NodeId>,
        now: Instant,
    ) {
        self.lagging.retain(|id, _| members.contains(id));
        let mut stalled = false;
        for id in members {
            let matched = repl.get(id).cloned().flatten().map(|l| l.index);
            if matched >= last {
                self.lagging.remove(id);
                continue;
            }
            let entry = self.lagging.entry(*id).or_insert((matched, now));
            if entry.0 != matched {
                *entry = (matched, now);
            } else if now.duration_since(entry.1) >= STALL && !down_now.contains(id) {
                stalled = true;
            }
        }
        if stalled && now.duration_since(self.last_kick) >= STALL {
            self.last_kick = now;
            let raft = self.raft.clone();
            tokio::spawn(async move {
                let _ = raft.client_write(Default::default()).await;
            });
        }
    }

    /// Drop from the synchronised set the members that fell behind, take
    /// back those that caught up, and return the confirmed index.
    fn resync(
        &mut self,
        m: &Metrics,
        repl: &Matched,
        members: &BTreeSet<NodeId>,
        departed: &BTreeSet<NodeId>,
        behind: &BTreeMap<NodeId, SyncProgress>,
        now: Instant,
    ) -> Option<u64> {
        let threshold = self.samples.threshold(now, self.timeout);
        let last = m.last_log_index;
        let matched_of = |id: &NodeId| repl.get(id).cloned().flatten().map(|l| l.index);
        let book = self.catching.read().expect("poisoned");
        self.in_sync.retain(|id| {
            *id == m.id
                || (members.contains(id)
                    && book.heard_in(m.current_term, *id)
                    && !behind.contains_key(id)
                    && (threshold.is_none() || matched_of(id) >= threshold)
                    && !(departed.contains(id) && matched_of(id) < last))
        });
        // What every replica waited on has: during the grace period
        // after takeover that is every member that has been up since,
        // later the synchronised.
        let waiting = members.iter().filter(|id| {
            **id == m.id
                || !departed.contains(id)
                    && (self.in_sync.contains(id)
                        || (now < self.grace_until && !self.away.contains(id) && !behind.contains_key(id)))
        });
        let confirmed = waiting.map(matched_of).min().flatten();
        // Back in only with everything confirmed so far (so joining
        // never lowers `confirmed`).
        let entry_floor = self.floor.max(confirmed);
        for id in members {
            if book.heard_in(m.current_term, *id)
                && !self.in_sync.contains(id)
                && !behind.contains_key(id)
                && !departed.contains(id)
                && matched_of(id) >= entry_floor
            {
                self.in_sync.insert(*id);
            }
        }
        confirmed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn threshold_is_the_leader_index_one_timeout_ago() {
        let t0 = Instant::now();
        let timeout = Duration::from_secs(1);
        let mut s = Samples { term: 1, points: VecDeque::new() };
        s.record(t0, 10, timeout);
        assert_eq!(s.threshold(t0, timeout), None, "young group: everyone is synchronised");
        s.record(t0 + Duration::from_millis(500), 20, timeout);
        s.record(t0 + Duration::from_millis(1000), 30, timeout);
        assert_eq!(s.threshold(t0 + Duration::from_millis(1000), timeout), Some(10));
        s.record(t0 + Duration::from_millis(1600), 40, timeout);
        assert_eq!(s.threshold(t0 + Duration::from_millis(1600), timeout), Some(20));
    }

    #[test]
    fn a_gate_ticks_only_while_time_can_change_what_it_decides() {
        let set = |ids: &[NodeId]| ids.iter().copied().collect::<BTreeSet<NodeId>>();
        let members = set(&[1, 2, 3]);
        let of = |lagging: &[NodeId], in_sync: &[NodeId], down: &[NodeId], departed: &[NodeId], busy: bool| {
            let peers = PeerNews { down: set(down), departed: set(departed), ..PeerNews::default() };
            let w = Wakeups::of(lagging.iter(), &set(in_sync), &members, &peers, busy);
            (w.tick, w.on_peers)
        };
        assert_eq!(of(&[], &[1, 2, 3], &[], &[], false), (false, false), "everyone synchronised and up to date");
        // Node 3 is stopping: it has every entry but tells no new master;
        // only its return (no longer stopping) lets it in without a report.
        assert_eq!(of(&[], &[1, 2], &[], &[3], false), (false, true), "a silent member out of the set");
        assert_eq!(of(&[], &[1, 2], &[], &[3], true), (true, true), "the grace period ends by time");
        // Node 3 is behind: timed out while synchronised, kicked while up.
        assert_eq!(of(&[3], &[1, 2, 3], &[3], &[], false), (true, true));
        assert_eq!(of(&[3], &[1, 2], &[], &[], false), (true, true));
        assert_eq!(
            of(&[3], &[1, 2], &[3], &[], false),
            (false, true),
            "down and out of the set: its return wakes the gate"
        );
        // Node 3 said it is stopping, and lags: out of the set, but still
        // up, so it may need a kick (it may be needed for a commit).
        assert_eq!(of(&[3], &[1, 2], &[], &[3], false), (true, true));
        assert_eq!(of(&[3], &[1, 2], &[3], &[3], false), (false, true));
    }

    /// A standing of member `5` in term 2, life `life`, the `seq`th look.
    fn standing(life: u64, seq: u64, behind: Option<SyncProgress>) -> Standing {
        Standing { term: 2, life, seq, behind }
    }

    #[test]
    fn a_member_behind_stays_behind_until_it_says_it_is_complete() {
        let book: CatchingUp = Arc::default();
        let progress = SyncProgress { msgs_done: 1, msgs_total: 9, bytes_done: 1, bytes_total: None, running: true };
        book.write().unwrap().record(2, 5, standing(1, 1, Some(progress)));
        // Silent for long after its last report: still behind.
        book.write().unwrap().behind.get_mut(&5).unwrap().1 = Instant::now() - Duration::from_secs(60);
        assert!(catching_up(&book).contains_key(&5));
        book.write().unwrap().record(2, 5, standing(1, 2, None));
        assert!(catching_up(&book).is_empty());
    }

    /// A replica's look taken before it installed a snapshot (complete)
    /// and come after the snapshot's answer (behind) does not undo it,
    /// nor does one from an earlier life; a later life's look counts.
    #[test]
    fn a_standing_older_than_one_taken_is_dropped() {
        let mut book = CatchUpBook::default();
        let progress = SyncProgress { msgs_done: 0, msgs_total: 9, bytes_done: 0, bytes_total: None, running: true };
        book.record(2, 5, standing(3, 8, Some(progress)));
        book.record(2, 5, standing(3, 7, None));
        assert!(!book.complete_in(2, 5), "a look from before the install counted");
        book.record(2, 5, standing(2, 50, None));
        assert!(!book.complete_in(2, 5), "an earlier life's look counted");
        book.record(2, 5, standing(3, 9, None));
        assert!(book.complete_in(2, 5));
        book.record(2, 5, standing(4, 1, Some(progress)));
        assert!(!book.complete_in(2, 5), "a later life's look did not count");
    }

    /// A look taken in an earlier term (before a snapshot of that
    /// leadership may have been installed) does not make a member heard in
    /// this one; the leader of an earlier term recording a late answer
    /// forgets nothing heard in this one.
    #[test]
    fn a_standing_counts_as_heard_only_in_the_term_it_was_taken_in() {
        let mut book = CatchUpBook::default();
        book.record(3, 5, Standing { term: 2, life: 1, seq: 1, behind: None });
        assert!(!book.complete_in(3, 5), "a look from term 2 heard in term 3");
        book.record(3, 5, Standing { term: 3, life: 1, seq: 2, behind: None });
        assert!(book.complete_in(3, 5));
        book.record(2, 6, Standing { term: 2, life: 1, seq: 1, behind: None });
        assert!(book.complete_in(3, 5), "a late record of term 2 cleared term 3's");
        assert!(!book.complete_in(2, 6) && !book.complete_in(3, 6));
    }

    /// A stopping node's reports no longer count, also one sent before the
    /// notice and come after it; its next life's do, also when the notice
    /// comes after them.
    #[test]
    fn a_stopping_members_report_counts_again_only_from_its_next_life() {
        let mut book = CatchUpBook::default();
        book.record(2, 5, standing(3, 1, None));
        assert!(book.heard_in(2, 5));
        book.forget(5, 3);
        assert!(!book.heard_in(2, 5), "a stopping member still counted");
        book.record(2, 5, standing(3, 2, None));
        assert!(!book.heard_in(2, 5), "a late report from the stopping life counted");
        book.record(2, 5, standing(4, 1, None));
        assert!(book.heard_in(2, 5), "the next life's report not counted");
        book.forget(5, 3);
        assert!(book.heard_in(2, 5), "a late notice forgot the next life's report");
    }

    #[test]
    fn confirms_needs_same_term_leadership_and_index() {
        let mut st = SyncState { term: 3, leader_term: Some(3), confirmed: Some(9), ..Default::default() };
        assert_eq!(st.confirms(3, 9), Some(Ok(())));
        assert_eq!(st.confirms(3, 10), None);
        st.term = 4;
        st.leader_term = None;
        assert_eq!(st.confirms(3, 10), Some(Err(())));
    }
}
