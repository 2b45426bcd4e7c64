//! Wires the controller together and owns its lifecycle: builds the API client and discovery,
//! the hub, the peering gate (freezing, leader election), the engine, the gRPC server and the
//! admin endpoint, runs them until the root token is cancelled, then drains: no new
//! invocations, `Drain` to every handler process, in-flight work given the shutdown grace (and
//! its outcomes written), then the lease is released (a standby takes over at once), the
//! engine stops, cleanup handlers run (bounded by the shutdown grace), the peering entry is
//! removed and the servers stop.
//!
//! All components share one API client whose credentials login handlers may replace
//! (`k8s::switch`); discovery and the CRD watch use the kubeconfig / in-cluster client, which
//! must exist before any handler process could log in. A startup handler that fails for good
//! before the operator started stops the controller with an error (non-zero exit); a late one
//! only withdraws its own process's registrations (`engine::activities`). Whatever ends the
//! controller, the way out is bounded: the servers get the shutdown grace to stop, then they
//! are aborted, so the process never hangs on a handler process that keeps its stream open.

use std::{sync::Arc, time::Duration};

use capstan_proto::pb;
use futures::future::BoxFuture;
use tokio::task::{JoinHandle, JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, debug, info, info_span, warn};

use crate::{
    config::Settings,
    engine::{self, Engine, activities::Activities},
    error::Result,
    grpc::{self, Hub},
    k8s,
    model::{Diagnostic, ResolvedResource, ResourceSelector},
    observability::{
        admin::Admin,
        health::{Check, Health},
        metrics::Sampled,
    },
    peering::{self, Gate, Peering, election::Elector, gate::Hooks},
};

/// Resolves registration selectors through API discovery. With `pending` (CRDs are watched),
/// a resource that is not served yet is a warning: the registration waits for it.
struct DiscoveryResolver {
    discovery: Arc<k8s::discovery::Discovery>,
    pending: bool,
}

impl grpc::Resolver for DiscoveryResolver {
    fn resolve<'a>(
        &'a self,
        selector: &'a ResourceSelector,
    ) -> BoxFuture<'a, Result<ResolvedResource, Diagnostic>> {
        Box::pin(async move {
            self.discovery.resolve(selector).await.map_err(|e| {
                if self.pending && matches!(e, k8s::discovery::Error::NotFound(_)) {
                    return Diagnostic::warning(
                        "RESOURCE_NOT_FOUND_YET",
                        format!("{e} yet; it is watched as soon as it is served (its CRD is established)"),
                    );
                }
                let mut d = Diagnostic::error(e.reason(), e.to_string());
                if let k8s::discovery::Error::Api(source) = &e {
                    d.detail = source.to_string();
                }
                d
            })
        })
    }
}

