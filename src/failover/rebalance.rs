//! Rebalancing masters over the nodes (`mirrorq ctl rebalance`), and moving
//! one queue's mastership to a chosen mirror.
//!
//! openraft 0.9 has no leadership transfer, and its leader lease makes every
//! member refuse votes while the master's heartbeats are recent. A move
//! therefore goes: the master stops proposing and waits until the successor
//! has its whole log (and every confirm in flight is answered); it stops its
//! replica, records on disk its vote for the successor in the next term,
//! and starts the replica again: a follower that has already granted that
//! vote, which no lease prevents. Asked to stand, the successor wins with
//! that vote (plus its own: a majority of up to three voters) at once.
//! Operations arriving meanwhile wait, then go to the new master.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use openraft::ServerState;
use serde::Serialize;

use super::{Busy, Failover, Host};
use crate::error::NodeError;
use crate::ids::{GroupId, NodeId};
use crate::wire::ask;

/// One mastership move of a rebalance, and how it went.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Move {
    pub queue: String,
    pub from: NodeId,
    pub to: NodeId,
    /// `None`: moved; otherwise why not.
    pub error: Option<String>,
}

/// Moves `(queue, from, to)` after which every node masters within one
/// queue of every other node, as far as where the replicas are allows.
/// `queues`: each mirrored queue's master and replicas. Deterministic.
pub fn plan_moves(
    queues: &BTreeMap<String, (NodeId, Vec<NodeId>)>,
    nodes: &BTreeSet<NodeId>,
) -> Vec<(String, NodeId, NodeId)> {
    let mut master: BTreeMap<&str, NodeId> = queues.iter().map(|(q, (m, _))| (q.as_str(), *m)).collect();
    let mut count: BTreeMap<NodeId, usize> = nodes.iter().map(|n| (*n, 0)).collect();
    for m in master.values() {
        *count.entry(*m).or_default() += 1;
    }
    let mut moves = Vec::new();
    // Each move lowers the spread; a queue moves at most once.
    let mut moved: BTreeSet<&str> = BTreeSet::new();
    loop {
        let mut by_load: Vec<(NodeId, usize)> = count.iter().map(|(n, c)| (*n, *c)).collect();
        by_load.sort_by_key(|(n, c)| (std::cmp::Reverse(*c), *n));
        let mut step = None;
        'busiest: for (from, c) in &by_load {
            for (q, (_, replicas)) in queues {
                if master[q.as_str()] != *from || moved.contains(q.as_str()) {
                    continue;
                }
                let to = replicas
                    .iter()
                    .filter(|r| *r != from && count.get(r).is_some_and(|rc| rc + 1 < *c))
                    .min_by_key(|r| (count[r], **r));
                if let Some(to) = to {
                    step = Some((q.as_str(), *from, *to));
                    break 'busiest;
                }
            }
        }
        let Some((q, from, to)) = step else { return moves };
        *count.get_mut(&from).expect("counted") -= 1;
        *count.get_mut(&to).expect("counted") += 1;
        master.insert(q, to);
        moved.insert(q);
        moves.push((q.to_string(), from, to));
    }
}

impl<H: Host> Failover<H> {
    /// Move masters so that every node masters within one mirrored queue of
    /// every other (as far as replica placement allows). Safe while clients
    /// publish: each move pauses its queue for a moment, loses nothing.
    pub async fn rebalance(&self) -> Result<Vec<Move>, NodeError> {
        let meta = self.metadata();
        let mut queues = BTreeMap::new();
        for q in meta.queues.values().filter(|q| q.replicas.len() > 1) {
            if let Some(master) = self.master_of(&q.name).await {
                queues.insert(q.name.clone(), (master, q.replicas.clone()));
            }
        }
        let nodes: BTreeSet<NodeId> = meta.nodes.keys().copied().collect();
        let planned = plan_moves(&queues, &nodes);
        tracing::info!(moves = planned.len(), "rebalancing masters");
        let moves = planned.into_iter().map(|(queue, from, to)| {
            let group = meta.queues.get(&queue).map(|q| q.group);
            async move {
                let result = match group {
                    None => Err(NodeError::NoSuchQueue(queue.clone())),
                    Some(group) if from == self.id() => self.move_master(group, to, false).await,
                    Some(group) => {
                        let deadline = Instant::now() + Duration::from_secs(20);
                        self.ask(from, ask::MoveMaster { group, to }, deadline).await.unwrap_or_else(|e| Err(e.into()))
                    }
                };
                if let Err(e) = &result {
                    tracing::warn!(queue, from, to, error = %e, "master not moved");
                }
                Move { queue, from, to, error: result.err().map(|e| e.to_string()) }
            }
        });
        // A few at a time: each move's pause is short, the disk is shared.
        use futures::StreamExt;
        Ok(futures::stream::iter(moves).buffer_unordered(4).collect().await)
    }

