//! Progress records: per handler, what has happened so far for the current cause.
//!
//! A record says when the handler first started, whether it finished (success or failure),
//! how many attempts were made, until when it sleeps before the next one, for which cause
//! (purpose) it was created, the last error message, and which sub-handlers it spawned. The
//! JSON shape is kopf's, so kopf-compatible mode reads and writes kopf's records as they are.
//!
//! Storages: annotations (the default, one compact JSON annotation per handler), status
//! (`status.<name>.progress.<id>`), smart (write both, read annotations first), or annotations
//! that also read — never write — records left in `status.<name>.progress` (kopf ≥ 1.44's
//! default, which reads what kopf ≤ 1.43 wrote to the status).

use std::time::SystemTime;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::{keys::Keys, time};

/// One handler's progress. Field names and formats are kopf's.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProgressRecord {
    /// When the first attempt started (ISO 8601).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started: Option<String>,
    /// When the handler finished, successfully or not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stopped: Option<String>,
    /// Not before this time (the next attempt's earliest start).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delayed: Option<String>,
    /// The cause that created the record: create, update, delete or resume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub purpose: Option<String>,
    /// Attempts made.
    #[serde(default)]
    pub retries: u32,
    /// Finished successfully.
    #[serde(default)]
    pub success: bool,
    /// Finished with a failure.
    #[serde(default)]
    pub failure: bool,
    /// The last error message.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// Ids of all descendant sub-handlers (for purging), sorted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub subrefs: Vec<String>,
    /// Consecutive attempts during which the handler process disconnected (Capstan's own
    /// field; kopf ignores it): the poison-pill guard counts them across restarts.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub lost: u32,
    /// A run of a completed change's handler that `capstan retry` asked for (Capstan's own
    /// field; kopf ignores it). Only such a record, while unfinished, makes a cycle with no
    /// change to handle run it on; a stale record that a late write put back never does.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub rerun: bool,
}

#[allow(
    clippy::trivially_copy_pass_by_ref,
    reason = "serde's skip_serializing_if signature"
)]
fn is_zero(n: &u32) -> bool {
    *n == 0
}

impl ProgressRecord {
    /// A fresh record for a handler about to run for `purpose`.
    pub fn started(now: SystemTime, purpose: &str) -> Self {
        Self {
            started: Some(time::format(now)),
            purpose: Some(purpose.to_owned()),
            ..Self::default()
        }
    }

    /// Finished, one way or the other.
    pub fn finished(&self) -> bool {
        self.success || self.failure
    }

    /// The earliest time of the next attempt, if delayed.
    pub fn delayed_until(&self) -> Option<SystemTime> {
        self.delayed.as_deref().and_then(time::parse)
    }

    /// When the first attempt started.
    pub fn started_at(&self) -> Option<SystemTime> {
        self.started.as_deref().and_then(time::parse)
    }

    /// Sleeping: not finished and delayed into the future.
    pub fn sleeping(&self, now: SystemTime) -> bool {
        !self.finished() && self.delayed_until().is_some_and(|t| t > now)
    }
}

/// Where progress records are kept.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProgressStorage {
    /// One annotation per handler (`<prefix>/<mangled id>`).
    Annotations(Keys),
    /// `status.<name>.progress.<id>`.
    Status {
        /// The status stanza name, e.g. `capstan` or `kopf`.
        name: String,
    },
    /// Both; reads annotations first.
    Smart(Keys, String),
    /// Annotations; records in `status.<name>.progress` are read when no annotation has one,
    /// and purged, but never written (kopf ≥ 1.44's smart storage).
    AnnotationsReadingStatus(Keys, String),
}

impl ProgressStorage {
    /// Reads a handler's record from a body.
    pub fn fetch(&self, id: &str, body: &Value) -> Option<ProgressRecord> {
        match self {
            Self::Annotations(keys) => fetch_annotation(keys, id, body),
            Self::Status { name } => fetch_status(name, id, body),
            Self::Smart(keys, name) | Self::AnnotationsReadingStatus(keys, name) => {
                fetch_annotation(keys, id, body).or_else(|| fetch_status(name, id, body))
            }
        }
    }

