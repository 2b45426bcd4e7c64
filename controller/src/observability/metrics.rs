//! Prometheus metrics, served at `/metrics` on the admin endpoint.
//!
//! Typed families of `prometheus-client`: per handler, invocations by outcome, invocation
//! durations (histogram) and retries; per resource, objects waiting for processing and API
//! writes; and gauges sampled when scraped (connected handler processes, paused, leadership).
//! Every family is registered once, when the registry is built, and recorded through a method
//! of [`Metrics`]: a metric cannot be recorded without being rendered, and the encoder escapes
//! every label value (handler ids come from handler processes and may hold any character), so
//! the page cannot be malformed. Updates touch only the family they record (a read lock on
//! its label map and an atomic), never one lock shared by all. One process-wide registry,
//! because metrics are observed from many layers (`grpc`, `engine`, `app`) and carry no
//! behaviour; `observability::admin` serves [`Metrics::render`]. controller-runtime's
//! families (`workqueue_*`, `controller_runtime_*`, `leader_election_master_status`) are in
//! the same registry, recorded through [`Metrics::workqueue`] (see `observability::workqueue`).

use std::{
    fmt,
    sync::{Arc, OnceLock},
    time::Duration,
};

use parking_lot::RwLock;
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _},
    metrics::{
        MetricType, counter::Counter, family::Family, gauge::ConstGauge, gauge::Gauge, histogram::Histogram,
    },
    registry::Registry,
};

/// The `Content-Type` of [`Metrics::render`]: the Prometheus text format 0.0.4.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Bucket bounds of the duration histogram, in seconds.
const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HandlerLabels {
    handler: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    handler: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AdmissionLabels {
    phase: String,
    result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabels {
    resource: String,
}

/// A gauge whose value is read from the controller's state at every scrape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Sampled {
    /// `capstan_handler_processes`: connected handler processes.
    HandlerProcesses,
    /// `capstan_paused`: 1 while dispatch is paused (frozen, standby, draining).
    Paused,
    /// `capstan_leader`: 1 while this replica holds the leader-election lease; rendered only
    /// once leader election samples it.
    Leader,
    /// `capstan_node_storage_objects`: objects with node-local state (with `--node-storage`).
    NodeStorageObjects,
    /// `capstan_node_storage_bytes`: bytes of node-local state (with `--node-storage`).
    NodeStorageBytes,
    /// `capstan_node_storage_corrupt_files`: node-local files found corrupt since start.
    NodeStorageCorrupt,
}

impl Sampled {
    const ALL: [Sampled; 6] = [
        Sampled::HandlerProcesses,
        Sampled::Paused,
        Sampled::Leader,
        Sampled::NodeStorageObjects,
        Sampled::NodeStorageBytes,
        Sampled::NodeStorageCorrupt,
    ];

    fn name(self) -> &'static str {
        match self {
            Sampled::HandlerProcesses => "capstan_handler_processes",
            Sampled::Paused => "capstan_paused",
            Sampled::Leader => "capstan_leader",
            Sampled::NodeStorageObjects => "capstan_node_storage_objects",
            Sampled::NodeStorageBytes => "capstan_node_storage_bytes",
            Sampled::NodeStorageCorrupt => "capstan_node_storage_corrupt_files",
        }
    }

    fn help(self) -> &'static str {
        match self {
            Sampled::HandlerProcesses => "Connected handler processes.",
            Sampled::Paused => "1 while dispatch is paused (frozen, standby, draining).",
            Sampled::Leader => {
                "1 while this replica holds the leader-election lease (only with --leader-election)."
            }
            Sampled::NodeStorageObjects => "Objects with state in the node-local storage.",
            Sampled::NodeStorageBytes => "Bytes of state in the node-local storage.",
            Sampled::NodeStorageCorrupt => {
                "Node-local state files found corrupt since start (their objects are handled as new)."
            }
        }
    }

    fn index(self) -> usize {
        match self {
            Sampled::HandlerProcesses => 0,
            Sampled::Paused => 1,
            Sampled::Leader => 2,
            Sampled::NodeStorageObjects => 3,
            Sampled::NodeStorageBytes => 4,
            Sampled::NodeStorageCorrupt => 5,
        }
    }
}

