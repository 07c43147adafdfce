//! Commands a queue's Raft group agrees on, and their replies.

use serde::{Deserialize, Serialize};

/// A log entry's identity `(leader term, leader node, index)`.
pub type Origin = (u64, u64, u64);

pub use crate::message::Message;

/// Where a delivered message is in its life (never-delivered messages have
/// no stored state: they are the range the queue's counters describe).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum MsgState {
    /// Delivered and requeued; served before `Ready` ones in `order`.
    Requeued { order: u64 },
    /// Delivered under `tag` to `owner`, awaiting ack.
    Unacked { tag: u64, owner: u64 },
    /// Never delivered, of a priority above 0 (a priority queue's), in
    /// `order` among those of its priority.
    Queued { order: u64 },
}

/// One operation on a queue. A Raft entry carries a batch of them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum QueueCmd {
    Enqueue {
        msgs: Vec<Message>,
    },
    /// Take up to `max` messages for `owner` (a connection or consumer id;
    /// `Release` requeues everything an owner holds).
    Get {
        owner: u64,
        max: u32,
        auto_ack: bool,
        /// The registered consumer asking (see [`QueueCmd::Consume`]): on a
        /// single-active-consumer queue only the active one is served.
        consumer: Option<ConsumerRef>,
    },
    Ack {
        tags: Vec<u64>,
    },
    Nack {
        tags: Vec<u64>,
        requeue: bool,
    },
    Release {
        owner: u64,
    },
    Purge,
    Delete,
    /// Read-only: counts, through the log so they are linearizable.
    Status,
    /// Messages a replica of an older epoch gave back (see `queue::epoch`):
    /// stored as requeued, so they are served first and marked redelivered.
    Handback {
        /// The log entry (of the old epoch) the messages were published in,
        /// as `(term, node, index)`, for publishes a replica never applied;
        /// for a stored message, its own number and the epoch that gave it
        /// (`state::message_key`). Replicas of that epoch hand back the same
        /// messages under the same key, and only the first is kept. `None`:
        /// no de-duplication. Written by earlier builds; this one writes
        /// [`QueueCmd::HandbackKeyed`].
        origin: Option<Origin>,
        msgs: Vec<Message>,
    },
    /// The first command of a re-formed epoch: where its history forked.
    Fork(super::epoch::ForkRecord),
    /// Put first in an entry by the master of a queue with limits (TTL,
    /// max length, dead-lettering): the master's clock and the limits in
    /// force for the rest of the entry. Every replica applies the same time
    /// and limits, so expiry and overflow stay deterministic. Expires what
    /// is due at `now_ms`.
    Stamp {
        now_ms: u64,
        limits: Limits,
    },
    /// Nothing by itself: an entry for its stamp to expire messages in when
    /// nothing else is happening on the queue.
    Expire,
    /// A publish of messages some of which carry their own TTL (the AMQP
    /// `expiration` property), in ms from the entry's stamp; built by
    /// [`QueueCmd::enqueue`].
    EnqueueExpiring {
        msgs: Vec<Message>,
        ttl_ms: Vec<Option<u64>>,
    },
    /// [`QueueCmd::Ack`] of deliveries to `owner` only. A tag the queue
    /// has given to another owner is unknown: a re-formed epoch, or a
    /// fork that yielded, numbers deliveries from its own counter, so a
    /// channel still holding a tag of the other epoch must not settle the
    /// message another consumer now holds under that number.
    AckOf {
        owner: u64,
        tags: Vec<u64>,
    },
    /// [`QueueCmd::Nack`] of deliveries to `owner` only (as `AckOf`).
    NackOf {
        owner: u64,
        tags: Vec<u64>,
        requeue: bool,
    },
    /// A consumer (number `consumer.number` of the channel `owner`) starts,
    /// on a single-active-consumer queue or with a priority. Registered in
    /// the log, so every replica knows which consumer is active and a new
    /// master goes on with the same one. Gone with `Cancel` or with its
    /// owner's `Release`.
    Consume {
        owner: u64,
        consumer: ConsumerRef,
        single_active: bool,
    },
    Cancel {
        owner: u64,
        number: u64,
    },
    /// As [`QueueCmd::Handback`], with a key of its own for each message
    /// (`keys[i]` for `msgs[i]`, where the sender knows it: its number and
    /// the epoch that gave it, `state::message_key`). A message is kept
    /// unless the batch's `origin` or its own key was handed back before:
    /// one replica of the old epoch may name a message by the entry that
    /// published it (its log has the entry), another by its number (its
    /// log was compacted, or it never applied that entry), a third by both.
    HandbackKeyed {
        origin: Option<Origin>,
        keys: Vec<Option<Origin>>,
        msgs: Vec<Message>,
    },
    /// A replica of another epoch rejoining this one tells what it still
    /// holds of the messages both epochs share: every other shared message
    /// was consumed (or dropped) on its side, so one still ready here is
    /// removed rather than delivered a second time. A split's consumers on
    /// the yielding side settle on the surviving one what they took.
    Merge(Holdings),
}

