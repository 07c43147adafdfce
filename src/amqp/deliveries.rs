//! A channel's delivery tags, the messages they stand for, and the prefetch
//! limits that decide how many more a consumer may be sent.
//!
//! `basic.qos` as RabbitMQ reads it: `global = false` sets the limit of each
//! consumer started afterwards on the channel, `global = true` a limit
//! shared by the whole channel; a consumer is sent messages only while both
//! allow it. Messages requeued here but not yet back in the queue still
//! count ("settling"), so a requeued message is back before the next get
//! and is the one delivered next. An ack (or a nack that does not requeue)
//! gives its room back at once: nothing it settles can be delivered again,
//! and waiting for its Raft commit would make the prefetch window a round
//! trip of the log longer (a drain at prefetch 1000 ran at 57k msg/s that
//! way; at 4000, or with the room back at once, about 88k).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use tokio::sync::Notify;

/// A consumer's number on its channel; `None` stands for `basic.get`.
pub type ConsumerId = u32;

/// With no limit, how many messages one get may take.
const UNLIMITED_BATCH: u32 = 1000;

#[derive(Default)]
pub struct Deliveries {
    state: Mutex<State>,
    /// Woken when acks free room under a prefetch limit.
    pub room: Notify,
    /// Woken when a delivery is held where none was (the channel then
    /// starts looking for deliveries past their consumer timeout).
    pub held: Notify,
}

#[derive(Default)]
struct State {
    next_tag: u64,
    /// channel tag -> where the message came from and who got it.
    unacked: BTreeMap<u64, Held>,
    /// Taken (acked, nacked) but not yet applied at the queue, per holder.
    settling: HashMap<Option<ConsumerId>, usize>,
    /// Unacked per consumer.
    held_by: HashMap<ConsumerId, usize>,
    /// Limit for consumers started from now on (`global = false`).
    consumer_prefetch: u16,
    /// Limit shared by the channel (`global = true`).
    channel_prefetch: u16,
    /// Each consumer's limit, fixed when it started.
    limits: HashMap<ConsumerId, u16>,
    /// Room a consumer has claimed for a get still in flight: counted
    /// against the limits so two consumers of one channel cannot both
    /// claim the same room.
    reserved: HashMap<ConsumerId, usize>,
    /// The queue name the last delivery was assigned from, to share.
    last_queue: Option<Arc<str>>,
    /// Settles on their way to the queue's master, by queue: the channel
    /// still knows these deliveries (the master must not requeue them as
    /// never got while an ack of them is being retried).
    in_flight: HashMap<Arc<str>, HashMap<u64, u32>>,
    /// The channel closed: settles still on their way stop trying (the
    /// owner's release gives back whatever they would have settled).
    closed: bool,
}

struct Held {
    /// Shared by every message of the queue held here: one allocation
    /// per queue, not per delivery.
    queue: Arc<str>,
    qtag: u64,
    by: Option<ConsumerId>,
    /// When it was delivered (consumer timeouts).
    at: Instant,
}

/// Append `v` to `queue`'s list, allocating its key only the first time.
fn push_for<T>(map: &mut BTreeMap<String, Vec<T>>, queue: &str, v: T) {
    match map.get_mut(queue) {
        Some(list) => list.push(v),
        None => {
            map.insert(queue.to_string(), vec![v]);
        }
    }
}

/// Room a consumer holds while its get is in flight.
pub struct Claim {
    pub n: u32,
    id: ConsumerId,
    deliveries: Arc<Deliveries>,
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.deliveries.release(self.id, self.n);
    }
}

/// Tags taken for settling, grouped by queue.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Taken {
    /// queue -> its own delivery tags.
    pub by_queue: BTreeMap<String, Vec<u64>>,
    /// Who held each, to give their room back once settled.
    holders: BTreeMap<String, Vec<Option<ConsumerId>>>,
}

impl Taken {
    /// The holders of the tags taken from `queue`, for [`Deliveries::settled`].
    pub fn holders(&mut self, queue: &str) -> Vec<Option<ConsumerId>> {
        self.holders.remove(queue).unwrap_or_default()
    }
    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_queue.values().map(Vec::len).sum()
    }
}

impl crate::owners::Holder for Deliveries {
    fn unknown(&self, queue: &str, qtags: &[u64]) -> Vec<u64> {
        let st = self.state.lock().expect("poisoned");
        let known: std::collections::HashSet<u64> =
            st.unacked.values().filter(|h| &*h.queue == queue).map(|h| h.qtag).collect();
        let in_flight = st.in_flight.get(queue);
        qtags.iter().copied().filter(|t| !known.contains(t) && !in_flight.is_some_and(|f| f.contains_key(t))).collect()
    }
}

