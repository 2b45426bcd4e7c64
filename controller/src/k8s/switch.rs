//! A swappable API client: the credentials behind every API call can change while the
//! controller runs (kopf's `on.login` handlers), without any user of the client noticing.
//!
//! Every component (objects, watches, Events, peering, leases) holds the same
//! [`kube::Client`] built on a routing service that forwards each request to the *current*
//! inner client. [`Switchable::install`] builds a client from login credentials, checks that
//! the API server accepts them, and swaps it in; requests already running (open watch
//! streams) finish on the old connection and the next request uses the new credentials. A
//! `401 Unauthorized` from the API is reported through [`Switchable::unauthorized`], so the
//! login handlers can be called again (kopf invalidates the credentials and re-logs in).
//!
//! Chicken and egg: resolving selectors at handshake time needs a client before any login
//! handler could have run, so discovery always uses the *base* client — the kubeconfig or
//! in-cluster service account that kube-rs finds ([`Switchable::base`]); that identity needs
//! only the discovery permission every authenticated user has. Without any kubeconfig or
//! in-cluster configuration the controller does not start, even when a login handler would
//! provide credentials later: a limitation, documented rather than worked around. Credentials
//! that expire are renewed ahead of their expiration on both sides: the base client's
//! exec-plugin tokens (a kubeconfig `exec` user with an `expirationTimestamp`) are run again
//! by kube-rs a minute before they expire (an in-cluster service-account token file is re-read
//! every minute, so rotated tokens are picked up), and login-handler credentials with an `expiration`
//! by the login activity ([`crate::engine::activities`]).
//!
//! Every request through either client is bounded: kube-rs sets no read timeout, so a request
//! on a connection that stopped answering would hang forever (and with it the worker that
//! holds a permit of the global limit). The answer's headers must arrive within the request
//! timeout, and for everything but watches the whole body too; a watch's body streams for as
//! long as the watch lives and is guarded by the watch's own inactivity timeout
//! ([`crate::k8s::watch`]). Every request's outcome feeds [`Reachability`].
//!
//! At most `--api-requests` requests other than watches are in flight at once; more wait
//! their turn (first come first served, within their request timeout). Over HTTP/2 (see
//! [`transport`]) they are streams of one connection; over HTTP/1.1 each request in flight
//! holds a connection of its own with its TLS and read buffers, so a burst of processing (a
//! start with thousands of unhandled objects, `--worker-limit` cycles writing at once) would
//! otherwise open a connection per cycle.

use std::{
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use futures::future::BoxFuture;
use http::{Request, Response, StatusCode, Uri};
use hyper::body::{Frame, SizeHint};
use kube::{
    Client, Config,
    client::Body,
    config::{KubeConfigOptions, Kubeconfig},
};
use parking_lot::RwLock;
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};

use super::{
    client::{self, USER_AGENT},
    reachability::{self, Reachability},
    transport,
};
use crate::model::Credentials;

/// Why credentials could not be used.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The credentials do not make a client (bad PEM, bad URL, nothing to authenticate with).
    #[error("the login credentials are unusable: {0}")]
    Unusable(String),
    /// The API server rejected the credentials.
    #[error("the API server rejected the login credentials ({0})")]
    Rejected(String),
    /// The API server could not be reached with them.
    #[error("the API server is unreachable with the login credentials")]
    Unreachable(#[source] kube::Error),
}

/// How long checking new credentials may take.
const VERIFY_TIMEOUT: Duration = Duration::from_secs(10);

/// At most this many requests other than watches in flight, unless configured otherwise.
/// Measured with a 10,000-object burst: 64 gave the shortest total, the least API-server CPU
/// and a median latency of 0.5 s; 128 (as many as objects processed at once) cost the API
/// server more and the controller ~3 MiB more at its peak (one connection and its buffers
/// per request) for a slower median (0.8 s); 32 saved memory again but held objects back in
/// the controller (median 3.4 s).
pub const DEFAULT_REQUESTS_IN_FLIGHT: usize = 64;

