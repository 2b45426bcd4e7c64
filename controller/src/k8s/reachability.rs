//! Whether the API server answers: the last outcome of any API request, shared with readiness
//! and with the watches' liveness.
//!
//! Liveness and readiness answer different questions (see `observability::health`): a
//! control-plane outage must make the controller *not ready*, never *not alive* — restarting
//! every operator pod does not bring an API server back. So every request that goes through
//! the shared client ([`crate::k8s::switch`]) reports here whether the server answered; a
//! watch that cannot be restarted while the server does not answer counts as an outage, not as
//! a hung watch. A response with a status code counts as an answer, except `502`/`503`/`504`,
//! which a load balancer or an API server that is starting sends in place of one. A server
//! that answers nothing at all, not even with an error, is noticed by the [`probe`].

pub mod probe;

use std::{sync::Arc, time::Duration};

use parking_lot::Mutex;
use tokio::time::Instant;

/// The shared record of the API server's reachability. Cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct Reachability {
    inner: Arc<Mutex<Inner>>,
}

#[derive(Debug, Default)]
struct Inner {
    /// When a request last got an answer.
    answered: Option<Instant>,
    /// Since when requests fail without an answer, and the last reason, while they do.
    failing: Option<(Instant, String)>,
    /// When any request last finished, either way.
    last: Option<Instant>,
}

impl Reachability {
    /// The process-wide record: the API client and the watches report here, readiness reads
    /// it. (Components built without the shared client, such as unit tests, use their own.)
    pub fn global() -> Self {
        static GLOBAL: std::sync::OnceLock<Reachability> = std::sync::OnceLock::new();
        GLOBAL.get_or_init(Self::default).clone()
    }

    /// Records that the server answered a request.
    pub fn answered(&self) {
        let mut inner = self.inner.lock();
        let now = Instant::now();
        inner.answered = Some(now);
        inner.last = Some(now);
        inner.failing = None;
    }

    /// Records that a request got no answer (connection refused or reset, timeout, 50x).
    pub fn failed(&self, why: impl Into<String>) {
        let mut inner = self.inner.lock();
        let now = Instant::now();
        inner.last = Some(now);
        let since = inner.failing.as_ref().map_or(now, |(since, _)| *since);
        inner.failing = Some((since, why.into()));
    }

    /// Why the server is unreachable and for how long, while it is.
    pub fn outage(&self) -> Option<(Duration, String)> {
        self.inner
            .lock()
            .failing
            .as_ref()
            .map(|(since, why)| (since.elapsed(), why.clone()))
    }

    /// Whether the server is reachable as far as the last request knows.
    pub fn is_reachable(&self) -> bool {
        self.inner.lock().failing.is_none()
    }

    /// How long ago any request finished; `None` before the first one.
    pub fn idle_for(&self) -> Option<Duration> {
        self.inner.lock().last.map(|t| t.elapsed())
    }

    /// How long ago the server last answered; `None` before the first answer.
    pub fn since_answered(&self) -> Option<Duration> {
        self.inner.lock().answered.map(|t| t.elapsed())
    }

    /// Whether the server answered a request at or after `since`.
    pub fn answered_since(&self, since: Instant) -> bool {
        self.inner.lock().answered.is_some_and(|t| t >= since)
    }

    /// Whether the server answered a request within the last `within`.
    pub fn answered_within(&self, within: Duration) -> bool {
        self.inner.lock().answered.is_some_and(|t| t.elapsed() <= within)
    }
}

/// Whether a response status means that the API server itself answered.
pub fn is_answer(status: http::StatusCode) -> bool {
    !matches!(
        status,
        http::StatusCode::BAD_GATEWAY
            | http::StatusCode::SERVICE_UNAVAILABLE
            | http::StatusCode::GATEWAY_TIMEOUT
    )
}

/// Whether a request error means that the API server did not answer (as opposed to answering
/// with an error status it can be blamed for): transport failures — a connection refused, a
/// connection reset, also under a watch stream that was flowing (`ReadEvents`) — timeouts,
/// `429 Too Many Requests` and server errors. The first moments of an outage must read as
/// one: a reset stream taken for "the server answers but refuses" would fail liveness until
/// the next request found the server gone.
pub fn is_unanswered(e: &kube::Error) -> bool {
    match e {
        kube::Error::Api(s) => s.code == 429 || s.code >= 500,
        kube::Error::HyperError(_) | kube::Error::Service(_) | kube::Error::ReadEvents(_) => true,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_outcome_wins_and_an_outage_keeps_its_start() {
        let r = Reachability::default();
        assert!(r.is_reachable() && r.outage().is_none() && r.idle_for().is_none());
        r.failed("connection refused");
        r.failed("timed out");
        let (_, why) = r.outage().unwrap();
        assert_eq!(why, "timed out");
        assert!(!r.is_reachable() && !r.answered_within(Duration::from_secs(60)));
        r.answered();
        assert!(r.is_reachable() && r.answered_within(Duration::from_secs(60)));
    }

    #[test]
    fn a_watch_stream_cut_by_a_reset_is_no_answer() {
        let reset = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "connection reset by peer");
        assert!(is_unanswered(&kube::Error::ReadEvents(reset)));
        let refused = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
        assert!(is_unanswered(&kube::Error::Service(Box::new(refused))));
        // An answer the server can be blamed for is one.
        let forbidden = kube::core::Status::failure("forbidden", "Forbidden").with_code(403);
        assert!(!is_unanswered(&kube::Error::Api(Box::new(forbidden))));
        assert!(!is_unanswered(&kube::Error::LinesCodecMaxLineLengthExceeded));
    }

    #[test]
    fn gateway_statuses_are_no_answer() {
        assert!(is_answer(http::StatusCode::NOT_FOUND));
        assert!(!is_answer(http::StatusCode::SERVICE_UNAVAILABLE));
    }
}
