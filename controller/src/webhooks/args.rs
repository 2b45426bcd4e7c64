//! The `capstan run` flags of the admission webhooks, mapped onto [`super::Settings`].

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use clap::Args;

use super::{Mode, Service, Settings};
use crate::config::parse_duration;

/// The shortest handshake, header and body timeouts accepted.
const MIN_TIMEOUT: Duration = Duration::from_millis(100);

/// Admission webhooks (validate and mutate handlers).
#[derive(Args, Debug, Clone)]
pub struct WebhookArgs {
    /// When the HTTPS webhook server runs: `auto` once a validate or mutate handler is
    /// registered, `on` from the start, `off` never (admission handlers are then rejected).
    #[arg(long = "webhooks", env = "CAPSTAN_WEBHOOKS", value_enum, default_value_t = Mode::Auto)]
    pub webhooks: Mode,

    /// Where the webhook server listens (HTTPS).
    #[arg(long, env = "CAPSTAN_WEBHOOK_LISTEN", default_value = "0.0.0.0:9443")]
    pub webhook_listen: SocketAddr,

    /// A directory with `tls.crt` and `tls.key` (and `ca.crt`), e.g. a mounted Secret issued by
    /// cert-manager; reloaded when the files change. Without it, a CA and a serving certificate
    /// are generated at start.
    #[arg(long, env = "CAPSTAN_WEBHOOK_CERT_DIR")]
    pub webhook_cert_dir: Option<PathBuf>,

    /// How often the certificate files are looked at for changes.
    #[arg(long, env = "CAPSTAN_WEBHOOK_CERT_POLL", value_parser = parse_duration, default_value = "10s")]
    pub webhook_cert_poll: Duration,

    /// A PEM CA bundle: only callers presenting a client certificate signed by one of its CAs
    /// are served (the API server, configured with `--admission-control-config-file`);
    /// reloaded when the file changes. Without it any peer that reaches the port is served.
    #[arg(long, env = "CAPSTAN_WEBHOOK_CLIENT_CA")]
    pub webhook_client_ca: Option<PathBuf>,

    /// Keep the CA of generated certificates in this Secret (in the Service's namespace), so
    /// that every replica's certificate is signed by one CA: created by the first replica,
    /// read by the others. Needed with leader election and no --webhook-cert-dir.
    #[arg(long, env = "CAPSTAN_WEBHOOK_CA_SECRET")]
    pub webhook_ca_secret: Option<String>,

    /// More DNS names or IP addresses for a generated certificate (comma-separated).
    #[arg(long, env = "CAPSTAN_WEBHOOK_CERT_NAMES", value_delimiter = ',')]
    pub webhook_cert_names: Vec<String>,

    /// The Service the API server reaches the webhook server through (in a cluster). Without
    /// it the managed configurations use a URL (development).
    #[arg(long, env = "CAPSTAN_WEBHOOK_SERVICE")]
    pub webhook_service: Option<String>,

    /// The Service's namespace; default the pod's (`POD_NAMESPACE`).
    #[arg(long, env = "CAPSTAN_WEBHOOK_SERVICE_NAMESPACE")]
    pub webhook_service_namespace: Option<String>,

    /// The Service's port.
    #[arg(long, env = "CAPSTAN_WEBHOOK_SERVICE_PORT", default_value_t = 443)]
    pub webhook_service_port: u16,

    /// The webhook server's base URL in the managed configurations when there is no Service;
    /// default `https://127.0.0.1:<listen port>`.
    #[arg(long, env = "CAPSTAN_WEBHOOK_URL")]
    pub webhook_url: Option<String>,

    /// Manage one ValidatingWebhookConfiguration and one MutatingWebhookConfiguration of this
    /// name (kopf's `admission.managed`), built from the registered handlers and removed on
    /// exit. Without it the name is the one a handler process's settings give
    /// (`admission.managed`), if any; given empty, the configurations are the user's whatever
    /// the settings say (the chart's `webhooks.configurations=unmanaged`).
    #[arg(long, env = "CAPSTAN_WEBHOOK_MANAGED")]
    pub webhook_managed: Option<String>,

