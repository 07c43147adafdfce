//! Message bodies on disk, in one of two places.
//!
//! **In the log.** A publish's bodies are already in its Raft entry, synced
//! on every replica before the confirm. Applying the entry records only a
//! [`LogRef`] (key `R` + first seq): which entry, and which of its messages
//! got which seqs. Bodies consumed before the group's next snapshot are never
//! written again: every body used to be written to the log and again to
//! sled, and sled rewrote leaves as chunks were removed (a node wrote 2.5-3.5
//! times the bodies of a drain, and each of those writes slowed the syncs of
//! confirms on the shared disk).
//!
//! **In chunks.** A snapshot lets the log go, so before one is taken the
//! bodies still held are copied out of the log into chunks (key `B` + first
//! seq): one record per run of consecutive seqs. So are the bodies a
//! catching-up mirror fetches, which are in no entry of its log. A chunk is
//! removed once none of its messages is held any more; which messages are
//! held is the state machine's knowledge, not the chunk's, so a consumed
//! message's bytes stay in its chunk until the chunk goes (as in RabbitMQ's
//! segment files).
//!
//! Chunk value layout: `count` (u32 LE), `count + 1` offsets (u32 LE) into
//! the data that follows, then each message as encoded by [`keys::encode`].
//! The chunk holding a seq is the last chunk key at or below it; the same
//! goes for references.

use openraft::EntryPayload;
use serde::{Deserialize, Serialize};

use mirrorq_storage::{keys, SmSpace, StorageError};

use super::types::Message;
use super::QueueTypes;

const PREFIX: u8 = b'B';
const REF_PREFIX: u8 = b'R';

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

