//! A fake runtime for unit-testing handlers without a cluster or a socket (kopf.testing's
//! counterpart).
//!
//! [`TestKit`] plays the controller's part in-process: it builds the `Invocation`s the
//! controller would send (with essences, diffs, sub-handler states and attempts), feeds them
//! into the very same dispatch function the real connection uses, and collects the
//! `InvocationResult`, the log records and the daemon updates into an [`Outcome`]. Declarative
//! filters (labels, annotations, field, value, old/new) are evaluated the way the controller
//! evaluates them, so `kit.create(body)` runs exactly the handlers that would run in a cluster.
//!
//! Time-related tests work with `tokio::time::pause()`: retry delays and daemon sleeps are tokio
//! timers.
//!
//! ```no_run
//! # async fn example() {
//! use capstan_sdk::{Context, HandlerResult, Registry, testing::TestKit};
//! use serde_json::json;
//!
//! async fn create_fn(ctx: Context) -> HandlerResult {
//!     ctx.patch().label("handled", "yes");
//!     Ok(Some(json!({"message": format!("hello {}", ctx.name())})))
//! }
//! let mut registry = Registry::new();
//! registry.on_create("cex", "create_fn", create_fn);
//! let kit = TestKit::new(registry);
//! let outcomes = kit.create(json!({"metadata": {"name": "one"}})).await;
//! let outcome = outcomes.get("create_fn").expect("create_fn ran");
//! assert_eq!(outcome.value(), Some(json!({"message": "hello one"})));
//! assert_eq!(outcome.patched_body()["metadata"]["labels"]["handled"], "yes");
//! # }
//! ```

use std::{
    collections::BTreeSet,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, SystemTime},
};

use parking_lot::Mutex;
use serde_json::{Map, Value};
use tokio::{sync::oneshot, task::JoinHandle};

mod records;

pub use records::{AdmissionVerdict, PatchDocument, PatchKind, PatchTarget, ProgressUpdate, SubhandlerState};

use crate::{
    Activity, CancelReason, Diagnostic, EventType, LogLevel, Operation, Registry, ResourceRef,
    control::Control,
    convert, dispatch,
    error::Result,
    filters::{lookup, meta_matches, value_matches},
    outbox::Outbox,
    patch::apply_merge,
    pb,
    pb::{connect_request::Message as Up, invocation::Payload, invocation_result::Outcome as Wire},
    registry::{Entry, Table},
};

/// An in-process fake controller that runs the handlers of a [`Registry`].
pub struct TestKit {
    table: Arc<Table>,
    next_id: AtomicU64,
}

impl std::fmt::Debug for TestKit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestKit")
            .field("handlers", &self.table.registrations().len())
            .finish()
    }
}

impl TestKit {
    /// A kit running the handlers of `registry`.
    ///
    /// # Panics
    ///
    /// When the registry is inconsistent (as `Operator::run` would fail); use
    /// [`TestKit::try_new`] to test for that.
    pub fn new(registry: Registry) -> Self {
        match Self::try_new(registry) {
            Ok(kit) => kit,
            Err(error) => panic!("the registry is invalid: {error}"),
        }
    }

    /// A kit running the handlers of `registry`.
    ///
    /// # Errors
    ///
    /// [`crate::Error::Register`] when the registry is inconsistent.
    pub fn try_new(registry: Registry) -> Result<Self> {
        Ok(Self {
            table: Arc::new(registry.into_table()?),
            next_id: AtomicU64::new(1),
        })
    }

    /// The ids of the handlers the SDK would register in `Hello`, in registration order (a
    /// field handler's id ends with `/<field>`; a handler with `also_for` selectors is listed
    /// once per resource).
    pub fn handler_ids(&self) -> Vec<&str> {
        self.table
            .registrations()
            .iter()
            .map(|registration| registration.handler_id.as_str())
            .collect()
    }

    /// Invokes one handler, whatever its filters say.
    pub async fn invoke(&self, handler_id: &str, invocation: InvocationBuilder) -> Outcome {
        self.start(handler_id, invocation).join().await
    }

    /// Starts one invocation in the background: for daemons and anything a test wants to cancel.
    pub fn start(&self, handler_id: &str, invocation: InvocationBuilder) -> Running {
        let mut invocation = invocation.invocation;
        invocation.handler_id = handler_id.to_owned();
        if invocation.invocation_id.is_empty() {
            invocation.invocation_id = format!("test-{}", self.next_id.fetch_add(1, Ordering::Relaxed));
        }
        Running::spawn(self.table.clone(), invocation)
    }

    /// Starts a daemon for `body`; stop it with [`Running::cancel`] and collect it with
    /// [`Running::join`].
    pub fn start_daemon(&self, handler_id: &str, body: Value) -> Running {
        self.start(handler_id, InvocationBuilder::daemon(body))
    }

    /// Runs one tick of a timer for `body`.
    pub async fn tick(&self, handler_id: &str, body: Value) -> Outcome {
        self.invoke(handler_id, InvocationBuilder::timer(body)).await
    }

