//! kopf's test kit on Capstan, end to end: a test written as kopf's own example tests are —
//! `KopfRunner(['run', '-A', '--standalone', '--verbose', 'example.py'])` around the object's
//! changes, then `exit_code`, `exception` and `output` checked — with only the import changed
//! (`capstan.kopf.testing`). The runner starts the real `capstan` binary itself
//! (`$CAPSTAN_BINARY`) against the real API server's kubeconfig, the operator file configures
//! itself in a startup handler with kopf's `settings`, and its create handler's and daemon's
//! effects are asserted on the object (the daemon's patches of failed attempts applied, as
//! kopf applies them).

use std::{collections::HashMap, time::Duration};

use anyhow::{Context as _, Result, bail};
use capstan_tests::{
    process::{Process, capstan_binary, sdk_python},
    testenv::{TestEnv, create_example, examples, repo_root},
};
use serde_json::json;

const T: Duration = Duration::from_secs(90);

/// A kopf operator file; only its import is Capstan's.
const OPERATOR: &str = r#"
import logging
import os
import capstan.kopf as kopf

@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_):
    settings.posting.level = logging.WARNING
    settings.persistence.finalizer = "demo.capstan.dev/finalizer"

@kopf.on.create("demo.capstan.dev", "v1", "examples")
def create_fn(spec: kopf.Spec, name, logger: kopf.Logger, patch: kopf.Patch, **_):
    logger.info(f"And here we are! Creating {name} with {spec.get('field')}")
    patch.status["created_by"] = "kopf-runner"
    open(os.environ["DONE_FILE"], "w").write(name)

@kopf.daemon("demo.capstan.dev", "v1", "examples")
def monitor(memo: kopf.Memo, patch: kopf.Patch, stopped, **_):
    # kopf applies a daemon's patch after a failed attempt too.
    memo.attempts = memo.get("attempts", 0) + 1
    if memo.attempts < 3:
        patch.status["monitor"] = f"Failed {memo.attempts} times"
        raise kopf.TemporaryError("not yet", delay=0.2)
    open(os.environ["DONE_FILE"] + ".daemon", "w").write("done")
    stopped.wait()
"#;

/// kopf's example test, with `capstan.kopf.testing` for `kopf.testing`. Prints to the real
/// stdout: inside the block, the runner captures `sys.stdout` as kopf's does.
const TEST: &str = r#"
import os, sys, time
from capstan.kopf.testing import KopfRunner

import capstan.kopf as kopf

done = os.environ["DONE_FILE"]
settings = kopf.OperatorSettings()
settings.watching.server_timeout = 10  # as kopf's example tests do
with KopfRunner(["run", "-A", "--standalone", "--verbose", os.environ["OPERATOR_FILE"]], timeout=60,
                settings=settings) as runner:
    print("runner started", file=sys.__stdout__, flush=True)
    deadline = time.monotonic() + 60
    while not (os.path.exists(done) and os.path.exists(done + ".daemon")) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1)  # the result's write
print("output:", runner.output, file=sys.__stdout__)
print("controller:", runner.controller_output, file=sys.__stdout__)
assert runner.exit_code == 0, runner.exit_code
assert runner.exception is None, runner.exception
# kopf's example test's checks: the object before the message, kopf's own lines.
assert "[default/kopf-runner] And here we are! Creating kopf-runner with x" in runner.output
assert "[default/kopf-runner] Creation is in progress:" in runner.output
assert "[default/kopf-runner] Handler 'create_fn' succeeded." in runner.output
assert "--finalizer demo.capstan.dev/finalizer" not in runner.output, "a setting sent to the controller was named as a flag"
assert runner.controller is not None and "capstan started" in runner.controller_output
assert "settings given as the controller's flags: --watch-server-timeout 10s" in runner.output
print("KOPF RUNNER OK", file=sys.__stdout__, flush=True)
"#;

#[tokio::test]
async fn kopf_runner_starts_the_controller_and_runs_a_kopf_operator_file() -> Result<()> {
    let python = sdk_python().await?;
    let capstan = capstan_binary().await?;
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let operator = env.scratch().join("example.py");
    std::fs::write(&operator, OPERATOR)?;
    let test = env.scratch().join("test_example.py");
    std::fs::write(&test, TEST)?;
    let done = env.scratch().join("done");
    let vars = HashMap::from([
        ("CAPSTAN_BINARY".to_owned(), capstan.display().to_string()),
        ("KUBECONFIG".to_owned(), env.kubeconfig.display().to_string()),
        (
            "PYTHONPATH".to_owned(),
            repo_root().join("sdk-python").display().to_string(),
        ),
        ("PYTHONUNBUFFERED".to_owned(), "1".to_owned()),
        ("OPERATOR_FILE".to_owned(), operator.display().to_string()),
        ("DONE_FILE".to_owned(), done.display().to_string()),
    ]);
    let mut process = Process::spawn(
        "kopf-runner-test",
        &python,
        &[test.display().to_string()],
        &vars,
        env.scratch(),
    )?;
    process.wait_for("runner started", T).await?;
    create_example(&env, "kopf-runner", json!({"field": "x"})).await?;
    process
        .wait_for("KOPF RUNNER OK", T)
        .await
        .context("the kopf-style test did not pass")?;
    let api = examples(&env.client().await?, "default");
    let object = api.get("kopf-runner").await?;
    let status = object.data.get("status").cloned().unwrap_or_default();
    if status.get("created_by") != Some(&json!("kopf-runner")) {
        bail!("the create handler's patch is missing: {:?}", object.data);
    }
    // The two failed attempts' patches were written (the third attempt patches nothing).
    if status.get("monitor") != Some(&json!("Failed 2 times")) {
        bail!("the daemon's patches are missing: {:?}", object.data);
    }
    // The startup handler's `settings.persistence.finalizer`, applied by the controller.
    if object.metadata.finalizers.as_deref() != Some(&["demo.capstan.dev/finalizer".to_owned()][..]) {
        bail!(
            "the settings' finalizer is not the object's: {:?}",
            object.metadata
        );
    }
    Ok(())
}

