//! Outbound node-to-node traffic: one multiplexed TCP connection per peer
//! carries every group's Raft messages and forwarded queue operations.
//!
//! Each request gets an envelope id; a reader task matches replies to
//! waiters, so many groups' RPCs are in flight on one connection at once.
//! A broken connection fails its waiters and is re-dialled on the next call,
//! with exponential backoff so a dead peer costs nothing but a fast error.

use std::collections::HashMap;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;
use tokio::sync::{broadcast, mpsc, oneshot};
use tokio_util::codec::{FramedRead, FramedWrite, LengthDelimitedCodec};

use super::auth::{self, ClusterSecret};
use super::beacon::{self, Beacon};
use super::faults::{Deafness, NetControl};
use super::frame::{self, MAX_FRAME};
use crate::tls::{LinkIo, LinkTls};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
const BACKOFF_MIN: Duration = Duration::from_millis(50);
const BACKOFF_MAX: Duration = Duration::from_secs(2);

/// Why a call to a peer failed.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("peer {0} unreachable: {1}")]
    Unreachable(String, String),
    #[error("call to {0} timed out")]
    Timeout(String),
    #[error("connection to {0} closed before the reply")]
    Closed(String),
    #[error("encode: {0}")]
    Encode(#[from] bincode::error::EncodeError),
    #[error("undecodable reply from {0}: {1}")]
    Decode(String, bincode::error::DecodeError),
}

pub fn codec() -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder().max_frame_length(MAX_FRAME).new_codec()
}

/// All outbound connections of a node.
pub struct Transport {
    peers: Mutex<HashMap<String, Arc<Peer>>>,
    /// Where pings go out (`beacon.rs`); without one they share the link.
    beacon: Option<Arc<Beacon>>,
    /// Peers a test cut this node off from.
    control: NetControl,
    /// The address of each peer whose connection broke by itself, as it breaks.
    losses: broadcast::Sender<String>,
    /// Proved on every connection dialled (`auth.rs`), when the cluster has one.
    secret: Option<ClusterSecret>,
    /// Every connection dialled runs over TLS (`--tls-node-link`).
    tls: Option<Arc<LinkTls>>,
}

impl Default for Transport {
    fn default() -> Self {
        Self::new()
    }
}

impl Transport {
    pub fn new() -> Self {
        Self {
            peers: Mutex::new(HashMap::new()),
            beacon: None,
            control: NetControl::default(),
            losses: broadcast::channel(64).0,
            secret: None,
            tls: None,
        }
    }

    /// Every connection dialled runs over mutual TLS (`None`: none does).
    pub fn with_tls(self, tls: Option<Arc<LinkTls>>) -> Self {
        Self { tls, ..self }
    }

    /// Every connection dialled proves `secret` first (`None`: none does).
    pub fn with_secret(self, secret: Option<ClusterSecret>) -> Self {
        Self { secret, ..self }
    }

    /// A transport whose pings travel on `beacon`'s thread and connections.
    pub fn with_beacon(beacon: Arc<Beacon>) -> Self {
        Self { beacon: Some(beacon), ..Self::new() }
    }

    fn peer(&self, addr: &str) -> Arc<Peer> {
        self.peers
            .lock()
            .expect("poisoned")
            .entry(addr.to_string())
            .or_insert_with(|| {
                let guard = Guard { secret: self.secret.clone(), tls: self.tls.clone() };
                Arc::new(Peer::new(addr.to_string(), self.losses.clone(), guard))
            })
            .clone()
    }

    /// Told the address of every peer whose connection breaks by itself
    /// (the moment [`Transport::link_lost_at`] records), as it happens.
    pub fn losses(&self) -> broadcast::Receiver<String> {
        self.losses.subscribe()
    }

