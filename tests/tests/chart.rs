//! The Helm chart (`charts/capstan`): strict lint, rendering of every CI values file, refusal
//! of invalid values with a message that says what to change, every rendered manifest applied
//! to a real API server (server-side dry run, then for real), and the chart's RBAC verified for
//! real: the `capstan` binary, impersonating the chart's ServiceAccount, runs a full
//! create/update/delete cycle with exactly those permissions and fails clearly without `patch`;
//! in DaemonSet mode it handles objects per node and cleans up after a deleted Node; with
//! leader election and peering it leads on its Lease and joins its peering group.

use std::{collections::BTreeSet, path::PathBuf, time::Duration};

use anyhow::{Context as _, Result, bail, ensure};
use capstan_tests::{
    helm::{
        self, Render, ci_values_files, documents, ensure_namespace, impersonating_kubeconfig, namespaces_of,
        scratch_file, stem,
    },
    process::{Controller, start_handler},
    scenario::{Scenario, annotation, has_finalizer, tail},
    testenv::TestEnv,
};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(30);

/// The handler image, which every install must name.
const HANDLER_IMAGE: &str = "handler.image.repository=ghcr.io/capstan-dev/capstan-example";

/// The values that make the chart run the demo operator for the example resource.
const EXAMPLE_RESOURCE: [&str; 3] = [
    "rbac.resources[0].apiGroup=demo.capstan.dev",
    "rbac.resources[0].resources={examples}",
    HANDLER_IMAGE,
];

/// The standard path of in-cluster API credentials.
const TOKEN_PATH: &str = "/var/run/secrets/kubernetes.io/serviceaccount";

fn ci_file(prefix: &str) -> Result<PathBuf> {
    ci_values_files()?
        .into_iter()
        .find(|p| stem(p).starts_with(prefix))
        .with_context(|| format!("no ci/{prefix}*.yaml"))
}

#[tokio::test]
async fn lint_passes_strictly_with_the_defaults_and_every_ci_values_file() -> Result<()> {
    let chart = helm::chart_dir().to_string_lossy().into_owned();
    let out = helm::run(&[
        "lint",
        "--strict",
        &chart,
        "--kube-version",
        helm::KUBE_VERSION,
        "--set",
        HANDLER_IMAGE,
    ])
    .await?;
    ensure!(
        out.success,
        "helm lint --strict failed:\n{}{}",
        out.stdout,
        out.stderr
    );
    let files = ci_values_files()?;
    ensure!(files.len() >= 7, "expected the CI values matrix, found {files:?}");
    for file in files {
        let values = file.to_string_lossy();
        let out = helm::run(&[
            "lint",
            "--strict",
            &chart,
            "--kube-version",
            helm::KUBE_VERSION,
            "--values",
            &values,
        ])
        .await?;
        ensure!(
            out.success,
            "helm lint --strict with {values} failed:\n{}{}",
            out.stdout,
            out.stderr
        );
    }
    Ok(())
}

#[tokio::test]
async fn every_value_is_documented_and_in_the_schema() -> Result<()> {
    let dir = helm::chart_dir();
    let values = std::fs::read_to_string(dir.join("values.yaml"))?;
    let schema: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("values.schema.json"))?)?;
    let mut previous = "";
    // (indentation, key) of the enclosing mappings.
    let mut path: Vec<(usize, String)> = Vec::new();
    let mut keys = Vec::new();
    for line in values.lines() {
        let trimmed = line.trim_start();
        let indent = line.len() - trimmed.len();
        if trimmed.is_empty() || trimmed.starts_with('#') || trimmed.starts_with('-') {
            if !trimmed.is_empty() {
                previous = line;
            }
            continue;
        }
        let Some((key, _)) = trimmed.split_once(':') else {
            bail!("unexpected line in values.yaml: {line:?}");
        };
        ensure!(
            previous.trim_start().starts_with('#'),
            "values.yaml: `{key}` has no comment above it"
        );
        while path.last().is_some_and(|(i, _)| *i >= indent) {
            path.pop();
        }
        path.push((indent, key.to_owned()));
        keys.push(path.iter().map(|(_, k)| k.as_str()).collect::<Vec<_>>().join("."));
        previous = line;
    }
    ensure!(keys.len() > 60, "parsed only {} values", keys.len());
    for key in &keys {
        let mut node = &schema;
        for part in key.split('.') {
            if let Some(reference) = node.get("$ref").and_then(Value::as_str) {
                let name = reference.trim_start_matches("#/definitions/");
                node = &schema["definitions"][name];
            }
            node = node
                .get("properties")
                .and_then(|p| p.get(part))
                .with_context(|| format!("values.schema.json does not describe `{key}`"))?;
        }
    }
    Ok(())
}

#[tokio::test]
async fn node_local_storage_mounts_a_host_directory_prepared_with_only_chown() -> Result<()> {
    let out = Render {
        release: "ci",
        namespace: "ops",
        values: vec![ci_file("09")?],
        ..Render::default()
    }
    .manifests()
    .await?;
    let daemonset = documents(&out)
        .into_iter()
        .find(|d| d.contains("kind: DaemonSet"))
        .context("no DaemonSet")?;
    let prepare = daemonset
        .find("- name: prepare-storage")
        .context("no prepare-storage init container")?;
    let sidecar = daemonset
        .find("- name: capstan\n")
        .context("no capstan container")?;
    ensure!(
        prepare < sidecar,
        "the directory is prepared before capstan starts"
    );
    let init = &daemonset[prepare..sidecar];
    ensure!(init.contains("\"65532:65532\""), "for the pod's user: {init}");
    ensure!(
        init.contains("drop: [ALL]") && init.contains("add: [CHOWN, FOWNER]"),
        "only CHOWN and FOWNER: {init}"
    );
    ensure!(
        daemonset.contains("path: \"/var/lib/capstan-example\"")
            && daemonset.contains("type: DirectoryOrCreate"),
        "a hostPath of type DirectoryOrCreate"
    );
    ensure!(
        out.contains("name: CAPSTAN_NODE_STORAGE")
            && out.contains("value: \"file:/var/lib/capstan-example\"")
    );
    let refused = Render {
        release: "ci",
        namespace: "ops",
        values: vec![ci_file("01")?],
        set: vec!["daemonset.nodeStorage.enabled=true"],
        ..Render::default()
    }
    .manifests()
    .await;
    ensure!(
        refused
            .as_ref()
            .is_err_and(|e| format!("{e:#}").contains("needs mode=daemonset")),
        "node storage outside daemonset mode is refused: {refused:?}"
    );
    Ok(())
}

#[tokio::test]
async fn every_ci_values_file_renders_and_the_modes_differ_as_documented() -> Result<()> {
    for file in ci_values_files()? {
        let out = Render {
            release: "ci",
            namespace: "ops",
            values: vec![file.clone()],
            ..Render::default()
        }
        .manifests()
        .await?;
        let docs = documents(&out);
        ensure!(!docs.is_empty(), "{} renders nothing", file.display());
        ensure!(
            out.contains("value: unix:///run/capstan/capstan.sock") && out.contains("name: CAPSTAN_ENDPOINT"),
            "{}: the handler must get CAPSTAN_ENDPOINT",
            file.display()
        );
        ensure!(
            !out.contains("'*'") && !out.contains("\"*\""),
            "{}: wildcard RBAC rules by default",
            file.display()
        );
    }
    let deployment = Render {
        release: "ci",
        namespace: "ops",
        values: vec![ci_file("01")?],
        ..Render::default()
    }
    .manifests()
    .await?;
    ensure!(deployment.contains("kind: Deployment") && !deployment.contains("kind: DaemonSet"));
    ensure!(
        deployment.contains("type: Recreate"),
        "Recreate without leader election"
    );
    ensure!(
        deployment.contains("initContainers:") && deployment.contains("restartPolicy: Always"),
        "capstan is a native sidecar by default"
    );
    let daemonset = Render {
        release: "ci",
        namespace: "ops",
        values: vec![ci_file("02")?],
        ..Render::default()
    }
    .manifests()
    .await?;
    ensure!(daemonset.contains("kind: DaemonSet") && !daemonset.contains("kind: Deployment"));
    ensure!(
        daemonset.contains("fieldPath: spec.nodeName"),
        "NODE_NAME from spec.nodeName"
    );
    let legacy = Render {
        release: "ci",
        namespace: "ops",
        values: vec![ci_file("05")?],
        ..Render::default()
    }
    .manifests()
    .await?;
    ensure!(
        !legacy.contains("initContainers:") && !legacy.contains("restartPolicy: Always"),
        "nativeSidecar=false runs capstan as a regular container"
    );
    Ok(())
}

