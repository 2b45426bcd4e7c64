//! Listing objects again for the cycles whose body is not in memory.
//!
//! - **Objects at rest.** An object that is handled, with no retry scheduled, no daemon or
//!   timer running and no re-run due, keeps no body in memory (a body is most of what a known
//!   object would cost); so when every known object must get a cycle again — its handlers
//!   changed, or dispatch resumed after a pause — the objects are listed again, page by page
//!   with the watch's scopes and selectors, and each known object at rest gets a cycle with
//!   its current body. That costs one paged LIST per such change, which happens on
//!   deployments and peer handovers, not per event.
//! - **Objects beyond the waiting bound.** A queue holds at most `waiting_bodies` waiting
//!   bodies (changes a quarter more); an event beyond that only marks its object (a start with many unhandled objects,
//!   or a burst). The listing then queues the marked objects' bodies one by one as workers
//!   take waiting ones, so the listing itself is paced by the processing (backpressure)
//!   instead of bodies piling up in memory.
//!
//! Marked objects get the listed body as their next work; a cycle that starts meanwhile with
//! a body at least as new (a watch event, which arrived after the mark) clears the mark, so
//! each object gets one cycle, also when a listing is retried or superseded. resourceVersions
//! are not compared (see `queue::version`): a mark is satisfied by a pass that started after
//! the event that marked the object (its snapshot is at least as new); a pass that started
//! before leaves the mark for a later one, and so does a body listed by a pass that started
//! before the answer of a write whose echo the object still awaits. The echoes
//! of the controller's own writes are dropped, as the write's answer was checked instead (see
//! [`super`]): only one that comes before its answer waits, one per running worker. One listing per queue runs at a time: a resync supersedes a running one (the
//! handlers changed), a new mark beyond the bound asks the running one for another pass. A
//! failed listing is tried again with a growing pause until no marked object is left or the
//! queue stops; a listing that ends with no new mark since it started clears the marks of
//! objects it did not find (they are gone: their deletion comes by the watch).

use std::{
    sync::atomic::{AtomicBool, Ordering},
    time::Duration,
};

use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use super::{Queue, Stored, ready::Priority, version::Judged};
use crate::{
    k8s::{
        listing::{list_page, list_params},
        watch::is_gone,
    },
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
    /// At most this many objects of the queue wait with their body; more wait for a listing.
    pub waiting_bodies: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            scopes: vec![None],
            label_selector: None,
            field_selector: None,
            page_size: 500,
            timeout: Duration::from_secs(60),
            waiting_bodies: 2048,
        }
    }
}

/// The listing in progress, if any.
#[derive(Default)]
pub(super) struct Relisting {
    /// The running listing's number and cancellation.
    pub(super) current: Mutex<Option<(u64, CancellationToken)>>,
    /// Listings started, to tell a running one from its successor.
    started: std::sync::atomic::AtomicU64,
    /// Passes started (of any listing): a mark is satisfied by a pass that started after it.
    passes: std::sync::atomic::AtomicU64,
    /// An object was marked since the running listing began its pass (set and read under the
    /// queue's slots lock, with the marks).
    marked: AtomicBool,
    /// When the last listing ended, and the pause before a listing for new marks may start:
    /// marks that keep coming while the queue is full must not list the whole collection
    /// back to back.
    spacing: Mutex<Spacing>,
}

struct Spacing {
    ended: Option<tokio::time::Instant>,
    pause: Duration,
}

impl Default for Spacing {
    fn default() -> Self {
        Self {
            ended: None,
            pause: FIRST_PAUSE,
        }
    }
}

impl Relisting {
    /// Records that an object was marked (called under the slots lock).
    pub(super) fn marked(&self) {
        self.marked.store(true, Ordering::Relaxed);
    }

    /// The number of the next pass to start: the first that satisfies a mark made now.
    pub(super) fn next_pass(&self) -> u64 {
        self.passes.load(Ordering::Relaxed).saturating_add(1)
    }

    /// A pass starts: its number.
    fn pass_starts(&self) -> u64 {
        self.passes.fetch_add(1, Ordering::Relaxed).saturating_add(1)
    }
}

/// The pause to wait now; the next one is twice as long, up to [`LONGEST_PAUSE`].
fn grow(pause: &mut Duration) -> Duration {
    let now = *pause;
    *pause = (now * 2).min(LONGEST_PAUSE);
    now
}

/// What became of a listed body.
enum Listed {
    Queued,
    Skipped,
    NoRoom,
}

/// Pauses between passes (failed, or followed by more marks).
const FIRST_PAUSE: Duration = Duration::from_secs(1);
const LONGEST_PAUSE: Duration = Duration::from_secs(30);

impl Queue {
    /// Lists the objects again and gives every marked object a cycle (superseding a listing
    /// still running: the marks are those of new handlers).
    pub(super) fn relist(&self) {
        let mut current = self.relisting.current.lock();
        if let Some((_, previous)) = current.take() {
            previous.cancel();
        }
        self.start_listing(&mut current, Duration::ZERO);
    }

