//! A test written as kopf's own example tests are (`test_example_09/10/11`: `KopfRunner` around
//! kubectl's create and delete of an object, then `exception`, `exit_code` and the log lines in
//! `output` checked) — `sdk-python/tests/differential/runner_example.py` — run twice against
//! the real API server: with real kopf's `kopf.testing.KopfRunner` (pinned from PyPI), which
//! proves the test's checks are kopf's behaviour, and with `capstan.kopf.testing.KopfRunner`,
//! which starts the real `capstan` binary itself. The operator file
//! (`examples_runner.py`, on the lines of kopf's `11-filtering-handlers`) has create handlers
//! whose label, annotation and `when` filters match or not, each logging a line of its own.

use std::{collections::HashMap, time::Duration};

use anyhow::{Context as _, Result};
use capstan_tests::{
    process::{Process, capstan_binary, sdk_python},
    testenv::{TestEnv, repo_root},
};

const T: Duration = Duration::from_secs(120);

/// The object the test creates and deletes with kubectl.
const OBJECT: &str = r#"
apiVersion: demo.capstan.dev/v1
kind: Example
metadata:
  name: filtered
  namespace: default
  labels:
    tier: backend
  annotations:
    owner: team-a
spec:
  field: x
"#;

/// Runs the kopf-style test under `framework` ("kopf" or "capstan") until it passes.
async fn run_example_test(env: &TestEnv, framework: &str) -> Result<()> {
    let obj = env.scratch().join("obj.yaml");
    std::fs::write(&obj, OBJECT)?;
    let differential = repo_root().join("sdk-python/tests/differential");
    let mut vars = HashMap::from([
        ("KUBECONFIG".to_owned(), env.kubeconfig.display().to_string()),
        ("PYTHONUNBUFFERED".to_owned(), "1".to_owned()),
        ("OBJ_FILE".to_owned(), obj.display().to_string()),
        (
            "OPERATOR_FILE".to_owned(),
            differential.join("examples_runner.py").display().to_string(),
        ),
    ]);
    let python = if framework == "capstan" {
        vars.extend([
            ("CAPSTAN_DIFFERENTIAL".to_owned(), "capstan".to_owned()),
            (
                "CAPSTAN_BINARY".to_owned(),
                capstan_binary().await?.display().to_string(),
            ),
            (
                "PYTHONPATH".to_owned(),
                repo_root().join("sdk-python").display().to_string(),
            ),
        ]);
        sdk_python().await?
    } else {
        // The kopf venv's interpreter, beside its `kopf` script.
        capstan_tests::kopf::binary().await?.with_file_name("python")
    };
    // Run from a copy: the script's directory comes first on Python's path, and the operator
    // files beside it include an `operator.py`, which would stand in for the standard one.
    let test = env.scratch().join("test_example.py");
    std::fs::copy(differential.join("runner_example.py"), &test)?;
    let test = test.display().to_string();
    let mut process = Process::spawn(
        &format!("example-test-{framework}"),
        &python,
        &[test],
        &vars,
        env.scratch(),
    )?;
    process
        .wait_for("EXAMPLE TEST PASSED", T)
        .await
        .with_context(|| format!("the kopf-style example test failed under {framework}"))?;
    Ok(())
}

/// kopf's example test passes with kopf's runner, and with Capstan's under only its import
/// changed.
#[tokio::test]
async fn a_kopf_style_example_test_passes_with_kopfs_runner_and_capstans() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    run_example_test(&env, "kopf").await?;
    run_example_test(&env, "capstan").await?;
    Ok(())
}
