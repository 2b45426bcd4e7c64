//! Liveness and readiness as a set of named checks that other components register.
//!
//! Checks are closures evaluated when a probe arrives, so no component has to push its state
//! anywhere: the gRPC hub answers "is a handler process connected", watches answer "is my
//! watch alive". The controller is live when every liveness check passes and ready when
//! every readiness check (and every liveness check) passes.
//!
//! # Liveness and readiness
//!
//! The two answer different questions, and the kubelet acts differently on them: a failing
//! liveness probe restarts the container, a failing readiness probe only marks the pod not
//! ready. So:
//!
//! - **Liveness** (`/healthz`) says whether *this process* works: its watches are not refused
//!   by the API server and their loops keep moving (`k8s::watch::Status::problem`), its probe
//!   handlers answer. It never fails only because the API server is unreachable — a restart
//!   does not bring a control plane back, and an outage would otherwise restart every operator
//!   pod at once.
//! - **Readiness** (`/readyz`) says whether the controller can do its work now: a handler
//!   process is connected, the watches have listed, operator activities (login, startup) are
//!   done, and the API server answers (`api-server`, fed by `k8s::reachability`). Each failing
//!   check carries its reason.
//!
//! Probe handlers (kopf `on.probe`) add values rather than checks: `/healthz` shows each
//! probe id with its last result, as kopf's liveness endpoint does. The provider of those
//! values answers from a cache; when the cache is older than its time, `/healthz` asks for a
//! new run and waits for it at most [`FRESH_WAIT`] (as kopf runs stale probes before it
//! answers), then answers with what it has — within the kubelet's probe timeout, whatever the
//! probe handlers do.

use std::{collections::BTreeMap, sync::Arc, time::Duration};

use futures::future::BoxFuture;
use parking_lot::RwLock;
use serde::Serialize;

/// The result of one check.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    /// Whether it passes.
    pub ok: bool,
    /// A short explanation.
    pub message: String,
}

impl Check {
    /// A passing check.
    pub fn pass(message: impl Into<String>) -> Self {
        Self {
            ok: true,
            message: message.into(),
        }
    }

    /// A failing check.
    pub fn fail(message: impl Into<String>) -> Self {
        Self {
            ok: false,
            message: message.into(),
        }
    }
}

type Probe = Arc<dyn Fn() -> Check + Send + Sync>;
type Values = Arc<dyn Fn() -> BTreeMap<String, serde_json::Value> + Send + Sync>;
type Refresh = Arc<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync>;

/// How long `/healthz` waits for probe handlers whose results are stale (below the chart's
/// and the kubelet's probe timeouts).
pub const FRESH_WAIT: Duration = Duration::from_secs(1);

/// The registry of checks. Cheap to clone.
#[derive(Clone, Default)]
pub struct Health {
    liveness: Arc<RwLock<BTreeMap<String, Probe>>>,
    readiness: Arc<RwLock<BTreeMap<String, Probe>>>,
    probes: Arc<RwLock<Option<Values>>>,
    refresh: Arc<RwLock<Option<Refresh>>>,
}

/// A probe's answer: overall status and each check.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Whether all checks pass.
    pub ok: bool,
    /// Each check by name.
    pub checks: BTreeMap<String, Check>,
    /// The results of probe handlers by handler id (liveness only).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub probes: BTreeMap<String, serde_json::Value>,
}

impl Health {
    /// Registers (or replaces) a liveness check.
    pub fn liveness(&self, name: &str, check: impl Fn() -> Check + Send + Sync + 'static) {
        self.liveness.write().insert(name.to_owned(), Arc::new(check));
    }

    /// Registers (or replaces) a readiness check.
    pub fn readiness(&self, name: &str, check: impl Fn() -> Check + Send + Sync + 'static) {
        self.readiness.write().insert(name.to_owned(), Arc::new(check));
    }

    /// Removes a check of either kind.
    pub fn remove(&self, name: &str) {
        self.liveness.write().remove(name);
        self.readiness.write().remove(name);
    }

    /// Sets the provider of probe handler results shown with liveness; it must not block.
    pub fn probe_values(
        &self,
        values: impl Fn() -> BTreeMap<String, serde_json::Value> + Send + Sync + 'static,
    ) {
        *self.probes.write() = Some(Arc::new(values));
    }

    /// Sets what brings stale probe results up to date: it resolves once they are (or at
    /// once when they are not stale).
    pub fn probe_refresh(&self, refresh: impl Fn() -> BoxFuture<'static, ()> + Send + Sync + 'static) {
        *self.refresh.write() = Some(Arc::new(refresh));
    }

    /// Evaluates the liveness checks, with probe results brought up to date first when they
    /// are stale and the probes answer within [`FRESH_WAIT`].
    pub async fn live_fresh(&self) -> Report {
        let refresh = self.refresh.read().clone();
        if let Some(refresh) = refresh {
            let _ = tokio::time::timeout(FRESH_WAIT, refresh()).await;
        }
        self.live()
    }

    /// Evaluates the liveness checks.
    pub fn live(&self) -> Report {
        let mut report = evaluate(&self.liveness.read());
        let values = self.probes.read().clone();
        if let Some(values) = values {
            report.probes = values();
        }
        report
    }

    /// Evaluates the readiness checks (liveness failures make it not ready too).
    pub fn ready(&self) -> Report {
        let mut report = evaluate(&self.readiness.read());
        let live = self.live();
        if !live.ok {
            report.ok = false;
            report
                .checks
                .extend(live.checks.into_iter().filter(|(_, c)| !c.ok));
        }
        report
    }
}

fn evaluate(probes: &BTreeMap<String, Probe>) -> Report {
    let checks: BTreeMap<String, Check> = probes
        .iter()
        .map(|(name, probe)| (name.clone(), probe()))
        .collect();
    Report {
        ok: checks.values().all(|c| c.ok),
        checks,
        probes: BTreeMap::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_only_when_all_checks_pass() {
        let health = Health::default();
        assert!(health.ready().ok, "no checks means ready");
        health.readiness("handlers", || Check::fail("no handler process connected"));
        assert!(!health.ready().ok);
        health.readiness("handlers", || Check::pass("1 connected"));
        health.liveness("watch", || Check::fail("hung"));
        let ready = health.ready();
        assert!(!ready.ok);
        assert!(ready.checks.contains_key("watch"));
    }

    #[test]
    fn liveness_shows_probe_values() {
        let health = Health::default();
        assert!(health.live().probes.is_empty());
        health.probe_values(|| BTreeMap::from([("probe_fn".to_owned(), serde_json::json!({"x": 1}))]));
        let live = health.live();
        assert_eq!(live.probes["probe_fn"]["x"], 1);
        assert!(!health.ready().probes.contains_key("probe_fn"));
    }
}
