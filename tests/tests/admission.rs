//! Admission webhooks end to end: a real API server calls the real `capstan` over TLS, which
//! asks the Rust SDK handler process (`on_validate`, `on_mutate`) over the stream.
//!
//! The controller runs in development mode: it listens on loopback and the managed
//! configurations address it by URL, with the CA it generated (or the files it was given).

use std::{future::Future, time::Duration};

use anyhow::{Context as _, Result, bail};
use capstan_tests::{
    process::free_port,
    scenario::{Scenario, tail},
};
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use kube::{
    Api,
    api::{DynamicObject, PostParams},
};
use serde_json::{Value, json};

const LONG: Duration = Duration::from_secs(60);

/// The webhook flags of a controller listening on `port`, managing configurations `managed`.
fn webhook_args(port: u16, managed: &str) -> Vec<String> {
    vec![
        "--webhook-listen".into(),
        format!("127.0.0.1:{port}"),
        "--webhook-managed".into(),
        managed.into(),
    ]
}

async fn start(presets: &str, extra: &[&str]) -> Result<(Scenario, u16)> {
    let port = free_port()?;
    let mut args = webhook_args(port, "capstan-e2e");
    args.extend(extra.iter().map(|s| (*s).to_owned()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    Ok((Scenario::start(presets, &args).await?, port))
}

/// Creates an example object; `Err` carries the API server's message.
async fn create(s: &Scenario, name: &str, spec: Value, dry_run: bool) -> Result<Result<Value, String>> {
    let obj: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "demo.capstan.dev/v1", "kind": "Example",
        "metadata": {"name": name, "namespace": s.namespace}, "spec": spec
    }))?;
    let params = PostParams {
        dry_run,
        ..PostParams::default()
    };
    match s.api().create(&params, &obj).await {
        Ok(created) => Ok(Ok(serde_json::to_value(created)?)),
        Err(kube::Error::Api(status)) => Ok(Err(format!("{} (code {})", status.message, status.code))),
        Err(e) => Err(e.into()),
    }
}

