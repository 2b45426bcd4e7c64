//! End to end: migrating an operator from kopf to Capstan and back.
//!
//! A real kopf operator (`tests/kopf/operator.py`, kopf installed from PyPI into a virtualenv
//! under `$HOME/.cache/capstan/kopf-venv`) handles an object; then `capstan run --persistence
//! kopf` with an SDK handler process takes over and must not handle that object again, but
//! handles a new one and an update of the old one; then kopf takes over again and must see the
//! new object as handled, reacting to its update as an update. Along the way, what Capstan
//! stores is checked against kopf's formats.

use std::{path::Path, time::Duration};

use anyhow::{Result, bail};
use capstan_tests::{
    kopf,
    process::{Controller, Process, start_handler},
    scenario::{Scenario, annotation, tail, writes_by},
    testenv::TestEnv,
};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);
const DIFFBASE: &str = "kopf.zalando.org/last-handled-configuration";
const CREATE_RECORD: &str = "kopf.zalando.org/create_fn";
/// The fields of kopf's progress records, in the order kopf writes them.
const RECORD_FIELDS: [&str; 9] = [
    "started", "stopped", "delayed", "purpose", "retries", "success", "failure", "message", "subrefs",
];

/// The kopf operator against the testenv; killed when dropped.
async fn start_kopf(env: &TestEnv, name: &str, calls: &Path) -> Result<Process> {
    kopf::start(env, &kopf::binary().await?, name, calls).await
}

/// kopf's calls so far: (handler, object name).
fn kopf_calls(path: &Path) -> Vec<(String, String)> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_once(' '))
        .map(|(h, n)| (h.to_owned(), n.to_owned()))
        .collect()
}

