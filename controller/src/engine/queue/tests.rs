//! The object queues against fakes: a panicking cycle, bounded event dispatch, stored bodies,
//! the merge diff and dropped fields.

use std::{
    collections::HashMap,
    sync::atomic::{AtomicU32, Ordering},
};

use futures::future::BoxFuture;
use serde_json::json;

use super::{events::EVENT_DISPATCH_LIMIT, *};
use crate::{
    grpc::Control,
    model::{ErrorsMode, HandlerKind, Outcome, Work},
};

/// Panics in the first invocation (an injected bug), succeeds afterwards.
#[derive(Default)]
struct PanicsOnce {
    calls: AtomicU32,
}

impl Invoker for PanicsOnce {
    fn invoke(&self, _work: Work, _control: Control) -> BoxFuture<'static, Outcome> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            assert!(call > 0, "injected panic in the first cycle");
            Outcome::success(None)
        })
    }
}

/// The number a fake API server counts a version by: its digits (versions are opaque to the
/// queue; the tests' servers number theirs).
fn rv_number(body: &Value) -> Option<u64> {
    let digits: String = version_of(body)?.chars().filter(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The version `u1` awaits the echo of, and whether its body was seen.
fn awaited(q: &Queue) -> Option<(String, bool)> {
    q.slots
        .lock()
        .get("u1")
        .and_then(|s| s.versions.as_ref())
        .and_then(|v| v.awaited().map(|(v, seen)| (v.to_owned(), seen)))
}

fn example(rv: &str) -> Value {
    json!({"apiVersion": "demo.capstan.dev/v1", "kind": "Example",
           "metadata": {"name": "one", "namespace": "default", "uid": "u1", "resourceVersion": rv},
           "spec": {"size": 1}})
}

/// An API server holding the tests' objects, as [`Store`] answers.
fn objects() -> Objects {
    patching(|_| {})
}

/// The objects of a fake API server. An object is first the tests' example of its name
/// (`one` is `u1`, `object-N` is `uN`) at version 19; a merge PATCH of it (or of its status)
/// is applied, then `mutate` (an admission webhook, say), its resourceVersion goes up by one,
/// and the answer is the object as stored — as a real API server answers.
#[derive(Clone)]
struct Store {
    objects: Arc<Mutex<HashMap<String, Value>>>,
    mutate: fn(&mut Value),
    /// How the server spells version `n`.
    spell: fn(u64) -> String,
}

impl Store {
    fn new(mutate: fn(&mut Value)) -> Self {
        Self {
            objects: Arc::default(),
            mutate,
            spell: |n| n.to_string(),
        }
    }

    /// The answer to a PATCH of `path` with `patch`.
    fn patch(&self, path: &str, patch: &[u8]) -> Value {
        let name = path
            .trim_end_matches("/status")
            .rsplit('/')
            .next()
            .unwrap_or_default()
            .to_owned();
        let mut objects = self.objects.lock();
        let object = objects.entry(name.clone()).or_insert_with(|| {
            let mut body = example(&(self.spell)(19));
            if let Some(n) = name.strip_prefix("object-") {
                body["metadata"]["name"] = json!(name);
                body["metadata"]["uid"] = json!(format!("u{n}"));
            }
            body
        });
        if let Ok(patch) = serde_json::from_slice::<Value>(patch) {
            json_patch::merge(object, &patch);
            (self.mutate)(object);
            let rv = rv_number(object).unwrap_or(0) + 1;
            object["metadata"]["resourceVersion"] = json!((self.spell)(rv));
        }
        object.clone()
    }
}

/// An API server whose answers to writes are those of a [`Store`] with `mutate`.
fn patching(mutate: fn(&mut Value)) -> Objects {
    serving(Store::new(mutate))
}

/// An API server whose answers to writes are those of `store`.
fn serving(store: Store) -> Objects {
    let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
        let store = store.clone();
        async move {
            let path = req.uri().path().to_owned();
            let patch = http_body_util::BodyExt::collect(req.into_body())
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let answer = serde_json::to_vec(&store.patch(&path, &patch)).unwrap_or_default();
            Ok::<_, std::convert::Infallible>(http::Response::new(kube::client::Body::from(answer)))
        }
    });
    Objects::new(kube::Client::new(service, "default"))
}

/// An API server that answers every request with `body`.
fn answering(body: Value) -> Objects {
    let service = tower::service_fn(move |_req: http::Request<kube::client::Body>| {
        let body = serde_json::to_vec(&body).unwrap_or_default();
        async move { Ok::<_, std::convert::Infallible>(http::Response::new(kube::client::Body::from(body))) }
    });
    Objects::new(kube::Client::new(service, "default"))
}

fn resource() -> crate::model::ResolvedResource {
    crate::model::ResolvedResource {
        group: "demo.capstan.dev".into(),
        version: "v1".into(),
        plural: "examples".into(),
        kind: "Example".into(),
        namespaced: true,
        status_subresource: false,
    }
}

/// A create handler `create_fn` of the example resource.
fn create_fn() -> Registration {
    let mut create = Registration::new("create_fn", HandlerKind::Create, None);
    create.resource = Some(resource());
    create
}

/// [`create_fn`] with a timeout: a checkpoint keeps its start while it runs long.
fn timed_create_fn() -> Registration {
    let mut create = create_fn();
    create.timeout = Some(Duration::from_secs(600));
    create
}

/// A queue of the example resource with `handlers`, calling `invoker`.
fn queue(invoker: Arc<dyn Invoker>, handlers: Vec<Registration>, limit: Arc<Semaphore>) -> Queue {
    queue_of(invoker, handlers, limit, objects())
}

/// As [`queue`], against the API server `objects`.
fn queue_of(
    invoker: Arc<dyn Invoker>,
    handlers: Vec<Registration>,
    limit: Arc<Semaphore>,
    objects: Objects,
) -> Queue {
    queue_with(invoker, handlers, limit, objects, relisting::Settings::default())
}

/// As [`queue_of`], listing again with `relisting`.
fn queue_with(
    invoker: Arc<dyn Invoker>,
    handlers: Vec<Registration>,
    limit: Arc<Semaphore>,
    objects: Objects,
    relisting: relisting::Settings,
) -> Queue {
    queue_pausable(
        invoker,
        handlers,
        limit,
        objects,
        relisting,
        watch::channel(false).1,
    )
}

/// As [`queue_with`], paused by `paused`.
fn queue_pausable(
    invoker: Arc<dyn Invoker>,
    handlers: Vec<Registration>,
    limit: Arc<Semaphore>,
    objects: Objects,
    relisting: relisting::Settings,
    paused: watch::Receiver<bool>,
) -> Queue {
    let cancel = CancellationToken::new();
    let (_handlers_tx, handlers) = watch::channel(Arc::new(handlers));
    let (stopped, _stopped_rx) = tokio::sync::mpsc::unbounded_channel();
    let storage = Storage::annotations("capstan.dev");
    let daemons = super::super::daemons::Daemons::new(super::super::daemons::Context {
        resource: resource(),
        invoker: invoker.clone(),
        objects: objects.clone(),
        rules: processing::rules(&storage, &[]),
        stopped,
        cancel: cancel.clone(),
        finalizer: storage.keys.finalizer.clone(),
        max_losses: 3,
        finished: super::super::daemons::Finished::default(),
    });
    Queue::new(Context {
        resource: resource(),
        handlers,
        storage,
        invoker,
        objects,
        limit,
        checkpoint_after: Duration::from_secs(1),
        daemons,
        paused,
        poster: super::super::posting::Poster::disabled(),
        cancel,
        max_losses: 3,
        relisting,
    })
}

