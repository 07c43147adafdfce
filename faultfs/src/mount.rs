//! Mounting: builds the state, mounts, serves the control socket and runs
//! the FUSE loop until unmounted or sent SIGTERM/SIGINT/SIGHUP.

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use fuser::{Config, MountOption, Session, SessionACL};

use crate::cli::MountArgs;
use crate::control;
use crate::error::FaultError;
use crate::fs::{FaultFs, Shared};
use crate::state::Inner;

/// The default state dir: `.NAME.faultfs-state` beside BACKING.
fn default_state(backing: &std::path::Path) -> PathBuf {
    let name = backing.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "root".into());
    let parent = backing.parent().unwrap_or(backing);
    parent.join(format!(".{name}.faultfs-state"))
}

/// Blocks the stop signals in this thread and every thread it starts
/// after, so one thread can `sigwait` for them.
fn block_stop_signals() -> libc::sigset_t {
    // SAFETY: sigset_t is plain data, initialised by sigemptyset.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, sig);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Mounts and serves until unmounted.
pub fn run(args: MountArgs) -> Result<(), FaultError> {
    let backing = std::fs::canonicalize(&args.backing).map_err(FaultError::io(&args.backing))?;
    let state = args.state.clone().unwrap_or_else(|| default_state(&backing));
    // Modes arrive with the caller's umask applied; ours must not cut more.
    // SAFETY: umask has no preconditions.
    unsafe { libc::umask(0) };
    let sigset = block_stop_signals();

    let inner = Inner::new(backing.clone(), state, args.strict)?;
    let shared = Arc::new(Shared { inner: Mutex::new(inner) });
    let mut config = Config::default();
    config.mount_options = vec![
        MountOption::FSName(format!("faultfs:{}", backing.display())),
        MountOption::Subtype("faultfs".into()),
        MountOption::DefaultPermissions,
        MountOption::RW,
    ];
    config.acl = SessionACL::All;
    config.n_threads = Some(args.threads.max(1));
    let fs = FaultFs { shared: shared.clone() };
    let mut session = Session::new(fs, &args.mountpoint, &config).map_err(FaultError::Session)?;
    let notifier = session.notifier();
    let mut unmounter = session.unmount_callable();

    let _ = std::fs::remove_file(&args.control);
    let listener = UnixListener::bind(&args.control).map_err(FaultError::io(&args.control))?;
    let ctl_shared = shared.clone();
    std::thread::Builder::new()
        .name("faultfs-control".into())
        .spawn(move || control::serve(listener, ctl_shared, notifier))
        .map_err(FaultError::Session)?;
    std::thread::Builder::new()
        .name("faultfs-signals".into())
        .spawn(move || {
            let mut sig = 0;
            // SAFETY: sigset was built by block_stop_signals.
            unsafe { libc::sigwait(&sigset, &mut sig) };
            eprintln!("faultfs: signal {sig}, unmounting");
            if let Err(e) = unmounter.unmount() {
                eprintln!("faultfs: unmount: {e}");
            }
        })
        .map_err(FaultError::Session)?;
    eprintln!(
        "faultfs: {} mounted on {} ({} mode)",
        backing.display(),
        args.mountpoint.display(),
        if args.strict { "strict" } else { "default" }
    );
    let r = session.run().map_err(FaultError::Session);
    let _ = std::fs::remove_file(&args.control);
    r
}
