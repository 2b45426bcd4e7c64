//! Who is in the ring, as this member sees it: the member Leases that are alive and settled.
//!
//! Liveness follows client-go's leader election: a Lease is alive until it has not changed for
//! its whole duration *as observed locally* (each version is timed from when this member first
//! saw it), so members' clocks need not agree. A member that was not seen in a ring yet (its
//! Lease acknowledges no generation) joins the view only after it has been alive for the
//! settle time, doubled for each time the same identity left in the last
//! [`DEPARTURE_MEMORY`] (at most [`MAX_SETTLE_DOUBLINGS`] times): a pod that crashes and
//! comes back every few seconds never moves objects to itself and back, and one that flaps
//! slower costs a move per settle time at most. Members that leave are never held back — their
//! objects must move at once.

use std::{
    collections::{BTreeMap, VecDeque},
    time::Duration,
};

use tokio::time::Instant;

use super::ring::Ring;
use crate::k8s::members::Member;

/// How long a departure counts against an identity's settle time.
pub const DEPARTURE_MEMORY: Duration = Duration::from_secs(120);
/// The settle time doubles at most this many times.
pub const MAX_SETTLE_DOUBLINGS: u32 = 3;

/// One member Lease as observed.
#[derive(Clone, Debug)]
struct Seen {
    record: Member,
    /// When this version was first seen.
    since: Instant,
    /// When this Lease was first seen alive (since it last came back).
    first: Instant,
    /// Whether it was alive when last judged (a departure is counted once).
    was_alive: bool,
}

/// The observed member Leases, and the recent departures.
#[derive(Debug)]
pub struct Membership {
    settle: Duration,
    seen: BTreeMap<String, Seen>,
    departures: BTreeMap<String, VecDeque<Instant>>,
}

impl Membership {
    /// Newcomers join a view after `settle`.
    pub fn new(settle: Duration) -> Self {
        Self {
            settle,
            seen: BTreeMap::new(),
            departures: BTreeMap::new(),
        }
    }

    /// Takes in a listing of the ring's Leases made at `now`.
    pub fn observe(&mut self, listed: Vec<Member>, now: Instant) {
        let mut next = BTreeMap::new();
        for record in listed {
            let seen = match self.seen.remove(&record.lease) {
                Some(old) if old.record.version == record.version => Seen { record, ..old },
                Some(old) if old.was_alive => Seen {
                    record,
                    since: now,
                    ..old
                },
                // New, or back after it expired: alive from now, and new to the ring.
                _ => Seen {
                    record,
                    since: now,
                    first: now,
                    was_alive: true,
                },
            };
            next.insert(seen.record.lease.clone(), seen);
        }
        for (_, gone) in std::mem::replace(&mut self.seen, next) {
            if gone.was_alive {
                self.depart(&gone.record.identity, now);
            }
        }
        let expired: Vec<String> = self
            .seen
            .values_mut()
            .filter(|s| s.was_alive && !s.alive(now))
            .map(|s| {
                s.was_alive = false;
                s.record.identity.clone()
            })
            .collect();
        for identity in expired {
            self.depart(&identity, now);
        }
        for times in self.departures.values_mut() {
            while times
                .front()
                .is_some_and(|t| now.duration_since(*t) > DEPARTURE_MEMORY)
            {
                times.pop_front();
            }
        }
        self.departures.retain(|_, t| !t.is_empty());
    }

    fn depart(&mut self, identity: &str, now: Instant) {
        self.departures
            .entry(identity.to_owned())
            .or_default()
            .push_back(now);
    }

    /// How long `identity` must be alive before it joins a view.
    pub fn settle_time(&self, identity: &str) -> Duration {
        let recent = self.departures.get(identity).map_or(0, VecDeque::len);
        let doublings = u32::try_from(recent)
            .unwrap_or(u32::MAX)
            .min(MAX_SETTLE_DOUBLINGS);
        self.settle.saturating_mul(1 << doublings)
    }

