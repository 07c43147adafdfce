//! Message rates as RabbitMQ's management API gives them (`message_stats`:
//! `publish`, `confirm`, `deliver_get`, `ack`, each with
//! `*_details.rate` per second), from counters sampled on the node that
//! keeps them: the node's own front-end counters, and the queues it
//! masters. One ticker per node records a sample a second; a rate is the
//! counters' growth from the oldest sample of the window to now, so it
//! is there for any API client, not only for a page that polls.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::ids::GroupId;

/// How often the node's ticker records a sample.
pub const SAMPLE_EVERY: Duration = Duration::from_secs(1);

/// How far back a rate looks: long enough to smooth the batches a master
/// applies in bursts, short enough that a chart follows a change within
/// a few seconds (RabbitMQ's default sample interval is 5 s).
pub const WINDOW: Duration = Duration::from_secs(5);

/// Below this span a rate would magnify one batch; the rate is 0 until the
/// window has this much history.
const MIN_SPAN_MS: u64 = 900;

/// Totals of the four message counters RabbitMQ's `message_stats` shows.
/// A queue has no `confirm` of its own (confirms are a channel's): 0 there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tally {
    pub publish: u64,
    pub confirm: u64,
    pub deliver_get: u64,
    pub ack: u64,
}

impl Tally {
    fn fields(&self) -> [u64; 4] {
        [self.publish, self.confirm, self.deliver_get, self.ack]
    }

    /// Any counter lower than in `earlier`: the counters started again (a
    /// replica restarted), so `earlier` says nothing of a rate.
    fn went_back_from(&self, earlier: &Tally) -> bool {
        self.fields().iter().zip(earlier.fields()).any(|(now, then)| *now < then)
    }
}

/// Per-second rates of the four counters.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rates {
    pub publish: f64,
    pub confirm: f64,
    pub deliver_get: f64,
    pub ack: f64,
}

impl std::ops::Add for Rates {
    type Output = Rates;
    fn add(self, o: Rates) -> Rates {
        Rates {
            publish: self.publish + o.publish,
            confirm: self.confirm + o.confirm,
            deliver_get: self.deliver_get + o.deliver_get,
            ack: self.ack + o.ack,
        }
    }
}

impl std::ops::Add for Tally {
    type Output = Tally;
    fn add(self, o: Tally) -> Tally {
        Tally {
            publish: self.publish + o.publish,
            confirm: self.confirm + o.confirm,
            deliver_get: self.deliver_get + o.deliver_get,
            ack: self.ack + o.ack,
        }
    }
}

/// Counters now and at the start of the sample window, as the node that
/// keeps them read them: whole numbers, so they travel on the node link
/// and compare exactly; [`Flows::rates`] makes rates of them anywhere.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Flows {
    pub now: Tally,
    /// How many ms before `now` the window starts, and the counters then;
    /// `None` before the first sample.
    pub since: Option<(u64, Tally)>,
}

impl Flows {
    /// Growth per second over the window; 0 while it is too short, or if
    /// the counters went back (they started again).
    pub fn rates(&self) -> Rates {
        let Some((ms, then)) = self.since else { return Rates::default() };
        if ms < MIN_SPAN_MS || self.now.went_back_from(&then) {
            return Rates::default();
        }
        let per_s = |now: u64, then: u64| (now - then) as f64 * 1000.0 / ms as f64;
        Rates {
            publish: per_s(self.now.publish, then.publish),
            confirm: per_s(self.now.confirm, then.confirm),
            deliver_get: per_s(self.now.deliver_get, then.deliver_get),
            ack: per_s(self.now.ack, then.ack),
        }
    }
}

