//! End to end: what the controller ingests from the API server cannot stop a resource.
//!
//! An object nested deeper than the JSON parser's recursion limit (the API server stores it
//! under `x-kubernetes-preserve-unknown-fields`) failed the whole LIST page and every watch
//! restart: no object of the resource created after it was handled, and `/healthz` turned
//! 503. Now it is quarantined — logged, counted, skipped — and the others flow, also after a
//! restart, whose listing finds it again.

use std::time::Duration;

use capstan_tests::{
    process::Controller,
    scenario::{Scenario, annotation},
};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

fn handled(o: &Value) -> bool {
    annotation(o, "capstan.dev/last-handled-configuration").is_some()
}

/// A value nested `depth` levels deep.
fn nested(depth: usize) -> Value {
    let mut value = json!("bottom");
    for _ in 0..depth {
        value = json!({ "down": value });
    }
    value
}

/// The sum of `capstan_objects_quarantined_total` for the examples.
async fn quarantined(controller: &Controller) -> anyhow::Result<u64> {
    let (_, metrics) = controller.admin_get("/metrics").await?;
    Ok(metrics
        .lines()
        .filter(|l| l.starts_with("capstan_objects_quarantined_total{resource=\"examples\"}"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum())
}

async fn healthz(controller: &Controller) -> anyhow::Result<u16> {
    Ok(controller.admin_get("/healthz").await?.0)
}

#[tokio::test]
async fn a_deep_object_is_quarantined_and_the_others_flow_also_after_a_restart() -> anyhow::Result<()> {
    let mut s = Scenario::start("create", &[]).await?;
    for n in 0..3 {
        s.create(&format!("before-{n}"), json!({})).await?;
    }
    // kubectl, not the test's own client: the client's JSON parser has the same limit.
    let deep = json!({
        "apiVersion": "demo.capstan.dev/v1", "kind": "Example",
        "metadata": {"name": "deep", "namespace": s.namespace},
        "spec": {"nested": nested(200)},
    });
    let file = s.env.scratch().join("deep.json");
    std::fs::write(&file, serde_json::to_vec(&deep)?)?;
    s.env
        .kubectl_ok(&["create", "-f", &file.to_string_lossy()])
        .await?;
    for n in 0..3 {
        s.create(&format!("after-{n}"), json!({})).await?;
    }
    let names: Vec<String> = (0..3)
        .flat_map(|n| [format!("before-{n}"), format!("after-{n}")])
        .collect();
    for name in &names {
        s.wait(name, T, "handled", handled).await?;
    }
    assert!(
        quarantined(&s.controller).await? >= 1,
        "the deep object is counted"
    );
    assert_eq!(healthz(&s.controller).await?, 200);
    let log = s.controller.process.output();
    assert!(
        log.lines()
            .any(|l| l.contains("quarantined") && l.contains("deep")),
        "the deep object is logged by name"
    );

    // A restart lists the deep object again: quarantined again, and the others still flow.
    s.controller.process.terminate().await?;
    s.controller = Controller::start(&s.env, "capstan-again", &[]).await?;
    s.handler.terminate().await?;
    s.restart_handler().await?;
    s.create("later", json!({})).await?;
    s.wait("later", T, "handled", handled).await?;
    let deadline = tokio::time::Instant::now() + T;
    while quarantined(&s.controller).await? == 0 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the restarted controller's listing did not quarantine the deep object"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(healthz(&s.controller).await?, 200);
    for name in &names {
        assert_eq!(s.count("create_fn", name), 1, "{name} handled once");
    }
    assert_eq!(s.count("create_fn", "deep"), 0);
    Ok(())
}
