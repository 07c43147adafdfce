//! The test suites that client libraries' authors wrote against RabbitMQ,
//! run as they wrote them (`tests/client_suites/run.sh` fetches each,
//! pinned, from the registry that ships it): amqplib's, py-amqp's
//! integration tests and kombu's py-amqp transport tests. Against three
//! `mirrorq serve` processes with every queue mirrored on all three
//! (`ha-mode: all`), the clients on node 2, which masters about a third of
//! the queues they declare (masters of mirrored queues go to the node with
//! fewest): so most of what they do is forwarded to another node.

mod common;

use std::time::{Duration, Instant};

use common::process::{self, http};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_libraries_own_suites_pass_against_a_mirrored_cluster() {
    let root = tempfile::tempdir().unwrap();
    let nodes = process::serving(root.path(), 3, &[]).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let body = json!({"pattern": "^", "definition": {"ha-mode": "all", "ha-sync-mode": "automatic"},
                          "apply-to": "queues"});
        let (status, reply) = http(&nodes[0], "PUT", "/api/policies/%2F/ha-all", Some(body)).await;
        let (_, registered) = http(&nodes[0], "GET", "/api/nodes", None).await;
        if (status == 201 || status == 204) && registered.as_array().is_some_and(|a| a.len() == 3) {
            break;
        }
        assert!(Instant::now() < deadline, "policy not set: {status} {reply}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let port = nodes[1].amqp_port.unwrap().to_string();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/client_suites/run.sh");
    let mut failed = Vec::new();
    for suite in ["amqplib", "py-amqp", "kombu"] {
        let port = port.clone();
        let out = tokio::task::spawn_blocking(move || std::process::Command::new(script).arg(suite).arg(port).output())
            .await
            .unwrap()
            .expect("bash");
        if !out.status.success() {
            let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
            failed.push(format!("=== {suite}\n{stdout}\n{stderr}"));
        }
    }
    let logs: String = nodes.iter().map(|n| format!("--- node {}\n{}", n.id, n.log_text())).collect();
    assert!(failed.is_empty(), "{}\nnode logs:\n{logs}", failed.join("\n"));
    for n in &nodes {
        n.assert_no_panic();
    }
}
