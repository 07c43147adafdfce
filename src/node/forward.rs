//! The one way to reach a queue's master or the metadata leader: run the
//! operation here when this node leads, else send it over the node link;
//! follow the leader's hint or wait for an election, and try again until a
//! deadline. One rule says what may be tried again: an operation that was
//! not run (not the leader, not reached, stopped before applying it) goes
//! again; one that was sent and got no answer goes again only if running it
//! twice does no harm ([`Resend`]).
//!
//! Catch-up and hand-back do not come here: they must reach the master of
//! one epoch (their replica's own, or the newer one), and a redirect or a
//! guess could reach another epoch's master.

use std::future::Future;
use std::time::{Duration, Instant};

use openraft::error::{ClientWriteError, RaftError};

use super::{Inner, Node, RaftMetrics, Submitted};
use crate::error::NodeError;
use crate::ids::{GroupId, NodeId};
use crate::link::transport::CallError;
use crate::metadata::{MetaCmd, MetaReply, QueueMeta};
use crate::queue::proposer::{Answer, Lane};
use crate::queue::{QueueCmd, QueueReply};
use crate::wire::ask::{self, typed, Ask, AskError};
use crate::wire::{RpcRequest, RpcResponse};

/// The leader an operation must run at.
#[derive(Clone, Copy)]
pub(super) enum Leader<'a> {
    /// The master of this queue.
    Of(&'a QueueMeta),
    /// The leader of the metadata group.
    Metadata,
}

/// Whether an operation that was sent and got no answer may be sent again.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Resend {
    /// It may have run: running it again would do it twice (a publish
    /// stored twice, a get that takes more). The caller is told instead.
    Never,
    /// Reads, and changes that find their target state already reached.
    Safe,
}

/// How one attempt at one node went.
pub(super) enum Attempt<T> {
    /// Run there, with this result.
    Done(Result<T, NodeError>),
    /// Not run there: not the leader (and maybe who is), not reached, or
    /// stopped before applying it.
    Elsewhere(Option<NodeId>),
    /// Sent, and no answer came: it may have run.
    Unanswered(String),
}

impl<T> Attempt<T> {
    /// A leader's answer: "not the leader" means try elsewhere.
    pub(super) fn answered(r: Result<T, NodeError>) -> Self {
        match r {
            Err(NodeError::NotLeader { leader }) => Attempt::Elsewhere(leader),
            r => Attempt::Done(r),
        }
    }

    /// A node link call that did not get an answer.
    pub(super) fn failed(e: CallError) -> Self {
        match e {
            CallError::Unreachable(..) => Attempt::Elsewhere(None),
            CallError::Encode(e) => Attempt::Done(Err(NodeError::Invalid(e.to_string()))),
            // Sent, and perhaps run: an answer that cannot be read is no answer.
            e @ (CallError::Timeout(_) | CallError::Closed(_) | CallError::Decode(..)) => {
                Attempt::Unanswered(e.to_string())
            }
        }
    }

    /// A question to a peer that got no answer, or one of the wrong kind.
    pub(super) fn not_answered(e: AskError) -> Self {
        match e {
            AskError::Call(e) => Attempt::failed(e),
            other @ AskError::Other(_) => Attempt::Done(Err(other.into())),
        }
    }

    /// The rule: `Ok(hint)` to try again (at the hinted leader if any),
    /// `Err(result)` to stop with it.
    fn again(self, resend: Resend) -> Result<Option<NodeId>, Result<T, NodeError>> {
        match self {
            Attempt::Done(r) => Err(r),
            Attempt::Unanswered(why) if resend == Resend::Never => Err(Err(NodeError::Unavailable(why))),
            Attempt::Unanswered(_) => Ok(None),
            Attempt::Elsewhere(hint) => Ok(hint),
        }
    }
}

/// The leader `raft` knows once it is another than `not`, within `wait`.
async fn leader_other_than(mut metrics: RaftMetrics, not: Option<NodeId>, wait: Duration) -> Option<NodeId> {
    let found = tokio::time::timeout(wait, async {
        metrics.wait_for(|m| m.current_leader.is_some_and(|l| Some(l) != not)).await.ok().and_then(|m| m.current_leader)
    })
    .await;
    found.ok().flatten()
}

/// How long to wait for an election before trying again: it ends the wait
/// as soon as a new leader is known, so this bounds only a wait in vain.
fn patience(tries: u32) -> Duration {
    Duration::from_millis(50 * u64::from(tries.min(10)))
}

