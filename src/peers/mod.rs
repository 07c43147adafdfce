//! Whether each peer is alive: the one place that decides it.
//!
//! Evidence comes in four kinds, weighed here and nowhere else:
//!
//! - a **round of pings** (`Peers::round`): the peers that answer are in
//!   reach, and seen at the round's start;
//! - a **refused dial** (`Peers::probe`): nothing listens on the peer's
//!   port, so its process is gone (`kill -9`, a crash, a stop), or a
//!   firewall rejects with a TCP reset in front of a live one. A silent
//!   dial proves nothing: a peer behind a partition that drops, or paused
//!   (SIGSTOP), does not refuse, and stays judged by the pings and Raft's
//!   timers. A refusal is proof of a death only after the peer's end
//!   closed its link in order or it said it stops (`gone_for_sure`);
//!   otherwise what a death allows at once (re-forming a group without
//!   its majority) waits, as for a partition;
//! - a **notice of departure**: a peer that said, in one of its lives, that
//!   it is stopping, counts as stopping until it is heard in another life;
//! - a **link that broke by itself** (read through the [`Prober`] from
//!   the node link's record): the peer was up until then, and a killed
//!   process's sockets close at once, so it bounds when the peer died.
//!
//! Readers get one view, [`PeerNews`], as a `watch` ([`Peers::subscribe`]):
//! the confirm gates judge members by it, and the failure watch, the
//! reaper and the quiet groups ask the owner's read methods.
//!
//! The pings also carry each node's list of the groups it leads quietly
//! ([`quiet`]): one signal per node stands in for every quiet group's
//! heartbeats, so those lists live here with the pings.
//!
//! This module knows nothing of the node: pings go out through a
//! [`Prober`] the node implements.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::watch;

use crate::ids::NodeId;

pub mod quiet;

/// How long a dial to a peer whose link just broke may take: on loopback
/// and a LAN a refusal comes back in well under a millisecond.
const PROBE_LIMIT: Duration = Duration::from_millis(300);
/// Dials of a probe, and the pause between them: a dying process's sockets
/// close one by one, so its links may break while its listening socket
/// still takes a dial; a dial a moment later is refused.
const PROBE_DIALS: u32 = 3;
const PROBE_PAUSE: Duration = Duration::from_millis(20);
/// A round of pings younger than this answers for a new one.
const ROUND_FRESH: Duration = Duration::from_millis(400);

/// What a node knows of its peers that its gates judge members by.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PeerNews {
    /// Not answering pings, or a master that announced its stop: not
    /// watched for progress (a gate whose only lagging member is down, and
    /// no longer synchronised, sleeps until this changes).
    pub down: BTreeSet<NodeId>,
    /// Said they are stopping: confirms do not wait for them, and they are
    /// out of the synchronised set (their reports forgotten) until a later
    /// life of theirs reports.
    pub departed: BTreeSet<NodeId>,
    /// Seen gone: their port refused a dial (the process ended), and they
    /// have not answered since. Unlike a peer merely out of reach, such a
    /// node comes back as a new process that reports by itself.
    pub gone: BTreeSet<NodeId>,
}

/// How the owner reaches a peer; the node implements it.
pub trait Prober: Sync {
    /// Ping `id` (bounded by the implementation): whether it answered.
    fn ping(&self, id: NodeId) -> impl Future<Output = bool> + Send;
    /// The address to dial `id` at for a probe, or `None` when no dial
    /// can prove anything (address unknown, or the link cut by a test,
    /// which stands for a partition where dials go unanswered).
    fn probe_addr(&self, id: NodeId) -> Option<String>;
    /// When this node's link to `id` broke by itself, if it is broken now.
    fn link_lost_at(&self, id: NodeId) -> Option<Instant>;
    /// Whether that link is broken because `id`'s end closed it in order
    /// (end of stream), not reset.
    fn link_closed_in_order(&self, id: NodeId) -> bool;
}

/// What a round of pings found.
#[derive(Debug, Clone)]
pub struct Round {
    /// The peers that answered, and this node.
    pub reach: BTreeSet<NodeId>,
    /// Whether reach changed since the last round, or a peer seen dead
    /// answered again: verdicts that depended on them are stale.
    pub changed: bool,
    /// Silent peers whose port refused a dial during the round.
    pub dead: Vec<NodeId>,
}

#[derive(Default)]
struct State {
    /// Peers that answered the last round of pings, and when it ended.
    reach: Option<(Instant, BTreeSet<NodeId>)>,
    /// When each peer last answered a ping (the start of that round).
    seen: HashMap<NodeId, Instant>,
    /// Peers whose port refused a dial (their process is gone, or a
    /// firewall rejects), and since when;
    /// cleared when they answer a ping.
    dead: HashMap<NodeId, Instant>,
    /// The life each peer was last heard in (its pings and answers say).
    lives: HashMap<NodeId, u64>,
    /// Peers that said they are stopping, with the life they said it in.
    departing: HashMap<NodeId, u64>,
}

