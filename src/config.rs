//! `mirrorq serve` configuration: flags and `MIRRORQ_*` variables (clap) over
//! the TOML file over built-in defaults.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;

use crate::alarms::Watermark;
use crate::cli::ServeArgs;
use crate::error::ServerError;
use crate::ids::NodeId;
use crate::node::{NodeConfig, Timing};

/// The TOML file: the same keys as the flags, all optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct FileConfig {
    #[serde(alias = "node_id")]
    pub node_id: Option<u64>,
    #[serde(alias = "node_name")]
    pub node_name: Option<String>,
    #[serde(alias = "data_dir")]
    pub data_dir: Option<PathBuf>,
    #[serde(alias = "amqp_listen")]
    pub amqp_listen: Option<String>,
    #[serde(alias = "http_listen")]
    pub http_listen: Option<String>,
    #[serde(alias = "raft_listen")]
    pub raft_listen: Option<String>,
    pub cluster: Option<String>,
    pub join: Option<String>,
    #[serde(alias = "sync_timeout")]
    pub sync_timeout: Option<f64>,
    #[serde(alias = "failure_timeout")]
    pub failure_timeout: Option<f64>,
    #[serde(alias = "election_timeout")]
    pub election_timeout: Option<f64>,
    #[serde(alias = "unreachable_hold")]
    pub unreachable_hold: Option<f64>,
    #[serde(alias = "consumer_timeout")]
    pub consumer_timeout: Option<u64>,
    #[serde(alias = "amqps_listen")]
    pub amqps_listen: Option<String>,
    #[serde(alias = "https_listen")]
    pub https_listen: Option<String>,
    #[serde(alias = "tls_cert")]
    pub tls_cert: Option<PathBuf>,
    #[serde(alias = "tls_key")]
    pub tls_key: Option<PathBuf>,
    #[serde(alias = "tls_ca")]
    pub tls_ca: Option<PathBuf>,
    #[serde(alias = "tls_verify_peer")]
    pub tls_verify_peer: Option<bool>,
    #[serde(alias = "tls_node_link")]
    pub tls_node_link: Option<bool>,
    #[serde(alias = "cluster_secret_file")]
    pub cluster_secret_file: Option<PathBuf>,
    #[serde(alias = "max_connections")]
    pub max_connections: Option<usize>,
    #[serde(alias = "cache_mb")]
    pub cache_mb: Option<u64>,
    #[serde(alias = "memory_high_watermark")]
    pub memory_high_watermark: Option<toml::Value>,
    #[serde(alias = "disk_free_limit")]
    pub disk_free_limit: Option<u64>,
    #[serde(alias = "worker_threads")]
    pub worker_threads: Option<usize>,
}

/// More runtime threads than this is a typo, not a tuning.
const MAX_WORKER_THREADS: usize = 1024;

/// Everything `serve` needs, resolved.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub node: NodeConfig,
    pub amqp_listen: String,
    pub http_listen: String,
    /// AMQP over TLS, if on.
    pub amqps_listen: Option<String>,
    /// The HTTP API over TLS, if on.
    pub https_listen: Option<String>,
    /// What the TLS listeners serve with; set when one is on.
    pub tls: Option<crate::tls::TlsFiles>,
    /// Runtime worker threads; `None` is tokio's default, one per core.
    pub worker_threads: Option<usize>,
}

/// Parse `ID=ADDR,ID=ADDR`.
pub fn parse_cluster(s: &str) -> Result<BTreeMap<NodeId, String>, String> {
    let mut out = BTreeMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (id, addr) = part.split_once('=').ok_or_else(|| format!("'{part}' is not ID=ADDR"))?;
        let id: NodeId = id.trim().parse().map_err(|_| format!("'{id}' is not a node id"))?;
        if id == 0 {
            return Err("node ids start at 1".into());
        }
        if addr.trim().is_empty() {
            return Err(format!("node {id} has an empty address"));
        }
        if out.insert(id, addr.trim().to_string()).is_some() {
            return Err(format!("node {id} listed twice"));
        }
    }
    Ok(out)
}

