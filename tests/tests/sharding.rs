//! End to end: sharding among replicas on the real API server. Three members share the
//! objects by the ring (each object's change handled once, by its owner); one member stops
//! cleanly and the others take its objects at once; one is killed (SIGKILL) and the last takes
//! everything once its Lease expired; no change is handled twice along the way, also under
//! random joins, SIGTERMs and SIGKILLs, where the API server's audit log shows each change
//! written once, by the member that handled it (members' user agents name them). A freeze
//! pauses every member, daemons and timers move with their objects, and indexes hold every
//! object on every member. Each runs on Kubernetes 1.35, which ignores KEP-5866's shard
//! filter (members drop others' objects on arrival), and again on 1.36 with the filter on
//! (`…with_the_servers_shard_filter…`); a member cut off from the API server is tested on 1.35.

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use anyhow::{Context as _, Result, bail, ensure};
use capstan::sharding::ring::Ring;
use capstan_tests::{
    operator::{Operator, Start},
    scenario::tail,
    testenv::{Kube, Options, TestEnv, create_example, examples},
};
use kube::api::{Patch, PatchParams};
use serde_json::{Value, json};

/// Short durations, so that a crash is noticed within seconds.
const SHARDING: [&str; 11] = [
    "--sharding",
    "--lease-duration",
    "5s",
    "--renew-deadline",
    "4s",
    "--retry-period",
    "1s",
    "--sharding-settle",
    "1s",
    "--shutdown-grace",
    "3s",
];

/// A member: an operator replica with `--sharding` and the short durations above.
async fn member(env: &TestEnv, name: &str, presets: &str, extra: &[&str]) -> Result<Operator> {
    member_with(env, None, name, presets, extra).await
}

/// A member that reaches the API server through `kubeconfig` (a fault-injecting proxy).
async fn member_with(
    env: &TestEnv,
    kubeconfig: Option<&std::path::Path>,
    name: &str,
    presets: &str,
    extra: &[&str],
) -> Result<Operator> {
    let mut args: Vec<&str> = SHARDING.to_vec();
    args.extend(["--peer-id", name]);
    args.extend(extra);
    let start = Start {
        args: &args,
        kubeconfig,
        ..Start::default()
    };
    Operator::start_with(env, name, presets, start).await
}