    /// The object was created: runs the matching create handlers and the field handlers whose
    /// field is set.
    pub async fn create(&self, body: Value) -> Outcomes {
        self.change(None, body, pb::ChangeReason::Create).await
    }

    /// The object changed from `old` to `new`: runs the matching update handlers and the field
    /// handlers whose field changed.
    pub async fn update(&self, old: Value, new: Value) -> Outcomes {
        self.change(Some(old), new, pb::ChangeReason::Update).await
    }

    /// The object is being deleted: runs the matching delete handlers.
    pub async fn delete(&self, body: Value) -> Outcomes {
        self.change(None, body, pb::ChangeReason::Delete).await
    }

    /// The object existed before the controller started: runs the matching resume handlers.
    pub async fn resume(&self, body: Value) -> Outcomes {
        self.change(None, body, pb::ChangeReason::Resume).await
    }

    /// Runs the field handlers of `field` for a change from `old` to `new`.
    pub async fn field(&self, field: &str, old: Value, new: Value) -> Outcomes {
        let mut outcomes = Outcomes {
            body: new.clone(),
            outcomes: Vec::new(),
        };
        for entry in self.table.entries() {
            let filters = entry.registration.filters.clone().unwrap_or_default();
            if entry.kind() != pb::HandlerKind::Field || filters.field != field {
                continue;
            }
            if matches(entry, Some(&old), &new, true) {
                let invocation = InvocationBuilder::field(field, old.clone(), new.clone());
                outcomes
                    .outcomes
                    .push(self.invoke(&entry.registration.handler_id, invocation).await);
            }
        }
        outcomes
    }

    /// A watch event: runs the matching event handlers.
    pub async fn event(&self, event_type: EventType, body: Value) -> Outcomes {
        let mut outcomes = Outcomes {
            body: body.clone(),
            outcomes: Vec::new(),
        };
        for entry in self.table.entries() {
            if entry.kind() == pb::HandlerKind::Event && matches(entry, None, &body, false) {
                let invocation = InvocationBuilder::event(event_type, body.clone());
                outcomes
                    .outcomes
                    .push(self.invoke(&entry.registration.handler_id, invocation).await);
            }
        }
        outcomes
    }

    /// The object is listed, created or changed: runs every index handler whose filters match
    /// it, and removes the object from the indexes whose filters it no longer matches (as the
    /// controller does). Read the result with [`TestKit::index`].
    pub async fn index_object(&self, body: Value) -> Outcomes {
        let mut outcomes = Outcomes {
            body: body.clone(),
            outcomes: Vec::new(),
        };
        for entry in self.table.entries() {
            if entry.kind() != pb::HandlerKind::Index {
                continue;
            }
            let invocation = if matches(entry, None, &body, false) {
                InvocationBuilder::index(body.clone())
            } else {
                InvocationBuilder::index_deleted(body.clone())
            };
            outcomes
                .outcomes
                .push(self.invoke(&entry.registration.handler_id, invocation).await);
        }
        outcomes
    }

    /// The object is gone: its entries leave every index and its memo is dropped.
    pub async fn object_gone(&self, body: Value) {
        for entry in self.table.entries() {
            if entry.kind() == pb::HandlerKind::Index {
                let invocation = InvocationBuilder::index_deleted(body.clone());
                self.invoke(&entry.registration.handler_id, invocation).await;
            }
        }
        let uid = body
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            .unwrap_or_default();
        self.table.memos.forget(uid);
    }

    /// The index built by the index handler `name`, as handlers read it.
    pub fn index(&self, name: &str) -> Option<crate::Index> {
        self.table.indexes.get(name)
    }

    /// The operator-wide memo.
    pub fn memo(&self) -> &crate::Memo {
        self.table.memos.operator()
    }

    /// How many objects have a memo (objects seen and not gone).
    pub fn memos(&self) -> usize {
        self.table.memos.objects()
    }

    /// Invokes a handler again and again, as the controller would, until it is done or
    /// `max_attempts` were made: after a temporary or unclassified error it waits the retry
    /// delay (a tokio timer), and while sub-handlers are unfinished it re-invokes the parent
    /// with their states. Returns every attempt's outcome.
    pub async fn retry_until_done(
        &self,
        handler_id: &str,
        invocation: InvocationBuilder,
        max_attempts: u32,
    ) -> Vec<Outcome> {
        let mut attempts: Vec<Outcome> = Vec::new();
        let mut next = invocation;
        for _ in 0..max_attempts {
            let outcome = self.invoke(handler_id, next.clone()).await;
            let wait = match outcome.kind() {
                OutcomeKind::TemporaryError { retry_after } => Some(retry_after.unwrap_or_default()),
                OutcomeKind::UnclassifiedError => Some(Duration::ZERO),
                OutcomeKind::Success if outcome.has_unfinished_subhandlers() => {
                    Some(outcome.subhandler_delays().into_iter().min().unwrap_or_default())
                }
                _ => None,
            };
            next = next.after(&outcome);
            attempts.push(outcome);
            match wait {
                Some(delay) => tokio::time::sleep(delay).await,
                None => break,
            }
        }
        attempts
    }

