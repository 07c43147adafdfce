//! Management HTTP API (RabbitMQ-compatible subset, CONTRACT section 3) on
//! axum. Any node answers for the whole cluster: reads come from the local
//! metadata and the queue masters (over the node link), writes go through
//! the metadata leader or the queue's master.

mod access;
mod definitions;
mod error;
mod prometheus;
mod props;
mod users;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{Extension, Json, Router};
use base64::Engine;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::api::DeclareOpts;
use crate::metadata::names::{self, key};
use crate::metadata::{
    policy, Access, ApplyTo, ArgValue, Args, Binding, ExchangeKind, ExchangeMeta, Policy, QueueArgs, QueueMeta,
};
use crate::node::Node;
use crate::queue::{Message, QueueCmd};
use crate::rates::{message_stats_json, Rates, Tally};
use access::Caller;
pub use error::ApiError;

/// Serve the API until `stop` is cancelled.
pub async fn serve(listener: TcpListener, node: Node, stop: CancellationToken) {
    let app = router(node);
    let server = axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
        .with_graceful_shutdown(stop.cancelled_owned());
    if let Err(e) = server.await {
        tracing::error!(error = %e, "http server failed");
    }
}

/// [`serve`] over TLS (`--https-listen`).
pub async fn serve_tls(listener: crate::tls::TlsListener, node: Node, stop: CancellationToken) {
    let app = router(node);
    use axum::serve::ListenerExt;
    // Tapped (doing nothing) for axum's connect info, which it gives any
    // tapped listener and only its own plain one otherwise.
    let listener = listener.tap_io(|_| {});
    let server = axum::serve(listener, app.into_make_service_with_connect_info::<SocketAddr>())
        .with_graceful_shutdown(stop.cancelled_owned());
    if let Err(e) = server.await {
        tracing::error!(error = %e, "https server failed");
    }
}

pub fn router(node: Node) -> Router {
    Router::new()
        .route("/api/overview", get(overview))
        .route("/api/health/checks/alarms", get(health))
        .route("/api/nodes", get(nodes))
        .route("/api/nodes/{name}", delete(forget_node))
        .route("/api/policies", get(list_policies))
        .route("/api/policies/{vhost}", get(list_policies_in))
        .route("/api/policies/{vhost}/{name}", get(get_policy).put(put_policy).delete(delete_policy))
        .route("/api/queues", get(list_queues))
        .route("/api/queues/{vhost}", get(list_queues_in))
        .route("/api/queues/{vhost}/{name}", get(get_queue).put(put_queue).delete(delete_queue))
        .route("/api/queues/{vhost}/{name}/contents", delete(purge_queue))
        .route("/api/queues/{vhost}/{name}/get", post(get_messages))
        .route("/api/queues/{vhost}/{name}/actions", post(queue_action))
        .route("/api/rebalance/queues", post(rebalance))
        .route("/api/exchanges", get(list_exchanges))
        .route("/api/exchanges/{vhost}", get(list_exchanges_in))
        .route("/api/exchanges/{vhost}/{name}", get(get_exchange).put(put_exchange).delete(delete_exchange))
        .route("/api/exchanges/{vhost}/{name}/publish", post(publish))
        .route("/api/bindings", get(list_bindings))
        .route("/api/bindings/{vhost}", get(list_bindings_in))
        .route("/api/bindings/{vhost}/e/{exchange}/q/{queue}", get(queue_bindings).post(bind))
        .route("/api/bindings/{vhost}/e/{exchange}/q/{queue}/{props}", get(get_binding).delete(unbind))
        .route("/api/bindings/{vhost}/e/{exchange}/e/{destination}", get(exchange_bindings).post(bind_exchange))
        .route(
            "/api/bindings/{vhost}/e/{exchange}/e/{destination}/{props}",
            get(get_exchange_binding).delete(unbind_exchange),
        )
        .route("/api/whoami", get(users::whoami))
        .route("/api/users", get(users::list_users))
        .route("/api/users/{name}", get(users::get_user).put(users::put_user).delete(users::delete_user))
        .route("/api/users/{name}/permissions", get(users::user_permissions))
        .route("/api/vhosts", get(users::list_vhosts))
        .route("/api/vhosts/{name}", get(users::get_vhost).put(users::put_vhost).delete(users::delete_vhost))
        .route("/api/vhosts/{name}/permissions", get(users::vhost_permissions))
        .route("/api/vhost-limits", get(users::list_vhost_limits))
        .route("/api/vhost-limits/{name}", get(users::vhost_limits))
        .route("/api/vhost-limits/{name}/{limit}", put(users::put_vhost_limit).delete(users::delete_vhost_limit))
        .route("/api/permissions", get(users::list_permissions))
        .route(
            "/api/permissions/{vhost}/{user}",
            get(users::get_permission).put(users::put_permission).delete(users::delete_permission),
        )
        .route("/api/definitions", get(definitions::export).post(definitions::import))
        .route("/api/connections", get(list_connections))
        .route("/api/connections/{name}", delete(close_connection))
        .route("/api/channels", get(list_channels))
        .route("/api/consumers", get(list_consumers))
        .fallback(|| async { ApiError::not_found() })
        .layer(middleware::from_fn_with_state(node.clone(), access::auth))
        // Outermost: users and permissions are checked against fresh metadata.
        .layer(middleware::from_fn_with_state(node.clone(), fresh_reads))
        // Added after the auth layer: scraped without credentials, as
        // RabbitMQ's prometheus endpoint is.
        .route("/metrics", get(prometheus))
        // The web UI is one page with its own login; its calls to the API
        // carry the credentials.
        .route("/", get(ui))
        .with_state(node)
}

