//! The orchestrator's settings: the `[orchestrator]` section of the config file, layered under
//! environment variables and flags.

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::ValueEnum;
use serde::{Deserialize, Serialize};
use specsplit_orchestrator::{
    AuthToken, ClientSpin, ClientTls, ConnectOptions, DrafterChoice, GenerateConfig, Mode, Pipeline,
};
use specsplit_workers::config::{load_section, Secret, WorkerConfig};

/// `--mode`: whether the draft is used.
#[derive(Clone, Copy, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ModeArg {
    /// Speculative decoding (draft + target).
    Spec,
    /// The target alone, token by token: the reference output speculation must equal.
    Ar,
}

/// `--drafter`: what proposes the trees.
#[derive(Clone, Copy, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DrafterArg {
    /// The draft worker's model.
    Model,
    /// N-gram prompt lookup in this process (no draft worker).
    Ngram,
    /// Suffix decoding in this process (no draft worker).
    Suffix,
    /// Chosen per round from measured speed among the model (with a draft worker), ngram,
    /// suffix and target-only rounds.
    Auto,
}

/// `--pipeline`: how drafting and verification are scheduled.
#[derive(Clone, Copy, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PipelineArg {
    /// Draft, verify, repeat.
    Sequential,
    /// Draft the next tree while the current one is verified, for one outcome of it (the
    /// whole path accepted).
    Overlapped,
    /// Draft the next tree while the current one is verified, for every likely outcome, as
    /// the cost model shapes it (for a draft worker on its own GPU).
    Predraft,
}

/// The orchestrator's flags, shared by `generate` and `serve`; each overrides the config file
/// and environment when given.
#[derive(clap::Args, Serialize)]
pub struct OrchestratorArgs {
    /// TOML configuration file (section [orchestrator]).
    #[arg(long, value_name = "FILE")]
    #[serde(skip)]
    pub(crate) config: Option<PathBuf>,
    /// Draft worker address, e.g. http://127.0.0.1:50051 (empty: start one in-process).
    #[arg(long, value_name = "URL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) draft_addr: Option<String>,
    /// Target worker address, e.g. http://127.0.0.1:50052 (empty: start one in-process).
    #[arg(long, value_name = "URL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) target_addr: Option<String>,
    /// Draft model for the in-process draft worker.
    #[arg(long, value_name = "SPEC")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) draft_model: Option<String>,
    /// Target model for the in-process target worker (and the tokenizer by default).
    #[arg(long, value_name = "SPEC")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) target_model: Option<String>,
    /// Model whose tokenizer encodes the prompt with remote workers (default: the model the
    /// target reports serving, where it is known here, else the target model).
    #[arg(long, value_name = "SPEC")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tokenizer: Option<String>,
    /// Device of in-process workers: cpu, cuda or cuda:N.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) device: Option<String>,
    /// Dtype of in-process workers: f32, f16 or bf16.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) dtype: Option<String>,
    /// Most new tokens to generate (`serve`: when a request does not say).
    #[arg(long, short = 'n', value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) max_tokens: Option<usize>,
    /// Draft depth as a chain (same as --widths 1,1,…,1 of this length).
    #[arg(long, value_name = "K", conflicts_with = "widths")]
    #[serde(skip)]
    pub(crate) depth: Option<usize>,
    /// Draft tree widths per depth, e.g. 4,2,1,1 (a chain when all are 1).
    #[arg(long, value_name = "W,W,…", value_delimiter = ',')]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) widths: Option<Vec<usize>>,
    /// Adapt the depth to measured acceptance and timings.
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub(crate) adaptive_depth: bool,
    /// Sampling temperature (0 = greedy).
    #[arg(long, short = 't')]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) temperature: Option<f32>,
    /// Keep only the k most likely tokens when sampling (0 = off).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) top_k: Option<usize>,
    /// Nucleus sampling threshold (1 = off).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) top_p: Option<f32>,
    /// Random seed (0 = random).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) seed: Option<u64>,
    /// Stop after this many milliseconds (0 = none).
    #[arg(long, value_name = "MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) deadline_ms: Option<u64>,
    /// Most milliseconds one request to the target may take (retried within 30 s, then an
    /// error; never past the deadline).
    #[arg(long, value_name = "MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) rpc_timeout_ms: Option<u64>,
    /// Most milliseconds a round waits for the draft before it goes on target-only.
    #[arg(long, value_name = "MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) draft_timeout_ms: Option<u64>,
    /// Target-only rounds after a failed draft request before the draft is tried again
    /// (doubling with each failure in a row).
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) draft_retry_rounds: Option<usize>,
    /// Longest wait, in rounds, between tries of a failing draft.
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) draft_retry_max_rounds: Option<usize>,
    /// When speculation measures slower than target-only decoding, run this many target-only
    /// rounds before trying it again (0 = never switch).
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) spec_probe_rounds: Option<usize>,
    /// Send the prompt as is, without the model's chat template.
    #[arg(long)]
    #[serde(skip)]
    pub(crate) no_chat_template: bool,
    /// spec: speculative decoding; ar: the target alone (the reference).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) mode: Option<ModeArg>,
    /// Which drafter proposes the trees (ngram and suffix need no draft worker) [default: auto].
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) drafter: Option<DrafterArg>,
    /// The suffix drafter also matches earlier generations of this process.
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub(crate) suffix_history: bool,
    /// sequential, overlapped or predraft rounds.
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) pipeline: Option<PipelineArg>,
    /// Candidate tokens per outcome the predraft pipeline pre-drafts: 0 (the default) lets
    /// its cost model choose (up to 4, or none where pre-drafting does not pay); 1–4 fixes it.
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) candidates: Option<usize>,
    /// Draft the first round beside the target's prefill: true or false (default: with the
    /// overlapped pipeline only).
    #[arg(long, value_name = "BOOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) first_round_overlap: Option<bool>,
    /// Busy-poll the client's sockets while a request is in flight: auto (once a worker reports
    /// a CUDA device), always or never.
    #[arg(long, value_name = "auto|always|never")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) client_spin: Option<ClientSpin>,
    /// Client threads the orchestrator runs generations on, each with its own connections to
    /// the workers; a generation takes the one running fewest (0: one for every four cores, 1
    /// to 8; at most 64).
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) client_threads: Option<usize>,
    /// Log format: text or json (filter with RUST_LOG; default warn).
    #[arg(long, value_name = "FORMAT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) log_format: Option<String>,
    /// PEM CA certificates the remote workers' certificates must chain to: connect over TLS.
    #[arg(long, value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tls_ca: Option<PathBuf>,
    /// PEM client certificate for workers requiring mutual TLS (with --tls-key).
    #[arg(long, value_name = "FILE", requires_all = ["tls_key", "tls_ca"])]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tls_key: Option<PathBuf>,
    /// The name the workers' certificates must carry [default: the host of each address].
    #[arg(long, value_name = "NAME")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tls_domain: Option<String>,
    /// File holding the bearer token sent to the workers; the token may also come from
    /// SPECSPLIT_ORCHESTRATOR__AUTH_TOKEN or the config file.
    #[arg(long, value_name = "FILE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) auth_token_file: Option<PathBuf>,
}