    async fn change(&self, old: Option<Value>, body: Value, reason: pb::ChangeReason) -> Outcomes {
        let mut outcomes = Outcomes {
            body: body.clone(),
            outcomes: Vec::new(),
        };
        let wanted = match reason {
            pb::ChangeReason::Create => pb::HandlerKind::Create,
            pb::ChangeReason::Update => pb::HandlerKind::Update,
            pb::ChangeReason::Delete => pb::HandlerKind::Delete,
            _ => pb::HandlerKind::Resume,
        };
        for entry in self.table.entries() {
            let kind = entry.kind();
            let id = entry.registration.handler_id.clone();
            let builder =
                if kind == wanted && matches(entry, old.as_ref(), &body, kind == pb::HandlerKind::Update) {
                    let mut builder = InvocationBuilder::change(reason, old.clone(), body.clone());
                    if reason == pb::ChangeReason::Update {
                        builder.set_change(essence(old.as_ref()), essence(Some(&body)));
                    }
                    builder
                } else if kind == pb::HandlerKind::Field
                    && matches!(reason, pb::ChangeReason::Create | pb::ChangeReason::Update)
                    && matches(entry, old.as_ref(), &body, true)
                {
                    let field = entry
                        .registration
                        .filters
                        .as_ref()
                        .map(|f| f.field.clone())
                        .unwrap_or_default();
                    let mut builder =
                        InvocationBuilder::field(&field, old.clone().unwrap_or(Value::Null), body.clone());
                    if let Some(Payload::Change(change)) = &mut builder.invocation.payload {
                        change.reason = reason as i32;
                    }
                    builder
                } else {
                    continue;
                };
            outcomes.outcomes.push(self.invoke(&id, builder).await);
        }
        outcomes
    }
}

