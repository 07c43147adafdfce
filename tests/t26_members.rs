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
    wait_until(Duration::from_secs(10), "node 2 knows the queue", || c.node(2).metadata().queues.contains_key("all-q"))
        .await;
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

/// With a cluster secret, the node link serves only peers that prove they
/// know it: the cluster works as before; a peer without the secret, or with
/// another, gets nothing done (no vote, no append, no publish or get, no
/// hand-back), is counted, and one with another secret is told that the
/// secrets differ; a node started with another secret and `--join` stays
/// out, and one with the cluster's joins.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_node_link_serves_only_peers_that_prove_the_cluster_secret() {
    use mirrorq::link::auth::ClusterSecret;
    use mirrorq::link::transport::Transport;
    use mirrorq::queue::QueueCmd;
    use mirrorq::wire::client::NodeClient;
    use mirrorq::wire::{ask, RpcRequest, RpcResponse};
    init_tracing();
    let secret = ClusterSecret::new("the cluster's own secret");
    let mut c = Cluster::start_configured(3, fast_timing(Duration::from_secs(3)), |cfg| {
        cfg.cluster_secret = Some(secret.clone());
    })
    .await;
    let q = c.node(1).declare_queue("sq", vec![1, 2, 3]).await.unwrap();
    wait_until(Duration::from_secs(10), "node 2 knows the queue", || c.node(2).metadata().queues.contains_key("sq"))
        .await;
    common::publish_retrying(c.node(2), "sq", b"kept".to_vec()).await;
    let master = c.master_of("sq").await;
    let term = || c.node(master).queue_raft("sq").unwrap().metrics().borrow().current_term;
    let term_before = term();
    let addr = c.configs[(master - 1) as usize].raft_listen.clone();
    let refused = |c: &Cluster| c.node(master).metrics().link_refused.get();

    let vote = RpcRequest::Vote {
        group: q.group,
        epoch: Default::default(),
        from: 9,
        req: openraft::raft::VoteRequest::new(openraft::Vote::new(term_before + 5, 9), None),
    };
    let append = RpcRequest::Append {
        group: q.group,
        epoch: Default::default(),
        from: 9,
        req: mirrorq::wire::Appends::Queue(openraft::raft::AppendEntriesRequest {
            vote: openraft::Vote::new_committed(term_before + 5, 9),
            prev_log_id: None,
            entries: vec![],
            leader_commit: None,
        }),
    };
    let handback = RpcRequest::from(ask::Handback {
        group: q.group,
        epoch: Default::default(),
        batches: vec![(None, vec![(None, common::msg("smuggled"))])],
    });
    let publish = RpcRequest::from(ask::Queue {
        group: q.group,
        epoch: None,
        cmds: vec![QueueCmd::Enqueue { msgs: vec![common::msg("smuggled")] }],
        lane: mirrorq::queue::proposer::Lane::Arrival,
    });
    let get = RpcRequest::from(ask::Queue {
        group: q.group,
        epoch: None,
        cmds: vec![QueueCmd::Get { owner: 1, max: 10, auto_ack: true, consumer: None }],
        lane: mirrorq::queue::proposer::Lane::Arrival,
    });
    for (who, transport) in [
        ("no secret", Transport::new()),
        ("another secret", Transport::new().with_secret(Some(ClusterSecret::new("some other secret here")))),
    ] {
        let was = refused(&c);
        for req in [&vote, &append, &handback, &publish, &get] {
            let r: Result<RpcResponse, _> = transport.call(&addr, req, Duration::from_secs(5)).await;
            assert!(r.is_err(), "{who}: a request was answered: {r:?}");
        }
        // The listener counts once it has seen the dialler give up.
        wait_until(Duration::from_secs(5), "the refusal counted", || refused(&c) > was).await;
        tracing::info!(who, "refused");
    }
    let told = NodeClient::with_secret(addr.clone(), ClusterSecret::new("some other secret here"))
        .queue_info("sq")
        .await
        .expect_err("answered with another secret");
    assert!(told.to_string().contains("cluster secret differs"), "{told}");

    // Nothing the refused peers sent took effect.
    assert_eq!(term(), term_before, "a vote or append from outside moved the term");
    let got = c.node(3).get("sq", 7, 10, false).await.unwrap();
    let bodies: Vec<_> = got.iter().map(|d| d.message.body.clone()).collect();
    assert_eq!(bodies, vec![b"kept".to_vec()], "the queue holds what the cluster put there, only");

    // Another secret with --join: not let in. The cluster's: in.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = mirrorq::NodeConfig::new(4, dir.path(), listener.local_addr().unwrap().to_string());
    cfg.timing = c.configs[0].timing.clone();
    cfg.join = Some(c.configs[0].raft_listen.clone());
    cfg.cluster_secret = Some(ClusterSecret::new("some other secret here"));
    let outsider = mirrorq::Node::start_with_listener(cfg, listener).await.expect("starts");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!c.node(1).metadata().nodes.contains_key(&4), "a node with another secret joined");
    outsider.shutdown().await;
    drop(dir);
    let four = c.add_node(1).await;
    wait_until(Duration::from_secs(30), "the node with the cluster's secret joins", || {
        c.node(1).metadata().nodes.contains_key(&four)
    })
    .await;
    c.shutdown().await;
}

