//! Bytes <-> frames and properties, via amq-protocol.

use amq_protocol::frame::{gen_frame, parse_frame, AMQPFrame};
use amq_protocol::protocol::AMQPClass;

/// Outcome of trying to parse one frame from the front of a buffer.
// Matched at once by the reader, never stored: boxing the frame would cost
// an allocation per frame for nothing.
#[allow(clippy::large_enum_variant)]
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

/// The whole size of the frame starting `buf` as its header announces it
/// (header and end octet included), once the header is in; `None` before,
/// and for the protocol header, which is no frame.
pub fn announced_len(buf: &[u8]) -> Option<u64> {
    if buf.len() < 7 || buf[0] == b'A' {
        return None;
    }
    Some(u32::from_be_bytes([buf[3], buf[4], buf[5], buf[6]]) as u64 + 8)
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

/// A method followed by its content header and body frames, encoded into
/// `out`. The header carries `properties` as stored, which is already their
/// wire encoding ([`encode_properties`]): decoding them only for
/// amq-protocol to encode them again cost about a sixth of a master's CPU
/// in a drain. The method frame still goes through amq-protocol; the
/// header and body frames are a fixed envelope around bytes we have.
pub fn write_content(
    ch: u16,
    class: AMQPClass,
    properties: &[u8],
    body: &[u8],
    frame_max: u32,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    write_frame(&AMQPFrame::Method(ch, class), out)?;
    write_content_frames(ch, properties, body, frame_max, out)
}

/// The header and body frames of [`write_content`], after a method frame
/// already written.
pub fn write_content_frames(
    ch: u16,
    properties: &[u8],
    body: &[u8],
    frame_max: u32,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    // No properties stored: none set, which is a zero flags word.
    let props: &[u8] = if properties.is_empty() { &[0, 0] } else { properties };
    let header_len = 2 + 2 + 8 + props.len();
    envelope(out, FRAME_HEADER, ch, header_len, |out| {
        out.extend_from_slice(&BASIC_CLASS.to_be_bytes());
        out.extend_from_slice(&0u16.to_be_bytes()); // weight
        out.extend_from_slice(&(body.len() as u64).to_be_bytes());
        out.extend_from_slice(props);
    })?;
    // A frame's 8 bytes of envelope count against frame-max.
    let chunk = (frame_max as usize).saturating_sub(8).max(1);
    for part in body.chunks(chunk) {
        envelope(out, FRAME_BODY, ch, part.len(), |out| out.extend_from_slice(part))?;
    }
    Ok(())
}

/// `basic.deliver` as a method frame, which a consumer is sent for every
/// message: amq-protocol's generic encoder, with a string allocated for each
/// of its three short strings, cost about a tenth of a master's CPU in a
/// drain. The layout is the spec's (class 60, method 60, consumer-tag,
/// delivery-tag, redelivered, exchange, routing-key); the tests check it
/// against amq-protocol's encoding.
pub fn write_deliver(
    ch: u16,
    consumer_tag: &str,
    delivery_tag: u64,
    redelivered: bool,
    exchange: &str,
    routing_key: &str,
    out: &mut Vec<u8>,
) -> Result<(), String> {
    let (ctag, ex, rk) = (short(consumer_tag), short(exchange), short(routing_key));
    let len = 4 + 1 + ctag.len() + 8 + 1 + 1 + ex.len() + 1 + rk.len();
    envelope(out, FRAME_METHOD, ch, len, |out| {
        out.extend_from_slice(&BASIC_CLASS.to_be_bytes());
        out.extend_from_slice(&BASIC_DELIVER.to_be_bytes());
        push_short(out, ctag);
        out.extend_from_slice(&delivery_tag.to_be_bytes());
        out.push(redelivered as u8);
        push_short(out, ex);
        push_short(out, rk);
    })
}

/// At most 255 bytes of `s`, cut at a character boundary, as a short
/// string must be.
pub fn short(s: &str) -> &str {
    let mut end = s.len().min(255);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn push_short(out: &mut Vec<u8>, s: &str) {
    out.push(s.len() as u8);
    out.extend_from_slice(s.as_bytes());
}

const FRAME_METHOD: u8 = 1;
const BASIC_DELIVER: u16 = 60;
const FRAME_HEADER: u8 = 2;
const FRAME_BODY: u8 = 3;
const FRAME_END: u8 = 0xCE;
const BASIC_CLASS: u16 = 60;

/// Frame type, channel, payload size, the payload `fill` writes, frame end.
fn envelope(out: &mut Vec<u8>, kind: u8, ch: u16, len: usize, fill: impl FnOnce(&mut Vec<u8>)) -> Result<(), String> {
    let size = u32::try_from(len).map_err(|_| format!("frame payload of {len} bytes is too big"))?;
    out.reserve(8 + len);
    out.push(kind);
    out.extend_from_slice(&ch.to_be_bytes());
    out.extend_from_slice(&size.to_be_bytes());
    let start = out.len();
    fill(out);
    debug_assert_eq!(out.len() - start, len);
    out.push(FRAME_END);
    Ok(())
}

#[cfg(test)]
mod tests {
    use amq_protocol::protocol::basic::AMQPProperties;

    use super::*;
    use crate::message::{decode_properties, encode_properties};

    /// amq-protocol's own encoding of the same frames is the reference.
    fn reference(ch: u16, class: AMQPClass, props: &[u8], body: &[u8], frame_max: u32) -> Vec<u8> {
        use amq_protocol::frame::AMQPContentHeader;
        let mut frames = vec![
            AMQPFrame::Method(ch, class),
            AMQPFrame::Header(
                ch,
                AMQPContentHeader { class_id: 60, body_size: body.len() as u64, properties: decode_properties(props) },
            ),
        ];
        frames.extend(body.chunks(frame_max as usize - 8).map(|p| AMQPFrame::Body(ch, p.to_vec())));
        let mut out = Vec::new();
        for f in &frames {
            write_frame(f, &mut out).unwrap();
        }
        out
    }

    #[test]
    fn content_is_encoded_as_amq_protocol_encodes_it() {
        use amq_protocol::protocol::basic;
        use amq_protocol::types::{AMQPValue, FieldTable, ShortString};
        let mut headers = FieldTable::default();
        headers.insert(ShortString::from("x-n"), AMQPValue::LongLongInt(7));
        let rich = AMQPProperties::default()
            .with_content_type(ShortString::from("text/plain"))
            .with_headers(headers)
            .with_delivery_mode(2)
            .with_priority(4)
            .with_message_id(ShortString::from("id-1"))
            .with_timestamp(1_700_000_000);
        let deliver = |tag| {
            AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                consumer_tag: ShortString::from("ctag"),
                delivery_tag: tag,
                redelivered: tag % 2 == 0,
                exchange: ShortString::from("ex"),
                routing_key: ShortString::from("rk"),
            }))
        };
        let long: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let cases: [(&[u8], Vec<u8>, u32); 5] = [
            (&[], Vec::new(), 131_072),
            (&[], b"hello".to_vec(), 131_072),
            (&encode_properties(&rich), b"body".to_vec(), 131_072),
            // Bodies cut at frame-max, the last part shorter.
            (&encode_properties(&rich), long.clone(), 4096),
            (&encode_properties(&AMQPProperties::default()), long, 10_008),
        ];
        for (i, (props, body, frame_max)) in cases.iter().enumerate() {
            let mut ours = Vec::new();
            write_content(3, deliver(i as u64 + 1), props, body, *frame_max, &mut ours).unwrap();
            assert_eq!(ours, reference(3, deliver(i as u64 + 1), props, body, *frame_max), "case {i}");
            // And a client parses it back into the same content.
            let mut rest = &ours[..];
            let mut parsed = Vec::new();
            while !rest.is_empty() {
                let Parsed::Frame(f, n) = parse(rest) else { panic!("case {i}: unparsable frame") };
                parsed.push(f);
                rest = &rest[n..];
            }
            let AMQPFrame::Header(3, h) = &parsed[1] else { panic!("case {i}: no header") };
            assert_eq!(h.properties, decode_properties(props));
            let got: Vec<u8> = parsed[2..]
                .iter()
                .flat_map(|f| if let AMQPFrame::Body(3, b) = f { b.clone() } else { panic!() })
                .collect();
            assert_eq!(&got, body, "case {i}");
        }
    }

    #[test]
    fn deliver_is_encoded_as_amq_protocol_encodes_it() {
        use amq_protocol::protocol::basic;
        use amq_protocol::types::ShortString;
        let long = "é".repeat(200);
        let cases = [
            ("ctag", 1u64, false, "", "q"),
            ("amq.ctag-x", u64::MAX, true, "ex.topic", "a.b.c"),
            (long.as_str(), 7, false, long.as_str(), long.as_str()),
        ];
        for (ctag, tag, redelivered, ex, rk) in cases {
            let mut ours = Vec::new();
            write_deliver(9, ctag, tag, redelivered, ex, rk, &mut ours).unwrap();
            let m = AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                consumer_tag: ShortString::from(short(ctag)),
                delivery_tag: tag,
                redelivered,
                exchange: ShortString::from(short(ex)),
                routing_key: ShortString::from(short(rk)),
            }));
            let mut theirs = Vec::new();
            write_frame(&AMQPFrame::Method(9, m), &mut theirs).unwrap();
            assert_eq!(ours, theirs, "{ctag} {tag}");
        }
        assert!(short(&long).len() <= 255 && long.starts_with(short(&long)));
    }
}
