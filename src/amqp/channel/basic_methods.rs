//! `basic.*` other than publish: qos, consume, cancel, get, ack, nack,
//! reject, recover.

use amq_protocol::protocol::{basic, AMQPClass};

use crate::amqp::channel::rand_id;
use crate::amqp::channel::{Channel, PendingPublish};
use crate::amqp::consumer::{Consumer, Running};
use crate::amqp::deliveries::Deliveries;
use crate::amqp::reply::{
    hard, node_soft, soft, unknown_tag, Hard, Soft, ACCESS_REFUSED, COMMAND_INVALID, NOT_ALLOWED, NOT_IMPLEMENTED,
    PRECONDITION_FAILED,
};
use crate::amqp::reply_to::{self, ReplyConsumer};
use crate::amqp::writer::ss;
use crate::error::NodeError;
use crate::message::to_args;
use crate::metadata::routing::ArgValue;
use crate::metadata::Access;
use crate::node::{Node, Submitted};
use crate::queue::proposer::Lane;
use crate::queue::types::ConsumerRef;
use crate::queue::QueueCmd;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Clone, Copy)]
pub(in crate::amqp) enum Settle {
    Ack,
    Nack { requeue: bool },
}

impl Settle {
    /// Settle `owner`'s deliveries `tags`: only its own.
    pub(in crate::amqp) fn cmd(self, owner: u64, tags: Vec<u64>) -> QueueCmd {
        match self {
            Settle::Ack => QueueCmd::AckOf { owner, tags },
            Settle::Nack { requeue } => QueueCmd::NackOf { owner, tags, requeue },
        }
    }
}

impl Channel {
    pub(in crate::amqp) async fn basic_method(&mut self, m: basic::AMQPMethod) -> Result<bool, Result<Soft, Hard>> {
        use basic::AMQPMethod as B;
        match m {
            B::Publish(p) => {
                if p.immediate {
                    // RabbitMQ dropped `immediate` in 3.0 and refuses it so.
                    let text = "NOT_IMPLEMENTED - immediate=true".to_string();
                    return Err(Err(Hard { code: NOT_IMPLEMENTED, text, class: 60, method: 40 }));
                }
                self.may(Access::Write, "exchange", p.exchange.as_str(), 60, 40)?;
                self.pending = Some(PendingPublish { publish: p, header: None, body: Vec::new() });
                Ok(true)
            }
            B::Qos(q) => {
                self.deliveries.set_prefetch(q.prefetch_count, q.global);
                self.reply(AMQPClass::Basic(B::QosOk(basic::QosOk {}))).await;
                Ok(true)
            }
            B::Get(g) => self.basic_get(g).await,
            B::Consume(c) => self.basic_consume(c).await,
            B::Cancel(c) => self.basic_cancel(c).await,
            B::Ack(a) => self.settle(a.delivery_tag, a.multiple, Settle::Ack, 80).await,
            B::Nack(n) => self.settle(n.delivery_tag, n.multiple, Settle::Nack { requeue: n.requeue }, 120).await,
            B::Reject(r) => self.settle(r.delivery_tag, false, Settle::Nack { requeue: r.requeue }, 90).await,
            B::Recover(r) => {
                self.requeue_all(r.requeue).await;
                self.reply(AMQPClass::Basic(B::RecoverOk(basic::RecoverOk {}))).await;
                Ok(true)
            }
            B::RecoverAsync(r) => {
                self.requeue_all(r.requeue).await;
                Ok(true)
            }
            other => Err(Err(hard(COMMAND_INVALID, format!("basic.{other:?} is not a client method")))),
        }
    }