    /// Keep the managed configurations when the controller stops (kopf's `persistent`
    /// webhooks, for all handlers): admission stays enforced while no controller runs, and a
    /// rolling update leaves no gap between the old leader's exit and the new one's write.
    #[arg(long, env = "CAPSTAN_WEBHOOK_KEEP_ON_EXIT")]
    pub webhook_keep_on_exit: bool,

    /// The webhooks' timeout (`timeoutSeconds`, 1–30 s), and the one assumed when the API
    /// server does not say.
    #[arg(long, env = "CAPSTAN_WEBHOOK_TIMEOUT", value_parser = parse_duration, default_value = "10s")]
    pub webhook_timeout: Duration,

    /// The largest admission request body accepted (bytes); larger ones get HTTP 413. The API
    /// server sends at most about twice its own request limit (3 MiB): the object and the old
    /// object.
    #[arg(long, env = "CAPSTAN_WEBHOOK_MAX_BODY", default_value_t = 6 << 20)]
    pub webhook_max_body: usize,

    /// How long a TLS handshake on the webhook port may take.
    #[arg(long, env = "CAPSTAN_WEBHOOK_HANDSHAKE_TIMEOUT", value_parser = parse_duration, default_value = "10s")]
    pub webhook_handshake_timeout: Duration,

    /// How long a request head may take to arrive, and an idle connection may wait for its
    /// next request, before the connection is closed.
    #[arg(long, env = "CAPSTAN_WEBHOOK_HEADER_TIMEOUT", value_parser = parse_duration, default_value = "10s")]
    pub webhook_header_timeout: Duration,

    /// How long a request body may pause between two chunks, and take in all (HTTP 408 after).
    #[arg(long, env = "CAPSTAN_WEBHOOK_BODY_TIMEOUT", value_parser = parse_duration, default_value = "10s")]
    pub webhook_body_timeout: Duration,

    /// The bytes all admission requests in flight may hold together (bodies, and the trees
    /// they become); beyond it requests get HTTP 429, and one that alone needs more gets 413.
    #[arg(long, env = "CAPSTAN_WEBHOOK_MEMORY_BUDGET", default_value_t = 32 << 20)]
    pub webhook_memory_budget: usize,

    /// The most admission reviews with the handlers at once; beyond it requests get HTTP 503.
    #[arg(long, env = "CAPSTAN_WEBHOOK_MAX_IN_FLIGHT", default_value_t = 64)]
    pub webhook_max_in_flight: usize,

    /// The most connections to the webhook port held at once; when all are taken, the one
    /// idle the longest is closed for a new one.
    #[arg(long, env = "CAPSTAN_WEBHOOK_MAX_CONNECTIONS", default_value_t = 1024)]
    pub webhook_max_connections: usize,

    /// Namespaces the managed configurations never send to the webhooks (comma-separated), so
    /// that a failing handler cannot lock the cluster out of them.
    #[arg(
        long,
        env = "CAPSTAN_WEBHOOK_EXCLUDE_NAMESPACES",
        value_delimiter = ',',
        default_value = "kube-system"
    )]
    pub webhook_exclude_namespaces: Vec<String>,
}

