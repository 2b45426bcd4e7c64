//! End to end: objects handled and at rest keep no body in the controller; when the handlers
//! change (a second handler process registers a delete handler), the controller lists them
//! again and each existing object gets what the new handler needs (its finalizer), then the
//! handler itself when the object is deleted.

use std::time::Duration;

use capstan_tests::{
    process::start_handler,
    scenario::{Scenario, has_finalizer},
};
use serde_json::json;

const T: Duration = Duration::from_secs(30);

#[tokio::test]
async fn objects_at_rest_are_listed_again_when_the_handlers_change() -> anyhow::Result<()> {
    let mut s = Scenario::start("create", &[]).await?;
    for name in ["one", "two", "three"] {
        s.create(name, json!({"field": "a"})).await?;
    }
    for name in ["one", "two", "three"] {
        let obj = s
            .wait(name, T, "created and handled", |o| {
                o.pointer("/metadata/annotations/capstan.dev~1last-handled-configuration")
                    .is_some()
            })
            .await?;
        assert!(!has_finalizer(&obj), "no delete handler yet, no finalizer");
    }
    let calls = s.env.scratch().join("calls-delete.log");
    let _deleting = start_handler(
        &s.env,
        "handler-delete",
        &s.controller.endpoint(),
        &[("E2E_HANDLERS", "delete"), ("E2E_LOG", &calls.to_string_lossy())],
    )?;
    s.controller
        .process
        .wait_for("listed again; objects without a body in memory queued", T)
        .await?;
    for name in ["one", "two", "three"] {
        s.wait(name, T, "the new delete handler's finalizer", has_finalizer)
            .await?;
    }
    s.delete("two").await?;
    s.wait_gone("two", T).await?;
    let deleted = std::fs::read_to_string(&calls)?;
    assert!(
        deleted
            .lines()
            .any(|l| l.starts_with("delete_fn") && l.contains("two")),
        "the delete handler ran for the object: {deleted}"
    );
    for name in ["one", "three"] {
        assert_eq!(s.count("create_fn", name), 1, "{name} was created once");
    }
    Ok(())
}