impl Node {
    /// Run `attempt` at `leader` until it is run there or `deadline`
    /// passes. `attempt(target)` runs the operation locally when `target` is
    /// this node, else sends it to `target`.
    pub(super) async fn forward<T, F, Fut>(
        &self,
        leader: Leader<'_>,
        resend: Resend,
        deadline: Instant,
        mut attempt: F,
    ) -> Result<T, NodeError>
    where
        F: FnMut(NodeId) -> Fut,
        Fut: Future<Output = Attempt<T>>,
    {
        let mut target = match leader {
            Leader::Of(q) => Some(self.leader_guess(q)),
            Leader::Metadata => self.inner.meta_raft.metrics().borrow().current_leader,
        };
        let mut tries = 0u32;
        loop {
            let outcome = match target {
                Some(t) => attempt(t).await,
                None => Attempt::Elsewhere(None),
            };
            let hint = match outcome.again(resend) {
                Ok(hint) => hint,
                Err(r) => {
                    if let (Ok(_), Leader::Of(q), Some(t)) = (&r, leader, target) {
                        self.inner.hints.lock().expect("poisoned").insert(q.group, t);
                    }
                    return r;
                }
            };
            if let Leader::Of(q) = leader {
                // Deleted meanwhile (its group gone on the master): say so
                // now rather than look for a master until the deadline.
                if self.metadata().queues.get(&q.name).is_none_or(|m| m.group != q.group) {
                    return Err(NodeError::NoSuchQueue(q.name.clone()));
                }
            }
            if Instant::now() >= deadline {
                return Err(NodeError::Unavailable(match leader {
                    Leader::Of(q) => format!("no master of '{}' reachable", q.name),
                    Leader::Metadata => "no metadata majority reachable".into(),
                }));
            }
            tries += 1;
            target = match hint {
                Some(l) if Some(l) != target => Some(l),
                _ => match leader {
                    // No hint: wait for an election, then try the new master
                    // or else the next replica.
                    Leader::Of(q) => Some(match self.new_leader(q.group, target, patience(tries)).await {
                        Some(l) => l,
                        None => q.replicas[tries as usize % q.replicas.len()],
                    }),
                    Leader::Metadata => self.new_meta_leader(target, patience(tries)).await,
                },
            };
        }
    }

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
    ///
    /// The first attempt is started here, in call order, at the master this
    /// node knows of; whatever it cannot settle goes through
    /// [`Node::forward`] ([`Node::queue_op`]).
    pub async fn submit_in(&self, queue: &str, cmds: Vec<QueueCmd>, lane: Lane) -> Result<Submitted, NodeError> {
        let q = self.metadata().queues.get(queue).cloned().ok_or_else(|| NodeError::NoSuchQueue(queue.to_string()))?;
        let target = self.leader_guess(&q);
        let (started, cmds) = if target == self.id() {
            (self.inner.local_enqueue(q.group, cmds.clone(), lane).await.ok().map(Started::Here), cmds)
        } else {
            self.start_at(target, q.group, cmds, lane).await
        };
        let node = self.clone();
        let queue = queue.to_string();
        let timeout = self.inner.timing.op_timeout;
        Ok(Box::pin(async move {
            let first = match started {
                Some(Started::Here(answer)) => Attempt::answered(answer.await.unwrap_or(Err(NodeError::Stopped))),
                Some(Started::There(addr, rx)) => match tokio::time::timeout(timeout, rx.reply()).await {
                    Ok(Ok(answer)) => match typed::<ask::Queue>(answer) {
                        Ok(r) => Attempt::answered(r),
                        Err(e) => Attempt::not_answered(e),
                    },
                    Ok(Err(e)) => Attempt::Unanswered(e.to_string()),
                    Err(_) => Attempt::Unanswered(format!("no answer from {addr} in time")),
                },
                None => Attempt::Elsewhere(None),
            };
            match first {
                Attempt::Done(r) => r,
                Attempt::Unanswered(why) => Err(NodeError::Unavailable(why)),
                Attempt::Elsewhere(_) => node.queue_op_in(&queue, cmds, lane).await,
            }
        }))
    }

