//! `mirrorq ctl` against a real node: each command, tables and `--json`,
//! clear messages and exit 1 on errors.

mod common;

use std::process::Output;

use common::process;
use mirrorq::wire::client::NodeClient;

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
        assert!(queues.lines().next().unwrap().starts_with("vhost  name"), "{queues}");
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

        // Users, vhosts, permissions, and -p for the vhost.
        assert!(ok(&ctl(port, &["add-vhost", "dev"])).contains("vhost dev added"));
        assert!(ok(&ctl(port, &["list-vhosts"])).lines().any(|l| l.trim() == "dev"));
        assert!(ok(&ctl(port, &["add-user", "ops", "ops-pw", "--tags", "management,policymaker"])).contains("added"));
        let users = ok(&ctl(port, &["list-users"]));
        assert!(users.lines().any(|l| l.starts_with("ops") && l.contains("management,policymaker")), "{users}");
        fails(&ctl(port, &["-p", "dev", "set-permissions", "ops", "(", ".*", ".*"]), "configure");
        fails(&ctl(port, &["-p", "nope", "set-permissions", "ops", ".*", ".*", ".*"]), "not_found");
        assert!(ok(&ctl(port, &["-p", "dev", "set-permissions", "ops", ".*", ".*", ".*"])).contains("set"));
        let perms = ok(&ctl(port, &["-p", "dev", "list-permissions"]));
        assert!(perms.lines().any(|l| l.starts_with("ops")), "{perms}");
        let as_ops = |args: &[&str]| ctl(port, &[&["--user", "ops", "--password", "ops-pw"], args].concat());
        assert!(ok(&as_ops(&["-p", "dev", "set-policy", "dev-ha", ".*", r#"{"ha-mode":"all"}"#])).contains("set"));
        let pols = ok(&ctl(port, &["list-policies"]));
        assert!(pols.lines().any(|l| l.starts_with("dev") && l.contains("dev-ha")), "{pols}");
        fails(&as_ops(&["set-policy", "in-root", ".*", r#"{"ha-mode":"all"}"#]), "401");
        fails(&as_ops(&["list-users"]), "administrator");
        assert!(ok(&ctl(port, &["-p", "dev", "clear-permissions", "ops"])).contains("cleared"));
        fails(&ctl(port, &["-p", "dev", "clear-permissions", "ops"]), "404");
        assert!(ok(&ctl(port, &["delete-vhost", "dev"])).contains("deleted"));
        fails(&ctl(port, &["delete-vhost", "dev"]), "404");
        assert!(!ok(&ctl(port, &["list-policies"])).contains("dev-ha"), "gone with its vhost");
        assert!(ok(&ctl(port, &["delete-user", "ops"])).contains("deleted"));
        fails(&as_ops(&["list-queues"]), "401");
        fails(&ctl(1, &["list-queues"]), "cannot reach");
        true
    })
    .await
    .unwrap();
    assert!(out);
    node.assert_no_panic();
}
