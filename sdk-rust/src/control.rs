//! The live state of one running invocation that the stream reader changes from outside the
//! handler: cancellation (with the reason it was cancelled for) and the latest body of the
//! invocation's object.
//!
//! The connection module cancels an invocation when the controller sends `Cancel`, the dispatch
//! module when the invocation's deadline passes, the test kit when a test stops a daemon. The
//! handler observes it through [`crate::Context::cancelled`]; the dispatch module uses it to tell
//! a handler that gave up because of a cancel (answered `Cancelled`) from one that failed.
//!
//! The connection module also stores the body of every `ObjectUpdate` here (the test kit does so
//! for [`crate::testing::Running::update_body`]), and [`crate::Context::body`] reads it, so that a
//! running daemon sees its object as it is now, as kopf's live `body` does. The body is kept as
//! an `Arc` behind a read-write lock: a read clones the `Arc`, an update swaps it, and neither
//! waits on the handler.

use std::sync::{Arc, OnceLock};

use parking_lot::RwLock;
use serde_json::Value;
use tokio_util::sync::CancellationToken;

use crate::pb;

/// The live state of one invocation; clones share it.
#[derive(Debug, Clone, Default)]
pub(crate) struct Control {
    token: CancellationToken,
    reason: Arc<OnceLock<pb::CancelReason>>,
    /// The body of the latest `ObjectUpdate`; `None` until one arrives, and then the
    /// invocation's own body is the latest.
    body: Arc<RwLock<Option<Arc<Value>>>>,
}

impl Control {
    /// A fresh, uncancelled control.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Cancels the invocation; the first reason given is kept.
    pub(crate) fn cancel(&self, reason: pb::CancelReason) {
        let _ = self.reason.set(reason);
        self.token.cancel();
    }

    /// The token handlers wait on.
    pub(crate) fn token(&self) -> &CancellationToken {
        &self.token
    }

    /// Why it was cancelled, if it was.
    pub(crate) fn reason(&self) -> Option<pb::CancelReason> {
        self.reason.get().copied()
    }

    /// Replaces the object's body with a newer one (an `ObjectUpdate`).
    pub(crate) fn update_body(&self, body: Value) {
        *self.body.write() = Some(Arc::new(body));
    }

    /// The body of the latest update, if any arrived.
    pub(crate) fn latest_body(&self) -> Option<Arc<Value>> {
        self.body.read().clone()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn keeps_the_first_reason() {
        let control = Control::new();
        assert!(control.reason().is_none() && !control.token().is_cancelled());
        control.cancel(pb::CancelReason::DeadlineExceeded);
        control.clone().cancel(pb::CancelReason::RuntimeShutdown);
        assert!(control.token().is_cancelled());
        assert_eq!(control.reason(), Some(pb::CancelReason::DeadlineExceeded));
    }

    #[test]
    fn keeps_the_latest_body() {
        let control = Control::new();
        assert!(control.latest_body().is_none());
        let before = control.clone();
        control.update_body(json!({"spec": {"size": 1}}));
        control.update_body(json!({"spec": {"size": 2}}));
        assert_eq!(before.latest_body().unwrap()["spec"]["size"], 2);
    }
}
