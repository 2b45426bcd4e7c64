//! End to end: priority freezing (`--dev`, a crashed `--dev` operator's expiry, `capstan
//! freeze` / `capstan resume` with daemons stopped while frozen, namespaced peering, expiry,
//! the same-priority warning) and leader election among replicas (one invokes handlers;
//! after a SIGKILL the standby takes over within the lease duration and completes what was
//! pending, and no completed change is handled twice).

use std::time::Duration;

use anyhow::{Result, bail, ensure};
use capstan_tests::{
    operator::Operator,
    process::{Controller, capstan_binary},
    scenario::tail,
    testenv::{TestEnv, create_example, examples},
};
use serde_json::{Value, json};

const PAUSED: &str = "pausing: no new handler invocations";
const RESUMED: &str = "resumed: handler invocations continue";

async fn env_with_crds(peering: bool) -> Result<TestEnv> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    if peering {
        env.apply_peering_crds().await?;
    }
    Ok(env)
}

/// The entries of the cluster-wide peering `default` (its status).
async fn peers(env: &TestEnv) -> Result<Value> {
    let status = env
        .kubectl_ok(&[
            "get",
            "clustercapstanpeering",
            "default",
            "-o",
            "jsonpath={.status}",
        ])
        .await?;
    Ok(serde_json::from_str(&status)?)
}

/// Whether the object's change was recorded as handled (diff-base written).
async fn handled(env: &TestEnv, name: &str) -> Result<bool> {
    let client = env.client().await?;
    let obj = examples(&client, "default").get(name).await?;
    Ok(obj
        .metadata
        .annotations
        .is_some_and(|a| a.contains_key("capstan.dev/last-handled-configuration")))
}

