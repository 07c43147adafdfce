//! What a node tells about queues, clients and itself: queue info (local
//! and at the master), Raft figures, cluster-wide client lists, pings;
//! and read-only inspection of a local replica for tests.

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::forward::{Attempt, Leader, Resend};
use super::{Node, QueueGroup};
use crate::api::{GroupRaftMetrics, QueueInfo};
use crate::clients::{ConnectionInfo, ConsumerInfo};
use crate::error::NodeError;
use crate::ids::{GroupId, NodeId, METADATA_GROUP};
use crate::queue::confirm_gate;
use crate::wire::ask;
use crate::wire::ask::AskError;
use crate::wire::{ClientReply, ClientRequest};

impl Node {
    /// The queue as its master sees it (counts, synchronised mirrors), asked
    /// over the node link when the master is elsewhere.
    pub async fn master_view(&self, name: &str) -> Result<QueueInfo, NodeError> {
        self.view_at_master(name, false).await
    }

    /// [`Node::master_view`] for a declare of the queue: proves that a
    /// master serves it, and counts as a use (`x-expires`), without an
    /// entry in its log (a quiet group stays quiet; clients declare their
    /// queues at every connection).
    pub async fn view_at_master(&self, name: &str, declared: bool) -> Result<QueueInfo, NodeError> {
        let q = self.find_queue(name).await?;
        // A declare waits for a master as long as any operation does (one
        // may be elected meanwhile); a look at the queue does not.
        let limit = if declared { self.inner.timing.op_timeout } else { Duration::from_secs(2) };
        let deadline = Instant::now() + limit;
        self.forward(Leader::Of(&q), Resend::Safe, deadline, |target| async move {
            let info = if target == self.id() {
                self.queue_info_declared(name, declared)
            } else {
                let req = ClientRequest::QueueInfo { name: name.into(), declared };
                match self.inner.ask(target, req, deadline).await {
                    Ok(Ok(ClientReply::QueueInfo(i))) => Ok(*i),
                    Ok(Ok(other)) => Err(NodeError::Invalid(format!("unexpected reply {other:?}"))),
                    Ok(Err(e)) => Err(e),
                    Err(AskError::Call(e)) => return Attempt::failed(e),
                    Err(other) => Err(other.into()),
                }
            };
            match info {
                // A declare counts a use at the master and proves that one
                // serves: only a settled master's answer will do.
                Ok(i) if declared && i.group != q.group => Attempt::Elsewhere(None),
                Ok(i) if declared && !(i.leader == Some(target) && i.settled) => {
                    Attempt::Elsewhere(i.leader.filter(|l| *l != target))
                }
                // A node that has not applied the queue's creation yet.
                Err(NodeError::NoSuchQueue(_)) if target != self.id() => Attempt::Elsewhere(None),
                // A replica that knows of another master: ask that one.
                Ok(i) if i.local && i.leader.is_some_and(|l| l != target) => Attempt::Elsewhere(i.leader),
                // A master just elected, still applying what its
                // predecessor committed: its counts are not yet right.
                Ok(i) if i.leader == Some(target) && !i.settled => Attempt::Elsewhere(None),
                r => Attempt::Done(r),
            }
        })
        .await
    }

    /// This node's view of the queue, for [`Node::view_at_master`]: a
    /// declare counts as a use (`x-expires`) only where the answer is
    /// taken, at the settled master, whose mark is the one read.
    pub(super) fn queue_info_declared(&self, name: &str, declared: bool) -> Result<QueueInfo, NodeError> {
        let info = self.queue_info(name)?;
        if declared && info.leader == Some(self.id()) && info.settled {
            self.inner.declared_here(name);
        }
        Ok(info)
    }

    /// Memory and disk readings of node `id` (this one's own, or asked over
    /// the node link; `None` if it does not answer in time).
    pub async fn readings_of(&self, id: NodeId, limit: Duration) -> Option<crate::alarms::Readings> {
        if id == self.id() {
            return Some(self.alarms().readings());
        }
        self.inner.ask(id, ask::Readings, Instant::now() + limit).await.ok()
    }

    /// Raft figures of every queue replica hosted here.
    pub fn local_raft_metrics(&self) -> Vec<GroupRaftMetrics> {
        let by_group: HashMap<GroupId, String> =
            self.metadata().queues.values().map(|q| (q.group, q.name.clone())).collect();
        let groups: Vec<Arc<QueueGroup>> = self.inner.groups.all();
        groups
            .iter()
            .filter_map(|g| {
                let queue = by_group.get(&g.meta.group)?.clone();
                let m = g.raft.metrics().borrow().clone();
                Some(GroupRaftMetrics {
                    queue,
                    term: m.current_term,
                    committed: m.last_applied.map(|l| l.index),
                    leader: m.current_leader,
                    epoch: g.epoch,
                })
            })
            .collect()
    }

    /// AMQP connections and consumers of every reachable node.
    pub async fn cluster_clients(&self) -> (Vec<ConnectionInfo>, Vec<ConsumerInfo>) {
        self.clients_of_nodes(false).await.unwrap_or_default()
    }

    /// Connections and consumers of this node and every other, asked all
    /// at once (a peer that does not answer costs the deadline once). A
    /// peer that does not answer is left out, unless `complete`: then the
    /// answer is `None`, for callers that act on an absence (a node may
    /// serve consumers it could not tell of). With `complete`, a peer seen
    /// gone is not asked: its clients went with it.
    pub(super) async fn clients_of_nodes(&self, complete: bool) -> Option<(Vec<ConnectionInfo>, Vec<ConsumerInfo>)> {
        let (mut conns, mut consumers) = self.inner.clients.snapshot();
        let peers: Vec<NodeId> = self
            .metadata()
            .nodes
            .keys()
            .copied()
            .filter(|id| *id != self.id() && !(complete && self.is_dead(*id)))
            .collect();
        let deadline = Instant::now() + Duration::from_millis(1000);
        let asks = peers.iter().map(|peer| self.inner.ask(*peer, ask::Clients, deadline));
        for answer in futures::future::join_all(asks).await {
            match answer {
                Ok((c, k)) => {
                    conns.extend(c);
                    consumers.extend(k);
                }
                _ if complete => return None,
                _ => {}
            }
        }
        Some((conns, consumers))
    }

