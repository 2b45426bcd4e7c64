//! The chart's admission webhook pieces: what renders in each certificate mode, the defaults
//! that keep a failing webhook from locking a cluster out of its own namespaces, and RBAC that
//! is exactly enough for the controller to manage its webhook configurations — proven by the
//! real `capstan` impersonating the chart's ServiceAccount against a real API server.

use std::time::Duration;

use anyhow::{Context as _, Result, ensure};
use capstan_tests::{
    helm::{Render, documents, ensure_namespace, impersonating_kubeconfig},
    process::free_port,
    scenario::Scenario,
    testenv::TestEnv,
};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use kube::Api;
use serde_json::Value;

const BASE: [&str; 3] = [
    "rbac.resources[0].apiGroup=demo.capstan.dev",
    "rbac.resources[0].resources={examples}",
    "handler.image.repository=ghcr.io/capstan-dev/capstan-example",
];

fn capstan_env(docs: &[String]) -> Vec<String> {
    docs.iter()
        .filter(|d| d.contains("kind: Deployment"))
        .flat_map(|d| d.lines().map(str::trim).map(str::to_owned).collect::<Vec<_>>())
        .collect()
}

async fn rendered(extra: &[&str]) -> Result<(String, Vec<String>)> {
    let mut set = BASE.to_vec();
    set.extend_from_slice(extra);
    let out = Render {
        release: "web",
        namespace: "ops",
        set,
        ..Render::default()
    }
    .manifests()
    .await?;
    let docs = documents(&out);
    Ok((out, docs))
}

fn has_kind(docs: &[String], kind: &str, name: &str) -> bool {
    docs.iter()
        .any(|d| d.contains(&format!("kind: {kind}\n")) && d.contains(&format!("name: {name}\n")))
}

/// The value of env variable `name` in the Deployment (the line after `- name: NAME`).
fn env_value(docs: &[String], name: &str) -> Option<String> {
    let lines = capstan_env(docs);
    let at = lines.iter().position(|l| l == &format!("- name: {name}"))?;
    lines
        .get(at + 1)
        .and_then(|l| l.strip_prefix("value: "))
        .map(|v| v.trim_matches('"').to_owned())
}

