//! The write path: turns a cycle's plan into API writes — the finalizer change, one PATCH of
//! the object and one of `/status` where the resource has that subresource — and retries what
//! can be retried without re-running any handler.
//!
//! `engine::queue` decides *when* an object is processed and calls [`Writer::write`] with the
//! plan `engine::processing` composed; daemons and timers use [`patch_object`] for their own
//! patches. Conflicts re-read the object and rebase the plan's changes on it; a patch the API
//! server refuses is traced back to the handler whose changes caused it (server-side dry runs),
//! which gets a failed attempt instead.

use std::{borrow::Cow, time::Duration};

use serde_json::{Map, Value};
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::processing::{self, FinalizerChange, Plan, Storage, merge_diff};
use crate::{
    k8s::objects::{self, Objects},
    model::ResolvedResource,
};

/// Conflicts re-read the object at once this many times, then with a growing delay.
const CONFLICTS_BEFORE_BACKOFF: u32 = 10;

/// How often a dry run that the API server failed to answer is tried.
const DRY_RUN_TRIES: u32 = 3;

/// The delay before the `attempt`-th retry of a write: 1, 4, 9, 16, then 25 s.
fn retry_delay(attempt: u32) -> Duration {
    Duration::from_secs(u64::from(attempt.clamp(1, 5)).pow(2))
}

/// Writes the plans of one resource's objects.
pub struct Writer {
    /// Reads and writes objects.
    pub objects: Objects,
    /// The resource.
    pub resource: ResolvedResource,
    /// Storage configuration (the finalizer's name, progress records).
    pub storage: Storage,
    /// Cancelled at shutdown: retries stop.
    pub cancel: CancellationToken,
}

/// What became of a plan's write.
pub enum Written {
    /// Written; the body as stored.
    Stored(Value),
    /// Nothing was to be written.
    Nothing,
    /// The object is gone.
    Gone,
    /// Not written (shutdown).
    Failed,
    /// The API server refused the write for good (with its message), even without the
    /// handlers' patches: the same write would be refused again.
    Refused(String),
}

impl Written {
    /// Whether the plan's changes are on the object now (written, or nothing to write).
    pub fn landed(&self) -> bool {
        matches!(self, Self::Stored(_) | Self::Nothing)
    }
}

/// The API server's message when it refused a write for good — the same request will never
/// succeed: invalid content (400, 422), a body too large for the server (413) or for etcd, a
/// method or media type it does not take (405, 415). Everything else may pass later
/// (conflicts, 403 until the RBAC is fixed, 429, 5xx, transport errors).
pub fn refusal(e: &objects::Error) -> Option<String> {
    match e {
        objects::Error::Invalid(message) => Some(message.clone()),
        objects::Error::Unavailable(kube::Error::Api(status))
            if matches!(status.code, 405 | 413 | 414 | 415)
                || status.message.contains("request is too large") =>
        {
            Some(format!("{} ({})", status.message, status.code))
        }
        _ => None,
    }
}

