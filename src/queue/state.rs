//! The queue's deterministic state: a pure `apply` over an in-memory index.
//!
//! Message bodies are not held here. `apply` returns the [`Change`]s a command
//! makes, and the state-machine adapter (`queue::sm`) writes them to disk and
//! reads bodies back when it delivers.
//!
//! Never-delivered messages are always the contiguous range
//! `[ready_head, next_seq)` (publishes append, gets take from the front), so
//! they cost no memory and no per-message state on disk: only delivered
//! (unacked) and requeued messages are tracked one by one. A deep queue costs
//! two counters, and restarting it reads only its unacked and requeued
//! messages.
//!
//! A priority queue (`x-max-priority`) keeps its priority-0 messages in that
//! range too; a message of a higher priority is tracked one by one, under a
//! seq of the tracked space that carries its priority, and is served before
//! every priority-0 one.
//!
//! Every replica applies the same commands in the same order and so makes the
//! same choices (which message a get takes, which delivery tag it gets).

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use super::epoch::{Epoch, Inherited};

use super::types::{
    ConsumerRef, DeadLettering, DeathReason, Holdings, Limits, Message, MsgState, Origin, Overflow, QueueCmd,
    QueueReply, Registration,
};

/// Seqs of messages outside the never-delivered range (handed back, or of
/// a priority above 0) have this bit set. Below it: the message's priority
/// from [`PRIORITY_SHIFT`], and a number taken from the order counter
/// (`next_requeue`), which only grows and so gives each its place.
pub const HANDBACK_SEQ: u64 = 1 << 63;
/// Where a message goes back when it is requeued: its place when it was
/// first queued. A plain message's seq is its place (handed-back ones, whose
/// seqs are above every plain one, go after them); a prioritized one's is
/// the order number it was queued under, among those of its priority.
fn place_of(seq: u64) -> u64 {
    if priority_of_seq(seq) == 0 {
        seq
    } else {
        seq & ORDER_PART
    }
}

/// Where a tracked seq keeps its message's priority (8 bits).
const PRIORITY_SHIFT: u32 = 48;
/// The part of a tracked seq taken from the order counter.
pub const ORDER_PART: u64 = (1 << PRIORITY_SHIFT) - 1;

/// Where a new epoch's delivery tags start: from its epoch `(term, node)`,
/// which no other epoch of the group shares, `term << 40 | node << 32`.
/// An epoch's term is above every term its parent lineage had, so the
/// parent, still serving on the other side of a split, would have to
/// deliver 2^40 messages to reach it, and another epoch of the same term
/// was formed by another node, 2^32 apart. A channel holding a tag of one
/// epoch must not see another epoch give that tag to another message: its
/// ack would settle that one.
const FORK_TAG_TERM_SHIFT: u32 = 40;
const FORK_TAG_NODE_SHIFT: u32 = 32;

/// The first delivery tag of epoch `(term, node)` (see above).
fn epoch_tag_base(term: u64, node: u64) -> u64 {
    (term.min((1 << (64 - FORK_TAG_TERM_SHIFT)) - 1) << FORK_TAG_TERM_SHIFT) | (node & 0xff) << FORK_TAG_NODE_SHIFT
}

/// The priority a message's seq records (0 for a plain seq).
pub fn priority_of_seq(seq: u64) -> u8 {
    if seq & HANDBACK_SEQ == 0 {
        0
    } else {
        ((seq >> PRIORITY_SHIFT) & 0xff) as u8
    }
}

/// Marks a hand-back key that names a message by its number (see
/// [`message_key`]) rather than a log entry: no node id has this bit.
const NUMBERED: u64 = 1 << 62;

/// The epoch that gave message `seq` its number, for a replica in epoch
/// `ours` whose fork record's ancestry is `line` (nearest first). An epoch
/// numbers from the counters it inherited on: plain seqs from
/// `next_seq`, tracked ones (handed back, prioritized) by their order part
/// from `next_order`; below those bounds a number was given by the epoch
/// it was formed from, and so on up the line. Every replica of that epoch
/// holds the same message under that number (its committed entries gave
/// it), whatever later epoch it is in now.
pub fn numbered_in(ours: Epoch, line: &[Inherited], seq: u64) -> Epoch {
    let tracked = seq & HANDBACK_SEQ != 0;
    let below = |i: &Inherited| match tracked {
        false => seq < i.next_seq,
        true => seq & ORDER_PART < i.next_order,
    };
    // `line[k]` holds what `line[k].from` had when the epoch nearer to us
    // was formed from it: a number below it came from that one or earlier.
    let mut era = ours;
    for i in line {
        if !below(i) {
            break;
        }
        era = i.from;
    }
    era
}

/// The hand-back key of a stored message: its number and the epoch that
/// gave it ([`numbered_in`]), in the shape of an entry's [`Origin`] with
/// [`NUMBERED`] in the node. Two replicas handing back the same message,
/// whether their logs still hold the entry that published it or not, give
/// the same key, and the receiver keeps the first (`QueueCmd::Handback`).
pub fn message_key(era: Epoch, seq: u64) -> Origin {
    (era.term, era.node | NUMBERED, seq)
}

/// Half-open ranges of seqs, sorted and disjoint whatever order and
/// overlaps they came in.
struct Spans(Vec<(u64, u64)>);

/// Half-open ranges sorted and merged where they touch or overlap.
pub(crate) fn disjoint_spans(ranges: impl IntoIterator<Item = (u64, u64)>) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = ranges.into_iter().filter(|(a, b)| a < b).collect();
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (a, b) in v {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

impl Spans {
    fn new(ranges: &[(u64, u64)]) -> Self {
        Self(disjoint_spans(ranges.iter().copied()))
    }

    /// The span holding `seq`, if any.
    fn around(&self, seq: u64) -> Option<(u64, u64)> {
        let i = self.0.partition_point(|(a, _)| *a <= seq);
        self.0.get(i.checked_sub(1)?).copied().filter(|(_, b)| seq < *b)
    }

    fn contains(&self, seq: u64) -> bool {
        self.around(seq).is_some()
    }

    /// The highest seq in `[from, to)` outside every span.
    fn last_outside(&self, from: u64, to: u64) -> Option<u64> {
        let mut end = to;
        while end > from {
            match self.around(end - 1) {
                Some((a, _)) => end = a,
                None => return Some(end - 1),
            }
        }
        None
    }
}

/// Publish time of messages enqueued while the queue had no TTL: they
/// never expire.
pub const UNTIMED: u64 = u64::MAX;

/// One step of a command's effect on stored messages, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Store a new message (the body is the command's `msgs[index]`).
    Insert {
        seq: u64,
        batch_index: usize,
    },
    /// A message's state changed (delivered, requeued).
    SetState {
        seq: u64,
        state: MsgState,
    },
    /// Remove a message for good (acked, rejected, purged). `tracked`: it
    /// has a stored state (was delivered or requeued) to remove as well.
    Remove {
        seq: u64,
        tracked: bool,
    },
    /// The reply includes this message: read its body before a later
    /// `Remove` of the same seq takes effect.
    Deliver {
        seq: u64,
        tag: u64,
        redelivered: bool,
        /// Times it was returned before (RabbitMQ's `x-delivery-count`).
        returns: u32,
    },
    /// The message was returned (requeued) `count` times so far.
    Returned {
        seq: u64,
        count: u32,
    },
    /// The count of returns kept for `seq` is no longer needed.
    Unreturned {
        seq: u64,
    },
    /// Remember that the messages of this old-epoch entry were handed back.
    Handed {
        origin: Origin,
    },
    /// Messages from `seq` on were published at `at_ms` (master's clock).
    Stamped {
        seq: u64,
        at_ms: u64,
    },
    /// The publish time recorded at `seq` is no longer needed.
    Unstamped {
        seq: u64,
    },
    /// The message goes to the dead-letter exchange: read its body before
    /// the `Remove` that follows.
    DeadLetter {
        seq: u64,
        reason: DeathReason,
    },
    /// The message expires at `at_ms` by its own TTL.
    Deadline {
        seq: u64,
        at_ms: u64,
    },
    /// The deadline of a removed message is no longer needed.
    Undeadline {
        seq: u64,
    },
    /// Consumer `number` of channel `owner` registered.
    Registered {
        owner: u64,
        number: u64,
        registration: Registration,
    },
    Unregistered {
        owner: u64,
        number: u64,
    },
}

/// Counters that must survive restarts alongside the per-message states.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    /// First never-delivered message.
    pub ready_head: u64,
    pub next_seq: u64,
    /// The next delivery tag.
    pub next_tag: u64,
    /// Numbers tracked seqs (handed back, prioritized) in the order they
    /// were queued, and consumers in the order they registered.
    pub next_requeue: u64,
    /// Messages of the never-delivered range below this seq were in the
    /// queue when the group was re-formed on a replica that may not have
    /// seen every get the lost master made: they count as delivered
    /// before (`redelivered`).
    pub maybe_delivered_below: u64,
}

/// The message [`QueueState::take_head`] took.
struct Head {
    seq: u64,
    /// It was delivered before.
    redelivered: bool,
    /// It has a stored state to remove with it.
    tracked: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Unacked {
    seq: u64,
    owner: u64,
}

/// The in-memory index of a queue.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct QueueState {
    counters: Counters,
    /// Requeued messages of priority 0 by their places ([`place_of`]):
    /// served before the never-delivered ones, in the order they were first
    /// queued (as RabbitMQ puts requeued messages back where they were),
    /// and always redelivered.
    requeued: BTreeMap<u64, u64>,
    /// Ready messages of a priority above 0 (a priority queue's): highest
    /// priority first, then requeued (`false`) before never-delivered, then
    /// in order. Served before every priority-0 message.
    prioritized: BTreeMap<(Reverse<u8>, bool, u64), u64>,
    /// Delivered, awaiting ack: delivery tag -> message.
    unacked: HashMap<u64, Unacked>,
    /// Tags of `unacked` held for at-least-once dead-lettering (their
    /// owners are [`DeathReason::owner`]s): the master republishes them.
    dead: BTreeSet<u64>,
    /// Old-epoch entries whose messages were handed back already.
    handed: BTreeSet<Origin>,
    /// Publish times, for TTL: first seq of a run of messages -> when they
    /// were published ([`UNTIMED`]: before the queue had a TTL). One entry
    /// per Raft entry, kept only while a message of the run is held.
    times: BTreeMap<u64, u64>,
    /// Deadlines of held messages published with a TTL of their own.
    deadlines: BTreeMap<u64, u64>,
    /// How many times each held message that was ever returned (requeued
    /// by a nack or a reject, or by its channel's end) was returned: its
    /// `x-delivery-count`, checked against `x-delivery-limit`.
    returns: BTreeMap<u64, u32>,
    /// Registered consumers by (channel owner, number on the channel).
    consumers: BTreeMap<(u64, u64), Registration>,
    /// The current entry's stamp: the master's clock and the limits in
    /// force (none unless the entry starts with [`QueueCmd::Stamp`]).
    now_ms: u64,
    limits: Limits,
}

