//! A channel's publisher confirms, sent as RabbitMQ sends them: the
//! publishes that completed together and lie below the lowest one still
//! waiting go as one `basic.ack` with `multiple`; the others as single acks
//! at once (no head-of-line wait behind a slow queue); nacks singly, first.
//!
//! With many publishes in flight a whole Raft entry confirms at once, so
//! one frame answers hundreds of publishes and the client handles one
//! confirm instead of hundreds.

use std::collections::BTreeSet;

use amq_protocol::frame::AMQPFrame;
use amq_protocol::protocol::{basic, AMQPClass};
use futures::future::BoxFuture;
use futures::stream::FuturesUnordered;
use futures::{FutureExt, StreamExt};
use tokio::sync::mpsc;

/// A publish awaiting its confirm: its sequence number and a future that
/// resolves to whether it was stored (ack) or not (nack).
pub type Pending = (u64, BoxFuture<'static, bool>);

/// The frames that answer one batch of completed publishes, given the seqs
/// still outstanding after it.
pub fn frames(done: &mut [(u64, bool)], outstanding: &BTreeSet<u64>, channel: u16) -> Vec<AMQPFrame> {
    done.sort_unstable();
    let low = outstanding.first().copied().unwrap_or(u64::MAX);
    let frame = |m| AMQPFrame::Method(channel, AMQPClass::Basic(m));
    let mut out: Vec<AMQPFrame> = done
        .iter()
        .filter(|(_, ok)| !ok)
        .map(|(seq, _)| {
            frame(basic::AMQPMethod::Nack(basic::Nack { delivery_tag: *seq, multiple: false, requeue: false }))
        })
        .collect();
    let acked = done.iter().filter(|(_, ok)| *ok).map(|(seq, _)| *seq);
    let (below, above): (Vec<u64>, Vec<u64>) = acked.partition(|seq| *seq < low);
    if let Some(&hi) = below.last() {
        // Every seq below `low` is confirmed by now: earlier batches
        // answered the rest, so `multiple` covers exactly these.
        out.push(frame(basic::AMQPMethod::Ack(basic::Ack { delivery_tag: hi, multiple: below.len() > 1 })));
    }
    out.extend(
        above.into_iter().map(|seq| frame(basic::AMQPMethod::Ack(basic::Ack { delivery_tag: seq, multiple: false }))),
    );
    out
}

/// Start the confirm task of `channel`; frames go to `send`. It ends once
/// the sender is dropped and every pending publish has been answered.
pub fn spawn<F, Fut>(channel: u16, send: F) -> mpsc::UnboundedSender<Pending>
where
    F: Fn(Vec<AMQPFrame>) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    let (tx, mut rx) = mpsc::unbounded_channel::<Pending>();
    tokio::spawn(async move {
        let mut waiting: FuturesUnordered<BoxFuture<'static, (u64, bool)>> = FuturesUnordered::new();
        let mut outstanding = BTreeSet::new();
        let mut open = true;
        while open || !waiting.is_empty() {
            tokio::select! {
                p = rx.recv(), if open => match p {
                    Some((seq, fut)) => {
                        outstanding.insert(seq);
                        waiting.push(fut.map(move |ok| (seq, ok)).boxed());
                    }
                    None => open = false,
                },
                Some(first) = waiting.next(), if !waiting.is_empty() => {
                    // Take every publish registered so far, then everything
                    // already complete: one batch, one write.
                    while let Ok((seq, fut)) = rx.try_recv() {
                        outstanding.insert(seq);
                        waiting.push(fut.map(move |ok| (seq, ok)).boxed());
                    }
                    let mut done = vec![first];
                    while let Some(Some(d)) = waiting.next().now_or_never() {
                        done.push(d);
                    }
                    for (seq, _) in &done {
                        outstanding.remove(seq);
                    }
                    send(frames(&mut done, &outstanding, channel)).await;
                }
            }
        }
    });
    tx
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

    #[test]
    fn contiguous_acks_coalesce_and_the_rest_go_singly() {
        // 1..=4 done, 5 still waiting, 6 and 7 done: one multiple ack for
        // 1-4, single acks for 6 and 7 (they must not wait for 5).
        let outstanding = BTreeSet::from([5]);
        let mut done = vec![(3, true), (1, true), (7, true), (2, true), (4, true), (6, true)];
        assert_eq!(acks(&frames(&mut done, &outstanding, 1)), [("ack", 4, true), ("ack", 6, false), ("ack", 7, false)]);
        // A nack goes first and singly; acks around it still coalesce
        // (a multiple ack covers only what is still unconfirmed).
        let mut done = vec![(8, true), (9, false), (10, true)];
        assert_eq!(acks(&frames(&mut done, &BTreeSet::new(), 1)), [("nack", 9, false), ("ack", 10, true)]);
        // One alone is a plain ack.
        assert_eq!(acks(&frames(&mut [(11, true)], &BTreeSet::new(), 1)), [("ack", 11, false)]);
    }

    #[tokio::test]
    async fn the_task_answers_every_publish_once() {
        let (out_tx, mut out_rx) = mpsc::unbounded_channel::<Vec<AMQPFrame>>();
        let tx = spawn(1, move |f| {
            let out_tx = out_tx.clone();
            async move {
                let _ = out_tx.send(f);
            }
        });
        let (gate_tx, gate_rx) = tokio::sync::oneshot::channel::<()>();
        tx.send((1, async { true }.boxed())).unwrap();
        tx.send((2, async move { gate_rx.await.is_ok() }.boxed())).unwrap();
        tx.send((3, async { false }.boxed())).unwrap();
        drop(tx);
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
}
