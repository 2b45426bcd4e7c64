//! The ring: which member owns which objects, computed the same way by every member.
//!
//! An object's place is the 64-bit FNV-1a hash of its `metadata.uid` — the hash Kubernetes'
//! sharded list and watch (KEP-5866, `shardRange(object.metadata.uid, '0x…', '0x…')`) uses,
//! so that the ranges below can be handed to a server that filters by them. Members own
//! ranges of that space by consistent hashing: each member places [`VIRTUAL_NODES`] tokens
//! (derived from the hash of its identity) on the circle and owns the arc that ends at each of its
//! tokens. A member joining takes about 1/n of every other member's arcs; a member leaving
//! gives its arcs to the next tokens' owners; nothing else moves.
//!
//! Members agree on the ring by agreeing on the set of identities; its [`Generation`] is a
//! fingerprint of that set, so two members can compare views without a counter anyone must
//! own. [`Ranges`] are half-open intervals of the space; a member's held set is an
//! intersection of assignments (see `sharding::handover`).

use std::collections::BTreeSet;

/// Tokens per member: with 512, the busiest of 2 to 4 members has at most about 6 % more than
/// 1/n of the space (with 256, 10 %: short of n members giving 0.9 × n × one member's
/// throughput), and a member's ranges stay within what a shard selector can carry for rings
/// of up to about 40 members (512 × (1 − 1/n) ranges).
pub const VIRTUAL_NODES: u32 = 512;

/// The top of the hash space (exclusive), as a bound.
const TOP: u128 = 1 << 64;

/// 64-bit FNV-1a of `bytes`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// A member's `i`-th token: its identity's hash and `i`, mixed by splitmix64's finalizer (FNV
/// alone spreads strings that differ in their last bytes poorly over the high bits, which
/// would make shares uneven).
fn token(base: u64, i: u32) -> u64 {
    let mut z = base.wrapping_add(u64::from(i).wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// An object's place in the space: the hash of its uid.
pub fn place(uid: &str) -> u64 {
    fnv1a64(uid.as_bytes())
}

/// A fingerprint of a ring's members: equal for equal sets, whatever the order they were seen in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Generation(pub u64);

impl std::fmt::Display for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl std::str::FromStr for Generation {
    type Err = std::num::ParseIntError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        u64::from_str_radix(s, 16).map(Self)
    }
}

/// Half-open intervals `[start, end)` of the hash space, sorted, disjoint and merged.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Ranges(Vec<(u128, u128)>);

impl Ranges {
    /// Nothing.
    pub fn none() -> Self {
        Self::default()
    }

    /// The whole space.
    pub fn all() -> Self {
        Self(vec![(0, TOP)])
    }

    /// From intervals in any order (empty ones dropped, overlapping ones merged).
    fn from_intervals(mut intervals: Vec<(u128, u128)>) -> Self {
        intervals.retain(|(s, e)| s < e);
        intervals.sort_unstable();
        let mut merged: Vec<(u128, u128)> = Vec::with_capacity(intervals.len());
        for (s, e) in intervals {
            match merged.last_mut() {
                Some(last) if s <= last.1 => last.1 = last.1.max(e),
                _ => merged.push((s, e)),
            }
        }
        Self(merged)
    }

    /// Whether `point` is in one of the intervals.
    pub fn contains(&self, point: u64) -> bool {
        let p = u128::from(point);
        let i = self.0.partition_point(|(_, e)| *e <= p);
        self.0.get(i).is_some_and(|(s, _)| *s <= p)
    }

    /// The points in both.
    pub fn intersect(&self, other: &Self) -> Self {
        let (mut i, mut j) = (0, 0);
        let mut out = Vec::new();
        while let (Some(a), Some(b)) = (self.0.get(i), other.0.get(j)) {
            let (s, e) = (a.0.max(b.0), a.1.min(b.1));
            if s < e {
                out.push((s, e));
            }
            if a.1 < b.1 {
                i += 1;
            } else {
                j += 1;
            }
        }
        Self(out)
    }

    /// The points of `self` not in `other`.
    pub fn minus(&self, other: &Self) -> Self {
        let mut out = Vec::new();
        for &(s, e) in &self.0 {
            let mut start = s;
            for &(os, oe) in &other.0 {
                if oe <= start || os >= e {
                    continue;
                }
                if os > start {
                    out.push((start, os));
                }
                start = start.max(oe);
            }
            if start < e {
                out.push((start, e));
            }
        }
        Self::from_intervals(out)
    }

    /// Whether there is no point.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The share of the space covered, from 0 to 1.
    #[allow(clippy::cast_precision_loss)]
    pub fn share(&self) -> f64 {
        let covered: u128 = self.0.iter().map(|(s, e)| e - s).sum();
        covered as f64 / TOP as f64
    }

    /// The intervals as KEP-5866's `shardRange` bounds (`0x…` hex, the end exclusive; the
    /// top of the space is `0x10000000000000000`).
    pub fn bounds(&self) -> impl Iterator<Item = (String, String)> + '_ {
        self.0
            .iter()
            .map(|(s, e)| (format!("0x{s:016x}"), format!("0x{e:016x}")))
    }

    /// How many intervals.
    pub fn len(&self) -> usize {
        self.0.len()
    }
}

