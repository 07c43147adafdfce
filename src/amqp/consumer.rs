//! Pushes a queue's messages to one consumer, within its prefetch.
//!
//! Deliveries are taken from the queue's master with gets that go through
//! the queue's Raft log (a delivered message is recorded on every replica
//! before the client sees it). One get at a time would make a consumer as
//! fast as one commit round trip allows, so while the queue holds more than
//! is already asked for, up to [`GETS_IN_FLIGHT`] gets run at once; their
//! messages go to the client in the order the gets were issued, which is
//! their order in the log.

use std::sync::Arc;
use std::time::Duration;

use amq_protocol::protocol::{basic, AMQPClass};
use futures::future::BoxFuture;
use futures::stream::FuturesOrdered;
use futures::{FutureExt, StreamExt};
use tokio_util::sync::CancellationToken;

use super::codec;
use super::deliveries::{Claim, ConsumerId, Deliveries};
use super::writer::{method, push_frames, ss, Out};
use crate::error::NodeError;
use crate::node::Node;
use crate::queue::types::ConsumerRef;
use crate::queue::Delivery;

/// Gets a consumer keeps in flight while the queue is deep.
const GETS_IN_FLIGHT: usize = 4;
/// Messages one get asks for at most.
const GET_BATCH: u32 = 256;
/// A no-ack consumer has no prefetch: this bounds what it asks for at once.
const NO_ACK_BATCH: u32 = 1000;

/// A get in flight: its claim on the prefetch, how many it asked for,
/// whether it was parked, and what it brought.
type Get = BoxFuture<'static, (Option<Claim>, u32, bool, Result<Vec<Delivery>, NodeError>)>;

pub(super) struct Consumer {
    /// Its number on the channel, for its prefetch count.
    pub id: ConsumerId,
    pub channel: u16,
    pub tag: String,
    pub queue: String,
    pub no_ack: bool,
    pub owner: u64,
    /// Its connection's id.
    pub connection: u64,
    pub node: Node,
    pub out: Out,
    pub deliveries: Arc<Deliveries>,
    pub frame_max: u32,
    pub stop: CancellationToken,
    /// Cancelled once it has stopped serving: every get it had in flight
    /// has been answered and its messages delivered or given back.
    pub served: CancellationToken,
    /// The channel's own token: cancelled when the channel closes (then
    /// nothing more may go out on it), not when only this consumer is.
    pub closing: CancellationToken,
    /// The channel's delivery gate (see `Channel::delivery_gate`).
    pub gate: Arc<tokio::sync::Mutex<()>>,
    /// Its number and `x-priority`, named in its gets.
    pub me: ConsumerRef,
    /// Registered in the queue's log, as a consumer of a priority or of a
    /// single-active-consumer queue (`Some(single active)`).
    pub register: Option<bool>,
}

/// A serving consumer's gets in flight: they go to the client in this
/// order, which is their order in the log.
struct Window {
    gets: FuturesOrdered<Get>,
    /// Messages the gets in flight ask for.
    asked: u64,
    /// How long to wait for messages after an unparked get found none:
    /// doubles, up to 200ms, while the queue stays empty.
    idle: Duration,
}

/// A running consumer, as its channel holds it.
pub(super) struct Running {
    pub stop: CancellationToken,
    /// See [`Consumer::served`].
    pub served: CancellationToken,
    pub no_ack: bool,
}

/// How long a consumer goes on trying to register or unregister while the
/// queue's master changes.
const REGISTER_FOR: Duration = Duration::from_secs(60);

impl Consumer {
    pub async fn run(self) {
        let served = self.served.clone();
        let Some(single_active) = self.register else {
            self.serve().await;
            return served.cancel();
        };
        let (node, queue, owner, me) = (self.node.clone(), self.queue.clone(), self.owner, self.me);
        // Until the queue knows it, the consumer is not served at all on a
        // single-active-consumer queue: register before the first get.
        let stop = self.stop.clone();
        let registered = retry(&stop, || node.register_consumer(&queue, owner, me, single_active)).await;
        if registered {
            self.serve().await;
        }
        served.cancel();
        // A channel that closes releases its owner, registrations with it;
        // a cancelled consumer's channel goes on, so it unregisters (also
        // after a registration that failed to answer but may have been
        // applied). A registration left behind would keep a cancelled
        // consumer active on a single-active-consumer queue.
        let never = tokio_util::sync::CancellationToken::new();
        if !retry(&never, || node.unregister_consumer(&queue, owner, me.number)).await {
            tracing::warn!(queue = %queue, "a cancelled consumer could not be unregistered");
        }
    }

