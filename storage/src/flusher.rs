//! Group commit: one `fdatasync` of the write-ahead log serves every waiter
//! present at that moment, across all groups of the node; sled's `flush` +
//! `fdatasync` is added to the round when one of them needs sled durable.
//!
//! Appenders hand in a completion callback and return at once (openraft only
//! needs the entries to be *readable* when `append` returns). A dedicated thread
//! takes the first waiter, drains every other waiter already queued, makes the
//! database durable once and completes them all. While it syncs, new waiters
//! queue up and form the next batch, so the number of syncs per second stays
//! bounded by the disk while the number of appends per sync grows with load.

use std::collections::HashSet;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::time::Instant;

use crate::keys::{encode_sled_mark, SLED_MARK_KEY};
use crate::wal::{Retired, Wal};

/// Called once with the outcome of the sync that covered the waiter's writes.
pub type Completion = Box<dyn FnOnce(io::Result<()>) + Send>;

/// sled's data file as the last sled sync left it, for a test's crash to
/// put back (`NodeDb::keep_crash_image`); `None`, the default: not kept.
pub type CrashImage = Arc<Mutex<Option<Vec<u8>>>>;

enum Msg {
    /// `sled`: the waiter needs sled's writes durable too, not only the log.
    Wait(Completion, bool),
    /// Sent when the database is closed: sync what is pending and exit, so the
    /// files are released before `NodeDb`'s drop returns.
    Stop,
}

/// Counters for benchmarks and metrics.
#[derive(Debug, Default)]
pub struct FlusherStats {
    /// Number of `flush` + `fdatasync` rounds.
    pub syncs: AtomicU64,
    /// Number of completions served (appends, vote saves, explicit syncs).
    pub waiters: AtomicU64,
    /// Total time spent syncing, in nanoseconds.
    pub sync_nanos: AtomicU64,
    /// Syncs by duration: `sync_buckets[i]` counts those up to
    /// `SYNC_BUCKET_BOUNDS[i]` seconds and over the bound before it.
    pub sync_buckets: [AtomicU64; SYNC_BUCKETS],
}

/// Number of sync-duration buckets (the last one is unbounded).
pub const SYNC_BUCKETS: usize = 14;

/// Upper bounds of the sync-duration buckets, in seconds.
pub const SYNC_BUCKET_BOUNDS: [f64; SYNC_BUCKETS] =
    [0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.024, f64::INFINITY];

impl FlusherStats {
    fn record(&self, took: std::time::Duration) {
        let secs = took.as_secs_f64();
        let i = SYNC_BUCKET_BOUNDS.iter().position(|b| secs <= *b).unwrap_or(SYNC_BUCKETS - 1);
        self.sync_buckets[i].fetch_add(1, Ordering::Relaxed);
    }
}

/// Handle to the flusher thread. Cloning shares the thread; the thread exits
/// when the last handle is dropped.
#[derive(Clone)]
pub struct Flusher {
    tx: mpsc::Sender<Msg>,
    failed: Arc<AtomicBool>,
    stats: Arc<FlusherStats>,
    held: Arc<Held>,
    /// See [`Flusher::hold_sled_syncs`].
    #[cfg(any(test, feature = "test-hooks"))]
    sled_gate: Arc<SledGate>,
}

/// How many [`SyncsHeld`] guards are alive; the flusher thread waits for none
/// before it syncs.
#[derive(Default)]
struct Held {
    count: Mutex<usize>,
    released: Condvar,
}

impl Held {
    /// Until no guard is alive, or the flusher has failed (a test's crash
    /// must not wait for a guard).
    fn wait_released(&self, failed: &AtomicBool) {
        let mut n = self.count.lock().expect("poisoned");
        while *n > 0 && !failed.load(Ordering::Acquire) {
            n = self.released.wait(n).expect("poisoned");
        }
    }
}

/// Syncs are held back while this lives (see [`Flusher::hold_syncs`]).
pub struct SyncsHeld(Arc<Held>);

