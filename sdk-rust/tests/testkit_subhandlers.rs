//! Sub-handlers through the test kit: declared by the parent, run after it, reported with
//! their outcomes, and skipped once finished.

#![allow(clippy::unwrap_used)]

use std::time::{Duration, SystemTime};

use capstan_sdk::{
    Context, HandlerError, HandlerResult, Registry, SubhandlerOptions,
    testing::{InvocationBuilder, OutcomeKind, SubhandlerState, TestKit},
};
use serde_json::json;

async fn parent(ctx: Context) -> HandlerResult {
    ctx.patch().label("parent", "ran");
    for item in ctx.spec()["items"].as_array().cloned().unwrap_or_default() {
        let item = item.as_str().unwrap_or_default().to_owned();
        ctx.subhandler(item.clone(), move |child: Context| {
            let item = item.clone();
            async move {
                if item == "flaky" && child.retry() == 0 {
                    child.patch().label("flaky", "discarded");
                    return Err(HandlerError::temporary(
                        "flaky the first time",
                        Duration::from_secs(5),
                    ));
                }
                child.patch().label(&format!("done-{item}"), "yes");
                Ok(Some(json!({"item": item, "id": child.handler_id()})))
            }
        });
    }
    Ok(None)
}

fn body() -> serde_json::Value {
    json!({"apiVersion": "demo.capstan.dev/v1", "kind": "Example",
        "metadata": {"name": "p", "uid": "u"}, "spec": {"items": ["good", "flaky"]}})
}

#[tokio::test]
async fn children_run_and_only_unfinished_ones_run_again() {
    let mut registry = Registry::new();
    registry.on_create("cex", "parent", parent);
    let kit = TestKit::new(registry);

    let first = kit.invoke("parent", InvocationBuilder::create(body())).await;
    assert!(first.is_success());
    assert_eq!(
        first.subhandlers(),
        vec![
            ("good".to_owned(), OutcomeKind::Success),
            (
                "flaky".to_owned(),
                OutcomeKind::TemporaryError {
                    retry_after: Some(Duration::from_secs(5))
                }
            ),
        ]
    );
    let patched = first.patched_body();
    assert_eq!(patched["metadata"]["labels"]["parent"], "ran");
    assert_eq!(patched["metadata"]["labels"]["done-good"], "yes");
    assert!(
        patched["metadata"]["labels"].get("flaky").is_none(),
        "a failed child's patch is dropped"
    );
    assert_eq!(patched["status"]["parent/good"]["id"], "parent/good");

    let second = kit
        .invoke("parent", InvocationBuilder::create(body()).after(&first))
        .await;
    assert_eq!(second.attempt(), 2);
    assert_eq!(
        second.subhandlers(),
        vec![("flaky".to_owned(), OutcomeKind::Success)]
    );
    assert_eq!(second.patched_body()["metadata"]["labels"]["done-flaky"], "yes");
}

#[tokio::test]
async fn delayed_and_failed_children_are_skipped() {
    let mut registry = Registry::new();
    registry.on_create("cex", "parent", parent);
    let kit = TestKit::new(registry);
    let later = SystemTime::now() + Duration::from_secs(3600);
    let invocation = InvocationBuilder::create(body())
        .subhandler_state(SubhandlerState {
            id: "good".to_owned(),
            failure: true,
            ..SubhandlerState::default()
        })
        .subhandler_state(SubhandlerState {
            id: "flaky".to_owned(),
            retries: 1,
            delayed_until: Some(later),
            ..SubhandlerState::default()
        });
    let outcome = kit.invoke("parent", invocation).await;
    assert!(outcome.is_success());
    assert!(outcome.subhandlers().is_empty());
}

#[tokio::test(start_paused = true)]
async fn retry_until_done_waits_for_children() {
    let mut registry = Registry::new();
    registry.on_create("cex", "parent", parent);
    let kit = TestKit::new(registry);
    let started = tokio::time::Instant::now();
    let attempts = kit
        .retry_until_done("parent", InvocationBuilder::create(body()), 5)
        .await;
    assert_eq!(attempts.len(), 2);
    assert_eq!(attempts[1].subhandler("flaky"), Some(OutcomeKind::Success));
    assert_eq!(attempts[1].subhandler("good"), None);
    assert_eq!(started.elapsed(), Duration::from_secs(5));
}

/// `outer` (with 3 retries of its own) declares `inner`, which fails temporarily on its first
/// attempt; `limited` (2 retries) always fails.
async fn nesting_parent(ctx: Context) -> HandlerResult {
    ctx.subhandler_with(
        "outer",
        SubhandlerOptions::new().retries(3),
        |outer: Context| async move {
            outer.subhandler("inner", |inner: Context| async move {
                if inner.retry() == 0 {
                    return Err(HandlerError::temporary("not yet", Duration::from_secs(2)));
                }
                inner.patch().label("inner", "done");
                Ok(Some(json!({"id": inner.handler_id()})))
            });
            outer.patch().label("outer", "done");
            Ok::<_, HandlerError>(None)
        },
    );
    ctx.subhandler_with(
        "limited",
        SubhandlerOptions::new()
            .retries(2)
            .backoff(Duration::from_secs(1)),
        |_c: Context| async move { Err::<Option<serde_json::Value>, _>(HandlerError::retry("always busy")) },
    );
    Ok(None)
}

#[tokio::test]
async fn nested_children_finish_before_their_parent_and_keep_their_own_retries() {
    let mut registry = Registry::new();
    registry.on_create("cex", "parent", nesting_parent);
    let kit = TestKit::new(registry);

    let first = kit.invoke("parent", InvocationBuilder::create(body())).await;
    assert_eq!(
        first.subhandlers(),
        vec![
            (
                "outer/inner".to_owned(),
                OutcomeKind::TemporaryError {
                    retry_after: Some(Duration::from_secs(2))
                }
            ),
            (
                "outer".to_owned(),
                OutcomeKind::TemporaryError {
                    retry_after: Some(Duration::from_secs(2))
                }
            ),
            (
                "limited".to_owned(),
                OutcomeKind::TemporaryError {
                    retry_after: Some(Duration::from_secs(1))
                }
            ),
        ]
    );
    assert!(
        first.patched_body()["metadata"]["labels"].get("outer").is_none(),
        "an unfinished child's patch waits for its last attempt"
    );

    let second = kit
        .invoke("parent", InvocationBuilder::create(body()).after(&first))
        .await;
    assert_eq!(
        second.subhandlers(),
        vec![
            ("outer/inner".to_owned(), OutcomeKind::Success),
            ("outer".to_owned(), OutcomeKind::Success),
            ("limited".to_owned(), OutcomeKind::PermanentError),
        ]
    );
    let patched = second.patched_body();
    assert_eq!(patched["metadata"]["labels"]["inner"], "done");
    assert_eq!(patched["metadata"]["labels"]["outer"], "done");
    assert_eq!(
        patched["status"]["parent/outer/inner"]["id"],
        "parent/outer/inner"
    );

    let third = kit
        .invoke("parent", InvocationBuilder::create(body()).after(&second))
        .await;
    assert!(third.subhandlers().is_empty(), "{:?}", third.subhandlers());
}
