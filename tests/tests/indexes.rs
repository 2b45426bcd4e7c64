//! End to end, against a real API server, the real `capstan` binary and a real SDK handler
//! process: an index over ConfigMaps by label (kopf's `@kopf.index`), read by the handlers of
//! another resource. Those handlers start only once the index holds every listed ConfigMap
//! (kopf's readiness gate); the index follows creates, updates (relabelling, unlabelling) and
//! deletes, and is rebuilt before anything else runs when the handler process restarts.

use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use capstan_tests::{
    indexes::{entries, peek, relabel},
    scenario::Scenario,
    testenv::TestEnv,
};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::{
    Api,
    api::{DeleteParams, Patch, PatchParams, PostParams},
};
use serde_json::json;

const T: Duration = Duration::from_secs(60);

async fn create_cm(api: &Api<ConfigMap>, name: &str, app: Option<&str>) -> Result<()> {
    let labels = app.map_or_else(|| json!({}), |a| json!({"e2e/app": a}));
    // One ConfigMap takes the index handler 3 s: a reader let through early would miss it.
    let annotations = if name == "web-19" {
        json!({"e2e/slow": "yes"})
    } else {
        json!({})
    };
    let cm: ConfigMap = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": name, "labels": labels, "annotations": annotations},
        "data": {"k": "v"},
    }))?;
    api.create(&PostParams::default(), &cm).await?;
    Ok(())
}