/// Whether the controller would invoke `entry` for this change (kopf's `match`).
fn matches(entry: &Entry, old: Option<&Value>, new: &Value, needs_change: bool) -> bool {
    let Some(filters) = &entry.registration.filters else {
        return true;
    };
    let meta = |body: &Value, section: &str, key: &str| {
        body.get("metadata")
            .and_then(|m| m.get(section))
            .and_then(|s| s.get(key))
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    let labels_ok = filters
        .labels
        .iter()
        .all(|(k, c)| meta_matches(c, meta(new, "labels", k).as_deref()));
    let annotations_ok = filters
        .annotations
        .iter()
        .all(|(k, c)| meta_matches(c, meta(new, "annotations", k).as_deref()));
    if !labels_ok || !annotations_ok {
        return false;
    }
    if filters.field.is_empty() {
        return true;
    }
    let old_value = old.and_then(|o| lookup(o, &filters.field));
    let new_value = lookup(new, &filters.field);
    if let Some(value) = &filters.value
        && !(value_matches(value, new_value) || (old.is_some() && value_matches(value, old_value)))
    {
        return false;
    }
    if filters.old.as_ref().is_some_and(|c| !value_matches(c, old_value))
        || filters.new.as_ref().is_some_and(|c| !value_matches(c, new_value))
    {
        return false;
    }
    !needs_change || old_value != new_value
}

/// kopf's essence: the body without `status` and with only labels and annotations of
/// `metadata`.
fn essence(body: Option<&Value>) -> Option<Value> {
    let mut essence = body?.as_object()?.clone();
    essence.remove("status");
    if let Some(Value::Object(meta)) = essence.get_mut("metadata") {
        meta.retain(|key, value| (key == "labels" || key == "annotations") && !value.is_null());
        if meta.is_empty() {
            essence.remove("metadata");
        }
    }
    Some(Value::Object(essence))
}

/// kopf's diff: objects are compared key by key, everything else as a whole.
fn diff(old: Option<&Value>, new: Option<&Value>, path: &mut Vec<String>, out: &mut Vec<pb::DiffItem>) {
    let item = |op: pb::DiffOperation, path: &[String]| pb::DiffItem {
        operation: op as i32,
        path: path.to_vec(),
        old: old.map(convert::json_to_pb),
        new: new.map(convert::json_to_pb),
    };
    match (old, new) {
        (None, None) => {}
        (None, Some(_)) => out.push(item(pb::DiffOperation::Add, path)),
        (Some(_), None) => out.push(item(pb::DiffOperation::Remove, path)),
        (Some(Value::Object(a)), Some(Value::Object(b))) => {
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for key in keys {
                path.push(key.clone());
                diff(a.get(key), b.get(key), path, out);
                path.pop();
            }
        }
        (Some(a), Some(b)) if a != b => out.push(item(pb::DiffOperation::Change, path)),
        _ => {}
    }
}

fn resource_of(body: &Value) -> pb::ResourceRef {
    let text = |v: Option<&Value>| v.and_then(Value::as_str).unwrap_or_default().to_owned();
    let api_version = text(body.get("apiVersion"));
    let (group, version) = match api_version.split_once('/') {
        Some((group, version)) => (group.to_owned(), version.to_owned()),
        None => (String::new(), api_version),
    };
    let meta = body.get("metadata");
    let kind = text(body.get("kind"));
    pb::ResourceRef {
        group,
        version,
        plural: format!("{}s", kind.to_lowercase()),
        kind,
        namespace: text(meta.and_then(|m| m.get("namespace"))),
        name: text(meta.and_then(|m| m.get("name"))),
        uid: text(meta.and_then(|m| m.get("uid"))),
        resource_version: text(meta.and_then(|m| m.get("resourceVersion"))),
        generation: meta
            .and_then(|m| m.get("generation"))
            .and_then(Value::as_i64)
            .unwrap_or_default(),
    }
}

/// Builds the `Invocation` the controller would send, for [`TestKit::invoke`].
#[derive(Debug, Clone)]
#[must_use]
pub struct InvocationBuilder {
    invocation: pb::Invocation,
}

impl InvocationBuilder {
    fn new(body: Option<&Value>, payload: Payload) -> Self {
        let invocation = pb::Invocation {
            attempt: 1,
            idempotency_key: format!(
                "test-{}",
                body.and_then(|b| b.pointer("/metadata/uid"))
                    .and_then(Value::as_str)
                    .unwrap_or("object")
            ),
            started_time: Some(convert::timestamp_to_pb(SystemTime::now())),
            resource: body.map(resource_of),
            body: body.map(convert::json_to_pb),
            payload: Some(payload),
            ..pb::Invocation::default()
        };
        Self { invocation }
    }

    fn change(reason: pb::ChangeReason, old: Option<Value>, body: Value) -> Self {
        let payload = Payload::Change(pb::ResourceChange {
            reason: reason as i32,
            ..pb::ResourceChange::default()
        });
        let mut builder = Self::new(Some(&body), payload);
        let new = if reason == pb::ChangeReason::Delete {
            None
        } else {
            essence(Some(&body))
        };
        builder.set_change(essence(old.as_ref()), new);
        builder
    }

    fn set_change(&mut self, old: Option<Value>, new: Option<Value>) {
        if let Some(Payload::Change(change)) = &mut self.invocation.payload {
            let mut items = Vec::new();
            diff(old.as_ref(), new.as_ref(), &mut Vec::new(), &mut items);
            change.diff = items;
            change.old = old.as_ref().map(convert::json_to_pb);
            change.new = new.as_ref().map(convert::json_to_pb);
        }
    }

    /// A create handler's invocation for `body`.
    pub fn create(body: Value) -> Self {
        Self::change(pb::ChangeReason::Create, None, body)
    }

    /// An update handler's invocation for a change from `old` to `new`.
    pub fn update(old: Value, new: Value) -> Self {
        Self::change(pb::ChangeReason::Update, Some(old), new)
    }

    /// A delete handler's invocation for `body`.
    pub fn delete(body: Value) -> Self {
        Self::change(pb::ChangeReason::Delete, None, body)
    }

    /// A resume handler's invocation for `body`.
    pub fn resume(body: Value) -> Self {
        Self::change(pb::ChangeReason::Resume, None, body)
    }

    /// A field handler's invocation: the dotted `field` changed between `old` and `new` bodies.
    pub fn field(field: &str, old: Value, new: Value) -> Self {
        let old_value = lookup(&old, field).cloned();
        let new_value = lookup(&new, field).cloned();
        let mut items = Vec::new();
        diff(
            old_value.as_ref(),
            new_value.as_ref(),
            &mut Vec::new(),
            &mut items,
        );
        let payload = Payload::Change(pb::ResourceChange {
            reason: pb::ChangeReason::Update as i32,
            old: old_value.as_ref().map(convert::json_to_pb),
            new: new_value.as_ref().map(convert::json_to_pb),
            diff: items,
            field: field.to_owned(),
        });
        Self::new(Some(&new), payload)
    }

    /// An event handler's invocation.
    pub fn event(event_type: EventType, body: Value) -> Self {
        Self::new(
            Some(&body),
            Payload::Event(pb::ResourceEvent {
                r#type: event_type.to_pb() as i32,
            }),
        )
    }

    /// A daemon's invocation.
    pub fn daemon(body: Value) -> Self {
        Self::new(Some(&body), Payload::Daemon(pb::DaemonStart { restarts: 0 }))
    }

    /// A timer tick.
    pub fn timer(body: Value) -> Self {
        let tick = pb::TimerTick {
            scheduled_time: Some(convert::timestamp_to_pb(SystemTime::now())),
        };
        Self::new(Some(&body), Payload::Timer(tick))
    }

    /// An index handler's invocation.
    pub fn index(body: Value) -> Self {
        Self::new(Some(&body), Payload::Index(pb::IndexRequest { deleted: false }))
    }

    /// An index handler's invocation for an object that leaves the index.
    pub fn index_deleted(body: Value) -> Self {
        Self::new(Some(&body), Payload::Index(pb::IndexRequest { deleted: true }))
    }

    /// An admission handler's invocation of `operation`.
    pub fn admission(operation: Operation, body: Value) -> Self {
        let request = pb::AdmissionRequest {
            uid: "test-admission".to_owned(),
            operation: operation.as_str().to_owned(),
            ..pb::AdmissionRequest::default()
        };
        Self::new(Some(&body), Payload::Admission(request))
    }

    /// A startup, cleanup or login handler's invocation.
    pub fn activity(activity: Activity) -> Self {
        Self::new(
            None,
            Payload::Activity(pb::ActivityRequest {
                activity: activity.to_pb() as i32,
            }),
        )
    }

    /// A probe handler's invocation.
    pub fn probe() -> Self {
        Self::new(None, Payload::Probe(pb::ProbeRequest {}))
    }

    /// The 1-based attempt number (`Context::retry` is one less).
    pub fn attempt(mut self, attempt: u32) -> Self {
        self.invocation.attempt = attempt.max(1);
        self
    }

    /// Attempts already made (kopf's `retry`).
    pub fn retry(self, retry: u32) -> Self {
        self.attempt(retry.saturating_add(1))
    }

    /// The registration's `param`.
    pub fn param(mut self, param: Value) -> Self {
        self.invocation.param = Some(convert::json_to_pb(&param));
        self
    }

    /// When the first attempt started.
    pub fn started(mut self, started: SystemTime) -> Self {
        self.invocation.started_time = Some(convert::timestamp_to_pb(started));
        self
    }

    /// A deadline `timeout` from now; the handler is cancelled when it passes.
    pub fn deadline_in(mut self, timeout: Duration) -> Self {
        self.invocation.deadline = Some(convert::timestamp_to_pb(SystemTime::now() + timeout));
        self
    }

    /// The persisted state of one sub-handler.
    pub fn subhandler_state(mut self, state: SubhandlerState) -> Self {
        self.invocation
            .subhandlers
            .retain(|s| s.subhandler_id != state.id);
        self.invocation.subhandlers.push(state.to_pb());
        self
    }

    /// For admission requests: the object before the operation.
    pub fn old_object(mut self, old: Value) -> Self {
        if let Some(Payload::Admission(request)) = &mut self.invocation.payload {
            request.old_object = Some(convert::json_to_pb(&old));
        }
        self
    }

    /// For admission requests: a dry run.
    pub fn dry_run(mut self, dry_run: bool) -> Self {
        if let Some(Payload::Admission(request)) = &mut self.invocation.payload {
            request.dry_run = dry_run;
        }
        self
    }

    /// The next attempt after `previous`, as the controller would send it once the retry delay
    /// has passed: attempt + 1 and the sub-handler states updated from `previous`'s outcomes.
    pub fn after(mut self, previous: &Outcome) -> Self {
        self.invocation.attempt = previous.invocation.attempt.saturating_add(1);
        self.invocation.started_time = previous.invocation.started_time;
        let mut states = previous.invocation.subhandlers.clone();
        for sub in &previous.result.subhandlers {
            let index = match states.iter().position(|s| s.subhandler_id == sub.subhandler_id) {
                Some(index) => index,
                None => {
                    states.push(pb::SubhandlerState {
                        subhandler_id: sub.subhandler_id.clone(),
                        started_time: previous.invocation.started_time,
                        ..pb::SubhandlerState::default()
                    });
                    states.len() - 1
                }
            };
            let state = &mut states[index];
            if matches!(sub.outcome, Some(pb::subhandler_outcome::Outcome::Deferred(_))) {
                // Left for a later call: no attempt counted.
                continue;
            }
            state.retries += 1;
            state.delayed_until = None;
            match &sub.outcome {
                Some(pb::subhandler_outcome::Outcome::Success(_)) => state.success = true,
                Some(pb::subhandler_outcome::Outcome::PermanentError(e)) => {
                    state.failure = true;
                    state.message = summary(&e.diagnostics).unwrap_or_default();
                }
                Some(pb::subhandler_outcome::Outcome::TemporaryError(e)) => {
                    state.message = summary(&e.diagnostics).unwrap_or_default();
                }
                Some(pb::subhandler_outcome::Outcome::UnclassifiedError(e)) => {
                    state.message = summary(&e.diagnostics).unwrap_or_default();
                }
                Some(pb::subhandler_outcome::Outcome::Deferred(_)) | None => {}
            }
        }
        for state in &mut states {
            state.delayed_until = None;
        }
        self.invocation.subhandlers = states;
        self
    }

    /// The wire invocation (the handler id and invocation id are filled in by the kit).
    #[cfg_attr(not(test), allow(dead_code, reason = "used by the dispatch tests"))]
    pub(crate) fn build(self) -> pb::Invocation {
        self.invocation
    }
}

fn summary(diagnostics: &[pb::Diagnostic]) -> Option<String> {
    diagnostics.first().map(|d| d.summary.clone())
}

/// What an invocation (or a sub-handler) ended with.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum OutcomeKind {
    /// It succeeded.
    Success,
    /// It will be retried after `retry_after` (`None`: the handler's backoff).
    TemporaryError {
        /// The requested delay.
        retry_after: Option<Duration>,
    },
    /// It failed for good.
    PermanentError,
    /// It failed with an unclassified error.
    UnclassifiedError,
    /// It stopped because of a cancel.
    Cancelled,
    /// The `when` filter rejected it.
    Skipped,
}

