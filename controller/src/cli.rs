//! The command line: `capstan run | freeze | resume | version`.
//!
//! Every flag can also be given as an environment variable (`CAPSTAN_…`), which is how the Helm
//! chart configures the sidecar. The mapping onto [`Settings`] is mechanical and logic-free.

use std::{net::SocketAddr, time::Duration};

use clap::{Args, Parser, Subcommand};

use crate::{
    config::{Settings, parse_duration},
    engine::processing::Storage,
    grpc::Listen,
    observability::logging,
    persistence::{DiffBaseStorage, Keys, ProgressStorage},
};

/// Capstan runs Kubernetes operators whose handlers are written in any language.
///
/// The controller watches resources with kopf's semantics and calls the handlers of the
/// handler processes that connect to it over gRPC.
#[derive(Debug, Parser)]
#[command(name = "capstan", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
#[allow(clippy::large_enum_variant, reason = "parsed once at start-up")]
pub enum Command {
    /// Run the controller: serve handler processes and watch the cluster.
    Run(RunArgs),
    /// Pause other operators of the same peering (priority freezing).
    Freeze(PeeringArgs),
    /// Resume operators paused by `capstan freeze`.
    Resume(PeeringArgs),
    /// Print the version and the protocol version.
    Version,
}

/// Flags of `capstan run`.
#[derive(Debug, Args)]
pub struct RunArgs {
    /// Where handler processes connect: unix:///path/to.sock or 127.0.0.1:PORT.
    #[arg(
        long,
        env = "CAPSTAN_LISTEN",
        default_value = "unix:///run/capstan/capstan.sock"
    )]
    pub listen: Listen,

    /// Address of the admin HTTP endpoint serving /healthz and /readyz.
    #[arg(long, env = "CAPSTAN_ADMIN_LISTEN", default_value = "0.0.0.0:8080")]
    pub admin_listen: SocketAddr,

    /// Log format.
    #[arg(long, env = "CAPSTAN_LOG_FORMAT", value_enum, default_value_t = logging::Format::Text)]
    pub log_format: logging::Format,

    /// Log filter, in tracing's EnvFilter syntax (e.g. "info,capstan=debug").
    #[arg(long, env = "CAPSTAN_LOG", default_value = "info")]
    pub log: String,

    /// Most invocations in flight to one handler process at once (the process may ask for
    /// fewer in its hello).
    #[arg(long, env = "CAPSTAN_MAX_IN_FLIGHT", default_value_t = 256)]
    pub max_in_flight: u32,

    /// How often handler processes are pinged.
    #[arg(long, env = "CAPSTAN_PING_INTERVAL", value_parser = parse_duration, default_value = "10s")]
    pub ping_interval: Duration,

    /// How long a pong may take before the connection is considered dead and dropped.
    #[arg(long, env = "CAPSTAN_PING_TIMEOUT", value_parser = parse_duration, default_value = "30s")]
    pub ping_timeout: Duration,

    /// How long a handler process has to send its hello after connecting.
    #[arg(long, env = "CAPSTAN_HANDSHAKE_TIMEOUT", value_parser = parse_duration, default_value = "10s")]
    pub handshake_timeout: Duration,

    /// How long a cancelled invocation has to finish before it is abandoned.
    #[arg(long, env = "CAPSTAN_CANCEL_GRACE", value_parser = parse_duration, default_value = "5s")]
    pub cancel_grace: Duration,

    /// After this many consecutive handler-process losses while processing the same work, the
    /// work fails permanently (poison-pill guard).
    #[arg(long, env = "CAPSTAN_MAX_LOSSES", default_value_t = 3)]
    pub max_losses: u32,

    /// How long in-flight invocations may take to finish at shutdown.
    #[arg(long, env = "CAPSTAN_SHUTDOWN_GRACE", value_parser = parse_duration, default_value = "20s")]
    pub shutdown_grace: Duration,

    /// How long API discovery results are reused.
    #[arg(long, env = "CAPSTAN_DISCOVERY_TTL", value_parser = parse_duration, default_value = "30s")]
    pub discovery_ttl: Duration,

    /// Watch only this namespace (repeatable); without it, the whole cluster is watched.
    #[arg(
        long = "namespace",
        short = 'n',
        env = "CAPSTAN_NAMESPACES",
        value_delimiter = ','
    )]
    pub namespaces: Vec<String>,

    /// The prefix of every annotation Capstan stores on objects (progress, diff-base).
    #[arg(long, env = "CAPSTAN_PERSISTENCE_PREFIX", default_value = "capstan.dev")]
    pub persistence_prefix: String,

    /// Where handler progress records are kept.
    #[arg(long, env = "CAPSTAN_PROGRESS_STORAGE", value_enum, default_value_t = ProgressKind::Annotations)]
    pub progress_storage: ProgressKind,

    /// Where the last handled state (diff-base) is kept.
    #[arg(long, env = "CAPSTAN_DIFFBASE_STORAGE", value_enum, default_value_t = DiffBaseKind::Annotations)]
    pub diffbase_storage: DiffBaseKind,

    /// The diff-base annotation key [default: <prefix>/last-handled-configuration].
    #[arg(long, env = "CAPSTAN_DIFFBASE_KEY")]
    pub diffbase_key: Option<String>,

    /// The finalizer name [default: <prefix>/finalizer].
    #[arg(long, env = "CAPSTAN_FINALIZER")]
    pub finalizer: Option<String>,

    /// The name of the stanza under `status` used by the status storages.
    #[arg(long, env = "CAPSTAN_STATUS_FIELD", default_value = "capstan")]
    pub status_field: String,

    /// At most this many objects are processed at the same time.
    #[arg(long, env = "CAPSTAN_WORKER_LIMIT", default_value_t = 128)]
    pub worker_limit: usize,

    /// When a handler is still running this long after other handlers of the same change
    /// finished, their progress is written first (so a crash does not run them again).
    #[arg(long, env = "CAPSTAN_CHECKPOINT_AFTER", value_parser = parse_duration, default_value = "1s")]
    pub checkpoint_after: Duration,

    /// Restart a watch that delivers nothing, not even a bookmark, for this long.
    #[arg(long, env = "CAPSTAN_WATCH_INACTIVITY_TIMEOUT", value_parser = parse_duration, default_value = "5m")]
    pub watch_inactivity_timeout: Duration,
}

