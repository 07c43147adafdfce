//! The one way to reach a queue's master or the metadata leader: run the
//! operation here when this node leads, else send it over the node link,
//! following redirects and retrying what was not sent.

use std::time::{Duration, Instant};

use openraft::error::{ClientWriteError, RaftError};

use super::{Inner, Node, Submitted};
use crate::error::NodeError;
use crate::ids::{GroupId, NodeId};
use crate::link::rpc::{RpcRequest, RpcResponse};
use crate::link::transport::CallError;
use crate::metadata::{MetaCmd, MetaReply, QueueMeta};
use crate::queue::proposer::{Answer, Lane};
use crate::queue::{QueueCmd, QueueReply};
use crate::raft::types::{Request, Response};

impl Node {
    /// Start queue operations at the queue's master and return the wait for
    /// their replies. Operations started one after another (awaiting each
    /// start) reach the queue's log in that order, as AMQP requires for one
    /// channel's publishes, while their confirms are awaited concurrently.
    /// Only a change of master between start and commit can reorder them.
    pub async fn submit(&self, queue: &str, cmds: Vec<QueueCmd>) -> Result<Submitted, NodeError> {
        self.submit_in(queue, cmds, Lane::Arrival).await
    }

    /// [`Node::submit`] in `lane` at the master: [`Lane::Consumer`] for a
    /// consumer's settlements, which need not wait behind queued publishes.
    pub async fn submit_in(&self, queue: &str, cmds: Vec<QueueCmd>, lane: Lane) -> Result<Submitted, NodeError> {
        let q = self.metadata().queues.get(queue).cloned().ok_or_else(|| NodeError::NoSuchQueue(queue.to_string()))?;
        let target = self.leader_guess(&q);
        let fast: Option<Result<Answer, NodeError>> =
            if target == self.id() { Some(self.inner.local_enqueue(q.group, cmds.clone(), lane).await) } else { None };
        let node = self.clone();
        let queue = queue.to_string();
        match fast {
            Some(Ok(answer)) => Ok(Box::pin(async move {
                match answer.await.unwrap_or(Err(NodeError::Stopped)) {
                    Err(NodeError::NotLeader { .. }) => node.queue_op_in(&queue, cmds, lane).await,
                    other => other,
                }
            })),
            Some(Err(_)) => Ok(Box::pin(async move { node.queue_op_in(&queue, cmds, lane).await })),
            None => {
                let addr =
                    if self.inner.transport.control.is_blocked(target) { None } else { self.inner.addr_of(target) };
                let Some(addr) = addr else {
                    return Ok(Box::pin(async move { node.queue_op_in(&queue, cmds, lane).await }));
                };
                let req = RpcRequest::Queue { group: q.group, cmds, lane };
                match self.inner.transport.start_call(&addr, &req).await {
                    Ok(rx) => {
                        let RpcRequest::Queue { cmds, .. } = req else { unreachable!() };
                        let timeout = self.inner.timing.op_timeout;
                        Ok(Box::pin(async move {
                            match tokio::time::timeout(timeout, rx).await {
                                Ok(Ok(RpcResponse::Queue(Err(NodeError::NotLeader { .. })))) => {
                                    node.queue_op_in(&queue, cmds, lane).await
                                }
                                Ok(Ok(RpcResponse::Queue(r))) => r,
                                Ok(Ok(other)) => Err(NodeError::Invalid(format!("unexpected reply {other:?}"))),
                                Ok(Err(_)) => Err(NodeError::Unavailable(format!("connection to {addr} lost"))),
                                Err(_) => Err(NodeError::Unavailable(format!("no answer from {addr} in time"))),
                            }
                        }))
                    }
                    Err(_) => {
                        let RpcRequest::Queue { cmds, .. } = req else { unreachable!() };
                        Ok(Box::pin(async move { node.queue_op_in(&queue, cmds, lane).await }))
                    }
                }
            }
        }
    }

    /// Run queue operations at the queue's master, wherever it is.
    pub async fn queue_op(&self, queue: &str, cmds: Vec<QueueCmd>) -> Result<Vec<QueueReply>, NodeError> {
        self.queue_op_in(queue, cmds, Lane::Arrival).await
    }

