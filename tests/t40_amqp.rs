//! The AMQP front end with a stock client (lapin) against a three-node
//! cluster, connected to nodes that are not the queue's master: forwarding,
//! confirms, properties, gets, consumers with prefetch, requeue and errors.

mod common;

use std::time::Duration;

use common::raw_amqp as raw;
use common::{fast_timing, init_tracing, Cluster};
use futures::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicGetOptions, BasicNackOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

struct AmqpCluster {
    cluster: Cluster,
    ports: Vec<u16>,
}

impl AmqpCluster {
    async fn start() -> Self {
        Self::start_timed(fast_timing(Duration::from_secs(5))).await
    }

    async fn start_timed(timing: mirrorq::node::Timing) -> Self {
        let cluster = Cluster::start(3, timing).await;
        let mut ports = Vec::new();
        for id in 1..=3 {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            ports.push(l.local_addr().unwrap().port());
            let node = cluster.node(id).clone();
            tokio::spawn(mirrorq::amqp::serve(l, node.clone(), node.stopped()));
        }
        Self { cluster, ports }
    }

    async fn connect(&self, node: u64) -> Connection {
        let uri = format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.ports[(node - 1) as usize]);
        Connection::connect(&uri, ConnectionProperties::default()).await.expect("connect")
    }
}

/// The broker closed with `code` (lapin reports it as a number or by name).
fn assert_amqp_error(err: &lapin::Error, code: &str, name: &str) {
    assert!(format!("{err:?}").contains(code) || format!("{err}").contains(name), "expected {code} {name}: {err:?}");
}

fn s(v: &str) -> ShortString {
    ShortString::from(v)
}

/// Publish `body` to `queue` through the default exchange on a channel in
/// confirm mode; `true` if acked, `false` if nacked.
async fn publish(ch: &lapin::Channel, queue: &str, body: &[u8]) -> bool {
    ch.basic_publish(s(""), s(queue), BasicPublishOptions::default(), body, BasicProperties::default())
        .await
        .unwrap()
        .await
        .unwrap()
        .is_ack()
}

/// Declared on node 1, published with confirms on node 2, fetched on node 3:
/// every publish is acked, properties come back exactly, counts are right.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn publish_confirm_and_get_through_other_nodes() {
    init_tracing();
    let c = AmqpCluster::start().await;
    let conn1 = c.connect(1).await;
    let ch1 = conn1.create_channel().await.unwrap();
    let q = ch1
        .queue_declare(s("orders"), QueueDeclareOptions { durable: true, ..Default::default() }, FieldTable::default())
        .await
        .unwrap();
    assert_eq!(q.message_count(), 0);

    let conn2 = c.connect(2).await;
    let ch2 = conn2.create_channel().await.unwrap();
    ch2.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let mut headers = FieldTable::default();
    headers.insert(s("x-trace"), AMQPValue::LongString("abc".into()));
    headers.insert(s("attempt"), AMQPValue::LongInt(3));
    let props = BasicProperties::default()
        .with_content_type(s("application/json"))
        .with_delivery_mode(2)
        .with_correlation_id(s("corr-1"))
        .with_headers(headers.clone());
    let mut confirms = Vec::new();
    for i in 0..50 {
        let body = format!("{{\"n\":{i}}}");
        confirms.push(
            // mandatory: a queue declared on node 1 must route on node 2 at once.
            ch2.basic_publish(
                s(""),
                s("orders"),
                BasicPublishOptions { mandatory: true, ..Default::default() },
                body.as_bytes(),
                props.clone(),
            )
            .await
            .unwrap(),
        );
    }
    for conf in confirms {
        let conf = conf.await.unwrap();
        assert!(conf.is_ack(), "publish not acked");
        assert!(conf.take_message().is_none(), "returned as unroutable");
    }

    let conn3 = c.connect(3).await;
    let ch3 = conn3.create_channel().await.unwrap();
    let got = ch3.basic_get(s("orders"), BasicGetOptions { no_ack: false }).await.unwrap().expect("a message");
    assert_eq!(got.delivery.data, b"{\"n\":0}");
    assert!(!got.delivery.redelivered);
    assert_eq!(got.delivery.routing_key.as_str(), "orders");
    assert_eq!(got.delivery.properties.content_type().as_ref().map(|v| v.as_str()), Some("application/json"));
    assert_eq!(*got.delivery.properties.delivery_mode(), Some(2));
    assert_eq!(got.delivery.properties.correlation_id().as_ref().map(|v| v.as_str()), Some("corr-1"));
    assert_eq!(got.delivery.properties.headers().as_ref(), Some(&headers));
    assert_eq!(got.message_count, 49);
    got.delivery.ack(BasicAckOptions::default()).await.unwrap();

    // Passive declare on another node sees the count.
    let q = ch3
        .queue_declare(s("orders"), QueueDeclareOptions { passive: true, ..Default::default() }, FieldTable::default())
        .await
        .unwrap();
    assert_eq!(q.message_count(), 49);
    // One channel's publishes arrive in publish order.
    for i in 1..50 {
        let m = ch3.basic_get(s("orders"), BasicGetOptions { no_ack: true }).await.unwrap().expect("message");
        assert_eq!(m.delivery.data, format!("{{\"n\":{i}}}").into_bytes());
    }
    assert!(ch3.basic_get(s("orders"), BasicGetOptions { no_ack: true }).await.unwrap().is_none());

    // The library API's messages reach clients with their properties; bytes
    // that are no property list are refused, not sent on to clients.
    c.cluster.node(1).publish("orders", vec![common::msg("lib")]).await.unwrap();
    let m = ch3.basic_get(s("orders"), BasicGetOptions { no_ack: true }).await.unwrap().expect("library message");
    assert_eq!(m.delivery.data, b"lib");
    assert_eq!(m.delivery.properties.app_id().as_ref().map(|v| v.as_str()), Some("test"));
    assert_eq!(*m.delivery.properties.delivery_mode(), Some(2));
    let bad = mirrorq::Message { properties: vec![1, 2, 3], ..common::msg("bad") };
    let refused = c.cluster.node(1).publish("orders", vec![common::msg("ok"), bad]).await;
    assert!(matches!(refused, Err(mirrorq::NodeError::Invalid(ref why)) if why.contains("message 1")), "{refused:?}");
    assert!(ch3.basic_get(s("orders"), BasicGetOptions { no_ack: true }).await.unwrap().is_none(), "none stored");
    c.cluster.shutdown().await;
}