#[tokio::test]
async fn invalid_values_fail_with_a_message_that_says_what_to_change() -> Result<()> {
    let cases: &[(&[&str], &str)] = &[
        (
            &["replicaCount=2"],
            "additional properties 'replicaCount' not allowed",
        ),
        (
            &["capstan.image.tagg=v1"],
            "additional properties 'tagg' not allowed",
        ),
        (&["replicas=two"], "at '/replicas': got string, want integer"),
        (
            &["nativeSidecar=maybe"],
            "at '/nativeSidecar': got string, want boolean",
        ),
        (
            &["mode=statefulset"],
            "at '/mode': value must be one of 'deployment', 'daemonset'",
        ),
        (
            &["rbac.scope=everywhere"],
            "at '/rbac/scope': value must be one of",
        ),
        (
            &["replicas=2"],
            "replicas=2 needs sharding.enabled=true or leaderElection.enabled=true: without either every \
             replica would handle every object at the same time.",
        ),
        (
            &["sharding.enabled=true", "leaderElection.enabled=true"],
            "sharding.enabled=true with leaderElection.enabled=true: sharding replaces leader election",
        ),
        (
            &["sharding.enabled=true", "mode=daemonset"],
            "sharding.enabled=true needs mode=deployment",
        ),
        (
            &[
                "mode=daemonset",
                "finalizers=enabled",
                "daemonset.nodeCleanup=false",
            ],
            "mode=daemonset with finalizers=enabled needs daemonset.nodeCleanup=true",
        ),
        (
            &["updateStrategy.type=RollingUpdate"],
            "updateStrategy.type=RollingUpdate without leader election",
        ),
        (
            &[
                "rbac.resources[0].apiGroup=apps",
                "rbac.resources[0].resources={*}",
            ],
            "at '/rbac/resources/0/resources/0'",
        ),
        (
            &["metrics.serviceMonitor.enabled=true"],
            "metrics.serviceMonitor.enabled=true needs metrics.enabled=true",
        ),
        (
            &["capstan.persistencePrefix=kopf.zalando.org"],
            "capstan.persistencePrefix=kopf.zalando.org without capstan.persistence=kopf keeps Capstan's own \
             key formats and finalizer under kopf's prefix: kopf's progress records would not be recognised and \
             kopf's finalizers (kopf.zalando.org/KopfFinalizerMarker) would stay on the objects.",
        ),
        (
            &["capstan.persistence=zalando"],
            "at '/capstan/persistence': value must be one of 'capstan', 'kopf'",
        ),
        (
            &[
                "handler.rbac.rules[0].apiGroups={}",
                "handler.rbac.rules[0].resources={configmaps}",
                "handler.rbac.rules[0].verbs={get}",
            ],
            "handler.rbac.rules needs handler.apiAccess=true",
        ),
    ];
    for (set, expected) in cases {
        let mut set = set.to_vec();
        set.push(HANDLER_IMAGE);
        let out = Render {
            release: "bad",
            namespace: "ops",
            set: set.clone(),
            ..Render::default()
        }
        .outcome()
        .await?;
        ensure!(!out.success, "--set {set:?} rendered although it is invalid");
        ensure!(
            out.stderr.contains(expected),
            "--set {set:?}: expected {expected:?} in:\n{}",
            out.stderr
        );
    }
    // Without a handler image nothing renders, and the message says what to set.
    let out = Render {
        release: "bad",
        namespace: "ops",
        ..Render::default()
    }
    .outcome()
    .await?;
    ensure!(
        !out.success
            && out.stderr.contains(
                "handler.image.repository is required: the image of your operator, which runs in the handler \
                 container."
            ),
        "rendered without a handler image:\n{}",
        out.stderr
    );
    // The safe variants of the refused combinations render.
    for set in [
        &["replicas=2", "leaderElection.enabled=true"][..],
        &["replicas=3", "sharding.enabled=true"][..],
        &[
            "replicas=3",
            "sharding.enabled=true",
            "updateStrategy.type=RollingUpdate",
        ][..],
        &["mode=daemonset", "finalizers=enabled"][..],
        &["mode=daemonset", "daemonset.nodeCleanup=false"][..],
        &["capstan.persistence=kopf"][..],
        &[
            "capstan.persistence=kopf",
            "capstan.persistencePrefix=kopf.zalando.org",
        ][..],
        &[
            "handler.apiAccess=true",
            "handler.rbac.rules[0].apiGroups={}",
            "handler.rbac.rules[0].resources={configmaps}",
            "handler.rbac.rules[0].verbs={get}",
        ][..],
    ] {
        let mut set = set.to_vec();
        set.push(HANDLER_IMAGE);
        Render {
            release: "good",
            namespace: "ops",
            set,
            ..Render::default()
        }
        .manifests()
        .await?;
    }
    Ok(())
}

/// A minimal ServiceMonitor CRD, standing in for the Prometheus Operator's.
const SERVICE_MONITOR_CRD: &str = r#"
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata:
  name: servicemonitors.monitoring.coreos.com
spec:
  group: monitoring.coreos.com
  scope: Namespaced
  names: {kind: ServiceMonitor, listKind: ServiceMonitorList, plural: servicemonitors, singular: servicemonitor}
  versions:
    - name: v1
      served: true
      storage: true
      schema:
        openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}
"#;

/// The objects of a `kubectl ... -o json` answer (a List or a single object).
fn objects(json: &str) -> Result<Vec<Value>> {
    let value: Value = serde_json::from_str(json).context("kubectl printed no JSON")?;
    Ok(match value.get("items").and_then(Value::as_array) {
        Some(items) => items.clone(),
        None => vec![value],
    })
}

fn find<'a>(objects: &'a [Value], kind: &str) -> Vec<&'a Value> {
    objects.iter().filter(|o| o["kind"] == kind).collect()
}

fn env_of(container: &Value) -> Vec<(String, String)> {
    container["env"]
        .as_array()
        .map(|env| {
            env.iter()
                .map(|e| {
                    let value = e["value"].as_str().map_or_else(
                        || {
                            format!(
                                "fieldRef:{}",
                                e["valueFrom"]["fieldRef"]["fieldPath"].as_str().unwrap_or("")
                            )
                        },
                        str::to_owned,
                    );
                    (e["name"].as_str().unwrap_or_default().to_owned(), value)
                })
                .collect()
        })
        .unwrap_or_default()
}

fn lookup<'a>(env: &'a [(String, String)], name: &str) -> Option<&'a str> {
    env.iter().find(|(n, _)| n == name).map(|(_, v)| v.as_str())
}