/// Where progress records are kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum ProgressKind {
    /// One annotation per handler.
    Annotations,
    /// Under `status.<status-field>.progress`.
    Status,
    /// Both; read from annotations first.
    Smart,
}

/// Where the diff-base is kept.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DiffBaseKind {
    /// In an annotation.
    Annotations,
    /// Under `status.<status-field>.last-handled-configuration`.
    Status,
}

/// Flags of `capstan freeze` and `capstan resume`.
#[derive(Debug, Args)]
pub struct PeeringArgs {
    /// The peering object's name.
    #[arg(long, env = "CAPSTAN_PEERING", default_value = "default")]
    pub peering: String,
}

impl RunArgs {
    /// Maps the flags onto settings.
    pub fn settings(&self) -> Settings {
        let mut settings = Settings {
            listen: self.listen.clone(),
            admin_listen: self.admin_listen,
            shutdown_grace: self.shutdown_grace,
            discovery_ttl: self.discovery_ttl,
            ..Settings::default()
        };
        settings.connection.ping_interval = self.ping_interval;
        settings.connection.ping_timeout = self.ping_timeout;
        settings.connection.handshake_timeout = self.handshake_timeout;
        settings.connection.max_in_flight = self.max_in_flight.max(1);
        settings.connection.cancel_grace = self.cancel_grace;
        settings.hub.cancel_grace = self.cancel_grace;
        settings.hub.max_losses = self.max_losses.max(1);
        settings.connection.supported_kinds = Some(crate::engine::SUPPORTED_KINDS.to_vec());
        settings.engine.storage = self.storage();
        settings.engine.namespaces = self
            .namespaces
            .iter()
            .filter(|n| !n.is_empty())
            .cloned()
            .collect();
        settings.engine.worker_limit = self.worker_limit.max(1);
        settings.engine.watch.inactivity_timeout = self.watch_inactivity_timeout;
        settings.engine.checkpoint_after = self.checkpoint_after;
        settings
    }

    fn storage(&self) -> Storage {
        let mut keys = Keys::new(&self.persistence_prefix);
        if let Some(k) = &self.diffbase_key {
            keys.diffbase.clone_from(k);
        }
        if let Some(f) = &self.finalizer {
            keys.finalizer.clone_from(f);
        }
        let progress = match self.progress_storage {
            ProgressKind::Annotations => ProgressStorage::Annotations(keys.clone()),
            ProgressKind::Status => ProgressStorage::Status {
                name: self.status_field.clone(),
            },
            ProgressKind::Smart => ProgressStorage::Smart(keys.clone(), self.status_field.clone()),
        };
        let diffbase = match self.diffbase_storage {
            DiffBaseKind::Annotations => DiffBaseStorage::Annotations(keys.clone()),
            DiffBaseKind::Status => DiffBaseStorage::Status {
                name: self.status_field.clone(),
            },
        };
        Storage {
            keys,
            progress,
            diffbase,
            finalizers: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn run_flags_map_onto_settings() {
        let cli = Cli::parse_from([
            "capstan",
            "run",
            "--listen",
            "127.0.0.1:0",
            "--ping-timeout",
            "2s",
        ]);
        let Command::Run(args) = cli.command else {
            panic!("not run")
        };
        let s = args.settings();
        assert_eq!(s.connection.ping_timeout, Duration::from_secs(2));
        assert!(matches!(s.listen, Listen::Tcp(_)));
    }
}
