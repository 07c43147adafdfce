//! The key space a group's state machine writes into.

use crate::batch::{self, Batch, REDO_MAX_BYTES};
use crate::keys::group_prefix;
use crate::{GroupId, NodeDb, StorageError};

/// A group's slice of the node's state-machine tree: every key is prefixed
/// with the group id, so groups never see each other's data and a group can
/// be cleared in one range.
///
/// State-machine writes are not synced themselves: sled recovers a prefix of
/// its writes after a crash, and the log entries they came from were synced
/// first, so a lost state-machine write is re-applied from the log.
#[derive(Clone)]
pub struct SmSpace {
    db: NodeDb,
    group: GroupId,
    prefix: [u8; 8],
}

impl SmSpace {
    pub fn new(db: NodeDb, group: GroupId) -> Self {
        Self { db, group, prefix: group_prefix(group) }
    }

    /// The encoded entry at `index` of the group's log, if the log still
    /// has it. A state machine may leave what an applied entry carries in
    /// the log rather than copy it (message bodies), as long as it copies
    /// it before a snapshot lets the log go.
    pub fn log_entry(&self, index: u64) -> Result<Option<Vec<u8>>, StorageError> {
        let mut read = self.db.wal().read(self.group, index, index).map_err(|e| self.db.read_failed(e))?;
        Ok(read.pop().map(|(_, bytes)| bytes))
    }

    /// Full key for a group-relative key.
    pub fn key(&self, rel: &[u8]) -> Vec<u8> {
        let mut k = Vec::with_capacity(8 + rel.len());
        k.extend_from_slice(&self.prefix);
        k.extend_from_slice(rel);
        k
    }

    pub fn get(&self, rel: &[u8]) -> Result<Option<sled::IVec>, StorageError> {
        Ok(self.db.sm_tree().get(self.key(rel))?)
    }

    /// Apply a batch whose keys were built with [`SmSpace::key`], atomically.
    pub fn apply(&self, batch: Batch) -> Result<(), StorageError> {
        self.db.sm_tree().apply_batch(batch.into_sled()).map_err(|e| self.db.write_failed(e))
    }

    /// Apply one step's writes and its commit record `record` under `rel`,
    /// atomically across a crash: small steps as a redo record (`record`
    /// followed by the writes, then the writes one by one; see
    /// [`crate::batch`]), large ones as a sled batch with `record` alone.
    /// After a restart, whatever follows the caller's record in the stored
    /// value goes to [`SmSpace::replay`] before the state is read.
    pub fn apply_step(&self, rel: &[u8], mut record: Vec<u8>, mut writes: Batch) -> Result<(), StorageError> {
        let tree = self.db.sm_tree();
        if writes.bytes() <= REDO_MAX_BYTES {
            writes.encode_redo(&mut record);
            tree.insert(self.key(rel), record).map_err(|e| self.db.write_failed(e))?;
            batch::apply_each(tree, &writes).map_err(|e| match e {
                StorageError::Sled(e) => self.db.write_failed(e),
                e => e,
            })
        } else {
            writes.insert(self.key(rel), record);
            tree.apply_batch(writes.into_sled()).map_err(|e| self.db.write_failed(e))
        }
    }

    /// Finish the step whose redo writes are `redo` (the tail of a record
    /// written by [`SmSpace::apply_step`]; empty: nothing to do). Returns the
    /// number of writes replayed.
    pub fn replay(&self, redo: &[u8]) -> Result<usize, StorageError> {
        batch::replay(self.db.sm_tree(), redo)
    }

    /// Set one key (group-relative) by itself.
    pub fn put(&self, rel: &[u8], value: Vec<u8>) -> Result<(), StorageError> {
        self.db.sm_tree().insert(self.key(rel), value).map_err(|e| self.db.write_failed(e))?;
        Ok(())
    }

