//! Shared test harness: in-process nodes on loopback TCP.
#![allow(dead_code)]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

pub mod process;
pub mod raw_amqp;

use amq_protocol::protocol::basic::AMQPProperties;
use mirrorq::message::encode_properties;
use mirrorq::{Message, Node, NodeConfig, Timing};

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("MIRRORQ_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,openraft=warn")),
        )
        .with_test_writer()
        .try_init();
}

/// A loopback port free at the time of asking, picked below the kernel's
/// ephemeral range. A port the kernel hands out for `bind(0)` may be handed
/// again to any outgoing connection (a client of another test, a node's
/// link) before the node told to listen on it has started; CI saw a node
/// exit with "Address already in use" on its node-link port so. Ports below
/// the range are only ever taken by a listener asked for them, and each is
/// given out once per test process.
pub fn free_port() -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let (lo, hi) = port_window();
    let span = hi - lo;
    // Processes run one after another mostly, but a leftover node of an
    // earlier one may still hold ports: start each process elsewhere.
    let start = std::process::id() * 97 % span;
    for _ in 0..span {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (lo + (start + n) % span) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {lo}..{hi}");
}

/// Ports from 10000 up to the start of the ephemeral range (32768 unless
/// the machine says otherwise).
fn port_window() -> (u32, u32) {
    let ephemeral_lo = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse::<u32>().ok()))
        .unwrap_or(32768);
    if ephemeral_lo > 12000 {
        (10000, ephemeral_lo)
    } else {
        (61000, 65535)
    }
}

pub fn fast_timing(sync_timeout: Duration) -> Timing {
    Timing {
        // Short enough for quick failovers, long enough that a loaded 2-core
        // CI machine running several clusters does not call elections.
        heartbeat: Duration::from_millis(150),
        election_min: Duration::from_millis(800),
        election_max: Duration::from_millis(1600),
        sync_timeout,
        op_timeout: Duration::from_secs(20),
        failure_timeout: Duration::from_secs(3),
        unreachable_hold: Duration::from_secs(60),
        consumer_timeout: Some(mirrorq::node::DEFAULT_CONSUMER_TIMEOUT),
    }
}

pub struct Cluster {
    pub dirs: Vec<tempfile::TempDir>,
    pub configs: Vec<NodeConfig>,
    /// `None` once a node has been crashed.
    pub nodes: Vec<Option<Node>>,
}

impl Cluster {
    /// Serve the management HTTP API (and UI) of every node on a loopback
    /// port; the ports in node order.
    #[allow(dead_code)]
    pub async fn serve_http(&self) -> Vec<u16> {
        let mut ports = Vec::new();
        for node in self.nodes.iter().flatten() {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            ports.push(l.local_addr().unwrap().port());
            tokio::spawn(mirrorq::http::serve(l, node.clone(), node.stopped()));
        }
        ports
    }

    /// Start `n` nodes (ids 1..=n) forming a new cluster.
    pub async fn start(n: u64, timing: Timing) -> Cluster {
        Self::start_configured(n, timing, |_| {}).await
    }

