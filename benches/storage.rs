//! Synced appends per second: one append per fsync versus group commit.
//!
//! `cargo bench --bench storage [-- DIR]` (DIR defaults to a temp dir on the
//! working directory's disk). Each append is a 1 KiB entry in the
//! write-ahead log made durable by the flusher (`fdatasync` of the log
//! segment), as `LogStore::append` does.

use std::sync::Arc;
use std::time::{Duration, Instant};

use mirrorq_storage::{DbOptions, NodeDb};

const VALUE: usize = 1024;

// Same allocator as the `mirrorq` binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let base = std::env::args().nth(1).filter(|a| !a.starts_with('-')).map(std::path::PathBuf::from);
    let dir = match &base {
        Some(b) => tempfile::tempdir_in(b).unwrap(),
        None => tempfile::tempdir_in(".").unwrap(),
    };
    let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
    let value = vec![7u8; VALUE];

    // One append, one sync, one at a time.
    let n = 2000u64;
    let t = Instant::now();
    for i in 0..n {
        db.wal().append(1, &[(i, value.clone())]).unwrap();
        db.flusher().sync_log().await.unwrap();
    }
    let serial = n as f64 / t.elapsed().as_secs_f64();
    println!("one append per sync:      {serial:>9.0} appends/s  ({n} appends, 1 KiB)");

    // Many writers (as many groups would be), one sync serving all waiting.
    for writers in [16u64, 256] {
        let before = (db.flusher().stats().syncs.load(std::sync::atomic::Ordering::Relaxed),);
        let dur = Duration::from_secs(5);
        let db2 = Arc::new(db.clone());
        let t = Instant::now();
        let mut tasks = Vec::new();
        for w in 0..writers {
            let (db, value) = (db2.clone(), value.clone());
            tasks.push(tokio::spawn(async move {
                let mut i = 0u64;
                while t.elapsed() < dur {
                    db.wal().append(100 + w, &[(i, value.clone())]).unwrap();
                    db.flusher().sync_log().await.unwrap();
                    i += 1;
                }
                i
            }));
        }
        let mut total = 0;
        for task in tasks {
            total += task.await.unwrap();
        }
        let secs = t.elapsed().as_secs_f64();
        let syncs = db.flusher().stats().syncs.load(std::sync::atomic::Ordering::Relaxed) - before.0;
        println!(
            "group commit, {writers:>3} writers: {:>9.0} appends/s  ({:.1} appends per sync, {:.0} syncs/s)",
            total as f64 / secs,
            total as f64 / syncs as f64,
            syncs as f64 / secs
        );
    }
}
