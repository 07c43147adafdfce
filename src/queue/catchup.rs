//! Which message bodies a replica still lacks after installing a snapshot.
//!
//! A snapshot sent to a replica carries the queue's *index* (counters and
//! the states of delivered and requeued messages) but no bodies: a deep
//! queue's bodies are far too large to serialize under the state machine's
//! lock, which would stop the queue while a mirror joins. The replica
//! installs the index at once, records which held messages it has no body
//! for (a [`Plan`]), and fetches those bodies from the master in chunks
//! while the queue goes on (`node::catchup`). Until its plan is done the
//! replica is not synchronised: confirms do not wait for it and it never
//! stands for election, so it can never serve a message it does not have.
//!
//! With `ha-sync-mode: manual` the fetch waits for a `sync` action, so a new
//! mirror holds only what was published after it joined (RabbitMQ's
//! behaviour), and `cancel_sync` pauses it again.

use std::collections::BTreeSet;
use std::ops::Range;

use serde::{Deserialize, Serialize};

/// Bodies a replica lacks, and how far fetching them has come.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Plan {
    /// Seq ranges `[start, end)`, ascending and disjoint, of messages this
    /// replica's state holds but has no body for.
    pub missing: Vec<(u64, u64)>,
    pub msgs_total: u64,
    pub msgs_done: u64,
    pub bytes_done: u64,
    /// Size of everything to fetch, as the master counted it (first chunk).
    pub bytes_total: Option<u64>,
}

impl Plan {
    /// Is `seq` among the messages without a body?
    pub fn lacks(&self, seq: u64) -> bool {
        let i = self.missing.partition_point(|(_, end)| *end <= seq);
        self.missing.get(i).is_some_and(|(start, _)| *start <= seq)
    }

    /// The master has answered for everything below `upto`: of that part,
    /// only the seqs `still_lacking` says are still held here without a
    /// body stay in the plan. The master leaves out what it no longer holds
    /// (consumed there, not yet here: those go once this replica applies
    /// as far) and what it lacks itself; either way the replica must not
    /// call itself synchronised while it holds a message without its body,
    /// or it could become a master that cannot deliver it.
    pub fn advance(&mut self, upto: u64, still_lacking: impl Fn(u64) -> bool) {
        let mut out: Vec<(u64, u64)> = Vec::with_capacity(self.missing.len());
        for &(start, end) in &self.missing {
            for seq in (start..end.min(upto)).filter(|s| still_lacking(*s)) {
                match out.last_mut() {
                    Some((_, e)) if *e == seq => *e += 1,
                    _ => out.push((seq, seq + 1)),
                }
            }
            if end > upto {
                match out.last_mut() {
                    Some((_, e)) if *e == start.max(upto) => *e = end,
                    _ => out.push((start.max(upto), end)),
                }
            }
        }
        self.missing = out;
    }

    pub fn is_done(&self) -> bool {
        self.missing.is_empty()
    }

    pub fn progress(&self, running: bool) -> SyncProgress {
        SyncProgress {
            msgs_done: self.msgs_done,
            msgs_total: self.msgs_total,
            bytes_done: self.bytes_done,
            bytes_total: self.bytes_total,
            running,
        }
    }
}

/// How a replica's catch-up stands, as reported to the master and the API.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyncProgress {
    pub msgs_done: u64,
    pub msgs_total: u64,
    pub bytes_done: u64,
    pub bytes_total: Option<u64>,
    /// Fetching now (false: a manual mirror waiting for `sync`, or cancelled).
    pub running: bool,
}

/// The held seqs (never-delivered range `fresh` plus the `tracked` ones,
/// delivered or requeued) that have no body in `present`, as ranges, and
/// their number.
pub fn missing_ranges(fresh: Range<u64>, tracked: &BTreeSet<u64>, present: &BTreeSet<u64>) -> (Vec<(u64, u64)>, u64) {
    let held = tracked.range(..fresh.start).copied().chain(fresh.clone()).chain(tracked.range(fresh.start..).copied());
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut count = 0;
    for seq in held.filter(|s| !present.contains(s)) {
        count += 1;
        match out.last_mut() {
            Some((_, end)) if *end == seq => *end += 1,
            _ => out.push((seq, seq + 1)),
        }
    }
    (out, count)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_ranges_cover_held_messages_without_bodies() {
        let tracked = BTreeSet::from([2, 3, 40, 1 << 63]);
        let present = BTreeSet::from([3, 12, 13, 99]);
        let (ranges, n) = missing_ranges(10..15, &tracked, &present);
        assert_eq!(ranges, vec![(2, 3), (10, 12), (14, 15), (40, 41), (1 << 63, (1 << 63) + 1)]);
        assert_eq!(n, 6);
        let (ranges, n) = missing_ranges(5..5, &BTreeSet::new(), &BTreeSet::new());
        assert!(ranges.is_empty() && n == 0, "an empty queue lacks nothing");
    }

    #[test]
    fn plan_knows_what_it_lacks_and_advances() {
        let mut p = Plan { missing: vec![(2, 3), (10, 15), (40, 41)], ..Plan::default() };
        assert!(p.lacks(2) && p.lacks(10) && p.lacks(14) && p.lacks(40));
        assert!(!p.lacks(3) && !p.lacks(9) && !p.lacks(15) && !p.lacks(41));
        p.advance(12, |_| false);
        assert_eq!(p.missing, vec![(12, 15), (40, 41)]);
        assert!(!p.lacks(11));
        p.advance(41, |_| false);
        assert!(p.is_done());
    }

    #[test]
    fn what_the_master_left_out_but_is_still_held_stays_in_the_plan() {
        let mut p = Plan { missing: vec![(2, 3), (10, 15), (40, 41)], ..Plan::default() };
        p.advance(13, |s| s == 2 || s == 11 || s == 12);
        assert_eq!(p.missing, vec![(2, 3), (11, 15), (40, 41)], "12 joins the part not answered yet");
        p.advance(50, |s| s == 11);
        assert_eq!(p.missing, vec![(11, 12)]);
        assert!(p.lacks(11) && !p.lacks(2) && !p.lacks(40));
        p.advance(12, |_| false);
        assert!(p.is_done(), "consumed here meanwhile: nothing left to fetch");
    }
}
