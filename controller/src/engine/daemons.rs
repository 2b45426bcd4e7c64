//! Daemons and timers: per-object background work for as long as an object exists.
//!
//! The handler process runs the work; the controller owns the lifecycle. For every object and
//! every daemon or timer handler that matches it, one task here keeps the work going: a daemon
//! is one long invocation, a timer is one invocation per tick (never overlapping, on a fixed
//! schedule when `sharp`, postponed while the object keeps changing when `idle`).
//!
//! A daemon's lifecycle is kopf's: one that returns (its result goes to `status.<id>`), fails
//! permanently, fails with errors mode `permanent` or `ignored`, or runs out of its `retries`
//! or `timeout` is done for that object while this controller runs — it is not started again,
//! not even when the object changes or matches its filters anew (kopf's `forever_stopped`; a
//! daemon that wants to run again raises a temporary error with a delay). Temporary and
//! unclassified errors (errors mode `temporary`, the default) restart it after the error's
//! delay or the handler's backoff (`restart_backoff` overrides it), counting attempts against
//! `retries` and the time since the first start against `timeout`, with kopf's look-ahead: a
//! retry that would pass either limit is not made. A daemon stopped by the controller (filter
//! mismatch, pause, reconnect) is not done and starts again when it is wanted again. Nor is
//! one whose handler process was lost: it starts again, not counting against its `retries`,
//! as soon as a handler process holding it is connected; only after `max_losses` losses in a
//! row, each soon after its start (a daemon that takes its process down), are its starts
//! spaced out with a growing delay — it is never made done by losses.
//!
//! Which daemons are done is kept apart from the watches ([`Finished`]), so that a pause, a
//! watch restart or a replaced engine does not start them again; an object's entries go when
//! it is deleted, and there are entries for a bounded number of objects. The per-object state
//! here (the latest body for the daemons' writes) exists only while something runs for it.
//!
//! They stop when the object is deleted, stops matching the filters, or the handler is
//! unregistered, and while dispatch is paused (shutdown, freezing, loss of leadership): first
//! a `Cancel`; a daemon with a `cancellation_timeout` is abandoned with a warning when it has
//! not ended by then (its object's finalizer is released), one without is waited for as long
//! as it runs, as kopf does — its object's deletion waits for it. Daemons see the object's latest body
//! (`ObjectUpdate`), timers get it on every tick, and both may patch their object.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
    time::{Duration, SystemTime},
};

use futures::future::BoxFuture;
use parking_lot::Mutex;
use serde_json::Value;
use tokio::{
    sync::{mpsc, watch},
    task::JoinHandle,
    time::Instant,
};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use super::{
    essence::Rules,
    matching::{self, Subject},
    processing::{self, Invoker},
};
use crate::{
    grpc::Control,
    k8s::objects::Objects,
    model::{
        CancelReason, DaemonOptions, ErrorsMode, HandlerId, HandlerKind, KindOptions, Outcome, Patch,
        Payload, Registration, ResolvedResource, TimerOptions, Work,
    },
};

/// The grace of a cancelled daemon without a `cancellation_timeout`: no limit (the hub's sleep
/// saturates to its far future, and the `Cancel` carries no grace period).
const WAIT_FOREVER: Duration = Duration::MAX;

/// A daemon that ran at least this long before its handler process was lost did not take the
/// process down: its count of losses in a row starts again (see [`Losses::lost`]).
const SETTLED: Duration = Duration::from_secs(60);

/// The longest a daemon whose handler process keeps being lost soon after it starts waits
/// before its next start.
const LOST_BACKOFF_LIMIT: Duration = Duration::from_secs(300);

/// The most objects whose done daemons are remembered; past it, the objects that have had
/// them longest are forgotten (their daemons could start again).
const MAX_FINISHED_OBJECTS: usize = 100_000;

/// The daemons that are done, per object and handler, for the controller's lifetime: they
/// outlive the watches and engines that ran them (a pause, a watch restart), as kopf keeps a
/// done daemon stopped for its process's lifetime. An object's entries go when it is deleted.
/// Keyed by uid, which is unique in the cluster across resources. Cheap to clone.
#[derive(Clone)]
pub struct Finished {
    inner: Arc<Mutex<FinishedInner>>,
}

struct FinishedInner {
    /// Per object: when it was first remembered (an order number), and its done handlers.
    by_uid: HashMap<String, (u64, Vec<HandlerId>)>,
    /// The objects by when they were first remembered, for the bound.
    order: BTreeMap<u64, String>,
    next: u64,
    capacity: usize,
}

impl Default for Finished {
    fn default() -> Self {
        Self::with_capacity(MAX_FINISHED_OBJECTS)
    }
}

