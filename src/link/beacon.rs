//! The beacon: liveness pings on a thread and a connection of their own.
//!
//! Peers judge a node out of reach by its pings, and after the failure
//! timeout re-form its queues without it. When pings shared the runtime and
//! the connection with Raft traffic, a node busy with thousands of elections
//! (a restart at ten thousand queues) answered them seconds late: its peers
//! re-formed queues that had a master, which made more work, and the cluster
//! did not settle. A ping answered on a thread that does nothing else, over
//! a connection that carries nothing else, tells whether the process is
//! alive and reachable, not how busy it is.
//!
//! A process alive but stuck (its runtime making no progress at all) is
//! no better than a dead one: the beacon answers only while the main
//! runtime has run a tick of its own within the stall limit, which is long
//! against a busy runtime's delays and short against a hang.
//!
//! A beacon connection opens with [`MAGIC`] on the node-link port; any
//! other connection is the node link's own and goes to the main runtime as
//! it is. A data frame cannot start with it: its first byte would announce
//! a frame far above [`super::frame::MAX_FRAME`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

/// What a beacon connection sends first.
pub const MAGIC: &[u8; 8] = b"MQBEACON";

/// How long an accepted connection may take to show what it is: a peer
/// sends at once, and a silent stranger is not kept.
const HELLO_TIMEOUT: Duration = Duration::from_secs(2);

/// How often the main runtime shows it makes progress.
const TICK: Duration = Duration::from_millis(100);

/// A thread running a runtime of its own, until the token it was started
/// with is cancelled (the node's stop: a stopped node answers no pings).
pub struct Beacon {
    handle: Handle,
    stop: CancellationToken,
    pulse: Pulse,
}

/// When the main runtime last ran its tick.
#[derive(Clone)]
pub struct Pulse {
    origin: Instant,
    /// Milliseconds from `origin`; 0 until it is watched.
    last: Arc<AtomicU64>,
    limit: Arc<AtomicU64>,
}

impl Pulse {
    /// Whether the main runtime ran its tick within the stall limit (always,
    /// while no runtime is watched).
    pub fn alive(&self) -> bool {
        let limit = self.limit.load(Ordering::Acquire);
        limit == 0
            || (self.origin.elapsed().as_millis() as u64).saturating_sub(self.last.load(Ordering::Acquire)) < limit
    }
}

impl Beacon {
    pub fn start(stop: CancellationToken) -> std::io::Result<Beacon> {
        let (tx, rx) = std::sync::mpsc::channel();
        let until = stop.clone();
        std::thread::Builder::new().name("mirrorq-beacon".into()).spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = tx.send(Err(e));
                    return;
                }
            };
            let _ = tx.send(Ok(rt.handle().clone()));
            rt.block_on(until.cancelled());
        })?;
        let handle = rx.recv().map_err(|_| std::io::Error::other("the beacon thread ended at once"))??;
        let pulse = Pulse { origin: Instant::now(), last: Arc::default(), limit: Arc::default() };
        Ok(Beacon { handle, stop, pulse })
    }

    /// Answer pings only while the runtime this is called from runs a tick
    /// at least once per `stall_limit`.
    pub fn watch_this_runtime(&self, stall_limit: Duration) {
        let (pulse, stop) = (self.pulse.clone(), self.stop.clone());
        let beat = move || pulse.last.store(pulse.origin.elapsed().as_millis() as u64, Ordering::Release);
        beat();
        self.pulse.limit.store(stall_limit.as_millis().max(1) as u64, Ordering::Release);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(TICK);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => beat(),
                }
            }
        });
    }

    pub fn pulse(&self) -> Pulse {
        self.pulse.clone()
    }

    pub fn handle(&self) -> &Handle {
        &self.handle
    }
}

impl Drop for Beacon {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// What an accepted connection turned out to be.
pub enum Hello {
    /// It sent [`MAGIC`], now consumed.
    Beacon(TcpStream),
    /// Anything else, with nothing consumed.
    Link(TcpStream),
}

/// Tell a beacon connection from a node-link one, reading only the magic
/// (and only once it is whole). `None`: the peer closed, failed or stayed
/// silent past [`HELLO_TIMEOUT`].
pub async fn hello(mut stream: TcpStream) -> Option<Hello> {
    let mut buf = [0u8; MAGIC.len()];
    let seen = tokio::time::timeout(HELLO_TIMEOUT, async {
        loop {
            let n = stream.peek(&mut buf).await.ok()?;
            if n == 0 {
                return None;
            }
            if buf[..n] != MAGIC[..n] {
                return Some(false);
            }
            if n == MAGIC.len() {
                return Some(true);
            }
            // Part of the magic so far (rare: it is 8 bytes sent at once):
            // wait for the rest.
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .ok()??;
    if !seen {
        return Some(Hello::Link(stream));
    }
    stream.read_exact(&mut buf).await.ok()?;
    Some(Hello::Beacon(stream))
}
