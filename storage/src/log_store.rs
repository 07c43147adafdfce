//! openraft's `RaftLogStorage` for one group: entries in the node's
//! write-ahead log, vote and purge point in sled's `raft_meta` tree.

use std::collections::VecDeque;
use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::sync::{Arc, Mutex};

use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{
    AnyError, ErrorSubject, ErrorVerb, LogId, OptionalSend, RaftLogId, RaftLogReader, RaftTypeConfig, StorageIOError,
    Vote,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::keys::{self, meta_key, META_COMMITTED, META_PURGED, META_VOTE};
use crate::{GroupId, NodeDb, StorageError};

type RaftStorageError<C> = openraft::StorageError<<C as RaftTypeConfig>::NodeId>;

/// Bytes of the newest entries a group keeps decoded in memory. Every
/// entry is read back right after it is written, to apply it and (on a
/// leader) once per mirror to replicate it; decoding it each time was 6-9%
/// of a node's CPU. A few entries in flight are all that is read
/// back, so the bound is small (it holds per group, busy or idle).
const RECENT_BYTES: usize = 512 << 10;

/// The log, vote and committed id of one Raft group.
///
/// Cheap to clone: clones share the database and the recent entries, and are
/// used as log readers by openraft's replication tasks. While a group's Raft
/// runs, only its store (and clones) may write its log: another instance's
/// writes would not reach these recent entries (writes from outside Raft,
/// [`LogStore::refound`], happen while it is stopped, and the group then
/// starts on a new store).
pub struct LogStore<C: RaftTypeConfig> {
    db: NodeDb,
    group: GroupId,
    recent: Arc<Mutex<Recent<C::Entry>>>,
    /// Which of the entries appended through this store are durable.
    durability: Durability,
}

/// Which of a group's log entries are on this node's disk, as its appends'
/// syncs complete. A leader applies an entry its mirrors committed before
/// its own sync of it (the leader's write runs in parallel with theirs),
/// and applying a publish writes a reference into that entry: a state
/// machine that waits here before it applies never makes durable a
/// reference to an entry a power cut can take from the log.
///
/// Only appends made through [`LogStore::append`] are tracked; entries
/// written otherwise (founding, re-founding) are synced before the group's
/// Raft starts, and what the log held when it was opened counts as durable.
/// Clones share the record.
#[derive(Clone, Default)]
pub struct Durability {
    inner: Arc<DurabilityInner>,
}

#[derive(Default)]
struct DurabilityInner {
    unsynced: Mutex<Unsynced>,
    /// Woken whenever appends become durable or a sync fails.
    changed: tokio::sync::Notify,
}

#[derive(Default)]
struct Unsynced {
    /// Appends written and not yet synced, in the order written: their
    /// first and last index and their number. Indexes rise along it: only
    /// a truncation writes below an earlier append, and it cuts every
    /// append from its index on.
    appends: VecDeque<(u64, u64, u64)>,
    /// The number the next append gets.
    next: u64,
    /// A sync failed: nothing written since the last good one will ever
    /// be durable in this process (fail-stop).
    failed: bool,
}

impl Durability {
    /// Whether every entry up to `index` that the log holds now is
    /// durable; `Err` once a sync failed.
    pub fn covers(&self, index: u64) -> Result<bool, StorageError> {
        let unsynced = self.inner.unsynced.lock().expect("poisoned");
        if unsynced.failed {
            return Err(StorageError::SyncFailed);
        }
        Ok(unsynced.appends.front().is_none_or(|(first, _, _)| *first > index))
    }

    /// Wait until [`Durability::covers`] `index`. At once when the log's
    /// syncs keep up; else until the append holding it (and every one
    /// before) is synced.
    pub async fn wait(&self, index: u64) -> Result<(), StorageError> {
        loop {
            let changed = self.inner.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            if self.covers(index)? {
                return Ok(());
            }
            changed.await;
        }
    }

    /// Entries `first..=last` were written; their number, for
    /// [`Durability::synced`].
    fn written(&self, first: u64, last: u64) -> u64 {
        let mut unsynced = self.inner.unsynced.lock().expect("poisoned");
        let n = unsynced.next;
        unsynced.next += 1;
        unsynced.appends.push_back((first, last, n));
        n
    }

    /// The sync covering append `n` completed (`ok`) or failed. The
    /// flusher completes appends in the order they were written, and a
    /// sync covers everything written before it began.
    fn synced(&self, n: u64, ok: bool) {
        {
            let mut unsynced = self.inner.unsynced.lock().expect("poisoned");
            if ok {
                while unsynced.appends.front().is_some_and(|(_, _, m)| *m <= n) {
                    unsynced.appends.pop_front();
                }
            } else {
                unsynced.failed = true;
            }
        }
        self.inner.changed.notify_waiters();
    }

    /// The log drops its entries from `index` on: appends of them are
    /// nothing to wait for any more.
    fn truncated(&self, index: u64) {
        let mut unsynced = self.inner.unsynced.lock().expect("poisoned");
        while unsynced.appends.back().is_some_and(|(first, _, _)| *first >= index) {
            unsynced.appends.pop_back();
        }
        if let Some(back) = unsynced.appends.back_mut() {
            back.1 = back.1.min(index.saturating_sub(1));
        }
        drop(unsynced);
        self.inner.changed.notify_waiters();
    }
}

/// The newest entries of the log, consecutive, ending at its last entry
/// (when not empty).
struct Recent<E> {
    entries: VecDeque<(u64, usize, E)>,
    bytes: usize,
}

impl<E> Recent<E> {
    fn new() -> Self {
        Self { entries: VecDeque::new(), bytes: 0 }
    }

    /// Whether entry `index` comes right after the last one kept.
    fn follows(&self, index: u64) -> bool {
        self.entries.back().is_some_and(|(last, _, _)| last.checked_add(1) == Some(index))
    }

    fn push(&mut self, index: u64, size: usize, entry: E) {
        if !self.entries.is_empty() && !self.follows(index) {
            self.clear();
        }
        if size > RECENT_BYTES {
            // Kept only in the log; nothing after it may be cached without it.
            self.clear();
            return;
        }
        self.entries.push_back((index, size, entry));
        self.bytes += size;
        while self.bytes > RECENT_BYTES {
            let (_, size, _) = self.entries.pop_front().expect("bytes counted for some entry");
            self.bytes -= size;
        }
    }

    fn clear(&mut self) {
        self.entries.clear();
        self.bytes = 0;
    }

    /// Drop entries from `index` on (truncate).
    fn drop_from(&mut self, index: u64) {
        while self.entries.back().is_some_and(|(i, _, _)| *i >= index) {
            let (_, size, _) = self.entries.pop_back().expect("checked");
            self.bytes -= size;
        }
    }

    /// Drop entries up to `index` (purge).
    fn drop_through(&mut self, index: u64) {
        while self.entries.front().is_some_and(|(i, _, _)| *i <= index) {
            let (_, size, _) = self.entries.pop_front().expect("checked");
            self.bytes -= size;
        }
    }
}

impl<E: Clone> Recent<E> {
    /// Entries `start..=end` if the first is here: the rest of the log is
    /// here too (this ends at the log's last entry).
    fn get(&self, start: u64, end: u64) -> Option<Vec<E>> {
        let first = self.entries.front()?.0;
        if start < first {
            return None;
        }
        let skip = usize::try_from(start - first).ok()?;
        if skip >= self.entries.len() {
            return None;
        }
        let take = usize::try_from(end - start).map_or(usize::MAX, |n| n.saturating_add(1));
        Some(self.entries.iter().skip(skip).take(take).map(|(_, _, e)| e.clone()).collect())
    }
}

impl<C: RaftTypeConfig> Clone for LogStore<C> {
    fn clone(&self) -> Self {
        Self {
            db: self.db.clone(),
            group: self.group,
            recent: self.recent.clone(),
            durability: self.durability.clone(),
        }
    }
}

impl<C: RaftTypeConfig> LogStore<C> {
    pub fn new(db: NodeDb, group: GroupId) -> Self {
        Self { db, group, recent: Arc::new(Mutex::new(Recent::new())), durability: Durability::default() }
    }

    /// Which entries appended through this store (and its clones) are
    /// durable.
    pub fn durability(&self) -> Durability {
        self.durability.clone()
    }

    fn wal(&self) -> &crate::Wal {
        self.db.wal()
    }

    fn recent(&self) -> std::sync::MutexGuard<'_, Recent<C::Entry>> {
        self.recent.lock().expect("poisoned")
    }

    pub fn group(&self) -> GroupId {
        self.group
    }

    /// A write the log refuses leaves it failed for good (fail-stop), but
    /// for a full disk (`NoSpace`), which leaves it as it was: a flusher
    /// round meets a failed log and stops the node now, not at whatever
    /// sync comes next (an idle node may not sync for a long time).
    fn write_failed(&self, verb: ErrorVerb, e: crate::WalError) -> RaftStorageError<C> {
        self.db.flusher().submit_log(Box::new(|_| {}));
        io_err::<C>(ErrorSubject::Logs, verb, e)
    }
}

