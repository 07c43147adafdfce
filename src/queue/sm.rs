//! The queue state machine on disk: [`QueueState`] plus message bodies and
//! states in the group's key space.
//!
//! Its keys in the group's space are laid out in `keys.rs`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Range;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use mirrorq_storage::{keys, Batch, SmSpace, StorageError};

use super::bodies::{self, Chunk, ChunkWriter, LogRef};
use super::catchup::{missing_ranges, Plan};
use super::epoch::ForkRecord;
use super::keys::{
    consumer_key, counts_of_returns, deadline_key, handed_key, handed_origin, returns_key, state_key, stored_consumers,
    stored_times, time_key, Registered, COUNTERS, FORK, PLAN,
};
use super::runs::Runs;
use super::state::{Change, Counters, QueueState, HANDBACK_SEQ, ORDER_PART};
use super::types::{DeathReason, Delivery, Holdings, Message, MsgState, Origin, QueueCmd, QueueReply};
use crate::raft::state_machine::{Machine, SNAPSHOT_EVERY};

/// Bytes of bodies a queue leaves in the log at most; past it, the oldest
/// are copied into chunks as entries are applied. 64 MiB made 4 KiB x 1000
/// faster (1.07x quorum's msg/s against 0.79x), but an idle queue's backlog
/// is copied at once when its log is compacted, and the sled sync after it
/// held every queue's confirms on the node (the next case of the side by
/// side, 10 queues, ran at 16k msg/s instead of 27-29k).
const MAX_IN_LOG_BYTES: u64 = 16 << 20;

/// Bytes of held bodies a snapshot may copy at once. Bodies a consumer is
/// about to take (a prefetch of 1,000 4 KiB messages is 4 MB) are left in
/// the log until then: copying them as the bound fell to nothing wrote
/// every body published in the last stretch before a snapshot twice, 2.0
/// MB of extra disk writes per 1,000 4 KiB messages where a 4 MiB floor
/// leaves 0.9, and the sled flush of each snapshot slowed the log syncs of
/// every node after it (p95 69-81 -> 44-47 ms, `benches/results/HISTORY.md`).
const SNAPSHOT_COPY_BYTES: u64 = 4 << 20;

/// A snapshot copies what is left in the log at once, holding the queue's
/// applies meanwhile (all of a 4 KiB x 1000 run's backlog made 3-5 s of
/// it). So over the second half of the entries between two snapshots the
/// bound falls to [`SNAPSHOT_COPY_BYTES`], and the oldest bodies are copied
/// a little with each entry instead; past a snapshot's due point (it is
/// late) everything held is copied as entries come.
fn in_log_allowed(since_snapshot: u64) -> u64 {
    if since_snapshot >= SNAPSHOT_EVERY {
        return 0;
    }
    let half = SNAPSHOT_EVERY / 2;
    let left = (SNAPSHOT_EVERY - since_snapshot).min(half);
    (MAX_IN_LOG_BYTES / half * left).max(SNAPSHOT_COPY_BYTES)
}

/// Message bodies by seq, encoded as stored.
pub type EncodedBodies = Vec<(u64, Vec<u8>)>;

/// Counts published after every apply, for the API and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QueueStats {
    pub ready: u64,
    pub unacked: u64,
    /// Publish time (ms) of the message at the head, if the queue keeps
    /// times: the master's expiry timer waits for it plus the TTL.
    pub head_published_at: Option<u64>,
    /// When the head message expires by its own TTL, if it has one.
    pub head_deadline: Option<u64>,
    /// Messages published, delivered (gets included) and acked since this
    /// replica's machine was made: every replica applies the same
    /// commands, so a new master's counts go on where they stood. Kept in
    /// memory only (a restart begins again from the entries it replays).
    pub flow: Flow,
    /// Messages held until the master has them dead-lettered
    /// (`dead-letter-strategy: at-least-once`).
    pub dead_letters: u64,
    /// The consumer served, on a single-active-consumer queue.
    pub active_consumer: Option<(u64, u64)>,
    /// Consumers are registered (priorities, single active): the master
    /// ranks consumers' gets (`queue::ranking`).
    pub ranked: bool,
}

/// What a queue's `message_stats` counts (RabbitMQ's `publish`,
/// `deliver_get`, `ack`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Flow {
    pub published: u64,
    pub delivered: u64,
    pub acked: u64,
}

impl Flow {
    /// Count what one applied command did: its reply says how many it
    /// stored or acked, its changes how many it delivered (on a mirror too,
    /// which reads no bodies but makes the same changes).
    fn count(&mut self, cmd: &QueueCmd, reply: &QueueReply, changes: &[Change]) {
        match (cmd, reply) {
            (QueueCmd::Enqueue { .. } | QueueCmd::EnqueueExpiring { .. }, QueueReply::Enqueued { count }) => {
                self.published += u64::from(*count);
            }
            // A dead letter's settling is no consumer's ack.
            (QueueCmd::AckOf { owner, .. }, _) if DeathReason::of_owner(*owner).is_some() => {}
            (QueueCmd::Ack { .. } | QueueCmd::AckOf { .. }, QueueReply::Settled { count, .. }) => {
                self.acked += u64::from(*count);
            }
            (QueueCmd::Get { .. }, _) => {
                self.delivered += changes.iter().filter(|c| matches!(c, Change::Deliver { .. })).count() as u64;
            }
            _ => {}
        }
    }
}