impl Writer {
    /// Writes a plan: the finalizer, then the object and status changes, retrying conflicts and
    /// unavailability without re-running any handler.
    pub async fn write(&self, body: &Value, plan: &Plan) -> Written {
        // Borrowed until a conflict rebases them: while a write waits for the API server, its
        // cycle holds no more copies of the object than its plan.
        let mut desired = Cow::Borrowed(&plan.desired);
        let mut base = Cow::Borrowed(&plan.base);
        let mut attempts = 0u32;
        let mut isolated = false;
        if desired.is_none() && plan.finalizer == FinalizerChange::Keep {
            return Written::Nothing;
        }
        loop {
            attempts += 1;
            match self.write_once(&base, (*desired).as_ref(), plan.finalizer).await {
                // The last finalizer of a deleting object went: the API server deleted it, and
                // answered with the object as it was, at the version this write was based on.
                // Events of that version still to come predate the write; none may run a
                // handler again.
                // Nothing to send to the API server (the changes were node-local records).
                Ok(None) => return Written::Nothing,
                Ok(Some(stored)) if released(&stored) => {
                    debug!("the object's last finalizer was removed; it is gone");
                    return Written::Gone;
                }
                Ok(Some(stored)) => return Written::Stored(stored),
                Err(objects::Error::NotFound) => {
                    debug!("object deleted meanwhile; dropped");
                    return Written::Gone;
                }
                Err(objects::Error::Conflict(message)) => {
                    debug!(%message, "conflict; re-reading the object");
                    // An object that changes all the time: re-read, but not in a tight loop.
                    if attempts >= CONFLICTS_BEFORE_BACKOFF {
                        let delay = retry_delay(attempts - CONFLICTS_BEFORE_BACKOFF);
                        tokio::select! {
                            () = self.cancel.cancelled() => return Written::Failed,
                            () = tokio::time::sleep(delay) => {}
                        }
                    }
                    let (ns, name) = identity(body);
                    match self.objects.get(&self.resource, &ns, &name).await {
                        // Deleted and created again under the same name: not this object.
                        Ok(fresh) if uid_of(&fresh) != uid_of(body) => return Written::Gone,
                        Ok(mut fresh) => {
                            // Node-local records are not on the object: the fresh body gets them
                            // as the cycle's body had them, so the rebased write keeps them all.
                            if let Some(local) = self.storage.local.as_deref()
                                && local
                                    .overlay(uid_of(body).unwrap_or_default(), &mut fresh)
                                    .await
                                    .is_err()
                            {
                                local.carry(&base, &mut fresh);
                            }
                            if let Some(d) = desired.to_mut().as_mut() {
                                rebase(d, &base, &fresh);
                            }
                            base = Cow::Owned(fresh);
                        }
                        Err(objects::Error::NotFound) => return Written::Gone,
                        Err(e) => warn!(error = %e, "re-reading after a conflict failed"),
                    }
                }
                Err(e) if let Some(message) = refusal(&e) => {
                    if plan.patched.is_empty() || isolated {
                        self.change_finalizer_alone(&base, plan.finalizer).await;
                        return Written::Refused(message);
                    }
                    warn!(%message, "the API server rejected the handlers' patch; finding which handler's patch it was");
                    desired = Cow::Owned(Some(self.isolate(plan, &base, &message).await));
                    isolated = true;
                }
                Err(e) => {
                    if self.cancel.is_cancelled() {
                        return Written::Failed;
                    }
                    let delay = retry_delay(attempts);
                    warn!(error = %crate::diagnostic::chain(&e), retry_in = ?delay, "writing the object failed; retrying");
                    tokio::select! {
                        () = self.cancel.cancelled() => return Written::Failed,
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }

    /// After a refused write: the finalizer change of the plan still happens on its own, so
    /// that a finished deletion does not leave the object terminating and a new one keeps its
    /// delete handlers due.
    async fn change_finalizer_alone(&self, base: &Value, change: FinalizerChange) {
        if change == FinalizerChange::Keep {
            return;
        }
        if let Err(e) = self.write_once(base, None, change).await {
            warn!(error = %crate::diagnostic::chain(&e), ?change, "the finalizer change alone failed too");
        }
    }

    /// After a rejected write: adds the handlers' changes one by one (validated with a
    /// server-side dry run) and records the ones the API server refuses as failed attempts.
    async fn isolate(&self, plan: &Plan, base: &Value, message: &str) -> Value {
        let storage = &self.storage;
        let Some(mut body) = plan.fallback.clone() else {
            return base.clone();
        };
        for p in &plan.patched {
            let mut candidate = body.clone();
            processing::accept(p, storage, &mut candidate);
            match self.dry_run_patiently(base, &candidate).await {
                Ok(()) => body = candidate,
                Err(e) if let Some(reason) = refusal(&e) => {
                    warn!(handler.id = %p.registration.id, %reason, "the API server rejected this handler's patch");
                    processing::reject(p, storage, &reason, &mut body);
                }
                Err(e) => {
                    // Not the handler's fault: its patch is kept; if it was the refused one,
                    // the write is refused again and reported as the cycle's.
                    warn!(handler.id = %p.registration.id, error = %crate::diagnostic::chain(&e), refused = message, "could not validate this handler's patch; kept");
                    body = candidate;
                }
            }
        }
        body
    }

    /// A dry run, tried again a few times when the API server fails to answer it (only a
    /// refusal is a verdict on the patch).
    async fn dry_run_patiently(&self, base: &Value, candidate: &Value) -> Result<(), objects::Error> {
        let mut tries = 0u32;
        loop {
            tries += 1;
            match self.dry_run(base, candidate).await {
                Err(e) if refusal(&e).is_none() && tries < DRY_RUN_TRIES => {
                    tokio::select! {
                        () = self.cancel.cancelled() => return Err(e),
                        () = tokio::time::sleep(retry_delay(tries)) => {}
                    }
                }
                result => return result,
            }
        }
    }

    async fn dry_run(&self, base: &Value, candidate: &Value) -> Result<(), objects::Error> {
        let (ns, name) = identity(base);
        let resource = &self.resource;
        let (mut base, mut candidate) = (base.clone(), candidate.clone());
        if let Some(local) = self.storage.local.as_deref() {
            local.detach(&mut base);
            local.detach(&mut candidate);
        }
        let Some(mut patch) = merge_diff(&base, &candidate) else {
            return Ok(());
        };
        strip_server_fields(&mut patch);
        if resource.status_subresource
            && let Some(status) = patch.as_object_mut().and_then(|p| p.remove("status"))
        {
            let status_patch = serde_json::json!({ "status": status });
            self.objects
                .merge_patch_dry_run(resource, &ns, &name, &status_patch, true)
                .await?;
        }
        if patch.as_object().is_some_and(|p| !p.is_empty()) {
            self.objects
                .merge_patch_dry_run(resource, &ns, &name, &patch, false)
                .await?;
        }
        Ok(())
    }

    /// Writes once; the object as the API server stored it, or `None` when there was nothing
    /// to send to it.
    pub(crate) async fn write_once(
        &self,
        base: &Value,
        desired: Option<&Value>,
        finalizer: FinalizerChange,
    ) -> Result<Option<Value>, objects::Error> {
        let Some(local) = self.storage.local.as_deref() else {
            return self.write_remote(base, desired, finalizer).await;
        };
        // Node-local storage: the node's records stay out of the PATCH, and are kept on the
        // node once the API server took the rest (a crash in between repeats a handler; it
        // never loses one's patch).
        let uid = uid_of(base).unwrap_or_default();
        let mut remote_base = base.clone();
        // An object that still carries the node's records on itself (from before the store)
        // gets them removed by this write: the base keeps them, the desired body does not.
        let migrating = desired.is_some() && local.migrating(uid);
        if !migrating {
            local.detach(&mut remote_base);
        }
        let mut remote_desired = desired.cloned();
        let state = remote_desired.as_mut().map(|d| local.detach(d));
        let stored = self
            .write_remote(&remote_base, remote_desired.as_ref(), finalizer)
            .await?;
        if let Some(state) = state {
            keep_locally(local, &self.resource, base, state).await;
        }
        if migrating {
            local.migrated(uid);
        }
        Ok(stored)
    }

    /// Writes to the API server what changed from `base` to `desired` and the finalizer; the
    /// object as stored, or `None` when nothing changed.
    async fn write_remote(
        &self,
        base: &Value,
        desired: Option<&Value>,
        finalizer: FinalizerChange,
    ) -> Result<Option<Value>, objects::Error> {
        let (ns, name) = identity(base);
        let resource = &self.resource;
        let mut patch = desired
            .and_then(|d| merge_diff(base, d))
            .unwrap_or(Value::Object(Map::new()));
        strip_server_fields(&mut patch);
        keep_finalizer(&mut patch, base, desired, &self.storage.keys.finalizer, finalizer);
        let stored = write_patch(&self.objects, resource, (&ns, &name), patch, base, desired).await?;
        if finalizer == FinalizerChange::Add {
            info!("finalizer added");
        } else if finalizer == FinalizerChange::Remove {
            info!("finalizer removed");
        }
        Ok(stored)
    }
}

/// Writes the changes from `base` to `desired` (no finalizer change): one `/status` PATCH
/// where the resource has a status subresource and status changed, one PATCH for the rest.
/// Our finalizer (`finalizer`) stays whatever the patches in `desired` did to it.
pub(crate) async fn patch_object(
    objects: &Objects,
    resource: &ResolvedResource,
    finalizer: &str,
    base: &Value,
    desired: &Value,
) -> Result<Value, objects::Error> {
    let (ns, name) = identity(base);
    let Some(mut patch) = merge_diff(base, desired) else {
        return Ok(base.clone());
    };
    strip_server_fields(&mut patch);
    keep_finalizer(&mut patch, base, Some(desired), finalizer, FinalizerChange::Keep);
    Ok(
        write_patch(objects, resource, (&ns, &name), patch, base, Some(desired))
            .await?
            .unwrap_or_else(|| base.clone()),
    )
}

/// Writes `patch` (split into its `/status` part where the resource has that subresource); a
/// write of the status conditions is guarded by `base`'s version (see
/// [`super::conditions::guard`]).
async fn write_patch(
    objects: &Objects,
    resource: &ResolvedResource,
    (ns, name): (&str, &str),
    mut patch: Value,
    base: &Value,
    desired: Option<&Value>,
) -> Result<Option<Value>, objects::Error> {
    let status = if resource.status_subresource {
        patch.as_object_mut().and_then(|p| p.remove("status"))
    } else {
        None
    };
    let mut stored = None;
    let metrics = crate::observability::metrics::global();
    if let Some(status) = status {
        let mut status_patch = serde_json::json!({ "status": status });
        super::conditions::guard(&mut status_patch, base);
        metrics.api_write(&resource.plural);
        stored = Some(
            objects
                .merge_patch(resource, ns, name, &status_patch, true)
                .await?,
        );
    }
    if patch.as_object().is_some_and(|p| !p.is_empty()) {
        super::conditions::guard(&mut patch, base);
        metrics.api_write(&resource.plural);
        let result = objects.merge_patch(resource, ns, name, &patch, false).await?;
        if let Some(d) = desired {
            report_dropped_fields(&patch, &result, d);
        }
        stored = Some(result);
    }
    Ok(stored)
}

impl processing::Checkpoint for Writer {
    fn save<'a>(
        &'a self,
        base: &'a Value,
        desired: &'a Value,
    ) -> futures::future::BoxFuture<'a, Option<Value>> {
        Box::pin(async move {
            match self.write_once(base, Some(desired), FinalizerChange::Keep).await {
                Ok(stored) => Some(stored.unwrap_or_else(|| base.clone())),
                Err(e) => {
                    debug!(error = %crate::diagnostic::chain(&e), "checkpoint not written; the final write will carry it");
                    None
                }
            }
        })
    }
}

/// Keeps an object's node-local records (`state`) in the node's store; a failure is reported,
/// and the store keeps the records in memory until a retry writes them (the object is not
/// processed meanwhile, so its handlers do not run again).
pub(crate) async fn keep_locally(
    local: &crate::persistence::node_store::NodeStore,
    resource: &ResolvedResource,
    body: &Value,
    state: Map<String, Value>,
) {
    let uid = body
        .pointer("/metadata/uid")
        .and_then(Value::as_str)
        .unwrap_or_default();
    if let Err(e) = local.persist(uid, &resource.to_string(), body, state).await {
        warn!(error = %crate::diagnostic::chain(&e), "the node-local state was not written; it is kept in memory and written again before the object is processed");
    }
}

/// The uid of a body.
fn uid_of(body: &Value) -> Option<&str> {
    body.pointer("/metadata/uid").and_then(Value::as_str)
}

/// Whether a stored body is of an object the API server deleted: marked for deletion, with no
/// finalizer left to wait for and no grace period running (a Pod in graceful deletion exists
/// without finalizers until its kubelet confirms).
fn released(stored: &Value) -> bool {
    let graceful = stored
        .pointer("/metadata/deletionGracePeriodSeconds")
        .and_then(Value::as_i64)
        .is_some_and(|s| s > 0);
    let deleting = !graceful
        && stored
            .pointer("/metadata/deletionTimestamp")
            .is_some_and(|v| !v.is_null());
    let finalizers = stored
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .is_some_and(|f| !f.is_empty());
    deleting && !finalizers
}

/// Makes the patch's finalizer list what `change` says about ours, whatever the handlers'
/// patches in `desired` did to the list: a handler may add or remove other finalizers, but
/// ours goes only with [`FinalizerChange::Remove`] — in the same write, so that no version of
/// the object lacks it while delete handlers are due. Adding or removing ours is guarded by
/// the base's `resourceVersion` (another controller may change the list meanwhile).
fn keep_finalizer(
    patch: &mut Value,
    base: &Value,
    desired: Option<&Value>,
    ours: &str,
    change: FinalizerChange,
) {
    let list_of = |body: &Value| -> Vec<Value> {
        body.pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default()
    };
    let before = list_of(base);
    let had = before.iter().any(|f| f.as_str() == Some(ours));
    let mut list = desired.map_or_else(|| before.clone(), list_of);
    let present = list.iter().any(|f| f.as_str() == Some(ours));
    let wanted = match change {
        FinalizerChange::Add => true,
        FinalizerChange::Remove => false,
        FinalizerChange::Keep => had,
    };
    if wanted && !present {
        list.push(Value::String(ours.to_owned()));
    } else if !wanted && present {
        list.retain(|f| f.as_str() != Some(ours));
    }
    if list == before && change == FinalizerChange::Keep {
        if let Some(meta) = patch.get_mut("metadata").and_then(Value::as_object_mut) {
            meta.remove("finalizers");
            if meta.is_empty()
                && let Some(p) = patch.as_object_mut()
            {
                p.remove("metadata");
            }
        }
        return;
    }
    let meta = processing_object(patch, "metadata");
    meta.insert("finalizers".into(), Value::Array(list));
    if change != FinalizerChange::Keep
        && let Some(rv) = base.pointer("/metadata/resourceVersion")
    {
        meta.insert("resourceVersion".into(), rv.clone());
    }
}

/// Removes metadata the server owns from a patch: a stale `resourceVersion` would turn the
/// patch into a conflicting optimistic lock.
fn strip_server_fields(patch: &mut Value) {
    if let Some(meta) = patch.get_mut("metadata").and_then(Value::as_object_mut) {
        for key in [
            "resourceVersion",
            "generation",
            "managedFields",
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "selfLink",
            "name",
            "namespace",
        ] {
            meta.remove(key);
        }
        if meta.is_empty()
            && let Some(p) = patch.as_object_mut()
        {
            p.remove("metadata");
        }
    }
}

fn identity(body: &Value) -> (String, String) {
    let get = |k: &str| {
        body.pointer(&format!("/metadata/{k}"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned()
    };
    (get("namespace"), get("name"))
}

fn processing_object<'a>(patch: &'a mut Value, key: &str) -> &'a mut Map<String, Value> {
    crate::persistence::progress::object_at(patch, &[key])
}

/// Re-applies the changes from `original` to `desired` on top of a freshly read body.
fn rebase(desired: &mut Value, original: &Value, fresh: &Value) {
    if let Some(changes) = merge_diff(original, desired) {
        let mut rebased = fresh.clone();
        json_patch::merge(&mut rebased, &changes);
        // A merge replaces the conditions list whole: merged by type instead, so that others'
        // conditions written meanwhile stay.
        if changes.pointer("/status/conditions").is_some() {
            super::conditions::rebase(&mut rebased, original, desired, fresh);
        }
        *desired = rebased;
    }
}

/// Warns about patched fields that did not stick (pruned by the schema or read-only).
fn report_dropped_fields(patch: &Value, stored: &Value, desired: &Value) {
    let mut dropped = Vec::new();
    walk_dropped(&mut Vec::new(), patch, stored, desired, &mut dropped);
    if !dropped.is_empty() {
        warn!(fields = %dropped.join(", "), "some patched fields did not stick (pruned by the schema or read-only)");
    }
}

fn walk_dropped(
    path: &mut Vec<String>,
    patch: &Value,
    stored: &Value,
    desired: &Value,
    out: &mut Vec<String>,
) {
    match patch {
        Value::Object(p) => {
            for (k, v) in p {
                if path.is_empty() && k == "metadata" {
                    continue;
                }
                path.push(k.clone());
                let s = stored.get(k).unwrap_or(&Value::Null);
                let d = desired.get(k).unwrap_or(&Value::Null);
                walk_dropped(path, v, s, d, out);
                path.pop();
            }
        }
        Value::Null => {}
        _ => {
            if stored != desired {
                out.push(path.join("."));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn merge_diff_adds_changes_and_nulls_removals() {
        let a = json!({"metadata": {"annotations": {"x": "1", "y": "2"}}, "spec": {"a": [1]}});
        let b = json!({"metadata": {"annotations": {"x": "1", "z": "3"}}, "spec": {"a": [1, 2]}});
        assert_eq!(
            merge_diff(&a, &b),
            Some(json!({"metadata": {"annotations": {"y": null, "z": "3"}}, "spec": {"a": [1, 2]}}))
        );
        assert_eq!(merge_diff(&a, &a), None);
    }

    #[test]
    fn rebase_keeps_our_changes_on_a_fresh_body() {
        let original = json!({"metadata": {"annotations": {"a": "1"}}, "spec": {"x": 1}});
        let mut desired = json!({"metadata": {"annotations": {"a": "1", "ours": "yes"}}, "spec": {"x": 1}});
        let fresh = json!({"metadata": {"annotations": {"a": "1", "theirs": "t"}}, "spec": {"x": 2}});
        rebase(&mut desired, &original, &fresh);
        assert_eq!(
            desired,
            json!({"metadata": {"annotations": {"a": "1", "ours": "yes", "theirs": "t"}}, "spec": {"x": 2}})
        );
    }

    #[test]
    fn our_finalizer_survives_handler_patches_and_goes_only_when_removed() {
        let ours = "capstan.dev/finalizer";
        let base = json!({"metadata": {"resourceVersion": "7", "finalizers": ["other", ours]}});
        // A handler patch that drops every finalizer keeps ours, in the same patch.
        let dropped = json!({"metadata": {"resourceVersion": "7"}, "spec": {"x": 1}});
        let mut patch = merge_diff(&base, &dropped).unwrap_or_default();
        keep_finalizer(&mut patch, &base, Some(&dropped), ours, FinalizerChange::Keep);
        assert_eq!(
            patch,
            json!({"metadata": {"finalizers": [ours]}, "spec": {"x": 1}})
        );
        // Nulling the list while only ours is on it changes nothing.
        let only = json!({"metadata": {"finalizers": [ours]}});
        let nulled = json!({"metadata": {}});
        let mut patch = merge_diff(&only, &nulled).unwrap_or_default();
        keep_finalizer(&mut patch, &only, Some(&nulled), ours, FinalizerChange::Keep);
        assert_eq!(patch, json!({}));
        // Removal is ours to make, with the optimistic lock.
        let mut patch = json!({});
        keep_finalizer(&mut patch, &base, None, ours, FinalizerChange::Remove);
        assert_eq!(
            patch,
            json!({"metadata": {"finalizers": ["other"], "resourceVersion": "7"}})
        );
        let mut patch = json!({});
        keep_finalizer(
            &mut patch,
            &json!({"metadata": {}}),
            None,
            ours,
            FinalizerChange::Add,
        );
        assert_eq!(patch, json!({"metadata": {"finalizers": [ours]}}));
    }

    #[test]
    fn permanent_refusals_are_told_from_passing_failures() {
        let api = |code: u16, message: &str| {
            objects::Error::from(kube::Error::Api(
                kube::core::Status::failure(message, "").with_code(code).boxed(),
            ))
        };
        assert!(refusal(&api(413, "Request entity too large: limit is 3145728")).is_some());
        assert!(refusal(&api(422, "metadata.annotations: Invalid value")).is_some());
        assert!(refusal(&api(500, "etcdserver: request is too large")).is_some());
        assert!(refusal(&api(500, "internal error")).is_none());
        assert!(refusal(&api(429, "slow down")).is_none());
        assert!(refusal(&api(409, "conflict")).is_none());
        assert!(refusal(&api(403, "forbidden")).is_none());
        // Admission may say otherwise later (a freeze window, a locked namespace): retried.
        let webhook = r#"admission webhook "freeze.example.com" denied the request: frozen"#;
        assert!(refusal(&api(400, webhook)).is_none());
        assert!(matches!(api(400, webhook), objects::Error::Denied(_)));
        let policy = "ValidatingAdmissionPolicy 'locked' with binding 'b' denied request: locked";
        assert!(refusal(&api(422, policy)).is_none());
    }

    #[test]
    fn dropped_fields_are_found() {
        let patch = json!({"spec": {"kept": 1, "pruned": 2}});
        let stored = json!({"spec": {"kept": 1}});
        let desired = json!({"spec": {"kept": 1, "pruned": 2}});
        let mut out = Vec::new();
        walk_dropped(&mut Vec::new(), &patch, &stored, &desired, &mut out);
        assert_eq!(out, vec!["spec.pruned"]);
    }
}