/// A consumer with prefetch 3 gets exactly 3 unacked messages; each ack lets
/// one more through; closing the channel requeues the rest as redelivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn consumer_prefetch_ack_and_requeue_on_close() {
    init_tracing();
    let c = AmqpCluster::start().await;
    let conn = c.connect(1).await;
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(s("work"), QueueDeclareOptions::default(), FieldTable::default()).await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    for i in 0..10 {
        ch.basic_publish(
            s(""),
            s("work"),
            BasicPublishOptions::default(),
            format!("job{i}").as_bytes(),
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }

    let conn2 = c.connect(2).await;
    let cch = conn2.create_channel().await.unwrap();
    cch.basic_qos(3, BasicQosOptions::default()).await.unwrap();
    let mut consumer =
        cch.basic_consume(s("work"), s("c1"), BasicConsumeOptions::default(), FieldTable::default()).await.unwrap();
    let mut held = Vec::new();
    for _ in 0..3 {
        let d =
            tokio::time::timeout(Duration::from_secs(10), consumer.next()).await.expect("delivery").unwrap().unwrap();
        held.push(d);
    }
    assert_eq!(
        held.iter().map(|d| d.data.clone()).collect::<Vec<_>>(),
        vec![b"job0".to_vec(), b"job1".to_vec(), b"job2".to_vec()]
    );
    // Prefetch honoured: nothing more while three are unacked.
    assert!(tokio::time::timeout(Duration::from_millis(700), consumer.next()).await.is_err(), "prefetch exceeded");
    held.remove(0).ack(BasicAckOptions::default()).await.unwrap();
    let d = tokio::time::timeout(Duration::from_secs(10), consumer.next())
        .await
        .expect("delivery after ack")
        .unwrap()
        .unwrap();
    assert_eq!(d.data, b"job3");
    // nack with requeue: comes back first, marked redelivered.
    d.nack(BasicNackOptions { requeue: true, ..Default::default() }).await.unwrap();
    let again =
        tokio::time::timeout(Duration::from_secs(10), consumer.next()).await.expect("redelivery").unwrap().unwrap();
    assert_eq!(again.data, b"job3");
    assert!(again.redelivered);

    // Close the channel with three unacked: they are requeued, redelivered.
    cch.close(200, s("bye")).await.unwrap();
    let ch3 = conn2.create_channel().await.unwrap();
    let mut seen = Vec::new();
    for _ in 0..20 {
        match ch3.basic_get(s("work"), BasicGetOptions { no_ack: true }).await.unwrap() {
            Some(m) => seen.push((String::from_utf8(m.delivery.data).unwrap(), m.delivery.redelivered)),
            None => {
                if seen.len() >= 9 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    let mut bodies: Vec<&str> = seen.iter().map(|(b, _)| b.as_str()).collect();
    bodies.sort();
    assert_eq!(bodies, vec!["job1", "job2", "job3", "job4", "job5", "job6", "job7", "job8", "job9"]);
    for (b, r) in &seen {
        let expect = matches!(b.as_str(), "job1" | "job2" | "job3");
        assert_eq!(*r, expect, "redelivered flag of {b}");
    }
    c.cluster.shutdown().await;
}

/// Protocol errors close the channel (or connection) with the right code.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn errors_get_the_right_reply_codes() {
    init_tracing();
    let c = AmqpCluster::start().await;
    let conn = c.connect(2).await;

    let ch = conn.create_channel().await.unwrap();
    let err = ch
        .queue_declare(s("missing"), QueueDeclareOptions { passive: true, ..Default::default() }, FieldTable::default())
        .await
        .unwrap_err();
    assert_amqp_error(&err, "404", "NOT_FOUND");

    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    // Unroutable + mandatory: returned, then acked (as RabbitMQ does).
    let conf = ch
        .basic_publish(
            s(""),
            s("nobody"),
            BasicPublishOptions { mandatory: true, ..Default::default() },
            b"x",
            BasicProperties::default(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(conf.is_ack());
    let returned = conf.take_message().expect("basic.return");
    assert_eq!(returned.reply_code, 312);

    // Acking a tag never delivered: 406 on that channel, connection lives.
    ch.basic_ack(99, BasicAckOptions::default()).await.unwrap();
    common::wait_until(Duration::from_secs(10), "the broker closes the channel", || !ch.status().connected()).await;
    assert!(!ch.status().connected(), "channel should be closed after 406");
    let ch2 = conn.create_channel().await.expect("connection still usable");
    ch2.queue_declare(s("fine"), QueueDeclareOptions::default(), FieldTable::default()).await.unwrap();

    // A wrong protocol header gets ours back, then the socket closes.
    let mut sock = tokio::net::TcpStream::connect(("127.0.0.1", c.ports[0])).await.unwrap();
    sock.write_all(b"HTTP/1.1").await.unwrap();
    let mut buf = Vec::new();
    tokio::time::timeout(Duration::from_secs(5), sock.read_to_end(&mut buf)).await.unwrap().unwrap();
    assert_eq!(buf, b"AMQP\x00\x00\x09\x01");

    // Bad credentials are refused.
    let uri = format!("amqp://guest:nope@127.0.0.1:{}/%2f", c.ports[0]);
    assert!(Connection::connect(&uri, ConnectionProperties::default()).await.is_err());
    c.cluster.shutdown().await;
}

/// Exchanges route like RabbitMQ's: topic wildcards, fanout, headers
/// `x-match`, a message reaching two queues is confirmed once both have it;
/// bad declarations get 404 / 406 / 403.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exchanges_route_and_validate() {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
    use lapin::ExchangeKind;
    init_tracing();
    let c = AmqpCluster::start().await;
    let conn = c.connect(1).await;
    let ch = conn.create_channel().await.unwrap();
    for q in ["errors", "everything", "pdfs"] {
        ch.queue_declare(s(q), QueueDeclareOptions::default(), FieldTable::default()).await.unwrap();
    }
    ch.exchange_declare(s("logs"), ExchangeKind::Topic, ExchangeDeclareOptions::default(), FieldTable::default())
        .await
        .unwrap();
    ch.queue_bind(s("errors"), s("logs"), s("*.error"), QueueBindOptions::default(), FieldTable::default())
        .await
        .unwrap();
    ch.queue_bind(s("everything"), s("logs"), s("#"), QueueBindOptions::default(), FieldTable::default())
        .await
        .unwrap();
    let mut hargs = FieldTable::default();
    hargs.insert(s("x-match"), AMQPValue::LongString("any".into()));
    hargs.insert(s("format"), AMQPValue::LongString("pdf".into()));
    ch.queue_bind(s("pdfs"), s("amq.headers"), s(""), QueueBindOptions::default(), hargs).await.unwrap();

    // Publish through another node.
    let conn2 = c.connect(3).await;
    let p = conn2.create_channel().await.unwrap();
    p.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let publish = |ex: &'static str, key: &'static str, props: BasicProperties| {
        let p = p.clone();
        async move {
            p.basic_publish(s(ex), s(key), BasicPublishOptions::default(), key.as_bytes(), props)
                .await
                .unwrap()
                .await
                .unwrap()
        }
    };
    assert!(publish("logs", "db.error", BasicProperties::default()).await.is_ack());
    assert!(publish("logs", "db.info", BasicProperties::default()).await.is_ack());
    let mut h = FieldTable::default();
    h.insert(s("format"), AMQPValue::LongString("pdf".into()));
    assert!(publish("amq.headers", "doc", BasicProperties::default().with_headers(h)).await.is_ack());
    assert!(publish("amq.headers", "other", BasicProperties::default()).await.is_ack());

    let drain = |q: &'static str| {
        let ch = ch.clone();
        async move {
            let mut out = Vec::new();
            while let Some(m) = ch.basic_get(s(q), BasicGetOptions { no_ack: true }).await.unwrap() {
                out.push(String::from_utf8(m.delivery.data).unwrap());
            }
            out
        }
    };
    assert_eq!(drain("errors").await, vec!["db.error"]);
    assert_eq!(drain("everything").await, vec!["db.error", "db.info"]);
    assert_eq!(drain("pdfs").await, vec!["doc"]);

    // Same name, other type: 406.
    let err = ch
        .exchange_declare(s("logs"), ExchangeKind::Fanout, ExchangeDeclareOptions::default(), FieldTable::default())
        .await
        .unwrap_err();
    assert_amqp_error(&err, "406", "PRECONDITION_FAILED");
    // Unknown exchange on publish: 404 closes the channel.
    let ch2 = conn.create_channel().await.unwrap();
    ch2.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let r =
        ch2.basic_publish(s("nope"), s("k"), BasicPublishOptions::default(), b"x", BasicProperties::default()).await;
    if let Ok(conf) = r {
        assert!(conf.await.is_err() || !ch2.status().connected(), "publish to a missing exchange must fail");
    }
    common::wait_until(Duration::from_secs(10), "the broker closes the channel", || !ch2.status().connected()).await;
    assert!(!ch2.status().connected());
    // Binding to the default exchange: 403.
    let ch3 = conn.create_channel().await.unwrap();
    let err = ch3
        .queue_bind(s("errors"), s(""), s("k"), QueueBindOptions::default(), FieldTable::default())
        .await
        .unwrap_err();
    assert_amqp_error(&err, "403", "ACCESS_REFUSED");
    c.cluster.shutdown().await;
}

/// Transactions: nothing is visible before commit; rollback discards
/// publishes and acks; commit applies publishes and acks together.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn transactions_commit_and_rollback() {
    init_tracing();
    let c = AmqpCluster::start().await;
    let conn = c.connect(2).await;
    let setup = conn.create_channel().await.unwrap();
    setup.queue_declare(s("txq"), QueueDeclareOptions::default(), FieldTable::default()).await.unwrap();
    let ch = conn.create_channel().await.unwrap();
    ch.tx_select().await.unwrap();
    for i in 0..3 {
        ch.basic_publish(
            s(""),
            s("txq"),
            BasicPublishOptions::default(),
            format!("t{i}").as_bytes(),
            BasicProperties::default(),
        )
        .await
        .unwrap();
    }
    let peek = conn.create_channel().await.unwrap();
    let count = |ch: lapin::Channel| async move {
        ch.queue_declare(s("txq"), QueueDeclareOptions { passive: true, ..Default::default() }, FieldTable::default())
            .await
            .unwrap()
            .message_count()
    };
    assert_eq!(count(peek.clone()).await, 0, "uncommitted publishes are invisible");
    ch.tx_rollback().await.unwrap();
    assert_eq!(count(peek.clone()).await, 0, "rolled back");
    for i in 0..3 {
        ch.basic_publish(
            s(""),
            s("txq"),
            BasicPublishOptions::default(),
            format!("t{i}").as_bytes(),
            BasicProperties::default(),
        )
        .await
        .unwrap();
    }
    ch.tx_commit().await.unwrap();
    assert_eq!(count(peek.clone()).await, 3, "committed");

    // Acks inside a transaction: rolled back, the messages stay unacked.
    let a = ch.basic_get(s("txq"), BasicGetOptions { no_ack: false }).await.unwrap().unwrap();
    let b = ch.basic_get(s("txq"), BasicGetOptions { no_ack: false }).await.unwrap().unwrap();
    a.delivery.ack(BasicAckOptions::default()).await.unwrap();
    ch.tx_rollback().await.unwrap();
    assert_eq!(count(peek.clone()).await, 1);
    // Committed: both acks and a new publish land together. (lapin's acker
    // will not ack one delivery twice, so ack by tag on the channel.)
    ch.basic_ack(a.delivery.delivery_tag, BasicAckOptions::default()).await.unwrap();
    b.delivery.ack(BasicAckOptions::default()).await.unwrap();
    ch.basic_publish(s(""), s("txq"), BasicPublishOptions::default(), b"t3", BasicProperties::default()).await.unwrap();
    ch.tx_commit().await.unwrap();
    ch.close(200, s("bye")).await.unwrap();
    let mut left = Vec::new();
    while let Some(m) = peek.basic_get(s("txq"), BasicGetOptions { no_ack: true }).await.unwrap() {
        left.push(String::from_utf8(m.delivery.data).unwrap());
    }
    assert_eq!(left, vec!["t2", "t3"], "t0 and t1 acked; nothing requeued on close");
    c.cluster.shutdown().await;
}

/// An exclusive queue: other connections get 405 RESOURCE_LOCKED; it goes
/// away with the connection that declared it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exclusive_queues_are_locked_and_die_with_their_connection() {
    init_tracing();
    let c = AmqpCluster::start().await;
    let owner = c.connect(1).await;
    let och = owner.create_channel().await.unwrap();
    och.queue_declare(s("excl"), QueueDeclareOptions { exclusive: true, ..Default::default() }, FieldTable::default())
        .await
        .unwrap();
    let other = c.connect(2).await;
    let ch = other.create_channel().await.unwrap();
    let err = ch
        .queue_declare(s("excl"), QueueDeclareOptions { passive: true, ..Default::default() }, FieldTable::default())
        .await
        .unwrap_err();
    assert_amqp_error(&err, "405", "RESOURCE_LOCKED");
    let ch = other.create_channel().await.unwrap();
    let err = ch.basic_get(s("excl"), BasicGetOptions::default()).await.unwrap_err();
    assert_amqp_error(&err, "405", "RESOURCE_LOCKED");
    // The owner uses it freely.
    assert!(och.basic_get(s("excl"), BasicGetOptions::default()).await.unwrap().is_none());
    // A bad locator argument is refused.
    let mut args = FieldTable::default();
    args.insert(s("x-queue-master-locator"), AMQPValue::LongString("random-ish".into()));
    let err = och.queue_declare(s("loc"), QueueDeclareOptions::default(), args).await.unwrap_err();
    assert_amqp_error(&err, "406", "PRECONDITION_FAILED");

    owner.close(200, s("bye")).await.unwrap();
    let n2 = c.cluster.node(2).clone();
    let mut gone = false;
    for _ in 0..100 {
        n2.meta_barrier().await;
        if !n2.metadata().queues.contains_key("excl") {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gone, "exclusive queue outlived its connection");
    c.cluster.shutdown().await;
}

/// An auto-delete queue goes when its last consumer does, not before.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn auto_delete_queue_goes_with_its_last_consumer() {
    init_tracing();
    let c = AmqpCluster::start().await;
    let conn = c.connect(1).await;
    let ch = conn.create_channel().await.unwrap();
    let opts = QueueDeclareOptions { auto_delete: true, ..Default::default() };
    ch.queue_declare(s("ad"), opts, FieldTable::default()).await.unwrap();
    let c1 = ch.basic_consume(s("ad"), s("a1"), BasicConsumeOptions::default(), FieldTable::default()).await.unwrap();
    let other = c.connect(3).await.create_channel().await.unwrap();
    let c2 =
        other.basic_consume(s("ad"), s("a2"), BasicConsumeOptions::default(), FieldTable::default()).await.unwrap();
    // (Both consumer handles stay alive: lapin cancels a dropped consumer.)
    ch.basic_cancel(s("a1"), Default::default()).await.unwrap();
    // Time for a wrong auto-delete to happen (there is no event to wait for).
    tokio::time::sleep(Duration::from_millis(500)).await;
    let node1 = c.cluster.node(1).clone();
    node1.meta_barrier().await;
    assert!(node1.metadata().queues.contains_key("ad"), "deleted while a consumer on another node remains");
    other.basic_cancel(s("a2"), Default::default()).await.unwrap();
    let mut gone = false;
    for _ in 0..100 {
        node1.meta_barrier().await;
        if !node1.metadata().queues.contains_key("ad") {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gone, "auto-delete queue outlived its last consumer");
    drop((c1, c2));
    c.cluster.shutdown().await;
}

/// A consumer on a node that is not the master keeps receiving while the
/// master moves away (graceful stop of the master's node: the mastership
/// moves to a mirror) and, separately, while the new master crashes (a
/// failover): acks of messages delivered before each move still settle them,
/// and every message is delivered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn consumer_keeps_receiving_when_the_master_moves() {
    init_tracing();
    let mut c = AmqpCluster::start().await;
    c.cluster
        .node(1)
        .set_policy(common::policy("^mv", r#"{"ha-mode":"all","ha-sync-mode":"automatic"}"#))
        .await
        .unwrap();
    c.cluster.node(1).declare_queue("mv-q", vec![]).await.unwrap();
    let master = c.cluster.master_of("mv-q").await;
    let at = (1..=3).find(|n| *n != master).unwrap();
    let publisher = c.cluster.node(at).clone();
    let conn = c.connect(at).await;
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(5, BasicQosOptions::default()).await.unwrap();
    let mut consumer =
        ch.basic_consume(s("mv-q"), s("mover"), BasicConsumeOptions::default(), FieldTable::default()).await.unwrap();
    let mut got = std::collections::BTreeSet::new();

    // Deliveries are taken until `want` distinct bodies arrived; the last
    // one taken stays unacked across the move that follows.
    async fn take(
        consumer: &mut lapin::Consumer,
        got: &mut std::collections::BTreeSet<String>,
        want: usize,
    ) -> lapin::message::Delivery {
        loop {
            let d = tokio::time::timeout(Duration::from_secs(30), consumer.next())
                .await
                .expect("the consumer stalled")
                .unwrap()
                .unwrap();
            got.insert(String::from_utf8(d.data.clone()).unwrap());
            if got.len() >= want {
                return d;
            }
            d.ack(BasicAckOptions::default()).await.unwrap();
        }
    }

    for i in 0..20 {
        publisher.publish("mv-q", vec![common::msg(format!("a{i}"))]).await.unwrap();
    }
    let held = take(&mut consumer, &mut got, 20).await;

    tracing::info!(master, "--- the master's node stops gracefully");
    let stopping = c.cluster.nodes[(master - 1) as usize].take().unwrap();
    stopping.shutdown().await;
    // Moved before the node stopped (not handed over after it, which would
    // leave the queue without a master for the lease of its last heartbeat).
    assert!(
        c.cluster.nodes.iter().flatten().any(|n| n.is_master("mv-q")),
        "no master right after the graceful stop: the idle queue's mastership did not move"
    );
    held.ack(BasicAckOptions::default()).await.unwrap();
    for i in 0..20 {
        common::publish_retrying(&publisher, "mv-q", format!("b{i}").into_bytes()).await;
    }
    let held = take(&mut consumer, &mut got, 40).await;

    let second = c.cluster.master_of("mv-q").await;
    assert_ne!(second, master);
    if second != at {
        tracing::info!(second, "--- the new master crashes");
        c.cluster.crash(second).await;
        // Two of three replicas gone: the consumer's node re-forms the queue.
    }
    held.ack(BasicAckOptions::default()).await.unwrap();
    for i in 0..20 {
        common::publish_retrying(&publisher, "mv-q", format!("c{i}").into_bytes()).await;
    }
    let last = take(&mut consumer, &mut got, 60).await;
    last.ack(BasicAckOptions::default()).await.unwrap();

    let want: std::collections::BTreeSet<String> =
        ["a", "b", "c"].iter().flat_map(|p| (0..20).map(move |i| format!("{p}{i}"))).collect();
    assert_eq!(got, want, "every message delivered");
    let mut settled = false;
    for _ in 0..100 {
        if publisher.status("mv-q").await.is_ok_and(|s| s == (0, 0)) {
            settled = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(settled, "acks across the moves did not settle every message: {:?}", publisher.status("mv-q").await);
    c.cluster.shutdown().await;
}

/// Waits until `queue` holds `n` ready messages (read through the master).
async fn wait_ready(c: &AmqpCluster, queue: &str, n: u64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let (ready, _) = c.cluster.node(1).status(queue).await.unwrap();
        if ready == n {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{queue}: {ready} ready, expected {n}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn x_death(props: &BasicProperties) -> Vec<FieldTable> {
    match props.headers().as_ref().and_then(|h| h.inner().get("x-death").cloned()) {
        Some(AMQPValue::FieldArray(a)) => a
            .as_slice()
            .iter()
            .map(|v| match v {
                AMQPValue::FieldTable(t) => t.clone(),
                other => panic!("x-death entry {other:?}"),
            })
            .collect(),
        other => panic!("no x-death header: {other:?}"),
    }
}

fn text(t: &FieldTable, k: &str) -> String {
    match t.inner().get(k) {
        Some(AMQPValue::LongString(v)) => String::from_utf8_lossy(v.as_bytes()).into_owned(),
        other => panic!("{k}: {other:?}"),
    }
}

/// Mirrored queues (`ha-mode: all`) with `x-message-ttl`, `x-max-length`
/// and dead-letter arguments, used through nodes that are not their
/// masters: messages expire with no consumer and reach the dead-letter
/// queue with RabbitMQ's `x-death`; rejected ones follow; a full queue
/// drops its head or refuses publishes with a nack; bad or inequivalent
/// arguments are 406.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ttl_max_length_and_dead_lettering() {
    init_tracing();
    let c = AmqpCluster::start().await;
    c.cluster.node(1).set_policy(common::policy("^lim", r#"{"ha-mode":"all"}"#)).await.unwrap();
    let conn1 = c.connect(1).await;
    let ch1 = conn1.create_channel().await.unwrap();
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    ch1.exchange_declare(
        s("lim.dlx"),
        lapin::ExchangeKind::Direct,
        lapin::options::ExchangeDeclareOptions { durable: true, ..Default::default() },
        FieldTable::default(),
    )
    .await
    .unwrap();
    ch1.queue_declare(s("lim.dead"), durable, FieldTable::default()).await.unwrap();
    ch1.queue_bind(s("lim.dead"), s("lim.dlx"), s("dead"), Default::default(), FieldTable::default()).await.unwrap();
    let mut args = FieldTable::default();
    args.insert(s("x-message-ttl"), AMQPValue::LongInt(300));
    args.insert(s("x-dead-letter-exchange"), AMQPValue::LongString("lim.dlx".into()));
    args.insert(s("x-dead-letter-routing-key"), AMQPValue::LongString("dead".into()));
    ch1.queue_declare(s("lim.ttl"), durable, args.clone()).await.unwrap();
    assert!(c.cluster.node(1).queue_members("lim.ttl").is_some_and(|m| m.len() == 3), "mirrored on three nodes");

    // Publish through a node that is not the master; nobody consumes.
    let master = c.cluster.node(1).queue_info("lim.ttl").unwrap().leader.unwrap();
    let other = (1..=3).find(|n| *n != master).unwrap();
    let conn = c.connect(other).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let props = BasicProperties::default().with_message_id(s("m-1"));
    for i in 0..3 {
        let conf = ch
            .basic_publish(
                s(""),
                s("lim.ttl"),
                BasicPublishOptions::default(),
                format!("t{i}").as_bytes(),
                props.clone(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(conf.is_ack());
    }
    // Re-declaring with the same arguments is fine; with others it is 406.
    ch.queue_declare(s("lim.ttl"), durable, args.clone()).await.unwrap();
    let mut other_ttl = args.clone();
    other_ttl.insert(s("x-message-ttl"), AMQPValue::LongInt(301));
    let bad = conn.create_channel().await.unwrap();
    let err = bad.queue_declare(s("lim.ttl"), durable, other_ttl).await.unwrap_err();
    assert_amqp_error(&err, "406", "PRECONDITION_FAILED");
    assert!(format!("{err:?}").contains("inequivalent arg 'x-message-ttl'"), "{err:?}");

    // Expired with no consumer and no other traffic: the master's timer.
    wait_ready(&c, "lim.dead", 3).await;
    wait_ready(&c, "lim.ttl", 0).await;
    for i in 0..3 {
        let got = ch.basic_get(s("lim.dead"), BasicGetOptions { no_ack: true }).await.unwrap().expect("dead letter");
        assert_eq!(got.delivery.data, format!("t{i}").into_bytes(), "in publish order, bodies intact");
        assert_eq!(got.delivery.exchange.as_str(), "lim.dlx");
        assert_eq!(got.delivery.routing_key.as_str(), "dead");
        assert_eq!(got.delivery.properties.message_id().as_ref().map(|v| v.as_str()), Some("m-1"));
        let d = x_death(&got.delivery.properties);
        assert_eq!(d.len(), 1);
        assert_eq!(text(&d[0], "reason"), "expired");
        assert_eq!(text(&d[0], "queue"), "lim.ttl");
        assert_eq!(text(&d[0], "exchange"), "");
        assert_eq!(d[0].inner().get("count"), Some(&AMQPValue::LongLongInt(1)));
        let h = got.delivery.properties.headers().clone().unwrap();
        assert_eq!(h.inner().get("x-first-death-reason"), Some(&AMQPValue::LongString("expired".into())));
    }

    // Rejected without requeue: dead-lettered with the original routing key
    // when the queue names no dead-letter routing key.
    let mut args = FieldTable::default();
    args.insert(s("x-dead-letter-exchange"), AMQPValue::LongString("".into()));
    ch1.queue_declare(s("lim.work"), durable, args).await.unwrap();
    assert!(publish(&ch, "lim.work", b"bad").await);
    let got = ch.basic_get(s("lim.work"), BasicGetOptions { no_ack: false }).await.unwrap().expect("message");
    got.delivery.reject(lapin::options::BasicRejectOptions { requeue: false }).await.unwrap();
    // Dead-lettered to "" with key "lim.work": back into lim.work itself,
    // allowed because the cycle has a rejection in it.
    wait_ready(&c, "lim.work", 1).await;
    let again = ch.basic_get(s("lim.work"), BasicGetOptions { no_ack: true }).await.unwrap().expect("dead letter");
    assert_eq!(again.delivery.data, b"bad");
    let d = x_death(&again.delivery.properties);
    assert_eq!((text(&d[0], "reason"), text(&d[0], "queue")), ("rejected".to_string(), "lim.work".to_string()));
    assert!(!again.delivery.redelivered, "a dead letter is a new message");

    // Max length, drop-head: the oldest go, to the dead-letter exchange.
    let mut args = FieldTable::default();
    args.insert(s("x-max-length"), AMQPValue::LongInt(2));
    args.insert(s("x-dead-letter-exchange"), AMQPValue::LongString("lim.dlx".into()));
    args.insert(s("x-dead-letter-routing-key"), AMQPValue::LongString("dead".into()));
    ch1.queue_declare(s("lim.short"), durable, args).await.unwrap();
    for i in 0..5 {
        assert!(publish(&ch, "lim.short", format!("s{i}").as_bytes()).await, "drop-head never refuses a publish");
    }
    wait_ready(&c, "lim.short", 2).await;
    for want in ["s3", "s4"] {
        let got = ch.basic_get(s("lim.short"), BasicGetOptions { no_ack: true }).await.unwrap().expect("message");
        assert_eq!(got.delivery.data, want.as_bytes());
    }
    wait_ready(&c, "lim.dead", 3).await;
    for want in ["s0", "s1", "s2"] {
        let got = ch.basic_get(s("lim.dead"), BasicGetOptions { no_ack: true }).await.unwrap().expect("dead letter");
        assert_eq!(got.delivery.data, want.as_bytes());
        assert_eq!(text(&x_death(&got.delivery.properties)[0], "reason"), "maxlen");
    }

    // Max length, reject-publish: the publish over the limit is nacked.
    let mut args = FieldTable::default();
    args.insert(s("x-max-length"), AMQPValue::LongInt(1));
    args.insert(s("x-overflow"), AMQPValue::LongString("reject-publish".into()));
    ch1.queue_declare(s("lim.full"), durable, args).await.unwrap();
    let mut outcomes = Vec::new();
    for i in 0..3 {
        outcomes.push(publish(&ch, "lim.full", format!("f{i}").as_bytes()).await);
    }
    assert_eq!(outcomes, vec![true, false, false]);
    let got = ch.basic_get(s("lim.full"), BasicGetOptions { no_ack: true }).await.unwrap().expect("message");
    assert_eq!(got.delivery.data, b"f0");
    assert!(publish(&ch, "lim.full", b"f3").await, "room again once consumed");

    // A TTL set by policy applies to messages published after it.
    ch1.queue_declare(s("lim.bypolicy"), durable, FieldTable::default()).await.unwrap();
    let mut p = common::policy("^lim\\.bypolicy$", r#"{"ha-mode":"all","message-ttl":200}"#);
    p.name = "ttl".into();
    p.priority = 1;
    c.cluster.node(2).set_policy(p).await.unwrap();
    // The master applies the policy on its next reconcile round (every
    // 500 ms); its proposer's limits cannot be seen from outside.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(publish(&ch, "lim.bypolicy", b"p").await);
    wait_ready(&c, "lim.bypolicy", 0).await;

    // Invalid arguments: 406, the channel closes, the connection lives.
    for (k, v) in [
        ("x-message-ttl", AMQPValue::LongInt(-5)),
        ("x-max-length", AMQPValue::LongString("ten".into())),
        ("x-overflow", AMQPValue::LongString("reject-publish-dlx".into())),
        ("x-max-length-bytes", AMQPValue::LongInt(1000)),
    ] {
        let bad = conn.create_channel().await.unwrap();
        let mut a = FieldTable::default();
        a.insert(s(k), v);
        let err = bad.queue_declare(s("lim.bad"), durable, a).await.unwrap_err();
        assert_amqp_error(&err, "406", "PRECONDITION_FAILED");
        assert!(format!("{err:?}").contains(k), "{err:?}");
    }
    assert!(c.cluster.node(1).find_queue("lim.bad").await.is_err(), "nothing declared");
    assert!(ch.basic_get(s("lim.ttl"), BasicGetOptions { no_ack: true }).await.unwrap().is_none());
    c.cluster.shutdown().await;
}

/// Counts deliveries per consumer until none arrives for `quiet`.
async fn drain_counts(consumers: &mut [&mut lapin::Consumer], quiet: Duration) -> Vec<usize> {
    let mut counts = vec![0; consumers.len()];
    loop {
        let mut any = false;
        for (i, c) in consumers.iter_mut().enumerate() {
            if let Ok(Some(d)) = tokio::time::timeout(quiet / 4, c.next()).await {
                d.unwrap();
                counts[i] += 1;
                any = true;
            }
        }
        if !any {
            tokio::time::sleep(quiet).await;
            let mut late = false;
            for (i, c) in consumers.iter_mut().enumerate() {
                if let Ok(Some(d)) = tokio::time::timeout(Duration::from_millis(10), c.next()).await {
                    d.unwrap();
                    counts[i] += 1;
                    late = true;
                }
            }
            if !late {
                return counts;
            }
        }
    }
}

/// `basic.qos` per consumer (`global = false`: each consumer started after
/// it gets that limit) and per channel (`global = true`: shared);
/// `queue.declare-ok` counts consumers on every node; an exclusive consumer
/// is refused on a queue with consumers and keeps others away (403).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn qos_per_consumer_and_per_channel_exclusive_consumers_and_counts() {
    init_tracing();
    let c = AmqpCluster::start().await;
    let conn1 = c.connect(1).await;
    let ch1 = conn1.create_channel().await.unwrap();
    ch1.queue_declare(s("pc"), QueueDeclareOptions::default(), FieldTable::default()).await.unwrap();
    ch1.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    for i in 0..40 {
        assert!(publish(&ch1, "pc", format!("m{i}").as_bytes()).await);
    }

    // Two consumers on one channel of another node, limits 2 and 3.
    let conn2 = c.connect(2).await;
    let ch2 = conn2.create_channel().await.unwrap();
    ch2.basic_qos(2, BasicQosOptions { global: false }).await.unwrap();
    let mut a =
        ch2.basic_consume(s("pc"), s("a"), BasicConsumeOptions::default(), FieldTable::default()).await.unwrap();
    ch2.basic_qos(3, BasicQosOptions { global: false }).await.unwrap();
    let mut b =
        ch2.basic_consume(s("pc"), s("b"), BasicConsumeOptions::default(), FieldTable::default()).await.unwrap();
    assert_eq!(drain_counts(&mut [&mut a, &mut b], Duration::from_millis(700)).await, vec![2, 3]);

    // A channel-wide limit of 4 shared by two consumers without their own.
    let ch3 = conn2.create_channel().await.unwrap();
    ch3.basic_qos(4, BasicQosOptions { global: true }).await.unwrap();
    let mut x =
        ch3.basic_consume(s("pc"), s("x"), BasicConsumeOptions::default(), FieldTable::default()).await.unwrap();
    let mut y =
        ch3.basic_consume(s("pc"), s("y"), BasicConsumeOptions::default(), FieldTable::default()).await.unwrap();
    let shared = drain_counts(&mut [&mut x, &mut y], Duration::from_millis(700)).await;
    assert_eq!(shared.iter().sum::<usize>(), 4, "{shared:?}");
    // Both limits: a per-consumer 1 under the channel's 4, which is full.
    ch3.basic_qos(1, BasicQosOptions { global: false }).await.unwrap();
    let mut z =
        ch3.basic_consume(s("pc"), s("z"), BasicConsumeOptions::default(), FieldTable::default()).await.unwrap();
    assert_eq!(drain_counts(&mut [&mut z], Duration::from_millis(500)).await, vec![0], "the channel is full");

    // declare-ok counts the consumers, asked on a third node.
    let conn3 = c.connect(3).await;
    let ch4 = conn3.create_channel().await.unwrap();
    let q = ch4
        .queue_declare(s("pc"), QueueDeclareOptions { passive: true, ..Default::default() }, FieldTable::default())
        .await
        .unwrap();
    assert_eq!(q.consumer_count(), 5);
    assert_eq!(q.message_count(), 40 - 2 - 3 - 4);

    // An exclusive consumer is refused where others consume...
    let err = ch4
        .basic_consume(
            s("pc"),
            s("ex"),
            BasicConsumeOptions { exclusive: true, ..Default::default() },
            FieldTable::default(),
        )
        .await
        .unwrap_err();
    assert_amqp_error(&err, "403", "ACCESS_REFUSED");
    assert!(format!("{err:?}").contains("in exclusive use"), "{err:?}");
    // ...and keeps everyone else away from its queue, on any node.
    ch1.queue_declare(s("solo"), QueueDeclareOptions::default(), FieldTable::default()).await.unwrap();
    let only = ch1
        .basic_consume(
            s("solo"),
            s("only"),
            BasicConsumeOptions { exclusive: true, ..Default::default() },
            FieldTable::default(),
        )
        .await
        .unwrap();
    let ch5 = conn3.create_channel().await.unwrap();
    let err = ch5
        .basic_consume(s("solo"), s("late"), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap_err();
    assert_amqp_error(&err, "403", "ACCESS_REFUSED");
    ch1.basic_cancel(s("only"), Default::default()).await.unwrap();
    drop(only);
    let ch6 = conn3.create_channel().await.unwrap();
    ch6.basic_consume(s("solo"), s("late"), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .expect("free once the exclusive consumer is gone");
    c.cluster.shutdown().await;
}

/// A memory alarm on the node a publisher is connected to: the client is
/// told `connection.blocked`, its publish waits (unread, unconfirmed)
/// while consumers on the same node go on; when the alarm clears it is
/// told `unblocked` and the publish is stored and confirmed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_resource_alarm_blocks_publishers_until_it_clears() {
    use mirrorq::alarms::{Watermark, DEFAULT_DISK_FREE_LIMIT};
    init_tracing();
    let c = AmqpCluster::start().await;
    let conn1 = c.connect(1).await;
    let ch1 = conn1.create_channel().await.unwrap();
    ch1.queue_declare(s("alarmed"), QueueDeclareOptions::default(), FieldTable::default()).await.unwrap();
    ch1.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    assert!(publish(&ch1, "alarmed", b"before").await);

    // A publishing connection (alarms concern those) and a consuming one.
    let publisher = c.connect(2).await;
    let pch = publisher.create_channel().await.unwrap();
    pch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    assert!(publish(&pch, "no-such-queue", b"").await);
    let consumer = c.connect(2).await;
    let cch = consumer.create_channel().await.unwrap();
    assert!(!publisher.status().blocked());

    c.cluster.node(2).alarms().set_limits(Watermark::Bytes(1), DEFAULT_DISK_FREE_LIMIT);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !publisher.status().blocked() {
        assert!(std::time::Instant::now() < deadline, "no connection.blocked");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(!consumer.status().blocked(), "a connection that never published is not told");
    // The client may hold the publish itself (lapin does once told) or
    // send it (the node then leaves it unread): either way, no confirm.
    let mut confirm = tokio::spawn(async move {
        pch.basic_publish(s(""), s("alarmed"), BasicPublishOptions::default(), b"during", BasicProperties::default())
            .await
            .unwrap()
            .await
            .unwrap()
    });
    assert!(tokio::time::timeout(Duration::from_millis(1500), &mut confirm).await.is_err(), "confirmed while blocked");
    // Consumers on the alarmed node keep going; nothing new was stored.
    let got = cch.basic_get(s("alarmed"), BasicGetOptions { no_ack: true }).await.unwrap().expect("message");
    assert_eq!(got.delivery.data, b"before");
    assert_eq!(c.cluster.node(1).status("alarmed").await.unwrap(), (0, 0));
    // Publishers on other nodes are not blocked by this node's alarm.
    assert!(publish(&ch1, "alarmed", b"elsewhere").await);

    c.cluster.node(2).alarms().set_limits(Watermark::default(), DEFAULT_DISK_FREE_LIMIT);
    let conf = tokio::time::timeout(Duration::from_secs(10), confirm).await.expect("confirmed once cleared").unwrap();
    assert!(!consumer.status().blocked());
    assert!(conf.is_ack());
    assert!(!publisher.status().blocked(), "connection.unblocked");
    let mut bodies = Vec::new();
    while let Some(m) = cch.basic_get(s("alarmed"), BasicGetOptions { no_ack: true }).await.unwrap() {
        bodies.push(m.delivery.data);
    }
    assert_eq!(bodies, vec![b"elsewhere".to_vec(), b"during".to_vec()]);
    c.cluster.shutdown().await;
}

/// `queue.delete` with `if-unused` is refused while the queue has a
/// consumer on any node; deleting it cancels that consumer from the server
/// side (`consumer_cancel_notify`): its stream ends instead of stalling.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deleting_a_consumed_queue_cancels_its_consumers() {
    init_tracing();
    let c = AmqpCluster::start().await;
    let conn1 = c.connect(1).await;
    let ch1 = conn1.create_channel().await.unwrap();
    ch1.queue_declare(s("doomed"), QueueDeclareOptions::default(), FieldTable::default()).await.unwrap();
    let conn2 = c.connect(2).await;
    let ch2 = conn2.create_channel().await.unwrap();
    let mut consumer = ch2
        .basic_consume(s("doomed"), s("watcher"), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap();

    let conn3 = c.connect(3).await;
    let bad = conn3.create_channel().await.unwrap();
    let err = bad
        .queue_delete(s("doomed"), lapin::options::QueueDeleteOptions { if_unused: true, ..Default::default() })
        .await
        .unwrap_err();
    assert_amqp_error(&err, "406", "PRECONDITION_FAILED");
    assert!(format!("{err:?}").contains("in use"), "{err:?}");

    let ch3 = conn3.create_channel().await.unwrap();
    ch3.queue_delete(s("doomed"), Default::default()).await.unwrap();
    let end = tokio::time::timeout(Duration::from_secs(10), consumer.next()).await.expect("consumer not cancelled");
    assert!(end.is_none(), "the stream ends with the server's basic.cancel: {end:?}");
    // The channel itself is still usable.
    ch2.queue_declare(s("after"), QueueDeclareOptions::default(), FieldTable::default()).await.unwrap();
    c.cluster.shutdown().await;
}

/// Per-message TTL (`expiration`) on a mirrored queue without a queue
/// TTL: the retry pattern, a "wait" queue dead-lettering into the work
/// queue. Expired at the head only (RabbitMQ's rule); the dead letter
/// loses its `expiration` (kept as `original-expiration`) so it stays in
/// the work queue; a bad `expiration` is 406.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn per_message_ttl_and_retry_through_a_wait_queue() {
    init_tracing();
    let c = AmqpCluster::start().await;
    c.cluster.node(1).set_policy(common::policy("^pm", r#"{"ha-mode":"all"}"#)).await.unwrap();
    let conn1 = c.connect(1).await;
    let ch1 = conn1.create_channel().await.unwrap();
    ch1.queue_declare(s("pm.work"), QueueDeclareOptions::default(), FieldTable::default()).await.unwrap();
    let mut args = FieldTable::default();
    args.insert(s("x-dead-letter-exchange"), AMQPValue::LongString("".into()));
    args.insert(s("x-dead-letter-routing-key"), AMQPValue::LongString("pm.work".into()));
    ch1.queue_declare(s("pm.wait"), QueueDeclareOptions::default(), args).await.unwrap();

    let master = c.cluster.node(1).queue_info("pm.wait").unwrap().leader.unwrap();
    let conn = c.connect((1..=3).find(|n| *n != master).unwrap()).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let expiring = |ms: &str| BasicProperties::default().with_expiration(s(ms)).with_message_id(s(ms));
    let send = |body: &'static [u8], props: BasicProperties| {
        let ch = ch.clone();
        async move {
            ch.basic_publish(s(""), s("pm.wait"), BasicPublishOptions::default(), body, props)
                .await
                .unwrap()
                .await
                .unwrap()
                .is_ack()
        }
    };
    // A long-lived message at the head keeps a short-lived one behind it.
    assert!(send(b"slow", expiring("60000")).await);
    assert!(send(b"fast", expiring("200")).await);
    // Well past "fast"'s expiration, which must not take it from behind the head.
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(c.cluster.node(1).status("pm.wait").await.unwrap(), (2, 0), "expiry only at the head");
    let slow = ch.basic_get(s("pm.wait"), BasicGetOptions { no_ack: true }).await.unwrap().expect("head");
    assert_eq!(slow.delivery.data, b"slow");
    assert_eq!(slow.delivery.properties.expiration().as_ref().map(|e| e.as_str()), Some("60000"), "kept while queued");
    // Now at the head and overdue: dead-lettered into the work queue.
    wait_ready(&c, "pm.work", 1).await;
    wait_ready(&c, "pm.wait", 0).await;
    // Past the original 200 ms: the dead letter must not expire again.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let got = ch.basic_get(s("pm.work"), BasicGetOptions { no_ack: true }).await.unwrap().expect("retried message");
    assert_eq!(got.delivery.data, b"fast");
    assert_eq!(*got.delivery.properties.expiration(), None, "does not expire again in the work queue");
    assert_eq!(got.delivery.properties.message_id().as_ref().map(|v| v.as_str()), Some("200"));
    let d = x_death(&got.delivery.properties);
    assert_eq!(text(&d[0], "reason"), "expired");
    assert_eq!(text(&d[0], "queue"), "pm.wait");
    assert_eq!(text(&d[0], "original-expiration"), "200");

    // Expiration 0 with nobody waiting: gone at once (to the work queue).
    assert!(send(b"now", expiring("0")).await);
    wait_ready(&c, "pm.work", 1).await;

    let bad = conn.create_channel().await.unwrap();
    bad.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let r = bad.basic_publish(s(""), s("pm.wait"), BasicPublishOptions::default(), b"x", expiring("soon")).await;
    let err = match r {
        Ok(confirm) => confirm.await.unwrap_err(),
        Err(e) => e,
    };
    assert_amqp_error(&err, "406", "PRECONDITION_FAILED");
    c.cluster.shutdown().await;
}

/// Users, vhosts and permissions over AMQP: a user logs in to the vhost it
/// was given and nowhere else; a vhost is a namespace of its own (same
/// queue names, its own exchanges, dead-lettering inside it); the
/// configure/write/read patterns are enforced per operation and follow
/// changes at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn vhosts_users_and_permissions() {
    use lapin::options::{ExchangeDeclareOptions, QueueBindOptions};
    use mirrorq::metadata::{MetaCmd, Permission, User, Vhost};
    init_tracing();
    let c = AmqpCluster::start().await;
    let n1 = c.cluster.node(1).clone();
    let change = |cmd: MetaCmd| {
        let n1 = n1.clone();
        async move { n1.meta_change(cmd, String::new).await.expect("metadata change") }
    };
    change(MetaCmd::PutVhost(Vhost::named("dev"))).await;
    change(MetaCmd::PutUser(User::with_password("alice", "alice-pw", vec![]))).await;
    change(MetaCmd::SetPermission(Permission::full("alice", "dev"))).await;
    let uri = |node: u64, user: &str, vhost: &str| {
        format!("amqp://{user}@127.0.0.1:{}/{}", c.ports[(node - 1) as usize], vhost.replace('/', "%2f"))
    };

    // Where alice may not go, and a wrong password.
    let refused = Connection::connect(&uri(2, "alice:alice-pw", "/"), ConnectionProperties::default()).await;
    assert_amqp_error(&refused.expect_err("alice has no access to /"), "530", "NOT_ALLOWED");
    let missing = Connection::connect(&uri(2, "alice:alice-pw", "nope"), ConnectionProperties::default()).await;
    assert_amqp_error(&missing.expect_err("no such vhost"), "530", "NOT_ALLOWED");
    let wrong = Connection::connect(&uri(2, "alice:guest", "dev"), ConnectionProperties::default()).await;
    assert!(wrong.is_err(), "wrong password must be refused");

    // Same names in two vhosts are two queues.
    let alice = Connection::connect(&uri(2, "alice:alice-pw", "dev"), ConnectionProperties::default()).await.unwrap();
    let a = alice.create_channel().await.unwrap();
    a.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    a.queue_declare(s("jobs"), durable, FieldTable::default()).await.unwrap();
    let guest = c.connect(3).await;
    let g = guest.create_channel().await.unwrap();
    g.queue_declare(s("jobs"), durable, FieldTable::default()).await.unwrap();
    assert!(publish(&a, "jobs", b"in dev").await);
    assert!(publish(&a, "jobs", b"in dev 2").await);
    assert!(
        g.basic_get(s("jobs"), BasicGetOptions { no_ack: true }).await.unwrap().is_none(),
        "/ jobs is another queue"
    );
    let got = a.basic_get(s("jobs"), BasicGetOptions { no_ack: true }).await.unwrap().expect("dev jobs has it");
    assert_eq!(got.delivery.data, b"in dev");
    assert_eq!(n1.metadata().queues.len(), 2);

    // Exchanges are per vhost too.
    a.exchange_declare(
        s("logs"),
        lapin::ExchangeKind::Fanout,
        ExchangeDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap();
    a.queue_bind(s("jobs"), s("logs"), s(""), QueueBindOptions::default(), FieldTable::default()).await.unwrap();
    let passive = ExchangeDeclareOptions { passive: true, ..Default::default() };
    let err = g.exchange_declare(s("logs"), lapin::ExchangeKind::Fanout, passive, FieldTable::default()).await;
    assert_amqp_error(&err.expect_err("no logs exchange in /"), "404", "NOT_FOUND");
    let g = guest.create_channel().await.unwrap();

    // Dead-lettering stays inside the vhost.
    let mut dl = FieldTable::default();
    dl.insert(s("x-message-ttl"), AMQPValue::LongInt(50));
    dl.insert(s("x-dead-letter-exchange"), AMQPValue::LongString("".into()));
    dl.insert(s("x-dead-letter-routing-key"), AMQPValue::LongString("jobs".into()));
    a.queue_declare(s("wait"), durable, dl).await.unwrap();
    assert!(publish(&a, "wait", b"later").await);
    let mut bodies = Vec::new();
    for _ in 0..100 {
        if let Some(m) = a.basic_get(s("jobs"), BasicGetOptions { no_ack: true }).await.unwrap() {
            bodies.push(m.delivery.data.clone());
        }
        if bodies.iter().any(|b| b == b"later") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(bodies, vec![b"in dev 2".to_vec(), b"later".to_vec()], "expired into dev's jobs");
    assert!(g.basic_get(s("jobs"), BasicGetOptions { no_ack: true }).await.unwrap().is_none(), "not into /'s jobs");

    // Narrower permissions apply to the next operation on open channels.
    let mut narrow = Permission::full("alice", "dev");
    narrow.configure = "^alice-".into();
    narrow.read = "^alice-".into();
    change(MetaCmd::SetPermission(narrow)).await;
    wait_metadata(&c, 2, |m| m.permission("alice", "dev").is_some_and(|p| p.read == "^alice-")).await;
    let b = alice.create_channel().await.unwrap();
    b.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    b.queue_declare(s("alice-1"), durable, FieldTable::default()).await.unwrap();
    assert!(publish(&b, "jobs", b"still writable").await, "write is still .*");
    let err = b.queue_declare(s("other"), durable, FieldTable::default()).await;
    assert_amqp_error(&err.expect_err("configure refused"), "403", "ACCESS_REFUSED");
    let b = alice.create_channel().await.unwrap();
    let err = b.basic_get(s("jobs"), BasicGetOptions::default()).await;
    assert_amqp_error(&err.expect_err("read refused"), "403", "ACCESS_REFUSED");
    assert!(n1.metadata().queues.keys().all(|k| !k.ends_with("other")), "nothing declared when refused");

    // Revoked access, a deleted user, a deleted vhost: their open
    // connections are closed (320), as RabbitMQ closes them.
    change(MetaCmd::PutUser(User::with_password("bob", "bob-pw", vec![]))).await;
    change(MetaCmd::SetPermission(Permission::full("bob", "dev"))).await;
    let bob = Connection::connect(&uri(3, "bob:bob-pw", "dev"), ConnectionProperties::default()).await.unwrap();
    let bob2 = Connection::connect(&uri(1, "bob:bob-pw", "dev"), ConnectionProperties::default()).await.unwrap();
    change(MetaCmd::ClearPermission { vhost: "dev".into(), user: "bob".into() }).await;
    common::wait_until(Duration::from_secs(10), "bob's connections closed", || {
        !bob.status().connected() && !bob2.status().connected()
    })
    .await;
    let carl = Connection::connect(&uri(2, "alice:alice-pw", "dev"), ConnectionProperties::default()).await.unwrap();
    assert!(alice.status().connected() && carl.status().connected(), "others' access unchanged");
    change(MetaCmd::PutUser(User::with_password("dave", "dave-pw", vec![]))).await;
    change(MetaCmd::SetPermission(Permission::full("dave", "dev"))).await;
    let dave = Connection::connect(&uri(2, "dave:dave-pw", "dev"), ConnectionProperties::default()).await.unwrap();
    change(MetaCmd::DeleteUser { name: "dave".into() }).await;
    common::wait_until(Duration::from_secs(10), "dave's connection closed", || !dave.status().connected()).await;
    assert!(alice.status().connected(), "deleting another user closes nothing of alice's");

    // A deleted vhost takes its queues and connections with it; / keeps its own.
    change(MetaCmd::DeleteVhost { name: "dev".into() }).await;
    common::wait_until(Duration::from_secs(10), "dev's connections closed", || {
        !alice.status().connected() && !carl.status().connected()
    })
    .await;
    assert!(guest.status().connected(), "a connection to / stays");
    wait_metadata(&c, 3, |m| m.queues.len() == 1).await;
    assert!(n1.metadata().queues.contains_key("jobs"), "/ jobs survives");
    let gone = Connection::connect(&uri(1, "alice:alice-pw", "dev"), ConnectionProperties::default()).await;
    assert_amqp_error(&gone.expect_err("dev deleted"), "530", "NOT_ALLOWED");
    c.cluster.shutdown().await;
}

async fn wait_metadata(c: &AmqpCluster, node: u64, cond: impl Fn(&mirrorq::metadata::MetaState) -> bool) {
    let n = c.cluster.node(node).clone();
    common::wait_until(Duration::from_secs(10), "metadata change applied", || cond(&n.metadata())).await;
}

/// A consumer waiting on an empty queue has its get parked at the master,
/// which puts it in the next entry: each message published to it is
/// delivered by the very entry that publishes it (one Raft entry a message,
/// not a publish entry and then a get entry). The consumer and the
/// publisher are on other nodes than the master, so the parked get crosses
/// the node link.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_waiting_consumer_is_served_by_the_entry_that_publishes() {
    init_tracing();
    let c = AmqpCluster::start().await;
    let master = c.cluster.node(1);
    let setup = c.connect(1).await.create_channel().await.unwrap();
    setup
        .queue_declare(s("waiting"), QueueDeclareOptions { durable: true, ..Default::default() }, FieldTable::default())
        .await
        .unwrap();
    let consumer_conn = c.connect(2).await;
    let cch = consumer_conn.create_channel().await.unwrap();
    cch.basic_qos(10, BasicQosOptions::default()).await.unwrap();
    let mut deliveries =
        cch.basic_consume(s("waiting"), s("w"), BasicConsumeOptions::default(), FieldTable::default()).await.unwrap();
    let pch = c.connect(3).await.create_channel().await.unwrap();
    pch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    // Let the consumer settle into waiting (its parked gets are answered
    // empty without an entry, so the index stays put).
    let applied = || master.queue_info("waiting").unwrap().applied.unwrap_or(0);
    let mut before = applied();
    for _ in 0..50 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let now = applied();
        if now == before {
            break;
        }
        before = now;
    }
    // A parked get that found nothing for 200 ms is answered empty and the
    // consumer parks a new one; a publish landing in that gap (a node-link
    // round trip) is proposed alone and the consumer's next get takes an
    // entry of its own. That race hits about one run in ten here, so a run
    // of five messages gets a second try; without parking every message
    // takes two entries and both tries fail.
    let mut entries_per_message = Vec::new();
    for attempt in 0..2u8 {
        entries_per_message.clear();
        for i in 0..5u8 {
            let body = [attempt, i];
            assert!(publish(&pch, "waiting", &body).await, "message {i} confirmed");
            let d = tokio::time::timeout(Duration::from_secs(5), deliveries.next())
                .await
                .expect("delivered in time")
                .expect("consumer open")
                .expect("delivery");
            assert_eq!(d.data, body.to_vec());
            // Not acked yet: an ack would be an entry of its own.
            let delivered = applied();
            entries_per_message.push(delivered - before);
            d.ack(BasicAckOptions::default()).await.unwrap();
            // The ack's entry; then the consumer waits again (its get,
            // answered empty by that entry, parks again at once).
            common::wait_until(Duration::from_secs(5), "the ack's entry is applied", || applied() > delivered).await;
            before = applied();
        }
        if entries_per_message.iter().all(|n| *n == 1) {
            break;
        }
    }
    assert_eq!(entries_per_message, vec![1; 5], "entries that published and delivered each message");
}

/// Publishes that arrive in one read go to the queue together (one batch),
/// yet each gets its own answer (acked while the queue had room, nacked
/// after), and whatever the channel does after them (here gets, and a
/// publish after a get) takes effect after them, in the order sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn publishes_read_together_are_answered_each_and_keep_their_place() {
    use amq_protocol::frame::AMQPFrame;
    use amq_protocol::protocol::{basic, channel, confirm, AMQPClass};
    use raw::method;
    init_tracing();
    let c = AmqpCluster::start().await;
    c.cluster.node(1).set_policy(common::policy("^pipe", r#"{"ha-mode":"all"}"#)).await.unwrap();
    let conn = c.connect(1).await;
    let ch = conn.create_channel().await.unwrap();
    let mut args = FieldTable::default();
    args.insert(s("x-max-length"), AMQPValue::LongInt(4));
    args.insert(s("x-overflow"), AMQPValue::LongString("reject-publish".into()));
    ch.queue_declare(s("pipe"), QueueDeclareOptions { durable: true, ..Default::default() }, args).await.unwrap();

    let mut raw = raw::Raw::open(c.ports[0]).await;
    let get = || method(1, AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get { queue: "pipe".into(), no_ack: true })));
    let mut frames = vec![
        method(1, AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {}))),
        method(1, AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select { nowait: false }))),
    ];
    for i in 0..10 {
        frames.extend(raw::publish(1, "pipe", format!("q{i}").as_bytes()));
    }
    frames.push(get());
    frames.extend(raw::publish(1, "pipe", b"q10"));
    frames.push(get());
    raw.send(&frames).await;

    let mut answers = std::collections::BTreeMap::new();
    let mut got = Vec::new();
    while answers.len() < 11 || got.len() < 2 {
        match raw.next().await {
            AMQPFrame::Method(1, AMQPClass::Basic(basic::AMQPMethod::Ack(a))) => {
                // `multiple`: every publish not answered yet, up to the tag.
                let from = if a.multiple { 1 } else { a.delivery_tag };
                for tag in from..=a.delivery_tag {
                    answers.entry(tag).or_insert(true);
                }
            }
            AMQPFrame::Method(1, AMQPClass::Basic(basic::AMQPMethod::Nack(n))) => {
                assert!(answers.insert(n.delivery_tag, false).is_none(), "publish {} answered twice", n.delivery_tag);
            }
            AMQPFrame::Method(1, AMQPClass::Basic(basic::AMQPMethod::GetOk(_))) => {
                assert!(matches!(raw.next().await, AMQPFrame::Header(1, _)));
                match raw.next().await {
                    AMQPFrame::Body(1, body) => got.push(String::from_utf8(body).unwrap()),
                    other => panic!("expected a body, got {other:?}"),
                }
            }
            AMQPFrame::Method(1, AMQPClass::Basic(basic::AMQPMethod::GetEmpty(_))) => got.push("(empty)".to_string()),
            AMQPFrame::Method(1, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))
            | AMQPFrame::Method(1, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_))) => {}
            other => panic!("unexpected frame {other:?}"),
        }
    }
    assert_eq!(got, ["q0", "q1"], "each get sees the publishes sent before it");
    let want: std::collections::BTreeMap<u64, bool> = (1..=11).map(|tag| (tag, tag <= 4 || tag == 11)).collect();
    assert_eq!(answers, want, "acked while there was room: the first four, and the one after the get");
    c.cluster.shutdown().await;
}

/// A message requeued with basic.nack is back at the head of the queue for
/// whatever the channel does next, even when the nack and a basic.consume
/// arrive in one read: the consumer's first delivery is that message,
/// marked redelivered (RabbitMQ handles a channel's methods in order).
///
/// The nack used to be submitted from a task of its own, which raced the
/// consumer's first get: `pika_works_unchanged` saw m1 first once under CI
/// load. In process this test did not lose that race in five runs without
/// the fix; the order is now kept by submitting in the connection's loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_requeue_is_back_before_a_consume_sent_with_it() {
    use amq_protocol::frame::AMQPFrame;
    use amq_protocol::protocol::{basic, channel, AMQPClass};
    use raw::method;
    init_tracing();
    let c = AmqpCluster::start().await;
    c.cluster.node(1).set_policy(common::policy("^order", r#"{"ha-mode":"all"}"#)).await.unwrap();
    let conn = c.connect(1).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    ch.queue_declare(s("order"), QueueDeclareOptions { durable: true, ..Default::default() }, FieldTable::default())
        .await
        .unwrap();
    for i in 0..5 {
        let confirm = ch
            .basic_publish(
                s(""),
                s("order"),
                BasicPublishOptions::default(),
                format!("m{i}").as_bytes(),
                BasicProperties::default(),
            )
            .await
            .unwrap();
        assert!(confirm.await.unwrap().is_ack());
    }

    let mut raw = raw::Raw::open(c.ports[0]).await;
    // Read a content's body after its method frame.
    async fn body(raw: &mut raw::Raw) -> String {
        assert!(matches!(raw.next().await, AMQPFrame::Header(1, _)));
        match raw.next().await {
            AMQPFrame::Body(1, b) => String::from_utf8(b).unwrap(),
            other => panic!("expected a body, got {other:?}"),
        }
    }
    raw.send(&[
        method(1, AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {}))),
        method(1, AMQPClass::Basic(basic::AMQPMethod::Get(basic::Get { queue: "order".into(), no_ack: false }))),
    ])
    .await;
    assert!(matches!(raw.next().await, AMQPFrame::Method(1, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))));
    let tag = match raw.next().await {
        AMQPFrame::Method(1, AMQPClass::Basic(basic::AMQPMethod::GetOk(g))) => g.delivery_tag,
        other => panic!("expected get-ok, got {other:?}"),
    };
    assert_eq!(body(&mut raw).await, "m0");
    // The requeue and the consumer in one write.
    let nack = basic::Nack { delivery_tag: tag, multiple: false, requeue: true };
    let qos = basic::Qos { prefetch_count: 10, global: false };
    let consume = basic::Consume {
        queue: "order".into(),
        consumer_tag: "c".into(),
        no_local: false,
        no_ack: true,
        exclusive: false,
        nowait: false,
        arguments: Default::default(),
    };
    raw.send(&[
        method(1, AMQPClass::Basic(basic::AMQPMethod::Nack(nack))),
        method(1, AMQPClass::Basic(basic::AMQPMethod::Qos(qos))),
        method(1, AMQPClass::Basic(basic::AMQPMethod::Consume(consume))),
    ])
    .await;
    let mut seen = Vec::new();
    while seen.len() < 5 {
        match raw.next().await {
            AMQPFrame::Method(1, AMQPClass::Basic(basic::AMQPMethod::Deliver(d))) => {
                seen.push((body(&mut raw).await, d.redelivered));
            }
            AMQPFrame::Method(1, AMQPClass::Basic(basic::AMQPMethod::QosOk(_)))
            | AMQPFrame::Method(1, AMQPClass::Basic(basic::AMQPMethod::ConsumeOk(_))) => {}
            other => panic!("unexpected frame {other:?}"),
        }
    }
    let want: Vec<(String, bool)> = (0..5).map(|i| (format!("m{i}"), i == 0)).collect();
    assert_eq!(seen, want, "the requeued message first, redelivered; then the rest in order");
    c.cluster.shutdown().await;
}

