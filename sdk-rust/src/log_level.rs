//! [`LogLevel`]: the severity of a handler's log record or posted Event.
//!
//! The SDK's own enum for the wire `LogLevel` (the levels of the Go and TypeScript SDKs), so
//! that [`crate::Context::log`] and the test kit's log entries never name a generated protocol
//! type. Decoding is total: a level this SDK does not know reads as [`LogLevel::Info`], as the
//! protocol says an unset level does.

use crate::pb;

/// The severity of a log record.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LogLevel {
    /// Details for debugging; not posted as an Event by the posting level (an explicit
    /// [`crate::Context::post_event_on`] posts whatever the level).
    Debug,
    /// Normal progress; may be posted as a Normal Event.
    Info,
    /// Something is off; may be posted as a Warning Event.
    Warning,
    /// Something failed; may be posted as a Warning Event.
    Error,
}

impl LogLevel {
    /// Encodes the level for the wire.
    pub(crate) fn to_pb(self) -> pb::LogLevel {
        match self {
            Self::Debug => pb::LogLevel::Debug,
            Self::Info => pb::LogLevel::Info,
            Self::Warning => pb::LogLevel::Warning,
            Self::Error => pb::LogLevel::Error,
        }
    }

    /// Decodes a wire level; unset and unknown levels are [`LogLevel::Info`].
    #[cfg_attr(not(feature = "testing"), allow(dead_code, reason = "used by the test kit"))]
    pub(crate) fn from_pb(level: i32) -> Self {
        match pb::LogLevel::try_from(level) {
            Ok(pb::LogLevel::Debug) => Self::Debug,
            Ok(pb::LogLevel::Warning) => Self::Warning,
            Ok(pb::LogLevel::Error) => Self::Error,
            _ => Self::Info,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_defaults_to_info() {
        for level in [
            LogLevel::Debug,
            LogLevel::Info,
            LogLevel::Warning,
            LogLevel::Error,
        ] {
            assert_eq!(LogLevel::from_pb(level.to_pb() as i32), level);
        }
        assert_eq!(LogLevel::from_pb(0), LogLevel::Info);
        assert_eq!(LogLevel::from_pb(99), LogLevel::Info);
    }
}
