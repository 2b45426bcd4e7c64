//! The gate: one "paused" switch combined from every reason to pause (frozen by a peer, not
//! the leader, …), and the driver that applies it to the hub.
//!
//! Freezing (`peering::freeze`) and leader election (`peering::election`) each hold or
//! release their own named reason; the controller is paused while any reason is held. The
//! combined state is published as a `watch::Receiver<bool>` ([`Gate::paused`]) so that the
//! engine, daemons and timers can follow it without knowing why.
//!
//! [`Gate::drive`] turns the switch into dispatch behaviour: on pause the hub stops handing out
//! invocations, every handler process is sent `Drain`, and in-flight work gets the grace period
//! to finish; on resume the [`Hooks`] run first (the app uses them to restart the engine with
//! fresh state) and then dispatch resumes on the same connections, with no reconnect. Watching
//! is never stopped by the gate, so resuming is instant.

use std::{
    collections::BTreeMap,
    sync::Arc,
    time::{Duration, SystemTime},
};

use capstan_proto::pb;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::grpc::Hub;

/// Combines pause reasons into one switch. Cheap to clone.
#[derive(Clone)]
pub struct Gate {
    inner: Arc<Inner>,
}

struct Inner {
    reasons: Mutex<BTreeMap<String, String>>,
    paused: watch::Sender<bool>,
    drained: watch::Sender<bool>,
}

impl Default for Gate {
    fn default() -> Self {
        Self::new()
    }
}

impl Gate {
    /// An open gate (no reason to pause).
    pub fn new() -> Self {
        Self {
            inner: Arc::new(Inner {
                reasons: Mutex::new(BTreeMap::new()),
                paused: watch::channel(false).0,
                drained: watch::channel(false).0,
            }),
        }
    }

    /// Holds the reason `key` (e.g. `leadership`, `peering:<object>`), explaining `why`; the
    /// gate is paused while any reason is held. Holding it again only updates the explanation.
    pub fn hold(&self, key: &str, why: impl Into<String>) {
        let mut reasons = self.inner.reasons.lock();
        reasons.insert(key.to_owned(), why.into());
        self.publish(&reasons);
    }

    /// Releases the reason `key`; the gate opens when no reason is left.
    pub fn release(&self, key: &str) {
        let mut reasons = self.inner.reasons.lock();
        if reasons.remove(key).is_some() {
            self.publish(&reasons);
        }
    }

    fn publish(&self, reasons: &BTreeMap<String, String>) {
        let paused = !reasons.is_empty();
        self.inner.paused.send_if_modified(|current| {
            let changed = *current != paused;
            *current = paused;
            changed
        });
    }

    /// Whether the gate is paused now.
    pub fn is_paused(&self) -> bool {
        *self.inner.paused.borrow()
    }

    /// Follows the combined state: `true` while paused.
    pub fn paused(&self) -> watch::Receiver<bool> {
        self.inner.paused.subscribe()
    }