/// The `[orchestrator]` section: where the workers are and how to generate.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    pub(crate) draft_addr: String,
    pub(crate) target_addr: String,
    pub(crate) draft_model: String,
    pub(crate) target_model: String,
    pub(crate) tokenizer: String,
    pub(crate) device: String,
    pub(crate) dtype: String,
    pub(crate) chat_template: bool,
    pub(crate) log_format: String,
    pub(crate) mode: Mode,
    pub(crate) drafter: DrafterChoice,
    pub(crate) suffix_history: bool,
    pub(crate) pipeline: Pipeline,
    pub(crate) candidates: usize,
    pub(crate) max_tokens: usize,
    pub(crate) widths: Vec<usize>,
    pub(crate) adaptive_depth: bool,
    pub(crate) min_depth: usize,
    pub(crate) max_depth: usize,
    pub(crate) temperature: f32,
    pub(crate) top_k: usize,
    pub(crate) top_p: f32,
    pub(crate) seed: u64,
    pub(crate) deadline_ms: u64,
    pub(crate) rpc_timeout_ms: u64,
    pub(crate) draft_timeout_ms: u64,
    pub(crate) draft_retry_rounds: usize,
    pub(crate) draft_retry_max_rounds: usize,
    pub(crate) spec_probe_rounds: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) first_round_overlap: Option<bool>,
    pub(crate) client_spin: ClientSpin,
    pub(crate) client_threads: usize,
    pub(crate) http_listen: String,
    pub(crate) http_max_body_bytes: usize,
    pub(crate) max_concurrent: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) api_key_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) api_key: Option<Secret>,
    pub(crate) insecure: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tls_ca: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tls_cert: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tls_key: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) tls_domain: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) auth_token_file: Option<PathBuf>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) auth_token: Option<Secret>,
}

