//! Differential test on the lines of kopf's example operators `10-builtins` and `16-indexing`:
//! an operator file of our own (`sdk-python/tests/differential/examples_builtins.py`) runs once
//! with real kopf (pinned from PyPI, `kopf run --standalone`) and once with `capstan.kopf` on
//! Capstan (`--persistence kopf`), each against a fresh API server, and what it saw is
//! compared.
//!
//! Pods are the built-in resource: one function decorated with both `on.resume` and
//! `on.create` starts an asyncio task per Pod that outlives the handler, and a delete handler
//! cancels it. Two indexes over the Pods (`kopf.index("pods")`, with `kopf.Status` and
//! `kopf.Labels` in their signatures) are read by an Example's timer. Compared: the calls per
//! Pod in order (the task's start and cancellation included) while the operator runs, and again
//! after it is restarted (the Pod left is resumed); the indexes as the timer saw them with both
//! Pods and after one was deleted; the Example's status the timer patched; the finalizers the
//! Pods carried; what the tasks saw while the operator's process stopped (they are cancelled).

use std::time::Duration;

use anyhow::{Context as _, Result};
use capstan_tests::{
    side_by_side::{
        Framework, Operator, calls, create_pod, pods, side_log, wait_gone, wait_object, wait_until,
    },
    testenv::{TestEnv, create_example, examples},
};
use kube::api::{DeleteParams, Patch, PatchParams};
use serde_json::{Value, json};

/// The operator file both frameworks run.
const OPERATOR: &str = "sdk-python/tests/differential/examples_builtins.py";

/// How long to look for calls that should not come once the handling looks over.
const SETTLE: Duration = Duration::from_millis(1500);

/// What one framework's run shows.
#[derive(Debug)]
struct BuiltinsRun {
    /// (pod, handler, reason or event) of each call while the operator ran the first time.
    first: Vec<(String, String, String)>,
    /// The same, for the calls made while the operator stopped.
    stopping: Vec<(String, String, String)>,
    /// The same, once it was started again.
    second: Vec<(String, String, String)>,
    /// The indexes as the timer saw them with both Pods, then with one.
    both: Value,
    one: Value,
    /// The Example's status as the timer patched it.
    status: Value,
    /// The finalizers of the Pods while the operator handled them.
    finalizers: Value,
}

/// (pod, handler, reason or event) of each call in `calls`.
fn steps(calls: &[Value]) -> Vec<(String, String, String)> {
    let text = |v: &Value| v.as_str().unwrap_or_default().to_owned();
    calls
        .iter()
        .map(|c| {
            let what = if c["reason"].is_string() {
                &c["reason"]
            } else {
                &c["event"]
            };
            (text(&c["name"]), text(&c["handler"]), text(what))
        })
        .collect()
}

fn count(calls: &[Value], handler: &str, name: &str, what: &str) -> usize {
    calls
        .iter()
        .filter(|c| c["handler"] == handler && c["name"] == name)
        .filter(|c| c["reason"] == what || c["event"] == what)
        .count()
}

/// The last tick of the timer whose index keys are `keys`, without its time.
fn tick_with(log: &std::path::Path, keys: &[&str]) -> Option<Value> {
    calls(&side_log(log))
        .into_iter()
        .rev()
        .find(|c| c["keys"] == json!(keys))
        .map(|mut c| {
            if let Some(tick) = c.as_object_mut() {
                tick.remove("at");
            }
            c
        })
}

