//! Processing cycles against a scripted invoker: causes, order and patch visibility, progress
//! records, diff-base, finalizers, retries, sub-handlers and rejected patches.

use std::{collections::VecDeque, time::Duration};

use parking_lot::Mutex;
use serde_json::{Value, json};

use super::*;
use crate::model::{KindOptions, PatchTarget, SubhandlerOutcome};

/// Answers invocations from a script and records what it was asked.
#[derive(Default)]
struct Script {
    answers: Mutex<VecDeque<Outcome>>,
    seen: Mutex<Vec<Work>>,
}

impl Script {
    fn new(answers: Vec<Outcome>) -> Self {
        Self {
            answers: Mutex::new(answers.into()),
            seen: Mutex::new(Vec::new()),
        }
    }

    fn ids(&self) -> Vec<String> {
        self.seen.lock().iter().map(|w| w.handler_id.0.clone()).collect()
    }
}

impl Invoker for Script {
    fn invoke(&self, work: Work, _control: Control) -> BoxFuture<'static, Outcome> {
        self.seen.lock().push(work);
        let answer = self.answers.lock().pop_front().unwrap_or(Outcome::success(None));
        Box::pin(async move { answer })
    }
}

/// The example resource the engine's unit tests handle.
pub(super) fn resource() -> ResolvedResource {
    ResolvedResource {
        group: "demo.capstan.dev".into(),
        version: "v1".into(),
        plural: "examples".into(),
        kind: "Example".into(),
        namespaced: true,
        status_subresource: true,
    }
}

fn reg(id: &str, kind: HandlerKind) -> Registration {
    let mut r = Registration::new(id, kind, None);
    r.resource = Some(resource());
    r
}

fn body() -> Value {
    json!({"apiVersion": "demo.capstan.dev/v1", "kind": "Example",
           "metadata": {"name": "one", "namespace": "default", "uid": "u1", "resourceVersion": "10"},
           "spec": {"size": 1}})
}

async fn run(
    body: &Value,
    event: EventType,
    handlers: &[Registration],
    memory: Memory,
    script: &Script,
) -> Plan {
    let storage = Storage::annotations("capstan.dev");
    let cancel = CancellationToken::new();
    cycle(
        Input {
            body,
            event,
            resource: &resource(),
            handlers,
            memory,
            storage: &storage,
            cancel: &cancel,
            checkpoint: None,
            checkpoint_after: Duration::from_secs(1),
            daemons_alive: false,
            max_losses: 3,
            registered: None,
        },
        script,
    )
    .await
}

fn merge(p: Value) -> Patch {
    Patch {
        patch_type: PatchType::Merge,
        target: PatchTarget::Object,
        body: p,
    }
}

fn success(result: Option<Value>, patches: Vec<Patch>) -> Outcome {
    Outcome::Success {
        result,
        kind_result: None,
        patches,
        subhandlers: vec![],
    }
}

fn annotations(v: &Value) -> Vec<String> {
    v.pointer("/metadata/annotations")
        .and_then(Value::as_object)
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default()
}

#[tokio::test]
async fn a_create_runs_every_handler_in_order_and_writes_once() {
    let handlers = [
        reg("first", HandlerKind::Create),
        reg("second", HandlerKind::Create),
        reg("upd", HandlerKind::Update),
    ];
    let script = Script::new(vec![
        success(
            Some(json!({"message": "hi"})),
            vec![merge(json!({"spec": {"size": 2}}))],
        ),
        success(
            None,
            vec![merge(json!({"metadata": {"labels": {"seen": "yes"}}}))],
        ),
    ]);
    let plan = run(&body(), EventType::Added, &handlers, Memory::default(), &script).await;
    assert_eq!(plan.cause, Cause::Create);
    assert_eq!(script.ids(), ["first", "second"]);
    let seen = script.seen.lock();
    assert_eq!(
        seen[1].body.as_ref().unwrap()["spec"]["size"],
        2,
        "the second handler sees the first one's patch"
    );
    let desired = plan.desired.expect("something to write");
    assert_eq!(desired["status"]["first"], json!({"message": "hi"}));
    assert_eq!(desired["metadata"]["labels"]["seen"], "yes");
    let keys = annotations(&desired);
    assert!(keys.contains(&"capstan.dev/last-handled-configuration".to_owned()));
    assert!(
        !keys.iter().any(|k| k == "capstan.dev/first"),
        "records are purged when the cause is done: {keys:?}"
    );
    assert!(plan.done);
    assert_eq!(plan.finalizer, FinalizerChange::Keep);
}