    /// The reasons held now, by key, for logs and readiness.
    pub fn reasons(&self) -> Vec<(String, String)> {
        self.inner
            .reasons
            .lock()
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    fn explain(&self) -> String {
        let reasons = self.reasons();
        if reasons.is_empty() {
            return "paused".to_owned();
        }
        reasons
            .into_iter()
            .map(|(_, why)| why)
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// Whether the current pause has drained (dispatch stopped, in-flight work finished or
    /// its grace period passed); `false` while not paused.
    pub fn is_drained(&self) -> bool {
        *self.inner.drained.borrow()
    }

    /// Waits until the current pause has drained: dispatch stopped and in-flight work
    /// finished (or its grace period passed). Returns at once when already drained.
    ///
    /// # Cancel safety
    /// Cancel safe: it only observes.
    pub async fn drained(&self) {
        let mut rx = self.inner.drained.subscribe();
        let _ = rx.wait_for(|d| *d).await;
    }

    /// Applies the gate to `hub` until `stop` is cancelled: pauses dispatch and drains handler
    /// processes when paused, resumes after `hooks.resuming()` when opened.
    ///
    /// # Cancel safety
    /// Meant to be spawned; stopping it leaves the hub as it is (the app's own shutdown drain
    /// follows).
    pub async fn drive(self, hub: Hub, grace: Duration, hooks: Arc<dyn Hooks>, stop: CancellationToken) {
        let mut rx = self.paused();
        let mut applied = false;
        loop {
            let paused = *rx.borrow_and_update();
            if paused && !applied {
                applied = true;
                let why = self.explain();
                info!(reason = %why, "pausing: no new handler invocations");
                hub.set_paused(true);
                hub.broadcast(pb::connect_response::Message::Drain(pb::Drain {
                    grace_period: prost_types::Duration::try_from(grace).ok(),
                    reason: format!("the controller is pausing: {why}"),
                    start_time: Some(prost_types::Timestamp::from(SystemTime::now())),
                }));
                let finished = tokio::select! {
                    finished = wait_idle(&hub, grace) => Some(finished),
                    () = stop.cancelled() => return,
                    // Resumed before the drain finished: the loop resumes dispatch at once,
                    // and this pause never counts as drained.
                    _ = rx.wait_for(|p| !*p) => None,
                };
                let Some(finished) = finished else {
                    continue;
                };
                if !finished {
                    warn!(
                        left = hub.in_flight(),
                        ?grace,
                        "in-flight invocations did not finish within the grace period; cancelling them"
                    );
                    hooks.overrun().await;
                }
                self.inner.drained.send_replace(true);
                continue;
            }
            if !paused && applied {
                applied = false;
                // Cleared first: a reason held while the engine is replaced waits for a drain
                // of its own, never this pause's.
                self.inner.drained.send_replace(false);
                hooks.resuming().await;
                hub.set_paused(false);
                info!("resumed: handler invocations continue");
            }
            tokio::select! {
                changed = rx.changed() => if changed.is_err() { return },
                () = stop.cancelled() => return,
            }
        }
    }
}

/// Waits until nothing is in flight (`true`) or `grace` has passed (`false`).
async fn wait_idle(hub: &Hub, grace: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + grace;
    loop {
        if hub.in_flight() == 0 {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What the owner of the processing pipeline does around pauses.
pub trait Hooks: Send + Sync {
    /// Before dispatch resumes: work that waited for dispatch during the pause may describe
    /// objects as they were before the pause (another operator may have handled them since),
    /// so it must be withdrawn and re-evaluated from fresh state.
    fn resuming(&self) -> BoxFuture<'_, ()>;
    /// In-flight invocations outlived the grace period of a pause: cancel them.
    fn overrun(&self) -> BoxFuture<'_, ()>;
}

/// Hooks that do nothing (tests, tools).
pub struct NoHooks;

impl Hooks for NoHooks {
    fn resuming(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }

    fn overrun(&self) -> BoxFuture<'_, ()> {
        Box::pin(async {})
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn any_held_reason_pauses() {
        let gate = Gate::new();
        let rx = gate.paused();
        assert!(!gate.is_paused());
        gate.hold("leadership", "standby");
        gate.hold("peering:a", "frozen by x");
        assert!(*rx.borrow());
        gate.release("leadership");
        assert!(gate.is_paused());
        assert_eq!(gate.explain(), "frozen by x");
        gate.release("peering:a");
        assert!(!*rx.borrow());
        gate.release("unknown");
        assert!(!gate.is_paused());
    }

    #[test]
    fn updating_an_explanation_does_not_notify() {
        let gate = Gate::new();
        let mut rx = gate.paused();
        gate.hold("a", "one");
        assert!(rx.has_changed().unwrap_or(false));
        rx.borrow_and_update();
        gate.hold("a", "two");
        assert!(!rx.has_changed().unwrap_or(true));
    }

    #[derive(Default)]
    struct Counting {
        resumed: Mutex<u32>,
    }

    impl Hooks for Counting {
        fn resuming(&self) -> BoxFuture<'_, ()> {
            *self.resumed.lock() += 1;
            Box::pin(async {})
        }
        fn overrun(&self) -> BoxFuture<'_, ()> {
            Box::pin(async {})
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_driver_pauses_drains_and_resumes_the_hub() {
        let gate = Gate::new();
        let hub = Hub::default();
        let hooks = Arc::new(Counting::default());
        let stop = CancellationToken::new();
        let task = tokio::spawn(gate.clone().drive(
            hub.clone(),
            Duration::from_secs(5),
            hooks.clone(),
            stop.clone(),
        ));
        gate.hold("leadership", "standby");
        tokio::time::timeout(Duration::from_secs(1), gate.drained())
            .await
            .expect("an idle hub drains at once");
        gate.release("leadership");
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        assert_eq!(*hooks.resumed.lock(), 1);
        stop.cancel();
        task.await.expect("the driver ends when stopped");
    }
}
