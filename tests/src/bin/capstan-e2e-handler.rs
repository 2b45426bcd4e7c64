//! The handler process of the end-to-end tests, written with the Rust SDK.
//!
//! `E2E_HANDLERS` (comma-separated) picks which handlers it registers for the example resource;
//! each invocation appends `<handler id> <object name> <attempt>` to the file `E2E_LOG`, so
//! tests can count calls across process restarts. What a handler does is steered by the
//! object's spec, per handler id:
//!
//! - `spec.temporary.<id>: N` fails with a temporary error on the first N attempts, retried
//!   after `spec.retryDelay.<id>` seconds (default 1);
//! - `spec.unclassified.<id>: N` fails with an unclassified error on the first N attempts;
//! - `spec.permanent.<id>: true` fails permanently;
//! - `spec.sleep.<id>: S` sleeps S seconds before answering (for crash tests);
//! - `spec.badPatch.<id>: true` patches `spec.size` with a string, which the schema rejects;
//! - `spec.crash.<id>: true` kills the whole process (SIGKILL) while the handler runs, after
//!   noting `lost <id> <name> <attempt> <last error reason>`;
//! - `spec.hugePatch.<id>: N` patches an annotation of N MiB (the API server refuses it);
//! - `spec.unfinalize.<id>: true` patches `metadata.finalizers` to null;
//!
//! The `update-seen` preset notes `seen <name> <spec.field>` for every update instead.
//!
//! and `E2E_FAIL_FIRST=N` makes every handler of this process fail its first N attempts.
//!
//! The `index` preset indexes ConfigMaps labelled `e2e/app` by that label (`by_app`: app →
//! ConfigMap names), noting `index <name>` per call; `lookup_fn` (create) answers
//! `status.lookup_fn.configmaps` with the names under the example's `spec.app` and notes
//! `lookup <name> <indexed objects>`; the `peek` timer writes the whole index to
//! `status.peek` every second and notes `peek <pid> <indexed objects>`.

use std::{io::Write, time::Duration};

use capstan_sdk::{Context, HandlerError, HandlerResult, Operator, Patch, Presence, Registry};
use serde_json::{Value, json};

const RESOURCE: &str = "examples.demo.capstan.dev";

fn log_call(ctx: &Context) {
    note(&format!(
        "{} {} {}",
        ctx.handler_id(),
        ctx.name(),
        ctx.retry() + 1
    ));
}

/// The behaviour every handler shares: log the call, then fail, sleep or patch as the spec says.
async fn behave(ctx: &Context) -> Result<(), HandlerError> {
    log_call(ctx);
    let id = ctx.handler_id().to_owned();
    let spec = ctx.spec().clone();
    let setting = |key: &str| spec.get(key).and_then(|m| m.get(&id)).cloned();
    if let Some(secs) = setting("sleep").and_then(|v| v.as_f64()) {
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs_f64(secs)) => {}
            () = ctx.cancelled() => return Err(HandlerError::retry("cancelled while sleeping")),
        }
    }
    if let Some(n) = std::env::var("E2E_FAIL_FIRST")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
        && ctx.retry() < n
    {
        return Err(HandlerError::temporary(
            format!("this process fails its first {n} attempts"),
            Duration::from_secs(1),
        ));
    }
    if let Some(n) = setting("temporary").and_then(|v| v.as_u64())
        && u64::from(ctx.retry()) < n
    {
        let delay = setting("retryDelay").and_then(|v| v.as_f64()).unwrap_or(1.0);
        return Err(HandlerError::temporary(
            format!("temporary failure {} of {n}", ctx.retry() + 1),
            Duration::from_secs_f64(delay),
        ));
    }
    if let Some(n) = setting("unclassified").and_then(|v| v.as_u64())
        && u64::from(ctx.retry()) < n
    {
        let parsed: Result<u32, _> = "not a number".parse();
        parsed.map_err(|e| HandlerError::from(anyhow::anyhow!("unclassified failure: {e}")))?;
    }
    if setting("permanent").and_then(|v| v.as_bool()) == Some(true) {
        return Err(HandlerError::permanent("permanent failure on purpose"));
    }
    if setting("badPatch").and_then(|v| v.as_bool()) == Some(true) {
        ctx.patch().spec("size", "not-a-number");
    }
    if setting("crash").and_then(|v| v.as_bool()) == Some(true) {
        let reason = ctx.last_error().map_or("NONE", |d| d.reason.as_str());
        note(&format!("lost {id} {} {} {reason}", ctx.name(), ctx.retry() + 1));
        // SIGKILL, as the OOM killer would: no goodbye, no flush.
        let _ = std::process::Command::new("kill")
            .args(["-KILL", &std::process::id().to_string()])
            .status();
        std::process::abort();
    }
    if let Some(mib) = setting("hugePatch").and_then(|v| v.as_u64()) {
        let size = usize::try_from(mib).unwrap_or(0).saturating_mul(1 << 20);
        ctx.patch().annotation("e2e/huge", "x".repeat(size));
    }
    if setting("unfinalize").and_then(|v| v.as_bool()) == Some(true) {
        ctx.patch().merge(&json!({"metadata": {"finalizers": null}}));
    }
    Ok(())
}