#[tokio::test]
async fn a_temporary_error_is_recorded_and_scheduled() {
    let handlers = [reg("ok", HandlerKind::Create), reg("flaky", HandlerKind::Create)];
    let script = Script::new(vec![
        success(None, vec![]),
        Outcome::Temporary {
            delay: Some(Duration::from_secs(7)),
            diagnostics: vec![Diagnostic::error("X", "not yet")],
            subhandlers: vec![],
        },
    ]);
    let plan = run(&body(), EventType::Added, &handlers, Memory::default(), &script).await;
    assert!(!plan.done);
    let desired = plan.desired.unwrap();
    let record: ProgressRecord = serde_json::from_str(
        desired["metadata"]["annotations"]["capstan.dev/flaky"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert_eq!(
        (record.retries, record.success, record.message.as_deref()),
        (1, false, Some("not yet"))
    );
    let ok: ProgressRecord = serde_json::from_str(
        desired["metadata"]["annotations"]["capstan.dev/ok"]
            .as_str()
            .unwrap(),
    )
    .unwrap();
    assert!(ok.success);
    assert!(
        desired["metadata"]["annotations"]
            .get("capstan.dev/last-handled-configuration")
            .is_none()
    );
    let wake = plan.wake_at.expect("a wake-up");
    assert!(wake > SystemTime::now() + Duration::from_secs(5));

    // The next cycle: the finished handler is not called again, the sleeping one not yet.
    let script = Script::default();
    let plan = run(
        &desired,
        EventType::Modified,
        &handlers,
        Memory::default(),
        &script,
    )
    .await;
    assert!(script.ids().is_empty());
    assert!(plan.desired.is_none(), "nothing changed, nothing to write");
}

#[tokio::test]
async fn the_finalizer_is_added_alone_then_removed_after_delete_handlers() {
    let handlers = [
        reg("create", HandlerKind::Create),
        reg("delete", HandlerKind::Delete),
    ];
    let script = Script::default();
    let plan = run(&body(), EventType::Added, &handlers, Memory::default(), &script).await;
    assert_eq!(plan.finalizer, FinalizerChange::Add);
    assert!(
        script.ids().is_empty(),
        "no handler runs before the finalizer is there"
    );

    let mut deleting = body();
    deleting["metadata"]["finalizers"] = json!(["capstan.dev/finalizer", "other/keep"]);
    deleting["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    let plan = run(
        &deleting,
        EventType::Modified,
        &handlers,
        Memory::default(),
        &script,
    )
    .await;
    assert_eq!(plan.cause, Cause::Delete);
    assert_eq!(script.ids(), ["delete"]);
    assert_eq!(plan.finalizer, FinalizerChange::Remove);

    let mut optional = reg("delete", HandlerKind::Delete);
    optional.options = KindOptions::Delete { optional: true };
    let plan = run(
        &body(),
        EventType::Added,
        &[optional],
        Memory::default(),
        &Script::default(),
    )
    .await;
    assert_eq!(
        plan.finalizer,
        FinalizerChange::Keep,
        "optional delete handlers never block deletion"
    );
}

#[tokio::test]
async fn a_finalizer_no_longer_needed_is_released() {
    let mut b = body();
    b["metadata"]["finalizers"] = json!(["capstan.dev/finalizer"]);
    let plan = run(
        &b,
        EventType::Modified,
        &[reg("create", HandlerKind::Create)],
        Memory::default(),
        &Script::default(),
    )
    .await;
    assert_eq!(plan.finalizer, FinalizerChange::Remove);
}

#[tokio::test]
async fn resume_update_and_noop_follow_the_diff_base() {
    let handlers = [
        reg("resume", HandlerKind::Resume),
        reg("update", HandlerKind::Update),
    ];
    let script = Script::default();
    let created = run(&body(), EventType::Added, &handlers, Memory::default(), &script)
        .await
        .desired
        .unwrap();
    assert!(
        script.ids().is_empty(),
        "no create handlers: the diff-base is stored anyway"
    );

    let listing = Memory {
        noticed_by_listing: true,
        fully_handled_once: false,
    };
    let plan = run(&created, EventType::Listing, &handlers, listing, &script).await;
    assert_eq!(plan.cause, Cause::Resume);
    assert_eq!(script.ids(), ["resume"]);

    let plan = run(
        &created,
        EventType::Modified,
        &handlers,
        Memory {
            noticed_by_listing: true,
            fully_handled_once: true,
        },
        &script,
    )
    .await;
    assert_eq!(plan.cause, Cause::Noop);
    assert!(plan.desired.is_none());

    let mut changed = created.clone();
    changed["spec"]["size"] = json!(5);
    changed["metadata"]["annotations"]["capstan.dev/unrelated"] = json!("x");
    let plan = run(
        &changed,
        EventType::Modified,
        &handlers,
        Memory::default(),
        &script,
    )
    .await;
    assert_eq!(plan.cause, Cause::Update);
    assert_eq!(script.ids(), ["resume", "update"]);
    let Payload::Change { diff, .. } = &script.seen.lock()[1].payload else {
        panic!("not a change")
    };
    assert_eq!(diff.len(), 1);
    assert_eq!(diff[0].path, ["spec", "size"]);
}

#[tokio::test]
async fn field_handlers_get_the_field_only() {
    let mut field = reg("f/spec.size", HandlerKind::Field);
    field.filters.field = vec!["spec".into(), "size".into()];
    let script = Script::default();
    let created = run(
        &body(),
        EventType::Added,
        std::slice::from_ref(&field),
        Memory::default(),
        &script,
    )
    .await
    .desired
    .unwrap();
    assert_eq!(
        script.ids(),
        ["f/spec.size"],
        "field handlers fire on creation too"
    );
    let mut changed = created.clone();
    changed["spec"]["size"] = json!(3);
    run(
        &changed,
        EventType::Modified,
        std::slice::from_ref(&field),
        Memory::default(),
        &script,
    )
    .await;
    let Payload::Change {
        old, new, field: f, ..
    } = &script.seen.lock()[1].payload
    else {
        panic!("not a change")
    };
    assert_eq!(
        (old.clone(), new.clone(), f.as_str()),
        (Some(json!(1)), Some(json!(3)), "spec.size")
    );
}

#[tokio::test]
async fn retries_run_out_into_a_permanent_failure_that_completes_the_cause() {
    let mut flaky = reg("flaky", HandlerKind::Create);
    flaky.retries = Some(1);
    let script = Script::new(vec![Outcome::Unclassified {
        diagnostics: vec![Diagnostic::error("E", "boom")],
        subhandlers: vec![],
    }]);
    let plan = run(&body(), EventType::Added, &[flaky], Memory::default(), &script).await;
    assert!(plan.done, "a final failure completes the cause");
    assert!(
        annotations(plan.desired.as_ref().unwrap())
            .contains(&"capstan.dev/last-handled-configuration".to_owned())
    );
}

/// The progress record stored under `key` in `body`'s annotations.
fn record_at(body: &Value, key: &str) -> ProgressRecord {
    serde_json::from_str(body["metadata"]["annotations"][key].as_str().unwrap()).unwrap()
}

/// `body` with the record under `key` due now (its delay passed), as when it is next processed.
fn due_now(body: &Value, key: &str) -> Value {
    let mut record = record_at(body, key);
    record.delayed = None;
    let mut later = body.clone();
    later["metadata"]["annotations"][key] = json!(serde_json::to_string(&record).unwrap());
    later
}

/// A parent's success that reports its sub-handlers' outcomes.
fn parent_reporting(subhandlers: Vec<(&str, Outcome)>) -> Outcome {
    Outcome::Success {
        result: None,
        kind_result: None,
        patches: vec![],
        subhandlers: subhandlers
            .into_iter()
            .map(|(id, outcome)| SubhandlerOutcome {
                id: id.into(),
                outcome,
            })
            .collect(),
    }
}

#[tokio::test]
async fn sub_handlers_keep_the_parent_open_until_they_finish() {
    let handlers = [reg("parent", HandlerKind::Create)];
    let script = Script::new(vec![Outcome::Success {
        result: None,
        kind_result: None,
        patches: vec![],
        subhandlers: vec![
            SubhandlerOutcome {
                id: "a".into(),
                outcome: Outcome::success(Some(json!(1))),
            },
            SubhandlerOutcome {
                id: "b".into(),
                outcome: Outcome::Temporary {
                    delay: Some(Duration::from_secs(1)),
                    diagnostics: vec![],
                    subhandlers: vec![],
                },
            },
        ],
    }]);
    let plan = run(&body(), EventType::Added, &handlers, Memory::default(), &script).await;
    assert!(!plan.done);
    let desired = plan.desired.unwrap();
    let ann = &desired["metadata"]["annotations"];
    let parent: ProgressRecord = serde_json::from_str(ann["capstan.dev/parent"].as_str().unwrap()).unwrap();
    assert_eq!(parent.subrefs, ["parent/a", "parent/b"]);
    assert!(!parent.finished());
    let b: ProgressRecord = serde_json::from_str(ann["capstan.dev/parent.b"].as_str().unwrap()).unwrap();
    assert_eq!(b.retries, 1);
    assert_eq!(desired["status"]["parent/a"], json!(1));

    // Next time the parent gets its children's states, and finishing them finishes it.
    let later = due_now(&due_now(&desired, "capstan.dev/parent.b"), "capstan.dev/parent");
    let script = Script::new(vec![parent_reporting(vec![("b", Outcome::success(None))])]);
    let plan = run(&later, EventType::Modified, &handlers, Memory::default(), &script).await;
    let states = &script.seen.lock()[0].subhandlers;
    assert_eq!(
        states
            .iter()
            .map(|s| (s.id.as_str(), s.success))
            .collect::<Vec<_>>(),
        [("a", true), ("b", false)]
    );
    assert!(plan.done);
    let keys = annotations(plan.desired.as_ref().unwrap());
    assert!(
        !keys.iter().any(|k| k.starts_with("capstan.dev/parent")),
        "{keys:?}"
    );
}

#[tokio::test]
async fn a_deferred_sub_handler_keeps_its_parent_due_at_once_and_a_waiting_one_keeps_it_waiting() {
    let handlers = [reg("parent", HandlerKind::Create)];
    let script = Script::new(vec![Outcome::Success {
        result: None,
        kind_result: None,
        patches: vec![],
        subhandlers: vec![
            SubhandlerOutcome {
                id: "a".into(),
                outcome: Outcome::success(None),
            },
            SubhandlerOutcome {
                id: "slow".into(),
                outcome: Outcome::Temporary {
                    delay: Some(Duration::from_secs(600)),
                    diagnostics: vec![],
                    subhandlers: vec![],
                },
            },
            SubhandlerOutcome {
                id: "b".into(),
                outcome: Outcome::Skipped,
            },
        ],
    }]);
    let plan = run(&body(), EventType::Added, &handlers, Memory::default(), &script).await;
    assert!(!plan.done, "the deferred sub-handler has not run");
    let desired = plan.desired.unwrap();
    let ann = &desired["metadata"]["annotations"];
    let parent: ProgressRecord = serde_json::from_str(ann["capstan.dev/parent"].as_str().unwrap()).unwrap();
    assert_eq!(parent.subrefs, ["parent/a", "parent/b", "parent/slow"]);
    assert!(!parent.finished());
    // Due at once for the deferred one, not after the other's 600 s.
    let due = parent.delayed_until().expect("the parent is delayed");
    assert!(
        due <= std::time::SystemTime::now() + Duration::from_secs(5),
        "the parent waits for the delayed sub-handler: {parent:?}"
    );
    let b: ProgressRecord = serde_json::from_str(ann["capstan.dev/parent.b"].as_str().unwrap()).unwrap();
    assert_eq!((b.retries, b.finished()), (0, false), "{b:?}");

    // The next call runs only the deferred one: the parent is then due when the one still
    // waiting is, not at once (it would be called again and again for nothing).
    let later = due_now(&desired, "capstan.dev/parent");
    let script = Script::new(vec![parent_reporting(vec![("b", Outcome::success(None))])]);
    let plan = run(&later, EventType::Modified, &handlers, Memory::default(), &script).await;
    assert!(!plan.done);
    let parent = record_at(&plan.desired.unwrap(), "capstan.dev/parent");
    let due = parent.delayed_until().expect("the parent is delayed");
    assert!(
        due >= std::time::SystemTime::now() + Duration::from_secs(500),
        "the parent is due before its waiting sub-handler: {parent:?}"
    );
}

#[tokio::test]
async fn a_sub_handler_no_longer_run_nor_waiting_keeps_its_parent_open_no_more() {
    let handlers = [reg("parent", HandlerKind::Create)];
    let script = Script::new(vec![parent_reporting(vec![("b", Outcome::Skipped)])]);
    let plan = run(&body(), EventType::Added, &handlers, Memory::default(), &script).await;
    assert!(!plan.done, "the deferred sub-handler keeps the parent open");
    let later = due_now(&plan.desired.unwrap(), "capstan.dev/parent");
    // The next call reports nothing of `b` (its filter no longer matches): the parent is done,
    // as kopf no longer counts a handler that does not match.
    let script = Script::new(vec![success(None, vec![])]);
    let plan = run(&later, EventType::Modified, &handlers, Memory::default(), &script).await;
    assert!(
        plan.done,
        "the parent waits for a sub-handler that is not run any more"
    );
}

#[tokio::test]
async fn a_rejected_patch_becomes_a_failed_attempt_and_keeps_the_rest() {
    let handlers = [
        reg("patcher", HandlerKind::Create),
        reg("quiet", HandlerKind::Create),
    ];
    let script = Script::new(vec![
        success(None, vec![merge(json!({"spec": {"size": "not a number"}}))]),
        success(None, vec![]),
    ]);
    let plan = run(&body(), EventType::Added, &handlers, Memory::default(), &script).await;
    assert_eq!(plan.patched.len(), 1);
    let storage = Storage::annotations("capstan.dev");
    let mut fallback = plan.fallback.clone().unwrap();
    reject(
        &plan.patched[0],
        &storage,
        "spec.size: Invalid value",
        &mut fallback,
    );
    assert_eq!(fallback["spec"]["size"], 1, "the handler's patch is dropped");
    let ann = &fallback["metadata"]["annotations"];
    let patcher: ProgressRecord = serde_json::from_str(ann["capstan.dev/patcher"].as_str().unwrap()).unwrap();
    assert!(patcher.message.unwrap().contains("spec.size: Invalid value"));
    assert_eq!(patcher.retries, 1);
    let quiet: ProgressRecord = serde_json::from_str(ann["capstan.dev/quiet"].as_str().unwrap()).unwrap();
    assert!(quiet.success, "the other handler's progress is kept");

    let mut accepted = plan.fallback.clone().unwrap();
    accept(&plan.patched[0], &storage, &mut accepted);
    assert_eq!(accepted["spec"]["size"], "not a number");
}

#[tokio::test]
async fn objects_being_deleted_without_our_finalizer_are_free() {
    let mut b = body();
    b["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    let script = Script::default();
    let plan = run(
        &b,
        EventType::Modified,
        &[reg("d", HandlerKind::Delete)],
        Memory::default(),
        &script,
    )
    .await;
    assert_eq!(plan.cause, Cause::Free);
    assert!(script.ids().is_empty());
    let plan = run(
        &b,
        EventType::Deleted,
        &[reg("d", HandlerKind::Delete)],
        Memory::default(),
        &script,
    )
    .await;
    assert_eq!(plan.cause, Cause::Gone);
}

/// Answers every invocation with success after a delay.
struct Slow(Duration);

impl Invoker for Slow {
    fn invoke(&self, _work: Work, _control: Control) -> BoxFuture<'static, Outcome> {
        let delay = self.0;
        Box::pin(async move {
            tokio::time::sleep(delay).await;
            Outcome::success(None)
        })
    }
}

/// Keeps what it is asked to write and stores it as it is.
#[derive(Default)]
struct Saved(Mutex<Vec<Value>>);

impl Checkpoint for Saved {
    fn save<'a>(&'a self, _base: &'a Value, desired: &'a Value) -> BoxFuture<'a, Option<Value>> {
        self.0.lock().push(desired.clone());
        Box::pin(async move { Some(desired.clone()) })
    }
}

