//! openraft's storage conformance suite against mirrorq's real storage: the
//! sled log store (group commit, fsync) and the on-disk queue state machine.

use mirrorq::ids::NodeId;
use mirrorq::queue::QueueMachine;
use mirrorq::raft::state_machine::StateMachine;
use mirrorq::raft::types::{LogStore, TypeConfig};
use mirrorq_storage::{DbOptions, NodeDb, SmSpace};
use openraft::testing::{StoreBuilder, Suite};
use openraft::StorageError;

struct Builder;

impl StoreBuilder<TypeConfig, LogStore, StateMachine<QueueMachine>, tempfile::TempDir> for Builder {
    async fn build(&self) -> Result<(tempfile::TempDir, LogStore, StateMachine<QueueMachine>), StorageError<NodeId>> {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = NodeDb::open(dir.path(), &DbOptions::default()).expect("open db");
        // A non-zero group id, so the suite also exercises key prefixing.
        let group = 42;
        let log = LogStore::new(db.clone(), group);
        let sm = StateMachine::<QueueMachine>::open(SmSpace::new(db, group), 1).expect("open sm");
        // As in a running node (after `Raft::new`): snapshots carry data.
        sm.enable_snapshot_transfer();
        Ok((dir, log, sm))
    }
}

/// Every test of `openraft::testing::Suite` passes on the sled store.
#[test]
fn openraft_storage_suite() -> Result<(), StorageError<NodeId>> {
    Suite::test_all(Builder)?;
    Ok(())
}