impl QueueStats {
    fn of(state: &QueueState) -> Self {
        Self {
            ready: state.ready_count(),
            unacked: state.unacked_count(),
            head_published_at: state.head_published_at(),
            head_deadline: state.head_deadline(),
            dead_letters: state.dead_letter_count(),
            flow: Flow::default(),
            active_consumer: state.active_consumer(),
            ranked: state.ranked(),
        }
    }
}

pub struct QueueMachine {
    state: QueueState,
    stats: watch::Sender<QueueStats>,
    /// Bodies still to fetch; `None` when the replica has every body.
    plan: watch::Sender<Option<Plan>>,
    /// Seqs of the delivered and requeued messages (the state's, ordered
    /// by seq): with the never-delivered range, what keeps a chunk alive.
    tracked: BTreeSet<u64>,
    /// Where delivered messages are recorded on disk.
    runs: Runs,
    /// Bodies still only in the log, by first seq (as the `R` keys).
    refs: BTreeMap<u64, LogRef>,
    /// Their bytes.
    in_log: u64,
    /// Index of the entry applied last, and of the last one before a
    /// snapshot (since this process started: the first entry applied).
    applied: u64,
    snapshot_at: Option<u64>,
    /// The chunk read last: a get reads its messages one after another.
    chunk: Option<Chunk>,
    /// Published in [`QueueStats::flow`] with each commit.
    flow: Flow,
}

/// Is any seq in `[start, end)` held, given the never-delivered range and
/// the tracked seqs?
fn held_in(fresh: &Range<u64>, tracked: &BTreeSet<u64>, start: u64, end: u64) -> bool {
    (start.max(fresh.start) < end.min(fresh.end)) || tracked.range(start..end).next().is_some()
}

/// What a stored (maybe stopped) replica holds, read from its disk alone:
/// the never-delivered range and the tracked seqs.
fn stored_holdings(space: &SmSpace) -> Result<(Range<u64>, BTreeSet<u64>), StorageError> {
    let c = QueueMachine::stored_counters(space)?;
    let mut tracked: BTreeSet<u64> = Runs::load(space)?.1.into_iter().map(|(seq, _)| seq).collect();
    for kv in space.scan(b"s") {
        tracked.insert(u64::from_be_bytes(kv?.0[1..9].try_into().expect("state key is 9 bytes")));
    }
    Ok((c.ready_head..c.next_seq, tracked))
}

/// Consecutive messages as chunks: a new chunk wherever a seq does not
/// follow the one before, or the chunk is full. `push` adds one message.
fn chunks_of<T>(
    msgs: impl IntoIterator<Item = (u64, T)>,
    mut push: impl FnMut(&mut ChunkWriter, T) -> Result<(), StorageError>,
) -> Result<Vec<ChunkWriter>, StorageError> {
    let mut out: Vec<ChunkWriter> = Vec::new();
    for (seq, m) in msgs {
        match out.last_mut() {
            Some(w) if w.end() == seq && !w.is_full() => push(w, m)?,
            _ => {
                let mut w = ChunkWriter::new(seq);
                push(&mut w, m)?;
                out.push(w);
            }
        }
    }
    Ok(out)
}

impl QueueMachine {
    pub fn stats(&self) -> watch::Receiver<QueueStats> {
        self.stats.subscribe()
    }

    /// Everyone holding unacked messages of this replica's queue, with
    /// the tags each holds.
    pub fn held(&self) -> BTreeMap<u64, Vec<u64>> {
        self.state.held()
    }

    /// The catch-up plan, announced whenever it changes.
    pub fn plan(&self) -> watch::Receiver<Option<Plan>> {
        self.plan.subscribe()
    }

    fn fresh(&self) -> Range<u64> {
        let c = self.state.counters();
        c.ready_head..c.next_seq
    }

    /// Store fetched bodies (encoded as the master stores them) of messages
    /// this replica still holds and lacks, and record that the master has
    /// answered for everything in the plan below `upto` (see
    /// [`Plan::advance`]: a message still held here whose body did not come
    /// stays in the plan). A body of a message consumed here meanwhile is
    /// dropped: it must not come back.
    pub fn fill(
        &mut self,
        space: &SmSpace,
        bodies: &[(u64, Vec<u8>)],
        upto: u64,
        bytes_total: Option<u64>,
    ) -> Result<(), StorageError> {
        let Some(mut plan) = self.plan.borrow().clone() else { return Ok(()) };
        let fresh = self.fresh();
        let mut batch = Batch::default();
        let wanted = bodies
            .iter()
            .filter(|(seq, _)| plan.lacks(*seq) && held_in(&fresh, &self.tracked, *seq, *seq + 1))
            .map(|(seq, body)| (*seq, body.as_slice()));
        let fetched = chunks_of(wanted, |w, body| {
            w.push_encoded(body);
            Ok(())
        })?;
        let mut stored = BTreeSet::new();
        for w in fetched {
            plan.msgs_done += w.end() - w.first();
            stored.extend(w.first()..w.end());
            let chunk = w.finish();
            plan.bytes_done += chunk.len() as u64;
            batch.insert(space.key(&bodies::key(w.first())), chunk);
        }
        plan.advance(upto, |seq| !stored.contains(&seq) && held_in(&fresh, &self.tracked, seq, seq + 1));
        plan.bytes_total = plan.bytes_total.or(bytes_total);
        batch.insert(space.key(PLAN), keys::encode(&plan, "catch-up plan")?);
        space.apply(batch)?;
        self.plan.send_replace(Some(plan));
        Ok(())
    }

