//! Keeps a failure that repeats from filling the disk with its log lines.
//!
//! Each place in the code that logs (a callsite, ours or a dependency's such
//! as openraft's replication loop) may write a few lines per window; further
//! lines from it are dropped and counted, and once per window a summary line
//! says how many were dropped and where from. Debug and trace lines pass:
//! someone asked for them.
//!
//! The throttle is process-wide, like the log it guards.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tracing::callsite::Identifier;
use tracing::{Event, Level, Metadata, Subscriber};
use tracing_subscriber::layer::{Context, Layer};

/// Lines one callsite may write per window.
pub const BURST: u32 = 5;
/// How long a callsite's allowance lasts, and how often the summary runs.
pub const WINDOW: Duration = Duration::from_secs(60);
/// Target of the summary lines (never throttled themselves).
const SUMMARY_TARGET: &str = "mirrorq::log";

#[derive(Debug)]
struct Site {
    meta: &'static Metadata<'static>,
    window_start: Instant,
    written: u32,
    /// Dropped since the last summary.
    dropped: u64,
}

/// What was dropped from one callsite since the last summary.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dropped {
    pub level: Level,
    pub target: String,
    /// `file:line`, or the callsite's name where the file is unknown.
    pub source: String,
    pub count: u64,
}

/// The per-callsite allowances.
#[derive(Debug)]
pub struct Throttle {
    burst: u32,
    window: Duration,
    sites: Mutex<HashMap<Identifier, Site>>,
    dropped_total: AtomicU64,
}

impl Throttle {
    pub fn new(burst: u32, window: Duration) -> Self {
        Self { burst, window, sites: Mutex::new(HashMap::new()), dropped_total: AtomicU64::new(0) }
    }

    /// Whether a line from `meta` may be written at `now`.
    pub fn admit(&self, meta: &'static Metadata<'static>, now: Instant) -> bool {
        if *meta.level() > Level::INFO || meta.target() == SUMMARY_TARGET {
            return true;
        }
        let mut sites = self.sites.lock().unwrap_or_else(|p| p.into_inner());
        let site = sites.entry(meta.callsite()).or_insert(Site { meta, window_start: now, written: 0, dropped: 0 });
        if now.duration_since(site.window_start) >= self.window {
            site.window_start = now;
            site.written = 0;
        }
        if site.written < self.burst {
            site.written += 1;
            true
        } else {
            site.dropped += 1;
            self.dropped_total.fetch_add(1, Ordering::Relaxed);
            false
        }
    }

    /// What was dropped since the last call, per callsite, and resets it.
    pub fn take_dropped(&self) -> Vec<Dropped> {
        let mut sites = self.sites.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = Vec::new();
        for site in sites.values_mut().filter(|s| s.dropped > 0) {
            let m = site.meta;
            let source = match (m.file(), m.line()) {
                (Some(f), Some(l)) => format!("{f}:{l}"),
                _ => m.name().to_string(),
            };
            out.push(Dropped { level: *m.level(), target: m.target().to_string(), source, count: site.dropped });
            site.dropped = 0;
        }
        out.sort_by_key(|d| std::cmp::Reverse(d.count));
        out
    }

    /// Lines dropped since the process started.
    pub fn dropped_total(&self) -> u64 {
        self.dropped_total.load(Ordering::Relaxed)
    }
}

static INSTALLED: OnceLock<Arc<Throttle>> = OnceLock::new();

/// Lines the process's log throttle dropped so far (0 when none is installed).
pub fn dropped_total() -> u64 {
    INSTALLED.get().map_or(0, |t| t.dropped_total())
}

/// The layer to put in front of the log writer. Installs the process's
/// throttle and starts the thread that writes the summaries.
pub fn layer() -> ThrottleLayer {
    let throttle = INSTALLED.get_or_init(|| {
        let t = Arc::new(Throttle::new(BURST, WINDOW));
        let summary = t.clone();
        let spawned = std::thread::Builder::new().name("log-throttle".into()).spawn(move || loop {
            std::thread::sleep(WINDOW);
            summarise(&summary);
        });
        if let Err(e) = spawned {
            eprintln!("mirrorq: cannot start the log summary thread: {e}");
        }
        t
    });
    ThrottleLayer { throttle: throttle.clone() }
}