/// The web UI, embedded in the binary: no build step, no external assets.
async fn ui() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], include_str!("ui.html")).into_response()
}

async fn prometheus(State(node): State<Node>) -> Response {
    ([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], prometheus::render(&node))
        .into_response()
}

/// Every request sees every change made through any node before it was
/// asked (a user just added, a permission just revoked, a queue just
/// declared): catch up with the metadata leader first (at once if it is
/// unreachable).
async fn fresh_reads(State(node): State<Node>, req: Request, next: Next) -> Response {
    node.meta_barrier().await;
    next.run(req).await
}

/// What a PUT answers, as RabbitMQ: 201 for something new, 204 otherwise.
fn put_status(created: bool) -> StatusCode {
    if created {
        StatusCode::CREATED
    } else {
        StatusCode::NO_CONTENT
    }
}

/// A queue, exchange or policy name from a path or body: it becomes part of a key.
fn checked_name(what: &str, name: &str) -> Result<(), ApiError> {
    names::check(what, name).map_err(ApiError::bad_request)
}

fn parse_body(body: &Bytes) -> Result<serde_json::Map<String, Value>, ApiError> {
    if body.is_empty() {
        return Ok(serde_json::Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad_request("body must be a JSON object")),
        Err(e) => Err(ApiError::bad_request(format!("malformed JSON: {e}"))),
    }
}

/// A boolean of a body: JSON `true`/`false`, or the strings `"true"` and
/// `"false"`, which RabbitMQ's API takes too (rabbitmqadmin sends them).
fn bool_field(b: &serde_json::Map<String, Value>, k: &str, default: bool) -> Result<bool, ApiError> {
    match b.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(v)) => Ok(*v),
        Some(Value::String(s)) if s == "true" => Ok(true),
        Some(Value::String(s)) if s == "false" => Ok(false),
        Some(_) => Err(ApiError::bad_request(format!("{k} must be true or false"))),
    }
}

/// RabbitMQ's alarms check: 503 while a memory or disk alarm is on here.
async fn health(State(node): State<Node>) -> Response {
    match node.alarms().readings().reason() {
        None => Json(json!({"status": "ok"})).into_response(),
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "failed", "reason": format!("resource alarm in effect on {}: {why}", node.name())})),
        )
            .into_response(),
    }
}

