//! Failover in-process: a queue that lost the majority of its group is
//! re-formed by the replica left (`ha-promote-on-failure: always`), serves,
//! and the returning replicas heal into the new epoch without losing or
//! duplicating what they share with it.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{fast_timing, init_tracing, policy, publish_retrying, wait_until, Cluster};

async fn drain(node: &mirrorq::Node, queue: &str) -> Vec<String> {
    let mut out = Vec::new();
    loop {
        let got = node.get(queue, 1, 100, true).await.unwrap();
        if got.is_empty() {
            return out;
        }
        out.extend(got.into_iter().map(|d| String::from_utf8(d.message.body).unwrap()));
    }
}

/// Cut (`true`) or mend every link between the nodes of `left` and `right`.
fn split(c: &Cluster, left: &[u64], right: &[u64], cut: bool) {
    for a in left {
        for b in right {
            for (x, y) in [(*a, *b), (*b, *a)] {
                let n = c.node(x);
                if cut {
                    n.block(y)
                } else {
                    n.unblock(y)
                }
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn last_replica_standing_serves_and_the_others_heal_into_its_epoch() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    for i in 0..10 {
        publish_retrying(c.node(1), "q", format!("m{i}").into_bytes()).await;
    }
    // Every replica has every confirmed message before the crash.
    wait_until(Duration::from_secs(10), "node 3 applied all", || c.node(3).queue_info("q").unwrap().ready == 10).await;

    tracing::info!("--- nodes 1 and 2 crash at once");
    c.crash(1).await;
    c.crash(2).await;
    let n3 = c.node(3).clone();
    // Node 3 alone re-forms the queue after the failure timeout and serves it.
    let got = n3.get("q", 1, 4, true).await.expect("served by the last replica");
    let bodies: Vec<String> = got.iter().map(|d| String::from_utf8(d.message.body.clone()).unwrap()).collect();
    assert_eq!(bodies, vec!["m0", "m1", "m2", "m3"]);
    assert_eq!(n3.queue_members("q").unwrap(), BTreeSet::from([3]));
    // Counted once the re-form returns, which may be a moment after the
    // re-formed group first serves.
    wait_until(Duration::from_secs(5), "the re-form counted in /metrics", || n3.metrics().queue_reforms.get() >= 1)
        .await;
    publish_retrying(&n3, "q", b"during".to_vec()).await;

    tracing::info!("--- nodes 1 and 2 come back");
    c.restart(1).await;
    c.restart(2).await;
    wait_until(Duration::from_secs(40), "old replicas rejoin as voters", || {
        n3.queue_members("q") == Some(BTreeSet::from([1, 2, 3]))
            && [1, 2].iter().all(|id| c.node(*id).queue_info("q").map(|i| i.ready == 7).unwrap_or(false))
    })
    .await;
    // They shared their whole history with node 3: nothing was handed back,
    // so nothing node 3 delivered comes again.
    let rest = drain(c.node(1), "q").await;
    assert_eq!(rest, vec!["m4", "m5", "m6", "m7", "m8", "m9", "during"]);

    // Deleting the queue leaves none of its group's keys behind on any node
    // (the chain of epochs node 3 formed included), but its epoch: a
    // replica that comes back later (a policy moves the queue back) must
    // not start the group's first epoch again.
    let group = n3.metadata().queues.values().find(|q| q.name == "q").expect("declared").group;
    let of_group = |id: u64| -> Vec<String> {
        c.node(id)
            .db()
            .node_tree()
            .iter()
            .keys()
            .map(|k| String::from_utf8_lossy(&k.unwrap()).into_owned())
            .filter(|k| k.ends_with(&format!("/{group}")) || k.ends_with(&format!(".{group}")))
            .filter(|k| !k.starts_with("epoch/"))
            .collect()
    };
    assert!(of_group(3).iter().any(|k| k.starts_with("formed-chain/")), "{:?}", of_group(3));
    c.node(1).delete_queue("q").await.unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::time::Instant::now() < deadline && !(1..=3).all(|id| of_group(id).is_empty()) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let left: Vec<Vec<String>> = (1..=3).map(of_group).collect();
    assert!(left.iter().all(|k| k.is_empty()), "keys left behind: {left:?}");
    c.shutdown().await;
}

/// Failure watches run side by side (each lost link starts one), each over
/// the groups it listed when it began. One that reaches a queue only after
/// another re-formed it must leave the new epoch alone: re-forming again
/// from its old view took the new replica out of sight while it kept
/// running, and wrote a new log over the publishes it was still appending
/// (campaign seed 869 lost a message the re-formed replica had confirmed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failure_watch_that_began_before_a_re_form_leaves_the_new_epoch_alone() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    for i in 0..5 {
        publish_retrying(c.node(1), "q", format!("m{i}").into_bytes()).await;
    }
    wait_until(Duration::from_secs(10), "node 3 applied all", || c.node(3).queue_info("q").unwrap().ready == 5).await;
    let n3 = c.node(3).clone();
    let listed_before = n3.replica_view("q").expect("hosted");

    c.crash(1).await;
    c.crash(2).await;
    let got = n3.get("q", 1, 1, true).await.expect("served by the last replica");
    assert_eq!(got.len(), 1);
    // Counted once the re-form has recorded its fork, which may come after
    // the first get is served.
    wait_until(Duration::from_secs(10), "the re-form is counted", || n3.metrics().queue_reforms.get() >= 1).await;
    assert_eq!(n3.metrics().queue_reforms.get(), 1);
    publish_retrying(&n3, "q", b"during".to_vec()).await;

    n3.watch_failures_over(vec![listed_before]).await;
    assert_eq!(n3.metrics().queue_reforms.get(), 1, "re-formed again from a view older than the epoch");
    publish_retrying(&n3, "q", b"after".to_vec()).await;
    assert_eq!(drain(&n3, "q").await, vec!["m1", "m2", "m3", "m4", "during", "after"]);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_only_the_old_epoch_has_are_handed_back() {
    init_tracing();
    let c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    for i in 0..3 {
        publish_retrying(c.node(1), "q", format!("a{i}").into_bytes()).await;
    }
    wait_until(Duration::from_secs(10), "node 3 applied all", || c.node(3).queue_info("q").unwrap().ready == 3).await;

    tracing::info!("--- node 3 is cut off; 1 and 2 go on with more messages");
    for id in [1, 2] {
        c.node(id).block(3);
        c.node(3).block(id);
    }
    for i in 0..4 {
        publish_retrying(c.node(1), "q", format!("b{i}").into_bytes()).await;
    }
    let n3 = c.node(3).clone();
    // Node 3 re-forms alone and takes a publish of its own.
    publish_retrying(&n3, "q", b"c0".to_vec()).await;
    assert_eq!(n3.queue_members("q").unwrap(), BTreeSet::from([3]));

    tracing::info!("--- the partition heals");
    for id in [1, 2] {
        c.node(id).unblock(3);
        c.node(3).unblock(id);
    }
    wait_until(Duration::from_secs(40), "one group again", || {
        (1..=3).all(|id| c.node(id).queue_members("q") == Some(BTreeSet::from([1, 2, 3])))
    })
    .await;
    let mut all = drain(c.node(2), "q").await;
    all.sort();
    // Nodes 1 and 2 kept the majority: node 3's fork yielded and handed
    // back c0, which only it had; nothing is lost and nothing shared is
    // duplicated.
    assert_eq!(all, vec!["a0", "a1", "a2", "b0", "b1", "b2", "b3", "c0"]);
    c.shutdown().await;
}

/// The rule for a split: node 3 is cut off and re-forms the queue alone
/// while nodes 1 and 2 keep a majority and go on serving (consuming half
/// the queue, holding one delivery unacked, taking new publishes). When
/// the partition heals, the majority's queue stays as it is (what it
/// consumed does not come back, its unacked delivery stays unacked) and
/// the minority's fork yields, handing back only what it took alone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_minoritys_fork_yields_to_a_majority_that_kept_serving() {
    init_tracing();
    let c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    for i in 0..10 {
        publish_retrying(c.node(1), "q", format!("a{i}").into_bytes()).await;
    }
    wait_until(Duration::from_secs(10), "node 3 applied all", || c.node(3).queue_info("q").unwrap().ready == 10).await;

    tracing::info!("--- node 3 is cut off; 1 and 2 consume half the queue and take more");
    for id in [1, 2] {
        c.node(id).block(3);
        c.node(3).block(id);
    }
    let n1 = c.node(1).clone();
    let taken: Vec<String> = n1
        .get("q", 1, 5, true)
        .await
        .unwrap()
        .into_iter()
        .map(|d| String::from_utf8(d.message.body).unwrap())
        .collect();
    assert_eq!(taken, vec!["a0", "a1", "a2", "a3", "a4"]);
    let held = n1.get("q", 7, 1, false).await.unwrap();
    assert_eq!(held[0].message.body, b"a5");
    for i in 0..3 {
        publish_retrying(&n1, "q", format!("b{i}").into_bytes()).await;
    }
    let n3 = c.node(3).clone();
    publish_retrying(&n3, "q", b"c0".to_vec()).await;
    assert_eq!(n3.queue_members("q").unwrap(), BTreeSet::from([3]), "node 3 re-formed alone");

    tracing::info!("--- the partition heals");
    for id in [1, 2] {
        c.node(id).unblock(3);
        c.node(3).unblock(id);
    }
    wait_until(Duration::from_secs(40), "one group again, with c0 handed back", || {
        (1..=3).all(|id| c.node(id).queue_members("q") == Some(BTreeSet::from([1, 2, 3])))
            && c.node(1).queue_info("q").is_ok_and(|i| i.ready == 8)
    })
    .await;
    assert_eq!(c.master_of("q").await, 1, "the majority's master stays");
    // The delivery held across the split is still unacked and can be acked.
    let settled = n1.ack("q", vec![held[0].tag]).await.unwrap();
    assert!(matches!(settled, mirrorq::QueueReply::Settled { count: 1, .. }), "{settled:?}");
    let mut rest = drain(c.node(2), "q").await;
    rest.sort();
    // Nothing the majority consumed comes back; c0 is there once.
    assert_eq!(rest, vec!["a6", "a7", "a8", "a9", "b0", "b1", "b2", "c0"]);
    c.shutdown().await;
}

fn bodies(got: &[mirrorq::Delivery]) -> Vec<String> {
    got.iter().map(|d| String::from_utf8(d.message.body.clone()).unwrap()).collect()
}

/// A minority's fork serves its consumers during the split, as
/// `ha-promote-on-failure: always` asks. When it yields, what its consumers
/// took of the messages both sides held is settled on the majority's side
/// too: not delivered a second time there. A delivery still unacked when
/// the fork yields comes back, redelivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_a_yielding_forks_consumers_took_is_not_delivered_again() {
    init_tracing();
    let c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    let all: Vec<mirrorq::Message> = (0..20).map(|i| common::msg(format!("a{i}").into_bytes())).collect();
    c.node(1).publish("q", all).await.unwrap();
    wait_until(Duration::from_secs(10), "node 3 applied all", || c.node(3).queue_info("q").unwrap().ready == 20).await;

    tracing::info!("--- node 3 is cut off and serves alone; 1 and 2 serve too");
    split(&c, &[1, 2], &[3], true);
    let (n1, n3) = (c.node(1).clone(), c.node(3).clone());
    assert_eq!(bodies(&n1.get("q", 1, 2, true).await.unwrap()), ["a0", "a1"]);
    assert_eq!(bodies(&n3.get("q", 1, 5, true).await.expect("the fork serves")), ["a0", "a1", "a2", "a3", "a4"]);
    assert_eq!(n3.queue_members("q").unwrap(), BTreeSet::from([3]), "node 3 re-formed alone");
    // Delivered there and never acked: it must come back.
    assert_eq!(bodies(&n3.get("q", 9, 1, false).await.unwrap()), ["a5"]);
    assert_eq!(bodies(&n3.get("q", 1, 4, true).await.unwrap()), ["a6", "a7", "a8", "a9"]);

    tracing::info!("--- the partition heals");
    split(&c, &[1, 2], &[3], false);
    wait_until(Duration::from_secs(40), "one group again", || {
        (1..=3).all(|id| c.node(id).queue_members("q") == Some(BTreeSet::from([1, 2, 3])))
    })
    .await;
    assert_eq!(c.master_of("q").await, 1, "the majority's master stays");
    let mut got = Vec::new();
    loop {
        let d = c.node(2).get("q", 5, 100, true).await.unwrap();
        if d.is_empty() {
            break;
        }
        got.extend(d.into_iter().map(|d| (String::from_utf8(d.message.body).unwrap(), d.redelivered)));
    }
    // a0 and a1 went to consumers on both sides while they were apart (no
    // merge can take a delivery back); a2-a4 and a6-a9, taken by node
    // 3's consumers only, are not delivered again.
    let mut want = vec![("a5".to_string(), true)];
    want.extend((10..20).map(|i| (format!("a{i}"), false)));
    assert_eq!(got, want);
    c.shutdown().await;
}