/// The reply code and text of a `connection.close` from the broker.
fn close_of(frame: &amq_protocol::frame::AMQPFrame) -> Option<(u16, String)> {
    use amq_protocol::protocol::{connection, AMQPClass};
    match frame {
        amq_protocol::frame::AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(c))) => {
            Some((c.reply_code, c.reply_text.to_string()))
        }
        _ => None,
    }
}

/// Protocol limits, held as RabbitMQ holds them: a frame whose header
/// announces more than the negotiated `frame_max` is refused (501) on its
/// header, its body never waited for; a channel above the negotiated
/// `channel_max` is refused (530); a node with its connection limit reached
/// refuses the next `connection.open` (530) and takes one again once a
/// client has gone; a client that does not finish the handshake within 10 s
/// is closed, whether it stopped after the protocol header or sent nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frames_channels_connections_and_handshakes_are_held_to_their_limits() {
    use amq_protocol::protocol::{channel, AMQPClass};
    init_tracing();
    let cluster =
        Cluster::start_configured(1, fast_timing(Duration::from_secs(5)), |cfg| cfg.max_connections = 2).await;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = l.local_addr().unwrap().port();
    let node = cluster.node(1).clone();
    tokio::spawn(mirrorq::amqp::serve(l, node.clone(), node.stopped()));

    // The two idle clients start first: their 10 s run meanwhile.
    let silent = tokio::spawn(async move {
        let mut sock = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        let started = std::time::Instant::now();
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(15), sock.read(&mut buf)).await;
        (matches!(n, Ok(Ok(0)) | Ok(Err(_))), started.elapsed())
    });
    let after_header = tokio::spawn(async move {
        let mut sock = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        sock.write_all(b"AMQP\x00\x00\x09\x01").await.unwrap();
        let started = std::time::Instant::now();
        let mut got = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match tokio::time::timeout(Duration::from_secs(15), sock.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return (true, started.elapsed(), got),
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
                Err(_) => return (false, started.elapsed(), got),
            }
        }
    });

    // A method frame on channel 1 announcing 1 MiB, and 3 bytes of it.
    let mut r = raw::Raw::open(port).await;
    r.send_bytes(&[1, 0, 1, 0x00, 0x10, 0x00, 0x00, 0, 60, 0]).await;
    let (code, text) = close_of(&r.next().await).expect("connection.close");
    assert_eq!(code, 501, "{text}");
    assert!(text.contains("frame_max"), "{text}");
    drop(r);

    // Raw::open negotiates channel_max 16.
    let mut r = raw::Raw::open(port).await;
    r.send(&[raw::method(17, AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})))]).await;
    let (code, text) = close_of(&r.next().await).expect("connection.close");
    assert_eq!(code, 530, "{text}");
    assert!(text.contains("channel_max"), "{text}");
    drop(r);

    // Two open connections at most (the closed ones above may take a
    // moment to be forgotten).
    let mut open = Vec::new();
    while open.len() < 2 {
        let (r, answer) = raw::Raw::handshake(port).await;
        if close_of(&answer).is_none() {
            open.push(r);
        } else {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    let (_, answer) = raw::Raw::handshake(port).await;
    let (code, text) = close_of(&answer).expect("the third connection is refused");
    assert_eq!(code, 530, "{text}");
    assert!(text.contains("connection limit (2)"), "{text}");
    open.pop();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while close_of(&raw::Raw::handshake(port).await.1).is_some() {
        assert!(std::time::Instant::now() < deadline, "no connection taken after one went");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let (closed, took) = silent.await.unwrap();
    assert!(closed, "a client that sent nothing was never closed");
    assert!(took >= Duration::from_secs(9) && took < Duration::from_secs(14), "{took:?}");
    let (closed, took, got) = after_header.await.unwrap();
    assert!(closed, "a client that stopped after the protocol header was never closed");
    assert!(took >= Duration::from_secs(9) && took < Duration::from_secs(14), "{took:?}");
    assert!(!got.is_empty(), "it was sent connection.start");
}

/// A consumer cut off from its queue's master (a partition, not a death)
/// goes on working through what it was sent. The master keeps those
/// messages with it past the failure timeout (given back then, they would
/// be delivered twice), and the acks the consumer sent while cut off
/// settle them once the partition heals.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_consumer_cut_off_from_its_master_keeps_its_window_and_its_acks_land_after_the_heal() {
    init_tracing();
    // Operations give up looking for a master long before the partition
    // heals: the acks must be sent again, not merely wait.
    let timing = mirrorq::node::Timing { op_timeout: Duration::from_secs(2), ..fast_timing(Duration::from_secs(5)) };
    let c = AmqpCluster::start_timed(timing).await;
    // `when-synced`: the consumer's node, alone, does not re-form the queue.
    let policy = r#"{"ha-mode":"all","ha-promote-on-failure":"when-synced"}"#;
    c.cluster.node(1).set_policy(common::policy("^cut", policy)).await.unwrap();
    c.cluster.node(1).declare_queue("cut-q", vec![]).await.unwrap();
    let master = c.cluster.master_of("cut-q").await;
    let at = (1..=3).find(|n| *n != master).unwrap();
    let m = c.cluster.node(master).clone();
    for i in 0..10 {
        common::publish_retrying(&m, "cut-q", format!("m{i}").into_bytes()).await;
    }
    let conn = c.connect(at).await;
    let ch = conn.create_channel().await.unwrap();
    ch.basic_qos(10, BasicQosOptions::default()).await.unwrap();
    let mut consumer =
        ch.basic_consume(s("cut-q"), s("cut"), BasicConsumeOptions::default(), FieldTable::default()).await.unwrap();
    let mut window = Vec::new();
    while window.len() < 10 {
        let d =
            tokio::time::timeout(Duration::from_secs(20), consumer.next()).await.expect("stalled").unwrap().unwrap();
        window.push(d);
    }
    assert_eq!(m.status("cut-q").await.unwrap(), (0, 10));

    tracing::info!(at, "--- the consumer's node is cut off from the others; its consumer acks its window");
    let others: Vec<u64> = (1..=3).filter(|id| *id != at).collect();
    for id in &others {
        c.cluster.node(*id).block(at);
        c.cluster.node(at).block(*id);
    }
    for d in &window {
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    // Three failure timeouts: the master's reaper sweeps every second.
    tokio::time::sleep(c.cluster.configs[0].timing.failure_timeout * 3).await;
    assert_eq!(m.status("cut-q").await.unwrap(), (0, 10), "the cut-off consumer's window was given back");

    tracing::info!("--- the partition heals");
    for id in &others {
        c.cluster.node(*id).unblock(at);
        c.cluster.node(at).unblock(*id);
    }
    let mut status = None;
    for _ in 0..200 {
        status = m.status("cut-q").await.ok();
        if status == Some((0, 0)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(status, Some((0, 0)), "the acks sent while cut off did not settle the window");
    let again = tokio::time::timeout(Duration::from_secs(2), consumer.next()).await;
    assert!(again.is_err(), "a message came twice: {again:?}");
    c.cluster.shutdown().await;
}

/// A no-ack consumer is cancelled and a message is published right after
/// the cancel-ok: the message stays in the queue. The consumer's get that
/// was waiting at the master when it was cancelled took no message it
/// then dropped (a no-ack get removes what it takes).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_published_after_a_no_ack_consumers_cancel_ok_stays_in_the_queue() {
    init_tracing();
    let c = AmqpCluster::start().await;
    c.cluster.node(1).declare_queue("nocancel-q", vec![1]).await.unwrap();
    for node in [1, 2] {
        let conn = c.connect(node).await;
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
        for round in 0..5 {
            let tag = format!("nc{node}-{round}");
            let opts = BasicConsumeOptions { no_ack: true, ..BasicConsumeOptions::default() };
            let mut consumer = ch.basic_consume(s("nocancel-q"), s(&tag), opts, FieldTable::default()).await.unwrap();
            // Its first get parks at the master, waiting for a publish.
            tokio::time::sleep(Duration::from_millis(50)).await;
            ch.basic_cancel(s(&tag), lapin::options::BasicCancelOptions::default()).await.unwrap();
            let body = format!("after-cancel-{node}-{round}");
            assert!(publish(&ch, "nocancel-q", body.as_bytes()).await, "confirmed");
            // Whatever the consumer was sent came before its cancel-ok.
            let mut sent_to_it = Vec::new();
            while let Ok(Some(Ok(d))) = tokio::time::timeout(Duration::from_millis(100), consumer.next()).await {
                sent_to_it.push(String::from_utf8(d.data).unwrap());
            }
            assert!(sent_to_it.is_empty(), "delivered after its cancel-ok: {sent_to_it:?}");
            let got = ch.basic_get(s("nocancel-q"), BasicGetOptions { no_ack: true }).await.unwrap();
            let got = got.map(|m| String::from_utf8(m.delivery.data).unwrap());
            assert_eq!(got.as_deref(), Some(body.as_str()), "the message published after the cancel-ok is gone");
        }
    }
    c.cluster.shutdown().await;
}

/// As RabbitMQ: deleting a queue or an exchange that is not there answers
/// delete-ok (a count of 0) and keeps the channel; `immediate=true` closes
/// the connection with 540; `connection.start` names every capability
/// mirrorq has that clients look for.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deletes_of_what_is_not_there_immediate_and_capabilities_as_rabbitmq_answers_them() {
    init_tracing();
    let c = AmqpCluster::start().await;
    let conn = c.connect(2).await;
    let ch = conn.create_channel().await.unwrap();
    let count = ch.queue_delete(s("never-declared"), Default::default()).await.expect("delete-ok");
    assert_eq!(count, 0);
    ch.exchange_delete(s("never-declared-x"), Default::default()).await.expect("delete-ok");
    ch.queue_declare(s("still-open"), QueueDeclareOptions::default(), FieldTable::default())
        .await
        .expect("the channel is still open");

    let start = raw::Raw::start_frame(c.ports[0]).await;
    let caps = match start.server_properties.inner().get("capabilities") {
        Some(AMQPValue::FieldTable(t)) => t.clone(),
        other => panic!("no capabilities table: {other:?}"),
    };
    for cap in ["exchange_exchange_bindings", "consumer_priorities", "publisher_confirms", "consumer_cancel_notify"] {
        assert_eq!(caps.inner().get(cap), Some(&AMQPValue::Boolean(true)), "capability {cap}: {caps:?}");
    }

    use amq_protocol::frame::{AMQPContentHeader, AMQPFrame};
    use amq_protocol::protocol::{basic, channel, AMQPClass};
    let mut raw = raw::Raw::open(c.ports[1]).await;
    let p = basic::Publish { exchange: "".into(), routing_key: "still-open".into(), mandatory: false, immediate: true };
    let header = AMQPContentHeader { class_id: 60, body_size: 1, properties: Default::default() };
    raw.send(&[
        raw::method(1, AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {}))),
        raw::method(1, AMQPClass::Basic(basic::AMQPMethod::Publish(p))),
        AMQPFrame::Header(1, header),
        AMQPFrame::Body(1, b"x".to_vec()),
    ])
    .await;
    assert!(matches!(raw.next().await, AMQPFrame::Method(1, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))));
    let closed = raw.next().await;
    assert_eq!(close_of(&closed).map(|(code, _)| code), Some(540), "{closed:?}");
    // It names the method it refuses, as RabbitMQ does (py-amqp checks).
    use amq_protocol::protocol::connection;
    let AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::Close(close))) = closed else {
        unreachable!()
    };
    assert_eq!(
        (close.class_id, close.method_id, close.reply_text.as_str()),
        (60, 40, "NOT_IMPLEMENTED - immediate=true")
    );
    c.cluster.shutdown().await;
}

