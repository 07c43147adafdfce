//! Users, vhosts and permissions (`/api/users`, `/api/vhosts`,
//! `/api/permissions`, `/api/whoami`), with RabbitMQ's field names.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use serde_json::{json, Value};

use super::access::Caller;
use super::{parse_body, put_status, ApiError};
use crate::metadata::access::{hash_password, parse_tags, Hashing};
use crate::metadata::{names, MetaCmd, Permission, User, Vhost};
use crate::node::Node;

pub fn user_json(u: &User) -> Value {
    json!({"name": u.name, "password_hash": u.password_hash, "hashing_algorithm": u.hashing.as_str(),
           "tags": u.tags, "limits": {}})
}

pub fn vhost_json(v: &Vhost) -> Value {
    json!({"name": v.name, "description": v.description, "tags": v.tags,
           "metadata": {"description": v.description, "tags": v.tags}, "tracing": false})
}

pub fn permission_json(p: &Permission) -> Value {
    json!({"user": p.user, "vhost": p.vhost, "configure": p.configure, "write": p.write, "read": p.read})
}

pub async fn whoami(Extension(caller): Extension<Caller>) -> Json<Value> {
    Json(json!({"name": caller.0.name, "tags": caller.0.tags}))
}

pub async fn list_users(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<Value>, ApiError> {
    caller.admin()?;
    Ok(Json(node.metadata().users.values().map(user_json).collect()))
}

pub async fn get_user(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    caller.admin()?;
    node.metadata().users.get(&name).map(|u| Json(user_json(u))).ok_or_else(ApiError::not_found)
}

/// A user from RabbitMQ's JSON: `password` (hashed here), or
/// `password_hash` with `hashing_algorithm`, or neither (no password login).
pub fn user_from(name: &str, b: &serde_json::Map<String, Value>) -> Result<User, ApiError> {
    if name.is_empty() {
        return Err(ApiError::bad_request("user name is empty"));
    }
    let tags = parse_tags(b.get("tags").unwrap_or(&Value::Null)).map_err(ApiError::bad_request)?;
    let hashing = match b.get("hashing_algorithm") {
        None | Some(Value::Null) => Hashing::Sha256,
        Some(Value::String(s)) => Hashing::parse(s).map_err(ApiError::bad_request)?,
        Some(_) => return Err(ApiError::bad_request("hashing_algorithm must be a string")),
    };
    match (b.get("password"), b.get("password_hash")) {
        (Some(_), Some(_)) => Err(ApiError::bad_request("give password or password_hash, not both")),
        (Some(Value::String(pw)), None) => {
            let salt: [u8; 4] = rand::random();
            Ok(User { name: name.into(), password_hash: hash_password(hashing, salt, pw), hashing, tags })
        }
        (Some(_), None) => Err(ApiError::bad_request("password must be a string")),
        (None, Some(Value::String(h))) => {
            let user = User { name: name.into(), password_hash: h.clone(), hashing, tags };
            let decoded = base64::Engine::decode(&base64::engine::general_purpose::STANDARD, h);
            if !h.is_empty() && decoded.map_or(true, |d| d.len() < 5) {
                return Err(ApiError::bad_request("password_hash must be base64 of a salt and a digest"));
            }
            Ok(user)
        }
        (None, Some(_)) => Err(ApiError::bad_request("password_hash must be a string")),
        (None, None) => Ok(User { name: name.into(), password_hash: String::new(), hashing, tags }),
    }
}

pub async fn put_user(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
    body: Bytes,
) -> Result<StatusCode, ApiError> {
    caller.admin()?;
    let user = user_from(&name, &parse_body(&body)?)?;
    let created = node.meta_change(MetaCmd::PutUser(user), String::new).await?;
    Ok(put_status(created))
}

pub async fn delete_user(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Result<StatusCode, ApiError> {
    caller.admin()?;
    node.meta_change(MetaCmd::DeleteUser { name: name.clone() }, || format!("no user '{name}'")).await?;
    Ok(StatusCode::NO_CONTENT)
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