/// The master consumes while the mirror that later re-forms the queue is
/// cut off; then the master and the other mirror crash. The survivor's
/// epoch starts without those acks. When the two come back and heal into
/// it, what their group had settled is settled there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acks_the_survivor_never_saw_are_settled_when_the_others_heal_into_its_epoch() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    let all: Vec<mirrorq::Message> = (0..10).map(|i| common::msg(format!("m{i}").into_bytes())).collect();
    c.node(1).publish("q", all).await.unwrap();
    wait_until(Duration::from_secs(10), "node 3 applied all", || c.node(3).queue_info("q").unwrap().ready == 10).await;
    split(&c, &[1, 2], &[3], true);
    assert_eq!(bodies(&c.node(1).get("q", 1, 3, true).await.unwrap()), ["m0", "m1", "m2"]);
    wait_until(Duration::from_secs(5), "node 2 applied the gets", || c.node(2).queue_info("q").unwrap().ready == 7)
        .await;
    c.crash(1).await;
    c.crash(2).await;
    for peer in [1, 2] {
        c.node(3).unblock(peer);
    }
    let n3 = c.node(3).clone();
    wait_until(Duration::from_secs(20), "node 3 re-formed alone", || {
        n3.queue_members("q") == Some(BTreeSet::from([3])) && n3.is_master("q")
    })
    .await;
    assert_eq!(n3.queue_info("q").unwrap().ready, 10, "node 3 never saw the gets");
    c.restart(1).await;
    c.restart(2).await;
    wait_until(Duration::from_secs(40), "the others rejoin node 3's epoch", || {
        n3.queue_members("q") == Some(BTreeSet::from([1, 2, 3]))
    })
    .await;
    let rest = drain(&n3, "q").await;
    assert_eq!(rest, (3..10).map(|i| format!("m{i}")).collect::<Vec<_>>());
    c.shutdown().await;
}

/// An operation forwarded to a queue's master runs only in the epoch of
/// the sender's replica: delivery tags mean something in one epoch, and an
/// ack a minority's fork runs just before it yields is lost to the group
/// that goes on (whose reaper then gives the message to someone else).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_operation_runs_only_in_its_senders_epoch() {
    init_tracing();
    let c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    c.node(1).publish("q", vec![common::msg(b"m0".to_vec())]).await.unwrap();
    let master = c.master_of("q").await;
    let from = if master == 1 { 2 } else { 1 };
    let ours = c.node(from).replica_epoch("q").expect("a replica on the sender");
    let get = || vec![mirrorq::QueueCmd::Get { owner: 5, max: 1, auto_ack: false, consumer: None }];
    let other = mirrorq::queue::epoch::Epoch { term: ours.term + 7, node: 3 };
    let refused = c.node(from).forward_as_of(master, "q", Some(other), get()).await;
    assert!(matches!(refused, Err(mirrorq::NodeError::NotLeader { leader: None })), "{refused:?}");
    assert_eq!(c.node(master).queue_info("q").unwrap().ready, 1, "nothing taken");
    let served = c.node(from).forward_as_of(master, "q", Some(ours), get()).await.unwrap();
    assert!(matches!(&served[..], [mirrorq::QueueReply::Got { msgs, .. }] if msgs.len() == 1), "{served:?}");
    c.shutdown().await;
}

