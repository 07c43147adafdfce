//! Hostile input, generated: every decoder and parser a client reaches
//! (AMQP frames and their field tables, content properties, policy
//! definitions and patterns, queue arguments, the HTTP API's JSON bodies)
//! gets arbitrary and mutated-valid input and must answer with a clear
//! error, never a panic, a hang or a node that stops serving. The pure
//! decoders take thousands of cases; a live node takes fewer, over its real
//! AMQP and HTTP ports. `fuzz/` holds the same targets for cargo-fuzz,
//! run by hand for longer (docs/reliability.md); what it ever found is
//! kept here as a regression case.

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use amq_protocol::frame::{AMQPContentHeader, AMQPFrame};
use amq_protocol::protocol::{basic, queue, AMQPClass, BasicProperties};
use amq_protocol::types::{AMQPValue, FieldArray, FieldTable, LongString};
use mirrorq::metadata::policy::{self, Policy};
use mirrorq::metadata::queue_args::QueueArgs;
use mirrorq::metadata::routing::{ArgValue, Args};
use mirrorq::metadata::ApplyTo;
use proptest::prelude::*;

/// Valid frames of every kind a client sends, field tables and properties
/// included: the seeds that mutations start from.
fn valid_frames() -> Vec<Vec<u8>> {
    let mut table = FieldTable::default();
    table.insert("x-max-length".into(), AMQPValue::LongLongInt(10));
    table.insert("x-dead-letter-exchange".into(), AMQPValue::LongString(LongString::from("dlx")));
    let mut inner = FieldTable::default();
    inner.insert("k".into(), AMQPValue::FieldArray(FieldArray::from(vec![AMQPValue::Boolean(true)])));
    table.insert("nested".into(), AMQPValue::FieldTable(inner.clone()));
    let props = BasicProperties::default()
        .with_content_type("text/plain".into())
        .with_headers(inner)
        .with_delivery_mode(2)
        .with_expiration("1000".into())
        .with_priority(3);
    let declare = queue::Declare {
        queue: "q".into(),
        passive: false,
        durable: true,
        exclusive: false,
        auto_delete: false,
        nowait: false,
        arguments: table,
    };
    let publish = basic::Publish { exchange: "".into(), routing_key: "q".into(), mandatory: true, immediate: false };
    [
        AMQPFrame::Method(1, AMQPClass::Queue(queue::AMQPMethod::Declare(declare))),
        AMQPFrame::Method(1, AMQPClass::Basic(basic::AMQPMethod::Publish(publish))),
        AMQPFrame::Header(1, AMQPContentHeader { class_id: 60, body_size: 5, properties: props }),
        AMQPFrame::Body(1, b"hello".to_vec()),
        AMQPFrame::Heartbeat,
    ]
    .iter()
    .map(|f| {
        let mut out = Vec::new();
        mirrorq::amqp::write_frame(f, &mut out).unwrap();
        out
    })
    .collect()
}

/// A valid frame with some bytes changed, inserted or cut.
fn mutated_frame() -> impl Strategy<Value = Vec<u8>> {
    let seeds = valid_frames();
    (0..seeds.len(), prop::collection::vec((any::<prop::sample::Index>(), any::<u8>(), 0u8..3), 1..8)).prop_map(
        move |(i, edits)| {
            let mut f = seeds[i].clone();
            for (at, byte, kind) in edits {
                if f.is_empty() {
                    f.push(byte);
                    continue;
                }
                let at = at.index(f.len());
                match kind {
                    0 => f[at] = byte,
                    1 => f.insert(at, byte),
                    _ => f.truncate(at),
                }
            }
            f
        },
    )
}

fn frame_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![prop::collection::vec(any::<u8>(), 0..512), mutated_frame()]
}

