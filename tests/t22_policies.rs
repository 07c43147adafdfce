//! Mirroring by policy on a live three-node cluster: groups grow and shrink
//! with the policy, new mirrors catch up, no message is lost at any step.

mod common;

use std::collections::BTreeSet;
use std::time::Duration;

use common::{fast_timing, init_tracing, policy, wait_until, Cluster};

async fn members_settle(c: &Cluster, queue: &str, n: usize) -> BTreeSet<u64> {
    let mut found = BTreeSet::new();
    wait_until(Duration::from_secs(30), "membership settles", || {
        let master = c.nodes.iter().flatten().find(|node| node.is_master(queue));
        found = master.and_then(|m| m.queue_members(queue)).unwrap_or_default();
        let meta = c.node(1).metadata();
        let wanted: BTreeSet<u64> = meta.queues[queue].replicas.iter().copied().collect();
        found.len() == n && found == wanted
    })
    .await;
    found
}

fn bodies(msgs: Vec<mirrorq::Message>) -> BTreeSet<Vec<u8>> {
    msgs.into_iter().map(|m| m.body).collect()
}

/// exactly 2 -> all -> exactly 1, with messages surviving every step and a
/// new mirror catching up with what was published before it joined.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn policy_grows_and_shrinks_a_queue_without_losing_messages() {
    init_tracing();
    let c = Cluster::start(3, fast_timing(Duration::from_secs(3))).await;
    c.node(1)
        .set_policy(policy("^ha", r#"{"ha-mode":"exactly","ha-params":2,"ha-sync-mode":"automatic"}"#))
        .await
        .unwrap();
    let q = c.node(1).declare_queue("ha-q", vec![]).await.unwrap();
    assert_eq!(q.replicas.len(), 2, "exactly 2: a master and one mirror");
    assert_eq!(q.policy.as_deref(), Some("ha"));
    common::publish_retrying(c.node(1), "ha-q", b"m1".to_vec()).await;
    members_settle(&c, "ha-q", 2).await;

    tracing::info!("--- ha-mode all: grows to three, the new mirror catches up");
    c.node(2).set_policy(policy("^ha", r#"{"ha-mode":"all","ha-sync-mode":"automatic"}"#)).await.unwrap();
    let members = members_settle(&c, "ha-q", 3).await;
    assert_eq!(members, BTreeSet::from([1, 2, 3]));
    let newcomer = (1..=3).find(|id| !q.replicas.contains(id)).unwrap();
    let nc = c.node(newcomer).clone();
    let mut has = false;
    for _ in 0..200 {
        has = bodies(nc.local_messages("ha-q").await.unwrap()).contains(b"m1".as_slice());
        if has {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(has, "new mirror did not catch up with m1");
    common::publish_retrying(c.node(3), "ha-q", b"m2".to_vec()).await;
    for id in 1..=3 {
        assert!(bodies(c.node(id).local_messages("ha-q").await.unwrap()).contains(b"m2".as_slice()), "node {id}");
    }

    tracing::info!("--- exactly 1: shrinks to one replica; the others drop their copy");
    c.node(1).set_policy(policy("^ha", r#"{"ha-mode":"exactly","ha-params":1}"#)).await.unwrap();
    let members = members_settle(&c, "ha-q", 1).await;
    let only = *members.iter().next().unwrap();
    for id in (1..=3).filter(|id| *id != only) {
        let node = c.node(id).clone();
        wait_until(Duration::from_secs(20), "removed replica stops", || node.queue_raft("ha-q").is_none()).await;
    }
    let got = c.node(1).get("ha-q", 1, 10, true).await.unwrap();
    let got: BTreeSet<Vec<u8>> = got.into_iter().map(|d| d.message.body).collect();
    assert_eq!(got, BTreeSet::from([b"m1".to_vec(), b"m2".to_vec()]));
    c.shutdown().await;
}

/// ha-mode nodes places replicas only on the listed nodes that exist.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nodes_mode_places_replicas_on_listed_nodes() {
    init_tracing();
    let c = Cluster::start(3, fast_timing(Duration::from_secs(3))).await;
    c.node(1)
        .set_policy(policy("^pinned", r#"{"ha-mode":"nodes","ha-params":["mirrorq@2","mirrorq@3","mirrorq@9"]}"#))
        .await
        .unwrap();
    let q = c.node(1).declare_queue("pinned", vec![]).await.unwrap();
    let placed: BTreeSet<u64> = q.replicas.iter().copied().collect();
    assert_eq!(placed, BTreeSet::from([2, 3]));
    common::publish_retrying(c.node(1), "pinned", b"x".to_vec()).await;
    assert!(c.node(1).queue_raft("pinned").is_none(), "node 1 is not listed");
    members_settle(&c, "pinned", 2).await;
    c.shutdown().await;
}
