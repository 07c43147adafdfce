//! Policies as RabbitMQ users know them (name, regex pattern, apply-to,
//! priority, definition) and the mirror placement they imply. Pure.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, OnceLock};

use serde::{Deserialize, Serialize};

use super::names;
use crate::ids::NodeId;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ApplyTo {
    Queues,
    Exchanges,
    All,
}

impl ApplyTo {
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "queues" => Ok(Self::Queues),
            "exchanges" => Ok(Self::Exchanges),
            "all" => Ok(Self::All),
            other => Err(format!("apply-to '{other}' is not one of queues, exchanges, all")),
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Queues => "queues",
            Self::Exchanges => "exchanges",
            Self::All => "all",
        }
    }
    fn covers_queues(self) -> bool {
        matches!(self, Self::Queues | Self::All)
    }
    fn covers_exchanges(self) -> bool {
        matches!(self, Self::Exchanges | Self::All)
    }
}

/// A stored policy; `name` is its key (vhost and name). The definition is kept as the JSON text it was given in
/// (validated on write), so it reads back exactly.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    pub name: String,
    pub pattern: String,
    pub apply_to: ApplyTo,
    pub priority: i64,
    pub definition: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HaMode {
    All,
    Exactly(usize),
    Nodes(Vec<String>),
}

/// The parts of a definition that decide mirroring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HaPolicy {
    pub mode: Option<HaMode>,
    pub sync_automatic: bool,
    /// `queue-master-locator`: `Some(true)` min-masters, `Some(false)` client-local.
    pub min_masters: Option<bool>,
    /// `ha-promote-on-failure: always` (the default): the replicas left may
    /// re-form the queue without a majority of its group.
    pub promote_on_failure_always: bool,
    /// `ha-promote-on-shutdown: always`: a stopping master hands over even
    /// to a mirror that is not synchronised.
    pub promote_on_shutdown_always: bool,
    /// `ha-min-synchronised` (ours): publishes wait, then are refused, while
    /// fewer replicas than this are synchronised.
    pub min_synchronised: Option<usize>,
}

impl Default for HaPolicy {
    fn default() -> Self {
        Self {
            mode: None,
            sync_automatic: false,
            min_masters: None,
            promote_on_failure_always: true,
            promote_on_shutdown_always: false,
            min_synchronised: None,
        }
    }
}

const KNOWN_KEYS: &[&str] = &[
    "ha-mode",
    "ha-params",
    "ha-sync-mode",
    "ha-sync-batch-size",
    "ha-promote-on-shutdown",
    "ha-promote-on-failure",
    "ha-min-synchronised",
    "queue-master-locator",
    "queue-leader-locator",
    "message-ttl",
    "expires",
    "max-length",
    "overflow",
    "dead-letter-exchange",
    "dead-letter-routing-key",
    "dead-letter-strategy",
    "queue-mode",
    "alternate-exchange",
    "consumer-timeout",
    "delivery-limit",
];

/// `parse_definition`, remembered per definition text: failover passes ask
/// for every queue's mirroring settings twice a second.
pub fn ha_policy_of(json: &str) -> Option<HaPolicy> {
    static PARSED: OnceLock<Mutex<HashMap<String, Option<HaPolicy>>>> = OnceLock::new();
    let mut parsed = PARSED.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if let Some(h) = parsed.get(json) {
        return h.clone();
    }
    if parsed.len() >= PATTERN_CACHE_MAX {
        parsed.clear();
    }
    let h = parse_definition(json).ok();
    parsed.insert(json.to_string(), h.clone());
    h
}

