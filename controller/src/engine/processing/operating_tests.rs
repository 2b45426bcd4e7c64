//! Processing cycles and what operating Capstan adds to them: retry requests consumed in the
//! cycle's own write, and status conditions.

use std::time::Duration;

use parking_lot::Mutex;
use serde_json::{Value, json};

use super::{tests::resource, *};
use crate::model::Diagnostic;

/// Answers every invocation with `answer` and records the handler ids.
struct Always {
    answer: Outcome,
    seen: Mutex<Vec<String>>,
}

impl Always {
    fn new(answer: Outcome) -> Self {
        Self {
            answer,
            seen: Mutex::new(Vec::new()),
        }
    }
}

impl Invoker for Always {
    fn invoke(&self, work: Work, _control: Control) -> BoxFuture<'static, Outcome> {
        self.seen.lock().push(work.handler_id.0.clone());
        let answer = self.answer.clone();
        Box::pin(async move { answer })
    }
}

fn handlers() -> Vec<Registration> {
    ["create_a", "create_b"]
        .iter()
        .map(|id| {
            let mut r = Registration::new(*id, HandlerKind::Create, None);
            r.resource = Some(resource());
            r
        })
        .collect()
}

fn body(annotations: Value) -> Value {
    json!({"apiVersion": "demo.capstan.dev/v1", "kind": "Example",
           "metadata": {"name": "one", "namespace": "default", "uid": "u1", "resourceVersion": "10",
                        "generation": 4, "annotations": annotations},
           "spec": {"size": 1}})
}

async fn run(body: &Value, storage: &Storage, invoker: &Always) -> Plan {
    run_on(body, storage, invoker, &resource(), &handlers()).await
}

async fn run_on(
    body: &Value,
    storage: &Storage,
    invoker: &Always,
    resource: &ResolvedResource,
    handlers: &[Registration],
) -> Plan {
    let cancel = CancellationToken::new();
    cycle(
        Input {
            body,
            event: EventType::Modified,
            resource,
            handlers,
            memory: Memory::default(),
            storage,
            cancel: &cancel,
            checkpoint: None,
            checkpoint_after: Duration::from_secs(1),
            daemons_alive: false,
            max_losses: 3,
            registered: None,
        },
        invoker,
    )
    .await
}

fn permanent() -> Outcome {
    Outcome::Permanent {
        diagnostics: vec![Diagnostic::error("HANDLER_FAILED", "still broken")],
        subhandlers: Vec::new(),
    }
}

/// create_a failed for good, create_b waits an hour for its retry.
fn stuck(request: Option<&str>) -> Value {
    let mut annotations = json!({
        "capstan.dev/kopf-managed": "yes",
        "capstan.dev/create_a": r#"{"started":"2026-12-01T10:00:00.000000+00:00","stopped":"2026-12-01T10:00:01.000000+00:00","purpose":"create","retries":1,"success":false,"failure":true,"message":"broken"}"#,
        "capstan.dev/create_b": format!(
            r#"{{"started":"2026-12-01T10:00:00.000000+00:00","delayed":"{}","purpose":"create","retries":1,"success":false,"failure":false}}"#,
            time::format(SystemTime::now() + Duration::from_secs(3600))
        ),
    });
    if let Some(r) = request {
        annotations["capstan.dev/retry-request"] = json!(r);
    }
    body(annotations)
}

fn annotation<'a>(plan: &'a Plan, key: &str) -> Option<&'a Value> {
    plan.desired.as_ref()?.pointer("/metadata/annotations")?.get(key)
}

#[tokio::test]
async fn a_retry_request_reruns_a_permanently_failed_handler_once_and_leaves_in_the_same_write() {
    let storage = Storage::annotations("capstan.dev");
    let invoker = Always::new(permanent());
    let idle = run(&stuck(None), &storage, &invoker).await;
    assert!(invoker.seen.lock().is_empty(), "without a request nothing runs");
    assert!(idle.desired.is_none());

    let request = r#"{"handlers":["create_a"],"requestedBy":"alice"}"#;
    let plan = run(&stuck(Some(request)), &storage, &invoker).await;
    assert_eq!(*invoker.seen.lock(), ["create_a"], "create_b keeps waiting");
    assert!(
        annotation(&plan, "capstan.dev/retry-request").is_none(),
        "consumed"
    );
    let record: ProgressRecord = serde_json::from_str(
        annotation(&plan, "capstan.dev/create_a")
            .and_then(Value::as_str)
            .unwrap_or_default(),
    )
    .unwrap();
    assert!(
        record.failure && record.message.as_deref() == Some("still broken"),
        "{record:?}"
    );
    assert_eq!(plan.announcements.len(), 1);
    let (level, reason, message) = &plan.announcements[0];
    assert_eq!((*level, *reason), (Level::Info, "RetryRequested"));
    assert!(
        message.contains("'create_a'") && message.contains("alice"),
        "{message}"
    );
}

