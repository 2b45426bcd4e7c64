//! An in-process controller gRPC server on a Unix socket, and a raw `capstan.v1` client.

use std::{path::PathBuf, sync::Arc, time::Duration};

use anyhow::{Context as _, Result, anyhow, bail};
use capstan::{
    grpc::{self, Hub, Listen, Resolver, connection},
    model::{Diagnostic, ResolvedResource, ResourceSelector},
};
use capstan_proto::pb::{
    self, connect_request::Message as In, connect_response::Message as Out,
    runtime_service_client::RuntimeServiceClient,
};
use futures::future::BoxFuture;
use hyper_util::rt::TokioIo;
use tokio::{net::UnixStream, sync::mpsc, task::JoinHandle};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Status, Streaming, transport::Channel};

/// Resolves `examples` (and its kind, singular and short name) to a fixed resource; everything
/// else is unknown.
pub struct TestResolver;

/// The resource `TestResolver` knows.
pub fn example_resource() -> ResolvedResource {
    ResolvedResource {
        group: "demo.capstan.dev".into(),
        version: "v1".into(),
        plural: "examples".into(),
        kind: "Example".into(),
        namespaced: true,
        status_subresource: true,
    }
}

impl Resolver for TestResolver {
    fn resolve<'a>(
        &'a self,
        selector: &'a ResourceSelector,
    ) -> BoxFuture<'a, Result<ResolvedResource, Diagnostic>> {
        Box::pin(async move {
            match selector.name.as_str() {
                "examples" | "Example" | "example" | "cex" | "examples.demo.capstan.dev" => {
                    Ok(example_resource())
                }
                other => Err(Diagnostic::error(
                    "UNKNOWN_RESOURCE",
                    format!("no resource matches {other:?}"),
                )),
            }
        })
    }
}

/// A running in-process gRPC server.
pub struct TestServer {
    /// The hub: tests act as the engine and call `hub.invoke(work)`.
    pub hub: Hub,
    /// The socket path.
    pub socket: PathBuf,
    shutdown: CancellationToken,
    task: Option<JoinHandle<()>>,
    _dir: tempfile::TempDir,
}

impl TestServer {
    /// Starts a server with default settings.
    pub async fn start() -> Result<Self> {
        Self::with_settings(connection::Settings::default(), grpc::hub::Settings::default()).await
    }