/// As RabbitMQ: declaring a queue or an exchange that exists with other
/// flags is refused with 406 PRECONDITION_FAILED ("inequivalent arg"); a
/// passive declare asks for none and is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_redeclare_with_other_flags_is_refused() {
    use lapin::options::ExchangeDeclareOptions;
    init_tracing();
    let c = AmqpCluster::start().await;
    let conn = c.connect(2).await;
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    let ch = conn.create_channel().await.unwrap();
    ch.queue_declare(s("flags-q"), durable, FieldTable::default()).await.unwrap();
    ch.queue_declare(s("flags-q"), durable, FieldTable::default()).await.expect("the same flags");
    let passive = QueueDeclareOptions { passive: true, ..Default::default() };
    ch.queue_declare(s("flags-q"), passive, FieldTable::default()).await.expect("passive");
    for (what, opts) in [
        ("durable", QueueDeclareOptions::default()),
        ("auto_delete", QueueDeclareOptions { durable: true, auto_delete: true, ..Default::default() }),
    ] {
        let ch = conn.create_channel().await.unwrap();
        let err = ch.queue_declare(s("flags-q"), opts, FieldTable::default()).await.unwrap_err();
        assert_amqp_error(&err, "406", "PRECONDITION_FAILED");
        assert!(format!("{err:?}").contains(what), "{what}: {err:?}");
    }

    let ch = conn.create_channel().await.unwrap();
    let durable = ExchangeDeclareOptions { durable: true, ..Default::default() };
    ch.exchange_declare(s("flags-x"), lapin::ExchangeKind::Direct, durable, FieldTable::default()).await.unwrap();
    ch.exchange_declare(s("flags-x"), lapin::ExchangeKind::Direct, durable, FieldTable::default())
        .await
        .expect("the same flags");
    for (what, opts) in [
        ("durable", ExchangeDeclareOptions::default()),
        ("internal", ExchangeDeclareOptions { durable: true, internal: true, ..Default::default() }),
        ("auto_delete", ExchangeDeclareOptions { durable: true, auto_delete: true, ..Default::default() }),
    ] {
        let ch = conn.create_channel().await.unwrap();
        let err = ch
            .exchange_declare(s("flags-x"), lapin::ExchangeKind::Direct, opts, FieldTable::default())
            .await
            .unwrap_err();
        assert_amqp_error(&err, "406", "PRECONDITION_FAILED");
        assert!(format!("{err:?}").contains(what), "{what}: {err:?}");
    }
    c.cluster.shutdown().await;
}

