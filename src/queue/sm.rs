//! The queue state machine on disk: [`QueueState`] plus message bodies and
//! states in the group's key space.
//!
//! Keys (group-relative):
//! - `c`            counters (next seq, tag, requeue order)
//! - `s` + seq(8)   [`MsgState`] of delivered or requeued messages only;
//!   scanned at start to rebuild the index (never-delivered messages are a
//!   range given by the counters, so a deep queue restarts without reading it)
//! - `b` + seq(8)   the [`Message`], read only to deliver
//! - `h` + origin(24) an old-epoch entry whose messages were handed back
//! - `e`            the [`ForkRecord`] of the group's current epoch, if re-formed
//! - `y`            the catch-up [`Plan`]: bodies this replica still lacks
//!   after installing a snapshot (absent once it has them all)
//! - `x` + seq(8)   deadline (ms) of a message published with a TTL of its own
//! - `t` + seq(8)   publish time (ms, master's clock) of the run of messages
//!   starting at seq; only for queues with a TTL

use std::collections::{BTreeSet, HashMap};

use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use mirrorq_storage::{keys, SmSpace, StorageError};

use super::catchup::{missing_ranges, Plan};
use super::epoch::ForkRecord;
use super::state::{Change, Counters, QueueState};
use super::types::{DeathReason, Delivery, Message, MsgState, Origin, QueueCmd, QueueReply};
use crate::raft::state_machine::Machine;
use crate::raft::types::{Request, Response};

const COUNTERS: &[u8] = b"c";
const FORK: &[u8] = b"e";
const PLAN: &[u8] = b"y";

fn state_key(seq: u64) -> [u8; 9] {
    let mut k = [b's'; 9];
    k[1..].copy_from_slice(&seq.to_be_bytes());
    k
}

fn handed_key((term, node, index): Origin) -> [u8; 25] {
    let mut k = [b'h'; 25];
    k[1..9].copy_from_slice(&term.to_be_bytes());
    k[9..17].copy_from_slice(&node.to_be_bytes());
    k[17..].copy_from_slice(&index.to_be_bytes());
    k
}

fn handed_origin(k: &[u8]) -> Origin {
    let n = |r: std::ops::Range<usize>| u64::from_be_bytes(k[r].try_into().expect("handed key is 25 bytes"));
    (n(1..9), n(9..17), n(17..25))
}

fn time_key(seq: u64) -> [u8; 9] {
    let mut k = [b't'; 9];
    k[1..].copy_from_slice(&seq.to_be_bytes());
    k
}

fn deadline_key(seq: u64) -> [u8; 9] {
    let mut k = [b'x'; 9];
    k[1..].copy_from_slice(&seq.to_be_bytes());
    k
}

/// `seq -> ms` pairs stored under `prefix` (publish times, deadlines).
fn stored_times(space: &SmSpace, prefix: &[u8]) -> Result<Vec<(u64, u64)>, StorageError> {
    let mut out = Vec::new();
    for kv in space.scan(prefix) {
        let (k, v) = kv?;
        let seq = u64::from_be_bytes(k[1..9].try_into().expect("time key is 9 bytes"));
        let at = u64::from_be_bytes(v.as_ref().try_into().map_err(|_| StorageError::Decode {
            what: "publish time",
            source: bincode::error::DecodeError::Other("publish time is not 8 bytes"),
        })?);
        out.push((seq, at));
    }
    Ok(out)
}

fn body_key(seq: u64) -> [u8; 9] {
    let mut k = [b'b'; 9];
    k[1..].copy_from_slice(&seq.to_be_bytes());
    k
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
}

impl QueueStats {
    fn of(state: &QueueState) -> Self {
        Self {
            ready: state.ready_count(),
            unacked: state.unacked_count(),
            head_published_at: state.head_published_at(),
            head_deadline: state.head_deadline(),
        }
    }
}

pub struct QueueMachine {
    state: QueueState,
    stats: watch::Sender<QueueStats>,
    /// Bodies still to fetch; `None` when the replica has every body.
    plan: watch::Sender<Option<Plan>>,
}

impl QueueMachine {
    pub fn stats(&self) -> watch::Receiver<QueueStats> {
        self.stats.subscribe()
    }

