//! [`Context`]: everything a handler gets for one invocation — kopf's kwargs as methods.
//!
//! The dispatch module builds one `Context` per invocation (and one per sub-handler) from the
//! wire `Invocation`: the body and its `spec`/`metadata`/`status` views (always of the latest
//! body: a daemon sees the bodies the controller pushes while it runs, through the control
//! module, as [`Snapshot`]s), the change (`reason`,
//! `diff`, `old`, `new`), the retry bookkeeping, `param`, the admission request, a logger that
//! sends `LogRecord`s on the stream, the [`Patch`] that rides with the result, cancellation for
//! daemons and deadlines, and [`Context::subhandler`] to declare sub-handlers (kopf's
//! `register`). A `Context` is a cheap handle: clones share the same invocation.

use std::{
    collections::HashMap,
    sync::{Arc, LazyLock},
    time::{Duration, SystemTime},
};

use parking_lot::Mutex;
use serde_json::{Map, Value};
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use crate::{
    Activity, AdmissionRequest, CancelReason, Diagnostic, EventType, Handler, HandlerError, Index, LogLevel,
    Memo, Patch, ResourceRef, Snapshot, control::Control, convert, error::Result, index::Indexes,
    outbox::Outbox, pb, pb::connect_request::Message,
};

static NULL: Value = Value::Null;
static EMPTY: LazyLock<Map<String, Value>> = LazyLock::new(Map::new);

/// Why a change handler is invoked (kopf's `reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Reason {
    /// The object was seen for the first time.
    Create,
    /// The object's essence changed.
    Update,
    /// The object is marked for deletion.
    Delete,
    /// The object existed before the controller started.
    Resume,
}

/// What happened to one field (kopf's diff operation).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DiffOp {
    /// The field appeared.
    Add,
    /// The field changed its value.
    Change,
    /// The field disappeared.
    Remove,
}

/// One difference between the old and new essence, as kopf's `(op, path, old, new)`.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct DiffItem {
    /// What happened.
    pub op: DiffOp,
    /// The field path, one element per nesting level.
    pub path: Vec<String>,
    /// The old value; `None` for [`DiffOp::Add`].
    pub old: Option<Value>,
    /// The new value; `None` for [`DiffOp::Remove`].
    pub new: Option<Value>,
}

use crate::subhandling::{Subhandler, SubhandlerOptions};

/// The decoded parts of an invocation that handlers read.
#[derive(Debug, Default)]
pub(crate) struct Decoded {
    /// The body the invocation carried; later bodies live in the invocation's control.
    pub(crate) body: Arc<Value>,
    pub(crate) old: Option<Value>,
    pub(crate) new: Option<Value>,
    pub(crate) diff: Vec<DiffItem>,
    pub(crate) param: Option<Value>,
    /// The object the invocation is for; `None` for activities.
    pub(crate) resource: Option<ResourceRef>,
    /// The admission request, for admission handlers.
    pub(crate) admission: Option<AdmissionRequest>,
    /// The previous attempt's failure.
    pub(crate) last_error: Option<Diagnostic>,
}

impl Decoded {
    /// Decodes the JSON parts of an invocation.
    pub(crate) fn from_invocation(invocation: &pb::Invocation) -> Result<Self, serde_json::Error> {
        let mut decoded = Self {
            body: Arc::new(convert::json_from_pb(invocation.body.as_ref())?.unwrap_or(Value::Null)),
            param: convert::json_from_pb(invocation.param.as_ref())?,
            resource: invocation.resource.as_ref().map(ResourceRef::from_pb),
            last_error: invocation.last_error.as_ref().map(Diagnostic::from_pb),
            ..Self::default()
        };
        if let Some(pb::invocation::Payload::Admission(request)) = &invocation.payload {
            decoded.admission = Some(AdmissionRequest::from_pb(request)?);
        }
        if let Some(pb::invocation::Payload::Change(change)) = &invocation.payload {
            decoded.old = convert::json_from_pb(change.old.as_ref())?;
            decoded.new = convert::json_from_pb(change.new.as_ref())?;
            for item in &change.diff {
                let op = match pb::DiffOperation::try_from(item.operation) {
                    Ok(pb::DiffOperation::Add) => DiffOp::Add,
                    Ok(pb::DiffOperation::Remove) => DiffOp::Remove,
                    _ => DiffOp::Change,
                };
                decoded.diff.push(DiffItem {
                    op,
                    path: item.path.clone(),
                    old: convert::json_from_pb(item.old.as_ref())?,
                    new: convert::json_from_pb(item.new.as_ref())?,
                });
            }
        }
        Ok(decoded)
    }
}

