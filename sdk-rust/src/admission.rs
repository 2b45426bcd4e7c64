//! [`AdmissionRequest`] and [`Operation`]: what validating and mutating handlers are asked
//! about, and which operations they intercept.
//!
//! The SDK's own types for the wire `AdmissionRequest` and `Operation` (named as in the Go and
//! TypeScript SDKs), so that [`crate::Context::admission`] and
//! [`crate::HandlerOptions::operations`] never name a generated protocol type. The request's
//! JSON parts are decoded here once per invocation: an operation this SDK does not know is
//! [`Operation::Unknown`], and an undecodable JSON part fails the invocation, as an
//! undecodable body does.

use std::collections::HashMap;

use serde_json::Value;

use crate::{convert, pb};

/// An operation of an admission review.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Operation {
    /// `CREATE`.
    Create,
    /// `UPDATE`.
    Update,
    /// `DELETE`.
    Delete,
    /// `CONNECT`.
    Connect,
    /// An operation this SDK does not know; naming it in
    /// [`crate::HandlerOptions::operations`] fails the registration.
    #[default]
    Unknown,
}

impl Operation {
    /// The Kubernetes name of the operation (`CREATE`, `UPDATE`, `DELETE`, `CONNECT`); empty
    /// for [`Operation::Unknown`].
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Create => "CREATE",
            Self::Update => "UPDATE",
            Self::Delete => "DELETE",
            Self::Connect => "CONNECT",
            Self::Unknown => "",
        }
    }

    /// Parses a Kubernetes operation name; anything else is [`Operation::Unknown`].
    pub fn parse(name: &str) -> Self {
        match name {
            "CREATE" => Self::Create,
            "UPDATE" => Self::Update,
            "DELETE" => Self::Delete,
            "CONNECT" => Self::Connect,
            _ => Self::Unknown,
        }
    }

    /// Encodes the operation for a registration.
    pub(crate) fn to_pb(self) -> pb::Operation {
        match self {
            Self::Create => pb::Operation::Create,
            Self::Update => pb::Operation::Update,
            Self::Delete => pb::Operation::Delete,
            Self::Connect => pb::Operation::Connect,
            Self::Unknown => pb::Operation::Unspecified,
        }
    }
}

impl std::fmt::Display for Operation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The admission review a validating or mutating handler is asked about (kopf's webhook
/// kwargs); the object under review is [`crate::Context::body`].
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct AdmissionRequest {
    /// The review's uid.
    pub uid: String,
    /// The operation under review.
    pub operation: Operation,
    /// The subresource, if any (empty otherwise).
    pub subresource: String,
    /// Nothing will be stored: no side effects allowed.
    pub dry_run: bool,
    /// The object before the operation (UPDATE, DELETE); `None` otherwise.
    pub old_object: Option<Value>,
    /// The requesting user (username, uid, groups, extra).
    pub user_info: Option<Value>,
    /// The HTTP headers of the review request the controller received.
    pub headers: HashMap<String, String>,
}

impl AdmissionRequest {
    /// Decodes a wire request.
    ///
    /// # Errors
    /// When the old object or the user info is not JSON: the invocation fails, as for an
    /// undecodable body (a missing old object and a broken one must not look alike).
    pub(crate) fn from_pb(request: &pb::AdmissionRequest) -> Result<Self, serde_json::Error> {
        Ok(Self {
            uid: request.uid.clone(),
            operation: Operation::parse(&request.operation),
            subresource: request.subresource.clone(),
            dry_run: request.dry_run,
            old_object: convert::json_from_pb(request.old_object.as_ref())?,
            user_info: convert::json_from_pb(request.user_info.as_ref())?,
            headers: request.headers.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn decodes_requests_and_refuses_broken_json() {
        let mut wire = pb::AdmissionRequest {
            uid: "r1".into(),
            operation: "UPDATE".into(),
            subresource: "status".into(),
            dry_run: true,
            old_object: Some(convert::json_to_pb(&json!({"a": 1}))),
            user_info: None,
            headers: HashMap::new(),
        };
        let request = AdmissionRequest::from_pb(&wire).expect("decodable");
        assert_eq!(request.operation, Operation::Update);
        assert_eq!(
            (request.uid.as_str(), request.subresource.as_str()),
            ("r1", "status")
        );
        assert!(request.dry_run);
        assert_eq!(request.old_object, Some(json!({"a": 1})));
        assert_eq!(request.user_info, None);
        wire.user_info = Some(pb::Json {
            json: b"not json".to_vec(),
        });
        assert!(AdmissionRequest::from_pb(&wire).is_err());
        assert_eq!(Operation::parse("PATCH"), Operation::Unknown);
        for op in [
            Operation::Create,
            Operation::Update,
            Operation::Delete,
            Operation::Connect,
        ] {
            assert_eq!(Operation::parse(op.as_str()), op);
        }
    }
}
