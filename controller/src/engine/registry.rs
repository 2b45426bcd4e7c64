//! The handlers the engine acts on: registrations of connected handler processes, kept while a
//! process is away.
//!
//! A handler process that restarts must not make its objects look unhandled: work for its
//! handlers waits until it is back. So a registration stays known after its connection drops,
//! and is retired only when handler processes are connected again and none of them registers
//! that handler id any more — the moment when, for example, a delete handler that was removed
//! from the code releases the finalizers it no longer needs.
//!
//! Resources can appear and disappear at run time (CRDs created or deleted after the
//! handshake, kopf §7.7): what discovery says *now* about a selector overrides what it said
//! at handshake time. A registration whose selector resolves to nothing is pending — kept,
//! not watched — until its resource is served again.

use std::{
    collections::{BTreeMap, HashMap},
    sync::Arc,
};

use crate::model::{Registration, ResolvedResource, ResourceSelector};

/// Known registrations, in registration order.
#[derive(Debug, Default)]
pub struct Registry {
    known: Vec<Registration>,
    /// Run-time discovery results by selector: `None` when the resource is not served.
    resolved: HashMap<ResourceSelector, Option<ResolvedResource>>,
}

impl Registry {
    /// Folds in the registrations of the currently connected processes.
    pub fn update(&mut self, connected: &[Registration]) {
        if !connected.is_empty() {
            // A handler may come with several selectors: keep exactly the connected ones.
            self.known
                .retain(|k| connected.iter().any(|c| c.id == k.id && c.selector == k.selector));
        }
        for reg in connected {
            match self
                .known
                .iter_mut()
                .find(|k| k.id == reg.id && k.selector == reg.selector)
            {
                Some(k) => *k = reg.clone(),
                None => self.known.push(reg.clone()),
            }
        }
    }

    /// Every known registration, in registration order.
    pub fn all(&self) -> &[Registration] {
        &self.known
    }

    /// The distinct selectors of the known registrations.
    pub fn selectors(&self) -> Vec<ResourceSelector> {
        let mut out: Vec<ResourceSelector> = Vec::new();
        for sel in self.known.iter().filter_map(|r| r.selector.as_ref()) {
            if !out.contains(sel) {
                out.push(sel.clone());
            }
        }
        out
    }

    /// Selectors whose resource is not served (yet, or any more).
    pub fn pending(&self) -> Vec<ResourceSelector> {
        self.known
            .iter()
            .filter(|r| r.selector.is_some() && self.effective(r).is_none())
            .filter_map(|r| r.selector.clone())
            .fold(Vec::new(), |mut out, s| {
                if !out.contains(&s) {
                    out.push(s);
                }
                out
            })
    }

    /// Records what run-time discovery found for `selector`; `true` when that changes what
    /// is watched.
    pub fn set_resolved(&mut self, selector: &ResourceSelector, resource: Option<ResolvedResource>) -> bool {
        let before: Vec<Option<ResolvedResource>> = self
            .known
            .iter()
            .filter(|r| r.selector.as_ref() == Some(selector))
            .map(|r| self.effective(r))
            .collect();
        self.resolved.insert(selector.clone(), resource);
        let after: Vec<Option<ResolvedResource>> = self
            .known
            .iter()
            .filter(|r| r.selector.as_ref() == Some(selector))
            .map(|r| self.effective(r))
            .collect();
        before != after
    }

    /// The resource a registration is served on now.
    fn effective(&self, reg: &Registration) -> Option<ResolvedResource> {
        match reg.selector.as_ref().and_then(|s| self.resolved.get(s)) {
            Some(now) => now.clone(),
            None => reg.resource.clone(),
        }
    }

    /// The known registrations grouped by resource, each group in registration order.
    pub fn by_resource(&self) -> BTreeMap<ResourceKey, Arc<Vec<Registration>>> {
        let mut groups: BTreeMap<ResourceKey, Vec<Registration>> = BTreeMap::new();
        for reg in &self.known {
            if let Some(resource) = self.effective(reg) {
                let mut reg = reg.clone();
                let key = ResourceKey::of(&resource);
                reg.resource = Some(resource);
                let group = groups.entry(key).or_default();
                // Overlapping selectors of one handler: called once per event (kopf).
                if !group.iter().any(|r| r.id == reg.id) {
                    group.push(reg);
                }
            }
        }
        groups.into_iter().map(|(k, v)| (k, Arc::new(v))).collect()
    }
}

/// Orders resources for deterministic maps.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ResourceKey {
    /// Group.
    pub group: String,
    /// Version.
    pub version: String,
    /// Plural.
    pub plural: String,
}

impl ResourceKey {
    /// The key of a resource.
    pub fn of(r: &ResolvedResource) -> Self {
        Self {
            group: r.group.clone(),
            version: r.version.clone(),
            plural: r.plural.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::HandlerKind;

    fn reg(id: &str) -> Registration {
        let mut r = Registration::new(id, HandlerKind::Create, None);
        r.resource = Some(ResolvedResource {
            plural: "examples".into(),
            ..Default::default()
        });
        r
    }

    #[test]
    fn registrations_survive_disconnects_and_retire_on_reconnect() {
        let mut registry = Registry::default();
        registry.update(&[reg("a"), reg("d")]);
        registry.update(&[]);
        assert_eq!(
            registry.by_resource().values().next().unwrap().len(),
            2,
            "kept while nobody is connected"
        );
        registry.update(&[reg("a")]);
        let ids: Vec<_> = registry
            .by_resource()
            .values()
            .next()
            .unwrap()
            .iter()
            .map(|r| r.id.0.clone())
            .collect();
        assert_eq!(ids, ["a"]);
    }

    #[test]
    fn run_time_discovery_overrides_the_handshake() {
        let selector = ResourceSelector {
            name: "examples".into(),
            ..Default::default()
        };
        let mut pending = Registration::new("p", HandlerKind::Create, Some(selector.clone()));
        pending.resource = None;
        let mut registry = Registry::default();
        registry.update(&[pending]);
        assert!(registry.by_resource().is_empty());
        assert_eq!(registry.pending(), std::slice::from_ref(&selector));
        let served = ResolvedResource {
            plural: "examples".into(),
            ..Default::default()
        };
        assert!(registry.set_resolved(&selector, Some(served.clone())));
        assert!(!registry.set_resolved(&selector, Some(served)), "no change");
        let groups = registry.by_resource();
        let group = groups.values().next().unwrap();
        assert_eq!(group[0].resource.as_ref().unwrap().plural, "examples");
        assert!(registry.pending().is_empty());
        assert!(registry.set_resolved(&selector, None), "the CRD went away");
        assert!(registry.by_resource().is_empty());
    }
}
