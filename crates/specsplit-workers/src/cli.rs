//! The command line shared by `specsplit-draft` and `specsplit-target`.

use std::path::PathBuf;

use serde::Serialize;

use crate::config::{load_section, WorkerConfig};
use crate::launch;

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
    /// Address to serve gRPC on, e.g. 0.0.0.0:50052 (port 0 picks a free port).
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
    /// Draft worker: model (the draft model), or ngram / suffix (model-free: no model loaded)
    /// [default: model].
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drafter: Option<crate::model_free::DrafterKind>,
    /// Draft worker with --drafter suffix: also match the worker's earlier sessions.
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub suffix_history: bool,
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
    if kind == WorkerKind::Draft && cfg.drafter != crate::model_free::DrafterKind::Model {
        let worker = launch::model_free_draft_worker(&cfg)?;
        let (listener, addr) = launch::bind(&cfg).await?;
        tracing::info!(%addr, drafter = ?cfg.drafter, "serving (no model loaded)");
        crate::service::serve_model_free_draft(worker, listener, shutdown_signal()).await?;
        tracing::info!("stopped");
        return Ok(());
    }
    tracing::info!(?kind, model = %cfg.model, device = %cfg.device, "loading model");
    let model = {
        let cfg = cfg.clone();
        tokio::task::spawn_blocking(move || launch::load(&cfg)).await??
    };
    let (listener, addr) = launch::bind(&cfg).await?;
    tracing::info!(%addr, model = %model.name, "serving");
    let r = match kind {
        WorkerKind::Draft => launch::run_draft(&cfg, model, listener, shutdown_signal()).await,
        WorkerKind::Target => launch::run_target(&cfg, model, listener, shutdown_signal()).await,
    };
    r?;
    tracing::info!("stopped");
    Ok(())
}
