//! `mirrorq ctl` against a real node: each command, tables and `--json`,
//! clear messages and exit 1 on errors.

mod common;

use std::process::Output;

use common::process;
use mirrorq::client::NodeClient;

fn ctl(port: u16, args: &[&str]) -> Output {
    std::process::Command::new(process::binary())
        .arg("ctl")
        .arg("--url")
        .arg(format!("http://127.0.0.1:{port}"))
        .args(args)
        .output()
        .unwrap()
}

fn ok(o: &Output) -> String {
    assert!(
        o.status.success(),
        "ctl failed: {}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn fails(o: &Output, has: &str) {
    assert_eq!(o.status.code(), Some(1), "{o:?}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(has), "stderr {err:?} lacks {has:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ctl_commands() {
    let root = tempfile::tempdir().unwrap();
    let node = process::single(root.path()).await;
    let port = node.http_port.unwrap();
    process::declare_retrying(&NodeClient::new(node.raft_addr.clone()), "ha.one", vec![]).await;

    let out = tokio::task::spawn_blocking(move || {
        let status = ok(&ctl(port, &["cluster-status"]));
        assert!(status.contains("mirrorq@1") && status.contains("true"), "{status}");

        assert!(ok(&ctl(
            port,
            &["set-policy", "ha", "^ha\\.", r#"{"ha-mode":"all"}"#, "--priority", "2", "--apply-to", "queues"]
        ))
        .contains("policy ha set"));
        let policies = ok(&ctl(port, &["list-policies"]));
        assert!(policies.contains("ha") && policies.contains("^ha\\.") && policies.contains("queues"), "{policies}");
        let json: serde_json::Value = serde_json::from_str(&ok(&ctl(port, &["--json", "list-policies"]))).unwrap();
        assert_eq!(json[0]["priority"], 2);

        let queues = ok(&ctl(port, &["list-queues"]));
        assert!(queues.lines().next().unwrap().starts_with("name"), "{queues}");
        assert!(queues.contains("ha.one") && queues.contains("mirrorq@1"), "{queues}");

        fails(&ctl(port, &["set-policy", "p", "x", "{not json"]), "not JSON");
        fails(&ctl(port, &["set-policy", "p", "x", r#"{"ha-mode":"most"}"#]), "ha-mode");
        fails(&ctl(port, &["set-policy", "p", "(", r#"{"ha-mode":"all"}"#]), "regex");
        assert!(ok(&ctl(port, &["clear-policy", "ha"])).contains("cleared"));
        fails(&ctl(port, &["clear-policy", "ha"]), "404");
        assert!(ok(&ctl(port, &["sync-queue", "ha.one"])).contains("sync of ha.one started"));
        assert!(ok(&ctl(port, &["cancel-sync-queue", "ha.one"])).contains("sync of ha.one cancelled"));
        fails(&ctl(port, &["sync-queue", "no.such.queue"]), "404");
        assert!(ok(&ctl(port, &["rebalance"])).contains("rebalanced: 0 of 0"));
        fails(&ctl(port, &["forget-node", "mirrorq@9"]), "404");
        fails(&ctl(port, &["forget-node", "mirrorq@1"]), "itself");
        let file = std::env::temp_dir().join(format!("mirrorq-defs-{}.json", std::process::id()));
        let f = file.to_str().unwrap();
        assert!(ok(&ctl(port, &["export-definitions", f])).contains("written"));
        let exported: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
        assert_eq!(exported["queues"][0]["name"], "ha.one");
        std::fs::write(&file, r#"{"queues":[{"name":"imported","vhost":"/"}]}"#).unwrap();
        assert!(ok(&ctl(port, &["import-definitions", f])).contains("imported"));
        assert!(ok(&ctl(port, &["list-queues"])).contains("imported"));
        std::fs::write(&file, "not json").unwrap();
        fails(&ctl(port, &["import-definitions", f]), "not JSON");
        let _ = std::fs::remove_file(&file);
        fails(&ctl(port, &["--password", "wrong", "list-queues"]), "401");
        fails(&ctl(1, &["list-queues"]), "cannot reach");
        true
    })
    .await
    .unwrap();
    assert!(out);
    node.assert_no_panic();
}
