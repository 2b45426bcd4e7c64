//! End to end, against a real API server, the real `capstan` binary and a real SDK handler
//! process: the compact diff-base (`--diff-base fields`, the default) keeps only the fields
//! that handlers watch, gives field handlers the same `old` and `new` as the whole essence,
//! reads the whole essence that earlier versions stored without a spurious handler call, and
//! `--diff-base full` keeps the whole essence.

use std::time::Duration;

use anyhow::{Result, ensure};
use capstan_tests::{
    process::capstan_binary,
    scenario::{Scenario, annotation, tail},
    testenv::TestEnv,
};
use kube::api::PostParams;
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(30);
const DIFFBASE: &str = "capstan.dev/last-handled-configuration";

/// A spec of about 1 KiB, as the benchmark's objects have.
fn spec(field: &str) -> Value {
    json!({"field": field, "size": 1, "payload": "x".repeat(1000)})
}

/// Polls until the controller's writes to `name` in the audit log are `expected` in number
/// (the log is written as requests complete); returns them.
async fn writes(s: &Scenario, name: &str, expected: usize) -> Result<Vec<String>> {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let writes = s.writes(name);
        if writes.len() >= expected || tokio::time::Instant::now() > deadline {
            return Ok(writes);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn a_create_and_field_operator_stores_only_the_watched_field() -> Result<()> {
    let s = Scenario::start("create,field", &[]).await?;
    s.create("one", spec("a")).await?;
    let obj = s
        .wait("one", T, "created", |o| {
            annotation(o, DIFFBASE).is_some() && annotation(o, "e2e/field") == Some("none->a")
        })
        .await?;
    let stored = annotation(&obj, DIFFBASE).unwrap_or_default();
    assert_eq!(stored, "[1,{\"spec.field\":\"a\"}]\n");
    assert!(stored.len() < 40, "{} bytes", stored.len());
    let created = writes(&s, "one", 1).await?;

    // The watched field changes: the field handler gets its old and new values.
    s.patch("one", json!({"spec": {"field": "b"}})).await?;
    s.wait("one", T, "the field change handled", |o| {
        annotation(o, "e2e/field") == Some("a->b")
            && annotation(o, DIFFBASE) == Some("[1,{\"spec.field\":\"b\"}]\n")
    })
    .await?;
    let after_field = writes(&s, "one", created.len() + 1).await?;
    assert_eq!(after_field.len(), created.len() + 1, "{after_field:?}");

    // Fields that no handler watches change: nothing is called, nothing is written. The
    // object's events are processed in order, so once the next change of the watched field
    // is handled, these were too.
    s.patch("one", json!({"spec": {"size": 2, "payload": "y".repeat(1000)}}))
        .await?;
    s.patch("one", json!({"metadata": {"labels": {"unwatched": "yes"}}}))
        .await?;
    // A quiet while, in which the controller has these events (and writes nothing).
    let quiet = tokio::time::Instant::now() + Duration::from_secs(3);
    while tokio::time::Instant::now() < quiet {
        ensure!(s.writes("one") == after_field, "written: {:?}", s.writes("one"));
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    s.patch("one", json!({"spec": {"field": "c"}})).await?;
    s.wait("one", T, "the next field change handled", |o| {
        annotation(o, "e2e/field") == Some("b->c")
    })
    .await?;
    let after = writes(&s, "one", after_field.len() + 1).await?;
    assert_eq!(
        after.len(),
        after_field.len() + 1,
        "only the field change was written: {after:?}"
    );
    assert_eq!(s.count("create_fn", "one"), 1);
    assert_eq!(s.count("field_fn/spec.field", "one"), 3, "{:?}", s.calls());
    Ok(())
}

#[tokio::test]
async fn an_essence_stored_by_an_earlier_version_is_replaced_without_a_spurious_call() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let client = env.client().await?;
    let examples = capstan_tests::testenv::examples(&client, "default");
    // Handled by an earlier version, which stored the whole essence; fields no handler watches
    // changed since (while no controller ran).
    let earlier = json!({"spec": spec("a")}).to_string() + "\n";
    let mut now = spec("a");
    now["size"] = json!(5);
    now["payload"] = json!("z".repeat(1000));
    let object: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "demo.capstan.dev/v1", "kind": "Example",
        "metadata": {"name": "old", "namespace": "default",
                     "annotations": {DIFFBASE: earlier, "capstan.dev/kopf-managed": "yes"}},
        "spec": now,
    }))?;
    examples.create(&PostParams::default(), &object).await?;
    let kubeconfig = env.kubeconfig.clone();
    let s = Scenario::attach(env, &kubeconfig, "create,field", &[], "default").await?;

    // The essence is out of date in fields no handler watches: it is replaced by the compact
    // form at once, with no handler call (an earlier version wrote the same changes too).
    s.wait("old", T, "the out-of-date essence replaced", |o| {
        annotation(o, DIFFBASE) == Some("[1,{\"spec.field\":\"a\"}]\n")
    })
    .await?;
    assert!(s.calls().is_empty(), "{:?}", s.calls());
    // Another change of an unwatched field (nothing), then one of the watched field: the
    // field handler gets the old value, and only that change is written.
    s.patch("old", json!({"spec": {"size": 6}})).await?;
    s.patch("old", json!({"spec": {"field": "b"}})).await?;
    let obj = s
        .wait("old", T, "the field change handled", |o| {
            annotation(o, "e2e/field").is_some()
        })
        .await?;
    assert_eq!(annotation(&obj, "e2e/field"), Some("a->b"));
    let converted = s
        .wait("old", T, "the compact format written", |o| {
            annotation(o, DIFFBASE) == Some("[1,{\"spec.field\":\"b\"}]\n")
        })
        .await?;
    assert_eq!(converted["spec"]["size"], 6);
    assert_eq!(
        s.count("create_fn", "old"),
        0,
        "not created again: {:?}",
        s.calls()
    );
    assert_eq!(
        s.count("field_fn/spec.field", "old"),
        1,
        "only the watched change: {:?}",
        s.calls()
    );
    let written = writes(&s, "old", 2).await?;
    assert_eq!(
        written,
        ["patch", "patch"],
        "the replacement and the field change"
    );
    Ok(())
}

