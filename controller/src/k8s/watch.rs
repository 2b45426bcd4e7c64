//! Watching one resource (in one namespace or cluster-wide): list, and watch with bookmarks
//! from the listing's first page on while the other pages are read (see [`catching_up`]),
//! relist on `410 Gone`, and restart any watch that fails or goes silent.
//!
//! kopf's most reported failure is a watch that silently hangs or dies and is never restarted.
//! Here a watch that delivers nothing at all (not even a bookmark) for the inactivity timeout
//! is restarted, any failure is retried with backoff, and the watch's state is exposed to the
//! health probes while it is down. Lists are paginated to keep the peak memory of a large
//! initial list small; objects vanished during a relist are reported as deleted.
//!
//! # Health
//!
//! [`Status`] tells liveness from readiness: a watch that is down because the API server does
//! not answer (connection refused or reset, no answer in time, `429`, `5xx`) is an *outage*
//! — readiness, recorded in the process-wide [`Reachability`] as well — while a watch the API
//! server refuses with another status, a watch that cannot be started while the server
//! answers other requests, or a watch loop that made no progress for twice the inactivity
//! timeout (plus a minute), is a *problem* — liveness, because restarting the process is what
//! helps then.
//!
//! # Recovery
//!
//! Retries wait for kube-runtime's [`DefaultBackoff`] (client-go's parameters: exponential from
//! 0.8 s to 30 s, each delay stretched by a random factor in `[1, 2)`), so that after an API
//! server restart the watches of many controllers do not reconnect in step; a `429` waits at
//! least the `Retry-After` the server asked for (`details.retryAfterSeconds`). The backoff
//! starts over once a watch is established.
//!
//! # Objects that do not parse
//!
//! LIST pages and watch events are split before their objects are parsed, each alone
//! (`watch::lines`, [`super::listing`]): an object that does not parse is quarantined (see
//! [`super::quarantine`]) and the watch goes on past it, instead of failing on it for ever.
//! A deletion of such an object is still reported, with what its text tells of it.
//!
//! Why not kube-runtime's `watcher()` itself: it keeps bookmarks, reconnects and its own idle
//! timeout inside the stream and shows none of them to its consumer, so neither a silent
//! watch nor one that keeps failing to reconnect could be reported to the health probes, and
//! the inactivity restart would have to relist everything instead of resuming from the last
//! resourceVersion. The field-selector fallback and the synthetic deletes after a relist are
//! Capstan's own either way; so this module keeps its list-then-watch loop and borrows the
//! backoff.

use std::{collections::HashMap, sync::Arc, time::Duration};

use futures::StreamExt;
use kube::{
    Api,
    api::{DynamicObject, WatchParams},
    runtime::{utils::Backoff as _, watcher::DefaultBackoff},
};
use parking_lot::Mutex;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use self::{
    catching_up::Listing,
    lines::{Line, Read},
};
use super::{
    listing::{Page, list_params, with_shard_selector},
    objects::to_body,
    quarantine::{Unparsed, quarantine},
    reachability::{self, Reachability},
};
use crate::model::EventType;

mod catching_up;
mod lines;

/// Tunables of a watch.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Restart a watch that delivers nothing for this long. Default 5 min.
    pub inactivity_timeout: Duration,
    /// Objects per list page. Default 500.
    pub page_size: u32,
    /// Server-side timeout of each watch request. Default 290 s.
    pub server_timeout: u32,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            inactivity_timeout: Duration::from_secs(300),
            page_size: 500,
            server_timeout: 290,
        }
    }
}

/// One event for the engine.
#[derive(Clone, Debug)]
pub struct Event {
    /// What happened; `Listing` for objects seen in a (re)list.
    pub event_type: EventType,
    /// The object; with its managed fields only where the watch keeps them for event
    /// handlers ([`Watch::with_event_handlers`]).
    pub body: Value,
    /// For an object of a listing: when that listing started (it reflects every write
    /// answered before).
    pub listed: Option<tokio::time::Instant>,
    /// A watch event that is the first sight of an object of the listing under way, which
    /// its page has not brought yet (see [`catching_up`]): it stands in for the listed
    /// body, so the object counts as found by the listing (resumed, and awaited by indexes).
    pub in_listing: bool,
}

/// The health of one watch, shared with the health endpoint (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct Status {
    inner: Arc<Mutex<StatusInner>>,
}

#[derive(Debug, Default)]
struct StatusInner {
    up: bool,
    synced: bool,
    problem: Option<String>,
    /// Why the API server refuses the listing, while it does (see [`Status::listing_refused`]).
    listing_refused: Option<String>,
    outage: Option<String>,
    /// When the watch loop last moved (an event, a bookmark, a retry).
    progress: Option<tokio::time::Instant>,
    /// No progress for this long means the loop is wedged.
    stuck_after: Option<Duration>,
}

