//! Command-line structure (clap only; merging with the config file is the
//! `config` module's).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "mirrorq", version, about = "RabbitMQ-style mirrored queues on Raft")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
}

// Made once, at start: the size of the serve flags costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start one node (the default when no subcommand is given).
    Serve(ServeArgs),
    /// AMQP load generator (works against RabbitMQ too).
    Perf(PerfArgs),
    /// Manage a cluster through the HTTP API.
    Ctl(CtlArgs),
}

#[derive(Debug, Clone, Args)]
pub struct CtlArgs {
    #[arg(long, default_value = "http://127.0.0.1:15672", env = "MIRRORQ_URL")]
    pub url: String,
    #[arg(long, default_value = "guest")]
    pub user: String,
    #[arg(long, default_value = "guest")]
    pub password: String,
    /// Print the API's JSON instead of tables.
    #[arg(long)]
    pub json: bool,
    /// The vhost of policies, queues and permissions (as rabbitmqctl's `-p`).
    #[arg(long, short = 'p', default_value = "/", global = true)]
    pub vhost: String,
    #[command(subcommand)]
    pub command: CtlCommand,
}

#[derive(Debug, Clone, Subcommand)]
pub enum CtlCommand {
    /// Nodes and whether they run.
    ClusterStatus,
    /// Queues with master, mirrors and counts.
    ListQueues,
    /// Policies with their pattern, apply-to, priority and definition.
    ListPolicies,
    /// Add or replace a policy: NAME PATTERN DEFINITION_JSON.
    SetPolicy {
        name: String,
        pattern: String,
        definition: String,
        #[arg(long, default_value_t = 0)]
        priority: i64,
        #[arg(long, default_value = "all")]
        apply_to: String,
    },
    /// Remove a policy: NAME.
    ClearPolicy { name: String },
    /// Make a queue's unsynchronised mirrors fetch what they lack: NAME.
    SyncQueue { name: String },
    /// Stop a queue's mirrors synchronising: NAME.
    CancelSyncQueue { name: String },
    /// Spread queue masters evenly over the running nodes.
    Rebalance,
    /// Remove a stopped node from the cluster for good (its replicas move
    /// elsewhere as policies say): NAME as shown by cluster-status.
    ForgetNode { name: String },
    /// Write users, vhosts, permissions, policies, exchanges, queues and bindings to FILE (JSON, as RabbitMQ's).
    ExportDefinitions { file: PathBuf },
    /// Load definitions from FILE (JSON, RabbitMQ's format).
    ImportDefinitions { file: PathBuf },
    /// Users and their tags.
    ListUsers,
    /// Add or replace a user: NAME PASSWORD.
    AddUser {
        name: String,
        password: String,
        /// Comma-separated: administrator, monitoring, policymaker, management.
        #[arg(long, default_value = "")]
        tags: String,
    },
    /// Delete a user: NAME.
    DeleteUser { name: String },
    /// Virtual hosts.
    ListVhosts,
    /// Add a virtual host: NAME.
    AddVhost { name: String },
    /// Delete a vhost and everything in it.
    DeleteVhost { name: String },
    /// Permissions in the vhost given by --vhost.
    ListPermissions,
    /// USER CONFIGURE WRITE READ (regexes) in the vhost given by --vhost.
    SetPermissions { user: String, configure: String, write: String, read: String },
    /// Remove USER's permissions in the vhost given by --vhost.
    ClearPermissions { user: String },
}

