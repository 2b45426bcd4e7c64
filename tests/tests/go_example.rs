//! End to end with the Go example operator (`sdk-go-example/cmd/example-operator`), a handler
//! process written in Go from `proto/` alone: the real API server, the real `capstan` binary
//! and the Go process, with the handlers' effects (including a retried temporary error)
//! asserted on the objects.

use std::{
    collections::HashMap,
    io::ErrorKind,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use capstan_tests::{
    process::{Controller, Process},
    scenario::{Scenario, annotation, label},
    testenv::{TestEnv, repo_root},
};
use serde_json::json;
use tokio::process::Command;

const T: Duration = Duration::from_secs(60);

/// Builds the Go example operator into `dir` with the local Go toolchain.
async fn build_go_operator(dir: &Path) -> Result<PathBuf> {
    let binary = dir.join("example-operator");
    let module = repo_root().join("sdk-go-example");
    let output = Command::new("go")
        .arg("build")
        .arg("-o")
        .arg(&binary)
        .arg("./cmd/example-operator")
        .current_dir(&module)
        .env("GOTOOLCHAIN", "local")
        .output()
        .await;
    let output = match output {
        Err(error) if error.kind() == ErrorKind::NotFound => {
            bail!(
                "`go` is not on PATH: the Go example operator test needs a Go toolchain (see sdk-go-example/README.md)"
            )
        }
        other => other.context("running go build for sdk-go-example")?,
    };
    if !output.status.success() {
        bail!(
            "go build ./cmd/example-operator in {} failed ({}):\n{}",
            module.display(),
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(binary)
}

/// Starts a testenv with the example CRD, `capstan run` and the Go operator connected to it.
async fn start() -> Result<Scenario> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let client = env.client().await?;
    let binary = build_go_operator(env.scratch()).await?;
    let mut controller = Controller::start(&env, "capstan", &[]).await?;
    let vars = HashMap::from([("CAPSTAN_ENDPOINT".to_owned(), controller.endpoint())]);
    let mut operator = Process::spawn("go-operator", &binary, &[], &vars, env.scratch())?;
    controller
        .process
        .wait_for("handler process connected", T)
        .await?;
    operator
        .wait_for("capstan: connected to the controller", T)
        .await?;
    let calls = env.scratch().join("calls.log");
    Ok(Scenario {
        env,
        client,
        controller,
        handler: operator,
        calls,
        presets: String::new(),
        namespace: "default".into(),
    })
}

#[tokio::test]
async fn go_operator_handles_create_update_field_and_delete() -> Result<()> {
    let mut s = start().await?;

    // Every registration is accepted in the welcome, and the operator logs each.
    for handler in [
        "create_fn",
        "update_fn",
        "field_fn/spec.field",
        "delete_fn",
        "monitor",
        "tick",
    ] {
        assert!(
            accepted(&s, handler),
            "{handler} was not accepted:\n{}",
            s.handler.output()
        );
    }

    s.create("one", json!({"field": "a"})).await?;
    let obj = s
        .wait("one", T, "create and field handlers done", |o| {
            label(o, "demo.capstan.dev/handled-by").is_some()
                && annotation(o, "demo.capstan.dev/field").is_some()
                && o.pointer("/status/create_fn/message").is_some()
        })
        .await?;
    assert_eq!(label(&obj, "demo.capstan.dev/handled-by"), Some("go"));
    assert_eq!(obj["status"]["create_fn"]["message"], "hello one from go");
    assert_eq!(
        annotation(&obj, "demo.capstan.dev/field"),
        Some("none->a"),
        "field handlers fire on creation"
    );

    s.patch("one", json!({"spec": {"field": "b"}})).await?;
    let obj = s
        .wait("one", T, "update and field handlers done", |o| {
            annotation(o, "demo.capstan.dev/field") == Some("a->b")
                && o.pointer("/status/update_fn/message").is_some()
        })
        .await?;
    assert_eq!(obj["status"]["update_fn"]["message"], "updated one from go");
    assert_eq!(obj["status"]["create_fn"]["message"], "hello one from go");

    let obj = s
        .wait("one", T, "the timer ticked", |o| {
            o.pointer("/status/ticks").is_some()
        })
        .await?;
    assert!(obj["status"]["ticks"].as_u64() >= Some(1), "{obj}");

    // A temporary error is retried after its delay, and the retry count reaches the handler.
    s.create("flaky", json!({"fail_times": 2})).await?;
    let obj = s
        .wait("flaky", T, "created after two temporary failures", |o| {
            o.pointer("/status/create_fn/message").is_some()
        })
        .await?;
    assert_eq!(obj["status"]["create_fn"]["message"], "hello flaky from go");
    let log = s.controller.process.output();
    for attempt in 1..=2 {
        let message = format!("not ready yet (attempt {attempt} of 2 failing)");
        assert!(log.contains(&message), "no retry after {message:?}:\n{log}");
    }

    s.delete("one").await?;
    s.wait_gone("one", T).await?;
    s.handler.wait_for("deleting one", T).await?;
    s.handler.wait_for("monitor stopped", T).await?;

    let status = s.handler.terminate().await?;
    assert!(status.success(), "the Go operator exited with {status}");
    let output = s.handler.output();
    assert!(
        output.contains("example operator stopped"),
        "no clean stop:\n{output}"
    );
    assert!(
        !output.contains("handler panicked"),
        "a handler panicked:\n{output}"
    );
    Ok(())
}

/// Whether the controller accepted the Go operator's registration of `handler`.
fn accepted(s: &Scenario, handler: &str) -> bool {
    let line = format!("handler={handler} ");
    s.handler
        .output()
        .lines()
        .any(|l| l.contains("handler registered") && l.contains(&line))
}
