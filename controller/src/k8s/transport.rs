//! The HTTP transport of the controller's API clients: kube-rs's own layers (base URI, retries
//! of 429/503/504, authentication with token refresh, extra headers), its rustls connector and
//! its connect, read and write timeouts, on a connection pool that keeps only what the steady
//! state needs.
//!
//! Why not `Client::try_from(config)`: its pool has no idle reaper and no bound on idle
//! connections, so the connections a burst opened stay until the API server closes them, and
//! each keeps a read buffer as large as the largest answer it ever read (up to ~400 KiB: a page
//! of a LIST). A start-up burst runs `--api-requests` requests at once, so dozens of connections
//! stayed open with their TLS state and buffers long after it, and the buffers grown by LIST
//! pages were the start-up peak's largest item. Here an idle connection closes 4–8 s after its
//! last request ([`IDLE_TIMEOUT`], checked as often), at most as many wait idle as requests may
//! run at once, and a connection's buffers never grow beyond [`BUFFER_LIMIT`].
//!
//! What kube-rs's stack has that this one leaves out: its HTTP tracing (debug spans, and an
//! error line per failed request: [`crate::k8s::switch`] records failures in its reachability
//! instead), and the `valid_until` of a client whose exec plugin issues client certificates
//! (nothing here reads it). A configuration with a `proxy-url` goes to kube-rs unchanged, which
//! refuses it: this build of kube-rs has no proxy support.

use std::time::Duration;

use hyper_timeout::TimeoutConnector;
use hyper_util::{
    client::legacy::{Client as Pool, connect::HttpConnector},
    rt::{TokioExecutor, TokioTimer},
};
use kube::{
    Client, Config,
    client::{Body, ConfigExt, retry::RetryPolicy},
};
use tower::{BoxError, ServiceBuilder, ServiceExt as _, retry::RetryLayer};

/// An idle connection closes after this long, or up to twice as long (the pool checks as
/// often). Reconnecting costs a TLS handshake, which a controller busy enough to notice keeps
/// its connections busy enough to avoid.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// The largest read or write buffer of one connection (hyper's default: ~400 KiB). A large
/// answer is read in chunks of this size; TLS records are at most 16 KiB anyway.
pub const BUFFER_LIMIT: usize = 64 * 1024;

/// Builds an API client for `config` on a bounded connection pool (see the module docs) where
/// at most `idle` connections wait idle: the number of requests that may run at once, so that
/// a sustained burst mostly reuses its connections rather than closing and opening them.
///
/// # Errors
/// What kube-rs reports for an unusable configuration (bad certificates, an auth provider that
/// cannot start, a proxy).
pub fn client(config: &Config, idle: usize) -> Result<Client, kube::Error> {
    pooled(config, idle, IDLE_TIMEOUT)
}

fn pooled(config: &Config, idle: usize, idle_timeout: Duration) -> Result<Client, kube::Error> {
    if config.proxy_url.is_some() {
        return Client::try_from(config.clone());
    }
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    let https = config.rustls_https_connector_with_connector(http)?;
    // As kube-rs does: the connect timeout covers the TLS handshake too.
    let mut connector = TimeoutConnector::new(https);
    connector.set_connect_timeout(config.connect_timeout);
    connector.set_read_timeout(config.read_timeout);
    connector.set_write_timeout(config.write_timeout);
    connector.set_reset_reader_on_write(config.reset_reader_on_write);
    let pool: Pool<_, Body> = Pool::builder(TokioExecutor::new())
        .pool_max_idle_per_host(idle.max(1))
        .pool_idle_timeout(idle_timeout)
        .pool_timer(TokioTimer::new())
        .http1_max_buf_size(BUFFER_LIMIT)
        .build(connector);
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(
            config
                .default_retry
                .then(|| RetryLayer::new(RetryPolicy::server_retry())),
        )
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .service(pool.map_err(BoxError::from));
    Ok(Client::new(service, config.default_namespace.clone()))
}

#[cfg(test)]
mod tests {
    use std::sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    };

    use tokio::{
        io::{AsyncReadExt, AsyncWriteExt},
        net::TcpListener,
    };

    use super::*;

    /// The idle bound of the tests' clients.
    const IDLE: usize = 16;

    /// The idle timeout of the tests' clients.
    const IDLE_FOR: Duration = Duration::from_millis(300);

    /// A plain-HTTP API server that answers every request with an empty namespace list and
    /// counts the connections it accepted and those still open.
    async fn server() -> (Config, Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let (accepted, open) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let (a, o) = (accepted.clone(), open.clone());
        tokio::spawn(async move {
            loop {
                let (mut socket, _) = listener.accept().await.unwrap();
                a.fetch_add(1, Ordering::SeqCst);
                o.fetch_add(1, Ordering::SeqCst);
                let o = o.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    let body = r#"{"apiVersion":"v1","kind":"NamespaceList","metadata":{},"items":[]}"#;
                    loop {
                        match socket.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(_) => {
                                // Each request fits one read here; answer slowly enough that
                                // concurrent requests need connections of their own.
                                tokio::time::sleep(Duration::from_millis(50)).await;
                                let answer = format!(
                                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                                    body.len()
                                );
                                if socket.write_all(answer.as_bytes()).await.is_err() {
                                    break;
                                }
                            }
                        }
                    }
                    o.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
        let config = Config::new(url.parse().unwrap());
        (config, accepted, open)
    }

    async fn list(client: &Client) {
        let api: kube::Api<k8s_openapi::api::core::v1::Namespace> = kube::Api::all(client.clone());
        api.list(&Default::default()).await.unwrap();
    }

    #[tokio::test]
    async fn a_burst_leaves_at_most_the_idle_bound_open_and_none_after_the_idle_timeout() {
        let (config, accepted, open) = server().await;
        let client = pooled(&config, IDLE, IDLE_FOR).unwrap();
        let burst = 40;
        futures::future::join_all((0..burst).map(|_| list(&client))).await;
        assert!(
            accepted.load(Ordering::SeqCst) > IDLE,
            "the burst needed more connections than may wait idle"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        let after_burst = open.load(Ordering::SeqCst);
        assert!(
            after_burst <= IDLE,
            "{after_burst} connections open after the burst"
        );
        tokio::time::sleep(IDLE_TIMEOUT * 2 + Duration::from_millis(500)).await;
        assert_eq!(
            open.load(Ordering::SeqCst),
            0,
            "idle connections outlived the idle timeout"
        );
        // The client still works afterwards, on a new connection.
        list(&client).await;
    }

    #[tokio::test]
    async fn requests_one_after_another_share_one_connection() {
        let (config, accepted, _) = server().await;
        let client = pooled(&config, IDLE, IDLE_FOR).unwrap();
        for _ in 0..5 {
            list(&client).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }
}