/// Where a round that syncs sled waits, after its log sync, while a
/// [`SledSyncsHeld`] lives.
#[cfg(any(test, feature = "test-hooks"))]
#[derive(Default)]
struct SledGate {
    /// Guards alive, and whether a round waits at the gate.
    state: Mutex<(usize, bool)>,
    changed: Condvar,
    /// A crash lets a waiting round go on, as a sync under way.
    crashed: AtomicBool,
}

#[cfg(any(test, feature = "test-hooks"))]
impl SledGate {
    fn pass(&self) {
        let mut state = self.state.lock().expect("poisoned");
        while state.0 > 0 && !self.crashed.load(Ordering::Acquire) {
            state.1 = true;
            state = self.changed.wait(state).expect("poisoned");
        }
        state.1 = false;
    }
}

/// Sled's part of a round is held back while this lives (see
/// [`Flusher::hold_sled_syncs`]).
#[cfg(any(test, feature = "test-hooks"))]
pub struct SledSyncsHeld(Arc<SledGate>);

#[cfg(any(test, feature = "test-hooks"))]
impl SledSyncsHeld {
    /// Whether a round has synced the log and waits to sync sled.
    pub fn round_waiting(&self) -> bool {
        self.0.state.lock().expect("poisoned").1
    }
}

#[cfg(any(test, feature = "test-hooks"))]
impl Drop for SledSyncsHeld {
    fn drop(&mut self) {
        self.0.state.lock().expect("poisoned").0 -= 1;
        self.0.changed.notify_all();
    }
}

impl Drop for SyncsHeld {
    fn drop(&mut self) {
        *self.0.count.lock().expect("poisoned") -= 1;
        self.0.released.notify_all();
    }
}

impl Flusher {
    /// Start the flusher for a sled database living in `dir`.
    ///
    /// `on_fatal` runs once, on the flusher thread, if a sync ever fails.
    ///
    /// `marks` is where sled keeps its mark (see [`Wal::note_sled_mark`]),
    /// and `mark` the highest mark written so far, in sled or in the log.
    pub fn start(
        db: sled::Db,
        dir: &Path,
        wal: Arc<Wal>,
        marks: (sled::Tree, u64),
        crash_image: CrashImage,
        on_fatal: impl Fn(&io::Error) + Send + 'static,
    ) -> io::Result<(Self, std::thread::JoinHandle<()>)> {
        let mut sled = SledTarget::new(db, dir)?;
        sled.crash_image = crash_image;
        sled.marks = Some(marks);
        let (remover, files) = mpsc::channel::<Vec<Retired>>();
        let log = wal.clone();
        let remover_thread = std::thread::Builder::new()
            .name("mirrorq-wal-rm".into())
            .spawn(move || files.iter().for_each(|batch| log.retire(batch)))?;
        #[cfg(any(test, feature = "test-hooks"))]
        let sled_gate = Arc::new(SledGate::default());
        let target = NodeTarget {
            wal,
            sled,
            remover,
            remover_thread: Some(remover_thread),
            sled_synced: Instant::now(),
            #[cfg(any(test, feature = "test-hooks"))]
            sled_gate: sled_gate.clone(),
        };
        #[cfg_attr(not(any(test, feature = "test-hooks")), allow(unused_mut))]
        let (mut flusher, thread) = Self::with_target(target, on_fatal)?;
        #[cfg(any(test, feature = "test-hooks"))]
        {
            flusher.sled_gate = sled_gate;
        }
        Ok((flusher, thread))
    }

    /// Start a flusher over any [`SyncTarget`] (tests inject failing ones).
    pub fn with_target(
        mut target: impl SyncTarget,
        on_fatal: impl Fn(&io::Error) + Send + 'static,
    ) -> io::Result<(Self, std::thread::JoinHandle<()>)> {
        let (tx, rx) = mpsc::channel::<Msg>();
        let failed = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(FlusherStats::default());
        let held = Arc::new(Held::default());
        let (f2, s2, h2) = (failed.clone(), stats.clone(), held.clone());
        let thread = std::thread::Builder::new()
            .name("mirrorq-flusher".into())
            .spawn(move || run(rx, &mut target, &f2, &s2, &h2, on_fatal))?;
        Ok((
            Self {
                tx,
                failed,
                stats,
                held,
                #[cfg(any(test, feature = "test-hooks"))]
                sled_gate: Arc::default(),
            },
            thread,
        ))
    }

