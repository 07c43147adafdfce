//! Metadata operations of the library API: policies, exchanges, bindings,
//! routing, and finding a queue.

use super::Node;
use crate::error::NodeError;
use crate::metadata::{routing, Args, Binding, ExchangeMeta, MetaCmd, MetaReply, Policy, QueueMeta};

pub(super) fn meta_result(reply: MetaReply, not_found: impl FnOnce() -> String) -> Result<(), NodeError> {
    match reply {
        MetaReply::Ok | MetaReply::Created | MetaReply::Queue(_) | MetaReply::NewQueue(_) => Ok(()),
        MetaReply::NotFound => Err(NodeError::NotFound(not_found())),
        MetaReply::Invalid(why) => Err(NodeError::Invalid(why)),
        MetaReply::Conflict(why) => Err(NodeError::Conflict(why)),
        MetaReply::Refused(why) => Err(NodeError::Refused(why)),
    }
}

impl Node {
    /// Add or replace a policy; queues it matches are re-placed. `true`
    /// when the policy is new.
    pub async fn set_policy(&self, p: Policy) -> Result<bool, NodeError> {
        let name = p.name.clone();
        let reply = self.meta_write(MetaCmd::SetPolicy(p)).await?;
        let created = reply == MetaReply::Created;
        meta_result(reply, || format!("policy '{name}'")).map(|_| created)
    }

    pub async fn clear_policy(&self, name: &str) -> Result<(), NodeError> {
        let (vhost, bare) = crate::metadata::names::split(name);
        meta_result(self.meta_write(MetaCmd::ClearPolicy { name: name.to_string() }).await?, || {
            format!("no policy '{bare}' in vhost '{vhost}'")
        })
    }

    /// A change to users, vhosts or permissions; `true` when it made
    /// something new.
    pub async fn meta_change(&self, cmd: MetaCmd, not_found: impl FnOnce() -> String) -> Result<bool, NodeError> {
        let reply = self.meta_write(cmd).await?;
        let created = reply == MetaReply::Created;
        meta_result(reply, not_found).map(|_| created)
    }

    /// Declare an exchange (idempotent for the same type).
    pub async fn declare_exchange(&self, ex: ExchangeMeta) -> Result<(), NodeError> {
        let name = ex.name.clone();
        meta_result(self.meta_write(MetaCmd::DeclareExchange(ex)).await?, || format!("exchange '{name}'"))
    }

    pub async fn delete_exchange(&self, name: &str, if_unused: bool) -> Result<(), NodeError> {
        meta_result(self.meta_write(MetaCmd::DeleteExchange { name: name.to_string(), if_unused }).await?, || {
            format!("no exchange '{name}' in vhost '/'")
        })
    }

    pub async fn bind(&self, b: Binding) -> Result<(), NodeError> {
        let kind = if b.to_exchange { "exchange" } else { "queue" };
        let what = format!("no exchange '{}' or {kind} '{}' in vhost '/'", b.exchange, b.destination);
        meta_result(self.meta_write(MetaCmd::Bind(b)).await?, || what)
    }

    pub async fn unbind(&self, b: Binding) -> Result<(), NodeError> {
        meta_result(self.meta_write(MetaCmd::Unbind(b)).await?, || "binding".into())
    }

    /// The queues a message reaches, decided from the local metadata.
    /// `None`: no such exchange.
    pub fn route(&self, exchange: &str, routing_key: &str, headers: &Args) -> Option<Vec<String>> {
        let meta = self.metadata();
        let queues = |q: &str| meta.queues.contains_key(q);
        let alternate = |ex: &ExchangeMeta| meta.alternate_of(ex);
        routing::route(&meta.exchanges, &meta.bindings, &queues, &alternate, exchange, routing_key, headers)
    }

    /// The queue's metadata, catching up with the leader before saying it
    /// does not exist.
    pub async fn find_queue(&self, name: &str) -> Result<QueueMeta, NodeError> {
        if let Some(q) = self.metadata().queues.get(name) {
            return Ok(q.clone());
        }
        self.meta_barrier().await;
        self.metadata().queues.get(name).cloned().ok_or_else(|| NodeError::NoSuchQueue(name.to_string()))
    }

    /// [`Node::route`], catching up with the metadata leader before calling a
    /// message unroutable or an exchange missing.
    pub async fn route_fresh(&self, exchange: &str, routing_key: &str, headers: &Args) -> Option<Vec<String>> {
        match self.route(exchange, routing_key, headers) {
            Some(q) if !q.is_empty() => Some(q),
            _ => {
                self.meta_barrier().await;
                self.route(exchange, routing_key, headers)
            }
        }
    }
}
