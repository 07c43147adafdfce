//! Deciding a split: when the replicas of a group meet a newer epoch that
//! a minority of them formed (re-formed the queue alone after the failure
//! timeout), which epoch keeps the queue. The old group keeps it if it
//! kept a live majority across the moment the fork was formed; the fork
//! then yields (hands back what only it has and rejoins as a new mirror).
//! Otherwise, as in the classic demo, the old group heals into the new
//! epoch (`failover/heal.rs`). The reasoning is in `docs/reliability.md`, "The
//! rule for a split".

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use openraft::ServerState;

use crate::failover::{Failover, Host, QueueGroup};
use crate::ids::{GroupId, NodeId};
use crate::queue::epoch::{Epoch, ForkRecord};
use crate::queue::QueueMachine;
use crate::wire::ask;
use crate::wire::raft_net::EpochNews;
use mirrorq_storage::{NodeDb, SmSpace, StorageError};

/// What the heals learn of newer epochs of one replica's group: which
/// voters answered from one (the epoch news task writes it) and which
/// epoch this replica, as master, last could not decide a split against
/// (the heal writes it).
#[derive(Default)]
pub(crate) struct SplitMemory {
    /// Replicas that answered from a newer epoch of the group, and when
    /// last: they follow no master of ours, however well they answer pings.
    in_newer: Mutex<HashMap<NodeId, Instant>>,
    /// The newer epoch last undecided (its node could not be asked), when,
    /// and how many times in a row.
    undecided: Mutex<Option<(Epoch, Instant, u32)>>,
}

/// The first wait before a split left undecided is judged again. Right
/// after a partition heals the other side's replicas often cannot be asked
/// yet (the node link is still being dialled again); waiting a whole
/// failure timeout then can let the next partition come before the split
/// is decided, and a later master (restarted, or moved) that never saw our
/// group keep its majority would heal it into the minority's fork.
const UNDECIDED_FIRST_WAIT: Duration = Duration::from_millis(500);

impl SplitMemory {
    /// `from` answered from a newer epoch of the group.
    pub(super) fn newer_seen(&self, from: NodeId) {
        self.in_newer.lock().expect("poisoned").insert(from, Instant::now());
    }

    /// A split against `epoch` could not be decided just now.
    pub(super) fn undecided(&self, epoch: Epoch) {
        let mut u = self.undecided.lock().expect("poisoned");
        let times = match *u {
            Some((e, _, n)) if e == epoch => n.saturating_add(1),
            _ => 1,
        };
        *u = Some((epoch, Instant::now(), times));
    }

    /// Whether a split against `epoch` was undecided too lately to ask
    /// again: every message of the fork brings news of it, and asking
    /// again at each would hold the group busy all along. The wait doubles
    /// from [`UNDECIDED_FIRST_WAIT`] each time it stays undecided, up to
    /// `longest` (the failure timeout).
    pub(super) fn undecided_lately(&self, epoch: Epoch, longest: Duration) -> bool {
        match *self.undecided.lock().expect("poisoned") {
            Some((e, at, times)) if e == epoch => {
                let wait = UNDECIDED_FIRST_WAIT.saturating_mul(1 << times.saturating_sub(1).min(16)).min(longest);
                at.elapsed() < wait
            }
            _ => false,
        }
    }
}

/// The epochs of the group this node formed, each from the one before
/// ([`Formed`]).
pub(super) fn formed_key(group: GroupId) -> String {
    format!("formed-chain/{group}")
}
/// The fork record of the last epoch of the group this node formed, kept
/// beside the group's log: the record's own entry may never have been
/// written (the node stopped between starting the epoch and committing it).
pub(super) fn formed_record_key(group: GroupId) -> String {
    format!("formed-record/{group}")
}

/// The record of `epoch` as this node formed it, if it did.
pub(super) fn formed_record(db: &NodeDb, group: GroupId, epoch: Epoch) -> Option<ForkRecord> {
    let b = db.get_node_value(&formed_record_key(group)).ok()??;
    let rec: ForkRecord = mirrorq_storage::keys::decode(&b, "formed record").ok()?;
    (rec.epoch == epoch).then_some(rec)
}

