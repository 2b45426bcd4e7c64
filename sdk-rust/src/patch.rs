//! [`Patch`]: the changes a handler wants made to its object.
//!
//! kopf hands every handler a mutable `patch` dict; the controller folds all patches of one
//! processing cycle and the handlers' results into one API request. Here a handler fills a
//! `Patch` through [`crate::Context::patch`] (or builds one for
//! [`crate::Context::send_patch`]); the dispatch module turns it into wire patches: one JSON merge
//! patch for the object, one for the status subresource, and optionally an RFC 6902 JSON patch
//! (what mutating admission handlers usually want). A `Patch` is a cheap handle: clones share the
//! same document, and every method locks only for the duration of the call.

use std::sync::Arc;

use parking_lot::Mutex;
use serde_json::{Map, Value};

use crate::{convert, pb};

#[derive(Debug, Default, Clone, PartialEq)]
struct Documents {
    object: Map<String, Value>,
    status: Map<String, Value>,
    operations: Vec<Value>,
}

/// A set of changes to one object: merge patches for the object and its status, plus RFC 6902
/// operations.
///
/// Paths are dotted (`spec.replicas`); label and annotation keys are taken verbatim, dots and
/// slashes included. Setting `null` deletes a key, as in a JSON merge patch.
#[derive(Debug, Clone, Default)]
pub struct Patch {
    docs: Arc<Mutex<Documents>>,
}

impl Patch {
    /// An empty patch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the field at a dotted `path` of the object (e.g. `spec.replicas`).
    pub fn set(&self, path: &str, value: impl Into<Value>) -> &Self {
        let keys: Vec<&str> = path.split('.').filter(|k| !k.is_empty()).collect();
        self.set_path(&keys, value)
    }

    /// Sets the field at `keys` (one key per nesting level) of the object.
    pub fn set_path(&self, keys: &[&str], value: impl Into<Value>) -> &Self {
        let value = value.into();
        let mut docs = self.docs.lock();
        if keys.first() == Some(&"status") {
            insert(&mut docs.status, &keys[1..], value);
        } else {
            insert(&mut docs.object, keys, value);
        }
        self
    }

    /// Deletes the field at a dotted `path` of the object.
    pub fn remove(&self, path: &str) -> &Self {
        self.set(path, Value::Null)
    }

    /// Sets `spec.<path>`.
    pub fn spec(&self, path: &str, value: impl Into<Value>) -> &Self {
        self.set(&format!("spec.{path}"), value)
    }

    /// Sets `status.<path>` (sent to the status subresource).
    pub fn status(&self, path: &str, value: impl Into<Value>) -> &Self {
        self.set(&format!("status.{path}"), value)
    }

    /// Sets a label.
    pub fn label(&self, key: &str, value: impl Into<String>) -> &Self {
        self.set_path(&["metadata", "labels", key], Value::String(value.into()))
    }

    /// Removes a label.
    pub fn remove_label(&self, key: &str) -> &Self {
        self.set_path(&["metadata", "labels", key], Value::Null)
    }

    /// Sets an annotation.
    pub fn annotation(&self, key: &str, value: impl Into<String>) -> &Self {
        self.set_path(&["metadata", "annotations", key], Value::String(value.into()))
    }

    /// Removes an annotation.
    pub fn remove_annotation(&self, key: &str) -> &Self {
        self.set_path(&["metadata", "annotations", key], Value::Null)
    }

    /// Merges a whole JSON merge patch document (relative to the object) into this patch.
    /// Non-object documents are ignored.
    pub fn merge(&self, document: &Value) -> &Self {
        if let Value::Object(fields) = document {
            let mut docs = self.docs.lock();
            for (key, value) in fields {
                match (key.as_str(), value) {
                    ("status", Value::Object(status)) => {
                        for (k, v) in status {
                            compose_field(&mut docs.status, k, v);
                        }
                    }
                    _ => compose_field(&mut docs.object, key, value),
                }
            }
        }
        self
    }

    /// Appends one RFC 6902 operation, e.g. `json!({"op": "add", "path": "/spec/x", "value": 1})`.
    pub fn json_op(&self, operation: Value) -> &Self {
        self.docs.lock().operations.push(operation);
        self
    }

    /// Whether nothing has been set.
    pub fn is_empty(&self) -> bool {
        let docs = self.docs.lock();
        docs.object.is_empty() && docs.status.is_empty() && docs.operations.is_empty()
    }

    /// The object merge patch, including `status` changes, as one JSON document.
    pub fn to_merge_document(&self) -> Value {
        let docs = self.docs.lock();
        let mut object = docs.object.clone();
        if !docs.status.is_empty() {
            compose_field(&mut object, "status", &Value::Object(docs.status.clone()));
        }
        Value::Object(object)
    }

