//! End to end, with a proxy in front of the API server: a request on a connection that stopped
//! answering times out and is retried; while the API server refuses connections the controller
//! stays alive (`/healthz`) but not ready (`/readyz`, with the reason), and both recover; an
//! Event whose posting failed during the outage is posted once the server is back.

use std::time::Duration;

use anyhow::{Result, bail, ensure};
use capstan_tests::{
    proxy::Proxy,
    scenario::{Scenario, annotation, tail},
    testenv::TestEnv,
};
use k8s_openapi::api::core::v1::Event;
use kube::{Api, api::ListParams};
use serde_json::json;
use tokio::time::Instant;

/// A scenario whose controller talks to the API server through a proxy.
struct Proxied {
    s: Scenario,
    proxy: Proxy,
}

impl std::ops::Deref for Proxied {
    type Target = Scenario;

    fn deref(&self) -> &Scenario {
        &self.s
    }
}

impl Proxied {
    /// A testenv, a proxy in front of it, a controller that talks through the proxy and a
    /// handler process with `presets`.
    async fn start(presets: &str, args: &[&str]) -> Result<Self> {
        let env = TestEnv::start().await?;
        env.apply_example_crd().await?;
        let (proxy, proxied) = Proxy::in_front_of(&env).await?;
        let s = Scenario::attach(env, &proxied, presets, args, "default").await?;
        Ok(Self { s, proxy })
    }

    /// Waits until `name`'s change was handled (its diff-base is written).
    async fn handled(&self, name: &str, within: Duration) -> Result<()> {
        let api = self.api();
        let deadline = Instant::now() + within;
        loop {
            let o = serde_json::to_value(api.get(name).await?)?;
            if annotation(&o, "capstan.dev/last-handled-configuration").is_some() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "{name} was not handled within {within:?}\ncontroller:\n{}",
                    tail(&self.controller.process.output(), 40)
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    fn calls_of(&self, line: &str) -> usize {
        std::fs::read_to_string(&self.calls)
            .unwrap_or_default()
            .lines()
            .filter(|l| *l == line)
            .count()
    }

    async fn wait_call(&self, line: &str) -> Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.calls_of(line) == 0 {
            ensure!(Instant::now() < deadline, "no {line:?} in the call log");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Polls an admin path until it answers `want`; returns the body.
    async fn wait_admin(&self, path: &str, want: u16, within: Duration) -> Result<String> {
        let deadline = Instant::now() + within;
        loop {
            let (code, body) = self.controller.admin_get(path).await?;
            if code == want {
                return Ok(body);
            }
            if Instant::now() > deadline {
                bail!(
                    "{path} is {code}, not {want}: {body}\ncontroller:\n{}",
                    tail(&self.controller.process.output(), 30)
                );
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

#[tokio::test]
async fn a_write_on_a_connection_that_stopped_answering_times_out_and_is_retried() -> Result<()> {
    let s = Proxied::start("create", &["--watch-inactivity-timeout", "10s"]).await?;
    s.create("first", json!({})).await?;
    s.handled("first", Duration::from_secs(60)).await?;

    // The handler runs for 3 s; meanwhile every connection to the API server hangs, and the
    // ones that hung stay hung after the proxy recovers: only a timeout frees the write of the
    // handled change — the request's own over HTTP/1.1, the connection's keep-alive ping over
    // HTTP/2 (which the testenv's API server speaks), whichever comes first.
    s.create("cut", json!({"sleep": {"create_fn": 3}})).await?;
    s.wait_call("create_fn cut 1").await?;
    s.proxy.hold();
    s.proxy.freeze();
    tokio::time::sleep(Duration::from_secs(6)).await;
    s.proxy.unfreeze();
    s.handled("cut", Duration::from_secs(150)).await?;
    ensure!(
        s.calls_of("create_fn cut 1") == 1 && s.calls_of("create_fn cut 2") == 0,
        "the handler ran again"
    );
    let out = s.controller.process.output();
    ensure!(
        out.contains("did not answer within") || out.contains("keep-alive timed out"),
        "no request timed out:\n{}",
        tail(&out, 40)
    );
    s.create("after", json!({})).await?;
    s.handled("after", Duration::from_secs(60)).await?;
    Ok(())
}

#[tokio::test]
async fn an_unreachable_api_server_makes_the_controller_unready_but_not_dead() -> Result<()> {
    let s = Proxied::start("create", &["--watch-inactivity-timeout", "5s"]).await?;
    s.create("before", json!({})).await?;
    s.handled("before", Duration::from_secs(60)).await?;
    s.wait_admin("/healthz", 200, Duration::from_secs(30)).await?;
    s.wait_admin("/readyz", 200, Duration::from_secs(30)).await?;

    s.proxy.refuse();
    let body = s.wait_admin("/readyz", 503, Duration::from_secs(60)).await?;
    ensure!(
        body.contains("api-server") && body.contains("does not answer"),
        "/readyz does not say why: {body}"
    );
    // Longer than the chart's liveness tolerance (3 failures × 10 s).
    let outage = Instant::now() + Duration::from_secs(45);
    while Instant::now() < outage {
        let (code, body) = s.controller.admin_get("/healthz").await?;
        ensure!(
            code == 200,
            "/healthz failed while the API server was unreachable: {code} {body}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }

    s.proxy.accept();
    s.wait_admin("/readyz", 200, Duration::from_secs(90)).await?;
    s.wait_admin("/healthz", 200, Duration::from_secs(10)).await?;
    s.create("after", json!({})).await?;
    s.handled("after", Duration::from_secs(90)).await?;
    Ok(())
}

#[tokio::test]
async fn an_event_posted_while_the_api_server_refuses_appears_after_it_recovers() -> Result<()> {
    let s = Proxied::start("create3", &["--watch-inactivity-timeout", "5s"]).await?;
    // create_c logs "create_c says hello to <name>" (an Event) after sleeping 4 s.
    s.create("talk", json!({"sleep": {"create_c": 4}})).await?;
    s.wait_call("create_c talk 1").await?;
    s.proxy.refuse();
    tokio::time::sleep(Duration::from_secs(10)).await;
    s.proxy.accept();
    s.handled("talk", Duration::from_secs(90)).await?;
    let events: Api<Event> = Api::namespaced(s.env.client().await?, "default");
    let wanted = "create_c says hello to talk";
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let found = events
            .list(&ListParams::default())
            .await?
            .items
            .into_iter()
            .filter(|e| e.message.as_deref() == Some(wanted))
            .count();
        if found > 0 {
            ensure!(found == 1, "the Event was posted {found} times");
            break;
        }
        if Instant::now() > deadline {
            bail!(
                "the Event posted during the outage never appeared\ncontroller:\n{}\nhandler:\n{}",
                tail(&s.controller.process.output(), 40),
                tail(&s.handler.output(), 10)
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    Ok(())
}