/// A ring: a set of member identities and the assignment they imply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ring {
    members: BTreeSet<String>,
    /// Every token with its owner, sorted by token.
    tokens: Vec<(u64, usize)>,
}

impl Ring {
    /// The ring of `members` (identities; duplicates count once).
    pub fn new<I, S>(members: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let members: BTreeSet<String> = members.into_iter().map(Into::into).collect();
        let mut tokens: Vec<(u64, usize)> = members
            .iter()
            .enumerate()
            .flat_map(|(owner, id)| {
                let base = fnv1a64(id.as_bytes());
                (0..VIRTUAL_NODES).map(move |i| (token(base, i), owner))
            })
            .collect();
        // Equal tokens (astronomically unlikely) go to the lower identity, the same everywhere.
        tokens.sort_unstable();
        tokens.dedup_by_key(|(t, _)| *t);
        Self { members, tokens }
    }

    /// The members, sorted.
    pub fn members(&self) -> impl Iterator<Item = &str> {
        self.members.iter().map(String::as_str)
    }

    /// How many members.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether the ring has no member.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Whether `identity` is a member.
    pub fn has(&self, identity: &str) -> bool {
        self.members.contains(identity)
    }

    /// The fingerprint of the member set.
    pub fn generation(&self) -> Generation {
        let joined = self
            .members
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>()
            .join("\n");
        Generation(fnv1a64(joined.as_bytes()))
    }

    /// The member that owns `point`; `None` for an empty ring.
    pub fn owner(&self, point: u64) -> Option<&str> {
        let i = self.tokens.partition_point(|(t, _)| *t < point);
        let (_, owner) = self.tokens.get(i).or_else(|| self.tokens.first())?;
        self.members.iter().nth(*owner).map(String::as_str)
    }

    /// The owner of the object with `uid`.
    pub fn owner_of(&self, uid: &str) -> Option<&str> {
        self.owner(place(uid))
    }

