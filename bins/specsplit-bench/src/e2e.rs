//! `e2e`: target and draft workers in-process on loopback, the orchestrator over real gRPC,
//! target-only vs speculative (chains of each depth, tree shapes, both pipelines) over a prompt
//! set; optionally with a synthetic drafter of fixed per-token acceptance β.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use specsplit_core::tree::full_tree_size;
use specsplit_models::loader::{load_model, LoadOptions, LoadedModel};
use specsplit_models::tokenizer::ChatFormat;
use specsplit_models::transformer::Transformer;
use specsplit_orchestrator::{
    ClientSpin, ConnectOptions, DrafterChoice, GenerateConfig, Generation, GenerationStats, Mode,
    Orchestrator, Pipeline, RoundRecord,
};
use specsplit_workers::draft::{DraftEngine, SyntheticOracle};
use specsplit_workers::launch::{parse_device, parse_dtype};
use specsplit_workers::service::{
    serve_draft, serve_target, DraftWorker, Execution, TargetWorker, WorkerInfo,
};
use specsplit_workers::session::SessionLimits;
use specsplit_workers::target::{PassTiming, TargetEngine};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

use crate::util;

/// Settings of the `e2e` subcommand (lists already resolved against `--quick`).
#[derive(Debug, Clone)]
pub struct E2eSettings {
    /// Target model spec.
    pub target: String,
    /// Draft model spec.
    pub draft: String,
    /// Target device.
    pub device_target: String,
    /// Draft device.
    pub device_draft: String,
    /// Dtype of both models ("" = device default).
    pub dtype: String,
    /// Text prompts, one per line (real tokenizers only); None = the built-in set.
    pub prompts_file: Option<PathBuf>,
    /// A prompt set of several kinds (see [`crate::prompt_set`]; real tokenizers only).
    pub prompt_set: Option<PathBuf>,
    /// Drafters run with the real draft model (each over every shape and pipeline).
    pub drafters: Vec<DrafterChoice>,
    /// Most milliseconds one request to the target may take.
    pub rpc_timeout_ms: u64,
    /// How many prompts to use.
    pub num_prompts: usize,
    /// Length of the pseudo-random prompts of random-weight models.
    pub prompt_len: usize,
    /// New tokens per generation.
    pub max_tokens: usize,
    /// Chain depths.
    pub depths: Vec<usize>,
    /// Tree shapes (widths per depth).
    pub trees: Vec<Vec<usize>>,
    /// Pipelines run for each shape.
    pub pipelines: Vec<Pipeline>,
    /// Synthetic acceptance rates; empty = the real draft model only.
    pub betas: Vec<f64>,
    /// The synthetic drafter's coverage of rejected positions' target tokens by 1, 2, …
    /// alternatives (see [`SyntheticOracle::with_coverage`]).
    pub coverage: Vec<f64>,
    /// Candidates per outcome of the predraft pipeline (0: its cost model chooses).
    pub candidates: usize,
    /// Each round's depth chosen between 1 and the listed depth (the predraft pipeline's by
    /// its cost model, the others' by the adaptive depth controller).
    pub adaptive_depth: bool,
    /// With betas, also run the real draft model.
    pub real_too: bool,
    /// Drop the EOS ids so every generation runs `max_tokens` (default for random models).
    pub ignore_eos: bool,
    /// Seed of the pseudo-random prompts.
    pub seed: u64,
    /// Unmeasured passes over every prompt before each configuration is measured.
    pub warmup: usize,
    /// Whether the first round drafts beside the target's prefill (None = the default rule).
    pub first_round_overlap: Option<bool>,
    /// When the orchestrator's client runtimes busy-poll.
    pub client_spin: ClientSpin,
    /// Client runtimes of each orchestrator (0: [`specsplit_orchestrator::default_client_threads`]).
    pub client_threads: usize,
    /// Output directory.
    pub out: PathBuf,
    /// Base name of the output files.
    pub name: String,
    /// Whether the target times each verification pass on the device.
    pub device_timing: bool,
    /// Ended sessions' bodies each engine keeps for its next sessions.
    pub spare_sessions: usize,
    /// The workers' busy-polling after each answer, in milliseconds (None: the device's
    /// default).
    pub spin_ms: Option<u64>,
}

/// Most runs of one configuration with a synthetic drafter (see `run`).
const ORACLE_ATTEMPTS: usize = 4;

/// Built-in prompts for real tokenizers.
const PROMPTS: [&str; 8] = [
    "Write a Python function that returns the n-th Fibonacci number using memoization.",
    "Implement binary search over a sorted list of integers in Rust and explain its complexity.",
    "Write a SQL query that returns the ten customers with the highest total order value.",
    "Explain the difference between a process and a thread, with a short C example.",
    "Write a JavaScript function that debounces another function by a given delay.",
    "Implement a stack-based evaluator for arithmetic expressions in reverse Polish notation in Python.",
    "Write a bash script that finds the five largest files under a directory.",
    "Write a Go HTTP handler that returns the current time as JSON.",
];

/// A server running on a loopback port until stopped.
pub(crate) struct Server {
    pub(crate) addr: String,
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    pub(crate) async fn stop(self) {
        let _ = self.stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(10), self.task).await;
    }
}

type Shutdown = Pin<Box<dyn Future<Output = ()> + Send>>;

