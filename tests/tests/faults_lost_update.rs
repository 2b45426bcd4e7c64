//! A user's change made while a long handler cycle runs must survive the controller's writes.
//! Found by the controller kill loop (`faults_kill.rs`), reproduced here without any fault:
//! the checkpoint write (`--checkpoint-after`) returns the object as stored, with the user's
//! newer spec; the cycle's final write must not diff its desired state, built from the older
//! body, against that newer object, or it writes the older spec back over the user's change.

use std::time::Duration;

use anyhow::{Result, ensure};
use capstan_tests::scenario::{Scenario, annotation};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

#[tokio::test]
async fn a_spec_change_during_a_checkpointed_cycle_is_not_overwritten() -> Result<()> {
    let s = Scenario::start("create3,update", &["--checkpoint-after", "300ms"]).await?;
    s.create(
        "edited",
        json!({"size": 1, "sleep": {"create_a": 1.5, "create_b": 3}}),
    )
    .await?;
    // The user edits the object while create_a runs; create_a then finishes, and its result
    // is checkpointed while create_b runs.
    let deadline = tokio::time::Instant::now() + T;
    while s.count("create_a", "edited") == 0 {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "create_a was never called"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    s.patch("edited", json!({"spec": {"size": 2}})).await?;
    s.wait("edited", T, "checkpoint written", |o| {
        annotation(o, "capstan.dev/create_a").is_some_and(|r| r.contains("\"success\":true"))
    })
    .await?;
    let o = s
        .wait("edited", T, "the user's change handled", |o| {
            annotation(o, "capstan.dev/last-handled-configuration")
                .and_then(|d| serde_json::from_str::<Value>(d).ok())
                .is_some_and(|d| d.pointer("/spec/size") == Some(&json!(2)))
        })
        .await;
    let now = s.get("edited").await?.unwrap_or_default();
    ensure!(
        now.pointer("/spec/size") == Some(&json!(2)),
        "the controller wrote the older spec back over the user's change: spec {} ({})",
        now["spec"],
        o.err()
            .map(|e| e.to_string().lines().next().unwrap_or_default().to_owned())
            .unwrap_or_default()
    );
    Ok(())
}
