//! Indexes (kopf's `@kopf.index`): every object of an indexed resource goes through the index
//! handlers, and a handler process gets no other resource work until its indexes are built.
//!
//! # Where the index lives
//!
//! In the handler process. The SDK folds each object's index result into the index it keeps
//! (a dict result gives keys and values, anything else goes under the key `None`, a `None`
//! result changes nothing) and handlers read it there, with no round trip and no
//! per-invocation cost. The controller only *feeds* it: it calls the index handlers for every
//! object of the resource as listed, again on every change, and with `deleted` when the
//! object is deleted or stops matching the handler's filters, so that its entries go away.
//!
//! # Feeds
//!
//! One feed per indexed resource and connected handler process: its own list-then-watch of the
//! resource (independent of the resource's processing queue, so that a feed can start over
//! without disturbing change handlers, daemons or timers), one invocation at a time per
//! object and up to [`MAX_IN_FLIGHT`] objects at once. A handler process that connects again
//! lost its indexes: the new connection gets a new feed, which lists again.
//!
//! # The readiness gate
//!
//! The hub holds every resource invocation of a handler process that registered index
//! handlers (except the index handlers themselves and admission) until the process's indexes
//! are *built*: each feed's watches have listed, and every object of that initial listing went
//! through every index handler once — whatever the outcome, so that a failing index handler
//! never holds the gate forever, and whatever came after, so that a busy resource does not
//! either (kopf's rule; [`building`]). An index handler whose resource is not served yet holds
//! nothing. Activities (startup, login, probe, cleanup) are never held.
//!
//! A resource the feed cannot list (RBAC refuses it) would hold the process forever: the gate
//! opens then, with a warning, as soon as the listing is refused or after
//! [`building::LISTING_DEADLINE`]; the feed keeps trying. Each feed's watches are health checks
//! as the resource watches are: `index/<resource>/<connection>` (liveness: refused or wedged)
//! and `…/synced` (readiness: listed).
//!
//! # Failures
//!
//! As kopf: the SDK drops the object's entries when the handler fails (a temporary, permanent,
//! or unclassified error under the TEMPORARY or PERMANENT errors mode; under IGNORED, the
//! default for index handlers, an unclassified error keeps what the object had). Temporary
//! failures are retried by the controller's own timer with the registration's `retries`,
//! `backoff` and `timeout` (kopf's look-ahead included), with the object's latest body. Once a
//! handler failed for good (a permanent error, or its retries or timeout ran out) the object
//! stays out of that index until it is deleted, the handler process reconnects, or the
//! controller restarts — kopf keeps such objects out "forever" too. Failure state lives only in
//! memory, for the failing objects.
//!
//! # Pauses and replaced engines
//!
//! An engine is replaced when dispatch resumes after a pause (freezing, a change of
//! leadership); the handler process keeps its indexes meanwhile. The feeds of the old engine
//! leave behind which objects may hold entries ([`Carried`]); the new feeds list again and,
//! once listed, remove the objects that vanished in between.
//!
//! # Memory
//!
//! Per indexed object the controller keeps its uid and a bit mask of the index handlers that
//! hold entries for it (about 100 bytes); bodies only for objects whose retry is pending; until
//! the index is built, the uids of the listed objects still to go through.

mod building;

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::Arc,
    time::{Duration, SystemTime},
};

use parking_lot::Mutex;
use serde_json::Value;
use tokio::{sync::mpsc, task::JoinSet, time::MissedTickBehavior};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use super::{
    execution::{self, Verdict},
    matching::{self, Subject},
    namespaces::Namespaces,
    processing,
    registry::ResourceKey,
};
use crate::{
    grpc::{Control, Hub, hub::ConnectionId},
    k8s::{objects::Objects, watch as k8s_watch},
    model::{EventType, HandlerId, Outcome, Payload, Registration, ResolvedResource, Work},
    observability::health::{Check, Health},
    persistence::ProgressRecord,
};

/// At most this many objects of one feed are being indexed at once.
pub const MAX_IN_FLIGHT: usize = 64;

/// How often a feed whose watches have not listed yet looks at them.
const BUILT_POLL: Duration = Duration::from_millis(50);

/// The progress purpose of index handlers' in-memory records.
const PURPOSE: &str = "index";

/// One feed: an indexed resource and the connection whose index handlers it feeds.
type FeedKey = (ResourceKey, ConnectionId);

