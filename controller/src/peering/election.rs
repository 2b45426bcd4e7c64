//! Leader election on a `coordination.k8s.io/v1` Lease, for replicas of one operator.
//!
//! The rules are client-go's `leaderelection`, which every Kubernetes controller follows:
//! try to acquire or renew every retry period; a lease held by someone else is taken over only
//! when it has not changed for a whole lease duration *as observed locally* (so clocks need not
//! agree); every write replaces the lease at the version that was read, so a conflict means
//! someone else won. A leader that cannot renew within the renew deadline steps down.
//!
//! Standbys are paused through the `peering::gate` (reason `leadership`), so they keep
//! watching and take over instantly. Stepping down is ordered for safety: pause first
//! (dispatch stops, handler processes are sent `Drain`, in-flight work gets its grace — but no
//! longer than the lease still protects us), then stop renewing and release the lease if it is
//! still ours, so another replica can start. On a clean exit the app drains and then calls
//! [`Elector::release`]: the holder is cleared and the lease expires in one second, so a
//! standby takes over at its next retry. Access goes through `k8s::lease` behind [`Store`], so
//! the state machine is tested without a cluster.

use std::{
    sync::Arc,
    time::{Duration, SystemTime},
};

use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::gate::Gate;
use crate::k8s::lease::{self, Leases, Record, Versioned};

/// The gate reason held while this replica is not the leader.
pub const GATE_KEY: &str = "leadership";

/// Why leader election cannot run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The durations are inconsistent.
    #[error(
        "leader election needs retry period < renew deadline < lease duration (got {retry:?}, {renew:?}, {lease:?})"
    )]
    Durations {
        /// The retry period.
        retry: Duration,
        /// The renew deadline.
        renew: Duration,
        /// The lease duration.
        lease: Duration,
    },
}

/// Leader election settings (client-go's defaults).
#[derive(Clone, Debug)]
pub struct Settings {
    /// Whether replicas elect a leader. Default off.
    pub enabled: bool,
    /// The Lease's name. Default `capstan`.
    pub lease_name: String,
    /// The Lease's namespace. Default: `POD_NAMESPACE`, else `default`.
    pub lease_namespace: Option<String>,
    /// How long a claim lasts without renewal; standbys wait this long. Default 15 s.
    pub lease_duration: Duration,
    /// A leader that has not renewed for this long steps down. Default 10 s.
    pub renew_deadline: Duration,
    /// How often to try to acquire or renew. Default 2 s.
    pub retry_period: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            enabled: false,
            lease_name: "capstan".into(),
            lease_namespace: None,
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

impl Settings {
    /// The Lease's namespace: the setting, else `POD_NAMESPACE`, else `default`.
    pub fn namespace(&self) -> String {
        self.lease_namespace
            .clone()
            .filter(|n| !n.is_empty())
            .or_else(|| std::env::var("POD_NAMESPACE").ok().filter(|n| !n.is_empty()))
            .unwrap_or_else(|| "default".into())
    }

    /// Checks that `retry period < renew deadline < lease duration`.
    ///
    /// # Errors
    /// [`Error::Durations`] otherwise.
    pub fn validate(&self) -> Result<(), Error> {
        if self.retry_period.is_zero()
            || self.retry_period >= self.renew_deadline
            || self.renew_deadline >= self.lease_duration
        {
            return Err(Error::Durations {
                retry: self.retry_period,
                renew: self.renew_deadline,
                lease: self.lease_duration,
            });
        }
        Ok(())
    }
}

/// Where the lease lives: the API (`k8s::lease::Leases`) or a test double.
pub trait Store: Send + Sync {
    /// Reads the lease.
    fn get(&self) -> BoxFuture<'_, Result<Option<Versioned>, lease::Error>>;
    /// Creates it.
    fn create<'a>(&'a self, record: &'a Record) -> BoxFuture<'a, Result<Versioned, lease::Error>>;
    /// Replaces it at `version`.
    fn replace<'a>(
        &'a self,
        record: &'a Record,
        version: &'a str,
    ) -> BoxFuture<'a, Result<Versioned, lease::Error>>;
}