/// RabbitMQ's `message_stats` object: each count and its `*_details`
/// with the rate (rounded to 0.01/s: more digits only make noise).
/// `confirm` only where there are confirms (the overview, not a queue).
pub fn message_stats_json(t: &Tally, r: &Rates, with_confirm: bool) -> Value {
    let rate = |v: f64| json!({"rate": (v * 100.0).round() / 100.0});
    let mut out = json!({
        "publish": t.publish, "publish_details": rate(r.publish),
        "deliver_get": t.deliver_get, "deliver_get_details": rate(r.deliver_get),
        "ack": t.ack, "ack_details": rate(r.ack),
    });
    if let (true, Value::Object(m)) = (with_confirm, &mut out) {
        m.insert("confirm".into(), t.confirm.into());
        m.insert("confirm_details".into(), rate(r.confirm));
    }
    out
}

/// Samples of one set of counters over the last [`WINDOW`].
#[derive(Debug, Default)]
pub struct RateWindow {
    /// Oldest first; the first one is the last taken at or before the
    /// window's start (once there is that much history).
    samples: VecDeque<(Instant, Tally)>,
}

impl RateWindow {
    pub fn record(&mut self, at: Instant, counts: Tally) {
        if self.samples.back().is_some_and(|(_, last)| counts.went_back_from(last)) {
            self.samples.clear();
        }
        self.samples.push_back((at, counts));
        let start = at.checked_sub(WINDOW);
        // Keep one sample at or before the start: the rate then spans the
        // whole window, not a second less.
        while self.samples.len() > 1 && start.is_some_and(|s| self.samples[1].0 <= s) {
            self.samples.pop_front();
        }
    }

    /// The counters `now` (read at `at`) against the window's start.
    pub fn flows(&self, at: Instant, now: Tally) -> Flows {
        let since = self.samples.front().map(|(t, then)| (at.saturating_duration_since(*t).as_millis() as u64, *then));
        Flows { now, since }
    }

    /// When the last sample was recorded.
    fn last_at(&self) -> Option<Instant> {
        self.samples.back().map(|(t, _)| *t)
    }
}

/// A node's sample windows: its own front-end counters, and each queue
/// it masters. Locked only to record or read, never across an await.
#[derive(Debug, Default)]
pub struct Sampler {
    node: Mutex<RateWindow>,
    queues: Mutex<HashMap<GroupId, RateWindow>>,
}

impl Sampler {
    /// One tick: the node's counters, and those of the queues mastered
    /// here now. A queue no longer mastered here loses its window (a new
    /// master samples its own counters; if mastership comes back, its
    /// rate starts again from that moment).
    pub fn record(&self, at: Instant, node: Tally, queues: impl IntoIterator<Item = (GroupId, Tally)>) {
        self.node.lock().expect("poisoned").record(at, node);
        let mut windows = self.queues.lock().expect("poisoned");
        for (group, counts) in queues {
            windows.entry(group).or_default().record(at, counts);
        }
        windows.retain(|_, w| w.last_at() == Some(at));
    }

    pub fn node_flows(&self, at: Instant, now: Tally) -> Flows {
        self.node.lock().expect("poisoned").flows(at, now)
    }