/// Checks the objects the API server accepted for one CI values file.
fn check_ci_objects(stem: &str, ns: &str, objs: &[Value]) -> Result<()> {
    let workloads: Vec<&Value> = objs
        .iter()
        .filter(|o| o["kind"] == "Deployment" || o["kind"] == "DaemonSet")
        .collect();
    ensure!(
        workloads.len() == 1,
        "{stem}: one workload, got {}",
        workloads.len()
    );
    let workload = workloads[0];
    let pod = &workload["spec"]["template"]["spec"];
    let native = pod["initContainers"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == "capstan"));
    let regular = pod["containers"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == "capstan"));
    let capstan = native.or(regular).context("no capstan container")?;
    let handler = pod["containers"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["name"] == "handler"))
        .context("no handler container")?;
    if stem.starts_with("05") {
        ensure!(
            native.is_none() && regular.is_some(),
            "{stem}: capstan as a regular container"
        );
    } else {
        ensure!(native.is_some(), "{stem}: capstan as a native sidecar");
        ensure!(
            capstan["restartPolicy"] == "Always",
            "{stem}: native sidecar restartPolicy"
        );
    }
    for c in [capstan, handler] {
        let sc = &c["securityContext"];
        ensure!(
            sc["readOnlyRootFilesystem"] == true,
            "{stem}: read-only root filesystem"
        );
        ensure!(
            sc["allowPrivilegeEscalation"] == false,
            "{stem}: no privilege escalation"
        );
        ensure!(sc["capabilities"]["drop"] == json!(["ALL"]), "{stem}: drop ALL");
        ensure!(
            c["volumeMounts"]
                .as_array()
                .is_some_and(|m| m.iter().any(|m| m["mountPath"] == "/run/capstan")),
            "{stem}: the socket volume is shared"
        );
    }
    ensure!(
        pod["securityContext"]["runAsNonRoot"] == true,
        "{stem}: non-root pod"
    );
    // The API token: never automounted, projected into the capstan container only; the
    // handler container has its own identity's token only with handler.apiAccess.
    ensure!(
        pod["automountServiceAccountToken"] == false,
        "{stem}: the pod must not automount the controller's token"
    );
    let mount_at = |c: &Value, path: &str| -> Option<String> {
        c["volumeMounts"].as_array().and_then(|m| {
            m.iter()
                .find(|m| m["mountPath"] == path)
                .and_then(|m| m["name"].as_str().map(str::to_owned))
        })
    };
    let volume = |name: &str| -> Option<&Value> {
        pod["volumes"]
            .as_array()
            .and_then(|v| v.iter().find(|v| v["name"] == name))
    };
    let capstan_token = mount_at(capstan, TOKEN_PATH).context("no API token in the capstan container")?;
    let projected = volume(&capstan_token)
        .and_then(|v| v["projected"]["sources"].as_array())
        .context("the capstan token volume is not projected")?;
    ensure!(
        projected
            .iter()
            .any(|s| s["serviceAccountToken"]["path"] == "token")
            && projected
                .iter()
                .any(|s| s["configMap"]["name"] == "kube-root-ca.crt")
            && projected
                .iter()
                .any(|s| s["downwardAPI"]["items"][0]["fieldRef"]["fieldPath"] == "metadata.namespace"),
        "{stem}: the projected volume holds token, ca.crt and namespace: {projected:?}"
    );
    match mount_at(handler, TOKEN_PATH) {
        None => ensure!(
            !stem.starts_with("07"),
            "{stem}: the handler's own token is missing"
        ),
        Some(name) => {
            ensure!(
                stem.starts_with("07"),
                "{stem}: the handler container gets an API token"
            );
            ensure!(
                name != capstan_token,
                "{stem}: the handler gets the controller's token"
            );
            // An in-memory volume the controller fills with expiring tokens of the handler's
            // own ServiceAccount; no token Secret (which never expires).
            ensure!(
                volume(&name).is_some_and(|v| v["emptyDir"]["medium"] == "Memory"),
                "{stem}: the handler's identity volume: {:?}",
                volume(&name)
            );
            ensure!(
                mount_at(capstan, "/run/capstan-handler-identity").as_deref() == Some(name.as_str()),
                "{stem}: the controller writes the handler's identity"
            );
            ensure!(
                lookup(&env_of(capstan), "CAPSTAN_HANDLER_IDENTITY")
                    == Some(
                        format!(
                            "{ns}/{}-handler",
                            workload["metadata"]["name"].as_str().unwrap_or_default()
                        )
                        .as_str()
                    ),
                "{stem}: the handler's ServiceAccount"
            );
            ensure!(
                !objs
                    .iter()
                    .any(|o| o["kind"] == "Secret" && o["type"] == "kubernetes.io/service-account-token"),
                "{stem}: a token Secret that never expires"
            );
            let token_role = find(objs, "Role")
                .into_iter()
                .find(|r| {
                    r["metadata"]["name"]
                        .as_str()
                        .is_some_and(|n| n.ends_with("-handler-token"))
                })
                .context("the Role to request the handler's tokens")?;
            ensure!(
                token_role["rules"]
                    == json!([{"apiGroups": [""], "resources": ["serviceaccounts/token"],
                               "resourceNames": [format!("{}-handler", workload["metadata"]["name"].as_str().unwrap_or_default())],
                               "verbs": ["create"]}]),
                "{stem}: tokens of the handler's account only: {token_role}"
            );
        }
    }
    let policies = find(objs, "NetworkPolicy");
    ensure!(policies.len() == 1, "{stem}: a NetworkPolicy by default");
    let ingress = policies[0]["spec"]["ingress"]
        .as_array()
        .context("NetworkPolicy ingress rules")?;
    // With admission webhooks the API server must reach the webhook port too.
    let webhooks = stem.starts_with("08");
    ensure!(
        ingress.len() == 1 + usize::from(webhooks)
            && ingress[0]["ports"] == json!([{"port": "admin", "protocol": "TCP"}])
            && (!webhooks || ingress[1]["ports"] == json!([{"port": "webhook", "protocol": "TCP"}])),
        "{stem}: only the admin port (and the webhook port) is reachable: {ingress:?}"
    );
    ensure!(
        capstan["livenessProbe"]["httpGet"]["path"] == "/healthz",
        "{stem}: liveness probe"
    );
    ensure!(
        capstan["readinessProbe"]["httpGet"]["path"] == "/readyz",
        "{stem}: readiness probe"
    );
    ensure!(
        capstan["livenessProbe"]["httpGet"]["port"] == "admin",
        "{stem}: probes on the admin port"
    );
    let cenv = env_of(capstan);
    let henv = env_of(handler);
    ensure!(lookup(&henv, "CAPSTAN_ENDPOINT") == Some("unix:///run/capstan/capstan.sock"));
    ensure!(lookup(&cenv, "CAPSTAN_LISTEN") == Some("unix:///run/capstan/capstan.sock"));

    let all_cluster_roles = find(objs, "ClusterRole");
    let crd_watch = all_cluster_roles
        .iter()
        .filter(|r| {
            r["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.ends_with("-crds"))
        })
        .count();
    ensure!(
        crd_watch == 1,
        "{stem}: a ClusterRole to watch CRDs (rbac.watchCrds)"
    );
    let cluster_roles: Vec<_> = all_cluster_roles
        .into_iter()
        .filter(|r| {
            !r["metadata"]["name"]
                .as_str()
                .is_some_and(|n| n.ends_with("-crds"))
        })
        .collect();
    let roles = find(objs, "Role");
    let all_rules: Vec<&Value> = cluster_roles
        .iter()
        .chain(roles.iter())
        .flat_map(|r| r["rules"].as_array().into_iter().flatten())
        .collect();
    for rule in &all_rules {
        for field in ["apiGroups", "resources", "verbs"] {
            ensure!(
                !rule[field].as_array().is_some_and(|v| v.iter().any(|x| x == "*")),
                "{stem}: wildcard in {rule}"
            );
        }
    }
    let has_rule = |resource: &str, verb: &str| {
        all_rules.iter().any(|r| {
            r["resources"]
                .as_array()
                .is_some_and(|v| v.iter().any(|x| x == resource))
                && r["verbs"].as_array().is_some_and(|v| v.iter().any(|x| x == verb))
        })
    };
    for verb in ["get", "list", "watch", "patch"] {
        ensure!(has_rule("examples", verb), "{stem}: examples {verb}");
    }
    ensure!(
        has_rule("examples/status", "patch"),
        "{stem}: examples/status patch"
    );
    ensure!(has_rule("events", "create"), "{stem}: events create");

    match stem.get(..2).unwrap_or_default() {
        "01" | "05" | "06" => {
            ensure!(workload["kind"] == "Deployment" && workload["spec"]["replicas"] == 1);
            ensure!(
                workload["spec"]["strategy"]["type"] == "Recreate",
                "{stem}: Recreate"
            );
            ensure!(lookup(&cenv, "CAPSTAN_FINALIZERS") == Some("true"));
            ensure!(lookup(&cenv, "CAPSTAN_STANDALONE") == Some("true"));
            ensure!(lookup(&cenv, "CAPSTAN_LEADER_ELECTION") == Some("false"));
            ensure!(
                lookup(&cenv, "CAPSTAN_NAMESPACES").is_none(),
                "{stem}: cluster-wide"
            );
            ensure!(
                cluster_roles.len() == 1 && roles.is_empty(),
                "{stem}: one ClusterRole"
            );
            ensure!(!has_rule("leases", "get") && !has_rule("nodes", "watch"));
        }
        "02" => {
            ensure!(workload["kind"] == "DaemonSet", "{stem}: a DaemonSet");
            ensure!(lookup(&cenv, "CAPSTAN_NODE_NAME") == Some("fieldRef:spec.nodeName"));
            ensure!(lookup(&cenv, "CAPSTAN_NODE_CLEANUP") == Some("true"));
            ensure!(
                lookup(&cenv, "CAPSTAN_FINALIZERS") == Some("false"),
                "{stem}: no finalizers in per-node mode by default"
            );
            ensure!(has_rule("nodes", "watch"), "{stem}: node cleanup watches Nodes");
            ensure!(pod["tolerations"].as_array().is_some_and(|t| !t.is_empty()));
            ensure!(pod["nodeSelector"]["kubernetes.io/os"] == "linux");
        }
        "03" => {
            ensure!(workload["spec"]["replicas"] == 2);
            ensure!(workload["spec"]["strategy"]["type"] == "RollingUpdate");
            ensure!(lookup(&cenv, "CAPSTAN_LEADER_ELECTION") == Some("true"));
            ensure!(lookup(&cenv, "CAPSTAN_LEASE_NAMESPACE") == Some(ns));
            ensure!(lookup(&cenv, "CAPSTAN_LEASE_NAME").is_some());
            ensure!(lookup(&cenv, "CAPSTAN_PEERING").is_some());
            ensure!(
                lookup(&cenv, "CAPSTAN_STANDALONE").is_none(),
                "{stem}: standalone conflicts with peering"
            );
            ensure!(
                lookup(&cenv, "POD_NAME") == Some("fieldRef:metadata.name"),
                "{stem}: the peer id"
            );
            ensure!(lookup(&cenv, "CAPSTAN_PRIORITY") == Some("100"));
            let lease_role = roles
                .iter()
                .find(|r| r["metadata"]["namespace"] == ns)
                .context("a Role for leases in the release namespace")?;
            ensure!(lease_role["rules"][0]["resources"] == json!(["leases"]));
            ensure!(
                has_rule("clustercapstanpeerings", "patch"),
                "{stem}: peering RBAC"
            );
            ensure!(
                find(objs, "CustomResourceDefinition").len() == 2,
                "{stem}: peering CRDs"
            );
            ensure!(find(objs, "PodDisruptionBudget").len() == 1, "{stem}: a PDB");
        }
        "10" => {
            ensure!(workload["spec"]["replicas"] == 3);
            ensure!(workload["spec"]["strategy"]["type"] == "RollingUpdate");
            ensure!(lookup(&cenv, "CAPSTAN_SHARDING") == Some("true"));
            ensure!(lookup(&cenv, "CAPSTAN_SHARDING_SETTLE") == Some("6s"));
            ensure!(lookup(&cenv, "CAPSTAN_LEADER_ELECTION") == Some("false"));
            ensure!(lookup(&cenv, "CAPSTAN_LEASE_NAMESPACE") == Some(ns));
            ensure!(
                lookup(&cenv, "POD_NAME") == Some("fieldRef:metadata.name"),
                "{stem}: the member's identity"
            );
            let role = roles
                .iter()
                .find(|r| r["metadata"]["namespace"] == ns)
                .context("a Role for member Leases in the release namespace")?;
            ensure!(role["rules"][0]["resources"] == json!(["leases"]));
            ensure!(
                role["rules"][0]["verbs"] == json!(["get", "list", "create", "update", "delete"]),
                "{stem}: member Lease verbs: {}",
                role["rules"][0]["verbs"]
            );
            ensure!(find(objs, "PodDisruptionBudget").len() == 1, "{stem}: a PDB");
        }
        "04" => {
            ensure!(
                cluster_roles.is_empty(),
                "{stem}: no ClusterRole with namespaced RBAC"
            );
            let namespaces: BTreeSet<&str> = roles
                .iter()
                .filter_map(|r| r["metadata"]["namespace"].as_str())
                .collect();
            ensure!(
                namespaces == BTreeSet::from(["capstan-ci-team-a", "capstan-ci-team-b"]),
                "{stem}: Roles in the watched namespaces, got {namespaces:?}"
            );
            ensure!(find(objs, "RoleBinding").len() == 2);
            ensure!(lookup(&cenv, "CAPSTAN_NAMESPACES") == Some("capstan-ci-team-a,capstan-ci-team-b"));
            ensure!(has_rule("capstanpeerings", "patch") && !has_rule("clustercapstanpeerings", "patch"));
            ensure!(has_rule("configmaps", "create"), "{stem}: extra rules");
        }
        "07" => {
            ensure!(lookup(&cenv, "CAPSTAN_PERSISTENCE") == Some("kopf"));
            ensure!(
                lookup(&cenv, "CAPSTAN_PERSISTENCE_PREFIX").is_none(),
                "{stem}: kopf's prefix comes with --persistence kopf"
            );
            let handler_role = cluster_roles
                .iter()
                .find(|r| {
                    r["metadata"]["name"]
                        .as_str()
                        .is_some_and(|n| n.ends_with("-handler"))
                })
                .context("the handler's ClusterRole")?;
            ensure!(handler_role["rules"][0]["resources"] == json!(["configmaps"]));
            let operator_rules: Vec<&Value> = cluster_roles
                .iter()
                .filter(|r| {
                    !r["metadata"]["name"]
                        .as_str()
                        .is_some_and(|n| n.ends_with("-handler"))
                })
                .flat_map(|r| r["rules"].as_array().into_iter().flatten())
                .collect();
            ensure!(
                !operator_rules
                    .iter()
                    .any(|r| r["resources"] == json!(["configmaps"])),
                "{stem}: the handler's rules are not the controller's"
            );
            let from = &find(objs, "NetworkPolicy")[0]["spec"]["ingress"][0]["from"];
            ensure!(
                from.as_array().is_some_and(|f| f.len() == 2)
                    && from[1]["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
                        == "monitoring",
                "{stem}: networkPolicy.adminFrom: {from}"
            );
        }
        _ => {}
    }
    if stem.starts_with("06") {
        let services = find(objs, "Service");
        ensure!(
            services
                .iter()
                .filter(|s| s["metadata"]["name"]
                    .as_str()
                    .is_some_and(|n| n.ends_with("-metrics")))
                .count()
                == 1,
            "{stem}: the metrics Service"
        );
        ensure!(
            find(objs, "ServiceMonitor").len() == 1,
            "{stem}: the ServiceMonitor"
        );
    }
    Ok(())
}

#[tokio::test]
async fn every_rendered_manifest_applies_to_a_real_api_server() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_crd(SERVICE_MONITOR_CRD, "servicemonitors.monitoring.coreos.com")
        .await?;
    for (i, file) in ci_values_files()?.into_iter().enumerate() {
        let stem = stem(&file);
        let ns = format!("chart-ci-{i}");
        let manifests = Render {
            release: &format!("ci{i}"),
            namespace: &ns,
            values: vec![file.clone()],
            ..Render::default()
        }
        .manifests()
        .await?;
        ensure_namespace(&env, &ns).await?;
        for other in namespaces_of(&manifests) {
            ensure_namespace(&env, &other).await?;
        }
        let path = scratch_file(&env, &stem, &manifests)?;
        let path = path.to_string_lossy();
        let dry = env
            .kubectl_ok(&["apply", "--dry-run=server", "-o", "json", "-f", &path])
            .await
            .with_context(|| format!("server-side dry run of {stem}"))?;
        let objs = objects(&dry)?;
        ensure!(
            objs.len() == documents(&manifests).len(),
            "{stem}: {} documents, {} objects",
            documents(&manifests).len(),
            objs.len()
        );
        check_ci_objects(&stem, &ns, &objs).with_context(|| format!("checking {stem}"))?;
        env.kubectl_ok(&["apply", "-f", &path])
            .await
            .with_context(|| format!("applying {stem}"))?;
        let kind = if manifests.contains("kind: DaemonSet") {
            "daemonset"
        } else {
            "deployment"
        };
        env.kubectl_ok(&["get", "-n", &ns, kind, &format!("ci{i}-capstan")])
            .await?;
    }
    // `helm install` of both modes, as the README shows, prints the notes; uninstall is clean.
    let chart = helm::chart_dir().to_string_lossy().into_owned();
    let kubeconfig = env.kubeconfig.to_string_lossy().into_owned();
    for (release, file, expected) in [
        ("deploy", ci_file("01")?, "as a Deployment (1 replica)"),
        (
            "pernode",
            ci_file("02")?,
            "as a DaemonSet (one operator per node)",
        ),
    ] {
        let values = file.to_string_lossy();
        let ns = format!("helm-{release}");
        let out = helm::run(&[
            "install",
            release,
            &chart,
            "--kubeconfig",
            &kubeconfig,
            "--namespace",
            &ns,
            "--create-namespace",
            "--values",
            &values,
        ])
        .await?;
        ensure!(out.success, "helm install {release} failed:\n{}", out.stderr);
        ensure!(
            out.stdout.contains(expected) && out.stdout.contains("CAPSTAN_ENDPOINT"),
            "helm install {release} printed unexpected notes:\n{}",
            out.stdout
        );
        let out = helm::run(&[
            "uninstall",
            release,
            "--kubeconfig",
            &kubeconfig,
            "--namespace",
            &ns,
        ])
        .await?;
        ensure!(out.success, "helm uninstall {release} failed:\n{}", out.stderr);
    }

    // The peering CRDs accept kopf-style peering objects.
    env.kubectl_ok(&[
        "wait",
        "--for=condition=Established",
        "crd/clustercapstanpeerings.capstan.dev",
    ])
    .await?;
    env.apply(
        r#"
apiVersion: capstan.dev/v1
kind: ClusterCapstanPeering
metadata:
  name: default
status:
  capstan-ops-7d9f-1234:
    priority: 100
    lifetime: 60
    lastseen: "2026-01-01T00:00:00Z"
"#,
    )
    .await?;
    let peering = env
        .kubectl_ok(&["get", "clustercapstanpeering", "default", "-o", "json"])
        .await?;
    let peering: Value = serde_json::from_str(&peering)?;
    ensure!(peering["status"]["capstan-ops-7d9f-1234"]["priority"] == 100);
    env.stop().await
}