#[tokio::test]
async fn a_request_for_everything_wakes_the_delayed_handler_too() {
    let storage = Storage::annotations("capstan.dev");
    let invoker = Always::new(Outcome::success(None));
    let plan = run(&stuck(Some(r#"{"handlers":[]}"#)), &storage, &invoker).await;
    assert_eq!(*invoker.seen.lock(), ["create_a", "create_b"]);
    assert!(plan.done, "both succeeded");
    assert!(annotation(&plan, "capstan.dev/retry-request").is_none());
}

#[tokio::test]
async fn garbage_and_pointless_requests_are_removed_with_an_event() {
    let storage = Storage::annotations("capstan.dev");
    let invoker = Always::new(Outcome::success(None));
    let plan = run(&stuck(Some("please")), &storage, &invoker).await;
    assert!(invoker.seen.lock().is_empty());
    assert!(annotation(&plan, "capstan.dev/retry-request").is_none());
    assert!(plan.desired.is_some(), "the removal is written");
    assert_eq!(plan.announcements[0].0, Level::Warning);
    assert_eq!(plan.announcements[0].1, "RetryRequestIgnored");

    // A handled object: no records, nothing to retry.
    let handled = {
        let mut b = body(json!({}));
        let rules = rules(&storage, &handlers());
        let essence = rules.essence(&b);
        storage
            .diffbase
            .store(&crate::persistence::diffbase::DiffBase::Essence(essence), &mut b);
        b["metadata"]["annotations"]["capstan.dev/retry-request"] = json!(r#"{"requestedBy":"bob"}"#);
        b
    };
    let plan = run(&handled, &storage, &invoker).await;
    assert!(invoker.seen.lock().is_empty());
    assert!(annotation(&plan, "capstan.dev/retry-request").is_none());
    assert!(
        plan.announcements[0]
            .2
            .starts_with("Nothing to retry (requested by bob"),
        "{:?}",
        plan.announcements
    );
}

#[tokio::test]
async fn conditions_ride_in_the_cycle_write() {
    let mut storage = Storage::annotations("capstan.dev");
    for_all_custom_resources(&mut storage);
    let fresh = body(json!({}));
    let plan = run(&fresh, &storage, &Always::new(Outcome::success(None))).await;
    let desired = plan.desired.clone().unwrap_or_default();
    let conditions = desired["status"]["conditions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    let ready = conditions
        .iter()
        .find(|c| c["type"] == "Ready")
        .cloned()
        .unwrap_or_default();
    assert_eq!(ready["status"], "True", "{conditions:?}");
    assert_eq!(ready["observedGeneration"], 4);

    let plan = run(&stuck(None), &storage, &Always::new(Outcome::success(None))).await;
    let desired = plan.desired.clone().unwrap_or_default();
    let by = |kind: &str| {
        desired["status"]["conditions"]
            .as_array()
            .and_then(|c| c.iter().find(|c| c["type"] == kind).cloned())
            .unwrap_or_default()
    };
    assert_eq!(by("Degraded")["status"], "True");
    assert_eq!(by("Progressing")["reason"], "Retrying");
    assert_eq!(by("Ready")["reason"], "HandlerFailed");

    let mut off = storage.clone();
    off.conditions = crate::engine::conditions::Selection::Off;
    let plan = run(&fresh, &off, &Always::new(Outcome::success(None))).await;
    assert!(
        plan.desired
            .unwrap_or_default()
            .pointer("/status/conditions")
            .is_none()
    );
}

fn conditions_of(plan: &Plan) -> Vec<Value> {
    plan.desired
        .as_ref()
        .and_then(|d| d.pointer("/status/conditions"))
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default()
}

fn for_all_custom_resources(storage: &mut Storage) {
    storage.conditions = crate::engine::conditions::Selection::Custom;
}

#[tokio::test]
async fn conditions_stay_off_built_in_resources_unless_named() {
    let pods = ResolvedResource {
        group: String::new(),
        version: "v1".into(),
        plural: "pods".into(),
        kind: "Pod".into(),
        namespaced: true,
        status_subresource: true,
    };
    let handlers: Vec<Registration> = handlers()
        .into_iter()
        .map(|mut r| {
            r.resource = Some(pods.clone());
            r
        })
        .collect();
    let mut storage = Storage::annotations("capstan.dev");
    for_all_custom_resources(&mut storage);
    // kubelet's Ready is the pod's own: a bare --conditions never touches it.
    let mut pod = body(json!({}));
    pod["status"] =
        json!({"conditions": [{"type": "Ready", "status": "False", "reason": "ContainersNotReady"}]});
    let plan = run_on(
        &pod,
        &storage,
        &Always::new(Outcome::success(None)),
        &pods,
        &handlers,
    )
    .await;
    let conditions = conditions_of(&plan);
    assert_eq!(
        conditions,
        [json!({"type": "Ready", "status": "False", "reason": "ContainersNotReady"})],
        "untouched"
    );
    // Custom resources are covered by a bare --conditions.
    let plan = run(&body(json!({})), &storage, &Always::new(Outcome::success(None))).await;
    assert_eq!(conditions_of(&plan).len(), 3);
    // Named, a built-in resource gets them (the operator's author chose so).
    storage.conditions = crate::engine::conditions::Selection::from_flag(Some(&["pods".into()]));
    let plan = run_on(
        &pod,
        &storage,
        &Always::new(Outcome::success(None)),
        &pods,
        &handlers,
    )
    .await;
    assert_eq!(conditions_of(&plan).len(), 3);
}

#[tokio::test]
async fn a_noop_cycle_brings_observed_generation_up_to_date() {
    let mut storage = Storage::annotations("capstan.dev");
    for_all_custom_resources(&mut storage);
    // A handled object whose handler patched its spec in the same write: generation moved on.
    let first = run(&body(json!({})), &storage, &Always::new(Outcome::success(None))).await;
    let mut stored = first.desired.clone().unwrap_or_default();
    assert_eq!(conditions_of(&first)[0]["observedGeneration"], 4);
    stored["metadata"]["generation"] = json!(5);
    let invoker = Always::new(Outcome::success(None));
    let plan = run(&stored, &storage, &invoker).await;
    assert!(invoker.seen.lock().is_empty(), "nothing to handle");
    let conditions = conditions_of(&plan);
    assert_eq!(conditions.len(), 3, "{plan:?}");
    assert!(
        conditions.iter().all(|c| c["observedGeneration"] == 5),
        "{conditions:?}"
    );
    let ready = conditions
        .iter()
        .find(|c| c["type"] == "Ready")
        .cloned()
        .unwrap_or_default();
    assert_eq!(ready["status"], "True");
    // Up to date: nothing to write.
    let current = plan.desired.clone().unwrap_or_default();
    let plan = run(&current, &storage, &invoker).await;
    assert!(plan.desired.is_none(), "{:?}", plan.desired);
}

fn with_child(child: Outcome) -> Outcome {
    Outcome::Success {
        result: None,
        kind_result: None,
        patches: Vec::new(),
        subhandlers: vec![crate::model::SubhandlerOutcome {
            id: "child".into(),
            outcome: child,
        }],
    }
}

#[tokio::test]
async fn a_permanently_failed_sub_handler_degrades_the_object() {
    let mut storage = Storage::annotations("capstan.dev");
    for_all_custom_resources(&mut storage);
    let plan = run(&body(json!({})), &storage, &Always::new(with_child(permanent()))).await;
    let conditions = conditions_of(&plan);
    let by = |kind: &str| {
        conditions
            .iter()
            .find(|c| c["type"] == kind)
            .cloned()
            .unwrap_or_default()
    };
    assert_eq!(by("Degraded")["status"], "True", "{conditions:?}");
    assert_eq!(by("Ready")["status"], "False", "{conditions:?}");
    assert!(
        by("Degraded")["message"]
            .as_str()
            .is_some_and(|m| m.contains("create_a/child")),
        "{conditions:?}"
    );
}

#[tokio::test]
async fn a_retry_request_for_a_sub_handler_runs_its_parent_again() {
    let storage = Storage::annotations("capstan.dev");
    let mut stuck = stuck(Some(r#"{"handlers":["create_a/child"],"requestedBy":"alice"}"#));
    let annotations = &mut stuck["metadata"]["annotations"];
    annotations["capstan.dev/create_a"] = json!(
        r#"{"started":"2026-12-01T10:00:00.000000+00:00","stopped":"2026-12-01T10:00:01.000000+00:00","purpose":"create","retries":1,"success":true,"failure":false,"subrefs":["create_a/child"]}"#
    );
    annotations["capstan.dev/create_a.child"] = json!(
        r#"{"started":"2026-12-01T10:00:00.000000+00:00","stopped":"2026-12-01T10:00:01.000000+00:00","purpose":"create","retries":1,"success":false,"failure":true,"message":"broken"}"#
    );
    let invoker = Always::new(with_child(Outcome::success(None)));
    let plan = run(&stuck, &storage, &invoker).await;
    assert_eq!(
        *invoker.seen.lock(),
        ["create_a"],
        "the parent runs its child again"
    );
    let child: ProgressRecord = serde_json::from_str(
        annotation(&plan, "capstan.dev/create_a.child")
            .and_then(Value::as_str)
            .unwrap_or_default(),
    )
    .unwrap();
    assert!(child.success && !child.failure, "{child:?}");
    assert!(annotation(&plan, "capstan.dev/retry-request").is_none());
    assert!(
        plan.announcements[0].2.contains("'create_a/child'"),
        "{:?}",
        plan.announcements
    );
}

/// A handled object: the diff-base of its current essence, no records.
fn handled(request: Option<&str>) -> Value {
    let storage = Storage::annotations("capstan.dev");
    let mut b = body(json!({"capstan.dev/kopf-managed": "yes"}));
    let essence = rules(&storage, &handlers()).essence(&b);
    storage
        .diffbase
        .store(&crate::persistence::diffbase::DiffBase::Essence(essence), &mut b);
    if let Some(r) = request {
        b["metadata"]["annotations"]["capstan.dev/retry-request"] = json!(r);
    }
    b
}

#[tokio::test]
async fn a_named_handler_runs_again_after_its_change_was_completed() {
    let storage = Storage::annotations("capstan.dev");
    // create_a failed for good: the creation is complete, its records purged.
    let invoker = Always::new(permanent());
    let plan = run(
        &handled(Some(r#"{"handlers":["create_a"],"requestedBy":"alice"}"#)),
        &storage,
        &invoker,
    )
    .await;
    assert_eq!(*invoker.seen.lock(), ["create_a"], "create_a once, create_b not");
    assert!(plan.done, "failed for good again: the retry is complete");
    let desired = plan.desired.clone().unwrap_or_default();
    let annotations = desired["metadata"]["annotations"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    assert!(
        !annotations.contains_key("capstan.dev/retry-request"),
        "{annotations:?}"
    );
    assert!(
        !annotations.contains_key("capstan.dev/create_a"),
        "purged: {annotations:?}"
    );
    assert_eq!(
        annotations.get("capstan.dev/last-handled-configuration"),
        handled(None)["metadata"]["annotations"].get("capstan.dev/last-handled-configuration")
    );
    let (_, reason, message) = &plan.announcements[0];
    assert_eq!(*reason, "RetryRequested");
    assert!(
        message.contains("'create_a'") && message.contains("alice"),
        "{message}"
    );
    assert!(
        plan.notes
            .iter()
            .any(|n| n.message.contains("failed permanently")),
        "{:?}",
        plan.notes
    );

    // A temporary failure keeps its record; the next cycle of the unchanged object retries it.
    let invoker = Always::new(Outcome::Temporary {
        delay: Some(Duration::from_secs(0)),
        diagnostics: vec![Diagnostic::error("HANDLER_FAILED", "later")],
        subhandlers: Vec::new(),
    });
    let plan = run(&handled(Some(r#"{"handlers":["create_a"]}"#)), &storage, &invoker).await;
    assert!(!plan.done && plan.wake_at.is_some());
    let kept = plan.desired.clone().unwrap_or_default();
    assert!(
        kept.pointer("/metadata/annotations/capstan.dev~1create_a")
            .is_some(),
        "{kept}"
    );
    let invoker = Always::new(Outcome::success(None));
    let plan = run(&kept, &storage, &invoker).await;
    assert_eq!(*invoker.seen.lock(), ["create_a"]);
    assert!(plan.done);
    assert!(
        plan.desired
            .unwrap_or_default()
            .pointer("/metadata/annotations/capstan.dev~1create_a")
            .is_none(),
        "purged"
    );

    // A name no handler has: nothing runs, the Event lists the handlers.
    let invoker = Always::new(Outcome::success(None));
    let plan = run(&handled(Some(r#"{"handlers":["nope"]}"#)), &storage, &invoker).await;
    assert!(invoker.seen.lock().is_empty());
    assert!(
        plan.announcements[0].2.contains("create_a, create_b"),
        "{:?}",
        plan.announcements
    );
}

/// A late write (a checkpoint the API server applied after the cycle's final write) can put a
/// started record back on a handled object. Only a re-run that `capstan retry` started makes
/// a cycle with no change run a handler again; such a stale record never does.
#[tokio::test]
async fn a_stale_unfinished_record_on_a_handled_object_runs_nothing() {
    let storage = Storage::annotations("capstan.dev");
    let mut body = handled(None);
    body["metadata"]["annotations"]["capstan.dev/create_a"] = json!(
        r#"{"started":"2026-01-01T00:00:00.000000+00:00","purpose":"create","retries":0,"success":false,"failure":false}"#
    );
    let invoker = Always::new(permanent());
    let _plan = run(&body, &storage, &invoker).await;
    assert!(
        invoker.seen.lock().is_empty(),
        "a stale record ran {:?}",
        invoker.seen.lock()
    );
}
