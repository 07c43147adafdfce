//! The counters and the confirm-latency histogram a node keeps as things
//! happen (the front ends count what their clients do on this node).
//! `http::prometheus` renders them, with gauges read at scrape time.

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};

/// What the front ends count on this node.
#[derive(Debug)]
pub struct Metrics {
    /// Messages received from publishers (AMQP and the HTTP API).
    pub received: Counter,
    /// Publisher confirms sent (`basic.ack`) and HTTP publishes answered.
    pub confirmed: Counter,
    /// Messages delivered to consumers and gets.
    pub delivered: Counter,
    /// Deliveries acknowledged by clients.
    pub acknowledged: Counter,
    /// Time from a publish's last frame to its confirm.
    pub confirm_latency: Histogram,
    /// AppendEntries calls (entries or heartbeats) this node's replicas
    /// were sent by their leaders, every group together.
    pub appends_received: Counter,
    /// Unacked messages given back because their holder (a channel, or
    /// every channel of a node) was gone.
    pub released_of_gone: Counter,
    /// Acks, nacks and rejects sent again because the queue's master was
    /// out of reach or moved when they were first sent.
    pub settles_resent: Counter,
    /// Rounds in which a queue replica could not be started or removed.
    pub reconcile_failures: Counter,
    /// Retried failures (re-forming, membership changes, catch-up,
    /// rejoining, held dead letters that cannot go yet), each logged only
    /// when new.
    pub repeated_failures: Counter,
    /// Leaderships of queue groups won here (a replica here became master
    /// in a new term), the first of each queue's included.
    pub queue_leaderships: Counter,
    /// Vote requests this node's queue replicas were sent: a mirror
    /// standing for the mastership of a queue. A new queue's group is
    /// founded already led, so declares add none.
    pub queue_vote_requests: Counter,
    /// Queue groups re-formed here after losing their majority.
    pub queue_reforms: Counter,
    /// Queue replicas here that handed back and rejoined another epoch
    /// (healing into a newer epoch, or yielding a minority's fork).
    pub queue_rejoins: Counter,
    /// Leaderships of the metadata group won here.
    pub metadata_leaderships: Counter,
    /// Node-link connections refused for not proving the cluster secret.
    pub link_refused: Counter,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            received: Counter::default(),
            confirmed: Counter::default(),
            delivered: Counter::default(),
            acknowledged: Counter::default(),
            // 0.25 ms .. about 4 s.
            confirm_latency: Histogram::new(exponential_buckets(0.00025, 2.0, 15)),
            appends_received: Counter::default(),
            released_of_gone: Counter::default(),
            settles_resent: Counter::default(),
            reconcile_failures: Counter::default(),
            repeated_failures: Counter::default(),
            queue_leaderships: Counter::default(),
            queue_vote_requests: Counter::default(),
            link_refused: Counter::default(),
            queue_reforms: Counter::default(),
            queue_rejoins: Counter::default(),
            metadata_leaderships: Counter::default(),
        }
    }
}