/// Polls `check` until it returns `Some`, or fails with the controller's log tail.
async fn eventually<T, F, Fut>(s: &Scenario, what: &str, timeout: Duration, mut check: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>>>,
{
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(v) = check().await? {
            return Ok(v);
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "timed out after {timeout:?} waiting for {what}\ncontroller log tail:\n{}\nhandler log tail:\n{}",
                tail(&s.controller.process.output(), 60),
                tail(&s.handler.output(), 20)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Waits until the API server calls the webhook: a dry-run create of an object that
/// `check_size` refuses is refused with its message.
async fn wait_enforced(s: &Scenario) -> Result<()> {
    eventually(s, "the validating webhook to be called", LONG, || async {
        Ok(create(s, "probe", json!({"size": 99}), true)
            .await?
            .err()
            .filter(|m| m.contains("size 99 is too large")))
    })
    .await?;
    Ok(())
}

fn validating(s: &Scenario) -> Api<ValidatingWebhookConfiguration> {
    Api::all(s.client.clone())
}

fn mutating(s: &Scenario) -> Api<MutatingWebhookConfiguration> {
    Api::all(s.client.clone())
}

/// The webhooks of a managed configuration as JSON, `None` while it does not exist.
async fn webhooks_of<K>(api: &Api<K>) -> Result<Option<Vec<Value>>>
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + serde::Serialize + std::fmt::Debug,
{
    Ok(match api.get_opt("capstan-e2e").await? {
        Some(config) => Some(
            serde_json::to_value(&config)?["webhooks"]
                .as_array()
                .cloned()
                .unwrap_or_default(),
        ),
        None => None,
    })
}

#[tokio::test]
async fn an_invalid_object_is_refused_with_the_handlers_message_and_warnings_reach_kubectl() -> Result<()> {
    let (s, _) = start("validate", &[]).await?;
    wait_enforced(&s).await?;
    let file = s.env.scratch().join("big.yaml");
    let manifest = |name: &str, size: u32| {
        format!(
            "apiVersion: demo.capstan.dev/v1\nkind: Example\nmetadata:\n  name: {name}\n  namespace: default\nspec:\n  size: {size}\n"
        )
    };
    std::fs::write(&file, manifest("big", 20))?;
    let out = s
        .env
        .kubectl()
        .args(["apply", "-f", &file.to_string_lossy()])
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "kubectl apply of an invalid object succeeded"
    );
    assert!(stderr.contains("size 20 is too large"), "{stderr}");
    assert!(s.get("big").await?.is_none());

    std::fs::write(&file, manifest("small", 3))?;
    let out = s
        .env
        .kubectl()
        .args(["apply", "-f", &file.to_string_lossy()])
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("Warning: checked by check_size"), "{stderr}");
    assert!(s.get("small").await?.is_some());
    let calls = s.notes("admission");
    assert!(
        calls
            .iter()
            .any(|c| c == &["check_size", "small", "CREATE", "dry=false"]),
        "{calls:?}"
    );
    let log = s.controller.process.output();
    assert!(
        log.contains("admission request denied") && log.contains("default/big") && log.contains("check_size"),
        "a denial is logged with the object and the handler:\n{}",
        tail(&log, 40)
    );
    let (_, metrics) = s.controller.admin_get("/metrics").await?;
    assert!(
        metrics.contains("capstan_admission_requests_total{phase=\"validate\",result=\"denied\"}"),
        "{metrics}"
    );
    assert!(
        metrics.contains("capstan_admission_denials_total{handler=\"check_size\"}"),
        "{metrics}"
    );
    assert!(metrics.contains("capstan_admission_duration_seconds_bucket{phase=\"validate\""));
    Ok(())
}

#[tokio::test]
async fn two_validating_and_two_mutating_handlers_combine_and_their_changes_are_stored() -> Result<()> {
    let (s, _) = start("validate2,mutate2", &[]).await?;
    wait_enforced(&s).await?;

    let stored = create(&s, "fine", json!({"size": 2}), false)
        .await?
        .map_err(|m| anyhow::anyhow!("refused: {m}"))?;
    assert_eq!(
        stored.pointer("/metadata/labels/e2e~1mutated"),
        Some(&json!("yes"))
    );
    assert_eq!(stored.pointer("/spec/defaulted"), Some(&json!(true)));
    // The second mutating handler saw the first one's change.
    assert_eq!(
        stored.pointer("/metadata/annotations/e2e~1seen-mutated"),
        Some(&json!("yes"))
    );
    let again = s.get("fine").await?.context("stored")?;
    assert_eq!(again.pointer("/spec/defaulted"), Some(&json!(true)));

    let refused = create(&s, "bad-name", json!({"size": 2}), false).await?;
    let message = refused.expect_err("denied by check_name");
    assert!(message.contains("the name bad-name is not allowed"), "{message}");
    // Both validators deny: the first in registration order wins, with its code.
    let refused = create(&s, "bad-both", json!({"size": 50}), false).await?;
    let message = refused.expect_err("denied");
    assert!(
        message.contains("size 50 is too large") && message.contains("422"),
        "{message}"
    );

    // A patch that does not apply is a denial naming the handler, never a silent admission.
    let refused = create(
        &s,
        "unpatchable",
        json!({"size": 1, "badAdmissionPatch": true}),
        false,
    )
    .await?;
    let message = refused.expect_err("denied");
    assert!(
        message.contains("add_defaults") && message.contains("does not apply"),
        "{message}"
    );
    assert!(s.get("unpatchable").await?.is_none());

    // Each handler denying by spec: the first denial stops the mutating chain.
    let refused = create(
        &s,
        "stopped",
        json!({"admission": {"add_defaults": {"deny": "not today"}}}),
        false,
    )
    .await?;
    let message = refused.expect_err("denied");
    assert!(
        message.contains("not today") && message.contains("403"),
        "{message}"
    );
    assert!(
        !s.notes("admission")
            .iter()
            .any(|c| c.first().map(String::as_str) == Some("copy_label")
                && c.get(1).map(String::as_str) == Some("stopped")),
        "the second mutating handler is not called after a denial"
    );
    Ok(())
}

#[tokio::test]
async fn dry_run_requests_reach_handlers_flagged_as_dry_run() -> Result<()> {
    let (s, _) = start("validate,validate-dry", &[]).await?;
    wait_enforced(&s).await?;
    let refused = create(&s, "dry", json!({"size": 1}), true).await?;
    let message = refused.expect_err("the dry-run handler refuses dry runs");
    assert!(message.contains("dry run seen"), "{message}");
    assert!(
        s.notes("admission")
            .iter()
            .any(|c| c == &["dry_check", "dry", "CREATE", "dry=true"]),
        "{:?}",
        s.notes("admission")
    );
    create(&s, "real", json!({"size": 1}), false)
        .await?
        .map_err(|m| anyhow::anyhow!("refused: {m}"))?;
    let hooks = webhooks_of(&validating(&s)).await?.context("configuration")?;
    assert_eq!(hooks[0]["sideEffects"], "NoneOnDryRun");
    Ok(())
}

#[tokio::test]
async fn a_handler_that_times_out_or_whose_process_is_down_follows_ignore_failures() -> Result<()> {
    let (mut s, _) = start("validate,validate-lenient", &["--webhook-timeout", "4s"]).await?;
    wait_enforced(&s).await?;

    // The lenient handler times out: left out, the request is admitted before the timeout.
    let started = tokio::time::Instant::now();
    create(
        &s,
        "slow-lenient",
        json!({"size": 1, "admission": {"lenient": {"sleep": 30}}}),
        false,
    )
    .await?
    .map_err(|m| anyhow::anyhow!("refused: {m}"))?;
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "answered before the webhook's timeout"
    );
    // The strict one times out: denied with a clear message.
    let refused = create(
        &s,
        "slow-strict",
        json!({"size": 1, "admission": {"check_size": {"sleep": 30}}}),
        false,
    )
    .await?;
    let message = refused.expect_err("denied");
    assert!(message.contains("check_size did not answer in time"), "{message}");
    // The cancelled invocations were told so.
    eventually(&s, "the timed-out invocations to be cancelled", LONG, || async {
        let cancelled = s.notes("admission-cancelled");
        Ok((cancelled.len() >= 2).then_some(()))
    })
    .await?;
    // A failing strict handler denies too.
    let refused = create(
        &s,
        "failing",
        json!({"admission": {"check_size": {"fail": true}}}),
        false,
    )
    .await?;
    assert!(
        refused
            .expect_err("denied")
            .contains("check_size failed on purpose")
    );

    // The process is down: the strict handler denies, naming the reason.
    s.handler.kill().await?;
    eventually(&s, "a denial while no process is connected", LONG, || async {
        Ok(create(&s, "orphan", json!({"size": 1}), true)
            .await?
            .err()
            .filter(|m| m.contains("no handler process that holds handler check_size is connected")))
    })
    .await?;
    let (_, metrics) = s.controller.admin_get("/metrics").await?;
    assert!(
        metrics.contains("capstan_admission_timeouts_total{handler=\"check_size\"}"),
        "{metrics}"
    );
    // Back: admitted again.
    s.restart_handler().await?;
    eventually(&s, "admission after the process came back", LONG, || async {
        Ok(create(&s, "back", json!({"size": 1}), false).await?.ok())
    })
    .await?;
    Ok(())
}

