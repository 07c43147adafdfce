//! The failure watch's side of quiet groups (`peers/quiet.rs` keeps
//! the lists the pings carry): as master, when a group has settled and may
//! go quiet; as follower, whether a quiet master stands in for the group's
//! heartbeats.

use std::collections::BTreeSet;
use std::time::Instant;

use openraft::ServerState;

use super::Metrics;
use crate::failover::{Failover, Host, QueueGroup};
use crate::ids::NodeId;
use crate::metadata::MetaState;
use crate::queue::confirm_gate;

/// How many heartbeat intervals a group in use stays still before its
/// master announces it quiet (a group never used: one).
const SETTLE_HEARTBEATS: u32 = 3;

/// A master's term and last log index: the group is settled while they
/// hold still.
pub(super) type Mark = (u64, Option<u64>);

/// Whether a master's group has settled: nothing for the heartbeats to
/// carry to any member in `present` (`Node::present`), and those are a
/// majority of the voters. A member gone or stopping is not waited for:
/// heartbeats cannot reach it, and when it returns the watch looks at the
/// group again (a peer seen alive again, or a new life of it, changes the
/// world) and wakes it if that member lacks any entry.
///
/// A member with every entry but not synchronised is not waited for
/// either, unless it said it lacks bodies: having this master's last entry
/// (always one of its term) it saved this master's vote, so it knows the
/// master, also after a restart, and reports by itself, which lets the gate
/// count it. Heartbeats would tell it nothing more. This is the node back
/// from a stop, whose replicas reported to none of the masters that took
/// over from it: waking each such group at its return (thousands at once)
/// stalled every node's confirms.
///
/// A member on a refilling node has not settled whatever its counts say:
/// they are from the dir it lost.
fn settled(g: &QueueGroup, m: &Metrics, me: NodeId, present: &BTreeSet<NodeId>, refilling: &BTreeSet<NodeId>) -> bool {
    let membership = m.membership_config.membership();
    let applied = m.last_applied.map(|l| l.index);
    if applied != m.last_log_index || membership.get_joint_config().len() != 1 {
        return false;
    }
    let Some(replication) = m.replication.as_ref() else { return false };
    let here = |id: &NodeId| *id == me || present.contains(id);
    let voters: Vec<NodeId> = membership.voter_ids().collect();
    if voters.iter().filter(|v| here(v)).count() * 2 <= voters.len() {
        return false;
    }
    let members: BTreeSet<NodeId> = membership.nodes().map(|(id, _)| *id).filter(here).collect();
    if members.iter().any(|id| *id != me && refilling.contains(id)) {
        return false;
    }
    let all_have = members
        .iter()
        .filter(|id| **id != me)
        .all(|id| replication.get(id).is_some_and(|matched| matched.map(|l| l.index) == m.last_log_index));
    if !all_have {
        return false;
    }
    let behind = confirm_gate::catching_up(&g.catching);
    let sync = g.sync.borrow();
    members.iter().all(|id| sync.synchronised.contains(id) || (*id != me && !behind.contains_key(id)))
        && g.plan.borrow().is_none()
        && !g.changing.load(std::sync::atomic::Ordering::Acquire)
}

impl<H: Host> Failover<H> {
    /// The nodes a group waits for to settle: every node but those seen
    /// gone (their port refuses a dial, `liveness.rs`) and those that said
    /// they are stopping. A node merely out of reach still counts: cut off
    /// one way, it could still unseat a master whose heartbeats are off
    /// (and whose lease has lapsed) again and again.
    /// Read from the peers' news the confirm gates judge by, which
    /// `reachable` refreshes just before.
    pub(super) fn present(&self, state: &MetaState) -> BTreeSet<NodeId> {
        let news = self.peers().news();
        state.nodes.keys().copied().filter(|id| !news.gone.contains(id) && !news.departed.contains(id)).collect()
    }

