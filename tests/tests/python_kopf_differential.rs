//! The differential test of the Python SDK's kopf compatibility: one kopf operator file
//! (`sdk-python/tests/differential/operator.py`) runs once with real kopf (pinned from PyPI)
//! and once with `capstan.kopf` on Capstan (`--persistence kopf`), against the same sequence
//! of object changes on a real API server. The handler calls, the kwargs each call saw
//! (retry, old, new, diff, reason) and the final object (handler results in status, the
//! finalizer, no leftover progress) must be the same; so must what a daemon, a timer and an
//! event handler saw (compared as sets: their timing is their own), and the Kubernetes Events
//! posted about the object (their types, reasons and messages: the explicit `kopf.event`,
//! `info`, `warn` and `exception` ones, and nothing about the handling itself). The operator
//! configures itself in a startup handler (`settings.persistence.finalizer`, watching and
//! queueing settings), which the controller applies as its flags; and a parent with two
//! sub-handlers is called once per sub-handler, its retry counted, as kopf's `asap` does.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use capstan_tests::{
    process::{Controller, Process, sdk_python},
    side_by_side::{calls, has_progress, side_log, wait_object, wait_until},
    testenv::{TestEnv, repo_root},
};
use k8s_openapi::api::core::v1::Event;
use kube::{
    Api,
    api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};

/// How long each step may take.
const T: Duration = Duration::from_secs(90);

/// The kopf operator file both runs share.
fn operator_file() -> PathBuf {
    repo_root().join("sdk-python/tests/differential/operator.py")
}

fn called(calls: &[Value], handler: &str) -> usize {
    calls.iter().filter(|c| c["handler"] == handler).count()
}

/// The side log's records (daemons, timers, event handlers) as a sorted set.
fn side_calls(log: &Path) -> Vec<Value> {
    let mut calls = calls(log);
    calls.sort_by_key(Value::to_string);
    calls.dedup();
    calls
}

/// The distinct (type, reason, message) of the Events about the object `name`, once the four
/// explicit ones of `create_fn` are there and a little longer (Events are posted in the
/// background by both).
async fn events_about(env: &TestEnv, name: &str) -> Result<Vec<(String, String, String)>> {
    let api: Api<Event> = Api::namespaced(env.client().await?, "default");
    let list = || async {
        let mut seen: Vec<(String, String, String)> = api
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|e| e.involved_object.name.as_deref() == Some(name))
            .map(|e| {
                (
                    e.type_.unwrap_or_default(),
                    e.reason.unwrap_or_default(),
                    e.message.unwrap_or_default(),
                )
            })
            .collect();
        seen.sort();
        seen.dedup();
        anyhow::Ok(seen)
    };
    let deadline = tokio::time::Instant::now() + T;
    while list()
        .await?
        .iter()
        .filter(|(_, r, _)| ["Custom", "Same", "Caught"].contains(&r.as_str()))
        .count()
        < 4
    {
        if tokio::time::Instant::now() > deadline {
            bail!(
                "the explicit Events did not come within {T:?}: {:?}",
                list().await?
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    list().await
}

/// Runs the sequence of changes against whichever operator is running and returns the
/// calls, the side calls ([`side_calls`]) and the object as it was before deletion.
async fn sequence(env: &TestEnv, log: &Path) -> Result<(Vec<Value>, Vec<Value>, Value)> {
    let api: Api<DynamicObject> = Api::namespaced_with(env.client().await?, "default", &example_resource());
    let object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "demo.capstan.dev/v1",
        "kind": "Example",
        "metadata": {"name": "diff"},
        "spec": {"field": "a", "fail_times": 1},
    }))?;
    api.create(&PostParams::default(), &object).await?;
    wait_until("create_fn succeeding after one retry", log, |c| {
        called(c, "create_fn") >= 2
    })
    .await?;
    wait_object(&api, "diff", "the create results", |o| {
        o.pointer("/status/create_fn").is_some()
    })
    .await?;
    api.patch(
        "diff",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"field": "b"}})),
    )
    .await?;
    wait_until("update_fn and field_fn for b", log, |c| {
        called(c, "update_fn") >= 1 && called(c, "field_fn") >= 2 && called(c, "update_field_fn") >= 1
    })
    .await?;
    let side = side_log(log);
    wait_until("the daemon's start and the timer's tick", &side, |c| {
        called(c, "daemon_fn") >= 1 && called(c, "timer_fn") >= 1
    })
    .await?;
    let before = wait_object(&api, "diff", "the update results", |o| {
        o.pointer("/status/update_fn").is_some() && !has_progress(o)
    })
    .await?;
    api.delete("diff", &DeleteParams::default()).await?;
    wait_until("delete_fn", log, |c| called(c, "delete_fn") >= 1).await?;
    wait_until("the daemon stopping", &side, |c| called(c, "daemon_fn") >= 2).await?;
    let deadline = tokio::time::Instant::now() + T;
    while api.get_opt("diff").await?.is_some() {
        if tokio::time::Instant::now() > deadline {
            bail!("the object was not released for deletion within {T:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let side_calls: Vec<Value> = side_calls(&side)
        .into_iter()
        .filter(|c| c["name"] == "diff")
        .collect();
    // A parent with two sub-handlers, on an object of its own (its filter), once the first is
    // gone: kopf calls the parent once per sub-handler.
    let object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "demo.capstan.dev/v1",
        "kind": "Example",
        "metadata": {"name": "subs"},
        "spec": {"field": "s"},
    }))?;
    api.create(&PostParams::default(), &object).await?;
    wait_until("both sub-handlers", log, |c| {
        called(c, "sub_a") >= 1 && called(c, "sub_b") >= 1
    })
    .await?;
    wait_object(&api, "subs", "the parent done", |o| {
        !has_progress(o) && o.pointer("/status/create_fn").is_some()
    })
    .await?;
    Ok((calls(log), side_calls, before))
}

