//! Runs one invocation: from a wire `Invocation` to its wire `InvocationResult`.
//!
//! This is the single place where handler code is called. The connection module feeds it the
//! invocations that arrive on the stream (one task each) and the test kit feeds it invocations
//! built in tests, so both exercise the same path: look up the handler, decode the invocation
//! into a [`Context`], evaluate the `when` filter, arm the deadline, call the handler, run the
//! sub-handlers it declared, and classify the outcome the way the protocol expects.
//!
//! # Guarantees
//!
//! Exactly one result per invocation, even when the handler panics (an unclassified error) or
//! the handler id is unknown (a permanent error). Patches ride only with a success. A handler
//! that returns an error after its invocation was cancelled is answered `Cancelled`; one that
//! returns success after a cancel is still a success.

use std::{sync::Arc, time::SystemTime};

use tokio::time::Instant;

use crate::{
    Context, HandlerError,
    classify::{call_guarded, diagnostic, failure, success},
    context::{Decoded, Parts},
    control::Control,
    convert,
    index::{Change, ObjectKey},
    outbox::Outbox,
    pb,
    pb::invocation_result::Outcome,
    registry::Table,
};

/// Runs `invocation` against the handler table and returns its result.
pub(crate) async fn run(
    table: &Table,
    invocation: pb::Invocation,
    control: Control,
    outbox: Outbox,
) -> pb::InvocationResult {
    let began = Instant::now();
    let invocation_id = invocation.invocation_id.clone();
    let mut result = run_inner(table, invocation, control, outbox).await;
    result.invocation_id = invocation_id;
    result.duration = Some(convert::duration_to_pb(began.elapsed()));
    result
}

async fn run_inner(
    table: &Table,
    invocation: pb::Invocation,
    control: Control,
    outbox: Outbox,
) -> pb::InvocationResult {
    let Some(entry) = table.get(&invocation.handler_id) else {
        let summary = format!(
            "no handler {:?} is registered in this process",
            invocation.handler_id
        );
        return finished(Outcome::PermanentError(pb::PermanentError {
            diagnostics: vec![diagnostic(summary, "UNKNOWN_HANDLER", "")],
        }));
    };
    let decoded = match Decoded::from_invocation(&invocation) {
        Ok(decoded) => Arc::new(decoded),
        Err(error) => {
            return finished(Outcome::PermanentError(pb::PermanentError {
                diagnostics: vec![diagnostic(
                    format!("the invocation carries malformed JSON: {error}"),
                    "INVALID_INVOCATION",
                    "",
                )],
            }));
        }
    };
    let kind = entry.kind();
    let invocation = Arc::new(invocation);
    let started = invocation
        .started_time
        .as_ref()
        .and_then(convert::timestamp_from_pb)
        .unwrap_or_else(SystemTime::now);
    let index_of = (kind == pb::HandlerKind::Index).then(|| object_key(&invocation));
    // The indexes this invocation's result belongs to: a new stream clears them, and a result
    // of an invocation of the earlier stream must not land in the new ones.
    let generation = table.indexes.generation();
    let apply = |object: &ObjectKey, change: Change| {
        if !table
            .indexes
            .apply(generation, &invocation.handler_id, object, change)
        {
            tracing::debug!(
                "the indexes were rebuilt since this invocation started; its result is not applied"
            );
        }
    };
    if let (Some(object), Some(pb::invocation::Payload::Index(request))) = (&index_of, &invocation.payload)
        && request.deleted
    {
        // The object left the index (deleted, or no longer matching): its entries go, and
        // the handler is not called (kopf).
        apply(object, Change::Remove);
        return finished(Outcome::Success(pb::Success::default()));
    }
    let uid = invocation.resource.as_ref().map_or("", |r| r.uid.as_str());
    let ctx = Context::from_parts(Parts {
        invocation: invocation.clone(),
        decoded: decoded.clone(),
        handler_id: invocation.handler_id.clone(),
        retry: invocation.attempt.saturating_sub(1),
        started,
        control: control.clone(),
        outbox: outbox.clone(),
        allow_subhandlers: is_change(kind),
        indexes: table.indexes.clone(),
        memo: table.memos.lazy(uid),
        operator_memo: table.memos.operator().clone(),
    });

    if let Some(when) = &entry.when
        && !when(&ctx)
    {
        tracing::debug!("the `when` filter rejected the invocation");
        if let Some(object) = &index_of {
            // kopf: an object the index handler's filters reject is not in that index.
            apply(object, Change::Remove);
        }
        return finished(Outcome::Skipped(pb::Skipped {}));
    }

    let call = call_guarded(entry.handler.call(ctx.clone()));
    let outcome = match invocation.deadline.as_ref().map(convert::until) {
        Some(remaining) => {
            tokio::pin!(call);
            tokio::select! {
                outcome = &mut call => outcome,
                () = tokio::time::sleep(remaining) => {
                    tracing::debug!("the deadline passed; cancelling");
                    control.cancel(pb::CancelReason::DeadlineExceeded);
                    call.await
                }
            }
        }
        None => call.await,
    };

    let outcome = outcome.and_then(|output| match &output.invalid {
        Some(error) => Err(HandlerError::permanent(format!(
            "handler {:?} returned a value that is not JSON-serialisable: {error}",
            invocation.handler_id
        ))),
        None => Ok(output),
    });
    if let Some(object) = &index_of {
        let change = match &outcome {
            Ok(output) => Change::from_result(output.value.as_ref()),
            // kopf: an ignored error keeps the object's values.
            Err(HandlerError::Unclassified { .. }) if errors_ignored(entry.registration.errors_mode) => {
                Change::Keep
            }
            Err(_) => Change::Remove,
        };
        apply(object, change);
    }
    let output = match outcome {
        Ok(output) => output,
        Err(_) if control.token().is_cancelled() => return finished(Outcome::Cancelled(pb::Cancelled {})),
        Err(HandlerError::Admission { message, code }) if is_admission(kind) => {
            let verdict = pb::AdmissionVerdict {
                allowed: false,
                message,
                code,
                warnings: ctx.take_warnings(),
            };
            return finished(Outcome::Success(pb::Success {
                result: None,
                kind_result: Some(pb::success::KindResult::Admission(verdict)),
            }));
        }
        Err(error) => return finished(failure(error).into()),
    };

    let mut patches = ctx.patch().to_pb();
    let children = crate::subhandling::Run {
        invocation: &invocation,
        decoded: &decoded,
        control: &control,
        outbox: &outbox,
        backoff: entry.registration.backoff.as_ref().map(convert::duration_from_pb),
    }
    .level(&ctx, "", 1)
    .await;
    patches.extend(children.patches);
    let subhandlers = children.outcomes;
    let kind_result = if is_admission(kind) {
        Some(pb::success::KindResult::Admission(pb::AdmissionVerdict {
            allowed: true,
            message: String::new(),
            code: 0,
            warnings: ctx.take_warnings(),
        }))
    } else {
        output
            .credentials
            .as_ref()
            .map(|credentials| pb::success::KindResult::Credentials(credentials.to_pb()))
    };
    pb::InvocationResult {
        outcome: Some(Outcome::Success(success(&output, kind_result))),
        patches,
        subhandlers,
        ..pb::InvocationResult::default()
    }
}