/// Runs the controller until `shutdown` is cancelled, then shuts down gracefully.
///
/// # Errors
/// When a subsystem cannot start (no cluster configuration, address in use, peering required
/// but its CRDs missing) or fails.
pub async fn run(mut settings: Settings, shutdown: CancellationToken) -> Result<()> {
    let core = Core::connect(&settings).await?;
    let serving = CancellationToken::new();
    // Bound now, so that an address in use is known at once.
    let admin = Admin::bind(settings.admin_listen, settings.admin.clone(), core.health.clone()).await?;
    let admin_addr = admin.local_addr();
    let mut tasks = JoinSet::new();
    // The handler container's own identity, before it starts: kubelet starts it once the
    // startup probe passes, so the first token is written before the admin endpoint answers.
    if let Some(spec) = settings.handler_identity.clone() {
        let client = core.switch.base();
        let Some(first) = crate::k8s::handler_identity::first_written(&client, &spec, &shutdown).await else {
            info!("stopped while writing the handler's identity");
            serving.cancel();
            return Ok(());
        };
        let stop = serving.clone();
        tasks.spawn(async move {
            crate::k8s::handler_identity::keep(client, spec, first, stop).await;
            Ok(())
        });
    }
    // Then the admin endpoint answers probes: also while the node-local storage is waited for
    // (a surge pod of the same DaemonSet may still hold it).
    let admin_stop = serving.clone();
    tasks.spawn(async move {
        admin.serve(admin_stop).await;
        Ok(())
    });
    tokio::select! {
        opened = open_node_store(&mut settings, &core.health) => opened?,
        () = shutdown.cancelled() => {
            info!("stopped while waiting for the node-local storage");
            serving.cancel();
            return Ok(());
        }
    }
    let background = Background::start(&settings, &core);
    core.register_checks();
    let mut pausing = Pausing::start(&settings, &core).await?;
    let server = grpc::Server::bind(
        settings.listen.clone(),
        core.hub.clone(),
        core.resolver(settings.engine.watch_crds),
        settings.connection.clone(),
        serving.clone(),
    )
    .await?;
    let (managed_names, managed_rx) = tokio::sync::watch::channel(settings.webhooks.managed.clone());
    let webhooks = crate::webhooks::Webhooks::start(
        &settings.webhooks,
        &core.hub,
        core.client.clone(),
        settings.engine.namespaces.exact(),
        pausing.leading.clone(),
        managed_rx,
    )
    .await?;
    info!(listen = %server.local(), admin = ?admin_addr, version = env!("CARGO_PKG_VERSION"), "capstan started");

    settings.engine.shard = pausing.shard();
    let engines = core.engines(&settings, &background);
    engines.register_check(&core.health);
    pausing.quiesce_with(&engines);
    let gate_stop = CancellationToken::new();
    let gate_task = tokio::spawn(pausing.gate.clone().drive(
        core.hub.clone(),
        settings.shutdown_grace,
        engines.clone(),
        gate_stop.clone(),
    ));
    engines.start().await;
    let following = CancellationToken::new();
    let follow_task = tokio::spawn(
        engines
            .clone()
            .follow_operator_settings(pausing.peering.clone(), following.clone()),
    );
    let client_task = tokio::spawn(follow_client_settings(
        core.hub.clone(),
        settings.operator.clone(),
        core.switch.clone(),
        webhooks.is_some().then_some(managed_names),
        following.clone(),
    ));
    serve(&mut tasks, server, &background.activities, &serving);

    let failed = tokio::select! {
        () = shutdown.cancelled() => None,
        Some(joined) = tasks.join_next() => Some(joined),
    };
    gate_stop.cancel();
    let _ = gate_task.await;
    following.cancel();
    let _ = follow_task.await;
    let _ = client_task.await;
    let drained = failed.is_none() && drain(&core.hub, settings.shutdown_grace).await;
    // Still the leader: the managed webhook configurations are removed.
    pausing.leaving();
    if let Some(webhooks) = webhooks {
        webhooks.stop().await;
    }
    pausing.stop_election().await;
    engines.stop().await;
    pausing.leave_ring(drained).await;
    if failed.is_none() {
        run_cleanup(&core.hub, &background.activities, settings.shutdown_grace).await;
    }
    background.stop().await;
    pausing.stop_peering().await;
    serving.cancel();
    finish(tasks, failed, settings.shutdown_grace).await
}

/// With `--node-storage`: opens the node's store (before any handler runs, so that a
/// directory that cannot be used stops the start with a clear error) and reports its size in
/// `/metrics`. Readiness says "waiting for storage" while another process holds it.
async fn open_node_store(settings: &mut Settings, health: &Health) -> Result<()> {
    const CHECK: &str = "node-local-storage";
    let Some(spec) = settings.node_store.clone() else {
        return Ok(());
    };
    let keys = settings.engine.storage.keys.clone();
    let waiting = format!(
        "waiting for storage: opening {} (another process may hold it)",
        spec.dir.display()
    );
    health.readiness(CHECK, move || Check::fail(waiting.clone()));
    let store = Arc::new(crate::persistence::node_store::NodeStore::open(&spec, keys).await?);
    health.readiness(CHECK, || Check::pass("node-local storage opened"));
    info!(dir = %spec.dir.display(), objects = store.entries(), bytes = store.bytes(), "node-local storage opened");
    let metrics = crate::observability::metrics::global();
    let s = store.clone();
    metrics.sample(Sampled::NodeStorageObjects, move || {
        i64::try_from(s.entries()).unwrap_or(i64::MAX)
    });
    let s = store.clone();
    metrics.sample(Sampled::NodeStorageBytes, move || {
        i64::try_from(s.bytes()).unwrap_or(i64::MAX)
    });
    let s = store.clone();
    metrics.sample(Sampled::NodeStorageCorrupt, move || {
        i64::try_from(s.corrupt()).unwrap_or(i64::MAX)
    });
    settings.engine.storage.local = Some(store);
    Ok(())
}

