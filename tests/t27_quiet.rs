//! Quiet groups: an idle queue group that has settled sends no Raft
//! heartbeats; its followers keep its master from the master node's pings,
//! fail over when that node dies or is cut off, and the next publish wakes
//! the group.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{fast_timing, init_tracing, msg, publish_retrying, wait_until, Cluster};
use mirrorq::Timing;

async fn quiet_queue(name: &str) -> (Cluster, u64, Vec<u64>) {
    quiet_queue_synced_within(name, Duration::from_secs(60)).await
}

/// `sync_timeout`: how long confirms wait for a mirror that is down.
async fn quiet_queue_synced_within(name: &str, sync_timeout: Duration) -> (Cluster, u64, Vec<u64>) {
    let c = Cluster::start(3, fast_timing(sync_timeout)).await;
    c.node(1).declare_queue(name, vec![1, 2, 3]).await.unwrap();
    for i in 0..3 {
        publish_retrying(c.node(1), name, format!("m{i}").into_bytes()).await;
    }
    let master = c.master_of(name).await;
    wait_until(Duration::from_secs(15), "the idle group goes quiet", || c.node(master).is_quiet_here(name)).await;
    let mirrors: Vec<u64> = (1..=3).filter(|id| *id != master).collect();
    (c, master, mirrors)
}

/// A quiet queue whose master's node began its stop and moved the
/// mastership away; that node stays up. Returns it and the new master.
async fn quiet_queue_moved_off_its_master(name: &str) -> (Cluster, u64, u64) {
    let (c, master, _) = quiet_queue(name).await;
    assert_eq!(c.node(master).move_masterships_away().await, 0, "a mastership did not move");
    let successor = c.master_of(name).await;
    assert_ne!(successor, master);
    (c, master, successor)
}

/// Whether every member of the master's group `raft` has its whole log,
/// all of it applied at the master.
fn holds_all_applied(raft: &mirrorq::queue::QueueRaft) -> bool {
    let m = raft.metrics().borrow().clone();
    let all = m.replication.as_ref().is_some_and(|r| r.values().all(|l| l.map(|l| l.index) == m.last_log_index));
    all && m.last_applied.map(|l| l.index) == m.last_log_index
}

