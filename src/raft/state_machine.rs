//! openraft's `RaftStateMachine` over a group's [`SmSpace`], generic over the
//! deterministic machine (queue or metadata) that interprets entries.
//!
//! State is kept on disk as it is applied, so a restart does not replay the
//! whole log and a deep queue does not live in memory. Building a snapshot is
//! therefore cheap: make the applied state durable and record its log id; logs
//! up to it can then be purged. Only when a lagging replica needs the state is
//! it serialized, by [`Machine::dump`].

use std::io::Cursor;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    AnyError, EntryPayload, ErrorSubject, ErrorVerb, LogId, OptionalSend, RaftSnapshotBuilder, SnapshotMeta,
    StorageIOError, StoredMembership,
};
use serde::{Deserialize, Serialize};
use tokio::sync::Mutex;

use mirrorq_storage::{keys, Batch, Durability, SmSpace, StorageError};

use crate::ids::NodeId;

use super::types::Group;

type RaftStorageError = openraft::StorageError<NodeId>;

/// A deterministic state machine whose state lives in a group's [`SmSpace`].
pub trait Machine: Send + Sync + Sized + 'static {
    /// What one entry of the group's log carries.
    type Cmd: openraft::AppData;
    /// What applying one answers; the default for entries without a
    /// command (blank and membership ones), whose answers nobody reads.
    type Reply: openraft::AppDataResponse + Default;
    /// Load the state written by earlier applies (empty space: initial state).
    fn load(space: &SmSpace) -> Result<Self, StorageError>;
    /// Apply one request, the entry at `index` of the group's log; writes
    /// go into `batch` (keys from `space.key`).
    /// `answering`: this node proposed the entry, so its reply reaches a
    /// client; elsewhere the reply is dropped and need not be filled in.
    fn apply(
        &mut self,
        space: &SmSpace,
        index: u64,
        req: &Self::Cmd,
        batch: &mut Batch,
        answering: bool,
    ) -> Result<Self::Reply, StorageError>;
    /// Add aggregate state to the batch that ends an apply call; announce the
    /// new state to watchers.
    fn commit(&mut self, space: &SmSpace, batch: &mut Batch) -> Result<(), StorageError>;
    /// Called before a snapshot of the applied state is taken, after which
    /// the log up to it may be purged: whatever the state still reads from
    /// applied entries must be copied out of the log now.
    fn before_snapshot(&mut self, _space: &SmSpace) -> Result<(), StorageError> {
        Ok(())
    }
    /// Group-relative key prefixes an installed snapshot leaves in place
    /// for [`Machine::restore`] to sort out (the rest is cleared first).
    const KEEP_ON_INSTALL: &'static [&'static [u8]] = &[];
    /// The whole state, for a snapshot sent to another replica.
    fn dump(&self, space: &SmSpace) -> Result<Vec<u8>, StorageError>;
    /// Replace the state with a dump, writing it into the space (cleared
    /// but for [`Machine::KEEP_ON_INSTALL`]). In place, so watchers of the machine stay subscribed.
    fn restore(&mut self, space: &SmSpace, dump: &[u8]) -> Result<(), StorageError>;
}

/// The type configuration of the groups machine `M` runs.
type TypesOf<M> = Group<<M as Machine>::Cmd, <M as Machine>::Reply>;

/// openraft builds a snapshot every this many entries (`SnapshotPolicy`).
pub const SNAPSHOT_EVERY: u64 = 1024;

const APPLIED_KEY: &[u8] = b"_applied";
const SNAPSHOT_KEY: &[u8] = b"_snapshot";

#[derive(Serialize, Deserialize, Default)]
struct Applied {
    last_applied: Option<LogId<NodeId>>,
    membership: StoredMembership<NodeId, openraft::BasicNode>,
}

