//! The reactor: turns watch events into handler invocations and object writes, with kopf's
//! semantics.
//!
//! The engine follows the registrations of connected handler processes (`registry`), watches
//! every resource that has handlers (`k8s::watch`), feeds each object's events into its own
//! serial queue (`queue`), and runs processing cycles (`processing`) that decide the cause
//! (`causes`), pick handlers (`matching`), judge outcomes (`execution`) and fold everything
//! into one write per handled change.
//!
//! Operator activities gate it (`activities`): no resource watch starts while a registered
//! login or startup handler has not succeeded. Resources may appear and disappear while it
//! runs: a registration whose resource is not served yet is pending, and every change of the
//! cluster's CRDs re-runs discovery (debounced, with two follow-ups because discovery lags
//! behind a CRD's `Established` condition), starting and stopping watches accordingly.

pub mod activities;
pub mod causes;
pub mod conditions;
pub mod daemons;
pub mod diff;
pub mod essence;
pub mod execution;
pub mod indexing;
pub mod matching;
pub mod namespaces;
pub mod nodes;
pub mod posting;
pub mod processing;
pub mod queue;
pub mod registry;
pub mod writing;

use std::{collections::BTreeMap, sync::Arc};

use tokio::{
    sync::{Semaphore, mpsc, watch},
    task::JoinSet,
};
use tokio_util::{sync::CancellationToken, task::TaskTracker};
use tracing::{Instrument, debug, info, info_span, warn};

use crate::{
    grpc::{Hub, hub::sleep_until_opt},
    k8s::{crds, discovery::Discovery, objects::Objects, watch as k8s_watch},
    model::{HandlerKind, Registration, ResolvedResource},
    observability::health::{Check, Health},
};
use processing::{Invoker, Storage};
use queue::Queue;
use registry::{Registry, ResourceKey};

/// The handler kinds the engine runs.
pub const SUPPORTED_KINDS: [HandlerKind; 13] = [
    HandlerKind::Create,
    HandlerKind::Update,
    HandlerKind::Delete,
    HandlerKind::Resume,
    HandlerKind::Field,
    HandlerKind::Event,
    HandlerKind::Index,
    HandlerKind::Daemon,
    HandlerKind::Timer,
    HandlerKind::Startup,
    HandlerKind::Cleanup,
    HandlerKind::Probe,
    HandlerKind::Login,
];

/// How long CRD changes are collected before discovery runs again.
const RESCAN_DEBOUNCE: std::time::Duration = std::time::Duration::from_millis(300);
/// Discovery lags behind CRD conditions: rescans are repeated this long after a change.
const RESCAN_FOLLOW_UP: std::time::Duration = std::time::Duration::from_secs(2);

/// How the engine works.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Where and under which names state is stored.
    pub storage: Storage,
    /// Namespaces to serve (kopf's patterns); empty means cluster-wide.
    pub namespaces: namespaces::Namespaces,
    /// At most this many objects processed at once. Default 128.
    pub worker_limit: usize,
    /// Watch tunables.
    pub watch: k8s_watch::Settings,
    /// A handler still running this long after others of its cycle finished makes the engine
    /// write their progress first. Default 1 s.
    pub checkpoint_after: std::time::Duration,
    /// Kubernetes Events about handler outcomes and handler log records.
    pub events: posting::Settings,
    /// Per-node mode (DaemonSet), when set.
    pub node: Option<nodes::Settings>,
    /// Operator activities (probe timeout and cache).
    pub activities: activities::Settings,
    /// Watch CRDs so that resources appearing or disappearing at run time are picked up.
    pub watch_crds: bool,
    /// The operator-wide settings of handler processes this engine was configured with, when
    /// it follows them: while the hub's differ, it starts no watch (it is about to be replaced
    /// by one configured with them).
    pub operator: Option<crate::model::operator_settings::OperatorSettings>,
    /// With sharding: the ranges of objects this member handles now (see `sharding::shard`);
    /// objects outside them are dropped as they arrive.
    pub shard: Option<crate::sharding::Shard>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            storage: Storage::annotations("capstan.dev"),
            namespaces: namespaces::Namespaces::default(),
            worker_limit: 128,
            watch: k8s_watch::Settings::default(),
            checkpoint_after: std::time::Duration::from_secs(1),
            events: posting::Settings::default(),
            node: None,
            activities: activities::Settings::default(),
            watch_crds: true,
            operator: None,
            shard: None,
        }
    }
}

