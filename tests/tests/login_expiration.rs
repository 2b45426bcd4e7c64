//! End to end: login credentials that say when they expire are replaced before they do — the
//! login handler is called again ahead of the expiration, with no `401 Unauthorized` needed —
//! and the controller keeps working as the new identity.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use capstan_tests::{
    process::{Controller, start_handler},
    scenario::tail,
    testenv::{TestEnv, create_example},
};
use serde_json::json;
use tokio::time::Instant;

const T: Duration = Duration::from_secs(60);

fn lines(path: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn credentials_are_renewed_before_they_expire() -> Result<()> {
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
            // Renewed a fifth of the lifetime ahead: after about 8 s.
            ("E2E_LOGIN_EXPIRES_IN", "10"),
        ],
    )?;
    let deadline = Instant::now() + T;
    while !lines(&calls).iter().any(|l| l == "login call 1 bad=false") {
        ensure!(Instant::now() < deadline, "{:?}", lines(&calls));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let first = Instant::now();
    while !lines(&calls).iter().any(|l| l == "login call 2 bad=false") {
        ensure!(
            Instant::now() < deadline,
            "not renewed: {:?}\ncontroller:\n{}",
            lines(&calls),
            tail(&controller.process.output(), 40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let renewed_after = first.elapsed();
    ensure!(
        renewed_after >= Duration::from_secs(4) && renewed_after < Duration::from_secs(10),
        "renewed after {renewed_after:?}"
    );
    let out = controller.process.output();
    ensure!(out.contains("about to expire"), "{}", tail(&out, 30));
    ensure!(
        !out.contains("401 Unauthorized"),
        "renewed before any rejection: {}",
        tail(&out, 30)
    );
    // Still working with the renewed credentials.
    create_example(&env, "after", json!({})).await?;
    while !lines(&calls).iter().any(|l| l == "create_fn after 1") {
        ensure!(
            Instant::now() < deadline,
            "{:?}\ncontroller:\n{}",
            lines(&calls),
            tail(&controller.process.output(), 40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let status = controller.process.terminate().await?;
    ensure!(status.success(), "exit status {status}");
    handler.kill().await?;
    env.stop().await
}