struct Inner {
    invocation: Arc<pb::Invocation>,
    decoded: Arc<Decoded>,
    handler_id: String,
    retry: u32,
    started: SystemTime,
    control: Control,
    outbox: Outbox,
    patch: Patch,
    subhandlers: Option<Mutex<Vec<Subhandler>>>,
    warnings: Mutex<Vec<String>>,
    indexes: Indexes,
    memo: crate::memo::Lazy,
    operator_memo: Memo,
}

/// The invocation a handler runs for: kopf's kwargs, the logger, the patch and cancellation.
#[derive(Clone)]
pub struct Context {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("handler_id", &self.inner.handler_id)
            .field("invocation_id", &self.inner.invocation.invocation_id)
            .finish_non_exhaustive()
    }
}

/// What the dispatch module needs to build a context.
pub(crate) struct Parts {
    pub(crate) invocation: Arc<pb::Invocation>,
    pub(crate) decoded: Arc<Decoded>,
    pub(crate) handler_id: String,
    pub(crate) retry: u32,
    pub(crate) started: SystemTime,
    pub(crate) control: Control,
    pub(crate) outbox: Outbox,
    pub(crate) allow_subhandlers: bool,
    /// The process's indexes.
    pub(crate) indexes: Indexes,
    /// The object's memo (the operator-wide one for activities), made when first read.
    pub(crate) memo: crate::memo::Lazy,
    /// The operator-wide memo.
    pub(crate) operator_memo: Memo,
}

impl Context {
    pub(crate) fn from_parts(parts: Parts) -> Self {
        Self {
            inner: Arc::new(Inner {
                invocation: parts.invocation,
                decoded: parts.decoded,
                handler_id: parts.handler_id,
                retry: parts.retry,
                started: parts.started,
                control: parts.control,
                outbox: parts.outbox,
                patch: Patch::new(),
                subhandlers: parts.allow_subhandlers.then(|| Mutex::new(Vec::new())),
                warnings: Mutex::new(Vec::new()),
                indexes: parts.indexes,
                memo: parts.memo,
                operator_memo: parts.operator_memo,
            }),
        }
    }

    pub(crate) fn take_subhandlers(&self) -> Vec<Subhandler> {
        self.inner
            .subhandlers
            .as_ref()
            .map(|subs| std::mem::take(&mut *subs.lock()))
            .unwrap_or_default()
    }

    pub(crate) fn take_warnings(&self) -> Vec<String> {
        std::mem::take(&mut *self.inner.warnings.lock())
    }

    // ----- the object -------------------------------------------------------------------------

    /// The object's latest body (`null` for activities): the body the invocation carried, or
    /// for a running daemon the newest one the controller has pushed since (kopf's live
    /// `body`). Each call takes a fresh [`Snapshot`]; a snapshot never changes.
    pub fn body(&self) -> Snapshot {
        Snapshot::new(self.latest(), whole)
    }

    /// `spec` of the latest body (`null` if absent).
    pub fn spec(&self) -> Snapshot {
        Snapshot::new(self.latest(), spec)
    }

    /// `metadata` of the latest body (`null` if absent).
    pub fn meta(&self) -> Snapshot {
        Snapshot::new(self.latest(), meta)
    }

