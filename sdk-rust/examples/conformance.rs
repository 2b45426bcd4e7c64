//! The Rust SDK's conformance handler for the `capstan.v1` conformance kit
//! (`tests/conformance/README.md`, "The conformance handler").
//!
//! It registers the kit's fixed set of handlers on `widgets.v1.conformance.capstan.dev`, each
//! running the script in the `spec.script` of the body it is given, plus the activities and the
//! probe. Only the handlers of the features named in `CAPSTAN_CONFORMANCE_FEATURES`
//! (comma-separated) are registered; when it is unset, those of every feature this SDK supports.
//!
//! It dials `CAPSTAN_ENDPOINT` (`unix:///path`, `http://host:port` or a bare loopback
//! `host:port`; default `unix:///run/capstan/capstan.sock`), logs to standard error only
//! (`RUST_LOG` filters, default `info`), and stops as the SDK stops on SIGTERM or Ctrl-C.
//!
//! ```sh
//! cargo build -p capstan-sdk --example conformance --locked
//! CAPSTAN_ENDPOINT=unix:///tmp/capstan.sock target/debug/examples/conformance
//! ```

use std::{collections::BTreeSet, fmt, time::Duration};

use capstan_sdk::{
    Context, Credentials, DiffOp, HandlerError, HandlerResult, LogLevel, Operator, Reason, Registry,
};
use futures::future::BoxFuture;
use serde_json::{Map, Value, json};

/// The resource every resource handler is registered on.
const RESOURCE: &str = "widgets.v1.conformance.capstan.dev";

/// The features this SDK can claim, in the order of the kit's Features table.
const SUPPORTED: &[&str] = &[
    "change",
    "field",
    "event",
    "daemon",
    "timer",
    "index",
    "admission",
    "sdk_filters",
    "activities",
    "probe",
    "subhandlers",
    "object_updates",
    "cleanup_on_goodbye",
    "tcp",
    "invocation_updates",
    "attempt_details",
];

/// Features of the kit that this SDK does not support (announced capabilities it lacks).
const UNSUPPORTED: &[&str] = &["result_ack"];

// ----- the script ---------------------------------------------------------------------------

/// An error of no kopf class: what the `crash` action ends with.
#[derive(Debug)]
struct Crash(String);

impl fmt::Display for Crash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Crash {}

/// A resource handler: runs the script of the body it is given.
async fn scripted(ctx: Context) -> HandlerResult {
    let script = script_of(&ctx);
    run_script(ctx, script).await
}

/// The script of the invocation's body; for an admission review without a body (a deletion),
/// the script of the old object.
fn script_of(ctx: &Context) -> Value {
    let script = ctx.spec().get("script").cloned().unwrap_or(Value::Null);
    if !script.is_null() {
        return script;
    }
    ctx.admission()
        .and_then(|review| review.old_object.as_ref())
        .and_then(|old| old.get("spec").and_then(|spec| spec.get("script")).cloned())
        .unwrap_or(Value::Null)
}

/// Runs a script's actions in order until one ends the handler. Boxed, because sub-handlers
/// run scripts too.
fn run_script(ctx: Context, script: Value) -> BoxFuture<'static, HandlerResult> {
    Box::pin(async move {
        let actions = match script {
            Value::Null => return Ok(None),
            Value::Array(actions) => actions,
            other => {
                return Err(HandlerError::permanent(format!(
                    "the script is not a list: {other}"
                )));
            }
        };
        for action in actions {
            let Some((name, argument)) = action.as_object().and_then(single_entry) else {
                return Err(HandlerError::permanent(format!(
                    "an action must be an object with one key: {action}"
                )));
            };
            if let Some(end) = perform(&ctx, name, argument).await {
                return end;
            }
        }
        Ok(None)
    })
}

fn single_entry(object: &Map<String, Value>) -> Option<(&str, &Value)> {
    let mut entries = object.iter();
    match (entries.next(), entries.next()) {
        (Some((name, argument)), None) => Some((name.as_str(), argument)),
        _ => None,
    }
}

