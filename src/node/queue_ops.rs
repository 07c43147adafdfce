//! Queue operations of the library API: declare and delete, publish,
//! get and consume, ack, nack, purge, status.

use std::sync::Arc;
use std::time::{Duration, Instant};

use super::{Inner, Node, QueueGroup};
use crate::api::DeclareOpts;
use crate::error::NodeError;
use crate::ids::{GroupId, NodeId};
use crate::metadata::{MetaCmd, MetaReply, QueueMeta};
use crate::queue::proposer::{Answer, Lane};
use crate::queue::types::ConsumerRef;
use crate::queue::{Delivery, Message, QueueCmd, QueueReply};

/// How many messages the enqueues among `replies` stored: a queue that is
/// full (`x-overflow: reject-publish`) stores a batch's first ones only.
pub fn stored_count(replies: &[QueueReply]) -> u64 {
    replies.iter().map(|r| if let QueueReply::Enqueued { count } = r { *count as u64 } else { 0 }).sum()
}

/// A publish's replies: `Err` if the queue refused any of its messages
/// (`x-overflow: reject-publish` at `x-max-length`).
pub fn stored_all(queue: &str, replies: &[QueueReply]) -> Result<(), NodeError> {
    if replies.iter().any(|r| matches!(r, QueueReply::Enqueued { count: 0 })) {
        return Err(NodeError::Refused(format!("queue '{queue}' is full (x-overflow: reject-publish)")));
    }
    Ok(())
}

impl Node {
    /// Declare a queue replicated on `replicas` (the first is the initial
    /// master), or, with `replicas` empty, placed by the effective policy as
    /// RabbitMQ would (no policy: one replica, here). Returns when its group
    /// has a master and answers.
    pub async fn declare_queue(&self, name: &str, replicas: Vec<NodeId>) -> Result<QueueMeta, NodeError> {
        self.declare_queue_reporting(name, replicas).await.map(|(q, _)| q)
    }

    /// [`Node::declare_queue`], also telling whether this call created it.
    pub async fn declare_queue_reporting(
        &self,
        name: &str,
        replicas: Vec<NodeId>,
    ) -> Result<(QueueMeta, bool), NodeError> {
        self.declare_queue_with(name, replicas, DeclareOpts::default()).await
    }

    /// Declare with AMQP's extras: master locator and exclusive owner.
    pub async fn declare_queue_with(
        &self,
        name: &str,
        replicas: Vec<NodeId>,
        opts: DeclareOpts,
    ) -> Result<(QueueMeta, bool), NodeError> {
        if name.is_empty() || name.len() > 255 {
            return Err(NodeError::Invalid("queue name must be 1 to 255 bytes".into()));
        }
        // An existing queue needs no metadata write, so a node cut off from
        // the metadata majority still answers declares of the queues it
        // serves (as every client library declares before it uses a queue).
        if let Some(q) = self.metadata().queues.get(name).cloned() {
            self.view_at_master(name, true).await?;
            return Ok((q, false));
        }
        if let Err(property) =
            opts.args.check_properties(!opts.transient, opts.exclusive_owner.is_some(), opts.auto_delete)
        {
            let (vhost, bare) = crate::metadata::names::split(name);
            return Err(NodeError::Invalid(format!(
                "invalid property '{property}' for queue '{bare}' in vhost '{vhost}'"
            )));
        }
        // Placement needs this node in the metadata; right after start its
        // registration may still be on its way.
        let mut meta = self.inner.meta.clone();
        let me = self.id();
        let _ = tokio::time::timeout(self.inner.timing.op_timeout, meta.wait_for(|m| m.nodes.contains_key(&me))).await;
        let cmd = MetaCmd::DeclareQueue {
            name: name.to_string(),
            replicas,
            durable: !opts.transient,
            declared_on: self.id(),
            locator: opts.min_masters,
            exclusive_owner: opts.exclusive_owner,
            auto_delete: opts.auto_delete,
            args: Box::new(opts.args),
        };
        let reply = self.meta_write(cmd).await?;
        let q = match reply {
            MetaReply::Queue(q) => (q, false),
            MetaReply::NewQueue(q) => (q, true),
            MetaReply::Invalid(why) => return Err(NodeError::Invalid(why)),
            other => return Err(NodeError::Invalid(format!("unexpected metadata reply {other:?}"))),
        };
        // A new queue's group is founded led by its master, whose first
        // append tells each mirror its master: a replica here that knows
        // one proves the group runs, without writing an entry. A node
        // without a replica, or whose replica does not hear by the
        // timeout, asks the master for the queue's status.
        let (meta, created) = &q;
        let until = Instant::now() + self.inner.timing.op_timeout;
        let led_here = *created
            && meta.replicas.contains(&me)
            && match self.inner.groups.started(meta.group, until).await {
                Some(g) => {
                    let mut m = g.raft.metrics();
                    let led = tokio::time::timeout_at(until.into(), m.wait_for(|m| m.current_leader.is_some())).await;
                    led.is_ok_and(|r| r.is_ok())
                }
                None => false,
            };
        if !led_here {
            self.view_at_master(name, true).await?;
        }
        Ok(q)
    }

