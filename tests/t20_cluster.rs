//! In-process three-node clusters over real loopback TCP with real fsync'd
//! storage: confirms, failover, and the slowest-replica rule.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{fast_timing, init_tracing, msg, publish_retrying, wait_until, Cluster};

fn bodies(msgs: &[mirrorq::Message]) -> BTreeSet<Vec<u8>> {
    msgs.iter().map(|m| m.body.clone()).collect()
}

/// Three nodes and a three-replica queue `q` whose master has confirmed one
/// message: the cluster, the master and the two mirrors.
async fn cluster_with_queue(q: &str) -> (Cluster, u64, Vec<u64>) {
    let c = Cluster::start(3, fast_timing(Duration::from_secs(60))).await;
    c.node(1).declare_queue(q, vec![1, 2, 3]).await.unwrap();
    c.node(1).publish(q, vec![msg("warm-up")]).await.unwrap();
    let master = c.master_of(q).await;
    let mirrors = (1..=3).filter(|id| *id != master).collect();
    (c, master, mirrors)
}

/// Whether `node`'s replica of `queue` comes to hold `body` within 2 s.
async fn comes_to_hold(node: &mirrorq::Node, queue: &str, body: &[u8]) -> bool {
    for _ in 0..100 {
        if bodies(&node.local_messages(queue).await.unwrap()).contains(body) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

/// Hold `node`'s disk syncs and publish "a" and "b" to `queue`, each in an
/// entry of its own: both of the master's in-flight slots are taken and
/// whatever comes next waits in its proposer until the guard drops. The
/// publishes' confirms come after that.
async fn fill_the_slots(
    node: &mirrorq::Node,
    queue: &str,
) -> (
    mirrorq_storage::flusher::SyncsHeld,
    Vec<tokio::task::JoinHandle<Result<Vec<mirrorq::QueueReply>, mirrorq::NodeError>>>,
) {
    let raft = node.queue_raft(queue).unwrap();
    let last = || raft.metrics().borrow().last_log_index.unwrap_or(0);
    let held = node.db().flusher().hold_syncs();
    let mut confirms = Vec::new();
    for body in ["a", "b"] {
        let before = last();
        let started = node.submit(queue, vec![mirrorq::QueueCmd::Enqueue { msgs: vec![msg(body)] }]).await.unwrap();
        confirms.push(tokio::spawn(started));
        wait_until(Duration::from_secs(5), "the publish is in an entry", || last() > before).await;
    }
    (held, confirms)
}

/// The bodies of what a get delivered.
fn delivered(deliveries: &[mirrorq::Delivery]) -> BTreeSet<Vec<u8>> {
    deliveries.iter().map(|d| d.message.body.clone()).collect()
}

/// Every confirmed publish is on the disk of all three replicas at the moment
/// its confirm arrives, and ends up in every replica's applied state.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn confirmed_messages_are_on_every_replica() {
    init_tracing();
    let c = Cluster::start(3, fast_timing(Duration::from_secs(30))).await;
    tracing::info!("--- declare a 3-replica queue from node 2");
    let q = c.node(2).declare_queue("q1", vec![1, 2, 3]).await.unwrap();
    assert_eq!(q.replicas, vec![1, 2, 3]);

    tracing::info!("--- 20 concurrent publishers x 10 confirmed messages, through every node");
    let mut tasks = Vec::new();
    for p in 0..20u32 {
        let node = c.node(1 + (p as u64 % 3)).clone();
        let replicas: Vec<_> = (1..=3).map(|id| c.node(id).clone()).collect();
        tasks.push(tokio::spawn(async move {
            for i in 0..10u32 {
                let body = format!("p{p}-m{i}").into_bytes();
                common::publish_retrying(&node, "q1", body.clone()).await;
                // Confirmed: every replica's disk must hold it right now.
                for r in &replicas {
                    let held = bodies(&r.local_messages("q1").await.unwrap());
                    assert!(held.contains(&body), "node {} lacks a confirmed message", r.id());
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }

    tracing::info!("--- every replica applies all 200 (more only if a resend duplicated one)");
    let (total, unacked) = c.node(3).status("q1").await.unwrap();
    assert!(total >= 200 && unacked == 0, "{total} {unacked}");
    for id in 1..=3 {
        let node = c.node(id).clone();
        wait_until(Duration::from_secs(10), "replica applied everything", || {
            node.queue_info("q1").unwrap().ready == total
        })
        .await;
    }
    c.shutdown().await;
}

/// Kill the master's node abruptly: a mirror takes over, publishing goes on
/// through the survivors, and every confirmed message is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn master_crash_loses_no_confirmed_message() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(1))).await;
    c.node(1).declare_queue("q2", vec![1, 2, 3]).await.unwrap();
    let mut confirmed = BTreeSet::new();
    for i in 0..100 {
        let b = format!("before-{i}").into_bytes();
        common::publish_retrying(c.node(1), "q2", b.clone()).await;
        confirmed.insert(b);
    }
    let master = c.master_of("q2").await;
    tracing::info!(master, "--- crash the master");
    c.crash(master).await;
    let survivor = (1..=3).find(|id| *id != master).unwrap();

    tracing::info!("--- keep publishing through a survivor");
    for i in 0..100 {
        let b = format!("after-{i}").into_bytes();
        // A publisher resends until confirmed (outcome unknown after a
        // leadership change or a connection lost mid-call).
        common::publish_retrying(c.node(survivor), "q2", b.clone()).await;
        confirmed.insert(b);
    }
    let new_master = c.master_of("q2").await;
    assert_ne!(new_master, master);

    tracing::info!("--- drain: every confirmed message is there");
    let got = c.node(survivor).get("q2", 1, 1000, true).await.unwrap();
    let got_bodies = bodies(&got.iter().map(|d| d.message.clone()).collect::<Vec<_>>());
    let missing: Vec<_> = confirmed.difference(&got_bodies).collect();
    assert!(missing.is_empty(), "{} confirmed messages lost", missing.len());

    tracing::info!("--- the crashed node comes back and catches up");
    c.restart(master).await;
    let back = c.node(master).clone();
    let mut last = None;
    let caught_up = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let info = back.queue_info("q2");
            if matches!(&info, Ok(i) if i.ready == 0 && i.applied.is_some() && i.leader.is_some()) {
                return;
            }
            last = Some(info);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    if caught_up.is_err() {
        let lm = c.node(c.master_of("q2").await).queue_raft("q2").unwrap().metrics().borrow().clone();
        let bm = back.queue_raft("q2").unwrap().metrics().borrow().clone();
        panic!("restarted replica did not catch up: {last:?}; leader: {lm:?}; restarted: {bm:?}");
    }
    c.shutdown().await;
}

/// A confirm waits for the slowest synchronised replica: with the master's
/// traffic to one mirror held back, the entry commits on a majority but the
/// confirm does not fire until that mirror has it on disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn confirm_waits_for_the_slowest_replica() {
    init_tracing();
    let (c, master, mirrors) = cluster_with_queue("q3").await;
    let (slow, fast) = (mirrors[0], mirrors[1]);

    tracing::info!(master, slow, "--- hold the master's traffic to one mirror");
    c.node(master).block(slow);
    let publisher = {
        let node = c.node(master).clone();
        tokio::spawn(async move { node.publish("q3", vec![msg("held")]).await })
    };
    // Committed on the majority (master + fast mirror)...
    assert!(comes_to_hold(c.node(fast), "q3", b"held").await, "the fast mirror never got the entry");
    // Time in which a confirm that did not wait for the slow mirror would fire.
    tokio::time::sleep(Duration::from_secs(1)).await;
    // ...but not confirmed: the slow mirror does not have it.
    assert!(!publisher.is_finished(), "confirm fired before the slow mirror had the message");
    assert!(!bodies(&c.node(slow).local_messages("q3").await.unwrap()).contains(b"held".as_slice()));

    tracing::info!("--- release: the confirm follows the slow mirror's fsync");
    c.node(master).unblock(slow);
    tokio::time::timeout(Duration::from_secs(10), publisher).await.expect("confirm after release").unwrap().unwrap();
    assert!(bodies(&c.node(slow).local_messages("q3").await.unwrap()).contains(b"held".as_slice()));
    c.shutdown().await;
}

/// The master's own fsync runs in parallel with its mirrors' (the patched
/// openraft core replicates an entry before the leader's write of it is
/// durable), and a confirm still waits for the master's disk as well: with
/// the master's syncs held, both mirrors get the entry onto their disks and
/// it commits on them, but no confirm fires until the master's sync is let go.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mirrors_sync_an_entry_while_the_master_syncs_it_and_the_confirm_waits_for_all_three() {
    init_tracing();
    let (c, master, mirrors) = cluster_with_queue("q4").await;
    let raft = c.node(master).queue_raft("q4").unwrap();
    let last = raft.metrics().borrow().last_log_index;
    let matched = |id: u64| {
        let m = raft.metrics().borrow().clone();
        m.replication.as_ref().and_then(|r| r.get(&id).cloned().flatten()).map(|l| l.index)
    };

    tracing::info!(master, "--- hold the master's disk syncs, publish one message");
    let held = c.node(master).db().flusher().hold_syncs();
    let publisher = {
        let node = c.node(master).clone();
        tokio::spawn(async move { node.publish("q4", vec![msg("held")]).await })
    };
    // A mirror answers an append only once it is on its disk, so `matched`
    // past `last` means durable there. Without replication in parallel with
    // the master's own write this never happens while the master's sync waits.
    wait_until(Duration::from_secs(10), "both mirrors have the entry on disk", || {
        mirrors.iter().all(|id| matched(*id) > last)
    })
    .await;
    for id in &mirrors {
        let applied = comes_to_hold(c.node(*id), "q4", b"held").await;
        assert!(applied, "mirror {id} never applied the entry its majority committed");
    }
    // Time in which a confirm that did not wait for the master's disk would fire.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(matched(master), last, "the master counted its own copy before its sync");
    assert!(!publisher.is_finished(), "confirm fired before the master's copy was on its disk");

    tracing::info!("--- let the master sync: the confirm follows");
    drop(held);
    tokio::time::timeout(Duration::from_secs(10), publisher).await.expect("confirm after release").unwrap().unwrap();
    assert!(matched(master) > last);
    c.shutdown().await;
}

/// A consumer's get goes into the master's next entry ahead of publishes
/// already waiting for one, while a plain get (AMQP `basic.get`) keeps its
/// place behind them. With two entries stuck in flight (the master's syncs
/// held), five publishes are queued at the master, then a consumer get and
/// a plain get: the consumer get takes only what was published before
/// them, the plain get what the five published.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumers_get_goes_ahead_of_publishes_waiting_at_the_master() {
    init_tracing();
    let (c, master, _) = cluster_with_queue("q-lane").await;
    let node = c.node(master).clone();
    let (held, mut confirms) = fill_the_slots(&node, "q-lane").await;
    // Five more wait at the master for a slot, in arrival order.
    for i in 0..5 {
        let cmds = vec![mirrorq::QueueCmd::Enqueue { msgs: vec![msg(format!("c{i}"))] }];
        confirms.push(tokio::spawn(node.submit("q-lane", cmds).await.unwrap()));
    }
    let consumer = {
        let node = node.clone();
        tokio::spawn(async move { node.consumer_fetch("q-lane", 7, 100, false, None).await })
    };
    // Started after the consumer get (it is in the proposer when this one is).
    // What waits in a proposer cannot be seen from outside: the spawned get
    // is given time to get there.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let plain = {
        let node = node.clone();
        tokio::spawn(async move { node.fetch("q-lane", 8, 100, false).await })
    };
    // Likewise for the plain get, before the slots free up.
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(held);

    for confirm in confirms {
        tokio::time::timeout(Duration::from_secs(10), confirm).await.expect("confirmed").unwrap().unwrap();
    }
    let got = delivered(&consumer.await.unwrap().unwrap().0);
    let want: BTreeSet<Vec<u8>> = ["warm-up", "a", "b"].iter().map(|b| b.as_bytes().to_vec()).collect();
    assert_eq!(got, want, "the consumer get waited behind publishes queued before it");
    let plain = delivered(&plain.await.unwrap().unwrap().0);
    let five: BTreeSet<Vec<u8>> = (0..5).map(|i| format!("c{i}").into_bytes()).collect();
    assert_eq!(plain, five, "a plain get must see the publishes queued before it");
    c.shutdown().await;
}

/// The consumer lane takes at most half an entry: with more consumer gets
/// waiting than that, a publish queued behind them still goes into the next
/// entry, and a get of the entry after it takes its message.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn publishes_go_on_behind_a_flood_of_consumer_gets() {
    init_tracing();
    let (c, master, _) = cluster_with_queue("q-flood").await;
    let node = c.node(master).clone();
    let (held, _confirms) = fill_the_slots(&node, "q-flood").await;
    // More consumer gets than half an entry's 4,096 commands.
    let gets: Vec<_> = (0..2100u64)
        .map(|owner| {
            let node = node.clone();
            tokio::spawn(async move { node.consumer_fetch("q-flood", owner, 1, false, None).await })
        })
        .collect();
    // Time for the spawned gets to reach the proposer (not visible from outside).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let publish = node.submit("q-flood", vec![mirrorq::QueueCmd::Enqueue { msgs: vec![msg("late")] }]).await.unwrap();
    // The publish is queued once its submit returns; this is more time for
    // the 2,100 gets (still not visible from outside).
    tokio::time::sleep(Duration::from_millis(200)).await;
    drop(held);

    tokio::time::timeout(Duration::from_secs(20), publish).await.expect("confirmed").unwrap();
    let mut got = BTreeSet::new();
    for g in gets {
        let (msgs, _) = tokio::time::timeout(Duration::from_secs(20), g).await.expect("answered").unwrap().unwrap();
        got.extend(msgs.into_iter().map(|d| d.message.body));
    }
    let want: BTreeSet<Vec<u8>> = ["warm-up", "a", "b", "late"].iter().map(|b| b.as_bytes().to_vec()).collect();
    assert_eq!(got, want, "the publish waited behind every consumer get");
    c.shutdown().await;
}

