//! How a handler's answer becomes a wire outcome: a panic is caught as an unclassified error,
//! errors are classified as the protocol's temporary, permanent or unclassified failures, and
//! successes carry their value. Shared by the dispatch of invocations and the sub-handlers they
//! run, so that both classify alike.

use std::panic::AssertUnwindSafe;

use futures::FutureExt;

use crate::{HandlerError, HandlerOutput, convert, pb, pb::invocation_result::Outcome};

/// Calls a handler future, turning a panic into an unclassified error.
pub(crate) async fn call_guarded(
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

pub(crate) enum Failure {
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

pub(crate) fn failure(error: HandlerError) -> Failure {
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

pub(crate) fn success(output: &HandlerOutput, kind_result: Option<pb::success::KindResult>) -> pb::Success {
    pb::Success {
        result: output.value.as_ref().map(convert::json_to_pb),
        kind_result,
    }
}

pub(crate) fn diagnostic(summary: String, reason: &str, error_type: &str) -> pb::Diagnostic {
    pb::Diagnostic {
        severity: pb::Severity::Error as i32,
        summary,
        reason: reason.to_owned(),
        error_type: error_type.to_owned(),
        ..pb::Diagnostic::default()
    }
}
