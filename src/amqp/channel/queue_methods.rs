//! `queue.*`: declare (with its arguments and exclusive queues), bind,
//! unbind, purge, delete.

use amq_protocol::protocol::{queue, AMQPClass};
use amq_protocol::types::AMQPValue;

use crate::amqp::channel::rand_id;
use crate::amqp::channel::Channel;
use crate::amqp::reply::{
    hard, node_soft, soft, Hard, Soft, ACCESS_REFUSED, COMMAND_INVALID, PRECONDITION_FAILED, RESOURCE_LOCKED,
};
use crate::amqp::writer::ss;
use crate::api::DeclareOpts;
use crate::error::NodeError;
use crate::message::to_args;
use crate::metadata::names;
use crate::metadata::{Access, QueueArgs};

impl Channel {
    pub(in crate::amqp) async fn queue_method(&mut self, m: queue::AMQPMethod) -> Result<bool, Result<Soft, Hard>> {
        use queue::AMQPMethod as Q;
        match m {
            Q::Declare(d) => self.queue_declare(d).await,
            Q::Purge(p) => self.queue_purge(p).await,
            Q::Delete(d) => self.queue_delete(d).await,
            Q::Bind(b) => self.queue_bind(b).await,
            Q::Unbind(b) => self.queue_unbind(b).await,
            other => Err(Err(hard(COMMAND_INVALID, format!("queue.{other:?} is not a client method")))),
        }
    }

    async fn queue_declare(&mut self, d: queue::Declare) -> Result<bool, Result<Soft, Hard>> {
        let mut name = d.queue.as_str().to_string();
        if name.is_empty() {
            name = format!("amq.gen-{:016x}", rand_id());
        }
        if let Err(why) = names::check("queue", &name) {
            return Err(Ok(soft(PRECONDITION_FAILED, format!("PRECONDITION_FAILED - {why}"), 50, 10)));
        }
        if !d.passive {
            self.may(Access::Configure, "queue", &name, 50, 10)?;
        }
        let bare = name;
        let name = self.key(&bare);
        if name.starts_with("amq.") && !d.queue.as_str().is_empty() && !d.passive {
            return Err(Ok(soft(
                ACCESS_REFUSED,
                format!("ACCESS_REFUSED - queue name '{name}' contains reserved prefix 'amq.*'"),
                50,
                10,
            )));
        }
        if d.passive && bare == crate::amqp::reply_to::PSEUDO_QUEUE {
            // As RabbitMQ: the direct reply-to pseudo-queue is always there.
            if !d.nowait {
                let ok = queue::DeclareOk { queue: ss(&bare), message_count: 0, consumer_count: 0 };
                self.reply(AMQPClass::Queue(queue::AMQPMethod::DeclareOk(ok))).await;
            }
            return Ok(true);
        }
        let mut existing = self.node.find_queue(&name).await.ok();
        if existing.as_ref().is_some_and(|q| q.exclusive_owner.is_some_and(|o| o != self.conn_id)) {
            // Its connection may have closed a moment ago through another
            // node, its queue deleted there: catch up before refusing.
            self.node.meta_barrier().await;
            existing = self.node.find_queue(&name).await.ok();
        }
        if d.passive && existing.is_none() {
            return Err(self.not_found("queue", &bare, 50, 10));
        }
        let args = if d.passive {
            None
        } else {
            let parsed = QueueArgs::parse(&to_args(&d.arguments))
                .map_err(|why| Ok(soft(PRECONDITION_FAILED, format!("PRECONDITION_FAILED - {why}"), 50, 10)))?;
            Some(parsed)
        };
        let (q, created) = match existing {
            Some(q) => {
                if !d.passive {
                    let flags = [("durable", d.durable, q.durable), ("auto_delete", d.auto_delete, q.auto_delete)];
                    inequivalent_flags(&flags, "queue", &bare, &self.vhost, 50, 10)?;
                }
                self.check_equivalent(&q, args.as_ref(), &bare)?;
                (q, false)
            }
            None => self.declare_new(&d, &name, args).await?,
        };
        self.check_exclusive(&q, 50, 10)?;
        // A queue this declare created has a master serving it (the
        // declare waited for one), no message and no consumer yet.
        // Otherwise: the master's count as applied, read without an
        // entry in its log (RabbitMQ's count is no more exact); a
        // declare, passive or not, counts as a use (x-expires).
        let ready = if created {
            0
        } else {
            self.node.view_at_master(&name, true).await.map_err(|e| Ok(node_soft(e, 50, 10)))?.ready
        };
        if !d.nowait {
            let consumers = if created { 0 } else { self.node.consumers_of(&name).await.len() };
            self.reply(AMQPClass::Queue(queue::AMQPMethod::DeclareOk(queue::DeclareOk {
                queue: ss(&bare),
                message_count: ready.min(u32::MAX as u64) as u32,
                consumer_count: consumers as u32,
            })))
            .await;
        }
        Ok(true)
    }

