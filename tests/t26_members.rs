//! Nodes joining a running cluster and being forgotten, on live in-process
//! clusters: an `ha-mode: all` queue grows a mirror on a node that joins and
//! shrinks back when it is forgotten, losing nothing; forgetting a running
//! node, or one holding a queue's only replica, is refused with a reason.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{fast_timing, init_tracing, policy, wait_until, Cluster};
use mirrorq::NodeError;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_joining_node_gets_mirrors_and_a_forgotten_one_loses_them() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(3))).await;
    c.node(1).set_policy(policy("^all", r#"{"ha-mode":"all","ha-sync-mode":"automatic"}"#)).await.unwrap();
    c.node(1).declare_queue("all-q", vec![]).await.unwrap();
    for i in 0..50 {
        c.node(2).publish("all-q", vec![common::msg(format!("m{i}"))]).await.unwrap();
    }
    // Only replica on node 2 (no policy matches): node 2 cannot be forgotten.
    let solo = c.node(2).declare_queue("solo", vec![]).await.unwrap();
    assert_eq!(solo.replicas, vec![2]);

    tracing::info!("--- node 4 joins through node 2");
    let four = c.add_node(2).await;
    assert_eq!(four, 4);
    wait_until(Duration::from_secs(30), "every node knows node 4", || {
        c.nodes.iter().flatten().all(|n| n.metadata().nodes.contains_key(&4))
    })
    .await;
    let voters: BTreeSet<u64> =
        c.node(1).metadata_raft().metrics().borrow().membership_config.membership().voter_ids().collect();
    assert!(voters.contains(&4), "node 4 is not a metadata voter: {voters:?}");
    assert!(c.node(1).metadata().queues["all-q"].replicas.contains(&4), "ha-mode all did not follow the new node");
    let n4 = c.node(4).clone();
    wait_until(Duration::from_secs(60), "node 4 holds the queue's messages", || {
        n4.local_stored_count("all-q").is_ok_and(|n| n == 50)
    })
    .await;
    let mut synced = false;
    for _ in 0..400 {
        synced = c.node(1).master_view("all-q").await.is_ok_and(|v| v.synchronised.contains(&4));
        if synced {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(synced, "node 4 never became a synchronised mirror");
    // The new node serves clients too.
    c.node(4).publish("all-q", vec![common::msg("from-4")]).await.unwrap();

    tracing::info!("--- forgetting: refused while running, or for a queue's only replica");
    match c.node(1).forget_node("mirrorq@4").await {
        Err(NodeError::Invalid(why)) => assert!(why.contains("running"), "{why}"),
        other => panic!("forgetting a running node: {other:?}"),
    }
    match c.node(1).forget_node("mirrorq@9").await {
        Err(NodeError::NotFound(_)) => {}
        other => panic!("forgetting an unknown node: {other:?}"),
    }
    c.crash(2).await;
    match c.node(1).forget_node("mirrorq@2").await {
        Err(NodeError::Conflict(why)) => assert!(why.contains("solo"), "{why}"),
        other => panic!("forgetting the only replica's node: {other:?}"),
    }
    c.restart(2).await;

    tracing::info!("--- node 4 stops and is forgotten");
    c.crash(4).await;
    c.node(3).forget_node("mirrorq@4").await.unwrap();
    // The metadata leader made the changes; followers apply them as they
    // reach them.
    wait_until(Duration::from_secs(30), "no node lists node 4, and the queue's replicas are 1, 2, 3", || {
        (1..=3).all(|id| {
            let meta = c.node(id).metadata();
            !meta.nodes.contains_key(&4)
                && meta.queues["all-q"].replicas.iter().copied().collect::<BTreeSet<_>>() == BTreeSet::from([1, 2, 3])
        })
    })
    .await;
    wait_until(Duration::from_secs(30), "every node's metadata voters are 1, 2, 3", || {
        (1..=3).all(|id| {
            let voters: BTreeSet<u64> =
                c.node(id).metadata_raft().metrics().borrow().membership_config.membership().voter_ids().collect();
            voters == BTreeSet::from([1, 2, 3])
        })
    })
    .await;
    wait_until(Duration::from_secs(30), "the queue's group drops node 4", || {
        c.nodes
            .iter()
            .flatten()
            .any(|n| n.is_master("all-q") && n.queue_members("all-q") == Some(BTreeSet::from([1, 2, 3])))
    })
    .await;
    let mut got = BTreeSet::new();
    loop {
        let batch = c.node(1).get("all-q", 1, 100, true).await.unwrap();
        if batch.is_empty() {
            break;
        }
        got.extend(batch.into_iter().map(|d| String::from_utf8(d.message.body).unwrap()));
    }
    let want: BTreeSet<String> = (0..50).map(|i| format!("m{i}")).chain(["from-4".to_string()]).collect();
    assert_eq!(got, want);
    c.shutdown().await;
}
