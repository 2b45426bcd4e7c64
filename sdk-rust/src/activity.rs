//! [`Activity`]: which operator activity a startup, cleanup or login handler runs for.
//!
//! The SDK's own enum for the wire `Activity` (the Go SDK's `ActivityStartup`/…), so that
//! [`crate::Context::activity`] and the test kit never name a generated protocol type.
//! Decoding is total: an unset or unknown activity is [`Activity::Unknown`].

use crate::pb;

/// An operator activity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Activity {
    /// Before watching starts (kopf's `on.startup`).
    Startup,
    /// When the controller stops (kopf's `on.cleanup`).
    Cleanup,
    /// Credentials are wanted (kopf's `on.login`).
    Login,
    /// An activity this SDK does not know, or none given.
    Unknown,
}

impl Activity {
    /// Decodes a wire activity.
    pub(crate) fn from_pb(activity: i32) -> Self {
        match pb::Activity::try_from(activity) {
            Ok(pb::Activity::Startup) => Self::Startup,
            Ok(pb::Activity::Cleanup) => Self::Cleanup,
            Ok(pb::Activity::Login) => Self::Login,
            _ => Self::Unknown,
        }
    }

    /// Encodes the activity for the wire; [`Activity::Unknown`] is sent as unset.
    #[cfg_attr(not(feature = "testing"), allow(dead_code, reason = "used by the test kit"))]
    pub(crate) fn to_pb(self) -> pb::Activity {
        match self {
            Self::Startup => pb::Activity::Startup,
            Self::Cleanup => pb::Activity::Cleanup,
            Self::Login => pb::Activity::Login,
            Self::Unknown => pb::Activity::Unspecified,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoding_is_total() {
        for a in [
            Activity::Startup,
            Activity::Cleanup,
            Activity::Login,
            Activity::Unknown,
        ] {
            assert_eq!(Activity::from_pb(a.to_pb() as i32), a);
        }
        assert_eq!(Activity::from_pb(42), Activity::Unknown);
    }
}
