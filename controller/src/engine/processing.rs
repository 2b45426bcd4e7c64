//! One processing cycle for one object: decide the cause, run every ready change handler in
//! registration order, and fold all of it into one desired body.
//!
//! This is where "one write per handled change" comes from. kopf runs one handler per cycle
//! and writes after each; here every handler that is ready runs in the same cycle, each seeing
//! the earlier handlers' patches applied locally, and the cycle's result is a single desired
//! body: handler patches, results at `status.<id>`, progress records and — once the cause is
//! done — the purge of those records and the new diff-base. The diff-base is the essence
//! *after* the handlers' own patches, so a handler that labels its object does not cause an
//! update of its own (kopf stores the essence before the patches and re-triggers). The
//! object's worker (`engine::queue`) hands the plan to `engine::writing`, which turns the
//! difference between the original and the desired body into one PATCH (plus one `/status`
//! PATCH where the status subresource requires it). The cycle's steps are in `cycle`.
//!
//! Nothing here talks to the API; handlers are reached through an [`Invoker`], checkpoints
//! are written through a [`Checkpoint`].

use std::{
    collections::BTreeSet,
    time::{Duration, SystemTime},
};

use futures::future::BoxFuture;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use crate::{model::Level, observability::workqueue::Reconciled};

use super::{
    causes::{self, Cause, Facts},
    diff,
    essence::{self, Rules},
    execution::{self, Verdict},
    matching::{self, Subject},
};
use crate::{
    grpc::Control,
    model::{
        ChangeReason, Diagnostic, EventType, HandlerId, HandlerKind, Outcome, Patch, PatchType, Payload,
        Registration, ResolvedResource, ResourceRef, SubhandlerState, Work,
    },
    persistence::{
        DiffBaseStorage, Keys, ProgressRecord, ProgressStorage,
        diffbase::{DiffBase, Extent, Watched},
        progress::object_at,
        time,
    },
};

/// Calls handlers. The hub implements it; tests use fakes.
pub trait Invoker: Send + Sync {
    /// Runs one piece of work to its outcome, steered by `control`.
    fn invoke(&self, work: Work, control: Control) -> BoxFuture<'static, Outcome>;

    /// Tells the handler processes that an object is gone (they drop its memo).
    fn object_gone(&self, _object: &ResourceRef) {}

    /// How the process of `handler` wants its outcomes posted as Events.
    fn outcome_events(&self, _handler: &HandlerId) -> crate::model::posting::OutcomeEvents {
        crate::model::posting::OutcomeEvents::Default
    }
}

impl Invoker for crate::grpc::Hub {
    fn invoke(&self, work: Work, control: Control) -> BoxFuture<'static, Outcome> {
        let hub = self.clone();
        Box::pin(async move { hub.dispatch(work, control).await })
    }

    fn object_gone(&self, object: &ResourceRef) {
        crate::grpc::Hub::object_gone(self, object);
    }

    fn outcome_events(&self, handler: &HandlerId) -> crate::model::posting::OutcomeEvents {
        crate::grpc::Hub::outcome_events(self, handler)
    }
}

/// Writes the progress of a cycle that is still running (a checkpoint), so that handlers that
/// finished are not run again if the controller dies before the cycle's final write.
pub trait Checkpoint: Send + Sync {
    /// Writes `desired` over `base`; returns the body as stored, or `None` when it failed.
    fn save<'a>(&'a self, base: &'a Value, desired: &'a Value) -> BoxFuture<'a, Option<Value>>;
}

/// Where state is stored, and under which names.
#[derive(Clone, Debug)]
pub struct Storage {
    /// Key names and the finalizer.
    pub keys: Keys,
    /// Progress records.
    pub progress: ProgressStorage,
    /// The diff-base.
    pub diffbase: DiffBaseStorage,
    /// How much of the essence the diff-base keeps (`--diff-base`; always the full essence
    /// with kopf's persistence).
    pub diffbase_extent: Extent,
    /// Add finalizers when handlers need them (off in per-node mode unless asked for).
    pub finalizers: bool,
    /// Node-local storage: the records under the node's prefix live in files on the node,
    /// not on the objects (they are overlaid on the bodies the cycles see, and taken out of
    /// every write).
    pub local: Option<std::sync::Arc<crate::persistence::node_store::NodeStore>>,
    /// The resources whose `status.conditions` are maintained (`engine::conditions`); none by
    /// default, never per node.
    pub conditions: super::conditions::Selection,
}

