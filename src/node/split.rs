//! Deciding a split: when the replicas of a group meet a newer epoch that
//! a minority of them formed (re-formed the queue alone after the failure
//! timeout), which epoch keeps the queue. The old group keeps it if it
//! kept a live majority across the moment the fork was formed; the fork
//! then yields (hands back what only it has and rejoins as a new mirror).
//! Otherwise, as in the classic demo, the old group heals into the new
//! epoch (`failover.rs`). The reasoning is in `docs/reliability.md`, "The
//! rule for a split".

use std::collections::BTreeSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use openraft::ServerState;

use super::{Node, QueueGroup};
use crate::ids::{GroupId, NodeId};
use crate::link::rpc::{RpcRequest, RpcResponse};
use crate::queue::epoch::Epoch;
use crate::raft::network::EpochNews;
use mirrorq_storage::{NodeDb, StorageError};

/// When and where this node re-formed the group ([`Formed`]).
pub(super) fn formed_key(group: GroupId) -> String {
    format!("formed/{group}")
}
/// Epochs of the group formed by a minority while our group kept its
/// majority: their replicas yield to ours.
fn defeated_key(group: GroupId) -> String {
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
    /// Wall clock, ms.
    pub(super) at_ms: u64,
    /// The queue's counters as applied when it re-formed: what it stored
    /// since is what only this epoch has (its log's older entries were
    /// committed in the old group).
    pub(super) next_seq: u64,
    pub(super) next_tag: u64,
}

pub(super) fn formed(db: &NodeDb, group: GroupId, epoch: Epoch) -> Option<Formed> {
    let b = db.get_node_value(&formed_key(group)).ok()??;
    let f = mirrorq_storage::keys::decode::<Formed>(&b, "formed").ok()?;
    (f.epoch == epoch).then_some(f)
}

/// When this node formed `epoch` of `group`, if it did.
pub(super) fn formed_at(db: &NodeDb, group: GroupId, epoch: Epoch) -> Option<u64> {
    formed(db, group, epoch).map(|f| f.at_ms)
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
    /// until now: that epoch is a minority's fork, and it yields.
    Keep,
    /// We follow a master that is alive: it decides for the group.
    Defer,
    /// We are the master, our group has its majority, and the node that
    /// formed the newer epoch cannot be asked when it did (a one-way cut:
    /// its messages reach us, ours do not reach it). Keep serving and ask
    /// again on its next message: healing now would hand a healthy queue
    /// to a node nobody can reach.
    Undecided,
}

impl Node {
    /// Decide for our group, of an older epoch than `news`'s, which epoch
    /// keeps the queue. Only the master decides, so the replicas of one
    /// group never part ways: a replica following a master in reach defers
    /// (the master hears of the newer epoch too: its appends to that
    /// epoch's replicas are refused).
    pub(super) async fn split_verdict(&self, g: &Arc<QueueGroup>, news: EpochNews) -> Verdict {
        let m = g.raft.metrics().borrow().clone();
        let me = self.id();
        let timing = &self.inner.timing;
        if m.state != ServerState::Leader {
            // In reach and still sending us appends: a master restored
            // from a vote on disk that has left our epoch sends none.
            let heard = *g.watch.master_heard.lock().expect("poisoned");
            let master_alive = m.current_leader.is_some_and(|l| l != me)
                && heard.is_some_and(|t| t.elapsed() < timing.failure_timeout);
            return if master_alive { Verdict::Defer } else { Verdict::Heal };
        }
        let kept_since = g.watch.majority.lock().expect("poisoned").kept_since(Instant::now(), timing.failure_timeout);
        let Some(since) = kept_since else { return Verdict::Heal };
        let Some(formed) = self.fetch_formed_at(news).await else { return Verdict::Undecided };
        // Clocks of different machines differ a little; the newer epoch
        // formed a failure timeout after its node lost our majority, so a
        // majority kept from before that is well clear of it.
        let margin = timing.failure_timeout.as_millis() as u64 / 2;
        if since.saturating_add(margin) <= formed {
            Verdict::Keep
        } else {
            Verdict::Heal
        }
    }

    /// When the newer epoch of `news` was formed, from the node that
    /// formed it (the one that told us first, else the other replicas).
    async fn fetch_formed_at(&self, news: EpochNews) -> Option<u64> {
        let q = self.metadata().queues.values().find(|q| q.group == news.group).cloned()?;
        let mut peers = vec![news.from, news.epoch.node];
        peers.extend(q.replicas.iter().copied());
        peers.dedup();
        for peer in peers.into_iter().filter(|p| *p != self.id()) {
            let limit = Instant::now() + Duration::from_secs(1);
            if let Ok(RpcResponse::Fork(Some(rec), Some(at))) =
                self.inner.call(peer, &RpcRequest::Fork { group: news.group }, limit).await
            {
                if rec.epoch == news.epoch {
                    return Some(at);
                }
            }
        }
        None
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
        let req = RpcRequest::Yield { group, defeated: news.epoch, winner: g.epoch, from: self.id() };
        if let Err(e) = self.inner.call(news.from, &req, Instant::now() + Duration::from_secs(2)).await {
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
        let result = g.raft.change_membership(change, false).await;
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
        // Campaign seed 648: the master was SIGSTOPped for 19 s while a
        // fork formed. Nothing watched meanwhile, so the majority it sees
        // on waking is no evidence it kept one while the fork formed.
        let t0 = Instant::now();
        let mut s = MajorityStretch::new(t0);
        s.observe(true, t0, 1_000, TIMEOUT);
        s.observe(true, t0 + Duration::from_secs(1), 2_000, TIMEOUT);
        let woke = t0 + Duration::from_secs(20);
        s.observe(true, woke, 21_000, TIMEOUT);
        assert_eq!(s.kept_since(woke, TIMEOUT), Some(21_000));
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
