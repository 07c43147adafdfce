//! A data dir damaged by a power cut or a failing disk: the node sets it
//! aside whole and comes back empty, refilled by its peers like a new
//! mirror, rather than refusing to start until a person steps in. Until
//! its leaders have filled it, it grants no vote (it lost its votes and
//! logs with the dir). A node with no peer to refill it refuses instead of
//! starting as if it had never held anything, and a dir that is only in a
//! format this build does not read is never set aside.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{fast_timing, init_tracing, publish_retrying, wait_until, Cluster};
use mirrorq::{Node, NodeConfig};

/// A flipped bit in an acknowledged record of a sealed log segment, as a
/// failing disk leaves one.
fn rot_the_log(dir: &Path) {
    let seg = dir.join("wal").join(format!("{:016x}.wal", 1));
    let mut bytes = std::fs::read(&seg).unwrap();
    bytes[40] ^= 0x04;
    std::fs::write(&seg, bytes).unwrap();
}

/// What sled 0.34 can do with a damaged file: open it as empty, without
/// an error (seen with 4 KiB zeroed in its `db` file).
fn empty_the_sled(dir: &Path) {
    let db = mirrorq_storage::NodeDb::open(dir, &mirrorq_storage::DbOptions::default()).unwrap();
    for tree in [db.node_tree(), db.raft_meta_tree(), db.sm_tree()] {
        tree.clear().unwrap();
    }
    db.flusher().sync_blocking().unwrap();
}

fn set_aside_dirs(dir: &Path) -> Vec<PathBuf> {
    let name = dir.file_name().unwrap().to_string_lossy().into_owned();
    std::fs::read_dir(dir.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with(&format!("{name}.damaged-")))
        .collect()
}

/// A cluster whose queue `q` holds five messages on every replica, with
/// node 1's first log segment sealed (node 1 restarted once).
async fn cluster_with_a_queue() -> Cluster {
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
    c.restart(1).await;
    c
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_data_dir_is_damaged_is_refilled_by_its_peers() {
    init_tracing();
    let mut c = cluster_with_a_queue().await;
    // Quiet, the master sends nothing by itself: it must learn that node 1
    // came back empty, since its counts say node 1 holds everything.
    wait_until(Duration::from_secs(10), "q's master has its heartbeats off", || {
        (1..=3).any(|id| c.node(id).is_quiet_here("q"))
    })
    .await;
    c.crash(1).await;
    let dir = c.dirs[0].path().to_path_buf();
    rot_the_log(&dir);
    c.restart(1).await;
    let aside = set_aside_dirs(&dir);
    assert_eq!(aside.len(), 1, "the damaged dir is kept, set aside: {aside:?}");
    assert!(aside[0].join("wal").exists(), "the damaged dir was not kept whole");
    wait_until(Duration::from_secs(30), "node 1 refilled: the cluster's metadata and the queue", || {
        c.node(1).metadata().nodes.len() == 3 && c.node(1).queue_info("q").is_ok_and(|i| i.ready == 5)
    })
    .await;
    wait_until(Duration::from_secs(30), "node 1 done refilling", || !c.node(1).is_refilling()).await;
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

/// A sled that comes back empty beside a log that holds groups has lost
/// the votes and state that go with the log: the dir is damaged, set aside
/// and refilled, never taken for a new node's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_sled_came_back_empty_beside_its_log_is_refilled() {
    init_tracing();
    let mut c = cluster_with_a_queue().await;
    c.crash(1).await;
    let dir = c.dirs[0].path().to_path_buf();
    empty_the_sled(&dir);
    c.restart(1).await;
    let aside = set_aside_dirs(&dir);
    assert_eq!(aside.len(), 1, "the dir with the emptied sled is set aside: {aside:?}");
    wait_until(Duration::from_secs(30), "node 1 refilled: the cluster's metadata and the queue", || {
        c.node(1).metadata().nodes.len() == 3 && c.node(1).queue_info("q").is_ok_and(|i| i.ready == 5)
    })
    .await;
    c.shutdown().await;
    for a in aside {
        std::fs::remove_dir_all(a).unwrap();
    }
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &to.join(e.file_name()));
        } else {
            std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
        }
    }
}

