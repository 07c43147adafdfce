//! The link's test seams, in one place: a peer cut off from this node
//! (every call to it fails as if it were unreachable, and a probe proves
//! nothing, as in a partition), and links that lose every reply. The
//! transport applies them itself, so no caller checks for them (but the
//! liveness probe, whose dial into a cut must prove nothing). Without
//! the `test-hooks` feature they hold nothing and every check is a
//! constant `false`: a release binary carries no test checks on its paths.

#[cfg(feature = "test-hooks")]
use std::collections::HashSet;
#[cfg(feature = "test-hooks")]
use std::sync::atomic::{AtomicBool, Ordering};
#[cfg(feature = "test-hooks")]
use std::sync::{Arc, RwLock};

/// Peers (by address) this node's calls are cut off from.
#[derive(Default)]
pub(super) struct NetControl {
    #[cfg(feature = "test-hooks")]
    blocked: RwLock<HashSet<String>>,
}

impl NetControl {
    /// Hold back every call to `addr` (a test's one-way cut).
    #[cfg(feature = "test-hooks")]
    pub(super) fn block(&self, addr: &str) {
        self.blocked.write().expect("poisoned").insert(addr.to_string());
    }

    #[cfg(feature = "test-hooks")]
    pub(super) fn unblock(&self, addr: &str) {
        self.blocked.write().expect("poisoned").remove(addr);
    }

    #[inline]
    pub(super) fn is_blocked(&self, addr: &str) -> bool {
        #[cfg(feature = "test-hooks")]
        {
            self.blocked.read().expect("poisoned").contains(addr)
        }
        #[cfg(not(feature = "test-hooks"))]
        {
            let _ = addr;
            false
        }
    }
}

/// Whether the replies on one peer's links are dropped on arrival.
#[derive(Clone, Default)]
pub struct Deafness(#[cfg(feature = "test-hooks")] Arc<AtomicBool>);

impl Deafness {
    #[cfg(feature = "test-hooks")]
    pub fn set(&self, deaf: bool) {
        self.0.store(deaf, Ordering::Release);
    }

    #[inline]
    pub fn is_on(&self) -> bool {
        #[cfg(feature = "test-hooks")]
        {
            self.0.load(Ordering::Acquire)
        }
        #[cfg(not(feature = "test-hooks"))]
        false
    }
}