impl QueueState {
    /// Rebuild from the counters and the stored per-message states.
    pub fn restore(counters: Counters, stored: impl IntoIterator<Item = (u64, MsgState)>) -> Self {
        let mut s = Self { counters, ..Self::default() };
        for (seq, st) in stored {
            match st {
                // A message of priority 0 goes back by its place, whatever
                // was stored with it.
                MsgState::Requeued { order } => {
                    let order = if priority_of_seq(seq) == 0 { place_of(seq) } else { order };
                    s.ready_again(seq, order, false)
                }
                MsgState::Queued { order } => s.ready_again(seq, order, true),
                MsgState::Unacked { tag, owner } => {
                    s.unacked.insert(tag, Unacked { seq, owner });
                    if DeathReason::of_owner(owner).is_some() {
                        s.dead.insert(tag);
                    }
                }
            }
        }
        s
    }

    /// Add the remembered hand-back origins (after [`QueueState::restore`]).
    pub fn with_handed(mut self, handed: impl IntoIterator<Item = Origin>) -> Self {
        self.handed.extend(handed);
        self
    }

    pub fn handed(&self) -> &BTreeSet<Origin> {
        &self.handed
    }

    /// Add the stored publish times (after [`QueueState::restore`]).
    pub fn with_times(mut self, times: impl IntoIterator<Item = (u64, u64)>) -> Self {
        self.times.extend(times);
        self
    }

    pub fn times(&self) -> &BTreeMap<u64, u64> {
        &self.times
    }

    /// Add the stored per-message deadlines (after [`QueueState::restore`]).
    pub fn with_deadlines(mut self, deadlines: impl IntoIterator<Item = (u64, u64)>) -> Self {
        self.deadlines.extend(deadlines);
        self
    }

    pub fn deadlines(&self) -> &BTreeMap<u64, u64> {
        &self.deadlines
    }

    /// Add the stored counts of returns (after [`QueueState::restore`]).
    pub fn with_returns(mut self, returns: impl IntoIterator<Item = (u64, u32)>) -> Self {
        self.returns.extend(returns);
        self
    }

    pub fn returns(&self) -> &BTreeMap<u64, u32> {
        &self.returns
    }

    /// Add the stored consumer registrations (after [`QueueState::restore`]).
    pub fn with_consumers(mut self, consumers: impl IntoIterator<Item = ((u64, u64), Registration)>) -> Self {
        self.consumers.extend(consumers);
        self
    }

    pub fn consumers(&self) -> &BTreeMap<(u64, u64), Registration> {
        &self.consumers
    }

    /// Does any consumer take part in who is served (a registered one: of
    /// a priority, or of a single-active-consumer queue)?
    pub fn ranked(&self) -> bool {
        !self.consumers.is_empty()
    }

    /// On a single-active-consumer queue, the consumer served: the one of
    /// the highest priority, the earliest registered among those.
    pub fn active_consumer(&self) -> Option<(u64, u64)> {
        self.consumers
            .iter()
            .filter(|(_, r)| r.single_active)
            .min_by_key(|(_, r)| (Reverse(r.priority), r.order))
            .map(|(k, _)| *k)
    }

    /// When the message at the head expires by its own TTL, if it has one.
    pub fn head_deadline(&self) -> Option<u64> {
        self.head().and_then(|seq| self.deadlines.get(&seq).copied())
    }

    fn head(&self) -> Option<u64> {
        if let Some((_, seq)) = self.prioritized.first_key_value() {
            return Some(*seq);
        }
        match self.requeued.first_key_value() {
            Some((_, seq)) => Some(*seq),
            None if self.fresh_count() > 0 => Some(self.counters.ready_head),
            None => None,
        }
    }

    /// A new entry starts: no stamp until it brings one.
    pub fn begin_entry(&mut self) {
        self.now_ms = 0;
        self.limits = Limits::default();
    }

    /// When the message at the head of the queue was published, if the
    /// queue records times and the head is timed (for the expiry timer).
    pub fn head_published_at(&self) -> Option<u64> {
        self.head().and_then(|seq| self.time_of(seq)).filter(|t| *t != UNTIMED)
    }

    fn time_of(&self, seq: u64) -> Option<u64> {
        if seq & HANDBACK_SEQ != 0 {
            return None;
        }
        self.times.range(..=seq).next_back().map(|(_, t)| *t)
    }

    pub fn counters(&self) -> &Counters {
        &self.counters
    }
    pub fn ready_count(&self) -> u64 {
        self.fresh_count() + self.requeued.len() as u64 + self.prioritized.len() as u64
    }
    fn fresh_count(&self) -> u64 {
        self.counters.next_seq - self.counters.ready_head
    }
    /// Is `seq` a stored, never-delivered message?
    pub fn is_fresh(&self, seq: u64) -> bool {
        (self.counters.ready_head..self.counters.next_seq).contains(&seq)
    }
    /// Everyone holding unacked messages, with the tags each holds, and
    /// the owners of registered consumers (whose registrations a
    /// `Release` of a gone owner removes).
    pub fn held(&self) -> BTreeMap<u64, Vec<u64>> {
        let mut out: BTreeMap<u64, Vec<u64>> = self.consumers.keys().map(|(owner, _)| (*owner, Vec::new())).collect();
        for (tag, u) in &self.unacked {
            out.entry(u.owner).or_default().push(*tag);
        }
        out
    }
    /// Messages delivered and not yet acked (those held for dead-lettering
    /// are not: no consumer has them).
    pub fn unacked_count(&self) -> u64 {
        (self.unacked.len() - self.dead.len()) as u64
    }
    /// Messages held until the master has them dead-lettered.
    pub fn dead_letter_count(&self) -> u64 {
        self.dead.len() as u64
    }
    /// Up to `max` of the messages held for dead-lettering, from tag
    /// `from` on, oldest first: their tags, seqs and reasons.
    pub fn dead_letters(&self, from: u64, max: usize) -> Vec<(u64, u64, DeathReason)> {
        let of = |tag: &u64| {
            let u = self.unacked.get(tag)?;
            Some((*tag, u.seq, DeathReason::of_owner(u.owner)?))
        };
        self.dead.range(from..).filter_map(of).take(max).collect()
    }
    /// Take a delivery out of the unacked ones.
    fn take_unacked(&mut self, tag: u64) -> Option<Unacked> {
        self.dead.remove(&tag);
        self.unacked.remove(&tag)
    }
    /// Seqs of the messages tracked one by one: delivered, requeued and
    /// prioritized ones.
    pub fn tracked_seqs(&self) -> BTreeSet<u64> {
        self.requeued
            .values()
            .chain(self.prioritized.values())
            .copied()
            .chain(self.unacked.values().map(|u| u.seq))
            .collect()
    }
    /// The messages tracked one by one with their states, by seq.
    pub fn states(&self) -> Vec<(u64, MsgState)> {
        let requeued = self.requeued.iter().map(|(order, seq)| (*seq, MsgState::Requeued { order: *order }));
        let prioritized = self.prioritized.iter().map(|((_, fresh, order), seq)| {
            (*seq, if *fresh { MsgState::Queued { order: *order } } else { MsgState::Requeued { order: *order } })
        });
        let unacked = self.unacked.iter().map(|(tag, u)| (u.seq, MsgState::Unacked { tag: *tag, owner: u.owner }));
        let mut v: Vec<_> = requeued.chain(prioritized).chain(unacked).collect();
        v.sort_unstable_by_key(|(seq, _)| *seq);
        v
    }
    /// Is `seq` a message the queue still holds?
    pub fn holds(&self, seq: u64, tracked: &BTreeSet<u64>) -> bool {
        self.is_fresh(seq) || tracked.contains(&seq)
    }

    /// Apply one command. Pure: no I/O, same input, same output.
    pub fn apply(&mut self, cmd: &QueueCmd, changes: &mut Vec<Change>) -> QueueReply {
        match cmd {
            QueueCmd::Enqueue { msgs } => self.enqueue(msgs, None, changes),
            QueueCmd::EnqueueExpiring { msgs, ttl_ms } => self.enqueue(msgs, Some(ttl_ms), changes),
            QueueCmd::Get { owner, max, auto_ack, consumer } => self.get(*owner, *max, *auto_ack, *consumer, changes),
            QueueCmd::Ack { tags } => self.settle(tags, None, None, changes),
            QueueCmd::AckOf { owner, tags } => self.settle(tags, Some(*owner), None, changes),
            QueueCmd::Nack { tags, requeue } => self.settle(tags, None, Some(*requeue), changes),
            QueueCmd::NackOf { owner, tags, requeue } => self.settle(tags, Some(*owner), Some(*requeue), changes),
            QueueCmd::Release { owner } => self.release(*owner, changes),
            QueueCmd::Purge => {
                let count = self.ready_count();
                self.drop_ready(changes);
                QueueReply::Purged { count }
            }
            QueueCmd::Delete => self.delete(changes),
            QueueCmd::Status => QueueReply::Status { ready: self.ready_count(), unacked: self.unacked_count() },
            QueueCmd::Handback { origin, msgs } => self.handback(*origin, &vec![None; msgs.len()], changes),
            QueueCmd::HandbackKeyed { origin, keys, msgs } => {
                let keys: Vec<Option<Origin>> = (0..msgs.len()).map(|i| keys.get(i).copied().flatten()).collect();
                self.handback(*origin, &keys, changes)
            }
            QueueCmd::Fork(record) => self.fork(record.epoch.term, record.epoch.node, changes),
            QueueCmd::Merge(holdings) => self.merge(holdings, changes),
            QueueCmd::Stamp { now_ms, limits } => {
                self.now_ms = *now_ms;
                self.limits = *limits;
                self.expire_due(changes);
                self.forget_times(changes);
                QueueReply::DeadLetters { msgs: Vec::new() }
            }
            QueueCmd::Expire => QueueReply::Enqueued { count: 0 },
            QueueCmd::Consume { owner, consumer, single_active } => {
                self.consume(*owner, *consumer, *single_active, changes)
            }
            QueueCmd::Cancel { owner, number } => {
                if self.consumers.remove(&(*owner, *number)).is_some() {
                    changes.push(Change::Unregistered { owner: *owner, number: *number });
                }
                QueueReply::Enqueued { count: 0 }
            }
        }
    }