/// A parent handler and its sub-handlers, one of which fails twice before it succeeds; run
/// by real kopf (with `import kopf`) and by Capstan (with `import capstan.kopf as kopf`).
const SUBHANDLERS: &str = r#"
import os

def record(name, what):
    with open(os.environ["CALLS_FILE"], "a") as f:
        f.write(f"{name} {what}\n")

@kopf.on.create("demo.capstan.dev", "v1", "examples")
def parent(name, retry, **_):
    record(name, f"parent {retry}")

    @kopf.subhandler(id="flaky")
    def flaky(retry, **_):
        record(name, f"flaky {retry}")
        if retry < 2:
            raise kopf.TemporaryError("not yet", delay=0.2)

    @kopf.subhandler(id="steady")
    def steady(retry, **_):
        record(name, f"steady {retry}")
"#;

/// Runs the sub-handlers' operator under the runner until the flaky sub-handler succeeded.
const SUBHANDLERS_TEST: &str = r#"
import os, sys, time
from capstan.kopf.testing import KopfRunner

calls = os.environ["CALLS_FILE"]
with KopfRunner(["run", "-A", "--standalone", os.environ["OPERATOR_FILE"]], timeout=60) as runner:
    print("runner started", file=sys.__stdout__, flush=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if os.path.exists(calls) and "flaky 2" in open(calls).read():
            break
        time.sleep(0.1)
    time.sleep(1)
print("controller:", runner.controller_output, file=sys.__stdout__)
print("SUBHANDLERS DONE", file=sys.__stdout__, flush=True)
"#;

/// The calls recorded for the object `name`, in order.
fn calls_of(file: &std::path::Path, name: &str) -> Vec<String> {
    std::fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.strip_prefix(&format!("{name} ")).map(str::to_owned))
        .collect()
}

