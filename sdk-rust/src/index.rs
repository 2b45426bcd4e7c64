//! Indexes (kopf's `@kopf.index`): kept in this process, read by every handler through
//! [`Context::index`](crate::Context::index).
//!
//! The controller calls an index handler for every object of its resource, again on every
//! change, and tells the SDK when an object leaves (deleted, or no longer matching the
//! handler's filters). The SDK folds each result into the index as kopf does:
//!
//! - a JSON object result gives keys and values: each key holds the value under it (a `null`
//!   value is a value too, a placeholder that records the key);
//! - any other non-null result is stored under the key `None`;
//! - no result (`None`/`null`) changes nothing: what the object had stays;
//! - a failure drops the object's entries (temporary, permanent, and unclassified errors under
//!   the TEMPORARY or PERMANENT errors mode); under IGNORED, the default for index handlers, an
//!   unclassified error changes nothing, as kopf keeps the stale values then.
//!
//! Reading follows kopf's `Index` and `Store`: an [`Index`] maps keys to [`Store`]s, a store is
//! the collection of the values every object put under that key, and empty stores do not
//! exist. An `Index` is a live view (each call reads the current state); a `Store` is a
//! snapshot of one key.
//!
//! # Memory
//!
//! Per object and index: its `(namespace, name, uid)` key (about 100 bytes with the strings),
//! one small vector of its index keys, and per key its value in a `serde_json::Value` (the
//! values themselves are what the handler returned). `memory_per_object` in this module's
//! tests measures it.
//!
//! A new connection to the controller starts with empty indexes: the controller feeds every
//! object again before any other handler of this process runs. An index invocation of the
//! earlier stream that finishes after that changes nothing: each invocation applies its result
//! only to the indexes of the stream it started in (a generation that every clear advances).

use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use parking_lot::RwLock;
use serde_json::Value;

/// A key of an index: `Some(key)` for the keys of a JSON object result, `None` for kopf's
/// `None` key, which holds every other result.
pub type IndexKey = Option<String>;

/// Identifies one object in an index, as kopf does: namespace, name and uid (stores are
/// ordered by it; the uid alone finds an object).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct ObjectKey {
    pub(crate) namespace: String,
    pub(crate) name: String,
    pub(crate) uid: String,
}

/// What an index invocation did to its object's entries.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Change {
    /// Replace the object's entries with these (the handler's result).
    Replace(Vec<(IndexKey, Value)>),
    /// Keep what the object has (no result, or an ignored error).
    Keep,
    /// Drop the object's entries (deleted, filtered out, or the handler failed).
    Remove,
}

impl Change {
    /// kopf's rule for a handler's result.
    pub(crate) fn from_result(value: Option<&Value>) -> Self {
        match value {
            None | Some(Value::Null) => Self::Keep,
            Some(Value::Object(map)) => {
                Self::Replace(map.iter().map(|(k, v)| (Some(k.clone()), v.clone())).collect())
            }
            Some(other) => Self::Replace(vec![(None, other.clone())]),
        }
    }
}

#[derive(Debug, Default)]
struct Data {
    /// Values by key, then by object (ordered, so stores read deterministically).
    by_key: HashMap<IndexKey, BTreeMap<Arc<ObjectKey>, Value>>,
    /// Each object's full key and the index keys it holds, by uid (which alone identifies an
    /// object: a removal needs nothing else), for O(keys of the object) updates.
    by_object: HashMap<String, (Arc<ObjectKey>, Vec<IndexKey>)>,
}

impl Data {
    fn remove(&mut self, object: &ObjectKey) {
        let Some((full, keys)) = self.by_object.remove(&object.uid) else {
            return;
        };
        for key in keys {
            if let Some(store) = self.by_key.get_mut(&key) {
                store.remove(&full);
                if store.is_empty() {
                    self.by_key.remove(&key);
                }
            }
        }
    }

    fn apply(&mut self, object: &ObjectKey, change: Change) {
        match change {
            Change::Keep => {}
            Change::Remove => self.remove(object),
            Change::Replace(entries) => {
                self.remove(object);
                let shared = Arc::new(object.clone());
                let mut keys = Vec::with_capacity(entries.len());
                for (key, value) in entries {
                    self.by_key
                        .entry(key.clone())
                        .or_default()
                        .insert(shared.clone(), value);
                    keys.push(key);
                }
                if !keys.is_empty() {
                    self.by_object.insert(object.uid.clone(), (shared, keys));
                }
            }
        }
    }
}