fn summarise(t: &Throttle) {
    for d in t.take_dropped() {
        tracing::warn!(
            target: SUMMARY_TARGET,
            source = %d.source,
            from = %d.target,
            level = %d.level,
            dropped = d.count,
            "a log line repeated: its copies of the last minute were dropped"
        );
    }
}

/// Drops what the throttle does not admit, before any writer sees it.
#[derive(Debug, Clone)]
pub struct ThrottleLayer {
    throttle: Arc<Throttle>,
}

impl<S: Subscriber> Layer<S> for ThrottleLayer {
    fn event_enabled(&self, event: &Event<'_>, _ctx: Context<'_, S>) -> bool {
        self.throttle.admit(event.metadata(), Instant::now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta_of(level: Level) -> &'static Metadata<'static> {
        // A real callsite's metadata, captured as its event passes.
        #[derive(Default)]
        struct Capture(Mutex<Vec<&'static Metadata<'static>>>);
        impl Subscriber for Capture {
            fn register_callsite(&self, _: &'static Metadata<'static>) -> tracing::subscriber::Interest {
                tracing::subscriber::Interest::always()
            }
            fn enabled(&self, _: &Metadata<'_>) -> bool {
                true
            }
            fn new_span(&self, _: &tracing::span::Attributes<'_>) -> tracing::span::Id {
                tracing::span::Id::from_u64(1)
            }
            fn record(&self, _: &tracing::span::Id, _: &tracing::span::Record<'_>) {}
            fn record_follows_from(&self, _: &tracing::span::Id, _: &tracing::span::Id) {}
            fn event(&self, e: &Event<'_>) {
                self.0.lock().unwrap().push(e.metadata());
            }
            fn enter(&self, _: &tracing::span::Id) {}
            fn exit(&self, _: &tracing::span::Id) {}
        }
        let cap = Arc::new(Capture::default());
        tracing::subscriber::with_default(cap.clone(), || match level {
            Level::ERROR => tracing::error!("e"),
            Level::WARN => tracing::warn!("w"),
            Level::INFO => tracing::info!("i"),
            _ => tracing::debug!("d"),
        });
        let got = cap.0.lock().unwrap();
        got.first().copied().expect("the event passed")
    }

    #[test]
    fn a_repeating_line_is_written_a_burst_per_window_and_counted() {
        let t = Throttle::new(3, Duration::from_secs(60));
        let err = meta_of(Level::ERROR);
        let start = Instant::now();
        let admitted = (0..100).filter(|i| t.admit(err, start + Duration::from_millis(*i))).count();
        assert_eq!(admitted, 3);
        assert_eq!(t.dropped_total(), 97);
        let dropped = t.take_dropped();
        assert_eq!(dropped.len(), 1);
        assert_eq!(dropped[0].count, 97);
        assert_eq!(dropped[0].level, Level::ERROR);
        assert!(dropped[0].source.contains("log_throttle.rs"), "{:?}", dropped[0]);
        // Reported once: the next summary has nothing new.
        assert!(t.take_dropped().is_empty());
        // A new window gives a new allowance.
        assert!(t.admit(err, start + Duration::from_secs(61)));
    }

    #[test]
    fn callsites_have_their_own_allowance_and_debug_is_never_dropped() {
        let t = Throttle::new(1, Duration::from_secs(60));
        let now = Instant::now();
        let (warn, info, debug) = (meta_of(Level::WARN), meta_of(Level::INFO), meta_of(Level::DEBUG));
        assert!(t.admit(warn, now));
        assert!(!t.admit(warn, now));
        assert!(t.admit(info, now));
        assert!(!t.admit(info, now));
        for _ in 0..10 {
            assert!(t.admit(debug, now));
        }
        assert_eq!(t.dropped_total(), 2);
    }
}
