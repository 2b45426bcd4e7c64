//! Per-node operators: cleaning up after nodes that are gone.
//!
//! In per-node mode every node's operator keeps its own annotations (and, if enabled, its own
//! finalizer) on the objects. When a Node object is deleted, nobody would ever remove that
//! node's state, so live operators do it without coordinating: each ranks its own node name
//! among the nodes still there (every operator sees the same watch of Nodes). The lowest
//! cleans at once; the next [`CANDIDATES`]` - 1` follow after the fallback delay each and
//! clean only what is still left, which covers a lowest node that runs no operator (a
//! DaemonSet with a node selector) or one that crashes halfway. Cleaning removes the departed
//! node's annotations, status stanza and finalizer from every object of the resources this
//! operator watches — listed whole, page by page, because the watch itself may see only this
//! node's objects (a field selector on `spec.nodeName`); objects that carry nothing of that
//! node cost no request.

use std::{
    collections::{BTreeSet, HashSet},
    sync::Arc,
    time::Duration,
};

use parking_lot::Mutex;
use serde_json::{Map, Value, json};
use tokio::{sync::mpsc, task::JoinSet};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use super::queue::Queue;
use crate::{
    k8s::{
        objects::{self, Objects},
        watch::{self as k8s_watch, Watch},
    },
    model::{EventType, ResolvedResource},
    persistence::{node, node_store::NodeStore},
};

/// How many operators (the lowest node names) take part in cleaning after a deleted node.
pub const CANDIDATES: usize = 3;

/// Attempts per object when its finalizers change under us (409).
const CONFLICT_ATTEMPTS: u32 = 3;

/// Per-node mode.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// This operator's node.
    pub name: String,
    /// The persistence prefix the node prefixes derive from.
    pub base_prefix: String,
    /// How a node's prefix is laid out (`persistence::node::prefix_with`).
    pub prefix_template: String,
    /// Clean up after deleted nodes.
    pub cleanup: bool,
    /// How long each further cleanup candidate waits after the one before it.
    pub fallback_delay: Duration,
    /// The status stanza name the node stanzas derive from.
    pub status_field: String,
}

/// The watched resources: each with the scopes it is watched in (`None`: all namespaces) and
/// its queue, so the cleanup can reach every object of them.
pub type Queues = Arc<Mutex<Vec<(ResolvedResource, Vec<Option<String>>, Queue)>>>;

/// Objects per page when the cleanup lists a resource.
const PAGE: u32 = 500;

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

/// This operator's place among the live nodes (0 = the lowest name), counting itself even
/// when its own Node object is not (yet) there.
pub fn rank(live: &BTreeSet<String>, me: &str) -> usize {
    live.iter().filter(|n| n.as_str() < me).count()
}

/// Watches Nodes and cleans up after each deleted one when this operator is a candidate.
pub async fn run(settings: Settings, objects: Objects, queues: Queues, cancel: CancellationToken) {
    let (tx, mut rx) = mpsc::channel(256);
    let status = k8s_watch::Status::default();
    let watch = Watch::new(
        objects.api(&nodes_resource(), None),
        None,
        None,
        k8s_watch::Settings::default(),
        status.clone(),
    );
    let mut tasks = JoinSet::new();
    tasks.spawn(watch.run(tx, cancel.clone()));
    let live: Arc<Mutex<BTreeSet<String>>> = Arc::default();
    // Nodes deleted while the Nodes are still listed (the watch runs meanwhile): ranked once
    // every live node is known — the listing has ended, and the events it left queued then
    // (`left`) are taken.
    let mut deferred: Vec<String> = Vec::new();
    let mut left: Option<usize> = None;
    let mut synced_check = tokio::time::interval(SYNCED_CHECK);
    synced_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let event = tokio::select! {
            () = cancel.cancelled() => break,
            e = rx.recv() => match e { Some(e) => Some(e), None => break },
            Some(_) = tasks.join_next(), if !tasks.is_empty() => continue,
            _ = synced_check.tick(), if !deferred.is_empty() => None,
        };
        if event.is_some()
            && let Some(n) = left.as_mut()
        {
            *n = n.saturating_sub(1);
        }
        if let Some(e) = &event
            && let Some(name) = e.body.pointer("/metadata/name").and_then(Value::as_str)
        {
            if e.event_type == EventType::Deleted {
                live.lock().remove(name);
                if !deferred.iter().any(|d| d == name) {
                    deferred.push(name.to_owned());
                }
            } else {
                live.lock().insert(name.to_owned());
            }
        }
        if left.is_none() && status.is_synced() {
            left = Some(rx.len());
        }
        if left != Some(0) {
            continue;
        }
        for name in std::mem::take(&mut deferred) {
            if name == settings.name {
                warn!(node = %name, "this operator's own Node was deleted");
                continue;
            }
            let rank = rank(&live.lock(), &settings.name);
            if rank >= CANDIDATES {
                debug!(node = %name, rank, "operators on lower node names clean up after the deleted node");
                continue;
            }
            let sweep = Sweep {
                node: name.clone(),
                prefix: node::prefix_with(&settings.prefix_template, &name, &settings.base_prefix),
                stanza: format!("{}-{}", settings.status_field, node::label(&name)),
                delay: settings.fallback_delay * u32::try_from(rank).unwrap_or(u32::MAX),
                objects: objects.clone(),
                queues: queues.clone(),
                live: live.clone(),
            };
            let stop = cancel.clone();
            tasks.spawn(
                async move {
                    tokio::select! {
                        () = stop.cancelled() => {}
                        () = sweep.run() => {}
                    }
                }
                .instrument(info_span!("node-cleanup", node = %name, rank)),
            );
        }
    }
    tasks.shutdown().await;
}

