//! Who is in the ring, as this member sees it: every member Lease that is alive.
//!
//! Liveness follows client-go's leader election: a Lease is alive until it has not changed for
//! its whole duration *as observed locally* (each version is timed from when this member first
//! saw it, after the listing that brought it returned), so members' clocks need not agree.
//!
//! Every live Lease is in the view, a newcomer's too: a member may widen into a range only
//! after every member of its ring acknowledged that ring, so leaving a live member out of a
//! view — one that might hold ranges, or widen into them concurrently — would let two members
//! take one range. Flapping is damped where it is safe: a new member waits before it writes
//! its Lease at all (see `sharding::handover`).

use std::{collections::BTreeMap, time::Duration};

use tokio::time::Instant;

use super::ring::Ring;
use crate::k8s::members::Member;

/// One member Lease as observed.
#[derive(Clone, Debug)]
struct Seen {
    record: Member,
    /// When this version was first seen.
    since: Instant,
}

impl Seen {
    fn alive(&self, now: Instant) -> bool {
        now < self.since + self.record.duration
    }
}

/// The observed member Leases.
#[derive(Debug, Default)]
pub struct Membership {
    seen: BTreeMap<String, Seen>,
}

impl Membership {
    /// Nothing observed yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Takes in a listing of the ring's Leases that returned at `now`.
    pub fn observe(&mut self, listed: Vec<Member>, now: Instant) {
        let mut next = BTreeMap::new();
        for record in listed {
            let since = match self.seen.remove(&record.lease) {
                Some(old) if old.record.version == record.version => old.since,
                _ => now,
            };
            next.insert(record.lease.clone(), Seen { record, since });
        }
        self.seen = next;
    }

    /// The ring as this member (`me`, always in it) sees it at `now`: every live member.
    pub fn view(&self, me: &str, now: Instant) -> Ring {
        Ring::new(
            self.seen
                .values()
                .filter(|s| s.alive(now))
                .map(|s| s.record.identity.clone())
                .chain(std::iter::once(me.to_owned())),
        )
    }

    /// The latest record of `identity`'s Lease, if alive.
    pub fn alive(&self, identity: &str, now: Instant) -> Option<&Member> {
        self.seen
            .values()
            .find(|s| s.record.identity == identity && s.alive(now))
            .map(|s| &s.record)
    }

    /// The record of the Lease named `lease` as last listed, and whether it is alive.
    pub fn record(&self, lease: &str, now: Instant) -> Option<(&Member, bool)> {
        self.seen.get(lease).map(|s| (&s.record, s.alive(now)))
    }

    /// Leases that have not changed for `after` beyond their duration: left behind by members
    /// that crashed (and fenced themselves long before), for anyone to delete.
    pub fn abandoned(&self, after: Duration, now: Instant) -> Vec<Member> {
        self.seen
            .values()
            .filter(|s| now.duration_since(s.since) >= s.record.duration + after)
            .map(|s| s.record.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(identity: &str, version: &str) -> Member {
        Member {
            lease: format!("ring-member-{identity}"),
            identity: identity.into(),
            duration: Duration::from_secs(10),
            acknowledged: None,
            instance: None,
            renewed: None,
            version: version.into(),
        }
    }

    fn names(ring: &Ring) -> Vec<&str> {
        ring.members().collect()
    }

    #[tokio::test(start_paused = true)]
    async fn members_that_stop_renewing_leave_after_their_duration() {
        let mut m = Membership::new();
        let t0 = Instant::now();
        m.observe(vec![lease("a", "1"), lease("b", "1")], t0);
        assert_eq!(names(&m.view("me", t0)), ["a", "b", "me"]);
        let t1 = t0 + Duration::from_secs(6);
        m.observe(vec![lease("a", "2"), lease("b", "1")], t1);
        let t2 = t0 + Duration::from_secs(11);
        m.observe(vec![lease("a", "3"), lease("b", "1")], t2);
        assert_eq!(
            names(&m.view("me", t2)),
            ["a", "me"],
            "b did not renew for its duration"
        );
        assert!(m.alive("b", t2).is_none());
        assert_eq!(m.record("ring-member-b", t2).map(|(_, alive)| alive), Some(false));
        assert_eq!(m.abandoned(Duration::from_secs(1), t2).len(), 1);
        assert!(m.abandoned(Duration::from_secs(5), t2).is_empty());
    }

    #[tokio::test(start_paused = true)]
    async fn newcomers_are_in_the_view_at_once_and_leave_when_deleted() {
        let mut m = Membership::new();
        let t0 = Instant::now();
        m.observe(vec![lease("n", "1")], t0);
        assert_eq!(names(&m.view("me", t0)), ["me", "n"]);
        m.observe(vec![], t0 + Duration::from_secs(1));
        assert_eq!(names(&m.view("me", t0 + Duration::from_secs(1))), ["me"]);
    }
}
