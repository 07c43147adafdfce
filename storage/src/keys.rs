//! Key encoding. Every key starts with the group id in big-endian so that one
//! group's keys are contiguous and sorted, and a group can be scanned or
//! dropped with one range.

use crate::GroupId;

/// Log tree key: `group(8) | index(8)`.
pub fn log_key(group: GroupId, index: u64) -> [u8; 16] {
    let mut k = [0u8; 16];
    k[..8].copy_from_slice(&group.to_be_bytes());
    k[8..].copy_from_slice(&index.to_be_bytes());
    k
}

/// Group part of any key (every key starts with its group).
pub fn key_group(key: &[u8]) -> GroupId {
    let mut b = [0u8; 8];
    b.copy_from_slice(&key[..8]);
    u64::from_be_bytes(b)
}

/// Index part of a log key.
pub fn log_key_index(key: &[u8]) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&key[8..16]);
    u64::from_be_bytes(b)
}

/// Raft meta tree key: `group(8) | tag(1)`.
pub fn meta_key(group: GroupId, tag: u8) -> [u8; 9] {
    let mut k = [0u8; 9];
    k[..8].copy_from_slice(&group.to_be_bytes());
    k[8] = tag;
    k
}

pub const META_VOTE: u8 = b'v';
pub const META_COMMITTED: u8 = b'c';
pub const META_PURGED: u8 = b'p';
/// Entries of a log rewrite committed but maybe not yet in the log
/// (see `NodeDb::rewrite_log`).
pub const META_REWRITE: u8 = b'r';

/// Node tree key of sled's mark (see `Wal::note_sled_mark`). Node values
/// of the broker are plain words; this cannot be one.
pub const SLED_MARK_KEY: &[u8] = b"\0storage.sled_mark";

/// What [`SLED_MARK_KEY`] holds: the mark, and the log's synced point
/// (segment, bytes) when sled was synced with it.
pub fn encode_sled_mark(mark: u64, (segment, bytes): (u64, u64)) -> [u8; 24] {
    let mut v = [0u8; 24];
    v[..8].copy_from_slice(&mark.to_be_bytes());
    v[8..16].copy_from_slice(&segment.to_be_bytes());
    v[16..].copy_from_slice(&bytes.to_be_bytes());
    v
}

/// The mark and the log's synced point, as [`encode_sled_mark`] made them.
pub fn decode_sled_mark(v: &[u8]) -> Option<(u64, (u64, u64))> {
    let v: &[u8; 24] = v.try_into().ok()?;
    let at = |i: usize| u64::from_be_bytes(v[i..i + 8].try_into().expect("8 bytes"));
    Some((at(0), (at(8), at(16))))
}

/// Prefix of everything a group owns in a tree.
pub fn group_prefix(group: GroupId) -> [u8; 8] {
    group.to_be_bytes()
}

pub fn encode<T: serde::Serialize>(v: &T, what: &'static str) -> Result<Vec<u8>, crate::StorageError> {
    bincode::serde::encode_to_vec(v, bincode::config::standard())
        .map_err(|source| crate::StorageError::Encode { what, source })
}

pub fn decode<T: serde::de::DeserializeOwned>(b: &[u8], what: &'static str) -> Result<T, crate::StorageError> {
    bincode::serde::decode_from_slice(b, bincode::config::standard())
        .map(|(v, _)| v)
        .map_err(|source| crate::StorageError::Decode { what, source })
}

/// Decode a value from the front of `b`, and say how many bytes it took.
pub fn decode_prefix<T: serde::de::DeserializeOwned>(
    b: &[u8],
    what: &'static str,
) -> Result<(T, usize), crate::StorageError> {
    bincode::serde::decode_from_slice(b, bincode::config::standard())
        .map_err(|source| crate::StorageError::Decode { what, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_keys_sort_by_group_then_index() {
        assert!(log_key(1, u64::MAX) < log_key(2, 0));
        assert!(log_key(1, 255) < log_key(1, 256));
        assert_eq!(log_key_index(&log_key(7, 123456)), 123456);
        assert_eq!(key_group(&log_key(7, 123456)), 7);
    }
}