/// What the feeds share with the indexer: which feeds exist and which are built.
struct Shared {
    hub: Hub,
    feeds: Mutex<HashMap<FeedKey, FeedState>>,
}

struct FeedState {
    id: u64,
    handlers: Vec<HandlerId>,
    built: bool,
}

impl Shared {
    /// Whether every feed of `conn` that serves `handler` is built.
    fn all_built(feeds: &HashMap<FeedKey, FeedState>, handler: &HandlerId, conn: ConnectionId) -> bool {
        feeds
            .iter()
            .filter(|((_, c), f)| *c == conn && f.handlers.contains(handler))
            .all(|(_, f)| f.built)
    }

    /// Records that the feed `id` at `key` is built, and tells the hub about every index
    /// handler of its connection that is now built everywhere.
    fn built(&self, key: &FeedKey, id: u64) {
        let feeds = {
            let mut feeds = self.feeds.lock();
            let Some(feed) = feeds.get_mut(key).filter(|f| f.id == id) else {
                return;
            };
            feed.built = true;
            let handlers = feed.handlers.clone();
            handlers
                .into_iter()
                .filter(|h| Self::all_built(&feeds, h, key.1))
                .collect::<Vec<_>>()
        };
        for handler in feeds {
            self.hub.index_built(key.1, &handler);
        }
    }
}

/// What the feeds of a stopped engine leave to their successors: per feed, the uids of the
/// objects that may hold entries in the handler process, with the mask of their handlers.
/// Kept across engines by whoever replaces them; dropped for connections that are gone.
#[derive(Clone, Default)]
pub struct Carried(Arc<Mutex<HashMap<FeedKey, Masks>>>);

/// The handler masks of objects, by uid.
type Masks = HashMap<Box<str>, u64>;

impl Carried {
    fn take(&self, key: &FeedKey) -> Masks {
        self.0.lock().remove(key).unwrap_or_default()
    }

    fn put(&self, key: FeedKey, objects: Masks) {
        if !objects.is_empty() {
            self.0.lock().insert(key, objects);
        }
    }

    fn retain_connections(&self, open: &HashSet<ConnectionId>) {
        self.0.lock().retain(|(_, conn), _| open.contains(conn));
    }
}

/// A running feed, owned by the indexer.
struct Feed {
    handlers: Vec<Registration>,
    cancel: CancellationToken,
    /// The health checks of its watches.
    checks: Checks,
}

/// Feeds the index handlers of connected handler processes (see the module docs).
pub struct Indexer {
    shared: Arc<Shared>,
    objects: Objects,
    watch: k8s_watch::Settings,
    namespaces: Namespaces,
    health: Health,
    feeds: HashMap<FeedKey, Feed>,
    next_id: u64,
    carried: Carried,
}

impl Indexer {
    /// An indexer with no feeds, taking over what the feeds of earlier engines left; its
    /// feeds' watches report to `health`.
    pub fn new(
        hub: Hub,
        objects: Objects,
        watch: k8s_watch::Settings,
        namespaces: Namespaces,
        health: Health,
        carried: Carried,
    ) -> Self {
        Self {
            carried,
            health,
            shared: Arc::new(Shared {
                hub,
                feeds: Mutex::new(HashMap::new()),
            }),
            objects,
            watch,
            namespaces,
            feeds: HashMap::new(),
            next_id: 1,
        }
    }

