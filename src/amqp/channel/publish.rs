//! A publish from its last frame to its confirm: routed, batched per queue
//! while the channel has frames waiting, submitted to each master, and
//! confirmed once every queue it reached has it on every synchronised
//! replica's disk.

use std::time::Instant;

use amq_protocol::protocol::{basic, AMQPClass};
use futures::{Future, FutureExt};
use tokio::sync::OwnedSemaphorePermit;

use crate::amqp::channel::Channel;
use crate::amqp::confirms;
use crate::amqp::reply::{soft, Hard, Soft, NO_ROUTE, PRECONDITION_FAILED};
use crate::amqp::reply_to;
use crate::amqp::writer::ss;
use crate::error::NodeError;
use crate::message::{encode_properties, expiration_ms, to_args};
use crate::node::{stored_all, stored_count, Node};
use crate::queue::{Message, QueueCmd};

/// Publishes of one channel to one queue, received back to back. They go
/// to the queue's master as one command: one submit, one reply, one confirm
/// wait for them all instead of one each (a third of a master's CPU went to
/// that per-publish machinery). Sent once the channel has no frame waiting,
/// before any other method, and when full, so a lone publish waits for
/// nothing and the channel's operations reach the log in their order.
pub(in crate::amqp) struct PublishBatch {
    pub(in crate::amqp) queue: String,
    pub(in crate::amqp) msgs: Vec<Message>,
    pub(in crate::amqp) ttls: Vec<Option<u64>>,
    pub(in crate::amqp) bytes: usize,
    /// Confirm mode: the first one's seq (the others follow it).
    pub(in crate::amqp) first_seq: Option<u64>,
    pub(in crate::amqp) received: Instant,
    pub(in crate::amqp) permits: OwnedSemaphorePermit,
}

/// Bounds on a [`PublishBatch`], like those on a Raft entry.
pub(in crate::amqp) const BATCH_MSGS: usize = 512;

pub(in crate::amqp) const BATCH_BYTES: usize = 128 << 10;

impl PublishBatch {
    pub(in crate::amqp) fn full(&self) -> bool {
        self.msgs.len() >= BATCH_MSGS || self.bytes >= BATCH_BYTES
    }
}

/// Count and log the outcome of `count` publishes from one channel (how
/// many were stored, or why none was) and answer how many to ack.
pub(in crate::amqp) fn publishes_answered(
    node: &Node,
    queue: &str,
    first_seq: Option<u64>,
    received: Instant,
    count: u64,
    result: Result<u64, NodeError>,
) -> u64 {
    match result {
        Ok(stored) => {
            if first_seq.is_some() {
                node.metrics().confirmed.inc_by(stored);
                let took = received.elapsed().as_secs_f64();
                for _ in 0..stored {
                    node.metrics().confirm_latency.observe(took);
                }
            }
            if stored < count {
                tracing::debug!(%queue, refused = count - stored, "queue full (x-overflow: reject-publish)");
            }
            stored
        }
        Err(e) => {
            match (&e, first_seq) {
                (NodeError::Refused(_), Some(_)) => tracing::debug!(%queue, error = %e, "publish refused; nacking"),
                (_, Some(_)) => tracing::warn!(%queue, error = %e, "publish not confirmed; nacking"),
                (_, None) => tracing::warn!(%queue, error = %e, "publish failed (no confirms requested)"),
            }
            0
        }
    }
}

impl Channel {
    /// Answer publishes once they are stored (or refused); the channel's
    /// confirm task coalesces the answers (see `confirms`).
    pub(in crate::amqp) fn confirm_when(&mut self, pending: confirms::Pending) {
        let (id, out) = (self.id, self.out.clone());
        let confirms = self.confirms.get_or_insert_with(|| {
            confirms::spawn(id, move |frames| {
                let out = out.clone();
                async move { out.send(frames).await }
            })
        });
        confirms.when(pending);
    }

    /// A reply to a direct reply-to consumer (`reply_to.rs`): straight to
    /// it, through no queue; dropped (returned if `mandatory`) if it is
    /// gone. Confirmed at once, as RabbitMQ confirms it.
    async fn publish_reply(
        &mut self,
        node: crate::ids::NodeId,
        msg: Message,
        mandatory: bool,
        seq: Option<u64>,
    ) -> Result<(), Result<Soft, Hard>> {
        let to = msg.routing_key.clone();
        let returned = mandatory.then(|| msg.clone());
        let taken = self.node.send_reply(&to, node, msg).await;
        if let Some(msg) = returned.filter(|_| !taken) {
            self.send_return(&msg).await;
        }
        self.confirm_now(seq);
        Ok(())
    }

