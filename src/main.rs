use clap::Parser;

// glibc malloc spent a fifth of the CPU faulting in fresh pages for sled's
// copy-on-write pages under load (perf, benches/results/HISTORY.md).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use mirrorq::cli::{Cli, Command, ServeArgs};
use mirrorq::config::ServeConfig;
use mirrorq::serve::{self, Exit};

/// `mi_option_purge_delay` in mimalloc v2's option enum (not exported by the
/// Rust binding).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// How long freed pages stay mapped (ms). Purging at once (0) made a quarter
/// of a node's CPU go to the kernel zeroing the same pages again with 4 KiB
/// messages; 100 ms gave +30% msg/s there and +40% publishing a deep queue,
/// for 12% more RSS holding 1M x 1 KiB (424 vs 378 MB with 16 KiB chunks;
/// benches/results/HISTORY.md).
/// mimalloc's default kept about 160 MB more on that queue.
const PURGE_DELAY_MS: std::ffi::c_long = 100;

/// `mi_option_allow_thp` in mimalloc v2's option enum (not exported either).
const MI_OPTION_ALLOW_THP: libmimalloc_sys::mi_option_t = 37;

fn main() -> anyhow::Result<()> {
    // mimalloc's own MIMALLOC_PURGE_DELAY (ms), when set, wins.
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets a global allocator option before any thread is started.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, PURGE_DELAY_MS) };
    }
    // Transparent huge pages made most of an idle node's memory: 2 MiB
    // pages half used, 450-565 of 470-710 MB RSS with 722 idle queues
    // (AnonHugePages), against 118-210 MB without. MIMALLOC_ALLOW_THP=1
    // brings them back.
    if std::env::var_os("MIMALLOC_ALLOW_THP").is_none() {
        // SAFETY: a global allocator option and a prctl on this process,
        // before any thread is started.
        unsafe {
            libmimalloc_sys::mi_option_set(MI_OPTION_ALLOW_THP, 0);
            libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0);
        }
    }
    {
        use tracing_subscriber::layer::SubscriberExt as _;
        use tracing_subscriber::util::SubscriberInitExt as _;
        let filter = tracing_subscriber::EnvFilter::try_from_env("MIRRORQ_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,openraft=warn"));
        // The outermost layer decides first: what the filter drops is not
        // counted against a callsite's allowance.
        tracing_subscriber::registry()
            .with(
                tracing_subscriber::fmt::layer()
                    .with_writer(std::io::stderr)
                    // Colours for a person at a terminal, not escape codes
                    // in a log file or journald.
                    .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr())),
            )
            .with(mirrorq::log_throttle::layer())
            .with(filter)
            .init();
    }
    let cli = Cli::parse();
    let args = match cli.command {
        Some(Command::Serve(a)) => a,
        Some(Command::Ctl(c)) => match mirrorq::ctl::run(&c) {
            Ok(out) => {
                println!("{out}");
                return Ok(());
            }
            Err(e) => {
                eprintln!("mirrorq ctl: {e}");
                std::process::exit(1);
            }
        },
        Some(Command::Perf(p)) => {
            let rt = tokio::runtime::Runtime::new()?;
            if let Err(e) = rt.block_on(mirrorq::perf::run(p)) {
                eprintln!("mirrorq perf: {e}");
                std::process::exit(1);
            }
            return Ok(());
        }
        None => ServeArgs::default(),
    };
    let cfg = match ServeConfig::resolve(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("mirrorq: {e}");
            std::process::exit(2);
        }
    };
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    rt.enable_all();
    if let Some(n) = cfg.worker_threads {
        rt.worker_threads(n);
    }
    let rt = rt.build()?;
    match rt.block_on(serve::run(cfg, shutdown_signal())) {
        Ok(Exit::Requested) => Ok(()),
        Ok(Exit::Failed) => {
            eprintln!("mirrorq: node stopped after a storage failure");
            std::process::exit(1);
        }
        Err(e) => {
            eprintln!("mirrorq: {e}");
            std::process::exit(1);
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("install SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutdown requested");
}
