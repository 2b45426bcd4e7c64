//! The reachability probe: notices an API server that stopped answering even when nothing
//! else asks it anything.
//!
//! Requests report their outcome to [`Reachability`] as they finish, but a frozen server —
//! connections open, nothing coming back — finishes no request: watches wait for events that
//! do not come, and other requests wait for their own timeout (30 s by default) or are not
//! sent at all in a quiet cluster. Readiness would then say "ready" through the whole outage.
//! So once [`QUIET`] has passed without any answer, this probe asks for the server's version
//! (the cheapest request there is) and gives it [`DEADLINE`]: no answer by then marks the
//! server unreachable. An API server that stops answering is therefore known within
//! `QUIET + DEADLINE` of its last answer. While it does not answer, the probe asks again
//! every [`PAUSE`] after a failed try, so the recovery shows as soon as it answers.

use std::{future::Future, time::Duration};

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::{Reachability, is_unanswered};

/// How long without any answer before the probe asks.
pub const QUIET: Duration = Duration::from_secs(5);

/// How long the probe waits for its answer.
pub const DEADLINE: Duration = Duration::from_secs(5);

/// The pause after a try that got no answer.
pub const PAUSE: Duration = Duration::from_secs(1);

/// Keeps `reachability` fresh with `ask` (a cheap request that answers `Ok` when the server
/// answered) until `stop` is cancelled.
pub async fn run<F, Fut>(reachability: Reachability, ask: F, stop: CancellationToken)
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<(), kube::Error>>,
{
    loop {
        let wait = reachability
            .since_answered()
            .map_or(Duration::ZERO, |since| QUIET.saturating_sub(since));
        if !wait.is_zero() {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(wait) => continue,
            }
        }
        let asked = Instant::now();
        tokio::select! {
            () = stop.cancelled() => return,
            answer = tokio::time::timeout(DEADLINE, ask()) => match answer {
                Ok(Ok(())) => reachability.answered(),
                Ok(Err(e)) if is_unanswered(&e) => {
                    debug!(error = %e, "the API server does not answer");
                    reachability.failed(e.to_string());
                }
                // Refused, but answered.
                Ok(Err(e)) => {
                    debug!(error = %e, "the API server refused a version request");
                    reachability.answered();
                }
                Err(_) => reachability.failed(format!(
                    "no answer to a version request within {DEADLINE:?}"
                )),
            },
        }
        if !reachability.answered_since(asked) {
            tokio::select! {
                () = stop.cancelled() => return,
                () = tokio::time::sleep(PAUSE) => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    };

    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_server_that_stops_answering_is_noticed_within_the_bound() {
        let reachability = Reachability::default();
        let answering = Arc::new(AtomicBool::new(true));
        let asked = Arc::new(AtomicUsize::new(0));
        let ask = {
            let (answering, asked) = (answering.clone(), asked.clone());
            move || {
                asked.fetch_add(1, Ordering::SeqCst);
                let answers = answering.load(Ordering::SeqCst);
                async move {
                    if !answers {
                        // Frozen: the request never ends.
                        std::future::pending::<()>().await;
                    }
                    Ok(())
                }
            }
        };
        let stop = CancellationToken::new();
        let probe = tokio::spawn(run(reachability.clone(), ask, stop.clone()));

        // A quiet server that answers: asked about every QUIET, never unreachable.
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(reachability.outage().is_none());
        let quiet_asks = asked.load(Ordering::SeqCst);
        assert!((11..=14).contains(&quiet_asks), "{quiet_asks} probes in 60 s");

        // The worst case: a request answered just before the server froze.
        answering.store(false, Ordering::SeqCst);
        reachability.answered();
        let froze = Instant::now();
        while reachability.outage().is_none() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let noticed = froze.elapsed();
        assert!(
            noticed <= QUIET + DEADLINE + Duration::from_millis(200),
            "noticed after {noticed:?}"
        );

        // It answers again: noticed by the next try.
        answering.store(true, Ordering::SeqCst);
        let thawed = Instant::now();
        while reachability.outage().is_some() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(thawed.elapsed() <= DEADLINE + PAUSE + Duration::from_millis(200));
        stop.cancel();
        probe.await.unwrap();
    }
}
