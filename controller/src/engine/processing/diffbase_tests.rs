//! The compact diff-base (`--diff-base fields`) against the full one: the same stories of an
//! object run under both, and handlers are given the same cause, `old`, `new` and `diff` —
//! except the documented difference of resume and delete handlers, which is pinned here too.

use std::time::Duration;

use parking_lot::Mutex;
use serde_json::{Value, json};

use super::{tests::resource, *};
use crate::model::ValueMatch;

const DIFFBASE: &str = "capstan.dev/last-handled-configuration";
const FINALIZER: &str = "capstan.dev/finalizer";

/// Answers every invocation with success and records what handlers were given.
#[derive(Default)]
struct Recorder(Mutex<Vec<(String, Payload)>>);

impl Invoker for Recorder {
    fn invoke(&self, work: Work, _control: Control) -> BoxFuture<'static, Outcome> {
        self.0.lock().push((work.handler_id.0.clone(), work.payload));
        Box::pin(async { Outcome::success(None) })
    }
}

fn reg(id: &str, kind: HandlerKind, field: &str) -> Registration {
    let mut r = Registration::new(id, kind, None);
    r.resource = Some(resource());
    if !field.is_empty() {
        r.filters.field = field.split('.').map(str::to_owned).collect();
    }
    r
}

/// An object as one controller sees it over time: each step edits the stored body, runs the
/// cycles an event brings (a finalizer added alone first), and keeps what they write.
struct Story {
    storage: Storage,
    handlers: Vec<Registration>,
    body: Value,
    recorder: Recorder,
    /// How many writes the cycles asked for.
    writes: usize,
}

impl Story {
    fn new(extent: Extent, handlers: Vec<Registration>) -> Self {
        Self {
            storage: Storage {
                diffbase_extent: extent,
                ..Storage::annotations("capstan.dev")
            },
            handlers,
            body: json!({"apiVersion": "demo.capstan.dev/v1", "kind": "Example",
                "metadata": {"name": "one", "namespace": "default", "uid": "u1", "resourceVersion": "1"},
                "spec": {"size": 1, "other": "a", "big": "x".repeat(1000)}}),
            recorder: Recorder::default(),
            writes: 0,
        }
    }

    async fn step(&mut self, event: EventType, memory: Memory, edit: impl FnOnce(&mut Value)) -> Cause {
        edit(&mut self.body);
        loop {
            let cancel = CancellationToken::new();
            let plan = cycle(
                Input {
                    body: &self.body,
                    event,
                    resource: &resource(),
                    handlers: &self.handlers,
                    memory,
                    storage: &self.storage,
                    cancel: &cancel,
                    checkpoint: None,
                    checkpoint_after: Duration::from_secs(60),
                    daemons_alive: false,
                    max_losses: 3,
                    registered: None,
                },
                &self.recorder,
            )
            .await;
            if let Some(desired) = plan.desired {
                self.body = desired;
                self.writes += 1;
            }
            match plan.finalizer {
                FinalizerChange::Add => {
                    object_at(&mut self.body, &["metadata"]).insert("finalizers".into(), json!([FINALIZER]));
                    self.writes += 1;
                    continue;
                }
                FinalizerChange::Remove => {
                    object_at(&mut self.body, &["metadata"]).remove("finalizers");
                    self.writes += 1;
                }
                FinalizerChange::Keep => {}
            }
            return plan.cause;
        }
    }

    async fn modified(&mut self, edit: impl FnOnce(&mut Value)) -> Cause {
        let memory = Memory {
            noticed_by_listing: false,
            fully_handled_once: true,
        };
        self.step(EventType::Modified, memory, edit).await
    }

    /// A restart: the object is listed again.
    async fn listed(&mut self, edit: impl FnOnce(&mut Value)) -> Cause {
        let memory = Memory {
            noticed_by_listing: true,
            fully_handled_once: false,
        };
        self.step(EventType::Listing, memory, edit).await
    }

    fn seen(&self) -> Vec<(String, Payload)> {
        self.recorder.0.lock().clone()
    }

    fn diffbase(&self) -> Option<String> {
        self.body
            .pointer("/metadata/annotations")
            .and_then(|a| a.get(DIFFBASE))
            .and_then(Value::as_str)
            .map(str::to_owned)
    }
}

/// The stories under both extents, step by step.
struct Both {
    full: Story,
    fields: Story,
}

