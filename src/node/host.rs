//! The node as failover's host: what failover (`crate::failover`) reads and
//! does through the node, and the node's handle on failover.

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use tokio_util::sync::CancellationToken;

use super::{Node, QueueGroup};
use crate::error::{NodeError, ServerError};
use crate::failover::{Failover, Host, Move, Shared, Tracked};
use crate::ids::{GroupId, NodeId};
use crate::metadata::{MetaState, QueueMeta};
use crate::metrics::Metrics;
use crate::peers::quiet::Quiescence;
use crate::peers::Peers;
use crate::queue::replicas::Replicas;
use crate::timing::Timing;
use crate::wire::ask::{Ask, AskError};
use mirrorq_storage::NodeDb;

impl Node {
    /// Failover on this node.
    pub(super) fn failover(&self) -> Failover<Node> {
        Failover(self.clone())
    }

    /// Move masters so that every node masters within one mirrored queue of
    /// every other (as far as replica placement allows). Safe while clients
    /// publish: each move pauses its queue for a moment, loses nothing.
    pub async fn rebalance(&self) -> Result<Vec<Move>, NodeError> {
        self.failover().rebalance().await
    }
}

impl Host for Node {
    fn id(&self) -> NodeId {
        self.inner.id
    }
    fn addr(&self) -> &str {
        &self.inner.addr
    }
    fn metadata(&self) -> Arc<MetaState> {
        Node::metadata(self)
    }
    fn db(&self) -> &NodeDb {
        &self.inner.db
    }
    fn timing(&self) -> &Timing {
        &self.inner.timing
    }
    fn replicas(&self) -> &Replicas<Tracked> {
        &self.inner.groups
    }
    fn peers(&self) -> &Peers {
        &self.inner.peers
    }
    fn quiescence(&self) -> &Quiescence {
        &self.inner.quiescence
    }
    fn metrics(&self) -> &Metrics {
        &self.inner.metrics
    }
    fn shared(&self) -> &Shared {
        &self.inner.failover
    }
    fn stopping(&self) -> &CancellationToken {
        &self.inner.stop
    }
    fn repeated(&self, group: GroupId, what: &'static str, text: &str) -> bool {
        self.inner.repeated(group, what, text)
    }
    fn cleared(&self, group: GroupId, what: &'static str) {
        self.inner.told.cleared(group, what);
    }
    fn take_out(&self, g: &Arc<QueueGroup>) -> bool {
        self.inner.take_out(g)
    }
    fn ask<A: Ask + Send + 'static>(
        &self,
        target: NodeId,
        req: A,
        deadline: Instant,
    ) -> impl Future<Output = Result<A::Reply, AskError>> + Send {
        let inner = self.inner.clone();
        async move { inner.ask(target, req, deadline).await }
    }
    fn start_group(&self, q: QueueMeta, state: &MetaState) -> impl Future<Output = Result<(), ServerError>> + Send {
        Node::start_group(self, q, state)
    }
    fn after_death(&self, id: NodeId) -> impl Future<Output = ()> + Send {
        Node::after_death(self, id)
    }
    fn master_of(&self, queue: &str) -> impl Future<Output = Option<NodeId>> + Send {
        let node = self.clone();
        let queue = queue.to_string();
        async move { node.master_view(&queue).await.ok().and_then(|v| v.leader) }
    }
}
