//! `mirrorq perf`: an AMQP load generator in the spirit of RabbitMQ's
//! PerfTest. It speaks plain AMQP (lapin), so the same command measures
//! mirrorq and RabbitMQ.
//!
//! Every producer and consumer has its own connection, as PerfTest's. Each
//! message starts with its send time, so consumers measure end-to-end
//! latency; producers measure confirm latency. A run ends at `--time` or
//! when every producer and consumer has done its `--pmessages` /
//! `--cmessages`; rates are over the time it really took.

use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use futures::StreamExt;
use hdrhistogram::Histogram;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions,
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

/// A connection to `--uri`, over TLS for `amqps://`, trusting `--ca`.
async fn connect(args: &PerfArgs) -> Result<Connection, PerfError> {
    use lapin::Connect;
    let cert_chain = match &args.ca {
        Some(path) => Some(
            std::fs::read_to_string(path).map_err(|e| PerfError::Invalid(format!("--ca {}: {e}", path.display())))?,
        ),
        None => None,
    };
    let tls = lapin::tcp::OwnedTLSConfig { identity: None, cert_chain };
    let runtime = lapin::runtime::default_runtime()?;
    Ok(args.uri.as_str().connect_with_config(ConnectionProperties::default(), tls, runtime).await?)
}

#[derive(Default)]
struct Counters {
    published: AtomicU64,
    confirmed: AtomicU64,
    nacked: AtomicU64,
    returned: AtomicU64,
    consumed: AtomicU64,
}

/// What every producer and consumer task shares.
struct Run {
    start: Instant,
    /// Connecting, declaring and opening channels, before `start`.
    setup: Duration,
    deadline: Instant,
    counters: Counters,
    confirm_lat: Mutex<Histogram<u64>>,
    e2e_lat: Mutex<Histogram<u64>>,
}

impl Run {
    fn micros(&self) -> u64 {
        self.start.elapsed().as_micros() as u64
    }
    fn left(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }
}

fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000, 3).expect("valid bounds")
}

fn queue_name(args: &PerfArgs, i: u32) -> String {
    if args.queues <= 1 {
        args.queue.clone()
    } else {
        format!("{}-{}", args.queue, i % args.queues + 1)
    }
}