impl Status {
    /// Whether the watch is established (or being re-established after a normal end).
    pub fn is_up(&self) -> bool {
        self.inner.lock().up
    }

    /// Whether the initial listing completed at least once.
    pub fn is_synced(&self) -> bool {
        self.inner.lock().synced
    }

    /// Why this watch is not alive, if it is not (liveness): the API server refuses it, or
    /// the watch loop stopped moving. An unreachable API server is no problem of the watch
    /// ([`Status::outage`]).
    pub fn problem(&self) -> Option<String> {
        let s = self.inner.lock();
        if let (Some(at), Some(limit)) = (s.progress, s.stuck_after)
            && at.elapsed() > limit
        {
            return Some(format!("the watch made no progress for {:?}", at.elapsed()));
        }
        s.problem.clone()
    }

    /// Why the watch is down while the API server does not answer (readiness).
    pub fn outage(&self) -> Option<String> {
        self.inner.lock().outage.clone()
    }

    /// Why the API server refuses to list the resource, while the initial listing has not
    /// completed: a problem of the listing itself (the watch runs during the listing, and a
    /// watch refused while the list is allowed still completes the listing).
    pub fn listing_refused(&self) -> Option<String> {
        let s = self.inner.lock();
        if s.synced { None } else { s.listing_refused.clone() }
    }

    /// The listing completed; the watch's own state is left as it is.
    fn set_synced(&self) {
        let mut s = self.inner.lock();
        s.synced = true;
        s.listing_refused = None;
        s.progress = Some(tokio::time::Instant::now());
    }

    fn moved(&self) {
        self.inner.lock().progress = Some(tokio::time::Instant::now());
    }

    fn set_up(&self, synced: bool) {
        let mut s = self.inner.lock();
        s.up = true;
        s.synced |= synced;
        if synced {
            s.listing_refused = None;
        }
        s.problem = None;
        s.outage = None;
        s.progress = Some(tokio::time::Instant::now());
    }

    /// The watch is down: an outage when the server did not answer, a problem otherwise.
    fn set_down(&self, why: String, unanswered: bool) {
        let mut s = self.inner.lock();
        s.up = false;
        s.progress = Some(tokio::time::Instant::now());
        if unanswered {
            s.outage = Some(why);
            s.problem = None;
        } else {
            s.problem = Some(why);
            s.outage = None;
        }
    }
}

/// A watch on one resource and scope.
pub struct Watch {
    api: Api<DynamicObject>,
    label_selector: Option<String>,
    field_selector: Option<String>,
    settings: Settings,
    status: Status,
    reachability: Reachability,
    backoff: DefaultBackoff,
    /// Known objects by uid, for reporting objects that vanished between a watch's end and
    /// the relist (one entry per watched object, so kept small: see [`Known`]).
    known: HashMap<Box<str>, Known>,
    /// The resource's plural, for the metrics of quarantined objects.
    plural: String,
    /// The resource's handlers, when event handlers may be among them: their events keep
    /// `managedFields` then (kopf passes them in raw events), dropped by the queue after.
    handlers: Option<tokio::sync::watch::Receiver<Arc<Vec<crate::model::Registration>>>>,
    /// With sharding: the ranges to ask the server for (KEP-5866's `shardSelector`).
    shard_selector: Option<Arc<str>>,
    /// With sharding: whether an object (by uid) is this member's; the others are dropped as
    /// they arrive, before anything is kept for them.
    holds: Option<Holds>,
    /// Whether the server was seen applying the shard selector (or refusing it); said once.
    shard_judged: bool,
}

/// Whether an object, by uid, is this member's (see [`Watch::with_shard`]).
pub type Holds = Arc<dyn Fn(&str) -> bool + Send + Sync>;

enum Restart {
    Relist,
    Rewatch,
}

impl Watch {
    /// A watch on `api`.
    pub fn new(
        api: Api<DynamicObject>,
        label_selector: Option<String>,
        field_selector: Option<String>,
        settings: Settings,
        status: Status,
    ) -> Self {
        status.inner.lock().stuck_after = Some(
            settings
                .inactivity_timeout
                .saturating_mul(2)
                .saturating_add(Duration::from_secs(60)),
        );
        Self {
            label_selector,
            field_selector,
            settings,
            status,
            reachability: Reachability::global(),
            backoff: DefaultBackoff::default(),
            known: HashMap::new(),
            handlers: None,
            shard_selector: None,
            holds: None,
            shard_judged: false,
            plural: api
                .resource_url()
                .rsplit('/')
                .next()
                .unwrap_or_default()
                .to_owned(),
            api,
        }
    }