    pub(in crate::amqp) async fn publish_complete(&mut self) -> Result<(), Result<Soft, Hard>> {
        let p = self.pending.take().expect("pending publish");
        let mut header = p.header.expect("header before completion");
        let exchange = p.publish.exchange.as_str().to_string();
        let routing_key = p.publish.routing_key.as_str().to_string();
        let headers = header.properties.headers().as_ref().map(to_args).unwrap_or_default();
        let ttl = expiration_ms(&header.properties)
            .map_err(|why| Ok(soft(PRECONDITION_FAILED, format!("PRECONDITION_FAILED - {why}"), 60, 40)))?;
        // A request naming the direct reply-to pseudo-queue goes out with
        // the name of this channel's reply consumer in its place.
        if header.properties.reply_to().as_ref().is_some_and(|r| r.as_str() == reply_to::PSEUDO_QUEUE) {
            let Some(r) = &self.reply else {
                let why = "PRECONDITION_FAILED - fast reply consumer does not exist";
                return Err(Ok(soft(PRECONDITION_FAILED, why.to_string(), 60, 40)));
            };
            header.properties = header.properties.with_reply_to(ss(&r.name));
        }
        let received = Instant::now();
        self.node.metrics().received.inc();
        if let Some(node) = exchange.is_empty().then(|| reply_to::node_of(&routing_key)).flatten() {
            self.flush_publishes().await;
            let seq = self.confirm.then(|| {
                self.publish_seq += 1;
                self.publish_seq
            });
            let msg =
                Message { exchange, routing_key, properties: encode_properties(&header.properties), body: p.body };
            return self.publish_reply(node, msg, p.publish.mandatory, seq).await;
        }
        let Some(queues) = self.node.route_fresh(&self.key(&exchange), &routing_key, &headers).await else {
            return Err(self.not_found("exchange", &exchange, 60, 40));
        };
        let batched = queues.len() == 1 && self.tx.is_none();
        if !batched || self.batch.as_ref().is_some_and(|b| b.queue != queues[0] || b.full()) {
            // A batch's seqs are consecutive and its queue is one.
            self.flush_publishes().await;
        }
        let seq = if self.confirm {
            self.publish_seq += 1;
            Some(self.publish_seq)
        } else {
            None
        };
        let msg = Message {
            exchange: exchange.clone(),
            routing_key: routing_key.clone(),
            properties: encode_properties(&header.properties),
            body: p.body,
        };
        if queues.is_empty() {
            self.publish_unroutable(msg, p.publish.mandatory, seq).await;
            return Ok(());
        }
        if let Some(tx) = self.tx.as_mut() {
            for q in queues {
                tx.publishes.entry(q).or_default().push((msg.clone(), ttl));
            }
            return Ok(());
        }
        if batched {
            let queue = queues.into_iter().next().expect("one queue");
            self.add_to_batch(queue, msg, ttl, seq, received).await;
            return Ok(());
        }
        self.publish_to_queues(queues, msg, ttl, seq, received).await;
        Ok(())
    }

    /// A message no queue takes: returned if `mandatory`, confirmed (after
    /// the return) in confirm mode.
    async fn publish_unroutable(&mut self, msg: Message, mandatory: bool, seq: Option<u64>) {
        if mandatory {
            self.send_return(&msg).await;
        }
        self.confirm_now(seq);
    }

    /// `basic.return` of `msg`, which nothing took.
    async fn send_return(&mut self, msg: &Message) {
        let ret = basic::AMQPMethod::Return(basic::Return {
            reply_code: NO_ROUTE,
            reply_text: ss("NO_ROUTE"),
            exchange: ss(&msg.exchange),
            routing_key: ss(&msg.routing_key),
        });
        self.out.content(self.id, AMQPClass::Basic(ret), msg, self.frame_max).await;
    }