/// Looks every 5 ms whether `node`'s replica of `queue` is awake; the flag
/// says whether it ever was, until the task is aborted.
fn watch_wakes(node: mirrorq::Node, queue: &'static str) -> (Arc<AtomicBool>, tokio::task::JoinHandle<()>) {
    let woke = Arc::new(AtomicBool::new(false));
    let flag = woke.clone();
    let task = tokio::spawn(async move {
        loop {
            if !node.is_quiet_here(queue) {
                flag.store(true, Ordering::Release);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    (woke, task)
}

/// Once settled, a mirror is sent nothing for the group, where a busy
/// group's master sends a heartbeat every 150 ms here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_group_sends_no_heartbeats_once_settled() {
    init_tracing();
    let (c, master, mirrors) = quiet_queue("q").await;
    let heartbeat = fast_timing(Duration::from_secs(60)).heartbeat;
    let before: Vec<u64> = mirrors.iter().map(|id| c.node(*id).appends_received_by("q").unwrap()).collect();
    tokio::time::sleep(heartbeat * 15).await;
    let after: Vec<u64> = mirrors.iter().map(|id| c.node(*id).appends_received_by("q").unwrap()).collect();
    assert_eq!(before, after, "appends sent to the mirrors of a quiet group");
    assert!(c.node(master).is_quiet_here("q"));
    assert_eq!(c.node(master).quiet_groups(), 1);
    // Nobody stood for election meanwhile: the master is the same.
    assert_eq!(c.master_of("q").await, master);
    c.shutdown().await;
}

/// A master quiets its settled group at its own next failure-watch round,
/// a heartbeat interval after the one that found it settled, with no round
/// of its peers in between: that first round sent the group one heartbeat
/// (carrying the last commit index) and announced it, and the next one's
/// pings carried the announcement to the peers. Waiting three heartbeat
/// intervals and then for each peer's own ping to fetch the list kept each
/// new queue's group sending heartbeats for 1.5 s: most of what a declare
/// cost in appends. Only the master's watch runs here, by hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settled_group_goes_quiet_at_its_masters_next_round_with_its_commit_known() {
    init_tracing();
    let timing = fast_timing(Duration::from_secs(60));
    let c = Cluster::start_configured(3, timing.clone(), |cfg| cfg.test.watch_after = Duration::from_secs(3600)).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    let master = c.master_of("q").await;
    let raft = c.node(master).queue_raft("q").unwrap();
    wait_until(Duration::from_secs(15), "every mirror holds the founding log", || holds_all_applied(&raft)).await;
    let round = || c.node(master).watch_failures_over(vec![c.node(master).replica_view("q").unwrap()]);
    round().await;
    assert!(!c.node(master).is_quiet_here("q"), "quiet at the round that found it settled");
    // Past the heartbeat interval, and past the time the watch reuses its
    // last pings.
    tokio::time::sleep(timing.heartbeat.max(Duration::from_millis(450))).await;
    round().await;
    assert!(c.node(master).is_quiet_here("q"), "not quiet at the master's next round");
    let last = raft.metrics().borrow().last_log_index;
    for id in (1..=3).filter(|id| *id != master) {
        assert_eq!(c.node(id).queue_info("q").unwrap().applied, last, "node {id} went quiet without the last commit");
    }
    c.shutdown().await;
}

/// A group in use is announced quiet, which stops its followers' timers,
/// only once it has been still for three heartbeat intervals: a queue used
/// every half second must not hold them all the time, or a master cut off
/// from them is replaced an election timeout later than a busy one's. A
/// queue just declared is announced at the first round that finds it
/// settled. Only the master's watch runs here, by hand.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_in_use_is_announced_quiet_only_once_still_for_a_while() {
    init_tracing();
    let timing = Timing { heartbeat: Duration::from_millis(300), ..fast_timing(Duration::from_secs(60)) };
    let c = Cluster::start_configured(3, timing.clone(), |cfg| cfg.test.watch_after = Duration::from_secs(3600)).await;
    c.node(1).declare_queue("q", vec![1, 2, 3]).await.unwrap();
    let master = c.master_of("q").await;
    let raft = c.node(master).queue_raft("q").unwrap();
    let settled = || holds_all_applied(&raft);
    let round = || c.node(master).watch_failures_over(vec![c.node(master).replica_view("q").unwrap()]);
    wait_until(Duration::from_secs(15), "the new group settles", settled).await;
    round().await;
    assert!(c.node(master).announces_quiet("q"), "a new group is announced at the round that finds it settled");

    c.node(master).publish("q", vec![msg(b"m")]).await.unwrap();
    wait_until(Duration::from_secs(15), "the group settles again", settled).await;
    round().await;
    assert!(!c.node(master).announces_quiet("q"), "a group in use announced as soon as it settled");
    tokio::time::sleep(timing.heartbeat + Duration::from_millis(50)).await;
    round().await;
    assert!(!c.node(master).announces_quiet("q"), "a group in use announced after one heartbeat interval");
    tokio::time::sleep(timing.heartbeat * 2 + Duration::from_millis(100)).await;
    round().await;
    assert!(c.node(master).announces_quiet("q"), "still for three heartbeat intervals, and not announced");
    c.shutdown().await;
}

/// A stopping node moves its masterships one group at a time; until a
/// quiet group's turn comes, it stays quiet. Waking them all as the stop
/// began (a node leading 6,700 quiet groups) sent heartbeats from every one
/// at once, which saturated every node of a 10,000-queue cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopping_node_keeps_its_quiet_groups_quiet_until_it_moves_them() {
    init_tracing();
    let (c, master, mirrors) = quiet_queue("q").await;
    let heartbeat = fast_timing(Duration::from_secs(60)).heartbeat;
    let before: Vec<u64> = mirrors.iter().map(|id| c.node(*id).appends_received_by("q").unwrap()).collect();
    c.node(master).begin_leaving();
    tokio::time::sleep(heartbeat * 15).await;
    let after: Vec<u64> = mirrors.iter().map(|id| c.node(*id).appends_received_by("q").unwrap()).collect();
    assert!(c.node(master).is_quiet_here("q"), "the leaving node woke its quiet group");
    assert_eq!(before, after, "appends sent to the mirrors of a quiet group of a leaving node");
    c.shutdown().await;
}

