//! Turns a stream of queue operations into few Raft entries, and answers each
//! operation when its entry is applied (and, for publishes, on every
//! synchronised replica's disk).
//!
//! openraft 0.9 runs one log append per group at a time, so an entry per
//! publish would cap a queue at the disk's sync rate. Instead, everything
//! that arrives while earlier entries are in flight goes into the next entry
//! together: the busier the queue, the bigger the entries.

use std::sync::Arc;

use openraft::error::ClientWriteError;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tokio_util::sync::CancellationToken;

use super::sync::SyncState;
use super::types::{QueueCmd, QueueReply};
use crate::error::NodeError;
use crate::raft::types::{NodeId, Raft, Request, Response, TypeConfig};

/// Entries of one group in flight at once. Two keeps one appending while the
/// previous one replicates; more only makes entries smaller.
const MAX_IN_FLIGHT: usize = 2;
/// Caps on one entry, to bound memory and the time to replicate it.
const MAX_CMDS: usize = 4096;
const MAX_BYTES: usize = 256 << 10;

type Reply = oneshot::Sender<Result<Vec<QueueReply>, NodeError>>;
/// Where the replies of enqueued operations arrive.
pub type Answer = oneshot::Receiver<Result<Vec<QueueReply>, NodeError>>;

struct Pending {
    cmds: Vec<QueueCmd>,
    reply: Reply,
}

/// Handle for submitting operations to one group on this node.
#[derive(Clone)]
pub struct Proposer {
    tx: mpsc::Sender<Pending>,
}

fn approx_size(cmds: &[QueueCmd]) -> usize {
    cmds.iter()
        .map(|c| match c {
            QueueCmd::Enqueue { msgs } => msgs.iter().map(|m| m.body.len() + m.properties.len() + 64).sum(),
            _ => 32,
        })
        .sum()
}

impl Proposer {
    pub fn spawn(raft: Raft, sync: watch::Receiver<SyncState>, stop: CancellationToken) -> Self {
        let (tx, mut rx) = mpsc::channel::<Pending>(65536);
        tokio::spawn(async move {
            let slots = Arc::new(Semaphore::new(MAX_IN_FLIGHT));
            loop {
                let permit = tokio::select! {
                    _ = stop.cancelled() => return,
                    p = slots.clone().acquire_owned() => p.expect("semaphore never closed"),
                };
                let first = tokio::select! {
                    _ = stop.cancelled() => return,
                    p = rx.recv() => match p { Some(p) => p, None => return },
                };
                let (mut n, mut bytes) = (first.cmds.len(), approx_size(&first.cmds));
                let mut batch = vec![first];
                while n < MAX_CMDS && bytes < MAX_BYTES {
                    match rx.try_recv() {
                        Ok(p) => {
                            n += p.cmds.len();
                            bytes += approx_size(&p.cmds);
                            batch.push(p);
                        }
                        Err(_) => break,
                    }
                }
                // Hand the entry to Raft here, in arrival order (that fixes
                // its place in the log); wait for commit and confirm elsewhere.
                let (cmds, waiters, needs_confirm) = flatten(batch);
                match raft.client_write_ff(Request::Queue(cmds)).await {
                    Ok(rx) => {
                        let sync = sync.clone();
                        tokio::spawn(async move {
                            finish(rx, sync, waiters, needs_confirm).await;
                            drop(permit);
                        });
                    }
                    Err(fatal) => fail(waiters, NodeError::Unavailable(fatal.to_string())),
                }
            }
        });
        Self { tx }
    }

    /// Submit operations; resolves with their replies in order.
    pub async fn submit(&self, cmds: Vec<QueueCmd>) -> Result<Vec<QueueReply>, NodeError> {
        self.enqueue(cmds).await?.await.map_err(|_| NodeError::Stopped)?
    }

    /// Queue operations behind everything enqueued before (this is what
    /// fixes their order in the log); the receiver answers after commit (and
    /// confirm, for publishes).
    pub async fn enqueue(&self, cmds: Vec<QueueCmd>) -> Result<Answer, NodeError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Pending { cmds, reply }).await.map_err(|_| NodeError::Stopped)?;
        Ok(rx)
    }
}

type Waiters = Vec<(usize, Reply)>;

fn flatten(batch: Vec<Pending>) -> (Vec<QueueCmd>, Waiters, bool) {
    let mut cmds = Vec::with_capacity(batch.iter().map(|p| p.cmds.len()).sum());
    let mut waiters = Vec::with_capacity(batch.len());
    for p in batch {
        waiters.push((p.cmds.len(), p.reply));
        cmds.extend(p.cmds);
    }
    let needs_confirm = cmds.iter().any(QueueCmd::needs_confirm);
    (cmds, waiters, needs_confirm)
}

fn fail(waiters: Waiters, e: NodeError) {
    for (_, reply) in waiters {
        let _ = reply.send(Err(e.clone()));
    }
}

type WriteAnswer = oneshot::Receiver<
    Result<openraft::raft::ClientWriteResponse<TypeConfig>, ClientWriteError<NodeId, openraft::BasicNode>>,
>;

async fn finish(rx: WriteAnswer, mut sync: watch::Receiver<SyncState>, waiters: Waiters, needs_confirm: bool) {
    let result = match rx.await {
        Ok(Ok(resp)) => match resp.data {
            Response::Queue(replies) => {
                let (term, index) = (resp.log_id.leader_id.term, resp.log_id.index);
                if needs_confirm {
                    let slow = tokio::time::timeout(
                        Duration::from_secs(3),
                        sync.wait_for(|s| s.confirms(term, index).is_some()),
                    )
                    .await
                    .is_err();
                    if slow {
                        // Normal while a mirror is being dropped from the
                        // synchronised set; worth seeing when it is not.
                        tracing::info!(term, index, sync = ?*sync.borrow(), "confirm waiting over 3 s");
                    }
                    match sync.wait_for(|s| s.confirms(term, index).is_some()).await {
                        Ok(s) if s.confirms(term, index) == Some(Ok(())) => Ok(replies),
                        _ => Err(NodeError::Unconfirmed(format!(
                            "leadership of term {term} ended before every replica had entry {index}"
                        ))),
                    }
                } else {
                    Ok(replies)
                }
            }
            other => Err(NodeError::Invalid(format!("queue group answered {other:?}"))),
        },
        Ok(Err(ClientWriteError::ForwardToLeader(f))) => Err(NodeError::NotLeader { leader: f.leader_id }),
        Ok(Err(e)) => Err(NodeError::Unavailable(e.to_string())),
        Err(_) => Err(NodeError::Stopped),
    };
    match result {
        Ok(replies) => {
            let mut it = replies.into_iter();
            for (n, reply) in waiters {
                let _ = reply.send(Ok(it.by_ref().take(n).collect()));
            }
        }
        Err(e) => fail(waiters, e),
    }
}
