//! Real `mirrorq serve` processes on loopback, driven through the node link,
//! killed with SIGKILL and restarted on their data dirs.

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::process::{self, ProcNode};
use common::{init_tracing, msg};
use mirrorq::wire::client::{ClientError, NodeClient};
use mirrorq::NodeError;

async fn drain(client: &NodeClient, queue: &str) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let got = client.get(queue, 1, 500, true).await.unwrap();
        if got.is_empty() {
            return out;
        }
        out.extend(got.into_iter().map(|d| d.message.body));
    }
}

/// Publish with retries on "not confirmed" (the publisher's job, as with a
/// nack); returns once confirmed.
async fn publish_confirmed(client: &NodeClient, queue: &str, body: Vec<u8>) {
    for _ in 0..50 {
        match client.publish(queue, vec![msg(body.clone())]).await {
            Ok(()) => return,
            Err(ClientError::Node(NodeError::Unconfirmed(_) | NodeError::Unavailable(_))) => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(e) => panic!("publish failed: {e}"),
        }
    }
    panic!("publish never confirmed");
}

/// Three processes; one mirror is killed with SIGKILL while publishing goes
/// on, restarted on its data dir, recovers its log and catches up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_replica_recovers_and_catches_up() {
    init_tracing();
    let root = tempfile::tempdir().unwrap();
    let mut nodes = process::cluster(root.path(), 3, &["--sync-timeout", "1"]);
    for n in nodes.iter_mut() {
        n.start();
    }
    for n in nodes.iter_mut() {
        n.wait_listening().await;
    }
    let c1 = NodeClient::new(nodes[0].raft_addr.clone());
    tracing::info!("--- declare on node 1, publish 100 confirmed");
    process::declare_retrying(&c1, "pq", vec![1, 2, 3]).await;
    assert_eq!(c1.queue_info("pq").await.unwrap().replicas, vec![1, 2, 3]);
    for i in 0..100 {
        publish_confirmed(&c1, "pq", format!("m{i}").into_bytes()).await;
    }
    let master = c1.queue_info("pq").await.unwrap().leader.expect("node 1 knows the master");
    let victim = (1..=3).find(|id| *id != master).unwrap();
    tracing::info!(victim, "--- kill -9 a mirror; keep publishing");
    nodes[(victim - 1) as usize].kill9();
    let other = (1..=3).find(|id| *id != victim).unwrap();
    let c = NodeClient::new(nodes[(other - 1) as usize].raft_addr.clone());
    for i in 100..200 {
        publish_confirmed(&c, "pq", format!("m{i}").into_bytes()).await;
    }

    tracing::info!("--- restart it on its data dir");
    nodes[(victim - 1) as usize].start();
    nodes[(victim - 1) as usize].wait_listening().await;
    let cv = NodeClient::new(nodes[(victim - 1) as usize].raft_addr.clone());
    let mut info = None;
    for _ in 0..200 {
        if let Ok(i) = cv.queue_info("pq").await {
            if i.ready == 200 {
                info = Some(i);
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let info = info.expect("restarted replica caught up to 200 messages");
    assert!(info.local);
    assert!(info.leader.is_some());

    tracing::info!("--- every message is delivered once, read through the restarted node");
    let got = drain(&cv, "pq").await;
    let want: BTreeSet<Vec<u8>> = (0..200).map(|i| format!("m{i}").into_bytes()).collect();
    let got_set: BTreeSet<Vec<u8>> = got.iter().cloned().collect();
    assert!(want.is_subset(&got_set), "lost {} confirmed messages", want.difference(&got_set).count());
    for n in &nodes {
        n.assert_no_panic();
    }
}

/// A single node killed with SIGKILL while many publishes are in flight:
/// after restart, everything that was confirmed is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_node_kill9_keeps_every_confirmed_message() {
    init_tracing();
    let root = tempfile::tempdir().unwrap();
    let mut nodes = process::cluster(root.path(), 1, &[]);
    let node = &mut nodes[0];
    node.start();
    node.wait_listening().await;
    let client = Arc::new(NodeClient::new(node.raft_addr.clone()));
    process::declare_retrying(&client, "solo", vec![1]).await;

    tracing::info!("--- 8 publishers flat out; SIGKILL after 1.5 s");
    let confirmed = Arc::new(Mutex::new(BTreeSet::new()));
    let mut tasks = Vec::new();
    for p in 0..8 {
        let (client, confirmed) = (client.clone(), confirmed.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0.. {
                let body = format!("p{p}-{i}").into_bytes();
                match client.publish("solo", vec![msg(body.clone())]).await {
                    Ok(()) => {
                        confirmed.lock().unwrap().insert(body);
                    }
                    Err(_) => return,
                }
            }
        }));
    }
    // A duration, not an ordering: the kill lands at an arbitrary point of
    // the stream (the assert below checks enough was confirmed by then).
    tokio::time::sleep(Duration::from_millis(1500)).await;
    node.kill9();
    for t in tasks {
        t.await.unwrap();
    }
    let confirmed = confirmed.lock().unwrap().clone();
    assert!(confirmed.len() > 50, "too few publishes confirmed before the kill: {}", confirmed.len());

    tracing::info!(confirmed = confirmed.len(), "--- restart and drain");
    node.start();
    node.wait_listening().await;
    let client = NodeClient::new(node.raft_addr.clone());
    let mut got: BTreeSet<Vec<u8>> = BTreeSet::new();
    let mut ready = false;
    for _ in 0..100 {
        match client.get("solo", 1, 500, true).await {
            Ok(batch) => {
                got.extend(batch.into_iter().map(|d| d.message.body));
                ready = true;
                break;
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    assert!(ready, "restarted node never served the queue");
    got.extend(drain(&client, "solo").await);
    let missing = confirmed.difference(&got).count();
    assert_eq!(missing, 0, "{missing} of {} confirmed messages lost after kill -9", confirmed.len());
    node.assert_no_panic();
}

/// A second process on a data dir in use is refused with a clear message
/// and a non-zero exit, and the first keeps running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_process_on_same_data_dir_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = process::cluster(root.path(), 1, &[]);
    nodes[0].start();
    nodes[0].wait_listening().await;
    let addr = format!("127.0.0.1:{}", common::free_port());
    let mut second = ProcNode::new(1, root.path(), addr.clone(), format!("1={addr}"));
    second.data_dir = nodes[0].data_dir.clone();
    let out = second.command().output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("in use by another mirrorq process"), "stderr: {err}");
    // The first node still answers.
    let q = NodeClient::new(nodes[0].raft_addr.clone()).queue_info("nope").await;
    assert!(matches!(q, Err(ClientError::Node(NodeError::NoSuchQueue(_)))), "{q:?}");
}

