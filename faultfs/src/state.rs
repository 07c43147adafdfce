//! The inode table, the unsynced-write tracking and the durable image.
//!
//! Live view: BACKING itself. Durable image: a namespace in memory
//! ([`Durable::dirs`], keyed by directory fid) and, per regular file, a copy
//! of its last synced contents in `STATE/data/<fid>` (absent = empty). A
//! file found in BACKING at mount is "same as live" until first changed: only
//! then is its live content copied to the state dir ([`Inner::ensure_stored`]).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{CString, OsStr, OsString};
use std::fs::{self, File, Metadata, OpenOptions};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use fuser::{Errno, FileType};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::error::FaultError;

/// Our file identity; also the FUSE inode number. Stable across renames and
/// across `cut` (the kernel's inode numbers stay meaningful).
pub type Fid = u64;

pub const ROOT: Fid = 1;

/// Name of the scratch directory inside BACKING that holds live files kept
/// across a `cut` while the tree is rebuilt (exists only during a cut).
const SALVAGE: &str = ".faultfs-salvage";

/// Copy buffer size for syncs and reverts.
const CHUNK: usize = 1 << 20;

/// One live file or directory.
#[derive(Debug)]
pub struct Node {
    /// File, directory, symlink...
    pub kind: FileType,
    /// Its live names as (parent fid, name); a directory has one, a file
    /// one per hard link, an unlinked file none.
    pub links: Vec<(Fid, OsString)>,
}

/// One unsynced change to a file, in write order (for `torn`).
#[derive(Debug, Clone, Copy)]
enum Op {
    Write {
        off: u64,
        len: u64,
    },
    /// A truncate or extending fallocate set the size.
    Size(u64),
}

/// A file's changes since its last sync. Holds ranges, never data: the data
/// is in BACKING.
#[derive(Debug)]
struct Dirty {
    /// In write order; an append continuing the previous write is merged.
    ops: Vec<Op>,
    /// The smallest live size since the last sync: beyond it the durable
    /// bytes were cut off the live file.
    min_size: u64,
}

impl Dirty {
    fn push_write(&mut self, off: u64, len: u64) {
        if len == 0 {
            return;
        }
        if let Some(Op::Write { off: o, len: l }) = self.ops.last_mut() {
            if *o + *l == off {
                *l += len;
                return;
            }
        }
        self.ops.push(Op::Write { off, len });
    }

    /// The written ranges, sorted and merged.
    fn extents(&self) -> Vec<(u64, u64)> {
        let mut v: Vec<(u64, u64)> = self
            .ops
            .iter()
            .filter_map(|op| match *op {
                Op::Write { off, len } => Some((off, off + len)),
                Op::Size(_) => None,
            })
            .collect();
        merge(&mut v);
        v
    }
}

fn merge(v: &mut Vec<(u64, u64)>) {
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for &(s, e) in v.iter() {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    *v = out;
}

/// One name in the durable namespace.
#[derive(Debug, Clone, PartialEq)]
pub struct DEntry {
    pub fid: Fid,
    pub kind: FileType,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    /// A symlink's target.
    pub target: Option<PathBuf>,
}

/// The durable image's namespace.
#[derive(Debug, Default)]
struct Durable {
    /// Entries of each directory as last committed.
    dirs: HashMap<Fid, BTreeMap<OsString, DEntry>>,
    /// Durable names per fid, to drop its copy when none is left.
    refs: HashMap<Fid, u32>,
    /// Fids whose durable content is `STATE/data/<fid>` (absent = empty);
    /// any other file's durable content is its live content (never changed).
    stored: HashSet<Fid>,
}

/// An open file or directory.
#[derive(Debug)]
pub enum Handle {
    File {
        fid: Fid,
        file: Arc<File>,
        /// Opened with O_SYNC/O_DSYNC: each write is synced.
        sync: bool,
    },
    Dir {
        fid: Fid,
        /// Snapshot taken at opendir: (name, fid, kind), with "." and "..".
        entries: Vec<(OsString, Fid, FileType)>,
    },
}

/// Faults armed through the control socket.
#[derive(Debug, Default)]
pub struct Faults {
    /// The next this many syncs fail with EIO.
    pub fail_fsync: u64,
    /// Writes that would take the files' total size above this fail with ENOSPC.
    pub enospc: Option<u64>,
    /// Each sync sleeps this long first.
    pub delay_ms: u64,
}

/// Counters for `stats`.
#[derive(Debug, Default)]
pub struct Stats {
    pub syncs: u64,
    pub failed_syncs: u64,
    pub cuts: u64,
}

/// Everything behind the one lock.
#[derive(Debug)]
pub struct Inner {
    backing: PathBuf,
    /// `STATE/data`: durable copies by fid.
    data: PathBuf,
    pub strict: bool,
    nodes: HashMap<Fid, Node>,
    /// Backing st_ino -> fid.
    by_backing: HashMap<u64, Fid>,
    next_fid: Fid,
    pub handles: HashMap<u64, Handle>,
    next_fh: u64,
    dirty: HashMap<Fid, Dirty>,
    /// Directories whose entries changed since they were last committed.
    ns_dirty: HashSet<Fid>,
    durable: Durable,
    pub faults: Faults,
    /// Live size of all regular files (for `enospc`).
    total_bytes: u64,
    pub stats: Stats,
}

pub fn errno(e: io::Error) -> Errno {
    Errno::from(e)
}

pub fn cpath(p: &Path) -> Result<CString, Errno> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| Errno::EINVAL)
}

