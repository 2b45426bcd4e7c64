//! The essence of an object: the part whose changes handlers react to.
//!
//! Built exactly as kopf builds it, so that the diff-base of one is the essence of the other
//! in kopf-compatible mode: the body without `apiVersion`, `kind`, `metadata` and `status`;
//! labels and annotations back — except the annotations of any operator (any prefix that
//! carries a `<prefix>/kopf-managed` marker, or kopf's own prefixes) and
//! `kubectl.kubernetes.io/last-applied-configuration`; every field a handler's `field` points
//! at (which is how a handler on `status.phase` sees status changes); then the annotations of
//! Capstan's own storage (its prefix, the diff-base key) removed. Only empty `labels`,
//! `annotations`, `metadata` and `status` stanzas are dropped; an empty object or list in the
//! spec is part of the essence, as in kopf. Finalizers, owner references, generation,
//! resource versions and managed fields never appear (unless a handler's `field` asks for
//! them), so Capstan's own writes are never mistaken for changes.

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
    /// Our own diff-base annotation key, when it is kept in an annotation (it may be outside
    /// the prefix).
    pub diffbase_key: Option<String>,
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
        if let Some(labels) = body.pointer("/metadata/labels") {
            metadata.insert("labels".into(), labels.clone());
        }
        if let Some(annotations) = body.pointer("/metadata/annotations") {
            let mut annotations = annotations.clone();
            if let Some(map) = annotations.as_object_mut() {
                let foreign: BTreeSet<String> =
                    operator_prefixes(map).into_iter().map(str::to_owned).collect();
                map.retain(|k, _| k != LAST_APPLIED && !foreign.contains(prefix_of(k)));
            }
            metadata.insert("annotations".into(), annotations);
        }
        if !metadata.is_empty() {
            essence.insert("metadata".into(), Value::Object(metadata));
        }
        let mut essence = Value::Object(essence);
        for path in &self.extra_fields {
            if let Some(value) = lookup(body, path) {
                set(&mut essence, path, value.clone());
            }
        }
        if let Some(annotations) = essence
            .pointer_mut("/metadata/annotations")
            .and_then(Value::as_object_mut)
        {
            annotations.retain(|k, _| {
                prefix_of(k) != self.prefix && self.diffbase_key.as_deref() != Some(k.as_str())
            });
        }
        remove_empty_stanzas(&mut essence);
        essence
    }
}

/// The prefix of an annotation key (`""` for an unprefixed key).
fn prefix_of(key: &str) -> &str {
    key.split_once('/').map_or("", |(p, _)| p)
}

