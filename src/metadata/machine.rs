use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

use mirrorq_storage::{keys, Batch, SmSpace, StorageError};

use super::state::{MetaCmd, MetaReply, MetaState, QueueMeta};
use crate::raft::state_machine::Machine;

const STATE: &[u8] = b"state";
/// Prefix of one key per queue, followed by the queue's name.
const QUEUE: &[u8] = b"q/";

fn queue_key(name: &str) -> Vec<u8> {
    [QUEUE, name.as_bytes()].concat()
}

/// Which queues an applied command may have changed: only those are written
/// again, and looked at again by the node's reconciler, so declaring a
/// queue costs the same with ten thousand others.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub enum Touched {
    #[default]
    None,
    Some(BTreeSet<String>),
    /// Policies and nodes re-place every queue; a vhost takes its queues.
    All,
}

/// Past this many names a change is treated as touching every queue: the
/// reconciler then walks them all once, which costs less than a set this
/// large kept in memory.
const TOUCHED_NAMES_MAX: usize = 1024;

impl Touched {
    pub fn contains(&self, name: &str) -> bool {
        match self {
            Touched::None => false,
            Touched::Some(names) => names.contains(name),
            Touched::All => true,
        }
    }

    /// This and `other` together.
    fn merge(&mut self, other: Touched) {
        match other {
            Touched::None => {}
            Touched::All => *self = Touched::All,
            Touched::Some(more) => match self {
                Touched::All => {}
                Touched::None => *self = Touched::Some(more),
                Touched::Some(names) => {
                    names.extend(more);
                    if names.len() > TOUCHED_NAMES_MAX {
                        *self = Touched::All;
                    }
                }
            },
        }
    }

    fn add(&mut self, cmd: &MetaCmd) {
        let name = match cmd {
            MetaCmd::DeclareQueue { name, .. } | MetaCmd::DeleteQueue { name } => name,
            MetaCmd::RegisterNode(_)
            | MetaCmd::ForgetNode { .. }
            | MetaCmd::SetPolicy(_)
            | MetaCmd::ClearPolicy { .. }
            | MetaCmd::DeleteVhost { .. } => {
                *self = Touched::All;
                return;
            }
            MetaCmd::DeclareExchange(_)
            | MetaCmd::DeleteExchange { .. }
            | MetaCmd::Bind(_)
            | MetaCmd::Unbind(_)
            | MetaCmd::PutUser(_)
            | MetaCmd::DeleteUser { .. }
            | MetaCmd::PutVhost(_)
            | MetaCmd::SetPermission(_)
            | MetaCmd::ClearPermission { .. } => return,
        };
        match self {
            Touched::All => {}
            Touched::Some(names) => {
                names.insert(name.clone());
            }
            Touched::None => *self = Touched::Some(BTreeSet::from([name.clone()])),
        }
    }
}

/// Metadata is kept whole in memory. On disk each queue has a key of its
/// own and the rest (nodes, exchanges, bindings, policies, users) is one
/// value, written when an apply changed anything; a queue's key is written
/// only when an apply may have changed that queue.
pub struct MetaMachine {
    state: MetaState,
    dirty: bool,
    touched: Touched,
    watch: watch::Sender<Arc<MetaState>>,
    /// What the commits changed since the feed was last read.
    pending: Arc<Mutex<Touched>>,
}

/// The metadata's states with the queues each change touched, for the one
/// reader that acts on changes (the node's reconciler).
pub struct ChangeFeed {
    pending: Arc<Mutex<Touched>>,
    rx: watch::Receiver<Arc<MetaState>>,
}

impl ChangeFeed {
    /// The newest state, and the queues changed since the last call (every
    /// queue at the first). Read under the lock the commit holds while it
    /// publishes, so a change never comes without its state nor a state
    /// without its change.
    pub fn latest(&mut self) -> (Arc<MetaState>, Touched) {
        let mut pending = self.pending.lock().expect("poisoned");
        let state = self.rx.borrow_and_update().clone();
        (state, std::mem::take(&mut *pending))
    }

    /// Resolves once a state newer than the last one read was committed.
    pub async fn changed(&mut self) -> Result<(), watch::error::RecvError> {
        self.rx.changed().await
    }
}

impl MetaMachine {
    /// Every applied change, for readers of the newest state.
    pub fn subscribe(&self) -> watch::Receiver<Arc<MetaState>> {
        self.watch.subscribe()
    }

    /// The feed of changes; its first read touches every queue. There is
    /// one reader: each read takes the changes it reports.
    pub fn feed(&self) -> ChangeFeed {
        *self.pending.lock().expect("poisoned") = Touched::All;
        ChangeFeed { pending: self.pending.clone(), rx: self.watch.subscribe() }
    }

    /// The rest of the state, without its queues.
    fn encode_rest(&mut self) -> Result<Vec<u8>, StorageError> {
        let queues = std::mem::take(&mut self.state.queues);
        let rest = keys::encode(&self.state, "metadata");
        self.state.queues = queues;
        rest
    }
}

