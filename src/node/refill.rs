//! A node refilled after its data dir was set aside as damaged
//! (`lifecycle::open_or_set_aside`). Its replicas start with empty logs and
//! no vote, so any candidate's log looks at least as complete as theirs:
//! granting votes then could elect a replica that lacks committed entries
//! (with the one other replica that holds them still down), or vote twice
//! in a term voted in before the damage. So a replica here grants no vote
//! until a leader has filled it: it applied at least what that leader had
//! committed when it first heard from it. Once the metadata group and
//! every replica the node hosts are filled, the node votes like any other
//! and the dir's `refill` mark goes.

use std::collections::HashMap;
use std::time::Duration;

use openraft::raft::{VoteRequest, VoteResponse};

use super::{Inner, Node, RaftMetrics, REFILL_KEY};
use crate::ids::{NodeId, METADATA_GROUP};
use mirrorq_storage::GroupId;

/// Per group, the commit index its leader announced in the first append
/// this life received; absent until one came.
pub(super) type Targets = HashMap<GroupId, u64>;

impl Inner {
    /// An append from a leader of `group`: the first one sets what the
    /// replica must apply before it may vote.
    pub(super) fn refill_heard(&self, group: GroupId, leader_commit: Option<u64>) {
        if let Some(targets) = self.refill.lock().expect("poisoned").as_mut() {
            targets.entry(group).or_insert(leader_commit.unwrap_or(0));
        }
    }

    /// Whether `raft`, the replica of `group` here, is still unfilled on a
    /// refilled node (and so must not vote).
    fn unfilled(&self, group: GroupId, metrics: &RaftMetrics) -> bool {
        let target = match self.refill.lock().expect("poisoned").as_ref() {
            None => return false,
            Some(targets) => targets.get(&group).copied(),
        };
        let applied = metrics.borrow().last_applied.map(|l| l.index);
        match target {
            None => true,
            Some(t) => applied.unwrap_or(0) < t,
        }
    }

    /// The answer to a vote request in `group` while its replica here is
    /// unfilled: not granted, and nothing the candidate would act on (the
    /// same vote, no log), so it just counts no vote from here.
    pub(super) fn refill_refusal(
        &self,
        group: GroupId,
        metrics: &RaftMetrics,
        req: &VoteRequest<NodeId>,
    ) -> Option<VoteResponse<NodeId>> {
        self.unfilled(group, metrics).then_some(VoteResponse { vote: req.vote, vote_granted: false, last_log_id: None })
    }
}

impl Node {
    /// Until every replica here is filled, check each second; then drop the
    /// dir's mark durably and vote again everywhere.
    pub(super) fn spawn_refill_watch(&self) {
        if self.inner.refill.lock().expect("poisoned").is_none() {
            return;
        }
        self.inner.quiescence.set_refilling(true);
        let node = self.clone();
        tokio::spawn(async move {
            tracing::warn!("refilling: this node's replicas grant no vote until their leaders have filled them");
            let mut started = node.inner.replicas_started.subscribe();
            loop {
                tokio::select! {
                    _ = node.inner.stop.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                }
                if !*started.borrow_and_update() || !node.all_filled() {
                    continue;
                }
                if let Err(e) = node.inner.db.remove_node_value_async(REFILL_KEY).await {
                    // A failed sync stops the node; this is only the mark.
                    tracing::error!(error = %e, "the refill mark could not be removed");
                    return;
                }
                *node.inner.refill.lock().expect("poisoned") = None;
                node.inner.quiescence.set_refilling(false);
                tracing::info!("refilled: every replica here holds what its leader had committed; voting again");
                return;
            }
        });
    }

    fn all_filled(&self) -> bool {
        let inner = &self.inner;
        if inner.unfilled(METADATA_GROUP, &inner.meta_raft.metrics()) {
            return false;
        }
        let groups: Vec<_> = inner.groups.read().iter().map(|(g, q)| (*g, q.raft.metrics())).collect();
        groups.iter().all(|(g, metrics)| !inner.unfilled(*g, metrics))
    }
}