async fn wait_for_kopf_call(kopf: &Process, calls: &Path, handler: &str, name: &str) -> Result<()> {
    let deadline = tokio::time::Instant::now() + T;
    while !kopf_calls(calls).iter().any(|(h, n)| h == handler && n == name) {
        if tokio::time::Instant::now() > deadline {
            bail!(
                "kopf did not call {handler} for {name} within {T:?}; kopf's log:\n{}",
                tail(&kopf.output(), 40)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Creates an object with `kubectl apply` (so it carries kubectl's last-applied annotation,
/// which no essence includes).
async fn kubectl_apply(env: &TestEnv, object: &Value) -> Result<()> {
    let file = env.scratch().join(format!(
        "{}.json",
        object["metadata"]["name"].as_str().unwrap_or("object")
    ));
    std::fs::write(&file, serde_json::to_string(object)?)?;
    env.kubectl_ok(&["apply", "-f", &file.to_string_lossy()]).await?;
    Ok(())
}

fn example(name: &str, spec: Value) -> Value {
    json!({
        "apiVersion": "demo.capstan.dev/v1", "kind": "Example",
        "metadata": {"name": name, "namespace": "default",
                     "labels": {"app": "demo"}, "annotations": {"team": "blue"}},
        "spec": spec
    })
}

/// The diff-base an object carries, parsed.
fn diffbase(obj: &Value) -> Option<Value> {
    annotation(obj, DIFFBASE).and_then(|t| serde_json::from_str(t).ok())
}

/// Checks a progress record's text against kopf's format: compact JSON, kopf's fields in
/// kopf's order, timestamps as kopf writes them.
fn check_kopf_record(text: &str) -> Result<Value> {
    let record: Value = serde_json::from_str(text)?;
    let Some(fields) = record.as_object() else {
        bail!("not a JSON object: {text}");
    };
    let mut positions = Vec::new();
    for key in fields.keys() {
        if !RECORD_FIELDS.contains(&key.as_str()) {
            bail!("{key:?} is not a field of kopf's records: {text}");
        }
    }
    for field in RECORD_FIELDS {
        if let Some(at) = text.find(&format!("\"{field}\":")) {
            positions.push(at);
        }
    }
    if !positions.is_sorted() || text.contains(": ") || text.contains(", ") {
        bail!("not in kopf's compact field order: {text}");
    }
    for stamp in ["started", "stopped", "delayed"] {
        if let Some(value) = record.get(stamp) {
            let s = value.as_str().unwrap_or_default();
            let ok = s.len() == 32
                && s.ends_with("+00:00")
                && s.as_bytes().get(10) == Some(&b'T')
                && s.as_bytes().get(19) == Some(&b'.');
            if !ok {
                bail!("{stamp} is not kopf's ISO 8601 with microseconds and +00:00: {s:?}");
            }
        }
    }
    Ok(record)
}

#[tokio::test]
async fn objects_move_between_kopf_and_capstan_without_being_handled_again() -> Result<()> {
    let started = tokio::time::Instant::now();
    // Installing kopf first keeps a PyPI or python3 problem from looking like a test failure.
    kopf::binary().await?;
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let client = env.client().await?;
    let kopf_log = env.scratch().join("kopf-calls.log");

    // 1. kopf handles `old`.
    kubectl_apply(
        &env,
        &example("old", json!({"field": "a", "size": 1, "empty": {}, "items": []})),
    )
    .await?;
    let mut kopf = start_kopf(&env, "kopf", &kopf_log).await?;
    wait_for_kopf_call(&kopf, &kopf_log, "create_fn", "old").await?;
    let api = capstan_tests::testenv::examples(&client, "default");
    let deadline = tokio::time::Instant::now() + T;
    let old_by_kopf = loop {
        let obj = serde_json::to_value(api.get("old").await?)?;
        if diffbase(&obj).is_some() && annotation(&obj, CREATE_RECORD).is_none() {
            break obj;
        }
        if tokio::time::Instant::now() > deadline {
            bail!("kopf did not finish handling old:\n{}", tail(&kopf.output(), 40));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    kopf.terminate().await?;
    drop(kopf);

    // 2. Capstan takes over.
    let controller = Controller::start(&env, "capstan", &["--persistence", "kopf"]).await?;
    let calls = env.scratch().join("calls.log");
    let handler = start_handler(
        &env,
        "handler",
        &controller.endpoint(),
        &[
            ("E2E_HANDLERS", "create,update"),
            ("E2E_LOG", &calls.to_string_lossy()),
        ],
    )?;
    let mut s = Scenario {
        env,
        client,
        controller,
        handler,
        calls,
        presets: "create,update".into(),
        namespace: "default".into(),
    };
    s.controller
        .process
        .wait_for("handler process connected", T)
        .await?;

    // A new object, whose first attempt fails so that a progress record is stored for a while.
    kubectl_apply(
        &s.env,
        &example(
            "fresh",
            json!({"field": "f", "empty": {}, "temporary": {"create_fn": 1}}),
        ),
    )
    .await?;
    let retrying = s
        .wait(
            "fresh",
            T,
            "a progress record while create_fn waits for its retry",
            |o| annotation(o, CREATE_RECORD).is_some(),
        )
        .await?;
    let record = check_kopf_record(annotation(&retrying, CREATE_RECORD).unwrap_or_default())?;
    assert_eq!(record["purpose"], "create");
    assert_eq!(record["retries"], 1);
    assert_eq!(record["success"], false);
    assert_eq!(record["failure"], false);
    assert!(
        record["delayed"].is_string() && record["message"].is_string(),
        "{record}"
    );
    let fresh = s
        .wait("fresh", T, "created by Capstan", |o| {
            diffbase(o).is_some() && annotation(o, CREATE_RECORD).is_none()
        })
        .await?;
    assert_eq!(
        s.count("create_fn", "fresh"),
        2,
        "one failed attempt, one success"
    );
    let text = annotation(&fresh, DIFFBASE).unwrap_or_default();
    assert!(
        text.ends_with("}\n") && !text.contains(": "),
        "kopf's compact JSON + newline: {text:?}"
    );
    assert_eq!(
        diffbase(&fresh),
        Some(json!({
            "spec": {"field": "f", "empty": {}, "temporary": {"create_fn": 1}},
            "metadata": {"labels": {"app": "demo"}, "annotations": {"team": "blue"}}
        })),
        "the diff-base is the essence as kopf builds it"
    );
    let annotations = fresh["metadata"]["annotations"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    let ours: Vec<&String> = annotations
        .keys()
        .filter(|k| k.contains("capstan.dev") || k.ends_with("/kopf-managed"))
        .collect();
    assert!(ours.is_empty(), "only kopf's names: {ours:?}");
    assert!(
        fresh["metadata"]["finalizers"].is_null(),
        "no delete handlers, no finalizer"
    );

    // Capstan has listed `old` long before `fresh` was done: it was not handled again, not
    // even written to.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(s.count("create_fn", "old"), 0, "{:?}", s.calls());
    assert_eq!(s.count("update_fn", "old"), 0, "{:?}", s.calls());
    assert!(
        writes_by(&s.env, "old", "capstan/").is_empty(),
        "{:?}",
        writes_by(&s.env, "old", "capstan/")
    );
    assert_eq!(
        s.get("old").await?.as_ref().and_then(diffbase),
        diffbase(&old_by_kopf)
    );

    // An update of `old` is an update.
    s.patch("old", json!({"spec": {"size": 2}})).await?;
    s.wait("old", T, "the update handled", |o| {
        diffbase(o).is_some_and(|d| d["spec"]["size"] == 2)
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(s.count("update_fn", "old"), 1, "{:?}", s.calls());
    assert_eq!(s.count("create_fn", "old"), 0, "{:?}", s.calls());
    assert_eq!(s.count("update_fn", "fresh"), 0, "{:?}", s.calls());

    // 3. Back to kopf.
    s.handler.terminate().await?;
    s.controller.process.terminate().await?;
    let before = kopf_calls(&kopf_log).len();
    let mut kopf = start_kopf(&s.env, "kopf-again", &kopf_log).await?;
    s.patch("fresh", json!({"spec": {"size": 5}})).await?;
    wait_for_kopf_call(&kopf, &kopf_log, "update_fn", "fresh").await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let again: Vec<(String, String)> = kopf_calls(&kopf_log).split_off(before);
    assert_eq!(
        again,
        [("update_fn".to_owned(), "fresh".to_owned())],
        "kopf neither creates fresh again nor sees a change in old; kopf's log:\n{}",
        tail(&kopf.output(), 40)
    );
    let fresh = s
        .wait("fresh", T, "kopf stored the update", |o| {
            diffbase(o).is_some_and(|d| d["spec"]["size"] == 5)
        })
        .await?;
    assert!(annotation(&fresh, CREATE_RECORD).is_none());
    kopf.terminate().await?;
    drop(kopf);

    eprintln!("kopf migration round trip took {:?}", started.elapsed());
    let Scenario { env, .. } = s;
    env.stop().await
}
