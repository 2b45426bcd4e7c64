//! The HTTP transport of the controller's API clients: kube-rs's own layers (base URI, retries
//! of 429/503/504, authentication with token refresh, extra headers), its TLS configuration and
//! its connect, read and write timeouts, on a connection pool that keeps only what the steady
//! state needs and speaks HTTP/2 wherever the API server offers it.
//!
//! Why HTTP/2: kube-rs speaks HTTP/1.1 only, so every request in flight needs a connection of
//! its own, with its TLS session and buffers. A start-up or a burst of writes runs
//! `--api-requests` requests at once, and their dozens of connections (handshakes, TLS state,
//! read and write buffers) were the largest part of the burst's memory and much of its CPU, on
//! both sides. Over HTTP/2, which the API server negotiates over TLS as it does with client-go,
//! the requests share one connection. Keep-alive pings find a connection that stopped
//! answering while requests wait on it ([`KEEP_ALIVE`]). A plain-HTTP API server, or one that
//! offers only HTTP/1.1, is spoken to in HTTP/1.1.
//!
//! Why watches stay on HTTP/1.1, each on a connection of its own: a watch is a stream that
//! lasts minutes, the API server allows a connection only so many streams at once (100 unless
//! configured otherwise), and this pool never opens a second HTTP/2 connection to the same
//! server: watches sharing the requests' connection could hold every request back. And a watch
//! whose events wait to be taken (the queue's backpressure) leaves them in the kernel's socket
//! buffer, where over HTTP/2 they would have to be read into the controller's memory to get at
//! the other streams.
//!
//! Why leases and peering do too: over HTTP/2 every request goes to the one connection until
//! keep-alive pings find it dead ([`KEEP_ALIVE`] twice), and a connection that stopped
//! answering without being closed (an API server lost behind a load balancer) would hold every
//! renewal of the leader's lease until the renewal deadline (10 s by default) passed and the
//! leader stepped down. Over HTTP/1.1 a renewal that times out closes its connection, and the
//! next one opens a new connection.
//!
//! An HTTP/2 connection is forgotten by the pool 4–8 s after its last request, like an idle
//! HTTP/1.1 connection, and closes once its last request ends; the next request opens a new one.
//! Until a connection has negotiated HTTP/2, the pool cannot know that requests may share it:
//! requests made at once before then each open their own, and those left over close when idle.
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

/// How much of one HTTP/2 stream's answer may wait unread (hyper's default: 2 MiB; client-go's:
/// 4 MiB): a page of a LIST arrives at full speed, and an answer being read holds at most this.
pub const STREAM_WINDOW: u32 = 1024 * 1024;

/// How much of all streams' answers may wait unread on one HTTP/2 connection: client-go's
/// (1 GiB), so that the streams' own windows are the only bound and an answer read slowly
/// cannot hold back other requests' answers. It is credit given to the API server, not memory
/// set aside.
pub const CONNECTION_WINDOW: u32 = 1024 * 1024 * 1024;