    /// Every body of the plan the caller saw done is here (and synced by
    /// the caller): drop the plan. Unless the plan now is another that
    /// still lacks bodies: a snapshot installed while the caller waited
    /// brought it, and dropping it would count the replica synchronised
    /// without those bodies (a master re-formed from such a replica lost
    /// them for good). `false` then: the catch-up goes on.
    pub fn finish_catch_up(&mut self, space: &SmSpace) -> Result<bool, StorageError> {
        if self.plan.borrow().as_ref().is_some_and(|p| !p.is_done()) {
            return Ok(false);
        }
        let mut batch = Batch::default();
        batch.remove(space.key(PLAN));
        space.apply(batch)?;
        self.plan.send_replace(None);
        Ok(true)
    }

    /// Encoded bodies with seqs in `ranges` from `from` on, at most about
    /// `max_bytes` of them, and the seq to continue from (`None`: the
    /// ranges are exhausted). Read from sled without the state machine
    /// lock: chunks are immutable, and one removed meanwhile is simply not
    /// sent. A consumed message whose chunk is still kept is sent too; the
    /// receiver keeps only what it still holds.
    pub fn read_bodies(
        space: &SmSpace,
        ranges: &[(u64, u64)],
        max_bytes: usize,
    ) -> Result<(EncodedBodies, Option<u64>), StorageError> {
        let mut out = Vec::new();
        let mut bytes = 0;
        for (start, end) in ranges {
            for c in bodies::overlapping(space, *start, *end)? {
                for seq in c.first().max(*start)..c.end().min(*end) {
                    if bytes >= max_bytes && !out.is_empty() {
                        return Ok((out, Some(seq)));
                    }
                    let body = c.encoded(seq)?.expect("seq within the chunk");
                    bytes += body.len();
                    out.push((seq, body.to_vec()));
                }
            }
        }
        Ok((out, None))
    }

    /// Total size of the bodies with seqs in `ranges`.
    pub fn bytes_in(space: &SmSpace, ranges: &[(u64, u64)]) -> Result<u64, StorageError> {
        let mut total = 0;
        for (start, end) in ranges {
            for c in bodies::overlapping(space, *start, *end)? {
                for seq in c.first().max(*start)..c.end().min(*end) {
                    total += c.encoded(seq)?.map_or(0, |b| b.len() as u64);
                }
            }
        }
        Ok(total)
    }

    /// Every message the stored state holds whose body is here, with its
    /// seq, in seq order (tests, tools, re-forming a group).
    /// Every live message stored in a group's space, with its seq.
    pub fn stored_live(space: &SmSpace) -> Result<Vec<(u64, Message)>, StorageError> {
        let (fresh, tracked) = stored_holdings(space)?;
        let mut out = Vec::new();
        for c in bodies::all(space)? {
            for seq in (c.first()..c.end()).filter(|s| held_in(&fresh, &tracked, *s, *s + 1)) {
                out.extend(c.message(seq)?.map(|m| (seq, m)));
            }
        }
        Ok(out)
    }

    /// Bodies of every message stored in a group's space (tests, tools).
    pub fn stored_messages(space: &SmSpace) -> Result<Vec<Message>, StorageError> {
        Ok(Self::stored_live(space)?.into_iter().map(|(_, m)| m).collect())
    }

    /// Live messages, with their seqs, stored since the counters were at
    /// `next_seq` and `next_order` (`Counters::next_requeue`): published,
    /// or handed back or prioritized (their seqs take an order number),
    /// since then.
    pub fn stored_since(space: &SmSpace, next_seq: u64, next_order: u64) -> Result<Vec<(u64, Message)>, StorageError> {
        let since = |seq: u64| match seq & HANDBACK_SEQ {
            0 => seq >= next_seq,
            _ => seq & ORDER_PART >= next_order,
        };
        Ok(Self::stored_live(space)?.into_iter().filter(|(seq, _)| since(*seq)).collect())
    }

