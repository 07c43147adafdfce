//! The queue arguments mirrorq acts on (`x-message-ttl`, `x-max-length`,
//! `x-overflow`, `x-dead-letter-exchange`, `x-dead-letter-routing-key`,
//! `x-expires`, `x-max-priority`, `x-single-active-consumer`), validated
//! once at declare time and stored with the queue, and how they combine
//! with the same keys in the queue's effective policy. `x-queue-mode` and
//! `x-queue-version` are checked and kept but change nothing: every queue
//! here keeps its bodies on disk, as a lazy queue does.
//!
//! As in RabbitMQ: when both set a TTL, an expiry or a maximum length the
//! lower one wins; for the other keys the argument wins over the policy.

use serde::{Deserialize, Serialize};

use super::routing::{ArgValue, Args};

/// `x-overflow` values we implement.
pub const OVERFLOW_DROP_HEAD: &str = "drop-head";
pub const OVERFLOW_REJECT_PUBLISH: &str = "reject-publish";

/// `x-queue-type` values we have. A quorum queue is a replicated queue
/// whose replica count comes from its arguments, not from `ha-` policies.
pub const QUEUE_TYPE_CLASSIC: &str = "classic";
pub const QUEUE_TYPE_QUORUM: &str = "quorum";
/// `x-dead-letter-strategy` values (RabbitMQ's quorum queues').
pub const DEAD_LETTER_AT_MOST_ONCE: &str = "at-most-once";
pub const DEAD_LETTER_AT_LEAST_ONCE: &str = "at-least-once";

/// RabbitMQ's default replica count of a quorum queue.
const QUORUM_DEFAULT_SIZE: usize = 3;
/// RabbitMQ 4's `delivery-limit` for a quorum queue that sets none.
pub const QUORUM_DELIVERY_LIMIT: u32 = 20;

/// Arguments we know but do not implement: refused at declare rather than
/// silently ignored, so nobody relies on a limit that is not enforced.
const UNSUPPORTED: &[&str] = &["x-max-length-bytes"];

#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueArgs {
    pub message_ttl: Option<u64>,
    pub max_length: Option<u64>,
    /// `drop-head` or `reject-publish`.
    pub overflow: Option<String>,
    pub dead_letter_exchange: Option<String>,
    pub dead_letter_routing_key: Option<String>,
    /// `x-expires`: the queue is deleted after this many ms unused.
    pub expires: Option<u64>,
    /// `x-max-priority`: a priority queue.
    pub max_priority: Option<u8>,
    /// `x-single-active-consumer`.
    pub single_active_consumer: bool,
    /// `x-queue-mode` (`default` or `lazy`), kept to show it back.
    pub queue_mode: Option<String>,
    /// `x-queue-version` (1 or 2), kept to show it back.
    pub queue_version: Option<u8>,
    /// Arguments mirrorq does not act on (`x-queue-type`, other
    /// plugins'), kept as declared to show them back, as RabbitMQ does.
    pub others: Args,
}

