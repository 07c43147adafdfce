//! What a node does when the replicas of a queue fail: who may stand for
//! election (seniority), re-forming a group that lost its majority
//! (`ha-promote-on-failure: always`), healing replicas of an older epoch,
//! deciding a split, and handing over mastership on a graceful stop or a
//! rebalance. The reasoning is in `docs/reliability.md`; the epoch rules in
//! `queue::epoch`.
//!
//! Failover runs as one task ([`Failover::run`]) over the replica table,
//! beside the node rather than inside it: what it needs of the node (its
//! storage, the replica table, the peers' liveness, a way to start a
//! replica and to ask a peer) is the [`Host`] trait, which the node
//! implements. What failover keeps is its own: per replica in
//! [`Tracked`], per node in [`Shared`].

mod epoch;
mod handover;
mod heal;
mod rebalance;
mod reform;
mod rules;
mod split;
mod watch;

pub(crate) use epoch::{epoch_report, history, load_epoch};
pub use rebalance::Move;

use futures::future::{BoxFuture, FusedFuture, FutureExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::queue::epoch::Epoch;
use crate::wire::raft_net::EpochNews;
pub(crate) use split::SplitMemory;
pub(crate) use watch::GroupWatch;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::ServerError;
use crate::ids::{GroupId, NodeId};
use crate::metadata::{policy, MetaState, QueueMeta};
use crate::metrics::Metrics;
use crate::peers::quiet::Quiescence;
use crate::peers::{Peers, Prober};
use crate::queue::replica::Replica;
use crate::queue::replicas::Replicas;
use crate::timing::Timing;
use crate::wire::ask::{Ask, AskError};
use mirrorq_storage::{NodeDb, StorageError};

/// One hosted queue replica, with what failover keeps about it.
pub type QueueGroup = Replica<Tracked>;

/// What failover needs of the node it runs on. The node implements it;
/// failover knows no node. Liveness is the peers' ([`Host::peers`]), the
/// replicas are the table's ([`Host::replicas`]); failover only reads them
/// and acts on its replicas through the node.
pub trait Host: Prober + Clone + Send + Sync + 'static {
    fn id(&self) -> NodeId;
    /// The node-link address peers dial.
    fn addr(&self) -> &str;
    /// The cluster metadata as last applied here.
    fn metadata(&self) -> Arc<MetaState>;
    fn db(&self) -> &NodeDb;
    fn timing(&self) -> &Timing;
    /// The replicas hosted here.
    fn replicas(&self) -> &Replicas<Tracked>;
    /// Whether each peer is alive: the one owner of that fact.
    fn peers(&self) -> &Peers;
    /// Groups mastered here that send no heartbeats, and what peers
    /// announce of theirs.
    fn quiescence(&self) -> &Quiescence;
    fn metrics(&self) -> &Metrics;
    /// What failover keeps node-wide.
    fn shared(&self) -> &Shared;
    /// Cancelled when the node stops.
    fn stopping(&self) -> &CancellationToken;
    /// `what` failed again for `group` with `text`: counted; true if it is
    /// news (first time, or another text), which the caller logs.
    fn repeated(&self, group: GroupId, what: &'static str, text: &str) -> bool;
    /// `what` worked for `group`: its next failure is news again.
    fn cleared(&self, group: GroupId, what: &'static str);
    /// Take `g` out of the hosted replicas so that its holder stops it, if
    /// it is still the one hosted (`false`: leave it alone, it was
    /// replaced meanwhile).
    fn take_out(&self, g: &Arc<QueueGroup>) -> bool;
    /// Ask peer `target` (`deadline` bounds the wait).
    fn ask<A: Ask + Send + 'static>(
        &self,
        target: NodeId,
        req: A,
        deadline: Instant,
    ) -> impl Future<Output = Result<A::Reply, AskError>> + Send;
    /// Start this node's replica of `q` from what its storage holds.
    fn start_group(&self, q: QueueMeta, state: &MetaState) -> impl Future<Output = Result<(), ServerError>> + Send;
    /// A round of pings found `id` dead: act on it at once.
    fn after_death(&self, id: NodeId) -> impl Future<Output = ()> + Send;
    /// Which node masters `queue` now, as its replicas report.
    fn master_of(&self, queue: &str) -> impl Future<Output = Option<NodeId>> + Send;
}

/// What failover keeps node-wide, beside the per-replica [`Tracked`].
#[derive(Default)]
pub struct Shared {
    /// Groups being re-formed, healed or moved: not (re)started meanwhile.
    pub(crate) busy: Mutex<HashSet<GroupId>>,
    /// Asks for a run of the failure watch.
    watch_wanted: tokio::sync::Notify,
    /// Set once a graceful stop starts handing masterships over: no replica
    /// here stands for election any more.
    pub(crate) leaving: AtomicBool,
    /// Groups whose replica here must not stand for election until then
    /// (it just handed mastership over, or its Raft core quit).
    quiet: Mutex<HashMap<GroupId, Instant>>,
}

impl Shared {
    /// Ask the failure watch for a run (soon, after the one under way).
    pub(crate) fn want_watch(&self) {
        self.watch_wanted.notify_one();
    }

    /// Whether the replica of `group` here must not stand for election now.
    pub(crate) fn is_quiet(&self, group: GroupId) -> bool {
        self.quiet.lock().expect("poisoned").get(&group).is_some_and(|t| Instant::now() < *t)
    }

    /// Whether `group` is being re-formed, healed or moved.
    pub(crate) fn is_busy(&self, group: GroupId) -> bool {
        self.busy.lock().expect("poisoned").contains(&group)
    }

    /// Whether this node is handing its masterships over to stop.
    pub(crate) fn is_leaving(&self) -> bool {
        self.leaving.load(Ordering::Acquire)
    }
}

/// Failover on a node: one task ([`Failover::run`]), and the hand-overs a
/// graceful stop and a rebalance ask for. A handle: clones share the host.
#[derive(Clone)]
pub struct Failover<H>(pub H);

impl<H> std::ops::Deref for Failover<H> {
    type Target = H;
    fn deref(&self) -> &H {
        &self.0
    }
}

/// What failover keeps about one instance of a replica, beside it in the
/// replica table (`queue::Replica::ext`), each part written by one party.
pub struct Tracked {
    /// What it hears from its master (the inbound path writes it).
    pub(crate) heard: Heard,
    /// What the failure watch keeps about it (its task writes it).
    pub(crate) watch: GroupWatch,
    /// What heals learn of newer epochs of the group (they write it).
    pub(crate) split: SplitMemory,
}

/// What a replica hears from its group's master: written by the inbound
/// path alone, as appends arrive; read by the failure watch, the split
/// verdict and the epoch report.
pub(crate) struct Heard {
    /// When this replica started.
    started: Instant,
    /// When a master of this replica's epoch last sent it entries or a
    /// heartbeat: nanoseconds after `started`, plus one (0: never).
    master_at: AtomicU64,
    /// AppendEntries calls (entries or heartbeats) received.
    appends: AtomicU64,
}

impl Heard {
    pub(crate) fn new() -> Self {
        Heard { started: Instant::now(), master_at: AtomicU64::new(0), appends: AtomicU64::new(0) }
    }

    /// An append (entries or a heartbeat) came from the master.
    pub(crate) fn append_received(&self) {
        let nanos = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX - 1);
        self.master_at.store(nanos + 1, Ordering::Release);
        self.appends.fetch_add(1, Ordering::Relaxed);
    }

    /// When the master was last heard, if ever in this replica's life.
    pub(crate) fn master_at(&self) -> Option<Instant> {
        match self.master_at.load(Ordering::Acquire) {
            0 => None,
            n => Some(self.started + Duration::from_nanos(n - 1)),
        }
    }

    /// When the master was last heard, or else when this replica started.
    pub(crate) fn master_or_start(&self) -> Instant {
        self.master_at().unwrap_or(self.started)
    }

    #[cfg(feature = "test-hooks")]
    pub(crate) fn appends(&self) -> u64 {
        self.appends.load(Ordering::Relaxed)
    }
}

