//! What a node does when the replicas of a queue fail: who may stand for
//! election (seniority), re-forming a group that lost its majority
//! (`ha-promote-on-failure: always`), healing replicas of an older epoch, and
//! handing over mastership on a graceful stop. The reasoning is in
//! `docs/reliability.md`; the epoch rules in `queue::epoch`.

mod epoch;
mod handover;
mod heal;
mod reform;
mod rules;
mod split;
mod watch;

pub(super) use epoch::load_epoch;

use futures::future::{BoxFuture, FusedFuture, FutureExt};
use tokio::sync::mpsc;

use crate::node::Node;
use crate::queue::epoch::Epoch;
use crate::wire::raft_net::EpochNews;
pub(super) use split::SplitMemory;
pub(super) use watch::GroupWatch;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::ids::{GroupId, NodeId};
use crate::metadata::{policy, MetaState, QueueMeta};
use mirrorq_storage::{NodeDb, StorageError};

/// What failover keeps about one instance of a replica, beside it in the
/// replica table (`queue::Replica::ext`), each part written by one party.
pub(super) struct Tracked {
    /// What it hears from its master (the inbound path writes it).
    pub(super) heard: Heard,
    /// What the failure watch keeps about it (its task writes it).
    pub(super) watch: GroupWatch,
    /// What heals learn of newer epochs of the group (they write it).
    pub(super) split: SplitMemory,
}

/// What a replica hears from its group's master: written by the inbound
/// path alone, as appends arrive; read by the failure watch, the split
/// verdict and the epoch report.
pub(super) struct Heard {
    /// When this replica started.
    started: Instant,
    /// When a master of this replica's epoch last sent it entries or a
    /// heartbeat: nanoseconds after `started`, plus one (0: never).
    master_at: AtomicU64,
    /// AppendEntries calls (entries or heartbeats) received.
    appends: AtomicU64,
}

impl Heard {
    pub(super) fn new() -> Self {
        Heard { started: Instant::now(), master_at: AtomicU64::new(0), appends: AtomicU64::new(0) }
    }

    /// An append (entries or a heartbeat) came from the master.
    pub(super) fn append_received(&self) {
        let nanos = u64::try_from(self.started.elapsed().as_nanos()).unwrap_or(u64::MAX - 1);
        self.master_at.store(nanos + 1, Ordering::Release);
        self.appends.fetch_add(1, Ordering::Relaxed);
    }

    /// When the master was last heard, if ever in this replica's life.
    pub(super) fn master_at(&self) -> Option<Instant> {
        match self.master_at.load(Ordering::Acquire) {
            0 => None,
            n => Some(self.started + Duration::from_nanos(n - 1)),
        }
    }

    /// When the master was last heard, or else when this replica started.
    pub(super) fn master_or_start(&self) -> Instant {
        self.master_at().unwrap_or(self.started)
    }

    #[cfg(feature = "test-hooks")]
    pub(super) fn appends(&self) -> u64 {
        self.appends.load(Ordering::Relaxed)
    }
}

/// A replica of a group that kept its majority asks ours, of a
/// minority's fork, to yield to it (`split.rs`).
pub(in crate::node) struct YieldAsk {
    pub(in crate::node) group: GroupId,
    pub(in crate::node) defeated: Epoch,
    pub(in crate::node) winner: Epoch,
    pub(in crate::node) from: NodeId,
}

impl Node {
    /// Failover's one task. Everything that starts failover work on this
    /// node arrives here: asks for a run of the failure watch
    /// ([`Node::want_watch`]: the reconcile's tick, a peer seen dead),
    /// peers' news of newer epochs of our groups (from the Raft network's
    /// refusals), and asks to yield to a group that kept its majority.
    /// The watch runs one run at a time (asks that come during a run make
    /// one more run after it), so its verdicts (who stands, who re-forms)
    /// are never taken by two watches over one group at once. Heals and
    /// yields, which take seconds, run beside it; each takes its group
    /// ([`Busy`]) first, as a re-form does.
    pub(in crate::node) fn spawn_failover(
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
                    _ = node.inner.stop.cancelled() => return,
                    () = &mut run, if !run.is_terminated() => {
                        if std::mem::take(&mut again) {
                            run.set(node.clone().watch_run().fuse());
                        }
                    }
                    _ = node.inner.watch_wanted.notified() => {
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
        let stale = match self.inner.groups.read().get(&news.group) {
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
pub(super) fn forget(db: &NodeDb, group: GroupId) -> Result<(), StorageError> {
    db.remove_node_value(&epoch::term_floor_key(group))?;
    db.remove_node_value(&split::formed_key(group))?;
    db.remove_node_value(&split::formed_record_key(group))?;
    db.remove_node_value(&split::defeated_key(group))
}

/// The mirroring settings in force for a queue.
pub(super) fn ha_of(state: &MetaState, q: &QueueMeta) -> policy::HaPolicy {
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
pub(super) struct Busy<'a> {
    set: &'a std::sync::Mutex<HashSet<GroupId>>,
    group: GroupId,
}

impl<'a> Busy<'a> {
    /// `None` if someone else has the group.
    pub(super) fn take(set: &'a std::sync::Mutex<HashSet<GroupId>>, group: GroupId) -> Option<Self> {
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
