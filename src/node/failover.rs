//! What a node does when the replicas of a queue fail: who may stand for
//! election (seniority), re-forming a group that lost its majority
//! (`ha-promote-on-failure: always`), healing replicas of an older epoch, and
//! handing over mastership on a graceful stop. The reasoning is in
//! `docs/reliability.md`; the epoch rules in `queue::epoch`.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use openraft::storage::RaftLogStorage;
use openraft::{
    BasicNode, CommittedLeaderId, Entry, EntryPayload, LogId, Membership, RaftLogReader, ServerState, Vote,
};
use tokio::sync::mpsc;

use super::split::{
    add_defeated, add_formed, defeated, formed_record, formed_record_key, left_through_own_forks, quorum, wall_ms,
    Formed, MajorityStretch, Undecided, Verdict,
};
use super::{Inner, Node, QueueGroup};
use crate::error::{NodeError, ServerError};
use crate::ids::{GroupId, NodeId};
use crate::link::rpc::{RpcRequest, RpcResponse};
use crate::metadata::{policy, MetaState, QueueMeta};
use crate::queue::epoch::{divergence, Epoch, EpochReport, ForkRecord};
use crate::queue::types::Origin;
use crate::queue::{Message, QueueCmd, QueueMachine};
use crate::raft::network::EpochNews;
use crate::raft::state_machine::stored_applied;
use crate::raft::types::{LogStore, Request, TypeConfig};
use mirrorq_storage::{NodeDb, SmSpace, StorageError};

/// How long a ping may take before the peer counts as unreachable.
/// Stand this long after the lost master's lease has run out on the other
/// voters: a vote asked for inside the lease is refused, and the refused
/// candidate would wait a whole election timeout before asking again.
const LEASE_MARGIN: Duration = Duration::from_millis(50);
/// Handed-back messages travel in chunks of at most this many bytes.
const HANDBACK_CHUNK_BYTES: usize = 1 << 20;

/// What failover watches about one replica of a group, kept with it.
pub(super) struct GroupWatch {
    /// When a majority of the group's voters last answered pings, and
    /// since when without a break.
    pub(super) majority: Mutex<MajorityStretch>,
    /// When a master of this replica's epoch last sent it entries or a
    /// heartbeat.
    pub(super) master_heard: Mutex<Option<Instant>>,
    /// AppendEntries calls (entries or heartbeats) received.
    pub(super) appends: std::sync::atomic::AtomicU64,
    /// Since when this replica has known no master.
    pub(super) leaderless_since: Mutex<Option<Instant>>,
    /// Since when the master this replica follows has not answered pings.
    pub(super) master_lost_since: Mutex<Option<Instant>>,
    /// An election is timed to start when the lost master's lease is out.
    pub(super) elect_at: Mutex<Option<Instant>>,
    /// The newer epoch this replica, as master, last could not decide a
    /// split against (its node could not be asked), and when.
    pub(super) undecided: Mutex<Option<(Epoch, Instant)>>,
    /// When this replica started.
    pub(super) started: Instant,
    /// Replicas that answered from a newer epoch of the group, and when
    /// last: they follow no master of ours, however well they answer pings.
    pub(super) in_newer: Mutex<HashMap<NodeId, Instant>>,
    /// As master: since when the group has been settled at (term, last
    /// log index), for `quiescence`.
    pub(super) settled: Mutex<Option<(Instant, super::quiescence::Mark)>>,
    /// As follower: the quiet master last seen in reach, its term, and
    /// when (its node's pings are the group's heartbeats).
    pub(super) quiet_master: Mutex<Option<(NodeId, u64, Instant)>>,
    /// The group's Raft metrics, as the watch last looked at them.
    metrics: Mutex<tokio::sync::watch::Receiver<openraft::RaftMetrics<NodeId, openraft::BasicNode>>>,
    /// Quiet at the watch's last full look, and as of which
    /// `Quiescence::world_of` the group, with whether a majority of voters
    /// was in reach: while neither that nor the group's metrics changed,
    /// the next rounds only extend the majority stretch.
    passed: Mutex<Option<((u64, u64), bool)>>,
}

impl GroupWatch {
    pub(super) fn new(
        metrics: tokio::sync::watch::Receiver<openraft::RaftMetrics<NodeId, openraft::BasicNode>>,
    ) -> Self {
        GroupWatch {
            majority: Mutex::new(MajorityStretch::new(Instant::now())),
            master_heard: Mutex::new(None),
            appends: std::sync::atomic::AtomicU64::new(0),
            leaderless_since: Mutex::new(None),
            master_lost_since: Mutex::new(None),
            elect_at: Mutex::new(None),
            undecided: Mutex::new(None),
            started: Instant::now(),
            in_newer: Mutex::new(HashMap::new()),
            settled: Mutex::new(None),
            quiet_master: Mutex::new(None),
            metrics: Mutex::new(metrics),
            passed: Mutex::new(None),
        }
    }
}

fn epoch_key(group: GroupId) -> String {
    format!("epoch/{group}")
}
fn heal_key(group: GroupId) -> String {
    format!("healing/{group}")
}
pub(super) fn term_floor_key(group: GroupId) -> String {
    format!("term-floor/{group}")
}
/// The epoch this node's replica of `group` is in. Also finishes a heal that
/// a crash interrupted after the hand-back (wiping is idempotent).
///
/// The wiped replica keeps a vote at the highest term it had seen, so this
/// node never leads a term it led before, in any epoch: hand-back origins
/// `(term, node, index)` and fork records name an entry by its leader, and
/// two leaderships of one term by one node could make a hand-back look
/// done, or an entry look shared, when it is not. Raised past that term,
/// the new epoch's master steps down once (the learner answers with the
/// higher vote) and is re-elected above it.
pub(super) fn load_epoch(db: &NodeDb, group: GroupId, me: NodeId) -> Result<Epoch, ServerError> {
    let decode = |b: Vec<u8>, what| mirrorq_storage::keys::decode::<Epoch>(&b, what);
    if let Some(b) = db.get_node_value(&heal_key(group))? {
        let epoch = decode(b, "healing marker")?;
        let raft = |e: openraft::StorageError<NodeId>| ServerError::Raft(e.to_string());
        let log = LogStore::new(db.clone(), group);
        // Durable before the wipe: a crash in between must not lose it.
        let kept = match db.get_node_value(&term_floor_key(group))? {
            Some(b) => mirrorq_storage::keys::decode::<u64>(&b, "term floor")?,
            None => 0,
        };
        let floor = kept.max(log.highest_term().map_err(raft)?);
        db.put_node_value(&term_floor_key(group), &mirrorq_storage::keys::encode(&floor, "term floor")?)?;
        db.drop_group(group)?;
        if floor > 0 {
            log.restore_vote(&Vote::new(floor, me)).map_err(raft)?;
        }
        store_epoch(db, group, epoch)?;
        db.remove_node_value(&heal_key(group))?;
        return Ok(epoch);
    }
    match db.get_node_value(&epoch_key(group))? {
        Some(b) => Ok(decode(b, "group epoch")?),
        None => Ok(Epoch::default()),
    }
}

fn store_epoch(db: &NodeDb, group: GroupId, epoch: Epoch) -> Result<(), StorageError> {
    db.put_node_value(&epoch_key(group), &mirrorq_storage::keys::encode(&epoch, "group epoch")?)
}

/// The mirroring settings in force for a queue.
pub(super) fn ha_of(state: &MetaState, q: &QueueMeta) -> policy::HaPolicy {
    q.policy
        .as_ref()
        .and_then(|n| state.policies.get(n))
        .and_then(|p| policy::ha_policy_of(&p.definition))
        .unwrap_or_default()
}

