//! Inbound node-to-node traffic: accepts peers' connections and hands each
//! request to the node, answering on the same connection in any order.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use bytes::Bytes;
use futures::{SinkExt, StreamExt};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::Handle;
use tokio::sync::{mpsc, Semaphore};
use tokio_util::codec::{Framed, FramedRead};
use tokio_util::sync::CancellationToken;

use super::auth::{self, AuthError, ClusterSecret};
use super::beacon::{self, Beacon, Hello, Pulse};
use super::frame;
use super::transport::{codec, write_frames};
use crate::tls::{LinkIo, LinkTls};

/// The rest of a request's handling, after its admission.
pub type Completion<R> = Pin<Box<dyn Future<Output = R> + Send>>;

/// Whatever answers requests arriving on the node link (the node), in
/// words of its own.
pub trait RpcHandler: Send + Sync + 'static {
    type Request: DeserializeOwned + Send + 'static;
    type Response: Serialize + Send + 'static;

    /// Admit a request, in arrival order (queue operations take their place
    /// in the master's log order here), and return the rest of its handling,
    /// which runs concurrently with later requests.
    fn admit(self: Arc<Self>, req: Self::Request) -> impl Future<Output = Completion<Self::Response>> + Send;

    /// Whether `req` is a liveness ping, the only request a beacon
    /// connection may carry.
    fn is_ping(req: &Self::Request) -> bool;

    /// Answer a liveness ping on the beacon's thread: at once, without
    /// waiting for anything.
    fn ping(&self, req: Self::Request) -> Self::Response;
}

/// Who may connect: with a cluster secret, only a peer that proves it
/// knows it (`auth.rs`); the others are refused, counted, and logged once
/// per address.
pub struct Gate {
    pub secret: Option<ClusterSecret>,
    /// Mutual TLS first, when the node link has it (`--tls-node-link`).
    pub tls: Option<Arc<LinkTls>>,
    pub refused: prometheus_client::metrics::counter::Counter,
    told: std::sync::Mutex<std::collections::HashSet<std::net::IpAddr>>,
}

/// Addresses told about at most; refusals beyond are only counted.
const MAX_TOLD: usize = 1024;
/// Connections not yet through TLS and the secret, at most: a stranger
/// holding sockets open cannot take the node's descriptors or its beacon
/// thread; beyond, new connections are dropped until some finish.
const MAX_UNPROVEN: usize = 256;
/// The whole of a connection's TLS handshake and secret exchange.
const PROOF_DEADLINE: std::time::Duration = std::time::Duration::from_secs(10);

impl Gate {
    pub fn new(
        secret: Option<ClusterSecret>,
        tls: Option<Arc<LinkTls>>,
        refused: prometheus_client::metrics::counter::Counter,
    ) -> Self {
        Self { secret, tls, refused, told: Default::default() }
    }

    /// `stream` ready to carry the node link: through TLS and the secret
    /// where they are on; `None`, counted and told once, if it failed.
    async fn open(&self, stream: TcpStream) -> Option<Box<dyn LinkIo>> {
        let peer = stream.peer_addr().ok()?;
        match tokio::time::timeout(PROOF_DEADLINE, self.prove(stream, peer)).await {
            Ok(io) => io,
            Err(_) => {
                self.refuse(peer, "TLS and secret not proved within the deadline");
                None
            }
        }
    }

    async fn prove(&self, stream: TcpStream, peer: std::net::SocketAddr) -> Option<Box<dyn LinkIo>> {
        let mut io: Box<dyn LinkIo> = match &self.tls {
            Some(tls) => match tls.accept(stream).await {
                Ok(io) => io,
                Err(e) => {
                    self.refuse(peer, &format!("TLS: {e}"));
                    return None;
                }
            },
            None => Box::new(stream),
        };
        if let Some(secret) = &self.secret {
            if let Err(e) = auth::accept(&mut io, secret).await {
                let e: AuthError = e;
                self.refuse(peer, &e.to_string());
                return None;
            }
        }
        Some(io)
    }

