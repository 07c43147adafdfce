//! Exchanges (`/api/exchanges`), and publishing through one, so RabbitMQ's tools can route without an AMQP client.

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use base64::Engine;
use serde_json::{json, Value};
use std::collections::HashMap;

use super::access::Caller;
use super::{
    bool_field, checked_name, exchange_args_json, json_args, parse_body, props, put_status, query_flag, ApiError,
};
use crate::metadata::names::{self, key};
use crate::metadata::{Access, ExchangeKind, ExchangeMeta};
use crate::node::Node;
use crate::queue::{Message, QueueCmd};

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

pub(super) async fn list_exchanges(State(node): State<Node>, Extension(caller): Extension<Caller>) -> Json<Value> {
    let meta = node.metadata();
    Json(meta.vhosts.keys().filter(|v| caller.sees(&meta, v)).flat_map(|v| exchanges_of(&meta, v)).collect())
}

pub(super) async fn list_exchanges_in(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let meta = node.metadata();
    caller.read(&meta, &vhost)?;
    Ok(Json(Value::Array(exchanges_of(&meta, &vhost))))
}

pub(super) async fn get_exchange(
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
pub(super) async fn put_exchange(
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

/// `DELETE /api/exchanges/VHOST/NAME[?if-unused=true]`: as RabbitMQ's,
/// refused while the exchange is the source of a binding.
pub(super) async fn delete_exchange(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
    Query(query): Query<HashMap<String, String>>,
) -> Result<StatusCode, ApiError> {
    caller.may(&node.metadata(), &vhost, Access::Configure, "exchange", &name)?;
    node.delete_exchange(&key(&vhost, &name), query_flag(&query, "if-unused")?).await?;
    Ok(StatusCode::NO_CONTENT)
}

pub(super) async fn publish(
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
