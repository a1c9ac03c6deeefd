//! Starting a worker from its configuration: load the model, bind, serve until shutdown.
//! Shared by the worker binaries and the CLI's in-process mode.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use candle_core::{DType, Device};
use specsplit_models::loader::{load_model, LoadOptions, LoadedModel};
use tokio::net::TcpListener;

use crate::batcher::BatchLimits;
use crate::config::WorkerConfig;
use crate::draft::DraftEngine;
use crate::load_gate::{LoadAdvisor, LoadGate};
use crate::model_free::ModelFreeEngine;
use crate::service::{
    serve_draft, serve_target, DraftWorker, Execution, Lifecycle, ModelFreeDraftWorker,
    ServeOptions, TargetWorker, WorkerInfo,
};
use crate::session::SessionLimits;
use crate::target::TargetEngine;

/// Errors starting a worker.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// A setting is unusable.
    #[error("{0}")]
    Config(String),
    /// The model failed to load.
    #[error("loading model '{spec}'")]
    Model {
        /// The `--model` value.
        spec: String,
        /// What failed.
        source: Box<specsplit_models::ModelError>,
    },
    /// A TLS or token file is unusable.
    #[error("{what} {path}")]
    Security {
        /// Which setting names the file.
        what: &'static str,
        /// The file.
        path: String,
        /// What failed.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}")]
    Bind {
        /// The address.
        addr: String,
        /// What failed.
        source: std::io::Error,
    },
}

/// Parses `cpu`, `cuda` or `cuda:N`. A CUDA device's memory pool is set to keep freed memory
/// ([`specsplit_core::device::retain_pool_memory`]; a failure there is only logged).
pub fn parse_device(s: &str) -> Result<Device, LaunchError> {
    let bad = |e: candle_core::Error| LaunchError::Config(format!("device '{s}': {e}"));
    let device = match s {
        "cpu" => Device::Cpu,
        "cuda" => Device::new_cuda(0).map_err(bad)?,
        _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => Device::new_cuda(n).map_err(bad)?,
            _ => {
                return Err(LaunchError::Config(format!(
                    "unknown device '{s}': use cpu, cuda or cuda:N"
                )))
            }
        },
    };
    if let Err(e) = specsplit_core::device::retain_pool_memory(&device) {
        tracing::warn!("{s}: {e}; freed GPU memory goes back to the driver at each sync");
    }
    Ok(device)
}

/// Parses `f32`, `f16`, `bf16`, or "" for the device default.
pub fn parse_dtype(s: &str) -> Result<Option<DType>, LaunchError> {
    match s {
        "" => Ok(None),
        "f32" => Ok(Some(DType::F32)),
        "f16" => Ok(Some(DType::F16)),
        "bf16" => Ok(Some(DType::BF16)),
        _ => Err(LaunchError::Config(format!(
            "unknown dtype '{s}': use f32, f16 or bf16"
        ))),
    }
}

/// Loads the model a worker configuration names.
pub fn load(cfg: &WorkerConfig) -> Result<LoadedModel, LaunchError> {
    let opts = LoadOptions {
        device: parse_device(&cfg.device)?,
        dtype: parse_dtype(&cfg.dtype)?,
    };
    load_model(&cfg.model, &opts).map_err(|source| LaunchError::Model {
        spec: cfg.model.clone(),
        source: Box::new(source),
    })
}

fn limits(cfg: &WorkerConfig) -> SessionLimits {
    SessionLimits {
        max_sessions: cfg.max_sessions.max(1),
        memory_budget_bytes: cfg.memory_budget_mb.saturating_mul(1 << 20),
        ttl: Duration::from_secs(cfg.session_ttl_secs.max(1)),
    }
}

fn info(cfg: &WorkerConfig, m: &LoadedModel) -> WorkerInfo {
    let dev = match m.model.device() {
        Device::Cpu => "cpu".to_string(),
        Device::Cuda(_) if cfg.device == "cuda" => "cuda:0".to_string(),
        Device::Cuda(_) => cfg.device.clone(),
        d => format!("{d:?}"),
    };
    WorkerInfo {
        model_name: m.name.clone(),
        vocab_size: m.model.config().vocab_size,
        eos_token_ids: m.tokenizer.eos_token_ids().to_vec(),
        max_context: cfg.max_context,
        max_tree_nodes: cfg.max_tree_nodes,
        max_tree_depth: cfg.max_tree_depth,
        // A request cannot carry more tokens than a session holds.
        max_prompt_len: cfg.prompt_limit().min(cfg.max_context),
        device: dev,
    }
}

/// Reads a file a security setting names.
fn read_pem(what: &'static str, path: &std::path::Path) -> Result<Vec<u8>, LaunchError> {
    std::fs::read(path).map_err(|e| LaunchError::Security {
        what,
        path: path.display().to_string(),
        source: Box::new(e),
    })
}