type SampleFn = Arc<dyn Fn() -> i64 + Send + Sync>;

/// The sampled gauges: a function per gauge, called at every scrape; a gauge without a
/// function is not rendered.
#[derive(Default)]
struct Samplers {
    functions: RwLock<[Option<SampleFn>; 6]>,
    /// `leader_election_master_status{name}`: the lease's name and whether this replica holds it.
    leader_election: RwLock<Option<(String, SampleFn)>>,
    /// `capstan_watch_up{resource}`: each watch by name, with its resource and whether it is up.
    watches: RwLock<std::collections::BTreeMap<String, (String, WatchFn)>>,
    /// With sharding: this member's name, and the ring's size and this member's moves.
    sharding: RwLock<Option<ShardingSamplers>>,
    /// With sharding: the objects this member's engine holds.
    sharding_objects: RwLock<Option<SampleFn>>,
}

/// The sampled sharding gauges of this member.
#[derive(Clone)]
struct ShardingSamplers {
    member: String,
    members: SampleFn,
    moves: Arc<dyn Fn() -> u64 + Send + Sync>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct MemberLabels {
    member: String,
}

type WatchFn = Arc<dyn Fn() -> bool + Send + Sync>;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ApiLabels {
    method: String,
    code: String,
}

/// The resident memory of this process in bytes (`VmRSS`), where the system tells it.
fn resident_memory() -> Option<i64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kib: i64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse()
        .ok()?;
    kib.checked_mul(1024)
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LeaseLabels {
    name: String,
}

impl fmt::Debug for Samplers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Samplers").finish_non_exhaustive()
    }
}