    /// What a stopped replica holds of the messages numbered below `shared`
    /// (`(next_seq, next_order)` bounds, see [`Holdings`]), for the epoch it
    /// rejoins to drop the rest ([`QueueCmd::Merge`]). The bounds shrink to
    /// the replica's own counters: a number it never gave is missing here
    /// because it never applied that publish, not because it was consumed.
    pub fn holdings(space: &SmSpace, shared: (u64, u64)) -> Result<Holdings, StorageError> {
        let c = Self::stored_counters(space)?;
        let (below_seq, below_order) = (shared.0.min(c.next_seq), shared.1.min(c.next_requeue));
        let (fresh, tracked) = stored_holdings(space)?;
        let is_shared = |seq: u64| match seq & HANDBACK_SEQ {
            0 => seq < below_seq,
            _ => seq & ORDER_PART < below_order,
        };
        let fresh = fresh.start..fresh.end.min(below_seq);
        let singles = tracked.into_iter().filter(|s| is_shared(*s) && !fresh.contains(s)).map(|s| (s, s + 1));
        let held = super::state::disjoint_spans(singles.chain([(fresh.start, fresh.end)]));
        Ok(Holdings { below_seq, below_order, held })
    }

    /// For a stopped replica: replay `entries` (commands of log entries not
    /// applied here, in order) on the stored state in memory, writing
    /// nothing, and tell for each command how many messages it would store
    /// (a publish refused by `reject-publish` stores fewer than it carries).
    pub fn would_store(space: &SmSpace, entries: &[Vec<QueueCmd>]) -> Result<Vec<Vec<u32>>, StorageError> {
        let mut m = <Self as Machine>::load(space)?;
        let mut changes = Vec::new();
        Ok(entries
            .iter()
            .map(|cmds| {
                cmds.iter()
                    .map(|c| {
                        changes.clear();
                        match m.state.apply(c, &mut changes) {
                            QueueReply::Enqueued { count } => count,
                            _ => 0,
                        }
                    })
                    .collect()
            })
            .collect())
    }

    /// The message stored under `seq`, if it is still live.
    pub fn stored_body(space: &SmSpace, seq: u64) -> Result<Option<Message>, StorageError> {
        let (fresh, tracked) = stored_holdings(space)?;
        if !held_in(&fresh, &tracked, seq, seq + 1) {
            return Ok(None);
        }
        match bodies::find(space, seq)? {
            Some(c) => c.message(seq),
            None => Ok(None),
        }
    }

    /// The counters as stored (a stopped replica's, for healing).
    pub fn stored_counters(space: &SmSpace) -> Result<Counters, StorageError> {
        match space.get(COUNTERS)? {
            Some(b) => keys::decode(&b, "queue counters"),
            None => Ok(Counters::default()),
        }
    }

    /// The fork record of the group's current epoch, if it was re-formed.
    pub fn fork_record(space: &SmSpace) -> Result<Option<ForkRecord>, StorageError> {
        space.get(FORK)?.map(|b| keys::decode(&b, "fork record")).transpose()
    }

    /// Forget the fork record, as a replica whose former stopped before the
    /// record's entry committed never had it (tests).
    #[cfg(feature = "test-hooks")]
    pub fn forget_fork_record(space: &SmSpace) -> Result<(), StorageError> {
        let mut batch = Batch::default();
        batch.remove(space.key(FORK));
        space.apply(batch)
    }

    /// Up to `max` of the messages held for at-least-once dead-lettering,
    /// from tag `from` on, oldest first: each with its delivery tag and
    /// reason. One whose body this replica lacks (it never leads then) is
    /// left out.
    pub fn dead_letters(
        &mut self,
        space: &SmSpace,
        from: u64,
        max: usize,
    ) -> Result<Vec<(u64, DeathReason, Message)>, StorageError> {
        let mut out = Vec::new();
        for (tag, seq, reason) in self.state.dead_letters(from, max) {
            if let Some(m) = self.read_body(space, seq)? {
                out.push((tag, reason, m));
            }
        }
        Ok(out)
    }

    /// The body of a live message; `None` if this replica has not fetched
    /// it yet (such a replica never leads, so the reply is not used).
    fn read_body(&mut self, space: &SmSpace, seq: u64) -> Result<Option<Message>, StorageError> {
        if !self.chunk.as_ref().is_some_and(|c| c.contains(seq)) {
            self.chunk = match self.ref_of(seq) {
                Some((first, r)) => r.resolve(space, first)?,
                None => bodies::find_chunk(space, seq)?,
            };
        }
        match &self.chunk {
            Some(c) => c.message(seq),
            None if self.plan.borrow().as_ref().is_some_and(|p| p.lacks(seq)) => Ok(None),
            None => Err(StorageError::Decode {
                what: "message body (missing)",
                source: bincode::error::DecodeError::Other("body of a live message is missing"),
            }),
        }
    }

    /// The reference covering `seq`, if its body is still only in the log.
    fn ref_of(&self, seq: u64) -> Option<(u64, &LogRef)> {
        let (first, r) = self.refs.range(..=seq).next_back()?;
        (seq < first + r.count()).then_some((*first, r))
    }