    async fn serve(self) {
        let mut w = Window { gets: FuturesOrdered::new(), asked: 0, idle: Duration::from_millis(5) };
        loop {
            if self.stop.is_cancelled() {
                return self.give_back(&mut w.gets).await;
            }
            let no_room = self.ask(&mut w);
            // Room an ack gives back while gets are in flight is asked for
            // at once, not when the oldest get completes: with the window
            // refilled only at completions, a consumer ran at the gets'
            // round trip (behind big publish entries) and fell behind.
            let next = if !w.gets.is_empty() && w.gets.len() < GETS_IN_FLIGHT && !self.no_ack {
                let room = self.deliveries.room.notified();
                tokio::select! {
                    biased;
                    next = w.gets.next() => next,
                    _ = room => continue,
                }
            } else {
                w.gets.next().await
            };
            let Some((claim, want, parked, got)) = next else {
                if !self.wait_for_work(no_room).await {
                    return;
                }
                continue;
            };
            w.asked -= want as u64;
            if !self.take(&mut w, claim, parked, got).await {
                return;
            }
        }
    }

    /// Issue gets up to [`GETS_IN_FLIGHT`]; `true` if the first one found
    /// no room in the prefetch.
    fn ask(&self, w: &mut Window) -> bool {
        let mut no_room = false;
        while w.gets.len() < GETS_IN_FLIGHT {
            let first = w.gets.is_empty();
            // Another get only while the queue holds more than is asked
            // for. The first goes anyway, parked at the master for the
            // next publish unless this node's replica shows messages
            // ready (without a replica here, the master decides).
            let ready = self.node.ready_hint(&self.queue);
            let park = first && ready.is_none_or(|r| r == 0);
            let worth = first || ready.is_some_and(|r| r > w.asked);
            if !worth {
                break;
            }
            // Held until the messages fetched with it are assigned tags.
            let claim = (!self.no_ack).then(|| self.deliveries.claim(self.id, GET_BATCH));
            let want = claim.as_ref().map_or(NO_ACK_BATCH, |c| c.n);
            if want == 0 {
                no_room = first;
                break;
            }
            w.asked += want as u64;
            let (node, queue, owner, no_ack) = (self.node.clone(), self.queue.clone(), self.owner, self.no_ack);
            let me = Some(self.me);
            w.gets.push_back(
                async move {
                    let got = if park {
                        node.consumer_get(&queue, owner, want, no_ack, me).await
                    } else {
                        node.consumer_fetch(&queue, owner, want, no_ack, me).await.map(|(msgs, _)| msgs)
                    };
                    (claim, want, park, got)
                }
                .boxed(),
            );
        }
        no_room
    }

