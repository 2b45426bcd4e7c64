//! Posting Kubernetes Events (`core/v1`) about objects, and bumping the count of an Event
//! that repeats.
//!
//! Events of cluster-scoped objects go to the `default` namespace (Events are namespaced).
//! Messages longer than 1024 characters are cut in the middle. An Event about an object
//! named without its uid (a handler posting on another object) gets the uid looked up, so
//! that `kubectl describe` finds it.
//!
//! # Guarantees
//!
//! An Event whose creation fails because the API server did not answer (connection refused or
//! reset, timeout, `429`, `5xx`) is not lost (kopf#513): it waits in a bounded outbox and is
//! posted again with kube-runtime's jittered backoff (0.8 s doubling to 30 s) until the server
//! takes it, one at a time and no faster than [`RETRY_PACE`] apart, so retries stay within the
//! default global Event rate. A repeat of an Event that is still waiting raises its count
//! instead of queueing a copy. When the outbox is full the oldest Event is dropped and counted
//! ([`Events::dropped`]). An Event the server refuses for good (`403`, `422`, …) is not
//! retried. The caller still learns of the first failure and carries on.

use std::{
    collections::VecDeque,
    sync::{
        Arc, Weak,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use k8s_openapi::api::core::v1::Event;
use kube::{
    Api, Client,
    api::{ApiResource, DynamicObject, Patch, PatchParams, PostParams},
    runtime::watcher::DefaultBackoff,
};
use parking_lot::Mutex;
use serde_json::json;
use tracing::{Instrument as _, debug, info, info_span, warn};

use crate::{
    k8s::reachability,
    model::{Posting, ResourceRef},
    persistence::time,
};

/// Events waiting for the API server at most; beyond, the oldest is dropped.
pub const OUTBOX_CAPACITY: usize = 256;

/// The least time between two retried Events (the default global rate of 20 per second).
pub const RETRY_PACE: Duration = Duration::from_millis(50);

/// The longest Event message posted.
pub const MAX_MESSAGE: usize = 1024;

/// Creates and updates Events.
#[derive(Clone)]
pub struct Events {
    client: Client,
    instance: String,
    outbox: Arc<Outbox>,
}

/// Events that wait for the API server to answer again.
#[derive(Default)]
struct Outbox {
    pending: Mutex<Pending>,
    dropped: AtomicU64,
}

#[derive(Default)]
struct Pending {
    events: VecDeque<Event>,
    /// Whether the retrying task runs.
    retrying: bool,
}

/// Where a posted Event lives, to bump its count later.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Posted {
    /// The Event's namespace.
    pub namespace: String,
    /// The Event's name.
    pub name: String,
}

impl Events {
    /// A poster reporting as `instance` (e.g. the pod or host name).
    pub fn new(client: Client, instance: String) -> Self {
        Self {
            client,
            instance,
            outbox: Arc::default(),
        }
    }

    /// How many Events were dropped because the outbox was full.
    pub fn dropped(&self) -> u64 {
        self.outbox.dropped.load(Ordering::Relaxed)
    }

    /// How many Events wait for the API server.
    pub fn waiting(&self) -> usize {
        self.outbox.pending.lock().events.len()
    }

    /// Creates an Event; when the API server does not answer, the Event is kept and posted
    /// again later (see the module docs).
    ///
    /// # Errors
    /// When the API refuses or is unreachable.
    pub async fn create(&self, posting: &Posting) -> Result<Posted, kube::Error> {
        let namespace = if posting.object.namespace.is_empty() {
            "default"
        } else {
            &posting.object.namespace
        };
        let now = time::format(std::time::SystemTime::now());
        let object = &posting.object;
        let uid = if object.uid.is_empty() && !object.name.is_empty() {
            self.uid_of(object).await
        } else {
            Some(object.uid.clone())
        };
        let event: Event = serde_json::from_value(json!({
            "metadata": {
                "generateName": format!("{}.", if object.name.is_empty() { "capstan" } else { &object.name }),
                "namespace": namespace,
            },
            "involvedObject": {
                "apiVersion": object.resource.api_version(),
                "kind": object.resource.kind,
                "name": object.name,
                "namespace": if object.namespace.is_empty() { None } else { Some(&object.namespace) },
                "uid": uid,
            },
            "reason": posting.reason,
            "message": cut(&posting.message),
            "type": posting.type_name(),
            "source": {"component": "capstan"},
            "reportingComponent": "capstan",
            "reportingInstance": self.instance,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }))
        .map_err(kube::Error::SerdeError)?;
        let api: Api<Event> = Api::namespaced(self.client.clone(), namespace);
        match api.create(&PostParams::default(), &event).await {
            Ok(created) => Ok(Posted {
                namespace: namespace.to_owned(),
                name: created.metadata.name.unwrap_or_default(),
            }),
            Err(e) => {
                if reachability::is_unanswered(&e) {
                    self.keep(event);
                }
                Err(e)
            }
        }
    }

    /// Puts an Event into the outbox and makes sure that the retrying task runs.
    fn keep(&self, event: Event) {
        let start = {
            let mut pending = self.outbox.pending.lock();
            if let Some(same) = pending.events.iter_mut().find(|e| same_event(e, &event)) {
                same.count = Some(same.count.unwrap_or(1).saturating_add(1));
                same.last_timestamp.clone_from(&event.last_timestamp);
            } else {
                if pending.events.len() >= OUTBOX_CAPACITY {
                    pending.events.pop_front();
                    let dropped = self.outbox.dropped.fetch_add(1, Ordering::Relaxed) + 1;
                    if dropped.is_power_of_two() {
                        warn!(
                            dropped,
                            "the Event outbox is full; the oldest waiting Events were dropped"
                        );
                    }
                }
                pending.events.push_back(event);
            }
            !std::mem::replace(&mut pending.retrying, true)
        };
        if start {
            debug!("the API server did not take an Event; it is posted again when it answers");
            tokio::spawn(
                retry(self.client.clone(), Arc::downgrade(&self.outbox))
                    .instrument(info_span!("event-outbox")),
            );
        }
    }

    /// The uid of a named object, if it can be read.
    async fn uid_of(&self, object: &ResourceRef) -> Option<String> {
        let r = &object.resource;
        let resource = ApiResource {
            group: r.group.clone(),
            version: r.version.clone(),
            api_version: r.api_version(),
            kind: r.kind.clone(),
            plural: r.plural.clone(),
        };
        let api: Api<DynamicObject> = if object.namespace.is_empty() {
            Api::all_with(self.client.clone(), &resource)
        } else {
            Api::namespaced_with(self.client.clone(), &object.namespace, &resource)
        };
        match api.get_metadata(&object.name).await {
            Ok(meta) => meta.metadata.uid,
            Err(e) => {
                debug!(object = %object, error = %e, "the Event's object could not be read; posting without its uid");
                None
            }
        }
    }

    /// Sets the count and last time of a posted Event.
    ///
    /// # Errors
    /// When the API refuses or is unreachable.
    pub async fn bump(&self, posted: &Posted, count: u32) -> Result<(), kube::Error> {
        let api: Api<Event> = Api::namespaced(self.client.clone(), &posted.namespace);
        let patch = json!({"count": count, "lastTimestamp": time::format(std::time::SystemTime::now())});
        api.patch(&posted.name, &PatchParams::default(), &Patch::Merge(&patch))
            .await?;
        Ok(())
    }
}

/// Posts the outbox's Events until it is empty or every [`Events`] handle is gone (then the
/// waiting Events go with them).
async fn retry(client: Client, outbox: Weak<Outbox>) {
    let mut backoff = DefaultBackoff::default();
    let mut failures = 0u32;
    loop {
        let delay = if failures == 0 {
            RETRY_PACE
        } else {
            backoff.next().unwrap_or(Duration::from_secs(30))
        };
        tokio::time::sleep(delay).await;
        let Some(outbox) = outbox.upgrade() else {
            return;
        };
        let next = {
            let mut pending = outbox.pending.lock();
            let next = pending.events.front().cloned();
            if next.is_none() {
                pending.retrying = false;
            }
            next
        };
        let Some(event) = next else {
            return;
        };
        let namespace = event
            .metadata
            .namespace
            .clone()
            .unwrap_or_else(|| "default".into());
        let api: Api<Event> = Api::namespaced(client.clone(), &namespace);
        let outcome = api.create(&PostParams::default(), &event).await;
        let retry_again = matches!(&outcome, Err(e) if reachability::is_unanswered(e));
        if !retry_again {
            let mut pending = outbox.pending.lock();
            // The front is still this Event unless the full outbox dropped it meanwhile.
            if pending.events.front().is_some_and(|e| same_event(e, &event)) {
                pending.events.pop_front();
            }
        }
        match outcome {
            Ok(_) => {
                if failures > 0 {
                    info!(
                        waited = failures,
                        "the API server takes Events again; posting the waiting ones"
                    );
                }
                failures = 0;
                backoff = DefaultBackoff::default();
            }
            Err(e) if retry_again => {
                failures = failures.saturating_add(1);
                debug!(error = %e, "posting a waiting Event failed again");
            }
            Err(e) => {
                warn!(error = %e, reason = event.reason.as_deref().unwrap_or_default(), "the API server refused a waiting Event; it is dropped")
            }
        }
    }
}

/// Whether two Events say the same thing about the same object.
fn same_event(a: &Event, b: &Event) -> bool {
    a.involved_object == b.involved_object
        && a.reason == b.reason
        && a.message == b.message
        && a.type_ == b.type_
}

/// Cuts a message longer than the limit in the middle, keeping both ends, to exactly the
/// limit as kopf cuts it (511 characters, `...`, the last 510).
pub fn cut(message: &str) -> String {
    if message.chars().count() <= MAX_MESSAGE {
        return message.to_owned();
    }
    let head: String = message.chars().take(MAX_MESSAGE / 2 - 1).collect();
    let tail: String = message
        .chars()
        .rev()
        .take(MAX_MESSAGE / 2 - 2)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    format!("{head}...{tail}")
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU32;

    use http::{Request, Response, StatusCode};
    use kube::client::Body;

    use super::*;
    use crate::model::{Level, Policy, ResolvedResource};

    /// An API that answers `503` to the first `failing` Event posts, then takes them.
    fn flaky(failing: u32) -> (Client, Arc<AtomicU32>, Arc<AtomicU32>) {
        let attempts = Arc::new(AtomicU32::new(0));
        let created = Arc::new(AtomicU32::new(0));
        let (a, c) = (attempts.clone(), created.clone());
        let service = tower::service_fn(move |req: Request<Body>| {
            let (a, c) = (a.clone(), c.clone());
            async move {
                let n = a.fetch_add(1, Ordering::SeqCst);
                let (status, body) = if req.method() != http::Method::POST {
                    (
                        StatusCode::NOT_FOUND,
                        r#"{"kind":"Status","apiVersion":"v1","status":"Failure","code":404}"#.to_owned(),
                    )
                } else if n < failing {
                    (StatusCode::SERVICE_UNAVAILABLE, r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"down","code":503}"#.to_owned())
                } else {
                    c.fetch_add(1, Ordering::SeqCst);
                    (StatusCode::CREATED, r#"{"apiVersion":"v1","kind":"Event","metadata":{"name":"x.1","namespace":"default"},"involvedObject":{}}"#.to_owned())
                };
                let mut response = Response::new(Body::from(body.into_bytes()));
                *response.status_mut() = status;
                Ok::<_, std::convert::Infallible>(response)
            }
        });
        (Client::new(service, "default"), attempts, created)
    }

    fn posting(message: &str) -> Posting {
        Posting {
            object: ResourceRef {
                resource: ResolvedResource {
                    group: "demo.capstan.dev".into(),
                    version: "v1".into(),
                    plural: "examples".into(),
                    kind: "Example".into(),
                    namespaced: true,
                    status_subresource: false,
                },
                namespace: "default".into(),
                name: "one".into(),
                uid: "u1".into(),
                ..ResourceRef::default()
            },
            level: Level::Info,
            reason: "Logging".into(),
            message: message.into(),
            policy: Policy::ByLevel,
            event_type: None,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn an_event_the_server_did_not_take_is_posted_when_it_answers_again() {
        let (client, _, created) = flaky(3);
        let events = Events::new(client, "test".into());
        assert!(events.create(&posting("hello")).await.is_err());
        assert!(
            events.create(&posting("hello")).await.is_err(),
            "a repeat is folded in"
        );
        assert_eq!(events.waiting(), 1);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
        while created.load(Ordering::SeqCst) == 0 {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the waiting Event was never posted"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(created.load(Ordering::SeqCst), 1);
        assert_eq!(events.waiting(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_outbox_drops_the_oldest_and_counts() {
        let (client, _, _) = flaky(u32::MAX);
        let events = Events::new(client, "test".into());
        for n in 0..OUTBOX_CAPACITY + 3 {
            let _ = events.create(&posting(&format!("message {n}"))).await;
        }
        assert_eq!(events.waiting(), OUTBOX_CAPACITY);
        assert_eq!(events.dropped(), 3);
        let first = events
            .outbox
            .pending
            .lock()
            .events
            .front()
            .and_then(|e| e.message.clone());
        assert_eq!(first.as_deref(), Some("message 3"));
    }

    #[test]
    fn long_messages_are_cut_in_the_middle() {
        let long = format!("{}{}", "a".repeat(2000), "z".repeat(10));
        let cut = cut(&long);
        assert_eq!(cut.chars().count(), MAX_MESSAGE);
        assert_eq!(cut.find("..."), Some(511));
        assert!(cut.starts_with("aaa") && cut.ends_with("zzz") && cut.contains("..."));
        assert_eq!(super::cut("short"), "short");
    }
}