/// With one message in flight a mirror is sent one AppendEntries per
/// message: the new commit index rides on the next entry (or the next
/// heartbeat) instead of a round trip of its own, which the next entry
/// would wait behind. A mirror that is sent nothing more still learns the
/// last commit and applies it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_mirror_is_sent_one_append_per_entry_and_still_learns_the_last_commit() {
    init_tracing();
    let (c, master, mirrors) = cluster_with_queue("q9").await;
    let heartbeat = fast_timing(Duration::from_secs(60)).heartbeat;
    let received = |id: u64| c.node(id).metrics().appends_received.get();
    let before: Vec<u64> = mirrors.iter().map(|id| received(*id)).collect();
    let started = std::time::Instant::now();
    const N: u64 = 40;
    for i in 0..N {
        c.node(master).publish("q9", vec![msg(format!("m{i}"))]).await.unwrap();
    }
    let elapsed = started.elapsed();
    // Heartbeats of both groups (metadata and q9) may come on top.
    let heartbeats = 2 * (elapsed.as_millis() as u64 / heartbeat.as_millis() as u64 + 2);
    for (id, before) in mirrors.iter().zip(before) {
        let got = received(*id) - before;
        assert!(
            got >= N && got <= N + heartbeats,
            "mirror {id} was sent {got} appends for {N} entries in {elapsed:?} (a commit round trip each: about {})",
            2 * N
        );
    }
    let last = c.node(master).queue_raft("q9").unwrap().metrics().borrow().last_log_index;
    for id in &mirrors {
        let raft = c.node(*id).queue_raft("q9").unwrap();
        wait_until(Duration::from_secs(5), "the mirror applies the last entry", || {
            raft.metrics().borrow().last_applied.map(|l| l.index) >= last
        })
        .await;
    }
    c.shutdown().await;
}

