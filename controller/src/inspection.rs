//! `capstan status`: what the handlers of each object have done, read from the objects.
//!
//! All handler state lives on the objects (`persistence`), so a terminal with a kubeconfig
//! can explain an operator without asking it: this command lists or gets objects through the
//! API, finds every progress record on them with [`persistence::survey`] — Capstan's
//! annotations, status and smart storages, every node's records in per-node mode, and kopf's
//! own records, so objects handled by kopf are explained too — and reports per object and
//! handler whether it is done, running, waiting for a retry (and until when) or failed for
//! good, with its attempts and last message. Daemons and timers keep no records on objects
//! (as in kopf); what is visible of them is the finalizer that holds their object.
//!
//! Every problem is reported in words, never as a crash: an unknown resource, a missing
//! permission (with the verb and the resource, as `kubectl auth can-i` wants them), an object
//! that does not exist, and a record that does not decode (shown as `malformed`, with the
//! reason, next to the records that do). Rendering is in `render`.

pub mod render;

use std::time::SystemTime;

use kube::{
    Client,
    api::{Api, DynamicObject, ListParams},
};
use serde::Serialize;
use serde_json::Value;

use crate::{
    k8s::{discovery::Discovery, objects},
    model::{ResolvedResource, ResourceSelector},
    persistence::{
        ProgressRecord,
        survey::{self, Scope},
        time,
    },
};

/// How long discovery results are reused within one command (one call in practice).
const DISCOVERY_TTL: std::time::Duration = std::time::Duration::from_secs(30);
/// The most objects listed per page.
const PAGE: u32 = 500;

/// Why `capstan status` could not report.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The resource is not served (or ambiguous, or discovery failed).
    #[error("cannot find the resource {resource:?} (give a plural, kind, short name, or plural.group)")]
    Resource {
        /// What was asked for.
        resource: String,
        /// Why.
        #[source]
        source: crate::k8s::discovery::Error,
    },
    /// The API server refused the read.
    #[error(
        "forbidden: cannot {verb} {resource}{scope} (check with: kubectl auth can-i {verb} {resource}{scope_flag}): {message}"
    )]
    Forbidden {
        /// get or list.
        verb: &'static str,
        /// The resource, `plural.group`.
        resource: String,
        /// ` in namespace X`, or empty.
        scope: String,
        /// ` -n X`, or empty.
        scope_flag: String,
        /// The server's message.
        message: String,
    },
    /// The named object does not exist.
    #[error("{resource} {name:?} not found{scope}")]
    NotFound {
        /// The resource.
        resource: String,
        /// The object's name.
        name: String,
        /// ` in namespace X`, or empty.
        scope: String,
    },
    /// Any other API failure.
    #[error("cannot read {resource}")]
    Api {
        /// The resource.
        resource: String,
        /// The cause.
        #[source]
        source: kube::Error,
    },
    /// The report could not be rendered.
    #[error("cannot render the report")]
    Render(#[source] render::Error),
    /// The member Leases of a sharded operator could not be read.
    #[error("cannot read the member leases of ring {ring:?} in namespace {namespace}")]
    Ring {
        /// The ring's name.
        ring: String,
        /// Its namespace.
        namespace: String,
        /// The cause.
        #[source]
        source: crate::k8s::members::Error,
    },
}

/// The result type of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Which namespaces to read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Namespaces {
    /// The kubeconfig context's namespace (or `default`).
    Current,
    /// This one.
    One(String),
    /// All of them.
    All,
}

/// What to report on.
#[derive(Clone, Debug)]
pub struct Query {
    /// The resource, as kubectl takes it (`examples`, `Example`, `examples.demo.capstan.dev`).
    pub resource: String,
    /// One object, or all of them.
    pub name: Option<String>,
    /// Where.
    pub namespaces: Namespaces,
    /// A label selector for listing.
    pub selector: Option<String>,
    /// Whose records.
    pub scope: Scope,
    /// A sharded operator's ring (name, and namespace or the context's): each object's member
    /// is reported.
    pub ring: Option<(String, Option<String>)>,
}

