//! [`CancelReason`]: why an invocation was cancelled.
//!
//! The SDK's own enum for the wire `CancelReason` (the names of the Go and TypeScript SDKs), so
//! that [`crate::Context::cancel_reason`] and the test kit never name a generated protocol
//! type. The cancellation machinery keeps the wire value; these conversions are at its edges.
//! Decoding is total: an unset or unknown reason is [`CancelReason::Unspecified`].

use crate::pb;

/// Why an invocation was cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CancelReason {
    /// The object was deleted (daemons).
    ResourceDeleted,
    /// The object no longer matches the handler's filters (daemons).
    FilterMismatch,
    /// The invocation's deadline passed.
    DeadlineExceeded,
    /// A newer version of the object made the invocation pointless.
    Superseded,
    /// The controller is shutting down, or the stream to it ended.
    RuntimeShutdown,
    /// The handler is no longer registered.
    HandlerUnregistered,
    /// The controller lost leadership or was frozen by a peer with a higher priority.
    Paused,
    /// No reason given, or one this SDK does not know.
    Unspecified,
}

impl CancelReason {
    /// The reason's name as the other SDKs spell it: `resource_deleted`, `filter_mismatch`,
    /// `deadline_exceeded`, `superseded`, `runtime_shutdown`, `handler_unregistered`, `paused`
    /// or `unspecified`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ResourceDeleted => "resource_deleted",
            Self::FilterMismatch => "filter_mismatch",
            Self::DeadlineExceeded => "deadline_exceeded",
            Self::Superseded => "superseded",
            Self::RuntimeShutdown => "runtime_shutdown",
            Self::HandlerUnregistered => "handler_unregistered",
            Self::Paused => "paused",
            Self::Unspecified => "unspecified",
        }
    }

    /// Decodes a wire reason.
    pub(crate) fn from_pb(reason: pb::CancelReason) -> Self {
        match reason {
            pb::CancelReason::ResourceDeleted => Self::ResourceDeleted,
            pb::CancelReason::FilterMismatch => Self::FilterMismatch,
            pb::CancelReason::DeadlineExceeded => Self::DeadlineExceeded,
            pb::CancelReason::Superseded => Self::Superseded,
            pb::CancelReason::RuntimeShutdown => Self::RuntimeShutdown,
            pb::CancelReason::HandlerUnregistered => Self::HandlerUnregistered,
            pb::CancelReason::Paused => Self::Paused,
            pb::CancelReason::Unspecified => Self::Unspecified,
        }
    }

    /// Encodes the reason for the wire.
    #[cfg_attr(not(feature = "testing"), allow(dead_code, reason = "used by the test kit"))]
    pub(crate) fn to_pb(self) -> pb::CancelReason {
        match self {
            Self::ResourceDeleted => pb::CancelReason::ResourceDeleted,
            Self::FilterMismatch => pb::CancelReason::FilterMismatch,
            Self::DeadlineExceeded => pb::CancelReason::DeadlineExceeded,
            Self::Superseded => pb::CancelReason::Superseded,
            Self::RuntimeShutdown => pb::CancelReason::RuntimeShutdown,
            Self::HandlerUnregistered => pb::CancelReason::HandlerUnregistered,
            Self::Paused => pb::CancelReason::Paused,
            Self::Unspecified => pb::CancelReason::Unspecified,
        }
    }
}

impl std::fmt::Display for CancelReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips() {
        for value in 0..8 {
            let wire = pb::CancelReason::try_from(value).unwrap_or_default();
            assert_eq!(CancelReason::from_pb(wire).to_pb(), wire);
        }
        assert_eq!(CancelReason::from_pb(pb::CancelReason::Paused).as_str(), "paused");
    }
}
