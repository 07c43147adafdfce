//! Making names durable: a file's `fsync` keeps its bytes, not its name.
//! A created, renamed or removed entry survives a power cut only once its
//! directory is synced, so every such change something relies on goes
//! through [`sync_dir`].
//!
//! For tests, the power cut of `NodeDb::crash_for_tests` (with
//! `keep_crash_image`) also loses what was never synced here: each
//! directory under the data dir is put back to the entries it held at its
//! last [`sync_dir`] (or when the data dir was opened, for one that
//! existed then; empty for one made since and never synced), and a file
//! made since the open whose bytes were never synced, by [`sync_file`] or
//! by their owner (log segments, sled's `db` and snapshots; see
//! [`contents_kept_elsewhere`]), loses them.

use std::fs::File;
use std::io;
use std::path::Path;

/// Make `dir`'s entries durable (a file created, renamed or removed in it).
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()?;
    #[cfg(any(test, feature = "test-hooks"))]
    model::synced_dir(dir);
    Ok(())
}

/// Make the file at `path` durable, bytes and size.
pub(crate) fn sync_file(path: &Path) -> io::Result<()> {
    let f = File::open(path)?;
    f.sync_all()?;
    #[cfg(any(test, feature = "test-hooks"))]
    model::synced_file(&f);
    Ok(())
}

/// Create `dir` (and its missing parents) durably: each new level's entry
/// is synced in its parent. Returns whether `dir` was made.
pub(crate) fn create_dir_durably(dir: &Path) -> io::Result<bool> {
    if dir.is_dir() {
        return Ok(false);
    }
    // A relative one-level path's parent is the working directory.
    if let Some(parent) = dir.parent().map(|p| if p.as_os_str().is_empty() { Path::new(".") } else { p }) {
        create_dir_durably(parent)?;
        match std::fs::create_dir(dir) {
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => return Ok(false),
            r => r?,
        }
        sync_dir(parent)?;
    } else {
        std::fs::create_dir_all(dir)?;
    }
    Ok(true)
}

/// Files whose bytes a test's crash already models, or which their owner
/// syncs itself: their names are still at stake, not their bytes.
#[cfg(any(test, feature = "test-hooks"))]
pub(crate) fn contents_kept_elsewhere(file: &File) {
    model::synced_file(file);
}

#[cfg(any(test, feature = "test-hooks"))]
pub(crate) use model::{baseline, lose_unsynced};

#[cfg(any(test, feature = "test-hooks"))]
mod model {
    use std::collections::{HashMap, HashSet};
    use std::ffi::OsString;
    use std::fs::File;
    use std::io;
    use std::os::unix::fs::MetadataExt;
    use std::path::Path;
    use std::sync::{LazyLock, Mutex};

    #[derive(Default)]
    struct Durable {
        /// Each directory's entries as of its last sync, by its (device,
        /// inode): a directory renamed after its sync (`sled.new`) keeps them.
        dirs: HashMap<(u64, u64), HashSet<OsString>>,
        /// Files (device, inode) whose bytes were synced (or are modeled
        /// elsewhere): by inode, so that a rename keeps them.
        files: HashSet<(u64, u64)>,
    }

    static DURABLE: LazyLock<Mutex<Durable>> = LazyLock::new(Mutex::default);

    fn names(dir: &Path) -> HashSet<OsString> {
        std::fs::read_dir(dir).map(|d| d.filter_map(|e| e.ok()).map(|e| e.file_name()).collect()).unwrap_or_default()
    }

    fn key(dir: &Path) -> (u64, u64) {
        std::fs::metadata(dir).map(|m| (m.dev(), m.ino())).unwrap_or_default()
    }

    pub(super) fn synced_dir(dir: &Path) {
        let listed = names(dir);
        DURABLE.lock().expect("poisoned").dirs.insert(key(dir), listed);
    }

    pub(super) fn synced_file(f: &File) {
        if let Ok(m) = f.metadata() {
            DURABLE.lock().expect("poisoned").files.insert((m.dev(), m.ino()));
        }
    }

    /// Take what is under `root` now as durable: what a process before
    /// this one left there.
    pub(crate) fn baseline(root: &Path) -> io::Result<()> {
        let mut durable = DURABLE.lock().expect("poisoned");
        let mut dirs = vec![root.to_owned()];
        while let Some(dir) = dirs.pop() {
            let mut listed = HashSet::new();
            for e in std::fs::read_dir(&dir)? {
                let e = e?;
                let m = e.metadata()?;
                if m.is_dir() {
                    dirs.push(e.path());
                } else {
                    durable.files.insert((m.dev(), m.ino()));
                }
                listed.insert(e.file_name());
            }
            durable.dirs.insert(key(&dir), listed);
        }
        Ok(())
    }

    /// The power cut: under `root`, every entry no directory sync covered
    /// goes, and every file kept that was made since [`baseline`] and
    /// never synced is emptied.
    pub(crate) fn lose_unsynced(root: &Path) -> io::Result<()> {
        let durable = DURABLE.lock().expect("poisoned");
        let empty = HashSet::new();
        let mut dirs = vec![root.to_owned()];
        while let Some(dir) = dirs.pop() {
            let kept = durable.dirs.get(&key(&dir)).unwrap_or(&empty);
            for e in std::fs::read_dir(&dir)? {
                let e = e?;
                let m = e.metadata()?;
                if !kept.contains(&e.file_name()) {
                    tracing::info!(entry = %e.path().display(), "crash: an entry whose directory was never synced is lost");
                    if m.is_dir() {
                        std::fs::remove_dir_all(e.path())?;
                    } else {
                        std::fs::remove_file(e.path())?;
                    }
                } else if m.is_dir() {
                    dirs.push(e.path());
                } else if !durable.files.contains(&(m.dev(), m.ino())) && m.len() > 0 {
                    tracing::info!(file = %e.path().display(), "crash: a file never synced loses its bytes");
                    std::fs::OpenOptions::new().write(true).open(e.path())?.set_len(0)?;
                }
            }
        }
        Ok(())
    }
}
