//! Errors: how a handler reports a failure ([`HandlerError`]) and how the SDK itself fails
//! ([`Error`]).
//!
//! [`HandlerError`] mirrors kopf's exceptions: a temporary error is retried after a delay, a
//! permanent one is final until the next change, and anything else is "unclassified" and left to
//! the handler's errors mode in the controller. Any error type converts into it, so `?` works
//! inside handlers. [`Error`] is the SDK's own failure (invalid registrations, unusable endpoint,
//! a controller that accepted none of the handlers); the dispatch and connection modules produce
//! it and [`crate::Operator::run`] returns it.

use std::{error::Error as StdError, fmt, time::Duration};

/// A module-local result with the SDK's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// How a handler failed: kopf's `TemporaryError`, `PermanentError`, `AdmissionError` or any
/// other exception.
///
/// `HandlerError` deliberately does not implement [`std::error::Error`]: that lets every error
/// type (and `anyhow::Error`, strings, …) convert into it with `?`, becoming
/// [`HandlerError::Unclassified`].
#[non_exhaustive]
pub enum HandlerError {
    /// The handler may succeed later: retry after `delay` (`None`: the handler's backoff).
    Temporary {
        /// What went wrong.
        message: String,
        /// How long to wait before the next attempt.
        delay: Option<Duration>,
    },
    /// The handler failed for good; it is not retried until the next change.
    Permanent(String),
    /// An admission handler denies the request (kopf's `AdmissionError`). For other handler
    /// kinds it is a permanent error.
    Admission {
        /// The message shown to the user.
        message: String,
        /// The HTTP status code; 0 means 400.
        code: i32,
    },
    /// An error the handler did not classify; the registration's errors mode decides.
    Unclassified {
        /// The Rust type name of the original error.
        error_type: &'static str,
        /// The original error.
        source: Box<dyn StdError + Send + Sync + 'static>,
    },
}

impl HandlerError {
    /// A temporary error: retry after `delay`.
    pub fn temporary(message: impl Into<String>, delay: Duration) -> Self {
        Self::Temporary {
            message: message.into(),
            delay: Some(delay),
        }
    }

    /// A temporary error retried after the handler's backoff.
    pub fn retry(message: impl Into<String>) -> Self {
        Self::Temporary {
            message: message.into(),
            delay: None,
        }
    }

    /// A permanent error: not retried until the next change of the object.
    pub fn permanent(message: impl Into<String>) -> Self {
        Self::Permanent(message.into())
    }

    /// Denies an admission request with `message` and HTTP status `code` (0 means 400).
    pub fn deny(message: impl Into<String>, code: i32) -> Self {
        Self::Admission {
            message: message.into(),
            code,
        }
    }

    /// The error's message, including the chain of causes for unclassified errors.
    pub fn message(&self) -> String {
        match self {
            Self::Temporary { message, .. } | Self::Permanent(message) => message.clone(),
            Self::Admission { message, .. } => message.clone(),
            Self::Unclassified { source, .. } => {
                let mut text = source.to_string();
                let mut cause = source.source();
                while let Some(inner) = cause {
                    text.push_str(": ");
                    text.push_str(&inner.to_string());
                    cause = inner.source();
                }
                text
            }
        }
    }
}

impl fmt::Debug for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Temporary { message, delay } => f
                .debug_struct("Temporary")
                .field("message", message)
                .field("delay", delay)
                .finish(),
            Self::Permanent(message) => f.debug_tuple("Permanent").field(message).finish(),
            Self::Admission { message, code } => f
                .debug_struct("Admission")
                .field("message", message)
                .field("code", code)
                .finish(),
            Self::Unclassified { error_type, source } => f
                .debug_struct("Unclassified")
                .field("error_type", error_type)
                .field("source", source)
                .finish(),
        }
    }
}

impl fmt::Display for HandlerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Temporary { .. } => write!(f, "temporary error: {}", self.message()),
            Self::Permanent(_) => write!(f, "permanent error: {}", self.message()),
            Self::Admission { .. } => write!(f, "admission denied: {}", self.message()),
            Self::Unclassified { .. } => write!(f, "{}", self.message()),
        }
    }
}

impl<E> From<E> for HandlerError
where
    E: Into<Box<dyn StdError + Send + Sync + 'static>>,
{
    fn from(error: E) -> Self {
        Self::Unclassified {
            error_type: std::any::type_name::<E>(),
            source: error.into(),
        }
    }
}

/// The SDK's own errors.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A handler registration is inconsistent (kopf raises these at decoration time).
    #[error("invalid registration of handler {handler_id:?}: {reason}")]
    Register {
        /// The handler id.
        handler_id: String,
        /// What is wrong.
        reason: String,
    },
    /// The endpoint is neither `unix://PATH` nor `http(s)://HOST:PORT`.
    #[error("invalid endpoint {endpoint:?}")]
    InvalidEndpoint {
        /// The endpoint as given.
        endpoint: String,
        /// The parser's complaint, if any.
        #[source]
        source: Option<tonic::transport::Error>,
    },
    /// The controller accepted none of the handlers and ended the stream with
    /// FAILED_PRECONDITION; reconnecting would not help.
    #[error("the controller accepted none of the handlers: {}", status.message())]
    Rejected {
        /// The status the controller ended the stream with.
        #[source]
        status: tonic::Status,
    },
    /// The connected controller does not run some of the registered handler kinds (its
    /// `Welcome` rejected them with `UNSUPPORTED_HANDLER_KIND`): the operator would silently
    /// miss them, so it stops instead. Upgrade the controller or remove those handlers.
    #[error(
        "the controller does not run these handlers' kinds: {}",
        describe_unsupported(handlers)
    )]
    Unsupported {
        /// Each handler id with the controller's explanation.
        handlers: Vec<(String, String)>,
    },
    /// The stream to the controller is gone, so nothing more can be sent for this invocation.
    #[error("the stream to the controller is closed")]
    StreamClosed,
}

fn describe_unsupported(handlers: &[(String, String)]) -> String {
    handlers
        .iter()
        .map(|(id, why)| format!("{id:?} ({why})"))
        .collect::<Vec<_>>()
        .join(", ")
}
