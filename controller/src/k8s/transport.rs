//! The HTTP transport of the controller's API clients: kube-rs's own layers (base URI, retries
//! of 429/503/504, authentication with token refresh, extra headers), its TLS configuration and
//! its connect, read and write timeouts, on a connection pool that keeps only what the steady
//! state needs and speaks HTTP/2 wherever the API server offers it.
//!
//! Why HTTP/2: kube-rs speaks HTTP/1.1 only, so every request in flight needs a connection of
//! its own, with its TLS session and buffers. A start-up or a burst of writes runs
//! `--api-requests` requests at once, and their dozens of connections (handshakes, TLS state,
//! read and write buffers) were the largest part of the burst's memory, which the allocator
//! then kept. Over HTTP/2, which the API server negotiates over TLS as it does with client-go,
//! all requests and watches share one connection. Flow control is set as client-go sets it: a
//! stream may hold [`STREAM_WINDOW`] unread, and the connection's window is large enough that
//! watches whose events wait to be taken never hold back the answers of other requests.
//! Keep-alive pings find a connection that died silently ([`KEEP_ALIVE`]). A plain-HTTP API
//! server is spoken to in HTTP/1.1. Until a connection has negotiated HTTP/2, the pool cannot
//! know that requests may share it: requests made at once before then (the controller's first
//! ones, or the first after a connection was lost) each open their own, and those left over
//! close when idle; the watches keep the one in use open.
//!
//! Why not `Client::try_from(config)`: besides HTTP/1.1 only, its pool has no idle reaper and
//! no bound on idle connections, so the connections a burst opened stay until the API server
//! closes them, and each keeps a read buffer as large as the largest answer it ever read (up to
//! ~400 KiB: a page of a LIST). Here an idle connection closes 4–8 s after its last request
//! ([`IDLE_TIMEOUT`], checked as often), at most as many HTTP/1.1 connections wait idle as
//! requests may run at once, and their buffers never grow beyond [`BUFFER_LIMIT`].
//!
//! What kube-rs's stack has that this one leaves out: its HTTP tracing (debug spans, and an
//! error line per failed request: [`crate::k8s::switch`] records failures in its reachability
//! instead), and the `valid_until` of a client whose exec plugin issues client certificates
//! (nothing here reads it). A configuration with a `proxy-url` goes to kube-rs unchanged, which
//! refuses it: this build of kube-rs has no proxy support.

use std::time::Duration;

use hyper_rustls::{FixedServerNameResolver, HttpsConnectorBuilder};
use hyper_timeout::TimeoutConnector;
use hyper_util::{
    client::legacy::{Client as Pool, connect::HttpConnector},
    rt::{TokioExecutor, TokioTimer},
};
use kube::{
    Client, Config,
    client::{Body, ConfigExt, RustlsTlsError, retry::RetryPolicy},
};
use rustls_pki_types::ServerName;
use tower::{BoxError, ServiceBuilder, ServiceExt as _, retry::RetryLayer};

/// An idle connection closes after this long, or up to twice as long (the pool checks as
/// often). Reconnecting costs a TLS handshake, which a controller busy enough to notice keeps
/// its connections busy enough to avoid.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(4);

/// The largest read or write buffer of one connection (hyper's default: ~400 KiB). A large
/// answer is read in chunks of this size; TLS records are at most 16 KiB anyway.
pub const BUFFER_LIMIT: usize = 64 * 1024;

/// How much of one HTTP/2 stream's answer may wait unread (hyper's default: 2 MiB): a page of a
/// LIST arrives at full speed, and a watch whose events wait to be taken holds at most this.
pub const STREAM_WINDOW: u32 = 1024 * 1024;

/// How much of all streams' answers may wait unread on one HTTP/2 connection: as client-go's
/// (1 GiB), so that the streams' own windows are the only bound and watches waiting to be read
/// cannot hold back other requests' answers. It is credit given to the API server, not memory
/// set aside.
pub const CONNECTION_WINDOW: u32 = 1024 * 1024 * 1024;

/// An HTTP/2 connection with nothing received for this long is pinged, and closed (failing
/// its requests and watches, which are retried on a new connection) when the ping gets no
/// answer within as long. Over HTTP/1.1 a request that hangs holds its connection alone and the
/// next request opens another; over HTTP/2 every request would go to the connection that
/// stopped answering until this closes it, so it is short (client-go: 30 s and 15 s).
pub const KEEP_ALIVE: Duration = Duration::from_secs(10);

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
    let https = HttpsConnectorBuilder::new()
        .with_tls_config(config.rustls_client_config()?)
        .https_or_http();
    let https = match &config.tls_server_name {
        Some(name) => {
            let name = ServerName::try_from(name.clone())
                .map_err(|e| kube::Error::RustlsTls(RustlsTlsError::InvalidServerName(e)))?;
            https.with_server_name_resolver(FixedServerNameResolver::new(name))
        }
        None => https,
    };
    // Offers HTTP/2 and HTTP/1.1 over TLS (ALPN); the API server picks.
    let https = https.enable_all_versions().wrap_connector(http);
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
        .timer(TokioTimer::new())
        .http2_initial_stream_window_size(STREAM_WINDOW)
        .http2_initial_connection_window_size(CONNECTION_WINDOW)
        .http2_keep_alive_interval(KEEP_ALIVE)
        .http2_keep_alive_timeout(KEEP_ALIVE)
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

    /// An HTTPS API server that speaks HTTP/2 only (as its ALPN says), answers every request
    /// with an empty namespace list after 50 ms, and counts the connections it accepted.
    async fn http2_server() -> (Config, Arc<AtomicUsize>) {
        use http_body_util::Full;
        use hyper::{Response, body::Bytes, service::service_fn};
        use hyper_util::rt::TokioIo;
        use rustls_pki_types::PrivateKeyDer;
        use tokio_rustls::{TlsAcceptor, rustls};

        let key = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut tls = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                vec![key.cert.der().clone()],
                PrivateKeyDer::Pkcs8(key.signing_key.serialize_der().into()),
            )
            .unwrap();
        tls.alpn_protocols = vec![b"h2".to_vec()];
        let acceptor = TlsAcceptor::from(Arc::new(tls));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        let accepted = Arc::new(AtomicUsize::new(0));
        let a = accepted.clone();
        tokio::spawn(async move {
            loop {
                let (socket, _) = listener.accept().await.unwrap();
                a.fetch_add(1, Ordering::SeqCst);
                let acceptor = acceptor.clone();
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(socket).await else {
                        return;
                    };
                    let answer = service_fn(|_request| async {
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        let body = r#"{"apiVersion":"v1","kind":"NamespaceList","metadata":{},"items":[]}"#;
                        Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(body))))
                    });
                    let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                        .serve_connection(TokioIo::new(tls), answer)
                        .await;
                });
            }
        });
        let mut config = Config::new(url.parse().unwrap());
        config.root_cert = Some(vec![key.cert.der().to_vec()]);
        (config, accepted)
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
    async fn over_tls_a_burst_shares_one_http2_connection() {
        let (config, accepted) = http2_server().await;
        let client = pooled(&config, IDLE, IDLE_FOR).unwrap();
        // As in the controller, where discovery comes first and watches keep the connection
        // open: until a connection has negotiated HTTP/2, the pool cannot know that requests
        // may share it, and concurrent first requests would each open their own.
        list(&client).await;
        let burst = 40;
        futures::future::join_all((0..burst).map(|_| list(&client))).await;
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "the burst's requests did not share one connection"
        );
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
