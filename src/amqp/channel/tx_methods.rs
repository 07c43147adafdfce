//! `tx.*`: a transaction's publishes and settlements wait in a buffer and
//! go to each queue's master as one batch at commit.

use std::collections::BTreeMap;

use amq_protocol::protocol::{tx, AMQPClass};

use crate::amqp::channel::basic_methods::Settle;
use crate::amqp::channel::Channel;
use crate::amqp::reply::{
    hard, not_transactional, soft, unknown_tag, Hard, Soft, COMMAND_INVALID, PRECONDITION_FAILED,
};
use crate::metadata::names;
use crate::queue::{Message, QueueCmd};

/// A transaction's work, applied at commit: per queue, its publishes and
/// settlements go to the master as one batch, so they land in one Raft entry.
#[derive(Default)]
pub(in crate::amqp) struct TxBuffer {
    /// Per queue, the messages and their own TTLs.
    pub(in crate::amqp) publishes: BTreeMap<String, Vec<(Message, Option<u64>)>>,
    pub(in crate::amqp) settles: Vec<(u64, bool, Settle)>,
}

impl Channel {
    pub(in crate::amqp) async fn tx_method(&mut self, m: tx::AMQPMethod) -> Result<bool, Result<Soft, Hard>> {
        use tx::AMQPMethod as T;
        match m {
            T::Select(_) => {
                if self.confirm {
                    return Err(Ok(soft(
                        PRECONDITION_FAILED,
                        "PRECONDITION_FAILED - cannot switch from confirm to tx mode",
                        90,
                        10,
                    )));
                }
                self.tx.get_or_insert_with(TxBuffer::default);
                self.reply(AMQPClass::Tx(T::SelectOk(tx::SelectOk {}))).await;
                Ok(true)
            }
            T::Rollback(_) => {
                let Some(tx) = self.tx.as_mut() else {
                    return Err(Ok(not_transactional(30)));
                };
                *tx = TxBuffer::default();
                self.reply(AMQPClass::Tx(T::RollbackOk(tx::RollbackOk {}))).await;
                Ok(true)
            }
            T::Commit(_) => {
                let Some(tx) = self.tx.as_mut() else {
                    return Err(Ok(not_transactional(20)));
                };
                let work = std::mem::take(tx);
                let mut per_queue: BTreeMap<String, Vec<QueueCmd>> = BTreeMap::new();
                for (q, published) in work.publishes {
                    let (msgs, ttls) = published.into_iter().unzip();
                    per_queue.entry(q).or_default().push(QueueCmd::enqueue(msgs, ttls));
                }
                let mut settled = Vec::new();
                for (tag, multiple, how) in work.settles {
                    let requeued = matches!(how, Settle::Nack { requeue: true });
                    let mut taken =
                        self.deliveries.take(tag, multiple, requeued).map_err(|t| Ok(unknown_tag(t, 90, 20)))?;
                    for (q, tags) in std::mem::take(&mut taken.by_queue) {
                        settled.extend(taken.holders(&q));
                        per_queue.entry(q).or_default().push(how.cmd(self.owner, tags));
                    }
                }
                // One batch per queue: it lands in one Raft entry, all or
                // nothing; commit-ok follows every synchronised replica's fsync.
                let mut waits = Vec::new();
                for (q, cmds) in per_queue {
                    waits.push((q.clone(), self.node.submit(&q, cmds).await));
                }
                let mut failure = None;
                for (q, w) in waits {
                    let r = match w {
                        Ok(wait) => wait.await.map(|_| ()),
                        Err(e) => Err(e),
                    };
                    if let Err(e) = r {
                        failure.get_or_insert((q, e));
                    }
                }
                self.deliveries.settled(&settled);
                if let Some((q, e)) = failure {
                    return Err(Ok(soft(
                        506,
                        format!("RESOURCE_ERROR - commit on queue '{}' failed: {e}", names::name_of(&q)),
                        90,
                        20,
                    )));
                }
                self.reply(AMQPClass::Tx(T::CommitOk(tx::CommitOk {}))).await;
                Ok(true)
            }
            other => Err(Err(hard(COMMAND_INVALID, format!("tx.{other:?} is not a client method")))),
        }
    }
}
