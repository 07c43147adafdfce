//! Turns a stream of queue operations into few Raft entries, and answers each
//! operation when its entry is applied (and, for publishes, on every
//! synchronised replica's disk).
//!
//! openraft 0.9 runs one log append per group at a time, so an entry per
//! publish would cap a queue at the disk's sync rate. Instead, everything
//! that arrives while earlier entries are in flight goes into the next entry
//! together: the busier the queue, the bigger the entries.
//!
//! Consumers' gets and settlements have a lane of their own that goes first
//! into each entry. In arrival order they waited behind every publish queued
//! before them: with 1000 publishes of 4 KiB in flight that is a dozen
//! entries, so a consumer asked for messages (and gave its prefetch back)
//! once per dozen entries and fell behind its publisher while the queue grew.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use openraft::error::ClientWriteError;
use serde::{Deserialize, Serialize};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tokio_util::sync::CancellationToken;

use super::confirm_gate::SyncState;
use super::hush::Hush;
use super::sm::QueueStats;
use super::types::{DeadLettering, DeathReason, Limits, Message, QueueCmd, QueueReply};
use super::{QueueRaft as Raft, QueueTypes};
use crate::error::NodeError;
use crate::ids::NodeId;

/// Entries of one group in flight at once. Two keeps one appending while the
/// previous one replicates; more only makes entries smaller.
const MAX_IN_FLIGHT: usize = 2;
/// Caps on one entry, to bound memory and the time to replicate it.
const MAX_CMDS: usize = 4096;
const MAX_BYTES: usize = 256 << 10;
/// The consumer lane fills at most this many commands of an entry, so
/// publishes go on however many consumers a queue has.
const MAX_CONSUMER_CMDS: usize = MAX_CMDS / 2;

type Reply = oneshot::Sender<Result<Vec<QueueReply>, NodeError>>;
/// Where the replies of enqueued operations arrive.
pub type Answer = oneshot::Receiver<Result<Vec<QueueReply>, NodeError>>;

struct Pending {
    cmds: Vec<QueueCmd>,
    reply: Reply,
    /// A consumer's get on a queue with nothing ready: held until an
    /// entry is proposed, and put at its end (see [`Lane::Parked`]).
    park: bool,
}

/// Where operations wait for their entry at the master.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Lane {
    /// In arrival order: publishes, `basic.get` (which must see its own
    /// channel's earlier publishes), everything that orders with them.
    Arrival,
    /// A consumer's gets (gets only), in the consumer lane. With messages
    /// ready they go in the next entry like any operation. With none, they
    /// wait for the next entry proposed (a publish, most likely) and go at
    /// its end, so a message published to a waiting consumer is delivered
    /// by the entry that publishes it: one Raft round trip instead of two.
    /// If nothing is proposed and nothing becomes ready within
    /// [`PARK_MAX`], they are answered empty, as a get of an empty queue
    /// would be.
    Parked,
    /// Consumers' gets and settlements (ack, nack, reject): into the next
    /// entry ahead of whatever waits in arrival order, in their own order.
    /// Nothing in them depends on a publish still waiting: a consumer's get
    /// takes what is ready, a settlement names delivered messages.
    Consumer,
}

/// How long a parked get waits for an entry or a ready message before it is
/// answered empty (without an entry: an empty get changes nothing).
pub const PARK_MAX: Duration = Duration::from_millis(200);

/// Where the master hands the messages its entries dead-lettered, to be
/// published to the queue's dead-letter exchange. Called when an entry is
/// proposed, it answers the slot for that entry's dead letters: slots are
/// taken in log order, so dead letters are republished in the order the
/// messages died, however the entries' completions interleave.
pub type DeadLetterSink = Arc<dyn Fn() -> DeadLetterSlot + Send + Sync>;
/// An entry's dead letters; dropped unfilled when it has none or failed.
pub type DeadLetterSlot = tokio::sync::oneshot::Sender<Vec<(Message, DeathReason)>>;

