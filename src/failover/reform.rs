//! Re-forming a group that lost its majority (`ha-promote-on-failure:
//! always`): the most senior replica left starts a new epoch alone.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use openraft::storage::RaftLogStorage;
use openraft::{BasicNode, CommittedLeaderId, Entry, EntryPayload, LogId, Membership, RaftLogReader, Vote};

use super::epoch::epoch_key;
use super::split::{add_formed, formed_record_key, own_record, wall_ms, Formed};
use super::Busy;
use crate::error::ServerError;
use crate::failover::{Failover, Host, QueueGroup};
use crate::ids::NodeId;
use crate::metadata::{MetaState, QueueMeta};
use crate::queue::epoch::{Epoch, ForkRecord, Inherited, ANCESTRY};
use crate::queue::{QueueCmd, QueueMachine};
use crate::queue::{QueueLog as LogStore, QueueTypes};
use crate::raft::state_machine::stored_applied;
use mirrorq_storage::SmSpace;

impl<H: Host> Failover<H> {
    /// Make this replica the only voter of a new epoch of the group, with
    /// its whole log (committed or not: anything may have been confirmed).
    /// `false`: someone else is re-forming or healing the group, or already
    /// replaced `g`, so nothing was done.
    pub(super) async fn reform(
        &self,
        g: Arc<QueueGroup>,
        q: QueueMeta,
        state: &MetaState,
    ) -> Result<bool, ServerError> {
        let group = q.group;
        let Some(_busy) = Busy::take(&self.shared().busy, group) else { return Ok(false) };
        if !self.take_out(&g) {
            return Ok(false);
        }
        g.stop.cancel();
        g.shut_down().await;

        let raft_err = |e: openraft::StorageError<NodeId>| ServerError::Raft(e.to_string());
        let mut log = LogStore::new(self.db().clone(), group);
        let log_state = log.get_log_state().await.map_err(raft_err)?;
        let ids = log.log_ids().map_err(raft_err)?;
        let term = log.highest_term().map_err(raft_err)?.max(g.epoch.term) + 1;
        let me = self.id();
        let epoch = Epoch { term, node: me };
        let mut record = ForkRecord::from_log(epoch, log_state.last_purged_log_id, ids);
        record.formed_ms = wall_ms();
        let c = QueueMachine::stored_counters(&SmSpace::new(self.db().clone(), group))?;
        let parent = Inherited { from: g.epoch, next_seq: c.next_seq, next_order: c.next_requeue };
        let line = own_record(self.db(), group, g.epoch)?.map(|r| r.inherited).unwrap_or_default();
        record.inherited = std::iter::once(parent).chain(line).take(ANCESTRY).collect();
        let index = log_state.last_log_id.map_or(0, |l| l.index + 1);
        let members = Membership::new(
            vec![BTreeSet::from([me])],
            BTreeMap::from([(me, BasicNode { addr: self.addr().to_string() })]),
        );
        let entry: Entry<QueueTypes> = Entry {
            log_id: LogId::new(CommittedLeaderId::new(term, me), index),
            payload: EntryPayload::Membership(members),
        };
        // Operations in entries not applied here were never answered (replies
        // follow commit), so a get there must not count as a delivery in the
        // new epoch: keep only what publishes. (Publishes may have been
        // confirmed: confirms wait for the synchronised replicas' disks, not
        // for commit.)
        let applied = stored_applied(&SmSpace::new(self.db().clone(), group))?.map_or(0, |l| l.index + 1);
        let mut reader = log.get_log_reader().await;
        let mut entries: Vec<Entry<QueueTypes>> = Vec::new();
        for mut e in reader.try_get_log_entries(applied..).await.map_err(raft_err)? {
            if let EntryPayload::Normal(cmds) = &mut e.payload {
                let before = cmds.len();
                let cmds = std::sync::Arc::make_mut(cmds);
                cmds.retain(|c| c.publishes() || matches!(c, QueueCmd::Fork(_)));
                if cmds.len() != before {
                    entries.push(e);
                }
            }
        }
        entries.push(entry);
        // The epoch's first entry after its membership, before any client's:
        // it marks what the queue held as maybe delivered and moves the
        // delivery tags past the old epoch's, which no get may precede.
        entries.push(Entry {
            log_id: LogId::new(CommittedLeaderId::new(term, me), index + 1),
            payload: EntryPayload::Normal(Arc::new(vec![QueueCmd::Fork(record.clone())])),
        });
        // Before the epoch itself: a replica of the old group that kept its
        // majority across this moment keeps the queue when the two meet.
        add_formed(
            self.db(),
            group,
            Formed { epoch, from: g.epoch, next_seq: c.next_seq, next_order: c.next_requeue },
        )?;
        self.db()
            .put_node_value(&formed_record_key(group), &mirrorq_storage::keys::encode(&record, "formed record")?)?;
        let epoch_value = (epoch_key(group), mirrorq_storage::keys::encode(&epoch, "group epoch")?);
        log.refound(&Vote::new_committed(term, me), entries, (&epoch_value.0, epoch_value.1))
            .await
            .map_err(raft_err)?;
        self.start_group(q.clone(), state).await?;
        tracing::warn!(queue = %q.name, %epoch, from_index = index, "queue re-formed on this replica alone; other replicas rejoin when they return");

        Ok(true)
    }
}
