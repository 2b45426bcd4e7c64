//! The runner's side of the socket: a gRPC server of `capstan.v1.RuntimeService/Connect` that
//! hands each stream to the case being run, as bytes.
//!
//! It serves raw frames rather than typed messages so that a case can send anything, a message
//! no typed encoder would make (unknown fields, a value out of range, garbage) included, and see
//! exactly what came.

use std::{path::Path, time::Duration};

use anyhow::{Context as _, Result, anyhow};
use bytes::{Buf as _, BufMut as _};
use capstan::grpc::frames::Guarded;
use tokio::{
    net::{TcpListener, UnixListener},
    sync::mpsc,
    task::JoinHandle,
};
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream, UnixListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::{
    Status, Streaming,
    codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder},
    codegen::{Bytes, http},
    server::NamedService,
};

use super::case::Transport;

/// The largest frame either way: above the protocol's 16 MiB, so that cases can send more.
const MAX_FRAME_BYTES: usize = 64 * 1024 * 1024;

/// How long a connection may take to send the HTTP/2 preface, as the controller's default.
const PREFACE_TIMEOUT: Duration = Duration::from_secs(10);

/// One `Connect` stream of a handler process.
pub struct Connection {
    /// What the handler process sends.
    pub inbound: Streaming<Bytes>,
    /// What the runner sends; an `Err` ends the stream with that status, dropping it ends the
    /// stream with `OK`.
    pub outbound: mpsc::Sender<Result<Bytes, Status>>,
}

/// The fake controller of one case.
pub struct FakeController {
    /// What the handler process dials: `unix:///…` or `127.0.0.1:port`.
    pub endpoint: String,
    connections: mpsc::Receiver<Connection>,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl FakeController {
    /// Serves in `dir` (a Unix socket there) or on a loopback port.
    pub async fn start(transport: Transport, dir: &Path) -> Result<Self> {
        let (sender, connections) = mpsc::channel(8);
        let service = ConnectService { connections: sender };
        let stop = CancellationToken::new();
        let router = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(Duration::from_secs(30)))
            .add_service(service);
        let shutdown = stop.clone().cancelled_owned();
        let (endpoint, task) = match transport {
            Transport::Unix => {
                let path = dir.join("capstan.sock");
                let listener =
                    UnixListener::bind(&path).with_context(|| format!("binding {}", path.display()))?;
                // Through the controller's own frame layer, which takes the `:authority` gRPC
                // C-core clients send on a Unix socket, as the controller does.
                let incoming = UnixListenerStream::new(listener)
                    .map(|stream| stream.map(|stream| Guarded::new(stream, PREFACE_TIMEOUT)));
                let task = tokio::spawn(async move {
                    if let Err(error) = router.serve_with_incoming_shutdown(incoming, shutdown).await {
                        tracing::warn!(%error, "the fake controller stopped");
                    }
                });
                (format!("unix://{}", path.display()), task)
            }
            Transport::Tcp => {
                let listener = TcpListener::bind("127.0.0.1:0")
                    .await
                    .context("binding a loopback port")?;
                let address = listener.local_addr()?;
                let incoming = TcpListenerStream::new(listener)
                    .map(|stream| stream.map(|stream| Guarded::new(stream, PREFACE_TIMEOUT)));
                let task = tokio::spawn(async move {
                    if let Err(error) = router.serve_with_incoming_shutdown(incoming, shutdown).await {
                        tracing::warn!(%error, "the fake controller stopped");
                    }
                });
                (address.to_string(), task)
            }
        };
        Ok(Self {
            endpoint,
            connections,
            stop,
            task,
        })
    }

    /// The next stream a handler process opens.
    pub async fn next_connection(&mut self, within: Duration) -> Result<Connection> {
        tokio::time::timeout(within, self.connections.recv())
            .await
            .map_err(|_| anyhow!("no connection within {within:?}"))?
            .ok_or_else(|| anyhow!("the fake controller stopped"))
    }
}

impl Drop for FakeController {
    fn drop(&mut self) {
        self.stop.cancel();
        self.task.abort();
    }
}

#[derive(Clone)]
struct ConnectService {
    connections: mpsc::Sender<Connection>,
}

impl NamedService for ConnectService {
    const NAME: &'static str = "capstan.v1.RuntimeService";
}

impl tonic::codegen::Service<http::Request<tonic::body::Body>> for ConnectService {
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = tonic::codegen::BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _: &mut std::task::Context<'_>) -> std::task::Poll<Result<(), Self::Error>> {
        std::task::Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<tonic::body::Body>) -> Self::Future {
        let accept = Accept {
            connections: self.connections.clone(),
        };
        Box::pin(async move {
            if request.uri().path() != "/capstan.v1.RuntimeService/Connect" {
                return Ok(Status::unimplemented(format!("no method {}", request.uri().path())).into_http());
            }
            let mut grpc = tonic::server::Grpc::new(RawCodec)
                .max_decoding_message_size(MAX_FRAME_BYTES)
                .max_encoding_message_size(MAX_FRAME_BYTES);
            Ok(grpc.streaming(accept, request).await)
        })
    }
}

struct Accept {
    connections: mpsc::Sender<Connection>,
}

impl tonic::server::StreamingService<Bytes> for Accept {
    type Response = Bytes;
    type ResponseStream = ReceiverStream<Result<Bytes, Status>>;
    type Future = tonic::codegen::BoxFuture<tonic::Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: tonic::Request<Streaming<Bytes>>) -> Self::Future {
        let connections = self.connections.clone();
        Box::pin(async move {
            let (outbound, receiver) = mpsc::channel(64);
            connections
                .send(Connection {
                    inbound: request.into_inner(),
                    outbound,
                })
                .await
                .map_err(|_| Status::unavailable("the case is over"))?;
            Ok(tonic::Response::new(ReceiverStream::new(receiver)))
        })
    }
}

/// Frames pass as they are.
#[derive(Clone, Copy, Default)]
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Bytes;
    type Decode = Bytes;
    type Encoder = Self;
    type Decoder = Self;

    fn encoder(&mut self) -> Self::Encoder {
        Self
    }

    fn decoder(&mut self) -> Self::Decoder {
        Self
    }
}

impl Encoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Bytes;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, Status> {
        Ok(Some(src.copy_to_bytes(src.remaining())))
    }
}