impl Finished {
    /// Remembers the done daemons of at most `capacity` objects.
    pub fn with_capacity(capacity: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(FinishedInner {
                by_uid: HashMap::new(),
                order: BTreeMap::new(),
                next: 0,
                capacity: capacity.max(1),
            })),
        }
    }

    /// Whether the daemon `id` is done for the object `uid`.
    pub fn contains(&self, uid: &str, id: &HandlerId) -> bool {
        self.inner
            .lock()
            .by_uid
            .get(uid)
            .is_some_and(|(_, ids)| ids.contains(id))
    }

    /// Records that the daemon `id` is done for the object `uid`.
    fn insert(&self, uid: &str, id: &HandlerId) {
        let mut inner = self.inner.lock();
        if let Some((_, ids)) = inner.by_uid.get_mut(uid) {
            if !ids.contains(id) {
                ids.push(id.clone());
            }
            return;
        }
        let n = inner.next;
        inner.next = n.wrapping_add(1);
        inner.by_uid.insert(uid.to_owned(), (n, vec![id.clone()]));
        inner.order.insert(n, uid.to_owned());
        while inner.by_uid.len() > inner.capacity {
            let Some((_, oldest)) = inner.order.pop_first() else {
                break;
            };
            inner.by_uid.remove(&oldest);
            warn!(object.uid = %oldest, capacity = inner.capacity, "too many objects with done daemons; the oldest is forgotten and its daemons may start again");
        }
    }

    /// Forgets an object that is gone.
    pub fn forget(&self, uid: &str) {
        let mut inner = self.inner.lock();
        if let Some((n, _)) = inner.by_uid.remove(uid) {
            inner.order.remove(&n);
        }
    }

    /// How many objects have done daemons.
    pub fn objects(&self) -> usize {
        self.inner.lock().by_uid.len()
    }
}

/// What the daemons of one resource need.
pub struct Context {
    /// The resource.
    pub resource: ResolvedResource,
    /// Calls handlers.
    pub invoker: Arc<dyn Invoker>,
    /// Writes the daemons' and timers' patches and results.
    pub objects: Objects,
    /// Essence rules, to notice changes for `idle` timers.
    pub rules: Rules,
    /// Told the uid of an object being deleted whose last daemon just stopped (so that its
    /// finalizer can be released).
    pub stopped: mpsc::UnboundedSender<String>,
    /// Cancelled at shutdown.
    pub cancel: CancellationToken,
    /// Our finalizer, which the handlers' patches cannot remove.
    pub finalizer: String,
    /// Losses of the handler process in a row, each soon after the daemon started, after
    /// which its starts are spaced out (the poison-pill guard for daemons).
    pub max_losses: u32,
    /// The done daemons, shared by every watch for the controller's lifetime.
    pub finished: Finished,
}

/// The daemons and timers of one resource. Cheap to clone.
#[derive(Clone)]
pub struct Daemons {
    ctx: Arc<Context>,
    objects: Arc<Mutex<HashMap<String, Object>>>,
}

struct Object {
    body: watch::Sender<Value>,
    changed_at: watch::Sender<Instant>,
    essence: Value,
    deleting: bool,
    running: HashMap<HandlerId, Running>,
}

struct Running {
    stop: CancellationToken,
    reason: Arc<Mutex<CancelReason>>,
    task: JoinHandle<()>,
}

impl Daemons {
    /// No daemons yet.
    pub fn new(ctx: Context) -> Self {
        Self {
            ctx: Arc::new(ctx),
            objects: Arc::new(Mutex::new(HashMap::new())),
        }
    }

    /// Starts, keeps or stops the daemons and timers of one object after an event; returns
    /// whether any of its daemons or timers is still running (its finalizer must stay).
    pub fn sync(&self, uid: &str, body: &Value, handlers: &[Registration], paused: bool) -> bool {
        let deleting = body
            .pointer("/metadata/deletionTimestamp")
            .is_some_and(|v| !v.is_null());
        let spawning: Vec<&Registration> = handlers
            .iter()
            .filter(|h| matches!(h.kind, HandlerKind::Daemon | HandlerKind::Timer))
            .collect();
        let subject = Subject {
            body,
            old: None,
            new: None,
        };
        // Done daemons are looked up under the objects' lock: a daemon that ends meanwhile is
        // either done already or still among the running.
        let mut objects = self.objects.lock();
        let wanted: Vec<bool> = spawning
            .iter()
            .map(|reg| {
                !deleting
                    && !paused
                    && matching::prematch(reg, subject)
                    && !self.ctx.finished.contains(uid, &reg.id)
            })
            .collect();
        // An object is kept only while something runs for it.
        if !objects.contains_key(uid) && !wanted.contains(&true) {
            return false;
        }
        let essence = self.ctx.rules.essence(body);
        let object = objects.entry(uid.to_owned()).or_insert_with(|| Object {
            body: watch::channel(body.clone()).0,
            changed_at: watch::channel(Instant::now()).0,
            essence: essence.clone(),
            deleting,
            running: HashMap::new(),
        });
        object.body.send_replace(body.clone());
        if object.essence != essence {
            object.essence = essence;
            object.changed_at.send_replace(Instant::now());
        }
        object.deleting = deleting;
        object.running.retain(|_, r| !r.task.is_finished());
        for (reg, wanted) in spawning.iter().zip(wanted) {
            match (wanted, object.running.get(&reg.id)) {
                (true, None) => {
                    let running = self.spawn(uid, reg, object);
                    object.running.insert(reg.id.clone(), running);
                }
                (false, Some(r)) if !r.stop.is_cancelled() => {
                    let reason = if deleting {
                        CancelReason::ResourceDeleted
                    } else if paused {
                        CancelReason::Paused
                    } else {
                        CancelReason::FilterMismatch
                    };
                    stop(r, reason);
                }
                _ => {}
            }
        }
        for (id, r) in &object.running {
            if !spawning.iter().any(|h| &h.id == id) && !r.stop.is_cancelled() {
                stop(r, CancelReason::HandlerUnregistered);
            }
        }
        let alive = !object.running.is_empty();
        if !alive {
            objects.remove(uid);
        }
        alive
    }

