//! End to end: the controller's writes keep what others wrote and cost no more than they must.
//!
//! - Status conditions are written with a resourceVersion precondition: a condition another
//!   controller added while a handler ran survives (on a conflict the controller re-reads the
//!   object and keeps the others' conditions beside its own).
//! - A single handler running longer than `--checkpoint-after` costs no checkpoint unless it
//!   has a timeout (whose clock its start time keeps across a restart): one PATCH per change.

use std::time::Duration;

use capstan_tests::scenario::{Scenario, annotation};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(30);

fn handled(o: &Value) -> bool {
    annotation(o, "capstan.dev/last-handled-configuration").is_some()
}

/// The types of an object's status conditions.
fn condition_types(o: &Value) -> Vec<String> {
    o.pointer("/status/conditions")
        .and_then(Value::as_array)
        .map(|cs| {
            cs.iter()
                .filter_map(|c| c["type"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn a_condition_added_by_another_controller_while_a_handler_runs_survives() -> anyhow::Result<()> {
    let s = Scenario::start("create", &["--conditions"]).await?;
    s.create("shared", json!({"sleep": {"create_fn": 3}})).await?;
    // The handler runs; another controller adds its own condition meanwhile.
    let deadline = tokio::time::Instant::now() + T;
    while s.count("create_fn", "shared") == 0 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the handler was not called"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let current = s.get("shared").await?.unwrap_or_default();
    let mut conditions = current
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    conditions.push(json!({
        "type": "Foreign", "status": "True", "reason": "Mine", "message": "another controller's",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }));
    s.api()
        .patch_status(
            "shared",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"status": {"conditions": conditions}})),
        )
        .await?;
    let done = s
        .wait("shared", T, "handled and Ready", |o| {
            handled(o) && condition_types(o).iter().any(|t| t == "Ready")
        })
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let stored = s.get("shared").await?.unwrap_or(done);
    let types = condition_types(&stored);
    for kind in ["Foreign", "Ready", "Progressing", "Degraded"] {
        assert!(types.iter().any(|t| t == kind), "{kind} missing: {types:?}");
    }
    let ready = stored
        .pointer("/status/conditions")
        .and_then(Value::as_array)
        .and_then(|cs| cs.iter().find(|c| c["type"] == "Ready"))
        .cloned()
        .unwrap_or_default();
    assert_eq!(ready["status"], "True", "{ready}");
    assert_eq!(s.count("create_fn", "shared"), 1, "the handler ran once");
    Ok(())
}

#[tokio::test]
async fn a_single_slow_handler_without_a_timeout_costs_one_write() -> anyhow::Result<()> {
    let s = Scenario::start("create", &["--checkpoint-after", "1s"]).await?;
    s.create("slow", json!({"sleep": {"create_fn": 2.5}})).await?;
    s.wait("slow", T, "handled", handled).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        s.writes("slow"),
        ["patch"],
        "a checkpoint of the lone handler's start was written"
    );
    assert_eq!(s.count("create_fn", "slow"), 1);
    Ok(())
}
