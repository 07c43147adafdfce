//! The node's write-ahead log: every group's Raft entries, appended to
//! segment files and made durable by one `fdatasync` per flusher round.
//!
//! Raft entries used to be sled values. sled rewrites a leaf page (up to 16
//! values) every few updates and pads each segment into fresh 4 MiB buffers,
//! so a node wrote 116-151 MB/s to disk for 3.4 MB/s of payload, and the
//! confirm tail followed those writes. Entries are written once, read back
//! almost only from memory, and dropped in index order, which is what an
//! append-only file does best.
//!
//! ## Records
//!
//! A segment `wal/<id, 16 hex digits>.wal` is a sequence of records:
//!
//! ```text
//! crc32 u32 | len u32 | kind u8 | group u64 | index u64 | payload (len bytes)
//! ```
//!
//! little-endian, the CRC (crc32fast) over the segment's id (8 bytes, not
//! stored) and then everything after itself. Kinds: an entry (payload: the
//! bincode entry) appended at `index`, which drops every entry of the group
//! from `index` on; an entry *rewritten* in place (re-founding a group keeps
//! later entries); a truncation from `index`; the group dropped; the
//! segment's *seal*, its last record, written and synced when the log moves
//! on to the next segment; *synced*, no payload, `index` the length of the
//! head that a sync covered, opening the first write after each sync that
//! covered more; *sled's mark*, no payload, `index` a mark that sled's
//! file held when a sync of it returned (see [`Wal::note_sled_mark`]).
//! Purges are not records: the purge point lives in
//! sled's `raft_meta` and is applied when the log is read back.
//!
//! A new segment's blocks are reserved when it is created (`fallocate`,
//! size included), so an append needs no block allocation. Better still,
//! the log *recycles* the files of dead segments (up to [`MAX_SPARES`]):
//! their blocks are already written, so an append into them changes no
//! metadata at all and `fdatasync` flushes data only. Into reserved
//! (unwritten) blocks, the first write of each block changes the extent
//! tree, and every such `fdatasync` waits for a commit of the file system's
//! journal, shared with every other file's metadata (other nodes' new and
//! removed segments, sled): with three writers of 32 KiB entries, sync p99
//! 0.80 against 0.44 ms and 257 against 349 MB/s (`cargo bench --bench
//! disk_floor`; `benches/results/HISTORY.md`). A recycled file still holds its old
//! records, salted with its old id: under the new id their CRCs fail, so
//! they read as the end of the segment, as zeros do.
//!
//! Segments of the previous format (`<id>.log`: no salt, no seal, cut to
//! their records when full) are still read, and never written again.
//!
//! ## Recovery
//!
//! Segments are replayed in order. A segment is sealed and synced before
//! the next one is written to, so every segment but the last ends with its
//! seal: a record that is short or fails its CRC before the seal is
//! corruption, and the node refuses to start. The last segment ends at its
//! first bad record (a torn tail, stale bytes of a recycled file, reserved
//! zeros): nothing after it was acknowledged. It is sealed there and the
//! log moves on to a new segment, so no stale byte behind the seal (a torn
//! write's later blocks may have reached the disk before its first) can
//! ever come to read as a record.
//!
//! ## Damage or torn tail
//!
//! The head's first bad record is its end unless a synced record further
//! on vouches for it: then it was acknowledged, and it is damage
//! ([`WalError::Corrupt`], naming the group and index its header claims),
//! not a tail to cut. The synced length lives in the log because the next
//! write carries it for free: no fsync of its own, and no block rewritten
//! in place for a torn write to lose, as a header block would be (a sled
//! key would cost a sled sync per round). What that leaves out: the
//! records of the last round before a stop or crash, until a later write
//! vouches for them (once the next start has sealed the head, its seal
//! vouches for all of them). The records between the bad one and the
//! synced one may have lost their framing with it (a damaged length), so
//! the synced record is looked for at every byte, by its fixed header.
//!
//! ## Reclaiming space
//!
//! Each segment counts the live entries each group holds in it. The oldest segments go
//! (oldest first, so a truncation or drop record never outlives what it
//! removed) once they hold none, after sled is synced so that the purge
//! points that killed those entries are durable, and once every record
//! that killed one of their entries is durable too: those take effect in
//! memory as they are written, and a segment freed by a record a power
//! cut then loses would leave a hole in its group's log. Going means being renamed
//! `<id>.spare` for a later segment to take (a recycled file), or, with
//! enough spares, unlinked. A group that stopped writing would pin its old
//! segment forever, so when more than `MAX_SEGMENTS` exist, the live
//! entries of groups found in the oldest one are written again at the
//! head.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{self, Read};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::flusher::is_disk_full;
use crate::GroupId;

/// An entry as the log keeps it: its index and its encoded bytes.
pub type RawEntry = (u64, Vec<u8>);

/// Segment size at which the log moves on to a new file.
pub const SEGMENT_BYTES: u64 = 64 << 20;

/// Segments kept before idle groups' entries are moved to the head.
const MAX_SEGMENTS: usize = 4;

/// Dead segments' files kept for later segments to reuse (see the module
/// docs): at most this many times the segment size of disk held beyond the
/// live log.
pub const MAX_SPARES: usize = 4;

/// Segments from which the groups pinning the oldest are asked to compact
/// their logs ([`Wal::pinning_oldest`]): before the move at
/// `MAX_SEGMENTS`, and leaving the newest full segment alone.
const COMPACT_AT: usize = 3;

/// How long idle groups' entries may keep the oldest segment over the
/// limit before they are moved (the owner compacts once a second).
const RELOCATE_AFTER: Duration = Duration::from_secs(5);

const HEADER: usize = 4 + 4 + 1 + 8 + 8;

const KIND_ENTRY: u8 = 1;
const KIND_REWRITE: u8 = 2;
const KIND_TRUNCATE: u8 = 3;
const KIND_DROP: u8 = 4;
const KIND_SEAL: u8 = 5;
/// The head segment's synced length when the write it opens began (see
/// "Damage or torn tail" in the module docs).
const KIND_SYNCED: u8 = 6;
/// A mark sled had on disk (no payload, `index` the mark): see
/// [`Wal::note_sled_mark`].
const KIND_SLED_MARK: u8 = 7;

/// Errors of the write-ahead log.
#[derive(Debug, thiserror::Error)]
pub enum WalError {
    #[error("write-ahead log {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// A record the log knows was durable does not read back. `group` and
    /// `index` are what the damaged record's own header says, if it looks
    /// like one (unverified: the damage may be there too); that group's
    /// entries from `index` on are the ones at stake, and every record
    /// after `offset` in this segment is unread.
    #[error(
        "write-ahead log segment {path} is damaged at byte {offset}{} (acknowledged data, not a torn tail; refusing to start)",
        describe_damaged(.group, .index)
    )]
    Corrupt { path: PathBuf, offset: u64, group: Option<GroupId>, index: Option<u64> },
    /// The log ends before a point sled recorded as synced (see
    /// [`Wal::open_expecting`]): acknowledged records are gone, as a
    /// truncated or zeroed segment leaves it, though what is left reads
    /// as a clean end.
    #[error(
        "write-ahead log {path} is damaged: it reads to byte {found} of segment {found_segment}, but byte {synced} of segment {segment} had been synced (refusing to start)"
    )]
    Shorter { path: PathBuf, segment: u64, synced: u64, found_segment: u64, found: u64 },
    #[error("write-ahead log has failed earlier; the node is stopping")]
    Failed,
    /// The disk has no room for the log's next segment (`ENOSPC` or
    /// `EDQUOT` creating or reserving it). Nothing was written: the head
    /// stays open, the log stays usable, and the same write may be tried
    /// again once space is freed.
    #[error("no space left on the disk for a new write-ahead log segment {path} ({bytes} bytes): {source}; the write is refused until space is freed")]
    NoSpace {
        path: PathBuf,
        bytes: u64,
        #[source]
        source: io::Error,
    },
}

impl WalError {
    /// Whether this is [`WalError::NoSpace`]: the disk is full and the log
    /// is intact.
    pub fn is_no_space(&self) -> bool {
        matches!(self, WalError::NoSpace { .. })
    }
}

/// The files of a log's dir, each kind by id, oldest first.
struct Listing {
    /// Segments, each with whether it is of this format (salted) or the
    /// previous one.
    segments: Vec<(u64, bool)>,
    spares: Vec<u64>,
}

fn list_files(dir: &Path) -> std::io::Result<Listing> {
    let mut ids = Vec::new();
    let mut spare_ids = Vec::new();
    for e in std::fs::read_dir(dir)? {
        let name = e?.file_name();
        let name = name.to_string_lossy();
        let Some((hex, ext)) = name.split_once('.') else { continue };
        let Ok(id) = u64::from_str_radix(hex, 16) else { continue };
        match ext {
            "wal" => ids.push((id, true)),
            "log" => ids.push((id, false)),
            "spare" => spare_ids.push(id),
            _ => {}
        }
    }
    ids.sort_unstable();
    spare_ids.sort_unstable();
    Ok(Listing { segments: ids, spares: spare_ids })
}

#[cfg(test)]
thread_local! {
    /// Tests: the next this many segment files made on this thread fail
    /// their reservation with ENOSPC.
    pub(crate) static NO_SPACE_FOR: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

fn describe_damaged(group: &Option<GroupId>, index: &Option<u64>) -> String {
    match (group, index) {
        (Some(g), Some(i)) => format!(", in a record of group {g} at index {i} by its header"),
        _ => String::new(),
    }
}

/// Where an entry's bytes are.
#[derive(Debug, Clone, Copy)]
struct Loc {
    seg: u64,
    offset: u64,
    len: u32,
}

/// A group's entries: consecutive indexes from `first`.
#[derive(Debug, Default)]
struct GroupLog {
    first: u64,
    locs: VecDeque<Loc>,
}

impl GroupLog {
    fn last(&self) -> Option<u64> {
        (!self.locs.is_empty()).then(|| self.first + self.locs.len() as u64 - 1)
    }
}

struct Segment {
    file: Arc<File>,
    path: PathBuf,
    /// Its records' CRCs cover its id (all but the previous format's).
    salted: bool,
    /// Live entries in this segment by group (none: the segment is dead):
    /// which groups pin it, found without going over every group's entries
    /// (ten thousand idle groups beside busy ones whose logs hold a
    /// thousand entries each).
    holders: HashMap<GroupId, u32>,
    /// Written since its last sync.
    dirty: bool,
    /// Bytes from its start known to be on disk: what a crash keeps
    /// ([`Wal::crash_for_tests`]).
    synced: u64,
    /// The synced length the last `KIND_SYNCED` record written here
    /// carries: the next write carries a new one only once a sync has
    /// covered more.
    marked: u64,
    /// The end of the latest record that killed an entry here (a
    /// truncation, a drop, an entry written over or moved). Until that
    /// record is durable the segment must stay, dead or not: a crash would
    /// lose the record and bring its entries back, with this file gone.
    killed_by: Pos,
}

/// A place in the log: a segment and an offset in it. Orders as the log
/// was written.
type Pos = (u64, u64);

/// What a kill that no record of the log made (a purge, whose point lives
/// in sled) waits for: nothing here.
const NO_RECORD: Pos = (0, 0);

struct Inner {
    segments: BTreeMap<u64, Segment>,
    active: u64,
    active_len: u64,
    groups: HashMap<GroupId, GroupLog>,
    failed: bool,
    /// The oldest segment and since when it has been over the limit with
    /// idle groups' entries in it (reset while none is idle there): they
    /// are moved only after
    /// [`RELOCATE_AFTER`], the owner's compaction having had its chance.
    crowded: Option<(u64, Instant)>,
    /// A move of idle groups' entries met a full disk and has not
    /// succeeded since: said once, not at every try.
    relocate_refused: bool,
    /// Dead segments' files, ready to become new segments.
    spares: Vec<Spare>,
    /// The highest sled mark read back at open (see [`Wal::sled_mark`]).
    sled_mark: u64,
}

/// A dead segment's file, renamed `<old id>.spare`.
struct Spare {
    path: PathBuf,
    /// Readers that took the segment's handle before it died may still
    /// read through it: the file is reused only once this is the last one.
    file: Arc<File>,
}

/// A segment dropped from the log by [`Wal::forget`], its file not yet
/// recycled or removed ([`Wal::retire`]).
pub struct Retired {
    id: u64,
    path: PathBuf,
    file: Arc<File>,
}

/// The node's write-ahead log (see the module docs).
pub struct Wal {
    dir: PathBuf,
    segment_bytes: u64,
    relocate_after: Duration,
    /// Bytes [`Wal::relocate_idle`] has copied since the log was opened.
    relocated: AtomicU64,
    inner: Mutex<Inner>,
    /// One [`Wal::sync`] at a time: a caller that finds nothing dirty must
    /// not return while another's `fdatasync` of what it found is under way.
    sync_lock: Mutex<()>,
    /// How many times a new segment met a full disk.
    no_space: tokio::sync::watch::Sender<u64>,
}

/// A record read back while recovering.
struct Record {
    kind: u8,
    group: GroupId,
    index: u64,
    offset: u64,
    len: u32,
}

/// Reserve `len` bytes of blocks for `file` and make that its size, so that
/// writes within it change no metadata and cannot meet a full disk. On a
/// file system without `fallocate` the file grows as it is written, as it
/// would without this; a full disk is an error (the segment is not made:
/// a write into it would fail half-way, and the log with it).
fn preallocate(file: &File, len: u64) -> io::Result<()> {
    #[cfg(test)]
    if NO_SPACE_FOR.with(|n| n.replace(n.get().saturating_sub(1))) > 0 {
        return Err(io::Error::from_raw_os_error(libc::ENOSPC));
    }
    // SAFETY: plain syscall on a descriptor `file` keeps open.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), 0, 0, len as libc::off_t) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        if is_disk_full(&e) {
            return Err(e);
        }
        tracing::debug!(error = %e, "write-ahead log segment not preallocated");
    }
    Ok(())
}

