//! What a power cut keeps: synced data and names, nothing else.

mod common;

use std::fs::{self, OpenOptions};
use std::io::Write;

use common::{write_synced, Mount};

/// An unsynced write, and a file never synced, are gone after `cut`.
#[test]
fn t10_unsynced_write_is_lost_on_cut() {
    let Some(m) = Mount::start(false) else { return };
    write_synced(&m.p("f"), b"durable");
    {
        let mut f = OpenOptions::new().append(true).open(m.p("f")).unwrap();
        f.write_all(b" and lost").unwrap();
    }
    fs::write(m.p("never"), b"not synced").unwrap();
    assert_eq!(fs::read(m.p("f")).unwrap(), b"durable and lost");
    m.ctl("cut");
    assert_eq!(fs::read(m.p("f")).unwrap(), b"durable");
    assert!(!m.p("never").exists(), "a never-synced file survived");
    // The mount stays usable.
    write_synced(&m.p("after"), b"ok");
    assert_eq!(fs::read(m.p("after")).unwrap(), b"ok");
}

/// fsync'd data survives `cut`, in a subdirectory and over many writes.
#[test]
fn t11_fsync_survives_cut() {
    let Some(m) = Mount::start(false) else { return };
    fs::create_dir(m.p("d")).unwrap();
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    write_synced(&m.p("d/big"), &data);
    m.ctl("cut");
    assert_eq!(fs::read(m.p("d/big")).unwrap(), data);
    // Unsynced overwrite in the middle and a truncate are undone.
    {
        let f = OpenOptions::new().write(true).open(m.p("d/big")).unwrap();
        use std::os::unix::fs::FileExt;
        f.write_all_at(b"XXXX", 1000).unwrap();
        f.set_len(5000).unwrap();
    }
    m.ctl("cut");
    assert_eq!(fs::read(m.p("d/big")).unwrap(), data);
    let stats = m.ctl("stats");
    assert!(stats.contains("cuts=2"), "{stats}");
}

/// Strict mode: a synced file whose directory was not synced loses its
/// name; with the directory synced it keeps it.
#[test]
fn t12_strict_needs_dir_fsync() {
    let Some(m) = Mount::start(true) else { return };
    fs::create_dir(m.p("d")).unwrap();
    m.sync_dir(".");
    write_synced(&m.p("d/f"), b"data");
    m.ctl("cut");
    assert!(m.p("d").is_dir(), "synced directory lost");
    assert!(!m.p("d/f").exists(), "name survived without a dir fsync");

    write_synced(&m.p("d/f"), b"data");
    m.sync_dir("d");
    m.ctl("cut");
    assert_eq!(fs::read(m.p("d/f")).unwrap(), b"data");
}

/// Default mode: any fsync commits the whole namespace, but a file's
/// contents only as last synced.
#[test]
fn t13_default_mode_commits_names_not_data() {
    let Some(m) = Mount::start(false) else { return };
    fs::create_dir(m.p("d")).unwrap();
    fs::write(m.p("d/unsynced"), b"contents").unwrap();
    write_synced(&m.p("other"), b"x");
    m.ctl("cut");
    assert!(m.p("d/unsynced").exists(), "name not committed by an fsync");
    assert_eq!(fs::read(m.p("d/unsynced")).unwrap(), b"");
}

/// A rename is durable only once synced; the content follows the file
/// (by inode), and an overwriting rename replaces the target.
#[test]
fn t14_rename_durability() {
    let Some(m) = Mount::start(true) else { return };
    write_synced(&m.p("a"), b"content of a");
    m.sync_dir(".");
    fs::rename(m.p("a"), m.p("b")).unwrap();
    m.ctl("cut");
    assert_eq!(fs::read(m.p("a")).unwrap(), b"content of a");
    assert!(!m.p("b").exists());

    fs::rename(m.p("a"), m.p("b")).unwrap();
    m.sync_dir(".");
    m.ctl("cut");
    assert!(!m.p("a").exists());
    assert_eq!(fs::read(m.p("b")).unwrap(), b"content of a");

    // The write-temp-then-rename idiom.
    write_synced(&m.p("tmp"), b"new b");
    fs::rename(m.p("tmp"), m.p("b")).unwrap();
    m.ctl("cut");
    assert_eq!(fs::read(m.p("b")).unwrap(), b"content of a", "rename durable unsynced");
    write_synced(&m.p("tmp"), b"new b");
    fs::rename(m.p("tmp"), m.p("b")).unwrap();
    m.sync_dir(".");
    m.ctl("cut");
    assert_eq!(fs::read(m.p("b")).unwrap(), b"new b");
    assert!(!m.p("tmp").exists());
}

/// A file present in BACKING before the mount is durable, and keeps its
/// content when unlinked without a sync.
#[test]
fn t15_preexisting_files_are_durable() {
    let Some(m) = Mount::start_with(false, |b| {
        fs::create_dir(b.join("old")).unwrap();
        fs::write(b.join("old/keep"), b"from before").unwrap();
    }) else {
        return;
    };
    fs::remove_file(m.p("old/keep")).unwrap();
    fs::write(m.p("old/new"), b"x").unwrap();
    m.ctl("cut");
    assert_eq!(fs::read(m.p("old/keep")).unwrap(), b"from before");
    assert!(!m.p("old/new").exists());
}