impl Storage {
    /// Capstan's defaults under `prefix`: annotations for both progress and diff-base.
    pub fn annotations(prefix: &str) -> Self {
        let keys = Keys::new(prefix);
        Self {
            progress: ProgressStorage::Annotations(keys.clone()),
            diffbase: DiffBaseStorage::Annotations(keys.clone()),
            diffbase_extent: Extent::Fields,
            keys,
            finalizers: true,
            local: None,
            conditions: super::conditions::Selection::Off,
        }
    }
}

/// What the controller remembers about an object between cycles (in memory only).
#[derive(Clone, Copy, Debug, Default)]
pub struct Memory {
    /// The object was first seen in a listing (not a watch event).
    pub noticed_by_listing: bool,
    /// A cause was fully handled once in this process (resume handlers stop).
    pub fully_handled_once: bool,
}

/// Everything one cycle looks at.
pub struct Input<'a> {
    /// The object's current body.
    pub body: &'a Value,
    /// The watch event that brought it.
    pub event: EventType,
    /// Its resource.
    pub resource: &'a ResolvedResource,
    /// The resource's handlers, in registration order.
    pub handlers: &'a [Registration],
    /// In-memory facts.
    pub memory: Memory,
    /// Storage configuration.
    pub storage: &'a Storage,
    /// Cancelled when the controller stops or pauses.
    pub cancel: &'a CancellationToken,
    /// Writes checkpoints; `None` never checkpoints.
    pub checkpoint: Option<&'a dyn Checkpoint>,
    /// A handler still running this long triggers a checkpoint of the handlers of the cycle
    /// that finished before it, and of its start where its timeout needs it.
    pub checkpoint_after: Duration,
    /// Daemons or timers of the object are still running: its finalizer must stay until they
    /// have stopped.
    pub daemons_alive: bool,
    /// After this many consecutive attempts lost with their handler process, a handler fails
    /// for good (the poison-pill guard).
    pub max_losses: u32,
    /// The resource's handlers as they change: a handler withdrawn while the cycle waits for
    /// it (its process left) interrupts the cycle, which runs again with the handlers then
    /// registered — instead of waiting for a process that may never come back. `None`: the
    /// handlers never change.
    pub registered: Option<tokio::sync::watch::Receiver<std::sync::Arc<Vec<Registration>>>>,
}

/// A change to our finalizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinalizerChange {
    /// Leave it as it is.
    Keep,
    /// Add it (written on its own, before any handler runs).
    Add,
    /// Remove it.
    Remove,
}

/// A handler whose patches are included in the desired body: if the API rejects them, it is
/// recorded as a failed attempt instead.
#[derive(Clone, Debug)]
pub struct Patched {
    /// The handler.
    pub registration: Registration,
    /// Its record before this cycle's attempt.
    pub record: ProgressRecord,
    /// Its record after the successful attempt.
    pub after: ProgressRecord,
    /// Its sub-handlers' records after the attempt, by full id.
    pub children: Vec<(String, ProgressRecord)>,
    /// What its patches and results changed, as a merge patch.
    pub delta: Value,
}

/// The result of a cycle.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The detected cause.
    pub cause: Cause,
    /// The body as last stored: the input body, or what a checkpoint wrote.
    pub base: Value,
    /// The desired body; `None` when nothing is to be written apart from the finalizer.
    pub desired: Option<Value>,
    /// The desired body without any handler patches or results (bookkeeping only), for when
    /// the API rejects the handlers' patches. Handlers in `patched` get failure records then.
    pub fallback: Option<Value>,
    /// The handlers whose patches are in `desired` but not in `fallback`.
    pub patched: Vec<Patched>,
    /// The finalizer change.
    pub finalizer: FinalizerChange,
    /// When to run the next cycle if no event comes first (delayed retries).
    pub wake_at: Option<SystemTime>,
    /// The cause is done (resume handlers stop for this object).
    pub done: bool,
    /// The cycle was interrupted (shutdown or pause) before every ready handler ran; what
    /// finished before is still in `desired`.
    pub interrupted: bool,
    /// What to report as Kubernetes Events: handler outcomes and the cause's completion.
    pub notes: Vec<Note>,
    /// Events with a reason of their own, always posted (a consumed retry request).
    pub announcements: Vec<(Level, &'static str, String)>,
    /// A handler failed in this cycle (to be retried, or for good).
    pub failed: bool,
    /// A handler that failed in this cycle is to be retried.
    pub retrying: bool,
}