async fn annotate(api: &Api<ConfigMap>, name: &str, key: &str, value: &str) -> Result<()> {
    let patch = json!({"metadata": {"annotations": {key: value}}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await?;
    Ok(())
}

/// The lines of the call log, in order.
fn lines(s: &Scenario) -> Vec<String> {
    std::fs::read_to_string(&s.calls)
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

#[tokio::test]
async fn an_index_gates_other_handlers_follows_changes_and_survives_a_restart() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let client = env.client().await?;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    // Before the operator starts: 20 "web", 5 "db", 3 unlabelled ConfigMaps and one example.
    let mut expected: Vec<(String, String)> = Vec::new();
    for i in 0..20 {
        let name = format!("web-{i:02}");
        create_cm(&cms, &name, Some("web")).await?;
        expected.push(("web".into(), name));
    }
    for i in 0..5 {
        let name = format!("db-{i}");
        create_cm(&cms, &name, Some("db")).await?;
        expected.push(("db".into(), name));
    }
    for i in 0..3 {
        create_cm(&cms, &format!("plain-{i}"), None).await?;
    }
    capstan_tests::testenv::create_example(&env, "x", json!({"app": "web"})).await?;
    let kubeconfig = env.kubeconfig.clone();
    let mut s = Scenario::attach(env, &kubeconfig, "index", &[], "default").await?;

    // The create handler ran once, after every listed ConfigMap was indexed.
    let obj = s
        .wait("x", T, "lookup_fn answered", |o| {
            o.pointer("/status/lookup_fn").is_some()
        })
        .await?;
    let mut web: Vec<String> = obj["status"]["lookup_fn"]["configmaps"]
        .as_array()
        .context("configmaps list")?
        .iter()
        .filter_map(|v| v.as_str().map(str::to_owned))
        .collect();
    web.sort();
    let want: Vec<String> = (0..20).map(|i| format!("web-{i:02}")).collect();
    assert_eq!(web, want, "the handler saw the full index");
    let log = lines(&s);
    let first_reader = log
        .iter()
        .position(|l| l.starts_with("lookup ") || l.starts_with("peek "))
        .context("a reader ran")?;
    let indexed_before = log[..first_reader]
        .iter()
        .filter(|l| l.starts_with("index "))
        .count();
    assert_eq!(
        indexed_before, 25,
        "every labelled ConfigMap was indexed before any other handler ran: {log:?}"
    );
    assert_eq!(s.notes("lookup"), vec![vec!["x".to_owned(), "25".to_owned()]]);
    assert!(
        !log.iter().any(|l| l.starts_with("index plain-")),
        "unlabelled ConfigMaps are filtered out in the controller"
    );

    s.wait("x", T, "the timer sees the full index", |o| {
        peek(o) == Some(entries(&expected))
    })
    .await?;

    // Creates, relabels, unlabels and deletes.
    create_cm(&cms, "web-new", Some("web")).await?;
    expected.push(("web".into(), "web-new".into()));
    relabel(&cms, "db-0", Some("web")).await?;
    expected.retain(|(_, n)| n != "db-0");
    expected.push(("web".into(), "db-0".into()));
    relabel(&cms, "web-01", None).await?;
    expected.retain(|(_, n)| n != "web-01");
    cms.delete("web-00", &DeleteParams::default()).await?;
    expected.retain(|(_, n)| n != "web-00");
    relabel(&cms, "plain-0", Some("cache")).await?;
    expected.push(("cache".into(), "plain-0".into()));
    s.wait("x", T, "the index followed every change", |o| {
        peek(o) == Some(entries(&expected))
    })
    .await?;

    // The handler process dies; meanwhile a ConfigMap is deleted and one created. The new
    // process's readers only run once its index holds everything again.
    let old_pid = s.handler.id().context("handler pid")?;
    s.handler.kill().await?;
    cms.delete("db-1", &DeleteParams::default()).await?;
    expected.retain(|(_, n)| n != "db-1");
    create_cm(&cms, "late", Some("db")).await?;
    expected.push(("db".into(), "late".into()));
    s.restart_handler().await?;
    let new_pid = s.handler.id().context("handler pid")?.to_string();
    s.wait("x", T, "the rebuilt index is complete", |o| {
        peek(o) == Some(entries(&expected))
    })
    .await?;
    let peeks: Vec<Vec<String>> = s
        .notes("peek")
        .into_iter()
        .filter(|n| n.first() == Some(&new_pid))
        .collect();
    if peeks.is_empty() {
        bail!("the restarted process never ran its timer");
    }
    let full = expected.len().to_string();
    for p in &peeks {
        assert_eq!(
            p.get(1),
            Some(&full),
            "after a reconnect the timer runs only on a rebuilt index (old pid {old_pid}): {peeks:?}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn failing_index_handlers_are_retried_and_never_hold_the_gate() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let client = env.client().await?;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    create_cm(&cms, "good", Some("web")).await?;
    create_cm(&cms, "broken", Some("web")).await?;
    annotate(&cms, "broken", "e2e/index-fail", "permanent").await?;
    create_cm(&cms, "flaky", Some("web")).await?;
    annotate(&cms, "flaky", "e2e/index-fail", "2").await?;
    capstan_tests::testenv::create_example(&env, "x", json!({"app": "web"})).await?;
    let kubeconfig = env.kubeconfig.clone();
    let s = Scenario::attach(env, &kubeconfig, "index", &[], "default").await?;

    // The gate opens after the first attempt of every listed object, failed or not.
    s.wait("x", T, "lookup_fn answered", |o| {
        o.pointer("/status/lookup_fn").is_some()
    })
    .await?;
    // The temporary failures are retried (1 s apart) until the ConfigMap is indexed; the
    // permanent one stays out.
    s.wait("x", T, "the flaky ConfigMap got in", |o| {
        peek(o) == Some(entries(&[("web", "flaky"), ("web", "good")]))
    })
    .await?;
    let retries: Vec<Vec<String>> = s.notes("index-retry");
    assert_eq!(
        retries,
        vec![
            vec!["flaky".to_owned(), "1".to_owned()],
            vec!["flaky".to_owned(), "2".to_owned()]
        ],
        "two temporary failures, then success"
    );
    let broken_calls = lines(&s).iter().filter(|l| *l == "index broken").count();
    assert_eq!(broken_calls, 1, "a permanent failure is not retried");

    // A change of the broken ConfigMap does not bring it back (kopf keeps it out); deleting
    // and creating it again does.
    annotate(&cms, "broken", "e2e/other", "x").await?;
    relabel(&cms, "good", Some("api")).await?;
    s.wait("x", T, "a later change is indexed", |o| {
        peek(o) == Some(entries(&[("api", "good"), ("web", "flaky")]))
    })
    .await?;
    let broken_calls = lines(&s).iter().filter(|l| *l == "index broken").count();
    assert_eq!(broken_calls, 1, "a change does not retry a permanent failure");
    cms.delete("broken", &DeleteParams::default()).await?;
    create_cm(&cms, "broken", Some("db")).await?;
    s.wait("x", T, "a new object of the same name is indexed", |o| {
        peek(o) == Some(entries(&[("api", "good"), ("db", "broken"), ("web", "flaky")]))
    })
    .await?;
    Ok(())
}

/// Runs `capstan <args>` as a user at a terminal would.
async fn capstan_cli(env: &TestEnv, args: &[&str]) -> Result<String> {
    let out = tokio::process::Command::new(capstan_tests::process::capstan_binary().await?)
        .args(args)
        .env("KUBECONFIG", &env.kubeconfig)
        .env("USER", "dev")
        .output()
        .await?;
    if !out.status.success() {
        bail!(
            "capstan {} failed: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test]
async fn objects_deleted_while_frozen_leave_the_index_on_resume() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    env.apply_peering_crds().await?;
    let client = env.client().await?;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), "default");
    create_cm(&cms, "web-a", Some("web")).await?;
    create_cm(&cms, "web-b", Some("web")).await?;
    capstan_tests::testenv::create_example(&env, "x", json!({"app": "web"})).await?;
    let kubeconfig = env.kubeconfig.clone();
    let mut s = Scenario::attach(env, &kubeconfig, "index", &[], "default").await?;
    s.wait("x", T, "the index is built", |o| {
        peek(o) == Some(entries(&[("web", "web-a"), ("web", "web-b")]))
    })
    .await?;

    // Frozen, the controller dispatches nothing; the handler process keeps its index. On
    // resume a new engine lists again and removes what vanished in between.
    capstan_cli(&s.env, &["freeze", "--lifetime", "60", "--priority", "100"]).await?;
    s.controller
        .process
        .wait_for("pausing: no new handler invocations", T)
        .await?;
    cms.delete("web-a", &DeleteParams::default()).await?;
    create_cm(&cms, "web-c", Some("web")).await?;
    // Give the frozen controller time to see both events (they wait for dispatch).
    tokio::time::sleep(Duration::from_secs(2)).await;
    capstan_cli(&s.env, &["resume"]).await?;
    s.wait(
        "x",
        T,
        "the index lost the deleted ConfigMap and gained the new one",
        |o| peek(o) == Some(entries(&[("web", "web-b"), ("web", "web-c")])),
    )
    .await?;
    Ok(())
}