    /// With sharding: asks the server for the objects of the held ranges only (KEP-5866's
    /// `shardSelector`, when there is one) and drops, as they arrive, the objects `holds` says
    /// are not this member's — all of them where the server does not filter by shard.
    #[must_use]
    pub fn with_shard(mut self, selector: Option<String>, holds: Holds) -> Self {
        self.shard_selector = selector.map(Into::into);
        self.holds = Some(holds);
        self
    }

    /// Whether the object with `uid` is to be reported (always, without sharding).
    fn ours(&self, uid: &str) -> bool {
        self.holds.as_ref().is_none_or(|holds| holds(uid))
    }

    /// Keeps `managedFields` in the events while `handlers` include event handlers.
    #[must_use]
    pub fn with_event_handlers(
        mut self,
        handlers: tokio::sync::watch::Receiver<Arc<Vec<crate::model::Registration>>>,
    ) -> Self {
        self.handlers = Some(handlers);
        self
    }

    /// Whether events keep their `managedFields` now.
    fn keeps_managed_fields(&self) -> bool {
        self.handlers.as_ref().is_some_and(|h| {
            h.borrow()
                .iter()
                .any(|r| r.kind == crate::model::HandlerKind::Event)
        })
    }

    /// Marks the watch down because its listing failed with `e` (see
    /// [`Status::listing_refused`]); returns how long to wait before the next try.
    fn listing_failed(&mut self, e: &kube::Error) -> Duration {
        if !reachability::is_unanswered(e) {
            self.status.inner.lock().listing_refused = Some(format!("listing failed: {e}"));
        }
        self.failed("listing failed", e)
    }

    /// Marks the watch down for `e` and returns how long to wait before the next try.
    fn failed(&mut self, what: &str, e: &kube::Error) -> Duration {
        let unanswered = reachability::is_unanswered(e);
        if unanswered {
            self.reachability.failed(e.to_string());
        }
        self.status.set_down(format!("{what}: {e}"), unanswered);
        retry_delay(&mut self.backoff, e)
    }

    /// Marks the watch down because its request, sent at `sent`, got no answer in time: an
    /// outage, unless the server answered other requests meanwhile — then this watch hangs
    /// while the server answers, which liveness reports.
    fn hung(&mut self, what: &str, sent: tokio::time::Instant) -> Duration {
        let why = format!("{what} (no answer within {:?})", self.settings.inactivity_timeout);
        if self.reachability.answered_since(sent) {
            self.status.set_down(
                format!("{why} while the API server answers other requests"),
                false,
            );
        } else {
            self.reachability.failed(why.clone());
            self.status.set_down(why, true);
        }
        self.backoff.next().unwrap_or(MAX_DELAY)
    }

    fn established(&mut self, synced: bool) {
        self.status.set_up(synced);
        self.backoff.reset();
    }