    async fn basic_get(&mut self, g: basic::Get) -> Result<bool, Result<Soft, Hard>> {
        use basic::AMQPMethod as B;
        self.may(Access::Read, "queue", g.queue.as_str(), 60, 70)?;
        let queue = self.key(g.queue.as_str());
        self.locked_check(&queue, 60, 70).await?;
        let (got, remaining) =
            self.node.fetch(&queue, self.owner, 1, g.no_ack).await.map_err(|e| Ok(node_soft(e, 60, 70)))?;
        match got.into_iter().next() {
            None => self.reply(AMQPClass::Basic(B::GetEmpty(basic::GetEmpty {}))).await,
            Some(d) => {
                self.node.metrics().delivered.inc();
                let tag = self.deliveries.assign(&queue, d.tag, !g.no_ack, None);
                let m = B::GetOk(basic::GetOk {
                    delivery_tag: tag,
                    redelivered: d.redelivered,
                    exchange: ss(&d.message.exchange),
                    routing_key: ss(&d.message.routing_key),
                    message_count: remaining as u32,
                });
                self.out.content(self.id, AMQPClass::Basic(m), &d.message, self.frame_max).await;
            }
        }
        Ok(true)
    }

    async fn basic_consume(&mut self, c: basic::Consume) -> Result<bool, Result<Soft, Hard>> {
        use basic::AMQPMethod as B;
        if c.queue.as_str() == reply_to::PSEUDO_QUEUE {
            return self.consume_replies(c).await;
        }
        let bare = c.queue.as_str().to_string();
        self.may(Access::Read, "queue", &bare, 60, 20)?;
        let queue = self.key(&bare);
        let single_active = match self.node.find_queue(&queue).await {
            Ok(q) => {
                self.check_exclusive(&q, 60, 20)?;
                q.args.single_active_consumer
            }
            Err(_) => return Err(self.not_found("queue", &bare, 60, 20)),
        };
        let priority = match to_args(&c.arguments).get("x-priority") {
            None => 0,
            Some(ArgValue::Int(p)) if i32::try_from(*p).is_ok() => *p as i32,
            Some(_) => {
                let why = "PRECONDITION_FAILED - invalid arg 'x-priority': not a 32-bit integer";
                return Err(Ok(soft(PRECONDITION_FAILED, why.to_string(), 60, 20)));
            }
        };
        let tag = self.new_consumer_tag(&c)?;
        // Cluster-wide, as the consumers of a queue may be on any node.
        let present = self.node.consumers_of(&queue).await;
        if (c.exclusive && !present.is_empty()) || present.iter().any(|k| k.exclusive) {
            return Err(Ok(soft(
                ACCESS_REFUSED,
                format!("ACCESS_REFUSED - queue '{bare}' in vhost '{}' in exclusive use", self.vhost),
                60,
                20,
            )));
        }
        self.next_consumer += 1;
        let id = self.next_consumer;
        let me = ConsumerRef { number: id as u64, priority };
        let register = (single_active || priority != 0).then_some(single_active);
        let prefetch = self.deliveries.consumer_started(id);
        let stop = self.closed.child_token();
        let served = CancellationToken::new();
        let running = Running { stop: stop.clone(), served: served.clone(), no_ack: c.no_ack };
        self.consumers.insert(tag.clone(), running);
        self.node.clients().consuming(crate::clients::ConsumerInfo {
            connection: self.conn_id,
            channel: self.id,
            tag: tag.clone(),
            queue: queue.clone(),
            ack_required: !c.no_ack,
            prefetch,
            exclusive: c.exclusive,
            owner: self.owner,
            number: me.number,
            single_active,
        });
        if !c.nowait {
            self.reply(AMQPClass::Basic(B::ConsumeOk(basic::ConsumeOk { consumer_tag: ss(&tag) }))).await;
        }
        let consumer = Consumer {
            id,
            channel: self.id,
            tag,
            queue,
            no_ack: c.no_ack,
            owner: self.owner,
            connection: self.conn_id,
            node: self.node.clone(),
            out: self.out.clone(),
            deliveries: self.deliveries.clone(),
            frame_max: self.frame_max,
            stop,
            served,
            closing: self.closed.clone(),
            gate: self.delivery_gate.clone(),
            me,
            register,
        };
        tokio::spawn(consumer.run());
        Ok(true)
    }

