//! Queue expiry (`x-expires`, or a policy's `expires`): a queue unused for
//! that long is deleted, as RabbitMQ deletes it.
//!
//! Unused as RabbitMQ counts it: no consumer, no `basic.get`, not declared
//! again; publishing to it does not count. Gets, consumers' gets, acks and
//! registrations go through the queue's master, and a declare asks the
//! master for its view ([`Inner::declared_here`]): the master notes the
//! time of each. Once a
//! second this node looks at the queues it masters that have an expiry;
//! one idle for longer is deleted, after every node has said it holds no
//! consumer of it (a consumer whose prefetch is full sends no gets). As in
//! RabbitMQ, a new master starts the count again.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use openraft::ServerState;

use super::deadletter;
use super::Clock;
use crate::error::NodeError;
use crate::ids::GroupId;
use crate::node::{Inner, Node};

const EVERY: Duration = Duration::from_secs(1);

impl Node {
    pub(in crate::node) fn spawn_expirer(&self) {
        let node = self.clone();
        tokio::spawn(async move {
            let mut clock = Clock::new(&node, EVERY);
            // When each queue's replica here was first seen leading.
            let mut leading_since: HashMap<GroupId, Instant> = HashMap::new();
            while clock.next().await {
                node.expire_unused(&mut leading_since).await;
            }
        });
    }

    /// One look at the queues mastered here that have an expiry.
    async fn expire_unused(&self, leading_since: &mut HashMap<GroupId, Instant>) {
        let meta = self.metadata();
        // Matching policies per queue every second is what a cluster of
        // many queues must not pay when no policy sets an expiry.
        let by_policy = meta.policies.values().any(|p| p.definition.contains("\"expires\""));
        let groups: Vec<_> =
            self.inner.groups.read().values().filter(|g| by_policy || g.meta.args.expires.is_some()).cloned().collect();
        let now = Instant::now();
        let mut due = Vec::new();
        let mut leading = Vec::new();
        for g in groups {
            if g.raft.metrics().borrow().state != ServerState::Leader {
                continue;
            }
            let Some(q) = meta.queues.get(&g.meta.name).filter(|q| q.group == g.meta.group) else { continue };
            let expires = match by_policy {
                true => deadletter::effective_args(&meta, q).expires,
                false => q.args.expires,
            };
            let Some(expires) = expires else { continue };
            leading.push(g.meta.group);
            let since = *leading_since.entry(g.meta.group).or_insert(now);
            let used = g.used.lock().expect("poisoned").max(since);
            if now.duration_since(used) >= Duration::from_millis(expires) {
                due.push((q.name.clone(), q.group, expires));
            }
        }
        leading_since.retain(|group, _| leading.contains(group));
        for (name, group, expires) in due {
            match self.consumers_anywhere(&name).await {
                Some(0) => {}
                // Consumers, or a node that did not say: not unused.
                _ => continue,
            }
            // Asking took time: still the same queue, still led here, and
            // still unused (a re-declare meanwhile keeps it)?
            let g = self.inner.groups.get(group);
            let still = g.is_some_and(|g| {
                g.raft.metrics().borrow().state == ServerState::Leader
                    && g.used.lock().expect("poisoned").elapsed() >= Duration::from_millis(expires)
            }) && self.metadata().queues.get(&name).is_some_and(|q| q.group == group);
            if !still {
                continue;
            }
            match self.delete_queue(&name).await {
                Ok(()) => tracing::info!(queue = %name, "queue expired unused (x-expires) and was deleted"),
                Err(NodeError::NoSuchQueue(_)) => {}
                Err(e) => tracing::warn!(queue = %name, error = %e, "could not delete an expired queue"),
            }
        }
    }

    /// How many consumers of `queue` every node holds; `None` if a node
    /// did not answer. A node seen gone holds none (its consumers went
    /// with it); one cut off may still serve some.
    async fn consumers_anywhere(&self, queue: &str) -> Option<usize> {
        let (_, consumers) = self.clients_of_nodes(true).await?;
        Some(consumers.iter().filter(|k| k.queue == queue).count())
    }
}

impl Inner {
    /// A declare of `queue` reached this node's replica: a use, as a get
    /// is (RabbitMQ: a redeclare renews the lease).
    pub(in crate::node) fn declared_here(&self, queue: &str) {
        let Some(group) = self.meta.borrow().queues.get(queue).map(|q| q.group) else { return };
        if let Some(g) = self.groups.get(group) {
            *g.used.lock().expect("poisoned") = Instant::now();
        }
    }
}