/// Binds 127.0.0.1:0 and runs `serve` on it with a shutdown signal.
pub(crate) async fn spawn_server<F, Fut, E>(what: &'static str, serve: F) -> Result<Server>
where
    F: FnOnce(TcpListener, Shutdown) -> Fut,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: std::fmt::Display,
{
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?.to_string();
    let (tx, rx) = oneshot::channel::<()>();
    let fut = serve(
        listener,
        Box::pin(async move {
            let _ = rx.await;
        }),
    );
    let task = tokio::spawn(async move {
        if let Err(e) = fut.await {
            eprintln!("{what} worker failed: {e}");
        }
    });
    Ok(Server {
        addr,
        stop: tx,
        task,
    })
}

/// Worker sizing shared by both sides.
pub(crate) struct Sizing {
    pub(crate) max_context: usize,
    pub(crate) max_tree_nodes: usize,
}

pub(crate) fn info(
    name: String,
    m: &Transformer,
    eos: &[u32],
    device: &str,
    z: &Sizing,
) -> WorkerInfo {
    WorkerInfo {
        model_name: name,
        vocab_size: m.config().vocab_size,
        eos_token_ids: eos.to_vec(),
        max_context: z.max_context,
        max_tree_nodes: z.max_tree_nodes,
        max_tree_depth: specsplit_proto::codec::MAX_WIRE_TREE_DEPTH,
        max_prompt_len: z.max_context,
        device: device.to_string(),
    }
}

pub(crate) fn limits() -> SessionLimits {
    SessionLimits {
        max_sessions: 8,
        memory_budget_bytes: usize::MAX / 2,
        ttl: Duration::from_secs(600),
    }
}

pub(crate) async fn load(spec: String, device: String, dtype: String) -> Result<LoadedModel> {
    tokio::task::spawn_blocking(move || -> Result<LoadedModel> {
        let opts = LoadOptions {
            device: parse_device(&device)?,
            dtype: parse_dtype(&dtype)?,
        };
        load_model(&spec, &opts).with_context(|| format!("loading {spec}"))
    })
    .await?
}

/// Loads the draft. A random-weight draft takes the target's vocabulary size (e.g. the 0.5B
/// shape under a 7B target, whose real checkpoints pad the vocabulary to different sizes), so
/// the pair passes the orchestrator's vocabulary check.
pub(crate) async fn load_draft(
    spec: &str,
    device: &str,
    dtype: &str,
    target: &LoadedModel,
) -> Result<LoadedModel> {
    let vocab = target.model.config().vocab_size;
    let Some(rest) = spec.strip_prefix("random:") else {
        return load(spec.to_string(), device.to_string(), dtype.to_string()).await;
    };
    let (preset, seed) = match rest.split_once(':') {
        Some((p, s)) => (
            p.to_string(),
            s.parse::<u64>().context("random draft seed")?,
        ),
        None => (rest.to_string(), 0),
    };
    let (device, dtype, spec) = (device.to_string(), dtype.to_string(), spec.to_string());
    tokio::task::spawn_blocking(move || -> Result<LoadedModel> {
        let mut cfg = specsplit_models::config::ModelConfig::preset(&preset)
            .with_context(|| format!("unknown preset {preset}"))?;
        cfg.vocab_size = vocab;
        let opts = LoadOptions {
            device: parse_device(&device)?,
            dtype: parse_dtype(&dtype)?,
        };
        let model = specsplit_models::transformer::Transformer::random(
            cfg,
            seed,
            opts.effective_dtype(),
            &opts.device,
        )?;
        Ok(LoadedModel {
            name: format!("{spec} (vocab {vocab})"),
            model,
            tokenizer: specsplit_models::tokenizer::TextTokenizer::byte_level(vocab)?,
        })
    })
    .await?
}

/// The prompt token sequences, and each one's kind of work (empty without a prompt set).
fn prompts(
    s: &E2eSettings,
    tok: &LoadedModel,
    random: bool,
    eos: &[u32],
) -> Result<(Vec<Vec<u32>>, Vec<String>)> {
    let n = s.num_prompts.max(1);
    if random {
        let vocab = tok.model.config().vocab_size;
        let ids = (0..n)
            .map(|i| util::random_ids(s.seed.wrapping_add(i as u64), s.prompt_len, vocab, eos))
            .collect();
        return Ok((ids, vec![String::new(); n]));
    }
    if let Some(path) = &s.prompt_set {
        let set: Vec<_> = crate::prompt_set::read(path)?
            .into_iter()
            .cycle()
            .take(n)
            .collect();
        let t = &tok.tokenizer;
        let chat = !matches!(t.chat_format(), ChatFormat::Plain);
        let ids = set
            .iter()
            .map(|p| {
                let text = if chat {
                    t.apply_chat_template(&p.text)
                } else {
                    p.text.clone()
                };
                Ok(t.encode(&text, !chat)?)
            })
            .collect::<Result<Vec<_>>>()?;
        return Ok((ids, set.into_iter().map(|p| p.kind).collect()));
    }
    let ids = text_prompts(s.prompts_file.as_deref(), n, tok)?;
    Ok((ids, vec![String::new(); n]))
}

/// Tokens per second of `gens` per kind of work (prompt `i` of kind `kinds[i]`), in order of
/// first appearance; `null` without kinds.
fn by_kind(gens: &[Generation], kinds: &[String]) -> Value {
    let mut order: Vec<&str> = Vec::new();
    for k in kinds {
        if !k.is_empty() && !order.contains(&k.as_str()) {
            order.push(k);
        }
    }
    if order.is_empty() {
        return Value::Null;
    }
    let mut out = serde_json::Map::new();
    for k in order {
        let (tokens, secs) = gens
            .iter()
            .zip(kinds)
            .filter(|(_, kind)| kind.as_str() == k)
            .fold((0usize, 0.0f64), |(t, e), (g, _)| {
                (t + g.token_ids.len(), e + g.stats.elapsed_s)
            });
        out.insert(
            k.to_string(),
            json!(if secs > 0.0 {
                tokens as f64 / secs
            } else {
                0.0
            }),
        );
    }
    Value::Object(out)
}

/// `by_kind` as `kind a tok/s, …` for the console.
fn kinds_label(v: &Value) -> String {
    v.as_object()
        .map(|m| {
            m.iter()
                .map(|(k, t)| format!("{k} {:.1} tok/s", t.as_f64().unwrap_or(0.0)))
                .collect::<Vec<_>>()
                .join(", ")
        })
        .unwrap_or_default()
}

/// The name of a drafter choice in rows and labels.
fn choice_name(d: DrafterChoice) -> &'static str {
    match d {
        DrafterChoice::Model => "model",
        DrafterChoice::Ngram => "ngram",
        DrafterChoice::Suffix => "suffix",
        DrafterChoice::Auto => "auto",
    }
}