async fn create_a(ctx: Context) -> HandlerResult {
    behave(&ctx).await?;
    ctx.patch().label("e2e/a", "1");
    Ok(None)
}

async fn create_b(ctx: Context) -> HandlerResult {
    behave(&ctx).await?;
    let seen = ctx
        .labels()
        .get("e2e/a")
        .and_then(Value::as_str)
        .unwrap_or("none")
        .to_owned();
    ctx.patch().label("e2e/b", format!("saw-a-{seen}"));
    Ok(None)
}

async fn plain(ctx: Context) -> HandlerResult {
    behave(&ctx).await?;
    Ok(None)
}

async fn with_result(ctx: Context) -> HandlerResult {
    behave(&ctx).await?;
    Ok(Some(
        json!({"message": format!("hello {}", ctx.name()), "attempts": ctx.retry() + 1}),
    ))
}

async fn field_fn(ctx: Context) -> HandlerResult {
    behave(&ctx).await?;
    let show = |v: Option<&Value>| {
        v.map_or_else(
            || "none".to_owned(),
            |v| v.as_str().map_or_else(|| v.to_string(), str::to_owned),
        )
    };
    ctx.patch()
        .annotation("e2e/field", format!("{}->{}", show(ctx.old()), show(ctx.new())));
    Ok(None)
}

/// Appends one line to `E2E_LOG` with a single `write`: concurrent invocations append whole
/// lines (`O_APPEND`), where `writeln!` on a `File` would write piece by piece and interleave.
fn note(line: &str) {
    let Ok(path) = std::env::var("E2E_LOG") else {
        return;
    };
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = f.write_all(format!("{line}\n").as_bytes());
    }
}

/// Kept in an object's memo by the `memo` preset: notes `memo-dropped <name>` when the memo
/// lets go of it (the object is gone).
struct MemoGuard(String);

impl Drop for MemoGuard {
    fn drop(&mut self) {
        note(&format!("memo-dropped {}", self.0));
    }
}

