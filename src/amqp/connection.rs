//! One AMQP connection: handshake, channel 0, and a task per channel.
//!
//! The reader parses frames and hands each channel's frames to that
//! channel's task, so a slow operation on one channel (a get that goes to a
//! remote master) never holds up another. Channel tasks and consumers send
//! frames through one writer task; a delivery's method, header and body go as
//! one unit so nothing interleaves inside it.

use std::collections::{BTreeSet, HashMap};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, channel, connection, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable, LongString};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, Semaphore};
use tokio_util::sync::CancellationToken;

use super::auth::{self, Grants};
use super::codec::{self, Parsed};
use super::deliveries::Deliveries;
use crate::amqp::channel::Channel;
use crate::amqp::reply::{
    hard, Hard, ACCESS_REFUSED, CHANNEL_ERROR, COMMAND_INVALID, CONNECTION_FORCED, FRAME_ERROR, INTERNAL_ERROR,
    NOT_ALLOWED, SYNTAX_ERROR,
};
use crate::amqp::writer::{method, ss, Out, Outgoing};
use crate::metadata::names::DEFAULT_VHOST;
use crate::node::Node;

pub(in crate::amqp) const PROTOCOL_HEADER: &[u8; 8] = b"AMQP\x00\x00\x09\x01";
pub(in crate::amqp) const FRAME_MAX: u32 = 131_072;
pub(in crate::amqp) const CHANNEL_MAX: u16 = 2047;
pub(in crate::amqp) const HEARTBEAT: u16 = 60;
/// From the connect to `connection.open-ok`, as RabbitMQ's `handshake_timeout`:
/// a client that never finishes holds no socket for longer.
pub(in crate::amqp) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Publishes awaiting their confirm per connection; beyond this the reader
/// stops reading and TCP pushes back on the publisher.
pub(in crate::amqp) const MAX_IN_FLIGHT: usize = 10_000;

