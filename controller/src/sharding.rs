//! Horizontal sharding: N replicas of one operator, each handling a share of the objects, no
//! object handled by two at once.
//!
//! Kubernetes is the coordination engine; there is no other store. Each replica is a
//! **member** holding its own Lease (`k8s::members`) in the operator's namespace; the ring is
//! the set of live, settled member Leases (`membership`), and every member computes the same
//! assignment from it (`ring`: 64-bit FNV-1a of the object's uid, consistent hashing with
//! virtual nodes, the hash and ranges of Kubernetes' sharded list and watch). Ranges move by
//! the acknowledgement protocol of `handover`: the old owner pauses, narrows and acknowledges
//! the new ring before the new owner widens; a member that cannot renew its Lease fences
//! itself before the others count it gone. The engine keeps only the objects whose uid falls
//! in the held ranges (`shard`).
//!
//! What is per member and what is global:
//! - change, resume, delete, event, field, daemon and timer handlers run on the object's
//!   member, with kopf's semantics there. A ring change pauses every member for the hand-over
//!   (its daemons and timers stop as on any pause and start again after it, as after a
//!   restart); a daemon whose object moved starts on its new member;
//! - indexes are over **all** objects on every member (the indexer's watch is not sharded):
//!   handlers see kopf's indexes whatever their object's member;
//! - startup, login, probe and cleanup handlers run on every member (they are per process);
//! - admission webhooks are served by every member; the one first in the ring writes the
//!   managed webhook configurations;
//! - freezing pauses every member (each keeps its peering entry, naming the ring, so members
//!   are not taken for conflicting operators); leader election is replaced by sharding (the
//!   two are refused together), and so is per-node mode.

pub mod handover;
pub mod membership;
pub mod ring;
pub mod shard;

use std::{sync::Arc, time::Duration};

use kube::Client;
use parking_lot::Mutex;
use tokio::{sync::mpsc, task::JoinHandle};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, debug, info, info_span};

pub use handover::{Handover, Status};
pub use shard::Shard;

use crate::{
    k8s::{events::Events, members::Members},
    model::{
        ResolvedResource, ResourceRef,
        posting::{Level, Policy, Posting},
    },
    peering::Gate,
};

/// Why sharding cannot run.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The durations are inconsistent (as leader election's must be).
    #[error("invalid sharding durations")]
    Durations(#[source] crate::peering::election::Error),
}

/// Sharding settings.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Whether replicas shard the objects. Default off.
    pub enabled: bool,
    /// The ring's name: the member Leases' label value and name prefix. Default `capstan`.
    pub ring: String,
    /// The member Leases' namespace. Default: `POD_NAMESPACE`, else `default`.
    pub namespace: Option<String>,
    /// How long a member is alive without renewing its Lease. Default 15 s.
    pub lease_duration: Duration,
    /// A member that has not renewed for this long stops handling. Default 10 s.
    pub renew_deadline: Duration,
    /// How often a member renews its Lease and looks at the ring. Default 2 s.
    pub retry_period: Duration,
    /// How long a new member must be alive before it joins the ring. Default 4 s.
    pub settle: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            enabled: false,
            ring: "capstan".into(),
            namespace: None,
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
            settle: Duration::from_secs(4),
        }
    }
}

impl Settings {
    /// The member Leases as leader election would see a Lease of them: the same namespace
    /// default and the same rules for the durations.
    fn lease(&self) -> crate::peering::election::Settings {
        crate::peering::election::Settings {
            enabled: false,
            lease_name: self.ring.clone(),
            lease_namespace: self.namespace.clone(),
            lease_duration: self.lease_duration,
            renew_deadline: self.renew_deadline,
            retry_period: self.retry_period,
        }
    }

    /// The member Leases' namespace: the setting, else `POD_NAMESPACE`, else `default`.
    pub fn namespace(&self) -> String {
        self.lease().namespace()
    }

    /// Checks that `retry period < renew deadline < lease duration`.
    ///
    /// # Errors
    /// [`Error::Durations`] otherwise.
    pub fn validate(&self) -> Result<(), Error> {
        self.lease().validate().map_err(Error::Durations)
    }
}

/// A running member: its hand-over task, and the poster of its ring-change Events.
pub struct Member {
    shard: Shard,
    status: Arc<Mutex<Status>>,
    quiesce: handover::QuiesceSlot,
    stop: CancellationToken,
    handover: Option<JoinHandle<Handover>>,
    announcer: JoinHandle<()>,
}

/// Ring-change Events waiting to be posted at most (more are dropped: they are reports).
const ANNOUNCEMENTS: usize = 8;

