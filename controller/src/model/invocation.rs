//! Work sent to handlers and the outcomes that come back.
//!
//! A [`Work`] is one piece of work for one handler: the engine (or a test) builds it, hands it
//! to `grpc::Hub`, and receives exactly one [`Outcome`]. The hub turns it into as many
//! attempts on the wire as it takes (a dropped connection means a new attempt on the next
//! connection); the retry policy across outcomes belongs to the caller, because kopf persists
//! it on the object. `Work` is data only: the runtime machinery that steers a running
//! invocation (its cancellation, the channels of its patches and of newer bodies) is a
//! `grpc::Control` next to it.

use std::time::{Duration, SystemTime};

use serde_json::Value;

use super::{diagnostic::Diagnostic, handler::HandlerId, resource::ResourceRef};

/// Why a change handler is invoked (kopf's `reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChangeReason {
    /// First seen, no diff-base.
    Create,
    /// The essence changed.
    Update,
    /// Marked for deletion.
    Delete,
    /// Existed before the controller started.
    Resume,
}

/// The kind of one diff item.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DiffOperation {
    /// The field appeared.
    Add,
    /// The field changed.
    Change,
    /// The field disappeared.
    Remove,
}

/// One difference between two essences (kopf's `(op, path, old, new)`).
#[derive(Clone, Debug, PartialEq)]
pub struct DiffItem {
    /// What happened.
    pub operation: DiffOperation,
    /// The field path.
    pub path: Vec<String>,
    /// The old value, if any.
    pub old: Option<Value>,
    /// The new value, if any.
    pub new: Option<Value>,
}

/// The type of a watch event; `Listing` is kopf's `type=None`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EventType {
    /// Seen in the initial listing.
    Listing,
    /// ADDED.
    Added,
    /// MODIFIED.
    Modified,
    /// DELETED.
    Deleted,
}

/// An operator activity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activity {
    /// Before watching.
    Startup,
    /// At shutdown.
    Cleanup,
    /// Credentials are wanted.
    Login,
}

/// The cause-specific part of a piece of work.
#[derive(Clone, Debug, PartialEq)]
pub enum Payload {
    /// Create, update, delete, resume and field handlers.
    Change {
        /// Why.
        reason: ChangeReason,
        /// The old essence or field value.
        old: Option<Value>,
        /// The new essence or field value.
        new: Option<Value>,
        /// The differences.
        diff: Vec<DiffItem>,
        /// The field path of field handlers, dotted.
        field: String,
    },
    /// Event handlers.
    Event {
        /// The watch event type.
        event_type: EventType,
    },
    /// Daemons.
    Daemon {
        /// Earlier starts in this controller's lifetime.
        restarts: u32,
    },
    /// Timers.
    Timer {
        /// When the tick was scheduled.
        scheduled: SystemTime,
    },
    /// Index handlers.
    Index {
        /// The object is leaving the index.
        deleted: bool,
    },
    /// Admission handlers.
    Admission {
        /// The request uid.
        uid: String,
        /// The operation.
        operation: String,
        /// The subresource.
        subresource: String,
        /// A dry run.
        dry_run: bool,
        /// The old object.
        old_object: Option<Value>,
        /// The user info.
        user_info: Option<Value>,
        /// The HTTP request's headers, names canonical, in the order they came.
        headers: Vec<(String, String)>,
    },
    /// Probe handlers.
    Probe,
    /// Startup, cleanup and login handlers.
    Activity(Activity),
}

/// The persisted state of one sub-handler, as sent to the SDK.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SubhandlerState {
    /// The sub-handler id without the parent prefix.
    pub id: String,
    /// Attempts so far.
    pub retries: u32,
    /// Finished successfully.
    pub success: bool,
    /// Failed for good.
    pub failure: bool,
    /// Not before this time.
    pub delayed_until: Option<SystemTime>,
    /// The last message.
    pub message: String,
    /// When the first attempt started.
    pub started: Option<SystemTime>,
}

/// One piece of work for one handler.
#[derive(Clone, Debug)]
pub struct Work {
    /// The handler.
    pub handler_id: HandlerId,
    /// The first attempt number to use (1-based); the hub increments it on redelivery.
    pub attempt: u32,
    /// Stable across attempts.
    pub idempotency_key: String,
    /// When the first attempt of this work started.
    pub started: SystemTime,
    /// How long one attempt may run before it is cancelled; `None` for no deadline.
    pub attempt_timeout: Option<Duration>,
    /// The object, for resource handlers.
    pub object: Option<ResourceRef>,
    /// The object's body, for resource handlers.
    pub body: Option<Value>,
    /// The registration's `param`.
    pub param: Option<Value>,
    /// The previous attempt's failure.
    pub last_error: Option<Diagnostic>,
    /// Persisted sub-handler states.
    pub subhandlers: Vec<SubhandlerState>,
    /// The cause-specific payload.
    pub payload: Payload,
    /// How long a cancelled invocation has to finish before it is abandoned.
    pub cancel_grace: Option<Duration>,
    /// A lost connection ends the work with [`Outcome::Lost`] instead of a redelivery by the
    /// hub: the caller records the lost attempt in the object's progress record and delivers
    /// the next one itself, so that attempt numbers and the poison-pill guard survive the
    /// absence of every handler process and a restart of the controller.
    pub report_losses: bool,
    /// The invocation's span in its trace (`traceparent` on the wire).
    pub trace: super::TraceContext,
}