impl Plan {
    fn idle(cause: Cause, base: &Value, finalizer: FinalizerChange) -> Self {
        Self {
            cause,
            base: base.clone(),
            desired: None,
            fallback: None,
            patched: Vec::new(),
            finalizer,
            wake_at: None,
            done: false,
            interrupted: false,
            notes: Vec::new(),
            announcements: Vec::new(),
            failed: false,
            retrying: false,
        }
    }
}

/// The essence rules for a resource's handlers.
pub fn rules(storage: &Storage, handlers: &[Registration]) -> Rules {
    let mut extra: Vec<Vec<String>> = handlers
        .iter()
        .filter(|h| !h.filters.field.is_empty() && h.kind != HandlerKind::Index)
        .map(|h| h.filters.field.clone())
        .collect();
    extra.sort();
    extra.dedup();
    Rules {
        prefix: storage.keys.prefix.clone(),
        diffbase_key: storage.diffbase.annotation_key().map(str::to_owned),
        extra_fields: extra,
    }
}

/// The essence paths whose old values the resource's handlers read, i.e. what the diff-base
/// must keep (`persistence::diffbase`).
///
/// Everything with `--diff-base full`, and when an update handler without a `field` is
/// registered: it gets the whole `old`, `new` and `diff`. Otherwise the `field` of every
/// update, field, resume and delete handler that has one (their `old`, `new`, `diff` and
/// filters are of the field). Create handlers never see an old state. The whole `old` and `diff` of resume and
/// delete handlers then show only the changes of watched fields: the documented cost of
/// `--diff-base fields`.
pub fn watched(storage: &Storage, handlers: &[Registration]) -> Watched {
    if storage.diffbase_extent == Extent::Full
        || handlers
            .iter()
            .any(|h| h.kind == HandlerKind::Update && h.filters.field.is_empty())
    {
        return Watched::All;
    }
    Watched::paths(
        handlers
            .iter()
            .filter(|h| {
                matches!(
                    h.kind,
                    HandlerKind::Update | HandlerKind::Field | HandlerKind::Resume | HandlerKind::Delete
                )
            })
            .filter(|h| !h.filters.field.is_empty())
            .map(|h| h.filters.field.clone()),
    )
}

/// The stored diff-base of `body`, a whole essence brought to the current rules (as kopf
/// reads it: fields no longer in the essence are left out).
fn fetch_diffbase(storage: &Storage, rules: &Rules, body: &Value) -> Option<DiffBase> {
    storage.diffbase.fetch(body).map(|stored| match stored {
        DiffBase::Essence(old) => DiffBase::Essence(rules.essence(&old)),
        fields @ DiffBase::Fields(_) => fields,
    })
}

/// Whether our finalizer is on the body.
pub fn has_finalizer(body: &Value, finalizer: &str) -> bool {
    body.pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .is_some_and(|f| f.iter().any(|x| x.as_str() == Some(finalizer)))
}

/// Runs one cycle.
///
/// Recorded as one reconcile of the resource (`controller_runtime_reconcile_*`, see
/// `observability::workqueue`).
pub async fn cycle(input: Input<'_>, invoker: &dyn Invoker) -> Plan {
    let started = tokio::time::Instant::now();
    let daemons_alive = input.daemons_alive;
    let metrics = crate::observability::metrics::global().workqueue(&input.resource.plural);
    let mut plan = cycle::run(input, invoker).await;
    if daemons_alive && plan.finalizer == FinalizerChange::Remove {
        debug!("daemons are still stopping; the finalizer stays for now");
        plan.finalizer = FinalizerChange::Keep;
    }
    if plan.retrying {
        metrics.retry();
    }
    metrics.reconciled(reconciled(&plan), started.elapsed());
    plan
}