    /// Brings the feeds in line with the index handlers of the known registrations (`known`,
    /// and the resolved ones by resource in `groups`: one snapshot) and the connections that
    /// own them now. `watching` is false while operator activities hold all watching: no feed
    /// starts then. Feeds of handlers whose connection changed (a reconnect) start over.
    ///
    /// A connection that opened after the snapshot was taken has index handlers the snapshot
    /// does not know: its gate stays shut until a sync with a snapshot that knows them.
    pub fn sync(
        &mut self,
        known: &[Registration],
        groups: &BTreeMap<ResourceKey, Arc<Vec<Registration>>>,
        watching: bool,
        cancel: &CancellationToken,
        tasks: &mut JoinSet<()>,
    ) {
        let owners: HashMap<HandlerId, ConnectionId> = self.shared.hub.index_owners().into_iter().collect();
        // A process that is gone took its indexes along: nothing to clean up for it.
        self.carried
            .retain_connections(&owners.values().copied().collect());
        let mut desired: HashMap<FeedKey, Vec<Registration>> = HashMap::new();
        for (key, handlers) in groups {
            for reg in handlers
                .iter()
                .filter(|h| h.kind == crate::model::HandlerKind::Index)
            {
                if let Some(conn) = owners.get(&reg.id) {
                    desired.entry((key.clone(), *conn)).or_default().push(reg.clone());
                }
            }
        }
        let stale: Vec<FeedKey> = self
            .feeds
            .iter()
            .filter(|(k, f)| desired.get(*k) != Some(&f.handlers) || !watching)
            .map(|(k, _)| k.clone())
            .collect();
        for key in stale {
            if let Some(feed) = self.feeds.remove(&key) {
                debug!(resource = %key.0.plural, connection = key.1, "index feed stopped");
                feed.cancel.cancel();
                feed.checks.remove();
            }
            self.shared.feeds.lock().remove(&key);
        }
        if watching {
            for (key, handlers) in desired {
                if self.feeds.contains_key(&key) {
                    continue;
                }
                let Some(resource) = handlers.first().and_then(|h| h.resource.clone()) else {
                    continue;
                };
                let id = self.next_id;
                self.next_id += 1;
                self.shared.feeds.lock().insert(
                    key.clone(),
                    FeedState {
                        id,
                        handlers: handlers.iter().map(|h| h.id.clone()).collect(),
                        built: false,
                    },
                );
                let feed_cancel = cancel.child_token();
                let scopes: Vec<Option<String>> = match self.namespaces.exact() {
                    Some(names) if resource.namespaced => names.into_iter().map(Some).collect(),
                    _ => vec![None],
                };
                let mut checks = Checks {
                    health: self.health.clone(),
                    names: Vec::new(),
                };
                let watches: Vec<(Option<String>, k8s_watch::Status)> = scopes
                    .into_iter()
                    .map(|scope| {
                        let status = k8s_watch::Status::default();
                        checks.register(&resource, key.1, scope.as_deref(), &status);
                        (scope, status)
                    })
                    .collect();
                let run = FeedTask {
                    watches,
                    shared: self.shared.clone(),
                    key: key.clone(),
                    id,
                    resource: resource.clone(),
                    handlers: handlers.clone(),
                    objects: self.objects.clone(),
                    watch: self.watch.clone(),
                    namespaces: self.namespaces.clone(),
                    cancel: feed_cancel.clone(),
                    carried: self.carried.clone(),
                };
                info!(%resource, connection = key.1, indexes = handlers.len(), "building indexes");
                tasks.spawn(
                    run.run()
                        .instrument(info_span!("index", resource = %resource, connection = key.1)),
                );
                self.feeds.insert(
                    key,
                    Feed {
                        handlers,
                        cancel: feed_cancel,
                        checks,
                    },
                );
            }
        }
        // Index handlers with no feed to wait for (their resource is not served yet): built.
        // Only those of the snapshot: the others have no feed yet because the snapshot does
        // not know them, not because they need none.
        if watching {
            let snapshot: HashSet<&HandlerId> = known
                .iter()
                .filter(|r| r.kind == crate::model::HandlerKind::Index)
                .map(|r| &r.id)
                .collect();
            let feeds = self.shared.feeds.lock();
            let ready: Vec<(HandlerId, ConnectionId)> = owners
                .into_iter()
                .filter(|(h, c)| snapshot.contains(h) && Shared::all_built(&feeds, h, *c))
                .collect();
            drop(feeds);
            for (handler, conn) in ready {
                self.shared.hub.index_built(conn, &handler);
            }
        }
    }

    /// Stops every feed.
    pub fn stop(&mut self) {
        for (_, feed) in self.feeds.drain() {
            feed.cancel.cancel();
            feed.checks.remove();
        }
        self.shared.feeds.lock().clear();
    }
}

/// One feed's task.
struct FeedTask {
    /// Its watches: the namespace (or all) and the status each reports.
    watches: Vec<(Option<String>, k8s_watch::Status)>,
    shared: Arc<Shared>,
    key: FeedKey,
    id: u64,
    resource: ResolvedResource,
    handlers: Vec<Registration>,
    objects: Objects,
    watch: k8s_watch::Settings,
    namespaces: Namespaces,
    cancel: CancellationToken,
    carried: Carried,
}