pub fn kind_of(md: &Metadata) -> FileType {
    FileType::from_std(md.file_type()).unwrap_or(FileType::RegularFile)
}

fn read_at_full(file: &File, buf: &mut [u8], off: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], off + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// Copies `[start, end)` of `from` to the same offsets of `to`; bytes past
/// the end of `from` are written as zeros.
fn copy_range(from: &File, to: &File, start: u64, end: u64) -> io::Result<()> {
    let mut buf = vec![0u8; CHUNK.min((end - start) as usize)];
    let mut off = start;
    while off < end {
        let n = buf.len().min((end - off) as usize);
        let got = read_at_full(from, &mut buf[..n], off)?;
        buf[got..n].fill(0);
        to.write_all_at(&buf[..n], off)?;
        off += n as u64;
    }
    Ok(())
}

impl Inner {
    /// Builds the state for BACKING; its whole current tree is the durable
    /// image to start with.
    pub fn new(backing: PathBuf, state: PathBuf, strict: bool) -> Result<Inner, FaultError> {
        let data = state.join("data");
        if data.exists() {
            fs::remove_dir_all(&data).map_err(FaultError::io(&data))?;
        }
        fs::create_dir_all(&data).map_err(FaultError::io(&data))?;
        let root_md = fs::metadata(&backing).map_err(FaultError::io(&backing))?;
        if !root_md.is_dir() {
            return Err(FaultError::Command(format!("{} is not a directory", backing.display())));
        }
        let salvage = backing.join(SALVAGE);
        if salvage.exists() {
            fs::remove_dir_all(&salvage).map_err(FaultError::io(&salvage))?;
        }
        let mut inner = Inner {
            backing,
            data,
            strict,
            nodes: HashMap::new(),
            by_backing: HashMap::new(),
            next_fid: ROOT + 1,
            handles: HashMap::new(),
            next_fh: 1,
            dirty: HashMap::new(),
            ns_dirty: HashSet::new(),
            durable: Durable::default(),
            faults: Faults::default(),
            total_bytes: 0,
            stats: Stats::default(),
        };
        inner.nodes.insert(ROOT, Node { kind: FileType::Directory, links: Vec::new() });
        inner.by_backing.insert(root_md.ino(), ROOT);
        // Commit every directory, top down.
        let mut todo = vec![ROOT];
        while let Some(dir) = todo.pop() {
            inner.commit_dir(dir);
            if let Some(entries) = inner.durable.dirs.get(&dir) {
                todo.extend(entries.values().filter(|e| e.kind == FileType::Directory).map(|e| e.fid));
            }
        }
        inner.total_bytes = inner.live_total();
        Ok(inner)
    }

    // ---- the inode table ----

    pub fn backing(&self) -> &Path {
        &self.backing
    }

    /// The backing path of a live fid (its first name).
    pub fn path_of(&self, fid: Fid) -> Result<PathBuf, Errno> {
        let mut parts: Vec<&OsStr> = Vec::new();
        let mut cur = fid;
        while cur != ROOT {
            let node = self.nodes.get(&cur).ok_or(Errno::ENOENT)?;
            let (parent, name) = node.links.first().ok_or(Errno::ENOENT)?;
            parts.push(name);
            cur = *parent;
            if parts.len() > 4096 {
                return Err(Errno::ELOOP);
            }
        }
        let mut p = self.backing.clone();
        for part in parts.iter().rev() {
            p.push(part);
        }
        Ok(p)
    }

    pub fn child_path(&self, parent: Fid, name: &OsStr) -> Result<PathBuf, Errno> {
        Ok(self.path_of(parent)?.join(name))
    }