    /// Send a request to the node at `addr` and wait for its reply.
    pub async fn call<Req: Serialize + ?Sized, Resp: DeserializeOwned>(
        &self,
        addr: &str,
        req: &Req,
        timeout: Duration,
    ) -> Result<Resp, CallError> {
        self.reachable(addr)?;
        let peer = self.peer(addr);
        match tokio::time::timeout(timeout, peer.call(req)).await {
            Ok(r) => r,
            Err(_) => Err(CallError::Timeout(addr.to_string())),
        }
    }

    /// A liveness ping to the node at `addr`, sent and answered on the
    /// beacon's connection: how busy this node's runtime is does not delay
    /// it, only how long the caller takes to look at the answer.
    pub async fn ping<Req, Resp>(&self, addr: &str, req: Req, timeout: Duration) -> Result<Resp, CallError>
    where
        Req: Serialize + Send + Sync + 'static,
        Resp: DeserializeOwned + Send + 'static,
    {
        self.reachable(addr)?;
        let Some(beacon) = &self.beacon else { return self.call(addr, &req, timeout).await };
        let peer = self.peer(addr);
        let timed_out = CallError::Timeout(addr.to_string());
        let ask = beacon.handle().spawn(async move {
            match tokio::time::timeout(timeout, peer.ping(&req)).await {
                Ok(r) => r,
                Err(_) => Err(timed_out),
            }
        });
        match ask.await {
            Ok(r) => r,
            Err(_) => Err(CallError::Closed(format!("{addr} (the beacon thread stopped)"))),
        }
    }

    /// Write a request to the node at `addr` now (so requests started in
    /// order travel in order) and return the wait for its reply.
    pub async fn start_call<Req: Serialize + ?Sized, Resp: DeserializeOwned>(
        &self,
        addr: &str,
        req: &Req,
    ) -> Result<Pending<Resp>, CallError> {
        self.reachable(addr)?;
        let rx = self.peer(addr).start_call(req).await?;
        Ok(Pending { rx, addr: addr.to_string(), reply: std::marker::PhantomData })
    }

    /// When the connection to `addr` broke by itself (the peer closed it or
    /// the socket failed), if it is broken now. A process killed with
    /// `kill -9` has its sockets closed by the kernel at once, so this is
    /// within milliseconds of its death.
    pub fn link_lost_at(&self, addr: &str) -> Option<Instant> {
        self.link_loss(addr).map(|l| l.at)
    }

    /// Whether the connection to `addr` is broken now because the peer's
    /// end closed it in order (end of stream). A process that exits, or is
    /// killed, with nothing unread on the link closes it so; a firewall
    /// that resets connections does not (nor does a kernel that discards
    /// unread data: then the link is reset, and this says no).
    pub fn link_closed_in_order(&self, addr: &str) -> bool {
        self.link_loss(addr).is_some_and(|l| l.orderly)
    }

    fn link_loss(&self, addr: &str) -> Option<Loss> {
        let peer = self.peers.lock().expect("poisoned").get(addr).cloned()?;
        let lost = *peer.lost_at.lock().expect("poisoned");
        lost
    }

    /// An error for a call to a peer a test cut this node off from.
    #[inline]
    fn reachable(&self, addr: &str) -> Result<(), CallError> {
        if self.control.is_blocked(addr) {
            return Err(CallError::Unreachable(addr.to_string(), "blocked by test hook".into()));
        }
        Ok(())
    }

    /// Whether a test cut this node off from `addr`: a dial there stands
    /// for one into a partition, which proves nothing.
    pub fn is_cut_off(&self, addr: &str) -> bool {
        self.control.is_blocked(addr)
    }

    /// Fail every call to `addr` as unreachable (a test's one-way cut).
    #[cfg(feature = "test-hooks")]
    pub fn block(&self, addr: &str) {
        self.control.block(addr);
    }

    #[cfg(feature = "test-hooks")]
    pub fn unblock(&self, addr: &str) {
        self.control.unblock(addr);
    }

    /// Let requests to the node at `addr` go out but lose every reply (a
    /// test's one-way cut: this side sends and hears nothing back).
    #[cfg(feature = "test-hooks")]
    pub fn deafen(&self, addr: &str, deaf: bool) {
        self.peer(addr).deaf.set(deaf);
    }