    /// Queue a completion behind the writes already made (log and sled); it
    /// fires after the next sync. After a failed sync it fires at once with
    /// an error.
    pub fn submit(&self, done: Completion) {
        self.send(done, true)
    }

    /// Like [`Flusher::submit`] for a waiter that needs only the write-ahead
    /// log durable (a log append): its round syncs sled only if another
    /// waiter needs it.
    pub fn submit_log(&self, done: Completion) {
        self.send(done, false)
    }

    fn send(&self, done: Completion, sled: bool) {
        if self.failed.load(Ordering::Acquire) {
            done(Err(sync_failed()));
            return;
        }
        if let Err(mpsc::SendError(Msg::Wait(done, _))) = self.tx.send(Msg::Wait(done, sled)) {
            done(Err(io::Error::other("flusher stopped")));
        }
    }

    /// Wait until everything written so far is durable.
    pub async fn sync(&self) -> io::Result<()> {
        self.wait(true).await
    }

    /// Wait until every log write so far is durable (sled's are not waited for).
    pub async fn sync_log(&self) -> io::Result<()> {
        self.wait(false).await
    }

    async fn wait(&self, sled: bool) -> io::Result<()> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.send(
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
            sled,
        );
        rx.await.unwrap_or_else(|_| Err(io::Error::other("flusher stopped")))
    }

    /// Blocking variant of [`Flusher::sync`] for non-async callers.
    pub fn sync_blocking(&self) -> io::Result<()> {
        let (tx, rx) = mpsc::channel();
        self.submit(Box::new(move |r| {
            let _ = tx.send(r);
        }));
        rx.recv().unwrap_or_else(|_| Err(io::Error::other("flusher stopped")))
    }

    /// Ask the thread to finish the pending batch and exit.
    pub fn stop(&self) {
        let _ = self.tx.send(Msg::Stop);
    }

    /// Ask the thread to exit as if the process died: a sync under way
    /// ends, nothing is synced after it, and every waiter, present or
    /// later, fails.
    #[cfg(any(test, feature = "test-hooks"))]
    pub(crate) fn crash_for_tests(&self) {
        self.failed.store(true, Ordering::Release);
        // Under the lock, so that a flusher waiting for held syncs cannot
        // miss the wake-up between its check and its wait.
        drop(self.held.count.lock().expect("poisoned"));
        self.held.released.notify_all();
        self.sled_gate.crashed.store(true, Ordering::Release);
        drop(self.sled_gate.state.lock().expect("poisoned"));
        self.sled_gate.changed.notify_all();
        self.stop();
    }

    /// Fail every waiter, present or later, without a sync: the node is
    /// stopping for a storage failure the flusher did not see (a sled
    /// write that failed). A round under way may never end (sled 0.34's
    /// flush can wait for good after a failed write): the waiters it took
    /// wait with it, and `mirrorq serve` exits without them.
    pub(crate) fn fail(&self) {
        self.failed.store(true, Ordering::Release);
        drop(self.held.count.lock().expect("poisoned"));
        self.held.released.notify_all();
    }

    pub fn has_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    pub fn stats(&self) -> &FlusherStats {
        &self.stats
    }

    /// Start no sync until the guard drops (a sync under way finishes):
    /// writes go on and stay readable, nothing more becomes durable and no
    /// completion fires. This is a disk that is slow on purpose, for tests
    /// of what waits for whose disk.
    pub fn hold_syncs(&self) -> SyncsHeld {
        *self.held.count.lock().expect("poisoned") += 1;
        SyncsHeld(self.held.clone())
    }

    /// Until the guard drops, a round that syncs sled syncs the log and
    /// then waits before it syncs sled; its waiters, and rounds after it,
    /// wait with it. This is a sled sync slow next to the log's, for tests
    /// of what may reach sled's disk before the log's: what is written to
    /// sled meanwhile becomes durable with that round, what is appended to
    /// the log meanwhile does not.
    #[cfg(any(test, feature = "test-hooks"))]
    pub fn hold_sled_syncs(&self) -> SledSyncsHeld {
        self.sled_gate.state.lock().expect("poisoned").0 += 1;
        SledSyncsHeld(self.sled_gate.clone())
    }
}