/// The fork record of this node's replica of `group` in `epoch`: its state
/// machine's, or, formed here and its entry never committed (a stop right
/// after the re-form), the one kept beside the log.
pub(super) fn own_record(db: &NodeDb, group: GroupId, epoch: Epoch) -> Result<Option<ForkRecord>, StorageError> {
    let applied = QueueMachine::fork_record(&SmSpace::new(db.clone(), group))?;
    Ok(applied.filter(|r| r.epoch == epoch).or_else(|| formed_record(db, group, epoch)))
}

/// Epochs of the group formed by a minority while our group kept its
/// majority: their replicas yield to ours.
pub(super) fn defeated_key(group: GroupId) -> String {
    format!("defeated/{group}")
}

pub(super) fn wall_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// How long a group's majority has been in reach without a break: the
/// split rule's evidence that a group kept its majority from before a
/// minority re-formed the queue.
#[derive(Debug)]
pub(super) struct MajorityStretch {
    /// When a majority of the voters last answered.
    seen: Instant,
    /// Since when (wall clock, ms) the majority has answered without a gap
    /// as long as the failure timeout.
    since: Option<u64>,
}

impl MajorityStretch {
    pub(super) fn new(now: Instant) -> Self {
        Self { seen: now, since: None }
    }

    /// One look at the group at `now`: whether a majority of its voters
    /// answered.
    pub(super) fn observe(&mut self, majority: bool, now: Instant, wall_ms: u64, failure_timeout: Duration) {
        // A stretch needs watching without a break: after a gap as long as
        // the failure timeout (this process was paused, SIGSTOP, or
        // starved) a new one begins, or a master paused while a fork
        // formed would judge the fork a minority's and keep a queue the
        // others left.
        let gap = now.duration_since(self.seen) >= failure_timeout;
        if gap {
            self.since = None;
        }
        if majority {
            self.seen = now;
            self.since.get_or_insert(wall_ms);
        }
    }

    /// When a majority last answered.
    pub(super) fn seen(&self) -> Instant {
        self.seen
    }

    /// Since when the majority has been kept, while it is still in reach.
    pub(super) fn kept_since(&self, now: Instant, failure_timeout: Duration) -> Option<u64> {
        self.since.filter(|_| now.duration_since(self.seen) < failure_timeout)
    }
}

/// A re-formation as the node that made it remembers it.
#[derive(Debug, Clone, Copy, serde::Serialize, serde::Deserialize)]
pub(super) struct Formed {
    pub(super) epoch: Epoch,
    /// The epoch this replica was in when it re-formed the group.
    pub(super) from: Epoch,
    /// The queue's counters as applied when it re-formed: what it stored
    /// since is what only this epoch has (its log's older entries were
    /// committed in the old group).
    pub(super) next_seq: u64,
    /// `Counters::next_requeue`, which numbers handed-back and prioritized
    /// messages' seqs.
    pub(super) next_order: u64,
}

fn formed_chain(db: &NodeDb, group: GroupId) -> Result<Vec<Formed>, StorageError> {
    match db.get_node_value(&formed_key(group))? {
        Some(b) => mirrorq_storage::keys::decode(&b, "formed epochs"),
        None => Ok(Vec::new()),
    }
}

/// Remember that this node formed `f.epoch`. A chain of forks is kept
/// whole: a minority of two re-forms the queue, one of them stops and the
/// other re-forms it again alone. When that fork yields, what it must
/// hand back is everything stored since it left the winning group, in
/// both of its epochs.
pub(super) fn add_formed(db: &NodeDb, group: GroupId, f: Formed) -> Result<(), StorageError> {
    let mut chain = formed_chain(db, group)?;
    if chain.last().is_none_or(|last| last.epoch != f.from) {
        chain.clear();
    }
    chain.push(f);
    db.put_node_value(&formed_key(group), &mirrorq_storage::keys::encode(&chain, "formed epochs")?)
}

