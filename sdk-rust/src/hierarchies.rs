//! Ownership and naming of the objects a handler creates: kopf's hierarchy helpers
//! (`adopt`, `append_owner_reference`, `remove_owner_reference`, `label`, `harmonize_naming`,
//! `adjust_namespace`, `build_object_reference`, `build_owner_reference`).
//!
//! They work on objects as JSON values (build a child with `serde_json::json!`, or turn a
//! typed `k8s-openapi` object into a value with `serde_json::to_value`) and change them in
//! place; the handler then creates them with its own client. Every helper checks all its
//! inputs before it changes anything: an owner without an `apiVersion`, `kind`, `name` or
//! `uid`, a namespace that is required but absent, or a child that is not a JSON object (or
//! whose `metadata` is not one) is a [`HierarchyError`] and no object is touched. Inside a
//! handler, [`crate::Context::adopt`] and its siblings use the handler's object as the owner,
//! as kopf's helpers default to the current handler's body.

use serde_json::{Map, Value, json};

/// Why a helper changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum HierarchyError {
    /// The owner lacks a field an owner reference needs.
    #[error("the owner has no {field}; an owner reference needs it")]
    OwnerIncomplete {
        /// The missing field, e.g. `metadata.uid`.
        field: &'static str,
    },
    /// A namespace was needed (to put children in) and there is none.
    #[error("the owner has no namespace to put its children in")]
    NoNamespace,
    /// A child is not a JSON object, or its `metadata` is not one.
    #[error("object #{index} is not a Kubernetes object (a JSON object with an object `metadata`)")]
    NotAnObject {
        /// Its position in the list given.
        index: usize,
    },
}

/// Options of [`adopt`] and [`crate::Context::adopt`], as kopf's keyword arguments.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Adoption {
    /// Overwrite existing names, namespaces and labels (kopf's `forced`).
    pub forced: bool,
    /// Name children exactly as the owner instead of `generateName: <owner>-` (kopf's `strict`).
    pub strict: bool,
    /// Also label these nested templates, e.g. `spec.template` (kopf's `nested`).
    pub nested: Vec<String>,
}

/// A reference to an object (kopf's `build_object_reference`): `apiVersion`, `kind`, `name`,
/// `uid`, and `namespace` when it has one.
///
/// # Errors
/// [`HierarchyError::OwnerIncomplete`] when the object lacks one of the first four.
pub fn build_object_reference(body: &Value) -> Result<Value, HierarchyError> {
    let mut reference = identity(body)?;
    if let Some(namespace) = text(body, "/metadata/namespace") {
        reference.insert("namespace".into(), namespace.into());
    }
    Ok(Value::Object(reference))
}

/// An owner reference to `owner` (kopf's `build_owner_reference`), with `controller` and
/// `blockOwnerDeletion` as given (kopf's defaults are both `true`).
///
/// # Errors
/// [`HierarchyError::OwnerIncomplete`] when the owner lacks `apiVersion`, `kind`, `name` or `uid`.
pub fn build_owner_reference(
    owner: &Value,
    controller: bool,
    block_owner_deletion: bool,
) -> Result<Value, HierarchyError> {
    let mut reference = identity(owner)?;
    reference.insert("controller".into(), controller.into());
    reference.insert("blockOwnerDeletion".into(), block_owner_deletion.into());
    Ok(Value::Object(reference))
}

/// Adds an owner reference to `owner` to each object that has none with the owner's uid
/// (kopf's `append_owner_reference`; kopf's defaults: `controller` and `block_owner_deletion`
/// both `true`).
///
/// # Errors
/// See the module docs; nothing is changed on error.
pub fn append_owner_reference<'a>(
    objects: impl IntoIterator<Item = &'a mut Value>,
    owner: &Value,
    controller: bool,
    block_owner_deletion: bool,
) -> Result<(), HierarchyError> {
    let reference = build_owner_reference(owner, controller, block_owner_deletion)?;
    let uid = reference["uid"].clone();
    for meta in metadatas(objects)? {
        let Some(refs) = list(meta, "ownerReferences") else {
            continue;
        };
        if !refs.iter().any(|r| r.get("uid") == Some(&uid)) {
            refs.push(reference.clone());
        }
    }
    Ok(())
}

/// Removes every owner reference to `owner` (by uid) from each object (kopf's
/// `remove_owner_reference`).
///
/// # Errors
/// See the module docs; nothing is changed on error.
pub fn remove_owner_reference<'a>(
    objects: impl IntoIterator<Item = &'a mut Value>,
    owner: &Value,
) -> Result<(), HierarchyError> {
    let uid = text(owner, "/metadata/uid").ok_or(HierarchyError::OwnerIncomplete {
        field: "metadata.uid",
    })?;
    for meta in metadatas(objects)? {
        if let Some(refs) = meta.get_mut("ownerReferences").and_then(Value::as_array_mut) {
            refs.retain(|r| r.get("uid").and_then(Value::as_str) != Some(uid));
        }
    }
    Ok(())
}