    /// Iterate over the group's keys starting with `rel_prefix`, yielding
    /// group-relative keys.
    pub fn scan(&self, rel_prefix: &[u8]) -> impl Iterator<Item = Result<(Vec<u8>, sled::IVec), StorageError>> + '_ {
        self.db
            .sm_tree()
            .scan_prefix(self.key(rel_prefix))
            .map(|kv| kv.map(|(k, v)| (k[8..].to_vec(), v)).map_err(StorageError::from))
    }

    /// Iterate over the group's keys in `[start, end)` (group-relative),
    /// yielding group-relative keys.
    pub fn range(
        &self,
        start: &[u8],
        end: &[u8],
    ) -> impl Iterator<Item = Result<(Vec<u8>, sled::IVec), StorageError>> + '_ {
        self.db
            .sm_tree()
            .range(self.key(start)..self.key(end))
            .map(|kv| kv.map(|(k, v)| (k[8..].to_vec(), v)).map_err(StorageError::from))
    }

    /// The last of the group's keys in `[start, end]` (group-relative), if
    /// any: the record a point falls in when records are keyed by where
    /// they start.
    pub fn last_in(&self, start: &[u8], end: &[u8]) -> Result<Option<(Vec<u8>, sled::IVec)>, StorageError> {
        match self.db.sm_tree().range(self.key(start)..=self.key(end)).next_back() {
            Some(kv) => {
                let (k, v) = kv?;
                Ok(Some((k[8..].to_vec(), v)))
            }
            None => Ok(None),
        }
    }

    /// Remove every key of the group.
    pub fn clear(&self) -> Result<(), StorageError> {
        self.clear_keeping(&[])
    }

    /// Remove every key of the group except those starting with one of
    /// `keep` (group-relative prefixes).
    pub fn clear_keeping(&self, keep: &[&[u8]]) -> Result<(), StorageError> {
        let tree = self.db.sm_tree();
        let mut batch = sled::Batch::default();
        for kv in tree.scan_prefix(self.prefix) {
            let k = kv?.0;
            if !keep.iter().any(|p| k[8..].starts_with(p)) {
                batch.remove(k);
            }
        }
        tree.apply_batch(batch).map_err(|e| self.db.write_failed(e))
    }

    /// Wait until every write so far is durable.
    pub async fn sync(&self) -> Result<(), StorageError> {
        self.db.flusher().sync().await.map_err(|_| StorageError::SyncFailed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DbOptions;

    fn value(space: &SmSpace, rel: &[u8]) -> Option<Vec<u8>> {
        space.get(rel).unwrap().map(|v| v.to_vec())
    }

    #[test]
    fn a_small_step_stores_its_writes_after_the_record_and_replays_them() {
        let dir = tempfile::tempdir().unwrap();
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        let space = SmSpace::new(db, 3);
        space.put(b"gone", b"old".to_vec()).unwrap();
        let mut step = Batch::default();
        step.insert(space.key(b"a"), b"1".to_vec());
        step.remove(space.key(b"gone"));
        step.insert(space.key(b"a"), b"2".to_vec());
        space.apply_step(b"rec", b"REC".to_vec(), step).unwrap();
        assert_eq!(value(&space, b"a"), Some(b"2".to_vec()), "the later write of a key wins");
        assert_eq!(value(&space, b"gone"), None);
        let rec = value(&space, b"rec").unwrap();
        assert_eq!(&rec[..3], b"REC");
        // A crash after the record: none of the writes made it.
        space.put(b"gone", b"old".to_vec()).unwrap();
        let mut lost = Batch::default();
        lost.remove(space.key(b"a"));
        space.apply(lost).unwrap();
        assert_eq!(space.replay(&rec[3..]).unwrap(), 3);
        assert_eq!(value(&space, b"a"), Some(b"2".to_vec()));
        assert_eq!(value(&space, b"gone"), None);
        // Replaying a finished step changes nothing.
        assert_eq!(space.replay(&rec[3..]).unwrap(), 3);
        assert_eq!(value(&space, b"a"), Some(b"2".to_vec()));
    }

    #[test]
    fn a_large_step_goes_through_a_sled_batch_with_the_bare_record() {
        let dir = tempfile::tempdir().unwrap();
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        let space = SmSpace::new(db, 3);
        let mut step = Batch::default();
        step.insert(space.key(b"big"), vec![7u8; REDO_MAX_BYTES + 1]);
        space.apply_step(b"rec", b"REC".to_vec(), step).unwrap();
        assert_eq!(value(&space, b"rec"), Some(b"REC".to_vec()), "no redo tail: sled's batch is atomic");
        assert_eq!(value(&space, b"big").map(|v| v.len()), Some(REDO_MAX_BYTES + 1));
        assert_eq!(space.replay(b"").unwrap(), 0);
    }
}
