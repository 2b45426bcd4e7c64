//! controller-runtime's metric families, fed by Capstan's queues and cycles.
//!
//! Operators judge controllers by dashboards and SLOs written against controller-runtime's
//! names (`workqueue_queue_duration_seconds` p99, `workqueue_depth`,
//! `controller_runtime_reconcile_total` …). Capstan exports them beside its own `capstan_*`
//! families, in the same registry, with controller-runtime's types, labels, units and
//! buckets, so that those dashboards and alerts work unchanged. In Capstan's terms:
//!
//! - the *workqueue* of a resource is its ready list: objects with work waiting for a worker
//!   (a permit of `--worker-limit`); labels `name` and `controller` are both the resource's
//!   plural, as controller-runtime sets both to the controller's name;
//! - an *add* is an object put on the ready list (an object already on it, or being processed,
//!   is not added again: its newer event replaces the waiting one);
//! - *queue duration* is from an object's work arriving on the ready list to a worker taking
//!   it; *work duration* is the worker's whole turn (its cycles and writes);
//! - a *reconcile* is one processing cycle of an object (its handlers, up to the plan that is
//!   written), with result `error` (a handler failed), `requeue` (interrupted, run again at
//!   once), `requeue_after` (a retry or timer is due later) or `success`;
//! - a *retry* is a cycle whose failed handler is scheduled to be retried.
//!
//! The gauges (depth, unfinished work, longest running processor, active workers, the worker
//! limit) are computed from the queues' state at every scrape. What is kept per object is its
//! arrival time while it is on the ready list (which the queue bounds) and its start time while
//! a worker processes it: nothing for objects at rest.

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    sync::{
        Arc,
        atomic::{AtomicI64, AtomicU64, Ordering},
    },
    time::Duration,
};

use parking_lot::{Mutex, RwLock};
use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric as _},
    metrics::{MetricType, counter::Counter, family::Family, gauge::ConstGauge, histogram::Histogram},
    registry::Registry,
};
use tokio::time::Instant;

/// controller-runtime's workqueue buckets: `prometheus.ExponentialBuckets(10e-9, 10, 12)`,
/// 10 ns to 1,000 s.
const QUEUE_BUCKETS: [f64; 12] = [
    1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0,
];

/// controller-runtime's buckets of `controller_runtime_reconcile_time_seconds`.
const RECONCILE_BUCKETS: [f64; 40] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25,
    1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 4.5, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 15.0, 20.0, 25.0, 30.0, 40.0,
    50.0, 60.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    name: String,
    controller: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ControllerLabels {
    controller: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    controller: String,
    result: String,
}

/// How a reconcile (one processing cycle of an object) ended, as controller-runtime's
/// `result` label says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reconciled {
    /// Nothing left to do until the object changes.
    Success,
    /// A handler failed (to be retried, or for good).
    Error,
    /// Interrupted: the object is processed again at once.
    Requeue,
    /// Something is due later (a delayed retry, a timer, a sleeping handler).
    RequeueAfter,
}

impl Reconciled {
    fn label(self) -> &'static str {
        match self {
            Reconciled::Success => "success",
            Reconciled::Error => "error",
            Reconciled::Requeue => "requeue",
            Reconciled::RequeueAfter => "requeue_after",
        }
    }
}

/// The families with values of their own (the others are computed at every scrape).
#[derive(Clone)]
struct Families {
    adds: Family<QueueLabels, Counter>,
    queue_duration: Family<QueueLabels, Histogram>,
    work_duration: Family<QueueLabels, Histogram>,
    retries: Family<QueueLabels, Counter>,
    reconciles: Family<ResultLabels, Counter>,
    errors: Family<ControllerLabels, Counter>,
    reconcile_time: Family<ControllerLabels, Histogram>,
}

fn queue_histogram() -> Histogram {
    Histogram::new(QUEUE_BUCKETS)
}

fn reconcile_histogram() -> Histogram {
    Histogram::new(RECONCILE_BUCKETS)
}

/// Every resource's workqueue metrics, and the gauges computed from them at every scrape.
pub(super) struct WorkQueues {
    families: Families,
    queues: RwLock<BTreeMap<String, Arc<WorkQueue>>>,
    /// `--worker-limit`: the objects processed at once, across resources.
    worker_limit: AtomicI64,
}

impl fmt::Debug for WorkQueues {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkQueues").finish_non_exhaustive()
    }
}

