//! Change, event and admission handlers through the test kit: results, patches, errors and
//! filters.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use capstan_sdk::{
    Context, ErrorsMode, EventType, HandlerError, HandlerResult, LogLevel, Operation, Presence, Registry,
    testing::{InvocationBuilder, OutcomeKind, PatchKind, PatchTarget, TestKit},
};
use serde_json::{Value, json};

fn example(name: &str, spec: Value) -> Value {
    json!({
        "apiVersion": "demo.capstan.dev/v1",
        "kind": "Example",
        "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
        "spec": spec,
    })
}

async fn create_fn(ctx: Context) -> HandlerResult {
    ctx.info(format!("creating {}", ctx.name()));
    ctx.patch()
        .label("demo.capstan.dev/handled", "yes")
        .status("phase", "Ready");
    Ok(Some(json!({"message": format!("hello {}", ctx.name())})))
}

async fn flaky_fn(ctx: Context) -> HandlerResult {
    let fail_times = ctx.spec()["fail_times"].as_u64().unwrap_or(0);
    if u64::from(ctx.retry()) < fail_times {
        ctx.patch().label("discarded", "yes");
        return Err(HandlerError::temporary("not yet", Duration::from_secs(1)));
    }
    Ok(Some(json!({"attempts": ctx.retry() + 1})))
}

#[tokio::test]
async fn create_returns_result_and_patch() {
    let mut registry = Registry::new();
    registry.on_create("examples.demo.capstan.dev", "create_fn", create_fn);
    registry.on_update("examples.demo.capstan.dev", "update_fn", |_ctx: Context| async {
        Ok::<_, HandlerError>(json!({"message": "updated"}))
    });
    let kit = TestKit::new(registry);

    let outcomes = kit.create(example("one", json!({"field": "a"}))).await;
    assert_eq!(outcomes.handler_ids(), vec!["create_fn"]);
    let outcome = outcomes.get("create_fn").unwrap();
    assert_eq!(outcome.kind(), OutcomeKind::Success);
    assert_eq!(outcome.value(), Some(json!({"message": "hello one"})));
    let patches = outcome.patches();
    assert_eq!(patches.len(), 2);
    assert!(patches.iter().all(|p| p.kind == PatchKind::Merge));
    assert_eq!(patches[1].target, PatchTarget::Status);
    let body = outcomes.patched_body();
    assert_eq!(body["metadata"]["labels"]["demo.capstan.dev/handled"], "yes");
    assert_eq!(body["status"]["phase"], "Ready");
    assert_eq!(body["status"]["create_fn"]["message"], "hello one");
    assert_eq!(outcome.logs()[0].message, "creating one");
    assert_eq!(outcome.logs()[0].level, LogLevel::Info);

    let updated = kit
        .update(
            example("one", json!({"field": "a"})),
            example("one", json!({"field": "b"})),
        )
        .await;
    assert_eq!(
        updated.get("update_fn").unwrap().value(),
        Some(json!({"message": "updated"}))
    );
}

#[tokio::test(start_paused = true)]
async fn temporary_errors_are_retried_with_their_delay() {
    let mut registry = Registry::new();
    registry.on_create("cex", "flaky_fn", flaky_fn);
    let kit = TestKit::new(registry);
    let body = example("flaky", json!({"fail_times": 2}));

    let first = kit
        .invoke("flaky_fn", InvocationBuilder::create(body.clone()))
        .await;
    assert_eq!(
        first.kind(),
        OutcomeKind::TemporaryError {
            retry_after: Some(Duration::from_secs(1))
        }
    );
    assert_eq!(first.message().as_deref(), Some("not yet"));
    assert_eq!(
        first.patched_body(),
        body,
        "patches of a failed attempt are discarded"
    );

    let started = tokio::time::Instant::now();
    let attempts = kit
        .retry_until_done("flaky_fn", InvocationBuilder::create(body), 10)
        .await;
    assert_eq!(attempts.len(), 3);
    assert_eq!(
        attempts.iter().map(|a| a.attempt()).collect::<Vec<_>>(),
        vec![1, 2, 3]
    );
    assert_eq!(attempts[2].value(), Some(json!({"attempts": 3})));
    assert_eq!(started.elapsed(), Duration::from_secs(2));
}

