//! `GET/POST /api/definitions` in RabbitMQ's JSON format, so a RabbitMQ
//! export imports (vhost `/` and user `guest`, the only ones mirrorq has).

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use serde_json::{json, Value};

use super::{parse_body, ApiError};
use crate::metadata::{policy, routing, ApplyTo, Binding, ExchangeKind, ExchangeMeta, Policy};
use crate::node::Node;

pub async fn export(State(node): State<Node>) -> Json<Value> {
    let meta = node.metadata();
    Json(json!({
        "product_name": "mirrorq",
        "product_version": env!("CARGO_PKG_VERSION"),
        "rabbit_version": "3.10.8",
        "users": [{"name": "guest", "password_hash": "", "hashing_algorithm": "rabbit_password_hashing_sha256",
                   "tags": ["administrator"], "limits": {}}],
        "vhosts": [{"name": "/", "limits": [], "metadata": {"description": "Default virtual host", "tags": []}}],
        "permissions": [{"user": "guest", "vhost": "/", "configure": ".*", "write": ".*", "read": ".*"}],
        "topic_permissions": [],
        "parameters": [],
        "global_parameters": [],
        "policies": meta.policies.values().map(|p| json!({
            "vhost": "/", "name": p.name, "pattern": p.pattern, "apply-to": p.apply_to.as_str(),
            "priority": p.priority,
            "definition": serde_json::from_str::<Value>(&p.definition).unwrap_or(json!({})),
        })).collect::<Vec<_>>(),
        "queues": meta.queues.values().map(|q| json!({
            "name": q.name, "vhost": "/", "durable": q.durable, "auto_delete": q.auto_delete,
            "arguments": q.args.to_json(),
        })).collect::<Vec<_>>(),
        "exchanges": meta.exchanges.values().map(|e| json!({
            "name": e.name, "vhost": "/", "type": e.kind.as_str(), "durable": e.durable,
            "auto_delete": e.auto_delete, "internal": e.internal, "arguments": {},
        })).collect::<Vec<_>>(),
        "bindings": meta.bindings.iter().map(|b| json!({
            "source": b.exchange, "vhost": "/", "destination": b.queue, "destination_type": "queue",
            "routing_key": b.routing_key, "arguments": {},
        })).collect::<Vec<_>>(),
    }))
}

fn list<'a>(defs: &'a serde_json::Map<String, Value>, key: &str) -> Result<&'a [Value], ApiError> {
    match defs.get(key) {
        None | Some(Value::Null) => Ok(&[]),
        Some(Value::Array(a)) => Ok(a),
        Some(_) => Err(ApiError::bad_request(format!("{key} must be a list"))),
    }
}

fn text<'a>(item: &'a Value, key: &str, what: &str) -> Result<&'a str, ApiError> {
    item.get(key)
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::bad_request(format!("{what}: {key} must be a string")))
}

fn vhost_of(item: &Value, what: &str) -> Result<(), ApiError> {
    match item.get("vhost").and_then(Value::as_str) {
        None | Some("/") => Ok(()),
        Some(v) => Err(ApiError::bad_request(format!("{what}: vhost '{v}' not supported (only '/')"))),
    }
}

/// Import: everything is checked first, then applied (policies, exchanges,
/// queues, bindings), so a bad file changes nothing.
pub async fn import(State(node): State<Node>, body: Bytes) -> Result<StatusCode, ApiError> {
    let defs = parse_body(&body)?;
    for v in list(&defs, "vhosts")? {
        let name = text(v, "name", "vhost")?;
        if name != "/" {
            return Err(ApiError::bad_request(format!("vhost '{name}' not supported (only '/')")));
        }
    }
    for u in list(&defs, "users")? {
        let name = text(u, "name", "user")?;
        if name != "guest" {
            return Err(ApiError::bad_request(format!("user '{name}' not supported (only guest)")));
        }
    }
    let mut policies = Vec::new();
    for p in list(&defs, "policies")? {
        vhost_of(p, "policy")?;
        let def = p
            .get("definition")
            .filter(|d| d.is_object())
            .ok_or_else(|| ApiError::bad_request("policy: definition must be an object"))?;
        let pol = Policy {
            name: text(p, "name", "policy")?.to_string(),
            pattern: text(p, "pattern", "policy")?.to_string(),
            apply_to: ApplyTo::parse(p.get("apply-to").and_then(Value::as_str).unwrap_or("all"))
                .map_err(ApiError::bad_request)?,
            priority: p.get("priority").and_then(Value::as_i64).unwrap_or(0),
            definition: def.to_string(),
        };
        policy::validate(&pol).map_err(|e| ApiError::bad_request(format!("policy {}: {e}", pol.name)))?;
        policies.push(pol);
    }
    let mut exchanges = Vec::new();
    for e in list(&defs, "exchanges")? {
        vhost_of(e, "exchange")?;
        let name = text(e, "name", "exchange")?;
        if routing::builtin(name).is_some() {
            continue;
        }
        let kind = ExchangeKind::parse(text(e, "type", "exchange")?)
            .ok_or_else(|| ApiError::bad_request(format!("exchange {name}: unknown type")))?;
        exchanges.push(ExchangeMeta {
            name: name.to_string(),
            kind,
            durable: e.get("durable").and_then(Value::as_bool).unwrap_or(true),
            auto_delete: e.get("auto_delete").and_then(Value::as_bool).unwrap_or(false),
            internal: e.get("internal").and_then(Value::as_bool).unwrap_or(false),
        });
    }
    let mut queues = Vec::new();
    for q in list(&defs, "queues")? {
        vhost_of(q, "queue")?;
        let name = text(q, "name", "queue")?;
        if name.is_empty() || name.len() > 255 {
            return Err(ApiError::bad_request("queue: name must be 1 to 255 bytes"));
        }
        let args = super::queue_args(q.get("arguments"))
            .map_err(|why| ApiError::bad_request(format!("queue {name}: {why}")))?;
        queues.push((name.to_string(), args));
    }
    let mut bindings = Vec::new();
    for b in list(&defs, "bindings")? {
        vhost_of(b, "binding")?;
        if b.get("destination_type").and_then(Value::as_str).unwrap_or("queue") != "queue" {
            return Err(ApiError::bad_request("binding: exchange-to-exchange bindings are not supported"));
        }
        bindings.push(Binding {
            exchange: text(b, "source", "binding")?.to_string(),
            queue: text(b, "destination", "binding")?.to_string(),
            routing_key: b.get("routing_key").and_then(Value::as_str).unwrap_or("").to_string(),
            args: Default::default(),
        });
    }
    for p in policies {
        node.set_policy(p).await?;
    }
    for e in exchanges {
        node.declare_exchange(e).await?;
    }
    for (q, args) in queues {
        node.declare_queue_with(&q, Vec::new(), crate::node::DeclareOpts { args, ..Default::default() }).await?;
    }
    for b in bindings {
        node.bind(b).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}
