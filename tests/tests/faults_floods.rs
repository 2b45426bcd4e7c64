//! Floods: many objects at once with a slow handler; hundreds of handler connections held and
//! dropped; ten thousand registrations spread over several processes; a flood of log records
//! that become Kubernetes Events. Everything is handled exactly once, the controller keeps
//! serving a well-behaved handler process, and its peak resident memory (`VmHWM`) is reported
//! and stays under a bound.
//!
//! Sizes: CI by default; `CAPSTAN_FAULTS_LONG=1` (`scripts/faults.sh --long`) runs the full
//! ones (2,000 objects, 500 connections, 10,000 registrations, 20,000 log records).

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use capstan_proto::pb::{self, connect_request::Message as In};
use capstan_tests::{
    faults::{self, peak_rss_kib},
    grpc::{RawClient, hello, registration, success, unix_channel},
    scenario::{Scenario, annotation},
    testenv::examples,
};
use futures::{StreamExt as _, stream};
use kube::api::{DynamicObject, ListParams, PostParams};
use serde_json::json;

/// The controller's peak memory must stay under this (a debug build; the release build
/// needs far less).
const RSS_BOUND_KIB: u64 = 512 * 1024;

fn report_rss(s: &Scenario, what: &str) -> Result<u64> {
    let pid = s
        .controller
        .process
        .id()
        .context("the controller is not running")?;
    let kib = peak_rss_kib(pid).context("no VmHWM for the controller")?;
    println!("{what}: controller peak RSS {:.1} MiB", kib as f64 / 1024.0);
    ensure!(
        kib < RSS_BOUND_KIB,
        "{what}: the controller's peak RSS {kib} KiB is over {RSS_BOUND_KIB} KiB"
    );
    Ok(kib)
}

