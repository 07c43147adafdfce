//! The on-disk queue state machine through openraft's trait, as a follower
//! catching up applies it: many entries per call, and restarts in between.

use mirrorq::queue::QueueTypes;
use mirrorq::queue::{Message, QueueCmd, QueueMachine, QueueReply};
use mirrorq::raft::state_machine::StateMachine;
use mirrorq_storage::{DbOptions, NodeDb, SmSpace};
use openraft::storage::{RaftSnapshotBuilder, RaftStateMachine};
use openraft::{CommittedLeaderId, Entry, EntryPayload, LogId};

/// The node database in `dir` and the queue machine of group 5 over it
/// (opened again, it is what a restart after kill -9 finds).
fn open_queue(dir: &std::path::Path) -> (NodeDb, SmSpace, StateMachine<QueueMachine>) {
    let db = NodeDb::open(dir, &DbOptions::default()).unwrap();
    let space = SmSpace::new(db.clone(), 5);
    let sm = StateMachine::<QueueMachine>::open(space.clone(), 1).unwrap();
    (db, space, sm)
}

/// A master's replica (node 1) that sends snapshots: `entries` applied,
/// then a snapshot built, which is returned.
async fn snapshot_after(
    db: &NodeDb,
    sm: &mut StateMachine<QueueMachine>,
    entries: Vec<Entry<QueueTypes>>,
) -> openraft::storage::Snapshot<QueueTypes> {
    sm.apply(logged(db, 5, entries)).await.unwrap();
    sm.get_snapshot_builder().await.build_snapshot().await.unwrap();
    sm.get_current_snapshot().await.unwrap().expect("a snapshot was built")
}

/// A mirror's replica (node 2) of the same queue, on a data dir of its own.
fn open_mirror(dir: &std::path::Path) -> (NodeDb, StateMachine<QueueMachine>) {
    let db = NodeDb::open(dir, &DbOptions::default()).unwrap();
    let sm = StateMachine::<QueueMachine>::open(SmSpace::new(db.clone(), 5), 2).unwrap();
    (db, sm)
}

fn entry(index: u64, cmds: Vec<QueueCmd>) -> Entry<QueueTypes> {
    Entry {
        log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Normal(std::sync::Arc::new(cmds)),
    }
}

/// Append `entries` to group `group`'s log, as Raft does before it applies
/// them: the machine leaves published bodies there until a snapshot.
fn logged(db: &NodeDb, group: u64, entries: Vec<Entry<QueueTypes>>) -> Vec<Entry<QueueTypes>> {
    let raw: Vec<(u64, Vec<u8>)> =
        entries.iter().map(|e| (e.log_id.index, mirrorq_storage::keys::encode(e, "entry").unwrap())).collect();
    db.wal().append(group, &raw).unwrap();
    entries
}

fn msg(b: &str) -> Message {
    Message { exchange: "x".into(), routing_key: "rk".into(), properties: vec![9], body: b.as_bytes().to_vec() }
}

fn delivered(replies: &[QueueReply]) -> Vec<(Vec<u8>, bool)> {
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
    let (db, _space, mut sm) = open_queue(dir.path());
    let out = sm
        .apply(logged(
            &db,
            5,
            vec![
                entry(1, vec![QueueCmd::Enqueue { msgs: vec![msg("a"), msg("b")] }]),
                entry(2, vec![QueueCmd::Get { owner: 1, max: 1, auto_ack: true, consumer: None }]),
                entry(3, vec![QueueCmd::Get { owner: 1, max: 1, auto_ack: false, consumer: None }]),
            ],
        ))
        .await
        .unwrap();
    assert_eq!(delivered(&out[1]), vec![(b"a".to_vec(), false)]);
    assert_eq!(delivered(&out[2]), vec![(b"b".to_vec(), false)]);
}

/// State, counters and the places of requeued messages survive a reopen,
/// and the message properties come back byte for byte.
#[tokio::test]
async fn state_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (db, _space, mut sm) = open_queue(dir.path());
        sm.apply(logged(
            &db,
            5,
            vec![
                entry(1, vec![QueueCmd::Enqueue { msgs: vec![msg("a"), msg("b"), msg("c")] }]),
                entry(2, vec![QueueCmd::Get { owner: 1, max: 2, auto_ack: false, consumer: None }]),
                // tags 0 (a) and 1 (b): requeue b first, then a; both go
                // back to their places, a before b
                entry(3, vec![QueueCmd::Nack { tags: vec![1, 0], requeue: true }]),
            ],
        ))
        .await
        .unwrap();
        db.flusher().sync().await.unwrap();
    }
    let (db, _space, mut sm) = open_queue(dir.path());
    let (applied, _) = sm.applied_state().await.unwrap();
    assert_eq!(applied.map(|l| l.index), Some(3));
    let get = vec![entry(4, vec![QueueCmd::Get { owner: 2, max: 10, auto_ack: false, consumer: None }])];
    let out = sm.apply(logged(&db, 5, get)).await.unwrap();
    assert_eq!(
        delivered(&out[0]),
        vec![(b"a".to_vec(), true), (b"b".to_vec(), true), (b"c".to_vec(), false)],
        "requeued first, in their places, then the rest"
    );
    let r = &out[0];
    let QueueReply::Got { msgs, .. } = &r[0] else { panic!() };
    assert_eq!(msgs[0].message, msg("a"));
    assert_eq!(msgs.iter().map(|d| d.tag).collect::<Vec<_>>(), vec![2, 3, 4], "tags keep counting after restart");
}

