//! Opening a node's data directory.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::mem::ManuallyDrop;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::error::StorageError;
use crate::flusher::{CrashImage, Flusher};
use crate::fsync::{create_dir_durably, sync_dir, sync_file};
use crate::keys::{decode_sled_mark, group_prefix, key_group, log_key_index, meta_key, META_REWRITE, SLED_MARK_KEY};
use crate::wal::{RawEntry, Wal, WalError};
use crate::GroupId;

/// Tuning for the sled database.
#[derive(Debug, Clone)]
pub struct DbOptions {
    /// sled page cache in bytes. Default 64 MiB: sled's own default (1 GiB)
    /// makes RSS follow queue depth, which is what paging messages to disk is
    /// meant to avoid.
    pub cache_bytes: u64,
    /// Size at which the write-ahead log moves on to a new segment file.
    pub wal_segment_bytes: u64,
}

impl Default for DbOptions {
    fn default() -> Self {
        Self { cache_bytes: 64 << 20, wal_segment_bytes: crate::wal::SEGMENT_BYTES }
    }
}

/// One node's storage: a sled database with a tree per concern, shared by every
/// Raft group on the node, and the flusher that makes it durable.
#[derive(Clone)]
pub struct NodeDb {
    inner: Arc<Inner>,
}

struct Inner {
    path: PathBuf,
    /// Dropped only if the node did not crash ([`NodeDb::crash_for_tests`]):
    /// dropping it flushes sled's buffers.
    db: ManuallyDrop<sled::Db>,
    /// Raft log entries of every group.
    wal: Arc<Wal>,
    /// Where Raft entries were kept before the write-ahead log, key
    /// `group | index`; emptied into the log when a data dir is opened.
    log: sled::Tree,
    /// Votes, committed and purged log ids, key `group | tag`.
    raft_meta: sled::Tree,
    /// State-machine data of every group, key `group | ...` (see `SmSpace`).
    sm: sled::Tree,
    /// Node-level values (identity, cluster id).
    node: sled::Tree,
    flusher: Flusher,
    /// Taken by whoever stops the flusher first: the last drop or a crash.
    flusher_thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    fatal: tokio::sync::watch::Receiver<Option<String>>,
    fatal_tx: Arc<tokio::sync::watch::Sender<Option<String>>>,
    /// Set by [`NodeDb::crash_for_tests`].
    crashed: AtomicBool,
    /// See `NodeDb::keep_crash_image`.
    #[cfg(any(test, feature = "test-hooks"))]
    crash_image: CrashImage,
    /// Whether the last process on this dir stopped cleanly (see
    /// [`NodeDb::started_clean`]).
    started_clean: bool,
    /// Held for the life of the process: a second process on the same dir is refused.
    _lock: File,
}

/// Present in a data dir only between a clean stop and the next open.
const CLEAN_STOP: &str = "CLEAN_STOP";

/// sled's dir while it is made (see `create_sled`).
const SLED_NEW: &str = "sled.new";

/// Make a new sled database at `sled_dir` whole or not at all. sled writes
/// its `conf` in two `write`s and syncs neither it nor its directory: a
/// power cut during a first open could leave a `conf` it cannot read, and
/// the data dir could never open again. So it is made in a sibling,
/// closed, synced file by file and directory by directory, and only then
/// renamed into place.
fn create_sled(sled_dir: &Path, config: impl Fn(&Path) -> sled::Config) -> Result<(), StorageError> {
    let parent = sled_dir.parent().unwrap_or(Path::new("."));
    let new = parent.join(SLED_NEW);
    let io = |source| StorageError::CreateDir { path: new.clone(), source };
    // Left by a first open that did not finish: nothing in it was ever used.
    if new.exists() {
        std::fs::remove_dir_all(&new).map_err(io)?;
    }
    let db = config(&new).open().map_err(|source| StorageError::Corrupt { path: new.clone(), source })?;
    db.flush().map_err(|source| StorageError::Corrupt { path: new.clone(), source })?;
    drop(db);
    let mut dirs = vec![new.clone()];
    while let Some(dir) = dirs.pop() {
        for e in std::fs::read_dir(&dir).map_err(io)? {
            let e = e.map_err(io)?;
            if e.file_type().map_err(io)?.is_dir() {
                dirs.push(e.path());
            } else {
                sync_file(&e.path()).map_err(io)?;
            }
        }
        sync_dir(&dir).map_err(io)?;
    }
    std::fs::rename(&new, sled_dir).map_err(io)?;
    sync_dir(parent).map_err(io)
}

