//! Queue limits on the master: the TTL, max length and dead-lettering a
//! queue's arguments and policy give it, the timer that expires messages
//! when nothing else happens on the queue, and the republishing of
//! dead-lettered messages to the dead-letter exchange.
//!
//! The queue's state machine decides which messages expire, overflow or are
//! rejected (deterministically, from the master's stamp in each entry); the
//! master's proposer hands their bodies here. Dead-lettering is at most
//! once by default, as for RabbitMQ's classic mirrored queues: a master
//! that fails between removing a message and republishing it loses that
//! dead letter. With `dead-letter-strategy: at-least-once` (RabbitMQ's
//! quorum queues' strategy) the state machine holds each dead letter in
//! the queue instead (`DeadLettering::AtLeastOnce`), and the master's
//! timer task republishes what is held, waits for every target queue's
//! confirm and only then settles it; a new master picks up what is held.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use tokio::sync::oneshot;

use crate::error::NodeError;
use crate::metadata::{names, policy, MetaState, QueueArgs, QueueMeta};
use crate::node::{Inner, Node, QueueGroup};
use crate::queue::proposer::{now_ms, DeadLetterSink};
use crate::queue::types::{DeadLettering, DeathReason, Limits, Overflow};
use crate::queue::{Message, QueueCmd};

/// The queue's arguments combined with its effective policy.
pub(crate) fn effective_args(state: &MetaState, q: &QueueMeta) -> QueueArgs {
    let def = policy::effective(&state.policies, &q.name).map(|p| p.definition.as_str());
    q.args.with_policy(def)
}

/// What the master stamps on the queue's entries.
pub(in crate::node) fn limits_of(state: &MetaState, q: &QueueMeta) -> Limits {
    let a = effective_args(state, q);
    let def = policy::effective(&state.policies, &q.name).map(|p| p.definition.as_str());
    Limits {
        ttl_ms: a.message_ttl,
        max_len: a.max_length,
        overflow: match a.overflow.as_deref() {
            Some(crate::metadata::queue_args::OVERFLOW_REJECT_PUBLISH) => Overflow::RejectPublish,
            _ => Overflow::DropHead,
        },
        dead_letter: match a.dead_letter_exchange {
            None => DeadLettering::Off,
            Some(_) if a.at_least_once_dead_lettering(def) => DeadLettering::AtLeastOnce,
            Some(_) => DeadLettering::AtMostOnce,
        },
        // 0 serves every message as priority 0: a plain queue.
        max_priority: a.max_priority.filter(|p| *p > 0),
        delivery_limit: q.args.delivery_limit(def),
    }
}

/// The proposer's sink for a queue's dead letters. Holds the node weakly:
/// the node owns the group that owns the proposer. One task republishes the
/// queue's dead letters slot by slot, in the order the entries were
/// proposed (a task per batch raced, and dead letters reached their queue
/// out of order); it ends with the sink. The task and its channel start
/// with the first slot asked for (a master's first entry stamped with the
/// queue's limits): a queue without limits never asks, and a waiting task
/// per replica was 3-4 KiB of it.
pub(in crate::node) fn sink(inner: Weak<Inner>, queue: String) -> DeadLetterSink {
    type Slot = oneshot::Receiver<Vec<(Message, DeathReason)>>;
    let tx: std::sync::OnceLock<tokio::sync::mpsc::UnboundedSender<Slot>> = std::sync::OnceLock::new();
    Arc::new(move || {
        let tx = tx.get_or_init(|| {
            let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Slot>();
            let (inner, queue) = (inner.clone(), queue.clone());
            tokio::spawn(async move {
                while let Some(slot) = rx.recv().await {
                    let Ok(msgs) = slot.await else { continue };
                    let Some(inner) = inner.upgrade() else { return };
                    // Boxed: held only while it runs, not by the waiting task.
                    Box::pin(Node { inner }.dead_letter(&queue, msgs)).await;
                }
            });
            tx
        });
        let (slot, filled) = oneshot::channel();
        let _ = tx.send(filled);
        slot
    })
}

