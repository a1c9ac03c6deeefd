//! specsplit-bench: the benchmark harness.
//!
//! - `forward`: forward-pass latency over a cached prefix (decode, chain and tree verification)
//!   per context length, and decode tok/s against the memory roofline;
//! - `e2e`: target-only vs speculative decoding end to end over loopback gRPC, with an optional
//!   synthetic drafter of fixed acceptance β;
//! - `plot`: PNG plots from the JSON reports;
//! - `rpc`: per-RPC cost on loopback beyond the workers' own handling time;
//! - `kernels`: the batch-invariant CUDA kernels against cuBLAS, per projection and pass size;
//! - `load`: many users on one target: N concurrent generations, target-only and speculative
//!   (depth gated by the target's load), aggregate tok/s and per-token latency;
//! - `coverage`: how often the target's greedy token is the draft's first choice, or among its
//!   next best alternatives (teacher-forced, real models).
//!
//! Every subcommand writes `<out>/<name>.json` (all but `coverage` also `<out>/<name>.csv`).

mod coverage;
mod e2e;
mod forward;
mod kernels;
mod load;
mod plot;
mod prompt_set;
mod report;
mod rpc;
mod util;

use std::path::PathBuf;

use anyhow::{bail, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use specsplit_orchestrator::{ClientSpin, DrafterChoice, Pipeline};

/// Benchmark harness for SpecSplit.
#[derive(Parser, Debug)]
#[command(name = "specsplit-bench", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Forward-pass latency (decode, chain and tree verification) and the memory roofline.
    Forward(ForwardArgs),
    /// End-to-end target-only vs speculative decoding over loopback gRPC.
    E2e(Box<E2eArgs>),
    /// PNG plots from the JSON reports in a directory.
    Plot(PlotArgs),
    /// Per-RPC cost on loopback beyond the workers' own handling time.
    Rpc(rpc::RpcArgs),
    /// The batch-invariant CUDA kernels against cuBLAS, per projection and pass size.
    Kernels(kernels::KernelArgs),
    /// How often the target's greedy token lies among the draft's top choices.
    Coverage(coverage::CoverageArgs),
    /// Many users on one target: N concurrent generations, target-only and speculative.
    Load(LoadArgs),
}

/// A decoding mode of `load --modes`.
#[derive(Copy, Clone, Debug, ValueEnum)]
enum ModeArg {
    /// Target-only decoding.
    Ar,
    /// Speculative decoding, its depth gated by the target's load advice.
    Spec,
}

