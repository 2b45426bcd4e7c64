//! Handler filters: the declarative ones the controller evaluates, and `when`, the callable one
//! that only the SDK can evaluate.
//!
//! Declarative filters (labels, annotations, field value, old/new) travel in the registration so
//! the controller can drop non-matching objects without a round trip. A `when` closure stays in
//! the process: the registration only says `sdk_when`, and the dispatch module answers `Skipped`
//! when the closure says no. The test kit evaluates the declarative filters too, the way the
//! controller would, so handler tests see the same selection.

use std::sync::Arc;

use serde_json::Value;

use crate::{Context, convert, pb};

/// Whether a label, annotation or field must exist (kopf's `PRESENT` / `ABSENT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Presence {
    /// The key or field must exist, with any value.
    Present,
    /// The key or field must not exist.
    Absent,
}

impl Presence {
    fn to_pb(self) -> pb::Presence {
        match self {
            Self::Present => pb::Presence::Present,
            Self::Absent => pb::Presence::Absent,
        }
    }
}

/// A condition on one label or annotation.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum MetaFilter {
    /// The key must exist with exactly this value.
    Equals(String),
    /// The key must exist or not exist.
    Presence(Presence),
}

impl From<&str> for MetaFilter {
    fn from(value: &str) -> Self {
        Self::Equals(value.to_owned())
    }
}

impl From<String> for MetaFilter {
    fn from(value: String) -> Self {
        Self::Equals(value)
    }
}

impl From<Presence> for MetaFilter {
    fn from(presence: Presence) -> Self {
        Self::Presence(presence)
    }
}

impl MetaFilter {
    pub(crate) fn to_pb(&self) -> pb::MetaMatch {
        let condition = match self {
            Self::Equals(value) => pb::meta_match::Condition::Equals(value.clone()),
            Self::Presence(p) => pb::meta_match::Condition::Presence(p.to_pb() as i32),
        };
        pb::MetaMatch {
            condition: Some(condition),
        }
    }
}

/// A condition on one field's value.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ValueFilter {
    /// The field must exist and equal this JSON value.
    Equals(Value),
    /// The field must exist or not exist.
    Presence(Presence),
}

impl From<Value> for ValueFilter {
    fn from(value: Value) -> Self {
        Self::Equals(value)
    }
}

impl From<&str> for ValueFilter {
    fn from(value: &str) -> Self {
        Self::Equals(Value::from(value))
    }
}

impl From<i64> for ValueFilter {
    fn from(value: i64) -> Self {
        Self::Equals(Value::from(value))
    }
}

impl From<bool> for ValueFilter {
    fn from(value: bool) -> Self {
        Self::Equals(Value::from(value))
    }
}

impl From<Presence> for ValueFilter {
    fn from(presence: Presence) -> Self {
        Self::Presence(presence)
    }
}

impl ValueFilter {
    pub(crate) fn to_pb(&self) -> pb::ValueMatch {
        let condition = match self {
            Self::Equals(value) => pb::value_match::Condition::Equals(convert::json_to_pb(value)),
            Self::Presence(p) => pb::value_match::Condition::Presence(p.to_pb() as i32),
        };
        pb::ValueMatch {
            condition: Some(condition),
        }
    }
}

/// A callable filter (kopf's `when=`), evaluated by the SDK before the handler runs.
pub(crate) type WhenFn = Arc<dyn Fn(&Context) -> bool + Send + Sync>;

/// Looks up a dotted field path (`spec.items`) in a JSON document.
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
pub(crate) fn lookup<'a>(doc: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.')
        .filter(|s| !s.is_empty())
        .try_fold(doc, |node, key| node.get(key))
}

/// Evaluates a wire `MetaMatch` against an optional value.
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
pub(crate) fn meta_matches(condition: &pb::MetaMatch, value: Option<&str>) -> bool {
    match &condition.condition {
        Some(pb::meta_match::Condition::Equals(expected)) => value == Some(expected.as_str()),
        Some(pb::meta_match::Condition::Presence(p)) => presence_matches(*p, value.is_some()),
        None => true,
    }
}

/// Evaluates a wire `ValueMatch` against an optional value.
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
pub(crate) fn value_matches(condition: &pb::ValueMatch, value: Option<&Value>) -> bool {
    match &condition.condition {
        Some(pb::value_match::Condition::Equals(expected)) => {
            match (convert::json_from_pb(Some(expected)), value) {
                (Ok(Some(expected)), Some(value)) => &expected == value,
                _ => false,
            }
        }
        Some(pb::value_match::Condition::Presence(p)) => presence_matches(*p, value.is_some()),
        None => true,
    }
}

fn presence_matches(presence: i32, exists: bool) -> bool {
    match pb::Presence::try_from(presence) {
        Ok(pb::Presence::Present) => exists,
        Ok(pb::Presence::Absent) => !exists,
        _ => true,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn meta_filters_match_like_kopf() {
        let equals = MetaFilter::from("yes").to_pb();
        assert!(meta_matches(&equals, Some("yes")));
        assert!(!meta_matches(&equals, Some("no")));
        assert!(!meta_matches(&equals, None));
        let absent = MetaFilter::from(Presence::Absent).to_pb();
        assert!(meta_matches(&absent, None));
        assert!(!meta_matches(&absent, Some("x")));
    }

    #[test]
    fn value_filters_compare_json() {
        let doc = json!({"spec": {"size": 3, "items": ["a"]}});
        let three = ValueFilter::from(3_i64).to_pb();
        assert!(value_matches(&three, lookup(&doc, "spec.size")));
        assert!(!value_matches(&three, lookup(&doc, "spec.items")));
        let present = ValueFilter::from(Presence::Present).to_pb();
        assert!(value_matches(&present, lookup(&doc, "spec.items")));
        assert!(!value_matches(&present, lookup(&doc, "spec.missing")));
    }
}
