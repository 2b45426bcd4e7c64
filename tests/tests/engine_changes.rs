//! End to end, against a real API server, the real `capstan` binary and a real SDK handler
//! process: create, update, field, delete and resume flows; handler order and patch
//! visibility; finalizers; filters (labels, annotations, values, old/new); sub-handlers.

use std::time::Duration;

use capstan_tests::scenario::{Scenario, annotation, has_finalizer, label, progress_keys};
use serde_json::json;

const T: Duration = Duration::from_secs(30);

#[tokio::test]
async fn create_update_field_and_delete_run_as_kopf_would() -> anyhow::Result<()> {
    let s = Scenario::start("create3,update,field,delete", &[]).await?;
    s.create("one", json!({"field": "a", "size": 1})).await?;
    let obj = s
        .wait("one", T, "create handlers done", |o| {
            label(o, "e2e/b").is_some() && annotation(o, "e2e/field").is_some()
        })
        .await?;
    assert_eq!(label(&obj, "e2e/a"), Some("1"));
    assert_eq!(
        label(&obj, "e2e/b"),
        Some("saw-a-1"),
        "the second handler sees the first one's patch"
    );
    assert_eq!(
        annotation(&obj, "e2e/field"),
        Some("none->a"),
        "field handlers fire on creation"
    );
    assert!(has_finalizer(&obj), "a delete handler needs the finalizer");
    assert!(annotation(&obj, "capstan.dev/last-handled-configuration").is_some());
    assert!(
        progress_keys(&obj).is_empty(),
        "progress is purged once the cause is done: {:?}",
        progress_keys(&obj)
    );
    let order: Vec<String> = s.calls().into_iter().map(|c| c.0).collect();
    assert_eq!(order, ["create_a", "create_b", "create_c", "field_fn/spec.field"]);

    s.patch("one", json!({"spec": {"size": 2}})).await?;
    let obj = s
        .wait("one", T, "update handled", |o| {
            o.pointer("/status/update_fn/message").is_some()
        })
        .await?;
    assert_eq!(obj["status"]["update_fn"]["message"], "hello one");
    assert_eq!(
        s.count("field_fn/spec.field", "one"),
        1,
        "the field did not change"
    );

    s.patch("one", json!({"spec": {"field": "b"}})).await?;
    s.wait("one", T, "field handled", |o| {
        annotation(o, "e2e/field") == Some("a->b")
    })
    .await?;
    assert_eq!(s.count("update_fn", "one"), 2);

    s.delete("one").await?;
    s.wait_gone("one", T).await?;
    assert_eq!(s.count("delete_fn", "one"), 1);
    for h in ["create_a", "create_b", "create_c"] {
        assert_eq!(s.count(h, "one"), 1, "{h} ran once");
    }
    Ok(())
}

#[tokio::test]
async fn filters_select_objects_in_the_controller() -> anyhow::Result<()> {
    let s = Scenario::start("filtered,create", &[]).await?;
    s.create_with("chosen", json!({}), json!({"labels": {"e2e/select": "yes"}}))
        .await?;
    s.create_with("other", json!({}), json!({"labels": {"e2e/select": "no"}}))
        .await?;
    s.create_with(
        "skipped",
        json!({}),
        json!({"labels": {"e2e/select": "yes"}, "annotations": {"e2e/skip": "1"}}),
    )
    .await?;
    for name in ["chosen", "other", "skipped"] {
        s.wait(name, T, "handled", |o| {
            annotation(o, "capstan.dev/last-handled-configuration").is_some()
        })
        .await?;
    }
    assert_eq!(s.count("selected_fn", "chosen"), 1);
    assert_eq!(s.count("selected_fn", "other"), 0);
    assert_eq!(s.count("selected_fn", "skipped"), 0);
    assert_eq!(s.count("create_fn", "other"), 1);
    Ok(())
}

