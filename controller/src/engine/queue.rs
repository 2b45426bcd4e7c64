//! Per-object serial queues: one worker per object (by uid), objects in parallel under a global
//! limit, and a newer version of an object superseding an older one still waiting.
//!
//! A worker takes the latest pending event of its object, runs a processing cycle and writes
//! the result (one PATCH, plus `/status` where needed); then it exits, keeping only the
//! object's small memory: its body is kept only while something will need it without a new
//! event (a retry or re-run due, daemons or timers running); objects at rest
//! are listed again when they must all be re-processed (see [`relisting`]). Delayed retries
//! are scheduled here by the controller's own timer, never by "touch" patches. A write answers
//! with the object as stored, which is what the write's echo will bring: the worker checks that
//! version at once (a handler added meanwhile, a webhook's change, the handlers due after a
//! finalizer's write), and watch events of versions a cycle has seen — the echo, recognised by
//! its exact version, and anything that arrived before it — are dropped before they reach a
//! cycle (resourceVersions are opaque: see `queue::version`).
//!
//! # Bounded memory
//!
//! An object with work waits in the resource's ready lines (its uid, once: changes before
//! confirmations of the state, which are never starved; see [`ready`]) until the queue's
//! dispatcher gets one of the global limit's permits (`--worker-limit`, first come first
//! served across resources) and then takes the best work waiting at that moment; only then is
//! a worker task spawned. So at any time at most
//! `--worker-limit` objects have a task, a parsed body and an invocation in flight, however
//! many objects a start-up listing brings: a waiting object costs its slot and one compressed
//! body (a newer event replaces the one waiting), never a task whose future is sized for a
//! whole cycle. At most `waiting_bodies` objects of a queue wait with their body (changes may
//! use a reserve of a quarter more, so that a listing's backlog, which keeps the bound full,
//! does not make a new object wait for a relisting): beyond that, an object's event only marks
//! it, and its body is listed again once there is room (see
//! [`relisting`]), paced by the workers — so a start with 100,000 unhandled objects holds a
//! bounded number of bodies, not all of them. An object with more work after its cycle goes to
//! the end of the ready list again (after at most [`FOLLOW_UPS`] cycles in a row, each
//! checking the answer of the write before), so a busy object cannot keep a permit from the
//! others.
//! `capstan_objects_processing` (and its `_peak`) shows how many objects run at once;
//! `capstan_objects_pending` how many wait.

use std::{
    collections::HashMap,
    num::NonZeroU64,
    panic::AssertUnwindSafe,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, SystemTime},
};

use futures::FutureExt;
use parking_lot::Mutex;
use serde_json::Value;
use tokio::{
    sync::{Notify, OwnedSemaphorePermit, Semaphore, watch},
    task::JoinHandle,
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{Instrument, debug, error, info_span, warn};

use self::{
    ready::{Priority, Taken},
    version::{Judged, Versions, version_of},
};
use super::{
    processing::{self, Input, Invoker, Memory, Storage},
    writing::{Writer, Written},
};
use crate::{
    k8s::objects::Objects,
    model::{EventType, Registration, ResolvedResource},
};

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
    /// Consecutive attempts lost with their handler process before a handler fails for good.
    pub max_losses: u32,
    /// How the objects are listed again to re-process those at rest.
    pub relisting: relisting::Settings,
}

/// How long an object whose cycle panicked waits before it is processed again.
pub const PANIC_RETRY: Duration = Duration::from_secs(5);

/// Frees an object's slot when its worker ends abnormally (see [`Queue::work`]).
struct WorkerGuard<'a> {
    queue: &'a Queue,
    uid: &'a str,
    armed: bool,
}

impl Drop for WorkerGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut slots = self.queue.slots.lock();
        if let Some(slot) = slots.get_mut(self.uid) {
            slot.running = false;
            if slot.pending.take().is_some() {
                self.queue.count_waiting(-1);
            }
            error!(object.uid = %self.uid, "an object's worker ended abnormally; its next event starts a new one");
        }
    }
}

/// The queues of one resource.
#[derive(Clone)]
pub struct Queue {
    ctx: Arc<Context>,
    writer: Arc<Writer>,
    events: Arc<events::EventDispatch>,
    slots: Arc<Mutex<HashMap<Box<str>, Slot>>>,
    /// Objects our own write found gone: a late event of one (all its events came before its
    /// deletion) finds no slot and must not start one (bounded).
    tombstones: Arc<Mutex<HashMap<String, tokio::time::Instant>>>,
    /// Objects with work waiting for a permit of the global limit, each at most once.
    ready: Arc<Ready>,
    /// The listing that re-processes objects at rest, while one runs.
    relisting: Arc<relisting::Relisting>,
    /// The objects' workers and the dispatcher: owned, so that a queue that is stopped can be
    /// waited for.
    workers: TaskTracker,
}

/// The objects with work and no worker yet (see the module docs).
#[derive(Default)]
struct Ready {
    lines: ready::Ready,
    /// How many objects wait with a body (their pending event).
    waiting: AtomicUsize,
    /// Told when an object's waiting body is taken or dropped.
    room: Notify,
}

/// A permit of the global limit held by one object's worker, counted in the metrics.
struct Working {
    _permit: OwnedSemaphorePermit,
}

impl Working {
    fn new(permit: OwnedSemaphorePermit) -> Self {
        crate::observability::metrics::global().processing(1);
        Self { _permit: permit }
    }
}

impl Drop for Working {
    fn drop(&mut self) {
        crate::observability::metrics::global().processing(-1);
    }
}

/// How many cycles one worker runs in a row, each after the first checking the answer of the
/// write before, until the object goes to the end of the ready list with the answer still to
/// check (a finalizer's write, the handlers' write, the check that finds nothing to do; more
/// only for an object that changes with every write, such as one a webhook edits each time).
const FOLLOW_UPS: usize = 4;