/// One index, as handlers read it (kopf's `kopf.Index`): a live, read-only mapping from keys
/// to [`Store`]s.
#[derive(Clone)]
pub struct Index {
    name: Arc<str>,
    data: Arc<RwLock<Data>>,
}

impl std::fmt::Debug for Index {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Index")
            .field("name", &self.name)
            .field("keys", &self.len())
            .finish()
    }
}

impl Index {
    /// The index's name: its handler's id.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The values under `key`, or `None` when no object put any there.
    pub fn get(&self, key: &str) -> Option<Store> {
        self.get_key(&Some(key.to_owned()))
    }

    /// The values under kopf's `None` key (results that were not JSON objects).
    pub fn get_none(&self) -> Option<Store> {
        self.get_key(&None)
    }

    /// The values under `key`, which may be the `None` key.
    pub fn get_key(&self, key: &IndexKey) -> Option<Store> {
        self.data.read().by_key.get(key).map(|store| Store {
            values: store.values().cloned().collect(),
        })
    }

    /// Whether any object put a value under `key`.
    pub fn contains_key(&self, key: &str) -> bool {
        self.data.read().by_key.contains_key(&Some(key.to_owned()))
    }

    /// The keys that hold values, sorted (the `None` key first).
    pub fn keys(&self) -> Vec<IndexKey> {
        let mut keys: Vec<IndexKey> = self.data.read().by_key.keys().cloned().collect();
        keys.sort();
        keys
    }

    /// How many keys hold values.
    pub fn len(&self) -> usize {
        self.data.read().by_key.len()
    }

    /// Whether no key holds a value.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every key with its store, sorted by key: one consistent snapshot.
    pub fn snapshot(&self) -> BTreeMap<IndexKey, Store> {
        self.data
            .read()
            .by_key
            .iter()
            .map(|(k, store)| {
                (
                    k.clone(),
                    Store {
                        values: store.values().cloned().collect(),
                    },
                )
            })
            .collect()
    }

    /// How many objects have entries in the index.
    pub fn objects(&self) -> usize {
        self.data.read().by_object.len()
    }
}

/// The values of one index key from all objects (kopf's `kopf.Store`), ordered by object
/// (namespace, name, uid). Never empty.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Store {
    values: Vec<Value>,
}

impl Store {
    /// The values.
    pub fn values(&self) -> &[Value] {
        &self.values
    }

    /// An iterator over the values.
    pub fn iter(&self) -> std::slice::Iter<'_, Value> {
        self.values.iter()
    }

    /// How many values (one per object that put a value under the key).
    pub fn len(&self) -> usize {
        self.values.len()
    }

    /// Whether there are none (never, for a store read from an index).
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Whether `value` is among the values.
    pub fn contains(&self, value: &Value) -> bool {
        self.values.contains(value)
    }
}

impl IntoIterator for Store {
    type Item = Value;
    type IntoIter = std::vec::IntoIter<Value>;

    fn into_iter(self) -> Self::IntoIter {
        self.values.into_iter()
    }
}

impl<'a> IntoIterator for &'a Store {
    type Item = &'a Value;
    type IntoIter = std::slice::Iter<'a, Value>;

    fn into_iter(self) -> Self::IntoIter {
        self.values.iter()
    }
}

/// Every index of this process, by index handler id. Cheap to clone.
#[derive(Clone, Default)]
pub(crate) struct Indexes {
    by_name: Arc<HashMap<String, Index>>,
    /// Advanced by every [`Indexes::clear`]: results of invocations that started before a
    /// clear are not applied after it.
    generation: Arc<AtomicU64>,
}

impl std::fmt::Debug for Indexes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.names()).finish()
    }
}

