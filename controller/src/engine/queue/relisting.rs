//! Re-processing objects at rest. An object that is handled, with no retry scheduled, no
//! daemon or timer running and no re-run due, keeps no body in memory (a body is most of
//! what a known object would cost); so when every known object must get a cycle again —
//! its handlers changed, or dispatch resumed after a pause — the objects are listed again,
//! page by page with the watch's scopes and selectors, and each known object at rest gets a
//! cycle with its current body. That costs one paged LIST per such change, which happens
//! on deployments and peer handovers, not per event.
//!
//! The resync marks the objects it leaves to the listing; a cycle that starts meanwhile (a
//! watch event) clears the mark, so each object gets one cycle with the new handlers, also
//! when a listing is retried or superseded. One listing per queue runs at a time; a newer
//! request supersedes a running one. A failed listing is tried again with a growing pause
//! until no marked object is left or the queue stops.

use std::time::Duration;

use parking_lot::Mutex;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use super::{Queue, rv_of, uid_of};
use crate::{
    k8s::watch::{list_page, list_params},
    model::EventType,
};

/// How the queue's objects are listed again: as the watch lists them.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The watched namespaces (`None`: cluster-wide).
    pub scopes: Vec<Option<String>>,
    /// The watch's server-side label selector.
    pub label_selector: Option<String>,
    /// The watch's server-side field selector.
    pub field_selector: Option<String>,
    /// Objects per page.
    pub page_size: u32,
    /// Deadline of each page's request.
    pub timeout: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            scopes: vec![None],
            label_selector: None,
            field_selector: None,
            page_size: 500,
            timeout: Duration::from_secs(60),
        }
    }
}

/// The listing in progress, if any.
#[derive(Default)]
pub(super) struct Relisting {
    current: Mutex<Option<CancellationToken>>,
}

/// Pauses between failed listings.
const FIRST_PAUSE: Duration = Duration::from_secs(1);
const LONGEST_PAUSE: Duration = Duration::from_secs(30);

impl Queue {
    /// Lists the objects again and gives every known object at rest a cycle (superseding a
    /// listing still running).
    pub(super) fn relist(&self) {
        let cancel = self.ctx.cancel.child_token();
        if let Some(previous) = self.relisting.current.lock().replace(cancel.clone()) {
            previous.cancel();
        }
        let queue = self.clone();
        let span = info_span!("relist", resource = %self.ctx.resource);
        self.workers.spawn(
            async move {
                let mut pause = FIRST_PAUSE;
                loop {
                    if !queue.slots.lock().values().any(|s| s.relist && !s.gone) {
                        debug!("no object waits for its listed body any more");
                        return;
                    }
                    let listed = tokio::select! {
                        () = cancel.cancelled() => return,
                        listed = queue.list_all() => listed,
                    };
                    match listed {
                        Ok(n) => {
                            info!(objects = n, "listed again; objects at rest re-processed");
                            return;
                        }
                        Err(e) => {
                            warn!(error = %e, retry_in = ?pause, "listing the objects again failed");
                        }
                    }
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        () = tokio::time::sleep(pause) => {}
                    }
                    pause = (pause * 2).min(LONGEST_PAUSE);
                }
            }
            .instrument(span),
        );
    }

    /// One listing of every scope; returns how many objects were queued.
    async fn list_all(&self) -> Result<usize, kube::Error> {
        let settings = &self.ctx.relisting;
        let params = list_params(
            settings.page_size,
            settings.label_selector.as_deref(),
            settings.field_selector.as_deref(),
        );
        let mut queued = 0;
        for scope in &settings.scopes {
            let api = self.ctx.objects.api(&self.ctx.resource, scope.as_deref());
            let mut params = params.clone();
            loop {
                let page = list_page(&api, &params, settings.timeout).await?;
                for obj in page.items {
                    let body = crate::k8s::objects::to_value(obj);
                    if self.push_at_rest(&body) {
                        queued += 1;
                    }
                }
                match page.metadata.continue_.filter(|c| !c.is_empty()) {
                    Some(token) => params.continue_token = Some(token),
                    None => break,
                }
            }
        }
        Ok(queued)
    }

    /// Queues a listed body for a known object the resync marked (no cycle started since, no
    /// work waiting, not gone, and the body not older than what its last cycle saw); returns
    /// whether it did.
    fn push_at_rest(&self, body: &Value) -> bool {
        let Some(uid) = uid_of(body) else {
            return false;
        };
        let mut slots = self.slots.lock();
        let Some(slot) = slots.get_mut(uid.as_str()) else {
            return false;
        };
        let older = matches!((slot.written_rv, rv_of(body)), (Some(w), Some(rv)) if rv < w);
        if !slot.relist || slot.gone || slot.pending.is_some() || older {
            debug!(%uid, "listed object had a cycle since, or has newer work; skipped");
            return false;
        }
        slot.relist = false;
        if self.set_pending(slot, EventType::Modified, body) {
            drop(slots);
            self.enqueue(uid);
        }
        true
    }
}
