//! Epochs: how a queue goes on after losing the majority of its group, and
//! how the replicas of an older epoch find out what they must hand back.
//!
//! Raft cannot change a group's membership without a majority. When the
//! master and most mirrors are gone and `ha-promote-on-failure` is `always`,
//! a surviving replica *re-forms* the group: it makes its own log the start of
//! a new epoch with itself as the only voter (see `failover`). Replicas
//! still in an older epoch must never be merged back by Raft's log repair,
//! which would silently drop whatever they accepted that the new epoch lacks.
//! So every Raft message carries the sender's epoch, and a replica that learns
//! of a newer epoch stops, hands back its messages past the point where its
//! log and the new epoch's history part ([`divergence`]), wipes its copy and
//! rejoins as a new mirror.
//!
//! Finding that point is the job of the [`ForkRecord`]: the leader ids of the
//! re-forming replica's log at the moment it re-formed, as runs of indexes
//! (the idea of Kafka's leader-epoch cache). Log ids carry the leader's
//! `(term, node)`, and a node leads a given term at most once, so an entry of
//! the stale replica is in the new epoch's history exactly when the record
//! shows the same leader at its index.

use std::fmt;

use openraft::LogId;
use serde::{Deserialize, Serialize};

use crate::ids::NodeId;

/// Which incarnation of a queue's group a replica belongs to. `(0, 0)` is
/// the group as founded; a re-formation creates `(term, node)` with a term
/// above any the re-forming node has seen. Higher epochs win.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Epoch {
    pub term: u64,
    pub node: NodeId,
}

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.term, self.node)
    }
}

/// A log entry's leader: `(term, node)`.
pub type Leader = (u64, NodeId);

/// The term a new queue's group starts in, led by its designated master
/// (the node's reconcile founds it).
pub const FOUNDING_TERM: u64 = 1;

fn leader_of(id: &LogId<NodeId>) -> Leader {
    (id.leader_id.term, id.leader_id.node_id)
}

/// The re-forming replica's log at the moment it re-formed.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkRecord {
    pub epoch: Epoch,
    /// Runs of equal leaders: `(last index of the run, leader)`, ascending.
    pub runs: Vec<(u64, Leader)>,
    /// First index the runs describe; below it only `purged` is known.
    pub known_from: u64,
    /// The last purged entry (covered by a snapshot), if any.
    pub purged: Option<(u64, Leader)>,
    /// When the epoch was formed (wall clock, ms; 0 in a record of a live
    /// log's history). Replicated with the record, so any replica of the
    /// epoch can answer the split rule's question, not only the node that
    /// formed it, which may have moved on to another epoch since.
    pub formed_ms: u64,
    /// What the epoch took over from the one it was formed from, then what
    /// that one took over from its own, and so on (nearest first, at most
    /// [`ANCESTRY`]; empty in a record of a live log's history).
    pub inherited: Vec<Inherited>,
}

/// How many epochs back a fork record traces its ancestry: two epochs
/// whose nearest common ancestor is further back share nothing known.
pub const ANCESTRY: usize = 32;

/// The epoch a re-formed one came from, and the queue's counters as the
/// forming replica had applied them: messages with lower numbers were
/// stored by entries committed in that epoch, which number them alike on
/// every replica of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Inherited {
    pub from: Epoch,
    /// `Counters::next_seq`: plain messages below it were inherited.
    pub next_seq: u64,
    /// `Counters::next_requeue`: tracked (handed-back, prioritized)
    /// messages numbered below it were inherited.
    pub next_order: u64,
}

/// Which messages of ours (in epoch `ours`, with the ancestry `our_line`
/// of its fork record) the epoch `theirs` (ancestry `their_line`) holds
/// already, or had and consumed, when the logs cannot tell where the
/// histories part (a log compacted past that point): those numbered
/// below the bounds returned. Known when one epoch descends from the
/// other (up to where its line left it), or both from a common ancestor
/// (up to the lower of the points where their lines left it: below both,
/// a number was given by that ancestor's committed entries). `None`:
/// nothing is known to be shared.
pub fn shared_numbers(
    ours: Epoch,
    our_line: &[Inherited],
    theirs: Epoch,
    their_line: &[Inherited],
) -> Option<(u64, u64)> {
    // A number came from `line[k].from` only if it is below the bounds of
    // every entry from the line's start to `k` (`state::numbered_in`
    // reads a line so): an epoch formed from a replica that had applied
    // less than its parent inherited passes on less, and the bounds need
    // not shrink monotonically up the line.
    let upto = |line: &[Inherited], k: usize| {
        line[..=k].iter().fold((u64::MAX, u64::MAX), |(s, o), i| (s.min(i.next_seq), o.min(i.next_order)))
    };
    if let Some(k) = their_line.iter().position(|t| t.from == ours) {
        return Some(upto(their_line, k));
    }
    if let Some(j) = our_line.iter().position(|o| o.from == theirs) {
        return Some(upto(our_line, j));
    }
    our_line.iter().enumerate().find_map(|(j, o)| {
        their_line.iter().position(|t| t.from == o.from).map(|k| {
            let (a, b) = (upto(our_line, j), upto(their_line, k));
            (a.0.min(b.0), a.1.min(b.1))
        })
    })
}