#[tokio::test]
async fn the_chart_renders_the_webhook_pieces_in_each_certificate_mode() -> Result<()> {
    // Off by default: nothing of it, and admission handlers are refused with a reason.
    let (_, docs) = rendered(&[]).await?;
    ensure!(!has_kind(&docs, "Service", "web-capstan-webhook"));
    ensure!(env_value(&docs, "CAPSTAN_WEBHOOKS").as_deref() == Some("off"));

    // Self-signed (the default source): Service, managed configurations with their RBAC, no
    // Secret mounted.
    let (out, docs) = rendered(&["webhooks.enabled=true"]).await?;
    ensure!(has_kind(&docs, "Service", "web-capstan-webhook"), "{out}");
    ensure!(out.contains("targetPort: webhook") && out.contains("containerPort: 9443"));
    ensure!(env_value(&docs, "CAPSTAN_WEBHOOKS").as_deref() == Some("on"));
    ensure!(env_value(&docs, "CAPSTAN_WEBHOOK_SERVICE").as_deref() == Some("web-capstan-webhook"));
    ensure!(env_value(&docs, "CAPSTAN_WEBHOOK_MANAGED").as_deref() == Some("web-capstan"));
    ensure!(
        env_value(&docs, "CAPSTAN_WEBHOOK_EXCLUDE_NAMESPACES").as_deref() == Some("kube-system,ops"),
        "kube-system and the release namespace are never sent to the webhooks"
    );
    ensure!(env_value(&docs, "CAPSTAN_WEBHOOK_CERT_DIR").is_none());
    ensure!(
        env_value(&docs, "CAPSTAN_WEBHOOK_CA_SECRET").as_deref() == Some("web-capstan-webhook-ca"),
        "one CA for every replica, kept in a Secret"
    );
    let ca_role = docs
        .iter()
        .find(|d| d.contains("kind: Role\n") && d.contains("name: web-capstan-webhook-ca\n"))
        .context("the Role for the CA Secret")?;
    ensure!(
        ca_role.contains("resourceNames: [web-capstan-webhook-ca]") && ca_role.contains("verbs: [create]"),
        "{ca_role}"
    );
    ensure!(has_kind(&docs, "RoleBinding", "web-capstan-webhook-ca"));
    ensure!(has_kind(&docs, "ClusterRole", "web-capstan-webhooks"));
    let role = docs
        .iter()
        .find(|d| d.contains("kind: ClusterRole\n") && d.contains("name: web-capstan-webhooks\n"))
        .context("the webhook ClusterRole")?;
    ensure!(role.contains("resourceNames: [web-capstan]"), "{role}");
    ensure!(!role.contains('*'));
    ensure!(
        out.contains("- port: webhook"),
        "the NetworkPolicy lets the API server reach the webhook port"
    );

    // cert-manager: a Certificate for the Service's names, its Secret mounted and reloaded.
    let (out, docs) = rendered(&[
        "webhooks.enabled=true",
        "webhooks.certificate.source=certManager",
        "webhooks.certificate.certManager.issuerName=cluster-ca",
        "webhooks.certificate.certManager.issuerKind=ClusterIssuer",
    ])
    .await?;
    ensure!(has_kind(&docs, "Certificate", "web-capstan-webhook"), "{out}");
    ensure!(out.contains("- web-capstan-webhook.ops.svc\n") && out.contains("kind: ClusterIssuer"));
    ensure!(out.contains("secretName: web-capstan-webhook-tls"));
    ensure!(env_value(&docs, "CAPSTAN_WEBHOOK_CERT_DIR").as_deref() == Some("/run/capstan-webhook-tls"));
    ensure!(env_value(&docs, "CAPSTAN_WEBHOOK_CA_SECRET").is_none());
    ensure!(!has_kind(&docs, "Role", "web-capstan-webhook-ca"));

    // Several replicas with leader election and a generated certificate: one shared CA.
    let (out, docs) = rendered(&[
        "webhooks.enabled=true",
        "replicas=2",
        "leaderElection.enabled=true",
    ])
    .await?;
    ensure!(
        env_value(&docs, "CAPSTAN_WEBHOOK_CA_SECRET").as_deref() == Some("web-capstan-webhook-ca"),
        "{out}"
    );

    // An existing Secret, configurations written by the user: no Certificate, no RBAC for
    // webhook configurations.
    let (out, docs) = rendered(&[
        "webhooks.enabled=true",
        "webhooks.configurations=unmanaged",
        "webhooks.certificate.source=existingSecret",
        "webhooks.certificate.existingSecret=my-tls",
        "webhooks.excludeNamespaces={monitoring}",
    ])
    .await?;
    ensure!(out.contains("secretName: my-tls"));
    ensure!(!has_kind(&docs, "Certificate", "web-capstan-webhook"));
    ensure!(!has_kind(&docs, "ClusterRole", "web-capstan-webhooks"));
    // Given empty: a startup handler's `admission.managed` cannot make the controller write any.
    ensure!(env_value(&docs, "CAPSTAN_WEBHOOK_MANAGED").as_deref() == Some(""));
    ensure!(
        env_value(&docs, "CAPSTAN_WEBHOOK_EXCLUDE_NAMESPACES").as_deref()
            == Some("kube-system,ops,monitoring")
    );

    // Combinations that cannot work say what to change.
    for (set, says) in [
        (
            vec!["webhooks.enabled=true", "webhooks.configurations=unmanaged"],
            "needs webhooks.configurations=managed",
        ),
        (
            vec!["webhooks.enabled=true", "webhooks.certificate.source=certManager"],
            "issuerName",
        ),
        (
            vec![
                "webhooks.enabled=true",
                "webhooks.certificate.source=existingSecret",
            ],
            "existingSecret",
        ),
    ] {
        let mut all = BASE.to_vec();
        all.extend(set.iter().copied());
        let outcome = Render {
            release: "web",
            namespace: "ops",
            set: all,
            ..Render::default()
        }
        .outcome()
        .await?;
        ensure!(
            !outcome.success && outcome.stderr.contains(says),
            "{set:?}: {}",
            outcome.stderr
        );
    }
    Ok(())
}

