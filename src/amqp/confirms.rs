//! A channel's publisher confirms, sent as RabbitMQ sends them: the
//! publishes that completed together and lie below the lowest one still
//! waiting go as one `basic.ack` with `multiple`; the others as single acks
//! at once (no head-of-line wait behind a slow queue); nacks singly, first.
//!
//! With many publishes in flight a whole Raft entry confirms at once, so
//! one frame answers hundreds of publishes and the client handles one
//! confirm instead of hundreds.

use std::collections::BTreeMap;
use std::time::Duration;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, AMQPClass};
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Publishes awaiting their confirm: `count` consecutive sequence numbers
/// from `first` (the publishes of a channel that went to the queue in one
/// submit) and a future that resolves to how many of them, from the first,
/// were stored (acked); the rest are nacked.
pub struct Pending {
    pub first: u64,
    pub count: u64,
    pub stored: BoxFuture<'static, u64>,
}

/// A completed [`Pending`]: `first..first + count`, of which the first
/// `stored` are acked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Done {
    pub first: u64,
    pub count: u64,
    pub stored: u64,
}

/// The frames that answer one batch of completed publishes, given the
/// lowest seq still outstanding after it (`u64::MAX`: none).
pub fn frames(done: &mut [Done], low: u64, channel: u16) -> Vec<AMQPFrame> {
    done.sort_unstable();
    let frame = |m| AMQPFrame::Method(channel, AMQPClass::Basic(m));
    let mut out: Vec<AMQPFrame> = done
        .iter()
        .flat_map(|d| d.first + d.stored..d.first + d.count)
        .map(|seq| frame(basic::AMQPMethod::Nack(basic::Nack { delivery_tag: seq, multiple: false, requeue: false })))
        .collect();
    // Outstanding and done ranges never overlap: each acked range lies
    // wholly below `low` or wholly above it.
    let acked = |d: &Done| (d.stored > 0).then_some(d.first..d.first + d.stored);
    let below: Vec<_> = done.iter().filter(|d| d.first < low).filter_map(acked).collect();
    if let Some(hi) = below.last().map(|r| r.end - 1) {
        // Every seq below `low` is confirmed by now: earlier batches
        // answered the rest, so `multiple` covers exactly these.
        let many = below.iter().map(|r| r.end - r.start).sum::<u64>() > 1;
        out.push(frame(basic::AMQPMethod::Ack(basic::Ack { delivery_tag: hi, multiple: many })));
    }
    out.extend(
        done.iter()
            .filter(|d| d.first > low)
            .filter_map(acked)
            .flatten()
            .map(|seq| frame(basic::AMQPMethod::Ack(basic::Ack { delivery_tag: seq, multiple: false }))),
    );
    out
}

/// A channel's confirm task: publishes go in with [`Confirms::when`], the
/// answers go out as they complete.
pub struct Confirms {
    tx: mpsc::UnboundedSender<Pending>,
    /// Nack whatever is still unanswered, and stop.
    cut: CancellationToken,
    task: JoinHandle<()>,
}

impl Confirms {
    /// Answer `p` once it completes.
    pub fn when(&self, p: Pending) {
        let _ = self.tx.send(p);
    }

    /// The channel closes (RabbitMQ: every publish is answered before
    /// `close-ok`, and nothing follows it): wait for the answers of every
    /// publish registered so far, at most `within`; what is still
    /// unanswered then is nacked. Returns once the last frame is sent.
    pub async fn close(self, within: Duration) {
        let Confirms { tx, cut, mut task } = self;
        drop(tx);
        if tokio::time::timeout(within, &mut task).await.is_err() {
            cut.cancel();
            // Its nacks may wait on a client that reads nothing: bounded.
            if tokio::time::timeout(within, &mut task).await.is_err() {
                task.abort();
            }
        }
    }

    /// The channel is closed under the client: nothing more is sent.
    pub fn abandon(self) {
        self.task.abort();
    }
}