    /// An auto-delete queue lost a consumer here: delete it if no node has
    /// a consumer on it any more (RabbitMQ: when its last consumer goes).
    pub async fn consumer_gone(&self, queue: &str) {
        let auto = self.metadata().queues.get(queue).is_some_and(|q| q.auto_delete);
        if !auto {
            return;
        }
        let (_, consumers) = self.cluster_clients().await;
        if consumers.iter().any(|c| c.queue == queue) {
            return;
        }
        match self.delete_queue(queue).await {
            Ok(()) => tracing::info!(queue, "auto-delete queue deleted after its last consumer"),
            Err(NodeError::NoSuchQueue(_)) => {}
            Err(e) => tracing::warn!(queue, error = %e, "could not auto-delete queue"),
        }
    }

    pub async fn delete_queue(&self, name: &str) -> Result<(), NodeError> {
        match self.meta_write(MetaCmd::DeleteQueue { name: name.to_string() }).await? {
            MetaReply::Ok => Ok(()),
            MetaReply::NotFound => Err(NodeError::NoSuchQueue(name.to_string())),
            other => Err(NodeError::Invalid(format!("unexpected metadata reply {other:?}"))),
        }
    }

    /// Publish messages to a queue; resolves once every synchronised replica
    /// has them on disk.
    pub async fn publish(&self, queue: &str, msgs: Vec<Message>) -> Result<(), NodeError> {
        // Consumers are sent the stored properties as they are.
        if let Some(bad) = msgs.iter().position(|m| !crate::message::valid_properties(&m.properties)) {
            return Err(NodeError::Invalid(format!(
                "message {bad}: properties are not an AMQP property list (message::encode_properties makes one)"
            )));
        }
        let count = msgs.len() as u64;
        let replies = self.queue_op(queue, vec![QueueCmd::Enqueue { msgs }]).await?;
        stored_all(queue, &replies)?;
        // A queue that fills up part way stores a batch's first ones only.
        match stored_count(&replies) {
            n if n < count => Err(NodeError::Refused(format!(
                "queue '{queue}' is full (x-overflow: reject-publish): {n} of {count} stored"
            ))),
            _ => Ok(()),
        }
    }

    /// Take up to `max` messages. With `auto_ack` they are gone at once;
    /// otherwise they wait for [`Node::ack`] / [`Node::nack`] under `owner`.
    pub async fn get(&self, queue: &str, owner: u64, max: u32, auto_ack: bool) -> Result<Vec<Delivery>, NodeError> {
        self.fetch(queue, owner, max, auto_ack).await.map(|(msgs, _)| msgs)
    }

    /// A consumer's get: with nothing ready at the master it waits there
    /// (briefly) for the next entry and takes what that entry publishes
    /// (`proposer::Lane::Parked`); answers empty if nothing came.
    /// `consumer`: a registered consumer ([`Node::register_consumer`]).
    pub async fn consumer_get(
        &self,
        queue: &str,
        owner: u64,
        max: u32,
        auto_ack: bool,
        consumer: Option<ConsumerRef>,
    ) -> Result<Vec<Delivery>, NodeError> {
        let get = QueueCmd::Get { owner, max, auto_ack, consumer };
        self.fetch_in(queue, get, Lane::Parked).await.map(|(msgs, _)| msgs)
    }

    /// A consumer's get of messages known to be ready: it goes into the
    /// master's next entry ahead of publishes waiting there ([`Lane::Consumer`]).
    /// Also answers how many ready messages remain.
    pub async fn consumer_fetch(
        &self,
        queue: &str,
        owner: u64,
        max: u32,
        auto_ack: bool,
        consumer: Option<ConsumerRef>,
    ) -> Result<(Vec<Delivery>, u64), NodeError> {
        self.fetch_in(queue, QueueCmd::Get { owner, max, auto_ack, consumer }, Lane::Consumer).await
    }

    /// A consumer starts on a single-active-consumer queue or with a
    /// priority: registered in the queue's log ([`QueueCmd::Consume`]).
    pub async fn register_consumer(
        &self,
        queue: &str,
        owner: u64,
        consumer: ConsumerRef,
        single_active: bool,
    ) -> Result<(), NodeError> {
        self.single(queue, QueueCmd::Consume { owner, consumer, single_active }).await.map(|_| ())
    }

