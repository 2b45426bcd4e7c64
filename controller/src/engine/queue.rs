//! Per-object serial queues: one worker per object (by uid), objects in parallel under a global
//! limit, and a newer version of an object superseding an older one still waiting.
//!
//! A worker takes the latest pending event of its object, runs a processing cycle, writes the
//! result (one PATCH, plus `/status` where needed), and repeats while events keep coming; then
//! it exits, keeping only the object's small memory. Delayed retries are scheduled here by the
//! controller's own timer, never by "touch" patches. After our own write, events older than the
//! version it produced are stale echoes and are dropped before they reach a cycle.

use std::{
    collections::HashMap,
    sync::Arc,
    time::{Duration, SystemTime},
};

use parking_lot::Mutex;
use serde_json::{Map, Value};
use tokio::{
    sync::{Semaphore, watch},
    task::JoinHandle,
};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use super::{
    execution,
    matching::{self, Subject},
    processing::{self, FinalizerChange, Input, Invoker, Memory, Plan, Storage, merge_diff},
};
use crate::{
    k8s::objects::{self, Objects},
    model::{EventType, HandlerKind, Outcome, Payload, Registration, ResolvedResource, Work},
};
use crate::{model::ErrorsMode, persistence::ProgressRecord};

/// Shared by all objects of one resource.
pub struct Context {
    /// The resource.
    pub resource: ResolvedResource,
    /// Its current handlers, in registration order.
    pub handlers: watch::Receiver<Arc<Vec<Registration>>>,
    /// Storage configuration.
    pub storage: Storage,
    /// Calls handlers.
    pub invoker: Arc<dyn Invoker>,
    /// Reads and writes objects.
    pub objects: Objects,
    /// The global limit of concurrently processed objects.
    pub limit: Arc<Semaphore>,
    /// Checkpoint a cycle when a handler runs longer than this after others finished.
    pub checkpoint_after: Duration,
    /// The resource's daemons and timers.
    pub daemons: super::daemons::Daemons,
    /// Whether dispatch is paused (daemons do not run then).
    pub paused: watch::Receiver<bool>,
    /// Posts Kubernetes Events.
    pub poster: super::posting::Poster,
    /// Cancelled at shutdown (and while paused).
    pub cancel: CancellationToken,
}

/// The queues of one resource.
#[derive(Clone)]
pub struct Queue {
    ctx: Arc<Context>,
    slots: Arc<Mutex<HashMap<String, Slot>>>,
}

#[derive(Default)]
struct Slot {
    pending: Option<(EventType, Stored)>,
    running: bool,
    memory: Memory,
    last_body: Option<Stored>,
    written_rv: Option<u64>,
    timer: Option<JoinHandle<()>>,
    gone: bool,
    /// Run another cycle with the latest body once the current one ends.
    rerun: bool,
}

fn uid_of(body: &Value) -> Option<String> {
    body.pointer("/metadata/uid")
        .and_then(Value::as_str)
        .map(str::to_owned)
}

fn rv_of(body: &Value) -> Option<u64> {
    body.pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .and_then(|s| s.parse().ok())
}

