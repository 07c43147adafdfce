//! How long a rebalance takes and what a publisher sees meanwhile.
//!
//! `cargo bench --bench rebalance [-- QUEUES]` (default 30). Three in-process
//! nodes over loopback TCP, `ha-mode: all` queues declared on node 1 (masters
//! spread by min-masters), node 3 crashed and restarted (its masterships move
//! to nodes 1 and 2), then one publisher per queue (one confirmed 1 KiB
//! message in flight each) runs while `rebalance` moves masters back. Prints
//! the rebalance time, the moves, and the longest wait for one confirm.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mirrorq::metadata::{ApplyTo, Policy};
use mirrorq::{Message, Node, NodeConfig};

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn config(root: &std::path::Path, id: u64, members: &BTreeMap<u64, String>) -> NodeConfig {
    let mut cfg = NodeConfig::new(id, root.join(format!("n{id}")), members[&id].clone());
    cfg.cluster = members.clone();
    cfg
}

async fn masters(nodes: &[Node], queues: &[String]) -> BTreeMap<u64, usize> {
    let mut count: BTreeMap<u64, usize> = (1..=3).map(|n| (n, 0)).collect();
    for q in queues {
        loop {
            if let Some(n) = nodes.iter().find(|n| n.is_master(q)) {
                *count.get_mut(&n.id()).unwrap() += 1;
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    count
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(30);
    let root = tempfile::tempdir().unwrap();
    let members: BTreeMap<u64, String> = (1..=3)
        .map(|id| (id, std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().to_string()))
        .collect();
    let mut nodes = Vec::new();
    for id in 1..=3 {
        nodes.push(Node::start(config(root.path(), id, &members)));
    }
    let mut nodes: Vec<Node> = futures::future::join_all(nodes).await.into_iter().map(|r| r.unwrap()).collect();
    while nodes.iter().any(|n| n.metadata().nodes.len() < 3) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let policy = Policy {
        name: "all".into(),
        pattern: "^rb".into(),
        apply_to: ApplyTo::Queues,
        priority: 0,
        definition: r#"{"ha-mode":"all","ha-sync-mode":"automatic"}"#.into(),
    };
    nodes[0].set_policy(policy).await.unwrap();
    let queues: Vec<String> = (0..n).map(|i| format!("rb-{i:03}")).collect();
    for q in &queues {
        nodes[0].declare_queue(q, vec![]).await.unwrap();
    }
    println!("placed: {:?}", masters(&nodes, &queues).await);

    let third = nodes.pop().unwrap();
    third.crash().await;
    drop(third);
    let mut up = nodes;
    let _ = masters(&up, &queues).await;
    let third = loop {
        match Node::start(config(root.path(), 3, &members)).await {
            Ok(node) => break node,
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    up.push(third);
    let nodes = up;
    // Wait until node 3 is a synchronised mirror everywhere.
    for q in &queues {
        while !nodes[0].master_view(q).await.is_ok_and(|v| v.synchronised.contains(&3)) {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    println!("after node 3 restarted: {:?}", masters(&nodes, &queues).await);

    let stop = Arc::new(AtomicBool::new(false));
    let worst = Arc::new(Mutex::new(Duration::ZERO));
    let publishers: Vec<_> = queues
        .iter()
        .enumerate()
        .map(|(i, q)| {
            let (node, q, stop, worst) = (nodes[i % 3].clone(), q.clone(), stop.clone(), worst.clone());
            tokio::spawn(async move {
                let body = vec![b'x'; 1024];
                while !stop.load(Ordering::Acquire) {
                    let t = Instant::now();
                    let m = Message {
                        exchange: String::new(),
                        routing_key: q.clone(),
                        properties: Vec::new(),
                        body: body.clone(),
                    };
                    let _ = node.publish(&q, vec![m]).await;
                    let took = t.elapsed();
                    let mut w = worst.lock().unwrap();
                    *w = (*w).max(took);
                }
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(2)).await;
    *worst.lock().unwrap() = Duration::ZERO;
    let t = Instant::now();
    let moves = nodes[1].rebalance().await.unwrap();
    let took = t.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, Ordering::Release);
    for p in publishers {
        let _ = p.await;
    }
    let failed = moves.iter().filter(|m| m.error.is_some()).count();
    println!("after rebalance: {:?}", masters(&nodes, &queues).await);
    println!("| queues | masters moved | failed | rebalance time | longest publish wait meanwhile |");
    println!("|---|---|---|---|---|");
    println!(
        "| {n} | {} | {failed} | {:.2} s | {} ms |",
        moves.len() - failed,
        took.as_secs_f64(),
        worst.lock().unwrap().as_millis()
    );
    for node in nodes {
        node.shutdown().await;
    }
}