/// `ids` ordered by seniority: the metadata's replica order first, then any
/// others by id.
fn by_seniority(q: &QueueMeta, ids: &BTreeSet<NodeId>) -> Vec<NodeId> {
    let mut out: Vec<NodeId> = q.replicas.iter().copied().filter(|id| ids.contains(id)).collect();
    out.extend(ids.iter().copied().filter(|id| !q.replicas.contains(id)));
    out
}

/// Who re-forms a group that lost its majority: the most senior voter
/// left, else the most senior wanted replica left. A voter has the group's
/// log up to its last commit; a learner may still be catching up. Campaign
/// seed 745: a voter of a two-voter group restarted, and a learner that had
/// joined 40 ms before, senior by the queue's order, re-formed the queue
/// over the live master.
fn reformer(replicas: &[NodeId], alive_voters: &BTreeSet<NodeId>, alive: &BTreeSet<NodeId>) -> Option<NodeId> {
    let from = if alive_voters.is_empty() { alive } else { alive_voters };
    replicas.iter().copied().find(|id| from.contains(id)).or_else(|| from.first().copied())
}

/// The voters in reach that [`reformer`] picks from. While a membership
/// change is under way (a joint configuration), the voters of the old set
/// in reach, if any: a voter only of the new set may be a learner promoted
/// a moment ago, still behind the last commit.
fn reform_voters(configs: &[BTreeSet<NodeId>], reach: &BTreeSet<NodeId>) -> BTreeSet<NodeId> {
    let old: BTreeSet<NodeId> = configs.first().map(|c| c.intersection(reach).copied().collect()).unwrap_or_default();
    if !old.is_empty() {
        return old;
    }
    configs.iter().flatten().filter(|v| reach.contains(v)).copied().collect()
}

/// Whether the last master a replica knows still leads the queue: it is
/// this replica, or in reach and heard from lately (a quiet master's
/// announcement holds its followers before this is asked), and still a
/// voter. A master that moved the queue away from itself and stepped down
/// answers pings but leads no one; counting it would keep every voter but
/// the most senior from standing while the senior cannot win (a 5-node
/// campaign run waited on it for good). So does a master back from a crash
/// that is not leading until an election says so
/// (`LogStore::step_down_after_crash`), when its log is behind the
/// mirrors' and it cannot win.
fn still_leads(leader: NodeId, me: NodeId, reach: &BTreeSet<NodeId>, voters: &BTreeSet<NodeId>, heard: bool) -> bool {
    (leader == me || (reach.contains(&leader) && heard)) && voters.contains(&leader)
}

/// Why a replica's Raft core no longer runs, if it does not: it quit on
/// an error (its last metrics say which), or it is gone without a word
/// (its metrics' sender dropped, as when its task panicked).
fn core_quit(metrics: &tokio::sync::watch::Receiver<openraft::RaftMetrics<NodeId, BasicNode>>) -> Option<String> {
    if let Err(fatal) = &metrics.borrow().running_state {
        return Some(fatal.to_string());
    }
    metrics.has_changed().is_err().then(|| "the Raft core ended".to_string())
}

/// Make this node's committed vote for itself in `group`, if it holds one,
/// uncommitted, so that the group's next Raft instance here starts as a
/// follower rather than resuming a leadership (only while the group's Raft
/// is stopped). Returns once the vote is durable.
async fn step_down(db: NodeDb, group: GroupId, me: NodeId) -> Result<(), ServerError> {
    let raft = |e: openraft::StorageError<NodeId>| ServerError::Raft(e.to_string());
    let mut log = LogStore::new(db, group);
    match log.read_vote().await.map_err(raft)? {
        Some(v) if v.is_committed() && v.leader_id().voted_for() == Some(me) => {
            let vote = Vote::new(v.leader_id().get_term(), me);
            // Its sync blocks: not on a runtime thread.
            tokio::task::spawn_blocking(move || log.restore_vote(&vote))
                .await
                .map_err(|e| ServerError::Raft(e.to_string()))?
                .map_err(raft)
        }
        _ => Ok(()),
    }
}

/// Messages handed back together: those one old-epoch entry published.
type Batch = (Option<Origin>, Vec<Message>);

/// What a log entry published: its origin and its messages, each marked
/// if it was a hand-back (stored outside the seq range) rather than a publish.
fn publishes(e: &Entry<TypeConfig>) -> (Origin, Vec<(&Message, bool)>) {
    let origin = (e.log_id.leader_id.term, e.log_id.leader_id.node_id, e.log_id.index);
    let mut msgs = Vec::new();
    if let EntryPayload::Normal(Request::Queue(cmds)) = &e.payload {
        for c in cmds.iter() {
            match c {
                QueueCmd::Enqueue { msgs: m } | QueueCmd::EnqueueExpiring { msgs: m, .. } => {
                    msgs.extend(m.iter().map(|m| (m, false)))
                }
                QueueCmd::Handback { msgs: m, .. } => msgs.extend(m.iter().map(|m| (m, true))),
                _ => {}
            }
        }
    }
    (origin, msgs)
}

/// Marks a group busy (re-forming, healing, moving its master) until dropped.
pub(super) struct Busy<'a> {
    set: &'a std::sync::Mutex<HashSet<GroupId>>,
    group: GroupId,
}

impl<'a> Busy<'a> {
    /// `None` if someone else has the group.
    pub(super) fn take(set: &'a std::sync::Mutex<HashSet<GroupId>>, group: GroupId) -> Option<Self> {
        // Not `then_some`: it would build (and drop) a `Busy` even when the
        // group is taken, and that drop would lock `set` again while this
        // lock is held (a deadlock) and free the other holder's claim.
        let fresh = set.lock().expect("poisoned").insert(group);
        fresh.then(|| Busy { set, group })
    }
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.set.lock().expect("poisoned").remove(&self.group);
    }
}

impl Inner {
    /// Our replica's log of `group` as a record of its history.
    pub(super) async fn history(&self, group: GroupId) -> Option<ForkRecord> {
        let g = self.groups.read().expect("poisoned").get(&group).cloned()?;
        let mut log = LogStore::new(self.db.clone(), group);
        let state = log.get_log_state().await.ok()?;
        let ids = log.log_ids().ok()?;
        Some(ForkRecord::from_log(g.epoch, state.last_purged_log_id, ids))
    }

    /// Our replica's epoch of `group`, with its fork record if the replica
    /// has it, and the master of that epoch in reach as our replica knows it.
    pub(super) fn epoch_report(&self, group: GroupId) -> Option<EpochReport> {
        let g = self.groups.read().expect("poisoned").get(&group).cloned()?;
        let record = QueueMachine::fork_record(&SmSpace::new(self.db.clone(), group)).ok()?;
        // Formed here: the record as kept beside the log, if its entry was
        // never committed (a stop right after the re-form); without it the
        // other side would wait for a record no one has, both serving.
        let record = record.filter(|r| r.epoch == g.epoch).or_else(|| formed_record(&self.db, group, g.epoch));
        let m = g.raft.metrics().borrow().clone();
        let heard = *g.watch.master_heard.lock().expect("poisoned");
        let master = match m.state {
            ServerState::Leader => Some(self.id),
            _ => m.current_leader.filter(|_| heard.is_some_and(|t| t.elapsed() < self.timing.failure_timeout)),
        };
        Some(EpochReport { epoch: g.epoch, record, master })
    }
}

impl Node {
    pub(super) fn spawn_epoch_watch(&self, mut rx: mpsc::UnboundedReceiver<EpochNews>) {
        let node = self.clone();
        tokio::spawn(async move {
            loop {
                let news = tokio::select! {
                    _ = node.inner.stop.cancelled() => return,
                    n = rx.recv() => match n { Some(n) => n, None => return },
                };
                let stale = match node.inner.groups.read().expect("poisoned").get(&news.group) {
                    Some(g) if g.epoch < news.epoch => {
                        g.watch.in_newer.lock().expect("poisoned").insert(news.from, Instant::now());
                        true
                    }
                    _ => false,
                };
                if stale {
                    let node = node.clone();
                    tokio::spawn(async move { node.heal(news).await });
                }
            }
        });
    }