impl Collector for Samplers {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), fmt::Error> {
        // Sample outside the encoder so that a slow sampler holds no lock of the registry.
        let values: Vec<(Sampled, i64)> = {
            let functions = self.functions.read();
            Sampled::ALL
                .iter()
                .filter_map(|g| functions[g.index()].clone().map(|f| (*g, f)))
                .collect::<Vec<_>>()
        }
        .into_iter()
        .map(|(g, f)| (g, f()))
        .collect();
        for (gauge, value) in values {
            let metric = encoder.encode_descriptor(gauge.name(), gauge.help(), None, MetricType::Gauge)?;
            ConstGauge::new(value).encode(metric)?;
        }
        let mut up: std::collections::BTreeMap<String, bool> = std::collections::BTreeMap::new();
        let watches: Vec<(String, WatchFn)> = self.watches.read().values().cloned().collect();
        for (resource, f) in watches {
            let is_up = f();
            up.entry(resource).and_modify(|u| *u &= is_up).or_insert(is_up);
        }
        if !up.is_empty() {
            let mut family = encoder.encode_descriptor(
                "capstan_watch_up",
                "1 while every watch of the resource is established and moving (from its listing's first page on, while the rest is read); 0 while one is down or stuck (restarted with backoff).",
                None,
                MetricType::Gauge,
            )?;
            for (resource, is_up) in up {
                ConstGauge::new(i64::from(is_up))
                    .encode(family.encode_family(&ResourceLabels { resource })?)?;
            }
        }
        if let Some(bytes) = resident_memory() {
            let metric = encoder.encode_descriptor(
                "process_resident_memory_bytes",
                "Resident memory size in bytes.",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new(bytes).encode(metric)?;
        }
        let sharding = self.sharding.read().clone();
        if let Some(sharding) = sharding {
            let metric = encoder.encode_descriptor(
                "capstan_sharding_members",
                "Members of the sharding ring as this member sees it.",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new((sharding.members)()).encode(metric)?;
            let objects = self.sharding_objects.read().clone();
            if let Some(objects) = objects {
                let mut family = encoder.encode_descriptor(
                    "capstan_sharding_objects",
                    "Objects this member handles (known to its engine), by member.",
                    None,
                    MetricType::Gauge,
                )?;
                ConstGauge::new(objects()).encode(family.encode_family(&MemberLabels {
                    member: sharding.member.clone(),
                })?)?;
            }
            let mut family = encoder.encode_descriptor(
                "capstan_sharding_moves",
                "Ring changes that moved ranges of objects to or from this member, by member.",
                None,
                MetricType::Counter,
            )?;
            prometheus_client::metrics::counter::ConstCounter::new((sharding.moves)()).encode(
                family.encode_family(&MemberLabels {
                    member: sharding.member,
                })?,
            )?;
        }
        let leader = self.leader_election.read().clone();
        if let Some((name, f)) = leader {
            let value = f();
            let mut family = encoder.encode_descriptor(
                "leader_election_master_status",
                "Gauge of if the reporting system is master of the relevant lease, 0 indicates backup, 1 indicates master. 'name' is the string used to identify the lease.",
                None,
                MetricType::Gauge,
            )?;
            ConstGauge::new(value).encode(family.encode_family(&LeaseLabels { name })?)?;
        }
        Ok(())
    }
}

/// The registry and its typed families.
pub struct Metrics {
    registry: Registry,
    invocations: Family<OutcomeLabels, Counter>,
    durations: Family<HandlerLabels, Histogram>,
    retries: Family<HandlerLabels, Counter>,
    pending: Family<ResourceLabels, Gauge>,
    processing: Gauge,
    processing_peak: Gauge,
    api_requests: Gauge,
    api_responses: Family<ApiLabels, Counter>,
    writes: Family<ResourceLabels, Counter>,
    events_dropped: Family<HandlerLabels, Counter>,
    node_storage_read_errors: Counter,
    quarantined: Family<ResourceLabels, Counter>,
    handovers: Family<MemberLabels, Histogram>,
    watch_events: Family<ResourceLabels, Counter>,
    admission: AdmissionFamilies,
    samplers: Arc<Samplers>,
    workqueues: Arc<super::workqueue::WorkQueues>,
}

/// The admission webhook families.
struct AdmissionFamilies {
    requests: Family<AdmissionLabels, Counter>,
    durations: Family<PhaseLabels, Histogram>,
    denials: Family<HandlerLabels, Counter>,
    timeouts: Family<HandlerLabels, Counter>,
}

impl AdmissionFamilies {
    fn register(registry: &mut Registry) -> Self {
        let requests = Family::<AdmissionLabels, Counter>::default();
        registry.register(
            "capstan_admission_requests",
            "Admission reviews answered, by phase (validate, mutate) and result (allowed, denied, invalid, too_large, unknown).",
            requests.clone(),
        );
        let durations =
            Family::<PhaseLabels, Histogram>::new_with_constructor(histogram as fn() -> Histogram);
        registry.register(
            "capstan_admission_duration_seconds",
            "Time from an admission review's arrival to its answer, by phase.",
            durations.clone(),
        );
        let denials = Family::<HandlerLabels, Counter>::default();
        registry.register(
            "capstan_admission_denials",
            "Admission requests denied, by the handler that denied or failed them.",
            denials.clone(),
        );
        let timeouts = Family::<HandlerLabels, Counter>::default();
        registry.register(
            "capstan_admission_timeouts",
            "Admission handler invocations that did not answer before the review's deadline, by handler.",
            timeouts.clone(),
        );
        Self {
            requests,
            durations,
            denials,
            timeouts,
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let invocations = Family::<OutcomeLabels, Counter>::default();
        registry.register(
            "capstan_handler_invocations",
            "Handler invocations by handler and outcome.",
            invocations.clone(),
        );
        let durations =
            Family::<HandlerLabels, Histogram>::new_with_constructor(histogram as fn() -> Histogram);
        registry.register(
            "capstan_handler_duration_seconds",
            "Time from dispatch to result, by handler.",
            durations.clone(),
        );
        let retries = Family::<HandlerLabels, Counter>::default();
        registry.register(
            "capstan_handler_retries",
            "Failed attempts scheduled for a retry, by handler.",
            retries.clone(),
        );
        let pending = Family::<ResourceLabels, Gauge>::default();
        registry.register(
            "capstan_objects_pending",
            "Objects with an event waiting for processing with its body, by resource (about the queue's waiting bound at most: beyond it, objects wait to be listed again).",
            pending.clone(),
        );
        let processing = Gauge::default();
        registry.register(
            "capstan_objects_processing",
            "Objects being processed now, across resources (at most --worker-limit; the others wait in their queues).",
            processing.clone(),
        );
        let processing_peak = Gauge::default();
        registry.register(
            "capstan_objects_processing_peak",
            "The most objects processed at the same time since the start.",
            processing_peak.clone(),
        );
        let api_requests = Gauge::default();
        registry.register(
            "capstan_api_requests_in_flight",
            "API requests other than watches in flight (at most --api-requests; more wait their turn).",
            api_requests.clone(),
        );
        let api_responses = Family::<ApiLabels, Counter>::default();
        registry.register(
            "capstan_api_requests",
            "API requests other than watches' streams, by method and answer: the HTTP status code, or error (no answer) or timeout.",
            api_responses.clone(),
        );
        let writes = Family::<ResourceLabels, Counter>::default();
        registry.register(
            "capstan_api_writes",
            "PATCH requests sent for handled changes, by resource.",
            writes.clone(),
        );
        let events_dropped = Family::<HandlerLabels, Counter>::default();
        registry.register(
            "capstan_events_dropped",
            "Watch events not passed to a fire-and-forget event handler because its invocations were at their limit, by handler.",
            events_dropped.clone(),
        );
        let node_storage_read_errors = Counter::default();
        registry.register(
            "capstan_node_storage_read_errors",
            "Reads of node-local state files that failed other than for a missing file (their objects wait until the file can be read).",
            node_storage_read_errors.clone(),
        );
        let quarantined = Family::<ResourceLabels, Counter>::default();
        registry.register(
            "capstan_objects_quarantined",
            "Objects received that could not be parsed (logged with their name and skipped; the others of the resource are processed), by resource.",
            quarantined.clone(),
        );
        let handovers =
            Family::<MemberLabels, Histogram>::new_with_constructor(histogram as fn() -> Histogram);
        registry.register(
            "capstan_sharding_handover_seconds",
            "How long this member paused for a ring change (from seeing it to handling its new ranges), by member.",
            handovers.clone(),
        );
        let watch_events = Family::<ResourceLabels, Counter>::default();
        registry.register(
            "capstan_watch_events",
            "Objects received from the resource watches (listed or in watch events, before a sharded member drops other members' objects), by resource.",
            watch_events.clone(),
        );
        let admission = AdmissionFamilies::register(&mut registry);
        let samplers = Arc::new(Samplers::default());
        registry.register_collector(Box::new(samplers.clone()));
        let workqueues = super::workqueue::WorkQueues::register(&mut registry);
        Self {
            registry,
            invocations,
            durations,
            retries,
            pending,
            processing,
            processing_peak,
            api_requests,
            api_responses,
            writes,
            events_dropped,
            node_storage_read_errors,
            quarantined,
            handovers,
            watch_events,
            admission,
            samplers,
            workqueues,
        }
    }
}

fn histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

/// The process-wide registry.
pub fn global() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::default)
}

