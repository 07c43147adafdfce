//! Resource alarms, as RabbitMQ raises them: when the node's memory use
//! goes over its high watermark or the free space on its data dir's disk
//! under its limit, publishers are blocked (`connection.blocked`, and the
//! node stops reading their sockets so TCP pushes back) until it clears.
//! Consumers keep going: draining queues is what frees memory and disk.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// RabbitMQ's defaults.
pub const DEFAULT_MEMORY_FRACTION: f64 = 0.4;
pub const DEFAULT_DISK_FREE_LIMIT: u64 = 50_000_000;

/// How often the readings are taken.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// The memory high watermark: a fraction of the machine's memory or bytes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Watermark {
    Fraction(f64),
    Bytes(u64),
}

impl Default for Watermark {
    fn default() -> Self {
        Watermark::Fraction(DEFAULT_MEMORY_FRACTION)
    }
}

impl Watermark {
    /// `0.4` (a fraction of total memory, below 1) or a byte count (`0`
    /// blocks every publisher, as in RabbitMQ).
    pub fn parse(s: &str) -> Result<Self, String> {
        let s = s.trim();
        if let Ok(n) = s.parse::<u64>() {
            return Ok(Watermark::Bytes(n));
        }
        match s.parse::<f64>() {
            Ok(f) if f.is_finite() && f > 0.0 && f < 1.0 => Ok(Watermark::Fraction(f)),
            _ => Err(format!("'{s}' is neither a fraction of memory between 0 and 1 nor a number of bytes")),
        }
    }

    /// `None` when the machine's memory cannot be read (no alarm then).
    fn bytes(self) -> Option<u64> {
        match self {
            Watermark::Bytes(b) => Some(b),
            Watermark::Fraction(f) => total_memory().map(|t| (t as f64 * f) as u64),
        }
    }
}

/// What the node measured last, in RabbitMQ's `/api/nodes` terms.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Readings {
    pub mem_used: u64,
    pub mem_limit: u64,
    pub mem_alarm: bool,
    pub disk_free: u64,
    pub disk_free_limit: u64,
    pub disk_free_alarm: bool,
}

impl Readings {
    /// Why publishers are blocked, if they are (RabbitMQ's reasons).
    pub fn reason(&self) -> Option<String> {
        match (self.mem_alarm, self.disk_free_alarm) {
            (false, false) => None,
            (true, false) => Some("low on memory".into()),
            (false, true) => Some("low on disk".into()),
            (true, true) => Some("low on memory and disk".into()),
        }
    }
}

pub struct Alarms {
    data_dir: PathBuf,
    limits: Mutex<(Watermark, u64)>,
    /// Set when a write met a full disk ([`Alarms::disk_full`]): the free
    /// space beyond the limit the disk alarm then waits for.
    disk_full: Mutex<Option<u64>>,
    readings: watch::Sender<Readings>,
}

impl Alarms {
    pub fn new(data_dir: impl Into<PathBuf>, memory: Watermark, disk_free_limit: u64) -> Self {
        let a = Self {
            data_dir: data_dir.into(),
            limits: Mutex::new((memory, disk_free_limit)),
            disk_full: Mutex::new(None),
            readings: watch::channel(Readings::default()).0,
        };
        a.check();
        a
    }

    /// The readings, announced whenever an alarm goes on or off.
    pub fn subscribe(&self) -> watch::Receiver<Readings> {
        self.readings.subscribe()
    }

    pub fn readings(&self) -> Readings {
        *self.readings.borrow()
    }

    /// Change the limits (`rabbitmqctl set_vm_memory_high_watermark`,
    /// `set_disk_free_limit`) and check at once.
    pub fn set_limits(&self, memory: Watermark, disk_free_limit: u64) {
        *self.limits.lock().expect("poisoned") = (memory, disk_free_limit);
        self.check();
    }

    /// A write met a full disk (`ENOSPC`) although the last reading was
    /// above the limit (a new write-ahead log segment reserves 64 MiB at
    /// once): raise the disk alarm now, and keep it until `need` bytes are
    /// free beyond the limit, so that publishers do not come back only to
    /// meet the same full disk. A quota that the file system's free space
    /// does not show is not seen this way: the next reading clears it.
    pub fn disk_full(&self, need: u64) {
        // Said when it starts, not at every write it refuses.
        if self.disk_full.lock().expect("poisoned").replace(need).is_none() {
            tracing::warn!(
                need,
                "a write met a full disk: disk alarm raised until the free space is above the limit by this much"
            );
        }
        self.check();
    }