/// The re-formation by which this node's replica, now in `ours`, left
/// `winner`, if it got from there to `ours` through epochs it formed itself:
/// its counters then bound what only those epochs have.
pub(super) fn left_through_own_forks(db: &NodeDb, group: GroupId, ours: Epoch, winner: Epoch) -> Option<Formed> {
    let chain = formed_chain(db, group).ok()?;
    if chain.last()?.epoch != ours {
        return None;
    }
    // Each later fork of the chain was formed from what its former had
    // applied, which may be less than the one before it had: only below
    // the lowest counters from the fork that left `winner` on were the
    // numbers given in `winner`.
    let k = chain.iter().rposition(|f| f.from == winner)?;
    let (next_seq, next_order) =
        chain[k..].iter().fold((u64::MAX, u64::MAX), |(s, o), f| (s.min(f.next_seq), o.min(f.next_order)));
    Some(Formed { next_seq, next_order, ..chain[k] })
}

pub(super) fn defeated(db: &NodeDb, group: GroupId) -> Result<BTreeSet<Epoch>, StorageError> {
    match db.get_node_value(&defeated_key(group))? {
        Some(b) => mirrorq_storage::keys::decode(&b, "defeated epochs"),
        None => Ok(BTreeSet::new()),
    }
}

pub(super) fn add_defeated(db: &NodeDb, group: GroupId, epoch: Epoch) -> Result<(), StorageError> {
    let mut set = defeated(db, group)?;
    if set.insert(epoch) {
        db.put_node_value(&defeated_key(group), &mirrorq_storage::keys::encode(&set, "defeated epochs")?)?;
    }
    Ok(())
}

/// What a replica of an older epoch does on learning of a newer one.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Hand back and join the newer epoch: our group lost its majority
    /// before that epoch formed (the classic demo), or has none now.
    Heal,
    /// Our group kept its majority from before the newer epoch formed
    /// until now, or serves while that epoch cannot: that epoch is a
    /// minority's fork, and it yields.
    Keep,
    /// We follow a master that is alive, or may soon (just started): it
    /// decides for the group.
    Defer,
    /// Not now; ask again on news of that epoch a failure timeout from now.
    /// Healing would hand the queue to no one or to a fork.
    Undecided(Undecided),
}

/// Why a split could not be decided yet.
#[derive(Debug, PartialEq, Eq, Clone, Copy)]
pub(super) enum Undecided {
    /// We are the master, our group has its majority, and no replica of
    /// the newer epoch can tell when it formed: none can be asked (a
    /// one-way cut: its messages reach us, ours do not reach it), or those
    /// that answer joined it and have not had its record from its master
    /// yet. Keep serving.
    CannotAsk,
    /// The newer epoch has no master to take a hand-back (its replicas
    /// lost theirs), and our group cannot decide either: wait for one.
    NoMaster,
}

/// What the replicas of a newer epoch tell of it.
#[derive(Debug, Clone, Copy)]
struct ForkNews {
    /// When the epoch was formed (wall clock, ms), if a replica that
    /// answered has its record.
    formed_ms: Option<u64>,
    /// Its master, if one of its replicas knows one in reach.
    master: Option<NodeId>,
    /// The node that formed it answered from another epoch: it left it
    /// (yielded, healed or re-formed again), so it masters it no more.
    former_left: bool,
}

