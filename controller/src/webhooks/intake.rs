//! Reading one webhook request: the route, the API server's `?timeout=`, the body within the
//! memory budget, and the typed review — everything before the handlers, as a tower service in
//! front of the one that asks them (behind the load shedding and concurrency limit).
//!
//! The body's size limit and its deadlines are tower-http's layers outside this one; here each
//! chunk of the body is reserved from the shared [`Budget`] before it is kept (a body declared
//! larger than the whole budget is refused at once), and the trees a review becomes are
//! reserved from the same budget before they are built, from a scan of the raw bytes. What
//! cannot be reserved is refused (429), never queued. Reading the body does not count as work
//! in flight: a peer that trickles a body holds only its own connection and what it sent.

use std::{
    convert::Infallible,
    future::Future,
    pin::Pin,
    task::{Context, Poll},
    time::Duration,
};

use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt as _, Full};
use hyper::body::{Body, Bytes};
use tokio::time::Instant;
use tower::{Service, ServiceExt as _};
use tracing::{debug, warn};

use super::{
    admission::Phase,
    budget::{Budget, Refusal, Reservation},
    review::{self, Review},
    slots::Marker,
};
use crate::observability::metrics;

/// The least time kept back from the API server's timeout for the answer's way back.
const MIN_MARGIN: Duration = Duration::from_millis(100);
/// The longest timeout the API server may ask for.
const MAX_TIMEOUT: Duration = Duration::from_secs(30);
/// The first reservation of a body of unknown length, and the least step it grows by.
const CHUNK: usize = 64 << 10;
/// What one JSON value costs once parsed: its tree node, and its copy on the way to the
/// handler process.
pub const BYTES_PER_VALUE: usize = 128;

/// A request read whole: what the handlers' side gets.
#[derive(Debug)]
pub struct Admit {
    /// The phase of the route.
    pub phase: Phase,
    /// The one handler of a `/<phase>/<id>` route.
    pub only: Option<String>,
    /// The review.
    pub review: Review,
    /// When the answer is due (the API server's timeout minus a margin).
    pub deadline: Instant,
    /// When the request arrived.
    pub arrived: Instant,
    /// The connection, marked busy while the handlers have the review.
    pub connection: Option<Marker>,
    /// The memory the review holds, returned when it is answered.
    pub reservation: Reservation,
}

/// The reading service in front of `S`.
#[derive(Clone, Debug)]
pub struct Intake<S> {
    budget: Budget,
    default_timeout: Duration,
    next: S,
}

