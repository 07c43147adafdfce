//! Who is calling the management API and what they may see and change, as
//! RabbitMQ's management plugin decides it from user tags and vhost
//! permissions:
//!
//! - any of `administrator`, `monitoring`, `policymaker`, `management` may
//!   log in (others: 401, as RabbitMQ's "Not management user");
//! - `administrator` does everything in every vhost, and alone manages
//!   users, vhosts, permissions, definitions, nodes and rebalancing;
//! - `monitoring` also reads every vhost;
//! - everyone else sees and works in the vhosts they have a permission in,
//!   within its configure/write/read patterns; `policymaker` may also change
//!   policies there.
//!
//! A refusal is 401 `not_authorised`, as RabbitMQ answers it.

use std::net::SocketAddr;

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use base64::Engine;

use super::ApiError;
use crate::metadata::{names, Access, MetaState, User};
use crate::node::Node;

/// The logged-in user, put on every request by [`auth`].
#[derive(Clone)]
pub struct Caller(pub User);

fn refused(reason: impl Into<String>) -> ApiError {
    ApiError::new(StatusCode::UNAUTHORIZED, "not_authorised", reason)
}

/// HTTP basic auth against the cluster's users; `guest` from loopback only.
pub async fn auth(State(node): State<Node>, mut req: Request, next: Next) -> Response {
    let loopback = req.extensions().get::<ConnectInfo<SocketAddr>>().map(|c| c.0.ip().is_loopback()).unwrap_or(true);
    let creds = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Basic "))
        .and_then(|b| base64::engine::general_purpose::STANDARD.decode(b).ok())
        .and_then(|c| String::from_utf8(c).ok());
    let user = creds.as_deref().and_then(|c| c.split_once(':')).and_then(|(name, password)| {
        let meta = node.metadata();
        meta.users.get(name).filter(|u| u.password_matches(password)).cloned()
    });
    let refusal = match &user {
        None => Some("Login failed"),
        Some(u) if u.name == "guest" && !loopback => Some("User can only log in via localhost"),
        Some(u) if !u.is_management() => Some("Not management user"),
        Some(_) => None,
    };
    if let Some(why) = refusal {
        let mut r = refused(why).into_response();
        r.headers_mut().insert(header::WWW_AUTHENTICATE, "Basic realm=\"RabbitMQ Management\"".parse().unwrap());
        return r;
    }
    req.extensions_mut().insert(Caller(user.expect("checked above")));
    next.run(req).await
}

impl Caller {
    pub fn name(&self) -> &str {
        &self.0.name
    }

    pub fn admin(&self) -> Result<(), ApiError> {
        if self.0.is_admin() {
            Ok(())
        } else {
            Err(refused("Not administrator user"))
        }
    }

    /// May see what is in `vhost`.
    pub fn sees(&self, meta: &MetaState, vhost: &str) -> bool {
        self.0.is_monitoring() || meta.permission(&self.0.name, vhost).is_some()
    }

    /// The vhost exists (404) and the caller may read in it (401).
    pub fn read(&self, meta: &MetaState, vhost: &str) -> Result<(), ApiError> {
        if !meta.vhosts.contains_key(vhost) {
            return Err(ApiError::not_found());
        }
        if self.sees(meta, vhost) {
            Ok(())
        } else {
            Err(self.no_vhost(vhost))
        }
    }

    /// The vhost exists and the caller may have `access` to the queue or
    /// exchange `name` in it.
    pub fn may(&self, meta: &MetaState, vhost: &str, access: Access, kind: &str, name: &str) -> Result<(), ApiError> {
        if !meta.vhosts.contains_key(vhost) {
            return Err(ApiError::not_found());
        }
        if self.0.is_admin() {
            return Ok(());
        }
        match meta.permission(&self.0.name, vhost) {
            None => Err(self.no_vhost(vhost)),
            Some(p) if p.allows(access, name) => Ok(()),
            Some(_) => Err(refused(format!(
                "{} access to {kind} '{name}' in vhost '{vhost}' refused for user '{}'",
                access.as_str(),
                self.0.name
            ))),
        }
    }

    /// May change policies in `vhost`.
    pub fn policies(&self, meta: &MetaState, vhost: &str) -> Result<(), ApiError> {
        self.read(meta, vhost)?;
        if self.0.is_admin() || (self.0.is_policymaker() && meta.permission(&self.0.name, vhost).is_some()) {
            Ok(())
        } else {
            Err(refused("Not policymaker user"))
        }
    }

    /// Keys of objects the caller may see.
    pub fn sees_key(&self, meta: &MetaState, key: &str) -> bool {
        self.sees(meta, names::vhost_of(key))
    }

    fn no_vhost(&self, vhost: &str) -> ApiError {
        refused(format!("access to vhost '{vhost}' refused for user '{}'", self.0.name))
    }
}
