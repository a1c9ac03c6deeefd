//! A worker's HTTP endpoints, on an address of their own (`metrics_listen`): `/metrics`
//! (Prometheus), `/health` (the process is live) and `/ready` (the model is loaded and the
//! worker is serving, not draining).

use std::future::Future;
use std::sync::{Arc, OnceLock};

use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use tokio::net::TcpListener;

use crate::metrics::CONTENT_TYPE;
use crate::service::{Lifecycle, Scrape};

/// What the endpoints report: the worker's lifecycle, and its metrics once its model is
/// loaded.
#[derive(Clone, Default)]
pub struct EndpointState {
    /// The worker's lifecycle.
    pub lifecycle: Arc<Lifecycle>,
    /// The worker's metrics, set once the worker exists.
    pub scrape: Arc<OnceLock<Scrape>>,
}

/// The endpoints' routes.
pub fn router(state: EndpointState) -> axum::Router {
    axum::Router::new()
        .route("/health", get(|| async { "live\n" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .with_state(state)
}

async fn ready(axum::extract::State(s): axum::extract::State<EndpointState>) -> impl IntoResponse {
    if s.lifecycle.is_serving() {
        (StatusCode::OK, "ready\n")
    } else if s.lifecycle.is_draining() {
        (StatusCode::SERVICE_UNAVAILABLE, "draining\n")
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "loading\n")
    }
}

async fn metrics(
    axum::extract::State(s): axum::extract::State<EndpointState>,
) -> impl IntoResponse {
    // Before the model is loaded there is nothing to report yet.
    let text = s
        .scrape
        .get()
        .map_or_else(|| "# EOF\n".to_string(), |f| f());
    ([(header::CONTENT_TYPE, CONTENT_TYPE)], text)
}

/// Serves the endpoints on `listener` until `shutdown` resolves.
pub async fn serve_endpoints(
    listener: TcpListener,
    state: EndpointState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(state))
        .with_graceful_shutdown(shutdown)
        .await
}