/// JSON values of the shapes the API's bodies take, with the keys they
/// know mixed in among others.
fn json_value() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let keys = prop_oneof![
        Just("ha-mode".to_string()),
        Just("ha-params".to_string()),
        Just("ha-sync-mode".to_string()),
        Just("ha-promote-on-failure".to_string()),
        Just("message-ttl".to_string()),
        Just("max-length".to_string()),
        Just("pattern".to_string()),
        Just("definition".to_string()),
        Just("priority".to_string()),
        Just("apply-to".to_string()),
        Just("durable".to_string()),
        Just("arguments".to_string()),
        Just("payload".to_string()),
        Just("payload_encoding".to_string()),
        Just("properties".to_string()),
        Just("routing_key".to_string()),
        Just("count".to_string()),
        Just("ackmode".to_string()),
        Just("queues".to_string()),
        Just("policies".to_string()),
        Just("name".to_string()),
        Just("vhost".to_string()),
        "[a-z_-]{0,12}",
    ];
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        prop_oneof![
            Just("all".to_string()),
            Just("exactly".to_string()),
            Just("nodes".to_string()),
            Just("automatic".to_string()),
            Just("base64".to_string()),
            Just("/".to_string()),
            Just("true".to_string()),
            ".{0,20}",
        ]
        .prop_map(Value::String),
    ];
    leaf.prop_recursive(4, 48, 8, move |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
            prop::collection::btree_map(keys.clone(), inner, 0..8).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

fn arg_value() -> impl Strategy<Value = ArgValue> {
    prop_oneof![
        ".{0,12}".prop_map(ArgValue::Str),
        any::<i64>().prop_map(ArgValue::Int),
        any::<bool>().prop_map(ArgValue::Bool),
        ".{0,12}".prop_map(ArgValue::Other),
    ]
}

/// The seeds are frames the decoder reads whole.
#[test]
fn the_seed_frames_decode() {
    for f in valid_frames() {
        assert!(matches!(mirrorq::amqp::parse(&f), mirrorq::amqp::Parsed::Frame(_, used) if used == f.len()));
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 4000, failure_persistence: None, ..ProptestConfig::default() })]

    /// The frame decoder takes any bytes: a frame, "more needed" or an
    /// error, and a frame never claims more bytes than it was given.
    #[test]
    fn the_frame_decoder_takes_any_bytes(bytes in frame_bytes()) {
        match mirrorq::amqp::parse(&bytes) {
            mirrorq::amqp::Parsed::Frame(frame, used) => {
                prop_assert!(used <= bytes.len());
                let mut out = Vec::new();
                let _ = mirrorq::amqp::write_frame(&frame, &mut out);
            }
            mirrorq::amqp::Parsed::Incomplete | mirrorq::amqp::Parsed::Invalid(_) => {}
        }
    }

    /// Stored content properties are read back from any bytes (what a
    /// publish or a hand-back carried), and a list judged whole decodes.
    #[test]
    fn content_properties_decode_from_any_bytes(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let whole = mirrorq::message::valid_properties(&bytes);
        let props = mirrorq::message::decode_properties(&bytes);
        let _ = mirrorq::message::expiration_ms(&props);
        if whole && !bytes.is_empty() {
            let again = mirrorq::message::encode_properties(&props);
            prop_assert!(mirrorq::message::valid_properties(&again));
        }
    }

    /// A policy's definition and pattern, as clients send them: accepted
    /// or refused with a reason, and a stored pattern is matched in bounded
    /// time whatever it is.
    #[test]
    fn policies_take_any_definition_and_pattern(
        def in prop_oneof![json_value().prop_map(|v| v.to_string()), ".{0,64}"],
        pattern in prop_oneof![".{0,24}", "[\\^$.*+?()\\[\\]{}|a-z0-9\\\\]{0,24}"],
        queue in "[a-z.]{0,12}",
    ) {
        let p = Policy { name: "/\u{1}p".into(), pattern, apply_to: ApplyTo::All, priority: 0, definition: def };
        if let Err(reason) = policy::validate(&p) {
            prop_assert!(!reason.is_empty());
        }
        let _ = policy::ha_policy_of(&p.definition);
        let policies = BTreeMap::from([(p.name.clone(), p)]);
        let _ = policy::effective(&policies, &format!("/\u{1}{queue}"));
    }

    /// Declare arguments of any names and values: parsed or refused with
    /// the argument named, and a policy folded in without a panic.
    #[test]
    fn queue_arguments_take_any_table(
        args in prop::collection::btree_map(
            prop_oneof![
                Just("x-message-ttl".to_string()),
                Just("x-expires".to_string()),
                Just("x-max-length".to_string()),
                Just("x-max-length-bytes".to_string()),
                Just("x-overflow".to_string()),
                Just("x-dead-letter-exchange".to_string()),
                Just("x-dead-letter-routing-key".to_string()),
                Just("x-queue-mode".to_string()),
                "x-[a-z-]{0,10}",
            ],
            arg_value(),
            0..8,
        ),
        def in json_value(),
    ) {
        let args: Args = args;
        match QueueArgs::parse(&args) {
            Ok(parsed) => {
                let _ = parsed.with_policy(Some(&def.to_string()));
                let _ = parsed.to_json();
            }
            Err(reason) => prop_assert!(reason.contains("arg") || !reason.is_empty()),
        }
    }
}

/// A live node: its AMQP and HTTP ports.
struct Live {
    _cluster: common::Cluster,
    amqp: u16,
    http: u16,
}

async fn live() -> Live {
    let cluster = common::Cluster::start(1, common::fast_timing(Duration::from_secs(5))).await;
    let http = cluster.serve_http().await[0];
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let amqp = l.local_addr().unwrap().port();
    let node = cluster.node(1).clone();
    tokio::spawn(mirrorq::amqp::serve(l, node.clone(), node.stopped()));
    Live { _cluster: cluster, amqp, http }
}