    /// The catch-up plan, announced whenever it changes.
    pub fn plan(&self) -> watch::Receiver<Option<Plan>> {
        self.plan.subscribe()
    }

    /// Store fetched bodies (encoded as the master stores them) of messages
    /// this replica still holds and lacks, and record that everything in
    /// the plan below `upto` has been fetched. A body of a message consumed
    /// here meanwhile is dropped: it must not come back.
    pub fn fill(
        &mut self,
        space: &SmSpace,
        bodies: &[(u64, Vec<u8>)],
        upto: u64,
        bytes_total: Option<u64>,
    ) -> Result<(), StorageError> {
        let Some(mut plan) = self.plan.borrow().clone() else { return Ok(()) };
        let tracked = self.state.tracked_seqs();
        let mut batch = sled::Batch::default();
        for (seq, body) in bodies {
            if plan.lacks(*seq) && self.state.holds(*seq, &tracked) {
                batch.insert(space.key(&body_key(*seq)), body.as_slice());
                plan.msgs_done += 1;
                plan.bytes_done += body.len() as u64;
            }
        }
        plan.advance(upto);
        plan.bytes_total = plan.bytes_total.or(bytes_total);
        batch.insert(space.key(PLAN), keys::encode(&plan, "catch-up plan")?);
        space.apply(batch)?;
        self.plan.send_replace(Some(plan));
        Ok(())
    }

    /// Every body is here (and synced by the caller): drop the plan.
    pub fn finish_catch_up(&mut self, space: &SmSpace) -> Result<(), StorageError> {
        let mut batch = sled::Batch::default();
        batch.remove(space.key(PLAN));
        space.apply(batch)?;
        self.plan.send_replace(None);
        Ok(())
    }

    /// Encoded bodies with seqs in `ranges` from `from` on, at most about
    /// `max_bytes` of them, and the seq to continue from (`None`: the
    /// ranges are exhausted). Read from sled without the state machine
    /// lock: bodies are immutable, and one consumed meanwhile is simply
    /// not sent.
    pub fn read_bodies(
        space: &SmSpace,
        ranges: &[(u64, u64)],
        max_bytes: usize,
    ) -> Result<(EncodedBodies, Option<u64>), StorageError> {
        let mut out = Vec::new();
        let mut bytes = 0;
        for (start, end) in ranges {
            for kv in space.range(&body_key(*start), &body_key(*end)) {
                let (k, v) = kv?;
                let seq = u64::from_be_bytes(k[1..9].try_into().expect("body key is 9 bytes"));
                if bytes >= max_bytes && !out.is_empty() {
                    return Ok((out, Some(seq)));
                }
                bytes += v.len();
                out.push((seq, v.to_vec()));
            }
        }
        Ok((out, None))
    }

    /// Total size of the bodies with seqs in `ranges`.
    pub fn bytes_in(space: &SmSpace, ranges: &[(u64, u64)]) -> Result<u64, StorageError> {
        let mut total = 0;
        for (start, end) in ranges {
            for kv in space.range(&body_key(*start), &body_key(*end)) {
                total += kv?.1.len() as u64;
            }
        }
        Ok(total)
    }

    /// Bodies of every message stored in a group's space (tests, tools).
    pub fn stored_messages(space: &SmSpace) -> Result<Vec<Message>, StorageError> {
        let mut out = Vec::new();
        for kv in space.scan(b"b") {
            out.push(keys::decode(&kv?.1, "message body")?);
        }
        Ok(out)
    }

    /// Live messages with a seq of at least `from` (handed-back ones
    /// included: their seqs are above every other).
    pub fn stored_from(space: &SmSpace, from: u64) -> Result<Vec<Message>, StorageError> {
        let mut out = Vec::new();
        for kv in space.scan(b"b") {
            let (k, v) = kv?;
            if u64::from_be_bytes(k[1..9].try_into().expect("body key is 9 bytes")) >= from {
                out.push(keys::decode(&v, "message body")?);
            }
        }
        Ok(out)
    }

