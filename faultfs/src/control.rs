//! The control socket: one command line in, one answer line out
//! (`ok ...` or `err REASON`), and the `faultfs ctl` client.

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::Arc;

use fuser::{INodeNo, Notifier};

use crate::error::FaultError;
use crate::fs::Shared;
use crate::state::{flip, shorten, zero, Fid};

fn num(args: &[&str], i: usize, what: &str) -> Result<u64, FaultError> {
    let s = args.get(i).ok_or_else(|| FaultError::Command(format!("missing {what}")))?;
    let r = match s.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => s.parse(),
    };
    r.map_err(|_| FaultError::Command(format!("bad {what}: {s}")))
}

fn arity(args: &[&str], min: usize, max: usize) -> Result<(), FaultError> {
    if args.len() < min || args.len() > max {
        return Err(FaultError::Command("wrong number of arguments".into()));
    }
    Ok(())
}

/// Runs one command line; the answer without the `ok`/`err` word, and the
/// inodes whose kernel caches must be dropped.
pub fn execute(shared: &Shared, line: &str) -> Result<(String, Vec<Fid>), FaultError> {
    let words: Vec<&str> = line.split_whitespace().collect();
    let Some((&cmd, args)) = words.split_first() else {
        return Err(FaultError::Command("empty command".into()));
    };
    let mut inner = shared.lock();
    let errno = |e: fuser::Errno| FaultError::Command(format!("{e:?}"));
    match cmd {
        "cut" => {
            arity(args, 0, 1)?;
            let known = inner.cut(None)?;
            Ok((format!("cut {}", inner.stats.cuts), known))
        }
        "torn" => {
            arity(args, 1, 1)?;
            let seed = num(args, 0, "seed")?;
            let known = inner.cut(Some(seed))?;
            Ok((format!("torn seed={seed}"), known))
        }
        "flip" => {
            arity(args, 2, 3)?;
            let off = num(args, 1, "offset")?;
            let mask = if args.len() == 3 { num(args, 2, "bits")? } else { 1 };
            let mask = u8::try_from(mask)
                .ok()
                .filter(|m| *m != 0)
                .ok_or_else(|| FaultError::Command("bits: a mask of 1..=255".into()))?;
            let len = std::fs::symlink_metadata(inner.backing().join(args[0].trim_start_matches('/')))
                .map(|m| m.len())
                .unwrap_or(0);
            if off >= len {
                return Err(FaultError::Command(format!("offset {off} past the end ({len})")));
            }
            let fid = inner.corrupt(args[0], flip(off, mask))?;
            Ok((format!("flipped {mask:#04x} at {off}"), fid.into_iter().collect()))
        }
        "zero" => {
            arity(args, 3, 3)?;
            let (off, len) = (num(args, 1, "offset")?, num(args, 2, "length")?);
            let fid = inner.corrupt(args[0], zero(off, len))?;
            Ok((format!("zeroed {len} at {off}"), fid.into_iter().collect()))
        }
        "truncate" => {
            arity(args, 2, 2)?;
            let len = num(args, 1, "length")?;
            let fid = inner.corrupt(args[0], shorten(len))?;
            Ok((format!("truncated to {len}"), fid.into_iter().collect()))
        }
        "fail-fsync" => {
            arity(args, 1, 1)?;
            inner.faults.fail_fsync = num(args, 0, "count")?;
            Ok((format!("fail-fsync {}", inner.faults.fail_fsync), Vec::new()))
        }
        "enospc" => {
            arity(args, 1, 1)?;
            if args[0] == "off" {
                inner.faults.enospc = None;
                Ok(("enospc off".into(), Vec::new()))
            } else {
                inner.recount();
                inner.faults.enospc = Some(num(args, 0, "bytes")?);
                Ok((format!("enospc {}", args[0]), Vec::new()))
            }
        }
        "delay-fsync" => {
            arity(args, 1, 1)?;
            inner.faults.delay_ms = num(args, 0, "milliseconds")?;
            Ok((format!("delay-fsync {}", inner.faults.delay_ms), Vec::new()))
        }
        "sync-all" => {
            arity(args, 0, 0)?;
            inner.sync_all().map_err(errno)?;
            Ok(("synced".into(), Vec::new()))
        }
        "stats" => {
            arity(args, 0, 0)?;
            Ok((inner.stats_line(), Vec::new()))
        }
        other => Err(FaultError::Command(format!("unknown command {other}"))),
    }
}

/// Serves the control socket until the process ends.
pub fn serve(listener: UnixListener, shared: Arc<Shared>, notifier: Notifier) {
    for conn in listener.incoming() {
        let Ok(conn) = conn else { continue };
        let mut reader = BufReader::new(&conn);
        let mut line = String::new();
        if reader.read_line(&mut line).is_err() {
            continue;
        }
        let answer = match execute(&shared, line.trim()) {
            Ok((msg, inval)) => {
                // Outside the lock: the kernel drops its cached pages and
                // attributes of these inodes (unknown ones answer ENOENT).
                for fid in inval {
                    let _ = notifier.inval_inode(INodeNo(fid), 0, 0);
                }
                format!("ok {msg}\n")
            }
            Err(e) => format!("err {}\n", e.to_string().replace('\n', " ")),
        };
        let _ = (&conn).write_all(answer.as_bytes());
    }
}

/// Sends one command and returns the answer line.
pub fn request(socket: &Path, command: &str) -> Result<String, FaultError> {
    let mut conn = UnixStream::connect(socket).map_err(FaultError::io(socket))?;
    conn.write_all(format!("{command}\n").as_bytes()).map_err(FaultError::io(socket))?;
    let mut line = String::new();
    BufReader::new(&conn).read_line(&mut line).map_err(FaultError::io(socket))?;
    Ok(line.trim_end().to_string())
}
