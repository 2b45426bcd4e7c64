//! Prometheus metrics, served at `/metrics` on the admin endpoint.
//!
//! A handful of families, written in the Prometheus text format by hand (no dependency): per
//! handler, invocations by outcome, invocation durations (histogram) and retries; per
//! resource, objects waiting for processing and API writes; and gauges evaluated when scraped
//! (connected handler processes, paused, leadership). One process-wide registry, because
//! metrics are observed from many layers and carry no behaviour.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    sync::{Arc, OnceLock},
    time::Duration,
};

use parking_lot::{Mutex, RwLock};

/// Bucket bounds of the duration histogram, in seconds.
const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0,
];

type Labels = Vec<(&'static str, String)>;
type GaugeFn = Arc<dyn Fn() -> f64 + Send + Sync>;

#[derive(Default)]
struct Histogram {
    counts: [u64; BUCKETS.len()],
    sum: f64,
    count: u64,
}

/// The registry.
#[derive(Default)]
pub struct Metrics {
    counters: Mutex<BTreeMap<(&'static str, Labels), u64>>,
    gauges: Mutex<BTreeMap<(&'static str, Labels), f64>>,
    histograms: Mutex<BTreeMap<(&'static str, Labels), Histogram>>,
    functions: RwLock<BTreeMap<&'static str, GaugeFn>>,
}

/// Help texts and types of every family.
const FAMILIES: [(&str, &str, &str); 8] = [
    (
        "capstan_handler_invocations_total",
        "counter",
        "Handler invocations by handler and outcome.",
    ),
    (
        "capstan_handler_duration_seconds",
        "histogram",
        "Time from dispatch to result, by handler.",
    ),
    (
        "capstan_handler_retries_total",
        "counter",
        "Failed attempts scheduled for a retry, by handler.",
    ),
    (
        "capstan_objects_pending",
        "gauge",
        "Objects with an event waiting for processing, by resource.",
    ),
    (
        "capstan_api_writes_total",
        "counter",
        "PATCH requests sent for handled changes, by resource.",
    ),
    (
        "capstan_handler_processes",
        "gauge",
        "Connected handler processes.",
    ),
    (
        "capstan_paused",
        "gauge",
        "1 while dispatch is paused (frozen, standby, draining).",
    ),
    (
        "capstan_leader",
        "gauge",
        "1 while this replica holds the leader-election lease (only with --leader-election).",
    ),
];

/// The process-wide registry.
pub fn global() -> &'static Metrics {
    static METRICS: OnceLock<Metrics> = OnceLock::new();
    METRICS.get_or_init(Metrics::default)
}

impl Metrics {
    /// Adds one to a counter.
    pub fn inc(&self, name: &'static str, labels: &[(&'static str, &str)]) {
        *self.counters.lock().entry((name, owned(labels))).or_default() += 1;
    }

    /// Adds `delta` to a gauge.
    pub fn add(&self, name: &'static str, labels: &[(&'static str, &str)], delta: f64) {
        *self.gauges.lock().entry((name, owned(labels))).or_default() += delta;
    }

    /// Records a duration.
    pub fn observe(&self, name: &'static str, labels: &[(&'static str, &str)], value: Duration) {
        let secs = value.as_secs_f64();
        let mut histograms = self.histograms.lock();
        let h = histograms.entry((name, owned(labels))).or_default();
        for (i, bound) in BUCKETS.iter().enumerate() {
            if secs <= *bound {
                h.counts[i] += 1;
            }
        }
        h.sum += secs;
        h.count += 1;
    }

    /// Registers (or replaces) a gauge evaluated at every scrape.
    pub fn gauge_fn(&self, name: &'static str, f: impl Fn() -> f64 + Send + Sync + 'static) {
        self.functions.write().insert(name, Arc::new(f));
    }

    /// The Prometheus text exposition of every family.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let counters = self.counters.lock();
        let gauges = self.gauges.lock();
        let histograms = self.histograms.lock();
        let functions = self.functions.read();
        for (family, kind, help) in FAMILIES {
            let _ = writeln!(out, "# HELP {family} {help}\n# TYPE {family} {kind}");
            for ((name, labels), value) in counters.iter().filter(|((n, _), _)| *n == family) {
                let _ = writeln!(out, "{name}{} {value}", render_labels(labels, None));
            }
            for ((name, labels), value) in gauges.iter().filter(|((n, _), _)| *n == family) {
                let _ = writeln!(out, "{name}{} {value}", render_labels(labels, None));
            }
            for ((name, labels), h) in histograms.iter().filter(|((n, _), _)| *n == family) {
                for (i, bound) in BUCKETS.iter().enumerate() {
                    let le = format!("{bound}");
                    let _ = writeln!(
                        out,
                        "{name}_bucket{} {}",
                        render_labels(labels, Some(&le)),
                        h.counts[i]
                    );
                }
                let _ = writeln!(
                    out,
                    "{name}_bucket{} {}",
                    render_labels(labels, Some("+Inf")),
                    h.count
                );
                let _ = writeln!(out, "{name}_sum{} {}", render_labels(labels, None), h.sum);
                let _ = writeln!(out, "{name}_count{} {}", render_labels(labels, None), h.count);
            }
            if let Some(f) = functions.get(family) {
                let _ = writeln!(out, "{family} {}", f());
            }
        }
        out
    }
}

fn owned(labels: &[(&'static str, &str)]) -> Labels {
    labels.iter().map(|(k, v)| (*k, (*v).to_owned())).collect()
}

fn render_labels(labels: &Labels, le: Option<&str>) -> String {
    let mut parts: Vec<String> = labels
        .iter()
        .map(|(k, v)| format!("{k}=\"{}\"", v.replace('\\', "\\\\").replace('"', "\\\"")))
        .collect();
    if let Some(le) = le {
        parts.push(format!("le=\"{le}\""));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!("{{{}}}", parts.join(","))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_text_format() {
        let m = Metrics::default();
        m.inc(
            "capstan_handler_invocations_total",
            &[("handler", "create_fn"), ("outcome", "success")],
        );
        m.inc(
            "capstan_handler_invocations_total",
            &[("handler", "create_fn"), ("outcome", "success")],
        );
        m.observe(
            "capstan_handler_duration_seconds",
            &[("handler", "create_fn")],
            Duration::from_millis(3),
        );
        m.gauge_fn("capstan_handler_processes", || 2.0);
        let text = m.render();
        assert!(
            text.contains("capstan_handler_invocations_total{handler=\"create_fn\",outcome=\"success\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("capstan_handler_duration_seconds_bucket{handler=\"create_fn\",le=\"0.005\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("capstan_handler_duration_seconds_bucket{handler=\"create_fn\",le=\"0.0025\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("capstan_handler_duration_seconds_count{handler=\"create_fn\"} 1"),
            "{text}"
        );
        assert!(text.contains("capstan_handler_processes 2"), "{text}");
        assert!(text.contains("# TYPE capstan_handler_duration_seconds histogram"));
    }
}
