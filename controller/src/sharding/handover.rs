//! The hand-over protocol: a range moves only after its old owner has stopped handling it.
//!
//! Each member keeps a held set of ranges and publishes, in its member Lease, the ring
//! generation it *acknowledged*. Acknowledging generation `g` is a promise: "I hold nothing
//! outside what `g` assigns to me". So a member:
//!
//! 1. **renews** its Lease every retry period (the write also carries its acknowledgement);
//! 2. on seeing a ring it has not acknowledged, **pauses** (the `sharding` reason of the
//!    peering gate: dispatch stops, handler processes get `Drain`, in-flight cycles finish or
//!    are cancelled after the grace period, daemons and timers stop as on any pause), then
//!    **narrows** its held set to what the new ring assigns to it, and only then writes the
//!    acknowledgement;
//! 3. **widens** to its whole assignment only once every other member of that ring has
//!    acknowledged the same generation — their Leases say so — and then resumes: the engine
//!    is replaced and lists afresh, keeping only the objects of the held ranges.
//!
//! Two members that see different rings (a stale listing, a newcomer one of them counts
//! already) acknowledge different generations, so neither widens until their views agree:
//! the acknowledgements decide, not time. Time decides only for members that stop renewing:
//! a Lease that has not changed for its duration (as observed locally) leaves the ring, and a
//! member that could not renew within the renew deadline (shorter than the duration) has
//! **fenced** itself — paused with nothing held — before anyone else counts it gone. A member
//! that stops cleanly drains, stops its engine, and deletes its Lease ([`Handover::leave`]),
//! so the others move at once.
//!
//! While a hand-over waits for acknowledgements the member lists the Leases every
//! [`HANDOVER_POLL`] instead of every retry period, so a graceful move takes about one retry
//! period (to notice) plus a few polls.

use std::{sync::Arc, time::Duration};

use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{
    Settings,
    membership::Membership,
    ring::{Generation, Ranges, Ring},
    shard::Shard,
};
use crate::{
    k8s::members::{self, Member},
    peering::Gate,
};

/// The gate reason held while this member hands ranges over (or has none).
pub const GATE_KEY: &str = "sharding";

/// How often the Leases are listed while a hand-over waits for acknowledgements.
pub const HANDOVER_POLL: Duration = Duration::from_millis(250);

/// Where the member Leases live: the API (`k8s::members::Members`) or a test double.
pub trait Store: Send + Sync {
    /// Every member Lease of the ring.
    fn list(&self) -> BoxFuture<'_, Result<Vec<Member>, members::Error>>;
    /// Creates (empty version) or replaces (at its version) a member's Lease.
    fn write<'a>(&'a self, record: &'a Member) -> BoxFuture<'a, Result<Member, members::Error>>;
    /// Deletes a member's Lease if still at its version.
    fn delete<'a>(&'a self, record: &'a Member) -> BoxFuture<'a, Result<(), members::Error>>;
    /// The Lease name of `identity`.
    fn lease_name(&self, identity: &str) -> String;
}

impl Store for members::Members {
    fn list(&self) -> BoxFuture<'_, Result<Vec<Member>, members::Error>> {
        Box::pin(members::Members::list(self))
    }

    fn write<'a>(&'a self, record: &'a Member) -> BoxFuture<'a, Result<Member, members::Error>> {
        Box::pin(members::Members::write(self, record))
    }

    fn delete<'a>(&'a self, record: &'a Member) -> BoxFuture<'a, Result<(), members::Error>> {
        Box::pin(members::Members::delete(self, record))
    }

    fn lease_name(&self, identity: &str) -> String {
        members::Members::lease_name(self, identity)
    }
}

