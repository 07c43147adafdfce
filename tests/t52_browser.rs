//! The web UI driven in headless Chromium (Debian's `chromium`, through
//! playwright-core in `tests/ui/`; `test.sh` installs both): a three-node
//! cluster, a policy and a queue added through the UI, the queue seen
//! mirrored on three nodes, a message published and got back in the page;
//! a mirror added under `ha-sync-mode: manual` synchronised with the queue
//! page's Synchronise button; RabbitMQ's other pages with a real AMQP
//! client connected: the overview's counts, Channels, an exchange added,
//! bound and published through to that client's consumer, a queue's
//! consumers and bindings, Admin's Users and Virtual Hosts, 123 queues paged and
//! filtered by the server, the client's connection force-closed from
//! Connections; then, while messages flow through the HTTP API, the rate
//! charts of the overview and of the queue draw, move and plot non-zero
//! rates, and the API's `message_stats` carry those rates.

mod common;

use std::process::Command;
use std::time::Duration;

use futures::StreamExt;
use lapin::options::{BasicConsumeOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{Connection, ConnectionProperties};

use common::{fast_timing, init_tracing, wait_until, Cluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_web_ui_in_a_real_browser() {
    init_tracing();
    let ui = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ui");
    assert!(
        ui.join("node_modules/playwright-core").is_dir(),
        "run `npm install --prefix tests/ui` first (and install Debian's chromium), as test.sh does"
    );
    let cluster = Cluster::start(3, fast_timing(Duration::from_secs(3))).await;
    let ports = cluster.serve_http().await;
    // A real client, on node 2, for Connections, Channels and Consumers.
    let amqp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let amqp_port = amqp.local_addr().unwrap().port();
    tokio::spawn(mirrorq::amqp::serve(amqp, cluster.node(2).clone(), cluster.node(2).stopped()));
    let uri = format!("amqp://guest:guest@127.0.0.1:{amqp_port}/%2f");
    let conn = Connection::connect(&uri, ConnectionProperties::default()).await.expect("connect");
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare("ui.consumed".into(), QueueDeclareOptions::default(), FieldTable::default()).await.unwrap();
    let mut consumer = ch
        .basic_consume(
            "ui.consumed".into(),
            "ui-consumer".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    // A queue whose second replica joins under `ha-sync-mode: manual`
    // with messages in it: not synchronised until asked.
    let manual = |n: u32| format!(r#"{{"ha-mode":"exactly","ha-params":{n},"ha-sync-mode":"manual"}}"#);
    cluster.node(1).set_policy(common::policy("^sync\\.", &manual(1))).await.unwrap();
    cluster.node(1).declare_queue("sync.q", vec![]).await.unwrap();
    for i in 0..50 {
        cluster.node(1).publish("sync.q", vec![common::msg(format!("s{i}"))]).await.unwrap();
    }
    cluster.node(1).set_policy(common::policy("^sync\\.", &manual(2))).await.unwrap();
    // More queues than one page holds, named to sort after the UI's own.
    for i in 0..120 {
        cluster.node(1).declare_queue(&format!("zz.page.{i:03}"), vec![1]).await.unwrap();
    }
    let shots = tempfile::tempdir().unwrap();
    // MIRRORQ_UI_SHOTS keeps the screenshots there, to look at them.
    let kept = std::env::var_os("MIRRORQ_UI_SHOTS").map(std::path::PathBuf::from);
    let shots_dir = kept.unwrap_or_else(|| shots.path().to_path_buf());
    let base = format!("http://127.0.0.1:{}", ports[0]);
    let (script, dir) = (ui.join("browser.js"), shots_dir.clone());
    let out = tokio::task::spawn_blocking(move || Command::new("node").arg(script).arg(&base).arg(&dir).output())
        .await
        .unwrap()
        .expect("node runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "browser run failed\nstdout:\n{stdout}\nstderr:\n{stderr}");
    tracing::info!("--- the browser saw:\n{stdout}");
    assert_eq!(stdout.lines().last(), Some("ok"), "{stdout}");
    assert!(shots_dir.join("queues.png").is_file());
    assert!(shots_dir.join("charts.png").is_file());
    assert!(shots_dir.join("exchange.png").is_file() && shots_dir.join("users.png").is_file());

    // The message published on the exchange's page reached the client.
    let delivery = tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("the message published through the exchange's page reaches the consumer")
        .expect("a delivery")
        .expect("not an error");
    assert_eq!(delivery.data, b"via ui.x");
    // "Force close" on Connections closed the client's connection.
    let closed = tokio::time::timeout(Duration::from_secs(10), async {
        while conn.status().connected() {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert!(closed.is_ok(), "the connection force-closed in the UI is still open");

    // What the browser did, seen through the library API.
    let node = cluster.node(2);
    let meta = node.metadata();
    assert!(meta.policies.contains_key("ha-ui"));
    assert!(meta.exchanges.contains_key("ui.x"), "exchange added through the UI");
    assert!(meta.users.contains_key("ui-user"), "user added through the UI");
    assert!(
        meta.permissions.get("/").is_some_and(|p| p.contains_key("ui-user")),
        "permission set through the UI: {:?}",
        meta.permissions
    );
    assert!(meta.vhosts.contains_key("ui-vhost"), "virtual host added through the UI");
    let members = node.queue_members("ui.demo").expect("queue declared through the UI");
    assert_eq!(members.len(), 3, "mirrored on three nodes");
    assert_eq!(node.status("ui.demo").await.unwrap(), (0, 0), "the message was got with an ack");
    cluster.shutdown().await;
}

/// The tutorial mirrorq started from, click for click in the browser
/// (`tests/ui/tutorial.js`): Admin > Policies on broker 1, a durable queue
/// added there and seen mirrored from brokers 2 and 3, a message published
/// at `#/queues/%2F/ha-queue-demo`; brokers 1 and 2 switched off (crashed:
/// what they had not synced is lost); broker 3's page of the queue gets
/// the message.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_tutorials_clicks_get_the_message_on_broker_3_with_brokers_1_and_2_switched_off() {
    tutorial(false).await;
}

/// The same with brokers 1 and 2 frozen (a VM paused: no answer, no
/// refused connection) instead of gone: broker 3 cannot tell them dead and
/// takes the queue over only after the failure timeout (15 s here);
/// meanwhile its page shows the queue down, its master unknown and the
/// message its replica has (`1*`), not an empty queue; then the get has it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_tutorials_clicks_with_brokers_1_and_2_frozen_show_the_queue_taken_over_then_get_the_message() {
    tutorial(true).await;
}

async fn tutorial(frozen: bool) {
    init_tracing();
    let ui = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ui");
    let timing = mirrorq::node::Timing {
        failure_timeout: Duration::from_secs(if frozen { 15 } else { 3 }),
        ..fast_timing(Duration::from_secs(3))
    };
    let mut cluster = Cluster::start(3, timing).await;
    let ports = cluster.serve_http().await;
    let bases: Vec<String> = ports.iter().map(|p| format!("http://127.0.0.1:{p}")).collect();
    let run = |args: Vec<String>| {
        let script = ui.join("tutorial.js");
        tokio::task::spawn_blocking(move || Command::new("node").arg(script).args(args).output())
    };
    let setup = run(["setup".to_string()].into_iter().chain(bases.iter().cloned()).collect()).await.unwrap().unwrap();
    let said = |o: &std::process::Output| {
        format!("stdout:\n{}\nstderr:\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr))
    };
    assert!(setup.status.success(), "setup on broker 1 failed\n{}", said(&setup));
    if frozen {
        // The confirm said broker 3 has the message on disk; its page
        // shows it once broker 3 also knows it committed (the master's
        // next message), which a freeze at once could cut off.
        wait_until(Duration::from_secs(10), "broker 3 applied the message", || {
            cluster.node(3).queue_info("ha-queue-demo").is_ok_and(|i| i.ready == 1)
        })
        .await;
        // Broker 3 hears nothing from 1 and 2, and its dials to them go
        // unanswered, as to a paused machine.
        for id in [1, 2] {
            cluster.node(3).block(id);
            cluster.node(id).block(3);
        }
    } else {
        cluster.crash(1).await;
        cluster.crash(2).await;
    }
    let mut get = vec!["get".to_string(), bases[2].clone()];
    if frozen {
        get.push("frozen".to_string());
    }
    let got = run(get).await.unwrap().unwrap();
    if frozen {
        assert!(String::from_utf8_lossy(&got.stdout).contains("master unknown, 1* ready"), "{}", said(&got));
    }
    assert!(got.status.success(), "get on broker 3 failed\n{}", said(&got));
    assert!(String::from_utf8_lossy(&got.stdout).contains("broker 3: got hello world HA-MESSAGE"), "{}", said(&got));
    assert_eq!(cluster.node(3).status("ha-queue-demo").await.unwrap(), (0, 0), "got with an ack");
    cluster.shutdown().await;
}