impl Both {
    fn new(handlers: &[Registration]) -> Self {
        Self {
            full: Story::new(Extent::Full, handlers.to_vec()),
            fields: Story::new(Extent::Fields, handlers.to_vec()),
        }
    }

    async fn added(&mut self) {
        let memory = Memory::default();
        self.full.step(EventType::Added, memory, |_| {}).await;
        self.fields.step(EventType::Added, memory, |_| {}).await;
    }

    async fn modified(&mut self, edit: impl Fn(&mut Value)) {
        self.full.modified(&edit).await;
        self.fields.modified(&edit).await;
    }

    async fn listed(&mut self, edit: impl Fn(&mut Value)) {
        self.full.listed(&edit).await;
        self.fields.listed(&edit).await;
    }

    fn handlers(&mut self, handlers: &[Registration]) {
        self.full.handlers = handlers.to_vec();
        self.fields.handlers = handlers.to_vec();
    }

    /// Handlers were given the same under both; returns what they were given.
    fn same(&self) -> Vec<(String, Payload)> {
        let seen = self.full.seen();
        assert_eq!(seen, self.fields.seen());
        seen
    }
}

fn set(path: &'static str, value: Value) -> impl Fn(&mut Value) {
    move |body: &mut Value| {
        let pointer = format!("/{}", path.replace('.', "/"));
        if let Some(slot) = body.pointer_mut(&pointer) {
            *slot = value.clone();
        } else if let Some((parent, key)) = pointer.rsplit_once('/')
            && let Some(map) = body.pointer_mut(parent).and_then(Value::as_object_mut)
        {
            map.insert(key.to_owned(), value.clone());
        }
    }
}

fn change(
    reason: ChangeReason,
    old: Option<Value>,
    new: Option<Value>,
) -> (ChangeReason, Option<Value>, Option<Value>) {
    (reason, old, new)
}

fn of(payload: &Payload) -> (ChangeReason, Option<Value>, Option<Value>) {
    match payload {
        Payload::Change { reason, old, new, .. } => (*reason, old.clone(), new.clone()),
        other => panic!("not a change: {other:?}"),
    }
}

fn diff_paths(payload: &Payload) -> Vec<String> {
    match payload {
        Payload::Change { diff, .. } => diff.iter().map(|d| d.path.join(".")).collect(),
        other => panic!("not a change: {other:?}"),
    }
}

#[tokio::test]
async fn field_handlers_are_given_the_same_old_new_and_diff() {
    let mut filtered = reg("grown", HandlerKind::Field, "spec.size");
    filtered.filters.old = Some(ValueMatch::Equals(json!(1)));
    filtered.filters.new = Some(ValueMatch::Equals(json!(3)));
    let mut valued = reg("valued", HandlerKind::Field, "spec.size");
    valued.filters.value = Some(ValueMatch::Equals(json!(3)));
    let handlers = [
        reg("create", HandlerKind::Create, ""),
        reg("size", HandlerKind::Field, "spec.size"),
        filtered,
        valued,
        reg("label", HandlerKind::Field, "metadata.labels.app"),
    ];
    let mut both = Both::new(&handlers);
    both.added().await;
    // Watched fields change, then one that no handler watches.
    both.modified(set("spec.size", json!(3))).await;
    both.modified(set("metadata.labels", json!({"app": "db"}))).await;
    both.modified(set("spec.size", json!(4))).await;
    both.modified(set("spec.other", json!("b"))).await;
    both.modified(set("metadata.labels", json!({}))).await;
    let seen = both.same();
    let ids: Vec<&str> = seen.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(
        ids,
        [
            "create", "size", "size", "grown", "valued", "label", "size", "valued", "label"
        ]
    );
    assert_eq!(
        of(&seen[2].1),
        change(ChangeReason::Update, Some(json!(1)), Some(json!(3)))
    );
    assert_eq!(diff_paths(&seen[2].1), [""], "reduced to the field");
    assert_eq!(
        of(&seen[8].1),
        change(ChangeReason::Update, Some(json!("db")), None)
    );
    // The compact diff-base holds the watched fields only; the full one the whole essence.
    assert_eq!(
        both.fields.diffbase().as_deref(),
        Some("[1,{\"spec.size\":4},[\"metadata.labels.app\"]]\n")
    );
    assert!(both.full.diffbase().is_some_and(|d| d.contains("\"big\"")));
    // The unwatched change cost the full diff-base a write and nothing under fields.
    assert_eq!(both.full.writes, both.fields.writes + 1);
}