    /// A registered consumer stops.
    pub async fn unregister_consumer(&self, queue: &str, owner: u64, number: u64) -> Result<(), NodeError> {
        self.single(queue, QueueCmd::Cancel { owner, number }).await.map(|_| ())
    }

    /// [`Node::get`], also answering how many ready messages remain.
    pub async fn fetch(
        &self,
        queue: &str,
        owner: u64,
        max: u32,
        auto_ack: bool,
    ) -> Result<(Vec<Delivery>, u64), NodeError> {
        self.fetch_in(queue, QueueCmd::Get { owner, max, auto_ack, consumer: None }, Lane::Arrival).await
    }

    pub(super) async fn fetch_in(
        &self,
        queue: &str,
        get: QueueCmd,
        lane: Lane,
    ) -> Result<(Vec<Delivery>, u64), NodeError> {
        match self.queue_op_in(queue, vec![get], lane).await?.pop() {
            Some(QueueReply::Got { msgs, remaining }) => Ok((msgs, remaining)),
            other => Err(NodeError::Invalid(format!("unexpected reply {other:?}"))),
        }
    }

    pub async fn ack(&self, queue: &str, tags: Vec<u64>) -> Result<QueueReply, NodeError> {
        self.single(queue, QueueCmd::Ack { tags }).await
    }

    pub async fn nack(&self, queue: &str, tags: Vec<u64>, requeue: bool) -> Result<QueueReply, NodeError> {
        self.single(queue, QueueCmd::Nack { tags, requeue }).await
    }

    /// Requeue `owner`'s deliveries `tags` (only its own: [`QueueCmd::NackOf`]).
    pub async fn nack_of(&self, queue: &str, owner: u64, tags: Vec<u64>) -> Result<QueueReply, NodeError> {
        self.single(queue, QueueCmd::NackOf { owner, tags, requeue: true }).await
    }

    pub async fn purge(&self, queue: &str) -> Result<u64, NodeError> {
        match self.single(queue, QueueCmd::Purge).await? {
            QueueReply::Purged { count } => Ok(count),
            other => Err(NodeError::Invalid(format!("unexpected reply {other:?}"))),
        }
    }

    /// Ready and unacknowledged counts, read through the master's log.
    pub async fn status(&self, queue: &str) -> Result<(u64, u64), NodeError> {
        match self.single(queue, QueueCmd::Status).await? {
            QueueReply::Status { ready, unacked } => Ok((ready, unacked)),
            other => Err(NodeError::Invalid(format!("unexpected reply {other:?}"))),
        }
    }

    pub(super) async fn single(&self, queue: &str, cmd: QueueCmd) -> Result<QueueReply, NodeError> {
        self.queue_op(queue, vec![cmd]).await?.pop().ok_or_else(|| NodeError::Invalid("empty reply".into()))
    }

    /// Ready messages in the local replica of `queue` (the master's count
    /// where this node masters it, a little behind elsewhere).
    pub fn ready_hint(&self, queue: &str) -> Option<u64> {
        let group = self.metadata().queues.get(queue)?.group;
        self.inner.groups.get(group).map(|g| g.stats.borrow().ready)
    }

    /// Wait until the local replica of `queue` shows ready messages, at most
    /// `limit` (just `limit` when this node hosts no replica).
    pub async fn wait_for_messages(&self, queue: &str, limit: Duration) {
        let group = self.metadata().queues.get(queue).map(|q| q.group);
        let stats = group.and_then(|g| self.inner.groups.get(g).map(|g| g.stats.clone()));
        match stats {
            Some(mut rx) => {
                let _ = tokio::time::timeout(limit, rx.wait_for(|s| s.ready > 0)).await;
            }
            None => tokio::time::sleep(limit).await,
        }
    }
}

impl Inner {
    /// Operations on this node's replica of `group`, answered once applied.
    pub(super) async fn local_queue_op(
        &self,
        group: GroupId,
        cmds: Vec<QueueCmd>,
        lane: Lane,
    ) -> Result<Vec<QueueReply>, NodeError> {
        self.hosted(group)?.run(cmds, lane).await
    }

    /// Put operations in this node's proposer for `group`, in call order
    /// within their lane ([`Lane`]).
    pub(super) async fn local_enqueue(
        &self,
        group: GroupId,
        cmds: Vec<QueueCmd>,
        lane: Lane,
    ) -> Result<Answer, NodeError> {
        self.hosted(group)?.enqueue(cmds, lane).await
    }

    fn hosted(&self, group: GroupId) -> Result<Arc<QueueGroup>, NodeError> {
        self.groups.get(group).ok_or(NodeError::NotLeader { leader: None })
    }
}
