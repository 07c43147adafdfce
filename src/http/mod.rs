//! Management HTTP API (RabbitMQ-compatible subset, CONTRACT section 3) on
//! axum. Any node answers for the whole cluster: reads come from the local
//! metadata and the queue masters (over the node link), writes go through
//! the metadata leader or the queue's master.

mod access;
mod bindings;
mod clients;
mod definitions;
mod error;
mod exchanges;
mod nodes;
mod overview;
mod paging;
mod permissions;
mod policies;
mod prometheus;
mod props;
mod queues;
mod users;
mod vhosts;

use std::net::SocketAddr;

use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::Router;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::metadata::names;
use crate::metadata::{ArgValue, Args, ExchangeMeta, QueueArgs};
use crate::node::Node;
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
        .route("/api/overview", get(overview::overview))
        .route("/api/health/checks/alarms", get(overview::health))
        .route("/api/nodes", get(nodes::nodes))
        .route("/api/nodes/{name}", delete(nodes::forget_node))
        .route("/api/policies", get(policies::list_policies))
        .route("/api/policies/{vhost}", get(policies::list_policies_in))
        .route(
            "/api/policies/{vhost}/{name}",
            get(policies::get_policy).put(policies::put_policy).delete(policies::delete_policy),
        )
        .route("/api/queues", get(queues::list_queues))
        .route("/api/queues/{vhost}", get(queues::list_queues_in))
        .route("/api/queues/{vhost}/{name}", get(queues::get_queue).put(queues::put_queue).delete(queues::delete_queue))
        .route("/api/queues/{vhost}/{name}/contents", delete(queues::purge_queue))
        .route("/api/queues/{vhost}/{name}/get", post(queues::get_messages))
        .route("/api/queues/{vhost}/{name}/actions", post(queues::queue_action))
        .route("/api/rebalance/queues", post(overview::rebalance))
        .route("/api/exchanges", get(exchanges::list_exchanges))
        .route("/api/exchanges/{vhost}", get(exchanges::list_exchanges_in))
        .route(
            "/api/exchanges/{vhost}/{name}",
            get(exchanges::get_exchange).put(exchanges::put_exchange).delete(exchanges::delete_exchange),
        )
        .route("/api/exchanges/{vhost}/{name}/publish", post(exchanges::publish))
        .route("/api/bindings", get(bindings::list_bindings))
        .route("/api/bindings/{vhost}", get(bindings::list_bindings_in))
        .route("/api/bindings/{vhost}/e/{exchange}/q/{queue}", get(bindings::queue_bindings).post(bindings::bind))
        .route(
            "/api/bindings/{vhost}/e/{exchange}/q/{queue}/{props}",
            get(bindings::get_binding).delete(bindings::unbind),
        )
        .route(
            "/api/bindings/{vhost}/e/{exchange}/e/{destination}",
            get(bindings::exchange_bindings).post(bindings::bind_exchange),
        )
        .route(
            "/api/bindings/{vhost}/e/{exchange}/e/{destination}/{props}",
            get(bindings::get_exchange_binding).delete(bindings::unbind_exchange),
        )
        .route("/api/whoami", get(users::whoami))
        .route("/api/users", get(users::list_users))
        .route("/api/users/{name}", get(users::get_user).put(users::put_user).delete(users::delete_user))
        .route("/api/users/{name}/permissions", get(permissions::user_permissions))
        .route("/api/vhosts", get(vhosts::list_vhosts))
        .route("/api/vhosts/{name}", get(vhosts::get_vhost).put(vhosts::put_vhost).delete(vhosts::delete_vhost))
        .route("/api/vhosts/{name}/permissions", get(permissions::vhost_permissions))
        .route("/api/vhost-limits", get(vhosts::list_vhost_limits))
        .route("/api/vhost-limits/{name}", get(vhosts::vhost_limits))
        .route("/api/vhost-limits/{name}/{limit}", put(vhosts::put_vhost_limit).delete(vhosts::delete_vhost_limit))
        .route("/api/permissions", get(permissions::list_permissions))
        .route(
            "/api/permissions/{vhost}/{user}",
            get(permissions::get_permission).put(permissions::put_permission).delete(permissions::delete_permission),
        )
        .route("/api/definitions", get(definitions::export).post(definitions::import))
        .route("/api/connections", get(clients::list_connections))
        .route("/api/connections/{name}", delete(clients::close_connection))
        .route("/api/channels", get(clients::list_channels))
        .route("/api/consumers", get(clients::list_consumers))
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
/// A `true`/`false` query parameter (RabbitMQ's `if-unused`, `if-empty`),
/// `false` when absent.
fn query_flag(query: &std::collections::HashMap<String, String>, k: &str) -> Result<bool, ApiError> {
    match query.get(k).map(String::as_str) {
        None | Some("false") => Ok(false),
        Some("true") => Ok(true),
        Some(_) => Err(ApiError::bad_request(format!("{k} must be true or false"))),
    }
}

fn bool_field(b: &serde_json::Map<String, Value>, k: &str, default: bool) -> Result<bool, ApiError> {
    match b.get(k) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(v)) => Ok(*v),
        Some(Value::String(s)) if s == "true" => Ok(true),
        Some(Value::String(s)) if s == "false" => Ok(false),
        Some(_) => Err(ApiError::bad_request(format!("{k} must be true or false"))),
    }
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