/// The `index` preset's index handler: `{<e2e/app label>: <name>}`.
async fn by_app(ctx: Context) -> HandlerResult {
    note(&format!("index {}", ctx.name()));
    // A ConfigMap annotated `e2e/slow` takes 3 s to index: a handler let through before the
    // index is built would show.
    if ctx.annotations().contains_key("e2e/slow") {
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    // `e2e/index-fail: permanent` fails for good; `e2e/index-fail: "N"` fails temporarily
    // (retried after 1 s) on the first N attempts.
    match ctx.annotations().get("e2e/index-fail").and_then(Value::as_str) {
        Some("permanent") => return Err(HandlerError::permanent("this ConfigMap cannot be indexed")),
        Some(n) if n.parse::<u32>().is_ok_and(|n| ctx.retry() < n) => {
            note(&format!("index-retry {} {}", ctx.name(), ctx.retry() + 1));
            return Err(HandlerError::temporary("not yet", Duration::from_secs(1)));
        }
        _ => {}
    }
    let app = ctx
        .labels()
        .get("e2e/app")
        .and_then(Value::as_str)
        .map(str::to_owned);
    Ok(app.map(|app| json!({ app: ctx.name() })))
}

/// The `index` preset's readers: the names under the example's `spec.app`, and the whole index.
async fn lookup(ctx: Context) -> HandlerResult {
    let index = ctx.index("by_app")?;
    note(&format!("lookup {} {}", ctx.name(), index.objects()));
    let app = ctx.spec()["app"].as_str().unwrap_or_default().to_owned();
    let names = index.get(&app).map(|s| s.values().to_vec()).unwrap_or_default();
    Ok(Some(json!({ "configmaps": names })))
}

async fn peek(ctx: Context) -> HandlerResult {
    let index = ctx.index("by_app")?;
    note(&format!("peek {} {}", std::process::id(), index.objects()));
    // `<key>=<name>` entries, sorted: a list, so that a merge patch replaces it whole.
    let mut entries: Vec<String> = index
        .snapshot()
        .into_iter()
        .flat_map(|(key, store)| {
            let key = key.unwrap_or_else(|| "None".into());
            store
                .into_iter()
                .map(move |v| format!("{key}={}", v.as_str().unwrap_or_default()))
        })
        .collect();
    entries.sort();
    ctx.patch().status("peek", json!(entries));
    Ok(None)
}

/// Reports progress with an interim patch, then runs until cancelled (or fails first when
/// `spec.temporary.monitor` says so); with `spec.finish.<id>: true` it returns a result at once.
async fn monitor(ctx: Context) -> HandlerResult {
    behave(&ctx).await?;
    let finish = ctx
        .spec()
        .get("finish")
        .and_then(|m| m.get(ctx.handler_id()))
        .and_then(Value::as_bool);
    if finish == Some(true) {
        return Ok(Some(
            json!({"finishedBy": ctx.handler_id(), "attempt": ctx.retry() + 1}),
        ));
    }
    let progress = Patch::new();
    progress.annotation("e2e/daemon", "running");
    ctx.send_patch(&progress)
        .await
        .map_err(|e| HandlerError::retry(e.to_string()))?;
    ctx.cancelled().await;
    let reason = ctx.cancel_reason().map_or("NONE", cancel_reason_name);
    note(&format!("daemon-stopped {} {reason}", ctx.name()));
    Ok(None)
}

/// A daemon that ignores its cancellation.
async fn stubborn(ctx: Context) -> HandlerResult {
    log_call(&ctx);
    tokio::time::sleep(Duration::from_secs(3600)).await;
    Ok(None)
}

/// Counts ticks in `status.ticks`, reading the latest body.
async fn tick(ctx: Context) -> HandlerResult {
    log_call(&ctx);
    // `spec.tickSleep: S` notes when each tick started (`tick-at <id> <name> <unix ms>`) and
    // makes it take S seconds.
    if let Some(secs) = ctx.spec().get("tickSleep").and_then(Value::as_f64) {
        let ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        note(&format!("tick-at {} {} {ms}", ctx.handler_id(), ctx.name()));
        tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    }
    let ticks = ctx.status()["ticks"].as_u64().unwrap_or(0) + 1;
    ctx.patch().status("ticks", ticks);
    Ok(None)
}

async fn parent(ctx: Context) -> HandlerResult {
    behave(&ctx).await?;
    for child in ["one", "two"] {
        ctx.subhandler(child, move |c: Context| async move {
            behave(&c).await?;
            c.patch().annotation(&format!("e2e/sub-{child}"), "done");
            Ok::<_, HandlerError>(None)
        });
    }
    Ok(None)
}

/// Notes the call, then marks the object as seen by this handler (`e2e/seen-<id>`).
async fn marking(ctx: Context) -> HandlerResult {
    behave(&ctx).await?;
    ctx.patch()
        .annotation(&format!("e2e/seen-{}", ctx.handler_id()), "yes");
    Ok(None)
}

/// Creates a ConfigMap that the object adopts (kopf's `adopt`), with the client of the
/// process's `KUBECONFIG`; its name goes to the result.
async fn spawn_child(ctx: Context) -> HandlerResult {
    log_call(&ctx);
    let mut child = json!({"apiVersion": "v1", "kind": "ConfigMap", "data": {"owner": ctx.name()}});
    ctx.adopt([&mut child], &capstan_sdk::hierarchies::Adoption::default())
        .map_err(|e| HandlerError::permanent(e.to_string()))?;
    let namespace = child
        .pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .unwrap_or("default")
        .to_owned();
    let configmap: k8s_openapi::api::core::v1::ConfigMap =
        serde_json::from_value(child).map_err(|e| HandlerError::permanent(e.to_string()))?;
    let client = kube::Client::try_default()
        .await
        .map_err(|e| HandlerError::retry(format!("no API client: {e}")))?;
    let created = kube::Api::<k8s_openapi::api::core::v1::ConfigMap>::namespaced(client, &namespace)
        .create(&kube::api::PostParams::default(), &configmap)
        .await
        .map_err(|e| HandlerError::retry(format!("creating the child: {e}")))?;
    Ok(Some(json!({"child": created.metadata.name})))
}

/// The `parity` preset: one handler (or a few) per kopf option, selected by `e2e/case`.
fn register_parity(registry: &mut Registry) {
    let case = |name: &'static str| ("e2e/case", name);
    // `optional`: no finalizer for it alone; called when another handler holds the finalizer
    // (the objects labelled `e2e/hold`).
    let (k, v) = case("optional");
    registry.on_create(RESOURCE, "opt_create", plain).label(k, v);
    registry
        .on_delete(RESOURCE, "opt_delete", plain)
        .label(k, v)
        .optional(true);
    registry
        .on_delete(RESOURCE, "hold_delete", plain)
        .label("e2e/hold", Presence::Present);
    // `resume` with and without `deleted`.
    let (k, v) = case("resume");
    registry
        .on_resume(RESOURCE, "resume_all", plain)
        .label(k, v)
        .deleted(true);
    registry.on_resume(RESOURCE, "resume_live", plain).label(k, v);
    // `param`: echoed back as the result.
    let (k, v) = case("param");
    registry
        .on_create(RESOURCE, "param_fn", |ctx: Context| async move {
            log_call(&ctx);
            Ok::<_, HandlerError>(Some(json!({"param": ctx.param().cloned()})))
        })
        .label(k, v)
        .param(json!({"greeting": "hello", "n": 7}));
    // `when`: only objects labelled `e2e/when: yes`; `when_witness` runs for all of them.
    let (k, v) = case("when");
    registry
        .on_create(RESOURCE, "when_fn", plain)
        .label(k, v)
        .when(|ctx: &Context| ctx.labels().get("e2e/when").and_then(Value::as_str) == Some("yes"));
    registry.on_create(RESOURCE, "when_witness", plain).label(k, v);
    // An overall timeout of 3 s with 1 s retry delays.
    let (k, v) = case("timeout");
    registry
        .on_create(RESOURCE, "timeout_fn", plain)
        .label(k, v)
        .timeout(Duration::from_secs(3));
    // Errors mode IGNORED, followed by another handler of the same cause.
    let (k, v) = case("ignored");
    registry
        .on_create(RESOURCE, "ignored_fn", plain)
        .label(k, v)
        .errors(capstan_sdk::ErrorsMode::Ignored)
        .backoff(Duration::from_secs(1));
    registry.on_create(RESOURCE, "after_ignored", plain).label(k, v);
    // For the progress storages: fails as its object's spec says.
    let (k, v) = case("storage");
    registry.on_create(RESOURCE, "stored_fn", plain).label(k, v);
    // Creates a ConfigMap adopted by its object (with the process's own kubeconfig).
    let (k, v) = case("children");
    registry
        .on_create(RESOURCE, "spawn_child", spawn_child)
        .label(k, v)
        .backoff(Duration::from_secs(1));
    // Core resources (empty API group), one namespaced and one cluster-scoped.
    let (k, v) = case("core");
    registry.on_create("configmaps", "cm_create", marking).label(k, v);
    registry.on_create("namespaces", "ns_create", marking).label(k, v);
}

async fn nest(ctx: Context) -> HandlerResult {
    behave(&ctx).await?;
    ctx.subhandler_with(
        "outer",
        capstan_sdk::SubhandlerOptions::new()
            .retries(5)
            .backoff(Duration::from_secs(1)),
        |outer: Context| async move {
            behave(&outer).await?;
            outer.subhandler("inner", |inner: Context| async move {
                behave(&inner).await?;
                inner.patch().annotation("e2e/sub-inner", "done");
                Ok::<_, HandlerError>(Some(json!({"attempts": inner.retry() + 1})))
            });
            outer.patch().annotation("e2e/sub-outer", "done");
            Ok::<_, HandlerError>(None)
        },
    );
    ctx.subhandler_with(
        "limited",
        capstan_sdk::SubhandlerOptions::new()
            .retries(2)
            .backoff(Duration::from_secs(1)),
        |limited: Context| async move {
            behave(&limited).await?;
            Ok::<_, HandlerError>(None)
        },
    );
    Ok(None)
}

/// The protocol's name of an event type (`EVENT_TYPE_ADDED`, …), as the tests expect it in
/// the notes.
fn event_type_name(event_type: capstan_sdk::EventType) -> &'static str {
    match event_type {
        capstan_sdk::EventType::Added => "EVENT_TYPE_ADDED",
        capstan_sdk::EventType::Modified => "EVENT_TYPE_MODIFIED",
        capstan_sdk::EventType::Deleted => "EVENT_TYPE_DELETED",
        _ => "EVENT_TYPE_UNSPECIFIED",
    }
}