/// The chart's RBAC for the example resource, for release `release` in namespace `ns`.
async fn example_rbac(release: &str, ns: &str) -> Result<String> {
    Render {
        release,
        namespace: ns,
        set: EXAMPLE_RESOURCE.to_vec(),
        show_only: vec!["templates/serviceaccount.yaml", "templates/rbac.yaml"],
        ..Render::default()
    }
    .manifests()
    .await
}

/// `kubectl auth can-i` as the impersonated user of `kubeconfig`.
async fn can_i(env: &TestEnv, kubeconfig: &std::path::Path, verb: &str, resource: &str) -> Result<bool> {
    let out = env
        .kubectl()
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["auth", "can-i", verb, resource, "--namespace", "apps"])
        .output()
        .await?;
    Ok(String::from_utf8_lossy(&out.stdout).trim() == "yes")
}

/// Every request of the controller (user agent `capstan/…`) in the audit log was made as
/// `user`, and none was refused.
fn every_request_was_made_as_and_allowed(env: &TestEnv, user: &str) -> Result<()> {
    let requests: Vec<Value> = env
        .audit_events()?
        .into_iter()
        .filter(|e| e["stage"] == "ResponseComplete")
        .filter(|e| {
            e["userAgent"]
                .as_str()
                .is_some_and(|ua| ua.starts_with("capstan/"))
        })
        .collect();
    ensure!(
        !requests.is_empty(),
        "no requests of the controller in the audit log"
    );
    for e in &requests {
        ensure!(
            e["impersonatedUser"]["username"] == user,
            "a request not made as {user}: {e}"
        );
        ensure!(
            e["responseStatus"]["code"] != 403,
            "the controller was refused {} {}: {e}",
            e["verb"],
            e["requestURI"]
        );
    }
    Ok(())
}

/// `kubectl auth can-i` as `user` (through `kubeconfig`) answers as `expected` says for each
/// (verb, resource, allowed).
async fn permissions_are(
    env: &TestEnv,
    kubeconfig: &std::path::Path,
    user: &str,
    expected: &[(&str, &str, bool)],
) -> Result<()> {
    for &(verb, resource, allowed) in expected {
        ensure!(
            can_i(env, kubeconfig, verb, resource).await? == allowed,
            "{user} can{} {verb} {resource}",
            if allowed { "not" } else { "" }
        );
    }
    Ok(())
}