/// How long one API request may take unless configured otherwise.
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// A request that got no answer within its timeout.
#[derive(Debug, thiserror::Error)]
#[error("the API server did not answer within {0:?}")]
pub struct TimedOut(pub Duration);

/// The API client whose credentials can be replaced. Cheap to clone.
#[derive(Clone)]
pub struct Switchable {
    inner: Arc<Inner>,
    routed: Client,
    base: Client,
}

struct Inner {
    base_config: Config,
    base: Client,
    current: RwLock<Client>,
    identity: RwLock<String>,
    unauthorized: watch::Sender<u64>,
    /// The request timeout; handler processes may change it (`networking.request_timeout`).
    timeout: RwLock<Duration>,
    reachability: Reachability,
    /// Room for requests other than watches (see the module docs).
    requests: Arc<Semaphore>,
    /// How many connections the pool of a client built for new credentials keeps idle.
    pool_idle: usize,
    /// The user agent of every request, also under new credentials.
    user_agent: http::HeaderValue,
}

impl Switchable {
    /// Builds the base client from the kubeconfig or the in-cluster configuration.
    ///
    /// # Errors
    /// [`client::Error::Config`] when neither works.
    pub async fn connect(
        timeout: Duration,
        requests: usize,
        user_agent: http::HeaderValue,
    ) -> Result<Self, client::Error> {
        let mut config = Config::infer()
            .await
            .map_err(|e| client::Error::Config(kube::Error::InferConfig(e)))?;
        with_user_agent(&mut config, &user_agent);
        let base = transport::client(&config, requests).map_err(client::Error::Config)?;
        Ok(Self::build(
            config,
            base,
            timeout,
            Reachability::global(),
            requests,
            user_agent,
        ))
    }

    /// Wraps an existing base client; every request gets `timeout` (see the module docs).
    /// Reachability is recorded in an instance of its own ([`Switchable::connect`] uses the
    /// process-wide one).
    pub fn new(base_config: Config, base: Client, timeout: Duration) -> Self {
        Self::build(
            base_config,
            base,
            timeout,
            Reachability::default(),
            DEFAULT_REQUESTS_IN_FLIGHT,
            http::HeaderValue::from_static(USER_AGENT),
        )
    }

    fn build(
        base_config: Config,
        base: Client,
        timeout: Duration,
        reachability: Reachability,
        requests: usize,
        user_agent: http::HeaderValue,
    ) -> Self {
        let namespace = base.default_namespace().to_owned();
        let (unauthorized, _) = watch::channel(0);
        let inner = Arc::new(Inner {
            base_config,
            current: RwLock::new(base.clone()),
            base,
            identity: RwLock::new("kubeconfig".to_owned()),
            unauthorized,
            timeout: RwLock::new(timeout),
            reachability,
            requests: Arc::new(Semaphore::new(requests.max(1))),
            pool_idle: requests.max(1),
            user_agent,
        });
        let routed = Client::new(
            Route {
                inner: inner.clone(),
                base: false,
            },
            namespace.clone(),
        );
        let base = Client::new(
            Route {
                inner: inner.clone(),
                base: true,
            },
            namespace,
        );
        Self { inner, routed, base }
    }

    /// The client every component uses: requests go to the current credentials.
    pub fn client(&self) -> Client {
        self.routed.clone()
    }

    /// The timeout of requests made from now on (requests already running keep theirs).
    pub fn request_timeout(&self) -> Duration {
        *self.inner.timeout.read()
    }

    /// Sets the timeout of the requests made from now on (kopf's `networking.request_timeout`
    /// from a handler process's settings).
    pub fn set_request_timeout(&self, timeout: Duration) {
        *self.inner.timeout.write() = timeout;
    }

    /// The kubeconfig / in-cluster client, for discovery (see the module docs).
    pub fn base(&self) -> Client {
        self.base.clone()
    }

    /// Whether the API server answers, as the requests of both clients found.
    pub fn reachability(&self) -> Reachability {
        self.inner.reachability.clone()
    }