    /// `status` of the latest body (`null` if absent).
    pub fn status(&self) -> Snapshot {
        Snapshot::new(self.latest(), status)
    }

    /// The labels of the latest body (empty if none).
    pub fn labels(&self) -> Snapshot<Map<String, Value>> {
        Snapshot::new(self.latest(), labels)
    }

    /// The annotations of the latest body (empty if none).
    pub fn annotations(&self) -> Snapshot<Map<String, Value>> {
        Snapshot::new(self.latest(), annotations)
    }

    /// The object's name (empty for activities); fixed for the object's lifetime.
    pub fn name(&self) -> &str {
        self.first_meta("name").unwrap_or_default()
    }

    /// The object's namespace; `None` for cluster-scoped objects.
    pub fn namespace(&self) -> Option<&str> {
        self.first_meta("namespace").filter(|ns| !ns.is_empty())
    }

    /// The object's uid; fixed for the object's lifetime.
    pub fn uid(&self) -> &str {
        self.first_meta("uid").unwrap_or_default()
    }

    /// The latest body: the last one pushed for this invocation, else the one it carried.
    fn latest(&self) -> Arc<Value> {
        self.inner
            .control
            .latest_body()
            .unwrap_or_else(|| self.inner.decoded.body.clone())
    }

    /// A string in `metadata` of the body the invocation carried, for the fields that never
    /// change (name, namespace, uid).
    fn first_meta(&self, key: &str) -> Option<&str> {
        meta(&self.inner.decoded.body).get(key).and_then(Value::as_str)
    }

    /// The object reference the invocation is for; `None` for activities.
    pub fn resource(&self) -> Option<&ResourceRef> {
        self.inner.decoded.resource.as_ref()
    }

    // ----- ownership ----------------------------------------------------------------------------

    /// The object as an owner of others: its latest body, with `apiVersion` and `kind` taken
    /// from the invocation's resource when the body lacks them (list results do).
    pub fn owner(&self) -> Value {
        let mut body = (*self.body()).clone();
        if let (Some(resource), Value::Object(map)) = (self.resource(), &mut body) {
            if !map.contains_key("apiVersion") {
                map.insert("apiVersion".into(), resource.api_version().into());
            }
            if !map.contains_key("kind") {
                map.insert("kind".into(), resource.kind.clone().into());
            }
        }
        body
    }

