//! End to end: the engine never loses, repeats or wedges work — a handler process that dies on
//! every attempt trips the poison-pill guard even when it is the handler's only owner, writes
//! the API server refuses for good become the handler's failure instead of an endless retry,
//! handler ids that are not valid annotation keys are stored under mangled keys, Capstan's
//! finalizer survives a handler's patch that drops it, a daemon without a cancellation timeout
//! is waited for, and a controller crash keeps the start time of a handler that was running.

use std::time::Duration;

use capstan_tests::{
    process::Controller,
    scenario::{Scenario, annotation, has_finalizer, progress_keys, tail},
};
use futures::StreamExt;
use kube::runtime::watcher;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

fn handled(o: &Value) -> bool {
    annotation(o, "capstan.dev/last-handled-configuration").is_some()
}

/// The `lost` notes of the handler process: (attempt, last error reason) per call.
fn losses(s: &Scenario, name: &str) -> Vec<(u32, String)> {
    s.notes("lost")
        .into_iter()
        .filter_map(|words| match words.as_slice() {
            [_, n, attempt, reason] if n == name => Some((attempt.parse().ok()?, reason.clone())),
            _ => None,
        })
        .collect()
}

/// 14.1: the only handler process of a create handler dies (SIGKILL) on every attempt and is
/// restarted; the controller is restarted as well in between. The attempt number keeps
/// growing, every later attempt is told the process was lost, and after three losses the
/// handler fails for good (the default poison-pill guard): the cause is done, the object is
/// not handled again.
#[tokio::test]
async fn a_sole_handler_process_killed_on_every_attempt_trips_the_poison_pill_guard() -> anyhow::Result<()> {
    let mut s = Scenario::start("create", &[]).await?;
    s.create("crashy", json!({"crash": {"create_fn": true}})).await?;
    for round in 1..=5u32 {
        let deadline = tokio::time::Instant::now() + T;
        loop {
            if !s.handler.running() {
                break;
            }
            if let Some(o) = s.get("crashy").await?
                && handled(&o)
            {
                break;
            }
            anyhow::ensure!(
                tokio::time::Instant::now() < deadline,
                "round {round}: the handler process was not called\ncontroller:\n{}",
                tail(&s.controller.process.output(), 40)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if s.get("crashy").await?.is_some_and(|o| handled(&o)) {
            break;
        }
        if round == 2 {
            // Through the progress records, the count also survives the controller: once the
            // second loss is on the object, the controller is killed and started again.
            s.wait("crashy", T, "the second loss recorded", |o| {
                annotation(o, "capstan.dev/create_fn").is_some_and(|r| r.contains("\"lost\":2"))
            })
            .await?;
            s.controller.process.kill().await?;
            s.controller = Controller::start(&s.env, "capstan-restarted", &[]).await?;
        }
        s.restart_handler().await?;
    }
    let o = s
        .wait("crashy", T, "the cause is done with a failure", handled)
        .await?;
    assert!(
        progress_keys(&o).is_empty(),
        "records purged: {:?}",
        progress_keys(&o)
    );
    let seen = losses(&s, "crashy");
    assert_eq!(
        seen,
        vec![
            (1, "NONE".to_owned()),
            (2, "HANDLER_PROCESS_LOST".to_owned()),
            (3, "HANDLER_PROCESS_LOST".to_owned()),
        ],
        "attempts continue across the losses, and the guard stops after three"
    );
    let log = s.controller.process.output();
    assert!(
        log.contains("HANDLER_PROCESS_LOST") || log.contains("disconnected 3 times"),
        "the failure names the loss:\n{}",
        tail(&log, 40)
    );
    Ok(())
}

/// 14.2: a handler's 10 MiB patch is refused by the API server (413). The refusal becomes
/// the handler's failed attempt with the server's message, and the object stays alive: once
/// the spec no longer asks for the huge patch, the retry succeeds.
#[tokio::test]
async fn a_patch_too_large_for_the_api_server_is_the_handlers_failure_and_the_object_lives_on()
-> anyhow::Result<()> {
    let s = Scenario::start("create", &[]).await?;
    s.create("huge", json!({"hugePatch": {"create_fn": 10}})).await?;
    let o = s
        .wait("huge", T, "the refusal recorded as a failed attempt", |o| {
            annotation(o, "capstan.dev/create_fn").is_some_and(|r| r.contains("rejected"))
        })
        .await?;
    let record: Value = serde_json::from_str(annotation(&o, "capstan.dev/create_fn").unwrap_or("{}"))?;
    assert!(record["retries"].as_u64() >= Some(1), "{record}");
    s.patch("huge", json!({"spec": {"hugePatch": null}})).await?;
    let o = s.wait("huge", T, "handled after the change", handled).await?;
    assert!(
        annotation(&o, "e2e/huge").is_none(),
        "the refused patch is not on the object"
    );
    assert!(progress_keys(&o).is_empty(), "{:?}", progress_keys(&o));
    Ok(())
}

/// 14.2: a handler id with a space cannot be an annotation key as it is. Its progress record
/// (written after a temporary error) goes under a mangled key, and the cause completes.
#[tokio::test]
async fn a_handler_id_that_is_not_a_valid_annotation_key_is_mangled() -> anyhow::Result<()> {
    let s = Scenario::start("spaced", &[]).await?;
    s.create("spaced", json!({"temporary": {"has space": 1}})).await?;
    let o = s
        .wait("spaced", T, "the first failure recorded", |o| {
            !progress_keys(o).is_empty()
        })
        .await?;
    let keys = progress_keys(&o);
    assert!(
        keys.iter().all(|k| !k.contains(' ')),
        "every key is valid: {keys:?}"
    );
    let o = s.wait("spaced", T, "cause done", handled).await?;
    assert!(progress_keys(&o).is_empty(), "{:?}", progress_keys(&o));
    let calls = std::fs::read_to_string(&s.calls)?;
    let attempts: Vec<&str> = calls
        .lines()
        .filter_map(|l| l.strip_prefix("has space spaced "))
        .collect();
    assert_eq!(attempts, ["1", "2"], "one temporary failure, then success");
    Ok(())
}

/// 14.3: a create handler patches `metadata.finalizers` to null. No version of the object
/// between the finalizer's addition and its deletion lacks Capstan's finalizer, and the
/// delete handler runs on deletion.
#[tokio::test]
async fn a_handler_patch_cannot_remove_capstans_finalizer() -> anyhow::Result<()> {
    let s = Scenario::start("create,delete", &[]).await?;
    let api = s.api();
    let versions = tokio::spawn(async move {
        let stream = watcher::watch_object(api, "unfin");
        tokio::time::timeout(Duration::from_secs(120), async move {
            let mut seen: Vec<Value> = Vec::new();
            let mut stream = std::pin::pin!(stream);
            while let Some(Ok(event)) = stream.next().await {
                match event {
                    Some(o) => seen.push(serde_json::to_value(o).unwrap_or_default()),
                    None if !seen.is_empty() => break,
                    None => {}
                }
            }
            seen
        })
        .await
        .unwrap_or_default()
    });
    s.create("unfin", json!({"unfinalize": {"create_fn": true}}))
        .await?;
    s.wait("unfin", T, "created and handled", handled).await?;
    s.delete("unfin").await?;
    s.wait_gone("unfin", T).await?;
    let seen = versions.await?;
    let first = seen
        .iter()
        .position(has_finalizer)
        .ok_or_else(|| anyhow::anyhow!("the finalizer was never added"))?;
    for o in &seen[first..] {
        assert!(
            has_finalizer(o),
            "a version without the finalizer: {}",
            serde_json::to_string(&o["metadata"]).unwrap_or_default()
        );
    }
    assert_eq!(s.count("delete_fn", "unfin"), 1, "the delete handler ran");
    Ok(())
}

/// 14.11: a daemon without a cancellation timeout that ignores its cancellation is waited for
/// (kopf's default): its object keeps the finalizer while it runs, well past the hub's
/// default grace.
#[tokio::test]
async fn a_daemon_without_a_cancellation_timeout_is_never_abandoned() -> anyhow::Result<()> {
    let s = Scenario::start("stubborn-forever", &[]).await?;
    s.create("forever", json!({})).await?;
    s.wait("forever", T, "finalizer added", has_finalizer).await?;
    let deadline = tokio::time::Instant::now() + T;
    while s.count("stubborn", "forever") == 0 {
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "the daemon did not start");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s.delete("forever").await?;
    tokio::time::sleep(Duration::from_secs(12)).await;
    let o = s.get("forever").await?;
    assert!(
        o.as_ref().is_some_and(has_finalizer),
        "the object must wait for its daemon:\n{}",
        tail(&s.controller.process.output(), 30)
    );
    assert!(
        !s.controller.process.output().contains("abandoned"),
        "{}",
        tail(&s.controller.process.output(), 30)
    );
    Ok(())
}

/// 14.12: the controller is killed while the only handler of a cause runs past the checkpoint
/// time. The checkpoint has its start; after the restart the record keeps that start, so its
/// timeout keeps counting from the first attempt.
#[tokio::test]
async fn a_controller_crash_keeps_the_start_time_of_a_running_handler() -> anyhow::Result<()> {
    let args = ["--checkpoint-after", "300ms"];
    let mut s = Scenario::start("slow-timeout", &args).await?;
    s.create("slow", json!({"sleep": {"slow": 8}})).await?;
    let o = s
        .wait("slow", T, "the running handler's start checkpointed", |o| {
            annotation(o, "capstan.dev/slow").is_some()
        })
        .await?;
    let before: Value = serde_json::from_str(annotation(&o, "capstan.dev/slow").unwrap_or("{}"))?;
    assert!(before["started"].is_string(), "{before}");
    assert_eq!(before["retries"], 0, "the attempt is still running: {before}");
    s.controller.process.kill().await?;
    s.controller = Controller::start(&s.env, "capstan-restarted", &args).await?;
    s.handler.kill().await?;
    s.restart_handler().await?;
    let deadline = tokio::time::Instant::now() + T;
    while s.count("slow", "slow") < 2 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "not invoked again after the restart"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let o = s.get("slow").await?.unwrap_or_default();
    let after: Value = serde_json::from_str(annotation(&o, "capstan.dev/slow").unwrap_or("{}"))?;
    assert_eq!(
        after["started"], before["started"],
        "the start survives the crash"
    );
    let o = s.wait("slow", T, "cause done", handled).await?;
    assert!(progress_keys(&o).is_empty());
    Ok(())
}