impl NodeDb {
    /// Open (creating if missing) the data dir. Refuses a dir locked by another
    /// process and a database sled cannot read; never wipes anything.
    pub fn open(dir: &Path, opts: &DbOptions) -> Result<Self, StorageError> {
        create_dir_durably(dir).map_err(|source| StorageError::CreateDir { path: dir.to_owned(), source })?;
        #[cfg(any(test, feature = "test-hooks"))]
        crate::fsync::baseline(dir).map_err(|source| StorageError::CreateDir { path: dir.to_owned(), source })?;
        let lock = lock_dir(dir)?;
        // The mark goes before anything is written: a crash of this life
        // must never be taken for a clean stop by the next one.
        let clean_mark = dir.join(CLEAN_STOP);
        let started_clean = clean_mark.exists();
        if started_clean {
            let gone = std::fs::remove_file(&clean_mark).and_then(|()| sync_dir(dir));
            gone.map_err(|source| StorageError::CleanMark { path: clean_mark.clone(), source })?;
        }
        let sled_dir = dir.join("sled");
        let config = |path: &Path| {
            sled::Config::new()
                .path(path)
                .cache_capacity(opts.cache_bytes)
                // Our flusher syncs; sled's periodic background flush would only add fsyncs.
                .flush_every_ms(None)
                // Values over a quarter segment go to unsynced blob files; a larger
                // segment keeps batched log entries inline in the synced log.
                .segment_size(4 << 20)
                .mode(sled::Mode::HighThroughput)
        };
        if !sled_dir.exists() {
            // Votes, purge points and state machines gone while the log
            // they go with is there: starting a fresh sled would forget
            // votes given. Damage, like a checksum that does not match.
            let wal_dir = dir.join("wal");
            let logged = std::fs::read_dir(&wal_dir).map(|mut d| d.next().is_some()).unwrap_or(false);
            if logged {
                return Err(StorageError::Missing { path: sled_dir, beside: wal_dir });
            }
            create_sled(&sled_dir, config)?;
        }
        let config = config(&sled_dir);
        // We hold LOCK, so no other process uses the dir; sled's own lock can
        // still be held for a moment by this process's previous instance while
        // sled's background threads let go of it (an in-process restart).
        let mut attempts = 0;
        let db = loop {
            // sled 0.34 panics on some damage it meets while recovering (a
            // zeroed segment header: "tried to serialize Uninitialized"):
            // that is a damaged dir, to be set aside and refilled, not a
            // node that can never start.
            let opened = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| config.open())).map_err(|panic| {
                let what = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".to_string());
                StorageError::SledPanicked { path: sled_dir.clone(), what }
            })?;
            match opened {
                Ok(db) => break db,
                Err(sled::Error::Io(e)) if e.to_string().contains("could not acquire lock") && attempts < 250 => {
                    attempts += 1;
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(source) => return Err(StorageError::Corrupt { path: sled_dir.clone(), source }),
            }
        };
        let open_tree =
            |name: &str| db.open_tree(name).map_err(|source| StorageError::Corrupt { path: sled_dir.clone(), source });
        let log = open_tree("log")?;
        let raft_meta = open_tree("raft_meta")?;
        let sm = open_tree("sm")?;
        let node = open_tree("node")?;
        let (in_sled, log_point) = node.get(SLED_MARK_KEY)?.and_then(|v| decode_sled_mark(&v)).unzip();
        let in_sled = in_sled.unwrap_or(0);
        let wal = Arc::new(Wal::open_expecting(&dir.join("wal"), opts.wal_segment_bytes, log_point)?);
        let in_log = wal.sled_mark();
        if in_sled < in_log {
            return Err(StorageError::SledBehind { path: sled_dir, sled: in_sled, log: in_log });
        }
        let (fatal_tx, fatal) = tokio::sync::watch::channel(None);
        let fatal_tx = Arc::new(fatal_tx);
        let tx = fatal_tx.clone();
        let crash_image = CrashImage::default();
        let (flusher, flusher_thread) = Flusher::start(
            db.clone(),
            &sled_dir,
            wal.clone(),
            (node.clone(), in_sled),
            crash_image.clone(),
            move |e| {
                let why = if crate::flusher::is_disk_full(e) {
                    format!(
                        "disk full: a write failed ({e}); free space on the data dir's disk and start the node again"
                    )
                } else {
                    format!("disk sync failed: {e}")
                };
                let _ = tx.send(Some(why));
            },
        )
        .map_err(|source| StorageError::Lock { path: sled_dir.clone(), source })?;
        let node_db = Self {
            inner: Arc::new(Inner {
                path: dir.to_owned(),
                db: ManuallyDrop::new(db),
                wal,
                log,
                raft_meta,
                sm,
                node,
                flusher,
                flusher_thread: Mutex::new(Some(flusher_thread)),
                fatal,
                fatal_tx,
                crashed: AtomicBool::new(false),
                #[cfg(any(test, feature = "test-hooks"))]
                crash_image,
                started_clean,
                _lock: lock,
            }),
        };
        node_db.move_sled_log()?;
        node_db.finish_rewrites()?;
        Ok(node_db)
    }

    /// Move entries a data dir from before the write-ahead log kept in sled
    /// into the log. The log is synced before sled forgets them; a crash in
    /// between moves them again, to the same indexes, which is harmless.
    fn move_sled_log(&self) -> Result<(), StorageError> {
        let log = &self.inner.log;
        if log.is_empty() {
            return Ok(());
        }
        let mut entries: Vec<(GroupId, RawEntry)> = Vec::new();
        for kv in log.iter() {
            let (k, v) = kv?;
            entries.push((key_group(&k), (log_key_index(&k), v.to_vec())));
        }
        // Keys sort by group, then index: one append per group, in order.
        for run in entries.chunk_by(|a, b| a.0 == b.0) {
            let group_entries: Vec<RawEntry> = run.iter().map(|(_, e)| e.clone()).collect();
            self.inner.wal.append(run[0].0, &group_entries)?;
        }
        let moved = entries.len();
        self.inner.wal.sync()?;
        log.clear()?;
        self.inner.flusher.sync_blocking().map_err(|_| StorageError::SyncFailed)?;
        tracing::info!(entries = moved, "moved Raft entries from sled into the write-ahead log");
        Ok(())
    }

    /// Finish a [`NodeDb::rewrite_log`] a crash interrupted.
    fn finish_rewrites(&self) -> Result<(), StorageError> {
        let pending: Vec<(sled::IVec, sled::IVec)> = self
            .inner
            .raft_meta
            .iter()
            .filter(|kv| kv.as_ref().map_or(true, |(k, _)| k.len() == 9 && k[8] == META_REWRITE))
            .collect::<Result<_, _>>()?;
        for (k, v) in pending {
            let group = key_group(&k);
            let entries: Vec<RawEntry> = crate::keys::decode(&v, "pending log rewrite")?;
            self.finish_rewrite(group, &k, &entries)?;
        }
        Ok(())
    }

    fn finish_rewrite(&self, group: GroupId, key: &[u8], entries: &[RawEntry]) -> Result<(), StorageError> {
        self.inner.wal.rewrite(group, entries)?;
        self.inner.wal.sync()?;
        self.inner.raft_meta.remove(key)?;
        self.inner.flusher.sync_blocking().map_err(|_| StorageError::SyncFailed)
    }

    /// Rewrite entries of `group`'s log (in place, or right after its last
    /// entry), adopt `vote` (encoded, under `vote_key` in the Raft meta
    /// tree) and set the node-level value `node_kv`, atomically: the three
    /// are committed together in sled first, with the entries, and the log
    /// rewritten after; a crash in between finishes the rewrite at the next
    /// open. Blocks on syncs; only for a group whose Raft is stopped.
    pub fn rewrite_log(
        &self,
        group: GroupId,
        entries: Vec<RawEntry>,
        vote_key: &[u8],
        vote: Vec<u8>,
        node_kv: (&str, Vec<u8>),
    ) -> Result<(), StorageError> {
        use sled::Transactional;
        let key = meta_key(group, META_REWRITE);
        let pending = crate::keys::encode(&entries, "pending log rewrite")?;
        // The log as read for the rewrite first: the vote adopted below may
        // reach the disk before the next sync (sled writes its file at
        // once), and it must not outlive a tail it was given with.
        self.inner.wal.sync()?;
        (&self.inner.raft_meta, &self.inner.node)
            .transaction(|(meta, node)| {
                meta.insert(&key[..], pending.as_slice())?;
                meta.insert(vote_key, vote.as_slice())?;
                node.insert(node_kv.0.as_bytes(), node_kv.1.as_slice())?;
                Ok::<(), sled::transaction::ConflictableTransactionError<()>>(())
            })
            .map_err(|e| match e {
                sled::transaction::TransactionError::Storage(e) => self.write_failed(e),
                sled::transaction::TransactionError::Abort(()) => StorageError::Redo("log rewrite aborted"),
            })?;
        self.inner.flusher.sync_blocking().map_err(|_| StorageError::SyncFailed)?;
        // The vote is durable now: the log must follow, or the group would
        // run on a vote given with a tail it does not hold. Only the next
        // open finishes a rewrite, so any failure here (a full disk, which
        // the log itself survives) stops the node.
        self.finish_rewrite(group, &key, &entries).inspect_err(|e| {
            self.stop_for(format!(
                "a log rewrite failed after its vote was made durable ({e}); the next start finishes it"
            ))
        })
    }

    /// Whether the process before this one stopped cleanly: everything it
    /// wrote was synced ([`NodeDb::mark_clean_stop`]). After a crash, what
    /// it wrote but did not sync may be gone (a power cut loses the page
    /// cache), so a Raft leader's log may lack entries its followers hold.
    pub fn started_clean(&self) -> bool {
        self.inner.started_clean
    }

    /// Record that this process stops cleanly: syncs everything first, and
    /// refuses after a failed sync. Call last, once nothing writes any more.
    pub fn mark_clean_stop(&self) -> Result<(), StorageError> {
        self.inner.flusher.sync_blocking().map_err(|_| StorageError::SyncFailed)?;
        if self.inner.fatal.borrow().is_some() {
            return Err(StorageError::SyncFailed);
        }
        let path = self.inner.path.join(CLEAN_STOP);
        let made = File::create(&path).and_then(|f| f.sync_all()).and_then(|()| sync_dir(&self.inner.path));
        made.map_err(|source| StorageError::CleanMark { path, source })
    }

    pub fn path(&self) -> &Path {
        &self.inner.path
    }
    pub fn flusher(&self) -> &Flusher {
        &self.inner.flusher
    }
    pub fn wal(&self) -> &Wal {
        &self.inner.wal
    }
    pub fn raft_meta_tree(&self) -> &sled::Tree {
        &self.inner.raft_meta
    }
    /// Node-level values (see [`NodeDb::put_node_value`]).
    pub fn node_tree(&self) -> &sled::Tree {
        &self.inner.node
    }
    pub fn sm_tree(&self) -> &sled::Tree {
        &self.inner.sm
    }

    /// Becomes `Some(reason)` when the node must stop (a sync failed).
    pub fn fatal(&self) -> tokio::sync::watch::Receiver<Option<String>> {
        self.inner.fatal.clone()
    }

    /// A write to sled failed (a full disk, as a rule): stop the node
    /// (fail-stop), with one log line saying why, and return the error for
    /// the caller. sled 0.34 keeps a failed write's error for every later
    /// operation and its next flush may never return, and a state-machine
    /// step half written cannot be trusted: a restart, once space is freed,
    /// redoes it from the log.
    pub fn write_failed(&self, e: sled::Error) -> StorageError {
        let full = matches!(&e, sled::Error::Io(io) if crate::flusher::is_disk_full(io));
        let why = if full {
            format!(
                "disk full: a write to sled failed ({e}); free space on the data dir's disk and start the node again"
            )
        } else {
            format!("a write to sled failed ({e})")
        };
        self.stop_for(why);
        StorageError::Sled(e)
    }

    /// A read of the log failed. A record that rotted on the disk
    /// ([`WalError::Corrupt`]) stops the node: its replica's core would
    /// meet it again at every restart from this disk, and only the next
    /// start can repair it (it finds the damage, sets the data dir aside
    /// and is refilled by its peers). Returns the error for the caller.
    pub fn read_failed(&self, e: WalError) -> WalError {
        if matches!(e, WalError::Corrupt { .. }) {
            self.stop_for(format!(
                "{e}: a record of the log changed on the disk after it was written; the next start sets this data \
                 dir aside and is refilled by its peers"
            ));
        }
        e
    }

    /// Tell the node to stop (fail-stop) for `why`, logged once: the
    /// first reason wins, later ones are not news.
    fn stop_for(&self, why: String) {
        let first = self.inner.fatal_tx.send_if_modified(|f| {
            if f.is_some() {
                return false;
            }
            *f = Some(why.clone());
            true
        });
        if first {
            tracing::error!(data_dir = %self.inner.path.display(), "{why}; stopping the node (fail-stop)");
            self.inner.flusher.fail();
        }
    }

    /// Read a node-level value.
    pub fn get_node_value(&self, key: &str) -> Result<Option<Vec<u8>>, StorageError> {
        Ok(self.inner.node.get(key)?.map(|v| v.to_vec()))
    }

    /// Write a node-level value and wait until it is durable.
    pub fn put_node_value(&self, key: &str, value: &[u8]) -> Result<(), StorageError> {
        self.inner.node.insert(key, value).map_err(|e| self.write_failed(e))?;
        self.inner.flusher.sync_blocking().map_err(|_| StorageError::SyncFailed)
    }

    /// [`NodeDb::put_node_value`] for a task: it waits for the sync without
    /// holding a runtime thread (a thread held so can starve the task that
    /// the sync waits on, as a test that holds the syncs does).
    pub async fn put_node_value_async(&self, key: &str, value: &[u8]) -> Result<(), StorageError> {
        self.inner.node.insert(key, value).map_err(|e| self.write_failed(e))?;
        self.inner.flusher.sync().await.map_err(|_| StorageError::SyncFailed)
    }

    /// [`NodeDb::remove_node_value`] for a task (see `put_node_value_async`).
    pub async fn remove_node_value_async(&self, key: &str) -> Result<(), StorageError> {
        self.inner.node.remove(key).map_err(|e| self.write_failed(e))?;
        self.inner.flusher.sync().await.map_err(|_| StorageError::SyncFailed)
    }

    /// Remove a node-level value, durably.
    pub fn remove_node_value(&self, key: &str) -> Result<(), StorageError> {
        self.inner.node.remove(key).map_err(|e| self.write_failed(e))?;
        self.inner.flusher.sync_blocking().map_err(|_| StorageError::SyncFailed)
    }

    /// Does this group have any state on disk?
    pub fn group_exists(&self, group: GroupId) -> Result<bool, StorageError> {
        let p = group_prefix(group);
        Ok(self.inner.raft_meta.scan_prefix(p).next().transpose()?.is_some() || self.inner.wal.has_group(group))
    }

    /// Remove everything a group stored (queue deleted, replica moved away).
    pub fn drop_group(&self, group: GroupId) -> Result<(), StorageError> {
        let p = group_prefix(group);
        // The log first, durably: entries without their vote and purge point
        // would come back as a group of their own.
        self.inner.wal.drop_group(group)?;
        for tree in [&self.inner.raft_meta, &self.inner.sm] {
            let mut batch = sled::Batch::default();
            for kv in tree.scan_prefix(p) {
                batch.remove(kv?.0);
            }
            tree.apply_batch(batch).map_err(|e| self.write_failed(e))?;
        }
        Ok(())
    }

    /// Bytes sled occupies on disk.
    pub fn size_on_disk(&self) -> Result<u64, StorageError> {
        Ok(self.inner.db.size_on_disk()?)
    }

    /// From now on, keep a copy of sled's data file as each sled sync
    /// leaves it, for [`NodeDb::crash_for_tests`] to put back: the crash
    /// then loses every sled write no sync covered, as a power loss may
    /// (without it, what sled wrote to its file unsynced survives, as
    /// after `kill -9`). Costs a read of the whole file per sled sync: for
    /// tests only. The first copy is the file as it is now.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn keep_crash_image(&self) -> std::io::Result<()> {
        let image = std::fs::read(self.inner.path.join("sled").join("db"))?;
        *self.inner.crash_image.lock().expect("poisoned") = Some(image);
        Ok(())
    }

    /// Die as the process would, for tests, so that the data dir can be
    /// opened again in this process (even while clones of this handle
    /// live on):
    ///
    /// - The flusher stops: a sync under way ends, no other starts, and
    ///   every waiter, present or later, fails.
    /// - Each log segment is cut back to what its last sync covered (the
    ///   page cache lost).
    /// - sled never writes again: its handle is leaked, not dropped (a drop
    ///   flushes), and its descriptor on `sled/db` is pointed at
    ///   `/dev/null`, which also lets go of sled's lock. What it held in
    ///   memory is lost. With [`NodeDb::keep_crash_image`], `sled/db` is
    ///   then put back as the last sled sync left it; without, what sled
    ///   had written to it stays, synced or not (sled writes its buffer out
    ///   on every batch and when it is full), as after `kill -9`. sled's
    ///   memory is not given back.
    /// - The data dir's `LOCK` is released.
    ///
    /// - With [`NodeDb::keep_crash_image`], names too: every directory
    ///   under the data dir is put back to its entries at its last sync,
    ///   and files made since the open and never synced lose their bytes
    ///   (see `fsync`). Removals are not undone.
    ///
    /// Whatever a sync covered survives. Not undone: blob files' contents.
    /// A sled sync that copies the image while sled writes may catch some
    /// of those writes, as a disk may keep some unsynced blocks. Every
    /// clone of this handle must be dropped afterwards, not used: its
    /// writes go nowhere and its reads may fail.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn crash_for_tests(&self) -> std::io::Result<()> {
        let inner = &self.inner;
        if inner.crashed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        inner.flusher.crash_for_tests();
        if let Some(t) = inner.flusher_thread.lock().expect("poisoned").take() {
            let _ = t.join();
        }
        inner.wal.crash_for_tests().map_err(std::io::Error::other)?;
        let sled_file = inner.path.join("sled").join("db");
        detach(&sled_file)?;
        if let Some(image) = inner.crash_image.lock().expect("poisoned").take() {
            std::fs::write(&sled_file, image)?;
            // A power cut, not a kill: the page cache holds names too.
            crate::fsync::lose_unsynced(&inner.path)?;
        }
        // SAFETY: unlock of a descriptor `_lock` keeps open.
        unsafe { libc::flock(inner._lock.as_raw_fd(), libc::LOCK_UN) };
        Ok(())
    }
}

