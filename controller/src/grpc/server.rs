//! The tonic server: `RuntimeService`, `grpc.health.v1` and server reflection, on a Unix socket
//! (the default, shared with the handler container through an `emptyDir`) or loopback TCP.
//!
//! The socket file is created with mode 0600 in a directory with mode 0700, so only the pod's
//! own user can dial it; a stale socket left by a previous run is removed first.

use std::{
    net::SocketAddr,
    os::unix::fs::{FileTypeExt, PermissionsExt},
    path::{Path, PathBuf},
    str::FromStr,
    sync::Arc,
};

use capstan_proto::pb::{
    self,
    runtime_service_server::{RuntimeService, RuntimeServiceServer},
};
use tokio::net::{TcpListener, UnixListener};
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::info;

use super::{
    connection::{self, Resolver, ResponseStream},
    hub::Hub,
};

/// Where the server listens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Listen {
    /// A Unix domain socket at this path.
    Unix(PathBuf),
    /// A TCP address (loopback, for local development).
    Tcp(SocketAddr),
}

impl FromStr for Listen {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if let Some(path) = s.strip_prefix("unix://").or_else(|| s.strip_prefix("unix:")) {
            if !path.starts_with('/') {
                return Err(format!(
                    "{s:?}: the socket path must be absolute (unix:///path/to.sock)"
                ));
            }
            return Ok(Self::Unix(PathBuf::from(path)));
        }
        let addr = s
            .strip_prefix("tcp://")
            .or_else(|| s.strip_prefix("http://"))
            .unwrap_or(s);
        addr.parse::<SocketAddr>()
            .map(Self::Tcp)
            .map_err(|_| format!("{s:?} is neither unix:///path nor HOST:PORT"))
    }
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Unix(p) => write!(f, "unix://{}", p.display()),
            Self::Tcp(a) => write!(f, "{a}"),
        }
    }
}

