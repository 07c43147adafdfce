//! The management HTTP API on a three-node cluster, asked on every node:
//! policies, queues with their mirrors, publish and get, and bad input
//! answered with 4xx JSON.

mod common;

use std::time::Duration;

use common::{fast_timing, init_tracing, wait_until, Cluster};
use serde_json::{json, Value};

struct Api {
    cluster: Cluster,
    ports: Vec<u16>,
}

impl Api {
    async fn start() -> Self {
        let cluster = Cluster::start(3, fast_timing(Duration::from_secs(3))).await;
        let ports = cluster.serve_http().await;
        Self { cluster, ports }
    }

    /// (status, JSON body or Null)
    async fn call(&self, node: u64, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
        self.call_as(node, method, path, body, Some(("guest", "guest"))).await
    }

    async fn call_as(
        &self,
        node: u64,
        method: &str,
        path: &str,
        body: Option<&str>,
        user: Option<(&str, &str)>,
    ) -> (u16, Value) {
        let url = format!("http://127.0.0.1:{}{}", self.ports[(node - 1) as usize], path);
        let (method, body) = (method.to_string(), body.map(str::to_string));
        let auth = user.map(|(u, p)| {
            use base64::Engine;
            format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("{u}:{p}")))
        });
        tokio::task::spawn_blocking(move || {
            let mut req = ureq::request(&method, &url).timeout(Duration::from_secs(30));
            if let Some(a) = auth {
                req = req.set("Authorization", &a);
            }
            let res = match body {
                Some(b) => req.set("Content-Type", "application/json").send_string(&b),
                None => req.call(),
            };
            let resp = match res {
                Ok(r) => r,
                Err(ureq::Error::Status(_, r)) => r,
                Err(e) => panic!("http transport error: {e}"),
            };
            let status = resp.status();
            let text = resp.into_string().unwrap_or_default();
            (status, serde_json::from_str(&text).unwrap_or(Value::Null))
        })
        .await
        .unwrap()
    }
}

fn assert_error(resp: &(u16, Value), status: u16, reason_has: &str) {
    assert_eq!(resp.0, status, "{resp:?}");
    assert!(resp.1["error"].is_string(), "no error field: {resp:?}");
    let reason = resp.1["reason"].as_str().unwrap_or("");
    assert!(reason.contains(reason_has), "reason {reason:?} lacks {reason_has:?}");
}