/// What a member's readiness says about the ring.
async fn ring(member: &Operator) -> Result<String> {
    let (_, body) = member.controller.admin_get("/readyz").await?;
    let report: Value = serde_json::from_str(&body)?;
    Ok(report["checks"]["sharding"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_owned())
}

/// Waits until every member's readiness says it is settled in a ring of `n`.
async fn settled(members: &[&Operator], n: usize, timeout: Duration) -> Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    let wanted = format!("member of {n} ");
    loop {
        let mut views = Vec::new();
        for m in members {
            views.push(ring(m).await?);
        }
        if views
            .iter()
            .all(|v| v.starts_with(&wanted) && !v.contains("handing over"))
        {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            let logs: Vec<String> = members
                .iter()
                .map(|m| format!("{}:\n{}", m.name, tail(&m.controller.process.output(), 15)))
                .collect();
            bail!(
                "the ring of {n} did not settle within {timeout:?}: {views:?}\n{}",
                logs.join("\n")
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The uids of the objects, by name.
async fn uids(env: &TestEnv, names: &[String]) -> Result<BTreeMap<String, String>> {
    let api = examples(&env.client().await?, "default");
    let mut out = BTreeMap::new();
    for name in names {
        let obj = api.get(name).await?;
        out.insert(name.clone(), obj.metadata.uid.context("a uid")?);
    }
    Ok(out)
}

/// Waits until `handler` was called `times` times in all for every object.
async fn handled_everywhere(
    members: &[&Operator],
    handler: &str,
    names: &[String],
    times: usize,
    timeout: Duration,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let mut total: BTreeMap<String, usize> = BTreeMap::new();
        for m in members {
            for (object, n) in m.called(handler) {
                *total.entry(object).or_default() += n;
            }
        }
        let short: Vec<&String> = names
            .iter()
            .filter(|n| total.get(*n).copied().unwrap_or(0) < times)
            .collect();
        if short.is_empty() {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("{handler} was not called {times} time(s) for {short:?} within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Patches `spec.field` of every object (a change for the update handlers).
async fn change_all(env: &TestEnv, names: &[String], value: i64) -> Result<()> {
    let api = examples(&env.client().await?, "default");
    for name in names {
        api.patch(
            name,
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"field": value.to_string()}})),
        )
        .await?;
    }
    Ok(())
}

/// Checks that each object's `handler` calls were made by its owner in `ring` only (counting
/// from `before`, the calls each member had made until then), `per_object` times.
fn by_owners(
    members: &[&Operator],
    before: &BTreeMap<String, BTreeMap<String, usize>>,
    handler: &str,
    ring: &Ring,
    uids: &BTreeMap<String, String>,
    per_object: usize,
) -> Result<()> {
    for (name, uid) in uids {
        let owner = ring.owner_of(uid).context("an owner")?;
        for m in members {
            let now = m.called(handler).get(name).copied().unwrap_or(0);
            let was = before
                .get(&m.name)
                .and_then(|c| c.get(name))
                .copied()
                .unwrap_or(0);
            let expected = if m.name == owner { per_object } else { 0 };
            ensure!(
                now - was == expected,
                "{handler} of {name} (owner {owner}) was called {} time(s) by {}",
                now - was,
                m.name
            );
        }
    }
    Ok(())
}

fn snapshot(members: &[&Operator], handler: &str) -> BTreeMap<String, BTreeMap<String, usize>> {
    members
        .iter()
        .map(|m| (m.name.clone(), m.called(handler)))
        .collect()
}

/// A real API server: Kubernetes 1.36 with KEP-5866's shard filter on when `filtered` (each
/// member lists and watches only its ranges, and asks for its new ranges after every
/// hand-over), else 1.35, which ignores the filter (members drop others' objects on arrival).
async fn server(filtered: bool) -> Result<TestEnv> {
    if filtered {
        TestEnv::start_with(Options {
            kube: Kube::V1_36,
            feature_gates: &["ShardedListAndWatch=true"],
        })
        .await
    } else {
        TestEnv::start().await
    }
}

#[tokio::test]
async fn members_share_the_objects_and_take_over_from_one_that_leaves_and_one_that_crashes() -> Result<()> {
    share_and_take_over(server(false).await?, false).await
}

#[tokio::test]
async fn with_the_servers_shard_filter_members_watch_only_their_objects_and_still_take_over() -> Result<()> {
    share_and_take_over(server(true).await?, true).await
}

/// Counts the events of a watch of `api` from now on (added, modified, deleted), in the
/// background until the test ends.
async fn count_events(
    api: kube::Api<kube::api::DynamicObject>,
) -> Result<std::sync::Arc<std::sync::atomic::AtomicU64>> {
    use futures::{StreamExt as _, TryStreamExt as _};
    let from = api
        .list(&kube::api::ListParams::default())
        .await?
        .metadata
        .resource_version
        .context("a list without a resourceVersion")?;
    let mut events = api
        .watch(&kube::api::WatchParams::default().timeout(290), &from)
        .await?
        .boxed();
    let count = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let counted = count.clone();
    tokio::spawn(async move {
        while let Ok(Some(event)) = events.try_next().await {
            if matches!(
                event,
                kube::api::WatchEvent::Added(_)
                    | kube::api::WatchEvent::Modified(_)
                    | kube::api::WatchEvent::Deleted(_)
            ) {
                counted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
        }
    });
    Ok(count)
}

/// Three members share 24 objects; one leaves, one crashes; `filtered`: the server filters
/// by shard.
async fn share_and_take_over(env: TestEnv, filtered: bool) -> Result<()> {
    env.apply_example_crd().await?;
    let a = member(&env, "a", "create,update", &[]).await?;
    let b = member(&env, "b", "create,update", &[]).await?;
    let c = member(&env, "c", "create,update", &[]).await?;
    settled(&[&a, &b, &c], 3, Duration::from_secs(30)).await?;

    // What a watch without the shard filter receives from here on: every object's events.
    let everything = count_events(examples(&env.client().await?, "default")).await?;
    let names: Vec<String> = (0..24).map(|i| format!("obj-{i:02}")).collect();
    for name in &names {
        create_example(&env, name, json!({})).await?;
    }
    handled_everywhere(&[&a, &b, &c], "create_fn", &names, 1, Duration::from_secs(60)).await?;
    let uids = uids(&env, &names).await?;
    let three = Ring::new(["a", "b", "c"]);
    by_owners(&[&a, &b, &c], &BTreeMap::new(), "create_fn", &three, &uids, 1)?;
    for m in [&a, &b, &c] {
        ensure!(!m.called("create_fn").is_empty(), "{} handled no object", m.name);
    }
    // `capstan status` shows each object's member, as the ring says.
    let status = tokio::process::Command::new(capstan_tests::process::capstan_binary().await?)
        .args([
            "status", "examples", "-n", "default", "--ring", "capstan", "-o", "json",
        ])
        .env("KUBECONFIG", &env.kubeconfig)
        .output()
        .await?;
    ensure!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let report: Value = serde_json::from_slice(&status.stdout)?;
    for item in report["items"].as_array().context("items")? {
        let name = item["name"].as_str().unwrap_or_default();
        let owner = uids.get(name).and_then(|u| three.owner_of(u));
        ensure!(
            item["member"].as_str() == owner,
            "capstan status says {name} is {}'s, the ring says {owner:?}",
            item["member"]
        );
    }
    for m in [&a, &b, &c] {
        // Custom resources' lists do not echo `shardInfo` (Kubernetes 1.36): the log says
        // the filter is unconfirmed either way; what arrives tells.
        let log = m.controller.process.output();
        ensure!(
            log.contains("the API server did not confirm a shard filter"),
            "{} did not say how objects are filtered",
            m.name
        );
        let (_, metrics) = m.controller.admin_get("/metrics").await?;
        let received: u64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix("capstan_watch_events_total{resource=\"examples\"} "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0);
        let own = m.called("create_fn").len() as u64;
        if filtered {
            // Its own objects' events only: nothing of the others' ever arrives, so fewer
            // than a watch of every object received (each object has events of its own).
            let all = everything.load(std::sync::atomic::Ordering::Relaxed);
            eprintln!(
                "{}: {received} events for its {own} objects; every object's: {all}",
                m.name
            );
            ensure!(
                received < all,
                "{} received {received} events for its {own} objects of {}; a watch of every object received {all}",
                m.name,
                names.len()
            );
        } else {
            ensure!(received >= names.len() as u64, "{} received {received}", m.name);
        }
    }

    // A member stops cleanly: the others take its objects at once.
    let before = snapshot(&[&a, &b], "update_fn");
    let left = tokio::time::Instant::now();
    c.stop().await?;
    settled(&[&a, &b], 2, Duration::from_secs(10)).await?;
    let took = left.elapsed();
    ensure!(
        took < Duration::from_secs(6),
        "the hand-over after a clean exit took {took:?}"
    );
    change_all(&env, &names, 1).await?;
    handled_everywhere(&[&a, &b], "update_fn", &names, 1, Duration::from_secs(30)).await?;
    by_owners(&[&a, &b], &before, "update_fn", &Ring::new(["a", "b"]), &uids, 1)?;

    // A member is killed: the last one takes everything once its Lease expired.
    let before = snapshot(&[&a], "update_fn");
    let killed = tokio::time::Instant::now();
    b.kill().await?;
    change_all(&env, &names, 2).await?;
    settled(&[&a], 1, Duration::from_secs(15)).await?;
    let took = killed.elapsed();
    // The lease duration (5 s) as observed, a retry period and some slack.
    ensure!(
        took < Duration::from_secs(10),
        "the take-over after a crash took {took:?}"
    );
    handled_everywhere(&[&a], "update_fn", &names, 1, Duration::from_secs(30)).await?;
    let after = a.called("update_fn");
    for name in &names {
        let now = after.get(name).copied().unwrap_or(0);
        let was = before.get("a").and_then(|c| c.get(name)).copied().unwrap_or(0);
        ensure!(
            now - was == 1,
            "update_fn of {name} was called {} time(s) by a after the crash",
            now - was
        );
    }
    // Nothing was created twice along the way (engines restarted with every ring change).
    tokio::time::sleep(Duration::from_secs(1)).await;
    let creates = a.called("create_fn");
    ensure!(
        creates.values().all(|n| *n == 1),
        "create_fn ran twice: {creates:?}"
    );

    let (_, metrics) = a.controller.admin_get("/metrics").await?;
    for wanted in [
        "capstan_sharding_members 1",
        "capstan_sharding_objects{member=\"a\"} 24",
        "capstan_sharding_handover_seconds_count{member=\"a\"}",
        "capstan_sharding_moves_total{member=\"a\"}",
    ] {
        ensure!(
            metrics.contains(wanted),
            "the metrics lack {wanted:?}:\n{metrics}"
        );
    }
    let events = env
        .kubectl_ok(&[
            "get",
            "events",
            "-n",
            "default",
            "--field-selector",
            "reason=RingChanged",
            "-o",
            "jsonpath={.items[*].involvedObject.name}",
        ])
        .await?;
    ensure!(
        events.contains("capstan-member-a"),
        "no ring change Event on a's Lease: {events:?}"
    );
    let leases = env
        .kubectl_ok(&[
            "get",
            "leases",
            "-n",
            "default",
            "-l",
            "capstan.dev/ring=capstan",
            "-o",
            "name",
        ])
        .await?;
    ensure!(!leases.contains("member-c"), "c left its Lease behind: {leases}");
    a.stop().await?;
    env.stop().await
}

#[tokio::test]
async fn daemons_and_timers_move_with_their_objects_and_a_freeze_pauses_every_member() -> Result<()> {
    daemons_timers_and_freeze(server(false).await?).await
}

#[tokio::test]
async fn with_the_servers_shard_filter_daemons_and_timers_move_and_a_freeze_pauses_every_member() -> Result<()>
{
    daemons_timers_and_freeze(server(true).await?).await
}

async fn daemons_timers_and_freeze(env: TestEnv) -> Result<()> {
    env.apply_example_crd().await?;
    env.apply_peering_crds().await?;
    let a = member(&env, "a", "daemon,timer", &[]).await?;
    let b = member(&env, "b", "daemon,timer", &[]).await?;
    settled(&[&a, &b], 2, Duration::from_secs(30)).await?;
    let names: Vec<String> = (0..6).map(|i| format!("d-{i}")).collect();
    for name in &names {
        create_example(&env, name, json!({})).await?;
    }
    handled_everywhere(&[&a, &b], "monitor", &names, 1, Duration::from_secs(60)).await?;
    let uids = uids(&env, &names).await?;
    by_owners(
        &[&a, &b],
        &BTreeMap::new(),
        "monitor",
        &Ring::new(["a", "b"]),
        &uids,
        1,
    )?;
    // Timers tick on their object's member only.
    handled_everywhere(&[&a, &b], "tick", &names, 2, Duration::from_secs(30)).await?;
    let two = Ring::new(["a", "b"]);
    for m in [&a, &b] {
        for object in m.called("tick").keys() {
            let owner = uids.get(object).and_then(|u| two.owner_of(u));
            ensure!(
                owner == Some(m.name.as_str()),
                "{} ticked {object}, {owner:?}'s",
                m.name
            );
        }
    }

    // `capstan freeze` pauses both members: their daemons stop.
    let bin = capstan_tests::process::capstan_binary().await?;
    let freeze = tokio::process::Command::new(&bin)
        .args([
            "freeze",
            "--lifetime",
            "60",
            "--priority",
            "100",
            "--message",
            "maintenance",
        ])
        .env("KUBECONFIG", &env.kubeconfig)
        .env("USER", "dev")
        .output()
        .await?;
    ensure!(
        freeze.status.success(),
        "{}",
        String::from_utf8_lossy(&freeze.stderr)
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let stopped = [&a, &b]
            .iter()
            .map(|m| {
                m.calls()
                    .iter()
                    .filter(|l| l.starts_with("daemon-stopped "))
                    .count()
            })
            .sum::<usize>();
        if stopped >= names.len() {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the freeze did not stop every member's daemons ({stopped} of {} stopped)",
            names.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let resume = tokio::process::Command::new(&bin)
        .args(["resume"])
        .env("KUBECONFIG", &env.kubeconfig)
        .env("USER", "dev")
        .output()
        .await?;
    ensure!(
        resume.status.success(),
        "{}",
        String::from_utf8_lossy(&resume.stderr)
    );
    handled_everywhere(&[&a, &b], "monitor", &names, 2, Duration::from_secs(30)).await?;

    // b leaves: its daemons start on a, as after a restart, and its timers tick there.
    let b_objects: Vec<String> = b.called("monitor").into_keys().collect();
    ensure!(!b_objects.is_empty(), "b ran no daemon");
    let before = a.called("monitor");
    let ticks_before = a.called("tick");
    b.stop().await?;
    settled(&[&a], 1, Duration::from_secs(10)).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (now, ticks) = (a.called("monitor"), a.called("tick"));
        let moved = b_objects
            .iter()
            .filter(|o| now.get(*o).copied().unwrap_or(0) > before.get(*o).copied().unwrap_or(0))
            .filter(|o| ticks.get(*o).copied().unwrap_or(0) > ticks_before.get(*o).copied().unwrap_or(0))
            .count();
        if moved == b_objects.len() {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "b's daemons and timers did not start on a ({moved} of {})",
            b_objects.len()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    a.stop().await?;
    env.stop().await
}

/// A small deterministic generator for the churn's choices (the seed is printed, so a failure
/// can be replayed with `CAPSTAN_SHARDING_SEED`).
struct Dice(u64);

impl Dice {
    fn roll(&mut self, sides: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % sides
    }
}

/// Every `seen <name> <value>` line of these call logs.
fn seen_lines(logs: &[PathBuf]) -> Vec<String> {
    logs.iter()
        .flat_map(|p| {
            std::fs::read_to_string(p)
                .unwrap_or_default()
                .lines()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .filter(|l| l.starts_with("seen "))
        .collect()
}

/// The members that wrote each example object, in the audit log's order: successful writes of
/// the object itself (not its status) by a controller, named by its user agent
/// `capstan/<version> (<member>)`.
fn writers(audit: &[Value]) -> BTreeMap<String, Vec<String>> {
    let mut out: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for e in audit {
        let agent = e["userAgent"].as_str().unwrap_or_default();
        let Some(member) = agent
            .strip_prefix("capstan/")
            .and_then(|rest| rest.split_once(" ("))
            .and_then(|(_, m)| m.strip_suffix(')'))
        else {
            continue;
        };
        let code = e["responseStatus"]["code"].as_u64().unwrap_or_default();
        if e["stage"] == "ResponseComplete"
            && e["objectRef"]["resource"] == "examples"
            && e["objectRef"]["subresource"].is_null()
            && matches!(e["verb"].as_str(), Some("update" | "patch"))
            && (200..300).contains(&code)
            && let Some(name) = e["objectRef"]["name"].as_str()
        {
            out.entry(name.to_owned()).or_default().push(member.to_owned());
        }
    }
    out
}

/// The `spec.field` of each example's last handled configuration (what its last handled
/// change wrote). The `update-seen` preset's handler watches the whole object, so the
/// annotation holds the whole essence (`{"spec": …}`).
async fn handled_values(api: &kube::Api<kube::api::DynamicObject>) -> Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for object in api.list(&Default::default()).await? {
        let Some(last) = object
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("capstan.dev/last-handled-configuration"))
        else {
            continue;
        };
        let last: Value = serde_json::from_str(last)?;
        if let (Some(name), Some(field)) = (object.metadata.name.clone(), last["spec"]["field"].as_str()) {
            out.insert(name, field.to_owned());
        }
    }
    Ok(out)
}

/// The member that handled each object's changes, in the changes' order (their values count
/// up): from the `seen <name> <value>` lines of the call logs `<member>-calls.log`.
fn handlers(logs: &[PathBuf]) -> BTreeMap<String, Vec<String>> {
    let mut seen: BTreeMap<String, Vec<(u64, String)>> = BTreeMap::new();
    for log in logs {
        let member = log
            .file_name()
            .and_then(|f| f.to_str())
            .and_then(|f| f.strip_suffix("-calls.log"))
            .unwrap_or_default();
        for line in seen_lines(std::slice::from_ref(log)) {
            let mut parts = line.split_whitespace().skip(1);
            if let (Some(name), Some(Ok(value))) = (parts.next(), parts.next().map(str::parse)) {
                seen.entry(name.to_owned())
                    .or_default()
                    .push((value, member.to_owned()));
            }
        }
    }
    seen.into_iter()
        .map(|(name, mut changes)| {
            changes.sort();
            (name, changes.into_iter().map(|(_, m)| m).collect())
        })
        .collect()
}

/// Members join, leave (SIGTERM) and crash (SIGKILL) at random while the objects change; every
/// change must be handled exactly once, and written once, by the member that handled it (the
/// handler calls and the API server's audit log agree). `CAPSTAN_SHARDING_CHURN_ROUNDS` sets the number of
/// ring changes (8 here; `scripts/faults.sh --long` runs 100).
#[tokio::test]
async fn random_ring_changes_under_churn_never_handle_a_change_twice() -> Result<()> {
    churn(false).await
}

#[tokio::test]
async fn random_ring_changes_under_churn_never_handle_a_change_twice_with_the_servers_shard_filter()
-> Result<()> {
    churn(true).await
}

async fn churn(filtered: bool) -> Result<()> {
    let rounds: u32 = std::env::var("CAPSTAN_SHARDING_CHURN_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(8);
    let seed: u64 = std::env::var("CAPSTAN_SHARDING_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
                | 1
        });
    eprintln!("churn: {rounds} ring changes, shard filter {filtered}, CAPSTAN_SHARDING_SEED={seed}");
    let mut dice = Dice(seed);
    let env = server(filtered).await?;
    env.apply_example_crd().await?;
    let mut members = vec![
        member(&env, "m0", "update-seen", &[]).await?,
        member(&env, "m1", "update-seen", &[]).await?,
    ];
    let mut next = 2;
    let mut logs: Vec<PathBuf> = members.iter().map(|m| m.calls.clone()).collect();
    settled(&members.iter().collect::<Vec<_>>(), 2, Duration::from_secs(30)).await?;
    let names: Vec<String> = (0..16).map(|i| format!("churn-{i:02}")).collect();
    for name in &names {
        create_example(&env, name, json!({"field": "0"})).await?;
    }
    let api = examples(&env.client().await?, "default");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    for name in &names {
        loop {
            let obj = api.get(name).await?;
            if obj
                .metadata
                .annotations
                .is_some_and(|a| a.contains_key("capstan.dev/last-handled-configuration"))
            {
                break;
            }
            ensure!(tokio::time::Instant::now() < deadline, "{name} was never handled");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    let mut expected: BTreeMap<String, String> = BTreeMap::new();
    for round in 1..=rounds {
        let action = match dice.roll(3) {
            0 if members.len() < 4 => "join",
            1 | 2 if members.len() > 1 => {
                if dice.roll(2) == 0 {
                    "leave"
                } else {
                    "crash"
                }
            }
            _ if members.len() < 4 => "join",
            _ => "leave",
        };
        match action {
            "join" => {
                let name = format!("m{next}");
                next += 1;
                let m = member(&env, &name, "update-seen", &[]).await?;
                logs.push(m.calls.clone());
                members.push(m);
            }
            "leave" => {
                let i = usize::try_from(dice.roll(members.len() as u64))?;
                members.swap_remove(i).stop().await?;
            }
            _ => {
                let i = usize::try_from(dice.roll(members.len() as u64))?;
                members.swap_remove(i).kill().await?;
            }
        }
        let value = round.to_string();
        let changed: Vec<&String> = names.iter().filter(|_| dice.roll(2) == 0).collect();
        for name in &changed {
            api.patch(
                name,
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"field": value}})),
            )
            .await?;
            expected.insert((*name).clone(), value.clone());
        }
        let alive: Vec<&str> = members.iter().map(|m| m.name.as_str()).collect();
        eprintln!(
            "round {round}: {action}; members {alive:?}; {} objects changed",
            changed.len()
        );
        // Every change so far is handled (a crashed member's objects after its Lease expired)
        // and written: the next round may kill its member, and a change handled but not yet
        // written would then be handled again, as it must be.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
        loop {
            let seen = seen_lines(&logs);
            // A failed listing counts as nothing written yet: tried again until the deadline.
            let written = handled_values(&api).await.unwrap_or_default();
            let missing: Vec<String> = expected
                .iter()
                .filter(|(name, value)| {
                    !seen.contains(&format!("seen {name} {value}"))
                        || written.get(name.as_str()) != Some(*value)
                })
                .map(|(name, value)| format!("{name}={value}"))
                .collect();
            if missing.is_empty() {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                let views = futures::future::join_all(members.iter().map(ring)).await;
                bail!(
                    "round {round} ({action}, seed {seed}): changes not handled or not written: {missing:?}; members see {views:?}"
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let seen = seen_lines(&logs);
    let mut counts: BTreeMap<&str, usize> = BTreeMap::new();
    for line in &seen {
        *counts.entry(line.as_str()).or_default() += 1;
    }
    let twice: Vec<(&str, usize)> = counts.into_iter().filter(|(_, n)| *n > 1).collect();
    ensure!(
        twice.is_empty(),
        "changes handled more than once (seed {seed}): {twice:?}"
    );
    // The API server's record: each object's writes, in order, are one for its creation and
    // then one per change, each by the member whose handler took that change. A write by a
    // member that had let the object go, or a second write of one change, breaks the sequence.
    let handled = handlers(&logs);
    // The first object whose writes do not match its handler calls, said.
    let disagreement = |written: &BTreeMap<String, Vec<String>>| {
        names.iter().find_map(|name| {
            let writes = written.get(name.as_str()).cloned().unwrap_or_default();
            let takers = handled.get(name.as_str()).cloned().unwrap_or_default();
            (writes.len() != takers.len() + 1 || writes[1..] != takers[..]).then(|| {
                format!("{name} (seed {seed}): written by {writes:?}, its changes handled by {takers:?}")
            })
        })
    };
    // Every change was written before the last round ended; the audit log has each write
    // before its response. Polled a little all the same.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let mut written = writers(&env.audit_events()?);
    while disagreement(&written).is_some() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(500)).await;
        written = writers(&env.audit_events()?);
    }
    if let Some(problem) = disagreement(&written) {
        bail!(problem);
    }
    let movers = handled
        .values()
        .filter(|t| t.windows(2).any(|w| w[0] != w[1]))
        .count();
    eprintln!(
        "audit: {} writes of {} objects agree with the handler calls ({movers} objects changed hands)",
        written.values().map(Vec::len).sum::<usize>(),
        names.len()
    );
    for m in members {
        m.stop().await?;
    }
    env.stop().await
}

/// Indexes are over all objects on every member: a handler on either member sees every
/// indexed ConfigMap, whatever member the ConfigMaps' own uids belong to.
#[tokio::test]
async fn indexes_hold_every_object_on_every_member() -> Result<()> {
    indexes_whole(server(false).await?).await
}

/// With the server's filter the resource watches ask for their ranges; the indexer's does not.
#[tokio::test]
async fn with_the_servers_shard_filter_indexes_still_hold_every_object_on_every_member() -> Result<()> {
    indexes_whole(server(true).await?).await
}

async fn indexes_whole(env: TestEnv) -> Result<()> {
    use k8s_openapi::api::core::v1::ConfigMap;
    env.apply_example_crd().await?;
    let client = env.client().await?;
    let cms: kube::Api<ConfigMap> = kube::Api::namespaced(client, "default");
    let mut wanted: Vec<String> = Vec::new();
    for i in 0..8 {
        let name = format!("web-{i}");
        let cm: ConfigMap = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": name, "labels": {"e2e/app": "web"}},
        }))?;
        cms.create(&kube::api::PostParams::default(), &cm).await?;
        wanted.push(name);
    }
    let a = member(&env, "a", "index", &[]).await?;
    let b = member(&env, "b", "index", &[]).await?;
    settled(&[&a, &b], 2, Duration::from_secs(30)).await?;
    let names: Vec<String> = (0..10).map(|i| format!("ix-{i}")).collect();
    for name in &names {
        create_example(&env, name, json!({"app": "web"})).await?;
    }
    let api = examples(&env.client().await?, "default");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    for name in &names {
        loop {
            let obj = api.get(name).await?;
            let found = obj
                .data
                .pointer("/status/lookup_fn/configmaps")
                .and_then(Value::as_array)
                .map(|list| {
                    let mut names: Vec<String> = list
                        .iter()
                        .filter_map(|v| v.as_str().map(str::to_owned))
                        .collect();
                    names.sort();
                    names
                });
            if let Some(found) = found {
                ensure!(
                    found == wanted,
                    "{name}'s handler saw part of the index: {found:?}"
                );
                break;
            }
            ensure!(
                tokio::time::Instant::now() < deadline,
                "lookup_fn did not answer for {name}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let uids = uids(&env, &names).await?;
    by_owners(
        &[&a, &b],
        &BTreeMap::new(),
        "lookup",
        &Ring::new(["a", "b"]),
        &uids,
        1,
    )?;
    ensure!(
        !a.called("lookup").is_empty() && !b.called("lookup").is_empty(),
        "both members handle examples"
    );
    a.stop().await?;
    b.stop().await?;
    env.stop().await
}

/// A member cut off from the API server stops handling when its renew deadline passes, before
/// the others count it gone and take its objects; once it reaches the server again it rejoins
/// and the objects are shared again, each change handled once.
#[tokio::test]
async fn a_member_cut_off_from_the_api_server_fences_itself_before_the_others_take_over() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let (proxy, proxied) = capstan_tests::proxy::Proxy::in_front_of(&env).await?;
    let a = member(&env, "a", "create,update-seen", &[]).await?;
    let b = member_with(&env, Some(&proxied), "b", "create,update-seen", &[]).await?;
    settled(&[&a, &b], 2, Duration::from_secs(30)).await?;
    let names: Vec<String> = (0..12).map(|i| format!("cut-{i:02}")).collect();
    for name in &names {
        create_example(&env, name, json!({})).await?;
    }
    handled_everywhere(&[&a, &b], "create_fn", &names, 1, Duration::from_secs(60)).await?;

    proxy.refuse();
    let cut = tokio::time::Instant::now();
    let (mut fenced, mut taken) = (None, None);
    while fenced.is_none() || taken.is_none() {
        ensure!(
            cut.elapsed() < Duration::from_secs(20),
            "fenced {fenced:?}, taken over {taken:?}"
        );
        if fenced.is_none() && ring(&b).await?.starts_with("fenced") {
            fenced = Some(cut.elapsed());
        }
        if taken.is_none() && ring(&a).await?.starts_with("member of 1 ") {
            taken = Some(cut.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (fenced, taken) = (fenced.unwrap_or_default(), taken.unwrap_or_default());
    ensure!(
        fenced < taken,
        "b fenced itself at {fenced:?}, after a took over at {taken:?}"
    );
    change_all(&env, &names, 1).await?;
    let seen = |m: &Operator| m.calls().iter().filter(|l| l.starts_with("seen ")).count();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(40);
    while seen(&a) < names.len() {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "a handled {} of the changes:\n{}",
            seen(&a),
            tail(&a.controller.process.output(), 40)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Back: b rejoins; the next changes are shared again, each handled once.
    proxy.accept();
    settled(&[&a, &b], 2, Duration::from_secs(30)).await?;
    change_all(&env, &names, 2).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let lines = seen_lines(&[a.calls.clone(), b.calls.clone()]);
        let handled = names
            .iter()
            .filter(|n| lines.contains(&format!("seen {n} 2")))
            .count();
        if handled == names.len() {
            let mut sorted = lines.clone();
            sorted.sort();
            sorted.dedup();
            ensure!(
                sorted.len() == lines.len(),
                "a change was handled twice: {lines:?}"
            );
            ensure!(lines.len() == 2 * names.len(), "{lines:?}");
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "{handled} of the second changes handled"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ensure!(
        b.calls().iter().any(|l| l.starts_with("seen ")),
        "b handles nothing after it rejoined"
    );
    a.stop().await?;
    b.stop().await?;
    env.stop().await
}