/// Held dead letters that could not go are tried again after this,
/// doubling up to [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(200);
const RETRY_MAX: Duration = Duration::from_secs(10);

/// Why held dead letters stay held for now (tried again later).
#[derive(Debug, thiserror::Error)]
enum NotDeadLettered {
    #[error("dead-letter exchange '{0}' does not exist")]
    NoExchange(String),
    #[error("dead-letter exchange '{0}' routes them to no queue")]
    NoRoute(String),
    #[error("the queue is not in this node's metadata")]
    NoQueue,
    #[error("the queue's master holds none of their bodies")]
    NoBodies,
    #[error(transparent)]
    Node(#[from] NodeError),
}

impl Node {
    /// Publish dead-lettered messages of `queue` to its dead-letter
    /// exchange, with RabbitMQ's `x-death` history, at most once.
    async fn dead_letter(&self, queue: &str, msgs: Vec<(Message, DeathReason)>) {
        let (routed, unrouted) = self.route_dead_letters(queue, msgs).await;
        if let Some((_, e)) = unrouted.first() {
            tracing::warn!(queue, error = %e, dropped = unrouted.len(), "dead letters dropped");
        }
        for (target, ms) in routed {
            if let Err(e) = self.publish(&target, ms.into_iter().map(|(_, m)| m).collect()).await {
                tracing::warn!(queue = %target, error = %e, "dead letters not stored");
            }
        }
    }

    /// Dead-letter what the master's replica of `g` holds for it, a batch
    /// at a time from tag `from` on (so a batch that cannot go keeps none
    /// behind it waiting): each is settled once every queue the dead-letter
    /// exchange routes it to has it confirmed. `sent` remembers, per held
    /// tag, the targets that confirmed it already, so a target that
    /// refuses does not have the others sent it again at every try.
    /// Answers the tag to go on from, and why some stay held.
    async fn dead_letter_held(
        &self,
        g: &QueueGroup,
        from: u64,
        sent: &mut HashMap<u64, BTreeSet<String>>,
    ) -> (u64, Result<(), NotDeadLettered>) {
        const BATCH: usize = 256;
        let held = match g.sm.with_mut(|m, space| m.dead_letters(space, from, BATCH)).await {
            Ok(held) => held,
            Err(e) => return (from, Err(NodeError::Unavailable(e.to_string()).into())),
        };
        let next = match held.last() {
            Some((tag, _, _)) if held.len() == BATCH => tag + 1,
            _ => 0,
        };
        if held.is_empty() {
            return (0, if from == 0 { Err(NotDeadLettered::NoBodies) } else { Ok(()) });
        }
        let tags: Vec<(DeathReason, u64)> = held.iter().map(|(tag, reason, _)| (*reason, *tag)).collect();
        let msgs = held.into_iter().map(|(_, reason, m)| (m, reason)).collect();
        let (routed, unrouted) = self.route_dead_letters(&g.meta.name, msgs).await;
        // A queue that no longer names an exchange drops what it held.
        let dropped = |e: &NotDeadLettered| matches!(e, NotDeadLettered::NoExchange(x) if x.is_empty());
        let mut kept: BTreeSet<usize> = unrouted.iter().filter(|(_, e)| !dropped(e)).map(|(i, _)| *i).collect();
        let mut why = unrouted.into_iter().find(|(_, e)| !dropped(e)).map(|(_, e)| e);
        for (target, ms) in routed {
            let (idx, ms): (Vec<usize>, Vec<Message>) =
                ms.into_iter().filter(|(i, _)| !sent.get(&tags[*i].1).is_some_and(|t| t.contains(&target))).unzip();
            if ms.is_empty() {
                continue;
            }
            match self.publish(&target, ms).await {
                Ok(()) => {
                    for i in idx {
                        sent.entry(tags[i].1).or_default().insert(target.clone());
                    }
                }
                Err(e) => {
                    kept.extend(idx);
                    why.get_or_insert(e.into());
                }
            }
        }
        // By owner: one per reason.
        let mut settle: BTreeMap<u64, Vec<u64>> = BTreeMap::new();
        for (i, (reason, tag)) in tags.into_iter().enumerate() {
            if !kept.contains(&i) {
                settle.entry(reason.owner()).or_default().push(tag);
            }
        }
        if !settle.is_empty() {
            let cmds = settle.iter().map(|(owner, tags)| QueueCmd::AckOf { owner: *owner, tags: tags.clone() });
            if let Err(e) = g.proposer.submit(cmds.collect()).await {
                return (from, Err(e.into()));
            }
            for tag in settle.values().flatten() {
                sent.remove(tag);
            }
        }
        (next, why.map_or(Ok(()), Err))
    }

