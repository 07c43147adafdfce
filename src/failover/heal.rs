//! Healing a replica of an older epoch into the newer one, and handing
//! back what only the older epoch's replicas had stored.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use openraft::storage::RaftLogStorage;
use openraft::{Entry, EntryPayload, RaftLogReader};

use super::epoch::{heal_key, load_epoch};
use super::split::{add_defeated, defeated, left_through_own_forks, own_record, Formed, Undecided, Verdict};
use super::Busy;
use crate::error::NodeError;
use crate::failover::{Failover, Host, QueueGroup};
use crate::ids::{GroupId, NodeId};
use crate::metadata::QueueMeta;
use crate::queue::epoch::{divergence, shared_numbers, Epoch, EpochReport, ForkRecord, Inherited};
use crate::queue::state::{message_key, numbered_in};
use crate::queue::types::Origin;
use crate::queue::{Holdings, Message, QueueCmd, QueueMachine, QueueReply};
use crate::queue::{QueueLog as LogStore, QueueTypes};
use crate::raft::state_machine::stored_applied;
use crate::wire::ask::{self, Handed};
use crate::wire::raft_net::EpochNews;
use mirrorq_storage::{SmSpace, StorageError};

/// Handed-back messages travel in chunks of at most this many bytes.
const HANDBACK_CHUNK_BYTES: usize = 1 << 20;

/// Messages handed back together: those one old-epoch entry published
/// (its origin, where known), each with its own key where known.
pub(super) type Batch = ask::HandbackBatch;

/// What a log entry published: its origin and its messages, each with
/// the key a hand-back gave it (a message handed back under a key keeps
/// it when handed back again from an entry never applied).
pub(super) fn publishes(e: &Entry<QueueTypes>) -> (Origin, Vec<(&Message, Option<Origin>)>) {
    let origin = (e.log_id.leader_id.term, e.log_id.leader_id.node_id, e.log_id.index);
    let mut msgs = Vec::new();
    if let EntryPayload::Normal(cmds) = &e.payload {
        for c in cmds.iter() {
            match c {
                QueueCmd::Enqueue { msgs: m }
                | QueueCmd::EnqueueExpiring { msgs: m, .. }
                | QueueCmd::Handback { msgs: m, .. } => msgs.extend(m.iter().map(|m| (m, None))),
                QueueCmd::HandbackKeyed { msgs: m, keys, .. } => {
                    msgs.extend(m.iter().enumerate().map(|(i, m)| (m, keys.get(i).copied().flatten())))
                }
                _ => {}
            }
        }
    }
    (origin, msgs)
}

/// The key of our stored message `seq` (`state::message_key`): the same
/// on every replica of our epoch, read from its log or its stored state.
fn key_of(ours: Epoch, line: &[Inherited], seq: u64) -> Option<Origin> {
    Some(message_key(numbered_in(ours, line, seq), seq))
}

/// Stored messages handed back one per batch, each under its own key: no
/// log entry names them here (the log was compacted past them).
fn numbered(ours: Epoch, line: &[Inherited], msgs: Vec<(u64, Message)>) -> impl Iterator<Item = Batch> + '_ {
    msgs.into_iter().map(move |(seq, m)| (None, vec![(key_of(ours, line, seq), m)]))
}

