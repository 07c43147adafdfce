//! Confirmed publishes through the library API on an in-process three-node
//! cluster over loopback TCP, every replica fsync'd before the confirm.
//!
//! `cargo bench --bench cluster [-- SECONDS]` (default 10 per case).
//! Each case: one 3-replica queue, N publishers each with one publish in
//! flight (so N = messages in flight), message size S.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use mirrorq::{Message, Node, NodeConfig};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

async fn start_cluster(root: &std::path::Path) -> Vec<Node> {
    let members: BTreeMap<u64, String> = (1..=3).map(|id| (id, format!("127.0.0.1:{}", free_port()))).collect();
    let mut nodes = Vec::new();
    for id in 1..=3 {
        let mut cfg = NodeConfig::new(id, root.join(format!("n{id}")), members[&id].clone());
        cfg.cluster = members.clone();
        nodes.push(Node::start(cfg));
    }
    let nodes: Vec<Node> = futures::future::join_all(nodes).await.into_iter().map(|r| r.unwrap()).collect();
    while nodes.iter().any(|n| n.metadata().nodes.len() < 3) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    nodes
}

// Same allocator as the `mirrorq` binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let secs: u64 = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(10);
    let root = tempfile::tempdir_in(".").unwrap();
    let nodes = start_cluster(root.path()).await;
    println!("| size | in flight | confirmed msg/s | p50 ms | p99 ms | max ms |");
    println!("|---|---|---|---|---|---|");
    // CASES="100x1000,4096x1" picks cases; default: all four.
    let only = std::env::var("CASES").ok();
    let cases = [(100usize, 1usize), (100, 1000), (4096, 1), (4096, 1000)]
        .into_iter()
        .filter(|(s, f)| only.as_ref().is_none_or(|o| o.split(',').any(|c| c == format!("{s}x{f}"))));
    for (case, (size, inflight)) in cases.enumerate() {
        let queue = format!("bench-{case}");
        nodes[0].declare_queue(&queue, vec![1, 2, 3]).await.unwrap();
        let hist = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap()));
        let dur = Duration::from_secs(secs);
        let start = Instant::now();
        let mut tasks = Vec::new();
        for _ in 0..inflight {
            let (node, queue, hist) = (nodes[0].clone(), queue.clone(), hist.clone());
            tasks.push(tokio::spawn(async move {
                let mut local = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
                let m = Message {
                    exchange: String::new(),
                    routing_key: queue.clone(),
                    properties: Vec::new(),
                    body: vec![b'x'; size],
                };
                let mut n = 0u64;
                while start.elapsed() < dur {
                    let t = Instant::now();
                    node.publish(&queue, vec![m.clone()]).await.unwrap();
                    local.record(t.elapsed().as_micros().max(1) as u64).unwrap();
                    n += 1;
                }
                hist.lock().unwrap().add(local).unwrap();
                n
            }));
        }
        let mut total = 0;
        for t in tasks {
            total += t.await.unwrap();
        }
        let elapsed = start.elapsed().as_secs_f64();
        {
            let h = hist.lock().unwrap();
            println!(
                "| {size} B | {inflight} | {:.0} | {:.2} | {:.2} | {:.2} |",
                total as f64 / elapsed,
                h.value_at_quantile(0.50) as f64 / 1000.0,
                h.value_at_quantile(0.99) as f64 / 1000.0,
                h.max() as f64 / 1000.0
            );
        }
        nodes[0].purge(&queue).await.unwrap();
    }
    for n in nodes {
        n.shutdown().await;
    }
}
