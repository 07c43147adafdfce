//! Vhosts and their limits (`/api/vhosts`, `/api/vhost-limits`), with
//! RabbitMQ's field names.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use serde_json::{json, Value};

use super::access::Caller;
use super::{parse_body, put_status, ApiError};
use crate::metadata::access::parse_tags;
use crate::metadata::{names, MetaCmd, Vhost};
use crate::node::Node;

pub fn vhost_json(v: &Vhost) -> Value {
    json!({"name": v.name, "description": v.description, "tags": v.tags,
           "metadata": {"description": v.description, "tags": v.tags}, "tracing": false})
}

pub async fn list_vhosts(State(node): State<Node>, Extension(caller): Extension<Caller>) -> Json<Value> {
    let meta = node.metadata();
    Json(meta.vhosts.values().filter(|v| caller.sees(&meta, &v.name)).map(vhost_json).collect())
}

pub async fn get_vhost(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let meta = node.metadata();
    caller.read(&meta, &name)?;
    Ok(Json(vhost_json(&meta.vhosts[&name])))
}

pub fn vhost_from(name: &str, b: &serde_json::Map<String, Value>) -> Result<Vhost, ApiError> {
    if name.is_empty() {
        return Err(ApiError::bad_request("vhost name is empty"));
    }
    names::check("vhost", name).map_err(ApiError::bad_request)?;
    let meta = b.get("metadata");
    let field = |k: &str| b.get(k).or_else(|| meta.and_then(|m| m.get(k)));
    let description = match field("description") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(ApiError::bad_request("description must be a string")),
    };
    let tags = parse_tags(field("tags").unwrap_or(&Value::Null)).map_err(ApiError::bad_request)?;
    match field("tracing") {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {}
        Some(Value::Bool(true)) => return Err(ApiError::bad_request("message tracing is not supported by mirrorq")),
        Some(_) => return Err(ApiError::bad_request("tracing must be a boolean")),
    }
    Ok(Vhost { name: name.into(), description, tags })
}

pub async fn put_vhost(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    caller.admin()?;
    let vhost = vhost_from(&name, &parse_body(&body)?)?;
    let created = node.meta_change(MetaCmd::PutVhost(vhost), String::new).await?;
    Ok(put_status(created))
}

/// Vhost limits (`max-connections`, `max-queues`): none are set, as none
/// can be; tools that read them (Terraform's provider reads them with each
/// vhost) see an empty list, as RabbitMQ answers for a vhost without limits.
pub async fn list_vhost_limits(Extension(caller): Extension<Caller>) -> Result<Json<Value>, ApiError> {
    caller.admin()?;
    Ok(Json(json!([])))
}

pub async fn vhost_limits(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    caller.admin()?;
    if !node.metadata().vhosts.contains_key(&name) {
        return Err(ApiError::not_found());
    }
    Ok(Json(json!([])))
}

/// Setting a limit is refused with the reason, rather than stored and not
/// enforced.
pub async fn put_vhost_limit(
    Extension(caller): Extension<Caller>,
    Path((_, limit)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    caller.admin()?;
    Err(ApiError::bad_request(format!("vhost limit '{limit}' is not supported by mirrorq")))
}

/// Clearing a limit that is not set succeeds, as RabbitMQ's does.
pub async fn delete_vhost_limit(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((name, _)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    caller.admin()?;
    if !node.metadata().vhosts.contains_key(&name) {
        return Err(ApiError::not_found());
    }
    Ok(StatusCode::NO_CONTENT)
}

/// Deletes the vhost and everything in it, as RabbitMQ does.
pub async fn delete_vhost(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    caller.admin()?;
    node.meta_change(MetaCmd::DeleteVhost { name: name.clone() }, || format!("no vhost '{name}'")).await?;
    Ok(StatusCode::NO_CONTENT)
}