#[derive(Args, Debug)]
struct LoadArgs {
    /// Target model spec.
    #[arg(long)]
    target: String,
    /// Draft model spec (same vocabulary as the target).
    #[arg(long)]
    draft: String,
    /// Target device.
    #[arg(long, default_value = "cpu")]
    device_target: String,
    /// Draft device.
    #[arg(long, default_value = "cpu")]
    device_draft: String,
    /// Dtype of both models (default: f32 on CPU, bf16 on CUDA).
    #[arg(long, default_value = "")]
    dtype: String,
    /// Concurrent generations of each measurement, all sharing one target and one draft
    /// worker.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8,16,32,64")]
    sessions: Vec<usize>,
    /// Generations of each measured run: N at once, each next one starting as a generation
    /// ends, until this many (and at least N) have run, so that few sessions still average
    /// over several prompts' acceptance draws (1: one wave of N).
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u64).range(1..=1024))]
    generations: u64,
    /// Modes measured side by side at each session count: ar (target-only), spec
    /// (speculative, gated by the target's load).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "ar,spec")]
    modes: Vec<ModeArg>,
    /// Prompt length of random-weight models, in tokens (real models use the built-in text
    /// prompts).
    #[arg(long, default_value_t = 128)]
    prompt_tokens: usize,
    /// New tokens per generation.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Synthetic drafter acceptance rate β: the draft model's forwards are paid for but its
    /// proposals follow each prompt's output alone with probability β. Results are labelled
    /// synthetic.
    #[arg(long)]
    synthetic_beta: Option<f64>,
    /// Synthetic drafter: the chance that the target's token at a rejected position lies among
    /// the draft's next 1, 2, … likeliest tokens [default: the rate measured on the
    /// Qwen2.5-Coder 0.5B → 1.5B pair].
    #[arg(long, value_delimiter = ',')]
    synthetic_coverage: Option<Vec<f64>>,
    /// Draft chain depth the orchestrator asks for; the target's load advice caps it.
    #[arg(long, default_value_t = 4)]
    depth: usize,
    /// A draft tree's children per node at each depth (e.g. 2,1,1,1: two roots, a chain under
    /// each) instead of a chain of `--depth`; the target's load advice caps its depth.
    #[arg(long, value_delimiter = ',')]
    widths: Option<Vec<usize>>,
    /// Speculative pipeline: sequential, overlapped or predraft (sequential: with both models
    /// on one GPU the overlapped pipeline's drafts contend with the verifications).
    #[arg(long, value_enum, default_value = "sequential")]
    pipeline: PipelineArg,
    /// Whether the target advises draft depths by its load (true or false).
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    load_gate: bool,
    /// Most sessions whose verification rounds share one target pass (1: every pass alone,
    /// as without batching).
    #[arg(long, default_value_t = 64)]
    max_batch_sessions: usize,
    /// Most sessions whose draft-tree levels share one draft pass (1: every draft alone, as
    /// without batching).
    #[arg(long, default_value_t = 64)]
    draft_batch_sessions: usize,
    /// Ended sessions' bodies (KV caches and the CUDA graphs captured over them) each worker
    /// keeps for new sessions, as the workers' `spare_sessions` setting.
    #[arg(long, default_value_t = specsplit_workers::spare::DEFAULT_SPARE_SESSIONS)]
    spare_sessions: usize,
    /// Whether greedy chains on CUDA grow from CUDA graphs, those of sessions queued together in
    /// one shared pass a level (true or false; false: level by level, like other trees).
    #[arg(long, value_name = "BOOL", default_value_t = true, action = clap::ArgAction::Set)]
    static_draft_chains: bool,
    /// Unmeasured runs of each measurement before it is measured (CUDA graphs of its pass
    /// lengths captured).
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Measured runs of each (sessions, mode), the modes alternating run by run (a drift of
    /// the machine meets both alike); each row reports the run of median throughput (of an even
    /// count, the faster of the middle two) and lists every run's.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=20))]
    repeats: u64,
    /// Most milliseconds one request to a worker may take (requests queue behind each other
    /// under load).
    #[arg(long, value_name = "MS", default_value_t = 120_000)]
    rpc_timeout_ms: u64,
    /// Seed of the pseudo-random prompts.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Tokio worker threads of the in-process workers and orchestrators (0 = one per core).
    #[arg(long, default_value_t = 0)]
    worker_threads: usize,
    /// Busy-poll the orchestrator's sockets while a request is in flight: auto, always or
    /// never.
    #[arg(long, value_name = "auto|always|never", default_value = "auto")]
    client_spin: ClientSpin,
    /// Client threads of each orchestrator, each with its own connections to the workers (0:
    /// one for every four cores, 1 to 8).
    #[arg(long, value_name = "N", default_value_t = 0)]
    client_threads: usize,
    /// Draft a speculative generation's first round beside the target's prefill: true or
    /// false (default: with the overlapped and pre-draft pipelines only).
    #[arg(long, value_name = "BOOL")]
    first_round_overlap: Option<bool>,
    /// Output directory.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Base name of the output files [default: load, or load-synthetic with --synthetic-beta].
    #[arg(long)]
    name: Option<String>,
}