/// The token sequences of `n` text prompts (cycling through them): the lines of `file`, else
/// the built-in set; wrapped in the model's chat template where its tokenizer has one.
pub(crate) fn text_prompts(
    file: Option<&Path>,
    n: usize,
    tok: &LoadedModel,
) -> Result<Vec<Vec<u32>>> {
    let texts: Vec<String> = match file {
        Some(p) => std::fs::read_to_string(p)
            .with_context(|| format!("reading {}", p.display()))?
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_string)
            .collect(),
        None => PROMPTS.iter().map(|p| p.to_string()).collect(),
    };
    if texts.is_empty() {
        bail!("no prompts");
    }
    let t = &tok.tokenizer;
    let chat = !matches!(t.chat_format(), ChatFormat::Plain);
    texts
        .iter()
        .cycle()
        .take(n)
        .map(|text| {
            let text = if chat {
                t.apply_chat_template(text)
            } else {
                text.clone()
            };
            Ok(t.encode(&text, !chat)?)
        })
        .collect()
}

/// One speculative configuration.
struct SpecRun {
    kind: &'static str,
    pipeline: Pipeline,
    widths: Vec<usize>,
    /// Its drafter.
    choice: DrafterChoice,
}

fn pipeline_name(p: Pipeline) -> &'static str {
    match p {
        Pipeline::Sequential => "sequential",
        Pipeline::Overlapped => "overlapped",
        Pipeline::Predraft => "predraft",
    }
}

async fn generate_all(
    o: &Orchestrator,
    prompts: &[Vec<u32>],
    cfg: &GenerateConfig,
) -> Result<Vec<Generation>> {
    let mut out = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        // Each generation its own seed: a synthetic drafter's acceptance draws (and a sampled
        // generation's) are then independent across the prompt set instead of one sequence
        // repeated for every prompt. Greedy target outputs do not depend on it.
        let cfg = GenerateConfig {
            seed: cfg.seed.wrapping_add(i as u64),
            ..cfg.clone()
        };
        out.push(o.generate(p, &cfg, |_| {}).await?);
    }
    Ok(out)
}

/// Runs `cfg` unmeasured before it is measured: `passes` times over every prompt, so that each
/// pass length the configuration meets has been seen twice (a stepper runs a new length eagerly
/// once, captures its graph the second time and replays it after); with `passes` 0 only one
/// short generation of the first prompt (kernels loaded, the common lengths started).
async fn warm_up(
    o: &Orchestrator,
    prompts: &[Vec<u32>],
    cfg: &GenerateConfig,
    passes: usize,
) -> Result<()> {
    if passes == 0 {
        let short = GenerateConfig {
            max_tokens: cfg.max_tokens.min(8),
            ..cfg.clone()
        };
        generate_all(o, &prompts[..prompts.len().min(1)], &short).await?;
    }
    for _ in 0..passes {
        generate_all(o, prompts, cfg).await?;
    }
    Ok(())
}

/// Prints the target's verification passes timed with `--device-timing`, by the
/// pass's rows (row counts of at least ten passes): the device time's median, 10th and 90th
/// percentile, the median host time until enqueued and the median model time.
fn print_device_times(times: &[PassTiming]) {
    let mut rows: Vec<usize> = times.iter().map(|t| t.rows).collect();
    rows.sort_unstable();
    rows.dedup();
    for n in rows {
        let passes: Vec<&PassTiming> = times.iter().filter(|t| t.rows == n).collect();
        if passes.len() < 10 {
            continue;
        }
        let of = |f: fn(&PassTiming) -> f64| {
            util::summarize(&passes.iter().map(|t| f(t)).collect::<Vec<_>>())
        };
        let (device, enqueue, model, context) = (
            of(|t| t.device_ms),
            of(|t| t.enqueue_ms),
            of(|t| t.model_ms),
            of(|t| t.context as f64),
        );
        eprintln!(
            "    {n}-row verify passes: device {:.3} ms (p10 {:.3}, p90 {:.3}), host enqueue {:.3} ms, model {:.3} ms, context median {:.0} ({} passes)",
            device.median, device.p10, device.p90, enqueue.median, model.median, context.median, passes.len()
        );
    }
}

/// The passes of [`print_device_times`], one `[rows, context, device ms, host enqueue ms,
/// model ms, graph]` array each (null when none were timed).
fn pass_timings_json(times: &[PassTiming]) -> Value {
    if times.is_empty() {
        return Value::Null;
    }
    times
        .iter()
        .map(|t| {
            json!([
                t.rows,
                t.context,
                t.device_ms,
                t.enqueue_ms,
                t.model_ms,
                t.graph
            ])
        })
        .collect()
}

/// Tokens a round a chain of `depth` synthetic proposals yields in expectation when each is
/// accepted with probability `beta` once its parent was: `1 + β + … + β^depth` (the target's
/// own next token included; before max-tokens cuts a round short).
fn expected_chain_len(beta: f64, depth: usize) -> f64 {
    (0..=depth as i32).map(|i| beta.powi(i)).sum()
}

