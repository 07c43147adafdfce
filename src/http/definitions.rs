//! `GET/POST /api/definitions` in RabbitMQ's JSON format, so a RabbitMQ
//! export (vhosts, users with their password hashes, permissions, policies,
//! exchanges, queues, bindings) imports, and ours imports into RabbitMQ.

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::{Extension, Json};
use serde_json::{json, Value};

use super::access::Caller;
use super::permissions::{permission_from, permission_json};
use super::users::{user_from, user_json};
use super::vhosts::vhost_from;
use super::{parse_body, ApiError};
use crate::metadata::names::{self, key};
use crate::metadata::{policy, routing, ApplyTo, Binding, ExchangeKind, ExchangeMeta, MetaCmd, Policy};
use crate::node::Node;

pub async fn export(State(node): State<Node>, Extension(caller): Extension<Caller>) -> Result<Json<Value>, ApiError> {
    caller.admin()?;
    let meta = node.metadata();
    let vhost = |k: &str| names::vhost_of(k).to_string();
    Ok(Json(json!({
        "product_name": "mirrorq",
        "product_version": env!("CARGO_PKG_VERSION"),
        "rabbit_version": "3.10.8",
        "users": meta.users.values().map(user_json).collect::<Vec<_>>(),
        "vhosts": meta.vhosts.values().map(|v| json!({
            "name": v.name, "limits": [], "metadata": {"description": v.description, "tags": v.tags},
        })).collect::<Vec<_>>(),
        "permissions": meta.permissions.values().flat_map(|u| u.values()).map(permission_json).collect::<Vec<_>>(),
        "topic_permissions": [],
        "parameters": [],
        "global_parameters": [],
        "policies": meta.policies.values().map(|p| json!({
            "vhost": vhost(&p.name), "name": names::name_of(&p.name), "pattern": p.pattern,
            "apply-to": p.apply_to.as_str(), "priority": p.priority,
            "definition": serde_json::from_str::<Value>(&p.definition).unwrap_or(json!({})),
        })).collect::<Vec<_>>(),
        "queues": meta.queues.values().map(|q| json!({
            "name": names::name_of(&q.name), "vhost": vhost(&q.name), "durable": q.durable,
            "auto_delete": q.auto_delete, "arguments": q.args.to_json(),
        })).collect::<Vec<_>>(),
        "exchanges": meta.exchanges.values().map(|e| json!({
            "name": names::name_of(&e.name), "vhost": vhost(&e.name), "type": e.kind.as_str(), "durable": e.durable,
            "auto_delete": e.auto_delete, "internal": e.internal, "arguments": super::exchange_args_json(e),
        })).collect::<Vec<_>>(),
        "bindings": meta.bindings.iter().map(|b| json!({
            "source": names::name_of(&b.exchange), "vhost": vhost(&b.exchange),
            "destination": names::name_of(&b.destination),
            "destination_type": if b.to_exchange { "exchange" } else { "queue" },
            "routing_key": b.routing_key, "arguments": crate::metadata::routing::args_json(&b.args),
        })).collect::<Vec<_>>(),
    })))
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

fn object<'a>(item: &'a Value, what: &str) -> Result<&'a serde_json::Map<String, Value>, ApiError> {
    item.as_object().ok_or_else(|| ApiError::bad_request(format!("each {what} must be an object")))
}

/// The item's vhost (`/` when it names none), which must exist now or be
/// among the vhosts imported.
fn vhost_of<'a>(item: &'a Value, what: &str, known: &[String]) -> Result<&'a str, ApiError> {
    let v = match item.get("vhost") {
        None | Some(Value::Null) => names::DEFAULT_VHOST,
        Some(Value::String(v)) => v.as_str(),
        Some(_) => return Err(ApiError::bad_request(format!("{what}: vhost must be a string"))),
    };
    if known.iter().any(|k| k == v) {
        Ok(v)
    } else {
        Err(ApiError::bad_request(format!("{what}: vhost '{v}' not found")))
    }
}

/// Import: everything is checked first, then applied (vhosts, users,
/// permissions, policies, exchanges, queues, bindings), so a bad file
/// changes nothing.
pub async fn import(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    caller.admin()?;
    let defs = parse_body(&body)?;
    let meta = node.metadata();
    let mut changes = Vec::new();
    let mut vhosts: Vec<String> = meta.vhosts.keys().cloned().collect();
    for v in list(&defs, "vhosts")? {
        let name = text(v, "name", "vhost")?;
        changes.push(MetaCmd::PutVhost(vhost_from(name, object(v, "vhost")?)?));
        vhosts.push(name.to_string());
    }
    let mut users: Vec<String> = meta.users.keys().cloned().collect();
    for u in list(&defs, "users")? {
        let name = text(u, "name", "user")?;
        changes.push(MetaCmd::PutUser(user_from(name, object(u, "user")?)?));
        users.push(name.to_string());
    }
    for p in list(&defs, "permissions")? {
        let vhost = vhost_of(p, "permission", &vhosts)?;
        let user = text(p, "user", "permission")?;
        if !users.iter().any(|u| u == user) {
            return Err(ApiError::bad_request(format!("permission: user '{user}' not found")));
        }
        changes.push(MetaCmd::SetPermission(permission_from(vhost, user, object(p, "permission")?)?));
    }
    for p in list(&defs, "policies")? {
        changes.push(MetaCmd::SetPolicy(policy_of(p, &vhosts)?));
    }
    let mut exchanges = Vec::new();
    for e in list(&defs, "exchanges")? {
        exchanges.extend(exchange_of(e, &vhosts)?);
    }
    let queues = list(&defs, "queues")?.iter().map(|q| queue_of(q, &vhosts)).collect::<Result<Vec<_>, _>>()?;
    let bindings = list(&defs, "bindings")?.iter().map(|b| binding_of(b, &vhosts)).collect::<Result<Vec<_>, _>>()?;
    for change in changes {
        node.meta_change(change, String::new).await?;
    }
    for e in exchanges {
        node.declare_exchange(e).await?;
    }
    for (q, opts) in queues {
        node.declare_queue_with(&q, Vec::new(), opts).await?;
    }
    for b in bindings {
        node.bind(b).await?;
    }
    Ok(StatusCode::NO_CONTENT)
}

