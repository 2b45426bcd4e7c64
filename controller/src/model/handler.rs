//! Handler registrations as the controller understands them: kopf's handler kinds, options and
//! declarative filters, already validated.
//!
//! `grpc::convert` builds these from `capstan.v1.HandlerRegistration` and rejects what does not
//! make sense; everything downstream can rely on the invariants documented here.

use std::{collections::BTreeMap, fmt, time::Duration};

use serde_json::Value;

use super::resource::{ResolvedResource, ResourceSelector};

/// kopf's default delay before retrying an unclassified error: 60 seconds.
pub const DEFAULT_BACKOFF: Duration = Duration::from_secs(60);

/// A handler id: stable across restarts, unique per connection.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct HandlerId(pub String);

impl fmt::Display for HandlerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<&str> for HandlerId {
    fn from(s: &str) -> Self {
        Self(s.to_owned())
    }
}

/// The kind of a handler: kopf's decorators.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HandlerKind {
    /// `on.create`.
    Create,
    /// `on.update`.
    Update,
    /// `on.delete`.
    Delete,
    /// `on.resume`.
    Resume,
    /// `on.field`.
    Field,
    /// `on.event`.
    Event,
    /// `index`.
    Index,
    /// `daemon`.
    Daemon,
    /// `timer`.
    Timer,
    /// `on.startup`.
    Startup,
    /// `on.cleanup`.
    Cleanup,
    /// `on.login`.
    Login,
    /// `on.probe`.
    Probe,
    /// `on.validate`.
    Validate,
    /// `on.mutate`.
    Mutate,
}

impl HandlerKind {
    /// Whether the kind handles a resource (and so needs a selector).
    pub fn is_resource_kind(self) -> bool {
        !matches!(self, Self::Startup | Self::Cleanup | Self::Login | Self::Probe)
    }

    /// Whether the kind reacts to changes of the essence (kopf's "changing" handlers).
    pub fn is_changing(self) -> bool {
        matches!(
            self,
            Self::Create | Self::Update | Self::Delete | Self::Resume | Self::Field
        )
    }

    /// Whether the kind is an admission webhook (validate, mutate): served by the webhook
    /// server, never by the engine.
    pub fn is_admission(self) -> bool {
        matches!(self, Self::Validate | Self::Mutate)
    }

    /// kopf's default errors mode for the kind.
    pub fn default_errors_mode(self) -> ErrorsMode {
        match self {
            Self::Event | Self::Index => ErrorsMode::Ignored,
            Self::Validate | Self::Mutate => ErrorsMode::Permanent,
            _ => ErrorsMode::Temporary,
        }
    }

    /// A lower-case name for logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Update => "update",
            Self::Delete => "delete",
            Self::Resume => "resume",
            Self::Field => "field",
            Self::Event => "event",
            Self::Index => "index",
            Self::Daemon => "daemon",
            Self::Timer => "timer",
            Self::Startup => "startup",
            Self::Cleanup => "cleanup",
            Self::Login => "login",
            Self::Probe => "probe",
            Self::Validate => "validate",
            Self::Mutate => "mutate",
        }
    }
}