/// A mirror that stays unreachable longer than the sync timeout stops
/// counting as synchronised, so confirms go on without it; once reachable
/// again it catches up and is synchronised again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unreachable_mirror_leaves_and_rejoins_the_synchronised_set() {
    init_tracing();
    let c = Cluster::start(3, fast_timing(Duration::from_millis(1500))).await;
    c.node(1).declare_queue("q4", vec![1, 2, 3]).await.unwrap();
    c.node(1).publish("q4", vec![msg("a")]).await.unwrap();
    let master = c.master_of("q4").await;
    let slow = (1..=3).find(|id| *id != master).unwrap();
    c.node(master).block(slow);
    tracing::info!("--- publishes complete once the blocked mirror times out");
    tokio::time::timeout(Duration::from_secs(10), c.node(master).publish("q4", vec![msg("b")]))
        .await
        .expect("confirm within the sync timeout")
        .unwrap();
    let info = c.node(master).queue_info("q4").unwrap();
    assert!(!info.synchronised.contains(&slow), "blocked mirror still counted: {info:?}");
    assert_eq!(info.synchronised.len(), 2);

    c.node(master).unblock(slow);
    let m = c.node(master).clone();
    wait_until(Duration::from_secs(10), "mirror synchronised again", || {
        m.queue_info("q4").unwrap().synchronised.contains(&slow)
    })
    .await;
    assert!(bodies(&c.node(slow).local_messages("q4").await.unwrap()).contains(b"b".as_slice()));
    c.shutdown().await;
}

