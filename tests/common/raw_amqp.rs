//! A client of raw AMQP frames: what it sends goes in one write, exactly
//! (for tests of how the server reads pipelined frames).

use amq_protocol::frame::{gen_frame, parse_frame, AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{basic, connection, AMQPClass};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub struct Raw {
    sock: TcpStream,
    buf: Vec<u8>,
}

pub fn method(ch: u16, class: AMQPClass) -> AMQPFrame {
    AMQPFrame::Method(ch, class)
}

pub fn publish(ch: u16, queue: &str, body: &[u8]) -> [AMQPFrame; 3] {
    let p = basic::Publish { exchange: "".into(), routing_key: queue.into(), mandatory: false, immediate: false };
    let header = AMQPContentHeader { class_id: 60, body_size: body.len() as u64, properties: Default::default() };
    [
        method(ch, AMQPClass::Basic(basic::AMQPMethod::Publish(p))),
        AMQPFrame::Header(ch, header),
        AMQPFrame::Body(ch, body.to_vec()),
    ]
}

impl Raw {
    /// Connected and opened as guest on the default vhost.
    pub async fn open(port: u16) -> Self {
        let (r, answer) = Self::handshake(port).await;
        assert!(
            matches!(answer, AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::OpenOk(_)))),
            "connection.open answered with {answer:?}"
        );
        r
    }

    /// The server's `connection.start`, read after the protocol header.
    #[allow(dead_code)]
    pub async fn start_frame(port: u16) -> connection::Start {
        let sock = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let mut r = Raw { sock, buf: Vec::new() };
        r.sock.write_all(b"AMQP\x00\x00\x09\x01").await.unwrap();
        match r.next().await {
            AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Start(start))) => start,
            other => panic!("expected connection.start, got {other:?}"),
        }
    }

    /// Through the handshake as guest on the default vhost: the connection
    /// and the frame that answered `connection.open`.
    pub async fn handshake(port: u16) -> (Self, AMQPFrame) {
        let sock = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let mut r = Raw { sock, buf: Vec::new() };
        r.sock.write_all(b"AMQP\x00\x00\x09\x01").await.unwrap();
        assert!(matches!(
            r.next().await,
            AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Start(_)))
        ));
        let start_ok = connection::StartOk {
            client_properties: Default::default(),
            mechanism: "PLAIN".into(),
            response: "\0guest\0guest".into(),
            locale: "en_US".into(),
        };
        r.send(&[method(0, AMQPClass::Connection(connection::AMQPMethod::StartOk(start_ok)))]).await;
        assert!(matches!(r.next().await, AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Tune(_)))));
        let tune_ok = connection::TuneOk { channel_max: 16, frame_max: 131072, heartbeat: 0 };
        let open = connection::Open { virtual_host: "/".into() };
        r.send(&[
            method(0, AMQPClass::Connection(connection::AMQPMethod::TuneOk(tune_ok))),
            method(0, AMQPClass::Connection(connection::AMQPMethod::Open(open))),
        ])
        .await;
        let answer = r.next().await;
        (r, answer)
    }

    /// Bytes as they are, in one write.
    pub async fn send_bytes(&mut self, bytes: &[u8]) {
        self.sock.write_all(bytes).await.unwrap();
    }

    /// [`Raw::send_bytes`], `false` if the broker has closed the connection.
    #[allow(dead_code)]
    pub async fn try_send_bytes(&mut self, bytes: &[u8]) -> bool {
        self.sock.write_all(bytes).await.is_ok()
    }

    pub async fn send(&mut self, frames: &[AMQPFrame]) {
        let mut out = Vec::new();
        for f in frames {
            out = cookie_factory::gen(gen_frame(f), out).unwrap().0;
        }
        self.sock.write_all(&out).await.unwrap();
    }

    /// The next frame, or `None` once the broker closed the connection
    /// (or sent bytes that are no frame).
    pub async fn next_or_closed(&mut self) -> Option<AMQPFrame> {
        loop {
            match parse_frame(self.buf.as_slice()) {
                Ok((rest, frame)) => {
                    let used = self.buf.len() - rest.len();
                    self.buf.drain(..used);
                    return Some(frame);
                }
                Err(e) if e.is_incomplete() => {}
                Err(_) => return None,
            }
            let mut chunk = vec![0u8; 64 * 1024];
            match self.sock.read(&mut chunk).await {
                Ok(n) if n > 0 => self.buf.extend_from_slice(&chunk[..n]),
                _ => return None,
            }
        }
    }

    pub async fn next(&mut self) -> AMQPFrame {
        loop {
            match parse_frame(self.buf.as_slice()) {
                Ok((rest, frame)) => {
                    let used = self.buf.len() - rest.len();
                    self.buf.drain(..used);
                    return frame;
                }
                Err(e) if e.is_incomplete() => {}
                Err(e) => panic!("malformed frame from the broker: {e:?}"),
            }
            let mut chunk = vec![0u8; 64 * 1024];
            let n = tokio::time::timeout(Duration::from_secs(10), self.sock.read(&mut chunk))
                .await
                .expect("an answer in time")
                .unwrap();
            assert!(n > 0, "the broker closed the connection");
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}