/// Whether `e` says the disk (or the user's quota) is full. By its kind
/// too: sled hands back a copy of its I/O error without the OS code.
pub(crate) fn is_disk_full(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC) | Some(libc::EDQUOT))
        || matches!(e.kind(), io::ErrorKind::StorageFull | io::ErrorKind::QuotaExceeded)
}

fn sync_failed() -> io::Error {
    io::Error::other("an earlier disk sync failed; node is stopping")
}

/// What the flusher makes durable: the seam where tests inject disk failures.
pub trait SyncTarget: Send + 'static {
    /// Make every log write so far durable, and with `sled` every sled write.
    fn sync(&mut self, sled: bool) -> io::Result<()>;
}

/// A node's storage: its write-ahead log and its sled database.
struct NodeTarget {
    wal: Arc<Wal>,
    sled: SledTarget,
    /// To the thread that recycles or unlinks dead segments' files, in the
    /// order they are sent (it ends when this target is dropped, after the
    /// files already sent).
    remover: mpsc::Sender<Vec<Retired>>,
    remover_thread: Option<std::thread::JoinHandle<()>>,
    /// When sled was last synced (see [`WITNESS_EVERY`]).
    sled_synced: Instant,
    #[cfg(any(test, feature = "test-hooks"))]
    sled_gate: Arc<SledGate>,
}

/// Longest a busy log goes without a sled sync: each records how far the
/// log is synced, which the next open holds the log to (a log cut short of
/// it is damage, not a torn tail), so this bounds how much of the log's
/// end damage could pass as a tail. A sled sync is a flush and one
/// fdatasync of a file that changes little while only the log is written.
pub const WITNESS_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

impl Drop for NodeTarget {
    /// Waits for the files already sent: once the flusher has exited, no
    /// thread of this database renames or unlinks anything in the log's
    /// directory, which a reopen is about to read.
    fn drop(&mut self) {
        // Hang up (a sender nobody listens to takes its place), then wait.
        self.remover = mpsc::channel().0;
        if let Some(thread) = self.remover_thread.take() {
            let _ = thread.join();
        }
    }
}

impl SyncTarget for NodeTarget {
    fn sync(&mut self, sled: bool) -> io::Result<()> {
        self.wal.sync().map_err(io::Error::other)?;
        if sled {
            #[cfg(any(test, feature = "test-hooks"))]
            self.sled_gate.pass();
            self.sync_sled()?;
        } else if self.sled_synced.elapsed() >= WITNESS_EVERY && self.witness_allowed() {
            self.sync_sled()?;
        }
        self.reclaim()
    }
}

impl NodeTarget {
    /// Whether a sled sync no waiter asked for may run: not while a test
    /// holds sled's syncs back, since what it holds must stay unsynced.
    fn witness_allowed(&self) -> bool {
        #[cfg(any(test, feature = "test-hooks"))]
        if self.sled_gate.state.lock().expect("poisoned").0 > 0 {
            return false;
        }
        true
    }

    /// Sync sled, with how far the log is synced, then leave the mark
    /// sled now holds in the log: each witnesses the other at the next open.
    fn sync_sled(&mut self) -> io::Result<()> {
        self.sled.log_point = self.wal.synced_point();
        self.sled.sync()?;
        self.sled_synced = Instant::now();
        if let Some((_, mark)) = &self.sled.marks {
            // A mark the log lacks only weakens the check at the next open.
            // A full disk refuses only a new segment and leaves the log
            // going; any other failure fails the log, and the next sync
            // stops the node.
            if let Err(e) = self.wal.note_sled_mark(*mark) {
                if !e.is_no_space() {
                    return Err(io::Error::other(e));
                }
            }
        }
        Ok(())
    }