/// A holder (an AMQP channel, here a stand-in) that knows of none of the
/// deliveries made to it, or of all of them.
struct Holder(bool);
impl mirrorq::owners::Holder for Holder {
    fn unknown(&self, _queue: &str, qtags: &[u64]) -> Vec<u64> {
        if self.0 {
            Vec::new()
        } else {
            qtags.to_vec()
        }
    }
}

/// Knows every delivery of one queue and none of any other.
struct KnowsOnly(&'static str);
impl mirrorq::owners::Holder for KnowsOnly {
    fn unknown(&self, queue: &str, qtags: &[u64]) -> Vec<u64> {
        if queue == self.0 {
            Vec::new()
        } else {
            qtags.to_vec()
        }
    }
}

/// One channel holds deliveries of three queues with the same master, the
/// same delivery tags in each: only those of the two queues it never got
/// come back, and those of the third stay held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stranded_deliveries_are_told_apart_by_queue() {
    init_tracing();
    let c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    let queues = ["known", "stranded-a", "stranded-b"];
    for q in queues {
        c.node(1).declare_queue(q, vec![1, 2, 3]).await.unwrap();
        for i in 0..3 {
            publish_retrying(c.node(1), q, format!("{q}{i}").into_bytes()).await;
        }
    }
    let n2 = c.node(2).clone();
    let owner = n2.owners().new_owner_held(std::sync::Arc::new(KnowsOnly("known")));
    for q in queues {
        assert_eq!(n2.get(q, owner, 3, false).await.unwrap().len(), 3);
    }
    wait_until(Duration::from_secs(20), "the six never got are ready again", || {
        ["stranded-a", "stranded-b"]
            .iter()
            .all(|q| c.node(1).queue_info(q).is_ok_and(|i| i.ready == 3 && i.unacked == 0))
    })
    .await;
    let i = c.node(1).queue_info("known").unwrap();
    assert_eq!((i.ready, i.unacked), (0, 3), "deliveries the holder knows were requeued");
    c.shutdown().await;
}