    /// Runs until `cancel` fires or the receiver goes away.
    pub async fn run(mut self, tx: mpsc::Sender<Event>, cancel: CancellationToken) {
        'relist: loop {
            let mut listing = Listing::new(
                self.api.clone(),
                list_params(
                    self.settings.page_size,
                    self.label_selector.as_deref(),
                    self.field_selector.as_deref(),
                ),
                self.shard_selector.clone(),
                self.settings.inactivity_timeout,
            );
            let first = tokio::select! {
                () = cancel.cancelled() => return,
                page = listing.next_page() => page,
            };
            let page = match first {
                Ok(Some(page)) => page,
                Err(e) if self.shard_selector.is_some() && refuses_shard_selector(&e) => {
                    warn!(
                        error = %e,
                        "the API server refuses the shard selector; listing every object and filtering on arrival (the alpha shard filter goes first, before a field selector)"
                    );
                    self.shard_selector = None;
                    self.shard_judged = true;
                    continue 'relist;
                }
                Err(e) if is_bad_request(&e) && self.field_selector.is_some() => {
                    // Custom resources accept field selectors only on metadata.name,
                    // metadata.namespace and the CRD's selectableFields; the handlers'
                    // selectors are checked in the controller as well, so nothing is lost.
                    warn!(
                        field_selector = self.field_selector.as_deref().unwrap_or_default(),
                        error = %e,
                        "the API server refuses this field selector for the resource (declare the field in \
                         the CRD's selectableFields to filter on the server); filtering in the controller"
                    );
                    self.field_selector = None;
                    continue 'relist;
                }
                // (`Ok(None)`, no page at all, cannot come first.)
                failed => {
                    let e = failed
                        .err()
                        .unwrap_or_else(|| internal("the listing brought no page"));
                    let delay = self.listing_failed(&e);
                    warn!(error = %e, retry_in = ?delay, "listing failed");
                    if sleep_or_cancel(delay, &cancel).await {
                        return;
                    }
                    continue 'relist;
                }
            };
            self.status.moved();
            if self.shard_selector.is_some() && !self.shard_judged {
                self.shard_judged = true;
                if page.sharded {
                    info!(
                        "the API server filters by shard: only this member's objects are listed and watched"
                    );
                } else {
                    info!(
                        "the API server did not confirm a shard filter (no shardInfo: no ShardedListAndWatch, or a custom resource, whose lists do not echo it): objects outside this member's ranges are dropped on arrival"
                    );
                }
            }
            let reported = tokio::select! {
                () = cancel.cancelled() => return,
                reported = self.report_page(&mut listing, page, &tx) => reported,
            };
            if !reported {
                return;
            }
            // The watch starts from the snapshot's version while the other pages are read
            // (without a version, a watch would bring every object again: then after them).
            let mut rv = listing.version().to_owned();
            let mut listing = Some(listing);
            if rv.is_empty() {
                match self.read_rest(&mut listing, &tx, &cancel).await {
                    Ok(()) => {}
                    Err(None) => return,
                    Err(Some(_)) => {
                        if let Some(unfinished) = listing.take() {
                            unfinished.abandon(&mut self.known);
                        }
                        continue 'relist;
                    }
                }
            }
            if !self.catch_up(&mut listing, &tx, true).await {
                return;
            }
            loop {
                match self.watch(&tx, &mut rv, &cancel, &mut listing).await {
                    None => return,
                    Some(Restart::Relist) => {
                        if let Some(unfinished) = listing.take() {
                            unfinished.abandon(&mut self.known);
                        }
                        continue 'relist;
                    }
                    Some(Restart::Rewatch) => {}
                }
            }
        }
    }

    /// Reports a page's objects (see [`catching_up`]); false when the receiver is gone.
    async fn report_page(&mut self, listing: &mut Listing, page: Page, tx: &mpsc::Sender<Event>) -> bool {
        let metrics = crate::observability::metrics::global();
        for obj in page.objects() {
            metrics.watch_event(&self.plural);
            let obj = match obj {
                Ok(obj) if !self.ours(obj.metadata.uid.as_deref().unwrap_or_default()) => continue,
                Ok(obj) => obj,
                Err(unparsed) if !unparsed.identity.uid.is_empty() && !self.ours(&unparsed.identity.uid) => {
                    continue;
                }
                Err(unparsed) => {
                    quarantine(&self.plural, &unparsed);
                    // Still there: not reported as vanished.
                    let id = &unparsed.identity;
                    if !id.uid.is_empty() {
                        listing.listed(&id.uid, Known::new(&id.namespace, &id.name));
                    }
                    continue;
                }
            };
            if let Some(uid) = obj.metadata.uid.as_deref()
                && !listing.listed(uid, Known::of(&obj))
            {
                debug!(%uid, "a listed body older than the watch's event skipped");
                continue;
            }
            let managed = self.keeps_managed_fields();
            if tx
                .send(Event {
                    event_type: EventType::Listing,
                    body: to_body(obj, managed),
                    listed: Some(listing.started()),
                    in_listing: false,
                })
                .await
                .is_err()
            {
                return false;
            }
        }
        true
    }

    /// Ends `listing` if its last page came: reports the objects that vanished while the
    /// watch was down, and marks the watch synced (and up, when `watching`: the watch is
    /// established or about to start, not waiting out a failure). False when the receiver is
    /// gone.
    async fn catch_up(
        &mut self,
        listing: &mut Option<Listing>,
        tx: &mpsc::Sender<Event>,
        watching: bool,
    ) -> bool {
        let Some(done) = listing.take_if(|l| l.is_done()) else {
            return true;
        };
        for (uid, known) in done.finish(&mut self.known) {
            let (namespace, name) = known.split();
            debug!(%uid, %name, "object vanished while the watch was down");
            let body = json!({"metadata": {"uid": uid, "name": name, "namespace": namespace}});
            if tx
                .send(Event {
                    event_type: EventType::Deleted,
                    body,
                    listed: None,
                    in_listing: false,
                })
                .await
                .is_err()
            {
                return false;
            }
        }
        if watching {
            self.established(true);
        } else {
            self.status.set_synced();
        }
        info!(objects = self.known.len(), "listed");
        true
    }

    /// Takes a page read while the watch runs: reports its objects, and ends the listing
    /// after its last page. An error is how the watch ends: `None` when the receiver is gone
    /// or the watch cancelled; a page that failed starts everything again with a new listing,
    /// after the backoff.
    async fn listed_page(
        &mut self,
        page: Result<Option<Page>, kube::Error>,
        listing: &mut Option<Listing>,
        tx: &mpsc::Sender<Event>,
        cancel: &CancellationToken,
        watching: bool,
    ) -> Result<(), Option<Restart>> {
        match page {
            Ok(Some(page)) => {
                self.status.moved();
                let Some(l) = listing.as_mut() else {
                    return Ok(());
                };
                if !self.report_page(l, page, tx).await || !self.catch_up(listing, tx, watching).await {
                    return Err(None);
                }
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(e) if is_gone(&e) => {
                debug!("the listing's continue token expired (410 Gone); listing again");
                Err(Some(Restart::Relist))
            }
            Err(e) => {
                let delay = self.listing_failed(&e);
                warn!(error = %e, retry_in = ?delay, "listing failed");
                if sleep_or_cancel(delay, cancel).await {
                    return Err(None);
                }
                Err(Some(Restart::Relist))
            }
        }
    }

    async fn watch(
        &mut self,
        tx: &mpsc::Sender<Event>,
        rv: &mut String,
        cancel: &CancellationToken,
        listing: &mut Option<Listing>,
    ) -> Option<Restart> {
        let mut params = WatchParams::default().timeout(self.settings.server_timeout);
        if let Some(l) = &self.label_selector {
            params = params.labels(l);
        }
        if let Some(f) = &self.field_selector {
            params = params.fields(f);
        }
        let sent = tokio::time::Instant::now();
        let stream = tokio::select! {
            () = cancel.cancelled() => return None,
            s = tokio::time::timeout(self.settings.inactivity_timeout, self.start(&params, rv)) => s,
        };
        let Ok(stream) = stream else {
            let delay = self.hung("starting the watch hung", sent);
            warn!(timeout = ?self.settings.inactivity_timeout, retry_in = ?delay, "starting the watch hung; retrying");
            return self.wait_out(delay, listing, tx, cancel).await;
        };
        let mut stream = match stream {
            Ok(s) => s.boxed(),
            Err(e) if is_gone(&e) => {
                debug!("the watch's resourceVersion expired (410 Gone); relisting");
                return Some(Restart::Relist);
            }
            Err(e) => {
                let delay = self.failed("watch failed to start", &e);
                warn!(error = %e, retry_in = ?delay, "starting the watch failed");
                return self.wait_out(delay, listing, tx, cancel).await;
            }
        };
        self.status.set_up(false);
        let silence = tokio::time::sleep(self.settings.inactivity_timeout);
        tokio::pin!(silence);
        loop {
            let reading = listing.as_ref().is_some_and(|l| !l.is_done());
            // Pages first: they come no faster than the reader fetches them, so they cannot
            // starve the watch, while a watch whose events are always ready (its consumer
            // slower than the events come) would starve the listing.
            let next = tokio::select! {
                biased;
                () = cancel.cancelled() => return None,
                page = next_page(listing), if reading => {
                    if let Err(end) = self.listed_page(page, listing, tx, cancel, true).await {
                        return end;
                    }
                    continue;
                }
                n = stream.next() => Ok(n),
                () = &mut silence => Err(()),
            };
            // Silence is counted from the last event handled: not the time spent handing events over.
            silence
                .as_mut()
                .reset(tokio::time::Instant::now() + self.settings.inactivity_timeout);
            let event = match next {
                Err(_) => {
                    // Whether the server answers decides the restart: a new watch that starts
                    // is up again, one that cannot start is an outage or a problem.
                    warn!(silent_for = ?self.settings.inactivity_timeout, "watch went silent; restarting it");
                    self.status.moved();
                    return Some(Restart::Rewatch);
                }
                Ok(Some(Read::Line(line))) => line,
                Ok(None) => return Some(Restart::Rewatch),
                Ok(Some(Read::Bad(e))) => {
                    // A line that is no event at all (not an object that does not parse).
                    let e = kube::Error::Service(Box::new(e));
                    let delay = self.failed("watch stream failed", &e);
                    warn!(error = %e, retry_in = ?delay, "watch stream failed; restarting it");
                    return self.wait_out(delay, listing, tx, cancel).await;
                }
                Ok(Some(Read::Failed(e))) => {
                    // The connection broke mid-answer: the server or the way to it.
                    let e = kube::Error::Service(Box::new(e));
                    let delay = self.failed("watch stream failed", &e);
                    warn!(error = %e, retry_in = ?delay, "watch stream failed; restarting it");
                    return self.wait_out(delay, listing, tx, cancel).await;
                }
            };
            if matches!(event, Line::Event(..) | Line::Unparsable(..)) {
                crate::observability::metrics::global().watch_event(&self.plural);
            }
            let (event_type, obj) = match event {
                Line::Event(_, o) if !self.ours(o.metadata.uid.as_deref().unwrap_or_default()) => {
                    // Another member's object: only the watch's place moves.
                    self.established(false);
                    if let Some(v) = &o.metadata.resource_version {
                        rv.clone_from(v);
                    }
                    silence
                        .as_mut()
                        .reset(tokio::time::Instant::now() + self.settings.inactivity_timeout);
                    continue;
                }
                Line::Event(event_type, o) => (event_type, *o),
                Line::Unparsable(_, unparsed)
                    if !unparsed.identity.uid.is_empty() && !self.ours(&unparsed.identity.uid) =>
                {
                    self.established(false);
                    if let Some(v) = &unparsed.identity.resource_version {
                        rv.clone_from(v);
                    }
                    silence
                        .as_mut()
                        .reset(tokio::time::Instant::now() + self.settings.inactivity_timeout);
                    continue;
                }
                Line::Unparsable(event_type, unparsed) => {
                    self.established(false);
                    let in_listing = match listing.as_mut() {
                        Some(l) if !unparsed.identity.uid.is_empty() => {
                            l.touch(&unparsed.identity.uid, event_type)
                        }
                        _ => false,
                    };
                    if let Some(body) = self.skip(event_type, &unparsed, rv)
                        && tx
                            .send(Event {
                                event_type,
                                body,
                                listed: None,
                                in_listing,
                            })
                            .await
                            .is_err()
                    {
                        return None;
                    }
                    silence
                        .as_mut()
                        .reset(tokio::time::Instant::now() + self.settings.inactivity_timeout);
                    continue;
                }
                Line::Bookmark(version) => {
                    *rv = version;
                    self.established(false);
                    continue;
                }
                Line::Error(e) if e.code == 410 => {
                    debug!("watch expired (410 Gone); relisting");
                    return Some(Restart::Relist);
                }
                Line::Error(e) => {
                    let e = kube::Error::Api(e);
                    let delay = self.failed("watch error", &e);
                    warn!(error = %e, retry_in = ?delay, "watch error; restarting it");
                    return self.wait_out(delay, listing, tx, cancel).await;
                }
            };
            self.established(false);
            if let Some(v) = &obj.metadata.resource_version {
                rv.clone_from(v);
            }
            let mut in_listing = false;
            if let Some(uid) = obj.metadata.uid.as_deref() {
                if let Some(l) = listing.as_mut() {
                    in_listing = l.touch(uid, event_type);
                }
                if event_type == EventType::Deleted {
                    self.known.remove(uid);
                } else if self.known.get(uid).is_none_or(|k| !k.is(&obj)) {
                    self.known.insert(uid.into(), Known::of(&obj));
                }
            }
            let managed = self.keeps_managed_fields();
            if tx
                .send(Event {
                    event_type,
                    body: to_body(obj, managed),
                    listed: None,
                    in_listing,
                })
                .await
                .is_err()
            {
                return None;
            }
            silence
                .as_mut()
                .reset(tokio::time::Instant::now() + self.settings.inactivity_timeout);
        }
    }

    /// Waits `delay` before the watch is tried again. A listing under way is read to its end
    /// meanwhile, as a list-then-watch would: a watch that cannot start does not hold it up.
    /// What the caller returns: `None` to stop, the restart otherwise.
    async fn wait_out(
        &mut self,
        delay: Duration,
        listing: &mut Option<Listing>,
        tx: &mpsc::Sender<Event>,
        cancel: &CancellationToken,
    ) -> Option<Restart> {
        let until = tokio::time::Instant::now() + delay;
        let restart = loop {
            if listing.as_ref().is_none_or(|l| l.is_done()) {
                break Restart::Rewatch;
            }
            let page = tokio::select! {
                () = cancel.cancelled() => return None,
                page = next_page(listing) => page,
            };
            match page {
                // Listed again after the watch's own wait (the watch's failure is what the
                // status tells, and its backoff what is waited).
                Err(e) => {
                    warn!(error = %e, "listing failed while the watch waits to start again; listing again after");
                    break Restart::Relist;
                }
                page => {
                    if let Err(end) = self.listed_page(page, listing, tx, cancel, false).await {
                        return end;
                    }
                }
            }
        };
        tokio::select! {
            () = cancel.cancelled() => None,
            () = tokio::time::sleep_until(until) => Some(restart),
        }
    }

    /// Reads the listing to its end before any watch starts (a first page without a
    /// resourceVersion). An error is how it ends: `None` to stop, a restart otherwise.
    async fn read_rest(
        &mut self,
        listing: &mut Option<Listing>,
        tx: &mpsc::Sender<Event>,
        cancel: &CancellationToken,
    ) -> Result<(), Option<Restart>> {
        while listing.as_ref().is_some_and(|l| !l.is_done()) {
            let page = tokio::select! {
                () = cancel.cancelled() => return Err(None),
                page = next_page(listing) => page,
            };
            self.listed_page(page, listing, tx, cancel, false).await?;
        }
        Ok(())
    }
}