impl<H: Host> Failover<H> {
    /// A peer is in a newer epoch of a group we host. If our group kept its
    /// majority from before that epoch formed, that epoch is a minority's
    /// fork: it yields to us. Otherwise hand back what that epoch lacks,
    /// wipe our replica and rejoin it as a new mirror.
    pub(super) async fn heal(&self, news: EpochNews) {
        let group = news.group;
        // Undecided a moment ago about this epoch: every message of the
        // fork brings news of it, and asking again at each would hold the
        // group busy (no master move, no graceful hand-over) all along.
        let lately = |g: &QueueGroup| g.ext.split.undecided_lately(news.epoch, self.timing().failure_timeout);
        let asked = self.replicas().any(group, lately);
        if asked {
            return;
        }
        let Some(_busy) = Busy::take(&self.shared().busy, group) else { return };
        let Some(g) = self.replicas().get(group) else { return };
        if g.epoch >= news.epoch {
            return;
        }
        let q = g.meta.clone();
        let io = |e: StorageError| tracing::error!(queue = %q.name, error = %e, "cannot record a defeated epoch");
        match defeated(self.db(), group) {
            // Judged a minority's fork before; unless our own group has
            // since left for newer epochs (a verdict on disk must not hold a
            // master alone in an epoch its mirrors left).
            Ok(d) if d.contains(&news.epoch) && self.majority_still_ours(&g) => {
                return self.tell_to_yield(&g, news).await
            }
            Ok(_) => {}
            Err(e) => return io(e),
        }
        let verdict = self.split_verdict(&g, news).await;
        // Asking took a while: the replica may have been removed meanwhile
        // (the queue deleted or moved away), and a verdict must not outlive it.
        if !self.replicas().is_current(&g) {
            return;
        }
        match verdict {
            Verdict::Defer => return,
            Verdict::Undecided(why) => {
                g.ext.split.undecided(news.epoch);
                let what = format!("epoch {} formed by node {}: {why:?}", news.epoch, news.epoch.node);
                if self.repeated(group, "split-undecided", &what) {
                    match why {
                        Undecided::CannotAsk => {
                            tracing::warn!(queue = %q.name, ours = %g.epoch, theirs = %news.epoch, from = news.from, "a newer epoch of the queue exists, but none of its replicas that answer can tell when it formed: this group keeps its majority and goes on serving until one can (told once)")
                        }
                        Undecided::NoMaster => {
                            tracing::warn!(queue = %q.name, ours = %g.epoch, theirs = %news.epoch, from = news.from, "a newer epoch of the queue exists but has no master to hand back to; waiting for one, or for this group's master to decide (told once)")
                        }
                    }
                }
                return;
            }
            Verdict::Keep => {
                self.cleared(group, "split-undecided");
                tracing::warn!(queue = %q.name, ours = %g.epoch, theirs = %news.epoch, from = news.from, "a minority re-formed the queue while this group kept its majority: its epoch yields to ours");
                if let Err(e) = add_defeated(self.db(), group, news.epoch) {
                    return io(e);
                }
                return self.tell_to_yield(&g, news).await;
            }
            Verdict::Heal => self.cleared(group, "split-undecided"),
        }
        tracing::warn!(queue = %q.name, ours = %g.epoch, theirs = %news.epoch, from = news.from, "replica is in an older epoch: healing");
        self.rejoin(g, news, false).await;
    }

    /// Our replica is in `defeated`, a minority's fork; the group of
    /// `winner` (whose replica on `from` told us) kept its majority: hand
    /// back to it what it may lack and rejoin it.
    pub(crate) async fn yield_to(&self, group: GroupId, defeated: Epoch, winner: Epoch, from: NodeId) {
        let Some(_busy) = Busy::take(&self.shared().busy, group) else { return };
        let Some(g) = self.replicas().get(group) else { return };
        if g.epoch != defeated {
            return;
        }
        tracing::warn!(queue = %g.meta.name, ours = %g.epoch, winner = %winner, from, "this replica's epoch is a minority's fork and yields to the group that kept its majority");
        self.rejoin(g, EpochNews { group, epoch: winner, from }, true).await;
    }

    /// Give our own group an election's time to commit what our log
    /// holds beyond what our replica applied. A replica restarted after a
    /// crash may have lost the applied state of entries its group had
    /// committed (a get, an ack): what it tells the epoch it joins that it
    /// still holds would bring those messages back. Entries our group can
    /// no longer commit (no majority) only cost the wait, and what it
    /// tells is then the applied state: more than it holds, never less.
    async fn apply_own_log(&self, g: &QueueGroup) {
        let m = g.raft.metrics().borrow().clone();
        let applied = m.last_applied.map(|l| l.index);
        if m.last_log_index <= applied {
            return;
        }
        let limit = self.timing().election_max * 2;
        let done = g.raft.wait(Some(limit)).applied_index_at_least(m.last_log_index, "own log applied").await;
        if done.is_err() {
            tracing::info!(queue = %g.meta.name, applied = ?applied, last = ?m.last_log_index, "rejoining with entries this replica's group did not commit in time");
        }
    }

