//! Where masters go, on a live three-node cluster: thirty mirrored queues
//! declared on one node end with masters spread within one of each other;
//! after a node's restart has moved its masterships away, a rebalance run
//! while clients publish evens them out again and loses no confirmed message.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{fast_timing, init_tracing, msg, policy, wait_until, Cluster};
use mirrorq::NodeError;

const QUEUES: usize = 30;

fn names() -> Vec<String> {
    (0..QUEUES).map(|i| format!("bal-{i:02}")).collect()
}

/// Masters per node, as the replicas see them (every node listed).
async fn masters(c: &Cluster) -> BTreeMap<u64, usize> {
    let mut count: BTreeMap<u64, usize> = (1..=3).map(|n| (n, 0)).collect();
    for q in names() {
        *count.entry(c.master_of(&q).await).or_default() += 1;
    }
    count
}

fn within_one_of_average(count: &BTreeMap<u64, usize>) -> bool {
    let avg = QUEUES as f64 / count.len() as f64;
    count.values().all(|c| (*c as f64 - avg).abs() <= 1.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn masters_spread_on_declare_and_rebalance_evens_them_out_while_publishing() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(3))).await;
    c.node(1).set_policy(policy("^bal", r#"{"ha-mode":"all","ha-sync-mode":"automatic"}"#)).await.unwrap();
    for q in names() {
        c.node(1).declare_queue(&q, vec![]).await.unwrap();
    }
    let placed = masters(&c).await;
    assert!(within_one_of_average(&placed), "after declaring on one node: {placed:?}");

    tracing::info!("--- node 3 restarts: its masterships move to nodes 1 and 2");
    c.crash(3).await;
    wait_until(Duration::from_secs(60), "every queue has a master on node 1 or 2", || {
        names().iter().all(|q| c.nodes.iter().flatten().any(|n| n.is_master(q)))
    })
    .await;
    c.restart(3).await;
    for q in names() {
        let node = c.node(1).clone();
        let mut synced = false;
        for _ in 0..600 {
            if let Ok(v) = node.master_view(&q).await {
                synced = v.synchronised.contains(&3);
                if synced {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(synced, "node 3 never synchronised on {q}");
    }
    let skewed = masters(&c).await;
    assert_eq!(skewed[&3], 0, "{skewed:?}");

    tracing::info!("--- rebalance while three publishers keep six queues busy");
    let stop = Arc::new(AtomicBool::new(false));
    let confirmed: Arc<Mutex<BTreeMap<String, BTreeSet<String>>>> = Arc::default();
    let publishers: Vec<_> = (0..3)
        .map(|p| {
            let (node, stop, confirmed) = (c.node(p + 1).clone(), stop.clone(), confirmed.clone());
            tokio::spawn(async move {
                let mut i = 0;
                while !stop.load(Ordering::Acquire) {
                    // Six busy queues; the other 24 are idle during the moves.
                    let queue = format!("bal-{:02}", (i * 3 + p as usize) % 6);
                    let body = format!("p{p}-{i}");
                    match node.publish(&queue, vec![msg(body.clone())]).await {
                        Ok(()) => {
                            confirmed.lock().unwrap().entry(queue).or_default().insert(body);
                        }
                        // Not confirmed: a publisher would resend; count only confirms.
                        Err(NodeError::Unconfirmed(_) | NodeError::Unavailable(_) | NodeError::NotLeader { .. }) => {}
                        Err(e) => panic!("publish failed: {e}"),
                    }
                    i += 1;
                }
            })
        })
        .collect();
    // Every publisher is under way (each has had its two queues confirm).
    let confirms = || -> BTreeMap<String, usize> {
        confirmed.lock().unwrap().iter().map(|(q, bodies)| (q.clone(), bodies.len())).collect()
    };
    wait_until(Duration::from_secs(30), "all six busy queues confirm publishes", || confirms().len() == 6).await;
    let moves = c.node(2).rebalance().await.unwrap();
    // Publishing goes on after the moves: every busy queue confirms again.
    let at_moves = confirms();
    wait_until(Duration::from_secs(30), "every busy queue confirms after the rebalance", || {
        let now = confirms();
        at_moves.iter().all(|(q, before)| now.get(q).is_some_and(|n| n > before))
    })
    .await;
    stop.store(true, Ordering::Release);
    for p in publishers {
        p.await.unwrap();
    }
    assert!(moves.len() >= 9, "{moves:?}");
    assert!(moves.iter().all(|m| m.error.is_none() && m.to == 3), "{moves:?}");
    let balanced = masters(&c).await;
    assert!(within_one_of_average(&balanced), "after the rebalance: {balanced:?}");

    // Every confirmed message is in its queue.
    let confirmed = confirmed.lock().unwrap().clone();
    assert!(confirmed.values().map(BTreeSet::len).sum::<usize>() > 0, "nothing was confirmed during the rebalance");
    for (queue, bodies) in confirmed {
        let mut got = BTreeSet::new();
        loop {
            let batch = c.node(1).get(&queue, 1, 100, true).await.unwrap();
            if batch.is_empty() {
                break;
            }
            got.extend(batch.into_iter().map(|d| String::from_utf8(d.message.body).unwrap()));
        }
        let missing: Vec<_> = bodies.difference(&got).collect();
        assert!(missing.is_empty(), "{queue}: confirmed but missing {missing:?}");
    }
    c.shutdown().await;
}

/// Two nodes stop at once: the stopping master does not hand its queue to
/// the senior mirror whose node is stopping too (it would lead a queue it
/// has no one to hand to), but to the one that stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_master_hands_over_to_no_mirror_that_is_stopping_too() {
    init_tracing();
    let c = Cluster::start(3, fast_timing(Duration::from_secs(60))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    common::publish_retrying(c.node(1), "q", b"m".to_vec()).await;
    let master = c.master_of("q").await;
    let replicas = c.node(master).metadata().queues["q"].replicas.clone();
    let mirrors: Vec<u64> = replicas.iter().copied().filter(|id| *id != master).collect();
    // By seniority the first mirror would take over; its node stops first.
    let (senior, other) = (mirrors[0], mirrors[1]);
    wait_until(Duration::from_secs(20), "every mirror synchronised", || {
        c.node(master).queue_info("q").is_ok_and(|i| i.synchronised.len() == 3)
    })
    .await;
    assert_eq!(c.node(senior).move_masterships_away().await, 0);
    assert_eq!(c.node(master).move_masterships_away().await, 0, "the mastership did not move");
    assert_eq!(c.master_of("q").await, other, "handed to a node that is stopping");
    c.shutdown().await;
}