/// Stores what it is asked to write together with others' edits made meanwhile: a user's
/// change of the spec, another controller's status and finalizer, a new resourceVersion.
#[derive(Default)]
struct EditedMeanwhile;

impl Checkpoint for EditedMeanwhile {
    fn save<'a>(&'a self, _base: &'a Value, desired: &'a Value) -> BoxFuture<'a, Option<Value>> {
        let mut stored = desired.clone();
        stored["spec"]["size"] = json!(7);
        stored["spec"]["added"] = json!("by the user");
        stored["status"] = json!({"other": "controller"});
        stored["metadata"]["finalizers"] = json!(["other.example/keep"]);
        stored["metadata"]["resourceVersion"] = json!("11");
        Box::pin(async move { Some(stored) })
    }
}

/// A cycle of one handler `slow` with a timeout (whose start a checkpoint keeps).
async fn run_with_checkpoint(invoker: &dyn Invoker, saved: &dyn Checkpoint) -> Plan {
    run_with_checkpoint_of(invoker, saved, Some(Duration::from_secs(600))).await
}

/// A cycle of one handler `slow` with `timeout`.
async fn run_with_checkpoint_of(
    invoker: &dyn Invoker,
    saved: &dyn Checkpoint,
    timeout: Option<Duration>,
) -> Plan {
    // The whole essence, to show which spec the diff-base comes from.
    let storage = Storage {
        diffbase_extent: Extent::Full,
        ..Storage::annotations("capstan.dev")
    };
    let cancel = CancellationToken::new();
    let mut slow = reg("slow", HandlerKind::Create);
    slow.timeout = timeout;
    let handlers = [slow];
    cycle(
        Input {
            body: &body(),
            event: EventType::Added,
            resource: &resource(),
            handlers: &handlers,
            memory: Memory::default(),
            storage: &storage,
            cancel: &cancel,
            checkpoint: Some(saved),
            checkpoint_after: Duration::from_secs(1),
            daemons_alive: false,
            max_losses: 3,
            registered: None,
        },
        invoker,
    )
    .await
}

