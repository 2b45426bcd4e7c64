//! Cause detection, exactly as kopf decides it: what happened to an object that its change
//! handlers should react to.

use std::fmt;

use crate::model::{ChangeReason, EventType};

/// What happened to an object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cause {
    /// The object is gone (DELETED event): nothing to do, forget it.
    Gone,
    /// Being deleted, and our finalizer is not on it: nothing to do.
    Free,
    /// Being deleted with our finalizer on it: delete handlers run.
    Delete,
    /// Never handled (no diff-base): create handlers run.
    Create,
    /// Unchanged, first seen in the initial listing: resume handlers run.
    Resume,
    /// Nothing changed.
    Noop,
    /// The essence changed: update handlers run (and resume handlers if initial).
    Update,
}

impl Cause {
    /// The reason handlers see, for causes that have handlers.
    pub fn reason(self) -> Option<ChangeReason> {
        match self {
            Self::Delete => Some(ChangeReason::Delete),
            Self::Create => Some(ChangeReason::Create),
            Self::Resume => Some(ChangeReason::Resume),
            Self::Update => Some(ChangeReason::Update),
            Self::Gone | Self::Free | Self::Noop => None,
        }
    }
}

impl fmt::Display for Cause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Gone => "gone",
            Self::Free => "free",
            Self::Delete => "delete",
            Self::Create => "create",
            Self::Resume => "resume",
            Self::Noop => "noop",
            Self::Update => "update",
        })
    }
}

/// The purpose string stored in progress records for a reason.
pub fn purpose(reason: ChangeReason) -> &'static str {
    match reason {
        ChangeReason::Create => "create",
        ChangeReason::Update => "update",
        ChangeReason::Delete => "delete",
        ChangeReason::Resume => "resume",
    }
}

/// The facts cause detection needs.
#[derive(Clone, Copy, Debug)]
pub struct Facts {
    /// The watch event type.
    pub event: EventType,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    /// Our finalizer is on the object.
    pub finalizer_present: bool,
    /// A diff-base is stored.
    pub has_diffbase: bool,
    /// The essence differs from the diff-base.
    pub changed: bool,
    /// First seen in a listing and not fully handled yet in this process.
    pub initial: bool,
}

/// Decides the cause, in kopf's order.
pub fn detect(f: Facts) -> Cause {
    if f.event == EventType::Deleted {
        Cause::Gone
    } else if f.deleting && !f.finalizer_present {
        Cause::Free
    } else if f.deleting {
        Cause::Delete
    } else if !f.has_diffbase {
        Cause::Create
    } else if !f.changed && f.initial {
        Cause::Resume
    } else if !f.changed {
        Cause::Noop
    } else {
        Cause::Update
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts() -> Facts {
        Facts {
            event: EventType::Modified,
            deleting: false,
            finalizer_present: false,
            has_diffbase: true,
            changed: false,
            initial: false,
        }
    }

    #[test]
    fn follows_kopf_order() {
        assert_eq!(
            detect(Facts {
                event: EventType::Deleted,
                deleting: true,
                ..facts()
            }),
            Cause::Gone
        );
        assert_eq!(
            detect(Facts {
                deleting: true,
                ..facts()
            }),
            Cause::Free
        );
        assert_eq!(
            detect(Facts {
                deleting: true,
                finalizer_present: true,
                ..facts()
            }),
            Cause::Delete
        );
        assert_eq!(
            detect(Facts {
                has_diffbase: false,
                initial: true,
                ..facts()
            }),
            Cause::Create
        );
        assert_eq!(
            detect(Facts {
                initial: true,
                ..facts()
            }),
            Cause::Resume
        );
        assert_eq!(detect(facts()), Cause::Noop);
        assert_eq!(
            detect(Facts {
                changed: true,
                initial: true,
                ..facts()
            }),
            Cause::Update
        );
    }
}
