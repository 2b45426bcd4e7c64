//! End to end: a login handler that never answers stalls no one. A process that connects
//! late with such a handler leaves the operator running on the credentials in use (the
//! controller's own here) while it is called in the background — the objects of the process
//! served all along are handled promptly, and the late process's own registrations are
//! served — and when login credentials are renewed, those of the login handler that answers
//! are installed without waiting for the silent one.

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

/// How soon work is expected that waits for nothing.
const PROMPT: Duration = Duration::from_secs(8);

/// The login deadline, set explicitly: PROMPT must stay well below it, or waiting out the
/// silent handler would pass these tests too.
const LOGIN_TIMEOUT: &str = "40s";

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
    within: Duration,
    controller: &Controller,
) -> Result<Duration> {
    let started = Instant::now();
    while !lines(path).iter().any(|l| l == line) {
        if started.elapsed() > within {
            bail!(
                "no {line:?} within {within:?}: {:?}\ncontroller:\n{}",
                lines(path),
                tail(&controller.process.output(), 40)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(started.elapsed())
}

/// Login credentials of a service account bound to cluster-admin, as a login handler returns
/// them: the server, its CA and a token.
struct Login {
    server: String,
    ca: String,
    token: String,
}

async fn login_credentials(env: &TestEnv) -> Result<Login> {
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
    Ok(Login {
        server: cluster.server.unwrap_or_default(),
        ca: cluster.certificate_authority_data.unwrap_or_default(),
        token: token.trim().to_owned(),
    })
}

fn start(env: &TestEnv, name: &str, controller: &Controller, vars: &[(&str, &str)]) -> Result<Process> {
    start_handler(env, name, &controller.endpoint(), vars)
}

fn logged_in(controller: &Controller) -> usize {
    controller
        .process
        .output()
        .matches("logged in: the API client now uses")
        .count()
}

#[tokio::test]
async fn a_late_login_handler_that_never_answers_stalls_no_one() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let mut controller = Controller::start(&env, "capstan", &["--login-timeout", LOGIN_TIMEOUT]).await?;
    let calls = env.scratch().join("calls.log");
    let log = calls.to_string_lossy().into_owned();
    // The first process is served on the controller's own (working) credentials.
    let mut first = start(
        &env,
        "first",
        &controller,
        &[("E2E_HANDLERS", "create"), ("E2E_LOG", log.as_str())],
    )?;
    create_example(&env, "one", json!({})).await?;
    wait_line(&calls, "create_fn one 1", T, &controller).await?;

    // A second process connects with a login handler that never answers, and handlers of
    // its own: one of them on a resource nothing watched so far (an index of ConfigMaps).
    env.kubectl_ok(&["create", "configmap", "cm-web", "-n", "default"])
        .await?;
    env.kubectl_ok(&["label", "configmap", "cm-web", "-n", "default", "e2e/app=web"])
        .await?;
    let started = Instant::now();
    let mut late = start(
        &env,
        "late",
        &controller,
        &[("E2E_HANDLERS", "login-hang,index"), ("E2E_LOG", log.as_str())],
    )?;
    late.wait_for("connected to the controller", T).await?;
    wait_line(&calls, "login called", T, &controller).await?;

    // Nothing waits for it: the late process's registrations are served at once, and a new
    // object is handled by both processes' handlers.
    wait_line(&calls, "index cm-web", PROMPT, &controller).await?;
    let indexed = started.elapsed();
    create_example(&env, "two", json!({})).await?;
    let first_took = wait_line(&calls, "create_fn two 1", PROMPT, &controller).await?;
    let late_took = wait_line(&calls, "lookup two 1", PROMPT, &controller).await?;
    eprintln!(
        "the late process's index was fed {indexed:?} after it started; a new object was handled \
         after {first_took:?} (first process) and {late_took:?} (late process)"
    );
    ensure!(
        logged_in(&controller) == 0,
        "the credentials in use were replaced:\n{}",
        tail(&controller.process.output(), 40)
    );
    let (code, body) = controller.admin_get("/readyz").await?;
    ensure!(
        code == 200,
        "/readyz is {code} while working credentials are in use: {body}"
    );

    // The silent handler ignores its cancellation too: its process goes first, so that the
    // controller's shutdown need not wait out its grace period for it.
    late.kill().await?;
    let status = controller.process.terminate().await?;
    ensure!(status.success(), "controller exited with {status}");
    first.kill().await?;
    env.stop().await
}

#[tokio::test]
async fn a_renewal_installs_the_credentials_that_answer_without_waiting_for_a_silent_login_handler()
-> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let login = login_credentials(&env).await?;
    let mut controller = Controller::start(&env, "capstan", &["--login-timeout", LOGIN_TIMEOUT]).await?;
    let calls = env.scratch().join("calls.log");
    let log = calls.to_string_lossy().into_owned();
    let mut first = start(
        &env,
        "first",
        &controller,
        &[
            ("E2E_HANDLERS", "login,create"),
            ("E2E_LOG", log.as_str()),
            ("E2E_LOGIN_SERVER", login.server.as_str()),
            ("E2E_LOGIN_CA", login.ca.as_str()),
            ("E2E_LOGIN_TOKEN", login.token.as_str()),
            // Renewed a fifth of the lifetime ahead: after about 12 s.
            ("E2E_LOGIN_EXPIRES_IN", "15"),
        ],
    )?;
    wait_line(&calls, "login call 1 bad=false", T, &controller).await?;
    let mut late = start(
        &env,
        "late",
        &controller,
        &[("E2E_HANDLERS", "login-hang"), ("E2E_LOG", log.as_str())],
    )?;
    late.wait_for("connected to the controller", T).await?;

    // The next login call of the first process is answered at once: its credentials are
    // installed then, not after the silent handler's deadline.
    wait_line(&calls, "login call 2 bad=false", T, &controller).await?;
    let answered = Instant::now();
    while logged_in(&controller) < 2 {
        if answered.elapsed() > PROMPT {
            bail!(
                "the renewed credentials were not installed within {PROMPT:?}: {:?}\ncontroller:\n{}",
                lines(&calls),
                tail(&controller.process.output(), 40)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!(
        "renewed credentials installed {:?} after the answer",
        answered.elapsed()
    );
    create_example(&env, "after", json!({})).await?;
    wait_line(&calls, "create_fn after 1", PROMPT, &controller).await?;

    // The silent handler ignores its cancellation too: its process goes first, so that the
    // controller's shutdown need not wait out its grace period for it.
    late.kill().await?;
    let status = controller.process.terminate().await?;
    ensure!(status.success(), "controller exited with {status}");
    first.kill().await?;
    env.stop().await
}
