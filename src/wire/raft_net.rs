//! The openraft network of one group: its Raft messages, stamped with the
//! replica's epoch, over the node link's shared connections.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::{RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use openraft::{BasicNode, RaftTypeConfig};
use tokio::sync::mpsc;

use crate::ids::{GroupId, NodeId};
use crate::link::transport::{CallError, Transport};
use crate::metadata::MetaTypes;
use crate::queue::confirm_gate::CatchingUp;
use crate::queue::epoch::Epoch;
use crate::queue::QueueTypes;
use crate::wire::{Appends, Installs, RpcRequest, RpcResponse};

/// A kind of group whose Raft messages go over the link: says which of
/// the wire's variants carries them.
pub trait Carried: RaftTypeConfig<NodeId = NodeId, Node = BasicNode> {
    fn appends(req: AppendEntriesRequest<Self>) -> Appends;
    fn installs(req: InstallSnapshotRequest<Self>) -> Installs;
}

impl Carried for QueueTypes {
    fn appends(req: AppendEntriesRequest<Self>) -> Appends {
        Appends::Queue(req)
    }
    fn installs(req: InstallSnapshotRequest<Self>) -> Installs {
        Installs::Queue(req)
    }
}

impl Carried for MetaTypes {
    fn appends(req: AppendEntriesRequest<Self>) -> Appends {
        Appends::Meta(req)
    }
    fn installs(req: InstallSnapshotRequest<Self>) -> Installs {
        Installs::Meta(req)
    }
}

/// A peer told us a group has moved on to a newer epoch than ours.
#[derive(Debug, Clone, Copy)]
pub struct EpochNews {
    pub group: GroupId,
    pub epoch: Epoch,
    /// A node of that epoch.
    pub from: NodeId,
}

/// Creates the per-target network clients of one group.
pub struct NetworkFactory {
    pub group: GroupId,
    /// This replica's epoch, sent with every message so that replicas of
    /// different epochs never exchange log entries.
    pub epoch: Epoch,
    pub me: NodeId,
    pub news: mpsc::UnboundedSender<EpochNews>,
    pub transport: Arc<Transport>,
    /// A queue group's reports of its members' bodies (`None`: the
    /// metadata group), where the answers to its snapshots go.
    pub catching: Option<CatchingUp>,
}

impl<C: Carried> RaftNetworkFactory<C> for NetworkFactory {
    type Network = GroupNetwork<C>;

    async fn new_client(&mut self, target: NodeId, node: &BasicNode) -> Self::Network {
        GroupNetwork {
            group: self.group,
            epoch: self.epoch,
            me: self.me,
            news: self.news.clone(),
            target,
            addr: node.addr.clone(),
            transport: self.transport.clone(),
            catching: self.catching.clone(),
            kind: PhantomData,
        }
    }
}

/// One group's link to one target node.
pub struct GroupNetwork<C> {
    group: GroupId,
    epoch: Epoch,
    me: NodeId,
    news: mpsc::UnboundedSender<EpochNews>,
    target: NodeId,
    addr: String,
    transport: Arc<Transport>,
    catching: Option<CatchingUp>,
    kind: PhantomData<fn() -> C>,
}

type RpcErr<E = openraft::error::Infallible> = RPCError<NodeId, BasicNode, RaftError<NodeId, E>>;

impl<C: Carried> GroupNetwork<C> {
    async fn send<E: std::error::Error>(&self, req: RpcRequest, ttl: Duration) -> Result<RpcResponse, RpcErr<E>> {
        match self.transport.call(&self.addr, &req, ttl).await {
            Ok(RpcResponse::UnknownGroup(g)) => {
                let e = CallError::Unreachable(self.addr.clone(), format!("group {g} not hosted (yet)"));
                Err(RPCError::Unreachable(Unreachable::new(&e)))
            }
            Ok(RpcResponse::NewerEpoch(epoch)) => {
                let _ = self.news.send(EpochNews { group: self.group, epoch, from: self.target });
                let e = CallError::Unreachable(self.addr.clone(), format!("replica is in newer epoch {epoch}"));
                Err(RPCError::Unreachable(Unreachable::new(&e)))
            }
            Ok(r) => Ok(r),
            Err(e @ CallError::Unreachable(..)) => Err(RPCError::Unreachable(Unreachable::new(&e))),
            Err(e) => Err(RPCError::Network(NetworkError::new(&e))),
        }
    }

    fn unexpected<E: std::error::Error>(&self) -> RpcErr<E> {
        let e = CallError::Closed(format!("{} (unexpected reply type)", self.addr));
        RPCError::Network(NetworkError::new(&e))
    }
}

impl<C: Carried> RaftNetwork<C> for GroupNetwork<C> {
    async fn append_entries(
        &mut self,
        req: AppendEntriesRequest<C>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<NodeId>, RpcErr> {
        match self
            .send(
                RpcRequest::Append { group: self.group, epoch: self.epoch, from: self.me, req: C::appends(req) },
                option.hard_ttl(),
            )
            .await?
        {
            RpcResponse::Append(r) => r.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e))),
            _ => Err(self.unexpected()),
        }
    }

    async fn install_snapshot(
        &mut self,
        req: InstallSnapshotRequest<C>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<NodeId>, RpcErr<InstallSnapshotError>> {
        let term = req.vote.leader_id().term;
        match self
            .send(
                RpcRequest::Snapshot { group: self.group, epoch: self.epoch, from: self.me, req: C::installs(req) },
                option.hard_ttl(),
            )
            .await?
        {
            RpcResponse::Snapshot(r, standing) => {
                // Recorded before openraft reads the answer and moves the
                // target's match up to the snapshot: the confirm gate reads
                // the match first and this book after, so it never sees
                // the match without the bodies the target lacks.
                if let (Ok(_), Some(standing), Some(book)) = (&r, standing, &self.catching) {
                    book.write().expect("poisoned").record(term, self.target, *standing);
                }
                r.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
            }
            _ => Err(self.unexpected()),
        }
    }

    async fn vote(&mut self, req: VoteRequest<NodeId>, option: RPCOption) -> Result<VoteResponse<NodeId>, RpcErr> {
        match self
            .send(RpcRequest::Vote { group: self.group, epoch: self.epoch, from: self.me, req }, option.hard_ttl())
            .await?
        {
            RpcResponse::Vote(r) => r.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e))),
            _ => Err(self.unexpected()),
        }
    }
}
