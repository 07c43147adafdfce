//! Exchanges, bindings and routing, as RabbitMQ users know them. Pure: the
//! routing decision is made from the local copy of the metadata.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::names;
pub use crate::message::{args_json, ArgValue, Args};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExchangeKind {
    Direct,
    Fanout,
    Topic,
    Headers,
}

impl ExchangeKind {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "direct" => Some(Self::Direct),
            "fanout" => Some(Self::Fanout),
            "topic" => Some(Self::Topic),
            "headers" | "match" => Some(Self::Headers),
            _ => None,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Direct => "direct",
            Self::Fanout => "fanout",
            Self::Topic => "topic",
            Self::Headers => "headers",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExchangeMeta {
    pub name: String,
    pub kind: ExchangeKind,
    pub durable: bool,
    pub auto_delete: bool,
    pub internal: bool,
    /// The `alternate-exchange` argument (a key): where a message this
    /// exchange cannot route goes.
    pub alternate: Option<String>,
    /// Every argument as declared, shown back as RabbitMQ does.
    pub args: Args,
}

/// A binding from the exchange `exchange` (the source) to a queue or,
/// with `to_exchange`, to another exchange. Sorted by source first, so an
/// exchange's bindings are one range.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Binding {
    pub exchange: String,
    /// A queue's key, or an exchange's with `to_exchange`.
    pub destination: String,
    pub to_exchange: bool,
    pub routing_key: String,
    pub args: Args,
}

/// The exchanges every vhost has (RabbitMQ's `amq.*` set and the default);
/// `name` is a key.
pub fn builtin(name: &str) -> Option<ExchangeMeta> {
    let kind = match names::name_of(name) {
        "" | "amq.direct" => ExchangeKind::Direct,
        "amq.fanout" => ExchangeKind::Fanout,
        "amq.topic" => ExchangeKind::Topic,
        "amq.headers" | "amq.match" => ExchangeKind::Headers,
        _ => return None,
    };
    Some(ExchangeMeta {
        name: name.to_string(),
        kind,
        durable: true,
        auto_delete: false,
        internal: false,
        alternate: None,
        args: Args::new(),
    })
}

/// AMQP topic matching: words split on '.', `*` is one word, `#` zero or
/// more. Walks both strings in place (no allocation): it runs once per
/// binding of the exchange on every publish.
pub fn topic_matches(pattern: &str, key: &str) -> bool {
    /// The first word and the rest (`None`: no words left).
    fn word(s: Option<&str>) -> Option<(&str, Option<&str>)> {
        let s = s?;
        Some(match s.split_once('.') {
            Some((w, rest)) => (w, Some(rest)),
            None => (s, None),
        })
    }
    fn go(p: Option<&str>, k: Option<&str>) -> bool {
        match (word(p), word(k)) {
            (None, None) => true,
            (Some(("#", p_rest)), _) => go(p_rest, k) || (k.is_some() && go(p, word(k).and_then(|(_, r)| r))),
            (Some(("*", p_rest)), Some((_, k_rest))) => go(p_rest, k_rest),
            (Some((w, p_rest)), Some((x, k_rest))) if w == x => go(p_rest, k_rest),
            _ => false,
        }
    }
    fn words(s: &str) -> Option<&str> {
        (!s.is_empty()).then_some(s)
    }
    go(words(pattern), words(key))
}

/// Headers-exchange matching: `x-match` `all` (default) or `any` over the
/// binding's arguments that do not start with `x-`.
pub fn headers_match(binding: &Args, headers: &Args) -> bool {
    let any = matches!(binding.get("x-match"), Some(ArgValue::Str(s)) if s == "any" || s == "any-with-x");
    let mut wanted = binding.iter().filter(|(k, _)| !k.starts_with("x-")).peekable();
    if wanted.peek().is_none() {
        return !any;
    }
    let hit = |(k, v): (&String, &ArgValue)| headers.get(k) == Some(v);
    if any {
        wanted.any(hit)
    } else {
        wanted.all(hit)
    }
}