    /// Drop every connection (the peers are re-dialled on the next call).
    pub fn close_all(&self) {
        for p in self.peers.lock().expect("poisoned").values() {
            p.close();
            if let Ok(mut c) = p.beacon_conn.try_lock() {
                if let Some(c) = c.take() {
                    c.close();
                }
            }
        }
    }
}

struct Conn {
    tx: mpsc::Sender<Bytes>,
    pending: Arc<Mutex<HashMap<u64, oneshot::Sender<Bytes>>>>,
    closed: Arc<AtomicBool>,
    tasks: [tokio::task::AbortHandle; 2],
}

impl Conn {
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        for t in &self.tasks {
            t.abort();
        }
        self.pending.lock().expect("poisoned").clear();
    }
}

struct Peer {
    addr: String,
    conn: tokio::sync::Mutex<Option<Arc<Conn>>>,
    /// The connection pings travel on, made and served on the beacon's
    /// runtime.
    beacon_conn: tokio::sync::Mutex<Option<Arc<Conn>>>,
    /// When the last dial failed, and how long to wait before the next.
    backoff: Mutex<Option<(Instant, Duration)>>,
    /// When and how the last connection broke by itself; `None` while
    /// one is up.
    lost_at: Arc<Mutex<Option<Loss>>>,
    losses: broadcast::Sender<String>,
    next_id: AtomicU64,
    /// Replies are dropped on arrival ([`Transport::deafen`]).
    deaf: Deafness,
    guard: Guard,
}

/// What a dialled connection goes through before it carries anything:
/// TLS, then the cluster secret, each if the cluster has it.
struct Guard {
    secret: Option<ClusterSecret>,
    tls: Option<Arc<LinkTls>>,
}

impl Guard {
    async fn open(&self, addr: &str, tcp: TcpStream) -> Result<Box<dyn LinkIo>, String> {
        let mut io: Box<dyn LinkIo> = match &self.tls {
            Some(tls) => tls.connect(addr, tcp).await.map_err(|e| format!("TLS: {e}"))?,
            None => Box::new(tcp),
        };
        if let Some(secret) = &self.secret {
            auth::dial(&mut io, secret).await.map_err(|e| format!("cluster secret: {e}"))?;
        }
        Ok(io)
    }
}

impl Peer {
    fn new(addr: String, losses: broadcast::Sender<String>, guard: Guard) -> Self {
        Self {
            guard,
            addr,
            conn: tokio::sync::Mutex::new(None),
            beacon_conn: tokio::sync::Mutex::new(None),
            backoff: Mutex::new(None),
            lost_at: Arc::default(),
            losses,
            next_id: AtomicU64::new(1),
            deaf: Deafness::default(),
        }
    }

    fn close(&self) {
        if let Ok(mut c) = self.conn.try_lock() {
            if let Some(c) = c.take() {
                c.close();
            }
        }
    }

