//! Delivered, unacknowledged messages on disk, as runs.
//!
//! A get takes messages from the head of the queue, so the messages it
//! delivers have consecutive seqs and consecutive tags, all for one owner.
//! Recording each under a key of its own cost a sled insert per delivered
//! message and a removal per ack, on every replica. A run records them in
//! one value (`u` + first tag, unique as tags are never reused): first seq,
//! owner, length and which of them are still unacked. An ack rewrites the run (or removes it once none is
//! left), once per entry however many of its messages the entry settles.
//!
//! A run is only extended within the entry that started it, so runs never
//! need merging. Messages delivered again after a requeue start runs of
//! their own, which may lie inside an older run's range: a seq's run is
//! found through an index of the live ones, not by range.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use mirrorq_storage::{keys, Batch, SmSpace, StorageError};

use super::types::MsgState;

const PREFIX: u8 = b'u';

fn key(first_tag: u64) -> [u8; 9] {
    let mut k = [PREFIX; 9];
    k[1..].copy_from_slice(&first_tag.to_be_bytes());
    k
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Run {
    first_seq: u64,
    owner: u64,
    len: u32,
    /// Bit `i`: the run's `i`th message is still unacked.
    live: Vec<u64>,
}

impl Run {
    fn new(seq: u64, owner: u64) -> Self {
        Self { first_seq: seq, owner, len: 1, live: vec![1] }
    }

    fn is_live(&self, i: u64) -> bool {
        i < self.len as u64 && self.live[(i / 64) as usize] & (1 << (i % 64)) != 0
    }

    fn push(&mut self) {
        let i = self.len as u64;
        if i.is_multiple_of(64) {
            self.live.push(0);
        }
        self.live[(i / 64) as usize] |= 1 << (i % 64);
        self.len += 1;
    }

    fn clear(&mut self, i: u64) {
        self.live[(i / 64) as usize] &= !(1 << (i % 64));
    }

    fn is_empty(&self) -> bool {
        self.live.iter().all(|w| *w == 0)
    }
}

/// The runs of one queue, as stored plus what the current entry changed.
#[derive(Debug, Default)]
pub struct Runs {
    by_tag: BTreeMap<u64, Run>,
    /// Live seq -> the first tag of its run.
    run_of: HashMap<u64, u64>,
    /// The run the current entry may still extend.
    open: Option<u64>,
    /// Runs changed by the current entry, to write with it.
    dirty: BTreeSet<u64>,
}

impl Runs {
    /// The stored runs, and the unacked messages they hold as `(seq, state)`.
    pub fn load(space: &SmSpace) -> Result<(Self, Vec<(u64, MsgState)>), StorageError> {
        let mut runs = Self::default();
        let mut states = Vec::new();
        for kv in space.scan(&[PREFIX]) {
            let (k, v) = kv?;
            let tag = u64::from_be_bytes(k[1..9].try_into().expect("run key is 9 bytes"));
            let run: Run = keys::decode(&v, "delivery run")?;
            if run.live.len() as u64 != (run.len as u64).div_ceil(64) {
                return Err(StorageError::Decode {
                    what: "delivery run",
                    source: bincode::error::DecodeError::Other("live bits do not match its length"),
                });
            }
            for i in (0..run.len as u64).filter(|i| run.is_live(*i)) {
                runs.run_of.insert(run.first_seq + i, tag);
                states.push((run.first_seq + i, MsgState::Unacked { tag: tag + i, owner: run.owner }));
            }
            runs.by_tag.insert(tag, run);
        }
        Ok((runs, states))
    }

    /// A new entry: runs from earlier entries are closed.
    pub fn begin_entry(&mut self) {
        self.open = None;
    }

    /// Is `seq` recorded in a run (delivered, not yet settled)?
    pub fn holds(&self, seq: u64) -> bool {
        self.run_of.contains_key(&seq)
    }

    /// `seq` was delivered under `tag` to `owner`.
    pub fn delivered(&mut self, seq: u64, tag: u64, owner: u64) {
        debug_assert!(!self.holds(seq), "delivered twice without settling");
        if let Some(first) = self.open {
            let run = self.by_tag.get_mut(&first).expect("open run exists");
            let n = run.len as u64;
            if run.first_seq + n == seq && first + n == tag && run.owner == owner {
                run.push();
                self.run_of.insert(seq, first);
                return;
            }
        }
        self.by_tag.insert(tag, Run::new(seq, owner));
        self.run_of.insert(seq, tag);
        self.open = Some(tag);
        self.dirty.insert(tag);
    }

    /// `seq` left its run (acked, rejected, requeued); false if it was in none.
    pub fn settle(&mut self, seq: u64) -> bool {
        let Some(first) = self.run_of.remove(&seq) else { return false };
        let run = self.by_tag.get_mut(&first).expect("indexed run exists");
        run.clear(seq - run.first_seq);
        self.dirty.insert(first);
        true
    }

    /// Write the runs the current entry changed.
    pub fn write(&mut self, space: &SmSpace, batch: &mut Batch) -> Result<(), StorageError> {
        for first in std::mem::take(&mut self.dirty) {
            match self.by_tag.get(&first) {
                Some(run) if run.is_empty() => {
                    self.by_tag.remove(&first);
                    if self.open == Some(first) {
                        self.open = None;
                    }
                    batch.remove(space.key(&key(first)));
                }
                Some(run) => batch.insert(space.key(&key(first)), keys::encode(run, "delivery run")?),
                None => {}
            }
        }
        Ok(())
    }

    /// Forget every run (the space is being replaced).
    pub fn clear(&mut self) {
        *self = Self::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn consecutive_deliveries_of_one_entry_share_a_run() {
        let mut r = Runs::default();
        r.begin_entry();
        for i in 0..70 {
            r.delivered(100 + i, 5 + i, 9);
        }
        // Another owner, or a gap, starts a new run.
        r.delivered(170, 75, 8);
        r.delivered(172, 76, 8);
        assert_eq!(r.by_tag.len(), 3);
        assert!(r.holds(100) && r.holds(169) && r.holds(170) && r.holds(172));
        assert!(!r.holds(171) && !r.holds(99) && !r.holds(173));
        r.begin_entry();
        r.delivered(173, 77, 8);
        assert_eq!(r.by_tag.len(), 4, "runs are not extended by a later entry");
    }

    #[test]
    fn a_redelivery_inside_an_older_runs_range_settles_the_right_run() {
        let mut r = Runs::default();
        r.begin_entry();
        for i in 0..10 {
            r.delivered(50 + i, i, 1);
        }
        assert!(r.settle(52));
        r.begin_entry();
        // 52 requeued and delivered again: a run of its own inside 50..60.
        r.delivered(52, 10, 1);
        for seq in [53, 55, 59] {
            assert!(r.settle(seq), "{seq} is in the first run");
        }
        assert!(r.settle(52) && !r.settle(52));
        assert_eq!(r.by_tag[&0].live, vec![0b1111111111 & !(1 << 2) & !(1 << 3) & !(1 << 5) & !(1 << 9)]);
        assert!(r.by_tag[&10].is_empty());
    }

    #[test]
    fn settling_clears_and_an_empty_run_is_dropped() {
        let mut r = Runs::default();
        r.begin_entry();
        r.delivered(0, 1, 2);
        r.delivered(1, 2, 2);
        assert!(r.settle(0));
        assert!(!r.settle(0), "settled once");
        assert!(!r.settle(5), "never delivered");
        assert!(r.holds(1) && !r.holds(0));
        assert!(r.settle(1));
        assert!(r.by_tag[&1].is_empty());
    }
}