    /// Remove log segments no live entry needs, after moving idle groups'
    /// entries out of the oldest. Once per segment's worth of writes, so
    /// the extra syncs cost nothing measurable.
    fn reclaim(&mut self) -> io::Result<()> {
        let started = Instant::now();
        let moved = self.wal.relocate_idle().map_err(io::Error::other)?;
        if moved > 0 {
            self.wal.sync().map_err(io::Error::other)?;
            // Every append on the node waited for this.
            tracing::info!(
                bytes = moved,
                took_ms = started.elapsed().as_millis() as u64,
                "idle groups' log entries moved to the head of the log"
            );
        }
        let dead = self.wal.reclaimable();
        if dead.is_empty() {
            return Ok(());
        }
        // The purge points that killed these entries are sled writes: they
        // must be durable before the entries are gone.
        self.sync_sled()?;
        let files = self.wal.forget(&dead);
        // Unlinking a full segment costs the file system 30-60 ms (its
        // extents, its cached pages), and every append on the node waits
        // for this thread: at 4 KiB x 1000 rounds of 108-183 ms, one per
        // few snapshots. The files go on a thread of their own, one thread
        // so that they still go oldest first (`Wal::retire`).
        if let Err(mpsc::SendError(files)) = self.remover.send(files) {
            self.wal.retire(files);
        }
        Ok(())
    }
}

struct SledTarget {
    db: sled::Db,
    data_file: File,
    /// sled writes values larger than a quarter segment to separate blob files
    /// and never syncs them; we do, once per new file.
    blobs: PathBuf,
    synced_blobs: HashSet<std::ffi::OsString>,
    data_path: PathBuf,
    /// sled's own dir: it writes its snapshots there (`snap.<lsn>`, synced,
    /// then renamed, old ones removed) and never syncs the dir. The names
    /// seen at the last sync, to sync the dir when they change.
    dir: PathBuf,
    snapshots: HashSet<std::ffi::OsString>,
    crash_image: CrashImage,
    /// Where sled keeps its mark, and the last mark written: each sync
    /// writes the next one first, so a sync that returns has it on disk.
    marks: Option<(sled::Tree, u64)>,
    /// The log's [`Wal::synced_point`] to record with the next mark.
    log_point: (u64, u64),
    /// What each sync flushed and synced, in order, for tests of that order.
    #[cfg(test)]
    trail: Vec<Step>,
}

#[cfg(test)]
#[derive(Debug, Clone, PartialEq, Eq)]
enum Step {
    Flush,
    Db,
    Blob(std::ffi::OsString),
    BlobsDir,
}

impl SledTarget {
    /// Over the sled database `db` living in `dir`.
    fn new(db: sled::Db, dir: &Path) -> io::Result<Self> {
        let data_file = File::open(dir.join("db"))?;
        #[cfg(any(test, feature = "test-hooks"))]
        crate::fsync::contents_kept_elsewhere(&data_file);
        Ok(Self {
            db,
            data_file,
            dir: dir.to_owned(),
            snapshots: HashSet::new(),
            blobs: dir.join("blobs"),
            synced_blobs: HashSet::new(),
            data_path: dir.join("db"),
            crash_image: CrashImage::default(),
            marks: None,
            log_point: (0, 0),
            #[cfg(test)]
            trail: Vec::new(),
        })
    }

