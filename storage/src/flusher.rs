//! Group commit: one `flush` + `fdatasync` serves every waiter present at that
//! moment, across all groups of the node.
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
use std::sync::{mpsc, Arc};
use std::time::Instant;

/// Called once with the outcome of the sync that covered the waiter's writes.
pub type Completion = Box<dyn FnOnce(io::Result<()>) + Send>;

enum Msg {
    Wait(Completion),
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
}

/// Handle to the flusher thread. Cloning shares the thread; the thread exits
/// when the last handle is dropped.
#[derive(Clone)]
pub struct Flusher {
    tx: mpsc::Sender<Msg>,
    failed: Arc<AtomicBool>,
    stats: Arc<FlusherStats>,
}

impl Flusher {
    /// Start the flusher for a sled database living in `dir`.
    ///
    /// `on_fatal` runs once, on the flusher thread, if a sync ever fails.
    pub fn start(
        db: sled::Db,
        dir: &Path,
        on_fatal: impl Fn(&io::Error) + Send + 'static,
    ) -> io::Result<(Self, std::thread::JoinHandle<()>)> {
        let data_file = File::open(dir.join("db"))?;
        let blobs = dir.join("blobs");
        let (tx, rx) = mpsc::channel::<Msg>();
        let failed = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(FlusherStats::default());
        let mut state = SyncTarget { db, data_file, blobs, synced_blobs: HashSet::new() };
        let (f2, s2) = (failed.clone(), stats.clone());
        let thread = std::thread::Builder::new()
            .name("mirrorq-flusher".into())
            .spawn(move || run(rx, &mut state, &f2, &s2, on_fatal))?;
        Ok((Self { tx, failed, stats }, thread))
    }

    /// Queue a completion behind the writes already made; it fires after the
    /// next sync. After a failed sync it fires at once with an error.
    pub fn submit(&self, done: Completion) {
        if self.failed.load(Ordering::Acquire) {
            done(Err(sync_failed()));
            return;
        }
        if let Err(mpsc::SendError(Msg::Wait(done))) = self.tx.send(Msg::Wait(done)) {
            done(Err(io::Error::other("flusher stopped")));
        }
    }

    /// Wait until everything written so far is durable.
    pub async fn sync(&self) -> io::Result<()> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit(Box::new(move |r| {
            let _ = tx.send(r);
        }));
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

    pub fn has_failed(&self) -> bool {
        self.failed.load(Ordering::Acquire)
    }

    pub fn stats(&self) -> &FlusherStats {
        &self.stats
    }
}

fn sync_failed() -> io::Error {
    io::Error::other("an earlier disk sync failed; node is stopping")
}

struct SyncTarget {
    db: sled::Db,
    data_file: File,
    /// sled writes values larger than a quarter segment to separate blob files
    /// and never syncs them; we do, once per new file.
    blobs: PathBuf,
    synced_blobs: HashSet<std::ffi::OsString>,
}

impl SyncTarget {
    fn sync(&mut self) -> io::Result<()> {
        self.db.flush().map_err(io::Error::other)?;
        self.data_file.sync_data()?;
        self.sync_new_blobs()
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
                    Ok(f) => f.sync_data()?,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                    Err(e) => return Err(e),
                }
                new_any = true;
            }
            present.insert(name);
        }
        if new_any {
            File::open(&self.blobs)?.sync_all()?;
        }
        self.synced_blobs = present;
        Ok(())
    }
}

fn run(
    rx: mpsc::Receiver<Msg>,
    target: &mut SyncTarget,
    failed: &AtomicBool,
    stats: &FlusherStats,
    on_fatal: impl Fn(&io::Error),
) {
    let mut batch: Vec<Completion> = Vec::with_capacity(256);
    let mut stopping = false;
    while !stopping {
        match rx.recv() {
            Ok(Msg::Wait(first)) => batch.push(first),
            Ok(Msg::Stop) | Err(_) => stopping = true,
        }
        while let Ok(more) = rx.try_recv() {
            match more {
                Msg::Wait(done) => batch.push(done),
                Msg::Stop => stopping = true,
            }
        }
        if batch.is_empty() {
            continue;
        }
        if failed.load(Ordering::Acquire) {
            for done in batch.drain(..) {
                done(Err(sync_failed()));
            }
            continue;
        }
        let started = Instant::now();
        let result = target.sync();
        stats.syncs.fetch_add(1, Ordering::Relaxed);
        stats.waiters.fetch_add(batch.len() as u64, Ordering::Relaxed);
        stats.sync_nanos.fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
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
                tracing::error!(error = %e, "disk sync failed; stopping the node");
                failed.store(true, Ordering::Release);
                on_fatal(&e);
                for done in batch.drain(..) {
                    done(Err(io::Error::new(e.kind(), e.to_string())));
                }
            }
        }
    }
}