/// A replica of a group that kept its majority asks ours, of a
/// minority's fork, to yield to it (`split.rs`).
pub(crate) struct YieldAsk {
    pub(crate) group: GroupId,
    pub(crate) defeated: Epoch,
    pub(crate) winner: Epoch,
    pub(crate) from: NodeId,
}

impl<H: Host> Failover<H> {
    /// Failover's one task. Everything that starts failover work on this
    /// node arrives here: asks for a run of the failure watch
    /// ([`Shared::want_watch`]: the reconcile's tick, a peer seen dead),
    /// peers' news of newer epochs of our groups (from the Raft network's
    /// refusals), and asks to yield to a group that kept its majority.
    /// The watch runs one run at a time (asks that come during a run make
    /// one more run after it), so its verdicts (who stands, who re-forms)
    /// are never taken by two watches over one group at once. Heals and
    /// yields, which take seconds, run beside it; each takes its group
    /// ([`Busy`]) first, as a re-form does.
    pub(crate) fn run(
        &self,
        mut news: mpsc::UnboundedReceiver<EpochNews>,
        mut yields: mpsc::UnboundedReceiver<YieldAsk>,
    ) {
        let node = self.clone();
        tokio::spawn(async move {
            let run = futures::future::Fuse::<BoxFuture<'static, ()>>::terminated();
            tokio::pin!(run);
            let mut again = false;
            loop {
                tokio::select! {
                    _ = node.stopping().cancelled() => return,
                    () = &mut run, if !run.is_terminated() => {
                        if std::mem::take(&mut again) {
                            run.set(node.clone().watch_run().fuse());
                        }
                    }
                    _ = node.shared().watch_wanted.notified() => {
                        if run.is_terminated() {
                            run.set(node.clone().watch_run().fuse());
                        } else {
                            again = true;
                        }
                    }
                    Some(n) = news.recv() => node.epoch_news(n),
                    Some(y) = yields.recv() => {
                        let node = node.clone();
                        tokio::spawn(async move { node.yield_to(y.group, y.defeated, y.winner, y.from).await });
                    }
                }
            }
        });
    }

