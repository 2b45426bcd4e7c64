//! A controller started on a cluster with thousands of unhandled objects: only
//! `--worker-limit` of them are processed at any time (the peak is read from the controller's
//! own metric), at most the waiting bound of them wait with their body (the rest are listed
//! again, page by page, as room frees up; beyond it only one next event per object being
//! processed), each is handled exactly once, and the controller's peak memory is reported.
//!
//! An object created while that backlog drains is a change: it goes before the listed objects
//! still waiting (see the queue's ready lines), so it is handled long before the backlog ends.
//! So is one created while the initial listing is still read: the watch runs from the
//! listing's first page on, and the object is handled before the listing's last page.

use std::{collections::HashMap, time::Duration};

use anyhow::{Context as _, Result, ensure};
use capstan_tests::{
    faults::{self, peak_rss_kib},
    scenario::Scenario,
    testenv::{TestEnv, examples},
};
use futures::{StreamExt as _, stream};
use kube::api::{DynamicObject, PostParams};
use serde_json::json;

/// The object created while the backlog drains.
const FRESH: &str = "zz-fresh";

/// The object created while the initial listing is read.
const EARLY: &str = "zz-early";

/// Objects per page of the listing: small, so that reading the backlog takes a while.
const PAGE_SIZE: &str = "2";

/// What the controller logs when a watch's listing has ended.
const LISTED: &str = "listed objects=";

/// The worker limit the controller is started with: far below the object count.
const LIMIT: u64 = 8;

/// How many objects may wait with their body at that worker limit (the controller's floor of
/// 1,024): below the object count, so that the start lists most objects again.
const WAITING_BODIES: f64 = 1024.0;

/// The value of an unlabelled gauge in a Prometheus text page.
fn gauge(page: &str, name: &str) -> Option<f64> {
    page.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))
        .and_then(|v| v.trim().parse().ok())
}