impl Metrics {
    /// Records the result of one handler invocation: its outcome (`capstan_handler_invocations_total`)
    /// and the time from dispatch to result (`capstan_handler_duration_seconds`).
    pub fn invocation(&self, handler: &str, outcome: &str, duration: Duration) {
        self.durations
            .get_or_create(&HandlerLabels {
                handler: handler.to_owned(),
            })
            .observe(duration.as_secs_f64());
        self.invocations
            .get_or_create(&OutcomeLabels {
                handler: handler.to_owned(),
                outcome: outcome.to_owned(),
            })
            .inc();
    }

    /// Counts a failed attempt scheduled for a retry (`capstan_handler_retries_total`).
    pub fn retry(&self, handler: &str) {
        self.retries
            .get_or_create(&HandlerLabels {
                handler: handler.to_owned(),
            })
            .inc();
    }

    /// Adds `delta` to the objects waiting for processing (`capstan_objects_pending`).
    pub fn pending(&self, resource: &str, delta: i64) {
        self.pending
            .get_or_create(&ResourceLabels {
                resource: resource.to_owned(),
            })
            .inc_by(delta);
    }

    /// Adds `delta` (+1 or -1) to the objects being processed (`capstan_objects_processing`),
    /// and raises its peak (`capstan_objects_processing_peak`).
    pub fn processing(&self, delta: i64) {
        let now = self.processing.inc_by(delta).saturating_add(delta);
        self.processing_peak
            .inner()
            .fetch_max(now, std::sync::atomic::Ordering::Relaxed);
    }