    /// Makes `objects` children of this handler's object (kopf's `adopt` with the current
    /// object as the owner); see [`crate::hierarchies::adopt`].
    ///
    /// # Errors
    /// A [`crate::hierarchies::HierarchyError`] when the object or a child is unfit; nothing is
    /// changed then.
    pub fn adopt<'a>(
        &self,
        objects: impl IntoIterator<Item = &'a mut Value>,
        options: &crate::hierarchies::Adoption,
    ) -> Result<(), crate::hierarchies::HierarchyError> {
        crate::hierarchies::adopt(objects, &self.owner(), options)
    }

    /// An owner reference to this handler's object (controller, blocking deletion), as kopf's
    /// `build_owner_reference(body)`.
    ///
    /// # Errors
    /// [`crate::hierarchies::HierarchyError::OwnerIncomplete`] for an object without a uid
    /// (activities have none).
    pub fn owner_reference(&self) -> Result<Value, crate::hierarchies::HierarchyError> {
        crate::hierarchies::build_owner_reference(&self.owner(), true, true)
    }

    // ----- the cause --------------------------------------------------------------------------

    /// Why a change handler is invoked; `None` for other handler kinds.
    pub fn reason(&self) -> Option<Reason> {
        match &self.inner.invocation.payload {
            Some(pb::invocation::Payload::Change(change)) => {
                match pb::ChangeReason::try_from(change.reason) {
                    Ok(pb::ChangeReason::Create) => Some(Reason::Create),
                    Ok(pb::ChangeReason::Update) => Some(Reason::Update),
                    Ok(pb::ChangeReason::Delete) => Some(Reason::Delete),
                    Ok(pb::ChangeReason::Resume) => Some(Reason::Resume),
                    _ => None,
                }
            }
            _ => None,
        }
    }

    /// The differences between the old and new essence (for field handlers: of the field).
    pub fn diff(&self) -> &[DiffItem] {
        &self.inner.decoded.diff
    }

    /// The old essence (for field handlers: the field's old value).
    pub fn old(&self) -> Option<&Value> {
        self.inner.decoded.old.as_ref()
    }

    /// The new essence (for field handlers: the field's new value).
    #[allow(
        clippy::new_ret_no_self,
        reason = "named after kopf's `new` kwarg, like `old`"
    )]
    pub fn new(&self) -> Option<&Value> {
        self.inner.decoded.new.as_ref()
    }

    /// For field handlers: the dotted path of the field.
    pub fn field(&self) -> Option<&str> {
        match &self.inner.invocation.payload {
            Some(pb::invocation::Payload::Change(change)) if !change.field.is_empty() => Some(&change.field),
            _ => None,
        }
    }

    /// The watch event type, for event handlers ([`EventType::Listed`] means the initial
    /// listing); `None` for other handler kinds.
    pub fn event_type(&self) -> Option<EventType> {
        match &self.inner.invocation.payload {
            Some(pb::invocation::Payload::Event(event)) => Some(EventType::from_pb(event.r#type)),
            _ => None,
        }
    }

    /// The admission request, for validating and mutating handlers.
    pub fn admission(&self) -> Option<&AdmissionRequest> {
        self.inner.decoded.admission.as_ref()
    }

    /// Whether the admission request is a dry run (no side effects allowed).
    pub fn dry_run(&self) -> bool {
        self.admission().is_some_and(|request| request.dry_run)
    }

    /// Adds a warning returned to the client of an admission request.
    pub fn add_warning(&self, warning: impl Into<String>) {
        self.inner.warnings.lock().push(warning.into());
    }

    // ----- indexes and memos -----------------------------------------------------------------

    /// The index built by the index handler `name` of this process (kopf's index kwarg named
    /// after the index). Handlers other than index handlers run only once every index has been
    /// built from the initial listing.
    ///
    /// # Errors
    ///
    /// A permanent [`HandlerError`] naming the indexes there are, when this process has no
    /// index handler `name`.
    pub fn index(&self, name: &str) -> Result<Index, HandlerError> {
        self.inner.indexes.get(name).ok_or_else(|| {
            let known = self.inner.indexes.names();
            HandlerError::permanent(if known.is_empty() {
                format!("there is no index {name:?}: this process registers no index handlers")
            } else {
                format!("there is no index {name:?}; the indexes are {}", known.join(", "))
            })
        })
    }

    /// The object's memo (kopf's `memo`): runtime values kept between this object's handler
    /// calls in this process, dropped when the object goes away. For activities, the
    /// operator-wide memo.
    pub fn memo(&self) -> &Memo {
        self.inner.memo.get()
    }

    /// The memo as it was handed in (not made yet if not read), for sub-handlers.
    pub(crate) fn lazy_memo(&self) -> crate::memo::Lazy {
        self.inner.memo.clone()
    }

    /// The process's indexes, for sub-handlers.
    pub(crate) fn indexes(&self) -> Indexes {
        self.inner.indexes.clone()
    }

    /// The operator-wide memo ([`crate::Registry::memo`]), shared by every object.
    pub fn operator_memo(&self) -> &Memo {
        &self.inner.operator_memo
    }

    /// The activity, for startup, cleanup and login handlers.
    pub fn activity(&self) -> Option<Activity> {
        match &self.inner.invocation.payload {
            Some(pb::invocation::Payload::Activity(a)) => Some(Activity::from_pb(a.activity)),
            _ => None,
        }
    }

    // ----- execution --------------------------------------------------------------------------

    /// The handler id (`parent/child` for sub-handlers).
    pub fn handler_id(&self) -> &str {
        &self.inner.handler_id
    }

    /// The invocation id, unique per attempt.
    pub fn invocation_id(&self) -> &str {
        &self.inner.invocation.invocation_id
    }

    /// The invocation's W3C `traceparent`: the controller traces every processing cycle, and
    /// each invocation is a span of that trace. Pass it on (HTTP headers, messages) to continue
    /// the trace; it is also a field of this invocation's `tracing` span (`trace.id`).
    pub fn traceparent(&self) -> Option<&str> {
        self.inner
            .invocation
            .trace_context
            .get("traceparent")
            .map(String::as_str)
    }

    /// The trace id of [`Context::traceparent`] (32 hex digits), as the controller logs it.
    pub fn trace_id(&self) -> Option<&str> {
        trace_id(&self.inner.invocation)
    }

    /// Stable across all attempts of the same piece of work: use it to make side effects
    /// idempotent.
    pub fn idempotency_key(&self) -> &str {
        &self.inner.invocation.idempotency_key
    }

    /// How many attempts were made before this one (kopf's `retry`; 0 on the first).
    pub fn retry(&self) -> u32 {
        self.inner.retry
    }

    /// When the first attempt of this work started (kopf's `started`).
    pub fn started(&self) -> SystemTime {
        self.inner.started
    }

    /// How long ago the first attempt started (kopf's `runtime`).
    pub fn runtime(&self) -> Duration {
        SystemTime::now()
            .duration_since(self.inner.started)
            .unwrap_or_default()
    }

    /// The registration's `param`, echoed.
    pub fn param(&self) -> Option<&Value> {
        self.inner.decoded.param.as_ref()
    }

    /// The previous attempt's failure, if any.
    pub fn last_error(&self) -> Option<&Diagnostic> {
        self.inner.decoded.last_error.as_ref()
    }

    // ----- patching ---------------------------------------------------------------------------

    /// The patch sent with the result; it is applied only if the handler succeeds.
    pub fn patch(&self) -> &Patch {
        &self.inner.patch
    }

    /// Sends a patch now, while the handler keeps running (daemons' progress). An empty patch
    /// sends nothing.
    ///
    /// # Errors
    ///
    /// [`crate::Error::StreamClosed`] when the stream to the controller is gone.
    pub async fn send_patch(&self, patch: &Patch) -> Result<()> {
        if patch.is_empty() {
            return Ok(());
        }
        let update = pb::InvocationUpdate {
            invocation_id: self.invocation_id().to_owned(),
            patches: patch.to_pb(),
        };
        self.inner.outbox.send(Message::Update(update)).await
    }

    // ----- cancellation -----------------------------------------------------------------------

    /// Resolves when the invocation is cancelled (daemon stop, deadline, shutdown).
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: use it freely in `tokio::select!`.
    pub fn cancelled(&self) -> WaitForCancellationFuture<'_> {
        self.inner.control.token().cancelled()
    }

    /// Whether the invocation was cancelled (kopf's `stopped`), for loops that poll.
    pub fn is_stopped(&self) -> bool {
        self.inner.control.token().is_cancelled()
    }

    /// Waits up to `timeout` for cancellation; `true` if cancelled (kopf's `stopped.wait`).
    pub async fn wait_stopped(&self, timeout: Duration) -> bool {
        tokio::select! {
            () = self.cancelled() => true,
            () = tokio::time::sleep(timeout) => self.is_stopped(),
        }
    }

    /// Why the invocation was cancelled, if it was.
    pub fn cancel_reason(&self) -> Option<CancelReason> {
        self.inner.control.reason().map(CancelReason::from_pb)
    }

    /// A clone of the cancellation token, to hand to other tasks the handler starts.
    pub fn cancellation_token(&self) -> CancellationToken {
        self.inner.control.token().clone()
    }

    // ----- sub-handlers -----------------------------------------------------------------------

    /// Declares a sub-handler (kopf's `register`/`@subhandler`): after this handler returns
    /// successfully, every declared sub-handler that is not finished yet runs, and its outcome
    /// is persisted by the controller under `<parent id>/<id>`. Its errors are judged by the
    /// parent's registration; [`Context::subhandler_with`] gives it options of its own.
    ///
    /// # Caveats
    ///
    /// As in kopf, the parent is re-invoked until all sub-handlers are finished and must declare
    /// the same sub-handlers every time. A sub-handler may declare sub-handlers of its own (ids
    /// `<parent id>/<id>/<child id>`, up to [`crate::subhandling::MAX_DEPTH`] levels); it
    /// succeeds once they all have. Declarations where sub-handlers are not allowed (event
    /// handlers, daemons, timers, activities) are ignored with a warning.
    pub fn subhandler(&self, id: impl Into<String>, handler: impl Handler) {
        self.subhandler_with(id, SubhandlerOptions::new(), handler);
    }

    /// Declares a sub-handler with its own `errors`, `retries`, `backoff` and `timeout`
    /// (kopf's `register(fn, id=…, errors=…, retries=…, backoff=…, timeout=…)`).
    pub fn subhandler_with(&self, id: impl Into<String>, options: SubhandlerOptions, handler: impl Handler) {
        let id = id.into();
        match &self.inner.subhandlers {
            Some(subs) => subs.lock().push(Subhandler {
                id,
                handler: Arc::new(handler),
                options,
            }),
            None => tracing::warn!(subhandler.id = %id, "sub-handlers cannot be declared here; ignored"),
        }
    }

    // ----- logging ----------------------------------------------------------------------------

    /// Logs at info level; the controller may post it as a Normal Event on the object.
    pub fn info(&self, message: impl Into<String>) {
        self.log(LogLevel::Info, message);
    }

    /// Logs at warning level; the controller may post it as a Warning Event on the object.
    pub fn warn(&self, message: impl Into<String>) {
        self.log(LogLevel::Warning, message);
    }

    /// Logs at error level; the controller may post it as a Warning Event on the object.
    pub fn error(&self, message: impl Into<String>) {
        self.log(LogLevel::Error, message);
    }

    /// Logs at debug level.
    pub fn debug(&self, message: impl Into<String>) {
        self.log(LogLevel::Debug, message);
    }

    /// Logs at `level`; the record goes to the controller and to this process's `tracing`.
    pub fn log(&self, level: LogLevel, message: impl Into<String>) {
        let message = message.into();
        trace_record(level, &message);
        self.inner.outbox.log(self.record(level, message));
    }

    /// Posts a Kubernetes Event on any object (kopf's `kopf.info/warn/exception(obj, …)`).
    /// Only `group`, `version`, `kind`, `plural`, `namespace`, `name` and `uid` of `object`
    /// are used; without a `uid` the controller looks it up so that `kubectl describe` shows
    /// the Event. Repeats of the same Event are aggregated into one with a count.
    pub fn post_event_on(
        &self,
        object: &ResourceRef,
        level: LogLevel,
        reason: impl Into<String>,
        message: impl Into<String>,
    ) {
        let message = message.into();
        trace_record(level, &message);
        let mut record = self.record(level, message);
        record.posting = pb::EventPosting::Always as i32;
        record.reason = reason.into();
        record.object = Some(object.to_pb());
        self.inner.outbox.log(record);
    }

    fn record(&self, level: LogLevel, message: String) -> pb::LogRecord {
        let mut fields = HashMap::new();
        fields.insert("handler_id".to_owned(), self.inner.handler_id.clone());
        if let Some(trace) = self.trace_id() {
            fields.insert("trace_id".to_owned(), trace.to_owned());
        }
        pb::LogRecord {
            invocation_id: self.invocation_id().to_owned(),
            level: level.to_pb() as i32,
            message,
            time: Some(convert::timestamp_to_pb(SystemTime::now())),
            fields,
            posting: pb::EventPosting::Unspecified as i32,
            reason: String::new(),
            object: None,
            event_type: String::new(),
        }
    }
}

