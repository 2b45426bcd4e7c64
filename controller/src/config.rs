//! The controller's settings, grouped by subsystem, with defaults that match kopf where kopf
//! has one.
//!
//! The CLI maps flags and environment variables onto these structs without logic of its own;
//! tests build them directly.

use std::{net::SocketAddr, time::Duration};

use crate::{
    engine,
    grpc::{self, Listen},
    peering,
};

/// Everything `capstan run` needs.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Where the gRPC server listens. Default `unix:///run/capstan/capstan.sock`.
    pub listen: Listen,
    /// Where the admin HTTP endpoint listens. Default `0.0.0.0:8080`.
    pub admin_listen: SocketAddr,
    /// Connection cap and deadlines of the admin endpoint.
    pub admin: crate::observability::admin::Settings,
    /// Per-connection protocol settings (pings, caps, sizes).
    pub connection: grpc::connection::Settings,
    /// Dispatch settings (cancel grace, poison-pill guard).
    pub hub: grpc::hub::Settings,
    /// How long in-flight invocations may take to finish at shutdown. Default 20 s.
    pub shutdown_grace: Duration,
    /// How long discovery results are reused before the API is asked again. Default 30 s.
    pub discovery_ttl: Duration,
    /// How long one API request may take (watches: until their answer starts). Default 30 s.
    pub api_timeout: Duration,
    /// At most this many API requests other than watches in flight. Default 32.
    pub api_requests: usize,
    /// Watching, queueing, persistence.
    pub engine: engine::Settings,
    /// Priority peering (freezing).
    pub peering: peering::Settings,
    /// Leader election among replicas.
    pub election: peering::election::Settings,
    /// Node-local storage of per-node state (per-node mode only).
    pub node_store: Option<crate::persistence::node_store::Spec>,
    /// Admission webhooks.
    pub webhooks: crate::webhooks::Settings,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            listen: Listen::Unix("/run/capstan/capstan.sock".into()),
            admin_listen: SocketAddr::from(([0, 0, 0, 0], 8080)),
            admin: crate::observability::admin::Settings::default(),
            connection: grpc::connection::Settings::default(),
            hub: grpc::hub::Settings::default(),
            shutdown_grace: Duration::from_secs(20),
            discovery_ttl: Duration::from_secs(30),
            api_timeout: crate::k8s::switch::DEFAULT_REQUEST_TIMEOUT,
            api_requests: crate::k8s::switch::DEFAULT_REQUESTS_IN_FLIGHT,
            engine: engine::Settings::default(),
            peering: peering::Settings::default(),
            election: peering::election::Settings::default(),
            node_store: None,
            webhooks: crate::webhooks::Settings::default(),
        }
    }
}

/// Parses a duration: `500ms`, `10s`, `2m`, `1h`, or a bare number of seconds (`1.5`).
///
/// # Errors
/// A message naming the accepted forms.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (number, unit) = match s.find(|c: char| c.is_ascii_alphabetic()) {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, "s"),
    };
    let value: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (e.g. 500ms, 10s, 2m, 1h)"))?;
    let seconds = match unit {
        "ms" => value / 1000.0,
        "s" => value,
        "m" => value * 60.0,
        "h" => value * 3600.0,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (use ms, s, m or h)")),
    };
    Duration::try_from_secs_f64(seconds).map_err(|_| format!("{s:?} is negative or too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("-1s").is_err());
        assert!(parse_duration("3 days").is_err());
    }
}
