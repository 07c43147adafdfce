//! The link's test seams, in one place: a peer cut off from this node
//! (every call to it fails as if it were unreachable, and a probe proves
//! nothing, as in a partition), and links that lose every reply. Without
//! the `test-hooks` feature they hold nothing and every check is a
//! constant `false`: a release binary carries no test checks on its paths.

#[cfg(feature = "test-hooks")]
use std::collections::HashSet;
#[cfg(feature = "test-hooks")]
use std::sync::atomic::{AtomicBool, Ordering};
#[cfg(feature = "test-hooks")]
use std::sync::{Arc, RwLock};

use crate::ids::NodeId;

/// Peers this node's calls are cut off from.
#[derive(Default)]
pub struct NetControl {
    #[cfg(feature = "test-hooks")]
    blocked: RwLock<HashSet<NodeId>>,
}

impl NetControl {
    /// Hold back every call to `peer` (a test's one-way cut).
    #[cfg(feature = "test-hooks")]
    pub fn block(&self, peer: NodeId) {
        self.blocked.write().expect("poisoned").insert(peer);
    }

    #[cfg(feature = "test-hooks")]
    pub fn unblock(&self, peer: NodeId) {
        self.blocked.write().expect("poisoned").remove(&peer);
    }

    #[inline]
    pub fn is_blocked(&self, peer: NodeId) -> bool {
        #[cfg(feature = "test-hooks")]
        {
            self.blocked.read().expect("poisoned").contains(&peer)
        }
        #[cfg(not(feature = "test-hooks"))]
        {
            let _ = peer;
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