#[tokio::test]
async fn the_charts_rbac_is_enough_for_a_full_cycle_and_fails_clearly_without_patch() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let ns = "capstan-system";
    ensure_namespace(&env, ns).await?;
    ensure_namespace(&env, "apps").await?;
    env.apply(&example_rbac("ops", ns).await?).await?;
    let user = format!("system:serviceaccount:{ns}:ops-capstan");
    let kubeconfig = impersonating_kubeconfig(&env, &user).await?;

    // Exactly the chart's permissions: what the operator needs, nothing else.
    permissions_are(
        &env,
        &kubeconfig,
        &user,
        &[
            ("list", "examples.demo.capstan.dev", true),
            ("watch", "examples.demo.capstan.dev", true),
            ("patch", "examples.demo.capstan.dev", true),
            ("get", "examples.demo.capstan.dev", true),
            ("patch", "examples.demo.capstan.dev/status", true),
            ("create", "events", true),
            ("create", "examples.demo.capstan.dev", false),
            ("delete", "examples.demo.capstan.dev", false),
            ("update", "examples.demo.capstan.dev", false),
            ("list", "secrets", false),
            ("get", "configmaps", false),
            ("create", "leases.coordination.k8s.io", false),
        ],
    )
    .await?;

    let mut s = Scenario::attach(env, &kubeconfig, "create,update,delete", &[], "apps").await?;

    // A full create/update/delete cycle with exactly the chart's permissions.
    s.create("one", json!({"field": "a", "size": 1})).await?;
    s.wait("one", T, "created and handled", |o| {
        has_finalizer(o) && annotation(o, "capstan.dev/last-handled-configuration").is_some()
    })
    .await?;
    ensure!(s.count("create_fn", "one") == 1);
    s.patch("one", json!({"spec": {"size": 2}})).await?;
    let obj = s
        .wait("one", T, "update handled", |o| {
            o.pointer("/status/update_fn/message").is_some()
        })
        .await?;
    ensure!(obj["status"]["update_fn"]["message"] == "hello one");
    s.delete("one").await?;
    s.wait_gone("one", T).await?;
    ensure!(s.count("delete_fn", "one") == 1, "calls: {:?}", s.calls());

    every_request_was_made_as_and_allowed(&s.env, &user)?;
    let writes = s.writes("one");
    ensure!(
        writes.iter().any(|w| w == "patch") && writes.iter().any(|w| w == "patch/status"),
        "the cycle wrote the object and its status: {writes:?}"
    );

    // Without `patch` on the resource, handling fails with a clear error in capstan's log.
    let role = s
        .env
        .kubectl_ok(&["get", "clusterrole", "ops-capstan", "-o", "json"])
        .await?;
    let mut role: Value = serde_json::from_str(&role)?;
    for rule in role["rules"].as_array_mut().into_iter().flatten() {
        if rule["resources"] == json!(["examples"])
            && let Some(verbs) = rule["verbs"].as_array_mut()
        {
            verbs.retain(|v| v != "patch");
        }
    }
    let path = scratch_file(&s.env, "role-without-patch", &role.to_string())?;
    s.env
        .kubectl_ok(&["replace", "-f", &path.to_string_lossy()])
        .await?;
    let deadline = tokio::time::Instant::now() + T;
    while can_i(&s.env, &kubeconfig, "patch", "examples.demo.capstan.dev").await? {
        ensure!(tokio::time::Instant::now() < deadline, "patch is still allowed");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    s.create("two", json!({"field": "b", "size": 1})).await?;
    let deadline = tokio::time::Instant::now() + T;
    let line = loop {
        let log = s.controller.process.output();
        if let Some(line) = log
            .lines()
            .find(|l| l.contains("two") && l.contains("forbidden") && l.contains("patch"))
        {
            break line.to_owned();
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "no clear `forbidden` error about patching `two` in capstan's log:\n{}",
                tail(&log, 40)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    ensure!(line.contains("examples"), "the error names the resource: {line}");
    println!("capstan's error without `patch`: {line}");
    let two = s.get("two").await?.context("two is gone")?;
    ensure!(
        !has_finalizer(&two) && annotation(&two, "capstan.dev/last-handled-configuration").is_none(),
        "nothing was written to two: {two}"
    );
    ensure!(
        s.controller.process.running(),
        "capstan keeps running and retries"
    );

    s.handler.terminate().await?;
    s.controller.process.terminate().await?;
    s.env.stop().await
}

#[tokio::test]
async fn the_chart_configures_capstan_with_the_variables_and_crds_of_the_binary() -> Result<()> {
    let bin = capstan_tests::process::capstan_binary().await?;
    let help = tokio::process::Command::new(&bin)
        .args(["run", "--help"])
        .output()
        .await?;
    ensure!(help.status.success(), "capstan run --help failed");
    let help = String::from_utf8_lossy(&help.stdout);
    let known: BTreeSet<&str> = help
        .split("[env: ")
        .skip(1)
        .filter_map(|s| s.split('=').next())
        .collect();
    ensure!(known.contains("CAPSTAN_LISTEN"), "no env variables in:\n{help}");
    let mut set = BTreeSet::new();
    let mut renders = Vec::new();
    for file in ci_values_files()? {
        renders.push(Render {
            release: "ci",
            namespace: "ops",
            values: vec![file],
            set: vec!["crds.enabled=true", "capstan.persistencePrefix=example.com"],
            ..Render::default()
        });
    }
    for render in renders {
        let out = render.manifests().await?;
        for line in out.lines() {
            if let Some(name) = line.trim().strip_prefix("- name: CAPSTAN_") {
                set.insert(format!("CAPSTAN_{name}"));
            }
        }
        // The peering CRDs are the ones `capstan crds` prints.
        let crds = std::fs::read_to_string(
            capstan_tests::testenv::repo_root().join("controller/crds/peering.yaml"),
        )?;
        for line in crds.lines().map(str::trim).filter(|l| {
            ["group:", "scope:", "kind:", "plural:", "singular:", "shortNames:"]
                .iter()
                .any(|k| l.starts_with(k))
        }) {
            if line.starts_with("kind:") && !line.contains("Peering") {
                continue;
            }
            ensure!(
                out.contains(line),
                "the chart's peering CRDs lack `{line}` of controller/crds/peering.yaml"
            );
        }
    }
    set.remove("CAPSTAN_ENDPOINT"); // the SDK's variable, in the handler container
    for name in &set {
        ensure!(
            known.contains(name.as_str()),
            "the chart sets {name}, which `capstan run` does not know"
        );
    }
    for name in [
        "CAPSTAN_LEADER_ELECTION",
        "CAPSTAN_LEASE_NAME",
        "CAPSTAN_LEASE_NAMESPACE",
        "CAPSTAN_PEERING",
        "CAPSTAN_PRIORITY",
        "CAPSTAN_STANDALONE",
        "CAPSTAN_NAMESPACES",
        "CAPSTAN_NODE_NAME",
        "CAPSTAN_FINALIZERS",
        "CAPSTAN_PERSISTENCE",
        "CAPSTAN_PERSISTENCE_PREFIX",
    ] {
        ensure!(set.contains(name), "no values file exercises {name}");
    }
    Ok(())
}

#[tokio::test]
async fn the_daemonset_rbac_lets_a_node_operator_handle_objects_and_clean_up_after_nodes() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let ns = "capstan-system";
    ensure_namespace(&env, ns).await?;
    ensure_namespace(&env, "apps").await?;
    let mut set = EXAMPLE_RESOURCE.to_vec();
    set.push("mode=daemonset");
    let rbac = Render {
        release: "agent",
        namespace: ns,
        set,
        show_only: vec!["templates/serviceaccount.yaml", "templates/rbac.yaml"],
        ..Render::default()
    }
    .manifests()
    .await?;
    env.apply(&rbac).await?;
    for node in ["node-a", "node-b"] {
        env.apply(&format!(
            "apiVersion: v1\nkind: Node\nmetadata:\n  name: {node}\n"
        ))
        .await?;
    }
    let user = format!("system:serviceaccount:{ns}:agent-capstan");
    let kubeconfig = impersonating_kubeconfig(&env, &user).await?;
    permissions_are(
        &env,
        &kubeconfig,
        &user,
        &[
            ("watch", "nodes", true),
            ("list", "nodes", true),
            ("patch", "nodes", false),
            ("delete", "nodes", false),
        ],
    )
    .await?;

    // As the chart runs it on node-a (standalone, the node name from the Downward API).
    let mut s = Scenario::attach(
        env,
        &kubeconfig,
        "create",
        &["--node-name", "node-a", "--standalone"],
        "apps",
    )
    .await?;
    // node-b's operator handled the object before its node went away.
    s.create_with(
        "one",
        json!({}),
        json!({"annotations": {"node-b.capstan.dev/last-handled-configuration": "{}",
                               "node-b.capstan.dev/kopf-managed": "yes"}}),
    )
    .await?;
    s.wait("one", T, "handled on node-a", |o| {
        annotation(o, "node-a.capstan.dev/last-handled-configuration").is_some()
    })
    .await?;
    ensure!(s.count("create_fn", "one") == 1);
    s.env
        .kubectl_ok(&["delete", "node", "node-b", "--wait=false"])
        .await?;
    s.wait("one", T, "node-b's state removed", |o| {
        annotation(o, "node-b.capstan.dev/last-handled-configuration").is_none()
            && annotation(o, "node-b.capstan.dev/kopf-managed").is_none()
    })
    .await?;
    every_request_was_made_as_and_allowed(&s.env, &user)?;
    s.handler.terminate().await?;
    s.controller.process.terminate().await?;
    s.env.stop().await
}

#[tokio::test]
async fn the_rbac_for_leader_election_and_peering_is_enough_to_lead_and_peer() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let ns = "capstan-system";
    ensure_namespace(&env, ns).await?;
    ensure_namespace(&env, "apps").await?;
    let mut set = EXAMPLE_RESOURCE.to_vec();
    set.extend([
        "leaderElection.enabled=true",
        "peering.enabled=true",
        "peering.priority=100",
        "crds.enabled=true",
    ]);
    let manifests = Render {
        release: "ha",
        namespace: ns,
        set,
        show_only: vec![
            "templates/serviceaccount.yaml",
            "templates/rbac.yaml",
            "templates/crd-peering.yaml",
        ],
        ..Render::default()
    }
    .manifests()
    .await?;
    env.apply_crds(
        &manifests,
        &[
            "capstanpeerings.capstan.dev",
            "clustercapstanpeerings.capstan.dev",
        ],
    )
    .await?;
    let user = format!("system:serviceaccount:{ns}:ha-capstan");
    let kubeconfig = impersonating_kubeconfig(&env, &user).await?;

    // As the chart runs it: elected on the release's Lease, in the release's peering group.
    let args = [
        "--leader-election",
        "--lease-name",
        "ha-capstan",
        "--lease-namespace",
        ns,
        "--peering",
        "ha-capstan",
        "--priority",
        "100",
    ];
    let mut s = Scenario::attach(env, &kubeconfig, "create", &args, "apps").await?;
    s.controller
        .process
        .wait_for("became the leader", Duration::from_secs(30))
        .await?;
    s.create("one", json!({})).await?;
    s.wait("one", T, "handled by the leader", |o| {
        annotation(o, "capstan.dev/last-handled-configuration").is_some()
    })
    .await?;
    let peering = s
        .env
        .kubectl_ok(&[
            "get",
            "clustercapstanpeering",
            "ha-capstan",
            "-o",
            "jsonpath={.status}",
        ])
        .await?;
    let peers: Value = serde_json::from_str(&peering)?;
    ensure!(
        peers
            .as_object()
            .is_some_and(|p| p.values().any(|e| e["priority"] == 100)),
        "the operator is not in its peering group: {peering}"
    );
    s.env
        .kubectl_ok(&["get", "lease", "ha-capstan", "-n", ns])
        .await?;
    every_request_was_made_as_and_allowed(&s.env, &user)?;
    s.handler.terminate().await?;
    s.controller.process.terminate().await?;
    s.env.stop().await
}