#[tokio::test]
async fn value_presence_and_old_new_filters_select_in_the_controller() -> anyhow::Result<()> {
    let s = Scenario::start("value-filtered,create", &[]).await?;
    let team = json!({"labels": {"e2e/team": "x"}});
    s.create_with("three", json!({"size": 3}), team.clone()).await?;
    s.create_with("four", json!({"size": 4}), team).await?;
    s.create("anonymous", json!({"size": 3})).await?;
    for name in ["three", "four", "anonymous"] {
        s.wait(name, T, "handled", |o| {
            annotation(o, "capstan.dev/last-handled-configuration").is_some()
        })
        .await?;
    }
    assert_eq!(s.count("sized_fn", "three"), 1);
    assert_eq!(s.count("sized_fn", "four"), 0, "the value does not match");
    assert_eq!(s.count("sized_fn", "anonymous"), 0, "the label is not present");

    // old=3/new=10 matches only that transition.
    s.patch("four", json!({"spec": {"size": 10}})).await?;
    s.patch("three", json!({"spec": {"size": 10}})).await?;
    s.wait("three", T, "the update handled", |o| {
        annotation(o, "capstan.dev/last-handled-configuration").is_some_and(|d| d.contains("10"))
    })
    .await?;
    s.wait("four", T, "the update handled", |o| {
        annotation(o, "capstan.dev/last-handled-configuration").is_some_and(|d| d.contains("10"))
    })
    .await?;
    assert_eq!(s.count("became_big_fn", "three"), 1);
    assert_eq!(s.count("became_big_fn", "four"), 0);
    Ok(())
}

#[tokio::test]
async fn sub_handlers_run_once_each_and_keep_the_parent_open_until_all_succeed() -> anyhow::Result<()> {
    let s = Scenario::start("subhandlers", &[]).await?;
    // The second child fails once: the parent is called again, the first child is not.
    s.create("nest", json!({"temporary": {"parent/two": 1}})).await?;
    let o = s
        .wait("nest", T, "both children done and the change handled", |o| {
            annotation(o, "e2e/sub-one") == Some("done")
                && annotation(o, "e2e/sub-two") == Some("done")
                && annotation(o, "capstan.dev/last-handled-configuration").is_some()
        })
        .await?;
    assert_eq!(s.count("parent/one", "nest"), 1, "{:?}", s.calls());
    assert_eq!(s.count("parent/two", "nest"), 2, "{:?}", s.calls());
    assert_eq!(s.count("parent", "nest"), 2, "{:?}", s.calls());
    assert!(
        progress_keys(&o).is_empty(),
        "progress records are purged once the change is handled: {:?}",
        progress_keys(&o)
    );
    Ok(())
}

