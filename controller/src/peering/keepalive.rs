//! The peering object model and the keep-alive: every running operator announces itself in
//! its peering object and watches the others.
//!
//! An entry of a peering object's `status` is kopf's: `{priority, lifetime, lastseen}` under
//! the peer's identity, plus Capstan's optional `message` (set by `capstan freeze`) and
//! `lease` (the Lease of replicas under leader election, so replicas are not mistaken for
//! conflicting operators). A peer is dead once `lastseen + lifetime` has passed; every writer
//! removes dead entries it sees (kopf's autoclean).
//!
//! [`Keepalive`] runs one peering object for the operator: it writes its own entry at once and
//! then every half lifetime, watches the object, asks `peering::freeze` what the live peers
//! mean, holds or releases its reason in the `peering::gate`, and removes its entry on a clean
//! exit. A missing object is created (kopf requires users to create it; an operator that can
//! write its entry can as well create the empty object). Access goes through `k8s::peering`.

use std::{
    collections::BTreeSet,
    time::{Duration, SystemTime},
};

use futures::StreamExt as _;
use serde_json::{Map, Value, json};
use tokio::sync::oneshot;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{freeze, gate::Gate};
use crate::{
    k8s::peering::{Error as ApiError, Peerings, Target},
    persistence::time,
};

/// One entry of a peering object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    /// The peer's identity (the key of its entry).
    pub id: String,
    /// Its priority: higher priorities pause lower ones.
    pub priority: i64,
    /// How long the entry stays alive after `lastseen`.
    pub lifetime: Duration,
    /// When the peer last wrote its entry.
    pub lastseen: SystemTime,
    /// Why it is there (a freeze's message), if it says.
    pub message: Option<String>,
    /// The Lease its replicas elect a leader on (`namespace/name`), if any.
    pub lease: Option<String>,
    /// The node of a per-node operator, if it is one.
    pub node: Option<String>,
}

impl Peer {
    /// When the entry expires; `None` when it never could be alive (overflow).
    pub fn expires_at(&self) -> Option<SystemTime> {
        self.lastseen.checked_add(self.lifetime)
    }

    /// Whether the entry has expired at `now` (kopf: `lastseen + lifetime <= now`).
    pub fn is_dead(&self, now: SystemTime) -> bool {
        self.expires_at().is_none_or(|t| t <= now)
    }

    /// The entry as stored in `status`.
    pub fn entry(&self) -> Value {
        let mut entry = json!({
            "priority": self.priority,
            "lifetime": self.lifetime.as_secs(),
            "lastseen": time::format(self.lastseen),
        });
        if let Some(map) = entry.as_object_mut() {
            if let Some(m) = &self.message {
                map.insert("message".into(), Value::String(m.clone()));
            }
            if let Some(l) = &self.lease {
                map.insert("lease".into(), Value::String(l.clone()));
            }
            if let Some(n) = &self.node {
                map.insert("node".into(), Value::String(n.clone()));
            }
        }
        entry
    }

    /// Reads an entry; `None` when it is not one (kopf's fields missing or malformed).
    pub fn parse(id: &str, entry: &Value) -> Option<Self> {
        let priority = entry.get("priority").and_then(Value::as_i64).unwrap_or(0);
        let lifetime = entry
            .get("lifetime")
            .and_then(|v| v.as_f64())
            .and_then(|s| Duration::try_from_secs_f64(s.max(0.0)).ok())?;
        let lastseen = entry
            .get("lastseen")
            .and_then(Value::as_str)
            .and_then(time::parse)?;
        let text = |k: &str| entry.get(k).and_then(Value::as_str).map(str::to_owned);
        Some(Self {
            id: id.to_owned(),
            priority,
            lifetime,
            lastseen,
            message: text("message"),
            lease: text("lease"),
            node: text("node"),
        })
    }
}

/// The peers of a peering object's status; malformed entries are skipped.
pub fn peers(status: &Map<String, Value>) -> Vec<Peer> {
    status
        .iter()
        .filter_map(|(id, entry)| Peer::parse(id, entry))
        .collect()
}

/// The status patch of a keep-alive: `me`'s entry, and `null` for every dead or malformed
/// entry of others (autoclean).
pub fn touch(me: &Peer, status: &Map<String, Value>, now: SystemTime) -> Map<String, Value> {
    let mut patch = Map::new();
    for (id, entry) in status {
        if *id != me.id && Peer::parse(id, entry).is_none_or(|p| p.is_dead(now)) {
            patch.insert(id.clone(), Value::Null);
        }
    }
    patch.insert(me.id.clone(), me.entry());
    patch
}

