//! The index feeds against a fake API server and an in-process handler process: the readiness
//! gate on a busy resource and on a resource that cannot be listed, the feed's bound on
//! objects in flight, and a connection that opens while the indexer syncs.

use std::{
    convert::Infallible,
    sync::atomic::{AtomicUsize, Ordering},
};

use capstan_proto::pb;
use futures::{StreamExt, stream::BoxStream};
use http_body_util::StreamBody;
use hyper::body::{Bytes, Frame};
use serde_json::json;
use tokio::task::JoinHandle;

use super::*;
use crate::model::HandlerKind;

#[test]
fn an_indexed_object_stays_small() {
    // Per indexed object: this entry, its uid (36 bytes on the heap) and the map's slot.
    assert!(std::mem::size_of::<Tracked>() <= 24);
    assert_eq!(std::mem::size_of::<Box<str>>(), 16);
}

#[test]
fn handlers_beyond_the_mask_are_always_assumed_to_hold_entries() {
    let mut t = Tracked::default();
    assert!(!t.holds(3));
    t.set(3, true);
    assert!(t.holds(3) && !t.idle());
    t.set(3, false);
    assert!(t.idle());
    t.set(70, true);
    assert!(t.holds(70) && t.idle(), "not tracked: a removal is always sent");
}

fn resource() -> ResolvedResource {
    ResolvedResource {
        group: "demo.capstan.dev".into(),
        version: "v1".into(),
        plural: "examples".into(),
        kind: "Example".into(),
        namespaced: true,
        status_subresource: false,
    }
}

fn key() -> ResourceKey {
    ResourceKey::of(&resource())
}

fn example(name: &str, rv: u64) -> Value {
    json!({"apiVersion": "demo.capstan.dev/v1", "kind": "Example",
           "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}"),
                        "resourceVersion": rv.to_string()},
           "spec": {"size": 1}})
}

fn index_handler(id: &str) -> Registration {
    let mut reg = Registration::new(id, HandlerKind::Index, None);
    reg.resource = Some(resource());
    reg
}

/// What the fake API server answers.
#[derive(Clone)]
enum Api {
    /// Lists these objects; the watch sends a change of the first one at this interval (or
    /// nothing).
    Serving(Vec<Value>, Option<Duration>),
    /// Refuses every request (RBAC).
    Forbidden,
}

type Body = StreamBody<BoxStream<'static, Result<Frame<Bytes>, Infallible>>>;

fn once(value: &Value) -> Body {
    let bytes = Bytes::from(serde_json::to_vec(value).unwrap_or_default());
    StreamBody::new(futures::stream::once(async move { Ok(Frame::data(bytes)) }).boxed())
}

fn fake_api(api: Api) -> Objects {
    let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
        let api = api.clone();
        async move {
            let watching = req.uri().query().is_some_and(|q| q.contains("watch=true"));
            let response = match api {
                Api::Forbidden => {
                    let status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {},
                        "status": "Failure", "message": "examples is forbidden", "reason": "Forbidden",
                        "code": 403});
                    let mut response = http::Response::new(once(&status));
                    *response.status_mut() = http::StatusCode::FORBIDDEN;
                    response
                }
                Api::Serving(items, _) if !watching => http::Response::new(once(&json!({
                    "apiVersion": "demo.capstan.dev/v1", "kind": "ExampleList",
                    "metadata": {"resourceVersion": "1"}, "items": items}))),
                Api::Serving(items, Some(every)) => {
                    let busy = items.first().cloned().unwrap_or_default();
                    let rv = Arc::new(AtomicUsize::new(1));
                    let events = tokio_stream::wrappers::IntervalStream::new(tokio::time::interval(every))
                        .map(move |_| {
                            let mut object = busy.clone();
                            let n = rv.fetch_add(1, Ordering::SeqCst) + 1;
                            object["metadata"]["resourceVersion"] = json!(n.to_string());
                            object["spec"]["size"] = json!(n);
                            let mut line = serde_json::to_vec(&json!({"type": "MODIFIED", "object": object}))
                                .unwrap_or_default();
                            line.push(b'\n');
                            Ok(Frame::data(Bytes::from(line)))
                        });
                    http::Response::new(StreamBody::new(events.boxed()))
                }
                Api::Serving(_, None) => {
                    http::Response::new(StreamBody::new(futures::stream::pending().boxed()))
                }
            };
            Ok::<_, Infallible>(response)
        }
    });
    Objects::new(kube::Client::new(service, "default"))
}

/// How the fake handler process answers an invocation.
type Answer =
    Arc<dyn Fn(&pb::Invocation) -> Option<(Duration, pb::invocation_result::Outcome)> + Send + Sync>;

fn success() -> pb::invocation_result::Outcome {
    pb::invocation_result::Outcome::Success(pb::Success::default())
}

