//! End to end, with the real controller, API server and an SDK handler process: kopf's
//! handler options that were proven only in unit or test-kit tests before — optional delete
//! handlers, `resume` with `deleted`, `param`, `when`, the overall `timeout` becoming a
//! permanent failure, errors mode IGNORED, the smart progress storage, core resources (the
//! empty API group), a cluster-scoped resource, and `--no-crd-watch`. (A daemon's
//! `initial_delay` is proven in `daemons_lifecycle.rs`.)

use std::time::Duration;

use capstan_tests::{
    process::start_handler,
    scenario::{Scenario, annotation, has_finalizer, progress_keys, tail},
    testenv::TestEnv,
};
use k8s_openapi::api::core::v1::{ConfigMap, Event, Namespace};
use kube::{
    Api,
    api::{DeleteParams, ListParams, PostParams},
};
use serde_json::{Value, json};
use tokio::time::Instant;

const T: Duration = Duration::from_secs(30);

/// How long nothing must happen for a "never again" check: several retry delays.
const QUIET: Duration = Duration::from_secs(4);

const DIFFBASE: &str = "capstan.dev/last-handled-configuration";

fn case(name: &str) -> Value {
    json!({"labels": {"e2e/case": name}})
}

fn handled(o: &Value) -> bool {
    annotation(o, DIFFBASE).is_some()
}

async fn events_of(s: &Scenario, name: &str) -> anyhow::Result<Vec<String>> {
    let api: Api<Event> = Api::namespaced(s.client.clone(), &s.namespace);
    let list = api
        .list(&ListParams::default().fields(&format!("involvedObject.name={name}")))
        .await?;
    Ok(list.items.into_iter().filter_map(|e| e.message).collect())
}