/// An object's next piece of work (see [`Queue::take_next`]).
struct Next {
    event_type: EventType,
    body: Stored,
    /// Whether `body` is the object as the API server stored it.
    as_stored: bool,
    /// Whether `body` is news for the event handlers (see [`Pending::event`]).
    event: bool,
    memory: Memory,
}

/// Where a queued body comes from.
#[derive(Clone, Copy, Debug)]
enum Source {
    /// A watch event, or an object of the watch's listing (`listed`: when that listing
    /// started; `in_listing`: an event standing in for the object's listed body).
    Watch {
        listed: Option<tokio::time::Instant>,
        in_listing: bool,
    },
    /// A body kept in memory: a retry, timer or daemon that is due (a change), or a resync
    /// (a confirmation).
    Memory(Priority),
}

/// How many tombstones are kept, and for how long.
const TOMBSTONES: usize = 4096;
const TOMBSTONE_TTL: Duration = Duration::from_secs(300);

/// An object's next work, waiting for its worker.
struct Pending {
    event_type: EventType,
    /// Whether the body is the object as the API server stored it (a watch event, a listing,
    /// a write's answer), not one kept in memory.
    as_stored: bool,
    /// Whether the body is news for the event handlers: a watch event or a listed body
    /// standing in for one, not our own write's echo or answer, nor a body from memory.
    event: bool,
    /// Whether this work, or work it replaced, is a change (see [`ready`]): a listing's body
    /// that replaces a change's still goes with the changes.
    change: bool,
    body: Stored,
}

#[derive(Default)]
struct Slot {
    /// The object's next work: its event type, whether the body is as stored and whether it
    /// is news (see [`Pending`]), and the body.
    pending: Option<Pending>,
    running: bool,
    memory: Memory,
    last_body: Option<Stored>,
    /// The echo of our own write the object waits for, and the versions that arrived while
    /// its cycle runs (see [`version`]); none when there is nothing to know.
    versions: Option<Box<Versions>>,
    timer: Option<JoinHandle<()>>,
    gone: bool,
    /// Run another cycle with the latest body once the current one ends.
    rerun: bool,
    /// The object needs a cycle whose body is not in memory (a resync found none, or its
    /// event came while the queue held as many waiting bodies as it may): its next listed
    /// body is queued for it, as this event type, unless a cycle starts before.
    relist: Option<EventType>,
    /// When an event marked it: the first listing pass that satisfies the mark (one that
    /// started after the event came); none: any listed body will do (a resync's mark).
    relist_from: Option<NonZeroU64>,
    /// The ready line the object waits in (see [`ready`]); none when it is not waiting.
    queued: Option<Priority>,
}

impl Slot {
    /// What is known of the object's versions, made when needed.
    fn versions(&mut self) -> &mut Versions {
        self.versions.get_or_insert_with(Box::default)
    }

    /// Drops the record of versions when nothing is known any more.
    fn tidy(&mut self) {
        if self.versions.as_ref().is_some_and(|v| v.is_empty()) {
            self.versions = None;
        }
    }

    /// Judges an event of `version` by the echo the object waits for (see [`version`]).
    fn judge(&mut self, version: Option<&str>, listed: Option<tokio::time::Instant>) -> Judged {
        let Some(versions) = self.versions.as_mut() else {
            return Judged::New;
        };
        let judged = versions.judge(version, listed);
        self.tidy();
        judged
    }

    /// A cycle of the object starts: the events arriving from now on are remembered.
    fn cycle_starts(&mut self) {
        if let Some(versions) = self.versions.as_mut() {
            versions.cycle_starts();
        }
        self.tidy();
    }

    /// The object's worker ends: what arrived while it ran is forgotten.
    fn cycle_ends(&mut self) {
        if let Some(versions) = self.versions.as_mut() {
            versions.cycle_ends();
        }
        self.tidy();
    }

    /// Marks the object for a listed body, as `event_type`, satisfied by listing pass `from`
    /// or a later one (none: by any pass).
    fn mark(&mut self, event_type: EventType, from: Option<u64>) {
        self.relist = Some(event_type);
        self.relist_from = self.relist_from.max(from.and_then(NonZeroU64::new));
    }

    /// The object's cycle starts: the mark is spent.
    fn unmark(&mut self) {
        self.relist = None;
        self.relist_from = None;
    }

    /// The object, which has a worker or waits for one, gets more work: a change moves it up
    /// from the confirmations, marked so under the caller's lock (the caller then
    /// [promotes](ready::Ready::promote) it).
    fn promote(&mut self, change: bool) -> Queued {
        if change && self.queued == Some(Priority::Confirmation) {
            self.queued = Some(Priority::Change);
            Queued::Promoted
        } else {
            Queued::Already
        }
    }
}

/// What became of an object given work (see [`Queue::set_pending`]).
#[derive(Debug)]
enum Queued {
    /// It goes at the end of this ready line.
    In(Priority),
    /// It waited as a confirmation and goes with the changes now.
    Promoted,
    /// It waits or runs already.
    Already,
}

fn uid_of(body: &Value) -> Option<String> {
    body.pointer("/metadata/uid")
        .and_then(Value::as_str)
        .map(str::to_owned)
}

impl Queue {
    /// Empty queues for one resource.
    pub fn new(ctx: Context) -> Self {
        let writer = Arc::new(Writer {
            objects: ctx.objects.clone(),
            resource: ctx.resource.clone(),
            storage: ctx.storage.clone(),
            cancel: ctx.cancel.clone(),
        });
        let queue = Self {
            workers: TaskTracker::new(),
            ctx: Arc::new(ctx),
            writer,
            events: Arc::new(events::EventDispatch::default()),
            slots: Arc::new(Mutex::new(HashMap::new())),
            tombstones: Arc::default(),
            ready: Arc::default(),
            relisting: Arc::default(),
        };
        let dispatcher = queue.clone();
        queue.workers.spawn(async move { dispatcher.dispatch().await });
        queue
    }

