//! The observability listener: `/metrics`, `/liveness`, `/readiness`.

use super::metrics::Metrics;
use axum::Router;
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::sync::watch;

/// What readiness depends on.
#[derive(Clone)]
pub struct Health {
    /// The metrics to expose.
    pub metrics: Metrics,
    /// The registry store answers.
    pub store_ready: watch::Receiver<bool>,
    /// kas is shutting down.
    pub closing: watch::Receiver<bool>,
}

/// The HTTP routes.
pub fn routes(health: Health) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/liveness", get(|| async { "ok\n" }))
        .route("/readiness", get(readiness))
        .with_state(health)
}

async fn metrics(State(h): State<Health>) -> impl IntoResponse {
    (
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        h.metrics.encode(),
    )
}

async fn readiness(State(h): State<Health>) -> (StatusCode, &'static str) {
    if *h.closing.borrow() {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n")
    } else if !*h.store_ready.borrow() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "registry store unreachable\n",
        )
    } else {
        (StatusCode::OK, "ready\n")
    }
}
