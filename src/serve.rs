//! `mirrorq serve`: run a node until a shutdown signal or a fatal error.

use std::future::Future;

use crate::config::ServeConfig;
use crate::error::ServerError;
use crate::node::Node;
use crate::tls::TlsListener;

/// How the node ended.
#[derive(Debug, PartialEq, Eq)]
pub enum Exit {
    /// Asked to stop (SIGTERM / SIGINT).
    Requested,
    /// Stopped by itself after a storage failure: exit non-zero.
    Failed,
}

/// How long a node stopping by itself (a storage failure) has to finish
/// before the process exits anyway.
const FAIL_STOP_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// Start a node and run it until `shutdown` resolves or the node stops.
pub async fn run(cfg: ServeConfig, shutdown: impl Future<Output = ()>) -> Result<Exit, ServerError> {
    let node = Node::start(cfg.node.clone()).await?;
    let amqp = tokio::net::TcpListener::bind(&cfg.amqp_listen)
        .await
        .map_err(|source| ServerError::Listen { addr: cfg.amqp_listen.clone(), source })?;
    let amqp = tokio::spawn(crate::amqp::serve(amqp, node.clone(), node.stopped()));
    let http = tokio::net::TcpListener::bind(&cfg.http_listen)
        .await
        .map_err(|source| ServerError::Listen { addr: cfg.http_listen.clone(), source })?;
    tokio::spawn(crate::http::serve(http, node.clone(), node.stopped()));
    let mut amqps = None;
    if let Some(tls) = &cfg.tls {
        let tls_err = |e: crate::tls::TlsError| ServerError::Config(e.to_string());
        if let Some(addr) = &cfg.amqps_listen {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| ServerError::Listen { addr: addr.clone(), source })?;
            let l = TlsListener::new(l, tls.server_config(&[]).map_err(tls_err)?, node.closing())
                .map_err(|source| ServerError::Listen { addr: addr.clone(), source })?;
            amqps = Some(tokio::spawn(crate::amqp::serve_tls(l, node.clone(), node.stopped())));
        }
        if let Some(addr) = &cfg.https_listen {
            let l = tokio::net::TcpListener::bind(addr)
                .await
                .map_err(|source| ServerError::Listen { addr: addr.clone(), source })?;
            let l = TlsListener::new(l, tls.server_config(&[b"http/1.1"]).map_err(tls_err)?, node.stopped())
                .map_err(|source| ServerError::Listen { addr: addr.clone(), source })?;
            tokio::spawn(crate::http::serve_tls(l, node.clone(), node.stopped()));
        }
    }
    tracing::info!(
        node = node.name(),
        raft = node.raft_addr(),
        amqp = %cfg.amqp_listen,
        http = %cfg.http_listen,
        amqps = cfg.amqps_listen.as_deref().unwrap_or("off"),
        https = cfg.https_listen.as_deref().unwrap_or("off"),
        "mirrorq node serving"
    );
    let (stopped, failed) = (node.stopped(), node.failed());
    let exit = tokio::select! {
        _ = shutdown => Exit::Requested,
        // From the moment the node knows it must stop, not when its stop
        // gets as far as `stopped` (after moving masterships, which a
        // stuck storage thread can hold up).
        _ = failed.cancelled() => Exit::Failed,
        _ = stopped.cancelled() => Exit::Failed,
    };
    if exit == Exit::Failed {
        // Fail-stop must stop: a storage thread stuck in a write or flush
        // that never returns (sled 0.34 after a failed write) must not keep
        // the process up, nor the tasks waiting on it.
        std::thread::spawn(|| {
            std::thread::sleep(FAIL_STOP_GRACE);
            eprintln!("mirrorq: the node did not stop within {FAIL_STOP_GRACE:?} of a storage failure; exiting");
            std::process::exit(1);
        });
    }
    // As RabbitMQ does: clients are told to leave (320) before masterships
    // move, and the listener closes, so none is served by a node on its way out.
    node.close_clients();
    let _ = amqp.await;
    if let Some(amqps) = amqps {
        let _ = amqps.await;
    }
    node.shutdown().await;
    Ok(exit)
}
