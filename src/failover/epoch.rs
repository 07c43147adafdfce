//! The epoch each replica is in, kept beside its log, and what this node
//! reports of it; news of a newer epoch starts a heal (`heal.rs`).

use openraft::storage::RaftLogStorage;
use openraft::{ServerState, Vote};

use super::split::own_record;
use super::Tracked;
use crate::error::ServerError;
use crate::ids::{GroupId, NodeId};
use crate::queue::epoch::{Epoch, EpochReport, ForkRecord};
use crate::queue::replicas::Replicas;
use crate::queue::QueueLog as LogStore;
use mirrorq_storage::{NodeDb, StorageError};
use std::time::Duration;

pub(super) fn epoch_key(group: GroupId) -> String {
    format!("epoch/{group}")
}

pub(super) fn heal_key(group: GroupId) -> String {
    format!("healing/{group}")
}

pub(super) fn term_floor_key(group: GroupId) -> String {
    format!("term-floor/{group}")
}

/// The epoch this node's replica of `group` is in. Also finishes a heal that
/// a crash interrupted after the hand-back (wiping is idempotent).
///
/// The wiped replica keeps a vote at the highest term it had seen, so this
/// node never leads a term it led before, in any epoch: hand-back origins
/// `(term, node, index)` and fork records name an entry by its leader, and
/// two leaderships of one term by one node could make a hand-back look
/// done, or an entry look shared, when it is not. Raised past that term,
/// the new epoch's master steps down once (the learner answers with the
/// higher vote) and is re-elected above it.
pub(crate) fn load_epoch(db: &NodeDb, group: GroupId, me: NodeId) -> Result<Epoch, ServerError> {
    let decode = |b: Vec<u8>, what| mirrorq_storage::keys::decode::<Epoch>(&b, what);
    if let Some(b) = db.get_node_value(&heal_key(group))? {
        let epoch = decode(b, "healing marker")?;
        let raft = |e: openraft::StorageError<NodeId>| ServerError::Raft(e.to_string());
        let log = LogStore::new(db.clone(), group);
        // Durable before the wipe: a crash in between must not lose it.
        let kept = match db.get_node_value(&term_floor_key(group))? {
            Some(b) => mirrorq_storage::keys::decode::<u64>(&b, "term floor")?,
            None => 0,
        };
        let floor = kept.max(log.highest_term().map_err(raft)?);
        db.put_node_value(&term_floor_key(group), &mirrorq_storage::keys::encode(&floor, "term floor")?)?;
        db.drop_group(group)?;
        if floor > 0 {
            log.restore_vote(&Vote::new(floor, me)).map_err(raft)?;
        }
        store_epoch(db, group, epoch)?;
        db.remove_node_value(&heal_key(group))?;
        return Ok(epoch);
    }
    match db.get_node_value(&epoch_key(group))? {
        Some(b) => Ok(decode(b, "group epoch")?),
        None => Ok(Epoch::default()),
    }
}

pub(super) fn store_epoch(db: &NodeDb, group: GroupId, epoch: Epoch) -> Result<(), StorageError> {
    db.put_node_value(&epoch_key(group), &mirrorq_storage::keys::encode(&epoch, "group epoch")?)
}

/// Make this node's committed vote for itself in `group`, if it holds one,
/// uncommitted, so that the group's next Raft instance here starts as a
/// follower rather than resuming a leadership (only while the group's Raft
/// is stopped). Returns once the vote is durable.
pub(super) async fn step_down(db: NodeDb, group: GroupId, me: NodeId) -> Result<(), ServerError> {
    let raft = |e: openraft::StorageError<NodeId>| ServerError::Raft(e.to_string());
    let mut log = LogStore::new(db, group);
    match log.read_vote().await.map_err(raft)? {
        Some(v) if v.is_committed() && v.leader_id().voted_for() == Some(me) => {
            let vote = Vote::new(v.leader_id().get_term(), me);
            // Its sync blocks: not on a runtime thread.
            tokio::task::spawn_blocking(move || log.restore_vote(&vote))
                .await
                .map_err(|e| ServerError::Raft(e.to_string()))?
                .map_err(raft)
        }
        _ => Ok(()),
    }
}