    /// The fid of the entry `name` of `parent` with metadata `md`, adding
    /// the name to its links (a new fid if its backing inode is new).
    pub fn register(&mut self, parent: Fid, name: &OsStr, md: &Metadata) -> Fid {
        let kind = kind_of(md);
        let link = (parent, name.to_os_string());
        if let Some(&fid) = self.by_backing.get(&md.ino()) {
            if let Some(node) = self.nodes.get_mut(&fid) {
                if node.kind == kind {
                    if !node.links.contains(&link) {
                        if kind == FileType::Directory {
                            node.links.clear();
                        }
                        node.links.push(link);
                    }
                    return fid;
                }
            }
        }
        let fid = self.next_fid;
        self.next_fid += 1;
        self.nodes.insert(fid, Node { kind, links: vec![link] });
        self.by_backing.insert(md.ino(), fid);
        fid
    }

    /// A file just created through the mount: its durable content is empty.
    pub fn created(&mut self, parent: Fid, name: &OsStr, md: &Metadata) -> Fid {
        let fid = self.register(parent, name, md);
        if kind_of(md) == FileType::RegularFile {
            self.durable.stored.insert(fid);
            let _ = fs::remove_file(self.data.join(fid.to_string()));
        }
        self.ns_dirty.insert(parent);
        fid
    }

    /// The name `(parent, name)` is gone from the live tree.
    pub fn unlinked(&mut self, parent: Fid, name: &OsStr, md: &Metadata) {
        self.ns_dirty.insert(parent);
        let Some(&fid) = self.by_backing.get(&md.ino()) else {
            return;
        };
        if let Some(node) = self.nodes.get_mut(&fid) {
            node.links.retain(|(p, n)| !(*p == parent && n == name));
        }
        if md.is_dir() || md.nlink() <= 1 {
            self.by_backing.remove(&md.ino());
            if let Some(node) = self.nodes.get_mut(&fid) {
                node.links.clear();
            }
            if md.is_file() {
                self.total_bytes = self.total_bytes.saturating_sub(md.len());
            }
            self.gc(fid);
        }
    }

    /// Before the last name of a file goes away: keep its content if a
    /// durable name still refers to it.
    pub fn before_unlink(&mut self, md: &Metadata, path: &Path) -> Result<(), Errno> {
        if md.is_file() && md.nlink() <= 1 {
            if let Some(&fid) = self.by_backing.get(&md.ino()) {
                if self.durable.refs.get(&fid).copied().unwrap_or(0) > 0 {
                    self.ensure_stored_at(fid, path)?;
                }
            }
        }
        Ok(())
    }

    /// A rename moved `(p, n)` to `(np, nn)`.
    pub fn renamed(&mut self, fid: Fid, p: Fid, n: &OsStr, np: Fid, nn: &OsStr) {
        if let Some(node) = self.nodes.get_mut(&fid) {
            let new = (np, nn.to_os_string());
            match node.links.iter_mut().find(|(lp, ln)| *lp == p && ln == n) {
                Some(l) => *l = new,
                None => node.links.push(new),
            }
        }
        self.ns_dirty.insert(p);
        self.ns_dirty.insert(np);
    }

    pub fn linked(&mut self, fid: Fid, np: Fid, nn: &OsStr) {
        if let Some(node) = self.nodes.get_mut(&fid) {
            node.links.push((np, nn.to_os_string()));
        }
        self.ns_dirty.insert(np);
    }

    /// A mode or owner change: durable with the namespace of its parents.
    pub fn meta_changed(&mut self, fid: Fid) {
        if let Some(node) = self.nodes.get(&fid) {
            for (p, _) in &node.links {
                self.ns_dirty.insert(*p);
            }
        }
    }

    /// A directory's parent (the root's is itself).
    pub fn parent_of(&self, fid: Fid) -> Fid {
        self.nodes.get(&fid).and_then(|n| n.links.first()).map_or(ROOT, |(p, _)| *p)
    }

    pub fn fid_of_backing(&self, ino: u64) -> Option<Fid> {
        self.by_backing.get(&ino).copied()
    }

    pub fn add_handle(&mut self, h: Handle) -> u64 {
        let fh = self.next_fh;
        self.next_fh += 1;
        self.handles.insert(fh, h);
        fh
    }

    pub fn release(&mut self, fh: u64) {
        if let Some(Handle::File { fid, .. }) = self.handles.remove(&fh) {
            self.gc(fid);
        }
    }