/// The master dies; of its two synchronised mirrors the older one (earlier
/// in the seniority order) takes over, every time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_most_senior_synchronised_mirror_takes_over() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    // Seniority order 2, 3, 1 (2 founds the group; 3 is the older mirror).
    c.node(1).declare_queue("q", vec![2, 3, 1]).await.unwrap();
    publish_retrying(c.node(1), "q", b"x".to_vec()).await;
    assert_eq!(c.master_of("q").await, 2);
    wait_until(Duration::from_secs(10), "all replicas synchronised", || {
        c.node(2).queue_info("q").unwrap().synchronised.len() == 3
    })
    .await;
    let won = c.node(3).metrics().queue_leaderships.get();
    c.crash(2).await;
    let next = c.master_of("q").await;
    assert_eq!(next, 3, "the senior mirror 3 must win, not 1");
    assert_eq!(c.node(3).metrics().queue_leaderships.get(), won + 1, "the takeover is counted in /metrics");
    // And after 2 returns, 3 stays master (no flapping back).
    c.restart(2).await;
    // Back in the group: node 2 has heard from a master of the current term
    // (its own vote from before the crash names itself, in an older term).
    wait_until(Duration::from_secs(20), "node 2 rejoined the group in the current term", || {
        let term = |id: u64| c.node(id).queue_raft("q").map(|r| r.metrics().borrow().current_term);
        let leader = c.node(2).queue_info("q").ok().and_then(|i| i.leader);
        term(2).is_some() && term(2) == term(3) && leader.is_some()
    })
    .await;
    assert_eq!(c.master_of("q").await, 3);
    c.shutdown().await;
}

/// `ha-promote-on-failure: when-synced` keeps strict Raft: the one replica
/// left never serves, so there is no second master anywhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_synced_minority_never_serves() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    c.node(1)
        .set_policy(policy(
            "^strict",
            r#"{"ha-mode":"all","ha-sync-mode":"automatic","ha-promote-on-failure":"when-synced"}"#,
        ))
        .await
        .unwrap();
    c.node(1).declare_queue("strict-q", vec![]).await.unwrap();
    wait_until(Duration::from_secs(20), "three replicas", || {
        c.node(3).queue_members("strict-q") == Some(BTreeSet::from([1, 2, 3]))
    })
    .await;
    publish_retrying(c.node(3), "strict-q", b"x".to_vec()).await;
    c.crash(1).await;
    c.crash(2).await;
    let n3 = c.node(3).clone();
    // Well past the failure timeout (3 s): still no master, same group.
    let r = tokio::time::timeout(Duration::from_secs(8), n3.get("strict-q", 1, 1, true)).await;
    assert!(!matches!(r, Ok(Ok(_))), "a minority replica served: {r:?}");
    assert!(!n3.is_master("strict-q"));
    assert_eq!(n3.queue_members("strict-q").unwrap(), BTreeSet::from([1, 2, 3]));
    // With a majority back, the message is there.
    c.restart(1).await;
    let got = c.node(1).get("strict-q", 1, 1, true).await.unwrap();
    assert_eq!(got.len(), 1);
    c.shutdown().await;
}

/// The master loses both mirrors while a get is waiting for a commit that
/// cannot come. It re-forms alone; that get was never answered, so it must
/// not have consumed the message in the new epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unanswered_get_does_not_consume_across_re_formation() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    publish_retrying(c.node(1), "q", b"keep me".to_vec()).await;
    assert_eq!(c.master_of("q").await, 1);
    // Cut off first, so node 1 cannot tell their deaths from a partition
    // and waits out the failure timeout before re-forming (a death it can
    // see, it re-forms at once, before the get below would be sent).
    for id in [2, 3] {
        c.node(1).block(id);
    }
    c.crash(2).await;
    c.crash(3).await;
    let n1 = c.node(1).clone();
    // Appended on the master, never committed, never answered.
    let stuck = tokio::time::timeout(Duration::from_secs(1), n1.get("q", 7, 1, true)).await;
    assert!(stuck.is_err(), "a get committed without a majority: {stuck:?}");
    let got = n1.get("q", 8, 1, true).await.expect("served after re-forming");
    assert_eq!(got.len(), 1, "the message was consumed by a get nobody received");
    assert_eq!(got[0].message.body, b"keep me");
    c.shutdown().await;
}

/// The master delivers a message (committed with one mirror) that the other
/// mirror never hears of; then the master and that mirror die, and the
/// last replica re-forms the queue. The message comes back `redelivered`
/// (the re-former cannot know it was not delivered), under a tag the old
/// epoch never gave: the consumer's ack of the old delivery settles
/// nothing of the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_before_a_re_form_comes_back_redelivered_and_its_old_tag_settles_nothing() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    for body in ["a", "b"] {
        publish_retrying(c.node(1), "q", body.as_bytes().to_vec()).await;
    }
    assert_eq!(c.master_of("q").await, 1);
    wait_until(Duration::from_secs(10), "node 3 has both", || c.node(3).queue_info("q").unwrap().ready == 2).await;
    c.node(1).block(3);
    c.node(3).block(1);
    let old = c.node(1).get("q", 7, 1, false).await.unwrap();
    assert_eq!((old.len(), old[0].redelivered), (1, false));
    c.crash(1).await;
    c.crash(2).await;
    let n3 = c.node(3).clone();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let again = loop {
        let got = tokio::time::timeout(Duration::from_millis(500), n3.get("q", 7, 1, false)).await;
        match got {
            Ok(Ok(d)) if !d.is_empty() => break d,
            _ if std::time::Instant::now() > deadline => panic!("node 3 does not serve alone: {got:?}"),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    };
    assert_eq!(n3.queue_members("q").unwrap(), BTreeSet::from([3]), "re-formed alone");
    assert_eq!(again[0].message.body, old[0].message.body);
    assert!(again[0].redelivered, "a message the lost master delivered came back as never delivered");
    assert_ne!(again[0].tag, old[0].tag, "the new epoch gave the old delivery's tag to another delivery");
    n3.ack("q", vec![old[0].tag]).await.unwrap();
    assert_eq!(n3.queue_info("q").unwrap().unacked, 1, "the old epoch's tag settled the new delivery");
    c.shutdown().await;
}

/// `ha-min-synchronised: 3`: with a mirror gone, a publish waits, then is
/// refused (a nack for AMQP); with the mirror back, publishes confirm again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn min_synchronised_refuses_publishes_without_enough_replicas() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    let def = r#"{"ha-mode":"all","ha-sync-mode":"automatic","ha-min-synchronised":3}"#;
    c.node(1).set_policy(policy("^ms", def)).await.unwrap();
    c.node(1).declare_queue("ms-q", vec![]).await.unwrap();
    let master = c.master_of("ms-q").await;
    wait_until(Duration::from_secs(20), "three synchronised replicas", || {
        c.node(master).queue_info("ms-q").unwrap().synchronised.len() == 3
    })
    .await;
    publish_retrying(c.node(master), "ms-q", b"with three".to_vec()).await;

    let mirror = (1..=3).find(|id| *id != master).unwrap();
    c.crash(mirror).await;
    let refused = c.node(master).publish("ms-q", vec![common::msg("with two")]).await;
    assert!(
        matches!(refused, Err(mirrorq::NodeError::Unconfirmed(ref why)) if why.contains("ha-min-synchronised")),
        "a publish was confirmed with two synchronised replicas: {refused:?}"
    );

    c.restart(mirror).await;
    publish_retrying(c.node(master), "ms-q", b"three again".to_vec()).await;
    c.shutdown().await;
}

