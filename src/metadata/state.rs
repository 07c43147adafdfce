use std::collections::{BTreeMap, BTreeSet};

use imbl::OrdMap;
use serde::{Deserialize, Serialize};

use super::access::{default_guest, Permission, User, Vhost};
use super::names::{self, DEFAULT_VHOST};
use super::policy::{self, Policy};
use super::queue_args::QueueArgs;
use super::routing::{builtin, Binding, ExchangeMeta};
use crate::ids::{GroupId, NodeId};

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
    /// Replica nodes in seniority order (longest in the group first); the
    /// wish that the master reconciles the group's membership towards.
    pub replicas: Vec<NodeId>,
    /// The members the group was founded with. Only `initial[0]` founds the
    /// group; emptied when that node leaves the replicas (its replica is
    /// then deleted), so a founder moved away and back never founds a
    /// second group over the first.
    pub initial: Vec<NodeId>,
    pub durable: bool,
    /// Placement follows policies (false: replicas given explicitly).
    pub by_policy: bool,
    /// Name of the effective policy, if any.
    pub policy: Option<String>,
    /// AMQP connection that declared it exclusive (deleted when it closes).
    #[serde(default)]
    pub exclusive_owner: Option<u64>,
    /// Deleted when its last consumer goes away (AMQP `auto_delete`).
    #[serde(default)]
    pub auto_delete: bool,
    /// Declare arguments mirrorq acts on (TTL, max length, dead-lettering).
    #[serde(default)]
    pub args: Box<QueueArgs>,
}

impl QueueMeta {
    /// Forget the founding members once the founder is no longer a replica.
    fn forget_a_gone_founder(&mut self) {
        if self.initial.first().is_some_and(|f| !self.replicas.contains(f)) {
            self.initial.clear();
        }
    }
}

/// What decides how a queue is mirrored besides its policy.
#[derive(Clone, Copy)]
struct Kind<'a> {
    args: &'a QueueArgs,
    exclusive: bool,
}

/// The metadata as every node sees it once applied. Queues, exchanges,
/// bindings and policies are keyed by [`names::key`] (vhost and name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaState {
    pub nodes: BTreeMap<NodeId, NodeInfo>,
    /// Shared between the states published after each change (a copy costs
    /// nothing and a change copies only its path), so a change costs the
    /// same with ten thousand queues.
    pub queues: OrdMap<String, QueueMeta>,
    /// Next queue group id; 0 is the metadata group itself.
    pub next_group: GroupId,
    /// Declared exchanges (the built-in `amq.*` and default ones are implicit).
    #[serde(default)]
    pub exchanges: BTreeMap<String, ExchangeMeta>,
    #[serde(default)]
    pub bindings: BTreeSet<Binding>,
    #[serde(default)]
    pub policies: BTreeMap<String, Policy>,
    pub users: BTreeMap<String, User>,
    pub vhosts: BTreeMap<String, Vhost>,
    /// Per vhost, per user.
    pub permissions: BTreeMap<String, BTreeMap<String, Permission>>,
    /// Each queue's name by its group: not stored, rebuilt by
    /// [`MetaState::reindex`] when the state is read back.
    #[serde(skip)]
    by_group: OrdMap<GroupId, String>,
    /// Derived from the queues like `by_group`, for placement: counting
    /// afresh went over every queue at each declare.
    #[serde(skip)]
    counts: Counts,
}

/// How many queues each node is the first replica (master by placement)
/// of, and a replica of.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Counts {
    masters: BTreeMap<NodeId, usize>,
    replicas: BTreeMap<NodeId, usize>,
}

impl Counts {
    fn add(&mut self, q: &QueueMeta) {
        if let Some(m) = q.replicas.first() {
            *self.masters.entry(*m).or_default() += 1;
        }
        for r in &q.replicas {
            *self.replicas.entry(*r).or_default() += 1;
        }
    }

    fn remove(&mut self, q: &QueueMeta) {
        fn less(map: &mut BTreeMap<NodeId, usize>, id: NodeId) {
            if let Some(n) = map.get_mut(&id) {
                *n -= 1;
                if *n == 0 {
                    map.remove(&id);
                }
            }
        }
        if let Some(m) = q.replicas.first() {
            less(&mut self.masters, *m);
        }
        for r in &q.replicas {
            less(&mut self.replicas, *r);
        }
    }
}