impl Watch {
    /// Starts a watch from `rv`: its answer's lines, each parsed when it comes.
    async fn start(
        &self,
        params: &WatchParams,
        rv: &str,
    ) -> Result<impl futures::Stream<Item = Read> + use<>, kube::Error> {
        let mut request = kube::core::Request::new(self.api.resource_url())
            .watch(params, rv)
            .map_err(kube::Error::BuildRequest)?;
        with_shard_selector(&mut request, self.shard_selector.as_deref());
        request.extensions_mut().insert("watch");
        // One gzip member per event would be decoded only up to the first (as kube's own watch).
        request.headers_mut().insert(
            http::header::ACCEPT_ENCODING,
            http::HeaderValue::from_static("identity"),
        );
        let body = self.api.clone().into_client().request_stream(request).await?;
        Ok(lines::lines(body).boxed())
    }

    /// Skips an event of an object that does not parse: quarantined, with the watch's version
    /// moved past it; a deletion is still reported, with the object's identity. Returns the
    /// body to report.
    fn skip(&mut self, event_type: EventType, unparsed: &Unparsed, rv: &mut String) -> Option<Value> {
        let id = &unparsed.identity;
        if let Some(version) = &id.resource_version {
            rv.clone_from(version);
        }
        if event_type == EventType::Deleted {
            self.known.remove(id.uid.as_str());
            debug!(uid = %id.uid, name = %id.name, "an object that cannot be parsed was deleted");
            return Some(id.body());
        }
        quarantine(&self.plural, unparsed);
        if !id.uid.is_empty() {
            self.known
                .insert(id.uid.as_str().into(), Known::new(&id.namespace, &id.name));
        }
        None
    }
}