    /// Which credentials are in use: `kubeconfig` or the login handler's id.
    pub fn identity(&self) -> String {
        self.inner.identity.read().clone()
    }

    /// Bumped on every `401 Unauthorized` answer.
    pub fn unauthorized(&self) -> watch::Receiver<u64> {
        self.inner.unauthorized.subscribe()
    }

    /// Builds a client from `credentials`, checks that the API server accepts them, and
    /// makes it the current one. `source` names them in logs (the login handler's id).
    ///
    /// # Errors
    /// See [`Error`]; the previous credentials stay in use.
    pub async fn install(&self, source: &str, credentials: &Credentials) -> Result<(), Error> {
        let config = self.config_for(credentials).await?;
        let client =
            transport::client(&config, self.inner.pool_idle).map_err(|e| Error::Unusable(e.to_string()))?;
        match tokio::time::timeout(VERIFY_TIMEOUT, client.list_core_api_versions()).await {
            Err(_) => {
                return Err(Error::Unreachable(kube::Error::Service(
                    "no answer within 10 s".into(),
                )));
            }
            Ok(Err(kube::Error::Api(status))) if status.code == 401 || status.code == 403 => {
                return Err(Error::Rejected(format!("{} {}", status.code, status.message)));
            }
            Ok(Err(e)) => return Err(Error::Unreachable(e)),
            Ok(Ok(_)) => {}
        }
        *self.inner.current.write() = client;
        *self.inner.identity.write() = source.to_owned();
        Ok(())
    }

    async fn config_for(&self, c: &Credentials) -> Result<Config, Error> {
        let base = &self.inner.base_config;
        let server = if c.server.is_empty() {
            base.cluster_url.to_string()
        } else {
            c.server.clone()
        };
        let mut cluster = json!({ "server": server });
        if c.insecure {
            cluster["insecure-skip-tls-verify"] = json!(true);
        }
        if !c.certificate_authority.is_empty() {
            cluster["certificate-authority-data"] = b64(&c.certificate_authority)?;
        }
        let mut user = json!({});
        if !c.token.is_empty() {
            user["token"] = json!(c.token);
        }
        if !c.username.is_empty() {
            user["username"] = json!(c.username);
            user["password"] = json!(c.password);
        }
        if !c.client_certificate.is_empty() {
            user["client-certificate-data"] = b64(&c.client_certificate)?;
            user["client-key-data"] = b64(&c.client_key)?;
        }
        if user.as_object().is_some_and(serde_json::Map::is_empty) {
            return Err(Error::Unusable(
                "no token, basic auth or client certificate was returned".into(),
            ));
        }
        let mut context = json!({ "cluster": "login", "user": "login" });
        if !c.default_namespace.is_empty() {
            context["namespace"] = json!(c.default_namespace);
        }
        let kubeconfig: Kubeconfig = serde_json::from_value(json!({
            "clusters": [{ "name": "login", "cluster": cluster }],
            "users": [{ "name": "login", "user": user }],
            "contexts": [{ "name": "login", "context": context }],
            "current-context": "login",
        }))
        .map_err(|e| Error::Unusable(e.to_string()))?;
        let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .map_err(|e| Error::Unusable(e.to_string()))?;
        if c.server.is_empty() && c.certificate_authority.is_empty() {
            // The same API server as the kubeconfig's: trust what it trusts.
            config.root_cert.clone_from(&base.root_cert);
            config.root_cert_file.clone_from(&base.root_cert_file);
            config.tls_server_name.clone_from(&base.tls_server_name);
        }
        with_user_agent(&mut config, &self.inner.user_agent);
        Ok(config)
    }
}

fn with_user_agent(config: &mut Config, agent: &http::HeaderValue) {
    config.headers.push((http::header::USER_AGENT, agent.clone()));
}

/// Base64 of bytes, as kubeconfig `*-data` fields want it (through k8s-openapi's encoding).
fn b64(bytes: &[u8]) -> Result<Value, Error> {
    serde_json::to_value(k8s_openapi::ByteString(bytes.to_vec())).map_err(|e| Error::Unusable(e.to_string()))
}