/// Handle for submitting operations to one group on this node.
#[derive(Clone)]
pub struct Proposer {
    tx: mpsc::Sender<Pending>,
    /// The consumer lane ([`Lane::Consumer`]).
    consumer_tx: mpsc::Sender<Pending>,
    /// `ha-min-synchronised` (0: none), set from the effective policy.
    min_sync: Arc<AtomicUsize>,
    /// TTL, max length, dead-lettering: stamped on every entry when set.
    limits: Arc<watch::Sender<Limits>>,
    /// In-flight entry slots; holding all of them stops new entries.
    slots: Arc<Semaphore>,
}

/// The operations of the next entry, and whether it has reached the caps.
#[derive(Default)]
struct Batch {
    pending: Vec<Pending>,
    cmds: usize,
    bytes: usize,
}

impl Batch {
    fn push(&mut self, p: Pending) {
        self.cmds += p.cmds.len();
        self.bytes += approx_size(&p.cmds);
        self.pending.push(p);
    }

    fn extend(&mut self, p: Option<Pending>) {
        if let Some(p) = p {
            self.push(p);
        }
    }

    fn full(&self) -> bool {
        self.cmds >= MAX_CMDS || self.bytes >= MAX_BYTES
    }
}

fn approx_size(cmds: &[QueueCmd]) -> usize {
    cmds.iter()
        .map(|c| c.messages().map_or(32, |msgs| msgs.iter().map(|m| m.body.len() + m.properties.len() + 64).sum()))
        .sum()
}

impl Proposer {
    /// `min_sync_wait`: how long a publish waits for `ha-min-synchronised`
    /// replicas before it is refused.
    pub fn spawn(
        raft: Raft,
        hush: Arc<Hush>,
        sync: watch::Receiver<SyncState>,
        min_sync_wait: Duration,
        dead_letters: DeadLetterSink,
        stats: watch::Receiver<QueueStats>,
        stop: CancellationToken,
    ) -> Self {
        let (tx, rx) = mpsc::channel::<Pending>(65536);
        let (consumer_tx, consumer_rx) = mpsc::channel::<Pending>(65536);
        let min_sync = Arc::new(AtomicUsize::new(0));
        let limits = Arc::new(watch::Sender::new(Limits::default()));
        let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
        let task = Proposing {
            raft,
            hush,
            sync,
            min_sync: min_sync.clone(),
            min_sync_wait,
            limits: limits.clone(),
            slots: slots.clone(),
            dead_letters,
            stats,
            stop,
            rx,
            consumer_rx,
            parked: Parked::default(),
        };
        tokio::spawn(task.run());
        Self { tx, consumer_tx, min_sync, limits, slots }
    }

    /// The limits the queue's arguments and policy give it now.
    pub fn set_limits(&self, limits: Limits) {
        // Set on every reconcile: only a change wakes the expiry timer.
        self.limits.send_if_modified(|l| std::mem::replace(l, limits) != limits);
    }

    /// The limits, announced whenever they change.
    pub fn watch_limits(&self) -> watch::Receiver<Limits> {
        self.limits.subscribe()
    }

    /// Stop proposing: resolves once every entry in flight has been
    /// answered (committed, and confirmed for publishes); operations
    /// submitted meanwhile wait until the returned permit is dropped, or are
    /// refused with `NotLeader` if the group stops first.
    pub async fn hold(&self) -> tokio::sync::OwnedSemaphorePermit {
        self.slots.clone().acquire_many_owned(MAX_IN_FLIGHT as u32).await.expect("semaphore never closed")
    }

    pub fn set_min_synchronised(&self, n: usize) {
        self.min_sync.store(n, Ordering::Relaxed);
    }

    /// Submit operations; resolves with their replies in order.
    pub async fn submit(&self, cmds: Vec<QueueCmd>) -> Result<Vec<QueueReply>, NodeError> {
        self.enqueue(cmds, Lane::Arrival).await?.await.map_err(|_| NodeError::Stopped)?
    }