/// A message's count of returns survives a reopen: delivered after it, it
/// carries `x-delivery-count`.
#[tokio::test]
async fn counts_of_returns_survive_reopen() {
    use amq_protocol::types::AMQPValue;
    let dir = tempfile::tempdir().unwrap();
    {
        let (db, _space, mut sm) = open_queue(dir.path());
        let m = Message { properties: Vec::new(), ..msg("p") };
        sm.apply(logged(
            &db,
            5,
            vec![
                entry(1, vec![QueueCmd::Enqueue { msgs: vec![m] }]),
                entry(2, vec![QueueCmd::Get { owner: 1, max: 1, auto_ack: false, consumer: None }]),
                entry(3, vec![QueueCmd::Nack { tags: vec![0], requeue: true }]),
            ],
        ))
        .await
        .unwrap();
        db.flusher().sync().await.unwrap();
    }
    let (db, _space, mut sm) = open_queue(dir.path());
    let get = vec![entry(4, vec![QueueCmd::Get { owner: 2, max: 1, auto_ack: false, consumer: None }])];
    let out = sm.apply(logged(&db, 5, get)).await.unwrap();
    let QueueReply::Got { msgs, .. } = &out[0][0] else { panic!("{:?}", out[0]) };
    let props = mirrorq::message::decode_properties(&msgs[0].message.properties);
    let count = props.headers().as_ref().and_then(|h| h.inner().get("x-delivery-count").cloned());
    assert_eq!(count, Some(AMQPValue::LongLongInt(1)));
}

/// A single-active-consumer registry and a priority queue's order survive
/// a reopen: the consumer active before is the one served after, and
/// prioritized messages come back highest first.
#[tokio::test]
async fn consumer_registrations_and_priorities_survive_reopen() {
    use mirrorq::queue::types::{ConsumerRef, Limits};
    let dir = tempfile::tempdir().unwrap();
    let prio = |b: &str, p: u8| {
        let props = amq_protocol::protocol::basic::AMQPProperties::default().with_priority(p);
        Message { properties: mirrorq::message::encode_properties(&props), ..msg(b) }
    };
    let consume = |owner, priority| QueueCmd::Consume {
        owner,
        consumer: ConsumerRef { number: 1, priority },
        single_active: true,
    };
    let get =
        |owner| QueueCmd::Get { owner, max: 1, auto_ack: true, consumer: Some(ConsumerRef { number: 1, priority: 0 }) };
    {
        let (db, _space, mut sm) = open_queue(dir.path());
        let stamp = QueueCmd::Stamp { now_ms: 1, limits: Limits { max_priority: Some(9), ..Limits::default() } };
        let publish = QueueCmd::Enqueue { msgs: vec![msg("low"), prio("mid", 4), prio("high", 9), prio("mid2", 4)] };
        sm.apply(logged(
            &db,
            5,
            vec![entry(1, vec![stamp, publish]), entry(2, vec![consume(7, 0)]), entry(3, vec![consume(8, 0)])],
        ))
        .await
        .unwrap();
        db.flusher().sync().await.unwrap();
    }
    let (db, _space, mut sm) = open_queue(dir.path());
    let out = sm
        .apply(logged(
            &db,
            5,
            vec![
                entry(4, vec![get(8)]),
                entry(5, vec![get(7)]),
                entry(6, vec![QueueCmd::Cancel { owner: 7, number: 1 }, get(8)]),
                entry(7, vec![consume(9, 5), get(8), get(9)]),
                entry(8, vec![QueueCmd::Release { owner: 9 }, get(8)]),
            ],
        ))
        .await
        .unwrap();
    assert!(delivered(&out[0]).is_empty(), "owner 8 registered second: not active");
    assert_eq!(delivered(&out[1]), vec![(b"high".to_vec(), false)], "the first registered, highest priority first");
    assert_eq!(delivered(&out[2]), vec![(b"mid".to_vec(), false)], "cancelled: the next one is active");
    assert_eq!(delivered(&out[3]), vec![(b"mid2".to_vec(), false)], "a consumer of a higher priority is active");
    assert_eq!(delivered(&out[4]), vec![(b"low".to_vec(), false)], "its owner released: 8 again");
}

