//! What tests and benches use to look inside a node and to crash it; built
//! only with the `test-hooks` feature (the dev-dependencies turn it on).

use std::sync::Arc;

use mirrorq_storage::SmSpace;

use super::{Node, QueueGroup};
use crate::error::NodeError;
use crate::ids::NodeId;
use crate::message::Message;
use crate::queue::QueueLog as LogStore;
use crate::queue::{QueueCmd, QueueMachine};

/// A queue's replica as a failure watch saw it when it listed the groups:
/// kept by a test to run a watch that began before something changed.
pub struct ReplicaView(Arc<QueueGroup>);

impl Node {
    /// This node's replica of `queue` as hosted now.
    pub fn replica_view(&self, queue: &str) -> Option<ReplicaView> {
        let q = self.metadata().queues.get(queue).cloned()?;
        self.inner.groups.get(q.group).map(ReplicaView)
    }

    /// Run the failure watch over replicas seen earlier, as a watch that
    /// listed them then and reaches them only now.
    pub async fn watch_failures_over(&self, views: Vec<ReplicaView>) {
        let state = self.metadata();
        self.failover().watch_groups(&state, views.into_iter().map(|v| v.0).collect(), None).await
    }

    /// AppendEntries calls (entries or heartbeats) this node's replica of
    /// `queue` has received.
    pub fn appends_received_by(&self, queue: &str) -> Option<u64> {
        let q = self.metadata().queues.get(queue).cloned()?;
        let g = self.inner.groups.get(q.group)?;
        Some(g.ext.heard.appends())
    }

    /// The first step of a graceful stop alone: the node is leaving (its
    /// replicas stand for no election, its failure watch knows), and its
    /// masterships are not moved yet.
    pub fn begin_leaving(&self) {
        self.failover().prepare_hand_over();
    }

    /// The first steps of a graceful stop: leaving, the peers told, and
    /// every mastership moved to its successor; the node then stays up.
    /// Returns how many did not move.
    pub async fn move_masterships_away(&self) -> usize {
        let successors = self.failover().prepare_hand_over();
        self.failover().announce_departure().await;
        self.failover().move_masters_away(successors).await.len()
    }

    /// Whether this node's confirm gates take `peer` as up and not
    /// stopping (their news of the peers).
    pub fn sees_peer_up(&self, peer: NodeId) -> bool {
        let news = self.inner.peers.news();
        !news.down.contains(&peer) && !news.departed.contains(&peer)
    }

    /// Whether this node's replica of `queue` has its heartbeats off.
    pub fn is_quiet_here(&self, queue: &str) -> bool {
        let Some(q) = self.metadata().queues.get(queue).cloned() else { return false };
        self.inner.groups.any(q.group, |g| g.hush.is_quiet())
    }

    /// The last queue group id declared before this node's life, once
    /// known: this node saw every queue above it declared.
    pub fn founding_floor(&self) -> Option<u64> {
        Some(self.inner.founding_floor.load(std::sync::atomic::Ordering::Acquire)).filter(|f| *f != u64::MAX)
    }

    /// Take every queue for one declared before this life, as after a
    /// restart on an emptied data dir.
    pub fn forget_founding_floor(&self) {
        self.inner.founding_floor.store(u64::MAX, std::sync::atomic::Ordering::Release);
    }

    /// Whether this node announces the group of `queue` as quietly led.
    pub fn announces_quiet(&self, queue: &str) -> bool {
        let Some(q) = self.metadata().queues.get(queue).cloned() else { return false };
        self.inner.quiescence.announces(q.group)
    }

    /// The epoch this node's replica of `queue` is in, if it hosts one.
    pub fn replica_epoch(&self, queue: &str) -> Option<crate::queue::epoch::Epoch> {
        let q = self.metadata().queues.get(queue).cloned()?;
        self.inner.groups.get(q.group).map(|g| g.epoch)
    }

    /// Send queue operations to `to` over the node link as a replica of
    /// `queue` in `epoch` forwards them.
    pub async fn forward_as_of(
        &self,
        to: NodeId,
        queue: &str,
        epoch: Option<crate::queue::epoch::Epoch>,
        cmds: Vec<QueueCmd>,
    ) -> Result<Vec<crate::queue::QueueReply>, NodeError> {
        let q = self.metadata().queues.get(queue).cloned().ok_or_else(|| NodeError::NoSuchQueue(queue.into()))?;
        let req = crate::wire::ask::Queue { group: q.group, epoch, cmds, lane: crate::queue::proposer::Lane::Consumer };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        self.inner.ask(to, req, deadline).await.map_err(|e| NodeError::Unavailable(format!("{e:?}")))?
    }

    /// Forget this replica's fork record of its epoch of `queue`, as if the
    /// node had stopped between re-forming the queue and committing the
    /// record's entry (the entry stays in the log; the state lacks it).
    pub fn forget_fork_record(&self, queue: &str) -> Result<(), NodeError> {
        let q = self.metadata().queues.get(queue).cloned().ok_or_else(|| NodeError::NoSuchQueue(queue.into()))?;
        QueueMachine::forget_fork_record(&SmSpace::new(self.inner.db.clone(), q.group))
            .map_err(|e| NodeError::Unavailable(e.to_string()))
    }

    /// Whether this node is still being refilled after its data dir was
    /// set aside (its replicas grant no vote yet).
    pub fn is_refilling(&self) -> bool {
        self.inner.refill.lock().expect("poisoned").is_some()
    }

    /// Fail every call from this node to `peer` as unreachable, and make
    /// its dials prove nothing (a test's one-way cut; `unblock` mends it).
    pub fn block(&self, peer: NodeId) {
        let addr = self.inner.addr_of(peer).expect("the peer's address is known");
        self.inner.transport.block(&addr);
    }