struct Inner<M> {
    space: SmSpace,
    machine: M,
    applied: Applied,
    /// The stored applied record still carries the last step's redo
    /// writes (see `SmSpace::apply_step`). Replaying them after a write that
    /// did not go through `apply` could undo that write, so such a write
    /// first stores the record without them.
    redo_stored: bool,
    /// Closed when its group stopped: openraft's state-machine worker
    /// outlives the group's core and goes on with what it was given, so a
    /// replica being re-formed or wiped would otherwise be written after
    /// its state was read (a get applied by the old worker after the
    /// re-formation took its entry as unapplied: a live message without a
    /// body in the new epoch).
    closed: bool,
}

/// The state machine of one group.
pub struct StateMachine<M> {
    inner: Arc<Mutex<Inner<M>>>,
    /// openraft asks for the current snapshot while starting up but uses only
    /// its meta; serializing a deep queue there made restarts take seconds.
    /// Until this is set (after `Raft::new`), the snapshot carries no data.
    transfer: Arc<AtomicBool>,
    /// This node: entries it proposed are the ones it answers.
    node: NodeId,
    /// The group's local log: an entry is applied only once it is durable
    /// there ([`StateMachine::applying_durable`]).
    log: Option<Durability>,
}

impl<M> Clone for StateMachine<M> {
    fn clone(&self) -> Self {
        Self { inner: self.inner.clone(), transfer: self.transfer.clone(), node: self.node, log: self.log.clone() }
    }
}

fn sto(subject: ErrorSubject<NodeId>, verb: ErrorVerb, e: StorageError) -> RaftStorageError {
    openraft::StorageError::IO { source: StorageIOError::new(subject, verb, AnyError::new(&e)) }
}

/// The last applied log id stored in a group's space (read while its Raft
/// is stopped).
pub fn stored_applied(space: &SmSpace) -> Result<Option<LogId<NodeId>>, StorageError> {
    Ok(match space.get(APPLIED_KEY)? {
        Some(b) => keys::decode::<Applied>(&b, "applied state")?.last_applied,
        None => None,
    })
}

impl<M: Machine> StateMachine<M> {
    /// The state machine of the group in `space`, on node `node`.
    pub fn open(space: SmSpace, node: NodeId) -> Result<Self, StorageError> {
        let applied = match space.get(APPLIED_KEY)? {
            Some(b) => {
                let (applied, used) = keys::decode_prefix::<Applied>(&b, "applied state")?;
                // A crash may have cut the last step short: finish it
                // before the machine reads its state.
                let replayed = space.replay(&b[used..])?;
                if replayed > 0 {
                    tracing::debug!(replayed, "finished the last applied step from its redo record");
                }
                applied
            }
            None => Applied::default(),
        };
        let machine = M::load(&space)?;
        Ok(Self {
            inner: Arc::new(Mutex::new(Inner { space, machine, applied, redo_stored: true, closed: false })),
            transfer: Arc::new(AtomicBool::new(false)),
            node,
            log: None,
        })
    }

    /// Apply an entry only once it is durable in the group's local log
    /// (`log`: its `LogStore::durability`). A leader may be told an entry
    /// is committed (its mirrors have it) before its own sync of it ends;
    /// what applying writes may reach the disk with the next sled sync,
    /// or by the kernel's own writeback, and a queue's state refers to its
    /// log entries for their bodies. After a power cut the log could lack
    /// an entry the state names: the state's applied id past the log's
    /// end, openraft purges up to it, and the body is gone from this
    /// replica. Waiting costs nothing while the leader's sync keeps up
    /// with its mirrors'; a mirror's entries are synced before it hears
    /// they are committed.
    pub fn applying_durable(mut self, log: Durability) -> Self {
        self.log = Some(log);
        self
    }

    /// Refuse every later write (apply, snapshot, fetched bodies), once
    /// the one under way, if any, is done. Call after the group's `Raft`
    /// has shut down and before its stored state is read or wiped.
    pub async fn close(&self) {
        self.inner.lock().await.closed = true;
    }

    /// From now on `get_current_snapshot` serializes the state (for sending
    /// it to a replica). Call once the group's `Raft` has started.
    pub fn enable_snapshot_transfer(&self) {
        self.transfer.store(true, Ordering::Release);
    }

    /// Run `f` on the machine (for reads that need not go through the log).
    pub async fn with<T>(&self, f: impl FnOnce(&M) -> T) -> T {
        f(&self.inner.lock().await.machine)
    }

