//! One AMQP connection: handshake, channel 0, and a task per channel.
//!
//! The reader parses frames and hands each channel's frames to that
//! channel's task, so a slow operation on one channel (a get that goes to a
//! remote master) never holds up another. Channel tasks and consumers send
//! frames through one writer task; a delivery's method, header and body go as
//! one unit so nothing interleaves inside it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{basic, channel, confirm, connection, exchange, queue, tx, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use futures::{Future, FutureExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;

use super::auth::{self, Grants};
use super::codec::{self, Parsed};
use super::confirms;
use super::consumer::Consumer;
use super::deliveries::{ConsumerId, Deliveries};
use crate::api::DeclareOpts;
use crate::error::NodeError;
use crate::message::{encode_properties, expiration_ms, to_args};
use crate::metadata::names::{self, DEFAULT_VHOST};
use crate::metadata::{Access, Binding, ExchangeKind, ExchangeMeta, QueueArgs};
use crate::node::{stored_all, stored_count, Node};
use crate::queue::proposer::Lane;
use crate::queue::{Message, QueueCmd};

const PROTOCOL_HEADER: &[u8; 8] = b"AMQP\x00\x00\x09\x01";
const FRAME_MAX: u32 = 131_072;
const CHANNEL_MAX: u16 = 2047;
const HEARTBEAT: u16 = 60;
/// Publishes awaiting their confirm per connection; beyond this the reader
/// stops reading and TCP pushes back on the publisher.
const MAX_IN_FLIGHT: usize = 10_000;

// Reply codes (AMQP 0-9-1).
const NO_ROUTE: u16 = 312;
const ACCESS_REFUSED: u16 = 403;
const NOT_FOUND: u16 = 404;
const RESOURCE_LOCKED: u16 = 405;
const PRECONDITION_FAILED: u16 = 406;
const FRAME_ERROR: u16 = 501;
const SYNTAX_ERROR: u16 = 502;
const COMMAND_INVALID: u16 = 503;
const CHANNEL_ERROR: u16 = 504;
const UNEXPECTED_FRAME: u16 = 505;
const NOT_ALLOWED: u16 = 530;
const NOT_IMPLEMENTED: u16 = 540;
const INTERNAL_ERROR: u16 = 541;
const CONNECTION_FORCED: u16 = 320;

/// An error that ends the connection (`connection.close`).
#[derive(Debug)]
struct Hard {
    code: u16,
    text: String,
    class: u16,
    method: u16,
}

fn hard(code: u16, text: impl Into<String>) -> Hard {
    Hard { code, text: text.into(), class: 0, method: 0 }
}

/// A short string (reply texts, names): at most 255 bytes, so a long
/// error text is cut at a character boundary rather than panicking.
pub(super) fn ss(s: &str) -> ShortString {
    ShortString::from(codec::short(s))
}

pub(super) fn method(ch: u16, class: AMQPClass) -> AMQPFrame {
    AMQPFrame::Method(ch, class)
}

/// What the connection's writer is handed: frames to encode, or frames
/// already encoded (message contents, see [`codec::write_content`]).
pub(super) enum Outgoing {
    Frames(Vec<AMQPFrame>),
    Encoded(Vec<u8>),
}

#[derive(Clone)]
pub(super) struct Out(mpsc::Sender<Outgoing>);

impl Out {
    pub(super) async fn send(&self, frames: Vec<AMQPFrame>) {
        let _ = self.0.send(Outgoing::Frames(frames)).await;
    }
    pub(super) async fn one(&self, frame: AMQPFrame) {
        self.send(vec![frame]).await;
    }
    pub(super) async fn encoded(&self, bytes: Vec<u8>) {
        let _ = self.0.send(Outgoing::Encoded(bytes)).await;
    }
    /// A method with `msg` as its content.
    pub(super) async fn content(&self, ch: u16, class: AMQPClass, msg: &Message, frame_max: u32) {
        let mut buf = Vec::with_capacity(msg.body.len() + msg.properties.len() + 128);
        push_frames(&mut buf, |buf| codec::write_content(ch, class, &msg.properties, &msg.body, frame_max, buf));
        self.encoded(buf).await;
    }
}

/// Append what `write` encodes to `buf`, or nothing if it cannot be
/// encoded (then it is logged and dropped, as the writer drops a frame).
pub(super) fn push_frames(buf: &mut Vec<u8>, write: impl FnOnce(&mut Vec<u8>) -> Result<(), String>) {
    let start = buf.len();
    if let Err(e) = write(buf) {
        buf.truncate(start);
        tracing::error!(error = %e, "dropping an unencodable message");
    }
}

pub async fn run(stream: TcpStream, peer: SocketAddr, node: Node, conn_id: u64) -> Result<(), String> {
    let (mut rd, mut wr) = stream.into_split();
    let mut header = [0u8; 8];
    if rd.read_exact(&mut header).await.is_err() {
        return Ok(());
    }
    if &header != PROTOCOL_HEADER {
        // The spec's answer to a wrong protocol header: ours, then close.
        let _ = wr.write_all(PROTOCOL_HEADER).await;
        return Err(format!("bad protocol header {header:?}"));
    }

    let local = wr.local_addr().map(|a| a.to_string()).unwrap_or_default();
    node.clients().connected(crate::clients::ConnectionInfo {
        id: conn_id,
        name: format!("{peer} -> {local}"),
        peer: peer.to_string(),
        user: String::new(),
        vhost: String::new(),
        node: node.name().to_string(),
        channels: Vec::new(),
    });
    let (tx, mut rx) = mpsc::channel::<Outgoing>(1024);
    let out = Out(tx);
    let writer = tokio::spawn(async move {
        let mut buf = Vec::with_capacity(64 * 1024);
        while let Some(first) = rx.recv().await {
            buf.clear();
            let mut batch = first;
            loop {
                match batch {
                    Outgoing::Frames(frames) => {
                        for f in &frames {
                            if let Err(e) = codec::write_frame(f, &mut buf) {
                                tracing::error!(error = %e, "dropping an unencodable frame");
                            }
                        }
                    }
                    Outgoing::Encoded(bytes) if buf.is_empty() => buf = bytes,
                    Outgoing::Encoded(bytes) => buf.extend_from_slice(&bytes),
                }
                if buf.len() > 256 * 1024 {
                    break;
                }
                match rx.try_recv() {
                    Ok(more) => batch = more,
                    Err(_) => break,
                }
            }
            if wr.write_all(&buf).await.is_err() {
                return;
            }
        }
        let _ = wr.shutdown().await;
    });

    let mut conn = Conn {
        node,
        conn_id,
        out: out.clone(),
        channels: HashMap::new(),
        frame_max: FRAME_MAX,
        heartbeat: 0,
        state: State::AwaitStartOk,
        in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
        hard_rx: None,
        hard_tx: None,
        exclusive: Arc::default(),
        blocked_capable: false,
        told_blocked: false,
        published: false,
        peer_loopback: peer.ip().is_loopback(),
        user: Arc::from(""),
        vhost: Arc::from(DEFAULT_VHOST),
    };
    let (hard_tx, hard_rx) = mpsc::channel::<Hard>(8);
    conn.hard_tx = Some(hard_tx);
    conn.hard_rx = Some(hard_rx);
    conn.send_start().await;
    let result = conn.read_loop(&mut rd).await;
    for (_, ch) in conn.channels.drain() {
        ch.closed.cancel();
    }
    for q in conn.node.clients().disconnected(conn_id) {
        conn.node.consumer_gone(&q).await;
    }
    // Exclusive queues live as long as the connection that declared them.
    let exclusive: Vec<String> = conn.exclusive.lock().expect("poisoned").iter().cloned().collect();
    for q in exclusive {
        if let Err(e) = conn.node.delete_queue(&q).await {
            tracing::warn!(queue = %q, error = %e, "could not delete an exclusive queue");
        }
    }
    if let Err(h) = &result {
        tracing::info!(%peer, code = h.code, text = %h.text, "closing amqp connection");
        out.one(method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Close(connection::Close {
                reply_code: h.code,
                reply_text: ss(&h.text),
                class_id: h.class,
                method_id: h.method,
            })),
        ))
        .await;
    }
    let told_to_leave = result.as_ref().err().is_some_and(|h| h.code == CONNECTION_FORCED);
    if result.is_ok() || told_to_leave {
        // The client closed (or is closing) the connection, or we told it to
        // leave. Whoever sent `connection.close` closes the socket after
        // close-ok: wait for the client to do so, briefly, rather than
        // closing under it (clients report that as a broken connection).
        let mut scratch = [0u8; 256];
        let _ = tokio::time::timeout(Duration::from_secs(1), async {
            while matches!(rd.read(&mut scratch).await, Ok(n) if n > 0) {}
        })
        .await;
    }
    drop(out);
    drop(conn);
    let _ = tokio::time::timeout(Duration::from_secs(2), writer).await;
    result.map_err(|h| h.text)
}