    /// Makes sure a listing runs for the objects marked (called after marking them): one that
    /// runs already makes another pass if its pass may have missed them.
    pub(super) fn relist_soon(&self) {
        let mut current = self.relisting.current.lock();
        if current.is_none() {
            // Soon after the last listing ended, the pause grows with each listing.
            let mut spacing = self.relisting.spacing.lock();
            let since = spacing.ended.map(|at| at.elapsed());
            let delay = match since {
                Some(since) if since < LONGEST_PAUSE => {
                    let delay = spacing.pause.saturating_sub(since);
                    spacing.pause = (spacing.pause * 2).min(LONGEST_PAUSE);
                    delay
                }
                _ => {
                    spacing.pause = FIRST_PAUSE;
                    Duration::ZERO
                }
            };
            drop(spacing);
            self.start_listing(&mut current, delay);
        }
    }

    fn start_listing(&self, current: &mut Option<(u64, CancellationToken)>, delay: Duration) {
        let cancel = self.ctx.cancel.child_token();
        let number = self.relisting.started.fetch_add(1, Ordering::Relaxed);
        *current = Some((number, cancel.clone()));
        let queue = self.clone();
        let span = info_span!("relist", resource = %self.ctx.resource);
        self.workers.spawn(
            async move {
                // Between passes: growing while objects keep being marked during passes (a
                // trickle of marks must not become a stream of whole LISTs) or listings fail.
                let mut pause = FIRST_PAUSE;
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = tokio::time::sleep(delay) => {}
                }
                loop {
                    // Not while paused: resuming re-processes (and lists) every object. Not while
                    // the queue is more than half full: the bodies would wait for room anyway,
                    // and the listing that marked the objects (the watch's) is likely still
                    // going, so a pass now would miss its later marks and need another.
                    if !queue.unpaused(&cancel).await
                        || !queue.low_water(&cancel).await
                        || queue.pass_done(number, false)
                    {
                        return;
                    }
                    let listed = tokio::select! {
                        () = cancel.cancelled() => return,
                        listed = queue.list_all(&cancel) => listed,
                    };
                    let wait = match listed {
                        Ok(n) => {
                            info!(
                                objects = n,
                                "listed again; objects without a body in memory queued"
                            );
                            if queue.pass_done(number, true) {
                                return;
                            }
                            debug!(retry_in = ?pause, "objects were marked during the pass; another pass");
                            grow(&mut pause)
                        }
                        // A pass paced by slow handlers can outlive its continue token: the
                        // objects it queued are unmarked, the next pass goes on with the rest.
                        Err(e) if is_gone(&e) => {
                            debug!(error = %e, "the listing expired; listing again");
                            FIRST_PAUSE
                        }
                        Err(e) => {
                            warn!(error = %e, retry_in = ?pause, "listing the objects again failed");
                            grow(&mut pause)
                        }
                    };
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        () = tokio::time::sleep(wait) => {}
                    }
                }
            }
            .instrument(span),
        );
    }

    /// Before a pass (and after a whole one, `listed`): whether the listing `number` is done —
    /// no object marked, or none marked since its pass began (the marks left are of objects
    /// the pass did not find, and are cleared). If it is not done, a new pass begins.
    fn pass_done(&self, number: u64, listed: bool) -> bool {
        let mut slots = self.slots.lock();
        if self
            .relisting
            .current
            .lock()
            .as_ref()
            .is_none_or(|(n, _)| *n != number)
        {
            // Superseded: its successor's pass covers the marks (and must see new ones).
            return true;
        }
        let marked_since = self.relisting.marked.swap(false, Ordering::Relaxed);
        let done = if listed && !marked_since {
            let mut unlisted = 0_usize;
            for slot in slots.values_mut().filter(|s| s.relist.is_some()) {
                slot.unmark();
                unlisted += 1;
            }
            if unlisted > 0 {
                debug!(objects = unlisted, "marked objects not listed (gone) unmarked");
            }
            true
        } else {
            !slots.values().any(|s| s.relist.is_some() && !s.gone)
        };
        if done {
            let mut current = self.relisting.current.lock();
            if current.as_ref().is_some_and(|(n, _)| *n == number) {
                *current = None;
                self.relisting.spacing.lock().ended = Some(tokio::time::Instant::now());
            }
            debug!("no object waits for its listed body any more");
        }
        done
    }

    /// One listing of every scope; returns how many objects were queued. A marked object's
    /// body is queued only when the queue has room for it: the listing waits for the workers.
    async fn list_all(&self, cancel: &CancellationToken) -> Result<usize, kube::Error> {
        let settings = &self.ctx.relisting;
        let params = list_params(
            settings.page_size,
            settings.label_selector.as_deref(),
            settings.field_selector.as_deref(),
        );
        let mut queued = 0;
        let pass = self.relisting.pass_starts();
        let started = tokio::time::Instant::now();
        for scope in &settings.scopes {
            let api = self.ctx.objects.api(&self.ctx.resource, scope.as_deref());
            let mut params = params.clone();
            loop {
                let page = list_page(&api, &params, None, settings.timeout).await?;
                let next = page.continue_token.clone();
                // Only the marked objects are kept, compressed, while the pass waits for room;
                // the page's objects are parsed one at a time (see `k8s::listing`).
                let mut marked: Vec<(String, Stored)> = Vec::new();
                for obj in page.objects() {
                    let obj = match obj {
                        Ok(obj) => obj,
                        Err(unparsed) => {
                            crate::k8s::quarantine::quarantine(&self.ctx.resource.plural, &unparsed);
                            continue;
                        }
                    };
                    let Some(uid) = obj.metadata.uid.clone() else {
                        continue;
                    };
                    let is_marked = self
                        .slots
                        .lock()
                        .get(uid.as_str())
                        .is_some_and(|s| s.relist.is_some());
                    if is_marked {
                        marked.push((uid, Stored::new(&crate::k8s::objects::to_value(obj))));
                    }
                }
                for (uid, body) in marked {
                    loop {
                        self.room(cancel).await;
                        if cancel.is_cancelled() {
                            return Ok(queued);
                        }
                        match self.push_listed(&uid, &body, pass, started) {
                            Listed::Queued => queued += 1,
                            Listed::Skipped => {}
                            Listed::NoRoom => continue,
                        }
                        break;
                    }
                }
                match next {
                    Some(token) => params.continue_token = Some(token),
                    None => break,
                }
            }
        }
        Ok(queued)
    }

    /// Waits until the queue has room for another waiting body and dispatch is not paused
    /// (paused cycles keep their bodies; resuming re-processes the marked objects), or
    /// `cancel`.
    async fn room(&self, cancel: &CancellationToken) {
        loop {
            let room = self.ready.room.notified();
            if !self.unpaused(cancel).await || self.has_room(Priority::Confirmation) {
                return;
            }
            tokio::select! {
                () = cancel.cancelled() => return,
                () = room => {}
            }
        }
    }

    /// Waits until at most half the waiting bound is used; returns false if `cancel` came
    /// first.
    async fn low_water(&self, cancel: &CancellationToken) -> bool {
        let half = self.ctx.relisting.waiting_bodies / 2;
        loop {
            let room = self.ready.room.notified();
            if self.ready.waiting.load(std::sync::atomic::Ordering::Relaxed) <= half {
                return true;
            }
            tokio::select! {
                () = cancel.cancelled() => return false,
                () = room => {}
            }
        }
    }

    /// Waits while dispatch is paused; returns false if `cancel` came first.
    async fn unpaused(&self, cancel: &CancellationToken) -> bool {
        let mut paused = self.ctx.paused.clone();
        let unpaused = tokio::select! {
            () = cancel.cancelled() => return false,
            unpaused = paused.wait_for(|p| !p) => unpaused.is_ok(),
        };
        if !unpaused {
            // The pause can no longer change: nothing is dispatched any more.
            cancel.cancelled().await;
        }
        !cancel.is_cancelled()
    }

    /// Queues a body listed by pass `pass` (started at `started`) for a marked known object:
    /// unless a cycle started since, work waits, or it is gone (skipped); or the pass started
    /// before the event that marked it, or before the answer of a write whose echo it awaits
    /// (skipped, kept marked for a later pass); or the queue has no room (checked under the
    /// slots lock, with the marks).
    fn push_listed(&self, uid: &str, body: &Stored, pass: u64, started: tokio::time::Instant) -> Listed {
        let mut slots = self.slots.lock();
        let Some(slot) = slots.get_mut(uid) else {
            return Listed::Skipped;
        };
        let Some(event_type) = slot.relist.filter(|_| !slot.gone && slot.pending.is_none()) else {
            debug!(%uid, "listed object had a cycle since, or has newer work; skipped");
            return Listed::Skipped;
        };
        if slot.relist_from.is_some_and(|from| pass < from.get()) {
            debug!(%uid, "the pass started before the event that marked the object; listed again later");
            self.relisting.marked();
            return Listed::Skipped;
        }
        // A body listed for an event's mark stands in for that event: a change; one listed
        // for a resync or a listing's stale mark confirms the state.
        let news = slot.relist_from.is_some();
        let priority = if news && event_type != EventType::Listing {
            Priority::Change
        } else {
            Priority::Confirmation
        };
        if !self.has_room(priority) {
            return Listed::NoRoom;
        }
        if slot.judge(body.version(), Some(started)) == Judged::Stale {
            debug!(%uid, "the pass started before the answer of our own write; listed again later");
            self.relisting.marked();
            return Listed::Skipped;
        }
        slot.unmark();
        let queued = self.set_pending(slot, event_type, body.clone(), true, news, priority);
        drop(slots);
        self.place(uid.to_owned(), queued);
        Listed::Queued
    }
}
