//! Message flows for the API's `message_stats`: one ticker samples this
//! node's front-end counters and the counters of every queue mastered here
//! (`rates.rs` keeps the windows); the overview sums every node's.

use std::time::{Duration, Instant};

use super::Clock;
use crate::ids::NodeId;
use crate::node::Node;
use crate::queue::sm::Flow;
use crate::rates::{Flows, Tally, SAMPLE_EVERY};
use crate::wire::ask;

/// A queue's counters under the names of `message_stats`.
pub(in crate::node) fn queue_tally(f: &Flow) -> Tally {
    Tally { publish: f.published, confirm: 0, deliver_get: f.delivered, ack: f.acked }
}

impl Node {
    /// Sample once a second until the node stops: one task for all the
    /// queues, each tick reading counters already kept (no lock but the
    /// groups map's, briefly), so 10,000 queues cost a pass over a map.
    pub(in crate::node) fn spawn_rate_sampler(&self) {
        let node = self.clone();
        tokio::spawn(async move {
            let mut clock = Clock::new(&node, SAMPLE_EVERY);
            while clock.next().await {
                node.sample_flows(Instant::now());
            }
        });
    }

    fn sample_flows(&self, at: Instant) {
        let led: Vec<_> = {
            let groups = self.inner.groups.read();
            groups
                .values()
                .filter(|g| g.is_leader(self.id()))
                .map(|g| (g.meta.group, queue_tally(&g.stats.borrow().flow)))
                .collect()
        };
        self.inner.rates.record(at, self.own_tally(), led);
    }

    /// What this node's front ends counted: messages received from
    /// publishers, confirmed to them, delivered and got, acked.
    fn own_tally(&self) -> Tally {
        let m = &self.inner.metrics;
        Tally {
            publish: m.received.get(),
            confirm: m.confirmed.get(),
            deliver_get: m.delivered.get(),
            ack: m.acknowledged.get(),
        }
    }

    /// This node's message flows, as of now.
    pub fn own_flows(&self) -> Flows {
        self.inner.rates.node_flows(Instant::now(), self.own_tally())
    }

    /// Node `id`'s message flows (this one's own, or asked over the node
    /// link; `None` if it does not answer in time).
    pub async fn flows_of(&self, id: NodeId, limit: Duration) -> Option<Flows> {
        if id == self.id() {
            return Some(self.own_flows());
        }
        self.inner.ask(id, ask::Flows, Instant::now() + limit).await.ok()
    }

    /// Every node's message flows, asked all at once (a node that does not
    /// answer costs `limit` once, and is left out).
    pub async fn cluster_flows(&self, limit: Duration) -> Vec<Flows> {
        let mut ids: Vec<NodeId> = self.metadata().nodes.keys().copied().collect();
        // Counted here even before this node's registration is applied.
        if !ids.contains(&self.id()) {
            ids.push(self.id());
        }
        let asks = ids.iter().map(|id| self.flows_of(*id, limit));
        futures::future::join_all(asks).await.into_iter().flatten().collect()
    }
}