#[derive(PartialEq)]
enum State {
    AwaitStartOk,
    AwaitTuneOk,
    AwaitOpen,
    Open,
    /// We sent connection.close; waiting for close-ok.
    Closing,
}

struct ChannelHandle {
    tx: mpsc::UnboundedSender<AMQPFrame>,
    closed: CancellationToken,
}

struct Conn {
    node: Node,
    conn_id: u64,
    out: Out,
    channels: HashMap<u16, ChannelHandle>,
    frame_max: u32,
    heartbeat: u16,
    state: State,
    in_flight: Arc<Semaphore>,
    hard_tx: Option<mpsc::Sender<Hard>>,
    hard_rx: Option<mpsc::Receiver<Hard>>,
    exclusive: Arc<Mutex<BTreeSet<String>>>,
    /// The client takes `connection.blocked` notifications.
    blocked_capable: bool,
    /// We told it it is blocked.
    told_blocked: bool,
    /// It has published: alarms concern it.
    published: bool,
    /// The client connects from a loopback address (where guest may log in).
    peer_loopback: bool,
    /// Who logged in, and the vhost they opened.
    user: Arc<str>,
    vhost: Arc<str>,
}

impl Conn {
    async fn send_start(&self) {
        let mut caps = FieldTable::default();
        for c in [
            "publisher_confirms",
            "basic.nack",
            "consumer_cancel_notify",
            "per_consumer_qos",
            "connection.blocked",
            "authentication_failure_close",
        ] {
            caps.insert(ss(c), AMQPValue::Boolean(true));
        }
        let mut props = FieldTable::default();
        props.insert(ss("product"), AMQPValue::LongString(LongString::from("mirrorq")));
        props.insert(ss("version"), AMQPValue::LongString(LongString::from(env!("CARGO_PKG_VERSION"))));
        props.insert(ss("cluster_name"), AMQPValue::LongString(LongString::from("mirrorq")));
        props.insert(ss("capabilities"), AMQPValue::FieldTable(caps));
        self.out
            .one(method(
                0,
                AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
                    version_major: 0,
                    version_minor: 9,
                    server_properties: props,
                    mechanisms: LongString::from("PLAIN AMQPLAIN"),
                    locales: LongString::from("en_US"),
                })),
            ))
            .await;
    }

    /// Why an open connection may no longer stay, as RabbitMQ closes it:
    /// its user was deleted, or its vhost, or the user's access to it.
    fn access_gone(&self, meta: &crate::metadata::MetaState) -> Option<String> {
        if self.state != State::Open {
            return None;
        }
        let (user, vhost) = (&self.user, &self.vhost);
        if !meta.users.contains_key(&**user) {
            Some(format!("user '{user}' was deleted"))
        } else if !meta.vhosts.contains_key(&**vhost) {
            Some(format!("vhost '{vhost}' is deleted"))
        } else if meta.permission(user, vhost).is_none() {
            Some(format!("access to vhost '{vhost}' was revoked for user '{user}'"))
        } else {
            None
        }
    }

    /// `connection.blocked` / `unblocked` to a publishing client that asked
    /// for them (as RabbitMQ: connections that only consume are left
    /// alone), once per change.
    async fn tell_blocked(&mut self, reason: Option<String>) {
        if !self.blocked_capable || !self.published || reason.is_some() == self.told_blocked {
            return;
        }
        self.told_blocked = reason.is_some();
        let m = match reason {
            Some(r) => connection::AMQPMethod::Blocked(connection::Blocked { reason: ss(&r) }),
            None => connection::AMQPMethod::Unblocked(connection::Unblocked {}),
        };
        self.out.one(method(0, AMQPClass::Connection(m))).await;
    }

    async fn read_loop(&mut self, rd: &mut tokio::net::tcp::OwnedReadHalf) -> Result<(), Hard> {
        let mut buf: Vec<u8> = Vec::with_capacity(64 * 1024);
        let mut chunk = vec![0u8; 64 * 1024];
        let mut last_seen = Instant::now();
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        let mut last_sent_heartbeat = Instant::now();
        let mut hard_rx = self.hard_rx.take().expect("hard_rx");
        let mut alarms = self.node.alarms().subscribe();
        let mut meta = self.node.watch_metadata();
        let closing = self.node.closing();
        // A publish waits in `buf` while an alarm is on; the socket is not
        // read meanwhile, so TCP pushes back on the publisher.
        let mut held = false;
        loop {
            // Parse everything buffered before reading more; what was parsed
            // is cut off once, not after every frame (that moved the rest of
            // the buffer once per frame: 7% of a master's CPU).
            let mut parsed = 0;
            loop {
                match codec::parse(&buf[parsed..]) {
                    Parsed::Incomplete => break,
                    Parsed::Invalid(e) => return Err(hard(FRAME_ERROR, format!("malformed frame: {e}"))),
                    Parsed::Frame(frame, used) => {
                        if self.state == State::Open && used as u64 > self.frame_max as u64 {
                            return Err(hard(FRAME_ERROR, format!("frame of {used} bytes exceeds frame_max")));
                        }
                        if is_publish(&frame) {
                            self.published = true;
                            let reason = alarms.borrow().reason();
                            if reason.is_some() {
                                self.tell_blocked(reason).await;
                                held = true;
                                break;
                            }
                        }
                        parsed += used;
                        if !self.handle(frame).await? {
                            return Ok(());
                        }
                    }
                }
            }
            buf.drain(..parsed);
            if buf.len() > self.frame_max as usize + 1024 {
                return Err(hard(FRAME_ERROR, "frame exceeds frame_max"));
            }
            tokio::select! {
                n = rd.read(&mut chunk), if !held => match n {
                    Ok(0) | Err(_) => return Ok(()),
                    Ok(n) => {
                        buf.extend_from_slice(&chunk[..n]);
                        last_seen = Instant::now();
                    }
                },
                Ok(()) = alarms.changed() => {
                    let reason = alarms.borrow_and_update().reason();
                    self.tell_blocked(reason).await;
                    held = false;
                }
                Some(h) = hard_rx.recv() => return Err(h),
                _ = closing.cancelled() => {
                    return Err(hard(
                        CONNECTION_FORCED,
                        "CONNECTION_FORCED - broker forced connection closure with reason 'shutdown'",
                    ));
                }
                Ok(()) = meta.changed() => {
                    if let Some(why) = self.access_gone(&meta.borrow_and_update()) {
                        return Err(hard(CONNECTION_FORCED, format!("CONNECTION_FORCED - {why}")));
                    }
                }
                _ = tick.tick() => {
                    if held || self.told_blocked {
                        // Not reading is our doing, and a blocked client
                        // may stop sending altogether: not a dead client.
                        last_seen = Instant::now();
                    }
                    if self.heartbeat > 0 {
                        let hb = Duration::from_secs(self.heartbeat as u64);
                        if last_seen.elapsed() > hb * 2 {
                            return Err(hard(INTERNAL_ERROR, "missed heartbeats from client"));
                        }
                        if last_sent_heartbeat.elapsed() >= hb / 2 {
                            last_sent_heartbeat = Instant::now();
                            self.out.one(AMQPFrame::Heartbeat).await;
                        }
                    }
                }
            }
        }
    }

    /// Handle one frame; `Ok(false)` ends the connection cleanly.
    async fn handle(&mut self, frame: AMQPFrame) -> Result<bool, Hard> {
        match frame {
            AMQPFrame::Heartbeat => Ok(true),
            AMQPFrame::InvalidHeartbeat(_) => Err(hard(FRAME_ERROR, "heartbeat on a non-zero channel")),
            AMQPFrame::ProtocolHeader(_) => Err(hard(COMMAND_INVALID, "protocol header after the handshake")),
            AMQPFrame::Method(0, AMQPClass::Connection(m)) => self.connection_method(m).await,
            AMQPFrame::Method(0, _) | AMQPFrame::Header(0, _) | AMQPFrame::Body(0, _) => {
                Err(hard(COMMAND_INVALID, "non-connection frame on channel 0"))
            }
            other => {
                if self.state == State::Closing {
                    return Ok(true);
                }
                if self.state != State::Open {
                    return Err(hard(CHANNEL_ERROR, "channel frame before the connection is open"));
                }
                self.channel_frame(other).await.map(|_| true)
            }
        }
    }

    async fn connection_method(&mut self, m: connection::AMQPMethod) -> Result<bool, Hard> {
        use connection::AMQPMethod as M;
        match (&self.state, m) {
            (State::AwaitStartOk, M::StartOk(ok)) => {
                self.blocked_capable = matches!(
                    ok.client_properties.inner().get("capabilities"),
                    Some(AMQPValue::FieldTable(caps))
                        if matches!(caps.inner().get("connection.blocked"), Some(AMQPValue::Boolean(true)))
                );
                let login = |meta: &crate::metadata::MetaState| {
                    auth::authenticate(meta, ok.mechanism.as_str(), ok.response.as_bytes(), self.peer_loopback)
                };
                let mut result = login(&self.node.metadata());
                if result.is_err() {
                    // Perhaps a user just added through another node.
                    self.node.meta_barrier().await;
                    result = login(&self.node.metadata());
                }
                match result {
                    Ok(user) => self.user = Arc::from(user),
                    Err(text) => return Err(Hard { code: ACCESS_REFUSED, text, class: 10, method: 11 }),
                }
                self.state = State::AwaitTuneOk;
                self.out
                    .one(method(
                        0,
                        AMQPClass::Connection(M::Tune(connection::Tune {
                            channel_max: CHANNEL_MAX,
                            frame_max: FRAME_MAX,
                            heartbeat: HEARTBEAT,
                        })),
                    ))
                    .await;
                Ok(true)
            }
            (State::AwaitTuneOk, M::TuneOk(t)) => {
                if t.frame_max != 0 && t.frame_max < 4096 {
                    return Err(hard(SYNTAX_ERROR, "frame_max below 4096"));
                }
                self.frame_max = if t.frame_max == 0 { FRAME_MAX } else { t.frame_max.min(FRAME_MAX) };
                self.heartbeat = t.heartbeat;
                self.state = State::AwaitOpen;
                Ok(true)
            }
            (State::AwaitOpen, M::Open(o)) => {
                let vhost = o.virtual_host.as_str();
                let mut meta = self.node.metadata();
                if meta.permission(&self.user, vhost).is_none() {
                    // Perhaps a vhost or permission just added through another node.
                    self.node.meta_barrier().await;
                    meta = self.node.metadata();
                }
                if !meta.vhosts.contains_key(vhost) {
                    return Err(hard(NOT_ALLOWED, format!("NOT_ALLOWED - vhost '{vhost}' not found")));
                }
                if meta.permission(&self.user, vhost).is_none() {
                    return Err(hard(
                        NOT_ALLOWED,
                        format!("NOT_ALLOWED - access to vhost '{vhost}' refused for user '{}'", self.user),
                    ));
                }
                self.vhost = Arc::from(vhost);
                self.node.clients().opened(self.conn_id, &self.user, vhost);
                self.state = State::Open;
                self.out.one(method(0, AMQPClass::Connection(M::OpenOk(connection::OpenOk {})))).await;
                Ok(true)
            }
            (_, M::Close(_)) => {
                self.out.one(method(0, AMQPClass::Connection(M::CloseOk(connection::CloseOk {})))).await;
                Ok(false)
            }
            (State::Closing, M::CloseOk(_)) => Ok(false),
            (_, M::Blocked(_) | M::Unblocked(_)) => Ok(true),
            (_, other) => Err(hard(COMMAND_INVALID, format!("unexpected {other:?} in this state"))),
        }
    }

    async fn channel_frame(&mut self, frame: AMQPFrame) -> Result<(), Hard> {
        let ch = match &frame {
            AMQPFrame::Method(c, _) | AMQPFrame::Header(c, _) | AMQPFrame::Body(c, _) => *c,
            _ => unreachable!("only channel frames get here"),
        };
        if let AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Open(_))) = frame {
            if ch > CHANNEL_MAX {
                return Err(hard(CHANNEL_ERROR, format!("channel {ch} above channel_max")));
            }
            if self.channels.contains_key(&ch) {
                return Err(hard(CHANNEL_ERROR, format!("channel {ch} already open")));
            }
            let (tx, rx) = mpsc::unbounded_channel();
            let closed = CancellationToken::new();
            let deliveries = Arc::new(Deliveries::default());
            let chan = Channel {
                id: ch,
                owner: self.node.owners().new_owner_held(deliveries.clone()),
                node: self.node.clone(),
                out: self.out.clone(),
                frame_max: self.frame_max,
                confirm: false,
                tx: None,
                publish_seq: 0,
                pending: None,
                batch: None,
                deliveries,
                consumers: HashMap::new(),
                delivery_gate: Arc::default(),
                next_consumer: 0,
                closed: closed.clone(),
                in_flight: self.in_flight.clone(),
                hard: self.hard_tx.clone().expect("hard_tx"),
                conn_id: self.conn_id,
                exclusive: self.exclusive.clone(),
                user: self.user.clone(),
                vhost: self.vhost.clone(),
                grants: Grants::default(),
                confirms: None,
            };
            self.channels.insert(ch, ChannelHandle { tx, closed });
            self.node.clients().channel_opened(self.conn_id, ch);
            tokio::spawn(chan.run(rx));
            self.out.one(method(ch, AMQPClass::Channel(channel::AMQPMethod::OpenOk(channel::OpenOk {})))).await;
            return Ok(());
        }
        let is_close_ok = matches!(frame, AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))));
        let is_close = matches!(frame, AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Close(_))));
        match self.channels.get(&ch) {
            Some(h) => {
                let _ = h.tx.send(frame);
                if is_close || is_close_ok {
                    // The channel task finishes the close; the id is free again.
                    self.channels.remove(&ch);
                }
                Ok(())
            }
            None if is_close_ok => Ok(()),
            None => Err(hard(CHANNEL_ERROR, format!("channel {ch} is not open"))),
        }
    }
}