#[derive(Args, Debug)]
struct ForwardArgs {
    /// Model spec: `random:qwen2.5-7b[:seed]`, an alias, a directory or a .gguf file.
    #[arg(long)]
    model: String,
    /// Device: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Dtype: f32, f16 or bf16 (default: f32 on CPU, bf16 on CUDA).
    #[arg(long, default_value = "")]
    dtype: String,
    /// Prefix lengths [default: 128,512,1024,2048,4096; quick: 128,512].
    #[arg(long, value_delimiter = ',')]
    contexts: Option<Vec<usize>>,
    /// Chain lengths verified [default: 1,2,4,8,16,32,64; quick: 1,4,16].
    #[arg(long, value_delimiter = ',')]
    chains: Option<Vec<usize>>,
    /// Tree sizes verified [default: 16,32,64; quick: 16,64].
    #[arg(long, value_delimiter = ',')]
    trees: Option<Vec<usize>>,
    /// Greedy chains grown at once below a forest's roots, a pre-draft's passes (CUDA graph
    /// replays; timed per level, chains of 4) [default: 1,2,5,10,16; quick: 2,10].
    #[arg(long, value_delimiter = ',')]
    growth_rows: Option<Vec<usize>>,
    /// Sessions whose verify rounds (a new token and a chain of 4 each) run as one
    /// multi-session pass, as the target's batched verification runs them, and whose draft
    /// chains (two fed tokens, then 4 levels) grow together, as the draft worker grows them
    /// (beside one session's chain grown alone) [default: 2,4; quick: 2].
    #[arg(long, value_delimiter = ',')]
    sessions: Option<Vec<usize>>,
    /// Timed iterations per measurement [default: 20; quick: 5].
    #[arg(long)]
    iters: Option<usize>,
    /// Warm-up iterations per measurement [default: 5; quick: 2].
    #[arg(long)]
    warmup: Option<usize>,
    /// Bandwidth-test buffer in MiB [default: 1024 on CUDA, 256 on CPU; quick: 64].
    #[arg(long)]
    bw_mib: Option<usize>,
    /// Small preset that finishes quickly.
    #[arg(long)]
    quick: bool,
    /// The fused CUDA kernels (draft step and fused layer stacks) or candle's ops.
    #[arg(long, value_enum, default_value = "fused")]
    kernels: KernelsArg,
    /// Batch-invariant kernels for passes of up to 64 rows (off: cuBLAS and candle's attention).
    #[arg(long, value_enum, default_value = "on")]
    batch_invariant: OnOff,
    /// Output directory.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Base name of the output files.
    #[arg(long, default_value = "forward")]
    name: String,
    /// Time each engine round's verification pass on the device with CUDA events.
    #[arg(long)]
    device_timing: bool,
}

/// Which kernels the benchmarked model runs.
#[derive(Copy, Clone, Debug, ValueEnum)]
enum KernelsArg {
    Fused,
    Unfused,
}

/// A side-by-side switch of a benchmark.
#[derive(Copy, Clone, Debug, ValueEnum)]
enum OnOff {
    On,
    Off,
}

#[derive(Copy, Clone, Debug, ValueEnum)]
enum PipelineArg {
    Sequential,
    Overlapped,
    Predraft,
}

/// A drafter of `e2e --drafters`.
#[derive(Copy, Clone, Debug, ValueEnum)]
enum DrafterArg {
    Model,
    Ngram,
    Suffix,
    Auto,
}