async fn builtins_run(framework: Framework) -> Result<BuiltinsRun> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let log = env.scratch().join("calls.jsonl");
    let client = env.client().await?;
    let pods = pods(&client);
    let api = examples(&client, "default");

    let operator = Operator::start(framework, &env, OPERATOR, &log, &[], 1).await?;
    let first = async {
        create_pod(&pods, "runner", json!({"app": "a"})).await?;
        create_pod(&pods, "sleeper", json!({"app": "b", "tier": "x"})).await?;
        pods.patch_status(
            "runner",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Running"}})),
        )
        .await?;
        wait_until("both Pods' tasks started", &log, |c| {
            count(c, "pod_watcher", "runner", "start") == 1 && count(c, "pod_watcher", "sleeper", "start") == 1
        })
        .await?;
        let finalizers = json!({
            "runner": wait_object(&pods, "runner", "the runner", |_| true).await?.pointer("/metadata/finalizers"),
            "sleeper": wait_object(&pods, "sleeper", "the sleeper", |_| true).await?.pointer("/metadata/finalizers"),
        });
        create_example(&env, "indexer", json!({})).await?;
        wait_object(&api, "indexer", "the running Pod in the status", |o| {
            o.pointer("/status/running-pods") == Some(&json!(["default::runner"]))
        })
        .await?;
        wait_until("a tick that saw both Pods running as they do", &log, |_| {
            tick_with(&log, &["default::runner", "default::sleeper"])
                .is_some_and(|t| t["running"] == json!(["default::runner"]))
        })
        .await?;
        let both = tick_with(&log, &["default::runner", "default::sleeper"]).unwrap_or_default();

        pods.delete("sleeper", &DeleteParams::default()).await?;
        wait_gone(&pods, "sleeper").await?;
        wait_until("the sleeper's task cancelled", &log, |c| {
            count(c, "pod_watcher", "sleeper", "cancelled") == 1
        })
        .await?;
        wait_until("a tick without the sleeper", &log, |_| {
            tick_with(&log, &["default::runner"]).is_some()
        })
        .await?;
        // Each index drops the sleeper on its own: the last tick once things settled.
        tokio::time::sleep(SETTLE).await;
        let one = tick_with(&log, &["default::runner"]).unwrap_or_default();
        let status = wait_object(&api, "indexer", "the Example", |_| true).await?["status"].clone();
        Ok::<_, anyhow::Error>((both, one, status, finalizers))
    }
    .await
    .with_context(|| format!("{framework:?}: {}", operator.output()));
    let ran = calls(&log).len();
    operator.stop().await?;
    let (both, one, status, finalizers) = first?;
    let stopped = calls(&log).len();

    // The Pod left is resumed by the same function, and deleting it cancels its new task.
    let operator = Operator::start(framework, &env, OPERATOR, &log, &[], 2).await?;
    let second = async {
        wait_until("the runner resumed and its task started", &log, |c| {
            count(&c[stopped..], "pod_watcher", "runner", "start") == 1
        })
        .await?;
        pods.delete("runner", &DeleteParams::default()).await?;
        wait_gone(&pods, "runner").await?;
        wait_until("the runner's task cancelled", &log, |c| {
            count(&c[stopped..], "pod_watcher", "runner", "cancelled") == 1
        })
        .await?;
        tokio::time::sleep(SETTLE).await;
        Ok::<_, anyhow::Error>(())
    }
    .await
    .with_context(|| format!("{framework:?}, restarted: {}", operator.output()));
    operator.stop().await?;
    second?;

    let all = calls(&log);
    let run = BuiltinsRun {
        first: steps(&all[..ran]),
        stopping: steps(&all[ran..stopped]),
        second: steps(&all[stopped..]),
        both,
        one,
        status,
        finalizers,
    };
    println!("{framework:?}: {run:#?}");
    Ok(run)
}

/// Pods handled as kopf handles them: the calls, the tasks the handlers leave running, the
/// indexes the timer reads and the finalizers are kopf's.
#[tokio::test]
async fn pods_and_their_indexes_are_handled_as_kopf_handles_them() -> Result<()> {
    let kopf = builtins_run(Framework::Kopf).await?;
    let capstan = builtins_run(Framework::Capstan).await?;

    let step = |pod: &str, handler: &str, what: &str| (pod.to_owned(), handler.to_owned(), what.to_owned());
    let mut first = kopf.first.clone();
    first.sort();
    let mut expected = vec![
        step("runner", "pod_in_sight", "create"),
        step("runner", "pod_watcher", "start"),
        step("sleeper", "pod_deleted", "delete"),
        step("sleeper", "pod_in_sight", "create"),
        step("sleeper", "pod_watcher", "cancelled"),
        step("sleeper", "pod_watcher", "start"),
    ];
    expected.sort();
    assert_eq!(first, expected, "kopf's calls are not the ones intended");
    // Per Pod, in order.
    for pod in ["runner", "sleeper"] {
        let of = |steps: &[(String, String, String)]| -> Vec<(String, String, String)> {
            steps.iter().filter(|s| s.0 == pod).cloned().collect()
        };
        assert_eq!(
            of(&capstan.first),
            of(&kopf.first),
            "the calls for {pod} differ (left: capstan.kopf, right: kopf)"
        );
    }
    assert_eq!(
        kopf.second,
        vec![
            step("runner", "pod_in_sight", "resume"),
            step("runner", "pod_watcher", "start"),
            step("runner", "pod_deleted", "delete"),
            step("runner", "pod_watcher", "cancelled"),
        ],
        "kopf's calls after the restart are not the ones intended"
    );
    assert_eq!(
        capstan.second, kopf.second,
        "the calls after the restart differ (left: capstan.kopf, right: kopf)"
    );
    assert_eq!(
        capstan.both, kopf.both,
        "the indexes with both Pods differ (left: capstan.kopf, right: kopf)"
    );
    assert_eq!(
        capstan.one, kopf.one,
        "the indexes with one Pod differ (left: capstan.kopf, right: kopf)"
    );
    assert_eq!(
        kopf.status["running-pods"],
        json!(["default::runner"]),
        "kopf's status is not the one intended"
    );
    assert_eq!(
        capstan.status, kopf.status,
        "the statuses differ (left: capstan.kopf, right: kopf)"
    );
    assert_eq!(
        capstan.finalizers, kopf.finalizers,
        "the Pods' finalizers differ (left: capstan.kopf, right: kopf)"
    );
    assert_eq!(
        capstan.stopping, kopf.stopping,
        "what the tasks saw while the operator stopped differs (left: capstan.kopf, right: kopf)"
    );
    Ok(())
}