/// Aggregates the generations of one configuration into a result row: the orchestrator's own
/// statistics over every round of every generation, plus the per-phase means.
fn aggregate(gens: &[Generation], depth: usize, reference: &[Generation]) -> Value {
    let rounds: Vec<RoundRecord> = gens.iter().flat_map(|g| g.rounds.clone()).collect();
    let elapsed: f64 = gens.iter().map(|g| g.stats.elapsed_s).sum();
    let st = GenerationStats::from_rounds(&rounds, elapsed, 0.0);
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let mean_of =
        |f: &dyn Fn(&Generation) -> f64| ratio(gens.iter().map(f).sum::<f64>(), gens.len() as f64);
    let per_round =
        |f: &dyn Fn(&RoundRecord) -> f64| ratio(rounds.iter().map(f).sum(), rounds.len() as f64);
    // Every round but each generation's first, which carries the prompt's prefill on both
    // workers (and, on a new session, the first steps before its CUDA graphs are captured).
    let steady: Vec<&RoundRecord> = gens.iter().flat_map(|g| g.rounds.iter().skip(1)).collect();
    let steady_mean = |f: &dyn Fn(&RoundRecord) -> f64| {
        ratio(steady.iter().map(|r| f(r)).sum(), steady.len() as f64)
    };
    let steady_median = |f: &dyn Fn(&RoundRecord) -> f64| {
        util::summarize(&steady.iter().map(|r| f(r)).collect::<Vec<_>>()).median
    };
    let first: Vec<&RoundRecord> = gens.iter().filter_map(|g| g.rounds.first()).collect();
    let first_mean = |f: &dyn Fn(&RoundRecord) -> f64| {
        ratio(first.iter().map(|r| f(r)).sum(), first.len() as f64)
    };
    let pairs: Vec<(usize, usize)> = rounds.iter().map(|r| (r.drafted, r.accepted)).collect();
    let identical = gens
        .iter()
        .zip(reference)
        .filter(|(g, r)| g.token_ids == r.token_ids)
        .count();
    let pre: Vec<f64> = rounds
        .iter()
        .filter(|r| r.predraft_candidates > 0)
        .map(|r| r.predraft_candidates as f64)
        .collect();
    let mean_candidates = ratio(pre.iter().sum(), pre.len() as f64);
    let by_accepted: Vec<Value> = (0..=depth)
        .map(|j| predraft_hits(&rounds, Some(j)))
        .collect();
    let predraft = json!({
        "predraft_hit_rate": predraft_hits(&rounds, None),
        "predraft_hit_rate_by_accepted": by_accepted,
        "mean_predraft_candidates": mean_candidates,
        "predraft_share": ratio(pre.len() as f64, rounds.len() as f64),
    });
    let row = json!({
        "generations": gens.len(),
        "tokens": st.tokens,
        "elapsed_s": elapsed,
        "tok_per_s": st.tokens_per_s,
        "ttft_ms": mean_of(&|g| g.stats.ttft_ms),
        "tpot_ms": mean_of(&|g| g.stats.tpot_ms),
        "rounds": st.rounds,
        "acceptance_rate": st.acceptance_rate,
        "mean_accepted_len": st.mean_accepted_len,
        "per_position_acceptance": util::per_position_acceptance(&pairs, depth),
        "overlap_hit_rate": st.overlap_hit_rate,
        "overlap_attempts": st.overlap_attempts,
        "network_share": st.network_share,
        "mean_draft_ms": per_round(&|r| r.draft_ms),
        "mean_verify_ms": per_round(&|r| r.verify_ms),
        "mean_verify_server_ms": per_round(&|r| r.verify_server_ms),
        "mean_draft_server_ms": per_round(&|r| r.draft_server_ms),
        "mean_verify_model_ms": per_round(&|r| r.verify_model_ms),
        "mean_draft_model_ms": per_round(&|r| r.draft_model_ms),
        "mean_round_ms": per_round(&|r| r.round_ms),
        "mean_round_overhead_ms": st.round_overhead_ms,
        "first_round_ms": first_mean(&|r| r.round_ms),
        "first_round_draft_server_ms": first_mean(&|r| r.draft_server_ms),
        "first_round_verify_ms": first_mean(&|r| r.verify_ms),
        "first_round_verify_server_ms": first_mean(&|r| r.verify_server_ms),
        "first_round_verify_model_ms": first_mean(&|r| r.verify_model_ms),
        "first_round_predraft_server_ms": first_mean(&|r| r.predraft_server_ms),
        "first_round_predraft_model_ms": first_mean(&|r| r.predraft_model_ms),
        "first_round_predraft_wait_ms": first_mean(&|r| r.predraft_wait_ms),
        "steady_rounds": steady.len(),
        "steady_round_ms": steady_mean(&|r| r.round_ms),
        "steady_draft_model_ms": steady_mean(&|r| r.draft_model_ms),
        "steady_verify_model_ms": steady_mean(&|r| r.verify_model_ms),
        "steady_draft_model_ms_median": steady_median(&|r| r.draft_model_ms),
        "steady_verify_model_ms_median": steady_median(&|r| r.verify_model_ms),
        "steady_verify_model_ms_max": steady.iter().map(|r| r.verify_model_ms).fold(0.0, f64::max),
        "steady_draft_model_ms_max": steady.iter().map(|r| r.draft_model_ms).fold(0.0, f64::max),
        "steady_round_overhead_ms": steady_mean(&RoundRecord::overhead_ms),
        "steady_tok_per_s": ratio(
            steady.iter().map(|r| r.emitted.len() as f64).sum::<f64>() * 1e3,
            steady.iter().map(|r| r.round_ms).sum(),
        ),
        "identical_to_target_only": ratio(identical as f64, gens.len().min(reference.len()) as f64),
        "output_digest": output_digest(gens),
    });
    // Where a round after the first spends its time.
    let steady_phases = json!({
        "steady_verify_ms": steady_mean(&|r| r.verify_ms),
        "steady_verify_server_ms": steady_mean(&|r| r.verify_server_ms),
        "steady_predraft_model_ms": steady_mean(&|r| r.predraft_model_ms),
        "steady_predraft_ms": steady_mean(&|r| r.predraft_ms),
        "steady_predraft_lag_ms": steady_mean(&|r| r.predraft_lag_ms),
        "steady_predraft_server_ms": steady_mean(&|r| r.predraft_server_ms),
        "steady_predraft_wait_ms_median": steady_median(&|r| r.predraft_wait_ms),
        "steady_predraft_waited_share": ratio(
            steady.iter().filter(|r| r.predraft_wait_ms > 0.05).count() as f64,
            steady.len() as f64,
        ),
        "steady_predraft_wait_ms": steady_mean(&|r| r.predraft_wait_ms),
    });
    merge(merge(row, predraft), steady_phases)
}