/// Our replica's log of `group` as a record of its history, with the
/// ancestry of its epoch if that was re-formed (a fork yielding to it
/// tells by it what both inherited).
pub(crate) async fn history(replicas: &Replicas<Tracked>, db: &NodeDb, group: GroupId) -> Option<ForkRecord> {
    let g = replicas.get(group)?;
    let mut log = LogStore::new(db.clone(), group);
    let state = log.get_log_state().await.ok()?;
    let ids = log.log_ids().ok()?;
    let mut record = ForkRecord::from_log(g.epoch, state.last_purged_log_id, ids);
    if let Some(own) = own_record(db, group, g.epoch).ok().flatten() {
        record.inherited = own.inherited;
    }
    Some(record)
}

/// Our replica's epoch of `group`, with its fork record if the replica
/// has it, and the master of that epoch in reach as our replica knows it
/// (heard within `failure_timeout`).
pub(crate) fn epoch_report(
    replicas: &Replicas<Tracked>,
    db: &NodeDb,
    me: NodeId,
    failure_timeout: Duration,
    group: GroupId,
) -> Option<EpochReport> {
    let g = replicas.get(group)?;
    // Formed here, the record kept beside the log counts too: without
    // it the other side would wait for a record no one has, both serving.
    let record = own_record(db, group, g.epoch).ok()?;
    let m = g.raft.metrics().borrow().clone();
    let heard = g.ext.heard.master_at();
    let master = match m.state {
        ServerState::Leader => Some(me),
        _ => m.current_leader.filter(|_| heard.is_some_and(|t| t.elapsed() < failure_timeout)),
    };
    Some(EpochReport { epoch: g.epoch, record, master })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::queue::QueueTypes;
    use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId};

    /// A replica that led terms up to 7 heals into another epoch: wiped, it
    /// keeps a vote at term 7, so it can never lead term 7 (or below) again;
    /// and a crash between the wipe and that vote loses nothing.
    #[tokio::test]
    async fn a_healed_replica_never_leads_a_term_it_saw_again() {
        let dir = tempfile::tempdir().unwrap();
        let db = NodeDb::open(dir.path(), &mirrorq_storage::DbOptions::default()).unwrap();
        let group = 5;
        let mut log = LogStore::new(db.clone(), group);
        let entries: Vec<Entry<QueueTypes>> = (1..=3)
            .map(|i| Entry { log_id: LogId::new(CommittedLeaderId::new(7, 1), i), payload: EntryPayload::Blank })
            .collect();
        let epoch = (epoch_key(group), mirrorq_storage::keys::encode(&Epoch::default(), "e").unwrap());
        log.refound(&Vote::new_committed(7, 1), entries, (&epoch.0, epoch.1)).await.unwrap();
        let next = Epoch { term: 4, node: 3 };
        db.put_node_value(&heal_key(group), &mirrorq_storage::keys::encode(&next, "m").unwrap()).unwrap();

        assert_eq!(load_epoch(&db, group, 1).unwrap(), next);
        let mut log = LogStore::new(db.clone(), group);
        assert_eq!(log.get_log_state().await.unwrap().last_log_id, None, "wiped");
        let vote = log.read_vote().await.unwrap().expect("a vote is kept");
        assert_eq!((vote.leader_id.term, vote.is_committed()), (7, false));

        // A crash after the wipe, before that vote: the floor was durable.
        db.drop_group(group).unwrap();
        db.put_node_value(&heal_key(group), &mirrorq_storage::keys::encode(&next, "m").unwrap()).unwrap();
        load_epoch(&db, group, 1).unwrap();
        let vote = LogStore::new(db.clone(), group).read_vote().await.unwrap();
        assert_eq!(vote.map(|v| v.leader_id.term), Some(7));
    }
}
