//! A real faultfs mount in a tempdir for one test; unmounted on drop.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// One running `faultfs mount`.
pub struct Mount {
    /// Holds backing/, mnt/, state/ and the socket; removed last.
    _dir: tempfile::TempDir,
    pub mnt: PathBuf,
    pub backing: PathBuf,
    ctl: PathBuf,
    child: Child,
}

fn mounted(mnt: &Path) -> bool {
    let m = mnt.to_string_lossy().into_owned();
    std::fs::read_to_string("/proc/self/mounts")
        .map(|s| s.lines().any(|l| l.split(' ').nth(1) == Some(m.as_str())))
        .unwrap_or(false)
}

impl Mount {
    /// Mounts a fresh tree, or returns None (with a message) where FUSE
    /// cannot be used: not root, or no /dev/fuse.
    pub fn start(strict: bool) -> Option<Mount> {
        Self::start_with(strict, |_| {})
    }

    /// As `start`, with `seed` filling BACKING before the mount.
    pub fn start_with(strict: bool, seed: impl FnOnce(&Path)) -> Option<Mount> {
        // SAFETY: geteuid has no preconditions.
        if unsafe { libc::geteuid() } != 0 || !Path::new("/dev/fuse").exists() {
            eprintln!("skipped: faultfs tests need root and /dev/fuse");
            return None;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let backing = dir.path().join("backing");
        let mnt = dir.path().join("mnt");
        let ctl = dir.path().join("ctl.sock");
        std::fs::create_dir(&backing).unwrap();
        std::fs::create_dir(&mnt).unwrap();
        seed(&backing);
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_faultfs"));
        cmd.arg("mount")
            .arg("--backing")
            .arg(&backing)
            .arg("--mountpoint")
            .arg(&mnt)
            .arg("--control")
            .arg(&ctl)
            .arg("--state")
            .arg(dir.path().join("state"))
            .stdin(Stdio::null());
        if strict {
            cmd.arg("--strict");
        }
        let child = cmd.spawn().expect("spawn faultfs");
        let m = Mount { _dir: dir, mnt, backing, ctl, child };
        let deadline = Instant::now() + Duration::from_secs(20);
        while !(m.ctl.exists() && mounted(&m.mnt)) {
            assert!(Instant::now() < deadline, "faultfs did not mount");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(m)
    }

    pub fn p(&self, rel: &str) -> PathBuf {
        self.mnt.join(rel)
    }

    /// Runs a control command that must succeed; its answer after `ok`.
    pub fn ctl(&self, cmd: &str) -> String {
        let answer = faultfs::control::request(&self.ctl, cmd).expect("control socket");
        assert!(answer.starts_with("ok"), "{cmd}: {answer}");
        answer
    }

    /// Runs a control command that must fail.
    pub fn ctl_err(&self, cmd: &str) -> String {
        let answer = faultfs::control::request(&self.ctl, cmd).expect("control socket");
        assert!(answer.starts_with("err"), "{cmd}: {answer}");
        answer
    }

    /// Syncs the directory `rel` (FSYNCDIR).
    pub fn sync_dir(&self, rel: &str) {
        std::fs::File::open(self.p(rel)).unwrap().sync_all().unwrap();
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        // SAFETY: signalling our own child by pid.
        unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if mounted(&self.mnt) {
            let _ = Command::new("umount").arg("-l").arg(&self.mnt).status();
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Writes `data` to `path` and fsyncs it.
pub fn write_synced(path: &Path, data: &[u8]) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    f.write_all(data).unwrap();
    f.sync_all().unwrap();
}
