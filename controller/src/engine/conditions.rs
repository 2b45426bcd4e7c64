//! Status conditions: `Ready`, `Progressing` and `Degraded` in `status.conditions`, kept by
//! the controller for resources that opt in (`capstan run --conditions RESOURCE,…`).
//!
//! They follow the Kubernetes API conventions for conditions (`type`, `status` `True` /
//! `False`, a CamelCase `reason`, a human `message`, `lastTransitionTime` changed only when
//! `status` changes, `observedGeneration` of the generation handled), so `kubectl wait
//! --for=condition=Ready` and generic tooling work on users' resources:
//!
//! - `Ready`: every handler of the last change succeeded;
//! - `Progressing`: a cause is being handled, or a handler waits for its retry;
//! - `Degraded`: a handler of the last change failed permanently.
//!
//! Conditions of other types (the user's own, another controller's) are kept as they are. A
//! merge patch replaces the `conditions` list whole, so a write that sets it carries the
//! base's `resourceVersion` as a precondition ([`guard`]): when another writer changed the
//! object meanwhile (added its own condition while a handler ran), the write conflicts, and the
//! writer re-reads the object and merges the lists by their key, `type` ([`rebase`]) — the
//! others' conditions as they are now, ours as the cycle set them — before writing again.
//! They are set in the
//! cycle's desired body, so they travel in the cycle's own write: the one PATCH, or for a
//! resource with a status subresource the cycle's `/status` PATCH (`engine::writing`) — never
//! a write of their own for a handled change. An unchanged condition is not rewritten. A
//! processing cycle composes them (`engine::processing::cycle`); this module only knows their
//! shape. Per-node operators do not keep conditions (the nodes would overwrite each other's).
//!
//! The opt-in is per resource ([`Selection`]): conditions of these types belong to whoever
//! owns the resource's status — kubelet keeps a Pod's `Ready`, the deployment controller a
//! Deployment's `Progressing` — and a second writer would fight it. A bare `--conditions`
//! therefore covers custom resources only; a built-in resource gets conditions only when it
//! is named.

use std::time::SystemTime;

use serde_json::{Value, json};

use crate::{
    model::ResolvedResource,
    persistence::{progress::object_at, time},
};

/// The resources whose conditions the controller keeps.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Selection {
    /// None (the default).
    #[default]
    Off,
    /// Every custom resource the operator handles; never a built-in one.
    Custom,
    /// The resources named, as `plural` or `plural.group` (built-in ones included).
    Named(Vec<String>),
}

impl Selection {
    /// The selection of `--conditions`: `None` without the flag, an empty list for a bare
    /// flag (every custom resource), or the resources named.
    pub fn from_flag(names: Option<&[String]>) -> Self {
        match names {
            None => Self::Off,
            Some(names) => {
                let named: Vec<String> = names
                    .iter()
                    .map(|n| n.trim().to_ascii_lowercase())
                    .filter(|n| !n.is_empty())
                    .collect();
                if named.is_empty() {
                    Self::Custom
                } else {
                    Self::Named(named)
                }
            }
        }
    }

    /// Whether the controller keeps the conditions of `resource`'s objects.
    pub fn covers(&self, resource: &ResolvedResource) -> bool {
        match self {
            Self::Off => false,
            Self::Custom => custom(resource),
            Self::Named(names) => names.iter().any(|n| {
                n == &resource.plural
                    || n.split_once('.')
                        .is_some_and(|(plural, group)| plural == resource.plural && group == resource.group)
            }),
        }
    }
}

/// Whether a resource is a custom one: its group is a domain (custom resource definitions
/// require a dot) outside Kubernetes' own (`*.k8s.io`, `*.kubernetes.io`, which also serve
/// built-in APIs such as `networking.k8s.io`).
fn custom(resource: &ResolvedResource) -> bool {
    let group = resource.group.as_str();
    group.contains('.')
        && !["k8s.io", "kubernetes.io"]
            .iter()
            .any(|own| group == *own || group.ends_with(&format!(".{own}")))
}

/// What a cycle found, for the conditions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Summary {
    /// Every handler of the cause has finished (successfully or not).
    pub done: bool,
    /// Handlers that failed permanently, with their messages.
    pub failed: Vec<(String, String)>,
    /// Handlers waiting for a retry, with their last messages.
    pub retrying: Vec<(String, String)>,
    /// The cause, for messages (`creation`, `update`, `deletion`, `resumption`).
    pub cause: String,
}

