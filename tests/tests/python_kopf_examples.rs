//! Differential tests on the lines of kopf's example operators: operator files of our own run
//! once with real kopf (pinned from PyPI, `kopf run --standalone`) and once with `capstan.kopf`
//! on Capstan (`--persistence kopf`), each against a fresh API server, and what their handlers
//! saw is compared. Each handler call is one JSON line in a log the operator file appends to.
//!
//! - Errors (as kopf's `03-exceptions`): create handlers failing with a `PermanentError`, with
//!   a `TemporaryError` and its own `delay` until their third attempt, with an arbitrary
//!   exception under `retries` and `backoff`, and under `errors=ErrorsMode.PERMANENT` and
//!   `IGNORED`. Compared per handler: the `retry` of every call (the interleaving of the
//!   handlers is each framework's own: Capstan runs all pending handlers in one cycle), the
//!   final status (the results of the handlers that succeeded) and finalizers, and that no
//!   progress record is left once the handling is over.
//! - Handlers (as kopf's `05-handlers` and `08-events`): two resume, two create and two delete
//!   handlers, declared interleaved. An object created before the operator starts is created
//!   (a creation never mixes with resuming), then resumed when the operator starts again; an
//!   object created while it runs is created and deleted. Compared per object: the exact
//!   sequence of calls (handler, the cause's reason, retry), declaration order included. Two
//!   event handlers, the first raising: what each saw (the watch event's types per object),
//!   compared as sets, so that the raising one is seen not to stop the other.
//!
//! Writes, their number and the intermediate annotations are not compared: Capstan runs all
//! pending top-level handlers of an object in one cycle and writes less often.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

use anyhow::{Context as _, Result};
use capstan_tests::{
    side_by_side::{
        Framework, Operator, calls, handled, has_progress, side_log, wait_gone, wait_object, wait_until,
    },
    testenv::{TestEnv, create_example, examples},
};
use kube::api::DeleteParams;
use serde_json::{Value, json};

/// Whether `handler` was called for the object `name`.
fn called(calls: &[serde_json::Value], handler: &str, name: &str) -> bool {
    calls.iter().any(|c| c["handler"] == handler && c["name"] == name)
}

/// How long to look for calls that should not come once the handling looks over.
const SETTLE: Duration = Duration::from_millis(1500);

// ---------------------------------------------------------------------------------------------
// Errors.

const ERRORS: &str = "sdk-python/tests/differential/examples_errors.py";

/// What one framework's run of the errors operator shows: the `retry` of each call per
/// handler, and the object once its handling is over.
struct ErrorsRun {
    retries: BTreeMap<String, Vec<u64>>,
    object: Value,
}

async fn errors_run(framework: Framework) -> Result<ErrorsRun> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let log = env.scratch().join("calls.jsonl");
    let operator = Operator::start(framework, &env, ERRORS, &log, &[], 1).await?;
    let outcome = async {
        create_example(&env, "failing", json!({"field": "f"})).await?;
        let api = examples(&env.client().await?, "default");
        wait_until("the first calls", &log, |c| !c.is_empty()).await?;
        wait_object(&api, "failing", "the handling's end", handled).await?;
        // A handler that failed for good is not called again.
        tokio::time::sleep(SETTLE).await;
        let object = wait_object(&api, "failing", "the handling's end", handled).await?;
        let mut retries: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for call in calls(&log) {
            retries
                .entry(call["handler"].as_str().unwrap_or_default().to_owned())
                .or_default()
                .push(call["retry"].as_u64().unwrap_or(u64::MAX));
        }
        anyhow::Ok(ErrorsRun { retries, object })
    }
    .await
    .with_context(|| format!("{framework:?}: {}", operator.output()));
    if let Ok(run) = &outcome {
        println!(
            "{framework:?}: retries {:?}; status {}",
            run.retries, run.object["status"]
        );
    }
    operator.stop().await?;
    outcome
}

