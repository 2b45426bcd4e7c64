//! End to end with the TypeScript SDK's demo operator (`sdk-typescript/examples/operator.ts`),
//! run by Node: the real API server, the real `capstan` binary and the Node process, with the
//! handlers' effects asserted on the object — a creation handled with its result and label, a
//! temporary error retried until it succeeds, a field and an update handler, a timer writing
//! the status, and the deletion.

use std::{collections::HashMap, io::ErrorKind, path::PathBuf, time::Duration};

use anyhow::{Context as _, Result, bail};
use capstan_tests::{
    process::{Controller, Process},
    scenario::{Scenario, label},
    testenv::{TestEnv, repo_root},
};
use serde_json::json;
use tokio::process::Command;

const T: Duration = Duration::from_secs(60);

/// Builds the SDK with its pinned dependencies (`scripts/build.sh`, idempotent) and returns the
/// demo operator's entry.
async fn build_typescript_operator() -> Result<PathBuf> {
    let sdk = repo_root().join("sdk-typescript");
    let output = Command::new("bash")
        .arg("scripts/build.sh")
        .current_dir(&sdk)
        .output()
        .await;
    let output = match output {
        Err(error) if error.kind() == ErrorKind::NotFound => bail!("`bash` is not on PATH"),
        other => other.context("running sdk-typescript/scripts/build.sh")?,
    };
    if !output.status.success() {
        bail!(
            "sdk-typescript/scripts/build.sh failed ({}); it needs Node 20 and npm:\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(sdk.join("dist/examples/operator.js"))
}

#[tokio::test]
async fn typescript_operator_handles_a_creation_a_retry_an_update_a_timer_and_a_deletion() -> Result<()> {
    let entry = build_typescript_operator().await?;
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let controller = Controller::start(&env, "capstan", &["--shutdown-grace", "5s"]).await?;
    let vars = HashMap::from([("CAPSTAN_ENDPOINT".to_owned(), controller.endpoint())]);
    let node = PathBuf::from("node");
    let operator = Process::spawn(
        "typescript-operator",
        &node,
        &[entry.display().to_string()],
        &vars,
        env.scratch(),
    )?;
    let s = Scenario::with_operator(env, controller, operator, T).await?;

    // The creation handler labels the object and stores its result; the flaky one fails once
    // (a temporary error with a delay of 1 s) and succeeds on its second attempt.
    s.create("one", json!({"field": "a", "fail_times": 1})).await?;
    let obj = s
        .wait("one", T, "create_fn and flaky_fn done", |o| {
            label(o, "demo.capstan.dev/handled").is_some()
                && o.pointer("/status/create_fn/message").is_some()
                && o.pointer("/status/flaky_fn/attempts").is_some()
        })
        .await?;
    assert_eq!(label(&obj, "demo.capstan.dev/handled"), Some("yes"));
    assert_eq!(obj["status"]["create_fn"]["message"], "hello one");
    assert_eq!(obj["status"]["flaky_fn"]["attempts"], 2);
    assert!(
        s.controller
            .process
            .output()
            .contains("failing on purpose (1 of 1)"),
        "the temporary error is not in the controller's log:\n{}",
        s.controller.process.output()
    );

    // An update: the update handler's result, and the field handler's log record.
    s.patch("one", json!({"spec": {"field": "b"}})).await?;
    s.wait("one", T, "update_fn done", |o| {
        o.pointer("/status/update_fn/message").and_then(|m| m.as_str()) == Some("updated")
    })
    .await?;
    let deadline = tokio::time::Instant::now() + T;
    while !s
        .controller
        .process
        .output()
        .contains(r#"spec.field changed: \"a\" -> \"b\""#)
        && !s
            .controller
            .process
            .output()
            .contains(r#"spec.field changed: "a" -> "b""#)
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the field handler's record is not in the controller's log:\n{}",
            s.controller.process.output()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The timer (every 10 s) counts its ticks in the status.
    s.wait("one", Duration::from_secs(45), "a timer tick", |o| {
        o.pointer("/status/ticks").and_then(|t| t.as_u64()) >= Some(1)
    })
    .await?;

    // The deletion runs the delete handler, and the finalizer goes.
    s.delete("one").await?;
    s.wait_gone("one", T).await?;
    Ok(())
}
