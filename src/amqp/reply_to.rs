//! RabbitMQ's direct reply-to, the RPC pattern many client frameworks use.
//! A requester consumes (no-ack) from the pseudo-queue
//! `amq.rabbitmq.reply-to` and publishes its request with `reply_to` set to
//! that name; the request goes out with the name of its consumer there
//! instead. A reply published to the default exchange with that name as
//! its routing key goes straight to the consumer, on whichever node it is,
//! through no queue. As in RabbitMQ, a reply whose consumer is gone is
//! dropped (returned if mandatory).

use std::sync::Arc;

use amq_protocol::protocol::{basic, AMQPClass};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::deliveries::Deliveries;
use super::writer::{ss, Out};
use crate::ids::NodeId;
use crate::message::Message;

/// The pseudo-queue a requester consumes from and names in `reply_to`.
pub(in crate::amqp) const PSEUDO_QUEUE: &str = "amq.rabbitmq.reply-to";
const PREFIX: &str = "amq.rabbitmq.reply-to.";

/// A consumer's name: the pseudo-queue's, the node it is on (so any node
/// can send it a reply), and a part nobody can guess (whoever knows the
/// name can send to it).
pub(super) fn name(node: NodeId, secret: u128) -> String {
    format!("{PREFIX}{node}.{secret:032x}")
}

/// The node a reply's routing key names, if it is a reply-to name.
pub(super) fn node_of(routing_key: &str) -> Option<NodeId> {
    routing_key.strip_prefix(PREFIX)?.split_once('.')?.0.parse().ok()
}

/// A channel's direct reply-to consumer.
pub(in crate::amqp) struct ReplyConsumer {
    pub(in crate::amqp) name: String,
    pub(in crate::amqp) tag: String,
    pub(in crate::amqp) stop: CancellationToken,
}

/// What a reply consumer needs to deliver.
pub(super) struct Deliverer {
    pub(super) channel: u16,
    pub(super) tag: String,
    pub(super) out: Out,
    pub(super) deliveries: Arc<Deliveries>,
    pub(super) frame_max: u32,
    pub(super) stop: CancellationToken,
    /// The channel's delivery gate: nothing goes out after a cancel-ok or
    /// close-ok (see `Channel::delivery_gate`).
    pub(super) gate: Arc<tokio::sync::Mutex<()>>,
}

impl Deliverer {
    /// Deliver the replies that arrive until the consumer stops.
    pub(super) async fn run(self, mut replies: mpsc::UnboundedReceiver<Message>) {
        loop {
            let reply = tokio::select! {
                r = replies.recv() => r,
                _ = self.stop.cancelled() => None,
            };
            let Some(reply) = reply else { return };
            let _gate = self.gate.lock().await;
            if self.stop.is_cancelled() {
                return;
            }
            // No ack is asked: the tag is only counted.
            let delivery_tag = self.deliveries.assign("", 0, false, None);
            let deliver = basic::Deliver {
                consumer_tag: ss(&self.tag),
                delivery_tag,
                redelivered: false,
                exchange: ss(&reply.exchange),
                routing_key: ss(&reply.routing_key),
            };
            let class = AMQPClass::Basic(basic::AMQPMethod::Deliver(deliver));
            self.out.content(self.channel, class, &reply, self.frame_max).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_to_name_carries_its_node_and_nothing_else_passes_for_one() {
        let n = name(3, 0xfeed);
        assert!(n.starts_with("amq.rabbitmq.reply-to.3."), "{n}");
        assert_eq!(node_of(&n), Some(3));
        for other in ["amq.rabbitmq.reply-to", "amq.rabbitmq.reply-to.", "amq.rabbitmq.reply-to.x.y", "orders", ""] {
            assert_eq!(node_of(other), None, "{other}");
        }
    }
}
