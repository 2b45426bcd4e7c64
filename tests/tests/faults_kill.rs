//! Kill loops: the controller, then the handler process, SIGKILLed again and again at random
//! points while objects go through create, update and delete with several handlers (one that
//! sleeps, one that fails once and is retried). Afterwards, from the handlers' call log and the
//! objects: every cause completed (every create handler ran, every update reached the
//! diff-base, every deleted object ran its delete handler and is gone); a handler was called
//! again for the same change only after a kill interrupted it, before its result was written
//! (the checkpoint window); attempt numbers never went down; no object is left with a stale
//! progress record or without its diff-base.
//!
//! Sizes: 20 kills of each in the default (CI) mode, 100 with `CAPSTAN_FAULTS_LONG=1`.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use anyhow::{Context as _, Result, ensure};
use capstan_tests::{
    faults::{self, Rng, check_repeats},
    process::Controller,
    scenario::{Scenario, annotation, has_finalizer, label, progress_keys, tail},
    testenv::examples,
};
use kube::api::{DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use serde_json::{Value, json};
use tokio::task::JoinHandle;

/// What the workload did to one object.
#[derive(Clone, Debug)]
struct Planned {
    name: String,
    patched: bool,
    deleted: bool,
}

/// Waits until every object reached its final state and checks the invariants.
async fn converged(s: &Scenario, planned: &[Planned], crashes: &[usize]) -> Result<()> {
    let t = Duration::from_secs(if faults::long() { 300 } else { 90 });
    for p in planned {
        if p.deleted {
            s.wait_gone(&p.name, t).await?;
            ensure!(
                s.count("delete_fn", &p.name) >= 1,
                "{} was deleted without its delete handler",
                p.name
            );
            continue;
        }
        let size = if p.patched { 2 } else { 1 };
        let o = s
            .wait(&p.name, t, "the last change handled", |o| {
                annotation(o, "capstan.dev/last-handled-configuration")
                    .and_then(|d| serde_json::from_str::<Value>(d).ok())
                    .is_some_and(|d| d.pointer("/spec/size") == Some(&json!(size)))
                    && progress_keys(o).is_empty()
            })
            .await?;
        ensure!(
            has_finalizer(&o),
            "{}: the finalizer of a live object is gone",
            p.name
        );
        let calls = s.calls();
        let mine: Vec<(usize, &str, u32)> = calls
            .iter()
            .enumerate()
            .filter(|(_, c)| c.1 == p.name)
            .map(|(i, c)| (i, c.0.as_str(), c.2))
            .collect();
        ensure!(
            label(&o, "e2e/a") == Some("1") && create_b_saw_a(label(&o, "e2e/b"), &mine),
            "{}: create_a's label is missing, or create_b's does not say what it could see: {o}\ncalls (index, handler, attempt): {mine:?}\ncrashes: {crashes:?}",
            p.name
        );
        for h in ["create_a", "create_b", "create_c"] {
            ensure!(s.count(h, &p.name) >= 1, "{}: {h} never ran", p.name);
        }
    }
    let calls = s.calls();
    check_repeats(
        &calls,
        crashes,
        &["create_a", "create_b", "create_c", "update_fn", "delete_fn"],
    )
    .with_context(|| format!("crashes after calls {crashes:?}"))?;
    Ok(())
}

/// Whether create_b's label (`seen`) is right. create_b sees create_a's label, unless a kill
/// lost create_a's attempt (create_a never fails otherwise, so its successful attempt is then
/// not its first): as in kopf, the handlers after a failed one run before its retry, and
/// create_b saw no label (`saw-a-none`). `calls` are the object's calls (index in the log,
/// handler, attempt).
fn create_b_saw_a(seen: Option<&str>, calls: &[(usize, &str, u32)]) -> bool {
    let last = |h: &str| calls.iter().rev().find(|c| c.1 == h);
    match (seen, last("create_a"), last("create_b")) {
        (Some("saw-a-1"), ..) => true,
        (Some("saw-a-none"), Some(a), Some(b)) => a.2 > 1 && a.0 > b.0,
        _ => false,
    }
}

#[tokio::test]
async fn the_controller_killed_at_random_points_loses_no_cause_and_repeats_nothing_finished() -> Result<()> {
    let kills = faults::size(20, 100);
    let args = ["--checkpoint-after", "300ms"];
    let mut s = Scenario::start("create3,update,delete", &args).await?;
    let mut rng = Rng::from_env("controller kill loop");
    let driver = Driver::start(&s, &mut rng);
    let mut crashes = Vec::new();
    let mut survived = 0;
    for k in 0..kills {
        tokio::time::sleep(Duration::from_millis(rng.range(200, 1500))).await;
        s.controller.process.kill().await?;
        // Calls the dead controller dispatched have reached the log by now.
        tokio::time::sleep(Duration::from_millis(50)).await;
        crashes.push(s.calls().len());
        // The same name: the same socket, which the handler process dials again.
        s.controller = Controller::start(&s.env, "capstan", &args)
            .await
            .with_context(|| format!("restart {} after a kill", k + 1))?;
        survived += 1;
    }
    let planned = driver.finish(&crashes).await?;
    converged(&s, &planned, &crashes).await.with_context(|| {
        format!(
            "after {survived} controller kills, {} objects\ncontroller log tail:\n{}",
            planned.len(),
            tail(&s.controller.process.output(), 30)
        )
    })?;
    println!(
        "controller kill loop: {survived} kills survived, {} objects, {} handler calls",
        planned.len(),
        s.calls().len()
    );
    Ok(())
}

#[tokio::test]
async fn the_handler_process_killed_at_random_points_loses_no_cause_and_repeats_nothing_finished()
-> Result<()> {
    let kills = faults::size(20, 100);
    // The poison-pill guard would end work that every kill happens to interrupt; this test is
    // about recovery, so the guard is set out of reach.
    let args = ["--checkpoint-after", "300ms", "--max-losses", "100000"];
    let mut s = Scenario::start("create3,update,delete", &args).await?;
    let mut rng = Rng::from_env("handler kill loop");
    let driver = Driver::start(&s, &mut rng);
    let mut crashes = Vec::new();
    for _ in 0..kills {
        tokio::time::sleep(Duration::from_millis(rng.range(200, 1200))).await;
        s.handler.kill().await?;
        crashes.push(s.calls().len());
        s.restart_handler().await?;
    }
    let planned = driver.finish(&crashes).await?;
    converged(&s, &planned, &crashes).await.with_context(|| {
        format!(
            "after {kills} handler process kills, {} objects\nhandler log tail:\n{}",
            planned.len(),
            tail(&s.handler.output(), 30)
        )
    })?;
    println!(
        "handler kill loop: {kills} kills survived, {} objects, {} handler calls",
        planned.len(),
        s.calls().len()
    );
    Ok(())
}

/// The [`workload`] running in the background during a kill loop.
struct Driver {
    stop: Arc<AtomicBool>,
    task: JoinHandle<Result<Vec<Planned>>>,
}

impl Driver {
    /// Starts the workload with its own client and a random stream drawn from `rng`.
    fn start(s: &Scenario, rng: &mut Rng) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let task = tokio::spawn(workload(
            s.client.clone(),
            s.namespace.clone(),
            Rng::new(rng.draw()),
            stop.clone(),
            faults::size(24, 120),
        ));
        Self { stop, task }
    }

    /// Stops the workload once the kills (`crashes`) are over; returns what it did.
    async fn finish(self, crashes: &[usize]) -> Result<Vec<Planned>> {
        self.stop.store(true, Ordering::Relaxed);
        let planned = self.task.await??;
        println!(
            "{} kills survived while {} objects were worked on",
            crashes.len(),
            planned.len()
        );
        Ok(planned)
    }
}

