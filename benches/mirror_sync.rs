//! How long a new mirror takes to synchronise a deep queue while publishing
//! goes on, and what the sync costs the publishers.
//!
//! `cargo bench --bench mirror_sync [-- MESSAGES [SECONDS]]` (default 100000 messages
//! of 1 KiB, 5 s per rate window). Two in-process nodes over loopback TCP:
//! the queue is filled on one replica, a `manual` policy adds a mirror on the
//! other (it joins empty), the publish rate is measured with that mirror in
//! place but not syncing ("before"), then `sync` starts and the rate is
//! measured until the mirror is synchronised ("during").

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mirrorq::metadata::{ApplyTo, Policy};
use mirrorq::{Message, Node, NodeConfig};

// Same allocator as the `mirrorq` binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const PUBLISHERS: usize = 8;

fn message(i: usize) -> Message {
    let mut body = format!("{i}:").into_bytes();
    body.resize(1024, b'x');
    Message { exchange: String::new(), routing_key: "sync-q".into(), properties: Vec::new(), body }
}

fn policy(def: &str) -> Policy {
    Policy { name: "s".into(), pattern: "^sync".into(), apply_to: ApplyTo::Queues, priority: 0, definition: def.into() }
}

/// Publishers with one 1 KiB message in flight each, until `stop`.
fn publishers(node: &Node, count: Arc<AtomicU64>, stop: Arc<AtomicBool>) -> Vec<tokio::task::JoinHandle<()>> {
    (0..PUBLISHERS)
        .map(|p| {
            let (node, count, stop) = (node.clone(), count.clone(), stop.clone());
            tokio::spawn(async move {
                let mut i = 0;
                while !stop.load(Ordering::Acquire) {
                    if node.publish("sync-q", vec![message(p * 1_000_000_000 + i)]).await.is_ok() {
                        count.fetch_add(1, Ordering::Relaxed);
                    }
                    i += 1;
                }
            })
        })
        .collect()
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let args: Vec<u64> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let total = args.first().copied().unwrap_or(100_000) as usize;
    let window = Duration::from_secs(args.get(1).copied().unwrap_or(5));
    let root = tempfile::tempdir().unwrap();
    let listeners: Vec<std::net::TcpListener> =
        (0..2).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let members: BTreeMap<u64, String> =
        (1..=2).zip(&listeners).map(|(id, l)| (id, l.local_addr().unwrap().to_string())).collect();
    let mut nodes = Vec::new();
    for (id, l) in (1..=2).zip(listeners) {
        let mut cfg = NodeConfig::new(id, root.path().join(format!("n{id}")), members[&id].clone());
        cfg.cluster = members.clone();
        nodes.push(Node::start_with_listener(cfg, l).await.unwrap());
    }
    while nodes.iter().any(|n| n.metadata().nodes.len() < 2) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let n1 = nodes[0].clone();
    n1.set_policy(policy(r#"{"ha-mode":"exactly","ha-params":1,"ha-sync-mode":"manual"}"#)).await.unwrap();
    let q = n1.declare_queue("sync-q", vec![]).await.unwrap();
    let master = nodes[(q.replicas[0] - 1) as usize].clone();
    let mirror_id = 3 - q.replicas[0];

    let t = Instant::now();
    for start in (0..total).step_by(500) {
        master.publish("sync-q", (start..(start + 500).min(total)).map(message).collect()).await.unwrap();
    }
    println!("filled {total} x 1 KiB in {:.1} s", t.elapsed().as_secs_f64());

    n1.set_policy(policy(r#"{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"manual"}"#)).await.unwrap();
    loop {
        let v = master.master_view("sync-q").await.unwrap();
        if v.catching_up.iter().any(|(id, _)| *id == mirror_id) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let count = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let tasks = publishers(&master, count.clone(), stop.clone());
    tokio::time::sleep(Duration::from_secs(1)).await;
    let c0 = count.load(Ordering::Relaxed);
    tokio::time::sleep(window).await;
    let before = (count.load(Ordering::Relaxed) - c0) as f64 / window.as_secs_f64();

    let c1 = count.load(Ordering::Relaxed);
    let t = Instant::now();
    master.sync_queue("sync-q", true).await.unwrap();
    let mut synced_msgs = 0;
    loop {
        let v = master.master_view("sync-q").await.unwrap();
        if let Some((_, p)) = v.catching_up.iter().find(|(id, _)| *id == mirror_id) {
            synced_msgs = p.msgs_total;
        } else if v.synchronised.contains(&mirror_id) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = t.elapsed();
    let during = (count.load(Ordering::Relaxed) - c1) as f64 / took.as_secs_f64();
    stop.store(true, Ordering::Release);
    for t in tasks {
        let _ = t.await;
    }
    println!("| messages synchronised | sync time | publish msg/s before (mirror joined, not syncing) | publish msg/s during sync |");
    println!("|---|---|---|---|");
    println!("| {synced_msgs} x 1 KiB | {:.2} s | {before:.0} | {during:.0} |", took.as_secs_f64());
    for n in nodes {
        n.shutdown().await;
    }
}