/// What every part of the controller shares: the API clients, discovery, the hub and health.
struct Core {
    switch: k8s::switch::Switchable,
    client: kube::Client,
    objects: k8s::objects::Objects,
    discovery: Arc<k8s::discovery::Discovery>,
    hub: Hub,
    health: Health,
}

impl Core {
    async fn connect(settings: &Settings) -> Result<Self> {
        let switch = k8s::switch::Switchable::connect(
            settings.api_timeout,
            settings.api_requests,
            k8s::client::user_agent(&settings.peering.identity()),
        )
        .await?;
        let client = switch.client();
        Ok(Self {
            objects: k8s::objects::Objects::new(client.clone()),
            discovery: Arc::new(k8s::discovery::Discovery::new(
                switch.base(),
                settings.discovery_ttl,
            )),
            client,
            switch,
            hub: Hub::new(settings.hub.clone()),
            health: Health::default(),
        })
    }

    /// Resolves registration selectors; with `pending` (CRDs are watched) a resource that is
    /// not served yet is waited for.
    fn resolver(&self, pending: bool) -> Arc<DiscoveryResolver> {
        Arc::new(DiscoveryResolver {
            discovery: self.discovery.clone(),
            pending,
        })
    }

    /// Readiness: a handler process is connected and the API server answers; metrics of the
    /// hub.
    fn register_checks(&self) {
        let hub = self.hub.clone();
        self.health
            .readiness("handler-processes", move || match hub.connections() {
                0 => Check::fail("no handler process is connected"),
                n => Check::pass(format!("{n} handler process(es) connected")),
            });
        let reachability = self.switch.reachability();
        self.health
            .readiness("api-server", move || match reachability.outage() {
                Some((since, why)) => Check::fail(format!(
                    "the API server does not answer (for {}s): {why}",
                    since.as_secs()
                )),
                None => Check::pass("the API server answers"),
            });
        let metrics = crate::observability::metrics::global();
        let h = self.hub.clone();
        metrics.sample(Sampled::HandlerProcesses, move || {
            i64::try_from(h.connections()).unwrap_or(i64::MAX)
        });
        let paused = self.hub.paused();
        metrics.sample(Sampled::Paused, move || i64::from(*paused.borrow()));
    }

    fn engines(&self, settings: &Settings, background: &Background) -> Arc<Engines> {
        Arc::new(Engines {
            hub: self.hub.clone(),
            objects: self.objects.clone(),
            settings: settings.engine.clone(),
            health: self.health.clone(),
            activities: background.activities.clone(),
            discovery: background
                .crds
                .as_ref()
                .map(|(rx, _)| (self.discovery.clone(), rx.clone())),
            operator: settings.operator.clone(),
            configured_with: parking_lot::Mutex::default(),
            current: tokio::sync::Mutex::new(None),
            index_memory: engine::indexing::Carried::default(),
            finished_daemons: engine::daemons::Finished::default(),
        })
    }
}

/// Follows the operator-wide settings of handler processes that do not restart the engine
/// (see [`crate::model::operator_settings::Field::restarts_engine`]): the API requests'
/// timeout, applied to the next requests, and the managed webhook configurations' name, which
/// the webhooks' manager follows (`managed_names`; `None` when no webhooks are served: a name
/// from the settings is then said to have no effect). A flag given wins. Ends with `stop`.
async fn follow_client_settings(
    hub: Hub,
    flags: Option<crate::config::OperatorFlags>,
    switch: k8s::switch::Switchable,
    managed_names: Option<tokio::sync::watch::Sender<Option<String>>>,
    stop: CancellationToken,
) {
    let Some(flags) = flags else {
        return;
    };
    let mut changes = hub.operator_settings();
    changes.mark_changed();
    let mut unserved: Option<String> = None;
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            changed = changes.changed() => if changed.is_err() { return },
        }
        let wanted = changes.borrow_and_update().clone();
        let (timeout, managed) = flags.client(&wanted);
        if timeout != switch.request_timeout() {
            info!(
                ?timeout,
                "the API requests' timeout changed with the handler processes' settings"
            );
            switch.set_request_timeout(timeout);
        }
        match &managed_names {
            Some(names) => {
                names.send_if_modified(|name| {
                    let changed = *name != managed;
                    *name = managed;
                    changed
                });
            }
            None if wanted.webhook_managed.is_some() && wanted.webhook_managed != unserved => {
                unserved.clone_from(&wanted.webhook_managed);
                let why = "webhook_managed has no effect: this controller serves no webhooks";
                warn!(name = ?wanted.webhook_managed, "{why}");
                let diagnostic = crate::model::Diagnostic::warning("SETTING_UNUSED", why)
                    .at("settings.operator.webhook_managed");
                hub.broadcast(pb::connect_response::Message::Notice(pb::Notice {
                    invocation_id: String::new(),
                    diagnostics: vec![crate::grpc::convert::diagnostic_to_pb(&diagnostic)],
                }));
            }
            None => {}
        }
    }
}

