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
    collections::{BTreeMap, HashMap, HashSet},
    sync::Arc,
};

use crate::model::{HandlerId, Registration, ResolvedResource, ResourceSelector};

/// Known registrations, in registration order.
#[derive(Debug, Default)]
pub struct Registry {
    known: Vec<Registration>,
    /// Run-time discovery results by selector: `None` when the resource is not served.
    resolved: HashMap<ResourceSelector, Option<ResolvedResource>>,
}

impl Registry {
    /// Folds in the registrations of the currently connected processes. Linear in the number
    /// of registrations.
    pub fn update(&mut self, connected: &[Registration]) {
        if !connected.is_empty() {
            // A handler may come with several selectors: keep exactly the connected ones.
            let keys: HashSet<(&HandlerId, Option<&ResourceSelector>)> =
                connected.iter().map(|c| (&c.id, c.selector.as_ref())).collect();
            self.known
                .retain(|k| keys.contains(&(&k.id, k.selector.as_ref())));
        }
        let mut at: HashMap<(HandlerId, Option<ResourceSelector>), usize> = self
            .known
            .iter()
            .enumerate()
            .map(|(i, k)| ((k.id.clone(), k.selector.clone()), i))
            .collect();
        for reg in connected {
            let key = (reg.id.clone(), reg.selector.clone());
            match at.get(&key).and_then(|&i| self.known.get_mut(i)) {
                Some(k) => *k = reg.clone(),
                None => {
                    at.insert(key, self.known.len());
                    self.known.push(reg.clone());
                }
            }
        }
    }

    /// Every known registration, in registration order.
    pub fn all(&self) -> &[Registration] {
        &self.known
    }

    /// The distinct selectors of the known registrations.
    pub fn selectors(&self) -> Vec<ResourceSelector> {
        let mut seen = HashSet::new();
        self.known
            .iter()
            .filter_map(|r| r.selector.as_ref())
            .filter(|s| seen.insert(*s))
            .cloned()
            .collect()
    }

    /// Selectors whose resource is not served (yet, or any more).
    pub fn pending(&self) -> Vec<ResourceSelector> {
        let mut seen = HashSet::new();
        self.known
            .iter()
            .filter(|r| r.selector.is_some() && self.effective(r).is_none())
            .filter_map(|r| r.selector.as_ref())
            .filter(|s| seen.insert(*s))
            .cloned()
            .collect()
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
        let mut seen: HashSet<(ResourceKey, &HandlerId)> = HashSet::new();
        for reg in &self.known {
            if let Some(resource) = self.effective(reg) {
                let key = ResourceKey::of(&resource);
                // Overlapping selectors of one handler: called once per event (kopf).
                if !seen.insert((key.clone(), &reg.id)) {
                    continue;
                }
                let mut reg = reg.clone();
                reg.resource = Some(resource);
                groups.entry(key).or_default().push(reg);
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
    fn updates_are_linear_in_the_number_of_registrations() {
        let many: Vec<Registration> = (0..50_000).map(|i| reg(&format!("h{i}"))).collect();
        let mut registry = Registry::default();
        let started = tokio::time::Instant::now();
        registry.update(&many);
        registry.update(&many);
        assert_eq!(registry.by_resource().values().next().unwrap().len(), 50_000);
        // Quadratic folding took minutes for this many; linear takes well under a second,
        // with room for a busy machine and a debug build.
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
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
