//! The observability listener: `/metrics`, `/liveness`, `/readiness`.

use super::metrics::Metrics;
use super::stopping::{Phase, Stop};
use tokio::sync::watch;

/// What readiness depends on, and the metrics.
#[derive(Clone)]
pub struct Health {
    /// The metrics to expose.
    pub metrics: Metrics,
    /// The registry store answers.
    pub store_ready: watch::Receiver<bool>,
    /// kas is shutting down.
    pub stop: Stop,
}

impl Health {
    /// `Ok` when ready for calls; otherwise why not.
    pub fn readiness(&self) -> Result<(), &'static str> {
        if self.stop.reached(Phase::Closing) {
            Err("shutting down")
        } else if !*self.store_ready.borrow() {
            Err("registry store unreachable")
        } else {
            Ok(())
        }
    }

    /// The metrics in the OpenMetrics text format.
    pub fn metrics_text(&self) -> String {
        self.metrics.encode()
    }
}

/// The value of an unlabelled metric (a gauge) in OpenMetrics text.
pub fn gauge(metrics: &str, name: &str) -> Option<f64> {
    metrics.lines().find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse().ok())?
    })
}

/// Serves `/metrics`, `/liveness` and `/readiness` on `listener` until `signal` resolves;
/// a connection silent for `listen.handshake_timeout` while a request is awaited is closed.
#[cfg(not(madsim))]
pub async fn serve(
    listener: tokio::net::TcpListener,
    listen: crate::config::Listen,
    tls: Option<std::sync::Arc<rustls::ServerConfig>>,
    health: Health,
    signal: impl Future<Output = ()> + Send + 'static,
) {
    use axum::extract::State;
    use axum::http::{StatusCode, header};
    use axum::routing::get;
    let routes = axum::Router::new()
        .route(
            "/metrics",
            get(|State(h): State<Health>| async move {
                let kind = "application/openmetrics-text; version=1.0.0; charset=utf-8";
                ([(header::CONTENT_TYPE, kind)], h.metrics_text())
            }),
        )
        .route("/liveness", get(|| async { "ok\n" }))
        .route(
            "/readiness",
            get(|State(h): State<Health>| async move {
                match h.readiness() {
                    Ok(()) => (StatusCode::OK, "ready\n".to_string()),
                    Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
                }
            }),
        )
        .with_state(health.clone());
    let guard = super::listener::Guard::ReadIdle(listen.handshake_timeout);
    let acceptor = super::listener::Acceptor::new(listener, guard, "observability", health.metrics);
    super::listener::serve_http(acceptor, routes, tls, &listen, signal).await;
}

/// In the simulation there is no HTTP listener (axum needs real sockets); the simulation
/// reads [`Health`] through `Kas::health`.
#[cfg(madsim)]
pub async fn serve(
    listener: tokio::net::TcpListener,
    _listen: crate::config::Listen,
    _tls: Option<std::sync::Arc<rustls::ServerConfig>>,
    _health: Health,
    signal: impl Future<Output = ()> + Send + 'static,
) {
    drop(listener);
    signal.await;
}
