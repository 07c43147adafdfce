//! Prometheus metrics (`GET /metrics`), named as RabbitMQ's prometheus
//! plugin names them where it has the same figure (`rabbitmq_*`), ours
//! (`mirrorq_*`) otherwise.
//!
//! Counters come from `metrics::Metrics`; gauges are read from the node's
//! state when scraped. Like RabbitMQ, each node reports its own: per-queue
//! figures come from the node mastering the queue, Raft figures from every
//! replica it hosts.

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;

use crate::node::Node;

/// A histogram whose buckets were counted elsewhere (the storage flusher's
/// sync durations), encoded as read at scrape time.
#[derive(Debug)]
struct Counted {
    sum: f64,
    count: u64,
    /// `(upper bound, count in this bucket)`.
    buckets: Vec<(f64, u64)>,
}

impl EncodeMetric for Counted {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        encoder.encode_histogram::<NoLabelSet>(self.sum, self.count, &self.buckets, None)
    }
    fn metric_type(&self) -> MetricType {
        MetricType::Histogram
    }
}

type Labelled = Family<Vec<(String, String)>, Gauge>;

fn labelled(registry: &mut Registry, name: &str, help: &str) -> Labelled {
    let f = Labelled::default();
    registry.register(name, help, f.clone());
    f
}

fn gauge(registry: &mut Registry, name: &str, help: &str, v: u64) {
    let g: Gauge = Gauge::default();
    g.set(i64::try_from(v).unwrap_or(i64::MAX));
    registry.register(name, help, g);
}

fn queue_labels(queue: &str) -> Vec<(String, String)> {
    let (vhost, name) = crate::metadata::names::split(queue);
    vec![("queue".into(), name.into()), ("vhost".into(), vhost.into())]
}

/// The node's metrics in the OpenMetrics text format.
pub fn render(node: &Node) -> String {
    let mut r = Registry::default();
    counters(&mut r, node);
    storage(&mut r, node);
    replicas(&mut r, node);
    node_gauges(&mut r, node);
    let mut out = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &r) {
        let _ = writeln!(out, "# encoding failed: {e}");
    }
    out
}

/// The counters of `metrics::Metrics`, and the process's dropped log lines.
fn counters(r: &mut Registry, node: &Node) {
    let m = node.metrics();
    r.register("rabbitmq_global_messages_received", "Messages received from publishers", m.received.clone());
    r.register("rabbitmq_global_messages_confirmed", "Messages confirmed to publishers", m.confirmed.clone());
    r.register("rabbitmq_global_messages_delivered", "Messages delivered to consumers", m.delivered.clone());
    r.register("rabbitmq_global_messages_acknowledged", "Messages acknowledged by consumers", m.acknowledged.clone());
    r.register(
        "mirrorq_released_of_gone_owners",
        "Unacked messages requeued because the channel or node holding them was gone",
        m.released_of_gone.clone(),
    );
    r.register(
        "mirrorq_settles_resent",
        "Acks, nacks and rejects sent again because the queue's master was out of reach when first sent",
        m.settles_resent.clone(),
    );
    r.register(
        "mirrorq_replica_start_failures",
        "Rounds in which a queue replica on this node could not be started or removed",
        m.reconcile_failures.clone(),
    );
    r.register(
        "mirrorq_repeated_failures",
        "Retried failures (re-forming, membership changes, catch-up, rejoining, held dead letters); each is logged only when new",
        m.repeated_failures.clone(),
    );
    let dropped: Counter = Counter::default();
    dropped.inc_by(crate::log_throttle::dropped_total());
    r.register(
        "mirrorq_log_lines_dropped",
        "Log lines dropped because their callsite repeated more than its allowance in a minute (the process's log, all nodes in it)",
        dropped,
    );
    r.register(
        "mirrorq_queue_leaderships",
        "Times a queue replica on this node became master in a new term (elections won, first ones included)",
        m.queue_leaderships.clone(),
    );
    r.register(
        "mirrorq_queue_vote_requests",
        "Vote requests this node's queue replicas were sent (a mirror standing for a queue's mastership); declares add none",
        m.queue_vote_requests.clone(),
    );
    r.register(
        "mirrorq_link_refused",
        "Node-link connections refused for not proving the cluster secret (--cluster-secret-file)",
        m.link_refused.clone(),
    );
    r.register(
        "mirrorq_queue_reforms",
        "Queues re-formed on this node after their group lost its majority",
        m.queue_reforms.clone(),
    );
    r.register(
        "mirrorq_queue_rejoins",
        "Queue replicas on this node that handed back their messages and rejoined another epoch of their group",
        m.queue_rejoins.clone(),
    );
    r.register(
        "mirrorq_metadata_leaderships",
        "Times this node became leader of the metadata group in a new term",
        m.metadata_leaderships.clone(),
    );
    r.register(
        "mirrorq_confirm_latency_seconds",
        "Time from a publish to its confirm (every synchronised replica fsync'd)",
        m.confirm_latency.clone(),
    );
    r.register(
        "mirrorq_raft_appends_received",
        "AppendEntries calls (entries or heartbeats) received from leaders, every group of this node",
        m.appends_received.clone(),
    );
}