#[derive(Args, Debug)]
struct E2eArgs {
    /// Target model spec.
    #[arg(long)]
    target: String,
    /// Draft model spec (same vocabulary as the target).
    #[arg(long)]
    draft: String,
    /// Target device.
    #[arg(long, default_value = "cpu")]
    device_target: String,
    /// Draft device.
    #[arg(long, default_value = "cpu")]
    device_draft: String,
    /// Dtype of both models (default: f32 on CPU, bf16 on CUDA).
    #[arg(long, default_value = "")]
    dtype: String,
    /// Text prompts, one per line (real models; random models use pseudo-random ids).
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// A prompt set of several kinds of work (`## <kind>` lines start prompts; e.g.
    /// bins/specsplit-bench/prompts/drafters.md: code editing, questions, summaries); rows then
    /// report tokens per second per kind too. Overrides --prompts.
    #[arg(long, value_name = "FILE", conflicts_with = "prompts")]
    prompt_set: Option<PathBuf>,
    /// Drafters run side by side with the real draft worker, each over every chain and tree
    /// shape: model, ngram, suffix (model-free, in the orchestrator) and auto (chosen per
    /// round) [default: model].
    #[arg(long, value_enum, value_delimiter = ',')]
    drafters: Option<Vec<DrafterArg>>,
    /// Most milliseconds one request to the target may take (a slow CPU's long prefills
    /// need more than the default).
    #[arg(long, value_name = "MS", default_value_t = 30_000)]
    rpc_timeout_ms: u64,
    /// Number of prompts [default: 8; quick: 2; with --prompt-set: the whole set].
    #[arg(long)]
    num_prompts: Option<usize>,
    /// Prompt length of random-weight models, in tokens [default: 128; quick: 32].
    #[arg(long)]
    prompt_len: Option<usize>,
    /// New tokens per generation [default: 128; quick: 32].
    #[arg(long)]
    max_tokens: Option<usize>,
    /// Chain depths [default: 1,2,4,6,8,12; quick: 2,4].
    #[arg(long, value_delimiter = ',')]
    depths: Option<Vec<usize>>,
    /// Tree shapes, `;`-separated widths per depth [default: "4,2,1,1;2,2,2,1"; quick: "2,2,1"].
    #[arg(long)]
    trees: Option<String>,
    /// Pipelines: sequential, overlapped (pre-draft one outcome), predraft (every likely
    /// outcome, shaped by the cost model) [default: sequential,overlapped,predraft].
    #[arg(long, value_enum, value_delimiter = ',')]
    pipelines: Option<Vec<PipelineArg>>,
    /// Synthetic drafter acceptance rate(s) β, e.g. 0.8 or 0.6,0.8,0.9: the draft model's
    /// forwards are paid for but its proposals follow the target-only reference with
    /// probability β. Results are labelled synthetic.
    #[arg(long, value_delimiter = ',')]
    synthetic_beta: Vec<f64>,
    /// Synthetic drafter: the chance that the target's token at a rejected position lies among
    /// the draft's next 1, 2, … likeliest tokens (comma-separated, one value per number of
    /// alternatives; beyond the list its last value) [default: the rate measured on the
    /// Qwen2.5-Coder 0.5B → 1.5B pair]. Pre-drafts hit a rejection outcome only this often.
    #[arg(long, value_delimiter = ',')]
    synthetic_coverage: Option<Vec<f64>>,
    /// Candidates per outcome of the predraft pipeline: 0 lets its cost model choose (up to
    /// 4), 1–4 fixes the number.
    #[arg(long, default_value_t = 0)]
    candidates: usize,
    /// Choose each round's depth between 1 and the listed depth: the predraft pipeline's by its
    /// cost model (with the candidates), the other pipelines' by the adaptive depth controller.
    #[arg(long)]
    adaptive_depth: bool,
    /// With --synthetic-beta, also run the real draft model.
    #[arg(long)]
    real_too: bool,
    /// Ignore EOS so every generation runs max-tokens (always on for random models).
    #[arg(long)]
    ignore_eos: bool,
    /// Tokio worker threads of the in-process workers and orchestrator (0 = one per core).
    #[arg(long, default_value_t = 0)]
    worker_threads: usize,
    /// Seed of the pseudo-random prompts.
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Unmeasured passes over the whole prompt set before each configuration is measured
    /// (target-only too), so that every pass length a configuration meets (chains cut short
    /// near max-tokens included) has its CUDA graph captured before the timed run; 0 = one
    /// short generation [default: 2; quick: 0].
    #[arg(long)]
    warmup: Option<usize>,
    /// Draft the first round beside the target's prefill: true or false (default: with the
    /// overlapped pipeline only).
    #[arg(long, value_name = "BOOL")]
    first_round_overlap: Option<bool>,
    /// Busy-poll the orchestrator's sockets while a request is in flight: auto (once a worker
    /// reports a CUDA device), always or never.
    #[arg(long, value_name = "auto|always|never", default_value = "auto")]
    client_spin: ClientSpin,
    /// Client threads of each orchestrator (0: one for every four cores, 1 to 8).
    #[arg(long, value_name = "N", default_value_t = 0)]
    client_threads: usize,
    /// Small preset that finishes quickly.
    #[arg(long)]
    quick: bool,
    /// Output directory.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Base name of the output files [default: e2e, or e2e-synthetic with --synthetic-beta].
    #[arg(long)]
    name: Option<String>,
    /// Time the target's verification passes on the device with CUDA events (printed, and
    /// stored as each row's verify_pass_timings).
    #[arg(long)]
    device_timing: bool,
    /// Ended sessions whose KV cache and CUDA graphs each in-process worker keeps for its next
    /// sessions (0: none).
    #[arg(long, value_name = "N", default_value_t = specsplit_workers::spare::DEFAULT_SPARE_SESSIONS)]
    spare_sessions: usize,
    /// Milliseconds the in-process workers busy-poll after each answer (0: never)
    /// [default: 20 on CUDA, 0 on the CPU].
    #[arg(long, value_name = "MS")]
    spin_ms: Option<u64>,
}

#[derive(Args, Debug)]
struct PlotArgs {
    /// Directory with the JSON reports.
    #[arg(long, default_value = "bench-out")]
    input: PathBuf,
    /// Directory for the PNG files.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// TrueType font for labels (default: DejaVu/Liberation from the system; none = no text).
    #[arg(long)]
    font: Option<PathBuf>,
}