/// Remove a segment's file; one already gone is fine.
fn unlink(path: &Path) -> io::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Whether the `len` bytes at `at` are zeros, as reserved space reads.
fn zeros_at(file: &File, at: u64, len: u64) -> io::Result<bool> {
    let mut buf = vec![0u8; len as usize];
    file.read_exact_at(&mut buf, at)?;
    Ok(buf.iter().all(|b| *b == 0))
}

fn seg_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:016x}.wal"))
}

/// A segment of the previous format (unsalted, unsealed).
fn v1_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:016x}.log"))
}

fn spare_path(dir: &Path, id: u64) -> PathBuf {
    dir.join(format!("{id:016x}.spare"))
}

/// Append a record to `buf`, its CRC covering the record only: the
/// segment's salt goes in when [`salt_records`] knows the segment. Returns
/// the payload's offset in `buf`.
fn encode_record(buf: &mut Vec<u8>, kind: u8, group: GroupId, index: u64, payload: &[u8]) -> u64 {
    let start = buf.len();
    buf.extend_from_slice(&[0; 4]);
    buf.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    buf.push(kind);
    buf.extend_from_slice(&group.to_le_bytes());
    buf.extend_from_slice(&index.to_le_bytes());
    buf.extend_from_slice(payload);
    let crc = crc32fast::hash(&buf[start + 4..]);
    buf[start..start + 4].copy_from_slice(&crc.to_le_bytes());
    (start + HEADER) as u64
}

/// Turn the CRCs of the whole records in `buf` into CRCs salted with
/// segment `id`: the CRC of the id's bytes followed by the record, combined
/// from the record's own CRC without reading its bytes again (so under the
/// log's lock this costs next to nothing, whatever the payloads weigh).
fn salt_records(buf: &mut [u8], id: u64) {
    let mut salt = crc32fast::Hasher::new();
    salt.update(&id.to_le_bytes());
    let mut at = 0;
    while at + HEADER <= buf.len() {
        let crc = u32::from_le_bytes(buf[at..at + 4].try_into().expect("4 bytes"));
        let len = u32::from_le_bytes(buf[at + 4..at + 8].try_into().expect("4 bytes")) as usize;
        let mut salted = salt.clone();
        salted.combine(&crc32fast::Hasher::new_with_initial_len(crc, (HEADER - 4 + len) as u64));
        buf[at..at + 4].copy_from_slice(&salted.finalize().to_le_bytes());
        at += HEADER + len;
    }
}

/// A segment's seal, salted for segment `id`.
fn seal_record(id: u64) -> Vec<u8> {
    let mut buf = Vec::with_capacity(HEADER);
    encode_record(&mut buf, KIND_SEAL, 0, id + 1, &[]);
    salt_records(&mut buf, id);
    buf
}

/// What [`parse`] found in a segment file.
struct Parsed {
    records: Vec<Record>,
    /// Where the valid records end (after the seal, if any).
    valid: u64,
    sealed: bool,
}

/// Records of one segment file, up to its seal or its first bad record;
/// `salt` is the segment's id (`None`: the previous, unsalted format).
/// Streams the file through one record's worth of memory.
fn parse(file: &File, salt: Option<u64>) -> io::Result<Parsed> {
    let size = file.metadata()?.len();
    let mut reader = io::BufReader::with_capacity(1 << 20, file);
    let mut out = Vec::new();
    let mut at = 0u64;
    let mut h = [0u8; HEADER];
    let mut payload = Vec::new();
    let mut sealed = false;
    while size - at >= HEADER as u64 {
        reader.read_exact(&mut h)?;
        let crc = u32::from_le_bytes(h[0..4].try_into().expect("4 bytes"));
        let len = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes"));
        // A torn header can claim any length: check it against the file
        // before reading that much.
        if at + HEADER as u64 + u64::from(len) > size {
            break;
        }
        payload.resize(len as usize, 0);
        reader.read_exact(&mut payload)?;
        let mut hasher = crc32fast::Hasher::new();
        if let Some(id) = salt {
            hasher.update(&id.to_le_bytes());
        }
        hasher.update(&h[4..]);
        hasher.update(&payload);
        // Zeros (crc 0 over kind 0) are never a record, whatever the salt.
        if hasher.finalize() != crc || !(KIND_ENTRY..=KIND_SLED_MARK).contains(&h[8]) {
            break;
        }
        if h[8] == KIND_SEAL {
            sealed = true;
            at += HEADER as u64 + u64::from(len);
            break;
        }
        if h[8] == KIND_SYNCED {
            at += HEADER as u64 + u64::from(len);
            continue;
        }
        out.push(Record {
            kind: h[8],
            group: u64::from_le_bytes(h[9..17].try_into().expect("8 bytes")),
            index: u64::from_le_bytes(h[17..25].try_into().expect("8 bytes")),
            offset: at + HEADER as u64,
            len,
        });
        at += HEADER as u64 + u64::from(len);
    }
    Ok(Parsed { records: out, valid: at, sealed })
}

/// Whether `bytes`, one whole record read back, is the entry `index` of
/// `group` as it was written: its CRC (salted with the segment's id where
/// the format has one) and its header's claims.
fn record_intact(bytes: &[u8], salt: Option<u64>, group: GroupId, index: u64) -> bool {
    let mut hasher = crc32fast::Hasher::new();
    if let Some(id) = salt {
        hasher.update(&id.to_le_bytes());
    }
    hasher.update(&bytes[4..]);
    let crc = u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes"));
    let len = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes")) as usize;
    hasher.finalize() == crc
        && len == bytes.len() - HEADER
        && u64::from_le_bytes(bytes[9..17].try_into().expect("8 bytes")) == group
        && u64::from_le_bytes(bytes[17..25].try_into().expect("8 bytes")) == index
}

/// A `KIND_SYNCED` record for segment `id`: its first `synced` bytes are
/// on disk.
fn synced_record(id: u64, synced: u64) -> Vec<u8> {
    let mut buf = Vec::with_capacity(HEADER);
    encode_record(&mut buf, KIND_SYNCED, 0, synced, &[]);
    salt_records(&mut buf, id);
    buf
}

/// Whether a valid `KIND_SYNCED` record of segment `id` somewhere after
/// `bad` says the segment had been synced past `bad`: then the bad record
/// at `bad` was acknowledged and has rotted since, rather than torn.
///
/// The records between may be unreadable too (a damaged length loses
/// their framing), so this looks at every byte: such a record has no
/// payload and a fixed header, a 13-byte pattern checked before its CRC,
/// and blocks of zeros (a new segment's unwritten space) are skipped
/// nearly whole. Only run on the head, and only when it ends before its
/// file does.
fn synced_past(file: &File, id: u64, bad: u64) -> io::Result<bool> {
    const BLOCK: usize = 4096;
    static ZEROS: [u8; BLOCK] = [0; BLOCK];
    // len 0, kind, group 0: bytes 4..17 of the header.
    let mut pattern = [0u8; 13];
    pattern[4] = KIND_SYNCED;
    let size = file.metadata()?.len();
    let mut salt = crc32fast::Hasher::new();
    salt.update(&id.to_le_bytes());
    let mut buf = vec![0u8; 256 * BLOCK];
    let mut at = bad + 1;
    while at + HEADER as u64 <= size {
        let n = ((size - at) as usize).min(buf.len());
        file.read_exact_at(&mut buf[..n], at)?;
        for (b, block) in buf[..n].chunks(BLOCK).enumerate() {
            // A header's kind byte is its ninth: one starting in a zero
            // block must start within its last 8 bytes.
            let start = b * BLOCK;
            let from = if block == &ZEROS[..block.len()] { start + block.len().saturating_sub(8) } else { start };
            for i in from..start + block.len() {
                if i + HEADER > n {
                    break;
                }
                let h = &buf[i..i + HEADER];
                if h[4..17] != pattern {
                    continue;
                }
                let mut crc = salt.clone();
                crc.update(&h[4..]);
                if crc.finalize() != u32::from_le_bytes(h[0..4].try_into().expect("4 bytes")) {
                    continue;
                }
                let synced = u64::from_le_bytes(h[17..25].try_into().expect("8 bytes"));
                // A record can only vouch for bytes before itself.
                if synced > bad && synced <= at + i as u64 {
                    return Ok(true);
                }
            }
        }
        if n < buf.len() {
            break;
        }
        // Overlap by a header, for one that straddles the two reads.
        at += (n - HEADER + 1) as u64;
    }
    Ok(false)
}

/// The group and index the header at `at` claims, if it looks like a
/// record header (kind known, length within the file).
fn claimed_record(file: &File, at: u64) -> Option<(GroupId, u64)> {
    let size = file.metadata().ok()?.len();
    let mut h = [0u8; HEADER];
    file.read_exact_at(&mut h, at).ok()?;
    let len = u64::from(u32::from_le_bytes(h[4..8].try_into().expect("4 bytes")));
    let known = matches!(h[8], KIND_ENTRY | KIND_REWRITE | KIND_TRUNCATE | KIND_DROP);
    (known && at + HEADER as u64 + len <= size).then(|| {
        (
            u64::from_le_bytes(h[9..17].try_into().expect("8 bytes")),
            u64::from_le_bytes(h[17..25].try_into().expect("8 bytes")),
        )
    })
}

