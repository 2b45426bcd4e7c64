//! The handlers the engine acts on: registrations of connected handler processes, kept while a
//! process is away.
//!
//! A handler process that restarts must not make its objects look unhandled: work for its
//! handlers waits until it is back. So a registration stays known after its connection drops,
//! and is retired only when handler processes are connected again and none of them registers
//! that handler id any more — the moment when, for example, a delete handler that was removed
//! from the code releases the finalizers it no longer needs.

use std::{collections::BTreeMap, sync::Arc};

use crate::model::{Registration, ResolvedResource};

/// Known registrations, in registration order.
#[derive(Debug, Default)]
pub struct Registry {
    known: Vec<Registration>,
}

impl Registry {
    /// Folds in the registrations of the currently connected processes.
    pub fn update(&mut self, connected: &[Registration]) {
        if !connected.is_empty() {
            self.known.retain(|k| connected.iter().any(|c| c.id == k.id));
        }
        for reg in connected {
            match self.known.iter_mut().find(|k| k.id == reg.id) {
                Some(k) => *k = reg.clone(),
                None => self.known.push(reg.clone()),
            }
        }
    }

    /// The known registrations grouped by resource, each group in registration order.
    pub fn by_resource(&self) -> BTreeMap<ResourceKey, Arc<Vec<Registration>>> {
        let mut groups: BTreeMap<ResourceKey, Vec<Registration>> = BTreeMap::new();
        for reg in &self.known {
            if let Some(resource) = &reg.resource {
                groups
                    .entry(ResourceKey::of(resource))
                    .or_default()
                    .push(reg.clone());
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
}
