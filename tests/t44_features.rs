//! RabbitMQ's queue and exchange features that client libraries and
//! frameworks use, driven by stock pika against three `mirrorq serve`
//! processes (`tests/clients/features.py`), each kept across the SIGKILL of
//! the node that masters the queues: priority queues, exchange-to-exchange
//! bindings, alternate exchanges, single active consumer, consumer
//! priorities, x-expires, x-queue-mode / x-queue-version,
//! connection.update-secret and at-least-once dead-lettering.

mod common;

use std::time::{Duration, Instant};

use common::process;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_and_exchange_features_through_pika_survive_a_killed_master() {
    let root = tempfile::tempdir().unwrap();
    let nodes = process::serving(root.path(), 3, &["--sync-timeout", "2", "--failure-timeout", "2"]).await;
    let join = |f: &dyn Fn(&process::ProcNode) -> String| nodes.iter().map(f).collect::<Vec<_>>().join(",");
    let (amqp, http, pids) = (
        join(&|n| n.amqp_port.unwrap().to_string()),
        join(&|n| n.http_port.unwrap().to_string()),
        join(&|n| n.pid().to_string()),
    );
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/features.py");
    let started = Instant::now();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("python3")
            .arg(script)
            .env("AMQP_PORTS", amqp)
            .env("HTTP_PORTS", http)
            .env("PIDS", pids)
            .output()
    })
    .await
    .unwrap()
    .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let logs: String = nodes.iter().map(|n| format!("--- node {}\n{}", n.id, n.log_text())).collect();
    assert!(out.status.success(), "features script failed:\n{stdout}\n{stderr}\nnode logs:\n{logs}");
    assert_eq!(stdout.lines().last(), Some("features ok"), "{stdout}");
    assert!(started.elapsed() < Duration::from_secs(300));
    for n in &nodes[1..] {
        n.assert_no_panic();
    }
}