/// Tasks that run for the controller's whole life: operator activities, the CRD watch and
/// the API server's reachability probe.
struct Background {
    activities: Activities,
    stop: CancellationToken,
    activities_task: JoinHandle<()>,
    crds: Option<(tokio::sync::watch::Receiver<k8s::crds::Snapshot>, JoinHandle<()>)>,
    reachability_task: JoinHandle<()>,
}

impl Background {
    fn start(settings: &Settings, core: &Core) -> Self {
        let stop = CancellationToken::new();
        let activities = Activities::new(
            core.hub.clone(),
            core.health.clone(),
            Some(core.switch.clone()),
            settings.engine.activities.clone(),
        );
        let activities_task = tokio::spawn(activities.clone().run(stop.clone()));
        let crds = settings.engine.watch_crds.then(|| {
            let (tx, rx) = tokio::sync::watch::channel(k8s::crds::Snapshot::default());
            let task = tokio::spawn(
                k8s::crds::Crds::new(core.switch.base())
                    .run(tx, stop.clone())
                    .instrument(info_span!("crds")),
            );
            (rx, task)
        });
        let reachability_task = tokio::spawn(
            probe_reachability(core.switch.clone(), stop.clone()).instrument(info_span!("reachability")),
        );
        Self {
            activities,
            stop,
            activities_task,
            crds,
            reachability_task,
        }
    }

    async fn stop(self) {
        self.stop.cancel();
        let _ = self.activities_task.await;
        if let Some((_, task)) = self.crds {
            let _ = task.await;
        }
        let _ = self.reachability_task.await;
    }
}

/// Keeps the API server's reachability fresh (see [`k8s::reachability::probe`]): the version
/// request goes through the shared client, like every other request.
async fn probe_reachability(switch: k8s::switch::Switchable, stop: CancellationToken) {
    let client = switch.base();
    let ask = move || {
        let client = client.clone();
        async move { client.apiserver_version().await.map(|_| ()) }
    };
    k8s::reachability::probe::run(switch.reachability(), ask, stop).await;
}

/// Freezing by peers and leader election: both pause dispatch through the gate.
struct Pausing {
    gate: Gate,
    /// Whether this replica leads (always, without election): it writes the managed webhook
    /// configurations.
    leading: crate::webhooks::managed::Leading,
    peering: Arc<PeeringSlot>,
    election_stop: CancellationToken,
    elector: Option<JoinHandle<Elector>>,
    /// With sharding: this replica's membership in the ring.
    member: Option<crate::sharding::Member>,
}

