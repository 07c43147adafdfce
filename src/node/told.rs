//! Failures that repeat (a group that cannot re-form, a membership change
//! that keeps failing, a catch-up that cannot finish) are retried every
//! few hundred milliseconds. Each is logged when it first happens or its
//! text changes, and counted every time (`mirrorq_repeated_failures`), so
//! a failure that persists cannot fill a disk with the same line.

use std::collections::HashMap;
use std::sync::Mutex;

use crate::ids::GroupId;

#[derive(Default)]
pub(super) struct Told {
    last: Mutex<HashMap<(GroupId, &'static str), String>>,
}

impl Told {
    /// Record that `what` failed for `group` with `text`; true if it is
    /// new (not the same text as last time), so the caller logs it.
    pub(super) fn first(&self, group: GroupId, what: &'static str, text: &str) -> bool {
        let mut last = self.last.lock().expect("poisoned");
        match last.get(&(group, what)) {
            Some(t) if t == text => false,
            _ => {
                last.insert((group, what), text.to_string());
                true
            }
        }
    }

    /// `what` worked for `group`: its next failure is news again.
    pub(super) fn cleared(&self, group: GroupId, what: &'static str) {
        self.last.lock().expect("poisoned").remove(&(group, what));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failure_is_news_once_until_it_changes_or_clears() {
        let t = Told::default();
        assert!(t.first(1, "re-form", "disk full"));
        assert!(!t.first(1, "re-form", "disk full"));
        assert!(t.first(2, "re-form", "disk full"), "another group");
        assert!(t.first(1, "re-form", "io error"), "another text");
        t.cleared(1, "re-form");
        assert!(t.first(1, "re-form", "io error"));
    }
}