    /// Write the changes one command of an entry made to the batch, and
    /// put the bodies it delivers in its reply.
    fn write_changes<'a>(
        &mut self,
        space: &SmSpace,
        batch: &mut Batch,
        entry: &mut EntryEffects<'a>,
        (cmd_at, cmd): (usize, &'a QueueCmd),
        changes: &[Change],
        reply: &mut QueueReply,
    ) -> Result<(), StorageError> {
        for ch in changes {
            match *ch {
                Change::Insert { seq, batch_index } => {
                    let Some(msgs) = cmd.messages() else { unreachable!("insert without messages") };
                    let m = &msgs[batch_index];
                    let bytes = (m.body.len() + m.properties.len() + m.exchange.len() + m.routing_key.len() + 8) as u64;
                    entry.inserted.push((seq, cmd_at as u32, batch_index as u32, bytes));
                    entry.fresh.insert(seq, m);
                }
                Change::Handed { origin } => batch.insert(space.key(&handed_key(origin)), &[][..]),
                Change::Stamped { seq, at_ms } => batch.insert(space.key(&time_key(seq)), &at_ms.to_be_bytes()[..]),
                Change::Unstamped { seq } => batch.remove(space.key(&time_key(seq))),
                Change::Deadline { seq, at_ms } => {
                    batch.insert(space.key(&deadline_key(seq)), &at_ms.to_be_bytes()[..])
                }
                Change::Undeadline { seq } => batch.remove(space.key(&deadline_key(seq))),
                Change::Returned { seq, count } => {
                    batch.insert(space.key(&returns_key(seq)), &u64::from(count).to_be_bytes()[..])
                }
                Change::Unreturned { seq } => batch.remove(space.key(&returns_key(seq))),
                Change::Registered { owner, number, registration } => {
                    let v = keys::encode(&registration, "consumer registration")?;
                    batch.insert(space.key(&consumer_key(owner, number)), v);
                }
                Change::Unregistered { owner, number } => batch.remove(space.key(&consumer_key(owner, number))),
                // Bodies go into replies only where a client gets them: a
                // mirror reads none (one still catching up may not have them).
                Change::DeadLetter { .. } | Change::Deliver { .. } if !entry.answering => {}
                Change::DeadLetter { seq, reason } => {
                    let message = match entry.fresh.get(&seq) {
                        Some(m) => Some((*m).clone()),
                        None => self.read_body(space, seq)?,
                    };
                    entry.dead.extend(message.map(|m| (m, reason)));
                }
                Change::SetState { seq, state: MsgState::Unacked { tag, owner } } => {
                    // Held anew under another tag (a delivered message held
                    // for dead-lettering): it leaves its delivery's run.
                    self.runs.settle(seq);
                    // Delivered again after a requeue: its state key goes.
                    if self.tracked.contains(&seq) && !self.runs.holds(seq) {
                        batch.remove(space.key(&state_key(seq)));
                    }
                    self.tracked.insert(seq);
                    self.runs.delivered(seq, tag, owner);
                }
                Change::SetState { seq, state } => {
                    self.runs.settle(seq);
                    self.tracked.insert(seq);
                    batch.insert(space.key(&state_key(seq)), keys::encode(&state, "message state")?);
                }
                Change::Remove { seq, tracked } => {
                    if tracked && !self.runs.settle(seq) {
                        batch.remove(space.key(&state_key(seq)));
                    }
                    self.tracked.remove(&seq);
                    entry.removed.push(seq);
                }
                Change::Deliver { seq, tag, redelivered, returns } => {
                    let message = match entry.fresh.get(&seq) {
                        Some(m) => Some((*m).clone()),
                        None => self.read_body(space, seq)?,
                    };
                    // RabbitMQ's count of earlier deliveries that came back.
                    let message = message.map(|mut m| {
                        if returns > 0 {
                            m.properties =
                                crate::message::with_long_header(&m.properties, "x-delivery-count", i64::from(returns));
                        }
                        m
                    });
                    if let (Some(message), QueueReply::Got { msgs, .. }) = (message, &mut *reply) {
                        msgs.push(Delivery { tag, redelivered, message });
                    }
                }
            }
        }
        Ok(())
    }

