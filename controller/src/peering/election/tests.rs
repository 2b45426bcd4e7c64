use std::sync::atomic::{AtomicBool, Ordering};

use super::*;

/// An in-memory lease with versions, and a switch that makes the API unreachable.
#[derive(Default)]
struct Memory {
    lease: Mutex<Option<Versioned>>,
    version: Mutex<u64>,
    down: AtomicBool,
}

impl Memory {
    fn holder(&self) -> Option<String> {
        self.lease.lock().as_ref().and_then(|v| v.record.holder.clone())
    }

    fn check(&self) -> Result<(), lease::Error> {
        if self.down.load(Ordering::SeqCst) {
            return Err(lease::Error::Api(kube::Error::Service(
                "the API server is down".into(),
            )));
        }
        Ok(())
    }

    fn store(&self, record: &Record) -> Versioned {
        let mut version = self.version.lock();
        *version += 1;
        let v = Versioned {
            record: record.clone(),
            version: version.to_string(),
        };
        *self.lease.lock() = Some(v.clone());
        v
    }
}

impl Store for Memory {
    fn get(&self) -> BoxFuture<'_, Result<Option<Versioned>, lease::Error>> {
        Box::pin(async move {
            self.check()?;
            Ok(self.lease.lock().clone())
        })
    }

    fn create<'a>(&'a self, record: &'a Record) -> BoxFuture<'a, Result<Versioned, lease::Error>> {
        Box::pin(async move {
            self.check()?;
            if self.lease.lock().is_some() {
                return Err(lease::Error::Conflict);
            }
            Ok(self.store(record))
        })
    }

    fn replace<'a>(
        &'a self,
        record: &'a Record,
        version: &'a str,
    ) -> BoxFuture<'a, Result<Versioned, lease::Error>> {
        Box::pin(async move {
            self.check()?;
            let current = self.lease.lock().as_ref().map(|v| v.version.clone());
            if current.as_deref() != Some(version) {
                return Err(lease::Error::Conflict);
            }
            Ok(self.store(record))
        })
    }
}

fn settings() -> Settings {
    Settings {
        enabled: true,
        lease_duration: Duration::from_secs(4),
        renew_deadline: Duration::from_secs(3),
        retry_period: Duration::from_secs(1),
        ..Settings::default()
    }
}

struct Replica {
    gate: Gate,
    status: Arc<Mutex<Leadership>>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Elector>,
}

fn replica(name: &str, store: &Arc<Memory>) -> Replica {
    let gate = Gate::new();
    let mut elector = Elector::new(settings(), name.into(), store.clone(), gate.clone());
    let status = elector.status();
    let stop = CancellationToken::new();
    tokio::spawn(gate.clone().drive(
        crate::grpc::Hub::default(),
        Duration::from_secs(1),
        Arc::new(super::super::gate::NoHooks),
        stop.clone(),
    ));
    let token = stop.clone();
    let task = tokio::spawn(async move {
        elector.run(token).await;
        elector
    });
    Replica {
        gate,
        status,
        stop,
        task,
    }
}

async fn settle(d: Duration) {
    tokio::time::sleep(d).await;
}

#[test]
fn claims_follow_client_go() {
    let t0 = Instant::now();
    let wall = SystemTime::now();
    let d = Duration::from_secs(15);
    let fresh = claim("a", None, t0, t0, wall, d).expect("an absent lease is free");
    assert_eq!(fresh.holder.as_deref(), Some("a"));
    assert_eq!(fresh.transitions, 0);

    let held = Record {
        holder: Some("b".into()),
        duration: Some(d),
        transitions: 2,
        ..Record::default()
    };
    assert_eq!(
        claim("a", Some(&held), t0, t0 + Duration::from_secs(14), wall, d),
        None
    );
    let taken = claim("a", Some(&held), t0, t0 + d, wall, d).expect("expired after a lease duration");
    assert_eq!(taken.transitions, 3);

    let renewed = claim("b", Some(&held), t0, t0, wall, d).expect("the holder renews");
    assert_eq!(renewed.transitions, 2);

    let released = Record { holder: None, ..held };
    let after_release =
        claim("a", Some(&released), t0, t0, wall, d).expect("a released lease is free at once");
    assert_eq!(after_release.transitions, 2);
}

