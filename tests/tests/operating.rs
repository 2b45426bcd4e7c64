//! End to end: operating Capstan — `capstan status` on objects in every state (done,
//! retrying with a next attempt, failed for good, per node, handled by kopf, malformed), its
//! JSON, and its messages for bad input; `capstan retry`; status conditions; trace ids across
//! the gRPC hop.
//!
//! Everything runs for real: the testenv API server, the `capstan` binary (as the controller
//! and as the terminal command, with a kubeconfig like kubectl's), the e2e handler process,
//! and kopf from PyPI for the kopf-handled object.

use std::{path::Path, time::Duration};

use anyhow::{Context as _, Result, bail};
use capstan_tests::{
    helm::impersonating_kubeconfig,
    kopf,
    process::{Controller, Process, capstan_binary, start_handler},
    scenario::{Scenario, annotation, tail},
    testenv::TestEnv,
};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(60);

/// What a terminal command printed.
struct Run {
    ok: bool,
    stdout: String,
    stderr: String,
}

/// Runs the `capstan` binary as a terminal command with `kubeconfig`.
async fn capstan(kubeconfig: &Path, args: &[&str]) -> Result<Run> {
    let out = tokio::process::Command::new(capstan_binary().await?)
        .args(args)
        .env("KUBECONFIG", kubeconfig)
        .env_remove("NO_COLOR")
        .output()
        .await
        .context("running capstan")?;
    Ok(Run {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    })
}

/// `capstan status … -o json`, parsed.
async fn status_json(kubeconfig: &Path, args: &[&str]) -> Result<Value> {
    let mut all = vec!["status"];
    all.extend_from_slice(args);
    all.extend(["-o", "json"]);
    let run = capstan(kubeconfig, &all).await?;
    if !run.ok {
        bail!("capstan {} failed: {}", all.join(" "), run.stderr);
    }
    serde_json::from_str(&run.stdout).with_context(|| format!("not JSON: {}", run.stdout))
}

/// The handler entries of one object in a JSON report, by (handler, node).
fn entry<'a>(report: &'a Value, object: &str, handler: &str, node: Option<&str>) -> Option<&'a Value> {
    report["items"].as_array()?.iter().find(|o| o["name"] == object)?["handlers"]
        .as_array()?
        .iter()
        .find(|h| h["handler"] == handler && h["node"].as_str() == node)
}

/// The row of a table that mentions all of `words`.
fn row<'a>(table: &'a str, words: &[&str]) -> Option<&'a str> {
    table
        .lines()
        .find(|l| words.iter().all(|w| l.split_whitespace().any(|x| x == *w)))
}

fn record_says(obj: &Value, key: &str, check: impl Fn(&Value) -> bool) -> bool {
    annotation(obj, key)
        .and_then(|t| serde_json::from_str::<Value>(t).ok())
        .is_some_and(|r| check(&r))
}

/// A per-node operator (controller + handler process) on the scenario's API server.
async fn node_operator(env: &TestEnv, node: &str, presets: &str) -> Result<(Controller, Process)> {
    node_operator_with(env, node, presets, &[]).await
}

/// A per-node operator with extra controller flags.
async fn node_operator_with(
    env: &TestEnv,
    node: &str,
    presets: &str,
    extra: &[&str],
) -> Result<(Controller, Process)> {
    let mut args = vec!["--node-name", node];
    args.extend_from_slice(extra);
    let mut controller = Controller::start(env, &format!("capstan-{node}"), &args).await?;
    let calls = env.scratch().join(format!("calls-{node}.log"));
    let handler = start_handler(
        env,
        &format!("handler-{node}"),
        &controller.endpoint(),
        &[("E2E_HANDLERS", presets), ("E2E_LOG", &calls.to_string_lossy())],
    )?;
    controller
        .process
        .wait_for("handler process connected", T)
        .await?;
    Ok((controller, handler))
}

