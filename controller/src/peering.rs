//! Peering, freezing and leader election: who among several operators may invoke handlers.
//!
//! Two mechanisms, one switch. **Priority peering** is kopf's: every operator announces its
//! identity, priority and lifetime in a peering object (`keepalive`) and pauses while a live
//! peer with a higher priority exists (`freeze`) — `capstan run --dev` (priority 666) and
//! `capstan freeze` (priority 100) pause production operators (priority 0) without touching
//! their Deployments. **Leader election** (`election`) is controller-runtime's: replicas of
//! one Deployment compete for a Lease and only the holder works. Both hold reasons in the
//! [`Gate`], which pauses dispatch and drains the handler processes while any reason is held;
//! watching never stops, so resuming is instant. `commands` implements `capstan freeze` and
//! `capstan resume` on the same objects.
//!
//! Scope follows kopf: an operator that watches the whole cluster uses the cluster-scoped
//! `ClusterCapstanPeering/<name>`; one that watches selected namespaces uses
//! `CapstanPeering/<name>` in each of them. (kopf pauses per namespace; Capstan has one
//! dispatch switch, so a freeze in any watched namespace pauses the operator.)
//!
//! Peering is used when its CRDs are installed. It is *required* — the operator refuses to
//! start without the CRDs — when it was asked for explicitly (`--peering`, `--priority`,
//! `--dev`): a developer who runs `--dev` must not believe production is frozen when it is
//! not. `--standalone` turns peering off.

pub mod commands;
pub mod election;
pub mod freeze;
pub mod gate;
pub mod keepalive;

use std::time::Duration;

use kube::Client;
use tokio::{sync::oneshot, task::JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, info, info_span, warn};

pub use gate::Gate;

use crate::k8s::peering::{self as api, Peerings, Target};

/// The priority of `--dev` (kopf's).
pub const DEV_PRIORITY: i64 = 666;
/// The default priority of `capstan freeze` (kopf's).
pub const FREEZE_PRIORITY: i64 = 100;

/// Why peering could not start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Peering was asked for but cannot work (CRDs missing, API refused).
    #[error("peering is required but unavailable")]
    Required(#[source] api::Error),
    /// Leader election settings are inconsistent.
    #[error("invalid leader election settings")]
    Election(#[from] election::Error),
}

/// Priority peering settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// No peering at all. Default off.
    pub standalone: bool,
    /// Refuse to start without the peering CRDs (set when peering was asked for explicitly).
    pub required: bool,
    /// The peering object's name. Default `default`.
    pub name: String,
    /// This operator's priority. Default 0; `--dev` is 666.
    pub priority: i64,
    /// How long this operator's entry stays alive without a keep-alive. Default 60 s; it is
    /// renewed every half lifetime.
    pub lifetime: Duration,
    /// This operator's identity; default `POD_NAME`, else `<hostname>@<pid>`.
    pub identity: Option<String>,
    /// The node of a per-node operator: peers on other nodes are not conflicts, another
    /// operator with the same node name is.
    pub node: Option<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            standalone: false,
            required: false,
            name: "default".into(),
            priority: 0,
            lifetime: Duration::from_secs(60),
            identity: None,
            node: None,
        }
    }
}

impl Settings {
    /// This operator's identity: the setting, else `POD_NAME`, else `<hostname>@<pid>`.
    pub fn identity(&self) -> String {
        self.identity
            .clone()
            .filter(|i| !i.is_empty())
            .or_else(|| std::env::var("POD_NAME").ok().filter(|n| !n.is_empty()))
            .unwrap_or_else(|| format!("{}@{}", hostname(), std::process::id()))
    }

    /// The peering objects of an operator watching `namespaces` (empty: the whole cluster).
    pub fn targets(&self, namespaces: &[String]) -> Vec<Target> {
        if namespaces.is_empty() {
            vec![Target::cluster(&self.name)]
        } else {
            namespaces
                .iter()
                .map(|ns| Target::namespaced(ns, &self.name))
                .collect()
        }
    }
}

/// The host's name, for identities (`/proc/sys/kernel/hostname`, `HOSTNAME`, `localhost`).
pub fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|h| h.trim().to_owned())
        .filter(|h| !h.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|h| !h.is_empty()))
        .unwrap_or_else(|| "localhost".into())
}

/// The running keep-alives of this operator.
pub struct Peering {
    tasks: JoinSet<()>,
    stop: CancellationToken,
}

impl Peering {
    /// Checks the CRDs, then starts one keep-alive per peering object and waits (up to
    /// `wait`) for their first decisions, so the operator does not start working in the
    /// moment before it learns that it is frozen. `None` when peering is off or unavailable
    /// and not required.
    ///
    /// # Errors
    /// [`Error::Required`] when peering is required and its CRDs are missing (or the API
    /// cannot tell).
    pub async fn start(
        settings: &Settings,
        client: Client,
        gate: &Gate,
        namespaces: &[String],
        lease: Option<String>,
        wait: Duration,
    ) -> Result<Option<Self>, Error> {
        if settings.standalone {
            info!("standalone: no peering");
            return Ok(None);
        }
        let peerings = Peerings::new(client);
        let targets = settings.targets(namespaces);
        if let Some(first) = targets.first()
            && let Err(e) = peerings.check_installed(first).await
        {
            if settings.required {
                return Err(Error::Required(e));
            }
            warn!(error = %crate::diagnostic::chain(&e), "running without peering: other operators cannot pause this one");
            return Ok(None);
        }
        let identity = settings.identity();
        let stop = CancellationToken::new();
        let mut tasks = JoinSet::new();
        let mut readies = Vec::new();
        for target in targets {
            let keepalive = keepalive::Keepalive {
                peerings: peerings.clone(),
                me: keepalive::Peer {
                    id: identity.clone(),
                    priority: settings.priority,
                    lifetime: settings.lifetime,
                    lastseen: std::time::SystemTime::now(),
                    message: None,
                    lease: lease.clone(),
                    node: settings.node.clone(),
                },
                gate: gate.clone(),
                target: target.clone(),
            };
            gate.hold(
                &keepalive.gate_key(),
                format!("peering: {target} not evaluated yet"),
            );
            let (tx, rx) = oneshot::channel();
            readies.push(rx);
            let span = info_span!("peering", peering = %target, peer = %identity);
            tasks.spawn(keepalive.run(tx, stop.clone()).instrument(span));
        }
        info!(
            identity,
            priority = settings.priority,
            lifetime = ?settings.lifetime,
            "peering started"
        );
        let _ = tokio::time::timeout(wait, futures::future::join_all(readies)).await;
        Ok(Some(Self { tasks, stop }))
    }

    /// Stops the keep-alives; each removes this operator's entry.
    pub async fn stop(mut self) {
        self.stop.cancel();
        while self.tasks.join_next().await.is_some() {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scope_follows_the_watched_namespaces() {
        let s = Settings::default();
        assert_eq!(s.targets(&[]), vec![Target::cluster("default")]);
        assert_eq!(
            s.targets(&["a".into(), "b".into()]),
            vec![
                Target::namespaced("a", "default"),
                Target::namespaced("b", "default")
            ]
        );
    }

    #[test]
    fn identities_are_explicit_or_host_and_pid() {
        let explicit = Settings {
            identity: Some("pod-1".into()),
            ..Settings::default()
        };
        assert_eq!(explicit.identity(), "pod-1");
        if std::env::var("POD_NAME").is_err() {
            let id = Settings::default().identity();
            assert!(id.ends_with(&format!("@{}", std::process::id())), "{id}");
        }
    }
}
