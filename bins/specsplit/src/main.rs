//! `specsplit`: generate text with disaggregated speculative decoding.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use serde::{Deserialize, Serialize};
use specsplit_models::tokenizer::TextTokenizer;
use specsplit_orchestrator::{
    ClientSpin, DrafterChoice, GenerateConfig, Mode, Orchestrator, Pipeline,
};
use specsplit_workers::cli::{init_logging, shutdown_signal};
use specsplit_workers::config::{load_section, WorkerConfig};
use specsplit_workers::launch;

/// Speculative decoding split across a draft worker and a target worker.
///
/// With no worker addresses, `generate` starts a draft and a target worker inside this process
/// on loopback with the default models (fetched on first use), so it works alone.
#[derive(Parser)]
#[command(version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of PROMPT, streaming text to stdout; a stats line goes to stderr.
    Generate(GenerateArgs),
}

#[derive(Clone, Copy, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum ModeArg {
    /// Speculative decoding (draft + target).
    Spec,
    /// The target alone, token by token: the reference output speculation must equal.
    Ar,
}

#[derive(Clone, Copy, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum DrafterArg {
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

#[derive(Clone, Copy, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
enum PipelineArg {
    /// Draft, verify, repeat.
    Sequential,
    /// Draft the next tree while the current one is verified, for one outcome of it (the
    /// whole path accepted).
    Overlapped,
    /// Draft the next tree while the current one is verified, for every likely outcome, as
    /// the cost model shapes it (for a draft worker on its own GPU).
    Predraft,
}

/// Flags of `generate`; each overrides the config file and environment when given.
#[derive(clap::Args, Serialize)]
struct GenerateArgs {
    /// The prompt ("-" reads it from stdin).
    #[serde(skip)]
    prompt: String,
    /// TOML configuration file (section [orchestrator]).
    #[arg(long, value_name = "FILE")]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// Draft worker address, e.g. http://127.0.0.1:50051 (empty: start one in-process).
    #[arg(long, value_name = "URL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    draft_addr: Option<String>,
    /// Target worker address, e.g. http://127.0.0.1:50052 (empty: start one in-process).
    #[arg(long, value_name = "URL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    target_addr: Option<String>,
    /// Draft model for the in-process draft worker.
    #[arg(long, value_name = "SPEC")]
    #[serde(skip_serializing_if = "Option::is_none")]
    draft_model: Option<String>,
    /// Target model for the in-process target worker (and the tokenizer by default).
    #[arg(long, value_name = "SPEC")]
    #[serde(skip_serializing_if = "Option::is_none")]
    target_model: Option<String>,
    /// Model whose tokenizer encodes the prompt with remote workers (default: the model the
    /// target reports serving, where it is known here, else the target model).
    #[arg(long, value_name = "SPEC")]
    #[serde(skip_serializing_if = "Option::is_none")]
    tokenizer: Option<String>,
    /// Device of in-process workers: cpu, cuda or cuda:N.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    device: Option<String>,
    /// Dtype of in-process workers: f32, f16 or bf16.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    dtype: Option<String>,
    /// Most new tokens to generate.
    #[arg(long, short = 'n', value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<usize>,
    /// Draft depth as a chain (same as --widths 1,1,…,1 of this length).
    #[arg(long, value_name = "K", conflicts_with = "widths")]
    #[serde(skip)]
    depth: Option<usize>,
    /// Draft tree widths per depth, e.g. 4,2,1,1 (a chain when all are 1).
    #[arg(long, value_name = "W,W,…", value_delimiter = ',')]
    #[serde(skip_serializing_if = "Option::is_none")]
    widths: Option<Vec<usize>>,
    /// Adapt the depth to measured acceptance and timings.
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    adaptive_depth: bool,
    /// Sampling temperature (0 = greedy).
    #[arg(long, short = 't')]
    #[serde(skip_serializing_if = "Option::is_none")]
    temperature: Option<f32>,
    /// Keep only the k most likely tokens when sampling (0 = off).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    top_k: Option<usize>,
    /// Nucleus sampling threshold (1 = off).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    top_p: Option<f32>,
    /// Random seed (0 = random).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    seed: Option<u64>,
    /// Stop after this many milliseconds (0 = none).
    #[arg(long, value_name = "MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    deadline_ms: Option<u64>,
    /// Most milliseconds one request to the target may take (retried within 30 s, then an
    /// error; never past the deadline).
    #[arg(long, value_name = "MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    rpc_timeout_ms: Option<u64>,
    /// Most milliseconds a round waits for the draft before it goes on target-only.
    #[arg(long, value_name = "MS")]
    #[serde(skip_serializing_if = "Option::is_none")]
    draft_timeout_ms: Option<u64>,
    /// Target-only rounds after a failed draft request before the draft is tried again
    /// (doubling with each failure in a row).
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    draft_retry_rounds: Option<usize>,
    /// Longest wait, in rounds, between tries of a failing draft.
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    draft_retry_max_rounds: Option<usize>,
    /// When speculation measures slower than target-only decoding, run this many target-only
    /// rounds before trying it again (0 = never switch).
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    spec_probe_rounds: Option<usize>,
    /// Send the prompt as is, without the model's chat template.
    #[arg(long)]
    #[serde(skip)]
    no_chat_template: bool,
    /// spec: speculative decoding; ar: the target alone (the reference).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    mode: Option<ModeArg>,
    /// Which drafter proposes the trees (ngram and suffix need no draft worker).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    drafter: Option<DrafterArg>,
    /// The suffix drafter also matches earlier generations of this process.
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    suffix_history: bool,
    /// sequential, overlapped or predraft rounds.
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pipeline: Option<PipelineArg>,
    /// Candidate tokens per outcome the predraft pipeline pre-drafts: 0 (the default) lets
    /// its cost model choose (up to 4, or none where pre-drafting does not pay); 1–4 fixes it.
    #[arg(long, value_name = "N")]
    #[serde(skip_serializing_if = "Option::is_none")]
    candidates: Option<usize>,
    /// Draft the first round beside the target's prefill: true or false (default: with the
    /// overlapped pipeline only).
    #[arg(long, value_name = "BOOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    first_round_overlap: Option<bool>,
    /// Busy-poll the client's sockets while a request is in flight: auto (once a worker reports
    /// a CUDA device), always or never.
    #[arg(long, value_name = "auto|always|never")]
    #[serde(skip_serializing_if = "Option::is_none")]
    client_spin: Option<ClientSpin>,
    /// Print one JSON object (text, token_ids, stats, rounds, config) instead of streaming.
    #[arg(long)]
    #[serde(skip)]
    json: bool,
    /// Log format: text or json (filter with RUST_LOG; default warn).
    #[arg(long, value_name = "FORMAT")]
    #[serde(skip_serializing_if = "Option::is_none")]
    log_format: Option<String>,
}