impl Inner {
    /// Groups with live entries in segment `seg` and none in the head.
    fn idle_in(&self, seg: u64) -> Vec<GroupId> {
        let Some(s) = self.segments.get(&seg) else { return Vec::new() };
        s.holders
            .keys()
            .filter(|k| self.groups.get(k).is_none_or(|g| g.locs.back().is_none_or(|l| l.seg != self.active)))
            .copied()
            .collect()
    }

    /// `n` live entries of `group` in segment `seg` fewer, killed by the
    /// record ending at `by`.
    fn unlive(&mut self, group: GroupId, seg: u64, n: u32, by: Pos) {
        if let Some(s) = self.segments.get_mut(&seg) {
            s.killed_by = s.killed_by.max(by);
            if let Entry::Occupied(mut e) = s.holders.entry(group) {
                *e.get_mut() -= n;
                if *e.get() == 0 {
                    e.remove();
                }
            }
        }
    }

    /// The entries `locs` of `group` are gone: one count per run of one
    /// segment (a group's entries sit mostly in order of their segments).
    fn unlive_all(&mut self, group: GroupId, locs: impl IntoIterator<Item = Loc>, by: Pos) {
        let mut run: Option<(u64, u32)> = None;
        for loc in locs {
            match &mut run {
                Some((seg, n)) if *seg == loc.seg => *n += 1,
                _ => {
                    if let Some((seg, n)) = run.replace((loc.seg, 1)) {
                        self.unlive(group, seg, n, by);
                    }
                }
            }
        }
        if let Some((seg, n)) = run {
            self.unlive(group, seg, n, by);
        }
    }

    fn live(&mut self, group: GroupId, loc: Loc) {
        let s = self.segments.get_mut(&loc.seg).expect("written to a known segment");
        *s.holders.entry(group).or_default() += 1;
    }

    /// Drop the group's entries from `index` on.
    fn truncate(&mut self, group: GroupId, index: u64, by: Pos) {
        let Some(g) = self.groups.get_mut(&group) else { return };
        let keep = index.saturating_sub(g.first).min(g.locs.len() as u64) as usize;
        let dropped: Vec<Loc> = g.locs.drain(keep..).collect();
        self.unlive_all(group, dropped, by);
    }

    /// Drop the group's entries up to `index`.
    fn purge(&mut self, group: GroupId, index: u64) {
        let Some(g) = self.groups.get_mut(&group) else { return };
        let n = (index.saturating_add(1)).saturating_sub(g.first).min(g.locs.len() as u64) as usize;
        let dropped: Vec<Loc> = g.locs.drain(..n).collect();
        g.first += n as u64;
        self.unlive_all(group, dropped, NO_RECORD);
    }

    fn drop_group(&mut self, group: GroupId, by: Pos) {
        if let Some(g) = self.groups.remove(&group) {
            self.unlive_all(group, g.locs, by);
        }
    }

    /// Entry `index` of `group` is now at `loc`: it follows the last entry,
    /// or replaces it and everything after it; after a gap the log starts
    /// again at `index` (openraft purged what came before).
    fn put(&mut self, group: GroupId, index: u64, loc: Loc, by: Pos) {
        let last = self.groups.get(&group).and_then(GroupLog::last);
        match last {
            Some(last) if index <= last => self.truncate(group, index, by),
            Some(last) if index == last + 1 => {}
            _ => {
                self.drop_group(group, by);
            }
        }
        let g = self.groups.entry(group).or_default();
        if g.locs.is_empty() {
            g.first = index;
        }
        g.locs.push_back(loc);
        self.live(group, loc);
    }

    /// Entry `index` now at `loc` without touching the entries after it.
    fn rewrite(&mut self, group: GroupId, index: u64, loc: Loc, by: Pos) {
        let slot = self
            .groups
            .get(&group)
            .filter(|g| index >= g.first && index - g.first < g.locs.len() as u64)
            .map(|g| (index - g.first) as usize);
        match slot {
            Some(i) => {
                let g = self.groups.get_mut(&group).expect("checked");
                let old = std::mem::replace(&mut g.locs[i], loc);
                self.unlive(group, old.seg, 1, by);
                self.live(group, loc);
            }
            None => self.put(group, index, loc, by),
        }
    }

    fn apply(&mut self, seg: u64, r: &Record) {
        let loc = Loc { seg, offset: r.offset, len: r.len };
        let by = (seg, r.offset + u64::from(r.len));
        match r.kind {
            KIND_ENTRY => self.put(r.group, r.index, loc, by),
            KIND_REWRITE => self.rewrite(r.group, r.index, loc, by),
            KIND_TRUNCATE => self.truncate(r.group, r.index, by),
            KIND_DROP => self.drop_group(r.group, by),
            KIND_SLED_MARK => self.sled_mark = self.sled_mark.max(r.index),
            _ => {}
        }
    }

    /// Whether the record ending at `pos` is on disk: every segment but
    /// the head was synced with its seal.
    fn durable(&self, pos: Pos) -> bool {
        pos.0 != self.active || self.segments.get(&pos.0).is_some_and(|s| pos.1 <= s.synced)
    }

    /// Whether segment `id` may go: no live entry, and every record that
    /// killed one durable (the purge points that did are sled's, which the
    /// caller syncs).
    fn reclaimable(&self, id: u64) -> bool {
        id != self.active && self.segments.get(&id).is_some_and(|s| s.holders.is_empty() && self.durable(s.killed_by))
    }
}

impl Wal {
    /// Open (creating if missing) the log in `dir` and replay it.
    pub fn open(dir: &Path, segment_bytes: u64) -> Result<Self, WalError> {
        Self::open_expecting(dir, segment_bytes, None)
    }

    /// [`Wal::open`], refusing a log that ends before `synced`, a
    /// [`Wal::synced_point`] recorded elsewhere (sled's): a torn tail is
    /// cut where it begins, but bytes a sync covered were acknowledged, so
    /// a log that no longer reaches them is damaged. Checked before the
    /// log writes anything, so the damaged dir is kept as it was found.
    pub fn open_expecting(dir: &Path, segment_bytes: u64, synced: Option<(u64, u64)>) -> Result<Self, WalError> {
        let io_err = |path: &Path| {
            let path = path.to_owned();
            move |source| WalError::Io { path, source }
        };
        // Its name first: a segment synced in a dir whose own entry is not
        // is lost all the same.
        crate::fsync::create_dir_durably(dir).map_err(io_err(dir))?;
        let Listing { segments: ids, spares: spare_ids } = list_files(dir).map_err(io_err(dir))?;
        let mut inner = Inner {
            segments: BTreeMap::new(),
            active: 0,
            active_len: 0,
            groups: HashMap::new(),
            failed: false,
            crowded: None,
            relocate_refused: false,
            spares: Vec::new(),
            sled_mark: 0,
        };
        // Whether the last segment may take more records: never one of the
        // previous format, nor one a crash may have left stale bytes in.
        let mut head_sealed = true;
        for (n, &(id, salted)) in ids.iter().enumerate() {
            let path = if salted { seg_path(dir, id) } else { v1_path(dir, id) };
            let file = OpenOptions::new().read(true).write(true).open(&path).map_err(io_err(&path))?;
            let size = file.metadata().map_err(io_err(&path))?.len();
            let parsed = parse(&file, salted.then_some(id)).map_err(io_err(&path))?;
            let last = n + 1 == ids.len();
            let whole = if salted { parsed.sealed } else { parsed.valid == size };
            // The head's first bad record is its torn tail, unless a later
            // record says the head had been synced past it.
            let rotted = !whole
                && (!last
                    || salted
                        && parsed.valid + HEADER as u64 <= size
                        && synced_past(&file, id, parsed.valid).map_err(io_err(&path))?);
            if rotted {
                let (group, index) = claimed_record(&file, parsed.valid).unzip();
                return Err(WalError::Corrupt { path, offset: parsed.valid, group, index });
            }
            if !salted && !whole {
                // The previous format's torn tail: cut it, as that format
                // did, so it stays whole as a segment that is not the last.
                let header = (size - parsed.valid).min(HEADER as u64);
                if !zeros_at(&file, parsed.valid, header).map_err(io_err(&path))? {
                    tracing::warn!(segment = %path.display(), at = parsed.valid, dropped = size - parsed.valid, "cutting the torn tail of the write-ahead log");
                }
                file.set_len(parsed.valid).map_err(io_err(&path))?;
                file.sync_all().map_err(io_err(&path))?;
            }
            head_sealed = !salted || parsed.sealed;
            let synced = parsed.valid;
            inner.segments.insert(
                id,
                Segment {
                    file: Arc::new(file),
                    path,
                    salted,
                    holders: HashMap::new(),
                    dirty: false,
                    synced,
                    marked: 0,
                    killed_by: NO_RECORD,
                },
            );
            for r in &parsed.records {
                inner.apply(id, r);
            }
            inner.active = id;
            inner.active_len = parsed.valid;
        }
        if let Some((segment, synced)) = synced.filter(|(_, len)| *len > 0) {
            // Segments go oldest first and never the head: a later one
            // stands for this one once it is gone.
            let last = inner.segments.keys().next_back().copied();
            let found = if last == Some(segment) { inner.active_len } else { 0 };
            if last.is_none_or(|last| last < segment) || (last == Some(segment) && found < synced) {
                return Err(WalError::Shorter {
                    path: dir.to_owned(),
                    segment,
                    synced,
                    found_segment: last.unwrap_or(0),
                    found,
                });
            }
        }
        for id in spare_ids {
            let path = spare_path(dir, id);
            if inner.spares.len() < MAX_SPARES {
                let file = OpenOptions::new().read(true).write(true).open(&path).map_err(io_err(&path))?;
                inner.spares.push(Spare { path, file: Arc::new(file) });
            } else {
                unlink(&path).map_err(io_err(&path))?;
            }
        }
        let wal = Self {
            dir: dir.to_owned(),
            segment_bytes,
            relocate_after: RELOCATE_AFTER,
            relocated: AtomicU64::new(0),
            inner: Mutex::new(inner),
            sync_lock: Mutex::new(()),
            no_space: tokio::sync::watch::channel(0).0,
        };
        {
            let mut inner = wal.lock();
            if inner.segments.is_empty() {
                wal.new_segment(&mut inner, 1, None)?;
            } else {
                if !head_sealed {
                    // Whatever follows the last good record was never
                    // acknowledged: seal the segment right there.
                    wal.seal_active(&mut inner)?;
                }
                let next = inner.active + 1;
                wal.new_segment(&mut inner, next, None)?;
            }
        }
        Ok(wal)
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().expect("poisoned")
    }

    fn io_err(&self, source: io::Error) -> WalError {
        WalError::Io { path: self.dir.clone(), source }
    }