    /// The message stored under `seq`, if it is still live.
    pub fn stored_body(space: &SmSpace, seq: u64) -> Result<Option<Message>, StorageError> {
        space.get(&body_key(seq))?.map(|b| keys::decode(&b, "message body")).transpose()
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

    /// The body of a live message; `None` if this replica has not fetched
    /// it yet (such a replica never leads, so the reply is not used).
    fn read_body(&self, space: &SmSpace, seq: u64) -> Result<Option<Message>, StorageError> {
        match space.get(&body_key(seq))? {
            Some(b) => keys::decode(&b, "message body").map(Some),
            None if self.plan.borrow().as_ref().is_some_and(|p| p.lacks(seq)) => Ok(None),
            None => Err(StorageError::Decode {
                what: "message body (missing)",
                source: bincode::error::DecodeError::Other("body of a live message is missing"),
            }),
        }
    }
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
}

impl Machine for QueueMachine {
    fn load(space: &SmSpace) -> Result<Self, StorageError> {
        let counters = Self::stored_counters(space)?;
        let mut stored = Vec::new();
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
            .with_deadlines(stored_times(space, b"x")?);
        let (stats, _) = watch::channel(QueueStats::of(&state));
        let plan = space.get(PLAN)?.map(|b| keys::decode::<Plan>(&b, "catch-up plan")).transpose()?;
        let (plan, _) = watch::channel(plan);
        Ok(Self { state, stats, plan })
    }

    fn apply(
        &mut self,
        space: &SmSpace,
        req: &Request,
        batch: &mut sled::Batch,
        answering: bool,
    ) -> Result<Response, StorageError> {
        let Request::Queue(cmds) = req else {
            return Ok(Response::None);
        };
        let mut replies = Vec::with_capacity(cmds.len());
        let mut changes = Vec::new();
        // Bodies inserted by this apply call are not in sled until the batch
        // is applied; a get in the same entry reads them from here.
        let mut fresh: HashMap<u64, &Message> = HashMap::new();
        let mut dead: Vec<(Message, DeathReason)> = Vec::new();
        self.state.begin_entry();
        for cmd in cmds {
            if let QueueCmd::Fork(record) = cmd {
                batch.insert(space.key(FORK), keys::encode(record, "fork record")?);
            }
            changes.clear();
            let mut reply = self.state.apply(cmd, &mut changes);
            for ch in &changes {
                match *ch {
                    Change::Insert { seq, batch_index } => {
                        let Some(msgs) = cmd.messages() else { unreachable!("insert without messages") };
                        let m = &msgs[batch_index];
                        batch.insert(space.key(&body_key(seq)), keys::encode(m, "message body")?);
                        fresh.insert(seq, m);
                    }
                    Change::Handed { origin } => {
                        batch.insert(space.key(&handed_key(origin)), &[][..]);
                    }
                    Change::Stamped { seq, at_ms } => {
                        batch.insert(space.key(&time_key(seq)), &at_ms.to_be_bytes()[..]);
                    }
                    Change::Unstamped { seq } => {
                        batch.remove(space.key(&time_key(seq)));
                    }
                    Change::Deadline { seq, at_ms } => {
                        batch.insert(space.key(&deadline_key(seq)), &at_ms.to_be_bytes()[..]);
                    }
                    Change::Undeadline { seq } => {
                        batch.remove(space.key(&deadline_key(seq)));
                    }
                    // Bodies go into replies only where a client gets them:
                    // a mirror reads none (one still catching up may not
                    // have them).
                    Change::DeadLetter { .. } | Change::Deliver { .. } if !answering => {}
                    Change::DeadLetter { seq, reason } => {
                        let message = match fresh.get(&seq) {
                            Some(m) => Some((*m).clone()),
                            None => self.read_body(space, seq)?,
                        };
                        dead.extend(message.map(|m| (m, reason)));
                    }
                    Change::SetState { seq, state } => {
                        batch.insert(space.key(&state_key(seq)), keys::encode(&state, "message state")?);
                    }
                    Change::Remove { seq, tracked } => {
                        if tracked {
                            batch.remove(space.key(&state_key(seq)));
                        }
                        batch.remove(space.key(&body_key(seq)));
                    }
                    Change::Deliver { seq, tag, redelivered } => {
                        let message = match fresh.get(&seq) {
                            Some(m) => Some((*m).clone()),
                            None => self.read_body(space, seq)?,
                        };
                        if let (Some(message), QueueReply::Got { msgs, .. }) = (message, &mut reply) {
                            msgs.push(Delivery { tag, redelivered, message });
                        }
                    }
                }
            }
            replies.push(reply);
        }
        // The entry's dead letters go to its stamp's reply, which only the
        // master's proposer reads.
        if let Some(QueueReply::DeadLetters { msgs }) = replies.first_mut() {
            *msgs = dead;
        }
        Ok(Response::Queue(replies))
    }