#[tokio::test(start_paused = true)]
async fn a_panicking_cycle_frees_its_slot_and_permit_and_the_object_is_processed_again() {
    let create = create_fn();
    let invoker = Arc::new(PanicsOnce::default());
    let limit = Arc::new(Semaphore::new(1));
    let queue = queue(invoker.clone(), vec![create], limit.clone());
    queue.push(EventType::Added, example("10"));
    let deadline = tokio::time::Instant::now() + PANIC_RETRY * 4;
    while invoker.calls.load(Ordering::SeqCst) < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the object was not processed again"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    while queue.slots.lock().get("u1").is_some_and(|s| s.running) {
        assert!(tokio::time::Instant::now() < deadline, "the worker never ended");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(limit.available_permits(), 1, "the permit is back");
    // The slot is usable: a new event (after the echo of the retried cycle's write) starts a
    // new worker.
    queue.push(EventType::Modified, example("20"));
    queue.push(EventType::Modified, example("21"));
    while invoker.calls.load(Ordering::SeqCst) < 3 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "a later event was not processed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Succeeds after a second; counts the invocations.
#[derive(Default)]
struct Slow {
    calls: AtomicU32,
}

impl Invoker for Slow {
    fn invoke(&self, _work: Work, _control: Control) -> BoxFuture<'static, Outcome> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            tokio::time::sleep(Duration::from_secs(1)).await;
            Outcome::success(None)
        })
    }
}

/// When our finalizer's removal lets the API server delete the object, the PATCH answers with
/// the object at the resourceVersion the write was based on (nothing newer was stored). An
/// event of that version still queued (the late echo of an earlier write) predates the write:
/// it must not run the finished delete handlers again.
#[tokio::test(start_paused = true)]
async fn an_event_of_the_version_a_finished_deletion_wrote_over_runs_no_handler_again() {
    let mut delete = Registration::new("delete_fn", HandlerKind::Delete, None);
    delete.resource = Some(resource());
    let deleting = |finalizers: Value| {
        let mut body = example("10");
        body["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        body["metadata"]["finalizers"] = finalizers;
        body
    };
    let invoker = Arc::new(Slow::default());
    let objects = answering(deleting(json!([])));
    let queue = queue_of(
        invoker.clone(),
        vec![delete],
        Arc::new(Semaphore::new(1)),
        objects,
    );
    queue.push(EventType::Modified, deleting(json!(["capstan.dev/finalizer"])));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(invoker.calls.load(Ordering::SeqCst), 1);
    queue.push(EventType::Modified, deleting(json!(["capstan.dev/finalizer"])));
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        invoker.calls.load(Ordering::SeqCst),
        1,
        "the delete handler ran again for an event its own finished write had superseded"
    );
    // Later still, once the object's slot is gone too, an event of that version starts nothing.
    assert!(
        queue.slots.lock().get("u1").is_none(),
        "the gone object is forgotten"
    );
    queue.push(EventType::Modified, deleting(json!(["capstan.dev/finalizer"])));
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        invoker.calls.load(Ordering::SeqCst),
        1,
        "a late event started the handlers again"
    );
}

/// Runs until its work is cancelled; counts the invocations.
#[derive(Default)]
struct Blocking {
    calls: AtomicU32,
}

impl Invoker for Blocking {
    fn invoke(&self, _work: Work, control: Control) -> BoxFuture<'static, Outcome> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            control.cancel.cancelled().await;
            Outcome::Cancelled
        })
    }
}

#[tokio::test(start_paused = true)]
async fn event_handler_dispatch_is_bounded_and_never_stalls_the_watch() {
    let mut event = Registration::new("event_fn", HandlerKind::Event, None);
    event.resource = Some(resource());
    event.errors = ErrorsMode::Ignored;
    let invoker = Arc::new(Blocking::default());
    let queue = queue(invoker.clone(), vec![event], Arc::new(Semaphore::new(4)));
    let observer = {
        let queue = queue.clone();
        tokio::spawn(async move {
            for n in 0..EVENT_DISPATCH_LIMIT + 5 {
                queue
                    .observe(EventType::Modified, example(&n.to_string()), None, false)
                    .await;
            }
        })
    };
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        invoker.calls.load(Ordering::SeqCst) as usize,
        EVENT_DISPATCH_LIMIT
    );
    assert!(
        observer.is_finished(),
        "the watch goes on: events beyond the limit are dropped for the handler"
    );
    assert_eq!(
        queue.events.tasks.lock().len(),
        EVENT_DISPATCH_LIMIT,
        "every invocation is owned"
    );
    // Stopping the watch ends everything it owns.
    queue.ctx.cancel.cancel();
    queue.stop_timers();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(queue.events.permits.available_permits(), EVENT_DISPATCH_LIMIT);
}

#[test]
fn stored_bodies_round_trip_and_are_smaller_than_their_text() {
    let spec = json!({"replicas": 3, "image": "registry.example.com/team/app:1.2.3",
                      "env": [{"name": "MODE", "value": "production"}]});
    let essence = json!({"spec": spec, "metadata": {"labels": {"app": "web"}}});
    let body = json!({
        "apiVersion": "demo.capstan.dev/v1", "kind": "Example",
        "metadata": {"name": "web", "namespace": "default", "uid": "u-1", "resourceVersion": "42",
                     "labels": {"app": "web"},
                     "annotations": {"capstan.dev/last-handled-configuration": essence.to_string()}},
        "spec": spec,
    });
    let stored = Stored::new(&body);
    assert_eq!(stored.value(), body);
    assert_eq!(stored.version(), Some("42"));
    let opaque = Stored::new(&json!({"metadata": {"resourceVersion": "b7f3/ü"}}));
    assert_eq!(opaque.version(), Some("b7f3/ü"));
    let text = serde_json::to_vec(&body).unwrap_or_default();
    assert!(
        stored.packed.len() < text.len(),
        "{} vs {}",
        stored.packed.len(),
        text.len()
    );
    for packed in [&[1, 2, 3][..], &[7, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3][..]] {
        let broken = Stored {
            packed: packed.into(),
        };
        assert_eq!(
            broken.value(),
            Value::Null,
            "corrupt data reads as nothing, no panic"
        );
    }
    let unversioned = Stored::new(&json!({"metadata": {"name": "x"}}));
    assert_eq!(unversioned.version(), None);
    assert_eq!(unversioned.value(), json!({"metadata": {"name": "x"}}));
}

/// Holds every invocation until the gate opens; records each object's invocations and the
/// most invocations running at once.
struct Gated {
    open: watch::Receiver<bool>,
    running: Arc<AtomicU32>,
    most: Arc<AtomicU32>,
    calls: Arc<Mutex<HashMap<String, u32>>>,
    order: Arc<Mutex<Vec<String>>>,
    /// Each invocation's object and the resourceVersion of the body it was given.
    versions: Arc<Mutex<Vec<(String, String)>>>,
}

impl Gated {
    fn new() -> (watch::Sender<bool>, Arc<Self>) {
        let (tx, open) = watch::channel(false);
        let gated = Self {
            open,
            running: Arc::default(),
            most: Arc::default(),
            calls: Arc::default(),
            order: Arc::default(),
            versions: Arc::default(),
        };
        (tx, Arc::new(gated))
    }

    fn total(&self) -> u32 {
        self.calls.lock().values().sum()
    }
}

impl Invoker for Gated {
    fn invoke(&self, work: Work, _control: Control) -> BoxFuture<'static, Outcome> {
        let uid = work.object.map(|o| o.uid).unwrap_or_default();
        let rv = work
            .body
            .as_ref()
            .and_then(|b| b.pointer("/metadata/resourceVersion"))
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        self.versions.lock().push((uid.clone(), rv));
        *self.calls.lock().entry(uid.clone()).or_default() += 1;
        self.order.lock().push(uid);
        let now = self.running.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        let mut open = self.open.clone();
        let running = self.running.clone();
        Box::pin(async move {
            let _ = open.wait_for(|o| *o).await;
            running.fetch_sub(1, Ordering::SeqCst);
            Outcome::success(None)
        })
    }
}

fn numbered(n: usize) -> Value {
    let mut body = example("10");
    body["metadata"]["name"] = json!(format!("object-{n}"));
    body["metadata"]["uid"] = json!(format!("u{n}"));
    body
}

