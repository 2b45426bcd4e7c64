//! The controller's settings, grouped by subsystem, with defaults that match kopf where kopf
//! has one.
//!
//! The CLI maps flags and environment variables onto these structs without logic of its own;
//! tests build them directly.

use std::{
    net::{Ipv4Addr, Ipv6Addr, SocketAddr},
    time::Duration,
};

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
    /// Sharding the objects among replicas.
    pub sharding: crate::sharding::Settings,
    /// Node-local storage of per-node state (per-node mode only).
    pub node_store: Option<crate::persistence::node_store::Spec>,
    /// The handler container's own identity, kept fresh by the controller.
    pub handler_identity: Option<crate::k8s::handler_identity::Spec>,
    /// Admission webhooks.
    pub webhooks: crate::webhooks::Settings,
    /// The flags the controller was started with, to apply the operator-wide settings handler
    /// processes send as if given as flags; `None`: they are not applied (settings built
    /// directly, as in tests).
    pub operator: Option<OperatorFlags>,
}

/// The flags of `capstan run`, and which operator-wide settings' flags were given.
#[derive(Clone, Debug)]
pub struct OperatorFlags {
    args: std::sync::Arc<crate::cli::RunArgs>,
    given: Vec<crate::model::operator_settings::Field>,
}

impl OperatorFlags {
    /// `args` as parsed; `given` the fields whose flags were given.
    pub fn new(args: crate::cli::RunArgs, given: Vec<crate::model::operator_settings::Field>) -> Self {
        Self {
            args: std::sync::Arc::new(args),
            given,
        }
    }

    /// The engine's settings with `wanted` applied where the flags were not given.
    ///
    /// # Errors
    /// When the combination cannot work; the flags' own settings apply then.
    pub fn engine(
        &self,
        wanted: &crate::model::operator_settings::OperatorSettings,
    ) -> Result<engine::Settings, String> {
        Ok(self
            .args
            .with_operator_settings(wanted, &self.given)?
            .settings()
            .engine)
    }

    /// The API requests' timeout and the managed webhook configurations' name with `wanted`
    /// applied where the flags were not given.
    pub fn client(
        &self,
        wanted: &crate::model::operator_settings::OperatorSettings,
    ) -> (Duration, Option<String>) {
        self.args.client_with(wanted, &self.given)
    }

    /// The operator's peering with `wanted` applied where the flags were not given.
    pub fn peering(&self, wanted: &crate::model::operator_settings::OperatorSettings) -> peering::Settings {
        self.args.peering_with(wanted, &self.given)
    }
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
            sharding: crate::sharding::Settings::default(),
            node_store: None,
            handler_identity: None,
            webhooks: crate::webhooks::Settings::default(),
            operator: None,
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

/// The address to listen on for `addr`: `[::]` (both address families, a dual-stack socket
/// accepts IPv4 too) where the host has IPv6, `0.0.0.0` where it has none (a kernel without
/// IPv6, where `[::]` cannot be bound), so that one setting — the chart's — serves IPv4-only,
/// IPv6-only and dual-stack clusters. Other addresses are kept as they are.
pub fn bindable(addr: SocketAddr) -> SocketAddr {
    if addr.ip() != Ipv6Addr::UNSPECIFIED {
        return addr;
    }
    let unsupported = [
        rustix::io::Errno::AFNOSUPPORT.raw_os_error(),
        rustix::io::Errno::ADDRNOTAVAIL.raw_os_error(),
    ];
    match std::net::TcpListener::bind((Ipv6Addr::UNSPECIFIED, 0)) {
        Err(e) if e.raw_os_error().is_some_and(|code| unsupported.contains(&code)) => {
            tracing::warn!(%addr, "the host has no IPv6; listening on IPv4 only");
            SocketAddr::from((Ipv4Addr::UNSPECIFIED, addr.port()))
        }
        _ => addr,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_address_families_are_kept_where_the_host_has_them() {
        let any: SocketAddr = "[::]:8080".parse().unwrap();
        let has_ipv6 = std::net::TcpListener::bind((Ipv6Addr::UNSPECIFIED, 0)).is_ok();
        assert_eq!(bindable(any) == any, has_ipv6);
        for kept in ["127.0.0.1:8080", "0.0.0.0:9443", "[::1]:8080"] {
            let addr: SocketAddr = kept.parse().unwrap();
            assert_eq!(bindable(addr), addr);
        }
    }

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