    /// A free spare file for segment `id` to take, by its place in
    /// `inner.spares`: if none is free, `<id>.spare` made with its blocks
    /// reserved. On a full disk nothing is left behind and
    /// [`WalError::NoSpace`] is returned (and announced to
    /// [`Wal::no_space`]); the log is unchanged.
    fn reserve(&self, inner: &mut Inner, id: u64) -> Result<usize, WalError> {
        if let Some(free) = inner.spares.iter().position(|s| Arc::strong_count(&s.file) == 1) {
            return Ok(free);
        }
        let path = spare_path(&self.dir, id);
        let made = OpenOptions::new().read(true).write(true).create_new(true).open(&path);
        let reserved = made.and_then(|file| match preallocate(&file, self.segment_bytes) {
            Ok(()) => Ok(file),
            Err(e) => {
                // Its name may be gone or not after a crash: either way a
                // spare that is too short only grows as it is written.
                let _ = unlink(&path);
                Err(e)
            }
        });
        match reserved {
            Ok(file) => {
                inner.spares.push(Spare { path, file: Arc::new(file) });
                Ok(inner.spares.len() - 1)
            }
            Err(source) if is_disk_full(&source) => {
                self.no_space.send_modify(|n| *n += 1);
                Err(WalError::NoSpace { path: seg_path(&self.dir, id), bytes: self.segment_bytes, source })
            }
            Err(e) => Err(WalError::Io { path, source: e }),
        }
    }

    /// Make segment `id` the head: the spare `reserved` for it, else a
    /// free spare file, else a new file with its blocks reserved (as a
    /// spare first).
    fn new_segment(&self, inner: &mut Inner, id: u64, reserved: Option<usize>) -> Result<(), WalError> {
        let path = seg_path(&self.dir, id);
        // The one reserved, not whichever is free by now: a reader may have
        // let go of an older spare meanwhile, and a reserved spare left in
        // the list would carry a live segment's future spare name.
        let free = match reserved {
            Some(i) => i,
            None => self.reserve(inner, id)?,
        };
        let spare = inner.spares.remove(free);
        std::fs::rename(&spare.path, &path).map_err(|e| self.io_err(e))?;
        let file = spare.file;
        // The new name must survive a crash as much as what is written to it.
        crate::fsync::sync_dir(&self.dir).map_err(|e| self.io_err(e))?;
        #[cfg(any(test, feature = "test-hooks"))]
        crate::fsync::contents_kept_elsewhere(&file);
        inner.segments.insert(
            id,
            Segment {
                file,
                path,
                salted: true,
                holders: HashMap::new(),
                dirty: false,
                synced: 0,
                marked: 0,
                killed_by: NO_RECORD,
            },
        );
        inner.active = id;
        inner.active_len = 0;
        Ok(())
    }

    /// Write the head segment's seal after its records and make them all
    /// durable: recovery trusts every segment but the last to end so.
    fn seal_active(&self, inner: &mut Inner) -> Result<(), WalError> {
        let seal = seal_record(inner.active);
        let at = inner.active_len;
        let s = inner.segments.get_mut(&inner.active).expect("active segment");
        if let Err(e) = s.file.write_all_at(&seal, at).and_then(|()| s.file.sync_data()) {
            inner.failed = true;
            return Err(self.io_err(e));
        }
        s.dirty = false;
        s.synced = at + seal.len() as u64;
        inner.active_len = s.synced;
        Ok(())
    }

    /// Write `buf` (whole records, CRCs not yet salted) at the head, moving
    /// to a new segment first when it would overflow this one (its seal
    /// included). Returns the segment and the offset `buf` starts at.
    fn write(&self, inner: &mut Inner, buf: &mut [u8]) -> Result<(u64, u64), WalError> {
        if inner.failed {
            return Err(WalError::Failed);
        }
        let marks = |inner: &Inner| {
            let s = &inner.segments[&inner.active];
            (s.synced > s.marked).then_some(s.synced)
        };
        let mark_len = if marks(inner).is_some() { HEADER } else { 0 };
        if inner.active_len > 0 && inner.active_len + (mark_len + buf.len() + HEADER) as u64 > self.segment_bytes {
            // The next segment's space first: on a full disk the write is
            // refused before the head is sealed, and the log goes on as if
            // it had never been tried.
            let spare = self.reserve(inner, inner.active + 1)?;
            self.seal_active(inner)?;
            let next = inner.active + 1;
            if let Err(e) = self.new_segment(inner, next, Some(spare)) {
                // The head is sealed: a record written behind its seal would
                // be acknowledged and then lost, since recovery stops at the
                // seal. And a retry cannot be trusted after a half-done
                // rename or a failed directory sync: fail-stop.
                inner.failed = true;
                return Err(e);
            }
        }
        let seg = inner.active;
        salt_records(buf, seg);
        let mark = marks(inner);
        let mut at = inner.active_len;
        let s = inner.segments.get_mut(&seg).expect("active segment");
        if let Some(synced) = mark {
            // A write of its own: copying `buf` (megabytes at times) in
            // behind it would cost more than the syscall.
            if let Err(e) = s.file.write_all_at(&synced_record(seg, synced), at) {
                inner.failed = true;
                return Err(self.io_err(e));
            }
            s.marked = synced;
            at += HEADER as u64;
        }
        if let Err(e) = s.file.write_all_at(buf, at) {
            // Part of it may be on disk: nothing may follow it.
            inner.failed = true;
            return Err(self.io_err(e));
        }
        s.dirty = true;
        inner.active_len = at + buf.len() as u64;
        Ok((seg, at))
    }

    /// Append entries `(index, bytes)` of `group`, in index order; readable
    /// at once, durable after the next [`Wal::sync`].
    pub fn append(&self, group: GroupId, entries: &[RawEntry]) -> Result<(), WalError> {
        self.write_entries(group, entries, KIND_ENTRY)
    }

    /// Counts the times a new segment met a full disk ([`WalError::NoSpace`]):
    /// the node raises its disk alarm at once rather than at its next check.
    pub fn no_space(&self) -> tokio::sync::watch::Receiver<u64> {
        self.no_space.subscribe()
    }

    /// Replace entries in place, keeping the ones after them; an index right
    /// after the last entry appends.
    pub fn rewrite(&self, group: GroupId, entries: &[RawEntry]) -> Result<(), WalError> {
        self.write_entries(group, entries, KIND_REWRITE)
    }

    fn write_entries(&self, group: GroupId, entries: &[RawEntry], kind: u8) -> Result<(), WalError> {
        let mut buf = Vec::with_capacity(entries.iter().map(|(_, b)| b.len() + HEADER).sum());
        let mut offsets = Vec::with_capacity(entries.len());
        for (index, bytes) in entries {
            offsets.push(encode_record(&mut buf, kind, group, *index, bytes));
        }
        let mut inner = self.lock();
        let (seg, at) = self.write(&mut inner, &mut buf)?;
        let by = (seg, at + buf.len() as u64);
        for ((index, bytes), off) in entries.iter().zip(offsets) {
            let loc = Loc { seg, offset: at + off, len: bytes.len() as u32 };
            if kind == KIND_REWRITE {
                inner.rewrite(group, *index, loc, by);
            } else {
                inner.put(group, *index, loc, by);
            }
        }
        Ok(())
    }

    /// Drop `group`'s entries from `index` on.
    pub fn truncate(&self, group: GroupId, index: u64) -> Result<(), WalError> {
        let mut buf = Vec::with_capacity(HEADER);
        encode_record(&mut buf, KIND_TRUNCATE, group, index, &[]);
        let mut inner = self.lock();
        let (seg, at) = self.write(&mut inner, &mut buf)?;
        inner.truncate(group, index, (seg, at + buf.len() as u64));
        Ok(())
    }

    /// Forget `group`'s entries up to `index` (the caller has made the purge
    /// point durable elsewhere, or will before the space is reclaimed).
    pub fn purge(&self, group: GroupId, index: u64) {
        self.lock().purge(group, index);
    }

    /// Drop every entry of `group`, durably.
    pub fn drop_group(&self, group: GroupId) -> Result<(), WalError> {
        let mut buf = Vec::with_capacity(HEADER);
        encode_record(&mut buf, KIND_DROP, group, 0, &[]);
        let mut inner = self.lock();
        if !inner.groups.contains_key(&group) {
            return Ok(());
        }
        let (seg, at) = self.write(&mut inner, &mut buf)?;
        inner.drop_group(group, (seg, at + buf.len() as u64));
        drop(inner);
        self.sync()
    }

    /// Record that sled's file held `mark` when a sync of it returned;
    /// durable with the next [`Wal::sync`]. sled's recovery yields a prefix
    /// of its writes, so a sled that comes back with a lower mark than the
    /// log's lost writes it had synced: damage that sled's own checks let
    /// through (a truncated or zeroed file can open without an error).
    /// The log is the witness because its records are checksummed and the
    /// next write carries this one for free, as with `KIND_SYNCED`.
    pub fn note_sled_mark(&self, mark: u64) -> Result<(), WalError> {
        let mut buf = Vec::with_capacity(HEADER);
        encode_record(&mut buf, KIND_SLED_MARK, 0, mark, &[]);
        let mut inner = self.lock();
        self.write(&mut inner, &mut buf)?;
        Ok(())
    }

    /// The highest mark [`Wal::note_sled_mark`] left in the log as it was
    /// opened (0 if none).
    pub fn sled_mark(&self) -> u64 {
        self.lock().sled_mark
    }

    /// The head segment and how many of its bytes are on disk: what a
    /// later [`Wal::open_expecting`] may demand.
    pub fn synced_point(&self) -> (u64, u64) {
        let inner = self.lock();
        (inner.active, inner.segments.get(&inner.active).map_or(0, |s| s.synced))
    }

    /// Whether `group` has any entry.
    pub fn has_group(&self, group: GroupId) -> bool {
        self.lock().groups.get(&group).is_some_and(|g| !g.locs.is_empty())
    }

    /// Groups that have entries.
    pub fn groups(&self) -> Vec<GroupId> {
        self.lock().groups.iter().filter(|(_, g)| !g.locs.is_empty()).map(|(k, _)| *k).collect()
    }

    /// First and last index of `group`'s entries.
    pub fn bounds(&self, group: GroupId) -> Option<(u64, u64)> {
        let inner = self.lock();
        let g = inner.groups.get(&group)?;
        Some((g.first, g.last()?))
    }

    /// The bytes of `group`'s entries `start..=end` that exist, in order.
    pub fn read(&self, group: GroupId, start: u64, end: u64) -> Result<Vec<RawEntry>, WalError> {
        let wanted: Vec<(u64, Loc, Arc<File>, Option<u64>)> = {
            let inner = self.lock();
            let Some(g) = inner.groups.get(&group) else { return Ok(Vec::new()) };
            let Some(last) = g.last() else { return Ok(Vec::new()) };
            let (from, to) = (start.max(g.first), end.min(last));
            if from > to {
                return Ok(Vec::new());
            }
            (from..=to)
                .map(|i| {
                    let loc = g.locs[(i - g.first) as usize];
                    let seg = &inner.segments[&loc.seg];
                    (i, loc, seg.file.clone(), seg.salted.then_some(loc.seg))
                })
                .collect()
        };
        // Read outside the lock: a segment reclaimed meanwhile stays readable
        // through its open handle.
        let mut out = Vec::with_capacity(wanted.len());
        for (index, loc, file, salt) in wanted {
            // The record's header too: its CRC is checked on every read, so
            // bits that rotted since the log was opened are never served,
            // replicated or applied as if they were the entry.
            let at = loc.offset - HEADER as u64;
            let mut bytes = vec![0; HEADER + loc.len as usize];
            file.read_exact_at(&mut bytes, at).map_err(|e| self.io_err(e))?;
            if !record_intact(&bytes, salt, group, index) {
                let path =
                    self.lock().segments.get(&loc.seg).map_or_else(|| seg_path(&self.dir, loc.seg), |s| s.path.clone());
                return Err(WalError::Corrupt { path, offset: at, group: Some(group), index: Some(index) });
            }
            bytes.drain(..HEADER);
            out.push((index, bytes));
        }
        Ok(out)
    }