    /// Puts an object at the end of its ready line; its slot was marked running and queued in
    /// that line under the same lock that decided it (so a change arriving meanwhile finds
    /// the mark and moves it up).
    fn enqueue(&self, uid: String, priority: Priority) {
        crate::observability::metrics::global()
            .workqueue(&self.ctx.resource.plural)
            .add(&uid);
        self.ready.lines.push(uid, priority);
    }

    /// How many objects wait for a worker.
    pub fn ready(&self) -> usize {
        self.ready.lines.len()
    }

    /// The best work waiting now: the next entry of the ready lines whose object still waits
    /// in that line (the old entry of an object moved to the changes is skipped).
    fn next_ready(&self) -> Option<String> {
        loop {
            let Taken { uid, priority } = self.ready.lines.take()?;
            {
                let mut slots = self.slots.lock();
                // An object owed a dispatch keeps its slot until its worker runs: an entry
                // whose object is marked for another line, or not at all, or whose slot is
                // gone, is the surplus one of a promotion.
                if let Some(slot) = slots.get_mut(uid.as_str())
                    && slot.queued == Some(priority)
                {
                    slot.queued = None;
                    return Some(uid);
                }
            }
            self.ready.lines.skipped();
        }
    }

    /// The dispatcher: once objects are ready, gets a permit of the global limit and gives it
    /// to the best work waiting then (a change that came while the permit was awaited goes
    /// before the confirmations); ends when the queue is stopped.
    async fn dispatch(self) {
        let cancel = self.ctx.cancel.clone();
        loop {
            if self.ready.lines.is_empty() {
                tokio::select! {
                    () = cancel.cancelled() => return self.abandon(),
                    () = self.ready.lines.added.notified() => continue,
                }
            }
            let permit = tokio::select! {
                () = cancel.cancelled() => return self.abandon(),
                permit = self.ctx.limit.clone().acquire_owned() => permit,
            };
            let Ok(permit) = permit else {
                // The limit is closed: nothing is processed any more.
                return self.abandon();
            };
            let Some(uid) = self.next_ready() else {
                continue;
            };
            let working = Working::new(permit);
            let turn = crate::observability::metrics::global()
                .workqueue(&self.ctx.resource.plural)
                .take(&uid);
            let queue = self.clone();
            self.workers.spawn(async move {
                queue.work(uid, working).await;
                drop(turn);
            });
        }
    }

    /// The queue is stopped: the work still waiting is dropped (the next queue of the
    /// resource lists the objects again) and no longer counted as pending.
    fn abandon(&self) {
        let mut dropped = 0_i64;
        for slot in self.slots.lock().values_mut() {
            if slot.pending.take().is_some() {
                dropped += 1;
            }
        }
        self.ready.lines.clear();
        crate::observability::metrics::global()
            .workqueue(&self.ctx.resource.plural)
            .clear();
        self.count_waiting(-dropped);
    }