/// Creates, updates and deletes objects until `stop` (or `limit` objects), at random
/// intervals, with its own API client. Deletes an object only once it carries the finalizer,
/// so that its delete handler must run.
async fn workload(
    client: kube::Client,
    namespace: String,
    mut rng: Rng,
    stop: Arc<AtomicBool>,
    limit: usize,
) -> Result<Vec<Planned>> {
    let namespace = namespace.as_str();
    let api = examples(&client, namespace);
    let mut planned: Vec<Planned> = Vec::new();
    let mut i = 0;
    while !stop.load(Ordering::Relaxed) && planned.len() < limit {
        let name = format!("obj-{i}");
        i += 1;
        let obj: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "demo.capstan.dev/v1", "kind": "Example",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {
                "size": 1,
                "sleep": {"create_b": 0.3, "update_fn": 0.2, "delete_fn": 0.2},
                "temporary": {"create_c": 1},
                "retryDelay": {"create_c": 0.5},
            },
        }))?;
        api.create(&PostParams::default(), &obj).await?;
        planned.push(Planned {
            name: name.clone(),
            patched: false,
            deleted: false,
        });
        tokio::time::sleep(Duration::from_millis(rng.range(100, 600))).await;
        if rng.chance(80) {
            api.patch(
                &name,
                &PatchParams::default(),
                &Patch::Merge(&json!({"spec": {"size": 2}})),
            )
            .await?;
            if let Some(p) = planned.last_mut() {
                p.patched = true;
            }
        }
        if rng.chance(50) {
            for p in planned.iter_mut().filter(|p| !p.deleted) {
                let has = api
                    .get_opt(&p.name)
                    .await?
                    .map(|o| serde_json::to_value(o).unwrap_or_default())
                    .is_some_and(|o| has_finalizer(&o));
                if has {
                    api.delete(&p.name, &DeleteParams::default()).await?;
                    p.deleted = true;
                    break;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(rng.range(100, 600))).await;
    }
    Ok(planned)
}
