//! A short power-cut campaign (tests/faults/campaign.py with --faultfs):
//! every node's data dir on faultfs, a filesystem that forgets what was
//! not synced, under the same confirmed publish / consume load as t60,
//! with power cuts of one node and of every node at once, torn writes,
//! a corrupted replica, a failed fsync and a slow disk chosen by seed;
//! then the same checks: no confirmed message lost, none from nowhere, no
//! node that cannot start, no queue wedged. Needs root, `ip netns` and
//! /dev/fuse (CI has all three); elsewhere it says why and passes without
//! running.

mod common;

use std::path::Path;
use std::process::Command;

use common::process::faultfs;

#[test]
fn power_cut_campaign_loses_no_confirmed_message() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("t61_power skipped: needs root for network namespaces and FUSE mounts");
        return;
    }
    if !Path::new("/dev/fuse").exists() {
        eprintln!("t61_power skipped: no /dev/fuse");
        return;
    }
    let probe = format!("t61probe{}", std::process::id());
    match Command::new("ip").args(["netns", "add", &probe]).output() {
        Ok(o) if o.status.success() => {
            let _ = Command::new("ip").args(["netns", "del", &probe]).output();
        }
        Ok(o) => {
            eprintln!("t61_power skipped: `ip netns add` failed: {}", String::from_utf8_lossy(&o.stderr));
            return;
        }
        Err(e) => {
            eprintln!("t61_power skipped: no `ip` (iproute2): {e}");
            return;
        }
    }
    let faultfs = faultfs();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/faults/campaign.py");
    // Seeds whose schedules hold a power cut of every node at once as well
    // as cuts of single nodes, torn writes and a corrupted replica.
    let out = Command::new("python3")
        .args([script, "--bin", env!("CARGO_BIN_EXE_mirrorq")])
        .arg("--faultfs")
        .arg(&faultfs)
        .args(["--nodes", "3", "--seeds", "106,170", "--duration", "40"])
        .env("PYTHONDONTWRITEBYTECODE", "1")
        .output()
        .expect("run python3");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    println!("{stdout}");
    eprintln!("{stderr}");
    assert!(out.status.success(), "the power-cut campaign failed ({}):\n{stdout}\n{stderr}", out.status);
    assert!(stdout.contains("campaign: runs=2 passed=2 failed=0"), "no summary line:\n{stdout}");
    assert!(stdout.contains("powercut-all"), "no seed cut the power of every node:\n{stdout}");
}
