//! Memos (kopf's `memo`): runtime-only values kept in this process between handler calls.
//!
//! Every object has its own [`Memo`], which lives from the first time a handler reads it until
//! the controller says the object is gone (`ObjectGone`). An invocation whose handler never
//! reads the memo (an index handler, typically) makes none. It starts as a shallow copy of the
//! operator-wide memo
//! ([`crate::Registry::memo`]): the same values, shared, under the same keys; keys added later
//! to either side stay on that side. Activities (startup, cleanup, login, probe) get the
//! operator-wide memo itself, as in kopf.
//!
//! Values are any `Send + Sync + 'static` Rust value (a client, a channel, a counter), stored
//! behind an `Arc`; nothing is serialised, nothing is written to the cluster. A new connection
//! to the controller keeps the memos: they belong to the process, not to the stream.
//!
//! # Bound
//!
//! `ObjectGone` is best effort (a congested stream misses it, an older controller never sends
//! it), so the objects' memos are bounded: at most [`MAX_OBJECT_MEMOS`] objects keep one, and
//! beyond that the memo of the object whose handlers read it least recently is dropped (that
//! object starts again from a copy of the operator-wide memo).

use std::{
    any::Any,
    collections::{BTreeMap, HashMap},
    sync::{Arc, OnceLock},
};

use parking_lot::Mutex;

type Value = Arc<dyn Any + Send + Sync>;

/// At most this many objects keep a memo (see the module docs).
pub(crate) const MAX_OBJECT_MEMOS: usize = 65_536;

/// A map of runtime values (kopf's `kopf.Memo`). Cheap to clone: clones share the same map.
#[derive(Clone, Default)]
pub struct Memo {
    values: Arc<Mutex<BTreeMap<String, Value>>>,
}

impl std::fmt::Debug for Memo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Memo").field("keys", &self.keys()).finish()
    }
}

impl Memo {
    /// An empty memo.
    pub fn new() -> Self {
        Self::default()
    }

    /// The value under `key`, if there is one of type `T`.
    pub fn get<T: Any + Send + Sync>(&self, key: &str) -> Option<Arc<T>> {
        self.values
            .lock()
            .get(key)
            .cloned()
            .and_then(|v| v.downcast::<T>().ok())
    }

    /// Stores `value` under `key`, replacing what was there.
    pub fn insert<T: Any + Send + Sync>(&self, key: impl Into<String>, value: T) {
        self.values.lock().insert(key.into(), Arc::new(value));
    }

    /// The value under `key`; when there is none of type `T`, stores `make()` first. The check
    /// and the store are one step, so concurrent handlers of the same object agree.
    pub fn get_or_insert_with<T: Any + Send + Sync>(&self, key: &str, make: impl FnOnce() -> T) -> Arc<T> {
        let mut values = self.values.lock();
        if let Some(existing) = values.get(key).cloned().and_then(|v| v.downcast::<T>().ok()) {
            return existing;
        }
        let made = Arc::new(make());
        values.insert(key.to_owned(), made.clone());
        made
    }

    /// Removes the value under `key`; returns whether there was one.
    pub fn remove(&self, key: &str) -> bool {
        self.values.lock().remove(key).is_some()
    }

    /// Whether there is a value under `key`.
    pub fn contains_key(&self, key: &str) -> bool {
        self.values.lock().contains_key(key)
    }

    /// The keys, sorted.
    pub fn keys(&self) -> Vec<String> {
        self.values.lock().keys().cloned().collect()
    }

    /// How many values.
    pub fn len(&self) -> usize {
        self.values.lock().len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A new memo with the same values (shared) under the same keys.
    fn shallow_copy(&self) -> Self {
        Self {
            values: Arc::new(Mutex::new(self.values.lock().clone())),
        }
    }
}

/// The operator-wide memo and the memos of the objects seen, by uid.
#[derive(Clone, Debug)]
pub(crate) struct Memos {
    operator: Memo,
    objects: Arc<Mutex<Objects>>,
}

/// The objects' memos, with the order in which they were last used.
#[derive(Debug)]
struct Objects {
    /// Memo and last use, by uid.
    by_uid: HashMap<String, (Memo, u64)>,
    /// Uids by last use, least recent first.
    by_use: BTreeMap<u64, String>,
    /// The last use handed out.
    clock: u64,
    /// At most this many memos.
    capacity: usize,
}

impl Default for Memos {
    fn default() -> Self {
        Self::new(Memo::new())
    }
}

impl Memos {
    /// Memos starting from `operator`.
    pub(crate) fn new(operator: Memo) -> Self {
        Self::with_capacity(operator, MAX_OBJECT_MEMOS)
    }

    /// Memos starting from `operator`, for at most `capacity` objects.
    pub(crate) fn with_capacity(operator: Memo, capacity: usize) -> Self {
        Self {
            operator,
            objects: Arc::new(Mutex::new(Objects {
                by_uid: HashMap::new(),
                by_use: BTreeMap::new(),
                clock: 0,
                capacity: capacity.max(1),
            })),
        }
    }

    /// The operator-wide memo.
    pub(crate) fn operator(&self) -> &Memo {
        &self.operator
    }

