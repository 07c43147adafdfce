//! One AMQP channel: its state, its task (frames in order, publishes
//! batched while frames wait), and the dispatch of methods to one file
//! per class: `queue_methods`, `exchange_methods`, `basic_methods`,
//! `tx_methods`; publishing and confirms in `publish`.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{basic, channel, confirm, AMQPClass};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::amqp::auth::Grants;
use crate::amqp::channel::publish::PublishBatch;
use crate::amqp::channel::tx_methods::TxBuffer;
use crate::amqp::confirms;
use crate::amqp::deliveries::{ConsumerId, Deliveries};
use crate::amqp::reply::{
    hard, soft, Hard, Soft, ACCESS_REFUSED, FRAME_ERROR, NOT_FOUND, NOT_IMPLEMENTED, PRECONDITION_FAILED,
    UNEXPECTED_FRAME,
};
use crate::amqp::writer::{method, ss, Out};
use crate::metadata::names;
use crate::metadata::Access;
use crate::node::Node;
use crate::queue::QueueCmd;

mod basic_methods;
mod exchange_methods;
mod publish;
mod queue_methods;
mod tx_methods;

pub(in crate::amqp) struct PendingPublish {
    pub(in crate::amqp) publish: basic::Publish,
    pub(in crate::amqp) header: Option<AMQPContentHeader>,
    pub(in crate::amqp) body: Vec<u8>,
}

pub(in crate::amqp) struct Channel {
    pub(in crate::amqp) id: u16,
    /// Owner of this channel's unacked messages in every queue.
    pub(in crate::amqp) owner: u64,
    pub(in crate::amqp) node: Node,
    pub(in crate::amqp) out: Out,
    pub(in crate::amqp) frame_max: u32,
    pub(in crate::amqp) confirm: bool,
    /// `tx.select`ed: publishes and settlements wait here for `tx.commit`.
    pub(in crate::amqp) tx: Option<TxBuffer>,
    pub(in crate::amqp) publish_seq: u64,
    pub(in crate::amqp) pending: Option<PendingPublish>,
    pub(in crate::amqp) batch: Option<PublishBatch>,
    pub(in crate::amqp) deliveries: Arc<Deliveries>,
    pub(in crate::amqp) consumers: HashMap<String, crate::amqp::consumer::Running>,
    /// Held by a consumer while it checks it is still running and queues a
    /// delivery, and by `basic.cancel` and channel close while they stop
    /// consumers: so no delivery follows a `cancel-ok` or `close-ok` (a
    /// client closing its channel fails on one; lapin does).
    pub(in crate::amqp) delivery_gate: Arc<tokio::sync::Mutex<()>>,
    /// Numbers this channel's consumers, for their prefetch counts.
    pub(in crate::amqp) next_consumer: ConsumerId,
    pub(in crate::amqp) closed: CancellationToken,
    pub(in crate::amqp) in_flight: Arc<Semaphore>,
    pub(in crate::amqp) hard: mpsc::Sender<Hard>,
    pub(in crate::amqp) conn_id: u64,
    /// Exclusive queues this connection declared: deleted when it closes.
    pub(in crate::amqp) exclusive: Arc<Mutex<BTreeSet<String>>>,
    pub(in crate::amqp) user: Arc<str>,
    /// Names from the client are in this vhost: the engine gets keys.
    pub(in crate::amqp) vhost: Arc<str>,
    pub(in crate::amqp) grants: Grants,
    /// In confirm mode: the task that sends acks and nacks.
    pub(in crate::amqp) confirms: Option<confirms::Confirms>,
    /// Its direct reply-to consumer, if it has one.
    pub(in crate::amqp) reply: Option<crate::amqp::reply_to::ReplyConsumer>,
}

impl Channel {
    /// The engine's key of a queue or exchange the client named.
    pub(in crate::amqp) fn key(&self, name: &str) -> String {
        names::key(&self.vhost, name)
    }

    /// 403 unless the user may have `access` to the `kind` (queue or
    /// exchange) `name` in this vhost.
    pub(in crate::amqp) fn may(
        &mut self,
        access: Access,
        kind: &str,
        name: &str,
        class: u16,
        method: u16,
    ) -> Result<(), Result<Soft, Hard>> {
        let meta = self.node.metadata();
        if self.grants.allows(&meta, &self.user, &self.vhost, access, name) {
            return Ok(());
        }
        let name = if name.is_empty() { "amq.default" } else { name };
        Err(Ok(soft(
            ACCESS_REFUSED,
            format!(
                "ACCESS_REFUSED - {} access to {kind} '{name}' in vhost '{}' refused for user '{}'",
                access.as_str(),
                self.vhost,
                self.user
            ),
            class,
            method,
        )))
    }