#[tokio::test(start_paused = true)]
async fn a_handler_running_past_the_checkpoint_time_has_its_start_written() {
    let saved = Saved::default();
    let plan = run_with_checkpoint(&Slow(Duration::from_secs(5)), &saved).await;
    let writes = saved.0.lock().clone();
    assert_eq!(writes.len(), 1, "one checkpoint: {writes:?}");
    let record: ProgressRecord = serde_json::from_str(
        writes[0]
            .pointer("/metadata/annotations/capstan.dev~1slow")
            .and_then(Value::as_str)
            .unwrap_or("{}"),
    )
    .unwrap();
    assert!(
        record.started.is_some() && !record.finished() && record.retries == 0,
        "{record:?}"
    );
    assert!(plan.done, "the cycle still completes");
}

/// The start of a handler matters only for its timeout: a lone handler without one writes no
/// checkpoint however long it runs — one write per change.
#[tokio::test(start_paused = true)]
async fn a_lone_handler_without_a_timeout_running_past_the_checkpoint_time_costs_no_checkpoint() {
    let saved = Saved::default();
    let plan = run_with_checkpoint_of(&Slow(Duration::from_secs(5)), &saved, None).await;
    assert!(saved.0.lock().is_empty(), "{:?}", saved.0.lock());
    assert!(plan.done);
}

