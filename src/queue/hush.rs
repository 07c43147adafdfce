//! A queue group's Raft heartbeats, off while the group is quiet and back
//! on with the group's next entry. Failover's watch decides when a group
//! is quiet (`failover/watch/quiet.rs`, over the lists of
//! `peers/quiet.rs`); the proposer wakes it, so the first entry after a
//! quiet stretch never waits for anyone to notice.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::QueueRaft as Raft;

pub struct Hush {
    raft: Raft,
    /// Whether heartbeats are off, changed only with the flag in openraft
    /// under this lock, so a wake and a hush cannot cross.
    quiet: Mutex<bool>,
    /// The same, for readers: the node's rounds ask every group whether it
    /// is quiet, ten thousand of them, and need no lock for it.
    seen_quiet: AtomicBool,
}

impl Hush {
    pub fn new(raft: Raft) -> Self {
        Hush { raft, quiet: Mutex::new(false), seen_quiet: AtomicBool::new(false) }
    }

    /// Stop heartbeats, if `still_idle` holds under the lock (checked here
    /// so that an entry proposed since the caller looked keeps them on).
    pub fn quiet_if(&self, still_idle: impl FnOnce() -> bool) -> bool {
        let mut quiet = self.quiet.lock().expect("poisoned");
        if *quiet {
            return true;
        }
        if !still_idle() {
            return false;
        }
        // Ticks only drive heartbeats and elections, which a quiet master
        // does not need.
        self.raft.runtime_config().heartbeat(false);
        self.raft.runtime_config().tick(false);
        *quiet = true;
        self.seen_quiet.store(true, Ordering::Release);
        true
    }

    /// Heartbeats on again; whether they were off.
    pub fn wake(&self) -> bool {
        let mut quiet = self.quiet.lock().expect("poisoned");
        if !*quiet {
            return false;
        }
        self.raft.runtime_config().tick(true);
        self.raft.runtime_config().heartbeat(true);
        *quiet = false;
        self.seen_quiet.store(false, Ordering::Release);
        true
    }

    pub fn is_quiet(&self) -> bool {
        self.seen_quiet.load(Ordering::Acquire)
    }
}
