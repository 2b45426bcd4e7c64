//! The diff-base: the essence of the object as last handled, kept on the object so that a
//! restarted controller can tell what changed while it was away.
//!
//! Stored as compact JSON plus a newline (kopf's format) in an annotation (the default) or as
//! a JSON string at `status.<name>.last-handled-configuration`.

use serde_json::Value;

use super::{keys::Keys, progress};

/// Where the diff-base is kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DiffBaseStorage {
    /// In the `Keys::diffbase` annotation.
    Annotations(Keys),
    /// In `status.<name>.last-handled-configuration`.
    Status {
        /// The status stanza name.
        name: String,
    },
}

impl DiffBaseStorage {
    /// Reads the stored essence; `None` when there is none (or it does not parse).
    pub fn fetch(&self, body: &Value) -> Option<Value> {
        let text = match self {
            Self::Annotations(keys) => body
                .pointer("/metadata/annotations")?
                .get(&keys.diffbase)?
                .as_str()?,
            Self::Status { name } => body
                .get("status")?
                .get(name)?
                .get("last-handled-configuration")?
                .as_str()?,
        };
        serde_json::from_str(text).ok()
    }

    /// Writes the essence into a local copy of the body.
    pub fn store(&self, essence: &Value, body: &mut Value) {
        let Ok(mut text) = serde_json::to_string(essence) else {
            return;
        };
        text.push('\n');
        match self {
            Self::Annotations(keys) => {
                progress::object_at(body, &["metadata", "annotations"])
                    .insert(keys.diffbase.clone(), Value::String(text));
            }
            Self::Status { name } => {
                progress::object_at(body, &["status", name])
                    .insert("last-handled-configuration".to_owned(), Value::String(text));
            }
        }
    }

    /// The annotation key, when stored in annotations (excluded from essences).
    pub fn annotation_key(&self) -> Option<&str> {
        match self {
            Self::Annotations(keys) => Some(&keys.diffbase),
            Self::Status { .. } => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn round_trips_in_kopf_format() {
        let storage = DiffBaseStorage::Annotations(Keys::kopf());
        let mut body = json!({});
        storage.store(&json!({"spec": {"a": 1}}), &mut body);
        assert_eq!(
            body["metadata"]["annotations"]["kopf.zalando.org/last-handled-configuration"],
            json!("{\"spec\":{\"a\":1}}\n")
        );
        assert_eq!(storage.fetch(&body), Some(json!({"spec": {"a": 1}})));
        let status = DiffBaseStorage::Status {
            name: "capstan".into(),
        };
        status.store(&json!({"x": 1}), &mut body);
        assert_eq!(status.fetch(&body), Some(json!({"x": 1})));
    }
}