/// A stopping node moves its masterships; each new master's group goes
/// quiet while the stopping node is still up. That node's replicas report
/// to no new master (so none counts it synchronised and waits for it once
/// it is gone), and the groups waited for its report to settle: at 10,000
/// queues the thousands of masterships it moved kept their heartbeats on
/// until it was gone, which saturated the node taking them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_moved_off_a_stopping_node_goes_quiet_before_that_node_is_gone() {
    init_tracing();
    let (mut c, master, successor) = quiet_queue_moved_off_its_master("q").await;
    wait_until(Duration::from_secs(15), "the moved group goes quiet", || c.node(successor).is_quiet_here("q")).await;
    let info = c.node(successor).queue_info("q").unwrap();
    assert!(!info.synchronised.contains(&master), "the stopping node counted as synchronised");
    // The stop goes on: the group stays quiet as that node goes.
    let (woke, watch) = watch_wakes(c.node(successor).clone(), "q");
    c.node(master).shutdown().await;
    c.crash(master).await;
    tokio::time::sleep(fast_timing(Duration::from_secs(60)).election_max * 3).await;
    watch.abort();
    assert!(!woke.load(Ordering::Acquire), "the moved group woke as the stopping node went");
    c.shutdown().await;
}

/// The node that moved its masterships away comes back. Its replicas hold
/// every entry of the new masters' terms (they took the new master's first
/// entry before the stop), so each knows its master from its saved vote and
/// reports by itself: the group stays quiet and counts it synchronised
/// again. At 10,000 queues waking every such group at the return (thousands
/// at once, while the returning node was still starting them) stalled
/// confirms on every node for 2-3 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_moved_off_a_stopping_node_stays_quiet_as_that_node_returns() {
    init_tracing();
    let (mut c, master, successor) = quiet_queue_moved_off_its_master("q").await;
    let raft = c.node(successor).queue_raft("q").unwrap();
    wait_until(Duration::from_secs(15), "the returning replica has the new master's entries", || {
        let m = raft.metrics().borrow().clone();
        m.replication.as_ref().and_then(|r| r.get(&master).cloned().flatten()).map(|l| l.index) == m.last_log_index
    })
    .await;
    wait_until(Duration::from_secs(15), "the moved group goes quiet", || c.node(successor).is_quiet_here("q")).await;
    c.node(master).shutdown().await;
    c.crash(master).await;
    let term = raft.metrics().borrow().current_term;
    let (woke, watch) = watch_wakes(c.node(successor).clone(), "q");
    c.restart(master).await;
    wait_until(Duration::from_secs(30), "the returned replica synchronised", || {
        c.node(successor).queue_info("q").is_ok_and(|i| i.synchronised.contains(&master))
    })
    .await;
    tokio::time::sleep(fast_timing(Duration::from_secs(60)).election_max * 3).await;
    watch.abort();
    assert!(!woke.load(Ordering::Acquire), "the moved group woke at the node's return");
    assert_eq!(raft.metrics().borrow().current_term, term, "an election was held");
    assert_eq!(c.node(master).local_stored_count("q").unwrap(), 3);
    c.shutdown().await;
}

/// A mirror is down while a message comes: the group goes quiet without
/// it (heartbeats cannot reach it), and when it returns the master wakes
/// the group, brings it every entry, counts it synchronised again, and goes
/// quiet once more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_group_goes_quiet_with_a_mirror_down_and_wakes_to_bring_it_back() {
    init_tracing();
    let (mut c, master, mirrors) = quiet_queue_synced_within("q", Duration::from_secs(3)).await;
    let away = mirrors[0];
    c.crash(away).await;
    publish_retrying(c.node(master), "q", b"while away".to_vec()).await;
    wait_until(Duration::from_secs(20), "quiet with a mirror down", || c.node(master).is_quiet_here("q")).await;
    let info = c.node(master).queue_info("q").unwrap();
    assert!(!info.synchronised.contains(&away));
    c.restart(away).await;
    wait_until(Duration::from_secs(30), "the returned mirror synchronised", || {
        c.node(master).queue_info("q").is_ok_and(|i| i.synchronised.contains(&away))
    })
    .await;
    assert_eq!(c.node(away).local_stored_count("q").unwrap(), 4, "the returned mirror lacks the message");
    wait_until(Duration::from_secs(15), "quiet again", || c.node(master).is_quiet_here("q")).await;
    c.shutdown().await;
}