/// The storage flusher's syncs and the log's relocations.
fn storage(r: &mut Registry, node: &Node) {
    let stats = node.db().flusher().stats();
    let buckets = mirrorq_storage::flusher::SYNC_BUCKET_BOUNDS
        .iter()
        .zip(&stats.sync_buckets)
        .map(|(b, n)| (*b, n.load(Ordering::Relaxed)))
        .collect();
    r.register(
        "mirrorq_fsync_seconds",
        "Duration of the storage flusher's flush + fdatasync rounds",
        Counted {
            sum: stats.sync_nanos.load(Ordering::Relaxed) as f64 / 1e9,
            count: stats.syncs.load(Ordering::Relaxed),
            buckets,
        },
    );

    let relocated = Counter::<u64>::default();
    relocated.inc_by(node.db().wal().relocated_bytes());
    r.register(
        "mirrorq_wal_relocated_bytes",
        "Log bytes copied forward because idle queues pinned the oldest log segment (each copy holds every append)",
        relocated,
    );
}

/// Per queue replica hosted here: Raft figures from each, message counts
/// from those mastered here.
fn replicas(r: &mut Registry, node: &Node) {
    let ready = labelled(r, "rabbitmq_queue_messages_ready", "Messages ready to be delivered (queues mastered here)");
    let unacked = labelled(r, "rabbitmq_queue_messages_unacked", "Messages delivered, not yet acknowledged");
    let synced = labelled(r, "mirrorq_queue_synchronised_replicas", "Synchronised voters, master included: replicas with every confirmed message that count in the queue's majority");
    let term = labelled(r, "rabbitmq_raft_term", "Current Raft term of the replica here");
    let commit = labelled(r, "rabbitmq_raft_log_commit_index", "Raft commit index of the replica here");
    let leader = labelled(r, "mirrorq_raft_leader_node", "Node id of the group's leader as known here (0: none)");
    // Replicas of one queue that show different epochs are a split not
    // healed yet: one of them is a minority's fork.
    let epoch_term =
        labelled(r, "mirrorq_queue_epoch_term", "Term of the epoch (group incarnation) of the replica here");
    let epoch_node =
        labelled(r, "mirrorq_queue_epoch_node", "Node that formed the epoch of the replica here (0: as founded)");
    for g in node.local_raft_metrics() {
        let labels = queue_labels(&g.queue);
        term.get_or_create(&labels).set(g.term as i64);
        commit.get_or_create(&labels).set(g.committed.unwrap_or(0) as i64);
        leader.get_or_create(&labels).set(g.leader.unwrap_or(0) as i64);
        epoch_term.get_or_create(&labels).set(g.epoch.term as i64);
        epoch_node.get_or_create(&labels).set(g.epoch.node as i64);
        if g.leader == Some(node.id()) && !g.queue.is_empty() {
            if let Ok(info) = node.queue_info(&g.queue) {
                ready.get_or_create(&labels).set(info.ready as i64);
                unacked.get_or_create(&labels).set(info.unacked as i64);
                synced.get_or_create(&labels).set(info.synchronised.len() as i64);
            }
        }
    }
}

/// Gauges of the node as a whole: quiet groups, tasks, memory, disk, alarms.
fn node_gauges(r: &mut Registry, node: &Node) {
    gauge(
        r,
        "mirrorq_queue_groups_quiet",
        "Queue groups mastered here that are idle and send no Raft heartbeats",
        node.quiet_groups() as u64,
    );

    // Each queue replica runs several tasks: how many are alive tells what
    // an idle group costs beyond its bytes.
    gauge(
        r,
        "mirrorq_runtime_tasks",
        "Tasks alive in this node's runtime",
        tokio::runtime::Handle::current().metrics().num_alive_tasks() as u64,
    );

    let readings = node.alarms().readings();
    gauge(r, "rabbitmq_process_resident_memory_bytes", "Resident memory of this node", readings.mem_used);
    gauge(r, "rabbitmq_resident_memory_limit_bytes", "Memory high watermark", readings.mem_limit);
    gauge(r, "rabbitmq_disk_space_available_bytes", "Free disk on the data dir's file system", readings.disk_free);
    gauge(
        r,
        "rabbitmq_disk_space_available_limit_bytes",
        "Free disk below which publishers are blocked",
        readings.disk_free_limit,
    );
    gauge(r, "rabbitmq_alarms_memory_used_watermark", "1 while the memory alarm is on", readings.mem_alarm as u64);
    gauge(
        r,
        "rabbitmq_alarms_free_disk_space_watermark",
        "1 while the disk alarm is on",
        readings.disk_free_alarm as u64,
    );
}