async fn overview(State(node): State<Node>, Extension(caller): Extension<Caller>) -> Json<Value> {
    let meta = node.metadata();
    let mut ready = 0;
    let mut unacked = 0;
    let visible: Vec<&QueueMeta> = meta.queues.values().filter(|q| caller.sees_key(&meta, &q.name)).collect();
    for q in &visible {
        if let Ok(info) = node.master_view(&q.name).await {
            ready += info.ready;
            unacked += info.unacked;
        }
    }
    // What every node's clients did, summed (RabbitMQ's overview counts
    // channels cluster-wide); a node that does not answer is left out.
    let (mut tally, mut rates) = (Tally::default(), Rates::default());
    for f in node.cluster_flows(Duration::from_millis(500)).await {
        (tally, rates) = (tally + f.now, rates + f.rates());
    }
    Json(json!({
        "cluster_name": "mirrorq",
        "node": node.name(),
        "product_name": "mirrorq",
        "product_version": env!("CARGO_PKG_VERSION"),
        "management_version": env!("CARGO_PKG_VERSION"),
        "queue_totals": {"messages": ready + unacked, "messages_ready": ready, "messages_unacknowledged": unacked},
        "message_stats": message_stats_json(&tally, &rates, true),
        "object_totals": {
            "queues": visible.len(),
            "exchanges": meta.exchanges.keys().filter(|k| caller.sees_key(&meta, k)).count()
                + 6 * meta.vhosts.keys().filter(|v| caller.sees(&meta, v)).count(),
            "connections": 0, "channels": 0, "consumers": 0,
        },
    }))
}

async fn nodes(State(node): State<Node>) -> Json<Value> {
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

fn policy_json(p: &Policy) -> Value {
    let (vhost, name) = names::split(&p.name);
    json!({
        "vhost": vhost,
        "name": name,
        "pattern": p.pattern,
        "apply-to": p.apply_to.as_str(),
        "priority": p.priority,
        "definition": serde_json::from_str::<Value>(&p.definition).unwrap_or(json!({})),
    })
}

async fn list_policies(State(node): State<Node>, Extension(caller): Extension<Caller>) -> Json<Value> {
    let meta = node.metadata();
    Json(meta.policies.values().filter(|p| caller.sees_key(&meta, &p.name)).map(policy_json).collect())
}

async fn list_policies_in(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let meta = node.metadata();
    caller.read(&meta, &vhost)?;
    Ok(Json(meta.policies.values().filter(|p| names::vhost_of(&p.name) == vhost).map(policy_json).collect()))
}

async fn get_policy(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let meta = node.metadata();
    caller.read(&meta, &vhost)?;
    meta.policies.get(&key(&vhost, &name)).map(|p| Json(policy_json(p))).ok_or_else(ApiError::not_found)
}

async fn put_policy(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    caller.policies(&node.metadata(), &vhost)?;
    checked_name("policy", &name)?;
    let b = parse_body(&body)?;
    let pattern = match b.get("pattern") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(ApiError::bad_request("pattern must be a string")),
        None => return Err(ApiError::bad_request("pattern is required")),
    };
    let definition = match b.get("definition") {
        Some(d @ Value::Object(_)) => d.to_string(),
        Some(_) => return Err(ApiError::bad_request("definition must be a JSON object")),
        None => return Err(ApiError::bad_request("definition is required")),
    };
    let priority = match b.get("priority") {
        None | Some(Value::Null) => 0,
        Some(Value::Number(n)) if n.is_i64() => n.as_i64().unwrap_or(0),
        Some(Value::String(s)) => s.parse().map_err(|_| ApiError::bad_request("priority must be an integer"))?,
        Some(_) => return Err(ApiError::bad_request("priority must be an integer")),
    };
    let apply_to = match b.get("apply-to") {
        None | Some(Value::Null) => ApplyTo::All,
        Some(Value::String(s)) => ApplyTo::parse(s).map_err(ApiError::bad_request)?,
        Some(_) => return Err(ApiError::bad_request("apply-to must be a string")),
    };
    let p = Policy { name: key(&vhost, &name), pattern, apply_to, priority, definition };
    policy::validate(&p).map_err(ApiError::bad_request)?;
    let created = node.set_policy(p).await?;
    Ok(put_status(created))
}