    /// Make every sled write made before the call durable.
    ///
    /// sled writes a blob file before the pointer to it enters its log, and
    /// never syncs the blob. A pointer made durable before its blob would,
    /// after a power loss, name a missing blob (sled skips the update, so
    /// it no longer recovers a prefix of its writes) or a torn one. So the
    /// blobs go first: listed after the flush, the listing holds the blob
    /// of every pointer the flush wrote, and of every write our waiters
    /// made. A pointer written by a concurrent write after the listing may
    /// still reach the disk ahead of its blob (with this `fdatasync` or by
    /// the kernel's own writeback); no waiter of this round depends on it,
    /// and the next round syncs its blob.
    fn sync(&mut self) -> io::Result<()> {
        if let Some((tree, mark)) = &mut self.marks {
            *mark += 1;
            let value = encode_sled_mark(*mark, self.log_point);
            tree.insert(SLED_MARK_KEY, &value[..]).map_err(|e| match e {
                sled::Error::Io(io) => io,
                e => io::Error::other(e),
            })?;
        }
        // sled writes what it buffered here: its I/O error as it is, so
        // that a full disk reads as one.
        self.db.flush().map_err(|e| match e {
            sled::Error::Io(io) => io,
            e => io::Error::other(e),
        })?;
        #[cfg(test)]
        self.trail.push(Step::Flush);
        self.sync_new_blobs()?;
        self.sync_snapshot_names()?;
        self.data_file.sync_data()?;
        #[cfg(test)]
        self.trail.push(Step::Db);
        if let Some(image) = self.crash_image.lock().expect("poisoned").as_mut() {
            *image = std::fs::read(&self.data_path)?;
        }
        Ok(())
    }
}

impl SledTarget {
    /// sled may reuse the log space a snapshot covers once it is written:
    /// the snapshot's name must be durable before sled's file is.
    fn sync_snapshot_names(&mut self) -> io::Result<()> {
        let mut now = HashSet::new();
        for e in std::fs::read_dir(&self.dir)? {
            let name = e?.file_name();
            if name.to_string_lossy().starts_with("snap.") {
                now.insert(name);
            }
        }
        if now != self.snapshots {
            #[cfg(any(test, feature = "test-hooks"))]
            for name in now.difference(&self.snapshots) {
                // sled synced its bytes; a name listed may be gone already.
                if let Ok(f) = File::open(self.dir.join(name)) {
                    crate::fsync::contents_kept_elsewhere(&f);
                }
            }
            crate::fsync::sync_dir(&self.dir)?;
            self.snapshots = now;
        }
        Ok(())
    }

