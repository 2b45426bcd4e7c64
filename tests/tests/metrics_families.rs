//! controller-runtime's metric families on `/metrics`, fed by real work: after objects are
//! handled (one at once, one after a temporary failure), the workqueue and reconcile families
//! of the resource have samples above zero, with controller-runtime's types, beside the
//! `capstan_*` families (the watch is up, API requests are counted by answer, the process's
//! memory is shown); with leader election, `leader_election_master_status` says this replica
//! leads. The page is read by Prometheus' own text-format parser (its Python client's,
//! pinned in `tests/interop/setup.sh`), which must find every family with its type.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use capstan_tests::{
    process::venv_python,
    scenario::{Scenario, annotation},
};
use serde_json::json;

const T: Duration = Duration::from_secs(60);

/// The value of the sample whose line starts with `prefix` (name and labels).
fn value(page: &str, prefix: &str) -> Option<f64> {
    page.lines()
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// The type a `# TYPE` line declares for `family`.
fn declared<'a>(page: &'a str, family: &str) -> Option<&'a str> {
    page.lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .find_map(|l| l.strip_prefix(family)?.strip_prefix(' '))
}

/// The families of a metrics page as Prometheus' own text-format parser (its Python client's)
/// reads them: name → `{"type": …, "samples": n}`. A page it cannot parse is an error.
async fn parse_with_prometheus_client(page: &str) -> Result<serde_json::Map<String, serde_json::Value>> {
    use tokio::io::AsyncWriteExt as _;
    const READ: &str = "import json, sys\n\
        from prometheus_client.parser import text_string_to_metric_families\n\
        families = {f.name: {'type': f.type, 'samples': len(f.samples)}\n\
                    for f in text_string_to_metric_families(sys.stdin.read())}\n\
        print(json.dumps(families))\n";
    let python = venv_python("CAPSTAN_INTEROP_PYTHON", "tests/interop/setup.sh").await?;
    let mut child = tokio::process::Command::new(python)
        .args(["-c", READ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    let mut stdin = child.stdin.take().context("no stdin")?;
    stdin.write_all(page.as_bytes()).await?;
    drop(stdin);
    let out = tokio::time::timeout(T, child.wait_with_output())
        .await
        .context("the parser did not finish")??;
    ensure!(
        out.status.success(),
        "Prometheus' text parser refused the page: {}\n{page}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(serde_json::from_slice(&out.stdout)?)
}

#[tokio::test]
async fn controller_runtime_families_count_the_handled_objects() -> Result<()> {
    let mut s = Scenario::start(
        "create3,update,delete",
        &["--leader-election", "--lease-name", "capstan-metrics"],
    )
    .await?;
    s.create("handled-at-once", json!({})).await?;
    s.create("handled-after-a-retry", json!({"temporary": {"create_b": 1}}))
        .await?;
    for name in ["handled-at-once", "handled-after-a-retry"] {
        s.wait(name, T, "handled", |o| {
            annotation(o, "capstan.dev/last-handled-configuration").is_some()
        })
        .await?;
    }
    let (code, page) = s.controller.admin_get("/metrics").await?;
    ensure!(code == 200, "/metrics answered {code}");
    let parsed = parse_with_prometheus_client(&page).await?;

    for (family, kind) in [
        ("workqueue_depth", "gauge"),
        ("workqueue_adds_total", "counter"),
        ("workqueue_queue_duration_seconds", "histogram"),
        ("workqueue_work_duration_seconds", "histogram"),
        ("workqueue_unfinished_work_seconds", "gauge"),
        ("workqueue_longest_running_processor_seconds", "gauge"),
        ("workqueue_retries_total", "counter"),
        ("controller_runtime_reconcile_total", "counter"),
        ("controller_runtime_reconcile_errors_total", "counter"),
        ("controller_runtime_reconcile_time_seconds", "histogram"),
        ("controller_runtime_active_workers", "gauge"),
        ("controller_runtime_max_concurrent_reconciles", "gauge"),
        ("leader_election_master_status", "gauge"),
        ("capstan_handler_invocations_total", "counter"),
        ("capstan_watch_up", "gauge"),
        ("capstan_api_requests_total", "counter"),
        ("process_resident_memory_bytes", "gauge"),
    ] {
        ensure!(
            declared(&page, family) == Some(kind),
            "{family} is not declared a {kind}:\n{page}"
        );
        // Prometheus' parser names a counter's family without its `_total`.
        let name = if kind == "counter" {
            family.strip_suffix("_total").unwrap_or(family)
        } else {
            family
        };
        let parsed_kind = parsed.get(name).and_then(|f| f["type"].as_str());
        ensure!(
            parsed_kind == Some(kind),
            "Prometheus' text parser reads {family} as {parsed_kind:?}, not {kind}"
        );
    }
    let queue = "{name=\"examples\",controller=\"examples\"}";
    let controller = "{controller=\"examples\"";
    for sample in [
        format!("workqueue_adds_total{queue}"),
        format!("workqueue_queue_duration_seconds_count{queue}"),
        format!("workqueue_work_duration_seconds_count{queue}"),
        format!("workqueue_retries_total{queue}"),
        format!("controller_runtime_reconcile_total{controller},result=\"success\"}}"),
        format!("controller_runtime_reconcile_total{controller},result=\"error\"}}"),
        format!("controller_runtime_reconcile_errors_total{controller}}}"),
        format!("controller_runtime_reconcile_time_seconds_count{controller}}}"),
        format!("controller_runtime_max_concurrent_reconciles{controller}}}"),
        "leader_election_master_status{name=\"capstan-metrics\"}".to_owned(),
        "capstan_watch_up{resource=\"examples\"}".to_owned(),
        "capstan_api_requests_total{method=\"PATCH\",code=\"200\"}".to_owned(),
        "process_resident_memory_bytes".to_owned(),
    ] {
        let v = value(&page, &sample).with_context(|| format!("no sample {sample}:\n{page}"))?;
        ensure!(v > 0.0, "{sample} is {v}:\n{page}");
    }
    for sample in [
        format!("workqueue_depth{queue}"),
        format!("workqueue_unfinished_work_seconds{queue}"),
        format!("workqueue_longest_running_processor_seconds{queue}"),
        format!("controller_runtime_active_workers{controller}}}"),
    ] {
        value(&page, &sample).with_context(|| format!("no sample {sample}:\n{page}"))?;
    }
    s.handler.terminate().await?;
    s.controller.process.terminate().await?;
    s.env.stop().await
}
