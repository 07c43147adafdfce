//! Giving back the unacked messages of holders that are gone.
//!
//! A channel that closes releases what it holds itself. One whose node was
//! killed, paused or cut off cannot, and neither can one whose release was
//! lost on the way (the master changed, the link broke). So, once a
//! second, every master looks at who holds its queue's unacked messages
//! (`owners.rs`: each owner names the node that made it) and asks each
//! such node which of its owners are still alive. The messages of an owner
//! its node no longer knows go back to ready at once; those of every owner
//! of a node that has not answered for the failure timeout go back then
//! (RabbitMQ gives them back when the consumer's node goes down too, and
//! the consumer's later acks are refused as unknown tags).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use openraft::ServerState;

use super::{Node, QueueGroup};
use crate::owners;
use crate::queue::proposer::Lane;
use crate::queue::{QueueCmd, QueueReply};
use crate::raft::rpc::{RpcRequest, RpcResponse};
use crate::raft::types::{GroupId, NodeId};

const EVERY: Duration = Duration::from_secs(1);
/// How long a node may take to say which of its owners are alive.
const ASK_LIMIT: Duration = Duration::from_millis(800);

/// What the reaper knows of a node between sweeps.
#[derive(Default)]
struct Absence {
    /// Since when asking it has failed without a break.
    failing_since: HashMap<NodeId, Instant>,
}

impl Node {
    pub(super) fn spawn_reaper(&self) {
        let node = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let mut absence = Absence::default();
            loop {
                tokio::select! {
                    _ = node.inner.stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                node.reap(&mut absence).await;
            }
        });
    }

    /// One sweep over the queues this node masters.
    async fn reap(&self, absence: &mut Absence) {
        let groups: Vec<Arc<QueueGroup>> = self
            .inner
            .groups
            .read()
            .expect("poisoned")
            .values()
            .filter(|g| g.raft.metrics().borrow().state == ServerState::Leader)
            .cloned()
            .collect();
        let mut held: Vec<(GroupId, BTreeSet<u64>)> = Vec::new();
        for g in groups {
            let mut owners = g.sm.with(|m| m.owners()).await;
            owners.retain(|o| owners::is_tracked(*o));
            if !owners.is_empty() {
                held.push((g.meta.group, owners));
            }
        }
        if held.is_empty() {
            return;
        }
        let all: BTreeSet<u64> = held.iter().flat_map(|(_, o)| o.iter().copied()).collect();
        let dead = self.dead_owners(&all, absence).await;
        if dead.is_empty() {
            return;
        }
        for (group, owners) in held {
            let gone: Vec<u64> = owners.intersection(&dead).copied().collect();
            if gone.is_empty() {
                continue;
            }
            let cmds = gone.iter().map(|owner| QueueCmd::Release { owner: *owner }).collect();
            match self.inner.local_queue_op(group, cmds, Lane::Consumer).await {
                Ok(replies) => {
                    let count: u64 = replies
                        .iter()
                        .map(|r| match r {
                            QueueReply::Settled { count, .. } => *count as u64,
                            _ => 0,
                        })
                        .sum();
                    self.inner.metrics.released_of_gone.inc_by(count);
                    tracing::info!(group, owners = gone.len(), messages = count, "requeued the unacked messages of holders that are gone");
                }
                // Not the master any more, or stopping: the next master's
                // sweep does it.
                Err(e) => tracing::debug!(group, error = %e, "could not requeue the messages of holders that are gone"),
            }
        }
    }

    /// Which of `owners` are gone: unknown to the node that made them, or
    /// made by a node that has not answered for the failure timeout (or
    /// by no node of the cluster).
    async fn dead_owners(&self, owners: &BTreeSet<u64>, absence: &mut Absence) -> BTreeSet<u64> {
        let mut by_bits: BTreeMap<u16, Vec<u64>> = BTreeMap::new();
        for o in owners {
            by_bits.entry(owners::node_bits(*o)).or_default().push(*o);
        }
        let nodes: Vec<NodeId> = self.metadata().nodes.keys().copied().collect();
        let now = Instant::now();
        let mut dead = BTreeSet::new();
        for (bits, asked) in by_bits {
            // Node ids are u64 and owners carry 16 bits of one: every node
            // whose id has those bits is asked, and an owner lives if any
            // of them says so.
            let candidates: Vec<NodeId> =
                nodes.iter().copied().filter(|id| owners::node_bits_of_id(*id) == bits).collect();
            let mut alive: BTreeSet<u64> = BTreeSet::new();
            let mut undecided = false;
            for id in candidates {
                if id == self.id() {
                    alive.extend(self.inner.owners.alive_of(&asked));
                    continue;
                }
                let deadline = Instant::now() + ASK_LIMIT;
                match self.inner.call(id, &RpcRequest::Owners { owners: asked.clone() }, deadline).await {
                    Ok(RpcResponse::Owners(live)) => {
                        absence.failing_since.remove(&id);
                        alive.extend(live);
                    }
                    _ => {
                        let since = *absence.failing_since.entry(id).or_insert(now);
                        // A ping answered after the asking started failing
                        // (the failure watch's) restarts the clock.
                        let last_seen = self.inner.seen.lock().expect("poisoned").get(&id).copied();
                        let absent_since = last_seen.map_or(since, |seen| seen.max(since));
                        if now.duration_since(absent_since) < self.inner.timing.failure_timeout {
                            undecided = true;
                        }
                    }
                }
            }
            if !undecided {
                dead.extend(asked.into_iter().filter(|o| !alive.contains(o)));
            }
        }
        dead
    }
}
