//! Objects the controller cannot parse: quarantined (logged, counted, skipped), never a stop of
//! their resource.
//!
//! The API server stores what its schema allows, and a schema with
//! `x-kubernetes-preserve-unknown-fields` allows an object nested far deeper than serde_json's
//! recursion limit (128). Parsed with its LIST page or its watch event, one such object failed
//! the whole page or event: every listing and every watch restart failed on it again, and no
//! other object of the resource was processed until it was deleted. Pages and watch events are
//! therefore split first (without recursion: [`serde_json::value::RawValue`] skips over a value
//! iteratively), each object is parsed alone, and one that does not parse is quarantined here:
//! logged with its namespace, name, uid and resourceVersion (read from its text without parsing
//! the rest), counted in `capstan_objects_quarantined_total{resource}`, and skipped. The
//! watch's resourceVersion moves past it as past any event.
//!
//! No handler sees a quarantined object, its deletion handlers included: deleted while it
//! carries Capstan's finalizer, it stays until it is readable again or the finalizer is
//! removed by hand, rather than have its deletion taken as handled when it was not.

use serde::Deserialize;
use serde_json::{Value, json, value::RawValue};
use tracing::warn;

/// Who an object is, read from its text without parsing the rest of it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Identity {
    /// `metadata.namespace` (empty for cluster-scoped objects or when unreadable).
    pub namespace: String,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.uid`.
    pub uid: String,
    /// `metadata.resourceVersion`.
    pub resource_version: Option<String>,
}

impl Identity {
    /// Reads an object's identity from its text. Only `metadata`'s scalar fields are parsed:
    /// everything else, however deep, is skipped without recursion. Text that is no object
    /// gives an empty identity.
    pub fn of(text: &str) -> Self {
        #[derive(Deserialize)]
        struct Outer<'a> {
            #[serde(borrow, default)]
            metadata: Option<&'a RawValue>,
        }
        #[derive(Deserialize, Default)]
        #[serde(rename_all = "camelCase", default)]
        struct Meta {
            namespace: Option<String>,
            name: Option<String>,
            uid: Option<String>,
            resource_version: Option<String>,
        }
        let meta = serde_json::from_str::<Outer<'_>>(text)
            .ok()
            .and_then(|o| o.metadata)
            .and_then(|m| serde_json::from_str::<Meta>(m.get()).ok())
            .unwrap_or_default();
        Self {
            namespace: meta.namespace.unwrap_or_default(),
            name: meta.name.unwrap_or_default(),
            uid: meta.uid.unwrap_or_default(),
            resource_version: meta.resource_version,
        }
    }

    /// A body with only this identity's metadata (enough to report the object's deletion).
    pub fn body(&self) -> Value {
        json!({"metadata": {
            "namespace": self.namespace,
            "name": self.name,
            "uid": self.uid,
            "resourceVersion": self.resource_version,
        }})
    }
}

/// An object whose text did not parse.
#[derive(Debug)]
pub struct Unparsed {
    /// Who it is.
    pub identity: Identity,
    /// Why it did not parse.
    pub error: serde_json::Error,
}

impl Unparsed {
    /// The object of `text` that failed with `error`.
    pub fn new(text: &str, error: serde_json::Error) -> Self {
        Self {
            identity: Identity::of(text),
            error,
        }
    }
}

/// Quarantines an object of `resource` that did not parse: logs it with its identity and
/// counts it. The caller skips it.
pub fn quarantine(resource: &str, unparsed: &Unparsed) {
    let Identity {
        namespace,
        name,
        uid,
        resource_version,
    } = &unparsed.identity;
    crate::observability::metrics::global().object_quarantined(resource);
    warn!(
        %resource,
        object.namespace = %namespace,
        object.name = %name,
        object.uid = %uid,
        object.resource_version = resource_version.as_deref().unwrap_or_default(),
        error = %unparsed.error,
        "an object that cannot be parsed is quarantined: skipped (the others of its resource are processed) until it changes"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An object nested `depth` levels deep in its spec.
    pub(crate) fn deep(depth: usize) -> String {
        let spec = format!("{}1{}", "{\"a\":".repeat(depth), "}".repeat(depth));
        format!(
            r#"{{"apiVersion":"demo.capstan.dev/v1","kind":"Example","spec":{spec},
               "metadata":{{"name":"deep","namespace":"team-a","uid":"u-deep","resourceVersion":"b7f3",
               "managedFields":[{{"fieldsV1":{spec}}}]}}}}"#
        )
    }

    #[test]
    fn a_deep_object_is_identified_without_parsing_it() {
        let text = deep(200);
        assert!(serde_json::from_str::<kube::api::DynamicObject>(&text).is_err());
        assert_eq!(
            Identity::of(&text),
            Identity {
                namespace: "team-a".into(),
                name: "deep".into(),
                uid: "u-deep".into(),
                resource_version: Some("b7f3".into()),
            }
        );
        // Far deeper still: no recursion, no stack overflow.
        assert_eq!(Identity::of(&deep(100_000)).name, "deep");
    }

    #[test]
    fn text_that_is_no_object_has_an_empty_identity() {
        assert_eq!(Identity::of("[1,2]"), Identity::default());
        assert_eq!(Identity::of("{\"metadata\":7}"), Identity::default());
        assert_eq!(Identity::of("nonsense"), Identity::default());
    }

    #[test]
    fn quarantined_objects_are_counted_by_resource() {
        let text = deep(200);
        let error = serde_json::from_str::<Value>(&text).expect_err("too deep");
        quarantine("examples", &Unparsed::new(&text, error));
        let rendered = crate::observability::metrics::global().render();
        assert!(
            rendered
                .lines()
                .any(|l| l.starts_with("capstan_objects_quarantined_total{resource=\"examples\"}")),
            "{rendered}"
        );
    }
}