/// One log record a handler sent.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct LogEntry {
    /// The severity.
    pub level: LogLevel,
    /// The message.
    pub message: String,
    /// The Event reason, for records posted as Events.
    pub reason: String,
    /// The object an Event is posted on, when not the invocation's own.
    pub object: Option<ResourceRef>,
}

#[derive(Debug, Default)]
struct Records {
    logs: Vec<LogEntry>,
    updates: Vec<ProgressUpdate>,
}

impl Records {
    fn push(&mut self, message: pb::ConnectRequest) {
        match message.message {
            Some(Up::Log(record)) => self.logs.push(LogEntry {
                level: LogLevel::from_pb(record.level),
                message: record.message,
                reason: record.reason,
                object: record.object.as_ref().map(ResourceRef::from_pb),
            }),
            Some(Up::Update(update)) => self.updates.push(ProgressUpdate::from_pb(&update)),
            _ => {}
        }
    }
}

/// A running invocation, e.g. a daemon.
#[derive(Debug)]
pub struct Running {
    invocation: pb::Invocation,
    control: Control,
    task: JoinHandle<pb::InvocationResult>,
    drain: JoinHandle<()>,
    records: Arc<Mutex<Records>>,
}

impl Running {
    fn spawn(table: Arc<Table>, invocation: pb::Invocation) -> Self {
        let (outbox, mut rx) = Outbox::channel();
        let (done_tx, mut done_rx) = oneshot::channel::<()>();
        let records = Arc::new(Mutex::new(Records::default()));
        let sink = records.clone();
        let drain = tokio::spawn(async move {
            loop {
                tokio::select! {
                    biased;
                    message = rx.recv() => match message {
                        Some(message) => sink.lock().push(message),
                        None => break,
                    },
                    _ = &mut done_rx => {
                        while let Ok(message) = rx.try_recv() {
                            sink.lock().push(message);
                        }
                        break;
                    }
                }
            }
        });
        let control = Control::new();
        let task = tokio::spawn({
            let control = control.clone();
            let invocation = invocation.clone();
            async move {
                let result = dispatch::run(&table, invocation, control, outbox).await;
                let _ = done_tx.send(());
                result
            }
        });
        Self {
            invocation,
            control,
            task,
            drain,
            records,
        }
    }