    /// Objects being processed now (`capstan_objects_processing`).
    pub fn processing_now(&self) -> i64 {
        self.processing.get()
    }

    /// Adds `delta` (+1 or -1) to the API requests in flight (`capstan_api_requests_in_flight`).
    pub fn api_requests(&self, delta: i64) {
        self.api_requests.inc_by(delta);
    }

    /// Counts one API request's answer (`capstan_api_requests_total{method,code}`): its status
    /// code, or `error` or `timeout`.
    pub fn api_response(&self, method: &str, code: &str) {
        self.api_responses
            .get_or_create(&ApiLabels {
                method: method.to_owned(),
                code: code.to_owned(),
            })
            .inc();
    }

    /// Registers (or replaces) watch `name` of `resource`, and the function that says whether
    /// it is up (`capstan_watch_up{resource}`).
    pub fn sample_watch(&self, name: &str, resource: &str, up: impl Fn() -> bool + Send + Sync + 'static) {
        self.samplers
            .watches
            .write()
            .insert(name.to_owned(), (resource.to_owned(), Arc::new(up)));
    }

    /// Counts one PATCH request for a handled change (`capstan_api_writes_total`).
    pub fn api_write(&self, resource: &str) {
        self.writes
            .get_or_create(&ResourceLabels {
                resource: resource.to_owned(),
            })
            .inc();
    }

    /// Counts a watch event not passed to a fire-and-forget event handler because its
    /// invocations were at their limit (`capstan_events_dropped_total`).
    pub fn event_dropped(&self, handler: &str) {
        self.events_dropped
            .get_or_create(&HandlerLabels {
                handler: handler.to_owned(),
            })
            .inc();
    }

    /// Counts a node-local state file that exists but could not be read
    /// (`capstan_node_storage_read_errors_total`).
    pub fn node_storage_read_error(&self) {
        self.node_storage_read_errors.inc();
    }

    /// Counts an object received that could not be parsed and was skipped
    /// (`capstan_objects_quarantined_total`).
    pub fn object_quarantined(&self, resource: &str) {
        self.quarantined
            .get_or_create(&ResourceLabels {
                resource: resource.to_owned(),
            })
            .inc();
    }

    /// Records one answered admission review (`capstan_admission_requests_total`,
    /// `capstan_admission_duration_seconds`).
    pub fn admission_request(&self, phase: &str, result: &str, duration: Duration) {
        self.admission
            .durations
            .get_or_create(&PhaseLabels {
                phase: phase.to_owned(),
            })
            .observe(duration.as_secs_f64());
        self.admission
            .requests
            .get_or_create(&AdmissionLabels {
                phase: phase.to_owned(),
                result: result.to_owned(),
            })
            .inc();
    }

    /// Counts an admission request denied by (or because of) `handler`
    /// (`capstan_admission_denials_total`).
    pub fn admission_denial(&self, handler: &str) {
        self.admission
            .denials
            .get_or_create(&HandlerLabels {
                handler: handler.to_owned(),
            })
            .inc();
    }

    /// Counts an admission handler invocation that timed out (`capstan_admission_timeouts_total`).
    pub fn admission_timeout(&self, handler: &str) {
        self.admission
            .timeouts
            .get_or_create(&HandlerLabels {
                handler: handler.to_owned(),
            })
            .inc();
    }

    /// Registers (or replaces) the function a sampled gauge is read from at every scrape.
    pub fn sample(&self, gauge: Sampled, f: impl Fn() -> i64 + Send + Sync + 'static) {
        self.samplers.functions.write()[gauge.index()] = Some(Arc::new(f));
    }