impl Default for Settings {
    fn default() -> Self {
        let g = GenerateConfig::default();
        Self {
            draft_addr: String::new(),
            target_addr: String::new(),
            draft_model: WorkerConfig::draft_defaults().model,
            target_model: WorkerConfig::target_defaults().model,
            tokenizer: String::new(),
            device: "cpu".into(),
            dtype: String::new(),
            chat_template: true,
            log_format: "text".into(),
            mode: g.mode,
            // The online choice: measured no slower than the target alone on the CPU quick start
            // and within 2.5% of the best single drafter on one GPU (docs/benchmarks.md §7).
            drafter: DrafterChoice::Auto,
            suffix_history: g.suffix_history,
            pipeline: g.pipeline,
            candidates: g.candidates,
            max_tokens: g.max_tokens,
            widths: g.widths,
            adaptive_depth: g.adaptive_depth,
            min_depth: g.min_depth,
            max_depth: g.max_depth,
            temperature: g.temperature,
            top_k: g.top_k,
            top_p: g.top_p,
            seed: g.seed,
            deadline_ms: g.deadline_ms,
            rpc_timeout_ms: g.rpc_timeout_ms,
            draft_timeout_ms: g.draft_timeout_ms,
            draft_retry_rounds: g.draft_retry_rounds,
            draft_retry_max_rounds: g.draft_retry_max_rounds,
            spec_probe_rounds: g.spec_probe_rounds,
            first_round_overlap: g.first_round_overlap,
            client_spin: ClientSpin::default(),
            client_threads: 0,
            http_listen: "127.0.0.1:8000".into(),
            http_max_body_bytes: 1 << 20,
            max_concurrent: 4,
            api_key_file: None,
            api_key: None,
            insecure: false,
            tls_ca: None,
            tls_cert: None,
            tls_key: None,
            tls_domain: None,
            auth_token_file: None,
            auth_token: None,
        }
    }
}

impl Settings {
    /// How to connect to remote workers: TLS and the bearer token as configured.
    pub(crate) fn connect_options(&self) -> Result<ConnectOptions> {
        let tls = match &self.tls_ca {
            Some(ca) => {
                let mut tls =
                    ClientTls::from_files(ca, self.tls_cert.as_deref(), self.tls_key.as_deref())?;
                tls.domain = self.tls_domain.clone();
                Some(tls)
            }
            None if self.tls_cert.is_some() || self.tls_domain.is_some() => {
                bail!("tls_cert and tls_domain need tls_ca (the CA the workers' certificates chain to)")
            }
            None => None,
        };
        let token = match (&self.auth_token, &self.auth_token_file) {
            (Some(_), Some(_)) => bail!("auth_token and auth_token_file are both set; set one"),
            (Some(t), None) => Some(AuthToken::new(t.expose())?),
            (None, Some(f)) => Some(AuthToken::from_file(f)?),
            (None, None) => None,
        };
        Ok(ConnectOptions {
            tls,
            token,
            ..self.client_options()
        })
    }

    /// How the orchestrator's client runtimes run: their busy-polling and their number (the
    /// orchestrator refuses more than `MAX_CLIENT_THREADS` when it connects).
    pub(crate) fn client_options(&self) -> ConnectOptions {
        ConnectOptions {
            spin: self.client_spin,
            client_threads: self.client_threads,
            ..ConnectOptions::default()
        }
    }

    /// The generation settings.
    pub fn generate_config(&self) -> GenerateConfig {
        GenerateConfig {
            mode: self.mode,
            drafter: self.drafter,
            suffix_history: self.suffix_history,
            pipeline: self.pipeline,
            candidates: self.candidates,
            max_tokens: self.max_tokens,
            widths: self.widths.clone(),
            adaptive_depth: self.adaptive_depth,
            min_depth: self.min_depth,
            max_depth: self.max_depth,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            seed: self.seed,
            deadline_ms: self.deadline_ms,
            stop_token_ids: Vec::new(),
            logprobs: false,
            rpc_timeout_ms: self.rpc_timeout_ms,
            draft_timeout_ms: self.draft_timeout_ms,
            draft_retry_rounds: self.draft_retry_rounds,
            draft_retry_max_rounds: self.draft_retry_max_rounds,
            spec_probe_rounds: self.spec_probe_rounds,
            first_round_overlap: self.first_round_overlap,
        }
    }
}

impl OrchestratorArgs {
    /// The settings: defaults < the config file < the environment < these flags (and
    /// `overrides`, flags of the subcommand itself).
    pub fn settings(&mut self, overrides: &impl Serialize) -> Result<Settings> {
        if let Some(k) = self.depth {
            if k == 0 {
                bail!("--depth must be at least 1");
            }
            self.widths = Some(vec![1; k]);
        }
        let mut flags = serde_json::to_value(&*self)?;
        if let (Some(all), serde_json::Value::Object(more)) =
            (flags.as_object_mut(), serde_json::to_value(overrides)?)
        {
            all.extend(more);
        }
        let mut s: Settings = load_section(
            "orchestrator",
            &Settings::default(),
            self.config.as_deref(),
            &flags,
        )?;
        if self.no_chat_template {
            s.chat_template = false;
        }
        if std::env::var_os("RUST_LOG").is_none() {
            std::env::set_var("RUST_LOG", "warn");
        }
        specsplit_workers::config::check_log_format(&s.log_format)?;
        s.generate_config()
            .validate()
            .map_err(|e| anyhow::anyhow!("invalid settings: {e}"))?;
        Ok(s)
    }
}
