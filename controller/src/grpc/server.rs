//! The tonic server: `RuntimeService`, `grpc.health.v1` and server reflection, on a Unix socket
//! (the default, shared with the handler container through an `emptyDir`) or loopback TCP.
//!
//! The socket is created with mode 0600 (the process umask is narrowed around `bind`, so it
//! never exists with a wider mode) in a directory with mode 0700: created so, or tightened when
//! it exists and this process may change it (its owner, or root), unless it is a shared sticky
//! directory such as `/tmp`. So only the pod's own user can dial it. A socket file left at the path is removed
//! only when nothing answers on it: a live socket belongs to another controller, and starting
//! is refused rather than taking it over. At exit the socket is removed only if it is still the
//! one this process created.
//!
//! TCP is for local development and listens on loopback addresses only: the protocol has no
//! authentication, and whoever reaches it can register handlers for anything the controller
//! may list and patch. Another address is refused unless
//! `--listen-insecure-non-loopback` says otherwise, and then a warning is logged.
//!
//! Every accepted connection goes through `grpc::frames` (the HTTP/2 handshake deadline, the
//! `:authority` of gRPC C-core clients, the log of refused streams) before the HTTP/2 server.

use std::{
    net::SocketAddr,
    os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt},
    path::{Path, PathBuf},
    str::FromStr,
    sync::Arc,
};

use capstan_proto::pb::{
    self,
    runtime_service_server::{RuntimeService, RuntimeServiceServer},
};
use tokio::net::{TcpListener, UnixListener};
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::{TcpListenerStream, UnixListenerStream};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::{info, warn};

use super::{
    connection::{self, Resolver, ResponseStream},
    frames::Guarded,
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
    /// Another process serves on the socket.
    #[error("another process is serving on {0} (a second controller?); refusing to take the socket over")]
    SocketInUse(PathBuf),
    /// A TCP address that is not loopback, without the flag that allows it.
    #[error(
        "refusing to serve the unauthenticated handler protocol on {0}, which is not a loopback address; use a Unix socket, 127.0.0.1, or --listen-insecure-non-loopback"
    )]
    NotLoopback(SocketAddr),
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
    /// The socket file this process created (device and inode), removed at exit if it is
    /// still there.
    socket: Option<(u64, u64)>,
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
        let mut socket = None;
        let (listen, incoming) = match listen {
            Listen::Unix(path) => {
                let listener = bind_unix(&path)?;
                socket = std::fs::symlink_metadata(&path).ok().map(|m| (m.dev(), m.ino()));
                (Listen::Unix(path), Incoming::Unix(listener))
            }
            Listen::Tcp(addr) => {
                if !addr.ip().is_loopback() {
                    if !settings.insecure_non_loopback {
                        return Err(Error::NotLoopback(addr));
                    }
                    warn!(
                        listen = %addr,
                        "INSECURE: serving the unauthenticated handler protocol on a non-loopback address (--listen-insecure-non-loopback); anyone who reaches it can register handlers and patch objects"
                    );
                }
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
            socket,
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
        let runtime_preface_timeout = self.runtime.settings.preface_timeout;
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
        let preface = runtime_preface_timeout;
        let result = match self.incoming {
            Incoming::Unix(l) => {
                let incoming = UnixListenerStream::new(l).map(move |s| s.map(|s| Guarded::new(s, preface)));
                router
                    .serve_with_incoming_shutdown(incoming, stopped.cancelled_owned())
                    .await
            }
            Incoming::Tcp(l) => {
                let incoming = TcpListenerStream::new(l).map(move |s| s.map(|s| Guarded::new(s, preface)));
                router
                    .serve_with_incoming_shutdown(incoming, stopped.cancelled_owned())
                    .await
            }
        };
        if let (Listen::Unix(path), Some(ours)) = (&self.listen, self.socket) {
            let still_ours = std::fs::symlink_metadata(path).is_ok_and(|m| (m.dev(), m.ino()) == ours);
            if still_ours {
                let _ = std::fs::remove_file(path);
            }
        }
        result.map_err(Error::Transport)
    }
}

fn bind_unix(path: &Path) -> Result<UnixListener, Error> {
    let io = |source| Error::SocketPath {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent() {
        prepare_dir(dir).map_err(io)?;
    }
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.file_type().is_socket() => {
            if answers(path) {
                return Err(Error::SocketInUse(path.to_owned()));
            }
            info!(path = %path.display(), "removing a stale socket nobody answers on");
            std::fs::remove_file(path).map_err(io)?;
        }
        Ok(_) => return Err(Error::NotASocket(path.to_owned())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    // The socket is created with mode 0600 from the start: the umask is narrowed around bind.
    let previous = rustix::process::umask(rustix::fs::Mode::from_raw_mode(0o177));
    let bound = UnixListener::bind(path);
    rustix::process::umask(previous);
    bound.map_err(|source| Error::Bind {
        listen: format!("unix://{}", path.display()),
        source,
    })
}

/// Creates the socket's directory with mode 0700, or tightens an existing one to 0700 unless it
/// is a shared (sticky) directory such as `/tmp`; a directory this process may not change is
/// left as it is, with a warning.
fn prepare_dir(dir: &Path) -> std::io::Result<()> {
    if !dir.exists() {
        std::fs::create_dir_all(dir)?;
        return std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700));
    }
    let meta = std::fs::metadata(dir)?;
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o777 == 0o700 {
        return Ok(());
    }
    if mode & 0o1000 != 0 {
        warn!(dir = %dir.display(), mode = format!("{mode:o}"), "the socket directory is a shared sticky directory; leaving its mode alone (the socket itself is 0600)");
        return Ok(());
    }
    match std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            warn!(dir = %dir.display(), mode = format!("{mode:o}"), "cannot tighten the socket directory to 0700 (not its owner); the socket itself is 0600");
            Ok(())
        }
        Err(e) => Err(e),
    }
}

/// Whether a process accepts connections on the socket at `path`.
fn answers(path: &Path) -> bool {
    std::os::unix::net::UnixStream::connect(path).is_ok()
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
            assert!(
                matches!(bind_unix(&sock), Err(Error::SocketInUse(_))),
                "a live socket is never taken over"
            );
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
        // An existing directory with a wide mode is tightened.
        let wide = dir.path().join("wide");
        std::fs::create_dir(&wide).unwrap();
        std::fs::set_permissions(&wide, std::fs::Permissions::from_mode(0o777)).unwrap();
        let inside = wide.join("c.sock");
        rt.block_on(async { drop(bind_unix(&inside).unwrap()) });
        assert_eq!(
            std::fs::metadata(&wide).unwrap().permissions().mode() & 0o777,
            0o700
        );
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(bind_unix(&file), Err(Error::NotASocket(_))));
    }
}