/// The report on one object.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct ObjectReport {
    /// The namespace; absent for cluster-scoped objects.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// The name.
    pub name: String,
    /// The member of a sharded operator that handles it (with a ring asked for).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub member: Option<String>,
    /// `metadata.generation`.
    pub generation: i64,
    /// Operators (prefix or status field, and node) that finished handling a change of it.
    pub handled_by: Vec<String>,
    /// Finalizers of the operators in scope (delete handlers, daemons or timers hold it).
    pub finalizers: Vec<String>,
    /// The object is being deleted.
    pub deleting: bool,
    /// Its handlers' records.
    pub handlers: Vec<HandlerReport>,
}

/// What one handler's record says.
#[derive(Clone, Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HandlerReport {
    /// The handler id as stored.
    pub handler: String,
    /// The node of a per-node operator.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub node: Option<String>,
    /// The prefix or status field of the operator that wrote it.
    pub owner: String,
    /// Where the record is.
    pub stored_in: String,
    /// The state.
    pub state: State,
    /// Attempts made.
    pub retries: u32,
    /// The cause the record is for (create, update, delete, resume).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub purpose: Option<String>,
    /// When the first attempt started.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub started: Option<String>,
    /// When it finished.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
    /// The earliest time of the next attempt, while waiting for a retry.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_attempt: Option<String>,
    /// Seconds until the next attempt (negative: overdue).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_attempt_in_seconds: Option<i64>,
    /// The last message (the error of the last failed attempt).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Attempts lost with their handler process in a row (the poison-pill guard's count).
    #[serde(skip_serializing_if = "is_zero")]
    pub lost: u32,
}

#[allow(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde's skip_serializing_if signature"
)]
fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Where a handler stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum State {
    /// Finished successfully (its cause still has other handlers to run).
    Done,
    /// Started, not finished, no retry scheduled: an attempt is running or about to.
    Running,
    /// An attempt failed; the next one is scheduled.
    Retrying,
    /// Failed for good (permanent error, retries or timeout exhausted).
    Failed,
    /// The record does not decode.
    Malformed,
}

impl State {
    /// The word shown in tables.
    pub fn word(self) -> &'static str {
        match self {
            Self::Done => "done",
            Self::Running => "running",
            Self::Retrying => "retrying",
            Self::Failed => "failed",
            Self::Malformed => "malformed",
        }
    }
}

/// Reads the objects and reports on them.
///
/// # Errors
/// See [`Error`]; malformed records are part of the report, not errors.
pub async fn report(client: Client, query: &Query) -> Result<Vec<ObjectReport>> {
    let resource = resolve(&client, &query.resource).await?;
    let namespace = match (&query.namespaces, resource.namespaced) {
        (_, false) | (Namespaces::All, true) => None,
        (Namespaces::One(ns), true) => Some(ns.clone()),
        (Namespaces::Current, true) => Some(client.default_namespace().to_owned()),
    };
    let ring = match &query.ring {
        Some((name, ns)) => Some(ring(&client, name, ns.as_deref()).await?),
        None => None,
    };
    let bodies = read(&client, &resource, namespace.as_deref(), query).await?;
    let now = SystemTime::now();
    Ok(bodies
        .iter()
        .map(|body| {
            let mut report = object_report(&query.scope, body, now);
            if let Some(ring) = &ring {
                let uid = body
                    .pointer("/metadata/uid")
                    .and_then(Value::as_str)
                    .unwrap_or_default();
                report.member = Some(ring.owner_of(uid).unwrap_or("-").to_owned());
            }
            report
        })
        .collect())
}

/// The ring of a sharded operator as its member Leases say now: the members whose Lease was
/// renewed within its duration (by this machine's clock: a report, not a decision).
async fn ring(client: &Client, name: &str, namespace: Option<&str>) -> Result<crate::sharding::ring::Ring> {
    let namespace = namespace.unwrap_or(client.default_namespace()).to_owned();
    let members = crate::k8s::members::Members::new(client.clone(), &namespace, name)
        .list()
        .await
        .map_err(|source| Error::Ring {
            ring: name.to_owned(),
            namespace: namespace.clone(),
            source,
        })?;
    let now = SystemTime::now();
    Ok(crate::sharding::ring::Ring::new(
        members
            .into_iter()
            .filter(|m| m.renewed.is_some_and(|at| at + m.duration > now))
            .map(|m| m.identity),
    ))
}