    /// Send queue operations to `target` without waiting for the answer;
    /// `None` (and the operations back) if they could not be sent.
    async fn start_at(
        &self,
        target: NodeId,
        group: GroupId,
        cmds: Vec<QueueCmd>,
        lane: Lane,
    ) -> (Option<Started>, Vec<QueueCmd>) {
        let Some(addr) = self.inner.addr_of(target) else { return (None, cmds) };
        let epoch = self.inner.groups.get(group).map(|g| g.epoch);
        let req = RpcRequest::from(ask::Queue { group, epoch, cmds, lane });
        let started = self.inner.transport.start_call(&addr, &req).await;
        let RpcRequest::Queue(ask::Queue { cmds, .. }) = req else { unreachable!() };
        match started {
            Ok(rx) => (Some(Started::There(addr, rx)), cmds),
            Err(_) => (None, cmds),
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
        let gets = cmds.iter().any(|c| matches!(c, QueueCmd::Get { .. }));
        let (cmds, q) = (&cmds, &q);
        self.forward(Leader::Of(q), Resend::Never, deadline, |target| async move {
            let (result, here) = if target == self.id() {
                (self.inner.local_queue_op(q.group, cmds.clone(), lane).await, true)
            } else {
                let epoch = self.inner.groups.get(q.group).map(|g| g.epoch);
                let req = ask::Queue { group: q.group, epoch, cmds: cmds.clone(), lane };
                match self.inner.ask(target, req, deadline).await {
                    Ok(r) => (r, false),
                    Err(e) => return Attempt::not_answered(e),
                }
            };
            match result {
                // A replica that stopped under the operation (re-forming,
                // healing, moved away) is about to be replaced: look for the
                // master again. Unless the operation takes messages: it may
                // have been applied before the stop, and a second get would
                // take more (an auto-ack get's first messages were lost so).
                // A replica here that stopped to re-form or heal drops the
                // gets it never applied: those may go again.
                Err(NodeError::Stopped) if gets && !(here && self.inner.failover.is_busy(q.group)) => {
                    Attempt::Done(Err(NodeError::Unavailable(format!(
                        "the master of '{}' stopped with the get in flight; it may have been served",
                        q.name
                    ))))
                }
                Err(NodeError::Stopped) if !self.inner.stop.is_cancelled() => Attempt::Elsewhere(None),
                r => Attempt::answered(r),
            }
        })
        .await
    }

    /// A leader of `group` other than `not`, as this node's replica learns
    /// of it within `wait` (at once when an election ends: a publisher
    /// waiting out a failover goes on as soon as there is a new master,
    /// not at its next retry). `None` after `wait` or without a replica here.
    pub(super) async fn new_leader(&self, group: GroupId, not: Option<NodeId>, wait: Duration) -> Option<NodeId> {
        let until = Instant::now() + wait;
        let g = self.inner.groups.get(group);
        let (g, not) = match g {
            // A replica that knows no master yet (a group electing its
            // first): whoever it learns of is news, the node just tried
            // included.
            Some(g) if g.raft.metrics().borrow().current_leader.is_none() => (g, None),
            Some(g) => (g, not),
            // No replica here yet (a queue declared a moment ago, this node
            // one of its replicas): likewise, once it starts.
            None => (self.inner.groups.started(group, until).await?, None),
        };
        leader_other_than(g.raft.metrics(), not, until.saturating_duration_since(Instant::now())).await
    }

    /// The metadata leader once it is another than `not`, or whichever this
    /// node knows of after `wait`.
    async fn new_meta_leader(&self, not: Option<NodeId>, wait: Duration) -> Option<NodeId> {
        let found = leader_other_than(self.inner.meta_raft.metrics(), not, wait).await;
        found.or_else(|| self.inner.meta_raft.metrics().borrow().current_leader)
    }

    pub(super) fn leader_guess(&self, q: &QueueMeta) -> NodeId {
        if let Some(g) = self.inner.groups.get(q.group) {
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
        if self.inner.meta_raft.metrics().borrow().current_leader != Some(self.id()) {
            let _ = self.meta_caught_up().await;
        }
    }

    /// Whether this node has applied everything the metadata leader had
    /// applied when asked (false if there is no leader, or no answer).
    pub(super) async fn meta_caught_up(&self) -> bool {
        let m = self.inner.meta_raft.metrics().borrow().clone();
        let Some(leader) = m.current_leader else { return false };
        let index = if leader == self.id() {
            m.last_log_index
        } else {
            let deadline = Instant::now() + Duration::from_millis(1000);
            match self.inner.ask(leader, ask::MetaIndex, deadline).await {
                Ok(Some(index)) => Some(index),
                _ => return false,
            }
        };
        let wait = self.inner.meta_raft.wait(Some(Duration::from_secs(2)));
        wait.applied_index_at_least(index, "caught up with the metadata leader").await.is_ok()
    }

    /// Write to the metadata group through its leader, then wait until this
    /// node has applied it (so local reads see the change).
    pub async fn meta_write(&self, cmd: MetaCmd) -> Result<MetaReply, NodeError> {
        let deadline = Instant::now() + self.inner.timing.op_timeout;
        let cmd = &cmd;
        let (reply, index) = self
            .forward(Leader::Metadata, Resend::Never, deadline, |target| async move {
                if target == self.id() {
                    return Attempt::answered(self.inner.local_meta_write(cmd.clone()).await);
                }
                match self.inner.ask(target, ask::Meta { cmd: cmd.clone() }, deadline).await {
                    Ok(r) => Attempt::answered(r),
                    Err(e) => Attempt::not_answered(e),
                }
            })
            .await?;
        let wait = deadline.saturating_duration_since(Instant::now());
        self.inner
            .meta_raft
            .wait(Some(wait))
            .applied_index_at_least(Some(index), "metadata change applied locally")
            .await
            .map_err(|e| NodeError::Unavailable(e.to_string()))?;
        Ok(reply)
    }
}

/// The first attempt of [`Node::submit_in`], started and not yet answered.
enum Started {
    Here(Answer),
    There(String, crate::link::transport::Pending<RpcResponse>),
}

impl Inner {
    pub(super) fn addr_of(&self, id: NodeId) -> Option<String> {
        if let Some(n) = self.meta.borrow().nodes.get(&id) {
            return Some(n.raft_addr.clone());
        }
        // Before registration completes, the metadata membership knows it.
        self.meta_raft.metrics().borrow().membership_config.membership().get_node(&id).map(|n| n.addr.clone())
    }

    /// Ask `target` and wait for the answer `req` expects.
    pub(super) async fn ask<A: Ask>(&self, target: NodeId, req: A, deadline: Instant) -> Result<A::Reply, AskError> {
        let addr = self.link_addr(target)?;
        let wait = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(100));
        let answer = self.transport.call(&addr, &req.into(), wait).await?;
        typed::<A>(answer)
    }

    /// Where to reach `target` on the node link.
    fn link_addr(&self, target: NodeId) -> Result<String, CallError> {
        self.addr_of(target).ok_or_else(|| CallError::Unreachable(format!("node {target}"), "address unknown".into()))
    }

    /// A liveness ping to `target`, on the beacon (`link::beacon`).
    pub(super) async fn ping(
        &self,
        target: NodeId,
        req: ask::Liveness,
        limit: Duration,
    ) -> Result<ask::Alive, AskError> {
        let addr = self.link_addr(target)?;
        let answer = self.transport.ping(&addr, RpcRequest::from(req), limit).await?;
        typed::<ask::Liveness>(answer)
    }

    pub(super) async fn local_meta_write(&self, cmd: MetaCmd) -> Result<(MetaReply, u64), NodeError> {
        match self.meta_raft.client_write(cmd).await {
            Ok(resp) => Ok((resp.data, resp.log_id.index)),
            Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => {
                Err(NodeError::NotLeader { leader: f.leader_id })
            }
            Err(e) => Err(NodeError::Unavailable(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn again(a: Attempt<u8>, resend: Resend) -> Result<Option<NodeId>, Result<u8, NodeError>> {
        a.again(resend)
    }

    #[test]
    fn what_was_sent_and_unanswered_goes_again_only_when_safe() {
        let timeout = || Attempt::<u8>::failed(CallError::Timeout("n2".into()));
        let closed = || Attempt::<u8>::failed(CallError::Closed("n2".into()));
        assert!(matches!(again(timeout(), Resend::Never), Err(Err(NodeError::Unavailable(_)))));
        assert!(matches!(again(closed(), Resend::Never), Err(Err(NodeError::Unavailable(_)))));
        assert!(matches!(again(timeout(), Resend::Safe), Ok(None)));
        assert!(matches!(again(closed(), Resend::Safe), Ok(None)));
    }

    #[test]
    fn what_was_not_run_goes_again_to_the_leader_named() {
        let unreachable = Attempt::<u8>::failed(CallError::Unreachable("n2".into(), "refused".into()));
        assert!(matches!(again(unreachable, Resend::Never), Ok(None)));
        let refused = Attempt::<u8>::answered(Err(NodeError::NotLeader { leader: Some(3) }));
        assert!(matches!(again(refused, Resend::Never), Ok(Some(3))));
        let done = Attempt::answered(Ok(7));
        assert!(matches!(again(done, Resend::Never), Err(Ok(7))));
        let failed = Attempt::<u8>::answered(Err(NodeError::NoSuchQueue("q".into())));
        assert!(matches!(again(failed, Resend::Safe), Err(Err(NodeError::NoSuchQueue(_)))));
    }
}