impl Deliveries {
    /// `basic.qos`.
    pub fn set_prefetch(&self, count: u16, global: bool) {
        let mut st = self.state.lock().expect("poisoned");
        if global {
            st.channel_prefetch = count;
        } else {
            st.consumer_prefetch = count;
        }
        drop(st);
        self.room.notify_waiters();
    }

    /// A consumer starts: it takes the channel's per-consumer limit now in
    /// force, which it reports.
    pub fn consumer_started(&self, id: ConsumerId) -> u16 {
        let mut st = self.state.lock().expect("poisoned");
        let limit = st.consumer_prefetch;
        st.limits.insert(id, limit);
        limit
    }

    /// A new channel tag for queue tag `qtag`, tracked until settled unless
    /// the message needs no ack.
    pub fn assign(&self, queue: &str, qtag: u64, track: bool, by: Option<ConsumerId>) -> u64 {
        let mut st = self.state.lock().expect("poisoned");
        st.next_tag += 1;
        let tag = st.next_tag;
        if track {
            let queue = match &st.last_queue {
                Some(q) if **q == *queue => q.clone(),
                _ => st.last_queue.insert(Arc::from(queue)).clone(),
            };
            let first = st.unacked.is_empty();
            st.unacked.insert(tag, Held { queue, qtag, by, at: Instant::now() });
            if let Some(c) = by {
                *st.held_by.entry(c).or_default() += 1;
            }
            if first {
                // A permit is kept if the channel is not waiting yet.
                self.held.notify_one();
            }
        }
        tag
    }

    /// Claim the room consumer `id` has now (how many more messages it may
    /// be sent); give it back with [`Deliveries::release`] once the
    /// messages fetched with it are assigned.
    pub fn reserve(&self, id: ConsumerId, at_most: u32) -> u32 {
        let mut st = self.state.lock().expect("poisoned");
        let mut room = UNLIMITED_BATCH.min(at_most);
        if st.channel_prefetch > 0 {
            let busy = st.unacked.len() + st.settling.values().sum::<usize>() + st.reserved.values().sum::<usize>();
            room = room.min((st.channel_prefetch as usize).saturating_sub(busy) as u32);
        }
        let limit = st.limits.get(&id).copied().unwrap_or(0);
        if limit > 0 {
            let busy = st.held_by.get(&id).copied().unwrap_or(0)
                + st.settling.get(&Some(id)).copied().unwrap_or(0)
                + st.reserved.get(&id).copied().unwrap_or(0);
            room = room.min((limit as usize).saturating_sub(busy) as u32);
        }
        *st.reserved.entry(id).or_default() += room as usize;
        room
    }

    /// Give back room claimed by [`Deliveries::reserve`].
    pub fn release(&self, id: ConsumerId, n: u32) {
        if n == 0 {
            // Nothing freed: waking the others would only spin them.
            return;
        }
        let mut st = self.state.lock().expect("poisoned");
        if let Some(r) = st.reserved.get_mut(&id) {
            *r = r.saturating_sub(n as usize);
        }
        drop(st);
        self.room.notify_waiters();
    }

    /// [`Deliveries::reserve`] of at most `at_most`, given back when the
    /// claim is dropped.
    pub fn claim(self: &Arc<Self>, id: ConsumerId, at_most: u32) -> Claim {
        Claim { n: self.reserve(id, at_most), id, deliveries: self.clone() }
    }

    #[cfg(test)]
    fn room(&self, id: ConsumerId) -> u32 {
        let n = self.reserve(id, u32::MAX);
        self.release(id, n);
        n
    }

    pub fn is_unacked(&self, tag: u64) -> bool {
        self.state.lock().expect("poisoned").unacked.contains_key(&tag)
    }

    /// Remove tags (all up to `tag` if `multiple`; all if tag 0 and
    /// multiple) grouped by queue. `Err` if a single tag is unknown. Their
    /// room comes back now, or, if they are `requeued`, at
    /// [`Deliveries::settled`] once the queue has them back.
    pub fn take(&self, tag: u64, multiple: bool, requeued: bool) -> Result<Taken, u64> {
        let mut st = self.state.lock().expect("poisoned");
        let gone: Vec<Held> = if multiple {
            // Tags are assigned in order: everything up to `tag` is a prefix.
            let keep = match tag.checked_add(1) {
                Some(after) if tag > 0 => st.unacked.split_off(&after),
                _ => BTreeMap::new(),
            };
            std::mem::replace(&mut st.unacked, keep).into_values().collect()
        } else {
            vec![st.unacked.remove(&tag).ok_or(tag)?]
        };
        let mut taken = Taken::default();
        for h in gone {
            if let Some(c) = h.by {
                if let Some(n) = st.held_by.get_mut(&c) {
                    *n = n.saturating_sub(1);
                }
            }
            if requeued {
                *st.settling.entry(h.by).or_default() += 1;
                push_for(&mut taken.holders, &h.queue, h.by);
            }
            push_for(&mut taken.by_queue, &h.queue, h.qtag);
        }
        drop(st);
        if !requeued && !taken.by_queue.is_empty() {
            self.room.notify_waiters();
        }
        Ok(taken)
    }

