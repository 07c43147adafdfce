//! Node-level failure detection, shared by every group: a peer whose link
//! breaks by itself is dialled again at once (`peers::Peers::probe`), and if
//! its port refuses the dial its process is gone (`kill -9`, a crash, a
//! stop). Every group it led here is then failed over at once instead of
//! after Raft's timers: the followers forget its leader lease (they would
//! refuse votes until it ran out, an election timeout after its last
//! heartbeat), confirms stop waiting for it, and the most senior replica
//! still standing asks for votes.
//!
//! Whether a peer is alive is decided in `peers`; this is how the node
//! feeds it (link losses, pings through [`Prober`]) and acts on a death.

use std::time::{Duration, Instant};

use openraft::ServerState;
use tokio::sync::broadcast::error::RecvError;

use super::Node;
use crate::ids::NodeId;
use crate::peers::Prober;

/// How long a liveness ping may take before its peer counts as out of reach.
pub(super) const PING_LIMIT: Duration = Duration::from_millis(800);

impl Prober for Node {
    async fn ping(&self, id: NodeId) -> bool {
        self.ping_liveness(id, PING_LIMIT).await
    }

    fn probe_addr(&self, id: NodeId) -> Option<String> {
        self.inner.addr_of(id).filter(|addr| !self.inner.transport.is_cut_off(addr))
    }

    fn link_lost_at(&self, id: NodeId) -> Option<Instant> {
        self.inner.transport.link_lost_at(&self.inner.addr_of(id)?)
    }

    fn link_closed_in_order(&self, id: NodeId) -> bool {
        self.inner.addr_of(id).is_some_and(|a| self.inner.transport.link_closed_in_order(&a))
    }
}

impl Node {
    pub(super) fn spawn_liveness(&self) {
        let node = self.clone();
        let mut losses = self.inner.transport.losses();
        tokio::spawn(async move {
            loop {
                let addr = tokio::select! {
                    _ = node.inner.stop.cancelled() => return,
                    r = losses.recv() => match r {
                        Ok(addr) => addr,
                        Err(RecvError::Lagged(_)) => continue,
                        Err(RecvError::Closed) => return,
                    },
                };
                let node = node.clone();
                tokio::spawn(async move { node.link_lost(&addr).await });
            }
        });
    }

    async fn link_lost(&self, addr: &str) {
        let id = self.metadata().nodes.values().find(|n| n.raft_addr == addr).map(|n| n.id);
        let Some(id) = id.filter(|id| *id != self.id()) else { return };
        if self.probe_dead(id).await {
            // Who stands now: the failure watch's rule, run at once.
            self.inner.failover.want_watch();
        }
    }

    /// Dial `id`; if the dial is refused, it is dead (`peers`): the failure
    /// watch's verdicts are stale and its leases are forgotten here.
    /// Whether it is dead.
    pub(super) async fn probe_dead(&self, id: NodeId) -> bool {
        if !self.inner.peers.probe(self, id).await {
            return false;
        }
        self.after_death(id).await;
        true
    }

    /// What follows a peer's death, however it was seen.
    pub(super) async fn after_death(&self, id: NodeId) {
        self.inner.quiescence.world_changed();
        self.forget_leases_of(id).await;
    }

    /// Followers here of `id`'s leaderships forget its lease, so they grant
    /// a vote at once.
    pub(super) async fn forget_leases_of(&self, id: NodeId) {
        let groups: Vec<_> = self.inner.groups.all();
        for g in groups {
            let m = g.raft.metrics().borrow().clone();
            if m.current_leader == Some(id) && m.state != ServerState::Leader {
                let _ = g.raft.trigger().expire_lease(id).await;
            }
        }
    }

    /// Whether `id`'s process was seen gone (and has not answered since).
    pub(super) fn is_dead(&self, id: NodeId) -> bool {
        self.inner.peers.is_dead(id)
    }
}