    async fn connection(&self) -> Result<Arc<Conn>, CallError> {
        let mut slot = self.conn.lock().await;
        if let Some(c) = slot.as_ref() {
            if !c.closed.load(Ordering::Acquire) {
                return Ok(c.clone());
            }
        }
        if let Some((at, wait)) = *self.backoff.lock().expect("poisoned") {
            if at.elapsed() < wait {
                return Err(CallError::Unreachable(self.addr.clone(), "backing off after a failed dial".into()));
            }
        }
        let stream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&self.addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(self.dial_failed(e.to_string())),
            Err(_) => return Err(self.dial_failed("connect timed out".into())),
        };
        let _ = stream.set_nodelay(true);
        let fd = stream.as_raw_fd();
        let stream = match self.guard.open(&self.addr, stream).await {
            Ok(io) => io,
            Err(why) => return Err(self.dial_failed(why)),
        };
        *self.backoff.lock().expect("poisoned") = None;
        *self.lost_at.lock().expect("poisoned") = None;
        let lost = LossReport { at: self.lost_at.clone(), to: self.losses.clone(), addr: self.addr.clone(), fd };
        let conn = Arc::new(start_conn(stream, Some(lost), self.deaf.clone()));
        *slot = Some(conn.clone());
        Ok(conn)
    }

    /// The beacon connection, dialled if there is none (on the runtime
    /// this runs on: the beacon's). No backoff: a ping's own bound keeps a
    /// dead peer cheap, and pings are few.
    async fn beacon_connection(&self) -> Result<Arc<Conn>, CallError> {
        let mut slot = self.beacon_conn.lock().await;
        if let Some(c) = slot.as_ref() {
            if !c.closed.load(Ordering::Acquire) {
                return Ok(c.clone());
            }
        }
        let unreachable = |why: String| CallError::Unreachable(self.addr.clone(), why);
        let mut stream = match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(&self.addr)).await {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => return Err(unreachable(e.to_string())),
            Err(_) => return Err(unreachable("connect timed out".into())),
        };
        let _ = stream.set_nodelay(true);
        // The beacon's mark goes first, in the clear: the listener tells
        // the two kinds apart before anything else (`beacon::hello`).
        stream.write_all(beacon::MAGIC).await.map_err(|e| unreachable(e.to_string()))?;
        let stream = self.guard.open(&self.addr, stream).await.map_err(unreachable)?;
        let conn = Arc::new(start_conn(stream, None, self.deaf.clone()));
        *slot = Some(conn.clone());
        Ok(conn)
    }

    async fn ping<Req: Serialize + ?Sized, Resp: DeserializeOwned>(&self, req: &Req) -> Result<Resp, CallError> {
        let conn = self.beacon_connection().await?;
        self.call_on(conn, req).await
    }

    fn dial_failed(&self, why: String) -> CallError {
        let mut b = self.backoff.lock().expect("poisoned");
        let wait = match *b {
            Some((_, w)) => (w * 2).min(BACKOFF_MAX),
            None => BACKOFF_MIN,
        };
        *b = Some((Instant::now(), wait));
        CallError::Unreachable(self.addr.clone(), why)
    }

    async fn start_call<Req: Serialize + ?Sized>(&self, req: &Req) -> Result<oneshot::Receiver<Bytes>, CallError> {
        let conn = self.connection().await?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = frame::frame(id, req)?;
        let (tx, rx) = oneshot::channel();
        conn.pending.lock().expect("poisoned").insert(id, tx);
        if conn.tx.send(frame).await.is_err() {
            conn.pending.lock().expect("poisoned").remove(&id);
            conn.closed.store(true, Ordering::Release);
            return Err(CallError::Closed(self.addr.clone()));
        }
        Ok(rx)
    }

    async fn call<Req: Serialize + ?Sized, Resp: DeserializeOwned>(&self, req: &Req) -> Result<Resp, CallError> {
        let conn = self.connection().await?;
        self.call_on(conn, req).await
    }

    async fn call_on<Req: Serialize + ?Sized, Resp: DeserializeOwned>(
        &self,
        conn: Arc<Conn>,
        req: &Req,
    ) -> Result<Resp, CallError> {
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let frame = frame::frame(id, req)?;
        let (tx, rx) = oneshot::channel();
        conn.pending.lock().expect("poisoned").insert(id, tx);
        // Removes our waiter however this call ends (timeout drops the future).
        struct Guard<'a>(&'a Conn, u64);
        impl Drop for Guard<'_> {
            fn drop(&mut self) {
                self.0.pending.lock().expect("poisoned").remove(&self.1);
            }
        }
        let _guard = Guard(&conn, id);
        if conn.tx.send(frame).await.is_err() {
            conn.closed.store(true, Ordering::Release);
            return Err(CallError::Closed(self.addr.clone()));
        }
        let body = rx.await.map_err(|_| CallError::Closed(self.addr.clone()))?;
        frame::decode(&body).map_err(|e| CallError::Decode(self.addr.clone(), e))
    }
}