    pub fn file_handle(&self, fh: u64) -> Result<(Fid, Arc<File>, bool), Errno> {
        match self.handles.get(&fh) {
            Some(Handle::File { fid, file, sync }) => Ok((*fid, file.clone(), *sync)),
            _ => Err(Errno::EBADF),
        }
    }

    /// A readable live file for `fid`: the given handle, any open handle,
    /// or its path.
    fn live_file(&self, fid: Fid, fh: Option<u64>) -> Option<Arc<File>> {
        if let Some(Handle::File { fid: f, file, .. }) = fh.and_then(|fh| self.handles.get(&fh)) {
            if *f == fid {
                return Some(file.clone());
            }
        }
        for h in self.handles.values() {
            if let Handle::File { fid: f, file, .. } = h {
                if *f == fid {
                    return Some(file.clone());
                }
            }
        }
        let path = self.path_of(fid).ok()?;
        File::open(path).ok().map(Arc::new)
    }

    // ---- changes to file contents ----

    /// Fails with ENOSPC if growing the files by `growth` bytes would pass
    /// the `enospc` limit.
    pub fn check_space(&self, growth: u64) -> Result<(), Errno> {
        match self.faults.enospc {
            Some(limit) if growth > 0 && self.total_bytes + growth > limit => Err(Errno::ENOSPC),
            Some(limit) if growth == 0 && self.total_bytes > limit => Err(Errno::ENOSPC),
            _ => Ok(()),
        }
    }

    /// What `statfs` reports, in blocks of `frsize`: the backing file
    /// system's `(blocks, bfree, bavail)`, or while an `enospc` limit is set
    /// a disk of the limit's size with the files' total in use (free never
    /// more than the backing disk's), so a program watching its free space
    /// sees the disk fill as its writes would.
    pub fn space_limited(&self, blocks: u64, bfree: u64, bavail: u64, frsize: u64) -> (u64, u64, u64) {
        let Some(limit) = self.faults.enospc else { return (blocks, bfree, bavail) };
        let frsize = frsize.max(1);
        let left = limit.saturating_sub(self.total_bytes) / frsize;
        (blocks.min(limit.div_ceil(frsize)), bfree.min(left), bavail.min(left))
    }

    pub fn grew(&mut self, old: u64, new: u64) {
        self.total_bytes = (self.total_bytes + new).saturating_sub(old);
    }

    fn data_path(&self, fid: Fid) -> PathBuf {
        self.data.join(fid.to_string())
    }

    /// Makes sure `fid` has its own durable copy before its live content
    /// changes (a file found at mount shares its live content until then).
    pub fn ensure_stored(&mut self, fid: Fid, live: &File) -> Result<(), Errno> {
        if self.durable.stored.contains(&fid) {
            return Ok(());
        }
        let len = live.metadata().map_err(errno)?.len();
        let dst = File::create(self.data_path(fid)).map_err(errno)?;
        copy_range(live, &dst, 0, len).map_err(errno)?;
        self.durable.stored.insert(fid);
        Ok(())
    }

    fn ensure_stored_at(&mut self, fid: Fid, path: &Path) -> Result<(), Errno> {
        if self.durable.stored.contains(&fid) {
            return Ok(());
        }
        let f = File::open(path).map_err(errno)?;
        self.ensure_stored(fid, &f)
    }

    fn dirty_entry(&mut self, fid: Fid, size_before: u64) -> &mut Dirty {
        self.dirty.entry(fid).or_insert_with(|| Dirty { ops: Vec::new(), min_size: size_before })
    }

    /// Records a write of `len` bytes at `off` (after it happened).
    pub fn wrote(&mut self, fid: Fid, size_before: u64, off: u64, len: u64) {
        self.dirty_entry(fid, size_before).push_write(off, len);
    }

    /// Records a size change by truncate.
    pub fn resized(&mut self, fid: Fid, size_before: u64, size: u64) {
        let d = self.dirty_entry(fid, size_before);
        d.min_size = d.min_size.min(size);
        d.ops.push(Op::Size(size));
    }

    // ---- syncs ----

    /// Makes the file's data (and size) durable.
    pub fn sync_file(&mut self, fid: Fid, fh: Option<u64>) -> Result<(), Errno> {
        let Some(d) = self.dirty.get(&fid) else {
            return Ok(());
        };
        let Some(live) = self.live_file(fid, fh) else {
            // Neither named nor open: nothing can read it again.
            self.dirty.remove(&fid);
            return Ok(());
        };
        let live_len = live.metadata().map_err(errno)?.len();
        let dst = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(self.data_path(fid))
            .map_err(errno)?;
        let dlen = dst.metadata().map_err(errno)?.len();
        if d.min_size < dlen {
            dst.set_len(d.min_size).map_err(errno)?;
        }
        dst.set_len(live_len).map_err(errno)?;
        for (s, e) in d.extents() {
            let e = e.min(live_len);
            if s < e {
                copy_range(&live, &dst, s, e).map_err(errno)?;
            }
        }
        self.durable.stored.insert(fid);
        self.dirty.remove(&fid);
        Ok(())
    }

