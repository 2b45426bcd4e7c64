//! End to end: a daemon's lifecycle is kopf's. One that returns (its result lands in
//! `status.<id>`) or fails permanently is done for its object while the controller runs, even
//! when the object changes or matches its filters anew; temporary errors restart it within its
//! `retries` and `timeout`; a filter mismatch stops it and a new match starts it again;
//! `initial_delay` postpones its start and `cancellation_backoff` lengthens the wait for it
//! when it is stopped; a lost handler process, however often, starts a running daemon again
//! and never a done one.

use std::time::Duration;

use capstan_tests::scenario::{Scenario, annotation};
use serde_json::{Value, json};
use tokio::time::Instant;

const T: Duration = Duration::from_secs(30);

/// How long nothing must happen for a "never again" check: several backoffs of the daemon.
const QUIET: Duration = Duration::from_secs(4);

fn log_lines(s: &Scenario) -> Vec<String> {
    std::fs::read_to_string(&s.calls)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

async fn wait_log(s: &Scenario, needle: &str, timeout: Duration) -> anyhow::Result<()> {
    let deadline = Instant::now() + timeout;
    while !log_lines(s).iter().any(|l| l.contains(needle)) {
        anyhow::ensure!(
            Instant::now() < deadline,
            "no {needle:?} in the handler log: {:?}",
            log_lines(s)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

async fn wait_count(s: &Scenario, handler: &str, name: &str, n: usize) -> anyhow::Result<()> {
    let deadline = Instant::now() + T;
    while s.count(handler, name) < n {
        anyhow::ensure!(
            Instant::now() < deadline,
            "{handler} ran {} times on {name}, not {n}: {:?}",
            s.count(handler, name),
            log_lines(s)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Touches an object twice: a spec change, then a filter mismatch and a new match.
async fn stir(s: &Scenario, name: &str) -> anyhow::Result<()> {
    s.patch(name, json!({"spec": {"stirred": 1}})).await?;
    s.patch(name, json!({"metadata": {"labels": {"e2e/run": "no"}}}))
        .await?;
    s.patch(name, json!({"metadata": {"labels": {"e2e/run": "yes"}}}))
        .await?;
    Ok(())
}

fn run_label() -> Value {
    json!({"labels": {"e2e/run": "yes"}})
}

#[tokio::test]
async fn a_daemon_that_returns_or_fails_for_good_is_never_started_again() -> anyhow::Result<()> {
    let mut s = Scenario::start("lifecycle-daemon", &[]).await?;
    s.create_with("returns", json!({"finish": {"monitor": true}}), run_label())
        .await?;
    s.create_with("fails", json!({"permanent": {"monitor": true}}), run_label())
        .await?;
    // Three attempts allowed, all three fail temporarily.
    s.create_with(
        "exhausted",
        json!({"temporary": {"monitor": 10}, "retryDelay": {"monitor": 0.5}}),
        run_label(),
    )
    .await?;
    let o = s
        .wait("returns", T, "the daemon's result in status", |o| {
            o.pointer("/status/monitor/finishedBy") == Some(&json!("monitor"))
        })
        .await?;
    assert_eq!(o.pointer("/status/monitor/attempt"), Some(&json!(1)), "{o}");
    wait_count(&s, "monitor", "fails", 1).await?;
    wait_count(&s, "monitor", "exhausted", 3).await?;
    s.controller
        .process
        .wait_for("the daemon ran out of retries", T)
        .await?;
    for name in ["returns", "fails", "exhausted"] {
        stir(&s, name).await?;
    }
    tokio::time::sleep(QUIET).await;
    assert_eq!(s.count("monitor", "returns"), 1, "{:?}", log_lines(&s));
    assert_eq!(s.count("monitor", "fails"), 1, "{:?}", log_lines(&s));
    assert_eq!(s.count("monitor", "exhausted"), 3, "{:?}", log_lines(&s));
    Ok(())
}

/// A lost handler process is not a daemon's failure, and a new watch (the resource loses its
/// handlers while no process is connected) does not forget which daemons are done.
#[tokio::test]
async fn handler_process_restarts_start_running_daemons_again_and_never_done_ones() -> anyhow::Result<()> {
    let mut s = Scenario::start("lifecycle-daemon", &[]).await?;
    s.create_with("returns", json!({"finish": {"monitor": true}}), run_label())
        .await?;
    s.create_with("runs", json!({}), run_label()).await?;
    s.wait("returns", T, "the daemon's result in status", |o| {
        o.pointer("/status/monitor/finishedBy") == Some(&json!("monitor"))
    })
    .await?;
    wait_count(&s, "monitor", "runs", 1).await?;
    // More restarts than the poison-pill guard's limit (3).
    for n in 2..=5 {
        s.handler.kill().await?;
        s.restart_handler().await?;
        wait_count(&s, "monitor", "runs", n).await?;
    }
    stir(&s, "returns").await?;
    tokio::time::sleep(QUIET).await;
    assert_eq!(s.count("monitor", "returns"), 1, "{:?}", log_lines(&s));
    Ok(())
}

#[tokio::test]
async fn temporary_errors_restart_a_daemon_within_its_limits_and_a_new_match_starts_it_again()
-> anyhow::Result<()> {
    let mut s = Scenario::start("lifecycle-daemon", &[]).await?;
    // Two temporary failures, then it runs: the third of three attempts.
    s.create_with("recovers", json!({"temporary": {"monitor": 2}}), run_label())
        .await?;
    // Fails temporarily forever, with a 4 s timeout and a 1 s delay: a few attempts, then done.
    s.create_with(
        "late",
        json!({"temporary": {"deadline": 100}}),
        json!({"labels": {"e2e/deadline": "yes"}}),
    )
    .await?;
    s.create_with("matches", json!({}), run_label()).await?;
    s.wait("recovers", T, "running after two failures", |o| {
        annotation(o, "e2e/daemon") == Some("running")
    })
    .await?;
    assert_eq!(s.count("monitor", "recovers"), 3);

    wait_log(&s, "monitor matches 1", T).await?;
    s.patch("matches", json!({"metadata": {"labels": {"e2e/run": "no"}}}))
        .await?;
    wait_log(&s, "daemon-stopped matches CANCEL_REASON_FILTER_MISMATCH", T).await?;
    s.patch("matches", json!({"metadata": {"labels": {"e2e/run": "yes"}}}))
        .await?;
    wait_count(&s, "monitor", "matches", 2).await?;

    s.controller
        .process
        .wait_for("the daemon ran out of time", T)
        .await?;
    let attempts = s.count("deadline", "late");
    assert!((2..=5).contains(&attempts), "{attempts} attempts in 4 s");
    tokio::time::sleep(QUIET).await;
    assert_eq!(s.count("deadline", "late"), attempts, "not started again");
    Ok(())
}

#[tokio::test]
async fn a_daemon_starts_after_its_initial_delay() -> anyhow::Result<()> {
    let s = Scenario::start("delayed-daemon", &[]).await?;
    let created = Instant::now();
    s.create("slow", json!({})).await?;
    wait_log(&s, "monitor slow 1", T).await?;
    let took = created.elapsed();
    assert!(took >= Duration::from_secs(3), "started after {took:?}");
    s.wait("slow", T, "daemon progress patch", |o| {
        annotation(o, "e2e/daemon") == Some("running")
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn a_stopped_daemon_is_waited_for_its_cancellation_backoff_and_timeout() -> anyhow::Result<()> {
    let mut s = Scenario::start("delayed-daemon", &[]).await?;
    s.create_with("stuck", json!({}), json!({"labels": {"e2e/stubborn": "yes"}}))
        .await?;
    wait_log(&s, "stubborn stuck", T).await?;
    let started = Instant::now();
    s.delete("stuck").await?;
    s.wait_gone("stuck", T).await?;
    let took = started.elapsed();
    // 2 s of backoff plus 1 s of timeout before it is abandoned and the finalizer goes.
    assert!(took >= Duration::from_secs(3), "abandoned after {took:?}");
    s.controller
        .process
        .wait_for("ignored its cancellation", Duration::from_secs(5))
        .await?;
    Ok(())
}
