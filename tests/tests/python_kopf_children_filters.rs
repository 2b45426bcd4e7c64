//! Differential tests on the lines of kopf's example operators `02-children` and
//! `11-filtering-handlers`: operator files of our own run once with real kopf (pinned from
//! PyPI, `kopf run --standalone`) and once with `capstan.kopf` on Capstan (`--persistence
//! kopf`), each against a fresh API server, and what came out is compared. Each handler call
//! is one JSON line in a log the operator file appends to.
//!
//! - Children (as `02-children`): a create handler makes a ConfigMap the child of the Example
//!   being handled with `kopf.adopt` (no owner given) and `kopf.label`, creates it, and
//!   returns its uid. Compared, with uids and generated names normalised: the child as the
//!   helpers left it, and as created (its owner reference to the parent: apiVersion, kind,
//!   name, uid, controller, blockOwnerDeletion; its labels, the parent's copied beside its
//!   own; its namespace; its name generated after the parent's), and the parent's
//!   `status.create_fn`. The owner is namespaced: for a cluster-scoped one kopf writes
//!   `namespace: null` into the child, where Capstan leaves the key out.
//! - Filters (as `11-filtering-handlers`): many create, update, field and delete handlers on
//!   one Example, each with its own filter; the Example is created, updated (labels,
//!   annotations and a spec field changed) and deleted. Compared per cause (its reason): the
//!   exact set of handlers called. A handler whose filter does not match is called by
//!   neither. One test for the `labels=` and `annotations=` filters (values, `kopf.PRESENT`,
//!   `kopf.ABSENT`, callbacks, combined), one for `when=` and `field=` with `value=`, `old=`
//!   and `new=`.
//!
//! Writes, their number and the intermediate annotations are not compared: Capstan runs all
//! pending top-level handlers of an object in one cycle and writes less often.

use std::{
    collections::{BTreeMap, BTreeSet},
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use capstan_tests::{
    side_by_side::{DIFFBASE, Framework, Operator, calls, handled, wait_gone, wait_object, wait_until},
    testenv::{TestEnv, examples},
};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::{
    Api,
    api::{DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams},
};
use serde_json::{Value, json};

/// How long to look for calls that should not come once the handling looks over.
const SETTLE: Duration = Duration::from_millis(1500);

/// Creates an Example in `default` with its metadata `meta` (name, labels, annotations).
async fn create(api: &Api<DynamicObject>, meta: Value, spec: Value) -> Result<()> {
    let object: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "demo.capstan.dev/v1",
        "kind": "Example",
        "metadata": meta,
        "spec": spec,
    }))?;
    api.create(&PostParams::default(), &object).await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Children.

const CHILDREN: &str = "sdk-python/tests/differential/examples_children.py";

/// What one framework's run of the children operator shows, normalised: the child as the
/// helpers left it, the child as created, and the parent's status.
struct ChildrenRun {
    adopted: Value,
    created: Value,
    status: Value,
}

async fn children_run(framework: Framework) -> Result<ChildrenRun> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let log = env.scratch().join("calls.jsonl");
    let client = env.client().await?;
    let api = examples(&client, "default");
    let configmaps: Api<ConfigMap> = Api::namespaced(client, "default");
    let operator = Operator::start(framework, &env, CHILDREN, &log, &[], 1).await?;
    let outcome = async {
        create(
            &api,
            json!({"name": "parent", "labels": {"app": "parent-app", "tier": "backend"}}),
            json!({"field": "value"}),
        )
        .await?;
        let parent = wait_object(&api, "parent", "the parent's handling", |o| {
            handled(o) && o.pointer("/status/create_fn").is_some()
        })
        .await?;
        let uid = parent["metadata"]["uid"].as_str().unwrap_or_default().to_owned();
        let recorded = calls(&log);
        let [call] = recorded.as_slice() else {
            bail!("create_fn was not called exactly once: {recorded:?}");
        };
        let children = configmaps
            .list(&ListParams::default().labels("from=parent"))
            .await?
            .items;
        let [child] = children.as_slice() else {
            bail!("not exactly one child: {children:?}");
        };
        let child = serde_json::to_value(child)?;
        let child_uid = child["metadata"]["uid"].as_str().unwrap_or_default().to_owned();
        let name = child["metadata"]["name"].as_str().unwrap_or_default();
        let normalise = |v: &Value| {
            v.to_string()
                .replace(&uid, "<parent-uid>")
                .replace(&child_uid, "<child-uid>")
                .replace(name, "<child-name>")
        };
        let created = json!({
            "namespace": child["metadata"]["namespace"],
            "generateName": child["metadata"]["generateName"],
            "name_after_parent": name.starts_with("parent-") && name.len() > "parent-".len(),
            "labels": child["metadata"]["labels"],
            "ownerReferences": child["metadata"]["ownerReferences"],
            "data": child["data"],
        });
        anyhow::Ok(ChildrenRun {
            adopted: serde_json::from_str(&normalise(&call["child"]))?,
            created: serde_json::from_str(&normalise(&created))?,
            status: serde_json::from_str(&normalise(&parent["status"]))?,
        })
    }
    .await
    .with_context(|| format!("{framework:?}: {}", operator.output()));
    if let Ok(run) = &outcome {
        println!(
            "{framework:?}: adopted {}; created {}; status {}",
            run.adopted, run.created, run.status
        );
    }
    operator.stop().await?;
    outcome
}