/// A 2 + 2 partition of a four-replica queue: neither side has a majority,
/// so each re-forms (two epochs) and takes publishes. When the partition
/// heals, the older epoch's side hands back what it took: every message
/// confirmed on either side is delivered afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_sides_of_a_partition_re_form_and_lose_nothing_when_it_heals() {
    init_tracing();
    let c = Cluster::start(4, fast_timing(Duration::from_secs(2))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3, 4]).await.unwrap();
    for i in 0..3 {
        publish_retrying(c.node(1), "q", format!("p{i}").into_bytes()).await;
    }
    let (left, right) = ([1u64, 2], [3u64, 4]);
    tracing::info!("--- partition {{1,2}} | {{3,4}}");
    split(&c, &left, &right, true);
    let (n1, n3) = (c.node(1).clone(), c.node(3).clone());
    let (l, r) = tokio::join!(
        async {
            for i in 0..3 {
                publish_retrying(&n1, "q", format!("left{i}").into_bytes()).await;
            }
        },
        async {
            for i in 0..3 {
                publish_retrying(&n3, "q", format!("right{i}").into_bytes()).await;
            }
        }
    );
    let _ = (l, r);
    assert_ne!(n1.queue_members("q"), n3.queue_members("q"), "each side runs its own epoch");

    tracing::info!("--- heal");
    split(&c, &left, &right, false);
    wait_until(Duration::from_secs(60), "one group of four again", || {
        (1..=4).all(|id| c.node(id).queue_members("q") == Some(BTreeSet::from([1, 2, 3, 4])))
    })
    .await;
    let got = drain(c.node(2), "q").await;
    let distinct: BTreeSet<&str> = got.iter().map(String::as_str).collect();
    let want: BTreeSet<&str> = ["p0", "p1", "p2", "left0", "left1", "left2", "right0", "right1", "right2"].into();
    assert_eq!(distinct, want, "every message confirmed on either side is delivered");
    println!("partition healed: {} deliveries of {} messages", got.len(), want.len());
    c.shutdown().await;
}

/// As above, but each side stores enough entries during the split that its
/// log is compacted past the point where the two histories part, so the
/// logs can no longer tell what the other side shares. The side that heals
/// still hands back only what it stored after the split: what both sides
/// inherited (by the numbers the fork records keep) stays where it is,
/// delivered once, not once per side.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_heal_past_a_compacted_split_hands_back_only_what_came_after_it() {
    init_tracing();
    let c = Cluster::start(4, fast_timing(Duration::from_secs(2))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3, 4]).await.unwrap();
    let before: Vec<String> = (0..200).map(|i| format!("before{i}")).collect();
    c.node(1).publish("q", before.iter().map(|b| common::msg(b.clone().into_bytes())).collect()).await.unwrap();
    // Applied everywhere: what a replica had not applied when it re-formed
    // is counted as its own (the numbers its former gave are not known).
    wait_until(Duration::from_secs(10), "every replica applied them", || {
        (1..=4).all(|id| c.node(id).queue_info("q").unwrap().ready == 200)
    })
    .await;
    let (left, right) = ([1u64, 2], [3u64, 4]);
    split(&c, &left, &right, true);
    // Each side re-formed before it takes publishes: one sent earlier is
    // retried on no answer and may be stored twice on its own side, which
    // is no hand-back's doing.
    let (n1, n3) = (c.node(1).clone(), c.node(3).clone());
    wait_until(Duration::from_secs(30), "each side re-formed the queue", || {
        n1.queue_members("q").is_some_and(|m| !m.contains(&3)) && n3.queue_members("q").is_some_and(|m| !m.contains(&1))
    })
    .await;
    // More than a snapshot's worth of entries on each side (compaction
    // keeps 256 entries behind a snapshot taken every 1024).
    const DURING: usize = 1400;
    tokio::join!(
        async {
            for i in 0..DURING {
                publish_retrying(&n1, "q", format!("left{i}").into_bytes()).await;
            }
        },
        async {
            for i in 0..DURING {
                publish_retrying(&n3, "q", format!("right{i}").into_bytes()).await;
            }
        }
    );
    for n in [&n1, &n3] {
        let raft = n.queue_raft("q").unwrap();
        assert!(raft.metrics().borrow().purged.is_some(), "node {}'s log was not compacted", n.id());
    }
    split(&c, &left, &right, false);
    wait_until(Duration::from_secs(60), "one group of four again", || {
        (1..=4).all(|id| c.node(id).queue_members("q") == Some(BTreeSet::from([1, 2, 3, 4])))
    })
    .await;
    let got = drain(c.node(2), "q").await;
    let mut count: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for m in &got {
        *count.entry(m.as_str()).or_default() += 1;
    }
    let want: BTreeSet<String> =
        before.iter().cloned().chain((0..DURING).flat_map(|i| [format!("left{i}"), format!("right{i}")])).collect();
    let distinct: BTreeSet<String> = count.keys().map(|s| s.to_string()).collect();
    assert_eq!(distinct, want, "every message confirmed on either side is delivered");
    let twice: Vec<&&str> = count.keys().filter(|m| m.starts_with("before") && count[**m] > 1).collect();
    assert!(twice.is_empty(), "{} of the messages both sides inherited were handed back: {twice:?}", twice.len());
    // Both replicas of the side that yields hand back what it stored
    // during the split, each from its stored state (neither log holds the
    // entries any more): the master keeps each message once.
    let twice: Vec<&&str> = count.keys().filter(|m| count[**m] > 1).collect();
    assert!(
        twice.is_empty(),
        "{} messages handed back by both replicas of one side: {:?}",
        twice.len(),
        &twice[..twice.len().min(5)]
    );
    c.shutdown().await;
}

/// A replica that re-formed a queue alone and then crashed comes back in its
/// epoch, as the queue's master, with its messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_re_formed_replica_restarts_as_master_of_its_epoch() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    publish_retrying(c.node(1), "q", b"before".to_vec()).await;
    wait_until(Duration::from_secs(10), "node 3 applied it", || c.node(3).queue_info("q").unwrap().ready == 1).await;
    c.crash(1).await;
    c.crash(2).await;
    publish_retrying(c.node(3), "q", b"alone".to_vec()).await;
    assert_eq!(c.node(3).queue_members("q").unwrap(), BTreeSet::from([3]));
    c.crash(3).await;
    c.restart(3).await;
    let n3 = c.node(3).clone();
    let got = n3.get("q", 1, 10, true).await.expect("served after restart");
    let bodies: Vec<&[u8]> = got.iter().map(|d| d.message.body.as_slice()).collect();
    assert_eq!(bodies, vec![&b"before"[..], &b"alone"[..]]);
    assert_eq!(n3.queue_members("q").unwrap(), BTreeSet::from([3]));
    c.shutdown().await;
}

/// Every node stops at once (a whole-cluster power cut) and node 3 comes
/// back first: its peers' ports refuse, but it never heard from them in
/// this life, so they may only not be up yet. It waits the failure
/// timeout instead of re-forming alone at once, and when the others come
/// back within it the queue goes on in the epoch it had, with no fork.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_node_back_after_a_whole_cluster_stop_does_not_fork_the_queue() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    publish_retrying(c.node(1), "q", b"before".to_vec()).await;
    wait_until(Duration::from_secs(10), "node 3 applied it", || c.node(3).queue_info("q").unwrap().ready == 1).await;
    let epoch = c.node(3).replica_epoch("q");
    // A power cut stops every node at the same instant: none sees another
    // go first. Crashed one after another, the last would see the others'
    // ports refuse and rightly re-form before its own turn came.
    for id in 1..=3 {
        for peer in (1..=3).filter(|p| *p != id) {
            c.node(id).block(peer);
        }
    }
    c.crash(1).await;
    c.crash(2).await;
    c.crash(3).await;
    c.restart(3).await;
    // Well inside the failure timeout (3 s): the dials to 1 and 2 are refused.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(c.node(3).replica_epoch("q"), epoch, "node 3 re-formed the queue alone before hearing from anyone");
    c.restart(1).await;
    c.restart(2).await;
    let got = c.node(3).get("q", 1, 10, true).await.expect("served once the others are back");
    assert_eq!(got.len(), 1);
    assert_eq!(c.node(3).replica_epoch("q"), epoch, "the queue forked");
    assert_eq!(c.node(3).metrics().queue_reforms.get(), 0);
    c.shutdown().await;
}