impl QueueArgs {
    /// Read and validate declare arguments. Unknown `x-` arguments are
    /// ignored, as RabbitMQ ignores them; `Err` names the bad one.
    pub fn parse(args: &Args) -> Result<Self, String> {
        let mut out = QueueArgs::default();
        for (k, v) in args {
            let non_negative = || match v {
                ArgValue::Int(n) if *n >= 0 => Ok(*n as u64),
                other => Err(format!("invalid arg '{k}': {} is not a non-negative integer", show(other))),
            };
            let positive = || match non_negative()? {
                0 => Err(format!("invalid arg '{k}': 0 is not a positive integer")),
                n => Ok(n),
            };
            let string = || match v {
                ArgValue::Str(s) => Ok(s.clone()),
                other => Err(format!("invalid arg '{k}': {} is not a string", show(other))),
            };
            match k.as_str() {
                "x-message-ttl" => out.message_ttl = Some(non_negative()?),
                "x-max-length" => out.max_length = Some(non_negative()?),
                "x-overflow" => {
                    let s = string()?;
                    if s != OVERFLOW_DROP_HEAD && s != OVERFLOW_REJECT_PUBLISH {
                        return Err(format!(
                            "invalid arg '{k}': '{s}' is not one of {OVERFLOW_DROP_HEAD}, {OVERFLOW_REJECT_PUBLISH}"
                        ));
                    }
                    out.overflow = Some(s);
                }
                "x-dead-letter-exchange" => out.dead_letter_exchange = Some(string()?),
                "x-dead-letter-routing-key" => out.dead_letter_routing_key = Some(string()?),
                "x-expires" => out.expires = Some(positive()?),
                "x-max-priority" => match non_negative()? {
                    n @ 0..=255 => out.max_priority = Some(n as u8),
                    n => return Err(format!("invalid arg '{k}': {n} is above the maximum priority 255")),
                },
                "x-single-active-consumer" => match v {
                    ArgValue::Bool(b) => out.single_active_consumer = *b,
                    other => return Err(format!("invalid arg '{k}': {} is not a boolean", show(other))),
                },
                "x-queue-mode" => match string()?.as_str() {
                    m @ ("default" | "lazy") => out.queue_mode = Some(m.to_string()),
                    m => return Err(format!("invalid arg '{k}': '{m}' is not one of default, lazy")),
                },
                "x-queue-version" => match non_negative()? {
                    n @ (1 | 2) => out.queue_version = Some(n as u8),
                    n => return Err(format!("invalid arg '{k}': {n} is not one of 1, 2")),
                },
                // Kept with the others (the stored form stays as it was);
                // read back by `is_quorum` and `quorum_size`.
                "x-queue-type" => match string()?.as_str() {
                    QUEUE_TYPE_CLASSIC | QUEUE_TYPE_QUORUM => {
                        out.others.insert(k.clone(), v.clone());
                    }
                    t => {
                        return Err(format!(
                            "invalid arg '{k}': '{t}' is not a queue type mirrorq has \
                             ({QUEUE_TYPE_CLASSIC}, {QUEUE_TYPE_QUORUM})"
                        ))
                    }
                },
                // Kept with the others; read by `consumer_timeout` and
                // `quorum_size`.
                "x-consumer-timeout" | "x-quorum-initial-group-size" => {
                    positive()?;
                    out.others.insert(k.clone(), v.clone());
                }
                // Kept with the others; read by `delivery_limit`. -1 lifts a
                // quorum queue's default, as in RabbitMQ 4.
                "x-delivery-limit" => {
                    if !matches!(v, ArgValue::Int(-1)) {
                        non_negative()?;
                    }
                    out.others.insert(k.clone(), v.clone());
                }
                // Kept with the others; read by `at_least_once_dead_lettering`.
                "x-dead-letter-strategy" => match string()?.as_str() {
                    DEAD_LETTER_AT_MOST_ONCE | DEAD_LETTER_AT_LEAST_ONCE => {
                        out.others.insert(k.clone(), v.clone());
                    }
                    t => {
                        return Err(format!(
                            "invalid arg '{k}': '{t}' is not one of {DEAD_LETTER_AT_MOST_ONCE}, {DEAD_LETTER_AT_LEAST_ONCE}"
                        ))
                    }
                },
                k if UNSUPPORTED.contains(&k) => return Err(format!("argument '{k}' is not supported by mirrorq")),
                _ => {
                    out.others.insert(k.clone(), v.clone());
                }
            }
        }
        if out.dead_letter_routing_key.is_some() && out.dead_letter_exchange.is_none() {
            return Err("x-dead-letter-routing-key given without x-dead-letter-exchange".into());
        }
        Ok(out)
    }