    /// Writes a handler's record into a local copy of the body.
    pub fn store(&self, id: &str, record: &ProgressRecord, body: &mut Value) {
        match self {
            Self::Annotations(keys) | Self::AnnotationsReadingStatus(keys, _) => {
                store_annotation(keys, id, record, body);
            }
            Self::Status { name } => store_status(name, id, record, body),
            Self::Smart(keys, name) => {
                store_annotation(keys, id, record, body);
                store_status(name, id, record, body);
            }
        }
    }

    /// Removes a handler's record from a local copy of the body.
    pub fn purge(&self, id: &str, body: &mut Value) {
        match self {
            Self::Annotations(keys) => purge_annotation(keys, id, body),
            Self::Status { name } => purge_status(name, id, body),
            Self::Smart(keys, name) | Self::AnnotationsReadingStatus(keys, name) => {
                purge_annotation(keys, id, body);
                purge_status(name, id, body);
            }
        }
    }
}

fn fetch_annotation(keys: &Keys, id: &str, body: &Value) -> Option<ProgressRecord> {
    let annotations = body.pointer("/metadata/annotations")?.as_object()?;
    keys.read_keys(id).iter().find_map(|k| {
        annotations
            .get(k)?
            .as_str()
            .and_then(|s| serde_json::from_str(s).ok())
    })
}

fn store_annotation(keys: &Keys, id: &str, record: &ProgressRecord, body: &mut Value) {
    let Ok(text) = serde_json::to_string(record) else {
        return;
    };
    let annotations = object_at(body, &["metadata", "annotations"]);
    for key in keys.write_keys(id) {
        annotations.insert(key, Value::String(text.clone()));
    }
}

fn purge_annotation(keys: &Keys, id: &str, body: &mut Value) {
    if let Some(annotations) = body
        .pointer_mut("/metadata/annotations")
        .and_then(Value::as_object_mut)
    {
        for key in keys.read_keys(id) {
            annotations.remove(&key);
        }
    }
}

fn fetch_status(name: &str, id: &str, body: &Value) -> Option<ProgressRecord> {
    let record = body.get("status")?.get(name)?.get("progress")?.get(id)?;
    serde_json::from_value(record.clone()).ok()
}

fn store_status(name: &str, id: &str, record: &ProgressRecord, body: &mut Value) {
    let Ok(value) = serde_json::to_value(record) else {
        return;
    };
    object_at(body, &["status", name, "progress"]).insert(id.to_owned(), value);
}

fn purge_status(name: &str, id: &str, body: &mut Value) {
    let Some(status) = body.get_mut("status").and_then(|s| s.get_mut(name)) else {
        return;
    };
    if let Some(progress) = status.get_mut("progress").and_then(Value::as_object_mut) {
        progress.remove(id);
        if progress.is_empty()
            && let Some(s) = status.as_object_mut()
        {
            s.remove("progress");
        }
    }
    prune_empty(body, &["status", name]);
}

/// The object at `path` inside `body`, created (replacing non-objects) as needed.
pub fn object_at<'a>(body: &'a mut Value, path: &[&str]) -> &'a mut Map<String, Value> {
    let mut current = body;
    for segment in path {
        if !current.is_object() {
            *current = Value::Object(Map::new());
        }
        current = current
            .as_object_mut()
            .expect("invariant: replaced by an object just above")
            .entry((*segment).to_owned())
            .or_insert_with(|| Value::Object(Map::new()));
    }
    if !current.is_object() {
        *current = Value::Object(Map::new());
    }
    current
        .as_object_mut()
        .expect("invariant: replaced by an object just above")
}