#[tokio::test]
async fn three_sharded_replicas_run_with_the_charts_rbac() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let ns = "capstan-system";
    ensure_namespace(&env, ns).await?;
    ensure_namespace(&env, "apps").await?;
    let mut set = EXAMPLE_RESOURCE.to_vec();
    set.extend(["sharding.enabled=true", "replicas=3"]);
    let manifests = Render {
        release: "sh",
        namespace: ns,
        set,
        show_only: vec![
            "templates/serviceaccount.yaml",
            "templates/rbac.yaml",
            "templates/deployment.yaml",
        ],
        ..Render::default()
    }
    .manifests()
    .await?;
    let objs: Vec<Value> = documents(&manifests)
        .iter()
        .filter(|d| !d.trim().is_empty())
        .map(|d| serde_saphyr::from_str(d))
        .collect::<Result<_, _>>()?;
    let deployment = find(&objs, "Deployment");
    let deployment = deployment.first().context("a Deployment")?;
    ensure!(
        deployment["spec"]["replicas"] == 3,
        "replicas: {}",
        deployment["spec"]["replicas"]
    );
    ensure!(
        deployment["spec"]["strategy"]["type"] == "RollingUpdate",
        "a sharded Deployment rolls: {}",
        deployment["spec"]["strategy"]
    );
    let capstan = deployment["spec"]["template"]["spec"]["containers"]
        .as_array()
        .into_iter()
        .chain(deployment["spec"]["template"]["spec"]["initContainers"].as_array())
        .flatten()
        .find(|c| c["name"] == "capstan")
        .context("the capstan container")?;
    let env_vars = env_of(capstan);
    ensure!(lookup(&env_vars, "CAPSTAN_SHARDING") == Some("true"));
    ensure!(lookup(&env_vars, "CAPSTAN_LEASE_NAME") == Some("sh-capstan"));
    ensure!(lookup(&env_vars, "CAPSTAN_LEADER_ELECTION") == Some("false"));
    let rbac: String = documents(&manifests)
        .into_iter()
        .filter(|doc| !doc.contains("kind: Deployment"))
        .collect::<Vec<_>>()
        .join("\n---\n");
    env.apply(&rbac).await?;
    let user = format!("system:serviceaccount:{ns}:sh-capstan");
    let kubeconfig = impersonating_kubeconfig(&env, &user).await?;

    // As the chart runs them: three members of the release's ring.
    let args = |id: &'static str| {
        vec![
            "--sharding",
            "--lease-name",
            "sh-capstan",
            "--lease-namespace",
            ns,
            "--peer-id",
            id,
        ]
    };
    let mut s = Scenario::attach(env, &kubeconfig, "create", &args("sh-0"), "apps").await?;
    let mut others = Vec::new();
    for id in ["sh-1", "sh-2"] {
        let mut controller = Controller::start_with(&s.env, &kubeconfig, id, &args(id)).await?;
        let handler = start_handler(
            &s.env,
            &format!("{id}-handler"),
            &controller.endpoint(),
            &[
                ("E2E_HANDLERS", "create"),
                (
                    "E2E_LOG",
                    &s.env.scratch().join(format!("{id}.log")).to_string_lossy(),
                ),
            ],
        )?;
        controller
            .process
            .wait_for("handler process connected", Duration::from_secs(60))
            .await?;
        others.push((controller, handler));
    }
    for (controller, _) in &mut others {
        controller
            .process
            .wait_for("the ring is settled", Duration::from_secs(30))
            .await?;
    }
    for i in 0..6 {
        s.create(&format!("obj-{i}"), json!({})).await?;
    }
    for i in 0..6 {
        s.wait(&format!("obj-{i}"), T, "handled by its member", |o| {
            annotation(o, "capstan.dev/last-handled-configuration").is_some()
        })
        .await?;
    }
    let leases = s
        .env
        .kubectl_ok(&[
            "get",
            "leases",
            "-n",
            ns,
            "-l",
            "capstan.dev/ring=sh-capstan",
            "-o",
            "name",
        ])
        .await?;
    ensure!(leases.lines().count() == 3, "three member Leases: {leases}");
    every_request_was_made_as_and_allowed(&s.env, &user)?;
    for (mut controller, mut handler) in others {
        handler.terminate().await?;
        controller.process.terminate().await?;
    }
    s.handler.terminate().await?;
    s.controller.process.terminate().await?;
    s.env.stop().await
}

#[tokio::test]
async fn the_handler_gets_its_own_identity_and_none_of_the_controllers_rights() -> Result<()> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let ns = "capstan-system";
    ensure_namespace(&env, ns).await?;
    ensure_namespace(&env, "apps").await?;
    let render = |extra: &'static [&'static str]| {
        let mut set = EXAMPLE_RESOURCE.to_vec();
        set.extend_from_slice(extra);
        Render {
            release: "ops",
            namespace: ns,
            set,
            show_only: vec![
                "templates/serviceaccount.yaml",
                "templates/rbac.yaml",
                "templates/handler-rbac.yaml",
            ],
            ..Render::default()
        }
    };
    // By default there is no identity for the handler at all: nothing to render.
    let out = render(&[]).outcome().await?;
    ensure!(
        !out.success
            && out
                .stderr
                .contains("could not find template templates/handler-rbac.yaml"),
        "handler-rbac.yaml renders objects by default:\n{}{}",
        out.stdout,
        out.stderr
    );
    let manifests = render(&[
        "handler.apiAccess=true",
        "handler.rbac.rules[0].apiGroups={}",
        "handler.rbac.rules[0].resources={configmaps}",
        "handler.rbac.rules[0].verbs={get,create}",
    ])
    .manifests()
    .await?;
    env.apply(&manifests).await?;
    ensure!(
        !manifests.contains("kubernetes.io/service-account-token"),
        "a token Secret that never expires:\n{manifests}"
    );
    // The controller, with exactly the chart's rights, writes an expiring token of the
    // handler's ServiceAccount for the handler container.
    let controller_user = format!("system:serviceaccount:{ns}:ops-capstan");
    let controller = impersonating_kubeconfig(&env, &controller_user).await?;
    let identity = env.scratch().join("handler-identity");
    std::fs::create_dir_all(&identity)?;
    let account = format!("{ns}/ops-capstan-handler");
    let dir = identity.to_string_lossy().into_owned();
    let mut capstan = capstan_tests::process::Controller::spawn_with(
        &env,
        &controller,
        "capstan-identity",
        &["--handler-identity", &account, "--handler-identity-dir", &dir],
    )
    .await?;
    // The startup probe lets kubelet start the handler container: the token is there by the
    // time `/healthz` first answers.
    let deadline = tokio::time::Instant::now() + T;
    loop {
        if let Ok((200, _)) = capstan.admin_get("/healthz").await {
            break;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "/healthz never answered 200"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    ensure!(
        identity.join("token").exists(),
        "/healthz answered before the handler's token was written, so the handler container would start without it"
    );
    capstan
        .process
        .wait_for("the handler's identity is written", T)
        .await?;
    let token = std::fs::read_to_string(identity.join("token"))?;
    ensure!(std::fs::read_to_string(identity.join("namespace"))? == ns);
    let claims = jwt_claims(&token)?;
    let lifetime = claims["exp"].as_i64().unwrap_or(0) - claims["iat"].as_i64().unwrap_or(0);
    ensure!(
        claims["sub"] == format!("system:serviceaccount:{ns}:ops-capstan-handler")
            && (600..=3600).contains(&lifetime),
        "the handler's token is of its own account and expires within the hour: {claims}"
    );
    let as_handler = token_kubeconfig(&env, &token)?;
    let whoami = env
        .kubectl()
        .arg("--kubeconfig")
        .arg(&as_handler)
        .args(["auth", "whoami", "-o", "jsonpath={.status.userInfo.username}"])
        .output()
        .await?;
    ensure!(
        String::from_utf8_lossy(&whoami.stdout) == format!("system:serviceaccount:{ns}:ops-capstan-handler"),
        "the API server takes the token for the handler's account: {whoami:?}"
    );
    capstan.process.terminate().await?;
    // The controller may not mint tokens of any other account.
    ensure!(
        !env.kubectl()
            .arg("--kubeconfig")
            .arg(&controller)
            .args(["create", "token", "ops-capstan", "-n", ns])
            .output()
            .await?
            .status
            .success(),
        "the controller can request tokens of other accounts"
    );

    let handler_user = format!("system:serviceaccount:{ns}:ops-capstan-handler");
    let handler = impersonating_kubeconfig(&env, &handler_user).await?;
    permissions_are(
        &env,
        &handler,
        &handler_user,
        &[
            ("get", "configmaps", true),
            ("create", "configmaps", true),
            ("delete", "configmaps", false),
            ("list", "examples.demo.capstan.dev", false),
            ("patch", "examples.demo.capstan.dev", false),
            ("patch", "examples.demo.capstan.dev/status", false),
            ("create", "events", false),
            ("list", "secrets", false),
        ],
    )
    .await?;
    permissions_are(
        &env,
        &controller,
        &controller_user,
        &[
            ("patch", "examples.demo.capstan.dev", true),
            ("get", "configmaps", false),
            ("create", "configmaps", false),
        ],
    )
    .await?;
    env.stop().await
}

#[tokio::test]
async fn the_pod_mounts_the_api_token_into_the_capstan_container_only() -> Result<()> {
    for extra in [&[][..], &["nativeSidecar=false"][..], &["mode=daemonset"][..]] {
        let mut set = EXAMPLE_RESOURCE.to_vec();
        set.extend_from_slice(extra);
        let out = Render {
            release: "ops",
            namespace: "ops",
            set,
            show_only: vec![if extra.contains(&"mode=daemonset") {
                "templates/daemonset.yaml"
            } else {
                "templates/deployment.yaml"
            }],
            ..Render::default()
        }
        .manifests()
        .await?;
        ensure!(
            out.contains("automountServiceAccountToken: false"),
            "{extra:?}: the pod automounts the token:\n{out}"
        );
        ensure!(
            out.matches(TOKEN_PATH).count() == 1,
            "{extra:?}: exactly one container (capstan) mounts the API token:\n{out}"
        );
        // The mount sits in the capstan container, before the handler container starts.
        let capstan = out.find("- name: capstan\n").context("the capstan container")?;
        let handler = out.find("- name: handler\n").context("the handler container")?;
        let token = out.find(TOKEN_PATH).context("the token mount")?;
        ensure!(
            (capstan < token && (token < handler || handler < capstan)),
            "{extra:?}: the token is mounted into the handler container:\n{out}"
        );
    }
    Ok(())
}

#[tokio::test]
async fn the_chart_requires_kubernetes_1_29_for_native_sidecars() -> Result<()> {
    let chart = helm::chart_dir().to_string_lossy().into_owned();
    let old = helm::run(&[
        "template",
        "x",
        &chart,
        "--set",
        HANDLER_IMAGE,
        "--kube-version",
        "1.28.9",
    ])
    .await?;
    ensure!(
        !old.success && old.stderr.contains("kubeVersion"),
        "the chart installs on 1.28:\n{}",
        old.stderr
    );
    let new = helm::run(&[
        "template",
        "x",
        &chart,
        "--set",
        HANDLER_IMAGE,
        "--kube-version",
        "1.29.0",
    ])
    .await?;
    ensure!(new.success, "the chart refuses 1.29:\n{}", new.stderr);
    Ok(())
}

#[tokio::test]
async fn the_helm_test_hook_checks_health_and_a_connected_handler_process() -> Result<()> {
    // The hook: a Service and a Pod running `capstan check` in the capstan image, reachable
    // through the NetworkPolicy.
    let out = Render {
        release: "ops",
        namespace: "ops",
        set: EXAMPLE_RESOURCE.to_vec(),
        show_only: vec!["templates/tests/check.yaml", "templates/networkpolicy.yaml"],
        ..Render::default()
    }
    .manifests()
    .await?;
    ensure!(out.matches("helm.sh/hook: test").count() == 2, "{out}");
    ensure!(
        out.contains("image: \"ghcr.io/capstan-dev/capstan:0.1.0\"")
            && out.contains("- check\n")
            && out.contains("\"http://ops-capstan-check.ops.svc:8080\""),
        "the test pod runs `capstan check` in the capstan image:\n{out}"
    );
    ensure!(
        out.contains("app.kubernetes.io/component: helm-test") && out.contains("kind: NetworkPolicy"),
        "the NetworkPolicy lets the test pod in:\n{out}"
    );

    // `capstan check` against a real controller: passes with a handler process connected,
    // fails saying so without one.
    let mut s = Scenario::start("create", &[]).await?;
    let bin = capstan_tests::process::capstan_binary().await?;
    let admin = format!("http://{}", s.controller.admin);
    let check = |timeout: &'static str| {
        let mut cmd = tokio::process::Command::new(&bin);
        cmd.args(["check", "--admin", &admin, "--timeout", timeout]);
        cmd
    };
    let passed = check("60s").output().await?;
    ensure!(
        passed.status.success(),
        "capstan check failed with a handler connected:\n{}",
        String::from_utf8_lossy(&passed.stderr)
    );
    let report = String::from_utf8_lossy(&passed.stdout);
    ensure!(report.contains("handler processes connected: 1"), "{report}");
    s.handler.kill().await?;
    let failed = check("3s").output().await?;
    let stderr = String::from_utf8_lossy(&failed.stderr);
    ensure!(
        !failed.status.success() && stderr.contains("no handler process is connected"),
        "capstan check passed without a handler process:\n{stderr}"
    );
    s.controller.process.terminate().await?;
    s.env.stop().await
}

