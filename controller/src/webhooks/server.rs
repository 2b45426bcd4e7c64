//! The HTTPS endpoint the API server calls: TLS (rustls) in front of HTTP/1.1, one route per
//! phase (`/validate`, `/mutate`, and kopf's `/<phase>/<handler id>` for one handler), each
//! answering an `AdmissionReview`.
//!
//! The API server appends `?timeout=<duration>` to every call: the answer is due that long
//! after the request arrived, so the handlers get it minus a margin for the way back (a tenth,
//! at least 100 ms). Bad input never stops the server or touches another request: a body that
//! is not an `AdmissionReview` gets 400 with the reason, one larger than the limit gets 413
//! (before it is read whole), a review for a resource without handlers gets 404 (the API
//! server then applies the webhook's failure policy), and a plaintext request fails the TLS
//! handshake. Connections are bounded in number and each handshake has a deadline.

use std::{convert::Infallible, net::SocketAddr, sync::Arc, time::Duration};

use http::{Method, Request, Response, StatusCode};
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::{
    body::{Bytes, Incoming},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::TokioIo;
use tokio::{net::TcpListener, task::JoinSet, time::Instant};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::{
    admission::{Admission, Answer, Phase},
    certs::Certificates,
    review,
};
use crate::observability::metrics;

/// The most connections served at once; more wait in the listen backlog.
const MAX_CONNECTIONS: usize = 1024;
/// How long a TLS handshake may take.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The least time kept back from the API server's timeout for the answer's way back.
const MIN_MARGIN: Duration = Duration::from_millis(100);

/// Why the webhook server could not start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Binding failed.
    #[error("cannot listen on {0} for admission webhooks")]
    Bind(SocketAddr, #[source] std::io::Error),
    /// The TLS configuration could not be built.
    #[error("cannot set up TLS for admission webhooks")]
    Tls(#[from] super::certs::Error),
}

/// Tunables of the server.
#[derive(Clone, Debug)]
pub struct Settings {
    /// The largest request body accepted; larger ones get 413.
    pub max_body_bytes: usize,
    /// The timeout assumed when the API server does not say (`?timeout=`).
    pub default_timeout: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            max_body_bytes: 8 << 20,
            default_timeout: Duration::from_secs(10),
        }
    }
}

/// A bound webhook server.
pub struct Server {
    listener: TcpListener,
    acceptor: TlsAcceptor,
    admission: Admission,
    settings: Arc<Settings>,
}