/// The status patch that removes the entry `id`.
pub fn removal(id: &str) -> Map<String, Value> {
    let mut patch = Map::new();
    patch.insert(id.to_owned(), Value::Null);
    patch
}

/// How often an entry with `lifetime` is renewed: every half lifetime, at least every second.
pub fn interval(lifetime: Duration) -> Duration {
    (lifetime / 2).max(Duration::from_secs(1))
}

/// The keep-alive of one operator in one peering object.
pub struct Keepalive {
    /// The API.
    pub peerings: Peerings,
    /// The peering object.
    pub target: Target,
    /// This operator's entry (its `lastseen` is set at each write).
    pub me: Peer,
    /// Where the pause decision goes.
    pub gate: Gate,
}

/// What a keep-alive remembers between evaluations, for logging changes only.
#[derive(Default)]
struct Seen {
    status: Map<String, Value>,
    blockers: BTreeSet<String>,
    conflicts: BTreeSet<String>,
    revisit_at: Option<SystemTime>,
}

impl Keepalive {
    /// The gate reason this keep-alive holds while frozen.
    pub fn gate_key(&self) -> String {
        format!("peering:{}", self.target)
    }

    /// Runs until `stop` is cancelled, then removes this operator's entry. `ready` fires after
    /// the first decision (or the first failure to make one).
    pub async fn run(self, ready: oneshot::Sender<()>, stop: CancellationToken) {
        let mut ready = Some(ready);
        let mut seen = Seen::default();
        let mut updates = Box::pin(self.peerings.watch(&self.target));
        let mut next_touch = tokio::time::Instant::now();
        let every = interval(self.me.lifetime);
        loop {
            let revisit = seen.revisit_at.map(|at| {
                let wait = at.duration_since(SystemTime::now()).unwrap_or_default();
                tokio::time::Instant::now() + wait + Duration::from_millis(10)
            });
            tokio::select! {
                () = stop.cancelled() => break,
                () = tokio::time::sleep_until(next_touch) => {
                    next_touch = tokio::time::Instant::now() + match self.keepalive(&seen.status).await {
                        Ok(status) => {
                            self.evaluate(&mut seen, status);
                            every
                        }
                        Err(e) => {
                            warn!(peering = %self.target, error = %crate::diagnostic::chain(&e), "the peering keep-alive failed; retrying");
                            every.min(Duration::from_secs(5))
                        }
                    };
                    if let Some(tx) = ready.take() {
                        let _ = tx.send(());
                    }
                }
                () = crate::grpc::hub::sleep_until_opt(revisit) => {
                    let status = std::mem::take(&mut seen.status);
                    self.evaluate(&mut seen, status);
                }
                update = updates.next() => match update {
                    Some(Ok(status)) => {
                        let missing = !status.contains_key(&self.me.id);
                        self.evaluate(&mut seen, status);
                        if missing && ready.is_none() {
                            // Our entry was removed (the object was recreated, or someone
                            // judged us dead): announce ourselves again now.
                            next_touch = tokio::time::Instant::now();
                        }
                    }
                    Some(Err(e)) => debug!(peering = %self.target, error = %crate::diagnostic::chain(&e), "peering watch error; it restarts by itself"),
                    None => {
                        updates = Box::pin(self.peerings.watch(&self.target));
                    }
                },
            }
        }
        self.gate.release(&self.gate_key());
        let removed = tokio::time::timeout(
            Duration::from_secs(5),
            self.peerings.patch(&self.target, removal(&self.me.id)),
        )
        .await;
        match removed {
            Ok(Ok(_)) => info!(peering = %self.target, id = %self.me.id, "left the peering"),
            Ok(Err(e)) => {
                warn!(peering = %self.target, error = %crate::diagnostic::chain(&e), "could not remove our peering entry; it expires by itself")
            }
            Err(_) => {
                warn!(peering = %self.target, "removing our peering entry timed out; it expires by itself")
            }
        }
    }

    /// Writes this operator's entry (creating the object if needed) and returns the status.
    async fn keepalive(&self, last: &Map<String, Value>) -> Result<Map<String, Value>, ApiError> {
        let now = SystemTime::now();
        let me = Peer {
            lastseen: now,
            ..self.me.clone()
        };
        match self.peerings.patch(&self.target, touch(&me, last, now)).await {
            Err(ApiError::NotFound(_)) => {
                info!(peering = %self.target, "the peering object does not exist; creating it");
                self.peerings.ensure(&self.target).await?;
                self.peerings.patch(&self.target, touch(&me, last, now)).await
            }
            result => {
                debug!(peering = %self.target, id = %me.id, "peering keep-alive written");
                result
            }
        }
    }