    /// End of the entry at `index`: reference its new messages' bodies in
    /// it, drop references and chunks none of whose messages is held any
    /// more, write the changed runs.
    fn write_entry(
        &mut self,
        space: &SmSpace,
        batch: &mut Batch,
        index: u64,
        inserted: &[(u64, u32, u32, u64)],
        removed: &mut [u64],
    ) -> Result<(), StorageError> {
        let fresh = self.fresh();
        // Runs of consecutive seqs, each one reference.
        let mut new: Vec<(u64, LogRef)> = Vec::new();
        for &(seq, cmd, msg, bytes) in inserted {
            match new.last_mut() {
                Some((first, r)) if *first + r.count() == seq => r.push(cmd, msg, bytes),
                _ => {
                    let mut r = LogRef::new(index);
                    r.push(cmd, msg, bytes);
                    new.push((seq, r));
                }
            }
        }
        let new_ranges: Vec<(u64, u64)> = new.iter().map(|(f, r)| (*f, f + r.count())).collect();
        for (first, r) in new {
            // Consumed within its own entry (auto-ack, overflow): never written.
            if held_in(&fresh, &self.tracked, first, first + r.count()) {
                batch.insert(space.key(&bodies::ref_key(first)), r.encode()?);
                self.in_log += r.bytes;
                self.refs.insert(first, r);
            }
        }
        removed.sort_unstable();
        let mut checked: Option<(u64, u64)> = None;
        for &seq in removed.iter() {
            if checked.is_some_and(|(start, end)| (start..end).contains(&seq))
                || new_ranges.iter().any(|(start, end)| (*start..*end).contains(&seq))
            {
                continue;
            }
            if let Some((first, end)) = self.ref_of(seq).map(|(f, r)| (f, f + r.count())) {
                checked = Some((first, end));
                if !held_in(&fresh, &self.tracked, first, end) {
                    batch.remove(space.key(&bodies::ref_key(first)));
                    self.in_log -= self.refs.remove(&first).map_or(0, |r| r.bytes);
                    if self.chunk.as_ref().is_some_and(|k| k.first() == first) {
                        self.chunk = None;
                    }
                }
                continue;
            }
            let chunk = match self.chunk.as_ref().filter(|c| c.contains(seq)) {
                Some(c) => Some(c.clone()),
                None => bodies::find_chunk(space, seq)?,
            };
            // No chunk: a body this replica never fetched.
            let Some(c) = chunk else { continue };
            checked = Some((c.first(), c.end()));
            if !held_in(&fresh, &self.tracked, c.first(), c.end()) {
                batch.remove(space.key(&bodies::key(c.first())));
                if self.chunk.as_ref().is_some_and(|k| k.first() == c.first()) {
                    self.chunk = None;
                }
            }
        }
        self.applied = index;
        let since = *self.snapshot_at.get_or_insert(index);
        let allowed = in_log_allowed(index.saturating_sub(since));
        if self.in_log > allowed {
            let mut oldest = Vec::new();
            while self.in_log > allowed {
                let Some((first, r)) = self.refs.pop_first() else { break };
                self.in_log -= r.bytes;
                oldest.push((first, r));
            }
            let (fresh, tracked) = (self.fresh(), &self.tracked);
            Self::spill_into(space, batch, oldest, |s| held_in(&fresh, tracked, s, s + 1))?;
            self.chunk = None;
        }
        self.runs.write(space, batch)
    }

    /// Copy the held bodies that are still only in the log into chunks, and
    /// drop their references: the log may go after this. Atomic: a crash
    /// leaves either the references or the chunks.
    fn spill(space: &SmSpace, refs: Vec<(u64, LogRef)>, keep: impl Fn(u64) -> bool) -> Result<u64, StorageError> {
        let mut batch = Batch::default();
        let copied = Self::spill_into(space, &mut batch, refs, keep)?;
        space.apply(batch)?;
        Ok(copied)
    }

    /// [`Self::spill`] into `batch`.
    fn spill_into(
        space: &SmSpace,
        batch: &mut Batch,
        refs: Vec<(u64, LogRef)>,
        keep: impl Fn(u64) -> bool,
    ) -> Result<u64, StorageError> {
        let mut copied = 0u64;
        for (first, r) in refs {
            batch.remove(space.key(&bodies::ref_key(first)));
            let Some(c) = r.resolve(space, first)? else {
                // Only after a snapshot was installed here: the plan fetches them.
                continue;
            };
            let held: Vec<(u64, &[u8])> = (c.first()..c.end())
                .filter(|s| keep(*s))
                .map(|s| Ok((s, c.encoded(s)?.expect("seq within the chunk"))))
                .collect::<Result<_, StorageError>>()?;
            let chunks = chunks_of(held, |w, body| {
                w.push_encoded(body);
                Ok(())
            })?;
            for w in chunks {
                copied += w.end() - w.first();
                batch.insert(space.key(&bodies::key(w.first())), w.finish());
            }
        }
        Ok(copied)
    }
}

/// What the commands of one entry applied so far left for the entry's end.
#[derive(Default)]
struct EntryEffects<'a> {
    answering: bool,
    /// Bodies not in sled until the batch is applied: a get in the same entry reads them here.
    fresh: HashMap<u64, &'a Message>,
    inserted: Vec<(u64, u32, u32, u64)>,
    removed: Vec<u64>,
    dead: Vec<(Message, DeathReason)>,
}

/// The queue's index, as sent to a replica that is too far behind for the
/// log. Bodies are not in it: the replica fetches them afterwards.
#[derive(Serialize, Deserialize)]
struct Dump {
    counters: Counters,
    /// Delivered or requeued messages and their state.
    states: Vec<(u64, MsgState)>,
    fork: Option<ForkRecord>,
    handed: Vec<Origin>,
    times: Vec<(u64, u64)>,
    deadlines: Vec<(u64, u64)>,
    consumers: Vec<Registered>,
    returns: Vec<(u64, u32)>,
}

impl Machine for QueueMachine {
    type Cmd = super::Cmds;
    type Reply = Vec<QueueReply>;

