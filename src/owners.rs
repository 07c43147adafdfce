//! Who holds a queue's unacknowledged messages.
//!
//! A queue records each delivery under an *owner* (a `u64` in
//! [`crate::queue::QueueCmd::Get`]): an AMQP channel, or one HTTP `get`.
//! A channel that closes cleanly releases what it holds, but a channel
//! whose node died, was paused or cut off never does. So an owner says
//! which node made it and in which life of that node, and every node keeps
//! the set of its owners that are still alive: a queue's master asks the
//! owning node which of its owners live, and gives back the messages of
//! those that do not, or of every owner of a node gone for the failure
//! timeout (`node/sweeps/reaper.rs`).
//!
//! Layout, high bits first: 16 bits of the node id, 16 bits of the node's
//! incarnation (a counter bumped and synced at every start, so an owner of
//! a previous life never matches a live one; a fresh data dir starts it
//! from the clock, so a node back on an emptied dir matches its earlier
//! lives only by chance, one in 65,536), 32 bits of a counter: every
//! channel opened (and every API get) is an owner of its own, so a channel
//! number reopened while its predecessor's release is still on its way
//! does not have its new deliveries released with the old ones.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// What an owner's holder (an AMQP channel) knows it was given: a master
/// asks about the deliveries it records under a live owner, and those the
/// holder has never heard of for a while are stranded (a get served by a
/// master that stopped before its answer got through).
pub trait Holder: Send + Sync {
    /// Of `qtags` (the queue's delivery tags) of `queue`, those the holder
    /// does not know.
    fn unknown(&self, queue: &str, qtags: &[u64]) -> Vec<u64>;
}

const COUNTER_BITS: u32 = 32;
const INCARNATION_BITS: u32 = 16;

/// The 16 bits of a node id an owner carries. Node ids are u64; two nodes
/// whose ids share their low 16 bits are both asked about such an owner.
pub fn node_bits(owner: u64) -> u16 {
    (owner >> (COUNTER_BITS + INCARNATION_BITS)) as u16
}

/// The 16 bits of `node` an owner carries; never 0, which marks the
/// owners a library caller numbers itself (below 2^48, see [`is_tracked`]).
pub fn node_bits_of_id(node: u64) -> u16 {
    (node as u16).max(1)
}

/// Was `owner` made here (by [`Owners`]), so its life can be checked? The
/// library API lets callers number owners themselves (small numbers):
/// those are theirs to release.
pub fn is_tracked(owner: u64) -> bool {
    node_bits(owner) != 0
}

/// This node's owners: making them, and which are alive.
pub struct Owners {
    /// Node and incarnation bits, shifted in place.
    prefix: u64,
    next: AtomicU64,
    /// Live owners, with their holder if they have one.
    live: Mutex<HashMap<u64, Option<Arc<dyn Holder>>>>,
}

impl Owners {
    pub fn new(node: u64, incarnation: u64) -> Self {
        let prefix = ((node_bits_of_id(node) as u64) << INCARNATION_BITS | (incarnation & 0xFFFF)) << COUNTER_BITS;
        Self { prefix, next: AtomicU64::new(1), live: Mutex::default() }
    }

    /// A new owner, alive until [`Owners::gone`].
    pub fn new_owner(&self) -> u64 {
        self.make(None)
    }

    /// A new owner whose holder can say which deliveries it knows (an AMQP
    /// channel), alive until [`Owners::gone`].
    pub fn new_owner_held(&self, holder: Arc<dyn Holder>) -> u64 {
        self.make(Some(holder))
    }

    fn make(&self, holder: Option<Arc<dyn Holder>>) -> u64 {
        let owner = self.prefix | (self.next.fetch_add(1, Ordering::Relaxed) & ((1 << COUNTER_BITS) - 1));
        self.live.lock().expect("poisoned").insert(owner, holder);
        owner
    }

    /// An owner for one request (the HTTP API's get), alive while the
    /// guard is.
    pub fn ephemeral(self: &Arc<Self>) -> OwnerGuard {
        OwnerGuard { owners: self.clone(), owner: self.new_owner() }
    }

    /// `owner` will hold nothing more: its messages may be given back.
    pub fn gone(&self, owner: u64) {
        self.live.lock().expect("poisoned").remove(&owner);
    }

    /// Which of `owners` are alive here.
    pub fn alive_of(&self, owners: &[u64]) -> Vec<u64> {
        let live = self.live.lock().expect("poisoned");
        owners.iter().copied().filter(|o| live.contains_key(o)).collect()
    }

    pub fn is_alive(&self, owner: u64) -> bool {
        self.live.lock().expect("poisoned").contains_key(&owner)
    }

    /// Of the queue tags `qtags` of `queue` held by the live `owner`, those
    /// its holder does not know (none for an owner without a holder).
    pub fn unknown(&self, owner: u64, queue: &str, qtags: &[u64]) -> Vec<u64> {
        let holder = self.live.lock().expect("poisoned").get(&owner).cloned().flatten();
        holder.map_or_else(Vec::new, |h| h.unknown(queue, qtags))
    }
}

/// A one-request owner; dropping it ends its life.
pub struct OwnerGuard {
    owners: Arc<Owners>,
    pub owner: u64,
}

impl Drop for OwnerGuard {
    fn drop(&mut self) {
        self.owners.gone(self.owner);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owners_keep_the_node_and_differ_across_lives_and_channels() {
        let a = Owners::new(0x1_0003, 7);
        let b = Owners::new(0x1_0003, 8);
        let c = Owners::new(4, 7);
        let (oa, ob, oc) = (a.new_owner(), b.new_owner(), c.new_owner());
        assert_eq!(node_bits(oa), 3);
        assert_eq!(node_bits(oc), 4);
        assert_ne!(oa, ob, "another incarnation makes another owner");
        assert_ne!(oa, oc, "another node makes another owner");
        assert_ne!(a.new_owner(), oa);
        assert_eq!(a.alive_of(&[oa, ob, oc]), vec![oa]);
        assert!(is_tracked(oa) && !is_tracked(7));
        assert_eq!(node_bits(Owners::new(1 << 16, 1).new_owner()), 1, "node bits are never 0");
        a.gone(oa);
        assert!(!a.is_alive(oa));
    }

    struct Knows(Vec<u64>);
    impl Holder for Knows {
        fn unknown(&self, _queue: &str, qtags: &[u64]) -> Vec<u64> {
            qtags.iter().copied().filter(|t| !self.0.contains(t)).collect()
        }
    }

    #[test]
    fn a_holder_tells_the_deliveries_it_never_got() {
        let a = Owners::new(1, 1);
        let held = a.new_owner_held(Arc::new(Knows(vec![1, 2])));
        assert_eq!(a.unknown(held, "q", &[1, 2, 3]), vec![3]);
        assert!(a.unknown(a.new_owner(), "q", &[3]).is_empty(), "no holder: nothing judged stranded");
    }

    #[test]
    fn an_ephemeral_owner_lives_as_long_as_its_guard() {
        let a = Arc::new(Owners::new(1, 1));
        let g = a.ephemeral();
        let owner = g.owner;
        assert!(a.is_alive(owner));
        assert_ne!(owner, a.new_owner());
        drop(g);
        assert!(!a.is_alive(owner));
    }
}