impl Settings {
    /// These settings with what the operator-wide settings decide taken from `configured`
    /// (the flags' settings with the processes' values applied): the storage's names and
    /// kinds, the watch timeouts, the worker limit. What was set up at the start (the
    /// node-local store, namespaces) stays.
    pub fn reconfigured(&self, configured: &Self) -> Self {
        let mut out = self.clone();
        out.storage.keys.clone_from(&configured.storage.keys);
        out.storage.progress.clone_from(&configured.storage.progress);
        out.storage.diffbase.clone_from(&configured.storage.diffbase);
        out.storage.diffbase_extent = configured.storage.diffbase_extent;
        out.watch.inactivity_timeout = configured.watch.inactivity_timeout;
        out.watch.server_timeout = configured.watch.server_timeout;
        out.worker_limit = configured.worker_limit;
        out
    }
}

/// The engine.
pub struct Engine {
    hub: Hub,
    invoker: Arc<dyn Invoker>,
    objects: Objects,
    settings: Settings,
    health: Health,
    activities: Option<activities::Activities>,
    discovery: Option<(Arc<Discovery>, watch::Receiver<crds::Snapshot>)>,
    /// Every watched resource's queue, for cleanups across objects (departed nodes).
    queues: nodes::Queues,
    /// The workers of stopped queues that may still run: a new watch of the same resource
    /// waits for them before it processes anything.
    retired: parking_lot::Mutex<Vec<(ResolvedResource, TaskTracker)>>,
    /// What the index feeds of the engine this one replaces left behind.
    carried: indexing::Carried,
    /// The daemons that are done, kept for the controller's lifetime.
    finished_daemons: daemons::Finished,
}

/// Watch events (parsed bodies) between a watch and its queue at most: a listing that runs
/// ahead of the queue waits for room, so that no more than this many parsed bodies are held
/// between the two (the queue keeps each object's body compressed).
const WATCH_BACKLOG: usize = 64;

/// How long a new watch of a resource waits for the workers of its stopped predecessor (their
/// invocations get `Cancel` and a grace period; their writes have the request timeout).
const RETIRED_WORKERS_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// One watched resource.
struct Watched {
    handlers: watch::Sender<Arc<Vec<Registration>>>,
    /// The selectors the watch applies on the server (see [`common_selectors`]).
    selectors: (Option<String>, Option<String>),
    cancel: CancellationToken,
    queue: Queue,
    checks: Vec<String>,
}

impl Engine {
    /// An engine dispatching through `hub`.
    pub fn new(hub: Hub, objects: Objects, settings: Settings, health: Health) -> Self {
        let invoker: Arc<dyn Invoker> = Arc::new(hub.clone());
        Self {
            hub,
            invoker,
            objects,
            queues: nodes::Queues::default(),
            retired: parking_lot::Mutex::new(Vec::new()),
            settings,
            health,
            activities: None,
            discovery: None,
            carried: indexing::Carried::default(),
            finished_daemons: daemons::Finished::default(),
        }
    }

    /// Shares the set of done daemons with the engines before and after this one, so that a
    /// daemon that is done stays done until the controller restarts.
    #[must_use]
    pub fn with_finished_daemons(mut self, finished: daemons::Finished) -> Self {
        self.finished_daemons = finished;
        self
    }

    /// Takes over what the index feeds of a replaced engine left behind (and leaves its own
    /// there), so that objects that vanished in between leave the handler processes' indexes.
    #[must_use]
    pub fn with_index_memory(mut self, carried: indexing::Carried) -> Self {
        self.carried = carried;
        self
    }

    /// Gates watching on the operator's login and startup handlers.
    #[must_use]
    pub fn with_activities(mut self, activities: activities::Activities) -> Self {
        self.activities = Some(activities);
        self
    }

    /// Resolves pending registrations, and re-resolves all, whenever CRDs change.
    #[must_use]
    pub fn with_discovery(
        mut self,
        discovery: Arc<Discovery>,
        crds: watch::Receiver<crds::Snapshot>,
    ) -> Self {
        self.discovery = Some((discovery, crds));
        self
    }