#[derive(Clone, Copy)]
enum Settle {
    Ack,
    Nack { requeue: bool },
}

impl Settle {
    fn cmd(self, tags: Vec<u64>) -> QueueCmd {
        match self {
            Settle::Ack => QueueCmd::Ack { tags },
            Settle::Nack { requeue } => QueueCmd::Nack { tags, requeue },
        }
    }
}

/// A transaction's work, applied at commit: per queue, its publishes and
/// settlements go to the master as one batch, so they land in one Raft entry.
#[derive(Default)]
struct TxBuffer {
    /// Per queue, the messages and their own TTLs.
    publishes: BTreeMap<String, Vec<(Message, Option<u64>)>>,
    settles: Vec<(u64, bool, Settle)>,
}

/// Publishes of one channel to one queue, received back to back. They go
/// to the queue's master as one command: one submit, one reply, one confirm
/// wait for them all instead of one each (a third of a master's CPU went to
/// that per-publish machinery). Sent once the channel has no frame waiting,
/// before any other method, and when full, so a lone publish waits for
/// nothing and the channel's operations reach the log in their order.
struct PublishBatch {
    queue: String,
    msgs: Vec<Message>,
    ttls: Vec<Option<u64>>,
    bytes: usize,
    /// Confirm mode: the first one's seq (the others follow it).
    first_seq: Option<u64>,
    received: Instant,
    permits: OwnedSemaphorePermit,
}

