//! The diff-base: what the object looked like when its last change was handled, kept on the
//! object so that a restarted controller can tell what changed while it was away.
//!
//! It is kept in an annotation (the default) or as a JSON string at
//! `status.<name>.last-handled-configuration`, in one of two formats; both end with a newline,
//! as kopf's does:
//!
//! - **The essence** (kopf's format, and what Capstan stored before compact diff-bases): the
//!   whole essence as compact JSON, always a JSON object, e.g. `{"spec":{"size":1}}`. It
//!   covers every field. Written with `--diff-base full`, with `--persistence kopf`, and
//!   whenever an update handler of the resource reads the whole `old`/`diff`.
//! - **Compact** (`--diff-base fields`, the default of Capstan's own persistence): only the
//!   essence at the paths the handlers watch ([`Watched`]), as a JSON array
//!   `[1,{"<dotted.path>":<value>,…},["<dotted.path of an absent field>",…]]`: the format
//!   version, the value of every watched path that has one, and the watched paths that had
//!   none (a removed field). Trailing empty parts are left out, so a resource whose handlers
//!   watch no field costs `[1]`. Field paths never contain dots within a key (a handler's
//!   `field` is split at its dots), so the dotted keys are unambiguous. An array of another
//!   version (written by a later Capstan) is read as a diff-base that covers nothing.
//!
//! The stored diff-base is turned into the `old` essence of a cycle by [`DiffBase::overlay`]:
//! the current essence, with the stored value put at every watched path the diff-base covers.
//! A field it does not cover reads as unchanged. The engine decides what is watched
//! (`engine::processing::watched`) and when a new diff-base is written: with the write that
//! finishes a cause, when a watched value (or the set of watched paths) differs from what is
//! stored — an essence whose watched values are current is not rewritten only to change its
//! format — and once on its own when a handler starts watching a field that the stored
//! diff-base does not cover (the field's value then becomes the base its changes are seen
//! against).

use std::collections::BTreeMap;

use serde_json::{Map, Value};

use super::{keys::Keys, progress};
use crate::model::field_path::{lookup, remove, set};

/// The version of the compact format.
const COMPACT_VERSION: u64 = 1;

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

/// How much of the essence the diff-base keeps (`--diff-base`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Extent {
    /// The whole essence, in kopf's format: `old` and `diff` of every handler show every
    /// change.
    Full,
    /// Only the fields that handlers watch (the compact format), unless an update handler
    /// without a `field` reads the whole `old`.
    #[default]
    Fields,
}

/// The essence paths whose old values handlers read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Watched {
    /// The whole essence.
    All,
    /// These paths: sorted, none equal to or under another.
    Paths(Vec<Vec<String>>),
}

impl Watched {
    /// The given paths, minimal: a path under another watched path is left out (the outer
    /// one covers it).
    pub fn paths(paths: impl IntoIterator<Item = Vec<String>>) -> Self {
        let mut all: Vec<Vec<String>> = paths.into_iter().collect();
        all.sort();
        all.dedup();
        let mut out: Vec<Vec<String>> = Vec::new();
        for path in all {
            // Sorted: a path's ancestors come before it.
            if !out.iter().any(|outer| path.starts_with(outer)) {
                out.push(path);
            }
        }
        Self::Paths(out)
    }

    /// The paths, with the whole essence as the one empty path.
    fn roots(&self) -> Vec<&[String]> {
        match self {
            Self::All => vec![&[]],
            Self::Paths(paths) => paths.iter().map(Vec::as_slice).collect(),
        }
    }
}

/// A diff-base as stored.
#[derive(Clone, Debug, PartialEq)]
pub enum DiffBase {
    /// A whole essence (kopf's format): covers every field.
    Essence(Value),
    /// The essence at some paths (the compact format): the value, or `None` where the
    /// essence had none.
    Fields(BTreeMap<Vec<String>, Option<Value>>),
}

impl DiffBase {
    /// The diff-base of `essence` for what is watched.
    pub fn of(essence: &Value, watched: &Watched) -> Self {
        match watched {
            Watched::All => Self::Essence(essence.clone()),
            Watched::Paths(paths) => Self::Fields(
                paths
                    .iter()
                    .map(|p| (p.clone(), lookup(essence, p).cloned()))
                    .collect(),
            ),
        }
    }

    /// Decodes the stored text; `None` when it is not JSON. A JSON object is an essence; an
    /// array of the compact format's version is compact; any other value is a diff-base that
    /// covers nothing.
    pub fn parse(text: &str) -> Option<Self> {
        let value: Value = serde_json::from_str(text).ok()?;
        let Value::Array(parts) = value else {
            return Some(match value {
                Value::Object(_) => Self::Essence(value),
                _ => Self::Fields(BTreeMap::new()),
            });
        };
        let mut fields = BTreeMap::new();
        if parts.first().and_then(Value::as_u64) != Some(COMPACT_VERSION) {
            return Some(Self::Fields(fields));
        }
        let split = |dotted: &str| -> Vec<String> { dotted.split('.').map(str::to_owned).collect() };
        if let Some(values) = parts.get(1).and_then(Value::as_object) {
            for (dotted, value) in values {
                fields.insert(split(dotted), Some(value.clone()));
            }
        }
        if let Some(absent) = parts.get(2).and_then(Value::as_array) {
            for dotted in absent.iter().filter_map(Value::as_str) {
                fields.entry(split(dotted)).or_insert(None);
            }
        }
        Some(Self::Fields(fields))
    }

