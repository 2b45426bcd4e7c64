//! The member Leases of a sharded operator: one `coordination.k8s.io/v1` Lease per member,
//! labelled with the ring's name, saying who the member is, until when it is alive, and which
//! ring generation it acknowledged.
//!
//! The hand-over (`sharding::handover`) decides what a member's Lease says; this module only
//! moves [`Member`] records to and from the API server. Writes carry the `resourceVersion`
//! that was read, so a member never overwrites a record it did not see, and deletion of an
//! expired member is conditional on the version judged expired.

use std::{collections::BTreeMap, time::Duration};

use k8s_openapi::{
    api::coordination::v1::{Lease, LeaseSpec},
    apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta},
    jiff::Timestamp,
};
use kube::{
    Api, Client,
    api::{DeleteParams, ListParams, PostParams, Preconditions},
};

use super::objects::FIELD_MANAGER;

/// The label that groups the Leases of one ring.
pub const RING_LABEL: &str = "capstan.dev/ring";
/// The annotation with the ring generation a member acknowledged (hex).
pub const ACKNOWLEDGED: &str = "capstan.dev/acknowledged";
/// The annotation naming the process that writes the Lease (two processes with one identity
/// must not both think it theirs).
pub const INSTANCE: &str = "capstan.dev/instance";

/// Why member Leases could not be read or written: as for any Lease (a 409 is a conflict).
pub use super::lease::Error;

/// What a member's Lease says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// The Lease's name.
    pub lease: String,
    /// The member's identity (the Lease's holder).
    pub identity: String,
    /// How long the member is alive after a renewal.
    pub duration: Duration,
    /// The ring generation the member acknowledged (hex); `None`: it holds nothing.
    pub acknowledged: Option<String>,
    /// The process that wrote it.
    pub instance: Option<String>,
    /// When it was last renewed, by the member's clock (for reports; liveness is judged by
    /// local observation of changes, never by this).
    pub renewed: Option<std::time::SystemTime>,
    /// The `resourceVersion` it was read at (empty before it is written).
    pub version: String,
}

/// The member Leases of one ring in one namespace.
#[derive(Clone)]
pub struct Members {
    api: Api<Lease>,
    ring: String,
}

impl Members {
    /// The members of ring `ring` in `namespace`.
    pub fn new(client: Client, namespace: &str, ring: &str) -> Self {
        Self {
            api: Api::namespaced(client, namespace),
            ring: ring.to_owned(),
        }
    }