/// Sets labels on each object, keeping values already there unless `forced` (kopf's `label`);
/// each path of `nested` (e.g. `spec.template`) is labelled too, at `<path>.metadata.labels`.
///
/// # Errors
/// See the module docs; nothing is changed on error.
pub fn label<'a>(
    objects: impl IntoIterator<Item = &'a mut Value>,
    labels: &Map<String, Value>,
    forced: bool,
    nested: &[String],
) -> Result<(), HierarchyError> {
    let objects: Vec<&'a mut Value> = objects.into_iter().collect();
    for (index, object) in objects.iter().enumerate() {
        check(object, index)?;
        for path in nested {
            if !reachable(object, path) {
                return Err(HierarchyError::NotAnObject { index });
            }
        }
    }
    let paths: Vec<Vec<&str>> = std::iter::once(Vec::new())
        .chain(nested.iter().map(|p| p.split('.').collect()))
        .collect();
    for object in objects {
        for path in &paths {
            let mut at = path.iter().copied().chain(["metadata", "labels"]);
            let Some(current) = object_at(object, &mut at) else {
                continue;
            };
            for (key, value) in labels {
                if forced || !current.contains_key(key) {
                    current.insert(key.clone(), value.clone());
                }
            }
        }
    }
    Ok(())
}

/// Names each object after `name` when it has neither a `name` nor a `generateName`, or
/// always when `forced` (kopf's `harmonize_naming`): `generateName: <name>-`, or exactly
/// `name` when `strict`.
///
/// # Errors
/// See the module docs; nothing is changed on error.
pub fn harmonize_naming<'a>(
    objects: impl IntoIterator<Item = &'a mut Value>,
    name: &str,
    forced: bool,
    strict: bool,
) -> Result<(), HierarchyError> {
    for meta in metadatas(objects)? {
        let named = meta.contains_key("name") || meta.contains_key("generateName");
        if named && !forced {
            continue;
        }
        if strict {
            meta.remove("generateName");
            meta.insert("name".into(), name.into());
        } else {
            meta.remove("name");
            meta.insert("generateName".into(), format!("{name}-").into());
        }
    }
    Ok(())
}

/// Puts each object in `namespace` when it has none, or always when `forced` (kopf's
/// `adjust_namespace`).
///
/// # Errors
/// See the module docs; nothing is changed on error.
pub fn adjust_namespace<'a>(
    objects: impl IntoIterator<Item = &'a mut Value>,
    namespace: &str,
    forced: bool,
) -> Result<(), HierarchyError> {
    if namespace.is_empty() {
        return Err(HierarchyError::NoNamespace);
    }
    for meta in metadatas(objects)? {
        let placed = meta
            .get("namespace")
            .and_then(Value::as_str)
            .is_some_and(|ns| !ns.is_empty());
        if forced || !placed {
            meta.insert("namespace".into(), namespace.into());
        }
    }
    Ok(())
}

/// Makes each object a child of `owner` (kopf's `adopt`): an owner reference (controller,
/// blocking deletion), a name after the owner's, the owner's namespace (a cluster-scoped owner
/// leaves its children's namespaces alone) and the owner's labels.
///
/// # Errors
/// See the module docs; nothing is changed on error.
pub fn adopt<'a>(
    objects: impl IntoIterator<Item = &'a mut Value>,
    owner: &Value,
    options: &Adoption,
) -> Result<(), HierarchyError> {
    build_owner_reference(owner, true, true)?;
    let mut objects: Vec<&'a mut Value> = objects.into_iter().collect();
    // Checked once for all, so that the steps below cannot fail half-way.
    for (index, object) in objects.iter().enumerate() {
        check(object, index)?;
        for path in &options.nested {
            if !reachable(object, path) {
                return Err(HierarchyError::NotAnObject { index });
            }
        }
    }
    let name = text(owner, "/metadata/name").unwrap_or_default().to_owned();
    let namespace = text(owner, "/metadata/namespace").map(str::to_owned);
    let labels = owner
        .pointer("/metadata/labels")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    append_owner_reference(objects.iter_mut().map(|o| &mut **o), owner, true, true)?;
    harmonize_naming(
        objects.iter_mut().map(|o| &mut **o),
        &name,
        options.forced,
        options.strict,
    )?;
    if let Some(namespace) = namespace {
        adjust_namespace(objects.iter_mut().map(|o| &mut **o), &namespace, options.forced)?;
    }
    label(
        objects.iter_mut().map(|o| &mut **o),
        &labels,
        options.forced,
        &options.nested,
    )
}