/// `kopf.adopt` and `kopf.label` on a child of the object being handled: the child is owned,
/// named, placed and labelled the same under both, and the handler's result (the child's
/// uid) lands in the parent's status the same.
#[tokio::test]
async fn adopted_child_is_owned_named_and_labelled_as_kopf_does() -> Result<()> {
    let kopf = children_run(Framework::Kopf).await?;
    let capstan = children_run(Framework::Capstan).await?;

    // The scenario is the one intended, under kopf.
    let owner = json!([{
        "apiVersion": "demo.capstan.dev/v1",
        "kind": "Example",
        "name": "parent",
        "uid": "<parent-uid>",
        "controller": true,
        "blockOwnerDeletion": true,
    }]);
    // The child's own label is kept; the parent's are copied; label() adds its own.
    let labels = json!({"app": "child", "tier": "backend", "from": "parent"});
    assert_eq!(
        kopf.created,
        json!({
            "namespace": "default",
            "generateName": "parent-",
            "name_after_parent": true,
            "labels": labels,
            "ownerReferences": owner,
            "data": {"field": "value"},
        }),
        "kopf's child is not the one intended"
    );
    assert_eq!(
        kopf.status,
        json!({"create_fn": {"children": ["<child-uid>"]}}),
        "kopf's parent status is not the one intended"
    );

    assert_eq!(
        capstan.adopted, kopf.adopted,
        "the children as adopt() and label() left them differ (left: capstan.kopf, right: kopf)"
    );
    assert_eq!(
        capstan.created, kopf.created,
        "the created children differ (left: capstan.kopf, right: kopf)"
    );
    assert_eq!(
        capstan.status, kopf.status,
        "the parents' status differs (left: capstan.kopf, right: kopf)"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Filters.

const FILTERS: &str = "sdk-python/tests/differential/examples_filters.py";

/// The handlers called per cause's reason.
type Called = BTreeMap<String, BTreeSet<String>>;

fn called(calls: &[Value]) -> Called {
    let mut called = Called::new();
    for call in calls {
        called
            .entry(call["reason"].as_str().unwrap_or_default().to_owned())
            .or_default()
            .insert(call["handler"].as_str().unwrap_or_default().to_owned());
    }
    called
}

fn expected(phases: &[(&str, &[&str])]) -> Called {
    phases
        .iter()
        .map(|(reason, handlers)| {
            (
                (*reason).to_owned(),
                handlers.iter().map(|h| (*h).to_owned()).collect(),
            )
        })
        .collect()
}

/// Runs the filters operator with the handlers of `group` under `framework`: creates the
/// Example, updates it, deletes it, and returns the handlers called per reason. `expected`
/// (kopf's calls, as intended) tells when each step's calls have come.
async fn filters_run(framework: Framework, group: &str, expected: &Called) -> Result<Called> {
    let env = TestEnv::start().await?;
    env.apply_example_crd().await?;
    let log = env.scratch().join("calls.jsonl");
    let api = examples(&env.client().await?, "default");
    let operator = Operator::start(
        framework,
        &env,
        FILTERS,
        &log,
        &[("DIFFERENTIAL_FILTERS", group)],
        1,
    )
    .await?;
    let has_all = |reason: &'static str| {
        let want = expected.get(reason).cloned().unwrap_or_default();
        move |c: &[Value]| want.is_subset(called(c).get(reason).unwrap_or(&BTreeSet::new()))
    };
    let outcome = async {
        create(
            &api,
            json!({
                "name": "filtered",
                "labels": {"a": "x", "b": "1"},
                "annotations": {"n": "1", "m": "yes"},
            }),
            json!({"f": "v", "g": "keep"}),
        )
        .await?;
        wait_until("the creation's calls", &log, has_all("create")).await?;
        wait_object(&api, "filtered", "the creation's handling", handled).await?;
        tokio::time::sleep(SETTLE).await;

        api.patch(
            "filtered",
            &PatchParams::default(),
            &Patch::Merge(json!({
                "metadata": {
                    "labels": {"a": "xy", "b": null, "c": "1"},
                    "annotations": {"n": "2"},
                },
                "spec": {"f": "w"},
            })),
        )
        .await?;
        wait_until("the update's calls", &log, has_all("update")).await?;
        wait_object(&api, "filtered", "the update's handling", |o| {
            // Not the last-handled configuration of the creation, still there at first.
            handled(o)
                && o.pointer("/metadata/annotations")
                    .and_then(|a| a.get(DIFFBASE))
                    .and_then(Value::as_str)
                    .and_then(|d| serde_json::from_str::<Value>(d).ok())
                    .is_some_and(|d| d.pointer("/spec/f") == Some(&json!("w")))
        })
        .await?;
        tokio::time::sleep(SETTLE).await;

        api.delete("filtered", &DeleteParams::default()).await?;
        wait_gone(&api, "filtered").await?;
        wait_until("the deletion's calls", &log, has_all("delete")).await?;
        tokio::time::sleep(SETTLE).await;

        let calls = calls(&log);
        if let Some(other) = calls.iter().find(|c| c["name"] != "filtered") {
            bail!("a call about another object: {other}");
        }
        anyhow::Ok(called(&calls))
    }
    .await
    .with_context(|| format!("{framework:?}: {}", operator.output()));
    if let Ok(called) = &outcome {
        println!("{framework:?}: {called:?}");
    }
    operator.stop().await?;
    outcome
}

/// `labels=` and `annotations=` filters with exact values, `kopf.PRESENT`, `kopf.ABSENT`,
/// callbacks, and several combined, on create, update and delete handlers: the same handlers
/// are called for each cause under both, and those whose filter does not match by neither.
#[tokio::test]
async fn label_and_annotation_filters_select_the_handlers_kopf_selects() -> Result<()> {
    let expected = expected(&[
        (
            "create",
            &[
                "create_label_value_yes",
                "create_label_present_yes",
                "create_label_absent_yes",
                "create_label_callback_yes",
                "create_annotation_value_yes",
                "create_annotation_present_yes",
                "create_annotation_absent_yes",
                "create_annotation_callback_yes",
                "create_combined_yes",
            ],
        ),
        (
            "update",
            &[
                "update_label_value_yes",
                "update_label_present_yes",
                "update_label_absent_yes",
                "update_label_callback_yes",
                "update_annotation_value_yes",
            ],
        ),
        (
            "delete",
            &["delete_label_callback_yes", "delete_annotation_present_yes"],
        ),
    ]);
    let kopf = filters_run(Framework::Kopf, "metadata", &expected).await?;
    let capstan = filters_run(Framework::Capstan, "metadata", &expected).await?;
    assert_eq!(kopf, expected, "kopf's calls are not the ones intended");
    assert_eq!(
        capstan, kopf,
        "the handlers called per cause differ (left: capstan.kopf, right: kopf)"
    );
    Ok(())
}

/// `when=` callbacks (on the spec, the labels, old and new), and `field=` with `value=`,
/// `old=` and `new=` on create, update, field and delete handlers: the same handlers are
/// called for each cause under both, and those whose filter does not match by neither. A
/// field handler is called for the creation and the update alike when its field changes; its
/// `value=` matches the field's new value or its old one.
#[tokio::test]
async fn when_and_field_filters_select_the_handlers_kopf_selects() -> Result<()> {
    let expected = expected(&[
        (
            "create",
            &[
                "create_when_yes",
                "create_when_labels_yes",
                "create_field_value_yes",
                "field_f_value_v_yes",
                "field_g_yes",
            ],
        ),
        (
            "update",
            &[
                "update_when_yes",
                "update_when_old_new_yes",
                "update_field_old_new_yes",
                "update_field_new_yes",
                "field_f_value_v_yes",
                "field_f_value_w_yes",
            ],
        ),
        ("delete", &["delete_when_yes", "delete_field_value_yes"]),
    ]);
    let kopf = filters_run(Framework::Kopf, "conditions", &expected).await?;
    let capstan = filters_run(Framework::Capstan, "conditions", &expected).await?;
    assert_eq!(kopf, expected, "kopf's calls are not the ones intended");
    assert_eq!(
        capstan, kopf,
        "the handlers called per cause differ (left: capstan.kopf, right: kopf)"
    );
    Ok(())
}