/// The protocol's name of a cancel reason (`CANCEL_REASON_RESOURCE_DELETED`, …), as the tests
/// expect it in the notes.
fn cancel_reason_name(reason: capstan_sdk::CancelReason) -> &'static str {
    use capstan_sdk::CancelReason as R;
    match reason {
        R::ResourceDeleted => "CANCEL_REASON_RESOURCE_DELETED",
        R::FilterMismatch => "CANCEL_REASON_FILTER_MISMATCH",
        R::DeadlineExceeded => "CANCEL_REASON_DEADLINE_EXCEEDED",
        R::Superseded => "CANCEL_REASON_SUPERSEDED",
        R::RuntimeShutdown => "CANCEL_REASON_RUNTIME_SHUTDOWN",
        R::HandlerUnregistered => "CANCEL_REASON_HANDLER_UNREGISTERED",
        R::Paused => "CANCEL_REASON_PAUSED",
        _ => "CANCEL_REASON_UNSPECIFIED",
    }
}

/// Notes an admission call: `admission <id> <name> <operation> dry=<bool>`.
fn note_admission(ctx: &Context) {
    let request = ctx.admission();
    note(&format!(
        "admission {} {} {} dry={}",
        ctx.handler_id(),
        ctx.name(),
        request.map_or("?", |r| r.operation.as_str()),
        ctx.dry_run()
    ));
}