    /// Taken tags with these holders have been applied at their queue.
    pub fn settled(&self, holders: &[Option<ConsumerId>]) {
        if holders.is_empty() {
            return;
        }
        let mut st = self.state.lock().expect("poisoned");
        for h in holders {
            if let Some(n) = st.settling.get_mut(h) {
                *n = n.saturating_sub(1);
            }
        }
        drop(st);
        self.room.notify_waiters();
    }

    /// A settle of `queue`'s deliveries `qtags` is on its way to the
    /// master: they stay known until [`Deliveries::landed`].
    pub fn sending(&self, queue: &str, qtags: &[u64]) {
        let mut st = self.state.lock().expect("poisoned");
        let set = st.in_flight.entry(Arc::from(queue)).or_default();
        for t in qtags {
            *set.entry(*t).or_default() += 1;
        }
    }

    /// The settle [`Deliveries::sending`] announced was answered, or given up.
    pub fn landed(&self, queue: &str, qtags: &[u64]) {
        let mut st = self.state.lock().expect("poisoned");
        if let Some(set) = st.in_flight.get_mut(queue) {
            for t in qtags {
                if let Some(n) = set.get_mut(t) {
                    *n -= 1;
                    if *n == 0 {
                        set.remove(t);
                    }
                }
            }
            if set.is_empty() {
                st.in_flight.remove(queue);
            }
        }
    }

    /// Whether the channel closed ([`Deliveries::forget_all`]).
    pub fn is_closed(&self) -> bool {
        self.state.lock().expect("poisoned").closed
    }

    /// Whether any delivery awaits its ack.
    pub fn holds_any(&self) -> bool {
        !self.state.lock().expect("poisoned").unacked.is_empty()
    }

    /// When the oldest delivery still unacked of each queue held was made.
    /// Deliveries are kept in the order they were made, so the first of a
    /// queue met is its oldest.
    pub fn oldest_by_queue(&self) -> Vec<(Arc<str>, Instant)> {
        let st = self.state.lock().expect("poisoned");
        let mut out: Vec<(Arc<str>, Instant)> = Vec::new();
        for h in st.unacked.values() {
            if !out.iter().any(|(q, _)| *q == h.queue) {
                out.push((h.queue.clone(), h.at));
            }
        }
        out
    }

    pub fn queues_held(&self) -> BTreeSet<String> {
        self.state.lock().expect("poisoned").unacked.values().map(|h| h.queue.to_string()).collect()
    }