#[tokio::test]
async fn diff_base_full_stores_the_whole_essence() -> Result<()> {
    let s = Scenario::start("create,field", &["--diff-base", "full"]).await?;
    s.create("whole", spec("a")).await?;
    let obj = s
        .wait("whole", T, "created", |o| annotation(o, DIFFBASE).is_some())
        .await?;
    let stored: Value = serde_json::from_str(annotation(&obj, DIFFBASE).unwrap_or_default())?;
    assert!(stored["spec"] == spec("a"), "the whole spec is stored");
    assert_eq!(
        stored["metadata"]["annotations"]["e2e/field"], "none->a",
        "with the handler's own patch"
    );
    // Every change is an update cause again (kopf's behaviour); the field handler sees the
    // same as with the compact diff-base.
    s.patch("whole", json!({"spec": {"size": 2}})).await?;
    s.wait("whole", T, "the unwatched change stored", |o| {
        annotation(o, DIFFBASE).is_some_and(|d| d.contains("\"size\":2"))
    })
    .await?;
    s.patch("whole", json!({"spec": {"field": "b"}})).await?;
    s.wait("whole", T, "the field change handled", |o| {
        annotation(o, "e2e/field") == Some("a->b")
    })
    .await?;
    assert_eq!(s.count("field_fn/spec.field", "whole"), 2);
    Ok(())
}

#[tokio::test]
async fn kopf_persistence_refuses_the_compact_diff_base() -> Result<()> {
    let out = tokio::process::Command::new(capstan_binary().await?)
        .args(["run", "--persistence", "kopf", "--diff-base", "fields"])
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    ensure!(
        out.status.code() == Some(64) && stderr.contains("--diff-base fields"),
        "status {:?}: {}",
        out.status,
        tail(&stderr, 5)
    );
    Ok(())
}