    fn sync_new_blobs(&mut self) -> io::Result<()> {
        let dir = match std::fs::read_dir(&self.blobs) {
            Ok(d) => d,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        let mut present = HashSet::new();
        let mut new_any = false;
        for entry in dir {
            let entry = entry?;
            let name = entry.file_name();
            if !self.synced_blobs.contains(&name) {
                // A blob may be removed by sled between listing and opening.
                match File::open(entry.path()) {
                    Ok(f) => {
                        f.sync_data()?;
                        #[cfg(any(test, feature = "test-hooks"))]
                        crate::fsync::contents_kept_elsewhere(&f);
                        #[cfg(test)]
                        self.trail.push(Step::Blob(name.clone()));
                    }
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(e),
                }
                new_any = true;
            }
            present.insert(name);
        }
        if new_any {
            crate::fsync::sync_dir(&self.blobs)?;
            #[cfg(test)]
            self.trail.push(Step::BlobsDir);
        }
        self.synced_blobs = present;
        Ok(())
    }
}

fn run(
    rx: mpsc::Receiver<Msg>,
    target: &mut impl SyncTarget,
    failed: &AtomicBool,
    stats: &FlusherStats,
    held: &Held,
    on_fatal: impl Fn(&io::Error),
) {
    let mut batch: Vec<Completion> = Vec::with_capacity(256);
    let mut stopping = false;
    while !stopping {
        let mut sled = false;
        match rx.recv() {
            Ok(Msg::Wait(first, s)) => {
                batch.push(first);
                sled |= s;
            }
            Ok(Msg::Stop) | Err(_) => stopping = true,
        }
        while let Ok(more) = rx.try_recv() {
            match more {
                Msg::Wait(done, s) => {
                    batch.push(done);
                    sled |= s;
                }
                Msg::Stop => stopping = true,
            }
        }
        if batch.is_empty() {
            continue;
        }
        held.wait_released(failed);
        if failed.load(Ordering::Acquire) {
            for done in batch.drain(..) {
                done(Err(sync_failed()));
            }
            continue;
        }
        let started = Instant::now();
        let result = target.sync(sled);
        stats.syncs.fetch_add(1, Ordering::Relaxed);
        stats.waiters.fetch_add(batch.len() as u64, Ordering::Relaxed);
        let took = started.elapsed();
        stats.sync_nanos.fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
        stats.record(took);
        match result {
            Ok(()) => {
                for done in batch.drain(..) {
                    done(Ok(()));
                }
            }
            Err(e) => {
                // Fail-stop: after a failed fsync the kernel may have dropped the
                // dirty pages, so a retry could "succeed" without the data. Never
                // report anything durable again in this process.
                if is_disk_full(&e) {
                    tracing::error!(error = %e, "disk full: a write of this sync failed; stopping the node (fail-stop)");
                } else {
                    tracing::error!(error = %e, "disk sync failed; stopping the node");
                }
                failed.store(true, Ordering::Release);
                on_fatal(&e);
                for done in batch.drain(..) {
                    done(Err(io::Error::new(e.kind(), e.to_string())));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    /// Succeeds `ok` times, then fails every time.
    struct FailAfter {
        ok: usize,
        calls: Arc<AtomicUsize>,
    }

    impl SyncTarget for FailAfter {
        fn sync(&mut self, _sled: bool) -> io::Result<()> {
            let n = self.calls.fetch_add(1, Ordering::SeqCst);
            if n < self.ok {
                Ok(())
            } else {
                Err(io::Error::other("EIO (injected)"))
            }
        }
    }

    #[test]
    fn a_failed_sync_fails_every_waiter_then_and_after() {
        let calls = Arc::new(AtomicUsize::new(0));
        let fatal = Arc::new(AtomicUsize::new(0));
        let f = fatal.clone();
        let (flusher, thread) = Flusher::with_target(FailAfter { ok: 1, calls: calls.clone() }, move |_| {
            f.fetch_add(1, Ordering::SeqCst);
        })
        .unwrap();
        assert!(flusher.sync_blocking().is_ok(), "first sync succeeds");
        let err = flusher.sync_blocking().unwrap_err();
        assert!(err.to_string().contains("EIO"), "{err}");
        assert!(flusher.has_failed());
        assert_eq!(fatal.load(Ordering::SeqCst), 1, "fatal raised once");
        // Fail-stop: never durable again, and the disk is not even asked.
        assert!(flusher.sync_blocking().is_err());
        assert!(flusher.sync_blocking().is_err());
        assert_eq!(calls.load(Ordering::SeqCst), 2, "no sync attempted after the failure");
        assert_eq!(fatal.load(Ordering::SeqCst), 1);
        flusher.stop();
        thread.join().unwrap();
    }

    #[test]
    fn one_sync_serves_every_waiter_queued_meanwhile() {
        let calls = Arc::new(AtomicUsize::new(0));
        struct Slow(Arc<AtomicUsize>);
        impl SyncTarget for Slow {
            fn sync(&mut self, _sled: bool) -> io::Result<()> {
                self.0.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(std::time::Duration::from_millis(200));
                Ok(())
            }
        }
        let (flusher, thread) = Flusher::with_target(Slow(calls.clone()), |_| {}).unwrap();
        let (tx, rx) = mpsc::channel();
        for _ in 0..100 {
            let tx = tx.clone();
            flusher.submit(Box::new(move |r| tx.send(r.is_ok()).unwrap()));
        }
        for _ in 0..100 {
            assert!(rx.recv().unwrap());
        }
        // The first waiter may be synced alone; the other 99 share at most one more.
        assert!(calls.load(Ordering::SeqCst) <= 2, "syncs: {}", calls.load(Ordering::SeqCst));
        flusher.stop();
        thread.join().unwrap();
    }

    #[test]
    fn held_syncs_complete_nothing_until_released() {
        struct Count(Arc<AtomicUsize>);
        impl SyncTarget for Count {
            fn sync(&mut self, _sled: bool) -> io::Result<()> {
                self.0.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        }
        let calls = Arc::new(AtomicUsize::new(0));
        let (flusher, thread) = Flusher::with_target(Count(calls.clone()), |_| {}).unwrap();
        let held = flusher.hold_syncs();
        let (tx, rx) = mpsc::channel();
        flusher.submit(Box::new(move |r| tx.send(r.is_ok()).unwrap()));
        let early = rx.recv_timeout(std::time::Duration::from_millis(200));
        assert!(early.is_err(), "a completion fired while syncs were held");
        assert_eq!(calls.load(Ordering::SeqCst), 0, "the disk was synced while held");
        drop(held);
        assert!(rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap());
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        flusher.stop();
        thread.join().unwrap();
    }

    /// sled writes a large value to a blob file of its own, then a pointer
    /// to it into its log (`db`). Once `db` is synced the pointer may
    /// survive a power loss: the blob must be on disk by then, its name in
    /// the blobs directory too. This checks the order of the syncs, which
    /// is all a test can see; it does not cut the power.
    #[test]
    fn blobs_are_synced_before_the_database_file_that_points_at_them() {
        let dir = tempfile::tempdir().unwrap();
        let sled_dir = dir.path().join("sled");
        let db = sled::Config::new().path(&sled_dir).segment_size(4 << 20).flush_every_ms(None).open().unwrap();
        let mut target = SledTarget::new(db.clone(), &sled_dir).unwrap();
        db.insert(b"small", b"v".to_vec()).unwrap();
        target.sync().unwrap();
        // Over a quarter segment: a blob file.
        db.insert(b"big", vec![7u8; 2 << 20]).unwrap();
        let blobs: Vec<std::ffi::OsString> =
            std::fs::read_dir(sled_dir.join("blobs")).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(!blobs.is_empty(), "sled wrote no blob file");
        target.trail.clear();
        target.sync().unwrap();
        let trail = target.trail.clone();
        let at =
            |step: &Step| trail.iter().position(|s| s == step).unwrap_or_else(|| panic!("{step:?} not in {trail:?}"));
        for name in &blobs {
            assert!(at(&Step::Blob(name.clone())) < at(&Step::Db), "blob {name:?} synced after db: {trail:?}");
        }
        assert!(at(&Step::BlobsDir) < at(&Step::Db), "blobs directory synced after db: {trail:?}");
        // Blobs written before the flush are listed after it.
        assert_eq!(at(&Step::Flush), 0, "{trail:?}");
        // Nothing new: db alone.
        db.insert(b"small", b"w".to_vec()).unwrap();
        target.trail.clear();
        target.sync().unwrap();
        assert_eq!(target.trail, vec![Step::Flush, Step::Db]);
    }

    #[test]
    fn sled_is_synced_only_in_rounds_with_a_waiter_that_needs_it() {
        struct Record(mpsc::Sender<bool>);
        impl SyncTarget for Record {
            fn sync(&mut self, sled: bool) -> io::Result<()> {
                self.0.send(sled).unwrap();
                Ok(())
            }
        }
        let (tx, rounds) = mpsc::channel();
        let (flusher, thread) = Flusher::with_target(Record(tx), |_| {}).unwrap();
        let (done_tx, done) = mpsc::channel();
        let d = done_tx.clone();
        flusher.submit_log(Box::new(move |r| d.send(r.is_ok()).unwrap()));
        assert!(done.recv().unwrap());
        assert!(!rounds.recv().unwrap(), "a log append alone leaves sled be");
        flusher.sync_blocking().unwrap();
        assert!(rounds.recv().unwrap(), "an explicit sync covers sled");
        flusher.stop();
        thread.join().unwrap();
    }
}