impl WorkQueues {
    /// Registers the families in `registry`.
    pub(super) fn register(registry: &mut Registry) -> Arc<Self> {
        let adds = Family::<QueueLabels, Counter>::default();
        registry.register(
            "workqueue_adds",
            "Total number of adds handled by workqueue (objects put on a resource's ready list).",
            adds.clone(),
        );
        let queue_duration =
            Family::<QueueLabels, Histogram>::new_with_constructor(queue_histogram as fn() -> Histogram);
        registry.register(
            "workqueue_queue_duration_seconds",
            "How long in seconds an item stays in workqueue before being requested (from an object's work arriving to a worker taking it).",
            queue_duration.clone(),
        );
        let work_duration =
            Family::<QueueLabels, Histogram>::new_with_constructor(queue_histogram as fn() -> Histogram);
        registry.register(
            "workqueue_work_duration_seconds",
            "How long in seconds processing an item from workqueue takes (a worker's turn: its cycles and writes).",
            work_duration.clone(),
        );
        let retries = Family::<QueueLabels, Counter>::default();
        registry.register(
            "workqueue_retries",
            "Total number of retries handled by workqueue (cycles whose failed handler is retried later).",
            retries.clone(),
        );
        let reconciles = Family::<ResultLabels, Counter>::default();
        registry.register(
            "controller_runtime_reconcile",
            "Total number of reconciliations (processing cycles of an object) per controller and result.",
            reconciles.clone(),
        );
        let errors = Family::<ControllerLabels, Counter>::default();
        registry.register(
            "controller_runtime_reconcile_errors",
            "Total number of reconciliation errors (cycles in which a handler failed) per controller.",
            errors.clone(),
        );
        let reconcile_time = Family::<ControllerLabels, Histogram>::new_with_constructor(
            reconcile_histogram as fn() -> Histogram,
        );
        registry.register(
            "controller_runtime_reconcile_time_seconds",
            "Length of time per reconciliation (processing cycle of an object) per controller.",
            reconcile_time.clone(),
        );
        let queues = Arc::new(Self {
            families: Families {
                adds,
                queue_duration,
                work_duration,
                retries,
                reconciles,
                errors,
                reconcile_time,
            },
            queues: RwLock::default(),
            worker_limit: AtomicI64::new(0),
        });
        registry.register_collector(Box::new(queues.clone()));
        queues
    }

    /// The metrics of `resource`'s workqueue, made on first use.
    pub(super) fn of(&self, resource: &str) -> Arc<WorkQueue> {
        if let Some(q) = self.queues.read().get(resource) {
            return q.clone();
        }
        self.queues
            .write()
            .entry(resource.to_owned())
            .or_insert_with(|| Arc::new(WorkQueue::new(resource, &self.families)))
            .clone()
    }

    /// Sets `--worker-limit` (`controller_runtime_max_concurrent_reconciles`).
    pub(super) fn set_worker_limit(&self, limit: usize) {
        self.worker_limit
            .store(i64::try_from(limit).unwrap_or(i64::MAX), Ordering::Relaxed);
    }
}

/// A gauge computed from one workqueue at a scrape.
struct Computed {
    name: &'static str,
    help: &'static str,
    /// Labelled `name` and `controller` (workqueue), or `controller` only (controller-runtime).
    workqueue: bool,
    value: fn(&WorkQueue, Instant, i64) -> Sample,
}

/// A computed gauge's value.
enum Sample {
    Count(usize),
    Seconds(f64),
}

const COMPUTED: [Computed; 5] = [
    Computed {
        name: "workqueue_depth",
        help: "Current depth of workqueue (objects on a resource's ready list, waiting for a worker).",
        workqueue: true,
        value: |q, _, _| Sample::Count(q.waiting.lock().len()),
    },
    Computed {
        name: "workqueue_unfinished_work_seconds",
        help: "How many seconds of work has been done that is in progress and hasn't been observed by work_duration. Large values indicate stuck threads.",
        workqueue: true,
        value: |q, now, _| {
            Sample::Seconds(
                q.running
                    .lock()
                    .values()
                    .map(|started| now.saturating_duration_since(*started).as_secs_f64())
                    .fold(0.0, |sum, s| sum + s),
            )
        },
    },
    Computed {
        name: "workqueue_longest_running_processor_seconds",
        help: "How many seconds has the longest running processor for workqueue been running.",
        workqueue: true,
        value: |q, now, _| {
            Sample::Seconds(
                q.running
                    .lock()
                    .values()
                    .map(|started| now.saturating_duration_since(*started).as_secs_f64())
                    .fold(0.0, f64::max),
            )
        },
    },
    Computed {
        name: "controller_runtime_active_workers",
        help: "Number of currently used workers per controller (objects of the resource being processed).",
        workqueue: false,
        value: |q, _, _| Sample::Count(q.running.lock().len()),
    },
    Computed {
        name: "controller_runtime_max_concurrent_reconciles",
        help: "Maximum number of concurrent reconciles per controller (--worker-limit, shared by all resources).",
        workqueue: false,
        value: |_, _, limit| Sample::Count(usize::try_from(limit).unwrap_or_default()),
    },
];

