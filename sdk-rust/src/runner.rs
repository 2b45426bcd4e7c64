//! [`Operator`]: the entry point that connects a [`Registry`] to the controller and serves it.
//!
//! `Operator::run` dials the controller (Unix socket by default, loopback TCP for development),
//! hands each stream to the connection module, and reconnects with jittered exponential backoff
//! (capped at 30 s) whenever the stream is lost, registering the same handlers again. It stops
//! when the application's shutdown future resolves — the SDK installs no signal handlers — or,
//! with an error, when the controller accepted none of the handlers: retrying cannot fix that.

use std::{
    collections::hash_map::RandomState,
    future::Future,
    hash::{BuildHasher, Hasher},
    sync::Arc,
    time::Duration,
};

use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::{
    Registry,
    connection::{self, Dialer, Ended},
    error::Result,
    pb,
    registry::Table,
};

/// The controller's default endpoint inside a Capstan pod.
pub const DEFAULT_ENDPOINT: &str = "unix:///run/capstan/capstan.sock";

/// The first reconnect delay; it doubles up to [`MAX_BACKOFF`].
const MIN_BACKOFF: Duration = Duration::from_millis(250);
/// The longest reconnect delay.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Serves a [`Registry`] to the Capstan controller.
///
/// ```no_run
/// # async fn example(registry: capstan_sdk::Registry) -> Result<(), capstan_sdk::Error> {
/// capstan_sdk::Operator::new(registry)
///     .endpoint("http://127.0.0.1:7070")
///     .run(capstan_sdk::shutdown_signal())
///     .await
/// # }
/// ```
#[derive(Debug)]
pub struct Operator {
    registry: Registry,
    endpoint: String,
    max_in_flight: u32,
    shutdown_grace: Duration,
}

impl Operator {
    /// An operator serving `registry` at [`DEFAULT_ENDPOINT`].
    pub fn new(registry: Registry) -> Self {
        Self {
            registry,
            endpoint: DEFAULT_ENDPOINT.to_owned(),
            max_in_flight: 0,
            shutdown_grace: Duration::from_secs(30),
        }
    }

    /// Where the controller listens: `unix:///path` or `http://host:port`.
    /// Default: [`DEFAULT_ENDPOINT`].
    #[must_use]
    pub fn endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.endpoint = endpoint.into();
        self
    }

    /// At most this many invocations in flight in this process; 0 (the default) leaves it to
    /// the controller.
    #[must_use]
    pub fn max_in_flight(mut self, limit: u32) -> Self {
        self.max_in_flight = limit;
        self
    }

    /// How long running invocations may take to finish after shutdown is requested before
    /// they are cancelled. Default: 30 s.
    #[must_use]
    pub fn shutdown_grace(mut self, grace: Duration) -> Self {
        self.shutdown_grace = grace;
        self
    }

    /// Connects and serves until `shutdown` resolves, reconnecting on any stream loss.
    ///
    /// # Errors
    ///
    /// [`crate::Error::Register`] for an inconsistent registry, [`crate::Error::InvalidEndpoint`]
    /// for an unusable endpoint, and [`crate::Error::Rejected`] when the controller accepted
    /// none of the handlers.
    pub async fn run(self, shutdown: impl Future<Output = ()> + Send) -> Result<()> {
        let table = Arc::new(self.registry.into_table()?);
        let dialer = Dialer::parse(&self.endpoint)?;
        let hello = pb::Hello {
            capabilities: vec![
                pb::Capability::SdkFilters as i32,
                pb::Capability::Subhandlers as i32,
                pb::Capability::InvocationUpdates as i32,
                pb::Capability::ObjectUpdates as i32,
                pb::Capability::ObjectGone as i32,
                pb::Capability::CleanupOnGoodbye as i32,
            ],
            sdk: Some(pb::SoftwareInfo {
                name: env!("CARGO_PKG_NAME").to_owned(),
                version: env!("CARGO_PKG_VERSION").to_owned(),
                language: "rust".to_owned(),
            }),
            instance_id: format!("{:016x}{:016x}", random(), random()),
            handlers: table.registrations().to_vec(),
            max_in_flight: self.max_in_flight,
        };
        let stop = CancellationToken::new();
        let span =
            tracing::info_span!("connection", instance.id = %hello.instance_id, endpoint = %self.endpoint);
        let serve = serve(&dialer, table, hello, &stop, self.shutdown_grace).instrument(span);
        tokio::pin!(serve);
        tokio::pin!(shutdown);
        tokio::select! {
            result = &mut serve => return result,
            () = &mut shutdown => stop.cancel(),
        }
        serve.await
    }
}

async fn serve(
    dialer: &Dialer,
    table: Arc<Table>,
    hello: pb::Hello,
    stop: &CancellationToken,
    grace: Duration,
) -> Result<()> {
    let mut failures = 0_u32;
    loop {
        if stop.is_cancelled() {
            return Ok(());
        }
        let delay = match dialer.connect().await {
            Ok(channel) => {
                tracing::info!("dialled the controller");
                match connection::run(channel, table.clone(), hello.clone(), stop, grace).await? {
                    Ended::Shutdown => return Ok(()),
                    Ended::Lost { reason, welcomed } => {
                        failures = if welcomed { 0 } else { failures.saturating_add(1) };
                        tracing::warn!(%reason, "lost the stream to the controller; reconnecting");
                        backoff(failures)
                    }
                }
            }
            Err(error) => {
                failures = failures.saturating_add(1);
                let delay = backoff(failures);
                tracing::warn!(error = %error, retry_in = ?delay, "cannot reach the controller");
                delay
            }
        };
        tokio::select! {
            () = tokio::time::sleep(delay) => {}
            () = stop.cancelled() => return Ok(()),
        }
    }
}

/// The delay before reconnect attempt number `failures`: exponential from [`MIN_BACKOFF`],
/// capped at [`MAX_BACKOFF`], with the upper half jittered so that many processes restarted
/// together do not reconnect in lockstep.
fn backoff(failures: u32) -> Duration {
    let exponent = failures.saturating_sub(1).min(16);
    let ceiling = MIN_BACKOFF.saturating_mul(1 << exponent).min(MAX_BACKOFF);
    let jitter = ceiling.mul_f64(0.5 * (random() as f64 / u64::MAX as f64));
    ceiling / 2 + jitter
}

/// A random number from the standard library's per-instance hasher keys.
fn random() -> u64 {
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos(),
    );
    hasher.finish()
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn backoff_grows_jittered_and_capped() {
        for failures in 0..40 {
            let delay = backoff(failures);
            assert!(delay <= MAX_BACKOFF, "{delay:?}");
            assert!(delay >= MIN_BACKOFF / 2);
        }
        assert!(backoff(30) >= MAX_BACKOFF / 2);
        assert_ne!(random(), random());
    }
}