/// What a replica tells of the epoch it is in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochReport {
    pub epoch: Epoch,
    /// The epoch's fork record, if the replica has it: a replica that
    /// joined the epoch has it only once its master sent it.
    pub record: Option<ForkRecord>,
    /// The epoch's master, if the replica knows one in reach.
    pub master: Option<NodeId>,
}

impl ForkRecord {
    /// Build from the log ids of a log (ascending) and its purge point.
    pub fn from_log(epoch: Epoch, purged: Option<LogId<NodeId>>, ids: impl IntoIterator<Item = LogId<NodeId>>) -> Self {
        let mut runs: Vec<(u64, Leader)> = Vec::new();
        let mut known_from = None;
        for id in ids {
            known_from.get_or_insert(id.index);
            let leader = leader_of(&id);
            match runs.last_mut() {
                Some((last, l)) if *l == leader => *last = id.index,
                _ => runs.push((id.index, leader)),
            }
        }
        let purged = purged.map(|p| (p.index, leader_of(&p)));
        let known_from = known_from.unwrap_or_else(|| purged.map_or(0, |p| p.0 + 1));
        Self { epoch, runs, known_from, purged, formed_ms: 0, inherited: Vec::new() }
    }

    /// Is the entry with this id part of the re-formed epoch's history?
    pub fn contains(&self, id: &LogId<NodeId>) -> bool {
        let leader = leader_of(id);
        if self.purged == Some((id.index, leader)) {
            return true;
        }
        if id.index < self.known_from {
            return false;
        }
        self.runs.iter().find(|(last, _)| *last >= id.index).is_some_and(|(_, l)| *l == leader)
    }
}

/// The last index up to which a replica's log (its remaining entries' ids,
/// ascending, and its purge point) is shared with the epoch `record`
/// describes. `None`: nothing is known to be shared, so everything the
/// replica holds must be handed back. When unsure it answers lower, which
/// costs duplicates, never losses.
pub fn divergence(record: &ForkRecord, purged: Option<LogId<NodeId>>, ids: &[LogId<NodeId>]) -> Option<u64> {
    // Shared entries form a prefix (Raft's log matching), so the highest
    // shared entry found is the answer.
    if let Some(id) = ids.iter().rev().find(|id| record.contains(id)) {
        return Some(id.index);
    }
    purged.filter(|p| record.contains(p)).map(|p| p.index)
}

#[cfg(test)]
mod tests {
    use openraft::CommittedLeaderId;

    use super::*;

    fn id(term: u64, node: NodeId, index: u64) -> LogId<NodeId> {
        LogId::new(CommittedLeaderId::new(term, node), index)
    }

    fn log(spec: &[(u64, NodeId, std::ops::RangeInclusive<u64>)]) -> Vec<LogId<NodeId>> {
        spec.iter().flat_map(|(t, n, r)| r.clone().map(move |i| id(*t, *n, i))).collect()
    }