impl Collector for WorkQueues {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), fmt::Error> {
        let queues: Vec<Arc<WorkQueue>> = self.queues.read().values().cloned().collect();
        if queues.is_empty() {
            return Ok(());
        }
        let now = Instant::now();
        let limit = self.worker_limit.load(Ordering::Relaxed);
        for gauge in &COMPUTED {
            let mut family = encoder.encode_descriptor(gauge.name, gauge.help, None, MetricType::Gauge)?;
            for q in &queues {
                let value = (gauge.value)(q, now, limit);
                let controller = ControllerLabels {
                    controller: q.labels.controller.clone(),
                };
                let metric = if gauge.workqueue {
                    family.encode_family(&q.labels)?
                } else {
                    family.encode_family(&controller)?
                };
                match value {
                    Sample::Count(n) => ConstGauge::new(n).encode(metric)?,
                    Sample::Seconds(s) => ConstGauge::new(s).encode(metric)?,
                }
            }
        }
        Ok(())
    }
}

/// One resource's workqueue metrics.
pub struct WorkQueue {
    labels: QueueLabels,
    /// Objects on the ready list, and since when.
    waiting: Mutex<HashMap<Box<str>, Instant>>,
    /// Workers processing an object, and since when.
    running: Mutex<HashMap<u64, Instant>>,
    next: AtomicU64,
    adds: Counter,
    queue_duration: Histogram,
    work_duration: Histogram,
    retries: Counter,
    reconciles: [Counter; 4],
    errors: Counter,
    reconcile_time: Histogram,
}

impl fmt::Debug for WorkQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WorkQueue")
            .field("name", &self.labels.name)
            .finish_non_exhaustive()
    }
}

const RESULTS: [Reconciled; 4] = [
    Reconciled::Success,
    Reconciled::Error,
    Reconciled::Requeue,
    Reconciled::RequeueAfter,
];

impl WorkQueue {
    fn new(resource: &str, families: &Families) -> Self {
        let labels = QueueLabels {
            name: resource.to_owned(),
            controller: resource.to_owned(),
        };
        let controller = ControllerLabels {
            controller: resource.to_owned(),
        };
        let reconciles = RESULTS.map(|r| {
            families
                .reconciles
                .get_or_create(&ResultLabels {
                    controller: resource.to_owned(),
                    result: r.label().to_owned(),
                })
                .clone()
        });
        Self {
            adds: families.adds.get_or_create(&labels).clone(),
            queue_duration: families.queue_duration.get_or_create(&labels).clone(),
            work_duration: families.work_duration.get_or_create(&labels).clone(),
            retries: families.retries.get_or_create(&labels).clone(),
            errors: families.errors.get_or_create(&controller).clone(),
            reconcile_time: families.reconcile_time.get_or_create(&controller).clone(),
            reconciles,
            labels,
            waiting: Mutex::default(),
            running: Mutex::default(),
            next: AtomicU64::new(0),
        }
    }

    /// Object `uid` is put on the ready list (`workqueue_adds_total`, `workqueue_depth`).
    pub fn add(&self, uid: &str) {
        self.adds.inc();
        self.waiting.lock().entry(uid.into()).or_insert_with(Instant::now);
    }

    /// A worker takes object `uid` (`workqueue_queue_duration_seconds`); the worker's turn
    /// lasts as long as the returned handle (`workqueue_work_duration_seconds`,
    /// `controller_runtime_active_workers`, the unfinished work).
    pub fn take(self: &Arc<Self>, uid: &str) -> InFlight {
        let now = Instant::now();
        if let Some(arrived) = self.waiting.lock().remove(uid) {
            self.queue_duration
                .observe(now.saturating_duration_since(arrived).as_secs_f64());
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.running.lock().insert(id, now);
        InFlight {
            queue: self.clone(),
            id,
            started: now,
        }
    }

    /// The ready list was dropped (the queue stopped): nothing waits any more.
    pub fn clear(&self) {
        self.waiting.lock().clear();
    }

    /// A cycle's failed handler is to be retried (`workqueue_retries_total`).
    pub fn retry(&self) {
        self.retries.inc();
    }

    /// One reconcile (processing cycle) ended with `result` after `took`.
    pub fn reconciled(&self, result: Reconciled, took: Duration) {
        self.reconcile_time.observe(took.as_secs_f64());
        let index = RESULTS.iter().position(|r| *r == result).unwrap_or(0);
        self.reconciles[index].inc();
        if result == Reconciled::Error {
            self.errors.inc();
        }
    }
}

/// A worker's turn with an object, recorded when it ends (dropped).
pub struct InFlight {
    queue: Arc<WorkQueue>,
    id: u64,
    started: Instant,
}

impl fmt::Debug for InFlight {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlight")
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.queue.running.lock().remove(&self.id);
        self.queue
            .work_duration
            .observe(self.started.elapsed().as_secs_f64());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(registry: &Registry) -> String {
        let mut out = String::new();
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, registry);
        out
    }