#[tokio::test]
async fn permanent_and_unclassified_errors() {
    let mut registry = Registry::new();
    registry.on_create("cex", "permanent", |_ctx: Context| async {
        Err::<(), _>(HandlerError::permanent("broken spec"))
    });
    registry
        .on_create("cex", "unclassified", |_ctx: Context| async {
            let number: i64 = "not a number".parse()?;
            Ok::<_, HandlerError>(json!(number))
        })
        .errors(ErrorsMode::Ignored);
    registry.on_create("cex", "anyhow", |_ctx: Context| async {
        Err::<(), _>(anyhow::anyhow!("outer").context("while creating"))
    });
    registry.on_create("cex", "panics", |ctx: Context| async move {
        if ctx.name() == "one" {
            panic!("boom");
        }
    });
    let kit = TestKit::new(registry);
    let outcomes = kit.create(example("one", json!({}))).await;
    assert_eq!(outcomes.len(), 4);
    let permanent = outcomes.get("permanent").unwrap();
    assert_eq!(permanent.kind(), OutcomeKind::PermanentError);
    assert_eq!(permanent.message().as_deref(), Some("broken spec"));
    let unclassified = outcomes.get("unclassified").unwrap();
    assert_eq!(unclassified.kind(), OutcomeKind::UnclassifiedError);
    assert!(unclassified.message().unwrap().contains("invalid digit"));
    assert!(unclassified.diagnostics()[0].error_type.contains("ParseIntError"));
    assert_eq!(
        outcomes.get("anyhow").unwrap().message().as_deref(),
        Some("while creating: outer")
    );
    let panicked = outcomes.get("panics").unwrap();
    assert_eq!(panicked.kind(), OutcomeKind::UnclassifiedError);
    assert!(panicked.message().unwrap().contains("boom"));
}

#[tokio::test]
async fn when_filter_skips() {
    let mut registry = Registry::new();
    registry
        .on_create("cex", "only_big", |_ctx: Context| async {
            Ok::<_, HandlerError>(json!("ran"))
        })
        .when(|ctx: &Context| ctx.spec()["size"].as_i64().unwrap_or(0) > 10);
    let kit = TestKit::new(registry);
    let small = kit.create(example("small", json!({"size": 1}))).await;
    assert_eq!(small.get("only_big").unwrap().kind(), OutcomeKind::Skipped);
    let big = kit.create(example("big", json!({"size": 11}))).await;
    assert_eq!(big.get("only_big").unwrap().value(), Some(json!("ran")));
}

#[tokio::test]
async fn declarative_filters_are_registered_and_evaluated() {
    let mut registry = Registry::new();
    registry
        .on_create("cex", "labelled", |_ctx: Context| async {})
        .label("app", "db")
        .annotation("skip", Presence::Absent)
        .field("spec.size")
        .value(Presence::Present)
        .param(json!({"tier": 1}))
        .retries(3)
        .backoff(Duration::from_secs(7))
        .timeout(Duration::from_secs(60));
    registry
        .on_delete("cex", "cleanup", |_ctx: Context| async {})
        .optional(true);
    registry
        .on_resume("cex", "resume", |_ctx: Context| async {})
        .deleted(true);
    registry
        .daemon("cex", "monitor", |_ctx: Context| async {})
        .initial_delay(Duration::from_secs(1))
        .cancellation_timeout(Duration::from_secs(5));
    registry
        .timer("cex", "tick", |_ctx: Context| async {})
        .interval(Duration::from_secs(10))
        .idle(Duration::from_secs(3));
    registry
        .on_validate("cex", "validate", |_ctx: Context| async {})
        .operations([Operation::Create, Operation::Update]);
    registry.on_startup("startup", |_ctx: Context| async {});
    registry.on_probe("probe", |_ctx: Context| async {
        Ok::<_, HandlerError>(json!(42))
    });
    let kit = TestKit::new(registry);

    // What lands in the wire registrations is checked by the registry's unit tests.
    assert_eq!(
        kit.handler_ids(),
        vec![
            "labelled", "cleanup", "resume", "monitor", "tick", "validate", "startup", "probe"
        ]
    );

    let ok = example("a", json!({"size": 1}));
    let mut labelled_body = ok.clone();
    labelled_body["metadata"]["labels"] = json!({"app": "db"});
    assert!(kit.create(ok).await.get("labelled").is_none(), "label missing");
    assert!(kit.create(labelled_body.clone()).await.get("labelled").is_some());
    let mut skipped = labelled_body.clone();
    skipped["metadata"]["annotations"] = json!({"skip": "1"});
    assert!(kit.create(skipped).await.is_empty());
    let mut no_size = labelled_body;
    no_size["spec"] = json!({});
    assert!(kit.create(no_size).await.is_empty());

    let probe = kit.invoke("probe", InvocationBuilder::probe()).await;
    assert_eq!(probe.value(), Some(json!(42)));
}