impl Default for MetaState {
    /// A fresh cluster, as a fresh RabbitMQ node: vhost `/` and user
    /// `guest` (administrator, all permissions on `/`).
    fn default() -> Self {
        let guest = default_guest();
        Self {
            nodes: BTreeMap::new(),
            queues: OrdMap::new(),
            by_group: OrdMap::new(),
            counts: Counts::default(),
            next_group: 0,
            exchanges: BTreeMap::new(),
            bindings: BTreeSet::new(),
            policies: BTreeMap::new(),
            permissions: [(
                DEFAULT_VHOST.to_string(),
                [(guest.name.clone(), Permission::full(&guest.name, DEFAULT_VHOST))].into(),
            )]
            .into(),
            users: [(guest.name.clone(), guest)].into(),
            vhosts: [(DEFAULT_VHOST.to_string(), Vhost::named(DEFAULT_VHOST))].into(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaCmd {
    /// A node announces its name and address (idempotent).
    RegisterNode(NodeInfo),
    /// A node leaves the cluster for good: its replicas are dropped (and
    /// replaced where a policy says so). Refused if it holds a queue's only
    /// replica.
    ForgetNode {
        id: NodeId,
    },
    /// Create a queue unless one of that name exists (then answer it as is).
    /// Empty `replicas`: placed by the effective policy, the master chosen by
    /// the locator (`declared_on` for client-local).
    DeclareQueue {
        name: String,
        replicas: Vec<NodeId>,
        durable: bool,
        #[serde(default)]
        declared_on: NodeId,
        /// `x-queue-master-locator`: Some(true) min-masters, Some(false) client-local.
        #[serde(default)]
        locator: Option<bool>,
        #[serde(default)]
        exclusive_owner: Option<u64>,
        #[serde(default)]
        auto_delete: bool,
        #[serde(default)]
        args: Box<QueueArgs>,
    },
    /// Add or replace a policy (validated first; nothing invalid is stored).
    SetPolicy(Policy),
    ClearPolicy {
        name: String,
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
    /// Add or replace a user (the password already hashed).
    PutUser(User),
    /// Remove a user and its permissions.
    DeleteUser {
        name: String,
    },
    PutVhost(Vhost),
    /// Remove a vhost with everything in it: queues, exchanges, bindings,
    /// policies, permissions.
    DeleteVhost {
        name: String,
    },
    SetPermission(Permission),
    ClearPermission {
        vhost: String,
        user: String,
    },
}

/// The default is what blank and membership entries answer, read by nobody.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaReply {
    #[default]
    Ok,
    /// A new object was made (HTTP answers 201 rather than 204).
    Created,
    /// The queue, as it already was.
    Queue(QueueMeta),
    /// The queue, just created.
    NewQueue(QueueMeta),
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
            MetaCmd::RegisterNode(info) => self.register_node(info),
            MetaCmd::ForgetNode { id } => self.forget_node(*id),
            MetaCmd::DeclareQueue {
                name,
                replicas,
                durable,
                declared_on,
                locator,
                exclusive_owner,
                auto_delete,
                args,
            } => {
                if let Some(q) = self.queues.get(name) {
                    return MetaReply::Queue(q.clone());
                }
                let kind = Kind { args, exclusive: exclusive_owner.is_some() };
                let (placed, policy) = match self.place_new_queue(name, replicas, *declared_on, *locator, kind) {
                    Ok(placed) => placed,
                    Err(why) => return why,
                };
                self.next_group += 1;
                self.add_queue(QueueMeta {
                    name: name.clone(),
                    group: self.next_group,
                    initial: placed.clone(),
                    replicas: placed,
                    durable: *durable,
                    by_policy: replicas.is_empty(),
                    policy,
                    exclusive_owner: *exclusive_owner,
                    auto_delete: *auto_delete,
                    args: args.clone(),
                })
            }
            MetaCmd::SetPolicy(p) => self.set_policy(p),
            MetaCmd::ClearPolicy { name } => self.clear_policy(name),
            MetaCmd::DeleteQueue { name } => self.delete_queue(name),
            MetaCmd::DeclareExchange(ex) => self.declare_exchange(ex),
            MetaCmd::DeleteExchange { name, if_unused } => self.delete_exchange(name, *if_unused),
            MetaCmd::Bind(b) => self.bind(b),
            MetaCmd::Unbind(b) => self.unbind(b),
            MetaCmd::PutUser(u) => self.put_user(u),
            MetaCmd::DeleteUser { name } => self.delete_user(name),
            MetaCmd::PutVhost(v) => self.put_vhost(v),
            MetaCmd::DeleteVhost { name } => self.delete_vhost(name),
            MetaCmd::SetPermission(p) => self.set_permission(p),
            MetaCmd::ClearPermission { vhost, user } => self.clear_permission(vhost, user),
        }
    }

    fn register_node(&mut self, info: &NodeInfo) -> MetaReply {
        let new = !self.nodes.contains_key(&info.id);
        self.nodes.insert(info.id, info.clone());
        if new {
            self.replace_all();
        }
        MetaReply::Ok
    }

    fn forget_node(&mut self, id: NodeId) -> MetaReply {
        if !self.nodes.contains_key(&id) {
            return MetaReply::NotFound;
        }
        let only: Vec<&str> = self.queues.values().filter(|q| q.replicas == [id]).map(|q| q.name.as_str()).collect();
        if !only.is_empty() {
            return MetaReply::Conflict(format!(
                "node {id} holds the only replica of queue(s) {}; delete or mirror them first",
                only.join(", ")
            ));
        }
        self.nodes.remove(&id);
        let holding: Vec<String> =
            self.queues.values().filter(|q| q.replicas.contains(&id)).map(|q| q.name.clone()).collect();
        for name in holding {
            if let Some(q) = self.queues.get_mut(&name) {
                q.replicas.retain(|r| *r != id);
                q.forget_a_gone_founder();
            }
        }
        self.replace_all();
        MetaReply::Ok
    }

    /// The replicas and policy of a queue about to be declared, checked:
    /// `replicas` as asked, or placed as [`MetaState::mirroring`] says if
    /// empty.
    fn place_new_queue(
        &self,
        name: &str,
        replicas: &[NodeId],
        declared_on: NodeId,
        locator: Option<bool>,
        kind: Kind<'_>,
    ) -> Result<(Vec<NodeId>, Option<String>), MetaReply> {
        self.vhost_exists(name)?;
        let (replicas, policy) = if replicas.is_empty() {
            let (mode, pol) = self.mirroring(name, kind);
            let ha = pol.as_ref().and_then(|p| policy::parse_definition(&p.definition).ok());
            // CONTRACT 5: client-local for unmirrored queues, min-masters
            // for mirrored; an exclusive queue lives on its connection's node.
            let min_masters =
                !kind.exclusive && locator.or(ha.as_ref().and_then(|h| h.min_masters)).unwrap_or(mode.is_some());
            let master = if min_masters || !self.nodes.contains_key(&declared_on) {
                self.least_masters().unwrap_or(declared_on)
            } else {
                declared_on
            };
            // Only `exactly` picks nodes by load; counting it walks every queue.
            let load = match mode {
                Some(policy::HaMode::Exactly(_)) => self.replica_load(),
                _ => BTreeMap::new(),
            };
            let placed = policy::placement(mode.as_ref(), &[master], &self.node_list(), &load);
            (placed, pol.map(|p| p.name))
        } else {
            (replicas.to_vec(), None)
        };
        if replicas.is_empty() {
            return Err(MetaReply::Invalid("a queue needs at least one replica".into()));
        }
        let mut seen = std::collections::BTreeSet::new();
        if !replicas.iter().all(|r| seen.insert(*r)) {
            return Err(MetaReply::Invalid("replica listed twice".into()));
        }
        if let Some(r) = replicas.iter().find(|r| !self.nodes.contains_key(r)) {
            return Err(MetaReply::Invalid(format!("node {r} is not a cluster member")));
        }
        Ok((replicas, policy))
    }

    /// How a queue placed by policy is mirrored, and its effective policy
    /// (whose other keys, TTLs and limits, apply whatever the mirroring).
    /// RabbitMQ's rules: an exclusive queue is never mirrored; a quorum
    /// queue has as many replicas as its arguments say and `ha-` keys do
    /// not apply to it; a classic queue follows its policy's `ha-mode`.
    fn mirroring(&self, name: &str, kind: Kind<'_>) -> (Option<policy::HaMode>, Option<Policy>) {
        let pol = policy::effective(&self.policies, name).cloned();
        let mode = if kind.exclusive {
            None
        } else if kind.args.is_quorum() {
            Some(policy::HaMode::Exactly(kind.args.quorum_size()))
        } else {
            pol.as_ref().and_then(|p| policy::parse_definition(&p.definition).ok()).and_then(|h| h.mode)
        };
        (mode, pol)
    }

    fn add_queue(&mut self, q: QueueMeta) -> MetaReply {
        self.queues.insert(q.name.clone(), q.clone());
        self.by_group.insert(q.group, q.name.clone());
        self.counts.add(&q);
        MetaReply::NewQueue(q)
    }

    fn delete_queue(&mut self, name: &str) -> MetaReply {
        match self.queues.remove(name).inspect(|q| {
            self.by_group.remove(&q.group);
            self.counts.remove(q);
        }) {
            Some(_) => {
                self.bindings.retain(|b| b.to_exchange || b.destination != name);
                MetaReply::Ok
            }
            None => MetaReply::NotFound,
        }
    }

    fn set_policy(&mut self, p: &Policy) -> MetaReply {
        if let Err(why) = policy::validate(p) {
            return MetaReply::Invalid(why);
        }
        if let Err(why) = self.vhost_exists(&p.name) {
            return why;
        }
        let new = self.policies.insert(p.name.clone(), p.clone()).is_none();
        self.replace_all();
        if new {
            MetaReply::Created
        } else {
            MetaReply::Ok
        }
    }

    fn clear_policy(&mut self, name: &str) -> MetaReply {
        if self.policies.remove(name).is_none() {
            return MetaReply::NotFound;
        }
        self.replace_all();
        MetaReply::Ok
    }

    fn declare_exchange(&mut self, ex: &ExchangeMeta) -> MetaReply {
        let (vhost, bare) = names::split(&ex.name);
        if let Some(have) = self.exchange(&ex.name) {
            return if have.kind == ex.kind {
                MetaReply::Ok
            } else {
                MetaReply::Conflict(format!(
                    "inequivalent arg 'type' for exchange '{bare}' in vhost '{vhost}': received '{}' but current is '{}'",
                    ex.kind.as_str(),
                    have.kind.as_str()
                ))
            };
        }
        if bare.starts_with("amq.") {
            return MetaReply::Refused(format!("exchange name '{bare}' contains reserved prefix 'amq.*'"));
        }
        if let Err(why) = self.vhost_exists(&ex.name) {
            return why;
        }
        self.exchanges.insert(ex.name.clone(), ex.clone());
        MetaReply::Ok
    }

    fn delete_exchange(&mut self, name: &str, if_unused: bool) -> MetaReply {
        let (vhost, bare) = names::split(name);
        if builtin(name).is_some() {
            return MetaReply::Refused(format!("cannot delete built-in exchange '{bare}'"));
        }
        if !self.exchanges.contains_key(name) {
            return MetaReply::NotFound;
        }
        // As RabbitMQ: bindings to it do not make it used.
        if if_unused && self.bindings.iter().any(|b| b.exchange == name) {
            return MetaReply::Conflict(format!("exchange '{bare}' in vhost '{vhost}' in use"));
        }
        self.exchanges.remove(name);
        self.bindings.retain(|b| b.exchange != name && !(b.to_exchange && b.destination == name));
        MetaReply::Ok
    }

    fn bind(&mut self, b: &Binding) -> MetaReply {
        if names::name_of(&b.exchange).is_empty() {
            return MetaReply::Refused("operation not permitted on the default exchange".into());
        }
        if b.to_exchange && names::name_of(&b.destination).is_empty() {
            return MetaReply::Refused("operation not permitted on the default exchange".into());
        }
        let destination = match b.to_exchange {
            true => self.exchange(&b.destination).is_some(),
            false => self.queues.contains_key(&b.destination),
        };
        if self.exchange(&b.exchange).is_none() || !destination {
            return MetaReply::NotFound;
        }
        self.bindings.insert(b.clone());
        MetaReply::Ok
    }

    fn unbind(&mut self, b: &Binding) -> MetaReply {
        if names::name_of(&b.exchange).is_empty() {
            return MetaReply::Refused("operation not permitted on the default exchange".into());
        }
        self.bindings.remove(b);
        MetaReply::Ok
    }

    fn put_user(&mut self, u: &User) -> MetaReply {
        if u.name.is_empty() {
            return MetaReply::Invalid("user name is empty".into());
        }
        match self.users.insert(u.name.clone(), u.clone()) {
            None => MetaReply::Created,
            Some(_) => MetaReply::Ok,
        }
    }

    fn delete_user(&mut self, name: &str) -> MetaReply {
        if self.users.remove(name).is_none() {
            return MetaReply::NotFound;
        }
        for users in self.permissions.values_mut() {
            users.remove(name);
        }
        MetaReply::Ok
    }

    fn put_vhost(&mut self, v: &Vhost) -> MetaReply {
        if let Err(why) = names::check("vhost", &v.name).and_then(|()| {
            if v.name.is_empty() {
                Err("vhost name is empty".to_string())
            } else {
                Ok(())
            }
        }) {
            return MetaReply::Invalid(why);
        }
        match self.vhosts.insert(v.name.clone(), v.clone()) {
            None => MetaReply::Created,
            Some(_) => MetaReply::Ok,
        }
    }

    fn delete_vhost(&mut self, name: &str) -> MetaReply {
        if self.vhosts.remove(name).is_none() {
            return MetaReply::NotFound;
        }
        let inside = |key: &String| names::vhost_of(key) == name;
        let gone: Vec<String> = self.queues.keys().filter(|k| inside(k)).cloned().collect();
        for k in gone {
            if let Some(q) = self.queues.remove(&k) {
                self.by_group.remove(&q.group);
                self.counts.remove(&q);
            }
        }
        self.exchanges.retain(|k, _| !inside(k));
        self.bindings.retain(|b| !inside(&b.exchange) && !inside(&b.destination));
        self.policies.retain(|k, _| !inside(k));
        self.permissions.remove(name);
        MetaReply::Ok
    }

    fn set_permission(&mut self, p: &Permission) -> MetaReply {
        if !self.users.contains_key(&p.user) {
            return MetaReply::Invalid(format!("no user '{}'", p.user));
        }
        if !self.vhosts.contains_key(&p.vhost) {
            return MetaReply::Invalid(format!("no vhost '{}'", p.vhost));
        }
        if let Err(why) = p.validate() {
            return MetaReply::Invalid(why);
        }
        match self.permissions.entry(p.vhost.clone()).or_default().insert(p.user.clone(), p.clone()) {
            None => MetaReply::Created,
            Some(_) => MetaReply::Ok,
        }
    }

    fn clear_permission(&mut self, vhost: &str, user: &str) -> MetaReply {
        match self.permissions.get_mut(vhost).and_then(|users| users.remove(user)) {
            Some(_) => MetaReply::Ok,
            None => MetaReply::NotFound,
        }
    }

    /// A queue, exchange or policy can only be made in a vhost that exists
    /// (it may have been deleted since the request was checked).
    fn vhost_exists(&self, key: &str) -> Result<(), MetaReply> {
        let vhost = names::vhost_of(key);
        if self.vhosts.contains_key(vhost) {
            Ok(())
        } else {
            Err(MetaReply::Invalid(format!("vhost '{vhost}' not found")))
        }
    }

    /// The user's permission in `vhost`, if it has access there.
    pub fn permission(&self, user: &str, vhost: &str) -> Option<&Permission> {
        self.permissions.get(vhost)?.get(user)
    }

    fn node_list(&self) -> Vec<(NodeId, String)> {
        self.nodes.values().map(|n| (n.id, n.name.clone())).collect()
    }

    /// Replicas per node, over every queue.
    fn replica_load(&self) -> BTreeMap<NodeId, usize> {
        let mut load: BTreeMap<NodeId, usize> = self.nodes.keys().map(|id| (*id, 0)).collect();
        load.extend(self.counts.replicas.iter().map(|(id, n)| (*id, *n)));
        load
    }

    /// The node that is first replica (master by placement) of the fewest queues.
    fn least_masters(&self) -> Option<NodeId> {
        self.nodes
            .keys()
            .map(|id| (*id, self.counts.masters.get(id).copied().unwrap_or(0)))
            .min_by_key(|(id, n)| (*n, *id))
            .map(|(id, _)| id)
    }

    /// Recompute every policy-placed queue's replicas after a policy or the
    /// set of nodes changed. Deterministic: every node computes the same.
    fn replace_all(&mut self) {
        let nodes = self.node_list();
        let names: Vec<String> = self.queues.values().filter(|q| q.by_policy).map(|q| q.name.clone()).collect();
        // Kept up to date as queues move, so each placement sees the ones
        // before it (counting afresh per queue made a policy change cost
        // the square of the number of queues).
        let mut load = self.replica_load();
        for name in names {
            let q = &self.queues[&name];
            let (mode, pol) = self.mirroring(&name, Kind { args: &q.args, exclusive: q.exclusive_owner.is_some() });
            let q = self.queues.get_mut(&name).expect("listed above");
            let replicas = policy::placement(mode.as_ref(), &q.replicas, &nodes, &load);
            for r in &q.replicas {
                if let Some(n) = load.get_mut(r) {
                    *n -= 1;
                }
            }
            for r in &replicas {
                *load.entry(*r).or_default() += 1;
            }
            q.replicas = replicas;
            q.forget_a_gone_founder();
            q.policy = pol.map(|p| p.name);
        }
        self.reindex();
    }

    /// A declared or built-in exchange.
    pub fn exchange(&self, name: &str) -> Option<ExchangeMeta> {
        self.exchanges.get(name).cloned().or_else(|| builtin(name))
    }

    /// Where a message `ex` cannot route goes (a key): its
    /// `alternate-exchange` argument, else its effective policy's.
    pub fn alternate_of(&self, ex: &ExchangeMeta) -> Option<String> {
        ex.alternate.clone().or_else(|| {
            let p = policy::effective_for_exchange(&self.policies, &ex.name)?;
            let def: serde_json::Value = serde_json::from_str(&p.definition).ok()?;
            let alt = def.get("alternate-exchange")?.as_str()?;
            Some(names::key(names::vhost_of(&ex.name), alt))
        })
    }

    /// A node that restarts is asked about thousands of groups before it
    /// started their replicas: an index, not a walk over every queue.
    pub fn queue_by_group(&self, group: GroupId) -> Option<&QueueMeta> {
        self.by_group.get(&group).and_then(|name| self.queues.get(name)).filter(|q| q.group == group)
    }

    /// Rebuild what is derived from the queues, after they were read back.
    pub fn reindex(&mut self) {
        self.by_group = self.queues.values().map(|q| (q.group, q.name.clone())).collect();
        self.counts = Counts::default();
        for q in self.queues.values() {
            self.counts.add(q);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::METADATA_GROUP;

    fn decl(name: &str, replicas: Vec<NodeId>, durable: bool) -> MetaCmd {
        MetaCmd::DeclareQueue {
            name: name.into(),
            replicas,
            durable,
            declared_on: 1,
            locator: None,
            exclusive_owner: None,
            auto_delete: false,
            args: Box::default(),
        }
    }

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
        let a = s.apply(&decl("a", vec![1, 2], true));
        let b = s.apply(&decl("b", vec![3], true));
        let (MetaReply::NewQueue(a), MetaReply::NewQueue(b)) = (a, b) else { panic!("declare failed") };
        assert_ne!(a.group, b.group);
        assert_ne!(a.group, METADATA_GROUP);
        let again = s.apply(&decl("a", vec![3], false));
        assert_eq!(again, MetaReply::Queue(a));
    }

    #[test]
    fn declare_rejects_unknown_or_duplicate_replicas() {
        let mut s = with_nodes(2);
        assert!(matches!(s.apply(&decl("a", vec![1, 9], true)), MetaReply::Invalid(_)));
        assert!(matches!(s.apply(&decl("a", vec![1, 1], true)), MetaReply::Invalid(_)));
        // Empty replicas: placed by policy (none here: client-local, one replica).
        assert!(matches!(s.apply(&decl("b", vec![], true)), MetaReply::NewQueue(q) if q.replicas == vec![1]));
        assert_eq!(s.queues.len(), 1);
    }

    #[test]
    fn exchanges_bindings_and_queue_deletion() {
        use crate::metadata::routing::{Args, ExchangeKind};
        let mut s = with_nodes(1);
        s.apply(&decl("q", vec![1], true));
        let ex = |n: &str, k| ExchangeMeta {
            name: n.into(),
            kind: k,
            durable: true,
            auto_delete: false,
            internal: false,
            alternate: None,
            args: Default::default(),
        };
        assert_eq!(s.apply(&MetaCmd::DeclareExchange(ex("logs", ExchangeKind::Topic))), MetaReply::Ok);
        assert_eq!(s.apply(&MetaCmd::DeclareExchange(ex("logs", ExchangeKind::Topic))), MetaReply::Ok);
        assert!(matches!(s.apply(&MetaCmd::DeclareExchange(ex("logs", ExchangeKind::Fanout))), MetaReply::Conflict(_)));
        assert!(matches!(
            s.apply(&MetaCmd::DeclareExchange(ex("amq.mine", ExchangeKind::Fanout))),
            MetaReply::Refused(_)
        ));
        let b = |e: &str, q: &str| Binding {
            exchange: e.into(),
            destination: q.into(),
            to_exchange: false,
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
        let to_ex = Binding { to_exchange: true, ..b("amq.topic", "logs") };
        assert_eq!(s.apply(&MetaCmd::Bind(to_ex.clone())), MetaReply::Ok);
        assert_eq!(
            s.apply(&MetaCmd::Bind(Binding { to_exchange: true, ..b("amq.topic", "nope") })),
            MetaReply::NotFound
        );
        s.apply(&MetaCmd::DeleteQueue { name: "q".into() });
        assert_eq!(s.bindings, BTreeSet::from([to_ex]), "deleting a queue removes its bindings, and only those");
        assert_eq!(s.apply(&MetaCmd::DeleteExchange { name: "logs".into(), if_unused: true }), MetaReply::Ok);
        assert!(s.bindings.is_empty(), "deleting an exchange removes the bindings to it");
        assert!(matches!(
            s.apply(&MetaCmd::DeleteExchange { name: "amq.topic".into(), if_unused: false }),
            MetaReply::Refused(_)
        ));
    }

    #[test]
    fn delete_then_redeclare_gets_a_new_group() {
        let mut s = with_nodes(1);
        let MetaReply::NewQueue(a) = s.apply(&decl("a", vec![1], true)) else { panic!() };
        assert_eq!(s.apply(&MetaCmd::DeleteQueue { name: "a".into() }), MetaReply::Ok);
        assert_eq!(s.apply(&MetaCmd::DeleteQueue { name: "a".into() }), MetaReply::NotFound);
        let MetaReply::NewQueue(a2) = s.apply(&decl("a", vec![1], true)) else { panic!() };
        assert_ne!(a.group, a2.group, "a re-declared queue must not reuse the old group's log");
    }
}

#[cfg(test)]
mod policy_tests {
    use super::*;
    use crate::metadata::policy::{ApplyTo, Policy};

    fn state(n: u64) -> MetaState {
        let mut s = MetaState::default();
        for id in 1..=n {
            s.apply(&MetaCmd::RegisterNode(NodeInfo { id, name: format!("mirrorq@{id}"), raft_addr: String::new() }));
        }
        s
    }

    fn set(s: &mut MetaState, name: &str, pattern: &str, def: &str) -> MetaReply {
        s.apply(&MetaCmd::SetPolicy(Policy {
            name: name.into(),
            pattern: pattern.into(),
            apply_to: ApplyTo::Queues,
            priority: 0,
            definition: def.into(),
        }))
    }

    fn declare(s: &mut MetaState, name: &str, on: NodeId) -> QueueMeta {
        match s.apply(&MetaCmd::DeclareQueue {
            name: name.into(),
            replicas: vec![],
            durable: true,
            declared_on: on,
            locator: None,
            exclusive_owner: None,
            auto_delete: false,
            args: Box::default(),
        }) {
            MetaReply::NewQueue(q) => q,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn policy_changes_regrow_and_shrink_policy_placed_queues() {
        let mut s = state(3);
        assert_eq!(set(&mut s, "ha", "^ha", r#"{"ha-mode":"exactly","ha-params":2}"#), MetaReply::Created);
        let q = declare(&mut s, "ha.q", 2);
        assert_eq!(q.replicas.len(), 2);
        assert_eq!(q.policy.as_deref(), Some("ha"));
        let plain = declare(&mut s, "plain", 2);
        assert_eq!(plain.replicas, vec![2], "no policy: one replica on the declaring node");
        set(&mut s, "ha", "^ha", r#"{"ha-mode":"all"}"#);
        assert_eq!(s.queues["ha.q"].replicas.len(), 3);
        assert_eq!(s.queues["ha.q"].replicas[..2], q.replicas[..], "seniority kept");
        set(&mut s, "ha", "^ha", r#"{"ha-mode":"exactly","ha-params":1}"#);
        assert_eq!(s.queues["ha.q"].replicas, vec![q.replicas[0]]);
        assert_eq!(s.queues["plain"].replicas, vec![2], "untouched");
        assert_eq!(s.apply(&MetaCmd::ClearPolicy { name: "ha".into() }), MetaReply::Ok);
        assert_eq!(s.queues["ha.q"].policy, None);
        assert_eq!(s.apply(&MetaCmd::ClearPolicy { name: "ha".into() }), MetaReply::NotFound);
    }

    #[test]
    fn mirrors_a_policy_change_adds_are_spread_over_the_nodes() {
        let mut s = state(4);
        set(&mut s, "ha", "^ha", r#"{"ha-mode":"exactly","ha-params":1}"#);
        for i in 0..12 {
            declare(&mut s, &format!("ha.{i}"), 1);
        }
        assert_eq!(s.replica_load(), BTreeMap::from([(1, 3), (2, 3), (3, 3), (4, 3)]));
        let masters: Vec<NodeId> = s.queues.values().map(|q| q.replicas[0]).collect();
        set(&mut s, "ha", "^ha", r#"{"ha-mode":"exactly","ha-params":2}"#);
        let load = s.replica_load();
        assert_eq!(load, BTreeMap::from([(1, 6), (2, 6), (3, 6), (4, 6)]), "each placement sees the ones before it");
        assert_eq!(s.queues.values().map(|q| q.replicas[0]).collect::<Vec<_>>(), masters, "masters stay");
    }

    #[test]
    fn invalid_policies_are_not_stored() {
        let mut s = state(1);
        assert!(matches!(set(&mut s, "p", "(", r#"{"ha-mode":"all"}"#), MetaReply::Invalid(_)));
        assert!(matches!(set(&mut s, "p", "^x", r#"{"ha-mode":"most"}"#), MetaReply::Invalid(_)));
        assert!(s.policies.is_empty());
    }

    #[test]
    fn all_mode_follows_nodes_that_join() {
        let mut s = state(2);
        set(&mut s, "all", ".*", r#"{"ha-mode":"all"}"#);
        declare(&mut s, "q", 1);
        assert_eq!(s.queues["q"].replicas.len(), 2);
        s.apply(&MetaCmd::RegisterNode(NodeInfo { id: 3, name: "mirrorq@3".into(), raft_addr: String::new() }));
        assert_eq!(s.queues["q"].replicas.len(), 3);
        assert_eq!(s.queues["q"].initial.len(), 2, "founding members stay while the founder does");
        let founder = s.queues["q"].initial[0];
        assert_eq!(s.apply(&MetaCmd::ForgetNode { id: 3 }), MetaReply::Ok);
        assert_eq!(s.queues["q"].initial.len(), 2, "a mirror left, the founder stays");
        set(&mut s, "all", ".*", r#"{"ha-mode":"exactly","ha-params":1}"#);
        let q = &s.queues["q"];
        assert_eq!((q.replicas.len(), q.initial.len()), (1, 2));
        let other = if founder == 1 { 2 } else { 1 };
        set(&mut s, "all", ".*", &format!(r#"{{"ha-mode":"nodes","ha-params":["mirrorq@{other}"]}}"#));
        assert!(!s.queues["q"].replicas.contains(&founder));
        assert!(s.queues["q"].initial.is_empty(), "the founder left: it never founds again");
    }

    #[test]
    fn mirrored_masters_spread_over_nodes() {
        let mut s = state(3);
        set(&mut s, "all", "^m", r#"{"ha-mode":"all"}"#);
        for i in 0..30 {
            declare(&mut s, &format!("m{i}"), 1);
        }
        let mut masters: BTreeMap<NodeId, usize> = BTreeMap::new();
        for q in s.queues.values() {
            *masters.entry(q.replicas[0]).or_default() += 1;
        }
        assert_eq!(masters.values().copied().collect::<Vec<_>>(), vec![10, 10, 10]);
    }

    /// What placement counts is kept with each change: equal to counting
    /// afresh after declares, deletes, policy changes, a node joining and
    /// one forgotten, and a vhost deleted.
    #[test]
    fn derived_counts_match_a_recount_after_every_kind_of_change() {
        let recounted = |s: &MetaState| {
            let mut again = s.clone();
            again.reindex();
            again
        };
        let mut s = state(3);
        set(&mut s, "ex", "^ex", r#"{"ha-mode":"exactly","ha-params":2}"#);
        set(&mut s, "all", "^all", r#"{"ha-mode":"all"}"#);
        for i in 0..9 {
            declare(&mut s, &format!("ex{i}"), 1 + i % 3);
            declare(&mut s, &format!("all{i}"), 1);
            declare(&mut s, &format!("plain{i}"), 2);
        }
        assert_eq!(s, recounted(&s), "after declares");
        s.apply(&MetaCmd::DeleteQueue { name: "all3".into() });
        s.apply(&MetaCmd::DeleteQueue { name: "ex4".into() });
        assert_eq!(s, recounted(&s), "after deletes");
        set(&mut s, "ex", "^ex", r#"{"ha-mode":"exactly","ha-params":3}"#);
        assert_eq!(s, recounted(&s), "after a policy change");
        s.apply(&MetaCmd::RegisterNode(NodeInfo { id: 4, name: "mirrorq@4".into(), raft_addr: String::new() }));
        assert_eq!(s, recounted(&s), "after a node joined");
        for i in 0..9 {
            s.apply(&MetaCmd::DeleteQueue { name: format!("plain{i}") });
        }
        assert_eq!(s.apply(&MetaCmd::ForgetNode { id: 2 }), MetaReply::Ok);
        assert_eq!(s, recounted(&s), "after a node was forgotten");
        assert_eq!(s.least_masters(), recounted(&s).least_masters());
        s.apply(&MetaCmd::DeleteVhost { name: "/".into() });
        assert!(s.queues.is_empty());
        assert_eq!(s, recounted(&s), "after the vhost went");
        assert_eq!(s.counts, Counts::default());
    }
}