/// What admission handlers share: note the call, warn, and sleep or fail as
/// `spec.admission.<id>` says (`{"sleep": S}`, `{"fail": true}`, `{"deny": "message"}`).
async fn admission_behave(ctx: &Context) -> Result<(), HandlerError> {
    note_admission(ctx);
    let id = ctx.handler_id().to_owned();
    ctx.add_warning(format!("checked by {id}"));
    let setting = ctx.spec().get("admission").and_then(|a| a.get(&id)).cloned();
    if let Some(secs) = setting
        .as_ref()
        .and_then(|s| s.get("sleep"))
        .and_then(Value::as_f64)
    {
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs_f64(secs)) => {}
            () = ctx.cancelled() => {
                note(&format!("admission-cancelled {id} {}", ctx.name()));
                return Err(HandlerError::permanent("cancelled"));
            }
        }
    }
    if setting
        .as_ref()
        .and_then(|s| s.get("fail"))
        .and_then(Value::as_bool)
        == Some(true)
    {
        return Err(HandlerError::permanent(format!("{id} failed on purpose")));
    }
    if let Some(message) = setting
        .as_ref()
        .and_then(|s| s.get("deny"))
        .and_then(Value::as_str)
    {
        return Err(HandlerError::deny(message.to_owned(), 403));
    }
    Ok(())
}

