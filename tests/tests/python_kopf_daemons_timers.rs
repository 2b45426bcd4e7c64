//! Differential tests on the lines of kopf's example operators `14-daemons` and `15-timers`:
//! an operator file of our own (`sdk-python/tests/differential/examples_daemons.py`) runs once
//! with real kopf (pinned from PyPI, `kopf run --standalone`) and once with `capstan.kopf` on
//! Capstan (`--persistence kopf`), each against a fresh API server, and what its daemons and
//! timers saw is compared. Each call is one JSON line in a log the operator file appends to;
//! every handler keeps to its own objects through a `when` filter.
//!
//! - A sync daemon failing with `TemporaryError(delay=)` on its first two attempts, then
//!   returning: compared are its attempts (the `retry` of each start, and its exit), the
//!   object's status once it is over (every attempt's patch, the failed ones' too, and the
//!   daemon's result) and that it is not started again.
//! - An async daemon that ignores `stopped` (with a `cancellation_timeout`) and a sync one that
//!   waits on it, when their object is deleted: compared are what each recorded (the async one
//!   is cancelled, the sync one returns), that `stopped.reason` names `RESOURCE_DELETED`
//!   (kopf's reason is a flag that gathers the later steps of the stopping too, such as
//!   `DAEMON_CANCELLED`; only the cause of the stopping is compared), and that the deletion
//!   completes; and that the async daemon, which has no `cancellation_backoff`, is cancelled at
//!   once, not when its `cancellation_timeout` has passed (that is the time it then has to
//!   end).
//! - A timer with `idle` on an object that keeps changing, then stops changing: compared are
//!   whether it ticked while the object changed, whether it ticked once the object was idle,
//!   and whether it then ticked again at its `interval`.
//! - A sync and an async timer on an object whose field changes: compared are what they saw,
//!   as a set of (handler, field), and the results they left in the status.
//!
//! Timing is each framework's own: ticks and pings are compared as sets and booleans, never
//! counted. Writes are not compared either. Sync daemons are never killed by Capstan (they
//! return once `stopped` is set), so the sync daemon here honours `stopped`.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::Path,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, Result};
use capstan_tests::{
    side_by_side::{Framework, Operator, calls, wait_gone, wait_object, wait_until},
    testenv::{TestEnv, create_example, examples},
};
use kube::{
    Api,
    api::{DeleteParams, DynamicObject, Patch, PatchParams},
};
use serde_json::{Value, json};

/// How long to look for calls that should not come once the handling looks over.
const SETTLE: Duration = Duration::from_millis(1500);

/// The operator file both frameworks run.
const OPERATOR: &str = "sdk-python/tests/differential/examples_daemons.py";

/// Runs `scenario` against a fresh API server with the Example CRD and the operator file
/// running under `framework`; the scenario gets the examples' API in `default` and the log.
async fn run<R>(
    framework: Framework,
    scenario: impl AsyncFnOnce(&TestEnv, &Api<DynamicObject>, &Path) -> Result<R>,
) -> Result<R> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let log = env.scratch().join("calls.jsonl");
    let api = examples(&env.client().await?, "default");
    let operator = Operator::start(framework, &env, OPERATOR, &log, &[], 1).await?;
    let outcome = scenario(&env, &api, &log)
        .await
        .with_context(|| format!("{framework:?}: {}", operator.output()));
    operator.stop().await?;
    outcome
}

/// The calls of `handler`.
fn calls_of(log: &Path, handler: &str) -> Vec<Value> {
    calls(log)
        .into_iter()
        .filter(|c| c["handler"] == handler)
        .collect()
}

fn recorded(calls: &[Value], handler: &str, event: &str) -> bool {
    calls
        .iter()
        .any(|c| c["handler"] == handler && c["event"] == event)
}

fn text(value: &Value) -> String {
    value.as_str().unwrap_or_default().to_owned()
}

/// Deletes the object `name` and waits until it is gone (its finalizer released).
async fn delete_and_wait_gone(api: &Api<DynamicObject>, name: &str) -> Result<()> {
    api.delete(name, &DeleteParams::default()).await?;
    wait_gone(api, name).await
}

/// Sets `spec.field` of the object `name`.
async fn set_field(api: &Api<DynamicObject>, name: &str, field: &str) -> Result<()> {
    api.patch(
        name,
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"field": field}})),
    )
    .await?;
    Ok(())
}