/// Validate a definition (JSON object) and extract its mirroring settings.
pub fn parse_definition(json: &str) -> Result<HaPolicy, String> {
    let v: serde_json::Value = serde_json::from_str(json).map_err(|e| format!("definition is not JSON: {e}"))?;
    let obj = v.as_object().ok_or("definition must be a JSON object")?;
    if obj.is_empty() {
        return Err("definition is empty".into());
    }
    for k in obj.keys() {
        // As `x-max-length-bytes` is: refused rather than silently not
        // enforced.
        if k == "max-length-bytes" {
            return Err("definition key 'max-length-bytes' is not supported by mirrorq".into());
        }
        if !KNOWN_KEYS.contains(&k.as_str()) {
            return Err(format!("definition key '{k}' not recognised"));
        }
    }
    let str_of = |k: &str| -> Result<Option<&str>, String> {
        match obj.get(k) {
            None => Ok(None),
            Some(serde_json::Value::String(s)) => Ok(Some(s.as_str())),
            Some(other) => Err(format!("{k} must be a string, not {other}")),
        }
    };
    let params = obj.get("ha-params");
    let mode = match str_of("ha-mode")? {
        None => {
            if params.is_some() {
                return Err("ha-params given without ha-mode".into());
            }
            None
        }
        Some("all") => {
            if params.is_some() {
                return Err("ha-params are not allowed with ha-mode all".into());
            }
            Some(HaMode::All)
        }
        Some("exactly") => match params.and_then(|p| p.as_i64()) {
            Some(n) if n >= 1 => Some(HaMode::Exactly(n as usize)),
            _ => return Err("ha-mode exactly needs ha-params, a positive integer".into()),
        },
        Some("nodes") => match params.and_then(|p| p.as_array()) {
            Some(list) if !list.is_empty() => {
                let names: Option<Vec<String>> = list.iter().map(|n| n.as_str().map(str::to_string)).collect();
                Some(HaMode::Nodes(names.ok_or("ha-params for ha-mode nodes must be a list of node names")?))
            }
            _ => return Err("ha-mode nodes needs ha-params, a non-empty list of node names".into()),
        },
        Some(other) => return Err(format!("ha-mode '{other}' is not one of all, exactly, nodes")),
    };
    let sync_automatic = match str_of("ha-sync-mode")? {
        // RabbitMQ's default is manual.
        None | Some("manual") => false,
        Some("automatic") => true,
        Some(other) => return Err(format!("ha-sync-mode '{other}' is not one of automatic, manual")),
    };
    let mut promote_always = [false, true];
    for (i, k) in ["ha-promote-on-shutdown", "ha-promote-on-failure"].into_iter().enumerate() {
        match str_of(k)? {
            None => {}
            Some("when-synced") => promote_always[i] = false,
            Some("always") => promote_always[i] = true,
            Some(other) => return Err(format!("{k} '{other}' is not one of when-synced, always")),
        }
    }
    let min_synchronised = match obj.get("ha-min-synchronised") {
        None => None,
        Some(v) => match v.as_i64() {
            Some(n) if n >= 1 => Some(n as usize),
            _ => return Err("ha-min-synchronised must be a positive integer".into()),
        },
    };
    for k in ["message-ttl", "expires", "max-length", "ha-sync-batch-size", "consumer-timeout"] {
        if let Some(v) = obj.get(k) {
            if v.as_i64().is_none_or(|n| n < 0) {
                return Err(format!("{k} must be a non-negative integer"));
            }
        }
    }
    if let Some(v) = obj.get("delivery-limit") {
        if v.as_i64().is_none_or(|n| n < -1) {
            return Err("delivery-limit must be a non-negative integer, or -1 for none".into());
        }
    }
    match str_of("overflow")? {
        None | Some("drop-head") | Some("reject-publish") => {}
        Some(other) => return Err(format!("overflow '{other}' is not one of drop-head, reject-publish")),
    }
    str_of("dead-letter-exchange")?;
    match str_of("dead-letter-strategy")? {
        None | Some("at-most-once") | Some("at-least-once") => {}
        Some(other) => return Err(format!("dead-letter-strategy '{other}' is not one of at-most-once, at-least-once")),
    }
    if str_of("dead-letter-routing-key")?.is_some() && obj.get("dead-letter-exchange").is_none() {
        return Err("dead-letter-routing-key given without dead-letter-exchange".into());
    }
    // RabbitMQ 4's name first; the older one, if set too, wins.
    let leader = match str_of("queue-leader-locator")? {
        None => None,
        Some("balanced") | Some("random") | Some("least-leaders") => Some(true),
        Some("client-local") => Some(false),
        Some(other) => return Err(format!("queue-leader-locator '{other}' is not one of client-local, balanced")),
    };
    let min_masters = match str_of("queue-master-locator")? {
        None => leader,
        Some("min-masters") => Some(true),
        Some("client-local") => Some(false),
        Some("random") => Some(true),
        Some(other) => return Err(format!("queue-master-locator '{other}' is not one of client-local, min-masters")),
    };
    Ok(HaPolicy {
        mode,
        sync_automatic,
        min_masters,
        promote_on_shutdown_always: promote_always[0],
        promote_on_failure_always: promote_always[1],
        min_synchronised,
    })
}