/// `apiVersion`, `kind`, `name` and `uid` of an object, all present.
fn identity(body: &Value) -> Result<Map<String, Value>, HierarchyError> {
    let field = |pointer: &str, field: &'static str| {
        text(body, pointer)
            .map(|v| Value::String(v.to_owned()))
            .ok_or(HierarchyError::OwnerIncomplete { field })
    };
    let mut reference = Map::new();
    reference.insert("apiVersion".into(), field("/apiVersion", "apiVersion")?);
    reference.insert("kind".into(), field("/kind", "kind")?);
    reference.insert("name".into(), field("/metadata/name", "metadata.name")?);
    reference.insert("uid".into(), field("/metadata/uid", "metadata.uid")?);
    Ok(reference)
}

/// A non-empty string at `pointer`.
fn text<'v>(body: &'v Value, pointer: &str) -> Option<&'v str> {
    body.pointer(pointer)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

/// Whether the object is a JSON object whose `metadata`, if any, is one too.
fn check(object: &Value, index: usize) -> Result<(), HierarchyError> {
    if reachable(object, "metadata") {
        Ok(())
    } else {
        Err(HierarchyError::NotAnObject { index })
    }
}

/// Whether every step of the dotted `path` (and the object itself) is an object or absent.
fn reachable(object: &Value, path: &str) -> bool {
    let mut at = object;
    if !at.is_object() {
        return false;
    }
    for part in path.split('.') {
        match at.get(part) {
            None | Some(Value::Null) => return true,
            Some(next @ Value::Object(_)) => at = next,
            Some(_) => return false,
        }
    }
    true
}

/// The object at a path of keys below `object`, creating empty objects (in place of absent or
/// `null` ones) on the way; `None` when something else is in the way.
fn object_at<'v, 'k>(
    object: &'v mut Value,
    path: &mut impl Iterator<Item = &'k str>,
) -> Option<&'v mut Map<String, Value>> {
    let mut at = object.as_object_mut()?;
    for key in path {
        let slot = at.entry(key.to_owned()).or_insert(Value::Null);
        if slot.is_null() {
            *slot = json!({});
        }
        at = slot.as_object_mut()?;
    }
    Some(at)
}

/// The `metadata` of every object (created when absent), once all were checked.
fn metadatas<'a>(
    objects: impl IntoIterator<Item = &'a mut Value>,
) -> Result<Vec<&'a mut Map<String, Value>>, HierarchyError> {
    let objects: Vec<&'a mut Value> = objects.into_iter().collect();
    for (index, object) in objects.iter().enumerate() {
        check(object, index)?;
    }
    Ok(objects
        .into_iter()
        .filter_map(|o| object_at(o, &mut std::iter::once("metadata")))
        .collect())
}

