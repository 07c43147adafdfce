//! Disk use follows the live messages: the log is compacted through
//! snapshots, and consumed messages leave the state machine.

mod common;

use std::time::Duration;

use common::{fast_timing, init_tracing, msg, wait_until, Cluster};

/// After thousands of entries published and consumed, the log has been
/// purged down to a bounded tail and no message body is left on disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_is_purged_and_consumed_messages_leave_the_disk() {
    init_tracing();
    let c = Cluster::start(1, fast_timing(Duration::from_secs(5))).await;
    let node = c.node(1).clone();
    node.declare_queue("compact", vec![1]).await.unwrap();
    tracing::info!("--- 1500 entries: publish one, consume one");
    for i in 0..750 {
        node.publish("compact", vec![msg(format!("m{i}"))]).await.unwrap();
        let got = node.get("compact", 1, 1, true).await.unwrap();
        assert_eq!(got.len(), 1);
    }
    let raft = node.queue_raft("compact").unwrap();
    wait_until(Duration::from_secs(10), "a snapshot purged the log", || raft.metrics().borrow().purged.is_some()).await;
    let kept = node.local_log_len("compact").await.unwrap();
    // Policy: snapshot every 1024 entries, keep 256 behind it.
    assert!(kept <= 1024 + 256, "log not compacted: {kept} entries kept");
    assert_eq!(node.queue_info("compact").unwrap().ready, 0);
    assert_eq!(node.local_stored_count("compact").unwrap(), 0, "consumed bodies still stored");
    c.shutdown().await;
}

/// A queue that stops being written to stops pinning the log's old
/// segments: every replica compacts its log (snapshot, then purge) instead
/// of the log copying its entries forward, and its messages survive that
/// and a crash of every node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_queue_log_is_compacted_and_its_messages_stay() {
    init_tracing();
    let mut c =
        Cluster::start_configured(3, fast_timing(Duration::from_secs(5)), |cfg| cfg.wal_segment_bytes = 256 << 10)
            .await;
    let node = c.node(1).clone();
    node.declare_queue("idle", vec![1, 2, 3]).await.unwrap();
    node.declare_queue("busy", vec![1, 2, 3]).await.unwrap();
    for i in 0..20 {
        node.publish("idle", vec![msg(format!("idle {i}"))]).await.unwrap();
    }
    tracing::info!("--- another queue writes on, segment after segment (256 KiB each)");
    let rafts: Vec<_> = (1..=3).map(|id| c.node(id).queue_raft("idle").unwrap()).collect();
    let compacted = |raft: &mirrorq::raft::types::Raft| {
        let m = raft.metrics().borrow().clone();
        m.purged.is_some() && m.purged.map(|p| p.index) == m.last_log_index
    };
    let body = vec![7u8; 1024];
    let mut written = 0usize;
    while !rafts.iter().all(compacted) {
        // Without compaction, 20 entries never reach a snapshot (1024).
        assert!(written < 40 << 20, "idle queue's log not compacted after {written} bytes written elsewhere");
        node.publish("busy", (0..10).map(|_| msg(body.clone())).collect()).await.unwrap();
        written += 10 * body.len();
    }
    for id in 1..=3 {
        assert_eq!(c.node(id).local_log_len("idle").await.unwrap(), 0, "node {id}");
    }
    tracing::info!("--- every node crashes and comes back");
    // Handles keep a node's storage open.
    drop((rafts, node));
    for id in 1..=3 {
        c.crash(id).await;
    }
    for id in 1..=3 {
        c.restart(id).await;
    }
    let node = c.node(1).clone();
    let mut got = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while got.len() < 20 {
        match node.get("idle", 1, 20, true).await {
            Ok(msgs) => got.extend(msgs.into_iter().map(|d| String::from_utf8(d.message.body).unwrap())),
            Err(e) => {
                assert!(std::time::Instant::now() < deadline, "idle queue never served again: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    let want: Vec<String> = (0..20).map(|i| format!("idle {i}")).collect();
    assert_eq!(got, want);
    assert_eq!(node.queue_info("idle").unwrap().ready, 0);
    c.shutdown().await;
}