/// How often Node deletions that came during the Nodes' listing are checked for its end.
const SYNCED_CHECK: Duration = Duration::from_millis(250);

/// Listings of a departed node's objects tried before the sweep falls back to the bodies in
/// memory, and the pause after the first failure (doubled after each).
const LIST_ATTEMPTS: u32 = 4;
const LIST_RETRY_PAUSE: Duration = Duration::from_secs(2);

/// One candidate's cleanup after one deleted node.
struct Sweep {
    node: String,
    prefix: String,
    stanza: String,
    delay: Duration,
    objects: Objects,
    queues: Queues,
    live: Arc<Mutex<BTreeSet<String>>>,
}

impl Sweep {
    async fn run(self) {
        if !self.delay.is_zero() {
            debug!(delay = ?self.delay, "cleaning what lower candidates leave, after a delay");
            tokio::time::sleep(self.delay).await;
        }
        if self.live.lock().contains(&self.node) {
            info!("the deleted node is back; keeping its state");
            return;
        }
        let targets: Vec<(ResolvedResource, Vec<Option<String>>, Queue)> = self.queues.lock().clone();
        let mut cleaned = 0usize;
        for (resource, scopes, queue) in targets {
            // The watch may see only some of the objects (a field selector the API server
            // applies, such as `spec.nodeName`): the departed node's objects are listed whole.
            let mut unlisted = false;
            for scope in scopes {
                match self.sweep_listed_retrying(&resource, scope.as_deref()).await {
                    Ok(n) => cleaned += n,
                    Err(e) => {
                        warn!(%resource, namespace = scope.as_deref().unwrap_or("*"), error = %crate::diagnostic::chain(&e), "listing the objects to clean failed again and again; cleaning those with a body in memory only");
                        unlisted = true;
                    }
                }
            }
            if unlisted {
                cleaned += self.sweep(&resource, queue.bodies()).await;
            }
        }
        if self.delay.is_zero() || cleaned > 0 {
            info!(node = %self.node, objects = cleaned, "cleaned up after the deleted node");
        }
    }
}

impl Sweep {
    /// As [`Self::sweep_listed`], tried [`LIST_ATTEMPTS`] times with growing pauses: the
    /// fallback can clean only the objects whose body is in memory (most objects at rest have
    /// none), so a passing failure of the API server must not leave the node's state behind.
    async fn sweep_listed_retrying(
        &self,
        resource: &ResolvedResource,
        scope: Option<&str>,
    ) -> Result<usize, kube::Error> {
        let mut pause = LIST_RETRY_PAUSE;
        let mut attempt = 1;
        loop {
            match self.sweep_listed(resource, scope).await {
                Err(e) if attempt < LIST_ATTEMPTS => {
                    warn!(%resource, namespace = scope.unwrap_or("*"), error = %crate::diagnostic::chain(&e), retry_in = ?pause, "listing the objects to clean failed; trying again");
                    tokio::time::sleep(pause).await;
                    pause = pause.saturating_mul(2);
                    attempt += 1;
                }
                done => return done,
            }
        }
    }

    /// Cleans every object of `resource` in `scope`, listed page by page without selectors.
    async fn sweep_listed(
        &self,
        resource: &ResolvedResource,
        scope: Option<&str>,
    ) -> Result<usize, kube::Error> {
        let api = self.objects.api(resource, scope);
        let mut params = kube::api::ListParams::default().limit(PAGE);
        let mut cleaned = 0;
        loop {
            let page = api.list(&params).await?;
            let next = page.metadata.continue_.clone().filter(|c| !c.is_empty());
            let bodies = page.items.into_iter().map(objects::to_value).collect();
            cleaned += self.sweep(resource, bodies).await;
            match next {
                Some(token) => params = params.continue_token(&token),
                None => return Ok(cleaned),
            }
        }
    }