/// Clients declare their queues at every connection: declaring a queue
/// that exists asks its master for its counts and writes nothing to its
/// log, so a quiet group stays quiet (it wrote a status entry, which woke
/// it for a settle window of heartbeats).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn declaring_an_existing_queue_leaves_its_quiet_group_alone() {
    init_tracing();
    let (c, master, mirrors) = quiet_queue("q").await;
    let raft = c.node(master).queue_raft("q").unwrap();
    let last = raft.metrics().borrow().last_log_index;
    for id in [master, mirrors[0], mirrors[1]] {
        let (q, created) = c.node(id).declare_queue_reporting("q", Vec::new()).await.expect("declared again");
        assert!(!created);
        assert_eq!(q.name, "q");
    }
    assert_eq!(raft.metrics().borrow().last_log_index, last, "a declare wrote to the queue's log");
    assert!(c.node(master).is_quiet_here("q"), "a declare woke the quiet group");
    c.shutdown().await;
}

/// The first publish wakes the group: it is confirmed, every mirror
/// applies it (the commit index reaches them without waiting for anyone to
/// notice), and the group goes quiet again afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_group_woken_by_a_publish_confirms_it_and_goes_quiet_again() {
    init_tracing();
    let (c, master, mirrors) = quiet_queue("q").await;
    c.node(master).publish("q", vec![msg("wake")]).await.expect("confirmed");
    assert!(!c.node(master).is_quiet_here("q"), "still quiet after an entry");
    let last = c.node(master).queue_raft("q").unwrap().metrics().borrow().last_log_index;
    for id in &mirrors {
        let raft = c.node(*id).queue_raft("q").unwrap();
        wait_until(Duration::from_secs(5), "the mirror applies the woken entry", || {
            raft.metrics().borrow().last_applied.map(|l| l.index) >= last
        })
        .await;
        assert_eq!(c.node(*id).queue_info("q").unwrap().ready, 4);
    }
    wait_until(Duration::from_secs(15), "quiet again", || c.node(master).is_quiet_here("q")).await;
    c.shutdown().await;
}

/// A quiet group's master node dies: a mirror takes over, without any
/// heartbeat having stopped to tell it, and serves every message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_group_whose_masters_node_dies_fails_over() {
    init_tracing();
    let (mut c, master, mirrors) = quiet_queue("q").await;
    let killed = Instant::now();
    c.crash(master).await;
    let other = c.node(mirrors[0]).clone();
    let got = other.get("q", 1, 3, true).await.expect("served after the failover");
    let bodies: Vec<String> = got.iter().map(|d| String::from_utf8(d.message.body.clone()).unwrap()).collect();
    assert_eq!(bodies, vec!["m0", "m1", "m2"]);
    let took = killed.elapsed();
    let new_master = c.master_of("q").await;
    assert!(mirrors.contains(&new_master));
    tracing::info!(?took, "quiet group failed over");
    c.shutdown().await;
}

/// A quiet group's master is cut off from both mirrors (its pings go
/// unanswered, nothing refuses a dial): the mirrors elect one of
/// themselves once its lease, counted from its last answered ping, is out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_group_whose_master_is_cut_off_fails_over() {
    init_tracing();
    let (c, master, mirrors) = quiet_queue("q").await;
    for m in &mirrors {
        c.node(*m).block(master);
        c.node(master).block(*m);
    }
    let n = c.node(mirrors[0]).clone();
    wait_until(Duration::from_secs(20), "a mirror becomes master", || {
        mirrors.iter().any(|id| c.node(*id).is_master("q"))
    })
    .await;
    let got = n.get("q", 1, 3, true).await.expect("served by the new master");
    assert_eq!(got.len(), 3);
    c.shutdown().await;
}

/// A mirror of a quiet group restarts: it learns the master from the
/// master node's announcement, stands for no election, and the group keeps
/// its master and term.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_mirror_of_a_quiet_group_keeps_its_master() {
    init_tracing();
    let (mut c, master, mirrors) = quiet_queue("q").await;
    let term = c.node(master).queue_raft("q").unwrap().metrics().borrow().current_term;
    c.crash(mirrors[0]).await;
    c.restart(mirrors[0]).await;
    let timing = fast_timing(Duration::from_secs(60));
    tokio::time::sleep(timing.election_max * 4).await;
    let now = c.node(master).queue_raft("q").unwrap().metrics().borrow().clone();
    assert!(now.state.is_leader(), "the master lost its mastership");
    assert_eq!(now.current_term, term, "an election was held");
    let raft = c.node(mirrors[0]).queue_raft("q").unwrap();
    assert_eq!(raft.metrics().borrow().current_term, term);
    c.node(mirrors[0]).publish("q", vec![msg("after")]).await.expect("confirmed through the restarted mirror");
    c.shutdown().await;
}