/// A sled that comes back with only part of what it had synced (here: as
/// an earlier stop left it, which is what its recovery makes of a file
/// truncated past that point) opens without an error and still knows the
/// node; the log's note of what sled had synced tells it apart: the dir is
/// set aside and refilled, never run on votes and state it forgot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_sled_lost_part_of_what_it_synced_is_refilled() {
    init_tracing();
    let mut c = cluster_with_a_queue().await;
    c.crash(1).await;
    let dir = c.dirs[0].path().to_path_buf();
    let earlier = tempfile::tempdir().unwrap();
    copy_dir(&dir.join("sled"), earlier.path());
    c.restart(1).await;
    for i in 5..10 {
        publish_retrying(c.node(2), "q", format!("m{i}").into_bytes()).await;
    }
    wait_until(Duration::from_secs(10), "node 1 holds every message", || {
        c.node(1).queue_info("q").is_ok_and(|i| i.ready == 10)
    })
    .await;
    c.crash(1).await;
    std::fs::remove_dir_all(dir.join("sled")).unwrap();
    copy_dir(earlier.path(), &dir.join("sled"));
    c.restart(1).await;
    let aside = set_aside_dirs(&dir);
    assert_eq!(aside.len(), 1, "the dir whose sled went back is set aside: {aside:?}");
    wait_until(Duration::from_secs(30), "node 1 refilled: the cluster's metadata and the queue", || {
        c.node(1).metadata().nodes.len() == 3 && c.node(1).queue_info("q").is_ok_and(|i| i.ready == 10)
    })
    .await;
    c.shutdown().await;
    for a in aside {
        std::fs::remove_dir_all(a).unwrap();
    }
}

/// Every node loses power; node 1's dir is found damaged. Nodes 1 and 2
/// come back first: node 1, empty, must not make node 2 a leader (node 2
/// might lack what node 3 and the damaged dir had committed); once node 3
/// is back, the cluster goes on and node 1 is filled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refilled_node_grants_no_vote_until_it_is_filled() {
    init_tracing();
    let mut c = cluster_with_a_queue().await;
    for id in 1..=3 {
        c.crash(id).await;
    }
    let dir = c.dirs[0].path().to_path_buf();
    rot_the_log(&dir);
    c.restart(1).await;
    c.restart(2).await;
    assert!(c.node(1).is_refilling());
    // Several election timeouts: node 2 stands again and again.
    tokio::time::sleep(Duration::from_secs(3)).await;
    for id in [1, 2] {
        let state = c.node(id).metadata_raft().metrics().borrow().state;
        assert_ne!(state, openraft::ServerState::Leader, "node {id} leads with the empty node's vote");
    }
    c.restart(3).await;
    wait_until(Duration::from_secs(30), "node 1 refilled", || {
        !c.node(1).is_refilling() && c.node(1).queue_info("q").is_ok_and(|i| i.ready == 5)
    })
    .await;
    c.shutdown().await;
    for a in set_aside_dirs(&dir) {
        std::fs::remove_dir_all(a).unwrap();
    }
}

async fn a_lone_node_with(damage: impl FnOnce(&Path)) -> String {
    let dir = tempfile::tempdir().unwrap();
    let listen = format!("127.0.0.1:{}", common::free_port());
    let cfg = NodeConfig::new(1, dir.path(), listen);
    let node = Node::start(cfg.clone()).await.expect("starts");
    node.shutdown().await;
    drop(node);
    damage(dir.path());
    let err = match Node::start(cfg).await {
        Ok(_) => panic!("a node started on a damaged data dir"),
        Err(e) => e.to_string(),
    };
    assert!(set_aside_dirs(dir.path()).is_empty(), "a data dir was set aside: {err}");
    err
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_node_with_a_damaged_data_dir_refuses_to_start() {
    init_tracing();
    let err = a_lone_node_with(rot_the_log).await;
    assert!(err.contains("damaged"), "unclear refusal: {err}");
}

/// A sled config this build does not read is a format, not damage (an
/// upgrade or downgrade across every node must never set every dir aside).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_dir_in_a_format_it_does_not_read_is_refused_not_set_aside() {
    init_tracing();
    let err = a_member_refused_after(|dir| std::fs::write(dir.join("sled").join("conf"), [0xff_u8; 64]).unwrap()).await;
    assert!(err.contains("corrupt"), "unclear refusal: {err}");
}

/// A data dir of another format (here: one an earlier build wrote, which
/// has no format mark) is refused with a clear error and left as it is:
/// read as this build's format, its entries could decode as other
/// commands, and setting it aside would throw away what it holds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_dir_of_an_earlier_format_is_refused_not_read_nor_set_aside() {
    init_tracing();
    let err = a_member_refused_after(|dir| {
        let db = mirrorq_storage::NodeDb::open(dir, &Default::default()).unwrap();
        db.remove_node_value("format").unwrap();
    })
    .await;
    assert!(err.contains("format 1 (unmarked)") && err.contains("reads format 4"), "unclear refusal: {err}");
}

/// Node 1 of a cluster, crashed, its dir changed by `change`, started
/// again: the refusal it must give, once it is checked that the dir was
/// not set aside.
async fn a_member_refused_after(change: impl FnOnce(&Path)) -> String {
    let mut c = cluster_with_a_queue().await;
    c.crash(1).await;
    let dir = c.dirs[0].path().to_path_buf();
    change(&dir);
    let err = match Node::start(c.configs[0].clone()).await {
        Ok(_) => panic!("a node started on a dir it must refuse"),
        Err(e) => e.to_string(),
    };
    assert!(set_aside_dirs(&dir).is_empty(), "a refused dir was set aside: {err}");
    c.shutdown().await;
    err
}
