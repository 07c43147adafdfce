//! A data dir damaged by a power cut or a failing disk: the node sets it
//! aside whole and comes back empty, refilled by its peers like a new
//! mirror, rather than refusing to start until a person steps in; a node
//! with no peer to refill it refuses instead of starting as if it had
//! never held anything.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{fast_timing, init_tracing, publish_retrying, wait_until, Cluster};
use mirrorq::{Node, NodeConfig};

/// A sled config file that cannot be read, as a cut between sled's two
/// writes of it leaves one.
fn damage(dir: &Path) {
    std::fs::write(dir.join("sled").join("conf"), [0xff_u8; 64]).unwrap();
}

fn set_aside_dirs(dir: &Path) -> Vec<PathBuf> {
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    std::fs::read_dir(dir.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(&format!("{name}.damaged-")))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_data_dir_is_damaged_is_refilled_by_its_peers() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(60))).await;
    c.node(2).declare_queue("q", vec![2, 3, 1]).await.unwrap();
    for i in 0..5 {
        publish_retrying(c.node(2), "q", format!("m{i}").into_bytes()).await;
    }
    wait_until(Duration::from_secs(10), "node 1 holds every message", || {
        c.node(1).queue_info("q").is_ok_and(|i| i.ready == 5)
    })
    .await;

    c.crash(1).await;
    let dir = c.dirs[0].path().to_path_buf();
    damage(&dir);
    c.restart(1).await;
    let aside = set_aside_dirs(&dir);
    assert_eq!(aside.len(), 1, "the damaged dir is kept, set aside: {aside:?}");
    assert!(aside[0].join("sled").join("conf").exists(), "the damaged dir was not kept whole");
    wait_until(Duration::from_secs(30), "node 1 refilled: the cluster's metadata and the queue", || {
        c.node(1).metadata().nodes.len() == 3 && c.node(1).queue_info("q").is_ok_and(|i| i.ready == 5)
    })
    .await;
    // Refilled, it serves: a publish through it reaches every replica.
    publish_retrying(c.node(1), "q", b"after".to_vec()).await;
    wait_until(Duration::from_secs(10), "every replica holds the new message", || {
        (1..=3).all(|id| c.node(id).queue_info("q").is_ok_and(|i| i.ready == 6))
    })
    .await;
    c.shutdown().await;
    for a in aside {
        std::fs::remove_dir_all(a).unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_node_with_a_damaged_data_dir_refuses_to_start() {
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", common::free_port());
    let cfg = NodeConfig::new(1, dir.path(), listen);
    let node = Node::start(cfg.clone()).await.expect("starts");
    node.shutdown().await;
    drop(node);
    damage(dir.path());
    let err = match Node::start(cfg).await {
        Ok(_) => panic!("a lone node started on a damaged data dir"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("corrupt"), "unclear refusal: {err}");
    assert!(set_aside_dirs(dir.path()).is_empty(), "a lone node set its only copy aside");
    assert!(dir.path().join("sled").join("conf").exists());
}
