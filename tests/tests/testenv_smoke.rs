//! Smoke tests of the test API server (`tests/testenv`): everything Capstan's end-to-end tests
//! rely on, checked through both kube-rs and kubectl against a real kube-apiserver.
//!
//! Covered: `/version` (v1.35.x); applying the example CRD until it is Established and served;
//! create, merge-patch and delete of an `Example` with its status subresource (status patches go
//! through `/status`, status changes in a main-object patch are ignored); a watch receiving
//! ADDED, MODIFIED and DELETED events; a finalizer blocking deletion until it is removed; core/v1
//! Events; coordination.k8s.io/v1 Leases; RBAC with an impersonated ServiceAccount that is denied
//! until a Role is bound; and the audit log recording our writes.
//!
//! Every test starts its own API server and stops it gracefully at the end, also when it fails.

use std::time::Duration;

use anyhow::{Result, anyhow, bail, ensure};
use capstan_tests::testenv::{TestEnv, examples};
use futures::TryStreamExt as _;
use k8s_openapi::{
    api::{
        coordination::v1::Lease,
        core::v1::{Event, Namespace, ServiceAccount},
        rbac::v1::{Role, RoleBinding},
    },
    apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition,
    apimachinery::pkg::apis::meta::v1::MicroTime,
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams},
    config::{KubeConfigOptions, Kubeconfig},
};
use serde_json::{Value, json};

/// How long any single expected effect may take to show.
const T: Duration = Duration::from_secs(30);

const CRD: &str = "examples.demo.capstan.dev";

/// Starts an API server, runs `body` against it and stops the server, whatever the outcome.
async fn with_testenv(body: impl AsyncFnOnce(&TestEnv) -> Result<()>) -> Result<()> {
    let env = TestEnv::start().await?;
    let outcome = body(&env).await;
    env.stop().await?;
    outcome
}

