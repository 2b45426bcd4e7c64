//! Differential test on the lines of kopf's example operator `17-admission`: an operator file
//! of our own (`sdk-python/tests/differential/examples_admission.py`) runs once with real kopf
//! (pinned from PyPI, `kopf run --standalone`, serving its webhooks itself with the test's
//! certificate) and once with `capstan.kopf` on Capstan (`--persistence kopf`, the controller
//! serving them from `--webhook-listen`), each against a fresh API server, and what the API
//! server's clients see is compared.
//!
//! The same startup handler sets `settings.admission.server`, `.managed` and
//! `settings.networking.request_timeout` under both: the controller is not given
//! `--webhook-managed` or `--api-timeout`, so the configurations' name and the timeout are the
//! startup handler's (`ProcessSettings.operator`). The
//! objects created then meet validating handlers that warn, deny with kopf's default code and
//! with their own, and skip dry runs, and a mutating handler that patches labelled objects;
//! the warnings name the request's User-Agent header and whether a client certificate came.
//! Compared per object: admitted (with the stored spec) or denied (with the code and the
//! message, the webhook's name aside: each names its webhooks its own way), and the warnings
//! kubectl prints for an admitted object.

use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use capstan::webhooks::certs::generate_pem;
use capstan_tests::{
    process::free_port,
    side_by_side::{Flags, Framework, Operator},
    testenv::{TestEnv, examples},
};
use kube::{
    Api,
    api::{DynamicObject, PostParams},
};
use serde_json::{Value, json};

/// The operator file both frameworks run.
const OPERATOR: &str = "sdk-python/tests/differential/examples_admission.py";

/// How long the API server may take to call a webhook configuration just made.
const ADMISSION_UP: Duration = Duration::from_secs(60);

/// What the API server answered for one object: admitted with its spec, or denied.
fn outcome(result: kube::Result<DynamicObject>) -> Result<Value> {
    match result {
        Ok(object) => Ok(json!({"admitted": object.data["spec"]})),
        Err(kube::Error::Api(status)) => {
            // `admission webhook "<name>" denied the request: <message>`
            let message = status
                .message
                .split_once("denied the request: ")
                .map_or(status.message.as_str(), |(_, m)| m);
            Ok(json!({"denied": {"code": status.code, "message": message}}))
        }
        Err(other) => bail!("the create failed on its way: {other}"),
    }
}

fn example(name: &str, labels: Value, field: &str) -> Result<DynamicObject> {
    Ok(serde_json::from_value(json!({
        "apiVersion": "demo.capstan.dev/v1",
        "kind": "Example",
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "spec": {"field": field},
    }))?)
}

async fn create(
    api: &Api<DynamicObject>,
    name: &str,
    labels: Value,
    field: &str,
    dry_run: bool,
) -> Result<Value> {
    let params = PostParams {
        dry_run,
        ..PostParams::default()
    };
    outcome(api.create(&params, &example(name, labels, field)?).await)
}

/// The warnings kubectl prints when it creates `name`.
async fn warnings_of_create(env: &TestEnv, name: &str) -> Result<Vec<String>> {
    let file = env.scratch().join(format!("{name}.json"));
    std::fs::write(&file, serde_json::to_vec(&example(name, json!({}), "fine")?)?)?;
    let out = env
        .kubectl()
        .args(["create", "-f", &file.display().to_string()])
        .output()
        .await?;
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() {
        bail!("kubectl create {name} failed: {stderr}");
    }
    Ok(stderr
        .lines()
        .filter_map(|l| l.strip_prefix("Warning: "))
        .map(str::to_owned)
        .collect())
}

/// The names of the validating and mutating webhook configurations in the cluster.
async fn configuration_names(env: &TestEnv) -> Result<Value> {
    use k8s_openapi::api::admissionregistration::v1::{
        MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
    };
    let client = env.client().await?;
    let names = |items: Vec<Option<String>>| {
        let mut names: Vec<String> = items.into_iter().flatten().collect();
        names.sort();
        names
    };
    let validating = Api::<ValidatingWebhookConfiguration>::all(client.clone())
        .list(&Default::default())
        .await?;
    let mutating = Api::<MutatingWebhookConfiguration>::all(client)
        .list(&Default::default())
        .await?;
    Ok(json!({
        "validating": names(validating.items.into_iter().map(|c| c.metadata.name).collect()),
        "mutating": names(mutating.items.into_iter().map(|c| c.metadata.name).collect()),
    }))
}

