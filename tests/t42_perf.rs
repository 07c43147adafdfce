//! `mirrorq perf` against a real node: it publishes with confirms, consumes,
//! and reports a JSON summary. (Figures are benchmarks, not asserted here.)

mod common;

use common::process;

/// Run `mirrorq perf ARGS --json`; it must succeed. Answers its summary
/// and its standard error.
fn perf(args: &[&str]) -> (serde_json::Value, String) {
    let out = std::process::Command::new(process::binary()).arg("perf").args(args).arg("--json").output().unwrap();
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "perf {args:?} failed: {stdout}\n{stderr}");
    (serde_json::from_str(stdout.trim()).expect("one JSON line"), stderr.into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn perf_runs_and_reports() {
    let root = tempfile::tempdir().unwrap();
    let node = process::single(root.path()).await;
    let amqp_port = node.amqp_port.unwrap();
    let uri = format!("amqp://guest:guest@127.0.0.1:{amqp_port}/%2f");
    let (v, _) = perf(&["--uri", &uri, "--time", "2", "--size", "64", "--confirm", "50"]);
    assert!(v["confirmed_per_sec"].as_f64().unwrap() > 0.0, "{v}");
    assert!(v["consumed_per_sec"].as_f64().unwrap() > 0.0, "{v}");
    assert_eq!(v["nacked"], 0, "{v}");
    // Connecting is timed apart from the run the rates are of.
    assert!(v["setup_ms"].as_f64().is_some_and(|ms| ms > 0.0), "{v}");
    assert!(v["confirm_latency_ms"]["p99"].as_f64().unwrap() >= v["confirm_latency_ms"]["p50"].as_f64().unwrap());
    // Message counts and several queues: 2 producers x 150 over 2 queues,
    // each consumer stops after its 150; every message confirmed and consumed.
    let (v, stderr) = perf(&[
        "--uri",
        &uri,
        "--time",
        "60",
        "--producers",
        "2",
        "--consumers",
        "2",
        "--queues",
        "2",
        "--pmessages",
        "150",
        "--cmessages",
        "150",
        "--confirm",
        "20",
        "--mandatory",
    ]);
    assert_eq!(
        (v["published"].as_u64(), v["confirmed"].as_u64(), v["consumed"].as_u64()),
        (Some(300), Some(300), Some(300)),
        "{v}"
    );
    assert_eq!(v["returned"], 0, "every queue exists: nothing returned");
    // Closing is clean: the server lets the client close the socket after
    // close-ok, so lapin does not report a broken connection.
    assert!(!stderr.contains("ERROR"), "{stderr}");
    // A routing key nothing is bound to, and an exchange the queue is not
    // bound to: one in flight, mandatory, so each message comes back
    // returned and confirmed, and none reaches the queue.
    for [flag, route] in [["--routing-key", "nowhere"], ["--exchange", "amq.direct"]] {
        let (v, _) = perf(&[
            "--uri",
            &uri,
            "--time",
            "60",
            "--consumers",
            "0",
            "--pmessages",
            "40",
            "--confirm",
            "1",
            "--mandatory",
            "--queue",
            "perf-unrouted",
            flag,
            route,
        ]);
        assert_eq!(
            (v["published"].as_u64(), v["confirmed"].as_u64(), v["returned"].as_u64()),
            (Some(40), Some(40), Some(40)),
            "{flag} {route}: {v}"
        );
    }
    // guest:guest
    let url = format!("http://127.0.0.1:{}/api/queues/%2F/perf-unrouted", node.http_port.unwrap());
    let depth: serde_json::Value = tokio::task::spawn_blocking(move || {
        ureq::get(&url).set("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=").call().unwrap().into_json().unwrap()
    })
    .await
    .unwrap();
    assert_eq!(depth["messages"], 0, "{depth}");
    // Bad input is a clear error and a non-zero exit.
    let bad =
        std::process::Command::new(process::binary()).args(["perf", "--uri", &uri, "--size", "4"]).output().unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--size"));
    node.assert_no_panic();
}
