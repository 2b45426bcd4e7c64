//! End to end: per-node operators (DaemonSet mode). Three controllers with different node
//! names, each with its own handler process, against one API server: every node handles every
//! object on its own, with its own progress and diff-base, failures of one node are retried
//! without touching the others, event handlers that opted in are retried, long and odd node
//! names give valid keys, a restarted node does not re-run what it completed, a deleted
//! Node's state is removed from the objects, node-local handlers (a field selector on
//! `spec.nodeName`) are called only for their node's objects, the steady state is one
//! diff-base per node, and the status storage keeps per-node state out of the annotations.

use std::{path::PathBuf, time::Duration};

use capstan_tests::{
    operator::{Operator, Start},
    process::Controller,
    scenario::tail,
    testenv::{TestEnv, examples},
};
use kube::api::PostParams;
use serde_json::{Value, json};

/// The longest Node name Kubernetes allows (253 characters).
const LONG: &str = "ip-10-0-0-1-eu-west-1-compute-internal-a-very-long-node-name-ab.second-label-of-the-longest-node-name-kubernetes-allows-0123456.third-label-of-the-longest-node-name-kubernetes-allows-01234567.fourth-label-ends-it-at-exactly-two-hundred-fifty-three-chars";

/// A node's operator: `name` is the Node's (its processes and files get a short tag of it).
struct Node {
    name: String,
    op: Operator,
}

impl Node {
    fn count(&self, handler: &str, object: &str) -> usize {
        self.op.count(handler, object)
    }
}

async fn node(env: &TestEnv, name: &str, presets: &str, extra_env: &[(&str, &str)]) -> anyhow::Result<Node> {
    node_with(env, name, presets, extra_env, &[]).await
}

/// A node's operator with extra controller flags.
async fn node_with(
    env: &TestEnv,
    name: &str,
    presets: &str,
    extra_env: &[(&str, &str)],
    args: &[&str],
) -> anyhow::Result<Node> {
    let tag = name
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .take(12)
        .collect::<String>();
    let mut flags = vec!["--node-name", name];
    flags.extend_from_slice(args);
    let start = Start {
        args: &flags,
        handler_env: extra_env,
        ..Start::default()
    };
    Ok(Node {
        name: name.to_owned(),
        op: Operator::start_with(env, &format!("capstan-{tag}"), presets, start).await?,
    })
}

async fn create_nodes(env: &TestEnv, names: &[&str]) -> anyhow::Result<()> {
    for n in names {
        env.apply(&format!("apiVersion: v1\nkind: Node\nmetadata:\n  name: {n}\n"))
            .await?;
    }
    Ok(())
}

/// Creates the Example `name` in `default` with `labels` and `spec`.
async fn create_example(env: &TestEnv, name: &str, labels: Value, spec: Value) -> anyhow::Result<()> {
    let obj = serde_json::from_value(json!({"apiVersion": "demo.capstan.dev/v1", "kind": "Example",
        "metadata": {"name": name, "namespace": "default", "labels": labels}, "spec": spec}))?;
    examples(&env.client().await?, "default")
        .create(&PostParams::default(), &obj)
        .await?;
    Ok(())
}

