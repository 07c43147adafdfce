//! The knobs only tests turn (feature `test-hooks`), gathered in one
//! struct, and the seams that read them: each seam is a method that does
//! nothing in a production build, so the paths that call it carry no test
//! checks of their own.

#[cfg(feature = "test-hooks")]
use std::sync::Arc;
#[cfg(feature = "test-hooks")]
use std::time::{Duration, Instant};

#[cfg(feature = "test-hooks")]
use tokio_util::sync::CancellationToken;

use super::Inner;

/// Faults and pauses a test may set on a node (`NodeConfig::test`).
#[cfg(feature = "test-hooks")]
#[derive(Debug, Clone, Default)]
pub struct TestKnobs {
    /// Keep a copy of sled's file as of its last sync, so that
    /// `Node::crash` loses what a power cut would.
    pub crash_image: bool,
    /// The failure watch first runs this long after the start, as on a
    /// node still starting thousands of replicas.
    pub watch_after: Duration,
    /// The replica of this queue starts only once the test notifies, as
    /// one among thousands on a node still starting them.
    pub start_held: Option<(String, Arc<tokio::sync::Notify>)>,
    /// This node's replicas ask their masters for no body and send them no
    /// report until the token is cancelled, as a replica whose fetch is
    /// slow to get going after a snapshot.
    pub bodies_held: Option<CancellationToken>,
    /// As master, this node makes no learner a voter until the token is
    /// cancelled, as a master whose membership change is slow to come.
    pub promotions_held: Option<CancellationToken>,
}

/// The knobs of a running node.
#[cfg(feature = "test-hooks")]
pub(super) struct Knobs {
    watch_from: Instant,
    start_held: Option<(String, Arc<tokio::sync::Notify>)>,
    bodies_held: Option<CancellationToken>,
    promotions_held: Option<CancellationToken>,
}

#[cfg(feature = "test-hooks")]
impl Knobs {
    pub(super) fn new(knobs: &TestKnobs) -> Self {
        Knobs {
            watch_from: Instant::now() + knobs.watch_after,
            start_held: knobs.start_held.clone(),
            bodies_held: knobs.bodies_held.clone(),
            promotions_held: knobs.promotions_held.clone(),
        }
    }
}

impl Inner {
    /// Whether the failure watch may run yet.
    pub(super) fn watch_due(&self) -> bool {
        #[cfg(feature = "test-hooks")]
        return Instant::now() >= self.knobs.watch_from;
        #[cfg(not(feature = "test-hooks"))]
        true
    }

    /// Wait until a test lets the replica of `queue` start.
    pub(super) async fn start_hold(&self, _queue: &str) {
        #[cfg(feature = "test-hooks")]
        if let Some((_, release)) = self.knobs.start_held.as_ref().filter(|(name, _)| name == _queue) {
            release.notified().await;
        }
    }

    /// Whether a test keeps this node, as master, from making learners voters.
    pub(super) fn promotions_held(&self) -> bool {
        #[cfg(feature = "test-hooks")]
        return self.knobs.promotions_held.as_ref().is_some_and(|t| !t.is_cancelled());
        #[cfg(not(feature = "test-hooks"))]
        false
    }

    /// Wait until a test lets this node's replicas fetch bodies.
    pub(super) async fn bodies_hold(&self) {
        #[cfg(feature = "test-hooks")]
        if let Some(released) = &self.knobs.bodies_held {
            released.cancelled().await;
        }
    }
}