fn io_err<C: RaftTypeConfig>(
    subject: ErrorSubject<C::NodeId>,
    verb: ErrorVerb,
    e: impl std::error::Error + 'static,
) -> RaftStorageError<C> {
    openraft::StorageError::IO { source: StorageIOError::new(subject, verb, AnyError::new(&e)) }
}

impl<C> LogStore<C>
where
    C: RaftTypeConfig,
    C::Entry: Serialize + DeserializeOwned,
{
    fn read_meta<T: DeserializeOwned>(&self, tag: u8) -> Result<Option<T>, RaftStorageError<C>> {
        let v = self
            .db
            .raft_meta_tree()
            .get(meta_key(self.group, tag))
            .map_err(|e| io_err::<C>(ErrorSubject::Store, ErrorVerb::Read, e))?;
        match v {
            None => Ok(None),
            Some(b) => keys::decode(&b, "raft meta")
                .map(Some)
                .map_err(|e| io_err::<C>(ErrorSubject::Store, ErrorVerb::Read, e)),
        }
    }

    fn write_meta<T: Serialize>(&self, tag: u8, v: &T) -> Result<(), RaftStorageError<C>> {
        let b = keys::encode(v, "raft meta").map_err(|e| io_err::<C>(ErrorSubject::Store, ErrorVerb::Write, e))?;
        self.db
            .raft_meta_tree()
            .insert(meta_key(self.group, tag), b)
            .map_err(|e| io_err::<C>(ErrorSubject::Store, ErrorVerb::Write, self.db.write_failed(e)))?;
        Ok(())
    }

    fn decode_entry(bytes: &[u8]) -> Result<C::Entry, RaftStorageError<C>> {
        keys::decode(bytes, "log entry").map_err(|e| io_err::<C>(ErrorSubject::Logs, ErrorVerb::Read, e))
    }

    fn last_entry(&self) -> Result<Option<C::Entry>, RaftStorageError<C>> {
        let Some((_, last)) = self.wal().bounds(self.group) else { return Ok(None) };
        Ok(self.read_entries(last, last)?.pop())
    }

    /// The highest term this replica has seen: its vote's or its log's.
    pub fn highest_term(&self) -> Result<u64, RaftStorageError<C>> {
        let vote: Option<Vote<C::NodeId>> = self.read_meta(META_VOTE)?;
        let purged = self.forget_purged()?;
        let last = self.last_entry()?.map(|e| e.get_log_id().clone()).or(purged);
        Ok(vote.map_or(0, |v| v.leader_id().get_term()).max(last.map_or(0, |l| l.leader_id.get_term())))
    }

    /// After a crash, make every committed vote of this node for itself
    /// uncommitted, in every group, before any group starts. openraft
    /// resumes leading at start when it finds one, in the same term; but a
    /// leader replicates an entry while its own write of it is still
    /// unsynced, so a leader that lost power may come back without entries
    /// its followers hold. Leading that term again, it would write other
    /// entries at those indexes under the same ids, which the followers
    /// take as already held: a confirm would then count copies that are
    /// not there. With the vote uncommitted the node starts as a follower,
    /// and the term's leadership goes to an election, which only a replica
    /// with every committed entry wins. Returns the groups changed.
    pub fn step_down_after_crash(db: &NodeDb, me: C::NodeId) -> Result<Vec<GroupId>, RaftStorageError<C>> {
        let mut changed = Vec::new();
        for kv in db.raft_meta_tree().iter() {
            let (k, v) = kv.map_err(|e| io_err::<C>(ErrorSubject::Store, ErrorVerb::Read, e))?;
            if k.len() != 9 || k[8] != META_VOTE {
                continue;
            }
            let vote: Vote<C::NodeId> =
                keys::decode(&v, "raft meta").map_err(|e| io_err::<C>(ErrorSubject::Store, ErrorVerb::Read, e))?;
            if vote.is_committed() && vote.leader_id().voted_for().as_ref() == Some(&me) {
                let store = LogStore::<C>::new(db.clone(), keys::key_group(&k));
                store.write_meta(META_VOTE, &Vote::new(vote.leader_id().get_term(), me.clone()))?;
                changed.push(store.group);
            }
        }
        if !changed.is_empty() {
            db.flusher().sync_blocking().map_err(|e| io_err::<C>(ErrorSubject::Vote, ErrorVerb::Write, e))?;
        }
        Ok(changed)
    }

    /// Adopt `vote` outside Raft and wait until it is durable. Only while
    /// the group's Raft is stopped.
    pub fn restore_vote(&self, vote: &Vote<C::NodeId>) -> Result<(), RaftStorageError<C>> {
        self.write_meta(META_VOTE, vote)?;
        self.db.flusher().sync_blocking().map_err(|e| io_err::<C>(ErrorSubject::Vote, ErrorVerb::Write, e))
    }

    /// Append `entries` to the log (not yet durable) and to the recent ones.
    fn write_entries(&self, entries: impl IntoIterator<Item = C::Entry>) -> Result<(), RaftStorageError<C>> {
        let mut encoded = Vec::new();
        let mut decoded = Vec::new();
        for entry in entries {
            let bytes =
                keys::encode(&entry, "log entry").map_err(|e| io_err::<C>(ErrorSubject::Logs, ErrorVerb::Write, e))?;
            let index = entry.get_log_id().index;
            decoded.push((index, bytes.len(), entry));
            encoded.push((index, bytes));
        }
        if let Err(e) = self.wal().append(self.group, &encoded) {
            // What is cached must be what the log has.
            self.recent().clear();
            return Err(self.write_failed(ErrorVerb::Write, e));
        }
        // Each appended entry is now the log's last one (an append replaces
        // whatever followed its index), so it may be cached after the one
        // before it.
        let mut recent = self.recent();
        for (index, size, entry) in decoded {
            recent.push(index, size, entry);
        }
        Ok(())
    }

    /// Whether this replica holds nothing: no vote, no entry, no purge point.
    pub fn is_blank(&self) -> Result<bool, RaftStorageError<C>> {
        Ok(self.read_meta::<Vote<C::NodeId>>(META_VOTE)?.is_none()
            && self.read_meta::<LogId<C::NodeId>>(META_PURGED)?.is_none()
            && self.wal().bounds(self.group).is_none())
    }

    /// Found a group without an election: write its `first` entries (the
    /// membership at index 0, then whatever its leader starts with) and
    /// adopt `vote`, made durable together by one sync before the group's
    /// Raft starts. Only on a replica that holds no purge point and either
    /// nothing, or what a crash during that sync may have left of a
    /// founding: exactly `first` without a vote, or `vote` (committed or,
    /// as a crash leaves it, not) without any entry. Nothing was sent under
    /// such a vote, since Raft starts only once the sync is done, so the
    /// founding is finished. A vote with any entry is never taken up again:
    /// a leader that lost an entry it had sent must not write another at
    /// that index. `false` if the replica was none of these.
    pub async fn found(&mut self, vote: &Vote<C::NodeId>, first: Vec<C::Entry>) -> Result<bool, RaftStorageError<C>> {
        if self.read_meta::<LogId<C::NodeId>>(META_PURGED)?.is_some() {
            return Ok(false);
        }
        let voted = self.read_meta::<Vote<C::NodeId>>(META_VOTE)?;
        let want: Vec<LogId<C::NodeId>> = first.iter().map(|e| e.get_log_id().clone()).collect();
        match (voted, self.wal().bounds(self.group)) {
            (Some(v), None) if v.leader_id() == vote.leader_id() => self.write_entries(first)?,
            (Some(_), _) => return Ok(false),
            (None, None) => self.write_entries(first)?,
            (None, Some((lo, hi))) if hi - lo + 1 == want.len() as u64 && self.log_ids()? == want => {}
            (None, Some(_)) => return Ok(false),
        }
        self.write_meta(META_VOTE, vote)?;
        // One round makes both durable: founding with two syncs in a row
        // (entries, then the vote) kept every declare waiting for both.
        self.db.flusher().sync().await.map_err(|e| io_err::<C>(ErrorSubject::Vote, ErrorVerb::Write, e))?;
        Ok(true)
    }

    /// Forget the entries up to the recorded purge point. The log replays
    /// purged entries until their segment is reclaimed; the purge point in
    /// sled is what says they are gone.
    fn forget_purged(&self) -> Result<Option<LogId<C::NodeId>>, RaftStorageError<C>> {
        let purged: Option<LogId<C::NodeId>> = self.read_meta(META_PURGED)?;
        if let Some(p) = &purged {
            self.wal().purge(self.group, p.index);
        }
        Ok(purged)
    }

    fn read_entries(&self, start: u64, end: u64) -> Result<Vec<C::Entry>, RaftStorageError<C>> {
        let read = self
            .wal()
            .read(self.group, start, end)
            .map_err(|e| io_err::<C>(ErrorSubject::Logs, ErrorVerb::Read, self.db.read_failed(e)))?;
        read.iter().map(|(_, b)| Self::decode_entry(b)).collect()
    }
}

