//! The admin endpoint's connection slots: at most a fixed number of connections are open, and
//! a new one that finds them all taken sheds the oldest.
//!
//! Refusing new connections when full would let whoever opened the slots first keep the
//! kubelet's probes out for as long as they hold them; shedding the newest would do the same
//! to every probe that arrives during a flood. The oldest connection is the one most likely to
//! be idle or hostile — a probe or a scrape is answered within milliseconds of its arrival —
//! so it is the one to close; among the open connections, those that have not sent a byte yet
//! go first ([`Slot::heard`]), so that a flood of silent connections cannot shed a probe whose
//! request is being read.
//!
//! A new connection gets its slot only once the one it sheds has closed ([`Slots::take`]
//! waits), so the descriptors held stay within the cap however fast connections arrive; the
//! others wait in the listen backlog meanwhile.

use std::{collections::VecDeque, sync::Arc};

use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// The set of open connections. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Slots {
    inner: Arc<Mutex<Inner>>,
    /// Signalled whenever a slot is freed.
    freed: Arc<Notify>,
}

#[derive(Debug)]
struct Inner {
    capacity: usize,
    /// Taken slots, oldest first.
    open: VecDeque<Entry>,
    next: u64,
    /// How many connections were shed, ever.
    shed: u64,
}

#[derive(Debug)]
struct Entry {
    id: u64,
    shed: CancellationToken,
    /// The connection sent something.
    heard: bool,
}

/// One connection's slot: [`Slot::shed`] fires when a newer connection takes it; dropping the
/// slot frees it.
#[derive(Debug)]
pub struct Slot {
    id: u64,
    shed: CancellationToken,
    slots: Slots,
}

impl Slots {
    /// A set of `capacity` slots (at least one).
    pub fn new(capacity: usize) -> Self {
        Self {
            inner: Arc::new(Mutex::new(Inner {
                capacity: capacity.max(1),
                open: VecDeque::new(),
                next: 0,
                shed: 0,
            })),
            freed: Arc::new(Notify::new()),
        }
    }

    /// Takes a slot for a new connection. When all are taken, the oldest connection that has
    /// not sent anything (or else the oldest) is told to close ([`Slot::shed`]), and the slot
    /// is given once it has.
    pub async fn take(&self) -> Slot {
        loop {
            if let Some(slot) = self.try_take() {
                return slot;
            }
            self.freed.notified().await;
        }
    }

    /// A slot if one is free; otherwise sheds a connection (unless one is closing already).
    fn try_take(&self) -> Option<Slot> {
        let mut inner = self.inner.lock();
        if inner.open.len() < inner.capacity {
            let id = inner.next;
            inner.next += 1;
            let shed = CancellationToken::new();
            inner.open.push_back(Entry {
                id,
                shed: shed.clone(),
                heard: false,
            });
            return Some(Slot {
                id,
                shed,
                slots: self.clone(),
            });
        }
        let closing = inner.open.iter().any(|e| e.shed.is_cancelled());
        if !closing {
            let victim = inner
                .open
                .iter()
                .find(|e| !e.heard)
                .or_else(|| inner.open.front())
                .map(|e| e.shed.clone());
            if let Some(victim) = victim {
                victim.cancel();
                inner.shed += 1;
            }
        }
        None
    }

    /// How many slots are taken (connections that were shed count until they closed).
    pub fn taken(&self) -> usize {
        self.inner.lock().open.len()
    }

    /// How many connections were shed so far.
    pub fn shed(&self) -> u64 {
        self.inner.lock().shed
    }
}

impl Slot {
    /// Fires when a newer connection needs this slot: the connection must close now.
    pub async fn shed(&self) {
        self.shed.cancelled().await;
    }

    /// Records that the connection sent something: it is shed only after the silent ones.
    pub fn heard(&self) {
        let mut inner = self.slots.inner.lock();
        if let Some(entry) = inner.open.iter_mut().find(|e| e.id == self.id) {
            entry.heard = true;
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        {
            let mut inner = self.slots.inner.lock();
            // Ids are taken in order, so the open ones are sorted.
            if let Ok(at) = inner.open.binary_search_by_key(&self.id, |e| e.id) {
                inner.open.remove(at);
            }
        }
        self.slots.freed.notify_one();
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn taken_now(slots: &Slots) -> Option<Slot> {
        futures::FutureExt::now_or_never(slots.take())
    }

    #[tokio::test]
    async fn a_full_set_sheds_its_oldest_connection() {
        let slots = Slots::new(2);
        let first = slots.take().await;
        let second = slots.take().await;
        assert_eq!(slots.taken(), 2);

        // Full: the oldest is told to close, and the new connection waits until it has.
        let waiting = tokio::spawn({
            let slots = slots.clone();
            async move { slots.take().await }
        });
        tokio::time::timeout(Duration::from_secs(5), first.shed())
            .await
            .expect("the oldest is shed");
        assert!(!second.shed.is_cancelled(), "only one is shed");
        assert_eq!((slots.taken(), slots.shed()), (2, 1));
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "no slot before the shed one closed");
        drop(first);
        let third = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("a slot once the shed connection closed")
            .unwrap();
        assert_eq!(slots.taken(), 2);

        // A connection that ends frees its slot; a free slot sheds no one.
        drop(third);
        let fourth = taken_now(&slots).expect("a free slot");
        assert!(!second.shed.is_cancelled() && !fourth.shed.is_cancelled());
    }

    #[tokio::test]
    async fn silent_connections_are_shed_before_those_that_sent_something() {
        let slots = Slots::new(2);
        let probe = slots.take().await;
        let silent = slots.take().await;
        probe.heard();
        assert!(taken_now(&slots).is_none());
        assert!(silent.shed.is_cancelled() && !probe.shed.is_cancelled());
        // While it closes, no one else is shed.
        assert!(taken_now(&slots).is_none());
        assert!(!probe.shed.is_cancelled());
        assert_eq!(slots.shed(), 1);
    }
}