/// Validate a whole policy before it is stored.
pub fn validate(p: &Policy) -> Result<HaPolicy, String> {
    if names::name_of(&p.name).is_empty() {
        return Err("policy name is empty".into());
    }
    regex::Regex::new(&p.pattern).map_err(|e| format!("pattern is not a valid regex: {e}"))?;
    parse_definition(&p.definition)
}

/// Patterns seen, compiled once each (None: not a valid regex), for
/// policies and permissions. Every failover and reconcile pass asks for
/// every queue's policy: compiling the pattern each time was a fifth of an
/// idle node's CPU with 600 queues.
/// Bounded (this and the parsed definitions): cleared when clients have
/// sent this many distinct ones.
const PATTERN_CACHE_MAX: usize = 4096;

pub(super) fn pattern_matches(pattern: &str, name: &str) -> bool {
    // Shared, not cloned: a cloned `Regex` gets a pool of its own, so each
    // match built a fresh search cache, and the failure watch matches every
    // settling group's queue at each round.
    static COMPILED: OnceLock<Mutex<HashMap<String, Option<Arc<regex::Regex>>>>> = OnceLock::new();
    let regex = {
        let mut compiled = COMPILED.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
        match compiled.get(pattern) {
            Some(r) => r.clone(),
            None => {
                if compiled.len() >= PATTERN_CACHE_MAX {
                    compiled.clear();
                }
                let r = regex::Regex::new(pattern).ok().map(Arc::new);
                compiled.insert(pattern.to_string(), r.clone());
                r
            }
        }
    };
    regex.is_some_and(|r| r.is_match(name))
}

/// The policy that applies to queue `queue` (a key): the highest priority
/// among the matching ones of its vhost; equal priorities go to the name that
/// sorts first, so every node picks the same one.
pub fn effective<'a>(policies: &'a BTreeMap<String, Policy>, queue: &str) -> Option<&'a Policy> {
    effective_of(policies, queue, ApplyTo::covers_queues)
}

/// The policy that applies to exchange `exchange` (a key), chosen as for a queue.
pub fn effective_for_exchange<'a>(policies: &'a BTreeMap<String, Policy>, exchange: &str) -> Option<&'a Policy> {
    effective_of(policies, exchange, ApplyTo::covers_exchanges)
}

fn effective_of<'a>(
    policies: &'a BTreeMap<String, Policy>,
    key: &str,
    covers: fn(ApplyTo) -> bool,
) -> Option<&'a Policy> {
    let (vhost, name) = names::split(key);
    policies
        .values()
        .filter(|p| covers(p.apply_to) && names::vhost_of(&p.name) == vhost)
        .filter(|p| pattern_matches(&p.pattern, name))
        .fold(None, |best: Option<&Policy>, p| match best {
            Some(b) if b.priority >= p.priority => Some(b),
            _ => Some(p),
        })
}

