//! Event handlers of one resource's queue: the fire-and-forget ones (kopf's) are dispatched
//! from the watch, bounded and owned; those that opted into retries (errors mode TEMPORARY)
//! run in the object's worker, with their progress persisted like a change handler's.

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use parking_lot::Mutex;
use serde_json::Value;
use tokio::{sync::Semaphore, task::JoinSet, time::Instant};
use tracing::{Instrument, debug, info, info_span, warn};

use super::{Queue, uid_of, version::version_of};
use crate::{
    engine::{
        execution,
        matching::{self, Subject},
        processing,
        writing::{self, patch_object},
    },
    grpc::Control,
    model::{ErrorsMode, EventType, HandlerKind, Outcome, Payload, Registration, Work},
    persistence::ProgressRecord,
};

/// At most this many fire-and-forget event handler invocations of one resource run at once.
pub const EVENT_DISPATCH_LIMIT: usize = 256;

/// The running fire-and-forget event handler invocations of one resource: owned (aborted when
/// the resource's watch stops) and bounded.
pub(super) struct EventDispatch {
    pub(super) permits: Arc<Semaphore>,
    pub(super) tasks: Mutex<JoinSet<()>>,
    /// Events dropped since the last warning, and when that was.
    dropped: Mutex<(u64, Option<Instant>)>,
}

impl Default for EventDispatch {
    fn default() -> Self {
        Self {
            permits: Arc::new(Semaphore::new(EVENT_DISPATCH_LIMIT)),
            tasks: Mutex::new(JoinSet::new()),
            dropped: Mutex::new((0, None)),
        }
    }
}

/// How often a resource warns about dropped events at most.
const DROP_WARNING_INTERVAL: Duration = Duration::from_secs(10);

impl EventDispatch {
    /// Counts an event dropped for `handler` because its invocations were at the limit, and
    /// warns at most every [`DROP_WARNING_INTERVAL`].
    fn dropped(&self, handler: &str) {
        crate::observability::metrics::global().event_dropped(handler);
        let mut dropped = self.dropped.lock();
        dropped.0 += 1;
        if dropped.1.is_none_or(|t| t.elapsed() >= DROP_WARNING_INTERVAL) {
            warn!(
                handler.id = handler,
                dropped = dropped.0,
                limit = EVENT_DISPATCH_LIMIT,
                "event handler invocations are at their limit; events dropped (not retried, as kopf)"
            );
            *dropped = (0, Some(Instant::now()));
        }
    }
}

impl Queue {
    pub(super) async fn dispatch_event_handlers(&self, event_type: EventType, body: &Value) {
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
            // Fire and forget, as kopf: when the handler's invocations pile up (its process is
            // slow or away), the event is dropped for it rather than stalling the watch, and
            // with it every other handler of the resource.
            let Ok(permit) = self.events.permits.clone().try_acquire_owned() else {
                self.events.dropped(&reg.id.0);
                continue;
            };
            let object = processing::object_ref(&self.ctx.resource, body);
            let key = format!("{}/{}/{}", object.uid, reg.id, object.resource_version);
            let mut work = Work::new(reg.id.0.clone(), key, Payload::Event { event_type });
            work.object = Some(object);
            work.body = Some(body.clone());
            work.param = reg.param.clone();
            work.attempt_timeout = reg.timeout;
            let control = Control::cancelled_by(self.ctx.cancel.child_token());
            let invoker = self.ctx.invoker.clone();
            let id = reg.id.clone();
            let mut tasks = self.events.tasks.lock();
            while tasks.try_join_next().is_some() {}
            tasks.spawn(
                async move {
                    let _permit = permit;
                    match invoker.invoke(work, control).await {
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

    /// Runs the event handlers that opted into retries (errors mode TEMPORARY): unlike
    /// fire-and-forget event handlers, their failures are persisted as progress records (per
    /// node in per-node mode) and retried with the latest body after the delay. Returns the
    /// body as stored and when to retry next.
    pub(super) async fn retry_event_handlers(
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
            work.last_error = execution::last_error(&record);
            work.report_losses = true;
            let control = Control::cancelled_by(self.ctx.cancel.child_token());
            let outcome = self.ctx.invoker.invoke(work, control).await;
            match execution::judge_with_guard(reg, &mut record, outcome, now, self.ctx.max_losses) {
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
        // Node-local storage: the records are kept on the node, the rest goes to the object.
        let (mut remote_body, mut remote_desired) = (body.clone(), desired.clone());
        let local_state = storage.local.as_deref().map(|local| {
            local.detach(&mut remote_body);
            (local, local.detach(&mut remote_desired))
        });
        match patch_object(
            &self.ctx.objects,
            &self.ctx.resource,
            &self.ctx.storage.keys.finalizer,
            &remote_body,
            &remote_desired,
        )
        .await
        {
            Ok(mut stored) => {
                if let Some((local, state)) = local_state {
                    writing::keep_locally(local, &self.ctx.resource, &body, state).await;
                    // The cycle that follows sees the node's records, as on the object.
                    let uid = uid_of(&body).unwrap_or_default();
                    if local.overlay(&uid, &mut stored).await.is_err() {
                        local.carry(&desired, &mut stored);
                    }
                }
                // A new version: its echo is awaited; the cycle that follows sees it as stored.
                if let Some(uid) = uid_of(&stored)
                    && let Some(version) = version_of(&stored)
                    && version_of(&body) != Some(version)
                    && let Some(slot) = self.slots.lock().get_mut(uid.as_str())
                {
                    slot.versions().await_echo(version, true);
                }
                (stored, wake)
            }
            Err(e) => {
                warn!(error = %crate::diagnostic::chain(&e), "recording event handler progress failed");
                (body, wake)
            }
        }
    }
}
