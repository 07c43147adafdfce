//! Node-level failure detection, shared by every group: a peer whose link
//! breaks by itself is dialled again at once, and if its port refuses the
//! dial its process is gone (`kill -9`, a crash, a stop). Every group it led
//! here is then failed over at once instead of after Raft's timers: the
//! followers forget its leader lease (they would refuse votes until it ran
//! out, an election timeout after its last heartbeat), confirms stop waiting
//! for it, and the most senior replica still standing asks for votes.
//!
//! A refused dial is proof, a silent one is not: a peer behind a partition
//! or paused (SIGSTOP) does not refuse, and is judged by the pings and
//! Raft's timers as before, so a partition cannot unseat a master faster
//! than it did.

use std::time::{Duration, Instant};

use openraft::ServerState;
use tokio::sync::broadcast::error::RecvError;

use super::Node;
use crate::ids::NodeId;

/// How long a dial to a peer whose link just broke may take: on loopback
/// and a LAN a refusal comes back in well under a millisecond.
const PROBE_LIMIT: Duration = Duration::from_millis(300);
/// How often the replica that stands asks for votes again while no master
/// is known: a voter that has not yet seen the death refuses the first ask.
pub(super) const ELECT_RETRY: Duration = Duration::from_millis(100);

/// Dials of a probe, and the pause between them: a dying process's sockets
/// close one by one, so its links may break while its listening socket
/// still takes a dial; a dial a moment later is refused.
const PROBE_DIALS: u32 = 3;
const PROBE_PAUSE: Duration = Duration::from_millis(20);

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
            // Who stands now: the rule of every reconcile, run at once.
            let state = self.metadata();
            self.watch_failures(&state).await;
        }
    }

    /// Dial `id`; if the dial is refused, record it dead, count it down for
    /// confirms and forget its leases. Whether it is dead.
    pub(super) async fn probe_dead(&self, id: NodeId) -> bool {
        let Some(addr) = self.inner.addr_of(id) else { return false };
        // A link a test cut stands for a partition, where dials go unanswered.
        if self.inner.transport.control.is_blocked(id) || !refused(&addr).await {
            return false;
        }
        self.inner.quiescence.world_changed();
        if self.inner.dead.lock().expect("poisoned").insert(id, Instant::now()).is_none() {
            tracing::info!(node = id, "peer's port refuses connections: its process is gone");
        }
        self.inner.peers.send_if_modified(|p| {
            let down = p.down.insert(id);
            p.gone.insert(id) || down
        });
        if let Some((_, reach)) = self.inner.reach.lock().expect("poisoned").as_mut() {
            reach.remove(&id);
        }
        self.forget_leases_of(id).await;
        true
    }

    /// Followers here of `id`'s leaderships forget its lease, so they grant
    /// a vote at once.
    pub(super) async fn forget_leases_of(&self, id: NodeId) {
        let groups: Vec<_> = self.inner.groups.read().expect("poisoned").values().cloned().collect();
        for g in groups {
            let m = g.raft.metrics().borrow().clone();
            if m.current_leader == Some(id) && m.state != ServerState::Leader {
                let _ = g.raft.trigger().expire_lease(id).await;
            }
        }
    }

    /// Whether `id`'s process was seen gone (and has not answered since).
    pub(super) fn is_dead(&self, id: NodeId) -> bool {
        self.inner.dead.lock().expect("poisoned").contains_key(&id)
    }
}