impl Pausing {
    async fn start(settings: &Settings, core: &Core) -> Result<Self> {
        let gate = Gate::new();
        let election = &settings.election;
        // Replicas sharing a Lease (leader election) or a ring (sharding) are one operator, not
        // conflicting peers.
        let lease = if settings.sharding.enabled {
            Some(format!(
                "{}/{}",
                settings.sharding.namespace(),
                settings.sharding.ring
            ))
        } else {
            election
                .enabled
                .then(|| format!("{}/{}", election.namespace(), election.lease_name))
        };
        if election.enabled {
            election.validate().map_err(peering::Error::from)?;
        }
        let namespaces = settings.engine.namespaces.exact().unwrap_or_default();
        let peering = Peering::start(
            &settings.peering,
            core.client.clone(),
            &gate,
            &namespaces,
            lease.clone(),
            PEERING_FIRST_DECISION,
        )
        .await?;
        let peering = Arc::new(PeeringSlot {
            running: tokio::sync::Mutex::new((settings.peering.clone(), peering)),
            failed: std::sync::atomic::AtomicBool::new(false),
            client: core.client.clone(),
            gate: gate.clone(),
            namespaces,
            lease: lease.clone(),
        });
        let election_stop = CancellationToken::new();
        let mut leading: crate::webhooks::managed::Leading = Arc::new(|| true);
        let elector = election.enabled.then(|| {
            let namespace = election.namespace();
            let store = Arc::new(k8s::lease::Leases::new(
                core.client.clone(),
                &namespace,
                &election.lease_name,
            ));
            let identity = settings.peering.identity();
            info!(lease = lease.as_deref().unwrap_or_default(), %identity, "leader election started");
            let mut elector = Elector::new(election.clone(), identity, store, gate.clone());
            let status = elector.status();
            let sampled = status.clone();
            crate::observability::metrics::global()
                .sample(Sampled::Leader, move || i64::from(sampled.lock().leading));
            let sampled = status.clone();
            crate::observability::metrics::global()
                .sample_leader(&election.lease_name, move || i64::from(sampled.lock().leading));
            let webhooks = status.clone();
            leading = Arc::new(move || webhooks.lock().leading);
            core.health
                .readiness("leadership", move || Check::pass(status.lock().describe()));
            let stop = election_stop.clone();
            tokio::spawn(
                async move {
                    elector.run(stop).await;
                    elector
                }
                .instrument(info_span!("election")),
            )
        });
        let member = if settings.sharding.enabled {
            let identity = settings.peering.identity();
            let member =
                crate::sharding::Member::start(&settings.sharding, &identity, core.client.clone(), &gate)?;
            let status = member.status();
            let first = status.clone();
            // The ring's first member writes the managed webhook configurations; leaving, it
            // removes them only when it is the last (the others keep serving).
            leading = Arc::new(move || {
                let status = first.lock();
                status.first && (!status.leaving || status.members.len() <= 1)
            });
            core.health
                .readiness("sharding", move || Check::pass(status.lock().describe()));
            Some(member)
        } else {
            None
        };
        Ok(Self {
            gate,
            leading,
            peering,
            election_stop,
            elector,
            member,
        })
    }

    /// With sharding: this member is leaving (the ring's other members stay).
    fn leaving(&self) {
        if let Some(member) = &self.member {
            member.status().lock().leaving = true;
        }
    }

    /// With sharding: the ranges this replica handles, for the engine.
    fn shard(&self) -> Option<crate::sharding::Shard> {
        self.member.as_ref().map(crate::sharding::Member::shard)
    }

    /// With sharding: leaves the ring once the engine stopped (the others take over at once),
    /// or, when in-flight work may still run (`finished` false), lets the Lease expire.
    async fn leave_ring(&mut self, finished: bool) {
        if let Some(member) = self.member.take() {
            member.leave(finished).await;
        }
    }

    /// With sharding: gives the hand-over the way to stop the engine and wait for it.
    fn quiesce_with(&self, engines: &Arc<Engines>) {
        if let Some(member) = &self.member {
            let engines = Arc::downgrade(engines);
            member.set_quiesce(Arc::new(move || {
                let engines = engines.clone();
                Box::pin(async move {
                    if let Some(engines) = engines.upgrade() {
                        engines.quiesce().await;
                    }
                })
            }));
        }
    }

    /// Stops the election and releases the lease (a standby takes over at once).
    async fn stop_election(&mut self) {
        self.election_stop.cancel();
        if let Some(task) = self.elector.take()
            && let Ok(mut elector) = task.await
        {
            elector.release().await;
        }
    }

    /// Removes the peering entry.
    async fn stop_peering(self) {
        self.peering.stop().await;
    }
}

/// The operator's peering, replaced when the handler processes' peering settings change
/// (kopf's `settings.peering` in a startup handler).
struct PeeringSlot {
    running: tokio::sync::Mutex<(peering::Settings, Option<Peering>)>,
    /// The last restart failed: required peering could not start.
    failed: std::sync::atomic::AtomicBool,
    client: kube::Client,
    gate: Gate,
    namespaces: Vec<String>,
    lease: Option<String>,
}