/// The split rule for a master (see [`Verdict`]). `kept_since`: since
/// when (wall clock, ms) our group has kept its majority, if it has one.
/// `fork`: what the newer epoch's replicas told, if any answered.
fn master_verdict(kept_since: Option<u64>, fork: Option<ForkNews>, failure_timeout: Duration) -> Verdict {
    // Clocks of different machines differ a little; the newer epoch
    // formed a failure timeout after its node lost our majority, so a
    // majority kept from before that is well clear of it.
    let margin = failure_timeout.as_millis() as u64 / 2;
    match (kept_since, fork) {
        (Some(since), Some(ForkNews { formed_ms: Some(formed), .. })) if since.saturating_add(margin) <= formed => {
            Verdict::Keep
        }
        // Formed while our group had no majority (the classic demo), but
        // that epoch has lost its master since and ours serves: healing
        // would hand a serving queue to a group that cannot elect one. Its
        // replicas give back what they hold instead. A fork loses its
        // master this way when its former moves on to a newer fork.
        (Some(_), Some(ForkNews { master: None, formed_ms: Some(_), .. })) => Verdict::Keep,
        // When it formed is not known either: no replica that answered has
        // its record, as when the former has yielded and the one replica
        // left joined the fork without ever hearing from its master. That
        // a replica knows no master proves little (it may not have heard
        // from a live one yet); that the former left does.
        (Some(_), Some(ForkNews { master: None, formed_ms: None, former_left: true })) => Verdict::Keep,
        (Some(_), Some(ForkNews { formed_ms: Some(_), .. })) => Verdict::Heal,
        (Some(_), Some(ForkNews { formed_ms: None, .. }) | None) => Verdict::Undecided(Undecided::CannotAsk),
        (None, Some(ForkNews { master: None, .. })) => Verdict::Undecided(Undecided::NoMaster),
        (None, _) => Verdict::Heal,
    }
}

/// Whether the voters that `counts` make a quorum of a group whose voter
/// configurations are `configs`: a majority of each. While a membership
/// change is under way (a joint configuration) a group elects and commits
/// only with a majority of the old voters and of the new alike; a majority
/// of their union is not enough. (A master crashed mid-change while an old
/// voter was cut off: the others stood for election in vain, each sure a
/// majority was in reach, and no one re-formed the queue.)
pub(super) fn quorum(configs: &[BTreeSet<NodeId>], counts: impl Fn(NodeId) -> bool) -> bool {
    !configs.is_empty() && configs.iter().all(|c| c.iter().filter(|v| counts(**v)).count() * 2 > c.len())
}

/// Whether a quorum of the voter configurations `configs` is in our
/// epoch: not heard from a newer one (`in_newer`: when each replica last
/// answered from one) within the failure timeout.
fn majority_in_our_epoch(
    configs: &[BTreeSet<NodeId>],
    in_newer: &HashMap<NodeId, Instant>,
    now: Instant,
    failure_timeout: Duration,
) -> bool {
    quorum(configs, |v| in_newer.get(&v).is_none_or(|t| now.duration_since(*t) >= failure_timeout))
}

impl<H: Host> Failover<H> {
    /// Decide for our group, of an older epoch than `news`'s, which epoch
    /// keeps the queue. Only the master decides, so the replicas of one
    /// group never part ways: a replica following a master in reach defers
    /// (the master hears of the newer epoch too: its appends to that
    /// epoch's replicas are refused).
    pub(super) async fn split_verdict(&self, g: &Arc<QueueGroup>, news: EpochNews) -> Verdict {
        let m = g.raft.metrics().borrow().clone();
        let me = self.id();
        let timing = &self.timing();
        if m.state != ServerState::Leader {
            // In reach and still sending us appends: a master restored
            // from a vote on disk that has left our epoch sends none.
            let heard = g.ext.heard.master_at();
            let master_alive = m.current_leader.is_some_and(|l| l != me)
                && heard.is_some_and(|t| t.elapsed() < timing.failure_timeout);
            if master_alive {
                return Verdict::Defer;
            }
            // Just (re)started: our group may be about to elect a master,
            // which decides for it. A mirror healing alone the moment it
            // restarts takes a group that kept its majority into a
            // minority's fork, one replica at a time (a cluster restarted
            // node by node after a heal would do just that).
            if g.ext.heard.master_or_start().elapsed() < timing.failure_timeout {
                return Verdict::Defer;
            }
            return match self.fetch_fork_news(news).await {
                Some(ForkNews { master: None, .. }) => Verdict::Undecided(Undecided::NoMaster),
                _ => Verdict::Heal,
            };
        }
        let kept_since = if self.majority_still_ours(g) {
            g.ext.watch.kept_since(Instant::now(), timing.failure_timeout)
        } else {
            None
        };
        let fork = self.fetch_fork_news(news).await;
        master_verdict(kept_since, fork, timing.failure_timeout)
    }