impl Server {
    /// Binds now, so that a port in use is known at once.
    ///
    /// # Errors
    /// [`Error::Bind`], [`Error::Tls`].
    pub async fn bind(
        addr: SocketAddr,
        certs: &Certificates,
        admission: Admission,
        settings: Settings,
    ) -> Result<Self, Error> {
        let config = certs.server_config()?;
        let listener = TcpListener::bind(addr).await.map_err(|e| Error::Bind(addr, e))?;
        Ok(Self {
            listener,
            acceptor: TlsAcceptor::from(Arc::new(config)),
            admission,
            settings: Arc::new(settings),
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Serves until `stop` is cancelled; then the open connections are closed.
    pub async fn serve(self, stop: CancellationToken) {
        info!(addr = ?self.local_addr(), "admission webhook server listening");
        let slots = Arc::new(tokio::sync::Semaphore::new(MAX_CONNECTIONS));
        let mut connections = JoinSet::new();
        loop {
            let permit = tokio::select! {
                () = stop.cancelled() => break,
                permit = slots.clone().acquire_owned() => match permit {
                    Ok(p) => p,
                    Err(_) => break,
                },
            };
            let (stream, peer) = tokio::select! {
                () = stop.cancelled() => break,
                Some(_) = connections.join_next(), if !connections.is_empty() => continue,
                accepted = self.listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        debug!(error = %e, "webhook accept failed");
                        continue;
                    }
                },
            };
            // Answers are small and latency matters: no Nagle delay behind a delayed ACK.
            let _ = stream.set_nodelay(true);
            let acceptor = self.acceptor.clone();
            let admission = self.admission.clone();
            let settings = self.settings.clone();
            let stop = stop.clone();
            connections.spawn(async move {
                let _permit = permit;
                let tls = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                    Ok(Ok(tls)) => tls,
                    Ok(Err(e)) => {
                        debug!(%peer, error = %e, "webhook TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        debug!(%peer, "webhook TLS handshake timed out");
                        return;
                    }
                };
                let service = service_fn(move |req| {
                    let admission = admission.clone();
                    let settings = settings.clone();
                    async move { Ok::<_, Infallible>(handle(&admission, &settings, req).await) }
                });
                let conn = http1::Builder::new().serve_connection(TokioIo::new(tls), service);
                tokio::select! {
                    result = conn => if let Err(e) = result { debug!(%peer, error = %e, "webhook connection failed") },
                    () = stop.cancelled() => {}
                }
            });
        }
        connections.shutdown().await;
    }
}

/// Answers one HTTP request.
async fn handle(admission: &Admission, settings: &Settings, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let arrived = Instant::now();
    if req.method() != Method::POST {
        return text(
            StatusCode::METHOD_NOT_ALLOWED,
            "admission reviews are POSTed\n".into(),
        );
    }
    let path = req.uri().path().trim_matches('/').to_owned();
    let (phase, only) = match path.split_once('/') {
        Some(("validate", id)) => (Phase::Validating, Some(id.to_owned())),
        Some(("mutate", id)) => (Phase::Mutating, Some(id.to_owned())),
        None if path == "validate" => (Phase::Validating, None),
        None if path == "mutate" => (Phase::Mutating, None),
        _ => {
            return text(
                StatusCode::NOT_FOUND,
                "not found: use /validate or /mutate\n".into(),
            );
        }
    };
    let timeout = req
        .uri()
        .query()
        .and_then(|q| q.split('&').find_map(|kv| kv.strip_prefix("timeout=")))
        .and_then(|t| crate::config::parse_duration(t).ok())
        .filter(|t| !t.is_zero())
        .unwrap_or(settings.default_timeout)
        .min(Duration::from_secs(30));
    let margin = (timeout / 10).max(MIN_MARGIN);
    let deadline = arrived + timeout.saturating_sub(margin).max(MIN_MARGIN);
    let too_large = || {
        warn!(
            limit = settings.max_body_bytes,
            "admission review refused: the body is too large"
        );
        metrics::global().admission_request(phase.as_str(), "too_large", arrived.elapsed());
        text(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the body is larger than {} bytes\n", settings.max_body_bytes),
        )
    };
    let declared = req
        .headers()
        .get(http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > settings.max_body_bytes) {
        return too_large();
    }
    let body = match Limited::new(req.into_body(), settings.max_body_bytes)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => return too_large(),
        Err(e) => {
            debug!(error = %e, "reading an admission review failed");
            return text(
                StatusCode::BAD_REQUEST,
                format!("the body could not be read: {e}\n"),
            );
        }
    };
    let review = match review::parse(&body) {
        Ok(r) => r,
        Err(why) => {
            warn!(%why, "admission review refused: not a valid AdmissionReview");
            metrics::global().admission_request(phase.as_str(), "invalid", arrived.elapsed());
            return text(
                StatusCode::BAD_REQUEST,
                format!("not a valid AdmissionReview: {why}\n"),
            );
        }
    };
    match admission.review(phase, only.as_deref(), &review, deadline).await {
        Answer::Verdict(verdict) => {
            let result = if verdict.allowed { "allowed" } else { "denied" };
            metrics::global().admission_request(phase.as_str(), result, arrived.elapsed());
            Response::builder()
                .status(StatusCode::OK)
                .header(http::header::CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(review::render(&review, &verdict))))
                .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
        }
        Answer::Unknown(why) => {
            warn!(object = %review.object_name(), resource = %review.resource_name(), %why, "admission review for a resource without handlers; the webhook's failure policy applies");
            metrics::global().admission_request(phase.as_str(), "unknown", arrived.elapsed());
            text(StatusCode::NOT_FOUND, format!("{why}\n"))
        }
    }
}

fn text(status: StatusCode, body: String) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain"),
    );
    response
}
