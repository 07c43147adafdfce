//! The on-disk queue state machine through openraft's trait, as a follower
//! catching up applies it: many entries per call, and restarts in between.

use mirrorq::queue::{Message, QueueCmd, QueueMachine, QueueReply};
use mirrorq::raft::state_machine::StateMachine;
use mirrorq::raft::types::{Request, Response, TypeConfig};
use mirrorq_storage::{DbOptions, NodeDb, SmSpace};
use openraft::storage::RaftStateMachine;
use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId};

fn entry(index: u64, cmds: Vec<QueueCmd>) -> Entry<TypeConfig> {
    Entry {
        log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(Request::Queue(cmds)),
    }
}

fn msg(b: &str) -> Message {
    Message { exchange: "x".into(), routing_key: "rk".into(), properties: vec![9], body: b.as_bytes().to_vec() }
}

fn delivered(r: &Response) -> Vec<(Vec<u8>, bool)> {
    let Response::Queue(replies) = r else { panic!("not a queue reply: {r:?}") };
    replies
        .iter()
        .flat_map(|q| match q {
            QueueReply::Got { msgs, .. } => msgs.iter().map(|d| (d.message.body.clone(), d.redelivered)).collect(),
            _ => Vec::new(),
        })
        .collect()
}

/// A get in one entry sees a publish from an earlier entry of the same
/// apply call (a catching-up follower applies many entries at once).
#[tokio::test]
async fn get_sees_publish_from_earlier_entry_in_same_apply() {
    let dir = tempfile::tempdir().unwrap();
    let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
    let mut sm = StateMachine::<QueueMachine>::open(SmSpace::new(db, 5), 1).unwrap();
    let out = sm
        .apply(vec![
            entry(1, vec![QueueCmd::Enqueue { msgs: vec![msg("a"), msg("b")] }]),
            entry(2, vec![QueueCmd::Get { owner: 1, max: 1, auto_ack: true }]),
            entry(3, vec![QueueCmd::Get { owner: 1, max: 1, auto_ack: false }]),
        ])
        .await
        .unwrap();
    assert_eq!(delivered(&out[1]), vec![(b"a".to_vec(), false)]);
    assert_eq!(delivered(&out[2]), vec![(b"b".to_vec(), false)]);
}

/// State, counters and requeue order survive a reopen, and the message
/// properties come back byte for byte.
#[tokio::test]
async fn state_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        let mut sm = StateMachine::<QueueMachine>::open(SmSpace::new(db.clone(), 5), 1).unwrap();
        sm.apply(vec![
            entry(1, vec![QueueCmd::Enqueue { msgs: vec![msg("a"), msg("b"), msg("c")] }]),
            entry(2, vec![QueueCmd::Get { owner: 1, max: 2, auto_ack: false }]),
            // tags 0 (a) and 1 (b): requeue b first, then a
            entry(3, vec![QueueCmd::Nack { tags: vec![1, 0], requeue: true }]),
        ])
        .await
        .unwrap();
        db.flusher().sync().await.unwrap();
    }
    let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
    let mut sm = StateMachine::<QueueMachine>::open(SmSpace::new(db, 5), 1).unwrap();
    let (applied, _) = sm.applied_state().await.unwrap();
    assert_eq!(applied.map(|l| l.index), Some(3));
    let out = sm.apply(vec![entry(4, vec![QueueCmd::Get { owner: 2, max: 10, auto_ack: false }])]).await.unwrap();
    assert_eq!(
        delivered(&out[0]),
        vec![(b"b".to_vec(), true), (b"a".to_vec(), true), (b"c".to_vec(), false)],
        "requeued first, in requeue order, then the rest"
    );
    let Response::Queue(r) = &out[0] else { panic!() };
    let QueueReply::Got { msgs, .. } = &r[0] else { panic!() };
    assert_eq!(msgs[0].message, msg("b"));
    assert_eq!(msgs.iter().map(|d| d.tag).collect::<Vec<_>>(), vec![2, 3, 4], "tags keep counting after restart");
}

/// A mirror does not read bodies for deliveries: only the node that
/// proposed an entry answers it. So a mirror lacking a body (one still
/// catching up) applies a get of that message instead of failing with a
/// fatal storage error, and the node that answers still gets the body.
#[tokio::test]
async fn only_the_answering_node_reads_delivered_bodies() {
    let dir = tempfile::tempdir().unwrap();
    let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
    let publish = entry(1, vec![QueueCmd::Enqueue { msgs: vec![msg("a"), msg("b")] }]);
    let get = entry(2, vec![QueueCmd::Get { owner: 2, max: 1, auto_ack: false }]);

    // Node 2, following leader 1 (the entries' proposer), without the body of seq 0.
    let mut mirror = StateMachine::<QueueMachine>::open(SmSpace::new(db.clone(), 7), 2).unwrap();
    mirror.apply(vec![publish.clone()]).await.unwrap();
    let mut body_key = vec![b'b'];
    body_key.extend(0u64.to_be_bytes());
    db.sm_tree().remove(SmSpace::new(db.clone(), 7).key(&body_key)).unwrap();
    let out = mirror.apply(vec![get.clone()]).await.expect("a mirror applies a get of a body it lacks");
    let Response::Queue(r) = &out[0] else { panic!() };
    assert!(matches!(&r[0], QueueReply::Got { msgs, remaining: 1 } if msgs.is_empty()), "{r:?}");

    // Node 1, which proposed them, answers with the body.
    let mut master = StateMachine::<QueueMachine>::open(SmSpace::new(db, 8), 1).unwrap();
    master.apply(vec![publish]).await.unwrap();
    let out = master.apply(vec![get]).await.unwrap();
    assert_eq!(delivered(&out[0]), vec![(b"a".to_vec(), false)]);
}