/// With `--tls-node-link`, every node-link connection is mutual TLS under
/// the cluster's CA, with the secret proved inside it: the cluster serves
/// across nodes; a peer that knows the secret but speaks no TLS, or shows a
/// certificate of another CA, is refused and counted; one with the
/// cluster's certificate and secret is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_node_link_over_mutual_tls_serves_only_the_clusters_certificates() {
    use mirrorq::link::auth::ClusterSecret;
    use mirrorq::link::transport::Transport;
    use mirrorq::tls::TlsFiles;
    use mirrorq::wire::{ClientRequest, RpcRequest, RpcResponse};
    use std::sync::Arc;
    init_tracing();
    let dir = tempfile::tempdir().unwrap();
    let ours = common::certificates(&dir.path().join("ours").tap_mkdir());
    let theirs = common::certificates(&dir.path().join("theirs").tap_mkdir());
    let files = |c: &[std::path::PathBuf; 5]| TlsFiles {
        cert: c[1].clone(),
        key: c[2].clone(),
        ca: Some(c[0].clone()),
        verify_peer: true,
    };
    let link = Arc::new(files(&ours).link_tls().unwrap());
    let secret = ClusterSecret::new("the cluster's own secret");
    let c = Cluster::start_configured(3, fast_timing(Duration::from_secs(3)), |cfg| {
        cfg.cluster_secret = Some(secret.clone());
        cfg.link_tls = Some(link.clone());
    })
    .await;
    c.node(1).declare_queue("tq", vec![1, 2, 3]).await.unwrap();
    wait_until(Duration::from_secs(10), "node 2 knows the queue", || c.node(2).metadata().queues.contains_key("tq"))
        .await;
    common::publish_retrying(c.node(2), "tq", b"over tls".to_vec()).await;
    let got = c.node(3).get("tq", 7, 10, true).await.unwrap();
    assert_eq!(got.len(), 1, "served across the nodes over TLS");

    let addr = c.configs[0].raft_listen.clone();
    let ask = RpcRequest::Client(ClientRequest::QueueInfo { name: "tq".into(), declared: false });
    let refused = |c: &Cluster| c.node(1).metrics().link_refused.get();
    for (who, transport) in [
        ("the secret, no TLS", Transport::new().with_secret(Some(secret.clone()))),
        (
            "the secret, another CA's certificate",
            Transport::new()
                .with_secret(Some(secret.clone()))
                .with_tls(Some(Arc::new(files(&theirs).link_tls().unwrap()))),
        ),
    ] {
        let was = refused(&c);
        let r: Result<RpcResponse, _> = transport.call(&addr, &ask, Duration::from_secs(5)).await;
        assert!(r.is_err(), "{who}: answered: {r:?}");
        wait_until(Duration::from_secs(5), "the refusal counted", || refused(&c) > was).await;
    }
    let member = Transport::new().with_secret(Some(secret.clone())).with_tls(Some(link.clone()));
    let r: Result<RpcResponse, _> = member.call(&addr, &ask, Duration::from_secs(5)).await;
    assert!(r.is_ok(), "the cluster's certificate and secret: {r:?}");
    c.shutdown().await;
}

trait TapMkdir {
    fn tap_mkdir(self) -> Self;
}

impl TapMkdir for std::path::PathBuf {
    fn tap_mkdir(self) -> Self {
        std::fs::create_dir_all(&self).unwrap();
        self
    }
}
