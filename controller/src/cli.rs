//! The command line: `capstan run | freeze | resume | crds | version | check | status | retry`.
//!
//! Every flag can also be given as an environment variable (`CAPSTAN_…`), which is how the Helm
//! chart configures the sidecar. The mapping onto [`Settings`] is mechanical and logic-free.

use std::{net::SocketAddr, time::Duration};

use clap::{Args, Parser, Subcommand};

use crate::{
    config::{Settings, parse_duration},
    engine::namespaces::Namespaces,
    engine::processing::Storage,
    grpc::Listen,
    k8s::peering::Target,
    model::{
        Level,
        operator_settings::{
            DiffBaseKind as OperatorDiffBase, Field, OperatorSettings, ProgressKind as OperatorProgress,
        },
    },
    observability::logging,
    peering,
    persistence::{DiffBaseStorage, Keys, ProgressStorage, diffbase::Extent},
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
    /// Pause the operators of a peering from a terminal (priority freezing).
    ///
    /// Writes a peering entry with the given priority and lifetime; operators with a lower
    /// priority pause (their watches stay warm) until `capstan resume` or until it expires.
    /// Uses the kubeconfig (KUBECONFIG or ~/.kube/config).
    Freeze(FreezeArgs),
    /// Resume the operators paused by `capstan freeze` (removes its peering entry).
    Resume(ResumeArgs),
    /// Print the peering CRDs (`capstan crds | kubectl apply -f -`).
    Crds,
    /// Prepare a node-local storage directory for a non-root controller: claim it for the
    /// release (`--claim`), create it, give it to UID:GID, mode 0711 (the chart's init
    /// container, with only the CHOWN and FOWNER capabilities).
    PrepareStorage(PrepareStorageArgs),
    /// Print the version and the protocol version.
    Version,
    /// Check a running controller through its admin endpoint: /healthz and /readyz answer
    /// 200 and a handler process is connected (the chart's `helm test`). Keeps trying until
    /// the timeout; exits non-zero saying what failed.
    Check(CheckArgs),
    /// Show what the handlers of objects have done: per object and handler, done, running,
    /// waiting for a retry (and when) or failed for good, with attempts and the last message.
    ///
    /// Reads the objects with the kubeconfig (KUBECONFIG or ~/.kube/config), as kubectl does,
    /// and understands every storage Capstan supports (annotations, status, smart, per-node
    /// prefixes) and kopf's own records. As a kubectl plugin: install the binary (or a link to
    /// it) as `kubectl-capstan` on the PATH and run `kubectl capstan status …`.
    Status(StatusArgs),
    /// Run failed (even permanently failed) or delayed handlers of an object again, now.
    ///
    /// Writes a retry request annotation (`<prefix>/retry-request`) that the controller
    /// consumes in its next cycle of the object, removing it in that cycle's write and posting
    /// an Event that names who asked. Says so, and writes nothing, when the object has
    /// nothing to retry.
    Retry(RetryArgs),
}

/// Flags of `capstan retry`.
#[derive(Debug, Args)]
pub struct RetryArgs {
    /// The resource: plural, kind, short name, or plural.group.
    pub resource: String,

    /// The object's name.
    pub name: String,

    /// Only this handler (repeatable); without it, every failed or delayed handler.
    #[arg(long = "handler", value_delimiter = ',')]
    pub handlers: Vec<String>,

    /// The namespace [default: the kubeconfig context's].
    #[arg(long, short = 'n')]
    pub namespace: Option<String>,

    /// The node of a per-node operator (DaemonSet mode) whose handlers to retry.
    #[arg(long)]
    pub node: Option<String>,

    /// The operator's persistence prefix [default: the one whose records the object carries].
    #[arg(long)]
    pub prefix: Option<String>,

    /// How the per-node operators lay out their prefixes, as `capstan run` takes it.
    #[arg(long, env = "CAPSTAN_NODE_PREFIX_TEMPLATE", default_value = crate::persistence::node::DEFAULT_TEMPLATE, value_parser = parse_node_prefix_template)]
    pub node_prefix_template: String,
}

impl RetryArgs {
    /// What these flags ask for.
    pub fn ask(&self) -> crate::steering::Ask {
        crate::steering::Ask {
            resource: self.resource.clone(),
            name: self.name.clone(),
            namespace: self.namespace.clone(),
            handlers: self.handlers.clone(),
            node: self.node.clone(),
            prefix: self.prefix.clone(),
            node_template: self.node_prefix_template.clone(),
        }
    }
}

/// Flags of `capstan status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The resource: plural, kind, short name, or plural.group (e.g. examples.demo.capstan.dev).
    pub resource: String,

    /// One object; without it, every object in the namespace.
    pub name: Option<String>,

    /// The namespace [default: the kubeconfig context's].
    #[arg(long, short = 'n', conflicts_with = "all_namespaces")]
    pub namespace: Option<String>,

    /// Every namespace.
    #[arg(long, short = 'A')]
    pub all_namespaces: bool,

    /// Only objects with these labels (a label selector, as kubectl -l).
    #[arg(long, short = 'l')]
    pub selector: Option<String>,

    /// Output format: aligned columns by default; wide, json or yaml.
    #[arg(long, short = 'o', value_enum, default_value_t = crate::inspection::render::Output::Table)]
    pub output: crate::inspection::render::Output,

    /// Annotation prefixes of the operators to report on (repeatable; per-node prefixes
    /// `<node>.<prefix>` are included) [default: capstan.dev and kopf.zalando.org].
    #[arg(long = "prefix", value_delimiter = ',')]
    pub prefixes: Vec<String>,

    /// Status stanzas of the status storages (repeatable; per-node `<field>-<node>` are
    /// included) [default: capstan and kopf].
    #[arg(long = "status-field", value_delimiter = ',')]
    pub status_fields: Vec<String>,

    /// How the per-node operators lay out their prefixes, as `capstan run` takes it.
    #[arg(long, env = "CAPSTAN_NODE_PREFIX_TEMPLATE", default_value = crate::persistence::node::DEFAULT_TEMPLATE, value_parser = parse_node_prefix_template)]
    pub node_prefix_template: String,

    /// A sharded operator's ring (its --lease-name): show each object's member.
    #[arg(long)]
    pub ring: Option<String>,

    /// The namespace of the ring's member Leases [default: the kubeconfig context's].
    #[arg(long, requires = "ring")]
    pub ring_namespace: Option<String>,
}

impl StatusArgs {
    /// The query these flags ask for.
    pub fn query(&self) -> crate::inspection::Query {
        use crate::inspection::Namespaces;
        let mut scope = crate::persistence::survey::Scope::default();
        if !self.prefixes.is_empty() {
            scope.prefixes.clone_from(&self.prefixes);
        }
        if !self.status_fields.is_empty() {
            scope.status_fields.clone_from(&self.status_fields);
        }
        scope.node_template.clone_from(&self.node_prefix_template);
        crate::inspection::Query {
            resource: self.resource.clone(),
            name: self.name.clone(),
            namespaces: match (&self.namespace, self.all_namespaces) {
                (_, true) => Namespaces::All,
                (Some(ns), false) => Namespaces::One(ns.clone()),
                (None, false) => Namespaces::Current,
            },
            selector: self.selector.clone(),
            scope,
            ring: self.ring.clone().map(|r| (r, self.ring_namespace.clone())),
        }
    }
}

/// Flags of `capstan prepare-storage`.
#[derive(Debug, Args)]
pub struct PrepareStorageArgs {
    /// The directory.
    pub dir: std::path::PathBuf,
    /// The owner, UID:GID.
    #[arg(long, default_value = "65532:65532", value_parser = parse_owner)]
    pub owner: (u32, u32),
    /// The release the directory belongs to (the chart's `<namespace>/<release>`): refused when
    /// another release claimed it, or a directory inside or around it.
    #[arg(long, env = "CAPSTAN_NODE_STORAGE_CLAIM")]
    pub claim: Option<String>,
}

