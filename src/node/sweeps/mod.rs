//! What a node runs beside its queues' traffic: the reaper of dead
//! consumers' deliveries, message and queue expiry, dead-lettering,
//! compaction of the log, the flow samples behind message rates, and the
//! fetch of message bodies a mirror lacks.

pub(super) mod body_fetch;
pub(super) mod compaction;
pub(super) mod deadletter;
pub(super) mod expiry;
pub(super) mod flows;
pub(super) mod reaper;

use std::time::Duration;

use tokio::time::{Interval, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

use super::Node;

/// A sweep's clock: it ticks every period until the node stops. A sweep
/// that overruns delays the next tick rather than bunching the ticks it
/// missed.
struct Clock {
    tick: Interval,
    stop: CancellationToken,
}

impl Clock {
    fn new(node: &Node, period: Duration) -> Self {
        let mut tick = tokio::time::interval(period);
        tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Clock { tick, stop: node.inner.stop.clone() }
    }

    /// Wait for the next tick; `false` once the node stops.
    async fn next(&mut self) -> bool {
        tokio::select! {
            _ = self.stop.cancelled() => false,
            _ = self.tick.tick() => true,
        }
    }
}