/// A get served by a master that stopped before its answer got through
/// leaves its messages recorded under a live owner whose channel never saw
/// them. The master finds such deliveries (the owner's node says its holder
/// does not know them, for the failure timeout) and requeues them; what a
/// holder does know stays unacked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_a_live_owner_never_got_are_requeued() {
    init_tracing();
    let c = Cluster::start(3, fast_timing(Duration::from_secs(2))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    for i in 0..7 {
        publish_retrying(c.node(1), "q", format!("m{i}").into_bytes()).await;
    }
    let n2 = c.node(2).clone();
    let stranded = n2.owners().new_owner_held(std::sync::Arc::new(Holder(false)));
    let holding = n2.owners().new_owner_held(std::sync::Arc::new(Holder(true)));
    assert_eq!(n2.get("q", stranded, 5, false).await.unwrap().len(), 5);
    assert_eq!(n2.get("q", holding, 2, false).await.unwrap().len(), 2);
    wait_until(Duration::from_secs(20), "the five nobody got are ready again", || {
        c.node(1).queue_info("q").is_ok_and(|i| i.ready == 5 && i.unacked == 2)
    })
    .await;
    // Well past another failure timeout: the two the holder knows stay held.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let i = c.node(1).queue_info("q").unwrap();
    assert_eq!((i.ready, i.unacked), (5, 2));
    c.shutdown().await;
}

