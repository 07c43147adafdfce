//! A full disk (issue 52): a real `mirrorq serve` whose data dir is on
//! faultfs, the disk filled with `enospc`. With room below the disk free
//! limit, the disk alarm trips: AMQP publishers are told
//! `connection.blocked`, an HTTP publish is refused with the reason, and
//! all of it clears once space is freed. With the limit set below what is
//! left, a write meets ENOSPC: the node stops (fail-stop) with one clear
//! log line, loses no confirmed message, and starts again on the same data
//! dir once space is freed. Needs root and /dev/fuse (CI has both);
//! elsewhere it says why and passes without running.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::process::{self, faultfs, ProcNode};

fn mounted(mnt: &Path) -> bool {
    let m = mnt.to_string_lossy().into_owned();
    std::fs::read_to_string("/proc/self/mounts")
        .map(|s| s.lines().any(|l| l.split(' ').nth(1) == Some(m.as_str())))
        .unwrap_or(false)
}

/// A faultfs mount at `root/mnt`, unmounted on drop.
struct Disk {
    mnt: PathBuf,
    ctl: PathBuf,
    child: Child,
}

impl Disk {
    /// None (with a message) where FUSE cannot be used.
    fn mount(root: &Path) -> Option<Disk> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 || !Path::new("/dev/fuse").exists() {
            eprintln!("t62_disk_full skipped: needs root and /dev/fuse");
            return None;
        }
        let (backing, mnt, ctl) = (root.join("backing"), root.join("mnt"), root.join("fs.sock"));
        std::fs::create_dir(&backing).unwrap();
        std::fs::create_dir(&mnt).unwrap();
        let child = Command::new(faultfs())
            .arg("mount")
            .arg("--backing")
            .arg(&backing)
            .arg("--mountpoint")
            .arg(&mnt)
            .arg("--control")
            .arg(&ctl)
            .arg("--state")
            .arg(root.join("state"))
            .stdin(Stdio::null())
            .spawn()
            .expect("spawn faultfs");
        let disk = Disk { mnt, ctl, child };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !(disk.ctl.exists() && mounted(&disk.mnt)) {
            assert!(Instant::now() < deadline, "faultfs did not mount");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(disk)
    }

    fn ctl(&self, cmd: &str) -> String {
        let out = Command::new(faultfs()).arg("ctl").arg(&self.ctl).args(cmd.split(' ')).output().unwrap();
        let answer = String::from_utf8_lossy(&out.stdout).trim().to_string();
        assert!(answer.starts_with("ok"), "{cmd}: {answer}");
        answer
    }

    fn in_use(&self) -> u64 {
        let stats = self.ctl("stats");
        let n = stats.split_whitespace().find_map(|kv| kv.strip_prefix("total_bytes=")).expect("total_bytes");
        n.parse().unwrap()
    }
}

