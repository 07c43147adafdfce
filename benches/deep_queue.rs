//! A deep queue on a real `mirrorq serve` process: RSS with N x 1 KiB
//! messages queued, disk use, and the time from restart (after `kill -9`) to
//! serving the queue again.
//!
//! `cargo bench --bench deep_queue [-- N]` (default N = 1,000,000).

use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use mirrorq::wire::client::NodeClient;
use mirrorq::{Message, QueueCmd, QueueReply};

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn spawn(dir: &std::path::Path, raft: &str) -> Child {
    Command::new(env!("CARGO_BIN_EXE_mirrorq"))
        .args(["serve", "--node-id", "1", "--raft-listen", raft])
        .arg("--data-dir")
        .arg(dir)
        .args(["--amqp-listen", &format!("127.0.0.1:{}", free_port())])
        .args(["--http-listen", &format!("127.0.0.1:{}", free_port())])
        .env("MIRRORQ_LOG", std::env::var("MIRRORQ_LOG").unwrap_or_else(|_| "warn".into()))
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn mirrorq")
}

fn rss_mb(pid: u32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kb: f64 = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap();
    kb / 1024.0
}

fn du_mb(path: &std::path::Path) -> f64 {
    fn walk(p: &std::path::Path) -> u64 {
        let mut n = 0;
        for e in std::fs::read_dir(p).unwrap().flatten() {
            let m = e.metadata().unwrap();
            n += if m.is_dir() { walk(&e.path()) } else { m.len() };
        }
        n
    }
    walk(path) as f64 / (1 << 20) as f64
}

async fn status(c: &NodeClient) -> Option<u64> {
    match c.queue_op("deep", vec![QueueCmd::Status]).await.ok()?.pop()? {
        QueueReply::Status { ready, .. } => Some(ready),
        _ => None,
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let n: u64 = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(1_000_000);
    let root = tempfile::tempdir_in(".").unwrap();
    let dir = root.path().join("data");
    let raft = format!("127.0.0.1:{}", free_port());
    let mut child = spawn(&dir, &raft);
    let client = Arc::new(NodeClient::new(raft.clone()));
    let t = Instant::now();
    while client.declare_queue("deep", vec![1]).await.is_err() {
        assert!(t.elapsed() < Duration::from_secs(20), "node did not come up");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    const CHUNK: u64 = 200;
    let chunks = n.div_ceil(CHUNK);
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let t = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..8 {
        let (client, next) = (client.clone(), next.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if i >= chunks {
                    return;
                }
                let count = CHUNK.min(n - i * CHUNK);
                let msgs = (0..count)
                    .map(|_| Message {
                        exchange: String::new(),
                        routing_key: "deep".into(),
                        properties: Vec::new(),
                        body: vec![b'm'; 1024],
                    })
                    .collect();
                client.publish("deep", msgs).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let publish_secs = t.elapsed().as_secs_f64();
    assert_eq!(status(&client).await, Some(n));
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss_full = rss_mb(child.id());
    let disk = du_mb(&dir);

    child.kill().unwrap();
    child.wait().unwrap();
    let t = Instant::now();
    let mut child = spawn(&dir, &raft);
    let client = NodeClient::new(raft.clone());
    let ready = loop {
        if let Some(r) = status(&client).await {
            break r;
        }
        assert!(t.elapsed() < Duration::from_secs(120), "node did not serve after restart");
        tokio::time::sleep(Duration::from_millis(5)).await;
    };
    let restart = t.elapsed().as_secs_f64();
    assert_eq!(ready, n, "messages lost across kill -9");
    let t = Instant::now();
    let first = client.get("deep", 1, 1, true).await.unwrap();
    assert_eq!(first.len(), 1);
    let first_get_ms = t.elapsed().as_secs_f64() * 1000.0;
    let rss_restarted = rss_mb(child.id());
    child.kill().unwrap();
    child.wait().unwrap();

    println!("messages queued:            {n} x 1 KiB (confirmed, 8 publishers x 200 per publish)");
    println!(
        "publish rate:               {:.0} msg/s ({:.1} MB/s)",
        n as f64 / publish_secs,
        n as f64 / 1024.0 / publish_secs
    );
    println!("RSS with the queue full:    {rss_full:.0} MB");
    println!("data dir on disk:           {disk:.0} MB");
    println!("kill -9 -> serving again:   {restart:.2} s (status answered through Raft, {ready} ready)");
    println!("first get after restart:    {first_get_ms:.1} ms");
    println!("RSS after restart:          {rss_restarted:.0} MB");
}
