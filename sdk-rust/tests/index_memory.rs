//! What an indexed object costs in the handler process: the index's own bookkeeping plus the
//! value, measured as the growth of the resident set while 20,000 objects are indexed (an
//! upper bound: allocator slack and page granularity count too).

use capstan_sdk::{Context, HandlerError, Registry, testing::TestKit};
use serde_json::{Value, json};

/// The process's resident set in bytes (Linux), `None` elsewhere.
fn resident() -> Option<i64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: i64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * 4096)
}

#[tokio::test(flavor = "current_thread")]
async fn an_indexed_object_costs_a_few_hundred_bytes() {
    const OBJECTS: usize = 20_000;
    let mut registry = Registry::new();
    registry.index("configmaps", "by_app", |ctx: Context| async move {
        let app = ctx.labels().get("app").and_then(Value::as_str).map(str::to_owned);
        Ok::<_, HandlerError>(app.map(|app| json!({ app: ctx.name() })))
    });
    let kit = TestKit::new(registry);
    let body = |i: usize| {
        json!({"metadata": {
            "name": format!("cm-{i:05}"),
            "namespace": "default",
            "uid": format!("7c0a4b1e-5d7f-4c1e-9b1a-{i:012}"),
            "labels": {"app": format!("app-{}", i % 10)},
        }})
    };
    // Warm up (lazy statics, the runtime's buffers), then measure.
    kit.index_object(body(OBJECTS)).await;
    let Some(before) = resident() else {
        return;
    };
    for i in 0..OBJECTS {
        kit.index_object(body(i)).await;
    }
    let after = resident().unwrap_or(before);
    let index = kit.index("by_app").unwrap_or_else(|| panic!("no index"));
    assert_eq!(index.objects(), OBJECTS + 1);
    let per_object = (after - before) / OBJECTS as i64;
    println!(
        "index memory: {per_object} bytes per indexed object (one key, a 8-character string value, \
         namespace/name/uid key of 7+8+36 characters)"
    );
    assert!(per_object < 1_024, "{per_object} bytes per object");
}