/// Drops empty `metadata.labels`, `metadata.annotations`, `metadata` and `status`, and nothing
/// else (kopf's `remove_empty_stanzas`).
fn remove_empty_stanzas(essence: &mut Value) {
    let empty =
        |v: Option<&Value>| v.is_some_and(|v| v.as_object().is_some_and(Map::is_empty) || v.is_null());
    if let Some(metadata) = essence.get_mut("metadata").and_then(Value::as_object_mut) {
        for stanza in ["annotations", "labels"] {
            if empty(metadata.get(stanza)) {
                metadata.remove(stanza);
            }
        }
    }
    if let Some(map) = essence.as_object_mut() {
        for stanza in ["metadata", "status"] {
            if empty(map.get(stanza)) {
                map.remove(stanza);
            }
        }
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

pub use crate::model::field_path::lookup;
use crate::model::field_path::set;

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn rules() -> Rules {
        Rules {
            prefix: "capstan.dev".into(),
            diffbase_key: Some("capstan.dev/last-handled-configuration".into()),
            extra_fields: vec![vec!["status".into(), "phase".into()]],
        }
    }

    fn kopf_rules() -> Rules {
        Rules {
            prefix: "kopf.zalando.org".into(),
            diffbase_key: Some("kopf.zalando.org/last-handled-configuration".into()),
            extra_fields: vec![],
        }
    }

    /// An object as kopf 1.45 left it after handling its creation (managed fields left out):
    /// created with `kubectl apply`, with a label, an annotation, and an empty object and an
    /// empty list in the spec.
    fn handled_by_kopf() -> Value {
        serde_json::from_str(
            r#"{"apiVersion": "demo.capstan.dev/v1", "kind": "Example", "metadata": {"annotations": {"kopf.zalando.org/last-handled-configuration": "{\"spec\":{\"empty\":{},\"field\":\"a\",\"items\":[],\"size\":1},\"metadata\":{\"labels\":{\"app\":\"demo\"},\"annotations\":{\"team\":\"blue\"}}}\n", "kubectl.kubernetes.io/last-applied-configuration": "{\"apiVersion\":\"demo.capstan.dev/v1\",\"kind\":\"Example\",\"metadata\":{\"annotations\":{\"team\":\"blue\"},\"labels\":{\"app\":\"demo\"},\"name\":\"old\",\"namespace\":\"default\"},\"spec\":{\"empty\":{},\"field\":\"a\",\"items\":[],\"size\":1}}\n", "team": "blue"}, "creationTimestamp": "2026-11-29T08:30:29Z", "generation": 1, "labels": {"app": "demo"}, "name": "old", "namespace": "default", "resourceVersion": "206", "uid": "7e15e27a-480d-4ffd-ade5-3bd930f3d719"}, "spec": {"empty": {}, "field": "a", "items": [], "size": 1}}"#,
        )
        .unwrap()
    }

    fn stored_diffbase(body: &Value) -> Value {
        let text = body["metadata"]["annotations"]["kopf.zalando.org/last-handled-configuration"]
            .as_str()
            .unwrap();
        serde_json::from_str(text).unwrap()
    }

    #[test]
    fn the_essence_of_a_kopf_handled_object_is_what_kopf_stored() {
        let body = handled_by_kopf();
        let stored = stored_diffbase(&body);
        assert_eq!(kopf_rules().essence(&body), stored);
        assert_eq!(
            kopf_rules().essence(&stored),
            stored,
            "the stored essence is stable"
        );
        // The same under Capstan's own prefix: kopf's annotations are another operator's.
        assert_eq!(rules().essence(&body)["spec"], stored["spec"]);
        assert_eq!(rules().essence(&body)["metadata"], stored["metadata"]);
    }

    #[test]
    fn kopf_records_touches_and_diffbase_never_change_the_essence() {
        let body = handled_by_kopf();
        let mut busy = body.clone();
        let annotations = busy["metadata"]["annotations"].as_object_mut().unwrap();
        annotations.insert(
            "kopf.zalando.org/create_fn".into(),
            json!(r#"{"started":"2026-11-29T08:30:50.995280+00:00","delayed":"2026-11-29T08:30:51.996350+00:00","purpose":"create","retries":1,"success":false,"failure":false,"message":"temporary failure 1 of 1"}"#),
        );
        annotations.insert(
            "kopf.zalando.org/touch-dummy".into(),
            json!("2026-11-29T08:30:52.000000+00:00"),
        );
        annotations.insert(
            "kopf.zalando.org/last-handled-configuration".into(),
            json!("{}\n"),
        );
        busy["metadata"]["finalizers"] = json!(["kopf.zalando.org/KopfFinalizerMarker"]);
        busy["status"] = json!({"kopf": {"progress": {"create_fn": {"retries": 1}}}, "create_fn": null});
        assert_eq!(kopf_rules().essence(&busy), kopf_rules().essence(&body));
    }

    #[test]
    fn empty_stanzas_are_dropped_as_kopf_drops_them() {
        let body = json!({
            "metadata": {"name": "x", "labels": {}, "annotations": {"kopf.zalando.org/create_fn": "{}"}},
            "spec": {}, "data": {"empty": {}, "list": []}, "status": {"phase": {}}
        });
        assert_eq!(
            kopf_rules().essence(&body),
            json!({"spec": {}, "data": {"empty": {}, "list": []}}),
            "kopf keeps empty objects outside labels, annotations, metadata and status"
        );
        let rules = Rules {
            extra_fields: vec![vec!["status".into(), "phase".into()]],
            ..kopf_rules()
        };
        assert_eq!(rules.essence(&body)["status"], json!({"phase": {}}));
        assert_eq!(
            rules.essence(&json!({"status": {}})),
            json!({}),
            "an absent extra field adds nothing"
        );
    }

    #[test]
    fn extra_fields_may_point_into_metadata_and_a_diffbase_key_outside_the_prefix_is_ours() {
        let body = json!({
            "metadata": {"name": "x", "generation": 3, "annotations": {"other.io/base": "{}", "a": "b"}},
            "spec": {"a": 1}
        });
        let rules = Rules {
            prefix: "capstan.dev".into(),
            diffbase_key: Some("other.io/base".into()),
            extra_fields: vec![vec!["metadata".into(), "generation".into()]],
        };
        assert_eq!(
            rules.essence(&body),
            json!({"spec": {"a": 1}, "metadata": {"generation": 3, "annotations": {"a": "b"}}})
        );
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
                "spec": {"size": 1, "empty": {}},
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
            diffbase_key: Some("capstan.dev/last-handled-configuration".into()),
            extra_fields: vec![],
        };
        assert_eq!(rules.essence(&before), rules.essence(&after));
    }
}
