//! End to end: errors and retries (a delayed retry keeps its time across a restart), crashes
//! of the controller and of the handler process, objects deleted while their handler runs,
//! patches the API server rejects, and finalizers released when delete handlers go away.

use std::time::Duration;

use capstan_tests::{
    process::Controller,
    scenario::{Scenario, annotation, has_finalizer, label, progress_keys},
};
use serde_json::json;

const T: Duration = Duration::from_secs(30);

fn handled(o: &serde_json::Value) -> bool {
    annotation(o, "capstan.dev/last-handled-configuration").is_some()
}

#[tokio::test]
async fn temporary_unclassified_and_permanent_errors_follow_the_retry_limit() -> anyhow::Result<()> {
    let s = Scenario::start("retries", &[]).await?;
    s.create("recovers", json!({"temporary": {"limited": 2}})).await?;
    s.create("exhausts", json!({"unclassified": {"limited": 10}}))
        .await?;
    s.create("gives-up", json!({"permanent": {"limited": true}}))
        .await?;

    // While retrying, the record is on the object.
    let o = s
        .wait("recovers", T, "first failure recorded", |o| {
            !progress_keys(o).is_empty()
        })
        .await?;
    let record: serde_json::Value =
        serde_json::from_str(annotation(&o, "capstan.dev/limited").unwrap_or("{}"))?;
    assert_eq!(record["retries"], 1);
    assert!(record["delayed"].is_string());
    assert_eq!(record["purpose"], "create");

    for name in ["recovers", "exhausts", "gives-up"] {
        let o = s.wait(name, T, "cause done", handled).await?;
        assert!(
            progress_keys(&o).is_empty(),
            "{name}: records purged: {:?}",
            progress_keys(&o)
        );
    }
    assert_eq!(
        s.count("limited", "recovers"),
        3,
        "two temporary failures, then success"
    );
    assert_eq!(
        s.count("limited", "exhausts"),
        3,
        "retries=3 allows three attempts in total"
    );
    assert_eq!(
        s.count("limited", "gives-up"),
        1,
        "permanent errors are not retried"
    );
    let attempts: Vec<u32> = s
        .calls()
        .into_iter()
        .filter(|c| c.1 == "recovers")
        .map(|c| c.2)
        .collect();
    assert_eq!(attempts, [1, 2, 3]);

    // A failed cause is done: the handler is not retried until the next change.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(s.count("limited", "exhausts"), 3);
    Ok(())
}

#[tokio::test]
async fn a_controller_killed_mid_cause_completes_it_after_restart_without_rerunning_finished_handlers()
-> anyhow::Result<()> {
    let mut s = Scenario::start("create3", &["--checkpoint-after", "300ms"]).await?;
    s.create("crash", json!({"sleep": {"create_b": 4}})).await?;
    // create_a finished, create_b is running: the checkpoint has create_a's success.
    s.wait("crash", T, "checkpoint written", |o| {
        annotation(o, "capstan.dev/create_a").is_some_and(|r| r.contains("\"success\":true"))
    })
    .await?;
    s.controller.process.kill().await?;
    let args: [&str; 2] = ["--checkpoint-after", "300ms"];
    s.controller = Controller::start(&s.env, "capstan-restarted", &args).await?;
    s.handler.kill().await?;
    s.restart_handler().await?;
    let o = s
        .wait(
            "crash",
            Duration::from_secs(60),
            "cause done after restart",
            handled,
        )
        .await?;
    assert_eq!(label(&o, "e2e/b"), Some("saw-a-1"));
    assert_eq!(
        s.count("create_a", "crash"),
        1,
        "a finished handler never runs again"
    );
    assert_eq!(s.count("create_c", "crash"), 1);
    assert!(
        s.count("create_b", "crash") >= 2,
        "the interrupted handler runs again"
    );
    Ok(())
}

#[tokio::test]
async fn a_delayed_retry_survives_a_restart_and_keeps_its_time() -> anyhow::Result<()> {
    let mut s = Scenario::start("create", &[]).await?;
    let created = tokio::time::Instant::now();
    s.create(
        "later",
        json!({"temporary": {"create_fn": 1}, "retryDelay": {"create_fn": 6}}),
    )
    .await?;
    s.wait("later", T, "the delay recorded", |o| {
        annotation(o, "capstan.dev/create_fn").is_some_and(|r| r.contains("\"delayed\""))
    })
    .await?;
    s.controller.process.kill().await?;
    s.controller = Controller::start(&s.env, "capstan-restarted", &[]).await?;
    s.handler.kill().await?;
    s.restart_handler().await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        s.count("create_fn", "later"),
        1,
        "the restart must not bring the retry forward"
    );
    s.wait("later", T, "handled after the delay", handled).await?;
    let took = created.elapsed();
    assert!(
        took >= Duration::from_secs(6),
        "retried {took:?} after creation, before its 6 s delay"
    );
    assert_eq!(s.count("create_fn", "later"), 2);
    Ok(())
}