    /// Peers answering pings, by a round at most a few hundred
    /// milliseconds old (`peers`).
    async fn reachable(&self, state: &MetaState) -> BTreeSet<NodeId> {
        if let Some(reach) = self.inner.peers.fresh_reach() {
            return reach;
        }
        let peers: Vec<NodeId> = state.nodes.keys().copied().filter(|id| *id != self.id()).collect();
        let round = self.inner.peers.round(self, &peers).await;
        for id in &round.dead {
            self.after_death(*id).await;
        }
        if round.changed {
            self.inner.quiescence.world_changed();
        }
        round.reach
    }

    /// Called on every reconcile: decide, per hosted group, who may stand
    /// for election, and whether to re-form a group that lost its majority.
    pub(super) async fn watch_failures(&self, state: &MetaState) {
        let listed_at = self.inner.removals.load(Ordering::Acquire);
        let groups: Vec<Arc<QueueGroup>> = self.inner.groups.read().expect("poisoned").values().cloned().collect();
        self.watch_groups(state, groups, Some(listed_at)).await
    }

    /// The failure watch over `groups`, a list taken when it began: several
    /// watches run at once (each lost link starts one), so a group another
    /// has re-formed or rejoined meanwhile is skipped here and refused by
    /// `take_out` further on. `listed_at`: `Inner::removals` read before
    /// the list was taken; a group in it stops being current only when one
    /// is taken out of the table (or the node stops), so until then the
    /// table need not be looked up for each group (`None`: look each up).
    pub(super) async fn watch_groups(&self, state: &MetaState, groups: Vec<Arc<QueueGroup>>, listed_at: Option<u64>) {
        if groups.is_empty() {
            return;
        }
        let mut reach = self.reachable(state).await;
        let mut present = self.present(state);
        let refilling = self.inner.quiescence.refilling_peers();
        let timing = &self.inner.timing;
        for g in groups {
            if self.inner.stop.is_cancelled() {
                return;
            }
            if listed_at != Some(self.inner.removals.load(Ordering::Acquire)) && !self.inner.is_current(&g) {
                continue;
            }
            let world = self.inner.quiescence.world_of(g.meta.group);
            let passed = g.watch.passed.lock().expect("poisoned").take();
            if let Some((was, majority)) = passed {
                let (metrics_changed, state_now) = {
                    let m = g.watch.metrics.lock().expect("poisoned");
                    let state_now = m.borrow().state;
                    (m.has_changed().unwrap_or(true), state_now)
                };
                let unchanged = was == world && !self.inner.leaving.load(Ordering::Acquire) && !metrics_changed;
                let still_quiet = g.hush.is_quiet() || state_now != ServerState::Leader;
                if unchanged && still_quiet {
                    // Watched without a gap, as the split rule needs.
                    let mut stretch = g.watch.majority.lock().expect("poisoned");
                    stretch.observe(majority, Instant::now(), wall_ms(), timing.failure_timeout);
                    drop(stretch);
                    *g.watch.passed.lock().expect("poisoned") = Some((was, majority));
                    continue;
                }
            }
            let quit = core_quit(&g.watch.metrics.lock().expect("poisoned"));
            if let Some(why) = quit {
                self.fail_replica(g, why, &reach).await;
                continue;
            }
            // By name: no table of every queue built at every round.
            let Some(q) = state.queues.get(&g.meta.name).filter(|q| q.group == g.meta.group) else { continue };
            let ha = ha_of(state, q);
            let m = g.watch.metrics.lock().expect("poisoned").borrow_and_update().clone();
            let voters: BTreeSet<NodeId> = m.membership_config.membership().voter_ids().collect();
            // A learner that is a wanted replica may have every confirmed
            // message too (confirms wait for caught-up learners), so it may
            // carry the queue on when no voter is left.
            let members: BTreeSet<NodeId> = m
                .membership_config
                .membership()
                .nodes()
                .map(|(id, _)| *id)
                .filter(|id| voters.contains(id) || q.replicas.contains(id))
                .collect();
            if !members.contains(&self.id()) {
                continue;
            }
            let majority = quorum(m.membership_config.membership().get_joint_config(), |v| reach.contains(&v));
            let alive: BTreeSet<NodeId> = members.intersection(&reach).copied().collect();
            let now = Instant::now();
            let seen = {
                let mut stretch = g.watch.majority.lock().expect("poisoned");
                stretch.observe(majority, now, wall_ms(), timing.failure_timeout);
                stretch.seen()
            };
            let alive_voter_set: BTreeSet<NodeId> = voters.intersection(&reach).copied().collect();
            let senior_voter = by_seniority(q, &alive_voter_set).first().copied();
            self.steer_quiet(&g, &m, &present, &refilling);
            let hold = if m.state != ServerState::Leader {
                self.held_by_quiet_master(&g, &m, &voters, &reach, now)
            } else {
                None
            };
            let held = hold.is_some();
            if held {
                // A quiet group's master answers for it: its node answers
                // pings and announces the group in our term. Its timers
                // have nothing to do until then.
                g.raft.runtime_config().elect(false);
                g.raft.runtime_config().tick(false);
                *g.watch.leaderless_since.lock().expect("poisoned") = None;
                *g.watch.master_lost_since.lock().expect("poisoned") = None;
            }

            // Seniority: while the master is away, only the most senior
            // replica still reachable stands for election, so it wins
            // whenever its log is up to date (a synchronised mirror's is). If
            // no one has won after a while, everyone may stand again: a
            // lagging senior must not keep the queue without a master.
            if !held && !g.hush.is_quiet() {
                g.raft.runtime_config().tick(true);
            }
            if !held && m.state != ServerState::Leader && !self.inner.leaving.load(Ordering::Acquire) {
                // Leaderless also while the last master known is out of
                // reach: a senior replica that never received the group's
                // log (it was down when the queue was declared) knows no
                // members and never stands, and a synchronised mirror
                // deferring to it would leave the queue without a master
                // until the old one came back.
                let leaderless_since = {
                    let mut l = g.watch.leaderless_since.lock().expect("poisoned");
                    // A leader sends at least a heartbeat per interval;
                    // an election timeout without one is a master that
                    // no longer leads, as openraft's own timer counts it.
                    let heard = g
                        .watch
                        .master_heard
                        .lock()
                        .expect("poisoned")
                        .is_some_and(|t| now.duration_since(t) < timing.election_max);
                    match m.current_leader.filter(|l| still_leads(*l, self.id(), &reach, &voters, heard)) {
                        Some(_) => *l = None,
                        None => {
                            l.get_or_insert(now);
                        }
                    }
                    *l
                };
                let leaderless_long = leaderless_since.is_some_and(|t| now.duration_since(t) > timing.election_max * 3);
                // A replica still fetching bodies never stands: it cannot
                // serve what it does not have.
                let complete = g.plan.borrow().is_none();
                let may = complete && !self.inner.is_quiet(q.group);
                let stand = may && (senior_voter == Some(self.id()) || leaderless_long);
                g.raft.runtime_config().elect(stand);
                // A follower of a master that was alive waits out the
                // master's lease and then a whole election timeout more
                // before standing (openraft), 3-4 s by default. The pings
                // already tell the master is gone: stand as soon as the lease
                // has run out on the other voters too. Their lease runs from
                // the master's last heartbeat, so from no later than its
                // death; when the link to it broke after its last answered
                // ping (a killed process's sockets close at once), that
                // moment bounds its death, else the moment the pings failed.
                let lost_since = {
                    let mut l = g.watch.master_lost_since.lock().expect("poisoned");
                    match m.current_leader.filter(|leader| !reach.contains(leader)) {
                        Some(leader) => Some(*l.get_or_insert_with(|| {
                            let seen = self.inner.peers.last_seen(leader);
                            match (self.inner.link_lost_at(leader), seen) {
                                (Some(lost), Some(seen)) if lost > seen => lost.min(now),
                                _ => now,
                            }
                        })),
                        None => {
                            *l = None;
                            None
                        }
                    }
                };
                if let (true, Some(lost), Some(leader)) =
                    (stand && m.state != ServerState::Candidate, lost_since, m.current_leader)
                {
                    // A master whose process is gone holds no lease: the
                    // other voters forget it as they see the death
                    // (`liveness`), and whoever has not yet refuses only
                    // the first ask.
                    let at = if self.is_dead(leader) { now } else { lost + timing.election_max + LEASE_MARGIN };
                    self.elect_after_lease(&g, leader, at);
                }
            }

            // Quiet, with a majority in reach (nothing here is waiting for
            // a timeout to run out): the next rounds pass it over quickly
            // while nothing changes.
            let quiet = (m.state == ServerState::Leader && g.hush.is_quiet()) || hold == Some(true);
            if quiet && majority {
                *g.watch.passed.lock().expect("poisoned") = Some((world, majority));
            }

            // Re-form: no majority reachable for the failure timeout, the
            // policy allows it, and we are the most senior replica left.
            // Every voter out of reach seen dead (its port refuses a dial)
            // is no partition that may heal into a second master: no need
            // to wait (the classic demo serves at once).
            // Dead means gone after being up in this node's life: a peer
            // not heard from since this node started may just not be up
            // yet (every node back from a whole-cluster power cut), and
            // re-forming alone then forks the queue on whichever node
            // came up first, which a damaged dir set aside can strand. It
            // was up if it answered a ping or a link to it broke; after a
            // failure timeout here, a refusing port is a death either way.
            let all_dead = voters.iter().filter(|v| !reach.contains(v)).all(|v| {
                let link_broke = self.inner.link_lost_at(*v).is_some();
                self.inner.peers.gone_for_sure(*v, link_broke, timing.failure_timeout)
            });
            let wait = if all_dead { Duration::ZERO } else { timing.failure_timeout };
            if now.duration_since(seen) >= wait
                && !majority
                && reformer(
                    &q.replicas,
                    &reform_voters(m.membership_config.membership().get_joint_config(), &reach),
                    &alive,
                ) == Some(self.id())
                && ha.promote_on_failure_always
                && g.plan.borrow().is_none()
            {
                match self.reform(g, q.clone(), state).await {
                    Ok(false) => {}
                    Ok(true) => {
                        tracing::warn!(queue = %q.name, ?voters, ?alive, "no majority of the queue's replicas (out of reach for the failure timeout, or dead): re-formed it");
                        self.inner.metrics.queue_reforms.inc();
                        self.inner.told.cleared(q.group, "re-form");
                    }
                    Err(e) => {
                        if self.inner.repeated(q.group, "re-form", &e.to_string()) {
                            tracing::error!(queue = %q.name, error = %e, "re-forming the queue failed; retrying (told once until it changes)");
                        }
                    }
                }
                // A re-form may take seconds: the groups after it are judged
                // on fresh pings, not on this round's.
                reach = self.reachable(state).await;
                present = self.present(state);
            }
        }
    }