    /// Asks the invocation to stop, as the controller does when a daemon's object goes away.
    pub fn cancel(&self) {
        self.control.cancel(CancelReason::ResourceDeleted.to_pb());
    }

    /// Asks the invocation to stop for a specific reason.
    pub fn cancel_with(&self, reason: CancelReason) {
        self.control.cancel(reason.to_pb());
    }

    /// Gives the running invocation a newer body of its object, as the controller does for a
    /// running daemon when its object changes (`ObjectUpdate`): from now on the handler's
    /// [`crate::Context::body`], `spec`, `meta`, `status`, `labels` and `annotations` show it.
    pub fn update_body(&self, body: Value) {
        self.control.update_body(body);
    }

    /// The log records sent so far.
    pub fn logs(&self) -> Vec<LogEntry> {
        self.records.lock().logs.clone()
    }

    /// The updates (progress patches) sent so far.
    pub fn updates(&self) -> Vec<ProgressUpdate> {
        self.records.lock().updates.clone()
    }

    /// Whether the invocation has ended.
    pub fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Waits for the invocation to end and returns its outcome.
    pub async fn join(self) -> Outcome {
        let result = match self.task.await {
            Ok(result) => result,
            Err(error) => pb::InvocationResult {
                invocation_id: self.invocation.invocation_id.clone(),
                outcome: Some(Wire::UnclassifiedError(pb::UnclassifiedError {
                    diagnostics: vec![pb::Diagnostic {
                        summary: error.to_string(),
                        ..pb::Diagnostic::default()
                    }],
                })),
                ..pb::InvocationResult::default()
            },
        };
        let _ = self.drain.await;
        let records = std::mem::take(&mut *self.records.lock());
        Outcome {
            invocation: self.invocation,
            result,
            logs: records.logs,
            updates: records.updates,
        }
    }
}

/// The outcome of one invocation in the test kit.
#[derive(Debug, Clone)]
pub struct Outcome {
    invocation: pb::Invocation,
    result: pb::InvocationResult,
    logs: Vec<LogEntry>,
    updates: Vec<ProgressUpdate>,
}

fn kind_of(outcome: Option<&Wire>) -> OutcomeKind {
    match outcome {
        Some(Wire::Success(_)) => OutcomeKind::Success,
        Some(Wire::TemporaryError(e)) => OutcomeKind::TemporaryError {
            retry_after: e.retry_after.as_ref().map(convert::duration_from_pb),
        },
        Some(Wire::PermanentError(_)) => OutcomeKind::PermanentError,
        Some(Wire::Cancelled(_)) => OutcomeKind::Cancelled,
        Some(Wire::Skipped(_)) => OutcomeKind::Skipped,
        Some(Wire::UnclassifiedError(_)) | None => OutcomeKind::UnclassifiedError,
    }
}