impl Work {
    /// Work for `handler_id` with the given payload and no object; fill in the rest as needed.
    pub fn new(handler_id: impl Into<String>, idempotency_key: impl Into<String>, payload: Payload) -> Self {
        Self {
            handler_id: HandlerId(handler_id.into()),
            attempt: 1,
            idempotency_key: idempotency_key.into(),
            started: SystemTime::now(),
            attempt_timeout: None,
            object: None,
            body: None,
            param: None,
            last_error: None,
            subhandlers: Vec::new(),
            payload,
            cancel_grace: None,
            report_losses: false,
            trace: super::TraceContext::root(),
        }
    }
}

/// Why an invocation is cancelled.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CancelReason {
    /// The object was deleted.
    ResourceDeleted,
    /// The object no longer matches.
    FilterMismatch,
    /// The deadline passed.
    DeadlineExceeded,
    /// A newer version superseded the work.
    Superseded,
    /// The controller is stopping.
    RuntimeShutdown,
    /// The handler was unregistered.
    HandlerUnregistered,
    /// Frozen by a peer or lost leadership.
    Paused,
}

/// The encoding of a patch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PatchType {
    /// RFC 7386 merge patch.
    Merge,
    /// RFC 6902 JSON patch.
    Json,
}

/// What a patch applies to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PatchTarget {
    /// The object.
    Object,
    /// The status subresource.
    Status,
}

/// A validated patch: a merge patch is a JSON object, a JSON patch a valid operation list.
#[derive(Clone, Debug, PartialEq)]
pub struct Patch {
    /// The encoding.
    pub patch_type: PatchType,
    /// The target.
    pub target: PatchTarget,
    /// The document.
    pub body: Value,
}

/// The verdict of an admission handler.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdmissionVerdict {
    /// Admitted.
    pub allowed: bool,
    /// Message on denial.
    pub message: String,
    /// HTTP code on denial.
    pub code: i32,
    /// Warnings.
    pub warnings: Vec<String>,
}

/// Credentials returned by a login handler.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Credentials {
    /// API server URL.
    pub server: String,
    /// CA PEM.
    pub certificate_authority: Vec<u8>,
    /// Skip TLS verification.
    pub insecure: bool,
    /// Basic-auth user.
    pub username: String,
    /// Basic-auth password.
    pub password: String,
    /// Bearer token.
    pub token: String,
    /// Client certificate PEM.
    pub client_certificate: Vec<u8>,
    /// Client key PEM.
    pub client_key: Vec<u8>,
    /// Default namespace.
    pub default_namespace: String,
    /// Expiry.
    pub expiration: Option<SystemTime>,
    /// Priority among login handlers.
    pub priority: i32,
}

/// Kind-specific parts of a success.
#[derive(Clone, Debug, PartialEq)]
pub enum KindResult {
    /// An admission verdict.
    Admission(AdmissionVerdict),
    /// Login credentials.
    Credentials(Credentials),
}

/// The outcome of one sub-handler.
#[derive(Clone, Debug, PartialEq)]
pub struct SubhandlerOutcome {
    /// The sub-handler id without the parent prefix.
    pub id: String,
    /// What happened (never `Cancelled`/`TimedOut`/`Abandoned`); `Skipped` is a sub-handler
    /// the process's lifecycle left for a later call of its parent (it did not run).
    pub outcome: Outcome,
}

/// What became of a piece of work. Exactly one per [`Work`].
#[derive(Clone, Debug, PartialEq)]
#[allow(clippy::large_enum_variant, reason = "one per invocation, moved once")]
pub enum Outcome {
    /// The handler succeeded.
    Success {
        /// The return value (stored at `status.<id>` for change handlers).
        result: Option<Value>,
        /// Kind-specific results.
        kind_result: Option<KindResult>,
        /// Patches to apply.
        patches: Vec<Patch>,
        /// Sub-handler outcomes.
        subhandlers: Vec<SubhandlerOutcome>,
    },
    /// Retry after the delay (`None`: the handler's backoff).
    Temporary {
        /// The requested delay.
        delay: Option<Duration>,
        /// What went wrong.
        diagnostics: Vec<Diagnostic>,
        /// Sub-handler outcomes reported with it.
        subhandlers: Vec<SubhandlerOutcome>,
    },
    /// Final failure.
    Permanent {
        /// What went wrong.
        diagnostics: Vec<Diagnostic>,
        /// Sub-handler outcomes reported with it.
        subhandlers: Vec<SubhandlerOutcome>,
    },
    /// An error the handler did not classify; the errors mode decides.
    Unclassified {
        /// What went wrong.
        diagnostics: Vec<Diagnostic>,
        /// Sub-handler outcomes reported with it.
        subhandlers: Vec<SubhandlerOutcome>,
    },
    /// The handler stopped after a `Cancel`, or the work was withdrawn before it was
    /// dispatched.
    Cancelled,
    /// An SDK-side filter said no.
    Skipped,
    /// The attempt passed its deadline and did not answer within the cancel grace period.
    TimedOut,
    /// The invocation was cancelled and did not answer within the grace period.
    Abandoned,
    /// The handler process disconnected while the attempt ran (only for work with
    /// `report_losses`; other work is redelivered by the hub).
    Lost,
}

impl Outcome {
    /// A short name for logs and metrics.
    pub fn as_str(&self) -> &'static str {
        match self {
            Self::Success { .. } => "success",
            Self::Temporary { .. } => "temporary_error",
            Self::Permanent { .. } => "permanent_error",
            Self::Unclassified { .. } => "unclassified_error",
            Self::Cancelled => "cancelled",
            Self::Skipped => "skipped",
            Self::TimedOut => "timed_out",
            Self::Abandoned => "abandoned",
            Self::Lost => "lost",
        }
    }

    /// A success with a plain result and nothing else.
    pub fn success(result: Option<Value>) -> Self {
        Self::Success {
            result,
            kind_result: None,
            patches: Vec::new(),
            subhandlers: Vec::new(),
        }
    }
}