#[tokio::test]
async fn an_object_deleted_while_its_handler_runs_is_dropped_quietly() -> anyhow::Result<()> {
    let s = Scenario::start("create", &[]).await?;
    s.create("fleeting", json!({"sleep": {"create_fn": 2}})).await?;
    let deadline = tokio::time::Instant::now() + T;
    while s.count("create_fn", "fleeting") == 0 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the handler was never called"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // No delete handler, so no finalizer: the object goes at once.
    s.delete("fleeting").await?;
    s.wait_gone("fleeting", T).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let log = s.controller.process.output();
    let complaints: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("fleeting") && (l.contains("WARN") || l.contains("ERROR")))
        .collect();
    assert!(complaints.is_empty(), "{complaints:#?}");
    assert!(
        log.lines()
            .any(|l| l.contains("fleeting") && l.contains("object deleted meanwhile; dropped")),
        "the write after the handler met the 404"
    );
    // The controller carries on with other objects.
    s.create("next", json!({})).await?;
    s.wait("next", T, "handled", handled).await?;
    assert_eq!(
        s.count("create_fn", "fleeting"),
        1,
        "a gone object is not retried"
    );
    Ok(())
}

#[tokio::test]
async fn a_handler_process_killed_mid_invocation_gets_the_work_again() -> anyhow::Result<()> {
    let mut s = Scenario::start("create", &[]).await?;
    s.create("victim", json!({"sleep": {"create_fn": 2}})).await?;
    let deadline = tokio::time::Instant::now() + T;
    while s.count("create_fn", "victim") == 0 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the handler was never called"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    s.handler.kill().await?;
    s.restart_handler().await?;
    s.wait(
        "victim",
        T,
        "handled after the handler process came back",
        handled,
    )
    .await?;
    let attempts: Vec<u32> = s
        .calls()
        .into_iter()
        .filter(|c| c.1 == "victim")
        .map(|c| c.2)
        .collect();
    assert_eq!(
        attempts,
        [1, 2],
        "the lost attempt is redelivered as the next attempt"
    );
    Ok(())
}

#[tokio::test]
async fn a_patch_the_api_rejects_is_a_failed_attempt_and_loses_nothing_else() -> anyhow::Result<()> {
    let s = Scenario::start("create3", &[]).await?;
    s.create("invalid", json!({"badPatch": {"create_b": true}, "size": 1}))
        .await?;
    let o = s
        .wait("invalid", T, "create_b's rejection recorded", |o| {
            annotation(o, "capstan.dev/create_b").is_some_and(|r| r.contains("rejected"))
        })
        .await?;
    let record: serde_json::Value =
        serde_json::from_str(annotation(&o, "capstan.dev/create_b").unwrap_or("{}"))?;
    assert!(
        record["message"]
            .as_str()
            .unwrap_or_default()
            .contains("spec.size"),
        "{record}"
    );
    assert_eq!(o["spec"]["size"], 1, "the rejected patch did not stick");
    let a: serde_json::Value = serde_json::from_str(annotation(&o, "capstan.dev/create_a").unwrap_or("{}"))?;
    assert_eq!(a["success"], true, "the other handlers' progress is kept");
    assert!(
        s.controller
            .process
            .output()
            .contains("rejected the handlers' patch")
    );
    Ok(())
}

#[tokio::test]
async fn a_finalizer_is_released_when_no_delete_handler_needs_it_any_more() -> anyhow::Result<()> {
    let mut s = Scenario::start("create,delete", &[]).await?;
    s.create("held", json!({})).await?;
    s.wait("held", T, "finalizer added and handled", |o| {
        has_finalizer(o) && handled(o)
    })
    .await?;
    // The handler process is redeployed without its delete handler.
    s.handler.terminate().await?;
    s.presets = "create".into();
    s.restart_handler().await?;
    s.wait("held", T, "finalizer released", |o| !has_finalizer(o))
        .await?;
    s.delete("held").await?;
    s.wait_gone("held", T).await?;
    Ok(())
}

#[tokio::test]
async fn resume_handlers_run_for_existing_objects_after_a_restart() -> anyhow::Result<()> {
    let mut s = Scenario::start("create,resume", &[]).await?;
    s.create("old", json!({})).await?;
    s.wait("old", T, "handled", handled).await?;
    assert_eq!(s.count("resume_fn", "old"), 0, "creation never mixes with resume");
    s.controller.process.terminate().await?;
    s.controller = Controller::start(&s.env, "capstan-again", &[]).await?;
    s.handler.terminate().await?;
    s.restart_handler().await?;
    let deadline = tokio::time::Instant::now() + T;
    while s.count("resume_fn", "old") == 0 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "resume handler not called"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(s.count("resume_fn", "old"), 1);
    assert_eq!(s.count("create_fn", "old"), 1, "no second creation");
    Ok(())
}