impl Member {
    /// Joins the ring as `identity`: holds the gate's `sharding` reason until this member's
    /// first ranges are handed to it, then follows the ring until [`Member::stop`].
    ///
    /// # Errors
    /// [`Error::Durations`] when the durations are inconsistent.
    pub fn start(settings: &Settings, identity: &str, client: Client, gate: &Gate) -> Result<Self, Error> {
        settings.validate()?;
        let namespace = settings.namespace();
        let store = Arc::new(Members::new(client.clone(), &namespace, &settings.ring));
        let shard = Shard::of(identity);
        let (tx, mut rx) = mpsc::channel::<(String, String)>(ANNOUNCEMENTS);
        let announce: handover::Announce = Arc::new(move |lease, message| {
            let _ = tx.try_send((lease.lease.clone(), message));
        });
        let member = identity.to_owned();
        let finished: handover::Finished =
            Arc::new(move |took| crate::observability::metrics::global().sharding_handover(&member, took));
        let mut handover = Handover::new(
            settings.clone(),
            identity.to_owned(),
            store,
            gate.clone(),
            shard.clone(),
        )
        .with_announce(announce)
        .with_finished(finished);
        let status = handover.status();
        let quiesce = handover.quiesce_slot();
        {
            let (members, moves) = (status.clone(), status.clone());
            crate::observability::metrics::global().sample_sharding(
                identity,
                move || i64::try_from(members.lock().members.len()).unwrap_or(i64::MAX),
                move || moves.lock().moves,
            );
        }
        let stop = CancellationToken::new();
        let events = Events::new(client, identity.to_owned());
        let announcer = tokio::spawn(
            async move {
                while let Some((lease, message)) = rx.recv().await {
                    let posting = Posting {
                        object: lease_ref(&namespace, &lease),
                        level: Level::Info,
                        reason: "RingChanged".into(),
                        message,
                        policy: Policy::Always,
                        event_type: None,
                    };
                    match tokio::time::timeout(ANNOUNCE_TIMEOUT, events.create(&posting)).await {
                        Ok(Ok(_)) => {}
                        Ok(Err(e)) => debug!(error = %e, "the ring change Event was not posted"),
                        Err(_) => debug!("posting the ring change Event timed out"),
                    }
                }
            }
            .instrument(info_span!("sharding-events")),
        );
        let task = {
            let stop = stop.clone();
            tokio::spawn(
                async move {
                    handover.run(stop).await;
                    handover
                }
                .instrument(info_span!("sharding", member = %identity)),
            )
        };
        info!(ring = %settings.ring, %identity, "sharding: joining the ring");
        Ok(Self {
            shard,
            status,
            quiesce,
            stop,
            handover: Some(task),
            announcer,
        })
    }

    /// The ranges this member handles now, for the engine.
    pub fn shard(&self) -> Shard {
        self.shard.clone()
    }

    /// The ring as this member knows it.
    pub fn status(&self) -> Arc<Mutex<Status>> {
        self.status.clone()
    }

    /// Gives the hand-over the engine's [`handover::Quiesce`], once the engine exists.
    pub fn set_quiesce(&self, quiesce: handover::Quiesce) {
        *self.quiesce.lock() = Some(quiesce);
    }

    /// Stops following the ring (the member keeps its ranges until [`Member::leave`]).
    async fn stop(&mut self) -> Option<Handover> {
        self.stop.cancel();
        let handover = self.handover.take()?.await.ok();
        self.announcer.abort();
        handover
    }

    /// Stops and leaves the ring: called once the engine stopped and in-flight work finished,
    /// so the others take this member's ranges at once. With `finished` false (a drain that
    /// ran out of time, a failure), the Lease is left to expire instead.
    pub async fn leave(mut self, finished: bool) {
        if let Some(mut handover) = self.stop().await {
            if finished {
                handover.leave().await;
            } else {
                handover.abandon();
            }
        }
    }
}

impl Drop for Member {
    fn drop(&mut self) {
        // Not left through `leave` (an early error): its tasks end with it; its Lease expires.
        self.stop.cancel();
        if let Some(task) = &self.handover {
            task.abort();
        }
        self.announcer.abort();
    }
}

/// How long posting one ring-change Event may take.
const ANNOUNCE_TIMEOUT: Duration = Duration::from_secs(10);

/// A member Lease as the object of an Event.
fn lease_ref(namespace: &str, name: &str) -> ResourceRef {
    ResourceRef {
        resource: ResolvedResource {
            group: "coordination.k8s.io".into(),
            version: "v1".into(),
            plural: "leases".into(),
            kind: "Lease".into(),
            namespaced: true,
            status_subresource: false,
        },
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        uid: String::new(),
        resource_version: String::new(),
        generation: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_must_be_ordered() {
        assert!(Settings::default().validate().is_ok());
        let bad = Settings {
            renew_deadline: Duration::from_secs(20),
            ..Settings::default()
        };
        assert!(bad.validate().is_err());
    }
}
