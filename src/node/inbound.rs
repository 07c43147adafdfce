//! Requests that reach this node over the node link: Raft messages for
//! hosted groups (checked against the replica's epoch), queue operations
//! for groups it masters, and the tools' client requests.

use std::sync::Arc;
use std::time::{Duration, Instant};

use openraft::raft::VoteRequest;
use openraft::ServerState;

use super::{Inner, Node, QueueGroup};
use crate::error::NodeError;
use crate::failover;
use crate::ids::{GroupId, NodeId, METADATA_GROUP};
use crate::link::server;
use crate::link::server::RpcHandler;
use crate::metadata::MetaCmd;
use crate::queue::epoch::Epoch;
use crate::queue::proposer::Lane;
use crate::queue::QueueCmd;
use crate::queue::QueueRaft;
use crate::wire::ask;
use crate::wire::raft_net::EpochNews;
use crate::wire::{Appends, ClientReply, ClientRequest, Installs, RpcRequest, RpcResponse};

/// How long a request for a replica about to start waits for it.
const REPLICA_START_WAIT: Duration = Duration::from_millis(200);

impl RpcHandler for Inner {
    type Request = RpcRequest;
    type Response = RpcResponse;

    async fn admit(self: Arc<Self>, req: RpcRequest) -> server::Completion<RpcResponse> {
        if let RpcRequest::Queue(ask::Queue { group, epoch, cmds, lane }) = req {
            let g = match self.replica_in(group, epoch) {
                Ok(g) => g,
                Err(e) => return Box::pin(std::future::ready(RpcResponse::Queue(Err(e)))),
            };
            if matches!(cmds.as_slice(), [QueueCmd::Get { consumer: Some(_), .. }]) && g.stats.borrow().ranked {
                // A consumer's get of a queue with registered consumers may
                // wait for its turn (`queue::ranking`): not in the
                // admission order.
                return Box::pin(async move { RpcResponse::Queue(g.run(cmds, lane).await) });
            }
            return match g.enqueue(cmds, lane).await {
                Ok(answer) => {
                    Box::pin(async move { RpcResponse::Queue(answer.await.unwrap_or(Err(NodeError::Stopped))) })
                }
                Err(e) => Box::pin(std::future::ready(RpcResponse::Queue(Err(e)))),
            };
        }
        Box::pin(self.handle(req))
    }

    fn is_ping(req: &RpcRequest) -> bool {
        matches!(req, RpcRequest::Liveness(_))
    }

    fn ping(&self, req: RpcRequest) -> RpcResponse {
        let RpcRequest::Liveness(ask::Liveness { from, have, mine }) = req else { return RpcResponse::Done };
        if let Some(list) = mine {
            self.peers.heard_life(from, list.incarnation);
            self.quiescence.heard(from, list.incarnation, list.gen, Some(list.groups), list.refilling);
        }
        RpcResponse::Liveness(self.quiescence.answer(from, have))
    }
}

impl Inner {
    /// The local Raft of `group` if the sender is in the same epoch. A
    /// sender in an older epoch is told ours; one in a newer epoch means
    /// this replica must heal before it takes part again.
    fn raft_in_epoch(&self, group: GroupId, epoch: Epoch, from: NodeId) -> Result<QueueRaft, RpcResponse> {
        let g = self.groups.get(group);
        match g {
            None => Err(RpcResponse::UnknownGroup(group)),
            Some(g) if g.epoch == epoch => Ok(g.raft.clone()),
            Some(g) if g.epoch > epoch => Err(RpcResponse::NewerEpoch(g.epoch)),
            Some(_) => {
                let _ = self.news.send(EpochNews { group, epoch, from });
                Err(RpcResponse::UnknownGroup(group))
            }
        }
    }

    /// The hosted replica of queue group `group` if it is in `epoch`.
    fn group_in_epoch(&self, group: GroupId, epoch: Epoch) -> Option<Arc<QueueGroup>> {
        self.groups.get(group).filter(|g| g.epoch == epoch)
    }

    /// A master's first messages to a replica of a queue declared a moment
    /// ago may come before this node has applied the declare and started
    /// the replica: wait for it briefly rather than answer that the group
    /// is unknown, which holds replication back for openraft's backoff.
    async fn replica_soon(&self, group: GroupId) {
        if group == METADATA_GROUP || self.groups.contains(group) {
            return;
        }
        let expected = {
            let meta = self.meta.borrow();
            group > meta.next_group || meta.queue_by_group(group).is_some_and(|q| q.replicas.contains(&self.id))
        };
        if expected {
            self.groups.started(group, Instant::now() + REPLICA_START_WAIT).await;
        }
    }

