//! End to end: a watch whose connection hangs silently is noticed, reported by `/readyz` while
//! the API server does not answer (`/healthz` stays alive: an outage is no reason to restart
//! the pod), restarted, and catches up with what happened meanwhile; a write lost to an API
//! outage is retried after a backoff without running the handler again.

use std::time::Duration;

use capstan_tests::{
    process::{Controller, start_handler},
    proxy::Proxy,
    scenario::annotation,
    testenv::{TestEnv, examples},
};
use kube::api::PostParams;
use serde_json::json;

async fn wait_health(c: &Controller, path: &str, want: u16, what: &str) -> anyhow::Result<String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    loop {
        let (code, body) = c.admin_get(path).await?;
        if code == want {
            return Ok(body);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "{what}: {path} is {code}: {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn a_silently_hung_watch_is_reported_restarted_and_catches_up() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let client = env.client().await?;
    let (proxy, proxied) = Proxy::in_front_of(&env).await?;

    // No checkpoint while the slow handler below runs: its final write is the one that meets
    // the outage.
    let mut controller = Controller::start_with(
        &env,
        &proxied,
        "capstan",
        &["--watch-inactivity-timeout", "3s", "--checkpoint-after", "60s"],
    )
    .await?;
    let calls = env.scratch().join("calls.log");
    let _handler = start_handler(
        &env,
        "handler",
        &controller.endpoint(),
        &[("E2E_HANDLERS", "create"), ("E2E_LOG", &calls.to_string_lossy())],
    )?;
    controller
        .process
        .wait_for("handler process connected", Duration::from_secs(30))
        .await?;
    let api = examples(&client, "default");
    let create = |name: &str| {
        serde_json::from_value::<kube::api::DynamicObject>(json!({
            "apiVersion": "demo.capstan.dev/v1", "kind": "Example",
            "metadata": {"name": name, "namespace": "default"}, "spec": {}
        }))
    };
    api.create(&PostParams::default(), &create("before")?).await?;
    let handled = |name: &'static str| {
        let api = api.clone();
        async move {
            let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
            loop {
                let o = serde_json::to_value(api.get(name).await?)?;
                if annotation(&o, "capstan.dev/last-handled-configuration").is_some() {
                    return anyhow::Ok(());
                }
                anyhow::ensure!(tokio::time::Instant::now() < deadline, "{name} not handled");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    handled("before").await?;
    wait_health(&controller, "/healthz", 200, "healthy at first").await?;

    proxy.freeze();
    let body = wait_health(&controller, "/readyz", 503, "reported while hung").await?;
    assert!(body.contains("api-server"), "{body}");
    let (code, body) = controller.admin_get("/healthz").await?;
    assert_eq!(
        code, 200,
        "an unanswering API server is no liveness failure: {body}"
    );
    api.create(&PostParams::default(), &create("during")?).await?;

    proxy.unfreeze();
    handled("during").await?;
    wait_health(&controller, "/readyz", 200, "ready again").await?;
    wait_health(&controller, "/healthz", 200, "healthy again").await?;
    assert!(controller.process.output().contains("watch went silent"));

    // The API goes away while a handler runs: its write fails, is retried after a backoff
    // once the API is back, and the handler does not run again.
    let slow = serde_json::from_value::<kube::api::DynamicObject>(json!({
        "apiVersion": "demo.capstan.dev/v1", "kind": "Example",
        "metadata": {"name": "cut", "namespace": "default"}, "spec": {"sleep": {"create_fn": 2}}
    }))?;
    api.create(&PostParams::default(), &slow).await?;
    let calls_of = |name: &str| {
        std::fs::read_to_string(&calls)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with(&format!("create_fn {name} ")))
            .count()
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while calls_of("cut") == 0 {
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "cut's handler never ran");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    proxy.freeze();
    tokio::time::sleep(Duration::from_secs(5)).await;
    proxy.unfreeze();
    handled("cut").await?;
    assert!(
        controller
            .process
            .output()
            .contains("writing the object failed; retrying"),
        "the failed write was not retried:\n{}",
        capstan_tests::scenario::tail(&controller.process.output(), 20)
    );
    assert_eq!(calls_of("cut"), 1, "the handler ran again after the outage");
    Ok(())
}