    /// The tag a `basic.consume` asks for, or one made up; a tag in use on
    /// the channel closes the connection (530), as RabbitMQ does.
    fn new_consumer_tag(&self, c: &basic::Consume) -> Result<String, Result<Soft, Hard>> {
        let tag = if c.consumer_tag.as_str().is_empty() {
            format!("amq.ctag-{:016x}", rand_id())
        } else {
            c.consumer_tag.as_str().to_string()
        };
        if self.consumers.contains_key(&tag) || self.reply.as_ref().is_some_and(|r| r.tag == tag) {
            return Err(Err(hard(NOT_ALLOWED, format!("NOT_ALLOWED - attempt to reuse consumer tag '{tag}'"))));
        }
        Ok(tag)
    }

    /// `basic.consume` from `amq.rabbitmq.reply-to` (`reply_to.rs`): no-ack
    /// only, one per channel, as RabbitMQ has it.
    async fn consume_replies(&mut self, c: basic::Consume) -> Result<bool, Result<Soft, Hard>> {
        use basic::AMQPMethod as B;
        let refuse = |why: &str| Err(Ok(soft(PRECONDITION_FAILED, format!("PRECONDITION_FAILED - {why}"), 60, 20)));
        if !c.no_ack {
            return refuse("reply consumer cannot acknowledge");
        }
        if self.reply.is_some() {
            return refuse("reply consumer already set");
        }
        let tag = self.new_consumer_tag(&c)?;
        let name = reply_to::name(self.node.id(), u128::from(rand_id()) << 64 | u128::from(rand_id()));
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        self.node.clients().replies_to(name.clone(), tx);
        let stop = self.closed.child_token();
        self.reply = Some(ReplyConsumer { name, tag: tag.clone(), stop: stop.clone() });
        if !c.nowait {
            self.reply(AMQPClass::Basic(B::ConsumeOk(basic::ConsumeOk { consumer_tag: ss(&tag) }))).await;
        }
        let deliverer = reply_to::Deliverer {
            channel: self.id,
            tag,
            out: self.out.clone(),
            deliveries: self.deliveries.clone(),
            frame_max: self.frame_max,
            stop,
            gate: self.delivery_gate.clone(),
        };
        tokio::spawn(deliverer.run(rx));
        Ok(true)
    }

    async fn basic_cancel(&mut self, c: basic::Cancel) -> Result<bool, Result<Soft, Hard>> {
        use basic::AMQPMethod as B;
        if self.reply.as_ref().is_some_and(|r| r.tag == c.consumer_tag.as_str()) {
            let r = self.reply.take().expect("checked");
            {
                let _gate = self.delivery_gate.lock().await;
                r.stop.cancel();
            }
            self.node.clients().replies_gone(&r.name);
            if !c.nowait {
                self.reply(AMQPClass::Basic(B::CancelOk(basic::CancelOk { consumer_tag: c.consumer_tag }))).await;
            }
            return Ok(true);
        }
        if let Some(running) = self.consumers.remove(c.consumer_tag.as_str()) {
            {
                let _gate = self.delivery_gate.lock().await;
                running.stop.cancel();
            }
            // A no-ack consumer's gets in flight removed their messages
            // from the queue as they took them: they go to the client
            // before the cancel-ok, or they would be lost.
            if running.no_ack {
                let served = tokio::time::timeout(SERVED_WITHIN, running.served.cancelled()).await;
                if served.is_err() {
                    tracing::warn!(consumer = %c.consumer_tag, "a cancelled no-ack consumer's gets did not finish in time");
                }
            }
        }
        if let Some(q) = self.node.clients().stopped_consuming(self.conn_id, self.id, c.consumer_tag.as_str()) {
            let node = self.node.clone();
            tokio::spawn(async move { node.consumer_gone(&q).await });
        }
        if !c.nowait {
            self.reply(AMQPClass::Basic(B::CancelOk(basic::CancelOk { consumer_tag: c.consumer_tag }))).await;
        }
        Ok(true)
    }