async fn delete_policy(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    caller.policies(&node.metadata(), &vhost)?;
    node.clear_policy(&key(&vhost, &name)).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn queue_json(node: &Node, q: &QueueMeta) -> Value {
    let meta = node.metadata();
    let name_of = |id: &u64| meta.nodes.get(id).map(|n| n.name.clone()).unwrap_or_else(|| format!("mirrorq@{id}"));
    let view = node.master_view(&q.name).await.ok();
    let master = view.as_ref().and_then(|v| v.leader);
    let slaves: Vec<String> = q.replicas.iter().filter(|r| Some(**r) != master).map(name_of).collect();
    let synced: Vec<String> = view
        .as_ref()
        .map(|v| v.synchronised.iter().filter(|r| Some(**r) != master).map(name_of).collect())
        .unwrap_or_default();
    let (ready, unacked) = view.as_ref().map(|v| (v.ready, v.unacked)).unwrap_or((0, 0));
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
    json!({
        "name": name,
        "vhost": vhost,
        "durable": q.durable,
        "auto_delete": q.auto_delete,
        "exclusive": q.exclusive_owner.is_some(),
        "arguments": q.args.to_json(),
        "node": master.map(|m| name_of(&m)).unwrap_or_else(|| name_of(&q.replicas[0])),
        "slave_nodes": slaves,
        "synchronised_slave_nodes": synced,
        "messages": ready + unacked,
        "messages_ready": ready,
        "messages_unacknowledged": unacked,
        "message_stats": message_stats_json(&flows.now, &flows.rates(), false),
        "policy": q.policy.as_deref().map(names::name_of),
        "effective_policy_definition": def,
        "sync_progress": catching,
        "state": match (master, syncing) {
            (None, _) => "down",
            (Some(_), true) => "syncing",
            (Some(_), false) => "running",
        },
        "type": "classic",
    })
}

async fn queues_json(node: &Node, wanted: impl Fn(&QueueMeta) -> bool) -> Json<Value> {
    let meta = node.metadata();
    let mut out = Vec::new();
    for q in meta.queues.values().filter(|q| wanted(q)) {
        out.push(queue_json(node, q).await);
    }
    Json(Value::Array(out))
}

async fn list_queues(State(node): State<Node>, Extension(caller): Extension<Caller>) -> Json<Value> {
    let meta = node.metadata();
    queues_json(&node, |q| caller.sees_key(&meta, &q.name)).await
}

async fn list_queues_in(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
) -> Result<Json<Value>, ApiError> {
    caller.read(&node.metadata(), &vhost)?;
    Ok(queues_json(&node, |q| names::vhost_of(&q.name) == vhost).await)
}

async fn get_queue(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let meta = node.metadata();
    caller.read(&meta, &vhost)?;
    let q = meta.queues.get(&key(&vhost, &name)).cloned().ok_or_else(ApiError::not_found)?;
    Ok(Json(queue_json(&node, &q).await))
}

async fn put_queue(
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

/// An exchange's `arguments`, as declared.
pub(crate) fn exchange_args_json(e: &ExchangeMeta) -> Value {
    crate::metadata::routing::args_json(&e.args)
}

/// An `arguments` object of the API (queues, bindings) as AMQP arguments.
pub(crate) fn json_args(v: Option<&Value>) -> Args {
    let Some(Value::Object(m)) = v else { return Args::new() };
    m.iter()
        .map(|(k, v)| {
            let v = match v {
                Value::String(s) => ArgValue::Str(s.clone()),
                Value::Bool(b) => ArgValue::Bool(*b),
                Value::Number(n) if n.is_i64() => ArgValue::Int(n.as_i64().unwrap_or_default()),
                other => ArgValue::Other(other.to_string()),
            };
            (k.clone(), v)
        })
        .collect()
}

/// A queue's `arguments` object as RabbitMQ's API takes it.
pub(crate) fn queue_args(v: Option<&Value>) -> Result<QueueArgs, String> {
    QueueArgs::parse(&json_args(v))
}

async fn delete_queue(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    caller.may(&node.metadata(), &vhost, Access::Configure, "queue", &name)?;
    node.delete_queue(&key(&vhost, &name)).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Remove a stopped node from the cluster (`rabbitmqctl forget_cluster_node`).
async fn forget_node(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    caller.admin()?;
    node.forget_node(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Move masters of mirrored queues so every node has within one of the
/// others (RabbitMQ answers at once and works in the background; we answer
/// when done, with what moved).
async fn rebalance(State(node): State<Node>, Extension(caller): Extension<Caller>) -> Result<Json<Value>, ApiError> {
    caller.admin()?;
    let moves = node.rebalance().await?;
    let meta = node.metadata();
    let name_of = |id: u64| meta.nodes.get(&id).map(|n| n.name.clone()).unwrap_or_else(|| format!("mirrorq@{id}"));
    let moves: Vec<Value> = moves
        .into_iter()
        .map(|m| {
            let (vhost, queue) = names::split(&m.queue);
            json!({"queue": queue, "vhost": vhost, "from": name_of(m.from), "to": name_of(m.to), "error": m.error})
        })
        .collect();
    Ok(Json(json!({ "moves": moves })))
}

/// `{"action":"sync"}` or `{"action":"cancel_sync"}`: start or stop the
/// catch-up of the queue's unsynchronised mirrors.
async fn queue_action(
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

async fn purge_queue(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    caller.may(&node.metadata(), &vhost, Access::Read, "queue", &name)?;
    node.purge(&key(&vhost, &name)).await?;
    Ok(StatusCode::NO_CONTENT)
}

async fn get_messages(
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

fn exchange_json(e: &ExchangeMeta) -> Value {
    let (vhost, name) = names::split(&e.name);
    json!({"name": name, "vhost": vhost, "type": e.kind.as_str(), "durable": e.durable,
           "auto_delete": e.auto_delete, "internal": e.internal, "arguments": exchange_args_json(e)})
}

/// Every exchange of `vhost`: the built-in ones and those declared there.
fn exchanges_of(meta: &crate::metadata::MetaState, vhost: &str) -> Vec<Value> {
    let builtin = ["", "amq.direct", "amq.fanout", "amq.topic", "amq.headers", "amq.match"];
    builtin
        .iter()
        .filter_map(|n| meta.exchange(&key(vhost, n)))
        .chain(meta.exchanges.values().filter(|e| names::vhost_of(&e.name) == vhost).cloned())
        .map(|e| exchange_json(&e))
        .collect()
}

async fn list_exchanges(State(node): State<Node>, Extension(caller): Extension<Caller>) -> Json<Value> {
    let meta = node.metadata();
    Json(meta.vhosts.keys().filter(|v| caller.sees(&meta, v)).flat_map(|v| exchanges_of(&meta, v)).collect())
}

async fn list_exchanges_in(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let meta = node.metadata();
    caller.read(&meta, &vhost)?;
    Ok(Json(Value::Array(exchanges_of(&meta, &vhost))))
}

async fn get_exchange(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let meta = node.metadata();
    caller.read(&meta, &vhost)?;
    let name = if name == "amq.default" { String::new() } else { name };
    meta.exchange(&key(&vhost, &name)).map(|e| Json(exchange_json(&e))).ok_or_else(ApiError::not_found)
}

/// Body `{"type","durable","auto_delete","internal","arguments"}`, as RabbitMQ.
async fn put_exchange(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    caller.may(&node.metadata(), &vhost, Access::Configure, "exchange", &name)?;
    checked_name("exchange", &name)?;
    if name.is_empty() || name.len() > 255 {
        return Err(ApiError::bad_request("exchange name must be 1 to 255 bytes"));
    }
    let b = parse_body(&body)?;
    let kind = match b.get("type") {
        Some(Value::String(t)) => ExchangeKind::parse(t).ok_or_else(|| {
            ApiError::bad_request(format!("unknown exchange type '{t}': direct, fanout, topic or headers"))
        })?,
        Some(_) => return Err(ApiError::bad_request("type must be a string")),
        None => return Err(ApiError::bad_request("type is required")),
    };
    let flag = |k: &str, default: bool| bool_field(&b, k, default);
    let alternate = match b.get("arguments").and_then(|a| a.get("alternate-exchange")) {
        None | Some(Value::Null) => None,
        Some(Value::String(alt)) => {
            // As RabbitMQ: unroutable messages are written there.
            caller.may(&node.metadata(), &vhost, Access::Write, "exchange", alt)?;
            caller.may(&node.metadata(), &vhost, Access::Read, "exchange", &name)?;
            Some(key(&vhost, alt))
        }
        Some(_) => return Err(ApiError::bad_request("arguments.alternate-exchange must be a string")),
    };
    let ex = ExchangeMeta {
        name: key(&vhost, &name),
        kind,
        durable: flag("durable", true)?,
        auto_delete: flag("auto_delete", false)?,
        internal: flag("internal", false)?,
        alternate,
        args: json_args(b.get("arguments")),
    };
    let existed = node.metadata().exchange(&ex.name).is_some();
    node.declare_exchange(ex).await?;
    Ok(put_status(!existed))
}

async fn delete_exchange(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    caller.may(&node.metadata(), &vhost, Access::Configure, "exchange", &name)?;
    node.delete_exchange(&key(&vhost, &name), false).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// How RabbitMQ names a binding in its API's paths (its "properties
/// key"): `~` for an empty routing key without arguments, else the routing
/// key form-encoded (so a `/` or `~` in it cannot break a path), and with
/// arguments `~` and a digest of them, so bindings that differ only in
/// their arguments have keys of their own.
fn properties_key(b: &Binding) -> String {
    if b.routing_key.is_empty() && b.args.is_empty() {
        return "~".into();
    }
    let mut key: String = form_urlencoded::byte_serialize(b.routing_key.as_bytes()).collect();
    if !b.args.is_empty() {
        use sha2::Digest;
        let digest = sha2::Sha256::digest(crate::metadata::routing::args_json(&b.args).to_string().as_bytes());
        key.push('~');
        key.extend(digest[..6].iter().map(|byte| format!("{byte:02x}")));
    }
    key
}

/// One segment of an API path, percent-encoded.
fn path_segment(s: &str) -> String {
    percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
}

fn binding_json(b: &Binding) -> Value {
    let (vhost, source) = names::split(&b.exchange);
    let kind = if b.to_exchange { "exchange" } else { "queue" };
    json!({"source": source, "vhost": vhost, "destination": names::name_of(&b.destination), "destination_type": kind,
           "routing_key": b.routing_key, "arguments": crate::metadata::routing::args_json(&b.args), "properties_key": properties_key(b)})
}

/// A binding's place in the API's paths: its source, and its destination
/// with its kind (`/q/` or `/e/`).
struct Ends {
    vhost: String,
    source: String,
    destination: String,
    to_exchange: bool,
}

impl Ends {
    fn of(to_exchange: bool, (vhost, source, destination): (String, String, String)) -> Self {
        Self { vhost, source, destination, to_exchange }
    }

    fn kind(&self) -> &'static str {
        if self.to_exchange {
            "exchange"
        } else {
            "queue"
        }
    }

    /// Its bindings (those `props` names, if given).
    fn bindings(&self, meta: &crate::metadata::MetaState, props: Option<&str>) -> Vec<Binding> {
        let (e, d) = (key(&self.vhost, &self.source), key(&self.vhost, &self.destination));
        meta.bindings
            .iter()
            .filter(|b| b.exchange == e && b.destination == d && b.to_exchange == self.to_exchange)
            .filter(|b| props.is_none_or(|p| properties_key(b) == p))
            .cloned()
            .collect()
    }

    /// As RabbitMQ: binding needs write on the destination, read on the source.
    fn may_bind(&self, caller: &Caller, meta: &crate::metadata::MetaState) -> Result<(), ApiError> {
        caller.may(meta, &self.vhost, Access::Write, self.kind(), &self.destination)?;
        caller.may(meta, &self.vhost, Access::Read, "exchange", &self.source)
    }
}

/// `GET /api/bindings/{vhost}/e/{exchange}/q/{queue}/{props}`.
async fn get_binding(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, exchange, queue, props)): Path<(String, String, String, String)>,
) -> Result<Json<Value>, ApiError> {
    one_binding(&node, &caller, Ends::of(false, (vhost, exchange, queue)), &props)
}

/// `GET /api/bindings/{vhost}/e/{exchange}/e/{destination}/{props}`.
async fn get_exchange_binding(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, exchange, destination, props)): Path<(String, String, String, String)>,
) -> Result<Json<Value>, ApiError> {
    one_binding(&node, &caller, Ends::of(true, (vhost, exchange, destination)), &props)
}

fn one_binding(node: &Node, caller: &Caller, ends: Ends, props: &str) -> Result<Json<Value>, ApiError> {
    let meta = node.metadata();
    caller.read(&meta, &ends.vhost)?;
    let found = ends.bindings(&meta, Some(props));
    found.first().map(|b| Json(binding_json(b))).ok_or_else(ApiError::not_found)
}

/// `DELETE /api/bindings/{vhost}/e/{exchange}/q/{queue}/{props}`, as
/// RabbitMQ: the binding its properties key names (`~`: the empty routing key).
async fn unbind(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, exchange, queue, props)): Path<(String, String, String, String)>,
) -> Result<StatusCode, ApiError> {
    unbind_named(&node, &caller, Ends::of(false, (vhost, exchange, queue)), &props).await
}

/// `DELETE /api/bindings/{vhost}/e/{exchange}/e/{destination}/{props}`.
async fn unbind_exchange(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, exchange, destination, props)): Path<(String, String, String, String)>,
) -> Result<StatusCode, ApiError> {
    unbind_named(&node, &caller, Ends::of(true, (vhost, exchange, destination)), &props).await
}

