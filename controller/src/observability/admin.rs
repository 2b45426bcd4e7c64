//! The admin HTTP listener: `/healthz` and `/readyz` for the kubelet's probes.
//!
//! Plain HTTP/1.1 on a TCP port (kubelet probes cannot reach a Unix socket), answering JSON
//! with every check so that a failing probe explains itself in `kubectl describe pod`.
//!
//! # Hostile peers
//!
//! The port has no authentication and, by default, listens on every address, so anything that
//! can reach the pod can connect. What a peer can hold is bounded, so that a flood of
//! connections can neither take the descriptors the API client and the node store need nor
//! keep the kubelet's probes out:
//!
//! - **At most `connections` are open** ([`slots`]): a new connection that finds them all
//!   taken sheds the oldest — first the oldest that has not sent a byte.
//! - **Headers within `header_timeout`**: a connection that sends nothing is closed then;
//!   once it sends, hyper's own header-read timeout, run by hyper-util's Tokio timer, bounds
//!   each request's headers. It also closes a kept-alive connection that sends no next request
//!   in that time.
//! - **Each connection within `request_timeout`**, whatever it does: then it is asked to close
//!   after its current answer, and cut a moment later.
//! - **No bodies**: every page is a `GET`; a request announcing a body is refused with `413`
//!   by tower-http's body limit, and a connection whose body was not read is closed after the
//!   answer.
//! - **Failed accepts back off** ([`ACCEPT_BACKOFF`]): out of descriptors (`EMFILE`), the loop
//!   waits instead of spinning on the error.

mod slots;

use std::{convert::Infallible, net::SocketAddr, time::Duration};

use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::{body::Bytes, server::conn::http1};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio_util::sync::CancellationToken;
use tower::{ServiceBuilder, ServiceExt as _};
use tower_http::limit::RequestBodyLimitLayer;
use tracing::{Instrument as _, debug, debug_span, info, warn};

use self::slots::{Slot, Slots};
use super::health::{Health, Report};

/// How long the accept loop waits after a failed accept (out of descriptors, mostly).
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Connections the kernel queues until they are accepted (it caps this at `somaxconn`, 4,096
/// by default): during a burst of connections, a probe waits in the queue rather than having
/// its connect dropped and retried a second later.
const BACKLOG: u32 = 4096;

/// How long a connection past its deadline may take to finish its current answer.
const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// The most bytes buffered per connection for reading a request (hyper's minimum is 8 KiB):
/// probe and scrape requests are a few hundred bytes.
const MAX_BUF: usize = 16 * 1024;

/// Limits of the admin endpoint's connections (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Settings {
    /// Most connections open at once; a new one beyond sheds the oldest. Default 64.
    pub connections: usize,
    /// Longest wait for a request's headers, and for the next request on an idle
    /// connection. Default 5 s.
    pub header_timeout: Duration,
    /// Longest life of one connection. Default 10 s.
    pub request_timeout: Duration,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            connections: 64,
            header_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(10),
        }
    }
}

/// Why the admin listener failed.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Binding failed.
    #[error("cannot listen on {0} for the admin endpoint")]
    Bind(SocketAddr, #[source] std::io::Error),
}

/// A bound admin listener.
pub struct Admin {
    listener: TcpListener,
    health: Health,
    settings: Settings,
    slots: Slots,
}