/// Registers the admission presets; `false` for another name.
///
/// - `validate`: `check_size` denies `spec.size > 10` (422, "size N is too large");
/// - `validate2`: also `check_name`, which denies names starting with `bad-`;
/// - `mutate`: `add_defaults` sets the label `e2e/mutated: "yes"` and `spec.defaulted: true`;
///   `spec.badAdmissionPatch: true` makes it send a patch that does not apply;
/// - `mutate2`: also `copy_label`, which copies that label (as it sees it) to the annotation
///   `e2e/seen-mutated`;
/// - `validate-lenient`: `lenient`, which ignores failures;
/// - `validate-dry`: `dry_check`, with side effects, denying dry runs ("dry run seen").
fn admission_preset(registry: &mut Registry, preset: &str) -> bool {
    match preset {
        "validate" | "validate2" => {
            registry.on_validate(RESOURCE, "check_size", |ctx: Context| async move {
                admission_behave(&ctx).await?;
                match ctx.spec().get("size").and_then(Value::as_i64) {
                    Some(size) if size > 10 => {
                        Err(HandlerError::deny(format!("size {size} is too large"), 422))
                    }
                    _ => Ok::<_, HandlerError>(None),
                }
            });
            if preset == "validate2" {
                registry.on_validate(RESOURCE, "check_name", |ctx: Context| async move {
                    admission_behave(&ctx).await?;
                    if ctx.name().starts_with("bad-") {
                        return Err(HandlerError::deny(
                            format!("the name {} is not allowed", ctx.name()),
                            0,
                        ));
                    }
                    Ok::<_, HandlerError>(None)
                });
            }
        }
        "mutate" | "mutate2" => {
            registry.on_mutate(RESOURCE, "add_defaults", |ctx: Context| async move {
                admission_behave(&ctx).await?;
                if ctx.spec().get("badAdmissionPatch").and_then(Value::as_bool) == Some(true) {
                    ctx.patch()
                        .json_op(json!({"op": "remove", "path": "/spec/doesNotExist"}));
                    return Ok::<_, HandlerError>(None);
                }
                ctx.patch().label("e2e/mutated", "yes");
                ctx.patch().spec("defaulted", true);
                Ok(None)
            });
            if preset == "mutate2" {
                registry.on_mutate(RESOURCE, "copy_label", |ctx: Context| async move {
                    admission_behave(&ctx).await?;
                    let seen = ctx
                        .labels()
                        .get("e2e/mutated")
                        .and_then(Value::as_str)
                        .unwrap_or("none")
                        .to_owned();
                    ctx.patch().annotation("e2e/seen-mutated", seen);
                    Ok::<_, HandlerError>(None)
                });
            }
        }
        "validate-lenient" => {
            registry
                .on_validate(RESOURCE, "lenient", |ctx: Context| async move {
                    admission_behave(&ctx).await?;
                    Ok::<_, HandlerError>(None)
                })
                .ignore_failures(true);
        }
        "validate-dry" => {
            registry
                .on_validate(RESOURCE, "dry_check", |ctx: Context| async move {
                    admission_behave(&ctx).await?;
                    if ctx.dry_run() {
                        return Err(HandlerError::deny("dry run seen", 0));
                    }
                    Ok::<_, HandlerError>(None)
                })
                .side_effects(true);
        }
        _ => return false,
    }
    true
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()))
        .init();
    let presets = std::env::var("E2E_HANDLERS").unwrap_or_else(|_| "create3".into());
    let mut registry = Registry::new();
    for preset in presets.split(',').map(str::trim) {
        match preset {
            "create3" => {
                registry.on_create(RESOURCE, "create_a", create_a);
                registry.on_create(RESOURCE, "create_b", create_b);
                registry.on_create(RESOURCE, "create_c", |ctx: Context| async move {
                    behave(&ctx).await?;
                    ctx.info(format!("create_c says hello to {}", ctx.name()));
                    Ok::<_, HandlerError>(None)
                });
            }
            "create" => {
                registry.on_create(RESOURCE, "create_fn", plain);
            }
            "results" => {
                registry
                    .on_create(RESOURCE, "create_fn", with_result)
                    .backoff(Duration::from_secs(1));
            }
            "retries" => {
                registry
                    .on_create(RESOURCE, "limited", plain)
                    .retries(3)
                    .backoff(Duration::from_secs(1));
            }
            "update" => {
                registry.on_update(RESOURCE, "update_fn", with_result);
            }
            // Notes `seen <name> <spec.field>` per call: a change handled twice shows as a
            // repeated line (the sharding tests give every change a value of its own).
            "update-seen" => {
                registry.on_update(RESOURCE, "update_seen", |ctx: Context| async move {
                    let field = ctx
                        .spec()
                        .get("field")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_owned();
                    note(&format!("seen {} {field}", ctx.name()));
                    Ok::<_, HandlerError>(None)
                });
            }
            "delete" => {
                registry.on_delete(RESOURCE, "delete_fn", plain);
            }
            "optional-delete" => {
                registry.on_delete(RESOURCE, "delete_fn", plain).optional(true);
            }
            "resume" => {
                registry.on_resume(RESOURCE, "resume_fn", plain);
            }
            "field" => {
                registry.on_field(RESOURCE, "spec.field", "field_fn", field_fn);
            }
            "filtered" => {
                registry
                    .on_create(RESOURCE, "selected_fn", plain)
                    .label("e2e/select", "yes")
                    .annotation("e2e/skip", Presence::Absent);
            }
            // Present label, a field value, and a field that must exist.
            "value-filtered" => {
                registry
                    .on_create(RESOURCE, "sized_fn", plain)
                    .label("e2e/team", Presence::Present)
                    .field("spec.size")
                    .value(3);
                registry
                    .on_update(RESOURCE, "became_big_fn", plain)
                    .field("spec.size")
                    .old(3)
                    .new(10);
            }
            // Posts the same Event twice on the object named by `spec.announceTo` (kopf's
            // `kopf.info(other, …)`), which the controller aggregates into one Event.
            "announce" => {
                registry.on_create(RESOURCE, "announce_fn", |ctx: Context| async move {
                    log_call(&ctx);
                    let spec = ctx.spec();
                    let Some(target) = spec.get("announceTo").and_then(Value::as_str) else {
                        return Ok::<_, HandlerError>(None);
                    };
                    let object = capstan_sdk::ResourceRef {
                        group: "demo.capstan.dev".into(),
                        version: "v1".into(),
                        kind: "Example".into(),
                        plural: "examples".into(),
                        namespace: ctx.namespace().unwrap_or_default().to_owned(),
                        name: target.to_owned(),
                        ..Default::default()
                    };
                    for _ in 0..2 {
                        ctx.post_event_on(
                            &object,
                            capstan_sdk::LogLevel::Info,
                            "Announced",
                            format!("{} says hello", ctx.name()),
                        );
                    }
                    Ok(None)
                });
            }
            "subhandlers" => {
                registry
                    .on_create(RESOURCE, "parent", parent)
                    .backoff(Duration::from_secs(1));
            }
            // `nest` declares `outer` (5 retries of its own), which declares `inner`, and
            // `limited` (2 retries, 1 s backoff); all behave as their object's spec says, under
            // their full ids (`nest/outer/inner`).
            "nested-subhandlers" => {
                registry
                    .on_create(RESOURCE, "nest", nest)
                    .backoff(Duration::from_secs(1));
            }
            "event-overlap" => {
                registry
                    .on_event(RESOURCE, "event_fn", |ctx: Context| async move {
                        let t = match ctx.event_type() {
                            None | Some(capstan_sdk::EventType::Listed | capstan_sdk::EventType::Unknown) => {
                                "LISTING"
                            }
                            Some(t) => event_type_name(t),
                        };
                        note(&format!("event {} {t}", ctx.name()));
                        Ok::<_, HandlerError>(None)
                    })
                    .also_for("cex")
                    .also_for("Example");
            }
            "event" => {
                registry.on_event(RESOURCE, "event_fn", |ctx: Context| async move {
                    log_call(&ctx);
                    let t = ctx.event_type().map_or("LISTING", event_type_name);
                    note(&format!("event {} {t}", ctx.name()));
                    Ok::<_, HandlerError>(None)
                });
            }
            "daemon" => {
                registry
                    .daemon(RESOURCE, "monitor", monitor)
                    .restart_backoff(Duration::from_secs(1));
            }
            // A daemon only for objects labelled `e2e/run: "yes"`.
            "filtered-daemon" => {
                registry
                    .daemon(RESOURCE, "monitor", monitor)
                    .label("e2e/run", "yes")
                    .restart_backoff(Duration::from_secs(1));
            }
            // Daemons as kopf's: `monitor` for objects labelled `e2e/run: "yes"`, 3 attempts,
            // 1 s backoff; `deadline` for objects with the label `e2e/deadline`, 4 s in all.
            "lifecycle-daemon" => {
                registry
                    .daemon(RESOURCE, "monitor", monitor)
                    .label("e2e/run", "yes")
                    .retries(3)
                    .backoff(Duration::from_secs(1));
                registry
                    .daemon(RESOURCE, "deadline", monitor)
                    .label("e2e/deadline", Presence::Present)
                    .timeout(Duration::from_secs(4))
                    .backoff(Duration::from_secs(1));
            }
            // `monitor` starts 3 s after its object appears; `stubborn` (objects with the label
            // `e2e/stubborn`) ignores its cancellation, given 2 s of cancellation backoff and
            // 1 s of cancellation timeout.
            "delayed-daemon" => {
                registry
                    .daemon(RESOURCE, "monitor", monitor)
                    .label("e2e/stubborn", Presence::Absent)
                    .initial_delay(Duration::from_secs(3));
                registry
                    .daemon(RESOURCE, "stubborn", stubborn)
                    .label("e2e/stubborn", Presence::Present)
                    .cancellation_backoff(Duration::from_secs(2))
                    .cancellation_timeout(Duration::from_secs(1));
            }
            // kopf's handler options, each for the objects labelled `e2e/case: <case>`.
            "parity" => register_parity(&mut registry),
            // A daemon that ignores its cancellation and has no cancellation timeout.
            "stubborn-forever" => {
                registry.daemon(RESOURCE, "stubborn", stubborn);
            }
            // A handler id that is not valid in an annotation key as it is.
            "spaced" => {
                registry
                    .on_create(RESOURCE, "has space", plain)
                    .backoff(Duration::from_secs(1));
            }
            // A create handler with a timeout (for crash tests: the clock keeps running).
            "slow-timeout" => {
                registry
                    .on_create(RESOURCE, "slow", plain)
                    .timeout(Duration::from_secs(300))
                    .backoff(Duration::from_secs(1));
            }
            "stubborn-daemon" => {
                registry
                    .daemon(RESOURCE, "stubborn", stubborn)
                    .cancellation_timeout(Duration::from_secs(2));
            }
            "timer" => {
                registry
                    .timer(RESOURCE, "tick", tick)
                    .interval(Duration::from_secs(1));
            }
            // The same 1 s interval, from the end of the previous tick and sharp.
            "steady-and-sharp" => {
                registry
                    .timer(RESOURCE, "steady", tick)
                    .interval(Duration::from_secs(1));
                registry
                    .timer(RESOURCE, "sharp", tick)
                    .interval(Duration::from_secs(1))
                    .sharp(true);
            }
            "idle-timer" => {
                registry
                    .timer(RESOURCE, "tick", tick)
                    .interval(Duration::from_millis(500))
                    .idle(Duration::from_secs(2));
            }
            "delayed-timer" => {
                registry
                    .timer(RESOURCE, "tick", tick)
                    .interval(Duration::from_secs(1))
                    .initial_delay(Duration::from_secs(3));
            }
            // Node-local scoping: objects whose `spec.nodeName` is `E2E_NODE` and that do not
            // carry the label `e2e/skip`.
            "node-local" => {
                let node = std::env::var("E2E_NODE").unwrap_or_default();
                registry
                    .on_create(RESOURCE, "local_fn", plain)
                    .field_selector(format!("spec.nodeName={node}"))
                    .label_selector("!e2e/skip");
            }
            // An update handler that writes nothing (the fleet benchmark counts only the
            // controller's own bookkeeping).
            "update-plain" => {
                registry.on_update(RESOURCE, "update_fn", plain);
            }
            // Node-local work with cleanup: a create and a delete handler, both only for objects
            // whose `spec.nodeName` is `E2E_NODE` (the watch filters on the server when the
            // CRD makes the field selectable).
            "node-local-delete" => {
                let node = std::env::var("E2E_NODE").unwrap_or_default();
                registry
                    .on_create(RESOURCE, "local_fn", plain)
                    .field_selector(format!("spec.nodeName={node}"));
                registry
                    .on_delete(RESOURCE, "local_delete", plain)
                    .field_selector(format!("spec.nodeName={node}"));
            }
            "event-retry" => {
                registry
                    .on_event(RESOURCE, "event_retry", plain)
                    .errors(capstan_sdk::ErrorsMode::Temporary)
                    .retries(5)
                    .backoff(Duration::from_secs(1));
            }
            // Operator activities. Startup: fails with a temporary error (1 s) on the first
            // `E2E_STARTUP_FAILS` attempts (default 2), noting each attempt in `E2E_LOG`.
            "startup" => {
                registry.on_startup("startup_fn", |ctx: Context| async move {
                    let fails: u32 = std::env::var("E2E_STARTUP_FAILS")
                        .ok()
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(2);
                    note(&format!("startup attempt {}", ctx.retry() + 1));
                    if ctx.retry() < fails {
                        return Err(HandlerError::temporary(
                            "the database is not up yet",
                            Duration::from_secs(1),
                        ));
                    }
                    note("startup done");
                    Ok::<_, HandlerError>(None)
                });
            }
            "startup-permanent" => {
                registry.on_startup("startup_fn", |_ctx: Context| async move {
                    note("startup attempt");
                    Err::<Option<Value>, _>(HandlerError::permanent("the license key is invalid"))
                });
            }
            "cleanup" => {
                registry.on_cleanup("cleanup_fn", |_ctx: Context| async move {
                    note("cleanup ran");
                    Ok::<_, HandlerError>(None)
                });
            }
            "probe" => {
                registry.on_probe("probe_fn", |_ctx: Context| async move {
                    Ok::<_, HandlerError>(Some(json!({"answer": 42})))
                });
            }
            "probe-hang" => {
                registry.on_probe("hanging_probe", |ctx: Context| async move {
                    ctx.cancelled().await;
                    Ok::<_, HandlerError>(None)
                });
            }
            // Login: returns `E2E_LOGIN_SERVER`, `E2E_LOGIN_CA` (base64 PEM) and
            // `E2E_LOGIN_TOKEN`; with `E2E_LOGIN_BAD_FIRST=1` the first call returns a token the
            // API server rejects, with `E2E_LOGIN_EXPIRES_IN=S` credentials that expire in S s.
            "login" => {
                registry
                    .on_login("login_fn", |_ctx: Context| async move {
                        static CALLS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let var = |k: &str| std::env::var(k).unwrap_or_default();
                        let ca: k8s_openapi::ByteString =
                            serde_json::from_value(Value::String(var("E2E_LOGIN_CA")))
                                .map_err(|e| HandlerError::permanent(format!("E2E_LOGIN_CA: {e}")))?;
                        let bad = call == 0 && var("E2E_LOGIN_BAD_FIRST") == "1";
                        note(&format!("login call {} bad={bad}", call + 1));
                        // `E2E_LOGIN_EXPIRES_IN=S`: the credentials say they expire in S seconds.
                        let expiration = var("E2E_LOGIN_EXPIRES_IN")
                            .parse::<u64>()
                            .ok()
                            .map(|s| std::time::SystemTime::now() + Duration::from_secs(s));
                        Ok::<_, HandlerError>(capstan_sdk::Credentials {
                            server: var("E2E_LOGIN_SERVER"),
                            certificate_authority: ca.0,
                            token: if bad {
                                "not-a-valid-token".into()
                            } else {
                                var("E2E_LOGIN_TOKEN")
                            },
                            expiration,
                            ..Default::default()
                        })
                    })
                    .backoff(Duration::from_secs(1));
            }
            // A login handler that never answers, not even to its cancellation.
            "login-hang" => {
                registry.on_login("hanging_login", |_ctx: Context| async move {
                    note("login called");
                    std::future::pending::<()>().await;
                    Ok::<_, HandlerError>(capstan_sdk::Credentials::default())
                });
            }
            // A resource that does not exist when the handler process connects.
            "late" => {
                registry.on_create("widgets.late.capstan.dev", "late_create", plain);
            }
            // Counts calls per object in its memo (`memo <name> <calls>`) and keeps a guard
            // there that notes when the memo is dropped.
            "memo" => {
                registry.on_create(RESOURCE, "memo_fn", |ctx: Context| async move {
                    let name = ctx.name().to_owned();
                    ctx.memo().get_or_insert_with("guard", || MemoGuard(name.clone()));
                    let calls = ctx
                        .memo()
                        .get_or_insert_with("calls", || std::sync::atomic::AtomicU32::new(0));
                    let n = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                    note(&format!("memo {name} {n}"));
                    Ok::<_, HandlerError>(None)
                });
                registry.on_update(RESOURCE, "memo_update", |ctx: Context| async move {
                    let calls = ctx
                        .memo()
                        .get_or_insert_with("calls", || std::sync::atomic::AtomicU32::new(0));
                    let n = calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
                    note(&format!("memo {} {n}", ctx.name()));
                    Ok::<_, HandlerError>(None)
                });
            }
            "index" => {
                registry
                    .index("configmaps", "by_app", by_app)
                    .label("e2e/app", Presence::Present);
                registry.on_create(RESOURCE, "lookup_fn", lookup);
                registry
                    .timer(RESOURCE, "peek", peek)
                    .interval(Duration::from_secs(1));
            }
            "" => {}
            other if admission_preset(&mut registry, other) => {}
            other => anyhow::bail!("unknown preset {other:?}"),
        }
    }
    let endpoint = std::env::var("CAPSTAN_ENDPOINT").unwrap_or_else(|_| capstan_sdk::DEFAULT_ENDPOINT.into());
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
        }
    };
    Operator::new(registry).endpoint(endpoint).run(shutdown).await?;
    Ok(())
}
