//! The cluster as a whole (overview, alarms, rebalancing), for the
//! dashboards and operators that watch it.

use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use serde_json::{json, Value};

use super::access::Caller;
use super::ApiError;
use crate::metadata::names;
use crate::metadata::QueueMeta;
use crate::node::Node;
use crate::rates::{message_stats_json, Rates, Tally};

/// RabbitMQ's alarms check: 503 while a memory or disk alarm is on here.
pub(super) async fn health(State(node): State<Node>) -> Response {
    match node.alarms().readings().reason() {
        None => Json(json!({"status": "ok"})).into_response(),
        Some(why) => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "failed", "reason": format!("resource alarm in effect on {}: {why}", node.name())})),
        )
            .into_response(),
    }
}

pub(super) async fn overview(State(node): State<Node>, Extension(caller): Extension<Caller>) -> Json<Value> {
    let meta = node.metadata();
    let mut ready = 0;
    let mut unacked = 0;
    // Queues whose master does not answer: counted as this node's replica
    // last applied them, or not at all; the totals say how many.
    let mut unanswered = 0;
    let visible: Vec<&QueueMeta> = meta.queues.values().filter(|q| caller.sees_key(&meta, &q.name)).collect();
    for q in &visible {
        // As the queue list judges it: a view without a master is none.
        let info = match node.master_view(&q.name).await.ok().filter(|v| v.leader.is_some()) {
            Some(info) => Some(info),
            None => {
                unanswered += 1;
                node.queue_info(&q.name).ok().filter(|i| i.local)
            }
        };
        if let Some(info) = info {
            ready += info.ready;
            unacked += info.unacked;
        }
    }
    // What every node's clients did, summed (RabbitMQ's overview counts
    // channels cluster-wide); a node that does not answer is left out.
    let (mut tally, mut rates) = (Tally::default(), Rates::default());
    for f in node.cluster_flows(Duration::from_millis(500)).await {
        (tally, rates) = (tally + f.now, rates + f.rates());
    }
    // Counted as the Connections and Channels pages list them.
    let (conns, consumers) = node.cluster_clients().await;
    let conns: Vec<_> = conns.into_iter().filter(|c| super::clients::own(&caller, &c.user)).collect();
    Json(json!({
        "cluster_name": "mirrorq",
        "node": node.name(),
        "product_name": "mirrorq",
        "product_version": env!("CARGO_PKG_VERSION"),
        "management_version": env!("CARGO_PKG_VERSION"),
        "queue_totals": {"messages": ready + unacked, "messages_ready": ready, "messages_unacknowledged": unacked,
                         "queues_without_master": unanswered},
        "message_stats": message_stats_json(&tally, &rates, true),
        "object_totals": {
            "queues": visible.len(),
            "exchanges": meta.exchanges.keys().filter(|k| caller.sees_key(&meta, k)).count()
                + 6 * meta.vhosts.keys().filter(|v| caller.sees(&meta, v)).count(),
            "connections": conns.len(),
            "channels": conns.iter().map(|c| c.channels.len()).sum::<usize>(),
            "consumers": consumers.iter().filter(|k| conns.iter().any(|c| c.id == k.connection)).count(),
        },
    }))
}

/// Move masters of mirrored queues so every node has within one of the
/// others (RabbitMQ answers at once and works in the background; we answer
/// when done, with what moved).
pub(super) async fn rebalance(
    State(node): State<Node>,
    Extension(caller): Extension<Caller>,
) -> Result<Json<Value>, ApiError> {
    caller.admin()?;
    let moves = node.rebalance().await?;
    let meta = node.metadata();
    let name_of = |id: u64| meta.nodes.get(&id).map(|n| n.name.clone()).unwrap_or_else(|| format!("mirrorq@{id}"));
    let moves: Vec<Value> = moves
        .into_iter()
        .map(|m| {
            let (vhost, queue) = names::split(&m.queue);
            json!({"queue": queue, "vhost": vhost, "from": name_of(m.from), "to": name_of(m.to), "error": m.error})
        })
        .collect();
    Ok(Json(json!({ "moves": moves })))
}