    /// Registers the function that says whether this replica holds lease `name`
    /// (`leader_election_master_status{name}`, as client-go's leader election reports it).
    pub fn sample_leader(&self, name: &str, f: impl Fn() -> i64 + Send + Sync + 'static) {
        *self.samplers.leader_election.write() = Some((name.to_owned(), Arc::new(f)));
    }

    /// Registers this sharding member's gauges: the ring's size and the ring changes that
    /// moved ranges to or from it (`capstan_sharding_members`, `capstan_sharding_moves_total`).
    pub fn sample_sharding(
        &self,
        member: &str,
        members: impl Fn() -> i64 + Send + Sync + 'static,
        moves: impl Fn() -> u64 + Send + Sync + 'static,
    ) {
        *self.samplers.sharding.write() = Some(ShardingSamplers {
            member: member.to_owned(),
            members: Arc::new(members),
            moves: Arc::new(moves),
        });
    }

    /// Registers (or replaces, as engines are replaced) how many objects this sharding member
    /// handles (`capstan_sharding_objects{member}`).
    pub fn sample_sharding_objects(&self, f: impl Fn() -> i64 + Send + Sync + 'static) {
        *self.samplers.sharding_objects.write() = Some(Arc::new(f));
    }

    /// Counts an object received from a resource watch (`capstan_watch_events_total`).
    pub fn watch_event(&self, resource: &str) {
        self.watch_events
            .get_or_create(&ResourceLabels {
                resource: resource.to_owned(),
            })
            .inc();
    }

    /// Records how long a hand-over paused `member` (`capstan_sharding_handover_seconds`).
    pub fn sharding_handover(&self, member: &str, took: Duration) {
        self.handovers
            .get_or_create(&MemberLabels {
                member: member.to_owned(),
            })
            .observe(took.as_secs_f64());
    }

    /// The controller-runtime metrics of `resource`'s workqueue and cycles (`workqueue_*`,
    /// `controller_runtime_*`, labelled by the resource's plural).
    pub fn workqueue(&self, resource: &str) -> Arc<super::workqueue::WorkQueue> {
        self.workqueues.of(resource)
    }

    /// Sets `--worker-limit` (`controller_runtime_max_concurrent_reconciles`).
    pub fn worker_limit(&self, limit: usize) {
        self.workqueues.set_worker_limit(limit);
    }

