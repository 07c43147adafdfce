//! A node's time limits: heartbeats and elections, how long a replica may
//! lag and still count as synchronised, and the timeouts of failover, the
//! reaper and consumers. One struct, read by the node and failover alike.

use std::time::Duration;

/// Time limits. Defaults suit a loaded 2-core machine running three nodes.
#[derive(Debug, Clone)]
pub struct Timing {
    pub heartbeat: Duration,
    pub election_min: Duration,
    pub election_max: Duration,
    /// A replica that has not caught up with where the master was this long
    /// ago stops counting as synchronised (confirms stop waiting for it).
    pub sync_timeout: Duration,
    /// How long an operation may look for a reachable master.
    pub op_timeout: Duration,
    /// How long a queue's replicas may be without a reachable majority of
    /// their group before the most senior one left re-forms it
    /// (`ha-promote-on-failure: always`).
    pub failure_timeout: Duration,
    /// How long the unacked messages of owners on a node out of reach,
    /// but not seen gone, stay with them before the master gives them
    /// back (`node/sweeps/reaper.rs`).
    pub unreachable_hold: Duration,
    /// How long an AMQP delivery may stay unacked before its channel is
    /// closed (RabbitMQ's `consumer_timeout`), unless its queue sets its
    /// own; `None`: no limit.
    pub consumer_timeout: Option<Duration>,
}

/// RabbitMQ's default `consumer_timeout`: 30 minutes.
pub const DEFAULT_CONSUMER_TIMEOUT: Duration = Duration::from_secs(30 * 60);

impl Default for Timing {
    fn default() -> Self {
        Self {
            heartbeat: Duration::from_millis(250),
            election_min: Duration::from_millis(1000),
            election_max: Duration::from_millis(2000),
            sync_timeout: Duration::from_secs(5),
            op_timeout: Duration::from_secs(15),
            failure_timeout: Duration::from_secs(5),
            unreachable_hold: Duration::from_secs(60),
            consumer_timeout: Some(DEFAULT_CONSUMER_TIMEOUT),
        }
    }
}