    fn commit(&mut self, space: &SmSpace, batch: &mut sled::Batch) -> Result<(), StorageError> {
        batch.insert(space.key(COUNTERS), keys::encode(self.state.counters(), "queue counters")?);
        self.stats.send_replace(QueueStats::of(&self.state));
        Ok(())
    }

    const KEEP_ON_INSTALL: &'static [&'static [u8]] = &[b"b"];

    fn dump(&self, space: &SmSpace) -> Result<Vec<u8>, StorageError> {
        let mut states = Vec::new();
        for kv in space.scan(b"s") {
            let (k, v) = kv?;
            let seq = u64::from_be_bytes(k[1..9].try_into().expect("state key is 9 bytes"));
            states.push((seq, keys::decode::<MsgState>(&v, "message state")?));
        }
        let fork = Self::fork_record(space)?;
        let handed = self.state.handed().iter().copied().collect();
        let times = self.state.times().iter().map(|(k, v)| (*k, *v)).collect();
        let deadlines = self.state.deadlines().iter().map(|(k, v)| (*k, *v)).collect();
        let dump = Dump { counters: self.state.counters().clone(), states, fork, handed, times, deadlines };
        keys::encode(&dump, "queue dump")
    }

    /// Bodies this replica already had (kept by the install) stay if the new
    /// state still holds their message; the others it holds go in the plan.
    fn restore(&mut self, space: &SmSpace, dump: &[u8]) -> Result<(), StorageError> {
        let d: Dump = keys::decode(dump, "queue dump")?;
        let state = QueueState::restore(d.counters.clone(), d.states.iter().copied())
            .with_handed(d.handed.clone())
            .with_times(d.times.iter().copied())
            .with_deadlines(d.deadlines.iter().copied());
        let tracked = state.tracked_seqs();
        let mut batch = sled::Batch::default();
        for (seq, at) in &d.times {
            batch.insert(space.key(&time_key(*seq)), &at.to_be_bytes()[..]);
        }
        for (seq, at) in &d.deadlines {
            batch.insert(space.key(&deadline_key(*seq)), &at.to_be_bytes()[..]);
        }
        batch.insert(space.key(COUNTERS), keys::encode(&d.counters, "queue counters")?);
        for o in &d.handed {
            batch.insert(space.key(&handed_key(*o)), &[][..]);
        }
        if let Some(f) = &d.fork {
            batch.insert(space.key(FORK), keys::encode(f, "fork record")?);
        }
        for (seq, st) in &d.states {
            batch.insert(space.key(&state_key(*seq)), keys::encode(st, "message state")?);
        }
        let mut present = BTreeSet::new();
        for kv in space.scan(b"b") {
            let (k, _) = kv?;
            let seq = u64::from_be_bytes(k[1..9].try_into().expect("body key is 9 bytes"));
            if state.holds(seq, &tracked) {
                present.insert(seq);
            } else {
                batch.remove(space.key(&k));
            }
        }
        let (missing, msgs_total) = missing_ranges(d.counters.ready_head..d.counters.next_seq, &tracked, &present);
        let plan = (!missing.is_empty()).then(|| Plan { missing, msgs_total, ..Plan::default() });
        match &plan {
            Some(p) => batch.insert(space.key(PLAN), keys::encode(p, "catch-up plan")?),
            None => batch.remove(space.key(PLAN)),
        }
        space.apply(batch)?;
        self.state = state;
        self.plan.send_replace(plan);
        Ok(())
    }
}
