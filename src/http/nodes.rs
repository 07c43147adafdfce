//! The cluster's nodes (`/api/nodes`): each one's readings under
//! RabbitMQ's names, and removing a stopped one.

use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use serde_json::{json, Value};

use super::access::Caller;
use super::ApiError;
use crate::node::Node;

pub(super) async fn nodes(State(node): State<Node>) -> Json<Value> {
    let meta = node.metadata();
    // Every node at once: one that does not answer costs the limit once.
    let asks = meta.nodes.values().map(|n| node.readings_of(n.id, Duration::from_millis(500)));
    let readings = futures::future::join_all(asks).await;
    let mut out = Vec::new();
    for (n, r) in meta.nodes.values().zip(readings) {
        // A node that answers its readings is running.
        let mut entry = json!({"name": n.name, "running": r.is_some(), "type": "disc", "cluster_links": []});
        if let (Value::Object(e), Some(Ok(Value::Object(r)))) = (&mut entry, r.map(serde_json::to_value)) {
            // Memory, disk and alarms under RabbitMQ's names.
            e.extend(r);
        }
        out.push(entry);
    }
    Json(Value::Array(out))
}

/// Remove a stopped node from the cluster (`rabbitmqctl forget_cluster_node`).
pub(super) async fn forget_node(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    caller.admin()?;
    node.forget_node(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}
