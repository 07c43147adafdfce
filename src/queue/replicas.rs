//! The replicas a node hosts, by group: one instance per group at a time.
//! Whoever takes an instance out is the one that stops it, so a caller
//! holding an older view (a replica since replaced) can never take out,
//! and so leave running unseen, the newer one.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};
use std::time::Instant;

use tokio::sync::Notify;

use super::replica::Replica;
use crate::ids::GroupId;

pub struct Replicas<X> {
    table: RwLock<HashMap<GroupId, Arc<Replica<X>>>>,
    /// Replicas taken out so far: a look over every group that started
    /// before the last removal may have to start one again.
    removals: AtomicU64,
    /// Woken whenever a replica is added: an operation on a queue declared
    /// a moment ago waits for its replica to start, not for a fixed pause.
    added: Notify,
}

impl<X> Default for Replicas<X> {
    fn default() -> Self {
        Self { table: RwLock::default(), removals: AtomicU64::new(0), added: Notify::new() }
    }
}

impl<X> Replicas<X> {
    pub fn get(&self, group: GroupId) -> Option<Arc<Replica<X>>> {
        self.table.read().expect("poisoned").get(&group).cloned()
    }

    pub fn contains(&self, group: GroupId) -> bool {
        self.table.read().expect("poisoned").contains_key(&group)
    }

    /// Whether a replica of `group` is hosted and `f` holds for it.
    pub fn any(&self, group: GroupId, f: impl FnOnce(&Replica<X>) -> bool) -> bool {
        self.table.read().expect("poisoned").get(&group).is_some_and(|r| f(r))
    }

    /// Every hosted replica, as of now.
    pub fn all(&self) -> Vec<Arc<Replica<X>>> {
        self.table.read().expect("poisoned").values().cloned().collect()
    }

    /// One look at the whole table, for a reader that must see every
    /// replica at one moment; held briefly (adding and taking out wait).
    pub fn read(&self) -> RwLockReadGuard<'_, HashMap<GroupId, Arc<Replica<X>>>> {
        self.table.read().expect("poisoned")
    }

    /// Host `r` unless `refused` (asked under the table's lock) or a
    /// replica of its group is hosted already; false if not hosted.
    pub fn add(&self, r: &Arc<Replica<X>>, refused: impl FnOnce() -> bool) -> bool {
        let added = {
            let mut table = self.table.write().expect("poisoned");
            let taken = refused() || table.contains_key(&r.meta.group);
            if !taken {
                table.insert(r.meta.group, r.clone());
            }
            !taken
        };
        if added {
            self.added.notify_waiters();
        }
        added
    }

    /// Take `r` out so its holder can stop it, if it is still the replica
    /// hosted: a caller whose view is older gets `false` and must leave
    /// the group alone. `then` runs under the table's lock once it is out,
    /// before a new instance of the group can be added.
    pub fn take_out(&self, r: &Arc<Replica<X>>, then: impl FnOnce()) -> bool {
        let mut table = self.table.write().expect("poisoned");
        match table.get(&r.meta.group) {
            Some(current) if Arc::ptr_eq(current, r) => {
                table.remove(&r.meta.group);
                self.removals.fetch_add(1, Ordering::AcqRel);
                then();
                true
            }
            _ => false,
        }
    }

    /// Take every replica out (the node stops).
    pub fn drain(&self) -> Vec<Arc<Replica<X>>> {
        self.table.write().expect("poisoned").drain().map(|(_, r)| r).collect()
    }

    /// Is `r` the replica hosted now (not one a newer one replaced)?
    pub fn is_current(&self, r: &Arc<Replica<X>>) -> bool {
        self.table.read().expect("poisoned").get(&r.meta.group).is_some_and(|c| Arc::ptr_eq(c, r))
    }

    /// How many replicas were taken out so far.
    pub fn removals(&self) -> u64 {
        self.removals.load(Ordering::Acquire)
    }

    /// The replica of `group` once it has started, until `until`.
    pub async fn started(&self, group: GroupId, until: Instant) -> Option<Arc<Replica<X>>> {
        loop {
            let added = self.added.notified();
            if let Some(r) = self.get(group) {
                return Some(r);
            }
            if tokio::time::timeout_at(until.into(), added).await.is_err() {
                return None;
            }
        }
    }
}