    /// Run `f` on the machine and its space, between two applies (for
    /// local state that is not the log's: fetched message bodies).
    pub async fn with_mut<T>(
        &self,
        f: impl FnOnce(&mut M, &SmSpace) -> Result<T, StorageError>,
    ) -> Result<T, StorageError> {
        let mut guard = self.inner.lock().await;
        let inner = &mut *guard;
        if inner.closed {
            return Err(StorageError::Closed);
        }
        inner.forget_redo()?;
        f(&mut inner.machine, &inner.space)
    }

    /// The group's key space.
    pub async fn space(&self) -> SmSpace {
        self.inner.lock().await.space.clone()
    }
}

fn snapshot_id(last: &Option<LogId<NodeId>>) -> String {
    match last {
        Some(l) => format!("{}-{}-{}", l.leader_id.term, l.leader_id.node_id, l.index),
        None => "empty".to_string(),
    }
}

impl<M: Machine> Inner<M> {
    /// Store the applied record without the last step's redo writes (that
    /// step is complete: every write of it came before this one).
    fn forget_redo(&mut self) -> Result<(), StorageError> {
        if self.redo_stored {
            self.space.put(APPLIED_KEY, keys::encode(&self.applied, "applied state")?)?;
            self.redo_stored = false;
        }
        Ok(())
    }

    fn meta(&self) -> SnapshotMeta<NodeId, openraft::BasicNode> {
        SnapshotMeta {
            last_log_id: self.applied.last_applied,
            last_membership: self.applied.membership.clone(),
            snapshot_id: snapshot_id(&self.applied.last_applied),
        }
    }
}

impl<M: Machine> RaftSnapshotBuilder<TypesOf<M>> for StateMachine<M> {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypesOf<M>>, RaftStorageError> {
        let mut guard = self.inner.lock().await;
        let inner = &mut *guard;
        let err = |e| sto(ErrorSubject::StateMachine, ErrorVerb::Write, e);
        if inner.closed {
            return Err(err(StorageError::Closed));
        }
        inner.forget_redo().map_err(err)?;
        inner.machine.before_snapshot(&inner.space).map_err(err)?;
        // Everything applied so far becomes durable; only then may openraft
        // purge the log entries it came from.
        inner.space.sync().await.map_err(|e| sto(ErrorSubject::StateMachine, ErrorVerb::Write, e))?;
        let meta = inner.meta();
        let b =
            keys::encode(&meta, "snapshot meta").map_err(|e| sto(ErrorSubject::Snapshot(None), ErrorVerb::Write, e))?;
        // One key: a plain insert is atomic, no sled batch needed.
        inner.space.put(SNAPSHOT_KEY, b).map_err(|e| sto(ErrorSubject::Snapshot(None), ErrorVerb::Write, e))?;
        // openraft keeps only the meta of a built snapshot; the data is
        // produced by `get_current_snapshot` when a replica needs it.
        Ok(Snapshot { meta, snapshot: Box::new(Cursor::new(Vec::new())) })
    }
}

impl<M: Machine> RaftStateMachine<TypesOf<M>> for StateMachine<M> {
    type SnapshotBuilder = Self;