fn parse_owner(s: &str) -> Result<(u32, u32), String> {
    let (uid, gid) = s.split_once(':').ok_or("the owner is UID:GID")?;
    let number = |n: &str| n.parse::<u32>().map_err(|e| format!("{n:?}: {e}"));
    Ok((number(uid)?, number(gid)?))
}

/// Flags of `capstan check`.
#[derive(Debug, Args)]
pub struct CheckArgs {
    /// The controller's admin endpoint, http://HOST:PORT.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    pub admin: crate::check::Admin,

    /// How long to keep trying before failing (e.g. 60s).
    #[arg(long, value_parser = parse_duration, default_value = "60s")]
    pub timeout: Duration,
}

/// Flags of `capstan run`.
#[derive(Clone, Debug, Args)]
pub struct RunArgs {
    /// Where handler processes connect: unix:///path/to.sock or a loopback 127.0.0.1:PORT
    /// (other TCP addresses need --listen-insecure-non-loopback).
    #[arg(
        long,
        env = "CAPSTAN_LISTEN",
        default_value = "unix:///run/capstan/capstan.sock"
    )]
    pub listen: Listen,

    /// Address of the admin HTTP endpoint serving /healthz and /readyz.
    #[arg(long, env = "CAPSTAN_ADMIN_LISTEN", default_value = "0.0.0.0:8080")]
    pub admin_listen: SocketAddr,

    /// Most connections to the admin endpoint open at once; a new connection beyond them
    /// closes the oldest, so that a flood of idle connections neither exhausts descriptors
    /// nor keeps the kubelet's probes out.
    #[arg(long, env = "CAPSTAN_ADMIN_CONNECTIONS", default_value_t = 64)]
    pub admin_connections: usize,

    /// How long a connection to the admin endpoint may take to send a request's headers, and
    /// how long an idle kept-alive connection stays open.
    #[arg(long, env = "CAPSTAN_ADMIN_HEADER_TIMEOUT", value_parser = parse_duration, default_value = "5s")]
    pub admin_header_timeout: Duration,

    /// How long one connection to the admin endpoint may stay open, whatever it does.
    #[arg(long, env = "CAPSTAN_ADMIN_REQUEST_TIMEOUT", value_parser = parse_duration, default_value = "10s")]
    pub admin_request_timeout: Duration,

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

    /// How long a new connection has to send the HTTP/2 preface before it is closed.
    #[arg(long, env = "CAPSTAN_PREFACE_TIMEOUT", value_parser = parse_duration, default_value = "10s")]
    pub preface_timeout: Duration,

    /// Allow --listen on a TCP address that is not loopback. INSECURE: the handler protocol
    /// has no authentication, and whoever reaches the port can register handlers for anything
    /// the controller may list and patch. Only for isolated networks.
    #[arg(long, env = "CAPSTAN_LISTEN_INSECURE_NON_LOOPBACK")]
    pub listen_insecure_non_loopback: bool,

    /// How long a cancelled invocation has to finish before it is abandoned (daemons use their
    /// own `cancellation_timeout`, and without one are waited for).
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

    /// How long one API request may take before it fails and is retried (a watch: until the
    /// server starts answering; its stream is guarded by `--watch-inactivity-timeout`).
    #[arg(long, env = "CAPSTAN_API_TIMEOUT", value_parser = parse_duration, default_value = "30s")]
    pub api_timeout: Duration,

    /// At most this many API requests (other than watches, leases and peering) in flight at
    /// once; more wait their turn (up to --api-timeout) before their own --api-timeout starts.
    /// Each holds a stream of the API server's one HTTP/2 connection, or over HTTP/1.1 a
    /// connection of its own with its buffers, so this bounds the controller's memory in a
    /// burst of writes. The default was measured best for both the
    /// API server and the controller; much fewer would hold objects back in the controller
    /// while the API server could take them.
    #[arg(long, env = "CAPSTAN_API_REQUESTS", default_value_t = crate::k8s::switch::DEFAULT_REQUESTS_IN_FLIGHT)]
    pub api_requests: usize,

    /// How long one probe handler may take before `/healthz` reports it failing. Probe
    /// results are cached for 10 s, as in kopf.
    #[arg(long, env = "CAPSTAN_PROBE_TIMEOUT", value_parser = parse_duration, default_value = "5s")]
    pub probe_timeout: Duration,

    /// How long one call of a login handler may take (kopf's login deadline): a handler that
    /// has not answered by then is withdrawn, and the answers of the others decide.
    #[arg(long, env = "CAPSTAN_LOGIN_TIMEOUT", value_parser = parse_duration, default_value = "30s")]
    pub login_timeout: Duration,

    /// Do not watch CustomResourceDefinitions: registrations for resources that are not
    /// served at handshake time then wait until the next handshake, and deleted CRDs are not
    /// noticed (for operators without RBAC to list/watch CRDs).
    #[arg(long, env = "CAPSTAN_NO_CRD_WATCH")]
    pub no_crd_watch: bool,

    /// Serve only namespaces matching this pattern (repeatable, comma-separated): exact names,
    /// globs with `*` and `?`, and `!` to exclude (e.g. `-n 'team-*' -n '!team-x'`). Without
    /// it (or with --all-namespaces), the whole cluster is served. Globs and negations watch
    /// cluster-wide and pick up namespaces created later.
    #[arg(
        long = "namespace",
        short = 'n',
        env = "CAPSTAN_NAMESPACES",
        value_delimiter = ',',
        value_parser = parse_namespace_pattern,
        conflicts_with = "all_namespaces"
    )]
    pub namespaces: Vec<String>,

    /// Run as one node's operator (DaemonSet mode): progress, diff-base and finalizer are kept
    /// under a per-node prefix `<node>.<persistence-prefix>`, so every node handles every
    /// object on its own. Falls back to the `NODE_NAME` environment variable.
    #[arg(long, env = "CAPSTAN_NODE_NAME")]
    pub node_name: Option<String>,

    /// Put a finalizer on objects whose delete handlers, daemons or timers need one: `auto`
    /// means yes, except in per-node mode (a node that disappears would leave its finalizers
    /// behind).
    #[arg(long, env = "CAPSTAN_FINALIZERS", value_enum, default_value_t = Finalizers::Auto)]
    pub finalizers: Finalizers,

    /// In per-node mode, keep this node's progress records and diff-base in files on the node
    /// instead of on the objects: `file:<directory>` (a hostPath; the chart's daemonset mode
    /// mounts one). Objects then carry nothing of the node but its finalizer (if enabled), and
    /// the state lives and dies with the node's disk.
    #[arg(long, env = "CAPSTAN_NODE_STORAGE", value_name = "file:DIR")]
    pub node_storage: Option<String>,

    /// The most node-local state kept, in MiB (objects beyond it are not recorded and are
    /// handled again after a restart).
    #[arg(long, env = "CAPSTAN_NODE_STORAGE_LIMIT_MIB", default_value_t = 1024)]
    pub node_storage_limit_mib: u64,

    /// Keep expiring API tokens of this ServiceAccount (`<namespace>/<name>`) for the handler
    /// container in `--handler-identity-dir` (with `ca.crt` and `namespace`): renewed when 80 %
    /// of their hour has passed, so the handler acts as an identity of its own without a
    /// token that never expires.
    #[arg(long, env = "CAPSTAN_HANDLER_IDENTITY", value_name = "NAMESPACE/NAME")]
    pub handler_identity: Option<String>,

    /// The directory the handler's identity is written to (shared with the handler container).
    #[arg(
        long,
        env = "CAPSTAN_HANDLER_IDENTITY_DIR",
        default_value = "/run/capstan-handler-identity"
    )]
    pub handler_identity_dir: std::path::PathBuf,

    /// The release the node-local storage directory belongs to (the chart passes
    /// `<namespace>/<release>`): written into the directory's `.capstan-claim` on first use;
    /// a directory claimed by another release, inside or around one, or reached through a
    /// symbolic link is refused.
    #[arg(long, env = "CAPSTAN_NODE_STORAGE_CLAIM", value_name = "NAME")]
    pub node_storage_claim: Option<String>,

    /// In per-node mode, how the node's storage prefix is laid out: `{prefix}` (the persistence
    /// prefix) and `{node}` (the node name as a DNS label) or `{node_short}` (its first
    /// dot-separated part), e.g. `{prefix}.{node_short}` to take over a kopf operator's
    /// `example.com.node-1` annotations.
    #[arg(long, env = "CAPSTAN_NODE_PREFIX_TEMPLATE", default_value = crate::persistence::node::DEFAULT_TEMPLATE, value_parser = parse_node_prefix_template)]
    pub node_prefix_template: String,

    /// In per-node mode, remove a deleted Node's annotations (and finalizers) from every object
    /// of the watched resources (listed whole, whatever the watch's selectors); one live
    /// operator (the one on the lowest node name) does it.
    #[arg(long, env = "CAPSTAN_NODE_CLEANUP", default_value_t = true, action = clap::ArgAction::Set)]
    pub node_cleanup: bool,

    /// In per-node mode, the lowest live node cleans up after a deleted Node at once; the next
    /// two wait this long each and clean what is left (e.g. when the lowest node runs no
    /// operator).
    #[arg(long, env = "CAPSTAN_NODE_CLEANUP_DELAY", value_parser = parse_duration, default_value = "30s")]
    pub node_cleanup_delay: Duration,

    /// Serve every namespace (the default when no --namespace is given).
    #[arg(long, short = 'A', env = "CAPSTAN_ALL_NAMESPACES")]
    pub all_namespaces: bool,

    /// Whose conventions the stored state follows. `kopf` reads and writes what a kopf
    /// operator stores (prefix kopf.zalando.org, V2 and V1 progress keys, kopf's diff-base key
    /// and finalizer, no kopf-managed marker, legacy status.kopf.progress records read but not
    /// written), so that objects a kopf operator handled are not handled again, and the other
    /// way round. --persistence-prefix, --diffbase-key, --finalizer and --status-field still
    /// override its names.
    #[arg(long, env = "CAPSTAN_PERSISTENCE", value_enum, default_value_t = Persistence::Capstan)]
    pub persistence: Persistence,

    /// The prefix of every annotation Capstan stores on objects (progress, diff-base)
    /// [default: capstan.dev; kopf.zalando.org with --persistence kopf].
    #[arg(
        long,
        env = "CAPSTAN_PERSISTENCE_PREFIX",
        default_value = "capstan.dev",
        default_value_if("persistence", "kopf", crate::persistence::keys::KOPF_PREFIX),
        hide_default_value = true
    )]
    pub persistence_prefix: String,

    /// Where handler progress records are kept. With --persistence kopf, `annotations` also
    /// reads (never writes) records in status.<status-field>.progress, as kopf does.
    #[arg(long, env = "CAPSTAN_PROGRESS_STORAGE", value_enum, default_value_t = ProgressKind::Annotations)]
    pub progress_storage: ProgressKind,

    /// Maintain status conditions Ready, Progressing and Degraded on the objects of these
    /// resources (plural or plural.group, comma-separated; written with each cycle's own
    /// write), so that `kubectl wait --for=condition=Ready` works. Without a value: every
    /// custom resource handled. Built-in resources (pods, deployments, …) only when named:
    /// their own controllers keep conditions of these types. Not in per-node mode.
    #[arg(
        long,
        env = "CAPSTAN_CONDITIONS",
        value_name = "RESOURCE",
        num_args = 0..,
        value_delimiter = ','
    )]
    pub conditions: Option<Vec<String>>,

    /// Where the last handled state (diff-base) is kept.
    #[arg(long, env = "CAPSTAN_DIFFBASE_STORAGE", value_enum, default_value_t = DiffBaseKind::Annotations)]
    pub diffbase_storage: DiffBaseKind,

    /// How much of the object the diff-base (the last handled state) keeps. `fields`: only
    /// the fields that handlers watch (the `field` of update, field, resume and delete
    /// handlers), in a compact format — or the whole essence when an update handler without a
    /// `field` is registered, since it reads the whole `old` and `diff`. Handlers with a
    /// `field` get the same `old`, `new` and `diff` either way. With `fields`, the whole `old`/`diff` of resume and delete handlers show
    /// only the changes of watched fields (other fields look unchanged; create handlers never
    /// have an `old`), and a change of a field that no handler watched when it was made (e.g.
    /// while the controller was down, before a new version adds a handler on it) is not seen
    /// as a change. `full`: the whole essence always, as kopf stores it. Diff-bases in either
    /// format are read. [default: fields; full with --persistence kopf or kopf's prefix or
    /// diff-base key, which cannot take fields]
    #[arg(long, env = "CAPSTAN_DIFF_BASE", value_enum)]
    pub diff_base: Option<DiffBaseExtent>,

    /// The diff-base annotation key [default: <prefix>/last-handled-configuration].
    #[arg(long, env = "CAPSTAN_DIFFBASE_KEY")]
    pub diffbase_key: Option<String>,

    /// The finalizer name [default: <prefix>/finalizer; kopf.zalando.org/KopfFinalizerMarker
    /// with --persistence kopf].
    #[arg(long, env = "CAPSTAN_FINALIZER")]
    pub finalizer: Option<String>,

    /// The name of the stanza under `status` used by the status storages [default: capstan;
    /// kopf with --persistence kopf].
    #[arg(
        long,
        env = "CAPSTAN_STATUS_FIELD",
        default_value = "capstan",
        default_value_if("persistence", "kopf", "kopf"),
        hide_default_value = true
    )]
    pub status_field: String,

    /// At most this many objects are processed at the same time.
    #[arg(long, env = "CAPSTAN_WORKER_LIMIT", default_value_t = 128)]
    pub worker_limit: usize,

    /// When a handler is still running this long, the progress so far is written first: that
    /// of the handlers of the same change that finished before it (so a crash does not run
    /// them again), and the running handler's start if it has a timeout (so a crash does not
    /// restart its timeout clock). A lone handler without a timeout costs no such write.
    #[arg(long, env = "CAPSTAN_CHECKPOINT_AFTER", value_parser = parse_duration, default_value = "1s")]
    pub checkpoint_after: Duration,

    /// Post Kubernetes Events on objects for handler outcomes and log records (rate-limited
    /// and aggregated); `--events false` posts none.
    #[arg(long, env = "CAPSTAN_EVENTS", default_value_t = true, action = clap::ArgAction::Set)]
    pub events: bool,

    /// The lowest level of outcomes and handler log records that become Events (records a
    /// handler marks as always posted are posted whatever the level).
    #[arg(long, env = "CAPSTAN_EVENT_LEVEL", value_enum, default_value_t = EventLevel::Info)]
    pub event_level: EventLevel,

    /// Restart a watch that delivers nothing, not even a bookmark, for this long.
    #[arg(long, env = "CAPSTAN_WATCH_INACTIVITY_TIMEOUT", value_parser = parse_duration, default_value = "5m")]
    pub watch_inactivity_timeout: Duration,

    /// How long the API server keeps each watch request open before it ends it (the watch
    /// then continues from where it was, without listing again); whole seconds.
    #[arg(long, env = "CAPSTAN_WATCH_SERVER_TIMEOUT", value_parser = parse_duration, default_value = "290s")]
    pub watch_server_timeout: Duration,

    /// Objects per page of a watch's listing. The watch itself starts once the first page
    /// came, so a change made while the rest is listed is not held behind it; smaller pages
    /// lower the listing's peak memory, larger ones cost the API server fewer requests.
    #[arg(long, env = "CAPSTAN_WATCH_PAGE_SIZE", default_value_t = 500,
          value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub watch_page_size: u32,

    /// Run without peering: no peering entry, never paused by `--dev` operators or
    /// `capstan freeze`.
    #[arg(long, env = "CAPSTAN_STANDALONE", conflicts_with_all = ["peering", "priority", "dev"])]
    pub standalone: bool,

    /// The peering object's name [default: default]. Giving it makes peering required: the
    /// controller refuses to start without the peering CRDs.
    #[arg(long, env = "CAPSTAN_PEERING")]
    pub peering: Option<String>,

    /// This operator's priority: a live peer with a higher priority pauses it [default: 0].
    /// Giving it makes peering required.
    #[arg(
        long,
        env = "CAPSTAN_PRIORITY",
        allow_negative_numbers = true,
        conflicts_with = "dev"
    )]
    pub priority: Option<i64>,

    /// Development mode: priority 666, which pauses every operator of a lower priority on the
    /// same peering while this one runs.
    #[arg(long, env = "CAPSTAN_DEV")]
    pub dev: bool,

    /// How long this operator's peering entry lives without a keep-alive (renewed every
    /// half lifetime).
    #[arg(long, env = "CAPSTAN_PEERING_LIFETIME", value_parser = parse_duration, default_value = "60s")]
    pub peering_lifetime: Duration,

    /// This operator's identity in peering and leader election [default: POD_NAME, else
    /// <hostname>@<pid>].
    #[arg(long, env = "CAPSTAN_PEER_ID")]
    pub peer_id: Option<String>,

    /// Elect a leader among replicas with a coordination.k8s.io/v1 Lease; standbys watch but
    /// invoke no handlers until they lead.
    #[arg(long, env = "CAPSTAN_LEADER_ELECTION")]
    pub leader_election: bool,

    /// Shard the objects among replicas: each replica holds a member Lease (named after
    /// --lease-name, in --lease-namespace) and handles the objects whose uid hashes into its
    /// ranges; ranges move between replicas only after their old owner stopped handling them.
    /// The durations are --lease-duration, --renew-deadline and --retry-period. Not with
    /// --leader-election (sharding replaces it) nor in per-node mode.
    #[arg(long, env = "CAPSTAN_SHARDING")]
    pub sharding: bool,

    /// With --sharding: how long a new replica must be alive before objects move to it
    /// (it watches the ring meanwhile; one that stops within it never takes objects).
    #[arg(long, env = "CAPSTAN_SHARDING_SETTLE", value_parser = parse_duration, default_value = "4s")]
    pub sharding_settle: Duration,

    /// The Lease's name.
    #[arg(long, env = "CAPSTAN_LEASE_NAME", default_value = "capstan")]
    pub lease_name: String,

    /// The Lease's namespace [default: POD_NAMESPACE, else default].
    #[arg(long, env = "CAPSTAN_LEASE_NAMESPACE")]
    pub lease_namespace: Option<String>,

    /// How long a leader's claim lasts without renewal; a standby takes over after it.
    #[arg(long, env = "CAPSTAN_LEASE_DURATION", value_parser = parse_duration, default_value = "15s")]
    pub lease_duration: Duration,

    /// A leader that cannot renew for this long pauses and steps down.
    #[arg(long, env = "CAPSTAN_RENEW_DEADLINE", value_parser = parse_duration, default_value = "10s")]
    pub renew_deadline: Duration,

    /// How often the Lease is acquired or renewed.
    #[arg(long, env = "CAPSTAN_RETRY_PERIOD", value_parser = parse_duration, default_value = "2s")]
    pub retry_period: Duration,

    /// Admission webhooks.
    #[command(flatten)]
    pub webhook: crate::webhooks::args::WebhookArgs,
}