    pub(in crate::amqp) fn not_found(&self, kind: &str, name: &str, class: u16, method: u16) -> Result<Soft, Hard> {
        Ok(soft(NOT_FOUND, format!("NOT_FOUND - no {kind} '{name}' in vhost '{}'", self.vhost), class, method))
    }

    pub(in crate::amqp) async fn run(mut self, mut rx: mpsc::UnboundedReceiver<AMQPFrame>) {
        let mut closing = false;
        // Polled only while deliveries await their acks: an idle channel
        // sets no timer.
        let mut overdue_check = tokio::time::interval(OVERDUE_CHECK);
        overdue_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let deliveries = self.deliveries.clone();
        loop {
            let holding = !closing && deliveries.holds_any();
            let result = tokio::select! {
                frame = rx.recv() => {
                    let Some(frame) = frame else { break };
                    if closing {
                        match frame {
                            AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))) => break,
                            // Both ends closed at once: each answers the other.
                            AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Close(_))) => {
                                self.reply(AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})))
                                    .await;
                                break;
                            }
                            _ => continue,
                        }
                    }
                    let result = self.frame(frame).await;
                    if rx.is_empty() || result.is_err() {
                        self.flush_publishes().await;
                    }
                    result
                }
                _ = overdue_check.tick(), if holding => match self.overdue() {
                    Some(s) => Err(Ok(s)),
                    None => continue,
                },
                _ = deliveries.held.notified(), if !holding && !closing => continue,
            };
            match result {
                Ok(true) => {}
                Ok(false) => break,
                Err(Ok(s)) => {
                    closing = true;
                    // Nothing goes out on the channel after our close.
                    if let Some(c) = self.confirms.take() {
                        c.abandon();
                    }
                    self.shutdown().await;
                    self.out
                        .one(method(
                            self.id,
                            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                                reply_code: s.code,
                                reply_text: ss(&s.text),
                                class_id: s.class,
                                method_id: s.method,
                            })),
                        ))
                        .await;
                }
                Err(Err(h)) => {
                    let _ = self.hard.send(h).await;
                    break;
                }
            }
        }
        self.flush_publishes().await;
        // The connection is going: the client reads no more confirms.
        if let Some(c) = self.confirms.take() {
            c.abandon();
        }
        self.shutdown().await;
    }

    /// RabbitMQ's consumer timeout: a delivery left unacked longer than
    /// its queue's timeout closes the channel with 406, and what the
    /// channel held goes back to its queues. A queue's timeout is its
    /// `x-consumer-timeout` argument or `consumer-timeout` policy key (the
    /// lower of the two), else the node's `--consumer-timeout`.
    fn overdue(&self) -> Option<Soft> {
        let oldest = self.deliveries.oldest_by_queue();
        let meta = self.node.metadata();
        let now = Instant::now();
        let late = oldest.iter().find_map(|(queue, at)| {
            let timeout = match meta.queues.get(&**queue) {
                Some(q) => {
                    let policy = q.policy.as_ref().and_then(|n| meta.policies.get(n)).map(|p| p.definition.as_str());
                    q.args.consumer_timeout(policy).or(self.node.consumer_timeout())
                }
                None => self.node.consumer_timeout(),
            }?;
            (now.saturating_duration_since(*at) > timeout).then_some(timeout)
        })?;
        Some(soft(
            PRECONDITION_FAILED,
            format!(
                "PRECONDITION_FAILED - delivery acknowledgement on channel {} timed out. Timeout value used: {} ms. \
                 This timeout value can be configured, see consumers doc guide to learn more",
                self.id,
                late.as_millis()
            ),
            0,
            0,
        ))
    }

    /// Stop consumers and give back unacked messages (requeued, redelivered).
    pub(in crate::amqp) async fn shutdown(&mut self) {
        let gate = self.delivery_gate.clone();
        let _gate = gate.lock().await;
        self.closed.cancel();
        for q in self.node.clients().channel_closed(self.conn_id, self.id) {
            let node = self.node.clone();
            tokio::spawn(async move { node.consumer_gone(&q).await });
        }
        for (_, c) in self.consumers.drain() {
            c.stop.cancel();
        }
        if let Some(r) = self.reply.take() {
            r.stop.cancel();
            self.node.clients().replies_gone(&r.name);
        }
        let queues = self.deliveries.queues_held();
        self.deliveries.forget_all();
        // As RabbitMQ: the messages are back in their queues, in their
        // places, before `close-ok`; a consumer the client starts next
        // gets them first and in order, not after newer ones.
        let owner = self.owner;
        let releases = queues.into_iter().map(|q| {
            let node = self.node.clone();
            async move {
                if let Err(e) = node.queue_op(&q, vec![QueueCmd::Release { owner }]).await {
                    tracing::warn!(queue = %q, error = %e, "could not requeue a closed channel's messages");
                }
            }
        });
        let _ = tokio::time::timeout(RELEASED_WITHIN, futures::future::join_all(releases)).await;
        // Whatever this release misses (a get that was still on its way,
        // a master that changed meanwhile) the masters' reapers give back.
        self.node.owners().gone(self.owner);
    }

    /// `Ok(false)`: the channel is closed.
    pub(in crate::amqp) async fn frame(&mut self, frame: AMQPFrame) -> Result<bool, Result<Soft, Hard>> {
        match frame {
            AMQPFrame::Method(_, class) => {
                if self.pending.is_some() {
                    return Err(Err(hard(UNEXPECTED_FRAME, "method frame while content was expected")));
                }
                if !matches!(class, AMQPClass::Basic(basic::AMQPMethod::Publish(_))) {
                    self.flush_publishes().await;
                }
                self.method(class).await
            }
            AMQPFrame::Header(_, header) => {
                let Some(p) = self.pending.as_mut() else {
                    return Err(Err(hard(UNEXPECTED_FRAME, "content header without basic.publish")));
                };
                if p.header.is_some() {
                    return Err(Err(hard(UNEXPECTED_FRAME, "second content header")));
                }
                let size = header.body_size;
                p.header = Some(header);
                if size == 0 {
                    self.publish_complete().await?;
                }
                Ok(true)
            }
            AMQPFrame::Body(_, data) => {
                let Some(p) = self.pending.as_mut() else {
                    return Err(Err(hard(UNEXPECTED_FRAME, "content body without basic.publish")));
                };
                let Some(h) = p.header.as_ref() else {
                    return Err(Err(hard(UNEXPECTED_FRAME, "content body before its header")));
                };
                p.body.extend_from_slice(&data);
                if p.body.len() as u64 > h.body_size {
                    return Err(Err(hard(FRAME_ERROR, "content body longer than announced")));
                }
                if p.body.len() as u64 == h.body_size {
                    self.publish_complete().await?;
                }
                Ok(true)
            }
            _ => Err(Err(hard(UNEXPECTED_FRAME, "unexpected frame on a channel"))),
        }
    }

    pub(in crate::amqp) async fn reply(&self, class: AMQPClass) {
        self.out.one(method(self.id, class)).await;
    }

    pub(in crate::amqp) async fn method(&mut self, class: AMQPClass) -> Result<bool, Result<Soft, Hard>> {
        match class {
            AMQPClass::Channel(channel::AMQPMethod::Close(_)) => {
                // As RabbitMQ: every publish is confirmed (or nacked)
                // before `close-ok`, and nothing follows it. Nothing is
                // delivered meanwhile: the client has closed.
                {
                    let _gate = self.delivery_gate.lock().await;
                    self.closed.cancel();
                }
                if let Some(c) = self.confirms.take() {
                    c.close(CONFIRMED_WITHIN).await;
                }
                self.shutdown().await;
                self.reply(AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {}))).await;
                Ok(false)
            }
            AMQPClass::Channel(channel::AMQPMethod::Flow(f)) => {
                self.reply(AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk { active: f.active }))).await;
                Ok(true)
            }
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => Ok(true),
            AMQPClass::Confirm(confirm::AMQPMethod::Select(s)) => {
                if self.tx.is_some() {
                    return Err(Ok(soft(
                        PRECONDITION_FAILED,
                        "PRECONDITION_FAILED - cannot switch from tx to confirm mode",
                        85,
                        10,
                    )));
                }
                self.confirm = true;
                if !s.nowait {
                    self.reply(AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {}))).await;
                }
                Ok(true)
            }
            AMQPClass::Queue(m) => self.queue_method(m).await,
            AMQPClass::Exchange(m) => self.exchange_method(m).await,
            AMQPClass::Tx(m) => self.tx_method(m).await,
            AMQPClass::Basic(m) => self.basic_method(m).await,
            other => Err(Err(hard(
                NOT_IMPLEMENTED,
                format!(
                    "NOT_IMPLEMENTED - {} (exchanges, bindings and transactions are not built yet)",
                    class_name(&other)
                ),
            ))),
        }
    }
}

/// How often a channel holding deliveries looks for one past its
/// consumer timeout.
const OVERDUE_CHECK: Duration = Duration::from_secs(1);
/// How long a closing channel waits for its publishes' confirms; what is
/// not answered by then is nacked.
const CONFIRMED_WITHIN: Duration = Duration::from_secs(10);
/// How long a closing channel waits for its queues to take back what it
/// held; the reapers give back whatever is missed.
pub(in crate::amqp) const RELEASED_WITHIN: Duration = Duration::from_secs(10);

fn class_name(c: &AMQPClass) -> String {
    let s = format!("{c:?}");
    s.split('(').take(2).collect::<Vec<_>>().join(".").to_lowercase()
}

fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    h.finish()
}