    /// Stops everything of an object that is gone, and forgets its done daemons.
    pub fn forget(&self, uid: &str) {
        let mut objects = self.objects.lock();
        self.ctx.finished.forget(uid);
        let Some(object) = objects.get_mut(uid) else {
            return;
        };
        object.deleting = true;
        for r in object.running.values() {
            stop(r, CancelReason::ResourceDeleted);
        }
        object.running.retain(|_, r| !r.task.is_finished());
        if object.running.is_empty() {
            objects.remove(uid);
        }
    }

    /// Stops every daemon and timer (shutdown, pause) with `reason`.
    pub fn stop_all(&self, reason: CancelReason) {
        for object in self.objects.lock().values() {
            for r in object.running.values() {
                stop(r, reason);
            }
        }
    }

    /// How many daemons and timers are running.
    pub fn running(&self) -> usize {
        self.objects
            .lock()
            .values()
            .map(|o| o.running.values().filter(|r| !r.task.is_finished()).count())
            .sum()
    }

    fn spawn(&self, uid: &str, reg: &Registration, object: &Object) -> Running {
        let stop = self.ctx.cancel.child_token();
        let reason = Arc::new(Mutex::new(CancelReason::RuntimeShutdown));
        let body = object.body.subscribe();
        let changed_at = object.changed_at.subscribe();
        let this = self.clone();
        let reg = reg.clone();
        let uid_owned = uid.to_owned();
        let task_stop = stop.clone();
        let task_reason = reason.clone();
        let name = object
            .body
            .borrow()
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        let span = info_span!("daemon", handler.id = %reg.id, kind = %reg.kind, object.name = %name, object.uid = %uid);
        let task = tokio::spawn(
            async move {
                info!("started");
                let lane = Lane {
                    daemons: &this,
                    uid: &uid_owned,
                    reg: &reg,
                    stop: &task_stop,
                    reason: &task_reason,
                    body,
                };
                match &reg.options {
                    KindOptions::Timer(t) => lane.timer(t, changed_at).await,
                    KindOptions::Daemon(d) => lane.daemon(d).await,
                    _ => lane.daemon(&DaemonOptions::default()).await,
                }
                info!("stopped");
                this.exited(&uid_owned, &reg.id);
            }
            .instrument(span),
        );
        Running { stop, reason, task }
    }

    /// Called by a task when it ends: drops an object with nothing left running, and tells
    /// the queue when it is being deleted (its finalizer can go).
    fn exited(&self, uid: &str, id: &HandlerId) {
        let mut objects = self.objects.lock();
        let Some(object) = objects.get_mut(uid) else {
            return;
        };
        object.running.remove(id);
        if object.running.is_empty() {
            let deleting = object.deleting;
            objects.remove(uid);
            if deleting {
                let _ = self.ctx.stopped.send(uid.to_owned());
            }
        }
    }

    fn finished_for_good(&self, uid: &str, id: &HandlerId) {
        self.ctx.finished.insert(uid, id);
    }

    /// Writes a daemon's or timer's result and patches over the object's latest body.
    async fn write(&self, uid: &str, id: &HandlerId, result: Option<Value>, patches: &[Patch]) {
        let mut staged = None;
        self.stage(uid, &mut staged, patches, None);
        if let Some(result) = result
            && let Some(staged) = staged.as_mut()
        {
            processing::store_result(&mut staged.desired, &id.0, result);
        }
        if let Some(staged) = staged {
            self.write_staged(uid, staged).await;
        }
    }

    /// Applies patches to the changes waiting to be written, which start from `after` (what
    /// the write in flight will leave) or the object's latest body: however many patches
    /// arrive while a write is in flight, one body is kept and one write follows.
    fn stage(&self, uid: &str, staged: &mut Option<Staged>, patches: &[Patch], after: Option<&Value>) {
        if staged.is_none() {
            let base = match after {
                Some(body) => body.clone(),
                None => {
                    let objects = self.objects.lock();
                    let Some(object) = objects.get(uid) else { return };
                    object.body.borrow().clone()
                }
            };
            *staged = Some(Staged {
                desired: base.clone(),
                base,
            });
        }
        let Some(staged) = staged.as_mut() else { return };
        let mut scratch = staged.desired.clone();
        match processing::apply_patches(&mut scratch, patches) {
            Ok(()) => staged.desired = scratch,
            Err(d) => warn!(problem = %d, "a patch from the handler does not apply; dropped"),
        }
    }

    async fn write_staged(&self, uid: &str, staged: Staged) {
        if staged.desired == staged.base {
            return;
        }
        match super::writing::patch_object(
            &self.ctx.objects,
            &self.ctx.resource,
            &self.ctx.finalizer,
            &staged.base,
            &staged.desired,
        )
        .await
        {
            Ok(stored) => {
                if let Some(object) = self.objects.lock().get(uid) {
                    object.body.send_replace(stored);
                }
            }
            Err(e) => warn!(error = %crate::diagnostic::chain(&e), "writing the handler's patch failed"),
        }
    }
}

/// Changes of a daemon waiting to be written: the body they apply to, and the result.
struct Staged {
    base: Value,
    desired: Value,
}

/// Awaits the write in flight, or never when there is none.
async fn landed(flight: &mut Option<BoxFuture<'_, ()>>) {
    match flight.as_mut() {
        Some(f) => f.await,
        None => std::future::pending().await,
    }
}

