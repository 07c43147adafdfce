//! A message as the broker keeps it, its AMQP content properties, and the
//! header and argument values routing compares. The properties are
//! encoded once at the front end, stored and replicated as bytes, decoded
//! where a property matters (expiration, dead-letter headers, the HTTP
//! API). A leaf: the queue, the front ends and the control plane share it.

use amq_protocol::protocol::basic::{gen_properties, parse_properties, AMQPProperties};
use amq_protocol::types::{AMQPValue, FieldTable};
use serde::{Deserialize, Serialize};

use std::collections::BTreeMap;

/// A message as stored and replicated. `properties` are the AMQP content
/// properties in their wire encoding ([`encode_properties`]; empty for
/// none), opaque to the queue and sent to consumers as they are.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Message {
    pub exchange: String,
    pub routing_key: String,
    #[serde(with = "serde_bytes")]
    pub properties: Vec<u8>,
    #[serde(with = "serde_bytes")]
    pub body: Vec<u8>,
}

/// AMQP content properties as stored with a message: their wire encoding.
pub fn encode_properties(props: &AMQPProperties) -> Vec<u8> {
    cookie_factory::gen(gen_properties(props), Vec::new()).map(|(b, _)| b).unwrap_or_default()
}

/// Whether `bytes` are a whole AMQP property list (flags and fields), as
/// [`encode_properties`] writes one; empty stands for none set. Front ends
/// send stored properties to clients as they are.
pub fn valid_properties(bytes: &[u8]) -> bool {
    bytes.is_empty() || matches!(parse_properties(bytes), Ok((rest, _)) if rest.is_empty())
}

pub fn decode_properties(bytes: &[u8]) -> AMQPProperties {
    if bytes.is_empty() {
        return AMQPProperties::default();
    }
    parse_properties(bytes).map(|(_, p)| p).unwrap_or_default()
}

/// `properties` (as stored) with the header `name` set to `value`; bytes
/// that are not a property list are left as they are.
pub fn with_long_header(properties: &[u8], name: &str, value: i64) -> Vec<u8> {
    if !valid_properties(properties) {
        return properties.to_vec();
    }
    let props = decode_properties(properties);
    let mut headers = props.headers().clone().unwrap_or_default();
    headers.insert(name.into(), AMQPValue::LongLongInt(value));
    encode_properties(&props.with_headers(headers))
}

/// A stored message's `priority` property (0 without one).
pub fn priority(properties: &[u8]) -> u8 {
    decode_properties(properties).priority().unwrap_or(0)
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

/// AMQP table -> the values routing compares.
pub fn to_args(t: &FieldTable) -> Args {
    t.inner()
        .iter()
        .map(|(k, v)| {
            let v = match v {
                AMQPValue::LongString(s) => ArgValue::Str(String::from_utf8_lossy(s.as_bytes()).into_owned()),
                AMQPValue::ShortString(s) => ArgValue::Str(s.as_str().to_string()),
                AMQPValue::Boolean(b) => ArgValue::Bool(*b),
                AMQPValue::ShortShortInt(i) => ArgValue::Int(*i as i64),
                AMQPValue::ShortShortUInt(i) => ArgValue::Int(*i as i64),
                AMQPValue::ShortInt(i) => ArgValue::Int(*i as i64),
                AMQPValue::ShortUInt(i) => ArgValue::Int(*i as i64),
                AMQPValue::LongInt(i) => ArgValue::Int(*i as i64),
                AMQPValue::LongUInt(i) => ArgValue::Int(*i as i64),
                AMQPValue::LongLongInt(i) => ArgValue::Int(*i),
                other => ArgValue::Other(format!("{other:?}")),
            };
            (k.as_str().to_string(), v)
        })
        .collect()
}

/// A header or binding-argument value, as far as routing compares them.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum ArgValue {
    Str(String),
    Int(i64),
    Bool(bool),
    /// Anything else, by its printed form (compared for equality only).
    Other(String),
}

pub type Args = BTreeMap<String, ArgValue>;

/// Arguments as a JSON object, as RabbitMQ's API shows them.
pub fn args_json(args: &Args) -> serde_json::Value {
    let m = args.iter().map(|(k, v)| {
        let v = match v {
            ArgValue::Str(s) => serde_json::Value::from(s.clone()),
            ArgValue::Int(n) => serde_json::Value::from(*n),
            ArgValue::Bool(b) => serde_json::Value::from(*b),
            ArgValue::Other(o) => serde_json::from_str(o).unwrap_or_else(|_| serde_json::Value::from(o.clone())),
        };
        (k.clone(), v)
    });
    serde_json::Value::Object(m.collect())
}

#[cfg(test)]
mod tests {
    use amq_protocol::types::ShortString;

    use super::*;

    #[test]
    fn only_whole_property_lists_are_valid() {
        let p = encode_properties(&AMQPProperties::default().with_app_id("app".into()).with_priority(1));
        assert!(valid_properties(&p));
        assert!(valid_properties(&[]));
        assert!(valid_properties(&encode_properties(&AMQPProperties::default())));
        assert!(!valid_properties(&p[..p.len() - 1]), "cut short");
        assert!(!valid_properties(&[p.as_slice(), &[0]].concat()), "trailing bytes");
        assert!(!valid_properties(&[1, 2, 3]));
    }

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