/// Validates one `--namespace` pattern at parse time.
fn parse_node_prefix_template(s: &str) -> Result<String, String> {
    crate::persistence::node::check_template(s).map(|()| s.to_owned())
}

fn parse_namespace_pattern(s: &str) -> Result<String, String> {
    Namespaces::parse(&[s.to_owned()])
        .map(|_| s.to_owned())
        .map_err(|e| e.to_string())
}

/// Whether finalizers are used.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Finalizers {
    /// Yes, except in per-node mode.
    Auto,
    /// Yes.
    True,
    /// No: delete handlers run only if something else holds the object.
    False,
}

/// The lowest level posted as an Event.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum EventLevel {
    /// Successes and info records too (Normal Events).
    Info,
    /// Retries, warnings and failures (Warning Events).
    Warning,
    /// Permanent failures and error records only.
    Error,
}

/// Whose persistence conventions are followed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Persistence {
    /// Capstan's: prefix capstan.dev, finalizer capstan.dev/finalizer, V2 keys only.
    Capstan,
    /// kopf's, to take over from a kopf operator (or hand objects back to one).
    Kopf,
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

/// How much of the essence the diff-base keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DiffBaseExtent {
    /// The whole essence (kopf's format).
    Full,
    /// The fields that handlers watch (compact).
    Fields,
}

