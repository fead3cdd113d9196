//! Process signals the binaries stop on.

/// Resolves on SIGTERM or Ctrl-C (SIGINT).
pub async fn terminate_or_interrupt() {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch SIGTERM; Ctrl-C only");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}