/// The owner of every peer's liveness, for one node.
pub struct Peers {
    me: NodeId,
    state: Mutex<State>,
    news: watch::Sender<PeerNews>,
}

impl Peers {
    pub fn new(me: NodeId) -> Self {
        Peers { me, state: Mutex::default(), news: watch::Sender::new(PeerNews::default()) }
    }

    /// The view the confirm gates follow.
    pub fn subscribe(&self) -> watch::Receiver<PeerNews> {
        self.news.subscribe()
    }

    /// The view as it stands.
    pub fn news(&self) -> PeerNews {
        self.news.borrow().clone()
    }

    pub fn is_dead(&self, id: NodeId) -> bool {
        self.state().dead.contains_key(&id)
    }

    /// When `id` last answered a ping.
    pub fn last_seen(&self, id: NodeId) -> Option<Instant> {
        self.state().seen.get(&id).copied()
    }

    /// Whether `id`'s refusals prove that its process went, rather than
    /// a firewall that answers for it or a peer not up yet. A refusal (a
    /// TCP reset to a dial) is the same from a host whose process is gone
    /// and from a firewall that rejects with a reset in front of a live
    /// one. So the proof is a refusal after the peer's end closed our link
    /// in order (end of stream: its process exited or was killed with
    /// nothing unread; a firewall resets), or after it said it is
    /// stopping; otherwise a refusal counts once it has lasted `settle`,
    /// as a silence does. That also covers a whole-cluster power cut: the
    /// first node back is refused by every other only because they are
    /// not up yet, with no link that closed.
    pub fn gone_for_sure(&self, prober: &impl Prober, id: NodeId, settle: Duration) -> bool {
        let s = self.state();
        let Some(since) = s.dead.get(&id) else { return false };
        prober.link_closed_in_order(id) || s.departing.contains_key(&id) || since.elapsed() >= settle
    }

    /// The latest moment `id`, out of reach now, can have died: when its
    /// link broke by itself after it last answered a ping (a killed
    /// process's sockets close at once), else `now`.
    pub fn died_by(&self, prober: &impl Prober, id: NodeId, now: Instant) -> Instant {
        match (prober.link_lost_at(id), self.last_seen(id)) {
            (Some(lost), Some(seen)) if lost > seen => lost.min(now),
            _ => now,
        }
    }

    /// The peers in reach by a round of pings no older than a few hundred
    /// milliseconds, if there was one.
    pub fn fresh_reach(&self) -> Option<BTreeSet<NodeId>> {
        match &self.state().reach {
            Some((at, set)) if at.elapsed() < ROUND_FRESH => Some(set.clone()),
            _ => None,
        }
    }

    /// A round of pings to `peers`; silent ones are probed. Publishes the
    /// news.
    pub async fn round(&self, prober: &impl Prober, peers: &[NodeId]) -> Round {
        let start = Instant::now();
        let answers = futures::future::join_all(peers.iter().map(|id| prober.ping(*id))).await;
        let mut reach: BTreeSet<NodeId> =
            peers.iter().copied().zip(answers).filter(|(_, ok)| *ok).map(|(id, _)| id).collect();
        reach.insert(self.me);
        let changed = {
            let mut s = self.state();
            let was = s.reach.as_ref().map(|(_, r)| r.clone());
            let before = s.dead.len();
            s.dead.retain(|id, _| !reach.contains(id));
            s.dead.len() != before || was.as_ref() != Some(&reach)
        };
        let silent: Vec<NodeId> =
            peers.iter().copied().filter(|id| !reach.contains(id) && !self.is_dead(*id)).collect();
        let probes = futures::future::join_all(silent.iter().map(|id| self.probe(prober, *id))).await;
        let dead = silent.into_iter().zip(probes).filter(|(_, d)| *d).map(|(id, _)| id).collect();
        {
            let mut s = self.state();
            for id in &reach {
                s.seen.insert(*id, start);
            }
            s.reach = Some((Instant::now(), reach.clone()));
        }
        self.publish(peers);
        Round { reach, changed, dead }
    }

    /// Dial `id`: whether its port refused, in which case it is recorded
    /// dead (logged the first time) and the news says so.
    pub async fn probe(&self, prober: &impl Prober, id: NodeId) -> bool {
        let Some(addr) = prober.probe_addr(id) else { return false };
        if !refused(&addr).await {
            return false;
        }
        let newly = {
            let mut s = self.state();
            if let Some((_, reach)) = s.reach.as_mut() {
                reach.remove(&id);
            }
            s.dead.insert(id, Instant::now()).is_none()
        };
        if newly {
            tracing::info!(node = id, "peer's port refuses connections: its process is gone, or a firewall rejects");
        }
        self.news.send_if_modified(|p| {
            let down = p.down.insert(id);
            p.gone.insert(id) || down
        });
        true
    }