    /// Nothing asked: wait for room or for messages; `false` once stopped.
    async fn wait_for_work(&self, no_room: bool) -> bool {
        if no_room {
            let notified = self.deliveries.room.notified();
            tokio::select! {
                _ = self.stop.cancelled() => return false,
                _ = notified => {}
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        } else {
            tokio::select! {
                _ = self.stop.cancelled() => return false,
                _ = self.node.wait_for_messages(&self.queue, Duration::from_millis(200)) => {}
            }
        }
        true
    }

    /// What a get brought; `false` once the consumer is done.
    async fn take(
        &self,
        w: &mut Window,
        claim: Option<Claim>,
        parked: bool,
        got: Result<Vec<Delivery>, NodeError>,
    ) -> bool {
        match got {
            Ok(msgs) if msgs.is_empty() => {
                drop(claim);
                // A parked get waited at the master already: park again
                // at once, or a publish meanwhile would miss it.
                if w.gets.is_empty() && !parked {
                    tokio::select! {
                        _ = self.stop.cancelled() => return false,
                        _ = self.node.wait_for_messages(&self.queue, w.idle) => {}
                    }
                    w.idle = (w.idle * 2).min(Duration::from_millis(200));
                }
            }
            Ok(msgs) => {
                w.idle = Duration::from_millis(5);
                if self.stop.is_cancelled() {
                    // Cancelled while the get was in flight.
                    self.after_stop(msgs).await;
                    self.give_back(&mut w.gets).await;
                    return false;
                }
                if let Err(msgs) = self.deliver(msgs).await {
                    // Cancelled meanwhile.
                    self.after_stop(msgs).await;
                    self.give_back(&mut w.gets).await;
                    return false;
                }
                drop(claim);
            }
            Err(NodeError::NoSuchQueue(_)) => {
                self.queue_gone(&mut w.gets).await;
                return false;
            }
            Err(e) => {
                drop(claim);
                tracing::debug!(queue = %self.queue, error = %e, "consumer get failed; retrying");
                if w.gets.is_empty() {
                    tokio::select! {
                        _ = self.stop.cancelled() => return false,
                        _ = tokio::time::sleep(Duration::from_millis(200)) => {}
                    }
                }
            }
        }
        true
    }

    /// The queue was deleted: tell the client (consumer_cancel_notify),
    /// unless the client cancelled this consumer first (a get still in
    /// flight then): its tag may be in use again.
    async fn queue_gone(&self, gets: &mut FuturesOrdered<Get>) {
        let gate = self.gate.lock().await;
        if self.stop.is_cancelled() {
            drop(gate);
            return self.give_back(gets).await;
        }
        self.node.clients().stopped_consuming(self.connection, self.channel, &self.tag);
        self.out
            .one(method(
                self.channel,
                AMQPClass::Basic(basic::AMQPMethod::Cancel(basic::Cancel {
                    consumer_tag: ss(&self.tag),
                    nowait: true,
                })),
            ))
            .await;
        drop(gate);
        self.give_back(gets).await
    }

    /// Gets still in flight when the consumer stops: wait for them (a get
    /// cannot be taken back once sent) and settle what they took.
    async fn give_back(&self, gets: &mut FuturesOrdered<Get>) {
        while let Some((_claim, _, _, got)) = gets.next().await {
            if let Ok(msgs) = got {
                self.after_stop(msgs).await;
            }
        }
    }

    /// Messages a get took for this consumer after it was cancelled. With
    /// acks, they go back to the queue. Without, the get removed them
    /// from the queue as it took them: they are delivered (the channel
    /// holds its cancel-ok until this consumer has served, so they still
    /// come before it), unless the channel itself is closing and nothing
    /// may go out on it, as RabbitMQ's no-ack deliveries on their way to
    /// a closing channel are gone.
    async fn after_stop(&self, msgs: Vec<Delivery>) {
        if msgs.is_empty() {
            return;
        }
        if !self.no_ack {
            let tags = msgs.iter().map(|d| d.tag).collect();
            let _ = self.node.nack_of(&self.queue, self.owner, tags).await;
        } else if !self.closing.is_cancelled() {
            let _gate = self.gate.lock().await;
            self.write(msgs).await;
        }
    }

    /// Hand `msgs` to the client, or back if the consumer was stopped.
    async fn deliver(&self, msgs: Vec<Delivery>) -> Result<(), Vec<Delivery>> {
        let _gate = self.gate.lock().await;
        if self.stop.is_cancelled() {
            return Err(msgs);
        }
        self.write(msgs).await;
        Ok(())
    }

    /// Send `msgs` to the client (the delivery gate held).
    async fn write(&self, msgs: Vec<Delivery>) {
        self.node.metrics().delivered.inc_by(msgs.len() as u64);
        let size: usize = msgs.iter().map(|d| d.message.body.len() + d.message.properties.len() + 128).sum();
        let mut buf = Vec::with_capacity(size);
        for d in msgs {
            let tag = self.deliveries.assign(&self.queue, d.tag, !self.no_ack, Some(self.id));
            let m = &d.message;
            push_frames(&mut buf, |buf| {
                codec::write_deliver(self.channel, &self.tag, tag, d.redelivered, &m.exchange, &m.routing_key, buf)?;
                codec::write_content_frames(self.channel, &m.properties, &m.body, self.frame_max, buf)
            });
        }
        self.out.encoded(buf).await;
    }
}

/// Run a registration step until it is done, the queue is gone (`true`
/// either way), `stop` or [`REGISTER_FOR`] (`false`).
async fn retry<F, Fut>(stop: &CancellationToken, mut step: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), NodeError>>,
{
    let until = tokio::time::Instant::now() + REGISTER_FOR;
    loop {
        match step().await {
            Ok(()) | Err(NodeError::NoSuchQueue(_)) => return true,
            Err(e) => tracing::debug!(error = %e, "consumer registration step failed; retrying"),
        }
        if tokio::time::Instant::now() >= until {
            return false;
        }
        tokio::select! {
            _ = stop.cancelled() => return false,
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
}