    /// Re-runs discovery for every known selector.
    async fn rescan(&self, registry: &mut Registry) {
        let Some((discovery, _)) = &self.discovery else {
            return;
        };
        let scan = match discovery.rescan().await {
            Ok(scan) => scan,
            Err(e) => {
                warn!(error = %crate::diagnostic::chain(&e), "discovery failed; resources stay as they were");
                return;
            }
        };
        for selector in registry.selectors() {
            let found = match scan.resolve(&selector) {
                Ok(resource) => Some(resource),
                Err(crate::k8s::discovery::Error::NotFound(_)) => None,
                Err(e) => {
                    debug!(%selector, error = %e, "selector still does not resolve cleanly");
                    continue;
                }
            };
            let what = found.as_ref().map(ToString::to_string);
            if registry.set_resolved(&selector, found) {
                match what {
                    Some(resource) => info!(%selector, %resource, "resource is served now"),
                    None => info!(%selector, "resource is not served any more; waiting for it to appear"),
                }
            }
        }
    }

    /// Runs until `cancel` fires.
    pub async fn run(self, cancel: CancellationToken) {
        let mut registrations = self.hub.registrations();
        let mut registry = Registry::default();
        let limit = Arc::new(Semaphore::new(self.settings.worker_limit.max(1)));
        crate::observability::metrics::global().worker_limit(self.settings.worker_limit.max(1));
        let instance = std::env::var("POD_NAME")
            .or_else(|_| std::env::var("HOSTNAME"))
            .unwrap_or_else(|_| format!("capstan-{}", std::process::id()));
        let poster = posting::Poster::spawn(
            crate::k8s::events::Events::new(self.objects.client().clone(), instance),
            self.settings.events.clone(),
            self.hub.postings(),
            cancel.clone(),
        );
        let mut watched: BTreeMap<ResourceKey, Watched> = BTreeMap::new();
        let mut tasks = JoinSet::new();
        if self.settings.shard.is_some() {
            let queues = Arc::downgrade(&self.queues);
            crate::observability::metrics::global().sample_sharding_objects(move || {
                queues.upgrade().map_or(0, |queues| {
                    let known: usize = queues.lock().iter().map(|(_, _, q)| q.len()).sum();
                    i64::try_from(known).unwrap_or(i64::MAX)
                })
            });
        }
        if let Some(node) = self.settings.node.clone().filter(|n| n.cleanup) {
            tasks.spawn(nodes::run(
                node,
                self.objects.clone(),
                self.queues.clone(),
                cancel.clone(),
            ));
        }
        if let Some(store) = self.settings.storage.local.clone() {
            tasks.spawn(nodes::collect_garbage(
                store,
                self.objects.clone(),
                self.queues.clone(),
                cancel.clone(),
            ));
        }
        let (_never_tx, never) = watch::channel(0u64);
        let mut activity_changes = self
            .activities
            .as_ref()
            .map_or_else(|| never.clone(), activities::Activities::changes);
        let (_no_crds_tx, no_crds) = watch::channel(crds::Snapshot::default());
        let mut crd_changes = self.discovery.as_ref().map_or(no_crds, |(_, rx)| rx.clone());
        let mut rescan_at: Option<tokio::time::Instant> = None;
        let mut follow_ups = 0u32;
        let mut last_pending = Vec::new();
        let mut last_gate: Option<String> = None;
        let mut operator_changes = self.hub.operator_settings();
        let mut indexer = indexing::Indexer::new(
            self.hub.clone(),
            self.objects.clone(),
            self.settings.watch.clone(),
            self.settings.namespaces.clone(),
            self.health.clone(),
            self.carried.clone(),
        );
        loop {
            let connected = registrations.borrow_and_update().clone();
            // Admission handlers are the webhook server's: they watch nothing.
            let connected: Vec<_> = connected
                .iter()
                .filter(|r| !r.kind.is_admission())
                .cloned()
                .collect();
            registry.update(&connected);
            let pending = registry.pending();
            if self.discovery.is_some() && !pending.is_empty() && pending != last_pending {
                // New registrations whose resource is not served yet: it may be by now.
                rescan_at.get_or_insert_with(tokio::time::Instant::now);
            }
            last_pending = pending;
            let stale = self.settings.operator.as_ref().is_some_and(|mine| {
                operator_changes.borrow_and_update().restarting_engine() != mine.restarting_engine()
            });
            let gate = if stale {
                Err("the operator's settings changed; the engine restarts with them".to_owned())
            } else {
                self.activities
                    .as_ref()
                    .map_or(Ok(()), |a| a.ready(registry.all()))
            };
            match (&gate, &last_gate) {
                (Err(why), last) if last.as_deref() != Some(why.as_str()) => {
                    info!(%why, "resource watching waits")
                }
                (Ok(()), Some(_)) => info!("operator activities done; watching resources"),
                _ => {}
            }
            last_gate = gate.as_ref().err().cloned();
            let groups = registry.by_resource();
            // Index handlers are fed by the indexer; the queues run everything else.
            indexer.sync(registry.all(), &groups, gate.is_ok(), &cancel, &mut tasks);
            let groups: BTreeMap<ResourceKey, Arc<Vec<Registration>>> = groups
                .into_iter()
                .filter_map(|(key, handlers)| {
                    let rest: Vec<Registration> = handlers
                        .iter()
                        .filter(|h| h.kind != HandlerKind::Index)
                        .cloned()
                        .collect();
                    (!rest.is_empty()).then(|| (key, Arc::new(rest)))
                })
                .collect();
            let stale: Vec<ResourceKey> = watched
                .keys()
                .filter(|k| !groups.contains_key(*k))
                .cloned()
                .collect();
            for key in stale {
                if let Some(w) = watched.remove(&key) {
                    info!(resource = %key.plural, "no handlers left; stopped watching");
                    self.stop(w);
                }
            }
            for (key, handlers) in groups {
                if watched
                    .get(&key)
                    .is_some_and(|w| w.selectors != common_selectors(&handlers))
                    && let Some(w) = watched.remove(&key)
                {
                    // The server-side selectors would hide objects from the new handlers.
                    info!(resource = %key.plural, "handlers' selectors changed; restarting the watch");
                    self.stop(w);
                }
                match watched.get(&key) {
                    Some(w) => {
                        let changed = w.handlers.send_if_modified(|current| {
                            if *current == handlers {
                                false
                            } else {
                                *current = handlers.clone();
                                true
                            }
                        });
                        if changed {
                            info!(resource = %key.plural, handlers = handlers.len(), "handlers changed");
                            w.queue.resync();
                        }
                    }
                    None => {
                        if gate.is_err() {
                            continue;
                        }
                        let Some(resource) = handlers.first().and_then(|h| h.resource.clone()) else {
                            continue;
                        };
                        let w = self.start(&resource, handlers, &limit, &poster, &cancel, &mut tasks);
                        watched.insert(key, w);
                    }
                }
            }
            tokio::select! {
                changed = registrations.changed() => if changed.is_err() { break },
                changed = activity_changes.changed() => if changed.is_err() { activity_changes = never.clone() },
                changed = operator_changes.changed(), if self.settings.operator.is_some() => if changed.is_err() { break },
                changed = crd_changes.changed(), if self.discovery.is_some() => {
                    if changed.is_ok() {
                        crd_changes.borrow_and_update();
                        rescan_at = Some(tokio::time::Instant::now() + RESCAN_DEBOUNCE);
                        follow_ups = 2;
                    }
                }
                () = sleep_until_opt(rescan_at) => {
                    self.rescan(&mut registry).await;
                    rescan_at = (follow_ups > 0).then(|| {
                        follow_ups -= 1;
                        tokio::time::Instant::now() + RESCAN_FOLLOW_UP
                    });
                }
                () = cancel.cancelled() => break,
            }
        }
        indexer.stop();
        for (_, w) in std::mem::take(&mut watched) {
            self.stop(w);
        }
        while tasks.join_next().await.is_some() {}
    }