/// The replica set a mirroring mode wants, keeping seniority: current
/// replicas stay in their order (master first), new ones are appended.
/// `nodes` are all cluster members (id, name) in id order; `load` counts
/// replicas per node, to put new mirrors where there are fewest.
pub fn placement(
    mode: Option<&HaMode>,
    current: &[NodeId],
    nodes: &[(NodeId, String)],
    load: &BTreeMap<NodeId, usize>,
) -> Vec<NodeId> {
    let exists = |id: &NodeId| nodes.iter().any(|(n, _)| n == id);
    let mut out: Vec<NodeId> = current.iter().copied().filter(exists).collect();
    if out.is_empty() {
        out = current.to_vec();
    }
    let mut by_load: Vec<NodeId> = nodes.iter().map(|(id, _)| *id).collect();
    by_load.sort_by_key(|id| (load.get(id).copied().unwrap_or(0), *id));
    match mode {
        None => out.truncate(1),
        Some(HaMode::All) => {
            for (id, _) in nodes {
                if !out.contains(id) {
                    out.push(*id);
                }
            }
        }
        Some(HaMode::Exactly(n)) => {
            let n = (*n).min(nodes.len()).max(1);
            out.truncate(n);
            for id in by_load {
                if out.len() >= n {
                    break;
                }
                if !out.contains(&id) {
                    out.push(id);
                }
            }
        }
        Some(HaMode::Nodes(names)) => {
            let wanted: Vec<NodeId> =
                nodes.iter().filter(|(_, name)| names.contains(name)).map(|(id, _)| *id).collect();
            if !wanted.is_empty() {
                // Keep the master if it is listed; otherwise the first listed takes over.
                out.retain(|id| wanted.contains(id));
                for id in wanted {
                    if !out.contains(&id) {
                        out.push(id);
                    }
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pol(name: &str, pattern: &str, priority: i64, apply_to: ApplyTo, def: &str) -> Policy {
        Policy { name: name.into(), pattern: pattern.into(), apply_to, priority, definition: def.into() }
    }

    #[test]
    fn remembered_patterns_and_definitions_answer_as_fresh_ones() {
        for _ in 0..2 {
            assert!(pattern_matches("^ha\\.", "ha.q"));
            assert!(!pattern_matches("^ha\\.", "hax"));
            assert!(!pattern_matches("(", "("), "an invalid pattern matches nothing");
            let def = r#"{"ha-mode":"exactly","ha-params":2}"#;
            assert_eq!(ha_policy_of(def), parse_definition(def).ok());
            assert_eq!(ha_policy_of("not json"), None);
        }
        // Past the bound the memory starts again, and still answers.
        for i in 0..PATTERN_CACHE_MAX + 10 {
            assert!(pattern_matches(&format!("^q{i}$"), &format!("q{i}")));
        }
        assert!(pattern_matches("^ha\\.", "ha.q"));
    }

    #[test]
    fn the_leader_locator_is_rabbitmq_4s_name_for_the_master_locator() {
        let of = |d: &str| parse_definition(d).map(|p| p.min_masters);
        assert_eq!(of(r#"{"queue-leader-locator":"balanced"}"#), Ok(Some(true)));
        assert_eq!(of(r#"{"queue-leader-locator":"client-local"}"#), Ok(Some(false)));
        let both = r#"{"queue-leader-locator":"balanced","queue-master-locator":"client-local"}"#;
        assert_eq!(of(both), Ok(Some(false)));
        assert!(of(r#"{"queue-leader-locator":"nearest"}"#).is_err());
    }

    #[test]
    fn a_byte_limit_is_refused_as_its_argument_is() {
        let bytes = parse_definition(r#"{"max-length-bytes":1000}"#).unwrap_err();
        assert!(bytes.contains("not supported"), "{bytes}");
    }

    #[test]
    fn definitions_are_validated() {
        assert_eq!(parse_definition(r#"{"ha-mode":"all"}"#).unwrap().mode, Some(HaMode::All));
        assert_eq!(parse_definition(r#"{"ha-mode":"exactly","ha-params":2}"#).unwrap().mode, Some(HaMode::Exactly(2)));
        assert_eq!(
            parse_definition(r#"{"ha-mode":"nodes","ha-params":["a","b"]}"#).unwrap().mode,
            Some(HaMode::Nodes(vec!["a".into(), "b".into()]))
        );
        assert!(parse_definition(r#"{"ha-mode":"al"}"#).is_err());
        assert!(parse_definition(r#"{"ha-mode":"exactly","ha-params":"2"}"#).is_err());
        assert!(parse_definition(r#"{"ha-mode":"exactly","ha-params":0}"#).is_err());
        assert!(parse_definition(r#"{"ha-mode":"exactly","ha-params":-1}"#).is_err());
        assert!(parse_definition(r#"{"ha-mode":"nodes","ha-params":[1]}"#).is_err());
        assert!(parse_definition(r#"{"ha-mode":"all","ha-params":3}"#).is_err());
        assert!(parse_definition(r#"{"ha-params":3}"#).is_err());
        assert!(parse_definition(r#"{"ha-mode":"all","ha-sync-mode":"sometimes"}"#).is_err());
        assert!(parse_definition(r#"{"ha-mode":"all","ha-promote-on-failure":"never"}"#).is_err());
        assert!(parse_definition(r#"{"ha-mode":"all","bogus":1}"#).is_err());
        assert!(parse_definition(r#"{"max-length":-5}"#).is_err());
        assert!(parse_definition(r#"[1]"#).is_err());
        assert!(parse_definition(r#"{}"#).is_err());
        assert!(parse_definition("not json").is_err());
        assert!(parse_definition(r#"{"ha-mode":"all","ha-sync-mode":"automatic"}"#).unwrap().sync_automatic);
        assert!(!parse_definition(r#"{"ha-mode":"all","ha-sync-mode":"manual"}"#).unwrap().sync_automatic);
        let bad_regex = pol("p", "(", 0, ApplyTo::All, r#"{"ha-mode":"all"}"#);
        assert!(validate(&bad_regex).unwrap_err().contains("regex"));
    }

    #[test]
    fn highest_priority_matching_policy_wins_ties_by_name() {
        let mut ps = BTreeMap::new();
        for p in [
            pol("all-ha", "^ha", 0, ApplyTo::All, r#"{"ha-mode":"all"}"#),
            pol("two", "^ha\\.orders", 5, ApplyTo::Queues, r#"{"ha-mode":"exactly","ha-params":2}"#),
            pol("ex-only", "^ha", 10, ApplyTo::Exchanges, r#"{"alternate-exchange":"x"}"#),
            pol("b-tie", "tie", 1, ApplyTo::Queues, r#"{"ha-mode":"all"}"#),
            pol("a-tie", "tie", 1, ApplyTo::Queues, r#"{"ha-mode":"exactly","ha-params":1}"#),
        ] {
            ps.insert(p.name.clone(), p);
        }
        assert_eq!(effective(&ps, "ha.orders").unwrap().name, "two");
        assert_eq!(effective(&ps, "ha.other").unwrap().name, "all-ha", "exchange-only policy ignored");
        assert_eq!(effective(&ps, "tie").unwrap().name, "a-tie");
        assert!(effective(&ps, "plain").is_none());
    }

    #[test]
    fn placement_by_mode_keeps_seniority() {
        let nodes: Vec<(NodeId, String)> = (1..=3).map(|i| (i, format!("mirrorq@{i}"))).collect();
        let none = BTreeMap::new();
        assert_eq!(placement(None, &[2, 3], &nodes, &none), vec![2]);
        assert_eq!(placement(Some(&HaMode::All), &[2], &nodes, &none), vec![2, 1, 3]);
        assert_eq!(placement(Some(&HaMode::Exactly(2)), &[3], &nodes, &none), vec![3, 1]);
        assert_eq!(placement(Some(&HaMode::Exactly(2)), &[3, 1, 2], &nodes, &none), vec![3, 1], "drops the youngest");
        assert_eq!(placement(Some(&HaMode::Exactly(9)), &[1], &nodes, &none), vec![1, 2, 3], "more than nodes: all");
        let load: BTreeMap<NodeId, usize> = [(1, 5), (2, 0), (3, 1)].into();
        assert_eq!(placement(Some(&HaMode::Exactly(2)), &[3], &nodes, &load), vec![3, 2], "least loaded first");
        let listed = HaMode::Nodes(vec!["mirrorq@2".into(), "mirrorq@3".into(), "ghost".into()]);
        assert_eq!(placement(Some(&listed), &[1], &nodes, &none), vec![2, 3]);
        assert_eq!(placement(Some(&listed), &[3], &nodes, &none), vec![3, 2]);
        let ghosts = HaMode::Nodes(vec!["ghost".into()]);
        assert_eq!(placement(Some(&ghosts), &[1, 2], &nodes, &none), vec![1, 2], "no listed node exists: stay");
    }
}
