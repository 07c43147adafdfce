//! openraft's storage conformance suite against mirrorq's real storage: the
//! sled log store (group commit, fsync) and the on-disk queue state machine.

use mirrorq::ids::NodeId;
use mirrorq::queue::QueueMachine;
use mirrorq::queue::{QueueLog as LogStore, QueueTypes};
use mirrorq::raft::state_machine::StateMachine;
use mirrorq_storage::{DbOptions, NodeDb, SmSpace};
use openraft::testing::{StoreBuilder, Suite};
use openraft::StorageError;

struct Builder;

impl StoreBuilder<QueueTypes, LogStore, StateMachine<QueueMachine>, tempfile::TempDir> for Builder {
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

/// Founding a group writes its first entries and a committed vote; it runs
/// on a replica holding nothing, finishes one a crash interrupted (the
/// entries there and not the vote, or the vote and no entry), and leaves
/// alone a replica that holds another vote, the vote with entries, or any
/// other log.
#[tokio::test]
async fn founding_runs_on_a_blank_replica_finishes_an_interrupted_one_and_leaves_others_alone() {
    use openraft::storage::RaftLogStorage;
    use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId, Vote};
    let dir = tempfile::tempdir().expect("tempdir");
    let db = NodeDb::open(dir.path(), &DbOptions::default()).expect("open db");
    let first = || -> Vec<Entry<QueueTypes>> {
        vec![
            Entry { log_id: LogId::default(), payload: EntryPayload::Blank },
            Entry { log_id: LogId::new(CommittedLeaderId::new(1, 1), 1), payload: EntryPayload::Blank },
        ]
    };
    let vote = Vote::new_committed(1, 1);
    let ids = |log: &LogStore| log.log_ids().unwrap().iter().map(|l| l.index).collect::<Vec<_>>();
    // The founding entries in group `g`'s log, as a crash would leave them.
    let write_first = |g| {
        let entries: Vec<_> =
            first().iter().map(|e| (e.log_id.index, mirrorq_storage::keys::encode(e, "entry").unwrap())).collect();
        db.wal().append(g, &entries).unwrap();
    };

    let mut blank = LogStore::new(db.clone(), 1);
    assert!(blank.found(&vote, first()).await.unwrap());
    assert_eq!((blank.read_vote().await.unwrap(), ids(&blank)), (Some(vote), vec![0, 1]));

    // The entries made durable, then a crash before the vote: the same
    // entries and no vote, finished by founding again.
    let mut interrupted = LogStore::new(db.clone(), 2);
    write_first(2);
    assert_eq!(interrupted.read_vote().await.unwrap(), None);
    assert!(interrupted.found(&vote, first()).await.unwrap());
    assert_eq!((interrupted.read_vote().await.unwrap(), ids(&interrupted)), (Some(vote), vec![0, 1]));

    // The vote made durable without the entries (one sync makes both, and
    // a crash may leave either), uncommitted as a crash leaves this node's
    // votes for itself: finished too.
    let mut vote_only = LogStore::new(db.clone(), 5);
    vote_only.save_vote(&Vote::new(1, 1)).await.unwrap();
    assert!(vote_only.found(&vote, first()).await.unwrap());
    assert_eq!((vote_only.read_vote().await.unwrap(), ids(&vote_only)), (Some(vote), vec![0, 1]));

    // The founding vote with any entry is a founding that finished: its
    // leader may have sent entries it lost since, so it is never founded
    // again (it would lead at once and write other entries at their
    // indexes).
    let mut led = LogStore::new(db.clone(), 6);
    led.save_vote(&Vote::new(1, 1)).await.unwrap();
    write_first(6);
    assert!(!led.found(&vote, first()).await.unwrap());
    assert_eq!(led.read_vote().await.unwrap(), Some(Vote::new(1, 1)));

    // A replica that voted otherwise is not founded.
    let mut voted = LogStore::new(db.clone(), 3);
    voted.save_vote(&Vote::new(4, 2)).await.unwrap();
    assert!(!voted.found(&vote, first()).await.unwrap());
    assert_eq!((voted.read_vote().await.unwrap(), ids(&voted)), (Some(Vote::new(4, 2)), vec![]));

