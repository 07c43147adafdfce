//! Stock Python clients against a real `mirrorq serve` process. `test.sh`
//! installs them (`pip install pika celery`); a missing client fails the test.

mod common;

use common::process;

/// pika (BlockingConnection): confirms, properties, get, consume with
/// prefetch and acks, requeue, mandatory returns, fanout, 404 on a channel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pika_works_unchanged() {
    let root = tempfile::tempdir().unwrap();
    let node = process::single(root.path()).await;
    let amqp_port = node.amqp_port.unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/pika_smoke.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .env("AMQP_PORT", amqp_port.to_string())
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "pika script failed:\n{stdout}\n{stderr}\nnode log:\n{}", node.log_text());
    assert!(stdout.contains("pika ok"));
    node.assert_no_panic();
}

/// Celery (kombu over py-amqp) with a stock worker: it declares its
/// exchanges and queues, consumes, and runs every task a client sends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn celery_works_unchanged() {
    let root = tempfile::tempdir().unwrap();
    let node = process::single(root.path()).await;
    let amqp_port = node.amqp_port.unwrap();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/celery_smoke.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .env("BROKER", format!("amqp://guest:guest@127.0.0.1:{amqp_port}//"))
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "celery script failed:\n{stdout}\n{stderr}\nnode log:\n{}", node.log_text());
    assert!(stdout.contains("celery ok"));
    node.assert_no_panic();
}