/// The gate's reason while peering is required but cannot run.
const PEERING_UNAVAILABLE: &str = "peering:unavailable";
/// The gate's reason while peering restarts.
const PEERING_RESTARTING: &str = "peering:restarting";
/// How often required peering that could not start is tried again.
const PEERING_RETRY: Duration = Duration::from_secs(30);

impl PeeringSlot {
    /// Restarts peering with `wanted` if it differs from the running one's settings: the
    /// old entries are removed, the new ones hold the gate until their first decision. Peering
    /// that is required but cannot start holds the gate (the operator stays paused).
    async fn follow(&self, wanted: peering::Settings) {
        let mut running = self.running.lock().await;
        if running.0 == wanted && !self.failed() {
            return;
        }
        info!(
            peering = %wanted.name,
            priority = wanted.priority,
            standalone = wanted.standalone,
            "the handler processes' peering settings changed; peering restarts with them"
        );
        // Held from before the old entries go until the new ones hold the gate (or peering is
        // found unavailable): a frozen operator must not run handlers in between.
        self.gate.hold(
            PEERING_RESTARTING,
            "peering restarts with the handler processes' settings",
        );
        if let Some(old) = running.1.take() {
            old.stop().await;
        }
        self.gate.release(PEERING_UNAVAILABLE);
        match Peering::start(
            &wanted,
            self.client.clone(),
            &self.gate,
            &self.namespaces,
            self.lease.clone(),
            PEERING_FIRST_DECISION,
        )
        .await
        {
            Ok(peering) => {
                running.1 = peering;
                self.failed.store(false, std::sync::atomic::Ordering::Relaxed);
            }
            Err(e) => {
                // Tried again (`failed`) until it starts or the settings change.
                warn!(error = %crate::diagnostic::chain(&e), "peering is required but cannot start: the operator stays paused");
                self.gate.hold(
                    PEERING_UNAVAILABLE,
                    format!("peering is required but cannot start: {e}"),
                );
                self.failed.store(true, std::sync::atomic::Ordering::Relaxed);
            }
        }
        running.0 = wanted;
        self.gate.release(PEERING_RESTARTING);
    }

    /// Whether the last restart failed (required peering that cannot start yet).
    fn failed(&self) -> bool {
        self.failed.load(std::sync::atomic::Ordering::Relaxed)
    }

    async fn stop(&self) {
        if let Some(peering) = self.running.lock().await.1.take() {
            peering.stop().await;
        }
    }
}

/// The tasks whose end ends the controller: the gRPC server, the admin endpoint, and a
/// startup handler that fails for good.
fn serve(
    tasks: &mut JoinSet<Result<()>>,
    server: grpc::Server,
    activities: &Activities,
    serving: &CancellationToken,
) {
    tasks.spawn(async move { server.serve().await.map_err(crate::error::Error::from) });
    let activities = activities.clone();
    let stop = serving.clone();
    tasks.spawn(async move {
        tokio::select! {
            e = activities.failed() => Err(e.into()),
            () = stop.cancelled() => Ok(()),
        }
    });
}

/// Runs cleanup handlers once resource work is drained and the engine stopped: only they
/// dispatch now.
async fn run_cleanup(hub: &Hub, activities: &Activities, grace: Duration) {
    hub.set_paused(false);
    activities.cleanup(grace).await;
    hub.set_paused(true);
}

/// Waits for the serving tasks; the first one that ended early decides the result.
async fn finish(
    mut tasks: JoinSet<Result<()>>,
    failed: Option<Result<Result<()>, tokio::task::JoinError>>,
    grace: Duration,
) -> Result<()> {
    if let Some(joined) = failed {
        let rest = async { while tasks.join_next().await.is_some() {} };
        if tokio::time::timeout(grace, rest).await.is_err() {
            warn!(
                ?grace,
                "the servers did not stop within the shutdown grace; aborting them"
            );
            tasks.abort_all();
            while tasks.join_next().await.is_some() {}
        }
        return match joined {
            Ok(result) => result,
            Err(e) => {
                warn!(error = %e, "a controller task panicked");
                Ok(())
            }
        };
    }
    let rest = async {
        while let Some(joined) = tasks.join_next().await {
            if let Ok(Err(e)) = joined {
                warn!(error = %e, "a subsystem failed during shutdown");
            }
        }
    };
    if tokio::time::timeout(grace, rest).await.is_err() {
        warn!(
            ?grace,
            "the servers did not stop within the shutdown grace; aborting them"
        );
        tasks.abort_all();
    }
    info!("capstan stopped");
    Ok(())
}

