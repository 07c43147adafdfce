//! Users (`/api/users`, `/api/whoami`), with RabbitMQ's field names.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::{Extension, Json};
use serde_json::{json, Value};

use super::access::Caller;
use super::{parse_body, put_status, ApiError};
use crate::metadata::access::{hash_password, parse_tags, Hashing};
use crate::metadata::{MetaCmd, User};
use crate::node::Node;

pub fn user_json(u: &User) -> Value {
    json!({"name": u.name, "password_hash": u.password_hash, "hashing_algorithm": u.hashing.as_str(),
           "tags": u.tags, "limits": {}})
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