    /// The name of the Lease of `identity`: `<ring>-member-<identity>` made a DNS subdomain,
    /// with a hash of the identity when it had to be changed (so distinct identities never
    /// share a Lease).
    pub fn lease_name(&self, identity: &str) -> String {
        let wanted = format!("{}-member-{identity}", self.ring);
        let cleaned: String = wanted
            .to_ascii_lowercase()
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                    c
                } else {
                    '-'
                }
            })
            .collect();
        let cleaned = cleaned
            .trim_matches(|c: char| !c.is_ascii_alphanumeric())
            .to_owned();
        let valid = cleaned.len() <= 253 && !["..", ".-", "-."].iter().any(|bad| cleaned.contains(bad));
        if cleaned == wanted && valid {
            return cleaned;
        }
        let hash = crate::sharding::ring::fnv1a64(identity.as_bytes());
        let cleaned = cleaned.replace('.', "-");
        let mut head: String = cleaned.chars().take(200).collect();
        head = head
            .trim_end_matches(|c: char| !c.is_ascii_alphanumeric())
            .to_owned();
        format!("{head}-{hash:016x}")
    }

    /// Every member Lease of the ring, with the time they were read.
    ///
    /// # Errors
    /// [`Error::Api`] when the API server cannot be asked.
    pub async fn list(&self) -> Result<Vec<Member>, Error> {
        let params = ListParams::default().labels(&format!("{RING_LABEL}={}", self.ring));
        let leases = self.api.list(&params).await?;
        Ok(leases.items.into_iter().filter_map(member).collect())
    }

    /// Writes `record` (created when its version is empty, else replaced at its version);
    /// the Lease's renew time is now.
    ///
    /// # Errors
    /// [`Error::Conflict`] when it changed since it was read; [`Error::Api`] otherwise.
    pub async fn write(&self, record: &Member) -> Result<Member, Error> {
        let lease = self.to_lease(record);
        let params = PostParams {
            field_manager: Some(FIELD_MANAGER.to_owned()),
            ..PostParams::default()
        };
        let written = if record.version.is_empty() {
            self.api.create(&params, &lease).await?
        } else {
            self.api.replace(&record.lease, &params, &lease).await?
        };
        member(written).ok_or(Error::Conflict)
    }

    /// Deletes the Lease of `record` if it is still at the version read.
    ///
    /// # Errors
    /// [`Error::Conflict`] when it changed since; [`Error::Api`] otherwise. A Lease that is
    /// gone already is not an error.
    pub async fn delete(&self, record: &Member) -> Result<(), Error> {
        let params = DeleteParams {
            preconditions: (!record.version.is_empty()).then(|| Preconditions {
                resource_version: Some(record.version.clone()),
                uid: None,
            }),
            ..DeleteParams::default()
        };
        match self.api.delete(&record.lease, &params).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(status)) if status.code == 404 => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    fn to_lease(&self, record: &Member) -> Lease {
        let now = Timestamp::try_from(std::time::SystemTime::now())
            .ok()
            .map(MicroTime);
        let seconds = i32::try_from(record.duration.as_secs().max(1)).unwrap_or(i32::MAX);
        Lease {
            metadata: ObjectMeta {
                name: Some(record.lease.clone()),
                resource_version: (!record.version.is_empty()).then(|| record.version.clone()),
                labels: Some(BTreeMap::from([(RING_LABEL.to_owned(), self.ring.clone())])),
                annotations: Some(
                    record
                        .acknowledged
                        .iter()
                        .map(|g| (ACKNOWLEDGED.to_owned(), g.clone()))
                        .chain(record.instance.iter().map(|i| (INSTANCE.to_owned(), i.clone())))
                        .collect(),
                ),
                ..ObjectMeta::default()
            },
            spec: Some(LeaseSpec {
                holder_identity: Some(record.identity.clone()),
                lease_duration_seconds: Some(seconds),
                renew_time: now,
                ..LeaseSpec::default()
            }),
        }
    }
}

/// A Lease as a member record; `None` for one without a name or holder (not a member's).
fn member(lease: Lease) -> Option<Member> {
    let spec = lease.spec.unwrap_or_default();
    let identity = spec.holder_identity.filter(|h| !h.is_empty())?;
    let mut annotations = lease.metadata.annotations.unwrap_or_default();
    Some(Member {
        lease: lease.metadata.name?,
        identity,
        duration: spec
            .lease_duration_seconds
            .and_then(|s| u64::try_from(s).ok())
            .map_or(Duration::from_secs(15), Duration::from_secs),
        acknowledged: annotations.remove(ACKNOWLEDGED),
        instance: annotations.remove(INSTANCE),
        renewed: spec.renew_time.map(|t| std::time::SystemTime::from(t.0)),
        version: lease.metadata.resource_version.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn members() -> Members {
        let client = Client::try_from(kube::Config::new("http://127.0.0.1:1".parse().expect("url")))
            .expect("a client");
        Members::new(client, "default", "capstan")
    }

    #[tokio::test]
    async fn lease_names_are_dns_subdomains_and_distinct() {
        let m = members();
        assert_eq!(m.lease_name("capstan-7d9f-x2"), "capstan-member-capstan-7d9f-x2");
        let a = m.lease_name("Host@12");
        let b = m.lease_name("host@12");
        assert_ne!(a, b);
        for name in [
            &a,
            &b,
            &m.lease_name(&"x".repeat(400)),
            &m.lease_name("a..b"),
            &m.lease_name("x-.y"),
        ] {
            assert!(
                !name.contains("..") && !name.contains("-.") && !name.contains(".-"),
                "{name}"
            );
            assert!(name.len() <= 253, "{name}");
            assert!(
                name.chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '.'),
                "{name}"
            );
        }
    }

    #[tokio::test]
    async fn records_survive_the_round_trip_through_a_lease() {
        let m = members();
        let record = Member {
            lease: "capstan-member-a".into(),
            identity: "a".into(),
            duration: Duration::from_secs(15),
            acknowledged: Some("00ff".into()),
            instance: Some("4f2a".into()),
            renewed: None,
            version: "7".into(),
        };
        let lease = m.to_lease(&record);
        let back = member(lease).expect("a member");
        assert!(back.renewed.is_some(), "a write renews");
        assert_eq!(
            Member {
                renewed: None,
                ..back
            },
            record
        );
    }
}