/// What a feed remembers about one object.
#[derive(Default)]
struct Tracked {
    /// Index handlers (by position; beyond 64 always assumed) that may hold entries for it.
    mask: u64,
    /// An invocation for it is running.
    busy: bool,
    /// Rarely needed state, boxed to keep the common entry small.
    extra: Option<Box<Extra>>,
}

#[derive(Default)]
struct Extra {
    /// The latest event that came while the object was busy.
    next: Option<(EventType, Value)>,
    /// Failing handlers, by position.
    failing: BTreeMap<usize, Failing>,
}

struct Failing {
    record: ProgressRecord,
    /// Retried at the record's delay with this body; `None` after a final failure (the object
    /// stays out of that index).
    body: Option<Value>,
}

impl Tracked {
    fn holds(&self, i: usize) -> bool {
        i >= 64 || self.mask & (1 << i) != 0
    }

    fn set(&mut self, i: usize, on: bool) {
        if i < 64 {
            if on {
                self.mask |= 1 << i;
            } else {
                self.mask &= !(1 << i);
            }
        }
    }

    fn idle(&self) -> bool {
        self.mask == 0
            && !self.busy
            && self
                .extra
                .as_ref()
                .is_none_or(|e| e.next.is_none() && e.failing.is_empty())
    }
}

/// A feed's working state.
#[derive(Default)]
struct State {
    tracked: HashMap<Box<str>, Tracked>,
    running: JoinSet<Done>,
    /// Objects with a retry pending (a subset of `tracked`).
    waiting: HashSet<Box<str>>,
    /// Objects an earlier feed left as possibly holding entries and not listed (yet).
    previous: Masks,
    /// Those of `previous` that the listing did not return: removed as room allows.
    vanished: Vec<(Box<str>, u64)>,
}

/// One invocation to make for an object.
struct Call {
    handler: usize,
    deleted: bool,
    record: ProgressRecord,
}

/// The outcomes of one object's invocations.
struct Done {
    uid: String,
    body: Value,
    results: Vec<(Call, Outcome)>,
}

impl FeedTask {
    async fn run(self) {
        let (label_selector, field_selector) = super::common_selectors(&self.handlers);
        let (tx, mut rx) = mpsc::channel::<k8s_watch::Event>(1024);
        let mut watches = JoinSet::new();
        let mut statuses = Vec::new();
        for (scope, status) in &self.watches {
            statuses.push(status.clone());
            let api = self.objects.api(&self.resource, scope.as_deref());
            let w = k8s_watch::Watch::new(
                api,
                label_selector.clone(),
                field_selector.clone(),
                self.watch.clone(),
                status.clone(),
            );
            watches.spawn(w.run(tx.clone(), self.cancel.clone()));
        }
        drop(tx);
        let mut state = State {
            previous: self.carried.take(&self.key),
            ..State::default()
        };
        let mut building = building::Building::new(tokio::time::Instant::now() + building::LISTING_DEADLINE);
        // One interval for the feed's life: other events never postpone its ticks.
        let mut poll = tokio::time::interval(BUILT_POLL);
        poll.set_missed_tick_behavior(MissedTickBehavior::Delay);
        let mut swept = false;
        let mut next_retry: Option<SystemTime> = None;
        loop {
            let retry_in = next_retry.map(|t| t.duration_since(SystemTime::now()).unwrap_or_default());
            let room = state.running.len() < MAX_IN_FLIGHT;
            tokio::select! {
                () = self.cancel.cancelled() => break,
                event = rx.recv(), if room => match event {
                    Some(e) => {
                        let uid = e.body.pointer("/metadata/uid").and_then(Value::as_str).map(str::to_owned);
                        if let Some(uid) = &uid {
                            building.received(e.event_type == EventType::Listing || e.in_listing, uid);
                        }
                        let ns = e.body.pointer("/metadata/namespace").and_then(Value::as_str).unwrap_or_default();
                        if self.namespaces.serves(ns) {
                            self.observe(&mut state, e.event_type, e.body);
                        }
                        // Nothing to run for it (no handler matched, or nothing to remove).
                        if let Some(uid) = &uid
                            && !state.tracked.get(uid.as_str()).is_some_and(|t| t.busy)
                        {
                            building.indexed(uid);
                        }
                    }
                    None => break,
                },
                Some(done) = state.running.join_next() => {
                    if let Ok(done) = done {
                        building.indexed(&done.uid);
                        self.finish(&mut state, done);
                    }
                    next_retry = next_due(&state);
                }
                () = sleep_opt(retry_in), if room => {
                    self.retry_due(&mut state);
                    next_retry = next_due(&state);
                }
                _ = poll.tick(), if building.polling() => {
                    let listed = statuses.iter().all(k8s_watch::Status::is_synced);
                    let refused = statuses.iter().find_map(k8s_watch::Status::listing_refused);
                    match building.poll(listed, refused, rx.len(), tokio::time::Instant::now()) {
                        Some(building::Unlisted::Refused(problem)) => {
                            warn!(%problem, "the API server refuses to list the indexed resource; the handler process's \
                                other handlers run without this index (it fills once the listing succeeds)");
                            self.shared.built(&self.key, self.id);
                        }
                        Some(building::Unlisted::Late) => {
                            warn!(deadline = ?building::LISTING_DEADLINE, "the indexed resource was not listed in time; \
                                the handler process's other handlers run without this index (it fills once the listing succeeds)");
                            self.shared.built(&self.key, self.id);
                        }
                        None => {}
                    }
                }
            }
            if building.listed() && !swept {
                swept = true;
                state.vanished = state.previous.drain().collect();
                if !state.vanished.is_empty() {
                    info!(
                        objects = state.vanished.len(),
                        "objects that vanished while the indexes were not fed are removed"
                    );
                }
            }
            self.sweep(&mut state);
            if building.built() {
                info!(
                    objects = state.tracked.len(),
                    "indexes built from the initial listing"
                );
                self.shared.built(&self.key, self.id);
            }
        }
        state.running.abort_all();
        watches.abort_all();
        let mut left: Masks = std::mem::take(&mut state.previous);
        left.extend(std::mem::take(&mut state.vanished));
        left.extend(
            state
                .tracked
                .into_iter()
                .filter(|(_, t)| t.mask != 0)
                .map(|(uid, t)| (uid, t.mask)),
        );
        self.carried.put(self.key.clone(), left);
    }

