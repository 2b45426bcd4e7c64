//! Liveness and readiness as a set of named checks that other components register.
//!
//! Checks are closures evaluated when a probe arrives, so no component has to push its state
//! anywhere: the gRPC hub answers "is a handler process connected", watchers (later) answer
//! "is my watch alive". The controller is live when every liveness check passes and ready when
//! every readiness check passes.

use std::{collections::BTreeMap, sync::Arc};

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

/// The registry of checks. Cheap to clone.
#[derive(Clone, Default)]
pub struct Health {
    liveness: Arc<RwLock<BTreeMap<String, Probe>>>,
    readiness: Arc<RwLock<BTreeMap<String, Probe>>>,
}

/// A probe's answer: overall status and each check.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// Whether all checks pass.
    pub ok: bool,
    /// Each check by name.
    pub checks: BTreeMap<String, Check>,
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

    /// Evaluates the liveness checks.
    pub fn live(&self) -> Report {
        evaluate(&self.liveness.read())
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
}