    async fn applied_state(
        &mut self,
    ) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, openraft::BasicNode>), RaftStorageError> {
        let inner = self.inner.lock().await;
        Ok((inner.applied.last_applied, inner.applied.membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<M::Reply>, RaftStorageError>
    where
        I: IntoIterator<Item = openraft::Entry<TypesOf<M>>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries: Vec<openraft::Entry<TypesOf<M>>> = entries.into_iter().collect();
        if let (Some(log), Some(last)) = (&self.log, entries.last()) {
            // Not under the lock: reads of the machine go on meanwhile.
            log.wait(last.log_id.index)
                .await
                .map_err(|e| sto(ErrorSubject::Apply(last.log_id), ErrorVerb::Write, e))?;
        }
        let mut guard = self.inner.lock().await;
        let inner = &mut *guard;
        if inner.closed {
            return Err(sto(ErrorSubject::StateMachine, ErrorVerb::Write, StorageError::Closed));
        }
        let mut out = Vec::new();
        // One atomic batch per entry: an entry may read what the previous
        // one wrote (a get of a message published just before), so each
        // entry's writes must be visible before the next is applied.
        for entry in entries {
            let mut batch = Batch::default();
            let resp = match &entry.payload {
                EntryPayload::Blank => M::Reply::default(),
                EntryPayload::Normal(req) => inner
                    .machine
                    .apply(
                        &inner.space,
                        entry.log_id.index,
                        req,
                        &mut batch,
                        entry.log_id.leader_id.node_id == self.node,
                    )
                    .map_err(|e| sto(ErrorSubject::Apply(entry.log_id), ErrorVerb::Write, e))?,
                EntryPayload::Membership(m) => {
                    inner.applied.membership = StoredMembership::new(Some(entry.log_id), m.clone());
                    M::Reply::default()
                }
            };
            inner.applied.last_applied = Some(entry.log_id);
            inner
                .machine
                .commit(&inner.space, &mut batch)
                .map_err(|e| sto(ErrorSubject::StateMachine, ErrorVerb::Write, e))?;
            let b = keys::encode(&inner.applied, "applied state")
                .map_err(|e| sto(ErrorSubject::StateMachine, ErrorVerb::Write, e))?;
            inner
                .space
                .apply_step(APPLIED_KEY, b, batch)
                .map_err(|e| sto(ErrorSubject::StateMachine, ErrorVerb::Write, e))?;
            inner.redo_stored = true;
            out.push(resp);
        }
        Ok(out)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.clone()
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>, RaftStorageError> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, openraft::BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<(), RaftStorageError> {
        let mut inner = self.inner.lock().await;
        let err = |e| sto(ErrorSubject::Snapshot(Some(meta.signature())), ErrorVerb::Write, e);
        if inner.closed {
            return Err(err(StorageError::Closed));
        }
        inner.space.clear_keeping(M::KEEP_ON_INSTALL).map_err(err)?;
        {
            let inner = &mut *inner;
            inner.machine.restore(&inner.space, snapshot.get_ref()).map_err(err)?;
        }
        inner.applied = Applied { last_applied: meta.last_log_id, membership: meta.last_membership.clone() };
        let mut batch = Batch::default();
        batch.insert(inner.space.key(APPLIED_KEY), keys::encode(&inner.applied, "applied state").map_err(err)?);
        batch.insert(inner.space.key(SNAPSHOT_KEY), keys::encode(meta, "snapshot meta").map_err(err)?);
        inner.space.apply(batch).map_err(err)?;
        inner.redo_stored = false;
        let mut batch = Batch::default();
        let inner = &mut *inner;
        inner.machine.commit(&inner.space, &mut batch).map_err(err)?;
        inner.space.apply(batch).map_err(err)?;
        // openraft purges the log up to the snapshot once this returns: a
        // crash must not then find the state from before the install with
        // the entries that led past it gone.
        inner.space.sync().await.map_err(err)?;
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypesOf<M>>>, RaftStorageError> {
        let mut guard = self.inner.lock().await;
        let inner = &mut *guard;
        let err = |e| sto(ErrorSubject::Snapshot(None), ErrorVerb::Read, e);
        if inner.space.get(SNAPSHOT_KEY).map_err(err)?.is_none() {
            return Ok(None);
        }
        // The current state is at least as new as the last built snapshot and
        // consistent with `applied` (we hold the lock), so send that. openraft
        // takes its id for the snapshot's (at start-up too) and may purge the
        // log up to it: what the state still reads from the log is copied
        // out first.
        inner.forget_redo().map_err(err)?;
        inner.machine.before_snapshot(&inner.space).map_err(err)?;
        let data = if self.transfer.load(Ordering::Acquire) {
            inner.machine.dump(&inner.space).map_err(err)?
        } else {
            Vec::new()
        };
        Ok(Some(Snapshot { meta: inner.meta(), snapshot: Box::new(Cursor::new(data)) }))
    }
}
