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

done = os.environ["DONE_FILE"]
with KopfRunner(["run", "-A", "--standalone", "--verbose", os.environ["OPERATOR_FILE"]], timeout=60) as runner:
    print("runner started", file=sys.__stdout__, flush=True)
    deadline = time.monotonic() + 60
    while not (os.path.exists(done) and os.path.exists(done + ".daemon")) and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(1)  # the result's write
print("output:", runner.output, file=sys.__stdout__)
print("controller:", runner.controller_output, file=sys.__stdout__)
assert runner.exit_code == 0, runner.exit_code
assert runner.exception is None, runner.exception
assert "And here we are! Creating kopf-runner with x" in runner.output
assert "--finalizer demo.capstan.dev/finalizer" in runner.output
assert runner.controller is not None and "capstan started" in runner.controller_output
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
    Ok(())
}