/// The array at `key` of `map`, created (in place of anything else) as needed.
fn list<'m>(parent: &'m mut Map<String, Value>, key: &str) -> Option<&'m mut Vec<Value>> {
    let slot = parent.entry(key.to_owned()).or_insert(Value::Null);
    if !slot.is_array() {
        *slot = Value::Array(Vec::new());
    }
    slot.as_array_mut()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn owner() -> Value {
        json!({"apiVersion": "demo.capstan.dev/v1", "kind": "Example",
               "metadata": {"name": "parent", "namespace": "team", "uid": "u-1",
                            "labels": {"app": "demo", "tier": "db"}}})
    }

    fn child() -> Value {
        json!({"apiVersion": "v1", "kind": "ConfigMap", "data": {"a": "1"}})
    }

    #[test]
    fn references_name_the_object_and_owner_references_block_deletion() {
        assert_eq!(
            build_object_reference(&owner()).unwrap(),
            json!({"apiVersion": "demo.capstan.dev/v1", "kind": "Example", "name": "parent",
                   "uid": "u-1", "namespace": "team"})
        );
        assert_eq!(
            build_owner_reference(&owner(), true, false).unwrap(),
            json!({"apiVersion": "demo.capstan.dev/v1", "kind": "Example", "name": "parent",
                   "uid": "u-1", "controller": true, "blockOwnerDeletion": false})
        );
    }

    #[test]
    fn adopt_sets_owner_naming_namespace_and_labels_once() {
        let mut a = child();
        let mut b = json!({"metadata": {"name": "fixed", "namespace": "elsewhere",
                                        "labels": {"tier": "web"}},
                           "spec": {"template": {"spec": {}}}});
        let options = Adoption {
            nested: vec!["spec.template".into()],
            ..Adoption::default()
        };
        adopt([&mut a, &mut b], &owner(), &options).unwrap();
        adopt([&mut a], &owner(), &options).unwrap();
        assert_eq!(a["metadata"]["generateName"], "parent-");
        assert_eq!(a["metadata"]["namespace"], "team");
        assert_eq!(a["metadata"]["labels"], json!({"app": "demo", "tier": "db"}));
        assert_eq!(
            a["metadata"]["ownerReferences"].as_array().unwrap().len(),
            1,
            "{a}"
        );
        assert_eq!(a["metadata"]["ownerReferences"][0]["controller"], true);
        assert_eq!(b["metadata"]["name"], "fixed", "a name is kept unless forced");
        assert_eq!(b["metadata"]["namespace"], "elsewhere");
        assert_eq!(
            b["metadata"]["labels"]["tier"], "web",
            "labels are kept unless forced"
        );
        assert_eq!(b["spec"]["template"]["metadata"]["labels"]["app"], "demo");

        let forced = Adoption {
            forced: true,
            strict: true,
            ..Adoption::default()
        };
        adopt([&mut b], &owner(), &forced).unwrap();
        assert_eq!(b["metadata"]["name"], "parent");
        assert!(b["metadata"].get("generateName").is_none());
        assert_eq!(b["metadata"]["namespace"], "team");
        assert_eq!(b["metadata"]["labels"]["tier"], "db");
    }

    #[test]
    fn remove_owner_reference_keeps_the_others() {
        let mut a = child();
        let other = json!({"apiVersion": "v1", "kind": "Secret",
                           "metadata": {"name": "s", "uid": "u-2"}});
        append_owner_reference([&mut a], &owner(), true, true).unwrap();
        append_owner_reference([&mut a], &other, false, false).unwrap();
        remove_owner_reference([&mut a], &owner()).unwrap();
        assert_eq!(
            a["metadata"]["ownerReferences"],
            json!([{"apiVersion": "v1", "kind": "Secret", "name": "s", "uid": "u-2",
                    "controller": false, "blockOwnerDeletion": false}])
        );
    }

    #[test]
    fn naming_and_namespaces_follow_kopf() {
        let mut a = child();
        harmonize_naming([&mut a], "parent", false, true).unwrap();
        assert_eq!(a["metadata"]["name"], "parent");
        let mut b = json!({"metadata": {"generateName": "mine-"}});
        harmonize_naming([&mut b], "parent", false, false).unwrap();
        assert_eq!(b["metadata"], json!({"generateName": "mine-"}));
        adjust_namespace([&mut b], "team", false).unwrap();
        assert_eq!(b["metadata"]["namespace"], "team");
        let mut labels = Map::new();
        labels.insert("k".into(), "v".into());
        label([&mut b], &labels, false, &[]).unwrap();
        assert_eq!(b["metadata"]["labels"]["k"], "v");
    }

    #[test]
    fn unfit_input_is_a_clear_error_and_nothing_is_written() {
        let mut good = child();
        let mut bad = json!("not an object");
        let before = good.clone();
        assert_eq!(
            adopt([&mut good, &mut bad], &owner(), &Adoption::default()),
            Err(HierarchyError::NotAnObject { index: 1 })
        );
        assert_eq!(good, before, "the first child is untouched");

        let mut no_uid = owner();
        no_uid["metadata"].as_object_mut().unwrap().remove("uid");
        let err = adopt([&mut good], &no_uid, &Adoption::default()).unwrap_err();
        assert_eq!(
            err,
            HierarchyError::OwnerIncomplete {
                field: "metadata.uid"
            }
        );
        assert!(err.to_string().contains("metadata.uid"));
        assert_eq!(good, before);
        assert_eq!(
            remove_owner_reference([&mut good], &no_uid),
            Err(HierarchyError::OwnerIncomplete {
                field: "metadata.uid"
            })
        );
        assert_eq!(
            adjust_namespace([&mut good], "", false),
            Err(HierarchyError::NoNamespace)
        );
        let mut bad_meta = json!({"metadata": "x"});
        assert_eq!(
            append_owner_reference([&mut good, &mut bad_meta], &owner(), true, true),
            Err(HierarchyError::NotAnObject { index: 1 })
        );
        assert_eq!(good, before);
        let mut bad_template = json!({"spec": {"template": 3}});
        let nested = Adoption {
            nested: vec!["spec.template".into()],
            ..Adoption::default()
        };
        assert!(adopt([&mut bad_template], &owner(), &nested).is_err());
        assert_eq!(bad_template, json!({"spec": {"template": 3}}));
    }

    #[test]
    fn a_cluster_scoped_owner_leaves_namespaces_alone() {
        let mut cluster_owner = owner();
        cluster_owner["metadata"]
            .as_object_mut()
            .unwrap()
            .remove("namespace");
        let mut a = child();
        adopt([&mut a], &cluster_owner, &Adoption::default()).unwrap();
        assert!(a["metadata"].get("namespace").is_none());
        assert_eq!(a["metadata"]["ownerReferences"][0]["uid"], "u-1");
    }
}
