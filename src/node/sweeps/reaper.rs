//! Giving back the unacked messages of holders that are gone.
//!
//! A channel that closes releases what it holds itself. One whose node was
//! killed, paused or cut off cannot, and neither can one whose release was
//! lost on the way (the master changed, the link broke). So, once a
//! second, every master looks at who holds its queue's unacked messages
//! (`owners.rs`: each owner names the node that made it) and asks each
//! such node which of its owners are still alive. The messages of an owner
//! its node no longer knows go back to ready at once, and so do those of
//! every owner of a node whose process is gone (`peers`: its port refuses
//! a dial). Those of a node merely out of reach stay with their owners
//! for `--unreachable-hold` (RabbitMQ's quorum queues return them when
//! Erlang's distribution declares the node down, after its tick time, 60 s
//! by default, and a consumer's later acks are then refused as unknown
//! tags): a consumer behind a short partition keeps its window, and its
//! acks, sent again until they land, settle it when the partition heals.
//!
//! A live owner can also hold messages it never got: a get served by a
//! master that stopped (or whose link broke) before its answer went out.
//! So the master also sends each holding node the tags it records for its
//! owners, and the node answers those the owner's channel does not know.
//! A tag unknown there for the failure timeout, sweep after sweep, is
//! requeued: a get's answer or an ack takes milliseconds on its way, so
//! only a stranded delivery stays unknown that long (and if one was merely
//! slow, the channel's later ack of it is refused: a redelivery, never a
//! loss).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use openraft::ServerState;

use super::Clock;
use crate::error::NodeError;
use crate::ids::{GroupId, NodeId};
use crate::node::{Node, QueueGroup};
use crate::owners;
use crate::queue::proposer::Lane;
use crate::queue::{QueueCmd, QueueReply};
use crate::wire::ask;

const EVERY: Duration = Duration::from_secs(1);
/// How long a node may take to say which of its owners are alive.
const ASK_LIMIT: Duration = Duration::from_millis(800);

/// One mastered queue's unacked deliveries: `(group, queue, owner -> tags)`.
type Held = (GroupId, String, BTreeMap<u64, Vec<u64>>);

/// What the reaper knows between sweeps.
#[derive(Default)]
struct Absence {
    /// Since when asking a node has failed without a break.
    failing_since: HashMap<NodeId, Instant>,
    /// Deliveries recorded under a live owner that its holder did not
    /// know, since when (without a break).
    unknown_since: HashMap<(GroupId, u64), Instant>,
}

/// What the owning nodes said in one sweep.
#[derive(Default)]
struct Verdicts {
    dead: BTreeSet<u64>,
    /// `(group, tag)` of deliveries their live owner's holder does not know.
    unknown: BTreeSet<(GroupId, u64)>,
}