/// The reply to a request already written ([`Transport::start_call`]).
pub struct Pending<Resp> {
    rx: oneshot::Receiver<Bytes>,
    addr: String,
    reply: std::marker::PhantomData<fn() -> Resp>,
}

impl<Resp: DeserializeOwned> Pending<Resp> {
    pub async fn reply(self) -> Result<Resp, CallError> {
        let body = self.rx.await.map_err(|_| CallError::Closed(self.addr.clone()))?;
        frame::decode(&body).map_err(|e| CallError::Decode(self.addr, e))
    }
}

/// Write queued frames until the queue closes or the socket fails; whatever
/// is already queued goes out in one write.
pub(crate) async fn write_frames(wr: impl tokio::io::AsyncWrite + Unpin, mut rx: mpsc::Receiver<Bytes>) {
    let mut out = FramedWrite::new(wr, codec());
    'outer: while let Some(frame) = rx.recv().await {
        if out.feed(frame).await.is_err() {
            break;
        }
        while let Ok(frame) = rx.try_recv() {
            if out.feed(frame).await.is_err() {
                break 'outer;
            }
        }
        if SinkExt::<Bytes>::flush(&mut out).await.is_err() {
            break;
        }
    }
}

/// How a connection broke by itself.
#[derive(Debug, Clone, Copy)]
struct Loss {
    at: Instant,
    /// The peer's end closed it (end of stream), rather than a reset or
    /// a failed read.
    orderly: bool,
}

/// Where a connection that breaks by itself tells so: the node link's own
/// do ([`Transport::losses`]); beacon connections do not.
struct LossReport {
    at: Arc<Mutex<Option<Loss>>>,
    to: broadcast::Sender<String>,
    addr: String,
    /// The connection's TCP socket, open as long as its read half.
    fd: RawFd,
}

/// Linux's TCP state after the peer's FIN, before ours (`tcp_states.h`).
const TCP_CLOSE_WAIT: u8 = 8;

/// Whether the peer's end of socket `fd` closed it in order: the peer sent
/// its FIN and nothing reset the connection since (its state is
/// CLOSE_WAIT; a reset leaves it CLOSED). Asked of the socket rather than
/// told by the read that ended: a reset's error goes to whichever call
/// meets it first, often a write, and the read after it sees an end of
/// stream like a FIN's.
fn peer_closed_in_order(fd: RawFd) -> bool {
    // SAFETY: all-zero is a valid `tcp_info` (plain integers).
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: `fd` is a socket the caller keeps open; `info` and `len`
    // are valid for writes of `len` bytes, which getsockopt does not exceed.
    let rc = unsafe {
        libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, (&raw mut info).cast::<libc::c_void>(), &mut len)
    };
    rc == 0 && info.tcpi_state == TCP_CLOSE_WAIT
}