/// The DaemonSet of a render.
fn daemonset_of(out: &str) -> Result<String> {
    documents(out)
        .into_iter()
        .find(|d| d.contains("kind: DaemonSet"))
        .context("no DaemonSet")
}

#[tokio::test]
async fn node_local_storage_is_a_directory_per_release_and_shared_paths_are_refused() -> Result<()> {
    let render = |release: &'static str, namespace: &'static str, set: Vec<&'static str>| async move {
        let mut all = vec![
            "mode=daemonset",
            "daemonset.nodeStorage.enabled=true",
            HANDLER_IMAGE,
        ];
        all.extend(set);
        Render {
            release,
            namespace,
            set: all,
            ..Render::default()
        }
        .outcome()
        .await
    };
    // Each release its own directory: hostPath, mount, flag, claim and the prepare step's.
    for (release, namespace) in [("one", "ops"), ("two", "ops"), ("one", "apps")] {
        let out = render(release, namespace, vec![]).await?;
        ensure!(out.success, "{}", out.stderr);
        let daemonset = daemonset_of(&out.stdout)?;
        let dir = format!("/var/lib/capstan/{namespace}/{release}");
        ensure!(
            daemonset.contains(&format!("path: \"{dir}\""))
                && daemonset.matches(&format!("mountPath: \"{dir}\"")).count() == 2,
            "{dir}: the hostPath, mounted at its own path in capstan and prepare-storage:\n{daemonset}"
        );
        ensure!(
            daemonset.contains(&format!("value: \"file:{dir}\""))
                && daemonset.contains("name: CAPSTAN_NODE_STORAGE_CLAIM")
                && daemonset.contains(&format!("value: \"{namespace}/{release}\"")),
            "{dir}: the flag and the claim:\n{daemonset}"
        );
        let prepare = &daemonset[daemonset
            .find("- name: prepare-storage")
            .context("prepare-storage")?..];
        ensure!(
            prepare.contains(&format!("- \"{dir}\""))
                && prepare.contains("- --claim")
                && prepare.contains(&format!("- \"{namespace}/{release}\"")),
            "{dir}: prepare-storage claims the release's directory:\n{prepare}"
        );
    }
    // A directory the node shares, or not a plain absolute path: refused.
    for path in ["/var/lib", "/tmp", "/", "/var/lib/capstan/../x", "relative"] {
        let set = format!("daemonset.nodeStorage.path={path}");
        let out = render("one", "ops", vec![Box::leak(set.into_boxed_str())]).await?;
        ensure!(
            !out.success
                && (out.stderr.contains("is shared with the rest of the node")
                    || out.stderr.contains("/daemonset/nodeStorage/path")),
            "{path} is accepted:\n{}{}",
            out.stdout,
            out.stderr
        );
    }
    // The path of releases before per-release directories, set explicitly: kept.
    let out = render("one", "ops", vec!["daemonset.nodeStorage.path=/var/lib/capstan"]).await?;
    ensure!(out.success, "{}", out.stderr);
    ensure!(daemonset_of(&out.stdout)?.contains("value: \"file:/var/lib/capstan\""));
    Ok(())
}

#[tokio::test]
async fn a_surge_rollout_of_a_daemonset_with_node_local_storage_is_refused() -> Result<()> {
    let render = |set: Vec<&'static str>| async move {
        let mut all = vec![
            "mode=daemonset",
            HANDLER_IMAGE,
            "updateStrategy.type=RollingUpdate",
        ];
        all.extend(set);
        Render {
            release: "ci",
            namespace: "ops",
            set: all,
            ..Render::default()
        }
        .outcome()
        .await
    };
    for surge in ["1", "25%"] {
        let set = format!("updateStrategy.rollingUpdate.maxSurge={surge}");
        let set: &'static str = Box::leak(set.into_boxed_str());
        let out = render(vec![
            "daemonset.nodeStorage.enabled=true",
            set,
            "updateStrategy.rollingUpdate.maxUnavailable=0",
        ])
        .await?;
        ensure!(
            !out.success && out.stderr.contains("maxSurge") && out.stderr.contains("Set maxSurge=0"),
            "maxSurge={surge} with node storage is accepted:\n{}{}",
            out.stdout,
            out.stderr
        );
        let out = render(vec![set, "updateStrategy.rollingUpdate.maxUnavailable=0"]).await?;
        ensure!(
            out.success,
            "maxSurge={surge} without node storage: {}",
            out.stderr
        );
    }
    let out = render(vec![
        "daemonset.nodeStorage.enabled=true",
        "updateStrategy.rollingUpdate.maxSurge=0",
        "updateStrategy.rollingUpdate.maxUnavailable=1",
    ])
    .await?;
    ensure!(out.success, "maxSurge=0 with node storage: {}", out.stderr);
    Ok(())
}

#[tokio::test]
async fn the_chart_binds_the_admin_and_webhook_ports_on_both_address_families() -> Result<()> {
    let out = Render {
        release: "ci",
        namespace: "ops",
        values: vec![ci_file("08")?],
        ..Render::default()
    }
    .manifests()
    .await?;
    ensure!(
        out.contains("name: CAPSTAN_ADMIN_LISTEN") && out.contains("value: \"[::]:8080\""),
        "the admin port on [::]:\n{out}"
    );
    ensure!(
        out.contains("name: CAPSTAN_WEBHOOK_LISTEN") && out.contains("value: \"[::]:9443\""),
        "the webhook port on [::]:\n{out}"
    );
    ensure!(!out.contains("value: \"0.0.0.0:"), "an IPv4-only bind:\n{out}");
    // A `[::]` socket of the controller answers over IPv4 and IPv6 (dual-stack).
    let env = TestEnv::start().await?;
    let port = capstan_tests::process::free_port()?;
    let socket = env.scratch().join("dual.sock");
    let args: Vec<String> = [
        "run",
        "--listen",
        &format!("unix://{}", socket.display()),
        "--admin-listen",
        &format!("[::]:{port}"),
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    let vars = [(
        "KUBECONFIG".to_owned(),
        env.kubeconfig.to_string_lossy().into_owned(),
    )]
    .into();
    let bin = capstan_tests::process::capstan_binary().await?;
    let mut process = capstan_tests::process::Process::spawn("dual", &bin, &args, &vars, env.scratch())?;
    process.wait_for("capstan started", T).await?;
    for host in ["127.0.0.1", "[::1]"] {
        let answer = healthz(&format!("{host}:{port}")).await;
        ensure!(
            answer.as_deref().is_ok_and(|a| a.starts_with("HTTP/1.1 200")),
            "/healthz over {host}: {answer:?}"
        );
    }
    process.terminate().await?;
    Ok(())
}

/// The first line of the answer to `GET /healthz` at `addr`.
async fn healthz(addr: &str) -> Result<String> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await?;
    Ok(String::from_utf8_lossy(&raw)
        .lines()
        .next()
        .unwrap_or_default()
        .to_owned())
}

#[tokio::test]
async fn the_lease_rules_name_the_lease() -> Result<()> {
    let out = Render {
        release: "ci",
        namespace: "ops",
        values: vec![ci_file("03")?],
        show_only: vec!["templates/rbac.yaml"],
        ..Render::default()
    }
    .manifests()
    .await?;
    let role = documents(&out)
        .into_iter()
        .find(|d| d.contains("-leader-election") && d.contains("kind: Role\n"))
        .context("the leader-election Role")?;
    ensure!(
        role.contains("resources: [leases]\n    resourceNames: [\"ci-capstan\"]\n    verbs: [get, update]"),
        "reading and renewing are limited to the release's Lease:\n{role}"
    );
    // Creating cannot be limited to a name (the name is in the body): create alone, no more.
    ensure!(
        role.matches("verbs:").count() == 2 && role.contains("verbs: [create]"),
        "{role}"
    );
    let named = Render {
        release: "ci",
        namespace: "ops",
        values: vec![ci_file("03")?],
        set: vec!["leaderElection.leaseName=my-lease"],
        show_only: vec!["templates/rbac.yaml"],
    }
    .manifests()
    .await?;
    ensure!(named.contains("resourceNames: [\"my-lease\"]"), "{named}");
    Ok(())
}

