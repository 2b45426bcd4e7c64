//! The webhook server's connection slots: a fixed number of connections held at once, and when
//! all are taken a new connection takes the slot of another, which is closed. A connection is
//! in one of three states:
//! - **idle**: in its TLS handshake, waiting for a request head, or kept alive between requests;
//! - **reading**: a request head has arrived and its body is being read (bounded by the body
//!   deadlines);
//! - **busy**: one of its reviews is with the handlers.
//!
//! Idle connections that were never answered give way first (the longest idle first), then
//! those answered before (the API server keeps its connections alive between calls); only
//! when none is idle does the one reading the longest, and a busy one never does. So
//! connections that hold a slot without asking anything cannot keep the API server's calls out
//! (they would otherwise wait in the listen backlog until their timeout, and the webhook's
//! failure policy would decide every covered write), and a flood of new connections cannot
//! shed a call whose body is on its way while silent connections are held. Only when every slot is busy does a new connection wait, for
//! the first to be no longer busy.

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
    /// When the connection last changed state.
    since: Instant,
    /// Requests read or answered now (a request is counted from its head to its answer).
    reading: usize,
    /// Reviews with the handlers now.
    busy: usize,
    /// Whether a request of this connection was answered.
    answered: bool,
    close: CancellationToken,
}

impl Entry {
    /// The order in which connections give way: idle before reading, never answered before
    /// answered, then the longest first.
    fn shedding_order(&self) -> (bool, bool, Instant) {
        (self.reading > 0, self.answered, self.since)
    }
}

/// One connection's slot; freed when dropped.
#[derive(Debug)]
pub struct Slot {
    id: u64,
    slots: Arc<Slots>,
    close: CancellationToken,
}

/// A review with the handlers; the connection is no longer busy when the last one is dropped.
#[derive(Debug)]
pub struct Busy {
    id: u64,
    slots: Arc<Slots>,
}

/// A request being read or answered; the connection is idle again when the last one is
/// dropped.
#[derive(Debug)]
pub struct Reading {
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

    /// A slot for a new connection: a free one, or the one of the connection that gives way
    /// first (idle the longest, else reading the longest; it is told to close); waits only
    /// while every slot is busy.
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
                .min_by_key(|(_, e)| e.shedding_order())?;
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
                since: Instant::now(),
                reading: 0,
                busy: 0,
                answered: false,
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

    /// Counts one more request (`reading`) or review (`busy`) on a connection.
    fn enter(&self, id: u64, busy: bool) {
        if let Some(entry) = self.state.lock().held.get_mut(&id) {
            if busy {
                entry.busy += 1;
            } else {
                entry.reading += 1;
            }
            entry.since = Instant::now();
        }
    }

    /// Counts one request or review less; a connection no longer busy may give way, so a
    /// waiting new connection is woken.
    fn leave(&self, id: u64, busy: bool) {
        let mut state = self.state.lock();
        if let Some(entry) = state.held.get_mut(&id) {
            let count = if busy {
                &mut entry.busy
            } else {
                entry.answered = true;
                &mut entry.reading
            };
            *count = count.saturating_sub(1);
            entry.since = Instant::now();
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

    /// A handle that marks the connection reading or busy.
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

/// Marks its connection reading while a request is read or answered, and busy while a review
/// is with the handlers. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Marker {
    id: u64,
    slots: Arc<Slots>,
}

impl Marker {
    /// Reading until the returned guard is dropped.
    pub fn reading(&self) -> Reading {
        self.slots.enter(self.id, false);
        Reading {
            id: self.id,
            slots: self.slots.clone(),
        }
    }

    /// Busy until the returned guard is dropped.
    pub fn busy(&self) -> Busy {
        self.slots.enter(self.id, true);
        Busy {
            id: self.id,
            slots: self.slots.clone(),
        }
    }
}

impl Drop for Reading {
    fn drop(&mut self) {
        self.slots.leave(self.id, false);
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.slots.leave(self.id, true);
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
        tokio::time::advance(Duration::from_secs(1)).await;
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
    async fn a_connection_reading_its_request_gives_way_only_after_every_idle_one() {
        let slots = Slots::new(3);
        let legitimate = slots.take().await;
        let reading = legitimate.marker().reading();
        tokio::time::advance(Duration::from_secs(1)).await;
        let silent = slots.take().await;
        tokio::time::advance(Duration::from_secs(1)).await;
        let _also_silent = slots.take().await;
        // A flood of new connections: each sheds a silent one, never the one reading.
        let mut flood = Vec::new();
        for _ in 0..10 {
            tokio::time::advance(Duration::from_millis(10)).await;
            flood.push(slots.take().await);
        }
        assert!(silent.closed().is_cancelled());
        assert!(!legitimate.closed().is_cancelled());
        assert_eq!(slots.len(), 3);
        // Once its request is answered it is idle again, kept alive as the API server keeps
        // its connections: the silent ones still give way first.
        tokio::time::advance(Duration::from_millis(10)).await;
        drop(reading);
        for _ in 0..10 {
            tokio::time::advance(Duration::from_millis(10)).await;
            flood.push(slots.take().await);
            assert!(!legitimate.closed().is_cancelled());
        }
        // Among answered connections, the one idle the longest goes first.
        let other = flood.pop().expect("a connection");
        drop(other.marker().reading());
        tokio::time::advance(Duration::from_millis(10)).await;
        let third = slots.take().await;
        assert!(!other.closed().is_cancelled() && !legitimate.closed().is_cancelled());
        let _third_reading = third.marker().reading();
        let _fourth = slots.take().await;
        assert!(legitimate.closed().is_cancelled() && !other.closed().is_cancelled());
    }

    #[tokio::test(start_paused = true)]
    async fn when_only_reading_connections_are_left_the_one_reading_the_longest_gives_way() {
        let slots = Slots::new(2);
        let trickling = slots.take().await;
        let _trickle = trickling.marker().reading();
        tokio::time::advance(Duration::from_secs(1)).await;
        let later = slots.take().await;
        let _later = later.marker().reading();
        let _new = slots.take().await;
        assert!(trickling.closed().is_cancelled());
        assert!(!later.closed().is_cancelled());
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