    /// [`Node::queue_op`] in `lane` at the master ([`Lane`]).
    pub(super) async fn queue_op_in(
        &self,
        queue: &str,
        cmds: Vec<QueueCmd>,
        lane: Lane,
    ) -> Result<Vec<QueueReply>, NodeError> {
        let deadline = Instant::now() + self.inner.timing.op_timeout;
        let q = self.metadata().queues.get(queue).cloned().ok_or_else(|| NodeError::NoSuchQueue(queue.to_string()))?;
        let mut target = self.leader_guess(&q);
        let mut attempt = 0usize;
        loop {
            let result = if target == self.id() {
                self.inner.local_queue_op(q.group, cmds.clone(), lane).await
            } else {
                let req = RpcRequest::Queue { group: q.group, cmds: cmds.clone(), lane };
                match self.inner.call(target, &req, deadline).await {
                    Ok(RpcResponse::Queue(r)) => r,
                    Ok(other) => Err(NodeError::Invalid(format!("unexpected reply {other:?}"))),
                    // Not sent: safe to try elsewhere.
                    Err(CallError::Unreachable(..)) => Err(NodeError::NotLeader { leader: None }),
                    // Sent, outcome unknown: the caller decides whether to resend.
                    Err(e) => Err(NodeError::Unavailable(e.to_string())),
                }
            };
            // A replica that stopped under the operation (re-forming,
            // healing, moved away) is about to be replaced: look for the
            // master again. Unless the operation takes messages: it may
            // have been applied before the stop, and a second get would
            // take more (an auto-ack get's first messages were lost so).
            // (A replica here that stopped to re-form or heal drops the gets
            // it never applied: those may go again.)
            let takes = cmds.iter().any(|c| matches!(c, QueueCmd::Get { .. }))
                && !(target == self.id() && self.inner.busy.lock().expect("poisoned").contains(&q.group));
            let result = match result {
                Err(NodeError::Stopped) if takes => Err(NodeError::Unavailable(format!(
                    "the master of '{queue}' stopped with the get in flight; it may have been served"
                ))),
                Err(NodeError::Stopped) if !self.inner.stop.is_cancelled() => {
                    Err(NodeError::NotLeader { leader: None })
                }
                other => other,
            };
            match result {
                Err(NodeError::NotLeader { leader }) => {
                    // Deleted meanwhile (its group gone on the master): say
                    // so now rather than look for a master until the deadline.
                    if self.metadata().queues.get(queue).is_none_or(|m| m.group != q.group) {
                        return Err(NodeError::NoSuchQueue(queue.to_string()));
                    }
                    if Instant::now() >= deadline {
                        return Err(NodeError::Unavailable(format!("no master of '{queue}' reachable")));
                    }
                    attempt += 1;
                    target = match leader {
                        Some(l) if l != target => l,
                        _ => {
                            // No hint: wait for an election, then try the
                            // new master or else the next replica.
                            let wait = Duration::from_millis(50 * attempt.min(10) as u64);
                            match self.new_leader(q.group, target, wait).await {
                                Some(l) => l,
                                None => q.replicas[attempt % q.replicas.len()],
                            }
                        }
                    };
                }
                Ok(r) => {
                    self.inner.hints.lock().expect("poisoned").insert(q.group, target);
                    return Ok(r);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// A leader of `group` other than `not`, as this node's replica learns
    /// of it within `wait` (at once when an election ends: a publisher
    /// waiting out a failover goes on as soon as there is a new master,
    /// not at its next retry). `None` after `wait` or without a replica here.
    pub(super) async fn new_leader(&self, group: GroupId, not: NodeId, wait: Duration) -> Option<NodeId> {
        let g = self.inner.groups.read().expect("poisoned").get(&group).cloned();
        let Some(g) = g else {
            tokio::time::sleep(wait).await;
            return None;
        };
        let mut metrics = g.raft.metrics();
        let found = tokio::time::timeout(wait, async {
            metrics.wait_for(|m| m.current_leader.is_some_and(|l| l != not)).await.ok().and_then(|m| m.current_leader)
        })
        .await;
        found.ok().flatten()
    }

    pub(super) fn leader_guess(&self, q: &QueueMeta) -> NodeId {
        if let Some(g) = self.inner.groups.read().expect("poisoned").get(&q.group) {
            if let Some(l) = g.raft.metrics().borrow().current_leader {
                return l;
            }
        }
        if let Some(h) = self.inner.hints.lock().expect("poisoned").get(&q.group) {
            return *h;
        }
        q.replicas[0]
    }

    /// Catch up with the metadata leader: wait (briefly) until this node has
    /// applied everything the leader had applied when asked, so a change
    /// made through another node is visible here. Without a reachable leader
    /// it returns at once and reads stay local (CONTRACT 5).
    pub async fn meta_barrier(&self) {
        let m = self.inner.meta_raft.metrics().borrow().clone();
        let Some(leader) = m.current_leader else { return };
        if leader == self.id() {
            return;
        }
        let deadline = Instant::now() + Duration::from_millis(1000);
        if let Ok(RpcResponse::MetaIndex(Some(index))) = self.inner.call(leader, &RpcRequest::MetaIndex, deadline).await
        {
            let _ = self
                .inner
                .meta_raft
                .wait(Some(Duration::from_secs(2)))
                .applied_index_at_least(Some(index), "metadata barrier")
                .await;
        }
    }

    /// Write to the metadata group through its leader, then wait until this
    /// node has applied it (so local reads see the change).
    pub async fn meta_write(&self, cmd: MetaCmd) -> Result<MetaReply, NodeError> {
        let deadline = Instant::now() + self.inner.timing.op_timeout;
        let mut attempt = 0u64;
        loop {
            let leader = self.inner.meta_raft.metrics().borrow().current_leader;
            let result = match leader {
                Some(l) if l == self.id() => self.inner.local_meta_write(cmd.clone()).await,
                Some(l) => match self.inner.call(l, &RpcRequest::Meta { cmd: cmd.clone() }, deadline).await {
                    Ok(RpcResponse::Meta(r)) => r,
                    Ok(other) => Err(NodeError::Invalid(format!("unexpected reply {other:?}"))),
                    Err(CallError::Unreachable(..)) => Err(NodeError::NotLeader { leader: None }),
                    Err(e) => Err(NodeError::Unavailable(e.to_string())),
                },
                None => Err(NodeError::NotLeader { leader: None }),
            };
            match result {
                Ok((reply, index)) => {
                    let wait = deadline.saturating_duration_since(Instant::now());
                    self.inner
                        .meta_raft
                        .wait(Some(wait))
                        .applied_index_at_least(Some(index), "metadata change applied locally")
                        .await
                        .map_err(|e| NodeError::Unavailable(e.to_string()))?;
                    return Ok(reply);
                }
                Err(NodeError::NotLeader { .. }) if Instant::now() < deadline => {
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(20 * attempt.min(10))).await;
                }
                Err(NodeError::NotLeader { .. }) => {
                    return Err(NodeError::Unavailable("no metadata majority reachable".into()))
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl Inner {
    pub(super) fn addr_of(&self, id: NodeId) -> Option<String> {
        if let Some(n) = self.meta.borrow().nodes.get(&id) {
            return Some(n.raft_addr.clone());
        }
        // Before registration completes, the metadata membership knows it.
        self.meta_raft.metrics().borrow().membership_config.membership().get_node(&id).map(|n| n.addr.clone())
    }

    /// When the link to `id` broke by itself, if it is broken now.
    pub(super) fn link_lost_at(&self, id: NodeId) -> Option<Instant> {
        self.transport.link_lost_at(&self.addr_of(id)?)
    }

    pub(super) async fn call(
        &self,
        target: NodeId,
        req: &RpcRequest,
        deadline: Instant,
    ) -> Result<RpcResponse, CallError> {
        if self.transport.control.is_blocked(target) {
            return Err(CallError::Unreachable(format!("node {target}"), "blocked by test hook".into()));
        }
        let addr = self
            .addr_of(target)
            .ok_or_else(|| CallError::Unreachable(format!("node {target}"), "address unknown".into()))?;
        let wait = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
        self.transport.call(&addr, req, wait).await
    }

    pub(super) async fn local_queue_op(
        &self,
        group: GroupId,
        cmds: Vec<QueueCmd>,
        lane: Lane,
    ) -> Result<Vec<QueueReply>, NodeError> {
        self.local_enqueue(group, cmds, lane).await?.await.unwrap_or(Err(NodeError::Stopped))
    }

    /// Put operations in this node's proposer for `group`, in call order
    /// within their lane ([`Lane`]).
    pub(super) async fn local_enqueue(
        &self,
        group: GroupId,
        cmds: Vec<QueueCmd>,
        lane: Lane,
    ) -> Result<Answer, NodeError> {
        let g = self.groups.read().expect("poisoned").get(&group).cloned();
        match g {
            Some(g) => g.proposer.enqueue(cmds, lane).await,
            None => Err(NodeError::NotLeader { leader: None }),
        }
    }

    pub(super) async fn local_meta_write(&self, cmd: MetaCmd) -> Result<(MetaReply, u64), NodeError> {
        match self.meta_raft.client_write(Request::Meta(cmd)).await {
            Ok(resp) => match resp.data {
                Response::Meta(r) => Ok((r, resp.log_id.index)),
                other => Err(NodeError::Invalid(format!("metadata group answered {other:?}"))),
            },
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => {
                Err(NodeError::NotLeader { leader: f.leader_id })
            }
            Err(e) => Err(NodeError::Unavailable(e.to_string())),
        }
    }
}