    fn evaluate(&self, seen: &mut Seen, status: Map<String, Value>) {
        let now = SystemTime::now();
        let decision = freeze::decide(&self.me, &peers(&status), now);
        let blockers: BTreeSet<String> = decision.blockers.iter().map(|p| p.id.clone()).collect();
        let conflicts: BTreeSet<String> = decision.conflicts.iter().map(|p| p.id.clone()).collect();
        if decision.pause() {
            if blockers != seen.blockers {
                info!(peering = %self.target, peers = ?blockers, "pausing operations in favour of higher-priority peers: {}", decision.explain());
            }
            self.gate.hold(&self.gate_key(), decision.explain());
        } else {
            if !seen.blockers.is_empty() {
                info!(peering = %self.target, "no higher-priority peer is alive any more; resuming operations");
            }
            self.gate.release(&self.gate_key());
        }
        if !conflicts.is_empty() && conflicts != seen.conflicts && self.me.node.is_some() {
            warn!(
                peering = %self.target,
                node = self.me.node.as_deref().unwrap_or_default(),
                peers = ?conflicts,
                "another operator runs with the same node name: both write the same per-node annotations; give each its own --node-name"
            );
        } else if !conflicts.is_empty() && conflicts != seen.conflicts {
            warn!(
                peering = %self.target,
                priority = self.me.priority,
                peers = ?conflicts,
                "possibly conflicting operators with the same priority; give one of them another --priority, or use --leader-election for replicas"
            );
        }
        seen.blockers = blockers;
        seen.conflicts = conflicts;
        seen.revisit_at = decision.revisit_at;
        seen.status = status;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me(now: SystemTime) -> Peer {
        Peer {
            id: "host@1".into(),
            priority: 0,
            lifetime: Duration::from_secs(60),
            lastseen: now,
            message: None,
            lease: None,
            node: None,
        }
    }

    #[test]
    fn entries_round_trip_in_kopf_format() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        let mut peer = me(now);
        peer.message = Some("debugging".into());
        let entry = peer.entry();
        assert_eq!(entry["priority"], 0);
        assert_eq!(entry["lifetime"], 60);
        assert_eq!(entry["lastseen"], "2023-11-14T22:13:20.000000+00:00");
        assert_eq!(Peer::parse("host@1", &entry), Some(peer));
        let kopf = json!({"priority": 666, "lifetime": 60, "lastseen": "2023-11-14T22:13:20.5Z"});
        assert_eq!(Peer::parse("dev", &kopf).map(|p| p.priority), Some(666));
        assert_eq!(Peer::parse("bad", &json!({"priority": 1})), None);
    }

    #[test]
    fn staleness_is_lastseen_plus_lifetime() {
        let now = SystemTime::now();
        let peer = me(now - Duration::from_secs(30));
        assert!(!peer.is_dead(now));
        assert!(peer.is_dead(now + Duration::from_secs(30)));
        let resumed = Peer {
            lifetime: Duration::ZERO,
            ..me(now)
        };
        assert!(resumed.is_dead(now), "lifetime 0 (kopf resume) is dead at once");
    }

    #[test]
    fn keepalives_clean_dead_entries_of_others() {
        let now = SystemTime::now();
        let mine = me(now);
        let mut status = Map::new();
        status.insert("dead".into(), me(now - Duration::from_secs(61)).entry());
        status.insert("alive".into(), me(now - Duration::from_secs(1)).entry());
        status.insert("garbage".into(), json!("x"));
        status.insert(mine.id.clone(), me(now - Duration::from_secs(600)).entry());
        let patch = touch(&mine, &status, now);
        assert_eq!(patch["dead"], Value::Null);
        assert_eq!(patch["garbage"], Value::Null);
        assert!(!patch.contains_key("alive"));
        assert_eq!(patch[&mine.id], mine.entry());
        assert_eq!(removal("x")["x"], Value::Null);
    }

    #[test]
    fn keepalives_run_twice_per_lifetime() {
        assert_eq!(interval(Duration::from_secs(60)), Duration::from_secs(30));
        assert_eq!(interval(Duration::from_secs(1)), Duration::from_secs(1));
    }
}