fn diffbases(o: &Value) -> Vec<String> {
    o.pointer("/metadata/annotations")
        .and_then(Value::as_object)
        .map(|a| {
            a.keys()
                .filter(|k| k.ends_with("/last-handled-configuration"))
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}

async fn wait(
    env: &TestEnv,
    name: &str,
    what: &str,
    nodes: &[&Node],
    check: impl Fn(&Value) -> bool,
) -> anyhow::Result<Value> {
    let api = examples(&env.client().await?, "default");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(45);
    loop {
        let o = serde_json::to_value(api.get(name).await?)?;
        if check(&o) {
            return Ok(o);
        }
        if tokio::time::Instant::now() > deadline {
            let logs: Vec<String> = nodes
                .iter()
                .map(|n| format!("--- {}\n{}", n.name, tail(&n.op.controller.process.output(), 15)))
                .collect();
            anyhow::bail!(
                "timed out waiting for {name}: {what}\n{}\n{}",
                serde_json::to_string_pretty(&o)?,
                logs.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test]
async fn every_node_handles_every_object_independently() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    create_nodes(&env, &["node-a", "node-b", LONG]).await?;
    let a = node(&env, "node-a", "create", &[]).await?;
    let b = node(&env, "node-b", "create", &[("E2E_FAIL_FIRST", "2")]).await?;
    let c = node(&env, LONG, "create", &[]).await?;
    create_example(&env, "shared", json!({}), json!({})).await?;
    let o = wait(&env, "shared", "three diff-bases", &[&a, &b, &c], |o| {
        diffbases(o).len() == 3
    })
    .await?;
    let keys = diffbases(&o);
    assert!(
        keys.contains(&"node-a.capstan.dev/last-handled-configuration".to_owned()),
        "{keys:?}"
    );
    assert!(
        keys.contains(&"node-b.capstan.dev/last-handled-configuration".to_owned()),
        "{keys:?}"
    );
    // The steady state: per node, the diff-base and the marker; no progress records.
    let annotations: Vec<String> = o
        .pointer("/metadata/annotations")
        .and_then(Value::as_object)
        .map(|m| m.keys().cloned().collect())
        .unwrap_or_default();
    assert_eq!(annotations.len(), 6, "{annotations:#?}");
    for key in &annotations {
        let (prefix, name) = key.split_once('/').expect("a prefixed key");
        assert!(
            name == "last-handled-configuration" || name == "kopf-managed",
            "{key}"
        );
        assert!(prefix.len() <= 253 && name.len() <= 63, "{key}");
        assert!(prefix.split('.').all(|l| !l.is_empty() && l.len() <= 63), "{key}");
    }
    assert!(
        o.pointer("/metadata/finalizers").is_none(),
        "no finalizers in per-node mode by default"
    );
    assert_eq!(a.count("create_fn", "shared"), 1);
    assert_eq!(c.count("create_fn", "shared"), 1);
    assert_eq!(
        b.count("create_fn", "shared"),
        3,
        "node-b failed twice and was retried on its own"
    );

    // A restarted node does not re-run what it completed.
    let mut a = a;
    a.op.controller.process.terminate().await?;
    a.op.controller = Controller::start(&env, "capstan-nodea", &["--node-name", "node-a"]).await?;
    a.op.controller
        .process
        .wait_for("handler process connected", Duration::from_secs(60))
        .await?;
    a.op.controller
        .process
        .wait_for("listed", Duration::from_secs(30))
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(a.count("create_fn", "shared"), 1);
    Ok(())
}

#[tokio::test]
async fn event_handlers_are_retried_and_departed_nodes_are_cleaned_up() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    // node-0 runs no operator (say, the DaemonSet's node selector leaves it out): node-a, the
    // next candidate, cleans up after the delay.
    create_nodes(&env, &["node-0", "node-a", "node-b"]).await?;
    let delay = ["--node-cleanup-delay", "2s"];
    let mut a = node_with(&env, "node-a", "create,event-retry", &[], &delay).await?;
    let b = node_with(
        &env,
        "node-b",
        "create,event-retry",
        &[("E2E_FAIL_FIRST", "2")],
        &delay,
    )
    .await?;
    create_example(&env, "ev", json!({}), json!({})).await?;
    wait(&env, "ev", "both nodes handled it", &[&a, &b], |o| {
        diffbases(o).len() == 2
    })
    .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while b.count("event_retry", "ev") < 3 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "event handler on node-b not retried: {}",
            b.count("event_retry", "ev")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let o = wait(&env, "ev", "event retry record purged", &[&a, &b], |o| {
        o.pointer("/metadata/annotations")
            .and_then(|a| a.get("node-b.capstan.dev/event_retry"))
            .is_none()
    })
    .await?;
    assert!(diffbases(&o).len() == 2);

    // node-b goes away with its operator, and its Node is deleted: node-a (the lowest live
    // name with an operator) removes node-b's state.
    let mut b = b;
    b.op.controller.process.kill().await?;
    env.kubectl_ok(&["delete", "node", "node-b", "--wait=false"])
        .await?;
    let o = wait(&env, "ev", "node-b's annotations removed", &[&a, &b], |o| {
        o.pointer("/metadata/annotations")
            .and_then(Value::as_object)
            .is_some_and(|m| !m.keys().any(|k| k.starts_with("node-b.capstan.dev/")))
    })
    .await?;
    assert!(diffbases(&o).contains(&"node-a.capstan.dev/last-handled-configuration".to_owned()));
    // The object's last patch lands before the cleaner logs its summary.
    a.op.controller
        .process
        .wait_for("cleaned up after the deleted node", Duration::from_secs(10))
        .await?;
    assert!(
        a.op.controller
            .process
            .output()
            .contains("cleaning what lower candidates leave, after a delay"),
        "node-a was not the fallback candidate"
    );
    Ok(())
}

/// A departed node's finalizer is removed even from objects no live operator watches: with
/// node-local handlers whose field selector the API server applies (the CRD makes
/// `spec.nodeName` selectable), node-a's watch never sees node-b's objects, yet the cleanup
/// must find them, or they hang in deletion for ever.
#[tokio::test]
async fn a_departed_nodes_state_is_removed_from_objects_no_live_operator_watches() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    let crd = std::fs::read_to_string(capstan_tests::testenv::repo_root().join("examples/crd.yaml"))?
        .replace(
            "                fail_times:",
            "                nodeName:\n                  type: string\n                fail_times:",
        )
        .replace(
            "      subresources:\n",
            "      selectableFields:\n        - jsonPath: .spec.nodeName\n      subresources:\n",
        );
    env.apply_crd(&crd, "examples.demo.capstan.dev").await?;
    create_nodes(&env, &["node-a", "node-b"]).await?;
    let flags = ["--finalizers", "true", "--node-cleanup-delay", "2s"];
    let preset = "node-local-delete";
    let a = node_with(&env, "node-a", preset, &[("E2E_NODE", "node-a")], &flags).await?;
    let mut b = node_with(&env, "node-b", preset, &[("E2E_NODE", "node-b")], &flags).await?;
    create_example(&env, "x", json!({}), json!({"nodeName": "node-b"})).await?;
    wait(&env, "x", "node-b handled it", &[&a, &b], |o| {
        diffbases(o) == ["node-b.capstan.dev/last-handled-configuration"]
            && o.pointer("/metadata/finalizers")
                .is_some_and(|f| f == &json!(["node-b.capstan.dev/finalizer"]))
    })
    .await?;
    b.op.controller.process.kill().await?;
    env.kubectl_ok(&["delete", "node", "node-b", "--wait=false"])
        .await?;
    wait(&env, "x", "node-b's state removed", &[&a, &b], |o| {
        let annotations = o
            .pointer("/metadata/annotations")
            .and_then(Value::as_object)
            .is_some_and(|m| m.keys().any(|k| k.starts_with("node-b.capstan.dev/")));
        let finalizers = o
            .pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .is_some_and(|f| !f.is_empty());
        !annotations && !finalizers
    })
    .await?;
    env.kubectl_ok(&[
        "delete",
        "examples.demo.capstan.dev",
        "x",
        "-n",
        "default",
        "--timeout=30s",
    ])
    .await?;
    assert_eq!(a.count("local_fn", "x"), 0, "node-a's handlers never ran for x");
    Ok(())
}

/// A kopf operator that laid out its per-node prefixes by hand as `<domain>.<node's first
/// label>` (kopf's own records under them) is taken over with a prefix template: what it
/// handled is not handled again, later changes are.
#[tokio::test]
async fn a_prefix_template_takes_over_objects_of_a_hand_built_per_node_layout() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let api = examples(&env.client().await?, "default");
    let seeded: kube::api::DynamicObject = serde_json::from_value(json!({
        "apiVersion": "demo.capstan.dev/v1", "kind": "Example",
        "metadata": {"name": "seeded", "namespace": "default", "annotations": {
            "example.com.node-a/last-handled-configuration": "{\"spec\":{\"field\":\"x\"}}\n",
            "example.com.node-a/kopf-managed": "yes",
        }},
        "spec": {"field": "x"},
    }))?;
    api.create(&PostParams::default(), &seeded).await?;
    let layout = [
        "--persistence",
        "kopf",
        "--persistence-prefix",
        "example.com",
        "--node-prefix-template",
        "{prefix}.{node_short}",
    ];
    let a = node_with(
        &env,
        "node-a.eu-west-1.compute.internal",
        "create,update",
        &[],
        &layout,
    )
    .await?;
    create_example(&env, "fresh", json!({}), json!({"field": "x"})).await?;
    wait(&env, "fresh", "handled under the template's prefix", &[&a], |o| {
        diffbases(o) == ["example.com.node-a/last-handled-configuration"]
    })
    .await?;
    assert_eq!(a.count("create_fn", "fresh"), 1);
    assert_eq!(
        a.count("create_fn", "seeded"),
        0,
        "what kopf handled is not created again"
    );
    assert_eq!(a.count("update_fn", "seeded"), 0, "nor seen as changed");
    api.patch(
        "seeded",
        &kube::api::PatchParams::default(),
        &kube::api::Patch::Merge(json!({"spec": {"field": "y"}})),
    )
    .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(45);
    while a.count("update_fn", "seeded") < 1 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the change of a taken-over object was not handled:\n{}",
            tail(&a.op.controller.process.output(), 20)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

#[tokio::test]
async fn the_status_storage_keeps_per_node_state_out_of_the_annotations() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let storage = ["--progress-storage", "status", "--diffbase-storage", "status"];
    let a = node_with(&env, "node-a", "create", &[], &storage).await?;
    let b = node_with(&env, "node-b", "create", &[("E2E_FAIL_FIRST", "1")], &storage).await?;
    create_example(&env, "quiet", json!({}), json!({})).await?;
    let handled = |o: &Value, node: &str| {
        o.pointer(&format!("/status/capstan-{node}/last-handled-configuration"))
            .is_some()
    };
    let o = wait(
        &env,
        "quiet",
        "both nodes' diff-bases in the status",
        &[&a, &b],
        |o| handled(o, "node-a") && handled(o, "node-b"),
    )
    .await?;
    let node_annotations: Vec<&String> = o
        .pointer("/metadata/annotations")
        .and_then(Value::as_object)
        .map(|m| {
            m.keys()
                .filter(|k| k.contains(".capstan.dev/") && !k.ends_with("/kopf-managed"))
                .collect()
        })
        .unwrap_or_default();
    assert!(node_annotations.is_empty(), "{node_annotations:?}");
    assert_eq!(a.count("create_fn", "quiet"), 1);
    assert_eq!(
        b.count("create_fn", "quiet"),
        2,
        "node-b's retry kept in its stanza"
    );
    Ok(())
}

#[tokio::test]
async fn node_local_handlers_are_called_only_for_their_nodes_objects() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    create_nodes(&env, &["node-a", "node-b"]).await?;
    // node-a's handlers differ in their selectors, so its watch sees every object and the
    // controller applies local_fn's selectors; node-b's only handler has them all, so its watch
    // asks the server, which refuses a field selector on a custom resource's spec: the
    // controller falls back to filtering itself.
    let a = node(&env, "node-a", "create,node-local", &[("E2E_NODE", "node-a")]).await?;
    let mut b = node(&env, "node-b", "node-local", &[("E2E_NODE", "node-b")]).await?;
    for (name, node, skip) in [
        ("on-a", Some("node-a"), false),
        ("on-b", Some("node-b"), false),
        ("on-b-skipped", Some("node-b"), true),
        ("nowhere", None, false),
    ] {
        let labels = if skip {
            json!({"e2e/skip": "yes"})
        } else {
            json!({})
        };
        create_example(&env, name, labels, json!({"nodeName": node})).await?;
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(45);
    let done = || {
        ["on-a", "on-b", "on-b-skipped", "nowhere"]
            .iter()
            .all(|o| a.count("create_fn", o) == 1)
            && a.count("local_fn", "on-a") == 1
            && b.count("local_fn", "on-b") == 1
    };
    while !done() {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "node-local handlers were not called:\n--- node-a\n{}\n--- node-b\n{}",
            tail(&a.op.controller.process.output(), 20),
            tail(&b.op.controller.process.output(), 20)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    b.op.controller
        .process
        .wait_for("filtering in the controller", Duration::from_secs(5))
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    for other in ["on-b", "on-b-skipped", "nowhere"] {
        assert_eq!(a.count("local_fn", other), 0, "node-a's local_fn ran for {other}");
    }
    for other in ["on-a", "on-b-skipped", "nowhere"] {
        assert_eq!(b.count("local_fn", other), 0, "node-b's local_fn ran for {other}");
    }
    Ok(())
}

#[tokio::test]
async fn two_operators_with_the_same_node_name_are_warned_about() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let crds = tokio::process::Command::new(capstan_tests::process::capstan_binary().await?)
        .arg("crds")
        .output()
        .await?;
    env.apply(&String::from_utf8_lossy(&crds.stdout)).await?;
    let mut first = Controller::start(&env, "capstan-twin1", &["--node-name", "twin"]).await?;
    let mut second = Controller::start(&env, "capstan-twin2", &["--node-name", "twin"]).await?;
    let _other = Controller::start(&env, "capstan-other", &["--node-name", "other"]).await?;
    let warning = "another operator runs with the same node name";
    first.process.wait_for(warning, Duration::from_secs(30)).await?;
    second.process.wait_for(warning, Duration::from_secs(30)).await?;
    assert!(
        !_other.process.output().contains(warning),
        "operators on other nodes are not conflicts"
    );
    Ok(())
}

/// `--node-storage file:<dir>` for the node `node` in `env`'s scratch directory, and the
/// directory its files are in (one per persistence prefix: `<dir>/<node>.capstan.dev`).
fn node_storage(env: &TestEnv, node: &str) -> (PathBuf, String) {
    let dir = env.scratch().join(format!("store-{node}"));
    let flag = format!("file:{}", dir.display());
    (dir.join(format!("{node}.capstan.dev")), flag)
}

/// Waits until `done` holds for the nodes' call logs.
async fn calls_until(what: &str, nodes: &[&Node], done: impl Fn() -> bool) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !done() {
        if tokio::time::Instant::now() > deadline {
            let logs: Vec<String> = nodes
                .iter()
                .map(|n| format!("--- {}\n{}", n.name, tail(&n.op.controller.process.output(), 15)))
                .collect();
            anyhow::bail!("{what}: not within 60 s\n{}", logs.join("\n"));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// The object's uid.
async fn uid(env: &TestEnv, name: &str) -> anyhow::Result<String> {
    let o = examples(&env.client().await?, "default").get(name).await?;
    o.metadata.uid.ok_or_else(|| anyhow::anyhow!("{name} has no uid"))
}

/// With node-local storage, three nodes handle every create, update and delete of shared
/// objects exactly once each, and the objects carry nothing of them but their finalizers.
#[tokio::test]
async fn node_local_storage_handles_every_change_once_per_node_and_keeps_records_off_the_objects()
-> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let mut nodes = Vec::new();
    let mut stores = Vec::new();
    for name in ["node-a", "node-b", "node-c"] {
        let (dir, flag) = node_storage(&env, name);
        let args = ["--node-storage", flag.as_str(), "--finalizers", "true"];
        nodes.push(node_with(&env, name, "create,update,delete", &[], &args).await?);
        stores.push(dir);
    }
    let all: Vec<&Node> = nodes.iter().collect();
    for name in ["shared-1", "shared-2"] {
        create_example(&env, name, json!({}), json!({"field": "a"})).await?;
    }
    calls_until("every node created both", &all, || {
        all.iter()
            .all(|n| n.count("create_fn", "shared-1") == 1 && n.count("create_fn", "shared-2") == 1)
    })
    .await?;
    let o = wait(&env, "shared-1", "the three finalizers", &all, |o| {
        o.pointer("/metadata/finalizers")
            .and_then(Value::as_array)
            .is_some_and(|f| f.len() == 3)
    })
    .await?;
    let on_object: Vec<&String> = o
        .pointer("/metadata/annotations")
        .and_then(Value::as_object)
        .map(|a| a.keys().filter(|k| k.contains(".capstan.dev/")).collect())
        .unwrap_or_default();
    assert!(on_object.is_empty(), "node records on the object: {on_object:?}");
    let shared_1 = uid(&env, "shared-1").await?;
    for dir in &stores {
        assert!(
            dir.join(format!("{shared_1}.json")).exists(),
            "no state in {}",
            dir.display()
        );
    }
    examples(&env.client().await?, "default")
        .patch(
            "shared-1",
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"field": "b"}})),
        )
        .await?;
    calls_until("every node updated shared-1", &all, || {
        all.iter().all(|n| n.count("update_fn", "shared-1") == 1)
    })
    .await?;
    env.kubectl_ok(&[
        "delete",
        "examples.demo.capstan.dev",
        "shared-1",
        "-n",
        "default",
        "--timeout=60s",
    ])
    .await?;
    calls_until("every node deleted shared-1", &all, || {
        all.iter().all(|n| n.count("delete_fn", "shared-1") == 1)
    })
    .await?;
    for n in &all {
        assert_eq!(n.count("create_fn", "shared-1"), 1, "{} created again", n.name);
        assert_eq!(
            n.count("update_fn", "shared-2"),
            0,
            "{} saw a change of shared-2",
            n.name
        );
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while stores.iter().any(|d| d.join(format!("{shared_1}.json")).exists()) {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "a deleted object's state stayed on a node"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// A controller SIGKILLed while a handler runs does not, after its restart, run again the
/// handlers that finished before (their records were kept on the node); a corrupt file makes
/// only its own object be handled again.
#[tokio::test]
async fn node_local_storage_survives_a_sigkill_and_a_corrupt_file_affects_only_its_object()
-> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let (dir, flag) = node_storage(&env, "node-a");
    let args = ["--node-storage", flag.as_str(), "--checkpoint-after", "300ms"];
    let mut a = node_with(&env, "node-a", "create3", &[], &args).await?;
    create_example(&env, "slow", json!({}), json!({"sleep": {"create_b": 4}})).await?;
    create_example(&env, "quick", json!({}), json!({})).await?;
    calls_until("create_b running for slow", &[&a], || {
        a.count("create_b", "slow") == 1
    })
    .await?;
    // create_a's success was checkpointed to the node while create_b runs.
    let slow = uid(&env, "slow").await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(dir.join(format!("{slow}.json"))).is_ok_and(|t| t.contains("create_a")) {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "no checkpoint on the node"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    a.op.controller.process.kill().await?;
    a.op.controller = Controller::start(
        &env,
        "capstan-nodea",
        &[
            "--node-name",
            "node-a",
            "--node-storage",
            &flag,
            "--checkpoint-after",
            "300ms",
        ],
    )
    .await?;
    calls_until("slow finished after the restart", &[&a], || {
        a.count("create_c", "slow") >= 1 && a.count("create_c", "quick") >= 1
    })
    .await?;
    assert_eq!(
        a.count("create_a", "slow"),
        1,
        "a finished handler ran again after the SIGKILL"
    );

    // A truncated file: its object is handled as new; the other is not touched.
    let quick = uid(&env, "quick").await?;
    a.op.controller.process.kill().await?;
    let file = dir.join(format!("{quick}.json"));
    let text = std::fs::read(&file)?;
    std::fs::write(&file, &text[..text.len() / 2])?;
    let before_slow = a.count("create_a", "slow");
    a.op.controller = Controller::start(
        &env,
        "capstan-nodea",
        &["--node-name", "node-a", "--node-storage", &flag],
    )
    .await?;
    calls_until("quick handled again", &[&a], || a.count("create_a", "quick") == 2).await?;
    a.op.controller
        .process
        .wait_for(
            "the node-local state of this object is corrupt",
            Duration::from_secs(10),
        )
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        a.count("create_a", "slow"),
        before_slow,
        "another object was handled again"
    );
    Ok(())
}

/// Event handlers that opted into retries keep their retry records in the node-local store:
/// node-b's handler fails twice and is retried, node-a's runs once, and the object never
/// carries a record of either node.
#[tokio::test]
async fn event_handler_retries_use_the_node_local_storage() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let (_, flag_a) = node_storage(&env, "node-a");
    let (dir_b, flag_b) = node_storage(&env, "node-b");
    let a = node_with(
        &env,
        "node-a",
        "create,event-retry",
        &[],
        &["--node-storage", flag_a.as_str()],
    )
    .await?;
    let b = node_with(
        &env,
        "node-b",
        "create,event-retry",
        &[("E2E_FAIL_FIRST", "2")],
        &["--node-storage", flag_b.as_str()],
    )
    .await?;
    create_example(&env, "ev", json!({}), json!({})).await?;
    let api = examples(&env.client().await?, "default");
    let mut seen_on_object = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while b.count("event_retry", "ev") < 3 || a.count("create_fn", "ev") < 1 || b.count("create_fn", "ev") < 1
    {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "node-b's event handler was not retried: {} calls\n{}",
            b.count("event_retry", "ev"),
            tail(&b.op.controller.process.output(), 20)
        );
        let o = serde_json::to_value(api.get("ev").await?)?;
        if let Some(m) = o.pointer("/metadata/annotations").and_then(Value::as_object) {
            seen_on_object.extend(m.keys().filter(|k| k.contains(".capstan.dev/")).cloned());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        seen_on_object.is_empty(),
        "node records on the object: {seen_on_object:?}"
    );
    let uid = uid(&env, "ev").await?;
    assert!(dir_b.join(format!("{uid}.json")).exists());
    assert_eq!(a.count("create_fn", "ev"), 1);
    // node-b's process fails the first two attempts of every handler: its create handler ran
    // three times, and not once more because of the event handler's retries.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        b.count("create_fn", "ev"),
        3,
        "a retried event handler ran the create handler again"
    );
    Ok(())
}

