//! A watch's listing, read while the watch already runs.
//!
//! A restarted controller with 100,000 objects needs half a minute to list them all; a watch
//! started only after the last page would leave a new object waiting that long. So the watch
//! starts from the first page's resourceVersion — the snapshot every page of a paged LIST
//! reflects — as soon as that page came, and the pages after it are read between the watch's
//! events. The new object then comes as a watch event, a change, which the queue takes before
//! the listed objects (see `engine::queue::ready`).
//!
//! Two rules keep the events in the order the API server stored them:
//!
//! - An object the watch reported while the listing goes on has a listed body older than the
//!   event (the snapshot predates everything the watch brings): the listing skips it, so an
//!   older body never follows a newer one, nor resurrects an object the watch saw deleted.
//! - Objects that vanished while the watch was down are found when the listing ends: known
//!   before, neither listed nor reported by the watch meanwhile.
//!
//! The pages are read by a task of their own, one page ahead of the one being reported, so
//! that a page's answer is read as it comes whatever the watch does meanwhile (a page left
//! half-read while events are handled would run into its timeout).

use std::{
    collections::{HashMap, HashSet},
    sync::Arc,
    time::Duration,
};

use kube::{
    Api,
    api::{DynamicObject, ListParams},
};
use tokio::sync::mpsc;
use tokio_util::task::AbortOnDropHandle;
use tracing::Instrument as _;

use super::Known;
use crate::{
    k8s::listing::{Page, list_page},
    model::EventType,
};

/// A listing under way (see the module docs).
pub(super) struct Listing {
    /// The pages, as the reader reads them.
    pages: mpsc::Receiver<Result<Page, kube::Error>>,
    /// The reader: stopped with the listing.
    _reader: AbortOnDropHandle<()>,
    /// When the listing started: its objects reflect every write answered before.
    started: tokio::time::Instant,
    /// The snapshot's resourceVersion, from the first page.
    version: Option<String>,
    /// The objects listed so far.
    seen: HashMap<Box<str>, Known>,
    /// The objects the watch reported since the listing started, before their page came.
    /// (An echo of the controller's own write comes after the page that brought the object:
    /// a start with 100,000 unhandled objects keeps no entry for them here.)
    touched: HashSet<Box<str>>,
    /// Whether the last page came.
    done: bool,
}

impl Listing {
    /// Starts listing `api` with `params` (and `shard`, a shard selector), each page within
    /// `timeout`.
    pub(super) fn new(
        api: Api<DynamicObject>,
        mut params: ListParams,
        shard: Option<Arc<str>>,
        timeout: Duration,
    ) -> Self {
        let (tx, pages) = mpsc::channel(1);
        let reader = async move {
            loop {
                let page = list_page(&api, &params, shard.as_deref(), timeout).await;
                let next = page.as_ref().ok().and_then(|p| p.continue_token.clone());
                if tx.send(page).await.is_err() {
                    return;
                }
                match next {
                    Some(token) => params.continue_token = Some(token),
                    None => return,
                }
            }
        };
        Self {
            pages,
            _reader: AbortOnDropHandle::new(tokio::spawn(reader.in_current_span())),
            started: tokio::time::Instant::now(),
            version: None,
            seen: HashMap::new(),
            touched: HashSet::new(),
            done: false,
        }
    }

    /// When the listing started.
    pub(super) fn started(&self) -> tokio::time::Instant {
        self.started
    }

    /// The snapshot's resourceVersion, once the first page came (empty if the server gave
    /// none).
    pub(super) fn version(&self) -> &str {
        self.version.as_deref().unwrap_or_default()
    }

    /// Whether the last page came.
    pub(super) fn is_done(&self) -> bool {
        self.done
    }

    /// The next page; `None` once the last came. Cancel-safe (the reader keeps reading).
    ///
    /// # Errors
    /// The page's error (after which the listing has ended and fails again when asked).
    pub(super) async fn next_page(&mut self) -> Result<Option<Page>, kube::Error> {
        if self.done {
            return Ok(None);
        }
        let Some(page) = self.pages.recv().await else {
            return Err(super::internal("the listing's reader stopped"));
        };
        let page = page?;
        if self.version.is_none() {
            self.version = Some(page.resource_version.clone().unwrap_or_default());
        }
        self.done = page.continue_token.is_none();
        Ok(Some(page))
    }

    /// An object of a page: remembered as listed. Whether its body is to be reported: not
    /// when the watch reported the object since the listing started (its event is newer).
    pub(super) fn listed(&mut self, uid: &str, known: Known) -> bool {
        self.seen.insert(uid.into(), known);
        !self.touched.contains(uid)
    }

    /// The watch reported an event of `event_type` of the object `uid` while the listing
    /// goes on. Whether this is the first sight of an object of the listing's snapshot that
    /// its page has not brought yet (a modification or deletion of an object the watch had
    /// not reported as added): the event stands in for the listed body, which is skipped.
    pub(super) fn touch(&mut self, uid: &str, event_type: EventType) -> bool {
        if self.seen.contains_key(uid) {
            // Listed already: its events come in order; only a deletion changes what exists.
            if event_type == EventType::Deleted {
                self.seen.remove(uid);
            }
            false
        } else if self.touched.contains(uid) {
            false
        } else {
            self.touched.insert(uid.into());
            event_type != EventType::Added
        }
    }