impl Machine for MetaMachine {
    type Cmd = MetaCmd;
    type Reply = MetaReply;

    fn load(space: &SmSpace) -> Result<Self, StorageError> {
        let mut state: MetaState = match space.get(STATE)? {
            Some(b) => keys::decode(&b, "metadata")?,
            None => MetaState::default(),
        };
        // A state written whole (before queues had keys of their own, or
        // installed from a snapshot) is split up at the next apply.
        let touched = if state.queues.is_empty() { Touched::None } else { Touched::All };
        for kv in space.scan(QUEUE) {
            let (_, v) = kv?;
            let q: QueueMeta = keys::decode(&v, "queue metadata")?;
            state.queues.insert(q.name.clone(), q);
        }
        state.reindex();
        let (watch, _) = watch::channel(Arc::new(state.clone()));
        Ok(Self { state, dirty: false, touched, watch, pending: Arc::default() })
    }

    fn apply(
        &mut self,
        _space: &SmSpace,
        _index: u64,
        cmd: &MetaCmd,
        _batch: &mut Batch,
        _answering: bool,
    ) -> Result<MetaReply, StorageError> {
        self.dirty = true;
        self.touched.add(cmd);
        Ok(self.state.apply(cmd))
    }

    fn commit(&mut self, space: &SmSpace, batch: &mut Batch) -> Result<(), StorageError> {
        let touched = std::mem::take(&mut self.touched);
        if std::mem::take(&mut self.dirty) {
            batch.insert(space.key(STATE), self.encode_rest()?);
            match &touched {
                Touched::None => {}
                Touched::Some(names) => {
                    for name in names {
                        match self.state.queues.get(name) {
                            Some(q) => batch.insert(space.key(&queue_key(name)), keys::encode(q, "queue metadata")?),
                            None => batch.remove(space.key(&queue_key(name))),
                        }
                    }
                }
                Touched::All => {
                    for kv in space.scan(QUEUE) {
                        let (k, _) = kv?;
                        batch.remove(space.key(&k));
                    }
                    for (name, q) in &self.state.queues {
                        batch.insert(space.key(&queue_key(name)), keys::encode(q, "queue metadata")?);
                    }
                }
            }
        }
        let mut pending = self.pending.lock().expect("poisoned");
        pending.merge(touched);
        self.watch.send_replace(Arc::new(self.state.clone()));
        Ok(())
    }

    fn dump(&self, _space: &SmSpace) -> Result<Vec<u8>, StorageError> {
        keys::encode(&self.state, "metadata")
    }