    /// [`Cluster::start`] with each node's config adjusted by `tweak`.
    pub async fn start_configured(n: u64, timing: Timing, tweak: impl Fn(&mut NodeConfig)) -> Cluster {
        // Bind every node's port before any starts: no race for free ports.
        let listeners: Vec<std::net::TcpListener> =
            (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0").unwrap()).collect();
        let members: BTreeMap<u64, String> =
            (1..=n).zip(&listeners).map(|(id, l)| (id, l.local_addr().unwrap().to_string())).collect();
        let mut dirs = Vec::new();
        let mut configs = Vec::new();
        for id in 1..=n {
            let dir = tempfile::tempdir().unwrap();
            let mut cfg = NodeConfig::new(id, dir.path(), members[&id].clone());
            cfg.cluster = members.clone();
            cfg.timing = timing.clone();
            // A crash loses what was not synced, as a power cut would.
            cfg.test.crash_image = true;
            tweak(&mut cfg);
            dirs.push(dir);
            configs.push(cfg);
        }
        let nodes = futures::future::join_all(
            configs.iter().cloned().zip(listeners).map(|(c, l)| Node::start_with_listener(c, l)),
        )
        .await;
        let nodes = nodes.into_iter().map(|r| Some(r.expect("node starts"))).collect();
        let c = Cluster { dirs, configs, nodes };
        c.wait_registered().await;
        c
    }

    pub fn node(&self, id: u64) -> &Node {
        self.nodes[(id - 1) as usize].as_ref().expect("node is running")
    }

    /// Wait until every node sees every node registered in the metadata.
    pub async fn wait_registered(&self) {
        let n = self.nodes.len();
        wait_until(Duration::from_secs(20), "all nodes registered", || {
            self.nodes.iter().flatten().all(|node| node.metadata().nodes.len() == n)
        })
        .await;
    }

    pub async fn crash(&mut self, id: u64) {
        let node = self.nodes[(id - 1) as usize].take().expect("node is running");
        node.crash().await;
    }

    pub async fn restart(&mut self, id: u64) {
        assert!(self.nodes[(id - 1) as usize].is_none(), "node {id} still running");
        let deadline = Instant::now() + Duration::from_secs(10);
        // The port may take a moment to be free again.
        loop {
            match Node::start(self.configs[(id - 1) as usize].clone()).await {
                Ok(n) => {
                    self.nodes[(id - 1) as usize] = Some(n);
                    return;
                }
                Err(e) if Instant::now() < deadline => {
                    tracing::info!(error = %e, "restart retry");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("restart of node {id} failed: {e}"),
            }
        }
    }

    /// Start one more node that joins the running cluster through `via`;
    /// returns its id.
    pub async fn add_node(&mut self, via: u64) -> u64 {
        let id = self.configs.len() as u64 + 1;
        let dir = tempfile::tempdir().unwrap();
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut cfg = NodeConfig::new(id, dir.path(), listener.local_addr().unwrap().to_string());
        cfg.timing = self.configs[0].timing.clone();
        cfg.cluster_secret = self.configs[0].cluster_secret.clone();
        cfg.test.crash_image = true;
        cfg.join = Some(self.configs[(via - 1) as usize].raft_listen.clone());
        let node = Node::start_with_listener(cfg.clone(), listener).await.expect("joining node starts");
        self.dirs.push(dir);
        self.configs.push(cfg);
        self.nodes.push(Some(node));
        id
    }

    /// The node currently master of `queue`, as the replicas see it.
    pub async fn master_of(&self, queue: &str) -> u64 {
        let mut found = None;
        wait_until(Duration::from_secs(20), "queue has a master", || {
            found = self.nodes.iter().flatten().find(|n| n.is_master(queue)).map(|n| n.id());
            found.is_some()
        })
        .await;
        found.unwrap()
    }

    pub async fn shutdown(mut self) {
        for n in self.nodes.iter_mut() {
            if let Some(n) = n.take() {
                n.shutdown().await;
            }
        }
    }
}

pub async fn wait_until(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Publish until confirmed, resending on the errors that leave the outcome
/// unknown, as a publisher does after a nack.
pub async fn publish_retrying(node: &Node, queue: &str, body: Vec<u8>) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match node.publish(queue, vec![msg(body.clone())]).await {
            Ok(()) => return,
            Err(e @ (mirrorq::NodeError::Unconfirmed(_) | mirrorq::NodeError::Unavailable(_))) => {
                assert!(Instant::now() < deadline, "never confirmed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("publish failed: {e}"),
        }
    }
}

pub fn msg(body: impl Into<Vec<u8>>) -> Message {
    // Some properties set, so they are seen to travel with the message.
    let props = AMQPProperties::default().with_app_id("test".into()).with_delivery_mode(2);
    Message {
        exchange: String::new(),
        routing_key: "q".into(),
        properties: encode_properties(&props),
        body: body.into(),
    }
}

/// A queue policy named `ha`.
pub fn policy(pattern: &str, def: &str) -> mirrorq::metadata::Policy {
    mirrorq::metadata::Policy {
        name: "ha".into(),
        pattern: pattern.into(),
        apply_to: mirrorq::metadata::ApplyTo::Queues,
        priority: 0,
        definition: def.into(),
    }
}

/// A CA, a node certificate (for `localhost` and `127.0.0.1`, fit for
/// serving and for dialling, as a node on the node link does both) and a
/// client certificate, as PEM files in `dir`: (ca, node cert, node key,
/// client cert, client key).
#[allow(dead_code)]
pub fn certificates(dir: &std::path::Path) -> [std::path::PathBuf; 5] {
    use rcgen::{BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose as Usage, IsCa, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.distinguished_name.push(DnType::CommonName, "mirrorq test CA");
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let leaf = |names: Vec<String>, usage: Vec<Usage>| {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(names).unwrap();
        p.extended_key_usages = usage;
        let cert = p.signed_by(&key, &ca_cert, &ca_key).unwrap();
        (cert.pem(), key.serialize_pem())
    };
    let (node, node_key) =
        leaf(vec!["localhost".into(), "127.0.0.1".into()], vec![Usage::ServerAuth, Usage::ClientAuth]);
    let (client, client_key) = leaf(vec!["a client".into()], vec![Usage::ClientAuth]);
    let files = ["ca.pem", "node.pem", "node.key", "client.pem", "client.key"].map(|f| dir.join(f));
    for (path, pem) in files.iter().zip([ca_cert.pem(), node, node_key, client, client_key]) {
        std::fs::write(path, pem).unwrap();
    }
    files
}
