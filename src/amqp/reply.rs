//! AMQP reply codes, and the two kinds of error a method can end in: a
//! hard one closes the connection (`connection.close`), a soft one the
//! channel (`channel.close`).

use crate::error::NodeError;
use crate::metadata::names;

// Reply codes (AMQP 0-9-1).
pub(in crate::amqp) const NO_ROUTE: u16 = 312;

pub(in crate::amqp) const ACCESS_REFUSED: u16 = 403;

pub(in crate::amqp) const NOT_FOUND: u16 = 404;

pub(in crate::amqp) const RESOURCE_LOCKED: u16 = 405;

pub(in crate::amqp) const PRECONDITION_FAILED: u16 = 406;

pub(in crate::amqp) const FRAME_ERROR: u16 = 501;

pub(in crate::amqp) const SYNTAX_ERROR: u16 = 502;

pub(in crate::amqp) const COMMAND_INVALID: u16 = 503;

pub(in crate::amqp) const CHANNEL_ERROR: u16 = 504;

pub(in crate::amqp) const UNEXPECTED_FRAME: u16 = 505;

pub(in crate::amqp) const NOT_ALLOWED: u16 = 530;

pub(in crate::amqp) const NOT_IMPLEMENTED: u16 = 540;

pub(in crate::amqp) const INTERNAL_ERROR: u16 = 541;

pub(in crate::amqp) const CONNECTION_FORCED: u16 = 320;

/// An error that ends the connection (`connection.close`).
#[derive(Debug)]
pub(in crate::amqp) struct Hard {
    pub(in crate::amqp) code: u16,
    pub(in crate::amqp) text: String,
    pub(in crate::amqp) class: u16,
    pub(in crate::amqp) method: u16,
}

pub(in crate::amqp) fn hard(code: u16, text: impl Into<String>) -> Hard {
    Hard { code, text: text.into(), class: 0, method: 0 }
}

/// A channel-level error: `channel.close` with this code.
pub(in crate::amqp) struct Soft {
    pub(in crate::amqp) code: u16,
    pub(in crate::amqp) text: String,
    pub(in crate::amqp) class: u16,
    pub(in crate::amqp) method: u16,
}

pub(in crate::amqp) fn soft(code: u16, text: impl Into<String>, class: u16, method: u16) -> Soft {
    Soft { code, text: text.into(), class, method }
}

pub(in crate::amqp) fn unknown_tag(tag: u64, class: u16, method: u16) -> Soft {
    soft(PRECONDITION_FAILED, format!("PRECONDITION_FAILED - unknown delivery tag {tag}"), class, method)
}

pub(in crate::amqp) fn not_transactional(method: u16) -> Soft {
    soft(PRECONDITION_FAILED, "PRECONDITION_FAILED - channel is not transactional", 90, method)
}

pub(in crate::amqp) fn node_soft(e: NodeError, class: u16, method: u16) -> Soft {
    match e {
        NodeError::NoSuchQueue(q) => {
            let (vhost, name) = names::split(&q);
            soft(NOT_FOUND, format!("NOT_FOUND - no queue '{name}' in vhost '{vhost}'"), class, method)
        }
        NodeError::NotFound(what) => soft(NOT_FOUND, format!("NOT_FOUND - {what}"), class, method),
        NodeError::Conflict(why) => soft(PRECONDITION_FAILED, format!("PRECONDITION_FAILED - {why}"), class, method),
        NodeError::Refused(why) => soft(ACCESS_REFUSED, format!("ACCESS_REFUSED - {why}"), class, method),
        NodeError::Invalid(why) => soft(PRECONDITION_FAILED, format!("PRECONDITION_FAILED - {why}"), class, method),
        other => soft(INTERNAL_ERROR_SOFT, format!("{other}"), class, method),
    }
}

/// Soft stand-in for "the cluster could not do it now" (RabbitMQ answers
/// queue operations without a reachable master with 404/541 variants;
/// clients treat a channel close as retryable).
pub(in crate::amqp) const INTERNAL_ERROR_SOFT: u16 = 506;