/// Bounds on a [`PublishBatch`], like those on a Raft entry.
const BATCH_MSGS: usize = 512;
const BATCH_BYTES: usize = 128 << 10;

impl PublishBatch {
    fn full(&self) -> bool {
        self.msgs.len() >= BATCH_MSGS || self.bytes >= BATCH_BYTES
    }
}

struct PendingPublish {
    publish: basic::Publish,
    header: Option<AMQPContentHeader>,
    body: Vec<u8>,
}

struct Channel {
    id: u16,
    /// Owner of this channel's unacked messages in every queue.
    owner: u64,
    node: Node,
    out: Out,
    frame_max: u32,
    confirm: bool,
    /// `tx.select`ed: publishes and settlements wait here for `tx.commit`.
    tx: Option<TxBuffer>,
    publish_seq: u64,
    pending: Option<PendingPublish>,
    batch: Option<PublishBatch>,
    deliveries: Arc<Deliveries>,
    consumers: HashMap<String, CancellationToken>,
    /// Held by a consumer while it checks it is still running and queues a
    /// delivery, and by `basic.cancel` and channel close while they stop
    /// consumers: so no delivery follows a `cancel-ok` or `close-ok` (a
    /// client closing its channel fails on one; lapin does).
    delivery_gate: Arc<tokio::sync::Mutex<()>>,
    /// Numbers this channel's consumers, for their prefetch counts.
    next_consumer: ConsumerId,
    closed: CancellationToken,
    in_flight: Arc<Semaphore>,
    hard: mpsc::Sender<Hard>,
    conn_id: u64,
    /// Exclusive queues this connection declared: deleted when it closes.
    exclusive: Arc<Mutex<BTreeSet<String>>>,
    user: Arc<str>,
    /// Names from the client are in this vhost: the engine gets keys.
    vhost: Arc<str>,
    grants: Grants,
    /// In confirm mode: the task that sends acks and nacks.
    confirms: Option<mpsc::UnboundedSender<confirms::Pending>>,
}

/// A channel-level error: `channel.close` with this code.
struct Soft {
    code: u16,
    text: String,
    class: u16,
    method: u16,
}

fn soft(code: u16, text: impl Into<String>, class: u16, method: u16) -> Soft {
    Soft { code, text: text.into(), class, method }
}

fn unknown_tag(tag: u64, class: u16, method: u16) -> Soft {
    soft(PRECONDITION_FAILED, format!("PRECONDITION_FAILED - unknown delivery tag {tag}"), class, method)
}

fn not_transactional(method: u16) -> Soft {
    soft(PRECONDITION_FAILED, "PRECONDITION_FAILED - channel is not transactional", 90, method)
}

impl Channel {
    /// The engine's key of a queue or exchange the client named.
    fn key(&self, name: &str) -> String {
        names::key(&self.vhost, name)
    }

    /// 403 unless the user may have `access` to the `kind` (queue or
    /// exchange) `name` in this vhost.
    fn may(
        &mut self,
        access: Access,
        kind: &str,
        name: &str,
        class: u16,
        method: u16,
    ) -> Result<(), Result<Soft, Hard>> {
        let meta = self.node.metadata();
        if self.grants.allows(&meta, &self.user, &self.vhost, access, name) {
            return Ok(());
        }
        let name = if name.is_empty() { "amq.default" } else { name };
        Err(Ok(soft(
            ACCESS_REFUSED,
            format!(
                "ACCESS_REFUSED - {} access to {kind} '{name}' in vhost '{}' refused for user '{}'",
                access.as_str(),
                self.vhost,
                self.user
            ),
            class,
            method,
        )))
    }