    /// Whether a majority of our group's voters is still in our epoch.
    /// Pings tell who is in reach, not who still follows us: voters that
    /// answer from a newer epoch have left our group. A master whose
    /// mirrors all healed into a fork has no majority to keep, and could
    /// not even take them out of its membership (no quorum).
    pub(super) fn majority_still_ours(&self, g: &QueueGroup) -> bool {
        let m = g.raft.metrics().borrow().clone();
        let configs = m.membership_config.membership().get_joint_config();
        let in_newer = g.ext.split.in_newer.lock().expect("poisoned");
        majority_in_our_epoch(configs, &in_newer, Instant::now(), self.timing().failure_timeout)
    }

    /// Ask the replicas of the newer epoch of `news` (the one that told us
    /// first, its former, then the queue's other replicas) when it formed
    /// and who masters it. `None` if no replica of it answers.
    async fn fetch_fork_news(&self, news: EpochNews) -> Option<ForkNews> {
        let q = self.metadata().queues.values().find(|q| q.group == news.group).cloned()?;
        let peers = self.asked_about(&q, news);
        let mut found: Option<ForkNews> = None;
        let mut former_left = false;
        for (peer, report) in self.ask_forks(news.group, &peers).await {
            if report.epoch != news.epoch {
                former_left |= peer == news.epoch.node;
                continue;
            }
            let formed_ms = report.record.map(|r| r.formed_ms).filter(|ms| *ms > 0);
            let f = found.get_or_insert(ForkNews { formed_ms: None, master: None, former_left: false });
            f.formed_ms = f.formed_ms.or(formed_ms);
            f.master = f.master.or(report.master);
        }
        found.map(|f| ForkNews { former_left, ..f })
    }

    /// Tell a replica of a defeated epoch to yield to ours. It comes back
    /// with an empty log, which openraft's leader must not have tracked
    /// (a follower's log never goes back), so it leaves our group's
    /// membership first and returns as a new mirror (`steer_membership`).
    pub(super) async fn tell_to_yield(&self, g: &Arc<QueueGroup>, news: EpochNews) {
        let group = news.group;
        if g.raft.metrics().borrow().state != ServerState::Leader {
            return;
        }
        if !self.expel(g, news.from).await {
            return;
        }
        let req = ask::Yield { group, defeated: news.epoch, winner: g.epoch, from: self.id() };
        if let Err(e) = self.ask(news.from, req, Instant::now() + Duration::from_secs(2)).await {
            tracing::debug!(group, to = news.from, error = %e, "could not tell a defeated replica to yield");
        }
    }

