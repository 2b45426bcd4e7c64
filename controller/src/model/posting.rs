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
}
