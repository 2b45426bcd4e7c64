//! Turns log records and handler outcomes into Kubernetes Events without flooding the API.
//!
//! A failing handler retried every second must not create an Event every second. Events are
//! therefore aggregated — the same reason and message for the same object within a window
//! bumps the count of the Event already posted (written at most every few seconds) — and
//! rate-limited per object and globally with token buckets; what exceeds the limits is
//! dropped and counted in the log. Posting never blocks processing: records go through a
//! bounded queue to one background task.

use std::{collections::HashMap, time::Duration};

use tokio::{
    sync::{broadcast, mpsc},
    time::Instant,
};
use tokio_util::sync::CancellationToken;
use tracing::{debug, warn};

use crate::{
    k8s::events::{Events, Posted},
    model::{Level, Policy, Posting},
};

/// How Events are posted.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Post Events at all. Default on.
    pub enabled: bool,
    /// The lowest level of records posted by default. Default info.
    pub level: Level,
    /// Events one object may get in a burst. Default 10.
    pub burst: u32,
    /// One more Event per object per this interval after a burst. Default 10 s.
    pub refill: Duration,
    /// Events per second across all objects. Default 20.
    pub global_per_second: u32,
    /// Repeats within this window bump the first Event's count. Default 10 min.
    pub window: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            enabled: true,
            level: Level::Info,
            burst: 10,
            refill: Duration::from_secs(10),
            global_per_second: 20,
            window: Duration::from_secs(600),
        }
    }
}

/// A handle for submitting postings. Cheap to clone.
#[derive(Clone)]
pub struct Poster {
    tx: Option<mpsc::Sender<Posting>>,
}

impl Poster {
    /// A poster that posts nothing (Events off).
    pub fn disabled() -> Self {
        Self { tx: None }
    }

    /// Submits a posting; dropped when the queue is full.
    pub fn post(&self, posting: Posting) {
        if let Some(tx) = &self.tx
            && tx.try_send(posting).is_err()
        {
            debug!("event queue full; an event was dropped");
        }
    }

    /// Starts the posting task; it also takes the handler processes' records from `records`.
    pub fn spawn(
        events: Events,
        settings: Settings,
        mut records: broadcast::Receiver<Posting>,
        cancel: CancellationToken,
    ) -> Self {
        if !settings.enabled {
            return Self::disabled();
        }
        let (tx, mut rx) = mpsc::channel::<Posting>(1024);
        tokio::spawn(async move {
            let mut state = State::new(settings);
            let mut flush = tokio::time::interval(Duration::from_secs(5));
            loop {
                let posting = tokio::select! {
                    () = cancel.cancelled() => break,
                    p = rx.recv() => match p { Some(p) => p, None => break },
                    r = records.recv() => match r {
                        Ok(p) => p,
                        Err(broadcast::error::RecvError::Lagged(n)) => { debug!(lost = n, "handler log records lost for events"); continue }
                        Err(broadcast::error::RecvError::Closed) => break,
                    },
                    _ = flush.tick() => {
                        state.flush(&events).await;
                        continue;
                    }
                };
                state.submit(&events, posting).await;
            }
            state.flush(&events).await;
        });
        Self { tx: Some(tx) }
    }
}

struct Bucket {
    tokens: f64,
    at: Instant,
}

impl Bucket {
    fn take(&mut self, capacity: f64, per_second: f64) -> bool {
        let now = Instant::now();
        self.tokens = (self.tokens + now.duration_since(self.at).as_secs_f64() * per_second).min(capacity);
        self.at = now;
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

struct Recent {
    posted: Posted,
    count: u32,
    written: u32,
    first: Instant,
}

struct State {
    settings: Settings,
    objects: HashMap<String, Bucket>,
    global: Bucket,
    /// Recently posted Events by object uid, type, reason and message.
    recent: HashMap<(String, String, String, String), Recent>,
    dropped: u64,
    last_report: Instant,
}

impl State {
    fn new(settings: Settings) -> Self {
        let global = Bucket {
            tokens: f64::from(settings.global_per_second),
            at: Instant::now(),
        };
        Self {
            settings,
            objects: HashMap::new(),
            global,
            recent: HashMap::new(),
            dropped: 0,
            last_report: Instant::now(),
        }
    }

    /// Whether a record is to be posted at all.
    fn wanted(&self, posting: &Posting) -> bool {
        match posting.policy {
            Policy::Always => true,
            Policy::Never => false,
            Policy::ByLevel => posting.level >= self.settings.level && posting.level > Level::Debug,
        }
    }

    async fn submit(&mut self, events: &Events, posting: Posting) {
        if !self.wanted(&posting) {
            return;
        }
        let key = (
            posting.object.uid.clone(),
            posting.type_name().to_owned(),
            posting.reason.clone(),
            posting.message.clone(),
        );
        if let Some(recent) = self.recent.get_mut(&key)
            && recent.first.elapsed() < self.settings.window
        {
            recent.count += 1;
            return;
        }
        let refill = 1.0 / self.settings.refill.as_secs_f64().max(0.001);
        let burst = f64::from(self.settings.burst.max(1));
        let bucket = self
            .objects
            .entry(posting.object.uid.clone())
            .or_insert_with(|| Bucket {
                tokens: burst,
                at: Instant::now(),
            });
        let global_rate = f64::from(self.settings.global_per_second.max(1));
        if !bucket.take(burst, refill) || !self.global.take(global_rate, global_rate) {
            self.dropped += 1;
            if self.last_report.elapsed() > Duration::from_secs(60) {
                warn!(dropped = self.dropped, "events dropped by rate limiting");
                self.last_report = Instant::now();
            }
            return;
        }
        match events.create(&posting).await {
            Ok(posted) => {
                self.recent.insert(
                    key,
                    Recent {
                        posted,
                        count: 1,
                        written: 1,
                        first: Instant::now(),
                    },
                );
            }
            Err(e) => debug!(error = %e, object = %posting.object, "posting an event failed"),
        }
    }

    /// Writes the counts of repeated Events and forgets old ones.
    async fn flush(&mut self, events: &Events) {
        for recent in self.recent.values_mut().filter(|r| r.count > r.written) {
            match events.bump(&recent.posted, recent.count).await {
                Ok(()) => recent.written = recent.count,
                Err(e) => debug!(error = %e, "updating an event's count failed"),
            }
        }
        let window = self.settings.window;
        self.recent
            .retain(|_, r| r.first.elapsed() < window || r.count > r.written);
        let refill = self.settings.refill * self.settings.burst.max(1);
        self.objects.retain(|_, b| b.at.elapsed() < refill);
    }
}