/// The master is lost before its most senior mirror ever received the
/// queue's log (that mirror was down when the queue was declared and came
/// back after the master died). Knowing no members of the group, it cannot
/// stand for election; the next mirror, synchronised, must not wait on it
/// for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_senior_mirror_without_the_log_does_not_keep_the_queue_without_a_master() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    c.crash(1).await;
    // Node 1 may have led the metadata group: retry while it re-elects.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let q = loop {
        match c.node(3).declare_queue("lost-senior", vec![3, 1, 2]).await {
            Ok(q) => break q,
            Err(e) if std::time::Instant::now() < deadline => {
                tracing::info!(error = %e, "declare retry");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("declare failed: {e}"),
        }
    };
    assert_eq!(q.replicas, vec![3, 1, 2], "node 1 is senior to node 2");
    publish_retrying(c.node(3), "lost-senior", b"kept".to_vec()).await;
    wait_until(Duration::from_secs(10), "node 2 applied it", || {
        c.node(2).queue_info("lost-senior").is_ok_and(|i| i.ready == 1)
    })
    .await;

    tracing::info!("--- the master crashes; the senior mirror comes back with nothing");
    c.crash(3).await;
    c.restart(1).await;
    wait_until(Duration::from_secs(30), "node 2 masters the queue", || c.node(2).is_master("lost-senior")).await;
    let got = c.node(2).get("lost-senior", 1, 10, true).await.unwrap();
    let bodies: Vec<String> = got.into_iter().map(|d| String::from_utf8(d.message.body).unwrap()).collect();
    assert_eq!(bodies, vec!["kept"]);
    c.shutdown().await;
}

/// A replica whose state cannot be read fails to start; the node's other
/// queues must still fail over (the round of starts used to stop at the
/// first failure, before failures were watched).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_that_cannot_start_does_not_keep_the_others_from_failing_over() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    for q in ["bad", "good"] {
        c.node(1).declare_queue(q, vec![1, 2, 3]).await.unwrap();
        publish_retrying(c.node(1), q, format!("{q}0").into_bytes()).await;
    }
    wait_until(Duration::from_secs(10), "node 3 applied both", || {
        ["bad", "good"].iter().all(|q| c.node(3).queue_info(q).is_ok_and(|i| i.ready == 1))
    })
    .await;
    let bad = c.node(3).metadata().queues["bad"].group;
    c.crash(3).await;
    {
        let db = mirrorq_storage::NodeDb::open(&c.configs[2].data_dir, &mirrorq_storage::DbOptions::default()).unwrap();
        mirrorq_storage::SmSpace::new(db.clone(), bad).put(b"_applied", vec![0xff; 3]).unwrap();
    }
    c.restart(3).await;
    c.crash(1).await;
    c.crash(2).await;
    let n3 = c.node(3).clone();
    let got = n3.get("good", 1, 1, true).await.expect("the good queue re-formed on node 3 and served");
    assert_eq!(got[0].message.body, b"good0");
    assert!(n3.queue_info("bad").is_err() || !n3.is_master("bad"), "the unreadable replica never served");
}