    pub(super) async fn handle(self: Arc<Self>, req: RpcRequest) -> RpcResponse {
        if let RpcRequest::Append { group, .. } | RpcRequest::Vote { group, .. } = &req {
            self.replica_soon(*group).await;
        }
        match req {
            RpcRequest::Append { group, epoch, from, req } => self.on_append(group, epoch, from, req).await,
            RpcRequest::Vote { group, epoch, from, req } => self.on_vote(group, epoch, from, req).await,
            RpcRequest::Snapshot { group, epoch, from, req } => self.on_snapshot(group, epoch, from, req).await,
            RpcRequest::Fork(ask::Fork { group }) => RpcResponse::Fork(failover::epoch_report(
                &self.groups,
                &self.db,
                self.id,
                self.timing.failure_timeout,
                group,
            )),
            RpcRequest::History(ask::History { group }) => {
                RpcResponse::History(failover::history(&self.groups, &self.db, group).await)
            }
            RpcRequest::Yield(ask::Yield { group, defeated, winner, from }) => {
                self.on_yield(group, defeated, winner, from)
            }
            RpcRequest::Handback(ask::Handback { group, epoch, batches }) => {
                let cmds = batches
                    .into_iter()
                    .map(|(origin, keyed)| {
                        let (keys, msgs) = keyed.into_iter().unzip();
                        QueueCmd::HandbackKeyed { origin, keys, msgs }
                    })
                    .collect();
                self.in_epoch(group, epoch, cmds).await
            }
            RpcRequest::Merge(ask::Merge { group, epoch, holdings }) => {
                self.in_epoch(group, epoch, vec![QueueCmd::Merge(holdings)]).await
            }
            RpcRequest::Bodies(ask::Bodies { group, from, standing, ranges, max_bytes, totals }) => {
                RpcResponse::Bodies(self.serve_bodies(group, (from, standing), ranges, max_bytes, totals).await)
            }
            RpcRequest::SyncControl(ask::SyncControl { group, run }) => self.on_sync_control(group, run),
            RpcRequest::Join(ask::Join { info }) => RpcResponse::Member(Node { inner: self }.admit(info).await),
            RpcRequest::Forget(ask::Forget { id }) => {
                RpcResponse::Member(Node { inner: self }.forget_locally(id).await)
            }
            RpcRequest::MoveMaster(ask::MoveMaster { group, to }) => {
                RpcResponse::Moved(Node { inner: self }.failover().move_master(group, to, false).await)
            }
            RpcRequest::Elect(ask::Elect { group, from, leaving }) => self.on_elect(group, from, leaving),
            RpcRequest::Departing(ask::Departing { from, incarnation }) => self.on_departing(from, incarnation),
            RpcRequest::Queue(ask::Queue { group, epoch, cmds, lane }) => match self.replica_in(group, epoch) {
                Ok(g) => RpcResponse::Queue(g.run(cmds, lane).await),
                Err(e) => RpcResponse::Queue(Err(e)),
            },
            RpcRequest::CloseConnection(ask::CloseConnection { id, reason }) => {
                RpcResponse::Closed(self.clients.close(id, &reason))
            }
            RpcRequest::Reply(ask::Reply { to, message }) => RpcResponse::Replied(self.clients.reply(&to, message)),
            RpcRequest::Clients(_) => self.on_clients(),
            RpcRequest::Owners(ask::Owners { owners, held }) => self.on_owners(&owners, held),
            RpcRequest::Readings(_) => RpcResponse::Readings(self.alarms.readings()),
            RpcRequest::Flows(_) => RpcResponse::Flows(Node { inner: self }.own_flows()),
            // Unknown (a storage error) counts as held: the asker must not
            // found the group again on that answer.
            RpcRequest::Holds(ask::Holds { group }) => RpcResponse::Holds(self.db.group_exists(group).unwrap_or(true)),
            RpcRequest::MetaIndex(_) => self.on_meta_index(),
            req @ RpcRequest::Liveness(_) => RpcHandler::ping(&*self, req),
            RpcRequest::Members(ask::Members { group, epoch }) => self.on_members(group, epoch),
            RpcRequest::Meta(ask::Meta { cmd }) => self.on_meta(cmd).await,
            RpcRequest::Client(c) => RpcResponse::Client(Node { inner: self }.client_request(c).await),
        }
    }