    /// Where `queue`'s dead letters go, each with its `x-death` history:
    /// per target queue, in order, with each message's index in `msgs`;
    /// and the indexes of those routed nowhere, with why
    /// (`NoExchange("")`: the queue has no dead-letter exchange any more).
    /// A message dead-lettered round a cycle with no rejection on it is
    /// routed to none of the cycle's queues (it would circle for ever), as
    /// in RabbitMQ, and that counts as done.
    async fn route_dead_letters(
        &self,
        queue: &str,
        msgs: Vec<(Message, DeathReason)>,
    ) -> (Vec<(String, Vec<(usize, Message)>)>, Vec<(usize, NotDeadLettered)>) {
        let state = self.metadata();
        let mut routed: Vec<(String, Vec<(usize, Message)>)> = Vec::new();
        let mut unrouted = Vec::new();
        let Some(q) = state.queues.get(queue) else {
            unrouted.extend((0..msgs.len()).map(|i| (i, NotDeadLettered::NoQueue)));
            return (routed, unrouted);
        };
        let args = effective_args(&state, q);
        let Some(dlx) = args.dead_letter_exchange else {
            unrouted.extend((0..msgs.len()).map(|i| (i, NotDeadLettered::NoExchange(String::new()))));
            return (routed, unrouted);
        };
        // Messages carry names as clients see them; the exchange is in the queue's vhost.
        let (vhost, bare) = names::split(queue);
        let dlx_key = names::key(vhost, &dlx);
        for (i, (msg, reason)) in msgs.into_iter().enumerate() {
            let key = args.dead_letter_routing_key.clone().unwrap_or_else(|| msg.routing_key.clone());
            let (dead, rejected_on_the_way, queues_seen) = with_death(msg, bare, reason, &dlx, &key);
            let headers = crate::message::decode_properties(&dead.properties)
                .headers()
                .as_ref()
                .map(crate::message::to_args)
                .unwrap_or_default();
            let targets = match self.route_fresh(&dlx_key, &key, &headers).await {
                None => {
                    unrouted.push((i, NotDeadLettered::NoExchange(dlx.clone())));
                    continue;
                }
                Some(t) if t.is_empty() => {
                    unrouted.push((i, NotDeadLettered::NoRoute(dlx.clone())));
                    continue;
                }
                Some(t) => t,
            };
            for target in targets {
                if queues_seen.iter().any(|q| q == names::name_of(&target)) && !rejected_on_the_way {
                    tracing::debug!(queue, target, "dead-letter cycle without a rejection; dropped");
                    continue;
                }
                match routed.iter_mut().find(|(t, _)| *t == target) {
                    Some((_, ms)) => ms.push((i, dead.clone())),
                    None => routed.push((target, vec![(i, dead.clone())])),
                }
            }
        }
        (routed, unrouted)
    }