/// A new queue's group starts already led by its designated master, in
/// term 1: no replica is asked for a vote (an election per queue synced a
/// vote on every node), and every replica knows its master from the start.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_queues_group_is_founded_led_without_an_election() {
    init_tracing();
    let c = Cluster::start(3, fast_timing(Duration::from_secs(60))).await;
    let votes = |c: &Cluster| (1..=3).map(|id| c.node(id).metrics().queue_vote_requests.get()).sum::<u64>();
    for i in 0..10 {
        let q = c.node(2).declare_queue(&format!("founded-{i}"), vec![3, 1, 2]).await.unwrap();
        assert_eq!(q.initial.first(), Some(&3), "node 3 is the designated master");
    }
    c.node(1).publish("founded-0", vec![msg("m")]).await.expect("confirmed");
    assert_eq!(votes(&c), 0, "vote requests sent for new queues");
    for i in 0..10 {
        let name = format!("founded-{i}");
        let m = c.node(3).queue_raft(&name).unwrap().metrics().borrow().clone();
        assert!(m.state.is_leader() && m.current_term == 1, "the designated master leads in term 1: {m:?}");
        for id in [1, 2] {
            let raft = c.node(id).queue_raft(&name).unwrap();
            wait_until(Duration::from_secs(5), "the mirror follows the designated master", || {
                let m = raft.metrics().borrow().clone();
                m.current_leader == Some(3) && m.current_term == 1
            })
            .await;
        }
    }
    assert_eq!(votes(&c), 0);
    c.shutdown().await;
}

/// Every node loses power at once (a data centre's outage) while both
/// mirrors have an entry on disk that the master's own sync has not yet
/// covered: the master comes back without it, holding a committed vote for
/// itself. It must not lead that term again, or its next entry would take
/// the lost one's index under the same log id, which the mirrors take as
/// already held: the next confirm would count copies that are not there.
/// A confirmed message is on every replica's disk, whatever the outage.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn after_a_power_cut_a_master_that_lost_an_entry_its_mirrors_hold_does_not_lead_its_term_again() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(60))).await;
    // Strict Raft: the first node back may not carry the queue on alone
    // (re-formed, it would serve from its own log and never meet the hazard).
    let strict = r#"{"ha-mode":"all","ha-sync-mode":"automatic","ha-promote-on-failure":"when-synced"}"#;
    c.node(1).set_policy(common::policy("^q9$", strict)).await.unwrap();
    c.node(1).declare_queue("q9", vec![]).await.unwrap();
    wait_until(Duration::from_secs(20), "three replicas", || {
        c.node(3).queue_members("q9") == Some(BTreeSet::from([1, 2, 3]))
    })
    .await;
    publish_retrying(c.node(1), "q9", b"warm-up".to_vec()).await;
    let master = c.master_of("q9").await;
    let mirrors: Vec<u64> = (1..=3).filter(|id| *id != master).collect();
    let raft = c.node(master).queue_raft("q9").unwrap();
    let last = raft.metrics().borrow().last_log_index;
    let term = raft.metrics().borrow().current_term;
    let matched = |id: u64| {
        let m = raft.metrics().borrow().clone();
        m.replication.as_ref().and_then(|r| r.get(&id).cloned().flatten()).map(|l| l.index)
    };

    tracing::info!(master, "--- hold the master's syncs; an entry reaches both mirrors' disks only");
    let held = c.node(master).db().flusher().hold_syncs();
    let unsynced = {
        let node = c.node(master).clone();
        tokio::spawn(async move { node.publish("q9", vec![msg("unsynced")]).await })
    };
    wait_until(Duration::from_secs(10), "both mirrors have the entry on disk", || {
        mirrors.iter().all(|id| matched(*id) > last)
    })
    .await;
    drop(raft);

    tracing::info!("--- power cut: every node at once, the mirrors first");
    for id in mirrors.iter().copied().chain([master]) {
        c.crash(id).await;
    }
    drop(held);
    assert!(!matches!(unsynced.await, Ok(Ok(_))), "confirmed without the master's sync");
    for id in 1..=3 {
        c.restart(id).await;
    }

    tracing::info!("--- a message confirmed after the outage is on every replica");
    publish_retrying(c.node(master), "q9", b"after".to_vec()).await;
    for id in 1..=3 {
        let held = bodies(&c.node(id).local_messages("q9").await.unwrap());
        assert!(held.contains(b"after".as_slice()), "node {id} lacks a confirmed message");
    }
    let m = c.node(c.master_of("q9").await).queue_raft("q9").unwrap().metrics().borrow().clone();
    assert!(m.current_term > term, "the outage's term was led again: {m:?}");
    c.shutdown().await;
}