/// Sets the three conditions in a local copy of `body` (the cycle's desired body), keeping
/// `lastTransitionTime` of those whose status does not change and every other condition.
pub fn apply(body: &mut Value, summary: &Summary, now: SystemTime) {
    let generation = body
        .pointer("/metadata/generation")
        .and_then(Value::as_i64)
        .unwrap_or(0);
    let degraded = !summary.failed.is_empty();
    let failures = list(&summary.failed);
    let ready = if summary.done && !degraded {
        (
            "True",
            "Handled",
            format!("Every handler of the {} succeeded.", summary.cause),
        )
    } else if degraded {
        ("False", "HandlerFailed", failures.clone())
    } else {
        (
            "False",
            "Processing",
            format!("The {} is being handled.", summary.cause),
        )
    };
    let progressing = if summary.done {
        ("False", "Handled", format!("The {} is handled.", summary.cause))
    } else if !summary.retrying.is_empty() {
        ("True", "Retrying", list(&summary.retrying))
    } else {
        (
            "True",
            "Processing",
            format!("The {} is being handled.", summary.cause),
        )
    };
    let degraded = if degraded {
        ("True", "HandlerFailed", failures)
    } else {
        ("False", "NoFailures", "No handler failed permanently.".to_owned())
    };
    let stamp = rfc3339(now);
    let status = object_at(body, &["status"]);
    let mut conditions: Vec<Value> = status
        .get("conditions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for (kind, (state, reason, message)) in [
        ("Ready", ready),
        ("Progressing", progressing),
        ("Degraded", degraded),
    ] {
        let existing = conditions.iter().position(|c| c["type"] == kind);
        let transition = existing
            .and_then(|i| conditions.get(i))
            .filter(|c| c["status"] == state)
            .and_then(|c| c.get("lastTransitionTime").cloned())
            .unwrap_or_else(|| Value::String(stamp.clone()));
        let condition = json!({
            "type": kind,
            "status": state,
            "reason": reason,
            "message": message,
            "lastTransitionTime": transition,
            "observedGeneration": generation,
        });
        match existing.and_then(|i| conditions.get_mut(i)) {
            Some(slot) => *slot = condition,
            None => conditions.push(condition),
        }
    }
    status.insert("conditions".into(), Value::Array(conditions));
}

/// Sets `observedGeneration` of the three conditions to the body's generation, leaving
/// everything else of them as it is.
pub fn observe(body: &mut Value) {
    let generation = body
        .pointer("/metadata/generation")
        .and_then(Value::as_i64)
        .unwrap_or(0);
    let Some(conditions) = body
        .pointer_mut("/status/conditions")
        .and_then(Value::as_array_mut)
    else {
        return;
    };
    for condition in conditions.iter_mut().filter(|c| {
        ["Ready", "Progressing", "Degraded"]
            .iter()
            .any(|kind| c["type"] == *kind)
    }) {
        if let Some(c) = condition.as_object_mut() {
            c.insert("observedGeneration".into(), generation.into());
        }
    }
}

/// Makes a write of `status.conditions` conditional on the object being still at `base`'s
/// version: `patch` is one PATCH's body (of the object or of its `/status`).
pub fn guard(patch: &mut Value, base: &Value) {
    if patch.pointer("/status/conditions").is_none() {
        return;
    }
    let Some(version) = base.pointer("/metadata/resourceVersion").cloned() else {
        return;
    };
    if let Some(p) = patch.as_object_mut() {
        let meta = p.entry("metadata").or_insert_with(|| json!({}));
        if let Some(meta) = meta.as_object_mut() {
            meta.insert("resourceVersion".into(), version);
        }
    }
}