    fn load(space: &SmSpace) -> Result<Self, StorageError> {
        let counters = Self::stored_counters(space)?;
        let (runs, mut stored) = Runs::load(space)?;
        for kv in space.scan(b"s") {
            let (k, v) = kv?;
            let seq = u64::from_be_bytes(k[1..9].try_into().expect("state key is 9 bytes"));
            stored.push((seq, keys::decode::<MsgState>(&v, "message state")?));
        }
        let mut handed = Vec::new();
        for kv in space.scan(b"h") {
            handed.push(handed_origin(&kv?.0));
        }
        let state = QueueState::restore(counters, stored)
            .with_handed(handed)
            .with_times(stored_times(space, b"t")?)
            .with_deadlines(stored_times(space, b"x")?)
            .with_returns(counts_of_returns(space)?)
            .with_consumers(stored_consumers(space)?);
        let (stats, _) = watch::channel(QueueStats::of(&state));
        let plan = space.get(PLAN)?.map(|b| keys::decode::<Plan>(&b, "catch-up plan")).transpose()?;
        let (plan, _) = watch::channel(plan);
        let tracked = state.tracked_seqs();
        let refs: BTreeMap<u64, LogRef> = bodies::all_refs(space).collect::<Result<_, _>>()?;
        let in_log = refs.values().map(|r| r.bytes).sum();
        Ok(Self {
            state,
            stats,
            plan,
            tracked,
            runs,
            refs,
            in_log,
            applied: 0,
            snapshot_at: None,
            chunk: None,
            flow: Flow::default(),
        })
    }

    fn apply(
        &mut self,
        space: &SmSpace,
        index: u64,
        cmds: &super::Cmds,
        batch: &mut Batch,
        answering: bool,
    ) -> Result<Vec<QueueReply>, StorageError> {
        let mut replies = Vec::with_capacity(cmds.len());
        let mut changes = Vec::new();
        let mut entry = EntryEffects { answering, ..EntryEffects::default() };
        self.state.begin_entry();
        self.runs.begin_entry();
        for (cmd_at, cmd) in cmds.iter().enumerate() {
            if let QueueCmd::Fork(record) = cmd {
                batch.insert(space.key(FORK), keys::encode(record, "fork record")?);
            }
            changes.clear();
            let mut reply = self.state.apply(cmd, &mut changes);
            self.flow.count(cmd, &reply, &changes);
            self.write_changes(space, batch, &mut entry, (cmd_at, cmd), &changes, &mut reply)?;
            replies.push(reply);
        }
        self.write_entry(space, batch, index, &entry.inserted, &mut entry.removed)?;
        // The entry's dead letters go to its stamp's reply, which only the
        // master's proposer reads.
        if let Some(QueueReply::DeadLetters { msgs }) = replies.first_mut() {
            *msgs = entry.dead;
        }
        Ok(replies)
    }

    fn commit(&mut self, space: &SmSpace, batch: &mut Batch) -> Result<(), StorageError> {
        batch.insert(space.key(COUNTERS), keys::encode(self.state.counters(), "queue counters")?);
        self.stats.send_replace(QueueStats { flow: self.flow, ..QueueStats::of(&self.state) });
        Ok(())
    }