    /// A non-passive declare of an existing queue must ask for its arguments.
    fn check_equivalent(
        &self,
        q: &crate::metadata::QueueMeta,
        args: Option<&QueueArgs>,
        bare: &str,
    ) -> Result<(), Result<Soft, Hard>> {
        if let Some(arg) = args.and_then(|a| a.inequivalent(&q.args)) {
            return Err(Ok(soft(
                PRECONDITION_FAILED,
                format!(
                    "PRECONDITION_FAILED - inequivalent arg '{arg}' for queue '{bare}' in vhost '{}': \
                     received {} but current is {}",
                    self.vhost,
                    args.map(|a| a.to_json()).unwrap_or_default(),
                    q.args.to_json()
                ),
                50,
                10,
            )));
        }
        Ok(())
    }

    /// `queue.declare` of a queue not there yet: `(queue, created)`.
    async fn declare_new(
        &mut self,
        d: &queue::Declare,
        name: &str,
        args: Option<QueueArgs>,
    ) -> Result<(crate::metadata::QueueMeta, bool), Result<Soft, Hard>> {
        // RabbitMQ 4 names it `x-queue-leader-locator` (`balanced` spreads
        // masters as `min-masters` does; 3.10-3.12 also took `random` and
        // `least-leaders`); the older name still works, and wins.
        let mut min_masters = None;
        for (key, spread) in [
            ("x-queue-leader-locator", &["balanced", "random", "least-leaders"][..]),
            ("x-queue-master-locator", &["min-masters"][..]),
        ] {
            match d.arguments.inner().get(&ss(key)) {
                None => {}
                Some(AMQPValue::LongString(v)) if v.as_bytes() == b"client-local" => min_masters = Some(false),
                Some(AMQPValue::LongString(v)) if spread.iter().any(|s| s.as_bytes() == v.as_bytes()) => {
                    min_masters = Some(true)
                }
                Some(other) => {
                    return Err(Ok(soft(
                        PRECONDITION_FAILED,
                        format!("PRECONDITION_FAILED - invalid {key} {other:?}"),
                        50,
                        10,
                    )))
                }
            }
        }
        let opts = DeclareOpts {
            min_masters,
            exclusive_owner: d.exclusive.then_some(self.conn_id),
            auto_delete: d.auto_delete,
            transient: !d.durable,
            args: args.unwrap_or_default(),
        };
        // Placed by the effective policy (none: one replica, here).
        let (q, created) =
            self.node.declare_queue_with(name, Vec::new(), opts).await.map_err(|e| Ok(node_soft(e, 50, 10)))?;
        if created && d.exclusive {
            self.exclusive.lock().expect("poisoned").insert(name.to_string());
        }
        Ok((q, created))
    }

    async fn queue_purge(&mut self, p: queue::Purge) -> Result<bool, Result<Soft, Hard>> {
        self.may(Access::Read, "queue", p.queue.as_str(), 50, 30)?;
        let name = self.key(p.queue.as_str());
        self.locked_check(&name, 50, 30).await?;
        let n = self.node.purge(&name).await.map_err(|e| Ok(node_soft(e, 50, 30)))?;
        if !p.nowait {
            self.reply(AMQPClass::Queue(queue::AMQPMethod::PurgeOk(queue::PurgeOk { message_count: n as u32 }))).await;
        }
        Ok(true)
    }