#[tokio::test]
async fn managed_configurations_follow_the_registrations_and_are_removed_on_exit() -> Result<()> {
    let (mut s, port) = start("validate", &[]).await?;
    let hooks = eventually(&s, "the validating configuration", LONG, || async {
        Ok(webhooks_of(&validating(&s)).await?.filter(|h| !h.is_empty()))
    })
    .await?;
    assert_eq!(hooks.len(), 1, "{hooks:?}");
    let hook = &hooks[0];
    assert_eq!(hook["name"], "examples.demo.capstan.dev.capstan-e2e");
    assert_eq!(
        hook["clientConfig"]["url"],
        format!("https://127.0.0.1:{port}/validate")
    );
    assert_eq!(hook["rules"][0]["apiGroups"], json!(["demo.capstan.dev"]));
    assert_eq!(hook["rules"][0]["apiVersions"], json!(["v1"]));
    assert_eq!(hook["rules"][0]["resources"], json!(["examples"]));
    assert_eq!(hook["rules"][0]["operations"], json!(["*"]));
    assert_eq!(hook["failurePolicy"], "Fail");
    assert_eq!(hook["sideEffects"], "None");
    let ca: k8s_openapi::ByteString = serde_json::from_value(hook["clientConfig"]["caBundle"].clone())?;
    assert!(String::from_utf8_lossy(&ca.0).contains("BEGIN CERTIFICATE"));
    // The bundle is what the server's certificate chains to: the API server calls it.
    wait_enforced(&s).await?;
    assert_eq!(webhooks_of(&mutating(&s)).await?.map(|h| h.len()), Some(0));

    // The process comes back with other handlers: the configurations follow.
    s.handler.kill().await?;
    s.presets = "mutate".into();
    s.restart_handler().await?;
    eventually(
        &s,
        "the configurations to follow the new registrations",
        LONG,
        || async {
            let v = webhooks_of(&validating(&s)).await?.unwrap_or_default();
            let m = webhooks_of(&mutating(&s)).await?.unwrap_or_default();
            Ok((v.is_empty() && m.len() == 1).then_some(()))
        },
    )
    .await?;
    let m = webhooks_of(&mutating(&s)).await?.unwrap_or_default();
    assert_eq!(
        m[0]["clientConfig"]["url"],
        format!("https://127.0.0.1:{port}/mutate")
    );
    eventually(&s, "the mutating webhook to be called", LONG, || async {
        Ok(create(&s, "mutated", json!({"size": 1}), false)
            .await?
            .ok()
            .filter(|o| o.pointer("/spec/defaulted") == Some(&json!(true))))
    })
    .await?;

    // On exit both are removed.
    s.controller.process.terminate().await?;
    assert!(validating(&s).get_opt("capstan-e2e").await?.is_none());
    assert!(mutating(&s).get_opt("capstan-e2e").await?.is_none());
    Ok(())
}