#[tokio::test]
async fn only_the_given_namespaces_are_watched() -> anyhow::Result<()> {
    let mut s = Scenario::start("create", &["--namespace", "watched"]).await?;
    for ns in ["watched", "ignored"] {
        s.env.kubectl_ok(&["create", "namespace", ns]).await?;
    }
    s.namespace = "watched".into();
    s.create("in", json!({})).await?;
    s.namespace = "ignored".into();
    s.create("out", json!({})).await?;
    s.namespace = "watched".into();
    s.wait("in", T, "handled", |o| {
        annotation(o, "capstan.dev/last-handled-configuration").is_some()
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        s.count("create_fn", "out"),
        0,
        "objects outside the watched namespaces are not handled"
    );
    Ok(())
}

#[tokio::test]
async fn status_storages_keep_progress_and_diff_base_in_the_status() -> anyhow::Result<()> {
    let s = Scenario::start(
        "create,retries,update",
        &[
            "--progress-storage",
            "status",
            "--diffbase-storage",
            "status",
            "--persistence-prefix",
            "ops.example.com",
        ],
    )
    .await?;
    s.create("st", json!({"temporary": {"limited": 1}})).await?;
    let o = s
        .wait("st", T, "progress in the status", |o| {
            o.pointer("/status/capstan/progress/limited").is_some()
        })
        .await?;
    assert_eq!(
        o.pointer("/status/capstan/progress/limited/retries"),
        Some(&json!(1))
    );
    let o = s
        .wait("st", T, "handled", |o| {
            o.pointer("/status/capstan/last-handled-configuration").is_some()
        })
        .await?;
    assert!(
        o.pointer("/status/capstan/progress/limited").is_none(),
        "purged when done"
    );
    let annotations = o.pointer("/metadata/annotations").cloned().unwrap_or_default();
    assert!(
        annotations.as_object().is_none_or(|a| !a
            .keys()
            .any(|k| k.starts_with("ops.example.com/") && !k.ends_with("kopf-managed"))),
        "nothing but the marker in annotations: {annotations}"
    );
    s.patch("st", json!({"spec": {"size": 7}})).await?;
    s.wait("st", T, "update handled", |o| {
        o.pointer("/status/update_fn").is_some()
    })
    .await?;
    assert_eq!(s.count("create_fn", "st"), 1);
    Ok(())
}

#[tokio::test]
async fn health_and_readiness_reflect_handlers_and_watches() -> anyhow::Result<()> {
    let mut s = Scenario::start("create", &[]).await?;
    s.create("h", json!({})).await?;
    s.wait("h", T, "handled", |o| {
        annotation(o, "capstan.dev/last-handled-configuration").is_some()
    })
    .await?;
    let (code, body) = s.controller.admin_get("/readyz").await?;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("watch/examples.v1.demo.capstan.dev"), "{body}");
    let (code, _) = s.controller.admin_get("/healthz").await?;
    assert_eq!(code, 200);
    let (code, metrics) = s.controller.admin_get("/metrics").await?;
    assert_eq!(code, 200);
    assert!(
        metrics.contains(r#"capstan_handler_invocations_total{handler="create_fn",outcome="success"} 1"#),
        "{metrics}"
    );
    assert!(metrics.contains("capstan_handler_processes 1"), "{metrics}");
    assert!(
        metrics.contains(r#"capstan_api_writes_total{resource="examples"}"#),
        "{metrics}"
    );
    s.handler.terminate().await?;
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let (code, body) = s.controller.admin_get("/readyz").await?;
        if code == 503 {
            assert!(body.contains("no handler process is connected"), "{body}");
            break;
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "still ready without handlers: {body}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        s.controller.admin_get("/healthz").await?.0,
        200,
        "alive without handlers"
    );
    Ok(())
}

#[tokio::test]
async fn namespace_globs_serve_matching_namespaces_including_new_ones() -> anyhow::Result<()> {
    let mut s = Scenario::start("create", &["--namespace", "team-*", "--namespace", "!team-x"]).await?;
    s.env.kubectl_ok(&["create", "namespace", "team-a"]).await?;
    s.env.kubectl_ok(&["create", "namespace", "team-x"]).await?;
    s.env.kubectl_ok(&["create", "namespace", "other"]).await?;
    for ns in ["team-a", "team-x", "other"] {
        s.namespace = ns.into();
        s.create(&format!("in-{ns}"), json!({})).await?;
    }
    s.namespace = "team-a".into();
    s.wait("in-team-a", T, "handled", |o| {
        annotation(o, "capstan.dev/last-handled-configuration").is_some()
    })
    .await?;
    // A namespace created after the start is served without a restart.
    s.env.kubectl_ok(&["create", "namespace", "team-late"]).await?;
    s.namespace = "team-late".into();
    s.create("in-team-late", json!({})).await?;
    s.wait("in-team-late", T, "handled", |o| {
        annotation(o, "capstan.dev/last-handled-configuration").is_some()
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(s.count("create_fn", "in-team-x"), 0, "excluded by the negation");
    assert_eq!(s.count("create_fn", "in-other"), 0, "not matched by the glob");
    Ok(())
}

#[tokio::test]
async fn an_invalid_namespace_pattern_is_refused_at_start() -> anyhow::Result<()> {
    let bin = capstan_tests::process::capstan_binary().await?;
    let out = tokio::process::Command::new(bin)
        .args(["run", "--namespace", "Bad_Name"])
        .output()
        .await?;
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is not a namespace name or glob"), "{err}");
    Ok(())
}