    /// Queue operations in `lane` behind everything enqueued there before
    /// (this is what fixes their order in the log; see [`Lane`]); the
    /// receiver answers after commit (and confirm, for publishes).
    pub async fn enqueue(&self, cmds: Vec<QueueCmd>, lane: Lane) -> Result<Answer, NodeError> {
        let (reply, rx) = oneshot::channel();
        let (tx, park) = match lane {
            Lane::Arrival => (&self.tx, false),
            Lane::Parked => (&self.consumer_tx, true),
            Lane::Consumer => (&self.consumer_tx, false),
        };
        tx.send(Pending { cmds, reply, park }).await.map_err(|_| NodeError::Stopped)?;
        Ok(rx)
    }
}

/// The task behind a [`Proposer`]: it takes operations off the lanes and
/// proposes them as entries.
struct Proposing {
    raft: Raft,
    hush: Arc<Hush>,
    sync: watch::Receiver<SyncState>,
    min_sync: Arc<AtomicUsize>,
    min_sync_wait: Duration,
    limits: Arc<watch::Sender<Limits>>,
    slots: Arc<Semaphore>,
    dead_letters: DeadLetterSink,
    stats: watch::Receiver<QueueStats>,
    stop: CancellationToken,
    rx: mpsc::Receiver<Pending>,
    consumer_rx: mpsc::Receiver<Pending>,
    parked: Parked,
}

impl Proposing {
    async fn run(mut self) {
        loop {
            // Work first, then a slot: an idle proposer holds no slot,
            // so `hold` takes them all at once.
            let first = tokio::select! {
                biased;
                _ = self.stop.cancelled() => return self.refuse_all(),
                p = self.consumer_rx.recv() => match p {
                    // Only the leader parks: elsewhere the get goes on
                    // to be refused, so its caller finds the master.
                    Some(p) if p.park && self.stats.borrow().ready == 0 && self.raft.metrics().borrow().state.is_leader() => {
                        self.parked.push(p);
                        continue;
                    }
                    Some(p) => Some((p, Lane::Consumer)),
                    None => return,
                },
                p = self.rx.recv() => match p {
                    Some(p) => Some((p, Lane::Arrival)),
                    None => return,
                },
                // Something became ready that no entry of theirs took:
                // the parked gets go in an entry of their own.
                r = self.stats.changed(), if !self.parked.is_empty() => {
                    if r.is_ok() && self.stats.borrow().ready == 0 {
                        continue;
                    }
                    None
                }
                _ = tokio::time::sleep_until(self.parked.deadline()), if !self.parked.is_empty() => {
                    self.parked.answer_empty();
                    continue;
                }
            };
            let permit = tokio::select! {
                _ = self.stop.cancelled() => {
                    if let Some((first, _)) = first {
                        let _ = first.reply.send(Err(NodeError::NotLeader { leader: None }));
                    }
                    return self.refuse_all();
                }
                p = self.slots.clone().acquire_owned() => p.expect("semaphore never closed"),
            };
            let batch = self.gather(first);
            if batch.is_empty() {
                continue;
            }
            self.propose(batch, permit).await;
        }
    }

    /// The operations of the next entry. The consumer lane first, then
    /// arrival order: an arrival that was waiting for this slot goes after
    /// the consumer lane too, so nothing waits behind more than one
    /// entry's worth.
    fn gather(&mut self, first: Option<(Pending, Lane)>) -> Vec<Pending> {
        let (mut consumer_first, mut arrival_first) = (None, None);
        match first {
            Some((p, Lane::Consumer)) => consumer_first = Some(p),
            Some((p, _)) => arrival_first = Some(p),
            None => {}
        }
        let mut batch = Batch::default();
        batch.extend(consumer_first);
        while !batch.full() && batch.cmds < MAX_CONSUMER_CMDS {
            match self.consumer_rx.try_recv() {
                Ok(p) if p.park => self.parked.push(p),
                Ok(p) => batch.push(p),
                Err(_) => break,
            }
        }
        batch.extend(arrival_first);
        while !batch.full() {
            match self.rx.try_recv() {
                Ok(p) => batch.push(p),
                Err(_) => break,
            }
        }
        let mut batch = batch.pending;
        // Parked gets go last, so they take what this entry publishes.
        batch.extend(self.parked.take());
        batch
    }