/// How long the start waits for the first peering decision before the engine starts.
const PEERING_FIRST_DECISION: Duration = Duration::from_secs(10);

/// How long a stopped engine's cycles get to end before a hand-over goes on regardless.
const QUIESCE_WAIT: Duration = Duration::from_secs(10);

/// How long cancelled work of a replaced engine gets to withdraw before dispatch resumes.
const WITHDRAW_SETTLE: Duration = Duration::from_millis(200);

/// The running engine, replaceable while the controller runs.
///
/// The engine keeps watching while the gate is paused, but its processing cycles that were
/// waiting for dispatch hold the object as it was before the pause — possibly before another
/// operator (the new leader's predecessor, a `--dev` operator) handled it. Resuming them would
/// run handlers twice. So when the gate opens, the engine is replaced: the old one's waiting
/// work is withdrawn without a handler call, and the new one starts from a fresh listing.
/// The same replacement cancels in-flight work that outlives a pause's grace period.
struct Engines {
    hub: Hub,
    objects: k8s::objects::Objects,
    settings: engine::Settings,
    health: Health,
    activities: Activities,
    discovery: Option<(
        Arc<k8s::discovery::Discovery>,
        tokio::sync::watch::Receiver<k8s::crds::Snapshot>,
    )>,
    /// The flags, to apply the operator-wide settings of handler processes; `None`: they are
    /// not followed.
    operator: Option<crate::config::OperatorFlags>,
    /// The processes' operator-wide settings the running engine was configured with.
    configured_with: parking_lot::Mutex<crate::model::operator_settings::OperatorSettings>,
    current: tokio::sync::Mutex<Option<(CancellationToken, JoinHandle<()>)>>,
    /// Index feeds' state handed from each engine to the next.
    index_memory: engine::indexing::Carried,
    /// Daemons that are done, kept across engines until the controller restarts.
    finished_daemons: engine::daemons::Finished,
}

impl Engines {
    /// Liveness: a running engine whose task ended (a panic) is a process that no longer works.
    fn register_check(self: &Arc<Self>, health: &Health) {
        let engines = Arc::downgrade(self);
        health.liveness("engine", move || {
            let Some(engines) = engines.upgrade() else {
                return Check::pass("stopped");
            };
            let Ok(current) = engines.current.try_lock() else {
                return Check::pass("being replaced");
            };
            match current.as_ref() {
                Some((stop, task)) if task.is_finished() && !stop.is_cancelled() => {
                    Check::fail("the engine's task ended unexpectedly")
                }
                Some(_) => Check::pass("running"),
                None => Check::pass("not running"),
            }
        });
    }

    async fn start(&self) {
        let mut current = self.current.lock().await;
        if current.is_none() {
            *current = Some(self.spawn());
        }
    }

    /// A new engine, configured with the operator-wide settings in effect now.
    fn spawn(&self) -> (CancellationToken, JoinHandle<()>) {
        let stop = CancellationToken::new();
        let mut engine = Engine::new(
            self.hub.clone(),
            self.objects.clone(),
            self.configured(),
            self.health.clone(),
        )
        .with_activities(self.activities.clone())
        .with_index_memory(self.index_memory.clone())
        .with_finished_daemons(self.finished_daemons.clone());
        if let Some((discovery, crds)) = &self.discovery {
            engine = engine.with_discovery(discovery.clone(), crds.clone());
        }
        (stop.clone(), tokio::spawn(engine.run(stop)))
    }

    /// The engine's settings: the flags', with the handler processes' operator-wide settings
    /// applied where their flags were not given.
    fn configured(&self) -> engine::Settings {
        let Some(flags) = &self.operator else {
            return self.settings.clone();
        };
        let wanted = self.hub.operator_settings().borrow().clone();
        let mut settings = match flags.engine(&wanted) {
            Ok(configured) => self.settings.reconfigured(&configured),
            Err(why) => {
                warn!(%why, "the handler processes' operator settings cannot be applied; the flags' are used");
                let diagnostic = crate::model::Diagnostic::warning(
                    "BAD_SETTING",
                    format!("the operator settings cannot be applied together ({why}); the controller's flags are used"),
                )
                .at("settings.operator");
                self.hub
                    .broadcast(pb::connect_response::Message::Notice(pb::Notice {
                        invocation_id: String::new(),
                        diagnostics: vec![crate::grpc::convert::diagnostic_to_pb(&diagnostic)],
                    }));
                self.settings.clone()
            }
        };
        if wanted != crate::model::operator_settings::OperatorSettings::default() {
            info!(settings = ?wanted, "the handler processes' operator settings are applied");
        }
        self.configured_with.lock().clone_from(&wanted);
        settings.operator = Some(wanted);
        settings
    }