impl<C> LogStore<C>
where
    C: RaftTypeConfig,
    C::Entry: Serialize + DeserializeOwned,
{
    /// The ids of every entry kept, ascending, read one entry at a time.
    pub fn log_ids(&self) -> Result<Vec<LogId<C::NodeId>>, RaftStorageError<C>> {
        self.forget_purged()?;
        Ok(self.read_entries(0, u64::MAX)?.iter().map(|e| e.get_log_id().clone()).collect())
    }

    /// Re-found the group on this replica's log, outside of Raft: write
    /// `entries` (rewritten unapplied entries, then the new epoch's
    /// membership after the last one), adopt `vote` and set the node-level
    /// value `node_kv` (the group's epoch) in one transaction, then sync.
    /// Atomic, so a crash never leaves the new leadership without its epoch.
    /// Used only while the group's Raft is stopped, when a group must go on
    /// without a majority (see mirrorq's `queue::epoch`).
    pub async fn refound(
        &mut self,
        vote: &Vote<C::NodeId>,
        entries: Vec<C::Entry>,
        node_kv: (&str, Vec<u8>),
    ) -> Result<(), RaftStorageError<C>> {
        let wr = |e: &dyn std::fmt::Display| {
            io_err::<C>(ErrorSubject::Logs, ErrorVerb::Write, io::Error::other(e.to_string()))
        };
        let mut log_kvs = Vec::with_capacity(entries.len());
        for entry in &entries {
            let bytes = keys::encode(entry, "log entry").map_err(|e| wr(&e))?;
            log_kvs.push((entry.get_log_id().index, bytes));
        }
        let vote_bytes = keys::encode(vote, "raft meta").map_err(|e| wr(&e))?;
        let vote_key = meta_key(self.group, META_VOTE);
        let (db, group, kv) = (self.db.clone(), self.group, (node_kv.0.to_owned(), node_kv.1));
        self.recent().clear();
        tokio::task::spawn_blocking(move || db.rewrite_log(group, log_kvs, &vote_key, vote_bytes, (&kv.0, kv.1)))
            .await
            .map_err(|e| wr(&e))?
            .map_err(|e| wr(&e))
    }
}