    /// Commits the live entries of directory `dir` to the durable namespace.
    pub fn commit_dir(&mut self, dir: Fid) {
        self.ns_dirty.remove(&dir);
        let listing = match self.path_of(dir) {
            Ok(p) => list_dir(&p),
            Err(_) => Vec::new(),
        };
        let mut new = BTreeMap::new();
        for (name, md) in listing {
            let fid = self.register(dir, &name, &md);
            let target = if md.file_type().is_symlink() {
                self.path_of(fid).ok().and_then(|p| fs::read_link(p).ok())
            } else {
                None
            };
            new.insert(
                name,
                DEntry { fid, kind: kind_of(&md), mode: md.mode() & 0o7777, uid: md.uid(), gid: md.gid(), target },
            );
        }
        for e in new.values() {
            *self.durable.refs.entry(e.fid).or_insert(0) += 1;
        }
        let old = self.durable.dirs.insert(dir, new).unwrap_or_default();
        for e in old.values() {
            self.unref(e.fid);
        }
    }

    fn unref(&mut self, fid: Fid) {
        if let Some(r) = self.durable.refs.get_mut(&fid) {
            *r = r.saturating_sub(1);
            if *r == 0 {
                self.durable.refs.remove(&fid);
                self.gc(fid);
            }
        }
    }

    /// Drops what is kept for `fid` once no durable name, live name or open
    /// handle refers to it.
    fn gc(&mut self, fid: Fid) {
        if fid == ROOT || self.durable.refs.contains_key(&fid) {
            return;
        }
        if self.nodes.get(&fid).is_some_and(|n| !n.links.is_empty()) {
            return;
        }
        let open = self.handles.values().any(|h| match h {
            Handle::File { fid: f, .. } | Handle::Dir { fid: f, .. } => *f == fid,
        });
        if open {
            return;
        }
        if self.durable.stored.remove(&fid) {
            let _ = fs::remove_file(self.data_path(fid));
        }
        self.dirty.remove(&fid);
        self.ns_dirty.remove(&fid);
        self.nodes.remove(&fid);
        if let Some(entries) = self.durable.dirs.remove(&fid) {
            for e in entries.values() {
                self.unref(e.fid);
            }
        }
    }

    /// Commits every directory changed since its last commit.
    pub fn commit_namespace(&mut self) {
        let mut dirs: Vec<Fid> = self.ns_dirty.iter().copied().collect();
        dirs.sort_unstable();
        for d in dirs {
            self.commit_dir(d);
        }
    }

    /// The fsync of a file.
    pub fn fsync_file(&mut self, fid: Fid, fh: Option<u64>) -> Result<(), Errno> {
        self.sync_file(fid, fh)?;
        if !self.strict {
            self.commit_namespace();
        }
        Ok(())
    }

    /// The fsync of a directory.
    pub fn fsync_dir(&mut self, fid: Fid) {
        if self.strict {
            self.commit_dir(fid);
        } else {
            self.commit_namespace();
        }
    }

    /// Consumes one armed fsync failure, if any.
    pub fn take_fsync_failure(&mut self) -> bool {
        if self.faults.fail_fsync > 0 {
            self.faults.fail_fsync -= 1;
            self.stats.failed_syncs += 1;
            true
        } else {
            self.stats.syncs += 1;
            false
        }
    }

    /// `sync-all`: everything live becomes durable.
    pub fn sync_all(&mut self) -> Result<(), Errno> {
        let mut fids: Vec<Fid> = self.dirty.keys().copied().collect();
        fids.sort_unstable();
        for fid in fids {
            self.sync_file(fid, None)?;
        }
        // Every directory, not only those marked: strict mode may hold
        // directories whose parents were committed before they were.
        let mut todo = vec![ROOT];
        let mut seen = HashSet::new();
        while let Some(dir) = todo.pop() {
            if !seen.insert(dir) {
                continue;
            }
            self.commit_dir(dir);
            if let Some(entries) = self.durable.dirs.get(&dir) {
                todo.extend(entries.values().filter(|e| e.kind == FileType::Directory).map(|e| e.fid));
            }
        }
        self.ns_dirty.clear();
        Ok(())
    }