#[tokio::test]
async fn update_handlers_without_a_field_keep_the_full_essence_byte_for_byte() {
    let mut with_field = reg("with_field", HandlerKind::Update, "spec.size");
    with_field.filters.new = Some(ValueMatch::Equals(json!(3)));
    for handlers in [
        vec![
            reg("update", HandlerKind::Update, ""),
            reg("size", HandlerKind::Field, "spec.size"),
        ],
        vec![
            with_field,
            reg("create", HandlerKind::Create, ""),
            reg("update", HandlerKind::Update, ""),
        ],
    ] {
        let mut both = Both::new(&handlers);
        both.added().await;
        both.modified(set("spec.size", json!(3))).await;
        both.modified(set("spec.other", json!("b"))).await;
        both.same();
        assert_eq!(both.full.body, both.fields.body, "the same writes");
        assert!(
            both.fields
                .diffbase()
                .is_some_and(|d| d.starts_with("{\"spec\":{"))
        );
    }
}

/// kopf reduces `old`, `new` and `diff` to the field for every changing handler with a
/// `field` (create, update, resume, delete and field handlers alike), not only for field
/// handlers.
#[tokio::test]
async fn every_changing_handler_with_a_field_is_given_the_fields_old_new_and_diff() {
    let handlers = [
        reg("create", HandlerKind::Create, "spec.size"),
        reg("update", HandlerKind::Update, "spec.size"),
        reg("resume", HandlerKind::Resume, "spec.size"),
        reg("delete", HandlerKind::Delete, "spec.size"),
    ];
    let mut both = Both::new(&handlers);
    both.added().await;
    both.modified(set("spec.size", json!(3))).await;
    both.listed(|_| {}).await;
    both.modified(set("metadata.deletionTimestamp", json!("2026-01-01T00:00:00Z")))
        .await;
    let seen = both.same();
    let ids: Vec<&str> = seen.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, ["create", "update", "resume", "delete"]);
    assert_eq!(of(&seen[0].1), change(ChangeReason::Create, None, Some(json!(1))));
    assert_eq!(
        of(&seen[1].1),
        change(ChangeReason::Update, Some(json!(1)), Some(json!(3)))
    );
    assert_eq!(diff_paths(&seen[1].1), [""], "reduced to the field");
    assert_eq!(
        of(&seen[2].1),
        change(ChangeReason::Resume, Some(json!(3)), Some(json!(3)))
    );
    assert!(diff_paths(&seen[2].1).is_empty());
    assert_eq!(
        of(&seen[3].1),
        change(ChangeReason::Delete, Some(json!(3)), Some(json!(3)))
    );
    for (id, payload) in &seen {
        let Payload::Change { field, .. } = payload else {
            panic!("not a change: {payload:?}");
        };
        assert_eq!(field, "spec.size", "{id}");
    }
    // An update handler with a field reads only its field: the diff-base stays compact.
    assert_eq!(both.fields.diffbase().as_deref(), Some("[1,{\"spec.size\":3}]\n"));
}

#[tokio::test]
async fn create_handlers_are_given_the_same() {
    let mut valued = reg("valued", HandlerKind::Create, "spec.size");
    valued.filters.value = Some(ValueMatch::Equals(json!(1)));
    let mut both = Both::new(&[reg("create", HandlerKind::Create, ""), valued]);
    both.added().await;
    both.modified(set("spec.size", json!(2))).await;
    let seen = both.same();
    assert_eq!(seen.len(), 2);
    assert_eq!(of(&seen[0].1).1, None, "a creation has no old state");
    assert_eq!(both.fields.diffbase().as_deref(), Some("[1]\n"));
}

#[tokio::test]
async fn resume_and_delete_handlers_with_a_field_are_given_the_same() {
    let mut resume = reg("resume", HandlerKind::Resume, "spec.size");
    resume.filters.value = Some(ValueMatch::Equals(json!(1)));
    let mut delete = reg("delete", HandlerKind::Delete, "spec.size");
    delete.filters.value = Some(ValueMatch::Equals(json!(5)));
    let mut both = Both::new(&[resume, delete, reg("size", HandlerKind::Field, "spec.size")]);
    both.added().await;
    // Changed while the controller was down: the resume handler matches by the old value.
    both.listed(set("spec.size", json!(2))).await;
    both.modified(set("spec.size", json!(5))).await;
    both.modified(|b| {
        set("spec.size", json!(6))(b);
        set("metadata.deletionTimestamp", json!("2026-01-01T00:00:00Z"))(b);
    })
    .await;
    let seen = both.same();
    let ids: Vec<&str> = seen.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(ids, ["size", "resume", "size", "size", "delete"]);
    assert_eq!(of(&seen[1].1).0, ChangeReason::Update);
    assert!(both.full.body.pointer("/metadata/finalizers").is_none());
    assert!(both.fields.body.pointer("/metadata/finalizers").is_none());
}