    /// Confirm publish `seq` (in confirm mode) with nothing to wait for:
    /// after a return sent before it, in order with the other confirms.
    fn confirm_now(&mut self, seq: Option<u64>) {
        if let Some(seq) = seq {
            self.node.metrics().confirmed.inc();
            self.confirm_when(confirms::Pending { first: seq, count: 1, stored: futures::future::ready(1).boxed() });
        }
    }

    /// A message for one queue outside a transaction joins the channel's
    /// batch (see [`PublishBatch`]).
    async fn add_to_batch(
        &mut self,
        queue: String,
        msg: Message,
        ttl: Option<u64>,
        seq: Option<u64>,
        received: Instant,
    ) {
        let permit = match self.in_flight.clone().try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                // The batch's own permits may be what is missing.
                self.flush_publishes().await;
                self.in_flight.clone().acquire_owned().await.expect("semaphore never closed")
            }
        };
        let bytes = msg.body.len() + msg.properties.len();
        match self.batch.as_mut() {
            Some(b) => {
                b.msgs.push(msg);
                b.ttls.push(ttl);
                b.bytes += bytes;
                b.permits.merge(permit);
            }
            None => {
                let (msgs, ttls) = (vec![msg], vec![ttl]);
                self.batch = Some(PublishBatch { queue, msgs, ttls, bytes, first_seq: seq, received, permits: permit });
            }
        }
    }

    /// A message for several queues (or one, unbatched): each queue's
    /// publish starts here in channel order; it is confirmed once every
    /// queue has it.
    async fn publish_to_queues(
        &mut self,
        queues: Vec<String>,
        msg: Message,
        ttl: Option<u64>,
        seq: Option<u64>,
        received: Instant,
    ) {
        let permit = self.in_flight.clone().acquire_owned().await.expect("semaphore never closed");
        // Start each queue's publish here, in channel order; wait elsewhere.
        let mut waits = Vec::with_capacity(queues.len());
        let mut msg = Some(msg);
        for (i, q) in queues.iter().enumerate() {
            // The last queue takes the message itself: no copy of its body
            // for the usual single queue.
            let m = if i + 1 == queues.len() { msg.take() } else { msg.clone() };
            let m = m.expect("taken only by the last queue");
            waits.push(self.node.submit(q, vec![QueueCmd::enqueue(vec![m], vec![ttl])]).await);
        }
        let node = self.node.clone();
        let done = async move {
            // Confirmed only when every queue it reached has confirmed it.
            let results = futures::future::join_all(waits.into_iter().zip(&queues).map(|(w, q)| async move {
                match w {
                    Ok(wait) => wait.await.and_then(|replies| stored_all(q, &replies)),
                    Err(e) => Err(e),
                }
            }))
            .await;
            drop(permit);
            let failed = queues.iter().zip(results).find_map(|(q, r)| r.err().map(|e| (q, e)));
            match failed {
                None => publishes_answered(&node, &queues[0], seq, received, 1, Ok(1)),
                Some((q, e)) => publishes_answered(&node, q, seq, received, 1, Err(e)),
            }
        };
        self.confirm_or_spawn(seq, 1, done);
    }

    /// Send the batched publishes (see [`PublishBatch`]) to their queue.
    pub(in crate::amqp) async fn flush_publishes(&mut self) {
        let Some(b) = self.batch.take() else { return };
        let count = b.msgs.len() as u64;
        let submitted = self.node.submit(&b.queue, vec![QueueCmd::enqueue(b.msgs, b.ttls)]).await;
        let (node, queue, first_seq, received, permits) =
            (self.node.clone(), b.queue, b.first_seq, b.received, b.permits);
        let done = async move {
            let result = match submitted {
                Ok(wait) => wait.await.map(|replies| stored_count(&replies).min(count)),
                Err(e) => Err(e),
            };
            drop(permits);
            publishes_answered(&node, &queue, first_seq, received, count, result)
        };
        self.confirm_or_spawn(first_seq, count, done);
    }

    /// In confirm mode, `count` publishes from `first_seq` are acked as far
    /// as `done` says they were stored; otherwise `done` just runs.
    pub(in crate::amqp) fn confirm_or_spawn(
        &mut self,
        first_seq: Option<u64>,
        count: u64,
        done: impl Future<Output = u64> + Send + 'static,
    ) {
        match first_seq {
            Some(first) => self.confirm_when(confirms::Pending { first, count, stored: done.boxed() }),
            None => {
                tokio::spawn(done);
            }
        }
    }
}
