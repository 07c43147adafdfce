//! Who is connected to this node over AMQP: what the management API lists
//! as connections, channels and consumers (each node reports its own; the
//! API gathers them cluster-wide).

use std::collections::BTreeMap;
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConnectionInfo {
    pub id: u64,
    /// `peer -> local`, as RabbitMQ names connections.
    pub name: String,
    pub peer: String,
    pub user: String,
    /// Empty until the client opens a vhost.
    pub vhost: String,
    pub node: String,
    /// Open channel numbers.
    pub channels: Vec<u16>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsumerInfo {
    pub connection: u64,
    pub channel: u16,
    pub tag: String,
    pub queue: String,
    pub ack_required: bool,
    pub prefetch: u16,
    /// `basic.consume` with `exclusive`: the queue's only consumer.
    #[serde(default)]
    pub exclusive: bool,
    /// Who it is in the queue's registrations: its channel's owner and its
    /// number there (`queue::types::ConsumerRef`).
    #[serde(default)]
    pub owner: u64,
    #[serde(default)]
    pub number: u64,
    /// Consuming from a queue with `x-single-active-consumer`.
    #[serde(default)]
    pub single_active: bool,
}

/// Tells one connection to close, with the reason given.
pub type Closer = Box<dyn Fn(&str) + Send + Sync>;

/// Where the replies to one direct reply-to consumer go.
pub type ReplyTx = tokio::sync::mpsc::UnboundedSender<crate::message::Message>;

/// This node's AMQP clients.
#[derive(Default)]
pub struct Clients {
    /// How to close each connection, by id.
    closers: Mutex<BTreeMap<u64, Closer>>,
    /// Open connections (a vhost opened) this node takes at most; 0: no limit.
    max_open: usize,
    connections: Mutex<BTreeMap<u64, ConnectionInfo>>,
    consumers: Mutex<BTreeMap<(u64, u16, String), ConsumerInfo>>,
    /// Direct reply-to consumers here, by the name their requests' `reply_to`
    /// was given (`amqp/reply_to.rs`).
    replies: Mutex<BTreeMap<String, ReplyTx>>,
}

impl Clients {
    pub fn connected(&self, info: ConnectionInfo) {
        self.connections.lock().expect("poisoned").insert(info.id, info);
    }
    /// How connection `id` is told to close ([`Clients::close`]).
    pub fn closes_by(&self, id: u64, closer: Closer) {
        self.closers.lock().expect("poisoned").insert(id, closer);
    }

    /// Close connection `id`, telling its client `reason`; `false` if it
    /// is not here (any more).
    pub fn close(&self, id: u64, reason: &str) -> bool {
        let closers = self.closers.lock().expect("poisoned");
        match closers.get(&id) {
            Some(close) => {
                close(reason);
                true
            }
            None => false,
        }
    }

    /// A direct reply-to consumer here takes the replies sent to `name`.
    pub fn replies_to(&self, name: String, tx: ReplyTx) {
        self.replies.lock().expect("poisoned").insert(name, tx);
    }

    /// The direct reply-to consumer of `name` is gone.
    pub fn replies_gone(&self, name: &str) {
        self.replies.lock().expect("poisoned").remove(name);
    }

    /// Hand `reply` to the consumer of `name`; `false` if it is not here
    /// (any more): RabbitMQ drops such a reply.
    pub fn reply(&self, name: &str, reply: crate::message::Message) -> bool {
        let replies = self.replies.lock().expect("poisoned");
        replies.get(name).is_some_and(|tx| tx.send(reply).is_ok())
    }

    /// Forget a connection; returns the queues its consumers were on.
    pub fn disconnected(&self, id: u64) -> Vec<String> {
        self.connections.lock().expect("poisoned").remove(&id);
        self.closers.lock().expect("poisoned").remove(&id);
        let mut gone = Vec::new();
        self.consumers.lock().expect("poisoned").retain(|k, v| {
            let keep = k.0 != id;
            if !keep {
                gone.push(v.queue.clone());
            }
            keep
        });
        gone
    }
    /// At most `max_open` open connections (0: no limit).
    pub fn with_limit(max_open: usize) -> Self {
        Self { max_open, ..Self::default() }
    }

    /// The client logged in as `user` and opens `vhost`; refused with the
    /// limit when this node has as many open connections already.
    pub fn opened(&self, id: u64, user: &str, vhost: &str) -> Result<(), usize> {
        let mut conns = self.connections.lock().expect("poisoned");
        if self.max_open > 0 && conns.values().filter(|c| !c.vhost.is_empty()).count() >= self.max_open {
            return Err(self.max_open);
        }
        if let Some(c) = conns.get_mut(&id) {
            c.user = user.to_string();
            c.vhost = vhost.to_string();
        }
        Ok(())
    }
    pub fn channel_opened(&self, id: u64, channel: u16) {
        if let Some(c) = self.connections.lock().expect("poisoned").get_mut(&id) {
            if !c.channels.contains(&channel) {
                c.channels.push(channel);
                c.channels.sort_unstable();
            }
        }
    }
    pub fn consuming(&self, info: ConsumerInfo) {
        self.consumers.lock().expect("poisoned").insert((info.connection, info.channel, info.tag.clone()), info);
    }
    /// Forget a consumer; returns its queue.
    pub fn stopped_consuming(&self, connection: u64, channel: u16, tag: &str) -> Option<String> {
        self.consumers.lock().expect("poisoned").remove(&(connection, channel, tag.to_string())).map(|c| c.queue)
    }
    /// Forget a channel; returns the queues its consumers were on.
    pub fn channel_closed(&self, connection: u64, channel: u16) -> Vec<String> {
        if let Some(c) = self.connections.lock().expect("poisoned").get_mut(&connection) {
            c.channels.retain(|ch| *ch != channel);
        }
        let mut gone = Vec::new();
        self.consumers.lock().expect("poisoned").retain(|k, v| {
            let keep = !(k.0 == connection && k.1 == channel);
            if !keep {
                gone.push(v.queue.clone());
            }
            keep
        });
        gone
    }
    pub fn snapshot(&self) -> (Vec<ConnectionInfo>, Vec<ConsumerInfo>) {
        (
            self.connections.lock().expect("poisoned").values().cloned().collect(),
            self.consumers.lock().expect("poisoned").values().cloned().collect(),
        )
    }
}