    fn stop(&self, w: Watched) {
        w.cancel.cancel();
        self.queues.lock().retain(|(_, _, q)| !q.same(&w.queue));
        w.queue.stop_timers();
        let workers = w.queue.workers();
        workers.close();
        let mut retired = self.retired.lock();
        retired.retain(|(_, t)| !t.is_empty());
        if !workers.is_empty() {
            retired.push((w.queue.resource().clone(), workers));
        }
        drop(retired);
        for check in &w.checks {
            self.health.remove(check);
        }
    }

    fn start(
        &self,
        resource: &ResolvedResource,
        handlers: Arc<Vec<Registration>>,
        limit: &Arc<Semaphore>,
        poster: &posting::Poster,
        cancel: &CancellationToken,
        tasks: &mut JoinSet<()>,
    ) -> Watched {
        let scopes: Vec<Option<String>> = match self.settings.namespaces.exact() {
            Some(names) if resource.namespaced => names.into_iter().map(Some).collect(),
            _ => vec![None],
        };
        let selectors = common_selectors(&handlers);
        let (label_selector, field_selector) = selectors.clone();
        let cancel = cancel.child_token();
        let (handlers_tx, handlers_rx) = watch::channel(handlers.clone());
        let (stopped_tx, mut stopped_rx) = mpsc::unbounded_channel();
        let daemons = daemons::Daemons::new(daemons::Context {
            resource: resource.clone(),
            invoker: self.invoker.clone(),
            objects: self.objects.clone(),
            rules: processing::rules(&self.settings.storage, &handlers),
            stopped: stopped_tx,
            cancel: cancel.clone(),
            finalizer: self.settings.storage.keys.finalizer.clone(),
            max_losses: self.hub.settings().max_losses,
            finished: self.finished_daemons.clone(),
        });
        let event_handlers = handlers_rx.clone();
        let queue = Queue::new(queue::Context {
            resource: resource.clone(),
            handlers: handlers_rx,
            storage: self.settings.storage.clone(),
            invoker: self.invoker.clone(),
            objects: self.objects.clone(),
            limit: limit.clone(),
            checkpoint_after: self.settings.checkpoint_after,
            daemons: daemons.clone(),
            paused: self.hub.paused(),
            poster: poster.clone(),
            cancel: cancel.clone(),
            max_losses: self.hub.settings().max_losses,
            relisting: queue::relisting::Settings {
                scopes: scopes.clone(),
                label_selector: label_selector.clone(),
                field_selector: field_selector.clone(),
                page_size: self.settings.watch.page_size,
                timeout: self.settings.watch.inactivity_timeout,
                // Sixteen waiting bodies per worker (2,048 by default): a burst the workers
                // keep up with never waits for a listing; a start with more unhandled objects
                // holds about 2 MiB of waiting bodies per resource (1 KiB specs), not one per
                // object.
                waiting_bodies: self.settings.worker_limit.saturating_mul(16).max(1024),
            },
        });
        {
            // Objects being deleted whose last daemon stopped: their finalizer can go now.
            let q = queue.clone();
            let stop = cancel.clone();
            tasks.spawn(async move {
                loop {
                    tokio::select! {
                        () = stop.cancelled() => break,
                        uid = stopped_rx.recv() => match uid {
                            Some(uid) => q.wake(&uid),
                            None => break,
                        },
                    }
                }
            });
        }
        {
            // Pausing stops daemons and timers; resuming starts them again.
            let q = queue.clone();
            let d = daemons;
            let stop = cancel.clone();
            let mut paused = self.hub.paused();
            tasks.spawn(async move {
                loop {
                    tokio::select! {
                        () = stop.cancelled() => break,
                        changed = paused.changed() => {
                            if changed.is_err() {
                                break;
                            }
                            if *paused.borrow_and_update() {
                                d.stop_all(crate::model::CancelReason::Paused);
                            } else {
                                q.resync();
                            }
                        }
                    }
                }
            });
        }
        let predecessors: Vec<TaskTracker> = {
            let mut retired = self.retired.lock();
            let (same, other): (Vec<_>, Vec<_>) = retired
                .drain(..)
                .partition(|(r, t)| r == resource && !t.is_empty());
            *retired = other;
            same.into_iter().map(|(_, t)| t).collect()
        };
        let predecessors_done = Arc::new(tokio::sync::OnceCell::new());
        let served = self.settings.namespaces.clone();
        let mut checks = Vec::new();
        for scope in scopes.clone() {
            let status = k8s_watch::Status::default();
            let name = match &scope {
                Some(ns) => format!("watch/{resource}/{ns}"),
                None => format!("watch/{resource}"),
            };
            {
                let status = status.clone();
                crate::observability::metrics::global().sample_watch(&name, &resource.plural, move || {
                    status.is_up() && status.problem().is_none()
                });
            }
            {
                let status = status.clone();
                self.health.liveness(&name, move || match status.problem() {
                    Some(problem) => Check::fail(problem),
                    None => Check::pass("watching"),
                });
            }
            {
                let status = status.clone();
                self.health.readiness(&format!("{name}/synced"), move || {
                    if status.is_synced() {
                        Check::pass("listed")
                    } else {
                        Check::fail("initial listing not finished")
                    }
                });
                checks.push(format!("{name}/synced"));
            }
            checks.push(name.clone());
            let api = self.objects.api(resource, scope.as_deref());
            let w = k8s_watch::Watch::new(
                api,
                label_selector.clone(),
                field_selector.clone(),
                self.settings.watch.clone(),
                status,
            )
            .with_event_handlers(event_handlers.clone());
            let w = match &self.settings.shard {
                Some(shard) => {
                    let holding = shard.clone();
                    w.with_shard(shard.selector(), Arc::new(move |uid| holding.holds(uid)))
                }
                None => w,
            };
            let (tx, mut rx) = mpsc::channel::<k8s_watch::Event>(WATCH_BACKLOG);
            let span = info_span!("watch", resource = %resource, namespace = scope.as_deref().unwrap_or("*"));
            let run = w.run(tx, cancel.clone());
            let predecessors = predecessors.clone();
            let predecessors_done = predecessors_done.clone();
            tasks.spawn(
                async move {
                    // One worker per object, and no stale listing: the workers of the watch
                    // this one replaces finish (and write) before this one lists.
                    predecessors_done
                        .get_or_init(|| wait_for_retired(predecessors))
                        .await;
                    run.await;
                }
                .instrument(span.clone()),
            );
            let q = queue.clone();
            let stop = cancel.clone();
            let served = served.clone();
            let shard = self.settings.shard.clone();
            tasks.spawn(
                async move {
                    loop {
                        tokio::select! {
                            () = stop.cancelled() => break,
                            event = rx.recv() => match event {
                                Some(e) => {
                                    let ns = e.body.pointer("/metadata/namespace").and_then(serde_json::Value::as_str).unwrap_or_default();
                                    if served.serves(ns) && shard.as_ref().is_none_or(|s| s.holds_object(&e.body)) {
                                        q.observe(e.event_type, e.body, e.listed, e.in_listing).await;
                                    }
                                }
                                None => break,
                            },
                        }
                    }
                }
                .instrument(span),
            );
        }
        info!(%resource, handlers = handlers.len(), "watching");
        self.queues.lock().push((resource.clone(), scopes, queue.clone()));
        Watched {
            handlers: handlers_tx,
            selectors,
            cancel,
            queue,
            checks,
        }
    }
}

