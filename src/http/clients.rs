//! AMQP connections, channels and consumers across the cluster, so operators can see and close them from any node.

use std::collections::BTreeMap;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use serde_json::{json, Value};

use super::access::Caller;
use super::ApiError;
use crate::metadata::names;
use crate::node::Node;

fn split_peer(peer: &str) -> (String, u16) {
    match peer.rsplit_once(':') {
        Some((h, p)) => (h.to_string(), p.parse().unwrap_or(0)),
        None => (peer.to_string(), 0),
    }
}

/// Monitoring users see every client; others their own (as RabbitMQ).
pub(super) fn own(caller: &Caller, user: &str) -> bool {
    caller.0.is_monitoring() || caller.name() == user
}

pub(super) async fn list_connections(State(node): State<Node>, Extension(caller): Extension<Caller>) -> Json<Value> {
    let (conns, _) = node.cluster_clients().await;
    Json(Value::Array(
        conns
            .iter()
            .filter(|c| own(&caller, &c.user))
            .map(|c| {
                let (host, port) = split_peer(&c.peer);
                json!({"name": c.name, "node": c.node, "user": c.user, "vhost": c.vhost, "channels": c.channels.len(),
                       "peer_host": host, "peer_port": port, "state": "running", "protocol": "AMQP 0-9-1"})
            })
            .collect(),
    ))
}

/// `DELETE /api/connections/{name}`: close it, on whichever node it is,
/// with RabbitMQ's reason (or the `X-Reason` header's).
pub(super) async fn close_connection(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    headers: axum::http::HeaderMap,
) -> Result<StatusCode, ApiError> {
    let (conns, _) = node.cluster_clients().await;
    // As RabbitMQ: an administrator, or the connection's own user (a
    // monitoring user sees every connection but closes only its own).
    let mine = |c: &&crate::clients::ConnectionInfo| caller.0.is_admin() || caller.name() == c.user;
    let Some(c) = conns.iter().filter(mine).find(|c| c.name == name) else { return Err(ApiError::not_found()) };
    let reason =
        headers.get("x-reason").and_then(|v| v.to_str().ok()).unwrap_or("Closed via management plugin").to_string();
    if node.close_connection(c, &reason).await {
        Ok(StatusCode::NO_CONTENT)
    } else {
        Err(ApiError::not_found())
    }
}

pub(super) async fn list_channels(State(node): State<Node>, Extension(caller): Extension<Caller>) -> Json<Value> {
    let (conns, consumers) = node.cluster_clients().await;
    let mut out = Vec::new();
    for c in conns.iter().filter(|c| own(&caller, &c.user)) {
        for ch in &c.channels {
            let n = consumers.iter().filter(|k| k.connection == c.id && k.channel == *ch).count();
            out.push(json!({"name": format!("{} ({ch})", c.name), "number": ch, "node": c.node, "user": c.user,
                            "vhost": c.vhost, "consumer_count": n, "state": "running",
                            "connection_details": {"name": c.name}}));
        }
    }
    Json(Value::Array(out))
}

pub(super) async fn list_consumers(State(node): State<Node>, Extension(caller): Extension<Caller>) -> Json<Value> {
    let (conns, consumers) = node.cluster_clients().await;
    let conn = |id: u64| conns.iter().find(|c| c.id == id);
    let name_of = |id: u64| conn(id).map(|c| c.name.clone()).unwrap_or_default();
    let shown: Vec<_> =
        consumers.iter().filter(|k| conn(k.connection).is_some_and(|c| own(&caller, &c.user))).collect();
    // RabbitMQ's `active` and `activity_status`: on a single-active-consumer
    // queue, as its master has the registrations (asked once per queue).
    let mut active_of: BTreeMap<&str, Option<(u64, u64)>> = BTreeMap::new();
    for k in shown.iter().filter(|k| k.single_active) {
        if !active_of.contains_key(k.queue.as_str()) {
            let active = node.master_view(&k.queue).await.ok().and_then(|v| v.active_consumer);
            active_of.insert(&k.queue, active);
        }
    }
    Json(Value::Array(
        shown
            .iter()
            .map(|k| {
                let (vhost, queue) = names::split(&k.queue);
                let (active, status) = if k.single_active {
                    let active = active_of.get(k.queue.as_str()).copied().flatten() == Some((k.owner, k.number));
                    (active, if active { "single_active" } else { "waiting" })
                } else {
                    (true, "up")
                };
                json!({"consumer_tag": k.tag, "queue": {"name": queue, "vhost": vhost}, "ack_required": k.ack_required,
                       "prefetch_count": k.prefetch, "exclusive": k.exclusive, "active": active, "activity_status": status,
                       "channel_details": {"name": format!("{} ({})", name_of(k.connection), k.channel), "number": k.channel}})
            })
            .collect(),
    ))
}
