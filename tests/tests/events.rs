//! End to end: handler outcomes and handler log records become Kubernetes Events on the
//! object, rate-limited so that a failing handler cannot flood the API; `--event-level` and
//! `--events false` narrow or switch them off.

use std::time::Duration;

use capstan_tests::scenario::{Scenario, annotation};
use k8s_openapi::api::core::v1::Event;
use kube::{Api, api::ListParams};
use serde_json::json;

const T: Duration = Duration::from_secs(30);

async fn events_of(s: &Scenario, name: &str) -> anyhow::Result<Vec<Event>> {
    let api: Api<Event> = Api::namespaced(s.client.clone(), &s.namespace);
    let list = api
        .list(&ListParams::default().fields(&format!("involvedObject.name={name}")))
        .await?;
    Ok(list.items)
}

#[tokio::test]
async fn outcomes_and_log_records_are_posted_as_events() -> anyhow::Result<()> {
    let s = Scenario::start("create3", &[]).await?;
    s.create("ev", json!({})).await?;
    s.wait("ev", T, "handled", |o| {
        annotation(o, "capstan.dev/last-handled-configuration").is_some()
    })
    .await?;
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let events = events_of(&s, "ev").await?;
        let messages: Vec<String> = events.iter().filter_map(|e| e.message.clone()).collect();
        let wanted = [
            "create_c says hello to ev",
            "Creation is processed: 3 succeeded; 0 failed.",
        ];
        if wanted.iter().all(|w| messages.iter().any(|m| m == w)) {
            let e = events
                .iter()
                .find(|e| e.message.as_deref() == Some(wanted[0]))
                .expect("found above");
            assert!(
                !messages.iter().any(|m| m.ends_with("succeeded.")),
                "one Event per handled change, not one per handler: {messages:?}"
            );
            assert_eq!(e.type_.as_deref(), Some("Normal"));
            assert_eq!(e.reason.as_deref(), Some("Logging"));
            assert_eq!(e.involved_object.kind.as_deref(), Some("Example"));
            assert_eq!(
                e.source.as_ref().and_then(|s| s.component.as_deref()),
                Some("capstan")
            );
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "events so far: {messages:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

#[tokio::test]
async fn a_handler_posts_events_on_other_objects_and_repeats_are_aggregated() -> anyhow::Result<()> {
    let s = Scenario::start("announce", &[]).await?;
    s.create("target", json!({})).await?;
    s.create("announcer", json!({"announceTo": "target"})).await?;
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let events = events_of(&s, "target").await?;
        let announced: Vec<&Event> = events
            .iter()
            .filter(|e| e.reason.as_deref() == Some("Announced"))
            .collect();
        if let [e] = announced.as_slice()
            && e.count == Some(2)
        {
            assert_eq!(e.message.as_deref(), Some("announcer says hello"));
            assert_eq!(e.involved_object.name.as_deref(), Some("target"));
            assert_eq!(e.involved_object.kind.as_deref(), Some("Example"));
            assert!(
                e.involved_object.uid.as_deref().is_some_and(|u| !u.is_empty()),
                "the controller fills in the uid: {e:?}"
            );
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "want one Announced Event with count 2 on target, got {announced:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

#[tokio::test]
async fn the_event_level_and_the_off_switch_are_honoured() -> anyhow::Result<()> {
    let handled = |o: &serde_json::Value| annotation(o, "capstan.dev/last-handled-configuration").is_some();
    // Warnings only: the retry is posted, successes and info records are not.
    let s = Scenario::start("create3", &["--event-level", "warning"]).await?;
    s.create("warned", json!({"temporary": {"create_a": 1}})).await?;
    s.wait("warned", T, "handled after one retry", handled).await?;
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let events = events_of(&s, "warned").await?;
        if events.iter().any(|e| e.type_.as_deref() == Some("Warning")) {
            tokio::time::sleep(Duration::from_secs(1)).await;
            let events = events_of(&s, "warned").await?;
            let normal: Vec<_> = events
                .iter()
                .filter(|e| e.type_.as_deref() != Some("Warning"))
                .filter_map(|e| e.message.clone())
                .collect();
            anyhow::ensure!(normal.is_empty(), "Normal Events below the level: {normal:?}");
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "no Warning Event for the retry"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // Off: nothing at all.
    let s = Scenario::start("create3", &["--events", "false"]).await?;
    s.create("silent", json!({"temporary": {"create_a": 1}})).await?;
    s.wait("silent", T, "handled after one retry", handled).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let events = events_of(&s, "silent").await?;
    anyhow::ensure!(events.is_empty(), "Events were posted: {events:?}");
    Ok(())
}

#[tokio::test]
async fn a_failing_handler_cannot_flood_the_api_with_events() -> anyhow::Result<()> {
    let s = Scenario::start("results", &[]).await?;
    s.create("noisy", json!({"temporary": {"create_fn": 40}})).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while s.count("create_fn", "noisy") < 16 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "too few attempts: {}",
            s.count("create_fn", "noisy")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let warnings = events_of(&s, "noisy")
        .await?
        .into_iter()
        .filter(|e| e.type_.as_deref() == Some("Warning"))
        .count();
    let attempts = s.count("create_fn", "noisy");
    assert!(
        warnings >= 5,
        "failures are reported: {warnings}\n{}",
        capstan_tests::scenario::tail(&s.controller.process.output(), 30)
    );
    assert!(
        warnings <= 13 && warnings < attempts,
        "{warnings} warning events for {attempts} failed attempts"
    );
    Ok(())
}

#[tokio::test]
async fn event_handlers_see_every_event_type_once_even_with_overlapping_selectors() -> anyhow::Result<()> {
    let mut s = Scenario::start("event-overlap", &[]).await?;
    let lines = |s: &Scenario| -> Vec<String> {
        std::fs::read_to_string(&s.calls)
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with("event "))
            .map(str::to_owned)
            .collect()
    };
    s.create("watched", json!({"size": 1})).await?;
    let wait_for = |s: &Scenario, line: &str| {
        let line = line.to_owned();
        let calls = s.calls.clone();
        async move {
            let deadline = tokio::time::Instant::now() + T;
            while !std::fs::read_to_string(&calls)
                .unwrap_or_default()
                .lines()
                .any(|l| l == line)
            {
                anyhow::ensure!(tokio::time::Instant::now() < deadline, "no {line:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            anyhow::Ok(())
        }
    };
    wait_for(&s, "event watched EVENT_TYPE_ADDED").await?;
    s.patch("watched", json!({"spec": {"size": 2}})).await?;
    wait_for(&s, "event watched EVENT_TYPE_MODIFIED").await?;
    // A restarted controller sees the object in its initial listing.
    s.controller.process.terminate().await?;
    s.controller = capstan_tests::process::Controller::start(&s.env, "capstan", &[]).await?;
    wait_for(&s, "event watched LISTING").await?;
    s.delete("watched").await?;
    wait_for(&s, "event watched EVENT_TYPE_DELETED").await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let seen = lines(&s);
    for t in [
        "EVENT_TYPE_ADDED",
        "EVENT_TYPE_MODIFIED",
        "LISTING",
        "EVENT_TYPE_DELETED",
    ] {
        let n = seen
            .iter()
            .filter(|l| **l == format!("event watched {t}"))
            .count();
        assert_eq!(
            n, 1,
            "{t} seen {n} times although three selectors name the resource: {seen:?}"
        );
    }
    Ok(())
}