/// Waits, within [`RETIRED_WORKERS_WAIT`], for the workers of stopped queues.
async fn wait_for_retired(workers: Vec<TaskTracker>) {
    if workers.is_empty() {
        return;
    }
    let all = futures::future::join_all(workers.iter().map(TaskTracker::wait));
    if tokio::time::timeout(RETIRED_WORKERS_WAIT, all).await.is_err() {
        warn!(wait = ?RETIRED_WORKERS_WAIT, "workers of the resource's previous watch are still running; going on");
    }
}

/// Server-side selectors shared by every handler of a resource (only then can the watch use
/// them without hiding objects from some handler; each handler's own selectors are checked in
/// [`matching::prematch`] either way).
fn common_selectors(handlers: &[Registration]) -> (Option<String>, Option<String>) {
    let pick = |f: fn(&Registration) -> &str| {
        let first = handlers.first().map(f).unwrap_or_default();
        (!first.is_empty() && handlers.iter().all(|h| f(h) == first)).then(|| first.to_owned())
    };
    (
        pick(|h| {
            h.selector
                .as_ref()
                .map(|s| s.label_selector.as_str())
                .unwrap_or_default()
        }),
        pick(|h| {
            h.selector
                .as_ref()
                .map(|s| s.field_selector.as_str())
                .unwrap_or_default()
        }),
    )
}
