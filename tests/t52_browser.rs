//! The web UI driven in headless Chromium (Debian's `chromium`, through
//! playwright-core in `tests/ui/`; `test.sh` installs both): a three-node
//! cluster, a policy and a queue added through the UI, the queue seen
//! mirrored on three nodes, a message published and got back in the page;
//! then, while messages flow through the HTTP API, the rate charts of the
//! overview and of the queue draw, move and plot non-zero rates, and the
//! API's `message_stats` carry those rates.

mod common;

use std::process::Command;
use std::time::Duration;

use common::{fast_timing, init_tracing, Cluster};

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

    // What the browser did, seen through the library API.
    let node = cluster.node(2);
    assert!(node.metadata().policies.contains_key("ha-ui"));
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
    init_tracing();
    let ui = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/ui");
    let mut cluster = Cluster::start(3, fast_timing(Duration::from_secs(3))).await;
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
    cluster.crash(1).await;
    cluster.crash(2).await;
    let got = run(vec!["get".to_string(), bases[2].clone()]).await.unwrap().unwrap();
    assert!(got.status.success(), "get on broker 3 failed\n{}", said(&got));
    assert!(String::from_utf8_lossy(&got.stdout).contains("broker 3: got hello world HA-MESSAGE"), "{}", said(&got));
    assert_eq!(cluster.node(3).status("ha-queue-demo").await.unwrap(), (0, 0), "got with an ack");
    cluster.shutdown().await;
}