/// While requests wait on an HTTP/2 connection, one with nothing received for this long is
/// pinged, and closed when the ping gets no answer within as long, failing its requests (their
/// callers retry them, on a new connection). Over HTTP/1.1 a request that hangs holds its
/// connection alone and the next request opens another; over HTTP/2 every new request would go
/// to the connection that stopped answering until this closes it, so it is short (client-go:
/// 30 s and 15 s) and shorter than the default request timeout.
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
    let tls = config.rustls_client_config()?;
    let server_name = match &config.tls_server_name {
        Some(name) => Some(
            ServerName::try_from(name.clone())
                .map_err(|e| kube::Error::RustlsTls(RustlsTlsError::InvalidServerName(e)))?,
        ),
        None => None,
    };
    let connector = |tls, http2: bool| {
        let mut http = HttpConnector::new();
        http.enforce_http(false);
        // An HTTP/2 request with a body is written as two frames one after the other: with
        // Nagle's algorithm the second waits for the API server's (delayed) acknowledgement of
        // the first, 40 ms a write. client-go turns it off too (Go's default).
        http.set_nodelay(true);
        let https = HttpsConnectorBuilder::new().with_tls_config(tls).https_or_http();
        let https = match &server_name {
            Some(name) => https.with_server_name_resolver(FixedServerNameResolver::new(name.clone())),
            None => https,
        };
        // Requests offer HTTP/2 and HTTP/1.1 over TLS (ALPN), and the API server picks;
        // watches, leases and peering speak HTTP/1.1 (see the module docs).
        let https = if http2 {
            https.enable_all_versions().wrap_connector(http)
        } else {
            https.enable_http1().wrap_connector(http)
        };
        // As kube-rs does: the connect timeout covers the TLS handshake too.
        let mut connector = TimeoutConnector::new(https);
        connector.set_connect_timeout(config.connect_timeout);
        connector.set_read_timeout(config.read_timeout);
        connector.set_write_timeout(config.write_timeout);
        connector.set_reset_reader_on_write(config.reset_reader_on_write);
        connector
    };
    let mut pool = Pool::builder(TokioExecutor::new());
    pool.pool_max_idle_per_host(idle.max(1))
        .pool_idle_timeout(idle_timeout)
        .pool_timer(TokioTimer::new())
        .http1_max_buf_size(BUFFER_LIMIT)
        .timer(TokioTimer::new())
        .http2_initial_stream_window_size(STREAM_WINDOW)
        .http2_initial_connection_window_size(CONNECTION_WINDOW)
        .http2_keep_alive_interval(KEEP_ALIVE)
        .http2_keep_alive_timeout(KEEP_ALIVE);
    let requests: Pool<_, Body> = pool.build(connector(tls.clone(), true));
    let own: Pool<_, Body> = pool.build(connector(tls, false));
    let pools = tower::service_fn(move |request: http::Request<Body>| {
        let uri = request.uri();
        let pool = if super::switch::is_watch(uri) || super::switch::is_coordination(uri) {
            own.clone()
        } else {
            requests.clone()
        };
        async move { pool.request(request).await }
    });
    let service = ServiceBuilder::new()
        .layer(config.base_uri_layer())
        .option_layer(
            config
                .default_retry
                .then(|| RetryLayer::new(RetryPolicy::server_retry())),
        )
        .option_layer(config.auth_layer()?)
        .layer(config.extra_headers_layer()?)
        .service(pools.map_err(BoxError::from));
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

    /// How long the test servers take to answer: long enough that requests made at once need
    /// connections (or streams) of their own.
    const ANSWER_AFTER: Duration = Duration::from_millis(50);

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
                                tokio::time::sleep(ANSWER_AFTER).await;
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

    /// The protocol of each request an HTTPS test server answered, by path and query.
    type Seen = Arc<parking_lot::Mutex<Vec<(String, http::Version)>>>;

    /// An HTTPS API server that offers `alpn` (and speaks HTTP/1.1 when the client offers none
    /// of it), answers every request with an empty namespace list after `delay`, once it has
    /// read the request's body, and counts the connections it accepted.
    async fn tls_server(alpn: &[&[u8]], delay: Duration) -> (Config, Arc<AtomicUsize>, Seen) {
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
        tls.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let acceptor = TlsAcceptor::from(Arc::new(tls));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("https://{}", listener.local_addr().unwrap());
        let accepted = Arc::new(AtomicUsize::new(0));
        let seen = Seen::default();
        let (a, s) = (accepted.clone(), seen.clone());
        tokio::spawn(async move {
            loop {
                let (socket, _) = listener.accept().await.unwrap();
                a.fetch_add(1, Ordering::SeqCst);
                let (acceptor, s) = (acceptor.clone(), s.clone());
                tokio::spawn(async move {
                    let Ok(tls) = acceptor.accept(socket).await else {
                        return;
                    };
                    let http2 = tls.get_ref().1.alpn_protocol() == Some(b"h2");
                    let answer = service_fn(move |request: http::Request<hyper::body::Incoming>| {
                        let target = request.uri().path_and_query().map(ToString::to_string);
                        s.lock().push((target.unwrap_or_default(), request.version()));
                        async move {
                            use http_body_util::BodyExt as _;
                            let _ = request.into_body().collect().await;
                            tokio::time::sleep(delay).await;
                            let body =
                                r#"{"apiVersion":"v1","kind":"NamespaceList","metadata":{},"items":[]}"#;
                            Ok::<_, std::convert::Infallible>(Response::new(Full::new(Bytes::from(body))))
                        }
                    });
                    let io = TokioIo::new(tls);
                    let _ = if http2 {
                        hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                            .serve_connection(io, answer)
                            .await
                    } else {
                        hyper::server::conn::http1::Builder::new()
                            .serve_connection(io, answer)
                            .await
                    };
                });
            }
        });
        let mut config = Config::new(url.parse().unwrap());
        config.root_cert = Some(vec![key.cert.der().to_vec()]);
        (config, accepted, seen)
    }

    /// A watch request (whose answer here is a list, which is all the test needs).
    async fn watch(client: &Client) {
        get(client, "/api/v1/namespaces?watch=true").await;
    }

    /// A request of a lease (answered with a list too).
    async fn lease(client: &Client) {
        get(
            client,
            "/apis/coordination.k8s.io/v1/namespaces/default/leases/one",
        )
        .await;
    }

    async fn get(client: &Client, target: &str) {
        let request = http::Request::get(target).body(Vec::new()).unwrap();
        client.request_text(request).await.unwrap();
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
    async fn over_tls_a_burst_shares_one_http2_connection_and_watches_and_leases_speak_http1() {
        let (config, accepted, seen) = tls_server(&[b"h2", b"http/1.1"], ANSWER_AFTER).await;
        let client = pooled(&config, IDLE, IDLE_FOR).unwrap();
        // As in the controller, where discovery comes first: until a connection has
        // negotiated HTTP/2, the pool cannot know that requests may share it, and concurrent
        // first requests would each open their own.
        list(&client).await;
        let burst = 40;
        futures::future::join_all((0..burst).map(|_| list(&client))).await;
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            1,
            "the burst's requests did not share one connection"
        );
        watch(&client).await;
        assert_eq!(
            accepted.load(Ordering::SeqCst),
            2,
            "the watch shared the requests' connection"
        );
        // A lease's renewal must not wait on a shared connection that may have stopped
        // answering (see the module docs).
        lease(&client).await;
        let seen = seen.lock();
        assert!(
            seen.iter()
                .all(|(target, version)| (*version == http::Version::HTTP_11)
                    == (target.contains("watch=true") || target.contains("/leases/"))),
            "{seen:?}"
        );
    }

    /// A request with a body goes out over HTTP/2 as a HEADERS frame and then a DATA frame,
    /// written one after the other. With Nagle's algorithm on, the DATA frame waited for the
    /// API server to acknowledge the HEADERS, which it delays by 40 ms: every write took at
    /// least 40 ms more (seen in the benchmark: 43.5 ms per object one at a time, against
    /// 5 ms over HTTP/1.1).
    #[tokio::test]
    async fn a_write_over_http2_is_not_held_back_by_nagles_algorithm() {
        let (config, _, seen) = tls_server(&[b"h2", b"http/1.1"], Duration::ZERO).await;
        let client = pooled(&config, IDLE, IDLE_FOR).unwrap();
        list(&client).await;
        let mut took = Vec::new();
        for _ in 0..9 {
            let request = http::Request::patch("/api/v1/namespaces/default")
                .header("content-type", "application/merge-patch+json")
                .body(br#"{"metadata":{"annotations":{"capstan.dev/x":"1"}}}"#.to_vec())
                .unwrap();
            let started = tokio::time::Instant::now();
            client.request_text(request).await.unwrap();
            took.push(started.elapsed());
        }
        took.sort();
        assert!(seen.lock().iter().all(|(_, v)| *v == http::Version::HTTP_2));
        // Held back, every write takes 40 ms or more; the median tolerates a loaded machine.
        assert!(took[4] < Duration::from_millis(20), "writes took {took:?}");
    }

    #[tokio::test]
    async fn a_server_that_offers_only_http1_over_tls_is_spoken_to_in_http1() {
        let (config, accepted, seen) = tls_server(&[b"http/1.1"], ANSWER_AFTER).await;
        let client = pooled(&config, IDLE, IDLE_FOR).unwrap();
        futures::future::join_all((0..4).map(|_| list(&client))).await;
        assert_eq!(accepted.load(Ordering::SeqCst), 4);
        assert!(seen.lock().iter().all(|(_, v)| *v == http::Version::HTTP_11));
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