/// Queues (keys) a message published to `exchange` (a key) with
/// `routing_key` and `headers` reaches (sorted, each once). `None`: no such exchange.
///
/// As RabbitMQ routes: through exchange-to-exchange bindings, each exchange
/// visited once (cycles end there), and to an exchange's alternate
/// (`alternate_of`: its argument, else its policy's) when none of its own
/// bindings matched. An exchange missing on the way routes nowhere.
pub fn route(
    exchanges: &BTreeMap<String, ExchangeMeta>,
    bindings: &BTreeSet<Binding>,
    queues: &dyn Fn(&str) -> bool,
    alternate_of: &dyn Fn(&ExchangeMeta) -> Option<String>,
    exchange: &str,
    routing_key: &str,
    headers: &Args,
) -> Option<Vec<String>> {
    let (vhost, bare) = names::split(exchange);
    if bare.is_empty() {
        let queue = names::key(vhost, routing_key);
        return Some(if queues(&queue) { vec![queue] } else { Vec::new() });
    }
    let first = exchanges.get(exchange).cloned().or_else(|| builtin(exchange))?;
    let mut out = BTreeSet::new();
    let mut seen = BTreeSet::from([exchange.to_string()]);
    let mut work = vec![first];
    while let Some(ex) = work.pop() {
        let mut matched = false;
        // Bindings sort by exchange first: this exchange's are one range.
        let from = Binding {
            exchange: ex.name.clone(),
            destination: String::new(),
            to_exchange: false,
            routing_key: String::new(),
            args: Args::new(),
        };
        for b in bindings.range(from..).take_while(|b| b.exchange == ex.name) {
            let hit = match ex.kind {
                ExchangeKind::Direct => b.routing_key == routing_key,
                ExchangeKind::Fanout => true,
                ExchangeKind::Topic => topic_matches(&b.routing_key, routing_key),
                ExchangeKind::Headers => headers_match(&b.args, headers),
            };
            if !hit {
                continue;
            }
            matched = true;
            if !b.to_exchange {
                out.insert(b.destination.clone());
            } else if seen.insert(b.destination.clone()) {
                work.extend(exchanges.get(&b.destination).cloned().or_else(|| builtin(&b.destination)));
            }
        }
        if !matched {
            if let Some(alt) = alternate_of(&ex).filter(|a| seen.insert(a.clone())) {
                work.extend(exchanges.get(&alt).cloned().or_else(|| builtin(&alt)));
            }
        }
    }
    Some(out.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_patterns() {
        assert!(topic_matches("a.b.c", "a.b.c"));
        assert!(topic_matches("a.*.c", "a.b.c"));
        assert!(!topic_matches("a.*.c", "a.c"));
        assert!(topic_matches("a.#", "a"));
        assert!(topic_matches("a.#", "a.b.c"));
        assert!(topic_matches("#", ""));
        assert!(topic_matches("#", "x.y"));
        assert!(topic_matches("#.c", "a.b.c"));
        assert!(!topic_matches("#.c", "a.b.d"));
        assert!(topic_matches("*.orange.*", "quick.orange.rabbit"));
        assert!(!topic_matches("*.orange.*", "quick.orange.male.rabbit"));
        assert!(topic_matches("lazy.#", "lazy.orange.male.rabbit"));
        assert!(!topic_matches("*", ""));
        assert!(!topic_matches("a.b", "a.b.c"));
        assert!(topic_matches("a.#.d", "a.d"));
        assert!(topic_matches("a.#.d", "a.b.c.d"));
        assert!(!topic_matches("a.#.d", "a.b.c"));
        assert!(topic_matches("#.#", "a"));
        assert!(topic_matches("", ""));
        assert!(!topic_matches("", "a"));
        assert!(topic_matches("a..b", "a..b"), "empty words are words");
        assert!(topic_matches("*.*", "a."));
    }

    fn args(kv: &[(&str, &str)]) -> Args {
        kv.iter().map(|(k, v)| (k.to_string(), ArgValue::Str(v.to_string()))).collect()
    }

    #[test]
    fn headers_all_and_any() {
        let h = args(&[("format", "pdf"), ("type", "report")]);
        assert!(headers_match(&args(&[("format", "pdf"), ("type", "report")]), &h));
        assert!(!headers_match(&args(&[("format", "pdf"), ("type", "log")]), &h));
        assert!(headers_match(&args(&[("x-match", "any"), ("format", "zip"), ("type", "report")]), &h));
        assert!(!headers_match(&args(&[("x-match", "any"), ("format", "zip")]), &h));
        assert!(headers_match(&args(&[]), &h), "no arguments with all matches everything");
    }

    #[test]
    fn route_by_kind() {
        let mut ex = BTreeMap::new();
        ex.insert(
            "logs".to_string(),
            ExchangeMeta {
                name: "logs".into(),
                kind: ExchangeKind::Topic,
                durable: true,
                auto_delete: false,
                internal: false,
                alternate: None,
                args: Args::new(),
            },
        );
        let mut b = BTreeSet::new();
        let bind = |e: &str, q: &str, k: &str| Binding {
            exchange: e.into(),
            destination: q.into(),
            to_exchange: false,
            routing_key: k.into(),
            args: Args::new(),
        };
        b.insert(bind("logs", "errors", "*.error"));
        b.insert(bind("logs", "all", "#"));
        b.insert(bind("amq.fanout", "f1", "ignored"));
        b.insert(bind("amq.fanout", "f2", ""));
        b.insert(bind("amq.direct", "d", "k"));
        let queues = |q: &str| q == "plain";
        let no_alt = |_: &ExchangeMeta| None;
        assert_eq!(
            route(&ex, &b, &queues, &no_alt, "logs", "db.error", &Args::new()),
            Some(vec!["all".into(), "errors".into()])
        );
        assert_eq!(route(&ex, &b, &queues, &no_alt, "logs", "db.info", &Args::new()), Some(vec!["all".into()]));
        assert_eq!(
            route(&ex, &b, &queues, &no_alt, "amq.fanout", "x", &Args::new()),
            Some(vec!["f1".into(), "f2".into()])
        );
        assert_eq!(route(&ex, &b, &queues, &no_alt, "amq.direct", "k", &Args::new()), Some(vec!["d".into()]));
        assert_eq!(route(&ex, &b, &queues, &no_alt, "amq.direct", "other", &Args::new()), Some(vec![]));
        assert_eq!(route(&ex, &b, &queues, &no_alt, "", "plain", &Args::new()), Some(vec!["plain".into()]));
        assert_eq!(route(&ex, &b, &queues, &no_alt, "", "nothing", &Args::new()), Some(vec![]));
        assert_eq!(route(&ex, &b, &queues, &no_alt, "missing", "k", &Args::new()), None);
    }

    #[test]
    fn exchange_to_exchange_bindings_and_alternate_exchanges() {
        let ex = |name: &str, kind, alternate: Option<&str>| {
            let meta = ExchangeMeta {
                name: name.into(),
                kind,
                durable: true,
                auto_delete: false,
                internal: false,
                alternate: alternate.map(str::to_string),
                args: Args::new(),
            };
            (name.to_string(), meta)
        };
        let exchanges: BTreeMap<String, ExchangeMeta> = [
            ex("front", ExchangeKind::Direct, Some("unrouted")),
            ex("logs", ExchangeKind::Topic, None),
            ex("unrouted", ExchangeKind::Fanout, None),
            ex("loop", ExchangeKind::Fanout, Some("front")),
        ]
        .into();
        let bind = |e: &str, d: &str, to_exchange: bool, k: &str| Binding {
            exchange: e.into(),
            destination: d.into(),
            to_exchange,
            routing_key: k.into(),
            args: Args::new(),
        };
        let b: BTreeSet<Binding> = [
            bind("front", "logs", true, "log"),
            bind("front", "orders", false, "order"),
            bind("logs", "all-logs", false, "#"),
            bind("logs", "front", true, "#"),
            bind("unrouted", "lost", false, ""),
            bind("loop", "loop", true, ""),
            bind("front", "gone", true, "gone"),
        ]
        .into();
        let queues = |_: &str| true;
        let alt = |e: &ExchangeMeta| e.alternate.clone();
        let r = |e: &str, k: &str| route(&exchanges, &b, &queues, &alt, e, k, &Args::new());
        assert_eq!(
            r("front", "log"),
            Some(vec!["all-logs".into()]),
            "through logs, and its binding back to front ends"
        );
        assert_eq!(r("front", "order"), Some(vec!["orders".into()]));
        assert_eq!(r("front", "nothing"), Some(vec!["lost".into()]), "unroutable: to the alternate");
        assert_eq!(r("front", "gone"), Some(vec![]), "a missing destination exchange routes nowhere, no alternate");
        assert_eq!(r("loop", "x"), Some(vec![]), "a binding to itself matched: no alternate, no endless walk");
        assert_eq!(
            r("logs", "x"),
            Some(vec!["all-logs".into(), "lost".into()]),
            "front, reached through logs, matched nothing: its alternate"
        );
    }
}
