//! Synchronising new mirrors (`ha-sync-mode`), on live in-process clusters:
//! a manual mirror holds only what was published after it joined and is
//! not synchronised until `sync`; the sync runs while the queue is in use;
//! `cancel_sync` pauses it; an unsynchronised mirror never becomes master.

mod common;

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::{fast_timing, init_tracing, msg, policy, wait_until, Cluster};
use mirrorq::{Node, QueueInfo};

const KIB: usize = 1024;

/// A cluster whose mirrors fetch `batch` bytes per request (small, so a
/// sync takes many round trips and can be watched while it runs).
async fn cluster(n: u64, batch: usize) -> Cluster {
    Cluster::start_configured(n, fast_timing(Duration::from_secs(3)), |cfg| cfg.sync_batch_bytes = batch).await
}

/// Publish `n` messages `{prefix}{i}` of about 1 KiB, in batches.
async fn publish_many(node: &Node, queue: &str, prefix: &str, n: usize) {
    for chunk in (0..n).collect::<Vec<_>>().chunks(100) {
        let msgs = chunk
            .iter()
            .map(|i| {
                let mut b = format!("{prefix}{i}:").into_bytes();
                b.resize(KIB, b'x');
                msg(b)
            })
            .collect();
        node.publish(queue, msgs).await.expect("publish confirmed");
    }
}

fn body_names(msgs: &[mirrorq::Message]) -> BTreeSet<String> {
    msgs.iter().map(|m| String::from_utf8_lossy(&m.body).split(':').next().unwrap().to_string()).collect()
}

