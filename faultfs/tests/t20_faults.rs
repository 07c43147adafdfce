//! Torn writes, corruption, failing syncs, a full disk, a slow disk.

mod common;

use std::fs::{self, OpenOptions};
use std::io::Write;
use std::time::{Duration, Instant};

use common::{write_synced, Mount};

/// `torn` keeps a prefix, in write order, of the unsynced writes: never
/// bytes out of order, and for some seeds neither nothing nor everything.
#[test]
fn t20_torn_keeps_a_prefix() {
    let Some(m) = Mount::start(false) else { return };
    let all: Vec<u8> = (0..4000u32).map(|i| b'a' + (i / 400) as u8).collect();
    let mut partial = 0;
    for seed in 1..=12u64 {
        write_synced(&m.p("log"), b"");
        {
            let mut f = OpenOptions::new().append(true).open(m.p("log")).unwrap();
            for chunk in all.chunks(400) {
                f.write_all(chunk).unwrap();
            }
        }
        m.ctl(&format!("torn {seed}"));
        let got = fs::read(m.p("log")).unwrap();
        assert_eq!(got[..], all[..got.len()], "seed {seed}: not a prefix");
        if !got.is_empty() && got.len() < all.len() {
            partial += 1;
        }
    }
    assert!(partial > 0, "no seed tore a write");
}

/// `torn` on random-offset writes keeps whole writes in order, the last cut.
#[test]
fn t21_torn_keeps_write_order() {
    let Some(m) = Mount::start(false) else { return };
    use std::os::unix::fs::FileExt;
    let mut seen_middle = false;
    for seed in 1..=12u64 {
        write_synced(&m.p("f"), &[b'.'; 300]);
        {
            let f = OpenOptions::new().write(true).open(m.p("f")).unwrap();
            f.write_all_at(&[b'3'; 100], 200).unwrap();
            f.write_all_at(&[b'1'; 100], 0).unwrap();
            f.write_all_at(&[b'2'; 100], 100).unwrap();
        }
        m.ctl(&format!("torn {seed}"));
        let got = fs::read(m.p("f")).unwrap();
        assert_eq!(got.len(), 300);
        let n = |c: u8| got.iter().filter(|b| **b == c).count();
        // Order 3, 1, 2: a later write landed only if all earlier did.
        if n(b'1') > 0 {
            assert_eq!(n(b'3'), 100, "seed {seed}: {:?}", String::from_utf8_lossy(&got));
        }
        if n(b'2') > 0 {
            assert_eq!(n(b'1'), 100, "seed {seed}");
        }
        if n(b'3') == 100 && n(b'2') < 100 {
            seen_middle = true;
        }
    }
    assert!(seen_middle, "every seed kept all or nothing of the later writes");
}

/// flip, zero and truncate show in the live view and survive a cut.
#[test]
fn t22_corruption_is_visible() {
    let Some(m) = Mount::start(false) else { return };
    write_synced(&m.p("f"), b"0123456789");
    m.ctl("flip f 3 0x01");
    assert_eq!(fs::read(m.p("f")).unwrap(), b"0122456789");
    m.ctl("zero f 5 2");
    assert_eq!(fs::read(m.p("f")).unwrap(), b"01224\x00\x00789");
    m.ctl("truncate f 8");
    assert_eq!(fs::read(m.p("f")).unwrap(), b"01224\x00\x007");
    m.ctl("cut");
    assert_eq!(fs::read(m.p("f")).unwrap(), b"01224\x00\x007");
    m.ctl_err("flip f 100");
    m.ctl_err("flip missing 0");
    m.ctl_err("bogus");
}

/// `fail-fsync N` fails the next N syncs with EIO, making nothing durable.
#[test]
fn t23_fail_fsync_gives_eio() {
    let Some(m) = Mount::start(false) else { return };
    write_synced(&m.p("f"), b"one");
    m.ctl("fail-fsync 1");
    let mut f = OpenOptions::new().append(true).open(m.p("f")).unwrap();
    f.write_all(b" two").unwrap();
    let err = f.sync_all().expect_err("fsync should fail");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    drop(f);
    m.ctl("cut");
    assert_eq!(fs::read(m.p("f")).unwrap(), b"one");
    // Only one failure was armed.
    write_synced(&m.p("f"), b"three");
    assert!(m.ctl("stats").contains("failed_syncs=1"));
}