/// The sum of a gauge family over its labels.
fn family_sum(page: &str, name: &str) -> f64 {
    page.lines()
        .filter(|l| l.starts_with(&format!("{name}{{")))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[tokio::test]
async fn a_start_with_thousands_of_unhandled_objects_handles_each_once_within_the_worker_limit() -> Result<()>
{
    let n = faults::size(2000, 10_000);
    let (env, api) = with_unhandled(n).await?;

    let kubeconfig = env.kubeconfig.clone();
    let limit = LIMIT.to_string();
    let s = Scenario::attach(env, &kubeconfig, "create", &["--worker-limit", &limit], "default").await?;
    let started = tokio::time::Instant::now();
    let deadline = started + Duration::from_secs(if faults::long() { 900 } else { 180 });
    let mut most_seen = 0.0f64;
    let mut most_pending = 0.0f64;
    // The new object: created once two fifths of the backlog are handled, when a relisting
    // keeps the waiting bound full; named to come last in a listing.
    let mut fresh: Option<(tokio::time::Instant, usize)> = None;
    let mut fresh_handled: Option<(Duration, usize)> = None;
    loop {
        let (_, page) = s.controller.admin_get("/metrics").await?;
        let now = gauge(&page, "capstan_objects_processing").unwrap_or_default();
        most_seen = most_seen.max(now);
        ensure!(
            now <= LIMIT as f64,
            "{now} objects processed at once with --worker-limit {LIMIT}"
        );
        let calls = s.calls();
        let handled = calls.len();
        if fresh.is_none() && handled >= n * 2 / 5 {
            let obj: DynamicObject = serde_json::from_value(json!({
                "apiVersion": "demo.capstan.dev/v1", "kind": "Example",
                "metadata": {"name": FRESH, "namespace": "default"},
                "spec": {"field": "initial", "size": 1},
            }))?;
            api.create(&PostParams::default(), &obj).await?;
            fresh = Some((tokio::time::Instant::now(), handled));
        }
        if let Some((at, _)) = fresh
            && fresh_handled.is_none()
            && calls.iter().any(|(_, name, _)| name == FRESH)
        {
            fresh_handled = Some((at.elapsed(), handled));
        }
        let handled = calls.iter().filter(|(_, name, _)| name != FRESH).count();
        let pending = family_sum(&page, "capstan_objects_pending");
        most_pending = most_pending.max(pending);
        // Beyond the bound only the next event of an object being processed waits with its
        // body (at most one per worker); the echoes of the controller's own writes never do,
        // also when those made during the initial listing come at once as the watch starts.
        ensure!(
            pending <= WAITING_BODIES + LIMIT as f64,
            "{pending} objects waited with their body, beyond the bound of {WAITING_BODIES}"
        );
        if handled >= n && fresh_handled.is_some() && pending == 0.0 && now == 0.0 {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "{handled} of {n} objects handled in time ({pending} pending, {now} processing)"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let took = started.elapsed();
    ensure!(
        s.controller
            .process
            .output()
            .contains("listed again; objects without a body in memory queued"),
        "the objects beyond the waiting bound were not listed again"
    );

    // The new object did not wait for the backlog.
    let (_, created_with) = fresh.context("the new object was never created")?;
    let (after, handled_with) = fresh_handled.context("the new object was not handled")?;
    println!(
        "an object created with {created_with} of {n} listed objects handled was handled {:.0} ms later, \
         with {handled_with} handled",
        after.as_secs_f64() * 1000.0
    );
    // In arrival order it would wait for every listed object with a body (over 1,000), and
    // marked beyond the bound for the next relisting.
    ensure!(
        handled_with - created_with < n / 10,
        "the new object waited behind the backlog: handled with {handled_with} of {n} listed objects done \
         (created with {created_with})"
    );
    let mut per_object: HashMap<String, usize> = HashMap::new();
    for (handler, name, _) in s.calls() {
        ensure!(handler == "create_fn", "unexpected handler {handler}");
        if name != FRESH {
            *per_object.entry(name).or_default() += 1;
        }
    }
    ensure!(
        per_object.len() == n,
        "{} of {n} objects handled",
        per_object.len()
    );
    let twice: Vec<_> = per_object.iter().filter(|(_, c)| **c != 1).collect();
    ensure!(twice.is_empty(), "objects not handled exactly once: {twice:?}");

    let pid = s
        .controller
        .process
        .id()
        .context("the controller is not running")?;
    let hwm = peak_rss_kib(pid).context("no VmHWM for the controller")?;
    let rss = rss_kib(pid).context("no VmRSS for the controller")?;
    let (_, page) = s.controller.admin_get("/metrics").await?;
    let peak = gauge(&page, "capstan_objects_processing_peak");
    println!(
        "{n} pre-existing objects handled exactly once in {:.1} s; at most {peak:?} processed at once \
         (seen {most_seen}), {most_pending} waiting with a body; controller RSS {:.1} MiB, peak {:.1} MiB",
        took.as_secs_f64(),
        rss as f64 / 1024.0,
        hwm as f64 / 1024.0
    );
    let peak = peak.context("no capstan_objects_processing_peak metric")?;
    ensure!(
        peak >= 1.0 && peak <= LIMIT as f64,
        "the peak of objects processed at once was {peak} with --worker-limit {LIMIT}"
    );
    // The start-up burst costs little more than keeping the objects: a waiting object holds
    // no task. (Generous for a debug build on a busy machine.)
    ensure!(
        hwm * 2 <= rss * 3,
        "the controller peaked at {hwm} KiB while starting, against {rss} KiB with everything handled"
    );
    Ok(())
}

/// A real API server with the example resource and `n` unhandled objects of it in `default`,
/// and the API of those objects.
async fn with_unhandled(n: usize) -> Result<(TestEnv, kube::Api<DynamicObject>)> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let client = env.client().await?;
    let api = examples(&client, "default");
    create_unhandled(&api, n).await?;
    Ok((env, api))
}

/// Creates `n` objects in `default`, each with a spec of about 300 bytes.
async fn create_unhandled(api: &kube::Api<DynamicObject>, n: usize) -> Result<()> {
    let items: Vec<String> = (0..4)
        .map(|i| format!("item-{i:02}-{}", "x".repeat(52)))
        .collect();
    let created: Vec<Result<DynamicObject, kube::Error>> = stream::iter(0..n)
        .map(|i| {
            let api = api.clone();
            let items = items.clone();
            async move {
                let obj: DynamicObject = serde_json::from_value(json!({
                    "apiVersion": "demo.capstan.dev/v1", "kind": "Example",
                    "metadata": {"name": format!("pre-{i}"), "namespace": "default"},
                    "spec": {"field": "initial", "size": 1, "items": items},
                }))
                .map_err(kube::Error::SerdeError)?;
                api.create(&PostParams::default(), &obj).await
            }
        })
        .buffer_unordered(32)
        .collect()
        .await;
    for c in created {
        c?;
    }
    Ok(())
}

/// The watch runs from the listing's first page on: an object created once it is up, while
/// the other pages of a listing of thousands are read (small pages make that take a while),
/// is handled before the listing ends.
#[tokio::test]
async fn an_object_created_while_the_initial_listing_is_read_is_handled_before_it_ends() -> Result<()> {
    let n = faults::size(1000, 10_000);
    let (env, api) = with_unhandled(n).await?;
    let kubeconfig = env.kubeconfig.clone();
    let s = Scenario::attach(
        env,
        &kubeconfig,
        "create",
        &["--watch-page-size", PAGE_SIZE],
        "default",
    )
    .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        ensure!(
            !s.controller.process.output().contains(LISTED),
            "the listing of {n} objects ended before the test saw the watch up: too few objects to tell"
        );
        let (_, page) = s.controller.admin_get("/metrics").await?;
        if page
            .lines()
            .any(|l| l.starts_with("capstan_watch_up{") && l.ends_with(" 1"))
        {
            break;
        }
        ensure!(tokio::time::Instant::now() < deadline, "the watch never came up");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "demo.capstan.dev/v1", "kind": "Example",
        "metadata": {"name": EARLY, "namespace": "default"},
        "spec": {"field": "initial", "size": 1},
    }))?;
    api.create(&PostParams::default(), &obj).await?;
    let created = tokio::time::Instant::now();
    let after = loop {
        // Read in this order, a call seen before the listing's end is seen to have come first.
        let handled = s.calls().iter().any(|(_, name, _)| name == EARLY);
        let listed = s.controller.process.output().contains(LISTED);
        ensure!(
            !listed,
            "the object created while the listing of {n} objects was read was handled only after it \
             ended (or at that very moment)"
        );
        if handled {
            break created.elapsed();
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the object created while the listing was read was not handled"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    println!(
        "an object created while the listing of {n} objects was read was handled {:.0} ms later, before it ended",
        after.as_secs_f64() * 1000.0
    );
    // Everything else is still handled, each object once.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(if faults::long() { 900 } else { 180 });
    loop {
        let mut per_object: HashMap<String, usize> = HashMap::new();
        for (_, name, _) in s.calls() {
            *per_object.entry(name).or_default() += 1;
        }
        if per_object.len() == n + 1 {
            let twice: Vec<_> = per_object.iter().filter(|(_, c)| **c != 1).collect();
            ensure!(twice.is_empty(), "objects not handled exactly once: {twice:?}");
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "{} of {} objects handled in time",
            per_object.len(),
            n + 1
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(())
}

/// The resident set size of a process in KiB (`VmRSS`).
fn rss_kib(pid: u32) -> Option<u64> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}
