//! Real `mirrorq serve` processes, killed with SIGKILL.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct ProcNode {
    pub id: u64,
    pub data_dir: PathBuf,
    pub raft_addr: String,
    pub cluster: String,
    pub log: PathBuf,
    pub extra: Vec<String>,
    /// AMQP and HTTP ports, picked at the first start (re-picked if taken).
    pub amqp_port: Option<u16>,
    pub http_port: Option<u16>,
    child: Option<Child>,
}

pub fn binary() -> &'static str {
    env!("CARGO_BIN_EXE_mirrorq")
}

impl ProcNode {
    pub fn new(id: u64, root: &Path, raft_addr: String, cluster: String) -> Self {
        Self {
            id,
            data_dir: root.join(format!("node{id}")),
            raft_addr,
            cluster,
            log: root.join(format!("node{id}.log")),
            extra: Vec::new(),
            amqp_port: None,
            http_port: None,
            child: None,
        }
    }

    pub fn command(&self) -> Command {
        let mut cmd = Command::new(binary());
        cmd.arg("serve")
            .arg("--node-id")
            .arg(self.id.to_string())
            .arg("--data-dir")
            .arg(&self.data_dir)
            .arg("--raft-listen")
            .arg(&self.raft_addr)
            .arg("--cluster")
            .arg(&self.cluster)
            .arg("--amqp-listen")
            .arg(format!("127.0.0.1:{}", self.amqp_port.unwrap_or_else(super::free_port)))
            .arg("--http-listen")
            .arg(format!("127.0.0.1:{}", self.http_port.unwrap_or_else(super::free_port)))
            .args(&self.extra)
            .env("MIRRORQ_LOG", "info,openraft=warn");
        cmd
    }