#[tokio::test]
async fn kept_configurations_stay_after_exit() -> Result<()> {
    let (mut s, _) = start("validate", &["--webhook-keep-on-exit"]).await?;
    wait_enforced(&s).await?;
    s.controller.process.terminate().await?;
    let hooks = webhooks_of(&validating(&s)).await?.context("kept")?;
    assert_eq!(hooks.len(), 1);
    // Nothing serves it now: the failure policy (Fail) refuses, as with kopf's persistent
    // webhooks.
    let refused = create(&s, "unserved", json!({"size": 1}), true).await?;
    assert!(refused.is_err(), "refused while no controller serves the webhook");
    Ok(())
}

/// With leader election every replica serves the webhooks, but only the leader writes the
/// managed configurations; a standby that takes over writes them.
#[tokio::test]
async fn only_the_leader_manages_the_configurations_and_every_replica_serves() -> Result<()> {
    use capstan_tests::{
        process::{Controller, start_handler},
        testenv::TestEnv,
    };
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let election = [
        "--leader-election",
        "--lease-duration",
        "4s",
        "--renew-deadline",
        "3s",
        "--retry-period",
        "1s",
        "--shutdown-grace",
        "2s",
        "--webhook-managed",
        "capstan-e2e",
        "--webhook-ca-secret",
        "capstan-e2e-webhook-ca",
    ];
    let start = |name: &'static str| {
        let env = &env;
        async move {
            let listen = format!("127.0.0.1:{}", free_port()?);
            let mut args: Vec<&str> = election.to_vec();
            args.extend(["--webhook-listen", &listen]);
            let mut c = Controller::start(env, name, &args).await?;
            let h = start_handler(
                env,
                &format!("{name}-handler"),
                &c.endpoint(),
                &[("E2E_HANDLERS", "validate")],
            )?;
            c.process.wait_for("handler process connected", LONG).await?;
            Ok::<_, anyhow::Error>((c, h, listen))
        }
    };
    let (mut a, mut a_handler, _) = start("a").await?;
    a.process.wait_for("became the leader", LONG).await?;
    a.process
        .wait_for("managed webhook configurations written", LONG)
        .await?;
    let (mut b, _b_handler, b_listen) = start("b").await?;
    // The standby's webhook server runs too (the API server may call any replica)...
    b.process
        .wait_for("admission webhook server listening", LONG)
        .await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    // ...but writes no configuration.
    assert!(
        !b.process
            .output()
            .contains("managed webhook configurations written"),
        "the standby wrote the configurations:\n{}",
        tail(&b.process.output(), 30)
    );
    let client = env.client().await?;
    let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let url = |config: &ValidatingWebhookConfiguration| {
        config
            .webhooks
            .as_ref()
            .and_then(|w| w.first())
            .and_then(|w| w.client_config.url.clone())
            .unwrap_or_default()
    };
    let written = api.get("capstan-e2e").await?;
    assert!(
        !url(&written).contains(&b_listen),
        "written by the leader, with its own address"
    );
    // One CA, kept in the Secret, signs both replicas' certificates: the bundle the leader
    // wrote is trusted by the standby's server too (as the API server will find in a rollout).
    let bundle = written
        .webhooks
        .as_ref()
        .and_then(|w| w.first())
        .and_then(|w| w.client_config.ca_bundle.clone())
        .context("a CA bundle")?;
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(client.clone(), "default");
    let kept = secrets.get("capstan-e2e-webhook-ca").await?;
    assert_eq!(
        kept.data
            .as_ref()
            .and_then(|d| d.get("ca.crt"))
            .map(|b| b.0.clone()),
        Some(bundle.0.clone())
    );
    handshake(&b_listen, &bundle.0).await?;

    // The leader goes away: the standby takes over and writes them (pointing at itself).
    a.process.kill().await?;
    a_handler.kill().await?;
    b.process.wait_for("became the leader", LONG).await?;
    let deadline = tokio::time::Instant::now() + LONG;
    loop {
        if let Some(config) = api.get_opt("capstan-e2e").await?
            && url(&config).contains(&b_listen)
        {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "the new leader did not write the configurations\n{}",
                tail(&b.process.output(), 40)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    b.process.terminate().await?;
    assert!(
        api.get_opt("capstan-e2e").await?.is_none(),
        "removed by the leader on exit"
    );
    Ok(())
}

/// A TLS handshake with the webhook server at `listen`, trusting only `ca_pem`.
async fn handshake(listen: &str, ca_pem: &[u8]) -> Result<()> {
    use rustls_pki_types::ServerName;
    let tcp = tokio::net::TcpStream::connect(listen).await?;
    let name = ServerName::try_from("127.0.0.1")?.to_owned();
    capstan_tests::webhook_tls::connector(ca_pem, None)?
        .connect(name, tcp)
        .await
        .context("the server's certificate is not trusted through the bundle")?;
    Ok(())
}

/// Without a shared CA each replica would generate its own, and the API server trusts only the
/// leader's: refused at start with `--webhooks=on`, and when the first admission handler
/// registers with `auto` (nothing is served then).
#[tokio::test]
async fn a_generated_certificate_with_leader_election_needs_a_shared_ca() -> Result<()> {
    use capstan_tests::{
        process::{Controller, capstan_binary, start_handler},
        testenv::TestEnv,
    };
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let listen = format!("127.0.0.1:{}", free_port()?);

    let out = tokio::time::timeout(
        LONG,
        tokio::process::Command::new(capstan_binary().await?)
            .args(["run", "--listen"])
            .arg(format!("unix://{}", env.scratch().join("refused.sock").display()))
            .args(["--admin-listen", &format!("127.0.0.1:{}", free_port()?)])
            .args([
                "--leader-election",
                "--webhooks",
                "on",
                "--webhook-listen",
                &listen,
            ])
            .env("KUBECONFIG", &env.kubeconfig)
            .env("NO_COLOR", "1")
            .output(),
    )
    .await
    .context("the controller did not stop")??;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("needs a CA shared by the replicas") && text.contains("--webhook-ca-secret"),
        "{text}"
    );

    // `auto`: the admission handler's registration is refused with the reason, which reaches
    // its process (not only the controller's log).
    let mut c = Controller::start(&env, "auto", &["--leader-election", "--webhook-listen", &listen]).await?;
    let mut handler = start_handler(
        &env,
        "auto-handler",
        &c.endpoint(),
        &[("E2E_HANDLERS", "validate")],
    )?;
    c.process.wait_for("registration rejected", LONG).await?;
    assert!(c.process.output().contains("needs a CA shared by the replicas"));
    handler
        .wait_for("needs a CA shared by the replicas", LONG)
        .await?;
    assert!(handler.output().contains("--webhook-ca-secret"));
    assert!(
        tokio::net::TcpStream::connect(&listen).await.is_err(),
        "nothing listens"
    );
    Ok(())
}