/// What a re-formed epoch's fork record marks as maybe delivered (plain
/// and prioritized messages alike) stays marked across a reopen; what is
/// published after the fork does not.
#[tokio::test]
async fn messages_held_at_a_fork_stay_redelivered_after_a_reopen() {
    use mirrorq::queue::epoch::{Epoch, ForkRecord};
    use mirrorq::queue::types::Limits;
    let dir = tempfile::tempdir().unwrap();
    let prio = |b: &str, p: u8| {
        let props = amq_protocol::protocol::basic::AMQPProperties::default().with_priority(p);
        Message { properties: mirrorq::message::encode_properties(&props), ..msg(b) }
    };
    let stamp = || QueueCmd::Stamp { now_ms: 1, limits: Limits { max_priority: Some(9), ..Limits::default() } };
    {
        let (db, _space, mut sm) = open_queue(dir.path());
        let fork = ForkRecord { epoch: Epoch { term: 3, node: 1 }, ..ForkRecord::default() };
        sm.apply(logged(
            &db,
            5,
            vec![
                entry(1, vec![stamp(), QueueCmd::Enqueue { msgs: vec![msg("plain"), prio("high", 5)] }]),
                entry(2, vec![QueueCmd::Fork(fork)]),
                entry(3, vec![stamp(), QueueCmd::Enqueue { msgs: vec![msg("after")] }]),
            ],
        ))
        .await
        .unwrap();
        db.flusher().sync().await.unwrap();
    }
    let (db, _space, mut sm) = open_queue(dir.path());
    let get = vec![entry(4, vec![QueueCmd::Get { owner: 2, max: 10, auto_ack: false, consumer: None }])];
    let out = sm.apply(logged(&db, 5, get)).await.unwrap();
    assert_eq!(
        delivered(&out[0]),
        vec![(b"high".to_vec(), true), (b"plain".to_vec(), true), (b"after".to_vec(), false)]
    );
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
    let get = entry(2, vec![QueueCmd::Get { owner: 2, max: 1, auto_ack: false, consumer: None }]);

    // Node 2, following leader 1 (the entries' proposer), without the
    // bodies: the entries are not in its log.
    let mut mirror = StateMachine::<QueueMachine>::open(SmSpace::new(db.clone(), 7), 2).unwrap();
    mirror.apply(vec![publish.clone()]).await.unwrap();
    let out = mirror.apply(vec![get.clone()]).await.expect("a mirror applies a get of a body it lacks");
    let r = &out[0];
    assert!(matches!(&r[0], QueueReply::Got { msgs, remaining: 1 } if msgs.is_empty()), "{r:?}");

    // Node 1, which proposed them, answers with the body.
    let mut master = StateMachine::<QueueMachine>::open(SmSpace::new(db.clone(), 8), 1).unwrap();
    master.apply(logged(&db, 8, vec![publish])).await.unwrap();
    let out = master.apply(logged(&db, 8, vec![get])).await.unwrap();
    assert_eq!(delivered(&out[0]), vec![(b"a".to_vec(), false)]);
}

