//! Admission webhooks (kopf's `on.validate` and `on.mutate`): the controller serves HTTPS
//! itself and forwards each `AdmissionReview` over the stream to the handler processes that
//! registered validating or mutating handlers for the resource.
//!
//! The parts, one per file:
//! - [`review`]: the `AdmissionReview` document in and out;
//! - [`admission`]: which handlers apply, their invocations, the combined verdict;
//! - [`server`]: the TLS listener and the stack of layers around the admission logic;
//! - [`slots`], [`budget`] and [`intake`]: the connection slots, the memory budget, and the
//!   reading of a request into a typed review within them;
//! - [`certs`]: the serving certificate, generated or read from (reloaded) files;
//! - [`shared_ca`]: the CA of generated certificates shared by the replicas through a Secret;
//! - [`client_ca`]: the CA whose client certificates callers must present, when one is set;
//! - [`configs`] and [`managed`]: the managed webhook configurations;
//! - [`args`]: the `capstan run` flags.
//!
//! Decisions:
//! - With `--webhooks=auto` (the default) the server starts when the first validate or
//!   mutate handler is registered, and keeps serving from then on; `on` binds at start (a port
//!   in use fails the start); `off` rejects admission handlers at the handshake.
//! - Every replica serves the webhooks (the API server calls whichever the Service picks), and
//!   admission is not paused by freezing or on a standby, as in kopf; only the managed
//!   configurations are the leader's to write.
//! - A handler stays known while its process is away (as in the engine), so that its webhook
//!   is not dropped from the configurations by a restart; requests meanwhile follow its
//!   `ignore_failures`. It is forgotten when processes are connected and none registers it.
//! - Certificates: generated (a CA and a serving certificate for the Service's DNS names and
//!   loopback) unless `--webhook-cert-dir` names a mounted Secret, whose files are reloaded
//!   when they change. With leader election a generated certificate needs one CA for all
//!   replicas (`--webhook-ca-secret`), or the replicas the leader's bundle does not cover would
//!   fail every review sent to them: without it the webhooks are refused (at start with
//!   `--webhooks on`, at registration of admission handlers with `auto`). In development (no `--webhook-service`), the configurations address
//!   the server by URL, `https://127.0.0.1:<port>` unless `--webhook-url` says otherwise.

pub mod admission;
pub mod args;
pub mod budget;
pub mod certs;
pub mod client_ca;
pub mod configs;
pub mod intake;
pub mod managed;
pub mod review;
pub mod server;
pub mod shared_ca;
pub mod slots;

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use tokio::{sync::watch, task::JoinHandle};
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, error, info_span};

use crate::{engine::registry::Registry, grpc::Hub, model::Registration};

/// When the webhook server runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// Once the first validate or mutate handler is registered.
    #[default]
    Auto,
    /// From the start.
    On,
    /// Never; admission handlers are rejected.
    Off,
}

/// The Service the API server reaches the webhook server through.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Service {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// Its port.
    pub port: u16,
}

/// Everything the webhooks need.
#[derive(Clone, Debug)]
pub struct Settings {
    /// When the server runs.
    pub mode: Mode,
    /// Where it listens. Default `0.0.0.0:9443`.
    pub listen: SocketAddr,
    /// Body limit and the default timeout.
    pub server: server::Settings,
    /// A directory with `tls.crt`, `tls.key` (and `ca.crt`); `None`: generate.
    pub cert_dir: Option<PathBuf>,
    /// How often the certificate files are looked at.
    pub cert_poll: Duration,
    /// More names for a generated certificate.
    pub extra_names: Vec<String>,
    /// A CA bundle whose client certificates callers must present; `None`: any caller.
    pub client_ca: Option<PathBuf>,
    /// The Secret (namespace, name) keeping the CA of generated certificates for every replica;
    /// `None`: each process makes its own.
    pub ca_secret: Option<(String, String)>,
    /// Leader election is on: another replica may write the configurations, with its CA.
    pub leader_election: bool,
    /// The Service in front of the server (in a cluster).
    pub service: Option<Service>,
    /// The base URL of the server (development); default `https://127.0.0.1:<port>`.
    pub url: Option<String>,
    /// The name of the managed configurations; `None`: unmanaged.
    pub managed: Option<String>,
    /// Keep the managed configurations when the controller stops.
    pub keep_on_exit: bool,
    /// Namespaces the managed configurations never send to the webhooks.
    pub excluded_namespaces: Vec<String>,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            mode: Mode::Auto,
            listen: SocketAddr::from(([0, 0, 0, 0], 9443)),
            server: server::Settings::default(),
            cert_dir: None,
            cert_poll: Duration::from_secs(10),
            extra_names: Vec::new(),
            client_ca: None,
            ca_secret: None,
            leader_election: false,
            service: None,
            url: None,
            managed: None,
            keep_on_exit: false,
            excluded_namespaces: vec!["kube-system".into()],
        }
    }
}