fn finished(outcome: Outcome) -> pb::InvocationResult {
    pb::InvocationResult {
        outcome: Some(outcome),
        ..pb::InvocationResult::default()
    }
}

/// The object an index invocation is for, as kopf keys it.
fn object_key(invocation: &pb::Invocation) -> ObjectKey {
    let r = invocation.resource.clone().unwrap_or_default();
    ObjectKey {
        namespace: r.namespace,
        name: r.name,
        uid: r.uid,
    }
}

/// Whether unclassified errors are ignored under this registration's errors mode (IGNORED is
/// the default of index handlers).
fn errors_ignored(mode: i32) -> bool {
    matches!(
        pb::ErrorsMode::try_from(mode),
        Ok(pb::ErrorsMode::Ignored | pb::ErrorsMode::Unspecified) | Err(_)
    )
}

fn is_change(kind: pb::HandlerKind) -> bool {
    matches!(
        kind,
        pb::HandlerKind::Create
            | pb::HandlerKind::Update
            | pb::HandlerKind::Delete
            | pb::HandlerKind::Resume
            | pb::HandlerKind::Field
    )
}

fn is_admission(kind: pb::HandlerKind) -> bool {
    matches!(kind, pb::HandlerKind::Validate | pb::HandlerKind::Mutate)
}

#[cfg(all(test, feature = "testing"))]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::Arc;

    use serde_json::json;
    use tokio::sync::Notify;

    use super::*;
    use crate::{Registry, testing::InvocationBuilder};

    #[tokio::test]
    async fn an_index_result_of_an_earlier_stream_is_not_applied() {
        let release = Arc::new(Notify::new());
        let mut registry = Registry::new();
        registry.index("configmaps", "by_name", {
            let release = release.clone();
            move |ctx: Context| {
                let release = release.clone();
                async move {
                    release.notified().await;
                    Ok::<_, HandlerError>(json!({"name": ctx.name()}))
                }
            }
        });
        let table = Arc::new(registry.into_table().unwrap());
        let mut invocation = InvocationBuilder::index(
            json!({"metadata": {"name": "a", "namespace": "default", "uid": "uid-a"}}),
        )
        .build();
        invocation.handler_id = "by_name".to_owned();
        let running = tokio::spawn({
            let table = table.clone();
            async move { run(&table, invocation, Control::new(), Outbox::channel().0).await }
        });
        tokio::task::yield_now().await;
        // A new stream starts: the indexes start over, and the old stream's invocation ends
        // only afterwards.
        table.indexes.clear();
        release.notify_one();
        running.await.unwrap();
        assert_eq!(
            table.indexes.get("by_name").unwrap().objects(),
            0,
            "a result of the earlier stream went into the new stream's index"
        );
    }
}