    /// What `identity` owns: the arcs ending at its tokens (nothing when not a member).
    pub fn assigned(&self, identity: &str) -> Ranges {
        let Some(me) = self.members.iter().position(|m| m == identity) else {
            return Ranges::none();
        };
        let Some(&(last, _)) = self.tokens.last() else {
            return Ranges::none();
        };
        let mut intervals = Vec::new();
        let mut previous = u128::from(last);
        for (i, &(token, owner)) in self.tokens.iter().enumerate() {
            let end = u128::from(token) + 1;
            if owner == me {
                if i == 0 {
                    // The first token also owns the wrap-around: after the last token.
                    intervals.push((previous + 1, TOP));
                    intervals.push((0, end));
                } else {
                    intervals.push((previous + 1, end));
                }
            }
            previous = u128::from(token);
        }
        Ranges::from_intervals(intervals)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a64_is_the_standard_hash() {
        // The published test vectors of FNV-1a, 64 bits.
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    fn uids(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| format!("{:08x}-1b2c-4d5e-8f90-{:012x}", i * 7919, i))
            .collect()
    }

    #[test]
    fn every_point_has_exactly_one_owner_whose_ranges_hold_it() {
        let ring = Ring::new(["a", "b", "c"]);
        let assigned: Vec<(String, Ranges)> =
            ring.members().map(|m| (m.to_owned(), ring.assigned(m))).collect();
        let total: f64 = assigned.iter().map(|(_, r)| r.share()).sum();
        assert!((total - 1.0).abs() < 1e-9, "{total}");
        for uid in uids(2000) {
            let owner = ring.owner_of(&uid).expect("an owner");
            let holders: Vec<&str> = assigned
                .iter()
                .filter(|(_, r)| r.contains(place(&uid)))
                .map(|(m, _)| m.as_str())
                .collect();
            assert_eq!(holders, vec![owner], "{uid}");
        }
        for edge in [0, u64::MAX] {
            let holders = assigned.iter().filter(|(_, r)| r.contains(edge)).count();
            assert_eq!(holders, 1, "{edge:x}");
        }
    }

    #[test]
    fn shares_are_balanced() {
        for n in 1..=6 {
            let names: Vec<String> = (0..n).map(|i| format!("capstan-7d9f8c-{i}")).collect();
            let ring = Ring::new(names.clone());
            for m in &names {
                let share = ring.assigned(m).share() * f64::from(n);
                assert!((0.88..=1.12).contains(&share), "{m} of {n}: {share}");
            }
        }
    }

    #[test]
    fn a_member_joining_moves_only_what_it_takes() {
        let before = Ring::new(["a", "b", "c"]);
        let after = Ring::new(["a", "b", "c", "d"]);
        let mut moved = 0;
        for uid in uids(4000) {
            let (was, is) = (before.owner_of(&uid), after.owner_of(&uid));
            if was != is {
                assert_eq!(is, Some("d"), "only the newcomer gains");
                moved += 1;
            }
        }
        assert!((800..=1200).contains(&moved), "about a quarter moves: {moved}");
    }

    #[test]
    fn generations_fingerprint_the_member_set() {
        assert_eq!(
            Ring::new(["b", "a"]).generation(),
            Ring::new(["a", "b", "a"]).generation()
        );
        assert_ne!(
            Ring::new(["a", "b"]).generation(),
            Ring::new(["a", "c"]).generation()
        );
        let g = Ring::new(["a"]).generation();
        assert_eq!(g.to_string().parse::<Generation>(), Ok(g));
    }

    #[test]
    fn ranges_intersect_and_subtract() {
        let a = Ranges::from_intervals(vec![(0, 10), (20, 30)]);
        let b = Ranges::from_intervals(vec![(5, 25)]);
        assert_eq!(a.intersect(&b), Ranges::from_intervals(vec![(5, 10), (20, 25)]));
        assert_eq!(a.minus(&b), Ranges::from_intervals(vec![(0, 5), (25, 30)]));
        assert!(a.contains(0) && a.contains(9) && !a.contains(10) && a.contains(29));
        assert!(Ranges::all().contains(u64::MAX) && !Ranges::none().contains(0));
        assert_eq!(
            Ranges::all().bounds().collect::<Vec<_>>(),
            vec![("0x0000000000000000".into(), "0x10000000000000000".into())]
        );
    }

    #[test]
    fn an_empty_ring_assigns_nothing() {
        let ring = Ring::new(Vec::<String>::new());
        assert_eq!(ring.owner(5), None);
        assert!(ring.assigned("a").is_empty());
        assert_eq!(Ring::new(["a"]).assigned("a"), Ranges::all());
    }
}
