//! Criterion micro-benchmarks of the hot paths of a publish and a delivery:
//! AMQP frame parse and encode, the queue state machine's apply, routing,
//! and a storage append made durable.
//!
//! `cargo bench --bench hot_paths` (add `-- NAME` to pick one). Figures are
//! in docs/benchmarks.md; instruction counts (`valgrind --tool=callgrind`)
//! are steadier than times on a shared machine.

use std::collections::{BTreeMap, BTreeSet};

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{basic, AMQPClass, BasicProperties};
use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use mirrorq::amqp::{parse, write_frame, Parsed};
use mirrorq::metadata::routing::{route, Args, Binding, ExchangeKind, ExchangeMeta};
use mirrorq::queue::state::QueueState;
use mirrorq::queue::{Message, QueueCmd};
use mirrorq_storage::{DbOptions, NodeDb};

// Same allocator as the `mirrorq` binary.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// A 100-byte persistent publish as a client sends it: method, header, body.
fn publish_frames() -> Vec<u8> {
    let frames = [
        AMQPFrame::Method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Publish(basic::Publish {
                exchange: "".into(),
                routing_key: "orders".into(),
                mandatory: false,
                immediate: false,
            })),
        ),
        AMQPFrame::Header(
            1,
            AMQPContentHeader {
                class_id: 60,
                body_size: 100,
                properties: BasicProperties::default().with_delivery_mode(2),
            },
        ),
        AMQPFrame::Body(1, vec![b'x'; 100]),
    ];
    let mut out = Vec::new();
    for f in &frames {
        write_frame(f, &mut out).unwrap();
    }
    out
}

fn frames(c: &mut Criterion) {
    let bytes = publish_frames();
    let mut g = c.benchmark_group("amqp");
    g.throughput(Throughput::Elements(1));
    g.bench_function("parse publish (method+header+100 B body)", |b| {
        b.iter(|| {
            let mut at = 0;
            while let Parsed::Frame(f, used) = parse(black_box(&bytes[at..])) {
                black_box(f);
                at += used;
            }
            assert_eq!(at, bytes.len());
        })
    });
    let deliver = [
        AMQPFrame::Method(
            1,
            AMQPClass::Basic(basic::AMQPMethod::Deliver(basic::Deliver {
                consumer_tag: "amq.ctag-1".into(),
                delivery_tag: 42,
                redelivered: false,
                exchange: "".into(),
                routing_key: "orders".into(),
            })),
        ),
        AMQPFrame::Header(
            1,
            AMQPContentHeader { class_id: 60, body_size: 100, properties: BasicProperties::default() },
        ),
        AMQPFrame::Body(1, vec![b'x'; 100]),
    ];
    let mut out = Vec::with_capacity(4096);
    g.bench_function("encode deliver (method+header+100 B body)", |b| {
        b.iter(|| {
            out.clear();
            for f in &deliver {
                write_frame(black_box(f), &mut out).unwrap();
            }
        })
    });
    g.finish();
}

fn state_apply(c: &mut Criterion) {
    let msg =
        Message { exchange: String::new(), routing_key: "orders".into(), properties: vec![], body: vec![b'x'; 100] };
    let mut g = c.benchmark_group("queue state");
    g.throughput(Throughput::Elements(100));
    g.bench_function("enqueue 100, get 100, ack 100", |b| {
        b.iter_batched(
            QueueState::default,
            |mut s| {
                let mut changes = Vec::new();
                s.apply(&QueueCmd::Enqueue { msgs: vec![msg.clone(); 100] }, &mut changes);
                s.apply(&QueueCmd::Get { owner: 1, max: 100, auto_ack: false, consumer: None }, &mut changes);
                let tags = (0..100).collect();
                s.apply(&QueueCmd::Ack { tags }, &mut changes);
                black_box((s, changes))
            },
            BatchSize::SmallInput,
        )
    });
    g.finish();
}

fn routing(c: &mut Criterion) {
    let mut exchanges = BTreeMap::new();
    exchanges.insert(
        "logs".to_string(),
        ExchangeMeta {
            name: "logs".into(),
            kind: ExchangeKind::Topic,
            durable: true,
            auto_delete: false,
            internal: false,
            alternate: None,
            args: Default::default(),
        },
    );
    let bindings: BTreeSet<Binding> = (0..1000)
        .map(|i| Binding {
            exchange: "logs".into(),
            destination: format!("q{i}"),
            to_exchange: false,
            routing_key: format!("app{}.*.error.#", i % 50),
            args: Args::new(),
        })
        .collect();
    let queues = |_: &str| true;
    let no_alternate = |_: &ExchangeMeta| None;
    let mut g = c.benchmark_group("routing");
    g.throughput(Throughput::Elements(1));
    g.bench_function("default exchange", |b| {
        b.iter(|| {
            route(&exchanges, &bindings, &queues, &no_alternate, black_box(""), black_box("orders"), &Args::new())
        })
    });
    g.bench_function("topic exchange, 1000 bindings", |b| {
        b.iter(|| {
            route(
                &exchanges,
                &bindings,
                &queues,
                &no_alternate,
                black_box("logs"),
                black_box("app7.db.error.disk"),
                &Args::new(),
            )
        })
    });
    g.finish();
}

fn storage(c: &mut Criterion) {
    let dir = tempfile::tempdir_in(".").unwrap();
    let db = NodeDb::open(dir.path(), &DbOptions::default()).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let value = vec![7u8; 1024];
    let mut g = c.benchmark_group("storage");
    g.sample_size(20);
    for batch in [1u64, 64] {
        g.throughput(Throughput::Elements(batch));
        let mut i = 0u64;
        g.bench_function(format!("append {batch} x 1 KiB + fdatasync"), |b| {
            b.iter(|| {
                for _ in 0..batch {
                    db.wal().append(1, &[(i, value.clone())]).unwrap();
                    i += 1;
                }
                rt.block_on(db.flusher().sync_log()).unwrap();
            })
        });
    }
    g.finish();
}

criterion_group!(benches, frames, state_apply, routing, storage);
criterion_main!(benches);