    /// After the listing: the objects an earlier feed left that were not listed are gone;
    /// their entries are removed, as many at once as the feed's bound leaves room for.
    fn sweep(&self, state: &mut State) {
        while state.running.len() < MAX_IN_FLIGHT {
            let Some((uid, mask)) = state.vanished.pop() else {
                return;
            };
            let body = serde_json::json!({"metadata": {"uid": &*uid}});
            let entry = state.tracked.entry(uid.clone()).or_default();
            entry.mask |= mask;
            if entry.busy {
                entry.extra.get_or_insert_with(Box::default).next = Some((EventType::Deleted, body));
                continue;
            }
            self.start(
                entry,
                &mut state.running,
                uid.to_string(),
                EventType::Deleted,
                body,
            );
            state.settle(&uid);
        }
    }

    /// An event for one object: runs its index handlers, or queues it behind the running ones.
    fn observe(&self, state: &mut State, event_type: EventType, body: Value) {
        let Some(uid) = body
            .pointer("/metadata/uid")
            .and_then(Value::as_str)
            .map(str::to_owned)
        else {
            warn!("an object without a uid was not indexed");
            return;
        };
        if event_type == EventType::Deleted {
            // Also for resources that have only index handlers (no queue says it then).
            self.shared
                .hub
                .object_gone(&processing::object_ref(&self.resource, &body));
        }
        let carried = state.previous.remove(uid.as_str());
        let entry = state.tracked.entry(uid.clone().into_boxed_str()).or_default();
        if let Some(mask) = carried {
            entry.mask |= mask;
        }
        if entry.busy {
            // Only the latest state matters for an index: a newer event supersedes a queued one.
            entry.extra.get_or_insert_with(Box::default).next = Some((event_type, body));
            return;
        }
        self.start(entry, &mut state.running, uid.clone(), event_type, body);
        state.settle(&uid);
    }

