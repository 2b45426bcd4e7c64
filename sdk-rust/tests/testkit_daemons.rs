//! Daemons, timers and deadlines through the test kit.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use capstan_sdk::{
    CancelReason, Context, HandlerError, HandlerResult, Patch, Registry,
    testing::{InvocationBuilder, OutcomeKind, TestKit},
};
use serde_json::json;

async fn monitor(ctx: Context) -> HandlerResult {
    let mut beats = 0_u64;
    while !ctx.wait_stopped(Duration::from_secs(5)).await {
        beats += 1;
        ctx.info(format!("beat {beats}"));
        let progress = Patch::new();
        progress.status("beats", beats);
        ctx.send_patch(&progress).await?;
    }
    ctx.info(format!("stopped: {:?}", ctx.cancel_reason()));
    Err(HandlerError::retry("stopped"))
}

fn body() -> serde_json::Value {
    json!({"apiVersion": "demo.capstan.dev/v1", "kind": "Example", "metadata": {"name": "d"}, "status": {"ticks": 4}})
}

#[tokio::test(start_paused = true)]
async fn daemons_run_until_cancelled() {
    let mut registry = Registry::new();
    registry.daemon("cex", "monitor", monitor);
    let kit = TestKit::new(registry);
    let daemon = kit.start_daemon("monitor", body());
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert!(!daemon.is_finished());
    assert_eq!(daemon.updates().len(), 2);
    daemon.cancel();
    let outcome = daemon.join().await;
    assert_eq!(outcome.kind(), OutcomeKind::Cancelled);
    assert_eq!(outcome.updates().len(), 2);
    let messages: Vec<&str> = outcome.logs().iter().map(|l| l.message.as_str()).collect();
    assert_eq!(
        messages,
        vec!["beat 1", "beat 2", "stopped: Some(ResourceDeleted)"]
    );
}

#[tokio::test(start_paused = true)]
async fn daemons_see_the_latest_body() {
    let mut registry = Registry::new();
    registry.daemon("cex", "scaler", |ctx: Context| async move {
        let first = ctx.spec()["size"].as_u64();
        while ctx.spec()["size"].as_u64() == first {
            if ctx.wait_stopped(Duration::from_secs(1)).await {
                return Err(HandlerError::retry("stopped"));
            }
        }
        Ok(json!({"from": first, "to": ctx.spec()["size"], "name": ctx.name()}))
    });
    let kit = TestKit::new(registry);
    let mut object = body();
    object["spec"] = json!({"size": 1});
    let daemon = kit.start_daemon("scaler", object.clone());
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(!daemon.is_finished());
    object["spec"]["size"] = json!(3);
    daemon.update_body(object);
    let outcome = daemon.join().await;
    assert_eq!(outcome.kind(), OutcomeKind::Success);
    assert_eq!(outcome.value(), Some(json!({"from": 1, "to": 3, "name": "d"})));
}

#[tokio::test(start_paused = true)]
async fn deadlines_cancel_handlers() {
    let mut registry = Registry::new();
    registry.on_create("cex", "slow", |ctx: Context| async move {
        ctx.cancelled().await;
        Err::<(), _>(HandlerError::retry(format!("{:?}", ctx.cancel_reason())))
    });
    let kit = TestKit::new(registry);
    let outcome = kit
        .invoke(
            "slow",
            InvocationBuilder::create(body()).deadline_in(Duration::from_secs(30)),
        )
        .await;
    assert_eq!(outcome.kind(), OutcomeKind::Cancelled);

    let running = kit.start("slow", InvocationBuilder::create(body()));
    running.cancel_with(CancelReason::Superseded);
    assert_eq!(running.join().await.kind(), OutcomeKind::Cancelled);
}

#[tokio::test]
async fn timers_patch_status() {
    let mut registry = Registry::new();
    registry
        .timer("cex", "tick", |ctx: Context| async move {
            let ticks = ctx.status()["ticks"].as_u64().unwrap_or(0) + 1;
            ctx.patch().status("ticks", ticks);
        })
        .interval(Duration::from_secs(10));
    let kit = TestKit::new(registry);
    let outcome = kit.tick("tick", body()).await;
    assert!(outcome.is_success());
    assert_eq!(outcome.patched_body()["status"]["ticks"], 5);
}
