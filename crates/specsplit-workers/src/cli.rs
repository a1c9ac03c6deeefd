//! The command line shared by `specsplit-draft` and `specsplit-target`.

use std::path::PathBuf;

use serde::Serialize;

use tokio::net::TcpListener;

use crate::config::{load_section, WorkerConfig};
use crate::endpoints::{serve_endpoints, EndpointState};
use crate::launch;
use crate::service::{serve_draft_with, serve_target_with};

/// Which worker a binary runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerKind {
    /// `specsplit-draft`.
    Draft,
    /// `specsplit-target`.
    Target,
}

/// Flags of a worker binary; each overrides the config file and environment when given.
#[derive(Debug, Clone, Default, clap::Args, Serialize)]
pub struct WorkerArgs {
    /// TOML configuration file (section [draft] or [target]).
    #[arg(long, value_name = "FILE")]
    #[serde(skip)]
    pub config: Option<PathBuf>,
    /// Address to serve gRPC on (port 0 picks a free port) [default: 127.0.0.1:50051 for the
    /// draft, 127.0.0.1:50052 for the target]. A non-loopback address needs TLS with client
    /// authentication (--tls-client-ca or an auth token), or --insecure.
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    /// Model: a directory, a .gguf file, an HF repo id, random:<preset>[:seed], or an alias
    /// (smollm2, qwen-coder-0.5b, qwen-coder-1.5b, llama); see docs/models.md.
    #[arg(long, value_name = "SPEC")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Dtype: f32, f16 or bf16 (default: f32 on CPU, bf16 on CUDA).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    /// Most sessions held at once (least recently used are evicted beyond).
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_sessions: Option<usize>,
    /// Seconds an idle session is kept.
    #[arg(long, value_name = "SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session_ttl_secs: Option<u64>,
    /// KV-cache capacity of one session, in tokens.
    #[arg(long, value_name = "TOKENS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_context: Option<usize>,
    /// Memory budget of all session caches, in MiB (RESOURCE_EXHAUSTED beyond).
    #[arg(long, value_name = "MIB")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub memory_budget_mb: Option<usize>,
    /// Milliseconds a request for a new session waits for room when every session is busy,
    /// before RESOURCE_EXHAUSTED (0: refuse at once) [default: 1000].
    #[arg(long, value_name = "MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub admission_wait_ms: Option<u64>,
    /// Most sessions whose work shares one model pass (target: verification rounds; draft:
    /// tree levels); 1 runs each request on its own [default: 64].
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_batch_sessions: Option<usize>,
    /// Most rows in one shared pass (target: new tokens and draft-tree nodes; draft: tree-level
    /// nodes; of all its sessions); a session with more runs alone [default: 2048].
    #[arg(long, value_name = "ROWS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_batch_rows: Option<usize>,
    /// Draft: greedy chains on CUDA grown from CUDA graphs, those of sessions queued together in
    /// one shared pass a level (true or false; false: level by level like other trees)
    /// [default: true].
    #[arg(long, value_name = "BOOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub static_draft_chains: Option<bool>,
    /// Most nodes of a draft tree.
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tree_nodes: Option<usize>,
    /// Most tokens on a root-to-leaf path of a draft tree (at most 99, the wire's limit).
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_tree_depth: Option<usize>,
    /// Most tokens one request may carry (prompt, or the whole sequence sent to the draft);
    /// at most max_context.
    #[arg(long, value_name = "TOKENS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_prompt_len: Option<usize>,
    /// Ended sessions whose KV cache and CUDA graphs are kept for the next sessions (0: none);
    /// they take memory beyond memory_budget_mb [default: 1].
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spare_sessions: Option<usize>,
    /// Milliseconds the server busy-polls its sockets after each answer (0: never)
    /// [default: 20 on CUDA, 0 on the CPU].
    #[arg(long, value_name = "MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spin_ms: Option<u64>,
    /// Time each verification pass on the device with CUDA events (target; a diagnostic).
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub device_timing: bool,
    /// Log format: text or json (filter with RUST_LOG).
    #[arg(long, value_name = "FORMAT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_format: Option<String>,
    /// PEM certificate chain to serve TLS with (with --tls-key) [default: plaintext].
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificates client certificates must chain to (mutual TLS: a client without
    /// one fails the handshake).
    #[arg(long, value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tls_client_ca: Option<PathBuf>,
    /// File holding the bearer token every call must carry (`authorization: Bearer <token>`);
    /// the token may also come from SPECSPLIT_<DRAFT|TARGET>__AUTH_TOKEN or the config file.
    #[arg(long, value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auth_token_file: Option<PathBuf>,
    /// Serve on a non-loopback address without TLS or without client authentication.
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub insecure: bool,
    /// Address of the HTTP /metrics (Prometheus), /health and /ready endpoints, e.g.
    /// 127.0.0.1:9090 [default: none].
    #[arg(long, value_name = "ADDR")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<String>,
    /// Seconds to go on serving after SIGTERM, health reporting NOT_SERVING, before stopping
    /// [default: 0].
    #[arg(long, value_name = "SECS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drain_secs: Option<u64>,
    /// Draft worker: model (the draft model), or ngram / suffix (model-free: no model loaded)
    /// [default: model].
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drafter: Option<crate::model_free::DrafterKind>,
    /// Draft worker with --drafter suffix: also match the worker's earlier sessions.
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub suffix_history: bool,
    /// Target: advise each session's next draft depth from the load (true or false)
    /// [default: true].
    #[arg(long, value_name = "BOOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load_gate: Option<bool>,
}

impl WorkerArgs {
    /// The effective configuration: defaults < file < SPECSPLIT_<KIND>__* env < flags.
    pub fn resolve(&self, kind: WorkerKind) -> Result<WorkerConfig, crate::config::ConfigError> {
        let (section, defaults) = match kind {
            WorkerKind::Draft => ("draft", WorkerConfig::draft_defaults()),
            WorkerKind::Target => ("target", WorkerConfig::target_defaults()),
        };
        load_section(section, &defaults, self.config.as_deref(), self)
    }
}

/// Installs the tracing subscriber: human-readable `text` or `json`, filtered by RUST_LOG
/// (default `info`), on stderr.
pub fn init_logging(format: &str) {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if format == "json" {
        b.json().try_init()
    } else {
        b.try_init()
    };
}

/// Resolves when SIGTERM or Ctrl-C arrives.
pub async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    tracing::info!("shutdown requested; finishing in-flight requests");
}

