//! Support for the fault-injection suite (`tests/tests/faults_*.rs`): its sizes (small enough
//! for CI by default, full with `CAPSTAN_FAULTS_LONG=1`, as `scripts/faults.sh --long` sets),
//! a seeded random source that each test prints so a failing run can be repeated
//! (`CAPSTAN_FAULTS_SEED`), the peak memory of a process, and the invariant that a handler is
//! called again for the same change only after a crash interrupted it.

use std::{collections::HashMap, path::Path};

use anyhow::{Result, bail};

/// Whether the long mode is on (`CAPSTAN_FAULTS_LONG=1`).
pub fn long() -> bool {
    std::env::var("CAPSTAN_FAULTS_LONG").is_ok_and(|v| v == "1" || v == "true")
}

/// `ci` in the default mode, `full` in the long mode.
pub fn size(ci: usize, full: usize) -> usize {
    if long() { full } else { ci }
}

/// A small seeded random source (xorshift64*), printed by the tests that use it.
pub struct Rng(u64);

impl Rng {
    /// Seeded from `CAPSTAN_FAULTS_SEED`, or from the clock; prints the seed.
    pub fn from_env(test: &str) -> Self {
        let seed = std::env::var("CAPSTAN_FAULTS_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(1, |d| d.as_nanos() as u64)
            })
            .max(1);
        println!("{test}: CAPSTAN_FAULTS_SEED={seed}");
        Self(seed)
    }

    /// Seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    /// The next number.
    pub fn draw(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A number in `low..high` (`low` when the range is empty).
    pub fn range(&mut self, low: u64, high: u64) -> u64 {
        if high <= low {
            low
        } else {
            low + self.draw() % (high - low)
        }
    }

    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.draw() % 100 < percent
    }
}

/// The peak resident set size of a process in KiB (`VmHWM` in `/proc/<pid>/status`).
pub fn peak_rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(Path::new("/proc").join(pid.to_string()).join("status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// Checks the handlers' call log (`(handler, object, attempt)` in order) against the crashes:
/// `crashes` holds, for each crash, how many calls had been logged when it happened. Every
/// call of a handler for an object after its first must follow a crash that happened after
/// the previous call (a finished handler is not called again unless a crash lost its result
/// before it was written), and attempt numbers of one handler for one object never go down.
/// `handlers` limits the check to handlers that run once per object.
pub fn check_repeats(calls: &[(String, String, u32)], crashes: &[usize], handlers: &[&str]) -> Result<()> {
    let mut last: HashMap<(&str, &str), (usize, u32)> = HashMap::new();
    for (i, (handler, object, attempt)) in calls.iter().enumerate() {
        if !handlers.contains(&handler.as_str()) {
            continue;
        }
        if let Some((previous, previous_attempt)) = last.get(&(handler.as_str(), object.as_str())) {
            if *attempt < *previous_attempt {
                bail!(
                    "{handler} for {object}: attempt {attempt} after attempt {previous_attempt} (calls {previous} and {i})"
                );
            }
            let explained = crashes.iter().any(|c| *c > *previous && *c <= i);
            if !explained && *attempt == *previous_attempt {
                bail!(
                    "{handler} was called again for {object} (calls {previous} and {i}, attempt {attempt}) \
                     with no crash in between"
                );
            }
        }
        last.insert((handler.as_str(), object.as_str()), (i, *attempt));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(h: &str, o: &str, a: u32) -> (String, String, u32) {
        (h.into(), o.into(), a)
    }

    #[test]
    fn repeats_need_a_crash_in_between() {
        let calls = vec![call("a", "x", 1), call("b", "x", 1), call("a", "x", 1)];
        assert!(check_repeats(&calls, &[], &["a"]).is_err());
        assert!(check_repeats(&calls, &[1], &["a"]).is_ok());
        assert!(check_repeats(&calls, &[3], &["a"]).is_err());
        // A retry (a higher attempt) needs no crash; a lower one is never right.
        assert!(check_repeats(&[call("a", "x", 1), call("a", "x", 2)], &[], &["a"]).is_ok());
        assert!(check_repeats(&[call("a", "x", 2), call("a", "x", 1)], &[1], &["a"]).is_err());
    }
}
