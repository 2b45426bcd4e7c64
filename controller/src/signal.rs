//! Turns SIGTERM and SIGINT into the cancellation of the root token, which starts a graceful
//! shutdown. A second signal while shutting down exits at once (code 130), without releasing
//! the leader Lease: cycles may still be writing, and a standby must not run beside them; it
//! takes over when the lease expires.

use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

/// Cancels `shutdown` on the first SIGTERM/SIGINT; exits the process on the second.
///
/// # Errors
/// When the signal handlers cannot be installed.
pub fn install(shutdown: CancellationToken) -> std::io::Result<()> {
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => info!(signal = "SIGTERM", "shutting down"),
            _ = int.recv() => info!(signal = "SIGINT", "shutting down"),
        }
        shutdown.cancel();
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        warn!("second signal received; exiting immediately");
        std::process::exit(130);
    });
    Ok(())
}