    /// Make everything written so far durable. Segments written by others
    /// during the sync are synced by the next call.
    pub fn sync(&self) -> Result<(), WalError> {
        let _one = self.sync_lock.lock().expect("poisoned");
        // (segment, its file, its length when the sync began)
        let files: Vec<(u64, Arc<File>, u64)> = {
            let mut inner = self.lock();
            if inner.failed {
                return Err(WalError::Failed);
            }
            // Only the head is written without a sync of its own (the seal's).
            let (active, active_len) = (inner.active, inner.active_len);
            inner
                .segments
                .iter_mut()
                .filter(|(_, s)| s.dirty)
                .map(|(id, s)| {
                    s.dirty = false;
                    (*id, s.file.clone(), if *id == active { active_len } else { s.synced })
                })
                .collect()
        };
        for (_, f, _) in &files {
            if let Err(e) = f.sync_data() {
                self.lock().failed = true;
                return Err(self.io_err(e));
            }
        }
        let mut inner = self.lock();
        for (id, _, len) in files {
            if let Some(s) = inner.segments.get_mut(&id) {
                s.synced = s.synced.max(len);
            }
        }
        Ok(())
    }

    /// A crash in which the page cache is lost, for tests: every segment
    /// loses what was written to it after its last sync (cut back to its
    /// synced length), and the log refuses everything from now on. File
    /// names (new segments, spares) stay as they are.
    #[cfg(any(test, feature = "test-hooks"))]
    pub(crate) fn crash_for_tests(&self) -> Result<(), WalError> {
        let mut inner = self.lock();
        inner.failed = true;
        for s in inner.segments.values() {
            s.file.set_len(s.synced).map_err(|e| self.io_err(e))?;
        }
        Ok(())
    }

    /// Segments that hold no live entry, oldest first, none of them the
    /// head, and none whose entries a record not yet synced killed (see
    /// `Segment::killed_by`). Before removing them with [`Wal::remove`],
    /// the caller makes the purge points durable that killed their entries.
    pub fn reclaimable(&self) -> Vec<u64> {
        let inner = self.lock();
        inner.segments.keys().take_while(|id| inner.reclaimable(**id)).copied().collect()
    }

    /// Remove segments [`Wal::reclaimable`] named (they stay dead: nothing
    /// is written to a segment but the head), there and then. The node's
    /// flusher forgets them instead and retires them elsewhere.
    #[cfg(test)]
    pub fn remove(&self, ids: &[u64]) -> Result<(), WalError> {
        self.retire(self.forget(ids));
        Ok(())
    }

    /// Drop the dead segments among `ids` from the log and answer their
    /// files, for the caller to [`Wal::retire`] when it suits it. A file
    /// left behind (a crash before it is retired) holds only dead entries:
    /// it is read back and reclaimed again.
    pub fn forget(&self, ids: &[u64]) -> Vec<Retired> {
        let mut inner = self.lock();
        let mut out = Vec::new();
        for id in ids {
            if inner.reclaimable(*id) {
                if let Some(s) = inner.segments.remove(id) {
                    out.push(Retired { id: *id, path: s.path, file: s.file });
                }
            }
        }
        out
    }

    /// Take forgotten segments' files out of the log, in order (oldest
    /// first: a crash never leaves an older segment without the newer one
    /// whose truncation or drop record kills its entries): each becomes a
    /// spare while fewer than [`MAX_SPARES`] exist, else it is unlinked.
    /// Either is a metadata change that costs the file system milliseconds
    /// for a full segment (unlinking one took 30-60 ms), so the node does
    /// this on a thread of its own.
    ///
    /// The directory is synced after each file: a later segment's removal
    /// must not reach the disk before an earlier one's, whose entries the
    /// later one's records may have killed. A failed sync fails the log
    /// (every later write and sync), as a failed `fdatasync` does.
    pub fn retire(&self, files: Vec<Retired>) {
        for Retired { id, path, file } in files {
            self.retire_one(id, path, file);
            if let Err(e) = crate::fsync::sync_dir(&self.dir) {
                tracing::error!(error = %e, dir = %self.dir.display(), "write-ahead log directory sync failed");
                self.lock().failed = true;
                return;
            }
        }
    }

