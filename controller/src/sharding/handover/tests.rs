use std::collections::BTreeMap;

use super::*;
use crate::{grpc::Hub, peering::gate::NoHooks};

/// Member Leases in memory, with versions and conditional writes like the API server's.
#[derive(Default)]
struct Leases {
    leases: Mutex<BTreeMap<String, Member>>,
    next: Mutex<u64>,
    /// Identities whose requests fail (a member cut off from the API server).
    cut_off: Mutex<Vec<String>>,
}

/// One member's view of the shared leases.
struct Client {
    leases: Arc<Leases>,
    me: String,
}

impl Client {
    fn check(&self) -> Result<(), members::Error> {
        if self.leases.cut_off.lock().contains(&self.me) {
            return Err(members::Error::Conflict);
        }
        Ok(())
    }
}

impl Store for Client {
    fn list(&self) -> BoxFuture<'_, Result<Vec<Member>, members::Error>> {
        Box::pin(async move {
            self.check()?;
            Ok(self.leases.leases.lock().values().cloned().collect())
        })
    }

    fn write<'a>(&'a self, record: &'a Member) -> BoxFuture<'a, Result<Member, members::Error>> {
        Box::pin(async move {
            self.check()?;
            let mut leases = self.leases.leases.lock();
            let current = leases.get(&record.lease).map(|m| m.version.clone());
            if current.unwrap_or_default() != record.version {
                return Err(members::Error::Conflict);
            }
            let mut next = self.leases.next.lock();
            *next += 1;
            let written = Member {
                version: next.to_string(),
                ..record.clone()
            };
            leases.insert(record.lease.clone(), written.clone());
            Ok(written)
        })
    }

    fn delete<'a>(&'a self, record: &'a Member) -> BoxFuture<'a, Result<(), members::Error>> {
        Box::pin(async move {
            self.check()?;
            let mut leases = self.leases.leases.lock();
            if leases
                .get(&record.lease)
                .is_some_and(|m| m.version == record.version)
            {
                leases.remove(&record.lease);
            }
            Ok(())
        })
    }

    fn lease_name(&self, identity: &str) -> String {
        format!("ring-member-{identity}")
    }
}

fn settings() -> Settings {
    Settings {
        enabled: true,
        lease_duration: Duration::from_secs(6),
        renew_deadline: Duration::from_secs(4),
        retry_period: Duration::from_secs(1),
        settle: Duration::from_secs(2),
        ..Settings::default()
    }
}

/// A member with its own gate, driven as in the controller (an idle hub drains at once).
struct Node {
    handover: Handover,
    shard: Shard,
    gate: Gate,
    stop: CancellationToken,
}

impl Node {
    fn new(leases: &Arc<Leases>, me: &str) -> Self {
        let gate = Gate::new();
        let stop = CancellationToken::new();
        tokio::spawn(gate.clone().drive(
            Hub::default(),
            Duration::from_secs(5),
            Arc::new(NoHooks),
            stop.clone(),
        ));
        let shard = Shard::new();
        let store = Arc::new(Client {
            leases: leases.clone(),
            me: me.to_owned(),
        });
        let handover = Handover::new(settings(), me.to_owned(), store, gate.clone(), shard.clone());
        Self {
            handover,
            shard,
            gate,
            stop,
        }
    }

    /// A ring of two members, `a` and `b`, that has settled (both gates open).
    async fn settled_pair(leases: &Arc<Leases>) -> (Self, Self) {
        let mut a = Self::new(leases, "a");
        let mut b = Self::new(leases, "b");
        assert!(
            rounds(&mut [&mut a, &mut b], 60, all_open).await,
            "the ring of two did not settle"
        );
        (a, b)
    }

