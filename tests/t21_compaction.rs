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
