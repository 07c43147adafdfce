//! TLS on the client surfaces, with a real `mirrorq serve` process and
//! stock clients: pika, lapin and Celery over AMQPS, the HTTP API over HTTPS, the
//! server's certificate checked against a CA the test makes, and client
//! certificates required with `--tls-verify-peer`.

mod common;

use std::path::{Path, PathBuf};

use common::certificates;

use common::process::{self, ProcNode};

/// A single node serving AMQPS and HTTPS too; its (amqps, https) ports.
async fn tls_node(root: &Path, certs: &[PathBuf; 5], verify_peer: bool) -> (ProcNode, u16, u16) {
    let mut node = process::cluster(root, 1, &[]).pop().unwrap();
    let (amqps, https) = (common::free_port(), common::free_port());
    node.extra = vec![
        "--amqps-listen".into(),
        format!("127.0.0.1:{amqps}"),
        "--https-listen".into(),
        format!("127.0.0.1:{https}"),
        "--tls-cert".into(),
        certs[1].display().to_string(),
        "--tls-key".into(),
        certs[2].display().to_string(),
        "--tls-ca".into(),
        certs[0].display().to_string(),
    ];
    if verify_peer {
        node.extra.push("--tls-verify-peer".into());
    }
    node.start();
    node.wait_serving().await;
    for port in [amqps, https] {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err() {
            assert!(std::time::Instant::now() < deadline, "TLS port never listened:\n{}", node.log_text());
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }
    (node, amqps, https)
}

fn python(script: &str, env: &[(&str, String)]) -> (bool, String) {
    let path = format!("{}/tests/clients/{script}", env!("CARGO_MANIFEST_DIR"));
    let out = std::process::Command::new("python3").arg(path).envs(env.iter().cloned()).output().expect("python3");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success(), text)
}

/// pika publishes with confirms and gets back over AMQPS, the HTTP API
/// answers over HTTPS, lapin (`mirrorq perf`) publishes and consumes, and a
/// stock Celery worker and client run tasks over AMQPS, each checking the
/// server's certificate against the test's CA.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pika_celery_and_the_http_api_work_over_tls() {
    let root = tempfile::tempdir().unwrap();
    let certs = certificates(root.path());
    let (node, amqps, https) = tls_node(root.path(), &certs, false).await;
    let ca = certs[0].display().to_string();
    let env = [("AMQPS_PORT", amqps.to_string()), ("HTTPS_PORT", https.to_string()), ("CA", ca.clone())];
    let (ok, out) = python("tls_smoke.py", &env);
    assert!(ok && out.contains("tls ok"), "pika over TLS:\n{out}\nnode log:\n{}", node.log_text());

    // lapin, through `mirrorq perf` over AMQPS, trusting the test's CA.
    let out = std::process::Command::new(process::binary())
        .args(["perf", "--uri", &format!("amqps://guest:guest@localhost:{amqps}/%2f"), "--ca", &ca])
        .args(["--time", "2", "--size", "64", "--confirm", "50", "--json"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "perf over TLS: {text}{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_str(text.lines().last().unwrap_or_default()).unwrap();
    assert!(v["confirmed"].as_u64().unwrap_or(0) > 0 && v["consumed"].as_u64().unwrap_or(0) > 0, "{v}");

    let broker = format!("amqps://guest:guest@localhost:{amqps}//");
    let (ok, out) = python("celery_smoke.py", &[("BROKER", broker), ("BROKER_CA", ca)]);
    assert!(ok && out.contains("celery ok"), "celery over TLS:\n{out}\nnode log:\n{}", node.log_text());
    node.assert_no_panic();
}

/// With `--tls-verify-peer`, a client without a certificate is refused at
/// the TLS handshake, and one with a certificate the CA signed is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_is_required_with_verify_peer() {
    let root = tempfile::tempdir().unwrap();
    let certs = certificates(root.path());
    let (node, amqps, https) = tls_node(root.path(), &certs, true).await;
    let base =
        [("AMQPS_PORT", amqps.to_string()), ("HTTPS_PORT", https.to_string()), ("CA", certs[0].display().to_string())];
    let mut refused = base.to_vec();
    refused.push(("EXPECT_REFUSED", "1".into()));
    let (ok, out) = python("tls_smoke.py", &refused);
    assert!(ok && out.contains("refused ok"), "served without a client certificate:\n{out}");
    let mut with_cert = base.to_vec();
    with_cert.push(("CLIENT_CERT", certs[3].display().to_string()));
    with_cert.push(("CLIENT_KEY", certs[4].display().to_string()));
    let (ok, out) = python("tls_smoke.py", &with_cert);
    assert!(ok && out.contains("tls ok"), "with a client certificate:\n{out}\nnode log:\n{}", node.log_text());
    node.assert_no_panic();
}