/// What this member knows of the ring, for readiness, metrics and webhooks.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Status {
    /// The ring's members as this member sees it.
    pub members: Vec<String>,
    /// The generation of that ring.
    pub generation: Option<Generation>,
    /// The generation this member acknowledged last.
    pub acknowledged: Option<Generation>,
    /// The share of the objects this member handles now (0 to 1).
    pub share: f64,
    /// The members whose acknowledgement this member waits for.
    pub waiting_for: Vec<String>,
    /// Whether it could not renew its Lease within the renew deadline.
    pub fenced: bool,
    /// Ring changes that moved ranges to or from this member.
    pub moves: u64,
    /// Whether it is the ring's first member (it writes what one replica must write).
    pub first: bool,
    /// Whether this member is leaving (stopping).
    pub leaving: bool,
}

impl Status {
    /// For readiness: `member 2 of 3, 33.1% of the objects`, or what it waits for.
    pub fn describe(&self) -> String {
        if self.fenced {
            return "fenced: the member lease is not renewed or not this process's; handling nothing"
                .to_owned();
        }
        let mut out = format!(
            "member of {} ({}), {:.1}% of the objects",
            self.members.len(),
            self.generation.map(|g| g.to_string()).unwrap_or_default(),
            self.share * 100.0
        );
        if !self.waiting_for.is_empty() {
            out.push_str(&format!(
                "; handing over, waiting for {}",
                self.waiting_for.join(", ")
            ));
        }
        out
    }
}

/// Something to say about a ring change (the app posts it as an Event on the member Lease).
pub type Announce = Arc<dyn Fn(&Member, String) + Send + Sync>;

/// Observer of hand-overs (the app records the metrics).
pub type Finished = Arc<dyn Fn(Duration) + Send + Sync>;

/// Stops everything this member's engine is doing and waits until it has stopped: its cycles
/// (and their writes) and its daemons are cancelled. Called before ranges are given up and on
/// fencing; the engine starts again, afresh, when dispatch resumes.
pub type Quiesce = Arc<dyn Fn() -> BoxFuture<'static, ()> + Send + Sync>;

/// Where the app puts its [`Quiesce`] once the engine exists (the member starts before it).
pub type QuiesceSlot = Arc<Mutex<Option<Quiesce>>>;

/// One member's side of the protocol.
pub struct Handover {
    settings: Settings,
    identity: String,
    /// This process, in its Lease: another process with the same identity is told apart.
    instance: String,
    store: Arc<dyn Store>,
    gate: Gate,
    shard: Shard,
    membership: Membership,
    /// This member's Lease as last written or listed.
    mine: Member,
    acknowledged: Option<Generation>,
    held: Ranges,
    /// When the last successful write started.
    renewed: Option<Instant>,
    /// Until then the member only watches the Leases; it writes its own after (see `run`).
    joining_until: Instant,
    /// When the current pause for a hand-over began.
    pausing_since: Option<Instant>,
    /// A drain is awaited: the next tick comes when it finishes.
    awaiting_drain: bool,
    status: Arc<Mutex<Status>>,
    announce: Option<Announce>,
    finished: Option<Finished>,
    quiesce: QuiesceSlot,
}

impl Handover {
    /// A member `identity` that holds nothing yet; holds the gate's `sharding` reason until
    /// its first ranges are handed to it.
    pub fn new(
        settings: Settings,
        identity: String,
        store: Arc<dyn Store>,
        gate: Gate,
        shard: Shard,
    ) -> Self {
        gate.hold(GATE_KEY, "sharding: joining the ring");
        let instance = instance_id(&identity);
        let mine = Member {
            lease: store.lease_name(&identity),
            identity: identity.clone(),
            duration: settings.lease_duration,
            acknowledged: None,
            instance: Some(instance.clone()),
            renewed: None,
            version: String::new(),
        };
        shard.set(Ranges::none());
        let now = Instant::now();
        Self {
            membership: Membership::new(),
            joining_until: now + settings.settle,
            settings,
            identity,
            instance,
            store,
            gate,
            shard,
            mine,
            acknowledged: None,
            held: Ranges::none(),
            renewed: None,
            pausing_since: Some(now),
            awaiting_drain: false,
            status: Arc::new(Mutex::new(Status::default())),
            announce: None,
            finished: None,
            quiesce: Arc::default(),
        }
    }

    /// Says something about every ring change this member takes part in.
    #[must_use]
    pub fn with_announce(mut self, announce: Announce) -> Self {
        self.announce = Some(announce);
        self
    }

