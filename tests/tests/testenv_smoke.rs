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
//! On the 1.36 server with the alpha gate `ShardedListAndWatch` (KEP-5866), which sharding uses:
//! `/version` (v1.36.x); a LIST with `shardSelector` returning exactly the objects whose uid
//! hashes into the ranges and echoing the selector in `metadata.shardInfo`; a WATCH with it
//! delivering only those objects; a selector of 200 OR-ed ranges (what one member of a sharded
//! operator may hold) being accepted, a malformed one refused. And the 1.35 server ignoring the
//! parameter.
//!
//! Every test starts its own API server and stops it gracefully at the end, also when it fails.

use std::{collections::BTreeSet, time::Duration};

use anyhow::{Context as _, Result, anyhow, bail, ensure};
use capstan_tests::testenv::{Kube, Options, TestEnv, examples};
use futures::TryStreamExt as _;
use k8s_openapi::{
    api::{
        coordination::v1::Lease,
        core::v1::{ConfigMap, Event, Namespace, ServiceAccount},
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
    with_testenv_of(Options::default(), body).await
}

/// [`with_testenv`] with a server started with `options`.
async fn with_testenv_of(options: Options<'_>, body: impl AsyncFnOnce(&TestEnv) -> Result<()>) -> Result<()> {
    let env = TestEnv::start_with(options).await?;
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

// KEP-5866: sharded list and watch (Kubernetes 1.36, alpha).

/// The 1.36 server with sharded list and watch on.
const SHARDED: Options<'static> = Options {
    kube: Kube::V1_36,
    feature_gates: &["ShardedListAndWatch=true"],
};

/// The top of the hash space (exclusive): 2^64, written `0x10000000000000000` in a selector.
const TOP: u128 = 1 << 64;

/// The lower half of the hash space, `[0, 2^63)`.
const LOWER: (u128, u128) = (0, 1 << 63);

/// The upper half of the hash space, `[2^63, 2^64)`.
const UPPER: (u128, u128) = (1 << 63, TOP);

/// The namespace the shard tests write their ConfigMaps to.
const SHARD_NS: &str = "shards";

/// KEP-5866's hash of an object: 64-bit FNV-1a of its uid.
fn fnv1a64(data: &[u8]) -> u64 {
    data.iter().fold(0xcbf2_9ce4_8422_2325, |hash, &byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Whether the object with `uid` falls into one of `ranges` (start inclusive, end exclusive).
fn in_ranges(uid: &str, ranges: &[(u128, u128)]) -> bool {
    let hash = u128::from(fnv1a64(uid.as_bytes()));
    ranges.iter().any(|&(start, end)| start <= hash && hash < end)
}

/// A `shardSelector` for `ranges`, spelled as Capstan's sharding spells it (16 hex digits, or 17
/// for the top), which is also how the server echoes it.
fn shard_selector(ranges: &[(u128, u128)]) -> String {
    ranges
        .iter()
        .map(|(start, end)| format!("shardRange(object.metadata.uid, '0x{start:016x}', '0x{end:016x}')"))
        .collect::<Vec<_>>()
        .join(" || ")
}

/// `uri` with `shardSelector=selector` added to its query, every byte but the unreserved ones
/// percent-encoded (as Capstan's sharding does).
fn with_shard_selector(uri: &str, selector: &str) -> String {
    let separator = match uri.find('?') {
        None => "?",
        Some(at) if at + 1 == uri.len() => "",
        Some(_) => "&",
    };
    format!("{uri}{separator}shardSelector={}", percent_encode(selector))
}

/// `value` with every byte but the unreserved ones (RFC 3986) percent-encoded.
fn percent_encode(value: &str) -> String {
    value
        .bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
                char::from(b).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// LISTs the ConfigMaps of [`SHARD_NS`], with a `shardSelector` when given; the answer as JSON.
async fn list_configmaps(client: &Client, selector: Option<&str>) -> Result<Value> {
    let path = format!("/api/v1/namespaces/{SHARD_NS}/configmaps");
    let mut request = kube::core::Request::new(path).list(&ListParams::default())?;
    if let Some(selector) = selector {
        let uri = with_shard_selector(&request.uri().to_string(), selector);
        *request.uri_mut() = uri
            .parse()
            .with_context(|| format!("a LIST URI of {} bytes", uri.len()))?;
    }
    Ok(client.request::<Value>(request).await?)
}

/// The (name, uid) of each item of a LIST answer.
fn listed(list: &Value) -> Result<BTreeSet<(String, String)>> {
    list["items"]
        .as_array()
        .ok_or_else(|| anyhow!("no items in {list}"))?
        .iter()
        .map(|item| {
            let name = item["metadata"]["name"].as_str();
            let uid = item["metadata"]["uid"].as_str();
            match (name, uid) {
                (Some(name), Some(uid)) => Ok((name.to_owned(), uid.to_owned())),
                _ => bail!("an item without name or uid: {item}"),
            }
        })
        .collect()
}

/// The items of `everything` that fall into `ranges`.
fn expected_in(
    everything: &BTreeSet<(String, String)>,
    ranges: &[(u128, u128)],
) -> BTreeSet<(String, String)> {
    everything
        .iter()
        .filter(|(_, uid)| in_ranges(uid, ranges))
        .cloned()
        .collect()
}

/// Creates [`SHARD_NS`] unless it is there.
async fn ensure_shard_namespace(client: &Client) -> Result<()> {
    let namespaces: Api<Namespace> = Api::all(client.clone());
    if namespaces.get_opt(SHARD_NS).await?.is_none() {
        let namespace: Namespace = serde_json::from_value(json!({"metadata": {"name": SHARD_NS}}))?;
        namespaces.create(&PostParams::default(), &namespace).await?;
    }
    Ok(())
}

/// Creates ConfigMaps in [`SHARD_NS`] until each half of the hash space holds at least
/// `per_half` of them (a uid's hash is random, so a fixed count could leave a half empty).
/// Returns the (name, uid) of each.
async fn create_configmaps_in_both_halves(client: &Client, per_half: usize) -> Result<Vec<(String, String)>> {
    ensure_shard_namespace(client).await?;
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), SHARD_NS);
    let mut created = Vec::new();
    let count = |created: &[(String, String)], half| {
        created.iter().filter(|(_, uid)| in_ranges(uid, &[half])).count()
    };
    while count(&created, LOWER) < per_half || count(&created, UPPER) < per_half {
        ensure!(
            created.len() < 64,
            "64 uids and still a half with fewer than {per_half}: {created:?}"
        );
        let name = format!("cm-{}", created.len());
        let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": name}, "data": {"n": name}}))?;
        let cm = api.create(&PostParams::default(), &cm).await?;
        let uid = cm.metadata.uid.ok_or_else(|| anyhow!("{name} has no uid"))?;
        created.push((name, uid));
    }
    Ok(created)
}

#[test]
fn fnv1a64_matches_the_reference_values() {
    // From the FNV reference test vectors (and Go's hash/fnv, which the server uses).
    assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
    assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
    assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
}

#[tokio::test]
async fn version_reports_kubernetes_1_36_for_the_1_36_server() -> Result<()> {
    with_testenv_of(SHARDED, async |env| {
        let info = env.client().await?.apiserver_version().await?;
        ensure!(
            info.git_version.starts_with("v1.36.") && info.minor.trim_end_matches('+') == "36",
            "kube-rs: {info:?}"
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn sharded_list_on_1_36_returns_only_the_objects_in_range_and_echoes_the_selector() -> Result<()> {
    with_testenv_of(SHARDED, async |env| {
        let client = env.client().await?;
        let created = create_configmaps_in_both_halves(&client, 3).await?;

        let everything = list_configmaps(&client, None).await?;
        ensure!(
            everything["metadata"].get("shardInfo").is_none(),
            "an unsharded list has no shardInfo: {}",
            everything["metadata"]
        );
        let everything = listed(&everything)?;
        for object in &created {
            ensure!(
                everything.contains(object),
                "{object:?} is not listed: {everything:?}"
            );
        }

        for half in [LOWER, UPPER] {
            let selector = shard_selector(&[half]);
            let list = list_configmaps(&client, Some(&selector)).await?;
            ensure!(
                list["metadata"]["shardInfo"]["selector"] == selector.as_str(),
                "the list does not echo {selector:?}: {}",
                list["metadata"]
            );
            let got = listed(&list)?;
            let want = expected_in(&everything, &[half]);
            ensure!(
                !want.is_empty() && got == want,
                "{selector}: listed {got:?}, expected {want:?}"
            );
        }

        // kubectl (whose client predates the parameter) gets the same through --raw.
        let selector = shard_selector(&[LOWER]);
        let raw = with_shard_selector(&format!("/api/v1/namespaces/{SHARD_NS}/configmaps"), &selector);
        let list: Value = serde_json::from_str(&env.kubectl_ok(&["get", "--raw", &raw]).await?)?;
        ensure!(
            list["metadata"]["shardInfo"]["selector"] == selector.as_str()
                && listed(&list)? == expected_in(&everything, &[LOWER]),
            "kubectl get --raw: {list}"
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn sharded_watch_on_1_36_delivers_only_the_objects_in_range() -> Result<()> {
    with_testenv_of(SHARDED, async |env| {
        let client = env.client().await?;
        ensure_shard_namespace(&client).await?;
        let start = list_configmaps(&client, None).await?;
        let rv = start["metadata"]["resourceVersion"]
            .as_str()
            .ok_or_else(|| anyhow!("no resourceVersion: {}", start["metadata"]))?;

        let selector = shard_selector(&[LOWER]);
        let path = format!("/api/v1/namespaces/{SHARD_NS}/configmaps");
        let mut request = kube::core::Request::new(path).watch(&WatchParams::default().timeout(60), rv)?;
        *request.uri_mut() = with_shard_selector(&request.uri().to_string(), &selector).parse()?;
        let stream = client.request_events::<DynamicObject>(request).await?;

        let created = create_configmaps_in_both_halves(&client, 3).await?;
        let in_range: BTreeSet<_> = created
            .iter()
            .filter(|(_, uid)| in_ranges(uid, &[LOWER]))
            .cloned()
            .collect();
        // A write after all the creates, to an object in range: a watch delivers in
        // resourceVersion order, so once its event is there every earlier one is too, and an
        // object out of range that was let through would have shown.
        let (fence, _) = in_range
            .first()
            .ok_or_else(|| anyhow!("nothing in range"))?
            .clone();
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), SHARD_NS);
        api.patch(
            &fence,
            &PatchParams::default(),
            &Patch::Merge(json!({"data": {"fence": "1"}})),
        )
        .await?;

        let mut added = BTreeSet::new();
        let mut seen = Vec::new();
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
                let uid = obj.metadata.uid.clone().unwrap_or_default();
                seen.push((kind, name.clone(), uid.clone()));
                if kind == "ADDED" {
                    added.insert((name.clone(), uid));
                }
                if kind == "MODIFIED" && name == fence {
                    return Ok(());
                }
            }
            bail!("the watch ended early")
        };
        tokio::time::timeout(T, collect)
            .await
            .map_err(|_| anyhow!("the fence did not arrive; so far {seen:?}"))??;

        let outside: Vec<_> = seen
            .iter()
            .filter(|(_, _, uid)| !in_ranges(uid, &[LOWER]))
            .collect();
        ensure!(outside.is_empty(), "events of objects out of range: {outside:?}");
        ensure!(
            added == in_range,
            "added {added:?}, expected {in_range:?} (of {created:?})"
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn shard_selector_of_200_ranges_is_accepted_by_1_36() -> Result<()> {
    with_testenv_of(SHARDED, async |env| {
        let client = env.client().await?;
        create_configmaps_in_both_halves(&client, 3).await?;
        let everything = listed(&list_configmaps(&client, None).await?)?;

        // Every other one of 400 equal slices of the space: 200 disjoint ranges, as a member
        // of a sharded operator holding 200 arcs of the ring asks for.
        let slice = TOP / 400;
        let ranges: Vec<(u128, u128)> = (0..200).map(|i| (2 * i * slice, (2 * i + 1) * slice)).collect();
        let selector = shard_selector(&ranges);
        let list = list_configmaps(&client, Some(&selector)).await.with_context(|| {
            format!(
                "a selector of {} bytes, {} percent-encoded",
                selector.len(),
                percent_encode(&selector).len()
            )
        })?;
        ensure!(
            list["metadata"]["shardInfo"]["selector"] == selector.as_str(),
            "the list does not echo the 200 ranges: {}",
            list["metadata"]
        );
        let got = listed(&list)?;
        let want = expected_in(&everything, &ranges);
        ensure!(got == want, "listed {got:?}, expected {want:?}");

        // A watch with it is accepted too. From resourceVersion 0 it starts with an ADDED event
        // of each object there is: those in the ranges only.
        let path = format!("/api/v1/namespaces/{SHARD_NS}/configmaps");
        let mut request = kube::core::Request::new(path).watch(&WatchParams::default().timeout(2), "0")?;
        *request.uri_mut() = with_shard_selector(&request.uri().to_string(), &selector).parse()?;
        let stream = client
            .request_events::<DynamicObject>(request)
            .await
            .context("a watch with 200 ranges")?;
        let mut stream = std::pin::pin!(stream);
        let mut added = BTreeSet::new();
        let collect = async {
            // The server ends the watch after its timeout (2 s).
            while let Some(event) = stream.try_next().await? {
                match event {
                    WatchEvent::Added(o) => {
                        added.insert((
                            o.metadata.name.unwrap_or_default(),
                            o.metadata.uid.unwrap_or_default(),
                        ));
                    }
                    WatchEvent::Bookmark(_) => {}
                    other => bail!("unexpected watch event {other:?}"),
                }
            }
            Ok(())
        };
        tokio::time::timeout(T, collect)
            .await
            .map_err(|_| anyhow!("the watch did not end"))??;
        ensure!(added == want, "the watch added {added:?}, expected {want:?}");

        // A selector the server cannot parse is refused, not ignored; 1.36 answers 500 (its
        // parse error is not mapped to a 400), which a client's fallback must expect.
        let malformed = "shardRange(object.metadata.uid, '0x0', '0x8000000000000000')";
        let refused = list_configmaps(&client, Some(malformed)).await.err();
        let status = refused.as_ref().and_then(|e| e.downcast_ref::<kube::Error>());
        ensure!(
            status.is_some_and(|e| is_status(e, 500) && e.to_string().contains("invalid shard selector")),
            "a malformed selector: {refused:?}"
        );
        Ok(())
    })
    .await
}

#[tokio::test]
async fn shard_selector_is_ignored_by_1_35() -> Result<()> {
    with_testenv(async |env| {
        let client = env.client().await?;
        let created: BTreeSet<_> = create_configmaps_in_both_halves(&client, 2)
            .await?
            .into_iter()
            .collect();
        let list = list_configmaps(&client, Some(&shard_selector(&[LOWER]))).await?;
        ensure!(
            list["metadata"].get("shardInfo").is_none(),
            "1.35 has no shardInfo: {}",
            list["metadata"]
        );
        let got = listed(&list)?;
        ensure!(
            got == created,
            "1.35 lists everything: {got:?}, created {created:?}"
        );
        Ok(())
    })
    .await
}
