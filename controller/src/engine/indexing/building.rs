//! Whether a feed's indexes are built: kopf's readiness gate, per feed.
//!
//! The rule is kopf's: an index is built once every object of the resource's *initial listing*
//! went through its index handlers once, whatever the outcome. Later events (a resource that
//! changes all the time) and retries do not count, so a busy resource never holds the gate.
//! The feed (the parent module) tells this state what it receives and what finished; this
//! module keeps the listed objects that are still to go through, and knows when the listing is
//! complete: the watches report having listed only after every listed object was queued for
//! the feed, so once every watch has listed, the events queued at that moment contain the rest
//! of the listing.
//!
//! A resource that cannot be listed never builds its index. Rather than holding the handler
//! process forever (with every health check green), the gate opens — with a warning — as soon
//! as the API server refuses the listing (RBAC's `403`, a `404`: what the watch reports as a
//! problem), or when the listing has not completed within [`LISTING_DEADLINE`]; the feed goes
//! on trying, and the index fills once the listing succeeds.

use std::{collections::HashSet, time::Duration};

use tokio::time::Instant;

/// How long a feed's watches may take to list before the gate opens without the index.
pub const LISTING_DEADLINE: Duration = Duration::from_secs(120);

/// Why the gate opened without a complete index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Unlisted {
    /// The API server refuses the listing (the watch's problem).
    Refused(String),
    /// The listing did not complete within [`LISTING_DEADLINE`].
    Late,
}

/// A feed's progress towards a built index.
#[derive(Debug)]
pub(super) struct Building {
    /// Events still to receive before the initial listings are all in: `None` until every
    /// watch has listed.
    listing_left: Option<usize>,
    /// Objects of the initial listings that have not been through the index handlers yet.
    pending: HashSet<Box<str>>,
    /// Whether the gate opened (built, or given up on).
    opened: bool,
    /// When the gate opens even though the resource was not listed.
    deadline: Instant,
}

impl Building {
    /// Nothing listed yet; the gate opens without the index at `deadline` at the latest.
    pub(super) fn new(deadline: Instant) -> Self {
        Self {
            listing_left: None,
            pending: HashSet::new(),
            opened: false,
            deadline,
        }
    }

    /// An event of object `uid` was received from the watches; `listing`: one of the initial
    /// listing (a listed body, or a watch event standing in for one).
    pub(super) fn received(&mut self, listing: bool, uid: &str) {
        if self.listed() {
            return;
        }
        if listing && !self.opened {
            self.pending.insert(uid.into());
        }
        if let Some(left) = self.listing_left.as_mut() {
            *left = left.saturating_sub(1);
        }
    }

    /// Object `uid` went through the index handlers (or had nothing to go through).
    pub(super) fn indexed(&mut self, uid: &str) {
        self.pending.remove(uid);
    }

    /// Whether the watches must still be polled for their initial listings.
    pub(super) fn polling(&self) -> bool {
        self.listing_left.is_none()
    }

    /// Whether the initial listings are all received.
    pub(super) fn listed(&self) -> bool {
        self.listing_left == Some(0)
    }

    /// What the watches say: once all of them have `listed`, the `queued` events not received
    /// yet hold the rest of the listings; `refused` is why the API server refuses a listing
    /// still to come. Says so when the gate opens without the index.
    pub(super) fn poll(
        &mut self,
        listed: bool,
        refused: Option<String>,
        queued: usize,
        now: Instant,
    ) -> Option<Unlisted> {
        if listed {
            self.listing_left = Some(queued);
            return None;
        }
        if self.opened {
            return None;
        }
        let unlisted = match refused {
            Some(problem) => Unlisted::Refused(problem),
            None if now >= self.deadline => Unlisted::Late,
            None => return None,
        };
        self.open();
        Some(unlisted)
    }

    /// Whether the index is built now: the listings are in and every listed object went
    /// through. True once, when it happens.
    pub(super) fn built(&mut self) -> bool {
        if self.opened || !self.listed() || !self.pending.is_empty() {
            return false;
        }
        self.open();
        true
    }

    fn open(&mut self) {
        self.opened = true;
        self.pending = HashSet::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_once_every_listed_object_went_through_whatever_else_happens() {
        let mut b = Building::new(Instant::now() + LISTING_DEADLINE);
        b.received(true, "a");
        b.received(true, "b");
        assert_eq!(b.poll(false, None, 0, Instant::now()), None);
        assert!(b.polling() && !b.built());
        b.indexed("a");
        b.indexed("b");
        assert!(!b.built(), "not listed yet");
        // Listed once the watch says so: two events are still queued (one of the listing).
        assert_eq!(b.poll(true, None, 2, Instant::now()), None);
        b.received(true, "c");
        assert!(!b.listed());
        b.received(false, "a");
        assert!(b.listed() && !b.built(), "c has not been through");
        b.received(false, "a");
        b.indexed("a");
        assert!(!b.built());
        b.indexed("c");
        assert!(b.built());
        assert!(!b.built(), "once");
    }

    #[test]
    fn a_listing_that_never_completes_opens_the_gate_at_the_deadline() {
        let start = Instant::now();
        let mut b = Building::new(start + LISTING_DEADLINE);
        b.received(true, "a");
        assert_eq!(b.poll(false, None, 0, start), None);
        assert_eq!(
            b.poll(false, None, 0, start + LISTING_DEADLINE),
            Some(Unlisted::Late)
        );
        assert!(!b.built(), "opened once");
        assert!(b.polling(), "the listing is still awaited");
        assert_eq!(b.poll(true, None, 0, start + LISTING_DEADLINE), None);
        assert!(b.listed() && !b.built());
    }

    #[test]
    fn a_refused_listing_opens_the_gate_at_once() {
        let start = Instant::now();
        let mut b = Building::new(start + LISTING_DEADLINE);
        let refused = Some("listing failed: 403 forbidden".to_owned());
        assert_eq!(
            b.poll(false, refused.clone(), 0, start),
            Some(Unlisted::Refused("listing failed: 403 forbidden".into()))
        );
        assert_eq!(b.poll(false, refused, 0, start), None, "once");
    }
}