/// The `[orchestrator]` section: where the workers are and how to generate.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Settings {
    draft_addr: String,
    target_addr: String,
    draft_model: String,
    target_model: String,
    tokenizer: String,
    device: String,
    dtype: String,
    chat_template: bool,
    log_format: String,
    mode: Mode,
    drafter: DrafterChoice,
    suffix_history: bool,
    pipeline: Pipeline,
    candidates: usize,
    max_tokens: usize,
    widths: Vec<usize>,
    adaptive_depth: bool,
    min_depth: usize,
    max_depth: usize,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    seed: u64,
    deadline_ms: u64,
    rpc_timeout_ms: u64,
    draft_timeout_ms: u64,
    draft_retry_rounds: usize,
    draft_retry_max_rounds: usize,
    spec_probe_rounds: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    first_round_overlap: Option<bool>,
    client_spin: ClientSpin,
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
            drafter: g.drafter,
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
        }
    }
}

impl Settings {
    fn generate_config(&self) -> GenerateConfig {
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
            rpc_timeout_ms: self.rpc_timeout_ms,
            draft_timeout_ms: self.draft_timeout_ms,
            draft_retry_rounds: self.draft_retry_rounds,
            draft_retry_max_rounds: self.draft_retry_max_rounds,
            spec_probe_rounds: self.spec_probe_rounds,
            first_round_overlap: self.first_round_overlap,
        }
    }
}

