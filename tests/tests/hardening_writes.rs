//! End to end: the controller's writes keep what others wrote and cost no more than they must.
//!
//! - A single handler running longer than `--checkpoint-after` costs no checkpoint unless it
//!   has a timeout (whose clock its start time keeps across a restart): one PATCH per change.

use std::time::Duration;

use capstan_tests::scenario::{Scenario, annotation};
use serde_json::{Value, json};

const T: Duration = Duration::from_secs(30);

fn handled(o: &Value) -> bool {
    annotation(o, "capstan.dev/last-handled-configuration").is_some()
}

#[tokio::test]
async fn a_single_slow_handler_without_a_timeout_costs_one_write() -> anyhow::Result<()> {
    let s = Scenario::start("create", &["--checkpoint-after", "1s"]).await?;
    s.create("slow", json!({"sleep": {"create_fn": 2.5}})).await?;
    s.wait("slow", T, "handled", handled).await?;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        s.writes("slow"),
        ["patch"],
        "a checkpoint of the lone handler's start was written"
    );
    assert_eq!(s.count("create_fn", "slow"), 1);
    Ok(())
}