    pub fn stats_line(&self) -> String {
        let unsynced: u64 = self.dirty.values().map(|d| d.extents().iter().map(|(s, e)| e - s).sum::<u64>()).sum();
        format!(
            "syncs={} failed_syncs={} unsynced_bytes={} files_dirty={} dirs_dirty={} cuts={} total_bytes={} durable_files={}",
            self.stats.syncs,
            self.stats.failed_syncs,
            unsynced,
            self.dirty.len(),
            self.ns_dirty.len(),
            self.stats.cuts,
            self.total_bytes,
            self.durable.stored.len(),
        )
    }

    fn live_total(&self) -> u64 {
        let mut total = 0;
        let mut todo = vec![self.backing.clone()];
        while let Some(dir) = todo.pop() {
            for (name, md) in list_dir(&dir) {
                if md.is_dir() {
                    todo.push(dir.join(name));
                } else if md.is_file() {
                    total += md.len();
                }
            }
        }
        total
    }

    pub fn recount(&mut self) {
        self.total_bytes = self.live_total();
    }

    // ---- power cut ----

    /// `cut` / `torn SEED`: the live tree becomes the durable image. Returns
    /// the fids the kernel may have cached, to invalidate.
    pub fn cut(&mut self, torn: Option<u64>) -> Result<Vec<Fid>, FaultError> {
        if let Some(seed) = torn {
            self.apply_torn(seed)?;
        }
        let known: Vec<Fid> = self.nodes.keys().copied().collect();
        let salvage = self.backing.join(SALVAGE);
        let io = |p: &Path| FaultError::io(p.to_path_buf());
        fs::create_dir(&salvage).map_err(io(&salvage))?;

        // 1. Keep live files whose content the image needs, reverted to it.
        let mut todo = vec![self.backing.clone()];
        while let Some(dir) = todo.pop() {
            for (name, md) in list_dir(&dir) {
                let path = dir.join(&name);
                if path == salvage {
                    continue;
                }
                if md.is_dir() {
                    todo.push(path);
                    continue;
                }
                if !md.is_file() {
                    continue;
                }
                let Some(&fid) = self.by_backing.get(&md.ino()) else {
                    continue;
                };
                let kept = salvage.join(fid.to_string());
                if !self.durable.refs.contains_key(&fid) || kept.exists() {
                    continue;
                }
                fs::rename(&path, &kept).map_err(io(&path))?;
                if self.dirty.contains_key(&fid) {
                    self.revert(fid, &kept)?;
                }
            }
        }
        // 2. Empty BACKING.
        for (name, md) in list_dir(&self.backing) {
            let path = self.backing.join(name);
            if path == salvage {
                continue;
            }
            let r = if md.is_dir() { fs::remove_dir_all(&path) } else { fs::remove_file(&path) };
            r.map_err(io(&path))?;
        }
        // 3. Rebuild it from the image, with a new inode table.
        let root = self.nodes.remove(&ROOT);
        self.nodes.clear();
        self.nodes.insert(ROOT, root.unwrap_or(Node { kind: FileType::Directory, links: Vec::new() }));
        let root_ino = fs::metadata(&self.backing).map_err(io(&self.backing))?.ino();
        self.by_backing.clear();
        self.by_backing.insert(root_ino, ROOT);
        self.handles.clear();
        self.dirty.clear();
        self.ns_dirty.clear();
        let mut visited = HashSet::from([ROOT]);
        let mut placed = HashMap::new();
        let backing = self.backing.clone();
        self.materialize(ROOT, &backing, &salvage, &mut visited, &mut placed)?;
        fs::remove_dir_all(&salvage).map_err(io(&salvage))?;
        // 4. Drop copies nothing refers to any more.
        let stored: Vec<Fid> = self.durable.stored.iter().copied().collect();
        for fid in stored {
            self.gc(fid);
        }
        let dirs: Vec<Fid> = self.durable.dirs.keys().copied().collect();
        for fid in dirs {
            self.gc(fid);
        }
        self.recount();
        self.stats.cuts += 1;
        Ok(known)
    }

