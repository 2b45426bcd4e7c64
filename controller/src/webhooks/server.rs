//! The HTTPS endpoint the API server calls: TLS (rustls) in front of HTTP/1.1, one route per
//! phase (`/validate`, `/mutate`, and kopf's `/<phase>/<handler id>` for one handler), each
//! answering an `AdmissionReview`.
//!
//! The port is reachable by anything that can reach the pod, and with `failurePolicy: Fail`
//! every covered write in the cluster depends on it, so the server is a stack of kept layers
//! around Capstan's admission logic, each bounding one way a peer could hold it:
//! - connections: a fixed number of [`slots`](super::slots); when all are taken the longest
//!   idle connection gives way, one reading its request only when none is idle, and one whose
//!   review is with the handlers never;
//! - the TLS handshake has a deadline (and, with a client CA, needs a client certificate); then hyper's HTTP/1 connection with hyper-util's timer,
//!   so that its header-read timeout holds, also for an idle keep-alive connection waiting for
//!   its next request; a read buffer of at most 64 KiB;
//! - tower-http's body size limit (413, from `Content-Length` before anything is read) and its
//!   body timeouts (between two chunks, and for the whole body);
//! - the [`intake`](super::intake): the body and the review's trees within the memory budget
//!   (429 when it is spent), parsed into kube's typed review;
//! - tower's load shedding over its concurrency limit: at most so many reviews with the
//!   handlers (503 beyond), never a queue.
//!
//! A failed accept (out of descriptors, mostly) backs off as the admin endpoint's does.
//!
//! The API server appends `?timeout=<duration>` to every call: the answer is due that long
//! after the request arrived, so the handlers get it minus a margin for the way back (a tenth,
//! at least 100 ms). Bad input never stops the server or touches another request: a body that
//! is not an `AdmissionReview` gets 400 with the reason, a review for a resource without
//! handlers gets 404 (the API server then applies the webhook's failure policy), and a
//! plaintext request fails the TLS handshake.