fn start_conn(stream: Box<dyn LinkIo>, lost: Option<LossReport>, deaf: Deafness) -> Conn {
    let (rd, wr) = tokio::io::split(stream);
    let (tx, rx) = mpsc::channel::<Bytes>(1024);
    let pending: Arc<Mutex<HashMap<u64, oneshot::Sender<Bytes>>>> = Arc::default();
    let closed = Arc::new(AtomicBool::new(false));

    let writer = {
        let closed = closed.clone();
        tokio::spawn(async move {
            write_frames(wr, rx).await;
            closed.store(true, Ordering::Release);
        })
    };
    let reader = {
        let (pending, closed) = (pending.clone(), closed.clone());
        tokio::spawn(async move {
            let mut input = FramedRead::new(rd, codec());
            let orderly = loop {
                // Ended by an end of stream or an error (TLS reports a
                // peer gone without its close_notify as one): the socket
                // tells whether the peer's end closed it in order.
                let frame = match input.next().await {
                    Some(Ok(frame)) => frame,
                    _ => break lost.as_ref().is_some_and(|l| peer_closed_in_order(l.fd)),
                };
                if deaf.is_on() {
                    continue;
                }
                match frame::open(&frame.freeze()) {
                    Some((id, body)) => {
                        if let Some(w) = pending.lock().expect("poisoned").remove(&id) {
                            let _ = w.send(body);
                        }
                    }
                    None => {
                        tracing::warn!("a reply without an envelope id from a peer; dropping the connection");
                        break false;
                    }
                }
            };
            closed.store(true, Ordering::Release);
            if let Some(LossReport { at, to, addr, .. }) = lost {
                at.lock().expect("poisoned").get_or_insert(Loss { at: Instant::now(), orderly });
                let _ = to.send(addr);
            }
            // Dropping the senders fails every waiter at once.
            pending.lock().expect("poisoned").clear();
        })
    };
    Conn { tx, pending, closed, tasks: [writer.abort_handle(), reader.abort_handle()] }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The failover timer starts from the moment a master's link broke: the
    /// transport must notice a peer closing it, without any call pending.
    #[tokio::test]
    async fn a_link_closed_by_the_peer_is_noticed_at_once() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let t = Transport::new();
        assert!(t.link_lost_at(&addr).is_none(), "never dialled");
        let accept = tokio::spawn(async move { listener.accept().await.unwrap().0 });
        let _reply: Pending<()> = t.start_call(&addr, "anything").await.unwrap();
        let server_side = accept.await.unwrap();
        assert!(t.link_lost_at(&addr).is_none(), "the link is up");
        let before = Instant::now();
        drop(server_side);
        let mut lost = None;
        for _ in 0..500 {
            lost = t.link_lost_at(&addr);
            if lost.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(lost.is_some_and(|at| at >= before), "the closed link was not noticed");
        // It had not read the call: its kernel reset the link, which is
        // no proof that its end closed it (a firewall resets too).
        assert!(!t.link_closed_in_order(&addr), "a reset taken for an orderly close");
    }

    /// A peer that read everything and closed its end: an orderly close,
    /// as a process that exits, or is killed, with nothing unread.
    #[tokio::test]
    async fn a_link_the_peer_closed_in_order_is_told_from_a_reset_one() {
        use tokio::io::AsyncReadExt;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let t = Transport::new();
        let accept = tokio::spawn(async move { listener.accept().await.unwrap().0 });
        let _reply: Pending<()> = t.start_call(&addr, "anything").await.unwrap();
        let mut server_side = accept.await.unwrap();
        let mut buf = [0u8; 4096];
        while let Ok(Ok(n)) = tokio::time::timeout(Duration::from_millis(200), server_side.read(&mut buf)).await {
            if n == 0 {
                break;
            }
        }
        drop(server_side);
        let mut closed = false;
        for _ in 0..500 {
            closed = t.link_closed_in_order(&addr);
            if closed {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(closed, "the orderly close was not told");
        assert!(t.link_lost_at(&addr).is_some());
    }

    /// A test's cut holds in the link itself: every kind of call to the
    /// peer fails as unreachable without a dial, whoever calls.
    #[cfg(feature = "test-hooks")]
    #[tokio::test]
    async fn a_peer_cut_off_is_unreachable_to_every_call_and_never_dialled() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let t = Transport::new();
        t.block(&addr);
        assert!(t.is_cut_off(&addr));
        let wait = Duration::from_millis(200);
        assert!(matches!(t.start_call::<_, ()>(&addr, "x").await, Err(CallError::Unreachable(..))));
        assert!(matches!(t.call::<_, ()>(&addr, "x", wait).await, Err(CallError::Unreachable(..))));
        assert!(matches!(t.ping::<_, ()>(&addr, "x".to_string(), wait).await, Err(CallError::Unreachable(..))));
        assert!(tokio::time::timeout(wait, listener.accept()).await.is_err(), "a peer cut off was dialled");
        t.unblock(&addr);
        assert!(!t.is_cut_off(&addr));
        let _reply: Pending<()> = t.start_call(&addr, "x").await.unwrap();
        assert!(tokio::time::timeout(Duration::from_secs(5), listener.accept()).await.is_ok(), "mended: not dialled");
    }
}