impl Node {
    pub(in crate::node) fn spawn_reaper(&self) {
        let node = self.clone();
        tokio::spawn(async move {
            let mut clock = Clock::new(&node, EVERY);
            let mut absence = Absence::default();
            while clock.next().await {
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
            .values()
            .filter(|g| g.raft.metrics().borrow().state == ServerState::Leader)
            .cloned()
            .collect();
        let mut held: Vec<Held> = Vec::new();
        for g in groups {
            let mut owners = g.sm.with(|m| m.held()).await;
            owners.retain(|o, _| owners::is_tracked(*o));
            if !owners.is_empty() {
                held.push((g.meta.group, g.meta.name.clone(), owners));
            }
        }
        if held.is_empty() {
            absence.unknown_since.clear();
            return;
        }
        let v = self.ask_owners(&held, absence).await;
        let now = Instant::now();
        absence.unknown_since.retain(|k, _| v.unknown.contains(k));
        for k in &v.unknown {
            absence.unknown_since.entry(*k).or_insert(now);
        }
        let timeout = self.inner.timing.failure_timeout;
        for (group, _, owners) in held {
            let gone: Vec<u64> = owners.keys().copied().filter(|o| v.dead.contains(o)).collect();
            // Per live owner, its deliveries its holder has not known for
            // the failure timeout.
            let stranded: Vec<(u64, Vec<u64>)> = owners
                .iter()
                .filter(|(o, _)| !v.dead.contains(o))
                .map(|(o, tags)| {
                    let lost = tags.iter().copied().filter(|t| {
                        absence.unknown_since.get(&(group, *t)).is_some_and(|at| now.duration_since(*at) >= timeout)
                    });
                    (*o, lost.collect::<Vec<u64>>())
                })
                .filter(|(_, tags)| !tags.is_empty())
                .collect();
            if gone.is_empty() && stranded.is_empty() {
                continue;
            }
            let mut cmds: Vec<QueueCmd> = gone.iter().map(|owner| QueueCmd::Release { owner: *owner }).collect();
            cmds.extend(stranded.iter().map(|(owner, tags)| QueueCmd::NackOf {
                owner: *owner,
                tags: tags.clone(),
                requeue: true,
            }));
            let stranded: Vec<u64> = stranded.into_iter().flat_map(|(_, tags)| tags).collect();
            // Bounded: a proposal the group never answers (it lost its
            // majority under us) must not stop the sweeps of every queue.
            let limit = self.inner.timing.op_timeout;
            let op = tokio::time::timeout(limit, self.inner.local_queue_op(group, cmds, Lane::Consumer));
            let result = op.await.unwrap_or_else(|_| Err(NodeError::Unavailable("no answer in time".into())));
            match result {
                Ok(replies) => {
                    let count: u64 = replies
                        .iter()
                        .map(|r| match r {
                            QueueReply::Settled { count, .. } => *count as u64,
                            _ => 0,
                        })
                        .sum();
                    self.inner.metrics.released_of_gone.inc_by(count);
                    for t in &stranded {
                        absence.unknown_since.remove(&(group, *t));
                    }
                    tracing::info!(
                        group,
                        owners = gone.len(),
                        stranded = stranded.len(),
                        messages = count,
                        "requeued the unacked messages of holders that are gone or never got them"
                    );
                }
                // Not the master any more, or stopping: the next master's
                // sweep does it.
                Err(e) => tracing::debug!(group, error = %e, "could not requeue the messages of holders that are gone"),
            }
        }
    }

    /// How long the owners of `id`, which does not answer, stay alive in
    /// the master's eyes. Its process gone (its port refused a dial), its
    /// channels went with it: not a moment. Merely out of reach (a
    /// partition, a pause), its consumers may still be working through
    /// what they were sent, and their acks are sent again until they land
    /// (`amqp::channel`): giving their messages back at once would deliver
    /// them twice whenever the partition heals within the hold.
    fn hold_of(&self, id: NodeId) -> Duration {
        if self.inner.peers.is_dead(id) {
            Duration::ZERO
        } else {
            self.inner.timing.unreachable_hold
        }
    }

    /// Ask the owning nodes, once each, about the owners and deliveries in
    /// `held`: which owners are gone (unknown to the node that made them,
    /// made by a node that has not answered for the failure timeout, or by
    /// no node of the cluster), and which deliveries of the live ones their
    /// holder does not know.
    async fn ask_owners(&self, held: &[Held], absence: &mut Absence) -> Verdicts {
        // Per node bits, every owner's deliveries, queue by queue.
        let mut asks: BTreeMap<u16, Vec<(u64, String, Vec<u64>)>> = BTreeMap::new();
        let mut group_of: HashMap<(String, u64), GroupId> = HashMap::new();
        for (group, queue, owners) in held {
            for (owner, tags) in owners {
                asks.entry(owners::node_bits(*owner)).or_default().push((*owner, queue.clone(), tags.clone()));
                group_of.insert((queue.clone(), *owner), *group);
            }
        }
        let nodes: Vec<NodeId> = self.metadata().nodes.keys().copied().collect();
        let now = Instant::now();
        let mut v = Verdicts::default();
        for (bits, held) in asks {
            let asked: Vec<u64> = held.iter().map(|(o, _, _)| *o).collect::<BTreeSet<_>>().into_iter().collect();
            let mut alive: BTreeSet<u64> = BTreeSet::new();
            let mut unknown: Vec<(u64, String, Vec<u64>)> = Vec::new();
            let mut undecided = false;
            // Node ids are u64 and owners carry 16 bits of one: every node
            // whose id has those bits is asked, and an owner lives if any
            // of them says so.
            for id in nodes.iter().copied().filter(|id| owners::node_bits_of_id(*id) == bits) {
                if id == self.id() {
                    alive.extend(self.inner.owners.alive_of(&asked));
                    unknown.extend(held.iter().map(|(o, q, t)| (*o, q.clone(), self.inner.owners.unknown(*o, q, t))));
                    continue;
                }
                let req = ask::Owners { owners: asked.clone(), held: held.clone() };
                match self.inner.ask(id, req, Instant::now() + ASK_LIMIT).await {
                    Ok((live, not_known)) => {
                        absence.failing_since.remove(&id);
                        alive.extend(live);
                        unknown.extend(not_known);
                    }
                    _ => {
                        let since = *absence.failing_since.entry(id).or_insert(now);
                        // A ping answered after the asking started failing
                        // (the failure watch's) restarts the clock.
                        let last_seen = self.inner.peers.last_seen(id);
                        let absent_since = last_seen.map_or(since, |seen| seen.max(since));
                        if now.duration_since(absent_since) < self.hold_of(id) {
                            undecided = true;
                        }
                    }
                }
            }
            if !undecided {
                v.dead.extend(asked.into_iter().filter(|o| !alive.contains(o)));
            }
            for (owner, queue, tags) in unknown {
                if let Some(group) = group_of.get(&(queue, owner)) {
                    v.unknown.extend(tags.into_iter().map(|t| (*group, t)));
                }
            }
        }
        v
    }
}