/// Polls `probe` until it yields a value or `timeout` passes.
async fn poll<T>(
    what: &str,
    timeout: Duration,
    mut probe: impl AsyncFnMut() -> Result<Option<T>>,
) -> Result<T> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let last = match probe().await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => String::from("not yet"),
            Err(error) => format!("{error:#}"),
        };
        if tokio::time::Instant::now() > deadline {
            bail!("{what}: not observed within {timeout:?} (last: {last})");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// An `Example` object.
fn example(name: &str, spec: Value) -> Result<DynamicObject> {
    example_with(name, spec, json!({}))
}

/// An `Example` object with extra metadata (labels, finalizers, …).
fn example_with(name: &str, spec: Value, metadata: Value) -> Result<DynamicObject> {
    let mut meta = json!({ "name": name });
    json_patch::merge(&mut meta, &metadata);
    Ok(serde_json::from_value(json!({
        "apiVersion": "demo.capstan.dev/v1",
        "kind": "Example",
        "metadata": meta,
        "spec": spec,
    }))?)
}

/// An object as JSON, for pointer lookups.
fn as_json(obj: &DynamicObject) -> Result<Value> {
    Ok(serde_json::to_value(obj)?)
}

/// Whether an API error is `code`.
fn is_status(error: &kube::Error, code: u16) -> bool {
    matches!(error, kube::Error::Api(status) if status.code == code)
}

/// A client that acts as `user` (the admin may impersonate anyone).
async fn impersonating_client(env: &TestEnv, user: &str) -> Result<Client> {
    let kubeconfig = Kubeconfig::read_from(&env.kubeconfig)?;
    let mut config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await?;
    config.auth_info.impersonate = Some(user.to_owned());
    Ok(Client::try_from(config)?)
}

/// `kubectl auth can-i --as=USER VERB RESOURCE -n NS`: Ok(true) for yes, Ok(false) for no.
async fn kubectl_can_i(env: &TestEnv, user: &str, verb: &str, resource: &str, ns: &str) -> Result<bool> {
    let out = env
        .kubectl()
        .args(["auth", "can-i", &format!("--as={user}"), verb, resource, "-n", ns])
        .output()
        .await?;
    let answer = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    match (out.status.code(), answer.as_str()) {
        (Some(0), "yes") => Ok(true),
        (Some(1), "no") => Ok(false),
        _ => bail!(
            "unexpected kubectl auth can-i result {:?}: {answer:?} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

#[tokio::test]
async fn version_reports_kubernetes_1_35_through_kube_rs_and_kubectl() -> Result<()> {
    with_testenv(async |env| {
        let info = env.client().await?.apiserver_version().await?;
        ensure!(
            info.git_version.starts_with("v1.35."),
            "kube-rs: gitVersion {:?}",
            info.git_version
        );
        ensure!(
            info.major == "1" && info.minor.trim_end_matches('+') == "35",
            "kube-rs: {info:?}"
        );

        let out: Value = serde_json::from_str(&env.kubectl_ok(&["version", "-o", "json"]).await?)?;
        let server = out["serverVersion"]["gitVersion"].as_str().unwrap_or_default();
        ensure!(
            server.starts_with("v1.35."),
            "kubectl: serverVersion {:?}",
            out["serverVersion"]
        );
        ensure!(
            server == info.git_version,
            "kubectl and kube-rs disagree: {server} vs {}",
            info.git_version
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn example_crd_is_established_and_served() -> Result<()> {
    with_testenv(async |env| {
        env.apply_example_crd().await?;

        let crds: Api<CustomResourceDefinition> = Api::all(env.client().await?);
        let crd = crds.get(CRD).await?;
        let conditions = crd.status.and_then(|s| s.conditions).unwrap_or_default();
        for wanted in ["Established", "NamesAccepted"] {
            ensure!(
                conditions.iter().any(|c| c.type_ == wanted && c.status == "True"),
                "condition {wanted} is not True: {conditions:?}"
            );
        }

        let resources = env
            .kubectl_ok(&["api-resources", "--api-group=demo.capstan.dev", "-o", "wide"])
            .await?;
        ensure!(
            resources
                .lines()
                .any(|l| l.starts_with("examples") && l.contains("cex") && l.contains("Example")),
            "kubectl api-resources does not list examples (cex):\n{resources}"
        );
        // The short name resolves and the (empty) list is served.
        let list: Value = serde_json::from_str(&env.kubectl_ok(&["get", "cex", "-o", "json"]).await?)?;
        ensure!(
            list["items"].as_array().is_some_and(Vec::is_empty),
            "unexpected list {list}"
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn example_create_merge_patch_status_subresource_and_delete() -> Result<()> {
    with_testenv(async |env| {
        env.apply_example_crd().await?;
        let api = examples(&env.client().await?, "default");

        let created = api
            .create(
                &PostParams::default(),
                &example("crud", json!({"field": "a", "size": 1}))?,
            )
            .await?;
        ensure!(created.metadata.uid.is_some() && created.metadata.resource_version.is_some());
        ensure!(
            as_json(&created)?.get("status").is_none(),
            "a new object has no status"
        );

        // A merge patch of the main object changes the spec.
        let patched = api
            .patch(
                "crud",
                &PatchParams::default(),
                &Patch::Merge(json!({"spec": {"field": "b"}})),
            )
            .await?;
        let patched = as_json(&patched)?;
        ensure!(
            patched["spec"] == json!({"field": "b", "size": 1}),
            "spec after the patch: {}",
            patched["spec"]
        );

        // The status is written through the status subresource …
        let with_status = api
            .patch_status(
                "crud",
                &PatchParams::default(),
                &Patch::Merge(json!({"status": {"phase": "Ready"}})),
            )
            .await?;
        ensure!(as_json(&with_status)?["status"] == json!({"phase": "Ready"}));

        // … and a main-object patch touching the status changes the spec only.
        let both = json!({"spec": {"size": 2}, "status": {"phase": "Hijacked"}});
        let after = as_json(
            &api.patch("crud", &PatchParams::default(), &Patch::Merge(both))
                .await?,
        )?;
        ensure!(
            after["spec"]["size"] == 2,
            "the spec part applies: {}",
            after["spec"]
        );
        ensure!(
            after["status"] == json!({"phase": "Ready"}),
            "the status part is ignored: {}",
            after["status"]
        );

        // Likewise a status patch touching the spec changes the status only.
        let both = json!({"spec": {"size": 3}, "status": {"phase": "Done"}});
        let after = as_json(
            &api.patch_status("crud", &PatchParams::default(), &Patch::Merge(both))
                .await?,
        )?;
        ensure!(
            after["spec"]["size"] == 2 && after["status"]["phase"] == "Done",
            "after a status patch: {after}"
        );

        // The same through kubectl.
        env.kubectl_ok(&[
            "patch",
            "cex",
            "crud",
            "--type=merge",
            "-p",
            r#"{"spec":{"field":"c"}}"#,
        ])
        .await?;
        env.kubectl_ok(&[
            "patch",
            "cex",
            "crud",
            "--subresource=status",
            "--type=merge",
            "-p",
            r#"{"status":{"phase":"Patched"}}"#,
        ])
        .await?;
        let shown: Value =
            serde_json::from_str(&env.kubectl_ok(&["get", "cex", "crud", "-o", "json"]).await?)?;
        ensure!(
            shown["spec"]["field"] == "c" && shown["status"]["phase"] == "Patched",
            "kubectl sees {shown}"
        );
        let table = env.kubectl_ok(&["get", "cex", "crud"]).await?;
        ensure!(
            table.contains("FIELD") && table.contains("crud"),
            "printer columns:\n{table}"
        );

        // Delete; without finalizers the object goes at once.
        api.delete("crud", &DeleteParams::default()).await?;
        poll("the object is gone", T, async || {
            match api.get_opt("crud").await? {
                None => Ok(Some(())),
                Some(_) => Ok(None),
            }
        })
        .await?;
        let err = env
            .kubectl_ok(&["get", "cex", "crud"])
            .await
            .err()
            .ok_or_else(|| anyhow!("kubectl found it"))?;
        ensure!(
            format!("{err:#}").contains("NotFound"),
            "kubectl get after delete: {err:#}"
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn watch_from_a_resource_version_receives_added_modified_and_deleted() -> Result<()> {
    with_testenv(async |env| {
        env.apply_example_crd().await?;
        let api = examples(&env.client().await?, "default");
        let first = api
            .create(
                &PostParams::default(),
                &example("watched", json!({"field": "a"}))?,
            )
            .await?;
        let rv = first
            .metadata
            .resource_version
            .clone()
            .ok_or_else(|| anyhow!("no resourceVersion"))?;

        // Events strictly after the create: the create itself is not replayed.
        let stream = api.watch(&WatchParams::default().timeout(60), &rv).await?;
        api.create(&PostParams::default(), &example("second", json!({}))?)
            .await?;
        api.patch(
            "watched",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"field": "b"}})),
        )
        .await?;
        api.delete("watched", &DeleteParams::default()).await?;

        let mut seen: Vec<(String, String, Value)> = Vec::new();
        let mut stream = std::pin::pin!(stream);
        let collect = async {
            while let Some(event) = stream.try_next().await? {
                let (kind, obj) = match event {
                    WatchEvent::Added(o) => ("ADDED", o),
                    WatchEvent::Modified(o) => ("MODIFIED", o),
                    WatchEvent::Deleted(o) => ("DELETED", o),
                    WatchEvent::Bookmark(_) => continue,
                    WatchEvent::Error(e) => bail!("watch error: {e:?}"),
                };
                let name = obj.metadata.name.clone().unwrap_or_default();
                let done = kind == "DELETED" && name == "watched";
                seen.push((kind.to_owned(), name, as_json(&obj)?["spec"].clone()));
                if done {
                    return Ok(());
                }
            }
            bail!("the watch ended early")
        };
        tokio::time::timeout(T, collect)
            .await
            .map_err(|_| anyhow!("watch timed out; so far {seen:?}"))??;

        let kinds: Vec<(&str, &str)> = seen.iter().map(|(k, n, _)| (k.as_str(), n.as_str())).collect();
        ensure!(
            kinds
                == [
                    ("ADDED", "second"),
                    ("MODIFIED", "watched"),
                    ("DELETED", "watched")
                ],
            "watch events: {seen:?}"
        );
        ensure!(
            seen[1].2["field"] == "b",
            "MODIFIED carries the new object: {:?}",
            seen[1]
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn finalizer_blocks_deletion_until_removed() -> Result<()> {
    with_testenv(async |env| {
        env.apply_example_crd().await?;
        let api = examples(&env.client().await?, "default");
        let obj = example_with(
            "held",
            json!({}),
            json!({"finalizers": ["smoke.capstan.dev/hold"]}),
        )?;
        api.create(&PostParams::default(), &obj).await?;

        // The delete only marks the object.
        let marked = api
            .delete("held", &DeleteParams::default())
            .await?
            .left()
            .ok_or_else(|| anyhow!("a finalized object was deleted at once"))?;
        ensure!(
            marked.metadata.deletion_timestamp.is_some(),
            "no deletionTimestamp: {marked:?}"
        );

        // It stays, marked, for as long as the finalizer is there.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let still = api.get("held").await?;
        ensure!(still.metadata.deletion_timestamp.is_some());
        ensure!(still.metadata.finalizers.as_deref() == Some(&["smoke.capstan.dev/hold".to_owned()][..]));
        let shown = env
            .kubectl_ok(&[
                "get",
                "cex",
                "held",
                "-o",
                "jsonpath={.metadata.deletionTimestamp}",
            ])
            .await?;
        ensure!(!shown.trim().is_empty(), "kubectl shows no deletionTimestamp");

        // No new finalizers while it is being deleted; the spec still changes.
        let more = json!({"metadata": {"finalizers": ["smoke.capstan.dev/hold", "smoke.capstan.dev/more"]}});
        let refused = api
            .patch("held", &PatchParams::default(), &Patch::Merge(more))
            .await
            .err();
        ensure!(
            refused.as_ref().is_some_and(|e| is_status(e, 422)),
            "adding a finalizer: {refused:?}"
        );
        api.patch(
            "held",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"field": "late"}})),
        )
        .await?;

        // Removing the finalizer lets the deletion finish.
        api.patch(
            "held",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"finalizers": null}})),
        )
        .await?;
        poll("the object is gone after removing its finalizer", T, async || {
            Ok(api.get_opt("held").await?.is_none().then_some(()))
        })
        .await?;
        Ok(())
    })
    .await
}

#[tokio::test]
async fn core_v1_event_is_created_and_listed() -> Result<()> {
    with_testenv(async |env| {
        env.apply_example_crd().await?;
        let client = env.client().await?;
        let target = examples(&client, "default")
            .create(&PostParams::default(), &example("noted", json!({}))?)
            .await?;
        let events: Api<Event> = Api::namespaced(client, "default");
        let event: Event = serde_json::from_value(json!({
            "metadata": {"name": "noted.smoke", "namespace": "default"},
            "involvedObject": {
                "apiVersion": "demo.capstan.dev/v1",
                "kind": "Example",
                "name": "noted",
                "namespace": "default",
                "uid": target.metadata.uid,
            },
            "type": "Normal",
            "reason": "SmokeTested",
            "message": "handler create_fn succeeded",
            "source": {"component": "capstan"},
            "reportingComponent": "capstan",
            "reportingInstance": "capstan-smoke",
            "count": 1,
            "firstTimestamp": "2026-01-01T00:00:00Z",
            "lastTimestamp": "2026-01-01T00:00:00Z",
        }))?;
        events.create(&PostParams::default(), &event).await?;

        let listed = events
            .list(&ListParams::default().fields("involvedObject.name=noted"))
            .await?;
        ensure!(listed.items.len() == 1, "events of noted: {:?}", listed.items);
        let got = &listed.items[0];
        ensure!(got.reason.as_deref() == Some("SmokeTested"));
        ensure!(
            got.involved_object.uid == target.metadata.uid,
            "involvedObject {:?}",
            got.involved_object
        );
        let none = events
            .list(&ListParams::default().fields("involvedObject.name=other"))
            .await?;
        ensure!(none.items.is_empty(), "the field selector filters");

        let shown = env
            .kubectl_ok(&["get", "events", "--field-selector", "involvedObject.kind=Example"])
            .await?;
        ensure!(
            shown.contains("SmokeTested") && shown.contains("handler create_fn succeeded"),
            "{shown}"
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn coordination_lease_is_created_and_updated() -> Result<()> {
    with_testenv(async |env| {
        let leases: Api<Lease> = Api::namespaced(env.client().await?, "default");
        let lease: Lease = serde_json::from_value(json!({
            "metadata": {"name": "capstan-smoke"},
            "spec": {"holderIdentity": "capstan-a", "leaseDurationSeconds": 15, "leaseTransitions": 0},
        }))?;
        let mut lease = leases.create(&PostParams::default(), &lease).await?;
        let stale = lease.clone();

        // Renew: replace with the current resourceVersion.
        let now = MicroTime(Timestamp::now());
        let spec = lease.spec.get_or_insert_with(Default::default);
        spec.acquire_time = Some(now.clone());
        spec.renew_time = Some(now);
        let renewed = leases
            .replace("capstan-smoke", &PostParams::default(), &lease)
            .await?;
        let renewed_spec = renewed.spec.clone().unwrap_or_default();
        ensure!(
            renewed_spec.renew_time.is_some() && renewed_spec.holder_identity.as_deref() == Some("capstan-a")
        );
        ensure!(renewed.metadata.resource_version != stale.metadata.resource_version);

        // A writer holding an old resourceVersion loses (optimistic concurrency).
        let mut takeover = stale;
        takeover.spec.get_or_insert_with(Default::default).holder_identity = Some("capstan-b".into());
        let err = leases
            .replace("capstan-smoke", &PostParams::default(), &takeover)
            .await
            .err();
        ensure!(
            err.as_ref().is_some_and(|e| is_status(e, 409)),
            "a stale replace must conflict: {err:?}"
        );

        // A handover by merge patch.
        let handover = json!({"spec": {"holderIdentity": "capstan-b", "leaseTransitions": 1}});
        let handed = leases
            .patch("capstan-smoke", &PatchParams::default(), &Patch::Merge(handover))
            .await?;
        let spec = handed.spec.unwrap_or_default();
        ensure!(spec.holder_identity.as_deref() == Some("capstan-b") && spec.lease_transitions == Some(1));
        ensure!(
            spec.renew_time == renewed_spec.renew_time,
            "the renew time survives the patch: {:?} vs {:?}",
            spec.renew_time,
            renewed_spec.renew_time
        );

        let shown = env.kubectl_ok(&["get", "lease", "capstan-smoke"]).await?;
        ensure!(shown.contains("capstan-b"), "kubectl get lease:\n{shown}");
        Ok(())
    })
    .await
}

#[tokio::test]
async fn rbac_denies_an_impersonated_service_account_until_a_role_is_bound() -> Result<()> {
    with_testenv(async |env| {
        env.apply_example_crd().await?;
        let admin = env.client().await?;
        let ns = "rbac-smoke";
        let namespace: Namespace = serde_json::from_value(json!({"metadata": {"name": ns}}))?;
        Api::<Namespace>::all(admin.clone()).create(&PostParams::default(), &namespace).await?;
        let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "reader"}}))?;
        Api::<ServiceAccount>::namespaced(admin.clone(), ns).create(&PostParams::default(), &sa).await?;
        examples(&admin, ns).create(&PostParams::default(), &example("visible", json!({}))?).await?;

        let user = format!("system:serviceaccount:{ns}:reader");
        let as_reader = examples(&impersonating_client(env, &user).await?, ns);
        let denied = as_reader.list(&ListParams::default()).await.err();
        ensure!(denied.as_ref().is_some_and(|e| is_status(e, 403)), "list must be forbidden: {denied:?}");
        ensure!(!kubectl_can_i(env, &user, "list", "examples.demo.capstan.dev", ns).await?);
        let out = env.kubectl().args(["get", "cex", "-n", ns, &format!("--as={user}")]).output().await?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        ensure!(!out.status.success() && stderr.contains("forbidden"), "kubectl get --as: {stderr}");

        let role: Role = serde_json::from_value(json!({
            "metadata": {"name": "example-reader"},
            "rules": [{"apiGroups": ["demo.capstan.dev"], "resources": ["examples"], "verbs": ["get", "list", "watch"]}],
        }))?;
        Api::<Role>::namespaced(admin.clone(), ns).create(&PostParams::default(), &role).await?;
        let binding: RoleBinding = serde_json::from_value(json!({
            "metadata": {"name": "example-reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "example-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": ns}],
        }))?;
        Api::<RoleBinding>::namespaced(admin.clone(), ns).create(&PostParams::default(), &binding).await?;

        // The authorizer reads RBAC from an informer: allow it a moment.
        let listed = poll("the bound role takes effect", T, async || match as_reader.list(&ListParams::default()).await {
            Ok(list) => Ok(Some(list)),
            Err(e) if is_status(&e, 403) => Ok(None),
            Err(e) => Err(e.into()),
        })
        .await?;
        let names: Vec<_> = listed.items.iter().filter_map(|o| o.metadata.name.as_deref()).collect();
        ensure!(names == ["visible"], "the reader lists {names:?}");
        ensure!(kubectl_can_i(env, &user, "list", "examples.demo.capstan.dev", ns).await?);
        let shown = env.kubectl_ok(&["get", "cex", "-n", ns, &format!("--as={user}"), "-o", "name"]).await?;
        ensure!(shown.trim() == "example.demo.capstan.dev/visible", "kubectl get --as: {shown}");

        // The role grants reading in its namespace only.
        ensure!(!kubectl_can_i(env, &user, "delete", "examples.demo.capstan.dev", ns).await?);
        ensure!(!kubectl_can_i(env, &user, "list", "examples.demo.capstan.dev", "default").await?);
        let write = as_reader.delete("visible", &DeleteParams::default()).await.err();
        ensure!(write.as_ref().is_some_and(|e| is_status(e, 403)), "delete must be forbidden: {write:?}");

        // The audit log names both the real and the impersonated user.
        let events = env.audit_events()?;
        ensure!(
            events.iter().any(|e| e["user"]["username"] == "capstan-admin"
                && e["impersonatedUser"]["username"] == user.as_str()
                && e["verb"] == "list"
                && e["objectRef"]["resource"] == "examples"
                && e["responseStatus"]["code"] == 403),
            "no audit event of the impersonated, denied list"
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn audit_log_records_example_writes_by_the_admin() -> Result<()> {
    with_testenv(async |env| {
        env.apply_example_crd().await?;
        let api = examples(&env.client().await?, "default");
        api.create(
            &PostParams::default(),
            &example("audited", json!({"field": "a"}))?,
        )
        .await?;
        api.patch(
            "audited",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"field": "b"}})),
        )
        .await?;
        api.patch_status(
            "audited",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"ok": true}})),
        )
        .await?;

        let find = |verb: &'static str, subresource: Option<&'static str>| {
            let env = &env;
            async move || -> Result<Option<Value>> {
                Ok(env.audit_events()?.into_iter().find(|e| {
                    e["verb"] == verb
                        && e["stage"] == "ResponseComplete"
                        && e["user"]["username"] == "capstan-admin"
                        && e["objectRef"]["apiGroup"] == "demo.capstan.dev"
                        && e["objectRef"]["resource"] == "examples"
                        && e["objectRef"]["namespace"] == "default"
                        && e["objectRef"].get("subresource").and_then(Value::as_str) == subresource
                        && e["objectRef"]["name"] == "audited"
                }))
            }
        };
        let create = poll("an audited create", T, find("create", None)).await?;
        ensure!(create["responseStatus"]["code"] == 201, "create: {create}");
        ensure!(
            create["user"]["groups"]
                .as_array()
                .is_some_and(|g| g.iter().any(|g| g == "system:masters")),
            "the admin is in system:masters: {create}"
        );
        let patch = poll("an audited patch", T, find("patch", None)).await?;
        ensure!(patch["responseStatus"]["code"] == 200, "patch: {patch}");
        let status = poll("an audited status patch", T, find("patch", Some("status"))).await?;
        ensure!(status["responseStatus"]["code"] == 200, "status patch: {status}");

        // kubectl's writes are recorded the same way.
        env.kubectl_ok(&["delete", "cex", "audited"]).await?;
        let delete = poll("an audited delete", T, find("delete", None)).await?;
        ensure!(
            delete["userAgent"]
                .as_str()
                .is_some_and(|ua| ua.starts_with("kubectl")),
            "the delete came from kubectl: {delete}"
        );
        let total = env.audit_events()?.len();
        ensure!(total > 0, "the audit log is empty");
        Ok(())
    })
    .await
}