/// Performs one action; `Some` when it ends the handler.
async fn perform(ctx: &Context, name: &str, argument: &Value) -> Option<HandlerResult> {
    match name {
        "log" => {
            let level = match text(argument, "level") {
                "debug" => LogLevel::Debug,
                "warning" | "warn" => LogLevel::Warning,
                "error" => LogLevel::Error,
                _ => LogLevel::Info,
            };
            ctx.log(level, text(argument, "message"));
            None
        }
        "event" => {
            // The Event's type follows from the level: Normal for info, Warning above.
            let level = if text(argument, "type") == "Normal" {
                LogLevel::Info
            } else {
                LogLevel::Warning
            };
            match ctx.resource() {
                Some(object) => {
                    ctx.post_event_on(object, level, text(argument, "reason"), text(argument, "message"))
                }
                None => tracing::warn!("an `event` action without an object; nothing is posted"),
            }
            None
        }
        "patch" => {
            ctx.patch().merge(argument);
            None
        }
        "send_patch" => {
            let patch = capstan_sdk::Patch::new();
            patch.merge(argument);
            match ctx.send_patch(&patch).await {
                Ok(()) => None,
                Err(error) => Some(Err(HandlerError::from(error))),
            }
        }
        "return" => Some(Ok(Some(argument.clone()).filter(|v| !v.is_null()))),
        "echo" => Some(Ok(Some(echo(ctx)))),
        "temporary" => {
            let message = text(argument, "message");
            Some(Err(match argument.get("delay").filter(|d| !d.is_null()) {
                Some(delay) => HandlerError::temporary(message, seconds(delay)),
                None => HandlerError::retry(message),
            }))
        }
        "permanent" => Some(Err(HandlerError::permanent(text(argument, "message")))),
        "crash" => Some(Err(HandlerError::from(Crash(
            text(argument, "message").to_owned(),
        )))),
        "sleep" => {
            let wait = seconds(argument);
            tokio::select! {
                () = tokio::time::sleep(wait) => None,
                () = ctx.cancelled() => Some(cancelled(ctx)),
            }
        }
        "hang" => {
            ctx.cancelled().await;
            Some(cancelled(ctx))
        }
        "hang_ignoring_cancel" => {
            tokio::time::sleep(seconds(argument)).await;
            Some(Ok(Some(json!({"ignored_cancel": true}))))
        }
        "subhandlers" => {
            for sub in argument.as_array().into_iter().flatten() {
                let id = text(sub, "id").to_owned();
                let script = sub.get("script").cloned().unwrap_or(Value::Null);
                ctx.subhandler(id, move |child: Context| run_script(child, script.clone()));
            }
            None
        }
        "deny" => {
            // Without a code, kopf's `AdmissionError` default: 500.
            let code = argument
                .get("code")
                .and_then(Value::as_i64)
                .and_then(|code| i32::try_from(code).ok())
                .unwrap_or(500);
            Some(Err(HandlerError::deny(text(argument, "message"), code)))
        }
        "warn" => {
            let warning = argument
                .as_str()
                .map_or_else(|| argument.to_string(), ToOwned::to_owned);
            ctx.add_warning(warning);
            None
        }
        other => Some(Err(HandlerError::permanent(format!("unknown action {other:?}")))),
    }
}

/// How this SDK ends a cancelled handler: with an error after the cancel, which the SDK
/// answers `cancelled`.
fn cancelled(ctx: &Context) -> HandlerResult {
    Err(HandlerError::retry(format!(
        "cancelled ({})",
        ctx.cancel_reason()
            .map_or("no reason given", |reason| reason.as_str())
    )))
}

/// A string field of an action's argument (empty when absent).
fn text<'a>(argument: &'a Value, key: &str) -> &'a str {
    argument.get(key).and_then(Value::as_str).unwrap_or_default()
}

/// A number of seconds as a duration (0 for anything that is not a non-negative number).
fn seconds(value: &Value) -> Duration {
    match value.as_f64() {
        Some(s) if s.is_finite() && s > 0.0 => Duration::try_from_secs_f64(s).unwrap_or(Duration::MAX),
        _ => Duration::ZERO,
    }
}

/// The echo of what the handler was given.
fn echo(ctx: &Context) -> Value {
    let non_empty = |s: &str| (!s.is_empty()).then(|| Value::String(s.to_owned()));
    let change = ctx.reason().is_some();
    let review = ctx.admission();
    json!({
        "name": non_empty(ctx.name()),
        "namespace": ctx.namespace(),
        "uid": non_empty(ctx.uid()),
        "spec": *ctx.spec(),
        "labels": Value::Object((*ctx.labels()).clone()),
        "retry": ctx.retry(),
        "param": ctx.param(),
        "reason": ctx.reason().map(|reason| match reason {
            Reason::Create => "create",
            Reason::Update => "update",
            Reason::Delete => "delete",
            _ => "resume",
        }),
        "old": ctx.old(),
        "new": ctx.new(),
        "diff": change.then(|| ctx.diff().iter().map(|item| {
            let op = match item.op {
                DiffOp::Add => "add",
                DiffOp::Remove => "remove",
                _ => "change",
            };
            json!([op, item.path, item.old, item.new])
        }).collect::<Vec<_>>()),
        "event_type": ctx.event_type().and_then(|t| t.as_k8s_str()),
        "operation": review.map(|r| r.operation.as_str()),
        "dry_run": review.map(|r| r.dry_run),
        "subresource": review.and_then(|r| non_empty(&r.subresource)),
        "idempotency_key": non_empty(ctx.idempotency_key()),
        "traceparent": ctx.traceparent(),
        "last_error": ctx.last_error().map(|e| e.summary.clone()),
    })
}

