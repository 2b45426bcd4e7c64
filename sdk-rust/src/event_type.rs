//! [`EventType`]: what a watch event says happened, for event handlers.
//!
//! The SDK's own enum for the wire `EventType` (the Go SDK's `EventListed`/`EventAdded`/…), so
//! that [`crate::Context::event_type`] and the test kit never name a generated protocol type.
//! Decoding is total: an unset type is [`EventType::Listed`] (the protocol's "seen in the
//! initial listing"), a type this SDK does not know is [`EventType::Unknown`].

use crate::pb;

/// The type of a watch event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum EventType {
    /// The object was seen in the initial listing, not through a watch event (kopf's
    /// `type=None`).
    Listed,
    /// `ADDED`.
    Added,
    /// `MODIFIED`.
    Modified,
    /// `DELETED`.
    Deleted,
    /// A type this SDK does not know.
    Unknown,
}

impl EventType {
    /// The Kubernetes name of the type (`ADDED`, `MODIFIED`, `DELETED`); `None` for
    /// [`EventType::Listed`] and [`EventType::Unknown`].
    pub fn as_k8s_str(self) -> Option<&'static str> {
        match self {
            Self::Added => Some("ADDED"),
            Self::Modified => Some("MODIFIED"),
            Self::Deleted => Some("DELETED"),
            Self::Listed | Self::Unknown => None,
        }
    }

    /// Decodes a wire type.
    pub(crate) fn from_pb(event_type: i32) -> Self {
        match pb::EventType::try_from(event_type) {
            Ok(pb::EventType::Unspecified) => Self::Listed,
            Ok(pb::EventType::Added) => Self::Added,
            Ok(pb::EventType::Modified) => Self::Modified,
            Ok(pb::EventType::Deleted) => Self::Deleted,
            Err(_) => Self::Unknown,
        }
    }

    /// Encodes the type for the wire; [`EventType::Unknown`] is sent as unset.
    #[cfg_attr(not(feature = "testing"), allow(dead_code, reason = "used by the test kit"))]
    pub(crate) fn to_pb(self) -> pb::EventType {
        match self {
            Self::Added => pb::EventType::Added,
            Self::Modified => pb::EventType::Modified,
            Self::Deleted => pb::EventType::Deleted,
            Self::Listed | Self::Unknown => pb::EventType::Unspecified,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decoding_is_total() {
        for t in [
            EventType::Listed,
            EventType::Added,
            EventType::Modified,
            EventType::Deleted,
        ] {
            assert_eq!(EventType::from_pb(t.to_pb() as i32), t);
        }
        assert_eq!(EventType::from_pb(42), EventType::Unknown);
        assert_eq!(EventType::Modified.as_k8s_str(), Some("MODIFIED"));
        assert_eq!(EventType::Listed.as_k8s_str(), None);
    }
}
