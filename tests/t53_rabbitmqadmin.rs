//! Debian's `rabbitmqadmin` (RabbitMQ's own management CLI, unpacked from
//! the rabbitmq-server package by `test.sh`, path in
//! `MIRRORQ_RABBITMQADMIN`) against a three-node mirrorq cluster: every
//! subcommand it has that mirrorq's API serves, as its users type them;
//! and the requests a Terraform RabbitMQ provider makes.
//! A missing rabbitmqadmin fails the test.

mod common;

use common::process;

struct Admin {
    script: String,
    port: u16,
}

impl Admin {
    /// Run `rabbitmqadmin ARGS`; its output, or a panic with it on failure.
    fn run(&self, args: &[&str]) -> String {
        let out = std::process::Command::new("python3")
            .arg(&self.script)
            .args(["-H", "127.0.0.1", "-P", &self.port.to_string(), "-u", "guest", "-p", "guest"])
            .args(args)
            .output()
            .expect("python3");
        let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success(), "rabbitmqadmin {args:?} failed:\n{text}");
        text
    }

    /// `list WHAT COLUMNS` as one line per row, columns tab-separated.
    fn list(&self, what: &str, columns: &[&str]) -> Vec<String> {
        let mut args = vec!["-f", "tsv", "-q", "list", what];
        args.extend_from_slice(columns);
        self.run(&args).lines().map(str::to_string).collect()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmqadmin_works_unchanged() {
    let script = std::env::var("MIRRORQ_RABBITMQADMIN")
        .expect("MIRRORQ_RABBITMQADMIN: the path of Debian's rabbitmqadmin (test.sh unpacks it)");
    let root = tempfile::tempdir().unwrap();
    let nodes = process::serving(root.path(), 3, &[]).await;
    // Through node 2: any node answers for the whole cluster.
    let admin = Admin { script, port: nodes[1].http_port.unwrap() };
    let sorted = |mut v: Vec<String>| {
        v.sort();
        v
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while admin.list("nodes", &["name", "running"]).iter().filter(|l| l.ends_with("True")).count() < 3 {
        assert!(std::time::Instant::now() < deadline, "three nodes never ran: {:?}", admin.list("nodes", &["name"]));
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }

    // Declare, as its users type it: booleans come as the strings "true"/"false".
    admin.run(&[
        "declare",
        "policy",
        "name=ha-all",
        "pattern=^ha\\.",
        "definition={\"ha-mode\":\"all\"}",
        "apply-to=queues",
    ]);
    admin.run(&["declare", "queue", "name=ha.orders", "durable=true"]);
    admin.run(&["declare", "queue", "name=ha.audit", "auto_delete=false", "arguments={\"x-max-length\":100}"]);
    admin.run(&["declare", "exchange", "name=orders", "type=topic", "durable=true", "internal=false"]);
    admin.run(&["declare", "binding", "source=orders", "destination=ha.orders", "routing_key=order.*"]);
    admin.run(&["declare", "vhost", "name=tenant"]);
    admin.run(&["declare", "user", "name=alice", "password=s3cret", "tags=management"]);
    admin.run(&["declare", "permission", "vhost=tenant", "user=alice", "configure=.*", "write=.*", "read=.*"]);

    let queues = sorted(admin.list("queues", &["name", "policy"]));
    assert_eq!(queues, vec!["ha.audit\tha-all", "ha.orders\tha-all"]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let mirrors = admin.list("queues", &["name", "synchronised_slave_nodes"]);
        if mirrors.iter().all(|l| l.matches("mirrorq@").count() == 2) {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "mirrors never synchronised: {mirrors:?}");
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    assert!(admin.list("exchanges", &["name", "type"]).contains(&"orders\ttopic".to_string()));
    assert!(admin
        .list("bindings", &["source", "destination", "routing_key"])
        .contains(&"orders\tha.orders\torder.*".to_string()));
    assert!(admin.list("policies", &["name", "pattern"]).contains(&"ha-all\t^ha\\.".to_string()));
    assert!(admin.list("vhosts", &["name"]).contains(&"tenant".to_string()));
    assert!(admin.list("users", &["name", "tags"]).iter().any(|l| l.starts_with("alice\t")));
    assert!(admin.list("permissions", &["user", "vhost"]).contains(&"alice\ttenant".to_string()));

    // Publish through the exchange, get back, purge.
    let out = admin.run(&["publish", "exchange=orders", "routing_key=order.new", "payload=first order"]);
    assert!(out.contains("Message published"), "{out}");
    admin.run(&["publish", "exchange=amq.default", "routing_key=ha.orders", "payload=second order"]);
    let got = admin.run(&["-f", "tsv", "get", "queue=ha.orders", "count=1", "ackmode=ack_requeue_false"]);
    assert!(got.contains("first order"), "{got}");
    admin.run(&["purge", "queue", "name=ha.orders"]);
    assert_eq!(admin.list("queues", &["name", "messages"]).iter().filter(|l| l.starts_with("ha.orders\t")).count(), 1);
    let left = admin.run(&["-f", "tsv", "get", "queue=ha.orders", "count=5", "ackmode=ack_requeue_false"]);
    assert!(!left.contains("second order"), "purged, yet: {left}");

    // Export, delete everything declared, import: it is all back.
    let defs = root.path().join("defs.json");
    admin.run(&["export", defs.to_str().unwrap()]);
    admin.run(&[
        "delete",
        "binding",
        "source=orders",
        "destination_type=queue",
        "destination=ha.orders",
        "properties_key=order.*",
    ]);
    assert!(!admin.list("bindings", &["source", "destination"]).contains(&"orders\tha.orders".to_string()));
    admin.run(&["delete", "queue", "name=ha.audit"]);
    admin.run(&["delete", "exchange", "name=orders"]);
    admin.run(&["delete", "permission", "vhost=tenant", "user=alice"]);
    admin.run(&["delete", "user", "name=alice"]);
    admin.run(&["delete", "vhost", "name=tenant"]);
    admin.run(&["delete", "policy", "name=ha-all"]);
    assert_eq!(admin.list("queues", &["name"]), vec!["ha.orders"]);
    admin.run(&["import", defs.to_str().unwrap()]);
    assert_eq!(sorted(admin.list("queues", &["name"])), vec!["ha.audit", "ha.orders"]);
    assert!(admin.list("users", &["name"]).contains(&"alice".to_string()));
    assert!(admin.list("policies", &["name"]).contains(&"ha-all".to_string()));
    assert!(admin.list("bindings", &["source", "destination"]).contains(&"orders\tha.orders".to_string()));

    // A connection it can see and close.
    let amqp = nodes[1].amqp_port.unwrap();
    let conn = lapin::Connection::connect(
        &format!("amqp://guest:guest@127.0.0.1:{amqp}/%2f"),
        lapin::ConnectionProperties::default(),
    )
    .await
    .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let name = loop {
        if let Some(n) = admin.list("connections", &["name"]).into_iter().next() {
            break n;
        }
        assert!(std::time::Instant::now() < deadline, "the connection is never listed");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    };
    admin.run(&["close", "connection", &format!("name={name}")]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while conn.status().connected() {
        assert!(std::time::Instant::now() < deadline, "closed through rabbitmqadmin, yet still connected");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    for n in &nodes {
        n.assert_no_panic();
    }
}

/// What Terraform's RabbitMQ provider sends, replayed request by request
/// (`tests/clients/terraform_requests.py`): vhosts with their limits,
/// users, permissions, policies, queues, exchanges and bindings, each
/// created, read back as the provider reads it, and deleted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terraform_providers_requests_are_served() {
    let root = tempfile::tempdir().unwrap();
    let node = process::single(root.path()).await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/clients/terraform_requests.py");
    let out = std::process::Command::new("python3")
        .arg(script)
        .env("HTTP_PORT", node.http_port.unwrap().to_string())
        .output()
        .expect("python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "requests failed:\n{stdout}\n{stderr}\nnode log:\n{}", node.log_text());
    assert_eq!(stdout.lines().last(), Some("terraform requests ok"), "{stdout}");
    node.assert_no_panic();
}