    /// Stop our replica of `g`, hand back to the master of `news.epoch`
    /// what that epoch may lack, wipe the replica and restart it in that
    /// epoch. `yielding`: the target epoch is the group our fork came
    /// from, whose history is read from its live log (it has no fork
    /// record of its own).
    pub(crate) async fn rejoin(&self, g: Arc<QueueGroup>, news: EpochNews, yielding: bool) {
        let group = news.group;
        let q = g.meta.clone();
        self.apply_own_log(&g).await;
        if !self.take_out(&g) {
            return;
        }
        g.stop.cancel();
        g.shut_down().await;
        tracing::info!(queue = %q.name, "replica stopped to rejoin another epoch");

        let mut news = news;
        let result: Result<(), NodeError> = async {
            // The hand-back goes to the newest epoch we hear of; our log is
            // untouched until it is taken, so starting over is safe.
            loop {
                let fork = left_through_own_forks(self.db(), group, g.epoch, news.epoch).filter(|_| yielding);
                let (batches, shared) = match fork {
                    // We formed the fork: what we stored since is ours alone.
                    Some(f) => (self.stored_since_fork(group, g.epoch, f).await?, Some((f.next_seq, f.next_order))),
                    None => {
                        let record = if yielding {
                            self.fetch_history(group, news).await
                        } else {
                            self.fetch_fork(group, news).await
                        };
                        // A replica answered from a newer epoch: what we
                        // hand back is judged against its history, so it
                        // goes there, and we join that one.
                        if let Some(r) = record.as_ref().filter(|r| r.epoch > news.epoch) {
                            news.epoch = r.epoch;
                        }
                        tracing::info!(queue = %q.name, epoch = %news.epoch, found = record.is_some(), "history of the epoch to join");
                        let shared = self.shared_numbers(&g, news, record.as_ref());
                        (self.handback_set(group, g.epoch, record.as_ref(), shared).await?, shared)
                    }
                };
                let space = SmSpace::new(self.db().clone(), group);
                let holdings = shared.map(|s| QueueMachine::holdings(&space, s)).transpose();
                let holdings = holdings.map_err(|e| NodeError::Unavailable(e.to_string()))?;
                let count: usize = batches.iter().map(|b| b.1.len()).sum();
                match self.send_handback(&q, news, holdings, batches).await? {
                    Sent::Taken { settled } => {
                        tracing::warn!(queue = %q.name, handed_back = count, settled, epoch = %news.epoch, "messages handed back, and those consumed on this side settled there");
                        break;
                    }
                    Sent::Newer(newer) if yielding => {
                        return Err(NodeError::Unavailable(format!(
                            "the group to yield to moved on to epoch {}; retrying from news of it",
                            newer.epoch
                        )))
                    }
                    Sent::Newer(newer) => news = newer,
                }
            }
            let db = self.db();
            let io = |e: StorageError| NodeError::Unavailable(e.to_string());
            db.put_node_value(&heal_key(group), &mirrorq_storage::keys::encode(&news.epoch, "healing marker").map_err(io)?)
                .map_err(io)?;
            load_epoch(db, group, self.id()).map_err(|e| NodeError::Unavailable(e.to_string()))?;
            Ok(())
        }
        .await;
        match &result {
            Ok(()) => {
                self.metrics().queue_rejoins.inc();
                self.cleared(group, "rejoin");
            }
            Err(e) => {
                if self.repeated(group, "rejoin", &e.to_string()) {
                    tracing::error!(queue = %q.name, error = %e, "rejoining failed; the replica restarts in its own epoch and retries (told once until it changes)");
                }
            }
        }
        let state = self.metadata();
        if let Err(e) = self.start_group(q.clone(), &state).await {
            tracing::error!(queue = %q.name, error = %e, "cannot restart the queue replica after rejoining");
        }
    }