    /// The running process's id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("node running").id()
    }

    /// Start the process; its stderr goes to `self.log` (appended).
    pub fn start(&mut self) {
        assert!(self.child.is_none(), "node {} already running", self.id);
        self.amqp_port.get_or_insert_with(super::free_port);
        self.http_port.get_or_insert_with(super::free_port);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let child = self.command().stdout(Stdio::null()).stderr(log).spawn().expect("spawn mirrorq");
        self.child = Some(child);
    }

    /// Wait until the node link accepts connections. If a port picked for
    /// AMQP or HTTP was taken meanwhile (by a listener of another process),
    /// pick new ones and start again.
    pub async fn wait_listening(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut retries = 0;
        loop {
            // Exit first: a port someone else holds accepts connections too.
            let exited = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()).is_some();
            if exited {
                let log = self.log_text();
                let taken = log.matches("Address already in use").count();
                assert!(
                    taken > retries && retries < 5 && !log.contains(&format!("cannot listen on {}", self.raft_addr)),
                    "node {} exited; log:\n{log}",
                    self.id
                );
                retries += 1;
                self.child = None;
                self.amqp_port = Some(super::free_port());
                self.http_port = Some(super::free_port());
                self.start();
            } else if tokio::net::TcpStream::connect(&self.raft_addr).await.is_ok() {
                return;
            }
            assert!(Instant::now() < deadline, "node {} never listened; log:\n{}", self.id, self.log_text());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Wait until the node link, AMQP and HTTP all accept connections (a
    /// node that lost a port race exits and is restarted on new ports).
    pub async fn wait_serving(&mut self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            self.wait_listening().await;
            let amqp = format!("127.0.0.1:{}", self.amqp_port.unwrap());
            let http = format!("127.0.0.1:{}", self.http_port.unwrap());
            if tokio::net::TcpStream::connect(&amqp).await.is_ok()
                && tokio::net::TcpStream::connect(&http).await.is_ok()
            {
                return;
            }
            assert!(Instant::now() < deadline, "node {} never served; log:\n{}", self.id, self.log_text());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// SIGKILL, no warning.
    pub fn kill9(&mut self) {
        let mut child = self.child.take().expect("node running");
        child.kill().expect("SIGKILL");
        child.wait().unwrap();
    }

    /// The exit code if the process has ended (it is then no longer
    /// running; `start` may start it again).
    pub fn try_exit(&mut self) -> Option<Option<i32>> {
        let status = self.child.as_mut().expect("node running").try_wait().unwrap()?;
        self.child = None;
        Some(status.code())
    }

    /// SIGTERM and wait; the exit code.
    pub fn terminate(&mut self) -> Option<i32> {
        let mut child = self.child.take().expect("node running");
        // SAFETY: sending a signal to our own child process.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        child.wait().unwrap().code()
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Fail the test if the node ever panicked.
    pub fn assert_no_panic(&self) {
        let log = self.log_text();
        assert!(!log.contains("panicked"), "node {} panicked:\n{log}", self.id);
    }
}

impl Drop for ProcNode {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Three (or n) processes forming a new cluster.
pub fn cluster(root: &Path, n: u64, extra: &[&str]) -> Vec<ProcNode> {
    let addrs: Vec<String> = (0..n).map(|_| format!("127.0.0.1:{}", super::free_port())).collect();
    let spec = addrs.iter().enumerate().map(|(i, a)| format!("{}={a}", i + 1)).collect::<Vec<_>>().join(",");
    (1..=n)
        .map(|id| {
            let mut p = ProcNode::new(id, root, addrs[(id - 1) as usize].clone(), spec.clone());
            p.extra = extra.iter().map(|s| s.to_string()).collect();
            p
        })
        .collect()
}

/// `n` processes forming a new cluster, started, each serving.
pub async fn serving(root: &Path, n: u64, extra: &[&str]) -> Vec<ProcNode> {
    let mut nodes = cluster(root, n, extra);
    for node in nodes.iter_mut() {
        node.start();
    }
    for node in nodes.iter_mut() {
        node.wait_serving().await;
    }
    nodes
}

/// One call of `node`'s management API as `guest`: (status, JSON body or
/// Null; 0 and the error if no answer came).
pub async fn http(
    node: &ProcNode,
    method: &str,
    path: &str,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    use serde_json::Value;
    let url = format!("http://127.0.0.1:{}{}", node.http_port.unwrap(), path);
    let method = method.to_string();
    tokio::task::spawn_blocking(move || {
        let req = ureq::request(&method, &url)
            .timeout(Duration::from_secs(30))
            .set("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=");
        let res = match body {
            Some(b) => req.send_json(b),
            None => req.call(),
        };
        match res {
            Ok(r) | Err(ureq::Error::Status(_, r)) => (r.status(), r.into_json().unwrap_or(Value::Null)),
            Err(e) => (0, Value::String(e.to_string())),
        }
    })
    .await
    .unwrap()
}

/// One node, started and serving: its node link, AMQP and HTTP all accept
/// connections (the node link alone listens before AMQP does, and a client
/// run at once was refused: CI saw `mirrorq perf` fail so).
pub async fn single(root: &Path) -> ProcNode {
    let mut node = cluster(root, 1, &[]).pop().expect("one node");
    node.start();
    node.wait_serving().await;
    node
}

/// Declare through the node link, retrying while the node elects its
/// metadata leader after start.
pub async fn declare_retrying(client: &mirrorq::wire::client::NodeClient, queue: &str, replicas: Vec<u64>) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match client.declare_queue(queue, replicas.clone()).await {
            Ok(_) => return,
            Err(e) => {
                assert!(Instant::now() < deadline, "declare of {queue} failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// faultfs is another package of the workspace: its binary sits beside
/// ours when the workspace was built, else it is built here.
pub fn faultfs() -> PathBuf {
    let ours = Path::new(env!("CARGO_BIN_EXE_mirrorq"));
    let path = ours.with_file_name("faultfs");
    if !path.exists() {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut build = Command::new(cargo);
        build.args(["build", "-p", "faultfs", "--bin", "faultfs"]).current_dir(env!("CARGO_MANIFEST_DIR"));
        if ours.parent().and_then(Path::file_name).is_some_and(|p| p == "release") {
            build.arg("--release");
        }
        let status = build.status().expect("run cargo build -p faultfs");
        assert!(status.success(), "cargo build -p faultfs failed");
    }
    path
}
