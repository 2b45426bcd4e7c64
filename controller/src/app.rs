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
//! stops the controller with an error (non-zero exit).

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
pub async fn run(settings: Settings, shutdown: CancellationToken) -> Result<()> {
    let switch = k8s::switch::Switchable::connect().await?;
    let client = switch.client();
    let objects = k8s::objects::Objects::new(client.clone());
    let discovery = Arc::new(k8s::discovery::Discovery::new(
        switch.base(),
        settings.discovery_ttl,
    ));
    let watch_crds = settings.engine.watch_crds;
    let resolver = Arc::new(DiscoveryResolver {
        discovery: discovery.clone(),
        pending: watch_crds,
    });
    let hub = Hub::new(settings.hub.clone());
    let health = Health::default();
    let activities_stop = CancellationToken::new();
    let activities = Activities::new(
        hub.clone(),
        health.clone(),
        Some(switch.clone()),
        settings.engine.activities.clone(),
    );
    let activities_task = tokio::spawn(activities.clone().run(activities_stop.clone()));
    let crds = watch_crds.then(|| {
        let (tx, rx) = tokio::sync::watch::channel(k8s::crds::Snapshot::default());
        let task = tokio::spawn(
            k8s::crds::Crds::new(switch.base())
                .run(tx, activities_stop.clone())
                .instrument(info_span!("crds")),
        );
        (rx, task)
    });
    {
        let hub = hub.clone();
        health.readiness("handler-processes", move || match hub.connections() {
            0 => Check::fail("no handler process is connected"),
            n => Check::pass(format!("{n} handler process(es) connected")),
        });
    }
    {
        let metrics = crate::observability::metrics::global();
        let h = hub.clone();
        metrics.sample(
            crate::observability::metrics::Sampled::HandlerProcesses,
            move || i64::try_from(h.connections()).unwrap_or(i64::MAX),
        );
        let paused = hub.paused();
        metrics.sample(crate::observability::metrics::Sampled::Paused, move || {
            i64::from(*paused.borrow())
        });
    }

    let gate = Gate::new();
    let election = &settings.election;
    let lease = election
        .enabled
        .then(|| format!("{}/{}", election.namespace(), election.lease_name));
    if election.enabled {
        election.validate().map_err(peering::Error::from)?;
    }
    let peering = Peering::start(
        &settings.peering,
        client.clone(),
        &gate,
        &settings.engine.namespaces.exact().unwrap_or_default(),
        lease.clone(),
        PEERING_FIRST_DECISION,
    )
    .await?;
    let election_stop = CancellationToken::new();
    let elector = election.enabled.then(|| {
        let namespace = election.namespace();
        let store = Arc::new(k8s::lease::Leases::new(
            client.clone(),
            &namespace,
            &election.lease_name,
        ));
        let identity = settings.peering.identity();
        info!(lease = lease.as_deref().unwrap_or_default(), %identity, "leader election started");
        let mut elector = Elector::new(election.clone(), identity, store, gate.clone());
        let status = elector.status();
        let leading = status.clone();
        crate::observability::metrics::global()
            .sample(crate::observability::metrics::Sampled::Leader, move || {
                i64::from(leading.lock().leading)
            });
        health.readiness("leadership", move || Check::pass(status.lock().describe()));
        let stop = election_stop.clone();
        tokio::spawn(
            async move {
                elector.run(stop).await;
                elector
            }
            .instrument(info_span!("election")),
        )
    });

    let serving = CancellationToken::new();
    let server = grpc::Server::bind(
        settings.listen.clone(),
        hub.clone(),
        resolver,
        settings.connection.clone(),
        serving.clone(),
    )
    .await?;
    let admin = Admin::bind(settings.admin_listen, health.clone()).await?;
    info!(listen = %server.local(), admin = ?admin.local_addr(), version = env!("CARGO_PKG_VERSION"), "capstan started");

    let engines = Arc::new(Engines {
        hub: hub.clone(),
        objects,
        settings: settings.engine.clone(),
        health: health.clone(),
        activities: activities.clone(),
        discovery: crds.as_ref().map(|(rx, _)| (discovery.clone(), rx.clone())),
        current: tokio::sync::Mutex::new(None),
    });
    let gate_stop = CancellationToken::new();
    let gate_task = tokio::spawn(gate.clone().drive(
        hub.clone(),
        settings.shutdown_grace,
        engines.clone(),
        gate_stop.clone(),
    ));
    engines.start().await;

    let mut tasks = JoinSet::new();
    tasks.spawn(async move { server.serve().await.map_err(crate::error::Error::from) });
    let admin_stop = serving.clone();
    tasks.spawn(async move {
        admin.serve(admin_stop).await;
        Ok(())
    });
    {
        let activities = activities.clone();
        let stop = serving.clone();
        tasks.spawn(async move {
            tokio::select! {
                e = activities.failed() => Err(e.into()),
                () = stop.cancelled() => Ok(()),
            }
        });
    }

    let failed = tokio::select! {
        () = shutdown.cancelled() => None,
        Some(joined) = tasks.join_next() => Some(joined),
    };
    gate_stop.cancel();
    let _ = gate_task.await;
    if failed.is_none() {
        drain(&hub, settings.shutdown_grace).await;
    }
    election_stop.cancel();
    if let Some(task) = elector
        && let Ok(mut elector) = task.await
    {
        elector.release().await;
    }
    engines.stop().await;
    if failed.is_none() {
        // Resource work is drained and the engine stopped: only cleanup handlers dispatch now.
        hub.set_paused(false);
        activities.cleanup(settings.shutdown_grace).await;
        hub.set_paused(true);
    }
    activities_stop.cancel();
    let _ = activities_task.await;
    if let Some((_, task)) = crds {
        let _ = task.await;
    }
    if let Some(peering) = peering {
        peering.stop().await;
    }
    serving.cancel();
    if let Some(joined) = failed {
        while tasks.join_next().await.is_some() {}
        return match joined {
            Ok(result) => result,
            Err(e) => {
                warn!(error = %e, "a controller task panicked");
                Ok(())
            }
        };
    }
    while let Some(joined) = tasks.join_next().await {
        if let Ok(Err(e)) = joined {
            warn!(error = %e, "a subsystem failed during shutdown");
        }
    }
    info!("capstan stopped");
    Ok(())
}

/// How long the start waits for the first peering decision before the engine starts.
const PEERING_FIRST_DECISION: Duration = Duration::from_secs(10);

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
    current: tokio::sync::Mutex<Option<(CancellationToken, JoinHandle<()>)>>,
}

impl Engines {
    async fn start(&self) {
        let mut current = self.current.lock().await;
        if current.is_none() {
            let stop = CancellationToken::new();
            let mut engine = Engine::new(
                self.hub.clone(),
                self.objects.clone(),
                self.settings.clone(),
                self.health.clone(),
            )
            .with_activities(self.activities.clone());
            if let Some((discovery, crds)) = &self.discovery {
                engine = engine.with_discovery(discovery.clone(), crds.clone());
            }
            *current = Some((stop.clone(), tokio::spawn(engine.run(stop))));
        }
    }

    async fn stop(&self) {
        let running = self.current.lock().await.take();
        if let Some((stop, task)) = running {
            stop.cancel();
            let _ = task.await;
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

/// Stops dispatch, tells handler processes to drain, and waits for in-flight work.
async fn drain(hub: &Hub, grace: Duration) {
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
}