    pub(in crate::amqp) async fn requeue_all(&mut self, _requeue: bool) {
        // RabbitMQ requeues in both cases; so do we.
        if let Ok(mut taken) = self.deliveries.take(0, true, true) {
            for (q, tags) in std::mem::take(&mut taken.by_queue) {
                let _ = self.node.nack_of(&q, self.owner, tags).await;
                self.deliveries.settled(&taken.holders(&q));
            }
        }
    }

    pub(in crate::amqp) async fn settle(
        &mut self,
        tag: u64,
        multiple: bool,
        how: Settle,
        method_id: u16,
    ) -> Result<bool, Result<Soft, Hard>> {
        let unknown = |t: u64| Ok(unknown_tag(t, 60, method_id));
        if let Some(tx) = self.tx.as_mut() {
            if !multiple && !self.deliveries.is_unacked(tag) {
                return Err(unknown(tag));
            }
            tx.settles.push((tag, multiple, how));
            return Ok(true);
        }
        let requeued = matches!(how, Settle::Nack { requeue: true });
        let mut taken = self.deliveries.take(tag, multiple, requeued).map_err(unknown)?;
        if matches!(how, Settle::Ack) {
            let n: usize = taken.by_queue.values().map(Vec::len).sum();
            self.node.metrics().acknowledged.inc_by(n as u64);
        }
        for (q, tags) in std::mem::take(&mut taken.by_queue) {
            let holders = taken.holders(&q);
            let cmd = how.cmd(self.owner, tags.clone());
            self.deliveries.sending(&q, &tags);
            // Submitted here, in the channel's order: a message requeued
            // before a basic.consume or basic.get on the channel is back
            // before that takes anything (the consumer lane goes first into
            // an entry, and a get comes after). Only the answer is awaited
            // apart.
            let submitted = self.node.submit_in(&q, vec![cmd.clone()], Lane::Consumer).await;
            let (node, deliveries) = (self.node.clone(), self.deliveries.clone());
            tokio::spawn(async move {
                land(&node, &q, cmd, submitted, &deliveries).await;
                deliveries.landed(&q, &tags);
                deliveries.settled(&holders);
            });
        }
        Ok(true)
    }
}

/// How long a cancel-ok waits for a cancelled no-ack consumer's gets in
/// flight (each bounded by the operation timeout at the master).
const SERVED_WITHIN: Duration = Duration::from_secs(20);

/// The first pause before a settle is sent again, and the longest.
const RESEND_FIRST: Duration = Duration::from_millis(100);
const RESEND_MAX: Duration = Duration::from_secs(1);

/// Wait for a settle's answer, and send it again while the queue's master
/// is out of reach (or moved, or its answer was lost) and the channel is
/// open. A consumer cut off from its queue's master by a partition goes on
/// working through what it was sent; were its acks dropped, the master
/// would give those messages back once the partition healed (their holder
/// no longer knows them) and they would be delivered twice. Sending a
/// settle twice settles once: a delivery tag is never given twice
/// (`queue::state`), so a repeated ack finds its tag gone and does nothing.
async fn land(node: &Node, queue: &str, cmd: QueueCmd, first: Result<Submitted, NodeError>, deliveries: &Deliveries) {
    let mut pause = RESEND_FIRST;
    let mut attempt = first;
    loop {
        let answer = match attempt {
            Ok(wait) => wait.await.map(|_| ()),
            Err(e) => Err(e),
        };
        match answer {
            Ok(()) => return,
            Err(NodeError::Unavailable(_) | NodeError::NotLeader { .. } | NodeError::Unconfirmed(_))
                if !deliveries.is_closed() =>
            {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(RESEND_MAX);
                node.metrics().settles_resent.inc();
                attempt = node.submit_in(queue, vec![cmd.clone()], Lane::Consumer).await;
            }
            Err(e) => {
                tracing::warn!(queue = %queue, error = %e, "settling deliveries failed");
                return;
            }
        }
    }
}