/// The share of pre-drafts (of rounds that ran one and got its answer) that held the
/// verdict's outcome, among rounds that accepted `accepted` tokens (`None`: all); `null` when
/// there were none.
fn predraft_hits(rounds: &[RoundRecord], accepted: Option<usize>) -> Value {
    let tried: Vec<bool> = rounds
        .iter()
        .filter(|r| accepted.is_none_or(|j| r.accepted == j))
        .filter_map(|r| r.predraft_hit)
        .collect();
    if tried.is_empty() {
        return Value::Null;
    }
    json!(tried.iter().filter(|&&h| h).count() as f64 / tried.len() as f64)
}

/// A fingerprint of every generation's tokens, in order (FNV-1a, 64 bits, hex), so that two
/// builds' runs of the same configuration can be compared for identical outputs.
fn output_digest(gens: &[Generation]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for g in gens {
        for &t in g.token_ids.iter().chain(std::iter::once(&u32::MAX)) {
            for b in t.to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
    }
    format!("{h:016x}")
}

/// The number `v[key]` holds (0 when absent).
fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or(0.0)
}

fn merge(mut a: Value, b: Value) -> Value {
    if let (Some(a), Value::Object(b)) = (a.as_object_mut(), b) {
        a.extend(b);
    }
    a
}