/// A start with many unhandled objects: only as many workers (tasks) as the limit allows
/// exist at any time, the rest wait as uids in the ready list, and every object is handled
/// exactly once when the handlers answer.
#[tokio::test(start_paused = true)]
async fn a_burst_of_objects_gets_no_more_workers_than_the_limit_and_each_is_handled_once() {
    const OBJECTS: usize = 300;
    const LIMIT: usize = 4;
    let create = create_fn();
    let (open, invoker) = Gated::new();
    let limit = Arc::new(Semaphore::new(LIMIT));
    let queue = queue(invoker.clone(), vec![create], limit.clone());
    for n in 0..OBJECTS {
        queue.push(EventType::Listing, numbered(n));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(invoker.running.load(Ordering::SeqCst), LIMIT as u32);
    assert!(
        queue.workers().len() <= LIMIT + 1,
        "{} tasks for a limit of {LIMIT} (and the dispatcher)",
        queue.workers().len()
    );
    assert_eq!(
        queue.ready(),
        OBJECTS - LIMIT,
        "the rest wait as uids (the dispatcher takes one only with a permit)"
    );
    assert_eq!(limit.available_permits(), 0);
    // A newer version of a waiting object replaces its waiting event: still one cycle.
    let mut newer = numbered(OBJECTS - 1);
    newer["metadata"]["resourceVersion"] = json!("11");
    queue.push(EventType::Modified, newer);
    assert_eq!(queue.ready(), OBJECTS - LIMIT);
    open.send_replace(true);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(600);
    while invoker.total() < OBJECTS as u32 || queue.slots.lock().values().any(|s| s.running) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "only {} of {OBJECTS} objects handled",
            invoker.total()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(invoker.most.load(Ordering::SeqCst) <= LIMIT as u32);
    let calls = invoker.calls.lock().clone();
    assert_eq!(calls.len(), OBJECTS);
    assert!(
        calls.values().all(|n| *n == 1),
        "an object was handled twice: {calls:?}"
    );
    assert_eq!(limit.available_permits(), LIMIT, "every permit is back");
    assert_eq!(queue.ready(), 0);
    assert_eq!(queue.workers().len(), 1, "only the dispatcher is left");
}

/// The limit is global: a second resource's objects get permits in their turn, first come
/// first served, while the first resource still has a backlog.
#[tokio::test(start_paused = true)]
async fn queues_share_the_limit_first_come_first_served() {
    let create = create_fn();
    let (open, invoker) = Gated::new();
    let limit = Arc::new(Semaphore::new(2));
    let first = queue(invoker.clone(), vec![create.clone()], limit.clone());
    let second = queue(invoker.clone(), vec![create], limit.clone());
    for n in 0..50 {
        first.push(EventType::Listing, numbered(n));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    second.push(EventType::Listing, numbered(1000));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(invoker.total(), 2);
    open.send_replace(true);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while invoker.total() < 51 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not every object was handled"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Two of the first queue's objects ran, the first queue's dispatcher was waiting with the
    // third: the second queue's object asked next and got the permit after that.
    let position = invoker.order.lock().iter().position(|uid| uid == "u1000");
    assert!(
        position.is_some_and(|p| p <= 4),
        "the second queue waited behind the first queue's backlog: {:?}",
        invoker.order.lock()
    );
    assert!(invoker.most.load(Ordering::SeqCst) <= 2);
}

/// A change goes before the objects of a listing that came earlier (after a restart, a new
/// object is not handled only after every listed one), and a listed object that gets a change
/// while it waits goes with the changes, handled once.
#[tokio::test(start_paused = true)]
async fn changes_go_before_a_listings_backlog_and_a_listed_object_that_changes_moves_up() {
    let create = create_fn();
    let (open, invoker) = Gated::new();
    let limit = Arc::new(Semaphore::new(1));
    let queue = queue(invoker.clone(), vec![create], limit);
    for n in 0..50 {
        queue.push(EventType::Listing, numbered(n));
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(invoker.total(), 1, "one listed object runs");
    queue.push(EventType::Added, numbered(1000));
    let mut changed = numbered(40);
    changed["metadata"]["resourceVersion"] = json!("11");
    queue.push(EventType::Modified, changed);
    assert_eq!(queue.ready(), 50, "the changed object counted once");
    open.send_replace(true);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while invoker.total() < 51 || queue.slots.lock().values().any(|s| s.running) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "not every object was handled"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let order = invoker.order.lock().clone();
    assert_eq!(order[1..3], ["u1000", "u40"], "{order:?}");
    assert_eq!(order.len(), 51);
    assert!(invoker.calls.lock().values().all(|n| *n == 1));
    assert_eq!(queue.ready(), 0);
}

/// A listing's backlog keeps the waiting bound full: a new object still waits with its body
/// (in the changes' reserve) and goes first, instead of being marked for the next relisting.
#[tokio::test(start_paused = true)]
async fn a_change_waits_with_its_body_while_a_listing_fills_the_bound() {
    let q = queue_with(
        Arc::new(Slow::default()),
        vec![create_fn()],
        Arc::new(Semaphore::new(0)),
        objects(),
        bounded(4),
    );
    for n in 0..10 {
        q.push(EventType::Listing, numbered(n));
    }
    assert_eq!(pending_bodies(&q), 4, "the rest of the listing is marked");
    q.push(EventType::Added, numbered(1000));
    assert_eq!(pending_bodies(&q), 5);
    assert_eq!(q.next_ready().as_deref(), Some("u1000"));
}

/// The surplus entry a promotion leaves in the confirmations is skipped, also once its
/// object's slot is gone: it never starts a worker of its own.
#[tokio::test(start_paused = true)]
async fn the_old_entry_of_a_promoted_object_starts_no_worker() {
    let q = queue(Arc::new(Slow::default()), vec![], Arc::new(Semaphore::new(0)));
    q.push(EventType::Listing, numbered(1));
    let mut changed = numbered(1);
    changed["metadata"]["resourceVersion"] = json!("11");
    q.push(EventType::Modified, changed);
    assert_eq!(q.ready(), 1, "one object waits");
    assert_eq!(q.next_ready().as_deref(), Some("u1"), "as a change");
    // Its worker ran and found it gone.
    q.slots.lock().remove("u1");
    assert_eq!(q.next_ready(), None, "the old entry is skipped");
    assert_eq!(q.ready(), 0);
}

/// A retry that falls due while its object waits as a confirmation moves it up.
#[tokio::test(start_paused = true)]
async fn a_retry_due_while_waiting_as_a_confirmation_moves_the_object_up() {
    let q = queue(Arc::new(Slow::default()), vec![], Arc::new(Semaphore::new(0)));
    q.push(EventType::Listing, numbered(1));
    q.push(EventType::Listing, numbered(2));
    q.wake("u2");
    assert_eq!(q.next_ready().as_deref(), Some("u2"));
    assert_eq!(q.next_ready().as_deref(), Some("u1"));
    assert_eq!(q.next_ready(), None);
}

/// A worker must keep the object marked running until it finishes: an event pushed between
/// its last look for work and its end is then queued once, never twice (two entries would
/// start two cycles of one object at once).
#[tokio::test(start_paused = true)]
async fn an_object_whose_worker_found_no_more_work_is_queued_once() {
    let limit = Arc::new(Semaphore::new(0));
    let q = queue(Arc::new(Slow::default()), vec![], limit);
    q.push(EventType::Modified, example("5"));
    // The dispatcher waits for a permit that never comes; taken as it would take it.
    tokio::task::yield_now().await;
    assert_eq!(q.ready(), 1);
    assert_eq!(q.next_ready().as_deref(), Some("u1"));
    assert_eq!(q.ready(), 0);
    assert!(q.take_next("u1").is_some(), "the worker's cycle");
    assert!(q.take_next("u1").is_none(), "no more work");
    q.push(EventType::Modified, example("11"));
    q.finish("u1");
    assert_eq!(q.ready(), 1, "queued once");
}

/// A stopped queue drops the work still waiting (and its count in the pending gauge): the
/// next queue of the resource lists the objects again.
#[tokio::test(start_paused = true)]
async fn a_stopped_queue_drops_the_work_still_waiting() {
    let q = queue(Arc::new(Slow::default()), vec![], Arc::new(Semaphore::new(0)));
    for n in 0..3 {
        q.push(EventType::Listing, numbered(n));
    }
    tokio::task::yield_now().await;
    assert!(q.slots.lock().values().all(|s| s.pending.is_some()));
    q.ctx.cancel.cancel();
    tokio::task::yield_now().await;
    assert!(q.slots.lock().values().all(|s| s.pending.is_none()));
    assert_eq!(q.ready(), 0);
}

/// Fails every invocation with a temporary error (once `open`): the object's next attempt is
/// scheduled.
struct Failing {
    open: watch::Receiver<bool>,
    calls: Arc<AtomicU32>,
}

impl Failing {
    fn new(open: bool) -> (watch::Sender<bool>, Arc<Self>) {
        let (tx, open) = watch::channel(open);
        (
            tx,
            Arc::new(Self {
                open,
                calls: Arc::default(),
            }),
        )
    }
}

impl Invoker for Failing {
    fn invoke(&self, _work: Work, _control: Control) -> BoxFuture<'static, Outcome> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        let mut open = self.open.clone();
        Box::pin(async move {
            let _ = open.wait_for(|o| *o).await;
            Outcome::Temporary {
                delay: Some(Duration::from_secs(60)),
                diagnostics: Vec::new(),
                subhandlers: Vec::new(),
            }
        })
    }
}

/// An API server that answers a LIST of the examples with `items` (counting the LISTs; each
/// answered once `open`) and any other request with the example object.
fn listing(items: Vec<Value>, lists: Arc<AtomicU32>, open: watch::Receiver<bool>) -> Objects {
    listing_of(Arc::new(Mutex::new(items)), lists, open)
}

/// As [`listing`], with the items as they are when each LIST arrives.
fn listing_of(items: Arc<Mutex<Vec<Value>>>, lists: Arc<AtomicU32>, open: watch::Receiver<bool>) -> Objects {
    let store = Store::new(|_| {});
    let service = tower::service_fn(move |req: http::Request<kube::client::Body>| {
        let list =
            req.method() == http::Method::GET && req.uri().path() == "/apis/demo.capstan.dev/v1/examples";
        let listed = list.then(|| {
            lists.fetch_add(1, Ordering::SeqCst);
            json!({"apiVersion": "demo.capstan.dev/v1", "kind": "ExampleList",
                   "metadata": {"resourceVersion": "30"}, "items": items.lock().clone()})
        });
        let mut open = open.clone();
        let store = store.clone();
        async move {
            let answer = match listed {
                Some(listed) => {
                    let _ = open.wait_for(|o| *o).await;
                    listed
                }
                None => {
                    let path = req.uri().path().to_owned();
                    let patch = http_body_util::BodyExt::collect(req.into_body())
                        .await
                        .map(|b| b.to_bytes())
                        .unwrap_or_default();
                    store.patch(&path, &patch)
                }
            };
            let body = serde_json::to_vec(&answer).unwrap_or_default();
            Ok::<_, std::convert::Infallible>(http::Response::new(kube::client::Body::from(body)))
        }
    });
    Objects::new(kube::Client::new(service, "default"))
}

async fn until_idle(queue: &Queue, calls: impl Fn() -> u32, want: u32) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while calls() < want || queue.slots.lock().values().any(|s| s.running) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {want} invocations",
            calls()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A handled object with nothing due keeps no body in memory; a change of handlers (or a
/// resume) lists the objects again and gives each object at rest a cycle with its listed
/// body. (The listed bodies are newer versions without the controller's records, as after a
/// `kubectl replace`: each cycle calls the handler again, which the test counts.)
#[tokio::test(start_paused = true)]
async fn objects_at_rest_keep_no_body_and_are_listed_again_to_be_re_processed() {
    let create = create_fn();
    let (open, invoker) = Gated::new();
    open.send_replace(true);
    let lists = Arc::new(AtomicU32::new(0));
    let listed: Vec<Value> = (0..3)
        .map(|n| {
            let mut body = numbered(n);
            body["metadata"]["resourceVersion"] = json!("40");
            body
        })
        .collect();
    let queue = queue_of(
        invoker.clone(),
        vec![create],
        Arc::new(Semaphore::new(2)),
        listing(listed, lists.clone(), watch::channel(true).1),
    );
    for n in 0..3 {
        queue.push(EventType::Listing, numbered(n));
    }
    until_idle(&queue, || invoker.total(), 3).await;
    assert!(
        queue.slots.lock().values().all(|s| s.last_body.is_none()),
        "objects at rest keep no body"
    );
    assert!(queue.bodies().is_empty());
    assert_eq!(lists.load(Ordering::SeqCst), 0);

    queue.resync();
    until_idle(&queue, || invoker.total(), 6).await;
    assert_eq!(lists.load(Ordering::SeqCst), 1, "one LIST for the resync");
    let calls = invoker.calls.lock().clone();
    assert!(
        calls.values().all(|n| *n == 2),
        "every object at rest got one more cycle: {calls:?}"
    );
    // An object awaiting the echo of a write (here one of version 45, which never comes):
    // a listing that started after the write's answer reflects it, and ends the wait.
    queue
        .slots
        .lock()
        .get_mut("u0")
        .expect("slot")
        .versions()
        .await_echo("45", true);
    tokio::time::sleep(Duration::from_millis(1)).await;
    queue.resync();
    until_idle(&queue, || invoker.total(), 9).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(lists.load(Ordering::SeqCst), 2);
    assert_eq!(invoker.calls.lock().get("u0"), Some(&3));
    assert!(
        queue
            .slots
            .lock()
            .get("u0")
            .and_then(|s| s.versions.as_ref())
            .is_none_or(|v| !v.awaits("45")),
        "the wait ended with the listing"
    );
}

/// An object with a retry scheduled keeps its body: the retry needs it, and a resync pushes
/// it at once without listing.
#[tokio::test(start_paused = true)]
async fn an_object_with_a_retry_due_keeps_its_body() {
    let create = create_fn();
    let lists = Arc::new(AtomicU32::new(0));
    let (_open, failing) = Failing::new(true);
    let queue = queue_of(
        failing,
        vec![create],
        Arc::new(Semaphore::new(1)),
        listing(Vec::new(), lists.clone(), watch::channel(true).1),
    );
    queue.push(EventType::Added, example("10"));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !queue
        .slots
        .lock()
        .get("u1")
        .is_some_and(|s| !s.running && s.timer.is_some())
    {
        assert!(tokio::time::Instant::now() < deadline, "no retry was scheduled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        queue
            .slots
            .lock()
            .get("u1")
            .is_some_and(|s| s.last_body.is_some())
    );
    assert_eq!(queue.bodies().len(), 1);
    queue.resync();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(lists.load(Ordering::SeqCst), 0, "nothing at rest, nothing listed");
}

/// A known object's slot is small: one map entry per object is what a large cluster pays for
/// (the key and slot together, before the map's spare capacity).
#[test]
fn a_slot_and_its_key_take_at_most_88_bytes() {
    assert!(std::mem::size_of::<Stored>() <= 16);
    assert!(std::mem::size_of::<(Box<str>, Slot)>() <= 88);
}

/// A resync while the object's cycle runs (maybe with the old handlers): once that cycle ends,
/// keeping its body (a retry is due), the object runs a cycle with the handlers registered now
/// — the answer to that cycle's write, checked at once — and the listing the resync started
/// finds nothing left to do for it: it queues no body, and the retry stays due when it was.
#[tokio::test(start_paused = true)]
async fn an_object_whose_cycle_ran_during_a_resync_gets_a_cycle_after_it() {
    let create = create_fn();
    let lists = Arc::new(AtomicU32::new(0));
    let (answer, invoker) = Failing::new(false);
    let (list_open, list_gate) = watch::channel(false);
    let queue = queue_of(
        invoker.clone(),
        vec![create],
        Arc::new(Semaphore::new(1)),
        listing(vec![example("20")], lists.clone(), list_gate),
    );
    queue.push(EventType::Added, example("10"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(invoker.calls.load(Ordering::SeqCst), 1, "the first cycle runs");
    queue.resync();
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        lists.load(Ordering::SeqCst),
        1,
        "the listing waits for its answer"
    );
    assert!(
        queue
            .slots
            .lock()
            .get("u1")
            .is_some_and(|s| s.relist.is_some() && s.rerun)
    );
    // The running cycle ends with a retry due in 60 s: it keeps its body, and the object runs
    // once more at once.
    answer.send_replace(true);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(queue.slots.lock().get("u1").is_some_and(|s| !s.running
        && s.last_body.is_some()
        && s.relist.is_none()
        && !s.rerun
        && s.timer.is_some()));
    list_open.send_replace(true);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(pending_bodies(&queue), 0, "the listing queued a body again");
    assert_eq!(
        invoker.calls.load(Ordering::SeqCst),
        1,
        "the retry is not due yet"
    );
}

/// A resync while a cycle of an object with a body in memory runs, and that cycle ends
/// writing nothing (no echo follows) at a newer version: the object runs once more after that
/// cycle, with the body it leaves — the older body it had when the resync came is stale by
/// then and would be dropped.
#[tokio::test(start_paused = true)]
async fn an_object_with_a_body_whose_cycle_runs_during_a_resync_runs_once_more() {
    let create = create_fn();
    let (open, invoker) = Gated::new();
    open.send_replace(true);
    let queue = queue(invoker.clone(), vec![create], Arc::new(Semaphore::new(1)));
    // The cycle in flight (of version 30) started before the resync; the body in memory is
    // that of version 20.
    queue.slots.lock().insert(
        "u1".into(),
        Slot {
            running: true,
            last_body: Some(Stored::new(&example("20"))),
            ..Slot::default()
        },
    );
    queue.resync();
    {
        // The cycle ends: nothing written, its base (version 30) kept.
        let mut slots = queue.slots.lock();
        let slot = slots.get_mut("u1").expect("slot");
        slot.last_body = Some(Stored::new(&example("30")));
    }
    queue.finish("u1");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while invoker.total() < 1 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the object did not run again after the cycle the resync overlapped"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Relisting settings with at most `waiting_bodies` waiting bodies.
fn bounded(waiting_bodies: usize) -> relisting::Settings {
    relisting::Settings {
        waiting_bodies,
        ..relisting::Settings::default()
    }
}

fn pending_bodies(queue: &Queue) -> usize {
    queue
        .slots
        .lock()
        .values()
        .filter(|s| s.pending.is_some())
        .count()
}

/// A start with more unhandled objects than may wait with a body: the queue holds the bound's
/// worth of bodies, marks the rest, and one listing paced by the workers queues their bodies
/// as room frees up; every object is handled once, as the event that marked it.
#[tokio::test(start_paused = true)]
async fn a_start_beyond_the_waiting_bound_holds_only_that_many_bodies_and_lists_the_rest() {
    const OBJECTS: usize = 40;
    const BOUND: usize = 5;
    let (open, invoker) = Gated::new();
    let lists = Arc::new(AtomicU32::new(0));
    let queue = queue_with(
        invoker.clone(),
        vec![create_fn()],
        Arc::new(Semaphore::new(2)),
        listing(
            (0..OBJECTS).map(numbered).collect(),
            lists.clone(),
            watch::channel(true).1,
        ),
        bounded(BOUND),
    );
    for n in 0..OBJECTS {
        queue.push(EventType::Listing, numbered(n));
    }
    assert_eq!(pending_bodies(&queue), BOUND);
    assert_eq!(
        queue
            .slots
            .lock()
            .values()
            .filter(|s| s.relist == Some(EventType::Listing))
            .count(),
        OBJECTS - BOUND,
        "the rest are marked, as listed"
    );
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(invoker.running.load(Ordering::SeqCst), 2);
    assert_eq!(pending_bodies(&queue), BOUND - 2);
    assert_eq!(
        lists.load(Ordering::SeqCst),
        0,
        "the listing waits until at most half the bound is used"
    );
    open.send_replace(true);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while invoker.total() < OBJECTS as u32 || queue.slots.lock().values().any(|s| s.running) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of {OBJECTS} handled",
            invoker.total()
        );
        assert!(queue.ready.waiting.load(Ordering::Relaxed) <= BOUND);
        assert!(pending_bodies(&queue) <= BOUND);
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let calls = invoker.calls.lock().clone();
    assert_eq!(calls.len(), OBJECTS);
    assert!(
        calls.values().all(|n| *n == 1),
        "an object was handled twice: {calls:?}"
    );
    assert_eq!(lists.load(Ordering::SeqCst), 1, "one listing was enough");
    assert!(queue.slots.lock().values().all(|s| s.relist.is_none()));
    assert!(queue.relisting.current.lock().is_none(), "the listing ended");
}

/// An object marked while a listing's pass runs, whose body that pass did not get (it came
/// after the LIST was answered), gets a second pass; a marked object no listing finds (it is
/// gone) is unmarked after a whole pass instead of being listed for ever.
#[tokio::test(start_paused = true)]
async fn an_object_marked_during_a_listing_gets_another_pass_and_an_unlisted_one_is_unmarked() {
    let (open, invoker) = Gated::new();
    let lists = Arc::new(AtomicU32::new(0));
    let items = Arc::new(Mutex::new(vec![numbered(1)]));
    let (list_open, list_gate) = watch::channel(false);
    let queue = queue_with(
        invoker.clone(),
        vec![create_fn()],
        Arc::new(Semaphore::new(1)),
        listing_of(items.clone(), lists.clone(), list_gate),
        bounded(1),
    );
    queue.push(EventType::Listing, numbered(0));
    queue.push(EventType::Listing, numbered(1));
    queue.push(EventType::Listing, numbered(9));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        lists.load(Ordering::SeqCst),
        1,
        "the first pass waits for its answer"
    );
    // u0 runs; u2 waits with its body; u3 comes after the LIST was answered, and is marked.
    queue.push(EventType::Added, numbered(2));
    queue.push(EventType::Added, numbered(3));
    assert!(queue.slots.lock().get("u3").is_some_and(|s| s.relist.is_some()));
    items.lock().push(numbered(3));
    list_open.send_replace(true);
    open.send_replace(true);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while invoker.total() < 4 || queue.relisting.current.lock().is_some() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} of 4 handled, {} listings",
            invoker.total(),
            lists.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        lists.load(Ordering::SeqCst),
        2,
        "a second pass for the object marked during the first"
    );
    let calls = invoker.calls.lock().clone();
    assert_eq!(calls.len(), 4, "{calls:?}");
    assert!(calls.values().all(|n| *n == 1), "{calls:?}");
    assert!(!calls.contains_key("u9"), "never listed: never handled");
    assert!(
        queue.slots.lock().values().all(|s| s.relist.is_none()),
        "the unlisted object is unmarked"
    );
    tokio::time::sleep(Duration::from_secs(60)).await;
    assert_eq!(lists.load(Ordering::SeqCst), 2, "no listing after that");
}

fn at_version(n: usize, rv: &str) -> Value {
    let mut body = numbered(n);
    body["metadata"]["resourceVersion"] = json!(rv);
    body
}

/// An object marked by an event while a listing's pass is under way: that pass's snapshot may
/// predate the event, so its body does not spend the mark; a pass that starts later queues
/// the object's current body, and the handler sees only that.
#[tokio::test(start_paused = true)]
async fn a_body_listed_by_a_pass_that_started_before_the_event_that_marked_the_object_keeps_the_mark() {
    let (open, invoker) = Gated::new();
    let lists = Arc::new(AtomicU32::new(0));
    let items = Arc::new(Mutex::new(vec![at_version(1, "10")]));
    let (list_open, list_gate) = watch::channel(false);
    let queue = queue_with(
        invoker.clone(),
        vec![create_fn()],
        Arc::new(Semaphore::new(1)),
        listing_of(items.clone(), lists.clone(), list_gate),
        bounded(2),
    );
    queue.push(EventType::Listing, at_version(0, "10"));
    queue.push(EventType::Listing, at_version(2, "10"));
    queue.push(EventType::Listing, at_version(1, "10"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(lists.load(Ordering::SeqCst), 1, "the pass for u1 started");
    // The queue fills up again, and u1 changes while the pass's LIST is under way.
    queue.push(EventType::Listing, at_version(3, "10"));
    queue.push(EventType::Modified, at_version(1, "60"));
    assert!(queue.slots.lock().get("u1").is_some_and(|s| s.relist.is_some()));
    items.lock()[0] = at_version(1, "60");
    list_open.send_replace(true);
    open.send_replace(true);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while invoker.total() < 4 || queue.relisting.current.lock().is_some() {
        assert!(tokio::time::Instant::now() < deadline, "u1 was not handled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let seen: Vec<_> = invoker
        .versions
        .lock()
        .iter()
        .filter(|(u, _)| u == "u1")
        .cloned()
        .collect();
    assert_eq!(seen, vec![("u1".to_owned(), "60".to_owned())]);
    assert_eq!(lists.load(Ordering::SeqCst), 2);
}

/// A re-run due after a running cycle (a timer fired during it) while a newer event of the
/// object waits for its listed body: the re-run does not run with the older body in memory
/// and spend the mark; the listed body's cycle does it.
#[tokio::test(start_paused = true)]
async fn a_re_run_leaves_a_newer_marked_event_to_its_listed_body() {
    let (open, invoker) = Gated::new();
    open.send_replace(true);
    let lists = Arc::new(AtomicU32::new(0));
    let queue = queue_with(
        invoker.clone(),
        vec![create_fn()],
        Arc::new(Semaphore::new(1)),
        listing(vec![at_version(1, "60")], lists.clone(), watch::channel(true).1),
        bounded(1),
    );
    // The cycle in flight keeps its body of version 50 (a retry due) and has a re-run due;
    // version 60 came meanwhile and was marked.
    queue.slots.lock().insert(
        "u1".into(),
        Slot {
            running: true,
            rerun: true,
            last_body: Some(Stored::new(&at_version(1, "50"))),
            relist: Some(EventType::Modified),
            relist_from: NonZeroU64::new(1),
            ..Slot::default()
        },
    );
    queue.relisting.marked();
    queue.finish("u1");
    queue.relist_soon();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while invoker.total() < 1 || queue.relisting.current.lock().is_some() {
        assert!(tokio::time::Instant::now() < deadline, "u1 was not handled");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        invoker.versions.lock().clone(),
        vec![("u1".to_owned(), "60".to_owned())],
        "one cycle, with the newer listed body"
    );
}

/// A body kept in memory (a timer's or a resync's) read just before a newer event marked the
/// object is not queued: the listing brings the newer one.
#[tokio::test(start_paused = true)]
async fn an_older_body_kept_in_memory_is_not_queued_under_a_newer_mark() {
    let (_open, invoker) = Gated::new();
    let queue = queue_with(
        invoker,
        vec![create_fn()],
        Arc::new(Semaphore::new(0)),
        objects(),
        bounded(1),
    );
    queue.slots.lock().insert(
        "u1".into(),
        Slot {
            last_body: Some(Stored::new(&at_version(1, "50"))),
            relist: Some(EventType::Modified),
            relist_from: NonZeroU64::new(1),
            ..Slot::default()
        },
    );
    queue.queue_body(
        EventType::Modified,
        at_version(1, "50"),
        Source::Memory(Priority::Change),
    );
    let slots = queue.slots.lock();
    let slot = slots.get("u1").expect("slot");
    assert!(slot.pending.is_none(), "the older body was queued");
    assert_eq!(slot.relist_from, NonZeroU64::new(1), "the mark stays");
}

/// While dispatch is paused, cycles keep no body and nothing is listed; resuming (a resync)
/// lists the objects and each gets its cycle.
#[tokio::test(start_paused = true)]
async fn a_paused_queue_keeps_no_bodies_and_resuming_lists_the_objects() {
    let (open, invoker) = Gated::new();
    open.send_replace(true);
    let lists = Arc::new(AtomicU32::new(0));
    let (pause, paused) = watch::channel(true);
    let queue = queue_pausable(
        invoker.clone(),
        vec![create_fn()],
        Arc::new(Semaphore::new(2)),
        listing(
            (0..3).map(numbered).collect(),
            lists.clone(),
            watch::channel(true).1,
        ),
        bounded(2),
        paused,
    );
    for n in 0..3 {
        queue.push(EventType::Listing, numbered(n));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while queue
        .slots
        .lock()
        .values()
        .any(|s| s.running || s.pending.is_some())
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the paused cycles did not end"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(invoker.total(), 0, "nothing is processed while paused");
    assert!(
        queue.slots.lock().values().all(|s| s.last_body.is_none()),
        "no body kept"
    );
    assert_eq!(lists.load(Ordering::SeqCst), 0, "nothing listed while paused");
    pause.send_replace(false);
    queue.resync();
    until_idle(&queue, || invoker.total(), 3).await;
    assert_eq!(lists.load(Ordering::SeqCst), 1);
    assert!(invoker.calls.lock().values().all(|n| *n == 1));
}

/// A listing for new marks soon after the last one ended waits for the pause first: marks
/// that keep coming while the queue is full do not list the collection back to back.
#[tokio::test(start_paused = true)]
async fn listings_for_new_marks_are_spaced() {
    let (open, invoker) = Gated::new();
    let lists = Arc::new(AtomicU32::new(0));
    let queue = queue_with(
        invoker.clone(),
        vec![create_fn()],
        Arc::new(Semaphore::new(1)),
        listing(
            (0..3).map(numbered).collect(),
            lists.clone(),
            watch::channel(true).1,
        ),
        bounded(1),
    );
    queue.push(EventType::Listing, numbered(0));
    queue.push(EventType::Listing, numbered(1));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(lists.load(Ordering::SeqCst), 1);
    assert!(
        queue.relisting.current.lock().is_none(),
        "the first listing ended"
    );
    // u0 runs, u1 waits with its body: the queue is full.
    queue.push(EventType::Listing, numbered(2));
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        lists.load(Ordering::SeqCst),
        1,
        "the second listing waits for the pause"
    );
    // The queue drains (the listing also waits for that); the pause still holds.
    open.send_replace(true);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(lists.load(Ordering::SeqCst), 1);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    assert_eq!(lists.load(Ordering::SeqCst), 2);
    until_idle(&queue, || invoker.total(), 3).await;
    assert!(invoker.calls.lock().values().all(|n| *n == 1));
}

/// The echoes of the controller's own writes made while the watch's initial listing ran come
/// all at once when the watch starts (from the listing's version). Each is of a version
/// whose cycle has run: none may wait with its body. (A start with 10,000 unhandled objects
/// held thousands of echoes beyond the waiting bound, the largest part of its peak.)
#[tokio::test(start_paused = true)]
async fn echoes_of_handled_versions_arriving_at_once_wait_with_no_body() {
    let q = queue_with(
        Arc::new(Slow::default()),
        vec![create_fn()],
        Arc::new(Semaphore::new(0)),
        objects(),
        bounded(4),
    );
    for n in 0..20 {
        q.slots.lock().insert(format!("u{n}").into(), Slot::default());
        if let Some(slot) = q.slots.lock().get_mut(format!("u{n}").as_str()) {
            slot.versions().await_echo("10", true);
        }
    }
    for n in 0..20 {
        q.push(EventType::Modified, numbered(n));
    }
    assert_eq!(
        pending_bodies(&q),
        0,
        "echoes of handled versions wait with their body"
    );
    assert_eq!(q.ready(), 0);
    // Changes by others beyond the bound (and the changes' reserve of a quarter more) are
    // marked as ever.
    for n in 0..20 {
        let mut changed = numbered(n);
        changed["metadata"]["resourceVersion"] = json!("11");
        q.push(EventType::Modified, changed);
    }
    assert_eq!(pending_bodies(&q), 5);
}

/// A cycle's write answers with the object as stored; the worker checks that version at once,
/// as its echo would have made it do. A webhook that changed the spec as the write was stored
/// makes that an update, handled without waiting for the watch; and the echo, when it comes,
/// runs nothing and waits with no body.
#[tokio::test(start_paused = true)]
async fn the_answer_to_a_write_is_checked_at_once_and_its_echo_runs_nothing() {
    let mut update = Registration::new("update_fn", HandlerKind::Update, None);
    update.resource = Some(resource());
    let invoker = Arc::new(Slow::default());
    let objects = patching(|o| o["spec"]["size"] = json!(2));
    let q = queue_of(
        invoker.clone(),
        vec![create_fn(), update],
        Arc::new(Semaphore::new(1)),
        objects.clone(),
    );
    q.push(EventType::Added, example("10"));
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        invoker.calls.load(Ordering::SeqCst),
        2,
        "the create handler, then the update handler for the webhook's change"
    );
    let slot_idle = |q: &Queue| {
        q.slots
            .lock()
            .get("u1")
            .is_some_and(|s| !s.running && s.pending.is_none())
    };
    assert!(slot_idle(&q));
    // The echoes of both writes come late: nothing runs, nothing waits.
    // Two writes from version 19 (a checkpoint may make it three: the handler takes as long
    // as the checkpoint waits).
    let written = awaited(&q).and_then(|(v, _)| v.parse::<u64>().ok()).unwrap_or(0);
    assert!(written >= 21, "written {written}");
    for rv in 20..=written {
        let mut echo = example(&rv.to_string());
        echo["spec"]["size"] = json!(2);
        q.push(EventType::Modified, echo);
        assert_eq!(
            pending_bodies(&q),
            0,
            "the echo of version {rv} (written {written}) waits"
        );
    }
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(invoker.calls.load(Ordering::SeqCst), 2);
    assert!(slot_idle(&q));
}

/// An object's next work while its handler runs, and what the cycle's write answer does to it.
async fn while_the_handler_runs(
    next: Option<(EventType, Value)>,
    handlers: Vec<Registration>,
) -> (Queue, Arc<Gated>) {
    while_the_handler_runs_at(next.into_iter().collect(), handlers, Store::new(|_| {})).await
}

/// As [`while_the_handler_runs`], with events `next` in order, against `store`.
async fn while_the_handler_runs_at(
    next: Vec<(EventType, Value)>,
    handlers: Vec<Registration>,
    store: Store,
) -> (Queue, Arc<Gated>) {
    let (open, invoker) = Gated::new();
    let q = queue_of(
        invoker.clone(),
        handlers,
        Arc::new(Semaphore::new(1)),
        serving(store),
    );
    q.push(EventType::Added, example("10"));
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(invoker.total(), 1);
    for (event_type, body) in next {
        q.push(event_type, body);
    }
    open.send_replace(true);
    tokio::time::sleep(Duration::from_secs(5)).await;
    (q, invoker)
}

/// The echo of a write may come before the write's answer: it waits as the object's next work
/// and the answer (the same version) replaces it — one check, no handler run again, even
/// though this echo carries none of the controller's records.
#[tokio::test(start_paused = true)]
async fn an_echo_before_the_answer_is_replaced_by_the_answer() {
    let (q, invoker) =
        while_the_handler_runs(Some((EventType::Modified, example("20"))), vec![create_fn()]).await;
    assert_eq!(invoker.total(), 1, "the early echo ran the handler again");
    assert_eq!(pending_bodies(&q), 0);
    assert!(
        q.slots
            .lock()
            .get("u1")
            .is_some_and(|s| !s.running && s.versions.is_none()),
        "the echo came: nothing is awaited"
    );
}

/// A change by someone else that comes while the handler runs is newer than the cycle's write
/// answer if it arrived after the write's echo (the watch brings an object's events in order),
/// and is processed itself; one that arrived before the echo predates the write, and the
/// answer supersedes it — whatever their versions, which are never compared as numbers.
#[tokio::test(start_paused = true)]
async fn a_change_newer_than_the_answer_is_processed_and_an_older_one_is_not() {
    let handlers = || {
        let mut update = Registration::new("update_fn", HandlerKind::Update, None);
        update.resource = Some(resource());
        vec![create_fn(), update]
    };
    let versions = |invoker: &Gated| {
        invoker
            .versions
            .lock()
            .iter()
            .map(|(_, rv)| rv.clone())
            .collect::<Vec<_>>()
    };
    // The server keeps the change (size 7) in every version it stores.
    let changed = |rv: &str| {
        let mut body = example(rv);
        body["spec"]["size"] = json!(7);
        body
    };
    let keeps_change = || Store::new(|o| o["spec"]["size"] = json!(7));
    // After the echo (version 20), a change at version 3 (versions went backwards).
    let (q, invoker) = while_the_handler_runs_at(
        vec![
            (EventType::Modified, example("20")),
            (EventType::Modified, changed("3")),
        ],
        handlers(),
        keeps_change(),
    )
    .await;
    // The change carries none of the controller's records: it is a creation to the cycle
    // that runs it, which proves that it ran rather than the answer (version 20).
    assert_eq!(versions(&invoker), ["10", "3"]);
    assert_eq!(pending_bodies(&q), 0);
    // Before the echo, a change at version 30: it predates the write, whose answer (version
    // 20) holds it: the update handler runs with the answer, never with the stale event.
    let (q, invoker) = while_the_handler_runs_at(
        vec![(EventType::Modified, changed("30"))],
        handlers(),
        keeps_change(),
    )
    .await;
    assert_eq!(versions(&invoker), ["10", "20"]);
    assert_eq!(pending_bodies(&q), 0);
}

/// A deletion that comes while the handler runs is not superseded by the write's answer.
#[tokio::test(start_paused = true)]
async fn a_deletion_while_the_handler_runs_is_not_superseded_by_the_answer() {
    let (q, invoker) =
        while_the_handler_runs(Some((EventType::Deleted, example("15"))), vec![create_fn()]).await;
    assert_eq!(invoker.total(), 1);
    assert!(
        q.slots.lock().get("u1").is_none(),
        "the deleted object is forgotten"
    );
}

/// An object that an admission webhook changes with every write never stops changing, as with
/// kopf; it gets [`FOLLOW_UPS`] checks of its answers in a row, then waits its turn: another
/// object is handled meanwhile.
#[tokio::test(start_paused = true)]
async fn an_object_changed_by_every_write_does_not_keep_its_worker() {
    let mut update = Registration::new("update_fn", HandlerKind::Update, None);
    update.resource = Some(resource());
    let (open, invoker) = Gated::new();
    open.send_replace(true);
    let bump = |o: &mut Value| {
        if o["metadata"]["name"] == "one" {
            let size = o["spec"]["size"].as_u64().unwrap_or(0);
            o["spec"]["size"] = json!(size + 1);
        }
    };
    let q = queue_of(
        invoker.clone(),
        vec![create_fn(), update],
        Arc::new(Semaphore::new(1)),
        patching(bump),
    );
    let calls = |uid: &str| invoker.calls.lock().get(uid).copied().unwrap_or(0);
    q.push(EventType::Added, example("10"));
    // The changing object keeps the runtime busy, so paused time does not move: progress is
    // counted in yields.
    let mut yields = 0;
    while calls("u1") < 2 {
        yields += 1;
        assert!(yields < 100_000, "the changing object's update handler never ran");
        tokio::task::yield_now().await;
    }
    q.push(EventType::Added, numbered(5));
    let before = invoker.order.lock().len();
    while calls("u5") == 0 {
        yields += 1;
        assert!(yields < 200_000, "the other object never got the worker");
        tokio::task::yield_now().await;
    }
    // Invocations in order: the changing object's that came after the other object was pushed
    // and before its handler ran.
    let order = invoker.order.lock().clone();
    let meanwhile = order.iter().skip(before).take_while(|uid| *uid != "u5").count();
    assert!(
        meanwhile <= FOLLOW_UPS + 1,
        "the changing object ran {meanwhile} more handlers first: {order:?}"
    );
}

/// Its first invocation runs past the checkpoint time and is then withdrawn (its process
/// left), the second is withdrawn before the checkpoint time, the third runs on: the first two cycles end with
/// nothing to write after a checkpoint, the second with the body the first left in memory.
#[derive(Default)]
struct WithdrawnTwice {
    calls: AtomicU32,
}

impl Invoker for WithdrawnTwice {
    fn invoke(&self, _work: Work, _control: Control) -> BoxFuture<'static, Outcome> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            match call {
                0 => tokio::time::sleep(Duration::from_secs(3)).await,
                1 => tokio::time::sleep(Duration::from_millis(10)).await,
                _ => std::future::pending().await,
            }
            Outcome::Cancelled
        })
    }
}

/// After a checkpoint with nothing written since, the plan's base is the body the cycle wrote,
/// not the object as stored (a user may have changed it in between), and so is the body kept
/// from it for the re-run: the watch's event of the checkpoint's version still waits to be
/// processed.
#[tokio::test(start_paused = true)]
async fn the_event_of_a_checkpoint_with_nothing_written_after_it_is_processed() {
    let invoker = Arc::new(WithdrawnTwice::default());
    let q = queue(
        invoker.clone(),
        vec![timed_create_fn()],
        Arc::new(Semaphore::new(1)),
    );
    q.push(EventType::Added, example("10"));
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        invoker.calls.load(Ordering::SeqCst),
        3,
        "two re-runs after withdrawals"
    );
    assert_eq!(
        awaited(&q),
        Some(("20".to_owned(), false)),
        "one write, the checkpoint, whose echo is awaited unseen"
    );
    assert!(
        an_edit_waits(&q, "20"),
        "the event of the checkpoint's version was dropped"
    );
}