    /// The channel closed: its unacked messages go back to their queues
    /// by the owner's release, so nothing here counts any more.
    pub fn forget_all(&self) {
        let mut st = self.state.lock().expect("poisoned");
        st.unacked.clear();
        st.settling.clear();
        st.held_by.clear();
        st.reserved.clear();
        st.in_flight.clear();
        st.closed = true;
        drop(st);
        self.room.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delivery_tags_multiple_and_unknown() {
        let d = Deliveries::default();
        let a = d.assign("q1", 10, true, None);
        let b = d.assign("q2", 20, true, None);
        let c = d.assign("q1", 11, true, None);
        assert_eq!((a, b, c), (1, 2, 3));
        assert_eq!(d.take(9, false, false), Err(9));
        let got = d.take(2, true, false).unwrap();
        assert_eq!(got.by_queue.get("q1"), Some(&vec![10]));
        assert_eq!(got.by_queue.get("q2"), Some(&vec![20]));
        assert_eq!(d.take(3, false, false).unwrap().by_queue.get("q1"), Some(&vec![11]));
        assert_eq!(d.take(3, false, true), Err(3), "a tag settles once");
    }

    #[test]
    fn a_delivery_whose_settle_is_on_its_way_is_still_known() {
        use crate::owners::Holder;
        let d = Deliveries::default();
        let a = d.assign("q", 10, true, None);
        d.assign("q", 11, true, None);
        d.take(a, false, false).unwrap();
        assert_eq!(d.unknown("q", &[10, 11, 12]), vec![10, 12], "taken and not on its way: unknown");
        d.sending("q", &[10]);
        d.sending("q", &[10]);
        assert_eq!(d.unknown("q", &[10, 11, 12]), vec![12]);
        assert_eq!(d.unknown("other", &[10]), vec![10], "known by queue");
        d.landed("q", &[10]);
        assert_eq!(d.unknown("q", &[10]), Vec::<u64>::new(), "one of two sends still on its way");
        d.landed("q", &[10]);
        assert_eq!(d.unknown("q", &[10]), vec![10]);
        assert!(!d.is_closed());
        d.sending("q", &[11]);
        d.forget_all();
        assert!(d.is_closed());
        assert_eq!(d.unknown("q", &[11]), vec![11], "a closed channel knows nothing");
    }

    #[test]
    fn per_consumer_limits_are_fixed_at_consume_and_counted_separately() {
        let d = Deliveries::default();
        d.set_prefetch(2, false);
        assert_eq!(d.consumer_started(1), 2);
        d.set_prefetch(3, false);
        assert_eq!(d.consumer_started(2), 3);
        assert_eq!((d.room(1), d.room(2)), (2, 3));
        let t1 = d.assign("q", 1, true, Some(1));
        d.assign("q", 2, true, Some(1));
        d.assign("q", 3, true, Some(2));
        assert_eq!((d.room(1), d.room(2)), (0, 2), "each consumer has its own limit");
        // Requeued but not yet back in the queue: still counts.
        let mut taken = d.take(t1, false, true).unwrap();
        assert_eq!(d.room(1), 0);
        d.settled(&taken.holders("q"));
        assert_eq!(d.room(1), 1);
        // Gets count against no consumer.
        d.assign("q", 4, true, None);
        assert_eq!((d.room(1), d.room(2)), (1, 2));
    }

    #[test]
    fn an_ack_gives_its_room_back_at_once_a_requeue_once_applied() {
        let d = Arc::new(Deliveries::default());
        d.set_prefetch(2, false);
        d.consumer_started(1);
        let t1 = d.assign("q", 1, true, Some(1));
        let t2 = d.assign("q", 2, true, Some(1));
        assert_eq!(d.room(1), 0);
        let woken = d.room.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        let mut acked = d.take(t1, false, false).unwrap();
        assert_eq!(d.room(1), 1, "acked: its room is back before the queue applies it");
        assert!(acked.holders("q").is_empty(), "nothing left to give back");
        assert!(futures::FutureExt::now_or_never(woken).is_some(), "a consumer waiting for room is woken");
        let mut requeued = d.take(t2, false, true).unwrap();
        assert_eq!(d.room(1), 1, "requeued: held until it is back in the queue");
        d.settled(&requeued.holders("q"));
        assert_eq!(d.room(1), 2);
    }

    #[test]
    fn a_global_limit_is_shared_by_the_channel() {
        let d = Deliveries::default();
        d.set_prefetch(3, true);
        d.consumer_started(1);
        d.consumer_started(2);
        assert_eq!(d.room(1), 3, "no per-consumer limit, the channel's applies");
        d.assign("q", 1, true, Some(1));
        d.assign("q", 2, true, Some(2));
        assert_eq!((d.room(1), d.room(2)), (1, 1));
        d.set_prefetch(1, false);
        d.consumer_started(3);
        d.assign("q", 3, true, Some(3));
        assert_eq!(d.room(3), 0, "both limits apply");
        assert_eq!(d.room(1), 0, "channel full");
        let mut taken = d.take(0, true, true).unwrap();
        assert_eq!(taken.len(), 3);
        d.settled(&taken.holders("q"));
        assert_eq!((d.room(1), d.room(3)), (3, 1));
    }

    #[test]
    fn room_claimed_by_one_consumer_is_not_given_to_another() {
        let d = Deliveries::default();
        d.set_prefetch(4, true);
        d.consumer_started(1);
        d.consumer_started(2);
        assert_eq!(d.reserve(1, u32::MAX), 4);
        assert_eq!(d.reserve(2, u32::MAX), 0, "consumer 1's get is in flight");
        d.assign("q", 1, true, Some(1));
        d.assign("q", 2, true, Some(1));
        d.release(1, 4);
        assert_eq!(d.reserve(2, u32::MAX), 2);
    }

    #[test]
    fn no_limit_means_batches_of_a_thousand() {
        let d = Deliveries::default();
        d.consumer_started(1);
        d.assign("q", 1, true, Some(1));
        assert_eq!(d.room(1), UNLIMITED_BATCH);
    }
}