    /// As follower: whether a quiet master stands in for the group's
    /// heartbeats. It does while its node answers pings and announces the
    /// group in our term (`Some(true)`), and for an election timeout after
    /// it last did (a lease, as a heartbeat gives: `Some(false)`), unless
    /// its process is seen gone.
    pub(super) fn held_by_quiet_master(
        &self,
        g: &QueueGroup,
        m: &Metrics,
        voters: &BTreeSet<NodeId>,
        reach: &BTreeSet<NodeId>,
        now: Instant,
    ) -> Option<bool> {
        let q = &self.quiescence();
        let mut s = g.ext.watch.state();
        let last = &mut s.quiet_master;
        if let Some(master) = q.quiet_master(g.meta.group, m.current_term, self.id(), voters, reach) {
            *last = Some((master, m.current_term, now));
            return Some(true);
        }
        match *last {
            Some((master, term, at))
                if term == m.current_term && !self.is_dead(master) && now < at + self.timing().election_max =>
            {
                Some(false)
            }
            _ => {
                *last = None;
                None
            }
        }
    }

    /// At every failure-watch round, per hosted group: as master, announce
    /// a settled group and then quiet it; wake it and withdraw the
    /// announcement when it is no longer settled or no longer ours.
    pub(super) fn steer_quiet(
        &self,
        g: &QueueGroup,
        m: &Metrics,
        present: &BTreeSet<NodeId>,
        refilling: &BTreeSet<NodeId>,
    ) {
        let group = g.meta.group;
        let q = &self.quiescence();
        let me = self.id();
        let leaving = self.shared().leaving.load(std::sync::atomic::Ordering::Acquire);
        // A stopping node announces nothing new, but keeps its quiet groups
        // quiet until each one moves: waking them all at once (a node
        // leading 6,700 of them) sent heartbeats from every one, which
        // saturated every node, so that the moves ran out of time and what
        // was left stood for election all at once.
        if leaving && m.state == ServerState::Leader && g.hush.is_quiet() {
            return;
        }
        let leading = m.state == ServerState::Leader && !leaving;
        let now_settled = leading && settled(g, m, me, present, refilling);
        let mark = (m.current_term, m.last_log_index);
        let since = {
            let mut s = g.ext.watch.state();
            match s.settled {
                Some((at, was)) if now_settled && was == mark => Some(at),
                _ => {
                    s.settled = now_settled.then(|| (Instant::now(), mark));
                    None
                }
            }
        };
        // A group that holds nothing but its founding (no entry was ever
        // proposed) is a queue just declared, not one used now and then.
        let unused = m.current_term == crate::queue::epoch::FOUNDING_TERM && m.last_log_index == Some(1);
        let Some(since) = since else {
            // Heartbeats until it has been settled a while (the proposer
            // woke it already if an entry came; a master deposed while
            // quiet must have them on should it lead again).
            g.hush.wake();
            // Settled anew: a heartbeat now carries the last commit index
            // to the mirrors (a commit rides on the next append).
            if now_settled {
                let raft = g.raft.clone();
                tokio::spawn(async move {
                    let _ = raft.trigger().heartbeat().await;
                });
            }
            // An unused group is announced at once, for this node's next
            // pings to carry while that heartbeat travels, and goes quiet
            // at the next round: waiting three heartbeat intervals, then a
            // round for the peers to fetch the list, kept each new queue's
            // group sending heartbeats for 1.5 s, most of the appends a
            // declare cost. A group in use is announced only once it has
            // been still for those intervals, since its followers stop
            // their timers while it is announced: a queue used every half
            // second would hold them all the time, and a master cut off
            // would be replaced an election timeout later.
            if now_settled && unused {
                q.announce(group, m.current_term);
            } else {
                q.withdraw(group);
            }
            return;
        };
        let still_for = if unused { 1 } else { SETTLE_HEARTBEATS };
        if since.elapsed() < self.timing().heartbeat * still_for {
            return;
        }
        let gen = q.announce(group, m.current_term);
        let others = m.membership_config.membership().voter_ids().filter(|v| *v != me && present.contains(v));
        if !q.fetched_by_all(gen, others) {
            return;
        }
        g.hush.quiet_if(|| {
            let now = g.raft.metrics().borrow().clone();
            now.state == ServerState::Leader && (now.current_term, now.last_log_index) == mark
        });
    }
}