/// Whether a watch event of `u1` at version `rv` with its spec edited is kept as work.
fn an_edit_waits(q: &Queue, rv: &str) -> bool {
    let mut edited = example(rv);
    edited["spec"]["size"] = json!(3);
    q.push(EventType::Modified, edited);
    q.slots.lock().get("u1").is_some_and(|s| s.pending.is_some())
}

/// Its first invocation runs past the checkpoint time and is then withdrawn; the second (the
/// re-run, from the body the checkpoint composed) succeeds.
#[derive(Default)]
struct WithdrawnOnce {
    calls: AtomicU32,
}

impl Invoker for WithdrawnOnce {
    fn invoke(&self, _work: Work, _control: Control) -> BoxFuture<'static, Outcome> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        Box::pin(async move {
            if call == 0 {
                tokio::time::sleep(Duration::from_secs(3)).await;
                return Outcome::Cancelled;
            }
            Outcome::success(None)
        })
    }
}

/// An API server where a PATCH changes nothing stored (the object already holds what it
/// sets, as when another writer got there first): the version stays.
fn keeps_version(object: &mut Value) {
    let rv = rv_number(object).unwrap_or(1).saturating_sub(1);
    object["metadata"]["resourceVersion"] = json!(rv.to_string());
}

/// A write from a body the cycle did not get from the API server (the one a checkpoint
/// composed) whose answer is that body's version: the answer is the object as stored, which
/// the cycle never saw, so the watch's event of that version is still processed.
#[tokio::test(start_paused = true)]
async fn a_write_that_changed_nothing_from_a_composed_body_leaves_its_version_unseen() {
    let invoker = Arc::new(WithdrawnOnce::default());
    let q = queue_of(
        invoker.clone(),
        vec![timed_create_fn()],
        Arc::new(Semaphore::new(1)),
        patching(keeps_version),
    );
    q.push(EventType::Added, example("10"));
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(
        invoker.calls.load(Ordering::SeqCst),
        2,
        "a re-run after the withdrawal"
    );
    assert_eq!(
        awaited(&q),
        Some(("19".to_owned(), false)),
        "the checkpoint and the re-run's write, both at 19, whose body no cycle got from the API server"
    );
    assert!(
        an_edit_waits(&q, "19"),
        "the event of the stored version was dropped"
    );
}