#[tokio::test]
async fn the_charts_webhook_rbac_is_enough_to_manage_the_configurations() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let ns = "capstan-system";
    ensure_namespace(&env, ns).await?;
    let mut set = BASE.to_vec();
    set.push("webhooks.enabled=true");
    let manifests = Render {
        release: "web",
        namespace: ns,
        set,
        show_only: vec![
            "templates/serviceaccount.yaml",
            "templates/rbac.yaml",
            "templates/webhook.yaml",
        ],
        ..Render::default()
    }
    .manifests()
    .await?;
    env.apply(&manifests).await?;
    let user = format!("system:serviceaccount:{ns}:web-capstan");
    let kubeconfig = impersonating_kubeconfig(&env, &user).await?;
    let can = |verb: &'static str, what: &'static str| {
        let env = &env;
        let kubeconfig = kubeconfig.clone();
        async move {
            let out = env
                .kubectl()
                .arg("--kubeconfig")
                .arg(&kubeconfig)
                .args(["auth", "can-i", verb, what])
                .output()
                .await?;
            Ok::<_, anyhow::Error>(String::from_utf8_lossy(&out.stdout).trim() == "yes")
        }
    };
    ensure!(can("patch", "validatingwebhookconfigurations/web-capstan").await?);
    ensure!(!can("patch", "validatingwebhookconfigurations/someone-elses").await?);
    ensure!(!can("list", "mutatingwebhookconfigurations").await?);
    let in_ns = |verb: &'static str, what: &'static str| {
        let env = &env;
        let kubeconfig = kubeconfig.clone();
        async move {
            let out = env
                .kubectl()
                .arg("--kubeconfig")
                .arg(&kubeconfig)
                .args(["auth", "can-i", verb, what, "-n", "capstan-system"])
                .output()
                .await?;
            Ok::<_, anyhow::Error>(String::from_utf8_lossy(&out.stdout).trim() == "yes")
        }
    };
    ensure!(in_ns("get", "secrets/web-capstan-webhook-ca").await?);
    ensure!(!in_ns("get", "secrets/someone-elses").await?);
    ensure!(!in_ns("list", "secrets").await?);
    ensure!(in_ns("create", "secrets").await?);

    // As the chart runs it (in development mode on loopback, so that the API server reaches it).
    let port = free_port()?;
    let listen = format!("127.0.0.1:{port}");
    let args = [
        "--webhook-listen",
        &listen,
        "--webhook-managed",
        "web-capstan",
        "--webhook-service-namespace",
        ns,
        "--webhook-ca-secret",
        "web-capstan-webhook-ca",
    ];
    let mut s = Scenario::attach(env, &kubeconfig, "validate", &args, "default").await?;
    let api: Api<ValidatingWebhookConfiguration> = Api::all(s.client.clone());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while api.get_opt("web-capstan").await?.is_none() {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the configuration was not written:\n{}",
            s.controller.process.output()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let secrets: Api<k8s_openapi::api::core::v1::Secret> = Api::namespaced(s.client.clone(), ns);
    ensure!(
        secrets.get_opt("web-capstan-webhook-ca").await?.is_some(),
        "the CA kept in its Secret"
    );
    s.controller.process.terminate().await?;
    ensure!(api.get_opt("web-capstan").await?.is_none(), "removed on exit");
    let refused: Vec<Value> = s
        .env
        .audit_events()?
        .into_iter()
        .filter(|e| e["stage"] == "ResponseComplete")
        .filter(|e| {
            e["userAgent"]
                .as_str()
                .is_some_and(|ua| ua.starts_with("capstan/"))
        })
        .filter(|e| e["responseStatus"]["code"] == 403)
        .collect();
    ensure!(refused.is_empty(), "the controller was refused: {refused:?}");
    s.handler.terminate().await?;
    Ok(())
}

#[tokio::test]
async fn the_chart_mounts_the_client_ca_and_opens_the_webhook_port_to_webhook_from() -> Result<()> {
    // Without a client CA: no flag, no mount; the webhook port is open to every address (the
    // API server is not a pod), as networkPolicy.webhookFrom says by default.
    let (out, docs) = rendered(&["webhooks.enabled=true"]).await?;
    ensure!(env_value(&docs, "CAPSTAN_WEBHOOK_CLIENT_CA").is_none());
    ensure!(!out.contains("webhook-client-ca"));
    let policy = docs
        .iter()
        .find(|d| d.contains("kind: NetworkPolicy\n"))
        .context("the NetworkPolicy")?;
    ensure!(
        policy.contains("- port: webhook")
            && policy.contains("cidr: 0.0.0.0/0")
            && policy.contains("cidr: ::/0"),
        "{policy}"
    );

    // Narrowed, and with the CA from a Secret.
    let (out, docs) = rendered(&[
        "webhooks.enabled=true",
        "webhooks.clientCA.secretName=apiserver-client-ca",
        "networkPolicy.webhookFrom[0].ipBlock.cidr=10.0.0.0/24",
    ])
    .await?;
    ensure!(
        env_value(&docs, "CAPSTAN_WEBHOOK_CLIENT_CA").as_deref()
            == Some("/run/capstan-webhook-client-ca/ca.crt"),
        "{out}"
    );
    ensure!(out.contains("mountPath: /run/capstan-webhook-client-ca"));
    ensure!(out.contains("secretName: apiserver-client-ca"));
    let policy = documents(&out)
        .into_iter()
        .find(|d| d.contains("kind: NetworkPolicy\n"))
        .context("the NetworkPolicy")?;
    ensure!(
        policy.contains("cidr: 10.0.0.0/24") && !policy.contains("0.0.0.0/0"),
        "{policy}"
    );

    // From a ConfigMap, under another key.
    let (out, docs) = rendered(&[
        "webhooks.enabled=true",
        "webhooks.clientCA.configMapName=front-proxy-ca",
        "webhooks.clientCA.key=client-ca.pem",
    ])
    .await?;
    ensure!(
        env_value(&docs, "CAPSTAN_WEBHOOK_CLIENT_CA").as_deref()
            == Some("/run/capstan-webhook-client-ca/client-ca.pem")
    );
    ensure!(
        out.contains("configMap:\n") && out.contains("name: front-proxy-ca"),
        "{out}"
    );

    // Both sources at once cannot be meant.
    let mut set = BASE.to_vec();
    set.extend([
        "webhooks.enabled=true",
        "webhooks.clientCA.secretName=a",
        "webhooks.clientCA.configMapName=b",
    ]);
    let outcome = Render {
        release: "web",
        namespace: "ops",
        set,
        ..Render::default()
    }
    .outcome()
    .await?;
    ensure!(
        !outcome.success && outcome.stderr.contains("secretName or configMapName"),
        "{}",
        outcome.stderr
    );
    Ok(())
}