#[derive(Debug, Clone, Args)]
pub struct PerfArgs {
    #[arg(long, default_value = "amqp://guest:guest@127.0.0.1:5672/%2f")]
    pub uri: String,
    /// PEM CA the server's certificate must chain to, for `amqps://` URIs
    /// (else the system's roots)
    #[arg(long)]
    pub ca: Option<std::path::PathBuf>,
    #[arg(long, default_value_t = 1)]
    pub producers: u32,
    #[arg(long, default_value_t = 1)]
    pub consumers: u32,
    /// Message size in bytes (at least 8).
    #[arg(long, default_value_t = 100)]
    pub size: usize,
    /// Publisher confirm window per producer (0: no confirms).
    #[arg(long, default_value_t = 1000)]
    pub confirm: u32,
    /// Seconds to run at most.
    #[arg(long, default_value_t = 10)]
    pub time: u64,
    #[arg(long, default_value = "perf-test")]
    pub queue: String,
    /// Spread producers and consumers over N queues, `QUEUE-1` .. `QUEUE-N`
    /// (round robin); 1: the queue `QUEUE` alone.
    #[arg(long, default_value_t = 1)]
    pub queues: u32,
    /// Publish to this exchange (default: the default exchange). It must
    /// exist; nothing is declared or bound for it.
    #[arg(long, default_value = "")]
    pub exchange: String,
    /// Publish with this routing key (default: the producer's queue name).
    /// A key nothing is bound to measures the client and the front end
    /// alone: an unroutable message is confirmed at once.
    #[arg(long)]
    pub routing_key: Option<String>,
    /// Each producer stops after N messages (0: until --time).
    #[arg(long, default_value_t = 0)]
    pub pmessages: u64,
    /// Each consumer stops after N messages (0: until --time).
    #[arg(long, default_value_t = 0)]
    pub cmessages: u64,
    /// Publish with `mandatory`.
    #[arg(long)]
    pub mandatory: bool,
    /// Consumer prefetch.
    #[arg(long, default_value_t = 1000)]
    pub prefetch: u16,
    /// Ack every N deliveries with `multiple`.
    #[arg(long, default_value_t = 100)]
    pub multi_ack: u32,
    /// Publish rate limit per producer, msg/s (0: unlimited).
    #[arg(long, default_value_t = 0)]
    pub rate: u64,
    /// Non-persistent messages.
    #[arg(long)]
    pub transient: bool,
    /// Declare the queue as a RabbitMQ quorum queue.
    #[arg(long)]
    pub quorum: bool,
    /// One JSON summary instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Flags of `mirrorq serve`. Each also reads `MIRRORQ_<FLAG>` and the TOML
/// key of the same name (with `-` or `_`) in `--config FILE`.
#[derive(Debug, Clone, Args, Default)]
pub struct ServeArgs {
    /// TOML file with any of the keys below.
    #[arg(long, env = "MIRRORQ_CONFIG")]
    pub config: Option<PathBuf>,
    /// Unique node id >= 1 [default: 1]
    #[arg(long, env = "MIRRORQ_NODE_ID")]
    pub node_id: Option<u64>,
    /// Name shown in every API [default: mirrorq@<node-id>]
    #[arg(long, env = "MIRRORQ_NODE_NAME")]
    pub node_name: Option<String>,
    /// Where all state lives; created if missing [default: ./mirrorq-data]
    #[arg(long, env = "MIRRORQ_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// AMQP 0-9-1 listener [default: 127.0.0.1:5672]
    #[arg(long, env = "MIRRORQ_AMQP_LISTEN")]
    pub amqp_listen: Option<String>,
    /// Management HTTP listener [default: 127.0.0.1:15672]
    #[arg(long, env = "MIRRORQ_HTTP_LISTEN")]
    pub http_listen: Option<String>,
    /// Node-to-node listener [default: 127.0.0.1:25672]
    #[arg(long, env = "MIRRORQ_RAFT_LISTEN")]
    pub raft_listen: Option<String>,
    /// Initial members of a new cluster, `ID=ADDR,...` (raft addresses), the
    /// same on every node. Ignored once the data dir holds a cluster.
    #[arg(long, env = "MIRRORQ_CLUSTER")]
    pub cluster: Option<String>,
    /// Join a running cluster through this member's raft address (a node
    /// with an empty data dir; ignored once the data dir holds a cluster).
    #[arg(long, env = "MIRRORQ_JOIN", conflicts_with = "cluster")]
    pub join: Option<String>,
    /// Seconds a lagging mirror may fall behind before confirms stop waiting
    /// for it [default: 5]
    #[arg(long, env = "MIRRORQ_SYNC_TIMEOUT")]
    pub sync_timeout: Option<f64>,
    /// Seconds without a master's heartbeat before a mirror stands for
    /// election (a random value up to twice this is used; heartbeats go
    /// every quarter of it). Shorter fails over sooner; too short on a busy
    /// machine causes needless elections [default: 1]
    #[arg(long, env = "MIRRORQ_ELECTION_TIMEOUT")]
    pub election_timeout: Option<f64>,
    /// Seconds a queue's replicas may be without a majority of their group
    /// before the most senior one left re-forms the queue
    /// (`ha-promote-on-failure: always`) [default: 5]
    #[arg(long, env = "MIRRORQ_FAILURE_TIMEOUT")]
    pub failure_timeout: Option<f64>,
    /// Seconds the unacked messages of consumers on a node out of reach
    /// (silent, not seen gone) stay with them before their queue's master
    /// gives them back; those of a node whose process is gone come back at
    /// once [default: 60]
    #[arg(long, env = "MIRRORQ_UNREACHABLE_HOLD")]
    pub unreachable_hold: Option<f64>,
    /// Milliseconds an AMQP delivery may stay unacked before its channel
    /// is closed with 406 and its messages go back (RabbitMQ's
    /// `consumer_timeout`), where the queue sets none of its own
    /// (`x-consumer-timeout`, policy `consumer-timeout`). 0: no limit
    /// [default: 1800000]
    #[arg(long, env = "MIRRORQ_CONSUMER_TIMEOUT")]
    pub consumer_timeout: Option<u64>,
    /// Memory use above which publishers are blocked: a fraction of the
    /// machine's memory (below 1) or bytes [default: 0.4]
    #[arg(long, env = "MIRRORQ_MEMORY_HIGH_WATERMARK")]
    pub memory_high_watermark: Option<String>,
    /// Free bytes on the data dir's disk below which publishers are
    /// blocked [default: 50000000]
    #[arg(long, env = "MIRRORQ_DISK_FREE_LIMIT")]
    pub disk_free_limit: Option<u64>,
    /// AMQP 0-9-1 over TLS (RabbitMQ's port is 5671) [default: off]
    #[arg(long, env = "MIRRORQ_AMQPS_LISTEN")]
    pub amqps_listen: Option<String>,
    /// The management HTTP API and web UI over TLS [default: off]
    #[arg(long, env = "MIRRORQ_HTTPS_LISTEN")]
    pub https_listen: Option<String>,
    /// PEM certificate chain of every TLS listener
    #[arg(long, env = "MIRRORQ_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of every TLS listener
    #[arg(long, env = "MIRRORQ_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA bundle that client certificates must chain to (with
    /// --tls-verify-peer)
    #[arg(long, env = "MIRRORQ_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// Require a client certificate signed by --tls-ca on every TLS
    /// listener (RabbitMQ's verify_peer + fail_if_no_peer_cert)
    #[arg(long, env = "MIRRORQ_TLS_VERIFY_PEER")]
    pub tls_verify_peer: bool,
    /// Mutual TLS on the node link too: every node shows --tls-cert and
    /// checks its peers' against --tls-ca (the certificate must name the
    /// node's --raft-listen host and allow client and server use)
    #[arg(long, env = "MIRRORQ_TLS_NODE_LINK")]
    pub tls_node_link: bool,
    /// File holding the secret every node of the cluster shares (the same
    /// file on every node, owner-only, at least 16 bytes); a node-link
    /// connection is served only after both ends prove they know it.
    /// Required when --raft-listen is not a loopback address
    #[arg(long, env = "MIRRORQ_CLUSTER_SECRET_FILE")]
    pub cluster_secret_file: Option<PathBuf>,
    /// AMQP connections the node keeps open at most; a client beyond is
    /// refused at `connection.open` (530 NOT_ALLOWED). 0: no limit
    /// [default: 65535]
    #[arg(long, env = "MIRRORQ_MAX_CONNECTIONS")]
    pub max_connections: Option<usize>,
    /// sled page cache in MiB [default: 64]
    #[arg(long, env = "MIRRORQ_CACHE_MB")]
    pub cache_mb: Option<u64>,
    /// Threads running the node's tasks (connections, queues, replication).
    /// Nodes sharing one machine do better with their share of its cores
    /// [default: one per core]
    #[arg(long, env = "MIRRORQ_WORKER_THREADS")]
    pub worker_threads: Option<usize>,
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn every_subcommand_says_what_it_does() {
        let cli = Cli::command();
        let mut silent = Vec::new();
        for sub in cli.get_subcommands() {
            if sub.get_about().is_none() {
                silent.push(sub.get_name().to_string());
            }
            for inner in sub.get_subcommands().filter(|s| s.get_name() != "help") {
                if inner.get_about().is_none() {
                    silent.push(format!("{} {}", sub.get_name(), inner.get_name()));
                }
            }
        }
        assert!(silent.is_empty(), "subcommands without a one-line help: {silent:?}");
    }
}