    /// Cleans those of `bodies` that carry anything of the node; returns how many.
    async fn sweep(&self, resource: &ResolvedResource, bodies: Vec<Value>) -> usize {
        let mut cleaned = 0;
        for body in bodies {
            // The listed (or cached) body tells which objects carry anything of the node.
            if removal(&body, &self.prefix, &self.stanza) == (None, None) {
                continue;
            }
            match clean(&self.objects, resource, &body, &self.prefix, &self.stanza).await {
                Ok(true) => cleaned += 1,
                Ok(false) => {}
                Err(e) => warn!(error = %crate::diagnostic::chain(&e), "cleaning up an object failed"),
            }
        }
        cleaned
    }
}

/// How long after start the node-local storage is first swept (the watches list meanwhile),
/// and how often after that.
const GARBAGE_FIRST: Duration = Duration::from_secs(60);
const GARBAGE_EVERY: Duration = Duration::from_secs(3600);

/// Removes the node-local state of objects that no longer exist (deleted while this operator
/// was not running, or by a DELETED event it missed): each watched resource is listed whole,
/// and its files of objects not listed go. A resource whose listing fails keeps its files.
pub async fn collect_garbage(
    store: Arc<NodeStore>,
    objects: Objects,
    queues: Queues,
    cancel: CancellationToken,
) {
    let mut delay = GARBAGE_FIRST;
    loop {
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(delay) => {}
        }
        delay = GARBAGE_EVERY;
        let targets: Vec<(ResolvedResource, Vec<Option<String>>)> = queues
            .lock()
            .iter()
            .map(|(r, s, _)| (r.clone(), s.clone()))
            .collect();
        for (resource, scopes) in targets {
            // Files written after the listing began may be of objects it could not see yet.
            let listed_from = std::time::SystemTime::now();
            let mut live = HashSet::new();
            let mut listed = true;
            for scope in &scopes {
                match list_uids(&objects, &resource, scope.as_deref(), &mut live).await {
                    Ok(()) => {}
                    Err(e) => {
                        warn!(%resource, error = %crate::diagnostic::chain(&e), "listing for the node-local storage's sweep failed; its files stay");
                        listed = false;
                    }
                }
            }
            if listed {
                let removed = store.retain(&resource.to_string(), &live, listed_from).await;
                if removed > 0 {
                    info!(%resource, removed, "node-local state of objects that no longer exist removed");
                }
            }
        }
    }
}

/// Adds the uids of every object of `resource` in `scope` to `uids`, page by page.
async fn list_uids(
    objects: &Objects,
    resource: &ResolvedResource,
    scope: Option<&str>,
    uids: &mut HashSet<String>,
) -> Result<(), kube::Error> {
    let api = objects.api(resource, scope);
    let mut params = kube::api::ListParams::default().limit(PAGE);
    loop {
        let page = api.list_metadata(&params).await?;
        uids.extend(page.items.into_iter().filter_map(|o| o.metadata.uid));
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(()),
        }
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
    let mut attempt = 1;
    loop {
        match clean_fresh(objects, resource, &namespace, &name, prefix, stanza).await {
            Err(objects::Error::Conflict(why)) if attempt < CONFLICT_ATTEMPTS => {
                debug!(%name, %why, "the object changed while cleaning; reading it again");
                attempt += 1;
            }
            Err(objects::Error::NotFound) => return Ok(false),
            other => return other,
        }
    }
}

/// One attempt on the freshest version: the queue's copy may predate other writes.
async fn clean_fresh(
    objects: &Objects,
    resource: &ResolvedResource,
    namespace: &str,
    name: &str,
    prefix: &str,
    stanza: &str,
) -> Result<bool, objects::Error> {
    let fresh = objects.get(resource, namespace, name).await?;
    let (object, status) = removal(&fresh, prefix, stanza);
    if object.is_none() && status.is_none() {
        return Ok(false);
    }
    if let Some(status) = status {
        let as_status = resource.status_subresource;
        objects
            .merge_patch(resource, namespace, name, &status, as_status)
            .await?;
    }
    if let Some(object) = object {
        objects
            .merge_patch(resource, namespace, name, &object, false)
            .await?;
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rank_counts_lower_live_names_and_includes_this_node() {
        let live: BTreeSet<String> = ["node-b", "node-d", "node-a"].map(String::from).into();
        assert_eq!(rank(&live, "node-a"), 0);
        assert_eq!(rank(&live, "node-c"), 2, "its own Node need not be listed");
        assert_eq!(rank(&live, "node-d"), 2);
        assert_eq!(rank(&BTreeSet::new(), "x"), 0);
    }

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
