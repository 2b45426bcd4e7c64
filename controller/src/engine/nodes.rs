//! Per-node operators: cleaning up after nodes that are gone.
//!
//! In per-node mode every node's operator keeps its own annotations (and, if enabled, its own
//! finalizer) on the objects. When a Node object is deleted, nobody would ever remove that
//! node's state, so one live operator does it: the one whose node name is the lowest among
//! the nodes still there (every operator can tell, from the same watch of Nodes, whether it is
//! that one, without coordinating). It removes the departed node's annotations, status stanza
//! and finalizer from every object it knows, in one PATCH per object.

use std::{collections::BTreeSet, sync::Arc};

use parking_lot::Mutex;
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::queue::Queue;
use crate::{
    k8s::{
        objects::{self, Objects},
        watch::{self as k8s_watch, Watch},
    },
    model::{EventType, ResolvedResource},
    persistence::node,
};

/// Per-node mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// This operator's node.
    pub name: String,
    /// The persistence prefix the node prefixes derive from.
    pub base_prefix: String,
    /// Clean up after deleted nodes.
    pub cleanup: bool,
    /// The status stanza name the node stanzas derive from.
    pub status_field: String,
}

/// The queues of all watched resources, so the cleanup can reach every known object.
pub type Queues = Arc<Mutex<Vec<(ResolvedResource, Queue)>>>;

/// The Node resource.
pub fn nodes_resource() -> ResolvedResource {
    ResolvedResource {
        group: String::new(),
        version: "v1".into(),
        plural: "nodes".into(),
        kind: "Node".into(),
        namespaced: false,
        status_subresource: true,
    }
}

/// Watches Nodes and cleans up after each deleted one when this operator is the one to do it.
pub async fn run(settings: Settings, objects: Objects, queues: Queues, cancel: CancellationToken) {
    let (tx, mut rx) = mpsc::channel(256);
    let watch = Watch::new(
        objects.api(&nodes_resource(), None),
        None,
        None,
        k8s_watch::Settings::default(),
        k8s_watch::Status::default(),
    );
    tokio::spawn(watch.run(tx, cancel.clone()));
    let mut live: BTreeSet<String> = BTreeSet::new();
    loop {
        let event = tokio::select! {
            () = cancel.cancelled() => return,
            e = rx.recv() => match e { Some(e) => e, None => return },
        };
        let Some(name) = event
            .body
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .map(str::to_owned)
        else {
            continue;
        };
        if event.event_type != EventType::Deleted {
            live.insert(name);
            continue;
        }
        live.remove(&name);
        if name == settings.name {
            warn!(node = %name, "this operator's own Node was deleted");
            continue;
        }
        let cleaner = live
            .iter()
            .chain(std::iter::once(&settings.name))
            .min()
            .cloned()
            .unwrap_or_default();
        if cleaner != settings.name {
            debug!(node = %name, %cleaner, "another operator cleans up after the deleted node");
            continue;
        }
        info!(node = %name, "node deleted; removing its state from all objects");
        let targets: Vec<(ResolvedResource, Vec<Value>)> = queues
            .lock()
            .iter()
            .map(|(r, q)| (r.clone(), q.bodies()))
            .collect();
        let prefix = node::prefix(&name, &settings.base_prefix);
        let stanza = format!("{}-{}", settings.status_field, node::label(&name));
        let mut cleaned = 0usize;
        for (resource, bodies) in targets {
            for body in bodies {
                match clean(&objects, &resource, &body, &prefix, &stanza).await {
                    Ok(true) => cleaned += 1,
                    Ok(false) => {}
                    Err(e) => warn!(error = %crate::error::chain(&e), "cleaning up an object failed"),
                }
            }
        }
        info!(node = %name, objects = cleaned, "cleaned up after the deleted node");
    }
}

/// The patches that remove `prefix`'s annotations, finalizer and status stanza from `body`:
/// (object patch, status patch).
pub fn removal(body: &Value, prefix: &str, stanza: &str) -> (Option<Value>, Option<Value>) {
    let owned = |k: &str| k.split_once('/').is_some_and(|(p, _)| p == prefix);
    let mut annotations = Map::new();
    if let Some(a) = body.pointer("/metadata/annotations").and_then(Value::as_object) {
        for key in a.keys().filter(|k| owned(k)) {
            annotations.insert(key.clone(), Value::Null);
        }
    }
    let finalizers: Vec<Value> = body
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let kept: Vec<Value> = finalizers
        .iter()
        .filter(|f| !f.as_str().is_some_and(owned))
        .cloned()
        .collect();
    let mut metadata = Map::new();
    if !annotations.is_empty() {
        metadata.insert("annotations".into(), Value::Object(annotations));
    }
    if kept.len() != finalizers.len() {
        metadata.insert("finalizers".into(), Value::Array(kept));
        if let Some(rv) = body.pointer("/metadata/resourceVersion") {
            metadata.insert("resourceVersion".into(), rv.clone());
        }
    }
    let object = (!metadata.is_empty()).then(|| json!({ "metadata": metadata }));
    let status = body
        .pointer(&format!("/status/{stanza}"))
        .map(|_| json!({"status": {stanza: null}}));
    (object, status)
}

async fn clean(
    objects: &Objects,
    resource: &ResolvedResource,
    body: &Value,
    prefix: &str,
    stanza: &str,
) -> Result<bool, objects::Error> {
    let meta = |k: &str| {
        body.pointer(&format!("/metadata/{k}"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    let (namespace, name) = (meta("namespace"), meta("name"));
    // Work on the freshest version: the queue's copy may predate other writes.
    let fresh = match objects.get(resource, &namespace, &name).await {
        Ok(fresh) => fresh,
        Err(objects::Error::NotFound) => return Ok(false),
        Err(e) => return Err(e),
    };
    let (object, status) = removal(&fresh, prefix, stanza);
    if object.is_none() && status.is_none() {
        return Ok(false);
    }
    if let Some(status) = status {
        let as_status = resource.status_subresource;
        objects
            .merge_patch(resource, &namespace, &name, &status, as_status)
            .await?;
    }
    if let Some(object) = object {
        objects
            .merge_patch(resource, &namespace, &name, &object, false)
            .await?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removes_only_the_departed_nodes_state() {
        let body = json!({"metadata": {
            "resourceVersion": "7",
            "annotations": {
                "node-a.capstan.dev/create_fn": "{}",
                "node-a.capstan.dev/last-handled-configuration": "{}",
                "node-b.capstan.dev/create_fn": "{}",
                "team": "x"
            },
            "finalizers": ["node-a.capstan.dev/finalizer", "node-b.capstan.dev/finalizer"]
        }, "status": {"capstan-node-a": {"progress": {}}, "capstan-node-b": {}}});
        let (object, status) = removal(&body, "node-a.capstan.dev", "capstan-node-a");
        assert_eq!(
            object.unwrap(),
            json!({"metadata": {
                "annotations": {"node-a.capstan.dev/create_fn": null, "node-a.capstan.dev/last-handled-configuration": null},
                "finalizers": ["node-b.capstan.dev/finalizer"],
                "resourceVersion": "7"
            }})
        );
        assert_eq!(status.unwrap(), json!({"status": {"capstan-node-a": null}}));
        assert_eq!(
            removal(&body, "node-c.capstan.dev", "capstan-node-c"),
            (None, None)
        );
    }
}
