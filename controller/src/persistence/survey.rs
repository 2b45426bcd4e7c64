//! Finds every progress record an object carries, whoever wrote it: Capstan under its default
//! or a custom prefix, every node's operator in per-node mode, and kopf.
//!
//! The controller reads records by handler id (it knows its handlers); a person looking at an
//! object does not, so `capstan status` and `capstan retry` walk the body instead: every
//! annotation under a known prefix (`<prefix>/<handler>` or `<node>.<prefix>/<handler>`) and
//! every `status.<field>.progress.<handler>` (or `status.<field>-<node>.progress`) is decoded
//! with the same [`ProgressRecord`] format the storages use. A record that does not decode is
//! reported as malformed with the reason, never skipped silently. kopf writes a long handler
//! id under two keys (V2 and the legacy V1); such pairs are reported once. The diff-bases are
//! surveyed too: they tell "every handler of the last change done" from "never handled".

use std::collections::BTreeMap;

use serde_json::Value;

use super::{ProgressRecord, keys::NAME_LIMIT};

/// The annotation names under a prefix that are not progress records.
pub const NOT_RECORDS: [&str; 4] = [
    "last-handled-configuration",
    "kopf-managed",
    // kopf's touch annotation (a timestamp that provokes a watch event while handlers wait).
    "touch-dummy",
    super::retry::NAME,
];

/// Where to look: the storage prefixes and status fields of the operators of interest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    /// Annotation prefixes (per-node prefixes `<node>.<prefix>` are found under each).
    pub prefixes: Vec<String>,
    /// Status stanza names (per-node stanzas `<field>-<node>` are found under each).
    pub status_fields: Vec<String>,
    /// How per-node operators lay out their prefixes (`persistence::node`), e.g.
    /// `{node}.{prefix}` (the default) or `{prefix}.{node_short}`.
    pub node_template: String,
}

impl Default for Scope {
    /// Capstan's and kopf's defaults.
    fn default() -> Self {
        Self {
            prefixes: vec!["capstan.dev".into(), super::keys::KOPF_PREFIX.into()],
            status_fields: vec!["capstan".into(), "kopf".into()],
            node_template: super::node::DEFAULT_TEMPLATE.into(),
        }
    }
}

/// Where a record was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Place {
    /// In the annotation with this key.
    Annotation(String),
    /// In `status.<field>.progress`.
    Status(String),
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Annotation(key) => write!(f, "annotation {key}"),
            Self::Status(field) => write!(f, "status.{field}.progress"),
        }
    }
}

/// One record found on an object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Found {
    /// The handler: its id as stored (annotation names carry kopf's mangling, `/` → `.`).
    pub handler: String,
    /// The node label of a per-node operator's record.
    pub node: Option<String>,
    /// The base prefix or status field it was found under.
    pub owner: String,
    /// Where exactly.
    pub place: Place,
    /// The record, or why it does not decode.
    pub record: Result<ProgressRecord, String>,
}

/// A diff-base found on an object: some operator finished handling a change of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Handled {
    /// The node label of a per-node operator.
    pub node: Option<String>,
    /// The base prefix or status field.
    pub owner: String,
}

/// Every record on `body` within `scope`, in a stable order (node, owner, handler).
pub fn records(scope: &Scope, body: &Value) -> Vec<Found> {
    let mut found = annotation_records(scope, body);
    found.extend(status_records(scope, body));
    // The operator without a node first, then by node, operator and handler.
    found.sort_by(|a, b| (&a.node, &a.owner, &a.handler).cmp(&(&b.node, &b.owner, &b.handler)));
    found
}

/// Every diff-base on `body` within `scope`.
pub fn diffbases(scope: &Scope, body: &Value) -> Vec<Handled> {
    let mut out = Vec::new();
    if let Some(annotations) = body.pointer("/metadata/annotations").and_then(Value::as_object) {
        for key in annotations.keys() {
            if let Some((owner, node, name)) = split_key(scope, key)
                && name == "last-handled-configuration"
            {
                out.push(Handled { node, owner });
            }
        }
    }
    if let Some(status) = body.get("status").and_then(Value::as_object) {
        for (field, stanza) in status {
            if let Some((owner, node)) = split_field(scope, field)
                && stanza.get("last-handled-configuration").is_some()
            {
                out.push(Handled { node, owner });
            }
        }
    }
    out
}

