//! Queues (`/api/queues`), so RabbitMQ's tools can declare, watch, sync, purge and sample them over HTTP.

use axum::body::Bytes;
use std::collections::HashMap;

use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use base64::Engine;
use serde_json::{json, Value};

use super::access::Caller;
use super::paging::Listing;
use super::{bool_field, checked_name, parse_body, props, put_status, query_flag, queue_args, ApiError};
use crate::api::DeclareOpts;
use crate::metadata::names::{self, key};
use crate::metadata::{Access, QueueMeta};
use crate::node::Node;
use crate::rates::message_stats_json;

async fn queue_json(node: &Node, q: &QueueMeta) -> Value {
    let meta = node.metadata();
    let name_of = |id: &u64| meta.nodes.get(id).map(|n| n.name.clone()).unwrap_or_else(|| format!("mirrorq@{id}"));
    // An answer that names no master (a replica standing for election)
    // is no master's view.
    let view = node.master_view(&q.name).await.ok().filter(|v| v.leader.is_some());
    let master = view.as_ref().and_then(|v| v.leader);
    // Shown as its node while no master answers (a takeover under way, or
    // no majority in reach): the most senior replica, as RabbitMQ shows a
    // queue's home node, and not also as one of its mirrors.
    let shown = master.unwrap_or(q.replicas[0]);
    let slaves: Vec<String> = q.replicas.iter().filter(|r| **r != shown).map(name_of).collect();
    let synced: Vec<String> = view
        .as_ref()
        .map(|v| v.synchronised.iter().filter(|r| Some(**r) != master).map(name_of).collect())
        .unwrap_or_default();
    // Without a master's answer the counts are what this node's replica
    // last applied (every committed publish and ack up to then), said to
    // be so; on a node with no replica they are not known: null, never a
    // confident 0.
    let (counts, counts_from) = match &view {
        Some(v) => (Some((v.ready, v.unacked)), Some("master")),
        None => match node.queue_info(&q.name).ok().filter(|i| i.local) {
            Some(i) => (Some((i.ready, i.unacked)), Some("local replica")),
            None => (None, None),
        },
    };
    let flows = view.as_ref().and_then(|v| v.flows).unwrap_or_default();
    let catching: Vec<Value> = view
        .as_ref()
        .map(|v| {
            v.catching_up
                .iter()
                .map(|(id, p)| {
                    json!({"node": name_of(id), "messages_done": p.msgs_done, "messages_total": p.msgs_total,
                           "bytes_done": p.bytes_done, "bytes_total": p.bytes_total, "running": p.running})
                })
                .collect()
        })
        .unwrap_or_default();
    let syncing = view.as_ref().is_some_and(|v| v.catching_up.iter().any(|(_, p)| p.running));
    let def = q
        .policy
        .as_ref()
        .and_then(|p| meta.policies.get(p))
        .and_then(|p| serde_json::from_str::<Value>(&p.definition).ok())
        .unwrap_or(json!({}));
    let (vhost, name) = names::split(&q.name);
    let mut out = json!({
        "name": name,
        "vhost": vhost,
        "durable": q.durable,
        "auto_delete": q.auto_delete,
        "exclusive": q.exclusive_owner.is_some(),
        "arguments": q.args.to_json(),
        "node": name_of(&shown),
        "slave_nodes": slaves,
        "synchronised_slave_nodes": synced,
        "message_stats": message_stats_json(&flows.now, &flows.rates(), false),
        "policy": q.policy.as_deref().map(names::name_of),
        "effective_policy_definition": def,
        "sync_progress": catching,
        "state": match (master, syncing) {
            (None, _) => "down",
            (Some(_), true) => "syncing",
            (Some(_), false) => "running",
        },
        "type": q.args.queue_type(),
    });
    if let Some(o) = out.as_object_mut() {
        o.insert("messages".into(), json!(counts.map(|(r, u)| r + u)));
        o.insert("messages_ready".into(), json!(counts.map(|(r, _)| r)));
        o.insert("messages_unacknowledged".into(), json!(counts.map(|(_, u)| u)));
        o.insert("counts_from".into(), json!(counts_from));
    }
    out
}