    /// Puts the live file `path` of dirty `fid` back to its durable content,
    /// copying only what changed since the last sync.
    fn revert(&mut self, fid: Fid, path: &Path) -> Result<(), FaultError> {
        let Some(d) = self.dirty.get(&fid) else {
            return Ok(());
        };
        let io = |p: &Path| FaultError::io(p.to_path_buf());
        let dpath = self.data_path(fid);
        let durable = match File::open(&dpath) {
            Ok(f) => Some(f),
            Err(e) if e.kind() == io::ErrorKind::NotFound => None,
            Err(e) => return Err(io(&dpath)(e)),
        };
        let dlen = match &durable {
            Some(f) => f.metadata().map_err(io(&dpath))?.len(),
            None => 0,
        };
        let live = OpenOptions::new().write(true).open(path).map_err(io(path))?;
        let llen = live.metadata().map_err(io(path))?.len();
        live.set_len(llen.min(d.min_size).min(dlen)).map_err(io(path))?;
        live.set_len(dlen).map_err(io(path))?;
        let mut ranges = d.extents();
        ranges.push((d.min_size, dlen));
        merge(&mut ranges);
        if let Some(durable) = durable {
            for (s, e) in ranges {
                let e = e.min(dlen);
                if s < e {
                    copy_range(&durable, &live, s, e).map_err(io(path))?;
                }
            }
        }
        Ok(())
    }

