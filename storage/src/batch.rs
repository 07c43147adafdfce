//! A state-machine step's writes, and how they are made crash-atomic
//! without a sled batch.
//!
//! sled makes a `Tree::apply_batch` atomic by sealing its IO buffer twice
//! (before and after a batch manifest). Each seal is one more device write on
//! sled's IO thread pool, which wakes every one of its threads
//! (`notify_all`), and the next `flush` of a Raft append waits behind those
//! writes. With one message in flight that was three device writes and some
//! forty thread wake-ups per entry on every replica.
//!
//! A small step is therefore written as a redo record instead: the step's
//! commit record (the group's "applied" state) is inserted *first*, carrying
//! every write of the step, and then the writes are made one by one. sled
//! recovers a prefix of its writes after a crash, so after a restart either
//! the record is missing, and so is every write after it, or it is there and
//! replaying its writes ([`replay`]) completes the step: each write is a
//! plain put or remove of a final value, so replaying a finished step changes
//! nothing. A large step (over [`REDO_MAX_BYTES`]) goes through a sled batch,
//! where two seals are cheap next to the bytes, and so as not to write its
//! bytes twice.

use sled::IVec;

use crate::StorageError;

/// Steps whose writes add up to more than this go through a sled batch.
pub const REDO_MAX_BYTES: usize = 64 << 10;

/// Writes of one step, in order; a later write of a key wins.
#[derive(Default, Debug)]
pub struct Batch {
    ops: Vec<(IVec, Option<IVec>)>,
    bytes: usize,
}

impl Batch {
    pub fn insert(&mut self, key: impl Into<IVec>, value: impl Into<IVec>) {
        let (k, v) = (key.into(), value.into());
        self.bytes += k.len() + v.len();
        self.ops.push((k, Some(v)));
    }

    pub fn remove(&mut self, key: impl Into<IVec>) {
        let k = key.into();
        self.bytes += k.len();
        self.ops.push((k, None));
    }

    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    /// Bytes of keys and values.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    pub(crate) fn into_sled(self) -> sled::Batch {
        let mut b = sled::Batch::default();
        for (k, v) in self.ops {
            match v {
                Some(v) => b.insert(k, v),
                None => b.remove(k),
            }
        }
        b
    }

    pub(crate) fn ops(&self) -> &[(IVec, Option<IVec>)] {
        &self.ops
    }

    /// Append the redo encoding of the writes to `out`:
    /// `count u32 | (kind u8 | key_len u32 | key | [value_len u32 | value])*`,
    /// little-endian, kind 1 a put and 0 a remove.
    pub(crate) fn encode_redo(&self, out: &mut Vec<u8>) {
        out.reserve(4 + self.bytes + self.ops.len() * 9);
        out.extend_from_slice(&(self.ops.len() as u32).to_le_bytes());
        for (k, v) in &self.ops {
            out.push(v.is_some() as u8);
            out.extend_from_slice(&(k.len() as u32).to_le_bytes());
            out.extend_from_slice(k);
            if let Some(v) = v {
                out.extend_from_slice(&(v.len() as u32).to_le_bytes());
                out.extend_from_slice(v);
            }
        }
    }

    /// Decode writes encoded by [`Batch::encode_redo`]; empty input is no writes.
    pub(crate) fn decode_redo(mut b: &[u8]) -> Result<Batch, StorageError> {
        let mut out = Batch::default();
        if b.is_empty() {
            return Ok(out);
        }
        let n = take_u32(&mut b)?;
        for _ in 0..n {
            let kind = *take(&mut b, 1)?.first().expect("took one byte");
            let klen = take_u32(&mut b)? as usize;
            let k = take(&mut b, klen)?.to_vec();
            match kind {
                1 => {
                    let vlen = take_u32(&mut b)? as usize;
                    let v = take(&mut b, vlen)?.to_vec();
                    out.insert(k, v);
                }
                0 => out.remove(k),
                _ => return Err(StorageError::Redo("unknown write kind")),
            }
        }
        if !b.is_empty() {
            return Err(StorageError::Redo("trailing bytes"));
        }
        Ok(out)
    }
}

fn take<'a>(b: &mut &'a [u8], n: usize) -> Result<&'a [u8], StorageError> {
    if b.len() < n {
        return Err(StorageError::Redo("truncated"));
    }
    let (head, tail) = b.split_at(n);
    *b = tail;
    Ok(head)
}

fn take_u32(b: &mut &[u8]) -> Result<u32, StorageError> {
    Ok(u32::from_le_bytes(take(b, 4)?.try_into().expect("took four bytes")))
}

/// Apply `tree`'s writes of a redo record's tail one by one (after a
/// restart, before anything reads the state). Returns how many there were.
pub(crate) fn replay(tree: &sled::Tree, redo: &[u8]) -> Result<usize, StorageError> {
    let batch = Batch::decode_redo(redo)?;
    apply_each(tree, &batch)?;
    Ok(batch.ops.len())
}

pub(crate) fn apply_each(tree: &sled::Tree, batch: &Batch) -> Result<(), StorageError> {
    for (k, v) in batch.ops() {
        match v {
            Some(v) => tree.insert(k, v.clone())?,
            None => tree.remove(k)?,
        };
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redo_encoding_round_trips_puts_and_removes_in_order() {
        let mut b = Batch::default();
        b.insert(b"k1".to_vec(), b"v1".to_vec());
        b.remove(b"k2".to_vec());
        b.insert(b"k1".to_vec(), vec![0u8; 300]);
        b.insert(Vec::new(), Vec::new());
        let mut enc = b"prefix".to_vec();
        b.encode_redo(&mut enc);
        let back = Batch::decode_redo(&enc[6..]).unwrap();
        assert_eq!(back.ops(), b.ops());
        assert_eq!(back.bytes(), b.bytes());
        assert!(Batch::decode_redo(&[]).unwrap().is_empty());
    }

    #[test]
    fn a_damaged_redo_record_is_an_error_not_a_partial_replay() {
        let mut b = Batch::default();
        b.insert(b"key".to_vec(), b"value".to_vec());
        let mut enc = Vec::new();
        b.encode_redo(&mut enc);
        for cut in 1..enc.len() {
            assert!(Batch::decode_redo(&enc[..cut]).is_err(), "cut at {cut}");
        }
        let mut extra = enc.clone();
        extra.push(0);
        assert!(Batch::decode_redo(&extra).is_err());
        let mut bad_kind = enc;
        bad_kind[4] = 7;
        assert!(Batch::decode_redo(&bad_kind).is_err());
    }
}