/// A handler process connected to the hub in this process.
struct Process {
    conn: ConnectionId,
    /// Invocations received.
    seen: Arc<AtomicUsize>,
    /// Invocations received and not answered yet.
    outstanding: Arc<AtomicUsize>,
    /// The most invocations outstanding at once.
    peak: Arc<AtomicUsize>,
    /// The uids of the objects whose invocations were answered.
    answered: Arc<Mutex<HashSet<String>>>,
    task: JoinHandle<()>,
}

impl Process {
    fn connect(hub: &Hub, registrations: Vec<Registration>, answer: Answer) -> Self {
        let (tx, mut rx) = mpsc::channel(4096);
        let (conn, taken) = hub.attach(tx, 10_000, false, registrations);
        assert!(taken.is_empty());
        hub.open(conn);
        let seen = Arc::new(AtomicUsize::new(0));
        let outstanding = Arc::new(AtomicUsize::new(0));
        let peak = Arc::new(AtomicUsize::new(0));
        let answered = Arc::new(Mutex::new(HashSet::new()));
        let task = tokio::spawn({
            let (hub, seen, outstanding, peak) =
                (hub.clone(), seen.clone(), outstanding.clone(), peak.clone());
            let answered = answered.clone();
            async move {
                while let Some(message) = rx.recv().await {
                    let Some(pb::connect_response::Message::Invocation(invocation)) = message.message else {
                        continue;
                    };
                    seen.fetch_add(1, Ordering::SeqCst);
                    let now = outstanding.fetch_add(1, Ordering::SeqCst) + 1;
                    peak.fetch_max(now, Ordering::SeqCst);
                    let Some((delay, outcome)) = answer(&invocation) else {
                        continue;
                    };
                    let (hub, outstanding, answered) = (hub.clone(), outstanding.clone(), answered.clone());
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        outstanding.fetch_sub(1, Ordering::SeqCst);
                        if let Some(object) = &invocation.resource {
                            answered.lock().insert(object.uid.clone());
                        }
                        let result = pb::InvocationResult {
                            invocation_id: invocation.invocation_id,
                            outcome: Some(outcome),
                            ..Default::default()
                        };
                        let _ = hub.complete(conn, &result);
                    });
                }
            }
        });
        Self {
            conn,
            seen,
            outstanding,
            peak,
            answered,
            task,
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// An indexer over the fake API server, fed the registrations `known`.
struct Harness {
    hub: Hub,
    health: Health,
    indexer: Indexer,
    cancel: CancellationToken,
    tasks: JoinSet<()>,
}

impl Harness {
    fn new(hub: &Hub, api: Api, carried: Carried) -> Self {
        let health = Health::default();
        Self {
            hub: hub.clone(),
            health: health.clone(),
            indexer: Indexer::new(
                hub.clone(),
                fake_api(api),
                k8s_watch::Settings::default(),
                Namespaces::default(),
                health,
                carried,
            ),
            cancel: CancellationToken::new(),
            tasks: JoinSet::new(),
        }
    }

    /// Syncs with the registrations `known` (the engine's snapshot).
    fn sync(&mut self, known: &[Registration]) {
        let mut groups: BTreeMap<ResourceKey, Vec<Registration>> = BTreeMap::new();
        for reg in known {
            if let Some(resource) = &reg.resource {
                groups
                    .entry(ResourceKey::of(resource))
                    .or_default()
                    .push(reg.clone());
            }
        }
        let groups = groups.into_iter().map(|(k, v)| (k, Arc::new(v))).collect();
        self.indexer
            .sync(known, &groups, true, &self.cancel, &mut self.tasks);
    }

    /// Waits (in the test's time) until the gate of `conn` is open; whether it opened.
    async fn gate_opens(&self, conn: ConnectionId, within: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + within;
        while tokio::time::Instant::now() < deadline {
            if self.hub.indexes_built(conn) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        false
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.cancel.cancel();
        self.indexer.stop();
        self.tasks.abort_all();
    }
}

#[tokio::test(start_paused = true)]
async fn the_gate_opens_on_a_resource_that_changes_all_the_time() {
    let hub = Hub::default();
    let by_label = index_handler("by_label");
    // The handler takes 30 ms per object and the first object changes every 10 ms: the feed is
    // never idle, yet every listed object went through the handler long ago.
    let process = Process::connect(
        &hub,
        vec![by_label.clone()],
        Arc::new(|_| Some((Duration::from_millis(30), success()))),
    );
    let objects = (0..5).map(|n| example(&format!("o{n}"), 1)).collect();
    let mut harness = Harness::new(
        &hub,
        Api::Serving(objects, Some(Duration::from_millis(10))),
        Carried::default(),
    );
    harness.sync(&[by_label]);
    assert!(
        harness.gate_opens(process.conn, Duration::from_secs(60)).await,
        "the gate stayed shut on a busy resource ({} invocations)",
        process.seen.load(Ordering::SeqCst)
    );
    let answered = process.answered.lock().clone();
    for n in 0..5 {
        assert!(
            answered.contains(&format!("uid-o{n}")),
            "the gate opened before o{n} was indexed"
        );
    }
}

#[tokio::test(start_paused = true)]
async fn the_gate_opens_when_the_resource_cannot_be_listed() {
    let hub = Hub::default();
    let by_label = index_handler("by_label");
    let process = Process::connect(
        &hub,
        vec![by_label.clone()],
        Arc::new(|_| Some((Duration::ZERO, success()))),
    );
    let mut harness = Harness::new(&hub, Api::Forbidden, Carried::default());
    harness.sync(&[by_label]);
    assert!(
        harness.gate_opens(process.conn, Duration::from_secs(600)).await,
        "a feed that cannot list its resource held the handler process forever"
    );
    let name = format!("index/{}/{}", resource(), process.conn);
    let live = harness.health.live();
    let check = live
        .checks
        .get(&name)
        .expect("the feed's watch is a liveness check");
    assert!(!check.ok && check.message.contains("403"), "{check:?}");
    let ready = harness.health.ready();
    assert!(ready.checks.get(&format!("{name}/synced")).is_some_and(|c| !c.ok));
    let health = harness.health.clone();
    drop(harness);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while health.live().checks.contains_key(&name) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the checks stayed after the feed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(start_paused = true)]
async fn vanished_objects_are_removed_within_the_feeds_bound() {
    let hub = Hub::default();
    let by_label = index_handler("by_label");
    let process = Process::connect(
        &hub,
        vec![by_label.clone()],
        Arc::new(|_| Some((Duration::from_millis(100), success()))),
    );
    // An earlier feed left 3 × MAX_IN_FLIGHT objects that vanished in between.
    let carried = Carried::default();
    let vanished: Masks = (0..3 * MAX_IN_FLIGHT)
        .map(|n| (format!("gone-{n}").into_boxed_str(), 1))
        .collect();
    carried.put((key(), process.conn), vanished);
    let mut harness = Harness::new(&hub, Api::Serving(Vec::new(), None), carried);
    harness.sync(&[by_label]);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while process.seen.load(Ordering::SeqCst) < 3 * MAX_IN_FLIGHT {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not every vanished object was removed"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let peak = process.peak.load(Ordering::SeqCst);
    assert!(peak <= MAX_IN_FLIGHT, "{peak} removals at once");
}

#[tokio::test]
async fn retries_stay_within_the_feeds_bound() {
    let hub = Hub::default();
    let by_label = index_handler("by_label");
    // Every object fails once (retry in 1 s); the retries are never answered.
    let process = Process::connect(
        &hub,
        vec![by_label.clone()],
        Arc::new(|invocation| {
            (invocation.attempt == 1).then(|| {
                let error = pb::TemporaryError {
                    retry_after: Some(prost_types::Duration { seconds: 1, nanos: 0 }),
                    diagnostics: Vec::new(),
                };
                (
                    Duration::ZERO,
                    pb::invocation_result::Outcome::TemporaryError(error),
                )
            })
        }),
    );
    let objects = (0..3 * MAX_IN_FLIGHT)
        .map(|n| example(&format!("o{n}"), 1))
        .collect();
    let mut harness = Harness::new(&hub, Api::Serving(objects, None), Carried::default());
    harness.sync(&[by_label]);
    // Wait (real time: retries are timed by the wall clock) until the retries filled the bound.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while process.seen.load(Ordering::SeqCst) < 3 * MAX_IN_FLIGHT + MAX_IN_FLIGHT {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the retries did not start"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let outstanding = process.outstanding.load(Ordering::SeqCst);
    assert!(outstanding <= MAX_IN_FLIGHT, "{outstanding} retries at once");
}

#[tokio::test(start_paused = true)]
async fn a_connection_that_opens_during_a_sync_keeps_its_gate_shut() {
    let hub = Hub::default();
    let mut harness = Harness::new(&hub, Api::Serving(Vec::new(), None), Carried::default());
    // The engine took its snapshot of the registrations (empty); then a process connected.
    let by_label = index_handler("by_label");
    let process = Process::connect(
        &hub,
        vec![by_label.clone()],
        Arc::new(|_| Some((Duration::ZERO, success()))),
    );
    harness.sync(&[]);
    assert!(
        !hub.indexes_built(process.conn),
        "the gate opened before the process's index had a feed"
    );
    // The next sync knows the registration: its feed lists (nothing) and the gate opens.
    harness.sync(&[by_label]);
    assert!(harness.gate_opens(process.conn, Duration::from_secs(60)).await);
}

#[tokio::test(start_paused = true)]
async fn an_index_of_a_resource_not_served_yet_holds_nothing() {
    let hub = Hub::default();
    let mut harness = Harness::new(&hub, Api::Serving(Vec::new(), None), Carried::default());
    let mut pending = index_handler("by_label");
    pending.resource = None;
    let process = Process::connect(
        &hub,
        vec![pending.clone()],
        Arc::new(|_| Some((Duration::ZERO, success()))),
    );
    harness.sync(&[pending]);
    assert!(hub.indexes_built(process.conn));
}