/// As RabbitMQ: `channel.close` in confirm mode is answered once every
/// publish before it is confirmed, and nothing follows `close-ok` on that
/// channel (amqplib takes a confirm on a closed channel for a connection
/// error). 1,000 publishes to a queue mirrored on three nodes, through a
/// node that does not master it, then the close in the same write.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_publish_is_confirmed_before_close_ok_and_nothing_follows_it() {
    use amq_protocol::frame::AMQPFrame;
    use amq_protocol::protocol::{basic, channel, confirm, AMQPClass};
    use raw::method;
    init_tracing();
    let c = AmqpCluster::start().await;
    c.cluster.node(1).set_policy(common::policy("^closing", r#"{"ha-mode":"all"}"#)).await.unwrap();
    c.cluster.node(1).declare_queue("closing", Vec::new()).await.unwrap();
    let via = if c.cluster.master_of("closing").await == 2 { 3 } else { 2 };
    let mut raw = raw::Raw::open(c.ports[via as usize - 1]).await;
    let mut frames = vec![
        method(1, AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {}))),
        method(1, AMQPClass::Confirm(confirm::AMQPMethod::Select(confirm::Select { nowait: false }))),
    ];
    const N: u64 = 1000;
    for i in 0..N {
        // Every tenth one routes nowhere: confirmed at once.
        let to = if i % 10 == 9 { "nowhere" } else { "closing" };
        frames.extend(raw::publish(1, to, format!("m{i}").as_bytes()));
    }
    let close = channel::Close { reply_code: 200, reply_text: "bye".into(), class_id: 0, method_id: 0 };
    frames.push(method(1, AMQPClass::Channel(channel::AMQPMethod::Close(close))));
    raw.send(&frames).await;
    let mut acked = vec![false; N as usize + 1];
    loop {
        match raw.next().await {
            AMQPFrame::Method(1, AMQPClass::Basic(basic::AMQPMethod::Ack(a))) => {
                let from = if a.multiple { 1 } else { a.delivery_tag };
                for t in from..=a.delivery_tag {
                    acked[t as usize] = true;
                }
            }
            AMQPFrame::Method(1, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))) => break,
            AMQPFrame::Method(1, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))
            | AMQPFrame::Method(1, AMQPClass::Confirm(confirm::AMQPMethod::SelectOk(_))) => {}
            AMQPFrame::Method(1, AMQPClass::Basic(basic::AMQPMethod::Nack(n))) => {
                panic!("publish {} nacked: not stored within the close's wait", n.delivery_tag)
            }
            other => panic!("unexpected frame {other:?}"),
        }
    }
    let missing: Vec<usize> = (1..=N as usize).filter(|t| !acked[*t]).collect();
    assert!(missing.is_empty(), "{} publishes unconfirmed at close-ok, first {:?}", missing.len(), missing.first());
    // The channel number is free again: the next frame on it answers the
    // new open, not a confirm of the old channel.
    raw.send(&[method(1, AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {})))]).await;
    let next = raw.next().await;
    assert!(matches!(next, AMQPFrame::Method(1, AMQPClass::Channel(channel::AMQPMethod::OpenOk(_)))), "{next:?}");
    assert_eq!(c.cluster.node(1).status("closing").await.unwrap().0, 900);
    c.cluster.shutdown().await;
}

