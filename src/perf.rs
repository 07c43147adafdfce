//! `mirrorq perf`: an AMQP load generator in the spirit of RabbitMQ's
//! PerfTest. It speaks plain AMQP (lapin), so the same command measures
//! mirrorq and RabbitMQ.
//!
//! Each message starts with the send time, so consumers measure
//! end-to-end latency; publishers measure confirm latency.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use hdrhistogram::Histogram;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Connection, ConnectionProperties};
use serde_json::json;
use tokio::sync::Semaphore;

use crate::cli::PerfArgs;

#[derive(Debug, thiserror::Error)]
pub enum PerfError {
    #[error("amqp: {0}")]
    Amqp(#[from] lapin::Error),
    #[error("{0}")]
    Invalid(String),
}

#[derive(Default)]
struct Counters {
    published: AtomicU64,
    confirmed: AtomicU64,
    nacked: AtomicU64,
    consumed: AtomicU64,
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds")
}

fn now_micros(start: Instant) -> u64 {
    start.elapsed().as_micros() as u64
}

pub async fn run(args: PerfArgs) -> Result<(), PerfError> {
    if args.size < 8 {
        return Err(PerfError::Invalid("--size must be at least 8 bytes (the timestamp)".into()));
    }
    let start = Instant::now();
    let counters = Arc::new(Counters::default());
    let confirm_lat = Arc::new(Mutex::new(histogram()));
    let e2e_lat = Arc::new(Mutex::new(histogram()));
    let conn = Connection::connect(&args.uri, ConnectionProperties::default()).await?;
    let setup = conn.create_channel().await?;
    let mut qargs = FieldTable::default();
    if args.quorum {
        qargs.insert(ShortString::from("x-queue-type"), AMQPValue::LongString("quorum".into()));
    }
    setup
        .queue_declare(
            ShortString::from(args.queue.as_str()),
            QueueDeclareOptions { durable: true, ..Default::default() },
            qargs,
        )
        .await?;
    let deadline = start + Duration::from_secs(args.time);
    let mut tasks = Vec::new();

    for _ in 0..args.consumers {
        let ch = conn.create_channel().await?;
        ch.basic_qos(args.prefetch, BasicQosOptions::default()).await?;
        let mut consumer = ch
            .basic_consume(
                ShortString::from(args.queue.as_str()),
                ShortString::from(""),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let (counters, e2e, multi) = (counters.clone(), e2e_lat.clone(), args.multi_ack.max(1));
        tasks.push(tokio::spawn(async move {
            let mut local = histogram();
            let mut since_ack = 0u32;
            while Instant::now() < deadline {
                let next =
                    tokio::time::timeout(deadline.saturating_duration_since(Instant::now()), consumer.next()).await;
                let Ok(Some(Ok(d))) = next else { break };
                if d.data.len() >= 8 {
                    let sent = u64::from_be_bytes(d.data[..8].try_into().expect("8 bytes"));
                    let _ = local.record(now_micros(start).saturating_sub(sent).max(1));
                }
                counters.consumed.fetch_add(1, Ordering::Relaxed);
                since_ack += 1;
                if since_ack >= multi {
                    let _ = ch.basic_ack(d.delivery_tag, BasicAckOptions { multiple: true }).await;
                    since_ack = 0;
                }
            }
            e2e.lock().expect("poisoned").add(local).expect("same bounds");
        }));
    }

    for _ in 0..args.producers {
        let ch = conn.create_channel().await?;
        if args.confirm > 0 {
            ch.confirm_select(ConfirmSelectOptions::default()).await?;
        }
        let window = Arc::new(Semaphore::new(args.confirm.max(1) as usize));
        let (counters, lat) = (counters.clone(), confirm_lat.clone());
        let (queue, size, confirm, persistent, rate) =
            (args.queue.clone(), args.size, args.confirm, !args.transient, args.rate);
        tasks.push(tokio::spawn(async move {
            let props =
                if persistent { BasicProperties::default().with_delivery_mode(2) } else { BasicProperties::default() };
            let mut body = vec![b'x'; size];
            let mut sent = 0u64;
            while Instant::now() < deadline {
                if rate > 0 {
                    let due = Duration::from_secs_f64(sent as f64 / rate as f64);
                    if start.elapsed() < due {
                        tokio::time::sleep(due - start.elapsed()).await;
                    }
                }
                let permit = match tokio::time::timeout(
                    deadline.saturating_duration_since(Instant::now()),
                    window.clone().acquire_owned(),
                )
                .await
                {
                    Ok(Ok(p)) => p,
                    _ => break,
                };
                let t = now_micros(start);
                body[..8].copy_from_slice(&t.to_be_bytes());
                let Ok(pc) = ch
                    .basic_publish(
                        ShortString::from(""),
                        ShortString::from(queue.as_str()),
                        BasicPublishOptions::default(),
                        &body,
                        props.clone(),
                    )
                    .await
                else {
                    break;
                };
                sent += 1;
                counters.published.fetch_add(1, Ordering::Relaxed);
                if confirm == 0 {
                    drop(permit);
                    continue;
                }
                let (counters, lat) = (counters.clone(), lat.clone());
                tokio::spawn(async move {
                    match pc.await {
                        Ok(c) if c.is_ack() => {
                            counters.confirmed.fetch_add(1, Ordering::Relaxed);
                            let _ = lat.lock().expect("poisoned").record(now_micros(start).saturating_sub(t).max(1));
                        }
                        _ => {
                            counters.nacked.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    drop(permit);
                });
            }
            // Wait for the confirms still in the window before the channel
            // (and with it their promises) goes away.
            if confirm > 0 {
                let _ = tokio::time::timeout(Duration::from_secs(30), window.acquire_many(confirm)).await;
            }
        }));
    }

    // Progress, once a second.
    let (mut last, mut last_t) = ((0, 0, 0), Instant::now());
    while Instant::now() < deadline {
        tokio::time::sleep(Duration::from_secs(1).min(deadline.saturating_duration_since(Instant::now()))).await;
        let now = (
            counters.published.load(Ordering::Relaxed),
            counters.confirmed.load(Ordering::Relaxed),
            counters.consumed.load(Ordering::Relaxed),
        );
        let dt = last_t.elapsed().as_secs_f64().max(1e-9);
        if !args.json {
            println!(
                "time {:>5.1}s, sent {:>8.0} msg/s, confirmed {:>8.0} msg/s, received {:>8.0} msg/s",
                start.elapsed().as_secs_f64(),
                (now.0 - last.0) as f64 / dt,
                (now.1 - last.1) as f64 / dt,
                (now.2 - last.2) as f64 / dt
            );
        }
        last = now;
        last_t = Instant::now();
    }
    for t in tasks {
        let _ = t.await;
    }
    let secs = args.time.max(1) as f64;
    let pct = |h: &Histogram<u64>| {
        json!({
            "min": h.min() as f64 / 1000.0, "p50": h.value_at_quantile(0.5) as f64 / 1000.0,
            "p75": h.value_at_quantile(0.75) as f64 / 1000.0, "p95": h.value_at_quantile(0.95) as f64 / 1000.0,
            "p99": h.value_at_quantile(0.99) as f64 / 1000.0, "max": h.max() as f64 / 1000.0,
        })
    };
    let cl = confirm_lat.lock().expect("poisoned");
    let el = e2e_lat.lock().expect("poisoned");
    let summary = json!({
        "published_per_sec": counters.published.load(Ordering::Relaxed) as f64 / secs,
        "confirmed_per_sec": counters.confirmed.load(Ordering::Relaxed) as f64 / secs,
        "nacked": counters.nacked.load(Ordering::Relaxed),
        "consumed_per_sec": counters.consumed.load(Ordering::Relaxed) as f64 / secs,
        "confirm_latency_ms": pct(&cl),
        "end_to_end_latency_ms": pct(&el),
        "producers": args.producers, "consumers": args.consumers, "size": args.size, "confirm": args.confirm,
    });
    if args.json {
        println!("{summary}");
    } else {
        println!(
            "summary: sent {:.0} msg/s, confirmed {:.0} msg/s, received {:.0} msg/s",
            summary["published_per_sec"].as_f64().unwrap_or(0.0),
            summary["confirmed_per_sec"].as_f64().unwrap_or(0.0),
            summary["consumed_per_sec"].as_f64().unwrap_or(0.0)
        );
        println!("confirm latency ms  min/p50/p75/p95/p99/max: {}", fmt_pct(&summary["confirm_latency_ms"]));
        println!("end-to-end latency ms min/p50/p75/p95/p99/max: {}", fmt_pct(&summary["end_to_end_latency_ms"]));
    }
    let _ = conn.close(200, ShortString::from("perf done")).await;
    Ok(())
}

fn fmt_pct(v: &serde_json::Value) -> String {
    ["min", "p50", "p75", "p95", "p99", "max"]
        .iter()
        .map(|k| format!("{:.2}", v[k].as_f64().unwrap_or(0.0)))
        .collect::<Vec<_>>()
        .join("/")
}