/// Start the confirm task of `channel`; frames go to `send`. It ends once
/// the sender is dropped and every pending publish has been answered.
pub fn spawn<F, Fut>(channel: u16, send: F) -> Confirms
where
    F: Fn(Vec<AMQPFrame>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let (tx, mut rx) = mpsc::unbounded_channel::<Pending>();
    let cut = CancellationToken::new();
    let cut_seen = cut.clone();
    let task = tokio::spawn(async move {
        let mut waiting: FuturesUnordered<BoxFuture<'static, Done>> = FuturesUnordered::new();
        // Outstanding ranges: first seq -> count.
        let mut outstanding = BTreeMap::new();
        let wait = |p: Pending, outstanding: &mut BTreeMap<u64, u64>| {
            let (first, count) = (p.first, p.count);
            outstanding.insert(first, count);
            p.stored.map(move |stored| Done { first, count, stored: stored.min(count) }).boxed()
        };
        let mut open = true;
        while open || !waiting.is_empty() {
            tokio::select! {
                p = rx.recv(), if open => match p {
                    Some(p) => waiting.push(wait(p, &mut outstanding)),
                    None => open = false,
                },
                Some(first) = waiting.next(), if !waiting.is_empty() => {
                    // Take every publish registered so far, then everything
                    // already complete: one batch, one write.
                    while let Ok(p) = rx.try_recv() {
                        waiting.push(wait(p, &mut outstanding));
                    }
                    let mut done = vec![first];
                    while let Some(Some(d)) = waiting.next().now_or_never() {
                        done.push(d);
                    }
                    for d in &done {
                        outstanding.remove(&d.first);
                    }
                    let low = outstanding.keys().next().copied().unwrap_or(u64::MAX);
                    send(frames(&mut done, low, channel)).await;
                }
                _ = cut_seen.cancelled() => {
                    while let Ok(p) = rx.try_recv() {
                        outstanding.insert(p.first, p.count);
                    }
                    let mut unanswered: Vec<Done> =
                        outstanding.iter().map(|(&first, &count)| Done { first, count, stored: 0 }).collect();
                    send(frames(&mut unanswered, u64::MAX, channel)).await;
                    return;
                }
            }
        }
    });
    Confirms { tx, cut, task }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn acks(frames: &[AMQPFrame]) -> Vec<(&'static str, u64, bool)> {
        frames
            .iter()
            .map(|f| match f {
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Ack(a))) => {
                    ("ack", a.delivery_tag, a.multiple)
                }
                AMQPFrame::Method(_, AMQPClass::Basic(basic::AMQPMethod::Nack(n))) => {
                    ("nack", n.delivery_tag, n.multiple)
                }
                other => panic!("unexpected {other:?}"),
            })
            .collect()
    }

    /// A confirm task whose frames are collected.
    fn collected() -> (Confirms, mpsc::UnboundedReceiver<Vec<AMQPFrame>>) {
        let (out_tx, out_rx) = mpsc::unbounded_channel::<Vec<AMQPFrame>>();
        let confirms = spawn(1, move |f| {
            let out_tx = out_tx.clone();
            async move {
                let _ = out_tx.send(f);
            }
        });
        (confirms, out_rx)
    }

    #[test]
    fn contiguous_acks_coalesce_and_the_rest_go_singly() {
        // 1..=4 done, 5 still waiting, 6 and 7 done: one multiple ack for
        // 1-4, single acks for 6 and 7 (they must not wait for 5).
        let one = |seq, ok: bool| Done { first: seq, count: 1, stored: ok as u64 };
        let mut done = vec![one(3, true), one(1, true), one(7, true), one(2, true), one(4, true), one(6, true)];
        assert_eq!(acks(&frames(&mut done, 5, 1)), [("ack", 4, true), ("ack", 6, false), ("ack", 7, false)]);
        // A nack goes first and singly; acks around it still coalesce
        // (a multiple ack covers only what is still unconfirmed).
        let mut done = vec![one(8, true), one(9, false), one(10, true)];
        assert_eq!(acks(&frames(&mut done, u64::MAX, 1)), [("nack", 9, false), ("ack", 10, true)]);
        // One alone is a plain ack.
        assert_eq!(acks(&frames(&mut [one(11, true)], u64::MAX, 1)), [("ack", 11, false)]);
    }

    #[test]
    fn a_range_is_acked_up_to_what_was_stored_and_nacked_after() {
        // 20..=29 went together, the queue stored the first 7 (then it was
        // full); 30..=31 are done as well, 32 is still waiting.
        let mut done = vec![Done { first: 30, count: 2, stored: 2 }, Done { first: 20, count: 10, stored: 7 }];
        assert_eq!(
            acks(&frames(&mut done, 32, 1)),
            [("nack", 27, false), ("nack", 28, false), ("nack", 29, false), ("ack", 31, true)]
        );
        // Above a publish still waiting, each stored one is acked singly.
        let mut done = vec![Done { first: 40, count: 3, stored: 3 }];
        assert_eq!(acks(&frames(&mut done, 39, 1)), [("ack", 40, false), ("ack", 41, false), ("ack", 42, false)]);
    }

    #[tokio::test]
    async fn the_task_answers_every_publish_once() {
        let (confirms, mut out_rx) = collected();
        let tx = confirms.tx.clone();
        let (gate_tx, gate_rx) = tokio::sync::oneshot::channel::<()>();
        let p = |first, stored: BoxFuture<'static, u64>| Pending { first, count: 1, stored };
        tx.send(p(1, async { 1 }.boxed())).unwrap();
        tx.send(p(2, async move { gate_rx.await.is_ok() as u64 }.boxed())).unwrap();
        tx.send(p(3, async { 0 }.boxed())).unwrap();
        drop(tx);
        drop(confirms);
        let mut seen = Vec::new();
        let first = out_rx.recv().await.unwrap();
        seen.extend(acks(&first));
        assert!(!seen.iter().any(|(_, seq, _)| *seq == 2), "2 is not complete yet");
        gate_tx.send(()).unwrap();
        while let Some(f) = out_rx.recv().await {
            seen.extend(acks(&f));
        }
        let mut tags: Vec<u64> = seen.iter().map(|(_, t, _)| *t).collect();
        tags.sort_unstable();
        assert_eq!(tags, [1, 2, 3], "{seen:?}");
        assert!(seen.contains(&("nack", 3, false)));
    }

    #[tokio::test]
    async fn a_close_answers_every_publish_before_it_returns_and_nacks_what_never_completes() {
        let (confirms, mut out_rx) = collected();
        let p = |first, stored: BoxFuture<'static, u64>| Pending { first, count: 1, stored };
        let later = tokio::time::sleep(Duration::from_millis(50));
        confirms.when(p(
            1,
            async move {
                later.await;
                1
            }
            .boxed(),
        ));
        confirms.when(p(2, futures::future::pending().boxed()));
        confirms.when(p(3, async { 1 }.boxed()));
        confirms.close(Duration::from_millis(300)).await;
        // Everything was sent before `close` returned: nothing comes after.
        let mut seen = Vec::new();
        while let Ok(f) = out_rx.try_recv() {
            seen.extend(acks(&f));
        }
        let mut by_tag: Vec<(u64, &str)> = seen.iter().map(|(k, t, _)| (*t, *k)).collect();
        by_tag.sort_unstable();
        assert_eq!(by_tag, [(1, "ack"), (2, "nack"), (3, "ack")], "{seen:?}");
        assert!(out_rx.recv().await.is_none(), "the task is gone and sends nothing more");
    }
}