/// How a cycle ended, in controller-runtime's terms.
fn reconciled(plan: &Plan) -> Reconciled {
    if plan.failed {
        Reconciled::Error
    } else if plan.interrupted {
        Reconciled::Requeue
    } else if plan.wake_at.is_some() {
        Reconciled::RequeueAfter
    } else {
        Reconciled::Success
    }
}

/// A cycle's message about its handlers (kopf's "Handler 'x' failed temporarily: …",
/// "Creation is processed: …"), posted as an Event where their processes want it.
#[derive(Clone, Debug)]
pub struct Note {
    /// Its level.
    pub level: Level,
    /// Its text.
    pub message: String,
    /// The handlers it is about: their processes' `ProcessSettings` decide whether it is
    /// posted ([`crate::model::posting::OutcomeEvents`]). Empty: the controller's settings.
    pub handlers: Vec<HandlerId>,
}

impl Note {
    /// A note about handlers.
    pub fn new(level: Level, message: String, handlers: Vec<HandlerId>) -> Self {
        Self {
            level,
            message,
            handlers,
        }
    }
}

/// One handler's part in a cycle.
#[derive(Clone)]
struct Step {
    registration: Registration,
    /// The record as stored before the cycle (for the current purpose).
    fetched: Option<ProgressRecord>,
    /// The record before this cycle's attempt.
    before: ProgressRecord,
    /// The record after it.
    record: ProgressRecord,
    children: Vec<Child>,
    /// Its patches or results are in the desired body.
    patched: bool,
    /// An SDK-side filter skipped it: done, nothing recorded.
    skipped: bool,
    /// What its patches and results changed, as a merge patch.
    delta: Value,
}

impl Step {
    fn with(mut self, record: ProgressRecord) -> Self {
        self.record = record;
        self
    }
}

#[derive(Clone)]
struct Child {
    id: String,
    fetched: Option<ProgressRecord>,
    record: ProgressRecord,
    result: Option<Value>,
}

/// Folds the steps into a desired body over `body` (the body as last stored). `complete` says
/// whether `steps` covers every selected handler (a checkpoint's does not).
#[allow(clippy::too_many_arguments)]
fn compose(
    body: &Value,
    running: Value,
    steps: &[Step],
    input: &Input<'_>,
    cause: Cause,
    rules: &Rules,
    diffbase: (Option<&DiffBase>, &Watched),
    mut finalizer: FinalizerChange,
    complete: bool,
) -> Plan {
    let storage = input.storage;
    let finished = complete && steps.iter().all(|s| s.record.finished() || s.skipped);
    // A deletion whose handlers finished while daemons are still stopping keeps its records
    // (and the finalizer) until they have stopped, so the handlers do not run again.
    let done = finished && !(cause == Cause::Delete && input.daemons_alive);
    let mut desired = running;
    let mut fallback = body.clone();
    let mut patched = Vec::new();
    let mut wake_at: Option<SystemTime> = None;
    for s in steps {
        if s.patched {
            patched.push(Patched {
                registration: s.registration.clone(),
                record: s.before.clone(),
                after: s.record.clone(),
                children: s
                    .children
                    .iter()
                    .map(|c| (c.id.clone(), c.record.clone()))
                    .collect(),
                delta: s.delta.clone(),
            });
        }
        if !s.record.finished()
            && let Some(t) = s.record.delayed_until()
        {
            wake_at = Some(wake_at.map_or(t, |w| w.min(t)));
        }
    }
    if done {
        let mut ids: BTreeSet<String> = input.handlers.iter().map(|h| h.id.0.clone()).collect();
        for s in steps {
            ids.extend(s.record.subrefs.iter().cloned());
            if let Some(f) = &s.fetched {
                ids.extend(f.subrefs.iter().cloned());
            }
        }
        for id in &ids {
            storage.progress.purge(id, &mut desired);
        }
        // The diff-base is the essence with the handlers' own patches applied: what the
        // handlers changed themselves is handled, and must not come back as an update.
        // Written only when it matters: an essence stored by kopf or an earlier Capstan whose
        // watched fields are those handled stays as it is.
        let handled = rules.essence(&desired);
        let (stored, watched) = diffbase;
        let next = DiffBase::of(&handled, watched);
        if cause != Cause::Delete && stored.is_none_or(|s| s.outdated_by(&next, &handled, watched)) {
            storage.diffbase.store(&next, &mut desired);
        }
        if cause == Cause::Delete {
            finalizer = FinalizerChange::Remove;
        }
        info!(%cause, handlers = steps.len(), "cause handled");
    } else {
        for s in steps {
            store_if_changed(
                storage,
                &s.registration.id.0,
                s.fetched.as_ref(),
                &s.record,
                &mut desired,
            );
            for c in &s.children {
                store_if_changed(storage, &c.id, c.fetched.as_ref(), &c.record, &mut desired);
            }
        }
    }
    // The fallback keeps every record except those of patching handlers, which become failed
    // attempts once the rejection's message is known.
    if !patched.is_empty() {
        for s in steps.iter().filter(|s| !s.patched) {
            store_if_changed(
                storage,
                &s.registration.id.0,
                s.fetched.as_ref(),
                &s.record,
                &mut fallback,
            );
        }
    }
    mark_managed(storage, &mut desired);
    mark_managed(storage, &mut fallback);
    let desired = (desired != *body).then_some(desired);
    let fallback = (!patched.is_empty()).then_some(fallback);
    if finalizer == FinalizerChange::Remove && !has_finalizer(body, &storage.keys.finalizer) {
        finalizer = FinalizerChange::Keep;
    }
    Plan {
        cause,
        base: body.clone(),
        desired,
        fallback,
        patched,
        finalizer,
        wake_at,
        done,
        interrupted: false,
        notes: Vec::new(),
        announcements: Vec::new(),
        failed: false,
        retrying: false,
    }
}

