//! [`Diagnostic`]: why an earlier attempt failed ([`crate::Context::last_error`]), and what a
//! failed invocation reported in the test kit.
//!
//! The SDK's own read-only view of the wire `Diagnostic` (the fields handlers use, as in the Go
//! and TypeScript SDKs), decoded here so handler code never names a generated protocol type.

use crate::pb;

/// A description of a failure.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Diagnostic {
    /// One line for humans.
    pub summary: String,
    /// A longer explanation; may be empty.
    pub detail: String,
    /// An `UPPER_SNAKE_CASE` code, e.g. `TEMPORARY_ERROR`; may be empty.
    pub reason: String,
    /// The type of the error on the handler side; may be empty.
    pub error_type: String,
}

impl Diagnostic {
    /// Decodes a wire diagnostic.
    pub(crate) fn from_pb(diagnostic: &pb::Diagnostic) -> Self {
        Self {
            summary: diagnostic.summary.clone(),
            detail: diagnostic.detail.clone(),
            reason: diagnostic.reason.clone(),
            error_type: diagnostic.error_type.clone(),
        }
    }
}