#[tokio::test]
async fn many_objects_at_once_with_a_slow_handler_are_each_handled_exactly_once() -> Result<()> {
    let n = faults::size(200, 2000);
    let s = Scenario::start("create", &[]).await?;
    let api = examples(&s.client, &s.namespace);
    let started = tokio::time::Instant::now();
    let created: Vec<Result<DynamicObject, kube::Error>> = stream::iter(0..n)
        .map(|i| {
            let api = api.clone();
            let namespace = s.namespace.clone();
            async move {
                let obj: DynamicObject = serde_json::from_value(json!({
                    "apiVersion": "demo.capstan.dev/v1", "kind": "Example",
                    "metadata": {"name": format!("flood-{i}"), "namespace": namespace},
                    "spec": {"sleep": {"create_fn": 0.2}},
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
    let deadline = started + Duration::from_secs(if faults::long() { 900 } else { 120 });
    loop {
        let list = api.list(&ListParams::default()).await?;
        let done = list
            .items
            .iter()
            .filter(|o| {
                o.metadata
                    .annotations
                    .as_ref()
                    .is_some_and(|a| a.contains_key("capstan.dev/last-handled-configuration"))
            })
            .count();
        if done == n {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "{done} of {n} objects handled in time"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let took = started.elapsed();
    let calls = s.calls();
    ensure!(calls.len() == n, "{} handler calls for {n} objects", calls.len());
    for i in 0..n {
        let name = format!("flood-{i}");
        ensure!(
            s.count("create_fn", &name) == 1,
            "{name} was not handled exactly once"
        );
    }
    println!("{n} objects handled exactly once in {:.1} s", took.as_secs_f64());
    report_rss(&s, &format!("{n} objects"))?;
    Ok(())
}

#[tokio::test]
async fn connections_held_and_dropped_and_ten_thousand_registrations_leave_the_controller_serving()
-> Result<()> {
    let connections = faults::size(200, 500);
    let (processes, per_process) = (10usize, faults::size(200, 1000));
    let s = Scenario::start("create", &[]).await?;
    let socket = s.controller.socket.clone();

    // Hold many connections at once, then drop them all.
    let mut held = Vec::new();
    for i in 0..connections {
        let channel = unix_channel(socket.clone()).await?;
        let (client, welcome) = RawClient::connect(
            channel,
            hello(vec![registration(&format!("held_{i}"), pb::HandlerKind::Create)]),
        )
        .await
        .with_context(|| format!("connection {i}"))?;
        ensure!(welcome.registrations.len() == 1, "connection {i}: {welcome:?}");
        held.push(client);
    }
    let (_, metrics) = s.controller.admin_get("/metrics").await?;
    ensure!(
        metrics.contains(&format!("capstan_handler_processes {}", connections + 1)),
        "the controller does not count the held connections"
    );
    drop(held);

    // Many registrations, spread over several processes: each accepted, or rejected with a
    // diagnostic (a cap on registrations per process).
    let mut accepted = 0;
    let mut rejected = 0;
    let mut clients = Vec::new();
    for p in 0..processes {
        let handlers = (0..per_process)
            .map(|i| registration(&format!("many_{p}_{i}"), pb::HandlerKind::Create))
            .collect();
        let channel = unix_channel(socket.clone()).await?;
        match RawClient::open(channel, In::Hello(hello(handlers))).await? {
            Err(status) => {
                ensure!(
                    !status.message().is_empty(),
                    "process {p} refused without a reason"
                );
                rejected += per_process;
            }
            Ok(mut client) => {
                let welcome = match client.recv_within(Duration::from_secs(60)).await {
                    Ok(pb::connect_response::Message::Welcome(w)) => w,
                    Ok(other) => anyhow::bail!("process {p}: expected a welcome, got {other:?}"),
                    Err(e) => {
                        // The stream may end with a status that says why (a cap).
                        let ended = e.downcast::<capstan_tests::grpc::StreamEnded>()?;
                        ensure!(
                            !ended.0.message().is_empty(),
                            "process {p} ended without a reason"
                        );
                        rejected += per_process;
                        continue;
                    }
                };
                for r in &welcome.registrations {
                    if r.accepted {
                        accepted += 1;
                    } else {
                        ensure!(
                            r.diagnostics.iter().any(|d| !d.reason.is_empty()),
                            "a registration rejected without a diagnostic: {r:?}"
                        );
                        rejected += 1;
                    }
                }
                clients.push(client);
            }
        }
    }
    println!(
        "{connections} connections held and dropped; {} registrations over {processes} processes: \
         {accepted} accepted, {rejected} rejected with a diagnostic",
        processes * per_process
    );
    drop(clients);

    // The well-behaved handler process is still served.
    s.create("after-the-flood", json!({})).await?;
    s.wait("after-the-flood", Duration::from_secs(60), "handled", |o| {
        annotation(o, "capstan.dev/last-handled-configuration").is_some()
    })
    .await?;
    ensure!(s.count("create_fn", "after-the-flood") == 1);
    report_rss(&s, "connections and registrations")?;
    Ok(())
}

#[tokio::test]
async fn a_flood_of_log_records_is_bounded_and_the_invocation_still_completes() -> Result<()> {
    let records = faults::size(2000, 20_000);
    // The e2e handler process registers a handler for labelled objects only: the chatty
    // object is the raw client's alone.
    let s = Scenario::start("filtered", &[]).await?;
    let channel = unix_channel(s.controller.socket.clone()).await?;
    let (mut client, welcome) = RawClient::connect(
        channel,
        hello(vec![registration("chatty_fn", pb::HandlerKind::Create)]),
    )
    .await?;
    ensure!(
        welcome.registrations.first().is_some_and(|r| r.accepted),
        "{welcome:?}"
    );
    s.create("chatty", json!({})).await?;
    let invocation = client.invocation().await?;
    for i in 0..records {
        client
            .send(In::Log(pb::LogRecord {
                invocation_id: invocation.invocation_id.clone(),
                level: pb::LogLevel::Info as i32,
                message: format!("record {i}"),
                ..Default::default()
            }))
            .await?;
    }
    client
        .send(success(&invocation.invocation_id, None, vec![]))
        .await?;
    s.wait("chatty", Duration::from_secs(60), "handled", |o| {
        annotation(o, "capstan.dev/last-handled-configuration").is_some()
    })
    .await?;
    let events = s
        .env
        .kubectl_ok(&[
            "get",
            "events",
            "-n",
            &s.namespace,
            "--field-selector",
            "involvedObject.name=chatty",
            "-o",
            "name",
        ])
        .await?;
    let posted = events.lines().count();
    println!("{records} log records: {posted} Events posted");
    ensure!(
        posted < records / 2,
        "{posted} Events for {records} log records: posting is not rate-limited"
    );
    report_rss(&s, &format!("{records} log records"))?;
    Ok(())
}