    /// The arguments as RabbitMQ's API shows them.
    pub fn to_json(&self) -> serde_json::Value {
        let mut m = serde_json::Map::new();
        if let Some(v) = self.message_ttl {
            m.insert("x-message-ttl".into(), v.into());
        }
        if let Some(v) = self.max_length {
            m.insert("x-max-length".into(), v.into());
        }
        if let Some(v) = &self.overflow {
            m.insert("x-overflow".into(), v.clone().into());
        }
        if let Some(v) = &self.dead_letter_exchange {
            m.insert("x-dead-letter-exchange".into(), v.clone().into());
        }
        if let Some(v) = &self.dead_letter_routing_key {
            m.insert("x-dead-letter-routing-key".into(), v.clone().into());
        }
        if let Some(v) = self.expires {
            m.insert("x-expires".into(), v.into());
        }
        if let Some(v) = self.max_priority {
            m.insert("x-max-priority".into(), v.into());
        }
        if self.single_active_consumer {
            m.insert("x-single-active-consumer".into(), true.into());
        }
        if let Some(v) = &self.queue_mode {
            m.insert("x-queue-mode".into(), v.clone().into());
        }
        if let Some(v) = self.queue_version {
            m.insert("x-queue-version".into(), v.into());
        }
        if let serde_json::Value::Object(others) = super::routing::args_json(&self.others) {
            m.extend(others);
        }
        serde_json::Value::Object(m)
    }

    /// `x-queue-type` as declared, if it was.
    fn declared_type(&self) -> Option<&str> {
        match self.others.get("x-queue-type") {
            Some(ArgValue::Str(t)) => Some(t),
            _ => None,
        }
    }

    /// Declared `x-queue-type: quorum`.
    pub fn is_quorum(&self) -> bool {
        self.declared_type() == Some(QUEUE_TYPE_QUORUM)
    }