async fn wait_event(s: &Scenario, name: &str, check: impl Fn(&str) -> bool) -> anyhow::Result<String> {
    let deadline = Instant::now() + T;
    loop {
        let messages = events_of(s, name).await?;
        if let Some(m) = messages.iter().find(|m| check(m)) {
            return Ok(m.clone());
        }
        anyhow::ensure!(Instant::now() < deadline, "events of {name}: {messages:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn an_optional_delete_handler_adds_no_finalizer_but_runs_when_another_holds_one() -> anyhow::Result<()>
{
    let s = Scenario::start("parity", &[]).await?;
    s.create_with("alone", json!({}), case("optional")).await?;
    s.create_with(
        "held",
        json!({}),
        json!({"labels": {"e2e/case": "optional", "e2e/hold": "yes"}}),
    )
    .await?;
    let alone = s.wait("alone", T, "created", handled).await?;
    assert!(
        !has_finalizer(&alone),
        "an optional delete handler alone needs no finalizer: {alone}"
    );
    s.wait("held", T, "finalizer for the other delete handler", has_finalizer)
        .await?;
    s.delete("alone").await?;
    s.wait_gone("alone", T).await?;
    s.delete("held").await?;
    s.wait_gone("held", T).await?;
    assert_eq!(
        s.count("opt_delete", "alone"),
        0,
        "the object went without waiting for it"
    );
    assert_eq!(s.count("opt_delete", "held"), 1, "{:?}", s.calls());
    assert_eq!(s.count("hold_delete", "held"), 1, "{:?}", s.calls());
    Ok(())
}

#[tokio::test]
async fn resume_handlers_with_deleted_also_resume_objects_being_deleted() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let client = env.client().await?;
    let examples = capstan_tests::testenv::examples(&client, "default");
    // Both were handled by an earlier run (they have a diff-base); "leaving" is being deleted
    // and still has our finalizer (and another one, so that it stays to be looked at).
    let finalizers = [
        ("live", json!([])),
        (
            "leaving",
            json!(["capstan.dev/finalizer", "e2e.capstan.dev/hold"]),
        ),
    ];
    for (name, finalizers) in finalizers {
        let object: kube::api::DynamicObject = serde_json::from_value(json!({
            "apiVersion": "demo.capstan.dev/v1", "kind": "Example",
            "metadata": {"name": name, "namespace": "default", "labels": {"e2e/case": "resume"},
                         "annotations": {DIFFBASE: "{\"spec\":{}}"},
                         "finalizers": finalizers},
            "spec": {}
        }))?;
        examples.create(&PostParams::default(), &object).await?;
    }
    examples.delete("leaving", &DeleteParams::default()).await?;
    let kubeconfig = env.kubeconfig.clone();
    let s = Scenario::attach(env, &kubeconfig, "parity", &[], "default").await?;
    let deadline = Instant::now() + T;
    while s.count("resume_all", "leaving") == 0 || s.count("resume_live", "live") == 0 {
        anyhow::ensure!(
            Instant::now() < deadline,
            "calls: {:?}\ncontroller:\n{}",
            s.calls(),
            tail(&s.controller.process.output(), 40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(s.count("resume_all", "live"), 1, "{:?}", s.calls());
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        s.count("resume_live", "leaving"),
        0,
        "a resume handler without `deleted` skips objects being deleted: {:?}",
        s.calls()
    );
    s.patch("leaving", json!({"metadata": {"finalizers": null}}))
        .await?;
    s.wait_gone("leaving", T).await?;
    Ok(())
}

#[tokio::test]
async fn param_reaches_the_handler_and_when_filters_in_the_sdk() -> anyhow::Result<()> {
    let s = Scenario::start("parity", &[]).await?;
    s.create_with("with-param", json!({}), case("param")).await?;
    let o = s
        .wait("with-param", T, "the param echoed to status", |o| {
            o.pointer("/status/param_fn/param").is_some()
        })
        .await?;
    assert_eq!(
        o.pointer("/status/param_fn/param"),
        Some(&json!({"greeting": "hello", "n": 7}))
    );

    s.create_with(
        "wanted",
        json!({}),
        json!({"labels": {"e2e/case": "when", "e2e/when": "yes"}}),
    )
    .await?;
    s.create_with(
        "unwanted",
        json!({}),
        json!({"labels": {"e2e/case": "when", "e2e/when": "no"}}),
    )
    .await?;
    for name in ["wanted", "unwanted"] {
        s.wait(name, T, "created", handled).await?;
    }
    assert_eq!(s.count("when_fn", "wanted"), 1, "{:?}", s.calls());
    assert_eq!(s.count("when_fn", "unwanted"), 0, "{:?}", s.calls());
    assert_eq!(s.count("when_witness", "unwanted"), 1, "{:?}", s.calls());
    let unwanted = s.get("unwanted").await?.unwrap_or_default();
    assert!(
        progress_keys(&unwanted).is_empty(),
        "a skipped handler leaves no record: {unwanted}"
    );
    Ok(())
}

#[tokio::test]
async fn the_overall_timeout_turns_retries_into_a_permanent_failure() -> anyhow::Result<()> {
    let s = Scenario::start("parity", &[]).await?;
    let started = Instant::now();
    s.create_with(
        "slowpoke",
        json!({"temporary": {"timeout_fn": 100}, "retryDelay": {"timeout_fn": 1}}),
        case("timeout"),
    )
    .await?;
    let message = wait_event(&s, "slowpoke", |m| {
        m.starts_with("Handler 'timeout_fn' failed permanently")
    })
    .await?;
    assert!(message.contains("timed out"), "{message}");
    assert!(
        started.elapsed() >= Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // The cause is done: the diff-base is stored and the handler is not called again.
    s.wait("slowpoke", T, "diff-base", handled).await?;
    let attempts = s.count("timeout_fn", "slowpoke");
    assert!((2..=4).contains(&attempts), "{attempts} attempts in 3 s");
    tokio::time::sleep(QUIET).await;
    assert_eq!(s.count("timeout_fn", "slowpoke"), attempts);
    Ok(())
}

#[tokio::test]
async fn errors_mode_ignored_counts_a_failure_as_done_and_the_cause_goes_on() -> anyhow::Result<()> {
    let s = Scenario::start("parity", &[]).await?;
    s.create_with(
        "careless",
        json!({"unclassified": {"ignored_fn": 5}}),
        case("ignored"),
    )
    .await?;
    let o = s.wait("careless", T, "created", handled).await?;
    assert!(progress_keys(&o).is_empty(), "{o}");
    assert_eq!(s.count("after_ignored", "careless"), 1, "{:?}", s.calls());
    tokio::time::sleep(QUIET).await;
    assert_eq!(
        s.count("ignored_fn", "careless"),
        1,
        "not retried: {:?}",
        s.calls()
    );
    Ok(())
}

#[tokio::test]
async fn the_smart_progress_storage_keeps_records_in_annotations_and_status() -> anyhow::Result<()> {
    let s = Scenario::start("parity", &["--progress-storage", "smart"]).await?;
    s.create_with(
        "smart",
        json!({"temporary": {"stored_fn": 1}, "retryDelay": {"stored_fn": 5}}),
        case("storage"),
    )
    .await?;
    let o = s
        .wait("smart", T, "a record in both places", |o| {
            annotation(o, "capstan.dev/stored_fn").is_some()
                && o.pointer("/status/capstan/progress/stored_fn").is_some()
        })
        .await?;
    let in_annotation: Value = serde_json::from_str(annotation(&o, "capstan.dev/stored_fn").unwrap_or("{}"))?;
    assert_eq!(in_annotation["retries"], json!(1), "{o}");
    assert_eq!(
        o.pointer("/status/capstan/progress/stored_fn/retries"),
        Some(&json!(1)),
        "{o}"
    );
    let o = s.wait("smart", T, "handled", handled).await?;
    assert_eq!(s.count("stored_fn", "smart"), 2, "{:?}", s.calls());
    assert!(progress_keys(&o).is_empty(), "purged from annotations: {o}");
    assert!(
        o.pointer("/status/capstan/progress/stored_fn").is_none(),
        "purged from status: {o}"
    );
    Ok(())
}

#[tokio::test]
async fn core_resources_and_a_cluster_scoped_resource_are_handled() -> anyhow::Result<()> {
    let s = Scenario::start("parity", &[]).await?;
    let configmaps: Api<ConfigMap> = Api::namespaced(s.client.clone(), "default");
    let namespaces: Api<Namespace> = Api::all(s.client.clone());
    configmaps
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "settings", "labels": {"e2e/case": "core"}},
                "data": {"a": "1"}
            }))?,
        )
        .await?;
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(
                json!({"metadata": {"name": "team-e2e", "labels": {"e2e/case": "core"}}}),
            )?,
        )
        .await?;
    let deadline = Instant::now() + T;
    loop {
        let cm = serde_json::to_value(configmaps.get("settings").await?)?;
        let ns = serde_json::to_value(namespaces.get("team-e2e").await?)?;
        if annotation(&cm, "e2e/seen-cm_create").is_some()
            && handled(&cm)
            && annotation(&ns, "e2e/seen-ns_create").is_some()
            && handled(&ns)
        {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "configmap: {cm}\nnamespace: {ns}\ncontroller:\n{}",
            tail(&s.controller.process.output(), 40)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(s.count("cm_create", "settings"), 1, "{:?}", s.calls());
    assert_eq!(s.count("ns_create", "team-e2e"), 1, "{:?}", s.calls());
    // Only the labelled ones.
    assert_eq!(s.count("ns_create", "default"), 0, "{:?}", s.calls());
    Ok(())
}

/// CRD requests (list/watch) by the controller, from the audit log.
fn crd_reads(env: &TestEnv) -> Vec<String> {
    env.audit_events()
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e["stage"] == "ResponseComplete")
        .filter(|e| {
            e["userAgent"]
                .as_str()
                .is_some_and(|ua| ua.starts_with("capstan/"))
        })
        .filter(|e| e["objectRef"]["resource"] == "customresourcedefinitions")
        .filter_map(|e| e["verb"].as_str().map(str::to_owned))
        .collect()
}