/// A known object's namespace and name in one allocation: `<namespace>/<name>` (neither may
/// contain a slash).
#[derive(Debug)]
struct Known(Box<str>);

impl Known {
    fn of(obj: &DynamicObject) -> Self {
        let namespace = obj.metadata.namespace.as_deref().unwrap_or_default();
        let name = obj.metadata.name.as_deref().unwrap_or_default();
        Self::new(namespace, name)
    }

    fn new(namespace: &str, name: &str) -> Self {
        Self(format!("{namespace}/{name}").into_boxed_str())
    }

    /// Whether `obj` has this namespace and name.
    fn is(&self, obj: &DynamicObject) -> bool {
        let (namespace, name) = self.split();
        obj.metadata.namespace.as_deref().unwrap_or_default() == namespace
            && obj.metadata.name.as_deref().unwrap_or_default() == name
    }

    /// The namespace and the name.
    fn split(&self) -> (&str, &str) {
        self.0.split_once('/').unwrap_or(("", &self.0))
    }
}

/// An error of the controller's own making (not the API server's, nor its unreachability).
fn internal(why: &str) -> kube::Error {
    kube::Error::SerdeError(<serde_json::Error as serde::de::Error>::custom(why))
}

/// The next page of `listing`, if one is under way.
async fn next_page(listing: &mut Option<Listing>) -> Result<Option<Page>, kube::Error> {
    match listing {
        Some(l) => l.next_page().await,
        None => Ok(None),
    }
}

