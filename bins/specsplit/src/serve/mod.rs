//! `specsplit serve`: an OpenAI-compatible HTTP API over one long-running orchestrator, its
//! tokenizer and channels made once and shared by every request.

mod generation;
mod handlers;
mod openai;

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use serde::Serialize;
use specsplit_workers::cli::{init_logging, shutdown_signal};

use crate::settings::OrchestratorArgs;
use crate::{notice, workers};
use generation::Server;

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
    let served = axum::serve(listener, router(server, s.http_max_body_bytes))
        .with_graceful_shutdown(shutdown_signal())
        .await;
    if let Some(ip) = c.in_process {
        ip.shutdown().await;
    }
    served.context("serving HTTP")
}

/// The routes, every request body bounded by `max_body_bytes`.
fn router(server: Arc<Server>, max_body_bytes: usize) -> Router {
    Router::new()
        .route("/v1/models", get(handlers::models))
        .route("/v1/completions", post(handlers::completions))
        .route("/v1/chat/completions", post(handlers::chat_completions))
        .fallback(handlers::not_found)
        .method_not_allowed_fallback(handlers::method_not_allowed)
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(server)
}