    /// Gives the listing up before its end (it starts again): what it saw so far is known
    /// (and so reported when a later listing finds it gone), but what the watch saw deleted.
    pub(super) fn abandon(self, known: &mut HashMap<Box<str>, Known>) {
        let Self { seen, touched, .. } = self;
        for (uid, k) in seen {
            if !touched.contains(&uid) && !known.contains_key(&uid) {
                known.insert(uid, k);
            }
        }
    }

    /// Ends the listing: `known` (the objects known before it, as the watch updated them
    /// since) becomes what exists now. Returns the objects that vanished while the watch was
    /// down, to be reported deleted.
    pub(super) fn finish(self, known: &mut HashMap<Box<str>, Known>) -> Vec<(Box<str>, Known)> {
        let Self {
            mut seen, touched, ..
        } = self;
        // Reported by the watch before their page came, and deleted since.
        for uid in &touched {
            if !known.contains_key(uid) {
                seen.remove(uid);
            }
        }
        let mut vanished = Vec::new();
        for (uid, k) in known.drain() {
            if touched.contains(&uid) {
                // As the watch reported it last.
                seen.insert(uid, k);
            } else if !seen.contains_key(&uid) {
                vanished.push((uid, k));
            }
        }
        *known = seen;
        vanished
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listing() -> Listing {
        let client = kube::Client::new(
            tower::service_fn(|_: http::Request<kube::client::Body>| async {
                Err::<http::Response<kube::client::Body>, std::io::Error>(std::io::Error::other("no server"))
            }),
            "default",
        );
        let resource = kube::api::ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&());
        Listing::new(
            Api::all_with(client, &resource),
            ListParams::default(),
            None,
            Duration::from_secs(1),
        )
    }

    fn known(pairs: &[(&str, &str)]) -> HashMap<Box<str>, Known> {
        pairs
            .iter()
            .map(|(uid, name)| ((*uid).into(), Known::new("default", name)))
            .collect()
    }

    fn names(known: &HashMap<Box<str>, Known>) -> Vec<String> {
        let mut names: Vec<String> = known.values().map(|k| k.split().1.to_owned()).collect();
        names.sort();
        names
    }

    #[tokio::test]
    async fn a_listed_body_older_than_a_watch_event_is_not_reported() {
        let mut l = listing();
        assert!(l.listed("u1", Known::new("default", "a")));
        // The watch reported u2 before its page came: the first sight of an object of the
        // snapshot, and its listed body is older.
        assert!(l.touch("u2", EventType::Modified));
        assert!(!l.touch("u2", EventType::Modified));
        assert!(!l.listed("u2", Known::new("default", "b")));
        // An object listed before the watch reported it was reported in order: no entry.
        assert!(!l.touch("u1", EventType::Modified));
        assert_eq!(l.touched.len(), 1);
        // One added after the snapshot is no object of it.
        assert!(!l.touch("u4", EventType::Added));
        assert!(l.listed("u3", Known::new("default", "c")));
    }

    #[tokio::test]
    async fn the_end_of_a_listing_reports_what_vanished_while_the_watch_was_down() {
        let mut l = listing();
        // Known before: a (still there), gone (deleted while the watch was down), b (deleted
        // by the watch during the listing, after its page), c (modified by the watch).
        let mut k = known(&[("ua", "a"), ("ugone", "gone"), ("ub", "b"), ("uc", "c")]);
        assert!(l.listed("ua", Known::new("default", "a")));
        assert!(l.listed("ub", Known::new("default", "b")));
        // The watch: b deleted, c modified before its page came (known as the watch last
        // told), d created after the snapshot, e created and deleted during the listing.
        l.touch("ub", EventType::Deleted);
        k.remove("ub");
        l.touch("uc", EventType::Modified);
        k.insert("uc".into(), Known::new("default", "c2"));
        l.touch("ud", EventType::Added);
        k.insert("ud".into(), Known::new("default", "d"));
        l.touch("ue", EventType::Added);
        l.touch("ue", EventType::Deleted);
        // c's page comes after the watch's event: skipped, but listed.
        assert!(!l.listed("uc", Known::new("default", "c")));
        let vanished = l.finish(&mut k);
        let vanished: Vec<&str> = vanished.iter().map(|(uid, _)| &**uid).collect();
        assert_eq!(vanished, ["ugone"]);
        assert_eq!(names(&k), ["a", "c2", "d"]);
    }

    #[tokio::test]
    async fn a_listing_given_up_keeps_what_it_saw_but_what_the_watch_saw_deleted() {
        let mut l = listing();
        let mut k = known(&[("uold", "old")]);
        assert!(l.listed("ua", Known::new("default", "a")));
        l.touch("ub", EventType::Modified);
        k.remove("ub");
        l.touch("ub", EventType::Deleted);
        assert!(!l.listed("ub", Known::new("default", "b")));
        l.abandon(&mut k);
        assert_eq!(names(&k), ["a", "old"]);
    }

    #[tokio::test]
    async fn a_listing_without_a_server_fails_and_fails_again_when_asked() {
        let mut l = listing();
        assert!(l.next_page().await.is_err());
        assert!(!l.is_done() && l.version().is_empty());
        assert!(l.next_page().await.is_err());
    }
}