fn pick<T: Clone>(given: Option<T>, quick: bool, q: T, full: T) -> T {
    given.unwrap_or(if quick { q } else { full })
}

fn forward(a: ForwardArgs) -> Result<()> {
    let q = a.quick;
    let cuda = a.device.starts_with("cuda");
    let s = forward::ForwardSettings {
        contexts: pick(
            a.contexts,
            q,
            vec![128, 512],
            vec![128, 512, 1024, 2048, 4096],
        ),
        chains: pick(a.chains, q, vec![1, 4, 16], vec![1, 2, 4, 8, 16, 32, 64]),
        trees: pick(a.trees, q, vec![16, 64], vec![16, 32, 64]),
        growth_rows: pick(a.growth_rows, q, vec![2, 10], vec![1, 2, 5, 10, 16]),
        sessions: pick(a.sessions, q, vec![2], vec![2, 4]),
        iters: pick(a.iters, q, 5, 20),
        warmup: pick(a.warmup, q, 2, 5),
        bw_mib: pick(a.bw_mib, q, 64, if cuda { 1024 } else { 256 }),
        model: a.model,
        device: a.device,
        dtype: a.dtype,
        kernels: specsplit_models::fused::KernelOptions {
            fused: matches!(a.kernels, KernelsArg::Fused),
            batch_invariant: matches!(a.batch_invariant, OnOff::On),
            ..Default::default()
        },
        out: a.out,
        name: a.name,
        device_timing: a.device_timing,
    };
    forward::run(&s)
}

fn e2e(a: E2eArgs) -> Result<()> {
    let q = a.quick;
    if a.synthetic_beta.iter().any(|b| !(0.0..=1.0).contains(b)) {
        bail!("--synthetic-beta values must lie in [0, 1]");
    }
    if let Some(c) = &a.synthetic_coverage {
        if c.is_empty() || c.iter().any(|v| !(0.0..=1.0).contains(v)) {
            bail!("--synthetic-coverage takes values in [0, 1], one per number of alternatives");
        }
    }
    if a.candidates > specsplit_orchestrator::MAX_CANDIDATES {
        bail!(
            "--candidates must lie in 0..={} (0: chosen by the cost model)",
            specsplit_orchestrator::MAX_CANDIDATES
        );
    }
    let random = a.target.starts_with("random:") && a.draft.starts_with("random:");
    let trees = pick(a.trees, q, "2,2,1".into(), "4,2,1,1;2,2,2,1".into());
    let name = a.name.unwrap_or_else(|| {
        if a.synthetic_beta.is_empty() {
            "e2e".into()
        } else {
            "e2e-synthetic".into()
        }
    });
    let num_prompts = match (&a.prompt_set, a.num_prompts) {
        (Some(set), None) => prompt_set::read(set)?.len(),
        _ => pick(a.num_prompts, q, 2, 8),
    };
    let s = e2e::E2eSettings {
        num_prompts,
        prompt_len: pick(a.prompt_len, q, 32, 128),
        max_tokens: pick(a.max_tokens, q, 32, 128),
        depths: pick(a.depths, q, vec![2, 4], vec![1, 2, 4, 6, 8, 12]),
        trees: util::parse_trees(&trees)?,
        pipelines: a
            .pipelines
            .unwrap_or_else(|| {
                vec![
                    PipelineArg::Sequential,
                    PipelineArg::Overlapped,
                    PipelineArg::Predraft,
                ]
            })
            .into_iter()
            .map(|p| match p {
                PipelineArg::Sequential => Pipeline::Sequential,
                PipelineArg::Overlapped => Pipeline::Overlapped,
                PipelineArg::Predraft => Pipeline::Predraft,
            })
            .collect(),
        coverage: a
            .synthetic_coverage
            .unwrap_or_else(|| specsplit_workers::draft::MEASURED_COVERAGE.to_vec()),
        candidates: a.candidates,
        adaptive_depth: a.adaptive_depth,
        betas: a.synthetic_beta,
        real_too: a.real_too,
        ignore_eos: a.ignore_eos || random,
        seed: a.seed,
        warmup: pick(a.warmup, q, 0, 2),
        target: a.target,
        draft: a.draft,
        device_target: a.device_target,
        device_draft: a.device_draft,
        dtype: a.dtype,
        prompts_file: a.prompts,
        prompt_set: a.prompt_set,
        rpc_timeout_ms: a.rpc_timeout_ms,
        drafters: a
            .drafters
            .unwrap_or_else(|| vec![DrafterArg::Model])
            .into_iter()
            .map(|d| match d {
                DrafterArg::Model => DrafterChoice::Model,
                DrafterArg::Ngram => DrafterChoice::Ngram,
                DrafterArg::Suffix => DrafterChoice::Suffix,
                DrafterArg::Auto => DrafterChoice::Auto,
            })
            .collect(),
        first_round_overlap: a.first_round_overlap,
        client_spin: a.client_spin,
        client_threads: a.client_threads,
        out: a.out,
        name,
        device_timing: a.device_timing,
        spare_sessions: a.spare_sessions,
        spin_ms: a.spin_ms,
    };
    if s.depths.contains(&0) {
        bail!("--depths must be positive");
    }
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if a.worker_threads > 0 {
        rt.worker_threads(a.worker_threads);
    }
    rt.enable_all().build()?.block_on(e2e::run(&s))
}