/// `enospc BYTES` fails growing writes with ENOSPC until `enospc off`.
#[test]
fn t24_enospc_and_recovery() {
    let Some(m) = Mount::start(false) else { return };
    write_synced(&m.p("f"), &[1u8; 1000]);
    m.ctl("enospc 1500");
    let mut f = OpenOptions::new().append(true).open(m.p("f")).unwrap();
    f.write_all(&[2u8; 400]).unwrap();
    let err = f.write_all(&[3u8; 400]).expect_err("write past the limit");
    assert_eq!(err.raw_os_error(), Some(libc::ENOSPC), "{err}");
    m.ctl("enospc off");
    f.write_all(&[3u8; 400]).unwrap();
    f.sync_all().unwrap();
    assert_eq!(fs::metadata(m.p("f")).unwrap().len(), 1800);
}

/// `delay-fsync MS` slows each sync without stopping other requests.
#[test]
fn t25_delay_fsync_slows_only_syncs() {
    let Some(m) = Mount::start(false) else { return };
    write_synced(&m.p("f"), b"x");
    m.ctl("delay-fsync 1500");
    let path = m.p("f");
    let start = Instant::now();
    let syncer = std::thread::spawn(move || {
        fs::File::open(path).unwrap().sync_all().unwrap();
    });
    std::thread::sleep(Duration::from_millis(200));
    let t = Instant::now();
    assert_eq!(fs::read(m.p("f")).unwrap(), b"x");
    assert!(t.elapsed() < Duration::from_millis(1000), "reads blocked by a sleeping sync");
    syncer.join().unwrap();
    assert!(start.elapsed() >= Duration::from_millis(1500), "sync was not delayed");
    m.ctl("delay-fsync 0");
}

/// Free space in bytes for unprivileged writers, as `df` and a disk alarm read it.
fn avail(path: &std::path::Path) -> u64 {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: c is a valid path; st a writable statvfs.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &mut st) }, 0, "{}", std::io::Error::last_os_error());
    st.f_bavail as u64 * st.f_frsize as u64
}

/// While `enospc BYTES` is set, statvfs of the mount shows a disk of that
/// size filling with the files (what a program's disk alarm reads), and
/// the backing disk's free space again after `enospc off`.
#[test]
fn t27_statfs_follows_the_enospc_limit() {
    let Some(m) = Mount::start(false) else { return };
    write_synced(&m.p("f"), &[1u8; 100_000]);
    let real = avail(&m.backing);
    assert!(avail(&m.mnt).abs_diff(real) < 64 << 20, "unlimited: mount {} backing {real}", avail(&m.mnt));
    m.ctl("enospc 10000000");
    let free = avail(&m.mnt);
    // 10 MB less the 100 kB in use, rounded down to a block.
    assert!(free <= 9_900_000 && free > 9_900_000 - 65_536, "{free}");
    let mut f = OpenOptions::new().append(true).open(m.p("f")).unwrap();
    f.write_all(&[2u8; 1_000_000]).unwrap();
    let after = avail(&m.mnt);
    assert!(after <= 8_900_000 && after > 8_900_000 - 65_536, "{after}");
    // A limit above the backing disk's free space shows the real free space.
    m.ctl(&format!("enospc {}", u64::MAX / 2));
    assert!(avail(&m.mnt) <= avail(&m.backing) + (64 << 20));
    // Everything in use: nothing free.
    m.ctl("enospc 1000");
    assert_eq!(avail(&m.mnt), 0);
    m.ctl("enospc off");
    let back = avail(&m.mnt);
    assert!(back.abs_diff(avail(&m.backing)) < 64 << 20, "after enospc off: {back}");
    assert!(back > 10_000_000);
}