/// Whether the API server answered 410 Gone (a watch or a continue token too old).
pub fn is_gone(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 410)
}

fn is_bad_request(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 400)
}

/// Whether the server refused a request for its shard selector: a 400, or the 500 that
/// Kubernetes 1.36 answers for a selector it cannot parse (`invalid shard selector: …`).
fn refuses_shard_selector(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(s) => s.code == 400 || (s.code == 500 && s.message.contains("shard selector")),
        _ => false,
    }
}

/// The longest a retry waits for the backoff (kube-runtime's `DefaultBackoff` cap, before
/// jitter); also the fallback should the backoff ever end.
const MAX_DELAY: Duration = Duration::from_secs(30);

/// The longest `Retry-After` honoured, so that a bad value cannot park a watch for long.
const MAX_RETRY_AFTER: Duration = Duration::from_secs(300);

/// The next delay: the jittered backoff, but at least what a `429` asked for.
fn retry_delay(backoff: &mut impl Iterator<Item = Duration>, e: &kube::Error) -> Duration {
    let delay = backoff.next().unwrap_or(MAX_DELAY);
    retry_after(e).map_or(delay, |asked| delay.max(asked))
}

/// The `Retry-After` of a `429 Too Many Requests` answer (`details.retryAfterSeconds`).
fn retry_after(e: &kube::Error) -> Option<Duration> {
    match e {
        kube::Error::Api(s) if s.code == 429 => s
            .details
            .as_ref()
            .map(|d| d.retry_after_seconds)
            .filter(|s| *s > 0)
            .map(|s| Duration::from_secs(u64::from(s)).min(MAX_RETRY_AFTER)),
        _ => None,
    }
}