impl Store for Leases {
    fn get(&self) -> BoxFuture<'_, Result<Option<Versioned>, lease::Error>> {
        Box::pin(Leases::get(self))
    }

    fn create<'a>(&'a self, record: &'a Record) -> BoxFuture<'a, Result<Versioned, lease::Error>> {
        Box::pin(Leases::create(self, record))
    }

    fn replace<'a>(
        &'a self,
        record: &'a Record,
        version: &'a str,
    ) -> BoxFuture<'a, Result<Versioned, lease::Error>> {
        Box::pin(Leases::replace(self, record, version))
    }
}

/// Who leads, as this replica knows it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Leadership {
    /// Whether this replica leads.
    pub leading: bool,
    /// The holder of the lease as last seen (this replica's identity when leading).
    pub leader: Option<String>,
}

impl Leadership {
    /// For readiness: `leader`, or `standby (leader: X)`.
    pub fn describe(&self) -> String {
        if self.leading {
            "leader".to_owned()
        } else {
            format!("standby (leader: {})", self.leader.as_deref().unwrap_or("none"))
        }
    }
}

/// What the next write to the lease should be, given what was read; `None` when someone else
/// holds a claim that has not expired. Pure (client-go's `tryAcquireOrRenew`).
///
/// `observed` is when the current record was first seen locally: expiry is judged by local
/// time since then, never by the holder's clock.
pub fn claim(
    me: &str,
    current: Option<&Record>,
    observed: Instant,
    now: Instant,
    wall: SystemTime,
    duration: Duration,
) -> Option<Record> {
    let Some(current) = current else {
        return Some(Record {
            holder: Some(me.to_owned()),
            duration: Some(duration),
            acquired: Some(wall),
            renewed: Some(wall),
            transitions: 0,
        });
    };
    let mine = current.holder.as_deref() == Some(me);
    let held = current.holder.as_deref().is_some_and(|h| !h.is_empty());
    let their_duration = current.duration.unwrap_or(duration);
    if held && !mine && now < observed + their_duration {
        return None;
    }
    Some(Record {
        holder: Some(me.to_owned()),
        duration: Some(duration),
        acquired: if mine {
            current.acquired.or(Some(wall))
        } else {
            Some(wall)
        },
        renewed: Some(wall),
        transitions: if mine || !held {
            current.transitions
        } else {
            current.transitions + 1
        },
    })
}

/// Runs leader election for one replica.
pub struct Elector {
    settings: Settings,
    identity: String,
    store: Arc<dyn Store>,
    gate: Gate,
    status: Arc<Mutex<Leadership>>,
    /// The last record read or written, with its version and when it was first seen.
    observed: Option<(Versioned, Instant)>,
    /// When this replica last renewed successfully while leading.
    renewed: Option<Instant>,
}

impl Elector {
    /// An elector for `identity`; holds the gate's `leadership` reason until elected.
    pub fn new(settings: Settings, identity: String, store: Arc<dyn Store>, gate: Gate) -> Self {
        gate.hold(GATE_KEY, "standby: waiting for the leader election");
        Self {
            settings,
            identity,
            store,
            gate,
            status: Arc::new(Mutex::new(Leadership::default())),
            observed: None,
            renewed: None,
        }
    }

    /// Who leads, kept up to date while [`Elector::run`] runs (for readiness).
    pub fn status(&self) -> Arc<Mutex<Leadership>> {
        self.status.clone()
    }

    fn leading(&self) -> bool {
        self.renewed.is_some()
    }

    /// One attempt to acquire or renew. `Ok(true)` when this replica holds the lease now.
    async fn attempt(&mut self) -> Result<bool, lease::Error> {
        let now = Instant::now();
        let current = self.store.get().await?;
        match (&current, &self.observed) {
            (Some(c), Some((o, _))) if c == o => {}
            (Some(c), _) => self.observed = Some((c.clone(), now)),
            (None, _) => self.observed = None,
        }
        let observed_at = self.observed.as_ref().map_or(now, |(_, at)| *at);
        let record = current.as_ref().map(|v| &v.record);
        let Some(next) = claim(
            &self.identity,
            record,
            observed_at,
            now,
            SystemTime::now(),
            self.settings.lease_duration,
        ) else {
            self.status.lock().leader = record.and_then(|r| r.holder.clone());
            return Ok(false);
        };
        let written = match &current {
            None => self.store.create(&next).await?,
            Some(v) => self.store.replace(&next, &v.version).await?,
        };
        self.observed = Some((written, Instant::now()));
        Ok(true)
    }