#[tokio::test]
async fn status_explains_every_state_and_every_storage() -> Result<()> {
    let s = Scenario::start("create3", &[]).await?;
    let (node, _node_handler) = node_operator(&s.env, "node-1", "create3").await?;
    // A third operator keeps its records in the status (`status.capstan-node-2.progress`).
    let (status_node, _status_handler) =
        node_operator_with(&s.env, "node-2", "create3", &["--progress-storage", "status"]).await?;
    let kubeconfig = s.env.kubeconfig.clone();

    s.create("quiet", json!({})).await?;
    // create_b waits ten minutes for its retry; create_a and create_c are done meanwhile.
    let waiting = json!({"temporary": {"create_b": 1000}, "retryDelay": {"create_b": 600}});
    s.create("waiting", waiting.clone()).await?;
    // create_a fails for good while create_b waits: the failure stays visible.
    let mut broken = waiting;
    broken["permanent"] = json!({"create_a": true});
    s.create("broken", broken).await?;

    s.wait("quiet", T, "handled by both operators", |o| {
        annotation(o, "capstan.dev/last-handled-configuration").is_some()
            && annotation(o, "node-1.capstan.dev/last-handled-configuration").is_some()
            && annotation(o, "node-2.capstan.dev/last-handled-configuration").is_some()
    })
    .await?;
    for name in ["waiting", "broken"] {
        for prefix in ["capstan.dev", "node-1.capstan.dev"] {
            s.wait(name, T, "create_b waiting for its retry", |o| {
                record_says(o, &format!("{prefix}/create_b"), |r| r["retries"] == 1)
                    && record_says(o, &format!("{prefix}/create_c"), |r| r["success"] == true)
            })
            .await?;
        }
    }
    s.wait("waiting", T, "node-2's create_b waiting in the status", |o| {
        o.pointer("/status/capstan-node-2/progress/create_b/retries") == Some(&json!(1))
    })
    .await?;
    // A record nobody can read, beside the good ones.
    s.patch(
        "quiet",
        json!({"metadata": {"annotations": {"capstan.dev/create_x": "{garbage"}}}),
    )
    .await?;

    // The table.
    let table = capstan(&kubeconfig, &["status", "examples", "-n", "default"]).await?;
    assert!(table.ok, "{}", table.stderr);
    eprintln!("$ capstan status examples\n{}", table.stdout);
    assert!(!table.stdout.contains('\x1b'), "no colours off a terminal");
    let lines: Vec<&str> = table.stdout.lines().collect();
    let header = lines.first().copied().unwrap_or_default();
    for column in [
        "NAME",
        "NODE",
        "HANDLER",
        "STATE",
        "RETRIES",
        "NEXT ATTEMPT",
        "MESSAGE",
    ] {
        assert!(header.contains(column), "{header}");
    }
    let state_at = header.find("STATE");
    assert!(
        lines.iter().skip(1).all(
            |l| ["done", "running", "retrying", "failed", "malformed", "handled"]
                .iter()
                .any(|w| l
                    .get(state_at.unwrap_or(0)..)
                    .is_some_and(|rest| rest.starts_with(w)))
        ),
        "the STATE column is aligned:\n{}",
        table.stdout
    );
    let waiting_row = row(&table.stdout, &["waiting", "-", "create_b", "retrying", "1"])
        .with_context(|| format!("no retrying row:\n{}", table.stdout))?;
    assert!(
        waiting_row.contains("in 9m") || waiting_row.contains("in 10m"),
        "{waiting_row}"
    );
    assert!(
        waiting_row.contains("temporary failure 1 of 1000"),
        "{waiting_row}"
    );
    assert!(
        row(&table.stdout, &["broken", "-", "create_a", "failed"]).is_some(),
        "{}",
        table.stdout
    );
    assert!(
        row(&table.stdout, &["broken", "node-1", "create_a", "failed"]).is_some(),
        "{}",
        table.stdout
    );
    assert!(
        row(&table.stdout, &["waiting", "node-1", "create_b", "retrying"]).is_some(),
        "{}",
        table.stdout
    );
    assert!(
        row(&table.stdout, &["waiting", "-", "create_c", "done"]).is_some(),
        "{}",
        table.stdout
    );
    let malformed = row(&table.stdout, &["quiet", "create_x", "malformed"])
        .with_context(|| format!("no malformed row:\n{}", table.stdout))?;
    assert!(malformed.contains("not a progress record"), "{malformed}");

    // JSON for scripts.
    let report = status_json(&kubeconfig, &["examples", "-n", "default"]).await?;
    let b = entry(&report, "waiting", "create_b", None).context("create_b of waiting")?;
    assert_eq!(b["state"], "retrying", "{b}");
    assert_eq!(b["retries"], 1);
    assert_eq!(b["purpose"], "create");
    assert_eq!(b["message"], "temporary failure 1 of 1000");
    assert_eq!(b["storedIn"], "annotation capstan.dev/create_b");
    let next = b["nextAttemptInSeconds"].as_i64().unwrap_or_default();
    assert!((400..=600).contains(&next), "{b}");
    assert!(
        b["nextAttempt"].as_str().is_some_and(|t| t.ends_with("+00:00")),
        "{b}"
    );
    let a = entry(&report, "broken", "create_a", None).context("create_a of broken")?;
    assert_eq!(a["state"], "failed", "{a}");
    assert_eq!(a["message"], "permanent failure on purpose");
    let per_node = entry(&report, "broken", "create_a", Some("node-1")).context("node-1's create_a")?;
    assert_eq!(per_node["state"], "failed", "{per_node}");
    assert_eq!(per_node["storedIn"], "annotation node-1.capstan.dev/create_a");
    let in_status = entry(&report, "waiting", "create_b", Some("node-2")).context("node-2's create_b")?;
    assert_eq!(in_status["state"], "retrying", "{in_status}");
    assert_eq!(in_status["storedIn"], "status.capstan-node-2.progress");
    assert_eq!(in_status["owner"], "capstan");
    let quiet = report["items"]
        .as_array()
        .and_then(|i| i.iter().find(|o| o["name"] == "quiet"))
        .context("quiet")?;
    assert_eq!(
        quiet["handledBy"],
        json!([
            "capstan.dev",
            "capstan.dev (node node-1)",
            "capstan.dev (node node-2)"
        ])
    );

    // One object, YAML, another scope.
    let one = capstan(
        &kubeconfig,
        &["status", "examples.demo.capstan.dev", "waiting", "-o", "yaml"],
    )
    .await?;
    assert!(
        one.ok && one.stdout.contains("state: retrying") && !one.stdout.contains("broken"),
        "{}{}",
        one.stdout,
        one.stderr
    );
    let all = capstan(&kubeconfig, &["status", "Example", "-A", "-o", "wide"]).await?;
    assert!(
        all.ok && all.stdout.starts_with("NAMESPACE") && all.stdout.contains("STORED IN"),
        "{}",
        all.stdout
    );
    eprintln!("$ capstan status Example -A -o wide\n{}", all.stdout);

    // As a kubectl plugin: the binary named kubectl-capstan on the PATH.
    let plugins = s.env.scratch().join("plugins");
    std::fs::create_dir_all(&plugins)?;
    std::os::unix::fs::symlink(capstan_binary().await?, plugins.join("kubectl-capstan"))?;
    let path = format!(
        "{}:{}",
        plugins.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let plugin = tokio::process::Command::new("kubectl")
        .args(["capstan", "status", "examples", "waiting"])
        .env("KUBECONFIG", &kubeconfig)
        .env("PATH", &path)
        .output()
        .await?;
    let plugin_out = String::from_utf8_lossy(&plugin.stdout);
    assert!(
        plugin.status.success() && row(&plugin_out, &["waiting", "-", "create_b", "retrying"]).is_some(),
        "kubectl capstan status: {plugin_out}{}",
        String::from_utf8_lossy(&plugin.stderr)
    );

    // Bad input: a clear message each, a failure exit, no crash.
    let unknown = capstan(&kubeconfig, &["status", "nonesuch"]).await?;
    assert!(
        !unknown.ok && unknown.stderr.contains("cannot find the resource \"nonesuch\""),
        "{}",
        unknown.stderr
    );
    let missing = capstan(&kubeconfig, &["status", "examples", "ghost"]).await?;
    assert!(
        !missing.ok
            && missing
                .stderr
                .contains("\"ghost\" not found in namespace default"),
        "{}",
        missing.stderr
    );
    let nobody = impersonating_kubeconfig(&s.env, "system:serviceaccount:default:nobody").await?;
    let denied = capstan(&nobody, &["status", "examples", "-n", "default"]).await?;
    assert!(
        !denied.ok
            && denied
                .stderr
                .contains("forbidden: cannot list examples.demo.capstan.dev in namespace default"),
        "{}",
        denied.stderr
    );
    for run in [&unknown, &missing, &denied] {
        assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
        eprintln!("{}", run.stderr.trim());
    }
    drop(node);
    drop(status_node);
    let Scenario { env, .. } = s;
    env.stop().await
}

#[tokio::test]
async fn status_explains_objects_handled_by_kopf() -> Result<()> {
    let kopf_bin = kopf::binary().await?;
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let log = env.scratch().join("kopf-calls.log");
    let mut operator = kopf::start(&env, &kopf_bin, "kopf", &log).await?;
    let client = env.client().await?;
    let api = capstan_tests::testenv::examples(&client, "default");
    capstan_tests::testenv::create_example(&env, "by-kopf", json!({"temporary": {"create_fn": 100_000}}))
        .await?;
    let deadline = tokio::time::Instant::now() + T;
    loop {
        let obj = serde_json::to_value(api.get("by-kopf").await?)?;
        if record_says(&obj, "kopf.zalando.org/create_fn", |r| {
            r["retries"].as_u64() >= Some(1)
        }) {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "kopf stored no retry record: {obj}\n{}",
                tail(&operator.output(), 40)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let report = status_json(&env.kubeconfig, &["examples", "by-kopf"]).await?;
    let record = entry(&report, "by-kopf", "create_fn", None).context("kopf's create_fn")?;
    assert_eq!(record["owner"], "kopf.zalando.org", "{record}");
    assert_eq!(record["state"], "retrying", "{record}");
    assert_eq!(record["purpose"], "create");
    assert!(record["retries"].as_u64() >= Some(1), "{record}");
    assert!(
        record["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("temporary failure")),
        "{record}"
    );
    let table = capstan(&env.kubeconfig, &["status", "examples", "by-kopf"]).await?;
    assert!(
        row(&table.stdout, &["by-kopf", "create_fn", "retrying"]).is_some(),
        "{}{}",
        table.stdout,
        table.stderr
    );
    eprintln!("$ capstan status examples by-kopf\n{}", table.stdout);
    operator.terminate().await?;
    drop(operator);
    env.stop().await
}

/// The Events about example `name` with `reason`, as (type, message).
async fn events(env: &TestEnv, name: &str, reason: &str) -> Result<Vec<(String, String)>> {
    let out = env
        .kubectl_ok(&[
            "get",
            "events",
            "-A",
            "-o",
            "json",
            "--field-selector",
            &format!("involvedObject.name={name},reason={reason}"),
        ])
        .await?;
    let list: Value = serde_json::from_str(&out)?;
    Ok(list["items"]
        .as_array()
        .map(|items| {
            items
                .iter()
                .map(|e| {
                    (
                        e["type"].as_str().unwrap_or_default().to_owned(),
                        e["message"].as_str().unwrap_or_default().to_owned(),
                    )
                })
                .collect()
        })
        .unwrap_or_default())
}

/// Polls for an Event.
async fn wait_event(env: &TestEnv, name: &str, reason: &str, needle: &str) -> Result<(String, String)> {
    let deadline = tokio::time::Instant::now() + T;
    loop {
        if let Some(e) = events(env, name, reason)
            .await?
            .into_iter()
            .find(|(_, m)| m.contains(needle))
        {
            return Ok(e);
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "no {reason} Event about {name} saying {needle:?}: {:?}",
                events(env, name, reason).await?
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn calls_of(log: &Path, handler: &str, name: &str) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.split_whitespace().take(2).eq([handler, name]))
        .count()
}

#[tokio::test]
async fn retry_reruns_a_permanently_failed_handler_once_in_one_write() -> Result<()> {
    let s = Scenario::start("create3", &[]).await?;
    let (node, _node_handler) = node_operator(&s.env, "node-1", "create3").await?;
    let node_calls = s.env.scratch().join("calls-node-1.log");
    let kubeconfig = s.env.kubeconfig.clone();
    // create_a fails for good; create_b waits ten minutes for its retry, so the cause is not
    // done and create_a's failure stays on record.
    s.create(
        "broken",
        json!({"permanent": {"create_a": true}, "temporary": {"create_b": 1000}, "retryDelay": {"create_b": 600}}),
    )
    .await?;
    for prefix in ["capstan.dev", "node-1.capstan.dev"] {
        s.wait("broken", T, "create_a failed, create_b waiting", |o| {
            record_says(o, &format!("{prefix}/create_a"), |r| r["failure"] == true)
                && record_says(o, &format!("{prefix}/create_b"), |r| r["retries"] == 1)
                && record_says(o, &format!("{prefix}/create_c"), |r| r["success"] == true)
        })
        .await?;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(s.count("create_a", "broken"), 1);

    // Bad input first: an unknown handler lists the known ones, a done one has nothing to retry.
    let unknown = capstan(&kubeconfig, &["retry", "examples", "broken", "--handler", "nope"]).await?;
    assert!(!unknown.ok, "{}", unknown.stdout);
    assert!(
        unknown
            .stderr
            .contains("has no record of handler \"nope\"; handlers with records: create_a (failed), create_b (retrying), create_c (done)"),
        "{}",
        unknown.stderr
    );
    let done = capstan(
        &kubeconfig,
        &["retry", "examples", "broken", "--handler", "create_c"],
    )
    .await?;
    assert!(
        done.ok
            && done
                .stdout
                .starts_with("Nothing to retry on examples.demo.capstan.dev/broken"),
        "{}{}",
        done.stdout,
        done.stderr
    );
    let nothing = capstan(&kubeconfig, &["retry", "examples", "ghost"]).await?;
    assert!(
        !nothing.ok && nothing.stderr.contains("\"ghost\" not found"),
        "{}",
        nothing.stderr
    );
    eprintln!("{}\n{}", unknown.stderr.trim(), done.stdout.trim());

    // The retry: one write by the command, one by the controller, one more call.
    let before = s.writes("broken").len();
    let asked = capstan(
        &kubeconfig,
        &["retry", "examples", "broken", "--handler", "create_a"],
    )
    .await?;
    assert!(asked.ok, "{}", asked.stderr);
    eprintln!(
        "$ capstan retry examples broken --handler create_a\n{}",
        asked.stdout
    );
    let after = s
        .wait("broken", T, "the request consumed", |o| {
            annotation(o, "capstan.dev/retry-request").is_none()
        })
        .await?;
    let (kind, message) = wait_event(&s.env, "broken", "RetryRequested", "'create_a' run again now").await?;
    eprintln!("Event {kind} RetryRequested: {message}");
    assert_eq!(kind, "Normal");
    assert!(
        !message.ends_with("requested by someone."),
        "the requester is named: {message}"
    );
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        s.count("create_a", "broken"),
        2,
        "exactly one more call: {:?}",
        s.calls()
    );
    assert_eq!(s.count("create_b", "broken"), 1, "create_b keeps waiting");
    assert_eq!(
        calls_of(&node_calls, "create_a", "broken"),
        1,
        "node-1 was not asked"
    );
    let writes = s.writes("broken");
    assert_eq!(
        writes.len() - before,
        2,
        "the command's patch and the controller's: {writes:?}"
    );
    assert!(
        record_says(&after, "capstan.dev/create_a", |r| r["failure"] == true),
        "{after}"
    );

    // Per node.
    let asked = capstan(&kubeconfig, &["retry", "examples", "broken", "--node", "node-1"]).await?;
    assert!(
        asked.ok && asked.stdout.contains("node-1.capstan.dev/retry-request"),
        "{}{}",
        asked.stdout,
        asked.stderr
    );
    let deadline = tokio::time::Instant::now() + T;
    while calls_of(&node_calls, "create_a", "broken") < 2 || calls_of(&node_calls, "create_b", "broken") < 2 {
        if tokio::time::Instant::now() > deadline {
            bail!("node-1 did not retry:\n{}", tail(&node.process.output(), 40));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s.wait("broken", T, "node-1's request consumed", |o| {
        annotation(o, "node-1.capstan.dev/retry-request").is_none()
    })
    .await?;
    assert_eq!(
        s.count("create_a", "broken"),
        2,
        "the other operator was not asked"
    );

    // Garbage is removed with a warning.
    s.patch(
        "broken",
        json!({"metadata": {"annotations": {"capstan.dev/retry-request": "please"}}}),
    )
    .await?;
    s.wait("broken", T, "the garbage removed", |o| {
        annotation(o, "capstan.dev/retry-request").is_none()
    })
    .await?;
    let (kind, message) = wait_event(&s.env, "broken", "RetryRequestIgnored", "malformed").await?;
    eprintln!("Event {kind} RetryRequestIgnored: {message}");
    assert_eq!(kind, "Warning");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(s.count("create_a", "broken"), 2);
    drop(node);
    let Scenario { env, .. } = s;
    env.stop().await
}

/// The condition of `kind` on an object.
#[tokio::test]
async fn retry_reruns_a_lone_permanent_failure_after_its_change_completed() -> Result<()> {
    let s = Scenario::start("create", &[]).await?;
    let kubeconfig = s.env.kubeconfig.clone();
    // The only handler fails for good: the creation is complete and its records are purged.
    s.create("lone", json!({"permanent": {"create_fn": true}}))
        .await?;
    s.wait("lone", T, "the creation complete", |o| {
        annotation(o, "capstan.dev/last-handled-configuration").is_some()
            && annotation(o, "capstan.dev/create_fn").is_none()
    })
    .await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(s.count("create_fn", "lone"), 1);

    let before = s.writes("lone").len();
    let asked = capstan(
        &kubeconfig,
        &["retry", "examples", "lone", "--handler", "create_fn"],
    )
    .await?;
    assert!(asked.ok, "{}{}", asked.stdout, asked.stderr);
    eprintln!(
        "$ capstan retry examples lone --handler create_fn\n{}",
        asked.stdout
    );
    s.wait("lone", T, "the request consumed", |o| {
        annotation(o, "capstan.dev/retry-request").is_none()
    })
    .await?;
    let (_, message) = wait_event(&s.env, "lone", "RetryRequested", "'create_fn' run again now").await?;
    eprintln!("Event RetryRequested: {message}");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(
        s.count("create_fn", "lone"),
        2,
        "exactly one more call: {:?}",
        s.calls()
    );
    let writes = s.writes("lone");
    assert_eq!(
        writes.len() - before,
        2,
        "the command's patch and the controller's: {writes:?}"
    );
    Ok(())
}

/// Waits until node `log` shows `n` calls of `handler` for `name`.
async fn node_calls_reach(log: &Path, handler: &str, name: &str, n: usize, node: &Controller) -> Result<()> {
    let deadline = tokio::time::Instant::now() + T;
    while calls_of(log, handler, name) < n {
        if tokio::time::Instant::now() > deadline {
            bail!(
                "{handler} was not called {n} times:\n{}",
                tail(&node.process.output(), 40)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

#[tokio::test]
async fn retry_follows_the_node_prefix_template_and_reaches_node_local_records() -> Result<()> {
    let s = Scenario::start("create3", &[]).await?;
    let kubeconfig = s.env.kubeconfig.clone();
    let template = "{prefix}.{node_short}";
    let (shaped, _shaped_handler) = node_operator_with(
        &s.env,
        "node-2.example.net",
        "create3",
        &["--node-prefix-template", template],
    )
    .await?;
    let store = s.env.scratch().join("store-node-1");
    let flag = format!("file:{}", store.display());
    let (local, _local_handler) =
        node_operator_with(&s.env, "node-1", "create3", &["--node-storage", &flag]).await?;
    // create_a fails for good; create_b waits, so the change stays open on every node.
    s.create(
        "spread",
        json!({"permanent": {"create_a": true}, "temporary": {"create_b": 1000}, "retryDelay": {"create_b": 600}}),
    )
    .await?;
    s.wait("spread", T, "node-2's records under its template", |o| {
        record_says(o, "capstan.dev.node-2/create_a", |r| r["failure"] == true)
    })
    .await?;
    let shaped_log = s.env.scratch().join("calls-node-2.example.net.log");
    let local_log = s.env.scratch().join("calls-node-1.log");
    node_calls_reach(&local_log, "create_a", "spread", 1, &local).await?;

    // The template's prefix: the records are found and the request lands where node-2 reads it.
    let status = capstan(
        &kubeconfig,
        &["status", "examples", "spread", "--node-prefix-template", template],
    )
    .await?;
    assert!(
        row(&status.stdout, &["spread", "node-2", "create_a", "failed"]).is_some(),
        "{}{}",
        status.stdout,
        status.stderr
    );
    let asked = capstan(
        &kubeconfig,
        &[
            "retry",
            "examples",
            "spread",
            "--node",
            "node-2.example.net",
            "--node-prefix-template",
            template,
            "--handler",
            "create_a",
        ],
    )
    .await?;
    assert!(
        asked.ok && asked.stdout.contains("capstan.dev.node-2/retry-request"),
        "{}{}",
        asked.stdout,
        asked.stderr
    );
    node_calls_reach(&shaped_log, "create_a", "spread", 2, &shaped).await?;

    // Node-local records are not on the object: the command says so and asks all the same;
    // the node's controller finds the record in its files and runs the handler again.
    let asked = capstan(
        &kubeconfig,
        &[
            "retry",
            "examples",
            "spread",
            "--node",
            "node-1",
            "--handler",
            "create_a",
        ],
    )
    .await?;
    assert!(
        asked.ok && asked.stdout.contains("node-local storage"),
        "{}{}",
        asked.stdout,
        asked.stderr
    );
    eprintln!(
        "$ capstan retry examples spread --node node-1 --handler create_a\n{}",
        asked.stdout
    );
    node_calls_reach(&local_log, "create_a", "spread", 2, &local).await?;
    s.wait("spread", T, "node-1's request consumed", |o| {
        annotation(o, "node-1.capstan.dev/retry-request").is_none()
    })
    .await?;
    assert_eq!(
        s.count("create_a", "spread"),
        1,
        "the operator without a node was not asked"
    );
    drop((shaped, local));
    let Scenario { env, .. } = s;
    env.stop().await
}

fn condition<'a>(obj: &'a Value, kind: &str) -> Option<&'a Value> {
    obj.pointer("/status/conditions")?
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
}

fn condition_is(obj: &Value, kind: &str, status: &str, generation: i64) -> bool {
    condition(obj, kind).is_some_and(|c| c["status"] == status && c["observedGeneration"] == generation)
}

#[tokio::test]
async fn conditions_follow_progress_and_kubectl_waits_for_them() -> Result<()> {
    let s = Scenario::start("create,update", &["--conditions"]).await?;

    // Progressing while create_fn waits for its retry, then Ready.
    s.create(
        "c1",
        json!({"temporary": {"create_fn": 1}, "retryDelay": {"create_fn": 3}}),
    )
    .await?;
    let progressing = s
        .wait("c1", T, "Progressing while create_fn waits", |o| {
            condition_is(o, "Progressing", "True", 1) && condition_is(o, "Ready", "False", 1)
        })
        .await?;
    let p = condition(&progressing, "Progressing")
        .cloned()
        .unwrap_or_default();
    eprintln!("Progressing: {p}");
    assert_eq!(p["reason"], "Retrying");
    assert!(
        p["message"]
            .as_str()
            .is_some_and(|m| m.contains("temporary failure 1 of 1")),
        "{p}"
    );
    assert!(
        p["lastTransitionTime"]
            .as_str()
            .is_some_and(|t| t.len() == 20 && t.ends_with('Z')),
        "{p}"
    );
    let waited = s
        .env
        .kubectl_ok(&[
            "wait",
            "--for=condition=Ready",
            "examples/c1",
            "-n",
            "default",
            "--timeout=60s",
        ])
        .await?;
    assert!(waited.contains("condition met"), "{waited}");
    let ready = s.get("c1").await?.context("c1")?;
    assert!(condition_is(&ready, "Ready", "True", 1), "{ready}");
    assert!(condition_is(&ready, "Progressing", "False", 1), "{ready}");
    assert!(condition_is(&ready, "Degraded", "False", 1), "{ready}");
    eprintln!(
        "{}",
        serde_json::to_string_pretty(&ready["status"]["conditions"]).unwrap_or_default()
    );

    // A permanent failure of the update: Degraded, not Ready, at the new generation.
    s.patch(
        "c1",
        json!({"spec": {"field": "new", "permanent": {"update_fn": true}}}),
    )
    .await?;
    s.env
        .kubectl_ok(&[
            "wait",
            "--for=condition=Degraded",
            "examples/c1",
            "-n",
            "default",
            "--timeout=60s",
        ])
        .await?;
    let degraded = s
        .wait("c1", T, "Degraded at generation 2", |o| {
            condition_is(o, "Degraded", "True", 2)
                && condition_is(o, "Ready", "False", 2)
                && condition_is(o, "Progressing", "False", 2)
        })
        .await?;
    let d = condition(&degraded, "Degraded").cloned().unwrap_or_default();
    eprintln!("Degraded: {d}");
    assert_eq!(d["reason"], "HandlerFailed");
    assert!(
        d["message"].as_str().is_some_and(|m| m.contains("update_fn")),
        "{d}"
    );

    // The conditions ride in the cycle's own writes: a change handled at once costs the
    // object's PATCH and the status subresource's, nothing per condition.
    s.create("c2", json!({})).await?;
    s.wait("c2", T, "Ready", |o| condition_is(o, "Ready", "True", 1))
        .await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let writes = s.writes("c2");
    eprintln!("writes for a handled creation with conditions: {writes:?}");
    assert!(writes.len() <= 2, "{writes:?}");
    let Scenario { env, .. } = s;
    env.stop().await
}

/// `text` without ANSI colour sequences.
fn plain(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\x1b' {
            for d in chars.by_ref() {
                if d.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// The trace ids (`trace.id=<32 hex digits>`) in the lines of `log` that contain all `words`.
fn trace_ids(log: &str, words: &[&str]) -> Vec<String> {
    plain(log)
        .lines()
        .filter(|l| words.iter().all(|w| l.contains(w)))
        .filter_map(|l| {
            let at = l.find("trace.id=")? + "trace.id=".len();
            let id = l.get(at..at + 32)?;
            id.bytes().all(|b| b.is_ascii_hexdigit()).then(|| id.to_owned())
        })
        .collect()
}

#[tokio::test]
async fn one_trace_id_in_the_controller_log_and_the_handler_log() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let mut controller = Controller::start(&env, "capstan", &[]).await?;
    let calls = env.scratch().join("calls.log");
    let handler = start_handler(
        &env,
        "handler",
        &controller.endpoint(),
        &[
            ("E2E_HANDLERS", "create3"),
            ("E2E_LOG", &calls.to_string_lossy()),
            ("RUST_LOG", "info,capstan_sdk=debug"),
        ],
    )?;
    controller
        .process
        .wait_for("handler process connected", T)
        .await?;
    capstan_tests::testenv::create_example(&env, "traced", json!({})).await?;
    // create_c logs "create_c says hello to traced" through the SDK: the handler process
    // logs it, and the controller logs the record it receives.
    let deadline = tokio::time::Instant::now() + T;
    let (ours, theirs) = loop {
        let ours = trace_ids(
            &controller.process.output(),
            &["capstan::handler", "create_c says hello to traced"],
        );
        let theirs = trace_ids(&handler.output(), &["create_c says hello to traced"]);
        if !ours.is_empty() && !theirs.is_empty() {
            break (ours, theirs);
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "no traced log lines:\ncontroller:\n{}\nhandler:\n{}",
                tail(&controller.process.output(), 30),
                tail(&handler.output(), 30)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    eprintln!("trace id {ours:?} (controller) and {theirs:?} (handler)");
    assert_eq!(ours, theirs, "one invocation, one trace id");
    let id = ours.first().cloned().unwrap_or_default();
    // The controller's spans of the object and of the invocation carry it too.
    let invoking = trace_ids(&controller.process.output(), &["invoking", "handler.id=create_c"]);
    assert!(invoking.contains(&id), "{invoking:?} vs {id}");
    let started = trace_ids(
        &handler.output(),
        &["invocation started", "handler.id=create_c", "traced"],
    );
    assert!(started.contains(&id), "{started:?} vs {id}");
    // Every handler of the cycle is a span of the same trace.
    let create_a = trace_ids(&controller.process.output(), &["invoking", "handler.id=create_a"]);
    assert!(create_a.contains(&id), "{create_a:?} vs {id}");
    drop(handler);
    drop(controller);
    env.stop().await
}
