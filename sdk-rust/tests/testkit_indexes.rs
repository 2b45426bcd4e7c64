//! Indexes and memos through the test kit: kopf's rules for index results, failures and
//! deletions, reading them from other handlers, and per-object memos.

#![allow(clippy::unwrap_used)]

use std::{
    collections::HashMap,
    sync::atomic::{AtomicU32, Ordering},
    time::Duration,
};

use capstan_sdk::{
    Context, ErrorsMode, HandlerError, HandlerOutput, Presence, Registry,
    testing::{InvocationBuilder, OutcomeKind, TestKit},
};
use serde_json::{Value, json};

const CM: &str = "configmaps";

fn cm(name: &str, app: Option<&str>) -> Value {
    let mut body = json!({"metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")}});
    if let Some(app) = app {
        body["metadata"]["labels"] = json!({"app": app});
    }
    body
}

/// `by_app`: `{<app label>: <name>}` for ConfigMaps labelled `app`.
fn registry() -> Registry {
    let mut registry = Registry::new();
    registry
        .index(CM, "by_app", |ctx: Context| async move {
            let app = ctx.labels().get("app").and_then(Value::as_str).map(str::to_owned);
            Ok::<_, HandlerError>(app.map(|app| json!({app: ctx.name()})))
        })
        .label("app", Presence::Present);
    registry.on_create("examples", "lookup", |ctx: Context| async move {
        let index = ctx.index("by_app")?;
        let wanted = ctx.spec()["app"].as_str().unwrap_or_default().to_owned();
        let names: Vec<Value> = index
            .get(&wanted)
            .map(|s| s.values().to_vec())
            .unwrap_or_default();
        Ok::<_, HandlerError>(json!({"configmaps": names}))
    });
    registry
}

#[tokio::test]
async fn the_index_follows_objects_and_other_handlers_read_it() {
    let kit = TestKit::new(registry());
    kit.index_object(cm("a", Some("web"))).await;
    kit.index_object(cm("b", Some("web"))).await;
    kit.index_object(cm("c", Some("db"))).await;
    kit.index_object(cm("plain", None)).await;
    let index = kit.index("by_app").unwrap();
    assert_eq!(index.keys(), vec![Some("db".to_owned()), Some("web".to_owned())]);
    assert_eq!(index.get("web").unwrap().values(), [json!("a"), json!("b")]);

    let example = json!({"metadata": {"name": "x", "uid": "uid-x"}, "spec": {"app": "web"}});
    let outcomes = kit.create(example.clone()).await;
    assert_eq!(
        outcomes.get("lookup").unwrap().value(),
        Some(json!({"configmaps": ["a", "b"]}))
    );

    // An update that changes the key moves the object; one that drops the label removes it.
    kit.index_object(cm("a", Some("db"))).await;
    kit.index_object(cm("b", None)).await;
    assert!(index.get("web").is_none(), "empty stores disappear");
    assert_eq!(index.get("db").unwrap().values(), [json!("a"), json!("c")]);
    kit.object_gone(cm("c", Some("db"))).await;
    assert_eq!(index.get("db").unwrap().values(), [json!("a")]);
    assert_eq!(index.objects(), 1);
}

#[tokio::test]
async fn failures_drop_the_object_unless_ignored() {
    let mut registry = Registry::new();
    let fail = |ctx: Context| async move {
        match ctx.spec()["fail"].as_str() {
            Some("temporary") => Err(HandlerError::temporary("later", Duration::from_secs(1))),
            Some("permanent") => Err(HandlerError::permanent("never")),
            Some("other") => Err(HandlerError::from(std::io::Error::other("boom"))),
            _ => Ok(Some(json!("v"))),
        }
    };
    registry.index(CM, "ignored", fail);
    registry.index(CM, "strict", fail).errors(ErrorsMode::Temporary);
    let kit = TestKit::new(registry);
    let body = |fail: Option<&str>| {
        let mut b = cm("a", None);
        if let Some(f) = fail {
            b["spec"] = json!({"fail": f});
        }
        b
    };
    kit.index_object(body(None)).await;
    let ignored = kit.index("ignored").unwrap();
    let strict = kit.index("strict").unwrap();
    assert_eq!(
        ignored.get_none().unwrap().values(),
        [json!("v")],
        "a plain result is under None"
    );

    kit.index_object(body(Some("other"))).await;
    assert_eq!(ignored.objects(), 1, "IGNORED keeps the stale value, as kopf");
    assert_eq!(strict.objects(), 0, "TEMPORARY drops it");

    kit.index_object(body(None)).await;
    let outcomes = kit.index_object(body(Some("temporary"))).await;
    assert!(matches!(
        outcomes.get("ignored").unwrap().kind(),
        OutcomeKind::TemporaryError { .. }
    ));
    assert_eq!(
        ignored.objects(),
        0,
        "a temporary error drops the object's entries"
    );
    kit.index_object(body(None)).await;
    kit.index_object(body(Some("permanent"))).await;
    assert!(
        ignored.is_empty() && strict.is_empty(),
        "a permanent error drops them too"
    );
}