    /// What the (stopped) replica that formed a fork holds that the group
    /// it forked from lacks: messages stored since the fork, and publishes
    /// in entries not applied here.
    pub(super) async fn stored_since_fork(
        &self,
        group: GroupId,
        ours: Epoch,
        f: Formed,
    ) -> Result<Vec<Batch>, NodeError> {
        let io = |e: &dyn std::fmt::Display| NodeError::Unavailable(e.to_string());
        let db = self.db().clone();
        let space = SmSpace::new(db.clone(), group);
        let line = self.our_line(group, ours);
        let stored = QueueMachine::stored_since(&space, f.next_seq, f.next_order).map_err(|e| io(&e))?;
        let mut out: Vec<Batch> = numbered(ours, &line, stored).collect();
        let start = stored_applied(&space).map_err(|e| io(&e))?.map_or(0, |l| l.index + 1);
        let mut log = LogStore::new(db, group);
        let mut reader = log.get_log_reader().await;
        for e in reader.try_get_log_entries(start..).await.map_err(|e| io(&e))? {
            let (origin, msgs) = publishes(&e);
            if !msgs.is_empty() {
                out.push((Some(origin), msgs.into_iter().map(|(m, key)| (key, m.clone())).collect()));
            }
        }
        out.retain(|b| !b.1.is_empty());
        Ok(out)
    }

    /// The ancestry of our epoch, from its fork record (none for an epoch
    /// founded as the group was, or whose record this replica lacks: then
    /// every number counts as given by `ours`, which holds it all the same).
    fn our_line(&self, group: GroupId, ours: Epoch) -> Vec<Inherited> {
        own_record(self.db(), group, ours).ok().flatten().map(|r| r.inherited).unwrap_or_default()
    }

    /// Which of our replica's messages the epoch we join holds or consumed
    /// already, by their numbers (`queue::epoch::shared_numbers`), from its
    /// fork record and ours.
    fn shared_numbers(&self, g: &QueueGroup, news: EpochNews, record: Option<&ForkRecord>) -> Option<(u64, u64)> {
        // The hand-back goes to `news.epoch`: a record of another epoch (a
        // newer one that a replica answered from) tells nothing of what
        // that one holds.
        let their_line = record.filter(|r| r.epoch == news.epoch).map_or(&[][..], |r| &r.inherited);
        let our_line = self.our_line(g.meta.group, g.epoch);
        shared_numbers(g.epoch, &our_line, news.epoch, their_line)
    }

    /// Whom to ask about the newer epoch of `news`, in order: the node that
    /// told us, the epoch's former, then the queue's other replicas.
    pub(crate) fn asked_about(&self, q: &QueueMeta, news: EpochNews) -> Vec<NodeId> {
        let mut peers: Vec<NodeId> = Vec::new();
        for p in [news.from, news.epoch.node].into_iter().chain(q.replicas.iter().copied()) {
            if p != self.id() && !peers.contains(&p) {
                peers.push(p);
            }
        }
        peers
    }

    /// The history of `news.epoch` from a replica of it: its live log's
    /// leader ids. `None` if no one answers (then everything is handed back).
    pub(super) async fn fetch_history(&self, group: GroupId, news: EpochNews) -> Option<ForkRecord> {
        let q = self.metadata().queues.values().find(|q| q.group == group).cloned()?;
        for peer in self.asked_about(&q, news) {
            let limit = Instant::now() + Duration::from_secs(5);
            if let Ok(Some(rec)) = self.ask(peer, ask::History { group }, limit).await {
                if rec.epoch == news.epoch {
                    return Some(rec);
                }
            }
        }
        None
    }