/// The most senior replica restarts as a mirror of a quiet group mastered
/// by another node: it knows no master (a quiet master sends it nothing)
/// and stands first by seniority, but must not unseat the live master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_senior_mirror_of_a_quiet_group_keeps_its_master() {
    init_tracing();
    let (mut c, first, _) = quiet_queue("q").await;
    // Make the senior replica a mirror: its master fails over and it
    // returns (once the failover is done: back sooner, it would stand by
    // seniority and win again).
    c.crash(first).await;
    let master = c.master_of("q").await;
    assert_ne!(master, first);
    c.restart(first).await;
    wait_until(Duration::from_secs(30), "quiet under the new master", || {
        c.node(master).is_quiet_here("q") && c.node(first).queue_info("q").map(|i| i.ready == 3).unwrap_or(false)
    })
    .await;
    let term = c.node(master).queue_raft("q").unwrap().metrics().borrow().current_term;
    c.crash(first).await;
    c.restart(first).await;
    let timing = fast_timing(Duration::from_secs(60));
    tokio::time::sleep(timing.election_max * 4).await;
    let now = c.node(master).queue_raft("q").unwrap().metrics().borrow().clone();
    assert!(now.state.is_leader(), "the restarted senior mirror unseated the quiet master");
    assert_eq!(now.current_term, term, "an election was held");
    c.shutdown().await;
}

/// A mirror of a quiet group restarts on a node whose failure watch has
/// not run yet (as on a node still starting thousands of replicas): the
/// quiet master sends it nothing, and it must not stand for election on
/// its own timer meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_mirror_stands_for_no_election_before_its_failure_watch_runs() {
    init_tracing();
    let (mut c, master, mirrors) = quiet_queue("q").await;
    let timing = fast_timing(Duration::from_secs(60));
    let term = c.node(master).queue_raft("q").unwrap().metrics().borrow().current_term;
    let mirror = mirrors[0];
    c.crash(mirror).await;
    c.configs[(mirror - 1) as usize].test.watch_after = timing.election_max * 6;
    c.restart(mirror).await;
    tokio::time::sleep(timing.election_max * 4).await;
    let restarted = c.node(mirror).queue_raft("q").unwrap().metrics().borrow().clone();
    assert_eq!(restarted.current_term, term, "the restarted mirror stood for election");
    let now = c.node(master).queue_raft("q").unwrap().metrics().borrow().clone();
    assert!(now.state.is_leader(), "the master lost its mastership");
    assert_eq!(now.current_term, term);
    // Once its watch runs, the queue is served through it as before.
    c.node(mirror).publish("q", vec![msg("after")]).await.expect("confirmed through the restarted mirror");
    c.shutdown().await;
}

/// Peers judge a node by its pings, and re-form its queues when it stays
/// silent. A node whose runtime is swamped (here: its only worker thread
/// blocked) still answers them, from the beacon's thread and connection,
/// so its peers see it alive rather than dead; but not once its runtime has
/// made no progress for the failure timeout (a hang is as good as a death);
/// and a crashed node answers no more.
#[test]
fn a_node_whose_runtime_is_blocked_still_answers_pings_until_the_failure_timeout() {
    use mirrorq::link::beacon::Beacon;
    use mirrorq::link::transport::Transport;
    use mirrorq::wire::{ask, RpcRequest, RpcResponse};
    use std::sync::Arc;
    use tokio_util::sync::CancellationToken;

    init_tracing();
    let timing = fast_timing(Duration::from_secs(60));
    let node_rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let mut c = node_rt.block_on(Cluster::start(1, timing.clone()));
    let addr = c.configs[0].raft_listen.clone();

    let pinger = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let stop = CancellationToken::new();
    let transport = Transport::with_beacon(Arc::new(Beacon::start(stop.clone()).unwrap()));
    let ping = || {
        pinger.block_on(transport.ping(
            &addr,
            RpcRequest::from(ask::Liveness { from: 99, have: None, mine: None }),
            Duration::from_secs(1),
        ))
    };
    assert!(matches!(ping(), Ok(RpcResponse::Liveness(_))), "a running node answers");

    let block = timing.failure_timeout + Duration::from_secs(3);
    let (started, blocked) = std::sync::mpsc::channel();
    node_rt.spawn(async move {
        started.send(Instant::now()).unwrap();
        std::thread::sleep(block);
    });
    let since = blocked.recv().unwrap();
    let answer = ping();
    assert!(matches!(answer, Ok(RpcResponse::Liveness(_))), "the busy node did not answer: {answer:?}");

    std::thread::sleep((since + timing.failure_timeout).saturating_duration_since(Instant::now()));
    let answer = ping();
    assert!(answer.is_err(), "a node stuck for the failure timeout answered: {answer:?}");

    std::thread::sleep((since + block + Duration::from_millis(500)).saturating_duration_since(Instant::now()));
    assert!(matches!(ping(), Ok(RpcResponse::Liveness(_))), "the node did not answer again once unstuck");

    node_rt.block_on(c.crash(1));
    assert!(ping().is_err(), "a crashed node answered a ping");
    stop.cancel();
}