fn sub_kind_of(outcome: Option<&pb::subhandler_outcome::Outcome>) -> OutcomeKind {
    use pb::subhandler_outcome::Outcome as Sub;
    match outcome {
        Some(Sub::Success(_)) => OutcomeKind::Success,
        Some(Sub::TemporaryError(e)) => OutcomeKind::TemporaryError {
            retry_after: e.retry_after.as_ref().map(convert::duration_from_pb),
        },
        Some(Sub::PermanentError(_)) => OutcomeKind::PermanentError,
        Some(Sub::Deferred(_)) => OutcomeKind::Skipped,
        Some(Sub::UnclassifiedError(_)) | None => OutcomeKind::UnclassifiedError,
    }
}

impl Outcome {
    /// The handler id invoked.
    pub fn handler_id(&self) -> &str {
        &self.invocation.handler_id
    }

    /// The attempt number of this invocation (1-based).
    pub fn attempt(&self) -> u32 {
        self.invocation.attempt
    }

    /// How it ended.
    pub fn kind(&self) -> OutcomeKind {
        kind_of(self.result.outcome.as_ref())
    }

    /// Whether it succeeded.
    pub fn is_success(&self) -> bool {
        self.kind() == OutcomeKind::Success
    }

    /// The returned value, on success.
    pub fn value(&self) -> Option<Value> {
        match &self.result.outcome {
            Some(Wire::Success(success)) => convert::json_from_pb(success.result.as_ref()).ok().flatten(),
            _ => None,
        }
    }

    /// The first diagnostic's summary, for failures.
    pub fn message(&self) -> Option<String> {
        match &self.result.outcome {
            Some(Wire::TemporaryError(e)) => summary(&e.diagnostics),
            Some(Wire::PermanentError(e)) => summary(&e.diagnostics),
            Some(Wire::UnclassifiedError(e)) => summary(&e.diagnostics),
            _ => None,
        }
    }

    /// The admission verdict, for validating and mutating handlers.
    pub fn verdict(&self) -> Option<AdmissionVerdict> {
        match &self.result.outcome {
            Some(Wire::Success(pb::Success {
                kind_result: Some(pb::success::KindResult::Admission(v)),
                ..
            })) => Some(AdmissionVerdict::from_pb(v)),
            _ => None,
        }
    }

    /// The patches sent with the result.
    pub fn patches(&self) -> Vec<PatchDocument> {
        self.result.patches.iter().map(PatchDocument::from_pb).collect()
    }

    /// The invocation's body with the result applied as the controller would: on success the
    /// patches, the result value at `status.<handler id>`, and each successful sub-handler's
    /// value at `status.<handler id>/<sub-handler id>`. Failed attempts change nothing.
    pub fn patched_body(&self) -> Value {
        let mut body = convert::json_from_pb(self.invocation.body.as_ref())
            .ok()
            .flatten()
            .unwrap_or(Value::Null);
        if self.is_success() {
            self.apply(&mut body);
        }
        body
    }