/// Resolves a resource as kubectl names it.
///
/// # Errors
/// [`Error::Resource`].
pub async fn resolve(client: &Client, resource: &str) -> Result<ResolvedResource> {
    let selector = ResourceSelector {
        name: resource.to_owned(),
        ..ResourceSelector::default()
    };
    Discovery::new(client.clone(), DISCOVERY_TTL)
        .resolve(&selector)
        .await
        .map_err(|source| Error::Resource {
            resource: resource.to_owned(),
            source,
        })
}

/// The API of `resource` in `namespace` (all namespaces, or cluster-scoped, when `None`).
pub fn api(client: &Client, resource: &ResolvedResource, namespace: Option<&str>) -> Api<DynamicObject> {
    objects::Objects::new(client.clone()).api(resource, namespace)
}

/// Classifies an API failure of `verb` on `resource`.
pub fn api_error(
    error: kube::Error,
    verb: &'static str,
    resource: &ResolvedResource,
    namespace: Option<&str>,
    name: Option<&str>,
) -> Error {
    let resource_name = qualified(resource);
    let scope = namespace
        .map(|ns| format!(" in namespace {ns}"))
        .unwrap_or_default();
    match &error {
        kube::Error::Api(status) if status.code == 403 => Error::Forbidden {
            verb,
            resource: resource_name,
            scope_flag: namespace.map(|ns| format!(" -n {ns}")).unwrap_or_default(),
            scope,
            message: status.message.clone(),
        },
        kube::Error::Api(status) if status.code == 404 && name.is_some() => Error::NotFound {
            resource: resource_name,
            name: name.unwrap_or_default().to_owned(),
            scope,
        },
        _ => Error::Api {
            resource: resource_name,
            source: error,
        },
    }
}

/// `plural.group` (just `plural` for the core group), as kubectl and RBAC name it.
pub fn qualified(resource: &ResolvedResource) -> String {
    if resource.group.is_empty() {
        resource.plural.clone()
    } else {
        format!("{}.{}", resource.plural, resource.group)
    }
}

async fn read(
    client: &Client,
    resource: &ResolvedResource,
    namespace: Option<&str>,
    query: &Query,
) -> Result<Vec<Value>> {
    let api = api(client, resource, namespace);
    if let Some(name) = &query.name {
        // A named object in all namespaces is looked up by a field selector.
        if namespace.is_none() && resource.namespaced {
            let lp = ListParams::default().fields(&format!("metadata.name={name}"));
            let list = api
                .list(&lp)
                .await
                .map_err(|e| api_error(e, "list", resource, namespace, None))?;
            if list.items.is_empty() {
                return Err(Error::NotFound {
                    resource: qualified(resource),
                    name: name.clone(),
                    scope: " in any namespace".into(),
                });
            }
            return Ok(list.items.into_iter().map(objects::to_value).collect());
        }
        let obj = api
            .get(name)
            .await
            .map_err(|e| api_error(e, "get", resource, namespace, Some(name)))?;
        return Ok(vec![objects::to_value(obj)]);
    }
    let mut out = Vec::new();
    let mut lp = ListParams::default().limit(PAGE);
    if let Some(selector) = &query.selector {
        lp = lp.labels(selector);
    }
    loop {
        let list = api
            .list(&lp)
            .await
            .map_err(|e| api_error(e, "list", resource, namespace, None))?;
        out.extend(list.items.into_iter().map(objects::to_value));
        match list.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => lp = lp.continue_token(&token),
            None => break,
        }
    }
    Ok(out)
}