    /// The ring as this member (`me`, always in it) sees it at `now`.
    pub fn view(&self, me: &str, now: Instant) -> Ring {
        let others = self.seen.values().filter(|s| {
            s.record.identity != me
                && s.alive(now)
                && (s.record.acknowledged.is_some()
                    || now.duration_since(s.first) >= self.settle_time(&s.record.identity))
        });
        Ring::new(
            others
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

    /// The record of the Lease named `lease`, as last listed.
    pub fn record(&self, lease: &str) -> Option<&Member> {
        self.seen.get(lease).map(|s| &s.record)
    }

    /// Leases that have been dead for `after` beyond their duration: left behind by members
    /// that crashed, for anyone to delete.
    pub fn abandoned(&self, after: Duration, now: Instant) -> Vec<Member> {
        self.seen
            .values()
            .filter(|s| now.duration_since(s.since) >= s.record.duration + after)
            .map(|s| s.record.clone())
            .collect()
    }
}

impl Seen {
    fn alive(&self, now: Instant) -> bool {
        now < self.since + self.record.duration
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease(identity: &str, version: &str, acknowledged: Option<&str>) -> Member {
        Member {
            lease: format!("ring-member-{identity}"),
            identity: identity.into(),
            duration: Duration::from_secs(10),
            acknowledged: acknowledged.map(str::to_owned),
            renewed: None,
            version: version.into(),
        }
    }

    fn names(ring: &Ring) -> Vec<&str> {
        ring.members().collect()
    }

    #[tokio::test(start_paused = true)]
    async fn members_that_stop_renewing_leave_after_their_duration() {
        let mut m = Membership::new(Duration::from_secs(2));
        let t0 = Instant::now();
        m.observe(vec![lease("a", "1", Some("g")), lease("b", "1", Some("g"))], t0);
        assert_eq!(names(&m.view("me", t0)), ["a", "b", "me"]);
        let t1 = t0 + Duration::from_secs(6);
        m.observe(vec![lease("a", "2", Some("g")), lease("b", "1", Some("g"))], t1);
        let t2 = t0 + Duration::from_secs(11);
        m.observe(vec![lease("a", "3", Some("g")), lease("b", "1", Some("g"))], t2);
        assert_eq!(
            names(&m.view("me", t2)),
            ["a", "me"],
            "b did not renew for its duration"
        );
        assert!(m.alive("b", t2).is_none());
        assert_eq!(
            m.abandoned(Duration::from_secs(5), t0 + Duration::from_secs(16))
                .len(),
            1
        );
    }

    #[tokio::test(start_paused = true)]
    async fn newcomers_join_after_the_settle_time_and_flappers_later() {
        let mut m = Membership::new(Duration::from_secs(2));
        let t0 = Instant::now();
        m.observe(vec![lease("n", "1", None)], t0);
        assert_eq!(names(&m.view("me", t0)), ["me"]);
        let t1 = t0 + Duration::from_secs(2);
        m.observe(vec![lease("n", "2", None)], t1);
        assert_eq!(names(&m.view("me", t1)), ["me", "n"]);
        // It leaves and comes back: now it must wait twice as long.
        m.observe(vec![], t1 + Duration::from_secs(1));
        let t2 = t1 + Duration::from_secs(2);
        m.observe(vec![lease("n", "5", None)], t2);
        assert_eq!(m.settle_time("n"), Duration::from_secs(4));
        assert_eq!(names(&m.view("me", t2 + Duration::from_secs(3))), ["me"]);
        m.observe(vec![lease("n", "6", None)], t2 + Duration::from_secs(4));
        assert_eq!(names(&m.view("me", t2 + Duration::from_secs(4))), ["me", "n"]);
        // Departures are forgotten after a while.
        m.observe(
            vec![lease("n", "7", None)],
            t2 + DEPARTURE_MEMORY + Duration::from_secs(1),
        );
        assert_eq!(m.settle_time("n"), Duration::from_secs(2));
    }

    #[tokio::test(start_paused = true)]
    async fn members_in_a_ring_already_are_not_held_back() {
        let mut m = Membership::new(Duration::from_secs(60));
        let t0 = Instant::now();
        m.observe(vec![lease("a", "1", Some("00ff"))], t0);
        assert_eq!(names(&m.view("me", t0)), ["a", "me"]);
    }
}