/// Why the webhooks could not start.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The certificates could not be made or read.
    #[error("cannot set up the webhook certificates")]
    Certificates(#[from] certs::Error),
    /// The server could not start.
    #[error("cannot start the webhook server")]
    Server(#[from] server::Error),
    /// The client CA could not be read.
    #[error("cannot set up the webhook client CA")]
    ClientCa(#[from] client_ca::Error),
    /// The shared CA could not be read or created.
    #[error("cannot set up the shared webhook CA")]
    SharedCa(#[from] shared_ca::Error),
    /// A generated certificate with leader election needs a CA shared by the replicas.
    #[error("{NEEDS_SHARED_CA}")]
    NeedsSharedCa,
}

/// Why a generated certificate is refused with leader election and no shared CA.
pub const NEEDS_SHARED_CA: &str = "a generated webhook certificate with leader election needs a CA shared by the replicas: \
     each process would make its own CA and the API server trusts only the leader's, so reviews sent to the other replicas \
     (and to the new pods of every rollout) fail; set --webhook-ca-secret <name> (the chart does), or give a certificate \
     with --webhook-cert-dir";

impl Settings {
    /// Whether the replicas would serve certificates of different CAs.
    pub fn needs_shared_ca(&self) -> bool {
        self.leader_election && self.cert_dir.is_none() && self.ca_secret.is_none()
    }
}

/// How long a lazily started server waits before binding again after a failure.
const REBIND_DELAY: Duration = Duration::from_secs(5);
/// How long the webhook tasks get to stop.
const STOP_TIMEOUT: Duration = Duration::from_secs(15);

/// The running webhooks.
pub struct Webhooks {
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    manager: JoinHandle<()>,
    handlers: watch::Receiver<Arc<Vec<Registration>>>,
    certs: Option<Certificates>,
}

pub use certs::Certificates;

impl Webhooks {
    /// Starts the webhooks (nothing with [`Mode::Off`]): the handler tracking, the certificate
    /// reloads, the server (now or once needed) and the configuration manager, which writes
    /// under the latest of `managed_names` (the flag's, or a handler process's setting).
    ///
    /// # Errors
    /// When the certificates cannot be made or read, or (with [`Mode::On`]) the server cannot
    /// bind.
    pub async fn start(
        settings: &Settings,
        hub: &Hub,
        client: kube::Client,
        namespaces: Option<Vec<String>>,
        leading: managed::Leading,
        managed_names: watch::Receiver<Option<String>>,
    ) -> Result<Option<Self>, Error> {
        if settings.mode == Mode::Off {
            return Ok(None);
        }
        if settings.needs_shared_ca() {
            if settings.mode == Mode::On {
                return Err(Error::NeedsSharedCa);
            }
            // `auto`: nothing is served, and admission handlers are refused at registration
            // with this reason (see `cli`), so their processes learn it.
            return Ok(None);
        }
        let shared = match &settings.ca_secret {
            Some((namespace, name)) if settings.cert_dir.is_none() => {
                Some(shared_ca::obtain(client.clone(), namespace, name).await?)
            }
            _ => None,
        };
        let source = match &settings.cert_dir {
            Some(dir) => certs::Source::Files {
                dir: dir.clone(),
                poll: settings.cert_poll,
            },
            None => certs::Source::SelfSigned {
                names: certs::names(
                    settings
                        .service
                        .as_ref()
                        .map(|s| (s.namespace.as_str(), s.name.as_str())),
                    &settings.extra_names,
                ),
                ca: shared,
            },
        };
        let certs = Certificates::new(source)?;
        let clients = settings
            .client_ca
            .as_deref()
            .map(client_ca::ClientCa::load)
            .transpose()?;
        let stop = CancellationToken::new();
        let (tx, handlers) = watch::channel(Arc::new(Vec::new()));
        let mut tasks = vec![
            tokio::spawn(
                follow(hub.registrations(), tx, stop.clone()).instrument(info_span!("webhook-handlers")),
            ),
            tokio::spawn(
                certs
                    .clone()
                    .watch_files(stop.clone())
                    .instrument(info_span!("webhook-certs")),
            ),
        ];
        if let Some(clients) = &clients {
            tasks.push(tokio::spawn(
                clients
                    .clone()
                    .watch(settings.cert_poll, stop.clone())
                    .instrument(info_span!("webhook-client-ca")),
            ));
        }
        let admission = admission::Admission::new(hub.clone(), handlers.clone());
        let bound = match settings.mode {
            Mode::On => Some(
                server::Server::bind(
                    settings.listen,
                    &certs,
                    clients.as_ref(),
                    admission.clone(),
                    settings.server.clone(),
                )
                .await?,
            ),
            _ => None,
        };
        tasks.push(tokio::spawn(
            serve(
                settings.clone(),
                certs.clone(),
                clients,
                admission,
                bound,
                handlers.clone(),
                stop.clone(),
            )
            .instrument(info_span!("webhook-server")),
        ));
        // The name may come later, from a handler process's settings (see `managed`).
        let manager = {
            let layout = configs::Layout {
                name: String::new(),
                endpoint: match (&settings.service, &settings.url) {
                    (Some(s), _) => configs::Endpoint::Service {
                        namespace: s.namespace.clone(),
                        name: s.name.clone(),
                        port: s.port,
                    },
                    (None, Some(url)) => configs::Endpoint::Url(url.clone()),
                    (None, None) => {
                        configs::Endpoint::Url(format!("https://127.0.0.1:{}", settings.listen.port()))
                    }
                },
                ca_bundle: Vec::new(),
                timeout_seconds: u8::try_from(settings.server.default_timeout.as_secs().clamp(1, 30))
                    .unwrap_or(10),
                namespaces: namespaces.clone(),
                excluded_namespaces: settings.excluded_namespaces.clone(),
            };
            let manager = managed::Manager::new(
                client.clone(),
                layout,
                managed_names,
                handlers.clone(),
                certs.ca_bundle(),
                leading.clone(),
            )
            .keep_on_exit(settings.keep_on_exit);
            tokio::spawn(
                manager
                    .run(stop.clone())
                    .instrument(info_span!("webhook-configurations")),
            )
        };
        Ok(Some(Self {
            stop,
            tasks,
            manager,
            handlers,
            certs: Some(certs),
        }))
    }

    /// The admission handlers known now.
    pub fn handlers(&self) -> watch::Receiver<Arc<Vec<Registration>>> {
        self.handlers.clone()
    }

    /// The serving certificates.
    pub fn certificates(&self) -> Option<&Certificates> {
        self.certs.as_ref()
    }

    /// Stops serving, and removes the managed configurations if this replica wrote them.
    pub async fn stop(self) {
        self.stop.cancel();
        let all = async {
            let _ = self.manager.await;
            for task in self.tasks {
                let _ = task.await;
            }
        };
        if tokio::time::timeout(STOP_TIMEOUT, all).await.is_err() {
            error!("the webhook tasks did not stop in time");
        }
    }
}

/// Keeps the known admission handlers: those of connected processes, and those of processes
/// that are away, until connected processes no longer register them.
async fn follow(
    mut connected: watch::Receiver<Arc<Vec<Registration>>>,
    tx: watch::Sender<Arc<Vec<Registration>>>,
    stop: CancellationToken,
) {
    let mut registry = Registry::default();
    loop {
        let all = connected.borrow_and_update().clone();
        let admission: Vec<Registration> = all.iter().filter(|r| r.kind.is_admission()).cloned().collect();
        // A process connected without admission handlers retires the ones that are away.
        if admission.is_empty() && !all.is_empty() {
            registry = Registry::default();
        }
        registry.update(&admission);
        let known: Vec<Registration> = registry
            .all()
            .iter()
            .filter(|r| r.resource.is_some())
            .cloned()
            .collect();
        tx.send_if_modified(|current| {
            if **current == known {
                false
            } else {
                *current = Arc::new(known);
                true
            }
        });
        tokio::select! {
            () = stop.cancelled() => return,
            changed = connected.changed() => if changed.is_err() { return },
        }
    }
}

/// Runs the server: `bound` already, or once the first admission handler is known.
async fn serve(
    settings: Settings,
    certs: Certificates,
    clients: Option<client_ca::ClientCa>,
    admission: admission::Admission,
    bound: Option<server::Server>,
    mut handlers: watch::Receiver<Arc<Vec<Registration>>>,
    stop: CancellationToken,
) {
    let server = match bound {
        Some(server) => server,
        None => loop {
            while handlers.borrow_and_update().is_empty() {
                tokio::select! {
                    () = stop.cancelled() => return,
                    changed = handlers.changed() => if changed.is_err() { return },
                }
            }
            match server::Server::bind(
                settings.listen,
                &certs,
                clients.as_ref(),
                admission.clone(),
                settings.server.clone(),
            )
            .await
            {
                Ok(server) => break server,
                Err(e) => {
                    error!(error = %crate::diagnostic::chain(&e), "the admission webhook server cannot start; trying again");
                    tokio::select! {
                        () = stop.cancelled() => return,
                        () = tokio::time::sleep(REBIND_DELAY) => {}
                    }
                }
            }
        },
    };
    server.serve(stop).await;
}