    fn refuse(&self, peer: std::net::SocketAddr, e: &str) {
        self.refused.inc();
        let first = {
            let mut told = self.told.lock().expect("poisoned");
            told.len() < MAX_TOLD && told.insert(peer.ip())
        };
        if first {
            tracing::warn!(%peer, error = %e, "refused a node-link connection that did not prove its TLS certificate or the cluster secret (told once per address; all are counted in mirrorq_link_refused_total)");
        }
    }
}

/// Accept connections until `stop` is cancelled; then every connection and
/// in-flight handler is dropped. Accepting runs on the beacon's thread,
/// which answers beacon connections itself (`beacon.rs`) and hands every
/// other connection to the runtime this is called from. Every connection
/// passes `gate` first.
pub fn serve<H: RpcHandler>(
    listener: TcpListener,
    handler: Arc<H>,
    beacon: &Beacon,
    gate: Arc<Gate>,
    stop: CancellationToken,
) {
    let main = Handle::current();
    let pulse = beacon.pulse();
    let listener = match listener.into_std() {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(error = %e, "cannot hand the raft port to the beacon thread");
            return;
        }
    };
    beacon.handle().spawn(async move {
        let listener = match TcpListener::from_std(listener) {
            Ok(l) => l,
            Err(e) => {
                tracing::error!(error = %e, "cannot listen on the raft port from the beacon thread");
                return;
            }
        };
        let unproven = Arc::new(Semaphore::new(MAX_UNPROVEN));
        loop {
            let accepted = tokio::select! {
                _ = stop.cancelled() => return,
                a = listener.accept() => a,
            };
            match accepted {
                Ok((stream, _)) => {
                    let Ok(slot) = unproven.clone().try_acquire_owned() else {
                        drop(stream);
                        continue;
                    };
                    let _ = stream.set_nodelay(true);
                    let (h, stop, main, pulse) = (handler.clone(), stop.clone(), main.clone(), pulse.clone());
                    let gate = gate.clone();
                    tokio::spawn(async move {
                        match beacon::hello(stream).await {
                            Some(Hello::Beacon(stream)) => {
                                let Some(io) = gate.open(stream).await else { return };
                                drop(slot);
                                tokio::select! {
                                    _ = stop.cancelled() => {}
                                    _ = answer_pings(io, h, pulse) => {}
                                }
                            }
                            // TLS and the secret on the main runtime, which
                            // serves the connection: a socket cannot move
                            // between runtimes once TLS wraps it.
                            Some(Hello::Link(stream)) => hand_to(&main, stream, h, gate, slot, stop),
                            None => {}
                        }
                    });
                }
                Err(e) => {
                    tracing::warn!(error = %e, "accept failed on the raft port");
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            }
        }
    });
}

/// Serve a node-link connection on the `main` runtime.
fn hand_to<H: RpcHandler>(
    main: &Handle,
    stream: TcpStream,
    handler: Arc<H>,
    gate: Arc<Gate>,
    slot: tokio::sync::OwnedSemaphorePermit,
    stop: CancellationToken,
) {
    let stream = match stream.into_std() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(error = %e, "cannot hand a node-link connection over");
            return;
        }
    };
    main.spawn(async move {
        let stream = match TcpStream::from_std(stream) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "cannot take a node-link connection over");
                return;
            }
        };
        let Some(io) = gate.open(stream).await else { return };
        drop(slot);
        tokio::select! {
            _ = stop.cancelled() => {}
            _ = connection(io, handler, stop.clone()) => {}
        }
    });
}

/// A beacon connection: each ping answered here, in order, at once, while
/// the main runtime makes progress; left unanswered while it does not.
async fn answer_pings<H: RpcHandler>(stream: Box<dyn LinkIo>, handler: Arc<H>, pulse: Pulse) {
    let mut framed = Framed::new(stream, codec());
    while let Some(Ok(frame)) = framed.next().await {
        let Some((id, body)) = frame::open(&frame.freeze()) else { return };
        let Ok(req) = frame::decode::<H::Request>(&body) else { return };
        if !H::is_ping(&req) {
            tracing::warn!("a beacon connection carried something other than a ping; closing it");
            return;
        }
        if !pulse.alive() {
            continue;
        }
        let body = handler.ping(req);
        let Ok(reply) = frame::frame(id, &body) else { return };
        if framed.send(reply).await.is_err() {
            return;
        }
    }
}

