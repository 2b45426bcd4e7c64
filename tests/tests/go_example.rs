//! End to end with the Go example operator (`sdk-go-example/cmd/example-operator`), a handler
//! process written with the Go SDK: the real API server, the real `capstan` binary and the Go
//! process, with the handlers' effects asserted on the objects — change handlers with results,
//! a retried temporary error, sub-handlers (one retried on its own), a daemon that follows its
//! object's live body and writes progress while it runs, a timer, and the startup, probe and
//! cleanup activities.

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
use serde_json::{Value, json};
use tokio::{process::Command, time::Instant};

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
    let binary = build_go_operator(env.scratch()).await?;
    let controller = Controller::start(&env, "capstan", &["--shutdown-grace", "5s"]).await?;
    let vars = HashMap::from([("CAPSTAN_ENDPOINT".to_owned(), controller.endpoint())]);
    let operator = Process::spawn("go-operator", &binary, &[], &vars, env.scratch())?;
    Scenario::with_operator(env, controller, operator, T).await
}

#[tokio::test]
async fn go_operator_handles_changes_subhandlers_a_live_daemon_a_timer_and_activities() -> Result<()> {
    let mut s = start().await?;

    // Every registration is accepted in the welcome, and the operator logs each (the last one
    // logged is the timer).
    s.handler.wait_for("handler=tick ", T).await?;
    for handler in [
        "startup_fn",
        "cleanup_fn",
        "probe_fn",
        "create_fn",
        "setup",
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
    s.handler.wait_for("example operator startup done", T).await?;

    s.create("one", json!({"field": "a"})).await?;
    let obj = s
        .wait("one", T, "create, field, sub- and daemon handlers done", |o| {
            label(o, "demo.capstan.dev/handled-by").is_some()
                && annotation(o, "demo.capstan.dev/field").is_some()
                && o.pointer("/status/create_fn/message").is_some()
                && annotation(o, "demo.capstan.dev/service").is_some()
                && annotation(o, "demo.capstan.dev/monitored") == Some("a")
        })
        .await?;
    assert_eq!(label(&obj, "demo.capstan.dev/handled-by"), Some("go"));
    assert_eq!(obj["status"]["create_fn"]["message"], "hello one from go");
    // The Go handler continues the controller's trace: its log line and the controller's log
    // of the record it sent back carry the same trace id.
    let go_trace = trace_id_after(&s.handler.output(), r#"msg="created one""#, "trace_id=");
    let controller_trace = trace_id_after(&s.controller.process.output(), "created one", "trace.id=");
    assert!(
        go_trace.is_some() && go_trace == controller_trace,
        "trace ids: go {go_trace:?}, controller {controller_trace:?}"
    );
    assert_eq!(
        annotation(&obj, "demo.capstan.dev/field"),
        Some("none->a"),
        "field handlers fire on creation"
    );
    assert_eq!(annotation(&obj, "demo.capstan.dev/config"), Some("ready"));
    assert_eq!(
        annotation(&obj, "demo.capstan.dev/service"),
        Some("ready after 0 retries")
    );

    // The probe's result is on the controller's liveness endpoint (refreshed periodically, so
    // it counts the creation once a probe ran after it).
    let deadline = Instant::now() + T;
    loop {
        let (_, body) = s.controller.admin_get("/healthz").await?;
        let report: Value = serde_json::from_str(&body).unwrap_or_default();
        let probe = &report["probes"]["probe_fn"];
        if probe["language"] == "go" && probe["created"].as_u64() >= Some(1) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no Go probe result in /healthz: {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // The running daemon sees the new body (it is not restarted) and writes what it sees.
    s.patch("one", json!({"spec": {"field": "b"}})).await?;
    let obj = s
        .wait("one", T, "update, field and daemon handlers saw b", |o| {
            annotation(o, "demo.capstan.dev/field") == Some("a->b")
                && o.pointer("/status/update_fn/message").is_some()
                && annotation(o, "demo.capstan.dev/monitored") == Some("b")
        })
        .await?;
    assert_eq!(obj["status"]["update_fn"]["message"], "updated one from go");
    assert_eq!(obj["status"]["create_fn"]["message"], "hello one from go");
    assert!(
        !s.handler.output().contains("monitor stopped"),
        "the daemon was restarted instead of following its object:\n{}",
        s.handler.output()
    );

    let obj = s
        .wait("one", T, "the timer ticked", |o| {
            o.pointer("/status/ticks").is_some()
        })
        .await?;
    assert!(obj["status"]["ticks"].as_u64() >= Some(1), "{obj}");

    // A temporary error is retried after its delay, and the retry count reaches the handler;
    // a failing sub-handler is retried on its own.
    s.create("flaky", json!({"fail_times": 2, "fail_service": true}))
        .await?;
    let obj = s
        .wait("flaky", T, "created after two temporary failures", |o| {
            o.pointer("/status/create_fn/message").is_some()
                && annotation(o, "demo.capstan.dev/service").is_some()
        })
        .await?;
    assert_eq!(obj["status"]["create_fn"]["message"], "hello flaky from go");
    assert_eq!(
        annotation(&obj, "demo.capstan.dev/service"),
        Some("ready after 1 retries")
    );
    assert_eq!(annotation(&obj, "demo.capstan.dev/config"), Some("ready"));
    let log = s.controller.process.output();
    for attempt in 1..=2 {
        let message = format!("not ready yet (attempt {attempt} of 2 failing)");
        assert!(log.contains(&message), "no retry after {message:?}:\n{log}");
    }

    s.delete("one").await?;
    s.wait_gone("one", T).await?;
    s.handler.wait_for("deleting one", T).await?;
    s.handler
        .wait_for(r#"msg="monitor stopped" object=one reason=resource_deleted"#, T)
        .await?;

    // The controller's shutdown runs the cleanup handler in the Go process.
    let status = s.controller.process.terminate().await?;
    assert!(status.success(), "the controller exited with {status}");
    s.handler.wait_for("example operator cleanup done", T).await?;

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

/// The 32 hex digits after `field` on the first line of `log` that contains `needle`.
fn trace_id_after(log: &str, needle: &str, field: &str) -> Option<String> {
    let line = log.lines().find(|l| l.contains(needle) && l.contains(field))?;
    let at = line.find(field)? + field.len();
    let id = line.get(at..at + 32)?;
    id.bytes().all(|b| b.is_ascii_hexdigit()).then(|| id.to_owned())
}

/// Whether the controller accepted the Go operator's registration of `handler`.
fn accepted(s: &Scenario, handler: &str) -> bool {
    let line = format!("handler={handler} ");
    s.handler
        .output()
        .lines()
        .any(|l| l.contains("handler registered") && l.contains(&line))
}

/// The Go SDK's admission handlers (`OnValidate`, `OnMutate`) behind the controller's webhook
/// server, called by the real API server.
#[tokio::test]
async fn go_operator_validates_and_mutates_admission_requests() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let binary = build_go_operator(env.scratch()).await?;
    let listen = format!("127.0.0.1:{}", capstan_tests::process::free_port()?);
    let controller = Controller::start(
        &env,
        "capstan",
        &["--webhook-listen", &listen, "--webhook-managed", "go-example"],
    )
    .await?;
    let vars = HashMap::from([
        ("CAPSTAN_ENDPOINT".to_owned(), controller.endpoint()),
        ("CAPSTAN_EXAMPLE_WEBHOOKS".to_owned(), "true".to_owned()),
    ]);
    let operator = Process::spawn("go-operator", &binary, &[], &vars, env.scratch())?;
    let s = Scenario::with_operator(env, controller, operator, T).await?;
    let deadline = Instant::now() + T;
    let message = loop {
        match s.create("huge", json!({"size": 500})).await {
            Err(e) if e.to_string().contains("above 100") => break e.to_string(),
            other => {
                if Instant::now() > deadline {
                    bail!("the Go validating handler was not called: {other:?}");
                }
                if other.is_ok() {
                    s.delete("huge").await?;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert!(message.contains("spec.size 500 is above 100"), "{message}");
    // The API server picks up the mutating configuration on its own schedule, which may be
    // after the validating one: until then objects are stored unchanged.
    let stored = loop {
        let stored = s.create("defaulted", json!({"field": "x"})).await?;
        if stored.pointer("/spec/size").is_some() || Instant::now() > deadline {
            break stored;
        }
        s.delete("defaulted").await?;
        s.wait_gone("defaulted", T).await?;
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(stored.pointer("/spec/size"), Some(&json!(1)), "{stored}");
    assert_eq!(label(&stored, "demo.capstan.dev/admitted-by"), Some("go"));
    Ok(())
}
