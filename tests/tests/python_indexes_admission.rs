//! End to end with a kopf operator file run by `python -m capstan run` (the Python SDK's
//! `capstan.kopf`): the real API server, the real `capstan` binary with its webhook server, and
//! the Python process over the real socket.
//!
//! - An index over ConfigMaps by label (`@kopf.index`), read by the handlers of the example
//!   resource by its name as a kwarg. Those handlers run only once the index holds every listed
//!   ConfigMap (kopf's readiness gate: one ConfigMap takes the index handler 3 s); the index
//!   follows creates, relabels, unlabels and deletes, and a restarted process's readers run
//!   only on its rebuilt index.
//! - Admission: `@kopf.on.validate` denies an object (the API server's create is refused with
//!   the handler's message) and `@kopf.on.mutate` changes objects as they are stored, through
//!   the controller's webhook server and the configurations it manages.

use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use capstan_tests::{
    indexes::{entries, peek, relabel},
    process::{Controller, free_port, python_operator, sdk_python},
    scenario::{Scenario, label},
    testenv::{TestEnv, create_example},
};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::{
    Api,
    api::{DeleteParams, PostParams},
};
use serde_json::json;
use tokio::time::Instant;

const T: Duration = Duration::from_secs(90);

/// The operator: an index of ConfigMaps by their `e2e/app` label, a create handler and a timer
/// of the example resource that read it, and a validating and a mutating admission handler.
const OPERATOR: &str = r#"
import time

import capstan.kopf as kopf

RESOURCE = ("demo.capstan.dev", "v1", "examples")
_last_peek = {"objects": None}


@kopf.index("configmaps", labels={"e2e/app": kopf.PRESENT})
def by_app(name, labels, annotations, logger, **_):
    if "e2e/slow" in annotations:
        time.sleep(3)
    logger.info(f"indexing {name}")
    return {labels["e2e/app"]: name}


@kopf.on.create(*RESOURCE)
def lookup_fn(name, spec, by_app, logger, **_):
    objects = sum(len(store) for store in by_app.values())
    logger.info(f"lookup of {name} saw {objects} indexed objects")
    return {"configmaps": sorted(by_app.get(spec.get("app"), [])), "objects": objects}


@kopf.timer(*RESOURCE, interval=0.5)
def peek(by_app, patch, logger, **_):
    entries = sorted(f"{key}={name}" for key, store in by_app.items() for name in store)
    if _last_peek["objects"] != len(entries):
        _last_peek["objects"] = len(entries)
        logger.info(f"peek saw {len(entries)} indexed objects")
    patch.status["peek"] = entries


@kopf.on.validate(*RESOURCE, operations=["CREATE", "UPDATE"])
def validate_fn(spec, **_):
    size = spec.get("size", 0)
    if size > 100:
        raise kopf.AdmissionError(f"spec.size {size} is above 100")


@kopf.on.mutate(*RESOURCE, operations=["CREATE"])
def mutate_fn(spec, patch, **_):
    if "size" not in spec:
        patch.spec["size"] = 1
    patch.metadata.labels["demo.capstan.dev/admitted-by"] = "python"
"#;

