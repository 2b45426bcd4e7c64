//! API faults: the API server frozen (SIGSTOP) for longer than the controller's request
//! timeout, and a proxy between the controller and the API server that refuses, resets,
//! delays and half-closes connections. After each fault processing resumes by itself, every
//! object is handled exactly once (nothing done twice, nothing lost), and the outage shows on
//! `/readyz` while `/healthz` stays healthy (an unreachable API server must not get the
//! controller restarted).

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use capstan_tests::{
    faults,
    proxy::{Fault, Proxy},
    scenario::{Scenario, annotation},
    testenv::TestEnv,
};
use serde_json::json;

fn handled(o: &serde_json::Value) -> bool {
    annotation(o, "capstan.dev/last-handled-configuration").is_some()
}

/// Sends a signal to a process.
async fn signal(pid: u32, sig: &str) -> Result<()> {
    let status = tokio::process::Command::new("kill")
        .args([sig, &pid.to_string()])
        .status()
        .await?;
    ensure!(status.success(), "kill {sig} {pid} failed");
    Ok(())
}

/// Polls the admin pages for `duration`: whether `/readyz` ever failed, and the `/healthz`
/// answers that were not 200.
async fn watch_health(s: &Scenario, duration: Duration) -> (bool, Vec<u16>) {
    let deadline = tokio::time::Instant::now() + duration;
    let mut not_ready = false;
    let mut unhealthy = Vec::new();
    while tokio::time::Instant::now() < deadline {
        if let Ok((code, _)) = s.controller.admin_get("/readyz").await
            && code != 200
        {
            not_ready = true;
        }
        if let Ok((code, _)) = s.controller.admin_get("/healthz").await
            && code != 200
        {
            unhealthy.push(code);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    (not_ready, unhealthy)
}

#[tokio::test]
async fn a_frozen_api_server_shows_on_readyz_only_and_nothing_is_done_twice() -> Result<()> {
    let freeze = Duration::from_secs(faults::size(35, 120) as u64);
    let s = Scenario::start("create", &[]).await?;
    s.create("before", json!({})).await?;
    s.wait("before", Duration::from_secs(30), "handled", handled)
        .await?;
    // A handler in flight when the API server stops: its result is written after the thaw.
    s.create("inflight", json!({"sleep": {"create_fn": 2}})).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while s.count("create_fn", "inflight") == 0 {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the handler was never called"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pid = s.env.pid().context("the API server is not running")?;
    signal(pid, "-STOP").await?;
    let (not_ready, unhealthy) = watch_health(&s, freeze).await;
    signal(pid, "-CONT").await?;
    ensure!(
        unhealthy.is_empty(),
        "/healthz failed while only the API server was unreachable: {unhealthy:?}"
    );

    let t = Duration::from_secs(90);
    s.wait("inflight", t, "handled after the thaw", handled).await?;
    s.create("after", json!({})).await?;
    s.wait("after", t, "handled after the thaw", handled).await?;
    for name in ["before", "inflight", "after"] {
        ensure!(
            s.count("create_fn", name) == 1,
            "{name} was handled {} times",
            s.count("create_fn", name)
        );
    }
    let deadline = tokio::time::Instant::now() + t;
    while s.controller.admin_get("/readyz").await?.0 != 200 {
        ensure!(tokio::time::Instant::now() < deadline, "/readyz did not recover");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    println!("API server frozen for {freeze:?}: processing resumed, nothing done twice");
    ensure!(not_ready, "/readyz stayed ready through a {freeze:?} API outage");
    Ok(())
}

#[tokio::test]
async fn refused_reset_delayed_and_half_closed_connections_are_survived() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let (proxy, proxied) = Proxy::in_front_of(&env).await?;
    let s = Scenario::attach(env, &proxied, "create", &[], "default").await?;

    let rounds = faults::size(1, 5);
    let outage = Duration::from_secs(8);
    let frozen_outage = Duration::from_secs(25);
    let mut injected = 0;
    let mut names = Vec::new();
    let mut always_ready = Vec::new();
    let mut restarted_by_liveness = Vec::new();
    for round in 0..rounds {
        for fault in [
            Fault::Refused,
            Fault::Reset,
            Fault::Delayed(Duration::from_millis(300)),
            Fault::HalfClosed,
            Fault::Frozen,
        ] {
            let name = format!(
                "{}-{round}",
                format!("{fault:?}").to_lowercase().replace(['(', ')', ' '], "")
            );
            let name: String = name
                .chars()
                .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
                .collect();
            proxy.set(fault);
            injected += 1;
            // The object changes while the controller cannot reach the API server.
            s.create(&name, json!({})).await?;
            // A frozen connection is known only by a deadline: the controller asks an API
            // server that has not answered for 5 s, and gives that request 5 s.
            let outage = if fault == Fault::Frozen {
                frozen_outage
            } else {
                outage
            };
            let (not_ready, unhealthy) = watch_health(&s, outage).await;
            proxy.set(Fault::None);
            if !unhealthy.is_empty() {
                restarted_by_liveness.push((fault, unhealthy));
            }
            if matches!(fault, Fault::Refused | Fault::Frozen) && !not_ready {
                always_ready.push(fault);
            }
            s.wait(&name, Duration::from_secs(90), "handled after the fault", handled)
                .await
                .with_context(|| format!("after {fault:?}"))?;
            names.push(name);
        }
    }
    for name in &names {
        ensure!(
            s.count("create_fn", name) == 1,
            "{name} was handled {} times",
            s.count("create_fn", name)
        );
    }
    println!("{injected} network faults injected; every object handled exactly once");
    ensure!(
        restarted_by_liveness.is_empty(),
        "/healthz failed while only the API server was unreachable: {restarted_by_liveness:?}"
    );
    ensure!(
        always_ready.is_empty(),
        "/readyz stayed ready through the outages of {always_ready:?}"
    );
    Ok(())
}

/// Polls `/healthz` every 50 ms for `duration`; the answers that were not 200, with their
/// bodies (which name the failing check).
async fn healthz_failures(s: &Scenario, duration: Duration) -> Vec<(u16, String)> {
    let deadline = tokio::time::Instant::now() + duration;
    let mut failures = Vec::new();
    while tokio::time::Instant::now() < deadline {
        if let Ok((code, body)) = s.controller.admin_get("/healthz").await
            && code != 200
        {
            failures.push((code, body));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    failures
}

#[tokio::test]
async fn healthz_stays_healthy_from_the_first_moment_the_api_server_stops_accepting() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let (proxy, proxied) = Proxy::in_front_of(&env).await?;
    let s = Scenario::attach(env, &proxied, "create", &[], "default").await?;
    s.create("before", json!({})).await?;
    s.wait("before", Duration::from_secs(30), "handled", handled)
        .await?;

    let rounds = faults::size(2, 10);
    let mut failures = Vec::new();
    for round in 0..rounds {
        for fault in [Fault::Refused, Fault::Reset] {
            // The watches are established and the server answered a moment ago: the outage
            // starts now, and liveness must not follow it at any moment.
            proxy.set(fault);
            for (code, body) in healthz_failures(&s, Duration::from_secs(4)).await {
                failures.push(format!("{fault:?} (round {round}): {code} {body}"));
            }
            proxy.set(Fault::None);
            let name = format!("after-{}-{round}", format!("{fault:?}").to_lowercase());
            s.create(&name, json!({})).await?;
            s.wait(
                &name,
                Duration::from_secs(90),
                "handled after the outage",
                handled,
            )
            .await?;
        }
    }
    ensure!(
        failures.is_empty(),
        "/healthz failed while only the API server was unreachable:\n{}",
        failures.join("\n")
    );
    Ok(())
}