/// After a conflict: `desired` (already rebased on `fresh` otherwise) gets the conditions of
/// `fresh` merged by type with the changes from `original` to `desired` — a condition this
/// write added or changed is set, one it removed goes, every other is as `fresh` has it.
pub fn rebase(desired: &mut Value, original: &Value, desired_before: &Value, fresh: &Value) {
    let list = |body: &Value| -> Vec<Value> {
        body.pointer("/status/conditions")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let (before, wanted, mut merged) = (list(original), list(desired_before), list(fresh));
    let of_type = |conditions: &[Value], kind: &Value| conditions.iter().position(|c| c["type"] == *kind);
    for condition in &wanted {
        let kind = &condition["type"];
        if of_type(&before, kind).and_then(|i| before.get(i)) == Some(condition) {
            continue;
        }
        match of_type(&merged, kind).and_then(|i| merged.get_mut(i)) {
            Some(slot) => *slot = condition.clone(),
            None => merged.push(condition.clone()),
        }
    }
    for removed in before.iter().filter(|c| of_type(&wanted, &c["type"]).is_none()) {
        merged.retain(|c| c["type"] != removed["type"]);
    }
    object_at(desired, &["status"]).insert("conditions".into(), Value::Array(merged));
}

/// Whether `body` carries the three conditions already.
pub fn present(body: &Value) -> bool {
    let Some(conditions) = body.pointer("/status/conditions").and_then(Value::as_array) else {
        return false;
    };
    ["Ready", "Progressing", "Degraded"]
        .iter()
        .all(|kind| conditions.iter().any(|c| c["type"] == *kind))
}

fn list(handlers: &[(String, String)]) -> String {
    handlers
        .iter()
        .map(|(id, message)| {
            if message.is_empty() {
                format!("Handler '{id}'.")
            } else {
                format!("Handler '{id}': {message}")
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// `2026-12-01T10:00:00Z`: metav1.Time's format (seconds, UTC).
fn rfc3339(t: SystemTime) -> String {
    let full = time::format(t);
    format!("{}Z", full.get(..19).unwrap_or(&full))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::Map;

    use super::*;

    fn by_type(body: &Value) -> Map<String, Value> {
        body.pointer("/status/conditions")
            .and_then(Value::as_array)
            .map(|c| {
                c.iter()
                    .filter_map(|c| Some((c["type"].as_str()?.to_owned(), c.clone())))
                    .collect()
            })
            .unwrap_or_default()
    }

    fn resource(group: &str, plural: &str) -> ResolvedResource {
        ResolvedResource {
            group: group.into(),
            version: "v1".into(),
            plural: plural.into(),
            kind: String::new(),
            namespaced: true,
            status_subresource: true,
        }
    }

    #[test]
    fn the_opt_in_is_per_resource_and_built_in_ones_only_by_name() {
        let examples = resource("demo.capstan.dev", "examples");
        let pods = resource("", "pods");
        let deployments = resource("apps", "deployments");
        let ingresses = resource("networking.k8s.io", "ingresses");
        let all = Selection::from_flag(Some(&[]));
        assert_eq!(all, Selection::Custom);
        assert!(all.covers(&examples));
        for builtin in [&pods, &deployments, &ingresses] {
            assert!(!all.covers(builtin), "{builtin:?}");
        }
        let named = Selection::from_flag(Some(&["Pods".into(), "examples.demo.capstan.dev".into()]));
        assert!(named.covers(&pods) && named.covers(&examples));
        assert!(!named.covers(&deployments));
        assert!(!named.covers(&resource("other.example.com", "examples")));
        assert!(Selection::from_flag(Some(&["deployments.apps".into()])).covers(&deployments));
        assert!(!Selection::from_flag(None).covers(&examples));
    }

    #[test]
    fn conditions_move_and_keep_their_transition_times() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let mut body = json!({"metadata": {"generation": 3}, "status": {"conditions": [
            {"type": "Mine", "status": "True"}
        ]}});
        let progressing = Summary {
            retrying: vec![("create_fn".into(), "later".into())],
            cause: "creation".into(),
            ..Summary::default()
        };
        apply(&mut body, &progressing, t0);
        let c = by_type(&body);
        assert_eq!(c["Progressing"]["status"], "True");
        assert_eq!(c["Progressing"]["reason"], "Retrying");
        assert_eq!(c["Progressing"]["message"], "Handler 'create_fn': later");
        assert_eq!(c["Ready"]["status"], "False");
        assert_eq!(c["Degraded"]["status"], "False");
        assert_eq!(c["Ready"]["observedGeneration"], 3);
        assert_eq!(c["Ready"]["lastTransitionTime"], "1970-01-12T13:46:40Z");
        assert!(c.contains_key("Mine") && present(&body));

        let t1 = t0 + Duration::from_secs(60);
        let ready = Summary {
            done: true,
            cause: "creation".into(),
            ..Summary::default()
        };
        apply(&mut body, &ready, t1);
        let c = by_type(&body);
        assert_eq!(c["Ready"]["status"], "True");
        assert_eq!(c["Ready"]["lastTransitionTime"], "1970-01-12T13:47:40Z");
        assert_eq!(
            c["Degraded"]["lastTransitionTime"], "1970-01-12T13:46:40Z",
            "unchanged status, unchanged time"
        );
        let before = body.clone();
        apply(&mut body, &ready, t1 + Duration::from_secs(5));
        assert_eq!(body, before, "nothing to write when nothing changed");

        let failed = Summary {
            done: true,
            failed: vec![("create_fn".into(), "no".into())],
            cause: "update".into(),
            ..Summary::default()
        };
        apply(&mut body, &failed, t1);
        let c = by_type(&body);
        assert_eq!(c["Degraded"]["status"], "True");
        assert_eq!(c["Degraded"]["reason"], "HandlerFailed");
        assert_eq!(c["Ready"]["status"], "False");
        assert_eq!(c["Progressing"]["status"], "False");
    }

    #[test]
    fn a_conditions_write_is_guarded_by_the_base_version() {
        let base = json!({"metadata": {"resourceVersion": "b7"}});
        let mut patch = json!({"status": {"conditions": []}});
        guard(&mut patch, &base);
        assert_eq!(patch["metadata"]["resourceVersion"], "b7");
        let mut other = json!({"status": {"phase": "x"}});
        guard(&mut other, &base);
        assert!(other.get("metadata").is_none(), "only writes of the conditions");
    }

    #[test]
    fn a_rebase_keeps_others_conditions_and_applies_ours() {
        let c = |kind: &str, status: &str| json!({"type": kind, "status": status});
        let original = json!({"status": {"conditions": [c("Ready", "False"), c("Old", "True")]}});
        let desired_before =
            json!({"status": {"conditions": [c("Ready", "True"), c("Progressing", "False")]}});
        let fresh =
            json!({"status": {"conditions": [c("Ready", "False"), c("Old", "True"), c("Foreign", "True")]}});
        let mut desired = fresh.clone();
        rebase(&mut desired, &original, &desired_before, &fresh);
        assert_eq!(
            desired["status"]["conditions"],
            json!([
                c("Ready", "True"),
                c("Foreign", "True"),
                c("Progressing", "False")
            ])
        );
    }
}
