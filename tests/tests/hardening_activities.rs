//! End to end: one handler process's activities cannot stop or stall the others. A late
//! startup handler that fails for good withdraws only its own process's registrations (with
//! other processes serving, and with nothing else happening), and the controller keeps
//! answering and stops on SIGTERM; a login handler that never answers is reported by
//! `/readyz`, and its process leaving releases the watches and startup handlers it held.

use std::time::Duration;

use anyhow::{Context as _, Result, bail, ensure};
use capstan_tests::{
    process::{Controller, Process, start_handler},
    scenario::tail,
    testenv::{TestEnv, create_example},
};
use serde_json::json;
use tokio::time::Instant;

const T: Duration = Duration::from_secs(60);

fn has_line(path: &std::path::Path, line: &str) -> bool {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .any(|l| l == line)
}

async fn wait_line(path: &std::path::Path, line: &str, controller: &Controller) -> Result<()> {
    let deadline = Instant::now() + T;
    while !has_line(path, line) {
        if Instant::now() > deadline {
            bail!(
                "no {line:?} in the call log\ncontroller:\n{}",
                tail(&controller.process.output(), 40)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// An admin GET that must answer within a few seconds (a hung controller does not).
async fn admin(controller: &Controller, path: &str) -> Result<(u16, String)> {
    tokio::time::timeout(Duration::from_secs(10), controller.admin_get(path))
        .await
        .with_context(|| format!("{path} did not answer within 10 s"))?
}

async fn wait_admin(controller: &Controller, path: &str, want: u16, within: Duration) -> Result<String> {
    let deadline = Instant::now() + within;
    loop {
        let (code, body) = admin(controller, path).await?;
        if code == want {
            return Ok(body);
        }
        if Instant::now() > deadline {
            bail!(
                "{path} is {code}, not {want}: {body}\ncontroller:\n{}",
                tail(&controller.process.output(), 30)
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn handler(env: &TestEnv, name: &str, controller: &Controller, presets: &str, log: &str) -> Result<Process> {
    start_handler(
        env,
        name,
        &controller.endpoint(),
        &[
            ("E2E_HANDLERS", presets),
            ("E2E_LOG", log),
            ("E2E_STARTUP_FAILS", "0"),
        ],
    )
}

/// The late process is told, the controller keeps running and answering.
async fn late_failure_is_confined(controller: &mut Controller, late: &mut Process) -> Result<()> {
    controller
        .process
        .wait_for("late startup handler failed for good", T)
        .await?;
    late.wait_for("STARTUP_FAILED", T).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(
        controller.process.running(),
        "the controller stopped:\n{}",
        tail(&controller.process.output(), 30)
    );
    wait_admin(controller, "/healthz", 200, Duration::from_secs(10)).await?;
    Ok(())
}

#[tokio::test]
async fn a_late_startup_failure_withdraws_only_its_own_process_while_others_serve() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let mut controller = Controller::start(&env, "capstan", &[]).await?;
    let calls = env.scratch().join("calls.log");
    let log = calls.to_string_lossy().into_owned();
    let mut serving = handler(&env, "serving", &controller, "create", &log)?;
    create_example(&env, "one", json!({})).await?;
    wait_line(&calls, "create_fn one 1", &controller).await?;

    let mut late = handler(&env, "late", &controller, "startup-permanent", &log)?;
    late_failure_is_confined(&mut controller, &mut late).await?;
    create_example(&env, "two", json!({})).await?;
    wait_line(&calls, "create_fn two 1", &controller).await?;
    wait_admin(&controller, "/readyz", 200, T).await?;

    let status = controller.process.terminate().await?;
    ensure!(status.success(), "controller exited with {status}");
    serving.kill().await?;
    late.kill().await?;
    env.stop().await
}

#[tokio::test]
async fn a_late_startup_failure_with_nothing_else_happening_never_hangs_the_controller() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let mut controller = Controller::start(&env, "capstan", &[]).await?;
    let calls = env.scratch().join("calls.log");
    let log = calls.to_string_lossy().into_owned();
    let mut first = handler(&env, "first", &controller, "create", &log)?;
    create_example(&env, "one", json!({})).await?;
    wait_line(&calls, "create_fn one 1", &controller).await?;
    first.kill().await?;
    controller
        .process
        .wait_for("handler process disconnected", T)
        .await?;

    let mut late = handler(&env, "late", &controller, "startup-permanent", &log)?;
    late_failure_is_confined(&mut controller, &mut late).await?;
    // Another process is served as usual.
    let mut next = handler(&env, "next", &controller, "create", &log)?;
    create_example(&env, "two", json!({})).await?;
    wait_line(&calls, "create_fn two 1", &controller).await?;

    let status = controller.process.terminate().await?;
    ensure!(status.success(), "controller exited with {status}");
    late.kill().await?;
    next.kill().await?;
    env.stop().await
}

#[tokio::test]
async fn a_login_handler_that_never_answers_is_reported_and_its_process_leaving_releases_everything()
-> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    create_example(&env, "waiting", json!({})).await?;
    let mut controller = Controller::start(&env, "capstan", &[]).await?;
    let calls = env.scratch().join("calls.log");
    let log = calls.to_string_lossy().into_owned();
    let mut login = handler(&env, "login", &controller, "login-hang", &log)?;
    wait_line(&calls, "login called", &controller).await?;
    let mut worker = handler(&env, "worker", &controller, "startup,create", &log)?;
    controller
        .process
        .wait_for("handler process connected", T)
        .await?;

    // Readiness says what is awaited while the login handler does not answer.
    let body = wait_admin(&controller, "/readyz", 503, T).await?;
    ensure!(
        body.contains("waiting for a login handler"),
        "/readyz does not report the wait: {body}"
    );
    ensure!(!has_line(&calls, "create_fn waiting 1"), "processed before login");

    // The login handler's process leaves: nothing waits for it any more.
    login.kill().await?;
    wait_line(&calls, "startup done", &controller).await?;
    wait_line(&calls, "create_fn waiting 1", &controller).await?;
    wait_admin(&controller, "/readyz", 200, T).await?;

    let status = controller.process.terminate().await?;
    ensure!(status.success(), "controller exited with {status}");
    worker.kill().await?;
    env.stop().await
}