fn example_resource() -> kube::api::ApiResource {
    kube::api::ApiResource {
        group: "demo.capstan.dev".into(),
        version: "v1".into(),
        api_version: "demo.capstan.dev/v1".into(),
        kind: "Example".into(),
        plural: "examples".into(),
    }
}

/// What must be equal between the two runs: the object's status and finalizers, and the
/// absence of progress records.
fn comparable(obj: &Value) -> Value {
    json!({
        "status": obj["status"],
        "finalizers": obj.pointer("/metadata/finalizers").cloned().unwrap_or(Value::Null),
        "progress_left": has_progress(obj),
    })
}

#[tokio::test]
async fn capstan_kopf_calls_handlers_as_kopf_does() -> Result<()> {
    let kopf = capstan_tests::kopf::binary().await?;
    let python = sdk_python().await?;

    // Real kopf.
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let kopf_log = env.scratch().join("kopf-calls.jsonl");
    let vars = HashMap::from([
        ("KUBECONFIG".to_owned(), env.kubeconfig.display().to_string()),
        ("DIFFERENTIAL_LOG".to_owned(), kopf_log.display().to_string()),
        (
            "DIFFERENTIAL_SIDE_LOG".to_owned(),
            side_log(&kopf_log).display().to_string(),
        ),
        ("PYTHONUNBUFFERED".to_owned(), "1".to_owned()),
    ]);
    let args = ["run", "--standalone", "-n", "default"]
        .iter()
        .map(|s| (*s).to_owned())
        .chain([operator_file().display().to_string()])
        .collect::<Vec<_>>();
    let mut kopf_process = Process::spawn("kopf", &kopf, &args, &vars, env.scratch())?;
    let (kopf_calls, kopf_side, kopf_object) = sequence(&env, &kopf_log)
        .await
        .with_context(|| format!("kopf's log:\n{}", kopf_process.output()))?;
    let kopf_events = events_about(&env, "diff").await?;
    kopf_process.terminate().await?;
    drop(env);

    // capstan.kopf on Capstan.
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let capstan_log = env.scratch().join("capstan-calls.jsonl");
    let controller = Controller::start(&env, "capstan", &["--persistence", "kopf"]).await?;
    let vars = HashMap::from([
        ("CAPSTAN_ENDPOINT".to_owned(), controller.endpoint()),
        ("CAPSTAN_DIFFERENTIAL".to_owned(), "capstan".to_owned()),
        ("DIFFERENTIAL_LOG".to_owned(), capstan_log.display().to_string()),
        (
            "DIFFERENTIAL_SIDE_LOG".to_owned(),
            side_log(&capstan_log).display().to_string(),
        ),
        (
            "PYTHONPATH".to_owned(),
            repo_root().join("sdk-python").display().to_string(),
        ),
        ("PYTHONUNBUFFERED".to_owned(), "1".to_owned()),
    ]);
    let args = ["-m", "capstan", "run"]
        .iter()
        .map(|s| (*s).to_owned())
        .chain([operator_file().display().to_string()])
        .collect::<Vec<_>>();
    let mut operator = Process::spawn("capstan-kopf", &python, &args, &vars, env.scratch())?;
    operator.wait_for("connected to the controller", T).await?;
    let (capstan_calls, capstan_side, capstan_object) = sequence(&env, &capstan_log)
        .await
        .with_context(|| format!("the operator's log:\n{}", operator.output()))?;
    let capstan_events = events_about(&env, "diff").await?;
    operator.terminate().await?;

    // The sequence compared is the one intended: a retried create, field handlers on creation
    // and on update, one update, one update handler with a field (its old, new and diff are
    // the field's), one delete.
    let handlers: Vec<(&str, Option<u64>)> = kopf_calls
        .iter()
        .map(|c| (c["handler"].as_str().unwrap_or_default(), c["retry"].as_u64()))
        .collect();
    for expected in [
        ("create_fn", Some(0)),
        ("create_fn", Some(1)),
        ("field_fn", None),
        ("update_fn", Some(0)),
        ("update_field_fn", Some(0)),
        ("delete_fn", Some(0)),
        ("parent_fn", Some(0)),
        ("parent_fn", Some(1)),
        ("sub_a", Some(0)),
        ("sub_b", Some(0)),
    ] {
        assert!(
            handlers.contains(&expected),
            "kopf made no call {expected:?}: {kopf_calls:?}"
        );
    }
    // kopf calls a delete handler again when the object's daemon is still stopping as the
    // handler finishes (the next cycle finds the deletion not done); Capstan keeps the finished
    // handler's record until the daemons have stopped and calls it once. The migration guide
    // lists this difference.
    let mut kopf_calls = kopf_calls;
    kopf_calls.dedup_by(|later, earlier| later == earlier && later["handler"] == "delete_fn");
    assert_eq!(
        capstan_calls, kopf_calls,
        "the handler calls differ (left: capstan.kopf, right: kopf)"
    );
    // Daemons, timers and event handlers: what each saw, as sets (their timing is their own).
    for expected in [
        json!({"handler": "daemon_fn", "name": "diff", "event": "start", "field": "a"}),
        json!({"handler": "daemon_fn", "name": "diff", "event": "stop", "reason": "RESOURCE_DELETED"}),
        json!({"handler": "timer_fn", "name": "diff", "event": "tick"}),
        json!({"handler": "event_fn", "name": "diff", "type": "DELETED", "field": "b", "managed": true}),
    ] {
        assert!(
            kopf_side.contains(&expected),
            "kopf made no call {expected}: {kopf_side:?}"
        );
    }
    assert_eq!(
        capstan_side, kopf_side,
        "the daemon, timer and event handler calls differ (left: capstan.kopf, right: kopf)"
    );
    assert_eq!(
        comparable(&capstan_object),
        comparable(&kopf_object),
        "the final objects differ (left: capstan.kopf, right: kopf)"
    );
    // The finalizer is the one the startup handler set in `settings`, under both.
    assert_eq!(
        kopf_object.pointer("/metadata/finalizers"),
        Some(&json!(["differential.capstan.dev/finalizer"])),
        "kopf did not take its settings' finalizer: {kopf_object}"
    );
    // Events: kopf's types (SomeType, Normal and Warning apart, Error with the exception's
    // text cut as kopf cuts it), and none about the handling.
    let types: Vec<&str> = kopf_events.iter().map(|(t, _, _)| t.as_str()).collect();
    for expected in ["SomeType", "Normal", "Warning", "Error"] {
        assert!(
            types.contains(&expected),
            "kopf posted no {expected} Event: {kopf_events:?}"
        );
    }
    assert_eq!(
        capstan_events, kopf_events,
        "the Events differ (left: capstan.kopf, right: kopf)"
    );
    Ok(())
}