/// Permanent, temporary, retried-until-given-up, `errors=PERMANENT` and `errors=IGNORED`
/// failures: each handler is called with the same retries under both, and both end the
/// handling with the same status and no progress record.
#[tokio::test]
async fn handler_errors_are_retried_as_kopf_retries_them() -> Result<()> {
    let kopf = errors_run(Framework::Kopf).await?;
    let capstan = errors_run(Framework::Capstan).await?;

    // The scenario is the one intended, under kopf.
    let expected: BTreeMap<String, Vec<u64>> = [
        ("permanent_fn", vec![0]),
        ("temporary_fn", vec![0, 1, 2]),
        ("retries_fn", vec![0, 1, 2]),
        ("errors_permanent_fn", vec![0]),
        ("errors_ignored_fn", vec![0]),
    ]
    .into_iter()
    .map(|(h, r)| (h.to_owned(), r))
    .collect();
    assert_eq!(kopf.retries, expected, "kopf's calls are not the ones intended");
    assert_eq!(
        capstan.retries, kopf.retries,
        "the retries per handler differ (left: capstan.kopf, right: kopf)"
    );
    let comparable = |obj: &Value| {
        json!({
            "status": obj["status"],
            "finalizers": obj.pointer("/metadata/finalizers").cloned().unwrap_or(Value::Null),
            "progress_left": has_progress(obj),
        })
    };
    assert_eq!(
        kopf.object["status"],
        json!({"temporary_fn": {"succeeded_at": 2}}),
        "kopf's status is not the one intended: {}",
        kopf.object
    );
    assert_eq!(
        comparable(&capstan.object),
        comparable(&kopf.object),
        "the final objects differ (left: capstan.kopf, right: kopf)"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Handlers and events.

const HANDLERS: &str = "sdk-python/tests/differential/examples_handlers.py";

/// What one framework's run of the handlers operator shows: the calls per object as
/// (handler, reason, retry), and the event handlers' (handler, object, type) as a set.
struct HandlersRun {
    per_object: BTreeMap<String, Vec<(String, String, u64)>>,
    events: BTreeSet<(String, String, String)>,
}

async fn handlers_run(framework: Framework) -> Result<HandlersRun> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let log = env.scratch().join("calls.jsonl");
    let api = examples(&env.client().await?, "default");

    // An object that exists before the operator starts, and was never handled: created.
    create_example(&env, "early", json!({"field": "e"})).await?;
    let operator = Operator::start(framework, &env, HANDLERS, &log, &[], 1).await?;
    let outcome = async {
        wait_until("the creation of early", &log, |c| {
            called(c, "create_fn_2", "early")
        })
        .await?;
        wait_object(&api, "early", "early handled", handled).await?;
        tokio::time::sleep(SETTLE).await;
        anyhow::Ok(())
    }
    .await
    .with_context(|| format!("{framework:?}, the first run: {}", operator.output()));
    operator.stop().await?;
    outcome?;

    // The operator starts again and finds early handled: resumed.
    let operator = Operator::start(framework, &env, HANDLERS, &log, &[], 2).await?;
    let outcome = async {
        wait_until("the resumption of early", &log, |c| {
            called(c, "resume_fn_2", "early")
        })
        .await?;
        wait_object(&api, "early", "early resumed", handled).await?;
        // An object created while the operator runs: created, then deleted.
        create_example(&env, "late", json!({"field": "l"})).await?;
        wait_until("the creation of late", &log, |c| called(c, "create_fn_2", "late")).await?;
        wait_object(&api, "late", "late handled", handled).await?;
        for name in ["late", "early"] {
            api.delete(name, &DeleteParams::default()).await?;
            wait_gone(&api, name).await?;
        }
        let side = side_log(&log);
        wait_until("the event handlers seeing the deletions", &side, |c| {
            ["early", "late"].iter().all(|name| {
                ["event_raising_fn", "event_fn"].iter().all(|handler| {
                    c.iter()
                        .any(|e| e["handler"] == *handler && e["name"] == *name && e["type"] == "DELETED")
                })
            })
        })
        .await?;
        tokio::time::sleep(SETTLE).await;
        let mut per_object: BTreeMap<String, Vec<(String, String, u64)>> = BTreeMap::new();
        for call in calls(&log) {
            per_object
                .entry(call["name"].as_str().unwrap_or_default().to_owned())
                .or_default()
                .push((
                    call["handler"].as_str().unwrap_or_default().to_owned(),
                    call["reason"].as_str().unwrap_or_default().to_owned(),
                    call["retry"].as_u64().unwrap_or(u64::MAX),
                ));
        }
        let events = calls(&side)
            .into_iter()
            .map(|e| {
                (
                    e["handler"].as_str().unwrap_or_default().to_owned(),
                    e["name"].as_str().unwrap_or_default().to_owned(),
                    // The initial listing's objects come with no type.
                    e["type"].as_str().unwrap_or("None").to_owned(),
                )
            })
            .collect();
        anyhow::Ok(HandlersRun { per_object, events })
    }
    .await
    .with_context(|| format!("{framework:?}, the second run: {}", operator.output()));
    if let Ok(run) = &outcome {
        println!(
            "{framework:?}: calls {:?}; events {:?}",
            run.per_object, run.events
        );
    }
    operator.stop().await?;
    outcome
}

fn sequence(calls: &[(&str, &str)]) -> Vec<(String, String, u64)> {
    calls
        .iter()
        .map(|(h, r)| ((*h).to_owned(), (*r).to_owned(), 0))
        .collect()
}

/// Resume, create and delete handlers, two of each declared interleaved: each object sees the
/// same calls in the same order under both; a creation found at the start is no resumption.
#[tokio::test]
async fn resume_create_and_delete_handlers_are_called_as_kopf_calls_them() -> Result<()> {
    let kopf = handlers_run(Framework::Kopf).await?;
    let capstan = handlers_run(Framework::Capstan).await?;

    // The scenario is the one intended, under kopf: in declaration order within each cause.
    let expected: BTreeMap<String, Vec<(String, String, u64)>> = [
        (
            "early",
            sequence(&[
                ("create_fn_1", "create"),
                ("create_fn_2", "create"),
                ("resume_fn_1", "resume"),
                ("resume_fn_2", "resume"),
                ("delete_fn_1", "delete"),
                ("delete_fn_2", "delete"),
            ]),
        ),
        (
            "late",
            sequence(&[
                ("create_fn_1", "create"),
                ("create_fn_2", "create"),
                ("delete_fn_1", "delete"),
                ("delete_fn_2", "delete"),
            ]),
        ),
    ]
    .into_iter()
    .map(|(n, s)| (n.to_owned(), s))
    .collect();
    assert_eq!(
        kopf.per_object, expected,
        "kopf's calls are not the ones intended"
    );
    assert_eq!(
        capstan.per_object, kopf.per_object,
        "the calls per object differ (left: capstan.kopf, right: kopf)"
    );

    // The event handlers: the raising one first, the other still sees every event type.
    for handler in ["event_raising_fn", "event_fn"] {
        for (name, kind) in [("late", "ADDED"), ("early", "DELETED"), ("late", "DELETED")] {
            let seen = (handler.to_owned(), name.to_owned(), kind.to_owned());
            assert!(
                kopf.events.contains(&seen),
                "kopf's {handler} did not see {kind} of {name}: {:?}",
                kopf.events
            );
        }
    }
    assert_eq!(
        capstan.events, kopf.events,
        "what the event handlers saw differs (left: capstan.kopf, right: kopf)"
    );
    Ok(())
}
