//! Quiet groups: an idle queue group sends no Raft heartbeats.
//!
//! A master whose group has settled (every member has the whole log and it
//! is all applied, every replica is synchronised, no membership change is
//! under way) sends one heartbeat, which carries the last commit index to
//! the followers. Once nothing was proposed for a few heartbeat intervals
//! (one, for a queue just declared), it announces the group as quietly led,
//! with its term, in a list this node keeps. The nodes exchange these lists
//! on the liveness pings they send anyway, and only when one changed: an
//! idle cluster's pings stay small. Once every other voter's node holds the
//! announcement, the master turns the group's heartbeats off.
//!
//! A follower whose master's node answers pings and announces the group in
//! the follower's term does not stand for election: the node's pings stand
//! in for every quiet group's heartbeats, one signal per node instead of
//! one per group. When that node stops answering, or is seen dead, the
//! follower's usual rules apply at once (`failover/watch.rs`): its lease ran out
//! long ago, so the most senior replica stands as it would for a busy
//! group, as soon as the pings tell.
//!
//! The next entry turns the heartbeats back on (`queue::hush`), before it
//! goes to Raft; the master withdraws the announcement at its next round,
//! and announces again once the group has settled anew.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::ids::{GroupId, NodeId};

/// A node's list of the groups it leads quietly, (group, term), at a
/// generation of one life of the node. Carried by its pings.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct QuietList {
    pub incarnation: u64,
    pub gen: u64,
    pub groups: Vec<(GroupId, u64)>,
    /// The node is refilling a data dir set aside as damaged: its replicas
    /// hold less than their masters counted them to, and wait for appends.
    pub refilling: bool,
}

/// The answer to a ping: the answering node's incarnation and the
/// generation of its list of quietly led groups; the list (group, term)
/// unless the asker has it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Alive {
    pub incarnation: u64,
    pub gen: u64,
    pub groups: Option<Vec<(GroupId, u64)>>,
    /// As in [`QuietList`].
    pub refilling: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Announcement {
    term: u64,
    /// The generation of our list that first held it.
    gen: u64,
}

#[derive(Default)]
struct Ours {
    gen: u64,
    groups: HashMap<GroupId, Announcement>,
    /// See [`Quiescence::set_refilling`].
    refilling: bool,
}

struct Heard {
    incarnation: u64,
    gen: u64,
    groups: HashMap<GroupId, u64>,
    refilling: bool,
}

/// This node's announcements and what it heard of its peers'.
pub struct Quiescence {
    incarnation: u64,
    ours: Mutex<Ours>,
    heard: Mutex<HashMap<NodeId, Heard>>,
    /// The generation of our list each peer said it holds, at its last ping.
    fetched: Mutex<HashMap<NodeId, u64>>,
    /// Bumped whenever something the failure watch judges every quiet
    /// group by, beyond the group's own Raft metrics, changes: the peers in
    /// reach or seen dead, a peer's list from a new incarnation, the
    /// metadata. A quiet group whose metrics, this and its own `news` are
    /// as at its last full look is passed over quickly.
    world: std::sync::atomic::AtomicU64,
    /// Per group, bumped when a peer's list changes what it says of that
    /// group (announced, withdrawn, another term). Groups settle and wake
    /// all the time while queues are declared or used; bumping `world`
    /// for each such change made the watch look at every hosted group in
    /// full twice a second, ten thousand of them.
    news: Mutex<HashMap<GroupId, u64>>,
}

impl Quiescence {
    pub fn new(incarnation: u64) -> Self {
        Quiescence {
            incarnation,
            ours: Mutex::default(),
            heard: Mutex::default(),
            fetched: Mutex::default(),
            world: std::sync::atomic::AtomicU64::new(0),
            news: Mutex::default(),
        }
    }

    /// This node's life, as its peers tell it apart from the next.
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// What the failure watch's verdict on `group` depends on beyond its
    /// metrics, as a value that changes when any of it does.
    pub fn world_of(&self, group: GroupId) -> (u64, u64) {
        let news = self.news.lock().expect("poisoned").get(&group).copied().unwrap_or(0);
        (self.world.load(std::sync::atomic::Ordering::Acquire), news)
    }

    pub fn world_changed(&self) {
        self.world.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    }

