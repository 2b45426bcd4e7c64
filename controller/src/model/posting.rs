//! Kubernetes Events to post about objects: what handlers log and how their attempts end.
//!
//! Handler processes send log records; the engine decides outcomes. Both become
//! [`Posting`]s, which the engine's poster turns into rate-limited, aggregated Events.

use super::resource::ResourceRef;

/// The severity of a record, as handler processes log it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// Debug: never posted.
    Debug,
    /// Info: a Normal Event.
    Info,
    /// Warning: a Warning Event.
    Warning,
    /// Error: a Warning Event.
    Error,
}

/// Whether a record must, may or must not become an Event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Post it if its level reaches the configured threshold.
    ByLevel,
    /// Always post it.
    Always,
    /// Never post it.
    Never,
}

/// One record about one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Posting {
    /// The object the Event is about.
    pub object: ResourceRef,
    /// The level.
    pub level: Level,
    /// The Event reason, e.g. `Logging`.
    pub reason: String,
    /// The message.
    pub message: String,
    /// The posting policy.
    pub policy: Policy,
    /// The Event's type when it is not the level's (kopf.event's `type`, kopf.exception's
    /// `Error`): a name of letters and digits ([`event_type`]).
    pub event_type: Option<String>,
}

impl Posting {
    /// The Event's type: its own, else the level's (Normal for debug and info, Warning above).
    pub fn type_name(&self) -> &str {
        self.event_type.as_deref().unwrap_or(match self.level {
            Level::Debug | Level::Info => "Normal",
            Level::Warning | Level::Error => "Warning",
        })
    }
}

/// Longest Event type a handler process may name.
pub const MAX_EVENT_TYPE: usize = 64;

/// A handler process's Event type, when it is one: 1 to [`MAX_EVENT_TYPE`] ASCII letters and
/// digits (`Normal`, `Warning`, `Error`, or a name of the operator's own).
pub fn event_type(name: &str) -> Option<String> {
    (!name.is_empty() && name.len() <= MAX_EVENT_TYPE && name.bytes().all(|b| b.is_ascii_alphanumeric()))
        .then(|| name.to_owned())
}

/// How a handler process wants the outcomes of its handlers posted as Events (its
/// `ProcessSettings.outcome_events`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum OutcomeEvents {
    /// As the controller's settings say.
    #[default]
    Default,
    /// Only logged.
    Never,
    /// Posted from this level up (and from the controller's `--event-level`).
    From(Level),
}

impl OutcomeEvents {
    /// How a note at `level` about handlers whose processes want `wants` is posted: `None`
    /// when none of them wants it. A note about no handler follows the controller's settings.
    pub fn policy(wants: &[Self], level: Level) -> Option<Policy> {
        if wants.is_empty() || wants.contains(&Self::Default) {
            return Some(Policy::ByLevel);
        }
        wants
            .iter()
            .any(|w| matches!(w, Self::From(from) if level >= *from))
            .then_some(Policy::ByLevel)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_types_are_names_and_outcomes_follow_the_processes_that_want_them() {
        assert_eq!(event_type("SomeType").as_deref(), Some("SomeType"));
        assert_eq!(event_type("Error").as_deref(), Some("Error"));
        for bad in ["", "with space", "a\nb", &"x".repeat(MAX_EVENT_TYPE + 1)] {
            assert_eq!(event_type(bad), None, "{bad:?}");
        }
        use OutcomeEvents as O;
        assert_eq!(O::policy(&[], Level::Info), Some(Policy::ByLevel));
        assert_eq!(
            O::policy(&[O::Never, O::Default], Level::Info),
            Some(Policy::ByLevel)
        );
        assert_eq!(O::policy(&[O::Never], Level::Error), None);
        assert_eq!(O::policy(&[O::From(Level::Warning)], Level::Info), None);
        assert_eq!(
            O::policy(&[O::Never, O::From(Level::Info)], Level::Error),
            Some(Policy::ByLevel)
        );
        assert_eq!(O::policy(&[O::From(Level::Info)], Level::Debug), None);
    }
}