#[test]
fn durations_must_nest() {
    assert!(settings().validate().is_ok());
    let bad = Settings {
        renew_deadline: Duration::from_secs(4),
        ..settings()
    };
    assert!(bad.validate().is_err());
}

#[tokio::test(start_paused = true)]
async fn one_leader_and_a_standby_that_takes_over_after_the_lease_expires() {
    let store = Arc::new(Memory::default());
    let a = replica("a", &store);
    settle(Duration::from_millis(100)).await;
    let b = replica("b", &store);
    settle(Duration::from_secs(3)).await;
    assert_eq!(store.holder().as_deref(), Some("a"));
    assert!(!a.gate.is_paused());
    assert!(b.gate.is_paused());
    assert_eq!(b.status.lock().describe(), "standby (leader: a)");
    assert_eq!(a.status.lock().describe(), "leader");

    // The leader dies without releasing: b waits one lease duration from when it last saw
    // a change, then takes over.
    a.task.abort();
    let died = Instant::now();
    while store.holder().as_deref() != Some("b") {
        settle(Duration::from_millis(100)).await;
    }
    let took = died.elapsed();
    assert!(took <= Duration::from_secs(6), "took over after {took:?}");
    assert!(took >= Duration::from_secs(2), "took over too early: {took:?}");
    settle(Duration::from_millis(10)).await;
    assert!(!b.gate.is_paused());
    b.stop.cancel();
    let _ = b.task.await;
}

#[tokio::test(start_paused = true)]
async fn a_released_lease_is_taken_over_at_the_next_retry() {
    let store = Arc::new(Memory::default());
    let a = replica("a", &store);
    settle(Duration::from_millis(100)).await;
    let b = replica("b", &store);
    settle(Duration::from_secs(2)).await;
    a.stop.cancel();
    let mut elector = a.task.await.expect("the elector stops");
    elector.release().await;
    assert_eq!(store.holder(), None);
    let released = Instant::now();
    while store.holder().as_deref() != Some("b") {
        settle(Duration::from_millis(50)).await;
    }
    assert!(released.elapsed() <= Duration::from_millis(1100));
    b.stop.cancel();
    let _ = b.task.await;
}

#[tokio::test(start_paused = true)]
async fn a_leader_that_cannot_renew_pauses_before_the_lease_expires() {
    let store = Arc::new(Memory::default());
    let a = replica("a", &store);
    settle(Duration::from_secs(2)).await;
    assert!(!a.gate.is_paused());
    let last = store.lease.lock().clone();
    store.down.store(true, Ordering::SeqCst);
    let cut = Instant::now();
    while !a.gate.is_paused() {
        settle(Duration::from_millis(100)).await;
    }
    // Paused after the renew deadline, before anyone else may take over (lease duration
    // counted from the last successful renewal, which was at most one retry period earlier).
    let paused_after = cut.elapsed();
    assert!(paused_after <= settings().lease_duration - Duration::from_millis(500));
    assert!(paused_after >= settings().renew_deadline - settings().retry_period);
    assert!(!a.status.lock().leading);
    // The API comes back: the lease was not released (it could not be), a regains it once it
    // has expired by a's own observation.
    store.down.store(false, Ordering::SeqCst);
    assert_eq!(*store.lease.lock(), last);
    while a.gate.is_paused() {
        settle(Duration::from_millis(100)).await;
    }
    assert_eq!(store.holder().as_deref(), Some("a"));
    a.stop.cancel();
    let _ = a.task.await;
}

#[tokio::test(start_paused = true)]
async fn a_leader_whose_lease_was_taken_steps_down_at_once() {
    let store = Arc::new(Memory::default());
    let a = replica("a", &store);
    settle(Duration::from_secs(2)).await;
    let current = store.lease.lock().clone().expect("a holds the lease");
    store.store(&Record {
        holder: Some("intruder".into()),
        ..current.record
    });
    settle(Duration::from_millis(1500)).await;
    assert!(a.gate.is_paused());
    assert_eq!(a.status.lock().describe(), "standby (leader: intruder)");
    a.stop.cancel();
    let _ = a.task.await;
}