/// Policy CRUD with validation, and auth refusals.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn policies_crud_and_bad_input() {
    init_tracing();
    let api = Api::start().await;
    let body = r#"{"pattern":"^ha","definition":{"ha-mode":"all","ha-sync-mode":"automatic"},"priority":1,"apply-to":"queues"}"#;
    assert_eq!(api.call(1, "PUT", "/api/policies/%2F/ha-all", Some(body)).await.0, 201);
    assert_eq!(api.call(2, "PUT", "/api/policies/%2F/ha-all", Some(body)).await.0, 204, "update");
    let (s, p) = api.call(3, "GET", "/api/policies/%2F/ha-all", None).await;
    assert_eq!(s, 200);
    assert_eq!(p["pattern"], "^ha");
    assert_eq!(p["apply-to"], "queues");
    assert_eq!(p["priority"], 1);
    assert_eq!(p["definition"], json!({"ha-mode":"all","ha-sync-mode":"automatic"}));
    let (_, list) = api.call(2, "GET", "/api/policies", None).await;
    assert_eq!(list.as_array().unwrap().len(), 1);

    assert_error(
        &api.call(1, "PUT", "/api/policies/%2F/bad", Some(r#"{"pattern":"(","definition":{"ha-mode":"all"}}"#)).await,
        400,
        "regex",
    );
    assert_error(
        &api.call(
            1,
            "PUT",
            "/api/policies/%2F/bad",
            Some(r#"{"pattern":"x","definition":{"ha-mode":"exactly","ha-params":"2"}}"#),
        )
        .await,
        400,
        "ha-params",
    );
    assert_error(
        &api.call(1, "PUT", "/api/policies/%2F/bad", Some(r#"{"pattern":"x","definition":{"ha-mode":"some"}}"#)).await,
        400,
        "ha-mode",
    );
    assert_error(
        &api.call(
            1,
            "PUT",
            "/api/policies/%2F/bad",
            Some(r#"{"pattern":"x","definition":{"ha-mode":"all"},"priority":"high"}"#),
        )
        .await,
        400,
        "priority",
    );
    assert_error(
        &api.call(1, "PUT", "/api/policies/%2F/bad", Some(r#"{"pattern":"x","definition":"#)).await,
        400,
        "JSON",
    );
    assert_error(
        &api.call(1, "PUT", "/api/policies/%2F/bad", Some(r#"{"definition":{"ha-mode":"all"}}"#)).await,
        400,
        "pattern",
    );
    assert_error(&api.call(1, "PUT", "/api/policies/other-vhost/bad", Some(body)).await, 404, "Not Found");
    assert_eq!(api.call(1, "GET", "/api/policies/%2F/bad", None).await.0, 404, "nothing invalid stored");

    assert_eq!(api.call(1, "DELETE", "/api/policies/%2F/ha-all", None).await.0, 204);
    assert_error(&api.call(1, "DELETE", "/api/policies/%2F/ha-all", None).await, 404, "");
    assert_error(&api.call_as(1, "GET", "/api/overview", None, None).await, 401, "Login failed");
    assert_error(&api.call_as(1, "GET", "/api/overview", None, Some(("guest", "nope"))).await, 401, "Login failed");
    assert_error(&api.call(1, "GET", "/api/nonsense", None).await, 404, "");
    api.cluster.shutdown().await;
}

/// A queue under `ha-mode: all` is mirrored on three nodes as every node
/// reports it; a message published over HTTP is confirmed and read back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn mirrored_queue_publish_and_get() {
    init_tracing();
    let api = Api::start().await;
    let pol = r#"{"pattern":"^ha","definition":{"ha-mode":"all","ha-sync-mode":"automatic"}}"#;
    assert_eq!(api.call(1, "PUT", "/api/policies/%2F/ha", Some(pol)).await.0, 201);
    assert_eq!(api.call(1, "PUT", "/api/queues/%2F/ha-queue-demo", Some(r#"{"durable":true}"#)).await.0, 201);
    assert_eq!(api.call(2, "PUT", "/api/queues/%2F/ha-queue-demo", Some(r#"{"durable":true}"#)).await.0, 204);

    let mut q = Value::Null;
    for _ in 0..100 {
        q = api.call(3, "GET", "/api/queues/%2F/ha-queue-demo", None).await.1;
        if q["synchronised_slave_nodes"].as_array().is_some_and(|a| a.len() == 2) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(q["name"], "ha-queue-demo");
    assert_eq!(q["vhost"], "/");
    assert_eq!(q["durable"], true);
    assert_eq!(q["policy"], "ha");
    assert_eq!(q["effective_policy_definition"]["ha-mode"], "all");
    assert_eq!(q["state"], "running");
    assert!(q["node"].as_str().unwrap().starts_with("mirrorq@"));
    assert_eq!(q["slave_nodes"].as_array().unwrap().len(), 2, "{q}");
    assert_eq!(q["synchronised_slave_nodes"].as_array().unwrap().len(), 2, "{q}");
    assert_eq!(q["sync_progress"], json!([]), "nobody is catching up: {q}");
    let (s, r) = api.call(2, "POST", "/api/rebalance/queues", Some("{}")).await;
    assert_eq!(s, 200, "{r}");
    assert!(r["moves"].as_array().unwrap().iter().all(|m| m["error"].is_null()), "{r}");
    assert_error(&api.call(1, "DELETE", "/api/nodes/mirrorq@9", None).await, 404, "");
    assert_error(&api.call(1, "DELETE", "/api/nodes/mirrorq@1", None).await, 400, "itself");
    assert_error(&api.call(1, "DELETE", "/api/nodes/mirrorq@2", None).await, 400, "running");

    let actions = "/api/queues/%2F/ha-queue-demo/actions";
    assert_eq!(api.call(2, "POST", actions, Some(r#"{"action":"sync"}"#)).await.0, 204);
    assert_eq!(api.call(3, "POST", actions, Some(r#"{"action":"cancel_sync"}"#)).await.0, 204);
    assert_error(&api.call(1, "POST", actions, Some(r#"{"action":"resync"}"#)).await, 400, "unknown action");
    assert_error(&api.call(1, "POST", actions, Some(r#"{}"#)).await, 400, "action missing");
    assert_error(&api.call(1, "POST", actions, Some("nope")).await, 400, "");
    assert_error(&api.call(1, "POST", "/api/queues/%2F/no-such/actions", Some(r#"{"action":"sync"}"#)).await, 404, "");

    let msg = r#"{"properties":{"delivery_mode":2,"headers":{"k":"v"}},"routing_key":"ha-queue-demo","payload":"hello","payload_encoding":"string"}"#;
    let (s, r) = api.call(2, "POST", "/api/exchanges/%2F/amq.default/publish", Some(msg)).await;
    assert_eq!((s, r), (200, json!({"routed": true})));
    let nowhere = r#"{"properties":{},"routing_key":"nobody","payload":"x","payload_encoding":"string"}"#;
    assert_eq!(
        api.call(2, "POST", "/api/exchanges/%2F/amq.default/publish", Some(nowhere)).await.1,
        json!({"routed": false})
    );

    let (_, overview) = api.call(1, "GET", "/api/overview", None).await;
    assert_eq!(overview["queue_totals"]["messages"], 1);
    assert_eq!(overview["object_totals"]["queues"], 1);

    let peek = r#"{"count":5,"ackmode":"ack_requeue_true","encoding":"auto"}"#;
    let (s, got) = api.call(3, "POST", "/api/queues/%2F/ha-queue-demo/get", Some(peek)).await;
    assert_eq!(s, 200);
    assert_eq!(got[0]["payload"], "hello");
    assert_eq!(got[0]["payload_encoding"], "string");
    assert_eq!(got[0]["redelivered"], false);
    assert_eq!(got[0]["routing_key"], "ha-queue-demo");
    assert_eq!(got[0]["properties"]["delivery_mode"], 2);
    assert_eq!(got[0]["properties"]["headers"], json!({"k":"v"}));
    let take = r#"{"count":5,"ackmode":"ack_requeue_false","encoding":"base64"}"#;
    let (_, got) = api.call(1, "POST", "/api/queues/%2F/ha-queue-demo/get", Some(take)).await;
    assert_eq!(got[0]["payload"], "aGVsbG8=");
    assert_eq!(got[0]["redelivered"], true, "it was requeued by the peek");
    let (_, got) = api.call(1, "POST", "/api/queues/%2F/ha-queue-demo/get", Some(take)).await;
    assert_eq!(got, json!([]));

    assert_error(
        &api.call(1, "POST", "/api/queues/%2F/ha-queue-demo/get", Some(r#"{"count":1,"ackmode":"peek"}"#)).await,
        400,
        "ackmode",
    );
    assert_error(
        &api.call(1, "POST", "/api/queues/%2F/ha-queue-demo/get", Some(r#"{"count":0,"ackmode":"ack_requeue_false"}"#))
            .await,
        400,
        "count",
    );
    assert_error(&api.call(1, "POST", "/api/queues/%2F/nope/get", Some(take)).await, 404, "");
    assert_error(&api.call(1, "PUT", "/api/queues/%2F/q2", Some(r#"{"durable":"yes"}"#)).await, 400, "durable");
    assert_error(&api.call(1, "POST", "/api/exchanges/%2F/missing/publish", Some(msg)).await, 404, "");
    assert_error(
        &api.call(1, "POST", "/api/exchanges/%2F/amq.default/publish", Some(r#"{"routing_key":1}"#)).await,
        400,
        "routing_key",
    );

    let (_, nodes) = api.call(1, "GET", "/api/nodes", None).await;
    assert_eq!(nodes.as_array().unwrap().len(), 3);
    assert!(nodes.as_array().unwrap().iter().all(|n| n["running"] == true));
    assert_eq!(api.call(2, "DELETE", "/api/queues/%2F/ha-queue-demo", None).await.0, 204);
    let n1 = api.cluster.node(1).clone();
    wait_until(Duration::from_secs(10), "queue gone everywhere", || n1.metadata().queues.is_empty()).await;
    api.cluster.shutdown().await;
}

/// A RabbitMQ-style definitions export imports (policy, exchange, queue,
/// binding) and exports back; a bad file is refused whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn definitions_import_and_export() {
    init_tracing();
    let api = Api::start().await;
    let defs = r#"{
      "rabbit_version": "3.10.8",
      "users": [{"name":"guest","password_hash":"AQEBAWK/5XLINlvKIAESraUpJ372LTuU7m+heqz7q+c666UW","hashing_algorithm":"rabbit_password_hashing_sha256","tags":"administrator"},
                {"name":"carol","password_hash":"CQgHBpdMuZXyG/avuvpvKFRTydvBrCJsDFtbvgMLddasqgCe","hashing_algorithm":"rabbit_password_hashing_sha256","tags":"management"}],
      "vhosts": [{"name":"/"}, {"name":"shop","metadata":{"description":"the shop"}}],
      "permissions": [{"user":"guest","vhost":"/","configure":".*","write":".*","read":".*"},
                      {"user":"carol","vhost":"shop","configure":".*","write":".*","read":".*"}],
      "policies": [{"vhost":"/","name":"ha-all","pattern":"^ha\\.","apply-to":"queues","definition":{"ha-mode":"all"},"priority":0}],
      "queues": [{"name":"ha.orders","vhost":"/","durable":true,"auto_delete":false,"arguments":{}},
                 {"name":"ha.orders","vhost":"shop","durable":true,"auto_delete":false,"arguments":{}}],
      "exchanges": [{"name":"orders","vhost":"/","type":"topic","durable":true,"auto_delete":false,"internal":false,"arguments":{}},
                    {"name":"amq.direct","vhost":"/","type":"direct","durable":true,"auto_delete":false,"internal":false,"arguments":{}}],
      "bindings": [{"source":"orders","vhost":"/","destination":"ha.orders","destination_type":"queue","routing_key":"order.#","arguments":{}}]
    }"#;
    assert_eq!(api.call(1, "POST", "/api/definitions", Some(defs)).await.0, 204);
    let (_, q) = api.call(2, "GET", "/api/queues/%2F/ha.orders", None).await;
    assert_eq!(q["policy"], "ha-all");
    assert_eq!(q["slave_nodes"].as_array().unwrap().len(), 2, "{q}");
    let msg = r#"{"properties":{},"routing_key":"order.new","payload":"o1","payload_encoding":"string"}"#;
    assert_eq!(api.call(3, "POST", "/api/exchanges/%2F/orders/publish", Some(msg)).await.1, json!({"routed": true}));
    let (s, out) = api.call(3, "GET", "/api/definitions", None).await;
    assert_eq!(s, 200);
    assert_eq!(out["policies"][0]["name"], "ha-all");
    assert_eq!(out["queues"][0]["name"], "ha.orders");
    assert_eq!(out["exchanges"][0]["name"], "orders");
    assert_eq!(out["bindings"][0]["routing_key"], "order.#");
    assert_eq!(out["vhosts"][0]["name"], "/");
    assert_eq!(out["vhosts"][1]["metadata"]["description"], "the shop");
    assert_eq!(out["queues"].as_array().unwrap().len(), 2);
    assert!(out["queues"].as_array().unwrap().iter().any(|q| q["vhost"] == "shop" && q["name"] == "ha.orders"));
    let carol = out["users"].as_array().unwrap().iter().find(|u| u["name"] == "carol").cloned().unwrap();
    assert_eq!(carol["password_hash"], "CQgHBpdMuZXyG/avuvpvKFRTydvBrCJsDFtbvgMLddasqgCe", "hash kept as exported");
    // The imported hashes are RabbitMQ's: carol logs in with her RabbitMQ
    // password (alice-pw) and sees her vhost only; guest still logs in.
    let (s, mine) = api.call_as(2, "GET", "/api/queues", None, Some(("carol", "alice-pw"))).await;
    assert_eq!(s, 200);
    assert_eq!(mine.as_array().unwrap().len(), 1, "{mine}");
    assert_eq!(mine[0]["vhost"], "shop");
    assert_eq!(api.call(2, "GET", "/api/whoami", None).await.1["name"], "guest");

    let bad = r#"{"policies":[{"name":"ok","pattern":"^z","definition":{"ha-mode":"all"}}],
                  "queues":[{"name":"q","vhost":"/other"}]}"#;
    assert_error(&api.call(1, "POST", "/api/definitions", Some(bad)).await, 400, "vhost");
    assert_eq!(api.call(1, "GET", "/api/policies/%2F/ok", None).await.0, 404, "nothing of a bad file applied");
    assert_error(&api.call(1, "POST", "/api/definitions", Some(r#"{"queues":{}}"#)).await, 400, "list");
    let md5 = r#"{"users":[{"name":"admin","password_hash":"abc","hashing_algorithm":"rabbit_password_hashing_md5"}]}"#;
    assert_error(&api.call(1, "POST", "/api/definitions", Some(md5)).await, 400, "hashing_algorithm");
    let no_user = r#"{"permissions":[{"user":"nobody","vhost":"/","configure":"","write":"","read":""}]}"#;
    assert_error(&api.call(1, "POST", "/api/definitions", Some(no_user)).await, 400, "nobody");
    api.cluster.shutdown().await;
}

/// Connections, channels and consumers of every node, asked on any node.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn connections_channels_and_consumers_cluster_wide() {
    use lapin::options::{BasicConsumeOptions, BasicQosOptions, QueueDeclareOptions};
    use lapin::types::{FieldTable, ShortString};
    init_tracing();
    let api = Api::start().await;
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let amqp_port = l.local_addr().unwrap().port();
    let n2 = api.cluster.node(2).clone();
    tokio::spawn(mirrorq::amqp::serve(l, n2.clone(), n2.stopped()));
    let conn = lapin::Connection::connect(&format!("amqp://guest:guest@127.0.0.1:{amqp_port}/%2f"), Default::default())
        .await
        .unwrap();
    let ch1 = conn.create_channel().await.unwrap();
    let _ch2 = conn.create_channel().await.unwrap();
    ch1.queue_declare(ShortString::from("watched"), QueueDeclareOptions::default(), FieldTable::default())
        .await
        .unwrap();
    ch1.basic_qos(7, BasicQosOptions::default()).await.unwrap();
    let _consumer = ch1
        .basic_consume(
            ShortString::from("watched"),
            ShortString::from("c-1"),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();

    let (s, conns) = api.call(1, "GET", "/api/connections", None).await;
    assert_eq!(s, 200);
    assert_eq!(conns.as_array().unwrap().len(), 1, "{conns}");
    assert_eq!(conns[0]["node"], "mirrorq@2");
    assert_eq!(conns[0]["user"], "guest");
    assert_eq!(conns[0]["vhost"], "/");
    assert_eq!(conns[0]["channels"], 2);
    let (_, chans) = api.call(3, "GET", "/api/channels", None).await;
    assert_eq!(chans.as_array().unwrap().len(), 2, "{chans}");
    let (_, consumers) = api.call(1, "GET", "/api/consumers", None).await;
    assert_eq!(consumers.as_array().unwrap().len(), 1, "{consumers}");
    assert_eq!(consumers[0]["consumer_tag"], "c-1");
    assert_eq!(consumers[0]["queue"]["name"], "watched");
    assert_eq!(consumers[0]["prefetch_count"], 7);

    // Closed through the API, as rabbitmqadmin does: a monitoring user
    // sees the connection but may not close it; an administrator closes
    // it from a node that does not hold it.
    let path =
        format!("/api/connections/{}", conns[0]["name"].as_str().unwrap().replace(' ', "%20").replace('>', "%3E"));
    let (s, _) = api.call(1, "PUT", "/api/users/watcher", Some(r#"{"password":"w","tags":"monitoring"}"#)).await;
    assert!(s == 201 || s == 204, "{s}");
    let (s, seen) = api.call_as(3, "GET", "/api/connections", None, Some(("watcher", "w"))).await;
    assert_eq!((s, seen.as_array().map(|a| a.len())), (200, Some(1)), "a monitoring user sees every connection");
    let (s, _) = api.call_as(3, "DELETE", &path, None, Some(("watcher", "w"))).await;
    assert_eq!(s, 404, "a monitoring user closed another user's connection");
    assert!(conn.status().connected());
    let (s, body) = api.call(3, "DELETE", &path, None).await;
    assert_eq!(s, 204, "{body}");
    for _ in 0..50 {
        if !conn.status().connected() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(!conn.status().connected(), "closed through the API, yet connected");
    let mut left = Value::Null;
    for _ in 0..50 {
        left = api.call(1, "GET", "/api/connections", None).await.1;
        if left.as_array().is_some_and(|a| a.is_empty()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(left, json!([]));
    assert_eq!(api.call(1, "GET", "/api/consumers", None).await.1, json!([]));
    api.cluster.shutdown().await;
}

/// Queue arguments through the API (validated, shown, compared on
/// re-declare, exported), and the alarms health check and node readings.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queue_arguments_and_alarms() {
    use mirrorq::alarms::{Watermark, DEFAULT_DISK_FREE_LIMIT};
    init_tracing();
    let api = Api::start().await;
    let args = r#"{"durable":true,"arguments":{"x-message-ttl":60000,"x-max-length":10,"x-overflow":"reject-publish","x-dead-letter-exchange":"dlx"}}"#;
    assert_eq!(api.call(1, "PUT", "/api/queues/%2F/limited", Some(args)).await.0, 201);
    let (s, q) = api.call(2, "GET", "/api/queues/%2F/limited", None).await;
    assert_eq!(s, 200);
    assert_eq!(
        q["arguments"],
        json!({"x-message-ttl":60000,"x-max-length":10,"x-overflow":"reject-publish","x-dead-letter-exchange":"dlx"})
    );
    assert_eq!(api.call(3, "PUT", "/api/queues/%2F/limited", Some(args)).await.0, 204, "same arguments");
    let other = r#"{"arguments":{"x-message-ttl":1}}"#;
    assert_error(
        &api.call(3, "PUT", "/api/queues/%2F/limited", Some(other)).await,
        400,
        "inequivalent arg 'x-message-ttl'",
    );
    for (body, says) in [
        (r#"{"arguments":{"x-message-ttl":-1}}"#, "x-message-ttl"),
        (r#"{"arguments":{"x-max-length":"ten"}}"#, "x-max-length"),
        (r#"{"arguments":{"x-overflow":"sideways"}}"#, "x-overflow"),
        (r#"{"arguments":{"x-max-length-bytes":100}}"#, "not supported"),
    ] {
        assert_error(&api.call(1, "PUT", "/api/queues/%2F/bad-args", Some(body)).await, 400, says);
    }
    assert_eq!(api.call(1, "GET", "/api/queues/%2F/bad-args", None).await.0, 404);
    let (_, defs) = api.call(1, "GET", "/api/definitions", None).await;
    let exported = defs["queues"].as_array().unwrap().iter().find(|q| q["name"] == "limited").unwrap().clone();
    assert_eq!(exported["arguments"]["x-max-length"], 10);

    // Alarms: the health check fails while one is on, and says why.
    assert_eq!(api.call(2, "GET", "/api/health/checks/alarms", None).await, (200, json!({"status":"ok"})));
    api.cluster.node(2).alarms().set_limits(Watermark::Bytes(1), DEFAULT_DISK_FREE_LIMIT);
    let (s, body) = api.call(2, "GET", "/api/health/checks/alarms", None).await;
    assert_eq!((s, body["status"].as_str()), (503, Some("failed")));
    assert!(body["reason"].as_str().unwrap().contains("low on memory"), "{body}");
    let (_, nodes) = api.call(2, "GET", "/api/nodes", None).await;
    let me = nodes.as_array().unwrap().iter().find(|n| n["name"] == "mirrorq@2").unwrap().clone();
    assert_eq!(me["mem_alarm"], true);
    assert_eq!(me["mem_limit"], 1);
    assert!(me["mem_used"].as_u64().unwrap() > 1 && me["disk_free"].as_u64().unwrap() > 0, "{me}");
    assert_eq!(api.call(1, "GET", "/api/health/checks/alarms", None).await.0, 200, "node 1 has no alarm");
    // Any node shows every node's readings.
    let (_, nodes) = api.call(1, "GET", "/api/nodes", None).await;
    for n in nodes.as_array().unwrap() {
        assert_eq!(n["running"], true, "{n}");
        assert!(n["mem_used"].as_u64().unwrap() > 1, "{n}");
        assert_eq!(n["mem_alarm"], n["name"] == "mirrorq@2", "{n}");
    }
    api.cluster.node(2).alarms().set_limits(Watermark::default(), DEFAULT_DISK_FREE_LIMIT);
    assert_eq!(api.call(2, "GET", "/api/health/checks/alarms", None).await.0, 200);
    api.cluster.shutdown().await;
}

/// `GET /metrics` without credentials, in the OpenMetrics text format.
async fn scrape(api: &Api, node: u64) -> String {
    let url = format!("http://127.0.0.1:{}/metrics", api.ports[(node - 1) as usize]);
    tokio::task::spawn_blocking(move || {
        let resp = ureq::get(&url).timeout(Duration::from_secs(30)).call().expect("metrics answer 200 without auth");
        assert!(resp.content_type().contains("openmetrics"), "{}", resp.content_type());
        resp.into_string().unwrap()
    })
    .await
    .unwrap()
}

/// The value of the sample `name` (with its labels, e.g. `x{queue="q",vhost="/"}`).
fn sample(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|rest| rest.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("no sample {name} in:\n{text}"))
        .trim()
        .parse()
        .unwrap()
}

/// Prometheus metrics: per-queue depth and synchronised replicas on the
/// master, Raft figures on every replica, the front-end counters where the
/// client is, confirm and fsync latency histograms, memory and disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn prometheus_metrics() {
    init_tracing();
    let api = Api::start().await;
    let pol = r#"{"pattern":"^m","definition":{"ha-mode":"all","ha-sync-mode":"automatic"}}"#;
    assert_eq!(api.call(1, "PUT", "/api/policies/%2F/ha", Some(pol)).await.0, 201);
    // The nodes share this test's runtime: a mirrored queue adds its three
    // replicas' tasks to the count each node reports.
    let tasks_before = sample(&scrape(&api, 1).await, "mirrorq_runtime_tasks");
    assert_eq!(api.call(1, "PUT", "/api/queues/%2F/mq", Some("{}")).await.0, 201);
    let msg = r#"{"properties":{},"routing_key":"mq","payload":"x","payload_encoding":"string"}"#;
    for _ in 0..3 {
        assert_eq!(
            api.call(2, "POST", "/api/exchanges/%2F/amq.default/publish", Some(msg)).await.1,
            json!({"routed": true})
        );
    }
    let get = r#"{"count":1,"ackmode":"ack_requeue_false","encoding":"auto"}"#;
    assert_eq!(api.call(2, "POST", "/api/queues/%2F/mq/get", Some(get)).await.0, 200);
    let q = r#"{queue="mq",vhost="/"}"#;
    let (_, info) = api.call(1, "GET", "/api/queues/%2F/mq", None).await;
    let master: u64 = info["node"].as_str().unwrap().trim_start_matches("mirrorq@").parse().unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while api.call(1, "GET", "/api/queues/%2F/mq", None).await.1["synchronised_slave_nodes"]
        .as_array()
        .map_or(0, Vec::len)
        < 2
    {
        assert!(std::time::Instant::now() < deadline, "mirrors never synchronised");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let m = scrape(&api, master).await;
    assert_eq!(sample(&m, &format!("rabbitmq_queue_messages_ready{q}")), 2.0);
    assert_eq!(sample(&m, &format!("rabbitmq_queue_messages_unacked{q}")), 0.0);
    assert_eq!(sample(&m, &format!("mirrorq_queue_synchronised_replicas{q}")), 3.0);
    assert_eq!(sample(&m, &format!("mirrorq_raft_leader_node{q}")), master as f64);
    for n in 1..=3 {
        // A mirror learns an entry is committed from the master's next
        // append, which the slower of the two may not have had yet.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut m = scrape(&api, n).await;
        while sample(&m, &format!("rabbitmq_raft_log_commit_index{q}")) < 4.0 && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            m = scrape(&api, n).await;
        }
        assert!(sample(&m, &format!("rabbitmq_raft_term{q}")) >= 1.0, "node {n}");
        assert!(sample(&m, &format!("rabbitmq_raft_log_commit_index{q}")) >= 4.0, "node {n}: 3 publishes and a get");
        // Never re-formed: every replica is in the epoch the group was founded in.
        assert_eq!(sample(&m, &format!("mirrorq_queue_epoch_term{q}")), 0.0, "node {n}");
        assert_eq!(sample(&m, &format!("mirrorq_queue_epoch_node{q}")), 0.0, "node {n}");
        assert!(sample(&m, "mirrorq_fsync_seconds_count") >= 1.0, "node {n} synced");
        assert!(sample(&m, "rabbitmq_process_resident_memory_bytes") > 1e6);
        assert!(sample(&m, "rabbitmq_disk_space_available_bytes") > 0.0);
        assert_eq!(sample(&m, "rabbitmq_alarms_memory_used_watermark"), 0.0);
        if n != master {
            assert!(!m.contains(&format!("rabbitmq_queue_messages_ready{q}")), "depth only from the master");
        }
    }
    let tasks_after = sample(&scrape(&api, 1).await, "mirrorq_runtime_tasks");
    assert!(tasks_after >= tasks_before + 3.0, "tasks {tasks_before} -> {tasks_after} for three new replicas");
    // The idle queue goes quiet: its master counts it, no one else does.
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while sample(&scrape(&api, master).await, "mirrorq_queue_groups_quiet") < 1.0 {
        assert!(std::time::Instant::now() < deadline, "the idle queue never went quiet");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for n in (1..=3).filter(|n| *n != master) {
        assert_eq!(sample(&scrape(&api, n).await, "mirrorq_queue_groups_quiet"), 0.0, "node {n}");
    }
    // The client's node counts what its client did.
    let m = scrape(&api, 2).await;
    assert_eq!(sample(&m, "rabbitmq_global_messages_received_total"), 3.0);
    assert_eq!(sample(&m, "rabbitmq_global_messages_confirmed_total"), 3.0);
    assert_eq!(sample(&m, "rabbitmq_global_messages_delivered_total"), 1.0);
    assert_eq!(sample(&m, "rabbitmq_global_messages_acknowledged_total"), 1.0);
    assert_eq!(sample(&m, "mirrorq_confirm_latency_seconds_count"), 3.0);
    assert!(sample(&m, r#"mirrorq_confirm_latency_seconds_bucket{le="+Inf"}"#) == 3.0);
    assert!(m.trim_end().ends_with("# EOF"));
    let m = scrape(&api, if master == 3 { 1 } else { 3 }).await;
    assert_eq!(sample(&m, "rabbitmq_global_messages_received_total"), 0.0, "no client there");
    api.cluster.shutdown().await;
}

/// `GET /` serves the embedded web UI without credentials (it has its own
/// login and calls the API with them); every page it draws is there.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn web_ui_is_served_from_the_binary() {
    init_tracing();
    let api = Api::start().await;
    let url = format!("http://127.0.0.1:{}/", api.ports[1]);
    let (status, kind, page) = tokio::task::spawn_blocking(move || {
        let r = ureq::get(&url).call().expect("200 without auth");
        (r.status(), r.content_type().to_string(), r.into_string().unwrap())
    })
    .await
    .unwrap();
    assert_eq!((status, kind.as_str()), (200, "text/html"));
    for hook in [
        "id=\"login\"",
        "overviewPage",
        "queuesPage",
        "queuePage",
        "policiesPage",
        "/amq.default/publish",
        "setInterval",
    ] {
        assert!(page.contains(hook), "UI lacks {hook}");
    }
    assert!(!page.contains("src=\"http") && !page.contains("href=\"http"), "no external assets");
    api.cluster.shutdown().await;
}

/// Users, vhosts and permissions through the API: an administrator creates
/// a vhost and a management user with access to it; that user works there
/// and is refused (401) everywhere else; patterns narrow what it may touch;
/// deleting a vhost deletes what is in it. Bad input answers 4xx JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn users_vhosts_and_permissions() {
    init_tracing();
    let api = Api::start().await;
    let alice = Some(("alice", "alice-pw"));
    assert_eq!(api.call(1, "PUT", "/api/vhosts/dev", Some(r#"{"description":"team dev"}"#)).await.0, 201);
    assert_eq!(api.call(1, "PUT", "/api/vhosts/dev", None).await.0, 204);
    let (_, vs) = api.call(2, "GET", "/api/vhosts", None).await;
    let names: Vec<&str> = vs.as_array().unwrap().iter().map(|v| v["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["/", "dev"]);
    assert_eq!(
        api.call(1, "PUT", "/api/users/alice", Some(r#"{"password":"alice-pw","tags":"management"}"#)).await.0,
        201
    );
    let (_, u) = api.call(2, "GET", "/api/users/alice", None).await;
    assert_eq!(u["tags"], json!(["management"]));
    assert_eq!(u["hashing_algorithm"], "rabbit_password_hashing_sha256");
    assert!(!u["password_hash"].as_str().unwrap().contains("alice-pw"));
    // Known to the API, but no vhost yet: logs in and sees nothing.
    assert_eq!(api.call_as(3, "GET", "/api/queues", None, alice).await, (200, json!([])));
    let perm = r#"{"configure":".*","write":".*","read":".*"}"#;
    assert_eq!(api.call(1, "PUT", "/api/permissions/dev/alice", Some(perm)).await.0, 201);
    let (_, p) = api.call(3, "GET", "/api/permissions/dev/alice", None).await;
    assert_eq!(p, json!({"user":"alice","vhost":"dev","configure":".*","write":".*","read":".*"}));
    let (_, ps) = api.call(3, "GET", "/api/vhosts/dev/permissions", None).await;
    assert_eq!(ps.as_array().unwrap().len(), 1);
    let (_, ps) = api.call(3, "GET", "/api/users/guest/permissions", None).await;
    assert_eq!(ps[0]["vhost"], "/");

    // Bad input.
    assert_error(
        &api.call(1, "PUT", "/api/permissions/dev/alice", Some(r#"{"configure":"(","write":"","read":""}"#)).await,
        400,
        "configure",
    );
    assert_error(&api.call(1, "PUT", "/api/permissions/dev/nobody", Some(perm)).await, 400, "not_found");
    assert_error(&api.call(1, "PUT", "/api/permissions/nope/alice", Some(perm)).await, 400, "not_found");
    assert_error(&api.call(1, "PUT", "/api/permissions/dev/alice", Some(r#"{"configure":".*"}"#)).await, 400, "write");
    assert_error(&api.call(1, "PUT", "/api/users/bob", Some(r#"{"password":5}"#)).await, 400, "password");
    assert_error(&api.call(1, "PUT", "/api/users/bob", Some(r#"{"password":"x","tags":7}"#)).await, 400, "tags");
    assert_error(&api.call(1, "PUT", "/api/users/bob", Some("{nope")).await, 400, "JSON");
    assert_error(&api.call(1, "PUT", "/api/vhosts/a%00b", None).await, 400, "NUL");
    assert_error(&api.call(1, "GET", "/api/vhosts/nope", None).await, 404, "");
    assert_error(&api.call(1, "DELETE", "/api/users/nope", None).await, 404, "");
    assert_error(&api.call(1, "DELETE", "/api/permissions/%2F/alice", None).await, 404, "");
    assert_error(&api.call(1, "GET", "/api/queues/nope", None).await, 404, "");

    // Alice works in dev; / is another namespace.
    assert_eq!(api.call(1, "PUT", "/api/queues/%2F/jobs", Some("{}")).await.0, 201);
    assert_eq!(api.call_as(2, "PUT", "/api/queues/dev/jobs", Some("{}"), alice).await.0, 201);
    let msg = r#"{"properties":{},"routing_key":"jobs","payload":"for dev","payload_encoding":"string"}"#;
    let publish = api.call_as(3, "POST", "/api/exchanges/dev/amq.default/publish", Some(msg), alice).await;
    assert_eq!(publish, (200, json!({"routed": true})));
    assert_eq!(api.call_as(1, "GET", "/api/queues/dev/jobs", None, alice).await.1["messages"], 1);
    assert_eq!(api.call(1, "GET", "/api/queues/%2F/jobs", None).await.1["messages"], 0);
    let (_, mine) = api.call_as(1, "GET", "/api/queues", None, alice).await;
    assert_eq!(mine.as_array().unwrap().len(), 1);
    assert_eq!((mine[0]["name"].as_str(), mine[0]["vhost"].as_str()), (Some("jobs"), Some("dev")));
    assert_eq!(api.call(1, "GET", "/api/queues", None).await.1.as_array().unwrap().len(), 2, "the admin sees both");
    let (_, ex) = api.call_as(1, "GET", "/api/exchanges", None, alice).await;
    assert!(ex.as_array().unwrap().iter().all(|e| e["vhost"] == "dev"), "{ex}");
    let take = r#"{"count":1,"ackmode":"ack_requeue_false","encoding":"auto"}"#;
    let (_, got) = api.call_as(2, "POST", "/api/queues/dev/jobs/get", Some(take), alice).await;
    assert_eq!(got[0]["payload"], "for dev");

    // And is refused elsewhere, and from what only administrators do.
    for (method, path, body) in [
        ("GET", "/api/queues/%2F", None),
        ("GET", "/api/queues/%2F/jobs", None),
        ("PUT", "/api/queues/%2F/mine", Some("{}")),
        ("DELETE", "/api/queues/%2F/jobs", None),
        ("POST", "/api/exchanges/%2F/amq.default/publish", Some(msg)),
        ("GET", "/api/users", None),
        ("PUT", "/api/vhosts/mine", None),
        ("PUT", "/api/permissions/%2F/alice", Some(perm)),
        ("GET", "/api/definitions", None),
        ("POST", "/api/rebalance/queues", Some("{}")),
        ("PUT", "/api/policies/dev/p", Some(r#"{"pattern":".*","definition":{"ha-mode":"all"}}"#)),
    ] {
        let r = api.call_as(2, method, path, body, alice).await;
        assert_eq!(r.0, 401, "{method} {path}: {r:?}");
        assert_eq!(r.1["error"], "not_authorised", "{method} {path}");
    }
    assert_eq!(api.call(1, "GET", "/api/queues/%2F/jobs", None).await.1["messages"], 0, "nothing happened in /");
    assert_error(&api.call_as(2, "GET", "/api/overview", None, Some(("alice", "wrong"))).await, 401, "Login failed");
    assert_eq!(api.call(1, "PUT", "/api/users/bob", Some(r#"{"password":"bob-pw"}"#)).await.0, 201);
    assert_error(&api.call_as(2, "GET", "/api/overview", None, Some(("bob", "bob-pw"))).await, 401, "management");

    // Narrower patterns: configure only alice-*.
    let narrow = r#"{"configure":"^alice-","write":".*","read":".*"}"#;
    assert_eq!(api.call(1, "PUT", "/api/permissions/dev/alice", Some(narrow)).await.0, 204);
    assert_error(&api.call_as(2, "PUT", "/api/queues/dev/other", Some("{}"), alice).await, 401, "configure");
    assert_eq!(api.call_as(2, "PUT", "/api/queues/dev/alice-1", Some("{}"), alice).await.0, 201);

    // Deleting the vhost deletes its queues and permissions.
    assert_eq!(api.call(3, "DELETE", "/api/vhosts/dev", None).await.0, 204);
    assert_error(&api.call(1, "GET", "/api/queues/dev/jobs", None).await, 404, "");
    let (_, all) = api.call(1, "GET", "/api/queues", None).await;
    assert_eq!(all.as_array().unwrap().len(), 1);
    assert_eq!(api.call_as(1, "GET", "/api/queues", None, alice).await, (200, json!([])));
    assert!(api.call(1, "GET", "/api/users/alice/permissions", None).await.1.as_array().unwrap().is_empty());
    assert_eq!(api.call(1, "DELETE", "/api/users/alice", None).await.0, 204);
    assert_error(&api.call_as(1, "GET", "/api/overview", None, alice).await, 401, "Login failed");
    api.cluster.shutdown().await;
}

/// Exchanges and bindings through the API: declare, read, bind, route a
/// publish through the binding, and delete; bad input answers 4xx JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exchanges_and_bindings_routes() {
    init_tracing();
    let api = Api::start().await;
    assert_eq!(api.call(1, "PUT", "/api/exchanges/%2F/logs", Some(r#"{"type":"topic","durable":true}"#)).await.0, 201);
    assert_eq!(api.call(2, "PUT", "/api/exchanges/%2F/logs", Some(r#"{"type":"topic"}"#)).await.0, 204);
    let (_, e) = api.call(3, "GET", "/api/exchanges/%2F/logs", None).await;
    assert_eq!((e["name"].as_str(), e["type"].as_str(), e["vhost"].as_str()), (Some("logs"), Some("topic"), Some("/")));
    let (_, d) = api.call(3, "GET", "/api/exchanges/%2F/amq.default", None).await;
    assert_eq!(d["type"], "direct");
    let (_, all) = api.call(3, "GET", "/api/exchanges/%2F", None).await;
    assert_eq!(all.as_array().unwrap().len(), 7, "six built-in and logs: {all}");
    assert_eq!(api.call(1, "PUT", "/api/queues/%2F/errors", Some("{}")).await.0, 201);
    let bind = r#"{"routing_key":"*.error","arguments":{}}"#;
    assert_eq!(api.call(2, "POST", "/api/bindings/%2F/e/logs/q/errors", Some(bind)).await.0, 201);
    let (_, bs) = api.call(3, "GET", "/api/bindings/%2F/e/logs/q/errors", None).await;
    assert_eq!(bs[0]["routing_key"], "*.error");
    assert_eq!(bs[0]["source"], "logs");
    assert_eq!(bs[0]["destination"], "errors");
    assert_eq!(api.call(3, "GET", "/api/bindings/%2F", None).await.1.as_array().unwrap().len(), 1);
    let msg =
        |key: &str| format!(r#"{{"properties":{{}},"routing_key":"{key}","payload":"x","payload_encoding":"string"}}"#);
    assert_eq!(api.call(1, "POST", "/api/exchanges/%2F/logs/publish", Some(&msg("db.error"))).await.1["routed"], true);
    assert_eq!(api.call(1, "POST", "/api/exchanges/%2F/logs/publish", Some(&msg("db.info"))).await.1["routed"], false);
    assert_eq!(api.call(1, "GET", "/api/queues/%2F/errors", None).await.1["messages"], 1);

    assert_error(&api.call(1, "PUT", "/api/exchanges/%2F/x", Some(r#"{"type":"fast"}"#)).await, 400, "type");
    assert_error(&api.call(1, "PUT", "/api/exchanges/%2F/x", Some("{}")).await, 400, "type");
    assert_error(
        &api.call(1, "PUT", "/api/exchanges/%2F/x", Some(r#"{"type":"direct","durable":"y"}"#)).await,
        400,
        "durable",
    );
    assert_error(
        &api.call(1, "PUT", "/api/exchanges/%2F/logs", Some(r#"{"type":"fanout"}"#)).await,
        400,
        "inequivalent",
    );
    assert_error(&api.call(1, "PUT", "/api/exchanges/%2F/amq.mine", Some(r#"{"type":"direct"}"#)).await, 400, "amq.");
    assert_error(&api.call(1, "PUT", "/api/exchanges/nope/x", Some(r#"{"type":"direct"}"#)).await, 404, "");
    assert_error(&api.call(1, "GET", "/api/exchanges/%2F/nope", None).await, 404, "");
    assert_error(&api.call(1, "POST", "/api/bindings/%2F/e/nope/q/errors", Some(bind)).await, 404, "");
    assert_error(
        &api.call(1, "POST", "/api/bindings/%2F/e/logs/q/errors", Some(r#"{"routing_key":3}"#)).await,
        400,
        "routing_key",
    );
    assert_error(&api.call(1, "DELETE", "/api/exchanges/%2F/amq.topic", None).await, 400, "built-in");
    // As RabbitMQ's API: delete only if unused (no binding from it), only
    // if empty (no message); a bad flag is a 400 naming it.
    let (status, body) = api.call(2, "DELETE", "/api/exchanges/%2F/logs?if-unused=true", None).await;
    assert_eq!(status, 400, "an exchange with a binding deleted if unused: {body}");
    assert_error(&api.call(2, "DELETE", "/api/queues/%2F/errors?if-empty=true", None).await, 400, "not empty");
    assert_error(&api.call(2, "DELETE", "/api/queues/%2F/errors?if-empty=yes", None).await, 400, "if-empty");
    assert_eq!(api.call(1, "GET", "/api/queues/%2F/errors", None).await.1["messages"], 1, "still there");
    assert_eq!(api.call(2, "PUT", "/api/queues/%2F/spare", Some("{}")).await.0, 201);
    assert_eq!(api.call(2, "DELETE", "/api/queues/%2F/spare?if-empty=true&if-unused=true", None).await.0, 204);

    assert_eq!(api.call(2, "DELETE", "/api/exchanges/%2F/logs", None).await.0, 204);
    assert_error(&api.call(1, "GET", "/api/exchanges/%2F/logs", None).await, 404, "");
    assert!(api.call(1, "GET", "/api/bindings", None).await.1.as_array().unwrap().is_empty(), "bindings went with it");
    api.cluster.shutdown().await;
}

/// Node 3 cut off from both others, which keep the queue (a policy with
/// `ha-promote-on-failure: when-synced`, so its minority never re-forms
/// it): its API shows the queue down, with the counts its own replica last
/// applied, marked as such, and the node shown as the queue's not also
/// among its mirrors; a queue it has no replica of has unknown counts
/// (null), never a confident 0; the overview's totals count the first as
/// last known and say how many queues no master answered for. The other
/// side answers as ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queue_without_a_reachable_master_shows_what_is_known_never_a_confident_zero() {
    init_tracing();
    let api = Api::start().await;
    let policy = r#"{"pattern":"^ha\\.","definition":{"ha-mode":"all","ha-promote-on-failure":"when-synced"}}"#;
    assert_eq!(api.call(1, "PUT", "/api/policies/%2F/ha", Some(policy)).await.0, 201);
    assert_eq!(api.call(1, "PUT", "/api/queues/%2F/ha.q", Some(r#"{"durable":true}"#)).await.0, 201);
    assert_eq!(api.call(1, "PUT", "/api/queues/%2F/lone", Some(r#"{"durable":true}"#)).await.0, 201);
    let publish = r#"{"properties":{},"routing_key":"ha.q","payload":"m","payload_encoding":"string"}"#;
    for _ in 0..2 {
        let (status, body) = api.call(1, "POST", "/api/exchanges/%2F/amq.default/publish", Some(publish)).await;
        assert_eq!((status, &body["routed"]), (200, &json!(true)));
    }
    let until = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (_, q) = api.call(3, "GET", "/api/queues/%2F/ha.q", None).await;
        if q["synchronised_slave_nodes"].as_array().map(Vec::len) == Some(2) && q["messages_ready"] == 2 {
            assert_eq!(q["counts_from"], "master");
            break;
        }
        assert!(std::time::Instant::now() < until, "ha.q never mirrored on three nodes: {q}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Node 3's own replica has applied both publishes (a follower learns
    // of a commit with the master's next append).
    let local = || api.cluster.node(3).queue_info("ha.q").map(|i| (i.local, i.ready)).ok();
    wait_until(Duration::from_secs(10), "node 3's replica applies both publishes", || local() == Some((true, 2))).await;
    for id in [1, 2] {
        api.cluster.node(id).block(3);
        api.cluster.node(3).block(id);
    }
    let until = std::time::Instant::now() + Duration::from_secs(20);
    let q = loop {
        let (_, q) = api.call(3, "GET", "/api/queues/%2F/ha.q", None).await;
        if q["state"] == "down" {
            break q;
        }
        assert!(std::time::Instant::now() < until, "node 3 still shows a master: {q}");
    };
    assert_eq!(q["messages_ready"], 2, "the counts node 3's replica applied: {q}");
    assert_eq!(q["messages"], 2, "{q}");
    assert_eq!(q["counts_from"], "local replica", "{q}");
    let slaves = q["slave_nodes"].as_array().expect("slave_nodes");
    assert!(!slaves.contains(&q["node"]), "the node shown as the queue's is not also a mirror: {q}");
    assert_eq!(slaves.len(), 2, "{q}");
    let (_, lone) = api.call(3, "GET", "/api/queues/%2F/lone", None).await;
    assert_eq!(lone["state"], "down", "{lone}");
    assert!(lone["messages_ready"].is_null() && lone["messages"].is_null(), "unknown, not 0: {lone}");
    assert!(lone["counts_from"].is_null(), "{lone}");
    let (_, kept) = api.call(1, "GET", "/api/queues/%2F/ha.q", None).await;
    assert_eq!(
        (&kept["state"], &kept["messages_ready"], &kept["counts_from"]),
        (&json!("running"), &json!(2), &json!("master"))
    );
    // The overview's totals too: ha.q as node 3's replica last applied it,
    // and how many queues no master answered for.
    let (_, ov) = api.call(3, "GET", "/api/overview", None).await;
    let totals = &ov["queue_totals"];
    assert_eq!((&totals["messages_ready"], &totals["queues_without_master"]), (&json!(2), &json!(2)), "{ov}");
    let (_, ov) = api.call(1, "GET", "/api/overview", None).await;
    assert_eq!(ov["queue_totals"]["queues_without_master"], 0, "{ov}");

    for id in [1, 2] {
        api.cluster.node(id).unblock(3);
        api.cluster.node(3).unblock(id);
    }
    let until = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (_, q) = api.call(3, "GET", "/api/queues/%2F/ha.q", None).await;
        if q["state"] == "running" && q["counts_from"] == "master" {
            break;
        }
        assert!(std::time::Instant::now() < until, "node 3 never sees the master again: {q}");
    }
    api.cluster.shutdown().await;
}

/// `GET /api/queues?page=&page_size=&name=&use_regex=`: RabbitMQ's paged
/// and filtered list, only the page's queues computed; bad paging is a 400
/// with a reason.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn queues_are_paged_and_filtered_by_the_server() {
    init_tracing();
    let api = Api::start().await;
    for i in 0..12 {
        assert_eq!(api.call(1, "PUT", &format!("/api/queues/%2F/p.{i:02}"), Some("{}")).await.0, 201);
    }
    assert_eq!(api.call(1, "PUT", "/api/queues/%2F/other", Some("{}")).await.0, 201);
    let (status, page) = api.call(2, "GET", "/api/queues?page=2&page_size=5", None).await;
    assert_eq!(status, 200, "{page}");
    assert_eq!((&page["page"], &page["page_count"], &page["page_size"]), (&json!(2), &json!(3), &json!(5)));
    assert_eq!(
        (&page["total_count"], &page["filtered_count"], &page["item_count"]),
        (&json!(13), &json!(13), &json!(5))
    );
    let names: Vec<&str> = page["items"].as_array().unwrap().iter().map(|q| q["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["p.04", "p.05", "p.06", "p.07", "p.08"]);
    let (_, page) = api.call(2, "GET", "/api/queues/%2F?page=1&page_size=100&name=P.1", None).await;
    assert_eq!((&page["filtered_count"], &page["total_count"]), (&json!(2), &json!(13)), "{page}");
    let (_, page) = api.call(2, "GET", "/api/queues?page=1&name=%5Ep%5C.0%5B0-2%5D%24&use_regex=true", None).await;
    let names: Vec<&str> = page["items"].as_array().unwrap().iter().map(|q| q["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["p.00", "p.01", "p.02"]);
    let (_, all) = api.call(2, "GET", "/api/queues", None).await;
    assert_eq!(all.as_array().map(Vec::len), Some(13), "without page, the whole list as an array");
    for bad in ["page=0", "page=4&page_size=5", "page=1&page_size=501", "page=x", "name=(&use_regex=true"] {
        let (status, body) = api.call(2, "GET", &format!("/api/queues?{bad}"), None).await;
        assert_eq!(status, 400, "{bad}: {body}");
        assert!(body["reason"].as_str().is_some_and(|r| !r.is_empty()), "{bad}: {body}");
    }
    api.cluster.shutdown().await;
}