    fn apply(&self, body: &mut Value) {
        for patch in &self.result.patches {
            let Ok(Some(document)) = convert::json_from_pb(patch.body.as_ref()) else {
                continue;
            };
            if patch.r#type == pb::PatchType::Json as i32 {
                if let Ok(operations) = serde_json::from_value::<json_patch::Patch>(document) {
                    let _ = json_patch::patch(body, &operations);
                }
            } else {
                apply_merge(body, &document);
            }
        }
        let mut status = Map::new();
        if let Some(value) = self.value() {
            status.insert(self.handler_id().to_owned(), value);
        }
        for sub in &self.result.subhandlers {
            if let Some(pb::subhandler_outcome::Outcome::Success(success)) = &sub.outcome
                && let Ok(Some(value)) = convert::json_from_pb(success.result.as_ref())
            {
                status.insert(format!("{}/{}", self.handler_id(), sub.subhandler_id), value);
            }
        }
        if !status.is_empty() {
            let mut patch = Map::new();
            patch.insert("status".to_owned(), Value::Object(status));
            apply_merge(body, &Value::Object(patch));
        }
    }

    /// The log records the handler sent.
    pub fn logs(&self) -> &[LogEntry] {
        &self.logs
    }

    /// The updates (progress patches) the handler sent while running.
    pub fn updates(&self) -> &[ProgressUpdate] {
        &self.updates
    }

    /// The sub-handlers that ran in this invocation, in order, with their outcomes.
    pub fn subhandlers(&self) -> Vec<(String, OutcomeKind)> {
        self.result
            .subhandlers
            .iter()
            .map(|s| (s.subhandler_id.clone(), sub_kind_of(s.outcome.as_ref())))
            .collect()
    }

    /// The outcome of one sub-handler, if it ran in this invocation.
    pub fn subhandler(&self, id: &str) -> Option<OutcomeKind> {
        self.subhandlers()
            .into_iter()
            .find(|(sub, _)| sub == id)
            .map(|(_, kind)| kind)
    }

    fn has_unfinished_subhandlers(&self) -> bool {
        let finished_before = |id: &str| {
            self.invocation
                .subhandlers
                .iter()
                .any(|s| s.subhandler_id == id && (s.success || s.failure))
        };
        let ran = self.subhandlers();
        let failing_now = ran.iter().any(|(_, kind)| {
            matches!(
                kind,
                OutcomeKind::TemporaryError { .. } | OutcomeKind::UnclassifiedError
            )
        });
        let waiting =
            self.invocation.subhandlers.iter().any(|s| {
                !finished_before(&s.subhandler_id) && !ran.iter().any(|(id, _)| id == &s.subhandler_id)
            });
        failing_now || waiting
    }

    fn subhandler_delays(&self) -> Vec<Duration> {
        self.subhandlers()
            .into_iter()
            .filter_map(|(_, kind)| match kind {
                OutcomeKind::TemporaryError { retry_after } => Some(retry_after.unwrap_or_default()),
                OutcomeKind::UnclassifiedError => Some(Duration::ZERO),
                _ => None,
            })
            .collect()
    }

    /// The diagnostics of a failure (temporary, permanent or unclassified); empty otherwise.
    pub fn diagnostics(&self) -> Vec<Diagnostic> {
        let diagnostics = match &self.result.outcome {
            Some(Wire::TemporaryError(e)) => &e.diagnostics,
            Some(Wire::PermanentError(e)) => &e.diagnostics,
            Some(Wire::UnclassifiedError(e)) => &e.diagnostics,
            _ => return Vec::new(),
        };
        diagnostics.iter().map(Diagnostic::from_pb).collect()
    }
}

/// The outcomes of all handlers run for one change or event, in registration order.
#[derive(Debug, Clone)]
pub struct Outcomes {
    body: Value,
    outcomes: Vec<Outcome>,
}

impl Outcomes {
    /// The outcome of one handler, if it ran.
    pub fn get(&self, handler_id: &str) -> Option<&Outcome> {
        self.outcomes.iter().find(|o| o.handler_id() == handler_id)
    }

    /// The ids of the handlers that ran.
    pub fn handler_ids(&self) -> Vec<&str> {
        self.outcomes.iter().map(Outcome::handler_id).collect()
    }

    /// All outcomes.
    pub fn iter(&self) -> impl Iterator<Item = &Outcome> {
        self.outcomes.iter()
    }

    /// How many handlers ran.
    pub fn len(&self) -> usize {
        self.outcomes.len()
    }

    /// Whether no handler ran.
    pub fn is_empty(&self) -> bool {
        self.outcomes.is_empty()
    }

    /// The body with the results of every successful handler applied, in order.
    pub fn patched_body(&self) -> Value {
        let mut body = self.body.clone();
        for outcome in self.outcomes.iter().filter(|o| o.is_success()) {
            outcome.apply(&mut body);
        }
        body
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn essence_and_diff_follow_kopf() {
        let old = json!({"metadata": {"name": "a", "labels": {"x": "1"}}, "spec": {"a": 1, "l": [1]}, "status": {"s": 1}});
        let new = json!({"metadata": {"name": "a"}, "spec": {"a": 2, "l": [1, 2], "b": true}});
        let (old, new) = (essence(Some(&old)), essence(Some(&new)));
        assert_eq!(
            old,
            Some(json!({"metadata": {"labels": {"x": "1"}}, "spec": {"a": 1, "l": [1]}}))
        );
        let mut items = Vec::new();
        diff(old.as_ref(), new.as_ref(), &mut Vec::new(), &mut items);
        let summary: Vec<(i32, String)> = items.iter().map(|i| (i.operation, i.path.join("."))).collect();
        assert_eq!(
            summary,
            vec![
                (pb::DiffOperation::Remove as i32, "metadata".to_owned()),
                (pb::DiffOperation::Change as i32, "spec.a".to_owned()),
                (pb::DiffOperation::Add as i32, "spec.b".to_owned()),
                (pb::DiffOperation::Change as i32, "spec.l".to_owned()),
            ]
        );
    }

    #[test]
    fn resource_refs_come_from_the_body() {
        let body = json!({"apiVersion": "demo.capstan.dev/v1", "kind": "Example",
            "metadata": {"name": "a", "namespace": "ns", "uid": "u1", "generation": 2}});
        let r = resource_of(&body);
        assert_eq!(
            (r.group.as_str(), r.version.as_str(), r.plural.as_str()),
            ("demo.capstan.dev", "v1", "examples")
        );
        assert_eq!(
            (
                r.namespace.as_str(),
                r.name.as_str(),
                r.uid.as_str(),
                r.generation
            ),
            ("ns", "a", "u1", 2)
        );
        assert_eq!(
            resource_of(&json!({"apiVersion": "v1", "kind": "Pod"})).version,
            "v1"
        );
    }
}
