//! The admin HTTP listener: `/healthz` and `/readyz` for the kubelet's probes.
//!
//! Plain HTTP/1.1 on a TCP port (kubelet probes cannot reach a Unix socket), answering JSON
//! with every check so that a failing probe explains itself in `kubectl describe pod`.

use std::{convert::Infallible, net::SocketAddr};

use http::{Method, Request, Response, StatusCode};
use http_body_util::Full;
use hyper::{body::Bytes, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info};

use super::health::{Health, Report};

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
}

impl Admin {
    /// Binds now so that a port in use fails the start.
    ///
    /// # Errors
    /// [`Error::Bind`].
    pub async fn bind(addr: SocketAddr, health: Health) -> Result<Self, Error> {
        let listener = TcpListener::bind(addr).await.map_err(|e| Error::Bind(addr, e))?;
        Ok(Self { listener, health })
    }

    /// The bound address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Serves until `shutdown` is cancelled.
    pub async fn serve(self, shutdown: CancellationToken) {
        info!(addr = ?self.local_addr(), "admin endpoint listening");
        loop {
            let (stream, peer) = tokio::select! {
                () = shutdown.cancelled() => return,
                accepted = self.listener.accept() => match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        debug!(error = %e, "admin accept failed");
                        continue;
                    }
                },
            };
            let health = self.health.clone();
            let conn_shutdown = shutdown.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| {
                    let health = health.clone();
                    async move { Ok::<_, Infallible>(route(&health, &req)) }
                });
                let conn = http1::Builder::new().serve_connection(TokioIo::new(stream), service);
                tokio::select! {
                    result = conn => if let Err(e) = result { debug!(%peer, error = %e, "admin connection failed") },
                    () = conn_shutdown.cancelled() => {}
                }
            });
        }
    }
}

fn route<B>(health: &Health, req: &Request<B>) -> Response<Full<Bytes>> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return text(StatusCode::METHOD_NOT_ALLOWED, "only GET is served here\n");
    }
    match req.uri().path() {
        "/healthz" | "/livez" => report(&health.live()),
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

    #[test]
    fn routes_probes_with_status_codes() {
        let health = Health::default();
        health.readiness("handlers", || Check::fail("none connected"));
        let get = |path: &str| Request::get(path).body(()).unwrap();
        assert_eq!(route(&health, &get("/healthz")).status(), StatusCode::OK);
        assert_eq!(
            route(&health, &get("/readyz")).status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(route(&health, &get("/nope")).status(), StatusCode::NOT_FOUND);
    }
}
