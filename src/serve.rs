//! `mirrorq serve`: run a node until a shutdown signal or a fatal error.

use std::future::Future;

use crate::config::ServeConfig;
use crate::error::ServerError;
use crate::node::Node;

/// How the node ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Exit {
    /// Asked to stop (SIGTERM / SIGINT).
    Requested,
    /// Stopped by itself after a storage failure: exit non-zero.
    Failed,
}

/// Start a node and run it until `shutdown` resolves or the node stops.
pub async fn run(cfg: ServeConfig, shutdown: impl Future<Output = ()>) -> Result<Exit, ServerError> {
    let node = Node::start(cfg.node.clone()).await?;
    // AMQP and HTTP front ends attach here (see issues #5 and #6); the flags
    // are accepted now so configurations stay valid.
    tracing::info!(
        node = node.name(),
        raft = node.raft_addr(),
        amqp = %cfg.amqp_listen,
        http = %cfg.http_listen,
        "mirrorq node serving"
    );
    let stopped = node.stopped();
    let exit = tokio::select! {
        _ = shutdown => Exit::Requested,
        _ = stopped.cancelled() => Exit::Failed,
    };
    node.shutdown().await;
    Ok(exit)
}