use std::{
    future::Future,
    net::SocketAddr,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use http::{Request, Response, StatusCode};
use http_body_util::Full;
use hyper::{
    body::{Bytes, Incoming},
    server::conn::http1,
    service::service_fn,
};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::{
    net::{TcpListener, TcpSocket},
    task::JoinSet,
};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;
use tower::{Service, ServiceBuilder, ServiceExt as _};
use tower_http::{
    limit::RequestBodyLimitLayer,
    timeout::{RequestBodyDeadlineLayer, RequestBodyTimeoutLayer},
};
use tracing::{Instrument as _, debug, debug_span, info, warn};

use super::{
    admission::{Admission, Answer},
    budget::Budget,
    certs::Certificates,
    client_ca::ClientCa,
    intake::{Admit, Intake, text},
    review,
    slots::{Marker, Slots},
};
use crate::observability::{admin::ACCEPT_BACKOFF, metrics};

/// The most bytes hyper buffers for one connection (the request head must fit).
const READ_BUFFER: usize = 64 << 10;

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
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// The largest request body accepted; larger ones get 413.
    pub max_body_bytes: usize,
    /// The timeout assumed when the API server does not say (`?timeout=`).
    pub default_timeout: Duration,
    /// How long a TLS handshake may take.
    pub handshake_timeout: Duration,
    /// How long a request head may take to arrive, and an idle connection may wait for one.
    pub header_timeout: Duration,
    /// How long the body may pause between two chunks, and take in all.
    pub body_timeout: Duration,
    /// The bytes all requests in flight may hold together.
    pub memory_budget: usize,
    /// The most reviews with the handlers at once.
    pub max_in_flight: usize,
    /// The most connections held at once.
    pub max_connections: usize,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            max_body_bytes: 6 << 20,
            default_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(10),
            memory_budget: 32 << 20,
            max_in_flight: 64,
            max_connections: 1024,
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
        clients: Option<&ClientCa>,
        admission: Admission,
        settings: Settings,
    ) -> Result<Self, Error> {
        let config = certs.server_config(clients)?;
        let listener = listen(addr, settings.max_connections).map_err(|e| Error::Bind(addr, e))?;
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
        let settings = self.settings.clone();
        info!(addr = ?self.local_addr(), max_connections = settings.max_connections, max_in_flight = settings.max_in_flight, memory_budget = settings.memory_budget, "admission webhook server listening");
        let slots = Slots::new(settings.max_connections);
        let budget = Budget::new(settings.memory_budget);
        let handlers = ServiceBuilder::new()
            .load_shed()
            .concurrency_limit(settings.max_in_flight.max(1))
            .service(Reviews {
                admission: self.admission.clone(),
            });
        let stack = ServiceBuilder::new()
            .layer(RequestBodyLimitLayer::new(settings.max_body_bytes))
            .layer(RequestBodyDeadlineLayer::new(settings.body_timeout))
            .layer(RequestBodyTimeoutLayer::new(settings.body_timeout))
            .service(Intake::new(budget, settings.default_timeout, handlers));
        let mut http = http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(settings.header_timeout)
            .max_buf_size(READ_BUFFER)
            .keep_alive(true);
        let mut connections = JoinSet::new();
        loop {
            let (stream, peer) = tokio::select! {
                () = stop.cancelled() => break,
                Some(_) = connections.join_next(), if !connections.is_empty() => continue,
                accepted = self.listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of descriptors, mostly: wait instead of spinning on the error.
                        warn!(error = %e, retry_in = ?ACCEPT_BACKOFF, "webhook accept failed");
                        tokio::select! {
                            () = stop.cancelled() => break,
                            () = tokio::time::sleep(ACCEPT_BACKOFF) => continue,
                        }
                    }
                },
            };
            let slot = tokio::select! {
                () = stop.cancelled() => break,
                slot = slots.take() => slot,
            };
            // Answers are small and latency matters: no Nagle delay behind a delayed ACK.
            let _ = stream.set_nodelay(true);
            let acceptor = self.acceptor.clone();
            let stack = stack.clone();
            let http = http.clone();
            let stop = stop.clone();
            let handshake_timeout = settings.handshake_timeout;
            connections.spawn(
                async move {
                    let closed = slot.closed();
                    let marker = slot.marker();
                    let handshake = tokio::time::timeout(handshake_timeout, acceptor.accept(stream));
                    let tls = tokio::select! {
                        () = stop.cancelled() => return,
                        () = closed.cancelled() => return,
                        tls = handshake => match tls {
                            Ok(Ok(tls)) => tls,
                            Ok(Err(e)) => {
                                debug!(error = %e, "webhook TLS handshake failed");
                                return;
                            }
                            Err(_) => {
                                debug!("webhook TLS handshake timed out");
                                return;
                            }
                        },
                    };
                    let service = service_fn(move |mut req: Request<Incoming>| {
                        // From its head to its answer, a request keeps its connection from
                        // being shed before the silent ones.
                        let reading = marker.reading();
                        req.extensions_mut().insert(marker.clone());
                        let answered = stack.clone().oneshot(req);
                        async move {
                            let response = answered.await;
                            drop(reading);
                            response
                        }
                    });
                    let conn = http.serve_connection(TokioIo::new(tls), service);
                    tokio::select! {
                        result = conn => if let Err(e) = result { debug!(error = %e, "webhook connection closed") },
                        () = stop.cancelled() => {}
                        () = closed.cancelled() => debug!("webhook connection closed to free its slot for a newer one"),
                    }
                    drop(slot);
                }
                .instrument(debug_span!("webhook-connection", %peer)),
            );
        }
        connections.shutdown().await;
    }
}

/// Binds with a listen backlog as deep as the connection slots (the kernel caps it at its
/// `somaxconn`): a burst of connections beyond the default backlog would otherwise be left
/// half-open on the peer's side, where the server cannot close them.
fn listen(addr: SocketAddr, max_connections: usize) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(u32::try_from(max_connections.max(1024)).unwrap_or(u32::MAX))
}

/// The innermost service: the handlers' verdict on a review that was read whole.
#[derive(Clone)]
struct Reviews {
    admission: Admission,
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

impl Service<Admit> for Reviews {
    type Response = Response<Full<Bytes>>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, admit: Admit) -> Self::Future {
        let admission = self.admission.clone();
        Box::pin(async move { Ok(answer(&admission, admit).await) })
    }
}

/// Asks the handlers; the connection is busy meanwhile, and the review's memory is returned
/// to the budget once it is answered.
async fn answer(admission: &Admission, admit: Admit) -> Response<Full<Bytes>> {
    let Admit {
        phase,
        only,
        review,
        deadline,
        arrived,
        connection,
        reservation,
    } = admit;
    let _busy = connection.as_ref().map(Marker::busy);
    let answer = admission.review(phase, only.as_deref(), &review, deadline).await;
    let response = match answer {
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
    };
    drop(review);
    drop(reservation);
    response
}