/// Sleeps; returns true when cancelled first.
async fn sleep_or_cancel(d: Duration, cancel: &CancellationToken) -> bool {
    tokio::select! {
        () = cancel.cancelled() => true,
        () = tokio::time::sleep(d) => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_objects_keep_their_namespace_and_name() {
        let obj = |namespace: Option<&str>, name: &str| {
            let mut obj = DynamicObject::new(
                name,
                &kube::api::ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&()),
            );
            obj.metadata.namespace = namespace.map(str::to_owned);
            obj
        };
        let namespaced = Known::of(&obj(Some("team-a"), "web:1"));
        assert_eq!(namespaced.split(), ("team-a", "web:1"));
        assert!(namespaced.is(&obj(Some("team-a"), "web:1")));
        assert!(!namespaced.is(&obj(Some("team-b"), "web:1")));
        let cluster = Known::of(&obj(None, "node-1"));
        assert_eq!(cluster.split(), ("", "node-1"));
        assert!(cluster.is(&obj(None, "node-1")));
    }

    #[test]
    fn backoff_is_jittered_within_bounds_and_grows_to_its_cap() {
        // kube-runtime's DefaultBackoff: base 0.8 s doubling to 30 s, each delay in [base, 2 base).
        let mut runs: Vec<Vec<Duration>> = Vec::new();
        for _ in 0..20 {
            let mut backoff = DefaultBackoff::default();
            let delays: Vec<Duration> = (0..10).map(|_| backoff.next().unwrap()).collect();
            for (n, d) in delays.iter().enumerate() {
                let base = Duration::from_millis(800).saturating_mul(1 << n).min(MAX_DELAY);
                assert!(
                    *d >= base && *d < base * 2,
                    "delay {n}: {d:?} outside [{base:?}, {:?})",
                    base * 2
                );
            }
            runs.push(delays);
        }
        let firsts: std::collections::HashSet<Duration> = runs.iter().map(|r| r[0]).collect();
        assert!(firsts.len() > 1, "twenty watches would retry in step: {firsts:?}");
    }

    #[test]
    fn too_many_requests_waits_at_least_the_retry_after() {
        let status = |code: u16, retry: u32| {
            let status: kube::core::Status = serde_json::from_value(json!({
                "code": code, "details": {"retryAfterSeconds": retry}
            }))
            .unwrap();
            kube::Error::Api(Box::new(status))
        };
        let mut backoff = DefaultBackoff::default();
        assert_eq!(
            retry_delay(&mut backoff, &status(429, 45)),
            Duration::from_secs(45)
        );
        assert!(retry_delay(&mut backoff, &status(429, 0)) < Duration::from_secs(10));
        assert_eq!(retry_delay(&mut backoff, &status(429, 100_000)), MAX_RETRY_AFTER);
        assert!(retry_delay(&mut backoff, &status(500, 45)) < Duration::from_secs(45));
    }

    #[test]
    fn a_shard_selector_is_refused_by_a_400_or_by_1_36s_500() {
        let status = |code: u16, message: &str| {
            let status: kube::core::Status =
                serde_json::from_value(json!({"code": code, "message": message})).unwrap();
            kube::Error::Api(Box::new(status))
        };
        assert!(refuses_shard_selector(&status(400, "bad")));
        assert!(refuses_shard_selector(&status(
            500,
            "invalid shard selector: CEL parse error: expression code point size exceeds limit"
        )));
        assert!(!refuses_shard_selector(&status(
            500,
            "etcdserver: request timed out"
        )));
        assert!(!refuses_shard_selector(&status(403, "forbidden")));
    }

    #[test]
    fn a_refused_listing_is_told_until_the_listing_completes_whatever_the_watch_does() {
        let status = Status::default();
        status.inner.lock().listing_refused = Some("listing failed: 403".into());
        // The watch runs meanwhile; its state does not clear the listing's.
        status.set_up(false);
        assert_eq!(status.listing_refused().as_deref(), Some("listing failed: 403"));
        status.set_synced();
        assert!(status.is_synced() && status.listing_refused().is_none());
        // Completing the listing while the watch waits out a failure leaves the watch down.
        status.set_down("watch failed to start: 403".into(), false);
        status.set_synced();
        assert!(!status.is_up() && status.problem().is_some());
    }

    #[test]
    fn the_controllers_own_errors_are_no_outage_of_the_api_server() {
        assert!(!reachability::is_unanswered(&internal(
            "the listing's reader stopped"
        )));
    }

    #[tokio::test]
    async fn outages_are_not_problems_and_a_wedged_loop_is() {
        tokio::time::pause();
        let status = Status::default();
        status.inner.lock().stuck_after = Some(Duration::from_secs(60));
        status.set_down("listing failed: connection refused".into(), true);
        assert!(status.problem().is_none());
        assert!(status.outage().is_some());
        status.set_down("listing failed: 403 forbidden".into(), false);
        assert!(status.problem().is_some() && status.outage().is_none());
        status.set_up(true);
        assert!(status.problem().is_none() && status.outage().is_none());
        tokio::time::advance(Duration::from_secs(61)).await;
        assert!(status.problem().unwrap().contains("no progress"));
    }
}
