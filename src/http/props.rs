//! AMQP content properties <-> the JSON the management API uses.

use amq_protocol::protocol::basic::AMQPProperties;
use amq_protocol::types::{AMQPValue, FieldTable, LongString, ShortString};
use serde_json::{json, Map, Value};

use crate::metadata::Args;

fn value_to_json(v: &AMQPValue) -> Value {
    match v {
        AMQPValue::Boolean(b) => json!(b),
        AMQPValue::ShortShortInt(i) => json!(i),
        AMQPValue::ShortShortUInt(i) => json!(i),
        AMQPValue::ShortInt(i) => json!(i),
        AMQPValue::ShortUInt(i) => json!(i),
        AMQPValue::LongInt(i) => json!(i),
        AMQPValue::LongUInt(i) => json!(i),
        AMQPValue::LongLongInt(i) => json!(i),
        AMQPValue::Float(f) => json!(f),
        AMQPValue::Double(f) => json!(f),
        AMQPValue::ShortString(s) => json!(s.as_str()),
        AMQPValue::LongString(s) => json!(String::from_utf8_lossy(s.as_bytes())),
        AMQPValue::FieldTable(t) => table_to_json(t),
        AMQPValue::FieldArray(a) => Value::Array(a.as_slice().iter().map(value_to_json).collect()),
        other => json!(format!("{other:?}")),
    }
}

fn table_to_json(t: &FieldTable) -> Value {
    Value::Object(t.inner().iter().map(|(k, v)| (k.as_str().to_string(), value_to_json(v))).collect())
}

/// Stored properties (wire bytes) as the API shows them.
pub fn to_json(stored: &[u8]) -> Value {
    let p = crate::message::decode_properties(stored);
    let mut m = Map::new();
    let mut put = |k: &str, v: Option<Value>| {
        if let Some(v) = v {
            m.insert(k.to_string(), v);
        }
    };
    put("content_type", p.content_type().as_ref().map(|v| json!(v.as_str())));
    put("content_encoding", p.content_encoding().as_ref().map(|v| json!(v.as_str())));
    put("headers", p.headers().as_ref().map(table_to_json));
    put("delivery_mode", p.delivery_mode().map(|v| json!(v)));
    put("priority", p.priority().map(|v| json!(v)));
    put("correlation_id", p.correlation_id().as_ref().map(|v| json!(v.as_str())));
    put("reply_to", p.reply_to().as_ref().map(|v| json!(v.as_str())));
    put("expiration", p.expiration().as_ref().map(|v| json!(v.as_str())));
    put("message_id", p.message_id().as_ref().map(|v| json!(v.as_str())));
    put("timestamp", p.timestamp().map(|v| json!(v)));
    put("type", p.kind().as_ref().map(|v| json!(v.as_str())));
    put("user_id", p.user_id().as_ref().map(|v| json!(v.as_str())));
    put("app_id", p.app_id().as_ref().map(|v| json!(v.as_str())));
    Value::Object(m)
}

fn json_to_value(v: &Value) -> Result<AMQPValue, String> {
    Ok(match v {
        Value::Bool(b) => AMQPValue::Boolean(*b),
        Value::Number(n) if n.is_i64() => AMQPValue::LongLongInt(n.as_i64().unwrap_or(0)),
        Value::Number(n) => AMQPValue::Double(n.as_f64().unwrap_or(0.0)),
        Value::String(s) => AMQPValue::LongString(LongString::from(s.as_str())),
        Value::Object(o) => AMQPValue::FieldTable(json_to_table(o)?),
        Value::Null => AMQPValue::Void,
        Value::Array(_) => return Err("arrays in headers are not supported".into()),
    })
}

fn json_to_table(o: &Map<String, Value>) -> Result<FieldTable, String> {
    let mut t = FieldTable::default();
    for (k, v) in o {
        t.insert(ShortString::from(k.as_str()), json_to_value(v)?);
    }
    Ok(t)
}

/// The API's `properties` object into AMQP properties; wrong types are a 400.
pub fn from_json(v: &Value) -> Result<AMQPProperties, String> {
    let o = match v {
        Value::Null => return Ok(AMQPProperties::default()),
        Value::Object(o) => o,
        _ => return Err("properties must be an object".into()),
    };
    let mut p = AMQPProperties::default();
    let text = |k: &str| -> Result<Option<ShortString>, String> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(ShortString::from(s.as_str()))),
            Some(_) => Err(format!("property {k} must be a string")),
        }
    };
    if let Some(v) = text("content_type")? {
        p = p.with_content_type(v);
    }
    if let Some(v) = text("content_encoding")? {
        p = p.with_content_encoding(v);
    }
    if let Some(v) = text("correlation_id")? {
        p = p.with_correlation_id(v);
    }
    if let Some(v) = text("reply_to")? {
        p = p.with_reply_to(v);
    }
    if let Some(v) = text("expiration")? {
        p = p.with_expiration(v);
    }
    if let Some(v) = text("message_id")? {
        p = p.with_message_id(v);
    }
    if let Some(v) = text("type")? {
        p = p.with_type(v);
    }
    if let Some(v) = text("app_id")? {
        p = p.with_app_id(v);
    }
    match o.get("delivery_mode") {
        None | Some(Value::Null) => {}
        Some(Value::Number(n)) if matches!(n.as_u64(), Some(1 | 2)) => {
            p = p.with_delivery_mode(n.as_u64().unwrap_or(1) as u8)
        }
        Some(_) => return Err("delivery_mode must be 1 or 2".into()),
    }
    match o.get("priority") {
        None | Some(Value::Null) => {}
        Some(Value::Number(n)) if n.as_u64().is_some_and(|v| v <= 255) => {
            p = p.with_priority(n.as_u64().unwrap_or(0) as u8)
        }
        Some(_) => return Err("priority must be an integer 0-255".into()),
    }
    match o.get("headers") {
        None | Some(Value::Null) => {}
        Some(Value::Object(h)) => p = p.with_headers(json_to_table(h)?),
        Some(_) => return Err("headers must be an object".into()),
    }
    Ok(p)
}

/// Message headers as routing compares them.
pub fn header_args(p: &AMQPProperties) -> Args {
    p.headers().as_ref().map(crate::message::to_args).unwrap_or_default()
}