impl Indexes {
    /// Empty indexes for the given index handler ids.
    pub(crate) fn new<'a>(names: impl IntoIterator<Item = &'a str>) -> Self {
        Self {
            by_name: Arc::new(
                names
                    .into_iter()
                    .map(|n| {
                        (
                            n.to_owned(),
                            Index {
                                name: n.into(),
                                data: Arc::default(),
                            },
                        )
                    })
                    .collect(),
            ),
            generation: Arc::default(),
        }
    }

    /// The index named `name`.
    pub(crate) fn get(&self, name: &str) -> Option<Index> {
        self.by_name.get(name).cloned()
    }

    /// The index names, sorted.
    pub(crate) fn names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.by_name.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// The current generation: take it when an invocation starts, apply with it.
    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(Ordering::SeqCst)
    }

    /// Applies one invocation's change to the index `name` for `object`, unless the indexes
    /// were cleared since `generation`. Returns whether it was applied.
    pub(crate) fn apply(&self, generation: u64, name: &str, object: &ObjectKey, change: Change) -> bool {
        let Some(index) = self.by_name.get(name) else {
            return false;
        };
        let mut data = index.data.write();
        // Checked under the index's lock, which `clear` takes after advancing the generation:
        // a change either lands before the clear empties the index or not at all.
        if self.generation() != generation {
            return false;
        }
        data.apply(object, change);
        true
    }

    /// Empties every index (a new connection: the controller feeds everything again).
    pub(crate) fn clear(&self) {
        self.generation.fetch_add(1, Ordering::SeqCst);
        for index in self.by_name.values() {
            *index.data.write() = Data::default();
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;

    fn obj(name: &str) -> ObjectKey {
        ObjectKey {
            namespace: "default".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        }
    }

    #[test]
    fn results_fold_in_as_kopf_does() {
        let indexes = Indexes::new(["by_app"]);
        let index = indexes.get("by_app").unwrap();
        let change = |v: Value| Change::from_result(Some(&v));
        indexes.apply(0, "by_app", &obj("a"), change(json!({"web": "a", "db": null})));
        indexes.apply(0, "by_app", &obj("b"), change(json!({"web": "b"})));
        indexes.apply(0, "by_app", &obj("c"), change(json!("plain")));
        assert_eq!(index.get("web").unwrap().values(), [json!("a"), json!("b")]);
        assert_eq!(
            index.get("db").unwrap().values(),
            [Value::Null],
            "a null value is a placeholder"
        );
        assert_eq!(index.get_none().unwrap().values(), [json!("plain")]);
        assert_eq!(index.keys(), vec![None, Some("db".into()), Some("web".into())]);
        // No result: the object keeps its entries.
        indexes.apply(0, "by_app", &obj("a"), Change::from_result(None));
        indexes.apply(0, "by_app", &obj("a"), Change::from_result(Some(&Value::Null)));
        assert_eq!(index.get("web").unwrap().len(), 2);
        // A new result replaces the object's entries; empty stores disappear.
        indexes.apply(0, "by_app", &obj("a"), change(json!({"api": 1})));
        assert_eq!(index.get("web").unwrap().values(), [json!("b")]);
        assert!(index.get("db").is_none());
        assert!(index.contains_key("api"));
        let by_uid = ObjectKey {
            namespace: String::new(),
            name: String::new(),
            uid: "uid-b".into(),
        };
        indexes.apply(0, "by_app", &by_uid, Change::Remove);
        assert!(index.get("web").is_none(), "the uid alone removes an object");
        assert_eq!(index.objects(), 2);
        indexes.clear();
        assert!(index.is_empty(), "the handle stays live across a clear");
        assert!(indexes.get("other").is_none());
    }

    #[test]
    fn a_change_from_before_a_clear_is_not_applied() {
        let indexes = Indexes::new(["i"]);
        let before = indexes.generation();
        indexes.clear();
        assert!(!indexes.apply(before, "i", &obj("a"), Change::from_result(Some(&json!(1)))));
        assert!(indexes.get("i").unwrap().is_empty());
        assert!(indexes.apply(
            indexes.generation(),
            "i",
            &obj("a"),
            Change::from_result(Some(&json!(1)))
        ));
        assert!(!indexes.get("i").unwrap().is_empty());
    }

    #[test]
    fn an_empty_object_result_holds_nothing() {
        let indexes = Indexes::new(["i"]);
        indexes.apply(0, "i", &obj("a"), Change::from_result(Some(&json!({"k": 1}))));
        indexes.apply(0, "i", &obj("a"), Change::from_result(Some(&json!({}))));
        let index = indexes.get("i").unwrap();
        assert!(index.is_empty());
        assert_eq!(index.objects(), 0);
    }
}