/// Point every descriptor this process has open on `path` at `/dev/null`:
/// whatever is written through them goes nowhere, and their lock on the
/// file is released (its open file description is closed).
#[cfg(any(test, feature = "test-hooks"))]
fn detach(path: &Path) -> std::io::Result<()> {
    let target = std::fs::canonicalize(path)?;
    let null = OpenOptions::new().read(true).write(true).open("/dev/null")?;
    for entry in std::fs::read_dir("/proc/self/fd")? {
        let entry = entry?;
        let Ok(fd) = entry.file_name().to_string_lossy().parse::<libc::c_int>() else { continue };
        if std::fs::read_link(entry.path()).is_ok_and(|p| p == target) {
            // SAFETY: `fd` stays open (now on /dev/null) for its owner,
            // sled's leaked handle, which may still write through it; no
            // memory is shared.
            if unsafe { libc::dup2(null.as_raw_fd(), fd) } < 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

impl Drop for Inner {
    fn drop(&mut self) {
        if self.crashed.load(Ordering::Acquire) {
            // Leaked: dropping sled flushes its buffers, which the crash lost.
            return;
        }
        self.flusher.stop();
        if let Some(t) = self.flusher_thread.get_mut().expect("poisoned").take() {
            let _ = t.join();
        }
        // SAFETY: dropped once, here, and never used again.
        unsafe { ManuallyDrop::drop(&mut self.db) };
    }
}

const SET_ASIDE: &str = ".damaged-";

/// Whether a data dir was ever set aside in place of `dir`: a dir found
/// new beside one was made for a refill, even if the power went before the
/// refill was marked in it.
pub fn was_set_aside(dir: &Path) -> bool {
    let (Some(name), Some(parent)) = (dir.file_name(), dir.parent()) else { return false };
    let prefix = format!("{}{SET_ASIDE}", name.to_string_lossy());
    let parent = if parent.as_os_str().is_empty() { Path::new(".") } else { parent };
    std::fs::read_dir(parent)
        .map(|entries| entries.flatten().any(|e| e.file_name().to_string_lossy().starts_with(&prefix)))
        .unwrap_or(false)
}

/// Move a damaged data dir out of the way, keeping it whole for a person to
/// look at: `DIR` becomes `DIR.damaged-<unix seconds>`, and the rename is
/// made durable before anything starts again in `DIR`. Returns where it went.
pub fn set_aside(dir: &Path) -> Result<PathBuf, StorageError> {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let mut name = dir.file_name().unwrap_or_default().to_owned();
    name.push(format!("{SET_ASIDE}{secs}"));
    let aside = dir.with_file_name(name);
    let err = |source| StorageError::SetAside { path: dir.to_owned(), source };
    std::fs::rename(dir, &aside).map_err(err)?;
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    sync_dir(parent).map_err(err)?;
    Ok(aside)
}

fn lock_dir(dir: &Path) -> Result<File, StorageError> {
    let path = dir.join("LOCK");
    let lock_err = |source| StorageError::Lock { path: path.clone(), source };
    let mut f = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(&path).map_err(lock_err)?;
    // SAFETY: flock on a file descriptor we own; no memory is shared.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
            let mut holder = String::new();
            let _ = f.read_to_string(&mut holder);
            let holder = match holder.trim() {
                "" => "unknown pid".to_string(),
                pid => format!("pid {pid}"),
            };
            return Err(StorageError::Locked { path: dir.to_owned(), holder });
        }
        return Err(lock_err(err));
    }
    f.set_len(0).map_err(lock_err)?;
    f.rewind().map_err(lock_err)?;
    write!(f, "{}", std::process::id()).map_err(lock_err)?;
    // Its name, once: everything made in the dir later syncs the dir again,
    // but a dir holding only `LOCK` should not come back without it.
    sync_dir(dir).map_err(lock_err)?;
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_open_of_same_dir_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let _first = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        let second = NodeDb::open(dir.path(), &DbOptions::default());
        match second {
            Err(StorageError::Locked { holder, .. }) => {
                assert_eq!(holder, format!("pid {}", std::process::id()))
            }
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("second open of a locked data dir succeeded"),
        }
    }

    #[test]
    fn corrupt_database_is_refused_not_wiped() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
            db.put_node_value("k", b"v").unwrap();
        }
        let conf = dir.path().join("sled").join("conf");
        std::fs::write(&conf, b"garbage that is not a sled config").unwrap();
        match NodeDb::open(dir.path(), &DbOptions::default()) {
            Err(StorageError::Corrupt { .. }) => {}
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("corrupt data dir was opened"),
        }
        // Still there for an operator to inspect.
        assert_eq!(std::fs::read(&conf).unwrap(), b"garbage that is not a sled config");
    }

    #[test]
    fn dead_log_segments_go_after_a_sync_and_the_live_entries_stay() {
        let dir = tempfile::tempdir().unwrap();
        let opts = DbOptions { wal_segment_bytes: 4096, ..DbOptions::default() };
        let db = NodeDb::open(dir.path(), &opts).unwrap();
        for i in 1..=40u64 {
            db.wal().append(1, &[(i, vec![7; 500])]).unwrap();
        }
        let files_with = |ext: &str| {
            std::fs::read_dir(dir.path().join("wal"))
                .unwrap()
                .filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == ext))
                .count()
        };
        let files = || files_with("wal");
        let before = files();
        assert!(before > 4, "small segments: the log moved on ({before} files)");
        db.wal().purge(1, 35);
        // The round's reclaim drops the dead segments from the log at once
        // and recycles or unlinks their files on a thread of its own.
        db.flusher().sync_blocking().unwrap();
        let gone = before - db.wal().segment_count();
        assert!(gone > 0);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while files() != db.wal().segment_count() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(files(), db.wal().segment_count(), "a dead segment's file was left behind");
        assert_eq!(files_with("spare"), gone.min(crate::wal::MAX_SPARES), "the oldest dead ones are kept for reuse");
        let live: Vec<u64> = db.wal().read(1, 36, 40).unwrap().into_iter().map(|(i, _)| i).collect();
        assert_eq!(live, vec![36, 37, 38, 39, 40]);
    }

    /// A sled write that met a full disk stops the node: the reason says
    /// so, and every sync, waiting or later, fails at once rather than
    /// waiting on a sled flush that may never return.
    #[test]
    fn a_failed_sled_write_stops_the_node_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        let held = db.flusher().hold_syncs();
        let waiter = {
            let db = db.clone();
            std::thread::spawn(move || db.flusher().sync_blocking())
        };
        std::thread::sleep(std::time::Duration::from_millis(50));
        // As sled hands its error back: a copy, the kind kept, the OS code not.
        let enospc = std::io::Error::from_raw_os_error(libc::ENOSPC);
        let e = db.write_failed(sled::Error::Io(std::io::Error::new(enospc.kind(), format!("{enospc:?}"))));
        assert!(matches!(e, StorageError::Sled(_)), "{e:?}");
        let why = db.fatal().borrow().clone().expect("the node is told to stop");
        assert!(why.starts_with("disk full"), "{why}");
        assert!(waiter.join().unwrap().is_err(), "a waiting sync succeeded");
        assert!(db.flusher().sync_blocking().is_err(), "a later sync succeeded");
        // Told once: a second failure keeps the first reason.
        db.write_failed(sled::Error::Unsupported("x".into()));
        assert_eq!(db.fatal().borrow().as_deref(), Some(why.as_str()));
        drop(held);
    }

    /// A log that failed part way through moving to a new segment stops
    /// the node at its next sync, as a failed fsync does.
    #[test]
    fn a_failed_log_roll_over_stops_the_node() {
        let dir = tempfile::tempdir().unwrap();
        let opts = DbOptions { wal_segment_bytes: 4096, ..DbOptions::default() };
        let db = NodeDb::open(dir.path(), &opts).unwrap();
        db.wal().append(1, &[(1, vec![1; 3000])]).unwrap();
        db.flusher().sync_blocking().unwrap();
        std::fs::create_dir(dir.path().join("wal").join(format!("{:016x}.wal", 2))).unwrap();
        assert!(db.wal().append(1, &[(2, vec![2; 3000])]).is_err(), "segment 2 cannot be made");
        assert!(db.flusher().sync_blocking().is_err(), "nothing is durable any more");
        assert!(db.fatal().borrow().is_some(), "the node is told to stop");
    }

    /// sled panics on some damage it meets at open (a zeroed segment
    /// header): that is damage, so that the dir is set aside and refilled,
    /// not a node that dies at every start.
    #[test]
    fn a_sled_that_panics_on_its_damaged_file_is_damage() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        {
            let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
            // Past two of sled's 4 MiB segments.
            for i in 0..20_000u32 {
                db.sm_tree().insert(i.to_be_bytes(), vec![7u8; 200]).unwrap();
                if i % 1000 == 999 {
                    db.flusher().sync_blocking().unwrap();
                }
            }
            db.flusher().sync_blocking().unwrap();
        }
        let file = dir.path().join("sled").join("db");
        assert!(std::fs::metadata(&file).unwrap().len() > 9 << 20);
        let f = OpenOptions::new().write(true).open(&file).unwrap();
        f.write_all_at(&[0u8; 4096], 8 << 20).unwrap();
        drop(f);
        match NodeDb::open(dir.path(), &DbOptions::default()) {
            Err(e) => assert!(matches!(e, StorageError::SledPanicked { .. }) && e.is_damage(), "not damage: {e}"),
            Ok(_) => panic!("a sled with a zeroed segment header opened"),
        }
    }

    /// A re-form's log rewrite that meets a full disk after its vote was
    /// made durable stops the node, although the log itself goes on after
    /// a full disk: only the next open finishes the rewrite, which it does.
    #[test]
    fn a_rewrite_that_meets_a_full_disk_after_its_vote_stops_the_node() {
        let dir = tempfile::tempdir().unwrap();
        let opts = DbOptions { wal_segment_bytes: 4096, ..DbOptions::default() };
        let rewritten = (2, vec![2; 3000]);
        {
            let db = NodeDb::open(dir.path(), &opts).unwrap();
            db.wal().append(1, &[(1, vec![1; 3000])]).unwrap();
            db.flusher().sync_blocking().unwrap();
            // The rewrite needs a new segment, whose space cannot be had.
            crate::wal::NO_SPACE_FOR.with(|n| n.set(1));
            let r = db.rewrite_log(1, vec![rewritten.clone()], b"vote", b"v".to_vec(), ("k", b"x".to_vec()));
            assert!(r.is_err(), "the rewrite met a full disk");
            let why = db.fatal().borrow().clone().expect("the node is told to stop");
            assert!(why.contains("log rewrite failed"), "{why}");
            assert!(db.flusher().sync_blocking().is_err(), "a later sync succeeded");
        }
        let db = NodeDb::open(dir.path(), &opts).unwrap();
        assert_eq!(db.wal().read(1, 0, u64::MAX).unwrap(), vec![(1, vec![1; 3000]), rewritten]);
        assert_eq!(db.get_node_value("k").unwrap().as_deref(), Some(&b"x"[..]));
    }

    /// A log entry that rotted under a running node stops the node when
    /// it is read (its replica would meet it at every restart), and the
    /// next open finds the damage, so that the dir is set aside and
    /// refilled; a read of a whole entry stops nothing.
    #[test]
    fn a_rotted_entry_read_at_runtime_stops_the_node_and_the_next_open_finds_it() {
        use std::os::unix::fs::FileExt;
        let dir = tempfile::tempdir().unwrap();
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        db.wal().append(1, &[(1, vec![1; 100]), (2, vec![2; 100])]).unwrap();
        db.flusher().sync_blocking().unwrap();
        // A later append records how far the log was synced, so that the
        // open can tell rot below that point from a torn tail.
        db.wal().append(1, &[(3, vec![3; 100])]).unwrap();
        db.flusher().sync_blocking().unwrap();
        let space = crate::space::SmSpace::new(db.clone(), 1);
        assert_eq!(space.log_entry(1).unwrap(), Some(vec![1; 100]));
        assert!(db.fatal().borrow().is_none(), "a whole entry stops nothing");
        // The second entry's payload, one bit flipped in place.
        let seg = std::fs::read_dir(dir.path().join("wal"))
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| p.extension().is_some_and(|x| x == "wal"))
            .unwrap();
        let f = OpenOptions::new().read(true).write(true).open(&seg).unwrap();
        let mut bytes = vec![0u8; 4096];
        let n = f.read_at(&mut bytes, 0).unwrap();
        let at = bytes[..n].windows(100).rposition(|w| w.iter().all(|b| *b == 2)).expect("the entry's payload");
        f.write_all_at(&[2 ^ 0x10], (at + 50) as u64).unwrap();
        drop(f);
        assert!(space.log_entry(2).is_err(), "a rotted entry was read as written");
        let why = db.fatal().borrow().clone().expect("the node is told to stop");
        assert!(why.contains("changed on the disk"), "{why}");
        drop(space);
        drop(db);
        let reopened = NodeDb::open(dir.path(), &DbOptions::default());
        assert!(matches!(&reopened, Err(e) if e.is_damage()), "the next open did not find the damage");
    }

    /// What a sync covered survives [`NodeDb::crash_for_tests`]; log bytes
    /// and sled writes made after it do not, even those sled wrote to its
    /// file (a batch) when the crash image is kept. The dir opens again
    /// while a clone of the crashed handle lives on.
    #[test]
    fn a_crash_keeps_what_was_synced_and_loses_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        db.keep_crash_image().unwrap();
        db.wal().append(1, &[(1, b"synced".to_vec())]).unwrap();
        db.sm_tree().insert(b"synced", b"1".to_vec()).unwrap();
        db.flusher().sync_blocking().unwrap();
        db.wal().append(1, &[(2, b"not synced".to_vec())]).unwrap();
        db.sm_tree().insert(b"not synced", b"2".to_vec()).unwrap();
        let mut batch = sled::Batch::default();
        batch.insert(&b"batch"[..], &b"3"[..]);
        db.sm_tree().apply_batch(batch).unwrap();
        let clone = db.clone();
        db.crash_for_tests().unwrap();
        drop(db);
        assert!(clone.flusher().sync_blocking().is_err(), "nothing is synced after the crash");
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        assert_eq!(db.wal().read(1, 0, u64::MAX).unwrap(), vec![(1, b"synced".to_vec())]);
        assert!(db.sm_tree().get(b"synced").unwrap().is_some());
        assert!(db.sm_tree().get(b"not synced").unwrap().is_none());
        assert!(db.sm_tree().get(b"batch").unwrap().is_none(), "written to sled's file, never synced");
        drop(clone);
        db.wal().append(1, &[(2, b"again".to_vec())]).unwrap();
        db.put_node_value("k", b"v").unwrap();
        drop(db);
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        assert_eq!(db.wal().bounds(1), Some((1, 2)));
        assert_eq!(db.get_node_value("k").unwrap().as_deref(), Some(&b"v"[..]));
    }

    /// A power cut right after the first open of a data dir, with an
    /// acknowledged node value and log entry: both come back. Every entry
    /// of every dir that was never synced is lost in the crash, so the data
    /// dir must have been synced after `sled` and `wal` were made in it.
    #[test]
    fn a_power_cut_after_the_first_open_keeps_what_was_acknowledged() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let db = NodeDb::open(&data, &DbOptions::default()).unwrap();
        db.keep_crash_image().unwrap();
        db.put_node_value("k", b"v").unwrap();
        db.wal().append(1, &[(1, b"acked".to_vec())]).unwrap();
        db.flusher().sync_blocking().unwrap();
        db.crash_for_tests().unwrap();
        drop(db);
        let db = NodeDb::open(&data, &DbOptions::default()).unwrap();
        assert_eq!(db.get_node_value("k").unwrap().as_deref(), Some(&b"v"[..]), "an acknowledged value was lost");
        assert_eq!(db.wal().bounds(1), Some((1, 1)), "an acknowledged log entry was lost");
    }

    /// sled's files are made whole before its dir gets its name: a power
    /// cut after the first open (the dir's entry kept, what sled wrote in
    /// it never synced) leaves a database that opens. A first open cut
    /// short leaves `sled.new`, which the next open throws away.
    #[test]
    fn a_power_cut_after_the_first_open_leaves_a_sled_dir_that_opens() {
        let dir = tempfile::tempdir().unwrap();
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        db.keep_crash_image().unwrap();
        db.wal().append(1, &[(1, b"acked".to_vec())]).unwrap();
        db.flusher().sync_blocking().unwrap();
        db.crash_for_tests().unwrap();
        drop(db);
        let conf = std::fs::metadata(dir.path().join("sled").join("conf")).map(|m| m.len());
        assert!(conf.as_ref().is_ok_and(|len| *len > 0), "sled's conf lost its bytes: {conf:?}");
        drop(NodeDb::open(dir.path(), &DbOptions::default()).unwrap());
        // As a first open cut short leaves it: no log yet, a torn sled.new.
        std::fs::remove_dir_all(dir.path().join("sled")).unwrap();
        std::fs::remove_dir_all(dir.path().join("wal")).unwrap();
        std::fs::create_dir(dir.path().join(SLED_NEW)).unwrap();
        std::fs::write(dir.path().join(SLED_NEW).join("conf"), b"torn").unwrap();
        drop(NodeDb::open(dir.path(), &DbOptions::default()).unwrap());
        assert!(!dir.path().join(SLED_NEW).exists());
    }

    /// sled's dir gone from beside a log (a name lost, or removed by hand)
    /// is damage: a fresh sled would forget the votes given.
    #[test]
    fn a_log_without_its_sled_dir_is_damage() {
        let dir = tempfile::tempdir().unwrap();
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        db.wal().append(1, &[(1, b"acked".to_vec())]).unwrap();
        db.flusher().sync_blocking().unwrap();
        drop(db);
        std::fs::remove_dir_all(dir.path().join("sled")).unwrap();
        match NodeDb::open(dir.path(), &DbOptions::default()) {
            Err(e) => assert!(e.is_damage(), "not taken for damage: {e}"),
            Ok(_) => panic!("a log without its sled dir opened with a fresh sled"),
        }
    }

    fn copy_dir(from: &Path, to: &Path) {
        std::fs::create_dir_all(to).unwrap();
        for e in std::fs::read_dir(from).unwrap() {
            let e = e.unwrap();
            if e.file_type().unwrap().is_dir() {
                copy_dir(&e.path(), &to.join(e.file_name()));
            } else {
                std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
            }
        }
    }

    /// sled that comes back with less than it had synced (here: its whole
    /// dir as an earlier sync left it, which is what its recovery makes of
    /// a file truncated or zeroed past that point) is damage, though sled
    /// opens it without an error and it still holds the node's values.
    #[test]
    fn a_sled_that_lost_writes_it_had_synced_is_damage() {
        let dir = tempfile::tempdir().unwrap();
        let old = tempfile::tempdir().unwrap();
        {
            let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
            db.put_node_value("node_id", b"1").unwrap();
            db.wal().append(1, &[(1, b"a".to_vec())]).unwrap();
            db.flusher().sync_blocking().unwrap();
        }
        copy_dir(&dir.path().join("sled"), old.path());
        {
            let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
            db.raft_meta_tree().insert(b"vote", b"given later".to_vec()).unwrap();
            db.flusher().sync_blocking().unwrap();
            // The log's note of that sync becomes durable with this one.
            db.wal().append(1, &[(2, b"b".to_vec())]).unwrap();
            db.flusher().sync_blocking().unwrap();
        }
        std::fs::remove_dir_all(dir.path().join("sled")).unwrap();
        copy_dir(old.path(), &dir.path().join("sled"));
        match NodeDb::open(dir.path(), &DbOptions::default()) {
            Err(e @ StorageError::SledBehind { .. }) => assert!(e.is_damage(), "not taken for damage: {e}"),
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("a sled that lost a synced vote opened"),
        }
    }

    /// A log segment cut short below the point the last sled sync recorded
    /// is damage, though what is left of it ends like a torn tail.
    #[test]
    fn a_log_cut_short_of_what_sled_saw_synced_is_damage() {
        let dir = tempfile::tempdir().unwrap();
        let head = {
            let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
            for i in 1..=50u64 {
                db.wal().append(1, &[(i, vec![7; 200])]).unwrap();
            }
            db.flusher().sync_blocking().unwrap();
            let point = db.wal().synced_point();
            db.crash_for_tests().unwrap();
            point
        };
        let seg = dir.path().join("wal").join(format!("{:016x}.wal", head.0));
        let f = OpenOptions::new().write(true).open(&seg).unwrap();
        f.set_len(head.1 / 3).unwrap();
        drop(f);
        match NodeDb::open(dir.path(), &DbOptions::default()) {
            Err(e @ StorageError::Wal(WalError::Shorter { .. })) => assert!(e.is_damage(), "not damage: {e}"),
            Err(e) => panic!("wrong error: {e}"),
            Ok(_) => panic!("a log cut short of an acknowledged point opened"),
        }
    }

    /// A log written without a waiter that needs sled still has sled
    /// synced once a [`crate::flusher::WITNESS_EVERY`], so the point sled
    /// holds the log to follows it.
    #[test]
    fn sled_follows_a_busy_log_within_the_witness_interval() {
        let dir = tempfile::tempdir().unwrap();
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        let point = || {
            let v = db.node_tree().get(SLED_MARK_KEY).unwrap().unwrap();
            decode_sled_mark(&v).unwrap().1
        };
        db.flusher().sync_blocking().unwrap();
        let before = point();
        let started = std::time::Instant::now();
        let mut i = 0;
        while started.elapsed() < crate::flusher::WITNESS_EVERY + std::time::Duration::from_millis(300) {
            i += 1;
            db.wal().append(1, &[(i, vec![1; 100])]).unwrap();
            block_on(db.flusher().sync_log()).unwrap();
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let after = point();
        assert!(after.1 > before.1, "sled never synced under log-only rounds: {before:?} -> {after:?}");
    }

    /// The mark never accuses a sled that kept what it synced: crashes at
    /// any point between a sled sync and the log's note of it, and after
    /// the note is durable, each reopen without a word.
    #[test]
    fn crashes_around_sled_syncs_are_never_taken_for_damage() {
        let dir = tempfile::tempdir().unwrap();
        for round in 0..12u64 {
            let db = NodeDb::open(dir.path(), &DbOptions::default())
                .unwrap_or_else(|e| panic!("round {round}: a sound dir refused: {e}"));
            db.keep_crash_image().unwrap();
            for i in 0..=round % 4 {
                db.sm_tree().insert(format!("{round}-{i}").as_bytes(), b"v".to_vec()).unwrap();
                db.wal().append(1, &[(round * 10 + i + 1, b"e".to_vec())]).unwrap();
                if (round + i) % 3 == 0 {
                    db.flusher().sync_blocking().unwrap();
                } else {
                    block_on(db.flusher().sync_log()).unwrap();
                }
            }
            if round % 2 == 0 {
                db.crash_for_tests().unwrap();
            }
        }
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        assert!(db.wal().sled_mark() > 0, "no sled sync left its mark in the log");
    }

    fn block_on<F: std::future::Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread().build().unwrap().block_on(f)
    }

    /// A test may crash a node whose disk it holds back: the crash does
    /// not wait for the guard, and the waiter held back fails.
    #[test]
    fn a_crash_does_not_wait_for_held_syncs() {
        let dir = tempfile::tempdir().unwrap();
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        let _held = db.flusher().hold_syncs();
        db.wal().append(1, &[(1, b"held".to_vec())]).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        db.flusher().submit_log(Box::new(move |r| tx.send(r.is_ok()).unwrap()));
        std::thread::sleep(std::time::Duration::from_millis(50));
        db.crash_for_tests().unwrap();
        assert_eq!(rx.recv_timeout(std::time::Duration::from_secs(5)), Ok(false));
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        assert_eq!(db.wal().bounds(1), None, "never synced");
    }

    #[test]
    fn node_values_survive_reopen() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
            db.put_node_value("identity", b"node-7").unwrap();
        }
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        assert_eq!(db.get_node_value("identity").unwrap().as_deref(), Some(&b"node-7"[..]));
    }

    #[test]
    fn entries_kept_in_sled_by_an_older_version_move_into_the_log() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
            for i in 1..=3u64 {
                db.inner.log.insert(crate::keys::log_key(7, i), vec![i as u8; 10]).unwrap();
            }
            db.inner.log.insert(crate::keys::log_key(2, 9), b"other group".to_vec()).unwrap();
            db.flusher().sync_blocking().unwrap();
        }
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        assert_eq!(
            db.wal().read(7, 0, u64::MAX).unwrap(),
            (1..=3u64).map(|i| (i, vec![i as u8; 10])).collect::<Vec<_>>()
        );
        assert_eq!(db.wal().read(2, 0, u64::MAX).unwrap(), vec![(9, b"other group".to_vec())]);
        assert!(db.inner.log.is_empty(), "sled no longer holds them");
        drop(db);
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        assert_eq!(db.wal().bounds(7), Some((1, 3)), "moved once, durably");
    }

    #[test]
    fn a_log_rewrite_committed_before_a_crash_is_finished_at_the_next_open() {
        let dir = tempfile::tempdir().unwrap();
        let pending = vec![(2u64, b"rewritten".to_vec()), (4, b"appended".to_vec())];
        {
            let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
            db.wal().append(5, &[(1, b"a".to_vec()), (2, b"b".to_vec()), (3, b"c".to_vec())]).unwrap();
            db.flusher().sync_blocking().unwrap();
            // What `rewrite_log` commits in sled before it touches the log;
            // the process dies before the log is written.
            let key = meta_key(5, META_REWRITE);
            db.inner.raft_meta.insert(key, crate::keys::encode(&pending, "t").unwrap()).unwrap();
            db.flusher().sync_blocking().unwrap();
        }
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        let want: Vec<(u64, Vec<u8>)> =
            vec![(1, b"a".to_vec()), (2, b"rewritten".to_vec()), (3, b"c".to_vec()), (4, b"appended".to_vec())];
        assert_eq!(db.wal().read(5, 0, u64::MAX).unwrap(), want);
        assert!(db.inner.raft_meta.get(meta_key(5, META_REWRITE)).unwrap().is_none(), "done, not redone");
        // And the whole call, without a crash.
        db.rewrite_log(5, vec![(5, b"e".to_vec())], &meta_key(5, b'v'), b"vote".to_vec(), ("epoch.5", b"x".to_vec()))
            .unwrap();
        assert_eq!(db.wal().bounds(5), Some((1, 5)));
        assert_eq!(db.get_node_value("epoch.5").unwrap().as_deref(), Some(&b"x"[..]));
        assert_eq!(db.inner.raft_meta.get(meta_key(5, b'v')).unwrap().as_deref(), Some(&b"vote"[..]));
    }

    #[test]
    fn a_dropped_group_leaves_nothing_behind() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
            db.wal().append(6, &[(1, b"a".to_vec())]).unwrap();
            db.inner.raft_meta.insert(meta_key(6, b'v'), b"vote".to_vec()).unwrap();
            assert!(db.group_exists(6).unwrap());
            db.drop_group(6).unwrap();
            assert!(!db.group_exists(6).unwrap());
        }
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        assert!(!db.group_exists(6).unwrap(), "the drop was durable");
    }
}
