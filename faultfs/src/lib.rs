//! faultfs: a FUSE passthrough filesystem for crash tests that forgets
//! what was not synced.
//!
//! # Layout
//! - [`cli`]: clap structs.
//! - [`state`]: the inode table, unsynced-write tracking, the durable image,
//!   `cut`/`torn` and corruption.
//! - [`fs`]: the FUSE operations (passthrough to BACKING).
//! - [`control`]: the control socket and its client.
//! - [`mount`]: mounting, signals, the session loop.

pub mod cli;
pub mod control;
pub mod error;
pub mod fs;
pub mod mount;
pub mod state;

pub use error::FaultError;
