//! End to end, against a real API server, the real `capstan` binary and a real SDK handler
//! process: kopf's per-object memo keeps values between one object's handler calls, and is
//! dropped when the controller sees the object deleted (`ObjectGone`).

use std::time::Duration;

use anyhow::Result;
use capstan_tests::scenario::Scenario;
use serde_json::json;

const T: Duration = Duration::from_secs(60);

#[tokio::test]
async fn a_memo_lives_between_calls_and_goes_with_its_object() -> Result<()> {
    let s = Scenario::start("memo", &[]).await?;
    s.create("one", json!({"size": 1})).await?;
    s.create("two", json!({"size": 1})).await?;
    let memo_lines = |name: &str| -> Vec<String> {
        s.notes("memo")
            .into_iter()
            .filter(|n| n.first().map(String::as_str) == Some(name))
            .filter_map(|n| n.get(1).cloned())
            .collect()
    };
    let deadline = tokio::time::Instant::now() + T;
    while memo_lines("one").is_empty() || memo_lines("two").is_empty() {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "create handlers did not run"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    s.patch("one", json!({"spec": {"size": 2}})).await?;
    while memo_lines("one").len() < 2 {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the update handler did not run"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        memo_lines("one"),
        ["1", "2"],
        "the memo kept the count between calls"
    );
    assert_eq!(memo_lines("two"), ["1"], "each object has its own memo");

    s.delete("one").await?;
    s.wait_gone("one", T).await?;
    while s.notes("memo-dropped").is_empty() {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the memo of the deleted object was not dropped"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        s.notes("memo-dropped"),
        vec![vec!["one".to_owned()]],
        "only the deleted object's memo"
    );
    Ok(())
}