/// Bodies are stored in chunks and deliveries in runs; whatever the mix of
/// publishes, gets, acks, requeues and reopens, the machine on disk answers
/// exactly as the pure in-memory state says, keeps the body of every held
/// message and of no other, and leaves no key behind once the queue is empty.
#[tokio::test]
async fn disk_layout_agrees_with_the_pure_state_across_reopens() {
    use mirrorq::queue::state::{Change, QueueState};
    use rand::{rngs::StdRng, Rng, SeedableRng};
    use std::collections::BTreeMap;

    for seed in 0..12u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let dir = tempfile::tempdir().unwrap();
        let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
        let space = || SmSpace::new(db.clone(), 9);
        let mut sm = StateMachine::<QueueMachine>::open(space(), 1).unwrap();
        let mut model = QueueState::default();
        let mut bodies: BTreeMap<u64, Message> = BTreeMap::new();
        let mut unacked: Vec<u64> = Vec::new();
        let mut n = 0u64;
        for index in 1..=300u64 {
            let mut cmds = Vec::new();
            for _ in 0..rng.gen_range(1..=3) {
                let cmd = match rng.gen_range(0..10) {
                    0..=3 => QueueCmd::Enqueue {
                        msgs: (0..rng.gen_range(1..=20))
                            .map(|_| {
                                n += 1;
                                // Some large ones, so that an entry's messages fill several chunks.
                                let pad = if rng.gen_bool(0.2) { 6000 } else { 0 };
                                msg(&format!("m{n}{}", "-".repeat(pad)))
                            })
                            .collect(),
                    },
                    4 | 5 => QueueCmd::Get {
                        owner: rng.gen_range(1..=2),
                        max: rng.gen_range(1..=30),
                        auto_ack: rng.gen_bool(0.2),
                        consumer: None,
                    },
                    6 | 7 if !unacked.is_empty() => {
                        let k = rng.gen_range(1..=unacked.len());
                        QueueCmd::Ack { tags: unacked.drain(..k).collect() }
                    }
                    8 if !unacked.is_empty() => {
                        let i = rng.gen_range(0..unacked.len());
                        QueueCmd::Nack { tags: vec![unacked.remove(i)], requeue: rng.gen_bool(0.7) }
                    }
                    9 if index % 50 == 0 => QueueCmd::Purge,
                    _ => QueueCmd::Release { owner: 2 },
                };
                cmds.push(cmd);
            }
            // The model: which messages each command delivers, keeps and drops.
            model.begin_entry();
            let mut expected = Vec::new();
            for cmd in &cmds {
                let mut changes = Vec::new();
                model.apply(cmd, &mut changes);
                for ch in changes {
                    match ch {
                        Change::Insert { seq, batch_index } => {
                            bodies.insert(seq, cmd.messages().unwrap()[batch_index].clone());
                        }
                        Change::Deliver { seq, tag, redelivered, .. } => {
                            expected.push((bodies[&seq].body.clone(), tag, redelivered))
                        }
                        Change::Remove { seq, .. } => {
                            bodies.remove(&seq);
                        }
                        _ => {}
                    }
                }
            }
            let out = sm.apply(logged(&db, 9, vec![entry(index, cmds)])).await.unwrap();
            let replies = &out[0];
            let got: Vec<_> = replies
                .iter()
                .flat_map(|r| match r {
                    QueueReply::Got { msgs, .. } => {
                        msgs.iter().map(|d| (d.message.body.clone(), d.tag, d.redelivered)).collect()
                    }
                    _ => Vec::new(),
                })
                .collect();
            assert_eq!(got, expected, "seed {seed}, entry {index}");
            // Track what is outstanding as the model has it (Release and Nack may requeue).
            unacked = model
                .states()
                .into_iter()
                .filter_map(|(_, st)| match st {
                    mirrorq::queue::MsgState::Unacked { tag, .. } => Some(tag),
                    _ => None,
                })
                .collect();
            unacked.sort_unstable();
            if rng.gen_bool(0.1) {
                drop(sm);
                sm = StateMachine::<QueueMachine>::open(space(), 1).unwrap();
            }
            if rng.gen_bool(0.1) {
                // A snapshot copies the held bodies out of the log, which
                // may go after it: none is left referenced there.
                sm.get_snapshot_builder().await.build_snapshot().await.unwrap();
                assert!(space().scan(b"R").next().is_none(), "seed {seed}, entry {index}: a body left in the log");
            }
            if index % 25 == 0 {
                let mut stored = QueueMachine::stored_messages(&space()).unwrap();
                stored.sort_by(|a, b| a.body.cmp(&b.body));
                let mut want: Vec<Message> = bodies.values().cloned().collect();
                want.sort_by(|a, b| a.body.cmp(&b.body));
                assert_eq!(stored, want, "seed {seed}, entry {index}: stored bodies");
            }
        }
        // Drain and settle everything: no chunk, run or state key may stay.
        let last = 301;
        let out = sm
            .apply(logged(
                &db,
                9,
                vec![entry(
                    last,
                    vec![
                        QueueCmd::Release { owner: 1 },
                        QueueCmd::Release { owner: 2 },
                        QueueCmd::Get { owner: 3, max: u32::MAX, auto_ack: true, consumer: None },
                    ],
                )],
            ))
            .await
            .unwrap();
        let left = bodies.len();
        assert_eq!(delivered(&out[0]).len(), left, "seed {seed}");
        drop(sm);
        let sm = StateMachine::<QueueMachine>::open(space(), 1).unwrap();
        drop(sm);
        let keys: Vec<u8> = space().scan(b"").map(|kv| kv.unwrap().0[0]).filter(|k| b"BRusn".contains(k)).collect();
        assert!(keys.is_empty(), "seed {seed}: keys left behind: {:?}", String::from_utf8_lossy(&keys));
    }
}

/// Every key of group 5, group-relative, with its value.
fn group_keys(space: &SmSpace) -> std::collections::BTreeMap<Vec<u8>, Vec<u8>> {
    space.scan(b"").map(|kv| kv.map(|(k, v)| (k, v.to_vec())).unwrap()).collect()
}