#[tokio::test]
async fn field_handlers_see_the_field_change() {
    let mut registry = Registry::new();
    registry.on_field("cex", "spec.field", "field_fn", |ctx: Context| async move {
        ctx.info(format!("{:?} -> {:?}", ctx.old(), ctx.new()));
        Ok::<_, HandlerError>(json!({"field": ctx.field(), "diff": ctx.diff().len()}))
    });
    let kit = TestKit::new(registry);
    assert_eq!(kit.handler_ids(), vec!["field_fn/spec.field"]);

    let old = example("f", json!({"field": "a", "other": 1}));
    let new = example("f", json!({"field": "b", "other": 2}));
    let outcomes = kit.update(old.clone(), new.clone()).await;
    let outcome = outcomes.get("field_fn/spec.field").unwrap();
    assert_eq!(
        outcome.logs()[0].message,
        r#"Some(String("a")) -> Some(String("b"))"#
    );
    assert_eq!(outcome.value(), Some(json!({"field": "spec.field", "diff": 1})));

    let unchanged = kit
        .update(old.clone(), example("f", json!({"field": "a", "other": 3})))
        .await;
    assert!(unchanged.is_empty());
    let created = kit.create(new.clone()).await;
    assert_eq!(created.handler_ids(), vec!["field_fn/spec.field"]);
    let direct = kit.field("spec.field", old, new).await;
    assert_eq!(direct.len(), 1);
}

#[tokio::test]
async fn event_handlers_get_the_event_type() {
    let mut registry = Registry::new();
    registry.on_event("cex", "event_fn", |ctx: Context| async move {
        ctx.debug(format!("{:?}", ctx.event_type()));
        Ok::<_, HandlerError>(json!(ctx.event_type().and_then(|t| t.as_k8s_str())))
    });
    let kit = TestKit::new(registry);
    let outcomes = kit.event(EventType::Modified, example("e", json!({}))).await;
    let outcome = outcomes.get("event_fn").unwrap();
    assert_eq!(outcome.value(), Some(json!("MODIFIED")));
    assert_eq!(outcome.logs()[0].level, LogLevel::Debug);
    let listed = kit.event(EventType::Listed, example("e", json!({}))).await;
    assert_eq!(listed.get("event_fn").unwrap().value(), None);
}

#[tokio::test]
async fn admission_handlers_return_verdicts() {
    let mut registry = Registry::new();
    registry.on_validate("cex", "validate", |ctx: Context| async move {
        ctx.add_warning("checked");
        if ctx.spec()["size"].as_i64().unwrap_or(0) > 5 {
            return Err(HandlerError::deny("too big", 422));
        }
        Ok(())
    });
    registry.on_mutate("cex", "mutate", |ctx: Context| async move {
        ctx.patch()
            .json_op(json!({"op": "add", "path": "/spec/defaulted", "value": true}));
    });
    let kit = TestKit::new(registry);
    let denied = kit
        .invoke(
            "validate",
            InvocationBuilder::admission(Operation::Create, example("v", json!({"size": 9}))),
        )
        .await;
    let verdict = denied.verdict().unwrap();
    assert!(!verdict.allowed);
    assert_eq!((verdict.message.as_str(), verdict.code), ("too big", 422));
    assert_eq!(verdict.warnings, vec!["checked"]);
    let allowed = kit
        .invoke(
            "validate",
            InvocationBuilder::admission(Operation::Create, example("v", json!({"size": 1}))),
        )
        .await;
    assert!(allowed.verdict().unwrap().allowed);
    let mutated = kit
        .invoke(
            "mutate",
            InvocationBuilder::admission(Operation::Create, example("m", json!({}))),
        )
        .await;
    assert_eq!(mutated.patched_body()["spec"]["defaulted"], true);
}

#[tokio::test]
async fn unknown_handlers_fail_permanently() {
    let kit = TestKit::new(Registry::new());
    let outcome = kit
        .invoke("missing", InvocationBuilder::create(example("x", json!({}))))
        .await;
    assert_eq!(outcome.kind(), OutcomeKind::PermanentError);
}

#[test]
fn invalid_registries_are_reported() {
    let mut registry = Registry::new();
    registry
        .on_create("cex", "a", |_ctx: Context| async {})
        .sharp(true);
    assert!(TestKit::try_new(registry).is_err());
}
