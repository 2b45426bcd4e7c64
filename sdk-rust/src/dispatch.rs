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

use std::{
    panic::AssertUnwindSafe,
    sync::Arc,
    time::{Duration, SystemTime},
};

use futures::FutureExt;
use tokio::time::Instant;

use crate::{
    Context, HandlerError, HandlerOutput,
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
    if let (Some(object), Some(pb::invocation::Payload::Index(request))) = (&index_of, &invocation.payload)
        && request.deleted
    {
        // The object left the index (deleted, or no longer matching): its entries go, and
        // the handler is not called (kopf).
        table
            .indexes
            .apply(&invocation.handler_id, object, Change::Remove);
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
        memo: table.memos.object(uid),
        operator_memo: table.memos.operator().clone(),
    });

    if let Some(when) = &entry.when
        && !when(&ctx)
    {
        tracing::debug!("the `when` filter rejected the invocation");
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
        table.indexes.apply(&invocation.handler_id, object, change);
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
    let subhandlers = run_subhandlers(&ctx, &invocation, &decoded, &control, &outbox, &mut patches).await;
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
            .clone()
            .map(pb::success::KindResult::Credentials)
    };
    pb::InvocationResult {
        outcome: Some(Outcome::Success(success(&output, kind_result))),
        patches,
        subhandlers,
        ..pb::InvocationResult::default()
    }
}

/// Runs the declared sub-handlers that are not finished, collecting their outcomes and the
/// patches of those that succeeded.
async fn run_subhandlers(
    parent: &Context,
    invocation: &Arc<pb::Invocation>,
    decoded: &Arc<Decoded>,
    control: &Control,
    outbox: &Outbox,
    patches: &mut Vec<pb::Patch>,
) -> Vec<pb::SubhandlerOutcome> {
    let mut outcomes = Vec::new();
    for (id, handler) in parent.take_subhandlers() {
        if control.token().is_cancelled() {
            break;
        }
        let state = invocation.subhandlers.iter().find(|s| s.subhandler_id == id);
        if let Some(state) = state {
            let waiting = state
                .delayed_until
                .as_ref()
                .is_some_and(|t| convert::until(t) > Duration::ZERO);
            if state.success || state.failure || waiting {
                continue;
            }
        }
        let child = Context::from_parts(Parts {
            invocation: invocation.clone(),
            decoded: decoded.clone(),
            handler_id: format!("{}/{id}", parent.handler_id()),
            retry: state.map_or(0, |s| s.retries),
            started: state
                .and_then(|s| s.started_time.as_ref())
                .and_then(convert::timestamp_from_pb)
                .unwrap_or_else(SystemTime::now),
            control: control.clone(),
            outbox: outbox.clone(),
            allow_subhandlers: false,
            indexes: parent.indexes(),
            memo: parent.memo().clone(),
            operator_memo: parent.operator_memo().clone(),
        });
        let outcome = match call_guarded(handler.call(child.clone())).await {
            Ok(output) => {
                patches.extend(child.patch().to_pb());
                pb::subhandler_outcome::Outcome::Success(success(&output, None))
            }
            Err(error) => match failure(error) {
                Failure::Temporary(e) => pb::subhandler_outcome::Outcome::TemporaryError(e),
                Failure::Permanent(e) => pb::subhandler_outcome::Outcome::PermanentError(e),
                Failure::Unclassified(e) => pb::subhandler_outcome::Outcome::UnclassifiedError(e),
            },
        };
        outcomes.push(pb::SubhandlerOutcome {
            subhandler_id: id,
            outcome: Some(outcome),
        });
    }
    outcomes
}

/// Calls a handler future, turning a panic into an unclassified error.
async fn call_guarded(
    call: futures::future::BoxFuture<'static, Result<HandlerOutput, HandlerError>>,
) -> Result<HandlerOutput, HandlerError> {
    match AssertUnwindSafe(call).catch_unwind().await {
        Ok(outcome) => outcome,
        Err(panic) => {
            let text = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic".to_owned());
            Err(HandlerError::Unclassified {
                error_type: "panic",
                source: format!("the handler panicked: {text}").into(),
            })
        }
    }
}

enum Failure {
    Temporary(pb::TemporaryError),
    Permanent(pb::PermanentError),
    Unclassified(pb::UnclassifiedError),
}

impl From<Failure> for Outcome {
    fn from(failure: Failure) -> Self {
        match failure {
            Failure::Temporary(e) => Outcome::TemporaryError(e),
            Failure::Permanent(e) => Outcome::PermanentError(e),
            Failure::Unclassified(e) => Outcome::UnclassifiedError(e),
        }
    }
}

fn failure(error: HandlerError) -> Failure {
    let summary = error.message();
    match error {
        HandlerError::Temporary { delay, .. } => Failure::Temporary(pb::TemporaryError {
            retry_after: delay.map(convert::duration_to_pb),
            diagnostics: vec![diagnostic(summary, "TEMPORARY_ERROR", "")],
        }),
        HandlerError::Permanent(_) | HandlerError::Admission { .. } => {
            Failure::Permanent(pb::PermanentError {
                diagnostics: vec![diagnostic(summary, "PERMANENT_ERROR", "")],
            })
        }
        HandlerError::Unclassified { error_type, .. } => Failure::Unclassified(pb::UnclassifiedError {
            diagnostics: vec![diagnostic(summary, "HANDLER_ERROR", error_type)],
        }),
    }
}

fn success(output: &HandlerOutput, kind_result: Option<pb::success::KindResult>) -> pb::Success {
    pb::Success {
        result: output.value.as_ref().map(convert::json_to_pb),
        kind_result,
    }
}

fn finished(outcome: Outcome) -> pb::InvocationResult {
    pb::InvocationResult {
        outcome: Some(outcome),
        ..pb::InvocationResult::default()
    }
}

fn diagnostic(summary: String, reason: &str, error_type: &str) -> pb::Diagnostic {
    pb::Diagnostic {
        severity: pb::Severity::Error as i32,
        summary,
        reason: reason.to_owned(),
        error_type: error_type.to_owned(),
        ..pb::Diagnostic::default()
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
