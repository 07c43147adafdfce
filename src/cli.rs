//! Command-line structure (clap only; merging with the config file is in
//! [`crate::config`]).

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "mirrorq", version, about = "RabbitMQ-style mirrored queues on Raft")]
pub struct Cli {
    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start one node (the default when no subcommand is given).
    Serve(ServeArgs),
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
    /// Seconds a lagging mirror may fall behind before confirms stop waiting
    /// for it [default: 5]
    #[arg(long, env = "MIRRORQ_SYNC_TIMEOUT")]
    pub sync_timeout: Option<f64>,
    /// sled page cache in MiB [default: 64]
    #[arg(long, env = "MIRRORQ_CACHE_MB")]
    pub cache_mb: Option<u64>,
}
