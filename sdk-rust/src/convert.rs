//! Conversions between protocol wire types and the Rust types the SDK exposes.
//!
//! JSON travels as UTF-8 text inside `pb::Json`, times as protobuf `Timestamp`/`Duration`. These
//! small helpers keep that detail out of the context, dispatch and test-kit modules.

use std::time::{Duration, SystemTime};

use serde_json::Value;

use crate::pb;

/// Encodes a JSON value for the wire.
pub(crate) fn json_to_pb(value: &Value) -> pb::Json {
    pb::Json {
        json: value.to_string().into_bytes(),
    }
}

/// Decodes an optional wire JSON value; unset stays `None`.
pub(crate) fn json_from_pb(json: Option<&pb::Json>) -> Result<Option<Value>, serde_json::Error> {
    json.map(|json| serde_json::from_slice(&json.json)).transpose()
}

/// Encodes a duration, saturating at protobuf's range.
pub(crate) fn duration_to_pb(duration: Duration) -> prost_types::Duration {
    prost_types::Duration::try_from(duration).unwrap_or(prost_types::Duration {
        seconds: i64::MAX,
        nanos: 0,
    })
}

/// Decodes a duration; negative durations become zero.
pub(crate) fn duration_from_pb(duration: &prost_types::Duration) -> Duration {
    Duration::try_from(*duration).unwrap_or(Duration::ZERO)
}

/// Encodes a wall-clock time.
pub(crate) fn timestamp_to_pb(time: SystemTime) -> prost_types::Timestamp {
    prost_types::Timestamp::from(time)
}

/// Decodes a wall-clock time, if it is representable.
pub(crate) fn timestamp_from_pb(timestamp: &prost_types::Timestamp) -> Option<SystemTime> {
    SystemTime::try_from(*timestamp).ok()
}

/// How long from now until `timestamp`; zero if it has passed.
pub(crate) fn until(timestamp: &prost_types::Timestamp) -> Duration {
    timestamp_from_pb(timestamp)
        .and_then(|at| at.duration_since(SystemTime::now()).ok())
        .unwrap_or(Duration::ZERO)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn json_round_trips_large_integers() {
        let value = serde_json::json!({"n": 9_007_199_254_740_993_u64});
        let back = json_from_pb(Some(&json_to_pb(&value))).unwrap();
        assert_eq!(back, Some(value));
        assert_eq!(json_from_pb(None).unwrap(), None);
    }

    #[test]
    fn durations_and_times_convert() {
        let d = Duration::from_millis(1500);
        assert_eq!(duration_from_pb(&duration_to_pb(d)), d);
        let past = timestamp_to_pb(SystemTime::UNIX_EPOCH);
        assert_eq!(until(&past), Duration::ZERO);
        assert_eq!(timestamp_from_pb(&past), Some(SystemTime::UNIX_EPOCH));
    }
}
