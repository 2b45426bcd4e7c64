//! End to end: daemons and timers live in the handler process while the controller owns their
//! lifecycle — started with the object, stopped on deletion (then the finalizer goes) and
//! while the object does not match the filters, restarted after failures and reconnects,
//! abandoned when they ignore cancellation, and stopped at shutdown; timers tick on interval,
//! sharp, idle and initial-delay schedules.

use std::time::Duration;

use capstan_tests::scenario::{Scenario, annotation, has_finalizer};
use serde_json::json;
use tokio::time::Instant;

const T: Duration = Duration::from_secs(30);

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

#[tokio::test]
async fn a_daemon_starts_with_its_object_and_stops_before_the_finalizer_goes() -> anyhow::Result<()> {
    let s = Scenario::start("daemon", &[]).await?;
    s.create("d1", json!({})).await?;
    let o = s
        .wait("d1", T, "daemon progress patch", |o| {
            annotation(o, "e2e/daemon") == Some("running")
        })
        .await?;
    assert!(has_finalizer(&o), "daemons keep the finalizer");
    assert_eq!(s.count("monitor", "d1"), 1);
    s.delete("d1").await?;
    s.wait_gone("d1", T).await?;
    assert!(
        log_lines(&s)
            .iter()
            .any(|l| l == "daemon-stopped d1 CANCEL_REASON_RESOURCE_DELETED"),
        "{:?}",
        log_lines(&s)
    );
    Ok(())
}

#[tokio::test]
async fn a_daemon_stops_when_its_object_stops_matching_and_starts_when_it_matches_again() -> anyhow::Result<()>
{
    let s = Scenario::start("filtered-daemon", &[]).await?;
    s.create_with("d5", json!({}), json!({"labels": {"e2e/run": "yes"}}))
        .await?;
    wait_log(&s, "monitor d5 ", T).await?;
    s.patch("d5", json!({"metadata": {"labels": {"e2e/run": "no"}}}))
        .await?;
    wait_log(&s, "daemon-stopped d5 CANCEL_REASON_FILTER_MISMATCH", T).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        s.count("monitor", "d5"),
        1,
        "not restarted while it does not match"
    );
    s.patch("d5", json!({"metadata": {"labels": {"e2e/run": "yes"}}}))
        .await?;
    let deadline = Instant::now() + T;
    while s.count("monitor", "d5") < 2 {
        anyhow::ensure!(Instant::now() < deadline, "the daemon did not start again");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

#[tokio::test]
async fn a_failed_daemon_is_restarted_after_its_backoff() -> anyhow::Result<()> {
    let s = Scenario::start("daemon", &[]).await?;
    s.create("d2", json!({"temporary": {"monitor": 1}})).await?;
    s.wait("d2", T, "running after a restart", |o| {
        annotation(o, "e2e/daemon") == Some("running")
    })
    .await?;
    assert_eq!(s.count("monitor", "d2"), 2, "failed once, restarted once");
    Ok(())
}

#[tokio::test]
async fn a_daemon_ignoring_cancellation_is_abandoned_and_deletion_proceeds() -> anyhow::Result<()> {
    let mut s = Scenario::start("stubborn-daemon", &[]).await?;
    s.create("d3", json!({})).await?;
    s.wait("d3", T, "finalizer", has_finalizer).await?;
    wait_log(&s, "stubborn d3", T).await?;
    let started = Instant::now();
    s.delete("d3").await?;
    s.wait_gone("d3", T).await?;
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "the cancellation timeout was waited for"
    );
    s.controller
        .process
        .wait_for("ignored its cancellation", Duration::from_secs(5))
        .await?;
    Ok(())
}

#[tokio::test]
async fn daemons_restart_when_the_handler_process_reconnects() -> anyhow::Result<()> {
    let mut s = Scenario::start("daemon", &[]).await?;
    s.create("d4", json!({})).await?;
    wait_log(&s, "monitor d4 1", T).await?;
    s.handler.kill().await?;
    s.restart_handler().await?;
    wait_log(&s, "monitor d4 2", T).await?;
    Ok(())
}

#[tokio::test]
async fn shutdown_stops_all_daemons_within_the_grace_period() -> anyhow::Result<()> {
    let mut s = Scenario::start("daemon", &[]).await?;
    for name in ["s1", "s2"] {
        s.create(name, json!({})).await?;
    }
    for name in ["s1", "s2"] {
        s.wait(name, T, "daemon running", |o| {
            annotation(o, "e2e/daemon") == Some("running")
        })
        .await?;
    }
    let started = Instant::now();
    let status = s.controller.process.terminate().await?;
    assert!(status.success(), "{status}");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "stopped in {:?}",
        started.elapsed()
    );
    for name in ["s1", "s2"] {
        if let Err(e) = wait_log(&s, &format!("daemon-stopped {name}"), Duration::from_secs(5)).await {
            anyhow::bail!(
                "{e}\ncontroller:\n{}",
                capstan_tests::scenario::tail(&s.controller.process.output(), 60)
            );
        }
    }
    Ok(())
}

