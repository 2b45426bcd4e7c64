//! [`Snapshot`]: a cheap, immutable view of the object's body (or of one part of it) as it was
//! when a [`crate::Context`] accessor was called.
//!
//! A running daemon's object changes while the daemon runs, and the controller pushes each new
//! body (`ObjectUpdate`); the control module keeps the latest. A handler cannot hold a plain
//! reference into a body that may be replaced at any moment, so [`crate::Context::body`],
//! [`crate::Context::spec`] and their siblings hand out a `Snapshot` instead: an `Arc` of the
//! whole body plus the function that finds the part asked for. Taking one costs an `Arc`
//! clone; it derefs to the part (a [`serde_json::Value`], or a label map), so indexing and
//! method calls work as on the value itself, and it never changes under the handler's feet.

use std::{fmt, ops::Deref, sync::Arc};

use serde_json::Value;

/// An immutable view of the object's body, or of one part of it, taken at one moment.
///
/// It derefs to the part: `ctx.spec()["size"]`, `ctx.labels().get("app")`. Call the accessor
/// again for a newer view; a long-running daemon sees the object's latest body that way.
pub struct Snapshot<T: ?Sized + 'static = Value> {
    root: Arc<Value>,
    part: fn(&Value) -> &T,
}

impl<T: ?Sized> Snapshot<T> {
    /// A view of the part of `root` that `part` finds.
    pub(crate) fn new(root: Arc<Value>, part: fn(&Value) -> &T) -> Self {
        Self { root, part }
    }

    /// The whole body this view was taken from.
    pub fn body(&self) -> &Value {
        &self.root
    }
}

impl<T: ?Sized> Deref for Snapshot<T> {
    type Target = T;

    fn deref(&self) -> &T {
        (self.part)(&self.root)
    }
}

impl<T: ?Sized> AsRef<T> for Snapshot<T> {
    fn as_ref(&self) -> &T {
        self
    }
}

impl<T: ?Sized> Clone for Snapshot<T> {
    fn clone(&self) -> Self {
        Self {
            root: self.root.clone(),
            part: self.part,
        }
    }
}

impl<T: ?Sized + fmt::Debug> fmt::Debug for Snapshot<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&**self, f)
    }
}

impl fmt::Display for Snapshot<Value> {
    /// Writes the part as compact JSON text.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&**self, f)
    }
}

impl<T: ?Sized + PartialEq> PartialEq<T> for Snapshot<T> {
    fn eq(&self, other: &T) -> bool {
        **self == *other
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn spec(body: &Value) -> &Value {
        body.get("spec").unwrap_or(&Value::Null)
    }

    #[test]
    fn derefs_to_the_part_and_keeps_its_body() {
        let root = Arc::new(json!({"spec": {"size": 3}}));
        let view = Snapshot::new(root.clone(), spec);
        assert_eq!(view["size"], 3);
        assert_eq!(view, json!({"size": 3}));
        assert_eq!(view.to_string(), r#"{"size":3}"#);
        assert!(Arc::ptr_eq(&root, &view.clone().root));
        assert_eq!(view.body(), &*root);
    }
}
