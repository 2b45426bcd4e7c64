//! Interoperability with stock gRPC stacks: a handler process written with Python's `grpcio`
//! (gRPC C-core, pinned from PyPI by `tests/interop/setup.sh`) connects over the real Unix
//! socket exactly as `proto/README.md` tells it to — `unix:///path`, no channel options but the
//! message sizes — and handles an object of the real API server through the real controller.
//!
//! C-core sends the percent-encoded socket path as `:authority`; this test is what keeps the
//! controller's HTTP/2 frame layer (`grpc::frames`) honest. It also checks that the handler's
//! log record with a newline stays one line in the controller's text log.

use std::{collections::HashMap, time::Duration};

use anyhow::{Context as _, Result, bail};
use capstan_tests::{
    process::{Controller, Process, venv_python},
    testenv::{TestEnv, create_example, examples, repo_root},
};
use serde_json::json;

#[tokio::test]
async fn stock_grpcio_handles_an_object_over_the_unix_socket() -> Result<()> {
    // The venv's python with the pinned grpcio.
    let python = venv_python("CAPSTAN_INTEROP_PYTHON", "tests/interop/setup.sh").await?;
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let controller = Controller::start(&env, "capstan", &[]).await?;
    let script = repo_root().join("tests/interop/grpcio_handler.py");
    let args = vec![
        script.to_string_lossy().into_owned(),
        controller.socket.to_string_lossy().into_owned(),
        repo_root().join("proto").to_string_lossy().into_owned(),
    ];
    let mut handler = Process::spawn("grpcio", &python, &args, &HashMap::new(), env.scratch())?;
    handler
        .wait_for("WELCOME capstan grpcio_create", Duration::from_secs(120))
        .await
        .with_context(|| format!("controller log:\n{}", controller.process.output()))?;

    let client = env.client().await?;
    create_example(&env, "one", json!({"size": 1})).await?;
    handler
        .wait_for("INVOCATION grpcio_create one 1", Duration::from_secs(60))
        .await?;
    handler.wait_for("ACK True", Duration::from_secs(60)).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let obj = examples(&client, "default").get("one").await?;
        let labels = obj.metadata.labels.unwrap_or_default();
        if labels.get("grpcio").map(String::as_str) == Some("yes") {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "the handler's patch was not applied:\n{}",
                controller.process.output()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let log = controller.process.output();
    assert!(
        log.contains("handled by grpcio\\nFORGED line from a handler process"),
        "the handler's log record is in the controller's log, escaped:\n{log}"
    );
    assert!(
        !log.lines().any(|l| l.starts_with("FORGED")),
        "a handler's newline forged a log line:\n{log}"
    );
    assert!(
        !log.contains("stream refused below the gRPC layer"),
        "no stream was refused:\n{log}"
    );
    Ok(())
}
