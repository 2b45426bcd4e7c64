//! End to end with the Python SDK's example operator (`sdk-python/examples/operator.py`, a
//! kopf operator file importing `capstan.kopf`), run by `python -m capstan run` with the
//! pinned grpcio and protobuf: the real API server, the real `capstan` binary and the Python
//! process, with the handlers' effects asserted on the objects — create, update and field
//! handlers with results and patches, sub-handlers (one retried on its own), a daemon that
//! follows its object's live body and stops on deletion, a timer, a retried temporary error, a
//! permanent error, deletion, the startup, probe and cleanup activities, and a clean stop on
//! SIGTERM. And the package as users get it: `pip install ./sdk-python` into a fresh venv runs
//! the example.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use capstan_tests::{
    process::{Controller, Process, python_operator, sdk_python},
    scenario::{Scenario, annotation, label},
    testenv::{TestEnv, repo_root},
};
use serde_json::{Value, json};
use tokio::{process::Command, time::Instant};

const T: Duration = Duration::from_secs(90);

/// Starts a testenv with the example CRD, `capstan run` and the Python operator connected.
async fn start() -> Result<Scenario> {
    let python = sdk_python().await?;
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let controller = Controller::start(&env, "capstan", &["--shutdown-grace", "5s"]).await?;
    let sdk = repo_root().join("sdk-python");
    let vars = HashMap::from([
        ("CAPSTAN_ENDPOINT".to_owned(), controller.endpoint()),
        ("PYTHONPATH".to_owned(), sdk.display().to_string()),
        ("PYTHONUNBUFFERED".to_owned(), "1".to_owned()),
    ]);
    let args = [
        "-m".to_owned(),
        "capstan".to_owned(),
        "run".to_owned(),
        "--verbose".to_owned(),
        sdk.join("examples/operator.py").display().to_string(),
    ];
    let operator = Process::spawn("python-operator", &python, &args, &vars, env.scratch())?;
    Scenario::with_operator(env, controller, operator, T).await
}

