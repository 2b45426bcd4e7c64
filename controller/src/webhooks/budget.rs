//! The webhook server's memory budget: one count of bytes shared by every request in flight,
//! from the first byte of its body to its answer. A request reserves before it keeps anything
//! (the body as it arrives, then what its trees will cost before they are built); when the
//! budget is spent the request is refused at once (429, the API server retries or applies the
//! failure policy) rather than queued, and a request that alone needs more than the whole
//! budget is refused as too large (413).
//!
//! Reserved in KiB so that a budget of gigabytes still fits the semaphore's counts.

use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

/// Why a reservation failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// The request alone needs more than the whole budget.
    #[error("the request needs {needed} bytes, more than the whole budget of {budget} bytes")]
    TooLarge {
        /// What the request needs.
        needed: usize,
        /// The whole budget.
        budget: usize,
    },
    /// Other requests hold the budget now.
    #[error("the memory budget is spent by the requests in flight")]
    Spent,
}

/// The shared budget. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Budget {
    kib: Arc<Semaphore>,
    total_kib: usize,
}

/// What one request holds; returned to the budget when dropped.
#[derive(Debug)]
pub struct Reservation {
    budget: Budget,
    held: Option<OwnedSemaphorePermit>,
}

fn kib(bytes: usize) -> usize {
    bytes.div_ceil(1024)
}

impl Budget {
    /// A budget of `bytes` (at least 1 KiB).
    pub fn new(bytes: usize) -> Self {
        let total_kib = kib(bytes).clamp(1, Semaphore::MAX_PERMITS);
        Self {
            kib: Arc::new(Semaphore::new(total_kib)),
            total_kib,
        }
    }

    /// The whole budget in bytes.
    pub fn total(&self) -> usize {
        self.total_kib.saturating_mul(1024)
    }

    /// The bytes not reserved now.
    pub fn available(&self) -> usize {
        self.kib.available_permits().saturating_mul(1024)
    }

    /// An empty reservation, grown with [`Reservation::grow_to`].
    pub fn reservation(&self) -> Reservation {
        Reservation {
            budget: self.clone(),
            held: None,
        }
    }
}

impl Reservation {
    /// The bytes held.
    pub fn held(&self) -> usize {
        self.held
            .as_ref()
            .map_or(0, |p| p.num_permits().saturating_mul(1024))
    }

    /// Holds at least `bytes` in all, without waiting.
    ///
    /// # Errors
    /// [`Refusal::TooLarge`] when `bytes` is more than the whole budget, [`Refusal::Spent`]
    /// when other requests hold what is missing.
    pub fn grow_to(&mut self, bytes: usize) -> Result<(), Refusal> {
        let want = kib(bytes);
        if want > self.budget.total_kib {
            return Err(Refusal::TooLarge {
                needed: bytes,
                budget: self.budget.total(),
            });
        }
        let have = self.held.as_ref().map_or(0, OwnedSemaphorePermit::num_permits);
        if want <= have {
            return Ok(());
        }
        let more = u32::try_from(want - have).map_err(|_| Refusal::Spent)?;
        let permit = self
            .budget
            .kib
            .clone()
            .try_acquire_many_owned(more)
            .map_err(|_| Refusal::Spent)?;
        match self.held.as_mut() {
            Some(held) => held.merge(permit),
            None => self.held = Some(permit),
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reservations_share_the_budget_and_return_it_when_dropped() {
        let budget = Budget::new(100 << 10);
        let mut a = budget.reservation();
        a.grow_to(60 << 10).expect("fits");
        a.grow_to(10 << 10).expect("already held");
        assert_eq!(a.held(), 60 << 10);
        let mut b = budget.reservation();
        assert_eq!(b.grow_to(50 << 10), Err(Refusal::Spent));
        b.grow_to(40 << 10).expect("what is left");
        assert_eq!(budget.available(), 0);
        assert!(matches!(
            budget.reservation().grow_to(101 << 10),
            Err(Refusal::TooLarge { .. })
        ));
        drop(a);
        assert_eq!(budget.available(), 60 << 10);
        b.grow_to(100 << 10).expect("grown into what was returned");
        drop(b);
        assert_eq!(budget.available(), 100 << 10);
    }
}