/// A master applies an entry its mirrors committed only once its own log
/// has it on disk. Applying a publish writes a reference into the entry
/// (the body stays in the log), and any sled sync of the node (another
/// group's vote, a snapshot) makes what was applied durable: it must not
/// make durable a reference to an entry a power cut can still take from
/// the master's log. Here a round of the master's flusher syncs the log,
/// then waits before it syncs sled while an entry is written, committed by
/// the mirrors and (without the wait) applied; the entry's own log sync is
/// then held and the master's power cut. Back up, its replica holds every
/// message, and the queue serves them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_master_applies_an_entry_only_once_its_own_log_has_it_on_disk() {
    init_tracing();
    let (mut c, master, mirrors) = cluster_with_queue("qd").await;
    let raft = c.node(master).queue_raft("qd").unwrap();
    let last = raft.metrics().borrow().last_log_index;
    let matched = |id: u64| {
        let m = raft.metrics().borrow().clone();
        m.replication.as_ref().and_then(|r| r.get(&id).cloned().flatten()).map(|l| l.index)
    };
    let db = c.node(master).db().clone();

    tracing::info!(master, "--- a round of the master's flusher syncs its log and waits to sync sled");
    let sled_held = db.flusher().hold_sled_syncs();
    let round = {
        let db = db.clone();
        tokio::spawn(async move { db.flusher().sync().await })
    };
    wait_until(Duration::from_secs(10), "a round waits to sync sled", || sled_held.round_waiting()).await;

    tracing::info!("--- an entry written after that log sync is committed by the mirrors");
    let publisher = {
        let node = c.node(master).clone();
        tokio::spawn(async move { node.publish("qd", vec![msg("late")]).await })
    };
    wait_until(Duration::from_secs(10), "both mirrors have the entry on disk", || {
        mirrors.iter().all(|id| matched(*id) > last)
    })
    .await;
    // Time for a master that applies what is committed, durable here or
    // not, to apply it.
    let applied = || raft.metrics().borrow().last_applied.map(|l| l.index) > last;
    let mut early = false;
    for _ in 0..150 {
        early = applied();
        if early {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tracing::info!(early, "--- sled synced with the entry's own log sync held; power cut at the master");
    let log_held = db.flusher().hold_syncs();
    drop(sled_held);
    round.await.unwrap().unwrap();
    drop(raft);
    c.crash(master).await;
    drop(log_held);
    publisher.abort();
    c.restart(master).await;

    tracing::info!("--- back up, the master's replica holds every message and the queue serves them");
    let want: BTreeSet<Vec<u8>> = ["warm-up", "late"].iter().map(|b| b.as_bytes().to_vec()).collect();
    let mut held = BTreeSet::new();
    for _ in 0..500 {
        held = bodies(&c.node(master).local_messages("qd").await.unwrap());
        if held == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(held, want, "the restarted master's replica lost a committed message");
    let got = c.node(master).get("qd", 9, 10, true).await.unwrap();
    assert_eq!(delivered(&got), want);
    c.shutdown().await;
}
