//! Message bodies on disk: one record ("chunk") per run of consecutive seqs
//! written together — the publishes of one Raft entry, or one run of bodies
//! a catching-up mirror fetched.
//!
//! A key per message made sled copy a leaf page for every message published
//! and again for every message consumed, on every replica: half of a
//! master's CPU went there. A chunk costs one insert per entry and one
//! removal once none of its messages is held any more; which messages are
//! held is the state machine's knowledge, not the chunk's, so a consumed
//! message's bytes stay in its chunk until the chunk goes (as in RabbitMQ's
//! segment files).
//!
//! Value layout: `count` (u32 LE), `count + 1` offsets (u32 LE) into the data
//! that follows, then each message as encoded by [`keys::encode`]. The key is
//! `B` + the first seq (big-endian), so the chunk holding a seq is the last
//! chunk key at or below it.

use mirrorq_storage::{keys, SmSpace, StorageError};

use super::types::Message;

const PREFIX: u8 = b'B';

/// A chunk takes no more messages once it holds this many bytes: sled keeps
/// large values poorly (a node holding 1M x 1 KiB grew to 1,286 MB of RSS in
/// chunks of 200 KB, 424 MB in 16 KiB, 316 MB in 4 KiB; msg/s alike), and a
/// small chunk frees its space sooner.
pub const FULL_BYTES: usize = 4 * 1024;

pub fn key(first: u64) -> [u8; 9] {
    let mut k = [PREFIX; 9];
    k[1..].copy_from_slice(&first.to_be_bytes());
    k
}

fn first_of(k: &[u8]) -> u64 {
    u64::from_be_bytes(k[1..9].try_into().expect("chunk key is 9 bytes"))
}

fn corrupt(why: &'static str) -> StorageError {
    StorageError::Decode { what: "message chunk", source: bincode::error::DecodeError::Other(why) }
}

/// Builds the value of a chunk from consecutive seqs.
pub struct ChunkWriter {
    first: u64,
    offsets: Vec<u32>,
    data: Vec<u8>,
}

impl ChunkWriter {
    pub fn new(first: u64) -> Self {
        Self { first, offsets: vec![0], data: Vec::new() }
    }

    pub fn first(&self) -> u64 {
        self.first
    }

    /// The seq the next pushed message gets.
    pub fn end(&self) -> u64 {
        self.first + (self.offsets.len() as u64 - 1)
    }

    /// Holds [`FULL_BYTES`] or more: the next message starts a new chunk.
    pub fn is_full(&self) -> bool {
        self.data.len() >= FULL_BYTES
    }

    pub fn push_encoded(&mut self, encoded: &[u8]) {
        self.data.extend_from_slice(encoded);
        self.offsets.push(self.data.len() as u32);
    }

    /// Encode `m` straight into the chunk (as [`keys::encode`] would).
    pub fn push(&mut self, m: &Message) -> Result<(), StorageError> {
        bincode::serde::encode_into_std_write(m, &mut self.data, bincode::config::standard())
            .map_err(|source| StorageError::Encode { what: "message body", source })?;
        self.offsets.push(self.data.len() as u32);
        Ok(())
    }

    pub fn finish(&self) -> Vec<u8> {
        let count = self.offsets.len() - 1;
        let mut out = Vec::with_capacity(4 + 4 * self.offsets.len() + self.data.len());
        out.extend_from_slice(&(count as u32).to_le_bytes());
        for o in &self.offsets {
            out.extend_from_slice(&o.to_le_bytes());
        }
        out.extend_from_slice(&self.data);
        out
    }
}

/// A stored chunk, read once and sliced per message.
#[derive(Clone)]
pub struct Chunk {
    first: u64,
    count: u32,
    raw: sled::IVec,
}

impl Chunk {
    pub fn parse(first: u64, raw: sled::IVec) -> Result<Self, StorageError> {
        let count = raw.get(..4).ok_or_else(|| corrupt("no header"))?;
        let count = u32::from_le_bytes(count.try_into().expect("4 bytes"));
        let header = 4 + 4 * (count as usize + 1);
        if raw.len() < header {
            return Err(corrupt("short header"));
        }
        let c = Self { first, count, raw };
        if c.offset(count) as usize != c.raw.len() - header {
            return Err(corrupt("offsets do not match its length"));
        }
        Ok(c)
    }

    pub fn first(&self) -> u64 {
        self.first
    }