#[tokio::test]
async fn an_unserialisable_index_value_fails_naming_the_handler() {
    let mut registry = Registry::new();
    registry.index(CM, "by_pair", |_ctx: Context| async move {
        // JSON object keys must be strings: a map keyed by tuples cannot be written.
        let mut by_pair: HashMap<(u8, u8), u8> = HashMap::new();
        by_pair.insert((1, 2), 3);
        Ok::<_, HandlerError>(HandlerOutput::serialize(&by_pair))
    });
    let kit = TestKit::new(registry);
    let outcome = kit
        .invoke("by_pair", InvocationBuilder::index(cm("a", None)))
        .await;
    assert_eq!(outcome.kind(), OutcomeKind::PermanentError);
    let message = outcome.message().unwrap();
    assert!(message.contains("\"by_pair\""), "{message}");
    assert!(message.contains("not JSON-serialisable"), "{message}");
    assert!(kit.index("by_pair").unwrap().is_empty());
}

#[tokio::test]
async fn an_unknown_index_is_a_clear_permanent_error() {
    let mut registry = registry();
    registry.on_create("examples", "typo", |ctx: Context| async move {
        ctx.index("by_ap")?;
        Ok::<_, HandlerError>(None)
    });
    let kit = TestKit::new(registry);
    let outcome = kit
        .invoke(
            "typo",
            InvocationBuilder::create(json!({"metadata": {"name": "x"}})),
        )
        .await;
    assert_eq!(outcome.kind(), OutcomeKind::PermanentError);
    assert!(outcome.message().unwrap().contains("the indexes are by_app"));
}

#[tokio::test]
async fn memos_are_per_object_and_start_from_the_operator_memo() {
    let mut registry = Registry::new();
    registry.memo().insert("shared", AtomicU32::new(0));
    registry.on_create("examples", "count", |ctx: Context| async move {
        ctx.memo()
            .get::<AtomicU32>("shared")
            .unwrap()
            .fetch_add(1, Ordering::SeqCst);
        let own = ctx.memo().get_or_insert_with("own", || AtomicU32::new(0));
        let n = own.fetch_add(1, Ordering::SeqCst) + 1;
        Ok::<_, HandlerError>(json!(n))
    });
    registry.on_startup("startup", |ctx: Context| async move {
        ctx.memo().insert("started", true);
        Ok::<_, HandlerError>(None)
    });
    let kit = TestKit::new(registry);
    let a = json!({"metadata": {"name": "a", "uid": "uid-a"}});
    let b = json!({"metadata": {"name": "b", "uid": "uid-b"}});
    let value = |o: capstan_sdk::testing::Outcomes| o.get("count").unwrap().value();
    assert_eq!(value(kit.create(a.clone()).await), Some(json!(1)));
    assert_eq!(
        value(kit.create(a.clone()).await),
        Some(json!(2)),
        "kept between calls"
    );
    assert_eq!(value(kit.create(b.clone()).await), Some(json!(1)), "per object");
    assert_eq!(
        kit.memo()
            .get::<AtomicU32>("shared")
            .unwrap()
            .load(Ordering::SeqCst),
        3,
        "values copied from the operator memo are shared"
    );
    assert_eq!(kit.memos(), 2);
    kit.object_gone(a.clone()).await;
    assert_eq!(kit.memos(), 1);
    assert_eq!(
        value(kit.create(a).await),
        Some(json!(1)),
        "dropped once the object is gone"
    );
    kit.invoke(
        "startup",
        InvocationBuilder::activity(capstan_sdk::Activity::Startup),
    )
    .await;
    assert!(
        kit.memo().contains_key("started"),
        "activities get the operator memo"
    );
}

#[tokio::test]
async fn a_when_filter_that_rejects_the_object_removes_its_entries() {
    let mut registry = Registry::new();
    registry
        .index(CM, "by_app", |ctx: Context| async move {
            let app = ctx.labels().get("app").cloned().unwrap_or(Value::Null);
            Ok::<_, HandlerError>(json!({"app": app}))
        })
        .when(|ctx| ctx.labels().contains_key("app"));
    let kit = TestKit::new(registry);
    kit.index_object(cm("a", Some("web"))).await;
    let index = kit.index("by_app").unwrap();
    assert_eq!(index.objects(), 1);
    // kopf: a handler whose `when` no longer matches drops the object's entries.
    let outcomes = kit.index_object(cm("a", None)).await;
    assert_eq!(outcomes.get("by_app").unwrap().kind(), OutcomeKind::Skipped);
    assert_eq!(index.objects(), 0, "the rejected object kept its entries");
}

#[tokio::test]
async fn index_invocations_make_no_memos() {
    let kit = TestKit::new(registry());
    for n in 0..10 {
        kit.index_object(cm(&format!("cm{n}"), Some("web"))).await;
    }
    assert_eq!(kit.index("by_app").unwrap().objects(), 10);
    assert_eq!(kit.memos(), 0, "every indexed object got a memo it never used");
}