async fn admission_run(framework: Framework) -> Result<Value> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let log = env.scratch().join("calls.jsonl");
    let api = examples(&env.client().await?, "default");
    let port = free_port()?.to_string();
    let names = ["127.0.0.1".to_owned(), "localhost".to_owned()];
    let pem = generate_pem(&names)?;
    let cert = env.scratch().join("webhook-cert.pem");
    let key = env.scratch().join("webhook-key.pem");
    std::fs::write(&cert, &pem.chain)?;
    std::fs::write(&key, &pem.key)?;
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    let vars = [
        ("WEBHOOK_PORT", port.as_str()),
        ("WEBHOOK_CERT", cert.as_str()),
        ("WEBHOOK_KEY", key.as_str()),
    ];
    let listen = format!("127.0.0.1:{}", free_port()?);
    // The managed configurations' name and the API timeout come from the startup handler.
    let controller = ["--webhook-listen", listen.as_str()];
    let flags = Flags {
        controller: &controller,
        ..Flags::default()
    };
    let operator = Operator::start_with(framework, &env, OPERATOR, &log, &vars, 1, flags).await?;
    let seen = async {
        // The API server calls the webhooks once it has read the configurations the operator
        // made: until then, objects pass unchecked (or unchanged).
        let deadline = tokio::time::Instant::now() + ADMISSION_UP;
        let mut probe = 0;
        loop {
            probe += 1;
            let answer = create(&api, &format!("probe-{probe}"), json!({}), "wrong", false).await?;
            // The mutating configuration is read on its own.
            let mutated = create(
                &api,
                "probe-mutated",
                json!({"somelabel": "somevalue"}),
                "fine",
                true,
            )
            .await?;
            if answer.get("denied").is_some() && mutated["admitted"]["injected"] == 123 {
                break;
            }
            if tokio::time::Instant::now() > deadline {
                bail!("the webhooks were not called within {ADMISSION_UP:?}: {answer}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        Ok::<_, anyhow::Error>(json!({
            "wrong": create(&api, "wrong", json!({}), "wrong", false).await?,
            "wrong-dry-run": create(&api, "wrong-dry-run", json!({}), "wrong", true).await?,
            "not-allowed": create(&api, "not-allowed", json!({}), "not-allowed", false).await?,
            "no-code": create(&api, "no-code", json!({}), "no-code", false).await?,
            "labelled": create(&api, "labelled", json!({"somelabel": "somevalue"}), "fine", false).await?,
            "other-label": create(&api, "other-label", json!({"somelabel": "other"}), "fine", false).await?,
            "warnings": warnings_of_create(&env, "warned").await?,
            "configuration": configuration_names(&env).await?,
        }))
    }
    .await
    .with_context(|| format!("{framework:?}: {}", operator.output()));
    if framework == Framework::Capstan && seen.is_ok() {
        let output = operator.output();
        if !output.contains("the API requests' timeout changed") || !output.contains("45s") {
            bail!("the controller did not take the startup handler's request_timeout:\n{output}");
        }
    }
    operator.stop().await?;
    let seen = seen?;
    println!("{framework:?}: {seen:#}");
    Ok(seen)
}

/// Validating and mutating handlers admit, deny, warn and patch as under kopf, with kopf's
/// codes and messages.
#[tokio::test]
async fn admission_handlers_answer_as_kopfs_do() -> Result<()> {
    let kopf = admission_run(Framework::Kopf).await?;
    let capstan = admission_run(Framework::Capstan).await?;
    assert_eq!(
        kopf["wrong"]["denied"]["message"],
        json!("Meh! I don't like it. Change the field."),
        "kopf's answers are not the ones intended: {kopf:#}"
    );
    assert_eq!(
        kopf["labelled"]["admitted"]["injected"],
        json!(123),
        "kopf's answers are not the ones intended: {kopf:#}"
    );
    for case in [
        "wrong",
        "wrong-dry-run",
        "not-allowed",
        "no-code",
        "labelled",
        "other-label",
        "warnings",
        "configuration",
    ] {
        assert_eq!(
            capstan[case], kopf[case],
            "{case}: the answers differ (left: capstan.kopf, right: kopf)"
        );
    }
    Ok(())
}