    /// The Prometheus text exposition (format 0.0.4, [`CONTENT_TYPE`]) of every family.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail; an encoder error would only truncate the page.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_text_format() {
        let m = Metrics::default();
        m.invocation("create_fn", "success", Duration::from_millis(3));
        m.invocation("create_fn", "success", Duration::from_millis(3));
        m.sample(Sampled::HandlerProcesses, || 2);
        let text = m.render();
        assert!(
            text.contains("capstan_handler_invocations_total{handler=\"create_fn\",outcome=\"success\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("capstan_handler_duration_seconds_bucket{handler=\"create_fn\",le=\"0.005\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("capstan_handler_duration_seconds_bucket{handler=\"create_fn\",le=\"0.0025\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("capstan_handler_duration_seconds_count{handler=\"create_fn\"} 2"),
            "{text}"
        );
        assert!(text.lines().any(|l| l == "capstan_handler_processes 2"), "{text}");
        assert!(text.contains("# TYPE capstan_handler_duration_seconds histogram"));
        assert!(
            text.contains("# TYPE capstan_handler_invocations_total counter"),
            "{text}"
        );
        assert!(
            !text.contains("capstan_leader"),
            "not sampled, not rendered: {text}"
        );
    }

    #[test]
    fn every_recorded_family_is_rendered() {
        let m = Metrics::default();
        m.invocation("h", "success", Duration::from_millis(1));
        m.retry("h");
        m.pending("examples", 1);
        m.pending("examples", 1);
        m.pending("examples", -1);
        m.api_write("examples");
        m.event_dropped("h");
        m.object_quarantined("examples");
        m.sample(Sampled::Paused, || 0);
        m.sample(Sampled::Leader, || 1);
        let text = m.render();
        for sample in [
            "capstan_handler_invocations_total{handler=\"h\",outcome=\"success\"} 1",
            "capstan_handler_duration_seconds_count{handler=\"h\"} 1",
            "capstan_handler_retries_total{handler=\"h\"} 1",
            "capstan_objects_pending{resource=\"examples\"} 1",
            "capstan_api_writes_total{resource=\"examples\"} 1",
            "capstan_events_dropped_total{handler=\"h\"} 1",
            "capstan_objects_quarantined_total{resource=\"examples\"} 1",
            "capstan_paused 0",
            "capstan_leader 1",
        ] {
            assert!(text.lines().any(|l| l == sample), "{sample} missing:\n{text}");
        }
        exposition_tests::check_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
    }

    #[test]
    fn updates_from_many_threads_are_all_counted() {
        let m = Arc::new(Metrics::default());
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for i in 0..1000 {
                        m.retry(&format!("h{}", (t + i) % 4));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().expect("a recording thread panicked");
        }
        let text = m.render();
        let total: u64 = text
            .lines()
            .filter(|l| l.starts_with("capstan_handler_retries_total{"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
            .sum();
        assert_eq!(total, 8000, "{text}");
    }
}

#[cfg(test)]
mod exposition_tests {
    use super::*;

    /// Checks the Prometheus text format line by line: comments, then samples of the form
    /// `name{label="value",…} number`, with label values escaped (`\\`, `\"`, `\n` only) and
    /// every sample belonging to a family declared by a `# TYPE` line.
    pub(super) fn check_exposition(text: &str) -> Result<(), String> {
        let mut families: Vec<String> = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let fail = |why: &str| Err(format!("line {}: {why}: {line:?}", n + 1));
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut parts = rest.split(' ');
                let (Some(name), Some(kind), None) = (parts.next(), parts.next(), parts.next()) else {
                    return fail("malformed TYPE");
                };
                if !["counter", "gauge", "histogram", "untyped", "summary"].contains(&kind) {
                    return fail("unknown type");
                }
                if families.iter().any(|f| f == name) {
                    return fail("family declared twice");
                }
                families.push(name.to_owned());
                continue;
            }
            if line.starts_with("# HELP ") || line == "# EOF" {
                continue;
            }
            if line.starts_with('#') {
                return fail("unexpected comment");
            }
            let name_end = line.find(['{', ' ']).unwrap_or(line.len());
            let name = &line[..name_end];
            let name_ok = !name.is_empty()
                && name.chars().enumerate().all(|(i, c)| {
                    c.is_ascii_alphabetic() || c == '_' || c == ':' || (i > 0 && c.is_ascii_digit())
                });
            if !name_ok {
                return fail("bad metric name");
            }
            if !families.iter().any(|f| {
                name == f
                    || ["_bucket", "_sum", "_count", "_total"]
                        .iter()
                        .any(|s| name.strip_suffix(s) == Some(f.as_str()))
            }) {
                return fail("sample of an undeclared family");
            }
            let mut rest = &line[name_end..];
            if let Some(labels) = rest.strip_prefix('{') {
                let mut chars = labels.char_indices().peekable();
                loop {
                    let key: String = chars
                        .by_ref()
                        .take_while(|(_, c)| *c != '=')
                        .map(|(_, c)| c)
                        .collect();
                    if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                        return fail("bad label name");
                    }
                    if chars.next().map(|(_, c)| c) != Some('"') {
                        return fail("label value not quoted");
                    }
                    loop {
                        match chars.next().map(|(_, c)| c) {
                            Some('\\') => match chars.next().map(|(_, c)| c) {
                                Some('\\' | '"' | 'n') => {}
                                _ => return fail("bad escape in a label value"),
                            },
                            Some('"') => break,
                            Some(_) => {}
                            None => return fail("unterminated label value"),
                        }
                    }
                    match chars.next() {
                        Some((_, ',')) => {}
                        Some((i, '}')) => {
                            rest = &labels[i + 1..];
                            break;
                        }
                        _ => return fail("bad label separator"),
                    }
                }
            }
            let Some(value) = rest.strip_prefix(' ') else {
                return fail("no value");
            };
            let value = value.split(' ').next().unwrap_or_default();
            if value.parse::<f64>().is_err() && !["+Inf", "-Inf", "NaN"].contains(&value) {
                return fail("bad value");
            }
        }
        Ok(())
    }

    /// The families of controller-runtime (and client-go's leader election) the page must
    /// hold, with their types as controller-runtime declares them.
    pub(crate) const CONTROLLER_RUNTIME_FAMILIES: [(&str, &str); 17] = [
        ("workqueue_depth", "gauge"),
        ("workqueue_adds_total", "counter"),
        ("workqueue_queue_duration_seconds", "histogram"),
        ("workqueue_work_duration_seconds", "histogram"),
        ("workqueue_unfinished_work_seconds", "gauge"),
        ("workqueue_longest_running_processor_seconds", "gauge"),
        ("workqueue_retries_total", "counter"),
        ("controller_runtime_reconcile_total", "counter"),
        ("controller_runtime_reconcile_errors_total", "counter"),
        ("controller_runtime_reconcile_time_seconds", "histogram"),
        ("controller_runtime_active_workers", "gauge"),
        ("controller_runtime_max_concurrent_reconciles", "gauge"),
        ("leader_election_master_status", "gauge"),
        ("capstan_handler_invocations_total", "counter"),
        ("capstan_watch_up", "gauge"),
        ("capstan_api_requests_total", "counter"),
        ("process_resident_memory_bytes", "gauge"),
    ];

    /// The `# TYPE` lines of a page, by family.
    fn types(text: &str) -> std::collections::BTreeMap<&str, &str> {
        text.lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_once(' '))
            .collect()
    }

