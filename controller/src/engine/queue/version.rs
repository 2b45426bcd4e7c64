//! resourceVersions as Kubernetes defines them: opaque strings, compared only for equality.
//!
//! The queue must tell its own writes' echoes and the events that predate them from changes it
//! has not seen. Comparing versions as numbers would do it on a fresh etcd, but after an etcd
//! restore, on an aggregated API server, or on a server whose versions are no numbers, a
//! numeric order drops real changes until the controller restarts. What the queue relies on
//! instead is the order of the watch: the events of one object come in the order they were
//! stored, so an event that arrives before the echo of a write predates that write, and one
//! that arrives after it is newer ("newer" means "arrived after").
//!
//! - **The echo.** A write that stored a new version makes the object wait for that version's
//!   event ([`Versions::await_echo`]); it is recognised by exact version. Events of the object
//!   that arrive before it predate the write and are dropped (the write's answer, which the
//!   worker checked at once, holds them).
//! - **The end of a wait.** A wait ends on the echo; on a listing that started after the
//!   write's answer (it reflects the write; the watch that follows it does not bring older
//!   events); or, should the echo never come (a server that does not send it), after
//!   [`PATIENCE`] further events of the object, so that no object stops being handled.
//! - **Events while a cycle runs.** The versions of the events that arrive while a cycle of
//!   the object runs are remembered (at most [`PATIENCE`]): when the cycle's write answers,
//!   they tell whether its echo came already, and so whether an event waiting meanwhile came
//!   after the write (it is processed) or before it (the answer replaces it).
//! - **Marks** of objects whose body is listed again are satisfied by a listing pass that
//!   started after the mark (see [`super::relisting`]), never by comparing versions.

use serde_json::Value;
use tokio::time::Instant;

/// How many events of an object a wait for an echo lets pass at most; also how many versions
/// are remembered while a cycle runs.
pub const PATIENCE: u8 = 32;

/// The resourceVersion of a body, as the API server gave it.
pub fn version_of(body: &Value) -> Option<&str> {
    body.pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .filter(|v| !v.is_empty())
}

/// What the queue knows of an object's versions beyond its body: the echo it waits for, and
/// the versions that arrived while its cycle runs. Kept only while there is something to
/// know (an object at rest has none: see [`Versions::is_empty`]).
#[derive(Debug, Default)]
pub struct Versions {
    awaited: Option<Awaited>,
    /// The versions of the events that arrived since the running cycle started.
    arrived: Vec<Box<str>>,
    /// More than [`PATIENCE`] events arrived since the running cycle started.
    overflowed: bool,
}

#[derive(Debug)]
struct Awaited {
    version: Box<str>,
    /// When the write answered: a listing that started later reflects it.
    since: Instant,
    /// Whether a cycle saw (or will see) that version's body as stored: then the echo brings
    /// nothing new.
    seen: bool,
    /// Events of the object dropped while waiting.
    dropped: u8,
}

/// What an event of the object is, judged by [`Versions::judge`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Judged {
    /// The echo of the controller's own write; `seen`: its body was seen as stored.
    Echo { seen: bool },
    /// It predates the write whose echo is awaited.
    Stale,
    /// Nothing is awaited (any more): it is newer than anything seen.
    New,
}

impl Versions {
    /// Waits for the echo of a write that stored `version` — unless its event arrived already
    /// while the cycle ran. `seen`: the cycle saw (or will see) that version's body as stored.
    pub fn await_echo(&mut self, version: &str, seen: bool) {
        if self.arrived(version) == Some(true) {
            self.awaited = None;
            return;
        }
        self.awaited = Some(Awaited {
            version: version.into(),
            since: Instant::now(),
            seen,
            dropped: 0,
        });
    }

    /// Whether the echo of `version` is awaited.
    #[cfg(test)]
    pub fn awaits(&self, version: &str) -> bool {
        self.awaited.as_ref().is_some_and(|a| &*a.version == version)
    }

    /// The version whose echo is awaited, and whether its body was seen.
    #[cfg(test)]
    pub fn awaited(&self) -> Option<(&str, bool)> {
        self.awaited.as_ref().map(|a| (&*a.version, a.seen))
    }

    /// A cycle saw `version`'s body as stored: if its echo is awaited, it brings nothing new.
    pub fn saw(&mut self, version: &str) {
        if let Some(awaited) = self.awaited.as_mut().filter(|a| &*a.version == version) {
            awaited.seen = true;
        }
    }