    pub fn unblock(&self, peer: NodeId) {
        let addr = self.inner.addr_of(peer).expect("the peer's address is known");
        self.inner.transport.unblock(&addr);
    }

    /// The metadata group's Raft handle.
    pub fn metadata_raft(&self) -> &crate::metadata::MetaRaft {
        &self.inner.meta_raft
    }

    /// Number of message bodies in this replica's applied state for `queue`.
    pub fn local_stored_count(&self, queue: &str) -> Result<usize, NodeError> {
        let q = self.metadata().queues.get(queue).cloned().ok_or_else(|| NodeError::NoSuchQueue(queue.into()))?;
        QueueMachine::stored_messages(&SmSpace::new(self.inner.db.clone(), q.group))
            .map(|m| m.len())
            .map_err(|e| NodeError::Unavailable(e.to_string()))
    }

    /// Number of log entries this replica keeps for `queue` (not yet purged).
    pub async fn local_log_len(&self, queue: &str) -> Result<usize, NodeError> {
        use openraft::storage::RaftLogStorage;
        use openraft::RaftLogReader;
        let q = self.metadata().queues.get(queue).cloned().ok_or_else(|| NodeError::NoSuchQueue(queue.into()))?;
        let mut log = LogStore::new(self.inner.db.clone(), q.group);
        let mut reader = log.get_log_reader().await;
        let entries = reader.try_get_log_entries(..).await.map_err(|e| NodeError::Unavailable(e.to_string()))?;
        Ok(entries.len())
    }

    /// Every message this replica holds for `queue`: in its applied state and
    /// in its log, whether applied yet or not. Reads only the local disk.
    pub async fn local_messages(&self, queue: &str) -> Result<Vec<Message>, NodeError> {
        use openraft::storage::RaftLogStorage;
        use openraft::RaftLogReader;
        let q = self.metadata().queues.get(queue).cloned().ok_or_else(|| NodeError::NoSuchQueue(queue.into()))?;
        let mut out = QueueMachine::stored_messages(&SmSpace::new(self.inner.db.clone(), q.group))
            .map_err(|e| NodeError::Unavailable(e.to_string()))?;
        let mut log = LogStore::new(self.inner.db.clone(), q.group);
        let mut reader = log.get_log_reader().await;
        let entries = reader.try_get_log_entries(..).await.map_err(|e| NodeError::Unavailable(e.to_string()))?;
        for e in entries {
            if let openraft::EntryPayload::Normal(cmds) = e.payload {
                for c in std::sync::Arc::unwrap_or_clone(cmds) {
                    if let QueueCmd::Enqueue { msgs } | QueueCmd::EnqueueExpiring { msgs, .. } = c {
                        out.extend(msgs);
                    }
                }
            }
        }
        Ok(out)
    }

    /// Delete this node's replica of `queue` as a replica told it moved
    /// away deletes itself (`Inner::drop_replica`), whatever the group's
    /// membership says: a voter's data lost while the group goes on. The
    /// reconciler starts the replica again, blank, at its next round if the
    /// metadata still places it here (as a disk replaced under a running
    /// node would leave it).
    pub async fn wipe_replica(&self, queue: &str) -> Result<(), NodeError> {
        let q = self.metadata().queues.get(queue).cloned().ok_or_else(|| NodeError::NoSuchQueue(queue.into()))?;
        let g = self.inner.groups.get(q.group);
        let g = g.ok_or_else(|| NodeError::Unavailable(format!("no replica of {queue} here")))?;
        let busy = crate::failover::Busy::take(&self.inner.failover.busy, q.group);
        let _busy = busy.ok_or_else(|| NodeError::Unavailable(format!("replica of {queue} is busy")))?;
        if !self.inner.take_out(&g) {
            return Err(NodeError::Unavailable(format!("replica of {queue} was replaced meanwhile")));
        }
        g.stop.cancel();
        g.shut_down().await;
        self.inner.drop_replica(q.group).map_err(|e| NodeError::Unavailable(e.to_string()))
    }

    /// Make this node's replica of `queue` meet a storage error, as a
    /// missing message body would: its state machine refuses every write
    /// from now on and a snapshot is asked for, on which openraft's core
    /// quits (`Fatal`). Nothing else is told: the replica stays hosted, as
    /// one whose core quit by itself.
    pub async fn fail_replica_storage(&self, queue: &str) -> Result<(), NodeError> {
        let q = self.metadata().queues.get(queue).cloned().ok_or_else(|| NodeError::NoSuchQueue(queue.into()))?;
        let g = self.inner.groups.get(q.group);
        let g = g.ok_or_else(|| NodeError::Unavailable(format!("no replica of {queue} here")))?;
        g.sm.close().await;
        // The snapshot's own error is the core's to meet, not the caller's.
        let _ = g.raft.trigger().snapshot().await;
        Ok(())
    }

    /// Stop abruptly, as a crash would: tasks end, connections drop, no
    /// final sync or handover happens, and storage loses everything not
    /// synced (the write-ahead log is cut back to its last sync, sled's
    /// memory is lost, and with `crash_image` so is what sled wrote since
    /// its last sync). For in-process failure tests; the node's handles
    /// must not be used afterwards.
    pub async fn crash(&self) {
        self.inner.stop.cancel();
        self.inner.transport.close_all();
        if let Err(e) = self.inner.db.crash_for_tests() {
            tracing::error!(error = %e, "crash of the storage failed");
        }
        let groups: Vec<_> = self.inner.groups.drain();
        for g in groups {
            let _ = g.raft.shutdown().await;
        }
        let _ = self.inner.meta_raft.shutdown().await;
    }
}
