//! End to end: a handler creates a child object and adopts it with the SDK's hierarchy helpers
//! (kopf's `adopt`): the child carries a controller owner reference to the handler's object,
//! a name generated from the owner's, the owner's namespace and the owner's labels.

use std::time::Duration;

use capstan_tests::{process::start_handler, scenario::Scenario};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Api;
use serde_json::json;

const T: Duration = Duration::from_secs(60);

#[tokio::test]
async fn a_handler_adopts_the_child_it_creates() -> anyhow::Result<()> {
    let mut s = Scenario::start("parity", &[]).await?;
    // The handler process creates children itself, with its own client.
    s.handler.kill().await?;
    let log = s.calls.to_string_lossy().into_owned();
    let kubeconfig = s.env.kubeconfig.to_string_lossy().into_owned();
    s.handler = start_handler(
        &s.env,
        "handler-children",
        &s.controller.endpoint(),
        &[
            ("E2E_HANDLERS", "parity"),
            ("E2E_LOG", log.as_str()),
            ("KUBECONFIG", kubeconfig.as_str()),
        ],
    )?;
    let owner = s
        .create_with(
            "family",
            json!({}),
            json!({"labels": {"e2e/case": "children", "team": "blue"}}),
        )
        .await?;
    let o = s
        .wait("family", T, "the child's name in status", |o| {
            o.pointer("/status/spawn_child/child").is_some()
        })
        .await?;
    let name = o
        .pointer("/status/spawn_child/child")
        .and_then(serde_json::Value::as_str)
        .unwrap_or_default()
        .to_owned();
    assert!(name.starts_with("family-"), "named after its owner: {name}");
    let child = Api::<ConfigMap>::namespaced(s.client.clone(), "default")
        .get(&name)
        .await?;
    let refs = child.metadata.owner_references.unwrap_or_default();
    assert_eq!(refs.len(), 1, "{refs:?}");
    let r = &refs[0];
    assert_eq!(
        Some(r.uid.as_str()),
        owner.pointer("/metadata/uid").and_then(|v| v.as_str())
    );
    assert_eq!(
        (r.api_version.as_str(), r.kind.as_str(), r.name.as_str()),
        ("demo.capstan.dev/v1", "Example", "family")
    );
    assert_eq!((r.controller, r.block_owner_deletion), (Some(true), Some(true)));
    let labels = child.metadata.labels.unwrap_or_default();
    assert_eq!(labels.get("team").map(String::as_str), Some("blue"));
    assert_eq!(s.count("spawn_child", "family"), 1, "{:?}", s.calls());
    Ok(())
}