/// `--worker-threads N` is the number of runtime threads the node runs its
/// tasks on (tokio names them `tokio-rt-worker`); 0 is a configuration error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_threads_set_the_runtime_threads() {
    let root = tempfile::tempdir().unwrap();
    let workers = |pid: u32| {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .filter(|t| {
                let comm = t.as_ref().map(|t| std::fs::read_to_string(t.path().join("comm")).unwrap_or_default());
                comm.is_ok_and(|c| c.trim() == "tokio-rt-worker")
            })
            .count()
    };
    // Three: neither tokio's default here (one per core) nor one.
    let mut nodes = process::cluster(root.path(), 1, &["--worker-threads", "3"]);
    nodes[0].start();
    nodes[0].wait_listening().await;
    assert_eq!(workers(nodes[0].pid()), 3);
    let mut bad = process::cluster(&root.path().join("bad"), 1, &["--worker-threads", "0"]).pop().unwrap();
    bad.data_dir = root.path().join("bad-data");
    let out = bad.command().output().unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--worker-threads must be between 1 and"), "stderr: {err}");
    nodes[0].assert_no_panic();
}

/// A corrupt data dir is refused with a clear message and a non-zero exit,
/// and left as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn corrupt_data_dir_is_refused() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = process::cluster(root.path(), 1, &[]);
    let node = &mut nodes[0];
    node.start();
    node.wait_listening().await;
    node.kill9();
    let conf = node.data_dir.join("sled").join("conf");
    std::fs::write(&conf, b"not a sled config").unwrap();
    let out = node.command().output().unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unreadable or corrupt"), "stderr: {err}");
    assert_eq!(std::fs::read(&conf).unwrap(), b"not a sled config");
}

/// SIGTERM stops a node cleanly with exit code 0, and its data is there
/// when it starts again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_zero_and_keeps_data() {
    let root = tempfile::tempdir().unwrap();
    let mut nodes = process::cluster(root.path(), 1, &[]);
    let node = &mut nodes[0];
    node.start();
    node.wait_listening().await;
    let client = NodeClient::new(node.raft_addr.clone());
    process::declare_retrying(&client, "kept", vec![1]).await;
    publish_confirmed(&client, "kept", b"still here".to_vec()).await;
    assert_eq!(node.terminate(), Some(0));
    node.start();
    node.wait_listening().await;
    let client = NodeClient::new(node.raft_addr.clone());
    let mut got = Vec::new();
    for _ in 0..100 {
        if let Ok(g) = client.get("kept", 1, 10, true).await {
            got = g;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(got.iter().map(|d| d.message.body.clone()).collect::<Vec<_>>(), vec![b"still here".to_vec()]);
}

/// SIGTERM tells the node's AMQP clients why they are cut off, first thing,
/// as RabbitMQ does: `connection.close` 320 CONNECTION_FORCED with reason
/// 'shutdown', before masterships move (no client is answered by a node on
/// its way out), and then the node exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_closes_amqp_connections_with_connection_forced() {
    use lapin::options::QueueDeclareOptions;
    use lapin::types::FieldTable;
    let root = tempfile::tempdir().unwrap();
    let mut nodes = process::cluster(root.path(), 1, &[]);
    let mut node = nodes.remove(0);
    node.start();
    node.wait_serving().await;
    let uri = format!("amqp://guest:guest@127.0.0.1:{}/%2f", node.amqp_port.unwrap());
    let conn = lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()).await.unwrap();
    let seen: Arc<Mutex<Option<String>>> = Arc::default();
    let slot = seen.clone();
    let mut events = Box::pin(conn.events_listener());
    tokio::spawn(async move {
        use futures::StreamExt;
        while let Some(ev) = events.next().await {
            if let lapin::Event::Error(e) = ev {
                slot.lock().unwrap().get_or_insert(e.to_string());
            }
        }
    });
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(
        "before-stop".into(),
        QueueDeclareOptions { durable: true, ..Default::default() },
        FieldTable::default(),
    )
    .await
    .unwrap();
    let code = tokio::task::spawn_blocking(move || node.terminate()).await.unwrap();
    assert_eq!(code, Some(0));
    common::wait_until(Duration::from_secs(10), "the client saw its connection end", || seen.lock().unwrap().is_some())
        .await;
    let why = seen.lock().unwrap().clone().unwrap();
    assert!(why.contains("CONNECTION_FORCED") && why.contains("shutdown"), "{why}");
    assert!(!conn.status().connected());
}
