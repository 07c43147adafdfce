//! Bindings (`/api/bindings`), named by RabbitMQ's properties key so its clients find the ones they made.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};

use super::access::Caller;
use super::{json_args, parse_body, ApiError};
use crate::metadata::names::{self, key};
use crate::metadata::{Access, Binding};
use crate::node::Node;

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
pub(super) async fn get_binding(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, exchange, queue, props)): Path<(String, String, String, String)>,
) -> Result<Json<Value>, ApiError> {
    one_binding(&node, &caller, Ends::of(false, (vhost, exchange, queue)), &props)
}

/// `GET /api/bindings/{vhost}/e/{exchange}/e/{destination}/{props}`.
pub(super) async fn get_exchange_binding(
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
pub(super) async fn unbind(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, exchange, queue, props)): Path<(String, String, String, String)>,
) -> Result<StatusCode, ApiError> {
    unbind_named(&node, &caller, Ends::of(false, (vhost, exchange, queue)), &props).await
}

/// `DELETE /api/bindings/{vhost}/e/{exchange}/e/{destination}/{props}`.
pub(super) async fn unbind_exchange(
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

pub(super) async fn list_bindings(State(node): State<Node>, Extension(caller): Extension<Caller>) -> Json<Value> {
    let meta = node.metadata();
    Json(meta.bindings.iter().filter(|b| caller.sees_key(&meta, &b.exchange)).map(binding_json).collect())
}

pub(super) async fn list_bindings_in(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path(vhost): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let meta = node.metadata();
    caller.read(&meta, &vhost)?;
    Ok(Json(meta.bindings.iter().filter(|b| names::vhost_of(&b.exchange) == vhost).map(binding_json).collect()))
}

pub(super) async fn queue_bindings(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, exchange, queue)): Path<(String, String, String)>,
) -> Result<Json<Value>, ApiError> {
    let meta = node.metadata();
    caller.read(&meta, &vhost)?;
    Ok(Json(Ends::of(false, (vhost, exchange, queue)).bindings(&meta, None).iter().map(binding_json).collect()))
}

pub(super) async fn exchange_bindings(
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
pub(super) async fn bind(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
    Path((vhost, exchange, queue)): Path<(String, String, String)>,
    body: Bytes,
) -> Result<Response, ApiError> {
    bind_ends(&node, &caller, Ends::of(false, (vhost, exchange, queue)), &body).await
}

/// Body `{"routing_key","arguments"}`; answers 201, as RabbitMQ.
pub(super) async fn bind_exchange(
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