async fn create_cm(api: &Api<ConfigMap>, name: &str, app: Option<&str>, slow: bool) -> Result<()> {
    let labels = app.map_or_else(|| json!({}), |a| json!({"e2e/app": a}));
    let annotations = if slow {
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

#[tokio::test]
async fn python_index_gates_readers_follows_changes_and_admission_validates_and_mutates() -> Result<()> {
    let python = sdk_python().await?;
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let cms: Api<ConfigMap> = Api::namespaced(env.client().await?, "default");
    // Before the operator starts: 10 "web" (one slow to index), 3 "db", 2 unlabelled
    // ConfigMaps, and one example object that reads the index when created.
    let mut expected: Vec<(String, String)> = Vec::new();
    for i in 0..10 {
        let name = format!("web-{i:02}");
        create_cm(&cms, &name, Some("web"), i == 9).await?;
        expected.push(("web".into(), name));
    }
    for i in 0..3 {
        let name = format!("db-{i}");
        create_cm(&cms, &name, Some("db"), false).await?;
        expected.push(("db".into(), name));
    }
    for i in 0..2 {
        create_cm(&cms, &format!("plain-{i}"), None, false).await?;
    }
    create_example(&env, "x", json!({"app": "web"})).await?;

    let listen = format!("127.0.0.1:{}", free_port()?);
    let controller = Controller::start(
        &env,
        "capstan",
        &["--webhook-listen", &listen, "--webhook-managed", "python-e2e"],
    )
    .await?;
    let file = env.scratch().join("operator.py");
    std::fs::write(&file, OPERATOR)?;
    let operator = python_operator(&python, &env, "python-operator", &file, controller.endpoint())?;
    let mut s = Scenario::with_operator(env, controller, operator, T).await?;
    for handler in ["by_app", "lookup_fn", "peek", "validate_fn", "mutate_fn"] {
        let line = format!("handler registered handler={handler}");
        assert!(
            s.handler.output().contains(&line),
            "{handler} was not accepted:\n{}",
            s.handler.output()
        );
    }

    // The create handler ran once, after every listed ConfigMap was indexed (the slow one
    // included), and saw the whole index by its name as a kwarg.
    let obj = s
        .wait("x", T, "lookup_fn answered", |o| {
            o.pointer("/status/lookup_fn").is_some()
        })
        .await?;
    let want: Vec<String> = (0..10).map(|i| format!("web-{i:02}")).collect();
    assert_eq!(obj["status"]["lookup_fn"]["configmaps"], json!(want), "{obj}");
    assert_eq!(obj["status"]["lookup_fn"]["objects"], 13, "{obj}");
    let output = s.handler.output();
    assert_eq!(
        output.matches("lookup of x saw").count(),
        1,
        "lookup_fn ran more than once:\n{output}"
    );
    assert!(
        !output.contains("indexing plain-"),
        "unlabelled ConfigMaps are filtered out by the controller:\n{output}"
    );
    s.wait("x", T, "the timer sees the full index", |o| {
        peek(o) == Some(entries(&expected))
    })
    .await?;

    // Creates, relabels, unlabels and deletes.
    create_cm(&cms, "web-new", Some("web"), false).await?;
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

    // The operator dies; meanwhile a ConfigMap is deleted and one created. The new process's
    // timer only runs once its index holds everything again.
    s.handler.kill().await?;
    cms.delete("db-1", &DeleteParams::default()).await?;
    expected.retain(|(_, n)| n != "db-1");
    create_cm(&cms, "late", Some("db"), true).await?;
    expected.push(("db".into(), "late".into()));
    s.handler = python_operator(&python, &s.env, "python-operator", &file, s.controller.endpoint())?;
    s.handler
        .wait_for("capstan: connected to the controller", T)
        .await?;
    s.wait("x", T, "the rebuilt index is complete", |o| {
        peek(o) == Some(entries(&expected))
    })
    .await?;
    let full = format!("peek saw {} indexed objects", expected.len());
    let output = s.handler.output();
    let peeks: Vec<&str> = output.lines().filter(|l| l.contains("peek saw")).collect();
    if peeks.is_empty() {
        bail!("the restarted operator never ran its timer:\n{output}");
    }
    assert!(
        peeks.iter().all(|l| l.contains(&full)),
        "after a restart the timer runs only on a rebuilt index: {peeks:?}"
    );

    // Admission: the validating handler's denial reaches the client with its message. The
    // API server picks up the configurations on its own schedule: until then objects pass.
    let deadline = Instant::now() + T;
    let message = loop {
        match s.create("huge", json!({"size": 500})).await {
            Err(e) if e.to_string().contains("above 100") => break e.to_string(),
            other => {
                if Instant::now() > deadline {
                    bail!("the Python validating handler was not called: {other:?}");
                }
                if other.is_ok() {
                    s.delete("huge").await?;
                    s.wait_gone("huge", T).await?;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    };
    assert!(message.contains("spec.size 500 is above 100"), "{message}");
    assert!(s.get("huge").await?.is_none(), "a denied object was stored");
    // An update is validated too.
    s.create("small", json!({"size": 5})).await?;
    let refused = s.patch("small", json!({"spec": {"size": 200}})).await;
    let refused = refused.err().context("an update to size 200 was admitted")?;
    assert!(
        refused.to_string().contains("spec.size 200 is above 100"),
        "{refused}"
    );

    // The mutating handler's patch is applied to the stored object.
    let stored = loop {
        let stored = s.create("defaulted", json!({"field": "x"})).await?;
        if stored.pointer("/spec/size").is_some() || Instant::now() > deadline {
            break stored;
        }
        s.delete("defaulted").await?;
        s.wait_gone("defaulted", T).await?;
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(stored.pointer("/spec/size"), Some(&json!(1)), "{stored}");
    assert_eq!(label(&stored, "demo.capstan.dev/admitted-by"), Some("python"));
    let small = s.get("small").await?.context("small disappeared")?;
    assert_eq!(small.pointer("/spec/size"), Some(&json!(5)), "{small}");

    let status = s.handler.terminate().await?;
    let output = s.handler.output();
    assert!(
        status.success(),
        "the Python operator exited with {status}:\n{output}"
    );
    assert!(
        !output.contains("Traceback"),
        "a traceback in the operator's log:\n{output}"
    );
    Ok(())
}