/// A consumer waiting its turn on a single-active-consumer queue asks the
/// master again and again: its gets are answered at the master without an
/// entry, so the quiet group stays quiet, and the active consumer is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_single_active_consumer_writes_no_entries() {
    use mirrorq::queue::types::ConsumerRef;
    init_tracing();
    let (c, master, mirrors) = quiet_queue("sac").await;
    let me = ConsumerRef { number: 1, priority: 0 };
    c.node(1).register_consumer("sac", 101, me, true).await.unwrap();
    c.node(2).register_consumer("sac", 102, me, true).await.unwrap();
    wait_until(Duration::from_secs(15), "the group goes quiet again", || c.node(master).is_quiet_here("sac")).await;
    let before: Vec<u64> = mirrors.iter().map(|id| c.node(*id).appends_received_by("sac").unwrap()).collect();
    for _ in 0..30 {
        let (got, _) = c.node(2).consumer_fetch("sac", 102, 10, false, Some(me)).await.unwrap();
        assert!(got.is_empty(), "the waiting consumer was served");
    }
    let after: Vec<u64> = mirrors.iter().map(|id| c.node(*id).appends_received_by("sac").unwrap()).collect();
    assert_eq!(before, after, "a waiting consumer's gets were written to the log");
    let (got, _) = c.node(1).consumer_fetch("sac", 101, 10, false, Some(me)).await.unwrap();
    assert_eq!(got.len(), 3, "the active consumer is served");
    c.shutdown().await;
}

/// A quiet master whose Raft core quit (here on a storage error of its
/// replica) holds its followers no longer: its node fails that replica
/// alone (the node goes on, and so do its other replicas), withdraws the
/// group's announcement, and starts the replica again as a follower; the
/// followers elect a master, and the queue serves with every message.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_master_whose_raft_core_quit_lets_its_followers_elect() {
    init_tracing();
    let (c, master, mirrors) = quiet_queue("q").await;
    c.node(1).declare_queue("other", vec![1, 2, 3]).await.unwrap();
    publish_retrying(c.node(1), "other", b"o".to_vec()).await;
    let dead = c.node(master).queue_raft("q").unwrap();
    tracing::info!("--- the master's replica meets a storage error");
    c.node(master).fail_replica_storage("q").await.unwrap();
    wait_until(Duration::from_secs(10), "the core quits", || dead.metrics().borrow().running_state.is_err()).await;
    tracing::info!("--- a mirror is elected");
    wait_until(Duration::from_secs(20), "a mirror masters the queue", || {
        mirrors.iter().any(|id| c.node(*id).is_master("q"))
    })
    .await;
    assert!(!c.node(master).announces_quiet("q"), "a replica whose core quit is still announced quiet");
    tracing::info!("--- the failed replica runs again, as a follower");
    wait_until(Duration::from_secs(20), "the replica runs again", || {
        c.node(master).queue_raft("q").is_some_and(|r| {
            let m = r.metrics().borrow().clone();
            m.running_state.is_ok() && m.current_leader.is_some_and(|l| l != master)
        })
    })
    .await;
    publish_retrying(c.node(master), "q", b"m3".to_vec()).await;
    let got = c.node(master).get("q", 7, 10, true).await.unwrap();
    let bodies: Vec<Vec<u8>> = got.into_iter().map(|d| d.message.body).collect();
    assert_eq!(bodies, ["m0", "m1", "m2", "m3"].map(|b| b.as_bytes().to_vec()));
    let other = c.node(master).get("other", 7, 10, true).await.unwrap();
    assert_eq!(other.len(), 1, "another queue of the node lost its message");
    c.shutdown().await;
}