    // Entries other than the founding ones: not founded either.
    let mut other = LogStore::new(db.clone(), 4);
    let e = Entry::<QueueTypes> { log_id: LogId::new(CommittedLeaderId::new(2, 3), 0), payload: EntryPayload::Blank };
    db.wal().append(4, &[(0, mirrorq_storage::keys::encode(&e, "entry").unwrap())]).unwrap();
    assert!(!other.found(&vote, first()).await.unwrap());
    assert_eq!(other.read_vote().await.unwrap(), None);
}

/// A data dir knows whether the process before stopped cleanly: a clean
/// stop is recorded, and the next open takes the record away, so a crash of
/// that life is not taken for a clean stop by the one after. After a crash,
/// this node's committed votes for itself become uncommitted (same term,
/// same candidate), so no group is led again without an election; other
/// votes stay as they were.
#[tokio::test]
async fn after_a_crash_the_node_leads_no_group_until_an_election() {
    use openraft::storage::RaftLogStorage;
    use openraft::Vote;
    let dir = tempfile::tempdir().expect("tempdir");
    let open = || NodeDb::open(dir.path(), &DbOptions::default()).expect("open db");

    let db = open();
    assert!(!db.started_clean(), "a new dir has no clean stop before it");
    let votes = [(1, Vote::new_committed(7, 1)), (2, Vote::new_committed(3, 2)), (3, Vote::new(9, 1))];
    for (group, vote) in &votes {
        LogStore::new(db.clone(), *group).save_vote(vote).await.unwrap();
    }
    db.mark_clean_stop().unwrap();
    drop(db);

    let db = open();
    assert!(db.started_clean());
    drop(db);
    let db = open();
    assert!(!db.started_clean(), "the record of a clean stop serves one open only");

    assert_eq!(LogStore::step_down_after_crash(&db, 1).unwrap(), vec![1]);
    let read = |group| LogStore::new(db.clone(), group);
    assert_eq!(read(1).read_vote().await.unwrap(), Some(Vote::new(7, 1)), "no longer committed");
    assert_eq!(read(2).read_vote().await.unwrap(), Some(Vote::new_committed(3, 2)), "another's vote kept");
    assert_eq!(read(3).read_vote().await.unwrap(), Some(Vote::new(9, 1)));
    db.crash_for_tests().unwrap();
    drop(db);

    let db = open();
    assert!(!db.started_clean(), "a crash is no clean stop");
    assert_eq!(LogStore::new(db.clone(), 1).read_vote().await.unwrap(), Some(Vote::new(7, 1)), "durable");
}

/// A commit index is saved unsynced, and a leader commits entries before
/// its own sync of them: after a power cut the saved index may name entries
/// the log lost. It is read back no further than the log goes, so the
/// replica starts (re-applying only what it has) instead of failing.
#[tokio::test]
async fn a_commit_index_past_the_log_is_read_back_at_the_log_end() {
    use openraft::storage::RaftLogStorage;
    use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId};
    let dir = tempfile::tempdir().expect("tempdir");
    let db = NodeDb::open(dir.path(), &DbOptions::default()).expect("open db");
    let id = |i| LogId::new(CommittedLeaderId::new(2, 1), i);
    let entries: Vec<_> = (0..=7)
        .map(|i| {
            (
                i,
                mirrorq_storage::keys::encode(
                    &Entry::<QueueTypes> { log_id: id(i), payload: EntryPayload::Blank },
                    "e",
                )
                .unwrap(),
            )
        })
        .collect();
    db.wal().append(9, &entries).unwrap();
    let mut log = LogStore::new(db.clone(), 9);
    log.save_committed(Some(id(10))).await.unwrap();
    assert_eq!(log.read_committed().await.unwrap(), Some(id(7)));
    log.save_committed(Some(id(5))).await.unwrap();
    assert_eq!(log.read_committed().await.unwrap(), Some(id(5)), "an index within the log is kept");
    let mut empty = LogStore::new(db.clone(), 10);
    empty.save_committed(Some(id(3))).await.unwrap();
    assert_eq!(empty.read_committed().await.unwrap(), None);
}