    /// Told how long every hand-over paused this member.
    #[must_use]
    pub fn with_finished(mut self, finished: Finished) -> Self {
        self.finished = Some(finished);
        self
    }

    /// Where the engine's [`Quiesce`] will be; without one, the gate's drain is all.
    pub fn quiesce_slot(&self) -> QuiesceSlot {
        self.quiesce.clone()
    }

    /// The ring as this member knows it, kept up to date while [`Handover::run`] runs.
    pub fn status(&self) -> Arc<Mutex<Status>> {
        self.status.clone()
    }

    /// Runs until `stop` is cancelled; then the app drains, stops the engine and calls
    /// [`Handover::leave`].
    ///
    /// A new member first only watches the Leases for the settle time, then writes its own: a
    /// pod that crashes within it never joins (no objects move to it and back), and by the
    /// time it joins it has seen which Leases still change.
    pub async fn run(&mut self, stop: CancellationToken) {
        loop {
            let started = Instant::now();
            tokio::select! {
                () = stop.cancelled() => return,
                () = self.tick() => {}
            }
            let period = if self.pausing_since.is_some() && started >= self.joining_until {
                HANDOVER_POLL
            } else {
                self.settings.retry_period
            };
            let mut next = started + period;
            // Fencing must not wait for the next round.
            if let Some(renewed) = self.renewed {
                next = next.min(renewed + self.settings.renew_deadline);
            }
            let gate = self.gate.clone();
            let awaiting = self.awaiting_drain;
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep_until(next) => {}
                () = gate.drained(), if awaiting => {}
            }
        }
    }

    /// Whether the renew deadline has passed since the last successful write.
    fn overdue(&self, now: Instant) -> bool {
        self.renewed
            .is_some_and(|renewed| now >= renewed + self.settings.renew_deadline)
    }

    /// How long one request of this round may take: a retry period (at least a second), and
    /// never past the renew deadline.
    fn request_limit(&self, now: Instant) -> Duration {
        let limit = self.settings.retry_period.max(Duration::from_secs(1));
        match self.renewed {
            Some(renewed) => limit.min(
                (renewed + self.settings.renew_deadline)
                    .saturating_duration_since(now)
                    .max(Duration::from_millis(10)),
            ),
            None => limit,
        }
    }

    /// One round: list, judge the ring, hand over what must move, renew.
    pub async fn tick(&mut self) {
        let started = Instant::now();
        if self.overdue(started) {
            return self
                .fence("the member lease could not be renewed within the renew deadline")
                .await;
        }
        let listed = match tokio::time::timeout(self.request_limit(started), self.store.list()).await {
            Ok(Ok(listed)) => listed,
            Ok(Err(e)) => return self.failed(&crate::diagnostic::chain(&e)).await,
            Err(_) => return self.failed("listing the member leases timed out").await,
        };
        let now = Instant::now();
        self.membership.observe(listed, now);
        if now < self.joining_until {
            debug!("watching the member leases before joining");
            return;
        }
        match self
            .membership
            .record(&self.mine.lease, now)
            .map(|(r, alive)| (r.version.clone(), r.instance.clone(), alive))
        {
            Some((_, Some(other), true)) if other != self.instance => {
                // A live Lease of this identity written by another process: never adopted
                // while it is alive (that process may hold ranges).
                warn!(identity = %self.identity, "another process holds this member's lease (the same identity twice: --peer-id, POD_NAME); handling nothing until it expires");
                return self.fence("another process holds this member's lease").await;
            }
            Some((version, _, _)) => self.mine.version = version,
            None if self.renewed.is_some() => {
                // Deleted while this member held it: the others may already have taken its
                // ranges. Hold nothing before joining again.
                self.fence("the member lease was deleted").await;
                self.mine.version.clear();
            }
            None => self.mine.version.clear(),
        }
        let ring = self.membership.view(&self.identity, now);
        let generation = ring.generation();
        let mut acknowledge = self.acknowledged;
        self.awaiting_drain = false;
        if self.acknowledged != Some(generation) {
            self.pause("sharding: the ring changed; handing over", now);
            if self.gate.is_drained() {
                self.narrow(&ring).await;
                acknowledge = Some(generation);
            } else {
                self.awaiting_drain = true;
            }
        }
        let record = Member {
            acknowledged: acknowledge.map(|g| g.to_string()),
            instance: Some(self.instance.clone()),
            ..self.mine.clone()
        };
        let write_started = Instant::now();
        if self.overdue(write_started) {
            return self
                .fence("the member lease could not be renewed within the renew deadline")
                .await;
        }
        match tokio::time::timeout(self.request_limit(write_started), self.store.write(&record)).await {
            Ok(Ok(written)) => {
                self.mine = written;
                // Conservative: the lease counts from before the request was sent.
                self.renewed = Some(started);
                if self.acknowledged != acknowledge {
                    debug!(%generation, members = ring.len(), "acknowledged the ring");
                }
                self.acknowledged = acknowledge;
                self.status.lock().fenced = false;
            }
            Ok(Err(members::Error::Conflict)) => {
                return self.failed("the member lease changed since it was read").await;
            }
            Ok(Err(e)) => return self.failed(&crate::diagnostic::chain(&e)).await,
            Err(_) => return self.failed("writing the member lease timed out").await,
        }
        let mut waiting_for = Vec::new();
        if self.acknowledged == Some(generation) {
            let wanted = ring.assigned(&self.identity);
            if self.held != wanted {
                let g = generation.to_string();
                waiting_for = ring
                    .members()
                    .filter(|m| *m != self.identity)
                    .filter(|m| {
                        self.membership
                            .alive(m, now)
                            .and_then(|r| r.acknowledged.as_deref())
                            != Some(g.as_str())
                    })
                    .map(str::to_owned)
                    .collect();
                if waiting_for.is_empty() {
                    self.widen(wanted);
                }
            }
            if waiting_for.is_empty() {
                self.resume(&ring);
            }
        }
        self.collect_abandoned(now).await;
        let mut status = self.status.lock();
        status.members = ring.members().map(str::to_owned).collect();
        status.generation = Some(generation);
        status.acknowledged = self.acknowledged;
        status.share = self.held.share();
        status.waiting_for = waiting_for;
        status.first = ring.members().next() == Some(self.identity.as_str());
    }

    /// Pauses for a hand-over (once per hand-over).
    fn pause(&mut self, why: &str, now: Instant) {
        if self.pausing_since.is_none() {
            self.pausing_since = Some(now);
        }
        self.gate.hold(GATE_KEY, why);
    }

    /// Stops the engine and waits for it (see [`Quiesce`]).
    async fn quiesce(&self) {
        let quiesce = self.quiesce.lock().clone();
        if let Some(quiesce) = quiesce {
            quiesce().await;
        }
    }

    /// Keeps only what `ring` assigns to this member. Dispatch is drained; when ranges are
    /// given up, the engine is stopped first, so no cycle of theirs is still writing.
    async fn narrow(&mut self, ring: &Ring) {
        let kept = self.held.intersect(&ring.assigned(&self.identity));
        if kept != self.held {
            self.quiesce().await;
            self.status.lock().moves += 1;
            info!(
                members = ring.len(),
                share = kept.share(),
                "ranges handed over: this member stopped handling them"
            );
        }
        self.held = kept;
        self.shard.set(self.held.clone());
    }

    /// Takes the whole assignment: every other member acknowledged the ring.
    fn widen(&mut self, wanted: Ranges) {
        self.held = wanted;
        self.shard.set(self.held.clone());
    }

    /// Ends the hand-over: dispatch resumes (the engine lists afresh with the held ranges).
    fn resume(&mut self, ring: &Ring) {
        let Some(since) = self.pausing_since.take() else {
            return;
        };
        let took = since.elapsed();
        let members: Vec<&str> = ring.members().collect();
        info!(
            members = ?members,
            generation = %ring.generation(),
            share = self.held.share(),
            took = ?took,
            "the ring is settled; handling this member's objects"
        );
        if let Some(announce) = &self.announce {
            announce(
                &self.mine,
                format!(
                    "Ring {} of {} member(s) ({}): {} handles {:.1}% of the objects; the hand-over took {:.1}s",
                    ring.generation(),
                    ring.len(),
                    members.join(", "),
                    self.identity,
                    self.held.share() * 100.0,
                    took.as_secs_f64()
                ),
            );
        }
        if let Some(finished) = &self.finished {
            finished(took);
        }
        self.gate.release(GATE_KEY);
    }

    /// A list or write failed: retried next round (the run loop wakes at the renew deadline,
    /// when this member fences itself).
    async fn failed(&mut self, error: &str) {
        if self.overdue(Instant::now()) {
            return self.fence(error).await;
        }
        if self.renewed.is_some() {
            warn!(%error, "renewing the member lease failed; retrying");
        } else {
            warn!(%error, "the member lease could not be written; retrying (the member handles nothing until it is)");
        }
    }

    /// Stops handling everything at once — in-flight work is cancelled, not drained — and
    /// acknowledges no ring until the Lease is renewed again.
    async fn fence(&mut self, why: &str) {
        let was_holding = !self.held.is_empty() || self.acknowledged.is_some();
        self.pause(&format!("sharding: fenced ({why})"), Instant::now());
        self.held = Ranges::none();
        self.shard.set(Ranges::none());
        self.acknowledged = None;
        self.renewed = None;
        {
            let mut status = self.status.lock();
            status.fenced = true;
            status.share = 0.0;
            status.acknowledged = None;
        }
        if was_holding {
            warn!(reason = %why, "fenced: handling nothing until the member lease is renewed");
            self.quiesce().await;
        }
    }

    /// Deletes one Lease of a member that has been gone for a retry period beyond its duration
    /// (it fenced itself long before): a newcomer then never waits for a dead member. One per
    /// round, so renewing never waits behind many.
    async fn collect_abandoned(&mut self, now: Instant) {
        let Some(abandoned) = self
            .membership
            .abandoned(self.settings.retry_period, now)
            .into_iter()
            .find(|a| a.lease != self.mine.lease)
        else {
            return;
        };
        match tokio::time::timeout(self.request_limit(now), self.store.delete(&abandoned)).await {
            Ok(Ok(())) => info!(member = %abandoned.identity, "deleted the lease of a member that is gone"),
            Ok(Err(e)) => {
                debug!(error = %e, member = %abandoned.identity, "could not delete an abandoned member lease")
            }
            Err(_) => debug!(member = %abandoned.identity, "deleting an abandoned member lease timed out"),
        }
    }

    /// Leaves the ring: holds nothing and deletes this member's Lease, so the others take its
    /// ranges at once. Called after the engine stopped and in-flight work finished; otherwise
    /// see [`Handover::abandon`].
    pub async fn leave(&mut self) {
        self.held = Ranges::none();
        self.shard.set(Ranges::none());
        if self.mine.version.is_empty() {
            return;
        }
        match tokio::time::timeout(Duration::from_secs(5), self.store.delete(&self.mine)).await {
            Ok(Ok(())) => info!(identity = %self.identity, "left the ring"),
            Ok(Err(e)) => warn!(error = %e, "could not delete the member lease; it expires by itself"),
            Err(_) => warn!("deleting the member lease timed out; it expires by itself"),
        }
    }

    /// Stops without deleting the Lease (work may still be running): the others take this
    /// member's ranges when the Lease expires.
    pub fn abandon(&mut self) {
        self.held = Ranges::none();
        self.shard.set(Ranges::none());
        warn!(identity = %self.identity, "leaving the member lease to expire: in-flight work may not have finished");
    }
}

/// A name for this process, different for every start (for the Lease's instance annotation).
fn instance_id(identity: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let seed = format!("{identity}/{}/{nanos}", std::process::id());
    format!("{:016x}", super::ring::fnv1a64(seed.as_bytes()))
}

#[cfg(test)]
#[path = "handover/tests.rs"]
mod tests;
