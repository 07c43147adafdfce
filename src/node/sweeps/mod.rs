//! What a node runs beside its queues' traffic: the reaper of dead
//! consumers' deliveries, message and queue expiry, dead-lettering,
//! compaction of the log, the flow samples behind message rates, and the
//! fetch of message bodies a mirror lacks.

pub(super) mod body_fetch;
pub(super) mod compaction;
pub(super) mod deadletter;
pub(super) mod expiry;
pub(super) mod flows;
pub(super) mod reaper;
