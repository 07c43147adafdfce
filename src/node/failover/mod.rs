//! What a node does when the replicas of a queue fail: who may stand for
//! election (seniority), re-forming a group that lost its majority
//! (`ha-promote-on-failure: always`), healing replicas of an older epoch, and
//! handing over mastership on a graceful stop. The reasoning is in
//! `docs/reliability.md`; the epoch rules in `queue::epoch`.

mod epoch;
mod handover;
mod heal;
mod reform;
mod rules;
mod watch;

pub(super) use epoch::{load_epoch, term_floor_key};

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::Instant;

use crate::ids::{GroupId, NodeId};
use crate::metadata::{policy, MetaState, QueueMeta};
use crate::node::split::MajorityStretch;
use crate::queue::epoch::Epoch;

/// What failover watches about one replica of a group, kept with it.
pub(super) struct GroupWatch {
    /// When a majority of the group's voters last answered pings, and
    /// since when without a break.
    pub(super) majority: Mutex<MajorityStretch>,
    /// When a master of this replica's epoch last sent it entries or a
    /// heartbeat.
    pub(super) master_heard: Mutex<Option<Instant>>,
    /// AppendEntries calls (entries or heartbeats) received.
    pub(super) appends: std::sync::atomic::AtomicU64,
    /// Since when this replica has known no master.
    pub(super) leaderless_since: Mutex<Option<Instant>>,
    /// Since when the master this replica follows has not answered pings.
    pub(super) master_lost_since: Mutex<Option<Instant>>,
    /// An election is timed to start when the lost master's lease is out.
    pub(super) elect_at: Mutex<Option<Instant>>,
    /// The newer epoch this replica, as master, last could not decide a
    /// split against (its node could not be asked), and when.
    pub(super) undecided: Mutex<Option<(Epoch, Instant)>>,
    /// When this replica started.
    pub(super) started: Instant,
    /// Replicas that answered from a newer epoch of the group, and when
    /// last: they follow no master of ours, however well they answer pings.
    pub(super) in_newer: Mutex<HashMap<NodeId, Instant>>,
    /// As master: since when the group has been settled at (term, last
    /// log index), for `quiescence`.
    pub(super) settled: Mutex<Option<(Instant, super::quiescence::Mark)>>,
    /// As follower: the quiet master last seen in reach, its term, and
    /// when (its node's pings are the group's heartbeats).
    pub(super) quiet_master: Mutex<Option<(NodeId, u64, Instant)>>,
    /// The group's Raft metrics, as the watch last looked at them.
    metrics: Mutex<tokio::sync::watch::Receiver<openraft::RaftMetrics<NodeId, openraft::BasicNode>>>,
    /// Quiet at the watch's last full look, and as of which
    /// `Quiescence::world_of` the group, with whether a majority of voters
    /// was in reach: while neither that nor the group's metrics changed,
    /// the next rounds only extend the majority stretch.
    passed: Mutex<Option<((u64, u64), bool)>>,
}

impl GroupWatch {
    pub(super) fn new(
        metrics: tokio::sync::watch::Receiver<openraft::RaftMetrics<NodeId, openraft::BasicNode>>,
    ) -> Self {
        GroupWatch {
            majority: Mutex::new(MajorityStretch::new(Instant::now())),
            master_heard: Mutex::new(None),
            appends: std::sync::atomic::AtomicU64::new(0),
            leaderless_since: Mutex::new(None),
            master_lost_since: Mutex::new(None),
            elect_at: Mutex::new(None),
            undecided: Mutex::new(None),
            started: Instant::now(),
            in_newer: Mutex::new(HashMap::new()),
            settled: Mutex::new(None),
            quiet_master: Mutex::new(None),
            metrics: Mutex::new(metrics),
            passed: Mutex::new(None),
        }
    }
}

/// The mirroring settings in force for a queue.
pub(super) fn ha_of(state: &MetaState, q: &QueueMeta) -> policy::HaPolicy {
    q.policy
        .as_ref()
        .and_then(|n| state.policies.get(n))
        .and_then(|p| policy::ha_policy_of(&p.definition))
        .unwrap_or_default()
}

/// Marks a group busy (re-forming, healing, moving its master) until dropped.
pub(super) struct Busy<'a> {
    set: &'a std::sync::Mutex<HashSet<GroupId>>,
    group: GroupId,
}

impl<'a> Busy<'a> {
    /// `None` if someone else has the group.
    pub(super) fn take(set: &'a std::sync::Mutex<HashSet<GroupId>>, group: GroupId) -> Option<Self> {
        // Not `then_some`: it would build (and drop) a `Busy` even when the
        // group is taken, and that drop would lock `set` again while this
        // lock is held (a deadlock) and free the other holder's claim.
        let fresh = set.lock().expect("poisoned").insert(group);
        fresh.then(|| Busy { set, group })
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.set.lock().expect("poisoned").remove(&self.group);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_claim_leaves_the_holder_alone() {
        let set = std::sync::Mutex::new(HashSet::new());
        let first = Busy::take(&set, 7).expect("free");
        // Before the fix this call deadlocked on `set`.
        assert!(Busy::take(&set, 7).is_none());
        assert!(set.lock().unwrap().contains(&7), "the refused claim freed the holder's");
        assert!(Busy::take(&set, 8).is_some(), "other groups are free");
        drop(first);
        assert!(set.lock().unwrap().is_empty());
    }
}