#[tokio::test]
async fn python_operator_handles_changes_subhandlers_a_daemon_a_timer_retries_and_errors() -> Result<()> {
    let mut s = start().await?;
    for handler in [
        "startup_fn",
        "cleanup_fn",
        "created",
        "create_fn",
        "update_fn",
        "field_fn/spec.field",
        "setup",
        "monitor",
        "tick",
        "delete_fn",
    ] {
        let line = format!("handler registered handler={handler}");
        assert!(
            s.handler.output().contains(&line),
            "{handler} was not accepted:\n{}",
            s.handler.output()
        );
    }
    s.handler.wait_for("example operator startup done", T).await?;

    // Create: a result in status, a label patch, the field handler on creation.
    s.create("one", json!({"field": "a"})).await?;
    let obj = s
        .wait("one", T, "create and field handlers done", |o| {
            label(o, "demo.capstan.dev/handled-by").is_some()
                && o.pointer("/status/create_fn/message").is_some()
                && annotation(o, "demo.capstan.dev/field").is_some()
        })
        .await?;
    assert_eq!(label(&obj, "demo.capstan.dev/handled-by"), Some("python"));
    assert_eq!(obj["status"]["create_fn"]["message"], "hello one from python");
    assert_eq!(obj["status"]["create_fn"]["retries"], 0);
    assert_eq!(annotation(&obj, "demo.capstan.dev/field"), Some("none->a"));

    // The probe's value is on the controller's liveness endpoint (refreshed periodically).
    let deadline = Instant::now() + T;
    loop {
        let (_, body) = s.controller.admin_get("/healthz").await?;
        let report: Value = serde_json::from_str(&body).unwrap_or_default();
        if report["probes"]["created"].as_u64() >= Some(1) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no Python probe result in /healthz: {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Update: the diff reaches the handler; the field handler sees old and new.
    s.patch("one", json!({"spec": {"field": "b"}})).await?;
    let obj = s
        .wait("one", T, "update and field handlers saw b", |o| {
            annotation(o, "demo.capstan.dev/field") == Some("a->b")
                && o.pointer("/status/update_fn/message").is_some()
        })
        .await?;
    assert_eq!(obj["status"]["update_fn"]["message"], "updated one from python");
    assert_eq!(obj["status"]["changed"], json!(["spec.field"]));

    // Sub-handlers, one retried on its own; a daemon that follows its object's live body; a
    // timer.
    s.create_with(
        "two",
        json!({"field": "a", "items": ["config", "slow-service"]}),
        json!({"annotations": {"demo.capstan.dev/watch": "yes"}}),
    )
    .await?;
    let obj = s
        .wait("two", T, "sub-handlers done and the timer ticked", |o| {
            annotation(o, "demo.capstan.dev/config").is_some()
                && annotation(o, "demo.capstan.dev/slow-service").is_some()
                && o.pointer("/status/ticks").is_some()
        })
        .await?;
    assert_eq!(
        annotation(&obj, "demo.capstan.dev/config"),
        Some("ready after 0 retries")
    );
    assert_eq!(
        annotation(&obj, "demo.capstan.dev/slow-service"),
        Some("ready after 1 retries")
    );
    s.handler.wait_for("monitor of two sees a", T).await?;
    s.patch("two", json!({"spec": {"field": "b"}})).await?;
    s.handler.wait_for("monitor of two sees b", T).await?;
    assert!(
        !s.handler.output().contains("monitor of two stopped"),
        "the daemon was restarted instead of following its object:\n{}",
        s.handler.output()
    );
    s.delete("two").await?;
    s.wait_gone("two", T).await?;
    s.handler
        .wait_for("monitor of two stopped: resource_deleted", T)
        .await?;

    // A temporary error is retried after its delay, with kopf's `retry` counting up.
    s.create("flaky", json!({"fail_times": 2})).await?;
    let obj = s
        .wait("flaky", T, "created after two temporary failures", |o| {
            o.pointer("/status/create_fn/message").is_some()
        })
        .await?;
    assert_eq!(obj["status"]["create_fn"]["retries"], 2);
    let log = s.controller.process.output();
    for attempt in 1..=2 {
        let message = format!("not ready yet (attempt {attempt} of 2 failing)");
        assert!(log.contains(&message), "no retry after {message:?}:\n{log}");
    }

    // A permanent error is not retried: the handler ran once and the object has no result.
    s.create("bad", json!({"reject": true})).await?;
    s.controller
        .process
        .wait_for("bad is rejected by its spec", T)
        .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let obj = s.get("bad").await?.context("bad disappeared")?;
    assert!(obj.pointer("/status/create_fn").is_none(), "{obj}");
    let failures = s.handler.output().matches("bad is rejected by its spec").count();
    assert_eq!(
        failures,
        1,
        "the permanent error was retried:\n{}",
        s.handler.output()
    );

    // Delete: the delete handler runs and the finalizer is released.
    s.delete("one").await?;
    s.wait_gone("one", T).await?;
    s.handler.wait_for("deleting one", T).await?;

    // The controller's shutdown runs the cleanup handler in the Python process.
    let status = s.controller.process.terminate().await?;
    assert!(status.success(), "the controller exited with {status}");
    s.handler.wait_for("example operator cleanup done", T).await?;

    // SIGTERM: a clean stop.
    let status = s.handler.terminate().await?;
    assert!(status.success(), "the Python operator exited with {status}");
    let output = s.handler.output();
    assert!(output.contains("capstan: stopped"), "no clean stop:\n{output}");
    assert!(
        !output.contains("Traceback"),
        "a traceback in the operator's log:\n{output}"
    );
    Ok(())
}

/// In the chart's pod the controller is a native sidecar: kubelet sends SIGTERM to the handler
/// container first and stops the controller only after it exited. The process's cleanup
/// handler must still run then — through the controller, which is still up — and the process
/// must wait for it before it closes its stream.
#[tokio::test]
async fn a_python_operator_stopped_before_the_controller_still_runs_its_cleanup_handler() -> Result<()> {
    let mut s = start().await?;
    s.create("one", json!({"field": "x"})).await?;
    s.wait("one", T, "created", |o| o.pointer("/status/create_fn").is_some())
        .await?;

    let status = s.handler.terminate().await?;
    let output = s.handler.output();
    assert!(
        status.success(),
        "the Python operator exited with {status}:\n{output}"
    );
    assert!(
        output.contains("example operator cleanup done"),
        "the cleanup handler did not run when the handler process stopped first:\n{output}"
    );
    assert!(
        output.contains("the controller ran this process's cleanup"),
        "the process did not wait for the controller's farewell:\n{output}"
    );
    assert!(
        !output.contains("Traceback"),
        "a traceback in the operator's log:\n{output}"
    );
    s.controller
        .process
        .wait_for("cleanup handler succeeded", T)
        .await?;

    // The controller's own stop does not run it again (nor wait for the process that left).
    let status = s.controller.process.terminate().await?;
    assert!(status.success(), "the controller exited with {status}");
    let log = s.controller.process.output();
    assert_eq!(
        log.matches("cleanup handler succeeded").count(),
        1,
        "the cleanup handler ran more than once:\n{log}"
    );
    Ok(())
}

#[tokio::test]
async fn python_operator_names_handlers_with_problems_and_exits_when_none_is_accepted() -> Result<()> {
    let python = sdk_python().await?;
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let controller = Controller::start(&env, "capstan", &[]).await?;
    let good = "@capstan.on.create('examples.demo.capstan.dev')\ndef good(**_):\n    pass\n\n";
    let unserved = "@capstan.on.create('nonexistents.demo.capstan.dev')\ndef unserved(**_):\n    pass\n";

    // A handler for a resource that is not served is accepted (watched once it appears, as
    // kopf does) and the controller's warning names it; the process runs.
    let mixed = env.scratch().join("mixed.py");
    std::fs::write(&mixed, format!("import capstan\n\n{good}{unserved}"))?;
    let mut first = python_operator(&python, &env, "mixed", &mixed, controller.endpoint())?;
    first.wait_for("connected to the controller", T).await?;
    let output = first.output();
    assert!(
        output.contains("handler registered handler=good")
            && output.contains("[WARNING ] capstan: handler unserved: "),
        "{output}"
    );
    assert!(first.running(), "the operator stopped:\n{output}");

    // A second process offering only the same handler id is refused (the id is taken), so
    // no handler of it is accepted: it retries for a while (the id could be held by a process
    // that just died), then exits with a clear error.
    let only_good = env.scratch().join("only_good.py");
    std::fs::write(&only_good, format!("import capstan\n\n{good}"))?;
    let mut second = python_operator(&python, &env, "only-good", &only_good, controller.endpoint())?;
    let deadline = Instant::now() + T;
    while second.running() {
        assert!(
            Instant::now() < deadline,
            "the second operator kept running:\n{}",
            second.output()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = second.terminate().await?;
    let output = second.output();
    assert_eq!(status.code(), Some(1), "{output}");
    assert!(
        output.contains("the controller accepted none of the handlers"),
        "{output}"
    );

    let status = first.terminate().await?;
    assert!(status.success(), "exited with {status}:\n{}", first.output());
    Ok(())
}

/// Copies the directory `from` to `to`, leaving out Python's byte-code caches.
fn copy_tree(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let name = entry.file_name();
        if name == "__pycache__" {
            continue;
        }
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &to.join(&name))?;
        } else {
            std::fs::copy(entry.path(), to.join(&name))?;
        }
    }
    Ok(())
}

/// Runs `program` with `args` and returns its standard output, or fails with its output.
async fn run(program: &Path, args: &[&str], what: &str) -> Result<String> {
    let output = Command::new(program)
        .args(args)
        .output()
        .await
        .with_context(|| format!("{what}: starting {}", program.display()))?;
    if !output.status.success() {
        bail!(
            "{what} failed ({}):\n{}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The package as its users get it: `pip install ./sdk-python` into a fresh venv (from the
/// registry, with the oldest grpcio and protobuf that pyproject.toml admits, the ones a Python
/// 3.9 machine may get), then `python -m capstan run examples/operator.py` from that venv
/// alone (no source tree on the path) against the real controller.
#[tokio::test]
async fn python_sdk_installed_with_pip_in_a_fresh_venv_runs_the_example() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    // A copy of the package, so the build leaves nothing in the source tree.
    let sdk = repo_root().join("sdk-python");
    let package = env.scratch().join("sdk-python");
    copy_tree(&sdk.join("capstan"), &package.join("capstan"))?;
    for file in ["pyproject.toml", "README.md"] {
        std::fs::copy(sdk.join(file), package.join(file))?;
    }
    let venv = env.scratch().join("fresh-venv");
    let python3 = PathBuf::from(std::env::var("PYTHON").unwrap_or_else(|_| "python3".into()));
    let venv_arg = venv.display().to_string();
    run(&python3, &["-m", "venv", &venv_arg], "python3 -m venv").await?;
    let python = venv.join("bin/python");
    let package_arg = package.display().to_string();
    run(
        &python,
        &[
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            &package_arg,
            "grpcio==1.80.1",
            "protobuf==6.31.1",
            "pyyaml==6.0.1",
        ],
        "pip install ./sdk-python (PyPI must be reachable)",
    )
    .await?;
    let imported = run(
        &python,
        &[
            "-c",
            "import capstan, google.protobuf; print(capstan.__file__, google.protobuf.__version__)",
        ],
        "import capstan",
    )
    .await?;
    assert!(
        imported.contains(&venv_arg) && imported.trim_end().ends_with(" 6.31.1"),
        "capstan is not the installed package, or protobuf is not the oldest: {imported}"
    );

    let controller = Controller::start(&env, "capstan", &[]).await?;
    let vars = HashMap::from([
        ("CAPSTAN_ENDPOINT".to_owned(), controller.endpoint()),
        ("PYTHONUNBUFFERED".to_owned(), "1".to_owned()),
    ]);
    let args = [
        "-m".to_owned(),
        "capstan".to_owned(),
        "run".to_owned(),
        sdk.join("examples/operator.py").display().to_string(),
    ];
    let operator = Process::spawn("installed-operator", &python, &args, &vars, env.scratch())?;
    let mut s = Scenario::with_operator(env, controller, operator, T).await?;
    s.create("one", json!({"field": "a"})).await?;
    let obj = s
        // The object and its status are two writes of the same cycle: wait for both.
        .wait("one", T, "the create handler answered", |o| {
            o.pointer("/status/create_fn/message").is_some()
                && label(o, "demo.capstan.dev/handled-by").is_some()
        })
        .await?;
    assert_eq!(obj["status"]["create_fn"]["message"], "hello one from python");
    assert_eq!(label(&obj, "demo.capstan.dev/handled-by"), Some("python"));
    let status = s.handler.terminate().await?;
    let output = s.handler.output();
    assert!(
        status.success(),
        "the installed operator exited with {status}:\n{output}"
    );
    assert!(
        !output.contains("Traceback"),
        "a traceback in the operator's log:\n{output}"
    );
    Ok(())
}