// ----- the activities and the probe ---------------------------------------------------------

/// Fails temporarily on its first attempt, then succeeds.
async fn startup(ctx: Context) -> HandlerResult {
    if ctx.retry() == 0 {
        return Err(HandlerError::temporary("not yet", Duration::from_millis(250)));
    }
    ctx.info("startup");
    Ok(None)
}

async fn cleanup(ctx: Context) -> HandlerResult {
    ctx.info("cleanup");
    Ok(None)
}

async fn login(_ctx: Context) -> HandlerResult<Credentials> {
    Ok(Credentials {
        server: "https://conformance.invalid:6443".to_owned(),
        token: "conformance-token".to_owned(),
        default_namespace: "conformance".to_owned(),
        ..Credentials::default()
    })
}

async fn probe(_ctx: Context) -> HandlerResult {
    Ok(Some(json!({"probe": "ok"})))
}

// ----- registration -------------------------------------------------------------------------

/// The features to register handlers for: `CAPSTAN_CONFORMANCE_FEATURES`, or all supported.
fn features() -> BTreeSet<String> {
    let Ok(list) = std::env::var("CAPSTAN_CONFORMANCE_FEATURES") else {
        return SUPPORTED.iter().map(|&f| f.to_owned()).collect();
    };
    let mut features = BTreeSet::new();
    for feature in list.split(',').map(str::trim).filter(|f| !f.is_empty()) {
        if UNSUPPORTED.contains(&feature) {
            tracing::warn!(feature, "this SDK does not support the feature; ignored");
        } else if !SUPPORTED.contains(&feature) {
            tracing::warn!(feature, "unknown feature; ignored");
        }
        features.insert(feature.to_owned());
    }
    features
}

fn registry(features: &BTreeSet<String>) -> Registry {
    let on = |feature: &str| features.contains(feature);
    let mut registry = Registry::new();
    if on("change") {
        registry
            .on_create(RESOURCE, "create", scripted)
            .param(json!({"p": 1}));
        registry
            .on_update(RESOURCE, "update", scripted)
            .retries(3)
            .backoff(Duration::from_secs(2))
            .timeout(Duration::from_secs(30));
        registry.on_delete(RESOURCE, "delete", scripted);
        registry.on_resume(RESOURCE, "resume", scripted);
    }
    if on("field") {
        // kopf's rule, which the SDK follows: the id of a field handler is `<id>/<field>`.
        registry.on_field(RESOURCE, "spec.watched", "field", scripted);
    }
    if on("event") {
        registry.on_event(RESOURCE, "event", scripted);
    }
    if on("daemon") {
        registry.daemon(RESOURCE, "daemon", scripted);
    }
    if on("timer") {
        registry
            .timer(RESOURCE, "timer", scripted)
            .interval(Duration::from_secs(3600));
    }
    if on("index") {
        registry.index(RESOURCE, "index", scripted);
    }
    if on("admission") {
        registry.on_validate(RESOURCE, "validate", scripted);
        registry.on_mutate(RESOURCE, "mutate", scripted);
    }
    if on("sdk_filters") {
        registry
            .on_create(RESOURCE, "when", scripted)
            .when(|ctx| ctx.spec().get("allowed") == Some(&Value::Bool(true)));
    }
    if on("activities") {
        registry.on_startup("startup", startup);
        registry.on_cleanup("cleanup", cleanup);
        registry.on_login("login", login);
    }
    if on("probe") {
        registry.on_probe("probe", probe);
    }
    registry
}

// ----- running ------------------------------------------------------------------------------

/// The endpoint to dial: `CAPSTAN_ENDPOINT`, a bare `host:port` taken as plaintext HTTP/2.
fn endpoint() -> String {
    let endpoint =
        std::env::var("CAPSTAN_ENDPOINT").unwrap_or_else(|_| capstan_sdk::DEFAULT_ENDPOINT.to_owned());
    if endpoint.starts_with("unix:") || endpoint.contains("://") {
        endpoint
    } else {
        format!("http://{endpoint}")
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let features = features();
    let endpoint = endpoint();
    tracing::info!(?features, %endpoint, "conformance handler starting");
    Operator::new(registry(&features))
        .endpoint(endpoint)
        .run(capstan_sdk::shutdown_signal())
        .await?;
    Ok(())
}
