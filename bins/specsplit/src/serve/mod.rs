//! `specsplit serve`: an OpenAI-compatible HTTP API over one long-running orchestrator, its
//! tokenizer and channels made once and shared by every request, with an API key,
//! Prometheus `/metrics`, `/health` and `/ready`.

mod auth;
mod generation;
mod handlers;
mod metrics;
mod openai;
mod probes;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::header;
use axum::middleware::{from_fn_with_state, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Serialize;
use specsplit_workers::cli::{init_logging, shutdown_signal};

use crate::settings::{OrchestratorArgs, Settings};
use crate::{notice, workers};
use auth::ApiKey;
use generation::Server;
use metrics::ServerMetrics;
use probes::Readiness;

/// Flags of `serve`.
#[derive(clap::Args)]
pub struct ServeArgs {
    #[command(flatten)]
    orchestrator: OrchestratorArgs,
    #[command(flatten)]
    http: HttpArgs,
}

/// The HTTP server's flags; each overrides the config file and environment when given.
#[derive(clap::Args, Serialize)]
struct HttpArgs {
    /// Address the HTTP server listens on (port 0: any free port).
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    http_listen: Option<String>,
    /// Largest request body accepted, in bytes (larger ones get 413).
    #[arg(long, value_name = "BYTES")]
    #[serde(skip_serializing_if = "Option::is_none")]
    http_max_body_bytes: Option<usize>,
    /// Generations run at once; further requests wait for one to end.
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_concurrent: Option<usize>,
    /// File holding the API key every /v1/* request must present as `Authorization: Bearer
    /// <key>`; the key may also come from SPECSPLIT_ORCHESTRATOR__API_KEY or the config file.
    #[arg(long, value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    api_key_file: Option<PathBuf>,
    /// Serve on a non-loopback --http-listen address without an API key.
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    insecure: bool,
}

/// Runs the server until Ctrl-C or SIGTERM.
pub async fn serve(mut args: ServeArgs) -> Result<()> {
    let s = args.orchestrator.settings(&args.http)?;
    init_logging(&s.log_format);
    if s.max_concurrent == 0 || s.http_max_body_bytes == 0 {
        bail!("max_concurrent and http_max_body_bytes must be at least 1");
    }
    tracing::info!(settings = ?s, "configuration");
    let listener = tokio::net::TcpListener::bind(&s.http_listen)
        .await
        .with_context(|| format!("listening on {}", s.http_listen))?;
    let addr = listener.local_addr()?;
    let api_key = api_key(&s)?;
    if api_key.is_none() && !addr.ip().is_loopback() && !s.insecure {
        bail!(
            "HTTP address {addr} is not loopback and the server has no API key: set \
             api_key_file (--api-key-file) or api_key (SPECSPLIT_ORCHESTRATOR__API_KEY), or pass \
             --insecure to serve without one (see docs/configuration.md)"
        );
    }
    let c = workers::connect(&s).await?;
    let model = if c.orch.target_model().is_empty() {
        s.target_model.clone()
    } else {
        c.orch.target_model().to_string()
    };
    let server = Arc::new(Server::new(
        c.orch,
        c.tokenizer,
        s.generate_config(),
        model.clone(),
        s.max_concurrent,
        s.http_max_body_bytes,
    ));
    notice(
        &s.log_format,
        &format!("serving '{model}' on http://{addr}"),
        serde_json::json!({"event": "listening", "addr": format!("http://{addr}"), "model": model}),
    );
    let readiness = Arc::new(Readiness::new(server.orch.clone()));
    let app = router(server, readiness, api_key, s.http_max_body_bytes);
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await;
    if let Some(ip) = c.in_process {
        ip.shutdown().await;
    }
    served.context("serving HTTP")
}

/// The API key the settings give, if any.
fn api_key(s: &Settings) -> Result<Option<Arc<ApiKey>>> {
    let key = match (&s.api_key, &s.api_key_file) {
        (Some(_), Some(_)) => bail!("api_key and api_key_file are both set; set one"),
        (Some(k), None) => Some(ApiKey::new(k.expose())?),
        (None, Some(f)) => Some(ApiKey::from_file(f)?),
        (None, None) => None,
    };
    Ok(key.map(Arc::new))
}

/// The routes, every request counted in the metrics, every `/v1/*` request checked for
/// `api_key` where there is one, every request body bounded by `max_body_bytes`.
fn router(
    server: Arc<Server>,
    readiness: Arc<Readiness>,
    api_key: Option<Arc<ApiKey>>,
    max_body_bytes: usize,
) -> Router {
    let metrics = server.metrics.clone();
    let mut app = Router::new()
        .route("/v1/models", get(handlers::models))
        .route("/v1/completions", post(handlers::completions))
        .route("/v1/chat/completions", post(handlers::chat_completions))
        .route("/metrics", get(render_metrics))
        .route("/health", get(probes::health))
        .route("/ready", get(probes::ready).with_state(readiness))
        .fallback(handlers::not_found)
        .method_not_allowed_fallback(handlers::method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(server);
    if let Some(key) = api_key {
        app = app.layer(from_fn_with_state(key, auth::require_key));
    }
    app.layer(from_fn_with_state(metrics, count_request))
}

/// `GET /metrics`: the server's metrics as OpenMetrics text.
async fn render_metrics(State(server): State<Arc<Server>>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, metrics::CONTENT_TYPE)],
        server.metrics.render(),
    )
}

/// Middleware: counts each answer by endpoint (the paths served; `other` for any other) and
/// status.
async fn count_request(
    State(metrics): State<Arc<ServerMetrics>>,
    req: Request,
    next: Next,
) -> Response {
    let endpoint = match req.uri().path() {
        "/v1/models" => "/v1/models",
        "/v1/completions" => "/v1/completions",
        "/v1/chat/completions" => "/v1/chat/completions",
        "/metrics" => "/metrics",
        "/health" => "/health",
        "/ready" => "/ready",
        _ => "other",
    };
    let response = next.run(req).await;
    metrics.observe_http(endpoint, response.status().as_u16());
    response
}
