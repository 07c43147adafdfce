use std::path::PathBuf;

/// Errors opening or operating a node's data directory.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("cannot create data dir {path}: {source}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("data dir {path} is in use by another mirrorq process ({holder}); stop it or choose another --data-dir")]
    Locked { path: PathBuf, holder: String },
    #[error("cannot lock data dir {path}: {source}")]
    Lock {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write or remove the clean-stop mark {path}: {source}")]
    CleanMark {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("data dir {path} is unreadable or corrupt (refusing to touch it): {source}")]
    Corrupt {
        path: PathBuf,
        #[source]
        source: sled::Error,
    },
    #[error("data dir {path} is damaged: its sled holds nothing while its log holds groups {groups:?}")]
    SledEmptied { path: PathBuf, groups: Vec<u64> },
    #[error(
        "data dir {path} is damaged: sled came back without writes it had synced (its mark {sled}, the log's {log})"
    )]
    SledBehind { path: PathBuf, sled: u64, log: u64 },
    #[error("data dir {path} is damaged: sled stopped reading it ({what})")]
    SledPanicked { path: PathBuf, what: String },
    #[error("sled: {0}")]
    Sled(#[from] sled::Error),
    #[error("decode {what}: {source}")]
    Decode {
        what: &'static str,
        #[source]
        source: bincode::error::DecodeError,
    },
    #[error("encode {what}: {source}")]
    Encode {
        what: &'static str,
        #[source]
        source: bincode::error::EncodeError,
    },
    #[error("damaged redo record of a state-machine step: {0}")]
    Redo(&'static str),
    #[error(transparent)]
    Wal(#[from] crate::wal::WalError),
    #[error("disk sync failed earlier; the node is stopping (fail-stop)")]
    SyncFailed,
    #[error("the state machine was closed (its group stopped)")]
    Closed,
    #[error("{path} is missing, while {beside} holds a log: the votes and state that go with it are gone")]
    Missing { path: PathBuf, beside: PathBuf },
    #[error("cannot set the damaged data dir {path} aside: {source}")]
    SetAside {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl StorageError {
    /// Whether opening failed because what is on the disk is damaged (as
    /// a power cut or a failing disk leaves it: a checksum that does not
    /// match), rather than because of how the node was started (a lock
    /// held, a permission, a full disk) or a format this build does not
    /// read (an upgrade or downgrade, which must never set a dir aside).
    /// sled reads its file lazily: a damaged one may open and fail at its
    /// first read, which is damage too.
    pub fn is_damage(&self) -> bool {
        matches!(
            self,
            StorageError::Corrupt { source: sled::Error::Corruption { .. }, .. }
                | StorageError::Sled(sled::Error::Corruption { .. })
                | StorageError::Redo(_)
                | StorageError::Missing { .. }
                | StorageError::SledPanicked { .. }
                | StorageError::SledEmptied { .. }
                | StorageError::SledBehind { .. }
                | StorageError::Wal(crate::wal::WalError::Corrupt { .. })
                | StorageError::Wal(crate::wal::WalError::Shorter { .. })
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// sled reads its file lazily: a file cut short beside a snapshot of
    /// its page table that points past the cut opens, and the first read
    /// of a page beyond the cut fails (a campaign's torn sled file did
    /// this at the node's first read). That read's error is damage, as the
    /// same error at open is, so the dir is set aside and refilled rather
    /// than a node that fails at every start.
    #[test]
    fn corrupt_data_met_by_a_read_is_damage() {
        let read = StorageError::from(sled::Error::Corruption { at: None, bt: () });
        assert!(read.is_damage(), "{read}");
        let at_open =
            StorageError::Corrupt { path: "sled".into(), source: sled::Error::Corruption { at: None, bt: () } };
        assert!(at_open.is_damage(), "{at_open}");
        let unsupported = StorageError::from(sled::Error::Unsupported("a later format".into()));
        assert!(!unsupported.is_damage(), "a format this build does not read is not damage");
    }
}