    /// The memo of the object `uid`, made on first sight from the operator-wide memo.
    pub(crate) fn object(&self, uid: &str) -> Memo {
        if uid.is_empty() {
            return self.operator.clone();
        }
        let mut objects = self.objects.lock();
        objects.clock += 1;
        let now = objects.clock;
        if let Some((memo, used)) = objects.by_uid.get_mut(uid) {
            let (memo, before) = (memo.clone(), std::mem::replace(used, now));
            objects.by_use.remove(&before);
            objects.by_use.insert(now, uid.to_owned());
            return memo;
        }
        while objects.by_uid.len() >= objects.capacity {
            let Some((_, oldest)) = objects.by_use.pop_first() else {
                break;
            };
            objects.by_uid.remove(&oldest);
        }
        let memo = self.operator.shallow_copy();
        objects.by_uid.insert(uid.to_owned(), (memo.clone(), now));
        objects.by_use.insert(now, uid.to_owned());
        memo
    }

    /// The memo of the object `uid`, made only when a handler reads it.
    pub(crate) fn lazy(&self, uid: &str) -> Lazy {
        Lazy(Arc::new(LazyInner {
            memos: self.clone(),
            uid: uid.to_owned(),
            memo: OnceLock::new(),
        }))
    }

    /// Drops the memo of an object that went away.
    pub(crate) fn forget(&self, uid: &str) -> bool {
        let mut objects = self.objects.lock();
        let Some((_, used)) = objects.by_uid.remove(uid) else {
            return false;
        };
        objects.by_use.remove(&used);
        true
    }

    /// How many objects have a memo.
    pub(crate) fn objects(&self) -> usize {
        self.objects.lock().by_uid.len()
    }
}

/// An invocation's memo, made on first read (cheap to clone: clones share it).
#[derive(Clone, Debug)]
pub(crate) struct Lazy(Arc<LazyInner>);

#[derive(Debug)]
struct LazyInner {
    memos: Memos,
    uid: String,
    memo: OnceLock<Memo>,
}

impl Lazy {
    /// A memo that is already there.
    #[cfg(test)]
    pub(crate) fn ready(memo: Memo) -> Self {
        Self(Arc::new(LazyInner {
            memos: Memos::with_capacity(Memo::new(), 1),
            uid: String::new(),
            memo: OnceLock::from(memo),
        }))
    }

    /// The memo, made now if it was not yet.
    pub(crate) fn get(&self) -> &Memo {
        self.0.memo.get_or_init(|| self.0.memos.object(&self.0.uid))
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[test]
    fn values_of_any_type_are_kept_and_typed() {
        let memo = Memo::new();
        memo.insert("count", 3_u32);
        assert_eq!(*memo.get::<u32>("count").unwrap(), 3);
        assert!(
            memo.get::<String>("count").is_none(),
            "a different type is not there"
        );
        let counter = memo.get_or_insert_with("calls", || AtomicU32::new(0));
        counter.fetch_add(1, Ordering::SeqCst);
        let again = memo.get_or_insert_with("calls", || AtomicU32::new(100));
        assert_eq!(again.load(Ordering::SeqCst), 1, "the same value is returned");
        assert_eq!(memo.keys(), ["calls", "count"]);
        assert!(memo.remove("count"));
        assert!(!memo.contains_key("count"));
        assert_eq!(memo.len(), 1);
    }

    #[test]
    fn object_memos_start_as_a_shallow_copy_of_the_operator_memo() {
        let operator = Memo::new();
        operator.insert("shared", AtomicU32::new(0));
        let memos = Memos::new(operator.clone());
        let a = memos.object("uid-a");
        a.get::<AtomicU32>("shared")
            .unwrap()
            .fetch_add(1, Ordering::SeqCst);
        assert_eq!(
            operator
                .get::<AtomicU32>("shared")
                .unwrap()
                .load(Ordering::SeqCst),
            1,
            "values are shared"
        );
        a.insert("own", "a");
        assert!(!operator.contains_key("own"), "keys are not");
        assert!(memos.object("uid-a").contains_key("own"), "kept between calls");
        assert!(!memos.object("uid-b").contains_key("own"), "per object");
        assert!(memos.forget("uid-a"));
        assert!(
            !memos.object("uid-a").contains_key("own"),
            "dropped when the object goes away"
        );
        assert_eq!(memos.objects(), 2);
        assert!(
            memos.object("").contains_key("shared"),
            "no object: the operator memo"
        );
    }

    #[test]
    fn memos_are_bounded_and_the_least_recently_used_goes_first() {
        let memos = Memos::with_capacity(Memo::new(), 3);
        for uid in ["a", "b", "c"] {
            memos.object(uid).insert("own", uid);
        }
        memos.object("a");
        memos.object("d");
        assert_eq!(memos.objects(), 3);
        assert!(memos.object("a").contains_key("own"), "used recently: kept");
        assert!(
            !memos.object("b").contains_key("own"),
            "least recently used: dropped"
        );
        // Making b's memo again dropped the next least recently used: c.
        assert!(!memos.forget("c"));
        assert!(memos.forget("d"));
        assert_eq!(memos.objects(), 2, "a and b");
        let full = Memos::new(Memo::new());
        for n in 0..MAX_OBJECT_MEMOS + 10 {
            full.object(&format!("uid-{n}"));
        }
        assert_eq!(full.objects(), MAX_OBJECT_MEMOS);
    }

    #[test]
    fn a_lazy_memo_is_made_on_first_read() {
        let memos = Memos::new(Memo::new());
        let lazy = memos.lazy("uid-a");
        assert_eq!(memos.objects(), 0);
        lazy.clone().get().insert("k", 1_u8);
        assert_eq!(memos.objects(), 1);
        assert!(lazy.get().contains_key("k"), "clones share it");
    }
}