    /// Hand the entry to Raft here, in this order (that fixes its place in
    /// the log); wait for commit and confirm elsewhere.
    async fn propose(&self, batch: Vec<Pending>, permit: tokio::sync::OwnedSemaphorePermit) {
        let (mut cmds, waiters, needs_confirm) = flatten(batch);
        let limits = *self.limits.borrow();
        let stamped = limits.any() || cmds.iter().any(QueueCmd::needs_stamp);
        if stamped {
            cmds.insert(0, QueueCmd::Stamp { now_ms: now_ms(), limits });
        }
        // A quiet group's followers learn this entry's commit from
        // the heartbeats that follow it.
        self.hush.wake();
        // Boxed: the idle proposer task need not hold room for it.
        match Box::pin(self.raft.client_write_ff(Arc::new(cmds))).await {
            Ok(rx) => {
                let sync = self.sync.clone();
                let min = (needs_confirm, self.min_sync.load(Ordering::Relaxed), self.min_sync_wait);
                // A slot for the dead letters only where the entry can
                // make some: the queue's republishing task starts with its
                // first slot, and a queue stamped only for its limits
                // (a quorum queue's delivery limit) never needs one.
                let at_most_once = limits.dead_letter == DeadLettering::AtMostOnce;
                let dead = stamped.then(|| at_most_once.then(|| (self.dead_letters)()));
                tokio::spawn(finish(rx, sync, waiters, min, dead, permit));
            }
            // The group stopped (its mastership moved, or the node
            // stops) before the entry reached it: nothing was
            // proposed, so the callers may go to the new master.
            // Refused as unavailable, an ack sent during a move was
            // lost and its message redelivered.
            Err(openraft::error::Fatal::Stopped) => fail(waiters, NodeError::NotLeader { leader: None }),
            Err(fatal) => fail(waiters, NodeError::Unavailable(fatal.to_string())),
        }
    }

    /// The group stopped here: everything parked or waiting in either lane.
    fn refuse_all(&mut self) {
        self.parked.refuse();
        refuse_waiting(&mut self.consumer_rx);
        refuse_waiting(&mut self.rx);
    }
}

/// Parked consumer gets and when the oldest must be answered.
#[derive(Default)]
struct Parked {
    gets: Vec<Pending>,
    since: Option<tokio::time::Instant>,
}

impl Parked {
    fn push(&mut self, p: Pending) {
        self.since.get_or_insert_with(tokio::time::Instant::now);
        self.gets.push(p);
    }

    fn is_empty(&self) -> bool {
        self.gets.is_empty()
    }

    fn deadline(&self) -> tokio::time::Instant {
        self.since.unwrap_or_else(tokio::time::Instant::now) + PARK_MAX
    }

    fn take(&mut self) -> Vec<Pending> {
        self.since = None;
        std::mem::take(&mut self.gets)
    }

    /// Nothing came: what a get of the empty queue would have answered.
    fn answer_empty(&mut self) {
        for p in self.take() {
            let replies = p.cmds.iter().map(|_| QueueReply::Got { msgs: Vec::new(), remaining: 0 }).collect();
            let _ = p.reply.send(Ok(replies));
        }
    }

    fn refuse(&mut self) {
        for p in self.take() {
            let _ = p.reply.send(Err(NodeError::NotLeader { leader: None }));
        }
    }
}

/// The master's clock for stamps, in ms since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// The group stopped here: operations never proposed are refused with
/// `NotLeader`, so their callers retry at the queue's new master.
fn refuse_waiting(rx: &mut mpsc::Receiver<Pending>) {
    rx.close();
    while let Ok(p) = rx.try_recv() {
        let _ = p.reply.send(Err(NodeError::NotLeader { leader: None }));
    }
}

/// Per submitter: how many commands, whether any of them is a publish
/// (only those wait for, and can fail on, the confirm), where to answer.
type Waiters = Vec<(usize, bool, Reply)>;