async fn unbind_named(node: &Node, caller: &Caller, ends: Ends, props: &str) -> Result<StatusCode, ApiError> {
    let meta = node.metadata();
    ends.may_bind(caller, &meta)?;
    let found = ends.bindings(&meta, Some(props));
    if found.is_empty() {
        return Err(ApiError::not_found());
    }
    for b in found {
        node.unbind(b).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

async fn list_bindings(State(node): State<Node>, Extension(caller): Extension<Caller>) -> Json<Value> {
    let meta = node.metadata();
    Json(meta.bindings.iter().filter(|b| caller.sees_key(&meta, &b.exchange)).map(binding_json).collect())
}

async fn list_bindings_in(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let meta = node.metadata();
    caller.read(&meta, &vhost)?;
    Ok(Json(meta.bindings.iter().filter(|b| names::vhost_of(&b.exchange) == vhost).map(binding_json).collect()))
}

async fn queue_bindings(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, exchange, queue)): Path<(String, String, String)>,
) -> Result<Json<Value>, ApiError> {
    let meta = node.metadata();
    caller.read(&meta, &vhost)?;
    Ok(Json(Ends::of(false, (vhost, exchange, queue)).bindings(&meta, None).iter().map(binding_json).collect()))
}

async fn exchange_bindings(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, exchange, destination)): Path<(String, String, String)>,
) -> Result<Json<Value>, ApiError> {
    let meta = node.metadata();
    caller.read(&meta, &vhost)?;
    let ends = Ends::of(true, (vhost, exchange, destination));
    Ok(Json(ends.bindings(&meta, None).iter().map(binding_json).collect()))
}