pub async fn run(args: PerfArgs) -> Result<(), PerfError> {
    if args.size < 8 {
        return Err(PerfError::Invalid("--size must be at least 8 bytes (the timestamp)".into()));
    }
    if args.queues == 0 {
        return Err(PerfError::Invalid("--queues must be at least 1".into()));
    }
    if args.producers == 0 && args.consumers == 0 {
        return Err(PerfError::Invalid("nothing to do: --producers and --consumers are both 0".into()));
    }
    let setup_started = Instant::now();
    let setup_conn = connect(&args).await?;
    let setup = setup_conn.create_channel().await?;
    let mut qargs = FieldTable::default();
    if args.quorum {
        qargs.insert(ShortString::from("x-queue-type"), AMQPValue::LongString("quorum".into()));
    }
    for i in 0..args.queues {
        let durable = QueueDeclareOptions { durable: true, ..Default::default() };
        setup.queue_declare(ShortString::from(queue_name(&args, i)), durable, qargs.clone()).await?;
    }
    let mut conns = vec![setup_conn];
    // Connections first, then the clock: rates are of the run, not of TCP
    // and AMQP handshakes (reported apart, as `setup_ms`).
    let mut channels = Vec::new();
    for _ in 0..args.consumers + args.producers {
        let conn = connect(&args).await?;
        channels.push(conn.create_channel().await?);
        conns.push(conn);
    }
    let start = Instant::now();
    let run = Arc::new(Run {
        start,
        setup: start - setup_started,
        deadline: start + Duration::from_secs(args.time),
        counters: Counters::default(),
        confirm_lat: Mutex::new(histogram()),
        e2e_lat: Mutex::new(histogram()),
    });
    let mut tasks = Vec::new();
    let mut channels = channels.into_iter();
    for i in 0..args.consumers {
        let ch = channels.next().expect("one channel per worker");
        tasks.push(tokio::spawn(consume(run.clone(), ch, queue_name(&args, i), args.clone())));
    }
    for i in 0..args.producers {
        let ch = channels.next().expect("one channel per worker");
        tasks.push(tokio::spawn(produce(run.clone(), ch, queue_name(&args, i), args.clone())));
    }

    // Progress, once a second, until the time is up or every task is done.
    let (mut last, mut last_t) = ((0, 0, 0), Instant::now());
    while Instant::now() < run.deadline && !tasks.iter().all(|t| t.is_finished()) {
        tokio::time::sleep(Duration::from_secs(1).min(run.left())).await;
        let c = &run.counters;
        let now = (
            c.published.load(Ordering::Relaxed),
            c.confirmed.load(Ordering::Relaxed),
            c.consumed.load(Ordering::Relaxed),
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
    let mut elapsed = [0f64; 2];
    for t in tasks {
        if let Ok(Some((role, secs))) = t.await {
            elapsed[role] = elapsed[role].max(secs);
        }
    }
    print_summary(&args, &run, elapsed);
    for c in conns {
        let _ = c.close(200, ShortString::from("perf done")).await;
    }
    Ok(())
}

const PRODUCER: usize = 0;
const CONSUMER: usize = 1;

/// Publish until the time is up or `--pmessages` are sent (and confirmed);
/// answers how long that took.
async fn produce(run: Arc<Run>, ch: lapin::Channel, queue: String, args: PerfArgs) -> Option<(usize, f64)> {
    if args.confirm > 0 {
        ch.confirm_select(ConfirmSelectOptions::default()).await.ok()?;
    }
    let window = Arc::new(Semaphore::new(args.confirm.max(1) as usize));
    let props =
        if args.transient { BasicProperties::default() } else { BasicProperties::default().with_delivery_mode(2) };
    let opts = BasicPublishOptions { mandatory: args.mandatory, ..Default::default() };
    let mut body = vec![b'x'; args.size];
    let mut sent = 0u64;
    let exchange = ShortString::from(args.exchange.as_str());
    let key = ShortString::from(args.routing_key.as_deref().unwrap_or(&queue));
    let (confirms, rx) = tokio::sync::mpsc::unbounded_channel::<Confirm>();
    let collector = tokio::spawn(collect_confirms(run.clone(), rx));
    while Instant::now() < run.deadline && (args.pmessages == 0 || sent < args.pmessages) {
        if args.rate > 0 {
            let due = Duration::from_secs_f64(sent as f64 / args.rate as f64);
            if run.start.elapsed() < due {
                tokio::time::sleep(due - run.start.elapsed()).await;
            }
        }
        let Ok(Ok(permit)) = tokio::time::timeout(run.left(), window.clone().acquire_owned()).await else { break };
        let t = run.micros();
        body[..8].copy_from_slice(&t.to_be_bytes());
        let (ch, exchange, key, body, props) = (ch.clone(), exchange.clone(), key.clone(), body.clone(), props.clone());
        let mut publish: Publish = Box::pin(async move { ch.basic_publish(exchange, key, opts, &body, props).await });
        if args.confirm == 0 {
            // No window to bound what is queued: each publish waits until
            // lapin has written it.
            if publish.await.is_err() {
                break;
            }
        } else if args.confirm == 1 {
            // One in flight: nothing to overlap, so the confirm is awaited
            // here rather than handed to the collector, one task hand-off
            // fewer per message (each a thread wake-up on a multi-thread
            // runtime), as PerfTest's publisher waits on its own thread.
            let outcome = match publish.await {
                Ok(pc) => pc.await,
                Err(e) => Err(e),
            };
            if !record_confirm(&run, t, outcome) {
                break;
            }
            drop(permit);
        } else {
            // lapin queues a publish's frames (and numbers it for confirms)
            // when its future is first polled, then waits for its IO thread
            // to write them. Polled once here, in order, and awaited by the
            // collector, a window's publishes share the IO thread's writes
            // instead of costing a thread hand-off and a `sendto` each.
            match futures::poll!(publish.as_mut()) {
                Poll::Ready(Err(_)) => break,
                // Written already: the collector must not poll it again.
                Poll::Ready(Ok(pc)) => publish = Box::pin(std::future::ready(Ok(pc))),
                Poll::Pending => {}
            }
            if confirms.send((t, publish, permit)).is_err() {
                break;
            }
        }
        sent += 1;
        run.counters.published.fetch_add(1, Ordering::Relaxed);
    }
    // The confirms still in the window belong to this run.
    drop(confirms);
    if args.confirm > 0 {
        let _ = tokio::time::timeout(Duration::from_secs(30), window.acquire_many(args.confirm)).await;
    }
    collector.abort();
    Some((PRODUCER, run.start.elapsed().as_secs_f64()))
}

/// A publish queued with lapin: its send, then its confirm.
type Publish = std::pin::Pin<Box<dyn Future<Output = lapin::Result<lapin::PublisherConfirm>> + Send>>;
type Confirm = (u64, Publish, tokio::sync::OwnedSemaphorePermit);

/// Await a producer's confirms, in whatever order they come, in one task
/// rather than one spawned per publish (5-10% less client CPU per message at
/// 1000 in flight; lapin itself is most of what the client spends).
async fn collect_confirms(run: Arc<Run>, mut rx: tokio::sync::mpsc::UnboundedReceiver<Confirm>) {
    let mut waiting = futures::stream::FuturesUnordered::new();
    let mut open = true;
    while open || !waiting.is_empty() {
        tokio::select! {
            next = rx.recv(), if open => match next {
                Some((t, publish, permit)) => waiting.push(async move {
                    let outcome = match publish.await {
                        Ok(pc) => pc.await,
                        Err(e) => Err(e),
                    };
                    (t, outcome, permit)
                }),
                None => open = false,
            },
            Some((t, outcome, permit)) = waiting.next(), if !waiting.is_empty() => {
                record_confirm(&run, t, outcome);
                drop(permit);
            }
        }
    }
}

/// Count a publish's outcome, and its latency if confirmed; false when the
/// channel failed (a nack is an answer, not a failure).
fn record_confirm(run: &Run, sent_at: u64, outcome: lapin::Result<lapin::Confirmation>) -> bool {
    match outcome {
        Ok(c) if c.is_ack() => {
            if c.take_message().is_some() {
                run.counters.returned.fetch_add(1, Ordering::Relaxed);
            }
            run.counters.confirmed.fetch_add(1, Ordering::Relaxed);
            let _ = run.confirm_lat.lock().expect("poisoned").record(run.micros().saturating_sub(sent_at).max(1));
            true
        }
        Ok(_) => {
            run.counters.nacked.fetch_add(1, Ordering::Relaxed);
            true
        }
        Err(_) => {
            run.counters.nacked.fetch_add(1, Ordering::Relaxed);
            false
        }
    }
}

/// Consume with prefetch and multi-acks until the time is up or
/// `--cmessages` arrived; answers how long that took.
async fn consume(run: Arc<Run>, ch: lapin::Channel, queue: String, args: PerfArgs) -> Option<(usize, f64)> {
    ch.basic_qos(args.prefetch, BasicQosOptions::default()).await.ok()?;
    let mut consumer = ch
        .basic_consume(
            ShortString::from(queue.as_str()),
            ShortString::from(""),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .ok()?;
    let mut local = histogram();
    let (mut got, mut since_ack, mut last) = (0u64, 0u32, 0u64);
    let multi = args.multi_ack.max(1);
    while Instant::now() < run.deadline && (args.cmessages == 0 || got < args.cmessages) {
        let Ok(Some(Ok(d))) = tokio::time::timeout(run.left(), consumer.next()).await else { break };
        if d.data.len() >= 8 {
            let sent = u64::from_be_bytes(d.data[..8].try_into().expect("8 bytes"));
            let _ = local.record(run.micros().saturating_sub(sent).max(1));
        }
        run.counters.consumed.fetch_add(1, Ordering::Relaxed);
        got += 1;
        since_ack += 1;
        last = d.delivery_tag;
        if since_ack >= multi {
            let _ = ch.basic_ack(last, BasicAckOptions { multiple: true }).await;
            since_ack = 0;
        }
    }
    if since_ack > 0 {
        let _ = ch.basic_ack(last, BasicAckOptions { multiple: true }).await;
    }
    let secs = run.start.elapsed().as_secs_f64();
    // Stop the deliveries before the connection closes: a delivery arriving
    // on a channel lapin is closing is logged as a connection error.
    let _ = ch.basic_cancel(consumer.tag(), BasicCancelOptions::default()).await;
    run.e2e_lat.lock().expect("poisoned").add(local).expect("same bounds");
    Some((CONSUMER, secs))
}

fn print_summary(args: &PerfArgs, run: &Run, elapsed: [f64; 2]) {
    let c = &run.counters;
    let rate = |n: &AtomicU64, secs: f64| n.load(Ordering::Relaxed) as f64 / secs.max(1e-3);
    let pct = |h: &Histogram<u64>| {
        let ms = |v: u64| if h.is_empty() { 0.0 } else { v as f64 / 1000.0 };
        json!({
            "min": ms(h.min()), "p50": ms(h.value_at_quantile(0.5)), "p75": ms(h.value_at_quantile(0.75)),
            "p95": ms(h.value_at_quantile(0.95)), "p99": ms(h.value_at_quantile(0.99)), "max": ms(h.max()),
        })
    };
    let cl = run.confirm_lat.lock().expect("poisoned");
    let el = run.e2e_lat.lock().expect("poisoned");
    let summary = json!({
        "published": c.published.load(Ordering::Relaxed),
        "confirmed": c.confirmed.load(Ordering::Relaxed),
        "consumed": c.consumed.load(Ordering::Relaxed),
        "published_per_sec": rate(&c.published, elapsed[PRODUCER]),
        "confirmed_per_sec": rate(&c.confirmed, elapsed[PRODUCER]),
        "nacked": c.nacked.load(Ordering::Relaxed),
        "setup_ms": run.setup.as_secs_f64() * 1000.0,
        "returned": c.returned.load(Ordering::Relaxed),
        "consumed_per_sec": rate(&c.consumed, elapsed[CONSUMER]),
        "confirm_latency_ms": pct(&cl),
        "end_to_end_latency_ms": pct(&el),
        "producers": args.producers, "consumers": args.consumers, "queues": args.queues,
        "size": args.size, "confirm": args.confirm,
    });
    if args.json {
        println!("{summary}");
        return;
    }
    println!(
        "summary: sent {:.0} msg/s, confirmed {:.0} msg/s, received {:.0} msg/s{}",
        summary["published_per_sec"].as_f64().unwrap_or(0.0),
        summary["confirmed_per_sec"].as_f64().unwrap_or(0.0),
        summary["consumed_per_sec"].as_f64().unwrap_or(0.0),
        match (summary["nacked"].as_u64(), summary["returned"].as_u64()) {
            (Some(0), Some(0)) => String::new(),
            (n, r) => format!(" ({} nacked, {} returned)", n.unwrap_or(0), r.unwrap_or(0)),
        }
    );
    println!("confirm latency ms  min/p50/p75/p95/p99/max: {}", fmt_pct(&summary["confirm_latency_ms"]));
    println!("end-to-end latency ms min/p50/p75/p95/p99/max: {}", fmt_pct(&summary["end_to_end_latency_ms"]));
}

fn fmt_pct(v: &serde_json::Value) -> String {
    ["min", "p50", "p75", "p95", "p99", "max"]
        .iter()
        .map(|k| format!("{:.2}", v[k].as_f64().unwrap_or(0.0)))
        .collect::<Vec<_>>()
        .join("/")
}
