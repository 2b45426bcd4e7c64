//! The retry request: an annotation a person puts on an object to make the controller run a
//! failed (even permanently failed) or delayed handler again now.
//!
//! `capstan retry` writes it; anyone may write it by hand:
//!
//! ```text
//! <prefix>/retry-request: '{"handlers":["create_fn"],"requestedBy":"alice","requestedAt":"2026-12-01T10:00:00Z"}'
//! ```
//!
//! `<prefix>` is the storage prefix of the operator that should act (per-node operators:
//! `<node>.<prefix>`); `handlers` names the handlers (ids as registered, or as their record
//! annotations spell them), and an empty list means every failed or delayed handler of the
//! object. `requestedBy` is recorded in the Event the controller posts. The controller
//! consumes the request in its next processing cycle of the object and removes the annotation
//! in that cycle's single PATCH; a request that does not decode is removed too, with a
//! warning Event. Requests are bounded: at most [`MAX_HANDLERS`] ids of at most
//! [`MAX_TEXT`] characters each, and `requestedBy` of at most [`MAX_TEXT`].

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::keys::Keys;

/// The annotation's name under the storage prefix.
pub const NAME: &str = "retry-request";
/// The most handler ids in one request.
pub const MAX_HANDLERS: usize = 64;
/// The longest id or requester accepted.
pub const MAX_TEXT: usize = 256;

/// A decoded retry request.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Request {
    /// The handlers to retry; empty: every failed or delayed one.
    #[serde(default)]
    pub handlers: Vec<String>,
    /// Who asked.
    #[serde(default)]
    pub requested_by: String,
    /// When (ISO 8601), for people reading the annotation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_at: Option<String>,
}

impl Request {
    /// Whether the request covers the handler `id` (as registered, or as `keys` spells it in
    /// annotation names).
    pub fn wants(&self, id: &str, keys: &Keys) -> bool {
        self.handlers.is_empty()
            || self
                .handlers
                .iter()
                .any(|h| h == id || names(id, keys).iter().any(|n| n == h))
    }

    /// Who asked, for messages.
    pub fn requester(&self) -> &str {
        if self.requested_by.is_empty() {
            "someone"
        } else {
            &self.requested_by
        }
    }
}

/// The annotation names (after the prefix) under which `keys` stores `id`'s record.
pub fn names(id: &str, keys: &Keys) -> Vec<String> {
    keys.read_keys(id)
        .into_iter()
        .filter_map(|k| k.split_once('/').map(|(_, name)| name.to_owned()))
        .collect()
}

/// The request annotation's key under `keys`' prefix.
pub fn key(keys: &Keys) -> String {
    format!("{}/{NAME}", keys.prefix)
}

/// The request on `body`: `None` without one, `Err` with the reason for a malformed one.
pub fn read(keys: &Keys, body: &Value) -> Option<Result<Request, String>> {
    let value = body.pointer("/metadata/annotations")?.get(key(keys))?;
    Some(decode(value))
}

fn decode(value: &Value) -> Result<Request, String> {
    let text = value.as_str().ok_or("the annotation is not a string")?;
    let request: Request = serde_json::from_str(text).map_err(|e| format!("not a retry request: {e}"))?;
    if request.handlers.len() > MAX_HANDLERS {
        return Err(format!("more than {MAX_HANDLERS} handlers"));
    }
    if request
        .handlers
        .iter()
        .any(|h| h.is_empty() || h.len() > MAX_TEXT)
        || request.requested_by.len() > MAX_TEXT
    {
        return Err(format!(
            "an empty handler id, or a value longer than {MAX_TEXT} characters"
        ));
    }
    Ok(request)
}

/// The annotation's value for `request`.
pub fn encode(request: &Request) -> String {
    serde_json::to_string(request).unwrap_or_default()
}

/// Removes the request from a local copy of a body.
pub fn remove(keys: &Keys, body: &mut Value) {
    if let Some(annotations) = body
        .pointer_mut("/metadata/annotations")
        .and_then(Value::as_object_mut)
    {
        annotations.remove(&key(keys));
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn requests_round_trip_and_match_mangled_names() {
        let keys = Keys::new("capstan.dev");
        let request = Request {
            handlers: vec!["parent.child".into()],
            requested_by: "alice".into(),
            requested_at: None,
        };
        let body = json!({"metadata": {"annotations": {"capstan.dev/retry-request": encode(&request)}}});
        let read = read(&keys, &body).unwrap().unwrap();
        assert_eq!(read, request);
        assert!(read.wants("parent/child", &keys));
        assert!(!read.wants("parent", &keys));
        assert!(Request::default().wants("anything", &keys));
        let mut body = body;
        remove(&keys, &mut body);
        assert!(super::read(&keys, &body).is_none());
    }

    #[test]
    fn garbage_is_refused_with_a_reason() {
        let keys = Keys::new("p.example.com");
        for garbage in [
            json!("please"),
            json!(7),
            json!(r#"{"handlers":"all"}"#),
            json!(r#"{"handlers":[""]}"#),
            json!(r#"{"handlers":[],"extra":1}"#),
        ] {
            let body = json!({"metadata": {"annotations": {"p.example.com/retry-request": garbage}}});
            assert!(read(&keys, &body).unwrap().is_err(), "{garbage}");
        }
    }
}