    /// Graceful stop: move every mastership in `successors` to its
    /// successor, [`MOVES_AT_ONCE`] at a time, starting none after
    /// [`MOVES_FOR`], or once none moved for [`MOVES_STALLED`]. Returns
    /// those that did not move.
    pub(crate) async fn move_masters_away(&self, successors: Vec<(GroupId, NodeId)>) -> Vec<(GroupId, NodeId)> {
        if successors.is_empty() {
            return successors;
        }
        let started = Instant::now();
        let until = started + MOVES_FOR;
        let last_moved = std::sync::Mutex::new(started);
        // Each move has its own bound: one that hangs must not make the
        // others, already done, count as not moved.
        let limit = self.timing().election_max * 2 + Duration::from_secs(1);
        let first_error = std::sync::Mutex::new(None);
        let at_once = tokio::sync::Semaphore::new(MOVES_AT_ONCE);
        let moves = successors.iter().map(|(group, to)| {
            let (first_error, at_once, last_moved) = (&first_error, &at_once, &last_moved);
            async move {
                let Ok(_turn) = at_once.acquire().await else { return false };
                let now = Instant::now();
                if now >= until || now.duration_since(*last_moved.lock().expect("poisoned")) >= MOVES_STALLED {
                    return false;
                }
                let r = match tokio::time::timeout(limit, self.move_master(*group, *to, true)).await {
                    Ok(r) => r,
                    Err(_) => Err(NodeError::Unavailable("no new master in time".into())),
                };
                match &r {
                    Ok(()) => *last_moved.lock().expect("poisoned") = Instant::now(),
                    Err(e) => {
                        first_error.lock().expect("poisoned").get_or_insert_with(|| (*group, *to, e.to_string()));
                    }
                }
                r.is_ok()
            }
        });
        let moved = futures::future::join_all(moves).await;
        let left: Vec<(GroupId, NodeId)> =
            successors.into_iter().zip(&moved).filter(|(_, ok)| !**ok).map(|(s, _)| s).collect();
        let elapsed_ms = started.elapsed().as_millis() as u64;
        match first_error.into_inner().expect("poisoned") {
            None if left.is_empty() => {
                tracing::info!(moved = moved.len(), left = 0, elapsed_ms, "masterships moved before stopping")
            }
            first => tracing::warn!(
                moved = moved.len() - left.len(),
                left = left.len(),
                elapsed_ms,
                first_failure = ?first,
                "not every mastership moved before stopping (out of time or failed): the rest are handed over after the groups stop"
            ),
        }
        left
    }

    /// Hand this node's mastership of `group` to the voter `to`. `leaving`:
    /// this node is stopping, so the new master need not wait for it.
    pub(crate) async fn move_master(&self, group: GroupId, to: NodeId, leaving: bool) -> Result<(), NodeError> {
        let me = self.id();
        let g = self.replicas().get(group);
        let Some(g) = g.filter(|g| g.is_leader(me)) else {
            return Err(NodeError::NotLeader { leader: None });
        };
        let voter = g.raft.metrics().borrow().membership_config.membership().voter_ids().any(|v| v == to);
        if !voter || !g.sync.borrow().synchronised.contains(&to) || to == me {
            return Err(NodeError::Invalid(format!("node {to} is not a synchronised mirror of '{}'", g.meta.name)));
        }
        if self.peers().departed().contains(&to) {
            return Err(NodeError::Unavailable(format!("node {to} is stopping")));
        }
        let Some(busy) = Busy::take(&self.shared().busy, group) else {
            return Err(NodeError::Unavailable("the queue is being re-formed or healed".into()));
        };
        let limit = Duration::from_secs(3);
        let hold = tokio::time::timeout(limit, g.proposer.hold())
            .await
            .map_err(|_| NodeError::Unavailable("operations in flight did not finish".into()))?;
        let caught_up = g
            .raft
            .wait(Some(limit))
            .metrics(
                |m| {
                    let last = m.last_log_index;
                    let theirs = m.replication.as_ref().and_then(|r| r.get(&to).cloned().flatten()).map(|l| l.index);
                    m.last_applied.map(|l| l.index) == last && theirs == last
                },
                "successor has the whole log",
            )
            .await
            .map_err(|_| NodeError::Unavailable(format!("node {to} did not catch up in time")))?;
        let term = caught_up.current_term;

        // From here on the move goes through even if the successor fails
        // to win: someone else then leads, and nothing was lost. This
        // replica gives its vote for the next term to the successor and
        // steps down; it must not stand meanwhile.
        self.shared().quiet.lock().expect("poisoned").insert(group, Instant::now() + self.timing().election_max * 4);
        g.raft.trigger().hand_over(to, term).await.map_err(|_| NodeError::Stopped)?;
        g.raft
            .wait(Some(limit))
            .metrics(|m| m.current_term > term || m.state != ServerState::Leader, "stepped down")
            .await
            .map_err(|_| NodeError::Unavailable("the master did not step down".into()))?;
        drop(hold);
        drop(busy);

        let deadline = Instant::now() + Duration::from_secs(2);
        let _ = self.ask(to, ask::Elect { group, from: me, leaving }, deadline).await;
        let moved = g
            .raft
            .wait(Some(self.timing().election_max * 3))
            .metrics(|m| m.current_leader.is_some_and(|l| l != me), "a new master")
            .await
            .map_err(|_| NodeError::Unavailable("no new master in time".into()))?;
        self.shared().quiet.lock().expect("poisoned").remove(&group);
        match moved.current_leader {
            Some(l) if l == to => {
                tracing::info!(queue = %g.meta.name, from = me, to, "master moved");
                Ok(())
            }
            other => Err(NodeError::Unavailable(format!("mastership went to {other:?} instead"))),
        }
    }
}