    /// Deliver up to `max` messages to `owner` (none to a consumer that is
    /// not the single active one).
    fn get(
        &mut self,
        owner: u64,
        max: u32,
        auto_ack: bool,
        consumer: Option<ConsumerRef>,
        changes: &mut Vec<Change>,
    ) -> QueueReply {
        if let Some(c) = consumer {
            if self.active_consumer().is_some_and(|active| active != (owner, c.number)) {
                return QueueReply::Got { msgs: Vec::new(), remaining: self.ready_count() };
            }
        }
        let mut delivered = 0u32;
        while delivered < max {
            let Some(Head { seq, redelivered, tracked }) = self.take_head() else { break };
            let tag = self.counters.next_tag;
            self.counters.next_tag += 1;
            let returns = self.returns.get(&seq).copied().unwrap_or(0);
            changes.push(Change::Deliver { seq, tag, redelivered, returns });
            if auto_ack {
                self.remove(seq, tracked, changes);
            } else {
                self.unacked.insert(tag, Unacked { seq, owner });
                changes.push(Change::SetState { seq, state: MsgState::Unacked { tag, owner } });
            }
            delivered += 1;
        }
        QueueReply::Got { msgs: Vec::new(), remaining: self.ready_count() }
    }

    /// Unregister `owner`'s consumers and requeue what it holds.
    fn release(&mut self, owner: u64, changes: &mut Vec<Change>) -> QueueReply {
        let theirs: Vec<(u64, u64)> = self.consumers.range((owner, 0)..=(owner, u64::MAX)).map(|(k, _)| *k).collect();
        for (owner, number) in theirs {
            self.consumers.remove(&(owner, number));
            changes.push(Change::Unregistered { owner, number });
        }
        // Tags ascend with delivery order, so requeue in that order.
        let mut tags: Vec<u64> = self.unacked.iter().filter(|(_, u)| u.owner == owner).map(|(t, _)| *t).collect();
        tags.sort_unstable();
        for tag in &tags {
            if let Some(u) = self.take_unacked(*tag) {
                self.settle_nack(u.seq, true, changes);
            }
        }
        QueueReply::Settled { count: tags.len() as u32, unknown: Vec::new() }
    }

    fn delete(&mut self, changes: &mut Vec<Change>) -> QueueReply {
        let count = self.ready_count();
        self.drop_ready(changes);
        self.dead.clear();
        let mut unacked: Vec<u64> = self.unacked.drain().map(|(_, u)| u.seq).collect();
        unacked.sort_unstable();
        for seq in unacked {
            self.remove(seq, true, changes);
        }
        QueueReply::Purged { count }
    }

    /// Take back `count` messages of an old epoch as requeued ones (none if
    /// those of `origin` were taken back already).
    /// Store handed-back messages (`keys[i]` is message `i`'s own key, if
    /// the sender knew it): none if the entry `origin` was handed back
    /// already, else those whose key was not. Every key is remembered,
    /// also of a batch whose entry was handed back already: that batch
    /// names, by number, messages stored under the entry's name, which a
    /// third replica may hand back by number alone.
    fn handback(&mut self, origin: Option<Origin>, keys: &[Option<Origin>], changes: &mut Vec<Change>) -> QueueReply {
        let fresh: Vec<usize> = match origin.is_some_and(|o| self.handed.contains(&o)) {
            true => Vec::new(),
            false => (0..keys.len()).filter(|i| keys[*i].is_none_or(|k| !self.handed.contains(&k))).collect(),
        };
        for k in origin.into_iter().chain(keys.iter().flatten().copied()) {
            if self.handed.insert(k) {
                changes.push(Change::Handed { origin: k });
            }
        }
        for &i in &fresh {
            // Outside the never-delivered range, which must stay
            // contiguous: a seq space of its own, unique by the order
            // it borrows.
            let seq = HANDBACK_SEQ | self.counters.next_requeue;
            self.counters.next_requeue += 1;
            changes.push(Change::Insert { seq, batch_index: i });
            let order = place_of(seq);
            self.requeued.insert(order, seq);
            changes.push(Change::SetState { seq, state: MsgState::Requeued { order } });
        }
        QueueReply::Enqueued { count: fresh.len() as u32 }
    }

    /// The group was re-formed on this replica's lineage by `node`, from a
    /// log that may lack gets the lost master made and answered: every
    /// message in the queue may have been delivered, so each comes back
    /// `redelivered`; and deliveries from now on take tags no other epoch
    /// of the group gives ([`epoch_tag_base`]).
    fn fork(&mut self, term: u64, node: u64, changes: &mut Vec<Change>) -> QueueReply {
        self.counters.maybe_delivered_below = self.counters.next_seq;
        let fresh: Vec<(Reverse<u8>, u64, u64)> = self
            .prioritized
            .iter()
            .filter(|((_, fresh, _), _)| *fresh)
            .map(|((p, _, o), seq)| (*p, *o, *seq))
            .collect();
        for (p, order, seq) in fresh {
            self.prioritized.remove(&(p, true, order));
            self.prioritized.insert((p, false, order), seq);
            changes.push(Change::SetState { seq, state: MsgState::Requeued { order } });
        }
        self.counters.next_tag = self.counters.next_tag.max(epoch_tag_base(term, node));
        QueueReply::Enqueued { count: 0 }
    }

    /// Remove the messages another epoch's replica shares with us and no
    /// longer holds (see [`QueueCmd::Merge`]): ready ones, and delivered
    /// ones too. A consumer's acks may have gone to that side (its channel
    /// sent them to whichever master it could reach): the channel forgot
    /// those tags once they landed there, so here they would wait for an
    /// ack that never comes and go back as stranded. A consumer here that
    /// still holds one and acks it finds its tag unknown: it was consumed
    /// there. A never-delivered message that replica holds but that lies
    /// behind one removed goes back as requeued: it was delivered there,
    /// and the never-delivered range stays contiguous.
    fn merge(&mut self, h: &Holdings, changes: &mut Vec<Change>) -> QueueReply {
        let held = Spans::new(&h.held);
        let gone = |seq: u64| {
            let shared = match seq & HANDBACK_SEQ {
                0 => seq < h.below_seq,
                _ => seq & ORDER_PART < h.below_order,
            };
            shared && !held.contains(seq)
        };
        let mut count = 0u64;
        let requeued: Vec<(u64, u64)> =
            self.requeued.iter().filter(|(_, seq)| gone(**seq)).map(|(o, seq)| (*o, *seq)).collect();
        for (order, seq) in requeued {
            self.requeued.remove(&order);
            self.remove(seq, true, changes);
            count += 1;
        }
        let prioritized: Vec<_> =
            self.prioritized.iter().filter(|(_, seq)| gone(**seq)).map(|(k, seq)| (*k, *seq)).collect();
        for (key, seq) in prioritized {
            self.prioritized.remove(&key);
            self.remove(seq, true, changes);
            count += 1;
        }
        let mut unacked: Vec<(u64, u64)> =
            self.unacked.iter().filter(|(_, u)| gone(u.seq)).map(|(tag, u)| (*tag, u.seq)).collect();
        unacked.sort_unstable();
        for (tag, seq) in unacked {
            self.take_unacked(tag);
            self.remove(seq, true, changes);
            count += 1;
        }
        let head = self.counters.ready_head;
        if let Some(last) = held.last_outside(head, self.counters.next_seq.min(h.below_seq)) {
            for seq in head..=last {
                if held.contains(seq) {
                    let order = place_of(seq);
                    self.requeued.insert(order, seq);
                    changes.push(Change::SetState { seq, state: MsgState::Requeued { order } });
                } else {
                    self.remove(seq, false, changes);
                    count += 1;
                }
            }
            self.counters.ready_head = last + 1;
        }
        QueueReply::Purged { count }
    }

    /// Register a consumer (once: a repeated consume keeps its place).
    fn consume(
        &mut self,
        owner: u64,
        consumer: ConsumerRef,
        single_active: bool,
        changes: &mut Vec<Change>,
    ) -> QueueReply {
        if !self.consumers.contains_key(&(owner, consumer.number)) {
            let order = self.counters.next_requeue;
            self.counters.next_requeue += 1;
            let registration = Registration { priority: consumer.priority, order, single_active };
            self.consumers.insert((owner, consumer.number), registration);
            changes.push(Change::Registered { owner, number: consumer.number, registration });
        }
        QueueReply::Enqueued { count: 0 }
    }

    /// Store new messages (`ttl_ms`: their own TTLs, if any) under the
    /// entry's limits.
    fn enqueue(&mut self, msgs: &[Message], ttl_ms: Option<&[Option<u64>]>, changes: &mut Vec<Change>) -> QueueReply {
        self.stamp_run(changes);
        let mut accepted = 0;
        for (i, m) in msgs.iter().enumerate() {
            if self.limits.overflow == Overflow::RejectPublish
                && self.limits.max_len.is_some_and(|max| self.ready_count() + self.dead_letter_count() >= max)
            {
                // Full: the rest of this publish is refused (nacked).
                break;
            }
            let own_ttl = ttl_ms.and_then(|t| t.get(i).copied().flatten());
            let priority = match self.limits.max_priority {
                Some(max) => crate::message::priority(&m.properties).min(max),
                None => 0,
            };
            let seq = if priority == 0 {
                let seq = self.counters.next_seq;
                self.counters.next_seq += 1;
                changes.push(Change::Insert { seq, batch_index: i });
                seq
            } else {
                let order = self.counters.next_requeue;
                self.counters.next_requeue += 1;
                let seq = HANDBACK_SEQ | u64::from(priority) << PRIORITY_SHIFT | order;
                changes.push(Change::Insert { seq, batch_index: i });
                self.prioritized.insert((Reverse(priority), true, order), seq);
                changes.push(Change::SetState { seq, state: MsgState::Queued { order } });
                seq
            };
            // Outside the plain range a message has no run time: the
            // queue's TTL becomes a deadline of its own.
            let queue_ttl = if priority == 0 { None } else { self.limits.ttl_ms };
            let due = [own_ttl, queue_ttl].into_iter().flatten().min();
            if let Some(ttl) = due {
                let at_ms = self.now_ms.saturating_add(ttl);
                self.deadlines.insert(seq, at_ms);
                changes.push(Change::Deadline { seq, at_ms });
            }
            accepted += 1;
        }
        if let (Some(max), Overflow::DropHead) = (self.limits.max_len, self.limits.overflow) {
            while self.ready_count() > max {
                if !self.drop_head(DeathReason::Maxlen, changes) {
                    break;
                }
            }
        }
        QueueReply::Enqueued { count: accepted }
    }