/// Runs the end-to-end benchmark and writes its report.
pub async fn run(s: &E2eSettings) -> Result<()> {
    let random = s.target.starts_with("random:") && s.draft.starts_with("random:");
    eprintln!("loading target {} and draft {} ...", s.target, s.draft);
    let target = load(s.target.clone(), s.device_target.clone(), s.dtype.clone()).await?;
    let draft = load_draft(&s.draft, &s.device_draft, &s.dtype, &target).await?;
    let eos: Vec<u32> = if s.ignore_eos {
        Vec::new()
    } else {
        let mut e = target.tokenizer.eos_token_ids().to_vec();
        e.extend(draft.tokenizer.eos_token_ids());
        e
    };
    let (prompts, kinds) = prompts(s, &target, random, target.tokenizer.eos_token_ids())?;
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let max_nodes = s
        .trees
        .iter()
        .map(|w| full_tree_size(w))
        .chain(s.depths.iter().copied())
        .max()
        .unwrap_or(1);
    // A pre-draft's nodes: the path, every outcome's candidates and their trees.
    let predraft_nodes = if s.pipelines.contains(&Pipeline::Predraft) {
        let m = specsplit_orchestrator::MAX_CANDIDATES;
        s.depths
            .iter()
            .map(|&d| d + (d + 1) * m * (1 + d))
            .chain(
                s.trees
                    .iter()
                    .map(|w| w.len() + (w.len() + 1) * m * (1 + full_tree_size(w))),
            )
            .max()
            .unwrap_or(0)
    } else {
        0
    };
    let max_nodes = max_nodes.max(predraft_nodes);
    let z = Sizing {
        max_context: longest + s.max_tokens + max_nodes + 16,
        max_tree_nodes: max_nodes + 8,
    };
    eprintln!(
        "{} prompts of up to {longest} tokens, {} new tokens each",
        prompts.len(),
        s.max_tokens
    );

    let target_model = Arc::new(target.model);
    let draft_model = Arc::new(draft.model);
    let t_info = info(
        target.name.clone(),
        &target_model,
        &eos,
        &s.device_target,
        &z,
    );
    let t_engine = Arc::new(
        TargetEngine::new(target_model.clone(), z.max_context)
            .with_device_timing(s.device_timing)
            .with_spare_sessions(s.spare_sessions),
    );
    let exec = |device: &str| Execution::for_device(device, s.spin_ms.map(Duration::from_millis));
    let t_exec = exec(&s.device_target);
    let t_worker =
        TargetWorker::new(t_engine.clone(), limits(), t_info).with_execution(t_exec.clone());
    let t_server = spawn_server("target", move |l, sd| serve_target(t_worker, l, sd)).await?;
    let start_draft = |engine: DraftEngine, label: String| {
        let d_info = info(label, &draft_model, &eos, &s.device_draft, &z);
        let w = DraftWorker::new(Arc::new(engine), limits(), d_info)
            .with_execution(exec(&s.device_draft));
        spawn_server("draft", move |l, sd| serve_draft(w, l, sd))
    };

    let base_cfg = GenerateConfig {
        max_tokens: s.max_tokens,
        temperature: 0.0,
        seed: 1,
        first_round_overlap: s.first_round_overlap,
        rpc_timeout_ms: s.rpc_timeout_ms,
        ..GenerateConfig::default()
    };
    let meta_models = json!({"target": target.name, "draft": draft.name});

    // Target-only baseline; its outputs are the reference continuations.
    let opts = ConnectOptions {
        spin: s.client_spin,
        client_threads: s.client_threads,
        ..ConnectOptions::default()
    };
    let ar_orch = Orchestrator::connect_with_options(None, &t_server.addr, &opts).await?;
    let ar_cfg = GenerateConfig {
        mode: Mode::Ar,
        ..base_cfg.clone()
    };
    warm_up(&ar_orch, &prompts, &ar_cfg, s.warmup).await?;
    eprintln!("target-only ...");
    t_engine.take_device_times();
    let ar = generate_all(&ar_orch, &prompts, &ar_cfg).await?;
    let ar_passes = t_engine.take_device_times();
    print_device_times(&ar_passes);
    let ar_row = merge(
        json!({
            "label": "target-only", "kind": "ar", "mode": "ar", "pipeline": "none",
            "widths": "", "depth": 0, "tree_nodes": 0, "synthetic": false, "beta": null,
            "drafter": "none", "drafter_choice": "none",
            "verify_pass_timings": pass_timings_json(&ar_passes),
            "tok_per_s_by_kind": by_kind(&ar, &kinds),
        }),
        aggregate(&ar, 0, &ar),
    );
    if !kinds_label(&ar_row["tok_per_s_by_kind"]).is_empty() {
        eprintln!("  by kind: {}", kinds_label(&ar_row["tok_per_s_by_kind"]));
    }
    let ar_tps = num(&ar_row, "tok_per_s");
    let ar_steady = num(&ar_row, "steady_tok_per_s");
    eprintln!(
        "  {ar_tps:.1} tok/s, overhead {:.3} ms/round, target server {:.2} ms (model {:.2}); \
         after the first round: {ar_steady:.1} tok/s, model {:.2} ms (median {:.2}, max {:.2}), \
         overhead {:.3} ms/round; ttft {:.2} ms",
        num(&ar_row, "mean_round_overhead_ms"),
        num(&ar_row, "mean_verify_server_ms"),
        num(&ar_row, "mean_verify_model_ms"),
        num(&ar_row, "steady_verify_model_ms"),
        num(&ar_row, "steady_verify_model_ms_median"),
        num(&ar_row, "steady_verify_model_ms_max"),
        num(&ar_row, "steady_round_overhead_ms"),
        num(&ar_row, "ttft_ms"),
    );
    let mut rows = vec![merge(ar_row, meta_models.clone())];

    let mut runs: Vec<SpecRun> = Vec::new();
    for &choice in &s.drafters {
        for &pipeline in &s.pipelines {
            for &d in &s.depths {
                runs.push(SpecRun {
                    kind: "chain",
                    pipeline,
                    widths: vec![1; d],
                    choice,
                });
            }
            for w in &s.trees {
                runs.push(SpecRun {
                    kind: "tree",
                    pipeline,
                    widths: w.clone(),
                    choice,
                });
            }
        }
    }

    // Drafters: the real draft model and/or synthetic ones.
    let mut drafters: Vec<Option<f64>> = Vec::new();
    if s.betas.is_empty() || s.real_too {
        drafters.push(None);
    }
    drafters.extend(s.betas.iter().map(|&b| Some(b)));
    let references: Vec<Vec<u32>> = prompts
        .iter()
        .zip(&ar)
        .map(|(p, g)| p.iter().chain(&g.token_ids).copied().collect())
        .collect();
    let mut summary = Vec::new();
    for beta in drafters {
        let mut engine = DraftEngine::new(draft_model.clone(), eos.clone(), z.max_context)
            .with_spare_sessions(s.spare_sessions);
        let oracle = beta
            .map(|b| SyntheticOracle::new(references.clone(), b).with_coverage(s.coverage.clone()));
        let label = match (&oracle, beta) {
            (Some(o), Some(b)) => {
                engine = engine.with_synthetic(o.clone());
                format!(
                    "{} (synthetic β={b}, coverage {})",
                    draft.name,
                    util::rates_label(&s.coverage)
                )
            }
            _ => draft.name.clone(),
        };
        let d_server = start_draft(engine, label.clone()).await?;
        let orch =
            Orchestrator::connect_with_options(Some(&d_server.addr), &t_server.addr, &opts).await?;
        let drafter = if beta.is_some() { "synthetic" } else { "real" };
        let mut best: Vec<(Pipeline, usize, f64)> = Vec::new();
        for r in &runs {
            // Synthetic acceptance is a property of the draft model's worker only.
            if beta.is_some() && r.choice != DrafterChoice::Model {
                continue;
            }
            let cfg = GenerateConfig {
                mode: Mode::Spec,
                drafter: r.choice,
                pipeline: r.pipeline,
                widths: r.widths.clone(),
                candidates: s.candidates,
                adaptive_depth: s.adaptive_depth,
                min_depth: 1,
                max_depth: r.widths.len().max(1),
                ..base_cfg.clone()
            };
            warm_up(&orch, &prompts, &cfg, s.warmup).await?;
            t_engine.take_device_times();
            // With a synthetic drafter, a generation that left every reference (the target's
            // verification broke a near-tie unlike its single-token decode) becomes a
            // reference itself and the configuration runs again, so the proposer follows the
            // target's real continuation; the last attempt is reported.
            let mut attempts = 0;
            let gens = loop {
                attempts += 1;
                let gens = generate_all(&orch, &prompts, &cfg).await?;
                let Some(o) = &oracle else { break gens };
                let mut added = 0;
                for (p, g) in prompts.iter().zip(&gens) {
                    added += usize::from(
                        o.add_reference(p.iter().chain(&g.token_ids).copied().collect()),
                    );
                }
                if added == 0 || attempts >= ORACLE_ATTEMPTS {
                    break gens;
                }
            };
            let passes = t_engine.take_device_times();
            print_device_times(&passes);
            let depth = r.widths.len();
            if r.pipeline == Pipeline::Predraft {
                let plan = orch.predraft_planner();
                eprintln!(
                    "    cost model: {:?} (candidates at depth {depth}: {})",
                    plan,
                    plan.choose(depth..=depth, None).candidates
                );
            }
            let agg = merge(
                aggregate(&gens, depth, &ar),
                json!({
                    "tok_per_s_by_kind": by_kind(&gens, &kinds),
                    "attempts": attempts,
                    "oracle_references": oracle.as_ref().map(|o| o.num_references()),
                    "verify_pass_timings": pass_timings_json(&passes),
                }),
            );
            let tps = num(&agg, "tok_per_s");
            let speedup = if ar_tps > 0.0 { tps / ar_tps } else { 0.0 };
            let widths = util::widths_label(&r.widths);
            let expected_len = beta.map(|b| expected_chain_len(b, depth));
            eprintln!(
                "{drafter}{} {} {} {} [{widths}]: {tps:.1} tok/s ({speedup:.2}x), accept {:.2}, len {:.2}{}, same {:.2}, draft {:.2} ms (server {:.2}, model {:.2}), verify {:.2} ms (server {:.2}, model {:.2}), overhead {:.3} ms/round, attempts {}",
                beta.map(|b| format!(" β={b}")).unwrap_or_default(),
                choice_name(r.choice),
                r.kind,
                pipeline_name(r.pipeline),
                num(&agg, "acceptance_rate"),
                num(&agg, "mean_accepted_len"),
                match (r.kind, expected_len) {
                    ("chain", Some(e)) => format!(" (expected {e:.2})"),
                    _ => String::new(),
                },
                num(&agg, "identical_to_target_only"),
                num(&agg, "mean_draft_ms"),
                num(&agg, "mean_draft_server_ms"),
                num(&agg, "mean_draft_model_ms"),
                num(&agg, "mean_verify_ms"),
                num(&agg, "mean_verify_server_ms"),
                num(&agg, "mean_verify_model_ms"),
                num(&agg, "mean_round_overhead_ms"),
                agg["attempts"],
            );
            if !kinds_label(&agg["tok_per_s_by_kind"]).is_empty() {
                eprintln!("    by kind: {}", kinds_label(&agg["tok_per_s_by_kind"]));
            }
            if r.choice == DrafterChoice::Auto {
                let per = specsplit_orchestrator::DrafterStats::of_rounds(
                    &gens
                        .iter()
                        .flat_map(|g| g.rounds.clone())
                        .collect::<Vec<_>>(),
                );
                let line: Vec<String> = per
                    .iter()
                    .map(|d| format!("{} {} rounds", d.drafter.name(), d.rounds))
                    .collect();
                eprintln!("    online choice: {}", line.join(", "));
            }
            if r.pipeline != Pipeline::Sequential {
                eprintln!(
                    "    pre-draft: beside {:.0}% of rounds, {:.2} candidates, hit rate {} \
                     (by accepted length {})",
                    100.0 * num(&agg, "predraft_share"),
                    num(&agg, "mean_predraft_candidates"),
                    agg["predraft_hit_rate"],
                    agg["predraft_hit_rate_by_accepted"],
                );
            }
            eprintln!(
                "    first round: {:.2} ms; draft {:.2} ms, verify {:.2} ms (server {:.2}, model \
                 {:.2}), pre-draft beside it {:.2} ms (model {:.2}), waited {:.2} ms",
                num(&agg, "first_round_ms"),
                num(&agg, "first_round_draft_server_ms"),
                num(&agg, "first_round_verify_ms"),
                num(&agg, "first_round_verify_server_ms"),
                num(&agg, "first_round_verify_model_ms"),
                num(&agg, "first_round_predraft_server_ms"),
                num(&agg, "first_round_predraft_model_ms"),
                num(&agg, "first_round_predraft_wait_ms"),
            );
            let steady = num(&agg, "steady_tok_per_s");
            eprintln!(
                "    after the first round: {steady:.1} tok/s ({:.2}x), draft model {:.2} ms \
                 (median {:.2}, max {:.2}), verify model {:.2} ms (median {:.2}, max {:.2}), \
                 overhead {:.3} ms/round; ttft {:.2} ms",
                if ar_steady > 0.0 {
                    steady / ar_steady
                } else {
                    0.0
                },
                num(&agg, "steady_draft_model_ms"),
                num(&agg, "steady_draft_model_ms_median"),
                num(&agg, "steady_draft_model_ms_max"),
                num(&agg, "steady_verify_model_ms"),
                num(&agg, "steady_verify_model_ms_median"),
                num(&agg, "steady_verify_model_ms_max"),
                num(&agg, "steady_round_overhead_ms"),
                num(&agg, "ttft_ms"),
            );
            eprintln!(
                "    a round after the first: {:.3} ms; verify {:.3} ms (server {:.3}, model \
                 {:.3}), pre-draft beside it {:.3} ms (sent {:.3} ms after the verify; server \
                 {:.3}, model {:.3}), waited {:.3} ms (median {:.3}; more than 0.05 ms in {:.0}% \
                 of rounds)",
                num(&agg, "steady_round_ms"),
                num(&agg, "steady_verify_ms"),
                num(&agg, "steady_verify_server_ms"),
                num(&agg, "steady_verify_model_ms"),
                num(&agg, "steady_predraft_ms"),
                num(&agg, "steady_predraft_lag_ms"),
                num(&agg, "steady_predraft_server_ms"),
                num(&agg, "steady_predraft_model_ms"),
                num(&agg, "steady_predraft_wait_ms"),
                num(&agg, "steady_predraft_wait_ms_median"),
                100.0 * num(&agg, "steady_predraft_waited_share"),
            );
            if r.kind == "chain" && r.choice == DrafterChoice::Model {
                match best.iter_mut().find(|b| b.0 == r.pipeline) {
                    Some(b) if b.2 >= tps => {}
                    Some(b) => *b = (r.pipeline, depth, tps),
                    None => best.push((r.pipeline, depth, tps)),
                }
            }
            let row = json!({
                // Model rows keep their labels of runs without --drafters.
                "label": match r.choice {
                    DrafterChoice::Model => {
                        format!("{}-{}-{widths}", r.kind, pipeline_name(r.pipeline))
                    }
                    c => format!(
                        "{}-{}-{}-{widths}",
                        choice_name(c),
                        r.kind,
                        pipeline_name(r.pipeline)
                    ),
                },
                "drafter_choice": choice_name(r.choice),
                "kind": r.kind, "mode": "spec", "pipeline": pipeline_name(r.pipeline),
                "widths": widths, "depth": depth, "tree_nodes": full_tree_size(&r.widths),
                "synthetic": beta.is_some(), "beta": beta, "drafter": drafter,
                "synthetic_coverage": beta.map(|_| s.coverage.clone()),
                "speedup": speedup, "target_only_tok_per_s": ar_tps,
                "expected_mean_accepted_len": if r.kind == "chain" { expected_len } else { None },
            });
            rows.push(merge(merge(row, agg), meta_models.clone()));
        }
        for (pipeline, depth, tps) in best {
            eprintln!(
                "best chain depth ({drafter}{}, {}): {depth} at {tps:.1} tok/s",
                beta.map(|b| format!(" β={b}")).unwrap_or_default(),
                pipeline_name(pipeline)
            );
            summary.push(json!({
                "drafter": drafter, "synthetic": beta.is_some(), "beta": beta,
                "pipeline": pipeline_name(pipeline), "best_depth": depth, "tok_per_s": tps,
                "speedup": if ar_tps > 0.0 { tps / ar_tps } else { 0.0 },
            }));
        }
        d_server.stop().await;
    }
    t_server.stop().await;

    let kernels = specsplit_models::fused::KernelOptions::default();
    let doc = json!({
        "meta": {
            "kind": "e2e",
            "target": target.name, "target_spec": s.target,
            "draft": draft.name, "draft_spec": s.draft,
            "device_target": s.device_target, "device_draft": s.device_draft,
            "dtype": if s.dtype.is_empty() { "default" } else { s.dtype.as_str() },
            "prompts": prompts.len(), "prompt_tokens": prompts.iter().map(Vec::len).collect::<Vec<_>>(),
            "prompt_kinds": kinds, "prompt_set": s.prompt_set,
            "drafters": s.drafters.iter().map(|&d| choice_name(d)).collect::<Vec<_>>(),
            "random_prompts": random,
            "max_tokens": s.max_tokens, "ignore_eos": s.ignore_eos, "warmup_passes": s.warmup,
            "first_round_overlap": s.first_round_overlap, "client_spin": s.client_spin, "client_threads": ar_orch.client_threads(),
            "synthetic": !s.betas.is_empty(), "betas": s.betas,
            "synthetic_coverage": (!s.betas.is_empty()).then(|| s.coverage.clone()),
            "candidates": s.candidates,
            "adaptive_depth": s.adaptive_depth,
            "transport": "gRPC over loopback, workers in-process",
            "greedy": true,
            // The workers load their models with the default kernel options.
            "fused_kernels": kernels.fused,
            "batch_invariant": kernels.batch_invariant,
            "wide_rows": kernels.wide_rows,
            "pdl": kernels.pdl && specsplit_models::fused::PDL_AVAILABLE,
            "work_placement": format!("{:?}", t_exec.placement()).to_lowercase(),
            "server_spin_ms": t_exec.spin().as_secs_f64() * 1e3,
            "spare_sessions": s.spare_sessions,
            "target_only_tok_per_s": ar_tps,
        },
        "best_depth": summary,
        "rows": rows,
    });
    let (j, c) = crate::report::write(&s.out, &s.name, &doc)?;
    eprintln!("wrote {} and {}", j.display(), c.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::expected_chain_len;

    #[test]
    fn expected_chain_len_sums_the_acceptance_of_every_prefix() {
        // Brute force: the mean over every accept/reject pattern of `depth` proposals, each
        // pattern weighted by its probability, of 1 + the accepted prefix's length.
        for (beta, depth) in [(0.8, 3), (0.8, 6), (0.5, 1), (1.0, 4), (0.0, 5)] {
            let mut mean = 0.0;
            for bits in 0u32..1 << depth {
                let p: f64 = (0..depth)
                    .map(|i| {
                        if (bits >> i) & 1 == 1 {
                            beta
                        } else {
                            1.0 - beta
                        }
                    })
                    .product();
                let accepted = (0..depth).take_while(|i| (bits >> i) & 1 == 1).count();
                mean += p * (1 + accepted) as f64;
            }
            let got = expected_chain_len(beta, depth);
            assert!(
                (got - mean).abs() < 1e-12,
                "β {beta} depth {depth}: {got} vs {mean}"
            );
        }
        assert!((expected_chain_len(0.8, 3) - 2.952).abs() < 1e-12);
    }
}