fn flatten(batch: Vec<Pending>) -> (Vec<QueueCmd>, Waiters, bool) {
    let mut cmds = Vec::with_capacity(batch.iter().map(|p| p.cmds.len()).sum());
    let mut waiters = Vec::with_capacity(batch.len());
    for p in batch {
        waiters.push((p.cmds.len(), p.cmds.iter().any(QueueCmd::needs_confirm), p.reply));
        cmds.extend(p.cmds);
    }
    let needs_confirm = cmds.iter().any(QueueCmd::needs_confirm);
    (cmds, waiters, needs_confirm)
}

fn fail(waiters: Waiters, e: NodeError) {
    for (_, _, reply) in waiters {
        let _ = reply.send(Err(e.clone()));
    }
}

type WriteAnswer = oneshot::Receiver<
    Result<openraft::raft::ClientWriteResponse<QueueTypes>, ClientWriteError<NodeId, openraft::BasicNode>>,
>;

/// Wait for commit and, for publishes, the confirm; answer the waiters.
/// `(needs_confirm, min_sync, wait)`: with `min_sync` > 0 a confirm also
/// needs that many synchronised replicas, waited for at most `wait` (with
/// the in-flight slot released: other operations go on meanwhile).
async fn finish(
    rx: WriteAnswer,
    mut sync: watch::Receiver<SyncState>,
    waiters: Waiters,
    (needs_confirm, min_sync, wait): (bool, usize, Duration),
    dead_letters: Option<Option<DeadLetterSlot>>,
    permit: tokio::sync::OwnedSemaphorePermit,
) {
    let result = match rx.await {
        Ok(Ok(resp)) => {
            let replies = resp.data;
            let (term, index) = (resp.log_id.leader_id.term, resp.log_id.index);
            if needs_confirm {
                let slow =
                    tokio::time::timeout(Duration::from_secs(3), sync.wait_for(|s| s.confirms(term, index).is_some()))
                        .await
                        .is_err();
                if slow {
                    // Normal while a mirror is being dropped from the
                    // synchronised set; worth seeing when it is not.
                    tracing::info!(term, index, sync = ?*sync.borrow(), "confirm waiting over 3 s");
                }
                let mut confirmed = match sync.wait_for(|s| s.confirms(term, index).is_some()).await {
                    Ok(s) if s.confirms(term, index) == Some(Ok(())) => Ok(()),
                    _ => Err(NodeError::Unconfirmed(format!(
                        "leadership of term {term} ended before every replica had entry {index}"
                    ))),
                };
                drop(permit);
                if confirmed.is_ok() && min_sync > 1 {
                    let enough = |s: &SyncState| s.term > term || s.synchronised.len() >= min_sync;
                    confirmed = match tokio::time::timeout(wait, sync.wait_for(enough)).await {
                        Ok(Ok(s)) if s.term == term => Ok(()),
                        _ => Err(NodeError::Unconfirmed(format!(
                            "fewer than ha-min-synchronised = {min_sync} replicas are synchronised"
                        ))),
                    };
                }
                Ok((replies, confirmed))
            } else {
                Ok((replies, Ok(())))
            }
        }
        Ok(Err(ClientWriteError::ForwardToLeader(f))) => Err(NodeError::NotLeader { leader: f.leader_id }),
        Ok(Err(e)) => Err(NodeError::Unavailable(e.to_string())),
        Err(_) => Err(NodeError::Stopped),
    };
    match result {
        // Committed: every operation took effect. Publishes answer with the
        // confirm's outcome; the others (gets, acks) with their replies,
        // which must reach their callers even when a publish beside them
        // could not be confirmed.
        Ok((replies, confirmed)) => {
            let mut it = replies.into_iter();
            if let Some(slot) = dead_letters {
                // The entry's stamp: its reply is the master's, not a caller's.
                if let (Some(QueueReply::DeadLetters { msgs }), Some(slot)) = (it.next(), slot) {
                    if !msgs.is_empty() {
                        let _ = slot.send(msgs);
                    }
                }
            }
            for (n, publishes, reply) in waiters {
                let mine: Vec<QueueReply> = it.by_ref().take(n).collect();
                let _ = reply.send(match (&confirmed, publishes) {
                    (Err(e), true) => Err(e.clone()),
                    _ => Ok(mine),
                });
            }
        }
        Err(e) => fail(waiters, e),
    }
}
