//! Differential test on the lines of kopf's example operator `13-hooks`: an operator file of
//! our own (`sdk-python/tests/differential/examples_hooks.py`) runs once with real kopf (pinned
//! from PyPI, `kopf run --standalone`) and once with `capstan.kopf` on Capstan (`--persistence
//! kopf`), each against a fresh API server, and what its hooks saw is compared.
//!
//! Two startup handlers (one makes an asyncio lock, one fails temporarily until its fourth
//! attempt), a login handler reading the kubeconfig, an event handler on Pods that starts a
//! background task per Pod under the lock, and a cleanup handler that asks those tasks to stop.
//! The operator is stopped with SIGTERM (under Capstan the handler process first, as the
//! chart's pod stops its containers). Compared: the startup handlers' attempts and their
//! delays, that the login handler and the event handler came after the startup, what the event
//! handler saw, that the cleanup handler ran once with the task it was to stop, and that the
//! task stopped.

use anyhow::{Context as _, Result};
use capstan_tests::{
    side_by_side::{Framework, Operator, calls, create_pod, pods, wait_until},
    testenv::TestEnv,
};
use serde_json::{Value, json};

/// The operator file both frameworks run.
const OPERATOR: &str = "sdk-python/tests/differential/examples_hooks.py";

/// What one framework's run shows.
#[derive(Debug)]
struct HooksRun {
    /// The `retry` of each startup handler's attempts, per handler.
    startup: Vec<(String, Vec<u64>)>,
    /// The shortest time between two attempts of the retried startup handler, in seconds.
    shortest_retry_gap: f64,
    /// What the login handler saw (its first call).
    login: Value,
    /// Whether every login and event handler call came after the startup handlers finished.
    after_startup: bool,
    /// What the event handler saw of the Pod: the event types, and that the lock was there.
    pod_events: Vec<Value>,
    /// The cleanup handler's calls (what it found to stop).
    cleanup: Vec<Value>,
    /// The background task's records.
    served: Vec<String>,
}

fn of<'a>(calls: &'a [Value], handler: &'a str) -> impl Iterator<Item = &'a Value> + 'a {
    calls.iter().filter(move |c| c["handler"] == handler)
}

fn without_time(call: &Value) -> Value {
    let mut call = call.clone();
    if let Some(fields) = call.as_object_mut() {
        fields.remove("at");
    }
    call
}

fn at(call: &Value) -> f64 {
    call["at"].as_f64().unwrap_or_default()
}

async fn hooks_run(framework: Framework) -> Result<HooksRun> {
    let env = TestEnv::start().await?;
    let log = env.scratch().join("calls.jsonl");
    let pods = pods(&env.client().await?);
    let operator = Operator::start(framework, &env, OPERATOR, &log, &[], 1).await?;
    let ran = async {
        // The Pod is there before the operator watches Pods (over a second ahead of it: the
        // startup has two more attempts to go, then the login), so both list it.
        wait_until("the retried startup handler's second attempt", &log, |c| {
            of(c, "startup_fn_retried").any(|r| r["retry"] == 1)
        })
        .await?;
        create_pod(&pods, "served", json!({})).await?;
        wait_until("the retried startup handler's fourth attempt", &log, |c| {
            of(c, "startup_fn_retried").any(|r| r["retry"] == 3)
        })
        .await?;
        wait_until("the Pod's task started", &log, |c| {
            of(c, "serve").any(|r| r["event"] == "start")
        })
        .await?;
        wait_until("the login handler called", &log, |c| {
            of(c, "login_fn").next().is_some()
        })
        .await
    }
    .await
    .with_context(|| format!("{framework:?}: {}", operator.output()));
    let output = operator.output();
    operator.stop().await?;
    ran?;
    let all = calls(&log);
    println!("{framework:?}: calls {all:#?}\n{output}");

    let startup = ["startup_fn_simple", "startup_fn_retried"]
        .into_iter()
        .map(|h| {
            let retries = of(&all, h).filter_map(|c| c["retry"].as_u64()).collect();
            (h.to_owned(), retries)
        })
        .collect();
    let retried: Vec<f64> = of(&all, "startup_fn_retried").map(at).collect();
    let shortest_retry_gap = retried
        .windows(2)
        .map(|w| w[1] - w[0])
        .fold(f64::INFINITY, f64::min);
    let started = of(&all, "startup_fn_retried").map(at).fold(0.0, f64::max);
    let after_startup = all
        .iter()
        .filter(|c| c["handler"] == "login_fn" || c["handler"] == "pod_task")
        .all(|c| at(c) >= started);
    let pod_events = of(&all, "pod_task")
        .filter(|c| c["name"] == "served")
        .map(without_time)
        .collect();
    Ok(HooksRun {
        startup,
        shortest_retry_gap,
        login: of(&all, "login_fn").next().map(without_time).unwrap_or_default(),
        after_startup,
        pod_events,
        cleanup: of(&all, "cleanup_fn").map(without_time).collect(),
        served: of(&all, "serve")
            .map(|c| c["event"].as_str().unwrap_or_default().to_owned())
            .collect(),
    })
}

/// Startup, login, event and cleanup hooks run as kopf runs them, the cleanup handler too
/// when SIGTERM reaches the operator's process.
#[tokio::test]
async fn startup_login_and_cleanup_hooks_run_as_kopf_runs_them() -> Result<()> {
    let kopf = hooks_run(Framework::Kopf).await?;
    let capstan = hooks_run(Framework::Capstan).await?;
    println!("kopf: {kopf:#?}\ncapstan.kopf: {capstan:#?}");

    let expected = vec![
        ("startup_fn_simple".to_owned(), vec![0]),
        ("startup_fn_retried".to_owned(), vec![0, 1, 2, 3]),
    ];
    assert_eq!(
        kopf.startup, expected,
        "kopf's startup attempts are not the ones intended"
    );
    assert_eq!(
        capstan.startup, kopf.startup,
        "the startup attempts differ (left: capstan.kopf, right: kopf)"
    );
    for (name, run) in [("kopf", &kopf), ("capstan.kopf", &capstan)] {
        assert!(
            run.shortest_retry_gap >= 0.45,
            "{name}: a startup attempt came {:.2} s after the one before, not after its delay",
            run.shortest_retry_gap
        );
    }
    assert_eq!(
        capstan.login, kopf.login,
        "what the login handler saw differs (left: capstan.kopf, right: kopf)"
    );
    assert!(
        kopf.after_startup,
        "kopf ran a login or event handler before its startup"
    );
    assert_eq!(
        capstan.after_startup, kopf.after_startup,
        "capstan.kopf ran a login or event handler before the startup handlers finished"
    );
    assert_eq!(
        capstan.pod_events.first(),
        kopf.pod_events.first(),
        "the event handler's first call differs (left: capstan.kopf, right: kopf)"
    );
    assert_eq!(
        kopf.cleanup,
        vec![json!({"handler": "cleanup_fn", "tasks": ["default/served"]})],
        "kopf's cleanup is not the one intended"
    );
    assert_eq!(
        capstan.cleanup, kopf.cleanup,
        "the cleanup handler's calls differ (left: capstan.kopf, right: kopf)"
    );
    assert_eq!(
        capstan.served, kopf.served,
        "what the Pod's task did differs (left: capstan.kopf, right: kopf)"
    );
    Ok(())
}