    /// The stored text (compact JSON and a newline).
    pub fn encode(&self) -> String {
        let mut text = match self {
            Self::Essence(essence) => serde_json::to_string(essence).unwrap_or_else(|_| "{}".into()),
            Self::Fields(fields) => {
                let mut values = Map::new();
                let mut absent = Vec::new();
                for (path, value) in fields {
                    match value {
                        Some(v) => {
                            values.insert(path.join("."), v.clone());
                        }
                        None => absent.push(Value::String(path.join("."))),
                    }
                }
                let mut parts = vec![Value::from(COMPACT_VERSION)];
                if !values.is_empty() || !absent.is_empty() {
                    parts.push(Value::Object(values));
                }
                if !absent.is_empty() {
                    parts.push(Value::Array(absent));
                }
                Value::Array(parts).to_string()
            }
        };
        text.push('\n');
        text
    }

    /// Whether it holds the old value of every watched path (so a change of any of them is
    /// seen): an essence always does; a compact one when every watched path is equal to or
    /// under one of its paths.
    pub fn covers(&self, watched: &Watched) -> bool {
        match self {
            Self::Essence(_) => true,
            Self::Fields(fields) => watched
                .roots()
                .iter()
                .all(|w| fields.keys().any(|s| w.starts_with(s))),
        }
    }

    /// The old essence: `new` (the current essence) with the stored value put at every watched
    /// path this diff-base covers, or the path removed where it stored no value. Paths it
    /// does not cover read as unchanged. An essence with everything watched is returned as it
    /// is (kopf's behaviour).
    pub fn overlay(&self, new: &Value, watched: &Watched) -> Value {
        match (self, watched) {
            (Self::Essence(old), Watched::All) => old.clone(),
            (Self::Essence(old), Watched::Paths(paths)) => {
                let mut out = new.clone();
                for path in paths {
                    place(&mut out, path, lookup(old, path));
                }
                out
            }
            (Self::Fields(fields), watched) => {
                let mut out = new.clone();
                for w in watched.roots() {
                    for (s, value) in fields {
                        if s.starts_with(w) {
                            // The stored path is the watched one or inside it.
                            place(&mut out, s, value.as_ref());
                        } else if w.starts_with(s) {
                            // The watched path is inside a stored one.
                            let inner = value.as_ref().and_then(|v| lookup(v, &w[s.len()..]));
                            place(&mut out, w, inner);
                        }
                    }
                }
                out
            }
        }
    }

    /// Whether this is a whole essence (kopf's, or an earlier version's) that differs from
    /// the current essence `new` while only some paths are watched. Its unwatched values are
    /// then out of date, and a handler that watches one of those fields later would be called
    /// for a change nobody watched: such an essence is replaced by the compact form at once.
    /// An essence equal to the current one stays as it is (no write only to change the
    /// format); the next change replaces it.
    pub fn stale(&self, new: &Value, watched: &Watched) -> bool {
        matches!((self, watched), (Self::Essence(old), Watched::Paths(_)) if old != new)
    }

    /// Whether writing `next` (the diff-base of the handled essence `handled`) in place of
    /// this one matters: a watched value differs, a watched path is not covered yet, a whole
    /// essence is [`stale`](Self::stale), or the compact paths differ.
    pub fn outdated_by(&self, next: &Self, handled: &Value, watched: &Watched) -> bool {
        if !self.covers(watched) || self.stale(handled, watched) || self.overlay(handled, watched) != *handled
        {
            return true;
        }
        matches!(self, Self::Fields(_)) && self != next
    }
}

impl DiffBaseStorage {
    /// Reads the stored diff-base; `None` when there is none (or it is not JSON).
    pub fn fetch(&self, body: &Value) -> Option<DiffBase> {
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
        DiffBase::parse(text)
    }

    /// Writes a diff-base into a local copy of the body.
    pub fn store(&self, diffbase: &DiffBase, body: &mut Value) {
        let text = Value::String(diffbase.encode());
        match self {
            Self::Annotations(keys) => {
                progress::object_at(body, &["metadata", "annotations"]).insert(keys.diffbase.clone(), text);
            }
            Self::Status { name } => {
                progress::object_at(body, &["status", name])
                    .insert("last-handled-configuration".to_owned(), text);
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

/// Puts `value` at `path` (creating objects on the way), or removes what is there when
/// `value` is `None`. The empty path is the whole value.
fn place(target: &mut Value, path: &[String], value: Option<&Value>) {
    match value {
        Some(v) => set(target, path, v.clone()),
        None => remove(target, path),
    }
}

#[cfg(test)]
mod tests;