    /// Starts a server with the given settings.
    pub async fn with_settings(
        settings: connection::Settings,
        hub_settings: grpc::hub::Settings,
    ) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let socket = dir.path().join("run/capstan.sock");
        let hub = Hub::new(hub_settings);
        let shutdown = CancellationToken::new();
        let server = grpc::Server::bind(
            Listen::Unix(socket.clone()),
            hub.clone(),
            Arc::new(TestResolver),
            settings,
            shutdown.clone(),
        )
        .await?;
        let task = tokio::spawn(async move {
            if let Err(e) = server.serve().await {
                eprintln!("test server failed: {e}");
            }
        });
        Ok(Self {
            hub,
            socket,
            shutdown,
            task: Some(task),
            _dir: dir,
        })
    }

    /// The endpoint string handler processes use.
    pub fn endpoint(&self) -> String {
        format!("unix://{}", self.socket.display())
    }

    /// A channel to the server over the socket.
    pub async fn channel(&self) -> Result<Channel> {
        unix_channel(self.socket.clone()).await
    }

    /// Stops the server and waits for it.
    pub async fn stop(mut self) {
        self.shutdown.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// Dials a Unix socket as a tonic channel.
pub async fn unix_channel(path: PathBuf) -> Result<Channel> {
    let channel = tonic::transport::Endpoint::from_static("http://capstan.invalid")
        .connect_with_connector(tower::service_fn(move |_| {
            let path = path.clone();
            async move { UnixStream::connect(path).await.map(TokioIo::new) }
        }))
        .await
        .context("dialling the controller socket")?;
    Ok(channel)
}

/// A raw protocol client: sends whatever the test says, in order.
pub struct RawClient {
    tx: Option<mpsc::Sender<pb::ConnectRequest>>,
    rx: Streaming<pb::ConnectResponse>,
    /// Answer pings automatically while receiving.
    pub auto_pong: bool,
}

/// A registration for `examples` of the given kind.
pub fn registration(id: &str, kind: pb::HandlerKind) -> pb::HandlerRegistration {
    pb::HandlerRegistration {
        handler_id: id.into(),
        kind: kind as i32,
        resource: Some(pb::ResourceSelector {
            name: "examples".into(),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A hello with the given registrations and the usual capabilities.
pub fn hello(handlers: Vec<pb::HandlerRegistration>) -> pb::Hello {
    pb::Hello {
        capabilities: vec![
            pb::Capability::SdkFilters as i32,
            pb::Capability::Subhandlers as i32,
        ],
        sdk: Some(pb::SoftwareInfo {
            name: "raw-test-client".into(),
            version: "0".into(),
            language: "rust".into(),
        }),
        instance_id: "test".into(),
        handlers,
        max_in_flight: 0,
    }
}

impl RawClient {
    /// Opens a stream and sends `first` as the first message. Returns the status if the server
    /// refused the stream outright.
    pub async fn open(channel: Channel, first: In) -> Result<Result<Self, Status>> {
        let (tx, rx) = mpsc::channel(16);
        tx.send(pb::ConnectRequest { message: Some(first) })
            .await
            .map_err(|_| anyhow!("send failed"))?;
        let mut client = RuntimeServiceClient::new(channel)
            .max_decoding_message_size(64 << 20)
            .max_encoding_message_size(64 << 20);
        match client.connect(ReceiverStream::new(rx)).await {
            Ok(response) => Ok(Ok(Self {
                tx: Some(tx),
                rx: response.into_inner(),
                auto_pong: true,
            })),
            Err(status) => Ok(Err(status)),
        }
    }

    /// Opens a stream with a hello and returns the client and the welcome.
    pub async fn connect(channel: Channel, hello: pb::Hello) -> Result<(Self, pb::Welcome)> {
        let mut client = Self::open(channel, In::Hello(hello))
            .await?
            .map_err(|s| anyhow!("refused: {s:?}"))?;
        match client.recv().await? {
            Out::Welcome(w) => Ok((client, w)),
            other => bail!("expected welcome, got {other:?}"),
        }
    }

    /// Sends one message.
    pub async fn send(&self, message: In) -> Result<()> {
        let tx = self
            .tx
            .as_ref()
            .ok_or_else(|| anyhow!("client side already closed"))?;
        tx.send(pb::ConnectRequest {
            message: Some(message),
        })
        .await
        .map_err(|_| anyhow!("stream closed"))
    }

    /// Closes the client's sending side.
    pub fn close_send(&mut self) {
        self.tx = None;
    }

    /// Receives the next message other than a ping (answering pings when `auto_pong`), within
    /// 10 seconds.
    pub async fn recv(&mut self) -> Result<Out> {
        self.recv_within(Duration::from_secs(10)).await
    }

    /// Like [`RawClient::recv`] with a custom timeout.
    pub async fn recv_within(&mut self, timeout: Duration) -> Result<Out> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let next = tokio::time::timeout_at(deadline, self.rx.message())
                .await
                .map_err(|_| anyhow!("nothing received within {timeout:?}"))?;
            match next {
                Ok(Some(pb::ConnectResponse {
                    message: Some(Out::Ping(ping)),
                })) if self.auto_pong => {
                    self.send(In::Pong(pb::Pong {
                        nonce: ping.nonce,
                        in_flight: 0,
                    }))
                    .await?;
                }
                Ok(Some(pb::ConnectResponse { message: Some(m) })) => return Ok(m),
                Ok(Some(_)) => bail!("empty message from the server"),
                Ok(None) => bail!("stream ended"),
                Err(status) => return Err(anyhow!(StreamEnded(status))),
            }
        }
    }

    /// Waits for the stream to end with an error status and returns it.
    pub async fn ended(&mut self, timeout: Duration) -> Result<Status> {
        loop {
            match self.recv_within(timeout).await {
                Ok(_) => continue,
                Err(e) => {
                    return e
                        .downcast::<StreamEnded>()
                        .map(|s| s.0)
                        .map_err(|e| anyhow!("no status: {e}"));
                }
            }
        }
    }

    /// Receives the next invocation.
    pub async fn invocation(&mut self) -> Result<pb::Invocation> {
        match self.recv().await? {
            Out::Invocation(i) => Ok(i),
            other => bail!("expected an invocation, got {other:?}"),
        }
    }
}

/// The stream ended with this status.
#[derive(Debug)]
pub struct StreamEnded(pub Status);

impl std::fmt::Display for StreamEnded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "stream ended with {:?}: {}", self.0.code(), self.0.message())
    }
}

impl std::error::Error for StreamEnded {}

/// A success result with optional JSON result and patches.
pub fn success(invocation_id: &str, result: Option<&str>, patches: Vec<pb::Patch>) -> In {
    In::Result(pb::InvocationResult {
        invocation_id: invocation_id.into(),
        outcome: Some(pb::invocation_result::Outcome::Success(pb::Success {
            result: result.map(|r| pb::Json {
                json: r.as_bytes().to_vec(),
            }),
            kind_result: None,
        })),
        patches,
        ..Default::default()
    })
}

/// A `cancelled` result: the handler stopped.
pub fn cancelled(invocation_id: &str) -> In {
    In::Result(pb::InvocationResult {
        invocation_id: invocation_id.into(),
        outcome: Some(pb::invocation_result::Outcome::Cancelled(pb::Cancelled {})),
        ..Default::default()
    })
}

/// A merge patch on the object.
pub fn merge_patch(json: &str) -> pb::Patch {
    pb::Patch {
        r#type: pb::PatchType::Merge as i32,
        target: pb::PatchTarget::Object as i32,
        body: Some(pb::Json {
            json: json.as_bytes().to_vec(),
        }),
    }
}
