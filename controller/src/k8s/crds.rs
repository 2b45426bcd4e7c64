//! Watches CustomResourceDefinitions so that resources can appear and disappear while the
//! controller runs (kopf §7.7: "watches CRDs; any CRD event rescans").
//!
//! Only what matters for discovery is reported: a CRD becoming `Established`, or one being
//! deleted. Subscribers get a counter that moves on every such change and re-run discovery;
//! this module does not resolve anything itself, so the rules for selectors stay in one place
//! (`discovery`). A missing permission to watch CRDs is logged once, then retried quietly
//! with backoff: everything that was resolvable at handshake time keeps working.

use std::collections::BTreeMap;

use futures::StreamExt as _;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::{
    Api, Client,
    runtime::{WatchStreamExt as _, watcher},
};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

/// The CRD watcher's view: established CRDs by name, and a change counter.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Snapshot {
    /// Bumped on every relevant change (after the initial listing too).
    pub generation: u64,
    /// Established CRDs: `<plural>.<group>`.
    pub established: std::collections::BTreeSet<String>,
}

/// Whether a CRD is established (its resource is served).
fn established(crd: &CustomResourceDefinition) -> bool {
    crd.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Established" && c.status == "True"))
}

fn name_of(crd: &CustomResourceDefinition) -> String {
    crd.metadata.name.clone().unwrap_or_default()
}

/// Follows the CRDs of the cluster until `cancel` fires.
pub struct Crds {
    client: Client,
}

impl Crds {
    /// A watcher over `client`.
    pub fn new(client: Client) -> Self {
        Self { client }
    }

    /// Runs the watch, publishing to `tx`.
    pub async fn run(self, tx: watch::Sender<Snapshot>, cancel: CancellationToken) {
        let api: Api<CustomResourceDefinition> = Api::all(self.client);
        let mut stream = watcher(api, watcher::Config::default()).default_backoff().boxed();
        let mut state: BTreeMap<String, bool> = BTreeMap::new();
        let mut listing: BTreeMap<String, bool> = BTreeMap::new();
        let mut failures = 0u32;
        loop {
            let event = tokio::select! {
                () = cancel.cancelled() => return,
                event = stream.next() => match event {
                    Some(e) => e,
                    None => return,
                },
            };
            let changed = match event {
                Ok(watcher::Event::Init) => {
                    listing.clear();
                    false
                }
                Ok(watcher::Event::InitApply(crd)) => {
                    listing.insert(name_of(&crd), established(&crd));
                    false
                }
                Ok(watcher::Event::InitDone) => {
                    failures = 0;
                    let fresh = std::mem::take(&mut listing);
                    let changed = fresh != state || tx.borrow().generation == 0;
                    state = fresh;
                    changed
                }
                Ok(watcher::Event::Apply(crd)) => {
                    failures = 0;
                    let name = name_of(&crd);
                    let now = established(&crd);
                    let before = state.insert(name.clone(), now);
                    if now && before != Some(true) {
                        info!(crd = %name, "custom resource definition established");
                    }
                    before != Some(now)
                }
                Ok(watcher::Event::Delete(crd)) => {
                    let name = name_of(&crd);
                    info!(crd = %name, "custom resource definition deleted");
                    state.remove(&name).is_some()
                }
                Err(e) => {
                    failures += 1;
                    if failures == 1 {
                        warn!(error = %e, "watching custom resource definitions failed; resources created later may not be picked up until it works");
                    } else {
                        debug!(error = %e, failures, "watching custom resource definitions still fails");
                    }
                    false
                }
            };
            if changed {
                let established = state
                    .iter()
                    .filter(|(_, e)| **e)
                    .map(|(n, _)| n.clone())
                    .collect();
                tx.send_modify(|s| {
                    s.generation += 1;
                    s.established = established;
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn established_needs_the_condition() {
        let mut crd: CustomResourceDefinition = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "examples.demo.capstan.dev"},
            "spec": {"group": "demo.capstan.dev", "names": {"plural": "examples", "kind": "Example"},
                     "scope": "Namespaced", "versions": []},
        }))
        .unwrap();
        assert!(!established(&crd));
        crd.status = serde_json::from_value(serde_json::json!({
            "conditions": [{"type": "Established", "status": "True"}]
        }))
        .unwrap();
        assert!(established(&crd));
        assert_eq!(name_of(&crd), "examples.demo.capstan.dev");
    }
}