async fn queues_json(
    node: &Node,
    wanted: impl Fn(&QueueMeta) -> bool,
    asked: &Listing,
) -> Result<Json<Value>, ApiError> {
    let meta = node.metadata();
    let mut total = 0;
    let listed: Vec<&QueueMeta> = meta
        .queues
        .values()
        .filter(|q| wanted(q))
        .inspect(|_| total += 1)
        .filter(|q| asked.matches(names::name_of(&q.name)))
        .collect();
    let range = asked.page(listed.len())?;
    let mut out = Vec::with_capacity(range.len());
    for q in &listed[range] {
        out.push(queue_json(node, q).await);
    }
    Ok(Json(asked.wrap(out, listed.len(), total)))
}

pub(super) async fn list_queues(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let asked = Listing::parse(&query)?;
    let meta = node.metadata();
    queues_json(&node, |q| caller.sees_key(&meta, &q.name), &asked).await
}

pub(super) async fn list_queues_in(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<Json<Value>, ApiError> {
    let asked = Listing::parse(&query)?;
    caller.read(&node.metadata(), &vhost)?;
    queues_json(&node, |q| names::vhost_of(&q.name) == vhost, &asked).await
}

pub(super) async fn get_queue(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let meta = node.metadata();
    caller.read(&meta, &vhost)?;
    let q = meta.queues.get(&key(&vhost, &name)).cloned().ok_or_else(ApiError::not_found)?;
    Ok(Json(queue_json(&node, &q).await))
}

pub(super) async fn put_queue(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    caller.may(&node.metadata(), &vhost, Access::Configure, "queue", &name)?;
    checked_name("queue", &name)?;
    let bare = name;
    let name = key(&vhost, &bare);
    let b = parse_body(&body)?;
    let durable = bool_field(&b, "durable", true)?;
    let auto_delete = bool_field(&b, "auto_delete", false)?;
    if b.get("arguments").is_some_and(|v| !v.is_object() && !v.is_null()) {
        return Err(ApiError::bad_request("arguments must be an object"));
    }
    if bare.is_empty() || bare.len() > 255 {
        return Err(ApiError::bad_request("queue name must be 1 to 255 bytes"));
    }
    let args = queue_args(b.get("arguments")).map_err(ApiError::bad_request)?;
    if let Some(q) = node.metadata().queues.get(&name) {
        if let Some(arg) = args.inequivalent(&q.args) {
            return Err(ApiError::bad_request(format!(
                "inequivalent arg '{arg}' for queue '{bare}' in vhost '{vhost}': received {} but current is {}",
                args.to_json(),
                q.args.to_json()
            )));
        }
    }
    // Decided by the metadata apply, not a local look-up that may lag.
    let opts = DeclareOpts { args, transient: !durable, auto_delete, ..DeclareOpts::default() };
    let (_, created) = node.declare_queue_with(&name, Vec::new(), opts).await?;
    Ok(put_status(created))
}

/// `DELETE /api/queues/VHOST/NAME[?if-unused=true][&if-empty=true]`: as
/// RabbitMQ's, refused (400) while the queue has consumers, or messages.
pub(super) async fn delete_queue(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<StatusCode, ApiError> {
    caller.may(&node.metadata(), &vhost, Access::Configure, "queue", &name)?;
    let (if_unused, if_empty) = (query_flag(&query, "if-unused")?, query_flag(&query, "if-empty")?);
    let q = key(&vhost, &name);
    if if_unused && !node.consumers_of(&q).await.is_empty() {
        return Err(ApiError::bad_request(format!("queue '{name}' in vhost '{vhost}' in use")));
    }
    if if_empty {
        let (ready, unacked) = node.status(&q).await?;
        if ready + unacked > 0 {
            return Err(ApiError::bad_request(format!("queue '{name}' in vhost '{vhost}' not empty")));
        }
    }
    node.delete_queue(&q).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `{"action":"sync"}` or `{"action":"cancel_sync"}`: start or stop the
/// catch-up of the queue's unsynchronised mirrors.
pub(super) async fn queue_action(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    caller.read(&node.metadata(), &vhost)?;
    let name = key(&vhost, &name);
    let b = parse_body(&body)?;
    let run = match b.get("action").and_then(Value::as_str) {
        Some("sync") => true,
        Some("cancel_sync") => false,
        Some(other) => return Err(ApiError::bad_request(format!("unknown action '{other}': use sync or cancel_sync"))),
        None => return Err(ApiError::bad_request("action missing: use sync or cancel_sync")),
    };
    node.sync_queue(&name, run).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(super) async fn purge_queue(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    caller.may(&node.metadata(), &vhost, Access::Read, "queue", &name)?;
    node.purge(&key(&vhost, &name)).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(super) async fn get_messages(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    caller.may(&node.metadata(), &vhost, Access::Read, "queue", &name)?;
    let name = key(&vhost, &name);
    let b = parse_body(&body)?;
    let count = match b.get("count") {
        Some(Value::Number(n)) => {
            n.as_u64().filter(|n| *n >= 1).ok_or_else(|| ApiError::bad_request("count must be a positive integer"))?
        }
        Some(Value::String(s)) => s.parse().map_err(|_| ApiError::bad_request("count must be a positive integer"))?,
        None => return Err(ApiError::bad_request("count is required")),
        Some(_) => return Err(ApiError::bad_request("count must be a positive integer")),
    };
    let requeue = match b.get("ackmode").and_then(Value::as_str) {
        Some("ack_requeue_false") | Some("reject_requeue_false") => false,
        Some("ack_requeue_true") | Some("reject_requeue_true") => true,
        Some(other) => return Err(ApiError::bad_request(format!("unknown ackmode '{other}'"))),
        None => return Err(ApiError::bad_request("ackmode is required")),
    };
    let base64_always = match b.get("encoding").and_then(Value::as_str) {
        Some("auto") | None => false,
        Some("base64") => true,
        Some(other) => return Err(ApiError::bad_request(format!("unknown encoding '{other}'"))),
    };
    node.find_queue(&name).await?;
    // Its own owner: if this node dies before the requeue below, the
    // master's reaper gives the messages back.
    let owner = node.owners().ephemeral();
    let (msgs, remaining) = node.fetch(&name, owner.owner, count.min(10_000) as u32, !requeue).await?;
    node.metrics().delivered.inc_by(msgs.len() as u64);
    if b.get("ackmode").and_then(Value::as_str) == Some("ack_requeue_false") {
        node.metrics().acknowledged.inc_by(msgs.len() as u64);
    }
    if requeue && !msgs.is_empty() {
        node.nack_of(&name, owner.owner, msgs.iter().map(|d| d.tag).collect()).await?;
    }
    let total = msgs.len() as u64;
    let out: Vec<Value> = msgs
        .into_iter()
        .enumerate()
        .map(|(i, d)| {
            let (payload, encoding) = match (base64_always, std::str::from_utf8(&d.message.body)) {
                (false, Ok(s)) => (s.to_string(), "string"),
                _ => (base64::engine::general_purpose::STANDARD.encode(&d.message.body), "base64"),
            };
            json!({
                "payload": payload,
                "payload_bytes": d.message.body.len(),
                "payload_encoding": encoding,
                "redelivered": d.redelivered,
                "exchange": d.message.exchange,
                "routing_key": d.message.routing_key,
                "message_count": remaining + (total - i as u64 - 1),
                "properties": props::to_json(&d.message.properties),
            })
        })
        .collect();
    Ok(Json(Value::Array(out)))
}