/// Now, in seconds since the epoch (as the operator file's `time.time()`).
fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

// ---------------------------------------------------------------------------------------------
// Daemons (14-daemons).

/// What one framework's run of the retrying daemon shows.
struct RetryingRun {
    /// (event, retry) of each record, in order.
    attempts: Vec<(String, u64)>,
    /// The object's status once the daemon is over.
    status: Value,
}

async fn retrying_run(framework: Framework) -> Result<RetryingRun> {
    run(framework, async |env, api, log| {
        create_example(env, "retrying", json!({"field": "r"})).await?;
        wait_until("the daemon's exit", log, |c| {
            recorded(c, "retrying_daemon", "exit")
        })
        .await?;
        wait_object(api, "retrying", "the daemon's result in the status", |o| {
            o.pointer("/status/retrying_daemon").is_some()
        })
        .await?;
        // A daemon that returned is not started again.
        tokio::time::sleep(SETTLE).await;
        let object = wait_object(api, "retrying", "the object", |_| true).await?;
        let attempts = calls_of(log, "retrying_daemon")
            .iter()
            .map(|c| (text(&c["event"]), c["retry"].as_u64().unwrap_or(u64::MAX)))
            .collect();
        delete_and_wait_gone(api, "retrying").await?;
        let run = RetryingRun {
            attempts,
            status: object["status"].clone(),
        };
        println!(
            "{framework:?}: attempts {:?}; status {}",
            run.attempts, run.status
        );
        Ok(run)
    })
    .await
}

/// A sync daemon raising `TemporaryError(delay=0.3)` twice, then returning: it is started with
/// the same retries under both, every attempt's status patch is applied (a failed one's too),
/// its result goes to the status, and it is not started again.
#[tokio::test]
async fn daemon_retried_on_temporary_errors_patches_every_attempt_and_returns() -> Result<()> {
    let kopf = retrying_run(Framework::Kopf).await?;
    let capstan = retrying_run(Framework::Capstan).await?;

    let expected: Vec<(String, u64)> = [("start", 0), ("start", 1), ("start", 2), ("exit", 2)]
        .into_iter()
        .map(|(e, r)| (e.to_owned(), r))
        .collect();
    assert_eq!(
        kopf.attempts, expected,
        "kopf's attempts are not the ones intended"
    );
    assert_eq!(
        capstan.attempts, kopf.attempts,
        "the daemon's attempts differ (left: capstan.kopf, right: kopf)"
    );
    assert_eq!(
        kopf.status,
        json!({
            "attempts": {"0": "failed", "1": "failed", "2": "succeeded"},
            "retrying_daemon": {"finished_at": 2},
        }),
        "kopf's status is not the one intended"
    );
    assert_eq!(
        capstan.status, kopf.status,
        "the statuses differ (left: capstan.kopf, right: kopf)"
    );
    Ok(())
}

/// What one framework's run of the stopping daemons shows.
struct StoppingRun {
    /// The events each daemon recorded, in order.
    events: BTreeMap<String, Vec<String>>,
    /// The stopping reasons each daemon saw when it ended.
    reasons: BTreeMap<String, BTreeSet<String>>,
    /// The async daemon was cancelled well before its `cancellation_timeout` (1 s) passed.
    cancelled_at_once: bool,
}

async fn stopping_run(framework: Framework) -> Result<StoppingRun> {
    run(framework, async |env, api, log| {
        create_example(env, "pinging", json!({"field": "p"})).await?;
        wait_until("both daemons running", log, |c| {
            recorded(c, "pinging_daemon", "ping") && recorded(c, "waiting_daemon", "start")
        })
        .await?;
        delete_and_wait_gone(api, "pinging").await?;
        wait_until("both daemons ending", log, |c| {
            recorded(c, "pinging_daemon", "cancelled") && recorded(c, "waiting_daemon", "exit")
        })
        .await?;
        tokio::time::sleep(SETTLE).await;
        let mut run = StoppingRun {
            events: BTreeMap::new(),
            reasons: BTreeMap::new(),
            cancelled_at_once: false,
        };
        for call in calls(log) {
            let handler = text(&call["handler"]);
            run.events
                .entry(handler.clone())
                .or_default()
                .push(text(&call["event"]));
            if let Some(reasons) = call["reason"].as_array() {
                run.reasons
                    .entry(handler)
                    .or_default()
                    .extend(reasons.iter().map(text));
            }
        }
        let since_stop = calls_of(log, "pinging_daemon")
            .iter()
            .find(|c| c["event"] == "cancelled")
            .map(|c| c["since_stop"].clone());
        // Null: cancelled before the daemon's own task noticed `stopped` — at once too.
        run.cancelled_at_once = since_stop
            .as_ref()
            .is_some_and(|s| s.is_null() || s.as_f64().is_some_and(|s| s < 0.5));
        println!(
            "{framework:?}: events {:?}; reasons {:?}; the async daemon cancelled {since_stop:?} s after stopped was set",
            run.events, run.reasons
        );
        Ok(run)
    })
    .await
}