    /// Counts objects that start (`delta` > 0) or stop waiting with a body, in the queue's
    /// bound and in the metrics.
    fn count_waiting(&self, delta: i64) {
        if delta == 0 {
            return;
        }
        crate::observability::metrics::global().pending(&self.ctx.resource.plural, delta);
        let n = usize::try_from(delta.unsigned_abs()).unwrap_or(usize::MAX);
        if delta > 0 {
            self.ready.waiting.fetch_add(n, Ordering::Relaxed);
        } else {
            let _ = self
                .ready
                .waiting
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                    Some(w.saturating_sub(n))
                });
            self.ready.room.notify_one();
        }
    }

    /// Whether another object may wait with its body: confirmations within the bound,
    /// changes also within a reserve of a quarter of it beyond (so that a new object, a
    /// change or a retry that is due does not wait for a relisting behind a listing's
    /// backlog, which keeps the bound full).
    fn has_room(&self, priority: Priority) -> bool {
        let bound = self.ctx.relisting.waiting_bodies.max(1);
        let bound = match priority {
            Priority::Change => bound + bound / 4,
            Priority::Confirmation => bound,
        };
        self.ready.waiting.load(Ordering::Relaxed) < bound
    }

    /// Remembers that our own write found object `uid` gone.
    fn bury(&self, uid: &str) {
        let mut tombstones = self.tombstones.lock();
        if tombstones.len() >= TOMBSTONES {
            let now = tokio::time::Instant::now();
            tombstones.retain(|_, at| now.duration_since(*at) < TOMBSTONE_TTL);
            if tombstones.len() >= TOMBSTONES {
                tombstones.clear();
            }
        }
        tombstones.insert(uid.to_owned(), tokio::time::Instant::now());
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
    ///
    /// At most [`EVENT_DISPATCH_LIMIT`] fire-and-forget event handler invocations of the
    /// resource run at once; beyond that, the event is dropped for the handler (counted and
    /// warned about) — never a task and a body copy per event and handler piling up, and
    /// never a stalled watch when one handler's process is slow or away.
    ///
    /// `listed`: for an object of the watch's listing, when that listing started (a listing
    /// that started after a write's answer reflects the write). `in_listing`: a watch event
    /// standing in for the listed body of an object of the listing under way (see
    /// [`crate::k8s::watch::Event::in_listing`]).
    pub async fn observe(
        &self,
        event_type: EventType,
        mut body: Value,
        listed: Option<tokio::time::Instant>,
        in_listing: bool,
    ) {
        self.dispatch_event_handlers(event_type, &body).await;
        // Kept for the event handlers only (kopf's raw events have them); never stored.
        crate::k8s::objects::drop_managed_fields(&mut body);
        self.queue_body(event_type, body, Source::Watch { listed, in_listing });
    }

    /// Queues a watch event; starts the object's worker if it is idle.
    pub fn push(&self, event_type: EventType, body: Value) {
        self.queue_body(
            event_type,
            body,
            Source::Watch {
                listed: None,
                in_listing: false,
            },
        );
    }

    /// Queues an event (of the watch, or a body kept in memory); starts the object's worker
    /// if it is idle.
    fn queue_body(&self, event_type: EventType, body: Value, source: Source) {
        let Some(uid) = uid_of(&body) else {
            warn!("an object without a uid was ignored");
            return;
        };
        if self.ctx.cancel.is_cancelled() {
            return;
        }
        let mut slots = self.slots.lock();
        if event_type != EventType::Deleted
            && !slots.contains_key(uid.as_str())
            && self.tombstones.lock().contains_key(&uid)
        {
            debug!(%uid, "late event of an object that is gone dropped");
            return;
        }
        let slot = slots.entry(uid.as_str().into()).or_insert_with(|| Slot {
            memory: Memory {
                noticed_by_listing: event_type == EventType::Listing
                    || matches!(source, Source::Watch { in_listing: true, .. }),
                fully_handled_once: false,
            },
            ..Slot::default()
        });
        if slot.gone && event_type != EventType::Deleted {
            debug!(%uid, "event of an object our own write found gone dropped");
            return;
        }
        let version = version_of(&body);
        let mut news = true;
        match source {
            Source::Watch { listed, .. } => {
                if slot.running
                    && let Some(version) = version
                {
                    slot.versions().arrive(version);
                }
                // Our own write's echo whose body a cycle has seen (its answer was checked when
                // it came) brings nothing new, nor does an event that came before it (see
                // `version`).
                if event_type != EventType::Deleted {
                    match slot.judge(version, listed) {
                        Judged::Echo { seen: true } => {
                            debug!(%uid, ?version, "the echo of our own write dropped");
                            return;
                        }
                        Judged::Echo { seen: false } => news = false,
                        Judged::Stale => {
                            debug!(%uid, ?version, "an event that predates our own write dropped");
                            if event_type == EventType::Listing && !slot.running && slot.pending.is_none() {
                                // A listing that was under way as our write answered may hold a
                                // change made after it: a listing that starts now tells.
                                slot.mark(event_type, Some(self.relisting.next_pass()));
                                self.relisting.marked();
                                drop(slots);
                                self.relist_soon();
                            }
                            return;
                        }
                        Judged::New => {}
                    }
                }
            }
            Source::Memory(_) if slot.relist_from.is_some() => {
                debug!(%uid, "a newer event waits for its listed body; the body in memory is not queued");
                return;
            }
            Source::Memory(_) => news = false,
        }
        let priority = match source {
            Source::Watch { .. } if event_type == EventType::Listing => Priority::Confirmation,
            Source::Watch { .. } => Priority::Change,
            Source::Memory(priority) => priority,
        };
        let watched = matches!(source, Source::Watch { .. });
        // The next event of an object whose cycle runs waits with its body beyond the bound
        // (it may be the echo of the write in flight, which the write's answer then replaces):
        // at most one per worker.
        if slot.pending.is_none()
            && event_type != EventType::Deleted
            && !slot.running
            && !self.has_room(priority)
        {
            // As many bodies wait as may: this one is listed again when there is room.
            debug!(%uid, "too many objects wait; the object waits for its listed body");
            slot.mark(event_type, Some(self.relisting.next_pass()));
            self.relisting.marked();
            drop(slots);
            self.relist_soon();
            return;
        }
        let queued = self.set_pending(slot, event_type, Stored::new(&body), watched, news, priority);
        drop(slots);
        self.place(uid, queued);
    }

    /// Puts an object given work where [`Queue::set_pending`] (or [`Slot::promote`]) said,
    /// once the slots' lock is released.
    fn place(&self, uid: String, queued: Queued) {
        match queued {
            Queued::In(line) => self.enqueue(uid, line),
            Queued::Promoted => self.ready.lines.promote(uid),
            Queued::Already => {}
        }
    }

    /// Makes `body` the object's next work (`news`: see [`Pending::event`]), of `priority`;
    /// says whether the object must be put in a ready line (it had no worker and none
    /// waiting: its slot is marked for that line now), moved up to the changes (it waits as a
    /// confirmation and this is a change), or neither.
    fn set_pending(
        &self,
        slot: &mut Slot,
        event_type: EventType,
        body: Stored,
        as_stored: bool,
        news: bool,
        priority: Priority,
    ) -> Queued {
        let change = priority == Priority::Change || slot.pending.as_ref().is_some_and(|p| p.change);
        if slot.pending.is_none() {
            self.count_waiting(1);
        }
        slot.pending = Some(Pending {
            event_type,
            as_stored,
            event: news,
            change,
            body,
        });
        if !std::mem::replace(&mut slot.running, true) {
            let line = Priority::of(change);
            slot.queued = Some(line);
            return Queued::In(line);
        }
        slot.promote(change)
    }

    /// Re-runs a cycle for every known object with its latest body (after the handlers
    /// changed: new handlers to run, finalizers to add or release; or after a pause): those
    /// with their body in memory at once, those at rest by listing them again.
    pub fn resync(&self) {
        let (bodies, at_rest) = {
            let mut slots = self.slots.lock();
            // Kept compressed: each is parsed only as it is queued.
            let mut bodies: Vec<Stored> = Vec::new();
            let mut at_rest = 0_usize;
            // Objects with work waiting get a cycle anyway. One whose cycle runs now may have
            // started it with the old handlers: it runs once more after it, with the body that
            // cycle leaves (kept for the re-run) — or, if that cycle ended already without
            // keeping one, with its listed body.
            for slot in slots.values_mut().filter(|s| !s.gone && s.pending.is_none()) {
                if slot.running {
                    slot.rerun = true;
                    slot.mark(slot.relist.unwrap_or(EventType::Modified), None);
                    at_rest += 1;
                    continue;
                }
                match &slot.last_body {
                    // A body waiting for its listing is newer than the one in memory.
                    Some(body) if slot.relist.is_none() => bodies.push(body.clone()),
                    _ => {
                        slot.mark(slot.relist.unwrap_or(EventType::Modified), None);
                        at_rest += 1;
                    }
                }
            }
            if at_rest > 0 {
                self.relisting.marked();
            }
            (bodies, at_rest)
        };
        debug!(objects = bodies.len(), at_rest, "re-processing known objects");
        for body in bodies {
            self.queue_body(
                EventType::Modified,
                body.value(),
                Source::Memory(Priority::Confirmation),
            );
        }
        if at_rest > 0 {
            self.relist();
        }
    }

    /// The queue's workers, to wait for once the queue is stopped: a new queue of the same
    /// resource must not process an object while a worker of this one still does (its cycle
    /// may still be waiting for an invocation's end or writing).
    pub fn workers(&self) -> TaskTracker {
        self.workers.clone()
    }

    /// The queue's resource.
    pub fn resource(&self) -> &ResolvedResource {
        &self.ctx.resource
    }

    /// Whether both handles are the same queue.
    pub fn same(&self, other: &Queue) -> bool {
        Arc::ptr_eq(&self.slots, &other.slots)
    }

    /// The bodies in memory (of objects not at rest: see the module docs), for cleanups
    /// across objects when they cannot be listed.
    pub fn bodies(&self) -> Vec<Value> {
        self.slots
            .lock()
            .values()
            .filter(|s| !s.gone)
            .filter_map(|s| s.last_body.as_ref().map(Stored::value))
            .collect()
    }

    /// Stops every timer and running event handler invocation (when the watch stops).
    pub fn stop_timers(&self) {
        self.events.tasks.lock().abort_all();
        for slot in self.slots.lock().values_mut() {
            if let Some(t) = slot.timer.take() {
                t.abort();
            }
        }
    }

    /// The object's worker, holding a permit of the global limit: runs one cycle with the
    /// object's latest event, then goes back to the end of the ready list if more work came
    /// meanwhile. A cycle that panics is logged with its object and run again after
    /// [`PANIC_RETRY`]; if the worker ends any other abnormal way, its guard frees the object's
    /// slot so that the next event starts a new one.
    async fn work(self, uid: String, working: Working) {
        let mut guard = WorkerGuard {
            queue: &self,
            uid: &uid,
            armed: true,
        };
        let mut answers = 0;
        while self.cycle(&uid).await {
            answers += 1;
            if answers == FOLLOW_UPS {
                self.defer_answer(&uid);
                break;
            }
        }
        drop(working);
        self.finish(&uid);
        guard.armed = false;
    }

    /// Takes the object's next piece of work: its latest event, or a re-run with its latest
    /// body. (Events that predate our own write were dropped as they came, or replaced by the
    /// write's answer: see [`Queue::check_answer`].)
    fn take_next(&self, uid: &str) -> Option<Next> {
        let mut slots = self.slots.lock();
        let slot = slots.get_mut(uid)?;
        let taken = slot.pending.take();
        if taken.is_some() {
            self.count_waiting(-1);
        }
        match taken {
            // Work pending now came after any mark (a mark is made only when nothing waits): it
            // is at least as new as the event that marked the object.
            Some(Pending {
                event_type,
                as_stored,
                event,
                body,
                ..
            }) => {
                slot.unmark();
                slot.cycle_starts();
                Some(Next {
                    event_type,
                    body,
                    as_stored,
                    event,
                    memory: slot.memory,
                })
            }
            None if slot.rerun && !slot.gone && slot.last_body.is_some() => {
                slot.rerun = false;
                if slot.relist_from.is_some() {
                    // An event came after the body in memory and waits for its listed body:
                    // that cycle does the re-run.
                    debug!(%uid, "re-run left to the newer listed body");
                    return None;
                }
                slot.unmark();
                slot.cycle_starts();
                slot.last_body.clone().map(|body| Next {
                    event_type: EventType::Modified,
                    body,
                    as_stored: false,
                    event: false,
                    memory: slot.memory,
                })
            }
            // The slot stays running: `finish` marks it idle (or removes a gone object)
            // under the same lock as it checks for work pushed meanwhile, so the object
            // is never queued twice.
            None => None,
        }
    }

    /// After a worker's cycle: the object goes to the end of the ready list if it has more
    /// work, or becomes idle.
    fn finish(&self, uid: &str) {
        let mut slots = self.slots.lock();
        let Some(slot) = slots.get_mut(uid) else { return };
        if !slot.running {
            return;
        }
        let more = slot.pending.is_some() || (slot.rerun && !slot.gone && slot.last_body.is_some());
        if more && !self.ctx.cancel.is_cancelled() {
            // Handling under way goes on as a change, unless all that waits is a listing's.
            let priority = Priority::of(slot.pending.as_ref().is_none_or(|p| p.change));
            slot.queued = Some(priority);
            drop(slots);
            self.enqueue(uid.to_owned(), priority);
            return;
        }
        if slot.pending.take().is_some() {
            // Stopped: the next queue of the resource lists the object again.
            self.count_waiting(-1);
        }
        // A wake-up that came while the cycle ended without keeping a body was for work that
        // cycle did: nothing is left to re-run.
        slot.rerun = false;
        slot.running = false;
        slot.cycle_ends();
        if slot.gone {
            slots.remove(uid);
        }
    }

    /// Runs one cycle with the object's next work; returns whether it left the answer to its
    /// write as the next work (see [`Queue::check_answer`]).
    async fn cycle(&self, uid: &str) -> bool {
        let Some(Next {
            event_type,
            body: stored,
            as_stored,
            event,
            memory,
        }) = self.take_next(uid)
        else {
            return false;
        };
        let body = stored.value();
        if *self.ctx.paused.borrow() && event_type != EventType::Deleted {
            // Paused (frozen, standby, draining): nothing is processed or written, and no body
            // is kept (a standby watching 100,000 objects would keep them all): resuming
            // re-processes every object, those without a body by listing them again.
            if let Some(slot) = self.slots.lock().get_mut(uid) {
                slot.last_body = None;
            }
            return false;
        }
        if self.ctx.cancel.is_cancelled() {
            let removed = self.slots.lock().remove(uid);
            if removed.is_some_and(|s| s.pending.is_some()) {
                self.count_waiting(-1);
            }
            return false;
        }
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
        let span = info_span!("object", object.resource = %self.ctx.resource.plural, object.namespace = %namespace, object.name = %name, object.uid = %uid, trace.id = tracing::field::Empty);
        let cycle = self
            .process(uid, event_type, body, as_stored, event, memory)
            .instrument(span.clone());
        match AssertUnwindSafe(cycle).catch_unwind().await {
            Ok(answer_next) => answer_next,
            Err(panic) => {
                span.in_scope(|| self.recover(uid, stored, panic.as_ref()));
                false
            }
        }
    }

    /// After a cycle panicked: logs it and runs the object again after a pause, with the body
    /// it was processing (or a newer one).
    fn recover(&self, uid: &str, stored: Stored, panic: &(dyn std::any::Any + Send)) {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| (*s).to_owned())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".to_owned());
        error!(panic = %what, retry_in = ?PANIC_RETRY, "processing the object panicked; it is processed again after a pause");
        self.defer(uid, stored, PANIC_RETRY);
    }

    /// Runs the object again after `delay`, with `stored` (or a newer body).
    fn defer(&self, uid: &str, stored: Stored, delay: Duration) {
        let mut slots = self.slots.lock();
        let Some(slot) = slots.get_mut(uid) else { return };
        // No cycle ended after the one that asked for the pause: what it processed is the
        // latest body (newer events wait as pending work).
        slot.last_body = Some(stored);
        self.schedule(slot, uid, delay);
    }

    /// Wakes the object after `delay` (replacing any earlier wake-up).
    fn schedule(&self, slot: &mut Slot, uid: &str, delay: Duration) {
        if let Some(t) = slot.timer.take() {
            t.abort();
        }
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

    /// One cycle with `body`; returns whether the answer to its write is the object's next
    /// work (see [`Queue::check_answer`]).
    async fn process(
        &self,
        uid: &str,
        event_type: EventType,
        mut body: Value,
        as_stored: bool,
        event: bool,
        memory: Memory,
    ) -> bool {
        if event_type == EventType::Deleted {
            // No tombstone: nothing of the object comes after its deletion, and a watch with a
            // selector says DELETED for an object that stops matching, whose events when it
            // matches again are news.
            self.forget_locally(uid, &body).await;
            self.ctx.daemons.forget(uid);
            self.ctx
                .invoker
                .object_gone(&processing::object_ref(&self.ctx.resource, &body));
            let mut slots = self.slots.lock();
            if let Some(slot) = slots.get_mut(uid) {
                if let Some(t) = slot.timer.take() {
                    t.abort();
                }
                slot.gone = true;
            }
            debug!("object is gone; forgotten");
            return false;
        }
        if let Some(local) = self.ctx.storage.local.as_deref()
            && let Err(e) = local.overlay(uid, &mut body).await
        {
            // Its records exist but cannot be read: processed without them, the object would
            // be taken for new and its create handlers would run again.
            let delay = local.retry_delay(uid);
            warn!(error = %crate::diagnostic::chain(&e), retry_in = ?delay, "the object's node-local state cannot be read or written; it is not processed until it can be");
            self.defer(uid, Stored::new(&body), delay);
            return false;
        }
        let handlers = self.ctx.handlers.borrow().clone();
        let paused = *self.ctx.paused.borrow();
        let (body, event_wake) = self
            .retry_event_handlers(event_type, body, &handlers, !event)
            .await;
        let daemons_alive = self.ctx.daemons.sync(uid, &body, &handlers, paused);
        // The version this cycle sees (the event handlers' progress write may have moved it on).
        let cycle_version = version_of(&body).map(str::to_owned);
        let plan = processing::cycle(
            Input {
                body: &body,
                event: event_type,
                resource: &self.ctx.resource,
                handlers: &handlers,
                memory,
                storage: &self.ctx.storage,
                cancel: &self.ctx.cancel,
                checkpoint: Some(self.writer.as_ref()),
                checkpoint_after: self.ctx.checkpoint_after,
                daemons_alive,
                max_losses: self.ctx.max_losses,
                registered: Some(self.ctx.handlers.clone()),
            },
            self.ctx.invoker.as_ref(),
        )
        .await;
        // The plan's base is this object as stored (the cycle's body, or what a checkpoint
        // wrote): the cycle's own copy of the body is not held while the write waits.
        drop(body);
        let body = &plan.base;
        let written = self.writer.write(body, &plan).await;
        let mut notes = plan.notes.clone();
        if let Written::Refused(message) = &written {
            error!(%message, cause = %plan.cause, "the API server refused the cycle's write for good; its changes are dropped, later changes of the object are handled");
            notes.push(processing::Note::new(
                crate::model::Level::Error,
                format!("The API server refused Capstan's write: {message}"),
                Vec::new(),
            ));
        }
        // Announcements (a consumed retry request) tell what the write did: posted only once
        // it landed, so a failed write and the cycle that repeats it post one Event, not two.
        if !plan.announcements.is_empty() && written.landed() {
            let object = processing::object_ref(&self.ctx.resource, body);
            for (level, reason, message) in &plan.announcements {
                self.ctx.poster.post(crate::model::Posting {
                    object: object.clone(),
                    level: *level,
                    reason: (*reason).into(),
                    message: message.clone(),
                    policy: crate::model::Policy::Always,
                    event_type: None,
                });
            }
        }
        if !notes.is_empty() {
            let object = processing::object_ref(&self.ctx.resource, body);
            for note in notes {
                // Posted as the processes of its handlers want (kopf's operators post none).
                let wants: Vec<_> = note
                    .handlers
                    .iter()
                    .map(|h| self.ctx.invoker.outcome_events(h))
                    .collect();
                let Some(policy) = crate::model::posting::OutcomeEvents::policy(&wants, note.level) else {
                    continue;
                };
                self.ctx.poster.post(crate::model::Posting {
                    object: object.clone(),
                    level: note.level,
                    reason: "Logging".into(),
                    message: note.message,
                    policy,
                    event_type: None,
                });
            }
        }
        let refused = matches!(written, Written::Refused(_));
        if matches!(written, Written::Gone) {
            if let Some(slot) = self.slots.lock().get_mut(uid) {
                // Events of any version it had are late now.
                slot.gone = true;
                if slot.pending.take().is_some() {
                    self.count_waiting(-1);
                }
                if let Some(t) = slot.timer.take() {
                    t.abort();
                }
                slot.versions = None;
            }
            self.bury(uid);
            // Its DELETED event may have been among the dropped ones.
            self.ctx.daemons.forget(uid);
            self.ctx
                .invoker
                .object_gone(&processing::object_ref(&self.ctx.resource, body));
            self.forget_locally(uid, body).await;
            return false;
        }
        let mut slots = self.slots.lock();
        let Some(slot) = slots.get_mut(uid) else {
            return false;
        };
        if plan.done {
            slot.memory.fully_handled_once = true;
        }
        // A cycle interrupted by a handler's withdrawal (not by a stop) runs again at once,
        // with the handlers registered now.
        if plan.interrupted && !self.ctx.cancel.is_cancelled() {
            slot.rerun = true;
        }
        if let Some(t) = slot.timer.take() {
            t.abort();
        }
        // A refused write would be refused again: no retry of the cycle until the object
        // changes (or its handlers do).
        let planned = plan.wake_at.filter(|_| !refused);
        let wake_at = match (planned, event_wake) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        // A node-local state that could not be written: the object comes back to write it
        // (its handlers do not run until it is written).
        let unwritten = (self.ctx.storage.local.as_deref())
            .filter(|local| local.unwritten(uid))
            .map(|local| SystemTime::now() + local.retry_delay(uid));
        let wake_at = match (wake_at, unwritten) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        // The body is kept only when something will run again without a new event; an object
        // at rest is listed again if it must be re-processed (see `relisting`).
        let keep = wake_at.is_some() || slot.rerun || daemons_alive;
        // The object as stored after this cycle: its write's answer — checked next when it is a
        // version newer than the one the cycle saw (a write that changed nothing answers with
        // that one) — or, when nothing was written, the plan's base. That base is the cycle's own
        // body, or after a checkpoint what the cycle wrote with the server's version: not the
        // object as stored (someone may have changed it meanwhile), so the watch's event of that
        // version must still be processed. An answer of another object (one that took the name
        // over) is not this one's.
        let mut answer = None;
        let (after, checked) = match &written {
            Written::Stored(stored) if uid_of(stored).as_deref() == Some(uid) => {
                let stored_version = version_of(stored);
                // A write that stored a new version: its echo is awaited, and its answer is the
                // next work (so its body will have been seen). One that changed nothing
                // answers with the version the cycle saw: seen now if the cycle's body was
                // that version as stored; for a body kept in memory, what was seen stays (not
                // after a checkpoint composed it).
                let check = stored_version.is_some() && stored_version != cycle_version.as_deref();
                if let Some(version) = stored_version {
                    if check {
                        slot.versions().await_echo(version, true);
                    } else if as_stored {
                        slot.versions().saw(version);
                    }
                }
                (Some(stored), check)
            }
            // The answer of another object (one that took the name over): its echo is not
            // this object's.
            Written::Stored(_) => (None, false),
            Written::Nothing => {
                match version_of(&plan.base) {
                    // A checkpoint's composed body: the echo of what it wrote is awaited, and
                    // processed when it comes (someone may have changed the object meanwhile).
                    Some(version) if Some(version) != cycle_version.as_deref() => {
                        slot.versions().await_echo(version, false);
                    }
                    Some(version) if as_stored => slot.versions().saw(version),
                    // Otherwise a body kept in memory was seen again: what was seen stays.
                    _ => {}
                }
                slot.tidy();
                (Some(&plan.base), false)
            }
            Written::Refused(_) => (Some(&plan.base), false),
            Written::Gone | Written::Failed => (None, false),
        };
        match after {
            Some(after) if keep || checked => {
                let kept = Stored::new(after);
                if checked {
                    slot.last_body = keep.then(|| kept.clone());
                    answer = Some(kept);
                } else {
                    slot.last_body = Some(kept);
                }
            }
            _ if !keep || matches!(written, Written::Stored(_)) => slot.last_body = None,
            _ => {}
        }
        if let Some(at) = wake_at {
            let delay = at.duration_since(SystemTime::now()).unwrap_or_default();
            self.schedule(slot, uid, delay);
        }
        answer.is_some_and(|answer| self.check_answer(slot, answer))
    }

    /// After [`FOLLOW_UPS`] answers in a row, the object's turn is over: the answer waiting as
    /// its next work goes to the end of the ready list like any other work, and within the
    /// waiting bound — beyond it, the object is marked and its body listed again.
    fn defer_answer(&self, uid: &str) {
        let mut slots = self.slots.lock();
        let Some(slot) = slots.get_mut(uid) else { return };
        let over = self.ready.waiting.load(Ordering::Relaxed) > self.ctx.relisting.waiting_bodies.max(1);
        if !over {
            return;
        }
        if let Some(Pending { event_type, .. }) = slot.pending.take() {
            self.count_waiting(-1);
            slot.mark(event_type, Some(self.relisting.next_pass()));
            self.relisting.marked();
            drop(slots);
            self.relist_soon();
        }
    }

    /// Makes the object as its cycle left it stored the object's next work, as its echo would
    /// have: a write's answer is the object at the version the write produced, the same body
    /// the watch brings later. The echo then finds its version seen and is dropped
    /// ([`Queue::queue_body`]), so no echo ever waits with its body — the echoes of writes
    /// made while a long listing ran come all at once when the watch starts. Not when newer
    /// work waits already (a change by someone else, or a deletion): its cycle sees what the
    /// answer holds. Returns whether the answer is the next work.
    fn check_answer(&self, slot: &mut Slot, answer: Stored) -> bool {
        if slot.gone || self.ctx.cancel.is_cancelled() {
            return false;
        }
        let Some(version) = answer.version() else {
            return false;
        };
        if let Some(Pending {
            event_type,
            body: waiting,
            ..
        }) = &slot.pending
        {
            if *event_type == EventType::Deleted {
                return false;
            }
            // The events of the object come in order: if the write's echo arrived while the
            // cycle ran, what waits and is not the echo came after it (or too many came to tell,
            // and what waits is processed rather than lost).
            let echo_came = slot.versions.as_ref().map_or(Some(false), |v| v.arrived(version));
            if waiting.version() != Some(version) && echo_came != Some(false) {
                debug!("a change newer than the write's answer waits; the answer is not checked");
                return false;
            }
        }
        // What waits is this write's echo, come before the answer, or older.
        self.set_pending(slot, EventType::Modified, answer, true, false, Priority::Change);
        true
    }

    /// Removes a gone object's node-local state — after making sure it is gone: a watch with
    /// a server-side selector also says DELETED when a live object stops matching, and that
    /// object keeps its state (the hourly sweep removes what is left of objects really gone).
    async fn forget_locally(&self, uid: &str, body: &Value) {
        let Some(local) = self.ctx.storage.local.as_deref() else {
            return;
        };
        let meta = |k: &str| {
            body.pointer(&format!("/metadata/{k}"))
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        match self
            .ctx
            .objects
            .get(&self.ctx.resource, &meta("namespace"), &meta("name"))
            .await
        {
            Ok(live) if uid_of(&live).as_deref() == Some(uid) => {
                debug!(%uid, "the object still exists (it stopped matching the watch); its node-local state stays");
                return;
            }
            Ok(_) | Err(crate::k8s::objects::Error::NotFound) => {}
            Err(e) => {
                debug!(%uid, error = %crate::diagnostic::chain(&e), "cannot tell whether the object is gone; its node-local state stays for the sweep");
                return;
            }
        }
        if let Err(e) = local.remove(uid).await {
            warn!(error = %crate::diagnostic::chain(&e), "removing a gone object's node-local state failed");
        }
    }

    /// Re-runs a cycle for an object whose delay has passed (or whose daemons stopped), with
    /// its latest known body.
    pub fn wake(&self, uid: &str) {
        let body = {
            let mut slots = self.slots.lock();
            let Some(slot) = slots.get_mut(uid) else { return };
            slot.timer = None;
            if slot.gone {
                return;
            }
            if let Some(pending) = slot.pending.as_mut() {
                // Its cycle runs what is due; waiting as a confirmation, it moves up.
                pending.change = true;
                let queued = slot.promote(true);
                drop(slots);
                self.place(uid.to_owned(), queued);
                return;
            }
            if slot.relist.is_some() && !slot.running {
                // Its newer body is listed again; the cycle with it runs what is due.
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
            self.queue_body(EventType::Modified, body, Source::Memory(Priority::Change));
        }
    }
}

/// An object body kept between cycles, as LZ4-compressed compact JSON. Thousands are kept: a
/// parsed `Value` of a typical object takes several times the size of its text, and the text
/// repeats itself (the diff-base annotation copies the spec and metadata), so it compresses
/// to under half for a few microseconds per body. Its resourceVersion leads the same
/// allocation, so that a slot stays small (one pointer and length per body).
#[derive(Clone)]
struct Stored {
    /// The resourceVersion's length (2 bytes, little-endian; 0 for none or one too long to
    /// keep) and text, then the compressed body.
    packed: Box<[u8]>,
}

const LEN_BYTES: usize = std::mem::size_of::<u16>();

impl Stored {
    fn new(body: &Value) -> Self {
        let json = serde_json::to_vec(body).unwrap_or_default();
        let version = version_of(body).unwrap_or_default().as_bytes();
        let version = u16::try_from(version.len()).map_or(&[][..], |_| version);
        let len = u16::try_from(version.len()).unwrap_or(0);
        let mut packed = len.to_le_bytes().to_vec();
        packed.extend_from_slice(version);
        packed.extend_from_slice(&lz4_flex::compress_prepend_size(&json));
        Self {
            packed: packed.into_boxed_slice(),
        }
    }

    /// Where the compressed body starts.
    fn body_at(&self) -> usize {
        let len = self
            .packed
            .get(..LEN_BYTES)
            .and_then(|b| <[u8; LEN_BYTES]>::try_from(b).ok())
            .map_or(0, u16::from_le_bytes);
        LEN_BYTES + usize::from(len)
    }

    /// The body's resourceVersion.
    fn version(&self) -> Option<&str> {
        self.packed
            .get(LEN_BYTES..self.body_at())
            .and_then(|v| std::str::from_utf8(v).ok())
            .filter(|v| !v.is_empty())
    }

    fn value(&self) -> Value {
        self.packed
            .get(self.body_at()..)
            .and_then(|packed| lz4_flex::decompress_size_prepended(packed).ok())
            .and_then(|json| serde_json::from_slice(&json).ok())
            .unwrap_or(Value::Null)
    }
}

mod events;
pub mod ready;
pub mod relisting;
mod version;

#[cfg(test)]
mod tests;