/// Publishes refused by `x-overflow: reject-publish` take no seq. A replica
/// of the old group that heals into a newer epoch must still hand back
/// exactly its live messages the new epoch lacks: it used to map entries to
/// seqs by counting publishes, so a refused one shifted the mapping, a live
/// confirmed message (b1) was judged consumed and refused ones came back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_publishes_do_not_shift_what_a_healing_replica_hands_back() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    c.node(1)
        .set_policy(policy("^lim", r#"{"ha-mode":"all","max-length":3,"overflow":"reject-publish"}"#))
        .await
        .unwrap();
    c.node(1).declare_queue("lim", vec![1, 2, 3]).await.unwrap();
    for m in ["a1", "a2"] {
        publish_retrying(c.node(1), "lim", m.as_bytes().to_vec()).await;
    }
    wait_until(Duration::from_secs(10), "node 3 applied both", || {
        c.node(3).queue_info("lim").is_ok_and(|i| i.ready == 2)
    })
    .await;

    tracing::info!("--- node 3 is cut off; 1 and 2 fill the queue past its limit and take a1");
    for id in [1, 2] {
        c.node(id).block(3);
        c.node(3).block(id);
    }
    let n1 = c.node(1).clone();
    publish_retrying(&n1, "lim", b"b1".to_vec()).await;
    for m in ["b2", "b3"] {
        assert!(
            n1.publish("lim", vec![common::msg(m.as_bytes().to_vec())]).await.is_err(),
            "{m} refused: the queue is full"
        );
    }
    let took = n1.get("lim", 1, 1, true).await.unwrap();
    assert_eq!(took[0].message.body, b"a1");
    publish_retrying(&n1, "lim", b"b4".to_vec()).await;
    wait_until(Duration::from_secs(10), "node 2 applied it all", || {
        c.node(2).queue_info("lim").is_ok_and(|i| i.ready == 3)
    })
    .await;

    tracing::info!("--- 1 and 2 crash; node 3 re-forms alone; 1 and 2 return and heal into its epoch");
    c.crash(1).await;
    c.crash(2).await;
    let n3 = c.node(3).clone();
    wait_until(Duration::from_secs(20), "node 3 re-formed", || n3.queue_members("lim") == Some(BTreeSet::from([3])))
        .await;
    c.restart(1).await;
    c.restart(2).await;
    for id in [1, 2] {
        c.node(id).unblock(3);
        n3.unblock(id);
    }
    wait_until(Duration::from_secs(40), "one group again", || {
        (1..=3).all(|id| c.node(id).queue_members("lim") == Some(BTreeSet::from([1, 2, 3])))
    })
    .await;
    let mut all = drain(c.node(2), "lim").await;
    all.sort();
    // a1 was taken on the other side: settled here too when it healed,
    // not delivered again. b1 and b4 were handed back; b2 and b3 never
    // stored.
    assert_eq!(all, vec!["a2", "b1", "b4"]);
    c.shutdown().await;
}

/// A one-way cut: nothing reaches node 2 (the next in seniority), while
/// what it sends still arrives. It hears no master, stands for election and
/// asks the others for their votes with a higher term; but the master still
/// has its majority, so neither the queue nor the metadata may change hands,
/// and publishes keep being confirmed without node 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_way_cut_does_not_unseat_a_healthy_master() {
    init_tracing();
    let c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    publish_retrying(c.node(1), "q", b"before".to_vec()).await;
    assert_eq!(c.master_of("q").await, 1);
    wait_until(Duration::from_secs(10), "all replicas synchronised", || {
        c.node(1).queue_info("q").unwrap().synchronised.len() == 3
    })
    .await;
    let queue_term = c.node(1).queue_raft("q").unwrap().metrics().borrow().current_term;
    let meta = c.node(1).metadata_raft().metrics().borrow().clone();
    let (meta_leader, meta_term) = (meta.current_leader, meta.current_term);
    // What /metrics counts: leaderships won, by the healthy nodes.
    let won = |id: u64| {
        let m = c.node(id).metrics();
        (m.queue_leaderships.get(), m.metadata_leaderships.get())
    };
    let won_before = [won(1), won(3)];

    for id in [1, 3] {
        c.node(id).block(2);
        c.node(2).transport().deafen(&c.configs[id as usize - 1].raft_listen, true);
    }
    // Several election timeouts and the failure timeout, with publishes.
    let until = tokio::time::Instant::now() + Duration::from_secs(6);
    let mut n = 0;
    while tokio::time::Instant::now() < until {
        tokio::time::timeout(Duration::from_secs(5), c.node(3).publish("q", vec![common::msg(format!("m{n}"))]))
            .await
            .expect("a publish during the cut was not confirmed within 5 s")
            .expect("a publish during the cut failed");
        n += 1;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Node 2 did stand for election: the cut was felt.
    let cut_off = c.node(2).queue_raft("q").unwrap().metrics().borrow().clone();
    assert!(cut_off.current_term > queue_term, "node 2 never stood for election: {cut_off:?}");
    let q = c.node(1).queue_raft("q").unwrap().metrics().borrow().clone();
    assert_eq!(q.current_leader, Some(1), "the queue changed master: {q:?}");
    assert_eq!(q.current_term, queue_term, "the queue's master was disturbed (term moved)");
    let m = c.node(1).metadata_raft().metrics().borrow().clone();
    assert_eq!(m.current_leader, meta_leader, "the metadata changed leader: {m:?}");
    assert_eq!(m.current_term, meta_term, "the metadata leader was disturbed (term moved)");
    assert_eq!([won(1), won(3)], won_before, "an election was won during the cut");
    for id in [1, 3] {
        c.node(id).unblock(2);
        c.node(2).transport().deafen(&c.configs[id as usize - 1].raft_listen, false);
    }
    // Healed: node 2 (which re-formed the queue alone, hearing no one)
    // yields to the group that kept its majority, and every confirmed
    // message is there once.
    wait_until(Duration::from_secs(30), "node 2 back under master 1, every replica synchronised", || {
        c.node(2).queue_info("q").ok().and_then(|i| i.leader) == Some(1)
            && c.node(1).queue_info("q").is_ok_and(|i| i.synchronised.len() == 3)
    })
    .await;
    assert_eq!(c.master_of("q").await, 1);
    let mut got = drain(c.node(1), "q").await;
    got.sort();
    // What node 2 took into its fork it could not know committed, and it
    // hands that back: "before" may come twice (a redelivery, as after any
    // split). What was published during the cut never reached it: once.
    let before = got.iter().filter(|m| *m == "before").count();
    assert!((1..=2).contains(&before), "'before' {before} times");
    got.retain(|m| m != "before");
    let mut want: Vec<String> = (0..n).map(|i| format!("m{i}")).collect();
    want.sort();
    assert_eq!(got, want);
    c.shutdown().await;
}

/// A cluster of `n` with queue `q` on every node holding a0..a4, applied
/// by every replica.
async fn five_messages_everywhere(n: u64) -> Cluster {
    init_tracing();
    let c = Cluster::start(n, fast_timing(Duration::from_secs(2))).await;
    c.node(1).declare_queue("q", (1..=n).collect()).await.unwrap();
    for i in 0..5 {
        publish_retrying(c.node(1), "q", format!("a{i}").into_bytes()).await;
    }
    wait_until(Duration::from_secs(10), "every replica applied all", || {
        (1..=n).all(|id| c.node(id).queue_info("q").unwrap().ready == 5)
    })
    .await;
    c
}

/// Node 3 of a three-node cluster is cut off from the others, which
/// confirm `b0` to `queue` through node `via`, and re-forms the queue
/// alone: a minority's fork. Returns node 3.
async fn node_3_forks_alone(c: &Cluster, queue: &str, via: u64) -> mirrorq::Node {
    tracing::info!("--- node 3 is cut off and re-forms alone");
    for id in [1, 2] {
        c.node(id).block(3);
        c.node(3).block(id);
    }
    publish_retrying(c.node(via), queue, b"b0".to_vec()).await;
    let n3 = c.node(3).clone();
    wait_until(Duration::from_secs(30), "node 3 re-formed alone", || {
        n3.queue_members(queue) == Some(BTreeSet::from([3])) && n3.is_master(queue)
    })
    .await;
    n3
}

/// Campaign seed 743. Nodes 4 and 5 are cut off from 1, 2 and 3 and
/// re-form the queue between them (epoch A); then one of them stops and the
/// other re-forms it again alone (epoch B). When the partition heals, B
/// yields to the majority's group, which kept serving all along; when the
/// stopped node comes back, still in A, A must yield as well: it was formed
/// by a minority while the majority kept its group, and it has no master
/// any more. Every message confirmed in A or B is delivered afterwards.
/// `restart_master`: the majority's master is restarted before the stopped
/// node returns, so the master that meets A never watched the split.
async fn a_fork_of_a_fork_yields_too(restart_master: bool) {
    let mut c = five_messages_everywhere(5).await;

    tracing::info!("--- partition {{1,2,3}} | {{4,5}}");
    let (majority, minority) = ([1u64, 2, 3], [4u64, 5]);
    for a in majority {
        for b in minority {
            c.node(a).block(b);
            c.node(b).block(a);
        }
    }
    for i in 0..3 {
        publish_retrying(c.node(1), "q", format!("b{i}").into_bytes()).await;
    }
    wait_until(Duration::from_secs(30), "4 and 5 re-formed the queue between them", || {
        minority.iter().all(|id| c.node(*id).queue_members("q") == Some(BTreeSet::from(minority)))
            && minority.iter().any(|id| c.node(*id).is_master("q"))
    })
    .await;
    let former = *minority.iter().find(|id| c.node(**id).is_master("q")).unwrap();
    let other = if former == 4 { 5 } else { 4 };
    let f = c.node(former).clone();
    publish_retrying(&f, "q", b"c0".to_vec()).await;
    wait_until(Duration::from_secs(10), "the other one has c0", || {
        c.node(other).queue_info("q").is_ok_and(|i| i.applied == f.queue_info("q").unwrap().applied)
    })
    .await;

    tracing::info!(former, other, "--- the other one stops; the former re-forms alone");
    c.crash(other).await;
    wait_until(Duration::from_secs(30), "the former re-formed alone", || {
        f.queue_members("q") == Some(BTreeSet::from([former])) && f.is_master("q")
    })
    .await;
    publish_retrying(&f, "q", b"d0".to_vec()).await;

    tracing::info!("--- the former's cut heals: its epoch yields");
    for a in majority {
        c.node(a).unblock(former);
        f.unblock(a);
    }
    wait_until(Duration::from_secs(40), "the former follows the majority's master", || {
        f.queue_info("q").ok().and_then(|i| i.leader).is_some_and(|l| majority.contains(&l))
    })
    .await;
    if restart_master {
        let m = c.master_of("q").await;
        tracing::info!(m, "--- the majority's master restarts");
        c.crash(m).await;
        c.restart(m).await;
        wait_until(Duration::from_secs(30), "a master again", || {
            (1..=5).filter(|id| *id != other).any(|id| c.node(id).is_master("q"))
        })
        .await;
    }

    tracing::info!("--- the stopped one returns in its old epoch");
    for a in majority {
        c.node(a).unblock(other);
    }
    c.restart(other).await;
    wait_until(Duration::from_secs(60), "one group of five, serving", || {
        (1..=5).all(|id| c.node(id).queue_members("q") == Some(BTreeSet::from([1, 2, 3, 4, 5])))
            && (1..=5).any(|id| c.node(id).is_master("q"))
    })
    .await;
    let m = c.master_of("q").await;
    assert!(majority.contains(&m), "the majority's group keeps the queue, master {m}");
    let got = drain(c.node(m), "q").await;
    let distinct: BTreeSet<&str> = got.iter().map(String::as_str).collect();
    let want: BTreeSet<&str> = ["a0", "a1", "a2", "a3", "a4", "b0", "b1", "b2", "c0", "d0"].into();
    assert_eq!(distinct, want, "every confirmed message is delivered");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_of_a_fork_yields_when_its_last_replica_returns() {
    a_fork_of_a_fork_yields_too(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_of_a_fork_yields_to_a_master_that_never_saw_the_split() {
    a_fork_of_a_fork_yields_too(true).await;
}

/// Campaign seed 743, the restarts after the heal: a mirror of the group
/// that kept its majority restarts while a minority's fork (node 3, cut
/// off, re-formed alone) is still serving, and hears of the fork before it
/// hears its own master. It must not heal into the fork on its own: its
/// master decides for the group, and the fork yields.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_mirror_does_not_heal_alone_into_a_minoritys_fork() {
    let mut c = five_messages_everywhere(3).await;
    let n3 = node_3_forks_alone(&c, "q", 1).await;
    publish_retrying(&n3, "q", b"c0".to_vec()).await;

    tracing::info!("--- node 2 restarts hearing the fork, not yet its master");
    c.node(1).block(2);
    c.crash(2).await;
    n3.unblock(2);
    c.restart(2).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    tracing::info!("--- everything heals");
    c.node(1).unblock(2);
    c.node(1).unblock(3);
    n3.unblock(1);
    wait_until(Duration::from_secs(40), "one group again under master 1", || {
        (1..=3).all(|id| c.node(id).queue_members("q") == Some(BTreeSet::from([1, 2, 3])))
            && (1..=3).all(|id| c.node(id).queue_info("q").ok().and_then(|i| i.leader) == Some(1))
    })
    .await;
    assert_eq!(c.node(2).metrics().queue_rejoins.get(), 0, "node 2 healed into the fork on its own");
    assert_eq!(n3.metrics().queue_rejoins.get(), 1, "the fork yielded once");
    let got = drain(c.node(1), "q").await;
    let distinct: BTreeSet<&str> = got.iter().map(String::as_str).collect();
    assert_eq!(distinct, ["a0", "a1", "a2", "a3", "a4", "b0", "c0"].into(), "every confirmed message is delivered");
    c.shutdown().await;
}

/// Campaign seed 1168. Node 3 is cut off and re-forms the queue alone: a
/// minority's fork, whose members are node 3 alone. The majority (master
/// 2, mirror 1) confirms a message. A policy then moves the queue off node
/// 1, and node 1 asks the replicas that stay whether the change excluding
/// it is in effect; it can reach node 3, whose fork answers for its own
/// membership. Node 1 deleted its replica on that word (the majority's
/// epoch was left with node 2 alone, and in the campaign the message
/// confirmed by 1 and 2 was never delivered): only a replica of its own
/// epoch may tell it it was moved away.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_moved_away_is_not_told_so_by_a_minoritys_fork() {
    init_tracing();
    let c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    let all = r#"{"ha-mode":"all","queue-master-locator":"client-local"}"#;
    c.node(2).set_policy(policy("^mv", all)).await.unwrap();
    c.node(2).declare_queue("mv.q", vec![]).await.unwrap();
    publish_retrying(c.node(2), "mv.q", b"a0".to_vec()).await;
    wait_until(Duration::from_secs(10), "every replica applied it", || {
        (1..=3).all(|id| c.node(id).queue_info("mv.q").is_ok_and(|i| i.ready == 1))
    })
    .await;
    assert!(c.node(2).is_master("mv.q"));
    node_3_forks_alone(&c, "mv.q", 2).await;
    tracing::info!("--- the queue moves off node 1; node 1 can reach the fork, nobody else can");
    let off_1 = r#"{"ha-mode":"nodes","ha-params":["mirrorq@2","mirrorq@3"],"queue-master-locator":"client-local"}"#;
    c.node(2).set_policy(policy("^mv", off_1)).await.unwrap();
    wait_until(Duration::from_secs(10), "node 1 sees the move", || {
        c.node(1).metadata().queues.get("mv.q").is_some_and(|q| !q.replicas.contains(&1))
    })
    .await;
    c.node(1).unblock(3);
    // Many reconciler rounds, each asking the replicas that stay.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(
        c.node(1).queue_members("mv.q").is_some(),
        "node 1 deleted its replica of the majority's epoch on the word of a minority's fork"
    );
    assert_eq!(c.node(1).queue_info("mv.q").unwrap().ready, 2, "node 1 holds both confirmed messages");
    c.shutdown().await;
}

/// Campaign seed 1211. Node 4, cut off from 1, 2 and 3, re-forms the queue
/// alone (epoch E). Node 5, cut off from them too, heals into E but gets
/// nothing of it: node 4 cannot reach it. Node 4's cut heals, and E yields
/// to the majority's group, whose master then crashes: the new master never
/// judged E. When node 5 returns, the only replica of E left is node 5's,
/// which has no record of when E formed and no master. The group that kept
/// its majority must still have it yield; in the campaign it waited for a
/// record no one had, and node 5's replica stayed stranded in E.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_left_alone_in_a_yielded_fork_without_its_record_yields_too() {
    let mut c = five_messages_everywhere(5).await;
    let majority = [1u64, 2, 3];
    tracing::info!("--- partition {{1,2,3}} | {{4,5}}; node 4 cannot reach node 5 either");
    for a in majority {
        for b in [4, 5] {
            c.node(a).block(b);
            c.node(b).block(a);
        }
    }
    c.node(4).block(5);
    publish_retrying(c.node(1), "q", b"b0".to_vec()).await;
    let (n4, n5) = (c.node(4).clone(), c.node(5).clone());
    wait_until(Duration::from_secs(30), "node 4 re-formed alone", || {
        n4.queue_members("q") == Some(BTreeSet::from([4])) && n4.is_master("q")
    })
    .await;
    let fork = n4.replica_epoch("q").unwrap();
    publish_retrying(&n4, "q", b"c0".to_vec()).await;
    wait_until(Duration::from_secs(30), "node 5 healed into node 4's epoch", || n5.replica_epoch("q") == Some(fork))
        .await;
    assert_eq!(n5.local_stored_count("q").unwrap(), 0, "node 5 got nothing from the fork's master");

    tracing::info!("--- node 4's cut heals: its epoch yields");
    for a in majority {
        c.node(a).unblock(4);
        n4.unblock(a);
    }
    wait_until(Duration::from_secs(40), "node 4 follows the majority's master", || {
        n4.replica_epoch("q") != Some(fork)
            && n4.queue_info("q").ok().and_then(|i| i.leader).is_some_and(|l| majority.contains(&l))
    })
    .await;
    // Node 4 a voter again, the change complete (no joint configuration):
    // without node 1, four of five voters are alive and elect a master,
    // where fewer would re-form the queue into an epoch newer than the fork.
    wait_until(Duration::from_secs(20), "node 4 is a voter again", || {
        majority.iter().all(|id| {
            c.node(*id).queue_raft("q").is_some_and(|r| {
                let m = r.metrics().borrow().membership_config.membership().clone();
                m.get_joint_config() == &vec![BTreeSet::from([1, 2, 3, 4, 5])]
            })
        })
    })
    .await;
    let judge = c.master_of("q").await;
    tracing::info!(judge, "--- the master that judged the fork crashes");
    c.crash(judge).await;
    let others: Vec<u64> = [1, 2, 3, 4].into_iter().filter(|id| *id != judge).collect();
    wait_until(Duration::from_secs(30), "a master among the others", || {
        others.iter().any(|id| c.node(*id).is_master("q"))
    })
    .await;

    tracing::info!("--- node 5's cut heals");
    for a in &others {
        c.node(*a).unblock(5);
        n5.unblock(*a);
    }
    wait_until(Duration::from_secs(40), "node 5 left the fork and follows the group's master", || {
        n5.replica_epoch("q") != Some(fork)
            && n5.queue_info("q").ok().and_then(|i| i.leader).is_some_and(|l| others.contains(&l))
    })
    .await;
    n5.unblock(judge);
    c.restart(judge).await;
    wait_until(Duration::from_secs(60), "one group of five, serving", || {
        (1..=5).all(|id| c.node(id).queue_members("q") == Some(BTreeSet::from([1, 2, 3, 4, 5])))
            && (1..=5).any(|id| c.node(id).is_master("q"))
    })
    .await;
    let m = c.master_of("q").await;
    let got = drain(c.node(m), "q").await;
    let distinct: BTreeSet<&str> = got.iter().map(String::as_str).collect();
    let want: BTreeSet<&str> = ["a0", "a1", "a2", "a3", "a4", "b0", "c0"].into();
    assert_eq!(distinct, want, "every confirmed message is delivered");
    c.shutdown().await;
}