/// Which peering objects `capstan freeze` and `capstan resume` act on.
#[derive(Debug, Args)]
pub struct PeeringScope {
    /// The peering object's name.
    #[arg(long, env = "CAPSTAN_PEERING", default_value = "default")]
    pub peering: String,

    /// Act on the namespaced peering in this namespace (repeatable), for operators that watch
    /// namespaces.
    #[arg(
        long = "namespace",
        short = 'n',
        value_delimiter = ',',
        conflicts_with = "all_namespaces"
    )]
    pub namespaces: Vec<String>,

    /// Act on the cluster-wide peering, for operators that watch the whole cluster (the
    /// default when no namespace is given).
    #[arg(long, short = 'A')]
    pub all_namespaces: bool,

    /// The identity of the freeze entry [default: <user>@<host>].
    #[arg(long)]
    pub id: Option<String>,
}

impl PeeringScope {
    /// The peering objects.
    pub fn targets(&self) -> Vec<Target> {
        let namespaces: Vec<String> = self
            .namespaces
            .iter()
            .filter(|n| !n.is_empty())
            .cloned()
            .collect();
        if namespaces.is_empty() || self.all_namespaces {
            vec![Target::cluster(&self.peering)]
        } else {
            namespaces
                .iter()
                .map(|ns| Target::namespaced(ns, &self.peering))
                .collect()
        }
    }
}

/// Flags of `capstan freeze`.
#[derive(Debug, Args)]
pub struct FreezeArgs {
    /// Where.
    #[command(flatten)]
    pub scope: PeeringScope,

    /// How long the freeze lasts unless resumed earlier.
    #[arg(long, value_parser = parse_duration, default_value = "1h")]
    pub lifetime: Duration,

    /// Operators with a lower priority pause.
    #[arg(long, allow_negative_numbers = true, default_value_t = peering::FREEZE_PRIORITY)]
    pub priority: i64,

    /// Why, recorded in the entry for whoever looks at the peering object.
    #[arg(long)]
    pub message: Option<String>,
}

/// Flags of `capstan resume`.
#[derive(Debug, Args)]
pub struct ResumeArgs {
    /// Where.
    #[command(flatten)]
    pub scope: PeeringScope,
}

