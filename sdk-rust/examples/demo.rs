//! The demo operator of the quick start: handles `examples.demo.capstan.dev` objects (kind
//! `Example`, short name `cex`) with one handler of each common kind.
//!
//! Run it next to a `capstan` controller; it dials `CAPSTAN_ENDPOINT` (default
//! `unix:///run/capstan/capstan.sock`) and stops on Ctrl-C or SIGTERM.

use std::time::Duration;

use capstan_sdk::{Context, HandlerError, HandlerResult, Operator, Registry};
use serde_json::json;

const RESOURCE: &str = "examples.demo.capstan.dev";

/// Greets new objects and marks them as handled.
async fn create_fn(ctx: Context) -> HandlerResult {
    ctx.patch().label("demo.capstan.dev/handled", "yes");
    ctx.info(format!("created {}", ctx.name()));
    Ok(Some(json!({"message": format!("hello {}", ctx.name())})))
}

/// Acknowledges changes of the spec.
async fn update_fn(_ctx: Context) -> HandlerResult {
    Ok(Some(json!({"message": "updated"})))
}

/// Logs how `spec.field` changed.
async fn field_fn(ctx: Context) -> HandlerResult {
    let show =
        |value: Option<&serde_json::Value>| value.map_or_else(|| "<none>".to_owned(), ToString::to_string);
    ctx.info(format!(
        "spec.field changed: {} -> {}",
        show(ctx.old()),
        show(ctx.new())
    ));
    Ok(None)
}

/// Logs deletions.
async fn delete_fn(ctx: Context) -> HandlerResult {
    ctx.info(format!("deleting {}", ctx.name()));
    Ok(None)
}

/// Fails `spec.fail_times` times with a temporary error, then succeeds.
async fn flaky_fn(ctx: Context) -> HandlerResult {
    let fail_times = ctx.spec()["fail_times"].as_u64().unwrap_or(0);
    if u64::from(ctx.retry()) < fail_times {
        return Err(HandlerError::temporary(
            format!("failing on purpose ({} of {fail_times})", ctx.retry() + 1),
            Duration::from_secs(1),
        ));
    }
    Ok(Some(json!({"attempts": ctx.retry() + 1})))
}

/// Logs every watch event's type.
async fn event_fn(ctx: Context) -> HandlerResult {
    let event = ctx
        .event_type()
        .map_or("NONE", |t| t.as_k8s_str().unwrap_or("LISTED"));
    tracing::info!(object = ctx.name(), event, "watch event");
    ctx.debug(format!("event {event}"));
    Ok(None)
}

/// Reports every few seconds that the object is monitored, until cancelled.
async fn monitor(ctx: Context) -> HandlerResult {
    while !ctx.wait_stopped(Duration::from_secs(5)).await {
        tracing::info!(object = ctx.name(), "monitoring");
        ctx.debug(format!("{} is monitored", ctx.name()));
    }
    tracing::info!(object = ctx.name(), reason = ?ctx.cancel_reason(), "monitor stopped");
    Ok(None)
}

/// Counts ticks in `status.ticks`.
async fn tick(ctx: Context) -> HandlerResult {
    let ticks = ctx.status()["ticks"].as_u64().unwrap_or(0) + 1;
    ctx.patch().status("ticks", ticks);
    Ok(None)
}

fn registry() -> Registry {
    let mut registry = Registry::new();
    registry.on_create(RESOURCE, "create_fn", create_fn);
    registry.on_update(RESOURCE, "update_fn", update_fn);
    registry.on_field(RESOURCE, "spec.field", "field_fn", field_fn);
    registry.on_delete(RESOURCE, "delete_fn", delete_fn);
    registry.on_create(RESOURCE, "flaky_fn", flaky_fn);
    registry.on_event(RESOURCE, "event_fn", event_fn);
    registry
        .daemon(RESOURCE, "monitor", monitor)
        .cancellation_timeout(Duration::from_secs(10));
    registry
        .timer(RESOURCE, "tick", tick)
        .interval(Duration::from_secs(10));
    registry
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let endpoint =
        std::env::var("CAPSTAN_ENDPOINT").unwrap_or_else(|_| capstan_sdk::DEFAULT_ENDPOINT.to_owned());
    Operator::new(registry())
        .endpoint(endpoint)
        .run(capstan_sdk::shutdown_signal())
        .await?;
    Ok(())
}