/// Why a worker binary stopped with an error; its causes stay attached as sources, for the
/// binary to print as a chain.
pub type WorkerMainError = Box<dyn std::error::Error + Send + Sync>;

/// The whole `main` of a worker binary.
pub async fn worker_main(kind: WorkerKind, args: WorkerArgs) -> Result<(), WorkerMainError> {
    let cfg = args.resolve(kind)?;
    cfg.validate()?;
    init_logging(&cfg.log_format);
    tracing::info!(?kind, config = ?cfg, "effective configuration");
    let state = EndpointState::default();
    let opts = launch::serve_options(&cfg, state.lifecycle.clone())?;
    // The HTTP endpoints answer while the model loads (/health live, /ready not yet).
    let endpoints = match &cfg.metrics_listen {
        None => None,
        Some(addr) => {
            let listener =
                TcpListener::bind(addr)
                    .await
                    .map_err(|source| launch::LaunchError::Bind {
                        addr: addr.clone(),
                        source,
                    })?;
            tracing::info!(http = %listener.local_addr()?, "serving /metrics, /health, /ready");
            // They answer until the worker has stopped (/ready 503 while it drains).
            let state = state.clone();
            Some(tokio::spawn(async move {
                if let Err(e) = serve_endpoints(listener, state, std::future::pending()).await {
                    tracing::error!("the HTTP endpoints stopped: {e}");
                }
            }))
        }
    };
    if kind == WorkerKind::Draft && cfg.drafter != crate::model_free::DrafterKind::Model {
        let worker = launch::model_free_draft_worker(&cfg)?;
        let (listener, addr) = launch::bind(&cfg).await?;
        tracing::info!(
            %addr,
            drafter = ?cfg.drafter,
            tls = cfg.tls_cert.is_some(),
            mutual_tls = cfg.tls_client_ca.is_some(),
            token = opts.token.is_some(),
            "serving (no model loaded)"
        );
        let r = serve_draft_with(worker, listener, shutdown_signal(), opts).await;
        if let Some(task) = endpoints {
            task.abort();
        }
        r?;
        tracing::info!("stopped");
        return Ok(());
    }
    tracing::info!(?kind, model = %cfg.model, device = %cfg.device, "loading model");
    let model = {
        let cfg = cfg.clone();
        tokio::task::spawn_blocking(move || launch::load(&cfg)).await??
    };
    let (listener, addr) = launch::bind(&cfg).await?;
    tracing::info!(
        %addr,
        model = %model.name,
        tls = cfg.tls_cert.is_some(),
        mutual_tls = cfg.tls_client_ca.is_some(),
        token = opts.token.is_some(),
        "serving"
    );
    let r = match kind {
        WorkerKind::Draft => {
            let worker = launch::draft_worker(&cfg, model);
            let _ = state.scrape.set(worker.scrape());
            serve_draft_with(worker, listener, shutdown_signal(), opts).await
        }
        WorkerKind::Target => {
            let worker = launch::target_worker(&cfg, model);
            let _ = state.scrape.set(worker.scrape());
            serve_target_with(worker, listener, shutdown_signal(), opts).await
        }
    };
    if let Some(task) = endpoints {
        task.abort();
    }
    r?;
    tracing::info!("stopped");
    Ok(())
}