/// Serve one client on `stream` (plain TCP, or TLS with its handshake
/// done), connected from `peer` to `local`.
pub async fn run<S>(stream: S, peer: SocketAddr, local: String, node: Node, conn_id: u64) -> Result<(), String>
where
    S: AsyncRead + AsyncWrite + Send + 'static,
{
    let handshake_deadline = Instant::now() + HANDSHAKE_TIMEOUT;
    let (mut rd, mut wr) = tokio::io::split(stream);
    if !protocol_header(&mut rd, &mut wr, handshake_deadline).await? {
        return Ok(());
    }

    node.clients().connected(crate::clients::ConnectionInfo {
        id: conn_id,
        name: format!("{peer} -> {local}"),
        peer: peer.to_string(),
        user: String::new(),
        vhost: String::new(),
        node: node.name().to_string(),
        channels: Vec::new(),
    });
    let (tx, rx) = mpsc::channel::<Outgoing>(1024);
    let out = Out(tx);
    let writer = tokio::spawn(write_loop(rx, wr));

    let mut conn = Conn::new(node, conn_id, out.clone(), peer, handshake_deadline);
    conn.send_start().await;
    let result = conn.read_loop(&mut rd).await;
    conn.release().await;
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
    if result.is_ok() || told_to_leave || conn.state == State::Open {
        // The client closed (or is closing) the connection, or we closed an
        // open one. Whoever sent `connection.close` closes the socket after
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

/// Read and check the client's protocol header: `Ok(false)` if the client
/// left before sending one.
async fn protocol_header(
    rd: &mut (impl AsyncRead + Unpin),
    wr: &mut (impl AsyncWrite + Unpin),
    handshake_deadline: Instant,
) -> Result<bool, String> {
    let mut header = [0u8; 8];
    match tokio::time::timeout_at(handshake_deadline.into(), rd.read_exact(&mut header)).await {
        Ok(Ok(_)) => {}
        Ok(Err(_)) => return Ok(false),
        Err(_) => return Err("no protocol header within the handshake timeout".into()),
    }
    if &header != PROTOCOL_HEADER {
        // The spec's answer to a wrong protocol header: ours, then close.
        let _ = wr.write_all(PROTOCOL_HEADER).await;
        return Err(format!("bad protocol header {header:?}"));
    }
    Ok(true)
}

/// The writer task: what is queued meanwhile goes out in one write.
async fn write_loop(mut rx: mpsc::Receiver<Outgoing>, mut wr: impl AsyncWrite + Unpin) {
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
    task: tokio::task::JoinHandle<()>,
}

struct Conn {
    node: Node,
    conn_id: u64,
    out: Out,
    channels: HashMap<u16, ChannelHandle>,
    frame_max: u32,
    /// As negotiated: the highest channel number the client may open.
    channel_max: u16,
    heartbeat: u16,
    /// The connection must be open by then.
    handshake_deadline: Instant,
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
    /// A connection awaiting `connection.start-ok`; `Clients::close` tells
    /// it to close (CONNECTION_FORCED).
    fn new(node: Node, conn_id: u64, out: Out, peer: SocketAddr, handshake_deadline: Instant) -> Conn {
        let mut conn = Conn {
            node,
            conn_id,
            out,
            channels: HashMap::new(),
            frame_max: FRAME_MAX,
            channel_max: CHANNEL_MAX,
            heartbeat: 0,
            handshake_deadline,
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
        let closer = hard_tx.clone();
        conn.node.clients().closes_by(
            conn_id,
            Box::new(move |reason| {
                let _ = closer.try_send(hard(CONNECTION_FORCED, format!("CONNECTION_FORCED - {reason}")));
            }),
        );
        conn.hard_tx = Some(hard_tx);
        conn.hard_rx = Some(hard_rx);
        conn
    }

    /// As RabbitMQ answers `connection.close`: once its channels are
    /// closed, their unacked messages back in their queues.
    async fn close_channels(&mut self) {
        let tasks: Vec<_> = self
            .channels
            .drain()
            .map(|(_, ch)| {
                ch.closed.cancel();
                ch.task
            })
            .collect();
        let within = crate::amqp::channel::RELEASED_WITHIN;
        let _ = tokio::time::timeout(within, futures::future::join_all(tasks)).await;
    }

    /// The read loop ended: stop the channels, let go of the consumers and
    /// of the exclusive queues.
    async fn release(&mut self) {
        let _ = self.start_release().await;
    }

    /// Let go of the consumers and delete the exclusive queues, all at
    /// once, in a task of its own: a caller that stops waiting (a close
    /// answered within a bound) leaves it to finish. Later calls have
    /// nothing left to do.
    fn start_release(&mut self) -> tokio::task::JoinHandle<()> {
        for (_, ch) in self.channels.drain() {
            ch.closed.cancel();
        }
        let node = self.node.clone();
        let consumed = node.clients().disconnected(self.conn_id);
        // Exclusive queues live as long as the connection that declared them.
        let exclusive = std::mem::take(&mut *self.exclusive.lock().expect("poisoned"));
        tokio::spawn(async move {
            let gone = consumed.iter().map(|q| node.consumer_gone(q));
            let node = &node;
            let deletes = exclusive.iter().map(|q| async move {
                if let Err(e) = node.delete_queue(q).await {
                    tracing::warn!(queue = %q, error = %e, "could not delete an exclusive queue");
                }
            });
            futures::future::join(futures::future::join_all(gone), futures::future::join_all(deletes)).await;
        })
    }

    async fn send_start(&self) {
        let mut caps = FieldTable::default();
        for c in [
            "publisher_confirms",
            "basic.nack",
            "consumer_cancel_notify",
            "per_consumer_qos",
            "connection.blocked",
            "authentication_failure_close",
            "exchange_exchange_bindings",
            "consumer_priorities",
            "direct_reply_to",
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

    async fn read_loop(&mut self, rd: &mut (impl AsyncRead + Unpin)) -> Result<(), Hard> {
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
            // Refused on its header: its body is never waited for.
            if let Some(len) = codec::announced_len(&buf).filter(|len| *len > self.frame_max as u64) {
                return Err(hard(FRAME_ERROR, format!("frame of {len} bytes exceeds frame_max {}", self.frame_max)));
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
                    if !matches!(self.state, State::Open | State::Closing) && Instant::now() >= self.handshake_deadline {
                        return Err(hard(
                            CONNECTION_FORCED,
                            format!("handshake not finished within {} s", HANDSHAKE_TIMEOUT.as_secs()),
                        ));
                    }
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
            (State::AwaitStartOk, M::StartOk(ok)) => self.start_ok(ok).await,
            (State::AwaitTuneOk, M::TuneOk(t)) => {
                if t.frame_max != 0 && t.frame_max < 4096 {
                    return Err(hard(SYNTAX_ERROR, "frame_max below 4096"));
                }
                self.frame_max = if t.frame_max == 0 { FRAME_MAX } else { t.frame_max.min(FRAME_MAX) };
                self.channel_max = if t.channel_max == 0 { CHANNEL_MAX } else { t.channel_max.min(CHANNEL_MAX) };
                self.heartbeat = t.heartbeat;
                self.state = State::AwaitOpen;
                Ok(true)
            }
            (State::AwaitOpen, M::Open(o)) => self.open(o).await,
            (State::Open, M::UpdateSecret(u)) => self.update_secret(u).await,
            (_, M::Close(_)) => {
                // As RabbitMQ: by close-ok the connection's channels are
                // closed and its exclusive queues gone, so the client's
                // next connection may declare them again at once.
                self.close_channels().await;
                let released = self.start_release();
                let _ = tokio::time::timeout(crate::amqp::channel::RELEASED_WITHIN, released).await;
                self.out.one(method(0, AMQPClass::Connection(M::CloseOk(connection::CloseOk {})))).await;
                Ok(false)
            }
            (State::Closing, M::CloseOk(_)) => Ok(false),
            (_, M::Blocked(_) | M::Unblocked(_)) => Ok(true),
            (_, other) => Err(hard(COMMAND_INVALID, format!("unexpected {other:?} in this state"))),
        }
    }

    async fn start_ok(&mut self, ok: connection::StartOk) -> Result<bool, Hard> {
        use connection::AMQPMethod as M;
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

    async fn open(&mut self, o: connection::Open) -> Result<bool, Hard> {
        use connection::AMQPMethod as M;
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
        if let Err(max) = self.node.clients().opened(self.conn_id, &self.user, vhost) {
            return Err(hard(
                NOT_ALLOWED,
                format!("NOT_ALLOWED - connection limit ({max}) of node {} is reached", self.node.name()),
            ));
        }
        self.vhost = Arc::from(vhost);
        self.state = State::Open;
        self.out.one(method(0, AMQPClass::Connection(M::OpenOk(connection::OpenOk {})))).await;
        Ok(true)
    }

    /// As RabbitMQ: a client with an expiring credential (a token) gives the
    /// new one on the open connection. The users here are internal ones,
    /// whose credentials do not expire, so RabbitMQ's answer for them is
    /// update-secret-ok whatever the secret: nothing about the connection
    /// changes (who it is and what it may do were settled at login).
    async fn update_secret(&mut self, _u: connection::UpdateSecret) -> Result<bool, Hard> {
        use connection::AMQPMethod as M;
        self.out.one(method(0, AMQPClass::Connection(M::UpdateSecretOk(connection::UpdateSecretOk {})))).await;
        Ok(true)
    }

    async fn channel_frame(&mut self, frame: AMQPFrame) -> Result<(), Hard> {
        let ch = match &frame {
            AMQPFrame::Method(c, _) | AMQPFrame::Header(c, _) | AMQPFrame::Body(c, _) => *c,
            _ => unreachable!("only channel frames get here"),
        };
        if let AMQPFrame::Method(_, AMQPClass::Channel(channel::AMQPMethod::Open(_))) = frame {
            if ch > self.channel_max {
                return Err(hard(
                    NOT_ALLOWED,
                    format!("NOT_ALLOWED - channel {ch} is above the negotiated channel_max ({})", self.channel_max),
                ));
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
                reply: None,
            };
            self.node.clients().channel_opened(self.conn_id, ch);
            let task = tokio::spawn(chan.run(rx));
            self.channels.insert(ch, ChannelHandle { tx, closed, task });
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

/// Frames an alarm holds back: the start of a publish.
fn is_publish(frame: &AMQPFrame) -> bool {
    matches!(frame, AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Publish(_))))
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
