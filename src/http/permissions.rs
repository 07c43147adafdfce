//! Permissions (`/api/permissions`, and per user and per vhost), with
//! RabbitMQ's field names.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use serde_json::{json, Value};

use super::access::Caller;
use super::{parse_body, put_status, ApiError};
use crate::metadata::{MetaCmd, Permission};
use crate::node::Node;

pub fn permission_json(p: &Permission) -> Value {
    json!({"user": p.user, "vhost": p.vhost, "configure": p.configure, "write": p.write, "read": p.read})
}

fn all_permissions(node: &Node) -> Vec<Permission> {
    node.metadata().permissions.values().flat_map(|users| users.values().cloned()).collect()
}

pub async fn list_permissions(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<Value>, ApiError> {
    caller.admin()?;
    Ok(Json(all_permissions(&node).iter().map(permission_json).collect()))
}

pub async fn vhost_permissions(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
) -> Result<Json<Value>, ApiError> {
    caller.admin()?;
    if !node.metadata().vhosts.contains_key(&vhost) {
        return Err(ApiError::not_found());
    }
    Ok(Json(all_permissions(&node).iter().filter(|p| p.vhost == vhost).map(permission_json).collect()))
}

pub async fn user_permissions(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(user): Path<String>,
) -> Result<Json<Value>, ApiError> {
    caller.admin()?;
    if !node.metadata().users.contains_key(&user) {
        return Err(ApiError::not_found());
    }
    Ok(Json(all_permissions(&node).iter().filter(|p| p.user == user).map(permission_json).collect()))
}

pub async fn get_permission(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, user)): Path<(String, String)>,
) -> Result<Json<Value>, ApiError> {
    caller.admin()?;
    node.metadata().permission(&user, &vhost).map(|p| Json(permission_json(p))).ok_or_else(ApiError::not_found)
}

pub fn permission_from(vhost: &str, user: &str, b: &serde_json::Map<String, Value>) -> Result<Permission, ApiError> {
    let pattern = |k: &str| match b.get(k) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(_) => Err(ApiError::bad_request(format!("{k} must be a string"))),
        None => Err(ApiError::bad_request(format!("{k} is required"))),
    };
    let p = Permission {
        user: user.into(),
        vhost: vhost.into(),
        configure: pattern("configure")?,
        write: pattern("write")?,
        read: pattern("read")?,
    };
    p.validate().map_err(ApiError::bad_request)?;
    Ok(p)
}

pub async fn put_permission(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, user)): Path<(String, String)>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    caller.admin()?;
    let p = permission_from(&vhost, &user, &parse_body(&body)?)?;
    let meta = node.metadata();
    if !meta.vhosts.contains_key(&vhost) || !meta.users.contains_key(&user) {
        return Err(ApiError::bad_request("vhost_or_user_not_found"));
    }
    let created = node.meta_change(MetaCmd::SetPermission(p), String::new).await?;
    Ok(put_status(created))
}

pub async fn delete_permission(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, user)): Path<(String, String)>,
) -> Result<StatusCode, ApiError> {
    caller.admin()?;
    node.meta_change(MetaCmd::ClearPermission { vhost: vhost.clone(), user: user.clone() }, || {
        format!("no permission for user '{user}' in vhost '{vhost}'")
    })
    .await?;
    Ok(StatusCode::NO_CONTENT)
}