/// The report on one object body.
pub fn object_report(scope: &Scope, body: &Value, now: SystemTime) -> ObjectReport {
    let text = |p: &str| body.pointer(p).and_then(Value::as_str).map(str::to_owned);
    let handled_by = survey::diffbases(scope, body)
        .into_iter()
        .map(|h| match h.node {
            Some(node) => format!("{} (node {node})", h.owner),
            None => h.owner,
        })
        .collect();
    let finalizers = body
        .pointer("/metadata/finalizers")
        .and_then(Value::as_array)
        .map(|f| {
            f.iter()
                .filter_map(Value::as_str)
                .filter(|f| ours(scope, f))
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    ObjectReport {
        namespace: text("/metadata/namespace"),
        name: text("/metadata/name").unwrap_or_default(),
        member: None,
        generation: body
            .pointer("/metadata/generation")
            .and_then(Value::as_i64)
            .unwrap_or(0),
        handled_by,
        finalizers,
        deleting: body.pointer("/metadata/deletionTimestamp").is_some(),
        handlers: survey::records(scope, body)
            .into_iter()
            .map(|found| handler_report(found, now))
            .collect(),
    }
}

/// Whether a finalizer is one of the scope's operators' (theirs, per node, or kopf's).
fn ours(scope: &Scope, finalizer: &str) -> bool {
    finalizer == crate::persistence::keys::KOPF_FINALIZER
        || finalizer.split_once('/').is_some_and(|(prefix, _)| {
            scope
                .prefixes
                .iter()
                .any(|p| prefix == p || prefix.ends_with(&format!(".{p}")))
        })
}

fn handler_report(found: survey::Found, now: SystemTime) -> HandlerReport {
    let stored_in = found.place.to_string();
    let mut report = HandlerReport {
        handler: found.handler,
        node: found.node,
        owner: found.owner,
        stored_in,
        state: State::Malformed,
        retries: 0,
        purpose: None,
        started: None,
        stopped: None,
        next_attempt: None,
        next_attempt_in_seconds: None,
        message: None,
        lost: 0,
    };
    match found.record {
        Ok(record) => {
            report.state = state(&record);
            if report.state == State::Retrying
                && let Some(at) = record.delayed_until()
            {
                report.next_attempt = Some(time::format(at));
                report.next_attempt_in_seconds = Some(seconds_between(now, at));
            }
            report.retries = record.retries;
            report.purpose = record.purpose;
            report.started = record.started;
            report.stopped = record.stopped;
            report.message = record.message;
            report.lost = record.lost;
        }
        Err(why) => report.message = Some(why),
    }
    report
}

/// A record's state.
pub fn state(record: &ProgressRecord) -> State {
    if record.success {
        State::Done
    } else if record.failure {
        State::Failed
    } else if record.delayed.is_some() {
        State::Retrying
    } else {
        State::Running
    }
}

/// Whole seconds from `now` to `at`, negative when `at` has passed.
fn seconds_between(now: SystemTime, at: SystemTime) -> i64 {
    match at.duration_since(now) {
        Ok(ahead) => i64::try_from(ahead.as_secs()).unwrap_or(i64::MAX),
        Err(behind) => i64::try_from(behind.duration().as_secs()).map_or(i64::MIN, |s| -s),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use serde_json::json;

    use super::*;

    #[test]
    fn states_follow_the_records() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000);
        let later = time::format(now + Duration::from_secs(30));
        let body = json!({"metadata": {
            "name": "x", "namespace": "ns", "generation": 2,
            "finalizers": ["capstan.dev/finalizer", "other/keep"],
            "annotations": {
                "capstan.dev/a": r#"{"retries":1,"success":true,"failure":false}"#,
                "capstan.dev/b": format!(r#"{{"retries":2,"delayed":"{later}","message":"try later"}}"#),
                "capstan.dev/c": r#"{"retries":1,"failure":true,"message":"no"}"#,
                "capstan.dev/d": r#"{"started":"1970-01-01T00:16:40.000000+00:00"}"#,
                "capstan.dev/e": "[]",
            }
        }});
        let report = object_report(&Scope::default(), &body, now);
        let states: Vec<(&str, State)> = report
            .handlers
            .iter()
            .map(|h| (h.handler.as_str(), h.state))
            .collect();
        assert_eq!(
            states,
            [
                ("a", State::Done),
                ("b", State::Retrying),
                ("c", State::Failed),
                ("d", State::Running),
                ("e", State::Malformed)
            ]
        );
        assert_eq!(report.handlers[1].next_attempt_in_seconds, Some(30));
        assert_eq!(report.finalizers, ["capstan.dev/finalizer"]);
        assert!(report.handled_by.is_empty());
        assert!(
            report.handlers[4]
                .message
                .as_deref()
                .unwrap_or_default()
                .contains("not a progress record")
        );
    }
}