    /// Judges an event of `version` (`listed`: it comes from a listing that started then); the
    /// wait ends unless the event is [`Judged::Stale`].
    pub fn judge(&mut self, version: Option<&str>, listed: Option<Instant>) -> Judged {
        let Some(awaited) = self.awaited.as_mut() else {
            return Judged::New;
        };
        if version.is_some_and(|v| *v == *awaited.version) {
            let seen = awaited.seen;
            self.awaited = None;
            return Judged::Echo { seen };
        }
        if listed.is_some_and(|at| at > awaited.since) {
            self.awaited = None;
            return Judged::New;
        }
        awaited.dropped = awaited.dropped.saturating_add(1);
        if awaited.dropped > PATIENCE {
            tracing::debug!(
                awaited = %awaited.version,
                "the echo of a write did not come within {PATIENCE} events of the object; no longer waiting"
            );
            self.awaited = None;
            return Judged::New;
        }
        Judged::Stale
    }

    /// A cycle of the object starts: the versions that arrive from now on are remembered.
    pub fn cycle_starts(&mut self) {
        self.arrived = Vec::new();
        self.overflowed = false;
    }

    /// An event of `version` arrived while a cycle of the object runs.
    pub fn arrive(&mut self, version: &str) {
        if self.arrived.len() < usize::from(PATIENCE) {
            self.arrived.push(version.into());
        } else {
            self.overflowed = true;
        }
    }

    /// The cycle ended: nothing more is remembered of what arrived while it ran.
    pub fn cycle_ends(&mut self) {
        self.cycle_starts();
    }

    /// Whether an event of `version` arrived since the running cycle started (`None`: too
    /// many events arrived to tell).
    pub fn arrived(&self, version: &str) -> Option<bool> {
        if self.arrived.iter().any(|v| &**v == version) {
            Some(true)
        } else if self.overflowed {
            None
        } else {
            Some(false)
        }
    }

    /// Whether nothing is known (the object keeps no record then).
    pub fn is_empty(&self) -> bool {
        self.awaited.is_none() && self.arrived.is_empty() && !self.overflowed
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_echo_is_recognised_by_exact_version_and_ends_the_wait() {
        let mut v = Versions::default();
        v.await_echo("20", true);
        assert_eq!(
            v.judge(Some("19"), None),
            Judged::Stale,
            "arrived before the echo"
        );
        assert_eq!(v.judge(Some("020"), None), Judged::Stale, "no numeric equality");
        assert_eq!(v.judge(Some("20"), None), Judged::Echo { seen: true });
        assert_eq!(
            v.judge(Some("5"), None),
            Judged::New,
            "after the echo, older numbers are news"
        );
        assert!(v.is_empty());
    }

    #[test]
    fn versions_that_go_backwards_or_are_no_numbers_are_news_once_nothing_is_awaited() {
        let mut v = Versions::default();
        for version in ["900", "12", "not-a-number", "b7f3", ""] {
            assert_eq!(v.judge(Some(version), None), Judged::New);
        }
        v.await_echo("zz-write", false);
        assert_eq!(v.judge(Some("aa"), None), Judged::Stale);
        assert_eq!(v.judge(Some("zz-write"), None), Judged::Echo { seen: false });
        assert_eq!(v.judge(Some("1"), None), Judged::New);
    }

    #[tokio::test(start_paused = true)]
    async fn a_listing_that_started_after_the_answer_ends_the_wait_and_an_earlier_one_does_not() {
        let before = Instant::now();
        tokio::time::advance(std::time::Duration::from_millis(5)).await;
        let mut v = Versions::default();
        v.await_echo("20", true);
        assert_eq!(v.judge(Some("7"), Some(before)), Judged::Stale);
        tokio::time::advance(std::time::Duration::from_millis(5)).await;
        assert_eq!(v.judge(Some("7"), Some(Instant::now())), Judged::New);
        assert!(v.is_empty());
    }

    #[test]
    fn a_wait_whose_echo_never_comes_ends_after_its_patience() {
        let mut v = Versions::default();
        v.await_echo("20", true);
        for n in 0..PATIENCE {
            assert_eq!(v.judge(Some(&format!("x{n}")), None), Judged::Stale);
        }
        assert_eq!(v.judge(Some("y"), None), Judged::New);
        assert_eq!(v.judge(Some("20"), None), Judged::New, "no longer awaited");
    }

    #[test]
    fn an_echo_that_arrived_while_the_cycle_ran_is_not_awaited() {
        let mut v = Versions::default();
        v.cycle_starts();
        v.arrive("20");
        v.arrive("21");
        assert_eq!(v.arrived("20"), Some(true));
        assert_eq!(v.arrived("22"), Some(false));
        v.await_echo("20", true);
        assert!(!v.awaits("20"));
        v.await_echo("22", true);
        assert!(v.awaits("22"));
        v.cycle_ends();
        for n in 0..=PATIENCE {
            v.arrive(&n.to_string());
        }
        assert_eq!(v.arrived("nothing"), None, "too many to tell");
    }
}