impl Admin {
    /// Binds now so that a port in use fails the start.
    ///
    /// # Errors
    /// [`Error::Bind`].
    pub async fn bind(addr: SocketAddr, settings: Settings, health: Health) -> Result<Self, Error> {
        let listener = listen(addr).map_err(|e| Error::Bind(addr, e))?;
        Ok(Self {
            listener,
            health,
            slots: Slots::new(settings.connections),
            settings,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Serves until `shutdown` is cancelled.
    pub async fn serve(self, shutdown: CancellationToken) {
        info!(addr = ?self.local_addr(), settings = ?self.settings, "admin endpoint listening");
        loop {
            let (stream, peer) = tokio::select! {
                () = shutdown.cancelled() => return,
                accepted = self.listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        warn!(error = %e, retry_in = ?ACCEPT_BACKOFF, "admin accept failed");
                        tokio::select! {
                            () = shutdown.cancelled() => return,
                            () = tokio::time::sleep(ACCEPT_BACKOFF) => continue,
                        }
                    }
                },
            };
            let slot = tokio::select! {
                () = shutdown.cancelled() => return,
                slot = self.slots.take() => slot,
            };
            debug!(%peer, open = self.slots.taken(), shed = self.slots.shed(), "admin connection accepted");
            tokio::spawn(
                connection(
                    stream,
                    slot,
                    self.health.clone(),
                    self.settings.clone(),
                    shutdown.clone(),
                )
                .instrument(debug_span!("admin connection", %peer)),
            );
        }
    }
}

/// A listener on `addr` with a backlog of [`BACKLOG`].
fn listen(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(BACKLOG)
}

/// Serves one connection until it ends, is shed, passes its deadline or the endpoint stops.
async fn connection(
    stream: TcpStream,
    slot: Slot,
    health: Health,
    settings: Settings,
    shutdown: CancellationToken,
) {
    let deadline = tokio::time::Instant::now() + settings.request_timeout;
    // A connection counts as silent (shed first) until its first byte; silence is bounded by
    // the header timeout as well.
    let mut byte = [0u8; 1];
    let silence = tokio::time::sleep(settings.header_timeout);
    tokio::pin!(silence);
    let first = loop {
        tokio::select! {
            first = stream.peek(&mut byte) => break first,
            () = slot.shed() => {
                if has_arrived(&stream) {
                    slot.spare();
                    continue;
                }
                return debug!("silent admin connection shed for a newer one");
            }
            () = shutdown.cancelled() => return,
            () = &mut silence => return debug!("admin connection sent nothing; closing it"),
            () = tokio::time::sleep_until(deadline) => return,
        }
    };
    match first {
        Ok(0) | Err(_) => return,
        Ok(_) => slot.heard(),
    }
    let service = ServiceBuilder::new()
        .layer(RequestBodyLimitLayer::new(0))
        .service_fn(move |req: Request<_>| {
            let health = health.clone();
            async move { Ok::<_, Infallible>(route(&health, &req).await) }
        });
    let service = hyper::service::service_fn(move |req| service.clone().oneshot(req));
    let conn = http1::Builder::new()
        .timer(TokioTimer::new())
        .header_read_timeout(settings.header_timeout)
        .max_buf_size(MAX_BUF)
        .serve_connection(TokioIo::new(stream), service);
    tokio::pin!(conn);
    tokio::select! {
        result = conn.as_mut() => if let Err(e) = result {
            debug!(error = %e, "admin connection failed");
        },
        () = slot.shed() => debug!("admin connection shed for a newer one"),
        () = shutdown.cancelled() => {}
        () = tokio::time::sleep_until(deadline) => {
            debug!(deadline = ?settings.request_timeout, "admin connection past its deadline; closing it");
            conn.as_mut().graceful_shutdown();
            tokio::select! {
                _ = tokio::time::timeout(CLOSE_GRACE, conn) => {}
                () = slot.shed() => {}
                () = shutdown.cancelled() => {}
            }
        }
    }
}

/// Whether bytes have arrived on `stream` that were not read yet, asked of the kernel now
/// (through a duplicate of its descriptor, non-blocking like the original): the runtime
/// learns of them only when it next polls its events, which under a flood of connections may
/// be after the connection was picked to be shed.
fn has_arrived(stream: &TcpStream) -> bool {
    use std::os::fd::AsFd as _;
    stream
        .as_fd()
        .try_clone_to_owned()
        .map(std::net::TcpStream::from)
        .and_then(|dup| dup.peek(&mut [0u8; 1]))
        .is_ok_and(|n| n > 0)
}

async fn route<B>(health: &Health, req: &Request<B>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET is served here\n");
    }
    match req.uri().path() {
        "/healthz" | "/livez" => report(&health.live_fresh().await),
        "/metrics" => {
            let mut response = Response::new(Full::new(Bytes::from(super::metrics::global().render())));
            response.headers_mut().insert(
                http::header::CONTENT_TYPE,
                http::HeaderValue::from_static(super::metrics::CONTENT_TYPE),
            );
            response
        }
        "/readyz" => report(&health.ready()),
        "/" => text(
            StatusCode::OK,
            "capstan admin endpoint: /healthz /readyz /metrics\n",
        ),
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

fn report(report: &Report) -> Response<Full<Bytes>> {
    let status = if report.ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::to_vec_pretty(report).unwrap_or_default();
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap_or_else(|_| Response::new(Full::new(Bytes::new())))
}

fn text(status: StatusCode, body: &'static str) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from_static(body.as_bytes())));
    *response.status_mut() = status;
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observability::health::Check;

    #[tokio::test]
    async fn routes_probes_with_status_codes() {
        let health = Health::default();
        health.readiness("handlers", || Check::fail("none connected"));
        let get = |path: &str| Request::get(path).body(()).unwrap();
        assert_eq!(route(&health, &get("/healthz")).await.status(), StatusCode::OK);
        assert_eq!(
            route(&health, &get("/readyz")).await.status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            route(&health, &get("/nope")).await.status(),
            StatusCode::NOT_FOUND
        );
    }
}