    /// While this node masters a queue, wake when the message at the head
    /// is due (by the queue's TTL or its own) and propose an entry whose
    /// stamp expires it. Sleeps on the queue's stats and limits otherwise:
    /// a queue with nothing due costs no wake-ups.
    pub(in crate::node) fn spawn_expiry(&self, g: Arc<QueueGroup>) {
        let node = self.clone();
        tokio::spawn(async move {
            let mut stats = g.stats.clone();
            let mut limits = g.proposer.watch_limits();
            // Held dead letters that could not go: when to try again, the
            // tag to go on from, and the targets that have each already.
            let mut retry: Option<(Instant, Duration)> = None;
            let mut from = 0;
            let mut sent: HashMap<u64, BTreeSet<String>> = HashMap::new();
            while !g.stop.is_cancelled() {
                let ttl = limits.borrow_and_update().ttl_ms;
                let (head, own, held) = {
                    let s = stats.borrow_and_update();
                    (s.head_published_at, s.head_deadline, s.dead_letters)
                };
                let by_queue = ttl.zip(head).map(|(ttl, at)| at.saturating_add(ttl));
                let due = match (by_queue, own) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                let leader = g.is_leader(node.id());
                if leader && due.is_some_and(|d| d <= now_ms()) {
                    if let Err(e) = g.proposer.submit(vec![QueueCmd::Expire]).await {
                        tracing::debug!(queue = %g.meta.name, error = %e, "expiry entry not written");
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                    continue;
                }
                if held == 0 || !leader {
                    (retry, from) = (None, 0);
                    sent.clear();
                }
                if leader && held > 0 && retry.is_none_or(|(at, _)| at <= Instant::now()) {
                    let (next, done) = node.dead_letter_held(&g, from, &mut sent).await;
                    from = next;
                    match done {
                        Ok(()) => retry = None,
                        Err(e) => {
                            node.inner.metrics.repeated_failures.inc();
                            let wait = retry.map_or(RETRY_FIRST, |(_, w)| (w * 2).min(RETRY_MAX));
                            tracing::warn!(queue = %g.meta.name, held, error = %e, retry_ms = wait.as_millis() as u64, "dead letters held in the queue until they can go");
                            retry = Some((Instant::now() + wait, wait));
                        }
                    }
                    continue;
                }
                let mut wait = match due {
                    Some(due) if leader => Duration::from_millis(due.saturating_sub(now_ms())),
                    // Something is due but another node masters the queue:
                    // look again now and then, this one may take over.
                    Some(_) => Duration::from_secs(1),
                    None => Duration::from_secs(3600),
                };
                if held > 0 {
                    let again = match retry {
                        Some((at, _)) if leader => at.saturating_duration_since(Instant::now()),
                        _ => Duration::from_secs(1),
                    };
                    wait = wait.min(again);
                }
                tokio::select! {
                    _ = g.stop.cancelled() => return,
                    _ = stats.changed() => {}
                    _ = limits.changed() => {}
                    _ = tokio::time::sleep(wait) => {}
                }
            }
        });
    }
}

/// The message as the dead-letter exchange gets it: routed with `key`,
/// without its `expiration` (kept as `original-expiration`), its `x-death`
/// history updated (the entry for this queue and reason
/// counted up and moved first), `x-first-death-*` set once. Also answers
/// whether the history holds a rejection and which queues it names.
fn with_death(
    mut msg: Message,
    queue: &str,
    reason: DeathReason,
    dlx: &str,
    key: &str,
) -> (Message, bool, Vec<String>) {
    let (props, expiration) = crate::message::without_expiration(crate::message::decode_properties(&msg.properties));
    let mut headers = props.headers().clone().unwrap_or_default();
    let s = |v: &str| AMQPValue::LongString(LongString::from(v));
    let text = |t: &FieldTable, k: &str| match t.inner().get(k) {
        Some(AMQPValue::LongString(v)) => Some(String::from_utf8_lossy(v.as_bytes()).into_owned()),
        Some(AMQPValue::ShortString(v)) => Some(v.as_str().to_string()),
        _ => None,
    };
    let mut deaths: Vec<FieldTable> = match headers.inner().get("x-death") {
        Some(AMQPValue::FieldArray(a)) => a
            .as_slice()
            .iter()
            .filter_map(|v| match v {
                AMQPValue::FieldTable(t) => Some(t.clone()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    let same = deaths.iter().position(|t| {
        text(t, "queue").as_deref() == Some(queue) && text(t, "reason").as_deref() == Some(reason.as_str())
    });
    let mut entry = match same {
        Some(i) => deaths.remove(i),
        None => FieldTable::default(),
    };
    let count = match entry.inner().get("count") {
        Some(AMQPValue::LongLongInt(n)) => *n + 1,
        Some(AMQPValue::LongInt(n)) => *n as i64 + 1,
        _ => 1,
    };
    entry.insert(ShortString::from("count"), AMQPValue::LongLongInt(count));
    entry.insert(ShortString::from("reason"), s(reason.as_str()));
    entry.insert(ShortString::from("queue"), s(queue));
    entry.insert(ShortString::from("time"), AMQPValue::Timestamp(now_ms() / 1000));
    entry.insert(ShortString::from("exchange"), s(&msg.exchange));
    entry.insert(ShortString::from("routing-keys"), AMQPValue::FieldArray(FieldArray::from(vec![s(&msg.routing_key)])));
    if let Some(e) = expiration {
        entry.insert(ShortString::from("original-expiration"), s(&e));
    }
    deaths.insert(0, entry);
    let rejected = deaths.iter().any(|t| text(t, "reason").as_deref() == Some("rejected"));
    let seen = deaths.iter().filter_map(|t| text(t, "queue")).collect();
    if !headers.contains_key("x-first-death-reason") {
        headers.insert(ShortString::from("x-first-death-reason"), s(reason.as_str()));
        headers.insert(ShortString::from("x-first-death-queue"), s(queue));
        headers.insert(ShortString::from("x-first-death-exchange"), s(&msg.exchange));
    }
    headers.insert(
        ShortString::from("x-death"),
        AMQPValue::FieldArray(FieldArray::from(deaths.into_iter().map(AMQPValue::FieldTable).collect::<Vec<_>>())),
    );
    msg.properties = crate::message::encode_properties(&props.with_headers(headers));
    msg.exchange = dlx.to_string();
    msg.routing_key = key.to_string();
    (msg, rejected, seen)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deaths(m: &Message) -> Vec<FieldTable> {
        let props = crate::message::decode_properties(&m.properties);
        match props.headers().as_ref().and_then(|h| h.inner().get("x-death").cloned()) {
            Some(AMQPValue::FieldArray(a)) => a
                .as_slice()
                .iter()
                .map(|v| match v {
                    AMQPValue::FieldTable(t) => t.clone(),
                    other => panic!("{other:?}"),
                })
                .collect(),
            other => panic!("no x-death: {other:?}"),
        }
    }

    #[test]
    fn x_death_counts_per_queue_and_reason_and_detects_cycles() {
        let m = Message { exchange: "ex".into(), routing_key: "k".into(), properties: vec![], body: b"b".to_vec() };
        let (m, rejected, seen) = with_death(m, "work", DeathReason::Rejected, "dlx", "retry");
        assert_eq!((m.exchange.as_str(), m.routing_key.as_str()), ("dlx", "retry"));
        assert!(rejected);
        assert_eq!(seen, vec!["work".to_string()]);
        let (m, _, _) = with_death(m, "retry", DeathReason::Expired, "ex", "k");
        let (m, rejected, seen) = with_death(m, "work", DeathReason::Rejected, "dlx", "retry");
        assert!(rejected);
        assert_eq!(seen, vec!["work".to_string(), "retry".to_string()]);
        let d = deaths(&m);
        assert_eq!(d.len(), 2);
        assert_eq!(d[0].inner().get("count"), Some(&AMQPValue::LongLongInt(2)));
        assert_eq!(d[0].inner().get("queue"), Some(&AMQPValue::LongString("work".into())));
        assert_eq!(d[1].inner().get("reason"), Some(&AMQPValue::LongString("expired".into())));
        let props = crate::message::decode_properties(&m.properties);
        let h = props.headers().clone().unwrap();
        assert_eq!(h.inner().get("x-first-death-reason"), Some(&AMQPValue::LongString("rejected".into())));
        assert_eq!(h.inner().get("x-first-death-exchange"), Some(&AMQPValue::LongString("ex".into())));

        let plain = Message { exchange: "".into(), routing_key: "q".into(), properties: vec![], body: vec![] };
        let (_, rejected, _) = with_death(plain, "q", DeathReason::Expired, "", "q");
        assert!(!rejected, "an expiry-only history is a cycle to break");
    }
}