/// Body `{"routing_key","arguments"}`; answers 201, as RabbitMQ.
async fn bind(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, exchange, queue)): Path<(String, String, String)>,
    body: Bytes,
) -> Result<Response, ApiError> {
    bind_ends(&node, &caller, Ends::of(false, (vhost, exchange, queue)), &body).await
}

/// Body `{"routing_key","arguments"}`; answers 201, as RabbitMQ.
async fn bind_exchange(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, exchange, destination)): Path<(String, String, String)>,
    body: Bytes,
) -> Result<Response, ApiError> {
    bind_ends(&node, &caller, Ends::of(true, (vhost, exchange, destination)), &body).await
}

async fn bind_ends(node: &Node, caller: &Caller, ends: Ends, body: &Bytes) -> Result<Response, ApiError> {
    ends.may_bind(caller, &node.metadata())?;
    let b = parse_body(body)?;
    let routing_key = match b.get("routing_key") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(ApiError::bad_request("routing_key must be a string")),
    };
    if b.get("arguments").is_some_and(|v| !v.is_object() && !v.is_null()) {
        return Err(ApiError::bad_request("arguments must be an object"));
    }
    let args = json_args(b.get("arguments"));
    let binding = Binding {
        exchange: key(&ends.vhost, &ends.source),
        destination: key(&ends.vhost, &ends.destination),
        to_exchange: ends.to_exchange,
        routing_key,
        args,
    };
    // As RabbitMQ: where the new binding is, its properties key last
    // (Terraform's provider reads the key from here).
    let location = format!(
        "/api/bindings/{}/e/{}/{}/{}/{}",
        path_segment(&ends.vhost),
        path_segment(&ends.source),
        if ends.to_exchange { "e" } else { "q" },
        path_segment(&ends.destination),
        path_segment(&properties_key(&binding)),
    );
    node.bind(binding).await?;
    Ok((StatusCode::CREATED, [(header::LOCATION, location)]).into_response())
}