impl Queue {
    /// Empty queues for one resource.
    pub fn new(ctx: Context) -> Self {
        Self {
            ctx: Arc::new(ctx),
            slots: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// How many objects are known.
    pub fn len(&self) -> usize {
        self.slots.lock().len()
    }

    /// Whether no object is known.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Handles a watch event: calls the event handlers (fire and forget, as kopf) and queues
    /// the event for the object's change handlers.
    pub fn observe(&self, event_type: EventType, body: Value) {
        self.dispatch_event_handlers(event_type, &body);
        self.push(event_type, body);
    }

    fn dispatch_event_handlers(&self, event_type: EventType, body: &Value) {
        let handlers = self.ctx.handlers.borrow().clone();
        let subject = Subject {
            body,
            old: None,
            new: None,
        };
        // Event handlers that opted into retries run in the object's worker instead.
        let fire_and_forget =
            |h: &&Registration| h.kind == HandlerKind::Event && h.errors != ErrorsMode::Temporary;
        for reg in handlers
            .iter()
            .filter(fire_and_forget)
            .filter(|h| matching::prematch(h, subject))
        {
            let object = processing::object_ref(&self.ctx.resource, body);
            let key = format!("{}/{}/{}", object.uid, reg.id, object.resource_version);
            let mut work = Work::new(reg.id.0.clone(), key, Payload::Event { event_type });
            work.object = Some(object);
            work.body = Some(body.clone());
            work.param = reg.param.clone();
            work.cancel = self.ctx.cancel.child_token();
            let invoker = self.ctx.invoker.clone();
            let id = reg.id.clone();
            tokio::spawn(
                async move {
                    match invoker.invoke(work).await {
                        Outcome::Success { .. } | Outcome::Skipped => debug!("event handler succeeded"),
                        other => warn!(
                            outcome = other.as_str(),
                            "event handler failed; not retried (as kopf)"
                        ),
                    }
                }
                .instrument(info_span!("event", handler.id = %id)),
            );
        }
    }

    /// Queues an event; starts the object's worker if it is idle.
    pub fn push(&self, event_type: EventType, body: Value) {
        let Some(uid) = uid_of(&body) else {
            warn!("an object without a uid was ignored");
            return;
        };
        let mut slots = self.slots.lock();
        let slot = slots.entry(uid.clone()).or_insert_with(|| Slot {
            memory: Memory {
                noticed_by_listing: event_type == EventType::Listing,
                fully_handled_once: false,
            },
            ..Slot::default()
        });
        if event_type != EventType::Deleted
            && let (Some(written), Some(rv)) = (slot.written_rv, rv_of(&body))
            && rv < written
        {
            debug!(%uid, rv, written, "stale event older than our own write dropped");
            return;
        }
        if slot.pending.is_none() {
            crate::observability::metrics::global().pending(&self.ctx.resource.plural, 1);
        }
        slot.pending = Some((event_type, Stored::new(&body)));
        if !slot.running {
            slot.running = true;
            let queue = self.clone();
            tokio::spawn(async move { queue.work(uid).await });
        }
    }

    /// Re-runs a cycle for every known object with its latest body (after the handlers
    /// changed: new handlers to run, finalizers to add or release).
    pub fn resync(&self) {
        let bodies: Vec<Value> = {
            let slots = self.slots.lock();
            slots
                .values()
                .filter(|s| !s.gone && s.pending.is_none())
                .filter_map(|s| s.last_body.as_ref().map(Stored::value))
                .collect()
        };
        debug!(
            objects = bodies.len(),
            "handlers changed; re-processing known objects"
        );
        for body in bodies {
            self.push(EventType::Modified, body);
        }
    }

    /// Whether both handles are the same queue.
    pub fn same(&self, other: &Queue) -> bool {
        Arc::ptr_eq(&self.slots, &other.slots)
    }

    /// The latest known bodies of all objects (for cleanups across objects).
    pub fn bodies(&self) -> Vec<Value> {
        self.slots
            .lock()
            .values()
            .filter(|s| !s.gone)
            .filter_map(|s| s.last_body.as_ref().map(Stored::value))
            .collect()
    }

    /// Stops every timer (at shutdown).
    pub fn stop_timers(&self) {
        for slot in self.slots.lock().values_mut() {
            if let Some(t) = slot.timer.take() {
                t.abort();
            }
        }
    }

    async fn work(self, uid: String) {
        loop {
            let next = {
                let mut slots = self.slots.lock();
                let Some(slot) = slots.get_mut(&uid) else { return };
                let taken = slot.pending.take();
                if taken.is_some() {
                    crate::observability::metrics::global().pending(&self.ctx.resource.plural, -1);
                }
                match taken {
                    // Events that arrived while our own write was in flight may predate it.
                    Some((t, body))
                        if t != EventType::Deleted
                            && matches!((slot.written_rv, body.rv), (Some(w), Some(rv)) if rv < w) =>
                    {
                        debug!(%uid, "stale event older than our own write dropped");
                        continue;
                    }
                    Some(next) => Some((next, slot.memory)),
                    None if slot.rerun && !slot.gone && slot.last_body.is_some() => {
                        slot.rerun = false;
                        slot.last_body
                            .clone()
                            .map(|b| ((EventType::Modified, b), slot.memory))
                    }
                    None => {
                        slot.running = false;
                        if slot.gone {
                            slots.remove(&uid);
                        }
                        None
                    }
                }
            };
            let Some(((event_type, stored), memory)) = next else {
                return;
            };
            let body = stored.value();
            if *self.ctx.paused.borrow() && event_type != EventType::Deleted {
                // Paused (frozen, standby, draining): nothing is processed or written; the
                // newest body is kept for when dispatch resumes.
                let mut slots = self.slots.lock();
                if let Some(slot) = slots.get_mut(&uid) {
                    slot.last_body = Some(stored);
                    slot.running = false;
                    if slot.pending.is_none() {
                        return;
                    }
                    slot.running = true;
                }
                continue;
            }
            if self.ctx.cancel.is_cancelled() {
                self.slots.lock().remove(&uid);
                return;
            }
            let Ok(_permit) = self.ctx.limit.clone().acquire_owned().await else {
                return;
            };
            let name = body
                .pointer("/metadata/name")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            let namespace = body
                .pointer("/metadata/namespace")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            let span = info_span!("object", object.resource = %self.ctx.resource.plural, object.namespace = %namespace, object.name = %name, object.uid = %uid);
            self.process(&uid, event_type, body, memory)
                .instrument(span)
                .await;
        }
    }

    async fn process(&self, uid: &str, event_type: EventType, body: Value, memory: Memory) {
        if event_type == EventType::Deleted {
            self.ctx.daemons.forget(uid);
            let mut slots = self.slots.lock();
            if let Some(slot) = slots.get_mut(uid) {
                if let Some(t) = slot.timer.take() {
                    t.abort();
                }
                slot.gone = true;
            }
            debug!("object is gone; forgotten");
            return;
        }
        let handlers = self.ctx.handlers.borrow().clone();
        let paused = *self.ctx.paused.borrow();
        let written_rv = self.slots.lock().get(uid).and_then(|s| s.written_rv);
        let echo = written_rv.is_some() && rv_of(&body) == written_rv;
        let (body, event_wake) = self.retry_event_handlers(event_type, body, &handlers, echo).await;
        let daemons_alive = self.ctx.daemons.sync(uid, &body, &handlers, paused);
        let plan = processing::cycle(
            Input {
                body: &body,
                event: event_type,
                resource: &self.ctx.resource,
                handlers: &handlers,
                memory,
                storage: &self.ctx.storage,
                cancel: &self.ctx.cancel,
                checkpoint: Some(self),
                checkpoint_after: self.ctx.checkpoint_after,
                daemons_alive,
            },
            self.ctx.invoker.as_ref(),
        )
        .await;
        let written = self.write(&body, &plan).await;
        if !plan.notes.is_empty() {
            let object = processing::object_ref(&self.ctx.resource, &body);
            for (level, message) in &plan.notes {
                self.ctx.poster.post(crate::model::Posting {
                    object: object.clone(),
                    level: *level,
                    reason: "Logging".into(),
                    message: message.clone(),
                    policy: crate::model::Policy::ByLevel,
                });
            }
        }
        let mut slots = self.slots.lock();
        let Some(slot) = slots.get_mut(uid) else { return };
        if plan.done {
            slot.memory.fully_handled_once = true;
        }
        match written {
            Written::Stored(stored) => {
                slot.written_rv = rv_of(&stored).or(slot.written_rv);
                slot.last_body = Some(Stored::new(&stored));
            }
            Written::Nothing => {
                slot.written_rv = rv_of(&plan.base).max(slot.written_rv);
                slot.last_body = Some(Stored::new(&plan.base));
            }
            Written::Gone => {
                slot.gone = true;
                slot.pending = None;
                return;
            }
            Written::Failed => {}
        }
        if let Some(t) = slot.timer.take() {
            t.abort();
        }
        let wake_at = match (plan.wake_at, event_wake) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        if let Some(at) = wake_at {
            let delay = at.duration_since(SystemTime::now()).unwrap_or_default();
            let queue = self.clone();
            let uid = uid.to_owned();
            debug!(?delay, "next attempt scheduled");
            slot.timer = Some(tokio::spawn(async move {
                tokio::select! {
                    () = queue.ctx.cancel.cancelled() => {}
                    () = tokio::time::sleep(delay) => queue.wake(&uid),
                }
            }));
        }
    }

    /// Runs the event handlers that opted into retries (errors mode TEMPORARY): unlike
    /// fire-and-forget event handlers, their failures are persisted as progress records (per
    /// node in per-node mode) and retried with the latest body after the delay. Returns the
    /// body as stored and when to retry next.
    async fn retry_event_handlers(
        &self,
        event_type: EventType,
        body: Value,
        handlers: &[Registration],
        echo: bool,
    ) -> (Value, Option<SystemTime>) {
        let subject = Subject {
            body: &body,
            old: None,
            new: None,
        };
        let retried: Vec<&Registration> = handlers
            .iter()
            .filter(|h| h.kind == HandlerKind::Event && h.errors == ErrorsMode::Temporary)
            .filter(|h| matching::prematch(h, subject))
            .collect();
        if retried.is_empty() {
            return (body, None);
        }
        let storage = &self.ctx.storage;
        let now = SystemTime::now();
        let mut desired = body.clone();
        let mut wake: Option<SystemTime> = None;
        for reg in retried {
            let fetched = storage
                .progress
                .fetch(&reg.id.0, &body)
                .filter(|r| r.purpose.as_deref() == Some("event"));
            let due = match &fetched {
                None => !echo,
                Some(r) => !r.finished() && !r.sleeping(now),
            };
            if !due {
                if let Some(t) = fetched
                    .as_ref()
                    .filter(|r| !r.finished())
                    .and_then(|r| r.delayed_until())
                {
                    wake = Some(wake.map_or(t, |w| w.min(t)));
                }
                continue;
            }
            let mut record = fetched
                .clone()
                .unwrap_or_else(|| ProgressRecord::started(now, "event"));
            if let Some(message) = execution::exhausted(reg, &record, now) {
                warn!(handler.id = %reg.id, %message, "event handler gives up");
                storage.progress.purge(&reg.id.0, &mut desired);
                continue;
            }
            let object = processing::object_ref(&self.ctx.resource, &body);
            let mut work = Work::new(
                reg.id.0.clone(),
                format!(
                    "{}/{}/event/{}",
                    object.uid,
                    reg.id,
                    record.started.as_deref().unwrap_or_default()
                ),
                Payload::Event { event_type },
            );
            work.attempt = record.retries + 1;
            work.started = record.started_at().unwrap_or(now);
            work.object = Some(object);
            work.body = Some(body.clone());
            work.param = reg.param.clone();
            work.last_error = record
                .message
                .clone()
                .map(|m| crate::model::Diagnostic::error("PREVIOUS_ATTEMPT_FAILED", m));
            work.cancel = self.ctx.cancel.child_token();
            let outcome = self.ctx.invoker.invoke(work).await;
            match execution::judge(reg, &mut record, outcome, now) {
                execution::Verdict::Retry => {
                    info!(handler.id = %reg.id, error = record.message.as_deref().unwrap_or_default(), "event handler will be retried");
                    if let Some(t) = record.delayed_until() {
                        wake = Some(wake.map_or(t, |w| w.min(t)));
                    }
                    storage.progress.store(&reg.id.0, &record, &mut desired);
                }
                execution::Verdict::Unrecorded => {}
                verdict => {
                    if matches!(verdict, execution::Verdict::Failure) {
                        warn!(handler.id = %reg.id, error = record.message.as_deref().unwrap_or_default(), "event handler failed permanently");
                    }
                    storage.progress.purge(&reg.id.0, &mut desired);
                }
            }
        }
        processing::mark_managed(storage, &mut desired);
        if desired == body {
            return (body, wake);
        }
        match patch_object(&self.ctx.objects, &self.ctx.resource, &body, &desired).await {
            Ok(stored) => {
                if let Some(uid) = uid_of(&stored)
                    && let Some(slot) = self.slots.lock().get_mut(&uid)
                {
                    slot.written_rv = rv_of(&stored).max(slot.written_rv);
                }
                (stored, wake)
            }
            Err(e) => {
                warn!(error = %crate::error::chain(&e), "recording event handler progress failed");
                (body, wake)
            }
        }
    }

    /// Re-runs a cycle for an object whose delay has passed (or whose daemons stopped), with
    /// its latest known body.
    pub fn wake(&self, uid: &str) {
        let body = {
            let mut slots = self.slots.lock();
            let Some(slot) = slots.get_mut(uid) else { return };
            slot.timer = None;
            if slot.pending.is_some() || slot.gone {
                return;
            }
            if slot.running {
                // The running cycle may have started before what woke us; run once more after
                // it with the body it leaves behind.
                slot.rerun = true;
                return;
            }
            slot.last_body.as_ref().map(Stored::value)
        };
        if let Some(body) = body {
            self.push(EventType::Modified, body);
        }
    }

    /// Writes a plan: the finalizer, then the object and status changes, retrying conflicts and
    /// unavailability without re-running any handler.
    async fn write(&self, body: &Value, plan: &Plan) -> Written {
        let mut desired = plan.desired.clone();
        let mut base = plan.base.clone();
        let mut attempts = 0u32;
        let mut isolated = false;
        if desired.is_none() && plan.finalizer == FinalizerChange::Keep {
            return Written::Nothing;
        }
        loop {
            attempts += 1;
            match self.write_once(&base, desired.as_ref(), plan.finalizer).await {
                Ok(stored) => return Written::Stored(stored),
                Err(objects::Error::NotFound) => {
                    debug!("object deleted meanwhile; dropped");
                    return Written::Gone;
                }
                Err(objects::Error::Conflict(message)) if attempts < 10 => {
                    debug!(%message, "conflict; re-reading the object");
                    let (ns, name) = identity(body);
                    match self.ctx.objects.get(&self.ctx.resource, &ns, &name).await {
                        Ok(fresh) => {
                            if let Some(d) = desired.as_mut() {
                                rebase(d, &base, &fresh);
                            }
                            base = fresh;
                        }
                        Err(objects::Error::NotFound) => return Written::Gone,
                        Err(e) => warn!(error = %e, "re-reading after a conflict failed"),
                    }
                }
                Err(objects::Error::Invalid(message)) if !plan.patched.is_empty() && !isolated => {
                    warn!(%message, "the API server rejected the handlers' patch; finding which handler's patch it was");
                    desired = Some(self.isolate(plan, &base, &message).await);
                    isolated = true;
                }
                Err(e) => {
                    if self.ctx.cancel.is_cancelled() {
                        return Written::Failed;
                    }
                    let delay =
                        Duration::from_secs(u64::from(attempts.min(5)).pow(2)).min(Duration::from_secs(30));
                    warn!(error = %crate::error::chain(&e), retry_in = ?delay, "writing the object failed; retrying");
                    tokio::select! {
                        () = self.ctx.cancel.cancelled() => return Written::Failed,
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }

    /// After a rejected write: adds the handlers' changes one by one (validated with a
    /// server-side dry run) and records the ones the API server refuses as failed attempts.
    async fn isolate(&self, plan: &Plan, base: &Value, message: &str) -> Value {
        let storage = &self.ctx.storage;
        let Some(mut body) = plan.fallback.clone() else {
            return base.clone();
        };
        for p in &plan.patched {
            let mut candidate = body.clone();
            processing::accept(p, storage, &mut candidate);
            match self.dry_run(base, &candidate).await {
                Ok(()) => body = candidate,
                Err(objects::Error::Invalid(reason)) => {
                    warn!(handler.id = %p.registration.id, %reason, "the API server rejected this handler's patch");
                    processing::reject(p, storage, &reason, &mut body);
                }
                Err(e) => {
                    warn!(handler.id = %p.registration.id, error = %crate::error::chain(&e), "could not validate this handler's patch");
                    processing::reject(p, storage, message, &mut body);
                }
            }
        }
        body
    }

    async fn dry_run(&self, base: &Value, candidate: &Value) -> Result<(), objects::Error> {
        let (ns, name) = identity(base);
        let resource = &self.ctx.resource;
        let Some(mut patch) = merge_diff(base, candidate) else {
            return Ok(());
        };
        strip_server_fields(&mut patch);
        if resource.status_subresource
            && let Some(status) = patch.as_object_mut().and_then(|p| p.remove("status"))
        {
            let status_patch = serde_json::json!({ "status": status });
            self.ctx
                .objects
                .merge_patch_dry_run(resource, &ns, &name, &status_patch, true)
                .await?;
        }
        if patch.as_object().is_some_and(|p| !p.is_empty()) {
            self.ctx
                .objects
                .merge_patch_dry_run(resource, &ns, &name, &patch, false)
                .await?;
        }
        Ok(())
    }

    async fn write_once(
        &self,
        base: &Value,
        desired: Option<&Value>,
        finalizer: FinalizerChange,
    ) -> Result<Value, objects::Error> {
        let (ns, name) = identity(base);
        let resource = &self.ctx.resource;
        let mut patch = desired
            .and_then(|d| merge_diff(base, d))
            .unwrap_or(Value::Object(Map::new()));
        strip_server_fields(&mut patch);
        if finalizer != FinalizerChange::Keep {
            let name = &self.ctx.storage.keys.finalizer;
            let mut list: Vec<Value> = base
                .pointer("/metadata/finalizers")
                .and_then(Value::as_array)
                .cloned()
                .unwrap_or_default();
            list.retain(|f| f.as_str() != Some(name));
            if finalizer == FinalizerChange::Add {
                list.push(Value::String(name.clone()));
            }
            let meta = processing_object(&mut patch, "metadata");
            meta.insert("finalizers".into(), Value::Array(list));
            if let Some(rv) = base.pointer("/metadata/resourceVersion") {
                meta.insert("resourceVersion".into(), rv.clone());
            }
        }
        let stored = write_patch(&self.ctx.objects, resource, &ns, &name, patch, desired).await?;
        if finalizer == FinalizerChange::Add {
            info!("finalizer added");
        } else if finalizer == FinalizerChange::Remove {
            info!("finalizer removed");
        }
        Ok(stored.unwrap_or_else(|| base.clone()))
    }
}

/// Writes the changes from `base` to `desired` (no finalizer change): one `/status` PATCH
/// where the resource has a status subresource and status changed, one PATCH for the rest.
pub(crate) async fn patch_object(
    objects: &Objects,
    resource: &ResolvedResource,
    base: &Value,
    desired: &Value,
) -> Result<Value, objects::Error> {
    let (ns, name) = identity(base);
    let Some(mut patch) = merge_diff(base, desired) else {
        return Ok(base.clone());
    };
    strip_server_fields(&mut patch);
    Ok(write_patch(objects, resource, &ns, &name, patch, Some(desired))
        .await?
        .unwrap_or_else(|| base.clone()))
}

async fn write_patch(
    objects: &Objects,
    resource: &ResolvedResource,
    ns: &str,
    name: &str,
    mut patch: Value,
    desired: Option<&Value>,
) -> Result<Option<Value>, objects::Error> {
    let status = if resource.status_subresource {
        patch.as_object_mut().and_then(|p| p.remove("status"))
    } else {
        None
    };
    let mut stored = None;
    let metrics = crate::observability::metrics::global();
    if let Some(status) = status {
        let status_patch = serde_json::json!({ "status": status });
        metrics.api_write(&resource.plural);
        stored = Some(
            objects
                .merge_patch(resource, ns, name, &status_patch, true)
                .await?,
        );
    }
    if patch.as_object().is_some_and(|p| !p.is_empty()) {
        metrics.api_write(&resource.plural);
        let result = objects.merge_patch(resource, ns, name, &patch, false).await?;
        if let Some(d) = desired {
            report_dropped_fields(&patch, &result, d);
        }
        stored = Some(result);
    }
    Ok(stored)
}

impl processing::Checkpoint for Queue {
    fn save<'a>(
        &'a self,
        base: &'a Value,
        desired: &'a Value,
    ) -> futures::future::BoxFuture<'a, Option<Value>> {
        Box::pin(async move {
            match self.write_once(base, Some(desired), FinalizerChange::Keep).await {
                Ok(stored) => Some(stored),
                Err(e) => {
                    debug!(error = %crate::error::chain(&e), "checkpoint not written; the final write will carry it");
                    None
                }
            }
        })
    }
}

/// Removes metadata the server owns from a patch: a stale `resourceVersion` would turn the
/// patch into a conflicting optimistic lock.
fn strip_server_fields(patch: &mut Value) {
    if let Some(meta) = patch.get_mut("metadata").and_then(Value::as_object_mut) {
        for key in [
            "resourceVersion",
            "generation",
            "managedFields",
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "selfLink",
            "name",
            "namespace",
        ] {
            meta.remove(key);
        }
        if meta.is_empty()
            && let Some(p) = patch.as_object_mut()
        {
            p.remove("metadata");
        }
    }
}

/// An object body kept between cycles, as LZ4-compressed compact JSON. Thousands are kept: a
/// parsed `Value` of a typical object takes several times the size of its text, and the text
/// repeats itself (the diff-base annotation copies the spec and metadata), so it compresses
/// to under half for a few microseconds per body.
#[derive(Clone)]
struct Stored {
    rv: Option<u64>,
    packed: Box<[u8]>,
}

impl Stored {
    fn new(body: &Value) -> Self {
        let json = serde_json::to_vec(body).unwrap_or_default();
        Self {
            rv: rv_of(body),
            packed: lz4_flex::compress_prepend_size(&json).into_boxed_slice(),
        }
    }

    fn value(&self) -> Value {
        lz4_flex::decompress_size_prepended(&self.packed)
            .ok()
            .and_then(|json| serde_json::from_slice(&json).ok())
            .unwrap_or(Value::Null)
    }
}

enum Written {
    Stored(Value),
    Nothing,
    Gone,
    Failed,
}

fn identity(body: &Value) -> (String, String) {
    let get = |k: &str| {
        body.pointer(&format!("/metadata/{k}"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    (get("namespace"), get("name"))
}

fn processing_object<'a>(patch: &'a mut Value, key: &str) -> &'a mut Map<String, Value> {
    crate::persistence::progress::object_at(patch, &[key])
}

/// Re-applies the changes from `original` to `desired` on top of a freshly read body.
fn rebase(desired: &mut Value, original: &Value, fresh: &Value) {
    if let Some(changes) = merge_diff(original, desired) {
        let mut rebased = fresh.clone();
        json_patch::merge(&mut rebased, &changes);
        *desired = rebased;
    }
}

/// Warns about patched fields that did not stick (pruned by the schema or read-only).
fn report_dropped_fields(patch: &Value, stored: &Value, desired: &Value) {
    let mut dropped = Vec::new();
    walk_dropped(&mut Vec::new(), patch, stored, desired, &mut dropped);
    if !dropped.is_empty() {
        warn!(fields = %dropped.join(", "), "some patched fields did not stick (pruned by the schema or read-only)");
    }
}

fn walk_dropped(
    path: &mut Vec<String>,
    patch: &Value,
    stored: &Value,
    desired: &Value,
    out: &mut Vec<String>,
) {
    match patch {
        Value::Object(p) => {
            for (k, v) in p {
                if path.is_empty() && k == "metadata" {
                    continue;
                }
                path.push(k.clone());
                let s = stored.get(k).unwrap_or(&Value::Null);
                let d = desired.get(k).unwrap_or(&Value::Null);
                walk_dropped(path, v, s, d, out);
                path.pop();
            }
        }
        Value::Null => {}
        _ => {
            if stored != desired {
                out.push(path.join("."));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn stored_bodies_round_trip_and_are_smaller_than_their_text() {
        let spec = json!({"replicas": 3, "image": "registry.example.com/team/app:1.2.3",
                          "env": [{"name": "MODE", "value": "production"}]});
        let essence = json!({"spec": spec, "metadata": {"labels": {"app": "web"}}});
        let body = json!({
            "apiVersion": "demo.capstan.dev/v1", "kind": "Example",
            "metadata": {"name": "web", "namespace": "default", "uid": "u-1", "resourceVersion": "42",
                         "labels": {"app": "web"},
                         "annotations": {"capstan.dev/last-handled-configuration": essence.to_string()}},
            "spec": spec,
        });
        let stored = Stored::new(&body);
        assert_eq!(stored.value(), body);
        assert_eq!(stored.rv, Some(42));
        let text = serde_json::to_vec(&body).unwrap_or_default();
        assert!(
            stored.packed.len() < text.len(),
            "{} vs {}",
            stored.packed.len(),
            text.len()
        );
        let broken = Stored {
            rv: None,
            packed: Box::new([1, 2, 3]),
        };
        assert_eq!(
            broken.value(),
            Value::Null,
            "corrupt data reads as nothing, no panic"
        );
    }

    #[test]
    fn merge_diff_adds_changes_and_nulls_removals() {
        let a = json!({"metadata": {"annotations": {"x": "1", "y": "2"}}, "spec": {"a": [1]}});
        let b = json!({"metadata": {"annotations": {"x": "1", "z": "3"}}, "spec": {"a": [1, 2]}});
        assert_eq!(
            merge_diff(&a, &b),
            Some(json!({"metadata": {"annotations": {"y": null, "z": "3"}}, "spec": {"a": [1, 2]}}))
        );
        assert_eq!(merge_diff(&a, &a), None);
    }

    #[test]
    fn rebase_keeps_our_changes_on_a_fresh_body() {
        let original = json!({"metadata": {"annotations": {"a": "1"}}, "spec": {"x": 1}});
        let mut desired = json!({"metadata": {"annotations": {"a": "1", "ours": "yes"}}, "spec": {"x": 1}});
        let fresh = json!({"metadata": {"annotations": {"a": "1", "theirs": "t"}}, "spec": {"x": 2}});
        rebase(&mut desired, &original, &fresh);
        assert_eq!(
            desired,
            json!({"metadata": {"annotations": {"a": "1", "ours": "yes", "theirs": "t"}}, "spec": {"x": 2}})
        );
    }

    #[test]
    fn dropped_fields_are_found() {
        let patch = json!({"spec": {"kept": 1, "pruned": 2}});
        let stored = json!({"spec": {"kept": 1}});
        let desired = json!({"spec": {"kept": 1, "pruned": 2}});
        let mut out = Vec::new();
        walk_dropped(&mut Vec::new(), &patch, &stored, &desired, &mut out);
        assert_eq!(out, vec!["spec.pruned"]);
    }
}