fn policy_of(p: &Value, vhosts: &[String]) -> Result<Policy, ApiError> {
    let vhost = vhost_of(p, "policy", vhosts)?;
    let def = p
        .get("definition")
        .filter(|d| d.is_object())
        .ok_or_else(|| ApiError::bad_request("policy: definition must be an object"))?;
    let name = text(p, "name", "policy")?;
    names::check("policy", name).map_err(ApiError::bad_request)?;
    let pol = Policy {
        name: key(vhost, name),
        pattern: text(p, "pattern", "policy")?.to_string(),
        apply_to: ApplyTo::parse(p.get("apply-to").and_then(Value::as_str).unwrap_or("all"))
            .map_err(ApiError::bad_request)?,
        priority: p.get("priority").and_then(Value::as_i64).unwrap_or(0),
        definition: def.to_string(),
    };
    policy::validate(&pol).map_err(|e| ApiError::bad_request(format!("policy {name}: {e}")))?;
    Ok(pol)
}

/// `None` for a built-in exchange, which is there already.
fn exchange_of(e: &Value, vhosts: &[String]) -> Result<Option<ExchangeMeta>, ApiError> {
    let vhost = vhost_of(e, "exchange", vhosts)?;
    let name = text(e, "name", "exchange")?;
    names::check("exchange", name).map_err(ApiError::bad_request)?;
    if routing::builtin(name).is_some() {
        return Ok(None);
    }
    let kind = ExchangeKind::parse(text(e, "type", "exchange")?)
        .ok_or_else(|| ApiError::bad_request(format!("exchange {name}: unknown type")))?;
    let alternate = match e.get("arguments").and_then(|a| a.get("alternate-exchange")) {
        None | Some(Value::Null) => None,
        Some(Value::String(alt)) => Some(key(vhost, alt)),
        Some(_) => return Err(ApiError::bad_request(format!("exchange {name}: alternate-exchange must be a string"))),
    };
    Ok(Some(ExchangeMeta {
        name: key(vhost, name),
        kind,
        durable: e.get("durable").and_then(Value::as_bool).unwrap_or(true),
        auto_delete: e.get("auto_delete").and_then(Value::as_bool).unwrap_or(false),
        internal: e.get("internal").and_then(Value::as_bool).unwrap_or(false),
        alternate,
        args: super::json_args(e.get("arguments")),
    }))
}

fn queue_of(q: &Value, vhosts: &[String]) -> Result<(String, crate::api::DeclareOpts), ApiError> {
    let vhost = vhost_of(q, "queue", vhosts)?;
    let name = text(q, "name", "queue")?;
    if name.is_empty() || name.len() > 255 {
        return Err(ApiError::bad_request("queue: name must be 1 to 255 bytes"));
    }
    names::check("queue", name).map_err(ApiError::bad_request)?;
    let args =
        super::queue_args(q.get("arguments")).map_err(|why| ApiError::bad_request(format!("queue {name}: {why}")))?;
    let flag = |k: &str, default: bool| q.get(k).and_then(Value::as_bool).unwrap_or(default);
    let opts = crate::api::DeclareOpts {
        args,
        transient: !flag("durable", true),
        auto_delete: flag("auto_delete", false),
        ..Default::default()
    };
    Ok((key(vhost, name), opts))
}

fn binding_of(b: &Value, vhosts: &[String]) -> Result<Binding, ApiError> {
    let vhost = vhost_of(b, "binding", vhosts)?;
    let to_exchange = match b.get("destination_type").and_then(Value::as_str).unwrap_or("queue") {
        "queue" => false,
        "exchange" => true,
        other => return Err(ApiError::bad_request(format!("binding: unknown destination_type '{other}'"))),
    };
    Ok(Binding {
        exchange: key(vhost, text(b, "source", "binding")?),
        destination: key(vhost, text(b, "destination", "binding")?),
        to_exchange,
        routing_key: b.get("routing_key").and_then(Value::as_str).unwrap_or("").to_string(),
        args: super::json_args(b.get("arguments")),
    })
}