    /// Close AMQP connection `conn` (as listed, with the node that holds
    /// it), telling its client `reason`; `false` if it is gone.
    pub async fn close_connection(&self, conn: &ConnectionInfo, reason: &str) -> bool {
        if conn.node == self.name() {
            return self.inner.clients.close(conn.id, reason);
        }
        let Some(peer) = self.metadata().nodes.values().find(|n| n.name == conn.node).map(|n| n.id) else {
            return false;
        };
        let deadline = Instant::now() + Duration::from_millis(1000);
        let req = ask::CloseConnection { id: conn.id, reason: reason.to_string() };
        matches!(self.inner.ask(peer, req, deadline).await, Ok(true))
    }

    /// Hand a reply to the direct reply-to consumer `to` names, on the node
    /// its name carries (`amqp/reply_to.rs`); `false` if that consumer is
    /// gone, or its node out of reach.
    pub async fn send_reply(&self, to: &str, node: NodeId, message: crate::message::Message) -> bool {
        if node == self.id() {
            return self.inner.clients.reply(to, message);
        }
        let deadline = Instant::now() + self.inner.timing.op_timeout;
        matches!(self.inner.ask(node, ask::Reply { to: to.to_string(), message }, deadline).await, Ok(true))
    }

    /// The consumers of `queue` on every node that answers.
    pub async fn consumers_of(&self, queue: &str) -> Vec<ConsumerInfo> {
        self.cluster_clients().await.1.into_iter().filter(|k| k.queue == queue).collect()
    }

    /// Does node `id` answer on the node link?
    pub async fn ping(&self, id: NodeId, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        self.inner.ask(id, ask::Members { group: METADATA_GROUP, epoch: None }, deadline).await.is_ok()
    }

    /// Does node `id` answer a liveness ping? Its answer brings its list of
    /// quietly led groups when that changed (`peers/quiet.rs`).
    /// The ping also carries this node's own list when the peer has not
    /// said it holds the latest (`Quiescence::push_for`).
    pub(super) async fn ping_liveness(&self, id: NodeId, limit: Duration) -> bool {
        let q = &self.inner.quiescence;
        let mine = q.push_for(id);
        let pushed = mine.as_ref().map(|l| l.gen);
        let req = ask::Liveness { from: self.id(), have: q.have(id), mine };
        match self.inner.ping(id, req, limit).await {
            Ok(ask::Alive { incarnation, gen, groups, refilling }) => {
                self.inner.peers.heard_life(id, incarnation);
                q.heard(id, incarnation, gen, groups, refilling);
                if let Some(gen) = pushed {
                    q.pushed(id, gen);
                }
                true
            }
            _ => false,
        }
    }

    /// Hosted queue groups whose heartbeats are off (`peers/quiet.rs`).
    pub fn quiet_groups(&self) -> usize {
        self.inner.groups.read().values().filter(|g| g.hush.is_quiet()).count()
    }

    /// Voters of the queue's group as this node's replica sees them.
    pub fn queue_members(&self, queue: &str) -> Option<BTreeSet<NodeId>> {
        self.queue_raft(queue).map(|r| r.metrics().borrow().membership_config.membership().voter_ids().collect())
    }

    /// The queue as this node sees it, without asking anyone.
    pub fn queue_info(&self, name: &str) -> Result<QueueInfo, NodeError> {
        let meta = self.metadata();
        let q = meta.queues.get(name).ok_or_else(|| NodeError::NoSuchQueue(name.to_string()))?;
        let group = self.inner.groups.get(q.group);
        let mut info = QueueInfo {
            name: q.name.clone(),
            group: q.group,
            replicas: q.replicas.clone(),
            local: group.is_some(),
            leader: None,
            ready: 0,
            unacked: 0,
            applied: None,
            settled: false,
            synchronised: Vec::new(),
            catching_up: Vec::new(),
            flows: None,
            active_consumer: None,
        };
        if let Some(g) = group {
            let m = g.raft.metrics().borrow().clone();
            info.leader = m.current_leader;
            info.applied = m.last_applied.map(|l| l.index);
            info.settled = m.state == openraft::ServerState::Leader
                && m.last_applied.is_some_and(|l| l.leader_id.term == m.current_term);
            let s = *g.stats.borrow();
            (info.ready, info.unacked) = (s.ready, s.unacked);
            info.active_consumer = s.active_consumer;
            // Those Raft counts too: a learner caught up has every confirmed
            // message (confirms wait for it) but is no voter yet, so the
            // group re-forms without it when a majority of its voters is
            // lost. Listed, it would promise a failover that cannot happen.
            let voters: BTreeSet<NodeId> = m.membership_config.membership().voter_ids().collect();
            info.synchronised = g.sync.borrow().synchronised.iter().copied().filter(|id| voters.contains(id)).collect();
            if g.is_leader(self.id()) {
                info.catching_up = confirm_gate::catching_up(&g.catching).into_iter().collect();
                let now = super::sweeps::flows::queue_tally(&s.flow);
                info.flows = Some(self.inner.rates.queue_flows(q.group, Instant::now(), now));
            }
        }
        Ok(info)
    }
}