/// Frames of any bytes on an open connection, over a live node's AMQP port:
/// the node answers, closes the connection with a reason, or waits for
/// more, and after every case a new client still opens a connection and
/// declares a queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_amqp_port_takes_any_frames() {
    common::init_tracing();
    let node = live().await;
    // The same cases every run: a live node's answer must not depend on luck.
    let mut runner = proptest::test_runner::TestRunner::new_with_rng(
        ProptestConfig { cases: 150, failure_persistence: None, ..ProptestConfig::default() },
        proptest::test_runner::TestRng::deterministic_rng(proptest::test_runner::RngAlgorithm::ChaCha),
    );
    let port = node.amqp;
    let cases = std::sync::Mutex::new(Vec::new());
    runner
        .run(&prop::collection::vec(frame_bytes(), 1..4), |frames| {
            cases.lock().unwrap().push(frames);
            Ok(())
        })
        .unwrap();
    for frames in cases.into_inner().unwrap() {
        let mut r = common::raw_amqp::Raw::open(port).await;
        for f in &frames {
            // An earlier frame may have closed the connection (501 and the like).
            if !r.try_send_bytes(f).await {
                break;
            }
        }
        // Whatever comes back within a moment (a reply, a close, or nothing).
        drop(tokio::time::timeout(Duration::from_millis(200), r.next_or_closed()).await);
        drop(r);
        let mut ok = common::raw_amqp::Raw::open(port).await;
        let declare = queue::Declare {
            queue: "after-fuzz".into(),
            passive: false,
            durable: true,
            exclusive: false,
            auto_delete: false,
            nowait: false,
            arguments: FieldTable::default(),
        };
        ok.send(&[
            common::raw_amqp::method(
                1,
                AMQPClass::Channel(amq_protocol::protocol::channel::AMQPMethod::Open(Default::default())),
            ),
            common::raw_amqp::method(1, AMQPClass::Queue(queue::AMQPMethod::Declare(declare))),
        ])
        .await;
        let mut answered = false;
        for _ in 0..2 {
            if let AMQPFrame::Method(1, AMQPClass::Queue(queue::AMQPMethod::DeclareOk(_))) = ok.next().await {
                answered = true;
            }
        }
        assert!(answered, "the node stopped serving after {frames:?}");
    }
}

/// JSON bodies of any shape to every API route that reads one, over a
/// live node's HTTP port: a 2xx or a 4xx with a JSON reason, never a 5xx,
/// and the node answers its overview after each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_http_api_takes_any_json_body() {
    common::init_tracing();
    let node = live().await;
    let mut runner = proptest::test_runner::TestRunner::new_with_rng(
        ProptestConfig { cases: 120, failure_persistence: None, ..ProptestConfig::default() },
        proptest::test_runner::TestRng::deterministic_rng(proptest::test_runner::RngAlgorithm::ChaCha),
    );
    let bodies = std::sync::Mutex::new(Vec::new());
    runner
        .run(&(0usize..6, prop_oneof![json_value().prop_map(|v| v.to_string()), ".{0,64}"]), |case| {
            bodies.lock().unwrap().push(case);
            Ok(())
        })
        .unwrap();
    let base = format!("http://127.0.0.1:{}", node.http);
    let cases = bodies.into_inner().unwrap();
    tokio::task::spawn_blocking(move || {
        let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(15)).build();
        let routes = [
            ("PUT", "/api/policies/%2F/fuzz"),
            ("PUT", "/api/queues/%2F/fuzz-q"),
            ("POST", "/api/definitions"),
            ("POST", "/api/exchanges/%2F/amq.default/publish"),
            ("POST", "/api/queues/%2F/fuzz-q/get"),
            ("PUT", "/api/exchanges/%2F/fuzz-x"),
        ];
        let mut seen = BTreeMap::new();
        for (route, body) in cases {
            let (method, path) = routes[route];
            let r = agent
                .request(method, &format!("{base}{path}"))
                .set("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=")
                .set("Content-Type", "application/json")
                .send_string(&body);
            let (status, text) = match r {
                Ok(resp) => (resp.status(), resp.into_string().unwrap_or_default()),
                Err(ureq::Error::Status(code, resp)) => (code, resp.into_string().unwrap_or_default()),
                Err(e) => panic!("{method} {path} with {body:?}: no answer: {e}"),
            };
            assert!(status < 500, "{method} {path} with {body:?}: {status} {text}");
            *seen.entry(status / 100).or_insert(0) += 1;
            if status >= 400 {
                let reason: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|_| {
                    panic!("{method} {path} with {body:?}: {status} without a JSON reason: {text}")
                });
                assert!(reason.get("reason").is_some() || reason.get("error").is_some(), "{text}");
            }
            let overview =
                agent.get(&format!("{base}/api/overview")).set("Authorization", "Basic Z3Vlc3Q6Z3Vlc3Q=").call();
            assert!(overview.is_ok(), "the API stopped answering after {method} {path} with {body:?}");
        }
        // Inputs that get past the parsing as well as ones refused by it.
        assert!(seen.contains_key(&2) && seen.contains_key(&4), "answers by class: {seen:?}");
    })
    .await
    .unwrap();
}