fn trace_record(level: LogLevel, message: &str) {
    match level {
        LogLevel::Error => tracing::error!(message),
        LogLevel::Warning => tracing::warn!(message),
        LogLevel::Debug => tracing::debug!(message),
        LogLevel::Info => tracing::info!(message),
    }
}

fn whole(body: &Value) -> &Value {
    body
}

fn spec(body: &Value) -> &Value {
    body.get("spec").unwrap_or(&NULL)
}

fn meta(body: &Value) -> &Value {
    body.get("metadata").unwrap_or(&NULL)
}

fn status(body: &Value) -> &Value {
    body.get("status").unwrap_or(&NULL)
}

fn labels(body: &Value) -> &Map<String, Value> {
    meta(body)
        .get("labels")
        .and_then(Value::as_object)
        .unwrap_or(&EMPTY)
}

fn annotations(body: &Value) -> &Map<String, Value> {
    meta(body)
        .get("annotations")
        .and_then(Value::as_object)
        .unwrap_or(&EMPTY)
}

/// The trace id of an invocation's `traceparent` (`00-<trace id>-<span id>-<flags>`), when it
/// has a well-formed one.
pub(crate) fn trace_id(invocation: &pb::Invocation) -> Option<&str> {
    let traceparent = invocation.trace_context.get("traceparent")?;
    let id = traceparent.split('-').nth(1)?;
    (id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some(id)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;

    fn context(body: Value, control: Control) -> Context {
        let invocation = pb::Invocation {
            invocation_id: "i1".to_owned(),
            handler_id: "monitor".to_owned(),
            body: Some(convert::json_to_pb(&body)),
            payload: Some(pb::invocation::Payload::Daemon(pb::DaemonStart { restarts: 0 })),
            ..pb::Invocation::default()
        };
        let decoded = Decoded::from_invocation(&invocation).unwrap();
        Context::from_parts(Parts {
            invocation: Arc::new(invocation),
            decoded: Arc::new(decoded),
            handler_id: "monitor".to_owned(),
            retry: 0,
            started: SystemTime::now(),
            control,
            outbox: Outbox::channel().0,
            allow_subhandlers: false,
            indexes: Indexes::default(),
            memo: crate::memo::Lazy::ready(Memo::new()),
            operator_memo: Memo::new(),
        })
    }

    #[test]
    fn body_views_follow_object_updates() {
        let control = Control::new();
        let ctx = context(
            json!({"metadata": {"name": "d", "uid": "u1", "labels": {"app": "a"}}, "spec": {"size": 1}}),
            control.clone(),
        );
        assert_eq!(ctx.spec()["size"], 1);
        let before = ctx.body();

        control.update_body(json!({
            "metadata": {"name": "d", "uid": "u1", "labels": {"app": "b"}, "annotations": {"x": "y"}},
            "spec": {"size": 2},
            "status": {"phase": "Running"},
        }));
        assert_eq!(ctx.spec()["size"], 2);
        assert_eq!(ctx.body()["spec"]["size"], 2);
        assert_eq!(ctx.status()["phase"], "Running");
        assert_eq!(ctx.meta()["labels"]["app"], "b");
        assert_eq!(ctx.labels().get("app"), Some(&json!("b")));
        assert_eq!(ctx.annotations().len(), 1);
        assert_eq!((ctx.name(), ctx.uid(), ctx.namespace()), ("d", "u1", None));
        // A snapshot taken earlier does not change; the raw invocation keeps its own body.
        assert_eq!(before["spec"]["size"], 1);
        assert_eq!(
            convert::json_from_pb(ctx.inner.invocation.body.as_ref())
                .unwrap()
                .unwrap()["spec"]["size"],
            1
        );
    }
}