pub fn ref_key(first: u64) -> [u8; 9] {
    let mut k = [REF_PREFIX; 9];
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

/// The chunk holding `seq`, if this replica has one (references aside).
pub fn find_chunk(space: &SmSpace, seq: u64) -> Result<Option<Chunk>, StorageError> {
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

/// The body of `seq` wherever this replica has it: its chunk, or its entry
/// in the log.
pub fn find(space: &SmSpace, seq: u64) -> Result<Option<Chunk>, StorageError> {
    if let Some(c) = find_chunk(space, seq)? {
        return Ok(Some(c));
    }
    match find_ref(space, seq)? {
        Some((first, r)) => r.resolve(space, first),
        None => Ok(None),
    }
}

/// Every chunk or referenced entry holding a seq in `[start, end)`, in seq
/// order, each seq in one of them (references resolved).
///
/// Read without the state machine's lock (a mirror's catch-up), so bodies
/// may move from the log into chunks meanwhile. References are read first:
/// a body moved before they are read is in a chunk when chunks are read,
/// one moved after was resolved already (or, its entry purged that fast,
/// is in a chunk by then too). A body seen in both places is kept once.
pub fn overlapping(space: &SmSpace, start: u64, end: u64) -> Result<Vec<Chunk>, StorageError> {
    let mut out = Vec::new();
    if start >= end {
        return Ok(out);
    }
    let mut refs: Vec<(u64, LogRef)> = find_ref(space, start)?.into_iter().collect();
    for kv in space.range(&ref_key(start.saturating_add(1)), &ref_key(end)) {
        let (k, v) = kv?;
        refs.push((first_of(&k), LogRef::decode(&v)?));
    }
    for (first, r) in refs {
        out.extend(r.resolve(space, first)?);
    }
    out.extend(find_chunk(space, start)?);
    for kv in space.range(&key(start.saturating_add(1)), &key(end)) {
        let (k, v) = kv?;
        out.push(Chunk::parse(first_of(&k), v)?);
    }
    Ok(disjoint(out))
}

/// Every chunk of the group and every referenced entry still in the log,
/// in seq order, each seq in one of them (read in the order
/// [`overlapping`] explains).
pub fn all(space: &SmSpace) -> Result<Vec<Chunk>, StorageError> {
    let mut out = Vec::new();
    for r in all_refs(space) {
        let (first, r) = r?;
        out.extend(r.resolve(space, first)?);
    }
    for kv in space.scan(&[PREFIX]) {
        let (k, v) = kv?;
        out.push(Chunk::parse(first_of(&k), v)?);
    }
    Ok(disjoint(out))
}

/// In seq order, without a chunk whose seqs an earlier one holds: a body
/// copied out of the log while being read shows up twice (an entry's
/// chunk, then the held part of it), with the same bytes.
fn disjoint(mut chunks: Vec<Chunk>) -> Vec<Chunk> {
    // The larger first: the copy of a whole entry covers its parts.
    chunks.sort_by_key(|c| (c.first(), std::cmp::Reverse(c.end())));
    let mut out: Vec<Chunk> = Vec::with_capacity(chunks.len());
    for c in chunks {
        if out.last().is_some_and(|p| p.end() > c.first()) {
            continue;
        }
        out.push(c);
    }
    out
}

/// Where the bodies of a run of consecutive seqs are: messages of the
/// group's log entry `index`, as `(command, first message, count)` runs in
/// seq order (a command's messages are usually one run).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LogRef {
    pub index: u64,
    pub runs: Vec<(u32, u32, u32)>,
    /// Bytes of the messages, roughly as a chunk would hold them.
    pub bytes: u64,
}

impl LogRef {
    pub fn new(index: u64) -> Self {
        Self { index, runs: Vec::new(), bytes: 0 }
    }

    /// Number of seqs it covers.
    pub fn count(&self) -> u64 {
        self.runs.iter().map(|r| r.2 as u64).sum()
    }

    /// The next seq is message `msg` of command `cmd`, of `bytes`.
    pub fn push(&mut self, cmd: u32, msg: u32, bytes: u64) {
        self.bytes += bytes;
        match self.runs.last_mut() {
            Some((c, first, n)) if *c == cmd && *first + *n == msg => *n += 1,
            _ => self.runs.push((cmd, msg, 1)),
        }
    }

    pub fn encode(&self) -> Result<Vec<u8>, StorageError> {
        keys::encode(self, "body reference")
    }

    pub fn decode(b: &[u8]) -> Result<Self, StorageError> {
        keys::decode(b, "body reference")
    }

    /// The bodies, read from the log as a chunk starting at `first`;
    /// `None` if the log no longer has the entry (a replica that installed a
    /// snapshot meanwhile: its plan fetches them).
    pub fn resolve(&self, space: &SmSpace, first: u64) -> Result<Option<Chunk>, StorageError> {
        let Some(bytes) = space.log_entry(self.index)? else { return Ok(None) };
        let entry: openraft::Entry<QueueTypes> = keys::decode(&bytes, "log entry")?;
        let EntryPayload::Normal(cmds) = &entry.payload else {
            return Err(corrupt("referenced log entry holds no queue commands"));
        };
        let mut w = ChunkWriter::new(first);
        for &(cmd, from, n) in &self.runs {
            let msgs = cmds
                .get(cmd as usize)
                .and_then(|c| c.messages())
                .ok_or_else(|| corrupt("referenced command holds no messages"))?;
            let run = msgs
                .get(from as usize..(from + n) as usize)
                .ok_or_else(|| corrupt("referenced messages out of range"))?;
            for m in run {
                w.push(m)?;
            }
        }
        Ok(Some(Chunk::parse(first, w.finish().into())?))
    }
}

/// The reference covering `seq`, as stored.
pub fn find_ref(space: &SmSpace, seq: u64) -> Result<Option<(u64, LogRef)>, StorageError> {
    match space.last_in(&ref_key(0), &ref_key(seq))? {
        Some((k, v)) => {
            let (first, r) = (first_of(&k), LogRef::decode(&v)?);
            Ok((seq < first + r.count()).then_some((first, r)))
        }
        None => Ok(None),
    }
}

/// Every stored reference of the group, by first seq.
pub fn all_refs(space: &SmSpace) -> impl Iterator<Item = Result<(u64, LogRef), StorageError>> + '_ {
    space.scan(&[REF_PREFIX]).map(|kv| kv.and_then(|(k, v)| Ok((first_of(&k), LogRef::decode(&v)?))))
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
    fn a_body_seen_in_the_log_and_in_a_chunk_is_kept_once() {
        let chunk = |first: u64, n: u64| {
            let mut w = ChunkWriter::new(first);
            for i in 0..n {
                w.push(&msg(&format!("m{}", first + i))).unwrap();
            }
            Chunk::parse(first, w.finish().into()).unwrap()
        };
        // An entry's messages 10..20 read from the log, its held parts
        // copied into chunks meanwhile, and the next entry's chunk.
        let got = disjoint(vec![chunk(16, 4), chunk(20, 5), chunk(12, 2), chunk(10, 10)]);
        let bounds: Vec<(u64, u64)> = got.iter().map(|c| (c.first(), c.end())).collect();
        assert_eq!(bounds, vec![(10, 20), (20, 25)]);
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