/// Workers started inside this process, stopped when dropped.
struct InProcess {
    stop: Vec<tokio::sync::oneshot::Sender<()>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl InProcess {
    async fn shutdown(self) {
        for s in self.stop {
            let _ = s.send(());
        }
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

async fn start_in_process(
    s: &Settings,
    with_draft: bool,
) -> Result<(InProcess, Option<String>, String, TextTokenizer)> {
    let mut ip = InProcess {
        stop: vec![],
        tasks: vec![],
    };
    let mut tokenizer = None;
    let mut addrs = Vec::new();
    let mut kinds = vec![("target", s.target_model.clone())];
    if with_draft {
        kinds.push(("draft", s.draft_model.clone()));
    }
    for (kind, model) in kinds {
        let base = if kind == "draft" {
            WorkerConfig::draft_defaults()
        } else {
            WorkerConfig::target_defaults()
        };
        let cfg = WorkerConfig {
            listen: "127.0.0.1:0".into(),
            model: model.clone(),
            device: s.device.clone(),
            dtype: s.dtype.clone(),
            max_sessions: 4,
            ..base
        };
        notice(
            &s.log_format,
            &format!("loading {kind} model '{model}' ..."),
            serde_json::json!({"event": "loading", "kind": kind, "model": model}),
        );
        let c2 = cfg.clone();
        let m = tokio::task::spawn_blocking(move || launch::load(&c2))
            .await?
            .with_context(|| format!("starting the in-process {kind} worker"))?;
        if kind == "target" {
            tokenizer = Some(m.tokenizer.clone());
        }
        let (listener, addr) = launch::bind(&cfg).await?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let shutdown = async move {
            let _ = rx.await;
        };
        let task = if kind == "draft" {
            tokio::spawn(async move {
                if let Err(e) = launch::run_draft(&cfg, m, listener, shutdown).await {
                    tracing::error!("in-process draft worker failed: {e}");
                }
            })
        } else {
            tokio::spawn(async move {
                if let Err(e) = launch::run_target(&cfg, m, listener, shutdown).await {
                    tracing::error!("in-process target worker failed: {e}");
                }
            })
        };
        ip.stop.push(tx);
        ip.tasks.push(task);
        addrs.push(format!("http://{addr}"));
    }
    let target = addrs[0].clone();
    let draft = addrs.get(1).cloned();
    let tok = tokenizer.context("no tokenizer")?;
    Ok((ip, draft, target, tok))
}

/// The generation was interrupted (Ctrl-C or SIGTERM): the process exits with 130.
#[derive(Debug)]
struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted")
    }
}

impl std::error::Error for Interrupted {}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate(args).await,
    };
    if let Err(e) = &result {
        if e.downcast_ref::<Interrupted>().is_some() {
            eprintln!("interrupted");
            std::process::exit(130);
        }
    }
    result
}

/// A line for the person at the terminal on stderr: `text`, or `value` as one JSON line when
/// the log format is JSON.
fn notice(log_format: &str, text: &str, value: serde_json::Value) {
    if log_format == "json" {
        eprintln!("{value}");
    } else {
        eprintln!("{text}");
    }
}

/// Writes `text` to stdout; a reader that went away (`| head`) ends the output quietly.
fn out(text: &str) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

async fn generate(mut args: GenerateArgs) -> Result<()> {
    if let Some(k) = args.depth {
        if k == 0 {
            bail!("--depth must be at least 1");
        }
        args.widths = Some(vec![1; k]);
    }
    let mut s: Settings = load_section(
        "orchestrator",
        &Settings::default(),
        args.config.as_deref(),
        &args,
    )?;
    if args.no_chat_template {
        s.chat_template = false;
    }
    if std::env::var_os("RUST_LOG").is_none() {
        std::env::set_var("RUST_LOG", "warn");
    }
    specsplit_workers::config::check_log_format(&s.log_format)?;
    init_logging(&s.log_format);
    let prompt_text = if args.prompt == "-" {
        let mut p = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut p)?;
        p
    } else {
        args.prompt.clone()
    };
    let gen_cfg = s.generate_config();
    gen_cfg
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid settings: {e}"))?;
    tracing::info!(settings = ?s, "configuration");

    let spec = gen_cfg.mode == Mode::Spec;
    // The model drafter needs a draft worker; the online choice uses one where there is one.
    let needs_draft = spec && gen_cfg.drafter == DrafterChoice::Model;
    let uses_draft = needs_draft || (spec && gen_cfg.drafter == DrafterChoice::Auto);
    let (in_process, orch, tokenizer) = if s.target_addr.is_empty()
        && (s.draft_addr.is_empty() || !uses_draft)
    {
        let (ip, d, t, tok) = start_in_process(&s, uses_draft).await?;
        let orch = Orchestrator::connect_with(d.as_deref(), &t, s.client_spin).await?;
        (Some(ip), orch, tok)
    } else {
        if s.target_addr.is_empty() || (needs_draft && s.draft_addr.is_empty()) {
            bail!("give both --draft-addr and --target-addr (or neither, to start both in-process); --mode ar and the ngram, suffix and auto drafters need only --target-addr");
        }
        let d = (uses_draft && !s.draft_addr.is_empty()).then(|| s.draft_addr.clone());
        let orch = Orchestrator::connect_with(d.as_deref(), &s.target_addr, s.client_spin).await?;
        let tok = remote_tokenizer(&s, orch.target_model()).await?;
        (None, orch, tok)
    };

    let result = run(&s, &gen_cfg, &prompt_text, &tokenizer, &orch, args.json).await;
    if let Some(ip) = in_process {
        ip.shutdown().await;
    }
    result
}

/// The tokenizer for remote workers: `tokenizer` when set, else the model the target reports
/// serving where it names one known here, else `target_model`.
async fn remote_tokenizer(s: &Settings, served: &str) -> Result<TextTokenizer> {
    let load = |spec: String| {
        tokio::task::spawn_blocking(move || {
            specsplit_models::source::resolve(&spec)
                .and_then(|r| specsplit_models::loader::load_tokenizer(&r))
        })
    };
    if s.tokenizer.is_empty() && !served.is_empty() {
        if let Ok(tok) = load(served.to_string()).await? {
            return Ok(tok);
        }
    }
    let spec = if s.tokenizer.is_empty() {
        s.target_model.clone()
    } else {
        s.tokenizer.clone()
    };
    load(spec)
        .await?
        .context("loading the tokenizer (set --tokenizer to the target's model)")
}