    /// One past the last seq in the chunk.
    pub fn end(&self) -> u64 {
        self.first + self.count as u64
    }

    pub fn contains(&self, seq: u64) -> bool {
        (self.first..self.end()).contains(&seq)
    }

    fn offset(&self, i: u32) -> u32 {
        let at = 4 + 4 * i as usize;
        u32::from_le_bytes(self.raw[at..at + 4].try_into().expect("4 bytes"))
    }

    /// The message under `seq`, as encoded.
    pub fn encoded(&self, seq: u64) -> Result<Option<&[u8]>, StorageError> {
        if !self.contains(seq) {
            return Ok(None);
        }
        let i = (seq - self.first) as u32;
        let data = 4 + 4 * (self.count as usize + 1);
        let (from, to) = (self.offset(i) as usize, self.offset(i + 1) as usize);
        if from > to || data + to > self.raw.len() {
            return Err(corrupt("offsets out of order"));
        }
        Ok(Some(&self.raw[data + from..data + to]))
    }

    pub fn message(&self, seq: u64) -> Result<Option<Message>, StorageError> {
        self.encoded(seq)?.map(|b| keys::decode(b, "message body")).transpose()
    }
}

/// The chunk holding `seq`, if this replica has one.
pub fn find(space: &SmSpace, seq: u64) -> Result<Option<Chunk>, StorageError> {
    // Reading in seq order (a consumer, a drain) meets each chunk at its
    // first seq: a point lookup then, cheaper in sled than the reverse scan.
    if let Some(v) = space.get(&key(seq))? {
        let c = Chunk::parse(seq, v)?;
        if c.contains(seq) {
            return Ok(Some(c));
        }
    }
    match space.last_in(&key(0), &key(seq))? {
        Some((k, v)) => {
            let c = Chunk::parse(first_of(&k), v)?;
            Ok(c.contains(seq).then_some(c))
        }
        None => Ok(None),
    }
}

/// Every chunk holding a seq in `[start, end)`, in seq order.
pub fn overlapping(space: &SmSpace, start: u64, end: u64) -> Result<Vec<Chunk>, StorageError> {
    let mut out = Vec::new();
    if start >= end {
        return Ok(out);
    }
    out.extend(find(space, start)?);
    for kv in space.range(&key(start.saturating_add(1)), &key(end)) {
        let (k, v) = kv?;
        out.push(Chunk::parse(first_of(&k), v)?);
    }
    Ok(out)
}

/// Every chunk of the group.
pub fn all(space: &SmSpace) -> impl Iterator<Item = Result<Chunk, StorageError>> + '_ {
    space.scan(&[PREFIX]).map(|kv| kv.and_then(|(k, v)| Chunk::parse(first_of(&k), v)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(body: &str) -> Message {
        Message { exchange: String::new(), routing_key: "q".into(), properties: vec![1, 2], body: body.into() }
    }

    #[test]
    fn a_chunk_gives_back_each_message_by_seq() {
        let mut w = ChunkWriter::new(40);
        w.push(&msg("a")).unwrap();
        for b in ["", "ccc"] {
            w.push_encoded(&keys::encode(&msg(b), "test").unwrap());
        }
        assert_eq!(w.end(), 43);
        let c = Chunk::parse(40, w.finish().into()).unwrap();
        assert_eq!((c.first(), c.end()), (40, 43));
        assert_eq!(c.message(40).unwrap(), Some(msg("a")));
        assert_eq!(c.message(41).unwrap(), Some(msg("")));
        assert_eq!(c.message(42).unwrap(), Some(msg("ccc")));
        assert_eq!(c.message(43).unwrap(), None);
        assert_eq!(c.message(39).unwrap(), None);
    }

    #[test]
    fn a_damaged_chunk_is_an_error_not_a_panic() {
        let mut w = ChunkWriter::new(0);
        w.push_encoded(&keys::encode(&msg("abc"), "test").unwrap());
        let good = w.finish();
        for cut in [0, 3, 8, good.len() - 1] {
            assert!(Chunk::parse(0, good[..cut].to_vec().into()).is_err(), "cut at {cut}");
        }
        let mut bad = good.clone();
        bad[4..8].copy_from_slice(&1000u32.to_le_bytes());
        let c = Chunk::parse(0, bad.into());
        assert!(c.is_err() || c.unwrap().encoded(0).is_err());
    }
}