/// On its object's deletion, an async daemon that ignores `stopped` is cancelled and a sync
/// daemon waiting on `stopped` returns, both with `RESOURCE_DELETED` as the reason, and the
/// deletion completes, under both.
#[tokio::test]
async fn daemons_are_stopped_when_their_object_is_deleted() -> Result<()> {
    let kopf = stopping_run(Framework::Kopf).await?;
    let capstan = stopping_run(Framework::Capstan).await?;

    let expected: BTreeMap<String, Vec<String>> = [
        ("pinging_daemon", vec!["start", "ping", "cancelled"]),
        ("waiting_daemon", vec!["start", "exit"]),
    ]
    .into_iter()
    .map(|(h, e)| (h.to_owned(), e.into_iter().map(str::to_owned).collect()))
    .collect();
    assert_eq!(
        kopf.events, expected,
        "kopf's daemons did not record what was intended"
    );
    assert_eq!(
        capstan.events, kopf.events,
        "what the daemons recorded differs (left: capstan.kopf, right: kopf)"
    );
    assert!(
        kopf.cancelled_at_once,
        "kopf did not cancel the async daemon at once"
    );
    assert!(
        capstan.cancelled_at_once,
        "capstan.kopf cancelled the async daemon only when its cancellation_timeout passed"
    );
    let deleted = |reasons: &BTreeMap<String, BTreeSet<String>>| -> BTreeMap<String, bool> {
        reasons
            .iter()
            .map(|(h, r)| (h.clone(), r.contains("RESOURCE_DELETED")))
            .collect()
    };
    let both: BTreeMap<String, bool> = [("pinging_daemon", true), ("waiting_daemon", true)]
        .into_iter()
        .map(|(h, d)| (h.to_owned(), d))
        .collect();
    assert_eq!(
        deleted(&kopf.reasons),
        both,
        "kopf's reasons are not the ones intended: {:?}",
        kopf.reasons
    );
    assert_eq!(
        deleted(&capstan.reasons),
        deleted(&kopf.reasons),
        "whether the daemons were stopped for the deletion differs (left: capstan.kopf {:?}, right: kopf {:?})",
        capstan.reasons,
        kopf.reasons
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Timers (15-timers).

/// What one framework's run of the idle timer shows.
#[derive(Debug, PartialEq)]
struct IdleRun {
    /// Whether it ticked before the object had been idle for (nearly) its `idle` since the
    /// creation or a change.
    ticked_while_changing: bool,
    /// Whether it ticked once the object was idle.
    ticked_once_idle: bool,
    /// Whether its second tick once idle came after (about) its `interval`, not its `idle`.
    ticked_again_at_interval: bool,
}

async fn idle_run(framework: Framework) -> Result<IdleRun> {
    run(framework, async |env, api, log| {
        let mut changes = vec![now()];
        create_example(env, "idling", json!({"field": "0"})).await?;
        wait_until("the operator seeing the object", log, |c| {
            c.iter().any(|c| c["handler"] == "idling_seen")
        })
        .await?;
        // Changes every 0.3 s for about 2 s: never idle for 1.5 s.
        for i in 1..=7 {
            tokio::time::sleep(Duration::from_millis(300)).await;
            set_field(api, "idling", &i.to_string()).await?;
            changes.push(now());
        }
        let last_change = now();
        wait_until("two ticks once idle", log, |c| {
            c.iter()
                .filter(|c| c["handler"] == "idle_timer" && c["at"].as_f64().unwrap_or(0.0) > last_change)
                .count()
                >= 2
        })
        .await?;
        let ticks: Vec<f64> = calls_of(log, "idle_timer")
            .iter()
            .filter_map(|c| c["at"].as_f64())
            .collect();
        delete_and_wait_gone(api, "idling").await?;
        // The idle time counts from when the operator saw a change, about when the test's
        // request returned: 0.3 s of slack.
        let idle_for = |tick: f64| {
            changes
                .iter()
                .filter(|c| **c <= tick)
                .fold(f64::INFINITY, |idle, c| idle.min(tick - c))
        };
        let after: Vec<f64> = ticks.iter().copied().filter(|t| *t > last_change).collect();
        let run = IdleRun {
            ticked_while_changing: ticks.iter().any(|t| idle_for(*t) < 1.2),
            ticked_once_idle: !after.is_empty(),
            ticked_again_at_interval: after.len() >= 2 && after[1] - after[0] < 1.2,
        };
        println!(
            "{framework:?}: {run:?}; ticks {:?} s after the last change",
            ticks
                .iter()
                .map(|t| ((t - last_change) * 100.0).round() / 100.0)
                .collect::<Vec<_>>()
        );
        Ok(run)
    })
    .await
}

/// A timer with `interval=0.5, idle=1.5` on an object changed every 0.3 s for 2 s: it does not
/// tick while the object changes, ticks once it has been idle for 1.5 s, then every 0.5 s.
#[tokio::test]
async fn timer_with_idle_ticks_only_once_the_object_is_idle() -> Result<()> {
    let kopf = idle_run(Framework::Kopf).await?;
    let capstan = idle_run(Framework::Capstan).await?;

    assert_eq!(
        kopf,
        IdleRun {
            ticked_while_changing: false,
            ticked_once_idle: true,
            ticked_again_at_interval: true,
        },
        "kopf's timer did not tick as intended"
    );
    assert_eq!(
        capstan, kopf,
        "the idle timer's ticks differ (left: capstan.kopf, right: kopf)"
    );
    Ok(())
}

/// What one framework's run of the sync and async timers shows.
struct TickingRun {
    /// (handler, the field it saw) of every tick.
    seen: BTreeSet<(String, String)>,
    /// The object's status once both have seen the last change.
    status: Value,
}

async fn ticking_run(framework: Framework) -> Result<TickingRun> {
    run(framework, async |env, api, log| {
        let saw = |c: &[Value], field: &str| {
            ["sync_timer", "async_timer"]
                .iter()
                .all(|h| c.iter().any(|c| c["handler"] == *h && c["field"] == field))
        };
        create_example(env, "ticking", json!({"field": "a"})).await?;
        wait_until("both timers seeing a", log, |c| saw(c, "a")).await?;
        set_field(api, "ticking", "b").await?;
        wait_until("both timers seeing b", log, |c| saw(c, "b")).await?;
        let object = wait_object(api, "ticking", "both timers' results for b", |o| {
            o.pointer("/status/sync_timer/field") == Some(&json!("b"))
                && o.pointer("/status/async_timer/field") == Some(&json!("b"))
        })
        .await?;
        delete_and_wait_gone(api, "ticking").await?;
        let seen = calls(log)
            .iter()
            .map(|c| (text(&c["handler"]), text(&c["field"])))
            .collect();
        let run = TickingRun {
            seen,
            status: object["status"].clone(),
        };
        println!("{framework:?}: seen {:?}; status {}", run.seen, run.status);
        Ok(run)
    })
    .await
}

/// A sync and an async timer with `interval=0.3`: both tick, see the object's latest field,
/// and leave their results in the status, under both; the object's deletion completes.
#[tokio::test]
async fn sync_and_async_timers_tick_with_the_latest_body() -> Result<()> {
    let kopf = ticking_run(Framework::Kopf).await?;
    let capstan = ticking_run(Framework::Capstan).await?;

    let expected: BTreeSet<(String, String)> = [
        ("sync_timer", "a"),
        ("sync_timer", "b"),
        ("async_timer", "a"),
        ("async_timer", "b"),
    ]
    .into_iter()
    .map(|(h, f)| (h.to_owned(), f.to_owned()))
    .collect();
    assert_eq!(kopf.seen, expected, "kopf's timers did not see what was intended");
    assert_eq!(
        capstan.seen, kopf.seen,
        "what the timers saw differs (left: capstan.kopf, right: kopf)"
    );
    assert_eq!(
        kopf.status,
        json!({"sync_timer": {"field": "b"}, "async_timer": {"field": "b"}}),
        "kopf's status is not the one intended"
    );
    assert_eq!(
        capstan.status, kopf.status,
        "the timers' results differ (left: capstan.kopf, right: kopf)"
    );
    Ok(())
}