    #[test]
    fn numbers_are_shared_with_a_parent_a_child_or_a_sibling_only() {
        let e = |term, node| Epoch { term, node };
        let fork = |from, next_seq, next_order| Inherited { from, next_seq, next_order };
        let (parent, left, right) = (e(1, 1), e(3, 1), e(4, 3));
        let l = [fork(parent, 100, 7)];
        let r = [fork(parent, 80, 9)];
        // They formed from us: below their starting point.
        assert_eq!(shared_numbers(parent, &[], right, &r), Some((80, 9)));
        // We formed from them.
        assert_eq!(shared_numbers(left, &l, parent, &[]), Some((100, 7)));
        // Siblings: the lower of the two.
        assert_eq!(shared_numbers(left, &l, right, &r), Some((80, 7)));
        // Cousins: where their lines left the common ancestor, not where
        // the nearer epochs left their parents.
        let (uncle, nephew) = (e(2, 2), e(6, 3));
        let nephew_line = [fork(uncle, 500, 40), fork(parent, 90, 8)];
        assert_eq!(shared_numbers(left, &l, nephew, &nephew_line), Some((90, 7)));
        // A grandchild of ours.
        assert_eq!(shared_numbers(parent, &[], nephew, &nephew_line), Some((90, 8)));
        // A line whose nearer epoch inherited less than its parent had: the
        // parent's numbers above the nearer bound were never passed on
        // (its former had applied less), so they are not shared.
        let (w, f, f2) = (e(0, 0), e(5, 1), e(8, 1));
        let short = [fork(f, 300, 4), fork(w, 1_000, 9)];
        assert_eq!(shared_numbers(w, &[], f2, &short), Some((300, 4)));
        assert_eq!(shared_numbers(f2, &short, w, &[]), Some((300, 4)));
        let sibling = [fork(w, 900, 20)];
        assert_eq!(shared_numbers(f2, &short, e(9, 2), &sibling), Some((300, 4)));
        // No ancestor in common, or no records: nothing known.
        let stranger = [fork(e(9, 9), 50, 5)];
        assert_eq!(shared_numbers(left, &l, e(10, 2), &stranger), None);
        assert_eq!(shared_numbers(left, &[], right, &[]), None);
    }

    #[test]
    fn record_keeps_runs_of_leaders() {
        let ids = log(&[(1, 1, 1..=4), (2, 2, 5..=9), (3, 1, 10..=10)]);
        let r = ForkRecord::from_log(Epoch { term: 4, node: 3 }, Some(id(1, 1, 0)), ids);
        assert_eq!(r.runs, vec![(4, (1, 1)), (9, (2, 2)), (10, (3, 1))]);
        assert_eq!(r.known_from, 1);
        assert!(r.contains(&id(2, 2, 7)));
        assert!(!r.contains(&id(2, 3, 7)), "same term, other leader: another history");
        assert!(!r.contains(&id(3, 1, 11)), "beyond the fork");
        assert!(r.contains(&id(1, 1, 0)), "the purge point is known");
    }

    #[test]
    fn a_replica_with_the_same_log_shares_all_of_it() {
        let ids = log(&[(1, 1, 1..=20)]);
        let r = ForkRecord::from_log(Epoch { term: 2, node: 3 }, None, ids.clone());
        assert_eq!(divergence(&r, None, &ids), Some(20));
    }

    #[test]
    fn entries_the_survivor_never_had_are_divergent() {
        // The old master 1 wrote 11..=15 in term 1 that survivor 3 never got.
        let survivor = log(&[(1, 1, 1..=10)]);
        let r = ForkRecord::from_log(Epoch { term: 2, node: 3 }, None, survivor);
        let stale = log(&[(1, 1, 1..=15)]);
        assert_eq!(divergence(&r, None, &stale), Some(10));
    }

    #[test]
    fn a_later_leader_of_the_old_epoch_diverges_where_it_started() {
        // After 3 re-formed, 1 and 2 came back and elected 2 in term 2 at 11.
        let survivor = log(&[(1, 1, 1..=12)]);
        let r = ForkRecord::from_log(Epoch { term: 2, node: 3 }, None, survivor);
        let stale = log(&[(1, 1, 1..=10), (2, 2, 11..=14)]);
        assert_eq!(divergence(&r, None, &stale), Some(10));
    }

    #[test]
    fn purged_survivor_log_is_matched_through_later_entries() {
        let survivor = log(&[(1, 1, 51..=60)]);
        let r = ForkRecord::from_log(Epoch { term: 2, node: 3 }, Some(id(1, 1, 50)), survivor);
        // The stale replica still has old entries the survivor purged: they
        // are shared because a later one is.
        let stale = log(&[(1, 1, 30..=58)]);
        assert_eq!(divergence(&r, None, &stale), Some(58));
    }

    #[test]
    fn nothing_known_in_common_hands_back_everything() {
        let r = ForkRecord::from_log(Epoch { term: 5, node: 3 }, Some(id(1, 1, 100)), log(&[(4, 3, 101..=110)]));
        let stale = log(&[(1, 1, 20..=40)]);
        assert_eq!(divergence(&r, Some(id(1, 1, 19)), &stale), None);
        // ...unless the stale replica's purge point is the survivor's.
        assert_eq!(divergence(&r, Some(id(1, 1, 100)), &[]), Some(100));
    }

    #[test]
    fn epochs_order_by_term_then_node() {
        let a = Epoch { term: 3, node: 2 };
        assert!(Epoch::default() < a);
        assert!(a < Epoch { term: 3, node: 3 });
        assert!(Epoch { term: 3, node: 3 } < Epoch { term: 4, node: 1 });
    }
}
