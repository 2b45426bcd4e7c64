//! The essence of an object: the part whose changes handlers react to.
//!
//! As in kopf: the body without `apiVersion`, `kind`, `metadata` and `status`, plus labels and
//! annotations back — except the annotations of Capstan's own storage, of any other operator
//! (any prefix that carries a `<prefix>/kopf-managed` marker, or kopf's own prefixes), and
//! `kubectl.kubernetes.io/last-applied-configuration` — plus every field a handler's `field`
//! points at (which is how a handler on `status.phase` sees status changes). Empty stanzas are
//! dropped. Finalizers, owner references, generation, resource versions and managed fields
//! never appear, so Capstan's own writes are never mistaken for changes.

use std::collections::BTreeSet;

use serde_json::{Map, Value};

/// The marker annotation suffix by which operators recognise each other's prefixes.
pub const MANAGED_MARKER: &str = "kopf-managed";

/// kubectl's annotation, never part of the essence.
pub const LAST_APPLIED: &str = "kubectl.kubernetes.io/last-applied-configuration";

/// What to leave out of (and add to) essences.
#[derive(Clone, Debug, Default)]
pub struct Rules {
    /// Our own annotation prefix.
    pub prefix: String,
    /// Extra field paths to keep (handlers' `field`s), e.g. `["status", "phase"]`.
    pub extra_fields: Vec<Vec<String>>,
}

impl Rules {
    /// Builds the essence of `body`.
    pub fn essence(&self, body: &Value) -> Value {
        let mut essence = Map::new();
        if let Some(obj) = body.as_object() {
            for (k, v) in obj {
                if !matches!(k.as_str(), "apiVersion" | "kind" | "metadata" | "status") {
                    essence.insert(k.clone(), v.clone());
                }
            }
        }
        let mut metadata = Map::new();
        if let Some(labels) = body.pointer("/metadata/labels").and_then(Value::as_object)
            && !labels.is_empty()
        {
            metadata.insert("labels".into(), Value::Object(labels.clone()));
        }
        if let Some(annotations) = body.pointer("/metadata/annotations").and_then(Value::as_object) {
            let foreign = operator_prefixes(annotations);
            let kept: Map<String, Value> = annotations
                .iter()
                .filter(|(k, _)| k.as_str() != LAST_APPLIED)
                .filter(|(k, _)| {
                    let prefix = k.split_once('/').map(|(p, _)| p).unwrap_or("");
                    prefix != self.prefix && !foreign.contains(prefix)
                })
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            if !kept.is_empty() {
                metadata.insert("annotations".into(), Value::Object(kept));
            }
        }
        if !metadata.is_empty() {
            essence.insert("metadata".into(), Value::Object(metadata));
        }
        let mut essence = Value::Object(essence);
        for path in &self.extra_fields {
            if matches!(
                path.first().map(String::as_str),
                Some("metadata" | "apiVersion" | "kind")
            ) {
                continue;
            }
            if let Some(value) = lookup(body, path) {
                set(&mut essence, path, value.clone());
            }
        }
        drop_empty(&mut essence);
        essence
    }
}

/// Prefixes that belong to operators (ours or others), by their markers and kopf's names.
fn operator_prefixes(annotations: &Map<String, Value>) -> BTreeSet<&str> {
    annotations
        .keys()
        .filter_map(|k| k.split_once('/'))
        .filter(|(prefix, name)| {
            *name == MANAGED_MARKER || *prefix == "kopf.zalando.org" || prefix.ends_with(".kopf.zalando.org")
        })
        .map(|(prefix, _)| prefix)
        .collect()
}

/// The value at `path`, if present.
pub fn lookup<'a>(value: &'a Value, path: &[String]) -> Option<&'a Value> {
    path.iter().try_fold(value, |v, key| v.as_object()?.get(key))
}

fn set(value: &mut Value, path: &[String], new: Value) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut current = value;
    for key in parents {
        if !current.is_object() {
            *current = Value::Object(Map::new());
        }
        let Some(map) = current.as_object_mut() else {
            return;
        };
        current = map
            .entry(key.clone())
            .or_insert_with(|| Value::Object(Map::new()));
    }
    if !current.is_object() {
        *current = Value::Object(Map::new());
    }
    if let Some(map) = current.as_object_mut() {
        map.insert(last.clone(), new);
    }
}

fn drop_empty(value: &mut Value) {
    if let Some(map) = value.as_object_mut() {
        for v in map.values_mut() {
            drop_empty(v);
        }
        map.retain(|_, v| !v.as_object().is_some_and(Map::is_empty));
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn rules() -> Rules {
        Rules {
            prefix: "capstan.dev".into(),
            extra_fields: vec![vec!["status".into(), "phase".into()]],
        }
    }

    #[test]
    fn keeps_spec_labels_foreign_annotations_and_extra_fields() {
        let body = json!({
            "apiVersion": "demo.capstan.dev/v1", "kind": "Example",
            "metadata": {
                "name": "x", "uid": "u", "resourceVersion": "5", "generation": 2, "finalizers": ["a"],
                "managedFields": [{}], "labels": {"app": "a"},
                "annotations": {
                    "team": "blue",
                    "capstan.dev/create_fn": "{}",
                    "capstan.dev/last-handled-configuration": "{}",
                    "node-1.capstan.dev/kopf-managed": "yes",
                    "node-1.capstan.dev/create_fn": "{}",
                    "kopf.zalando.org/create_fn": "{}",
                    "kubectl.kubernetes.io/last-applied-configuration": "{}"
                }
            },
            "spec": {"size": 1, "empty": {}},
            "status": {"phase": "Running", "other": 1}
        });
        assert_eq!(
            rules().essence(&body),
            json!({
                "spec": {"size": 1},
                "metadata": {"labels": {"app": "a"}, "annotations": {"team": "blue"}},
                "status": {"phase": "Running"}
            })
        );
    }

    #[test]
    fn our_own_writes_do_not_change_the_essence() {
        let before = json!({"metadata": {"name": "x"}, "spec": {"a": 1}});
        let after = json!({
            "metadata": {"name": "x", "finalizers": ["capstan.dev/finalizer"], "resourceVersion": "9",
                         "annotations": {"capstan.dev/create_fn": "{}"}},
            "spec": {"a": 1}, "status": {"create_fn": {"message": "hi"}}
        });
        let rules = Rules {
            prefix: "capstan.dev".into(),
            extra_fields: vec![],
        };
        assert_eq!(rules.essence(&before), rules.essence(&after));
    }
}