/// How a worker configured by `cfg` serves: TLS (mutual with `tls_client_ca`) and the bearer
/// token as configured, its health following `lifecycle`, draining for `drain_secs`.
pub fn serve_options(
    cfg: &WorkerConfig,
    lifecycle: Arc<Lifecycle>,
) -> Result<ServeOptions, LaunchError> {
    use specsplit_proto::auth::AuthToken;
    use tonic::transport::{Certificate, Identity, ServerTlsConfig};
    let tls = match (&cfg.tls_cert, &cfg.tls_key) {
        (Some(cert), Some(key)) => {
            let identity = Identity::from_pem(
                read_pem("tls_cert: cannot read", cert)?,
                read_pem("tls_key: cannot read", key)?,
            );
            let mut tls = ServerTlsConfig::new().identity(identity);
            if let Some(ca) = &cfg.tls_client_ca {
                let ca = read_pem("tls_client_ca: cannot read", ca)?;
                tls = tls.client_ca_root(Certificate::from_pem(ca));
            }
            Some(tls)
        }
        _ => None,
    };
    let token = match (&cfg.auth_token, &cfg.auth_token_file) {
        (Some(t), _) => Some(
            AuthToken::new(t.expose()).map_err(|e| LaunchError::Security {
                what: "auth_token:",
                path: "(from the config file or environment)".into(),
                source: Box::new(e),
            })?,
        ),
        (None, Some(path)) => {
            Some(
                AuthToken::from_file(path).map_err(|e| LaunchError::Security {
                    what: "auth_token_file",
                    path: path.display().to_string(),
                    source: Box::new(e),
                })?,
            )
        }
        (None, None) => None,
    };
    Ok(ServeOptions {
        tls,
        token,
        lifecycle,
        drain: Duration::from_secs(cfg.drain_secs),
    })
}

/// Binds `cfg.listen`, returning the listener and its actual address (port 0 picks one).
pub async fn bind(cfg: &WorkerConfig) -> Result<(TcpListener, SocketAddr), LaunchError> {
    let l = TcpListener::bind(&cfg.listen)
        .await
        .map_err(|source| LaunchError::Bind {
            addr: cfg.listen.clone(),
            source,
        })?;
    let addr = l.local_addr().map_err(|source| LaunchError::Bind {
        addr: cfg.listen.clone(),
        source,
    })?;
    Ok((l, addr))
}

/// How a worker configured by `cfg` runs its model work on the device `info` names.
fn execution(cfg: &WorkerConfig, info: &WorkerInfo) -> Execution {
    Execution::for_device(&info.device, cfg.spin_ms.map(Duration::from_millis))
}

/// A draft worker service over a loaded model.
pub fn draft_worker(cfg: &WorkerConfig, m: LoadedModel) -> DraftWorker {
    let info = info(cfg, &m);
    let exec = execution(cfg, &info);
    let eos = m.tokenizer.eos_token_ids().to_vec();
    let mut engine = DraftEngine::new(Arc::new(m.model), eos, cfg.max_context)
        .with_spare_sessions(cfg.spare_sessions);
    if !cfg.static_draft_chains {
        engine = engine.with_static_chains(false);
    }
    let worker = DraftWorker::new(Arc::new(engine), limits(cfg), info)
        .with_execution(exec)
        .with_admission_wait(admission_wait(cfg));
    if cfg.max_batch_sessions > 1 {
        worker.with_batching(batch_limits(cfg))
    } else {
        worker
    }
}

/// The limits of one shared pass (`max_batch_sessions`, `max_batch_rows`).
fn batch_limits(cfg: &WorkerConfig) -> BatchLimits {
    BatchLimits {
        max_sessions: cfg.max_batch_sessions,
        max_rows: cfg.max_batch_rows,
    }
}

/// How long a request for a new session waits for room (`admission_wait_ms`).
fn admission_wait(cfg: &WorkerConfig) -> Duration {
    Duration::from_millis(cfg.admission_wait_ms)
}

/// A draft worker service that loads no model: `cfg.drafter` (n-gram or suffix) answers its
/// draft requests on the CPU.
pub fn model_free_draft_worker(cfg: &WorkerConfig) -> Result<ModelFreeDraftWorker, LaunchError> {
    let engine = ModelFreeEngine::new(cfg.drafter, cfg.suffix_history)
        .map_err(|e| LaunchError::Config(e.to_string()))?;
    let info = WorkerInfo {
        model_name: format!("{:?}", cfg.drafter).to_ascii_lowercase(),
        vocab_size: 0,
        eos_token_ids: Vec::new(),
        max_context: cfg.max_context,
        max_tree_nodes: cfg.max_tree_nodes,
        max_tree_depth: cfg.max_tree_depth,
        max_prompt_len: cfg.prompt_limit().min(cfg.max_context),
        device: "cpu".into(),
    };
    // CPU work, no busy-polling after an answer.
    let exec = Execution::for_device("cpu", Some(Duration::ZERO));
    Ok(
        ModelFreeDraftWorker::new(Arc::new(engine), limits(cfg), info)
            .with_execution(exec)
            .with_admission_wait(admission_wait(cfg)),
    )
}

/// A target worker service over a loaded model.
pub fn target_worker(cfg: &WorkerConfig, m: LoadedModel) -> TargetWorker {
    let info = info(cfg, &m);
    let exec = execution(cfg, &info);
    let engine = TargetEngine::new(Arc::new(m.model), cfg.max_context)
        .with_spare_sessions(cfg.spare_sessions)
        .with_device_timing(cfg.device_timing);
    let gate = cfg.load_gate.then(|| {
        let gate = LoadGate::new(cfg.max_tree_depth).with_group_rows(engine.session_group_rows());
        Arc::new(LoadAdvisor::with_gate(gate))
    });
    let worker = TargetWorker::new(Arc::new(engine), limits(cfg), info)
        .with_execution(exec)
        .with_admission_wait(admission_wait(cfg))
        .with_load_gate(gate);
    if cfg.max_batch_sessions > 1 {
        worker.with_batching(batch_limits(cfg))
    } else {
        worker
    }
}

/// Serves a draft worker for `m` on `listener` until `shutdown`.
pub async fn run_draft(
    cfg: &WorkerConfig,
    m: LoadedModel,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    serve_draft(draft_worker(cfg, m), listener, shutdown).await
}

/// Serves a target worker for `m` on `listener` until `shutdown`.
pub async fn run_target(
    cfg: &WorkerConfig,
    m: LoadedModel,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    serve_target(target_worker(cfg, m), listener, shutdown).await
}
