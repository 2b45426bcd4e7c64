//! End to end: sub-handlers nest (`parent/child/grandchild`, each with its own progress
//! record) and keep their own options: a child retries within its own `retries`, and one
//! that runs out of them fails for good while its siblings finish and the cause completes.

use std::time::Duration;

use capstan_tests::scenario::{Scenario, annotation};
use serde_json::json;

const T: Duration = Duration::from_secs(60);

/// How long nothing must happen for a "never again" check: several retry delays.
const QUIET: Duration = Duration::from_secs(4);

#[tokio::test]
async fn nested_subhandlers_finish_in_order_and_keep_their_own_retries() -> anyhow::Result<()> {
    let s = Scenario::start("nested-subhandlers", &[]).await?;
    s.create(
        "tree",
        json!({
            "temporary": {"nest/outer/inner": 2, "nest/limited": 100},
            "retryDelay": {"nest/outer/inner": 1, "nest/limited": 1}
        }),
    )
    .await?;
    let o = s
        .wait("tree", T, "the cause is done", |o| {
            annotation(o, "capstan.dev/last-handled-configuration").is_some()
        })
        .await?;
    assert_eq!(annotation(&o, "e2e/sub-inner"), Some("done"), "{o}");
    assert_eq!(annotation(&o, "e2e/sub-outer"), Some("done"), "{o}");
    assert_eq!(
        o.pointer("/status/nest~1outer~1inner/attempts"),
        Some(&json!(3)),
        "the grandchild's result under its full id: {o}"
    );
    assert_eq!(s.count("nest/outer/inner", "tree"), 3, "{:?}", s.calls());
    assert_eq!(
        s.count("nest/outer", "tree"),
        3,
        "the child runs again until its own child is done: {:?}",
        s.calls()
    );
    assert_eq!(s.count("nest/limited", "tree"), 2, "{:?}", s.calls());
    tokio::time::sleep(QUIET).await;
    assert_eq!(
        s.count("nest/limited", "tree"),
        2,
        "not retried past its own limit"
    );
    assert_eq!(s.count("nest/outer/inner", "tree"), 3);
    Ok(())
}