impl Drop for Disk {
    fn drop(&mut self) {
        // SAFETY: signalling our own child by pid.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline && !matches!(self.child.try_wait(), Ok(Some(_))) {
            std::thread::sleep(Duration::from_millis(20));
        }
        if mounted(&self.mnt) {
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One node with its data dir on `disk`.
fn node_on(root: &Path, disk: &Disk, extra: &[&str]) -> ProcNode {
    let mut node = process::cluster(root, 1, extra).pop().unwrap();
    node.data_dir = disk.mnt.join("node1");
    node
}

/// (status, body) of an HTTP request as guest.
async fn http(node: &ProcNode, method: &str, path: &str, body: Option<String>) -> (u16, String) {
    let url = format!("http://127.0.0.1:{}{path}", node.http_port.unwrap());
    let method = method.to_string();
    tokio::task::spawn_blocking(move || {
        let req = ureq::request(&method, &url)
            .timeout(Duration::from_secs(20))
            .set("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=");
        let res = match body {
            Some(b) => req.set("Content-Type", "application/json").send_string(&b),
            None => req.call(),
        };
        match res {
            Ok(r) => (r.status(), r.into_string().unwrap_or_default()),
            Err(ureq::Error::Status(s, r)) => (s, r.into_string().unwrap_or_default()),
            Err(e) => (0, e.to_string()),
        }
    })
    .await
    .unwrap()
}

async fn declare(node: &ProcNode, queue: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (s, b) = http(node, "PUT", &format!("/api/queues/%2F/{queue}"), Some(r#"{"durable":true}"#.into())).await;
        if s == 201 || s == 204 {
            return;
        }
        assert!(Instant::now() < deadline, "declare: {s} {b}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn publish(node: &ProcNode, queue: &str, payload: &str) -> (u16, String) {
    let body = serde_json::json!({"routing_key": queue, "payload": payload, "properties": {"delivery_mode": 2}});
    http(node, "POST", "/api/exchanges/%2F/amq.default/publish", Some(body.to_string())).await
}

async fn messages(node: &ProcNode, queue: &str) -> Option<u64> {
    let (s, b) = http(node, "GET", &format!("/api/queues/%2F/{queue}"), None).await;
    (s == 200).then(|| serde_json::from_str::<serde_json::Value>(&b).ok()?["messages"].as_u64()).flatten()
}

/// Room left below the disk free limit (the default, RabbitMQ's 50 MB):
/// the disk alarm trips as faultfs's free space drops, AMQP publishers
/// are blocked, an HTTP publish is refused with the reason, and all of it
/// clears after `enospc off`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_disk_filling_below_the_limit_blocks_publishers_until_space_is_freed() {
    use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
    let root = tempfile::tempdir().unwrap();
    let Some(disk) = Disk::mount(root.path()) else { return };
    let mut node = node_on(root.path(), &disk, &[]);
    node.start();
    node.wait_serving().await;
    declare(&node, "q").await;
    let uri = format!("amqp://guest:guest@127.0.0.1:{}/%2f", node.amqp_port.unwrap());
    let conn = lapin::Connection::connect(&uri, lapin::ConnectionProperties::default()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let confirm = ch
        .basic_publish("".into(), "q".into(), BasicPublishOptions::default(), b"before", Default::default())
        .await
        .unwrap();
    assert!(confirm.await.unwrap().is_ack());
    assert_eq!(publish(&node, "q", "before").await.0, 200);

    disk.ctl(&format!("enospc {}", disk.in_use() + 20_000_000));
    let deadline = Instant::now() + Duration::from_secs(10);
    while !conn.status().blocked() {
        assert!(Instant::now() < deadline, "no connection.blocked; log:\n{}", node.log_text());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (s, b) = http(&node, "GET", "/api/health/checks/alarms", None).await;
    assert_eq!(s, 503, "{b}");
    assert!(b.contains("low on disk"), "{b}");
    let (s, b) = publish(&node, "q", "during").await;
    assert_eq!(s, 503, "an HTTP publish under the disk alarm: {b}");
    assert!(b.contains("low on disk"), "{b}");
    assert!(node.log_text().contains("resource alarm: low on disk; publishers blocked"));

    disk.ctl("enospc off");
    let deadline = Instant::now() + Duration::from_secs(10);
    while conn.status().blocked() {
        assert!(Instant::now() < deadline, "no connection.unblocked");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(publish(&node, "q", "after").await.0, 200);
    let confirm = ch
        .basic_publish("".into(), "q".into(), BasicPublishOptions::default(), b"after", Default::default())
        .await
        .unwrap();
    assert!(confirm.await.unwrap().is_ack());
    assert_eq!(messages(&node, "q").await, Some(4));
    node.assert_no_panic();
}

/// The limit far below what is left (1 kB), so nothing warns before a
/// write meets ENOSPC: the node stops by itself (fail-stop), saying why,
/// rather than hanging on a storage thread that never returns; once space
/// is freed it starts again on the same data dir with every confirmed
/// message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_meeting_enospc_stops_the_node_and_it_starts_again_once_space_is_freed() {
    let root = tempfile::tempdir().unwrap();
    let Some(disk) = Disk::mount(root.path()) else { return };
    let mut node = node_on(root.path(), &disk, &["--disk-free-limit", "1000"]);
    node.start();
    node.wait_serving().await;
    declare(&node, "q").await;
    disk.ctl(&format!("enospc {}", disk.in_use() + 1_000_000));
    let payload = "x".repeat(100_000);
    let mut confirmed = 0u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    let refusal = loop {
        assert!(Instant::now() < deadline, "no error after {confirmed} publishes; log:\n{}", node.log_text());
        match publish(&node, "q", &payload).await {
            (200, _) => confirmed += 1,
            (s, b) => break format!("{s} {b}"),
        }
    };
    // The log's segment is reserved whole (64 MiB) and takes the entries;
    // sled, which keeps the messages too, has 1 MB to grow by.
    assert!(confirmed < 700, "{confirmed} publishes of 100 kB fitted in 1 MB and a log segment");
    eprintln!("after {confirmed} confirmed publishes: {refusal}");
    let deadline = Instant::now() + Duration::from_secs(30);
    let code = loop {
        if let Some(code) = node.try_exit() {
            break code;
        }
        assert!(Instant::now() < deadline, "the node neither served nor stopped; log:\n{}", node.log_text());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let log = node.log_text();
    assert_eq!(code, Some(1), "log:\n{log}");
    assert!(log.contains("disk full"), "no clear reason in the log:\n{log}");
    node.assert_no_panic();

    disk.ctl("enospc off");
    node.start();
    node.wait_serving().await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match messages(&node, "q").await {
            Some(n) if n >= confirmed => break,
            n => assert!(Instant::now() < deadline, "{n:?} messages of {confirmed} confirmed"),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while publish(&node, "q", "after").await.0 != 200 {
        assert!(Instant::now() < deadline, "no publish after the restart; log:\n{}", node.log_text());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    node.assert_no_panic();
}