/// A change by someone else whose version compares lower than the controller's own write
/// (after an etcd restore, versions go backwards) is processed once the write's echo came:
/// "newer" is "arrived after the echo", never a larger number.
#[tokio::test(start_paused = true)]
async fn a_change_at_a_lower_version_than_our_write_is_processed() {
    let mut update = Registration::new("update_fn", HandlerKind::Update, None);
    update.resource = Some(resource());
    let (open, invoker) = Gated::new();
    open.send_replace(true);
    let store = Store::new(|_| {});
    let q = queue_of(
        invoker.clone(),
        vec![create_fn(), update],
        Arc::new(Semaphore::new(1)),
        serving(store.clone()),
    );
    q.push(EventType::Added, example("10"));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(invoker.total(), 1);
    assert_eq!(awaited(&q), Some(("20".to_owned(), true)));
    // An event from before the write: dropped. Then the echo: dropped.
    q.push(EventType::Modified, example("12"));
    assert_eq!(pending_bodies(&q), 0, "an event before the echo waits");
    q.push(EventType::Modified, example("20"));
    assert_eq!(pending_bodies(&q), 0, "the echo waits");
    assert!(awaited(&q).is_none());
    // Versions went backwards: someone's change is stored at version 3.
    let changed = {
        let mut objects = store.objects.lock();
        let object = objects.get_mut("one").expect("stored");
        object["spec"]["size"] = json!(5);
        object["metadata"]["resourceVersion"] = json!("3");
        object.clone()
    };
    q.push(EventType::Modified, changed);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        invoker.versions.lock().clone(),
        [
            ("u1".to_owned(), "10".to_owned()),
            ("u1".to_owned(), "3".to_owned())
        ],
        "the change at a lower version was not handled once"
    );
}

