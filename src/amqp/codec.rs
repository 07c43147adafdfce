//! Bytes <-> frames and properties, via amq-protocol.

use amq_protocol::frame::{gen_frame, parse_frame, AMQPFrame};
use amq_protocol::protocol::basic::{gen_properties, parse_properties, AMQPProperties};

/// Outcome of trying to parse one frame from the front of a buffer.
pub enum Parsed {
    Frame(AMQPFrame, usize),
    Incomplete,
    Invalid(String),
}

pub fn parse(buf: &[u8]) -> Parsed {
    match parse_frame(buf) {
        Ok((rest, frame)) => Parsed::Frame(frame, buf.len() - rest.len()),
        Err(e) if e.is_incomplete() => Parsed::Incomplete,
        Err(e) => Parsed::Invalid(format!("{e:?}")),
    }
}

pub fn write_frame(frame: &AMQPFrame, out: &mut Vec<u8>) -> Result<(), String> {
    let buf = std::mem::take(out);
    match cookie_factory::gen(gen_frame(frame), buf) {
        Ok((buf, _)) => {
            *out = buf;
            Ok(())
        }
        Err(e) => Err(format!("cannot encode frame: {e:?}")),
    }
}

/// AMQP content properties as stored with a message: their wire encoding.
pub fn encode_properties(props: &AMQPProperties) -> Vec<u8> {
    cookie_factory::gen(gen_properties(props), Vec::new()).map(|(b, _)| b).unwrap_or_default()
}

pub fn decode_properties(bytes: &[u8]) -> AMQPProperties {
    if bytes.is_empty() {
        return AMQPProperties::default();
    }
    parse_properties(bytes).map(|(_, p)| p).unwrap_or_default()
}