async fn wait_for_call(file: &std::path::Path, name: &str, call: &str) -> Result<()> {
    let deadline = tokio::time::Instant::now() + T;
    while !calls_of(file, name).iter().any(|c| c == call) {
        if tokio::time::Instant::now() > deadline {
            bail!("{call:?} was not called within {T:?}: {:?}", calls_of(file, name));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Anything else the cycle still calls.
    tokio::time::sleep(Duration::from_secs(1)).await;
    Ok(())
}

#[tokio::test]
async fn a_parent_is_called_on_each_cycle_of_its_subhandlers_with_kopfs_retries() -> Result<()> {
    let python = sdk_python().await?;
    let capstan = capstan_binary().await?;
    let kopf = capstan_tests::kopf::binary().await?;
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let calls = env.scratch().join("calls");
    let base = HashMap::from([
        ("KUBECONFIG".to_owned(), env.kubeconfig.display().to_string()),
        ("PYTHONUNBUFFERED".to_owned(), "1".to_owned()),
        ("CALLS_FILE".to_owned(), calls.display().to_string()),
    ]);

    // Real kopf.
    let kopf_operator = env.scratch().join("kopf_subhandlers.py");
    std::fs::write(&kopf_operator, format!("import kopf\n{SUBHANDLERS}"))?;
    let args = ["run", "--standalone", "-n", "default"]
        .iter()
        .map(|s| (*s).to_owned())
        .chain([kopf_operator.display().to_string()])
        .collect::<Vec<_>>();
    let mut kopf_process = Process::spawn("kopf", &kopf, &args, &base, env.scratch())?;
    create_example(&env, "by-kopf", json!({"field": "x"})).await?;
    wait_for_call(&calls, "by-kopf", "flaky 2")
        .await
        .with_context(|| kopf_process.output())?;
    kopf_process.terminate().await?;
    let by_kopf = calls_of(&calls, "by-kopf");
    // kopf's object goes: Capstan keeps records of its own and would handle it again.
    let api = examples(&env.client().await?, "default");
    api.delete("by-kopf", &Default::default()).await?;
    let deadline = tokio::time::Instant::now() + T;
    while api.get_opt("by-kopf").await?.is_some() {
        if tokio::time::Instant::now() > deadline {
            bail!("kopf's object was not deleted within {T:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // capstan.kopf under the runner, on an object of its own.
    let operator = env.scratch().join("subhandlers.py");
    std::fs::write(&operator, format!("import capstan.kopf as kopf\n{SUBHANDLERS}"))?;
    let test = env.scratch().join("test_subhandlers.py");
    std::fs::write(&test, SUBHANDLERS_TEST)?;
    let mut vars = base.clone();
    vars.extend([
        ("CAPSTAN_BINARY".to_owned(), capstan.display().to_string()),
        (
            "PYTHONPATH".to_owned(),
            repo_root().join("sdk-python").display().to_string(),
        ),
        ("OPERATOR_FILE".to_owned(), operator.display().to_string()),
    ]);
    let mut process = Process::spawn(
        "kopf-runner-subhandlers",
        &python,
        &[test.display().to_string()],
        &vars,
        env.scratch(),
    )?;
    process.wait_for("runner started", T).await?;
    create_example(&env, "by-capstan", json!({"field": "x"})).await?;
    process.wait_for("SUBHANDLERS DONE", T).await?;

    let by_capstan = calls_of(&calls, "by-capstan");
    // kopf's default lifecycle (asap): one sub-handler per cycle, the parent called on each.
    assert_eq!(
        by_kopf,
        [
            "parent 0", "flaky 0", "parent 1", "steady 0", "parent 2", "flaky 1", "parent 3", "flaky 2"
        ]
    );
    // Capstan: the same, each sub-handler the lifecycle leaves for later reported deferred.
    assert_eq!(by_capstan, by_kopf, "{}", process.output());
    // The same: each sub-handler's calls with their retries, and the parent before each
    // cycle's sub-handlers with its retry counting the cycles.
    let of = |calls: &[String], who: &str| -> Vec<String> {
        calls.iter().filter(|c| c.starts_with(who)).cloned().collect()
    };
    for who in ["flaky", "steady"] {
        assert_eq!(of(&by_capstan, who), of(&by_kopf, who), "{who}'s calls differ");
    }
    for calls in [&by_kopf, &by_capstan] {
        let parents = of(calls, "parent");
        let expected: Vec<String> = (0..parents.len()).map(|i| format!("parent {i}")).collect();
        assert_eq!(parents, expected);
        assert!(calls[0].starts_with("parent"));
    }
    Ok(())
}

/// A kopf operator file, unchanged: it imports `kopf`.
const UNCHANGED: &str = r#"
import os
import kopf

@kopf.on.create("demo.capstan.dev", "v1", "examples")
def create_fn(name, patch, **_):
    patch.status["created_by"] = "kopf-compat"

@kopf.on.cleanup()
def cleanup_fn(logger, **_):
    open(os.environ["CLEANUP_FILE"], "w").write("cleaned up")
"#;

#[tokio::test]
async fn python_m_capstan_run_with_controller_runs_an_unchanged_kopf_file_and_its_cleanup() -> Result<()> {
    let python = sdk_python().await?;
    let capstan = capstan_binary().await?;
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let operator = env.scratch().join("unchanged.py");
    std::fs::write(&operator, UNCHANGED)?;
    let cleanup = env.scratch().join("cleanup");
    let vars = HashMap::from([
        ("CAPSTAN_BINARY".to_owned(), capstan.display().to_string()),
        ("KUBECONFIG".to_owned(), env.kubeconfig.display().to_string()),
        (
            "PYTHONPATH".to_owned(),
            repo_root().join("sdk-python").display().to_string(),
        ),
        ("PYTHONUNBUFFERED".to_owned(), "1".to_owned()),
        ("CLEANUP_FILE".to_owned(), cleanup.display().to_string()),
    ]);
    let args: Vec<String> = [
        "-m",
        "capstan",
        "run",
        "--kopf-compat",
        "--with-controller",
        "-A",
        "--standalone",
        "--verbose",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain([operator.display().to_string()])
    .collect();
    let mut process = Process::spawn("kopf-compat", &python, &args, &vars, env.scratch())?;
    process
        .wait_for("handler registered handler=create_fn", T)
        .await?;
    create_example(&env, "compat", json!({"field": "x"})).await?;
    let api = examples(&env.client().await?, "default");
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let object = api.get("compat").await?;
        if object.data.pointer("/status/created_by") == Some(&json!("kopf-compat")) {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "create_fn's patch did not arrive: {:?}\n{}",
                object.data,
                process.output()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // SIGTERM: the controller stops first and runs the cleanup handler through this process.
    let status = process.terminate().await?;
    if !status.success() {
        bail!(
            "python -m capstan run exited with {status}:\n{}",
            process.output()
        );
    }
    let cleaned = std::fs::read_to_string(&cleanup).unwrap_or_default();
    if cleaned != "cleaned up" {
        bail!("the cleanup handler did not run:\n{}", process.output());
    }
    Ok(())
}