    /// `id`, a master that is stopping, handed its groups over: down (its
    /// confirms not waited for) until a round of pings hears it again.
    pub fn stepping_down(&self, id: NodeId) {
        self.news.send_if_modified(|p| p.down.insert(id));
    }

    /// `id` was heard in its life `life` (a ping it sent, or its answer).
    pub fn heard_life(&self, id: NodeId, life: u64) {
        let cleared = {
            let mut s = self.state();
            s.lives.insert(id, life);
            s.departing.get(&id).is_some_and(|said| *said != life) && s.departing.remove(&id).is_some()
        };
        if cleared {
            self.news.send_if_modified(|p| p.departed.remove(&id));
        }
    }

    /// `id` said, in its life `life`, that it is stopping. Whether it
    /// counts as stopping: not when a later life of it was heard already
    /// (a late notice).
    pub fn departs(&self, id: NodeId, life: u64) -> bool {
        {
            let mut s = self.state();
            if s.lives.get(&id).is_some_and(|heard| *heard != life) {
                return false;
            }
            s.departing.insert(id, life);
        }
        self.news.send_if_modified(|p| p.departed.insert(id));
        true
    }

    /// The peers that said they are stopping and have not been heard in
    /// another life since (a peer not heard at all counts as in the life
    /// it said it in).
    pub fn departed(&self) -> BTreeSet<NodeId> {
        self.state().departing.keys().copied().collect()
    }

    /// Publish the news for a cluster of `peers` (this node aside).
    fn publish(&self, peers: &[NodeId]) {
        let news = {
            let s = self.state();
            let reach = s.reach.as_ref().map(|(_, r)| r);
            PeerNews {
                down: peers.iter().copied().filter(|id| reach.is_none_or(|r| !r.contains(id))).collect(),
                departed: s.departing.keys().copied().collect(),
                gone: s.dead.keys().copied().collect(),
            }
        };
        self.news.send_if_modified(|was| {
            let changed = *was != news;
            *was = news;
            changed
        });
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("poisoned")
    }
}