fn stop(r: &Running, reason: CancelReason) {
    *r.reason.lock() = reason;
    r.stop.cancel();
}

/// A daemon's losses of its handler process.
#[derive(Default)]
struct Losses {
    /// All of them (they count in the attempt number).
    total: u32,
    /// In a row, each soon after the daemon started.
    in_a_row: u32,
}

impl Losses {
    /// Records a loss after the daemon ran for `ran`; returns how long to wait before starting
    /// it again. A lost process is not the daemon's failure: it neither counts against the
    /// daemon's `retries` nor makes it done, and the next start waits for a process holding
    /// the handler. Only when the process is lost `max_losses` times in a row, each time
    /// before the daemon ran for [`SETTLED`] — the daemon probably takes its process down —
    /// are its starts spaced out: its backoff, doubled for each further such loss, up to
    /// [`LOST_BACKOFF_LIMIT`]. A daemon that runs for [`SETTLED`] starts the count again.
    fn lost(&mut self, ran: Duration, max_losses: u32, backoff: Duration) -> Duration {
        self.total = self.total.saturating_add(1);
        if ran >= SETTLED {
            self.in_a_row = 0;
        }
        self.in_a_row = self.in_a_row.saturating_add(1);
        let Some(beyond) = self.in_a_row.checked_sub(max_losses.max(1)) else {
            info!(
                losses = self.in_a_row,
                "the handler process was lost while the daemon ran; it starts again when a handler process holding it is connected"
            );
            return Duration::ZERO;
        };
        let delay = backoff
            .saturating_mul(2u32.saturating_pow(beyond.min(16)))
            .min(LOST_BACKOFF_LIMIT);
        warn!(losses = self.in_a_row, restart_in = ?delay, "the handler process was lost repeatedly soon after the daemon started; its next start is delayed");
        delay
    }
}

/// One running daemon or timer.
struct Lane<'a> {
    daemons: &'a Daemons,
    uid: &'a str,
    reg: &'a Registration,
    stop: &'a CancellationToken,
    reason: &'a Arc<Mutex<CancelReason>>,
    body: watch::Receiver<Value>,
}

