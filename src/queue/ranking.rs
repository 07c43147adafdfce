//! Consumer priorities (`x-priority`) at a queue's master.
//!
//! As RabbitMQ: messages go to the consumers of the highest priority while
//! they have room in their prefetch, and to lower ones only while those are
//! blocked. A consumer here pulls: it asks its queue's master with gets
//! while it has room, and stops asking when its prefetch is full. So the
//! master counts a consumer as having room while one of its gets is in
//! flight or its last ended moments ago, and a get of a lower-priority
//! consumer waits out such a consumer and then goes away empty.
//!
//! Kept in memory at the master only: which consumers have room changes
//! with every get, and a new master learns it again from the next gets.
//! Only the gets of registered consumers (those with a priority or on a
//! single-active-consumer queue) come here: a queue without them pays
//! nothing.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long after its last get ended a consumer still counts as having
/// room: the time a consumer with room takes between two gets.
pub const RECENT: Duration = Duration::from_millis(100);
/// A consumer not heard from for this long is forgotten.
const FORGET: Duration = Duration::from_secs(10);

/// A consumer: its channel owner and its number on the channel.
pub type ConsumerKey = (u64, u64);

#[derive(Default)]
pub struct Ranking {
    askers: Mutex<HashMap<ConsumerKey, Asker>>,
}

struct Asker {
    priority: i32,
    in_flight: u32,
    last: Instant,
}

impl Ranking {
    /// A get of consumer `who` of `priority` starts; it counts as asking
    /// until the returned guard drops.
    pub fn begin(&self, who: ConsumerKey, priority: i32) -> Asking<'_> {
        let now = Instant::now();
        let mut askers = self.askers.lock().expect("poisoned");
        askers.retain(|_, a| a.in_flight > 0 || now.duration_since(a.last) < FORGET);
        let a = askers.entry(who).or_insert(Asker { priority, in_flight: 0, last: now });
        a.priority = priority;
        a.in_flight += 1;
        Asking { ranking: self, who }
    }

    /// Is a consumer of a priority above `priority` asking, or did it
    /// moments ago?
    pub fn outranked(&self, priority: i32) -> bool {
        let now = Instant::now();
        let askers = self.askers.lock().expect("poisoned");
        askers.values().any(|a| a.priority > priority && (a.in_flight > 0 || now.duration_since(a.last) < RECENT))
    }
}

/// A get in flight (see [`Ranking::begin`]).
pub struct Asking<'a> {
    ranking: &'a Ranking,
    who: ConsumerKey,
}

impl Drop for Asking<'_> {
    fn drop(&mut self) {
        let mut askers = self.ranking.askers.lock().expect("poisoned");
        if let Some(a) = askers.get_mut(&self.who) {
            a.in_flight = a.in_flight.saturating_sub(1);
            a.last = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lower_priority_waits_while_a_higher_one_asks_and_moments_after() {
        let r = Ranking::default();
        let high = r.begin((1, 1), 10);
        let low = r.begin((2, 1), 0);
        assert!(r.outranked(0), "a get of priority 10 is in flight");
        assert!(!r.outranked(10), "no one above 10");
        drop(high);
        assert!(r.outranked(0), "its get just ended: it still has room");
        std::thread::sleep(RECENT + Duration::from_millis(20));
        assert!(!r.outranked(0), "blocked: it stopped asking");
        drop(low);
        let again = r.begin((1, 1), 10);
        assert!(r.outranked(5));
        drop(again);
    }
}
