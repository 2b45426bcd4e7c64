//! Reading and writing one `coordination.k8s.io/v1` Lease, with its `resourceVersion` for
//! optimistic concurrency.
//!
//! Leader election (`peering::election`) decides what the lease should say; this module only
//! moves a [`Record`] to and from the API server. Every write is a full replace carrying the
//! version that was read, so two replicas can never both believe they wrote the same version:
//! the loser gets [`Error::Conflict`] and must re-read.

use std::time::{Duration, SystemTime};

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{PostParams, Resource as _},
};

use super::objects::FIELD_MANAGER;

/// Why a lease could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Someone else wrote the lease since it was read (or created it first).
    #[error("the lease changed since it was read")]
    Conflict,
    /// The API server could not be reached or refused the request.
    #[error("the lease API request failed")]
    Api(#[source] kube::Error),
}

impl From<kube::Error> for Error {
    fn from(e: kube::Error) -> Self {
        match &e {
            kube::Error::Api(status) if status.code == 409 => Self::Conflict,
            _ => Self::Api(e),
        }
    }
}

/// What a lease says, in domain terms.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Record {
    /// Who holds it; `None` (or empty) when released.
    pub holder: Option<String>,
    /// How long the holder's claim lasts after `renewed`.
    pub duration: Option<Duration>,
    /// When the current holder acquired it.
    pub acquired: Option<SystemTime>,
    /// When the holder last renewed it.
    pub renewed: Option<SystemTime>,
    /// How many times it changed hands.
    pub transitions: i32,
}

/// A record together with the `resourceVersion` it was read at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Versioned {
    /// The content.
    pub record: Record,
    /// The version to replace it at.
    pub version: String,
}

/// One named lease.
#[derive(Clone)]
pub struct Leases {
    api: Api<Lease>,
    name: String,
}

impl Leases {
    /// The lease `namespace/name`.
    pub fn new(client: Client, namespace: &str, name: &str) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            name: name.to_owned(),
        }
    }

    /// Reads the lease; `None` when it does not exist.
    ///
    /// # Errors
    /// [`Error::Api`] when the API server cannot be asked.
    pub async fn get(&self) -> Result<Option<Versioned>, Error> {
        Ok(self.api.get_opt(&self.name).await?.map(versioned))
    }

    /// Creates the lease with `record`.
    ///
    /// # Errors
    /// [`Error::Conflict`] when it exists already; [`Error::Api`] otherwise.
    pub async fn create(&self, record: &Record) -> Result<Versioned, Error> {
        let lease = to_lease(&self.name, record, None);
        Ok(versioned(self.api.create(&post_params(), &lease).await?))
    }

    /// Replaces the lease with `record`, only if it is still at `version`.
    ///
    /// # Errors
    /// [`Error::Conflict`] when it changed since; [`Error::Api`] otherwise.
    pub async fn replace(&self, record: &Record, version: &str) -> Result<Versioned, Error> {
        let lease = to_lease(&self.name, record, Some(version));
        Ok(versioned(
            self.api.replace(&self.name, &post_params(), &lease).await?,
        ))
    }
}

fn post_params() -> PostParams {
    PostParams {
        field_manager: Some(FIELD_MANAGER.to_owned()),
        ..PostParams::default()
    }
}

fn micro(t: Option<SystemTime>) -> Option<MicroTime> {
    t.and_then(|t| Timestamp::try_from(t).ok()).map(MicroTime)
}

fn to_lease(name: &str, record: &Record, version: Option<&str>) -> Lease {
    let seconds = record
        .duration
        .map(|d| i32::try_from(d.as_secs().max(1)).unwrap_or(i32::MAX));
    Lease {
        metadata: ObjectMeta {
            name: Some(name.to_owned()),
            resource_version: version.map(str::to_owned),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec {
            holder_identity: Some(record.holder.clone().unwrap_or_default()),
            lease_duration_seconds: seconds,
            acquire_time: micro(record.acquired),
            renew_time: micro(record.renewed),
            lease_transitions: Some(record.transitions),
            ..LeaseSpec::default()
        }),
    }
}

fn versioned(lease: Lease) -> Versioned {
    let version = lease.meta().resource_version.clone().unwrap_or_default();
    let spec = lease.spec.unwrap_or_default();
    let time = |t: Option<MicroTime>| t.map(|t| SystemTime::from(t.0));
    Versioned {
        record: Record {
            holder: spec.holder_identity.filter(|h| !h.is_empty()),
            duration: spec
                .lease_duration_seconds
                .and_then(|s| u64::try_from(s).ok())
                .map(Duration::from_secs),
            acquired: time(spec.acquire_time),
            renewed: time(spec.renew_time),
            transitions: spec.lease_transitions.unwrap_or(0),
        },
        version,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_survive_the_round_trip_through_a_lease() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456);
        let record = Record {
            holder: Some("a@1".into()),
            duration: Some(Duration::from_secs(15)),
            acquired: Some(now),
            renewed: Some(now),
            transitions: 3,
        };
        let mut lease = to_lease("capstan", &record, Some("42"));
        lease.metadata.resource_version = Some("42".into());
        let back = versioned(lease);
        assert_eq!(back.record, record);
        assert_eq!(back.version, "42");
    }

    #[test]
    fn an_empty_holder_means_released() {
        let lease = to_lease("capstan", &Record::default(), None);
        assert_eq!(
            lease.spec.as_ref().and_then(|s| s.holder_identity.as_deref()),
            Some("")
        );
        assert_eq!(versioned(lease).record.holder, None);
    }
}