/// A state file that exists but cannot be read (here a directory in its place, which no one
/// can read, root included) is not a missing one: its object's next change is not processed
/// — never its create handler again — it is retried, reported and counted, and once the file
/// can be read the change is handled as an update.
#[tokio::test]
async fn an_unreadable_state_file_defers_its_object_and_never_runs_its_create_handler_again()
-> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let (dir, flag) = node_storage(&env, "node-a");
    let mut a = node_with(
        &env,
        "node-a",
        "create,update",
        &[],
        &["--node-storage", flag.as_str()],
    )
    .await?;
    create_example(&env, "kept", json!({}), json!({"field": "a"})).await?;
    create_example(&env, "other", json!({}), json!({"field": "a"})).await?;
    calls_until("both created", &[&a], || {
        a.count("create_fn", "kept") == 1 && a.count("create_fn", "other") == 1
    })
    .await?;
    let kept = uid(&env, "kept").await?;
    let file = dir.join(format!("{kept}.json"));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !file.exists() {
        anyhow::ensure!(tokio::time::Instant::now() < deadline, "no state of kept");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let saved = std::fs::read(&file)?;
    std::fs::remove_file(&file)?;
    std::fs::create_dir(&file)?;
    let api = examples(&env.client().await?, "default");
    for name in ["kept", "other"] {
        api.patch(
            name,
            &kube::api::PatchParams::default(),
            &kube::api::Patch::Merge(json!({"spec": {"field": "b"}})),
        )
        .await?;
    }
    calls_until("the other object updated", &[&a], || {
        a.count("update_fn", "other") == 1
    })
    .await?;
    // Retried with growing delays (1, 2, 4 s ...): a few failed reads in 4 s.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(a.count("create_fn", "kept"), 1, "the create handler ran again");
    a.op.controller
        .process
        .wait_for(
            "the object's node-local state cannot be read",
            Duration::from_secs(10),
        )
        .await?;
    let (_, metrics) = a.op.controller.admin_get("/metrics").await?;
    let errors: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("capstan_node_storage_read_errors_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0);
    anyhow::ensure!(errors >= 2.0, "read errors counted: {errors}");
    assert_eq!(a.count("create_fn", "kept"), 1, "the create handler ran again");
    assert_eq!(a.count("update_fn", "kept"), 0, "handled without its state");
    // Readable again: the deferred change is handled, as the update it is.
    std::fs::remove_dir(&file)?;
    std::fs::write(&file, saved)?;
    calls_until("kept updated once readable", &[&a], || {
        a.count("update_fn", "kept") == 1
    })
    .await?;
    assert_eq!(a.count("create_fn", "kept"), 1, "the create handler ran again");
    Ok(())
}

/// A controller whose node-local storage another process still holds (the old pod of a
/// surge rollout) waits for it without blocking: its admin endpoint answers probes
/// meanwhile — alive, not ready, "waiting for storage" — and it starts once the other lets go.
#[tokio::test]
async fn a_held_store_is_waited_for_while_the_admin_endpoint_answers_probes() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let (_, flag) = node_storage(&env, "node-a");
    let args = ["--node-name", "node-a", "--node-storage", flag.as_str()];
    let mut old = Controller::start(&env, "capstan-old", &args).await?;
    let mut new = Controller::spawn(&env, "capstan-new", &args).await?;
    new.process
        .wait_for(
            "another process holds the node-local storage",
            Duration::from_secs(30),
        )
        .await?;
    for _ in 0..3 {
        let (live, body) = new.admin_get("/healthz").await?;
        anyhow::ensure!(live == 200, "not alive while waiting: {live} {body}");
        let (ready, body) = new.admin_get("/readyz").await?;
        anyhow::ensure!(
            ready == 503 && body.contains("waiting for storage"),
            "readiness while waiting: {ready} {body}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    anyhow::ensure!(
        !new.process.output().contains("capstan started"),
        "started while the store is held"
    );
    old.process.terminate().await?;
    new.process
        .wait_for("capstan started", Duration::from_secs(30))
        .await?;
    let (_, body) = new.admin_get("/readyz").await?;
    anyhow::ensure!(
        body.contains("node-local storage opened") && !body.contains("waiting for storage"),
        "readiness once opened: {body}"
    );
    Ok(())
}

/// A node-local storage directory belongs to the release that claimed it first: another
/// release naming the same directory, or one inside it, does not start, and says whose it is.
#[tokio::test]
async fn a_storage_directory_claimed_by_another_release_is_refused_with_its_name() -> anyhow::Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let dir = env.scratch().join("capstan/ops/one");
    let flag = format!("file:{}", dir.display());
    let nested = format!("file:{}", dir.join("inner").display());
    let mut one = Controller::start(
        &env,
        "capstan-one",
        &[
            "--node-name",
            "node-a",
            "--node-storage",
            &flag,
            "--node-storage-claim",
            "ops/one",
        ],
    )
    .await?;
    anyhow::ensure!(std::fs::read_to_string(dir.join(".capstan-claim"))? == "ops/one\n");
    for (name, storage, expected) in [
        (
            "capstan-two",
            flag.as_str(),
            "belongs to \"ops/one\", not to \"ops/two\"",
        ),
        ("capstan-inner", nested.as_str(), "which belongs to \"ops/one\""),
    ] {
        let mut other = Controller::spawn(
            &env,
            name,
            &[
                "--node-name",
                "node-b",
                "--node-storage",
                storage,
                "--node-storage-claim",
                "ops/two",
            ],
        )
        .await?;
        other.process.wait_for(expected, Duration::from_secs(30)).await?;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while other.process.running() {
            anyhow::ensure!(tokio::time::Instant::now() < deadline, "{name} kept running");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        anyhow::ensure!(
            !other.process.output().contains("capstan started"),
            "{name} started"
        );
    }
    one.process.terminate().await?;
    Ok(())
}
