//! Policies (`/api/policies`), so operators set mirroring and other settings by pattern, not queue by queue.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use serde_json::{json, Value};

use super::access::Caller;
use super::{checked_name, parse_body, put_status, ApiError};
use crate::metadata::names::{self, key};
use crate::metadata::{policy, ApplyTo, Policy};
use crate::node::Node;

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

pub(super) async fn list_policies(State(node): State<Node>, Extension(caller): Extension<Caller>) -> Json<Value> {
    let meta = node.metadata();
    Json(meta.policies.values().filter(|p| caller.sees_key(&meta, &p.name)).map(policy_json).collect())
}

pub(super) async fn list_policies_in(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let meta = node.metadata();
    caller.read(&meta, &vhost)?;
    Ok(Json(meta.policies.values().filter(|p| names::vhost_of(&p.name) == vhost).map(policy_json).collect()))
}

pub(super) async fn get_policy(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    let meta = node.metadata();
    caller.read(&meta, &vhost)?;
    meta.policies.get(&key(&vhost, &name)).map(|p| Json(policy_json(p))).ok_or_else(ApiError::not_found)
}

pub(super) async fn put_policy(
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

pub(super) async fn delete_policy(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, name)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    caller.policies(&node.metadata(), &vhost)?;
    node.clear_policy(&key(&vhost, &name)).await?;
    Ok(StatusCode::NO_CONTENT)
}
