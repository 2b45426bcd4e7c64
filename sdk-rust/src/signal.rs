//! The stop of a handler process: SIGTERM (what kubelet sends a container) or Ctrl-C.
//!
//! Every operator's `main` needs it for [`crate::Operator::run`]; the SDK has it once, so that
//! an operator does not stop on one signal and die on the other.

/// Resolves on SIGTERM or SIGINT (Ctrl-C); pass it to [`crate::Operator::run`]. When SIGTERM
/// cannot be listened for (no signal handling in the environment), only Ctrl-C stops it, and a
/// warning says so.
pub async fn shutdown_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM");
                std::future::pending::<()>().await;
            }
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        () = terminate => {}
    }
    tracing::info!("shutting down");
}
