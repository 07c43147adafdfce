//! The pure rules of failover: seniority, who re-forms, whether a master
//! still leads.

use std::collections::BTreeSet;

use openraft::BasicNode;

use crate::ids::NodeId;
use crate::metadata::QueueMeta;

/// `ids` ordered by seniority: the metadata's replica order first, then any
/// others by id.
pub(super) fn by_seniority(q: &QueueMeta, ids: &BTreeSet<NodeId>) -> Vec<NodeId> {
    let mut out: Vec<NodeId> = q.replicas.iter().copied().filter(|id| ids.contains(id)).collect();
    out.extend(ids.iter().copied().filter(|id| !q.replicas.contains(id)));
    out
}

/// Who re-forms a group that lost its majority: the most senior voter
/// left, else the most senior wanted replica left. A voter has the group's
/// log up to its last commit; a learner may still be catching up. So when
/// a voter of a two-voter group restarts, a learner that joined a moment
/// ago must not re-form the queue over the live master merely because the
/// queue's order ranks it senior.
pub(super) fn reformer(
    replicas: &[NodeId],
    alive_voters: &BTreeSet<NodeId>,
    alive: &BTreeSet<NodeId>,
) -> Option<NodeId> {
    let from = if alive_voters.is_empty() { alive } else { alive_voters };
    replicas.iter().copied().find(|id| from.contains(id)).or_else(|| from.first().copied())
}

/// The voters in reach that [`reformer`] picks from. While a membership
/// change is under way (a joint configuration), the voters of the old set
/// in reach, if any: a voter only of the new set may be a learner promoted
/// a moment ago, still behind the last commit.
pub(super) fn reform_voters(configs: &[BTreeSet<NodeId>], reach: &BTreeSet<NodeId>) -> BTreeSet<NodeId> {
    let old: BTreeSet<NodeId> = configs.first().map(|c| c.intersection(reach).copied().collect()).unwrap_or_default();
    if !old.is_empty() {
        return old;
    }
    configs.iter().flatten().filter(|v| reach.contains(v)).copied().collect()
}

/// Whether the last master a replica knows still leads the queue: it is
/// this replica, or in reach and heard from lately (a quiet master's
/// announcement holds its followers before this is asked), and still a
/// voter. A master that moved the queue away from itself and stepped down
/// answers pings but leads no one; counting it would keep every voter but
/// the most senior from standing while the senior cannot win, and the
/// queue would wait without a master for good. So does a master back from
/// a crash that is not leading until an election says so
/// (`LogStore::step_down_after_crash`), when its log is behind the
/// mirrors' and it cannot win.
pub(super) fn still_leads(
    leader: NodeId,
    me: NodeId,
    reach: &BTreeSet<NodeId>,
    voters: &BTreeSet<NodeId>,
    heard: bool,
) -> bool {
    (leader == me || (reach.contains(&leader) && heard)) && voters.contains(&leader)
}

/// Why a replica's Raft core no longer runs, if it does not: it quit on
/// an error (its last metrics say which), or it is gone without a word
/// (its metrics' sender dropped, as when its task panicked).
pub(super) fn core_quit(
    metrics: &tokio::sync::watch::Receiver<openraft::RaftMetrics<NodeId, BasicNode>>,
) -> Option<String> {
    if let Err(fatal) = &metrics.borrow().running_state {
        return Some(fatal.to_string());
    }
    metrics.has_changed().is_err().then(|| "the Raft core ended".to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_master_that_moved_the_queue_away_leads_no_one() {
        let set = |ids: &[NodeId]| ids.iter().copied().collect::<BTreeSet<NodeId>>();
        let (reach, voters) = (set(&[1, 2, 3, 5]), set(&[1, 2, 3]));
        // Node 5 moved the queue to 1-3 and stepped down: still in reach,
        // no longer a voter.
        assert!(!still_leads(5, 2, &reach, &voters, true));
        assert!(still_leads(1, 2, &reach, &voters, true));
        assert!(still_leads(2, 2, &set(&[1]), &voters, false), "this replica leads without pinging itself");
        assert!(!still_leads(3, 2, &set(&[1, 2]), &voters, true), "a master out of reach leads no one");
        // Back from a crash, node 1 answers pings but sends nothing: it is
        // not leading.
        assert!(!still_leads(1, 2, &reach, &voters, false));
    }

    #[test]
    fn a_live_voter_re_forms_before_a_more_senior_learner() {
        let set = |ids: &[NodeId]| ids.iter().copied().collect::<BTreeSet<NodeId>>();
        let replicas = [1, 2, 3, 4, 5];
        // Voters {1, 4}, 1 restarting; 2 joined as a learner.
        assert_eq!(reformer(&replicas, &set(&[4]), &set(&[2, 3, 4, 5])), Some(4));
        // No voter left: the most senior wanted replica carries on.
        assert_eq!(reformer(&replicas, &set(&[]), &set(&[3, 5])), Some(3));
        assert_eq!(reformer(&replicas, &set(&[]), &set(&[])), None);
    }

    #[test]
    fn in_a_membership_change_a_voter_of_the_old_set_re_forms() {
        let set = |ids: &[NodeId]| ids.iter().copied().collect::<BTreeSet<NodeId>>();
        // 4, senior by the queue's order, is a voter only of the new set:
        // promoted a moment ago, it may lack the last commit.
        let (replicas, joint) = ([4, 1, 2, 3, 5], [set(&[1, 2, 3]), set(&[1, 2, 3, 4])]);
        let reach = set(&[2, 4]);
        assert_eq!(reform_voters(&joint, &reach), set(&[2]));
        assert_eq!(reformer(&replicas, &reform_voters(&joint, &reach), &reach), Some(2));
        // No voter of the old set in reach: the new set's.
        assert_eq!(reform_voters(&joint, &set(&[4, 5])), set(&[4]));
        // Without a change under way, every voter in reach.
        assert_eq!(reform_voters(&[set(&[1, 2, 3])], &set(&[2, 3, 5])), set(&[2, 3]));
    }
}