    fn not_found(&self, kind: &str, name: &str, class: u16, method: u16) -> Result<Soft, Hard> {
        Ok(soft(NOT_FOUND, format!("NOT_FOUND - no {kind} '{name}' in vhost '{}'", self.vhost), class, method))
    }

    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<AMQPFrame>) {
        let mut closing = false;
        while let Some(frame) = rx.recv().await {
            if closing {
                if let AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))) = frame {
                    break;
                }
                continue;
            }
            let result = self.frame(frame).await;
            if rx.is_empty() || result.is_err() {
                self.flush_publishes().await;
            }
            match result {
                Ok(true) => {}
                Ok(false) => break,
                Err(Ok(s)) => {
                    closing = true;
                    self.shutdown().await;
                    self.out
                        .one(method(
                            self.id,
                            AMQPClass::Channel(channel::AMQPMethod::Close(channel::Close {
                                reply_code: s.code,
                                reply_text: ss(&s.text),
                                class_id: s.class,
                                method_id: s.method,
                            })),
                        ))
                        .await;
                }
                Err(Err(h)) => {
                    let _ = self.hard.send(h).await;
                    break;
                }
            }
        }
        self.flush_publishes().await;
        self.shutdown().await;
    }

    /// Stop consumers and give back unacked messages (requeued, redelivered).
    async fn shutdown(&mut self) {
        let gate = self.delivery_gate.clone();
        let _gate = gate.lock().await;
        self.closed.cancel();
        for q in self.node.clients().channel_closed(self.conn_id, self.id) {
            let node = self.node.clone();
            tokio::spawn(async move { node.consumer_gone(&q).await });
        }
        for (_, c) in self.consumers.drain() {
            c.cancel();
        }
        let queues = self.deliveries.queues_held();
        self.deliveries.forget_all();
        for q in queues {
            let node = self.node.clone();
            let owner = self.owner;
            tokio::spawn(async move {
                if let Err(e) = node.queue_op(&q, vec![QueueCmd::Release { owner }]).await {
                    tracing::warn!(queue = %q, error = %e, "could not requeue a closed channel's messages");
                }
            });
        }
        // Whatever this release misses (a get that was still on its way,
        // a master that changed meanwhile) the masters' reapers give back.
        self.node.owners().gone(self.owner);
    }

    /// `Ok(false)`: the channel is closed.
    async fn frame(&mut self, frame: AMQPFrame) -> Result<bool, Result<Soft, Hard>> {
        match frame {
            AMQPFrame::Method(_, class) => {
                if self.pending.is_some() {
                    return Err(Err(hard(UNEXPECTED_FRAME, "method frame while content was expected")));
                }
                if !matches!(class, AMQPClass::Basic(basic::AMQPMethod::Publish(_))) {
                    self.flush_publishes().await;
                }
                self.method(class).await
            }
            AMQPFrame::Header(_, header) => {
                let Some(p) = self.pending.as_mut() else {
                    return Err(Err(hard(UNEXPECTED_FRAME, "content header without basic.publish")));
                };
                if p.header.is_some() {
                    return Err(Err(hard(UNEXPECTED_FRAME, "second content header")));
                }
                let size = header.body_size;
                p.header = Some(header);
                if size == 0 {
                    self.publish_complete().await?;
                }
                Ok(true)
            }
            AMQPFrame::Body(_, data) => {
                let Some(p) = self.pending.as_mut() else {
                    return Err(Err(hard(UNEXPECTED_FRAME, "content body without basic.publish")));
                };
                let Some(h) = p.header.as_ref() else {
                    return Err(Err(hard(UNEXPECTED_FRAME, "content body before its header")));
                };
                p.body.extend_from_slice(&data);
                if p.body.len() as u64 > h.body_size {
                    return Err(Err(hard(FRAME_ERROR, "content body longer than announced")));
                }
                if p.body.len() as u64 == h.body_size {
                    self.publish_complete().await?;
                }
                Ok(true)
            }
            _ => Err(Err(hard(UNEXPECTED_FRAME, "unexpected frame on a channel"))),
        }
    }

    async fn reply(&self, class: AMQPClass) {
        self.out.one(method(self.id, class)).await;
    }

    async fn method(&mut self, class: AMQPClass) -> Result<bool, Result<Soft, Hard>> {
        match class {
            AMQPClass::Channel(channel::AMQPMethod::Close(_)) => {
                self.shutdown().await;
                self.reply(AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {}))).await;
                Ok(false)
            }
            AMQPClass::Channel(channel::AMQPMethod::Flow(f)) => {
                self.reply(AMQPClass::Channel(channel::AMQPMethod::FlowOk(channel::FlowOk { active: f.active }))).await;
                Ok(true)
            }
            AMQPClass::Channel(channel::AMQPMethod::CloseOk(_)) => Ok(true),
            AMQPClass::Confirm(confirm::AMQPMethod::Select(s)) => {
                if self.tx.is_some() {
                    return Err(Ok(soft(
                        PRECONDITION_FAILED,
                        "PRECONDITION_FAILED - cannot switch from tx to confirm mode",
                        85,
                        10,
                    )));
                }
                self.confirm = true;
                if !s.nowait {
                    self.reply(AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(confirm::SelectOk {}))).await;
                }
                Ok(true)
            }
            AMQPClass::Queue(m) => self.queue_method(m).await,
            AMQPClass::Exchange(m) => self.exchange_method(m).await,
            AMQPClass::Tx(m) => self.tx_method(m).await,
            AMQPClass::Basic(m) => self.basic_method(m).await,
            other => Err(Err(hard(
                NOT_IMPLEMENTED,
                format!(
                    "NOT_IMPLEMENTED - {} (exchanges, bindings and transactions are not built yet)",
                    class_name(&other)
                ),
            ))),
        }
    }

    async fn queue_method(&mut self, m: queue::AMQPMethod) -> Result<bool, Result<Soft, Hard>> {
        use queue::AMQPMethod as Q;
        match m {
            Q::Declare(d) => {
                let mut name = d.queue.as_str().to_string();
                if name.is_empty() {
                    name = format!("amq.gen-{:016x}", rand_id());
                }
                if let Err(why) = names::check("queue", &name) {
                    return Err(Ok(soft(PRECONDITION_FAILED, format!("PRECONDITION_FAILED - {why}"), 50, 10)));
                }
                if !d.passive {
                    self.may(Access::Configure, "queue", &name, 50, 10)?;
                }
                let bare = name;
                let name = self.key(&bare);
                if name.starts_with("amq.") && !d.queue.as_str().is_empty() && !d.passive {
                    return Err(Ok(soft(
                        ACCESS_REFUSED,
                        format!("ACCESS_REFUSED - queue name '{name}' contains reserved prefix 'amq.*'"),
                        50,
                        10,
                    )));
                }
                let existing = self.node.find_queue(&name).await.ok();
                if d.passive && existing.is_none() {
                    return Err(self.not_found("queue", &bare, 50, 10));
                }
                let args = if d.passive {
                    None
                } else {
                    let parsed = QueueArgs::parse(&to_args(&d.arguments))
                        .map_err(|why| Ok(soft(PRECONDITION_FAILED, format!("PRECONDITION_FAILED - {why}"), 50, 10)))?;
                    Some(parsed)
                };
                let q = match existing {
                    Some(q) => {
                        if let Some(arg) = args.as_ref().and_then(|a| a.inequivalent(&q.args)) {
                            return Err(Ok(soft(
                                PRECONDITION_FAILED,
                                format!(
                                    "PRECONDITION_FAILED - inequivalent arg '{arg}' for queue '{bare}' in vhost '{}': \
                                     received {} but current is {}",
                                    self.vhost,
                                    args.as_ref().map(|a| a.to_json()).unwrap_or_default(),
                                    q.args.to_json()
                                ),
                                50,
                                10,
                            )));
                        }
                        q
                    }
                    None => {
                        let min_masters = match d.arguments.inner().get(&ss("x-queue-master-locator")) {
                            None => None,
                            Some(AMQPValue::LongString(v)) if v.as_bytes() == b"min-masters" => Some(true),
                            Some(AMQPValue::LongString(v)) if v.as_bytes() == b"client-local" => Some(false),
                            Some(other) => {
                                return Err(Ok(soft(
                                    PRECONDITION_FAILED,
                                    format!("PRECONDITION_FAILED - invalid x-queue-master-locator {other:?}"),
                                    50,
                                    10,
                                )))
                            }
                        };
                        let opts = DeclareOpts {
                            min_masters,
                            exclusive_owner: d.exclusive.then_some(self.conn_id),
                            auto_delete: d.auto_delete,
                            args: args.clone().unwrap_or_default(),
                        };
                        // Placed by the effective policy (none: one replica, here).
                        let (q, created) = self
                            .node
                            .declare_queue_with(&name, Vec::new(), opts)
                            .await
                            .map_err(|e| Ok(node_soft(e, 50, 10)))?;
                        if created && d.exclusive {
                            self.exclusive.lock().expect("poisoned").insert(name.clone());
                        }
                        q
                    }
                };
                self.check_exclusive(&q, 50, 10)?;
                let (ready, _) = self.node.status(&name).await.map_err(|e| Ok(node_soft(e, 50, 10)))?;
                if !d.nowait {
                    let consumers = self.node.consumers_of(&name).await.len();
                    self.reply(AMQPClass::Queue(Q::DeclareOk(queue::DeclareOk {
                        queue: ss(&bare),
                        message_count: ready.min(u32::MAX as u64) as u32,
                        consumer_count: consumers as u32,
                    })))
                    .await;
                }
                Ok(true)
            }
            Q::Purge(p) => {
                self.may(Access::Read, "queue", p.queue.as_str(), 50, 30)?;
                let name = self.key(p.queue.as_str());
                self.locked_check(&name, 50, 30).await?;
                let n = self.node.purge(&name).await.map_err(|e| Ok(node_soft(e, 50, 30)))?;
                if !p.nowait {
                    self.reply(AMQPClass::Queue(Q::PurgeOk(queue::PurgeOk { message_count: n as u32 }))).await;
                }
                Ok(true)
            }
            Q::Delete(d) => {
                let bare = d.queue.as_str();
                self.may(Access::Configure, "queue", bare, 50, 40)?;
                let key = self.key(bare);
                let name = key.as_str();
                self.locked_check(name, 50, 40).await?;
                let (ready, unacked) = self.node.status(name).await.map_err(|e| Ok(node_soft(e, 50, 40)))?;
                if d.if_unused && !self.node.consumers_of(name).await.is_empty() {
                    return Err(Ok(soft(
                        PRECONDITION_FAILED,
                        format!("PRECONDITION_FAILED - queue '{bare}' in vhost '{}' in use", self.vhost),
                        50,
                        40,
                    )));
                }
                if d.if_empty && ready + unacked > 0 {
                    return Err(Ok(soft(
                        PRECONDITION_FAILED,
                        format!("PRECONDITION_FAILED - queue '{bare}' in vhost '{}' not empty", self.vhost),
                        50,
                        40,
                    )));
                }
                self.node.delete_queue(name).await.map_err(|e| Ok(node_soft(e, 50, 40)))?;
                if !d.nowait {
                    self.reply(AMQPClass::Queue(Q::DeleteOk(queue::DeleteOk { message_count: ready as u32 }))).await;
                }
                Ok(true)
            }
            Q::Bind(b) => {
                self.may(Access::Write, "queue", b.queue.as_str(), 50, 20)?;
                self.may(Access::Read, "exchange", b.exchange.as_str(), 50, 20)?;
                let binding = self.binding_of(&b.exchange, &b.queue, &b.routing_key, &b.arguments);
                self.node.bind(binding).await.map_err(|e| Ok(node_soft(e, 50, 20)))?;
                if !b.nowait {
                    self.reply(AMQPClass::Queue(Q::BindOk(queue::BindOk {}))).await;
                }
                Ok(true)
            }
            Q::Unbind(b) => {
                self.may(Access::Write, "queue", b.queue.as_str(), 50, 50)?;
                self.may(Access::Read, "exchange", b.exchange.as_str(), 50, 50)?;
                let binding = self.binding_of(&b.exchange, &b.queue, &b.routing_key, &b.arguments);
                self.node.unbind(binding).await.map_err(|e| Ok(node_soft(e, 50, 50)))?;
                self.reply(AMQPClass::Queue(Q::UnbindOk(queue::UnbindOk {}))).await;
                Ok(true)
            }
            other => Err(Err(hard(COMMAND_INVALID, format!("queue.{other:?} is not a client method")))),
        }
    }

    async fn exchange_method(&mut self, m: exchange::AMQPMethod) -> Result<bool, Result<Soft, Hard>> {
        use exchange::AMQPMethod as E;
        match m {
            E::Declare(d) => {
                let bare = d.exchange.as_str();
                if let Err(why) = names::check("exchange", bare) {
                    return Err(Ok(soft(PRECONDITION_FAILED, format!("PRECONDITION_FAILED - {why}"), 40, 10)));
                }
                let name = self.key(bare);
                if d.passive {
                    if self.node.metadata().exchange(&name).is_none() && {
                        self.node.meta_barrier().await;
                        self.node.metadata().exchange(&name).is_none()
                    } {
                        return Err(self.not_found("exchange", bare, 40, 10));
                    }
                } else {
                    self.may(Access::Configure, "exchange", bare, 40, 10)?;
                    let Some(kind) = ExchangeKind::parse(d.kind.as_str()) else {
                        return Err(Err(hard(
                            COMMAND_INVALID,
                            format!("COMMAND_INVALID - unknown exchange type '{}'", d.kind.as_str()),
                        )));
                    };
                    let ex = ExchangeMeta {
                        name,
                        kind,
                        durable: d.durable,
                        auto_delete: d.auto_delete,
                        internal: d.internal,
                    };
                    self.node.declare_exchange(ex).await.map_err(|e| Ok(node_soft(e, 40, 10)))?;
                }
                if !d.nowait {
                    self.reply(AMQPClass::Exchange(E::DeclareOk(exchange::DeclareOk {}))).await;
                }
                Ok(true)
            }
            E::Delete(d) => {
                self.may(Access::Configure, "exchange", d.exchange.as_str(), 40, 20)?;
                self.node
                    .delete_exchange(&self.key(d.exchange.as_str()), d.if_unused)
                    .await
                    .map_err(|e| Ok(node_soft(e, 40, 20)))?;
                if !d.nowait {
                    self.reply(AMQPClass::Exchange(E::DeleteOk(exchange::DeleteOk {}))).await;
                }
                Ok(true)
            }
            other => Err(Err(hard(
                NOT_IMPLEMENTED,
                format!("NOT_IMPLEMENTED - exchange.{other:?} (exchange-to-exchange bindings)"),
            ))),
        }
    }

    /// Another connection's exclusive queue: 405 RESOURCE_LOCKED.
    fn check_exclusive(
        &self,
        q: &crate::metadata::QueueMeta,
        class: u16,
        method: u16,
    ) -> Result<(), Result<Soft, Hard>> {
        match q.exclusive_owner {
            Some(owner) if owner != self.conn_id => Err(Ok(soft(
                RESOURCE_LOCKED,
                format!(
                    "RESOURCE_LOCKED - cannot obtain exclusive access to locked queue '{}' in vhost '{}'",
                    names::name_of(&q.name),
                    self.vhost
                ),
                class,
                method,
            ))),
            _ => Ok(()),
        }
    }

    async fn locked_check(&self, queue: &str, class: u16, method: u16) -> Result<(), Result<Soft, Hard>> {
        match self.node.find_queue(queue).await {
            Ok(q) => self.check_exclusive(&q, class, method),
            Err(_) => Ok(()),
        }
    }

    async fn basic_method(&mut self, m: basic::AMQPMethod) -> Result<bool, Result<Soft, Hard>> {
        use basic::AMQPMethod as B;
        match m {
            B::Publish(p) => {
                self.may(Access::Write, "exchange", p.exchange.as_str(), 60, 40)?;
                self.pending = Some(PendingPublish { publish: p, header: None, body: Vec::new() });
                Ok(true)
            }
            B::Qos(q) => {
                self.deliveries.set_prefetch(q.prefetch_count, q.global);
                self.reply(AMQPClass::Basic(B::QosOk(basic::QosOk {}))).await;
                Ok(true)
            }
            B::Get(g) => {
                self.may(Access::Read, "queue", g.queue.as_str(), 60, 70)?;
                let queue = self.key(g.queue.as_str());
                self.locked_check(&queue, 60, 70).await?;
                let (got, remaining) =
                    self.node.fetch(&queue, self.owner, 1, g.no_ack).await.map_err(|e| Ok(node_soft(e, 60, 70)))?;
                match got.into_iter().next() {
                    None => self.reply(AMQPClass::Basic(B::GetEmpty(basic::GetEmpty {}))).await,
                    Some(d) => {
                        self.node.metrics().delivered.inc();
                        let tag = self.deliveries.assign(&queue, d.tag, !g.no_ack, None);
                        let m = B::GetOk(basic::GetOk {
                            delivery_tag: tag,
                            redelivered: d.redelivered,
                            exchange: ss(&d.message.exchange),
                            routing_key: ss(&d.message.routing_key),
                            message_count: remaining as u32,
                        });
                        self.out.content(self.id, AMQPClass::Basic(m), &d.message, self.frame_max).await;
                    }
                }
                Ok(true)
            }
            B::Consume(c) => {
                let bare = c.queue.as_str().to_string();
                self.may(Access::Read, "queue", &bare, 60, 20)?;
                let queue = self.key(&bare);
                match self.node.find_queue(&queue).await {
                    Ok(q) => self.check_exclusive(&q, 60, 20)?,
                    Err(_) => return Err(self.not_found("queue", &bare, 60, 20)),
                }
                let tag = if c.consumer_tag.as_str().is_empty() {
                    format!("amq.ctag-{:016x}", rand_id())
                } else {
                    c.consumer_tag.as_str().to_string()
                };
                if self.consumers.contains_key(&tag) {
                    return Err(Err(hard(NOT_ALLOWED, format!("NOT_ALLOWED - attempt to reuse consumer tag '{tag}'"))));
                }
                // Cluster-wide, as the consumers of a queue may be on any node.
                let present = self.node.consumers_of(&queue).await;
                if (c.exclusive && !present.is_empty()) || present.iter().any(|k| k.exclusive) {
                    return Err(Ok(soft(
                        ACCESS_REFUSED,
                        format!("ACCESS_REFUSED - queue '{bare}' in vhost '{}' in exclusive use", self.vhost),
                        60,
                        20,
                    )));
                }
                self.next_consumer += 1;
                let id = self.next_consumer;
                let prefetch = self.deliveries.consumer_started(id);
                let stop = self.closed.child_token();
                self.consumers.insert(tag.clone(), stop.clone());
                self.node.clients().consuming(crate::clients::ConsumerInfo {
                    connection: self.conn_id,
                    channel: self.id,
                    tag: tag.clone(),
                    queue: queue.clone(),
                    ack_required: !c.no_ack,
                    prefetch,
                    exclusive: c.exclusive,
                });
                if !c.nowait {
                    self.reply(AMQPClass::Basic(B::ConsumeOk(basic::ConsumeOk { consumer_tag: ss(&tag) }))).await;
                }
                let consumer = Consumer {
                    id,
                    channel: self.id,
                    tag,
                    queue,
                    no_ack: c.no_ack,
                    owner: self.owner,
                    connection: self.conn_id,
                    node: self.node.clone(),
                    out: self.out.clone(),
                    deliveries: self.deliveries.clone(),
                    frame_max: self.frame_max,
                    stop,
                    gate: self.delivery_gate.clone(),
                };
                tokio::spawn(consumer.run());
                Ok(true)
            }
            B::Cancel(c) => {
                if let Some(t) = self.consumers.remove(c.consumer_tag.as_str()) {
                    let _gate = self.delivery_gate.lock().await;
                    t.cancel();
                }
                if let Some(q) = self.node.clients().stopped_consuming(self.conn_id, self.id, c.consumer_tag.as_str()) {
                    let node = self.node.clone();
                    tokio::spawn(async move { node.consumer_gone(&q).await });
                }
                if !c.nowait {
                    self.reply(AMQPClass::Basic(B::CancelOk(basic::CancelOk { consumer_tag: c.consumer_tag }))).await;
                }
                Ok(true)
            }
            B::Ack(a) => self.settle(a.delivery_tag, a.multiple, Settle::Ack, 80).await,
            B::Nack(n) => self.settle(n.delivery_tag, n.multiple, Settle::Nack { requeue: n.requeue }, 120).await,
            B::Reject(r) => self.settle(r.delivery_tag, false, Settle::Nack { requeue: r.requeue }, 90).await,
            B::Recover(r) => {
                self.requeue_all(r.requeue).await;
                self.reply(AMQPClass::Basic(B::RecoverOk(basic::RecoverOk {}))).await;
                Ok(true)
            }
            B::RecoverAsync(r) => {
                self.requeue_all(r.requeue).await;
                Ok(true)
            }
            other => Err(Err(hard(COMMAND_INVALID, format!("basic.{other:?} is not a client method")))),
        }
    }

    async fn requeue_all(&mut self, _requeue: bool) {
        // RabbitMQ requeues in both cases; so do we.
        if let Ok(mut taken) = self.deliveries.take(0, true, true) {
            for (q, tags) in std::mem::take(&mut taken.by_queue) {
                let _ = self.node.nack(&q, tags, true).await;
                self.deliveries.settled(&taken.holders(&q));
            }
        }
    }

    async fn settle(
        &mut self,
        tag: u64,
        multiple: bool,
        how: Settle,
        method_id: u16,
    ) -> Result<bool, Result<Soft, Hard>> {
        let unknown = |t: u64| Ok(unknown_tag(t, 60, method_id));
        if let Some(tx) = self.tx.as_mut() {
            if !multiple && !self.deliveries.is_unacked(tag) {
                return Err(unknown(tag));
            }
            tx.settles.push((tag, multiple, how));
            return Ok(true);
        }
        let requeued = matches!(how, Settle::Nack { requeue: true });
        let mut taken = self.deliveries.take(tag, multiple, requeued).map_err(unknown)?;
        if matches!(how, Settle::Ack) {
            let n: usize = taken.by_queue.values().map(Vec::len).sum();
            self.node.metrics().acknowledged.inc_by(n as u64);
        }
        for (q, tags) in std::mem::take(&mut taken.by_queue) {
            let holders = taken.holders(&q);
            // Submitted here, in the channel's order: a message requeued
            // before a basic.consume or basic.get on the channel is back
            // before that takes anything (the consumer lane goes first into
            // an entry, and a get comes after). Only the answer is awaited
            // apart.
            let submitted = self.node.submit_in(&q, vec![how.cmd(tags)], Lane::Consumer).await;
            let deliveries = self.deliveries.clone();
            tokio::spawn(async move {
                let r = match submitted {
                    Ok(wait) => wait.await.map(|_| ()),
                    Err(e) => Err(e),
                };
                if let Err(e) = r {
                    tracing::warn!(queue = %q, error = %e, "settling deliveries failed");
                }
                deliveries.settled(&holders);
            });
        }
        Ok(true)
    }

    async fn tx_method(&mut self, m: tx::AMQPMethod) -> Result<bool, Result<Soft, Hard>> {
        use tx::AMQPMethod as T;
        match m {
            T::Select(_) => {
                if self.confirm {
                    return Err(Ok(soft(
                        PRECONDITION_FAILED,
                        "PRECONDITION_FAILED - cannot switch from confirm to tx mode",
                        90,
                        10,
                    )));
                }
                self.tx.get_or_insert_with(TxBuffer::default);
                self.reply(AMQPClass::Tx(T::SelectOk(tx::SelectOk {}))).await;
                Ok(true)
            }
            T::Rollback(_) => {
                let Some(tx) = self.tx.as_mut() else {
                    return Err(Ok(not_transactional(30)));
                };
                *tx = TxBuffer::default();
                self.reply(AMQPClass::Tx(T::RollbackOk(tx::RollbackOk {}))).await;
                Ok(true)
            }
            T::Commit(_) => {
                let Some(tx) = self.tx.as_mut() else {
                    return Err(Ok(not_transactional(20)));
                };
                let work = std::mem::take(tx);
                let mut per_queue: BTreeMap<String, Vec<QueueCmd>> = BTreeMap::new();
                for (q, published) in work.publishes {
                    let (msgs, ttls) = published.into_iter().unzip();
                    per_queue.entry(q).or_default().push(QueueCmd::enqueue(msgs, ttls));
                }
                let mut settled = Vec::new();
                for (tag, multiple, how) in work.settles {
                    let requeued = matches!(how, Settle::Nack { requeue: true });
                    let mut taken =
                        self.deliveries.take(tag, multiple, requeued).map_err(|t| Ok(unknown_tag(t, 90, 20)))?;
                    for (q, tags) in std::mem::take(&mut taken.by_queue) {
                        settled.extend(taken.holders(&q));
                        per_queue.entry(q).or_default().push(how.cmd(tags));
                    }
                }
                // One batch per queue: it lands in one Raft entry, all or
                // nothing; commit-ok follows every synchronised replica's fsync.
                let mut waits = Vec::new();
                for (q, cmds) in per_queue {
                    waits.push((q.clone(), self.node.submit(&q, cmds).await));
                }
                let mut failure = None;
                for (q, w) in waits {
                    let r = match w {
                        Ok(wait) => wait.await.map(|_| ()),
                        Err(e) => Err(e),
                    };
                    if let Err(e) = r {
                        failure.get_or_insert((q, e));
                    }
                }
                self.deliveries.settled(&settled);
                if let Some((q, e)) = failure {
                    return Err(Ok(soft(
                        506,
                        format!("RESOURCE_ERROR - commit on queue '{}' failed: {e}", names::name_of(&q)),
                        90,
                        20,
                    )));
                }
                self.reply(AMQPClass::Tx(T::CommitOk(tx::CommitOk {}))).await;
                Ok(true)
            }
            other => Err(Err(hard(COMMAND_INVALID, format!("tx.{other:?} is not a client method")))),
        }
    }

    /// Answer publishes once they are stored (or refused); the channel's
    /// confirm task coalesces the answers (see `confirms`).
    fn confirm_when(&mut self, pending: confirms::Pending) {
        let (id, out) = (self.id, self.out.clone());
        let confirms = self.confirms.get_or_insert_with(|| {
            confirms::spawn(id, move |frames| {
                let out = out.clone();
                async move { out.send(frames).await }
            })
        });
        let _ = confirms.send(pending);
    }

    async fn publish_complete(&mut self) -> Result<(), Result<Soft, Hard>> {
        let p = self.pending.take().expect("pending publish");
        let header = p.header.expect("header before completion");
        let exchange = p.publish.exchange.as_str().to_string();
        let routing_key = p.publish.routing_key.as_str().to_string();
        let headers = header.properties.headers().as_ref().map(to_args).unwrap_or_default();
        let ttl = expiration_ms(&header.properties)
            .map_err(|why| Ok(soft(PRECONDITION_FAILED, format!("PRECONDITION_FAILED - {why}"), 60, 40)))?;
        let received = Instant::now();
        self.node.metrics().received.inc();
        let Some(queues) = self.node.route_fresh(&self.key(&exchange), &routing_key, &headers).await else {
            return Err(self.not_found("exchange", &exchange, 60, 40));
        };
        let batched = queues.len() == 1 && self.tx.is_none();
        if !batched || self.batch.as_ref().is_some_and(|b| b.queue != queues[0] || b.full()) {
            // A batch's seqs are consecutive and its queue is one.
            self.flush_publishes().await;
        }
        let seq = if self.confirm {
            self.publish_seq += 1;
            Some(self.publish_seq)
        } else {
            None
        };
        let msg = Message {
            exchange: exchange.clone(),
            routing_key: routing_key.clone(),
            properties: encode_properties(&header.properties),
            body: p.body,
        };
        if queues.is_empty() {
            if p.publish.mandatory {
                let ret = basic::AMQPMethod::Return(basic::Return {
                    reply_code: NO_ROUTE,
                    reply_text: ss("NO_ROUTE"),
                    exchange: ss(&exchange),
                    routing_key: ss(&routing_key),
                });
                self.out.content(self.id, AMQPClass::Basic(ret), &msg, self.frame_max).await;
            }
            if let Some(seq) = seq {
                // After the return, in order with the other confirms.
                self.node.metrics().confirmed.inc();
                self.confirm_when(confirms::Pending {
                    first: seq,
                    count: 1,
                    stored: futures::future::ready(1).boxed(),
                });
            }
            return Ok(());
        }
        if let Some(tx) = self.tx.as_mut() {
            for q in queues {
                tx.publishes.entry(q).or_default().push((msg.clone(), ttl));
            }
            return Ok(());
        }
        if batched {
            let permit = match self.in_flight.clone().try_acquire_owned() {
                Ok(p) => p,
                Err(_) => {
                    // The batch's own permits may be what is missing.
                    self.flush_publishes().await;
                    self.in_flight.clone().acquire_owned().await.expect("semaphore never closed")
                }
            };
            let bytes = msg.body.len() + msg.properties.len();
            match self.batch.as_mut() {
                Some(b) => {
                    b.msgs.push(msg);
                    b.ttls.push(ttl);
                    b.bytes += bytes;
                    b.permits.merge(permit);
                }
                None => {
                    let queue = queues.into_iter().next().expect("one queue");
                    let (msgs, ttls) = (vec![msg], vec![ttl]);
                    self.batch =
                        Some(PublishBatch { queue, msgs, ttls, bytes, first_seq: seq, received, permits: permit });
                }
            }
            return Ok(());
        }
        let permit = self.in_flight.clone().acquire_owned().await.expect("semaphore never closed");
        // Start each queue's publish here, in channel order; wait elsewhere.
        let mut waits = Vec::with_capacity(queues.len());
        let mut msg = Some(msg);
        for (i, q) in queues.iter().enumerate() {
            // The last queue takes the message itself: no copy of its body
            // for the usual single queue.
            let m = if i + 1 == queues.len() { msg.take() } else { msg.clone() };
            let m = m.expect("taken only by the last queue");
            waits.push(self.node.submit(q, vec![QueueCmd::enqueue(vec![m], vec![ttl])]).await);
        }
        let node = self.node.clone();
        let done = async move {
            // Confirmed only when every queue it reached has confirmed it.
            let results = futures::future::join_all(waits.into_iter().zip(&queues).map(|(w, q)| async move {
                match w {
                    Ok(wait) => wait.await.and_then(|replies| stored_all(q, &replies)),
                    Err(e) => Err(e),
                }
            }))
            .await;
            drop(permit);
            let failed = queues.iter().zip(results).find_map(|(q, r)| r.err().map(|e| (q, e)));
            match failed {
                None => publishes_answered(&node, &queues[0], seq, received, 1, Ok(1)),
                Some((q, e)) => publishes_answered(&node, q, seq, received, 1, Err(e)),
            }
        };
        self.confirm_or_spawn(seq, 1, done);
        Ok(())
    }

    /// Send the batched publishes (see [`PublishBatch`]) to their queue.
    async fn flush_publishes(&mut self) {
        let Some(b) = self.batch.take() else { return };
        let count = b.msgs.len() as u64;
        let submitted = self.node.submit(&b.queue, vec![QueueCmd::enqueue(b.msgs, b.ttls)]).await;
        let (node, queue, first_seq, received, permits) =
            (self.node.clone(), b.queue, b.first_seq, b.received, b.permits);
        let done = async move {
            let result = match submitted {
                Ok(wait) => wait.await.map(|replies| stored_count(&replies).min(count)),
                Err(e) => Err(e),
            };
            drop(permits);
            publishes_answered(&node, &queue, first_seq, received, count, result)
        };
        self.confirm_or_spawn(first_seq, count, done);
    }

    /// In confirm mode, `count` publishes from `first_seq` are acked as far
    /// as `done` says they were stored; otherwise `done` just runs.
    fn confirm_or_spawn(
        &mut self,
        first_seq: Option<u64>,
        count: u64,
        done: impl Future<Output = u64> + Send + 'static,
    ) {
        match first_seq {
            Some(first) => self.confirm_when(confirms::Pending { first, count, stored: done.boxed() }),
            None => {
                tokio::spawn(done);
            }
        }
    }
}