    async fn on_append(&self, group: GroupId, epoch: Epoch, from: NodeId, req: Appends) -> RpcResponse {
        match req {
            Appends::Meta(req) if group == METADATA_GROUP => {
                self.metrics.appends_received.inc();
                self.refill_heard(group, req.leader_commit.map(|l| l.index));
                RpcResponse::Append(self.meta_raft.append_entries(req).await)
            }
            Appends::Queue(req) if group != METADATA_GROUP => match self.raft_in_epoch(group, epoch, from) {
                Ok(r) => {
                    if let Some(g) = self.groups.get(group) {
                        g.ext.heard.append_received();
                    }
                    self.metrics.appends_received.inc();
                    self.refill_heard(group, req.leader_commit.map(|l| l.index));
                    RpcResponse::Append(r.append_entries(req).await)
                }
                Err(refusal) => refusal,
            },
            // Entries of the other kind of group: no replica here takes them.
            _ => RpcResponse::UnknownGroup(group),
        }
    }

    async fn on_vote(&self, group: GroupId, epoch: Epoch, from: NodeId, req: VoteRequest<NodeId>) -> RpcResponse {
        if group == METADATA_GROUP {
            if let Some(refusal) = self.refill_refusal(group, &self.meta_raft.metrics(), &req) {
                return RpcResponse::Vote(Ok(refusal));
            }
            return RpcResponse::Vote(self.meta_raft.vote(req).await);
        }
        match self.raft_in_epoch(group, epoch, from) {
            Ok(r) => {
                self.metrics.queue_vote_requests.inc();
                if let Some(refusal) = self.refill_refusal(group, &r.metrics(), &req) {
                    return RpcResponse::Vote(Ok(refusal));
                }
                RpcResponse::Vote(r.vote(req).await)
            }
            Err(refusal) => refusal,
        }
    }

    async fn on_snapshot(self: &Arc<Self>, group: GroupId, epoch: Epoch, from: NodeId, req: Installs) -> RpcResponse {
        let req = match req {
            Installs::Meta(req) if group == METADATA_GROUP => {
                return RpcResponse::Snapshot(self.meta_raft.install_snapshot(req).await, None);
            }
            Installs::Queue(req) if group != METADATA_GROUP => req,
            _ => return RpcResponse::UnknownGroup(group),
        };
        match self.raft_in_epoch(group, epoch, from) {
            Ok(r) => {
                // The last chunk installs the snapshot: the answer then
                // says what the replica lacks (see `confirm_gate`).
                let g = if req.done { self.group_in_epoch(group, epoch) } else { None };
                let answer = r.install_snapshot(req).await;
                let standing = match (&answer, g) {
                    (Ok(_), Some(g)) => {
                        let running = *g.sync_run.borrow() || !Node { inner: self.clone() }.waits_for_sync(&g);
                        Some(Box::new(self.standing(&g, running).await))
                    }
                    _ => None,
                };
                RpcResponse::Snapshot(answer, standing)
            }
            Err(refusal) => refusal,
        }
    }

    fn on_yield(self: Arc<Self>, group: GroupId, defeated: Epoch, winner: Epoch, from: NodeId) -> RpcResponse {
        // Failover's task takes it; gone only when the node stops.
        let _ = self.yields.send(failover::YieldAsk { group, defeated, winner, from });
        RpcResponse::Done
    }

    /// Our replica of `group`, if it is in `epoch` (any, if `None`): a
    /// forwarded operation runs only in the epoch its sender's replica is
    /// in. One in another epoch answers that it is not the master: the
    /// sender finds its own epoch's.
    fn replica_in(&self, group: GroupId, epoch: Option<Epoch>) -> Result<Arc<QueueGroup>, NodeError> {
        match self.groups.get(group) {
            Some(g) if epoch.is_none_or(|e| e == g.epoch) => Ok(g),
            _ => Err(NodeError::NotLeader { leader: None }),
        }
    }

    /// Commands from a replica rejoining `epoch` (a hand-back, a merge),
    /// which name messages by that epoch's numbers: taken only by a
    /// replica of that very epoch.
    async fn in_epoch(&self, group: GroupId, epoch: Epoch, cmds: Vec<QueueCmd>) -> RpcResponse {
        let g = self.groups.get(group);
        match g {
            // Into this replica's own log, not whichever replica of the
            // group is hosted by the time the proposal is made.
            Some(g) if g.epoch == epoch => RpcResponse::Queue(g.run(cmds, Lane::Arrival).await),
            // The epoch moved on again: the sender must heal into this one.
            Some(g) if g.epoch > epoch => RpcResponse::NewerEpoch(g.epoch),
            _ => RpcResponse::Queue(Err(NodeError::NotLeader { leader: None })),
        }
    }

    fn on_sync_control(&self, group: GroupId, run: bool) -> RpcResponse {
        self.sync_control(group, run);
        RpcResponse::Done
    }