    /// Whether the peers have seen `id` dead.
    fn is_dead(&self, id: NodeId) -> bool {
        self.peers().is_dead(id)
    }

    /// One run of the failure watch, over the metadata as it stands.
    fn watch_run(self) -> BoxFuture<'static, ()> {
        Box::pin(async move {
            let state = self.metadata();
            self.watch_failures(&state).await;
        })
    }

    /// A peer told of a newer epoch of `news.group`: if our replica is
    /// older, remember who answers from it, and heal.
    fn epoch_news(&self, news: EpochNews) {
        let stale = match self.replicas().read().get(&news.group) {
            Some(g) if g.epoch < news.epoch => {
                g.ext.split.newer_seen(news.from);
                true
            }
            _ => false,
        };
        if stale {
            let node = self.clone();
            tokio::spawn(async move { node.heal(news).await });
        }
    }
}

/// Forget what failover kept on disk about this node's replica of `group`
/// (it left the group, or the queue was deleted).
pub(crate) fn forget(db: &NodeDb, group: GroupId) -> Result<(), StorageError> {
    db.remove_node_value(&epoch::term_floor_key(group))?;
    db.remove_node_value(&split::formed_key(group))?;
    db.remove_node_value(&split::formed_record_key(group))?;
    db.remove_node_value(&split::defeated_key(group))
}

/// The mirroring settings in force for a queue.
pub(crate) fn ha_of(state: &MetaState, q: &QueueMeta) -> policy::HaPolicy {
    let ha = q
        .policy
        .as_ref()
        .and_then(|n| state.policies.get(n))
        .and_then(|p| policy::ha_policy_of(&p.definition))
        .unwrap_or_default();
    if q.args.is_quorum() {
        // A quorum queue is Raft alone, as RabbitMQ's: new mirrors catch
        // up on their own, and only a majority of its replicas serves.
        // Of its policy only the master locator (no `ha-` key) applies.
        policy::HaPolicy {
            sync_automatic: true,
            promote_on_failure_always: false,
            promote_on_shutdown_always: false,
            min_masters: ha.min_masters,
            ..policy::HaPolicy::default()
        }
    } else {
        ha
    }
}

/// Marks a group busy (re-forming, healing, moving its master) until dropped.
pub(crate) struct Busy<'a> {
    set: &'a std::sync::Mutex<HashSet<GroupId>>,
    group: GroupId,
}

impl<'a> Busy<'a> {
    /// `None` if someone else has the group.
    pub(crate) fn take(set: &'a std::sync::Mutex<HashSet<GroupId>>, group: GroupId) -> Option<Self> {
        // Not `then_some`: it would build (and drop) a `Busy` even when the
        // group is taken, and that drop would lock `set` again while this
        // lock is held (a deadlock) and free the other holder's claim.
        let fresh = set.lock().expect("poisoned").insert(group);
        fresh.then(|| Busy { set, group })
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.set.lock().expect("poisoned").remove(&self.group);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_claim_leaves_the_holder_alone() {
        let set = std::sync::Mutex::new(HashSet::new());
        let first = Busy::take(&set, 7).expect("free");
        // Before the fix this call deadlocked on `set`.
        assert!(Busy::take(&set, 7).is_none());
        assert!(set.lock().unwrap().contains(&7), "the refused claim freed the holder's");
        assert!(Busy::take(&set, 8).is_some(), "other groups are free");
        drop(first);
        assert!(set.lock().unwrap().is_empty());
    }
}
