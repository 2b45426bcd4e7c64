//! Operator activities end to end: startup handlers gate processing (and a permanent failure
//! stops the controller), cleanup handlers run on SIGTERM, probe results appear in `/healthz`,
//! and login credentials are used for the API.

use std::time::Duration;

use tokio::time::Instant;

use anyhow::{Context as _, Result, bail, ensure};
use capstan_tests::{
    process::{Controller, Process, start_handler},
    scenario::tail,
    testenv::{TestEnv, create_example},
};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

fn lines(path: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

async fn wait_line(
    path: &std::path::Path,
    line: &str,
    controller: &Controller,
    handler: &Process,
) -> Result<()> {
    let deadline = Instant::now() + T;
    while !lines(path).iter().any(|l| l == line) {
        if Instant::now() > deadline {
            bail!(
                "no {line:?} in the call log: {:?}\ncontroller:\n{}\nhandler:\n{}",
                lines(path),
                tail(&controller.process.output(), 40),
                tail(&handler.output(), 20)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

fn position(all: &[String], line: &str) -> Option<usize> {
    all.iter().position(|l| l == line)
}

#[tokio::test]
async fn a_startup_handler_failing_then_succeeding_gates_all_processing_and_runs_once() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    create_example(&env, "early", json!({})).await?;
    let mut controller = Controller::start(&env, "capstan", &[]).await?;
    let calls = env.scratch().join("calls.log");
    let log = calls.to_string_lossy().into_owned();
    let vars = [
        ("E2E_HANDLERS", "startup,create"),
        ("E2E_LOG", log.as_str()),
        ("E2E_STARTUP_FAILS", "2"),
    ];
    let mut handler = start_handler(&env, "handler", &controller.endpoint(), &vars)?;
    wait_line(&calls, "create_fn early 1", &controller, &handler).await?;
    let all = lines(&calls);
    let done = position(&all, "startup done").context("startup never finished")?;
    let handled = position(&all, "create_fn early 1").context("early not handled")?;
    ensure!(
        all[..done]
            .iter()
            .filter(|l| l.starts_with("startup attempt"))
            .count()
            == 3,
        "two temporary failures, then success: {all:?}"
    );
    ensure!(
        done < handled,
        "the object was handled before startup succeeded: {all:?}"
    );
    let out = controller.process.output();
    ensure!(
        out.contains("startup handler failed; retrying"),
        "{}",
        tail(&out, 30)
    );
    ensure!(
        out.contains("waiting for startup handlers: startup_fn"),
        "{}",
        tail(&out, 30)
    );

    // A reconnecting handler process does not run startup again.
    handler.kill().await?;
    handler = start_handler(&env, "handler", &controller.endpoint(), &vars)?;
    create_example(&env, "later", json!({})).await?;
    wait_line(&calls, "create_fn later 1", &controller, &handler).await?;
    let attempts = lines(&calls)
        .iter()
        .filter(|l| l.starts_with("startup attempt"))
        .count();
    ensure!(
        attempts == 3,
        "startup ran again after a reconnect: {:?}",
        lines(&calls)
    );

    let status = controller.process.terminate().await?;
    ensure!(status.success(), "controller exited with {status}");
    handler.kill().await?;
    env.stop().await
}

#[tokio::test]
async fn a_permanently_failing_startup_handler_stops_the_controller_with_an_error() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    create_example(&env, "untouched", json!({})).await?;
    let mut controller = Controller::start(&env, "capstan", &[]).await?;
    let calls = env.scratch().join("calls.log");
    let log = calls.to_string_lossy().into_owned();
    let mut handler = start_handler(
        &env,
        "handler",
        &controller.endpoint(),
        &[
            ("E2E_HANDLERS", "startup-permanent,create"),
            ("E2E_LOG", log.as_str()),
        ],
    )?;
    controller
        .process
        .wait_for("startup handler startup_fn failed: the license key is invalid", T)
        .await?;
    let deadline = Instant::now() + T;
    while controller.process.running() {
        ensure!(Instant::now() < deadline, "the controller keeps running");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = controller.process.terminate().await?;
    ensure!(
        !status.success(),
        "a failed startup must exit non-zero, got {status}"
    );
    ensure!(
        !lines(&calls).iter().any(|l| l.starts_with("create_fn")),
        "nothing may be processed: {:?}",
        lines(&calls)
    );
    handler.kill().await?;
    env.stop().await
}

#[tokio::test]
async fn cleanup_handlers_run_on_sigterm_and_the_controller_exits_0() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let mut controller = Controller::start(&env, "capstan", &["--shutdown-grace", "5s"]).await?;
    let calls = env.scratch().join("calls.log");
    let log = calls.to_string_lossy().into_owned();
    let mut handler = start_handler(
        &env,
        "handler",
        &controller.endpoint(),
        &[("E2E_HANDLERS", "cleanup,create"), ("E2E_LOG", log.as_str())],
    )?;
    controller
        .process
        .wait_for("handler process connected", T)
        .await?;
    create_example(&env, "one", json!({})).await?;
    wait_line(&calls, "create_fn one 1", &controller, &handler).await?;
    ensure!(!lines(&calls).iter().any(|l| l == "cleanup ran"));
    let status = controller.process.terminate().await?;
    ensure!(status.success(), "exit status {status}");
    ensure!(
        lines(&calls).iter().any(|l| l == "cleanup ran"),
        "{:?}",
        lines(&calls)
    );
    let out = controller.process.output();
    ensure!(out.contains("cleanup handler succeeded"), "{}", tail(&out, 30));
    let stopped = out.find("capstan stopped").context("no clean stop")?;
    ensure!(out.find("cleanup handler succeeded").is_some_and(|c| c < stopped));
    handler.kill().await?;
    env.stop().await
}

/// The order of the chart's pod: kubelet stops the handler container first (the controller is
/// a native sidecar, stopped once the handler container exited). The Rust SDK's process asks
/// for its cleanup handler in its goodbye, and waits for it before it exits; the controller's
/// own stop later does not run it again.
#[tokio::test]
async fn a_handler_process_stopped_before_the_controller_runs_its_cleanup_handler_once() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let mut controller = Controller::start(&env, "capstan", &["--shutdown-grace", "5s"]).await?;
    let calls = env.scratch().join("calls.log");
    let log = calls.to_string_lossy().into_owned();
    let mut handler = start_handler(
        &env,
        "handler",
        &controller.endpoint(),
        &[("E2E_HANDLERS", "cleanup,create"), ("E2E_LOG", log.as_str())],
    )?;
    controller
        .process
        .wait_for("handler process connected", T)
        .await?;
    create_example(&env, "one", json!({})).await?;
    wait_line(&calls, "create_fn one 1", &controller, &handler).await?;
    let status = handler.terminate().await?;
    ensure!(status.success(), "handler exit status {status}");
    ensure!(
        lines(&calls).iter().filter(|l| *l == "cleanup ran").count() == 1,
        "the cleanup handler did not run once when its process stopped first: {:?}\n{}",
        lines(&calls),
        tail(&handler.output(), 30)
    );
    let status = controller.process.terminate().await?;
    ensure!(status.success(), "exit status {status}");
    let out = controller.process.output();
    ensure!(
        out.matches("cleanup handler succeeded").count() == 1,
        "{}",
        tail(&out, 30)
    );
    ensure!(lines(&calls).iter().filter(|l| *l == "cleanup ran").count() == 1);
    env.stop().await
}

#[tokio::test]
async fn probe_results_appear_in_healthz_and_a_hanging_probe_fails_within_its_timeout() -> Result<()> {
    let env = TestEnv::start().await?;
    let controller = Controller::start(&env, "capstan", &["--probe-timeout", "2s"]).await?;
    let mut handler = start_handler(
        &env,
        "handler",
        &controller.endpoint(),
        &[("E2E_HANDLERS", "probe,probe-hang")],
    )?;
    let mut controller = controller;
    controller
        .process
        .wait_for("handler process connected", T)
        .await?;
    let connected = Instant::now();
    let (code, body) = loop {
        let asked = Instant::now();
        let (code, body) = controller.admin_get("/healthz").await?;
        // Never waiting for the probes: the hanging one alone takes its 2 s timeout.
        ensure!(
            asked.elapsed() < Duration::from_millis(1800),
            "/healthz must answer from the cache"
        );
        let report: Value = serde_json::from_str(&body).unwrap_or_default();
        if report["probes"]["probe_fn"]["answer"] == 42
            && report["checks"]["probe/hanging_probe"]["ok"] == false
        {
            break (code, report);
        }
        ensure!(
            connected.elapsed() < Duration::from_secs(40),
            "no probe results in time: {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    ensure!(code == 503, "a failing probe fails liveness, got {code}");
    let message = body["checks"]["probe/hanging_probe"]["message"]
        .as_str()
        .unwrap_or_default();
    ensure!(message.contains("did not answer within 2s"), "{body}");
    ensure!(body["checks"]["probe/probe_fn"]["ok"] == true, "{body}");
    let status = controller.process.terminate().await?;
    ensure!(status.success(), "exit status {status}");
    handler.kill().await?;
    env.stop().await
}

#[tokio::test]
async fn login_credentials_are_used_for_the_api_and_bad_ones_are_retried() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    env.kubectl_ok(&["create", "serviceaccount", "capstan-login", "-n", "default"])
        .await?;
    env.kubectl_ok(&[
        "create",
        "clusterrolebinding",
        "capstan-login",
        "--clusterrole=cluster-admin",
        "--serviceaccount=default:capstan-login",
    ])
    .await?;
    let token = env
        .kubectl_ok(&[
            "create",
            "token",
            "capstan-login",
            "-n",
            "default",
            "--duration=1h",
        ])
        .await?;
    let kubeconfig = kube::config::Kubeconfig::read_from(&env.kubeconfig)?;
    let cluster = kubeconfig.clusters[0].cluster.clone().context("no cluster")?;
    let server = cluster.server.unwrap_or_default();
    let ca = cluster.certificate_authority_data.unwrap_or_default();

    let mut controller = Controller::start(&env, "capstan", &[]).await?;
    let calls = env.scratch().join("calls.log");
    let log = calls.to_string_lossy().into_owned();
    let mut handler = start_handler(
        &env,
        "handler",
        &controller.endpoint(),
        &[
            ("E2E_HANDLERS", "login,create"),
            ("E2E_LOG", log.as_str()),
            ("E2E_LOGIN_SERVER", server.as_str()),
            ("E2E_LOGIN_CA", ca.as_str()),
            ("E2E_LOGIN_TOKEN", token.trim()),
            ("E2E_LOGIN_BAD_FIRST", "1"),
        ],
    )?;
    create_example(&env, "who", json!({})).await?;
    wait_line(&calls, "create_fn who 1", &controller, &handler).await?;
    let all = lines(&calls);
    ensure!(
        position(&all, "login call 2 bad=false") < position(&all, "create_fn who 1"),
        "{all:?}"
    );
    let out = controller.process.output();
    ensure!(
        out.contains("login failed"),
        "the rejected token must be logged: {}",
        tail(&out, 30)
    );
    ensure!(
        out.contains("rejected the login credentials"),
        "{}",
        tail(&out, 30)
    );
    ensure!(out.contains("logged in"), "{}", tail(&out, 30));

    // The controller's writes to the object were made as the login handler's identity.
    let deadline = Instant::now() + T;
    let users = loop {
        let users: Vec<String> = env
            .audit_events()?
            .into_iter()
            .filter(|e| e["stage"] == "ResponseComplete")
            .filter(|e| {
                e["userAgent"]
                    .as_str()
                    .is_some_and(|ua| ua.starts_with("capstan/"))
            })
            .filter(|e| e["objectRef"]["resource"] == "examples" && e["objectRef"]["name"] == "who")
            .filter(|e| e["verb"] == "patch")
            .map(|e| e["user"]["username"].as_str().unwrap_or_default().to_owned())
            .collect();
        if !users.is_empty() || Instant::now() > deadline {
            break users;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    ensure!(!users.is_empty(), "no patch of the object by capstan");
    ensure!(
        users
            .iter()
            .all(|u| u == "system:serviceaccount:default:capstan-login"),
        "writes by {users:?}"
    );
    let status = controller.process.terminate().await?;
    ensure!(status.success(), "exit status {status}");
    handler.kill().await?;
    env.stop().await
}
