//! The objects of one resource that have work and wait for a worker, in two lines by priority.
//!
//! A change — a watch event of a new version, a retry, timer or daemon that is due, the next
//! cycle of an object whose handling is under way — waits in the line of changes. Work that
//! only confirms the state — the objects of a listing after a start, a takeover or an expired
//! watch (410), a relisting after the handlers changed — waits in the line of confirmations.
//! Changes go first, so that after a restart with 100,000 objects a new object is not handled
//! only after all of them (as a single line would have it).
//!
//! Confirmations are never starved: while changes keep coming, one worker in [`SHARE`] goes to
//! the confirmation that has waited the longest. So a confirmation waits at most `SHARE` times
//! as many dispatches as there are confirmations ahead of it, however many changes arrive; the
//! listing drains at no less than a `SHARE`th of the workers' pace.
//!
//! An object is in the lines once. Its entry is checked against the object's slot when taken
//! ([`Taken`]): an object that waits as a confirmation and gets a change is moved to the line
//! of changes ([`Ready::promote`] with the slot's mark updated), and its old entry is skipped
//! when its turn comes. The entries are the uids alone; the mark lives in the slot, so the two
//! lines cost no more than one.

use std::collections::VecDeque;

use parking_lot::Mutex;
use tokio::sync::Notify;

/// Where an object's work waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Priority {
    /// A change to handle.
    Change,
    /// State to confirm (a listing, a relisting).
    Confirmation,
}

impl Priority {
    /// The line of work that is (`true`) or is not a change.
    pub fn of(change: bool) -> Self {
        if change { Self::Change } else { Self::Confirmation }
    }
}

/// While changes wait, one dispatch in this many takes the oldest confirmation.
pub const SHARE: usize = 8;

/// The two lines.
#[derive(Default)]
pub struct Ready {
    lines: Mutex<Lines>,
    /// Told when an object is added.
    pub added: Notify,
}

#[derive(Default)]
struct Lines {
    changes: VecDeque<String>,
    confirmations: VecDeque<String>,
    /// Changes taken in a row while confirmations waited.
    passed: usize,
    /// Entries to be skipped when taken: one for each promotion (an object that moved has
    /// one entry more than it has work).
    stale: usize,
}

/// An entry taken from the lines, to be checked against its object's mark.
#[derive(Debug, PartialEq, Eq)]
pub struct Taken {
    /// The object.
    pub uid: String,
    /// The line it came from.
    pub priority: Priority,
}

impl Ready {
    /// Adds an object to the end of its line.
    pub fn push(&self, uid: String, priority: Priority) {
        {
            let mut lines = self.lines.lock();
            match priority {
                Priority::Change => lines.changes.push_back(uid),
                Priority::Confirmation => lines.confirmations.push_back(uid),
            }
        }
        self.added.notify_one();
    }

    /// Moves an object waiting as a confirmation to the end of the changes; its old entry is
    /// skipped when taken (the caller has marked the object's slot as a change).
    pub fn promote(&self, uid: String) {
        {
            let mut lines = self.lines.lock();
            lines.stale += 1;
            lines.changes.push_back(uid);
        }
        self.added.notify_one();
    }

    /// An entry taken was skipped: its object waits elsewhere, or no more.
    pub fn skipped(&self) {
        let mut lines = self.lines.lock();
        lines.stale = lines.stale.saturating_sub(1);
    }

    /// The next entry: a change, unless confirmations have waited [`SHARE`]` - 1` changes
    /// in a row.
    pub fn take(&self) -> Option<Taken> {
        let mut lines = self.lines.lock();
        let confirmation = if lines.confirmations.is_empty() {
            false
        } else if lines.changes.is_empty() {
            true
        } else {
            lines.passed + 1 >= SHARE
        };
        if confirmation {
            lines.passed = 0;
            lines.confirmations.pop_front().map(|uid| Taken {
                uid,
                priority: Priority::Confirmation,
            })
        } else {
            if !lines.confirmations.is_empty() {
                lines.passed += 1;
            }
            lines.changes.pop_front().map(|uid| Taken {
                uid,
                priority: Priority::Change,
            })
        }
    }

    /// How many objects wait (an object that moved counted once).
    pub fn len(&self) -> usize {
        let lines = self.lines.lock();
        (lines.changes.len() + lines.confirmations.len()).saturating_sub(lines.stale)
    }

    /// Whether no entry waits (old ones included: taking them is how they go).
    pub fn is_empty(&self) -> bool {
        let lines = self.lines.lock();
        lines.changes.is_empty() && lines.confirmations.is_empty()
    }

    /// Drops every entry.
    pub fn clear(&self) {
        let mut lines = self.lines.lock();
        lines.changes.clear();
        lines.confirmations.clear();
        lines.passed = 0;
        lines.stale = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn uids(ready: &Ready, n: usize) -> Vec<String> {
        (0..n).filter_map(|_| ready.take()).map(|t| t.uid).collect()
    }

    #[test]
    fn changes_go_before_confirmations_that_came_earlier() {
        let ready = Ready::default();
        for i in 0..3 {
            ready.push(format!("listed-{i}"), Priority::Confirmation);
        }
        ready.push("new".into(), Priority::Change);
        assert_eq!(ready.len(), 4);
        assert_eq!(uids(&ready, 4), ["new", "listed-0", "listed-1", "listed-2"]);
        assert!(ready.is_empty() && ready.take().is_none());
    }

    #[test]
    fn confirmations_are_not_starved_by_endless_changes() {
        let ready = Ready::default();
        for i in 0..3 {
            ready.push(format!("listed-{i}"), Priority::Confirmation);
        }
        // A change arrives for every one taken: still, one dispatch in SHARE is a
        // confirmation, the oldest first.
        let mut taken = Vec::new();
        for next in 0..3 * SHARE {
            ready.push(format!("change-{next}"), Priority::Change);
            taken.push(ready.take().expect("work").uid);
        }
        let confirmations: Vec<(usize, &String)> = taken
            .iter()
            .enumerate()
            .filter(|(_, uid)| uid.starts_with("listed"))
            .collect();
        assert_eq!(
            confirmations,
            [
                (SHARE - 1, &"listed-0".to_owned()),
                (2 * SHARE - 1, &"listed-1".to_owned()),
                (3 * SHARE - 1, &"listed-2".to_owned()),
            ]
        );
    }

    #[test]
    fn a_promoted_object_is_taken_once_as_a_change() {
        let ready = Ready::default();
        ready.push("a".into(), Priority::Confirmation);
        ready.push("b".into(), Priority::Confirmation);
        ready.promote("b".into());
        assert_eq!(ready.len(), 2, "b counted once");
        let first = ready.take().expect("b");
        assert_eq!(
            first,
            Taken {
                uid: "b".into(),
                priority: Priority::Change
            }
        );
        let a = ready.take().expect("a");
        assert_eq!(a.uid, "a");
        // b's old entry: the caller finds its slot unmarked for it and skips it.
        let old = ready.take().expect("the old entry");
        assert_eq!(
            old,
            Taken {
                uid: "b".into(),
                priority: Priority::Confirmation
            }
        );
        ready.skipped();
        assert_eq!(ready.len(), 0);
        assert!(ready.take().is_none());
    }
}