/// `(base prefix, node label, name)` of an annotation key under one of the scope's prefixes.
fn split_key(scope: &Scope, key: &str) -> Option<(String, Option<String>, String)> {
    let (prefix, name) = key.split_once('/')?;
    scope.prefixes.iter().find_map(|base| {
        if prefix == base {
            return Some((base.clone(), None, name.to_owned()));
        }
        let node = node_part(&scope.node_template, base, prefix)?;
        Some((base.clone(), Some(node.to_owned()), name.to_owned()))
    })
}

/// The node label in a per-node `prefix` laid out by `template` under `base`: what stands
/// where the template puts `{node}` (or `{node_short}`), a single non-empty label.
fn node_part<'p>(template: &str, base: &str, prefix: &'p str) -> Option<&'p str> {
    const MARK: &str = "\u{0}";
    let rendered = template
        .replace("{prefix}", base)
        .replace("{node_short}", MARK)
        .replace("{node}", MARK);
    let (before, after) = rendered.split_once(MARK)?;
    let node = prefix.strip_prefix(before)?.strip_suffix(after)?;
    (!node.is_empty() && !node.contains('.')).then_some(node)
}

/// The label that stands for `node` in prefixes laid out by `template`.
pub fn node_label(template: &str, node: &str) -> String {
    if template.contains("{node}") {
        super::node::label(node)
    } else {
        super::node::label(node.split('.').next().unwrap_or(node))
    }
}

/// `(base field, node label)` of a status stanza named after one of the scope's fields.
fn split_field(scope: &Scope, field: &str) -> Option<(String, Option<String>)> {
    scope.status_fields.iter().find_map(|base| {
        if field == base {
            return Some((base.clone(), None));
        }
        let node = field.strip_prefix(base.as_str())?.strip_prefix('-')?;
        (!node.is_empty()).then(|| (base.clone(), Some(node.to_owned())))
    })
}

/// An operator: its base prefix and node label.
type Operator = (String, Option<String>);

fn annotation_records(scope: &Scope, body: &Value) -> Vec<Found> {
    let Some(annotations) = body.pointer("/metadata/annotations").and_then(Value::as_object) else {
        return Vec::new();
    };
    let mut found: Vec<Found> = Vec::new();
    // Values already reported per (owner, node): kopf's V1 twin of a long V2 key is skipped.
    let mut seen: BTreeMap<Operator, Vec<(String, String)>> = BTreeMap::new();
    let mut keys: Vec<&String> = annotations.keys().collect();
    // Longer names first: a V2 key (name up to 63 characters) before its shorter V1 twin.
    keys.sort_by(|a, b| b.len().cmp(&a.len()).then(a.cmp(b)));
    for key in keys {
        let Some((owner, node, name)) = split_key(scope, key) else {
            continue;
        };
        if NOT_RECORDS.contains(&name.as_str()) {
            continue;
        }
        let text = annotations.get(key).map_or_else(String::new, |v| match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        });
        let twins = seen.entry((owner.clone(), node.clone())).or_default();
        let prefix_len = key.len() - name.len() - 1;
        if at_limit(&name, prefix_len)
            && twins
                .iter()
                .any(|(other, t)| t == &text && at_limit(other, prefix_len) && other.len() > name.len())
        {
            continue;
        }
        twins.push((name.clone(), text.clone()));
        found.push(Found {
            handler: name,
            node,
            owner,
            place: Place::Annotation(key.clone()),
            record: decode(&text),
        });
    }
    found
}

/// Whether an annotation name has the length of a shortened key (V2: the name limit; V1: the
/// limit minus the prefix).
fn at_limit(name: &str, prefix_len: usize) -> bool {
    name.len() == NAME_LIMIT || name.len() + prefix_len + 1 == NAME_LIMIT
}

fn status_records(scope: &Scope, body: &Value) -> Vec<Found> {
    let Some(status) = body.get("status").and_then(Value::as_object) else {
        return Vec::new();
    };
    let mut found = Vec::new();
    for (field, stanza) in status {
        let Some((owner, node)) = split_field(scope, field) else {
            continue;
        };
        let Some(progress) = stanza.get("progress") else {
            continue;
        };
        let Some(progress) = progress.as_object() else {
            found.push(Found {
                handler: String::new(),
                node,
                owner,
                place: Place::Status(field.clone()),
                record: Err(format!("status.{field}.progress is not an object")),
            });
            continue;
        };
        for (id, value) in progress {
            found.push(Found {
                handler: id.clone(),
                node: node.clone(),
                owner: owner.clone(),
                place: Place::Status(field.clone()),
                record: decode_value(value.clone()),
            });
        }
    }
    found
}