/// Audit of the seed-1211 fix: node 3, cut off, re-forms the queue alone,
/// and stops before the entry carrying the fork's record commits (the
/// test takes the record out of its state instead: the entry stays in
/// its log, already applied). When the cut heals, the majority's master
/// asks when the fork formed. Without the record kept beside the log,
/// node 3 could only answer that it masters the fork, and the master
/// waited for a record no one had while both epochs served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_whose_record_entry_never_committed_still_yields() {
    let c = five_messages_everywhere(3).await;
    let n3 = node_3_forks_alone(&c, "q", 1).await;
    let fork = n3.replica_epoch("q").unwrap();
    publish_retrying(&n3, "q", b"c0".to_vec()).await;
    n3.forget_fork_record("q").unwrap();

    tracing::info!("--- the cut heals");
    for id in [1, 2] {
        c.node(id).unblock(3);
        n3.unblock(id);
    }
    wait_until(Duration::from_secs(40), "node 3 left its fork and follows the majority's master", || {
        n3.replica_epoch("q") != Some(fork)
            && n3.queue_info("q").ok().and_then(|i| i.leader).is_some_and(|l| l == 1 || l == 2)
    })
    .await;
    wait_until(Duration::from_secs(40), "one group of three", || {
        (1..=3).all(|id| c.node(id).queue_members("q") == Some(BTreeSet::from([1, 2, 3])))
    })
    .await;
    let m = c.master_of("q").await;
    let got = drain(c.node(m), "q").await;
    let distinct: BTreeSet<&str> = got.iter().map(String::as_str).collect();
    assert_eq!(distinct, ["a0", "a1", "a2", "a3", "a4", "b0", "c0"].into(), "every confirmed message is delivered");
    c.shutdown().await;
}