fn load_bench(a: LoadArgs) -> Result<()> {
    if a.synthetic_beta.is_some_and(|b| !(0.0..=1.0).contains(&b)) {
        bail!("--synthetic-beta must lie in [0, 1]");
    }
    if a.depth == 0 {
        bail!("--depth must be positive");
    }
    let s = load::LoadSettings {
        name: a.name.unwrap_or_else(|| {
            if a.synthetic_beta.is_some() {
                "load-synthetic".into()
            } else {
                "load".into()
            }
        }),
        target: a.target,
        draft: a.draft,
        device_target: a.device_target,
        device_draft: a.device_draft,
        dtype: a.dtype,
        sessions: a.sessions,
        generations: a.generations as usize,
        modes: a
            .modes
            .into_iter()
            .map(|m| match m {
                ModeArg::Ar => specsplit_orchestrator::Mode::Ar,
                ModeArg::Spec => specsplit_orchestrator::Mode::Spec,
            })
            .collect(),
        prompt_tokens: a.prompt_tokens,
        max_tokens: a.max_tokens,
        synthetic_beta: a.synthetic_beta,
        coverage: a
            .synthetic_coverage
            .unwrap_or_else(|| specsplit_workers::draft::MEASURED_COVERAGE.to_vec()),
        widths: match a.widths {
            Some(w) if w.is_empty() || w.contains(&0) => {
                anyhow::bail!("--widths: each depth needs at least one child, got {w:?}")
            }
            Some(w) => w,
            None => vec![1; a.depth],
        },
        pipeline: match a.pipeline {
            PipelineArg::Sequential => Pipeline::Sequential,
            PipelineArg::Overlapped => Pipeline::Overlapped,
            PipelineArg::Predraft => Pipeline::Predraft,
        },
        load_gate: a.load_gate,
        max_batch_sessions: a.max_batch_sessions,
        draft_batch_sessions: a.draft_batch_sessions,
        spare_sessions: a.spare_sessions,
        static_draft_chains: a.static_draft_chains,
        warmup: a.warmup,
        repeats: a.repeats as usize,
        rpc_timeout_ms: a.rpc_timeout_ms,
        seed: a.seed,
        client_spin: a.client_spin,
        client_threads: a.client_threads,
        first_round_overlap: a.first_round_overlap,
        out: a.out,
    };
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if a.worker_threads > 0 {
        rt.worker_threads(a.worker_threads);
    }
    rt.enable_all().build()?.block_on(load::run(&s)).map(|_| ())
}

fn main() -> Result<()> {
    // The in-process workers' logs, where RUST_LOG asks for them (e.g.
    // `RUST_LOG=specsplit_workers::load_gate=debug`: each change of the target's load advice).
    if std::env::var_os("RUST_LOG").is_some() {
        specsplit_workers::cli::init_logging("text");
    }
    match Cli::parse().command {
        Command::Forward(a) => forward(a),
        Command::E2e(a) => e2e(*a),
        Command::Plot(a) => plot::run(&a.input, &a.out, a.font.as_deref()),
        Command::Rpc(a) => rpc::main(a),
        Command::Kernels(a) => kernels::main(a),
        Command::Coverage(a) => coverage::main(a),
        Command::Load(a) => load_bench(a),
    }
}