    /// Take `id` out of our group's membership, if it is in it. False if
    /// that could not be done now (a membership change was under way, or
    /// failed): the next news of the defeated epoch tries again.
    async fn expel(&self, g: &Arc<QueueGroup>, id: NodeId) -> bool {
        let m = g.raft.metrics().borrow().clone();
        let membership = m.membership_config.membership();
        if !membership.nodes().any(|(n, _)| *n == id) {
            return true;
        }
        if g.changing.swap(true, Ordering::AcqRel) {
            return false;
        }
        let voters: BTreeSet<NodeId> = membership.voter_ids().filter(|v| *v != id).collect();
        let change = if membership.voter_ids().any(|v| v == id) {
            openraft::ChangeMembers::ReplaceAllVoters(voters)
        } else {
            openraft::ChangeMembers::RemoveNodes(BTreeSet::from([id]))
        };
        // Bounded: without a quorum of the old and new voters the change
        // never commits, and waiting for it would hold the group busy (no
        // heal, no hand-over) for good.
        let limit = self.timing().failure_timeout;
        let result = match tokio::time::timeout(limit, g.raft.change_membership(change, false)).await {
            Ok(r) => r.map_err(|e| e.to_string()),
            Err(_) => Err(format!("not committed within {limit:?}")),
        };
        g.changing.store(false, Ordering::Release);
        match result {
            Ok(_) => {
                tracing::info!(queue = %g.meta.name, node = id, "the defeated replica left the group; it returns as a new mirror");
                true
            }
            Err(e) => {
                tracing::debug!(queue = %g.meta.name, node = id, error = %e, "could not take the defeated replica out yet");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(5);

    #[test]
    fn an_undecided_split_is_judged_again_soon_then_less_often() {
        let m = SplitMemory::default();
        let e = Epoch { term: 17, node: 2 };
        assert!(!m.undecided_lately(e, TIMEOUT));
        let aged = |ago: Duration| {
            let mut u = m.undecided.lock().unwrap();
            let (e, _, n) = u.expect("undecided");
            *u = Some((e, Instant::now().checked_sub(ago).expect("uptime"), n));
        };
        m.undecided(e);
        assert!(m.undecided_lately(e, TIMEOUT));
        aged(Duration::from_millis(600));
        assert!(!m.undecided_lately(e, TIMEOUT), "judged again after half a second");
        // Undecided three times in a row: two seconds.
        m.undecided(e);
        m.undecided(e);
        aged(Duration::from_millis(1_500));
        assert!(m.undecided_lately(e, TIMEOUT));
        aged(Duration::from_millis(2_100));
        assert!(!m.undecided_lately(e, TIMEOUT));
        for _ in 0..20 {
            m.undecided(e);
        }
        aged(Duration::from_millis(4_900));
        assert!(m.undecided_lately(e, TIMEOUT));
        aged(TIMEOUT);
        assert!(!m.undecided_lately(e, TIMEOUT), "never longer than the failure timeout");
        // News of another epoch is judged at once, and starts over.
        let other = Epoch { term: 18, node: 3 };
        assert!(!m.undecided_lately(other, TIMEOUT));
        m.undecided(other);
        aged(Duration::from_millis(600));
        assert!(!m.undecided_lately(other, TIMEOUT));
    }

    #[test]
    fn a_majority_watched_without_a_break_is_kept_from_its_start() {
        let t0 = Instant::now();
        let mut s = MajorityStretch::new(t0);
        for i in 0..20u64 {
            s.observe(true, t0 + Duration::from_millis(500 * i), 1_000 + 500 * i, TIMEOUT);
        }
        assert_eq!(s.kept_since(t0 + Duration::from_millis(9_600), TIMEOUT), Some(1_000));
        // Out of reach for the failure timeout: no longer kept.
        assert_eq!(s.kept_since(t0 + Duration::from_millis(9_500) + TIMEOUT, TIMEOUT), None);
    }

    #[test]
    fn a_stretch_broken_by_a_pause_starts_again() {
        // A master paused (SIGSTOP) while a fork formed watched nothing
        // meanwhile, so the majority it sees on waking is no evidence it
        // kept one while the fork formed.
        let t0 = Instant::now();
        let mut s = MajorityStretch::new(t0);
        s.observe(true, t0, 1_000, TIMEOUT);
        s.observe(true, t0 + Duration::from_secs(1), 2_000, TIMEOUT);
        let woke = t0 + Duration::from_secs(20);
        s.observe(true, woke, 21_000, TIMEOUT);
        assert_eq!(s.kept_since(woke, TIMEOUT), Some(21_000));
    }

    fn fork(formed_ms: u64, master: Option<NodeId>) -> Option<ForkNews> {
        Some(ForkNews { formed_ms: Some(formed_ms), master, former_left: false })
    }

    /// Replicas of the newer epoch answered, none with its record.
    fn unrecorded(master: Option<NodeId>, former_left: bool) -> Option<ForkNews> {
        Some(ForkNews { formed_ms: None, master, former_left })
    }

    #[test]
    fn a_fork_formed_while_the_group_kept_its_majority_yields() {
        assert_eq!(master_verdict(Some(1_000), fork(10_000, Some(4)), TIMEOUT), Verdict::Keep);
        assert_eq!(master_verdict(Some(1_000), fork(10_000, None), TIMEOUT), Verdict::Keep);
    }

    #[test]
    fn the_group_heals_into_a_serving_epoch_formed_while_it_had_no_majority() {
        // The classic demo: the old group came back after the new epoch
        // formed, and that epoch has a master to hand back to.
        assert_eq!(master_verdict(Some(20_000), fork(10_000, Some(3)), TIMEOUT), Verdict::Heal);
        assert_eq!(master_verdict(None, fork(10_000, Some(3)), TIMEOUT), Verdict::Heal);
        // Too close to call on clocks that differ a little: heal.
        assert_eq!(master_verdict(Some(9_000), fork(10_000, Some(3)), TIMEOUT), Verdict::Heal);
    }

    #[test]
    fn a_serving_group_does_not_heal_into_an_epoch_without_a_master() {
        // The master that meets the fork was elected after it formed,
        // and the fork's last replica cannot elect.
        assert_eq!(master_verdict(Some(20_000), fork(10_000, None), TIMEOUT), Verdict::Keep);
        // Neither side can serve: wait.
        assert_eq!(master_verdict(None, fork(10_000, None), TIMEOUT), Verdict::Undecided(Undecided::NoMaster));
    }

    #[test]
    fn a_fork_whose_only_replica_has_no_record_and_no_master_yields_to_a_serving_group() {
        // The fork's former yielded; the replica left in it joined
        // without ever hearing from the fork's master.
        assert_eq!(master_verdict(Some(1_000), unrecorded(None, true), TIMEOUT), Verdict::Keep);
        assert_eq!(master_verdict(None, unrecorded(None, true), TIMEOUT), Verdict::Undecided(Undecided::NoMaster));
        // The former did not say it left: the replica may just not have
        // heard from a live master yet. Ask again later.
        assert_eq!(
            master_verdict(Some(1_000), unrecorded(None, false), TIMEOUT),
            Verdict::Undecided(Undecided::CannotAsk)
        );
        // It knows a master, which will send it the record: ask again then.
        assert_eq!(
            master_verdict(Some(1_000), unrecorded(Some(4), false), TIMEOUT),
            Verdict::Undecided(Undecided::CannotAsk)
        );
        assert_eq!(master_verdict(None, unrecorded(Some(4), false), TIMEOUT), Verdict::Heal);
    }

    #[test]
    fn a_group_with_its_majority_waits_when_no_replica_of_the_fork_answers() {
        assert_eq!(master_verdict(Some(1_000), None, TIMEOUT), Verdict::Undecided(Undecided::CannotAsk));
        assert_eq!(master_verdict(None, None, TIMEOUT), Verdict::Heal);
    }

    #[test]
    fn a_joint_configuration_needs_a_majority_of_each_of_its_voter_sets() {
        let (old, new) = (BTreeSet::from([1, 2, 3, 5]), BTreeSet::from([1, 2, 3, 4, 5]));
        let joint = [old.clone(), new.clone()];
        // The master (1) crashed mid-change and 5 is cut off: 2, 3 and 4
        // are three of the five, but two of the old four.
        let alive = BTreeSet::from([2, 3, 4]);
        assert!(quorum(std::slice::from_ref(&new), |v| alive.contains(&v)));
        assert!(!quorum(&joint, |v| alive.contains(&v)), "no majority of the old voters");
        let alive = BTreeSet::from([1, 2, 4]);
        assert!(!quorum(&joint, |v| alive.contains(&v)), "no majority of the new voters");
        let alive = BTreeSet::from([1, 2, 3]);
        assert!(quorum(&joint, |v| alive.contains(&v)));
        assert!(!quorum(&[], |_| true), "no voters, no quorum");
    }

    #[test]
    fn voters_answering_from_a_newer_epoch_are_no_longer_ours() {
        let t0 = Instant::now();
        let voters = [BTreeSet::from([1, 2, 3])];
        let mut in_newer = HashMap::from([(3, t0)]);
        assert!(majority_in_our_epoch(&voters, &in_newer, t0, TIMEOUT), "one of three left: two remain");
        in_newer.insert(2, t0);
        assert!(!majority_in_our_epoch(&voters, &in_newer, t0, TIMEOUT), "the master alone is no majority");
        // Not heard from the newer epoch for the failure timeout: back.
        assert!(majority_in_our_epoch(&voters, &in_newer, t0 + TIMEOUT, TIMEOUT));
    }

    fn db() -> (tempfile::TempDir, NodeDb) {
        let dir = tempfile::tempdir().unwrap();
        let db = NodeDb::open(dir.path(), &Default::default()).unwrap();
        (dir, db)
    }

    fn formed(term: u64, node: NodeId, from: Epoch, next_seq: u64) -> Formed {
        Formed { epoch: Epoch { term, node }, from, next_seq, next_order: 0 }
    }

    #[test]
    fn a_fork_of_its_own_fork_hands_back_since_it_left_the_winner() {
        let (_dir, db) = db();
        let root = Epoch::default();
        let a = formed(3, 4, root, 100);
        let b = formed(4, 4, a.epoch, 150);
        add_formed(&db, 1, a).unwrap();
        add_formed(&db, 1, b).unwrap();
        let left = left_through_own_forks(&db, 1, b.epoch, root).unwrap();
        assert_eq!(left.next_seq, 100, "everything stored since the first fork of the chain");
        assert_eq!(left_through_own_forks(&db, 1, b.epoch, a.epoch).unwrap().next_seq, 150);
        // A replica no longer in the chain's last epoch has no such bound.
        assert!(left_through_own_forks(&db, 1, a.epoch, root).is_none());
        // A re-formation from an epoch formed elsewhere starts a new chain.
        let c = formed(7, 4, Epoch { term: 6, node: 2 }, 300);
        add_formed(&db, 1, c).unwrap();
        assert!(left_through_own_forks(&db, 1, c.epoch, root).is_none());
        assert_eq!(left_through_own_forks(&db, 1, c.epoch, c.from).unwrap().next_seq, 300);
        // A later fork formed from less than the one before had applied:
        // only below the lower counters were the numbers given in the
        // winner (above them this chain numbered its own messages).
        let (_dir2, db2) = self::db();
        let a = formed(3, 4, root, 1_000);
        let b = formed(9, 4, a.epoch, 300);
        add_formed(&db2, 1, a).unwrap();
        add_formed(&db2, 1, b).unwrap();
        let left = left_through_own_forks(&db2, 1, b.epoch, root).unwrap();
        assert_eq!((left.epoch, left.from, left.next_seq), (a.epoch, root, 300));
    }

    #[test]
    fn a_lost_majority_ends_the_stretch_after_the_failure_timeout() {
        let t0 = Instant::now();
        let mut s = MajorityStretch::new(t0);
        s.observe(true, t0, 1_000, TIMEOUT);
        // Short losses (a slow ping) do not end it.
        s.observe(false, t0 + Duration::from_secs(2), 3_000, TIMEOUT);
        s.observe(true, t0 + Duration::from_secs(3), 4_000, TIMEOUT);
        assert_eq!(s.kept_since(t0 + Duration::from_secs(3), TIMEOUT), Some(1_000));
        s.observe(false, t0 + Duration::from_secs(9), 10_000, TIMEOUT);
        s.observe(true, t0 + Duration::from_secs(10), 11_000, TIMEOUT);
        assert_eq!(s.kept_since(t0 + Duration::from_secs(10), TIMEOUT), Some(11_000));
    }
}