/// A crash can cut a step short after its applied record is stored: sled
/// recovers a prefix of its writes, and the record goes first. Reopening
/// finishes the step from the record's redo writes, so the state is the
/// one the whole step left, not a mix of before and after.
#[tokio::test]
async fn a_step_cut_short_by_a_crash_is_finished_from_its_redo_record() {
    let dir = tempfile::tempdir().unwrap();
    let (before, after) = {
        let (db, space, mut sm) = open_queue(dir.path());
        sm.apply(logged(
            &db,
            5,
            vec![
                entry(1, vec![QueueCmd::Enqueue { msgs: vec![msg("a"), msg("b"), msg("c")] }]),
                entry(2, vec![QueueCmd::Get { owner: 1, max: 2, auto_ack: false, consumer: None }]),
            ],
        ))
        .await
        .unwrap();
        let before = group_keys(&space);
        // One step that adds, rewrites and removes keys: acks a (its chunk
        // stays for b and c), requeues b, publishes d and e.
        let step = vec![entry(
            3,
            vec![
                QueueCmd::Ack { tags: vec![0] },
                QueueCmd::Nack { tags: vec![1], requeue: true },
                QueueCmd::Enqueue { msgs: vec![msg("d"), msg("e")] },
            ],
        )];
        sm.apply(logged(&db, 5, step)).await.unwrap();
        let after = group_keys(&space);
        assert_ne!(before, after);
        // The crash: of the step's writes only the record survived.
        let mut undo = mirrorq_storage::Batch::default();
        for k in after.keys().filter(|k| !before.contains_key(*k)) {
            undo.remove(space.key(k));
        }
        for (k, v) in before.iter().filter(|(k, _)| k.as_slice() != b"_applied") {
            undo.insert(space.key(k), v.clone());
        }
        space.apply(undo).unwrap();
        let cut = group_keys(&space);
        assert_ne!(cut, after, "the simulated crash lost the step's writes");
        assert_eq!(cut.get(b"_applied".as_slice()), after.get(b"_applied".as_slice()));
        db.flusher().sync().await.unwrap();
        (before, after)
    };
    let (db, space, mut sm) = open_queue(dir.path());
    assert_eq!(group_keys(&space), after, "reopening finished the step");
    assert_ne!(group_keys(&space), before);
    let (applied, _) = sm.applied_state().await.unwrap();
    assert_eq!(applied.map(|l| l.index), Some(3));
    let get = vec![entry(4, vec![QueueCmd::Get { owner: 2, max: 10, auto_ack: false, consumer: None }])];
    let out = sm.apply(logged(&db, 5, get)).await.unwrap();
    assert_eq!(
        delivered(&out[0]),
        vec![(b"b".to_vec(), true), (b"c".to_vec(), false), (b"d".to_vec(), false), (b"e".to_vec(), false)],
        "a acked, b requeued, d and e published: all of step 3"
    );
}

/// A publish's bodies stay in its log entry: applying it writes a
/// reference, not the bodies. A restart serves them from the log, and a
/// snapshot copies the held ones into chunks, after which the log may go.
#[tokio::test]
async fn bodies_stay_in_the_log_until_a_snapshot_copies_them() {
    let prefixes =
        |space: &SmSpace| -> Vec<u8> { group_keys(space).keys().map(|k| k[0]).filter(|k| b"BR".contains(k)).collect() };
    let dir = tempfile::tempdir().unwrap();
    {
        let (db, space, mut sm) = open_queue(dir.path());
        let publish = vec![entry(1, vec![QueueCmd::Enqueue { msgs: vec![msg("a"), msg("b"), msg("c")] }])];
        sm.apply(logged(&db, 5, publish)).await.unwrap();
        assert_eq!(prefixes(&space), b"R", "one reference, no chunk");
        let get = vec![entry(2, vec![QueueCmd::Get { owner: 1, max: 1, auto_ack: true, consumer: None }])];
        sm.apply(logged(&db, 5, get)).await.unwrap();
        db.flusher().sync().await.unwrap();
    }
    // As after kill -9: the bodies come back from the log.
    let (db, space, mut sm) = open_queue(dir.path());
    assert_eq!(prefixes(&space), b"R");
    let get = vec![entry(3, vec![QueueCmd::Get { owner: 1, max: 1, auto_ack: false, consumer: None }])];
    let out = sm.apply(logged(&db, 5, get)).await.unwrap();
    assert_eq!(delivered(&out[0]), vec![(b"b".to_vec(), false)]);
    let r = &out[0];
    let QueueReply::Got { msgs, .. } = &r[0] else { panic!("{r:?}") };
    let tag_b = msgs[0].tag;

    sm.get_snapshot_builder().await.build_snapshot().await.unwrap();
    assert_eq!(prefixes(&space), b"B", "the held bodies copied into a chunk, the reference gone");
    // The log goes: b (unacked) and c are still there, a (consumed) is not.
    db.wal().purge(5, 3);
    assert_eq!(space.log_entry(1).unwrap(), None, "the log no longer has the publish");
    let mut stored: Vec<Vec<u8>> = QueueMachine::stored_messages(&space).unwrap().into_iter().map(|m| m.body).collect();
    stored.sort();
    assert_eq!(stored, vec![b"b".to_vec(), b"c".to_vec()]);
    let requeue_and_get = vec![entry(
        4,
        vec![
            QueueCmd::Nack { tags: vec![tag_b], requeue: true },
            QueueCmd::Get { owner: 1, max: 5, auto_ack: true, consumer: None },
        ],
    )];
    let out = sm.apply(logged(&db, 5, requeue_and_get)).await.unwrap();
    assert_eq!(delivered(&out[0]), vec![(b"b".to_vec(), true), (b"c".to_vec(), false)]);
    assert!(prefixes(&space).is_empty(), "every body consumed: nothing left");
}

