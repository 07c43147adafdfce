//! The key space a group's state machine writes into.

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
    prefix: [u8; 8],
}

impl SmSpace {
    pub fn new(db: NodeDb, group: GroupId) -> Self {
        Self { db, prefix: group_prefix(group) }
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
    pub fn apply(&self, batch: sled::Batch) -> Result<(), StorageError> {
        Ok(self.db.sm_tree().apply_batch(batch)?)
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
        Ok(tree.apply_batch(batch)?)
    }

    /// Wait until every write so far is durable.
    pub async fn sync(&self) -> Result<(), StorageError> {
        self.db.flusher().sync().await.map_err(|_| StorageError::SyncFailed)
    }
}