/// Removes the object at `path` if it is empty.
pub fn prune_empty(body: &mut Value, path: &[&str]) {
    let Some((last, parents)) = path.split_last() else {
        return;
    };
    let mut current = &mut *body;
    for segment in parents {
        match current.get_mut(*segment) {
            Some(next) => current = next,
            None => return,
        }
    }
    if let Some(map) = current.as_object_mut()
        && map
            .get(*last)
            .and_then(Value::as_object)
            .is_some_and(Map::is_empty)
    {
        map.remove(*last);
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use serde_json::json;

    use super::*;

    #[test]
    fn records_serialize_like_kopf() {
        let mut r = ProgressRecord::started(UNIX_EPOCH + Duration::from_secs(1), "create");
        r.retries = 1;
        r.success = true;
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"started":"1970-01-01T00:00:01.000000+00:00","purpose":"create","retries":1,"success":true,"failure":false}"#
        );
    }

    #[test]
    fn annotation_storage_round_trips_and_purges() {
        let storage = ProgressStorage::Annotations(Keys::new("capstan.dev"));
        let mut body = json!({"metadata": {"name": "x"}});
        let record = ProgressRecord {
            retries: 2,
            ..ProgressRecord::default()
        };
        storage.store("create_fn", &record, &mut body);
        assert!(body["metadata"]["annotations"]["capstan.dev/create_fn"].is_string());
        assert_eq!(storage.fetch("create_fn", &body), Some(record));
        storage.purge("create_fn", &mut body);
        assert_eq!(storage.fetch("create_fn", &body), None);
    }

    #[test]
    fn smart_storage_writes_both_and_status_prunes() {
        let storage = ProgressStorage::Smart(Keys::new("capstan.dev"), "capstan".into());
        let mut body = json!({});
        storage.store("a/b", &ProgressRecord::default(), &mut body);
        assert!(body["status"]["capstan"]["progress"]["a/b"].is_object());
        assert!(body["metadata"]["annotations"]["capstan.dev/a.b"].is_string());
        storage.purge("a/b", &mut body);
        assert_eq!(body["status"], json!({}));
        let status_only = ProgressStorage::Status {
            name: "capstan".into(),
        };
        status_only.store("x", &ProgressRecord::default(), &mut body);
        assert!(status_only.fetch("x", &body).is_some());
    }

    #[test]
    fn records_read_like_kopf_writes_them() {
        // As written by kopf 1.45 while a handler waits for its retry.
        let text = r#"{"started":"2026-11-29T08:30:50.995280+00:00","delayed":"2026-11-29T08:30:51.996350+00:00","purpose":"create","retries":1,"success":false,"failure":false,"message":"temporary failure 1 of 1"}"#;
        let record: ProgressRecord = serde_json::from_str(text).unwrap();
        assert_eq!(record.retries, 1);
        assert_eq!(record.message.as_deref(), Some("temporary failure 1 of 1"));
        assert!(record.delayed_until().is_some() && !record.finished());
        assert_eq!(serde_json::to_string(&record).unwrap(), text);
    }

    #[test]
    fn legacy_status_records_are_read_and_purged_but_never_written() {
        let storage = ProgressStorage::AnnotationsReadingStatus(Keys::kopf(), "kopf".into());
        let legacy = json!({"started": "2026-11-29T08:30:50.995280+00:00", "purpose": "create",
                            "retries": 1, "success": true, "failure": false});
        let mut body = json!({"status": {"kopf": {"progress": {"create_fn": legacy}}}});
        let fetched = storage.fetch("create_fn", &body).unwrap();
        assert!(fetched.success);

        let newer = ProgressRecord {
            retries: 2,
            ..fetched
        };
        storage.store("create_fn", &newer, &mut body);
        assert_eq!(
            body["status"]["kopf"]["progress"]["create_fn"]["retries"], 1,
            "the status is not written"
        );
        assert!(body["metadata"]["annotations"]["kopf.zalando.org/create_fn"].is_string());
        assert_eq!(
            storage.fetch("create_fn", &body),
            Some(newer),
            "annotations first"
        );

        let long = "x".repeat(70);
        storage.store(&long, &ProgressRecord::default(), &mut body);
        assert_eq!(
            body["metadata"]["annotations"].as_object().unwrap().len(),
            3,
            "V2 and V1 keys for a long id"
        );
        storage.purge(&long, &mut body);
        storage.purge("create_fn", &mut body);
        assert_eq!(storage.fetch("create_fn", &body), None);
        assert_eq!(body["status"], json!({}));
        assert_eq!(body["metadata"]["annotations"], json!({}));
    }

    #[test]
    fn sleeping_and_finished() {
        let now = UNIX_EPOCH + Duration::from_secs(100);
        let r = ProgressRecord {
            delayed: Some(time::format(now + Duration::from_secs(5))),
            ..Default::default()
        };
        assert!(r.sleeping(now));
        assert!(!r.sleeping(now + Duration::from_secs(6)));
        assert!(
            ProgressRecord {
                failure: true,
                ..Default::default()
            }
            .finished()
        );
    }
}