impl Lane<'_> {
    fn work(&self, payload: Payload, key: String) -> Work {
        let body = self.body.borrow().clone();
        let mut work = Work::new(self.reg.id.0.clone(), key, payload);
        work.object = Some(processing::object_ref(&self.daemons.ctx.resource, &body));
        work.body = Some(body);
        work.param = self.reg.param.clone();
        work
    }

    /// Stopped with the lane, for the reason the lane is stopped for.
    fn control(&self) -> Control {
        Control {
            reason: self.reason.clone(),
            ..Control::cancelled_by(self.stop.clone())
        }
    }

    /// Sleeps; true when stopped first.
    async fn sleep(&self, d: Duration) -> bool {
        tokio::select! {
            () = self.stop.cancelled() => true,
            () = tokio::time::sleep(d) => false,
        }
    }

    async fn daemon(&self, opts: &DaemonOptions) {
        if self.sleep(opts.initial_delay).await {
            return;
        }
        let started = Instant::now();
        let mut restarts = 0u32;
        let mut losses = Losses::default();
        loop {
            let (updates_tx, mut updates_rx) = mpsc::unbounded_channel::<Vec<Patch>>();
            let mut work = self.work(
                Payload::Daemon { restarts },
                format!("{}/{}/daemon/{restarts}", self.uid, self.reg.id),
            );
            work.attempt = restarts.saturating_add(losses.total).saturating_add(1);
            work.report_losses = true;
            if losses.in_a_row > 0 {
                work.last_error = Some(crate::model::Diagnostic::error(
                    "HANDLER_PROCESS_LOST",
                    "the handler process disconnected while the daemon ran",
                ));
            }
            let attempt_began = Instant::now();
            let grace = match opts.cancellation_timeout {
                Some(timeout) => opts
                    .cancellation_backoff
                    .unwrap_or_default()
                    .saturating_add(timeout),
                None => WAIT_FOREVER,
            };
            work.cancel_grace = Some(grace);
            let control = Control {
                updates: Some(updates_tx),
                body_updates: Some(self.body.clone()),
                ..self.control()
            };
            let invocation = self.daemons.ctx.invoker.invoke(work, control);
            tokio::pin!(invocation);
            // Progress patches are applied as they come and written one write at a time:
            // what arrives during a write is coalesced into the next one.
            let mut staged: Option<Staged> = None;
            let mut flight: Option<BoxFuture<'_, ()>> = None;
            let mut flying: Option<Value> = None;
            let outcome = loop {
                if flight.is_none()
                    && let Some(next) = staged.take()
                {
                    flying = Some(next.desired.clone());
                    flight = Some(Box::pin(self.daemons.write_staged(self.uid, next)));
                }
                tokio::select! {
                    outcome = &mut invocation => break outcome,
                    Some(patches) = updates_rx.recv() => {
                        self.daemons.stage(self.uid, &mut staged, &patches, flying.as_ref());
                        while let Ok(more) = updates_rx.try_recv() {
                            self.daemons.stage(self.uid, &mut staged, &more, flying.as_ref());
                        }
                    }
                    () = landed(&mut flight) => {
                        flight = None;
                        flying = None;
                    }
                }
            };
            if let Some(f) = flight.take() {
                f.await;
            }
            while let Ok(more) = updates_rx.try_recv() {
                self.daemons.stage(self.uid, &mut staged, &more, None);
            }
            if let Some(rest) = staged.take() {
                self.daemons.write_staged(self.uid, rest).await;
            }
            let backoff = opts.restart_backoff.unwrap_or(self.reg.backoff);
            let delay = match outcome {
                Outcome::Success { result, patches, .. } => {
                    self.daemons.write(self.uid, &self.reg.id, result, &patches).await;
                    if self.stop.is_cancelled() {
                        return;
                    }
                    info!("the daemon finished; it is done for this object until the controller restarts");
                    self.daemons.finished_for_good(self.uid, &self.reg.id);
                    return;
                }
                Outcome::Abandoned | Outcome::TimedOut if self.stop.is_cancelled() => {
                    warn!(cancellation_timeout = ?grace, "the daemon ignored its cancellation and was abandoned");
                    return;
                }
                _ if self.stop.is_cancelled() => return,
                // An SDK-side filter said no: not finished; the next event asks again.
                Outcome::Skipped => return,
                // Not the daemon's failure: it starts again as soon as a handler process
                // holding it is connected (the next invocation waits for one).
                Outcome::Lost => {
                    let delay = losses.lost(attempt_began.elapsed(), self.daemons.ctx.max_losses, backoff);
                    if self.sleep(delay).await {
                        return;
                    }
                    continue;
                }
                Outcome::Temporary {
                    delay: d,
                    diagnostics,
                    ..
                } => {
                    let delay = d.unwrap_or(backoff);
                    warn!(message = %crate::model::Diagnostic::summarize(&diagnostics), restart_in = ?delay, "the daemon failed temporarily");
                    delay
                }
                Outcome::Permanent { diagnostics, .. } => {
                    self.give_up(
                        &crate::model::Diagnostic::summarize(&diagnostics),
                        "the daemon failed permanently",
                    );
                    return;
                }
                Outcome::Unclassified { diagnostics, .. } => {
                    let message = crate::model::Diagnostic::summarize(&diagnostics);
                    match self.reg.errors {
                        ErrorsMode::Temporary => {
                            warn!(message = %message, restart_in = ?backoff, "the daemon failed");
                            backoff
                        }
                        ErrorsMode::Permanent => {
                            self.give_up(&message, "the daemon failed (errors mode: permanent)");
                            return;
                        }
                        ErrorsMode::Ignored => {
                            info!(message = %message, "the daemon failed (errors mode: ignored); it is done for this object");
                            self.daemons.finished_for_good(self.uid, &self.reg.id);
                            return;
                        }
                    }
                }
                other => {
                    warn!(outcome = other.as_str(), restart_in = ?backoff, "the daemon ended unexpectedly");
                    backoff
                }
            };
            restarts += 1;
            losses.in_a_row = 0;
            // kopf's look-ahead: a retry that would pass the limits is not made.
            if self.reg.retries.is_some_and(|r| restarts >= r) {
                self.give_up(
                    &format!("{restarts} attempts made"),
                    "the daemon ran out of retries",
                );
                return;
            }
            if self
                .reg
                .timeout
                .is_some_and(|t| started.elapsed().saturating_add(delay) >= t)
            {
                self.give_up(
                    &format!("running for {:?}", started.elapsed()),
                    "the daemon ran out of time",
                );
                return;
            }
            if self.sleep(delay).await {
                return;
            }
        }
    }

    /// Ends a daemon after a final failure: it is not started again for this object while
    /// the controller runs (kopf's `forever_stopped`).
    fn give_up(&self, message: &str, what: &str) {
        warn!(message = %message, "{what}; it is done for this object until the controller restarts");
        self.daemons.finished_for_good(self.uid, &self.reg.id);
    }

    async fn timer(&self, opts: &TimerOptions, mut changed_at: watch::Receiver<Instant>) {
        if self.sleep(opts.initial_delay).await {
            return;
        }
        let interval = opts.interval.max(Duration::from_millis(10));
        let start = Instant::now();
        let mut tick = 0u64;
        loop {
            if let Some(idle) = opts.idle {
                loop {
                    let since = changed_at.borrow_and_update().elapsed();
                    if since >= idle {
                        break;
                    }
                    tokio::select! {
                        () = self.stop.cancelled() => return,
                        () = tokio::time::sleep(idle - since) => {}
                        _ = changed_at.changed() => {}
                    }
                }
            }
            let began = Instant::now();
            tick += 1;
            self.tick(tick).await;
            if self.stop.is_cancelled() {
                return;
            }
            let took = began.elapsed();
            if took > interval {
                warn!(took = ?took, interval = ?interval, "the timer handler is slower than its interval; ticks do not overlap");
            }
            // Checked: the interval comes off the wire (bounded there); a slot past the clock's
            // range falls back to one interval from now.
            let sharp_slot = || {
                let periods = start.elapsed().as_nanos() / interval.as_nanos() + 1;
                let periods = u32::try_from(periods).ok()?;
                start.checked_add(interval.checked_mul(periods)?)
            };
            let after_one = || Instant::now().checked_add(interval);
            let next = if opts.sharp {
                sharp_slot().or_else(after_one)
            } else {
                after_one()
            };
            let Some(next) = next else { return };
            tokio::select! {
                () = self.stop.cancelled() => return,
                () = tokio::time::sleep_until(next) => {}
            }
        }
    }

    /// One tick: invoked, and retried on temporary errors within the handler's limits.
    async fn tick(&self, tick: u64) {
        let scheduled = SystemTime::now();
        let mut attempt = 1u32;
        loop {
            let mut work = self.work(
                Payload::Timer { scheduled },
                format!("{}/{}/timer/{tick}", self.uid, self.reg.id),
            );
            work.attempt = attempt;
            let outcome = self.daemons.ctx.invoker.invoke(work, self.control()).await;
            let retry_in = match outcome {
                Outcome::Success { result, patches, .. } => {
                    self.daemons.write(self.uid, &self.reg.id, result, &patches).await;
                    return;
                }
                Outcome::Temporary { delay, .. } => delay.unwrap_or(self.reg.backoff),
                Outcome::Unclassified { .. } if self.reg.errors == crate::model::ErrorsMode::Temporary => {
                    self.reg.backoff
                }
                Outcome::Skipped | Outcome::Cancelled | Outcome::Abandoned => return,
                other => {
                    warn!(
                        outcome = other.as_str(),
                        "the timer handler failed; next tick as scheduled"
                    );
                    return;
                }
            };
            if self.reg.retries.is_some_and(|r| attempt >= r) {
                warn!(
                    attempts = attempt,
                    "the timer handler failed; no retries left for this tick"
                );
                return;
            }
            debug!(retry_in = ?retry_in, "the timer handler will be retried");
            attempt += 1;
            if self.sleep(retry_in).await {
                return;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use http_body_util::BodyExt;
    use serde_json::json;

    use super::*;
    use crate::{k8s::objects::Objects, persistence::Keys};

    const BATCHES: u32 = 200;

    fn example() -> Value {
        json!({"apiVersion": "demo.capstan.dev/v1", "kind": "Example",
               "metadata": {"name": "one", "namespace": "default", "uid": "u1", "resourceVersion": "10"},
               "spec": {"size": 1}})
    }

    /// A daemon that sends many progress patches at once, then runs until stopped.
    struct Chatty;

    impl Invoker for Chatty {
        fn invoke(&self, _work: Work, control: Control) -> BoxFuture<'static, Outcome> {
            Box::pin(async move {
                if let Some(updates) = &control.updates {
                    for n in 0..BATCHES {
                        let patch = Patch {
                            patch_type: crate::model::PatchType::Merge,
                            target: crate::model::PatchTarget::Object,
                            body: json!({"metadata": {"annotations": {"progress": n.to_string()}}}),
                        };
                        let _ = updates.send(vec![patch]);
                    }
                }
                control.cancel.cancelled().await;
                Outcome::Cancelled
            })
        }
    }

    /// An API server whose PATCHes take 100 ms; keeps the last PATCH body.
    fn slow_api(patches: Arc<AtomicU32>, last: Arc<Mutex<Value>>) -> Objects {
        let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
            let patches = patches.clone();
            let last = last.clone();
            async move {
                let body = req
                    .into_body()
                    .collect()
                    .await
                    .map(|b| b.to_bytes())
                    .unwrap_or_default();
                if let Ok(v) = serde_json::from_slice::<Value>(&body) {
                    *last.lock() = v;
                }
                patches.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(100)).await;
                let reply = serde_json::to_vec(&example()).unwrap_or_default();
                Ok::<_, std::convert::Infallible>(http::Response::new(kube::client::Body::from(reply)))
            }
        });
        Objects::new(kube::Client::new(service, "default"))
    }

    /// A daemon that answers every attempt with `outcome` at once, counting the attempts.
    struct Answers {
        calls: Arc<AtomicU32>,
        outcome: fn() -> Outcome,
    }

    impl Invoker for Answers {
        fn invoke(&self, _work: Work, _control: Control) -> BoxFuture<'static, Outcome> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            let outcome = (self.outcome)();
            Box::pin(async move { outcome })
        }
    }

    fn resource() -> ResolvedResource {
        ResolvedResource {
            group: "demo.capstan.dev".into(),
            version: "v1".into(),
            plural: "examples".into(),
            kind: "Example".into(),
            namespaced: true,
            status_subresource: false,
        }
    }

    fn daemons_with(invoker: Arc<dyn Invoker>, cancel: &CancellationToken) -> Daemons {
        daemons_sharing(invoker, cancel, &Finished::default())
    }

    /// Daemons of one watch that share the done daemons with other watches.
    fn daemons_sharing(
        invoker: Arc<dyn Invoker>,
        cancel: &CancellationToken,
        finished: &Finished,
    ) -> Daemons {
        let (stopped, _stopped_rx) = mpsc::unbounded_channel();
        Daemons::new(Context {
            resource: resource(),
            invoker,
            objects: slow_api(Arc::new(AtomicU32::new(0)), Arc::new(Mutex::new(Value::Null))),
            rules: Rules {
                prefix: "capstan.dev".into(),
                diffbase_key: None,
                extra_fields: Vec::new(),
            },
            stopped,
            cancel: cancel.clone(),
            finalizer: Keys::new("capstan.dev").finalizer,
            max_losses: 3,
            finished: finished.clone(),
        })
    }

    /// Runs a daemon answering `outcome` with `retries`, syncing its object again and again
    /// (changed bodies, a filter mismatch and a new match) for a minute; returns the attempts.
    async fn attempts_over_a_minute(outcome: fn() -> Outcome, retries: Option<u32>) -> u32 {
        let calls = Arc::new(AtomicU32::new(0));
        let cancel = CancellationToken::new();
        let daemons = daemons_with(
            Arc::new(Answers {
                calls: calls.clone(),
                outcome,
            }),
            &cancel,
        );
        let mut monitor = Registration::new("monitor", HandlerKind::Daemon, None);
        monitor.resource = Some(resource());
        monitor.retries = retries;
        monitor.backoff = Duration::from_secs(1);
        let mut body = example();
        for n in 0..60 {
            body["spec"]["size"] = json!(n);
            daemons.sync("u1", &body, std::slice::from_ref(&monitor), false);
            if n == 30 {
                // Not wanted for a moment (paused), then wanted again.
                daemons.sync("u1", &body, std::slice::from_ref(&monitor), true);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        cancel.cancel();
        calls.load(Ordering::SeqCst)
    }

    #[tokio::test(start_paused = true)]
    async fn a_daemon_that_returns_or_fails_for_good_is_never_started_again() {
        assert_eq!(attempts_over_a_minute(|| Outcome::success(None), None).await, 1);
        let permanent = || Outcome::Permanent {
            diagnostics: vec![],
            subhandlers: vec![],
        };
        assert_eq!(attempts_over_a_minute(permanent, None).await, 1);
    }

    #[tokio::test(start_paused = true)]
    async fn temporary_errors_restart_a_daemon_within_its_retries() {
        let temporary = || Outcome::Temporary {
            delay: Some(Duration::from_secs(2)),
            diagnostics: vec![],
            subhandlers: vec![],
        };
        assert_eq!(attempts_over_a_minute(temporary, Some(4)).await, 4);
        let unclassified = || Outcome::Unclassified {
            diagnostics: vec![],
            subhandlers: vec![],
        };
        assert_eq!(attempts_over_a_minute(unclassified, Some(3)).await, 3);
        // Without a limit: about one attempt per two seconds (one per backoff after a pause).
        let unlimited = attempts_over_a_minute(temporary, None).await;
        assert!((20..=40).contains(&unlimited), "{unlimited} attempts");
    }

    #[tokio::test(start_paused = true)]
    async fn a_done_daemon_stays_done_across_watches_until_its_object_is_deleted() {
        let calls = Arc::new(AtomicU32::new(0));
        let finished = Finished::default();
        let mut monitor = Registration::new("monitor", HandlerKind::Daemon, None);
        monitor.resource = Some(resource());
        // Watch after watch (a pause and resume, changed selectors, a process reconnect).
        for _ in 0..3 {
            let cancel = CancellationToken::new();
            let invoker = Arc::new(Answers {
                calls: calls.clone(),
                outcome: || Outcome::success(None),
            });
            let daemons = daemons_sharing(invoker, &cancel, &finished);
            daemons.sync("u1", &example(), std::slice::from_ref(&monitor), false);
            tokio::time::sleep(Duration::from_secs(10)).await;
            cancel.cancel();
        }
        assert_eq!(calls.load(Ordering::SeqCst), 1, "the daemon returned; it is done");
        assert_eq!(finished.objects(), 1);
        let daemons = daemons_sharing(Arc::new(Chatty), &CancellationToken::new(), &finished);
        daemons.forget("u1");
        assert_eq!(
            finished.objects(),
            0,
            "a deleted object's done daemons are forgotten"
        );
    }

    /// A daemon that returns at once for the object with uid `done` and runs until stopped
    /// for the others.
    struct ReturnsForDone;

    impl Invoker for ReturnsForDone {
        fn invoke(&self, work: Work, control: Control) -> BoxFuture<'static, Outcome> {
            let done = work.body.as_ref().and_then(|b| b.pointer("/metadata/uid")) == Some(&json!("done"));
            Box::pin(async move {
                if !done {
                    control.cancel.cancelled().await;
                }
                Outcome::success(None)
            })
        }
    }

    fn object(uid: &str, labelled: bool) -> Value {
        let mut body = example();
        body["metadata"]["uid"] = json!(uid);
        if labelled {
            body["metadata"]["labels"] = json!({"watched": "yes"});
        }
        body
    }

    #[tokio::test(start_paused = true)]
    async fn objects_are_kept_only_while_a_daemon_runs_for_them() {
        let cancel = CancellationToken::new();
        let finished = Finished::default();
        let daemons = daemons_sharing(Arc::new(ReturnsForDone), &cancel, &finished);
        let mut monitor = Registration::new("monitor", HandlerKind::Daemon, None);
        monitor.resource = Some(resource());
        monitor
            .filters
            .labels
            .insert("watched".into(), crate::model::MetaMatch::Equals("yes".into()));
        let handlers = std::slice::from_ref(&monitor);
        for n in 0..1000 {
            assert!(!daemons.sync(
                &format!("u{n}"),
                &object(&format!("u{n}"), false),
                handlers,
                false
            ));
        }
        assert_eq!(
            daemons.objects.lock().len(),
            0,
            "objects no daemon matches are not kept"
        );
        assert!(daemons.sync("running", &object("running", true), handlers, false));
        assert!(daemons.sync("done", &object("done", true), handlers, false));
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(
            daemons.objects.lock().len(),
            1,
            "only the object with a running daemon"
        );
        assert_eq!(finished.objects(), 1);
        // Both are deleted.
        daemons.forget("running");
        daemons.forget("done");
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(daemons.objects.lock().len(), 0);
        assert_eq!(finished.objects(), 0);
        assert_eq!(daemons.running(), 0);
        cancel.cancel();
    }

    #[test]
    fn the_done_daemons_of_at_most_so_many_objects_are_remembered() {
        let finished = Finished::with_capacity(2);
        let id = HandlerId("monitor".into());
        for uid in ["a", "b", "c"] {
            finished.insert(uid, &id);
        }
        assert_eq!(finished.objects(), 2);
        assert!(!finished.contains("a", &id), "the oldest is forgotten");
        assert!(finished.contains("b", &id) && finished.contains("c", &id));
    }

    /// Attaches a handler process holding `monitor` to `hub`; returns its connection and the
    /// first invocation it receives.
    async fn holder(hub: &crate::grpc::Hub, monitor: &Registration) -> (crate::grpc::hub::ConnectionId, u32) {
        let (tx, mut rx) = mpsc::channel(64);
        let (conn, taken) = hub.attach(tx, 8, false, vec![monitor.clone()]);
        assert!(taken.is_empty());
        hub.open(conn);
        let deadline = Instant::now() + Duration::from_secs(600);
        loop {
            let message = tokio::select! {
                m = rx.recv() => m,
                () = tokio::time::sleep_until(deadline) => None,
            };
            match message.and_then(|m| m.message) {
                Some(capstan_proto::pb::connect_response::Message::Invocation(i)) => {
                    return (conn, i.attempt);
                }
                Some(_) => {}
                None => panic!("the daemon was not started on the reconnected handler process"),
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_daemon_starts_again_after_every_loss_of_its_handler_process() {
        let hub = crate::grpc::Hub::default();
        let cancel = CancellationToken::new();
        let daemons = daemons_with(Arc::new(hub.clone()), &cancel);
        let mut monitor = Registration::new("monitor", HandlerKind::Daemon, None);
        monitor.resource = Some(resource());
        monitor.backoff = Duration::from_secs(1);
        assert!(daemons.sync("u1", &example(), std::slice::from_ref(&monitor), false));
        // Far more process restarts than the poison-pill guard's limit, each after the daemon
        // ran for a while: none of them is the daemon's failure.
        for _ in 0..6 {
            let (conn, _) = holder(&hub, &monitor).await;
            tokio::time::sleep(Duration::from_secs(120)).await;
            hub.detach(conn);
        }
        let (_conn, _) = holder(&hub, &monitor).await;
        assert_eq!(daemons.running(), 1);
        cancel.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn a_daemon_whose_process_keeps_dying_at_its_start_is_started_less_often() {
        let hub = crate::grpc::Hub::default();
        let cancel = CancellationToken::new();
        let daemons = daemons_with(Arc::new(hub.clone()), &cancel);
        let mut monitor = Registration::new("monitor", HandlerKind::Daemon, None);
        monitor.resource = Some(resource());
        monitor.backoff = Duration::from_secs(10);
        monitor.retries = Some(1);
        assert!(daemons.sync("u1", &example(), std::slice::from_ref(&monitor), false));
        let mut waits = Vec::new();
        let (mut conn, mut attempt) = holder(&hub, &monitor).await;
        for n in 1..=5u32 {
            assert_eq!(
                attempt, n,
                "losses count in the attempt number, not against retries"
            );
            hub.detach(conn);
            let lost_at = Instant::now();
            (conn, attempt) = holder(&hub, &monitor).await;
            waits.push(lost_at.elapsed().as_secs());
        }
        // max_losses (3) losses in a row soon after the start: then 10 s, doubling.
        assert_eq!(waits, [0, 0, 10, 20, 40]);
        cancel.cancel();
    }

    #[tokio::test(start_paused = true)]
    async fn progress_patches_are_coalesced_while_a_write_is_in_flight() {
        let patches = Arc::new(AtomicU32::new(0));
        let last = Arc::new(Mutex::new(Value::Null));
        let (stopped, _stopped_rx) = mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        let resource = ResolvedResource {
            group: "demo.capstan.dev".into(),
            version: "v1".into(),
            plural: "examples".into(),
            kind: "Example".into(),
            namespaced: true,
            status_subresource: false,
        };
        let daemons = Daemons::new(Context {
            resource: resource.clone(),
            invoker: Arc::new(Chatty),
            objects: slow_api(patches.clone(), last.clone()),
            rules: Rules {
                prefix: "capstan.dev".into(),
                diffbase_key: None,
                extra_fields: Vec::new(),
            },
            stopped,
            cancel: cancel.clone(),
            finalizer: Keys::new("capstan.dev").finalizer,
            max_losses: 3,
            finished: Finished::default(),
        });
        let mut monitor = Registration::new("monitor", HandlerKind::Daemon, None);
        monitor.resource = Some(resource);
        assert!(daemons.sync("u1", &example(), &[monitor], false));
        let deadline = Instant::now() + Duration::from_secs(60);
        while last.lock().pointer("/metadata/annotations/progress") != Some(&json!((BATCHES - 1).to_string()))
        {
            assert!(Instant::now() < deadline, "the last progress was not written");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let writes = patches.load(Ordering::SeqCst);
        assert!(writes <= 3, "{BATCHES} progress patches took {writes} writes");
        cancel.cancel();
    }
}
