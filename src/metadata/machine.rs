use std::sync::Arc;

use tokio::sync::watch;

use mirrorq_storage::{keys, Batch, SmSpace, StorageError};

use super::state::MetaState;
use crate::raft::state_machine::Machine;
use crate::raft::types::{Request, Response};

const STATE: &[u8] = b"state";

/// Metadata is small and changes rarely: it is kept whole in memory and
/// written whole on every apply.
pub struct MetaMachine {
    state: MetaState,
    dirty: bool,
    watch: watch::Sender<Arc<MetaState>>,
}

impl MetaMachine {
    /// Every applied change, for the node's reconciler.
    pub fn subscribe(&self) -> watch::Receiver<Arc<MetaState>> {
        self.watch.subscribe()
    }
}

impl Machine for MetaMachine {
    fn load(space: &SmSpace) -> Result<Self, StorageError> {
        let state: MetaState = match space.get(STATE)? {
            Some(b) => keys::decode(&b, "metadata")?,
            None => MetaState::default(),
        };
        let (watch, _) = watch::channel(Arc::new(state.clone()));
        Ok(Self { state, dirty: false, watch })
    }

    fn apply(
        &mut self,
        _space: &SmSpace,
        _index: u64,
        req: &Request,
        _batch: &mut Batch,
        _answering: bool,
    ) -> Result<Response, StorageError> {
        let Request::Meta(cmd) = req else {
            return Ok(Response::None);
        };
        self.dirty = true;
        Ok(Response::Meta(self.state.apply(cmd)))
    }

    fn commit(&mut self, space: &SmSpace, batch: &mut Batch) -> Result<(), StorageError> {
        if std::mem::take(&mut self.dirty) {
            batch.insert(space.key(STATE), keys::encode(&self.state, "metadata")?);
        }
        self.watch.send_replace(Arc::new(self.state.clone()));
        Ok(())
    }

    fn dump(&self, _space: &SmSpace) -> Result<Vec<u8>, StorageError> {
        keys::encode(&self.state, "metadata")
    }

    fn restore(&mut self, space: &SmSpace, dump: &[u8]) -> Result<(), StorageError> {
        self.state = keys::decode(dump, "metadata")?;
        self.dirty = false;
        let mut batch = Batch::default();
        batch.insert(space.key(STATE), dump.to_vec());
        space.apply(batch)
    }
}
