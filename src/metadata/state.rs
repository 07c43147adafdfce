use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::routing::{builtin, Binding, ExchangeMeta};
use crate::raft::types::{GroupId, NodeId, METADATA_GROUP};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    pub id: NodeId,
    pub name: String,
    pub raft_addr: String,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QueueMeta {
    pub name: String,
    pub group: GroupId,
    /// Replica nodes in seniority order; the first is the initial master.
    pub replicas: Vec<NodeId>,
    pub durable: bool,
}

/// The metadata as every node sees it once applied.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaState {
    pub nodes: BTreeMap<NodeId, NodeInfo>,
    pub queues: BTreeMap<String, QueueMeta>,
    /// Next queue group id; 0 is the metadata group itself.
    pub next_group: GroupId,
    /// Declared exchanges (the built-in `amq.*` and default ones are implicit).
    #[serde(default)]
    pub exchanges: BTreeMap<String, ExchangeMeta>,
    #[serde(default)]
    pub bindings: BTreeSet<Binding>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaCmd {
    /// A node announces its name and address (idempotent).
    RegisterNode(NodeInfo),
    /// Create a queue unless one of that name exists (then answer it as is).
    DeclareQueue {
        name: String,
        replicas: Vec<NodeId>,
        durable: bool,
    },
    DeleteQueue {
        name: String,
    },
    /// Create an exchange unless one of that name exists; a different type
    /// is refused.
    DeclareExchange(ExchangeMeta),
    DeleteExchange {
        name: String,
        if_unused: bool,
    },
    Bind(Binding),
    Unbind(Binding),
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaReply {
    Ok,
    Queue(QueueMeta),
    NotFound,
    Invalid(String),
    /// The request conflicts with what exists (AMQP 406).
    Conflict(String),
    /// Reserved names (AMQP 403).
    Refused(String),
}

impl MetaState {
    pub fn apply(&mut self, cmd: &MetaCmd) -> MetaReply {
        match cmd {
            MetaCmd::RegisterNode(info) => {
                self.nodes.insert(info.id, info.clone());
                MetaReply::Ok
            }
            MetaCmd::DeclareQueue { name, replicas, durable } => {
                if let Some(q) = self.queues.get(name) {
                    return MetaReply::Queue(q.clone());
                }
                if replicas.is_empty() {
                    return MetaReply::Invalid("a queue needs at least one replica".into());
                }
                let mut seen = std::collections::BTreeSet::new();
                if !replicas.iter().all(|r| seen.insert(*r)) {
                    return MetaReply::Invalid("replica listed twice".into());
                }
                if let Some(r) = replicas.iter().find(|r| !self.nodes.contains_key(r)) {
                    return MetaReply::Invalid(format!("node {r} is not a cluster member"));
                }
                self.next_group = self.next_group.max(METADATA_GROUP) + 1;
                let q = QueueMeta {
                    name: name.clone(),
                    group: self.next_group,
                    replicas: replicas.clone(),
                    durable: *durable,
                };
                self.queues.insert(name.clone(), q.clone());
                MetaReply::Queue(q)
            }
            MetaCmd::DeleteQueue { name } => match self.queues.remove(name) {
                Some(_) => {
                    self.bindings.retain(|b| &b.queue != name);
                    MetaReply::Ok
                }
                None => MetaReply::NotFound,
            },
            MetaCmd::DeclareExchange(ex) => {
                if let Some(have) = self.exchange(&ex.name) {
                    return if have.kind == ex.kind {
                        MetaReply::Ok
                    } else {
                        MetaReply::Conflict(format!(
                            "inequivalent arg 'type' for exchange '{}' in vhost '/': received '{}' but current is '{}'",
                            ex.name,
                            ex.kind.as_str(),
                            have.kind.as_str()
                        ))
                    };
                }
                if ex.name.starts_with("amq.") {
                    return MetaReply::Refused(format!("exchange name '{}' contains reserved prefix 'amq.*'", ex.name));
                }
                self.exchanges.insert(ex.name.clone(), ex.clone());
                MetaReply::Ok
            }
            MetaCmd::DeleteExchange { name, if_unused } => {
                if builtin(name).is_some() {
                    return MetaReply::Refused(format!("cannot delete built-in exchange '{name}'"));
                }
                if !self.exchanges.contains_key(name) {
                    return MetaReply::NotFound;
                }
                if *if_unused && self.bindings.iter().any(|b| &b.exchange == name) {
                    return MetaReply::Conflict(format!("exchange '{name}' in vhost '/' in use"));
                }
                self.exchanges.remove(name);
                self.bindings.retain(|b| &b.exchange != name);
                MetaReply::Ok
            }
            MetaCmd::Bind(b) => {
                if b.exchange.is_empty() {
                    return MetaReply::Refused("operation not permitted on the default exchange".into());
                }
                if self.exchange(&b.exchange).is_none() || !self.queues.contains_key(&b.queue) {
                    return MetaReply::NotFound;
                }
                self.bindings.insert(b.clone());
                MetaReply::Ok
            }
            MetaCmd::Unbind(b) => {
                if b.exchange.is_empty() {
                    return MetaReply::Refused("operation not permitted on the default exchange".into());
                }
                self.bindings.remove(b);
                MetaReply::Ok
            }
        }
    }

    /// A declared or built-in exchange.
    pub fn exchange(&self, name: &str) -> Option<ExchangeMeta> {
        self.exchanges.get(name).cloned().or_else(|| builtin(name))
    }

    pub fn queue_by_group(&self, group: GroupId) -> Option<&QueueMeta> {
        self.queues.values().find(|q| q.group == group)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_nodes(n: u64) -> MetaState {
        let mut s = MetaState::default();
        for id in 1..=n {
            s.apply(&MetaCmd::RegisterNode(NodeInfo { id, name: format!("n{id}"), raft_addr: String::new() }));
        }
        s
    }

    #[test]
    fn declare_assigns_distinct_groups_and_is_idempotent() {
        let mut s = with_nodes(3);
        let a = s.apply(&MetaCmd::DeclareQueue { name: "a".into(), replicas: vec![1, 2], durable: true });
        let b = s.apply(&MetaCmd::DeclareQueue { name: "b".into(), replicas: vec![3], durable: true });
        let (MetaReply::Queue(a), MetaReply::Queue(b)) = (a, b) else { panic!("declare failed") };
        assert_ne!(a.group, b.group);
        assert_ne!(a.group, METADATA_GROUP);
        let again = s.apply(&MetaCmd::DeclareQueue { name: "a".into(), replicas: vec![3], durable: false });
        assert_eq!(again, MetaReply::Queue(a));
    }

    #[test]
    fn declare_rejects_unknown_or_duplicate_replicas() {
        let mut s = with_nodes(2);
        assert!(matches!(
            s.apply(&MetaCmd::DeclareQueue { name: "a".into(), replicas: vec![1, 9], durable: true }),
            MetaReply::Invalid(_)
        ));
        assert!(matches!(
            s.apply(&MetaCmd::DeclareQueue { name: "a".into(), replicas: vec![1, 1], durable: true }),
            MetaReply::Invalid(_)
        ));
        assert!(matches!(
            s.apply(&MetaCmd::DeclareQueue { name: "a".into(), replicas: vec![], durable: true }),
            MetaReply::Invalid(_)
        ));
        assert!(s.queues.is_empty());
    }

    #[test]
    fn exchanges_bindings_and_queue_deletion() {
        use crate::metadata::routing::{Args, ExchangeKind};
        let mut s = with_nodes(1);
        s.apply(&MetaCmd::DeclareQueue { name: "q".into(), replicas: vec![1], durable: true });
        let ex =
            |n: &str, k| ExchangeMeta { name: n.into(), kind: k, durable: true, auto_delete: false, internal: false };
        assert_eq!(s.apply(&MetaCmd::DeclareExchange(ex("logs", ExchangeKind::Topic))), MetaReply::Ok);
        assert_eq!(s.apply(&MetaCmd::DeclareExchange(ex("logs", ExchangeKind::Topic))), MetaReply::Ok);
        assert!(matches!(s.apply(&MetaCmd::DeclareExchange(ex("logs", ExchangeKind::Fanout))), MetaReply::Conflict(_)));
        assert!(matches!(
            s.apply(&MetaCmd::DeclareExchange(ex("amq.mine", ExchangeKind::Fanout))),
            MetaReply::Refused(_)
        ));
        let b = |e: &str, q: &str| Binding {
            exchange: e.into(),
            queue: q.into(),
            routing_key: "k".into(),
            args: Args::new(),
        };
        assert_eq!(s.apply(&MetaCmd::Bind(b("logs", "q"))), MetaReply::Ok);
        assert_eq!(s.apply(&MetaCmd::Bind(b("nope", "q"))), MetaReply::NotFound);
        assert_eq!(s.apply(&MetaCmd::Bind(b("logs", "nope"))), MetaReply::NotFound);
        assert!(matches!(s.apply(&MetaCmd::Bind(b("", "q"))), MetaReply::Refused(_)));
        assert!(matches!(
            s.apply(&MetaCmd::DeleteExchange { name: "logs".into(), if_unused: true }),
            MetaReply::Conflict(_)
        ));
        s.apply(&MetaCmd::DeleteQueue { name: "q".into() });
        assert!(s.bindings.is_empty(), "deleting a queue removes its bindings");
        assert_eq!(s.apply(&MetaCmd::DeleteExchange { name: "logs".into(), if_unused: true }), MetaReply::Ok);
        assert!(matches!(
            s.apply(&MetaCmd::DeleteExchange { name: "amq.topic".into(), if_unused: false }),
            MetaReply::Refused(_)
        ));
    }

    #[test]
    fn delete_then_redeclare_gets_a_new_group() {
        let mut s = with_nodes(1);
        let MetaReply::Queue(a) =
            s.apply(&MetaCmd::DeclareQueue { name: "a".into(), replicas: vec![1], durable: true })
        else {
            panic!()
        };
        assert_eq!(s.apply(&MetaCmd::DeleteQueue { name: "a".into() }), MetaReply::Ok);
        assert_eq!(s.apply(&MetaCmd::DeleteQueue { name: "a".into() }), MetaReply::NotFound);
        let MetaReply::Queue(a2) =
            s.apply(&MetaCmd::DeclareQueue { name: "a".into(), replicas: vec![1], durable: true })
        else {
            panic!()
        };
        assert_ne!(a.group, a2.group, "a re-declared queue must not reuse the old group's log");
    }
}