/// As RabbitMQ: the unacked messages of a channel or a connection that
/// closes are back in their queue, in their places, before `close-ok`; a
/// consumer started right after gets them first and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unacked_messages_are_back_in_order_before_a_close_is_answered() {
    use amq_protocol::frame::AMQPFrame;
    use amq_protocol::protocol::{basic, channel, connection, AMQPClass};
    use raw::method;
    init_tracing();
    let c = AmqpCluster::start().await;
    c.cluster.node(1).set_policy(common::policy("^in-order", r#"{"ha-mode":"all"}"#)).await.unwrap();
    c.cluster.node(1).declare_queue("in-order", Vec::new()).await.unwrap();
    let via = if c.cluster.master_of("in-order").await == 2 { 3 } else { 2 };
    let port = c.ports[via as usize - 1];
    let conn = c.connect(via).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    for i in 0..5 {
        assert!(publish(&ch, "in-order", format!("m{i}").as_bytes()).await);
    }
    let consume = |tag: &str| basic::Consume {
        queue: "in-order".into(),
        consumer_tag: tag.into(),
        no_local: false,
        no_ack: false,
        exclusive: false,
        nowait: false,
        arguments: Default::default(),
    };
    // The next `n` deliveries on channel `id`: (body, redelivered, tag).
    async fn deliveries(raw: &mut raw::Raw, id: u16, n: usize) -> Vec<(String, bool, u64)> {
        let mut out = Vec::new();
        while out.len() < n {
            match raw.next().await {
                AMQPFrame::Method(c, AMQPClass::Basic(basic::AMQPMethod::Deliver(d))) if c == id => {
                    assert!(matches!(raw.next().await, AMQPFrame::Header(..)));
                    let AMQPFrame::Body(_, b) = raw.next().await else { panic!("expected a body") };
                    out.push((String::from_utf8(b).unwrap(), d.redelivered, d.delivery_tag));
                }
                AMQPFrame::Method(c, _) if c == id => {}
                other => panic!("unexpected frame {other:?}"),
            }
        }
        out
    }
    let qos = basic::Qos { prefetch_count: 2, global: false };
    let close = channel::Close { reply_code: 200, reply_text: "bye".into(), class_id: 0, method_id: 0 };
    for round in ["channel", "connection"] {
        let mut raw = raw::Raw::open(port).await;
        raw.send(&[
            method(1, AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {}))),
            method(1, AMQPClass::Basic(basic::AMQPMethod::Qos(qos.clone()))),
            method(1, AMQPClass::Basic(basic::AMQPMethod::Consume(consume("first")))),
        ])
        .await;
        let got: Vec<String> = deliveries(&mut raw, 1, 2).await.into_iter().map(|d| d.0).collect();
        assert_eq!(got, ["m0", "m1"], "{round}");
        if round == "channel" {
            raw.send(&[method(1, AMQPClass::Channel(channel::AMQPMethod::Close(close.clone())))]).await;
            loop {
                if let AMQPFrame::Method(1, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))) = raw.next().await {
                    break;
                }
            }
        } else {
            let bye = connection::Close { reply_code: 200, reply_text: "bye".into(), class_id: 0, method_id: 0 };
            raw.send(&[method(0, AMQPClass::Connection(connection::AMQPMethod::Close(bye)))]).await;
            loop {
                if let AMQPFrame::Method(0, AMQPClass::Connection(connection::AMQPMethod::CloseOk(_))) =
                    raw.next().await
                {
                    break;
                }
            }
            raw = raw::Raw::open(port).await;
        }
        // Back at the master already, not on their way: its counts as
        // applied, read without an entry in its log.
        let at_master = c.cluster.node(1).view_at_master("in-order", false).await.unwrap();
        assert_eq!((at_master.ready, at_master.unacked), (5, 0), "after the {round}'s close-ok");
        // A consumer started right after the close-ok.
        raw.send(&[
            method(2, AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {}))),
            method(2, AMQPClass::Basic(basic::AMQPMethod::Consume(consume("second")))),
        ])
        .await;
        let got = deliveries(&mut raw, 2, 5).await;
        let order: Vec<(&str, bool)> = got.iter().map(|(b, r, _)| (b.as_str(), *r)).collect();
        // The second round's first three were all delivered once before.
        let again = round == "connection";
        let want = [("m0", true), ("m1", true), ("m2", again), ("m3", again), ("m4", again)];
        assert_eq!(order, want, "after the {round} closed: the two it held first, in their places");
        if round == "channel" {
            // Back where they were for the next round: closed unacked.
            raw.send(&[method(2, AMQPClass::Channel(channel::AMQPMethod::Close(close.clone())))]).await;
            loop {
                if let AMQPFrame::Method(2, AMQPClass::Channel(channel::AMQPMethod::CloseOk(_))) = raw.next().await {
                    break;
                }
            }
        }
    }
    c.cluster.shutdown().await;
}