/// Decodes an annotation's text as a progress record.
fn decode(text: &str) -> Result<ProgressRecord, String> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| format!("not a progress record: not JSON: {e}"))?;
    decode_value(value)
}

/// Decodes a JSON object as a progress record (serde would also take an array).
fn decode_value(value: Value) -> Result<ProgressRecord, String> {
    if !value.is_object() {
        return Err("not a progress record: not a JSON object".into());
    }
    serde_json::from_value(value).map_err(|e| format!("not a progress record: {e}"))
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::persistence::{Keys, ProgressStorage};

    fn record(retries: u32) -> ProgressRecord {
        ProgressRecord {
            retries,
            purpose: Some("create".into()),
            ..ProgressRecord::default()
        }
    }

    #[test]
    fn finds_records_of_every_storage() {
        let mut body = json!({"metadata": {"annotations": {
            "capstan.dev/last-handled-configuration": "{}",
            "capstan.dev/kopf-managed": "yes",
            "kopf.zalando.org/touch-dummy": "2026-12-01T10:00:00.000000+00:00",
            "other.example.com/create_fn": "{}",
        }}});
        ProgressStorage::Annotations(Keys::new("capstan.dev")).store("a/b", &record(1), &mut body);
        ProgressStorage::Annotations(Keys::new("node-1.capstan.dev")).store("c", &record(2), &mut body);
        ProgressStorage::Status {
            name: "capstan-node-2".into(),
        }
        .store("d", &record(3), &mut body);
        let long = "x".repeat(70);
        ProgressStorage::Annotations(Keys::kopf()).store(&long, &record(4), &mut body);
        let found = records(&Scope::default(), &body);
        let summary: Vec<(&str, Option<&str>, u32)> = found
            .iter()
            .map(|f| {
                (
                    f.handler.as_str(),
                    f.node.as_deref(),
                    f.record.as_ref().map_or(99, |r| r.retries),
                )
            })
            .collect();
        assert_eq!(summary.len(), 4, "{summary:?}");
        assert!(summary.contains(&("a.b", None, 1)));
        assert!(summary.contains(&("c", Some("node-1"), 2)));
        assert!(summary.contains(&("d", Some("node-2"), 3)));
        assert!(
            summary
                .iter()
                .any(|(h, n, r)| h.len() == NAME_LIMIT && n.is_none() && *r == 4),
            "kopf's V1 twin is reported once: {summary:?}"
        );
        assert_eq!(diffbases(&Scope::default(), &body).len(), 1);
        // A compact diff-base (`persistence::diffbase`) is one as well, and never a record.
        body["metadata"]["annotations"]["node-1.capstan.dev/last-handled-configuration"] = json!("[1]\n");
        body["status"]["capstan-node-2"]["last-handled-configuration"] = json!("[1,{\"spec.a\":1}]\n");
        assert_eq!(diffbases(&Scope::default(), &body).len(), 3);
        assert_eq!(records(&Scope::default(), &body).len(), 4);
    }

    #[test]
    fn per_node_prefixes_follow_the_node_prefix_template() {
        let template = "{prefix}.{node_short}";
        let prefix = crate::persistence::node::prefix_with(template, "node-1.example.net", "example.com");
        assert_eq!(prefix, "example.com.node-1");
        let mut body = json!({"metadata": {"annotations": {}}});
        ProgressStorage::Annotations(Keys::new(&prefix)).store("create_fn", &record(2), &mut body);
        let scope = Scope {
            prefixes: vec!["example.com".into()],
            node_template: template.into(),
            ..Scope::default()
        };
        let found = records(&scope, &body);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].owner, "example.com");
        assert_eq!(found[0].node.as_deref(), Some("node-1"));
        assert_eq!(found[0].handler, "create_fn");
        assert_eq!(node_label(template, "node-1.example.net"), "node-1");
        assert_eq!(
            node_label(crate::persistence::node::DEFAULT_TEMPLATE, "node-1"),
            "node-1"
        );
    }

    #[test]
    fn malformed_records_are_reported() {
        let body = json!({
            "metadata": {"annotations": {"capstan.dev/create_fn": "{not json", "capstan.dev/n": 5}},
            "status": {"kopf": {"progress": "garbage"}, "capstan": {"progress": {"x": {"retries": "many"}}}}
        });
        let found = records(&Scope::default(), &body);
        assert_eq!(found.len(), 4, "{found:?}");
        assert!(found.iter().all(|f| f.record.is_err()), "{found:?}");
    }
}