/// Forwards each request to the current inner client (or the base one), bounds it by the
/// request timeout, records whether the server answered, and reports 401s.
struct Route {
    inner: Arc<Inner>,
    base: bool,
}

impl tower::Service<Request<Body>> for Route {
    type Response = Response<Bounded>;
    type Error = kube::Error;
    type Future = BoxFuture<'static, Result<Response<Bounded>, kube::Error>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let client = if self.base {
            self.inner.base.clone()
        } else {
            self.inner.current.read().clone()
        };
        let inner = self.inner.clone();
        let watch = is_watch(request.uri());
        let method = request.method().clone();
        let answered =
            move |code: &str| crate::observability::metrics::global().api_response(method.as_str(), code);
        let unlimited = watch || is_coordination(request.uri());
        Box::pin(async move {
            let timeout = *inner.timeout.read();
            let in_flight = if unlimited {
                None
            } else {
                match tokio::time::timeout(timeout, inner.requests.clone().acquire_owned()).await {
                    Ok(Ok(permit)) => Some(InFlight::new(permit)),
                    // Never closed; and a request that waited out its timeout for room is no
                    // sign of the server's health.
                    Ok(Err(_)) | Err(_) => return Err(kube::Error::Service(Box::new(TimedOut(timeout)))),
                }
            };
            // The request's own time starts once it has room: waiting for room says nothing of
            // the server.
            let deadline = tokio::time::Instant::now() + timeout;
            let response = match tokio::time::timeout_at(deadline, client.send(request)).await {
                Ok(Ok(response)) => response,
                Ok(Err(e)) => {
                    answered("error");
                    if reachability::is_unanswered(&e) {
                        inner.reachability.failed(e.to_string());
                    }
                    return Err(e);
                }
                Err(_) => {
                    answered("timeout");
                    inner.reachability.failed(TimedOut(timeout).to_string());
                    return Err(kube::Error::Service(Box::new(TimedOut(timeout))));
                }
            };
            answered(response.status().as_str());
            if reachability::is_answer(response.status()) {
                inner.reachability.answered();
            } else {
                inner
                    .reachability
                    .failed(format!("the API server answered {}", response.status()));
            }
            if response.status() == StatusCode::UNAUTHORIZED {
                inner.unauthorized.send_modify(|n| *n += 1);
            }
            let limit = (!watch).then_some((deadline, timeout));
            Ok(response.map(|body| Bounded::new(body, limit, in_flight)))
        })
    }
}

/// Leases and peering objects: the requests that keep leadership and presence. They never
/// wait behind a burst of the engine's writes, which could otherwise outlast the lease's
/// renewal deadline and hand leadership to a standby that meets the same burst; nor do they
/// share the other requests' HTTP/2 connection (see [`super::transport`]).
pub(super) fn is_coordination(uri: &Uri) -> bool {
    let path = uri.path();
    path.starts_with("/apis/coordination.k8s.io/")
        || path
            .strip_prefix("/apis/")
            .and_then(|rest| rest.strip_prefix(super::peering::GROUP))
            .is_some_and(|rest| rest.starts_with('/'))
}

/// Whether a request is a watch (`?watch=true`, `?watch=1` or `?watch=True`): its body streams
/// for as long as the watch lives.
pub(super) fn is_watch(uri: &Uri) -> bool {
    uri.query().is_some_and(|q| {
        q.split('&')
            .any(|pair| matches!(pair, "watch=true" | "watch=1" | "watch=True"))
    })
}

/// A request's room among those in flight, counted in `capstan_api_requests_in_flight`.
struct InFlight {
    _permit: OwnedSemaphorePermit,
}

impl InFlight {
    fn new(permit: OwnedSemaphorePermit) -> Self {
        crate::observability::metrics::global().api_requests(1);
        Self { _permit: permit }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        crate::observability::metrics::global().api_requests(-1);
    }
}

/// A response body that fails once its deadline passes (for everything but watches), and
/// holds its request's room until it is read or dropped.
struct Bounded {
    body: Body,
    deadline: Option<(Pin<Box<tokio::time::Sleep>>, Duration)>,
    _in_flight: Option<InFlight>,
}