    /// Remove a message for good, with its deadline if it had one.
    fn remove(&mut self, seq: u64, tracked: bool, changes: &mut Vec<Change>) {
        changes.push(Change::Remove { seq, tracked });
        if self.deadlines.remove(&seq).is_some() {
            changes.push(Change::Undeadline { seq });
        }
        if self.returns.remove(&seq).is_some() {
            changes.push(Change::Unreturned { seq });
        }
    }

    /// Record the publish time of the messages an enqueue is about to add:
    /// the stamp's clock with a TTL, [`UNTIMED`] without one (only needed
    /// once times are being kept at all).
    fn stamp_run(&mut self, changes: &mut Vec<Change>) {
        let at_ms = if self.limits.ttl_ms.is_some() { self.now_ms } else { UNTIMED };
        if at_ms == UNTIMED && self.times.last_key_value().is_none_or(|(_, t)| *t == UNTIMED) {
            return;
        }
        let seq = self.counters.next_seq;
        if self.times.last_key_value().is_some_and(|(_, t)| *t == at_ms) {
            return;
        }
        self.times.insert(seq, at_ms);
        changes.push(Change::Stamped { seq, at_ms });
    }

    /// Remove messages at the head whose TTL has run out, as RabbitMQ
    /// expires them: from the head only, oldest first.
    fn expire_due(&mut self, changes: &mut Vec<Change>) {
        while let Some(due) = self.head_due() {
            if due > self.now_ms || !self.drop_head(DeathReason::Expired, changes) {
                break;
            }
        }
    }