/// Marks our annotation prefix as an operator's (`<prefix>/kopf-managed`) whenever the body
/// carries any annotation under it, so that other operators — other nodes in per-node mode,
/// kopf — leave them out of their essences from the very first write (a progress record
/// written before the diff-base would otherwise look like a change to them).
pub(crate) fn mark_managed(storage: &Storage, body: &mut Value) {
    if storage.keys.prefix.starts_with("kopf.") {
        return;
    }
    let marker = format!("{}/{}", storage.keys.prefix, essence::MANAGED_MARKER);
    let ours = body
        .pointer("/metadata/annotations")
        .and_then(Value::as_object)
        .is_some_and(|a| a.keys().any(|k| k != &marker && storage.keys.owns(k)));
    if ours {
        object_at(body, &["metadata", "annotations"]).insert(marker, Value::String("yes".into()));
    }
}

fn store_if_changed(
    storage: &Storage,
    id: &str,
    fetched: Option<&ProgressRecord>,
    record: &ProgressRecord,
    body: &mut Value,
) {
    if fetched != Some(record) {
        storage.progress.store(id, record, body);
    }
}

/// Records in `body` that the API server rejected the patch of `patched`: a failed attempt,
/// retried after the handler's backoff (or final when its limits are reached).
pub fn reject(patched: &Patched, storage: &Storage, message: &str, body: &mut Value) {
    let mut record = patched.record.clone();
    let text = format!("the API server rejected the handler's patch: {message}");
    let _ = execution::retry(
        &patched.registration,
        &mut record,
        SystemTime::now(),
        patched.registration.backoff,
        &text,
    );
    storage.progress.store(&patched.registration.id.0, &record, body);
    mark_managed(storage, body);
}

/// Adds an accepted handler's changes and records to `body`.
pub fn accept(patched: &Patched, storage: &Storage, body: &mut Value) {
    if !patched.delta.is_null() {
        json_patch::merge(body, &patched.delta);
    }
    storage
        .progress
        .store(&patched.registration.id.0, &patched.after, body);
    for (id, record) in &patched.children {
        storage.progress.store(id, record, body);
    }
    mark_managed(storage, body);
}

/// The RFC 7386 merge patch that turns `from` into `to`; `None` when they are equal.
pub fn merge_diff(from: &Value, to: &Value) -> Option<Value> {
    match (from, to) {
        (Value::Object(a), Value::Object(b)) => {
            let mut out = serde_json::Map::new();
            for (k, vb) in b {
                match a.get(k) {
                    Some(va) => {
                        if let Some(d) = merge_diff(va, vb) {
                            out.insert(k.clone(), d);
                        }
                    }
                    None => {
                        out.insert(k.clone(), vb.clone());
                    }
                }
            }
            for k in a.keys() {
                if !b.contains_key(k) {
                    out.insert(k.clone(), Value::Null);
                }
            }
            (!out.is_empty()).then_some(Value::Object(out))
        }
        (a, b) if a == b => None,
        (_, b) => Some(b.clone()),
    }
}