    /// Handling: holds ranges and the gate is open.
    fn handling(&self) -> Ranges {
        if self.gate.is_paused() {
            Ranges::none()
        } else {
            (*self.shard.held()).clone()
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

/// Whether every member's gate is open (no hand-over under way).
fn all_open(nodes: &[&mut Node]) -> bool {
    nodes.iter().all(|n| !n.gate.is_paused())
}

/// Runs rounds of every live member, 250 ms apart, checking after each member's round that
/// no two members hold a common range; returns when `done` or after `rounds`.
async fn rounds(nodes: &mut [&mut Node], rounds: usize, done: impl Fn(&[&mut Node]) -> bool) -> bool {
    for _ in 0..rounds {
        for i in 0..nodes.len() {
            nodes[i].handover.tick().await;
            for _ in 0..20 {
                tokio::task::yield_now().await;
            }
            for a in 0..nodes.len() {
                for b in (a + 1)..nodes.len() {
                    let (x, y) = (nodes[a].shard.held(), nodes[b].shard.held());
                    assert!(
                        x.intersect(&y).is_empty(),
                        "members {a} and {b} hold a common range"
                    );
                }
            }
        }
        if done(nodes) {
            return true;
        }
        tokio::time::sleep(HANDOVER_POLL).await;
    }
    false
}

fn share(ranges: &Ranges) -> f64 {
    ranges.share()
}

#[tokio::test(start_paused = true)]
async fn a_lone_member_takes_everything() {
    let leases = Arc::new(Leases::default());
    let mut a = Node::new(&leases, "a");
    assert!(a.gate.is_paused(), "nothing is handled before the ring is known");
    let ok = rounds(&mut [&mut a], 20, |n| n[0].handling() == Ranges::all()).await;
    assert!(ok, "a did not take the whole space");
    assert_eq!(a.handover.status().lock().members, vec!["a".to_owned()]);
}

#[tokio::test(start_paused = true)]
async fn a_newcomer_takes_its_share_only_after_the_old_owner_let_go() {
    let leases = Arc::new(Leases::default());
    let mut a = Node::new(&leases, "a");
    assert!(rounds(&mut [&mut a], 20, |n| n[0].handling() == Ranges::all()).await);
    let moves = a.handover.status().lock().moves;
    let mut b = Node::new(&leases, "b");
    let settled = rounds(&mut [&mut a, &mut b], 60, |n| {
        !n[0].gate.is_paused()
            && !n[1].gate.is_paused()
            && (share(&n[0].handling()) + share(&n[1].handling()) - 1.0).abs() < 1e-9
    })
    .await;
    assert!(settled, "the ring of two did not settle");
    let (sa, sb) = (share(&a.handling()), share(&b.handling()));
    assert!(sa > 0.3 && sb > 0.3, "{sa} {sb}");
    assert_eq!(
        a.handover.status().lock().moves,
        moves + 1,
        "a gave ranges away once"
    );
}

#[tokio::test(start_paused = true)]
async fn a_member_that_leaves_hands_over_at_once() {
    let leases = Arc::new(Leases::default());
    let (mut a, mut b) = Node::settled_pair(&leases).await;
    b.handover.leave().await;
    let started = Instant::now();
    assert!(rounds(&mut [&mut a], 20, |n| n[0].handling() == Ranges::all()).await);
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test(start_paused = true)]
async fn a_cut_off_member_fences_itself_before_the_others_take_over() {
    let leases = Arc::new(Leases::default());
    let (mut a, mut b) = Node::settled_pair(&leases).await;
    leases.cut_off.lock().push("b".into());
    // Both keep running; the invariant is checked after every round (b still holds what it
    // held until it fences; a must not widen before that).
    let mut fenced_at = None;
    let mut taken_at = None;
    let start = Instant::now();
    for _ in 0..80 {
        b.handover.tick().await;
        a.handover.tick().await;
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        if fenced_at.is_none() && b.shard.held().is_empty() {
            fenced_at = Some(start.elapsed());
        }
        if taken_at.is_none() && *a.shard.held() == Ranges::all() {
            taken_at = Some(start.elapsed());
        }
        assert!(
            a.shard.held().intersect(&b.shard.held()).is_empty(),
            "a took ranges b still held"
        );
        tokio::time::sleep(HANDOVER_POLL).await;
    }
    let (fenced, taken) = (fenced_at.expect("b fenced"), taken_at.expect("a took over"));
    assert!(fenced < taken, "fenced at {fenced:?}, taken at {taken:?}");
    assert!(taken < Duration::from_secs(9), "{taken:?}");
    assert!(b.handover.status().lock().fenced);
}

#[tokio::test(start_paused = true)]
async fn members_that_see_different_rings_wait_for_each_other() {
    let leases = Arc::new(Leases::default());
    let (mut a, mut b) = Node::settled_pair(&leases).await;
    // A third member: a counts it after the settle time, b does not run meanwhile (a stale
    // view). Until b sees the new ring too, b keeps its old ranges and neither a nor c may
    // widen into them.
    let mut c = Node::new(&leases, "c");
    c.handover.tick().await;
    for _ in 0..20 {
        a.handover.tick().await;
        c.handover.tick().await;
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        let (ha, hb, hc) = (a.shard.held(), b.shard.held(), c.shard.held());
        assert!(ha.intersect(&hb).is_empty() && hb.intersect(&hc).is_empty() && ha.intersect(&hc).is_empty());
        tokio::time::sleep(HANDOVER_POLL).await;
    }
    assert!(
        rounds(&mut [&mut a, &mut b, &mut c], 80, all_open).await,
        "the ring of three did not settle"
    );
    let total: f64 = [&a, &b, &c].iter().map(|n| share(&n.handling())).sum();
    assert!((total - 1.0).abs() < 1e-9, "{total}");
}

#[tokio::test(start_paused = true)]
async fn a_second_process_with_the_same_identity_waits_until_the_first_is_gone() {
    let leases = Arc::new(Leases::default());
    let mut a = Node::new(&leases, "a");
    assert!(rounds(&mut [&mut a], 20, |n| n[0].handling() == Ranges::all()).await);
    let mut twin = Node::new(&leases, "a");
    // Both run: the twin never takes the live Lease of the first, and holds nothing.
    assert!(!rounds(&mut [&mut a, &mut twin], 30, |n| !n[1].shard.held().is_empty()).await);
    assert_eq!(*a.shard.held(), Ranges::all(), "the first keeps its ranges");
    assert!(twin.handover.status().lock().fenced);
    // The first dies: once its Lease expired, the twin takes over.
    assert!(rounds(&mut [&mut twin], 60, |n| n[0].handling() == Ranges::all()).await);
}
