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

/// The per-message TTL an `expiration` property asks for, in ms. RabbitMQ
/// takes a non-negative integer in a string; anything else is refused.
pub fn expiration_ms(props: &AMQPProperties) -> Result<Option<u64>, String> {
    match props.expiration() {
        None => Ok(None),
        Some(v) => v
            .as_str()
            .parse::<u64>()
            .map(Some)
            .map_err(|_| format!("invalid expiration '{}': not a non-negative integer", v.as_str())),
    }
}

/// The same properties without `expiration` (a dead-lettered message must
/// not expire again by its old TTL), and the expiration it had.
pub fn without_expiration(props: AMQPProperties) -> (AMQPProperties, Option<String>) {
    let Some(exp) = props.expiration().as_ref().map(|e| e.as_str().to_string()) else {
        return (props, None);
    };
    // amq-protocol's fields are private: rebuild from every other one.
    let mut out = AMQPProperties::default();
    macro_rules! keep {
        ($get:ident, $with:ident) => {
            if let Some(v) = props.$get().clone() {
                out = out.$with(v);
            }
        };
    }
    keep!(content_type, with_content_type);
    keep!(content_encoding, with_content_encoding);
    keep!(headers, with_headers);
    keep!(delivery_mode, with_delivery_mode);
    keep!(priority, with_priority);
    keep!(correlation_id, with_correlation_id);
    keep!(reply_to, with_reply_to);
    keep!(message_id, with_message_id);
    keep!(timestamp, with_timestamp);
    keep!(kind, with_type);
    keep!(user_id, with_user_id);
    keep!(app_id, with_app_id);
    keep!(cluster_id, with_cluster_id);
    (out, Some(exp))
}

#[cfg(test)]
mod tests {
    use super::*;
    use amq_protocol::types::ShortString;

    #[test]
    fn expiration_is_parsed_and_stripped_keeping_the_rest() {
        let p = AMQPProperties::default()
            .with_expiration(ShortString::from("1500"))
            .with_message_id(ShortString::from("m"))
            .with_delivery_mode(2)
            .with_priority(3)
            .with_timestamp(7)
            .with_type(ShortString::from("t"));
        assert_eq!(expiration_ms(&p), Ok(Some(1500)));
        assert!(expiration_ms(&p.clone().with_expiration(ShortString::from("-1"))).is_err());
        assert!(expiration_ms(&p.clone().with_expiration(ShortString::from("soon"))).is_err());
        let (q, old) = without_expiration(p.clone());
        assert_eq!(old.as_deref(), Some("1500"));
        assert_eq!(*q.expiration(), None);
        assert_eq!(
            q,
            AMQPProperties::default()
                .with_message_id(ShortString::from("m"))
                .with_delivery_mode(2)
                .with_priority(3)
                .with_timestamp(7)
                .with_type(ShortString::from("t"))
        );
        let plain = AMQPProperties::default().with_app_id(ShortString::from("a"));
        assert_eq!(without_expiration(plain.clone()), (plain, None));
    }
}
