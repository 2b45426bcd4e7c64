//! The admin endpoint (`/healthz`, `/readyz`, `/metrics`) has no authentication, so nothing
//! of the handled objects may appear on it: neither names, namespaces or uids, nor spec,
//! label or annotation values, nor handler messages. Checked on every page while objects are
//! being handled (a handler sleeping mid-invocation, another failing with a message that
//! quotes the object) and after.

use std::time::Duration;

use anyhow::{Result, ensure};
use capstan_tests::scenario::{Scenario, annotation};
use serde_json::json;

const T: Duration = Duration::from_secs(60);

/// What must never be served: parts of the objects and of what handlers said about them.
const SECRETS: [&str; 6] = [
    "confidential-object-name",
    "sentinel-spec-value-7f3a",
    "sentinel-label-value-91c2",
    "sentinel-annotation-value-e4d0",
    "tenant-namespace-b8",
    "temporary failure",
];

async fn pages(s: &Scenario) -> Result<Vec<(String, u16, String)>> {
    let mut out = Vec::new();
    for path in ["/", "/healthz", "/livez", "/readyz", "/metrics", "/no-such-page"] {
        let (code, body) = s.controller.admin_get(path).await?;
        out.push((path.to_owned(), code, body));
    }
    Ok(out)
}

fn check(pages: &[(String, u16, String)], uids: &[String]) -> Result<()> {
    for (path, _, body) in pages {
        for secret in SECRETS.iter().copied().chain(uids.iter().map(String::as_str)) {
            ensure!(
                !body.contains(secret),
                "{path} shows object data ({secret:?}):\n{body}"
            );
        }
    }
    Ok(())
}

#[tokio::test]
async fn no_admin_page_shows_object_data_while_objects_are_handled() -> Result<()> {
    let mut s = Scenario::start("create3,update,delete", &[]).await?;
    s.namespace = "tenant-namespace-b8".into();
    s.env.kubectl_ok(&["create", "namespace", &s.namespace]).await?;
    let metadata = json!({
        "labels": {"team": "sentinel-label-value-91c2"},
        "annotations": {"note": "sentinel-annotation-value-e4d0"},
    });
    let mut uids = Vec::new();
    // One object whose first handler sleeps (in flight while the pages are read), one whose
    // handler fails temporarily with a message, so that both states are on the pages.
    let slow = s
        .create_with(
            "confidential-object-name-slow",
            json!({"secret": "sentinel-spec-value-7f3a", "sleep": {"create_a": 4}}),
            metadata.clone(),
        )
        .await?;
    let failing = s
        .create_with(
            "confidential-object-name-failing",
            json!({"secret": "sentinel-spec-value-7f3a", "temporary": {"create_b": 2}}),
            metadata,
        )
        .await?;
    for obj in [&slow, &failing] {
        uids.push(obj["metadata"]["uid"].as_str().unwrap_or_default().to_owned());
    }
    ensure!(uids.iter().all(|u| !u.is_empty()), "objects without uids");

    // While handling: a handler is sleeping, another one is being retried.
    let deadline = tokio::time::Instant::now() + T;
    while s.count("create_a", "confidential-object-name-slow") == 0 {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the slow handler was never called"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let during = pages(&s).await?;
    check(&during, &uids)?;
    let metrics = &during
        .iter()
        .find(|(p, _, _)| p == "/metrics")
        .map(|(_, _, b)| b.clone())
        .unwrap_or_default();
    ensure!(
        metrics.contains("capstan_handler_processes 1"),
        "the pages were read while a handler process was connected:\n{metrics}"
    );

    for name in [
        "confidential-object-name-slow",
        "confidential-object-name-failing",
    ] {
        s.wait(name, T, "handled", |o| {
            annotation(o, "capstan.dev/last-handled-configuration").is_some()
        })
        .await?;
    }
    s.patch(
        "confidential-object-name-slow",
        json!({"spec": {"secret": "sentinel-spec-value-7f3a-2"}}),
    )
    .await?;
    s.delete("confidential-object-name-failing").await?;
    s.wait_gone("confidential-object-name-failing", T).await?;

    let after = pages(&s).await?;
    check(&after, &uids)?;
    let metrics = after
        .iter()
        .find(|(p, _, _)| p == "/metrics")
        .map(|(_, _, b)| b.clone())
        .unwrap_or_default();
    ensure!(
        metrics.contains("capstan_handler_retries_total{handler=\"create_b\"}"),
        "the retry was counted (by handler, not by object):\n{metrics}"
    );
    s.handler.terminate().await?;
    s.controller.process.terminate().await?;
    s.env.stop().await
}