fn ticks(o: &serde_json::Value) -> u64 {
    o.pointer("/status/ticks")
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0)
}

#[tokio::test]
async fn a_timer_ticks_on_its_interval_with_the_latest_body() -> anyhow::Result<()> {
    let s = Scenario::start("timer", &[]).await?;
    s.create("t1", json!({})).await?;
    let started = Instant::now();
    s.wait("t1", T, "three ticks", |o| ticks(o) >= 3).await?;
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1800) && took < Duration::from_secs(10),
        "three ticks took {took:?}"
    );
    Ok(())
}

/// The start times of `handler`'s ticks on `object` (ms), from the handler's `tick-at` notes.
fn tick_starts(s: &Scenario, handler: &str, object: &str) -> Vec<u128> {
    s.notes("tick-at")
        .into_iter()
        .filter_map(|words| match words.as_slice() {
            [h, o, ms] if h == handler && o == object => ms.parse().ok(),
            _ => None,
        })
        .collect()
}

/// Waits for `n` tick starts of `handler` on `object`; returns the gaps between them (ms).
async fn tick_gaps(s: &Scenario, handler: &str, object: &str, n: usize) -> anyhow::Result<Vec<u128>> {
    let deadline = Instant::now() + T;
    loop {
        let starts = tick_starts(s, handler, object);
        if starts.len() >= n {
            return Ok(starts.windows(2).map(|w| w[1].saturating_sub(w[0])).collect());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{handler} ticked {} times on {object}",
            starts.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_sharp_timer_keeps_its_schedule_and_a_slow_one_never_overlaps() -> anyhow::Result<()> {
    let s = Scenario::start("steady-and-sharp", &[]).await?;
    // Each tick takes 0.5 s with a 1 s interval: sharp ticks start every 1 s, steady ones
    // every 1.5 s (the interval counts from the end of the previous tick).
    s.create("half", json!({"tickSleep": 0.5})).await?;
    let sharp = tick_gaps(&s, "sharp", "half", 5).await?;
    let steady = tick_gaps(&s, "steady", "half", 4).await?;
    println!("gaps (ms): sharp {sharp:?}, steady {steady:?}");
    // A late tick start (a busy machine) lengthens one gap and, on the sharp schedule,
    // shortens the next: compare the sharp schedule by its mean, the steady one by its floor.
    let mean = |gaps: &[u128]| gaps.iter().sum::<u128>() / gaps.len().max(1) as u128;
    assert!((900..=1400).contains(&mean(&sharp)), "sharp gaps (ms): {sharp:?}");
    assert!(
        steady.iter().all(|g| *g >= 1450),
        "steady ticks wait the interval after the tick's end (ms): {steady:?}"
    );
    // Slower than the interval: a warning, and the next sharp tick waits for the next slot
    // of the schedule (2 s later) instead of overlapping.
    s.create("slow", json!({"tickSleep": 1.3})).await?;
    let gaps = tick_gaps(&s, "sharp", "slow", 3).await?;
    assert!(
        (1700..=2700).contains(&mean(&gaps)),
        "slow sharp gaps (ms): {gaps:?}"
    );
    assert!(
        s.controller
            .process
            .output()
            .contains("the timer handler is slower than its interval"),
        "no warning about the slow timer"
    );
    Ok(())
}

#[tokio::test]
async fn an_idle_timer_waits_until_the_object_stops_changing() -> anyhow::Result<()> {
    let s = Scenario::start("idle-timer", &[]).await?;
    s.create("t3", json!({"size": 0})).await?;
    // Keep changing the spec for 3 s: no tick.
    for i in 1..=6 {
        s.patch("t3", json!({"spec": {"size": i}})).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(
        s.count("tick", "t3"),
        0,
        "no tick while the object keeps changing"
    );
    s.wait("t3", T, "ticks once idle", |o| ticks(o) >= 2).await?;
    Ok(())
}

#[tokio::test]
async fn a_timer_waits_for_its_initial_delay() -> anyhow::Result<()> {
    let s = Scenario::start("delayed-timer", &[]).await?;
    s.create("t4", json!({})).await?;
    let started = Instant::now();
    s.wait("t4", T, "first tick", |o| ticks(o) >= 1).await?;
    assert!(
        started.elapsed() >= Duration::from_millis(2500),
        "ticked after {:?}",
        started.elapsed()
    );
    Ok(())
}
