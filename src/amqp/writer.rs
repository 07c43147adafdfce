//! The connection's outgoing side: what channels and consumers hand the
//! writer task (frames, or contents already encoded), and helpers to build them.

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::AMQPClass;
use amq_protocol::types::ShortString;
use tokio::sync::mpsc;

use crate::amqp::codec;
use crate::queue::Message;

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
pub(super) struct Out(pub(super) mpsc::Sender<Outgoing>);

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