/// Why the server could not start or stopped abnormally.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Preparing the socket's directory or removing a stale socket failed.
    #[error("cannot prepare the socket path {path}")]
    SocketPath {
        /// The socket path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// Something other than a socket is in the way.
    #[error("{0} exists and is not a socket; refusing to remove it")]
    NotASocket(PathBuf),
    /// Binding failed (address in use, permissions).
    #[error("cannot listen on {listen}")]
    Bind {
        /// Where.
        listen: String,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The reflection service could not be built from the descriptors.
    #[error("cannot build the reflection service")]
    Reflection(#[source] tonic_reflection::server::Error),
    /// The transport failed.
    #[error("the gRPC server failed")]
    Transport(#[source] tonic::transport::Error),
}

/// The `RuntimeService` implementation: hands each stream to `connection::accept`.
struct Runtime {
    hub: Hub,
    resolver: Arc<dyn Resolver>,
    settings: connection::Settings,
    shutdown: CancellationToken,
}

#[tonic::async_trait]
impl RuntimeService for Runtime {
    type ConnectStream = ResponseStream;

    async fn connect(
        &self,
        request: Request<Streaming<pb::ConnectRequest>>,
    ) -> Result<Response<Self::ConnectStream>, Status> {
        let stream = connection::accept(
            self.hub.clone(),
            self.resolver.clone(),
            self.settings.clone(),
            self.shutdown.child_token(),
            request.into_inner(),
        )
        .await?;
        Ok(Response::new(stream))
    }
}

/// A bound gRPC server, ready to serve.
pub struct Server {
    listen: Listen,
    incoming: Incoming,
    runtime: Runtime,
}

enum Incoming {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Server {
    /// Binds the listener now, so that errors (address in use) surface before anything else
    /// starts.
    ///
    /// # Errors
    /// See [`Error`].
    pub async fn bind(
        listen: Listen,
        hub: Hub,
        resolver: Arc<dyn Resolver>,
        settings: connection::Settings,
        shutdown: CancellationToken,
    ) -> Result<Self, Error> {
        let (listen, incoming) = match listen {
            Listen::Unix(path) => {
                let listener = bind_unix(&path)?;
                (Listen::Unix(path), Incoming::Unix(listener))
            }
            Listen::Tcp(addr) => {
                let listener = TcpListener::bind(addr).await.map_err(|source| Error::Bind {
                    listen: addr.to_string(),
                    source,
                })?;
                let local = listener.local_addr().map_err(|source| Error::Bind {
                    listen: addr.to_string(),
                    source,
                })?;
                (Listen::Tcp(local), Incoming::Tcp(listener))
            }
        };
        Ok(Self {
            listen,
            incoming,
            runtime: Runtime {
                hub,
                resolver,
                settings,
                shutdown,
            },
        })
    }

    /// Where the server actually listens (with the real port for `:0`).
    pub fn local(&self) -> &Listen {
        &self.listen
    }

    /// Serves until the shutdown token is cancelled.
    ///
    /// # Errors
    /// See [`Error`].
    pub async fn serve(self) -> Result<(), Error> {
        let shutdown = self.runtime.shutdown.clone();
        let max = self.runtime.settings.max_message_bytes;
        let (health_reporter, health) = tonic_health::server::health_reporter();
        health_reporter
            .set_serving::<RuntimeServiceServer<Runtime>>()
            .await;
        let reflection = tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .build_v1()
            .map_err(Error::Reflection)?;
        let runtime = RuntimeServiceServer::new(self.runtime)
            .max_decoding_message_size(max)
            .max_encoding_message_size(max);
        let router = tonic::transport::Server::builder()
            .http2_keepalive_interval(Some(std::time::Duration::from_secs(30)))
            .http2_keepalive_timeout(Some(std::time::Duration::from_secs(10)))
            .add_service(runtime)
            .add_service(health)
            .add_service(reflection);
        info!(listen = %self.listen, "gRPC server listening");
        let stopped = shutdown.clone();
        let result = match self.incoming {
            Incoming::Unix(l) => {
                router
                    .serve_with_incoming_shutdown(UnixListenerStream::new(l), stopped.cancelled_owned())
                    .await
            }
            Incoming::Tcp(l) => {
                router
                    .serve_with_incoming_shutdown(TcpListenerStream::new(l), stopped.cancelled_owned())
                    .await
            }
        };
        if let Listen::Unix(path) = &self.listen {
            let _ = std::fs::remove_file(path);
        }
        result.map_err(Error::Transport)
    }
}

fn bind_unix(path: &Path) -> Result<UnixListener, Error> {
    let io = |source| Error::SocketPath {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent()
        && !dir.exists()
    {
        std::fs::create_dir_all(dir).map_err(io)?;
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path).map_err(io)?,
        Ok(_) => return Err(Error::NotASocket(path.to_owned())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    let listener = UnixListener::bind(path).map_err(|source| Error::Bind {
        listen: format!("unix://{}", path.display()),
        source,
    })?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io)?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_listen_addresses() {
        assert_eq!(
            "unix:///run/capstan/capstan.sock".parse(),
            Ok(Listen::Unix("/run/capstan/capstan.sock".into()))
        );
        assert_eq!(
            "127.0.0.1:7000".parse(),
            Ok(Listen::Tcp("127.0.0.1:7000".parse().unwrap()))
        );
        assert!("unix://relative.sock".parse::<Listen>().is_err());
        assert!("nonsense".parse::<Listen>().is_err());
    }

    #[test]
    fn stale_sockets_are_replaced_and_files_refused() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("sub/c.sock");
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let first = bind_unix(&sock).unwrap();
            drop(first);
            let _second = bind_unix(&sock).unwrap();
            let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
            let dir_mode = std::fs::metadata(sock.parent().unwrap())
                .unwrap()
                .permissions()
                .mode()
                & 0o777;
            assert_eq!(dir_mode, 0o700);
        });
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(bind_unix(&file), Err(Error::NotASocket(_))));
    }
}