#[tokio::test(start_paused = true)]
async fn a_handler_answering_within_the_checkpoint_time_costs_no_checkpoint() {
    let saved = Saved::default();
    let plan = run_with_checkpoint(&Slow(Duration::from_millis(500)), &saved).await;
    assert!(saved.0.lock().is_empty());
    assert!(plan.done);
}

#[tokio::test(start_paused = true)]
async fn the_write_after_a_checkpoint_keeps_what_others_wrote_meanwhile() {
    let plan = run_with_checkpoint(&Slow(Duration::from_secs(5)), &EditedMeanwhile).await;
    assert!(plan.done);
    let desired = plan.desired.clone().unwrap_or_default();
    let patch = merge_diff(&plan.base, &desired).unwrap_or_default();
    assert!(
        patch.get("spec").is_none(),
        "the user's spec edit is not reverted: {patch}"
    );
    assert!(
        patch.get("status").is_none(),
        "others' status is not reverted: {patch}"
    );
    assert!(
        patch.pointer("/metadata/finalizers").is_none(),
        "others' finalizer is not reverted: {patch}"
    );
    assert_eq!(plan.base["metadata"]["resourceVersion"], "11");
    // The checkpoint's progress record goes, and the diff-base is what the handler saw, so
    // that the user's edit is a change for the next cycle.
    assert_eq!(
        patch.pointer("/metadata/annotations/capstan.dev~1slow"),
        Some(&Value::Null),
        "{patch}"
    );
    let diffbase = patch
        .pointer("/metadata/annotations/capstan.dev~1last-handled-configuration")
        .and_then(Value::as_str)
        .unwrap_or_default();
    assert!(diffbase.contains(r#""size":1"#), "{diffbase}");
}

/// Waits, as the hub does for a handler that no connected process owns, until cancelled.
struct Unowned;

impl Invoker for Unowned {
    fn invoke(&self, _work: Work, control: Control) -> BoxFuture<'static, Outcome> {
        Box::pin(async move {
            control.cancel.cancelled().await;
            Outcome::Cancelled
        })
    }
}

/// Runs a create cycle of `handlers` with an [`Unowned`] invoker, while the registered
/// handlers become `remaining` 50 ms after it starts (their process left).
async fn run_withdrawing(handlers: Vec<Registration>, remaining: Vec<Registration>) -> Plan {
    let storage = Storage::annotations("capstan.dev");
    let cancel = CancellationToken::new();
    let (registered, rx) = tokio::sync::watch::channel(std::sync::Arc::new(handlers.clone()));
    let withdraw = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        registered.send_replace(std::sync::Arc::new(remaining));
        registered
    });
    let plan = cycle(
        Input {
            body: &body(),
            event: EventType::Added,
            resource: &resource(),
            handlers: &handlers,
            memory: Memory::default(),
            storage: &storage,
            cancel: &cancel,
            checkpoint: None,
            checkpoint_after: Duration::from_secs(1),
            daemons_alive: false,
            max_losses: 3,
            registered: Some(rx),
        },
        &Unowned,
    )
    .await;
    let _ = withdraw.await;
    plan
}