    fn restore(&mut self, space: &SmSpace, dump: &[u8]) -> Result<(), StorageError> {
        self.state = keys::decode(dump, "metadata")?;
        self.state.reindex();
        // The space was cleared: every queue gets its key again.
        self.dirty = true;
        self.touched = Touched::All;
        let mut batch = Batch::default();
        self.commit(space, &mut batch)?;
        space.apply(batch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::policy::{ApplyTo, Policy};
    use crate::metadata::state::NodeInfo;
    use mirrorq_storage::{DbOptions, NodeDb};

    fn declare(name: &str) -> MetaCmd {
        MetaCmd::DeclareQueue {
            name: name.into(),
            replicas: vec![],
            durable: true,
            declared_on: 1,
            locator: None,
            exclusive_owner: None,
            auto_delete: false,
            args: Default::default(),
        }
    }

    /// Apply `cmds` as one apply call ends (a commit), as the state machine does.
    fn apply_all(m: &mut MetaMachine, space: &SmSpace, cmds: Vec<MetaCmd>) {
        let mut batch = Batch::default();
        for cmd in cmds {
            m.apply(space, 0, &cmd, &mut batch, false).unwrap();
        }
        m.commit(space, &mut batch).unwrap();
        space.apply(batch).unwrap();
    }

    /// An empty metadata machine on a fresh store (the dir lives as long as it).
    fn fresh() -> (tempfile::TempDir, SmSpace, MetaMachine) {
        let dir = tempfile::tempdir().unwrap();
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        let space = SmSpace::new(db, 0);
        let m = MetaMachine::load(&space).unwrap();
        (dir, space, m)
    }

    fn ha_all() -> Policy {
        Policy {
            name: "ha".into(),
            pattern: ".*".into(),
            apply_to: ApplyTo::Queues,
            priority: 0,
            definition: r#"{"ha-mode":"all"}"#.into(),
        }
    }

    fn queue_keys(space: &SmSpace) -> Vec<Vec<u8>> {
        space.scan(QUEUE).map(|kv| kv.unwrap().0).collect()
    }

    #[test]
    fn queues_are_written_one_key_each_and_read_back_whole() {
        let (_dir, space, mut m) = fresh();
        let nodes =
            (1..=3).map(|id| MetaCmd::RegisterNode(NodeInfo { id, name: format!("n{id}"), raft_addr: String::new() }));
        apply_all(&mut m, &space, nodes.chain(["a", "b", "c"].map(declare)).collect());
        assert_eq!(queue_keys(&space), vec![queue_key("a"), queue_key("b"), queue_key("c")]);
        let rest: MetaState = keys::decode(&space.get(STATE).unwrap().unwrap(), "metadata").unwrap();
        assert!(rest.queues.is_empty(), "queues are not written with the rest");

        // A policy re-places every queue; a delete drops its key.
        let b = m.state.queues["b"].group;
        apply_all(&mut m, &space, vec![MetaCmd::SetPolicy(ha_all()), MetaCmd::DeleteQueue { name: "b".into() }]);
        assert_eq!(queue_keys(&space), vec![queue_key("a"), queue_key("c")]);
        assert!(m.state.queue_by_group(b).is_none(), "a deleted queue is not found by its group");
        apply_all(&mut m, &space, vec![declare("d")]);
        let again = MetaMachine::load(&space).unwrap();
        assert_eq!(again.state, m.state);
        for name in ["a", "c", "d"] {
            let group = m.state.queues[name].group;
            assert_eq!(again.state.queue_by_group(group).map(|q| q.name.as_str()), Some(name), "read back indexed");
        }
        assert_eq!(again.state.queues["a"].replicas.len(), 3);
    }

    #[test]
    fn the_change_feed_tells_which_queues_each_change_touched() {
        let (_dir, space, mut m) = fresh();
        let mut feed = m.feed();
        let (_, first) = feed.latest();
        assert_eq!(first, Touched::All, "the first read looks at every queue");
        let node = MetaCmd::RegisterNode(NodeInfo { id: 1, name: "n1".into(), raft_addr: String::new() });
        apply_all(&mut m, &space, vec![node]);
        assert_eq!(feed.latest().1, Touched::All, "a node re-places every queue");
        assert_eq!(feed.latest().1, Touched::None, "a read takes what it reports");

        // Changes between two reads add up, and come with the state they made.
        apply_all(&mut m, &space, vec![declare("a")]);
        apply_all(&mut m, &space, vec![declare("b"), MetaCmd::DeleteQueue { name: "a".into() }]);
        let (state, touched) = feed.latest();
        assert_eq!(touched, Touched::Some(BTreeSet::from(["a".to_string(), "b".to_string()])));
        assert!(state.queues.contains_key("b") && !state.queues.contains_key("a"));

        // Exchanges and users touch no queue; a policy touches them all.
        apply_all(&mut m, &space, vec![MetaCmd::DeleteExchange { name: "x".into(), if_unused: false }]);
        assert_eq!(feed.latest().1, Touched::None);
        apply_all(&mut m, &space, vec![declare("c")]);
        apply_all(&mut m, &space, vec![MetaCmd::SetPolicy(ha_all())]);
        assert_eq!(feed.latest().1, Touched::All);

        // Past the bound, a pile of names becomes every queue.
        for i in 0..=TOUCHED_NAMES_MAX {
            apply_all(&mut m, &space, vec![declare(&format!("q{i}"))]);
        }
        assert_eq!(feed.latest().1, Touched::All);
    }

    #[test]
    fn a_state_written_whole_is_read_and_split_at_the_next_apply() {
        let dir = tempfile::tempdir().unwrap();
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        let space = SmSpace::new(db.clone(), 0);
        let mut whole = MetaState::default();
        whole.apply(&MetaCmd::RegisterNode(NodeInfo { id: 1, name: "n1".into(), raft_addr: String::new() }));
        whole.apply(&declare("old"));
        let mut batch = Batch::default();
        batch.insert(space.key(STATE), keys::encode(&whole, "metadata").unwrap());
        space.apply(batch).unwrap();

        let mut m = MetaMachine::load(&space).unwrap();
        assert_eq!(m.state, whole);
        apply_all(&mut m, &space, vec![declare("new")]);
        assert_eq!(queue_keys(&space), vec![queue_key("new"), queue_key("old")]);
        let again = MetaMachine::load(&space).unwrap();
        assert_eq!(again.state.queues.keys().collect::<Vec<_>>(), ["new", "old"]);
    }

    #[test]
    fn a_restored_snapshot_gives_every_queue_its_key() {
        let dir = tempfile::tempdir().unwrap();
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        let (from, to) = (SmSpace::new(db.clone(), 0), SmSpace::new(db.clone(), 1));
        let mut m = MetaMachine::load(&from).unwrap();
        let node = MetaCmd::RegisterNode(NodeInfo { id: 1, name: "n1".into(), raft_addr: String::new() });
        apply_all(&mut m, &from, vec![node, declare("a"), declare("b")]);
        let dump = m.dump(&from).unwrap();
        let mut r = MetaMachine::load(&to).unwrap();
        r.restore(&to, &dump).unwrap();
        assert_eq!(queue_keys(&to), vec![queue_key("a"), queue_key("b")]);
        let a = m.state.queues["a"].group;
        assert_eq!(r.state.queue_by_group(a).map(|q| q.name.as_str()), Some("a"), "a restored state is indexed");
        assert_eq!(MetaMachine::load(&to).unwrap().state, m.state);
    }
}