    /// Ask the peer that told us (then the other replicas) for the newer
    /// epoch's fork record. `None` if no one has it: then everything we hold
    /// is handed back.
    pub(super) async fn fetch_fork(&self, group: GroupId, news: EpochNews) -> Option<ForkRecord> {
        let q = self.metadata().queues.values().find(|q| q.group == group).cloned()?;
        let peers = self.asked_about(&q, news);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let answers = self.ask_forks(group, &peers).await;
            if let Some(rec) = answers.into_iter().filter_map(|(_, a)| a.record).find(|rec| rec.epoch >= news.epoch) {
                return Some(rec);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        None
    }

    /// What each of `peers`' replica of `group` tells of its epoch, asked
    /// all at once; those that do not answer in a second are left out.
    pub(crate) async fn ask_forks(&self, group: GroupId, peers: &[NodeId]) -> Vec<(NodeId, EpochReport)> {
        let limit = Instant::now() + Duration::from_secs(1);
        let answers = futures::future::join_all(peers.iter().map(|p| self.ask(*p, ask::Fork { group }, limit))).await;
        peers.iter().zip(answers).filter_map(|(p, a)| a.ok().flatten().map(|r| (*p, r))).collect()
    }

    /// Every message this (stopped) replica holds that the epoch described
    /// by `record` may lack, grouped by the log entry that published it:
    /// live messages published after the point where the histories part,
    /// and every publish in log entries not applied here. Where the logs
    /// cannot tell that point (ours compacted past it), `inherited` (message
    /// numbers below which that epoch holds ours already) keeps the
    /// inherited messages here; without it, everything live goes back.
    pub(super) async fn handback_set(
        &self,
        group: GroupId,
        ours: Epoch,
        record: Option<&ForkRecord>,
        inherited: Option<(u64, u64)>,
    ) -> Result<Vec<Batch>, NodeError> {
        let io = |e: &dyn std::fmt::Display| NodeError::Unavailable(e.to_string());
        let line = self.our_line(group, ours);
        let db = self.db().clone();
        let space = SmSpace::new(db.clone(), group);
        let mut log = LogStore::new(db, group);
        let log_state = log.get_log_state().await.map_err(|e| io(&e))?;
        let ids = log.log_ids().map_err(|e| io(&e))?;
        let shared = record.and_then(|r| divergence(r, log_state.last_purged_log_id, &ids));
        let applied = stored_applied(&space).map_err(|e| io(&e))?.map(|l| l.index);
        let mut reader = log.get_log_reader().await;
        let mut out = Vec::new();
        // Applied past the shared point: of what those entries published,
        // what is still live here.
        if let Some(a) = applied.filter(|a| shared.is_none_or(|p| p < *a)) {
            let purged = log_state.last_purged_log_id.map(|l| l.index);
            match shared {
                Some(p) if purged.is_none_or(|x| x <= p) => {
                    let entries = reader.try_get_log_entries(p + 1..=a).await.map_err(|e| io(&e))?;
                    // Which of these entries' messages are still live here,
                    // by content: an entry's publishes do not map to seqs
                    // by counting (a publish refused by reject-publish takes
                    // none). A live message is always found; an identical
                    // twin can only make a consumed one go back too (a
                    // duplicate, never a loss). Each goes back under its
                    // entry and its number (lowest first, as the entries
                    // numbered them): another replica of our epoch may
                    // name it by either.
                    let stored = QueueMachine::stored_live(&space).map_err(|e| io(&e))?;
                    let mut live_here: HashMap<&Message, VecDeque<u64>> = HashMap::new();
                    for (seq, m) in &stored {
                        live_here.entry(m).or_default().push_back(*seq);
                    }
                    for e in &entries {
                        let (origin, msgs) = publishes(e);
                        let mut live = Vec::new();
                        for (m, _) in msgs {
                            if let Some(seq) = live_here.get_mut(m).and_then(|seqs| seqs.pop_front()) {
                                live.push((key_of(ours, &line, seq), m.clone()));
                            }
                        }
                        if !live.is_empty() {
                            out.push((Some(origin), live));
                        }
                    }
                }
                // The entries are gone: what the other epoch did not
                // inherit goes back, or else everything live.
                _ => {
                    let (seq, order) = inherited.unwrap_or((0, 0));
                    let since = QueueMachine::stored_since(&space, seq, order).map_err(|e| io(&e))?;
                    out.extend(numbered(ours, &line, since));
                }
            }
        }
        // Not applied here (not known to be committed, maybe confirmed):
        // what each publish would have stored, from a replay on the stored
        // state (a publish refused by reject-publish was never confirmed and
        // must not appear), from the first entry not applied on.
        let start = [shared, applied].into_iter().flatten().max().map_or(0, |i| i + 1);
        let first = applied.map_or(0, |a| a + 1);
        let unapplied = reader.try_get_log_entries(first..).await.map_err(|e| io(&e))?;
        let cmds: Vec<Vec<QueueCmd>> = unapplied
            .iter()
            .map(|e| match &e.payload {
                EntryPayload::Normal(c) => c.to_vec(),
                _ => Vec::new(),
            })
            .collect();
        let stored = QueueMachine::would_store(&space, &cmds).map_err(|e| io(&e))?;
        for ((e, cmds), counts) in unapplied.iter().zip(&cmds).zip(stored) {
            if e.log_id.index < start {
                continue;
            }
            let origin = (e.log_id.leader_id.term, e.log_id.leader_id.node_id, e.log_id.index);
            let mut msgs = Vec::new();
            for (c, n) in cmds.iter().zip(counts) {
                match c {
                    QueueCmd::Enqueue { msgs: m } | QueueCmd::EnqueueExpiring { msgs: m, .. } => {
                        msgs.extend(m.iter().take(n as usize).map(|m| (None, m.clone())))
                    }
                    QueueCmd::Handback { msgs: m, .. } if n > 0 => msgs.extend(m.iter().map(|m| (None, m.clone()))),
                    // Under the keys they came with: the receiver keeps
                    // each once, whoever hands it back.
                    QueueCmd::HandbackKeyed { msgs: m, keys, .. } if n > 0 => {
                        msgs.extend(m.iter().enumerate().map(|(i, m)| (keys.get(i).copied().flatten(), m.clone())))
                    }
                    _ => {}
                }
            }
            if !msgs.is_empty() {
                out.push((Some(origin), msgs));
            }
        }
        Ok(out)
    }

    /// Tell the master of the newer epoch what we hold of the messages we
    /// share with it (`holdings`), so it drops what our consumers took,
    /// then give it our messages, a chunk at a time, each answered once
    /// confirmed there.
    pub(super) async fn send_handback(
        &self,
        q: &QueueMeta,
        news: EpochNews,
        holdings: Option<Holdings>,
        batches: Vec<Batch>,
    ) -> Result<Sent, NodeError> {
        let deadline = Instant::now() + self.timing().op_timeout * 4;
        let mut candidates = self.asked_about(q, news);
        if candidates.is_empty() {
            candidates.push(news.from);
        }
        let mut target = news.from;
        let mut attempt = 0usize;
        let mut settled = 0;
        let steps = holdings.map(Step::Merge).into_iter().chain(chunks(batches).map(Step::Handback));
        for step in steps {
            loop {
                let limit = Instant::now() + Duration::from_secs(10);
                let (group, epoch) = (q.group, news.epoch);
                let answer = match &step {
                    Step::Merge(holdings) => {
                        self.ask(target, ask::Merge { group, epoch, holdings: holdings.clone() }, limit).await
                    }
                    Step::Handback(batches) => {
                        self.ask(target, ask::Handback { group, epoch, batches: batches.clone() }, limit).await
                    }
                };
                match answer {
                    Ok(Handed::Answered(Ok(replies))) => {
                        if let (Step::Merge(_), [QueueReply::Purged { count }]) = (&step, &replies[..]) {
                            settled = *count;
                        }
                        break;
                    }
                    Ok(Handed::NewerEpoch(epoch)) if epoch > news.epoch => {
                        return Ok(Sent::Newer(EpochNews { group: q.group, epoch, from: target }));
                    }
                    Ok(Handed::Answered(Err(NodeError::NotLeader { leader: Some(l) }))) if l != target => target = l,
                    other => {
                        tracing::debug!(queue = %q.name, target, answer = ?other.map(|_| ()), "hand-back not taken yet");
                        if Instant::now() > deadline {
                            return Err(NodeError::Unavailable(
                                "no master of the newer epoch took the hand-back".into(),
                            ));
                        }
                        attempt += 1;
                        target = candidates[attempt % candidates.len()];
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }
        Ok(Sent::Taken { settled })
    }
}

/// What [`Failover::send_handback`] did.
pub(super) enum Sent {
    /// The master took it all; it dropped `settled` messages our side's
    /// consumers had taken.
    Taken { settled: u64 },
    /// A replica answered with an even newer epoch, which is where the
    /// messages must go instead.
    Newer(EpochNews),
}

/// One request of a hand-back.
enum Step {
    Merge(Holdings),
    Handback(Vec<Batch>),
}

/// Batches in chunks of about [`HANDBACK_CHUNK_BYTES`].
fn chunks(batches: Vec<Batch>) -> impl Iterator<Item = Vec<Batch>> {
    let mut rest = batches.into_iter().peekable();
    std::iter::from_fn(move || {
        rest.peek()?;
        let mut chunk = Vec::new();
        let mut bytes = 0;
        while let Some(b) = rest.next_if(|_| chunk.is_empty() || bytes <= HANDBACK_CHUNK_BYTES) {
            bytes += b.1.iter().map(|(_, m)| m.body.len() + m.properties.len()).sum::<usize>();
            chunk.push(b);
        }
        Some(chunk)
    })
}