/// Runs `capstan <args>` as a user at a terminal would, with the testenv's kubeconfig.
async fn capstan(env: &TestEnv, args: &[&str]) -> Result<String> {
    let out = tokio::process::Command::new(capstan_binary().await?)
        .args(args)
        .env("KUBECONFIG", &env.kubeconfig)
        .env("USER", "dev")
        .output()
        .await?;
    ensure!(
        out.status.success(),
        "capstan {} failed: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test]
async fn a_dev_operator_freezes_a_normal_one_until_it_exits() -> Result<()> {
    let env = env_with_crds(true).await?;
    let normal = Operator::start(&env, "normal", "create", &[]).await?;
    create_example(&env, "before", json!({})).await?;
    normal
        .wait_call("create_fn", "before", Duration::from_secs(30))
        .await?;

    let dev = Operator::start(&env, "dev", "create", &["--dev"]).await?;
    normal.wait_log(PAUSED, 1, Duration::from_secs(20)).await?;
    ensure!(
        normal
            .log()
            .contains("pausing operations in favour of higher-priority peers"),
        "the normal operator does not say in whose favour it pauses"
    );

    create_example(&env, "during", json!({})).await?;
    dev.wait_call("create_fn", "during", Duration::from_secs(30))
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(
        normal.count("create_fn", "during") == 0,
        "a frozen operator invoked a handler"
    );
    ensure!(
        dev.count("create_fn", "before") == 0,
        "the dev operator handled a handled object again"
    );

    let status = peers(&env).await?;
    ensure!(
        status.as_object().is_some_and(|p| p.len() == 2
            && p.values().any(|e| e["priority"] == 666)
            && p.values().any(|e| e["priority"] == 0)),
        "unexpected peering status {status}"
    );

    dev.stop().await?;
    normal.wait_log(RESUMED, 1, Duration::from_secs(20)).await?;
    create_example(&env, "after", json!({})).await?;
    normal
        .wait_call("create_fn", "after", Duration::from_secs(30))
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(
        normal.count("create_fn", "during") == 0 && normal.count("create_fn", "before") == 1,
        "after resuming, the normal operator handled a change again"
    );
    let status = peers(&env).await?;
    ensure!(
        status.as_object().is_some_and(|p| p.len() == 1),
        "the dev operator did not leave the peering: {status}"
    );
    normal.stop().await?;
    env.stop().await
}

#[tokio::test]
async fn an_operator_of_one_namespace_is_frozen_by_its_namespaces_peering_only() -> Result<()> {
    let env = env_with_crds(true).await?;
    let op = Operator::start(&env, "op", "create", &["--namespace", "default"]).await?;
    // A cluster-wide freeze is for cluster-wide operators.
    capstan(&env, &["freeze", "-A", "--lifetime", "30", "--priority", "100"]).await?;
    create_example(&env, "free", json!({})).await?;
    op.wait_call("create_fn", "free", Duration::from_secs(30)).await?;
    ensure!(
        !op.log().contains(PAUSED),
        "a cluster-wide freeze paused a namespaced operator"
    );

    let out = capstan(
        &env,
        &["freeze", "-n", "default", "--lifetime", "30", "--priority", "100"],
    )
    .await?;
    ensure!(
        out.contains("froze capstanpeering/default (namespace default)"),
        "freeze said: {out}"
    );
    op.wait_log(PAUSED, 1, Duration::from_secs(20)).await?;
    create_example(&env, "held", json!({})).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(
        op.count("create_fn", "held") == 0,
        "a frozen operator invoked a handler"
    );
    capstan(&env, &["resume", "-n", "default"]).await?;
    op.wait_log(RESUMED, 1, Duration::from_secs(20)).await?;
    op.wait_call("create_fn", "held", Duration::from_secs(30)).await?;
    op.stop().await?;
    env.stop().await
}

#[tokio::test]
async fn a_crashed_dev_operator_freezes_others_only_until_its_lifetime_expires() -> Result<()> {
    let env = env_with_crds(true).await?;
    let normal = Operator::start(&env, "normal", "create", &[]).await?;
    let mut dev = Operator::start(&env, "dev", "create", &["--dev", "--peering-lifetime", "5s"]).await?;
    normal.wait_log(PAUSED, 1, Duration::from_secs(20)).await?;

    // SIGKILL: the dev operator cannot leave the peering; its entry expires instead.
    dev.controller.process.kill().await?;
    let killed = tokio::time::Instant::now();
    dev.handler.kill().await?;
    create_example(&env, "orphaned", json!({})).await?;
    normal.wait_log(RESUMED, 1, Duration::from_secs(30)).await?;
    let took = killed.elapsed();
    ensure!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(15),
        "resumed {took:?} after the dev operator died (its lifetime is 5 s)"
    );
    normal
        .wait_call("create_fn", "orphaned", Duration::from_secs(30))
        .await?;
    Ok(())
}

#[tokio::test]
async fn capstan_freeze_pauses_and_capstan_resume_resumes() -> Result<()> {
    let env = env_with_crds(true).await?;
    let op = Operator::start(&env, "op", "create,daemon", &[]).await?;
    create_example(&env, "watched", json!({})).await?;
    op.wait_line("monitor watched ", 1, Duration::from_secs(30))
        .await?;

    let out = capstan(
        &env,
        &[
            "freeze",
            "--lifetime",
            "30",
            "--priority",
            "100",
            "--message",
            "maintenance",
        ],
    )
    .await?;
    ensure!(
        out.contains("froze clustercapstanpeering/default"),
        "freeze said: {out}"
    );
    ensure!(
        out.contains("pausing: "),
        "freeze did not name the paused operator: {out}"
    );
    op.wait_log(PAUSED, 1, Duration::from_secs(20)).await?;
    ensure!(
        op.log().contains("maintenance"),
        "the pause does not carry the freeze's message"
    );
    // Daemons stop while frozen, and start again on resume.
    op.wait_line(
        "daemon-stopped watched CANCEL_REASON_PAUSED",
        1,
        Duration::from_secs(20),
    )
    .await?;
    create_example(&env, "frozen", json!({})).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    ensure!(
        op.count("create_fn", "frozen") == 0,
        "a frozen operator invoked a handler"
    );

    let out = capstan(&env, &["resume"]).await?;
    ensure!(
        out.contains("resumed clustercapstanpeering/default"),
        "resume said: {out}"
    );
    op.wait_log(RESUMED, 1, Duration::from_secs(20)).await?;
    op.wait_call("create_fn", "frozen", Duration::from_secs(30))
        .await?;
    op.wait_line("monitor watched ", 2, Duration::from_secs(30))
        .await?;

    // A freeze also ends by itself when its lifetime expires.
    capstan(&env, &["freeze", "--lifetime", "3"]).await?;
    op.wait_log(PAUSED, 2, Duration::from_secs(20)).await?;
    op.wait_log(RESUMED, 2, Duration::from_secs(20)).await?;

    let out = capstan(&env, &["resume"]).await?;
    ensure!(
        out.contains("had expired already"),
        "resume of an expired freeze said: {out}"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    ensure!(
        op.count("create_fn", "frozen") == 1,
        "the object frozen earlier was handled twice"
    );
    op.stop().await?;
    env.stop().await
}

#[tokio::test]
async fn operators_with_the_same_priority_are_warned_about() -> Result<()> {
    let env = env_with_crds(true).await?;
    let mut one = Controller::start(&env, "one", &[]).await?;
    let mut two = Controller::start(&env, "two", &[]).await?;
    let warning = "possibly conflicting operators with the same priority";
    two.process.wait_for(warning, Duration::from_secs(20)).await?;
    one.process.wait_for(warning, Duration::from_secs(20)).await?;
    one.process.terminate().await?;
    two.process.terminate().await?;
    env.stop().await
}

#[tokio::test]
async fn capstan_refuses_to_start_dev_mode_without_the_peering_crds() -> Result<()> {
    let env = env_with_crds(false).await?;
    let err = match Controller::start(&env, "dev", &["--dev"]).await {
        Ok(_) => bail!("a --dev controller started without the peering CRDs"),
        Err(e) => e.to_string(),
    };
    ensure!(
        err.contains("capstan crds | kubectl apply -f -") && err.contains("--standalone"),
        "unclear error: {err}"
    );
    env.stop().await
}

async fn leadership(c: &Controller) -> Result<String> {
    let (_, body) = c.admin_get("/readyz").await?;
    let report: Value = serde_json::from_str(&body)?;
    Ok(report["checks"]["leadership"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned())
}

#[tokio::test]
async fn replicas_elect_one_leader_and_a_standby_takes_over_after_a_crash() -> Result<()> {
    let env = env_with_crds(true).await?;
    let election = [
        "--leader-election",
        "--lease-duration",
        "4s",
        "--renew-deadline",
        "3s",
        "--retry-period",
        "1s",
        "--shutdown-grace",
        "2s",
    ];
    let mut a = Operator::start(&env, "a", "create", &election).await?;
    a.wait_log("became the leader", 1, Duration::from_secs(20))
        .await?;
    let b = Operator::start(&env, "b", "create", &election).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (la, lb) = (leadership(&a.controller).await?, leadership(&b.controller).await?);
        if la == "leader" && lb.starts_with("standby (leader: ") {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "readiness does not show the leader: a={la:?} b={lb:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    create_example(&env, "one", json!({})).await?;
    a.wait_call("create_fn", "one", Duration::from_secs(30)).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !handled(&env, "one").await? {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "one was not recorded as handled"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // A change in progress when the leader dies: the standby must complete it.
    create_example(&env, "slow", json!({"sleep": {"create_fn": 5}})).await?;
    a.wait_call("create_fn", "slow", Duration::from_secs(30)).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    ensure!(
        b.count("create_fn", "one") == 0 && b.count("create_fn", "slow") == 0,
        "the standby invoked handlers"
    );

    a.controller.process.kill().await?;
    let killed = tokio::time::Instant::now();
    a.handler.kill().await?;
    create_example(&env, "leaderless", json!({})).await?;

    b.wait_log("became the leader", 1, Duration::from_secs(15))
        .await?;
    let took = killed.elapsed();
    // One lease duration as observed by the standby, plus one retry period and some slack.
    ensure!(
        took < Duration::from_secs(7),
        "the standby took over after {took:?}"
    );
    b.wait_call("create_fn", "leaderless", Duration::from_secs(30))
        .await?;
    b.wait_call("create_fn", "slow", Duration::from_secs(30)).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !(handled(&env, "slow").await? && handled(&env, "leaderless").await?) {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the new leader did not complete the pending changes:\n{}",
            tail(&b.log(), 30)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    ensure!(
        a.count("create_fn", "one") + b.count("create_fn", "one") == 1,
        "a completed change was handled again"
    );
    ensure!(
        b.count("create_fn", "slow") == 1 && b.count("create_fn", "leaderless") == 1,
        "the new leader ran a handler twice"
    );
    ensure!(
        !b.log().contains("possibly conflicting operators"),
        "replicas sharing a lease were reported as conflicting"
    );
    ensure!(leadership(&b.controller).await? == "leader");
    let (_, metrics) = b.controller.admin_get("/metrics").await?;
    ensure!(
        metrics.lines().any(|l| l == "capstan_leader 1"),
        "the leader's metrics do not say so:\n{metrics}"
    );
    b.stop().await?;
    env.stop().await
}

#[tokio::test]
async fn a_leader_that_exits_cleanly_hands_over_at_once() -> Result<()> {
    let env = env_with_crds(false).await?;
    let election = [
        "--leader-election",
        "--lease-duration",
        "15s",
        "--renew-deadline",
        "10s",
        "--retry-period",
        "1s",
    ];
    let a = Operator::start(&env, "a", "create", &election).await?;
    a.wait_log("became the leader", 1, Duration::from_secs(20))
        .await?;
    let b = Operator::start(&env, "b", "create", &election).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stopped = tokio::time::Instant::now();
    a.stop().await?;
    b.wait_log("became the leader", 1, Duration::from_secs(10))
        .await?;
    let took = stopped.elapsed();
    ensure!(
        took < Duration::from_secs(8),
        "handover after a clean exit took {took:?}"
    );
    create_example(&env, "handover", json!({})).await?;
    b.wait_call("create_fn", "handover", Duration::from_secs(30))
        .await?;
    b.stop().await?;
    env.stop().await
}