/// Declare a one-replica queue under a manual policy, fill it, then grow
/// it to two: the newcomer is the new mirror. Returns (master, mirror).
async fn queue_with_new_manual_mirror(c: &Cluster, queue: &str, old: usize) -> (u64, u64) {
    c.node(1)
        .set_policy(policy("^man", r#"{"ha-mode":"exactly","ha-params":1,"ha-sync-mode":"manual"}"#))
        .await
        .unwrap();
    let q = c.node(1).declare_queue(queue, vec![]).await.unwrap();
    let master = q.replicas[0];
    publish_many(c.node(1), queue, "old", old).await;
    c.node(1)
        .set_policy(policy("^man", r#"{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"manual"}"#))
        .await
        .unwrap();
    let mut mirror = 0;
    wait_until(Duration::from_secs(30), "the new mirror joins", || {
        let replicas = c.node(1).metadata().queues[queue].replicas.clone();
        mirror = replicas.iter().copied().find(|r| *r != master).unwrap_or(0);
        mirror != 0 && c.node(master).queue_members(queue).is_some_and(|m| m.contains(&mirror))
    })
    .await;
    (master, mirror)
}

/// Serve node's HTTP API on a loopback port; returns the port.
async fn http(node: &Node) -> u16 {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    tokio::spawn(mirrorq::http::serve(l, node.clone(), node.stopped()));
    port
}

/// `GET /api/queues/%2F/{queue}` as a management client sees it.
async fn http_queue(port: u16, queue: &str) -> serde_json::Value {
    let url = format!("http://127.0.0.1:{port}/api/queues/%2F/{queue}");
    tokio::task::spawn_blocking(move || {
        ureq::get(&url).set("authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=").call().unwrap().into_json().unwrap()
    })
    .await
    .unwrap()
}

async fn view(node: &Node, queue: &str) -> QueueInfo {
    node.master_view(queue).await.expect("master answers")
}

async fn wait_view(node: &Node, queue: &str, what: &str, cond: impl Fn(&QueueInfo) -> bool) -> QueueInfo {
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    loop {
        let v = view(node, queue).await;
        if cond(&v) {
            return v;
        }
        assert!(std::time::Instant::now() < deadline, "timed out waiting for: {what}; last view {v:?}");
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
}

/// A mirror added to a queue nobody uses: the master hears from it that it
/// lacks the old bodies after its log is complete, and no Raft metric
/// changes then; the report alone must take it out of the synchronised
/// set (a master's confirm gate with nothing to wait for does not tick).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_added_to_an_idle_queue_is_not_counted_synchronised_while_it_lacks_bodies() {
    init_tracing();
    let c = cluster(3, 8 * KIB).await;
    let (_, mirror) = queue_with_new_manual_mirror(&c, "man-idle", 500).await;
    wait_view(c.node(1), "man-idle", "the mirror reports", |v| v.catching_up.iter().any(|(id, _)| *id == mirror)).await;
    // Nothing is published: only the report can have moved the set.
    let v = wait_view(c.node(1), "man-idle", "the master counts the mirror out", |v| !v.synchronised.contains(&mirror))
        .await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let later = view(c.node(1), "man-idle").await;
    assert!(!later.synchronised.contains(&mirror), "counted synchronised without its bodies: {later:?} (was {v:?})");
    c.shutdown().await;
}

/// A mirror caught up but still a learner (its master has not made it a
/// voter yet) has every confirmed message, yet the group would re-form
/// without it if a majority of its voters were lost: the API lists it as
/// synchronised only once it is a voter, so what the API calls
/// synchronised is what Raft counts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_learner_is_listed_synchronised_only_once_it_is_a_voter() {
    init_tracing();
    let held = tokio_util::sync::CancellationToken::new();
    let c = Cluster::start_configured(3, fast_timing(Duration::from_secs(3)), |cfg| {
        cfg.test.promotions_held = Some(held.clone())
    })
    .await;
    let auto = |n: u32| format!(r#"{{"ha-mode":"exactly","ha-params":{n},"ha-sync-mode":"automatic"}}"#);
    c.node(1).set_policy(policy("^lrn", &auto(1))).await.unwrap();
    let q = c.node(1).declare_queue("lrn", vec![]).await.unwrap();
    let master = q.replicas[0];
    publish_many(c.node(master), "lrn", "m", 50).await;
    c.node(1).set_policy(policy("^lrn", &auto(2))).await.unwrap();
    let mut mirror = 0;
    wait_until(Duration::from_secs(30), "the new mirror is chosen", || {
        let replicas = c.node(1).metadata().queues["lrn"].replicas.clone();
        mirror = replicas.iter().copied().find(|r| *r != master).unwrap_or(0);
        mirror != 0
    })
    .await;
    // Caught up as a learner: it has applied what the master has.
    let ready = view(c.node(master), "lrn").await.ready;
    wait_until(Duration::from_secs(30), "the learner applies every message", || {
        c.node(mirror).queue_info("lrn").is_ok_and(|i| i.ready == ready)
    })
    .await;
    let port = http(c.node(master)).await;
    for i in 0..20 {
        publish_many(c.node(master), "lrn", &format!("p{i}-"), 1).await;
        let v = view(c.node(master), "lrn").await;
        assert_eq!(c.node(master).queue_members("lrn"), Some(BTreeSet::from([master])), "still a learner");
        assert!(!v.synchronised.contains(&mirror), "a learner listed as synchronised: {v:?}");
        let h = http_queue(port, "lrn").await;
        assert_eq!(h["synchronised_slave_nodes"], serde_json::json!([]), "{h}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    held.cancel();
    wait_view(c.node(master), "lrn", "the voter is listed", |v| v.synchronised.contains(&mirror)).await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn manual_mirror_gets_only_new_messages_until_sync_which_runs_while_the_queue_is_used() {
    init_tracing();
    let c = cluster(3, 8 * KIB).await;
    let (master, mirror) = queue_with_new_manual_mirror(&c, "man-q", 2000).await;
    publish_many(c.node(1), "man-q", "new", 10).await;

    // The mirror received the new messages and nothing published before it
    // joined: neither in its state nor in its log.
    let m = c.node(mirror).clone();
    let mut held = BTreeSet::new();
    for _ in 0..200 {
        held = body_names(&m.local_messages("man-q").await.unwrap());
        if held.len() == 10 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(held, (0..10).map(|i| format!("new{i}")).collect::<BTreeSet<_>>());

    // Reported as behind and not synchronised, and it stays so without `sync`.
    let v = wait_view(c.node(1), "man-q", "the mirror reports", |v| !v.catching_up.is_empty()).await;
    assert_eq!(v.catching_up[0].0, mirror);
    let p = v.catching_up[0].1;
    assert_eq!((p.msgs_total, p.msgs_done, p.running), (2000, 0, false), "{p:?}");
    // Time passes: without `sync` nothing may change.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let v = view(c.node(1), "man-q").await;
    assert!(!v.synchronised.contains(&mirror), "manual mirror synchronised without sync: {v:?}");
    assert_eq!(m.local_stored_count("man-q").unwrap(), 10);

    // Sync, while a publisher and a consumer keep going.
    let busy = Arc::new(AtomicBool::new(true));
    let during = Arc::new(AtomicU64::new(0));
    let load = {
        let (node, busy, during) = (c.node(2).clone(), busy.clone(), during.clone());
        tokio::spawn(async move {
            let mut i = 0;
            while busy.load(Ordering::Acquire) {
                let before = view(&node, "man-q").await.catching_up.first().map(|(_, p)| *p);
                node.publish("man-q", vec![msg(format!("during{i}:"))]).await.expect("publish during sync");
                let got = node.get("man-q", 7, 1, true).await.expect("get during sync");
                assert_eq!(got.len(), 1);
                let after = view(&node, "man-q").await.catching_up.first().map(|(_, p)| *p);
                // Both ends of the publish and the get inside a running sync.
                if let (Some(b), Some(a)) = (before, after) {
                    if b.running && a.running && b.msgs_done > 0 && a.msgs_done < a.msgs_total {
                        during.fetch_add(1, Ordering::AcqRel);
                    }
                }
                i += 1;
            }
            i
        })
    };
    c.node(3).sync_queue("man-q", true).await.unwrap();
    let v = wait_view(c.node(1), "man-q", "the mirror is synchronised", |v| {
        v.synchronised.contains(&mirror) && v.catching_up.is_empty()
    })
    .await;
    busy.store(false, Ordering::Release);
    let rounds = load.await.unwrap();
    assert!(
        during.load(Ordering::Acquire) > 0,
        "no publish and get completed while the sync ran ({rounds} rounds): {v:?}"
    );

    // The mirror now holds what the master holds, and can take over with it.
    // It learns the last commit with the next append or heartbeat, so its
    // state is compared once it has applied the master's last entry.
    let (ready, _) = c.node(1).status("man-q").await.unwrap();
    let last = c.node(master).queue_raft("man-q").unwrap().metrics().borrow().last_applied.map(|l| l.index);
    let mirror_raft = c.node(mirror).queue_raft("man-q").unwrap();
    wait_until(Duration::from_secs(5), "the mirror applies the master's last entry", || {
        mirror_raft.metrics().borrow().last_applied.map(|l| l.index) >= last
    })
    .await;
    assert_eq!(m.local_stored_count("man-q").unwrap() as u64, ready);
    let mut c = c;
    c.crash(master).await;
    let left = c.node(mirror).clone();
    let mut got = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while got.len() < ready as usize {
        match left.get("man-q", 9, 500, true).await {
            Ok(d) => got.extend(d.into_iter().map(|d| d.message)),
            Err(e) => {
                assert!(std::time::Instant::now() < deadline, "synced mirror never served: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    // The load took `rounds` messages from the head and added as many.
    let names = body_names(&got);
    let expected: BTreeSet<String> = (rounds..2000)
        .map(|i| format!("old{i}"))
        .chain((0..10).map(|i| format!("new{i}")))
        .chain((0..rounds).map(|i| format!("during{i}")))
        .collect();
    assert_eq!(got.len(), expected.len());
    assert_eq!(names, expected, "the synchronised mirror lacks messages after the failover");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancel_sync_pauses_and_an_unsynchronised_mirror_never_becomes_master() {
    init_tracing();
    let mut c = cluster(3, KIB).await;
    let (master, mirror) = queue_with_new_manual_mirror(&c, "man-c", 1500).await;

    let port = http(c.node(1)).await;
    c.node(1).sync_queue("man-c", true).await.unwrap();
    wait_view(c.node(1), "man-c", "the sync makes progress", |v| {
        v.catching_up.first().is_some_and(|(_, p)| p.running && p.msgs_done > 0)
    })
    .await;
    let q = http_queue(port, "man-c").await;
    assert_eq!(q["state"], "syncing", "{q}");
    assert_eq!(q["sync_progress"][0]["node"], format!("mirrorq@{mirror}"), "{q}");
    assert_eq!(q["sync_progress"][0]["running"], true, "{q}");
    assert_eq!(q["sync_progress"][0]["messages_total"], 1500, "{q}");
    assert!(q["sync_progress"][0]["bytes_total"].as_u64().is_some_and(|b| b >= 1500 * 1024), "{q}");
    c.node(1).sync_queue("man-c", false).await.unwrap();
    let v = wait_view(c.node(1), "man-c", "the sync stops", |v| v.catching_up.first().is_some_and(|(_, p)| !p.running))
        .await;
    let paused = v.catching_up[0].1;
    let q = http_queue(port, "man-c").await;
    assert_eq!(q["state"], "running", "a paused sync is not syncing: {q}");
    assert_eq!(q["sync_progress"][0]["running"], false, "{q}");
    assert!(!q["synchronised_slave_nodes"].as_array().unwrap().contains(&format!("mirrorq@{mirror}").into()), "{q}");
    assert!(paused.msgs_done < paused.msgs_total, "finished before the cancel could count: {paused:?}");
    // Time in which a sync that was not paused would fetch on.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let v = view(c.node(1), "man-c").await;
    assert_eq!(v.catching_up.first().map(|(_, p)| p.msgs_done), Some(paused.msgs_done), "kept fetching after cancel");
    assert!(!v.synchronised.contains(&mirror));

    // The master goes: the mirror lacks messages, so it must not take over,
    // not by election and not by re-forming the group on its own.
    c.crash(master).await;
    let m = c.node(mirror).clone();
    let waited = std::time::Instant::now();
    // Watched for well past the 3 s failure timeout, when a lone replica may re-form.
    while waited.elapsed() < Duration::from_secs(7) {
        assert!(!m.is_master("man-c"), "an unsynchronised mirror became master");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(m.publish("man-c", vec![msg("x")]).await.is_err(), "served without a synchronised replica");

    // Back: the old master leads again; the mirror finishes its sync.
    c.restart(master).await;
    c.master_of("man-c").await;
    c.node(mirror).sync_queue("man-c", true).await.unwrap();
    wait_view(c.node(1), "man-c", "synchronised after the master returned", |v| {
        v.synchronised.contains(&mirror) && v.catching_up.is_empty()
    })
    .await;
    assert_eq!(c.node(mirror).local_stored_count("man-c").unwrap(), 1500);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn switching_to_automatic_starts_a_waiting_mirror_by_itself() {
    init_tracing();
    let c = cluster(2, 64 * KIB).await;
    let (_, mirror) = queue_with_new_manual_mirror(&c, "man-a", 500).await;
    let v = wait_view(c.node(1), "man-a", "the mirror reports", |v| !v.catching_up.is_empty()).await;
    assert!(!v.catching_up[0].1.running);
    c.node(2)
        .set_policy(policy("^man", r#"{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"automatic"}"#))
        .await
        .unwrap();
    wait_view(c.node(1), "man-a", "synchronised without a sync action", |v| {
        v.synchronised.contains(&mirror) && v.catching_up.is_empty()
    })
    .await;
    assert_eq!(c.node(mirror).local_stored_count("man-a").unwrap(), 500);
    c.shutdown().await;
}

/// `ha-mode: nodes` moves a queue from node 1 to nodes 2 and 3 under manual
/// sync: the new mirrors lack every body published before they joined, so
/// node 1 (their only other copy) stays in the group until a `sync` has
/// given them every body; then it leaves, and every message is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn moving_a_queue_keeps_the_old_replica_until_the_new_ones_have_every_body() {
    init_tracing();
    let c = cluster(3, 64 * KIB).await;
    let at = |nodes: &str| format!(r#"{{"ha-mode":"nodes","ha-params":[{nodes}],"ha-sync-mode":"manual"}}"#);
    c.node(1).set_policy(policy("^mv", &at(r#""mirrorq@1""#))).await.unwrap();
    c.node(1).declare_queue("mv-q", vec![]).await.unwrap();
    publish_many(c.node(1), "mv-q", "old", 300).await;
    c.node(1).set_policy(policy("^mv", &at(r#""mirrorq@2","mirrorq@3""#))).await.unwrap();
    wait_until(Duration::from_secs(30), "the new mirrors join", || {
        c.node(1).queue_members("mv-q").is_some_and(|m| m.contains(&2) && m.contains(&3))
    })
    .await;
    // Well past the time the move took before: node 1 is still a voter.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let members = c.node(2).queue_members("mv-q").unwrap();
    assert!(members.contains(&1), "the only complete replica left before the others had the bodies: {members:?}");

    c.node(2).sync_queue("mv-q", true).await.unwrap();
    wait_until(Duration::from_secs(60), "node 1 leaves once 2 and 3 are complete", || {
        c.node(2).queue_members("mv-q") == Some(BTreeSet::from([2, 3]))
    })
    .await;
    // The old master left: wait for the new one before taking messages.
    wait_view(c.node(3), "mv-q", "a master among the new replicas", |v| {
        v.leader.is_some_and(|l| l != 1)
            && v.synchronised.iter().copied().collect::<BTreeSet<_>>() == BTreeSet::from([2, 3])
    })
    .await;
    for id in [2, 3] {
        assert_eq!(c.node(id).local_stored_count("mv-q").unwrap(), 300, "node {id} holds every body");
    }
    let mut got = BTreeSet::new();
    loop {
        let d = c.node(3).get("mv-q", 1, 100, true).await.expect("served by the new replicas");
        if d.is_empty() {
            break;
        }
        got.extend(d.iter().map(|d| String::from_utf8_lossy(&d.message.body).split(':').next().unwrap().to_string()));
    }
    assert_eq!(got, (0..300).map(|i| format!("old{i}")).collect::<BTreeSet<_>>());
}

/// A mirror's node says it is stopping, then stops: its master stops
/// waiting for it at the notice, where it held the next confirm for the
/// sync timeout (a busy queue stalled for seconds at each node of a
/// rolling restart). Back, it is synchronised again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_that_said_it_is_stopping_holds_up_no_confirm() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(60))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    common::publish_retrying(c.node(1), "q", b"before".to_vec()).await;
    let master = c.master_of("q").await;
    let stopping = (1..=3).find(|id| *id != master).unwrap();
    wait_view(c.node(master), "q", "every mirror synchronised", |i| i.synchronised.len() == 3).await;
    assert_eq!(c.node(stopping).move_masterships_away().await, 0);
    c.crash(stopping).await;
    let confirmed =
        tokio::time::timeout(Duration::from_secs(10), c.node(master).publish("q", vec![msg("after")])).await;
    assert!(matches!(confirmed, Ok(Ok(()))), "confirm held up by the stopped mirror: {confirmed:?}");
    let info = view(c.node(master), "q").await;
    assert!(!info.synchronised.contains(&stopping), "a mirror lacking a confirmed message counted synchronised");
    assert_eq!(info.synchronised.len(), 2);
    // Back as a new life, with nothing more published: synchronised again.
    c.restart(stopping).await;
    wait_view(c.node(master), "q", "the returned mirror synchronised", |i| i.synchronised.contains(&stopping)).await;
    wait_until(Duration::from_secs(10), "both messages applied on the returned mirror", || {
        c.node(stopping).local_stored_count("q").is_ok_and(|n| n == 2)
    })
    .await;
    c.shutdown().await;
}

/// A node back from a stop holds its replicas' reports until it has
/// started every replica: a master that counted one synchronised would
/// wait for its acknowledgements, slow while the node starts thousands of
/// replicas (at 10,000 queues every busy queue's confirms stalled for about
/// a second at each return of a rolling restart). Here the replica of `a`
/// starts late, as one among thousands would: meanwhile the returned
/// replica of `b` has every message and is not counted; afterwards both are.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_returning_node_counts_as_synchronised_once_it_has_started_every_replica() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(60))).await;
    for q in ["a", "b"] {
        c.node(1).declare_queue(q, vec![1, 2, 3]).await.unwrap();
        common::publish_retrying(c.node(1), q, b"before".to_vec()).await;
    }
    let masters = [c.master_of("a").await, c.master_of("b").await];
    let back = (1..=3).find(|id| !masters.contains(id)).unwrap();
    for q in ["a", "b"] {
        wait_view(c.node(1), q, "every mirror synchronised", |i| i.synchronised.len() == 3).await;
    }
    assert_eq!(c.node(back).move_masterships_away().await, 0);
    // Idle, it has every message, but counts no more once it said it stops.
    for q in ["a", "b"] {
        wait_view(c.node(1), q, "the stopping mirror out of the set", |i| !i.synchronised.contains(&back)).await;
    }
    c.crash(back).await;
    for q in ["a", "b"] {
        common::publish_retrying(c.node(1), q, b"while away".to_vec()).await;
        let info = view(c.node(1), q).await;
        assert!(!info.synchronised.contains(&back), "a mirror lacking a confirmed message counted synchronised");
    }
    let release = Arc::new(tokio::sync::Notify::new());
    c.configs[(back - 1) as usize].test.start_held = Some(("a".into(), release.clone()));
    c.restart(back).await;
    wait_until(Duration::from_secs(20), "the returned replica of b has every message", || {
        c.node(back).local_stored_count("b").is_ok_and(|n| n == 2)
    })
    .await;
    // A second of looks: a report would have come within milliseconds.
    for _ in 0..20 {
        let info = view(c.node(1), "b").await;
        assert!(!info.synchronised.contains(&back), "counted synchronised while still starting its replicas");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(c.node(back).queue_raft("a").is_none(), "the held replica started");
    release.notify_one();
    for q in ["a", "b"] {
        wait_view(c.node(1), q, "the returned mirror synchronised", |i| i.synchronised.contains(&back)).await;
    }
    c.shutdown().await;
}

/// A mastership moves off a stopping node, whose replica then returns
/// while the new master's grace period (confirms wait for every member that
/// answers, until they report) still runs. The returned replica is slow,
/// as on a node starting thousands of them (here: its start held back), and
/// a confirm must not wait for it: it was away during this leadership, and
/// joins by its report. At 10,000 queues every busy queue that changed
/// master at a stop stalled for about a second at that node's return.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_masters_grace_period_waits_for_no_member_back_from_a_stop() {
    init_tracing();
    let mut c = Cluster::start(3, fast_timing(Duration::from_secs(60))).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    common::publish_retrying(c.node(1), "q", b"before".to_vec()).await;
    let old = c.master_of("q").await;
    wait_view(c.node(old), "q", "every mirror synchronised", |i| i.synchronised.len() == 3).await;
    assert_eq!(c.node(old).move_masterships_away().await, 0, "the mastership did not move");
    let new = c.master_of("q").await;
    assert_ne!(new, old);
    c.node(old).shutdown().await;
    c.crash(old).await;
    let release = Arc::new(tokio::sync::Notify::new());
    c.configs[(old - 1) as usize].test.start_held = Some(("q".into(), release.clone()));
    c.restart(old).await;
    wait_until(Duration::from_secs(10), "the new master sees the old one back", || c.node(new).sees_peer_up(old)).await;
    assert!(c.node(old).queue_raft("q").is_none(), "the held replica started already");
    let confirmed =
        tokio::time::timeout(Duration::from_secs(3), c.node(new).publish("q", vec![msg("after the return")])).await;
    assert!(matches!(confirmed, Ok(Ok(()))), "a confirm waited for the returned replica: {confirmed:?}");
    assert!(c.node(old).queue_raft("q").is_none(), "the held replica started before the confirm");
    release.notify_one();
    wait_view(c.node(new), "q", "the returned mirror synchronised", |i| i.synchronised.contains(&old)).await;
    c.shutdown().await;
}

/// A mirror back from a crash after its master purged the log it lacks is
/// sent a snapshot, which names messages whose bodies it does not have.
/// Its earlier life was heard synchronised in this term and its log is
/// soon complete, but until it holds those bodies the master must not
/// count it synchronised: confirms would count it as a copy it is not. Its
/// fetch, and every report riding on it, is held here, so only the answer
/// to the snapshot can tell the master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_sent_a_snapshot_is_not_synchronised_until_it_holds_the_bodies() {
    mirror_sent_a_snapshot("snap-q", false).await;
}

/// The same for a mirror back on an emptied data dir: what its earlier
/// life reported does not count for the new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mirror_back_on_an_emptied_data_dir_is_not_synchronised_until_it_holds_the_bodies() {
    mirror_sent_a_snapshot("empty-q", true).await;
}

async fn mirror_sent_a_snapshot(queue: &str, emptied: bool) {
    init_tracing();
    let mut c = cluster(3, 8 * KIB).await;
    c.node(1).declare_queue(queue, vec![1, 2, 3]).await.unwrap();
    let master = c.master_of(queue).await;
    let back = (1..=3).rev().find(|id| *id != master).unwrap();
    publish_many(c.node(master), queue, "before", 100).await;
    wait_view(c.node(master), queue, "every mirror synchronised", |i| i.synchronised.len() == 3).await;

    tracing::info!("--- the mirror crashes; the master goes on and purges its log");
    c.crash(back).await;
    publish_many(c.node(master), queue, "away", 300).await;
    let raft = c.node(master).queue_raft(queue).unwrap();
    let applied = raft.metrics().borrow().last_applied.unwrap().index;
    let limit = Some(Duration::from_secs(10));
    raft.trigger().snapshot().await.unwrap();
    raft.wait(limit).metrics(|m| m.snapshot.is_some_and(|s| s.index >= applied), "snapshot").await.unwrap();
    raft.trigger().purge_log(applied).await.unwrap();
    raft.wait(limit).metrics(|m| m.purged.is_some_and(|p| p.index >= applied), "log purged").await.unwrap();
    let last = raft.metrics().borrow().last_log_index;
    if emptied {
        for entry in std::fs::read_dir(c.dirs[(back - 1) as usize].path()).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                std::fs::remove_dir_all(&path).unwrap();
            } else {
                std::fs::remove_file(&path).unwrap();
            }
        }
    }

    tracing::info!("--- back, it installs the snapshot while its fetch is held");
    let released = tokio_util::sync::CancellationToken::new();
    c.configs[(back - 1) as usize].test.bodies_held = Some(released.clone());
    c.restart(back).await;
    let matched = || {
        let m = raft.metrics().borrow().clone();
        m.replication.as_ref().and_then(|r| r.get(&back).cloned().flatten()).map(|l| l.index)
    };
    wait_until(Duration::from_secs(30), "the mirror has the master's log", || matched() >= last).await;
    assert!(
        c.node(back).local_stored_count(queue).unwrap() < 400,
        "the mirror holds every body: it was not sent a snapshot"
    );
    // A second of looks: the master's gate acts on the mirror's progress
    // within milliseconds.
    for _ in 0..20 {
        let info = view(c.node(master), queue).await;
        assert!(!info.synchronised.contains(&back), "counted synchronised without the bodies: {info:?}");
        assert!(info.catching_up.iter().any(|(id, _)| *id == back), "not known to be behind: {info:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    tracing::info!("--- its fetch goes ahead: synchronised once it holds every body");
    released.cancel();
    wait_view(c.node(master), queue, "the mirror synchronised", |i| i.synchronised.contains(&back)).await;
    assert_eq!(c.node(back).local_stored_count(queue).unwrap(), 400, "synchronised without every body");
    c.shutdown().await;
}