/// How much of the requests of one connection may be in hand at once, in
/// bytes, each counted at least [`MIN_COST`]: beyond it the connection is
/// not read until some finish, so a peer sending faster than this node
/// handles is slowed by TCP (its calls time out and are retried) instead of
/// piling up handlers here. Pings have their own connection (`beacon.rs`).
const IN_HAND: usize = 64 << 20;
const MIN_COST: usize = 1 << 10;

async fn connection<H: RpcHandler>(stream: Box<dyn LinkIo>, handler: Arc<H>, stop: CancellationToken) {
    let (rd, wr) = tokio::io::split(stream);
    let (tx, rx) = mpsc::channel::<Bytes>(1024);
    let writer = tokio::spawn(write_frames(wr, rx));
    let mut input = FramedRead::new(rd, codec());
    let in_hand = Arc::new(Semaphore::new(IN_HAND));
    while let Some(Ok(frame)) = input.next().await {
        let cost = frame.len().clamp(MIN_COST, IN_HAND) as u32;
        let Ok(permit) = in_hand.clone().acquire_many_owned(cost).await else { break };
        let Some((id, body)) = frame::open(&frame.freeze()) else {
            tracing::warn!("a request without an envelope id on the raft port; closing the connection");
            break;
        };
        let req = match frame::decode::<H::Request>(&body) {
            Ok(r) => r,
            Err(e) => {
                tracing::warn!(error = %e, "undecodable request on the raft port; closing the connection");
                break;
            }
        };
        drop(body);
        let completion = handler.clone().admit(req).await;
        let (tx, stop) = (tx.clone(), stop.clone());
        tokio::spawn(async move {
            let body = tokio::select! {
                _ = stop.cancelled() => return,
                b = completion => b,
            };
            drop(permit);
            match frame::frame(id, &body) {
                Ok(b) => {
                    let _ = tx.send(b).await;
                }
                Err(e) => tracing::error!(error = %e, "cannot encode a reply"),
            }
        });
    }
    drop(tx);
    writer.abort();
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::time::Duration;

    use super::*;
    use crate::link::transport::Transport;

    /// Admits every request and finishes each only when the test lets one go.
    struct Held {
        admitted: AtomicUsize,
        release: Arc<Semaphore>,
    }

    impl RpcHandler for Held {
        type Request = u64;
        type Response = ();

        async fn admit(self: Arc<Self>, _req: u64) -> Completion<()> {
            self.admitted.fetch_add(1, Ordering::SeqCst);
            let release = self.release.clone();
            Box::pin(async move {
                if let Ok(p) = release.acquire().await {
                    p.forget();
                }
            })
        }

        fn is_ping(_: &u64) -> bool {
            false
        }

        fn ping(&self, _req: u64) {}
    }

    async fn settled(count: &AtomicUsize) -> usize {
        let mut last = usize::MAX;
        loop {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let now = count.load(Ordering::SeqCst);
            if now == last {
                return now;
            }
            last = now;
        }
    }

    /// Requests whose handling does not finish are held to a budget per
    /// connection; the rest wait in the socket, and each one finished lets
    /// one more in.
    #[tokio::test]
    async fn a_connection_holds_a_bounded_number_of_requests_in_hand() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let stop = CancellationToken::new();
        let beacon = Beacon::start(stop.child_token()).unwrap();
        let held = Arc::new(Held { admitted: AtomicUsize::new(0), release: Arc::new(Semaphore::new(0)) });
        serve(listener, held.clone(), &beacon, Arc::new(Gate::new(None, None, Default::default())), stop.clone());

        let budget = IN_HAND / MIN_COST;
        let t = Transport::new();
        let mut waits = Vec::new();
        for group in 0..budget as u64 + 500 {
            waits.push(t.start_call::<u64, ()>(&addr, &group).await.unwrap());
        }
        assert_eq!(settled(&held.admitted).await, budget, "requests in hand beyond the budget");
        held.release.add_permits(10);
        assert_eq!(settled(&held.admitted).await, budget + 10, "finished requests did not let others in");
        stop.cancel();
    }
}