impl fmt::Display for HandlerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How errors the handler did not classify are treated (kopf `ErrorsMode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorsMode {
    /// Retried after the backoff.
    Temporary,
    /// Final failure.
    Permanent,
    /// Logged and treated as done.
    Ignored,
}

/// A condition on one label or annotation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MetaMatch {
    /// The key exists with exactly this value.
    Equals(String),
    /// The key exists.
    Present,
    /// The key does not exist.
    Absent,
}

impl MetaMatch {
    /// Whether `value` (the key's value, or `None` when absent) satisfies the condition.
    pub fn matches(&self, value: Option<&str>) -> bool {
        match self {
            Self::Equals(expected) => value == Some(expected.as_str()),
            Self::Present => value.is_some(),
            Self::Absent => value.is_none(),
        }
    }
}

/// A condition on one field value.
#[derive(Clone, Debug, PartialEq)]
pub enum ValueMatch {
    /// The field exists and equals this value.
    Equals(Value),
    /// The field exists.
    Present,
    /// The field does not exist.
    Absent,
}

impl ValueMatch {
    /// Whether `value` (the field's value, or `None` when absent) satisfies the condition.
    pub fn matches(&self, value: Option<&Value>) -> bool {
        match self {
            Self::Equals(expected) => value == Some(expected),
            Self::Present => value.is_some(),
            Self::Absent => value.is_none(),
        }
    }
}

/// Declarative filters, evaluated by the controller. All conditions must hold.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Filters {
    /// Conditions on labels.
    pub labels: BTreeMap<String, MetaMatch>,
    /// Conditions on annotations.
    pub annotations: BTreeMap<String, MetaMatch>,
    /// The field path the value conditions refer to (and that field handlers watch).
    pub field: Vec<String>,
    /// The field's value (old or new state, or current body).
    pub value: Option<ValueMatch>,
    /// The field's old value.
    pub old: Option<ValueMatch>,
    /// The field's new value.
    pub new: Option<ValueMatch>,
    /// The SDK evaluates a callable filter too, and may answer `skipped`.
    pub sdk_when: bool,
    /// The resource selector's label and field selectors, checked here too: the watch applies
    /// them on the server only when every handler of the resource shares them.
    pub selector: super::ObjectSelector,
}

/// Options of daemon handlers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DaemonOptions {
    /// Delay before the first start.
    pub initial_delay: Duration,
    /// Grace between the stop request and cancellation.
    pub cancellation_backoff: Option<Duration>,
    /// How long to wait after cancellation before abandoning; `None`: wait as long as the
    /// daemon runs (kopf's default).
    pub cancellation_timeout: Option<Duration>,
    /// Delay before restarting a daemon that failed temporarily without asking for a delay;
    /// `None`: the handler's backoff.
    pub restart_backoff: Option<Duration>,
    /// Kept from the wire for compatibility; without effect: a daemon that returned is never
    /// restarted (kopf).
    pub no_restart_after_success: bool,
}

/// Options of timer handlers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TimerOptions {
    /// The period; never zero.
    pub interval: Duration,
    /// Delay before the first tick.
    pub initial_delay: Duration,
    /// Only tick once the object has been unchanged this long.
    pub idle: Option<Duration>,
    /// Align ticks to a fixed schedule.
    pub sharp: bool,
}

/// Options of admission handlers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdmissionOptions {
    /// Operations intercepted ("CREATE", ...); empty means all.
    pub operations: Vec<String>,
    /// The subresource; empty for the main resource.
    pub subresource: String,
    /// The handler has side effects.
    pub side_effects: bool,
    /// Fail open.
    pub ignore_failures: bool,
}

/// Options that exist only for some kinds.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum KindOptions {
    /// No kind-specific options.
    #[default]
    None,
    /// Daemon options.
    Daemon(DaemonOptions),
    /// Timer options.
    Timer(TimerOptions),
    /// Admission options.
    Admission(AdmissionOptions),
    /// Delete handler options: `optional` handlers never block deletion.
    Delete {
        /// Never add a finalizer for this handler.
        optional: bool,
    },
    /// Resume handler options: also resume objects being deleted.
    Resume {
        /// Resume objects already marked for deletion.
        deleted: bool,
    },
}

/// One validated handler registration.
#[derive(Clone, Debug, PartialEq)]
pub struct Registration {
    /// The handler id.
    pub id: HandlerId,
    /// The kind.
    pub kind: HandlerKind,
    /// The selector; `Some` exactly for resource kinds.
    pub selector: Option<ResourceSelector>,
    /// What discovery resolved the selector to, once resolved.
    pub resource: Option<ResolvedResource>,
    /// Controller-side filters.
    pub filters: Filters,
    /// How unclassified errors are treated.
    pub errors: ErrorsMode,
    /// Maximum attempts in total; `None` means unlimited.
    pub retries: Option<u32>,
    /// Delay before retrying unclassified errors.
    pub backoff: Duration,
    /// Give up once this long has passed since the first attempt.
    pub timeout: Option<Duration>,
    /// Per-handler in-flight cap; `None` means only the process cap applies.
    pub max_in_flight: Option<u32>,
    /// Opaque user value echoed in invocations.
    pub param: Option<Value>,
    /// Kind-specific options.
    pub options: KindOptions,
}

impl Registration {
    /// A registration with kopf's defaults for `kind`.
    pub fn new(id: impl Into<String>, kind: HandlerKind, selector: Option<ResourceSelector>) -> Self {
        Self {
            id: HandlerId(id.into()),
            kind,
            selector,
            resource: None,
            filters: Filters::default(),
            errors: kind.default_errors_mode(),
            retries: None,
            backoff: DEFAULT_BACKOFF,
            timeout: None,
            max_in_flight: None,
            param: None,
            options: KindOptions::None,
        }
    }

    /// Whether this handler needs a finalizer on the objects it matches (kopf's
    /// `requires_finalizer`): non-optional delete handlers, daemons and timers.
    pub fn requires_finalizer(&self) -> bool {
        match self.kind {
            HandlerKind::Delete => !matches!(self.options, KindOptions::Delete { optional: true }),
            HandlerKind::Daemon | HandlerKind::Timer => true,
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_follow_kopf() {
        assert_eq!(
            Registration::new("a", HandlerKind::Event, None).errors,
            ErrorsMode::Ignored
        );
        assert_eq!(
            Registration::new("a", HandlerKind::Mutate, None).errors,
            ErrorsMode::Permanent
        );
        let create = Registration::new("a", HandlerKind::Create, None);
        assert_eq!(create.errors, ErrorsMode::Temporary);
        assert_eq!(create.backoff, DEFAULT_BACKOFF);
    }

    #[test]
    fn only_blocking_handlers_require_finalizers() {
        let mut delete = Registration::new("d", HandlerKind::Delete, None);
        assert!(delete.requires_finalizer());
        delete.options = KindOptions::Delete { optional: true };
        assert!(!delete.requires_finalizer());
        assert!(Registration::new("t", HandlerKind::Timer, None).requires_finalizer());
        assert!(!Registration::new("c", HandlerKind::Create, None).requires_finalizer());
    }

    #[test]
    fn meta_and_value_matches() {
        assert!(MetaMatch::Equals("x".into()).matches(Some("x")));
        assert!(!MetaMatch::Equals("x".into()).matches(None));
        assert!(MetaMatch::Absent.matches(None));
        assert!(ValueMatch::Present.matches(Some(&Value::Null)));
        assert!(ValueMatch::Equals(Value::from(3)).matches(Some(&Value::from(3))));
    }
}