    /// `classic` or `quorum`, as RabbitMQ's API shows a queue's type.
    pub fn queue_type(&self) -> &'static str {
        if self.is_quorum() {
            QUEUE_TYPE_QUORUM
        } else {
            QUEUE_TYPE_CLASSIC
        }
    }

    /// How many replicas a quorum queue asks for: its
    /// `x-quorum-initial-group-size`, else RabbitMQ's default (three).
    pub fn quorum_size(&self) -> usize {
        match self.others.get("x-quorum-initial-group-size") {
            Some(ArgValue::Int(n)) if *n > 0 => usize::try_from(*n).unwrap_or(usize::MAX),
            _ => QUORUM_DEFAULT_SIZE,
        }
    }

    /// How long a delivery from this queue may stay unacked (RabbitMQ's
    /// consumer timeout): its `x-consumer-timeout` or the `consumer-timeout`
    /// of its policy `definition` (already validated), the lower of the two;
    /// `None` if neither sets one.
    pub fn consumer_timeout(&self, definition: Option<&str>) -> Option<std::time::Duration> {
        let arg = match self.others.get("x-consumer-timeout") {
            Some(ArgValue::Int(n)) if *n > 0 => Some(*n as u64),
            _ => None,
        };
        let policy = definition
            .and_then(|d| serde_json::from_str::<serde_json::Value>(d).ok())
            .and_then(|d| d.get("consumer-timeout").and_then(|v| v.as_u64()))
            .filter(|n| *n > 0);
        let ms = match (arg, policy) {
            (Some(a), Some(p)) => a.min(p),
            (a, p) => a.or(p)?,
        };
        Some(std::time::Duration::from_millis(ms))
    }

    /// How many times a message of this queue may be returned (requeued)
    /// before it is dead-lettered, or dropped: its `x-delivery-limit` or
    /// the `delivery-limit` of its policy `definition` (already validated),
    /// the lower of the two; for a quorum queue that sets neither,
    /// RabbitMQ 4's default [`QUORUM_DELIVERY_LIMIT`]. -1 lifts the
    /// default; `None`: no limit.
    pub fn delivery_limit(&self, definition: Option<&str>) -> Option<u32> {
        let arg = match self.others.get("x-delivery-limit") {
            Some(ArgValue::Int(n)) => Some(*n),
            _ => None,
        };
        let policy = definition
            .and_then(|d| serde_json::from_str::<serde_json::Value>(d).ok())
            .and_then(|d| d.get("delivery-limit").and_then(|v| v.as_i64()));
        let set = |v: Option<i64>| v.filter(|n| *n >= 0);
        let lifted = arg == Some(-1) || policy == Some(-1);
        let n = match (set(arg), set(policy)) {
            (Some(a), Some(p)) => a.min(p),
            (Some(n), None) | (None, Some(n)) => n,
            (None, None) if self.is_quorum() && !lifted => return Some(QUORUM_DELIVERY_LIMIT),
            (None, None) => return None,
        };
        Some(u32::try_from(n).unwrap_or(u32::MAX))
    }

    /// Does the queue dead-letter at least once? As in RabbitMQ: its
    /// `x-dead-letter-strategy`, else its policy's `dead-letter-strategy`
    /// (`definition`, already validated), says `at-least-once`, and it
    /// has a dead-letter exchange and overflows by `reject-publish` (with
    /// `drop-head` the queue could drop what it holds for dead-lettering,
    /// so RabbitMQ falls back to at most once there, and so does this).
    /// `self` is the queue's arguments combined with its policy.
    pub fn at_least_once_dead_lettering(&self, definition: Option<&str>) -> bool {
        let arg = match self.others.get("x-dead-letter-strategy") {
            Some(ArgValue::Str(s)) => Some(s.clone()),
            _ => None,
        };
        let strategy = arg.or_else(|| {
            definition
                .and_then(|d| serde_json::from_str::<serde_json::Value>(d).ok())
                .and_then(|d| d.get("dead-letter-strategy").and_then(|v| v.as_str().map(str::to_string)))
        });
        strategy.as_deref() == Some(DEAD_LETTER_AT_LEAST_ONCE)
            && self.dead_letter_exchange.is_some()
            && self.overflow.as_deref() == Some(OVERFLOW_REJECT_PUBLISH)
    }

    /// What a queue of this type may not be (RabbitMQ refuses a quorum
    /// queue that is transient, exclusive or auto-delete: a queue that
    /// goes away on its own is not replicated); `Err` names the property
    /// as RabbitMQ does.
    pub fn check_properties(&self, durable: bool, exclusive: bool, auto_delete: bool) -> Result<(), &'static str> {
        if !self.is_quorum() {
            return Ok(());
        }
        if !durable {
            Err("non-durable")
        } else if exclusive {
            Err("exclusive-owner")
        } else if auto_delete {
            Err("auto-delete")
        } else {
            Ok(())
        }
    }

    /// The first argument that differs from `other`, RabbitMQ's
    /// "inequivalent arg" check on re-declare. A re-declare that names no
    /// queue type matches either type (as RabbitMQ 4 has it: clients that
    /// never heard of quorum queues keep working with one).
    pub fn inequivalent(&self, other: &QueueArgs) -> Option<&'static str> {
        if self.declared_type().is_some() && self.queue_type() != other.queue_type() {
            Some("x-queue-type")
        } else if self.message_ttl != other.message_ttl {
            Some("x-message-ttl")
        } else if self.max_length != other.max_length {
            Some("x-max-length")
        } else if self.overflow != other.overflow {
            Some("x-overflow")
        } else if self.dead_letter_exchange != other.dead_letter_exchange {
            Some("x-dead-letter-exchange")
        } else if self.dead_letter_routing_key != other.dead_letter_routing_key {
            Some("x-dead-letter-routing-key")
        } else if self.expires != other.expires {
            Some("x-expires")
        } else if self.max_priority != other.max_priority {
            Some("x-max-priority")
        } else if self.single_active_consumer != other.single_active_consumer {
            Some("x-single-active-consumer")
        } else {
            None
        }
    }

    /// Combined with a policy definition (already validated JSON).
    pub fn with_policy(&self, definition: Option<&str>) -> QueueArgs {
        let def: serde_json::Value =
            definition.and_then(|d| serde_json::from_str(d).ok()).unwrap_or(serde_json::Value::Null);
        let num = |k: &str| def.get(k).and_then(|v| v.as_u64());
        let text = |k: &str| def.get(k).and_then(|v| v.as_str()).map(str::to_string);
        let lower = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        let dead_letter_exchange = self.dead_letter_exchange.clone().or_else(|| text("dead-letter-exchange"));
        QueueArgs {
            message_ttl: lower(self.message_ttl, num("message-ttl")),
            expires: lower(self.expires, num("expires")),
            max_priority: self.max_priority,
            single_active_consumer: self.single_active_consumer,
            queue_mode: self.queue_mode.clone().or_else(|| text("queue-mode")),
            queue_version: self.queue_version,
            others: self.others.clone(),
            max_length: lower(self.max_length, num("max-length")),
            overflow: self.overflow.clone().or_else(|| text("overflow")),
            dead_letter_routing_key: match &self.dead_letter_exchange {
                Some(_) => self.dead_letter_routing_key.clone(),
                None => text("dead-letter-routing-key"),
            },
            dead_letter_exchange,
        }
    }
}

