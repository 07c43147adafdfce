//! The crate's error type: mount setup, state I/O and control commands.

use std::io;
use std::path::PathBuf;

/// What went wrong outside a FUSE request (those answer with an errno).
#[derive(Debug, thiserror::Error)]
pub enum FaultError {
    /// A file or directory of the backing tree or the state dir.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A control command that could not be parsed or applied.
    #[error("{0}")]
    Command(String),
    /// Mounting, running or unmounting the FUSE session.
    #[error("fuse session: {0}")]
    Session(#[source] io::Error),
}

impl FaultError {
    pub(crate) fn io(path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> FaultError {
        let path = path.into();
        move |source| FaultError::Io { path, source }
    }
}