#[tokio::test]
async fn a_handler_withdrawn_while_the_cycle_waits_for_it_interrupts_the_cycle() {
    let handlers = vec![
        reg("left", HandlerKind::Create),
        reg("stays", HandlerKind::Create),
    ];
    let plan = tokio::time::timeout(
        Duration::from_secs(10),
        run_withdrawing(handlers, vec![reg("stays", HandlerKind::Create)]),
    )
    .await
    .expect("the cycle does not wait for a process that left");
    assert!(
        !plan.done,
        "the cause is not done without the withdrawn handler's verdict"
    );
    assert!(
        plan.interrupted,
        "the cycle runs again with the handlers registered then"
    );
}

#[tokio::test]
async fn after_an_interruption_handlers_without_a_record_get_none() {
    let mut handlers = vec![reg("left", HandlerKind::Create)];
    handlers.extend((0..50).map(|i| reg(&format!("later_{i}"), HandlerKind::Create)));
    let plan = run_withdrawing(handlers, Vec::new()).await;
    let desired = plan.desired.clone().unwrap_or_default();
    let annotations = desired
        .pointer("/metadata/annotations")
        .and_then(Value::as_object)
        .map(|a| a.keys().filter(|k| k.contains("later_")).count())
        .unwrap_or_default();
    assert_eq!(annotations, 0, "{desired}");
}