impl WebhookArgs {
    /// Maps the flags onto settings.
    pub fn settings(&self) -> Settings {
        let namespace = self
            .webhook_service_namespace
            .clone()
            .or_else(|| std::env::var("POD_NAMESPACE").ok())
            .unwrap_or_else(|| "default".into());
        Settings {
            mode: self.webhooks,
            listen: self.webhook_listen,
            server: super::server::Settings {
                max_body_bytes: self.webhook_max_body.max(1024),
                default_timeout: self
                    .webhook_timeout
                    .clamp(Duration::from_secs(1), Duration::from_secs(30)),
                handshake_timeout: self.webhook_handshake_timeout.max(MIN_TIMEOUT),
                header_timeout: self.webhook_header_timeout.max(MIN_TIMEOUT),
                body_timeout: self.webhook_body_timeout.max(MIN_TIMEOUT),
                memory_budget: self.webhook_memory_budget.max(1 << 20),
                max_in_flight: self.webhook_max_in_flight.max(1),
                max_connections: self.webhook_max_connections.max(1),
            },
            cert_dir: self.webhook_cert_dir.clone(),
            cert_poll: self.webhook_cert_poll,
            extra_names: self.webhook_cert_names.clone(),
            client_ca: self.webhook_client_ca.clone(),
            ca_secret: self
                .webhook_ca_secret
                .clone()
                .filter(|n| !n.is_empty())
                .map(|name| (namespace.clone(), name)),
            leader_election: false,
            service: self.webhook_service.clone().map(|name| Service {
                namespace,
                name,
                port: self.webhook_service_port,
            }),
            url: self.webhook_url.clone(),
            managed: self.webhook_managed.clone().filter(|n| !n.is_empty()),
            keep_on_exit: self.webhook_keep_on_exit,
            excluded_namespaces: self
                .webhook_exclude_namespaces
                .iter()
                .filter(|n| !n.is_empty())
                .cloned()
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[derive(clap::Parser)]
    struct Flags {
        #[command(flatten)]
        webhook: WebhookArgs,
    }

    fn settings(args: &[&str]) -> Settings {
        let mut all = vec!["capstan"];
        all.extend_from_slice(args);
        Flags::try_parse_from(all)
            .expect("valid flags")
            .webhook
            .settings()
    }

    #[test]
    fn defaults_serve_on_9443_when_needed_and_manage_nothing() {
        let s = settings(&[]);
        assert_eq!(s.mode, Mode::Auto);
        assert_eq!(s.listen, SocketAddr::from(([0, 0, 0, 0], 9443)));
        assert_eq!(s.managed, None);
        assert_eq!(s.service, None);
        assert_eq!(s.excluded_namespaces, vec!["kube-system".to_owned()]);
        assert_eq!(s.server, super::super::server::Settings::default());
        assert_eq!(s.server.max_body_bytes, 6 << 20);
        assert_eq!(s.server.memory_budget, 32 << 20);
        assert_eq!(s.server.max_in_flight, 64);
        assert_eq!(s.server.max_connections, 1024);
        for timeout in [
            s.server.handshake_timeout,
            s.server.header_timeout,
            s.server.body_timeout,
        ] {
            assert_eq!(timeout, Duration::from_secs(10));
        }
        let s = settings(&[
            "--webhook-header-timeout",
            "2s",
            "--webhook-body-timeout",
            "3s",
            "--webhook-handshake-timeout",
            "4s",
            "--webhook-memory-budget",
            "1",
            "--webhook-max-connections",
            "0",
        ]);
        assert_eq!(s.server.header_timeout, Duration::from_secs(2));
        assert_eq!(s.server.body_timeout, Duration::from_secs(3));
        assert_eq!(s.server.handshake_timeout, Duration::from_secs(4));
        assert_eq!(s.server.memory_budget, 1 << 20, "at least 1 MiB");
        assert_eq!(s.server.max_connections, 1);
    }

    #[test]
    fn flags_map_onto_settings_within_their_ranges() {
        let s = settings(&[
            "--webhooks",
            "on",
            "--webhook-service",
            "op-webhook",
            "--webhook-service-namespace",
            "ops",
            "--webhook-managed",
            "op",
            "--webhook-timeout",
            "90s",
            "--webhook-exclude-namespaces",
            "kube-system,ops",
            "--webhook-cert-dir",
            "/certs",
        ]);
        assert_eq!(s.mode, Mode::On);
        assert_eq!(
            s.service,
            Some(Service {
                namespace: "ops".into(),
                name: "op-webhook".into(),
                port: 443
            })
        );
        assert_eq!(s.managed.as_deref(), Some("op"));
        assert_eq!(
            s.server.default_timeout,
            Duration::from_secs(30),
            "capped at the API server's limit"
        );
        assert_eq!(
            s.excluded_namespaces,
            vec!["kube-system".to_owned(), "ops".to_owned()]
        );
        assert_eq!(s.cert_dir, Some(PathBuf::from("/certs")));
        assert_eq!(settings(&["--webhooks", "off"]).mode, Mode::Off);
    }
}
