//! The pause decision of priority freezing: given the live peers of a peering object, should
//! this operator run, pause, or warn about a conflicting peer?
//!
//! kopf's rules (`kopf/_core/engines/peering.py`): a live peer with a higher priority pauses
//! the operator ("pausing in favour of …") — that is how `--dev` (priority 666) and
//! `capstan freeze` (priority 100 by default) take over from production operators at the
//! default priority 0. A live peer with the *same* priority is a probable conflict and is
//! warned about. kopf also pauses on a same-priority peer; Capstan only warns, because replicas
//! of one Deployment share a priority and are coordinated by leader election instead (peers
//! that name the same lease are therefore not reported as conflicts at all).
//!
//! Pure logic; `peering::keepalive` feeds it and applies the result to the `peering::gate`.

use std::time::SystemTime;

use super::keepalive::Peer;

/// What to do about the peers of one peering object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Live peers with a higher priority, highest first: pause while non-empty.
    pub blockers: Vec<Peer>,
    /// Live peers with the same priority that are not replicas of this operator: warn.
    pub conflicts: Vec<Peer>,
    /// When the decision may change without any new event: the earliest expiry of a
    /// blocking or conflicting peer.
    pub revisit_at: Option<SystemTime>,
}

impl Decision {
    /// Whether the operator must pause.
    pub fn pause(&self) -> bool {
        !self.blockers.is_empty()
    }

    /// A one-line explanation of the pause, naming the peers in whose favour it happens.
    pub fn explain(&self) -> String {
        let names: Vec<String> = self
            .blockers
            .iter()
            .map(|p| match &p.message {
                Some(m) if !m.is_empty() => format!("{} (priority {}: {m})", p.id, p.priority),
                _ => format!("{} (priority {})", p.id, p.priority),
            })
            .collect();
        format!("frozen in favour of {}", names.join(", "))
    }
}

/// Decides for the operator `me` among `peers` (any entries of the peering object, including
/// its own and dead ones, which are ignored).
pub fn decide(me: &Peer, peers: &[Peer], now: SystemTime) -> Decision {
    let live = peers.iter().filter(|p| p.id != me.id && !p.is_dead(now));
    let mut blockers: Vec<Peer> = Vec::new();
    let mut conflicts: Vec<Peer> = Vec::new();
    for peer in live {
        if peer.priority > me.priority {
            blockers.push(peer.clone());
        } else if peer.priority == me.priority
            && !(me.lease.is_some() && peer.lease == me.lease)
            // Per-node operators share a priority by design; only the same node conflicts.
            && (me.node.is_none() || peer.node == me.node)
        {
            conflicts.push(peer.clone());
        }
    }
    blockers.sort_by(|a, b| b.priority.cmp(&a.priority).then_with(|| a.id.cmp(&b.id)));
    conflicts.sort_by(|a, b| a.id.cmp(&b.id));
    let revisit_at = blockers
        .iter()
        .chain(&conflicts)
        .filter_map(Peer::expires_at)
        .min();
    Decision {
        blockers,
        conflicts,
        revisit_at,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn per_node_operators_conflict_only_on_the_same_node() {
        let now = SystemTime::now();
        let node = |id: &str, n: &str| Peer {
            id: id.into(),
            priority: 0,
            lifetime: Duration::from_secs(60),
            lastseen: now,
            message: None,
            lease: None,
            node: Some(n.into()),
        };
        let me = node("me", "node-a");
        let d = decide(&me, &[node("other", "node-b"), node("twin", "node-a")], now);
        assert_eq!(
            d.conflicts.iter().map(|p| p.id.as_str()).collect::<Vec<_>>(),
            ["twin"]
        );
        assert!(!d.pause());
    }

    fn peer(id: &str, priority: i64, seen_ago: u64, lifetime: u64, now: SystemTime) -> Peer {
        Peer {
            id: id.into(),
            priority,
            lifetime: Duration::from_secs(lifetime),
            lastseen: now - Duration::from_secs(seen_ago),
            message: None,
            lease: None,
            node: None,
        }
    }

    #[test]
    fn a_higher_priority_peer_pauses() {
        let now = SystemTime::now();
        let me = peer("me", 0, 0, 60, now);
        let d = decide(&me, &[me.clone(), peer("dev", 666, 5, 60, now)], now);
        assert!(d.pause());
        assert_eq!(d.blockers[0].id, "dev");
        assert_eq!(d.revisit_at, Some(now + Duration::from_secs(55)));
        assert!(d.explain().contains("dev (priority 666)"));
    }

    #[test]
    fn dead_and_lower_peers_do_not_pause() {
        let now = SystemTime::now();
        let me = peer("me", 100, 0, 60, now);
        let d = decide(
            &me,
            &[
                peer("old-dev", 666, 61, 60, now),
                peer("edge", 666, 60, 60, now),
                peer("prod", 0, 1, 60, now),
            ],
            now,
        );
        assert!(!d.pause());
        assert!(d.conflicts.is_empty());
        assert_eq!(d.revisit_at, None);
    }

    #[test]
    fn same_priority_is_a_conflict_unless_both_share_a_lease() {
        let now = SystemTime::now();
        let mut me = peer("me", 0, 0, 60, now);
        let mut twin = peer("twin", 0, 1, 60, now);
        let d = decide(&me, std::slice::from_ref(&twin), now);
        assert!(!d.pause());
        assert_eq!(d.conflicts.len(), 1);
        me.lease = Some("ns/capstan".into());
        twin.lease = Some("ns/capstan".into());
        assert!(decide(&me, std::slice::from_ref(&twin), now).conflicts.is_empty());
        twin.lease = Some("ns/other".into());
        assert_eq!(decide(&me, &[twin], now).conflicts.len(), 1);
    }

    #[test]
    fn blockers_are_ordered_by_priority() {
        let now = SystemTime::now();
        let me = peer("me", 0, 0, 60, now);
        let d = decide(
            &me,
            &[peer("freeze", 100, 0, 30, now), peer("dev", 666, 0, 60, now)],
            now,
        );
        let ids: Vec<&str> = d.blockers.iter().map(|p| p.id.as_str()).collect();
        assert_eq!(ids, ["dev", "freeze"]);
        assert_eq!(d.revisit_at, Some(now + Duration::from_secs(30)));
    }
}