#[tokio::test]
async fn with_webhooks_off_admission_handlers_are_refused_with_a_reason() -> Result<()> {
    let (s, port) = start("validate,create", &["--webhooks", "off"]).await?;
    eventually(&s, "the refusal to reach the handler process", LONG, || async {
        Ok(s.handler
            .output()
            .contains("admission webhooks are off (--webhooks=off)")
            .then_some(()))
    })
    .await?;
    // The SDK does not run an operator without some of its handlers: the process stops,
    // naming the handler (the Rust SDK's `Error::Unsupported`); nothing listens for webhooks.
    let mut handler = s.handler;
    let deadline = tokio::time::Instant::now() + LONG;
    while handler.running() {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the handler process kept running without its admission handler"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(handler.output().contains("check_size"), "{}", handler.output());
    assert!(tokio::net::TcpStream::connect(("127.0.0.1", port)).await.is_err());
    Ok(())
}

/// At the controller's stop the managed configurations stay while it drains (admission is
/// still served and enforced while in-flight work finishes), and go once it has drained.
#[tokio::test]
async fn managed_configurations_stay_while_the_controller_drains() -> Result<()> {
    let (mut s, _) = start("validate,stubborn-forever", &["--shutdown-grace", "8s"]).await?;
    wait_enforced(&s).await?;
    // A daemon that ignores its stop holds the drain for the whole grace.
    s.create("held", json!({"size": 1})).await?;
    eventually(&s, "the daemon to run", LONG, || async {
        Ok((s.count("stubborn", "held") > 0).then_some(()))
    })
    .await?;
    let pid = s
        .controller
        .process
        .id()
        .context("the controller is not running")?;
    let sent = std::process::Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()?;
    assert!(sent.success(), "SIGTERM could not be sent");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        s.controller.process.running(),
        "the controller stopped before its drain was over"
    );
    assert!(
        validating(&s).get_opt("capstan-e2e").await?.is_some(),
        "the configurations were removed while the controller drains:\n{}",
        tail(&s.controller.process.output(), 40)
    );
    let refused = create(&s, "during-the-drain", json!({"size": 99}), true).await?;
    assert!(
        refused
            .as_ref()
            .is_err_and(|m| m.contains("size 99 is too large")),
        "not enforced during the drain: {refused:?}"
    );
    // Its grace runs out; then it removes them and exits (a second signal would hurry it).
    let deadline = tokio::time::Instant::now() + LONG;
    while s.controller.process.running() {
        if tokio::time::Instant::now() > deadline {
            bail!("the controller did not stop after its grace");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        validating(&s).get_opt("capstan-e2e").await?.is_none(),
        "{}",
        tail(&s.controller.process.output(), 40)
    );
    Ok(())
}
