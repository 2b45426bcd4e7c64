//! Watching one resource (in one namespace or cluster-wide): list, then watch with bookmarks,
//! relist on `410 Gone`, and restart any watch that fails or goes silent.
//!
//! kopf's most reported failure is a watch that silently hangs or dies and is never restarted.
//! Here a watch that delivers nothing at all (not even a bookmark) for the inactivity timeout
//! is restarted, any failure is retried with backoff, and the watch's state is exposed to the
//! liveness probe while it is down. Lists are paginated to keep the peak memory of a large
//! initial list small; objects vanished during a relist are reported as deleted.

use std::{collections::HashMap, sync::Arc, time::Duration};

use futures::{StreamExt, TryStreamExt};
use kube::{
    Api,
    api::{DynamicObject, ListParams, WatchEvent, WatchParams},
};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::objects::to_value;
use crate::model::EventType;

/// Tunables of a watch.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Restart a watch that delivers nothing for this long. Default 5 min.
    pub inactivity_timeout: Duration,
    /// Objects per list page. Default 500.
    pub page_size: u32,
    /// Server-side timeout of each watch request. Default 290 s.
    pub server_timeout: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            inactivity_timeout: Duration::from_secs(300),
            page_size: 500,
            server_timeout: 290,
        }
    }
}

/// One event for the engine.
#[derive(Clone, Debug)]
pub struct Event {
    /// What happened; `Listing` for objects seen in a (re)list.
    pub event_type: EventType,
    /// The object, without managed fields.
    pub body: Value,
}

/// The liveness of one watch, shared with the health endpoint.
#[derive(Clone, Debug, Default)]
pub struct Status {
    inner: Arc<Mutex<StatusInner>>,
}

#[derive(Debug, Default)]
struct StatusInner {
    up: bool,
    synced: bool,
    problem: Option<String>,
}

impl Status {
    /// Whether the watch is established (or being re-established after a normal end).
    pub fn is_up(&self) -> bool {
        self.inner.lock().up
    }

    /// Whether the initial listing completed at least once.
    pub fn is_synced(&self) -> bool {
        self.inner.lock().synced
    }

    /// Why the watch is down, if it is.
    pub fn problem(&self) -> Option<String> {
        self.inner.lock().problem.clone()
    }

    fn set_up(&self, synced: bool) {
        let mut s = self.inner.lock();
        s.up = true;
        s.synced |= synced;
        s.problem = None;
    }

    fn set_down(&self, problem: String) {
        let mut s = self.inner.lock();
        s.up = false;
        s.problem = Some(problem);
    }
}

/// A watch on one resource and scope.
pub struct Watch {
    api: Api<DynamicObject>,
    label_selector: Option<String>,
    field_selector: Option<String>,
    settings: Settings,
    status: Status,
    /// Known objects by uid: (namespace, name), for reporting objects that vanished between
    /// a watch's end and the relist.
    known: HashMap<String, (String, String)>,
}

enum Restart {
    Relist,
    Rewatch,
}

impl Watch {
    /// A watch on `api`.
    pub fn new(
        api: Api<DynamicObject>,
        label_selector: Option<String>,
        field_selector: Option<String>,
        settings: Settings,
        status: Status,
    ) -> Self {
        Self {
            api,
            label_selector,
            field_selector,
            settings,
            status,
            known: HashMap::new(),
        }
    }