/// The documented difference: the whole `old` and `diff` of resume and delete handlers show
/// only the changes of watched fields, and a resumption whose only changes are unwatched is a
/// resumption.
#[tokio::test]
async fn resume_and_delete_handlers_see_only_watched_changes_under_fields() {
    let handlers = [
        reg("resume", HandlerKind::Resume, ""),
        reg("delete", HandlerKind::Delete, ""),
        reg("size", HandlerKind::Field, "spec.size"),
    ];
    let mut both = Both::new(&handlers);
    both.added().await;
    // While the controller was down: an unwatched and a watched change.
    both.listed(|b| {
        set("spec.other", json!("b"))(b);
        set("spec.size", json!(2))(b);
    })
    .await;
    let (full, fields) = (both.full.seen(), both.fields.seen());
    let ids = |seen: &[(String, Payload)]| seen.iter().map(|(id, _)| id.clone()).collect::<Vec<_>>();
    assert_eq!(ids(&full), ["size", "resume", "size"]);
    assert_eq!(ids(&fields), ids(&full));
    assert_eq!(full[2], fields[2], "the field handler: the same");
    assert_eq!(diff_paths(&full[1].1), ["spec.other", "spec.size"]);
    assert_eq!(diff_paths(&fields[1].1), ["spec.size"]);
    assert_eq!(of(&full[1].1).1.unwrap()["spec"]["other"], "a");
    assert_eq!(of(&fields[1].1).1.unwrap()["spec"]["other"], "b");

    // Only an unwatched change while down: an update under full, a resumption under fields.
    let mut both = Both::new(&handlers);
    both.added().await;
    both.listed(set("spec.other", json!("c"))).await;
    let (full, fields) = (both.full.seen(), both.fields.seen());
    assert_eq!(of(&full[1].1).0, ChangeReason::Update);
    assert_eq!(of(&fields[1].1).0, ChangeReason::Resume);
    assert!(diff_paths(&fields[1].1).is_empty());

    // Deleted with an unwatched change the controller had not seen.
    let mut both = Both::new(&handlers);
    both.added().await;
    both.modified(|b| {
        set("spec.other", json!("d"))(b);
        set("metadata.deletionTimestamp", json!("2026-01-01T00:00:00Z"))(b);
    })
    .await;
    let (full, fields) = (both.full.seen(), both.fields.seen());
    assert_eq!(full[1].0, "delete");
    assert_eq!(fields[1].0, "delete");
    assert_eq!(diff_paths(&full[1].1), ["spec.other"]);
    assert!(diff_paths(&fields[1].1).is_empty());
}

#[tokio::test]
async fn a_handler_added_later_watches_from_the_value_it_finds() {
    let create = reg("create", HandlerKind::Create, "");
    let other = reg("other", HandlerKind::Field, "spec.other");
    let mut both = Both::new(std::slice::from_ref(&create));
    both.added().await;
    assert_eq!(both.fields.diffbase().as_deref(), Some("[1]\n"));
    // A new version adds a handler on spec.other: the compact diff-base is brought up to it
    // by one write; then its changes are seen as under the full diff-base.
    both.handlers(&[create.clone(), other.clone()]);
    let writes = both.fields.writes;
    both.listed(|_| {}).await;
    assert_eq!(both.fields.writes, writes + 1);
    assert_eq!(
        both.fields.diffbase().as_deref(),
        Some("[1,{\"spec.other\":\"a\"}]\n")
    );
    both.modified(|_| {}).await;
    assert_eq!(both.fields.writes, writes + 1, "once");
    both.modified(set("spec.other", json!("b"))).await;
    let seen = both.same();
    assert_eq!(seen.len(), 2);
    assert_eq!(
        of(&seen[1].1),
        change(ChangeReason::Update, Some(json!("a")), Some(json!("b")))
    );
    // And when it goes again, the next write shrinks the diff-base.
    both.handlers(std::slice::from_ref(&create));
    both.modified(set("spec.size", json!(9))).await;
    assert_eq!(
        both.fields.diffbase().as_deref(),
        Some("[1,{\"spec.other\":\"b\"}]\n")
    );
    both.handlers(&[create, reg("resume", HandlerKind::Resume, "")]);
    both.listed(|_| {}).await;
    assert_eq!(both.fields.diffbase().as_deref(), Some("[1]\n"));
}