    /// Empties the patch.
    pub fn clear(&self) {
        *self.docs.lock() = Documents::default();
    }

    /// The wire patches: object merge patch, status merge patch, JSON patch (each only if
    /// non-empty).
    pub(crate) fn to_pb(&self) -> Vec<pb::Patch> {
        let docs = self.docs.lock().clone();
        let mut patches = Vec::new();
        if !docs.object.is_empty() {
            patches.push(wire(
                pb::PatchType::Merge,
                pb::PatchTarget::Object,
                Value::Object(docs.object),
            ));
        }
        if !docs.status.is_empty() {
            let mut body = Map::new();
            body.insert("status".to_owned(), Value::Object(docs.status));
            patches.push(wire(
                pb::PatchType::Merge,
                pb::PatchTarget::Status,
                Value::Object(body),
            ));
        }
        if !docs.operations.is_empty() {
            patches.push(wire(
                pb::PatchType::Json,
                pb::PatchTarget::Object,
                Value::Array(docs.operations),
            ));
        }
        patches
    }
}

fn wire(kind: pb::PatchType, target: pb::PatchTarget, body: Value) -> pb::Patch {
    pb::Patch {
        r#type: kind as i32,
        target: target as i32,
        body: Some(convert::json_to_pb(&body)),
    }
}

/// Inserts `value` at `keys` in a merge-patch document, creating intermediate objects.
fn insert(doc: &mut Map<String, Value>, keys: &[&str], value: Value) {
    match keys {
        [] => {
            if let Value::Object(fields) = value {
                for (k, v) in fields {
                    compose_field(doc, &k, &v);
                }
            }
        }
        [last] => {
            doc.insert((*last).to_owned(), value);
        }
        [first, rest @ ..] => {
            let child = doc
                .entry((*first).to_owned())
                .or_insert_with(|| Value::Object(Map::new()));
            if !child.is_object() {
                *child = Value::Object(Map::new());
            }
            if let Value::Object(child) = child {
                insert(child, rest, value);
            }
        }
    }
}

/// Composes a merge-patch field into a merge-patch document: nested objects merge, everything
/// else (including `null`, which must survive as a deletion) replaces.
fn compose_field(doc: &mut Map<String, Value>, key: &str, value: &Value) {
    match (doc.get_mut(key), value) {
        (Some(Value::Object(existing)), Value::Object(fields)) => {
            for (k, v) in fields {
                compose_field(existing, k, v);
            }
        }
        _ => {
            doc.insert(key.to_owned(), value.clone());
        }
    }
}

/// Applies an RFC 7386 merge patch to a document.
#[cfg_attr(not(feature = "testing"), allow(dead_code))]
pub(crate) fn apply_merge(target: &mut Value, patch: &Value) {
    let Value::Object(fields) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = Value::Object(Map::new());
    }
    if let Value::Object(existing) = target {
        for (key, value) in fields {
            if value.is_null() {
                existing.remove(key);
            } else {
                apply_merge(existing.entry(key.clone()).or_insert(Value::Null), value);
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn builds_object_and_status_patches() {
        let patch = Patch::new();
        patch
            .label("demo.capstan.dev/handled", "yes")
            .spec("size", 3)
            .status("ticks", 2)
            .remove("spec.old");
        let wire = patch.to_pb();
        assert_eq!(wire.len(), 2);
        let object: Value = serde_json::from_slice(&wire[0].body.as_ref().unwrap().json).unwrap();
        assert_eq!(
            object,
            json!({"metadata": {"labels": {"demo.capstan.dev/handled": "yes"}}, "spec": {"size": 3, "old": null}})
        );
        assert_eq!(wire[1].target, pb::PatchTarget::Status as i32);
        let status: Value = serde_json::from_slice(&wire[1].body.as_ref().unwrap().json).unwrap();
        assert_eq!(status, json!({"status": {"ticks": 2}}));
    }

    #[test]
    fn merge_composes_and_keeps_deletions() {
        let patch = Patch::new();
        patch
            .set("spec.a.b", 1)
            .merge(&json!({"spec": {"a": {"c": null}}, "status": {"x": 1}}));
        assert_eq!(
            patch.to_merge_document(),
            json!({"spec": {"a": {"b": 1, "c": null}}, "status": {"x": 1}})
        );
        assert!(!patch.is_empty());
        patch.clear();
        assert!(patch.is_empty() && patch.to_pb().is_empty());
    }

    #[test]
    fn apply_merge_follows_rfc_7386() {
        let mut doc = json!({"a": {"b": 1, "c": 2}, "d": [1]});
        apply_merge(&mut doc, &json!({"a": {"b": null, "e": 3}, "d": [2]}));
        assert_eq!(doc, json!({"a": {"c": 2, "e": 3}, "d": [2]}));
    }
}