    #[test]
    fn the_page_holds_controller_runtimes_families_with_their_types() {
        let m = Metrics::default();
        m.worker_limit(4);
        m.sample_leader("capstan-leader", || 1);
        m.sample_watch("watch/examples/a", "examples", || true);
        m.sample_watch("watch/examples/b", "examples", || false);
        m.api_response("PATCH", "409");
        m.invocation("h", "success", Duration::from_millis(1));
        let q = m.workqueue("examples");
        q.add("u");
        let turn = q.take("u");
        q.reconciled(
            super::super::workqueue::Reconciled::Success,
            Duration::from_millis(2),
        );
        q.retry();
        drop(turn);
        let text = m.render();
        check_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        let types = types(&text);
        for (family, kind) in CONTROLLER_RUNTIME_FAMILIES {
            assert_eq!(types.get(family), Some(&kind), "{family}:\n{text}");
            let samples = text
                .lines()
                .filter(|l| !l.starts_with('#'))
                .filter(|l| l.starts_with(family.trim_end_matches("_total")))
                .count();
            assert!(samples > 0, "no sample of {family}:\n{text}");
        }
        for sample in [
            "workqueue_adds_total{name=\"examples\",controller=\"examples\"} 1",
            "controller_runtime_reconcile_total{controller=\"examples\",result=\"success\"} 1",
            "controller_runtime_max_concurrent_reconciles{controller=\"examples\"} 4",
            "leader_election_master_status{name=\"capstan-leader\"} 1",
            "capstan_watch_up{resource=\"examples\"} 0",
            "capstan_api_requests_total{method=\"PATCH\",code=\"409\"} 1",
        ] {
            assert!(text.lines().any(|l| l == sample), "{sample} missing:\n{text}");
        }
    }

    #[test]
    fn a_handler_id_with_quotes_backslashes_and_newlines_renders_a_valid_page() {
        let m = Metrics::default();
        let id = "evil\"id\\with\nnewline} 1\nfake_metric 2";
        m.invocation(id, "success", Duration::from_millis(3));
        m.retry(id);
        m.pending(id, 1);
        m.api_write(id);
        let text = m.render();
        check_exposition(&text).unwrap_or_else(|e| panic!("{e}\n{text}"));
        assert!(!text.lines().any(|l| l.starts_with("fake_metric")), "{text}");
    }
}
