//! The webhook server's connection slots: a fixed number of connections held at once, and when
//! all are taken a new connection takes the slot of the one idle the longest, which is closed.
//! A connection is busy only while one of its reviews is with the handlers; waiting for a
//! header, reading a body or idling between requests is idle, so that connections that hold a
//! slot without asking anything cannot keep the API server's calls out (they would otherwise
//! wait in the listen backlog until their timeout, and the webhook's failure policy would
//! decide every covered write).
//!
//! Only when every slot is busy does a new connection wait, for the first to become idle.

use std::{collections::HashMap, sync::Arc};

use parking_lot::Mutex;
use tokio::{sync::Notify, time::Instant};
use tokio_util::sync::CancellationToken;

/// The slots of one server.
#[derive(Debug)]
pub struct Slots {
    max: usize,
    state: Mutex<State>,
    freed: Notify,
}

#[derive(Debug, Default)]
struct State {
    next: u64,
    held: HashMap<u64, Entry>,
}

#[derive(Debug)]
struct Entry {
    idle_since: Instant,
    busy: usize,
    close: CancellationToken,
}

/// One connection's slot; freed when dropped.
#[derive(Debug)]
pub struct Slot {
    id: u64,
    slots: Arc<Slots>,
    close: CancellationToken,
}

/// A review with the handlers; the connection is idle again when the last one is dropped.
#[derive(Debug)]
pub struct Busy {
    id: u64,
    slots: Arc<Slots>,
}

impl Slots {
    /// `max` slots (at least one).
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max: max.max(1),
            state: Mutex::new(State::default()),
            freed: Notify::new(),
        })
    }

    /// The connections held now.
    pub fn len(&self) -> usize {
        self.state.lock().held.len()
    }

    /// Whether no connection is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A slot for a new connection: a free one, or the one of the connection idle the longest
    /// (which is told to close); waits only while every slot is busy.
    pub async fn take(self: &Arc<Self>) -> Slot {
        loop {
            let freed = self.freed.notified();
            if let Some(slot) = self.try_take() {
                return slot;
            }
            freed.await;
        }
    }

    fn try_take(self: &Arc<Self>) -> Option<Slot> {
        let mut state = self.state.lock();
        if state.held.len() >= self.max {
            let (&oldest, _) = state
                .held
                .iter()
                .filter(|(_, e)| e.busy == 0)
                .min_by_key(|(_, e)| e.idle_since)?;
            if let Some(evicted) = state.held.remove(&oldest) {
                evicted.close.cancel();
            }
        }
        let id = state.next;
        state.next += 1;
        let close = CancellationToken::new();
        state.held.insert(
            id,
            Entry {
                idle_since: Instant::now(),
                busy: 0,
                close: close.clone(),
            },
        );
        Some(Slot {
            id,
            slots: self.clone(),
            close,
        })
    }

    fn release(&self, id: u64) {
        if self.state.lock().held.remove(&id).is_some() {
            self.freed.notify_waiters();
        }
    }

    fn idle(&self, id: u64) {
        let mut state = self.state.lock();
        if let Some(entry) = state.held.get_mut(&id) {
            entry.busy = entry.busy.saturating_sub(1);
            entry.idle_since = Instant::now();
            if entry.busy == 0 {
                drop(state);
                self.freed.notify_waiters();
            }
        }
    }
}

impl Slot {
    /// Cancelled when the slot was given to a newer connection: close this one.
    pub fn closed(&self) -> CancellationToken {
        self.close.clone()
    }

    /// A handle that marks the connection busy.
    pub fn marker(&self) -> Marker {
        Marker {
            id: self.id,
            slots: self.slots.clone(),
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.slots.release(self.id);
    }
}

/// Marks its connection busy while a review is with the handlers. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Marker {
    id: u64,
    slots: Arc<Slots>,
}

impl Marker {
    /// Busy until the returned guard is dropped.
    pub fn busy(&self) -> Busy {
        if let Some(entry) = self.slots.state.lock().held.get_mut(&self.id) {
            entry.busy += 1;
        }
        Busy {
            id: self.id,
            slots: self.slots.clone(),
        }
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.slots.idle(self.id);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_full_server_closes_the_longest_idle_connection_and_never_a_busy_one() {
        let slots = Slots::new(3);
        let a = slots.take().await;
        tokio::time::advance(Duration::from_secs(1)).await;
        let b = slots.take().await;
        tokio::time::advance(Duration::from_secs(1)).await;
        let c = slots.take().await;
        let busy = a.marker().busy();
        // Full: b (idle the longest of those not busy) gives way.
        let d = slots.take().await;
        assert!(b.closed().is_cancelled());
        assert!(!a.closed().is_cancelled());
        assert_eq!(slots.len(), 3);
        drop(b);
        assert_eq!(slots.len(), 3, "the evicted slot was already given away");
        // a is idle again (and now the newest idle): c goes next.
        tokio::time::advance(Duration::from_secs(1)).await;
        drop(busy);
        let _e = slots.take().await;
        assert!(c.closed().is_cancelled());
        assert!(!a.closed().is_cancelled() && !d.closed().is_cancelled());
    }

    #[tokio::test(start_paused = true)]
    async fn when_every_slot_is_busy_a_new_connection_waits_for_one_to_be_idle() {
        let slots = Slots::new(1);
        let a = slots.take().await;
        let busy = a.marker().busy();
        let waiting = tokio::spawn({
            let slots = slots.clone();
            async move { slots.take().await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished());
        drop(busy);
        let b = waiting.await.expect("a slot");
        assert!(a.closed().is_cancelled());
        assert!(!b.closed().is_cancelled());
    }
}
