//! The disk's floor under a confirm at one message in flight: three replicas
//! on one machine, each appending a small record and `fdatasync`ing it at the
//! same moment, as the master and both mirrors do for every message.
//!
//! `cargo bench --bench disk_floor [-- DIR [ROUNDS]]` (DIR defaults to a
//! temp dir on the working directory's disk; 3000 rounds). Each writer has
//! its own preallocated file, as each node has its own write-ahead log
//! segment. Per round it reports when the *first*, the *second* (a Raft
//! majority: what a RabbitMQ quorum queue's confirm waits for) and the
//! *last* (every replica: what a mirrorq confirm waits for) sync returned.
//! No network, no Raft, no client: whatever a broker adds comes on top.
//!
//! Then the disk's bandwidth for the same three writers, each appending
//! 256 KiB (a full Raft entry of 4 KiB messages) and syncing it, over and
//! over for five seconds: the ceiling of a replicated 4 KiB stream when
//! every replica writes every body once.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::os::unix::io::AsRawFd;
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;

const RECORD: usize = 200;
const FILE_BYTES: u64 = 64 << 20;

/// How a writer's file gets its blocks before the appends.
#[derive(Clone, Copy, Debug)]
enum Fill {
    /// `fallocate`: blocks reserved as unwritten extents; the first write to
    /// each block changes the extent tree, which `fdatasync` must commit
    /// through the file system's journal.
    Fallocated,
    /// Zeros written and synced beforehand: appends overwrite blocks that
    /// are already written, and `fdatasync` has no metadata to commit.
    Written,
}

/// Reserve the file's blocks, unwritten.
fn reserve(f: &File) {
    // SAFETY: plain syscall on a descriptor `f` keeps open.
    let rc = unsafe { libc::fallocate(f.as_raw_fd(), 0, 0, FILE_BYTES as libc::off_t) };
    assert_eq!(rc, 0, "fallocate: {}", std::io::Error::last_os_error());
}

fn preallocated(path: &std::path::Path, fill: Fill) -> File {
    let f = OpenOptions::new().read(true).write(true).create(true).truncate(true).open(path).unwrap();
    match fill {
        Fill::Fallocated => reserve(&f),
        Fill::Written => {
            let zeros = vec![0u8; 1 << 20];
            for at in (0..FILE_BYTES).step_by(zeros.len()) {
                f.write_all_at(&zeros, at).unwrap();
            }
        }
    }
    f.sync_all().unwrap();
    f
}

/// `writers` threads append and sync together `rounds` times; per round,
/// the time from the start until the k-th sync returned, for each k.
fn run(dir: &std::path::Path, fill: Fill, writers: usize, rounds: usize) -> Vec<Histogram<u64>> {
    let start = Arc::new(Barrier::new(writers + 1));
    let (tx, rx) = std::sync::mpsc::channel::<Instant>();
    let threads: Vec<_> = (0..writers)
        .map(|w| {
            let file = preallocated(&dir.join(format!("replica-{w}")), fill);
            let (start, tx) = (start.clone(), tx.clone());
            std::thread::spawn(move || {
                let record = [0x5au8; RECORD];
                for r in 0..rounds {
                    start.wait();
                    file.write_all_at(&record, (r * RECORD) as u64 % FILE_BYTES).unwrap();
                    file.sync_data().unwrap();
                    tx.send(Instant::now()).unwrap();
                }
            })
        })
        .collect();
    let mut hists: Vec<Histogram<u64>> = (0..writers).map(|_| Histogram::new(3).unwrap()).collect();
    for _ in 0..rounds {
        start.wait();
        let began = Instant::now();
        let mut done: Vec<Duration> = (0..writers).map(|_| rx.recv().unwrap() - began).collect();
        done.sort();
        for (k, d) in done.iter().enumerate() {
            hists[k].record(d.as_micros() as u64).unwrap();
        }
    }
    for t in threads {
        t.join().unwrap();
    }
    hists
}

/// `writers` threads each append `chunk` bytes and sync, for `secs`; bytes
/// made durable per second, all writers together.
fn bandwidth(dir: &std::path::Path, fill: Fill, writers: usize, chunk: usize, secs: u64) -> (f64, Histogram<u64>) {
    let until = Instant::now() + Duration::from_secs(secs);
    let threads: Vec<_> = (0..writers)
        .map(|w| {
            let file = preallocated(&dir.join(format!("stream-{w}")), fill);
            std::thread::spawn(move || {
                let data = vec![0x5au8; chunk];
                let mut at = 0u64;
                let mut written = 0u64;
                let mut lat = Histogram::<u64>::new(3).unwrap();
                while Instant::now() < until {
                    file.write_all_at(&data, at).unwrap();
                    let t = Instant::now();
                    file.sync_data().unwrap();
                    lat.record(t.elapsed().as_micros() as u64).unwrap();
                    at += chunk as u64;
                    if at + chunk as u64 > FILE_BYTES {
                        // The next segment: a fresh reservation, or the
                        // same written blocks again (a recycled segment).
                        at = 0;
                        if let Fill::Fallocated = fill {
                            file.set_len(0).unwrap();
                            reserve(&file);
                        }
                    }
                    written += chunk as u64;
                }
                (written, lat)
            })
        })
        .collect();
    let mut all = Histogram::<u64>::new(3).unwrap();
    let mut total = 0u64;
    for t in threads {
        let (w, lat) = t.join().unwrap();
        total += w;
        all.add(lat).unwrap();
    }
    (total as f64 / secs as f64, all)
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with('-')).collect();
    let dir = match args.first() {
        Some(b) => tempfile::tempdir_in(b).unwrap(),
        None => tempfile::tempdir_in(".").unwrap(),
    };
    let rounds: usize = args.get(1).and_then(|r| r.parse().ok()).unwrap_or(3000);
    let ms = |h: &Histogram<u64>, q: f64| h.value_at_quantile(q) as f64 / 1000.0;
    for fill in [Fill::Fallocated, Fill::Written] {
        println!(
            "{fill:?} files: {RECORD} B append + fdatasync per writer, writers starting together, {rounds} rounds"
        );
        for writers in 1..=3 {
            let hists = run(dir.path(), fill, writers, rounds);
            for (k, h) in hists.iter().enumerate() {
                let what = match (writers, k + 1) {
                    (1, _) => "the sync",
                    (_, n) if n == writers => "all syncs",
                    (_, 1) => "first sync",
                    _ => "second sync (majority of 3)",
                };
                println!(
                    "  {writers} writer(s), {what:<28} p50 {:>6.3} ms  p90 {:>6.3} ms  p99 {:>6.3} ms  -> at most {:>5.0} rounds/s at p50",
                    ms(h, 0.5),
                    ms(h, 0.9),
                    ms(h, 0.99),
                    1000.0 / ms(h, 0.5)
                );
            }
        }
        for chunk in [32 << 10, 256 << 10] {
            let (mb, lat) = bandwidth(dir.path(), fill, 3, chunk, 5);
            // A 4 KiB message is about 4.2 KB in a replica's log record.
            println!(
                "  3 writers, {} KiB appends + fdatasync: {:.0} MB/s in all, sync p50 {:.3} ms p99 {:.3} ms -> at most {:.0} msg/s of 4 KiB with every replica writing each body once",
                chunk >> 10,
                mb / 1e6,
                ms(&lat, 0.5),
                ms(&lat, 0.99),
                mb / (3.0 * 4200.0)
            );
        }
    }
}
