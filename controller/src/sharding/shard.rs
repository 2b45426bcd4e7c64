//! The shard: what this member handles now, read by the engine for every object it receives.
//!
//! The hand-over (`sharding::handover`) is the only writer: it narrows the held ranges before
//! it acknowledges a ring change and widens them only once every other member acknowledged.
//! The engine asks [`Shard::holds`] as objects arrive from a watch and keeps nothing for the
//! others (no body, no slot): the ranges are the filter a server with KEP-5866 would apply.
//! Index handlers see every object (kopf's indexes are over all objects), so the indexer's
//! watch is not filtered.

use std::sync::Arc;

use parking_lot::RwLock;

use super::ring::{Ranges, place};

/// The most ranges put into a shard selector: a request URI holds at most 64 KiB (about 600
/// ranges, percent-encoded). A member holds 512 × (1 − 1/n) ranges of a ring of n (one per
/// token whose predecessor is another member's); more than this (rings of more than about 40
/// members), and the watches ask for everything and filter on arrival.
const MAX_SELECTOR_RANGES: usize = 500;

/// The held ranges, shared between the hand-over and the engine. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Shard {
    held: Arc<RwLock<Arc<Ranges>>>,
    member: Arc<str>,
}

impl Shard {
    /// A shard that holds nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// The shard of the member `identity`, holding nothing yet.
    pub fn of(identity: &str) -> Self {
        Self {
            held: Arc::default(),
            member: identity.into(),
        }
    }

    /// The member's identity.
    pub fn member(&self) -> &str {
        &self.member
    }

    /// Whether the object with `uid` is this member's now. An object without a uid (never
    /// sent by a real API server) is nobody's.
    pub fn holds(&self, uid: &str) -> bool {
        !uid.is_empty() && self.held.read().contains(place(uid))
    }

    /// Whether an object body (a watch event's) is this member's.
    pub fn holds_object(&self, body: &serde_json::Value) -> bool {
        self.holds(
            body.pointer("/metadata/uid")
                .and_then(serde_json::Value::as_str)
                .unwrap_or_default(),
        )
    }

    /// The ranges held now.
    pub fn held(&self) -> Arc<Ranges> {
        self.held.read().clone()
    }

    /// The held ranges as KEP-5866's shard selector (`shardRange(object.metadata.uid, …) ||
    /// …`), for a server that filters by shard; `None` when nothing or everything is held
    /// (no useful filter).
    pub fn selector(&self) -> Option<String> {
        let held = self.held();
        if held.is_empty() || *held == Ranges::all() || held.len() > MAX_SELECTOR_RANGES {
            return None;
        }
        Some(
            held.bounds()
                .map(|(start, end)| format!("shardRange(object.metadata.uid, '{start}', '{end}')"))
                .collect::<Vec<_>>()
                .join(" || "),
        )
    }

    /// Replaces the held ranges.
    pub(super) fn set(&self, ranges: Ranges) {
        *self.held.write() = Arc::new(ranges);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_what_it_was_given() {
        let shard = Shard::new();
        assert!(!shard.holds("5f0c"));
        shard.set(Ranges::all());
        assert!(shard.holds("5f0c"));
        assert!(!shard.holds(""), "an object without a uid is nobody's");
        assert!(shard.holds_object(&serde_json::json!({"metadata": {"uid": "5f0c"}})));
        assert!(!shard.holds_object(&serde_json::json!({"metadata": {}})));
        assert_eq!(shard.selector(), None, "everything needs no filter");
    }

    #[test]
    fn selectors_name_the_held_ranges() {
        let shard = Shard::of("a");
        let ring = super::super::ring::Ring::new(["a", "b"]);
        shard.set(ring.assigned("a"));
        let selector = shard.selector().expect("a selector");
        assert!(
            selector.starts_with("shardRange(object.metadata.uid, '0x"),
            "{selector}"
        );
        assert_eq!(selector.matches("shardRange(").count(), ring.assigned("a").len());
    }
}