fn subhandlers_of(outcome: &Outcome) -> Vec<crate::model::SubhandlerOutcome> {
    match outcome {
        Outcome::Success { subhandlers, .. }
        | Outcome::Temporary { subhandlers, .. }
        | Outcome::Permanent { subhandlers, .. }
        | Outcome::Unclassified { subhandlers, .. } => subhandlers.clone(),
        _ => Vec::new(),
    }
}

fn child_states(
    storage: &Storage,
    parent: &Registration,
    body: &Value,
    record: &ProgressRecord,
    resets: &[(String, ProgressRecord)],
) -> Vec<SubhandlerState> {
    let prefix = format!("{}/", parent.id);
    record
        .subrefs
        .iter()
        .filter_map(|full| {
            let short = full.strip_prefix(&prefix)?;
            let r = reset_of(resets, full).or_else(|| storage.progress.fetch(full, body))?;
            Some(SubhandlerState {
                id: short.to_owned(),
                retries: r.retries,
                success: r.success,
                failure: r.failure,
                delayed_until: r.delayed_until(),
                message: r.message.clone().unwrap_or_default(),
                started: r.started_at(),
            })
        })
        .collect()
}

#[allow(clippy::too_many_arguments)]
fn record_children(
    storage: &Storage,
    body: &Value,
    parent: &Registration,
    record: &mut ProgressRecord,
    step: &mut Step,
    reported: Vec<crate::model::SubhandlerOutcome>,
    resets: &[(String, ProgressRecord)],
    now: SystemTime,
) {
    for child in reported {
        let full = format!("{}/{}", parent.id, child.id);
        let mut reg = parent.clone();
        reg.id = HandlerId(full.clone());
        let fetched = storage
            .progress
            .fetch(&full, body)
            .filter(|r| r.purpose == record.purpose);
        let mut child_record = reset_of(resets, &full)
            .or_else(|| fetched.clone())
            .unwrap_or_else(|| ProgressRecord {
                started: Some(time::format(now)),
                purpose: record.purpose.clone(),
                ..ProgressRecord::default()
            });
        // A deferred sub-handler did not run: its record stays as it was (unfinished), and
        // keeps its parent unfinished, to be called again at once.
        let result = if matches!(child.outcome, Outcome::Skipped) {
            None
        } else {
            match execution::judge(&reg, &mut child_record, child.outcome, now) {
                Verdict::Success { result, .. } => result,
                _ => None,
            }
        };
        if !record.subrefs.contains(&full) {
            record.subrefs.push(full.clone());
            record.subrefs.sort();
        }
        step.children.push(Child {
            id: full,
            fetched,
            record: child_record,
            result,
        });
    }
}

/// A sub-handler's record as a retry request reset it, if it did.
fn reset_of(resets: &[(String, ProgressRecord)], full: &str) -> Option<ProgressRecord> {
    resets.iter().find(|(id, _)| id == full).map(|(_, r)| r.clone())
}

/// The sub-handlers of the parent that keep it unfinished: those reported now and not
/// finished, and those persisted earlier, not reported now, still waiting for a delay that had
/// not passed when the call was made (an SDK leaves such ones out). One not reported that was
/// due is no longer declared, or its filter no longer matches: it keeps nothing open, as a
/// handler that no longer matches does not in kopf.
fn unfinished_children(
    storage: &Storage,
    body: &Value,
    record: &ProgressRecord,
    children: &[Child],
    now: SystemTime,
) -> Vec<ProgressRecord> {
    let reported = children
        .iter()
        .filter(|c| !c.record.finished())
        .map(|c| c.record.clone());
    let waiting = record
        .subrefs
        .iter()
        .filter(|id| !children.iter().any(|c| &c.id == *id))
        .filter_map(|id| storage.progress.fetch(id, body))
        .filter(|r| !r.finished() && r.delayed_until().is_some_and(|due| due > now));
    reported.chain(waiting).collect()
}