impl RunArgs {
    /// Maps the flags onto settings.
    pub fn settings(&self) -> Settings {
        let mut settings = Settings {
            listen: self.listen.clone(),
            admin_listen: crate::config::bindable(self.admin_listen),
            admin: crate::observability::admin::Settings {
                connections: self.admin_connections.max(1),
                header_timeout: self.admin_header_timeout,
                request_timeout: self.admin_request_timeout,
            },
            shutdown_grace: self.shutdown_grace,
            discovery_ttl: self.discovery_ttl,
            api_timeout: self.api_timeout,
            api_requests: self.api_requests.max(1),
            ..Settings::default()
        };
        settings.connection.ping_interval = self.ping_interval;
        settings.connection.ping_timeout = self.ping_timeout;
        settings.connection.handshake_timeout = self.handshake_timeout;
        settings.connection.preface_timeout = self.preface_timeout;
        settings.connection.insecure_non_loopback = self.listen_insecure_non_loopback;
        settings.connection.max_in_flight = self.max_in_flight.max(1);
        settings.connection.cancel_grace = self.cancel_grace;
        settings.hub.cancel_grace = self.cancel_grace;
        settings.hub.max_losses = self.max_losses.max(1);
        settings.connection.supported_kinds = Some(crate::engine::SUPPORTED_KINDS.to_vec());
        settings.webhooks = self.webhook.settings();
        settings.webhooks.listen = crate::config::bindable(settings.webhooks.listen);
        // Replicas that shard serve webhooks like replicas that elect a leader: one of them
        // writes the configurations, and all need the same certificate authority.
        settings.webhooks.leader_election = self.leader_election || self.sharding;
        // Admission handlers are run only where webhooks are served; otherwise their
        // registrations are refused with the reason, so the handler process learns it.
        settings.connection.admission_unavailable = if settings.webhooks.mode == crate::webhooks::Mode::Off {
            Some("its admission webhooks are off (--webhooks=off)".to_owned())
        } else if settings.webhooks.needs_shared_ca() {
            Some(crate::webhooks::NEEDS_SHARED_CA.to_owned())
        } else {
            None
        };
        if settings.connection.admission_unavailable.is_none()
            && let Some(kinds) = settings.connection.supported_kinds.as_mut()
        {
            kinds.extend([
                crate::model::HandlerKind::Validate,
                crate::model::HandlerKind::Mutate,
            ]);
        }
        settings.engine.storage = self.storage();
        settings.node_store = self.node_store_spec();
        settings.handler_identity = self.handler_identity.as_deref().and_then(|value| {
            crate::k8s::handler_identity::Spec::parse(value, self.handler_identity_dir.clone()).ok()
        });
        settings.engine.node = self.node().map(|name| crate::engine::nodes::Settings {
            name,
            base_prefix: self.persistence_prefix.clone(),
            prefix_template: self.node_prefix_template.clone(),
            cleanup: self.node_cleanup,
            fallback_delay: self.node_cleanup_delay,
            status_field: self.status_field.clone(),
        });
        settings.engine.namespaces = if self.all_namespaces {
            Namespaces::default()
        } else {
            Namespaces::parse(&self.namespaces).unwrap_or_default()
        };
        settings.engine.worker_limit = self.worker_limit.max(1);
        settings.engine.watch.inactivity_timeout = self.watch_inactivity_timeout;
        settings.engine.watch.page_size = self.watch_page_size;
        settings.engine.watch.server_timeout =
            u32::try_from(self.watch_server_timeout.as_secs().clamp(1, 24 * 3600)).unwrap_or(290);
        settings.engine.checkpoint_after = self.checkpoint_after;
        settings.engine.events.enabled = self.events;
        settings.engine.events.level = match self.event_level {
            EventLevel::Info => Level::Info,
            EventLevel::Warning => Level::Warning,
            EventLevel::Error => Level::Error,
        };
        settings.engine.activities.probe_timeout = self.probe_timeout;
        settings.engine.activities.login_timeout = self.login_timeout;
        settings.engine.activities.cleanup_grace = self.shutdown_grace;
        settings.engine.watch_crds = !self.no_crd_watch;
        settings.peering = peering::Settings {
            standalone: self.standalone,
            required: self.peering.is_some() || self.priority.is_some() || self.dev,
            name: self.peering.clone().unwrap_or_else(|| "default".into()),
            priority: if self.dev {
                peering::DEV_PRIORITY
            } else {
                self.priority.unwrap_or(0)
            },
            lifetime: self.peering_lifetime,
            identity: self.peer_id.clone(),
            node: self.node(),
        };
        settings.election = peering::election::Settings {
            enabled: self.leader_election,
            lease_name: self.lease_name.clone(),
            lease_namespace: self.lease_namespace.clone(),
            lease_duration: self.lease_duration,
            renew_deadline: self.renew_deadline,
            retry_period: self.retry_period,
        };
        settings.sharding = crate::sharding::Settings {
            enabled: self.sharding,
            ring: self.lease_name.clone(),
            namespace: self.lease_namespace.clone(),
            lease_duration: self.lease_duration,
            renew_deadline: self.renew_deadline,
            retry_period: self.retry_period,
            settle: self.sharding_settle,
        };
        settings
    }

    /// The settings of `capstan run` with these flags, `given` being the operator-wide
    /// settings' flags that were given (see [`RunArgs::given_operator_flags`]): handler
    /// processes' values for the others are applied as if given as flags.
    pub fn settings_following_processes(&self, mut given: Vec<Field>) -> Settings {
        // Per node, the names of the stored state are the node's (its prefix, status stanza,
        // finalizer, node-local store): fixed as if given.
        if self.node().is_some() {
            for field in [
                Field::Finalizer,
                Field::PersistencePrefix,
                Field::ProgressStorage,
                Field::DiffBaseStorage,
                Field::DiffBaseKey,
                Field::StatusField,
            ] {
                if !given.contains(&field) {
                    given.push(field);
                }
            }
        }
        let mut settings = self.settings();
        settings.hub.operator_flags = self.given_operator_settings(&given);
        settings.operator = Some(crate::config::OperatorFlags::new(self.clone(), given));
        settings
    }

    /// The operator-wide settings whose flags were given on the command line or in the
    /// environment (not left at their defaults): they win over handler processes' values.
    pub fn given_operator_flags(matches: &clap::ArgMatches) -> Vec<Field> {
        let given = |id: &str| {
            matches!(
                matches.value_source(id),
                Some(clap::parser::ValueSource::CommandLine | clap::parser::ValueSource::EnvVariable)
            )
        };
        // `--dev` counts when it is on (CAPSTAN_DEV=false given is no development mode).
        let dev = given("dev") && matches.get_flag("dev");
        Field::ALL
            .into_iter()
            .filter(|field| match field {
                Field::PeeringName => given("peering"),
                Field::PeeringPriority => given("priority") || dev,
                // Any of these decides whether there is peering (they exclude each other).
                Field::PeeringStandalone | Field::PeeringMandatory => {
                    given("standalone") || given("peering") || given("priority") || dev
                }
                Field::PeeringLifetime => given("peering_lifetime"),
                other => given(other.name()),
            })
            .collect()
    }

    /// The operator's peering with `wanted`'s peering fields applied where their flags are
    /// not `given`. Unlike `--peering` and `--priority`, a name or priority set this way does
    /// not make peering required (kopf's `peering.mandatory` does).
    pub fn peering_with(&self, wanted: &OperatorSettings, given: &[Field]) -> peering::Settings {
        let mut out = self.settings().peering;
        for field in wanted
            .set_fields()
            .filter(|f| f.is_peering() && !given.contains(f))
        {
            match field {
                Field::PeeringName => {
                    if let Some(name) = &wanted.peering_name {
                        out.name.clone_from(name);
                    }
                }
                Field::PeeringPriority => out.priority = wanted.peering_priority.unwrap_or(out.priority),
                Field::PeeringStandalone => {
                    out.standalone = wanted.peering_standalone.unwrap_or(out.standalone)
                }
                Field::PeeringMandatory => out.required = wanted.peering_mandatory.unwrap_or(out.required),
                Field::PeeringLifetime => out.lifetime = wanted.peering_lifetime.unwrap_or(out.lifetime),
                _ => {}
            }
        }
        out
    }

    /// The API requests' timeout and the managed webhook configurations' name, with `wanted`'s
    /// applied where their flags are not `given`.
    pub fn client_with(&self, wanted: &OperatorSettings, given: &[Field]) -> (Duration, Option<String>) {
        let timeout = match wanted.api_timeout {
            Some(timeout) if !given.contains(&Field::ApiTimeout) => timeout,
            _ => self.api_timeout,
        };
        let managed = match &wanted.webhook_managed {
            Some(name) if !given.contains(&Field::WebhookManaged) => Some(name.clone()),
            _ => self.webhook.webhook_managed.clone().filter(|n| !n.is_empty()),
        };
        (timeout, managed)
    }

