//! `capstan retry`: asks the controller to run failed or delayed handlers of an object again
//! now, through the retry request annotation (`persistence::retry`).
//!
//! The command reads the object first, so that it can answer at once when there is nothing
//! to retry (every record done, or no records: the last change is fully handled) and list the
//! handlers that do have records when the one asked for has none. Otherwise it writes the
//! request with one merge patch and leaves the rest to the controller: the request names who
//! asked — the user the API server authenticates (a `SelfSubjectReview`), or `user@host` when
//! the server does not answer that — and the controller records it in its Event.
//!
//! Once a change is complete its records are gone (kopf purges them, a permanent failure's
//! included); `--handler ID` then still writes the request, and the controller runs that
//! handler again for the object as it is (`engine::processing::cycle`).
//!
//! Records are found as `capstan status` finds them (`persistence::survey`); `--node`
//! addresses a per-node operator's records and request (`<node>.<prefix>`).

use std::time::SystemTime;

use kube::{
    Client,
    api::{Patch, PatchParams},
};
use serde_json::json;

use crate::{
    inspection::{self, State},
    persistence::{
        Keys,
        keys::KOPF_PREFIX,
        node,
        retry::{self, Request},
        survey::{self, Scope},
        time,
    },
};

/// Why `capstan retry` could not ask.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Reading the object failed (unknown resource, permission, not found).
    #[error(transparent)]
    Read(#[from] inspection::Error),
    /// The handler asked for has no record on the object.
    #[error("{object} has no record of handler {handler:?}; handlers with records: {known}")]
    UnknownHandler {
        /// The object.
        object: String,
        /// The handler asked for.
        handler: String,
        /// The handlers that have records, with their states.
        known: String,
    },
    /// Records of several operators are on the object and none was chosen.
    #[error("{object} carries records of several operators ({owners}); choose one with --prefix")]
    Ambiguous {
        /// The object.
        object: String,
        /// Their prefixes.
        owners: String,
    },
    /// Writing the request failed.
    #[error("cannot write the retry request")]
    Write(#[source] inspection::Error),
}

/// The result type of this module.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What to retry.
#[derive(Clone, Debug)]
pub struct Ask {
    /// The resource, as kubectl takes it.
    pub resource: String,
    /// The object's name.
    pub name: String,
    /// Its namespace; `None`: the kubeconfig context's.
    pub namespace: Option<String>,
    /// The handlers; empty: every failed or delayed one.
    pub handlers: Vec<String>,
    /// The node of a per-node operator.
    pub node: Option<String>,
    /// The operator's storage prefix; `None`: the one whose records the object carries.
    pub prefix: Option<String>,
    /// How per-node operators lay out their prefixes (`persistence::node`).
    pub node_template: String,
}

/// Writes the retry request, or says why there is nothing to retry; returns the lines to print.
///
/// # Errors
/// See [`Error`].
pub async fn retry(client: Client, ask: &Ask) -> Result<Vec<String>> {
    let resource = inspection::resolve(&client, &ask.resource).await?;
    let namespace = resource.namespaced.then(|| {
        ask.namespace
            .clone()
            .unwrap_or_else(|| client.default_namespace().to_owned())
    });
    let api = inspection::api(&client, &resource, namespace.as_deref());
    let object = match &namespace {
        Some(ns) => format!(
            "{}/{} in namespace {ns}",
            inspection::qualified(&resource),
            ask.name
        ),
        None => format!("{}/{}", inspection::qualified(&resource), ask.name),
    };
    let body =
        crate::k8s::objects::to_value(api.get(&ask.name).await.map_err(|e| {
            inspection::api_error(e, "get", &resource, namespace.as_deref(), Some(&ask.name))
        })?);
    let node_label = ask
        .node
        .as_deref()
        .map(|n| survey::node_label(&ask.node_template, n));
    let mut scope = Scope {
        node_template: ask.node_template.clone(),
        ..Scope::default()
    };
    if let Some(p) = &ask.prefix {
        scope.prefixes = vec![p.clone()];
    }
    let found: Vec<survey::Found> = survey::records(&scope, &body)
        .into_iter()
        .filter(|f| f.node == node_label)
        .collect();
    let base = match &ask.prefix {
        Some(p) => p.clone(),
        None => owner_prefix(&object, &found)?,
    };
    let keys = match &ask.node {
        Some(n) => keys_for(&node::prefix_with(&ask.node_template, n, &base), &base),
        None => keys_for(&base, &base),
    };
    let retryable = |f: &survey::Found| {
        matches!(
            f.record.as_ref().map(inspection::state),
            Ok(State::Failed | State::Retrying)
        )
    };
    let mut wanted = Vec::new();
    for handler in &ask.handlers {
        let matching: Vec<&survey::Found> = found
            .iter()
            .filter(|f| &f.handler == handler || retry::names(handler, &keys).contains(&f.handler))
            .collect();
        // No records at all: the last change is complete (kopf purges its records, a
        // permanent failure's too). The controller runs a handler named so again for the
        // object as it is, and its Event says whether it has a handler of that name.
        if found.is_empty() {
            wanted.push(handler.clone());
            continue;
        }
        if matching.is_empty() {
            return Err(Error::UnknownHandler {
                object,
                handler: handler.clone(),
                known: known(&found),
            });
        }
        if matching.iter().any(|f| retryable(f)) {
            wanted.push(handler.clone());
        }
    }
    let any = if ask.handlers.is_empty() {
        found.iter().any(retryable)
    } else {
        !wanted.is_empty()
    };
    // A node's operator with node-local storage (`--node-storage`) keeps its records in files
    // on the node: the object carries neither its records nor its diff-base. The request is
    // written all the same; the controller consumes it and its Event says what ran.
    let node_local = ask.node.is_some()
        && found.is_empty()
        && !survey::diffbases(&scope, &body)
            .iter()
            .any(|h| h.node == node_label && h.owner == base);
    if !any && !node_local {
        let why = if found.is_empty() {
            "it has no handler records (its last change is fully handled, or was never handled); --handler ID runs a handler of the last change again, even one that failed for good".to_owned()
        } else {
            format!(
                "no handler asked for has failed or waits for a retry ({})",
                known(&found)
            )
        };
        return Ok(vec![format!("Nothing to retry on {object}: {why}.")]);
    }
    let request = Request {
        handlers: wanted.clone(),
        requested_by: requester(&client).await,
        requested_at: Some(time::format(SystemTime::now())),
    };
    let patch = json!({"metadata": {"annotations": {retry::key(&keys): retry::encode(&request)}}});
    api.patch(&ask.name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|e| {
            Error::Write(inspection::api_error(
                e,
                "patch",
                &resource,
                namespace.as_deref(),
                Some(&ask.name),
            ))
        })?;
    let what = if wanted.is_empty() {
        "every failed or delayed handler".to_owned()
    } else {
        wanted.join(", ")
    };
    let mut lines = vec![format!(
        "Retry of {what} requested on {object} (annotation {}); the controller runs it in its next cycle.",
        retry::key(&keys)
    )];
    if node_local {
        lines.push(format!(
            "The object carries no records of node {}'s operator: with node-local storage (--node-storage) they are in files on that node, so whether anything is to retry is known only there; the controller's Event on the object (reason RetryRequested) says what ran.",
            ask.node.as_deref().unwrap_or_default()
        ));
    }
    Ok(lines)
}

/// The prefix of the only operator whose annotation records the object carries.
fn owner_prefix(object: &str, found: &[survey::Found]) -> Result<String> {
    let mut owners: Vec<&str> = found
        .iter()
        .filter(|f| matches!(f.place, survey::Place::Annotation(_)))
        .map(|f| f.owner.as_str())
        .collect();
    owners.sort_unstable();
    owners.dedup();
    match owners.as_slice() {
        [] => Ok(Scope::default().prefixes.into_iter().next().unwrap_or_default()),
        [one] => Ok((*one).to_owned()),
        many => Err(Error::Ambiguous {
            object: object.to_owned(),
            owners: many.join(", "),
        }),
    }
}

/// The key names of an operator storing under `prefix` (kopf's for kopf's prefix).
fn keys_for(prefix: &str, base: &str) -> Keys {
    if base == KOPF_PREFIX {
        Keys::kopf_under(prefix)
    } else {
        Keys::new(prefix)
    }
}

/// `id (state), …` of the records found.
fn known(found: &[survey::Found]) -> String {
    if found.is_empty() {
        return "none".into();
    }
    found
        .iter()
        .map(|f| {
            let state = f
                .record
                .as_ref()
                .map_or(State::Malformed, inspection::state)
                .word();
            format!("{} ({state})", f.handler)
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// Who is asking: the authenticated user, or `user@host`.
async fn requester(client: &Client) -> String {
    let user = crate::k8s::client::username(client).await;
    let mut who = user.unwrap_or_else(crate::peering::commands::user_identity);
    who.truncate(
        (0..=retry::MAX_TEXT.min(who.len()))
            .rev()
            .find(|i| who.is_char_boundary(*i))
            .unwrap_or(0),
    );
    who
}