#[tokio::test]
async fn an_essence_of_an_earlier_version_is_read_as_full_and_converted_by_the_next_write() {
    let handlers = [
        reg("create", HandlerKind::Create, ""),
        reg("size", HandlerKind::Field, "spec.size"),
        reg("resume", HandlerKind::Resume, ""),
    ];
    // Written by an earlier version (the whole essence).
    let mut earlier = Story::new(Extent::Full, handlers.to_vec());
    earlier.step(EventType::Added, Memory::default(), |_| {}).await;
    let mut story = Story::new(Extent::Fields, handlers.to_vec());
    story.body = earlier.body.clone();
    let essence = story.diffbase().expect("stored");
    assert!(essence.starts_with("{\"spec\":{"));
    // A restart with nothing changed: no handler but resume, no write.
    story.listed(|_| {}).await;
    story.modified(|_| {}).await;
    assert_eq!(story.writes, 0);
    assert_eq!(story.diffbase(), Some(essence));
    // A watched change: the field handler sees the old value, and the compact format is
    // written.
    story.modified(set("spec.size", json!(2))).await;
    assert_eq!(
        of(&story.seen()[1].1),
        change(ChangeReason::Update, Some(json!(1)), Some(json!(2)))
    );
    assert_eq!(story.diffbase().as_deref(), Some("[1,{\"spec.size\":2}]\n"));
    let ids: Vec<String> = story.seen().into_iter().map(|(id, _)| id).collect();
    assert_eq!(ids, ["resume", "size"]);
}

/// An earlier version's essence must not keep unwatched values that are out of date: a
/// handler added later on such a field would be called for a change nobody watched.
#[tokio::test]
async fn an_earlier_essence_is_replaced_when_an_unwatched_field_changes() {
    let handlers = [
        reg("create", HandlerKind::Create, ""),
        reg("size", HandlerKind::Field, "spec.size"),
    ];
    let mut earlier = Story::new(Extent::Full, handlers.to_vec());
    earlier.step(EventType::Added, Memory::default(), |_| {}).await;
    let mut story = Story::new(Extent::Fields, handlers.to_vec());
    story.body = earlier.body.clone();
    // An unwatched change calls nothing; the essence it makes out of date is replaced (one
    // write, as the earlier version made for the same change).
    story.modified(set("spec.other", json!("b"))).await;
    assert!(story.seen().is_empty());
    assert_eq!(story.writes, 1);
    assert_eq!(story.diffbase().as_deref(), Some("[1,{\"spec.size\":1}]\n"));
    // A new version adds a handler on that field: it watches from the value it finds.
    story
        .handlers
        .push(reg("other", HandlerKind::Field, "spec.other"));
    story.listed(|_| {}).await;
    assert!(story.seen().is_empty(), "{:?}", story.seen());
    story.modified(set("spec.other", json!("c"))).await;
    assert_eq!(
        of(&story.seen()[0].1),
        change(ChangeReason::Update, Some(json!("b")), Some(json!("c")))
    );
}

#[tokio::test]
async fn watched_fields_follow_the_kinds_that_read_old_values() {
    let storage = Storage::annotations("capstan.dev");
    let paths = |handlers: &[Registration]| watched(&storage, handlers);
    let daemon = reg("daemon", HandlerKind::Daemon, "status.phase");
    assert_eq!(
        paths(&[
            reg("c", HandlerKind::Create, "spec.a"),
            reg("f", HandlerKind::Field, "spec.b"),
            reg("r", HandlerKind::Resume, "spec.c.d"),
            reg("d", HandlerKind::Delete, "spec.c"),
            reg("e", HandlerKind::Event, "spec.e"),
            daemon,
        ]),
        Watched::Paths(vec![
            vec!["spec".into(), "b".into()],
            vec!["spec".into(), "c".into()]
        ])
    );
    assert_eq!(
        paths(&[reg("u", HandlerKind::Update, "spec.a")]),
        Watched::Paths(vec![vec!["spec".into(), "a".into()]])
    );
    assert_eq!(paths(&[reg("u", HandlerKind::Update, "")]), Watched::All);
    let full = Storage {
        diffbase_extent: Extent::Full,
        ..Storage::annotations("capstan.dev")
    };
    assert_eq!(watched(&full, &[]), Watched::All);
}