    fn on_elect(&self, group: GroupId, from: NodeId, leaving: bool) -> RpcResponse {
        if leaving {
            self.peers.stepping_down(from);
        }
        let g = self.groups.get(group);
        // A replica still fetching bodies never stands, asked or not:
        // as master it would answer gets without those bodies. Nor
        // does one on a node that is stopping itself (two stopping
        // at once): it would lead a group it has no one to hand to.
        let stopping = self.failover.is_leaving();
        if let Some(r) = g.filter(|g| g.plan.borrow().is_none() && !stopping).map(|g| g.raft.clone()) {
            // The other mirrors refuse votes until the lease of the
            // old master's last heartbeat runs out: keep standing
            // until someone leads, a little longer than that lease.
            let (me, until) = (self.id, Instant::now() + self.timing.election_max * 2);
            let step = self.timing.heartbeat;
            tokio::spawn(async move {
                while Instant::now() < until {
                    let m = r.metrics().borrow().clone();
                    if m.current_leader.is_some_and(|l| l != from) || m.state == ServerState::Leader {
                        return;
                    }
                    if m.state != ServerState::Candidate {
                        // Its timers run again: a quiet group's
                        // follower had them off.
                        r.runtime_config().tick(true);
                        let _ = r.trigger().elect().await;
                    }
                    tokio::time::sleep(step).await;
                }
                tracing::debug!(node = me, "gave up standing after a handover");
            });
        }
        RpcResponse::Done
    }

    fn on_departing(&self, from: NodeId, incarnation: u64) -> RpcResponse {
        // Unless a later life of it was heard already (a late notice).
        if self.peers.departs(from, incarnation) {
            for g in self.groups.read().values() {
                g.catching.write().expect("poisoned").forget(from, incarnation);
            }
        }
        tracing::info!(node = from, "peer is stopping: confirms no longer wait for it");
        RpcResponse::Done
    }

    fn on_clients(&self) -> RpcResponse {
        let (c, k) = self.clients.snapshot();
        RpcResponse::Clients(c, k)
    }

    fn on_owners(&self, owners: &[u64], held: Vec<(u64, String, Vec<u64>)>) -> RpcResponse {
        RpcResponse::Owners(
            self.owners.alive_of(owners),
            held.into_iter()
                .map(|(owner, queue, tags)| {
                    let unknown = self.owners.unknown(owner, &queue, &tags);
                    (owner, queue, unknown)
                })
                .filter(|(_, _, unknown)| !unknown.is_empty())
                .collect(),
        )
    }

    fn on_meta_index(&self) -> RpcResponse {
        let m = self.meta_raft.metrics().borrow().clone();
        RpcResponse::MetaIndex(if m.current_leader == Some(self.id) { m.last_applied.map(|l| l.index) } else { None })
    }

    /// A replica that has received no membership yet (a new mirror not yet
    /// reached by the master) knows nothing: it must not look like a group
    /// that excludes the asker, which would then drop what may be the only
    /// complete copy of the queue.
    fn on_members(&self, group: GroupId, epoch: Option<Epoch>) -> RpcResponse {
        let same_epoch = |e| self.groups.any(group, |g| g.epoch == e);
        let metrics = match epoch {
            Some(e) if !same_epoch(e) => None,
            _ => self.metrics_of(group),
        };
        RpcResponse::Members(metrics.and_then(|r| {
            let m = r.borrow().membership_config.clone();
            m.log_id().is_some().then(|| m.membership().nodes().map(|(id, _)| *id).collect())
        }))
    }

    async fn on_meta(&self, cmd: MetaCmd) -> RpcResponse {
        let leader = self.meta_raft.metrics().borrow().current_leader;
        RpcResponse::Meta(if leader == Some(self.id) {
            self.local_meta_write(cmd).await
        } else {
            Err(NodeError::NotLeader { leader })
        })
    }
}

impl Node {
    pub(super) async fn client_request(&self, req: ClientRequest) -> Result<ClientReply, NodeError> {
        match req {
            ClientRequest::DeclareQueue { name, replicas } => {
                self.declare_queue(&name, replicas).await.map(ClientReply::Declared)
            }
            ClientRequest::DeleteQueue { name } => self.delete_queue(&name).await.map(|_| ClientReply::Deleted),
            ClientRequest::QueueInfo { name, declared } => {
                self.queue_info_declared(&name, declared).map(|i| ClientReply::QueueInfo(Box::new(i)))
            }
            ClientRequest::QueueOp { queue, cmds } => self.queue_op(&queue, cmds).await.map(ClientReply::Queue),
        }
    }
}