const LATE_CRD: &str = r"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: widgets.late.capstan.dev
spec:
  group: late.capstan.dev
  names: {kind: Widget, plural: widgets, singular: widget, listKind: WidgetList}
  scope: Namespaced
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          x-kubernetes-preserve-unknown-fields: true
";

#[tokio::test]
async fn without_a_crd_watch_a_late_resource_waits_for_the_next_handshake() -> anyhow::Result<()> {
    let mut s = Scenario::start("create,late", &["--no-crd-watch"]).await?;
    s.create("plain", json!({})).await?;
    s.wait("plain", T, "created", handled).await?;
    assert_eq!(s.count("create_fn", "plain"), 1);

    s.env.apply_crd(LATE_CRD, "widgets.late.capstan.dev").await?;
    s.env
        .apply("apiVersion: late.capstan.dev/v1\nkind: Widget\nmetadata: {name: w1, namespace: default}\nspec: {size: 1}\n")
        .await?;
    tokio::time::sleep(QUIET).await;
    assert_eq!(
        s.count("late_create", "w1"),
        0,
        "no CRD watch: the new resource is not noticed before the next handshake"
    );

    s.handler.kill().await?;
    let log = s.calls.to_string_lossy().into_owned();
    s.handler = start_handler(
        &s.env,
        "handler-2",
        &s.controller.endpoint(),
        &[("E2E_HANDLERS", "create,late"), ("E2E_LOG", log.as_str())],
    )?;
    let deadline = Instant::now() + T;
    while s.count("late_create", "w1") == 0 {
        anyhow::ensure!(
            Instant::now() < deadline,
            "not handled after the handshake: {:?}\ncontroller:\n{}",
            s.calls(),
            tail(&s.controller.process.output(), 40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let reads = crd_reads(&s.env);
    assert!(
        !reads.iter().any(|v| v == "watch"),
        "the controller watched CRDs: {reads:?}"
    );
    Ok(())
}