impl Bounded {
    fn new(body: Body, limit: Option<(tokio::time::Instant, Duration)>, in_flight: Option<InFlight>) -> Self {
        Self {
            body,
            deadline: limit.map(|(at, timeout)| (Box::pin(tokio::time::sleep_until(at)), timeout)),
            _in_flight: in_flight,
        }
    }
}

impl hyper::body::Body for Bounded {
    type Data = hyper::body::Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        if let Some((sleep, timeout)) = self.deadline.as_mut()
            && sleep.as_mut().poll(cx).is_ready()
        {
            let timeout = *timeout;
            return Poll::Ready(Some(Err(Box::new(TimedOut(timeout)))));
        }
        Pin::new(&mut self.body).poll_frame(cx).map_err(Into::into)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An HTTP API server on loopback that answers every request with the core API versions
    /// and records each request's `Authorization` header.
    async fn recording_server() -> (String, Arc<parking_lot::Mutex<Vec<String>>>) {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let seen = Arc::new(parking_lot::Mutex::new(Vec::new()));
        let record = seen.clone();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let record = record.clone();
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut byte = [0u8; 1];
                    while !head.ends_with(b"\r\n\r\n") && stream.read(&mut byte).await.is_ok_and(|n| n == 1) {
                        head.push(byte[0]);
                    }
                    let head = String::from_utf8_lossy(&head).to_string();
                    let auth = head
                        .lines()
                        .find_map(|l| {
                            l.strip_prefix("authorization: ")
                                .or_else(|| l.strip_prefix("Authorization: "))
                        })
                        .unwrap_or_default()
                        .to_owned();
                    record.lock().push(auth);
                    let body = r#"{"kind":"APIVersions","versions":["v1"],"serverAddressByClientCIDRs":[]}"#;
                    let reply = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = stream.write_all(reply.as_bytes()).await;
                });
            }
        });
        (url, seen)
    }

    /// A kubeconfig whose user is an exec plugin that counts its runs and returns the token
    /// `t<run>`, expiring `lifetime` seconds later.
    async fn exec_config(server: &str, dir: &std::path::Path, lifetime: u64) -> Config {
        let counter = dir.join("runs");
        let script = format!(
            "n=$(( $(cat {c} 2>/dev/null || echo 0) + 1 )); echo $n > {c}; \
             printf '{{\"apiVersion\":\"client.authentication.k8s.io/v1beta1\",\"kind\":\"ExecCredential\",\"status\":{{\"token\":\"t%s\",\"expirationTimestamp\":\"%s\"}}}}' $n \"$(date -u -d '+{lifetime} seconds' +%Y-%m-%dT%H:%M:%SZ)\"",
            c = counter.display()
        );
        let kubeconfig: Kubeconfig = serde_json::from_value(json!({
            "clusters": [{"name": "c", "cluster": {"server": server}}],
            "users": [{"name": "u", "user": {"exec": {
                "apiVersion": "client.authentication.k8s.io/v1beta1",
                "command": "sh", "args": ["-c", script], "interactiveMode": "Never"}}}],
            "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
            "current-context": "x",
        }))
        .unwrap();
        Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
            .await
            .unwrap()
    }

    /// The kubeconfig's exec-plugin credentials are run again before their
    /// `expirationTimestamp` (kube-rs refreshes them a minute ahead), not after a 401.
    #[tokio::test]
    async fn exec_plugin_credentials_are_renewed_before_they_expire() {
        // (The plugin also runs while the client is built: the numbers start higher than 1.)
        for (lifetime, renewed) in [(30, true), (3600, false)] {
            let dir = tempfile::tempdir().unwrap();
            let (url, seen) = recording_server().await;
            let config = exec_config(&url, dir.path(), lifetime).await;
            let base = transport::client(&config, 4).unwrap();
            let switch = Switchable::new(config, base, DEFAULT_REQUEST_TIMEOUT);
            for _ in 0..2 {
                switch.base().list_core_api_versions().await.unwrap();
            }
            let seen = seen.lock().clone();
            assert_eq!(seen.len(), 2);
            assert!(seen.iter().all(|a| a.starts_with("Bearer t")), "{seen:?}");
            assert_eq!(
                seen[0] != seen[1],
                renewed,
                "credentials living {lifetime} s: {seen:?}"
            );
        }
    }

    fn fake(status: StatusCode) -> Client {
        let service = tower::service_fn(move |_req: Request<Body>| async move {
            let body = if status == StatusCode::OK {
                r#"{"kind":"APIVersions","versions":["v1"],"serverAddressByClientCIDRs":[]}"#
            } else {
                r#"{"kind":"Status","apiVersion":"v1","status":"Failure","message":"Unauthorized","reason":"Unauthorized","code":401}"#
            };
            let mut response = Response::new(Body::from(body.as_bytes().to_vec()));
            *response.status_mut() = status;
            Ok::<_, std::convert::Infallible>(response)
        });
        Client::new(service, "default")
    }

    fn config() -> Config {
        Config::new("https://127.0.0.1:6443".parse().unwrap())
    }

    #[tokio::test]
    async fn reports_unauthorized_answers() {
        let switch = Switchable::new(config(), fake(StatusCode::UNAUTHORIZED), DEFAULT_REQUEST_TIMEOUT);
        let mut rx = switch.unauthorized();
        let err = switch.client().list_core_api_versions().await.unwrap_err();
        assert!(matches!(err, kube::Error::Api(s) if s.code == 401));
        assert!(rx.has_changed().unwrap());
        assert_eq!(*rx.borrow_and_update(), 1);
    }

    /// Answers after a second; counts the requests it serves at once.
    fn slow(running: Arc<std::sync::atomic::AtomicU32>, most: Arc<std::sync::atomic::AtomicU32>) -> Client {
        use std::sync::atomic::Ordering;
        let service = tower::service_fn(move |_req: Request<Body>| {
            let (running, most) = (running.clone(), most.clone());
            async move {
                let now = running.fetch_add(1, Ordering::SeqCst) + 1;
                most.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_secs(1)).await;
                running.fetch_sub(1, Ordering::SeqCst);
                let body = r#"{"kind":"APIVersions","versions":["v1"],"serverAddressByClientCIDRs":[]}"#;
                Ok::<_, std::convert::Infallible>(Response::new(Body::from(body.as_bytes().to_vec())))
            }
        });
        Client::new(service, "default")
    }

    #[tokio::test(start_paused = true)]
    async fn requests_beyond_the_limit_wait_their_turn_and_all_complete() {
        use std::sync::atomic::{AtomicU32, Ordering};
        let (running, most) = (Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        let base = slow(running, most.clone());
        let switch = Switchable::build(
            config(),
            base,
            DEFAULT_REQUEST_TIMEOUT,
            Reachability::default(),
            3,
            http::HeaderValue::from_static(USER_AGENT),
        );
        let started = tokio::time::Instant::now();
        let all = futures::future::join_all((0..10).map(|_| {
            let client = switch.client();
            async move { client.list_core_api_versions().await }
        }))
        .await;
        assert!(all.iter().all(Result::is_ok), "{all:?}");
        assert_eq!(most.load(Ordering::SeqCst), 3, "at most the limit in flight");
        assert!(
            started.elapsed() >= Duration::from_secs(4),
            "ten requests, three at a time"
        );
        assert_eq!(switch.inner.requests.available_permits(), 3, "all room is back");
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_request_never_waits_behind_a_burst() {
        use std::sync::atomic::AtomicU32;
        let base = slow(Arc::new(AtomicU32::new(0)), Arc::new(AtomicU32::new(0)));
        let switch = Switchable::build(
            config(),
            base,
            DEFAULT_REQUEST_TIMEOUT,
            Reachability::default(),
            1,
            http::HeaderValue::from_static(USER_AGENT),
        );
        let burst: Vec<_> = (0..5)
            .map(|_| {
                let client = switch.client();
                tokio::spawn(async move { client.list_core_api_versions().await })
            })
            .collect();
        tokio::time::sleep(Duration::from_millis(10)).await;
        let started = tokio::time::Instant::now();
        let lease = http::Request::get("/apis/coordination.k8s.io/v1/namespaces/a/leases/capstan")
            .body(Vec::new())
            .unwrap();
        switch.client().request_text(lease).await.unwrap();
        assert!(
            started.elapsed() < Duration::from_secs(2),
            "answered in its own second, not after the burst: {:?}",
            started.elapsed()
        );
        for request in burst {
            assert!(request.await.unwrap().is_ok());
        }
    }

    #[tokio::test]
    async fn routes_through_the_current_client() {
        let switch = Switchable::new(config(), fake(StatusCode::UNAUTHORIZED), DEFAULT_REQUEST_TIMEOUT);
        *switch.inner.current.write() = fake(StatusCode::OK);
        assert!(switch.client().list_core_api_versions().await.is_ok());
        assert!(!switch.unauthorized().has_changed().unwrap());
    }

    fn silent() -> Client {
        let service = tower::service_fn(|_req: Request<Body>| async move {
            std::future::pending::<()>().await;
            Ok::<_, std::convert::Infallible>(Response::new(Body::empty()))
        });
        Client::new(service, "default")
    }

    #[tokio::test]
    async fn a_request_that_gets_no_answer_times_out_and_marks_the_server_unreachable() {
        let switch = Switchable::new(config(), silent(), Duration::from_millis(200));
        let started = tokio::time::Instant::now();
        let err = switch.client().list_core_api_versions().await.unwrap_err();
        assert!(err.to_string().contains("did not answer"), "{err}");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(!switch.reachability().is_reachable());
        let err = switch.base().list_core_api_versions().await.unwrap_err();
        assert!(err.to_string().contains("did not answer"), "{err}");
    }

    #[tokio::test]
    async fn an_answer_marks_the_server_reachable() {
        let switch = Switchable::new(config(), fake(StatusCode::OK), DEFAULT_REQUEST_TIMEOUT);
        switch.reachability().failed("earlier");
        switch.client().list_core_api_versions().await.unwrap();
        assert!(switch.reachability().is_reachable());
    }

    #[test]
    fn watches_are_told_apart() {
        assert!(is_watch(
            &"/api/v1/pods?watch=true&resourceVersion=1".parse().unwrap()
        ));
        assert!(is_watch(&"/api/v1/pods?labelSelector=a&watch=1".parse().unwrap()));
        assert!(!is_watch(&"/api/v1/pods?limit=500".parse().unwrap()));
        assert!(!is_watch(&"/api/v1/pods".parse().unwrap()));
    }

    #[test]
    fn leases_and_peering_are_told_apart() {
        assert!(is_coordination(
            &"/apis/coordination.k8s.io/v1/namespaces/a/leases/capstan"
                .parse()
                .unwrap()
        ));
        assert!(is_coordination(
            &"/apis/capstan.dev/v1/clusterkopfpeerings/default"
                .parse()
                .unwrap()
        ));
        assert!(!is_coordination(
            &"/apis/demo.capstan.dev/v1/namespaces/a/examples/x"
                .parse()
                .unwrap()
        ));
        assert!(!is_coordination(&"/api/v1/namespaces/a/events".parse().unwrap()));
    }

    #[tokio::test]
    async fn credentials_without_identity_are_unusable() {
        let switch = Switchable::new(config(), fake(StatusCode::OK), DEFAULT_REQUEST_TIMEOUT);
        let err = switch
            .install("login_fn", &Credentials::default())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Unusable(_)), "{err}");
        let err = switch
            .install(
                "login_fn",
                &Credentials {
                    token: "t".into(),
                    certificate_authority: b"not a pem".to_vec(),
                    ..Credentials::default()
                },
            )
            .await;
        assert!(err.is_err(), "a CA that is no PEM must not be installed");
        assert_eq!(switch.identity(), "kubeconfig");
    }
}