    /// When the head message expires: the sooner of the queue's TTL (from
    /// its publish time) and its own.
    fn head_due(&self) -> Option<u64> {
        let by_queue = self.limits.ttl_ms.and_then(|ttl| self.head_published_at().map(|at| at.saturating_add(ttl)));
        match (by_queue, self.head_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Take the message at the head out of the ready ones: a prioritized
    /// one first, then a requeued one, else the oldest never-delivered one.
    fn take_head(&mut self) -> Option<Head> {
        if let Some(((_, fresh, _), seq)) = self.prioritized.pop_first() {
            Some(Head { seq, redelivered: !fresh, tracked: true })
        } else if let Some((_, seq)) = self.requeued.pop_first() {
            Some(Head { seq, redelivered: true, tracked: true })
        } else if self.fresh_count() > 0 {
            let seq = self.counters.ready_head;
            self.counters.ready_head += 1;
            Some(Head { seq, redelivered: seq < self.counters.maybe_delivered_below, tracked: false })
        } else {
            None
        }
    }

    /// A message ready again under `order`: a prioritized one by its
    /// priority, a priority-0 one with the requeued.
    fn ready_again(&mut self, seq: u64, order: u64, fresh: bool) {
        match priority_of_seq(seq) {
            0 => {
                self.requeued.insert(order, seq);
            }
            p => {
                self.prioritized.insert((Reverse(p), fresh, order), seq);
            }
        }
    }

    /// Remove the message at the head (requeued ones first, as they are
    /// served first). `false` if the queue has no ready message.
    fn drop_head(&mut self, reason: DeathReason, changes: &mut Vec<Change>) -> bool {
        let Some(Head { seq, tracked, .. }) = self.take_head() else { return false };
        self.dead_letter(seq, tracked, reason, changes);
        true
    }

    /// Drop publish times no held message needs any more: every run
    /// before the one holding the oldest message still held.
    fn forget_times(&mut self, changes: &mut Vec<Change>) {
        if self.times.len() < 2 && self.ready_count() + self.unacked_count() > 0 {
            return;
        }
        let plain = |seq: &u64| *seq & HANDBACK_SEQ == 0;
        let oldest = [self.fresh_count().gt(&0).then_some(self.counters.ready_head)]
            .into_iter()
            .flatten()
            .chain(self.requeued.values().copied().filter(plain))
            .chain(self.unacked.values().map(|u| u.seq).filter(plain))
            .min();
        let keep_from = match oldest {
            Some(seq) => self.times.range(..=seq).next_back().map_or(0, |(k, _)| *k),
            None => u64::MAX,
        };
        let old: Vec<u64> = self.times.range(..keep_from).map(|(k, _)| *k).collect();
        for seq in old {
            self.times.remove(&seq);
            changes.push(Change::Unstamped { seq });
        }
    }

    fn drop_ready(&mut self, changes: &mut Vec<Change>) {
        for (_, seq) in std::mem::take(&mut self.prioritized) {
            self.remove(seq, true, changes);
        }
        for (_, seq) in std::mem::take(&mut self.requeued) {
            self.remove(seq, true, changes);
        }
        for seq in self.counters.ready_head..self.counters.next_seq {
            self.remove(seq, false, changes);
        }
        self.counters.ready_head = self.counters.next_seq;
    }

    /// Ack (`nack` `None`) or nack the deliveries `tags`, of `owner` only
    /// if one is named; the others are unknown.
    fn settle(
        &mut self,
        tags: &[u64],
        owner: Option<u64>,
        nack: Option<bool>,
        changes: &mut Vec<Change>,
    ) -> QueueReply {
        let mut unknown = Vec::new();
        for tag in tags {
            let theirs = self.unacked.get(tag).is_some_and(|u| owner.is_none_or(|o| u.owner == o));
            match theirs.then(|| self.take_unacked(*tag)).flatten() {
                Some(u) => match nack {
                    None => self.remove(u.seq, true, changes),
                    Some(requeue) => self.settle_nack(u.seq, requeue, changes),
                },
                None => unknown.push(*tag),
            }
        }
        QueueReply::Settled { count: (tags.len() - unknown.len()) as u32, unknown }
    }

    fn settle_nack(&mut self, seq: u64, requeue: bool, changes: &mut Vec<Change>) {
        if requeue {
            let returns = self.returns.get(&seq).copied().unwrap_or(0).saturating_add(1);
            if self.limits.delivery_limit.is_some_and(|limit| returns > limit) {
                // A poison message: not served again.
                self.dead_letter(seq, true, DeathReason::DeliveryLimit, changes);
                return;
            }
            self.returns.insert(seq, returns);
            changes.push(Change::Returned { seq, count: returns });
            let order = place_of(seq);
            self.ready_again(seq, order, false);
            changes.push(Change::SetState { seq, state: MsgState::Requeued { order } });
        } else {
            self.dead_letter(seq, true, DeathReason::Rejected, changes);
        }
    }

    /// A message leaves the queue's ready or unacked ones for `reason`:
    /// removed, and handed to the master's republishing or held for it.
    fn dead_letter(&mut self, seq: u64, tracked: bool, reason: DeathReason, changes: &mut Vec<Change>) {
        match self.limits.dead_letter {
            DeadLettering::Off => self.remove(seq, tracked, changes),
            DeadLettering::AtMostOnce => {
                changes.push(Change::DeadLetter { seq, reason });
                self.remove(seq, tracked, changes);
            }
            DeadLettering::AtLeastOnce => {
                let (tag, owner) = (self.counters.next_tag, reason.owner());
                self.counters.next_tag += 1;
                self.unacked.insert(tag, Unacked { seq, owner });
                self.dead.insert(tag);
                changes.push(Change::SetState { seq, state: MsgState::Unacked { tag, owner } });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::types::Message;

    fn msg(body: &str) -> Message {
        Message {
            exchange: String::new(),
            routing_key: "q".into(),
            properties: Vec::new(),
            body: body.as_bytes().to_vec(),
        }
    }

    fn enqueue(s: &mut QueueState, n: usize) -> Vec<Change> {
        let mut c = Vec::new();
        s.apply(&QueueCmd::Enqueue { msgs: (0..n).map(|i| msg(&i.to_string())).collect() }, &mut c);
        c
    }

    fn get(s: &mut QueueState, owner: u64, max: u32, auto_ack: bool) -> (Vec<(u64, u64, bool)>, Vec<Change>) {
        let mut c = Vec::new();
        s.apply(&QueueCmd::Get { owner, max, auto_ack, consumer: None }, &mut c);
        let d = c
            .iter()
            .filter_map(|ch| match ch {
                Change::Deliver { seq, tag, redelivered, .. } => Some((*seq, *tag, *redelivered)),
                _ => None,
            })
            .collect();
        (d, c)
    }

    /// Replicas of one old epoch name a handed-back message by the entry
    /// that published it, by its number, or both: it is stored once
    /// whichever comes first.
    #[test]
    fn a_handed_back_message_is_kept_once_whether_named_by_its_entry_or_its_number() {
        let keyed = |origin, keys: Vec<Option<Origin>>, bodies: &[&str]| QueueCmd::HandbackKeyed {
            origin,
            keys,
            msgs: bodies.iter().map(|b| msg(b)).collect(),
        };
        let stored = |r: QueueReply| match r {
            QueueReply::Enqueued { count } => count,
            other => panic!("{other:?}"),
        };
        let entry = Some((3, 1, 40));
        let (k1, k2, k3) = (Some((2, 1 << 62, 7)), Some((2, 1 << 62, 8)), Some((2, 1 << 62, 9)));
        // By entry alone first (a replica that never applied it), then by
        // both (one whose log has it), then by number alone (one restored
        // from a snapshot): the later ones add nothing.
        let mut s = QueueState::default();
        let mut c = Vec::new();
        assert_eq!(stored(s.apply(&keyed(entry, vec![None, None], &["m1", "m2"]), &mut c)), 2);
        assert_eq!(stored(s.apply(&keyed(entry, vec![k1, k2], &["m1", "m2"]), &mut c)), 0);
        assert_eq!(stored(s.apply(&keyed(None, vec![k1], &["m1"]), &mut c)), 0);
        // A batch naming one known and one new message keeps the new one.
        c.clear();
        assert_eq!(stored(s.apply(&keyed(None, vec![k2, k3], &["m2", "m3"]), &mut c)), 1);
        assert!(c.iter().any(|ch| matches!(ch, Change::Insert { batch_index: 1, .. })), "m3 is the one stored: {c:?}");
        // Both first, then by number alone.
        let mut s = QueueState::default();
        assert_eq!(stored(s.apply(&keyed(entry, vec![k1, k2], &["m1", "m2"]), &mut c)), 2);
        assert_eq!(stored(s.apply(&keyed(None, vec![k2], &["m2"]), &mut c)), 0);
        assert_eq!(stored(s.apply(&keyed(entry, vec![None, None], &["m1", "m2"]), &mut c)), 0);
        assert_eq!(s.ready_count(), 2);
    }

    /// One side of a split consumed some of the messages both sides
    /// inherited; when it rejoins the other, what it holds of them tells
    /// the other which to drop.
    #[test]
    fn a_merge_drops_the_shared_messages_the_other_side_no_longer_holds() {
        let merge = |s: &mut QueueState, below_seq, below_order, held: Vec<(u64, u64)>| {
            let mut c = Vec::new();
            let r = s.apply(&QueueCmd::Merge(Holdings { below_seq, below_order, held }), &mut c);
            (r, c)
        };
        // Ten shared messages (0..10), two more of this side's own (10, 11).
        let mut s = QueueState::default();
        enqueue(&mut s, 12);
        // Here: 0 and 2 delivered and unacked; 1 taken and requeued.
        let (d, _) = get(&mut s, 7, 3, false);
        let mut c = Vec::new();
        s.apply(&QueueCmd::Nack { tags: vec![d[1].1], requeue: true }, &mut c);
        // There: 0..2 consumed, 2 delivered (held, unacked), 3..5 and 6
        // consumed, 5 held, 7..10 never delivered.
        let (r, c) = merge(&mut s, 10, 0, vec![(2, 3), (5, 6), (7, 10)]);
        assert_eq!(r, QueueReply::Purged { count: 5 }, "0, 1, 3, 4 and 6: {c:?}");
        // A delivery held here that was consumed there is settled: its
        // consumer's ack may have landed there. One held on both sides
        // stays with its consumer here.
        assert!(c.contains(&Change::Remove { seq: 0, tracked: true }), "{c:?}");
        assert_eq!(s.unacked_count(), 1);
        let mut c2 = Vec::new();
        let r = s.apply(&QueueCmd::Ack { tags: vec![d[0].1, d[2].1] }, &mut c2);
        assert_eq!(r, QueueReply::Settled { count: 1, unknown: vec![d[0].1] });
        assert!(c.contains(&Change::Remove { seq: 1, tracked: true }), "{c:?}");
        assert!(c.contains(&Change::Remove { seq: 6, tracked: false }), "{c:?}");
        // 5 was delivered there: it comes first, redelivered; then the
        // rest in order, this side's own ones untouched.
        let (d, _) = get(&mut s, 8, 10, true);
        let got: Vec<(u64, bool)> = d.iter().map(|(seq, _, r)| (*seq, *r)).collect();
        assert_eq!(got, vec![(5, true), (7, false), (8, false), (9, false), (10, false), (11, false)]);

        // Nothing shared: nothing removed, whatever the holdings say.
        let mut s = QueueState::default();
        enqueue(&mut s, 3);
        assert_eq!(merge(&mut s, 0, 0, Vec::new()).0, QueueReply::Purged { count: 0 });
        assert_eq!(s.ready_count(), 3);
        // Unsorted, overlapping ranges mean the same as their union.
        assert_eq!(merge(&mut s, 3, 0, vec![(2, 3), (0, 1), (0, 1)]).0, QueueReply::Purged { count: 1 });
        let (d, _) = get(&mut s, 8, 10, true);
        // 0, behind the removed 1, goes back as requeued.
        assert_eq!(d.iter().map(|(seq, _, r)| (*seq, *r)).collect::<Vec<_>>(), vec![(0, true), (2, false)]);

        // Tracked messages (handed back here before) are shared by their
        // order part.
        let mut s = QueueState::default();
        let mut c = Vec::new();
        s.apply(&QueueCmd::Handback { origin: None, msgs: vec![msg("h0"), msg("h1"), msg("h2")] }, &mut c);
        let h = |order: u64| HANDBACK_SEQ | order;
        // The other side holds h1; h2 was handed back after the split.
        let (r, _) = merge(&mut s, 0, 2, vec![(h(1), h(2))]);
        assert_eq!(r, QueueReply::Purged { count: 1 });
        let (d, _) = get(&mut s, 8, 10, true);
        assert_eq!(d.iter().map(|(seq, ..)| *seq).collect::<Vec<_>>(), vec![h(1), h(2)]);
    }

    #[test]
    fn a_message_is_keyed_by_the_epoch_that_numbered_it_alike_on_siblings() {
        let e = |term, node| Epoch { term, node };
        let fork = |from, next_seq, next_order| Inherited { from, next_seq, next_order };
        let (root, parent) = (e(0, 0), e(15, 3));
        // Two siblings formed from `parent` at the same point, which was
        // formed from `root` when root had numbered 1,000 plain messages
        // and 40 tracked ones.
        let (a, b) = (e(16, 2), e(16, 3));
        let line = [fork(parent, 5_000, 60), fork(root, 1_000, 40)];
        let tracked = |order: u64| HANDBACK_SEQ | order;
        for (seq, era) in [(999, root), (1_000, parent), (4_999, parent), (tracked(39), root), (tracked(59), parent)] {
            assert_eq!(numbered_in(a, &line, seq), era, "seq {seq:#x}");
            assert_eq!(message_key(numbered_in(a, &line, seq), seq), message_key(numbered_in(b, &line, seq), seq));
        }
        // What each sibling numbered itself is its own: the same number
        // names different messages there.
        assert_eq!(numbered_in(a, &line, 5_000), a);
        assert_ne!(message_key(numbered_in(a, &line, 5_000), 5_000), message_key(numbered_in(b, &line, 5_000), 5_000));
        assert_eq!(numbered_in(b, &line, tracked(60)), b);
        // A priority in a tracked seq does not move it to another epoch.
        assert_eq!(numbered_in(a, &line, tracked(59) | 3 << 48), parent);
        // No record: everything is the epoch's own (it holds it all).
        assert_eq!(numbered_in(a, &[], 7), a);
        // Never an entry's origin: no node id has the bit.
        let (_, node, _) = message_key(root, 7);
        assert_ne!(node, 0);
    }

    #[test]
    fn enqueue_assigns_increasing_seqs_and_counts() {
        let mut s = QueueState::default();
        let c = enqueue(&mut s, 3);
        assert_eq!(
            c,
            vec![
                Change::Insert { seq: 0, batch_index: 0 },
                Change::Insert { seq: 1, batch_index: 1 },
                Change::Insert { seq: 2, batch_index: 2 }
            ]
        );
        assert_eq!(s.ready_count(), 3);
        assert_eq!(s.unacked_count(), 0);
    }

    #[test]
    fn get_is_fifo_with_unique_tags_and_tracks_unacked() {
        let mut s = QueueState::default();
        enqueue(&mut s, 3);
        let (d, _) = get(&mut s, 7, 2, false);
        assert_eq!(d, vec![(0, 0, false), (1, 1, false)]);
        assert_eq!((s.ready_count(), s.unacked_count()), (1, 2));
        let (d, _) = get(&mut s, 7, 5, false);
        assert_eq!(d, vec![(2, 2, false)]);
        let (d, _) = get(&mut s, 7, 5, false);
        assert!(d.is_empty());
    }

    #[test]
    fn auto_ack_get_removes_after_delivering() {
        let mut s = QueueState::default();
        enqueue(&mut s, 1);
        let (_, c) = get(&mut s, 1, 1, true);
        assert_eq!(
            c,
            vec![
                Change::Deliver { seq: 0, tag: 0, redelivered: false, returns: 0 },
                Change::Remove { seq: 0, tracked: false }
            ]
        );
        assert_eq!((s.ready_count(), s.unacked_count()), (0, 0));
    }

    #[test]
    fn ack_removes_and_reports_unknown_tags() {
        let mut s = QueueState::default();
        enqueue(&mut s, 2);
        get(&mut s, 1, 2, false);
        let mut c = Vec::new();
        let r = s.apply(&QueueCmd::Ack { tags: vec![1, 99] }, &mut c);
        assert_eq!(r, QueueReply::Settled { count: 1, unknown: vec![99] });
        assert_eq!(c, vec![Change::Remove { seq: 1, tracked: true }]);
        // acking twice is an unknown tag, not a second removal
        let r = s.apply(&QueueCmd::Ack { tags: vec![1] }, &mut c);
        assert_eq!(r, QueueReply::Settled { count: 0, unknown: vec![1] });
        assert_eq!(s.unacked_count(), 1);
    }

    #[test]
    fn an_owner_settles_only_its_own_deliveries() {
        let mut s = QueueState::default();
        enqueue(&mut s, 3);
        get(&mut s, 1, 1, false); // tag 0 to owner 1
        get(&mut s, 2, 2, false); // tags 1, 2 to owner 2
        let mut c = Vec::new();
        let r = s.apply(&QueueCmd::AckOf { owner: 1, tags: vec![0, 1] }, &mut c);
        assert_eq!(r, QueueReply::Settled { count: 1, unknown: vec![1] });
        let r = s.apply(&QueueCmd::NackOf { owner: 1, tags: vec![2], requeue: true }, &mut c);
        assert_eq!(r, QueueReply::Settled { count: 0, unknown: vec![2] });
        // Owner 2's deliveries are untouched, and its own settle works.
        assert_eq!(s.unacked_count(), 2);
        let r = s.apply(&QueueCmd::NackOf { owner: 2, tags: vec![2, 1], requeue: true }, &mut c);
        assert_eq!(r, QueueReply::Settled { count: 2, unknown: vec![] });
        assert_eq!((s.ready_count(), s.unacked_count()), (2, 0));
    }

    #[test]
    fn requeued_messages_come_back_first_marked_redelivered() {
        let mut s = QueueState::default();
        enqueue(&mut s, 4);
        get(&mut s, 1, 2, false); // seq 0 tag 0, seq 1 tag 1
        let mut c = Vec::new();
        s.apply(&QueueCmd::Nack { tags: vec![1, 0], requeue: true }, &mut c);
        assert_eq!(s.ready_count(), 4);
        let (d, _) = get(&mut s, 1, 4, false);
        // back in their places whatever the nack's order, before
        // never-delivered ones
        assert_eq!(d, vec![(0, 2, true), (1, 3, true), (2, 4, false), (3, 5, false)]);
    }

    #[test]
    fn requeued_messages_go_back_to_their_places_whenever_they_come_back() {
        let mut s = QueueState::default();
        enqueue(&mut s, 5);
        get(&mut s, 1, 5, false); // seqs 0..5, tags 0..5
        let mut c = Vec::new();
        s.apply(&QueueCmd::Nack { tags: vec![3, 4], requeue: true }, &mut c);
        s.apply(&QueueCmd::Release { owner: 1 }, &mut c);
        let (d, _) = get(&mut s, 2, 5, false);
        let seqs: Vec<u64> = d.iter().map(|x| x.0).collect();
        assert_eq!(seqs, [0, 1, 2, 3, 4], "the later requeue does not put 0-2 behind 3 and 4");
    }

    #[test]
    fn nack_without_requeue_drops() {
        let mut s = QueueState::default();
        enqueue(&mut s, 1);
        get(&mut s, 1, 1, false);
        let mut c = Vec::new();
        s.apply(&QueueCmd::Nack { tags: vec![0], requeue: false }, &mut c);
        assert_eq!(c, vec![Change::Remove { seq: 0, tracked: true }]);
        assert_eq!((s.ready_count(), s.unacked_count()), (0, 0));
    }

    /// Each return (a nack with requeue, a channel's end) counts: the
    /// next delivery carries the count (`x-delivery-count`), and past the
    /// queue's `x-delivery-limit` the message is dead-lettered, or dropped
    /// without a dead-letter exchange, and its count forgotten.
    #[test]
    fn returns_are_counted_and_a_message_returned_past_the_limit_is_dead_lettered() {
        let limits = Limits { delivery_limit: Some(2), dead_letter: DeadLettering::AtMostOnce, ..Limits::default() };
        let mut s = QueueState::default();
        enqueue(&mut s, 2);
        let returns_of = |c: &[Change]| {
            c.iter()
                .find_map(|ch| match ch {
                    Change::Deliver { seq: 0, returns, .. } => Some(*returns),
                    _ => None,
                })
                .expect("message 0 delivered")
        };
        for round in 0..3u32 {
            let (d, c) = get(&mut s, 1, 1, false);
            assert_eq!(returns_of(&c), round, "delivery {round} carries the returns before it");
            stamp(&mut s, 1_000, limits);
            let mut c = Vec::new();
            if round == 1 {
                // A channel's end counts as a return too.
                s.apply(&QueueCmd::Release { owner: 1 }, &mut c);
            } else {
                s.apply(&QueueCmd::Nack { tags: vec![d[0].1], requeue: true }, &mut c);
            }
            if round < 2 {
                assert!(c.contains(&Change::Returned { seq: 0, count: round + 1 }), "{c:?}");
                assert_eq!(s.returns().get(&0), Some(&(round + 1)));
            } else {
                assert_eq!(dead(&c), vec![(0, DeathReason::DeliveryLimit)], "the third return is past the limit");
                assert!(c.contains(&Change::Remove { seq: 0, tracked: true }));
                assert!(c.contains(&Change::Unreturned { seq: 0 }));
                assert!(s.returns().is_empty());
            }
        }
        assert_eq!((s.ready_count(), s.unacked_count()), (1, 0), "message 1 is untouched");
        // Without a dead-letter exchange the message is dropped; without a
        // limit it comes back however often it returns.
        let mut s = QueueState::default();
        enqueue(&mut s, 1);
        let no_dlx = Limits { delivery_limit: Some(0), ..Limits::default() };
        let (d, _) = get(&mut s, 1, 1, false);
        stamp(&mut s, 1_000, no_dlx);
        let mut c = Vec::new();
        s.apply(&QueueCmd::Nack { tags: vec![d[0].1], requeue: true }, &mut c);
        assert!(dead(&c).is_empty() && c.contains(&Change::Remove { seq: 0, tracked: true }), "{c:?}");
        let mut s = QueueState::default();
        enqueue(&mut s, 1);
        for _ in 0..50 {
            let (d, _) = get(&mut s, 1, 1, false);
            s.begin_entry();
            s.apply(&QueueCmd::Nack { tags: vec![d[0].1], requeue: true }, &mut Vec::new());
        }
        assert_eq!((s.ready_count(), s.returns().get(&0)), (1, Some(&50)));
        // An ack forgets the count.
        let (d, _) = get(&mut s, 1, 1, false);
        let mut c = Vec::new();
        s.apply(&QueueCmd::Ack { tags: vec![d[0].1] }, &mut c);
        assert!(c.contains(&Change::Unreturned { seq: 0 }) && s.returns().is_empty());
    }

    #[test]
    fn release_requeues_only_that_owners_messages() {
        let mut s = QueueState::default();
        enqueue(&mut s, 3);
        get(&mut s, 1, 1, false);
        get(&mut s, 2, 1, false);
        get(&mut s, 1, 1, false);
        let mut c = Vec::new();
        let r = s.apply(&QueueCmd::Release { owner: 1 }, &mut c);
        assert_eq!(r, QueueReply::Settled { count: 2, unknown: vec![] });
        assert_eq!((s.ready_count(), s.unacked_count()), (2, 1));
        let (d, _) = get(&mut s, 3, 5, false);
        assert_eq!(d.iter().map(|x| (x.0, x.2)).collect::<Vec<_>>(), vec![(0, true), (2, true)]);
    }

    #[test]
    fn purge_drops_ready_but_keeps_unacked() {
        let mut s = QueueState::default();
        enqueue(&mut s, 3);
        get(&mut s, 1, 1, false);
        let mut c = Vec::new();
        let r = s.apply(&QueueCmd::Purge, &mut c);
        assert_eq!(r, QueueReply::Purged { count: 2 });
        assert_eq!(c, vec![Change::Remove { seq: 1, tracked: false }, Change::Remove { seq: 2, tracked: false }]);
        assert_eq!((s.ready_count(), s.unacked_count()), (0, 1));
    }

    #[test]
    fn deep_queue_index_is_two_counters() {
        let mut s = QueueState::default();
        let mut c = Vec::new();
        s.apply(&QueueCmd::Enqueue { msgs: vec![msg("x"); 1000] }, &mut c);
        get(&mut s, 1, 10, true);
        assert_eq!(s.ready_count(), 990);
        assert!(s.unacked.is_empty() && s.requeued.is_empty());
        assert_eq!((s.counters().ready_head, s.counters().next_seq), (10, 1000));
        assert!(s.is_fresh(10) && !s.is_fresh(9) && !s.is_fresh(1000));
    }

    #[test]
    fn handed_back_messages_come_first_redelivered_and_leave_the_fresh_range_alone() {
        let mut s = QueueState::default();
        enqueue(&mut s, 2);
        let mut c = Vec::new();
        let origin = Some((4, 1, 17));
        s.apply(&QueueCmd::Handback { origin, msgs: vec![msg("old")] }, &mut c);
        let seq = HANDBACK_SEQ;
        assert_eq!(
            c,
            vec![
                Change::Handed { origin: (4, 1, 17) },
                Change::Insert { seq, batch_index: 0 },
                Change::SetState { seq, state: MsgState::Requeued { order: seq } }
            ]
        );
        // A second replica handing back the same entry adds nothing.
        let mut c2 = Vec::new();
        let r = s.apply(&QueueCmd::Handback { origin, msgs: vec![msg("old")] }, &mut c2);
        assert_eq!((r, c2), (QueueReply::Enqueued { count: 0 }, vec![]));
        assert_eq!(s.ready_count(), 3);
        assert!(!s.is_fresh(seq));
        let (d, _) = get(&mut s, 1, 3, false);
        assert_eq!(d, vec![(seq, 0, true), (0, 1, false), (1, 2, false)]);
    }

    fn fork(s: &mut QueueState, node: u64) -> Vec<Change> {
        fork_at(s, 5, node)
    }

    fn fork_at(s: &mut QueueState, term: u64, node: u64) -> Vec<Change> {
        let record =
            crate::queue::epoch::ForkRecord { epoch: crate::queue::epoch::Epoch { term, node }, ..Default::default() };
        let mut c = Vec::new();
        s.apply(&QueueCmd::Fork(record), &mut c);
        c
    }

    #[test]
    fn a_fork_gives_tags_its_parent_never_gives_so_a_stale_ack_settles_nothing() {
        let mut parent = QueueState::default();
        enqueue(&mut parent, 3);
        // The re-forming replica never applied the get below.
        let mut forked = parent.clone();
        let (d, _) = get(&mut parent, 7, 1, false);
        let (x_seq, x_tag, _) = d[0];
        fork(&mut forked, 3);
        let (d, _) = get(&mut forked, 7, 1, false);
        let (y_seq, y_tag, _) = d[0];
        assert_eq!(y_seq, x_seq, "the same message, delivered again in the new epoch");
        assert_ne!(y_tag, x_tag, "the new epoch gave a tag its parent gave");
        // The channel acks what the old epoch delivered under x_tag: in the
        // new epoch that names nothing, and the delivery y stays unacked.
        let mut c = Vec::new();
        let r = forked.apply(&QueueCmd::AckOf { owner: 7, tags: vec![x_tag] }, &mut c);
        assert_eq!(r, QueueReply::Settled { count: 0, unknown: vec![x_tag] });
        assert_eq!(forked.unacked_count(), 1);
        // Two nodes forking from the same point number apart too.
        let mut other = parent.clone();
        fork(&mut other, 2);
        let mut third = parent.clone();
        fork(&mut third, 4);
        let (a, _) = get(&mut other, 7, 1, false);
        let (b, _) = get(&mut third, 7, 1, false);
        assert_ne!(a[0].1, b[0].1);
        // Cousins: node 1 forks and node 4 forks that; node 2 forks and
        // node 3 forks that. Each epoch numbers apart, whatever the path.
        let (mut one, mut two) = (parent.clone(), parent.clone());
        fork_at(&mut one, 6, 1);
        fork_at(&mut two, 6, 2);
        fork_at(&mut one, 8, 4);
        fork_at(&mut two, 8, 3);
        let (a, _) = get(&mut one, 7, 1, false);
        let (b, _) = get(&mut two, 7, 1, false);
        assert_ne!(a[0].1, b[0].1, "two cousin epochs gave the same tag");
    }

    #[test]
    fn after_a_fork_every_message_in_the_queue_comes_back_redelivered() {
        let mut s = QueueState::default();
        let seqs = publish_prioritized(&mut s, 5, &[None, Some(3), None]);
        let c = fork(&mut s, 2);
        let prioritized = seqs.iter().find(|(_, i)| **i == 1).map(|(seq, _)| *seq).unwrap();
        assert!(
            c.iter().any(
                |ch| matches!(ch, Change::SetState { seq, state: MsgState::Requeued { .. } } if *seq == prioritized)
            ),
            "the prioritized message's flag is stored: {c:?}"
        );
        // Published after the fork: never delivered.
        s.apply(&QueueCmd::Enqueue { msgs: vec![msg("new")] }, &mut Vec::new());
        let (d, _) = get(&mut s, 1, 10, false);
        let flags: Vec<bool> = d.iter().map(|(_, _, redelivered)| *redelivered).collect();
        assert_eq!(flags, vec![true, true, true, false]);
        // A restart keeps it.
        let mut again = QueueState::default();
        let seqs = publish_prioritized(&mut again, 5, &[None, Some(3)]);
        let _ = seqs;
        fork(&mut again, 2);
        let mut c = Vec::new();
        let states: Vec<(u64, MsgState)> = again
            .prioritized
            .iter()
            .map(|((_, fresh, order), seq)| {
                (*seq, if *fresh { MsgState::Queued { order: *order } } else { MsgState::Requeued { order: *order } })
            })
            .collect();
        let mut restored = QueueState::restore(again.counters().clone(), states);
        restored.apply(&QueueCmd::Get { owner: 1, max: 10, auto_ack: true, consumer: None }, &mut c);
        assert!(c.iter().all(|ch| !matches!(ch, Change::Deliver { redelivered: false, .. })), "{c:?}");
    }

    #[test]
    fn delete_drops_everything() {
        let mut s = QueueState::default();
        enqueue(&mut s, 3);
        get(&mut s, 1, 1, false);
        let mut c = Vec::new();
        s.apply(&QueueCmd::Delete, &mut c);
        assert_eq!(c.len(), 3);
        assert_eq!((s.ready_count(), s.unacked_count()), (0, 0));
    }

    #[test]
    fn restore_rebuilds_the_same_state() {
        let mut s = QueueState::default();
        enqueue(&mut s, 5);
        get(&mut s, 1, 3, false);
        let mut c = Vec::new();
        s.apply(&QueueCmd::Nack { tags: vec![2, 0], requeue: true }, &mut c);
        // only delivered and requeued messages have a stored state
        let mut disk: BTreeMap<u64, MsgState> = BTreeMap::new();
        disk.insert(1, MsgState::Unacked { tag: 1, owner: 1 });
        disk.insert(2, MsgState::Requeued { order: 2 });
        disk.insert(0, MsgState::Requeued { order: 0 });
        let restored = QueueState::restore(s.counters().clone(), disk).with_returns([(0, 1), (2, 1)]);
        assert_eq!(restored, s);
    }

    fn with_priority(body: &str, priority: Option<u8>) -> Message {
        let props = amq_protocol::protocol::basic::AMQPProperties::default();
        let props = match priority {
            Some(p) => props.with_priority(p),
            None => props,
        };
        Message { properties: crate::message::encode_properties(&props), ..msg(body) }
    }

    /// The bodies' indexes (as enqueued by `publish_prioritized`) in the
    /// order gets take them.
    fn order_of(s: &mut QueueState, bodies: &BTreeMap<u64, usize>) -> Vec<usize> {
        let (d, _) = get(s, 1, 100, true);
        d.iter().map(|(seq, _, _)| bodies[seq]).collect()
    }

    /// Publishes messages of these priorities in one stamped entry, and
    /// tells which seq each got.
    fn publish_prioritized(s: &mut QueueState, max: u8, priorities: &[Option<u8>]) -> BTreeMap<u64, usize> {
        stamp(s, 1_000, Limits { max_priority: Some(max), ..Limits::default() });
        let msgs: Vec<Message> =
            priorities.iter().enumerate().map(|(i, p)| with_priority(&i.to_string(), *p)).collect();
        let mut c = Vec::new();
        s.apply(&QueueCmd::Enqueue { msgs }, &mut c);
        c.iter()
            .filter_map(|ch| match ch {
                Change::Insert { seq, batch_index } => Some((*seq, *batch_index)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_priority_queue_serves_the_highest_priority_first_capped_at_its_maximum() {
        let mut s = QueueState::default();
        let p = [None, Some(3), Some(1), Some(9), Some(0), Some(3), Some(200)];
        let seqs = publish_prioritized(&mut s, 5, &p);
        assert_eq!(s.ready_count(), 7);
        // 9 and 200 are both capped at 5, then kept in publish order.
        assert_eq!(order_of(&mut s, &seqs), vec![3, 6, 1, 5, 2, 0, 4]);
        assert_eq!(s.ready_count(), 0);
        assert!(s.tracked_seqs().is_empty(), "auto-acked prioritized messages leave no state");
        // Without the stamp's maximum, priorities are not looked at.
        let mut plain = QueueState::default();
        let mut c = Vec::new();
        plain.apply(&QueueCmd::Enqueue { msgs: vec![with_priority("a", None), with_priority("b", Some(7))] }, &mut c);
        assert!(c.iter().all(|ch| matches!(ch, Change::Insert { seq, .. } if *seq & HANDBACK_SEQ == 0)));
    }

    #[test]
    fn a_requeued_prioritized_message_goes_back_by_its_priority_and_a_restart_keeps_the_order() {
        let mut s = QueueState::default();
        let seqs = publish_prioritized(&mut s, 10, &[Some(2), Some(7), None, Some(7), Some(2)]);
        let (d, _) = get(&mut s, 1, 1, false);
        assert_eq!(seqs[&d[0].0], 1, "the first priority-7 message");
        let mut c = Vec::new();
        s.apply(&QueueCmd::Nack { tags: vec![d[0].1], requeue: true }, &mut c);
        // Stored states as the adapter writes them, read back by a restart.
        let disk = s.states();
        assert_eq!(disk.len(), 4, "prioritized messages are tracked, the priority-0 one is not");
        let mut restored = QueueState::restore(s.counters().clone(), disk);
        let (d, _) = get(&mut restored, 1, 1, false);
        assert!(d[0].2, "the requeued one comes back first among its priority, redelivered");
        assert_eq!(seqs[&d[0].0], 1);
        assert_eq!(order_of(&mut restored, &seqs), vec![3, 0, 4, 2]);
        assert_eq!(order_of(&mut s, &seqs), vec![1, 3, 0, 4, 2], "the same order without the restart");
    }

    #[test]
    fn prioritized_messages_expire_by_the_queues_ttl_and_are_purged() {
        let mut s = QueueState::default();
        stamp(
            &mut s,
            1_000,
            Limits {
                max_priority: Some(5),
                ttl_ms: Some(100),
                dead_letter: DeadLettering::AtMostOnce,
                ..Limits::default()
            },
        );
        let mut c = Vec::new();
        s.apply(&QueueCmd::Enqueue { msgs: vec![with_priority("hi", Some(4)), with_priority("lo", None)] }, &mut c);
        let c = stamp(
            &mut s,
            1_050,
            Limits {
                max_priority: Some(5),
                ttl_ms: Some(100),
                dead_letter: DeadLettering::AtMostOnce,
                ..Limits::default()
            },
        );
        assert!(dead(&c).is_empty());
        let c = stamp(
            &mut s,
            1_100,
            Limits {
                max_priority: Some(5),
                ttl_ms: Some(100),
                dead_letter: DeadLettering::AtMostOnce,
                ..Limits::default()
            },
        );
        assert_eq!(dead(&c).len(), 2, "both due at 1,100: the prioritized one by its deadline");
        assert_eq!(s.ready_count(), 0);
        publish_prioritized(&mut s, 5, &[Some(1), None, Some(3)]);
        let mut c = Vec::new();
        assert_eq!(s.apply(&QueueCmd::Purge, &mut c), QueueReply::Purged { count: 3 });
        assert!(s.tracked_seqs().is_empty() && s.deadlines().is_empty());
        assert_eq!(c.iter().filter(|ch| matches!(ch, Change::Remove { tracked: true, .. })).count(), 2);
    }

    fn stamp(s: &mut QueueState, now_ms: u64, limits: Limits) -> Vec<Change> {
        let mut c = Vec::new();
        s.begin_entry();
        s.apply(&QueueCmd::Stamp { now_ms, limits }, &mut c);
        c
    }

    fn dead(c: &[Change]) -> Vec<(u64, DeathReason)> {
        c.iter()
            .filter_map(|ch| match ch {
                Change::DeadLetter { seq, reason } => Some((*seq, *reason)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn ttl_expires_from_the_head_at_the_stamped_time() {
        let ttl = Limits { ttl_ms: Some(100), dead_letter: DeadLettering::AtMostOnce, ..Limits::default() };
        let mut s = QueueState::default();
        stamp(&mut s, 1_000, ttl);
        enqueue(&mut s, 2); // published at 1000
        stamp(&mut s, 1_050, ttl);
        enqueue(&mut s, 1); // published at 1050
        assert_eq!(s.head_published_at(), Some(1_000));
        assert!(dead(&stamp(&mut s, 1_099, ttl)).is_empty(), "not due yet");
        let c = stamp(&mut s, 1_100, ttl);
        assert_eq!(dead(&c), vec![(0, DeathReason::Expired), (1, DeathReason::Expired)]);
        assert!(c.contains(&Change::Remove { seq: 1, tracked: false }));
        assert_eq!(s.ready_count(), 1);
        assert_eq!(s.head_published_at(), Some(1_050));
        // The run of the expired messages is forgotten, the live one kept.
        assert_eq!(s.times().keys().copied().collect::<Vec<_>>(), vec![2]);
        let c = stamp(&mut s, 1_150, ttl);
        assert_eq!(dead(&c), vec![(2, DeathReason::Expired)]);
        assert!(c.contains(&Change::Unstamped { seq: 2 }), "{c:?}");
        assert!(s.times().is_empty());
    }

    #[test]
    fn unacked_messages_never_expire_and_requeued_ones_keep_their_time() {
        let ttl = Limits { ttl_ms: Some(100), ..Limits::default() };
        let mut s = QueueState::default();
        stamp(&mut s, 1_000, ttl);
        enqueue(&mut s, 1);
        stamp(&mut s, 1_090, ttl);
        enqueue(&mut s, 1);
        get(&mut s, 7, 1, false); // seq 0 unacked
        assert!(dead(&stamp(&mut s, 5_000, Limits { dead_letter: DeadLettering::AtMostOnce, ..ttl }))
            .contains(&(1, DeathReason::Expired)));
        assert_eq!(s.unacked_count(), 1, "delivered messages do not expire");
        let mut c = Vec::new();
        s.apply(&QueueCmd::Nack { tags: vec![0], requeue: true }, &mut c);
        // Requeued, it is at the head with its original publish time.
        assert_eq!(s.head_published_at(), Some(1_000));
        let c = stamp(&mut s, 5_001, ttl);
        assert!(c.contains(&Change::Remove { seq: 0, tracked: true }));
        assert!(dead(&c).is_empty(), "no dead-lettering without a dead-letter exchange");
        assert_eq!(s.ready_count(), 0);
    }

    #[test]
    fn messages_published_before_a_ttl_never_expire() {
        let mut s = QueueState::default();
        enqueue(&mut s, 1);
        let ttl = Limits { ttl_ms: Some(10), ..Limits::default() };
        stamp(&mut s, 1_000, ttl);
        enqueue(&mut s, 1);
        stamp(&mut s, 9_000, Limits::default());
        enqueue(&mut s, 1);
        assert_eq!(s.times().values().copied().collect::<Vec<_>>(), vec![1_000, UNTIMED]);
        assert_eq!(s.head_published_at(), None, "the head has no time");
        stamp(&mut s, 9_000, ttl);
        assert_eq!(s.ready_count(), 3, "expiry stops at an untimed head");
    }

    #[test]
    fn max_length_drops_the_head_or_refuses_publishes() {
        let drop = Limits { max_len: Some(2), dead_letter: DeadLettering::AtMostOnce, ..Limits::default() };
        let mut s = QueueState::default();
        stamp(&mut s, 0, drop);
        let mut c = Vec::new();
        let r = s.apply(&QueueCmd::Enqueue { msgs: (0..3).map(|i| msg(&i.to_string())).collect() }, &mut c);
        assert_eq!(r, QueueReply::Enqueued { count: 3 });
        assert_eq!(dead(&c), vec![(0, DeathReason::Maxlen)]);
        assert_eq!((s.ready_count(), s.counters().ready_head), (2, 1));

        let reject = Limits { max_len: Some(2), overflow: Overflow::RejectPublish, ..Limits::default() };
        let mut s = QueueState::default();
        stamp(&mut s, 0, reject);
        let mut c = Vec::new();
        let r = s.apply(&QueueCmd::Enqueue { msgs: (0..3).map(|i| msg(&i.to_string())).collect() }, &mut c);
        assert_eq!(r, QueueReply::Enqueued { count: 2 });
        let r = s.apply(&QueueCmd::Enqueue { msgs: vec![msg("x")] }, &mut c);
        assert_eq!(r, QueueReply::Enqueued { count: 0 });
        assert_eq!(s.ready_count(), 2);
        // Unacked messages do not count against the limit.
        get(&mut s, 1, 1, false);
        let r = s.apply(&QueueCmd::Enqueue { msgs: vec![msg("y")] }, &mut c);
        assert_eq!(r, QueueReply::Enqueued { count: 1 });
        // A later entry without a stamp has no limit.
        s.begin_entry();
        let r = s.apply(&QueueCmd::Enqueue { msgs: vec![msg("z")] }, &mut c);
        assert_eq!(r, QueueReply::Enqueued { count: 1 });
    }

    #[test]
    fn rejected_messages_are_dead_lettered_only_with_an_exchange() {
        let mut s = QueueState::default();
        enqueue(&mut s, 2);
        get(&mut s, 1, 2, false);
        let c = stamp(&mut s, 0, Limits { dead_letter: DeadLettering::AtMostOnce, ..Limits::default() });
        assert!(dead(&c).is_empty());
        let mut c = Vec::new();
        s.apply(&QueueCmd::Nack { tags: vec![0], requeue: false }, &mut c);
        assert_eq!(
            c,
            vec![
                Change::DeadLetter { seq: 0, reason: DeathReason::Rejected },
                Change::Remove { seq: 0, tracked: true }
            ]
        );
        s.begin_entry();
        let mut c = Vec::new();
        s.apply(&QueueCmd::Nack { tags: vec![1], requeue: false }, &mut c);
        assert_eq!(c, vec![Change::Remove { seq: 1, tracked: true }]);
    }

    #[test]
    fn at_least_once_dead_letters_stay_held_until_settled_by_their_reasons_owner() {
        let mut s = QueueState::default();
        enqueue(&mut s, 3);
        get(&mut s, 1, 2, false);
        let once = Limits {
            dead_letter: DeadLettering::AtLeastOnce,
            max_len: Some(2),
            overflow: Overflow::RejectPublish,
            ..Limits::default()
        };
        stamp(&mut s, 0, once);
        let mut c = Vec::new();
        s.apply(&QueueCmd::NackOf { owner: 1, tags: vec![0], requeue: false }, &mut c);
        let owner = DeathReason::Rejected.owner();
        // Held, not removed: its body stays until it is dead-lettered.
        assert_eq!(c, vec![Change::SetState { seq: 0, state: MsgState::Unacked { tag: 2, owner } }]);
        assert_eq!((s.ready_count(), s.unacked_count(), s.dead_letter_count()), (1, 1, 1));
        assert_eq!(s.dead_letters(0, 10), vec![(2, 0, DeathReason::Rejected)]);
        assert_eq!(s.dead_letters(3, 10), vec![]);
        // It counts against the maximum length: the queue is full.
        let mut c = Vec::new();
        assert_eq!(s.apply(&QueueCmd::Enqueue { msgs: vec![msg("x")] }, &mut c), QueueReply::Enqueued { count: 0 });
        // A restart rebuilds it as held.
        let restored = QueueState::restore(s.counters().clone(), s.states());
        assert_eq!(restored.dead_letters(0, 10), s.dead_letters(0, 10));
        // No consumer settles it, only its reason's owner.
        s.begin_entry();
        let mut c = Vec::new();
        s.apply(&QueueCmd::AckOf { owner: 1, tags: vec![2] }, &mut c);
        assert_eq!(s.dead_letter_count(), 1);
        s.apply(&QueueCmd::AckOf { owner, tags: vec![2] }, &mut c);
        assert_eq!(c, vec![Change::Remove { seq: 0, tracked: true }]);
        assert_eq!((s.dead_letter_count(), s.unacked_count()), (0, 1));
        assert_eq!(DeathReason::of_owner(owner), Some(DeathReason::Rejected));
        assert_eq!(DeathReason::of_owner(1), None);
    }

    #[test]
    fn dead_lettering_reads_back_from_entries_that_stored_a_flag() {
        for (flag, how) in [(false, DeadLettering::Off), (true, DeadLettering::AtMostOnce)] {
            let bytes = mirrorq_storage::keys::encode(&flag, "flag").unwrap();
            assert_eq!(mirrorq_storage::keys::decode::<DeadLettering>(&bytes, "how").unwrap(), how);
        }
    }

    #[test]
    fn messages_with_their_own_ttl_expire_at_the_head_only() {
        let mut s = QueueState::default();
        let mut c = Vec::new();
        s.begin_entry();
        s.apply(
            &QueueCmd::Stamp {
                now_ms: 1_000,
                limits: Limits { dead_letter: DeadLettering::AtMostOnce, ..Limits::default() },
            },
            &mut c,
        );
        let r =
            s.apply(&QueueCmd::enqueue(vec![msg("a"), msg("b"), msg("c")], vec![Some(500), None, Some(10)]), &mut c);
        assert_eq!(r, QueueReply::Enqueued { count: 3 });
        assert!(c.contains(&Change::Deadline { seq: 0, at_ms: 1_500 }));
        assert!(c.contains(&Change::Deadline { seq: 2, at_ms: 1_010 }));
        assert_eq!(s.head_deadline(), Some(1_500));
        // "c" is due at 1010 but not at the head: it waits, as in RabbitMQ.
        assert!(dead(&stamp(&mut s, 1_100, Limits::default())).is_empty());
        let c = stamp(&mut s, 1_500, Limits::default());
        assert_eq!(dead(&c), vec![], "no dead-lettering without an exchange in the stamp");
        assert!(c.contains(&Change::Undeadline { seq: 0 }));
        assert_eq!(s.ready_count(), 2, "b has no TTL and now heads the queue");
        let (d, _) = get(&mut s, 1, 1, true);
        assert_eq!(d, vec![(1, 0, false)]);
        let c = stamp(&mut s, 1_600, Limits { dead_letter: DeadLettering::AtMostOnce, ..Limits::default() });
        assert_eq!(dead(&c), vec![(2, DeathReason::Expired)]);
        assert!(s.deadlines().is_empty());
        // A message acked before its deadline leaves no deadline behind.
        let mut c = Vec::new();
        s.begin_entry();
        s.apply(&QueueCmd::Stamp { now_ms: 2_000, limits: Limits::default() }, &mut c);
        s.apply(&QueueCmd::enqueue(vec![msg("d")], vec![Some(1)]), &mut c);
        get(&mut s, 1, 1, false);
        let mut c = Vec::new();
        s.apply(&QueueCmd::Ack { tags: vec![1] }, &mut c);
        assert_eq!(c, vec![Change::Remove { seq: 3, tracked: true }, Change::Undeadline { seq: 3 }]);
        assert!(s.deadlines().is_empty());
    }
}