    #[test]
    fn an_object_added_taken_and_reconciled_is_counted_in_every_family() {
        let mut registry = Registry::default();
        let queues = WorkQueues::register(&mut registry);
        queues.set_worker_limit(8);
        let q = queues.of("examples");
        q.add("u1");
        q.add("u2");
        let text = render(&registry);
        assert!(
            text.lines()
                .any(|l| l == "workqueue_depth{name=\"examples\",controller=\"examples\"} 2"),
            "{text}"
        );
        let turn = q.take("u1");
        q.reconciled(Reconciled::Error, Duration::from_millis(20));
        q.retry();
        let text = render(&registry);
        for sample in [
            "workqueue_depth{name=\"examples\",controller=\"examples\"} 1",
            "workqueue_adds_total{name=\"examples\",controller=\"examples\"} 2",
            "workqueue_queue_duration_seconds_count{name=\"examples\",controller=\"examples\"} 1",
            "workqueue_retries_total{name=\"examples\",controller=\"examples\"} 1",
            "controller_runtime_reconcile_total{controller=\"examples\",result=\"error\"} 1",
            "controller_runtime_reconcile_total{controller=\"examples\",result=\"success\"} 0",
            "controller_runtime_reconcile_errors_total{controller=\"examples\"} 1",
            "controller_runtime_reconcile_time_seconds_bucket{controller=\"examples\",le=\"0.025\"} 1",
            "controller_runtime_active_workers{controller=\"examples\"} 1",
            "controller_runtime_max_concurrent_reconciles{controller=\"examples\"} 8",
        ] {
            assert!(text.lines().any(|l| l == sample), "{sample} missing:\n{text}");
        }
        drop(turn);
        let text = render(&registry);
        for sample in [
            "workqueue_work_duration_seconds_count{name=\"examples\",controller=\"examples\"} 1",
            "controller_runtime_active_workers{controller=\"examples\"} 0",
            "workqueue_longest_running_processor_seconds{name=\"examples\",controller=\"examples\"} 0.0",
            "workqueue_unfinished_work_seconds{name=\"examples\",controller=\"examples\"} 0.0",
        ] {
            assert!(text.lines().any(|l| l == sample), "{sample} missing:\n{text}");
        }
        q.clear();
        assert_eq!(q.waiting.lock().len(), 0);
    }

    #[test]
    fn the_workqueue_buckets_are_controller_runtimes() {
        let mut registry = Registry::default();
        let queues = WorkQueues::register(&mut registry);
        drop(queues.of("examples").take("u"));
        let text = render(&registry);
        let bounds: Vec<&str> = text
            .lines()
            .filter(|l| l.starts_with("workqueue_work_duration_seconds_bucket{"))
            .filter_map(|l| l.split("le=\"").nth(1)?.split('"').next())
            .collect();
        assert_eq!(
            bounds,
            [
                "1e-08", "1e-07", "1e-06", "1e-05", "0.0001", "0.001", "0.01", "0.1", "1", "10", "100",
                "1000", "+Inf"
            ],
            "{text}"
        );
    }

    #[test]
    fn a_long_running_worker_shows_as_unfinished_work() {
        let mut registry = Registry::default();
        let queues = WorkQueues::register(&mut registry);
        let q = queues.of("examples");
        let _turn = q.take("u");
        std::thread::sleep(Duration::from_millis(30));
        let text = render(&registry);
        let value = |name: &str| -> f64 {
            text.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.rsplit(' ').next()?.parse().ok())
                .unwrap_or_default()
        };
        assert!(
            value("workqueue_longest_running_processor_seconds{") >= 0.03,
            "{text}"
        );
        assert!(value("workqueue_unfinished_work_seconds{") >= 0.03, "{text}");
    }
}