    /// A queue mastered here; no window yet: counts only.
    pub fn queue_flows(&self, group: GroupId, at: Instant, now: Tally) -> Flows {
        match self.queues.lock().expect("poisoned").get(&group) {
            Some(w) => w.flows(at, now),
            None => Flows { now, since: None },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tally(publish: u64, ack: u64) -> Tally {
        Tally { publish, confirm: publish, deliver_get: ack, ack }
    }

    #[test]
    fn a_steady_flow_gives_its_rate_per_second() {
        let t0 = Instant::now();
        let mut w = RateWindow::default();
        // 100 publishes and 40 acks a second, sampled every second for 10 s.
        for s in 0..=10u64 {
            w.record(t0 + Duration::from_secs(s), tally(100 * s, 40 * s));
        }
        // Read half a second after the last sample, with what came since.
        let r = w.flows(t0 + Duration::from_millis(10_500), tally(1050, 420)).rates();
        assert!((r.publish - 100.0).abs() < 1e-9, "{r:?}");
        assert!((r.confirm - 100.0).abs() < 1e-9, "{r:?}");
        assert!((r.ack - 40.0).abs() < 1e-9, "{r:?}");
        assert!((r.deliver_get - 40.0).abs() < 1e-9, "{r:?}");
    }

    #[test]
    fn the_window_keeps_only_the_last_seconds() {
        let t0 = Instant::now();
        let mut w = RateWindow::default();
        // A burst long ago, then nothing: the rate falls to 0.
        w.record(t0, tally(0, 0));
        w.record(t0 + Duration::from_secs(1), tally(5000, 0));
        for s in 2..=9u64 {
            w.record(t0 + Duration::from_secs(s), tally(5000, 0));
        }
        assert_eq!(w.samples.len(), 6, "the start of the window and the samples within it");
        let f = w.flows(t0 + Duration::from_secs(9), tally(5000, 0));
        assert_eq!(f.since.map(|(ms, _)| ms), Some(5000));
        assert_eq!(f.rates(), Rates::default());
        // A rate over the window, not over the last second.
        w.record(t0 + Duration::from_secs(10), tally(5500, 0));
        let r = w.flows(t0 + Duration::from_secs(10), tally(5500, 0)).rates();
        assert!((r.publish - 100.0).abs() < 1e-9, "{r:?}");
    }

    #[test]
    fn no_rate_without_enough_history_or_after_a_restart() {
        let t0 = Instant::now();
        let mut w = RateWindow::default();
        assert_eq!(w.flows(t0, tally(7, 7)).rates(), Rates::default(), "no sample yet");
        w.record(t0, tally(0, 0));
        let early = w.flows(t0 + Duration::from_millis(100), tally(50, 0));
        assert_eq!(early.rates(), Rates::default(), "a tenth of a second says nothing yet");
        w.record(t0 + Duration::from_secs(1), tally(1000, 0));
        // Counters back at a low value: the replica started again.
        w.record(t0 + Duration::from_secs(2), tally(10, 0));
        assert_eq!(w.samples.len(), 1, "the samples before the restart are dropped");
        let f = w.flows(t0 + Duration::from_secs(3), tally(30, 0));
        assert!((f.rates().publish - 20.0).abs() < 1e-9, "{f:?}");
        // Read against an older sample than the counters (never negative).
        let back = Flows { now: tally(1, 0), since: Some((2000, tally(5, 0))) };
        assert_eq!(back.rates(), Rates::default());
    }

    #[test]
    fn queues_no_longer_mastered_lose_their_window() {
        let s = Sampler::default();
        let t0 = Instant::now();
        s.record(t0, Tally::default(), [(7, tally(0, 0)), (8, tally(0, 0))]);
        s.record(t0 + Duration::from_secs(2), tally(20, 0), [(7, tally(10, 0))]);
        let at = t0 + Duration::from_secs(2);
        assert!((s.queue_flows(7, at, tally(10, 0)).rates().publish - 5.0).abs() < 1e-9);
        assert_eq!(s.queue_flows(8, at, tally(10, 0)).since, None);
        assert!((s.node_flows(at, tally(20, 0)).rates().publish - 10.0).abs() < 1e-9);
    }

    #[test]
    fn message_stats_as_rabbitmq_names_them() {
        let t = Tally { publish: 10, confirm: 9, deliver_get: 8, ack: 7 };
        let r = Rates { publish: 1.234, confirm: 0.0, deliver_get: 2.0, ack: 1.0 / 3.0 };
        let v = message_stats_json(&t, &r, true);
        assert_eq!(v["publish"], 10);
        assert_eq!(v["publish_details"]["rate"], 1.23);
        assert_eq!(v["confirm"], 9);
        assert_eq!(v["ack_details"]["rate"], 0.33);
        let q = message_stats_json(&t, &r, false);
        assert!(q.get("confirm").is_none() && q.get("confirm_details").is_none());
        assert_eq!(q["deliver_get_details"]["rate"], 2.0);
    }
}