    /// The answer to a liveness ping from `from`, which holds our list at
    /// `have`.
    pub fn answer(&self, from: NodeId, have: Option<(u64, u64)>) -> Alive {
        let ours = self.ours.lock().expect("poisoned");
        {
            let mut fetched = self.fetched.lock().expect("poisoned");
            match have {
                Some((incarnation, gen)) if incarnation == self.incarnation => fetched.insert(from, gen),
                _ => fetched.remove(&from),
            };
        }
        let current = have == Some((self.incarnation, ours.gen));
        Alive {
            incarnation: self.incarnation,
            gen: ours.gen,
            groups: (!current).then(|| ours.groups.iter().map(|(g, a)| (*g, a.term)).collect()),
            refilling: ours.refilling,
        }
    }

    /// What to tell `peer` we hold of its list.
    pub fn have(&self, peer: NodeId) -> Option<(u64, u64)> {
        self.heard.lock().expect("poisoned").get(&peer).map(|h| (h.incarnation, h.gen))
    }

    /// Our list, for a ping to `peer` to carry, when `peer` has not said it
    /// holds the latest: an announcement reaches the peers at this node's
    /// next round, rather than at theirs, and is known to have.
    pub fn push_for(&self, peer: NodeId) -> Option<QuietList> {
        let ours = self.ours.lock().expect("poisoned");
        if self.fetched.lock().expect("poisoned").get(&peer) == Some(&ours.gen) {
            return None;
        }
        Some(QuietList {
            incarnation: self.incarnation,
            gen: ours.gen,
            groups: ours.groups.iter().map(|(g, a)| (*g, a.term)).collect(),
            refilling: ours.refilling,
        })
    }

    /// Whether this node is refilling a data dir set aside as damaged: its
    /// masters' counts of what its replicas hold are from the lost dir, so
    /// a quiet master would never send them anything. Said with the list
    /// (a change is a new generation), and masters keep every group with a
    /// refilling member awake until it says it is done.
    pub fn set_refilling(&self, on: bool) {
        let mut ours = self.ours.lock().expect("poisoned");
        if ours.refilling != on {
            ours.refilling = on;
            ours.gen += 1;
        }
    }

    /// The peers that said they are refilling, in the life heard last.
    pub fn refilling_peers(&self) -> BTreeSet<NodeId> {
        self.heard.lock().expect("poisoned").iter().filter(|(_, h)| h.refilling).map(|(p, _)| *p).collect()
    }

    /// `peer` answered a ping that carried our list at `gen`: it holds it.
    pub fn pushed(&self, peer: NodeId, gen: u64) {
        self.fetched.lock().expect("poisoned").insert(peer, gen);
    }

    /// `peer`'s list: from the answer to our ping, or carried by its own.
    /// An older generation of the life we hold (a ping and an answer that
    /// crossed) changes nothing.
    pub fn heard(
        &self,
        peer: NodeId,
        incarnation: u64,
        gen: u64,
        groups: Option<Vec<(GroupId, u64)>>,
        refilling: bool,
    ) {
        let mut heard = self.heard.lock().expect("poisoned");
        if heard.get(&peer).is_some_and(|h| h.incarnation == incarnation && h.gen > gen) {
            return;
        }
        match groups {
            Some(groups) => {
                let groups: HashMap<GroupId, u64> = groups.into_iter().collect();
                let was = heard.insert(peer, Heard { incarnation, gen, groups, refilling });
                let now = &heard[&peer].groups;
                // Every group the peer is a member of is judged anew.
                if let Some(was) = was.filter(|w| w.incarnation == incarnation && w.refilling == refilling) {
                    // The same life of the peer: only the groups whose entry
                    // changed are judged anew.
                    let mut news = self.news.lock().expect("poisoned");
                    let changed = was.groups.iter().filter(|(g, t)| now.get(g) != Some(t)).map(|(g, _)| *g);
                    let added = now.keys().filter(|g| !was.groups.contains_key(g)).copied();
                    for g in changed.chain(added) {
                        *news.entry(g).or_default() += 1;
                    }
                    return;
                }
            }
            // Unchanged, as long as it is the list we hold.
            None if heard.get(&peer).is_some_and(|h| h.incarnation == incarnation && h.gen == gen) => return,
            None => {
                heard.remove(&peer);
            }
        }
        self.world_changed();
    }

    /// Announce `group` as quietly led in `term`; the generation that
    /// first held this announcement.
    pub fn announce(&self, group: GroupId, term: u64) -> u64 {
        let mut ours = self.ours.lock().expect("poisoned");
        if let Some(a) = ours.groups.get(&group).filter(|a| a.term == term) {
            return a.gen;
        }
        ours.gen += 1;
        let gen = ours.gen;
        ours.groups.insert(group, Announcement { term, gen });
        gen
    }