    /// Runs until `cancel` fires or the receiver goes away.
    pub async fn run(mut self, tx: mpsc::Sender<Event>, cancel: CancellationToken) {
        let mut failures = 0u32;
        'relist: loop {
            let rv = tokio::select! {
                () = cancel.cancelled() => return,
                listed = self.list(&tx) => match listed {
                    Ok(Some(rv)) => rv,
                    Ok(None) => return,
                    Err(e) if is_bad_request(&e) && self.field_selector.is_some() => {
                        // Custom resources accept field selectors only on metadata.name,
                        // metadata.namespace and the CRD's selectableFields; the handlers'
                        // selectors are checked in the controller as well, so nothing is lost.
                        warn!(
                            field_selector = self.field_selector.as_deref().unwrap_or_default(),
                            error = %e,
                            "the API server refuses this field selector for the resource (declare the field in \
                             the CRD's selectableFields to filter on the server); filtering in the controller"
                        );
                        self.field_selector = None;
                        continue 'relist;
                    }
                    Err(e) => {
                        failures += 1;
                        let delay = backoff(failures);
                        warn!(error = %e, retry_in = ?delay, "listing failed");
                        self.status.set_down(format!("listing failed: {e}"));
                        if sleep_or_cancel(delay, &cancel).await { return }
                        continue 'relist;
                    }
                },
            };
            failures = 0;
            self.status.set_up(true);
            let mut rv = rv;
            loop {
                match self.watch(&tx, &mut rv, &cancel).await {
                    None => return,
                    Some(Restart::Relist) => continue 'relist,
                    Some(Restart::Rewatch) => {}
                }
            }
        }
    }

    /// Lists all objects page by page; returns the list's resourceVersion, or `None` when the
    /// receiver is gone.
    async fn list(&mut self, tx: &mpsc::Sender<Event>) -> Result<Option<String>, kube::Error> {
        let mut params = ListParams::default().limit(self.settings.page_size);
        if let Some(l) = &self.label_selector {
            params = params.labels(l);
        }
        if let Some(f) = &self.field_selector {
            params = params.fields(f);
        }
        let mut seen: HashMap<String, (String, String)> = HashMap::new();
        let mut rv = String::new();
        loop {
            let page =
                match tokio::time::timeout(self.settings.inactivity_timeout, self.api.list(&params)).await {
                    Ok(page) => page?,
                    Err(_) => {
                        return Err(kube::Error::Service(Box::new(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            format!("listing hung for {:?}", self.settings.inactivity_timeout),
                        ))));
                    }
                };
            rv = page.metadata.resource_version.clone().unwrap_or(rv);
            for obj in page.items {
                if let Some(uid) = obj.metadata.uid.clone() {
                    seen.insert(
                        uid,
                        (
                            obj.metadata.namespace.clone().unwrap_or_default(),
                            obj.metadata.name.clone().unwrap_or_default(),
                        ),
                    );
                }
                if tx
                    .send(Event {
                        event_type: EventType::Listing,
                        body: to_value(obj),
                    })
                    .await
                    .is_err()
                {
                    return Ok(None);
                }
            }
            match page.metadata.continue_.filter(|c| !c.is_empty()) {
                Some(token) => params.continue_token = Some(token),
                None => break,
            }
        }
        let vanished: Vec<(String, (String, String))> = self
            .known
            .drain()
            .filter(|(uid, _)| !seen.contains_key(uid))
            .collect();
        for (uid, (namespace, name)) in vanished {
            debug!(%uid, %name, "object vanished while the watch was down");
            let body = json!({"metadata": {"uid": uid, "name": name, "namespace": namespace}});
            if tx
                .send(Event {
                    event_type: EventType::Deleted,
                    body,
                })
                .await
                .is_err()
            {
                return Ok(None);
            }
        }
        self.known = seen;
        info!(objects = self.known.len(), "listed");
        Ok(Some(rv))
    }

    async fn watch(
        &mut self,
        tx: &mpsc::Sender<Event>,
        rv: &mut String,
        cancel: &CancellationToken,
    ) -> Option<Restart> {
        let mut params = WatchParams::default().timeout(self.settings.server_timeout);
        if let Some(l) = &self.label_selector {
            params = params.labels(l);
        }
        if let Some(f) = &self.field_selector {
            params = params.fields(f);
        }
        let stream = tokio::select! {
            () = cancel.cancelled() => return None,
            s = tokio::time::timeout(self.settings.inactivity_timeout, self.api.watch(&params, rv)) => s,
        };
        let Ok(stream) = stream else {
            warn!(timeout = ?self.settings.inactivity_timeout, "starting the watch hung; retrying");
            self.status.set_down("starting the watch hung".into());
            return Some(Restart::Rewatch);
        };
        let mut stream = match stream {
            Ok(s) => s.boxed(),
            Err(e) => {
                warn!(error = %e, "starting the watch failed");
                self.status.set_down(format!("watch failed to start: {e}"));
                if sleep_or_cancel(Duration::from_secs(1), cancel).await {
                    return None;
                }
                return Some(if is_gone(&e) {
                    Restart::Relist
                } else {
                    Restart::Rewatch
                });
            }
        };
        self.status.set_up(false);
        loop {
            let next = tokio::select! {
                () = cancel.cancelled() => return None,
                n = tokio::time::timeout(self.settings.inactivity_timeout, stream.try_next()) => n,
            };
            let event = match next {
                Err(_) => {
                    warn!(silent_for = ?self.settings.inactivity_timeout, "watch went silent; restarting it");
                    self.status.set_down("watch went silent".into());
                    return Some(Restart::Rewatch);
                }
                Ok(Ok(Some(e))) => e,
                Ok(Ok(None)) => return Some(Restart::Rewatch),
                Ok(Err(e)) => {
                    warn!(error = %e, "watch stream failed; restarting it");
                    self.status.set_down(format!("watch stream failed: {e}"));
                    let _ = sleep_or_cancel(Duration::from_millis(500), cancel).await;
                    return Some(Restart::Rewatch);
                }
            };
            let (event_type, obj) = match event {
                WatchEvent::Added(o) => (EventType::Added, o),
                WatchEvent::Modified(o) => (EventType::Modified, o),
                WatchEvent::Deleted(o) => (EventType::Deleted, o),
                WatchEvent::Bookmark(b) => {
                    *rv = b.metadata.resource_version;
                    self.status.set_up(false);
                    continue;
                }
                WatchEvent::Error(e) if e.code == 410 => {
                    debug!("watch expired (410 Gone); relisting");
                    return Some(Restart::Relist);
                }
                WatchEvent::Error(e) => {
                    warn!(code = e.code, message = %e.message, "watch error; restarting it");
                    self.status
                        .set_down(format!("watch error {}: {}", e.code, e.message));
                    return Some(Restart::Rewatch);
                }
            };
            self.status.set_up(false);
            if let Some(v) = &obj.metadata.resource_version {
                rv.clone_from(v);
            }
            if let Some(uid) = obj.metadata.uid.clone() {
                if event_type == EventType::Deleted {
                    self.known.remove(&uid);
                } else {
                    self.known.insert(
                        uid,
                        (
                            obj.metadata.namespace.clone().unwrap_or_default(),
                            obj.metadata.name.clone().unwrap_or_default(),
                        ),
                    );
                }
            }
            if tx
                .send(Event {
                    event_type,
                    body: to_value(obj),
                })
                .await
                .is_err()
            {
                return None;
            }
        }
    }
}

fn is_gone(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 410)
}

fn is_bad_request(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 400)
}

fn backoff(failures: u32) -> Duration {
    Duration::from_secs(u64::from(failures.min(6)).pow(2).clamp(1, 30))
}

/// Sleeps; returns true when cancelled first.
async fn sleep_or_cancel(d: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        () = cancel.cancelled() => true,
        () = tokio::time::sleep(d) => false,
    }
}