fn show(v: &ArgValue) -> String {
    match v {
        ArgValue::Str(s) => format!("'{s}'"),
        ArgValue::Int(n) => n.to_string(),
        ArgValue::Bool(b) => b.to_string(),
        ArgValue::Other(o) => o.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(kv: &[(&str, ArgValue)]) -> Args {
        kv.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
    }

    #[test]
    fn parses_known_arguments_and_ignores_unknown_ones() {
        let a = QueueArgs::parse(&args(&[
            ("x-message-ttl", ArgValue::Int(500)),
            ("x-max-length", ArgValue::Int(3)),
            ("x-overflow", ArgValue::Str("reject-publish".into())),
            ("x-dead-letter-exchange", ArgValue::Str("dlx".into())),
            ("x-dead-letter-routing-key", ArgValue::Str("dead".into())),
            ("x-expires", ArgValue::Int(10_000)),
            ("x-max-priority", ArgValue::Int(10)),
            ("x-single-active-consumer", ArgValue::Bool(true)),
            ("x-queue-mode", ArgValue::Str("lazy".into())),
            ("x-queue-version", ArgValue::Int(2)),
            ("x-unknown", ArgValue::Int(2)),
        ]))
        .unwrap();
        assert_eq!(a.expires, Some(10_000));
        assert_eq!(a.max_priority, Some(10));
        assert!(a.single_active_consumer);
        assert_eq!((a.queue_mode.as_deref(), a.queue_version), (Some("lazy"), Some(2)));
        assert_eq!(a.message_ttl, Some(500));
        assert_eq!(a.max_length, Some(3));
        assert_eq!(a.overflow.as_deref(), Some("reject-publish"));
        assert_eq!(a.dead_letter_exchange.as_deref(), Some("dlx"));
        assert_eq!(a.dead_letter_routing_key.as_deref(), Some("dead"));
    }

    #[test]
    fn refuses_bad_values() {
        let bad = [
            ("x-message-ttl", ArgValue::Int(-1)),
            ("x-message-ttl", ArgValue::Str("10".into())),
            ("x-max-length", ArgValue::Bool(true)),
            ("x-overflow", ArgValue::Str("reject-publish-dlx".into())),
            ("x-dead-letter-exchange", ArgValue::Int(1)),
            ("x-max-length-bytes", ArgValue::Int(1000)),
            ("x-expires", ArgValue::Int(0)),
            ("x-max-priority", ArgValue::Int(256)),
            ("x-single-active-consumer", ArgValue::Str("true".into())),
            ("x-queue-mode", ArgValue::Str("fast".into())),
            ("x-queue-version", ArgValue::Int(3)),
            ("x-queue-type", ArgValue::Str("stream".into())),
            ("x-queue-type", ArgValue::Int(1)),
            ("x-quorum-initial-group-size", ArgValue::Int(0)),
            ("x-consumer-timeout", ArgValue::Int(0)),
            ("x-consumer-timeout", ArgValue::Str("5000".into())),
        ];
        for (k, v) in bad {
            let err = QueueArgs::parse(&args(&[(k, v.clone())])).unwrap_err();
            assert!(err.contains(k), "{k}={v:?}: {err}");
        }
        assert!(QueueArgs::parse(&args(&[("x-dead-letter-routing-key", ArgValue::Str("k".into()))])).is_err());
    }

    #[test]
    fn policy_combines_lower_limit_and_argument_first() {
        let a = QueueArgs {
            message_ttl: Some(1000),
            max_length: None,
            dead_letter_exchange: Some("mine".into()),
            ..QueueArgs::default()
        };
        let def = r#"{"message-ttl":500,"max-length":7,"dead-letter-exchange":"theirs","dead-letter-routing-key":"k","overflow":"reject-publish"}"#;
        let e = a.with_policy(Some(def));
        assert_eq!(e.message_ttl, Some(500), "lower TTL wins");
        assert_eq!(e.max_length, Some(7));
        assert_eq!(e.dead_letter_exchange.as_deref(), Some("mine"), "the argument wins");
        assert_eq!(e.dead_letter_routing_key, None, "the policy's key goes with the policy's exchange");
        assert_eq!(e.overflow.as_deref(), Some("reject-publish"));
        let none = QueueArgs::default().with_policy(None);
        assert_eq!(none, QueueArgs::default());
        assert_eq!(a.inequivalent(&QueueArgs::default()), Some("x-message-ttl"));
        assert_eq!(a.inequivalent(&a.clone()), None);
    }

    #[test]
    fn a_quorum_queue_is_durable_shared_and_sized_by_its_arguments() {
        let classic = QueueArgs::parse(&args(&[])).unwrap();
        assert_eq!((classic.is_quorum(), classic.queue_type()), (false, "classic"));
        assert_eq!(classic.check_properties(false, true, true), Ok(()));
        let quorum = QueueArgs::parse(&args(&[("x-queue-type", ArgValue::Str("quorum".into()))])).unwrap();
        assert_eq!((quorum.is_quorum(), quorum.quorum_size()), (true, 3));
        assert_eq!(quorum.to_json()["x-queue-type"], "quorum", "shown back as declared");
        assert_eq!(quorum.check_properties(true, false, false), Ok(()));
        assert_eq!(quorum.check_properties(false, false, false), Err("non-durable"));
        assert_eq!(quorum.check_properties(true, true, false), Err("exclusive-owner"));
        assert_eq!(quorum.check_properties(true, false, true), Err("auto-delete"));
        let five = QueueArgs::parse(&args(&[
            ("x-queue-type", ArgValue::Str("quorum".into())),
            ("x-quorum-initial-group-size", ArgValue::Int(5)),
        ]))
        .unwrap();
        assert_eq!(five.quorum_size(), 5);
        // Re-declared: another type is refused, no type matches either.
        assert_eq!(quorum.inequivalent(&classic), Some("x-queue-type"));
        assert_eq!(classic.inequivalent(&quorum), None);
        let named_classic = QueueArgs::parse(&args(&[("x-queue-type", ArgValue::Str("classic".into()))])).unwrap();
        assert_eq!(named_classic.inequivalent(&quorum), Some("x-queue-type"));
        assert_eq!(named_classic.inequivalent(&classic), None);
    }

    #[test]
    fn a_delivery_limit_comes_from_the_argument_or_the_policy_and_a_quorum_queue_has_one() {
        let none = QueueArgs::parse(&args(&[])).unwrap();
        assert_eq!(none.delivery_limit(None), None, "a classic queue has none of its own");
        assert_eq!(none.delivery_limit(Some(r#"{"delivery-limit":5}"#)), Some(5));
        let arg = QueueArgs::parse(&args(&[("x-delivery-limit", ArgValue::Int(3))])).unwrap();
        assert_eq!(arg.delivery_limit(Some(r#"{"delivery-limit":5}"#)), Some(3), "the lower wins");
        let quorum = QueueArgs::parse(&args(&[("x-queue-type", ArgValue::Str("quorum".into()))])).unwrap();
        assert_eq!(quorum.delivery_limit(None), Some(QUORUM_DELIVERY_LIMIT));
        assert_eq!(quorum.delivery_limit(Some(r#"{"delivery-limit":-1}"#)), None, "-1 lifts the default");
        let lifted = QueueArgs::parse(&args(&[
            ("x-queue-type", ArgValue::Str("quorum".into())),
            ("x-delivery-limit", ArgValue::Int(-1)),
        ]))
        .unwrap();
        assert_eq!(lifted.delivery_limit(None), None);
        assert!(QueueArgs::parse(&args(&[("x-delivery-limit", ArgValue::Int(-2))])).is_err());
        assert!(QueueArgs::parse(&args(&[("x-delivery-limit", ArgValue::Str("3".into()))])).is_err());
    }

    #[test]
    fn at_least_once_dead_lettering_needs_an_exchange_and_reject_publish_as_in_rabbitmq() {
        let bad = QueueArgs::parse(&args(&[("x-dead-letter-strategy", ArgValue::Str("exactly-once".into()))]));
        assert!(bad.unwrap_err().contains("x-dead-letter-strategy"));
        let strategy = ("x-dead-letter-strategy", ArgValue::Str("at-least-once".into()));
        let dlx = ("x-dead-letter-exchange", ArgValue::Str("dlx".into()));
        let reject = ("x-overflow", ArgValue::Str("reject-publish".into()));
        let full = QueueArgs::parse(&args(&[strategy.clone(), dlx.clone(), reject.clone()])).unwrap();
        assert!(full.at_least_once_dead_lettering(None));
        // Falls back to at most once without either.
        for partial in [vec![strategy.clone(), dlx.clone()], vec![strategy.clone(), reject.clone()]] {
            assert!(!QueueArgs::parse(&args(&partial)).unwrap().at_least_once_dead_lettering(None));
        }
        // From the policy, unless the argument says otherwise.
        let plain = QueueArgs::parse(&args(&[dlx.clone(), reject.clone()])).unwrap();
        let def = r#"{"dead-letter-strategy":"at-least-once"}"#;
        assert!(plain.at_least_once_dead_lettering(Some(def)));
        let most = ("x-dead-letter-strategy", ArgValue::Str("at-most-once".into()));
        let own = QueueArgs::parse(&args(&[most, dlx, reject])).unwrap();
        assert!(!own.at_least_once_dead_lettering(Some(def)));
        assert!(super::super::policy::parse_definition(r#"{"dead-letter-strategy":"sometimes"}"#).is_err());
        assert!(super::super::policy::parse_definition(def).is_ok());
    }

    #[test]
    fn a_consumer_timeout_comes_from_the_argument_or_the_policy_the_lower_winning() {
        use std::time::Duration;
        let none = QueueArgs::parse(&args(&[])).unwrap();
        assert_eq!(none.consumer_timeout(None), None);
        assert_eq!(none.consumer_timeout(Some(r#"{"consumer-timeout":2000}"#)), Some(Duration::from_millis(2000)));
        let arg = QueueArgs::parse(&args(&[("x-consumer-timeout", ArgValue::Int(5000))])).unwrap();
        assert_eq!(arg.consumer_timeout(None), Some(Duration::from_millis(5000)));
        assert_eq!(arg.consumer_timeout(Some(r#"{"consumer-timeout":2000}"#)), Some(Duration::from_millis(2000)));
        assert_eq!(arg.consumer_timeout(Some(r#"{"ha-mode":"all"}"#)), Some(Duration::from_millis(5000)));
    }
}