/// A queue leaves at most 16 MiB of bodies in the log: past that, the
/// oldest are copied into chunks as entries are applied, so the copy a
/// snapshot makes stays small. Every body is still delivered, in order.
#[tokio::test]
async fn a_backlog_past_its_bound_moves_out_of_the_log_as_it_grows() {
    let dir = tempfile::tempdir().unwrap();
    let (db, space, mut sm) = open_queue(dir.path());
    let big = |i: u64| msg(&format!("{i:04}{}", "x".repeat(1 << 20)));
    for i in 1..=24u64 {
        let publish = vec![entry(i, vec![QueueCmd::Enqueue { msgs: vec![big(i)] }])];
        sm.apply(logged(&db, 5, publish)).await.unwrap();
    }
    let keys = group_keys(&space);
    let in_log = keys.keys().filter(|k| k[0] == b'R').count();
    let chunks = keys.keys().filter(|k| k[0] == b'B').count();
    assert!((15..=16).contains(&in_log), "{in_log} bodies of 1 MiB left in the log");
    assert_eq!(in_log + chunks, 24, "every other body in a chunk");
    let get = vec![entry(25, vec![QueueCmd::Get { owner: 1, max: 100, auto_ack: true, consumer: None }])];
    let out = sm.apply(logged(&db, 5, get)).await.unwrap();
    let got: Vec<Vec<u8>> = delivered(&out[0]).into_iter().map(|(b, _)| b).collect();
    assert_eq!(got, (1..=24u64).map(|i| big(i).body).collect::<Vec<_>>());
}

/// openraft takes the current state for its snapshot (at start-up, and to
/// send it to a replica) and may purge the log up to it: the bodies that
/// state still reads from the log are copied out first.
#[tokio::test]
async fn the_current_snapshot_copies_bodies_out_of_the_log() {
    let dir = tempfile::tempdir().unwrap();
    let (db, space, mut sm) = open_queue(dir.path());
    sm.get_snapshot_builder().await.build_snapshot().await.unwrap();
    let publish = vec![entry(1, vec![QueueCmd::Enqueue { msgs: vec![msg("a"), msg("b")] }])];
    sm.apply(logged(&db, 5, publish)).await.unwrap();
    let snap = sm.get_current_snapshot().await.unwrap().expect("a snapshot was built");
    let upto = snap.meta.last_log_id.expect("covers the publish").index;
    assert_eq!(upto, 1);
    db.wal().purge(5, upto);
    let bodies: Vec<Vec<u8>> = QueueMachine::stored_messages(&space).unwrap().into_iter().map(|m| m.body).collect();
    assert_eq!(bodies, vec![b"a".to_vec(), b"b".to_vec()]);
    let get = vec![entry(2, vec![QueueCmd::Get { owner: 1, max: 5, auto_ack: true, consumer: None }])];
    let out = sm.apply(logged(&db, 5, get)).await.unwrap();
    assert_eq!(delivered(&out[0]), vec![(b"a".to_vec(), false), (b"b".to_vec(), false)]);
}

/// openraft purges a replica's log up to a snapshot it installed once
/// `install_snapshot` returns: the installed state must be on disk by
/// then, or a crash right after leaves the replica with neither the state
/// nor the entries it came from.
#[tokio::test]
async fn an_installed_snapshot_survives_a_crash_right_after_the_install() {
    let sender_dir = tempfile::tempdir().unwrap();
    let (sender_db, _, mut sender) = open_queue(sender_dir.path());
    sender.enable_snapshot_transfer();
    let entries = vec![
        entry(1, vec![QueueCmd::Enqueue { msgs: vec![msg("a"), msg("b"), msg("c")] }]),
        entry(2, vec![QueueCmd::Get { owner: 1, max: 1, auto_ack: false, consumer: None }]),
    ];
    let snap = snapshot_after(&sender_db, &mut sender, entries).await;
    assert_eq!(snap.meta.last_log_id.map(|l| l.index), Some(2));

    let dir = tempfile::tempdir().unwrap();
    let installed = {
        let (db, space, mut sm) = open_queue(dir.path());
        // The crash loses every sled write no sync covered (a power loss).
        db.keep_crash_image().unwrap();
        sm.install_snapshot(&snap.meta, snap.snapshot).await.unwrap();
        let installed = group_keys(&space);
        assert!(!installed.is_empty());
        drop((sm, space));
        db.crash_for_tests().unwrap();
        installed
    };
    let (_db, space, mut sm) = open_queue(dir.path());
    let (applied, _) = sm.applied_state().await.unwrap();
    assert_eq!(applied, snap.meta.last_log_id, "the install was lost in the crash");
    assert_eq!(group_keys(&space), installed);
}