async fn publish(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, exchange)): Path<(String, String)>,
    body: Bytes,
) -> Result<Json<Value>, ApiError> {
    let exchange = if exchange == "amq.default" { String::new() } else { exchange };
    caller.may(&node.metadata(), &vhost, Access::Write, "exchange", &exchange)?;
    // What AMQP publishers are held back for (connection.blocked), an HTTP
    // publish is refused for, with the reason, rather than held.
    if let Some(why) = node.alarms().readings().reason() {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "service_unavailable",
            format!("resource alarm in effect on {}: {why}; publishing is blocked", node.name()),
        ));
    }
    let b = parse_body(&body)?;
    let routing_key = match b.get("routing_key") {
        Some(Value::String(s)) => s.clone(),
        _ => return Err(ApiError::bad_request("routing_key must be a string")),
    };
    let payload = match b.get("payload") {
        Some(Value::String(s)) => s.clone(),
        _ => return Err(ApiError::bad_request("payload must be a string")),
    };
    let body = match b.get("payload_encoding").and_then(Value::as_str) {
        Some("string") | None => payload.into_bytes(),
        Some("base64") => base64::engine::general_purpose::STANDARD
            .decode(payload)
            .map_err(|e| ApiError::bad_request(format!("payload is not base64: {e}")))?,
        Some(other) => return Err(ApiError::bad_request(format!("unknown payload_encoding '{other}'"))),
    };
    let properties = props::from_json(b.get("properties").unwrap_or(&Value::Null)).map_err(ApiError::bad_request)?;
    let headers = props::header_args(&properties);
    let ttl = crate::message::expiration_ms(&properties).map_err(ApiError::bad_request)?;
    let received = std::time::Instant::now();
    node.metrics().received.inc();
    let Some(queues) = node.route_fresh(&key(&vhost, &exchange), &routing_key, &headers).await else {
        return Err(ApiError::not_found());
    };
    if queues.is_empty() {
        return Ok(Json(json!({"routed": false})));
    }
    let msg = Message {
        exchange: exchange.clone(),
        routing_key,
        properties: crate::message::encode_properties(&properties),
        body,
    };
    // Answer only after every queue it reached has confirmed it (CONTRACT 6).
    let mut waits = Vec::new();
    for q in &queues {
        waits.push(node.submit(q, vec![QueueCmd::enqueue(vec![msg.clone()], vec![ttl])]).await?);
    }
    for (w, q) in waits.into_iter().zip(&queues) {
        crate::node::stored_all(q, &w.await?)?;
    }
    node.metrics().confirmed.inc();
    node.metrics().confirm_latency.observe(received.elapsed().as_secs_f64());
    Ok(Json(json!({"routed": true})))
}

fn split_peer(peer: &str) -> (String, u16) {
    match peer.rsplit_once(':') {
        Some((h, p)) => (h.to_string(), p.parse().unwrap_or(0)),
        None => (peer.to_string(), 0),
    }
}

/// Monitoring users see every client; others their own (as RabbitMQ).
fn own(caller: &Caller, user: &str) -> bool {
    caller.0.is_monitoring() || caller.name() == user
}

async fn list_connections(State(node): State<Node>, Extension(caller): Extension<Caller>) -> Json<Value> {
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
async fn close_connection(
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

async fn list_channels(State(node): State<Node>, Extension(caller): Extension<Caller>) -> Json<Value> {
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

async fn list_consumers(State(node): State<Node>, Extension(caller): Extension<Caller>) -> Json<Value> {
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