async fn run(
    s: &Settings,
    gen_cfg: &GenerateConfig,
    prompt_text: &str,
    tokenizer: &TextTokenizer,
    orch: &Orchestrator,
    json: bool,
) -> Result<()> {
    let text_in = if s.chat_template {
        tokenizer.apply_chat_template(prompt_text)
    } else {
        prompt_text.to_string()
    };
    let prompt = tokenizer
        .encode(&text_in, !s.chat_template)
        .context("tokenizing the prompt")?;
    // Token ids the tokenizer makes must mean the same on the target: a model's vocabulary
    // may be padded past its tokenizer's, never the other way round.
    if tokenizer.vocab_size() > orch.vocab_size() {
        bail!(
            "the tokenizer has {} tokens but the target serves a vocabulary of {}: set \
             --tokenizer to the target's model",
            tokenizer.vocab_size(),
            orch.vocab_size()
        );
    }
    let mut decoder = tokenizer.stream_decoder(true);
    let mut ends_with_newline = true;
    let mut stdout = std::io::stdout();
    let on_tokens = |toks: &[u32]| {
        if json {
            return;
        }
        if let Ok(text) = decoder.push(tokenizer, toks) {
            if !text.is_empty() {
                ends_with_newline = text.ends_with('\n');
                let _ = stdout.write_all(text.as_bytes());
                let _ = stdout.flush();
            }
        }
    };
    let gen = tokio::select! {
        r = orch.generate(&prompt, gen_cfg, on_tokens) => r?,
        _ = shutdown_signal() => return Err(Interrupted.into()),
    };
    let text = tokenizer.decode(&gen.token_ids, true).unwrap_or_default();
    if json {
        let obj = serde_json::json!({
            "text": text,
            "token_ids": gen.token_ids,
            "prompt_token_ids": prompt,
            "stop_reason": gen.stop_reason,
            "stats": gen.stats,
            "rounds": gen.rounds,
            "config": s,
        });
        out(&format!("{}\n", serde_json::to_string(&obj)?))?;
    } else {
        let rest = decoder.finish(tokenizer).unwrap_or_default();
        out(&rest)?;
        let ends = if rest.is_empty() {
            ends_with_newline
        } else {
            rest.ends_with('\n')
        };
        if !ends {
            out("\n")?;
        }
        let st = &gen.stats;
        let stop = serde_json::to_value(gen.stop_reason)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        notice(
            &s.log_format,
            &format!(
                "[stats] tokens={} tok/s={:.2} ttft={:.1}ms tpot={:.1}ms acceptance={:.1}% mean_accepted_len={:.2} rounds={} overlap_hit_rate={:.1}% draft_failures={} target_only_rounds={} speed_switches={} drafters={} stop={stop}",
                st.tokens,
                st.tokens_per_s,
                st.ttft_ms,
                st.tpot_ms,
                st.acceptance_rate * 100.0,
                st.mean_accepted_len,
                st.rounds,
                st.overlap_hit_rate * 100.0,
                st.draft_failures,
                st.target_only_rounds,
                st.speed_switches.len(),
                drafter_summary(&st.per_drafter),
            ),
            serde_json::json!({"event": "stats", "stats": st, "stop_reason": stop}),
        );
        if let Some(slow) = st.speed_switches.iter().find(|w| !w.speculate) {
            notice(
                &s.log_format,
                &format!(
                    "note: speculative rounds ran at {:.1} tok/s against {:.1} tok/s for the \
                     target alone, so {} rounds ran target-only. With both models on the same \
                     CPU or GPU they take turns; --mode ar runs the target alone, and a draft \
                     worker on its own device (--draft-addr) can pay.",
                    slow.spec_tokens_per_s, slow.target_only_tokens_per_s, st.target_only_rounds
                ),
                serde_json::json!({"event": "speculation_slower", "switch": slow}),
            );
        }
    }
    Ok(())
}

/// Rounds, tokens and tokens per second of each drafter, e.g.
/// `ngram:12r/40t/85.3tok/s,none:3r/3t/20.1tok/s`.
fn drafter_summary(per: &[specsplit_orchestrator::DrafterStats]) -> String {
    per.iter()
        .map(|d| {
            format!(
                "{}:{}r/{}t/{:.1}tok/s",
                d.drafter.name(),
                d.rounds,
                d.tokens,
                d.tokens_per_s
            )
        })
        .collect::<Vec<_>>()
        .join(",")
}