    const KEEP_ON_INSTALL: &'static [&'static [u8]] = &[b"B", b"R"];

    fn before_snapshot(&mut self, space: &SmSpace) -> Result<(), StorageError> {
        self.snapshot_at = (self.applied > 0).then_some(self.applied);
        if self.refs.is_empty() {
            return Ok(());
        }
        let refs = std::mem::take(&mut self.refs).into_iter().collect();
        self.in_log = 0;
        let (fresh, tracked) = (self.fresh(), &self.tracked);
        let copied = Self::spill(space, refs, |s| held_in(&fresh, tracked, s, s + 1))?;
        // The chunk read last may be an entry's, with other bounds than the
        // chunks just written: removals must find those.
        self.chunk = None;
        tracing::trace!(copied, "bodies copied out of the log before a snapshot");
        Ok(())
    }

    fn dump(&self, space: &SmSpace) -> Result<Vec<u8>, StorageError> {
        let fork = Self::fork_record(space)?;
        let handed = self.state.handed().iter().copied().collect();
        let times = self.state.times().iter().map(|(k, v)| (*k, *v)).collect();
        let deadlines = self.state.deadlines().iter().map(|(k, v)| (*k, *v)).collect();
        let states = self.state.states();
        let consumers = self.state.consumers().iter().map(|(k, r)| (*k, *r)).collect();
        let counters = self.state.counters().clone();
        let returns = self.state.returns().iter().map(|(k, v)| (*k, *v)).collect();
        let dump = Dump { counters, states, fork, handed, times, deadlines, consumers, returns };
        keys::encode(&dump, "queue dump")
    }

    /// Chunks this replica already had (kept by the install) stay if the
    /// new state still holds one of their messages; the held messages
    /// without a body here go in the plan.
    fn restore(&mut self, space: &SmSpace, dump: &[u8]) -> Result<(), StorageError> {
        let d: Dump = keys::decode(dump, "queue dump")?;
        let state = QueueState::restore(d.counters.clone(), d.states.iter().copied())
            .with_handed(d.handed.clone())
            .with_times(d.times.iter().copied())
            .with_deadlines(d.deadlines.iter().copied())
            .with_returns(d.returns.iter().copied())
            .with_consumers(d.consumers.iter().copied());
        let tracked = state.tracked_seqs();
        let fresh = d.counters.ready_head..d.counters.next_seq;
        let mut batch = Batch::default();
        for (seq, at) in &d.times {
            batch.insert(space.key(&time_key(*seq)), &at.to_be_bytes()[..]);
        }
        for (seq, at) in &d.deadlines {
            batch.insert(space.key(&deadline_key(*seq)), &at.to_be_bytes()[..]);
        }
        for (seq, n) in &d.returns {
            batch.insert(space.key(&returns_key(*seq)), &u64::from(*n).to_be_bytes()[..]);
        }
        batch.insert(space.key(COUNTERS), keys::encode(&d.counters, "queue counters")?);
        for o in &d.handed {
            batch.insert(space.key(&handed_key(*o)), &[][..]);
        }
        for ((owner, number), r) in &d.consumers {
            batch.insert(space.key(&consumer_key(*owner, *number)), keys::encode(r, "consumer registration")?);
        }
        if let Some(f) = &d.fork {
            batch.insert(space.key(FORK), keys::encode(f, "fork record")?);
        }
        // Delivered ones too are stored one by one here: runs are only
        // made by gets.
        for (seq, st) in &d.states {
            batch.insert(space.key(&state_key(*seq)), keys::encode(st, "message state")?);
        }
        // Bodies this replica has in its log go into chunks first: the
        // install lets the log go. Which are held is sorted out below.
        let refs = bodies::all_refs(space).collect::<Result<_, _>>()?;
        Self::spill(space, refs, |_| true)?;
        self.refs.clear();
        self.in_log = 0;
        let mut present = BTreeSet::new();
        for c in bodies::all(space)? {
            if held_in(&fresh, &tracked, c.first(), c.end()) {
                present.extend((c.first()..c.end()).filter(|s| held_in(&fresh, &tracked, *s, *s + 1)));
            } else {
                batch.remove(space.key(&bodies::key(c.first())));
            }
        }
        let (missing, msgs_total) = missing_ranges(fresh, &tracked, &present);
        let plan = (!missing.is_empty()).then(|| Plan { missing, msgs_total, ..Plan::default() });
        match &plan {
            Some(p) => batch.insert(space.key(PLAN), keys::encode(p, "catch-up plan")?),
            None => batch.remove(space.key(PLAN)),
        }
        space.apply(batch)?;
        self.state = state;
        self.tracked = tracked;
        self.runs.clear();
        self.chunk = None;
        self.plan.send_replace(plan);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_on_bodies_in_the_log_falls_to_what_a_snapshot_may_copy() {
        let half = SNAPSHOT_EVERY / 2;
        assert_eq!(in_log_allowed(0), MAX_IN_LOG_BYTES);
        assert_eq!(in_log_allowed(half), MAX_IN_LOG_BYTES);
        assert_eq!(in_log_allowed(half + half / 2), MAX_IN_LOG_BYTES / 2);
        assert_eq!(in_log_allowed(SNAPSHOT_EVERY - half / 4), SNAPSHOT_COPY_BYTES, "a prefetch's worth stays");
        assert_eq!(in_log_allowed(SNAPSHOT_EVERY - 1), SNAPSHOT_COPY_BYTES);
        assert_eq!(in_log_allowed(SNAPSHOT_EVERY), 0);
        assert_eq!(in_log_allowed(10 * SNAPSHOT_EVERY), 0, "a snapshot is late: copy as entries come");
    }

    #[test]
    fn flow_counts_publishes_deliveries_and_acks_as_applied() {
        let msg = |b: &str| Message {
            exchange: String::new(),
            routing_key: "q".into(),
            properties: Vec::new(),
            body: b.as_bytes().to_vec(),
        };
        let (mut state, mut flow) = (QueueState::default(), Flow::default());
        let mut apply = |cmd: QueueCmd| {
            let mut changes = Vec::new();
            let reply = state.apply(&cmd, &mut changes);
            flow.count(&cmd, &reply, &changes);
            reply
        };
        apply(QueueCmd::Enqueue { msgs: vec![msg("a"), msg("b"), msg("c")] });
        apply(QueueCmd::EnqueueExpiring { msgs: vec![msg("d")], ttl_ms: vec![None] });
        // Two taken to ack, one with an automatic ack.
        apply(QueueCmd::Get { owner: 1, max: 2, auto_ack: false, consumer: None });
        apply(QueueCmd::Get { owner: 1, max: 1, auto_ack: true, consumer: None });
        // One acked (99 is unknown), one requeued: a get of five finds two.
        apply(QueueCmd::Ack { tags: vec![0, 99] });
        apply(QueueCmd::Nack { tags: vec![1], requeue: true });
        apply(QueueCmd::Get { owner: 1, max: 5, auto_ack: false, consumer: None });
        apply(QueueCmd::AckOf { owner: 1, tags: vec![3, 4] });
        assert_eq!(flow, Flow { published: 4, delivered: 5, acked: 3 });
    }
}