/// This node's replica of `queue`, if it runs; a replica whose core
/// stopped (quit on an error, or panicked) fails the test at once.
fn replica_running(node: &mirrorq::Node, queue: &str) -> bool {
    let Some(raft) = node.queue_raft(queue) else { return false };
    let rx = raft.metrics();
    assert!(rx.has_changed().is_ok(), "node {}'s replica of {queue} stopped: its core is gone", node.id());
    if let Err(e) = &rx.borrow().running_state {
        panic!("node {}'s replica of {queue} stopped: {e}", node.id());
    }
    true
}

/// Campaign seed 1168, second half. Node 1 deleted its replica while it was
/// still a voter (`Inner::drop_replica`), and its reconciler started the
/// replica again, blank, in the same group and epoch, while the master
/// (node 2), whose log no longer began at 0, still held node 1 as matched
/// far along. openraft 0.9's leader does not expect a follower's log to go
/// back: a debug build panics in the master's core; a release build's
/// search for the match point wrapped around and sent the blank replica
/// `prev_log_id: None` with the entries from the master's first kept one,
/// which the replica took as its log with a hole from index 0: its core
/// quit at the first apply ("try to get log at index 0 but got Some(..)"),
/// never started again, and the group, whose membership needed node 1,
/// was wedged. The master must fill the blank replica instead (snapshot,
/// then entries): no replica's core stops, every confirmed message is on
/// every replica, and the replica starts again after a crash.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_voter_wiped_and_started_blank_is_filled_by_its_master() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    let all = r#"{"ha-mode":"all","queue-master-locator":"client-local"}"#;
    c.node(2).set_policy(policy("^bv", all)).await.unwrap();
    c.node(2).declare_queue("bv.q", vec![]).await.unwrap();
    let mut sent = BTreeSet::new();
    // Publish on node 2 until confirmed; every replica's core must stay up.
    async fn publish(c: &Cluster, sent: &mut BTreeSet<String>, body: String) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            match c.node(2).publish("bv.q", vec![common::msg(body.clone())]).await {
                Ok(()) => break,
                Err(e @ (mirrorq::NodeError::Unconfirmed(_) | mirrorq::NodeError::Unavailable(_))) => {
                    for id in 1..=3 {
                        replica_running(c.node(id), "bv.q");
                    }
                    assert!(std::time::Instant::now() < deadline, "never confirmed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(e) => panic!("publish failed: {e}"),
            }
        }
        sent.insert(body);
    }
    let holds = |c: &Cluster, id: u64, n: usize| {
        replica_running(c.node(id), "bv.q")
            && c.node(id).queue_info("bv.q").is_ok_and(|i| i.ready == n as u64)
            && c.node(id).local_stored_count("bv.q").is_ok_and(|s| s == n)
    };
    for i in 0..20 {
        publish(&c, &mut sent, format!("a{i}")).await;
    }
    assert!(c.node(2).is_master("bv.q"));
    wait_until(Duration::from_secs(10), "every replica holds the first messages", || {
        (1..=3).all(|id| holds(&c, id, sent.len()))
    })
    .await;

    tracing::info!("--- the master snapshots and purges its log: it no longer starts at 0");
    let raft = c.node(2).queue_raft("bv.q").unwrap();
    let applied = raft.metrics().borrow().last_applied.unwrap().index;
    raft.trigger().snapshot().await.unwrap();
    let limit = Some(Duration::from_secs(10));
    raft.wait(limit).metrics(|m| m.snapshot.is_some_and(|s| s.index >= applied), "snapshot").await.unwrap();
    raft.trigger().purge_log(applied).await.unwrap();
    raft.wait(limit).metrics(|m| m.purged.is_some_and(|p| p.index >= applied), "purged").await.unwrap();
    for i in 0..5 {
        publish(&c, &mut sent, format!("b{i}")).await;
    }
    wait_until(Duration::from_secs(10), "node 1 holds them too", || holds(&c, 1, sent.len())).await;

    tracing::info!("--- node 1's replica is wiped while it is a voter; the master goes on");
    c.node(1).wipe_replica("bv.q").await.unwrap();
    for i in 0..5 {
        publish(&c, &mut sent, format!("c{i}")).await;
    }
    wait_until(Duration::from_secs(30), "node 1's blank replica is filled by the master", || {
        (1..=3).all(|id| holds(&c, id, sent.len()))
    })
    .await;
    assert_eq!(c.node(2).queue_members("bv.q"), Some(BTreeSet::from([1, 2, 3])));
    publish(&c, &mut sent, "d0".into()).await;

    tracing::info!("--- node 1 crashes and restarts: its replica starts again");
    c.crash(1).await;
    c.restart(1).await;
    wait_until(Duration::from_secs(30), "every replica holds every message after the restart", || {
        (1..=3).all(|id| holds(&c, id, sent.len()))
    })
    .await;
    let got: BTreeSet<String> = drain(c.node(2), "bv.q").await.into_iter().collect();
    assert_eq!(got, sent, "every confirmed message is delivered");
    c.shutdown().await;
}

/// A founder whose replica is lost while it still leads its group's first
/// term (its data dir emptied or replaced, the group declared before its
/// life began) does not found the group again: it would lead term 1 once
/// more holding nothing, and its followers, which hold the group's messages
/// at the same indexes, would take it for the same master. It asks the
/// other replicas, finds the group held there, and starts blank; another
/// master is elected and fills it, and no confirmed message is lost. The
/// hook stands for the life boundary: every queue counts as declared
/// before this life.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_founder_that_lost_its_replica_does_not_found_its_group_again() {
    init_tracing();
    let c = Cluster::start(3, fast_timing(Duration::from_secs(60))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    for i in 0..3 {
        publish_retrying(c.node(1), "q", format!("m{i}").into_bytes()).await;
    }
    let raft = c.node(1).queue_raft("q").unwrap();
    assert_eq!(raft.metrics().borrow().current_term, 1, "the founder still leads its first term");
    // Quiet: its followers hold their timers while node 1 announces it, as
    // they would while a re-founded master led them.
    wait_until(Duration::from_secs(15), "the group goes quiet", || c.node(1).is_quiet_here("q")).await;
    wait_until(Duration::from_secs(10), "node 1 knows its life's first group", || c.node(1).founding_floor().is_some())
        .await;
    c.node(1).forget_founding_floor();
    c.node(1).wipe_replica("q").await.unwrap();
    wait_until(Duration::from_secs(30), "node 1's replica holds the three messages again", || {
        c.node(1).local_stored_count("q").is_ok_and(|n| n == 3)
    })
    .await;
    assert_ne!(c.master_of("q").await, 1, "the blank founder leads");
    assert_eq!(c.node(2).status("q").await.unwrap().0, 3, "the queue lost messages");
    c.shutdown().await;
}

/// A node's life knows which queues were declared before it began, also
/// on an emptied data dir, where it learns them from the metadata leader
/// after it started: every queue declared until then is at or below its
/// floor, and one declared afterwards above it (founded without asking).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_back_on_an_empty_data_dir_counts_the_queues_declared_before_its_life() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(60))).await;
    for i in 0..20 {
        c.node(2).declare_queue(&format!("old{i}"), vec![2, 3]).await.unwrap();
    }
    let old = c.node(2).queue_info("old19").unwrap().group;
    c.crash(1).await;
    let dir = c.dirs[0].path().to_path_buf();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            std::fs::remove_dir_all(&path).unwrap();
        } else {
            std::fs::remove_file(&path).unwrap();
        }
    }
    c.restart(1).await;
    wait_until(Duration::from_secs(20), "node 1 knows its life's first group", || c.node(1).founding_floor().is_some())
        .await;
    let floor = c.node(1).founding_floor().unwrap();
    assert!(old <= floor, "queue group {old} declared before the restart, above the floor {floor}");
    c.node(2).declare_queue("new", vec![1, 2, 3]).await.unwrap();
    assert!(c.node(1).queue_info("new").unwrap().group > floor);
    c.shutdown().await;
}
