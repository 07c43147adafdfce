//! A graceful stop: every mastership here handed to its successor, and the
//! peers told this node is leaving.

use std::collections::{BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::ha_of;
use super::rules::by_seniority;
use crate::failover::{Failover, Host, QueueGroup};
use crate::ids::{GroupId, NodeId};
use crate::metadata::QueueMeta;
use crate::wire::ask;

impl<H: Host> Failover<H> {
    /// For each queue this node masters, the most senior mirror that may
    /// take over (`ha-promote-on-shutdown`).
    pub(super) fn successors(&self) -> Vec<(GroupId, NodeId)> {
        let state = self.metadata();
        let groups: Vec<Arc<QueueGroup>> = self.replicas().all();
        let by_group: HashMap<GroupId, &QueueMeta> = state.queues.values().map(|q| (q.group, q)).collect();
        let departed = self.peers().departed();
        let mut out = Vec::new();
        let mut stranded = Vec::new();
        for g in groups {
            if !g.is_leader(self.id()) {
                continue;
            }
            let Some(q) = by_group.get(&g.meta.group).copied() else { continue };
            let me = self.id();
            let synced: BTreeSet<NodeId> =
                g.sync.borrow().synchronised.iter().copied().filter(|id| *id != me).collect();
            let m = g.raft.metrics().borrow().clone();
            let voters: BTreeSet<NodeId> =
                m.membership_config.membership().voter_ids().filter(|id| *id != me).collect();
            // A learner cannot be elected: with `when-synced`, a synchronised
            // voter.
            let eligible = if ha_of(&state, q).promote_on_shutdown_always {
                voters
            } else {
                synced.intersection(&voters).copied().collect()
            };
            // A mirror whose node is gone or stopping too (an idle queue
            // still counts it synchronised) cannot take over.
            let eligible: BTreeSet<NodeId> =
                eligible.into_iter().filter(|id| !self.is_dead(*id) && !departed.contains(id)).collect();
            match by_seniority(q, &eligible).first() {
                Some(next) => out.push((g.meta.group, *next)),
                None => stranded.push(q.name.clone()),
            }
        }
        if !stranded.is_empty() {
            tracing::warn!(
                queues = stranded.len(),
                first = %stranded[0],
                "stopping with no synchronised mirror running: these queues wait for this node rather than lose messages"
            );
        }
        out
    }

    /// Graceful stop, before the groups stop: turn elections off here and
    /// pick, for each queue we master, the mirror that should take over.
    pub(crate) fn prepare_hand_over(&self) -> Vec<(GroupId, NodeId)> {
        self.shared().leaving.store(true, Ordering::Release);
        for g in self.replicas().read().values() {
            g.raft.runtime_config().elect(false);
        }
        self.successors()
    }

    /// Graceful stop, before any mastership moves: tell every peer. Their
    /// masters stop waiting for this node's replicas (a busy queue would
    /// otherwise hold its confirms for the sync timeout once they stop)
    /// and settle groups without them.
    pub(crate) async fn announce_departure(&self) {
        let state = self.metadata();
        let req = ask::Departing { from: self.id(), incarnation: self.quiescence().incarnation() };
        let deadline = Instant::now() + Duration::from_secs(1);
        let peers = state.nodes.keys().copied().filter(|id| *id != self.id());
        let calls = peers.map(|id| {
            let req = req.clone();
            async move {
                if self.ask(id, req, deadline).await.is_err() {
                    tracing::info!(node = id, "peer not told of this node's stop");
                }
            }
        });
        futures::future::join_all(calls).await;
    }

    /// After our groups stopped: ask each successor to stand for election
    /// now, and to stop waiting for us. The other mirrors still honour the
    /// leader lease of our last heartbeat, so the successor wins within
    /// about one election timeout instead of after failure detection.
    pub(crate) async fn hand_over(&self, successors: Vec<(GroupId, NodeId)>) {
        let calls = successors.into_iter().map(|(group, next)| async move {
            let req = ask::Elect { group, from: self.id(), leaving: true };
            let asked = self.ask(next, req, Instant::now() + Duration::from_secs(1)).await;
            match asked {
                Ok(()) => tracing::info!(group, successor = next, "mastership handed over"),
                _ => tracing::warn!(group, successor = next, "successor did not answer the handover"),
            }
        });
        futures::future::join_all(calls).await;
    }
}