/// Count and log the outcome of `count` publishes from one channel (how
/// many were stored, or why none was) and answer how many to ack.
fn publishes_answered(
    node: &Node,
    queue: &str,
    first_seq: Option<u64>,
    received: Instant,
    count: u64,
    result: Result<u64, NodeError>,
) -> u64 {
    match result {
        Ok(stored) => {
            if first_seq.is_some() {
                node.metrics().confirmed.inc_by(stored);
                let took = received.elapsed().as_secs_f64();
                for _ in 0..stored {
                    node.metrics().confirm_latency.observe(took);
                }
            }
            if stored < count {
                tracing::debug!(%queue, refused = count - stored, "queue full (x-overflow: reject-publish)");
            }
            stored
        }
        Err(e) => {
            match (&e, first_seq) {
                (NodeError::Refused(_), Some(_)) => tracing::debug!(%queue, error = %e, "publish refused; nacking"),
                (_, Some(_)) => tracing::warn!(%queue, error = %e, "publish not confirmed; nacking"),
                (_, None) => tracing::warn!(%queue, error = %e, "publish failed (no confirms requested)"),
            }
            0
        }
    }
}

impl Channel {
    fn binding_of(&self, exchange: &ShortString, queue: &ShortString, key: &ShortString, args: &FieldTable) -> Binding {
        Binding {
            exchange: self.key(exchange.as_str()),
            queue: self.key(queue.as_str()),
            routing_key: key.as_str().to_string(),
            args: to_args(args),
        }
    }
}