    /// The values of the `given` operator-wide settings' flags.
    pub fn given_operator_settings(&self, given: &[Field]) -> OperatorSettings {
        let mut out = OperatorSettings::default();
        for field in given {
            match field {
                Field::Finalizer => out.finalizer = Some(self.storage().keys.finalizer),
                Field::PersistencePrefix => out.persistence_prefix = Some(self.persistence_prefix.clone()),
                Field::ProgressStorage => {
                    out.progress_storage = Some(match self.progress_storage {
                        ProgressKind::Annotations => OperatorProgress::Annotations,
                        ProgressKind::Status => OperatorProgress::Status,
                        ProgressKind::Smart => OperatorProgress::Smart,
                    });
                }
                Field::DiffBaseStorage => {
                    out.diffbase_storage = Some(match self.diffbase_storage {
                        DiffBaseKind::Annotations => OperatorDiffBase::Annotations,
                        DiffBaseKind::Status => OperatorDiffBase::Status,
                    });
                }
                Field::DiffBaseKey => out.diffbase_key = Some(self.storage().keys.diffbase),
                Field::StatusField => out.status_field = Some(self.status_field.clone()),
                Field::WatchInactivityTimeout => {
                    out.watch_inactivity_timeout = Some(self.watch_inactivity_timeout)
                }
                Field::WatchServerTimeout => {
                    out.watch_server_timeout =
                        Some(Duration::from_secs(self.watch_server_timeout.as_secs().max(1)));
                }
                Field::WorkerLimit => out.worker_limit = u32::try_from(self.worker_limit).ok(),
                Field::PeeringName => out.peering_name.clone_from(&self.peering),
                Field::PeeringPriority => {
                    out.peering_priority = if self.dev {
                        Some(peering::DEV_PRIORITY)
                    } else {
                        self.priority
                    };
                }
                Field::PeeringStandalone => out.peering_standalone = Some(self.standalone),
                Field::PeeringMandatory => out.peering_mandatory = Some(!self.standalone),
                Field::PeeringLifetime => out.peering_lifetime = Some(self.peering_lifetime),
                Field::ApiTimeout => out.api_timeout = Some(self.api_timeout),
                Field::WebhookManaged => out.webhook_managed.clone_from(&self.webhook.webhook_managed),
            }
        }
        out
    }

    /// These flags with the values of `wanted` for the fields whose flags are not `given`, as
    /// if they had been given.
    ///
    /// # Errors
    /// When the combination cannot work (as [`RunArgs::check`] says).
    pub fn with_operator_settings(&self, wanted: &OperatorSettings, given: &[Field]) -> Result<Self, String> {
        let mut args = self.clone();
        for field in wanted.set_fields().filter(|f| !given.contains(f)) {
            match field {
                Field::Finalizer => args.finalizer.clone_from(&wanted.finalizer),
                Field::PersistencePrefix => {
                    if let Some(prefix) = &wanted.persistence_prefix {
                        args.persistence_prefix.clone_from(prefix);
                    }
                }
                Field::ProgressStorage => {
                    args.progress_storage = match wanted.progress_storage {
                        Some(OperatorProgress::Status) => ProgressKind::Status,
                        Some(OperatorProgress::Smart) => ProgressKind::Smart,
                        _ => ProgressKind::Annotations,
                    };
                }
                Field::DiffBaseStorage => {
                    args.diffbase_storage = match wanted.diffbase_storage {
                        Some(OperatorDiffBase::Status) => DiffBaseKind::Status,
                        _ => DiffBaseKind::Annotations,
                    };
                }
                Field::DiffBaseKey => args.diffbase_key.clone_from(&wanted.diffbase_key),
                Field::StatusField => {
                    if let Some(field) = &wanted.status_field {
                        args.status_field.clone_from(field);
                    }
                }
                Field::WatchInactivityTimeout => {
                    if let Some(d) = wanted.watch_inactivity_timeout {
                        args.watch_inactivity_timeout = d;
                    }
                }
                Field::WatchServerTimeout => {
                    if let Some(d) = wanted.watch_server_timeout {
                        args.watch_server_timeout = d;
                    }
                }
                Field::WorkerLimit => {
                    if let Some(n) = wanted.worker_limit {
                        args.worker_limit = usize::try_from(n).unwrap_or(args.worker_limit);
                    }
                }
                // The operator's peering, not its engine: see `peering_with`; the API client
                // and the webhook configurations follow on their own: see `client_with`.
                Field::PeeringName
                | Field::PeeringPriority
                | Field::PeeringStandalone
                | Field::PeeringMandatory
                | Field::PeeringLifetime
                | Field::ApiTimeout
                | Field::WebhookManaged => {}
            }
        }
        args.check()?;
        Ok(args)
    }

    /// Whether a kopf operator may read the diff-base Capstan writes: kopf's persistence, or
    /// kopf's prefix or diff-base key given by hand. kopf reads only the whole essence.
    fn kopf_reads_the_diffbase(&self) -> bool {
        let kopf = crate::persistence::keys::KOPF_PREFIX;
        let key = self.diffbase_key.as_deref().unwrap_or(&self.persistence_prefix);
        self.persistence == Persistence::Kopf
            || self.persistence_prefix == kopf
            || key.split_once('/').map_or(key, |(prefix, _)| prefix) == kopf
    }

    /// Combinations of flags that cannot work, said before anything starts.
    ///
    /// # Errors
    /// What is wrong.
    pub fn check(&self) -> Result<(), String> {
        if self.kopf_reads_the_diffbase() && self.diff_base == Some(DiffBaseExtent::Fields) {
            return Err(
                "--diff-base fields cannot be used with --persistence kopf or kopf's diff-base key: kopf reads only the whole essence it stores (use --diff-base full, the default there)".into(),
            );
        }
        if let Some(value) = self.handler_identity.as_deref() {
            crate::k8s::handler_identity::Spec::parse(value, self.handler_identity_dir.clone())
                .map_err(|e| e.to_string())?;
        }
        // Checked on the values, not as clap conflicts: the chart sets CAPSTAN_LEADER_ELECTION
        // to "false" beside CAPSTAN_SHARDING, which clap would count as given.
        if self.sharding && self.leader_election {
            return Err("--sharding cannot be used with --leader-election: sharding replaces it (every replica handles a share of the objects; none stands by)".into());
        }
        if self.sharding && self.node().is_some() {
            return Err("--sharding cannot be used in per-node mode (--node-name or $NODE_NAME): every node's operator already handles only its node's share".into());
        }
        if let Some(value) = self.node_storage.as_deref() {
            if self.node().is_none() {
                return Err("--node-storage needs per-node mode (--node-name or $NODE_NAME)".into());
            }
            crate::persistence::node_store::Spec::parse(value, 0)?;
        }
        Ok(())
    }

    /// The node-local storage, when asked for in per-node mode (see `check`).
    pub fn node_store_spec(&self) -> Option<crate::persistence::node_store::Spec> {
        let value = self.node_storage.as_deref()?;
        self.node()?;
        let mut spec = crate::persistence::node_store::Spec::parse(
            value,
            self.node_storage_limit_mib.saturating_mul(1 << 20),
        )
        .ok()?;
        spec.claim.clone_from(&self.node_storage_claim);
        Some(spec)
    }

    /// The node's name in per-node mode.
    pub fn node(&self) -> Option<String> {
        self.node_name
            .clone()
            .or_else(|| std::env::var("NODE_NAME").ok())
            .map(|n| n.trim().to_owned())
            .filter(|n| !n.is_empty())
    }