    /// Take the readings now; raise or clear alarms.
    pub fn check(&self) -> Readings {
        let (memory, disk_limit) = *self.limits.lock().expect("poisoned");
        let mem_used = resident_bytes().unwrap_or(0);
        let mem_limit = memory.bytes();
        let disk_free = free_bytes(&self.data_dir).unwrap_or(u64::MAX);
        let disk_free_alarm = {
            let mut full = self.disk_full.lock().expect("poisoned");
            match *full {
                Some(need) if disk_free < disk_limit.saturating_add(need) => true,
                _ => {
                    *full = None;
                    disk_free < disk_limit
                }
            }
        };
        let r = Readings {
            mem_used,
            mem_limit: mem_limit.unwrap_or(u64::MAX),
            // As RabbitMQ: a watermark of 0 blocks every publisher.
            mem_alarm: mem_limit.is_some_and(|l| mem_used > l || l == 0),
            disk_free,
            disk_free_limit: disk_limit,
            disk_free_alarm,
        };
        let before = self.readings();
        if r.mem_alarm != before.mem_alarm || r.disk_free_alarm != before.disk_free_alarm {
            match r.reason() {
                Some(why) => tracing::warn!(
                    mem_used,
                    mem_limit,
                    disk_free,
                    disk_limit,
                    "resource alarm: {why}; publishers blocked"
                ),
                None => tracing::info!(mem_used, disk_free, "resource alarms cleared; publishers unblocked"),
            }
            self.readings.send_replace(r);
        } else {
            // Numbers only: no one needs waking.
            self.readings.send_if_modified(|old| {
                *old = r;
                false
            });
        }
        r
    }

    /// Check every second until `stop`.
    pub fn spawn(self: std::sync::Arc<Self>, stop: CancellationToken) {
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(CHECK_EVERY) => {}
                }
                self.check();
            }
        });
    }
}

/// This process's resident memory.
fn resident_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    Some(pages * u64::try_from(page).ok()?)
}

fn total_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Free space for unprivileged writers on the file system holding `dir`.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: `path` is a valid NUL-terminated string and `st` a properly
    // sized, writable statvfs that the call fills in.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(path.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(st.f_bavail as u64 * st.f_frsize as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn watermarks_parse_as_fraction_or_bytes() {
        assert_eq!(Watermark::parse("0.4"), Ok(Watermark::Fraction(0.4)));
        assert_eq!(Watermark::parse("1073741824"), Ok(Watermark::Bytes(1 << 30)));
        assert_eq!(Watermark::parse("0"), Ok(Watermark::Bytes(0)));
        for bad in ["1.5", "-0.1", "0.0", "lots", "NaN"] {
            assert!(Watermark::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn alarms_go_on_and_off_with_the_limits() {
        let dir = tempfile::tempdir().unwrap();
        let a = Alarms::new(dir.path(), Watermark::default(), DEFAULT_DISK_FREE_LIMIT);
        let r = a.readings();
        assert!(r.mem_used > 0 && r.mem_limit > r.mem_used, "{r:?}");
        assert!(r.disk_free > 0);
        assert_eq!(r.reason(), None);
        let mut rx = a.subscribe();
        a.set_limits(Watermark::Bytes(1), DEFAULT_DISK_FREE_LIMIT);
        assert!(rx.has_changed().unwrap());
        assert_eq!(rx.borrow_and_update().reason().as_deref(), Some("low on memory"));
        a.set_limits(Watermark::default(), u64::MAX);
        assert_eq!(a.readings().reason().as_deref(), Some("low on disk"));
        a.set_limits(Watermark::default(), DEFAULT_DISK_FREE_LIMIT);
        assert_eq!(a.readings().reason(), None);
    }

    /// A write that met a full disk raises the disk alarm at once, however
    /// much the file system says is free, and it stays until that much is
    /// free beyond the limit.
    #[test]
    fn a_full_disk_met_by_a_write_raises_the_disk_alarm_until_there_is_room() {
        let dir = tempfile::tempdir().unwrap();
        let a = Alarms::new(dir.path(), Watermark::default(), 0);
        let free = a.readings().disk_free;
        let mut rx = a.subscribe();
        a.disk_full(u64::MAX / 2);
        assert!(rx.has_changed().unwrap());
        assert_eq!(rx.borrow_and_update().reason().as_deref(), Some("low on disk"));
        assert!(a.check().disk_free_alarm, "cleared while still short of room");
        assert_eq!(a.readings().disk_free_limit, 0, "the limit shown is the configured one");
        // Room enough (the free space now, less a margin for other writers).
        a.disk_full(free / 2);
        assert!(!a.check().disk_free_alarm);
        assert!(!a.check().disk_free_alarm, "held after it cleared");
    }
}