/// Frames an alarm holds back: the start of a publish.
fn is_publish(frame: &AMQPFrame) -> bool {
    matches!(frame, AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Publish(_))))
}

fn class_name(c: &AMQPClass) -> String {
    let s = format!("{c:?}");
    s.split('(').take(2).collect::<Vec<_>>().join(".").to_lowercase()
}

fn node_soft(e: NodeError, class: u16, method: u16) -> Soft {
    match e {
        NodeError::NoSuchQueue(q) => {
            let (vhost, name) = names::split(&q);
            soft(NOT_FOUND, format!("NOT_FOUND - no queue '{name}' in vhost '{vhost}'"), class, method)
        }
        NodeError::NotFound(what) => soft(NOT_FOUND, format!("NOT_FOUND - {what}"), class, method),
        NodeError::Conflict(why) => soft(PRECONDITION_FAILED, format!("PRECONDITION_FAILED - {why}"), class, method),
        NodeError::Refused(why) => soft(ACCESS_REFUSED, format!("ACCESS_REFUSED - {why}"), class, method),
        NodeError::Invalid(why) => soft(PRECONDITION_FAILED, format!("PRECONDITION_FAILED - {why}"), class, method),
        other => soft(INTERNAL_ERROR_SOFT, format!("{other}"), class, method),
    }
}

/// Soft stand-in for "the cluster could not do it now" (RabbitMQ answers
/// queue operations without a reachable master with 404/541 variants;
/// clients treat a channel close as retryable).
const INTERNAL_ERROR_SOFT: u16 = 506;

fn rand_id() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(Instant::now().elapsed().as_nanos());
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_texts_are_cut_to_a_short_string() {
        let long = "é".repeat(200);
        let cut = ss(&long);
        assert!(cut.as_str().len() <= 255);
        assert!(long.starts_with(cut.as_str()));
        assert_eq!(ss("NOT_FOUND").as_str(), "NOT_FOUND");
    }
}