/// Whether a fresh dial to `addr` is refused: nothing listens there.
async fn refused(addr: &str) -> bool {
    for dial in 0..PROBE_DIALS {
        if dial > 0 {
            tokio::time::sleep(PROBE_PAUSE).await;
        }
        match tokio::time::timeout(PROBE_LIMIT, tokio::net::TcpStream::connect(addr)).await {
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => return true,
            Ok(Ok(_)) => continue,
            // Silent (a partition, a paused host) or another failure: no proof.
            _ => return false,
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A peer that said it is stopping counts as stopping until it is heard
    /// in any other life: a later one, or one that starts counting again on
    /// an empty data dir; a notice that comes after its next life was heard
    /// marks nothing.
    #[test]
    fn a_peer_stops_counting_as_stopping_once_heard_in_another_life() {
        let p = Peers::new(1);
        assert!(p.departs(2, 7));
        assert!(p.departed().contains(&2), "not heard from at all: in the life it said");
        assert!(p.news().departed.contains(&2), "published");
        p.heard_life(2, 7);
        assert!(p.departed().contains(&2));
        p.heard_life(2, 1);
        assert!(p.departed().is_empty(), "back on an empty data dir, its life counts from 1 again");
        assert!(p.news().departed.is_empty(), "published");
        p.heard_life(3, 9);
        assert!(!p.departs(3, 8));
        assert!(p.departed().is_empty(), "a late notice from an earlier life");
    }

    /// Pings answered on demand, and a port for each peer that refuses or
    /// takes a dial as the test says.
    struct Scripted {
        answers: BTreeSet<NodeId>,
        addrs: HashMap<NodeId, String>,
        lost: HashMap<NodeId, Instant>,
        /// Peers whose link closed in order (the rest of `lost` reset).
        closed: BTreeSet<NodeId>,
    }

    impl Prober for Scripted {
        async fn ping(&self, id: NodeId) -> bool {
            self.answers.contains(&id)
        }
        fn probe_addr(&self, id: NodeId) -> Option<String> {
            self.addrs.get(&id).cloned()
        }
        fn link_lost_at(&self, id: NodeId) -> Option<Instant> {
            self.lost.get(&id).copied()
        }
        fn link_closed_in_order(&self, id: NodeId) -> bool {
            self.lost.contains_key(&id) && self.closed.contains(&id)
        }
    }

    /// A port nothing listens on: bound, then closed.
    fn closed_port() -> String {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        drop(l);
        addr
    }

    /// A silent peer whose port refuses is dead and gone in the news; one
    /// whose port takes the dial (a paused process) is only down; a dead
    /// peer that answers again is alive, and the round says things changed.
    #[tokio::test]
    async fn a_round_tells_a_refusing_port_from_a_silent_peer() {
        let listening = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut prober = Scripted {
            answers: BTreeSet::from([2]),
            addrs: HashMap::from([(3, closed_port()), (4, listening.local_addr().unwrap().to_string())]),
            lost: HashMap::new(),
            closed: BTreeSet::new(),
        };
        let p = Peers::new(1);
        let r = p.round(&prober, &[2, 3, 4]).await;
        assert_eq!(r.reach, BTreeSet::from([1, 2]));
        assert_eq!(r.dead, vec![3]);
        assert!(p.is_dead(3) && !p.is_dead(4));
        assert_eq!(
            p.news(),
            PeerNews { down: BTreeSet::from([3, 4]), departed: BTreeSet::new(), gone: BTreeSet::from([3]) }
        );
        assert!(p.last_seen(2).is_some() && p.last_seen(3).is_none());
        assert_eq!(p.fresh_reach(), Some(BTreeSet::from([1, 2])), "a round just run stands for the next");

        prober.answers.insert(3);
        let r = p.round(&prober, &[2, 3, 4]).await;
        assert!(r.changed && r.dead.is_empty());
        assert!(!p.is_dead(3), "answered again");
        assert_eq!(p.news().gone, BTreeSet::new());
    }

    /// A refusing port proves a death at once only after the peer's end
    /// closed our link in order, or after it said it stops: a firewall
    /// that resets answers a dial as a dead process's host does, and right
    /// after a whole-cluster power cut every peer refuses only because it
    /// is not up yet. Otherwise the refusal counts once it has lasted the
    /// settle time.
    #[tokio::test]
    async fn a_refusal_proves_a_death_only_after_an_orderly_close_a_notice_or_the_settle_time() {
        let mut prober = Scripted {
            answers: BTreeSet::new(),
            addrs: HashMap::from([(2, closed_port()), (3, closed_port()), (4, closed_port())]),
            lost: HashMap::new(),
            closed: BTreeSet::new(),
        };
        let p = Peers::new(1);
        p.heard_life(3, 4);
        for id in [2, 3, 4] {
            assert!(p.probe(&prober, id).await);
        }
        let settle = Duration::from_secs(3600);
        assert!(!p.gone_for_sure(&prober, 2, settle), "no link ever: may just not be up yet");
        assert!(!p.gone_for_sure(&prober, 3, settle), "heard in this life, but a firewall may answer for it");
        prober.lost = HashMap::from([(2, Instant::now()), (3, Instant::now()), (5, Instant::now())]);
        prober.closed = BTreeSet::from([3, 5]);
        assert!(!p.gone_for_sure(&prober, 2, settle), "its link was reset: a firewall, maybe");
        assert!(p.gone_for_sure(&prober, 3, settle), "its end closed the link, then nothing listened");
        assert!(!p.gone_for_sure(&prober, 5, Duration::ZERO), "closed in order but never refused: not dead");
        assert!(p.departs(4, 4));
        assert!(p.gone_for_sure(&prober, 4, settle), "it said it stops, then nothing listened");
        assert!(p.gone_for_sure(&prober, 2, Duration::ZERO), "refused for the settle time");
    }

    /// A peer out of reach died no later than its link broke, if that was
    /// after it last answered; otherwise all that is known is "by now".
    #[tokio::test]
    async fn a_link_that_broke_after_the_last_answer_bounds_the_death() {
        let mut prober = Scripted {
            answers: BTreeSet::from([2]),
            addrs: HashMap::new(),
            lost: HashMap::new(),
            closed: BTreeSet::new(),
        };
        let p = Peers::new(1);
        let before = Instant::now();
        p.round(&prober, &[2]).await;
        let now = Instant::now() + Duration::from_secs(5);
        assert_eq!(p.died_by(&prober, 2, now), now, "no broken link: only now");
        prober.lost.insert(2, before);
        assert_eq!(p.died_by(&prober, 2, now), now, "it broke before the last answer: it proves nothing");
        let broke = Instant::now() + Duration::from_secs(1);
        prober.lost.insert(2, broke);
        assert_eq!(p.died_by(&prober, 2, now), broke, "it broke after the last answer");
        assert_eq!(p.died_by(&prober, 2, broke - Duration::from_millis(1)), broke - Duration::from_millis(1));
    }
}
