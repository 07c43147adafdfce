//! Ordinary programs run on the mount: a mix of std::fs calls checked
//! against a model, and sled.

mod common;

use std::collections::BTreeMap;
use std::fs;
use std::io::Write;
use std::path::Path;

use common::Mount;
use rand::{Rng, SeedableRng};

/// The tree under `root` as path -> content ("->target" for symlinks,
/// "/" for directories).
fn snapshot(root: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.pop() {
        for e in fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            let ft = e.file_type().unwrap();
            if ft.is_dir() {
                out.insert(rel, b"/".to_vec());
                todo.push(p);
            } else if ft.is_symlink() {
                let t = fs::read_link(&p).unwrap();
                out.insert(rel, format!("->{}", t.display()).into_bytes());
            } else {
                out.insert(rel, fs::read(&p).unwrap());
            }
        }
    }
    out
}

/// 400 random file operations (create, append, overwrite, truncate,
/// rename over, hard link, symlink, unlink, mkdir, fsync) leave the same
/// tree as on a plain directory; after `sync-all` and `cut` it is still
/// the same.
#[test]
fn t30_plain_program_matches_a_plain_dir() {
    let Some(m) = Mount::start(false) else { return };
    let plain = tempfile::tempdir().unwrap();
    for root in [m.mnt.as_path(), plain.path()] {
        let mut rng = rand::rngs::StdRng::seed_from_u64(30);
        for d in ["a", "b"] {
            fs::create_dir(root.join(d)).unwrap();
        }
        for i in 0..400u32 {
            let dir = ["a", "b", "."][rng.gen_range(0..3)];
            let name = format!("{dir}/f{}", rng.gen_range(0..8));
            let p = root.join(&name);
            match rng.gen_range(0..10) {
                0 | 1 => fs::write(&p, format!("created {i}")).unwrap(),
                2 | 3 => {
                    let mut f = fs::OpenOptions::new().create(true).append(true).open(&p).unwrap();
                    f.write_all(format!(" +{i}").as_bytes()).unwrap();
                    if rng.gen_bool(0.5) {
                        f.sync_data().unwrap();
                    }
                }
                4 => {
                    if p.is_file() {
                        let f = fs::OpenOptions::new().write(true).open(&p).unwrap();
                        f.set_len(rng.gen_range(0..6)).unwrap();
                    }
                }
                5 => {
                    let to = root.join(format!("{}/f{}", ["a", "b"][rng.gen_range(0..2)], rng.gen_range(0..8)));
                    if p.symlink_metadata().is_ok() && to != p {
                        fs::rename(&p, &to).unwrap();
                    }
                }
                6 => {
                    let to = root.join(format!("{dir}/l{}", rng.gen_range(0..3)));
                    if p.is_file() && to.symlink_metadata().is_err() {
                        fs::hard_link(&p, &to).unwrap();
                    }
                }
                7 => {
                    let to = root.join(format!("{dir}/s{}", rng.gen_range(0..3)));
                    if to.symlink_metadata().is_err() {
                        std::os::unix::fs::symlink(format!("f{i}"), &to).unwrap();
                    }
                }
                8 => {
                    if p.symlink_metadata().is_ok() {
                        fs::remove_file(&p).unwrap();
                    }
                }
                _ => {
                    let d = root.join(format!("{dir}/d{}", rng.gen_range(0..3)));
                    if d.symlink_metadata().is_err() {
                        fs::create_dir(&d).unwrap();
                        fs::write(d.join("inner"), format!("{i}")).unwrap();
                    }
                }
            }
        }
    }
    let want = snapshot(plain.path());
    assert!(want.len() > 10, "too little happened: {want:?}");
    assert_eq!(snapshot(&m.mnt), want);
    assert_eq!(snapshot(&m.backing), want);
    m.ctl("sync-all");
    m.ctl("cut");
    assert_eq!(snapshot(&m.mnt), want, "sync-all did not make everything durable");
}

/// Inserts 500 keys and flushes, inserts 100 more without, cuts, and
/// checks the flushed keys are back and the db still works.
fn sled_round(m: &Mount, strict_dir_syncs: bool) {
    let path = m.p("db");
    {
        let db = sled::open(&path).unwrap();
        if strict_dir_syncs {
            // sled 0.34 never fsyncs a directory: its names are durable only
            // where the filesystem commits them with a file's fsync (ext4).
            m.sync_dir(".");
            m.sync_dir("db");
        }
        for i in 0..500u32 {
            db.insert(i.to_be_bytes(), vec![7u8; 100]).unwrap();
        }
        db.flush().unwrap();
        for i in 500..600u32 {
            db.insert(i.to_be_bytes(), vec![8u8; 100]).unwrap();
        }
    }
    m.ctl("cut");
    let db = sled::open(&path).unwrap();
    for i in 0..500u32 {
        assert_eq!(db.get(i.to_be_bytes()).unwrap().as_deref(), Some(&[7u8; 100][..]), "flushed key {i} lost");
    }
    db.insert(b"after", b"cut").unwrap();
    db.flush().unwrap();
}

/// sled runs on the mount (ext4-like mode): what it flushed survives a
/// cut, and it reopens after one.
#[test]
fn t31_sled_survives_cut() {
    let Some(m) = Mount::start(false) else { return };
    sled_round(&m, false);
}

/// Strict mode: sled's files survive only with its directories synced,
/// which sled itself never does (a fresh db vanishes whole otherwise).
#[test]
fn t32_sled_strict_needs_dir_syncs() {
    let Some(m) = Mount::start(true) else { return };
    {
        let db = sled::open(m.p("db")).unwrap();
        db.insert(b"k", b"v").unwrap();
        db.flush().unwrap();
    }
    m.ctl("cut");
    assert!(!m.p("db").exists(), "strict mode kept names never synced");
    sled_round(&m, true);
}