/// What a replica holds of the messages its epoch shares with another
/// (`queue::epoch::shared_numbers`): plain seqs below `below_seq`, and
/// tracked ones (handed back, prioritized) whose order part is below
/// `below_order`, were numbered alike on both sides, so the same seq names
/// the same message. `held`: half-open ranges of the seqs among those that
/// the replica still holds, ready or delivered and unacked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holdings {
    pub below_seq: u64,
    pub below_order: u64,
    pub held: Vec<(u64, u64)>,
}

/// A consumer as its gets name it: its number on its channel, and its
/// `x-priority`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConsumerRef {
    pub number: u64,
    pub priority: i32,
}

/// A registered consumer, as every replica keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    pub priority: i32,
    /// When it registered, among the queue's registrations.
    pub order: u64,
    pub single_active: bool,
}

/// What `x-overflow` does when a queue is at `x-max-length`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Overflow {
    /// Drop (and dead-letter) the oldest messages.
    #[default]
    DropHead,
    /// Refuse new publishes (the publisher gets a `basic.nack`).
    RejectPublish,
}

/// How a queue dead-letters (RabbitMQ's `dead-letter-strategy`).
///
/// Stored where a `bool` was (`false`: `Off`, `true`: `AtMostOnce`): the
/// encoding writes a unit variant as its index, one byte for each, so
/// entries written before `AtLeastOnce` existed read back the same.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeadLettering {
    /// No dead-letter exchange: removed messages are gone.
    #[default]
    Off,
    /// The master republishes what it removes; a master that fails
    /// between the two loses that dead letter.
    AtMostOnce,
    /// A dead-lettered message stays in the queue, held by the owner its
    /// reason names ([`DeathReason::owner`]), until the master has it
    /// confirmed by every queue the dead-letter exchange routes it to and
    /// settles it; a new master takes over what is still held.
    AtLeastOnce,
}

/// A queue's limits as its master applies them: from the queue's
/// arguments and its effective policy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limits {
    /// `x-message-ttl` in milliseconds.
    pub ttl_ms: Option<u64>,
    /// `x-max-length` in messages (ready ones, as RabbitMQ counts).
    pub max_len: Option<u64>,
    pub overflow: Overflow,
    /// Whether and how removed messages (expired, dropped, rejected) go
    /// to the dead-letter exchange.
    pub dead_letter: DeadLettering,
    /// `x-max-priority`: messages are served by their `priority` property,
    /// capped at this.
    pub max_priority: Option<u8>,
    /// `x-delivery-limit`: a message returned (requeued by a nack or a
    /// reject, or left unacked by a channel that closed) more times than
    /// this is dead-lettered, or dropped without a dead-letter exchange.
    pub delivery_limit: Option<u32>,
}

impl Limits {
    /// Does the queue need stamped entries at all?
    pub fn any(&self) -> bool {
        self.ttl_ms.is_some()
            || self.max_len.is_some()
            || self.dead_letter != DeadLettering::Off
            || self.max_priority.is_some()
            || self.delivery_limit.is_some()
    }
}