impl<C> RaftLogReader<C> for LogStore<C>
where
    C: RaftTypeConfig,
    C::Entry: Serialize + DeserializeOwned + Clone,
{
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<C::Entry>, RaftStorageError<C>> {
        let start = match range.start_bound() {
            Bound::Included(i) => *i,
            Bound::Excluded(i) => i.saturating_add(1),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(i) => *i,
            Bound::Excluded(0) => return Ok(Vec::new()),
            Bound::Excluded(i) => i - 1,
            Bound::Unbounded => u64::MAX,
        };
        if start > end {
            return Ok(Vec::new());
        }
        if let Some(hit) = self.recent().get(start, end) {
            return Ok(hit);
        }
        self.read_entries(start, end)
    }
}

impl<C> RaftLogStorage<C> for LogStore<C>
where
    C: RaftTypeConfig,
    C::Entry: Serialize + DeserializeOwned + Clone,
{
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<C>, RaftStorageError<C>> {
        let last_purged_log_id = self.forget_purged()?;
        let last_log_id = match self.last_entry()? {
            Some(e) => Some(e.get_log_id().clone()),
            None => last_purged_log_id.clone(),
        };
        Ok(LogState { last_purged_log_id, last_log_id })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<C::NodeId>) -> Result<(), RaftStorageError<C>> {
        self.write_meta(META_VOTE, vote)?;
        // A vote must be durable before the node answers with it, or a restart
        // could vote twice in one term.
        self.db.flusher().sync().await.map_err(|e| io_err::<C>(ErrorSubject::Vote, ErrorVerb::Write, e))
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<C::NodeId>>, RaftStorageError<C>> {
        self.read_meta(META_VOTE)
    }

    async fn save_committed(&mut self, committed: Option<LogId<C::NodeId>>) -> Result<(), RaftStorageError<C>> {
        // Not synced: losing it only means re-applying from the last applied id.
        self.write_meta(META_COMMITTED, &committed)
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<C::NodeId>>, RaftStorageError<C>> {
        let committed = self.read_meta::<Option<LogId<C::NodeId>>>(META_COMMITTED)?.flatten();
        // Saved unsynced, and a leader commits entries before its own sync
        // of them: after a power cut the index may name entries the log
        // lost, which could not be applied again. The leader tells it anew.
        let purged = self.read_meta::<LogId<C::NodeId>>(META_PURGED)?;
        let last = self.last_entry()?.map(|e| e.get_log_id().clone()).or(purged);
        Ok(match (committed, last) {
            (Some(c), Some(l)) if c > l => Some(l),
            (Some(_), None) => None,
            (c, _) => c,
        })
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<C>) -> Result<(), RaftStorageError<C>>
    where
        I: IntoIterator<Item = C::Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries: Vec<C::Entry> = entries.into_iter().collect();
        let span = entries.first().zip(entries.last()).map(|(a, b)| (a.get_log_id().index, b.get_log_id().index));
        self.write_entries(entries)?;
        let written = span.map(|(first, last)| self.durability.written(first, last));
        let durability = self.durability.clone();
        // Readable now; durable (and acknowledged to openraft) after the next
        // group-commit sync of the log.
        self.db.flusher().submit_log(Box::new(move |r: io::Result<()>| {
            if let Some(n) = written {
                durability.synced(n, r.is_ok());
            }
            callback.log_io_completed(r)
        }));
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId<C::NodeId>) -> Result<(), RaftStorageError<C>> {
        self.recent().drop_from(log_id.index);
        self.durability.truncated(log_id.index);
        self.wal().truncate(self.group, log_id.index).map_err(|e| self.write_failed(ErrorVerb::Delete, e))
    }

    async fn purge(&mut self, log_id: LogId<C::NodeId>) -> Result<(), RaftStorageError<C>> {
        // The purge point is the record: the entries' space is reclaimed by
        // the flusher once sled (with this point) is durable.
        self.write_meta(META_PURGED, &log_id)?;
        self.recent().drop_through(log_id.index);
        self.wal().purge(self.group, log_id.index);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recent(indexes: impl IntoIterator<Item = u64>, size: usize) -> Recent<u64> {
        let mut r = Recent::new();
        for i in indexes {
            r.push(i, size, i);
        }
        r
    }

    #[test]
    fn recent_entries_stay_consecutive_bounded_and_end_at_the_log_tail() {
        let mut r = recent(1..=5, 10);
        assert_eq!(r.get(2, 4), Some(vec![2, 3, 4]));
        assert_eq!(r.get(4, u64::MAX), Some(vec![4, 5]), "the rest of the log");
        assert_eq!(r.get(0, 3), None, "starts before what is kept: read the log");
        assert_eq!(r.get(6, 9), None);
        // A gap (a log rewritten elsewhere) forgets what came before it.
        r.push(9, 10, 9);
        assert_eq!((r.get(5, 9), r.get(9, 9)), (None, Some(vec![9])));
        // Truncate and purge.
        let mut r = recent(1..=5, 10);
        r.drop_from(4);
        assert_eq!((r.get(1, u64::MAX), r.bytes), (Some(vec![1, 2, 3]), 30));
        r.drop_through(1);
        assert_eq!(r.get(2, u64::MAX), Some(vec![2, 3]));
        r.push(4, 10, 4);
        assert_eq!(r.get(2, 9), Some(vec![2, 3, 4]));
        // The byte bound drops the oldest; an entry over it empties the cache
        // (nothing after it could be served without it).
        let mut r = recent(1..=4, RECENT_BYTES / 3);
        assert_eq!((r.get(1, 4), r.get(2, 4)), (None, Some(vec![2, 3, 4])));
        r.push(5, RECENT_BYTES + 1, 5);
        assert_eq!((r.get(5, 5), r.entries.len(), r.bytes), (None, 0, 0));
    }

    /// An entry counts as durable once the sync of the append that wrote it,
    /// and of every append before, completed; a truncation takes back what
    /// it cut; a failed sync fails every question after it.
    #[tokio::test]
    async fn an_entry_is_durable_once_its_append_and_every_earlier_one_synced() {
        let d = Durability::default();
        assert!(d.covers(u64::MAX).unwrap(), "nothing written: all durable");
        let a = d.written(1, 3);
        let b = d.written(4, 4);
        assert!(!d.covers(1).unwrap());
        let waiter = {
            let d = d.clone();
            tokio::spawn(async move { d.wait(4).await })
        };
        d.synced(a, true);
        assert!(d.covers(3).unwrap() && !d.covers(4).unwrap());
        tokio::task::yield_now().await;
        assert!(!waiter.is_finished(), "woken before its append synced");
        d.synced(b, true);
        waiter.await.unwrap().unwrap();
        // A later sync covers what was written before it began.
        let c = d.written(5, 5);
        let e = d.written(6, 6);
        d.synced(e, true);
        assert!(d.covers(6).unwrap());
        d.synced(c, true);
        // Cut from 9: 7 and 8 still wait for their sync; a rewrite of 9 for its own.
        let f = d.written(7, 10);
        let g = d.written(11, 12);
        d.truncated(9);
        assert!(!d.covers(7).unwrap());
        let h = d.written(9, 9);
        d.synced(f, true);
        assert!(d.covers(8).unwrap() && !d.covers(9).unwrap());
        assert!(g < h, "numbers rise in the order written");
        let waiter = {
            let d = d.clone();
            tokio::spawn(async move { d.wait(9).await })
        };
        tokio::task::yield_now().await;
        d.synced(h, false);
        assert!(matches!(waiter.await.unwrap(), Err(StorageError::SyncFailed)));
        assert!(d.covers(0).is_err());
    }
}
