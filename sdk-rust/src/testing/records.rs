//! What the test kit reports and takes, as the SDK's own types: sub-handler states fed into an
//! invocation, and the patches, progress updates and admission verdicts it produced.
//!
//! The kit keeps the wire messages the controller would see; these types are their read-only
//! views (and, for [`SubhandlerState`], the input a test builds), so tests never name a
//! generated protocol type. The names follow the TypeScript SDK's test kit. Decoding is total:
//! unknown enum values map to an `Unknown` variant and undecodable JSON to `null`.

use std::time::SystemTime;

use serde_json::Value;

use crate::{convert, pb};

/// The persisted state of one sub-handler, as the controller sends it with a parent's
/// invocation ([`super::InvocationBuilder::subhandler_state`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SubhandlerState {
    /// The sub-handler's id, relative to its parent (`child`, or `child/grandchild`).
    pub id: String,
    /// How many attempts were made.
    pub retries: u32,
    /// It succeeded.
    pub success: bool,
    /// It failed for good.
    pub failure: bool,
    /// It is not retried before this time.
    pub delayed_until: Option<SystemTime>,
    /// The last failure's message.
    pub message: String,
    /// When its first attempt started.
    pub started: Option<SystemTime>,
}

impl SubhandlerState {
    /// Encodes the state for the wire.
    pub(crate) fn to_pb(&self) -> pb::SubhandlerState {
        pb::SubhandlerState {
            subhandler_id: self.id.clone(),
            retries: self.retries,
            success: self.success,
            failure: self.failure,
            delayed_until: self.delayed_until.map(convert::timestamp_to_pb),
            message: self.message.clone(),
            started_time: self.started.map(convert::timestamp_to_pb),
        }
    }
}

/// How a [`PatchDocument`] is to be applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PatchKind {
    /// An RFC 7386 JSON merge patch (an object).
    Merge,
    /// An RFC 6902 JSON patch (a list of operations).
    Json,
    /// A kind this SDK does not know.
    Unknown,
}

/// What a [`PatchDocument`] is applied to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PatchTarget {
    /// The object (metadata, spec).
    Object,
    /// The status subresource.
    Status,
    /// A target this SDK does not know.
    Unknown,
}

/// One patch as the controller receives it with a result or a progress update.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct PatchDocument {
    /// How it is applied.
    pub kind: PatchKind,
    /// What it is applied to.
    pub target: PatchTarget,
    /// The patch document.
    pub body: Value,
}

impl PatchDocument {
    /// Decodes a wire patch.
    pub(crate) fn from_pb(patch: &pb::Patch) -> Self {
        let kind = match pb::PatchType::try_from(patch.r#type) {
            Ok(pb::PatchType::Merge) => PatchKind::Merge,
            Ok(pb::PatchType::Json) => PatchKind::Json,
            _ => PatchKind::Unknown,
        };
        let target = match pb::PatchTarget::try_from(patch.target) {
            Ok(pb::PatchTarget::Object) => PatchTarget::Object,
            Ok(pb::PatchTarget::Status) => PatchTarget::Status,
            _ => PatchTarget::Unknown,
        };
        Self {
            kind,
            target,
            body: convert::json_from_pb(patch.body.as_ref())
                .ok()
                .flatten()
                .unwrap_or(Value::Null),
        }
    }
}

/// Patches a running handler sent before it returned ([`crate::Context::send_patch`]).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct ProgressUpdate {
    /// The patches, in order.
    pub patches: Vec<PatchDocument>,
}

impl ProgressUpdate {
    /// Decodes a wire update.
    pub(crate) fn from_pb(update: &pb::InvocationUpdate) -> Self {
        Self {
            patches: update.patches.iter().map(PatchDocument::from_pb).collect(),
        }
    }
}

/// What an admission handler answered.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct AdmissionVerdict {
    /// The request is allowed.
    pub allowed: bool,
    /// Why not, for denials.
    pub message: String,
    /// The HTTP status code of a denial; 0 for the default.
    pub code: i32,
    /// Warnings returned to the client.
    pub warnings: Vec<String>,
}

impl AdmissionVerdict {
    /// Decodes a wire verdict.
    pub(crate) fn from_pb(verdict: &pb::AdmissionVerdict) -> Self {
        Self {
            allowed: verdict.allowed,
            message: verdict.message.clone(),
            code: verdict.code,
            warnings: verdict.warnings.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn patches_decode_totally() {
        let patch = PatchDocument::from_pb(&pb::Patch {
            r#type: pb::PatchType::Json as i32,
            target: pb::PatchTarget::Status as i32,
            body: Some(convert::json_to_pb(&json!([]))),
        });
        assert_eq!(
            (patch.kind, patch.target, patch.body),
            (PatchKind::Json, PatchTarget::Status, json!([]))
        );
        let odd = PatchDocument::from_pb(&pb::Patch {
            r#type: 9,
            target: 9,
            body: None,
        });
        assert_eq!(
            (odd.kind, odd.target, odd.body),
            (PatchKind::Unknown, PatchTarget::Unknown, Value::Null)
        );
    }

    #[test]
    fn subhandler_states_encode_every_field() {
        let state = SubhandlerState {
            id: "child".into(),
            retries: 2,
            failure: true,
            message: "no".into(),
            delayed_until: Some(SystemTime::UNIX_EPOCH),
            ..SubhandlerState::default()
        };
        let wire = state.to_pb();
        assert_eq!(
            (wire.subhandler_id.as_str(), wire.retries, wire.failure),
            ("child", 2, true)
        );
        assert_eq!(wire.delayed_until.map(|t| t.seconds), Some(0));
        assert_eq!(wire.started_time, None);
    }
}