    /// Runs until `stop` is cancelled. The leadership it may still hold then is released by
    /// [`Elector::release`] once the app has drained.
    pub async fn run(&mut self, stop: CancellationToken) {
        loop {
            let started = Instant::now();
            let attempt = tokio::select! {
                () = stop.cancelled() => return,
                result = tokio::time::timeout(self.settings.retry_period.max(Duration::from_secs(1)), self.attempt()) => result,
            };
            match attempt {
                Ok(Ok(true)) => {
                    if !self.leading() {
                        info!(identity = %self.identity, "became the leader");
                        self.gate.release(GATE_KEY);
                    }
                    self.renewed = Some(started);
                    *self.status.lock() = Leadership {
                        leading: true,
                        leader: Some(self.identity.clone()),
                    };
                }
                Ok(Ok(false)) => {
                    let leader = self.status.lock().leader.clone().unwrap_or_default();
                    if self.leading() {
                        warn!(%leader, "the lease was taken over by another replica; stepping down");
                        self.step_down(false).await;
                    } else {
                        self.gate.hold(GATE_KEY, format!("standby (leader: {leader})"));
                        debug!(%leader, "standby");
                    }
                }
                Ok(Err(e)) => self.failed(&e.to_string(), &stop).await,
                Err(_) => self.failed("the lease request timed out", &stop).await,
            }
            let next = started + self.settings.retry_period;
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep_until(next) => {}
            }
        }
    }

    async fn failed(&mut self, error: &str, stop: &CancellationToken) {
        let Some(renewed) = self.renewed else {
            debug!(%error, "acquiring the lease failed; retrying");
            return;
        };
        if renewed.elapsed() < self.settings.renew_deadline {
            warn!(%error, "renewing the lease failed; retrying");
            return;
        }
        warn!(%error, deadline = ?self.settings.renew_deadline, "could not renew the lease within the renew deadline; stepping down");
        tokio::select! {
            () = stop.cancelled() => {}
            () = self.step_down(true) => {}
        }
    }

    /// Pauses, waits for the drain (no longer than the lease protects us), then releases the
    /// lease if it is still ours.
    async fn step_down(&mut self, release: bool) {
        let renewed = self.renewed.take().unwrap_or_else(Instant::now);
        self.gate.hold(GATE_KEY, "stepping down from leadership");
        self.status.lock().leading = false;
        let protected_until = renewed + self.settings.lease_duration;
        if tokio::time::timeout_at(protected_until, self.gate.drained())
            .await
            .is_err()
        {
            warn!("the drain did not finish before the lease expired");
        }
        info!(identity = %self.identity, "stepped down; now a standby");
        if release {
            self.release().await;
        }
        self.gate.hold(GATE_KEY, "standby (leader: unknown)");
    }

    /// Releases the lease if this replica holds it: clears the holder and shortens the
    /// duration to one second, so a standby takes over at its next retry. Best effort.
    pub async fn release(&mut self) {
        let attempt = async {
            let current = self.store.get().await?;
            let Some(current) = current.filter(|c| c.record.holder.as_deref() == Some(&self.identity)) else {
                return Ok::<bool, lease::Error>(false);
            };
            let released = Record {
                holder: None,
                duration: Some(Duration::from_secs(1)),
                renewed: Some(SystemTime::now()),
                ..current.record.clone()
            };
            self.store.replace(&released, &current.version).await?;
            Ok(true)
        };
        match tokio::time::timeout(Duration::from_secs(5), attempt).await {
            Ok(Ok(true)) => info!(identity = %self.identity, "released the lease"),
            Ok(Ok(false)) => {}
            Ok(Err(e)) => warn!(error = %e, "could not release the lease; it expires by itself"),
            Err(_) => warn!("releasing the lease timed out; it expires by itself"),
        }
        self.renewed = None;
        *self.status.lock() = Leadership::default();
    }
}

#[cfg(test)]
#[path = "election/tests.rs"]
mod tests;