/// A group's state machine is closed when the group stops (re-formed,
/// healed, removed): openraft's state-machine worker outlives the group's
/// core, and an apply it still had in hand must not land after the
/// re-formation read the stored state (a get applied then, on an entry the
/// re-formation rewrote as unapplied, left a live message without a body
/// in the new epoch: campaign seed 745). A clone (the worker's) is refused
/// too, and the state is what it was at the close.
#[tokio::test]
async fn a_closed_state_machine_applies_nothing_more() {
    let dir = tempfile::tempdir().unwrap();
    let (db, space, mut sm) = open_queue(dir.path());
    sm.apply(logged(&db, 5, vec![entry(1, vec![QueueCmd::Enqueue { msgs: vec![msg("a")] }])])).await.unwrap();
    let mut worker = sm.clone();
    sm.close().await;
    let get = vec![entry(2, vec![QueueCmd::Get { owner: 1, max: 1, auto_ack: true, consumer: None }])];
    assert!(worker.apply(logged(&db, 5, get)).await.is_err(), "an apply after the close was taken");
    assert_eq!(mirrorq::raft::state_machine::stored_applied(&space).unwrap().map(|l| l.index), Some(1));
    assert_eq!(QueueMachine::stored_messages(&space).unwrap(), vec![msg("a")], "the message is still there");
}

/// A catching-up replica asks the master for the bodies its installed
/// snapshot left out. A message it still holds whose body did not come
/// (the master lacked it) stays in its plan: it must not call itself
/// synchronised, stand for election and then fail to deliver the message.
/// Once the message is consumed here, nothing is left to fetch.
#[tokio::test]
async fn a_body_the_master_did_not_send_keeps_the_replica_catching_up() {
    let sender_dir = tempfile::tempdir().unwrap();
    let (sender_db, sender_space, mut sender) = open_queue(sender_dir.path());
    sender.enable_snapshot_transfer();
    let publish = vec![entry(1, vec![QueueCmd::Enqueue { msgs: vec![msg("a"), msg("b"), msg("c")] }])];
    let snap = snapshot_after(&sender_db, &mut sender, publish).await;

    // Node 2, a mirror: it applies gets without reading their bodies.
    let dir = tempfile::tempdir().unwrap();
    let (db, mut sm) = open_mirror(dir.path());
    sm.install_snapshot(&snap.meta, snap.snapshot).await.unwrap();
    let plan = sm.with(|m| m.plan().borrow().clone()).await.expect("the bodies are to be fetched");
    assert_eq!(plan.msgs_total, 3);
    let ranges = plan.missing.clone();
    let (all, next) = QueueMachine::read_bodies(&sender_space, &ranges, usize::MAX).unwrap();
    assert_eq!((all.len(), next), (3, None));
    let upto = ranges.last().unwrap().1;
    let lost = all[1].0;
    let sent: Vec<(u64, Vec<u8>)> = all.iter().filter(|(seq, _)| *seq != lost).cloned().collect();
    sm.with_mut(|m, space| m.fill(space, &sent, upto, None)).await.unwrap();
    let plan = sm.with(|m| m.plan().borrow().clone()).await.expect("a held body is still missing");
    assert_eq!(plan.missing, vec![(lost, lost + 1)]);

    // The first message is consumed here (as the master would have before
    // it read): asking again brings nothing, and the held one stays.
    let get = vec![entry(2, vec![QueueCmd::Get { owner: 1, max: 1, auto_ack: true, consumer: None }])];
    sm.apply(logged(&db, 5, get)).await.unwrap();
    sm.with_mut(|m, space| m.fill(space, &[], lost + 1, None)).await.unwrap();
    let plan = sm.with(|m| m.plan().borrow().clone()).await.expect("still missing");
    assert_eq!(plan.missing, vec![(lost, lost + 1)]);

    // Consumed here too: nothing left to fetch.
    let get = vec![entry(3, vec![QueueCmd::Get { owner: 1, max: 1, auto_ack: true, consumer: None }])];
    sm.apply(logged(&db, 5, get)).await.unwrap();
    sm.with_mut(|m, space| m.fill(space, &[], lost + 1, None)).await.unwrap();
    assert!(sm.with(|m| m.plan().borrow().as_ref().is_some_and(|p| p.is_done())).await);
}

