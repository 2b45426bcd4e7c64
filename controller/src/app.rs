//! Wires the controller together and owns its lifecycle: builds the API client and discovery,
//! the hub, the engine, the gRPC server and the admin endpoint, runs them until the root token is
//! cancelled, then drains: no new invocations, `Drain` to every handler process, in-flight work
//! given the shutdown grace (and its outcomes written), then the engine and the servers stop.

use std::{sync::Arc, time::Duration};

use capstan_proto::pb;
use futures::future::BoxFuture;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::{
    config::Settings,
    engine::Engine,
    error::Result,
    grpc::{self, Hub},
    k8s,
    model::{Diagnostic, ResolvedResource, ResourceSelector},
    observability::{
        admin::Admin,
        health::{Check, Health},
    },
};

/// Resolves registration selectors through API discovery.
struct DiscoveryResolver(k8s::discovery::Discovery);

impl grpc::Resolver for DiscoveryResolver {
    fn resolve<'a>(
        &'a self,
        selector: &'a ResourceSelector,
    ) -> BoxFuture<'a, Result<ResolvedResource, Diagnostic>> {
        Box::pin(async move {
            self.0.resolve(selector).await.map_err(|e| {
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
/// When a subsystem cannot start (no cluster configuration, address in use) or fails.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> Result<()> {
    let client = k8s::client::connect().await?;
    let objects = k8s::objects::Objects::new(client.clone());
    let resolver = Arc::new(DiscoveryResolver(k8s::discovery::Discovery::new(
        client,
        settings.discovery_ttl,
    )));
    let hub = Hub::new(settings.hub.clone());
    let health = Health::default();
    {
        let hub = hub.clone();
        health.readiness("handler-processes", move || match hub.connections() {
            0 => Check::fail("no handler process is connected"),
            n => Check::pass(format!("{n} handler process(es) connected")),
        });
    }
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

    let engine_stop = CancellationToken::new();
    let engine = Engine::new(hub.clone(), objects, settings.engine.clone(), health.clone());
    let engine_task = tokio::spawn(engine.run(engine_stop.clone()));

    let mut tasks = JoinSet::new();
    tasks.spawn(async move { server.serve().await.map_err(crate::error::Error::from) });
    let admin_stop = serving.clone();
    tasks.spawn(async move {
        admin.serve(admin_stop).await;
        Ok(())
    });

    let failed = tokio::select! {
        () = shutdown.cancelled() => None,
        Some(joined) = tasks.join_next() => Some(joined),
    };
    if let Some(joined) = failed {
        engine_stop.cancel();
        let _ = engine_task.await;
        serving.cancel();
        while tasks.join_next().await.is_some() {}
        return match joined {
            Ok(result) => result,
            Err(e) => {
                warn!(error = %e, "a controller task panicked");
                Ok(())
            }
        };
    }
    drain(&hub, settings.shutdown_grace).await;
    engine_stop.cancel();
    let _ = engine_task.await;
    serving.cancel();
    while let Some(joined) = tasks.join_next().await {
        if let Ok(Err(e)) = joined {
            warn!(error = %e, "a subsystem failed during shutdown");
        }
    }
    info!("capstan stopped");
    Ok(())
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