/// Whether a listen address (`HOST:PORT`) is only reachable from this
/// machine. A name other than `localhost` may resolve anywhere: not loopback.
fn is_loopback(addr: &str) -> bool {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost") || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

impl ServeConfig {
    pub fn resolve(args: &ServeArgs) -> Result<Self, ServerError> {
        let file = match &args.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| ServerError::Config(format!("cannot read {}: {e}", path.display())))?;
                toml::from_str::<FileConfig>(&text)
                    .map_err(|e| ServerError::Config(format!("{}: {e}", path.display())))?
            }
            None => FileConfig::default(),
        };
        let mut node = Self::node_config(args, &file)?;
        let worker_threads = args.worker_threads.or(file.worker_threads);
        if let Some(n) = worker_threads {
            if !(1..=MAX_WORKER_THREADS).contains(&n) {
                return Err(ServerError::Config(format!(
                    "--worker-threads must be between 1 and {MAX_WORKER_THREADS}"
                )));
            }
        }
        let amqps_listen = args.amqps_listen.clone().or(file.amqps_listen.clone());
        let https_listen = args.https_listen.clone().or(file.https_listen.clone());
        let tls = Self::tls(args, &file, amqps_listen.is_some() || https_listen.is_some())?;
        if args.tls_node_link || file.tls_node_link.unwrap_or(false) {
            let t = tls.as_ref().ok_or_else(|| {
                ServerError::Config("--tls-node-link needs --tls-cert, --tls-key and --tls-ca".into())
            })?;
            node.link_tls = Some(Arc::new(t.link_tls().map_err(|e| ServerError::Config(e.to_string()))?));
        }
        Ok(Self {
            node,
            amqps_listen,
            https_listen,
            tls,
            worker_threads,
            amqp_listen: args
                .amqp_listen
                .clone()
                .or(file.amqp_listen.clone())
                .unwrap_or_else(|| "127.0.0.1:5672".into()),
            http_listen: args
                .http_listen
                .clone()
                .or(file.http_listen.clone())
                .unwrap_or_else(|| "127.0.0.1:15672".into()),
        })
    }

    /// The node's part: ids, addresses, cluster, timing, limits.
    fn node_config(args: &ServeArgs, file: &FileConfig) -> Result<NodeConfig, ServerError> {
        let node_id = args.node_id.or(file.node_id).unwrap_or(1);
        let data_dir =
            args.data_dir.clone().or(file.data_dir.clone()).unwrap_or_else(|| PathBuf::from("./mirrorq-data"));
        let raft_listen =
            args.raft_listen.clone().or(file.raft_listen.clone()).unwrap_or_else(|| "127.0.0.1:25672".into());
        let mut node = NodeConfig::new(node_id, data_dir, raft_listen);
        if let Some(name) = args.node_name.clone().or(file.node_name.clone()) {
            node.node_name = name;
        }
        if let Some(c) = args.cluster.clone().or(file.cluster.clone()) {
            node.cluster = parse_cluster(&c).map_err(|e| ServerError::Config(format!("--cluster: {e}")))?;
        }
        node.join = args.join.clone().or(file.join.clone());
        if node.join.is_some() && !node.cluster.is_empty() {
            return Err(ServerError::Config("--join and --cluster exclude each other".into()));
        }
        if let Some(s) = args.sync_timeout.or(file.sync_timeout) {
            if !(s.is_finite() && s > 0.0) {
                return Err(ServerError::Config("--sync-timeout must be a positive number of seconds".into()));
            }
            node.timing = Timing { sync_timeout: Duration::from_secs_f64(s), ..node.timing };
        }
        if let Some(s) = args.failure_timeout.or(file.failure_timeout) {
            if !(s.is_finite() && s > 0.0) {
                return Err(ServerError::Config("--failure-timeout must be a positive number of seconds".into()));
            }
            node.timing = Timing { failure_timeout: Duration::from_secs_f64(s), ..node.timing };
        }
        if let Some(s) = args.unreachable_hold.or(file.unreachable_hold) {
            if !(s.is_finite() && s > 0.0) {
                return Err(ServerError::Config("--unreachable-hold must be a positive number of seconds".into()));
            }
            node.timing = Timing { unreachable_hold: Duration::from_secs_f64(s), ..node.timing };
        }
        if let Some(ms) = args.consumer_timeout.or(file.consumer_timeout) {
            let timeout = (ms > 0).then(|| Duration::from_millis(ms));
            node.timing = Timing { consumer_timeout: timeout, ..node.timing };
        }
        if let Some(s) = args.election_timeout.or(file.election_timeout) {
            if !(s.is_finite() && (0.1..=60.0).contains(&s)) {
                return Err(ServerError::Config("--election-timeout must be between 0.1 and 60 seconds".into()));
            }
            let min = Duration::from_secs_f64(s);
            node.timing = Timing { heartbeat: min / 4, election_min: min, election_max: min * 2, ..node.timing };
        }
        let watermark = args.memory_high_watermark.clone().or(file.memory_high_watermark.clone().map(|v| match v {
            toml::Value::String(s) => s,
            toml::Value::Float(f) => f.to_string(),
            toml::Value::Integer(n) => n.to_string(),
            other => format!("{other:?}"),
        }));
        if let Some(w) = watermark {
            node.memory_high_watermark =
                Watermark::parse(&w).map_err(|e| ServerError::Config(format!("--memory-high-watermark: {e}")))?;
        }
        if let Some(d) = args.disk_free_limit.or(file.disk_free_limit) {
            node.disk_free_limit = d;
        }
        if let Some(path) = args.cluster_secret_file.clone().or(file.cluster_secret_file.clone()) {
            node.cluster_secret = Some(
                crate::link::auth::ClusterSecret::from_file(&path)
                    .map_err(|e| ServerError::Config(format!("--cluster-secret-file: {e}")))?,
            );
        }
        if node.cluster_secret.is_none() && !is_loopback(&node.raft_listen) {
            return Err(ServerError::Config(format!(
                "--raft-listen {} is not a loopback address: give --cluster-secret-file, or anyone who reaches \
                 the port could speak Raft to this node",
                node.raft_listen
            )));
        }
        if let Some(n) = args.max_connections.or(file.max_connections) {
            node.max_connections = n;
        }
        if let Some(mb) = args.cache_mb.or(file.cache_mb) {
            node.cache_bytes = mb << 20;
        }
        Ok(node)
    }

    /// The TLS files, checked: `listens` if a TLS listener is on.
    fn tls(args: &ServeArgs, file: &FileConfig, listens: bool) -> Result<Option<crate::tls::TlsFiles>, ServerError> {
        let tls = match (args.tls_cert.clone().or(file.tls_cert.clone()), args.tls_key.clone().or(file.tls_key.clone()))
        {
            (Some(cert), Some(key)) => Some(crate::tls::TlsFiles {
                cert,
                key,
                ca: args.tls_ca.clone().or(file.tls_ca.clone()),
                verify_peer: args.tls_verify_peer || file.tls_verify_peer.unwrap_or(false),
            }),
            (None, None) => None,
            _ => return Err(ServerError::Config("--tls-cert and --tls-key go together".into())),
        };
        if listens && tls.is_none() {
            return Err(ServerError::Config("--amqps-listen and --https-listen need --tls-cert and --tls-key".into()));
        }
        if let Some(t) = &tls {
            if t.verify_peer && t.ca.is_none() {
                return Err(ServerError::Config(crate::tls::TlsError::NoCa.to_string()));
            }
            // Read now: a bad file stops the start with its name, not a
            // listener later.
            t.server_config(&[]).map_err(|e| ServerError::Config(e.to_string()))?;
        }
        Ok(tls)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cluster_list_parses_and_rejects_bad_input() {
        let c = parse_cluster("1=127.0.0.1:1, 2=127.0.0.1:2,3=h:3").unwrap();
        assert_eq!(c.len(), 3);
        assert_eq!(c[&2], "127.0.0.1:2");
        assert!(parse_cluster("1=a,1=b").is_err());
        assert!(parse_cluster("0=a").is_err());
        assert!(parse_cluster("x=a").is_err());
        assert!(parse_cluster("1").is_err());
        assert!(parse_cluster("1=").is_err());
    }

    #[test]
    fn flags_override_file_which_overrides_defaults() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.toml");
        std::fs::write(
            &path,
            "node-id = 3\ndata_dir = \"/tmp/x\"\nraft-listen = \"127.0.0.1:9\"\nsync-timeout = 2.5\n",
        )
        .unwrap();
        let args = ServeArgs { config: Some(path), node_id: Some(7), ..Default::default() };
        let c = ServeConfig::resolve(&args).unwrap();
        assert_eq!(c.node.node_id, 7, "flag beats file");
        assert_eq!(c.node.node_name, "mirrorq@7");
        assert_eq!(c.node.data_dir, PathBuf::from("/tmp/x"), "file beats default");
        assert_eq!(c.node.raft_listen, "127.0.0.1:9");
        assert_eq!(c.node.timing.sync_timeout, Duration::from_millis(2500));
        assert_eq!(c.amqp_listen, "127.0.0.1:5672", "default");
    }

    #[test]
    fn a_node_link_beyond_loopback_needs_a_cluster_secret() {
        use std::os::unix::fs::PermissionsExt;
        for open in ["127.0.0.1:25672", "[::1]:25672", "localhost:25672"] {
            let args = ServeArgs { raft_listen: Some(open.into()), ..Default::default() };
            assert!(ServeConfig::resolve(&args).is_ok(), "{open}");
        }
        for exposed in ["0.0.0.0:25672", "10.0.0.5:25672", "[::]:25672", "node1.example:25672"] {
            let args = ServeArgs { raft_listen: Some(exposed.into()), ..Default::default() };
            let e = ServeConfig::resolve(&args).expect_err(exposed).to_string();
            assert!(e.contains("--cluster-secret-file"), "{e}");
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("secret");
        std::fs::write(&path, "a secret of sixteen or more\n").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        let args = ServeArgs {
            raft_listen: Some("0.0.0.0:25672".into()),
            cluster_secret_file: Some(path.clone()),
            ..Default::default()
        };
        assert!(ServeConfig::resolve(&args).unwrap().node.cluster_secret.is_some());
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = ServeConfig::resolve(&args).expect_err("a secret others may read").to_string();
        assert!(e.contains("owner only"), "{e}");
    }

    #[test]
    fn tls_listeners_need_a_readable_certificate_and_key() {
        let amqps = || ServeArgs { amqps_listen: Some("127.0.0.1:5671".into()), ..Default::default() };
        let e = ServeConfig::resolve(&amqps()).expect_err("amqps without a certificate").to_string();
        assert!(e.contains("--tls-cert"), "{e}");
        let half = ServeArgs { tls_cert: Some("/nonexistent/cert.pem".into()), ..amqps() };
        assert!(ServeConfig::resolve(&half).expect_err("a cert without its key").to_string().contains("go together"));
        let missing = ServeArgs {
            tls_cert: Some("/nonexistent/cert.pem".into()),
            tls_key: Some("/nonexistent/k".into()),
            ..amqps()
        };
        let e = ServeConfig::resolve(&missing).expect_err("unreadable files").to_string();
        assert!(e.contains("/nonexistent/cert.pem"), "the file is named: {e}");
        let link = ServeArgs { tls_node_link: true, ..Default::default() };
        let e = ServeConfig::resolve(&link).expect_err("node-link TLS without files").to_string();
        assert!(e.contains("--tls-node-link needs"), "{e}");
        let verify = ServeArgs { tls_verify_peer: true, ..missing };
        let e = ServeConfig::resolve(&verify).expect_err("verify_peer without a CA").to_string();
        assert!(e.contains("--tls-ca"), "{e}");
    }

    #[test]
    fn consumer_timeout_is_thirty_minutes_unless_set_and_zero_lifts_it() {
        let default = ServeConfig::resolve(&ServeArgs::default()).unwrap().node.timing.consumer_timeout;
        assert_eq!(default, Some(Duration::from_secs(1800)));
        let set = ServeArgs { consumer_timeout: Some(2500), ..Default::default() };
        assert_eq!(ServeConfig::resolve(&set).unwrap().node.timing.consumer_timeout, Some(Duration::from_millis(2500)));
        let off = ServeArgs { consumer_timeout: Some(0), ..Default::default() };
        assert_eq!(ServeConfig::resolve(&off).unwrap().node.timing.consumer_timeout, None);
    }

    #[test]
    fn election_timeout_sets_heartbeat_and_range_and_is_checked() {
        let args = ServeArgs { election_timeout: Some(0.4), ..Default::default() };
        let t = ServeConfig::resolve(&args).unwrap().node.timing;
        assert_eq!(
            (t.heartbeat, t.election_min, t.election_max),
            (Duration::from_millis(100), Duration::from_millis(400), Duration::from_millis(800))
        );
        for bad in [0.0, -1.0, 0.05, f64::NAN, 61.0] {
            let args = ServeArgs { election_timeout: Some(bad), ..Default::default() };
            assert!(ServeConfig::resolve(&args).is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn worker_threads_come_from_flag_or_file_and_are_checked() {
        assert_eq!(ServeConfig::resolve(&ServeArgs::default()).unwrap().worker_threads, None);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.toml");
        std::fs::write(&path, "worker-threads = 3\n").unwrap();
        let args = ServeArgs { config: Some(path.clone()), ..Default::default() };
        assert_eq!(ServeConfig::resolve(&args).unwrap().worker_threads, Some(3));
        let args = ServeArgs { config: Some(path), worker_threads: Some(1), ..Default::default() };
        assert_eq!(ServeConfig::resolve(&args).unwrap().worker_threads, Some(1), "flag beats file");
        for bad in [0, 1025] {
            let args = ServeArgs { worker_threads: Some(bad), ..Default::default() };
            let err = ServeConfig::resolve(&args).unwrap_err().to_string();
            assert!(err.contains("--worker-threads"), "{bad}: {err}");
        }
    }

    #[test]
    fn join_comes_from_flag_or_file_and_excludes_cluster() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.toml");
        std::fs::write(&path, "join = \"127.0.0.1:25671\"\n").unwrap();
        let args = ServeArgs { config: Some(path.clone()), ..Default::default() };
        assert_eq!(ServeConfig::resolve(&args).unwrap().node.join.as_deref(), Some("127.0.0.1:25671"));
        let args = ServeArgs { config: Some(path), cluster: Some("1=127.0.0.1:1".into()), ..Default::default() };
        let err = ServeConfig::resolve(&args).unwrap_err();
        assert!(err.to_string().contains("--join and --cluster"), "{err}");
    }

    #[test]
    fn unknown_file_keys_are_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.toml");
        std::fs::write(&path, "node-idd = 3\n").unwrap();
        let err = ServeConfig::resolve(&ServeArgs { config: Some(path), ..Default::default() }).unwrap_err();
        assert!(err.to_string().contains("node-idd"), "{err}");
    }

    #[test]
    fn resource_limits_come_from_flag_or_file_and_are_checked() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.toml");
        std::fs::write(&path, "memory-high-watermark = 0.25\ndisk_free_limit = 1000\n").unwrap();
        let args = ServeArgs { config: Some(path.clone()), ..Default::default() };
        let n = ServeConfig::resolve(&args).unwrap().node;
        assert_eq!((n.memory_high_watermark, n.disk_free_limit), (Watermark::Fraction(0.25), 1000));
        let args =
            ServeArgs { config: Some(path), memory_high_watermark: Some("2000000000".into()), ..Default::default() };
        assert_eq!(ServeConfig::resolve(&args).unwrap().node.memory_high_watermark, Watermark::Bytes(2_000_000_000));
        let defaults = ServeConfig::resolve(&ServeArgs::default()).unwrap().node;
        assert_eq!(defaults.memory_high_watermark, Watermark::Fraction(0.4));
        assert_eq!(defaults.disk_free_limit, 50_000_000);
        let args = ServeArgs { memory_high_watermark: Some("1.5".into()), ..Default::default() };
        assert!(ServeConfig::resolve(&args).unwrap_err().to_string().contains("--memory-high-watermark"));
    }
}