    /// Starts the invocations one event needs for an idle object.
    fn start(
        &self,
        entry: &mut Tracked,
        running: &mut JoinSet<Done>,
        uid: String,
        event_type: EventType,
        body: Value,
    ) {
        let deleted = event_type == EventType::Deleted;
        let now = SystemTime::now();
        let mut calls = Vec::new();
        for (i, reg) in self.handlers.iter().enumerate() {
            if let Some(extra) = entry.extra.as_mut()
                && let Some(failing) = extra.failing.get_mut(&i)
            {
                if deleted {
                    // Gone: its failures go with it, and whatever the SDK may still hold.
                    extra.failing.remove(&i);
                } else {
                    if failing.body.is_some() {
                        // Waiting for its retry, which takes the newest body; a handler that
                        // failed for good keeps the object out.
                        failing.body = Some(body.clone());
                    }
                    continue;
                }
            }
            let matches = !deleted
                && matching::prematch(
                    reg,
                    Subject {
                        body: &body,
                        old: None,
                        new: None,
                    },
                );
            if matches {
                // From now on the SDK may hold entries for it (until a `deleted` is answered):
                // failures drop them there, but an extra `deleted` costs little and a missing
                // one would leave stale entries behind.
                entry.set(i, true);
                calls.push(Call {
                    handler: i,
                    deleted: false,
                    record: ProgressRecord::started(now, PURPOSE),
                });
            } else if entry.holds(i) {
                calls.push(Call {
                    handler: i,
                    deleted: true,
                    record: ProgressRecord::started(now, PURPOSE),
                });
            }
        }
        if calls.is_empty() {
            return;
        }
        entry.busy = true;
        self.spawn(running, uid, body, calls);
    }

    fn spawn(&self, running: &mut JoinSet<Done>, uid: String, body: Value, calls: Vec<Call>) {
        let object = processing::object_ref(&self.resource, &body);
        let works: Vec<(Call, Work)> = calls
            .into_iter()
            .filter_map(|call| {
                let reg = self.handlers.get(call.handler)?;
                let mut work = Work::new(
                    reg.id.0.clone(),
                    format!("{}/{}/index/{}", object.uid, reg.id, object.resource_version),
                    Payload::Index {
                        deleted: call.deleted,
                    },
                );
                work.attempt = call.record.retries + 1;
                work.started = call.record.started_at().unwrap_or_else(SystemTime::now);
                work.object = Some(object.clone());
                work.body = Some(body.clone());
                work.param = reg.param.clone();
                work.attempt_timeout = reg.timeout;
                work.last_error = execution::last_error(&call.record);
                Some((call, work))
            })
            .collect();
        let hub = self.shared.hub.clone();
        let cancel = self.cancel.clone();
        running.spawn(async move {
            let calls = works.into_iter().map(|(call, work)| {
                let hub = hub.clone();
                let control = Control::cancelled_by(cancel.child_token());
                async move {
                    let outcome = hub.dispatch(work, control).await;
                    (call, outcome)
                }
            });
            let results = futures::future::join_all(calls).await;
            Done { uid, body, results }
        });
    }

    /// Applies one object's outcomes, then runs the event that waited behind them.
    fn finish(&self, state: &mut State, done: Done) {
        let Some(entry) = state.tracked.get_mut(done.uid.as_str()) else {
            return;
        };
        entry.busy = false;
        let now = SystemTime::now();
        for (mut call, outcome) in done.results {
            let Some(reg) = self.handlers.get(call.handler) else {
                continue;
            };
            if call.deleted {
                if !matches!(outcome, Outcome::Cancelled | Outcome::Abandoned) {
                    entry.set(call.handler, false);
                }
                continue;
            }
            match execution::judge(reg, &mut call.record, outcome, now) {
                Verdict::Success { .. } => {
                    if let Some(extra) = entry.extra.as_mut() {
                        extra.failing.remove(&call.handler);
                    }
                }
                Verdict::Retry => {
                    debug!(handler.id = %reg.id, object.uid = %done.uid, error = call.record.message.as_deref().unwrap_or_default(), "index handler will be retried");
                    entry.extra.get_or_insert_with(Box::default).failing.insert(
                        call.handler,
                        Failing {
                            record: call.record,
                            body: Some(done.body.clone()),
                        },
                    );
                }
                Verdict::Failure => {
                    warn!(handler.id = %reg.id, object.uid = %done.uid, error = call.record.message.as_deref().unwrap_or_default(), "index handler failed for good; the object stays out of this index until it is deleted or the handler process reconnects");
                    entry.extra.get_or_insert_with(Box::default).failing.insert(
                        call.handler,
                        Failing {
                            record: call.record,
                            body: None,
                        },
                    );
                }
                Verdict::Unrecorded => {}
            }
        }
        let next = entry.extra.as_mut().and_then(|e| e.next.take());
        if let Some((event_type, body)) = next {
            self.start(entry, &mut state.running, done.uid.clone(), event_type, body);
        }
        state.settle(&done.uid);
    }