/// A mirror finished fetching one snapshot's bodies, and while it waited to
/// drop its plan a second snapshot came with more it lacks: finishing the
/// first catch-up must not drop the second plan (the mirror would count
/// as synchronised without those bodies; re-formed from it, a queue lost
/// 36,121 confirmed messages in a partition campaign).
#[tokio::test]
async fn finishing_a_catch_up_keeps_the_plan_a_later_snapshot_brought() {
    let sender_dir = tempfile::tempdir().unwrap();
    let (sender_db, sender_space, mut sender) = open_queue(sender_dir.path());
    sender.enable_snapshot_transfer();
    let publish = vec![entry(1, vec![QueueCmd::Enqueue { msgs: vec![msg("a"), msg("b")] }])];
    let first = snapshot_after(&sender_db, &mut sender, publish).await;

    let dir = tempfile::tempdir().unwrap();
    let (_db, mut sm) = open_mirror(dir.path());
    sm.install_snapshot(&first.meta, first.snapshot).await.unwrap();
    let plan = sm.with(|m| m.plan().borrow().clone()).await.expect("bodies to fetch");
    let (bodies, _) = QueueMachine::read_bodies(&sender_space, &plan.missing, usize::MAX).unwrap();
    let upto = plan.missing.last().unwrap().1;
    sm.with_mut(|m, space| m.fill(space, &bodies, upto, None)).await.unwrap();
    assert!(sm.with(|m| m.plan().borrow().as_ref().is_some_and(|p| p.is_done())).await);

    // More published at the master while this mirror was cut off; the
    // log moved on, so a second snapshot comes.
    let more = vec![entry(2, vec![QueueCmd::Enqueue { msgs: vec![msg("c"), msg("d"), msg("e")] }])];
    let second = snapshot_after(&sender_db, &mut sender, more).await;
    sm.install_snapshot(&second.meta, second.snapshot).await.unwrap();

    // The finish of the first catch-up, late: it must leave the new plan.
    let finished = sm.with_mut(|m, space| m.finish_catch_up(space)).await.unwrap();
    assert!(!finished, "a plan that still lacks bodies was dropped");
    let plan = sm.with(|m| m.plan().borrow().clone()).await.expect("the second plan stays");
    assert_eq!(plan.msgs_total, 3, "{plan:?}");
    let (bodies, _) = QueueMachine::read_bodies(&sender_space, &plan.missing, usize::MAX).unwrap();
    sm.with_mut(|m, space| m.fill(space, &bodies, plan.missing.last().unwrap().1, None)).await.unwrap();
    assert!(sm.with_mut(|m, space| m.finish_catch_up(space)).await.unwrap(), "done once fetched");
    assert!(sm.with(|m| m.plan().borrow().is_none()).await);
}

/// What a stopped replica holds of the messages it shares with another
/// epoch, read from its disk: never-delivered ones as one range, delivered
/// and requeued ones one by one, nothing at or above its own counters
/// (a number it never gave is missing because it never applied that
/// publish, not because a consumer took it).
#[tokio::test]
async fn a_replica_tells_what_it_holds_of_the_shared_messages_from_its_disk() {
    let dir = tempfile::tempdir().unwrap();
    let (db, space, mut sm) = open_queue(dir.path());
    let bodies: Vec<Message> = (0..10).map(|i| msg(&i.to_string())).collect();
    sm.apply(logged(
        &db,
        5,
        vec![
            entry(1, vec![QueueCmd::Enqueue { msgs: bodies }]),
            // 0 and 1 consumed; 2, 3 and 4 delivered (tags 2, 3, 4).
            entry(2, vec![QueueCmd::Get { owner: 1, max: 2, auto_ack: true, consumer: None }]),
            entry(3, vec![QueueCmd::Get { owner: 1, max: 3, auto_ack: false, consumer: None }]),
            // 4 acked, 3 requeued, 2 still unacked.
            entry(4, vec![QueueCmd::Ack { tags: vec![4] }]),
            entry(5, vec![QueueCmd::Nack { tags: vec![3], requeue: true }]),
        ],
    ))
    .await
    .unwrap();
    db.flusher().sync().await.unwrap();
    drop(sm);
    let h = QueueMachine::holdings(&space, (8, 0)).unwrap();
    assert_eq!((h.below_seq, h.below_order), (8, 0));
    assert_eq!(h.held, vec![(2, 4), (5, 8)]);
    // Shared numbers beyond what this replica ever numbered are cut to it.
    let h = QueueMachine::holdings(&space, (50, 7)).unwrap();
    assert_eq!((h.below_seq, h.held), (10, vec![(2, 4), (5, 10)]));
    assert!(h.below_order <= 7);
}
