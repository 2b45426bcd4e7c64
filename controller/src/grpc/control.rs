//! The runtime side of one piece of work: how its caller cancels it, and what flows between
//! the caller and the running invocation.
//!
//! [`crate::model::Work`] is data — which handler, which attempt, which object, which payload —
//! and crosses layers as such; a [`Control`] is the machinery next to it, which only the hub
//! watches while the work runs (`grpc::hub`) and only its caller holds the other ends of
//! (`engine::processing`, `engine::queue`, `engine::daemons`).

use std::sync::Arc;

use parking_lot::Mutex;
use serde_json::Value;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::model::{CancelReason, Patch};

/// How a caller steers one piece of work while it runs.
#[derive(Clone, Debug)]
pub struct Control {
    /// Cancelling this token sends `Cancel` to the handler (daemon stop, shutdown, superseded).
    pub cancel: CancellationToken,
    /// The reason sent with that `Cancel`, read at the moment of cancellation (daemons are
    /// stopped for reasons not known when they start).
    pub reason: Arc<Mutex<CancelReason>>,
    /// Where patches sent by a running invocation (`InvocationUpdate`) go; `None` drops them
    /// with a notice to the handler process.
    pub updates: Option<mpsc::UnboundedSender<Vec<Patch>>>,
    /// The object's latest bodies while the invocation runs (daemons); sent to handler
    /// processes that support object updates.
    pub body_updates: Option<watch::Receiver<Value>>,
}

impl Default for Control {
    fn default() -> Self {
        Self::cancelled_by(CancellationToken::new())
    }
}

impl Control {
    /// Work cancelled by `cancel` (for the controller's shutdown, unless the reason is changed).
    pub fn cancelled_by(cancel: CancellationToken) -> Self {
        Self {
            cancel,
            reason: Arc::new(Mutex::new(CancelReason::RuntimeShutdown)),
            updates: None,
            body_updates: None,
        }
    }

    /// The reason to send with `Cancel` now.
    pub fn reason(&self) -> CancelReason {
        *self.reason.lock()
    }
}