    async fn queue_delete(&mut self, d: queue::Delete) -> Result<bool, Result<Soft, Hard>> {
        let bare = d.queue.as_str();
        self.may(Access::Configure, "queue", bare, 50, 40)?;
        let key = self.key(bare);
        let name = key.as_str();
        self.locked_check(name, 50, 40).await?;
        // Deleting a queue that is not there is done already, as in
        // RabbitMQ: delete-ok with a count of 0, not a 404.
        let (ready, unacked) = match self.node.status(name).await {
            Ok(counts) => counts,
            Err(NodeError::NoSuchQueue(_)) => return self.queue_deleted(d.nowait, 0).await,
            Err(e) => return Err(Ok(node_soft(e, 50, 40))),
        };
        if d.if_unused && !self.node.consumers_of(name).await.is_empty() {
            return Err(Ok(soft(
                PRECONDITION_FAILED,
                format!("PRECONDITION_FAILED - queue '{bare}' in vhost '{}' in use", self.vhost),
                50,
                40,
            )));
        }
        if d.if_empty && ready + unacked > 0 {
            return Err(Ok(soft(
                PRECONDITION_FAILED,
                format!("PRECONDITION_FAILED - queue '{bare}' in vhost '{}' not empty", self.vhost),
                50,
                40,
            )));
        }
        match self.node.delete_queue(name).await {
            Ok(()) | Err(NodeError::NoSuchQueue(_)) => {}
            Err(e) => return Err(Ok(node_soft(e, 50, 40))),
        }
        self.queue_deleted(d.nowait, ready).await
    }

    async fn queue_deleted(&mut self, nowait: bool, ready: u64) -> Result<bool, Result<Soft, Hard>> {
        if !nowait {
            let ok = queue::DeleteOk { message_count: u32::try_from(ready).unwrap_or(u32::MAX) };
            self.reply(AMQPClass::Queue(queue::AMQPMethod::DeleteOk(ok))).await;
        }
        Ok(true)
    }

    async fn queue_bind(&mut self, b: queue::Bind) -> Result<bool, Result<Soft, Hard>> {
        let binding = self.binding_of(&b.exchange, &b.queue, false, &b.routing_key, &b.arguments);
        self.change_binding(binding, true, (50, 20)).await?;
        if !b.nowait {
            self.reply(AMQPClass::Queue(queue::AMQPMethod::BindOk(queue::BindOk {}))).await;
        }
        Ok(true)
    }

    async fn queue_unbind(&mut self, b: queue::Unbind) -> Result<bool, Result<Soft, Hard>> {
        let binding = self.binding_of(&b.exchange, &b.queue, false, &b.routing_key, &b.arguments);
        self.change_binding(binding, false, (50, 50)).await?;
        self.reply(AMQPClass::Queue(queue::AMQPMethod::UnbindOk(queue::UnbindOk {}))).await;
        Ok(true)
    }

    /// Another connection's exclusive queue: 405 RESOURCE_LOCKED.
    pub(in crate::amqp) fn check_exclusive(
        &self,
        q: &crate::metadata::QueueMeta,
        class: u16,
        method: u16,
    ) -> Result<(), Result<Soft, Hard>> {
        match q.exclusive_owner {
            Some(owner) if owner != self.conn_id => Err(Ok(soft(
                RESOURCE_LOCKED,
                format!(
                    "RESOURCE_LOCKED - cannot obtain exclusive access to locked queue '{}' in vhost '{}'",
                    names::name_of(&q.name),
                    self.vhost
                ),
                class,
                method,
            ))),
            _ => Ok(()),
        }
    }

    pub(in crate::amqp) async fn locked_check(
        &self,
        queue: &str,
        class: u16,
        method: u16,
    ) -> Result<(), Result<Soft, Hard>> {
        match self.node.find_queue(queue).await {
            Ok(q) => self.check_exclusive(&q, class, method),
            Err(_) => Ok(()),
        }
    }
}

/// A declare of something that exists with other flags is refused, as
/// RabbitMQ refuses it: `(flag, asked, current)`.
pub(in crate::amqp) fn inequivalent_flags(
    flags: &[(&str, bool, bool)],
    kind: &str,
    bare: &str,
    vhost: &str,
    class: u16,
    method: u16,
) -> Result<(), Result<Soft, Hard>> {
    match flags.iter().find(|(_, asked, current)| asked != current) {
        Some((flag, asked, current)) => Err(Ok(soft(
            PRECONDITION_FAILED,
            format!(
                "PRECONDITION_FAILED - inequivalent arg '{flag}' for {kind} '{bare}' in vhost '{vhost}': \
                 received '{asked}' but current is '{current}'"
            ),
            class,
            method,
        ))),
        None => Ok(()),
    }
}