    /// Retries the failing handlers whose delay has passed, with the object's latest body.
    fn retry_due(&self, state: &mut State) {
        let now = SystemTime::now();
        let waiting: Vec<Box<str>> = state.waiting.iter().cloned().collect();
        for uid in waiting {
            if state.running.len() >= MAX_IN_FLIGHT {
                // The rest waits for room: the next pass finds them due.
                return;
            }
            let Some(entry) = state.tracked.get_mut(&uid) else {
                state.waiting.remove(&uid);
                continue;
            };
            if entry.busy {
                continue;
            }
            let Some(extra) = entry.extra.as_mut() else {
                continue;
            };
            let due: Vec<usize> = extra
                .failing
                .iter()
                .filter(|(_, f)| f.body.is_some() && f.record.delayed_until().is_none_or(|t| t <= now))
                .map(|(i, _)| *i)
                .collect();
            let mut body = None;
            let mut calls = Vec::new();
            for i in due {
                let Some(failing) = extra.failing.remove(&i) else {
                    continue;
                };
                body = failing.body.or(body);
                let mut record = failing.record;
                record.delayed = None;
                if let Some(reg) = self.handlers.get(i)
                    && let Some(message) = execution::exhausted(reg, &record, now)
                {
                    warn!(handler.id = %reg.id, object.uid = %uid, %message, "index handler gives up");
                    extra.failing.insert(i, Failing { record, body: None });
                    continue;
                }
                calls.push(Call {
                    handler: i,
                    deleted: false,
                    record,
                });
            }
            if let Some(body) = body
                && !calls.is_empty()
            {
                entry.busy = true;
                self.spawn(&mut state.running, uid.to_string(), body, calls);
            }
            state.settle(&uid);
        }
    }
}

/// A feed's health checks, removed when the feed stops.
struct Checks {
    health: Health,
    names: Vec<String>,
}

impl Checks {
    /// Registers the checks of one of the feed's watches, as the resource watches do:
    /// liveness fails while the API server refuses it or its loop is wedged, readiness until it
    /// has listed.
    fn register(
        &mut self,
        resource: &ResolvedResource,
        conn: ConnectionId,
        scope: Option<&str>,
        status: &k8s_watch::Status,
    ) {
        let name = match scope {
            Some(ns) => format!("index/{resource}/{conn}/{ns}"),
            None => format!("index/{resource}/{conn}"),
        };
        let live = status.clone();
        self.health.liveness(&name, move || match live.problem() {
            Some(problem) => Check::fail(problem),
            None => Check::pass("watching"),
        });
        let listed = status.clone();
        let synced = format!("{name}/synced");
        self.health.readiness(&synced, move || {
            if listed.is_synced() {
                Check::pass("listed")
            } else {
                Check::fail("initial listing not finished")
            }
        });
        self.names.push(name);
        self.names.push(synced);
    }
}

impl Checks {
    fn remove(&self) {
        for name in &self.names {
            self.health.remove(name);
        }
    }
}

impl State {
    /// Forgets an object that holds nothing and waits for nothing; keeps `waiting` exact.
    fn settle(&mut self, uid: &str) {
        let Some(entry) = self.tracked.get(uid) else {
            self.waiting.remove(uid);
            return;
        };
        let retrying = entry
            .extra
            .as_ref()
            .is_some_and(|e| e.failing.values().any(|f| f.body.is_some()));
        if retrying {
            self.waiting.insert(uid.into());
        } else {
            self.waiting.remove(uid);
        }
        if entry.idle() {
            self.tracked.remove(uid);
        }
    }
}

/// When the earliest pending retry is due.
fn next_due(state: &State) -> Option<SystemTime> {
    state
        .waiting
        .iter()
        .filter_map(|uid| state.tracked.get(uid))
        .filter(|t| !t.busy)
        .filter_map(|t| t.extra.as_ref())
        .flat_map(|e| e.failing.values())
        .filter(|f| f.body.is_some())
        .map(|f| f.record.delayed_until().unwrap_or_else(SystemTime::now))
        .min()
}

/// Sleeps for `d`, or forever without one.
async fn sleep_opt(d: Option<Duration>) {
    match d {
        Some(d) => tokio::time::sleep(d).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests;