/// An API server whose versions are no numbers: the controller's own writes' echoes are
/// recognised by exact version, and the events that came before them dropped, as with numbers.
#[tokio::test(start_paused = true)]
async fn echoes_are_recognised_when_versions_are_no_numbers() {
    let mut update = Registration::new("update_fn", HandlerKind::Update, None);
    update.resource = Some(resource());
    let (open, invoker) = Gated::new();
    open.send_replace(true);
    let mut store = Store::new(|_| {});
    store.spell = |n| format!("etcd-{n}-opaque");
    let q = queue_of(
        invoker.clone(),
        vec![create_fn(), update],
        Arc::new(Semaphore::new(1)),
        serving(store.clone()),
    );
    q.push(EventType::Added, example("etcd-10-opaque"));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(invoker.total(), 1);
    assert_eq!(
        awaited(&q),
        Some(("etcd-20-opaque".to_owned(), true)),
        "the echo of the write is awaited by its exact version"
    );
    // The event of the version the cycle saw comes late, then the echo: neither runs anything.
    q.push(EventType::Modified, example("etcd-10-opaque"));
    q.push(EventType::Modified, example("etcd-20-opaque"));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(invoker.total(), 1);
    assert_eq!(pending_bodies(&q), 0);
    // A change after the echo runs the update handler.
    let changed = {
        let mut objects = store.objects.lock();
        let object = objects.get_mut("one").expect("stored");
        object["spec"]["size"] = json!(5);
        object["metadata"]["resourceVersion"] = json!("etcd-21-opaque");
        object.clone()
    };
    q.push(EventType::Modified, changed);
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(invoker.total(), 2);
}