    /// Whether this node announces `group` as quietly led.
    #[cfg(feature = "test-hooks")]
    pub fn announces(&self, group: GroupId) -> bool {
        self.ours.lock().expect("poisoned").groups.contains_key(&group)
    }

    /// Withdraw `group`'s announcement; whether there was one.
    pub fn withdraw(&self, group: GroupId) -> bool {
        let mut ours = self.ours.lock().expect("poisoned");
        if ours.groups.remove(&group).is_none() {
            return false;
        }
        ours.gen += 1;
        true
    }

    /// Whether every one of `peers` holds our list at `gen` or later.
    pub fn fetched_by_all(&self, gen: u64, peers: impl IntoIterator<Item = NodeId>) -> bool {
        let fetched = self.fetched.lock().expect("poisoned");
        peers.into_iter().all(|p| fetched.get(&p).is_some_and(|g| *g >= gen))
    }

    /// The voter other than `me`, in reach, that announces `group` as
    /// quietly led in `term` or later: the master a follower in `term`
    /// keeps without heartbeats.
    pub fn quiet_master(
        &self,
        group: GroupId,
        term: u64,
        me: NodeId,
        voters: &BTreeSet<NodeId>,
        reach: &BTreeSet<NodeId>,
    ) -> Option<NodeId> {
        let heard = self.heard.lock().expect("poisoned");
        voters
            .iter()
            .filter(|v| **v != me && reach.contains(v))
            .filter(|v| heard.get(v).and_then(|h| h.groups.get(&group)).is_some_and(|t| *t >= term))
            .max_by_key(|v| heard.get(v).and_then(|h| h.groups.get(&group)).copied())
            .copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A change in a peer's list of quiet groups makes the failure watch
    /// look again at the groups it changed, not at every group: the key a
    /// group was passed over by moves for those only, and for all of them
    /// when the list comes from a new life of the peer.
    #[test]
    fn a_peers_new_list_changes_the_watch_key_of_the_groups_it_changed_only() {
        let q = Quiescence::new(1);
        q.heard(2, 7, 1, Some(vec![(10, 3), (11, 3), (12, 3)]), false);
        let key = |g| q.world_of(g);
        let before = [key(10), key(11), key(12), key(13)];
        // 11 withdrawn, 12 in another term, 13 announced; 10 as it was.
        q.heard(2, 7, 2, Some(vec![(10, 3), (12, 4), (13, 4)]), false);
        assert_eq!(key(10), before[0], "an unchanged group keeps its key");
        for (i, g) in [(1, 11), (2, 12), (3, 13)] {
            assert_ne!(key(g), before[i], "group {g} changed in the list");
        }
        // The list as it was, answered without the groups: nothing moves.
        let now = [key(10), key(11)];
        q.heard(2, 7, 2, None, false);
        assert_eq!([key(10), key(11)], now);
        // A new life of the peer: every group is judged anew.
        q.heard(2, 8, 1, Some(vec![(10, 3)]), false);
        assert_ne!(key(10), now[0]);
    }

    /// Our list rides on our pings to a peer until it answers one that
    /// carried its latest generation, and again once it changes; a list of
    /// an older generation of the life we hold (a ping and an answer that
    /// crossed) changes nothing.
    #[test]
    fn our_list_goes_with_our_pings_until_held_and_an_older_one_changes_nothing() {
        let q = Quiescence::new(1);
        assert!(q.push_for(2).is_some(), "a peer that never said what it holds");
        let gen = q.announce(10, 3);
        let list = q.push_for(2).unwrap();
        assert_eq!((list.incarnation, list.gen, list.groups), (1, gen, vec![(10, 3)]));
        q.pushed(2, gen);
        assert!(q.push_for(2).is_none(), "the peer holds it");
        assert!(q.withdraw(10));
        assert!(q.push_for(2).is_some_and(|l| l.groups.is_empty()), "a changed list goes again");

        let (voters, reach) = (BTreeSet::from([1, 3]), BTreeSet::from([3]));
        q.heard(3, 7, 5, Some(vec![(11, 2)]), false);
        q.heard(3, 7, 4, Some(vec![]), false);
        assert_eq!(q.quiet_master(11, 2, 1, &voters, &reach), Some(3), "an older generation changed the list");
        q.heard(3, 7, 6, Some(vec![]), false);
        assert_eq!(q.quiet_master(11, 2, 1, &voters, &reach), None, "a newer one is taken");
    }
}