/// As RabbitMQ: an exclusive queue lives on its connection's node and is
/// never mirrored, even where a policy mirrors its name. `x-queue-type:
/// quorum` asks for replicas, three unless `x-quorum-initial-group-size`
/// says otherwise, whatever `ha-` policy matches; a quorum queue cannot be
/// transient, exclusive or auto-delete (406); a queue type mirrorq does not
/// have is refused (406), as is a re-declare that names another type.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exclusive_queues_stay_on_their_node_and_quorum_queues_are_replicated() {
    init_tracing();
    let mut c = AmqpCluster::start().await;
    c.cluster.node(1).set_policy(common::policy("^", r#"{"ha-mode":"all"}"#)).await.unwrap();
    // Read where the declares went: the declaring node has applied them.
    fn placed(c: &AmqpCluster, name: &str) -> (Vec<u64>, &'static str) {
        let meta = c.cluster.node(2).metadata();
        let q = meta.queues.get(name).unwrap_or_else(|| panic!("{name} declared"));
        (q.replicas.clone(), q.args.queue_type())
    }
    let replicas = |name: &str| placed(&c, name);
    let conn = c.connect(2).await;
    let ch = conn.create_channel().await.unwrap();
    let exclusive = QueueDeclareOptions { exclusive: true, ..Default::default() };
    for name in ["excl-a", "excl-b", "excl-c"] {
        ch.queue_declare(s(name), exclusive, FieldTable::default()).await.unwrap();
        assert_eq!(replicas(name), (vec![2], "classic"), "{name}: here, alone");
    }
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    assert!(publish(&ch, "excl-a", b"x").await);

    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    ch.queue_declare(s("plain"), durable, FieldTable::default()).await.unwrap();
    assert_eq!(replicas("plain").0.len(), 3, "mirrored by the policy");
    let quorum = |size: Option<i32>| {
        let mut t = FieldTable::default();
        t.insert(s("x-queue-type"), AMQPValue::LongString("quorum".into()));
        if let Some(n) = size {
            t.insert(s("x-quorum-initial-group-size"), AMQPValue::LongInt(n));
        }
        t
    };
    ch.queue_declare(s("qq-3"), durable, quorum(None)).await.unwrap();
    assert_eq!(replicas("qq-3").0.len(), 3);
    assert_eq!(replicas("qq-3").1, "quorum");
    ch.queue_declare(s("qq-2"), durable, quorum(Some(2))).await.unwrap();
    assert_eq!(replicas("qq-2").0.len(), 2, "the argument, not the ha-mode all policy");
    assert!(publish(&ch, "qq-2", b"y").await);
    // Re-declared without a type: the same queue; with another: refused.
    ch.queue_declare(s("qq-2"), durable, FieldTable::default()).await.expect("no type named");
    let mut classic = FieldTable::default();
    classic.insert(s("x-queue-type"), AMQPValue::LongString("classic".into()));
    let err = conn.create_channel().await.unwrap().queue_declare(s("qq-2"), durable, classic).await.unwrap_err();
    assert_amqp_error(&err, "406", "PRECONDITION_FAILED");
    assert!(format!("{err:?}").contains("x-queue-type"), "{err:?}");

    let mut stream = FieldTable::default();
    stream.insert(s("x-queue-type"), AMQPValue::LongString("stream".into()));
    for (name, opts, args, why) in [
        ("qq-transient", QueueDeclareOptions::default(), quorum(None), "non-durable"),
        (
            "qq-exclusive",
            QueueDeclareOptions { durable: true, exclusive: true, ..Default::default() },
            quorum(None),
            "exclusive-owner",
        ),
        (
            "qq-auto",
            QueueDeclareOptions { durable: true, auto_delete: true, ..Default::default() },
            quorum(None),
            "auto-delete",
        ),
        ("a-stream", durable, stream, "x-queue-type"),
    ] {
        let err = conn.create_channel().await.unwrap().queue_declare(s(name), opts, args).await.unwrap_err();
        assert_amqp_error(&err, "406", "PRECONDITION_FAILED");
        assert!(format!("{err:?}").contains(why), "{name}: {err:?}");
        assert!(c.cluster.node(2).metadata().queues.get(name).is_none(), "{name} was not made");
    }
    // A fourth node: a classic queue mirrored by policy grows onto it,
    // the quorum queues keep their size, the exclusive ones stay alone.
    let four = c.cluster.add_node(1).await;
    common::wait_until(Duration::from_secs(20), "the fourth node is a member, seen by node 2", || {
        c.cluster.node(2).metadata().nodes.contains_key(&four)
    })
    .await;
    assert_eq!(placed(&c, "plain").0.len(), 4);
    assert_eq!(placed(&c, "qq-3").0.len(), 3);
    assert_eq!(placed(&c, "qq-2").0.len(), 2);
    assert_eq!(placed(&c, "excl-a").0, vec![2], "its connection is still open");
    // Gone by its connection's close-ok: a client on another node declares
    // it again at once (py-amqp's tests do).
    conn.close(200, s("bye")).await.unwrap();
    let again = c.connect(3).await.create_channel().await.unwrap();
    again.queue_declare(s("excl-a"), exclusive, FieldTable::default()).await.expect("free again");
    c.cluster.shutdown().await;
}

/// RabbitMQ's consumer timeout: a delivery left unacked longer than its
/// queue's `x-consumer-timeout` (or its policy's `consumer-timeout`)
/// closes the channel with 406 PRECONDITION_FAILED, and the message is back
/// in the queue, redelivered; a channel whose deliveries come from a queue
/// with no such limit keeps them (the node's default is 30 minutes).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delivery_unacked_past_its_queues_consumer_timeout_closes_the_channel_and_comes_back() {
    use amq_protocol::frame::AMQPFrame;
    use amq_protocol::protocol::{basic, channel, AMQPClass};
    use raw::method;
    init_tracing();
    let c = AmqpCluster::start().await;
    let mut policy = common::policy("^slow-by-policy$", r#"{"consumer-timeout":1000,"ha-mode":"all"}"#);
    policy.name = "timeouts".into();
    c.cluster.node(1).set_policy(policy).await.unwrap();
    c.cluster.node(1).set_policy(common::policy("^(slow|patient)$", r#"{"ha-mode":"all"}"#)).await.unwrap();
    let conn = c.connect(2).await;
    let ch = conn.create_channel().await.unwrap();
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    let mut by_arg = FieldTable::default();
    by_arg.insert(s("x-consumer-timeout"), AMQPValue::LongInt(1000));
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    ch.queue_declare(s("slow"), durable, by_arg).await.unwrap();
    for q in ["slow-by-policy", "patient"] {
        ch.queue_declare(s(q), durable, FieldTable::default()).await.unwrap();
    }
    for q in ["slow", "slow-by-policy", "patient"] {
        assert!(publish(&ch, q, q.as_bytes()).await);
    }
    let consume = |queue: &str| basic::Consume {
        queue: queue.into(),
        consumer_tag: "".into(),
        no_local: false,
        no_ack: false,
        exclusive: false,
        nowait: false,
        arguments: Default::default(),
    };
    let mut raw = raw::Raw::open(c.ports[1]).await;
    // Before any delivery: no close may come within the timeout of it.
    let started = std::time::Instant::now();
    raw.send(&[
        method(1, AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {}))),
        method(1, AMQPClass::Basic(basic::AMQPMethod::Consume(consume("patient")))),
    ])
    .await;
    for (id, q) in [(2u16, "slow"), (3, "slow-by-policy")] {
        raw.send(&[
            method(id, AMQPClass::Channel(channel::AMQPMethod::Open(channel::Open {}))),
            method(id, AMQPClass::Basic(basic::AMQPMethod::Consume(consume(q)))),
        ])
        .await;
    }
    // Each timed-out channel closes once, with RabbitMQ's code and text;
    // the patient one stays open meanwhile.
    let mut delivered = std::collections::BTreeSet::new();
    let mut closed = std::collections::BTreeSet::new();
    while closed.len() < 2 {
        assert!(started.elapsed() < Duration::from_secs(30), "not closed: delivered {delivered:?}, closed {closed:?}");
        match raw.next().await {
            AMQPFrame::Method(id, AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                assert_eq!(close.reply_code, 406, "{close:?}");
                let text = close.reply_text.as_str();
                assert!(text.contains(&format!("delivery acknowledgement on channel {id} timed out")), "{text}");
                assert!(text.contains("Timeout value used: 1000 ms"), "{text}");
                assert!(delivered.contains(&id), "channel {id} closed before it got its delivery");
                assert!(closed.insert(id), "channel {id} closed twice");
                raw.send(&[method(id, AMQPClass::Channel(channel::AMQPMethod::CloseOk(channel::CloseOk {})))]).await;
            }
            AMQPFrame::Method(id, AMQPClass::Basic(basic::AMQPMethod::Deliver(_))) => {
                delivered.insert(id);
            }
            _ => {}
        }
    }
    assert_eq!(closed, [2, 3].into());
    assert!(started.elapsed() >= Duration::from_millis(1000), "closed before the timeout: {:?}", started.elapsed());
    // Back in their queues, redelivered; the patient one still held.
    for q in ["slow", "slow-by-policy"] {
        let got = ch.basic_get(s(q), BasicGetOptions::default()).await.unwrap().expect("back in the queue");
        assert!(got.delivery.redelivered, "{q}");
        assert_eq!(got.delivery.data, q.as_bytes());
    }
    assert!(ch.basic_get(s("patient"), BasicGetOptions::default()).await.unwrap().is_none(), "still held");
    raw.send(&[method(1, AMQPClass::Basic(basic::AMQPMethod::Qos(basic::Qos { prefetch_count: 1, global: false })))])
        .await;
    loop {
        match raw.next().await {
            AMQPFrame::Method(1, AMQPClass::Basic(basic::AMQPMethod::QosOk(_))) => break,
            AMQPFrame::Method(1, AMQPClass::Channel(channel::AMQPMethod::Close(close))) => {
                panic!("the patient channel was closed: {close:?}")
            }
            _ => {}
        }
    }
    c.cluster.shutdown().await;
}

/// RabbitMQ's direct reply-to, the RPC pattern of many client frameworks:
/// a client on node 2 consumes from `amq.rabbitmq.reply-to` and sends a
/// request naming it in `reply_to`; a server on node 3 gets the request
/// with the consumer's own name there and publishes its reply to the
/// default exchange under that name; the reply reaches the client through
/// no queue. A consumer that would ack, or a request naming the
/// pseudo-queue without a reply consumer, is refused (406); once the
/// consumer is cancelled a mandatory reply comes back as returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn direct_reply_to_answers_a_request_across_nodes() {
    use lapin::message::BasicReturnMessage;
    use lapin::options::BasicCancelOptions;
    init_tracing();
    let c = AmqpCluster::start().await;
    let client = c.connect(2).await;
    let server = c.connect(3).await;
    let sch = server.create_channel().await.unwrap();
    sch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    sch.queue_declare(s("rpc"), QueueDeclareOptions::default(), FieldTable::default()).await.unwrap();
    let pseudo = "amq.rabbitmq.reply-to";
    let props = || BasicProperties::default().with_reply_to(s(pseudo));

    let ch = client.create_channel().await.unwrap();
    let err =
        ch.basic_consume(s(pseudo), s(""), BasicConsumeOptions::default(), FieldTable::default()).await.unwrap_err();
    assert_amqp_error(&err, "406", "PRECONDITION_FAILED");
    let ch = client.create_channel().await.unwrap();
    // In confirm mode the publish's confirm carries the channel's close,
    // whenever it arrives (a later call could find the channel already
    // closing and say only that).
    ch.confirm_select(ConfirmSelectOptions::default()).await.unwrap();
    match ch.basic_publish(s(""), s("rpc"), BasicPublishOptions::default(), b"early", props()).await {
        Ok(confirm) => assert_amqp_error(&confirm.await.unwrap_err(), "406", "PRECONDITION_FAILED"),
        Err(err) => assert_amqp_error(&err, "406", "PRECONDITION_FAILED"),
    }

    let ch = client.create_channel().await.unwrap();
    ch.queue_declare(s(pseudo), QueueDeclareOptions { passive: true, ..Default::default() }, FieldTable::default())
        .await
        .expect("the pseudo-queue answers a passive declare");
    let no_ack = BasicConsumeOptions { no_ack: true, ..Default::default() };
    let mut replies = ch.basic_consume(s(pseudo), s("rpc-client"), no_ack, FieldTable::default()).await.unwrap();
    for i in 0..3 {
        let body = format!("request {i}");
        ch.basic_publish(s(""), s("rpc"), BasicPublishOptions::default(), body.as_bytes(), props()).await.unwrap();
        let request = loop {
            if let Some(m) = sch.basic_get(s("rpc"), BasicGetOptions { no_ack: true }).await.unwrap() {
                break m;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let to = request.properties.reply_to().clone().expect("a reply_to").to_string();
        assert!(to.starts_with("amq.rabbitmq.reply-to.2."), "named after the consumer's node: {to}");
        let answer = format!("answer {i}");
        let confirm = sch
            .basic_publish(s(""), s(&to), BasicPublishOptions::default(), answer.as_bytes(), BasicProperties::default())
            .await
            .unwrap();
        assert!(confirm.await.unwrap().is_ack());
        let reply =
            tokio::time::timeout(Duration::from_secs(10), replies.next()).await.expect("a reply").unwrap().unwrap();
        assert_eq!(reply.data, answer.as_bytes());
        assert_eq!(reply.routing_key.as_str(), to);
        assert_eq!(
            c.cluster.node(1).metadata().queues.keys().filter(|q| q.starts_with("amq.")).count(),
            0,
            "no queue was made for it"
        );
        if i == 2 {
            ch.basic_cancel(s("rpc-client"), BasicCancelOptions::default()).await.unwrap();
            let mandatory = BasicPublishOptions { mandatory: true, ..Default::default() };
            let confirm =
                sch.basic_publish(s(""), s(&to), mandatory, b"late", BasicProperties::default()).await.unwrap();
            let returned: Option<BasicReturnMessage> = confirm.await.unwrap().take_message();
            assert_eq!(returned.map(|m| m.delivery.data), Some(b"late".to_vec()), "returned: its consumer is gone");
        }
    }
    // The reply consumer's tag is taken on its channel, as any consumer's.
    let other = c.connect(2).await;
    let och = other.create_channel().await.unwrap();
    let no_ack = BasicConsumeOptions { no_ack: true, ..Default::default() };
    let _reply = och.basic_consume(s(pseudo), s("taken"), no_ack, FieldTable::default()).await.unwrap();
    let err = och
        .basic_consume(s("rpc"), s("taken"), BasicConsumeOptions::default(), FieldTable::default())
        .await
        .unwrap_err();
    assert_amqp_error(&err, "530", "NOT_ALLOWED");
    c.cluster.shutdown().await;
}

/// RabbitMQ's poison-message handling on a mirrored queue, used through a
/// node that is not its master, across a failover: every return (a nack
/// with requeue, a channel closed with the message unacked) counts, the
/// count is replicated (the master that takes over after a crash knows
/// it), the next delivery carries it in `x-delivery-count`, and a message
/// returned more than `x-delivery-limit` times goes to the dead-letter
/// exchange with reason `delivery_limit`. A quorum queue has RabbitMQ 4's
/// limit of 20 without asking, and drops the message past it.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_returned_past_its_delivery_limit_is_dead_lettered() {
    init_tracing();
    let mut c = AmqpCluster::start().await;
    c.cluster.node(1).set_policy(common::policy("^poison", r#"{"ha-mode":"all"}"#)).await.unwrap();
    let conn1 = c.connect(1).await;
    let ch1 = conn1.create_channel().await.unwrap();
    let durable = QueueDeclareOptions { durable: true, ..Default::default() };
    ch1.queue_declare(s("poison.dead"), durable, FieldTable::default()).await.unwrap();
    let mut args = FieldTable::default();
    args.insert(s("x-delivery-limit"), AMQPValue::LongInt(2));
    args.insert(s("x-dead-letter-exchange"), AMQPValue::LongString("".into()));
    args.insert(s("x-dead-letter-routing-key"), AMQPValue::LongString("poison.dead".into()));
    // Declared through node 2, which masters it; the client is on node 3.
    let conn2 = c.connect(2).await;
    conn2.create_channel().await.unwrap().queue_declare(s("poison.q"), durable, args).await.unwrap();
    assert_eq!(c.cluster.master_of("poison.q").await, 2);
    let conn = c.connect(3).await;
    let ch = conn.create_channel().await.unwrap();
    ch.basic_publish(s(""), s("poison.q"), BasicPublishOptions::default(), b"bad", BasicProperties::default())
        .await
        .unwrap();
    let count = |d: &lapin::message::Delivery| {
        d.properties.headers().as_ref().and_then(|h| h.inner().get("x-delivery-count").cloned())
    };
    let get = |ch: lapin::Channel| async move {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(m) = ch.basic_get(s("poison.q"), BasicGetOptions { no_ack: false }).await.unwrap() {
                return m.delivery;
            }
            assert!(std::time::Instant::now() < deadline, "the message never came back");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    let first = get(ch.clone()).await;
    assert_eq!(count(&first), None, "never returned yet");
    ch.basic_nack(first.delivery_tag, BasicNackOptions { requeue: true, ..Default::default() }).await.unwrap();
    let second = get(ch.clone()).await;
    assert!(second.redelivered);
    assert_eq!(count(&second), Some(AMQPValue::LongLongInt(1)));
    // The master crashes; node 1 or 3 takes over, knowing the count.
    drop(conn2);
    c.cluster.crash(2).await;
    // A channel that closes with it unacked returns it too.
    let holder = conn.create_channel().await.unwrap();
    ch.basic_nack(second.delivery_tag, BasicNackOptions { requeue: true, ..Default::default() }).await.unwrap();
    let third = get(holder.clone()).await;
    assert_eq!(count(&third), Some(AMQPValue::LongLongInt(2)));
    holder.close(200, "bye".into()).await.unwrap();
    wait_ready(&c, "poison.dead", 1).await;
    wait_ready(&c, "poison.q", 0).await;
    let dead = ch.basic_get(s("poison.dead"), BasicGetOptions { no_ack: true }).await.unwrap().expect("dead letter");
    assert_eq!(dead.delivery.data, b"bad");
    let d = x_death(&dead.delivery.properties);
    assert_eq!(text(&d[0], "reason"), "delivery_limit");
    assert_eq!(text(&d[0], "queue"), "poison.q");

    // A quorum queue: 20 returns, then the message is dropped (no
    // dead-letter exchange).
    let mut qargs = FieldTable::default();
    qargs.insert(s("x-queue-type"), AMQPValue::LongString("quorum".into()));
    ch1.queue_declare(s("poison.quorum"), durable, qargs).await.unwrap();
    ch.basic_publish(s(""), s("poison.quorum"), BasicPublishOptions::default(), b"q", BasicProperties::default())
        .await
        .unwrap();
    let mut last = None;
    for round in 0..=20 {
        let m = loop {
            if let Some(m) = ch.basic_get(s("poison.quorum"), BasicGetOptions { no_ack: false }).await.unwrap() {
                break m.delivery;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        let expected = (round > 0).then_some(AMQPValue::LongLongInt(round));
        assert_eq!(count(&m), expected, "delivery {round}");
        last = count(&m);
        ch.basic_nack(m.delivery_tag, BasicNackOptions { requeue: true, ..Default::default() }).await.unwrap();
    }
    assert_eq!(last, Some(AMQPValue::LongLongInt(20)));
    wait_ready(&c, "poison.quorum", 0).await;
    c.cluster.shutdown().await;
}
