//! End to end: API writes per handled change, counted from the API server's audit log.
//!
//! kopf writes once per handler plus bookkeeping; Capstan folds a whole change into one PATCH
//! (plus one for the finalizer when a delete handler needs it, and one `/status` PATCH when
//! handlers return results on a resource with a status subresource), and its own writes and
//! other parties' status changes cost nothing.

use std::time::Duration;

use capstan_tests::scenario::{Scenario, annotation, label};
use serde_json::json;

const T: Duration = Duration::from_secs(30);

fn handled(o: &serde_json::Value) -> bool {
    annotation(o, "capstan.dev/last-handled-configuration").is_some()
}

#[tokio::test]
async fn a_create_with_three_handlers_costs_one_patch() -> anyhow::Result<()> {
    let s = Scenario::start("create3", &[]).await?;
    s.create("one", json!({})).await?;
    s.wait("one", T, "handled", |o| handled(o) && label(o, "e2e/b").is_some())
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        s.writes("one"),
        ["patch"],
        "one PATCH, and the echo of it costs nothing"
    );
    Ok(())
}

#[tokio::test]
async fn a_delete_handler_adds_one_patch_for_the_finalizer() -> anyhow::Result<()> {
    let s = Scenario::start("create3,delete", &[]).await?;
    s.create("two", json!({})).await?;
    s.wait("two", T, "handled", handled).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(s.writes("two"), ["patch", "patch"]);
    s.delete("two").await?;
    s.wait_gone("two", T).await?;
    let writes = s.writes("two");
    assert_eq!(
        writes.iter().filter(|w| *w == "patch").count(),
        3,
        "the delete cycle is one more: {writes:?}"
    );
    Ok(())
}

#[tokio::test]
async fn results_add_one_status_patch_and_foreign_status_changes_cost_nothing() -> anyhow::Result<()> {
    let s = Scenario::start("results", &[]).await?;
    s.create("three", json!({})).await?;
    s.wait("three", T, "handled", |o| {
        handled(o) && o.pointer("/status/create_fn").is_some()
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(s.writes("three"), ["patch/status", "patch"]);
    // A third party changes only the status.
    let api = s.api();
    api.patch_status(
        "three",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(json!({"status": {"phase": "Elsewhere"}})),
    )
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        s.writes("three"),
        ["patch/status", "patch"],
        "the controller wrote nothing more"
    );
    assert_eq!(s.count("create_fn", "three"), 1);
    Ok(())
}