    /// Follows the operator-wide settings handler processes send: a change replaces the
    /// running engine with one configured with them (before the first watch when a startup
    /// handler sent them: the engine waits for startup handlers). Ends with `stop`.
    async fn follow_operator_settings(self: Arc<Self>, peering: Arc<PeeringSlot>, stop: CancellationToken) {
        let Some(flags) = self.operator.clone() else {
            return;
        };
        let mut changes = self.hub.operator_settings();
        // Settings that came before this task subscribed are followed too.
        changes.mark_changed();
        loop {
            tokio::select! {
                () = stop.cancelled() => return,
                changed = changes.changed() => if changed.is_err() { return },
                () = tokio::time::sleep(PEERING_RETRY), if peering.failed() => {}
            }
            let wanted = changes.borrow_and_update().clone();
            // Peering first: its new entries hold the gate before the engine that follows
            // these settings starts (the engine's gate stays closed until then). Not raced
            // against the stop: it is bounded, and a half-done restart would leave entries.
            peering.follow(flags.peering(&wanted)).await;
            if stop.is_cancelled() {
                return;
            }
            let mut current = self.current.lock().await;
            // An engine started meanwhile may have been configured with these already; and a
            // change of settings that are not the engine's leaves it running.
            if self.configured_with.lock().restarting_engine() == changes.borrow().restarting_engine() {
                continue;
            }
            let Some((running, task)) = current.take() else {
                continue;
            };
            info!("the handler processes' operator settings changed; the engine restarts with them");
            running.cancel();
            let _ = task.await;
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(WITHDRAW_SETTLE) => {}
            }
            *current = Some(self.spawn());
        }
    }

    async fn stop(&self) {
        let running = self.current.lock().await.take();
        if let Some((stop, task)) = running {
            stop.cancel();
            let _ = task.await;
        }
    }

    /// Stops the engine (its cycles, their writes and its daemons are cancelled) and waits
    /// until no object is processed any more, within [`QUIESCE_WAIT`]; the gate's resume
    /// starts a new one.
    async fn quiesce(&self) {
        self.stop().await;
        let deadline = tokio::time::Instant::now() + QUIESCE_WAIT;
        while crate::observability::metrics::global().processing_now() > 0 {
            if tokio::time::Instant::now() >= deadline {
                warn!(wait = ?QUIESCE_WAIT, "objects are still being processed after the engine stopped");
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    async fn restart(&self) {
        self.stop().await;
        tokio::time::sleep(WITHDRAW_SETTLE).await;
        self.start().await;
    }
}

impl Hooks for Engines {
    fn resuming(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            debug!("replacing the engine: work that waited during the pause is re-evaluated");
            self.restart().await;
        })
    }

    fn overrun(&self) -> BoxFuture<'_, ()> {
        Box::pin(async move {
            debug!("replacing the engine: in-flight work is cancelled");
            self.restart().await;
        })
    }
}

/// Stops dispatch, tells handler processes to drain, and waits for in-flight work; whether
/// it all finished within `grace`.
async fn drain(hub: &Hub, grace: Duration) -> bool {
    hub.set_paused(true);
    hub.broadcast(pb::connect_response::Message::Drain(pb::Drain {
        grace_period: prost_types::Duration::try_from(grace).ok(),
        reason: "the controller is shutting down".into(),
        start_time: Some(prost_types::Timestamp::from(std::time::SystemTime::now())),
    }));
    let deadline = tokio::time::Instant::now() + grace;
    while hub.in_flight() > 0 && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let left = hub.in_flight();
    if left > 0 {
        warn!(
            left,
            "in-flight invocations did not finish within the shutdown grace"
        );
    }
    left == 0
}