    /// `torn`: for each dirty file, a seeded prefix of its unsynced writes
    /// (the last one cut at a random byte) reaches its durable copy. The
    /// bytes are read from the live file now, so later overwrites show.
    fn apply_torn(&mut self, seed: u64) -> Result<(), FaultError> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut fids: Vec<Fid> = self.dirty.keys().copied().collect();
        fids.sort_unstable();
        for fid in fids {
            let ops = self.dirty[&fid].ops.clone();
            let keep = rng.gen_range(0..=ops.len());
            if keep == 0 {
                continue;
            }
            let Some(live) = self.live_file(fid, None) else {
                continue;
            };
            let dpath = self.data_path(fid);
            let dst = OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(false)
                .open(&dpath)
                .map_err(FaultError::io(&dpath))?;
            for (i, op) in ops[..keep].iter().enumerate() {
                match *op {
                    Op::Size(s) => dst.set_len(s),
                    Op::Write { off, len } => {
                        let len = if i + 1 == keep { rng.gen_range(1..=len) } else { len };
                        copy_range(&live, &dst, off, off + len)
                    }
                }
                .map_err(FaultError::io(&dpath))?;
            }
            self.durable.stored.insert(fid);
        }
        Ok(())
    }

    fn materialize(
        &mut self,
        dir: Fid,
        path: &Path,
        salvage: &Path,
        visited: &mut HashSet<Fid>,
        placed: &mut HashMap<Fid, PathBuf>,
    ) -> Result<(), FaultError> {
        let entries = self.durable.dirs.get(&dir).cloned().unwrap_or_default();
        for (name, e) in entries {
            let p = path.join(&name);
            let io = FaultError::io(&p);
            match e.kind {
                FileType::Directory => {
                    if !visited.insert(e.fid) {
                        continue;
                    }
                    fs::create_dir(&p).map_err(io)?;
                    set_meta(&p, &e)?;
                    self.place(dir, &name, &p, e.fid);
                    self.materialize(e.fid, &p, salvage, visited, placed)?;
                }
                FileType::RegularFile => {
                    if let Some(first) = placed.get(&e.fid) {
                        fs::hard_link(first, &p).map_err(io)?;
                    } else {
                        let kept = salvage.join(e.fid.to_string());
                        let data = self.data_path(e.fid);
                        if kept.exists() {
                            fs::rename(&kept, &p).map_err(io)?;
                        } else if self.durable.stored.contains(&e.fid) && data.exists() {
                            fs::copy(&data, &p).map_err(io)?;
                        } else {
                            File::create(&p).map_err(io)?;
                        }
                        set_meta(&p, &e)?;
                        placed.insert(e.fid, p.clone());
                    }
                    self.place(dir, &name, &p, e.fid);
                }
                FileType::Symlink => {
                    if let Some(t) = &e.target {
                        std::os::unix::fs::symlink(t, &p).map_err(io)?;
                        let c = cpath(&p).map_err(|_| FaultError::Command("bad path".into()))?;
                        // SAFETY: c is a valid NUL-terminated path.
                        unsafe { libc::lchown(c.as_ptr(), e.uid, e.gid) };
                        self.place(dir, &name, &p, e.fid);
                    }
                }
                FileType::NamedPipe => {
                    let c = cpath(&p).map_err(|_| FaultError::Command("bad path".into()))?;
                    // SAFETY: c is a valid NUL-terminated path.
                    unsafe { libc::mkfifo(c.as_ptr(), e.mode as libc::mode_t) };
                    set_meta(&p, &e)?;
                    self.place(dir, &name, &p, e.fid);
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Enters a rebuilt entry into the inode table under its old fid.
    fn place(&mut self, dir: Fid, name: &OsStr, p: &Path, fid: Fid) {
        let Ok(md) = fs::symlink_metadata(p) else {
            return;
        };
        self.by_backing.insert(md.ino(), fid);
        let node = self.nodes.entry(fid).or_insert(Node { kind: e_kind(&md), links: Vec::new() });
        node.links.push((dir, name.to_os_string()));
    }

    // ---- corruption ----

    /// Applies `f` to the live file at `rel` and to its durable copy (if it
    /// has one of its own). Returns the fid to invalidate.
    pub fn corrupt(&mut self, rel: &str, f: impl Fn(&File) -> io::Result<()>) -> Result<Option<Fid>, FaultError> {
        let path = self.backing.join(rel.trim_start_matches('/'));
        let md = fs::symlink_metadata(&path).map_err(FaultError::io(&path))?;
        if !md.is_file() {
            return Err(FaultError::Command(format!("{rel}: not a regular file")));
        }
        let live = OpenOptions::new().read(true).write(true).open(&path).map_err(FaultError::io(&path))?;
        f(&live).map_err(FaultError::io(&path))?;
        let fid = self.by_backing.get(&md.ino()).copied();
        if let Some(fid) = fid {
            if self.durable.stored.contains(&fid) {
                let dpath = self.data_path(fid);
                if let Ok(d) = OpenOptions::new().read(true).write(true).open(&dpath) {
                    f(&d).map_err(FaultError::io(&dpath))?;
                }
            }
        }
        self.recount();
        Ok(fid)
    }
}

fn e_kind(md: &Metadata) -> FileType {
    kind_of(md)
}

fn set_meta(p: &Path, e: &DEntry) -> Result<(), FaultError> {
    fs::set_permissions(p, fs::Permissions::from_mode(e.mode)).map_err(FaultError::io(p))?;
    let c = cpath(p).map_err(|_| FaultError::Command("bad path".into()))?;
    // SAFETY: c is a valid NUL-terminated path.
    unsafe { libc::lchown(c.as_ptr(), e.uid, e.gid) };
    Ok(())
}

/// The entries of a backing directory with their (not followed) metadata,
/// sorted by name; entries that vanish meanwhile are skipped.
pub fn list_dir(dir: &Path) -> Vec<(OsString, Metadata)> {
    let Ok(rd) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut v: Vec<(OsString, Metadata)> = rd
        .filter_map(|e| e.ok())
        .filter(|e| !(dir.parent().is_some() && e.file_name() == SALVAGE))
        .filter_map(|e| e.metadata().ok().map(|md| (e.file_name(), md)))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

/// Flip: XOR `mask` into the byte at `off` (which must exist in the live file;
/// past the end of a copy it is skipped).
pub fn flip(off: u64, mask: u8) -> impl Fn(&File) -> io::Result<()> {
    move |f| {
        let mut b = [0u8; 1];
        if read_at_full(f, &mut b, off)? == 1 {
            b[0] ^= mask;
            f.write_all_at(&b, off)?;
        }
        Ok(())
    }
}

/// Zero `len` bytes at `off`, within each file's length.
pub fn zero(off: u64, len: u64) -> impl Fn(&File) -> io::Result<()> {
    move |f| {
        let size = f.metadata()?.len();
        let end = (off + len).min(size);
        let mut at = off;
        let buf = vec![0u8; CHUNK];
        while at < end {
            let n = buf.len().min((end - at) as usize);
            f.write_all_at(&buf[..n], at)?;
            at += n as u64;
        }
        Ok(())
    }
}

/// Shorten to `len` (a longer file is left alone).
pub fn shorten(len: u64) -> impl Fn(&File) -> io::Result<()> {
    move |f| {
        if f.metadata()?.len() > len {
            f.set_len(len)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_joins_overlaps_and_neighbours() {
        let mut v = vec![(10, 20), (0, 5), (5, 8), (15, 30), (40, 41)];
        merge(&mut v);
        assert_eq!(v, vec![(0, 8), (10, 30), (40, 41)]);
    }

    #[test]
    fn appends_coalesce_in_write_order() {
        let mut d = Dirty { ops: Vec::new(), min_size: 0 };
        d.push_write(0, 10);
        d.push_write(10, 5);
        d.push_write(3, 2);
        assert_eq!(d.ops.len(), 2);
        assert_eq!(d.extents(), vec![(0, 15)]);
    }
}