/// Why a message was dead-lettered (`x-death` `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeathReason {
    Expired,
    Maxlen,
    Rejected,
    /// Returned more times than the queue's `x-delivery-limit`.
    DeliveryLimit,
}

/// Owners of the messages held for at-least-once dead-lettering: one per
/// reason, just below 2^48, in the range of owners a library caller numbers
/// itself (`owners::is_tracked` is false for them), so no node is asked
/// about their life and no sweep gives their messages back.
const DEAD_LETTER_OWNERS: u64 = (1 << 48) - 16;

impl DeathReason {
    const ALL: [DeathReason; 4] =
        [DeathReason::Expired, DeathReason::Maxlen, DeathReason::Rejected, DeathReason::DeliveryLimit];

    /// The owner holding this reason's messages until they are
    /// dead-lettered ([`DeadLettering::AtLeastOnce`]).
    pub fn owner(self) -> u64 {
        DEAD_LETTER_OWNERS + Self::ALL.iter().position(|r| *r == self).expect("listed") as u64
    }

    /// The reason whose dead letters `owner` holds, if it is one of them.
    pub fn of_owner(owner: u64) -> Option<DeathReason> {
        let i = owner.checked_sub(DEAD_LETTER_OWNERS)?;
        Self::ALL.get(usize::try_from(i).ok()?).copied()
    }

    pub fn as_str(self) -> &'static str {
        match self {
            DeathReason::Expired => "expired",
            DeathReason::Maxlen => "maxlen",
            DeathReason::Rejected => "rejected",
            DeathReason::DeliveryLimit => "delivery_limit",
        }
    }
}

impl QueueCmd {
    /// A publish; messages with a TTL of their own need the master's stamp.
    pub fn enqueue(msgs: Vec<Message>, ttl_ms: Vec<Option<u64>>) -> Self {
        if ttl_ms.iter().all(Option::is_none) {
            QueueCmd::Enqueue { msgs }
        } else {
            QueueCmd::EnqueueExpiring { msgs, ttl_ms }
        }
    }

    /// The messages this command stores, if it is a publish or hand-back.
    pub fn messages(&self) -> Option<&[Message]> {
        match self {
            QueueCmd::Enqueue { msgs }
            | QueueCmd::EnqueueExpiring { msgs, .. }
            | QueueCmd::Handback { msgs, .. }
            | QueueCmd::HandbackKeyed { msgs, .. } => Some(msgs),
            _ => None,
        }
    }

    /// Does the master have to stamp the entry even without queue limits?
    pub fn needs_stamp(&self) -> bool {
        matches!(self, QueueCmd::EnqueueExpiring { .. } | QueueCmd::Expire)
    }

    /// Must the caller wait for every synchronised replica before answering?
    /// Only publishes carry that promise.
    pub fn needs_confirm(&self) -> bool {
        matches!(
            self,
            QueueCmd::Enqueue { .. }
                | QueueCmd::EnqueueExpiring { .. }
                | QueueCmd::Handback { .. }
                | QueueCmd::HandbackKeyed { .. }
        )
    }

    /// Is this a command whose effect a re-formed epoch must keep?
    pub fn publishes(&self) -> bool {
        self.needs_confirm() || matches!(self, QueueCmd::Stamp { .. })
    }
}

/// A delivered message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delivery {
    /// Queue-wide delivery tag, to ack or nack with.
    pub tag: u64,
    pub redelivered: bool,
    pub message: Message,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum QueueReply {
    Enqueued {
        count: u32,
    },
    /// `msgs` is filled by the state-machine adapter from disk.
    Got {
        msgs: Vec<Delivery>,
        remaining: u64,
    },
    Settled {
        count: u32,
        unknown: Vec<u64>,
    },
    Purged {
        count: u64,
    },
    Status {
        ready: u64,
        unacked: u64,
    },
    /// The reply to an entry's [`QueueCmd::Stamp`]: every message the
    /// entry removed for the dead-letter exchange (filled from disk by the
    /// state-machine adapter), for the master to republish.
    DeadLetters {
        msgs: Vec<(Message, DeathReason)>,
    },
}