    fn storage(&self) -> Storage {
        let node = self.node();
        let prefix = match &node {
            Some(node) => crate::persistence::node::prefix_with(
                &self.node_prefix_template,
                node,
                &self.persistence_prefix,
            ),
            None => self.persistence_prefix.clone(),
        };
        let status_field = match &node {
            Some(node) => format!("{}-{}", self.status_field, crate::persistence::node::label(node)),
            None => self.status_field.clone(),
        };
        let mut keys = match self.persistence {
            Persistence::Capstan => Keys::new(&prefix),
            Persistence::Kopf => Keys::kopf_under(&prefix),
        };
        if let Some(k) = &self.diffbase_key {
            keys.diffbase.clone_from(k);
        }
        if let Some(f) = &self.finalizer {
            keys.finalizer.clone_from(f);
        }
        let progress = match self.progress_storage {
            ProgressKind::Annotations => match self.persistence {
                Persistence::Capstan => ProgressStorage::Annotations(keys.clone()),
                Persistence::Kopf => {
                    ProgressStorage::AnnotationsReadingStatus(keys.clone(), status_field.clone())
                }
            },
            ProgressKind::Status => ProgressStorage::Status {
                name: status_field.clone(),
            },
            ProgressKind::Smart => ProgressStorage::Smart(keys.clone(), status_field.clone()),
        };
        let diffbase = match self.diffbase_storage {
            DiffBaseKind::Annotations => DiffBaseStorage::Annotations(keys.clone()),
            DiffBaseKind::Status => DiffBaseStorage::Status { name: status_field },
        };
        // Node-local storage keeps the records as annotations of the bodies the engine sees;
        // the writer takes them out of every write.
        let (progress, diffbase) = if self.node_store_spec().is_some() {
            (
                ProgressStorage::Annotations(keys.clone()),
                DiffBaseStorage::Annotations(keys.clone()),
            )
        } else {
            (progress, diffbase)
        };
        let finalizers = match self.finalizers {
            Finalizers::Auto => node.is_none(),
            Finalizers::True => true,
            Finalizers::False => false,
        };
        let diffbase_extent = match self.diff_base {
            Some(DiffBaseExtent::Full) => Extent::Full,
            Some(DiffBaseExtent::Fields) => Extent::Fields,
            None if self.kopf_reads_the_diffbase() => Extent::Full,
            None => Extent::Fields,
        };
        Storage {
            keys,
            progress,
            diffbase,
            diffbase_extent,
            finalizers,
            local: None,
            conditions: if node.is_none() {
                crate::engine::conditions::Selection::from_flag(self.conditions.as_deref())
            } else {
                crate::engine::conditions::Selection::Off
            },
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
        assert!(!s.peering.required);
        assert_eq!(s.peering.priority, 0);
        assert!(!s.election.enabled);
        assert!(!s.connection.insecure_non_loopback);
        assert_eq!(s.connection.preface_timeout, Duration::from_secs(10));
    }

    #[test]
    fn operator_settings_apply_as_flags_unless_their_flag_was_given() {
        use clap::{CommandFactory, FromArgMatches};
        let matches = Cli::command()
            .try_get_matches_from([
                "capstan",
                "run",
                "--finalizer",
                "flag.example/f",
                "--worker-limit",
                "9",
            ])
            .unwrap();
        let Command::Run(args) = Cli::from_arg_matches(&matches).unwrap().command else {
            panic!("not run")
        };
        let given = RunArgs::given_operator_flags(matches.subcommand_matches("run").unwrap());
        assert_eq!(given, [Field::Finalizer, Field::WorkerLimit]);
        let flags = args.given_operator_settings(&given);
        assert_eq!(
            (flags.finalizer.as_deref(), flags.worker_limit, flags.status_field),
            (Some("flag.example/f"), Some(9), None)
        );
        let wanted = OperatorSettings {
            finalizer: Some("setting.example/f".into()),
            persistence_prefix: Some("setting.example".into()),
            progress_storage: Some(OperatorProgress::Status),
            status_field: Some("mine".into()),
            watch_server_timeout: Some(Duration::from_secs(60)),
            worker_limit: Some(2),
            ..OperatorSettings::default()
        };
        let engine = args
            .with_operator_settings(&wanted, &given)
            .unwrap()
            .settings()
            .engine;
        assert_eq!(engine.storage.keys.finalizer, "flag.example/f");
        assert_eq!(engine.worker_limit, 9);
        assert!(
            engine.storage.keys.diffbase.starts_with("setting.example/"),
            "{:?}",
            engine.storage.keys
        );
        assert_eq!(
            engine.storage.progress,
            ProgressStorage::Status { name: "mine".into() }
        );
        assert_eq!(engine.watch.server_timeout, 60);
        // A combination the flags refuse is refused for settings too.
        let kopf_fields = OperatorSettings {
            persistence_prefix: Some(crate::persistence::keys::KOPF_PREFIX.into()),
            ..OperatorSettings::default()
        };
        let fields = run_args(&["--diff-base", "fields"]);
        assert!(fields.with_operator_settings(&kopf_fields, &[]).is_err());
    }

    #[test]
    fn the_api_timeout_and_the_managed_name_apply_unless_given() {
        use clap::{CommandFactory, FromArgMatches};
        let wanted = OperatorSettings {
            api_timeout: Some(Duration::from_secs(45)),
            webhook_managed: Some("setting.example".into()),
            ..OperatorSettings::default()
        };
        let plain = run_args(&[]);
        assert_eq!(
            plain.client_with(&wanted, &[]),
            (Duration::from_secs(45), Some("setting.example".to_owned()))
        );
        assert_eq!(
            plain.client_with(&OperatorSettings::default(), &[]),
            (crate::k8s::switch::DEFAULT_REQUEST_TIMEOUT, None)
        );
        let matches = Cli::command()
            .try_get_matches_from([
                "capstan",
                "run",
                "--api-timeout",
                "10s",
                "--webhook-managed",
                "flag.example",
            ])
            .unwrap();
        let Command::Run(args) = Cli::from_arg_matches(&matches).unwrap().command else {
            panic!("not run")
        };
        let given = RunArgs::given_operator_flags(matches.subcommand_matches("run").unwrap());
        assert_eq!(given, [Field::ApiTimeout, Field::WebhookManaged]);
        assert_eq!(
            args.client_with(&wanted, &given),
            (Duration::from_secs(10), Some("flag.example".to_owned()))
        );
        let flags = args.given_operator_settings(&given);
        assert_eq!(
            (flags.api_timeout, flags.webhook_managed.as_deref()),
            (Some(Duration::from_secs(10)), Some("flag.example"))
        );
        // Neither restarts the engine.
        assert_eq!(wanted.restarting_engine(), OperatorSettings::default());
    }

    #[test]
    fn peering_settings_apply_unless_given_and_do_not_make_peering_required() {
        let wanted = OperatorSettings {
            peering_name: Some("mine".into()),
            peering_priority: Some(100),
            peering_lifetime: Some(Duration::from_secs(30)),
            ..OperatorSettings::default()
        };
        let plain = run_args(&[]);
        let peering = plain.peering_with(&wanted, &[]);
        assert_eq!(
            (peering.name.as_str(), peering.priority, peering.required),
            ("mine", 100, false)
        );
        assert_eq!(peering.lifetime, Duration::from_secs(30));
        let mandatory = OperatorSettings {
            peering_mandatory: Some(true),
            ..wanted.clone()
        };
        assert!(plain.peering_with(&mandatory, &[]).required);
        // --dev fixes the priority; --peering fixes the name and, with it, standalone.
        use clap::{CommandFactory, FromArgMatches};
        let matches = Cli::command()
            .try_get_matches_from(["capstan", "run", "--dev", "--peering", "flags"])
            .unwrap();
        let Command::Run(args) = Cli::from_arg_matches(&matches).unwrap().command else {
            panic!("not run")
        };
        let given = RunArgs::given_operator_flags(matches.subcommand_matches("run").unwrap());
        for field in [
            Field::PeeringName,
            Field::PeeringPriority,
            Field::PeeringStandalone,
            Field::PeeringMandatory,
        ] {
            assert!(
                given.contains(&field),
                "{field} not fixed by the flags: {given:?}"
            );
        }
        let standalone = OperatorSettings {
            peering_standalone: Some(true),
            ..wanted
        };
        let peering = args.peering_with(&standalone, &given);
        assert_eq!(
            (peering.name.as_str(), peering.priority, peering.standalone),
            ("flags", 666, false)
        );
        assert_eq!(
            peering.lifetime,
            Duration::from_secs(30),
            "the lifetime was not given"
        );
    }

    #[test]
    fn per_node_the_names_of_the_stored_state_are_fixed() {
        let args = run_args(&["--node-name", "node-1"]);
        let settings = args.settings_following_processes(Vec::new());
        let fixed = &settings.hub.operator_flags;
        assert!(
            fixed.finalizer.is_some() && fixed.persistence_prefix.is_some(),
            "{fixed:?}"
        );
        assert!(
            fixed.diffbase_key.is_some() && fixed.status_field.is_some(),
            "{fixed:?}"
        );
        assert_eq!(fixed.worker_limit, None, "the worker limit is not the node's");
    }

    #[test]
    fn the_transport_flags_map_onto_settings() {
        let s = run(&[
            "--listen",
            "0.0.0.0:7000",
            "--listen-insecure-non-loopback",
            "--preface-timeout",
            "3s",
        ]);
        assert!(s.connection.insecure_non_loopback);
        assert_eq!(s.connection.preface_timeout, Duration::from_secs(3));
    }

    #[test]
    fn conditions_are_chosen_per_resource() {
        use crate::engine::conditions::Selection;
        assert_eq!(run(&[]).engine.storage.conditions, Selection::Off);
        assert_eq!(
            run(&["--conditions"]).engine.storage.conditions,
            Selection::Custom
        );
        assert_eq!(
            run(&[
                "--conditions",
                "examples.demo.capstan.dev,pods",
                "--listen",
                "127.0.0.1:0"
            ])
            .engine
            .storage
            .conditions,
            Selection::Named(vec!["examples.demo.capstan.dev".into(), "pods".into()])
        );
        assert_eq!(
            run(&["--conditions", "--node-name", "n1"])
                .engine
                .storage
                .conditions,
            Selection::Off,
            "never per node"
        );
    }

    fn run(args: &[&str]) -> Settings {
        run_args(args).settings()
    }

    fn run_args(args: &[&str]) -> RunArgs {
        let cli = Cli::parse_from(["capstan", "run"].iter().chain(args));
        let Command::Run(args) = cli.command else {
            panic!("not run")
        };
        args
    }

    #[test]
    fn sharding_flags_map_onto_settings_and_refuse_what_it_replaces() {
        let sharded = run(&[
            "--sharding",
            "--lease-name",
            "ring",
            "--lease-duration",
            "6s",
            "--sharding-settle",
            "2s",
        ]);
        assert!(sharded.sharding.enabled && !sharded.election.enabled);
        assert_eq!(sharded.sharding.ring, "ring");
        assert_eq!(sharded.sharding.lease_duration, Duration::from_secs(6));
        assert_eq!(sharded.sharding.settle, Duration::from_secs(2));
        assert!(
            sharded.webhooks.leader_election,
            "one replica writes the webhook configurations"
        );
        let both = run_args(&["--sharding", "--leader-election"]);
        assert!(both.check().is_err_and(|e| e.contains("replaces it")));

        let per_node = run_args(&["--sharding", "--node-name", "n1"]);
        assert!(per_node.check().is_err_and(|e| e.contains("per-node mode")));
        assert!(run_args(&["--sharding"]).check().is_ok());
    }

    #[test]
    fn peering_flags_map_onto_settings() {
        let dev = run(&["--dev"]);
        assert_eq!(dev.peering.priority, 666);
        assert!(dev.peering.required);
        let named = run(&["--peering", "team", "--priority", "-5"]);
        assert_eq!(named.peering.name, "team");
        assert_eq!(named.peering.priority, -5);
        assert!(run(&["--standalone"]).peering.standalone);
        assert!(Cli::try_parse_from(["capstan", "run", "--standalone", "--dev"]).is_err());
        let elected = run(&[
            "--leader-election",
            "--lease-duration",
            "4s",
            "--renew-deadline",
            "3s",
            "--retry-period",
            "1s",
        ]);
        assert!(elected.election.enabled);
        assert_eq!(elected.election.lease_duration, Duration::from_secs(4));
        assert!(elected.election.validate().is_ok());
    }

    #[test]
    fn kopf_persistence_uses_kopf_names_unless_overridden() {
        let capstan = run(&[]).engine.storage;
        assert_eq!(capstan.keys, Keys::new("capstan.dev"));
        assert_eq!(
            capstan.progress,
            ProgressStorage::Annotations(Keys::new("capstan.dev"))
        );

        let kopf = run(&["--persistence", "kopf"]).engine.storage;
        assert_eq!(kopf.keys, Keys::kopf());
        assert_eq!(
            kopf.progress,
            ProgressStorage::AnnotationsReadingStatus(Keys::kopf(), "kopf".into())
        );
        assert_eq!(kopf.diffbase, DiffBaseStorage::Annotations(Keys::kopf()));

        let custom = run(&[
            "--persistence",
            "kopf",
            "--persistence-prefix",
            "my-op.example.com",
            "--finalizer",
            "example.com/fin",
            "--progress-storage",
            "smart",
        ])
        .engine
        .storage;
        assert_eq!(custom.keys.prefix, "my-op.example.com");
        assert_eq!(
            custom.keys.diffbase,
            "my-op.example.com/last-handled-configuration"
        );
        assert_eq!(custom.keys.finalizer, "example.com/fin");
        assert!(custom.keys.v1);
        assert!(matches!(custom.progress, ProgressStorage::Smart(_, ref name) if name == "kopf"));
        assert!(Cli::try_parse_from(["capstan", "run", "--persistence", "zalando"]).is_err());
    }

    #[test]
    fn the_watch_page_size_is_bounded() {
        assert_eq!(run(&[]).engine.watch.page_size, 500);
        assert_eq!(run(&["--watch-page-size", "1"]).engine.watch.page_size, 1);
        assert_eq!(
            run(&["--watch-page-size", "10000"]).engine.watch.page_size,
            10_000
        );
        for refused in ["0", "10001", "-1", "4294967296"] {
            assert!(Cli::try_parse_from(["capstan", "run", "--watch-page-size", refused]).is_err());
        }
    }

    #[test]
    fn the_diff_base_keeps_watched_fields_unless_full_or_kopf() {
        assert_eq!(run(&[]).engine.storage.diffbase_extent, Extent::Fields);
        let full = run(&["--diff-base", "full"]).engine.storage;
        assert_eq!(full.diffbase_extent, Extent::Full);
        let kopf = run(&["--persistence", "kopf"]).engine.storage;
        assert_eq!(kopf.diffbase_extent, Extent::Full);
        let check = |args: &[&str]| {
            let Command::Run(run) = Cli::parse_from(["capstan", "run"].iter().chain(args)).command else {
                panic!("not run")
            };
            run.check()
        };
        assert!(check(&["--persistence", "kopf", "--diff-base", "full"]).is_ok());
        let refused = check(&["--persistence", "kopf", "--diff-base", "fields"]).unwrap_err();
        assert!(refused.contains("--diff-base fields"), "{refused}");
        assert!(check(&["--diff-base", "fields"]).is_ok());
        // kopf's names given by hand: kopf may read what is written there.
        for args in [
            &["--persistence-prefix", "kopf.zalando.org"][..],
            &["--diffbase-key", "kopf.zalando.org/last-handled-configuration"][..],
        ] {
            assert_eq!(run(args).engine.storage.diffbase_extent, Extent::Full, "{args:?}");
            let with_fields: Vec<&str> = args.iter().copied().chain(["--diff-base", "fields"]).collect();
            assert!(check(&with_fields).is_err(), "{args:?}");
        }
    }

    #[test]
    fn freeze_targets_follow_the_scope() {
        let cli = Cli::parse_from([
            "capstan",
            "freeze",
            "--lifetime",
            "30",
            "-n",
            "a,b",
            "--message",
            "x",
        ]);
        let Command::Freeze(args) = cli.command else {
            panic!("not freeze")
        };
        assert_eq!(args.priority, 100);
        assert_eq!(args.lifetime, Duration::from_secs(30));
        assert_eq!(args.scope.targets().len(), 2);
        let cli = Cli::parse_from(["capstan", "resume"]);
        let Command::Resume(args) = cli.command else {
            panic!("not resume")
        };
        assert_eq!(args.scope.targets(), vec![Target::cluster("default")]);
    }
}