/// Masterships moved at once by a stopping node. Each move holds an
/// election; ten thousand of them at once saturated every node, and the
/// peers' calls timed out.
const MOVES_AT_ONCE: usize = 32;

/// How long a stopping node starts new moves; the rest are handed over
/// after its groups stop (their successors stand at once, all together).
/// A node of a rolling restart at 10,000 queues leads two thirds of them
/// and moves about 300 a second: with 20 s, 900 were left, and their
/// elections all at once made the node's return take 10 s instead of 3.
const MOVES_FOR: Duration = Duration::from_secs(60);

/// Moves stop being started once none has succeeded for this long: a
/// cluster that cannot elect does not hold a stop for the whole of
/// [`MOVES_FOR`].
const MOVES_STALLED: Duration = Duration::from_secs(10);

#[cfg(test)]
mod tests {
    use super::*;

    fn queues(spec: &[(&str, NodeId, &[NodeId])]) -> BTreeMap<String, (NodeId, Vec<NodeId>)> {
        spec.iter().map(|(q, m, r)| (q.to_string(), (*m, r.to_vec()))).collect()
    }

    fn spread(
        q: &BTreeMap<String, (NodeId, Vec<NodeId>)>,
        moves: &[(String, NodeId, NodeId)],
        nodes: &[NodeId],
    ) -> usize {
        let mut count: BTreeMap<NodeId, usize> = nodes.iter().map(|n| (*n, 0)).collect();
        for (name, (m, _)) in q {
            let m = moves.iter().find(|(q, _, _)| q == name).map_or(*m, |(_, _, to)| *to);
            *count.get_mut(&m).unwrap() += 1;
        }
        count.values().max().unwrap() - count.values().min().unwrap()
    }

    #[test]
    fn all_on_one_node_spreads_to_within_one() {
        let all: &[NodeId] = &[1, 2, 3];
        let names: Vec<String> = (0..30).map(|i| format!("q{i:02}")).collect();
        let q = queues(&names.iter().map(|n| (n.as_str(), 1, all)).collect::<Vec<_>>());
        let nodes = BTreeSet::from([1, 2, 3]);
        let moves = plan_moves(&q, &nodes);
        assert_eq!(moves.len(), 20);
        assert_eq!(spread(&q, &moves, all), 0);
        assert_eq!(plan_moves(&q, &nodes), moves, "deterministic");
    }

    #[test]
    fn balanced_or_pinned_queues_do_not_move() {
        let q = queues(&[("a", 1, &[1, 2]), ("b", 2, &[2, 3]), ("c", 3, &[3, 1]), ("d", 1, &[1, 2])]);
        assert!(plan_moves(&q, &BTreeSet::from([1, 2, 3])).is_empty(), "spread 1 already");
        // Replicas only on nodes 1 and 2: node 3 cannot take any.
        let q = queues(&[("a", 1, &[1, 2]), ("b", 1, &[1, 2]), ("c", 1, &[1, 2]), ("d", 1, &[1, 2])]);
        let moves = plan_moves(&q, &BTreeSet::from([1, 2, 3]));
        assert_eq!(moves.len(), 2);
        assert!(moves.iter().all(|(_, from, to)| *from == 1 && *to == 2));
    }
}