#[tokio::test]
async fn cluster_scope_with_watched_namespaces_binds_in_those_namespaces_only() -> Result<()> {
    let out = Render {
        release: "ci",
        namespace: "ops",
        set: [
            EXAMPLE_RESOURCE.as_slice(),
            &["rbac.scope=cluster", "watchNamespaces={apps,web}"],
        ]
        .concat(),
        show_only: vec!["templates/rbac.yaml"],
        ..Render::default()
    }
    .manifests()
    .await?;
    let docs = documents(&out);
    let bindings: Vec<&String> = docs
        .iter()
        .filter(|d| d.contains("kind: RoleBinding") && d.contains("metadata:\n  name: ci-capstan\n"))
        .collect();
    ensure!(
        !docs
            .iter()
            .any(|d| d.contains("kind: ClusterRoleBinding") && d.contains("metadata:\n  name: ci-capstan\n")),
        "bound cluster-wide:\n{out}"
    );
    ensure!(bindings.len() == 2, "a RoleBinding per watched namespace:\n{out}");
    for ns in ["apps", "web"] {
        ensure!(
            bindings.iter().any(|b| b.contains(&format!("namespace: {ns}\n"))
                && b.contains("kind: ClusterRole\n  name: ci-capstan")),
            "no binding of the ClusterRole in {ns}:\n{out}"
        );
    }
    // Without watched namespaces the whole cluster is watched: bound cluster-wide.
    let all = Render {
        release: "ci",
        namespace: "ops",
        set: [EXAMPLE_RESOURCE.as_slice(), &["rbac.scope=cluster"]].concat(),
        show_only: vec!["templates/rbac.yaml"],
        ..Render::default()
    }
    .manifests()
    .await?;
    ensure!(all.contains("kind: ClusterRoleBinding"), "{all}");
    Ok(())
}

#[tokio::test]
async fn helm_template_passes_the_charts_kube_version_without_being_told_one() -> Result<()> {
    let chart = helm::chart_dir().to_string_lossy().into_owned();
    for command in ["template", "lint"] {
        let mut args = vec![command];
        if command == "template" {
            args.push("ci");
        } else {
            args.push("--strict");
        }
        args.extend([chart.as_str(), "--set", HANDLER_IMAGE]);
        let out = helm::run(&args).await?;
        ensure!(
            out.success,
            "helm {command} without --kube-version failed:\n{}{}",
            out.stdout,
            out.stderr
        );
    }
    Ok(())
}

/// The claims of a JSON Web Token (its middle part), unverified.
fn jwt_claims(token: &str) -> Result<Value> {
    let payload = token.split('.').nth(1).context("not a JWT")?;
    let mut bytes = Vec::new();
    let (mut buffer, mut bits) = (0u32, 0);
    for c in payload.bytes() {
        let value = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'-' | b'+' => 62,
            b'_' | b'/' => 63,
            _ => continue,
        };
        buffer = (buffer << 6) | u32::from(value);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            bytes.push(u8::try_from((buffer >> bits) & 0xff)?);
        }
    }
    Ok(serde_json::from_slice(&bytes)?)
}

/// A kubeconfig for the testenv's API server that authenticates with `token` only.
fn token_kubeconfig(env: &TestEnv, token: &str) -> Result<PathBuf> {
    let base = kube::config::Kubeconfig::read_from(&env.kubeconfig)?;
    let mut config = base.clone();
    for user in &mut config.auth_infos {
        if let Some(auth) = user.auth_info.as_mut() {
            *auth = kube::config::AuthInfo {
                token: Some(token.to_owned().into()),
                ..kube::config::AuthInfo::default()
            };
        }
    }
    let path = env
        .scratch()
        .join(format!("token-{}.kubeconfig", std::process::id()));
    std::fs::write(&path, serde_json::to_string(&config)?)?;
    Ok(path)
}

/// The text of the block scalar `key: |-` in a YAML document, without its indentation.
fn block_scalar(doc: &str, key: &str) -> Option<String> {
    let mut lines = doc.lines().skip_while(|l| l.trim() != format!("{key}: |-"));
    let header = lines.next()?;
    let indent = header.len() - header.trim_start().len() + 2;
    let body: Vec<&str> = lines
        .take_while(|l| l.trim().is_empty() || l.len() - l.trim_start().len() >= indent)
        .map(|l| l.get(indent..).unwrap_or_default())
        .collect();
    Some(body.join("\n"))
}

/// The metric names a PromQL expression selects: every identifier followed by `{` (each of
/// the chart's selectors has one), and any identifier with a prefix of the controller's
/// families.
fn metric_names(expr: &str) -> BTreeSet<String> {
    const PREFIXES: [&str; 5] = [
        "capstan_",
        "workqueue_",
        "controller_runtime_",
        "leader_election_",
        "process_",
    ];
    let mut names = BTreeSet::new();
    let mut ident = String::new();
    let mut quoted = false;
    for c in expr.chars().chain(std::iter::once(' ')) {
        if c == '"' {
            quoted = !quoted;
            ident.clear();
            continue;
        }
        if quoted {
            continue;
        }
        if c.is_ascii_alphanumeric() || c == '_' || c == ':' {
            ident.push(c);
            continue;
        }
        if !ident.is_empty() && (c == '{' || PREFIXES.iter().any(|p| ident.starts_with(p))) {
            names.insert(std::mem::take(&mut ident));
        }
        ident.clear();
    }
    names
}

/// The families on a `/metrics` page (`# TYPE` lines), with the series names of each
/// (`_bucket`, `_sum` and `_count` of a histogram).
fn exported(page: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for (family, kind) in page
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
    {
        names.insert(family.to_owned());
        if kind == "histogram" {
            for suffix in ["_bucket", "_sum", "_count"] {
                names.insert(format!("{family}{suffix}"));
            }
        }
    }
    names
}

/// The families the controller registers (its metrics modules' names; a family is on the page
/// only once it has a sample), with the series names each may have.
fn registered() -> Result<BTreeSet<String>> {
    let dir = helm::chart_dir().join("../../controller/src/observability");
    let mut names = BTreeSet::new();
    for file in ["metrics.rs", "workqueue.rs"] {
        let source = std::fs::read_to_string(dir.join(file)).with_context(|| format!("reading {file}"))?;
        for literal in source.split('"').skip(1).step_by(2) {
            let family = [
                "capstan_",
                "workqueue_",
                "controller_runtime_",
                "leader_election_",
                "process_",
            ]
            .iter()
            .any(|p| literal.starts_with(p))
                && literal
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
            if family {
                for suffix in ["", "_total", "_bucket", "_sum", "_count"] {
                    names.insert(format!("{literal}{suffix}"));
                }
            }
        }
    }
    Ok(names)
}

#[tokio::test]
async fn the_grafana_dashboard_renders_and_its_queries_and_alerts_name_only_exported_metrics() -> Result<()> {
    // Off by default.
    let default = Render {
        release: "ci",
        namespace: "ops",
        set: vec![HANDLER_IMAGE],
        ..Render::default()
    }
    .manifests()
    .await?;
    ensure!(
        !default.contains("capstan.json"),
        "the dashboard is rendered without being asked for:\n{default}"
    );
    let out = Render {
        release: "ci",
        namespace: "ops",
        set: vec![
            HANDLER_IMAGE,
            "grafanaDashboard.enabled=true",
            "grafanaDashboard.label=dashboards",
            "grafanaDashboard.labelValue=capstan",
            "metrics.prometheusRule.enabled=true",
        ],
        show_only: vec![
            "templates/grafana-dashboard.yaml",
            "templates/prometheusrule.yaml",
        ],
        ..Render::default()
    }
    .manifests()
    .await?;
    let docs = documents(&out);
    let configmap = docs
        .iter()
        .find(|d| d.contains("kind: ConfigMap"))
        .with_context(|| format!("no ConfigMap:\n{out}"))?;
    ensure!(
        configmap.contains("    dashboards: \"capstan\"\n"),
        "the ConfigMap does not carry the sidecar's label:\n{configmap}"
    );
    let text = block_scalar(configmap, "capstan.json").context("no capstan.json in the ConfigMap")?;
    let dashboard: Value = serde_json::from_str(&text).context("the dashboard is no JSON")?;
    let panels = dashboard["panels"].as_array().context("no panels")?;
    let mut queries: Vec<(String, String)> = Vec::new();
    for panel in panels.iter().filter(|p| p["type"] != "row") {
        let title = panel["title"].as_str().unwrap_or_default().to_owned();
        let targets = panel["targets"].as_array().filter(|t| !t.is_empty());
        let targets = targets.with_context(|| format!("panel {title:?} has no query"))?;
        for target in targets {
            let expr = target["expr"].as_str().context("a target without expr")?;
            queries.push((title.clone(), expr.to_owned()));
        }
    }
    for wanted in [
        "Queue depth",
        "Queue latency",
        "Cycle outcomes",
        "Handler latency",
        "API requests",
        "API errors",
        "The hop",
        "Memory",
    ] {
        ensure!(queries.iter().any(|(t, _)| t == wanted), "no panel {wanted:?}");
    }
    let rule = docs
        .iter()
        .find(|d| d.contains("kind: PrometheusRule"))
        .context("no PrometheusRule")?;
    for alert in [
        "CapstanQueueLatencyHigh",
        "CapstanHandlersFailing",
        "CapstanWatchDown",
    ] {
        ensure!(
            rule.contains(&format!("- alert: {alert}\n")),
            "no alert {alert}:\n{rule}"
        );
    }
    queries.extend(
        rule.lines()
            .filter_map(|l| l.trim().strip_prefix("expr: "))
            .map(|e| ("PrometheusRule".to_owned(), e.to_owned())),
    );

    // What a controller exports once it has handled objects (one after a retry), as a leader.
    let mut s = Scenario::start(
        "create3,update,delete",
        &["--leader-election", "--lease-name", "capstan-dashboard"],
    )
    .await?;
    s.create("dashboard-object", json!({"temporary": {"create_b": 1}}))
        .await?;
    s.wait("dashboard-object", T, "handled", |o| {
        annotation(o, "capstan.dev/last-handled-configuration").is_some()
    })
    .await?;
    let (_, page) = s.controller.admin_get("/metrics").await?;
    s.handler.terminate().await?;
    s.controller.process.terminate().await?;
    s.env.stop().await?;
    let exported = exported(&page);
    let registered = registered()?;
    ensure!(
        exported.iter().all(|n| registered.contains(n)),
        "the page has families the metrics modules do not name:\n{page}"
    );
    let mut named = 0;
    for (title, expr) in &queries {
        let names = metric_names(expr);
        ensure!(!names.is_empty(), "{title}: no metric in {expr}");
        for name in names {
            named += 1;
            ensure!(
                exported.contains(&name) || registered.contains(&name),
                "{title}: {name} is not exported by the controller ({expr}):\n{page}"
            );
        }
    }
    ensure!(named > 20, "only {named} metric names found");
    Ok(())
}