    /// Fail this node's replica `g`, whose Raft core quit (`why`), and
    /// not the node: its other replicas go on. A quit core answers nothing
    /// and its metrics stand still, so a quiet master would go on
    /// announcing the group and its followers would wait for it for good.
    /// The replica is taken out, which withdraws that announcement; it is
    /// shut down, and the reconciler starts it again from its disk. A
    /// replica that led starts again as a follower (its vote for itself
    /// no longer committed, as after a crash) that does not stand for a
    /// while, and asks the most senior other voter in `reach` to stand
    /// now: the others would wait for this senior one first, and a fault
    /// that persists must not make it take the mastership back, only to
    /// quit again.
    async fn fail_replica(&self, g: Arc<QueueGroup>, why: String, reach: &BTreeSet<NodeId>) {
        let (group, me) = (g.meta.group, self.id());
        // A re-form or a heal holds it: it replaces the replica anyway.
        let Some(_busy) = Busy::take(&self.inner.busy, group) else { return };
        if !self.inner.take_out(&g) {
            return;
        }
        if self.inner.repeated(group, "core", &why) {
            tracing::error!(queue = %g.meta.name, error = %why, "the queue replica's Raft core quit: the replica stops, starts again as a follower and stands for no election for a while (told once until it changes)");
        }
        self.inner.quiet.lock().expect("poisoned").insert(group, Instant::now() + self.inner.timing.election_max * 4);
        let m = g.watch.metrics.lock().expect("poisoned").borrow().clone();
        g.stop.cancel();
        g.shut_down().await;
        if let Err(e) = step_down(self.inner.db.clone(), group, me).await {
            tracing::error!(queue = %g.meta.name, error = %e, "cannot step the failed replica down; it may lead again when it starts");
        }
        if m.current_leader != Some(me) {
            return;
        }
        let others: BTreeSet<NodeId> =
            m.membership_config.membership().voter_ids().filter(|v| *v != me && reach.contains(v)).collect();
        let Some(to) = by_seniority(&g.meta, &others).first().copied() else { return };
        let inner = self.inner.clone();
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_secs(2);
            let _ = inner.call(to, &RpcRequest::Elect { group, from: me, leaving: false }, deadline).await;
        });
    }

    /// Stand for election at `at` (now if it has passed; an earlier `at`
    /// given meanwhile moves it), if the master is still lost then and no
    /// one has won meanwhile: timed rather than left to the next reconcile,
    /// which may come half a second late. Against a master whose process is
    /// gone, ask again while no one wins, for up to an election timeout: a
    /// voter that has not yet seen the death still keeps its lease and
    /// refuses.
    fn elect_after_lease(&self, g: &Arc<QueueGroup>, lost_leader: NodeId, at: Instant) {
        {
            let mut slot = g.watch.elect_at.lock().expect("poisoned");
            match *slot {
                Some(t) if t <= at => return,
                Some(_) => {
                    *slot = Some(at);
                    return;
                }
                None => *slot = Some(at),
            }
        }
        let g = g.clone();
        let node = self.clone();
        tokio::spawn(async move {
            let stop = node.inner.stop.clone();
            loop {
                let Some(at) = *g.watch.elect_at.lock().expect("poisoned") else { return };
                let now = Instant::now();
                if now >= at {
                    break;
                }
                // In steps, so that an earlier time set meanwhile is kept.
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep((at - now).min(Duration::from_millis(50))) => {}
                }
            }
            // Until the lease would have run out on every voter anyway: a
            // voter slow to see the death (a loaded machine) refuses a few
            // asks, and after the last one openraft's own timer would wait
            // out a whole election timeout more.
            let until = Instant::now() + node.inner.timing.election_max;
            let mut ask = 0u32;
            while Instant::now() < until {
                ask += 1;
                // A candidate knows no leader, so the reconcile has stopped
                // counting the master as lost by the next ask: a later ask
                // goes on the death alone.
                let lost = if ask == 1 {
                    g.watch.master_lost_since.lock().expect("poisoned").is_some()
                } else {
                    node.is_dead(lost_leader)
                };
                if stop.is_cancelled() || !lost {
                    break;
                }
                let m = g.raft.metrics().borrow().clone();
                let waiting = match m.state {
                    ServerState::Follower => m.current_leader == Some(lost_leader),
                    // Still asking since the last round: it was refused.
                    ServerState::Candidate => ask > 1,
                    _ => false,
                };
                if !waiting {
                    break;
                }
                g.raft.runtime_config().tick(true);
                let _ = g.raft.trigger().elect().await;
                if !node.is_dead(lost_leader) {
                    break;
                }
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tokio::time::sleep(super::liveness::ELECT_RETRY * ask.min(3)) => {}
                }
            }
            *g.watch.elect_at.lock().expect("poisoned") = None;
        });
    }

    /// Make this replica the only voter of a new epoch of the group, with
    /// its whole log (committed or not: anything may have been confirmed).
    /// `false`: someone else is re-forming or healing the group, or already
    /// replaced `g`, so nothing was done.
    async fn reform(&self, g: Arc<QueueGroup>, q: QueueMeta, state: &MetaState) -> Result<bool, ServerError> {
        let group = q.group;
        let Some(_busy) = Busy::take(&self.inner.busy, group) else { return Ok(false) };
        if !self.inner.take_out(&g) {
            return Ok(false);
        }
        g.stop.cancel();
        g.shut_down().await;

        let raft_err = |e: openraft::StorageError<NodeId>| ServerError::Raft(e.to_string());
        let mut log = LogStore::new(self.inner.db.clone(), group);
        let log_state = log.get_log_state().await.map_err(raft_err)?;
        let ids = log.log_ids().map_err(raft_err)?;
        let term = log.highest_term().map_err(raft_err)?.max(g.epoch.term) + 1;
        let me = self.id();
        let epoch = Epoch { term, node: me };
        let mut record = ForkRecord::from_log(epoch, log_state.last_purged_log_id, ids);
        record.formed_ms = wall_ms();
        let index = log_state.last_log_id.map_or(0, |l| l.index + 1);
        let members = Membership::new(
            vec![BTreeSet::from([me])],
            BTreeMap::from([(me, BasicNode { addr: self.inner.addr.clone() })]),
        );
        let entry: Entry<TypeConfig> = Entry {
            log_id: LogId::new(CommittedLeaderId::new(term, me), index),
            payload: EntryPayload::Membership(members),
        };
        // Operations in entries not applied here were never answered (replies
        // follow commit), so a get there must not count as a delivery in the
        // new epoch: keep only what publishes. (Publishes may have been
        // confirmed: confirms wait for the synchronised replicas' disks, not
        // for commit.)
        let applied = stored_applied(&SmSpace::new(self.inner.db.clone(), group))?.map_or(0, |l| l.index + 1);
        let mut reader = log.get_log_reader().await;
        let mut entries: Vec<Entry<TypeConfig>> = Vec::new();
        for mut e in reader.try_get_log_entries(applied..).await.map_err(raft_err)? {
            if let EntryPayload::Normal(Request::Queue(cmds)) = &mut e.payload {
                let before = cmds.len();
                let cmds = std::sync::Arc::make_mut(cmds);
                cmds.retain(|c| c.publishes() || matches!(c, QueueCmd::Fork(_)));
                if cmds.len() != before {
                    entries.push(e);
                }
            }
        }
        entries.push(entry);
        // Before the epoch itself: a replica of the old group that kept its
        // majority across this moment keeps the queue when the two meet.
        let c = QueueMachine::stored_counters(&SmSpace::new(self.inner.db.clone(), group))?;
        add_formed(&self.inner.db, group, Formed { epoch, from: g.epoch, next_seq: c.next_seq, next_tag: c.next_tag })?;
        self.inner
            .db
            .put_node_value(&formed_record_key(group), &mirrorq_storage::keys::encode(&record, "formed record")?)?;
        let epoch_value = (epoch_key(group), mirrorq_storage::keys::encode(&epoch, "group epoch")?);
        log.refound(&Vote::new_committed(term, me), entries, (&epoch_value.0, epoch_value.1))
            .await
            .map_err(raft_err)?;
        self.start_group(q.clone(), state).await?;
        tracing::warn!(queue = %q.name, %epoch, from_index = index, "queue re-formed on this replica alone; other replicas rejoin when they return");

        // Record where the new epoch forked, for the replicas that return.
        let raft = self.inner.raft_of(group).ok_or(ServerError::Raft("re-formed group vanished".into()))?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match raft.client_write(Request::Queue(std::sync::Arc::new(vec![QueueCmd::Fork(record.clone())]))).await {
                Ok(_) => return Ok(true),
                Err(e) if Instant::now() > deadline => return Err(ServerError::Raft(e.to_string())),
                Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
            }
        }
    }

    /// A peer is in a newer epoch of a group we host. If our group kept its
    /// majority from before that epoch formed, that epoch is a minority's
    /// fork: it yields to us. Otherwise hand back what that epoch lacks,
    /// wipe our replica and rejoin it as a new mirror.
    async fn heal(&self, news: EpochNews) {
        let group = news.group;
        // Undecided a moment ago about this epoch: every message of the
        // fork brings news of it, and asking again at each would hold the
        // group busy (no master move, no graceful hand-over) all along.
        let asked = self
            .inner
            .groups
            .read()
            .expect("poisoned")
            .get(&group)
            .map(|g| *g.watch.undecided.lock().expect("poisoned"));
        if let Some(Some((epoch, at))) = asked {
            if epoch == news.epoch && at.elapsed() < self.inner.timing.failure_timeout {
                return;
            }
        }
        let Some(_busy) = Busy::take(&self.inner.busy, group) else { return };
        let Some(g) = self.inner.groups.read().expect("poisoned").get(&group).cloned() else { return };
        if g.epoch >= news.epoch {
            return;
        }
        let q = g.meta.clone();
        let io = |e: StorageError| tracing::error!(queue = %q.name, error = %e, "cannot record a defeated epoch");
        match defeated(&self.inner.db, group) {
            // Judged a minority's fork before; unless our own group has
            // since left for newer epochs (a verdict on disk must not hold a
            // master alone in an epoch its mirrors left).
            Ok(d) if d.contains(&news.epoch) && self.majority_still_ours(&g) => {
                return self.tell_to_yield(&g, news).await
            }
            Ok(_) => {}
            Err(e) => return io(e),
        }
        let verdict = self.split_verdict(&g, news).await;
        // Asking took a while: the replica may have been removed meanwhile
        // (the queue deleted or moved away), and a verdict must not outlive it.
        if !self.inner.is_current(&g) {
            return;
        }
        match verdict {
            Verdict::Defer => return,
            Verdict::Undecided(why) => {
                *g.watch.undecided.lock().expect("poisoned") = Some((news.epoch, Instant::now()));
                let what = format!("epoch {} formed by node {}: {why:?}", news.epoch, news.epoch.node);
                if self.inner.repeated(group, "split-undecided", &what) {
                    match why {
                        Undecided::CannotAsk => {
                            tracing::warn!(queue = %q.name, ours = %g.epoch, theirs = %news.epoch, from = news.from, "a newer epoch of the queue exists, but none of its replicas that answer can tell when it formed: this group keeps its majority and goes on serving until one can (told once)")
                        }
                        Undecided::NoMaster => {
                            tracing::warn!(queue = %q.name, ours = %g.epoch, theirs = %news.epoch, from = news.from, "a newer epoch of the queue exists but has no master to hand back to; waiting for one, or for this group's master to decide (told once)")
                        }
                    }
                }
                return;
            }
            Verdict::Keep => {
                self.inner.told.cleared(group, "split-undecided");
                tracing::warn!(queue = %q.name, ours = %g.epoch, theirs = %news.epoch, from = news.from, "a minority re-formed the queue while this group kept its majority: its epoch yields to ours");
                if let Err(e) = add_defeated(&self.inner.db, group, news.epoch) {
                    return io(e);
                }
                return self.tell_to_yield(&g, news).await;
            }
            Verdict::Heal => self.inner.told.cleared(group, "split-undecided"),
        }
        tracing::warn!(queue = %q.name, ours = %g.epoch, theirs = %news.epoch, from = news.from, "replica is in an older epoch: healing");
        self.rejoin(g, news, false).await;
    }

    /// Our replica is in `defeated`, a minority's fork; the group of
    /// `winner` (whose replica on `from` told us) kept its majority: hand
    /// back to it what it may lack and rejoin it.
    pub(super) async fn yield_to(&self, group: GroupId, defeated: Epoch, winner: Epoch, from: NodeId) {
        let Some(_busy) = Busy::take(&self.inner.busy, group) else { return };
        let Some(g) = self.inner.groups.read().expect("poisoned").get(&group).cloned() else { return };
        if g.epoch != defeated {
            return;
        }
        tracing::warn!(queue = %g.meta.name, ours = %g.epoch, winner = %winner, from, "this replica's epoch is a minority's fork and yields to the group that kept its majority");
        self.rejoin(g, EpochNews { group, epoch: winner, from }, true).await;
    }

    /// Stop our replica of `g`, hand back to the master of `news.epoch`
    /// what that epoch may lack, wipe the replica and restart it in that
    /// epoch. `yielding`: the target epoch is the group our fork came
    /// from, whose history is read from its live log (it has no fork
    /// record of its own).
    pub(super) async fn rejoin(&self, g: Arc<QueueGroup>, news: EpochNews, yielding: bool) {
        let group = news.group;
        let q = g.meta.clone();
        if !self.inner.take_out(&g) {
            return;
        }
        g.stop.cancel();
        g.shut_down().await;
        tracing::info!(queue = %q.name, "replica stopped to rejoin another epoch");

        let mut news = news;
        let result: Result<(), NodeError> = async {
            // The hand-back goes to the newest epoch we hear of; our log is
            // untouched until it is taken, so starting over is safe.
            loop {
                let fork = left_through_own_forks(&self.inner.db, group, g.epoch, news.epoch).filter(|_| yielding);
                let batches = match fork {
                    // We formed the fork: what we stored since is ours alone.
                    Some(f) => self.stored_since_fork(group, f).await?,
                    None => {
                        let record = if yielding {
                            self.fetch_history(group, news).await
                        } else {
                            self.fetch_fork(group, news).await
                        };
                        tracing::info!(queue = %q.name, epoch = %news.epoch, found = record.is_some(), "history of the epoch to join");
                        self.handback_set(group, record.as_ref()).await?
                    }
                };
                let count: usize = batches.iter().map(|b| b.1.len()).sum();
                match self.send_handback(&q, news, batches).await? {
                    None => {
                        tracing::warn!(queue = %q.name, handed_back = count, epoch = %news.epoch, "messages handed back");
                        break;
                    }
                    Some(newer) if yielding => {
                        return Err(NodeError::Unavailable(format!(
                            "the group to yield to moved on to epoch {}; retrying from news of it",
                            newer.epoch
                        )))
                    }
                    Some(newer) => news = newer,
                }
            }
            let db = &self.inner.db;
            let io = |e: StorageError| NodeError::Unavailable(e.to_string());
            db.put_node_value(&heal_key(group), &mirrorq_storage::keys::encode(&news.epoch, "healing marker").map_err(io)?)
                .map_err(io)?;
            load_epoch(db, group, self.id()).map_err(|e| NodeError::Unavailable(e.to_string()))?;
            Ok(())
        }
        .await;
        match &result {
            Ok(()) => {
                self.inner.metrics.queue_rejoins.inc();
                self.inner.told.cleared(group, "rejoin");
            }
            Err(e) => {
                if self.inner.repeated(group, "rejoin", &e.to_string()) {
                    tracing::error!(queue = %q.name, error = %e, "rejoining failed; the replica restarts in its own epoch and retries (told once until it changes)");
                }
            }
        }
        let state = self.metadata();
        if let Err(e) = self.start_group(q.clone(), &state).await {
            tracing::error!(queue = %q.name, error = %e, "cannot restart the queue replica after rejoining");
        }
    }

    /// What the (stopped) replica that formed a fork holds that the group
    /// it forked from lacks: messages stored since the fork, and publishes
    /// in entries not applied here.
    async fn stored_since_fork(&self, group: GroupId, f: Formed) -> Result<Vec<Batch>, NodeError> {
        let io = |e: &dyn std::fmt::Display| NodeError::Unavailable(e.to_string());
        let db = self.inner.db.clone();
        let space = SmSpace::new(db.clone(), group);
        let mut out = vec![(None, QueueMachine::stored_since(&space, f.next_seq, f.next_tag).map_err(|e| io(&e))?)];
        let start = stored_applied(&space).map_err(|e| io(&e))?.map_or(0, |l| l.index + 1);
        let mut log = LogStore::new(db, group);
        let mut reader = log.get_log_reader().await;
        for e in reader.try_get_log_entries(start..).await.map_err(|e| io(&e))? {
            let (origin, msgs) = publishes(&e);
            if !msgs.is_empty() {
                out.push((Some(origin), msgs.into_iter().map(|(m, _)| m.clone()).collect()));
            }
        }
        out.retain(|b| !b.1.is_empty());
        Ok(out)
    }

    /// Whom to ask about the newer epoch of `news`, in order: the node that
    /// told us, the epoch's former, then the queue's other replicas.
    pub(super) fn asked_about(&self, q: &QueueMeta, news: EpochNews) -> Vec<NodeId> {
        let mut peers: Vec<NodeId> = Vec::new();
        for p in [news.from, news.epoch.node].into_iter().chain(q.replicas.iter().copied()) {
            if p != self.id() && !peers.contains(&p) {
                peers.push(p);
            }
        }
        peers
    }

    /// The history of `news.epoch` from a replica of it: its live log's
    /// leader ids. `None` if no one answers (then everything is handed back).
    async fn fetch_history(&self, group: GroupId, news: EpochNews) -> Option<ForkRecord> {
        let q = self.metadata().queues.values().find(|q| q.group == group).cloned()?;
        for peer in self.asked_about(&q, news) {
            let limit = Instant::now() + Duration::from_secs(5);
            if let Ok(RpcResponse::History(Some(rec))) =
                self.inner.call(peer, &RpcRequest::History { group }, limit).await
            {
                if rec.epoch == news.epoch {
                    return Some(rec);
                }
            }
        }
        None
    }

    /// Ask the peer that told us (then the other replicas) for the newer
    /// epoch's fork record. `None` if no one has it: then everything we hold
    /// is handed back.
    async fn fetch_fork(&self, group: GroupId, news: EpochNews) -> Option<ForkRecord> {
        let q = self.metadata().queues.values().find(|q| q.group == group).cloned()?;
        let peers = self.asked_about(&q, news);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let answers = self.ask_forks(group, &peers).await;
            if let Some(rec) = answers.into_iter().filter_map(|(_, a)| a.record).find(|rec| rec.epoch >= news.epoch) {
                return Some(rec);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        None
    }

    /// What each of `peers`' replica of `group` tells of its epoch, asked
    /// all at once; those that do not answer in a second are left out.
    pub(super) async fn ask_forks(&self, group: GroupId, peers: &[NodeId]) -> Vec<(NodeId, EpochReport)> {
        let limit = Instant::now() + Duration::from_secs(1);
        let req = RpcRequest::Fork { group };
        let answers = futures::future::join_all(peers.iter().map(|p| self.inner.call(*p, &req, limit))).await;
        peers
            .iter()
            .zip(answers)
            .filter_map(|(p, a)| match a {
                Ok(RpcResponse::Fork(report)) => report.map(|r| (*p, r)),
                _ => None,
            })
            .collect()
    }

    /// Every message this (stopped) replica holds that the epoch described
    /// by `record` may lack, grouped by the log entry that published it:
    /// live messages published after the point where the histories part,
    /// and every publish in log entries not applied here.
    async fn handback_set(&self, group: GroupId, record: Option<&ForkRecord>) -> Result<Vec<Batch>, NodeError> {
        let io = |e: &dyn std::fmt::Display| NodeError::Unavailable(e.to_string());
        let db = self.inner.db.clone();
        let space = SmSpace::new(db.clone(), group);
        let mut log = LogStore::new(db, group);
        let log_state = log.get_log_state().await.map_err(|e| io(&e))?;
        let ids = log.log_ids().map_err(|e| io(&e))?;
        let shared = record.and_then(|r| divergence(r, log_state.last_purged_log_id, &ids));
        let applied = stored_applied(&space).map_err(|e| io(&e))?.map(|l| l.index);
        let mut reader = log.get_log_reader().await;
        let mut out = Vec::new();
        // Applied past the shared point: of what those entries published,
        // what is still live here.
        if let Some(a) = applied.filter(|a| shared.is_none_or(|p| p < *a)) {
            let purged = log_state.last_purged_log_id.map(|l| l.index);
            match shared {
                Some(p) if purged.is_none_or(|x| x <= p) => {
                    let entries = reader.try_get_log_entries(p + 1..=a).await.map_err(|e| io(&e))?;
                    // Which of these entries' messages are still live here,
                    // by content: an entry's publishes do not map to seqs
                    // by counting (a publish refused by reject-publish takes
                    // none). A live message is always found; an identical
                    // twin can only make a consumed one go back too (a
                    // duplicate, never a loss).
                    let mut live_here: HashMap<&Message, usize> = HashMap::new();
                    let stored = QueueMachine::stored_from(&space, 0).map_err(|e| io(&e))?;
                    for m in &stored {
                        *live_here.entry(m).or_default() += 1;
                    }
                    for e in &entries {
                        let (origin, msgs) = publishes(e);
                        let mut live = Vec::new();
                        for (m, _) in msgs {
                            if let Some(n) = live_here.get_mut(m).filter(|n| **n > 0) {
                                *n -= 1;
                                live.push(m.clone());
                            }
                        }
                        if !live.is_empty() {
                            out.push((Some(origin), live));
                        }
                    }
                }
                // The entries are gone: everything live goes back.
                _ => out.push((None, QueueMachine::stored_from(&space, 0).map_err(|e| io(&e))?)),
            }
        }
        // Not applied here (not known to be committed, maybe confirmed):
        // what each publish would have stored, from a replay on the stored
        // state (a publish refused by reject-publish was never confirmed and
        // must not appear), from the first entry not applied on.
        let start = [shared, applied].into_iter().flatten().max().map_or(0, |i| i + 1);
        let first = applied.map_or(0, |a| a + 1);
        let unapplied = reader.try_get_log_entries(first..).await.map_err(|e| io(&e))?;
        let cmds: Vec<Vec<QueueCmd>> = unapplied
            .iter()
            .map(|e| match &e.payload {
                EntryPayload::Normal(Request::Queue(c)) => c.to_vec(),
                _ => Vec::new(),
            })
            .collect();
        let stored = QueueMachine::would_store(&space, &cmds).map_err(|e| io(&e))?;
        for ((e, cmds), counts) in unapplied.iter().zip(&cmds).zip(stored) {
            if e.log_id.index < start {
                continue;
            }
            let origin = (e.log_id.leader_id.term, e.log_id.leader_id.node_id, e.log_id.index);
            let mut msgs = Vec::new();
            for (c, n) in cmds.iter().zip(counts) {
                match c {
                    QueueCmd::Enqueue { msgs: m } | QueueCmd::EnqueueExpiring { msgs: m, .. } => {
                        msgs.extend(m.iter().take(n as usize).cloned())
                    }
                    QueueCmd::Handback { msgs: m, .. } if n > 0 => msgs.extend(m.iter().cloned()),
                    _ => {}
                }
            }
            if !msgs.is_empty() {
                out.push((Some(origin), msgs));
            }
        }
        Ok(out)
    }

    /// Give messages to the master of the newer epoch, a chunk at a time,
    /// each answered once confirmed there. `Some(news)`: a replica answered
    /// with an even newer epoch, which is where the messages must go instead.
    async fn send_handback(
        &self,
        q: &QueueMeta,
        news: EpochNews,
        batches: Vec<Batch>,
    ) -> Result<Option<EpochNews>, NodeError> {
        let deadline = Instant::now() + self.inner.timing.op_timeout * 4;
        let mut candidates = self.asked_about(q, news);
        if candidates.is_empty() {
            candidates.push(news.from);
        }
        let mut target = news.from;
        let mut attempt = 0usize;
        let mut rest = batches.into_iter().peekable();
        while rest.peek().is_some() {
            let mut chunk = Vec::new();
            let mut bytes = 0;
            while let Some(b) = rest.next_if(|_| chunk.is_empty() || bytes <= HANDBACK_CHUNK_BYTES) {
                bytes += b.1.iter().map(|m| m.body.len() + m.properties.len()).sum::<usize>();
                chunk.push(b);
            }
            loop {
                let req = RpcRequest::Handback { group: q.group, epoch: news.epoch, batches: chunk.clone() };
                match self.inner.call(target, &req, Instant::now() + Duration::from_secs(10)).await {
                    Ok(RpcResponse::Queue(Ok(_))) => break,
                    Ok(RpcResponse::NewerEpoch(epoch)) if epoch > news.epoch => {
                        return Ok(Some(EpochNews { group: q.group, epoch, from: target }));
                    }
                    Ok(RpcResponse::Queue(Err(NodeError::NotLeader { leader: Some(l) }))) if l != target => target = l,
                    other => {
                        tracing::debug!(queue = %q.name, target, answer = ?other.map(|_| ()), "hand-back not taken yet");
                        if Instant::now() > deadline {
                            return Err(NodeError::Unavailable(
                                "no master of the newer epoch took the hand-back".into(),
                            ));
                        }
                        attempt += 1;
                        target = candidates[attempt % candidates.len()];
                        tokio::time::sleep(Duration::from_millis(200)).await;
                    }
                }
            }
        }
        Ok(None)
    }

    /// For each queue this node masters, the most senior mirror that may
    /// take over (`ha-promote-on-shutdown`).
    fn successors(&self) -> Vec<(GroupId, NodeId)> {
        let state = self.metadata();
        let groups: Vec<Arc<QueueGroup>> = self.inner.groups.read().expect("poisoned").values().cloned().collect();
        let by_group: HashMap<GroupId, &QueueMeta> = state.queues.values().map(|q| (q.group, q)).collect();
        let departed = self.inner.peers.departed();
        let mut out = Vec::new();
        let mut stranded = Vec::new();
        for g in groups {
            if !g.is_leader(self.id()) {
                continue;
            }
            let Some(q) = by_group.get(&g.meta.group).copied() else { continue };
            let me = self.id();
            let synced: BTreeSet<NodeId> =
                g.sync.borrow().synchronised.iter().copied().filter(|id| *id != me).collect();
            let m = g.raft.metrics().borrow().clone();
            let voters: BTreeSet<NodeId> =
                m.membership_config.membership().voter_ids().filter(|id| *id != me).collect();
            let eligible = if ha_of(&state, q).promote_on_shutdown_always { voters } else { synced };
            // A mirror whose node is gone or stopping too (an idle queue
            // still counts it synchronised) cannot take over.
            let eligible: BTreeSet<NodeId> =
                eligible.into_iter().filter(|id| !self.is_dead(*id) && !departed.contains(id)).collect();
            match by_seniority(q, &eligible).first() {
                Some(next) => out.push((g.meta.group, *next)),
                None => stranded.push(q.name.clone()),
            }
        }
        if !stranded.is_empty() {
            tracing::warn!(
                queues = stranded.len(),
                first = %stranded[0],
                "stopping with no synchronised mirror running: these queues wait for this node rather than lose messages"
            );
        }
        out
    }

    /// Graceful stop, before the groups stop: turn elections off here and
    /// pick, for each queue we master, the mirror that should take over.
    pub(super) fn prepare_hand_over(&self) -> Vec<(GroupId, NodeId)> {
        self.inner.leaving.store(true, Ordering::Release);
        for g in self.inner.groups.read().expect("poisoned").values() {
            g.raft.runtime_config().elect(false);
        }
        self.successors()
    }

    /// Graceful stop, before any mastership moves: tell every peer. Their
    /// masters stop waiting for this node's replicas (a busy queue would
    /// otherwise hold its confirms for the sync timeout once they stop)
    /// and settle groups without them.
    pub(super) async fn announce_departure(&self) {
        let state = self.metadata();
        let req = RpcRequest::Departing { from: self.id(), incarnation: self.inner.quiescence.incarnation() };
        let deadline = Instant::now() + Duration::from_secs(1);
        let peers = state.nodes.keys().copied().filter(|id| *id != self.id());
        let calls = peers.map(|id| {
            let req = &req;
            async move {
                if self.inner.call(id, req, deadline).await.is_err() {
                    tracing::info!(node = id, "peer not told of this node's stop");
                }
            }
        });
        futures::future::join_all(calls).await;
    }

    /// After our groups stopped: ask each successor to stand for election
    /// now, and to stop waiting for us. The other mirrors still honour the
    /// leader lease of our last heartbeat, so the successor wins within
    /// about one election timeout instead of after failure detection.
    pub(super) async fn hand_over(&self, successors: Vec<(GroupId, NodeId)>) {
        let calls = successors.into_iter().map(|(group, next)| async move {
            let req = RpcRequest::Elect { group, from: self.id(), leaving: true };
            let asked = self.inner.call(next, &req, Instant::now() + Duration::from_secs(1)).await;
            match asked {
                Ok(RpcResponse::Done) => tracing::info!(group, successor = next, "mastership handed over"),
                _ => tracing::warn!(group, successor = next, "successor did not answer the handover"),
            }
        });
        futures::future::join_all(calls).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_master_that_moved_the_queue_away_leads_no_one() {
        let set = |ids: &[NodeId]| ids.iter().copied().collect::<BTreeSet<NodeId>>();
        let (reach, voters) = (set(&[1, 2, 3, 5]), set(&[1, 2, 3]));
        // Node 5 moved the queue to 1-3 and stepped down: still in reach,
        // no longer a voter.
        assert!(!still_leads(5, 2, &reach, &voters, true));
        assert!(still_leads(1, 2, &reach, &voters, true));
        assert!(still_leads(2, 2, &set(&[1]), &voters, false), "this replica leads without pinging itself");
        assert!(!still_leads(3, 2, &set(&[1, 2]), &voters, true), "a master out of reach leads no one");
        // Back from a crash, node 1 answers pings but sends nothing: it is
        // not leading.
        assert!(!still_leads(1, 2, &reach, &voters, false));
    }

    #[test]
    fn a_live_voter_re_forms_before_a_more_senior_learner() {
        let set = |ids: &[NodeId]| ids.iter().copied().collect::<BTreeSet<NodeId>>();
        let replicas = [1, 2, 3, 4, 5];
        // Seed 745: voters {1, 4}, 1 restarting; 2 joined as a learner.
        assert_eq!(reformer(&replicas, &set(&[4]), &set(&[2, 3, 4, 5])), Some(4));
        // No voter left: the most senior wanted replica carries on.
        assert_eq!(reformer(&replicas, &set(&[]), &set(&[3, 5])), Some(3));
        assert_eq!(reformer(&replicas, &set(&[]), &set(&[])), None);
    }

    #[test]
    fn in_a_membership_change_a_voter_of_the_old_set_re_forms() {
        let set = |ids: &[NodeId]| ids.iter().copied().collect::<BTreeSet<NodeId>>();
        // 4, senior by the queue's order, is a voter only of the new set:
        // promoted a moment ago, it may lack the last commit.
        let (replicas, joint) = ([4, 1, 2, 3, 5], [set(&[1, 2, 3]), set(&[1, 2, 3, 4])]);
        let reach = set(&[2, 4]);
        assert_eq!(reform_voters(&joint, &reach), set(&[2]));
        assert_eq!(reformer(&replicas, &reform_voters(&joint, &reach), &reach), Some(2));
        // No voter of the old set in reach: the new set's.
        assert_eq!(reform_voters(&joint, &set(&[4, 5])), set(&[4]));
        // Without a change under way, every voter in reach.
        assert_eq!(reform_voters(&[set(&[1, 2, 3])], &set(&[2, 3, 5])), set(&[2, 3]));
    }

    /// A replica that led terms up to 7 heals into another epoch: wiped, it
    /// keeps a vote at term 7, so it can never lead term 7 (or below) again;
    /// and a crash between the wipe and that vote loses nothing.
    #[tokio::test]
    async fn a_healed_replica_never_leads_a_term_it_saw_again() {
        let dir = tempfile::tempdir().unwrap();
        let db = NodeDb::open(dir.path(), &mirrorq_storage::DbOptions::default()).unwrap();
        let group = 5;
        let mut log = LogStore::new(db.clone(), group);
        let entries: Vec<Entry<TypeConfig>> = (1..=3)
            .map(|i| Entry { log_id: LogId::new(CommittedLeaderId::new(7, 1), i), payload: EntryPayload::Blank })
            .collect();
        let epoch = (epoch_key(group), mirrorq_storage::keys::encode(&Epoch::default(), "e").unwrap());
        log.refound(&Vote::new_committed(7, 1), entries, (&epoch.0, epoch.1)).await.unwrap();
        let next = Epoch { term: 4, node: 3 };
        db.put_node_value(&heal_key(group), &mirrorq_storage::keys::encode(&next, "m").unwrap()).unwrap();

        assert_eq!(load_epoch(&db, group, 1).unwrap(), next);
        let mut log = LogStore::new(db.clone(), group);
        assert_eq!(log.get_log_state().await.unwrap().last_log_id, None, "wiped");
        let vote = log.read_vote().await.unwrap().expect("a vote is kept");
        assert_eq!((vote.leader_id.term, vote.is_committed()), (7, false));

        // A crash after the wipe, before that vote: the floor was durable.
        db.drop_group(group).unwrap();
        db.put_node_value(&heal_key(group), &mirrorq_storage::keys::encode(&next, "m").unwrap()).unwrap();
        load_epoch(&db, group, 1).unwrap();
        let vote = LogStore::new(db.clone(), group).read_vote().await.unwrap();
        assert_eq!(vote.map(|v| v.leader_id.term), Some(7));
    }

    #[test]
    fn a_refused_claim_leaves_the_holder_alone() {
        let set = std::sync::Mutex::new(HashSet::new());
        let first = Busy::take(&set, 7).expect("free");
        // Before the fix this call deadlocked on `set`.
        assert!(Busy::take(&set, 7).is_none());
        assert!(set.lock().unwrap().contains(&7), "the refused claim freed the holder's");
        assert!(Busy::take(&set, 8).is_some(), "other groups are free");
        drop(first);
        assert!(set.lock().unwrap().is_empty());
    }
}
