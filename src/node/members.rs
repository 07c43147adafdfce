//! Nodes joining a running cluster (`serve --join`) and being forgotten
//! (`DELETE /api/nodes/{name}`, `mirrorq ctl forget-node`).
//!
//! Both are changes of the metadata group's membership plus a metadata
//! entry, made by the metadata leader: a joining node becomes a learner,
//! catches up with the (small) metadata log, becomes a voter and is
//! registered; registering re-places every policy-placed queue, so
//! `ha-mode: all` queues grow a mirror on it. Forgetting drops the node from
//! every queue's replicas (policies pick replacements) and then from the
//! metadata group.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use openraft::{BasicNode, ChangeMembers};

use super::forward::{Attempt, Leader, Resend};
use super::Node;
use crate::error::NodeError;
use crate::ids::NodeId;
use crate::metadata::{MetaCmd, MetaReply, NodeInfo};
use crate::wire::ask::{self, Ask};
use crate::wire::RpcRequest;

impl Node {
    /// Ask the member at `via` to let this node in, until it is in.
    pub(super) fn spawn_join(&self, via: String) {
        let node = self.clone();
        tokio::spawn(async move {
            let me = node.id();
            let info = NodeInfo { id: me, name: node.inner.name.clone(), raft_addr: node.inner.addr.clone() };
            loop {
                if node.metadata().nodes.get(&me) == Some(&info) {
                    tracing::info!(via, "joined the cluster");
                    return;
                }
                let req = RpcRequest::from(ask::Join { info: info.clone() });
                let answer = tokio::select! {
                    _ = node.inner.stop.cancelled() => return,
                    a = node.inner.transport.call(&via, &req, Duration::from_secs(30)) => a,
                };
                match answer.map(ask::Join::reply) {
                    Ok(Ok(Ok(()))) => {}
                    Ok(Ok(Err(e))) => tracing::warn!(via, error = %e, "join refused; retrying"),
                    Ok(Err(other)) => tracing::warn!(via, ?other, "unexpected answer to join"),
                    Err(e) if e.to_string().contains("cluster secret") => {
                        if node.inner.repeated(crate::ids::METADATA_GROUP, "join", &e.to_string()) {
                            tracing::error!(via, error = %e, "cannot join: the member refuses this node's cluster secret or proves another; check --cluster-secret-file on both (retrying; told once until it changes)");
                        }
                    }
                    Err(e) => tracing::info!(via, error = %e, "cluster not reachable yet; retrying"),
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
    }

    /// Bring a joining node into the metadata group and the metadata
    /// (through the metadata leader).
    pub(super) async fn admit(&self, info: NodeInfo) -> Result<(), NodeError> {
        if let Some(other) = self.metadata().nodes.values().find(|n| n.name == info.name && n.id != info.id) {
            return Err(NodeError::Conflict(format!("node name {} is taken by node {}", info.name, other.id)));
        }
        self.at_meta_leader(ask::Join { info: info.clone() }, || self.admit_locally(info.clone())).await
    }

    async fn admit_locally(&self, info: NodeInfo) -> Result<(), NodeError> {
        let raft = &self.inner.meta_raft;
        let voters: BTreeSet<NodeId> = raft.metrics().borrow().membership_config.membership().voter_ids().collect();
        if !voters.contains(&info.id) {
            let unavailable = |e: &dyn std::fmt::Display| NodeError::Unavailable(e.to_string());
            raft.add_learner(info.id, BasicNode { addr: info.raft_addr.clone() }, true)
                .await
                .map_err(|e| unavailable(&e))?;
            raft.change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([info.id])), false)
                .await
                .map_err(|e| unavailable(&e))?;
            tracing::info!(node = info.id, name = %info.name, addr = %info.raft_addr, "node joined the metadata group");
        }
        self.meta_write(MetaCmd::RegisterNode(info)).await.map(|_| ())
    }

    /// Remove a stopped node from the cluster for good. Its replicas are
    /// dropped and, where a policy says so, placed on other nodes.
    pub async fn forget_node(&self, name: &str) -> Result<(), NodeError> {
        let id = self
            .metadata()
            .nodes
            .values()
            .find(|n| n.name == name)
            .map(|n| n.id)
            .ok_or_else(|| NodeError::NotFound(format!("no node named {name}")))?;
        if id == self.id() {
            return Err(NodeError::Invalid("a node cannot forget itself; ask another node".into()));
        }
        if self.ping(id, Duration::from_secs(1)).await {
            return Err(NodeError::Invalid(format!("node {name} is running; stop it before forgetting it")));
        }
        self.at_meta_leader(ask::Forget { id }, || self.forget_locally(id)).await
    }

    pub(super) async fn forget_locally(&self, id: NodeId) -> Result<(), NodeError> {
        match self.meta_write(MetaCmd::ForgetNode { id }).await? {
            MetaReply::Ok | MetaReply::NotFound => {}
            MetaReply::Conflict(why) => return Err(NodeError::Conflict(why)),
            other => return Err(NodeError::Invalid(format!("unexpected metadata reply {other:?}"))),
        }
        let raft = &self.inner.meta_raft;
        let m = raft.metrics().borrow().clone();
        if m.membership_config.membership().get_node(&id).is_some() {
            let gone = BTreeSet::from([id]);
            let change = if m.membership_config.membership().voter_ids().any(|v| v == id) {
                ChangeMembers::RemoveVoters(gone)
            } else {
                ChangeMembers::RemoveNodes(gone)
            };
            raft.change_membership(change, false).await.map_err(|e| NodeError::Unavailable(e.to_string()))?;
        }
        tracing::info!(node = id, "node forgotten");
        Ok(())
    }

    /// Run `local` if this node leads the metadata group, else send `req`
    /// to the leader. Joining and forgetting find their work done when it
    /// was (a member is not added twice, a forgotten node is not found), so
    /// a request that got no answer may go again.
    async fn at_meta_leader<A, F, Fut>(&self, req: A, local: F) -> Result<(), NodeError>
    where
        A: Ask<Reply = Result<(), NodeError>> + Clone,
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = Result<(), NodeError>>,
    {
        let deadline = Instant::now() + self.inner.timing.op_timeout;
        let (req, local) = (&req, &local);
        self.forward(Leader::Metadata, Resend::Safe, deadline, |target| async move {
            if target == self.id() {
                return Attempt::answered(local().await);
            }
            match self.inner.ask(target, req.clone(), deadline).await {
                Ok(r) => Attempt::answered(r),
                Err(e) => Attempt::not_answered(e),
            }
        })
        .await
    }
}