    fn retire_one(&self, id: u64, path: PathBuf, file: Arc<File>) {
        let spare = spare_path(&self.dir, id);
        // A spare of that name may be listed already (one a crash left
        // beside the log, loaded at open): renaming onto it would replace
        // its file under its open handle, and the segment that took it
        // would write to a deleted file. New spares are made only under
        // the lock and taken at once, so the list cannot grow by more than
        // this push between the check and it.
        let room = {
            let inner = self.lock();
            inner.spares.len() < MAX_SPARES && !inner.spares.iter().any(|s| s.path == spare)
        };
        if room {
            match std::fs::rename(&path, &spare) {
                Ok(()) => {
                    self.lock().spares.push(Spare { path: spare, file });
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, file = %path.display(), "could not keep a dead write-ahead log segment for reuse")
                }
            }
        }
        drop(file);
        if let Err(e) = unlink(&path) {
            // Space not given back until the next start, nothing lost.
            tracing::warn!(error = %e, file = %path.display(), "could not remove a write-ahead log segment");
        }
    }

    /// When there are too many segments, write the entries of the groups
    /// that still live in the oldest one again at the head, so that it can
    /// go. Only groups that are idle there (none of their entries in the
    /// head segment) are moved; a busy group's old entries are purged soon
    /// by its own snapshots, an idle one's by its owner's compaction, given
    /// [`RELOCATE_AFTER`] first. Returns the bytes moved (the caller syncs
    /// before reclaiming if any).
    pub fn relocate_idle(&self) -> Result<u64, WalError> {
        let (oldest, moves): (u64, Vec<GroupId>) = {
            let mut inner = self.lock();
            if inner.segments.len() <= MAX_SEGMENTS {
                return Ok(0);
            }
            let Some((&oldest, s)) = inner.segments.iter().next() else { return Ok(0) };
            if s.holders.is_empty() {
                return Ok(0);
            }
            // The wait starts when idle groups pin the oldest segment, not
            // when the log first went over the limit: a group that was busy
            // until a moment ago (a 4 KiB x 1000 case writing 280 MB) would
            // otherwise be copied whole the instant it goes idle, before its
            // owner's compaction had a chance, holding every append on the
            // node for the copy (4.3 s seen in the side-by-side matrix).
            // While it waits, the idle groups are not looked for again at
            // every sync: ten thousand of them made that pass a fifth of a
            // node's work among busy queues.
            if inner.crowded.is_some_and(|(seg, since)| seg == oldest && since.elapsed() < self.relocate_after) {
                return Ok(0);
            }
            let idle = inner.idle_in(oldest);
            if idle.is_empty() {
                inner.crowded = None;
                return Ok(0);
            }
            match inner.crowded {
                Some((seg, _)) if seg == oldest => {}
                _ => {
                    inner.crowded = Some((oldest, Instant::now()));
                    return Ok(0);
                }
            }
            (oldest, idle)
        };
        let mut moved = 0u64;
        for group in moves {
            let Some((first, last)) = self.bounds(group) else { continue };
            let entries = self.read(group, first, last)?;
            // Under the lock so no append of the group slips in between.
            let mut inner = self.lock();
            if inner.groups.get(&group).and_then(|g| Some((g.first, g.last()?))) != Some((first, last)) {
                continue;
            }
            let mut buf = Vec::new();
            let offsets: Vec<u64> =
                entries.iter().map(|(i, b)| encode_record(&mut buf, KIND_ENTRY, group, *i, b)).collect();
            let (seg, at) = match self.write(&mut inner, &mut buf) {
                Ok(w) => w,
                // A full disk refused the write and left the log as it
                // was: the rest wait for a later round (the node's disk
                // alarm is on meanwhile).
                Err(e) if e.is_no_space() => {
                    // Tried again after the same wait as a first try, not
                    // at every sync (each try reserves a segment's blocks).
                    inner.crowded = Some((oldest, Instant::now()));
                    if !std::mem::replace(&mut inner.relocate_refused, true) {
                        tracing::warn!(error = %e, "idle groups' log entries not moved for now");
                    }
                    break;
                }
                Err(e) => return Err(e),
            };
            inner.relocate_refused = false;
            let by = (seg, at + buf.len() as u64);
            for ((index, bytes), off) in entries.iter().zip(offsets) {
                inner.put(group, *index, Loc { seg, offset: at + off, len: bytes.len() as u32 }, by);
            }
            moved += buf.len() as u64;
        }
        self.relocated.fetch_add(moved, Ordering::Relaxed);
        Ok(moved)
    }

    /// Idle groups (none of their entries in the head segment) with live
    /// entries in the oldest segment, once the log has [`COMPACT_AT`]
    /// segments or more. Their owner compacts their logs (a snapshot, then
    /// a purge), which frees the segment without rewriting anything;
    /// [`Wal::relocate_idle`] stays the fallback for a group that cannot
    /// purge (a replica behind it). Busy groups are left to their own
    /// snapshots: one a second would hold their applies for a sled sync
    /// each time.
    pub fn pinning_oldest(&self) -> Vec<GroupId> {
        let inner = self.lock();
        if inner.segments.len() < COMPACT_AT {
            return Vec::new();
        }
        let Some((&oldest, s)) = inner.segments.iter().next() else { return Vec::new() };
        if s.holders.is_empty() {
            return Vec::new();
        }
        inner.idle_in(oldest)
    }

    /// Bytes moved to the head by [`Wal::relocate_idle`] since the log was
    /// opened: each move held every append of the node.
    pub fn relocated_bytes(&self) -> u64 {
        self.relocated.load(Ordering::Relaxed)
    }

    #[cfg(test)]
    fn with_relocate_after(mut self, after: Duration) -> Self {
        self.relocate_after = after;
        self
    }

    /// Number of segment files.
    #[cfg(test)]
    pub fn segment_count(&self) -> usize {
        self.lock().segments.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(group_tag: u8, range: std::ops::RangeInclusive<u64>, size: usize) -> Vec<(u64, Vec<u8>)> {
        range.map(|i| (i, vec![group_tag ^ (i as u8); size])).collect()
    }

    fn all(wal: &Wal, group: GroupId) -> Vec<(u64, Vec<u8>)> {
        wal.read(group, 0, u64::MAX).unwrap()
    }

    /// A log that no longer reaches a point a sync covered is damaged, even
    /// where what is left ends cleanly; one that reaches it, or whose
    /// segment went with a later one standing, is not.
    #[test]
    fn a_log_cut_short_of_a_synced_point_is_damage() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Wal::open(dir.path(), 1 << 20).unwrap();
        append_each(&wal, 1, &entries(1, 1..=20, 300));
        wal.sync().unwrap();
        let point = wal.synced_point();
        assert!(point.1 > 0);
        drop(wal);
        let head = seg_path(dir.path(), point.0);
        let len = std::fs::metadata(&head).unwrap().len();
        // Reaching it exactly is whole (the open writes nothing here).
        let copy = tempfile::tempdir().unwrap();
        std::fs::copy(&head, copy.path().join(head.file_name().unwrap())).unwrap();
        drop(Wal::open_expecting(copy.path(), 1 << 20, Some(point)).unwrap());
        // A record boundary well inside, as a truncation there leaves it.
        let f = OpenOptions::new().write(true).open(&head).unwrap();
        f.set_len(point.1 / 2).unwrap();
        drop(f);
        assert!(len >= point.1);
        match Wal::open_expecting(dir.path(), 1 << 20, Some(point)) {
            Err(WalError::Shorter { synced, .. }) => assert_eq!(synced, point.1),
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("a log cut short of its synced point opened"),
        }
        let wal = Wal::open(dir.path(), 1 << 20).unwrap();
        assert!(all(&wal, 1).len() < 20, "the cut took entries");
        drop(wal);
        // Opened once, the head moved on: the old point is behind it.
        drop(Wal::open_expecting(dir.path(), 1 << 20, Some(point)).unwrap());
        // No segment at or after the point: the log lost its newest files.
        let empty = tempfile::tempdir().unwrap();
        assert!(matches!(Wal::open_expecting(empty.path(), 1 << 20, Some(point)), Err(WalError::Shorter { .. })));
    }

    /// The highest sled mark the log holds comes back at open, across
    /// segments; one not yet synced is lost with a crash.
    #[test]
    fn sled_marks_come_back_at_open_once_synced() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Wal::open(dir.path(), 4096).unwrap();
        assert_eq!(wal.sled_mark(), 0);
        for mark in 1..=5 {
            wal.note_sled_mark(mark).unwrap();
            append_each(&wal, 1, &entries(1, mark * 10..=mark * 10 + 9, 300));
        }
        wal.sync().unwrap();
        assert!(wal.segment_count() > 1, "the marks should span segments");
        wal.note_sled_mark(6).unwrap();
        wal.crash_for_tests().unwrap();
        drop(wal);
        let wal = Wal::open(dir.path(), 4096).unwrap();
        assert_eq!(wal.sled_mark(), 5);
        assert_eq!(all(&wal, 1).len(), 50, "marks are no entries");
    }

    #[test]
    fn entries_survive_reopen_across_segments() {
        let dir = tempfile::tempdir().unwrap();
        let a = entries(1, 1..=40, 300);
        let b = entries(2, 5..=20, 100);
        {
            let wal = Wal::open(dir.path(), 4096).unwrap();
            for chunk in a.chunks(3) {
                wal.append(1, chunk).unwrap();
            }
            wal.append(2, &b).unwrap();
            wal.sync().unwrap();
            assert!(wal.segment_count() > 2, "small segments: the log moved on");
            assert_eq!(all(&wal, 1), a);
        }
        let wal = Wal::open(dir.path(), 4096).unwrap();
        assert_eq!(all(&wal, 1), a);
        assert_eq!(all(&wal, 2), b);
        assert_eq!(wal.bounds(2), Some((5, 20)));
        assert_eq!(wal.read(1, 10, 12).unwrap(), a[9..12].to_vec());
        assert!(wal.read(3, 0, 9).unwrap().is_empty());
    }

    #[test]
    fn truncate_rewrite_append_over_and_drop_are_replayed() {
        let dir = tempfile::tempdir().unwrap();
        let mut want = entries(1, 1..=10, 50);
        {
            let wal = Wal::open(dir.path(), 1 << 20).unwrap();
            wal.append(1, &want).unwrap();
            wal.truncate(1, 8).unwrap();
            want.truncate(7);
            // Appending over an index replaces it and what follows.
            let over = entries(9, 6..=9, 20);
            wal.append(1, &over).unwrap();
            want.truncate(5);
            want.extend(over);
            // A rewrite replaces one entry and keeps the later ones.
            let re = vec![(3, b"rewritten".to_vec()), (10, b"appended".to_vec())];
            wal.rewrite(1, &re).unwrap();
            want[2] = re[0].clone();
            want.push(re[1].clone());
            wal.append(2, &entries(2, 1..=3, 10)).unwrap();
            wal.drop_group(2).unwrap();
            wal.sync().unwrap();
            assert_eq!(all(&wal, 1), want);
        }
        let wal = Wal::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(all(&wal, 1), want);
        assert!(!wal.has_group(2), "dropped");
        assert_eq!(wal.groups(), vec![1]);
    }

    /// Append each entry on its own, so that small segments fill and the
    /// log moves on between them.
    fn append_each(wal: &Wal, group: GroupId, es: &[(u64, Vec<u8>)]) {
        for e in es {
            wal.append(group, std::slice::from_ref(e)).unwrap();
        }
    }

    /// A log in `dir` holding `es` of group 1, synced and closed.
    fn written(dir: &Path, segment_bytes: u64, es: &[(u64, Vec<u8>)]) {
        let wal = Wal::open(dir, segment_bytes).unwrap();
        wal.append(1, es).unwrap();
        wal.sync().unwrap();
    }

    fn inode(path: &Path) -> u64 {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(path).unwrap().ino()
    }

    fn files_with(dir: &Path, ext: &str) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == ext))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn new_segments_are_preallocated_and_a_full_one_is_sealed() {
        let dir = tempfile::tempdir().unwrap();
        let seg_bytes = 64 << 10;
        let blocks = |id| {
            use std::os::unix::fs::MetadataExt;
            let m = std::fs::metadata(seg_path(dir.path(), id)).unwrap();
            (m.len(), m.blocks() * 512)
        };
        let a = entries(1, 1..=3, 100);
        {
            let wal = Wal::open(dir.path(), seg_bytes).unwrap();
            let (len, allocated) = blocks(1);
            assert_eq!(len, seg_bytes, "a new segment has its full size at once");
            assert!(allocated >= seg_bytes, "and its blocks: {allocated} bytes allocated");
            wal.append(1, &a).unwrap();
            wal.sync().unwrap();
        }
        // Reopened (as after a crash): the segment is sealed after its last
        // good record and the log goes on in a new one.
        let wal = Wal::open(dir.path(), seg_bytes).unwrap();
        assert_eq!(all(&wal, 1), a);
        assert_eq!(wal.segment_count(), 2);
        let parsed = parse(&File::open(seg_path(dir.path(), 1)).unwrap(), Some(1)).unwrap();
        assert!(parsed.sealed, "the first segment ends with its seal");
        assert_eq!(parsed.valid, (a.len() * (HEADER + 100) + HEADER) as u64);
        // Filling the head moves the log on again, sealing it first.
        let big = entries(2, 1..=2, (seg_bytes / 2) as usize);
        wal.append(2, &big[..1]).unwrap();
        wal.append(2, &big[1..]).unwrap();
        wal.sync().unwrap();
        assert_eq!(wal.segment_count(), 3);
        assert!(parse(&File::open(seg_path(dir.path(), 2)).unwrap(), Some(2)).unwrap().sealed);
        drop(wal);
        let wal = Wal::open(dir.path(), seg_bytes).unwrap();
        assert_eq!(all(&wal, 1), a);
        assert_eq!(all(&wal, 2), big);
    }

    /// A dead segment's file becomes a later segment; what it held, valid
    /// records of its old id, never reads back.
    #[test]
    fn a_dead_segments_file_is_reused_and_its_old_records_never_come_back() {
        let dir = tempfile::tempdir().unwrap();
        let one = entries(1, 1..=40, 500);
        // Seven entries to a segment: the second reused file is the head,
        // its old records right behind the new ones.
        let two = entries(2, 1..=10, 500);
        {
            let wal = Wal::open(dir.path(), 4096).unwrap();
            append_each(&wal, 1, &one);
            wal.sync().unwrap();
            wal.purge(1, 35);
            let dead = wal.reclaimable();
            assert!(dead.len() > MAX_SPARES, "{} dead segments", dead.len());
            let dead_files: Vec<PathBuf> = dead.iter().map(|id| seg_path(dir.path(), *id)).collect();
            let inodes: Vec<u64> = dead_files.iter().map(|p| inode(p)).collect();
            wal.remove(&dead).unwrap();
            // The oldest dead ones are kept, the rest unlinked.
            let spares = files_with(dir.path(), "spare");
            assert_eq!(spares.len(), MAX_SPARES);
            assert!(dead_files.iter().all(|p| !p.exists()));
            let spare_inodes: Vec<u64> = spares.iter().map(|p| inode(p)).collect();
            assert_eq!(spare_inodes, inodes[..MAX_SPARES].to_vec());
            // The next segments are the spares, renamed.
            append_each(&wal, 2, &two);
            wal.sync().unwrap();
            assert_eq!(files_with(dir.path(), "spare").len(), MAX_SPARES - 2);
            let heads: Vec<u64> = files_with(dir.path(), "wal").iter().map(|p| inode(p)).collect();
            assert_eq!(heads[heads.len() - 2..], spare_inodes[..2], "the oldest spares first");
            assert_eq!(all(&wal, 1), one[35..].to_vec());
            assert_eq!(all(&wal, 2), two);
        }
        // Read back from disk: the reused files' old records (group 1 from
        // index 1, their CRCs salted with the old ids) are not records.
        let wal = Wal::open(dir.path(), 4096).unwrap();
        assert_eq!(all(&wal, 1), one[35..].to_vec());
        assert_eq!(all(&wal, 2), two);
    }

    /// A spare a crash left beside the log under a later segment's name
    /// (made for a roll-over the crash cut short) is loaded with the others
    /// and outlives that segment's start. When that segment dies, its file
    /// must not be renamed onto the listed spare's name: the spare's open
    /// handle would then be a deleted file, and a later segment written
    /// through it would be gone at the next open.
    #[test]
    fn a_dead_segment_is_never_renamed_onto_a_listed_spares_name() {
        let dir = tempfile::tempdir().unwrap();
        let one = entries(1, 1..=40, 500);
        let next = {
            let wal = Wal::open(dir.path(), 4096).unwrap();
            append_each(&wal, 1, &one);
            wal.sync().unwrap();
            wal.purge(1, 35);
            wal.sync().unwrap();
            let dead = wal.reclaimable();
            assert!(dead.len() >= 2, "{} dead segments", dead.len());
            // Two spares, from the oldest dead segments.
            wal.remove(&dead[..2]).unwrap();
            let active = wal.lock().active;
            active + 1
        };
        // The next start's first segment will be `next`.
        let leftover = spare_path(dir.path(), next);
        let f = File::create(&leftover).unwrap();
        f.set_len(4096).unwrap();
        drop(f);
        // Enough to move past segment `next` (seven to a segment), not to
        // use the leftover spare.
        let two = entries(2, 1..=10, 500);
        let three = entries(2, 11..=40, 500);
        {
            let wal = Wal::open(dir.path(), 4096).unwrap();
            assert_eq!(wal.lock().active, next);
            assert!(leftover.exists(), "an older spare became segment {next}");
            append_each(&wal, 2, &two);
            assert!(leftover.exists(), "the leftover spare is still unused");
            wal.sync().unwrap();
            // Segment `next` dies, and those before it (segments are
            // reclaimed oldest first).
            wal.purge(1, 40);
            wal.purge(2, 8);
            wal.sync().unwrap();
            let dead = wal.reclaimable();
            assert!(dead.contains(&next), "segment {next} is dead: {dead:?}");
            // Segment `next`'s file alone is retired, so that the spares
            // have room for it (the older ones' files are left).
            wal.remove(&[next]).unwrap();
            // The next segments are made of the spares, the leftover one
            // among them.
            append_each(&wal, 2, &three);
            wal.sync().unwrap();
            assert!(!leftover.exists(), "every spare was used");
            assert!(all(&wal, 2) == [&two[8..], &three[..]].concat());
        }
        // (A purge is replayed as far as its segment reached: the first
        // entries kept may start earlier than asked.)
        let wal = Wal::open(dir.path(), 4096).unwrap();
        assert!(wal.read(2, 9, 40).unwrap() == [&two[8..], &three[..]].concat(), "entries lost at the reopen");
    }

    /// A roll-over that fails after the seal (the next segment's name is
    /// taken by a directory) leaves the head sealed. A record written behind
    /// the seal would be acknowledged and then lost, as recovery stops at the
    /// seal: every later write is refused instead.
    #[test]
    fn a_roll_over_failing_after_the_seal_refuses_every_later_write() {
        let dir = tempfile::tempdir().unwrap();
        let early = entries(1, 1..=1, 3000);
        let late = entries(1, 2..=2, 100);
        let wal = Wal::open(dir.path(), 4096).unwrap();
        wal.append(1, &early).unwrap();
        wal.sync().unwrap();
        std::fs::create_dir(seg_path(dir.path(), 2)).unwrap();
        // Too big for segment 1: it is sealed, then segment 2 cannot be made.
        assert!(wal.append(1, &entries(1, 2..=2, 3000)).is_err());
        // Small enough to fit behind the seal.
        let acked = wal.append(1, &late).is_ok() && wal.sync().is_ok();
        let other_write = wal.truncate(1, 3);
        drop(wal);
        std::fs::remove_dir(seg_path(dir.path(), 2)).unwrap();
        let wal = Wal::open(dir.path(), 4096).unwrap();
        let indexes: Vec<u64> = all(&wal, 1).into_iter().map(|(i, _)| i).collect();
        if acked {
            assert_eq!(indexes, vec![1, 2], "an acknowledged append was lost on reopen");
        }
        assert!(!acked, "an append after the failed roll-over was acknowledged");
        assert!(matches!(other_write, Err(WalError::Failed)), "{other_write:?}");
        assert_eq!(all(&wal, 1), early);
    }

    /// A new segment that meets a full disk refuses the write with
    /// `NoSpace` before the head is sealed: no file is left behind, the
    /// alarm hears of it, and the log goes on (a smaller write into the
    /// head, the refused one once there is space), all of it read back
    /// after a reopen.
    #[test]
    fn a_full_disk_refuses_the_roll_over_and_the_log_goes_on() {
        let dir = tempfile::tempdir().unwrap();
        let first = entries(1, 1..=1, 3000);
        let wal = Wal::open(dir.path(), 4096).unwrap();
        let mut alarm = wal.no_space();
        wal.append(1, &first).unwrap();
        wal.sync().unwrap();
        NO_SPACE_FOR.with(|n| n.set(1));
        let err = wal.append(1, &entries(1, 2..=2, 3000)).unwrap_err();
        assert!(err.is_no_space(), "{err:?}");
        assert!(err.to_string().contains("no space left"), "{err}");
        assert!(alarm.has_changed().unwrap(), "the full disk was not announced");
        assert_eq!(*alarm.borrow_and_update(), 1);
        assert_eq!(wal.segment_count(), 1);
        assert!(files_with(dir.path(), "spare").is_empty(), "a half-made segment was left");
        let small = entries(1, 2..=2, 100);
        wal.append(1, &small).unwrap();
        wal.sync().unwrap();
        let big = entries(1, 3..=3, 3000);
        wal.append(1, &big).unwrap();
        wal.sync().unwrap();
        assert_eq!(wal.segment_count(), 2);
        drop(wal);
        let wal = Wal::open(dir.path(), 4096).unwrap();
        assert_eq!(all(&wal, 1), [first, small, big].concat());
    }

    /// Moving an idle group's entries to the head when the head's next
    /// segment meets a full disk is put off, not an error (which would
    /// stop the node as a failed sync does); it is done once there is room.
    #[test]
    fn moving_idle_groups_waits_out_a_full_disk() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Wal::open(dir.path(), 1024).unwrap().with_relocate_after(Duration::ZERO);
        let idle = entries(9, 1..=1, 300);
        wal.append(9, &idle).unwrap();
        for i in 1..=16u64 {
            wal.append(1, &[(i, vec![1; 300])]).unwrap();
            wal.purge(1, i.saturating_sub(1));
        }
        wal.sync().unwrap();
        assert!(wal.segment_count() > MAX_SEGMENTS);
        assert_eq!(wal.pinning_oldest(), vec![9]);
        assert_eq!(wal.relocate_idle().unwrap(), 0, "the wait starts");
        // Fill the head so that the move needs a new segment.
        let mut i = 17;
        while wal.lock().active_len < 1024 - 200 {
            wal.append(1, &[(i, vec![1; 50])]).unwrap();
            i += 1;
        }
        NO_SPACE_FOR.with(|n| n.set(1));
        assert_eq!(wal.relocate_idle().unwrap(), 0, "nothing moved on a full disk");
        assert_eq!(wal.pinning_oldest(), vec![9]);
        assert!(wal.relocate_idle().unwrap() > 0, "moved once there is room");
        wal.sync().unwrap();
        assert_eq!(all(&wal, 9), idle);
    }

    /// A test's crash keeps what each sync covered, across segments (a
    /// roll-over syncs the sealed one), a drop that synced by itself, and
    /// nothing written after.
    #[test]
    fn a_crash_cuts_each_segment_back_to_its_last_sync() {
        let dir = tempfile::tempdir().unwrap();
        let synced = entries(1, 1..=10, 500);
        {
            let wal = Wal::open(dir.path(), 4096).unwrap();
            append_each(&wal, 1, &synced);
            wal.append(2, &entries(2, 1..=1, 10)).unwrap();
            wal.sync().unwrap();
            assert!(wal.segment_count() > 1);
            wal.drop_group(2).unwrap();
            wal.append(1, &entries(1, 11..=11, 100)).unwrap();
            wal.crash_for_tests().unwrap();
            assert!(matches!(wal.append(1, &entries(1, 12..=12, 10)), Err(WalError::Failed)));
        }
        let wal = Wal::open(dir.path(), 4096).unwrap();
        assert_eq!(wal.bounds(1), Some((1, 10)));
        assert!(all(&wal, 1) == synced);
        assert!(!wal.has_group(2), "its drop synced itself");
    }

    /// A segment whose entries a truncation killed stays until that
    /// truncation is synced: removed before, a power cut would lose the
    /// truncation and keep the entries after the removed ones, a hole
    /// between the group's purge point and its next entries.
    #[test]
    fn a_segment_killed_by_an_unsynced_record_is_not_reclaimed_before_it_is_durable() {
        let dir = tempfile::tempdir().unwrap();
        let es = entries(1, 1..=10, 500);
        {
            let wal = Wal::open(dir.path(), 4096).unwrap();
            append_each(&wal, 1, &es);
            wal.sync().unwrap();
            assert!(wal.segment_count() > 1);
            // As in a flusher round: the log synced, then a truncation comes
            // in before the round asks what it may reclaim.
            wal.truncate(1, 1).unwrap();
            let dead = wal.reclaimable();
            wal.remove(&dead).unwrap();
            wal.crash_for_tests().unwrap();
        }
        let wal = Wal::open(dir.path(), 4096).unwrap();
        let indexes: Vec<u64> = all(&wal, 1).into_iter().map(|(i, _)| i).collect();
        assert_eq!(indexes, (1..=10).collect::<Vec<_>>(), "the truncation was lost, so every entry must be back");
        assert_eq!(all(&wal, 1), es);
        drop(wal);
        // Once the truncation is durable the segments go.
        let wal = Wal::open(dir.path(), 4096).unwrap();
        wal.truncate(1, 1).unwrap();
        assert!(wal.reclaimable().is_empty(), "not synced yet");
        wal.sync().unwrap();
        assert!(!wal.reclaimable().is_empty());
    }

    #[test]
    fn a_dead_segment_still_being_read_is_not_reused() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Wal::open(dir.path(), 4096).unwrap();
        append_each(&wal, 1, &entries(1, 1..=10, 500));
        wal.purge(1, 7);
        let dead = wal.reclaimable();
        assert!(!dead.is_empty());
        // A reader took the oldest segment's handle before it died.
        let reading = wal.lock().segments[&dead[0]].file.clone();
        let held = inode(&seg_path(dir.path(), dead[0]));
        wal.remove(&dead).unwrap();
        append_each(&wal, 2, &entries(2, 1..=30, 500));
        let heads: Vec<u64> = files_with(dir.path(), "wal").iter().map(|p| inode(p)).collect();
        assert!(!heads.contains(&held), "a file a reader holds was written over");
        assert_eq!(files_with(dir.path(), "spare").len(), 1, "it waits as a spare");
        drop(reading);
        append_each(&wal, 2, &entries(2, 31..=40, 500));
        assert!(files_with(dir.path(), "spare").is_empty());
        let heads: Vec<u64> = files_with(dir.path(), "wal").iter().map(|p| inode(p)).collect();
        assert!(heads.contains(&held), "once let go it is reused");
    }

    /// Bytes after a torn record may be records of the same segment that
    /// reached the disk before it: the seal keeps them out for good.
    #[test]
    fn records_after_a_torn_one_stay_out_even_when_the_log_writes_over_it() {
        let dir = tempfile::tempdir().unwrap();
        let a = entries(1, 1..=5, 100);
        written(dir.path(), 1 << 20, &a);
        let seg = seg_path(dir.path(), 1);
        let f = OpenOptions::new().write(true).open(&seg).unwrap();
        // Entry 3's block never made it; 4 and 5 did.
        f.write_all_at(&[0; 20], (2 * (HEADER + 100) + HEADER + 10) as u64).unwrap();
        drop(f);
        {
            let wal = Wal::open(dir.path(), 1 << 20).unwrap();
            assert_eq!(all(&wal, 1), a[..2].to_vec());
            // An entry 3 of the same size as the torn one, written where it
            // was, would put 4 and 5 right behind it.
            wal.append(1, &entries(9, 3..=3, 100)).unwrap();
            wal.sync().unwrap();
        }
        let wal = Wal::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(wal.bounds(1), Some((1, 3)), "entries 4 and 5 were never acknowledged");
        assert_eq!(all(&wal, 1)[2], entries(9, 3..=3, 100)[0]);
    }

    #[test]
    fn a_segment_that_is_not_the_last_must_end_with_its_seal() {
        let dir = tempfile::tempdir().unwrap();
        {
            let wal = Wal::open(dir.path(), 1024).unwrap();
            append_each(&wal, 1, &entries(1, 1..=6, 300));
            wal.sync().unwrap();
        }
        let seg = seg_path(dir.path(), 1);
        let end = parse(&File::open(&seg).unwrap(), Some(1)).unwrap().valid;
        // The seal lost: the next segment's records cannot be trusted to
        // follow this one's.
        OpenOptions::new().write(true).open(&seg).unwrap().write_all_at(&[0; HEADER], end - HEADER as u64).unwrap();
        match Wal::open(dir.path(), 1024) {
            Err(WalError::Corrupt { offset, .. }) => assert_eq!(offset, end - HEADER as u64),
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("an unsealed segment before the last was accepted"),
        }
    }

    /// Segments written before records were salted and sealed: cut to their
    /// records, the last one possibly torn.
    #[test]
    fn segments_of_the_previous_format_are_read_and_left_behind() {
        let dir = tempfile::tempdir().unwrap();
        let a = entries(1, 1..=4, 100);
        let b = entries(1, 5..=7, 100);
        let unsalted = |es: &[(u64, Vec<u8>)]| {
            let mut buf = Vec::new();
            for (i, bytes) in es {
                encode_record(&mut buf, KIND_ENTRY, 1, *i, bytes);
            }
            buf
        };
        std::fs::write(v1_path(dir.path(), 1), unsalted(&a)).unwrap();
        let mut last = unsalted(&b);
        let torn = last.len() - 40;
        last.truncate(torn);
        last.extend_from_slice(&[0; 4096]);
        std::fs::write(v1_path(dir.path(), 2), last).unwrap();
        {
            let wal = Wal::open(dir.path(), 1 << 20).unwrap();
            assert_eq!(all(&wal, 1), [&a[..], &b[..2]].concat());
            assert_eq!(std::fs::metadata(v1_path(dir.path(), 2)).unwrap().len(), (2 * (HEADER + 100)) as u64, "cut");
            wal.append(1, &entries(3, 7..=8, 50)).unwrap();
            wal.sync().unwrap();
            assert!(seg_path(dir.path(), 3).exists(), "new records go to a segment of this format");
        }
        let wal = Wal::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(all(&wal, 1), [&a[..], &b[..2], &entries(3, 7..=8, 50)[..]].concat());
    }

    #[test]
    fn a_torn_tail_is_sealed_off_and_damage_before_it_refused() {
        let dir = tempfile::tempdir().unwrap();
        let a = entries(1, 1..=5, 100);
        written(dir.path(), 1 << 20, &a);
        let seg = seg_path(dir.path(), 1);
        let whole = (a.len() * (HEADER + 100)) as u64;
        // Half a record written when the power went: the rest of its
        // blocks read as the zeros of reserved space.
        let f = OpenOptions::new().write(true).open(&seg).unwrap();
        f.write_all_at(&[0; 30], whole - 30).unwrap();
        drop(f);
        {
            let wal = Wal::open(dir.path(), 1 << 20).unwrap();
            assert_eq!(all(&wal, 1), a[..4].to_vec(), "the torn last entry is gone, the rest kept");
            // Writing goes on after the torn entry, not after the garbage.
            wal.append(1, &entries(7, 5..=6, 10)).unwrap();
            wal.sync().unwrap();
        }
        let wal = Wal::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(wal.bounds(1), Some((1, 6)));
        drop(wal);
        // A flipped byte in a segment that is not the last is corruption.
        {
            let wal = Wal::open(dir.path(), 200).unwrap();
            wal.append(1, &entries(3, 7..=9, 150)).unwrap();
            wal.sync().unwrap();
        }
        let mut bytes = std::fs::read(&seg).unwrap();
        bytes[HEADER + 3] ^= 0xff;
        std::fs::write(&seg, bytes).unwrap();
        match Wal::open(dir.path(), 200) {
            Err(WalError::Corrupt { offset, .. }) => assert_eq!(offset, 0),
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("a damaged segment was accepted"),
        }
    }

    /// A record of the head segment that a sync covered and that no
    /// longer reads back is damage, not a torn tail: the log refuses to
    /// start, naming the record, rather than drop it and every record
    /// after it.
    #[test]
    fn a_flipped_byte_in_a_synced_record_of_the_head_is_corruption_not_its_end() {
        let dir = tempfile::tempdir().unwrap();
        let a = entries(1, 1..=5, 100);
        {
            let wal = Wal::open(dir.path(), 1 << 20).unwrap();
            wal.append(1, &a).unwrap();
            wal.sync().unwrap();
            // The next write says how far the head was synced.
            wal.append(2, &entries(2, 1..=1, 10)).unwrap();
            wal.sync().unwrap();
        }
        let seg = seg_path(dir.path(), 1);
        let third = (2 * (HEADER + 100)) as u64;
        let f = OpenOptions::new().read(true).write(true).open(&seg).unwrap();
        let mut byte = [0u8];
        f.read_exact_at(&mut byte, third + HEADER as u64 + 40).unwrap();
        f.write_all_at(&[byte[0] ^ 0x10], third + HEADER as u64 + 40).unwrap();
        drop(f);
        match Wal::open(dir.path(), 1 << 20) {
            Err(WalError::Corrupt { offset, group, index, .. }) => {
                assert_eq!((offset, group, index), (third, Some(1), Some(3)))
            }
            Err(e) => panic!("wrong error: {e}"),
            Ok(wal) => panic!("damage read as the end of the log: group 1 holds {:?}", wal.bounds(1)),
        }
        // Also when the damaged length hides where the next records start.
        let f = OpenOptions::new().write(true).open(&seg).unwrap();
        f.write_all_at(&[0xff; 4], third + 4).unwrap();
        drop(f);
        assert!(matches!(Wal::open(dir.path(), 1 << 20), Err(WalError::Corrupt { offset, .. }) if offset == third));
    }

    /// Bits that rot under a running log are found when the entry is read
    /// (served, replicated or applied), never handed on as the entry.
    #[test]
    fn an_entry_that_rotted_after_the_open_is_refused_when_read() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Wal::open(dir.path(), 1 << 20).unwrap();
        wal.append(1, &entries(1, 1..=3, 100)).unwrap();
        wal.sync().unwrap();
        assert_eq!(wal.read(1, 1, 3).unwrap().len(), 3);
        let second = (HEADER + 100) as u64;
        let f = OpenOptions::new().read(true).write(true).open(seg_path(dir.path(), 1)).unwrap();
        let mut byte = [0u8];
        f.read_exact_at(&mut byte, second + HEADER as u64 + 7).unwrap();
        f.write_all_at(&[byte[0] ^ 0x01], second + HEADER as u64 + 7).unwrap();
        match wal.read(1, 1, 3) {
            Err(WalError::Corrupt { offset, group, index, .. }) => {
                assert_eq!((offset, group, index), (second, Some(1), Some(2)))
            }
            other => panic!("a rotted entry was read as written: {other:?}"),
        }
        assert_eq!(wal.read(1, 1, 1).unwrap(), entries(1, 1..=1, 100), "the entry before it is whole");
    }

    /// What was written after the last sync and torn by the crash is still
    /// the log's end, cut there, records of the same write behind it or not.
    #[test]
    fn a_torn_unsynced_tail_is_still_cut() {
        let dir = tempfile::tempdir().unwrap();
        let a = entries(1, 1..=3, 100);
        let b = entries(1, 4..=7, 100);
        {
            let wal = Wal::open(dir.path(), 1 << 20).unwrap();
            wal.append(1, &a).unwrap();
            wal.sync().unwrap();
            // Never synced; opens with how far the head was synced.
            wal.append(1, &b).unwrap();
        }
        // Entry 5's block never made it; 6 and 7 did.
        let fifth = (3 * (HEADER + 100) + HEADER + HEADER + 100) as u64;
        OpenOptions::new()
            .write(true)
            .open(seg_path(dir.path(), 1))
            .unwrap()
            .write_all_at(&[0; 30], fifth + 10)
            .unwrap();
        let wal = Wal::open(dir.path(), 1 << 20).unwrap();
        assert_eq!(all(&wal, 1), [&a[..], &b[..1]].concat());
    }

    /// A group that pinned the oldest segment while busy gets the whole
    /// wait once it goes idle: the time the log spent over the limit
    /// before does not count.
    #[test]
    fn a_group_gone_idle_gets_the_whole_wait_before_it_is_moved() {
        let dir = tempfile::tempdir().unwrap();
        let wal = Wal::open(dir.path(), 1024).unwrap().with_relocate_after(Duration::from_millis(300));
        // Group 9 writes past the limit, busy (its last entry in the head).
        for i in 1..=40u64 {
            wal.append(9, &[(i, vec![9; 300])]).unwrap();
        }
        wal.sync().unwrap();
        assert!(wal.segment_count() > MAX_SEGMENTS);
        assert_eq!(wal.relocate_idle().unwrap(), 0, "a busy group is never moved");
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(wal.relocate_idle().unwrap(), 0, "still busy");
        // Another group takes the head: group 9 is idle from now on.
        for i in 1..=6u64 {
            wal.append(1, &[(i, vec![1; 300])]).unwrap();
            wal.purge(1, i.saturating_sub(1));
        }
        assert_eq!(wal.pinning_oldest(), vec![9]);
        assert_eq!(wal.relocate_idle().unwrap(), 0, "just gone idle: its owner compacts first");
        assert_eq!(wal.relocate_idle().unwrap(), 0);
        std::thread::sleep(Duration::from_millis(400));
        assert!(wal.relocate_idle().unwrap() > 0, "the owner had its chance: the fallback copy");
    }

    /// The groups named as pinning the oldest segment are those with live
    /// entries there: not one whose entries there were purged, truncated,
    /// dropped or rewritten elsewhere, nor one busy in the head; and after
    /// a replay.
    #[test]
    fn only_groups_with_live_entries_in_the_oldest_segment_pin_it() {
        let dir = tempfile::tempdir().unwrap();
        let pinning = |wal: &Wal| {
            let mut p = wal.pinning_oldest();
            p.sort_unstable();
            p
        };
        {
            let wal = Wal::open(dir.path(), 1024).unwrap();
            for g in [2, 3, 4, 5, 6, 9] {
                wal.append(g, &entries(g as u8, 1..=2, 40)).unwrap();
            }
            wal.purge(2, 2);
            wal.truncate(3, 1).unwrap();
            wal.drop_group(4).unwrap();
            for i in 1..=60u64 {
                wal.append(1, &[(i, vec![1; 300])]).unwrap();
                wal.purge(1, i.saturating_sub(2));
                if i == 5 {
                    // Both of group 5's entries now in a later segment.
                    wal.rewrite(5, &entries(5, 1..=2, 40)).unwrap();
                }
            }
            wal.append(6, &entries(6, 3..=3, 40)).unwrap();
            assert!(wal.segment_count() >= COMPACT_AT);
            assert_eq!(pinning(&wal), vec![9], "group 6 is busy, 2-5 hold nothing there");
            wal.sync().unwrap();
        }
        // Purge points live outside the log: its owner purges again after
        // a start. A reopened log writes to a new head, so group 6 is idle.
        let wal = Wal::open(dir.path(), 1024).unwrap();
        wal.purge(2, 2);
        assert_eq!(pinning(&wal), vec![6, 9], "replayed");
    }

    #[test]
    fn dead_segments_are_reclaimed_and_idle_groups_moved_to_the_head() {
        let dir = tempfile::tempdir().unwrap();
        let idle = entries(5, 1..=3, 100);
        {
            let wal = Wal::open(dir.path(), 1024).unwrap().with_relocate_after(Duration::from_millis(100));
            wal.append(9, &idle).unwrap();
            wal.append(1, &[(1, vec![1; 300])]).unwrap();
            assert_eq!(wal.pinning_oldest(), Vec::<GroupId>::new(), "one segment: nothing to compact");
            for i in 2..=60u64 {
                wal.append(1, &[(i, vec![1; 300])]).unwrap();
                wal.purge(1, i.saturating_sub(2));
            }
            wal.sync().unwrap();
            // Group 1's purged entries are dead, but the idle group pins the
            // oldest segment: nothing can go yet.
            assert!(wal.reclaimable().is_empty());
            assert!(wal.segment_count() > MAX_SEGMENTS);
            assert_eq!(wal.pinning_oldest(), vec![9], "its owner is asked to compact it");
            // The owner gets its chance before anything is copied.
            assert_eq!(wal.relocate_idle().unwrap(), 0);
            assert_eq!(wal.relocate_idle().unwrap(), 0);
            std::thread::sleep(Duration::from_millis(150));
            assert!(wal.relocate_idle().unwrap() > 300, "three entries of 100 bytes and their headers");
            wal.sync().unwrap();
            let dead = wal.reclaimable();
            assert!(!dead.is_empty());
            wal.remove(&dead).unwrap();
            assert!(wal.segment_count() <= 3, "{} segments left", wal.segment_count());
            assert_eq!(all(&wal, 9), idle);
        }
        let wal = Wal::open(dir.path(), 1024).unwrap();
        assert_eq!(all(&wal, 9), idle, "moved entries replay");
        assert_eq!(wal.bounds(1).map(|b| b.1), Some(60));
    }
}
