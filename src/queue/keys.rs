//! The layout of a queue group's key space (group-relative keys), read and
//! written by the state-machine adapter (`sm.rs`):
//! - `c`            counters (next seq, tag, order of tracked seqs)
//! - `s` + seq(8)   `MsgState` of a requeued message (or of one restored
//!   from a snapshot); scanned at start with the runs to rebuild the index
//!   (never-delivered messages are a range given by the counters, so a deep
//!   queue restarts without reading it)
//! - `u` + tag(8)   a run of messages delivered together, keyed by its first
//!   tag ([`super::runs`])
//! - `R` + seq(8)   where in the log the bodies from seq on are (an entry
//!   applied since the last snapshot; [`super::bodies`])
//! - `B` + seq(8)   a chunk of message bodies from seq on ([`super::bodies`]),
//!   copied out of the log before a snapshot, or fetched; removed once
//!   none of its messages is held
//! - `h` + origin(24) an old-epoch entry whose messages were handed back
//! - `e`            the `ForkRecord` of the group's current epoch, if re-formed
//! - `y`            the catch-up `Plan`: bodies this replica still lacks
//!   after installing a snapshot (absent once it has them all)
//! - `x` + seq(8)   deadline (ms) of a message published with a TTL of its own
//! - `t` + seq(8)   publish time (ms, master's clock) of the run of messages
//!   starting at seq; only for queues with a TTL
//! - `n` + seq(8)   how many times a held message was returned (its
//!   `x-delivery-count`), for messages returned at least once

use mirrorq_storage::{keys, SmSpace, StorageError};

use super::types::{Origin, Registration};

pub(super) const COUNTERS: &[u8] = b"c";
pub(super) const FORK: &[u8] = b"e";
pub(super) const PLAN: &[u8] = b"y";

pub(super) fn state_key(seq: u64) -> [u8; 9] {
    let mut k = [b's'; 9];
    k[1..].copy_from_slice(&seq.to_be_bytes());
    k
}

pub(super) fn handed_key((term, node, index): Origin) -> [u8; 25] {
    let mut k = [b'h'; 25];
    k[1..9].copy_from_slice(&term.to_be_bytes());
    k[9..17].copy_from_slice(&node.to_be_bytes());
    k[17..].copy_from_slice(&index.to_be_bytes());
    k
}

pub(super) fn handed_origin(k: &[u8]) -> Origin {
    let n = |r: std::ops::Range<usize>| u64::from_be_bytes(k[r].try_into().expect("handed key is 25 bytes"));
    (n(1..9), n(9..17), n(17..25))
}

pub(super) fn time_key(seq: u64) -> [u8; 9] {
    let mut k = [b't'; 9];
    k[1..].copy_from_slice(&seq.to_be_bytes());
    k
}

/// A registered consumer: its channel owner and number.
pub(super) fn consumer_key(owner: u64, number: u64) -> [u8; 17] {
    let mut k = [b'k'; 17];
    k[1..9].copy_from_slice(&owner.to_be_bytes());
    k[9..].copy_from_slice(&number.to_be_bytes());
    k
}

/// A consumer registration as stored: (channel owner, number) and what it registered.
pub(super) type Registered = ((u64, u64), Registration);

pub(super) fn stored_consumers(space: &SmSpace) -> Result<Vec<Registered>, StorageError> {
    let mut out = Vec::new();
    for kv in space.scan(b"k") {
        let (k, v) = kv?;
        let n = |r: std::ops::Range<usize>| u64::from_be_bytes(k[r].try_into().expect("consumer key is 17 bytes"));
        out.push(((n(1..9), n(9..17)), keys::decode::<Registration>(&v, "consumer registration")?));
    }
    Ok(out)
}

pub(super) fn returns_key(seq: u64) -> [u8; 9] {
    let mut k = [b'n'; 9];
    k[1..].copy_from_slice(&seq.to_be_bytes());
    k
}

pub(super) fn deadline_key(seq: u64) -> [u8; 9] {
    let mut k = [b'x'; 9];
    k[1..].copy_from_slice(&seq.to_be_bytes());
    k
}

/// `seq -> u64` pairs stored under `prefix` (publish times, deadlines,
/// counts of returns).
pub(super) fn stored_times(space: &SmSpace, prefix: &[u8]) -> Result<Vec<(u64, u64)>, StorageError> {
    let mut out = Vec::new();
    for kv in space.scan(prefix) {
        let (k, v) = kv?;
        let seq = u64::from_be_bytes(k[1..9].try_into().expect("time key is 9 bytes"));
        let at = u64::from_be_bytes(v.as_ref().try_into().map_err(|_| StorageError::Decode {
            what: "publish time",
            source: bincode::error::DecodeError::Other("publish time is not 8 bytes"),
        })?);
        out.push((seq, at));
    }
    Ok(out)
}

/// The stored counts of returns (`n` keys).
pub(super) fn counts_of_returns(space: &SmSpace) -> Result<Vec<(u64, u32)>, StorageError> {
    let counts = stored_times(space, b"n")?;
    Ok(counts.into_iter().map(|(seq, n)| (seq, u32::try_from(n).unwrap_or(u32::MAX))).collect())
}