/// The echo of a write that never comes (a server that does not send it) does not stop the
/// object for good: after its patience, the object's events are processed again.
#[tokio::test(start_paused = true)]
async fn an_echo_that_never_comes_is_awaited_for_a_bounded_number_of_events() {
    let mut update = Registration::new("update_fn", HandlerKind::Update, None);
    update.resource = Some(resource());
    let (open, invoker) = Gated::new();
    open.send_replace(true);
    let store = Store::new(|_| {});
    let q = queue_of(
        invoker.clone(),
        vec![create_fn(), update],
        Arc::new(Semaphore::new(1)),
        serving(store.clone()),
    );
    q.push(EventType::Added, example("10"));
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(invoker.total(), 1);
    for n in 0..=version::PATIENCE {
        let changed = {
            let mut objects = store.objects.lock();
            let object = objects.get_mut("one").expect("stored");
            object["spec"]["size"] = json!(100 + u64::from(n));
            object["metadata"]["resourceVersion"] = json!(format!("x{n}"));
            object.clone()
        };
        q.push(EventType::Modified, changed);
        tokio::task::yield_now().await;
    }
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(
        invoker.total(),
        2,
        "the event after the patience is processed, once"
    );
}

/// A watch event standing in for the listed body of an object the listing under way has not
/// reached yet counts as the object's listing: its first cycle is the initial one (resume
/// handlers), as if the listed body had come first; any other first event does not.
#[tokio::test(start_paused = true)]
async fn a_watch_event_standing_in_for_a_listed_body_counts_as_the_listing() {
    let (_pause, paused) = watch::channel(true);
    let q = queue_pausable(
        Arc::new(PanicsOnce::default()),
        vec![create_fn()],
        Arc::new(Semaphore::new(4)),
        objects(),
        relisting::Settings::default(),
        paused,
    );
    q.observe(EventType::Modified, numbered(1), None, true).await;
    q.observe(EventType::Modified, numbered(2), None, false).await;
    q.observe(
        EventType::Listing,
        numbered(3),
        Some(tokio::time::Instant::now()),
        false,
    )
    .await;
    let noticed = |uid: &str| q.slots.lock().get(uid).map(|s| s.memory.noticed_by_listing);
    assert_eq!(noticed("u1"), Some(true));
    assert_eq!(noticed("u2"), Some(false));
    assert_eq!(noticed("u3"), Some(true));
}