impl<S> Intake<S> {
    /// Reads requests within `budget` and passes them to `next`; `default_timeout` when the
    /// API server does not say.
    pub fn new(budget: Budget, default_timeout: Duration, next: S) -> Self {
        Self {
            budget,
            default_timeout,
            next,
        }
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl<S, B> Service<Request<B>> for Intake<S>
where
    S: Service<Admit, Response = Response<Full<Bytes>>, Error = BoxError> + Clone + Send + 'static,
    S::Future: Send,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<BoxError>,
{
    type Response = Response<Full<Bytes>>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let budget = self.budget.clone();
        let default_timeout = self.default_timeout;
        let next = self.next.clone();
        Box::pin(async move {
            let arrived = Instant::now();
            let admit = match read(req, &budget, default_timeout, arrived).await {
                Ok(admit) => admit,
                Err(response) => return Ok(response),
            };
            let phase = admit.phase;
            match next.oneshot(admit).await {
                Ok(response) => Ok(response),
                Err(e) => {
                    // Only the load shedding fails: every review slot is taken.
                    warn!(error = %e, "admission review refused: too many reviews in flight");
                    metrics::global().admission_request(phase.as_str(), "overloaded", arrived.elapsed());
                    Ok(text(
                        StatusCode::SERVICE_UNAVAILABLE,
                        "too many admission reviews in flight\n".into(),
                    ))
                }
            }
        })
    }
}

/// Reads `req` into an [`Admit`], or the answer that refuses it.
async fn read<B>(
    req: Request<B>,
    budget: &Budget,
    default_timeout: Duration,
    arrived: Instant,
) -> Result<Admit, Response<Full<Bytes>>>
where
    B: Body<Data = Bytes>,
    B::Error: Into<BoxError>,
{
    if req.method() != Method::POST {
        return Err(text(
            StatusCode::METHOD_NOT_ALLOWED,
            "admission reviews are POSTed\n".into(),
        ));
    }
    let path = req.uri().path().trim_matches('/');
    let (phase, only) = match path.split_once('/') {
        Some(("validate", id)) => (Phase::Validating, Some(id.to_owned())),
        Some(("mutate", id)) => (Phase::Mutating, Some(id.to_owned())),
        None if path == "validate" => (Phase::Validating, None),
        None if path == "mutate" => (Phase::Mutating, None),
        _ => {
            return Err(text(
                StatusCode::NOT_FOUND,
                "not found: use /validate or /mutate\n".into(),
            ));
        }
    };
    let timeout = req
        .uri()
        .query()
        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("timeout=")))
        .and_then(|t| crate::config::parse_duration(t).ok())
        .filter(|t| !t.is_zero())
        .unwrap_or(default_timeout)
        .min(MAX_TIMEOUT);
    let margin = (timeout / 10).max(MIN_MARGIN);
    let deadline = arrived + timeout.saturating_sub(margin).max(MIN_MARGIN);
    let connection = req.extensions().get::<Marker>().cloned();
    let headers = review::headers(req.headers());
    let declared = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    let refuse = |refusal: Refusal| {
        let (status, result) = match refusal {
            Refusal::TooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
            Refusal::Spent => (StatusCode::TOO_MANY_REQUESTS, "over_budget"),
        };
        warn!(%refusal, "admission review refused");
        metrics::global().admission_request(phase.as_str(), result, arrived.elapsed());
        let mut response = text(status, format!("{refusal}\n"));
        response
            .headers_mut()
            .insert(http::header::RETRY_AFTER, http::HeaderValue::from_static("1"));
        response
    };

    // The body, reserved before it is kept.
    let mut reservation = budget.reservation();
    if let Some(n) = declared.filter(|&n| n > budget.total()) {
        return Err(refuse(Refusal::TooLarge {
            needed: n,
            budget: budget.total(),
        }));
    }
    reservation
        .grow_to(declared.unwrap_or(CHUNK).min(CHUNK))
        .map_err(refuse)?;
    let mut body = std::pin::pin!(req.into_body());
    let mut bytes: Vec<u8> = Vec::new();
    while let Some(frame) = body.frame().await {
        let data = match frame.map(|f| f.into_data()) {
            Ok(Ok(data)) => data,
            Ok(Err(_trailers)) => continue,
            Err(e) => return Err(body_error(e.into(), phase, arrived)),
        };
        let needed = bytes.len() + data.len();
        if needed > bytes.capacity() {
            let capacity = match declared {
                Some(n) if n >= needed => n,
                _ => needed.max(bytes.capacity() * 2).max(CHUNK),
            };
            reservation.grow_to(capacity).map_err(refuse)?;
            bytes.reserve_exact(capacity - bytes.len());
        }
        bytes.extend_from_slice(&data);
    }

    // The trees, reserved before they are built.
    let shape = match review::shape(&bytes) {
        Ok(shape) => shape,
        Err(why) => return Err(invalid(&why, phase, arrived)),
    };
    let trees = bytes
        .len()
        .saturating_add(shape.values.saturating_mul(BYTES_PER_VALUE));
    reservation
        .grow_to(bytes.capacity().saturating_add(trees))
        .map_err(refuse)?;
    let mut review = review::parse(&bytes).map_err(|why| invalid(&why, phase, arrived))?;
    review.headers = headers;
    debug!(
        bytes = bytes.len(),
        values = shape.values,
        depth = shape.depth,
        reserved = reservation.held(),
        "admission review read"
    );
    Ok(Admit {
        phase,
        only,
        review,
        deadline,
        arrived,
        connection,
        reservation,
    })
}

/// The answer to a body that could not be read: too large (the limit layer), too slow (the
/// deadline layers), or broken.
fn body_error(e: BoxError, phase: Phase, arrived: Instant) -> Response<Full<Bytes>> {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(e.as_ref());
    while let Some(err) = source {
        if err.is::<http_body_util::LengthLimitError>() {
            warn!("admission review refused: the body is too large");
            metrics::global().admission_request(phase.as_str(), "too_large", arrived.elapsed());
            return text(StatusCode::PAYLOAD_TOO_LARGE, "the body is too large\n".into());
        }
        if err.is::<tower_http::timeout::TimeoutError>() {
            warn!("admission review refused: the body did not arrive in time");
            metrics::global().admission_request(phase.as_str(), "timeout", arrived.elapsed());
            return text(
                StatusCode::REQUEST_TIMEOUT,
                "the body did not arrive in time\n".into(),
            );
        }
        source = err.source();
    }
    debug!(error = %e, "reading an admission review failed");
    text(
        StatusCode::BAD_REQUEST,
        format!("the body could not be read: {e}\n"),
    )
}

fn invalid(why: &str, phase: Phase, arrived: Instant) -> Response<Full<Bytes>> {
    warn!(%why, "admission review refused: not a valid AdmissionReview");
    metrics::global().admission_request(phase.as_str(), "invalid", arrived.elapsed());
    text(
        StatusCode::BAD_REQUEST,
        format!("not a valid AdmissionReview: {why}\n"),
    )
}

/// A plain-text answer.
pub fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain"),
    );
    response
}
