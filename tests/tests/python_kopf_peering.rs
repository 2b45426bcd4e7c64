//! Differential test on the lines of kopf's example operator `06-peering`: an operator file of
//! our own (`sdk-python/tests/differential/examples_peering.py`) runs as two operators of one
//! peering, priorities 100 and 200, once under real kopf (pinned from PyPI, `kopf run
//! --peering example --priority N`, with kopf's peering resource) and once under `capstan.kopf`
//! on Capstan (the controllers' `--peering example --priority N`, with Capstan's peering CRDs),
//! each against a fresh API server. The low one handles an object alone first. Compared: which
//! operator handles an object created while both run (the higher one, the lower paused), and
//! one created once the higher one stopped (the lower one, resumed).

use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use capstan_tests::{
    side_by_side::{Flags, Framework, Operator, calls, handled, wait_object, wait_until},
    testenv::{TestEnv, create_example, examples},
};
use serde_json::{Value, json};

/// The operator file both frameworks run.
const OPERATOR: &str = "sdk-python/tests/differential/examples_peering.py";

/// How long an operator may take to pause or resume once its peer came or went (beyond the
/// default peering lifetime, 60 s: a peer's entry that was not removed expires then).
const PEERING: Duration = Duration::from_secs(120);

/// kopf's namespaced peering resource, as a definition of our own, and the peering object.
const KOPF_PEERING: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: kopfpeerings.kopf.dev
spec:
  group: kopf.dev
  scope: Namespaced
  names: {kind: KopfPeering, plural: kopfpeerings, singular: kopfpeering}
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema:
          type: object
          x-kubernetes-preserve-unknown-fields: true
"#;

const KOPF_PEERING_OBJECT: &str = r#"
apiVersion: kopf.dev/v1
kind: KopfPeering
metadata:
  name: example
  namespace: default
"#;

/// The log lines that say an operator paused, and resumed.
fn pause_lines(framework: Framework) -> (&'static str, &'static str) {
    match framework {
        Framework::Kopf => (
            "Pausing operations in favour of",
            "Resuming operations after the pause",
        ),
        Framework::Capstan => (
            "pausing: no new handler invocations",
            "resumed: handler invocations continue",
        ),
    }
}

/// The operator's log (its controller's, under Capstan).
fn log_of(operator: &Operator) -> String {
    match &operator.controller {
        Some(controller) => controller.process.output(),
        None => operator.process.output(),
    }
}

/// Waits until the operator's log has `line` after its first `mark` bytes (a pause or resume
/// of its own start does not count).
async fn wait_logged_after(operator: &Operator, mark: usize, line: &str) -> Result<()> {
    let deadline = tokio::time::Instant::now() + PEERING;
    loop {
        if log_of(operator).get(mark..).is_some_and(|l| l.contains(line)) {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("{line:?} was not logged within {PEERING:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Which operators handled the object `name`.
fn handlers_of(calls: &[Value], name: &str) -> Vec<String> {
    calls
        .iter()
        .filter(|c| c["name"] == name)
        .map(|c| c["operator"].as_str().unwrap_or_default().to_owned())
        .collect()
}

async fn peering_run(framework: Framework) -> Result<Value> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    match framework {
        Framework::Kopf => {
            env.apply_crds(KOPF_PEERING, &["kopfpeerings.kopf.dev"]).await?;
            let object = env.scratch().join("peering.yaml");
            std::fs::write(&object, KOPF_PEERING_OBJECT)?;
            env.kubectl_ok(&["apply", "-f", &object.display().to_string()])
                .await?;
        }
        Framework::Capstan => {
            env.apply_peering_crds().await?;
        }
    }
    let log = env.scratch().join("calls.jsonl");
    let (paused, resumed) = pause_lines(framework);
    let start = async |name: &str, priority: &str, run: usize| {
        let flags = ["--peering", "example", "--priority", priority];
        let flags = Flags {
            kopf: &flags,
            controller: &flags,
        };
        Operator::start_with(
            framework,
            &env,
            OPERATOR,
            &log,
            &[("OPERATOR_NAME", name)],
            run,
            flags,
        )
        .await
    };
    let api = examples(&env.client().await?, "default");
    let low = start("low", "100", 1).await?;
    // The low one works before the high one comes (an operator starts paused until it has
    // looked at its peers: one that meets a higher peer at once never logs a pause).
    let alone = async {
        create_example(&env, "before-the-high-one", json!({})).await?;
        wait_until("the object handled", &log, |c| {
            !handlers_of(c, "before-the-high-one").is_empty()
        })
        .await?;
        wait_object(&api, "before-the-high-one", "the handling stored", handled).await
    }
    .await
    .with_context(|| format!("{framework:?}: the low one alone: {}", low.output()));
    if let Err(error) = alone {
        low.stop().await?;
        return Err(error);
    }
    let mark = log_of(&low).len();
    let high = start("high", "200", 2).await?;
    let seen = async {
        wait_logged_after(&low, mark, paused).await?;
        create_example(&env, "while-both-run", json!({})).await?;
        wait_until("the object handled", &log, |c| {
            !handlers_of(c, "while-both-run").is_empty()
        })
        .await?;
        // Its handling is stored before the high one stops: the low one has nothing left of it
        // to handle when it resumes.
        wait_object(&api, "while-both-run", "the handling stored", handled).await?;
        Ok::<_, anyhow::Error>(())
    }
    .await
    .with_context(|| {
        format!(
            "{framework:?}: the low one: {}\nthe high one: {}",
            low.output(),
            high.output()
        )
    });
    let mark = log_of(&low).len();
    high.stop().await?;
    let after = async {
        seen?;
        wait_logged_after(&low, mark, resumed).await?;
        create_example(&env, "after-the-high-one", json!({})).await?;
        wait_until("the object handled", &log, |c| {
            !handlers_of(c, "after-the-high-one").is_empty()
        })
        .await?;
        wait_object(&api, "after-the-high-one", "the handling stored", handled).await?;
        Ok::<_, anyhow::Error>(())
    }
    .await
    .with_context(|| format!("{framework:?}: the low one: {}", low.output()));
    low.stop().await?;
    after?;
    let all = calls(&log);
    let seen = json!({
        "while-both-run": handlers_of(&all, "while-both-run"),
        "after-the-high-one": handlers_of(&all, "after-the-high-one"),
    });
    println!("{framework:?}: {seen}");
    Ok(seen)
}

/// The higher-priority operator handles what comes while both run, the lower one paused; the
/// lower one resumes when the higher one stops, as under kopf.
#[tokio::test]
async fn the_higher_priority_operator_handles_and_the_lower_resumes_as_under_kopf() -> Result<()> {
    let kopf = peering_run(Framework::Kopf).await?;
    let capstan = peering_run(Framework::Capstan).await?;
    assert_eq!(
        kopf,
        json!({"while-both-run": ["high"], "after-the-high-one": ["low"]}),
        "kopf's run is not the one intended"
    );
    assert_eq!(capstan, kopf, "the runs differ (left: capstan.kopf, right: kopf)");
    Ok(())
}