/// Keeps the parent unfinished, due when its earliest unfinished sub-handler is (a deferred
/// one, without a delay, at once).
fn reopen_for_children(record: &mut ProgressRecord, unfinished: &[ProgressRecord], now: SystemTime) {
    record.success = false;
    record.stopped = None;
    let next = unfinished
        .iter()
        .map(|r| r.delayed_until().unwrap_or(now))
        .min()
        .unwrap_or(now);
    record.delayed = Some(time::format(next));
    record.message = Some("sub-handlers are not finished yet".into());
}

/// Stores a handler's result at `status.<id>` (an object result is merged into what is there).
pub(crate) fn store_result(body: &mut Value, id: &str, result: Value) {
    let status = object_at(body, &["status"]);
    match (status.get_mut(id), result) {
        (Some(Value::Object(existing)), Value::Object(new)) => existing.extend(new),
        (_, result) => {
            status.insert(id.to_owned(), result);
        }
    }
}

/// Applies handler patches to a local body.
///
/// # Errors
/// A diagnostic when a JSON patch does not apply (e.g. a `test` fails or a path is missing).
pub fn apply_patches(body: &mut Value, patches: &[Patch]) -> Result<(), Diagnostic> {
    for p in patches {
        match p.patch_type {
            PatchType::Merge => json_patch::merge(body, &p.body),
            PatchType::Json => {
                let ops: json_patch::Patch = serde_json::from_value(p.body.clone())
                    .map_err(|e| Diagnostic::error("MALFORMED_PATCH", format!("not a JSON patch: {e}")))?;
                json_patch::patch(body, &ops).map_err(|e| {
                    Diagnostic::error(
                        "PATCH_DOES_NOT_APPLY",
                        format!("the JSON patch does not apply: {e}"),
                    )
                })?;
            }
        }
    }
    Ok(())
}

/// The reference of an object, from its body.
pub fn object_ref(resource: &ResolvedResource, body: &Value) -> ResourceRef {
    let meta = |k: &str| {
        body.pointer(&format!("/metadata/{k}"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    ResourceRef {
        resource: resource.clone(),
        namespace: meta("namespace"),
        name: meta("name"),
        uid: meta("uid"),
        resource_version: meta("resourceVersion"),
        generation: body
            .pointer("/metadata/generation")
            .and_then(Value::as_i64)
            .unwrap_or(0),
    }
}

#[allow(clippy::too_many_arguments)]
fn work(
    input: &Input<'_>,
    reg: &Registration,
    reason: ChangeReason,
    record: &ProgressRecord,
    running: &Value,
    old: Option<&Value>,
    new: &Value,
    subhandlers: Vec<SubhandlerState>,
) -> Work {
    let object = object_ref(input.resource, input.body);
    let started = record.started_at().unwrap_or_else(SystemTime::now);
    // As kopf: every changing handler with a `field` (not only field handlers) is given the
    // field's old and new values and the diff reduced to it.
    let (old_v, new_v, items, field) = if !reg.filters.field.is_empty() {
        let field = &reg.filters.field;
        let all = diff::diff(old, Some(new));
        (
            old.and_then(|o| essence::lookup(o, field)).cloned(),
            essence::lookup(new, field).cloned(),
            diff::reduce(&all, field),
            field.join("."),
        )
    } else {
        (
            old.cloned(),
            Some(new.clone()),
            diff::diff(old, Some(new)),
            String::new(),
        )
    };
    let mut work = Work::new(
        reg.id.0.clone(),
        format!(
            "{}/{}/{}/{}",
            object.uid,
            reg.id,
            causes::purpose(reason),
            record.started.as_deref().unwrap_or_default()
        ),
        Payload::Change {
            reason,
            old: old_v,
            new: new_v,
            diff: items,
            field,
        },
    );
    work.attempt = record.retries + 1;
    work.started = started;
    work.attempt_timeout = reg.timeout.map(|t| {
        let spent = SystemTime::now().duration_since(started).unwrap_or_default();
        t.saturating_sub(spent).max(Duration::from_millis(100))
    });
    work.object = Some(object);
    work.body = Some(running.clone());
    work.param = reg.param.clone();
    work.last_error = execution::last_error(record);
    work.report_losses = true;
    work.subhandlers = subhandlers;
    work
}

mod cycle;
mod retrying;

#[cfg(test)]
mod tests;

#[cfg(test)]
mod operating_tests;

#[cfg(test)]
mod diffbase_tests;
