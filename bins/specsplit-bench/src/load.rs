//! `load`: many users on one target. N concurrent generations share one in-process target
//! worker and one draft worker over loopback gRPC, target-only (`ar`) and speculative (`spec`,
//! the depth gated by the target's load advice) side by side for each N; every output is
//! compared with the same prompt generated alone.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use specsplit_core::tree::full_tree_size;
use specsplit_orchestrator::{
    ClientSpin, ConnectOptions, GenerateConfig, Generation, Mode, Orchestrator, Pipeline,
};
use specsplit_workers::batcher::{BatchLimits, VerifyBatcher};
use specsplit_workers::draft::{DraftEngine, SyntheticOracle};
use specsplit_workers::draft_batcher::DraftBatcher;
use specsplit_workers::load_gate::{LoadAdvisor, LoadGate};
use specsplit_workers::service::{serve_draft, serve_target, DraftWorker, Execution, TargetWorker};
use specsplit_workers::session::SessionLimits;
use specsplit_workers::target::TargetEngine;

use crate::e2e::{info, load, load_draft, spawn_server, text_prompts, Sizing};
use crate::util;

/// Settings of the `load` subcommand.
#[derive(Debug, Clone)]
pub struct LoadSettings {
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
    /// Concurrent generations of each measurement.
    pub sessions: Vec<usize>,
    /// Generations of each measured run (at least the sessions'), at most the sessions' count
    /// at once: each next one starts as one ends.
    pub generations: usize,
    /// Target-only and/or speculative decoding.
    pub modes: Vec<Mode>,
    /// Prompt length of random-weight models, in tokens.
    pub prompt_tokens: usize,
    /// New tokens per generation.
    pub max_tokens: usize,
    /// Synthetic drafter acceptance β (None: the real draft model).
    pub synthetic_beta: Option<f64>,
    /// The synthetic drafter's coverage of rejected positions (see
    /// [`SyntheticOracle::with_coverage`]).
    pub coverage: Vec<f64>,
    /// The draft tree's children per node at each depth the orchestrator asks for (a chain:
    /// all 1); the target's advice caps its depth.
    pub widths: Vec<usize>,
    /// The speculative pipeline.
    pub pipeline: Pipeline,
    /// Whether the target advises depths by load.
    pub load_gate: bool,
    /// Most sessions whose rounds share one target pass (1: each pass alone).
    pub max_batch_sessions: usize,
    /// Most sessions whose tree levels share one draft pass (1: each draft alone).
    pub draft_batch_sessions: usize,
    /// Ended sessions' bodies (caches and CUDA graphs) each worker keeps for new sessions.
    pub spare_sessions: usize,
    /// Whether greedy chains on CUDA grow from CUDA graphs, those of sessions queued together in
    /// one shared pass a level (false: level by level, like other trees).
    pub static_draft_chains: bool,
    /// Unmeasured runs of each measurement before it is measured.
    pub warmup: usize,
    /// Measured runs of each (sessions, mode), the modes alternating run by run; a row reports
    /// the run of median throughput.
    pub repeats: usize,
    /// Most milliseconds one request to a worker may take.
    pub rpc_timeout_ms: u64,
    /// Seed of the pseudo-random prompts.
    pub seed: u64,
    /// When the orchestrator's client runtimes busy-poll.
    pub client_spin: ClientSpin,
    /// Client runtimes of each orchestrator (0: [`specsplit_orchestrator::default_client_threads`]).
    pub client_threads: usize,
    /// Whether a speculative generation's first round drafts beside the target's prefill
    /// (`None`: the pipeline's default, see [`GenerateConfig::overlaps_first_round`]).
    pub first_round_overlap: Option<bool>,
    /// Output directory.
    pub out: PathBuf,
    /// Base name of the output files.
    pub name: String,
}

/// The name of a mode in rows.
fn mode_name(m: Mode) -> &'static str {
    match m {
        Mode::Ar => "ar",
        Mode::Spec => "spec",
    }
}

/// Runs `total` generations on `orch`, `n` at a time (each next one starting as one ends),
/// generation `i` on prompt `i`; returns them in prompt order and the wall time from the
/// first start to the last finish.
async fn generate_concurrently(
    orch: &Arc<Orchestrator>,
    prompts: &[Vec<u32>],
    (n, total): (usize, usize),
    cfg: &GenerateConfig,
) -> Result<(Vec<Generation>, f64)> {
    let total = total.max(n).min(prompts.len());
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    let spawn = |tasks: &mut tokio::task::JoinSet<_>, i: usize| {
        let (orch, prompt) = (orch.clone(), prompts[i].clone());
        let cfg = GenerateConfig {
            seed: cfg.seed.wrapping_add(i as u64),
            ..cfg.clone()
        };
        tasks.spawn(async move { (i, orch.generate(&prompt, &cfg, |_| {}).await) });
    };
    let mut next = n.min(total);
    for i in 0..next {
        spawn(&mut tasks, i);
    }
    let mut gens: Vec<Option<Generation>> = vec![None; total];
    while let Some(joined) = tasks.join_next().await {
        let (i, g) = joined.context("a generation task failed")?;
        gens[i] = Some(g.with_context(|| format!("generation {i}"))?);
        if next < total {
            spawn(&mut tasks, next);
            next += 1;
        }
    }
    let wall = start.elapsed().as_secs_f64();
    Ok((gens.into_iter().flatten().collect(), wall))
}

/// Each token's latency after a generation's first round: its round's wall time ÷ the tokens
/// the round emitted, in ms, over every generation.
fn token_latencies_ms(gens: &[Generation]) -> Vec<f64> {
    gens.iter()
        .flat_map(|g| g.rounds.iter().skip(1))
        .filter(|r| !r.emitted.is_empty())
        .flat_map(|r| {
            let per = r.round_ms / r.emitted.len() as f64;
            std::iter::repeat_n(per, r.emitted.len())
        })
        .collect()
}

/// Rounds listed per row among its slowest (after each generation's first).
const SLOWEST_ROUNDS: usize = 5;

/// The `SLOWEST_ROUNDS` slowest rounds of `gens` after each generation's first, slowest first:
/// where their time went.
fn slowest_rounds(gens: &[Generation]) -> Vec<Value> {
    let mut rounds: Vec<(usize, usize, &specsplit_orchestrator::RoundRecord)> = gens
        .iter()
        .enumerate()
        .flat_map(|(g, gen)| {
            gen.rounds
                .iter()
                .enumerate()
                .skip(1)
                .map(move |(i, r)| (g, i, r))
        })
        .collect();
    rounds.sort_by(|a, b| b.2.round_ms.total_cmp(&a.2.round_ms));
    rounds
        .iter()
        .take(SLOWEST_ROUNDS)
        .map(|&(g, i, r)| {
            json!({
                "generation": g, "round": i, "drafted": r.drafted, "accepted": r.accepted,
                "advised_depth": r.advised_depth, "round_ms": r.round_ms,
                "draft_ms": r.draft_ms, "draft_server_ms": r.draft_server_ms,
                "draft_model_ms": r.draft_model_ms, "verify_ms": r.verify_ms,
                "verify_server_ms": r.verify_server_ms, "verify_model_ms": r.verify_model_ms,
            })
        })
        .collect()
}

/// One result row: `n` sessions of `mode` generated `gens` in `wall_s` seconds; `alone` holds
/// each prompt's output generated alone.
fn row(
    mode: Mode,
    n: usize,
    (gens, wall_s): (&[Generation], f64),
    alone: &[Generation],
    passes: Passes,
) -> Value {
    let tokens: usize = gens.iter().map(|g| g.token_ids.len()).sum();
    let lat = token_latencies_ms(gens);
    let identical = gens
        .iter()
        .zip(alone)
        .filter(|(g, a)| g.token_ids == a.token_ids)
        .count();
    let rounds: Vec<_> = gens.iter().flat_map(|g| g.rounds.iter().skip(1)).collect();
    let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
    let advised: Vec<f64> = rounds
        .iter()
        .filter_map(|r| r.advised_depth.map(|d| d as f64))
        .collect();
    // Every round verifies once; a round drafted by the draft worker drafted once.
    let verifies: usize = gens.iter().map(|g| g.rounds.len()).sum();
    let drafted: Vec<_> = rounds.iter().filter(|r| r.draft_server_ms > 0.0).collect();
    let drafts = gens
        .iter()
        .flat_map(|g| &g.rounds)
        .filter(|r| r.draft_server_ms > 0.0)
        .count();
    let load_rounds = rounds
        .iter()
        .filter(|r| r.no_draft == Some(specsplit_orchestrator::NoDraft::Load))
        .count();
    json!({
        "sessions": n,
        "mode": mode_name(mode),
        "generations": gens.len(),
        "tokens": tokens,
        "wall_s": wall_s,
        "aggregate_tok_per_s": ratio(tokens as f64, wall_s),
        "p50_tpot_ms": util::percentile(&lat, 0.5),
        "p99_tpot_ms": util::percentile(&lat, 0.99),
        "mean_ttft_ms": ratio(gens.iter().map(|g| g.stats.ttft_ms).sum(), gens.len() as f64),
        "max_ttft_ms": gens.iter().map(|g| g.stats.ttft_ms).fold(0.0, f64::max),
        "identical_to_alone": ratio(identical as f64, gens.len() as f64),
        "mean_drafted_depth": ratio(rounds.iter().map(|r| r.drafted as f64).sum(), rounds.len() as f64),
        "mean_accepted": ratio(rounds.iter().map(|r| r.accepted as f64).sum(), rounds.len() as f64),
        "mean_advised_depth": if advised.is_empty() { Value::Null } else { json!(ratio(advised.iter().sum(), advised.len() as f64)) },
        "load_target_only_share": ratio(load_rounds as f64, rounds.len() as f64),
        "mean_verify_model_ms": ratio(rounds.iter().map(|r| r.verify_model_ms).sum(), rounds.len() as f64),
        "mean_round_ms": ratio(rounds.iter().map(|r| r.round_ms).sum(), rounds.len() as f64),
        "mean_draft_model_ms": ratio(drafted.iter().map(|r| r.draft_model_ms).sum(), drafted.len() as f64),
        "verify_passes": passes.verify,
        "mean_verify_pass_sessions": ratio(verifies as f64, passes.verify as f64),
        "draft_passes": passes.draft,
        "mean_draft_pass_sessions": ratio(drafts as f64, passes.draft as f64),
        "draft_chain_shapes_made": passes.draft_shapes,
        "draft_chain_shapes_ms": passes.draft_shapes_ms,
        "round_parts_ms": round_parts(&rounds),
        "slowest_rounds": slowest_rounds(gens),
    })
}

/// Where the mean round of `rounds` went, in ms (the parts sum to the mean round): each
/// worker's model time, the rest of its reported handling (queueing for a shared pass, host
/// work), the transport to it and back (its call's wall time less its reported time), and the
/// orchestrator's own time between the calls; draft parts are 0 in rounds without a draft call.
fn round_parts(rounds: &[&specsplit_orchestrator::RoundRecord]) -> Value {
    let n = rounds.len().max(1) as f64;
    let mean = |f: &dyn Fn(&specsplit_orchestrator::RoundRecord) -> f64| {
        rounds.iter().map(|r| f(r)).sum::<f64>() / n
    };
    json!({
        "draft_model": mean(&|r| r.draft_model_ms),
        "draft_server_rest": mean(&|r| r.draft_server_ms - r.draft_model_ms),
        "draft_transport": mean(&|r| r.draft_ms - r.draft_server_ms),
        "verify_model": mean(&|r| r.verify_model_ms),
        "verify_server_rest": mean(&|r| r.verify_server_ms - r.verify_model_ms),
        "verify_transport": mean(&|r| r.verify_ms - r.verify_server_ms),
        "orchestrator": mean(&|r| r.round_ms - r.draft_ms - r.verify_ms),
    })
}

/// The model passes the workers' batchers ran during one run (0 where a worker does not batch).
#[derive(Debug, Clone, Copy, Default)]
struct Passes {
    verify: u64,
    draft: u64,
    /// Shapes of shared draft chains the draft worker made (each an eager pass and a capture).
    draft_shapes: u64,
    /// Host time the draft worker spent making, running eagerly and capturing those shapes.
    draft_shapes_ms: f64,
}

impl Passes {
    /// What ran since `before`.
    fn since(self, before: Passes) -> Passes {
        Passes {
            verify: self.verify - before.verify,
            draft: self.draft - before.draft,
            draft_shapes: self.draft_shapes - before.draft_shapes,
            draft_shapes_ms: self.draft_shapes_ms - before.draft_shapes_ms,
        }
    }
}

/// The passes `target` and `draft` have run so far.
fn passes_so_far(target: Option<&Arc<VerifyBatcher>>, draft: Option<&Arc<DraftBatcher>>) -> Passes {
    Passes {
        verify: target.map_or(0, |b| b.stats().passes),
        draft: draft.map_or(0, |b| b.stats().passes),
        draft_shapes: draft.map_or(0, |b| b.engine().chain_shapes_made()),
        draft_shapes_ms: draft.map_or(0.0, |b| b.engine().chain_shapes_time().as_secs_f64() * 1e3),
    }
}

/// Per-run fields that [`median_run`] keeps for every run, as `<field>_runs`: what tells a
/// run that lost apart (sessions that fell into separate passes, a generation that started
/// late).
const PER_RUN: [&str; 3] = [
    "mean_drafted_depth",
    "mean_verify_pass_sessions",
    "max_ttft_ms",
];

/// The row of median throughput among `runs` (each run's row), with every run's throughput
/// in `aggregate_tok_per_s_runs` and each of [`PER_RUN`] in `<field>_runs` (in run order).
fn median_run(mut runs: Vec<Value>) -> Value {
    let rate = |r: &Value| r["aggregate_tok_per_s"].as_f64().unwrap_or(0.0);
    let all: Vec<f64> = runs.iter().map(rate).collect();
    let per_run: Vec<Vec<Value>> = PER_RUN
        .iter()
        .map(|k| runs.iter().map(|r| r[*k].clone()).collect())
        .collect();
    runs.sort_by(|a, b| rate(a).total_cmp(&rate(b)));
    let mut mid = runs.swap_remove(runs.len() / 2);
    mid["aggregate_tok_per_s_runs"] = json!(all);
    for (k, v) in PER_RUN.iter().zip(per_run) {
        mid[format!("{k}_runs")] = json!(v);
    }
    mid
}

/// Runs the load benchmark, prints its table and writes its report; returns the report.
pub async fn run(s: &LoadSettings) -> Result<Value> {
    if s.sessions.is_empty() || s.sessions.contains(&0) {
        bail!("--sessions takes positive counts");
    }
    if s.modes.is_empty() {
        bail!("--modes takes ar and/or spec");
    }
    let random = s.target.starts_with("random:") && s.draft.starts_with("random:");
    eprintln!("loading target {} and draft {} ...", s.target, s.draft);
    let target = load(s.target.clone(), s.device_target.clone(), s.dtype.clone()).await?;
    let draft = load_draft(&s.draft, &s.device_draft, &s.dtype, &target).await?;
    // Prompts for the most sessions, and for every generation of a run.
    let most = s
        .sessions
        .iter()
        .copied()
        .max()
        .unwrap_or(1)
        .max(s.generations);
    let prompts: Vec<Vec<u32>> = if random {
        let vocab = target.model.config().vocab_size;
        let eos = target.tokenizer.eos_token_ids();
        (0..most)
            .map(|i| util::random_ids(s.seed.wrapping_add(i as u64), s.prompt_tokens, vocab, eos))
            .collect()
    } else {
        text_prompts(None, most, &target)?
    };
    // Random weights: no EOS, so every generation runs max_tokens.
    let eos: Vec<u32> = if random {
        Vec::new()
    } else {
        target.tokenizer.eos_token_ids().to_vec()
    };
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let z = Sizing {
        max_context: longest + s.max_tokens + s.widths.len() + 16,
        max_tree_nodes: full_tree_size(&s.widths).max(1) + 8,
    };
    let limits = SessionLimits {
        max_sessions: 2 * most + 8,
        memory_budget_bytes: usize::MAX / 2,
        ttl: Duration::from_secs(600),
    };
    let target_model = Arc::new(target.model);
    let draft_model = Arc::new(draft.model);
    let t_info = info(
        target.name.clone(),
        &target_model,
        &eos,
        &s.device_target,
        &z,
    );
    let max_depth = t_info.max_tree_depth;
    let t_engine = Arc::new(
        TargetEngine::new(target_model.clone(), z.max_context)
            .with_spare_sessions(s.spare_sessions),
    );
    let t_exec = Execution::for_device(&s.device_target, None);
    let gate = s.load_gate.then(|| {
        let gate = LoadGate::new(max_depth).with_group_rows(t_engine.session_group_rows());
        Arc::new(LoadAdvisor::with_gate(gate))
    });
    let t_worker = TargetWorker::new(t_engine, limits, t_info)
        .with_execution(t_exec.clone())
        .with_load_gate(gate);
    let t_worker = if s.max_batch_sessions > 1 {
        t_worker.with_batching(BatchLimits {
            max_sessions: s.max_batch_sessions,
            max_rows: 2048,
        })
    } else {
        t_worker
    };
    let t_batcher = t_worker.batcher().cloned();
    let t_server = spawn_server("target", move |l, sd| serve_target(t_worker, l, sd)).await?;

    let base = GenerateConfig {
        max_tokens: s.max_tokens,
        temperature: 0.0,
        seed: 1,
        rpc_timeout_ms: s.rpc_timeout_ms,
        draft_timeout_ms: s.rpc_timeout_ms,
        ..GenerateConfig::default()
    };
    let ar_cfg = GenerateConfig {
        mode: Mode::Ar,
        ..base.clone()
    };
    let spec_cfg = GenerateConfig {
        mode: Mode::Spec,
        pipeline: s.pipeline,
        widths: s.widths.clone(),
        first_round_overlap: s.first_round_overlap,
        ..base.clone()
    };
    let opts = ConnectOptions {
        spin: s.client_spin,
        client_threads: s.client_threads,
        ..ConnectOptions::default()
    };
    let ar_orch = Arc::new(Orchestrator::connect_with_options(None, &t_server.addr, &opts).await?);

    // Each prompt alone, target-only: the reference of every measurement.
    eprintln!("{most} prompts alone (target-only) ...");
    let mut alone = Vec::with_capacity(most);
    for (i, p) in prompts.iter().enumerate() {
        let cfg = GenerateConfig {
            seed: base.seed.wrapping_add(i as u64),
            ..ar_cfg.clone()
        };
        alone.push(ar_orch.generate(p, &cfg, |_| {}).await?);
    }

    let mut engine = DraftEngine::new(draft_model.clone(), eos.clone(), z.max_context)
        .with_spare_sessions(s.spare_sessions);
    if !s.static_draft_chains {
        engine = engine.with_static_chains(false);
    }
    let static_chains = engine.static_chains();
    let mut draft_label = draft.name.clone();
    if let Some(beta) = s.synthetic_beta {
        let references = prompts
            .iter()
            .zip(&alone)
            .map(|(p, g)| p.iter().chain(&g.token_ids).copied().collect())
            .collect();
        let oracle = SyntheticOracle::new(references, beta).with_coverage(s.coverage.clone());
        engine = engine.with_synthetic(oracle);
        draft_label = format!("{} (synthetic β={beta})", draft.name);
    }
    let d_info = info(draft_label.clone(), &draft_model, &eos, &s.device_draft, &z);
    let d_worker = DraftWorker::new(Arc::new(engine), limits, d_info)
        .with_execution(Execution::for_device(&s.device_draft, None));
    let d_worker = if s.draft_batch_sessions > 1 {
        d_worker.with_batching(BatchLimits {
            max_sessions: s.draft_batch_sessions,
            max_rows: 2048,
        })
    } else {
        d_worker
    };
    let d_batcher = d_worker.batcher().cloned();
    let d_server = spawn_server("draft", move |l, sd| serve_draft(d_worker, l, sd)).await?;
    let spec_orch = Arc::new(
        Orchestrator::connect_with_options(Some(&d_server.addr), &t_server.addr, &opts).await?,
    );

    let mut rows = Vec::new();
    let f = |r: &Value, k: &str| r[k].as_f64().unwrap_or(0.0);
    let setup = |mode: Mode| match mode {
        Mode::Ar => (&ar_orch, &ar_cfg),
        Mode::Spec => (&spec_orch, &spec_cfg),
    };
    for &n in &s.sessions {
        for &mode in &s.modes {
            let (orch, cfg) = setup(mode);
            for _ in 0..s.warmup {
                generate_concurrently(orch, &prompts, (n, n), cfg).await?;
            }
        }
        // The modes alternate run by run, so that a drift of the machine meets both alike.
        let mut runs: Vec<Vec<Value>> = vec![Vec::new(); s.modes.len()];
        for _ in 0..s.repeats.max(1) {
            for (m, &mode) in s.modes.iter().enumerate() {
                let (orch, cfg) = setup(mode);
                let before = passes_so_far(t_batcher.as_ref(), d_batcher.as_ref());
                let (gens, wall) =
                    generate_concurrently(orch, &prompts, (n, s.generations), cfg).await?;
                let passes = passes_so_far(t_batcher.as_ref(), d_batcher.as_ref()).since(before);
                let r = row(mode, n, (&gens, wall), &alone, passes);
                eprintln!(
                    "  {n} sessions {}: {:.1} tok/s, p50 {:.2} ms, p99 {:.2} ms, identical {:.2}; \
                     first token mean {:.1} ms, max {:.1} ms; round {:.2} ms, sessions a \
                     verify pass {:.2}, a draft pass {:.2}, new draft chain shapes {} ({:.1} ms)",
                    mode_name(mode),
                    f(&r, "aggregate_tok_per_s"),
                    f(&r, "p50_tpot_ms"),
                    f(&r, "p99_tpot_ms"),
                    f(&r, "identical_to_alone"),
                    f(&r, "mean_ttft_ms"),
                    f(&r, "max_ttft_ms"),
                    f(&r, "mean_round_ms"),
                    f(&r, "mean_verify_pass_sessions"),
                    f(&r, "mean_draft_pass_sessions"),
                    passes.draft_shapes,
                    passes.draft_shapes_ms,
                );
                eprintln!("    round parts (ms) {}", r["round_parts_ms"]);
                if mode == Mode::Spec {
                    for slow in r["slowest_rounds"].as_array().into_iter().flatten() {
                        eprintln!("    slow round {slow}");
                    }
                }
                runs[m].push(r);
            }
        }
        rows.extend(runs.into_iter().map(median_run));
    }
    d_server.stop().await;
    t_server.stop().await;

    println!("{}", table(&rows));
    let doc = json!({
        "meta": {
            "kind": "load",
            "target": target.name, "target_spec": s.target,
            "draft": draft_label, "draft_spec": s.draft,
            "device_target": s.device_target, "device_draft": s.device_draft,
            "dtype": if s.dtype.is_empty() { "default" } else { s.dtype.as_str() },
            "sessions": s.sessions,
            "generations_per_run": s.generations,
            "modes": s.modes.iter().map(|&m| mode_name(m)).collect::<Vec<_>>(),
            "prompt_tokens": prompts.iter().map(Vec::len).collect::<Vec<_>>(),
            "random_prompts": random,
            "max_tokens": s.max_tokens,
            "synthetic": s.synthetic_beta.is_some(), "beta": s.synthetic_beta,
            "synthetic_coverage": s.synthetic_beta.map(|_| s.coverage.clone()),
            "depth": s.widths.len(),
            "widths": s.widths,
            "pipeline": format!("{:?}", s.pipeline).to_lowercase(),
            "load_gate": s.load_gate,
            "max_batch_sessions": s.max_batch_sessions,
            "draft_batch_sessions": s.draft_batch_sessions,
            "spare_sessions": s.spare_sessions,
            "static_draft_chains": static_chains,
            "warmup_runs": s.warmup,
            "repeats": s.repeats.max(1),
            "transport": "gRPC over loopback, workers in-process, one target and one draft worker shared by all sessions",
            "greedy": true,
            "work_placement": format!("{:?}", t_exec.placement()).to_lowercase(),
            "client_spin": s.client_spin,
            "client_threads": ar_orch.client_threads(),
            "first_round_overlap": spec_cfg.overlaps_first_round(),
        },
        "rows": rows,
    });
    let (j, c) = crate::report::write(&s.out, &s.name, &doc)?;
    eprintln!("wrote {} and {}", j.display(), c.display());
    Ok(doc)
}

/// The rows as a plain-text table.
fn table(rows: &[Value]) -> String {
    let mut out = format!(
        "{:>8} {:>5} {:>12} {:>10} {:>10} {:>9} {:>8} {:>8}\n",
        "sessions", "mode", "agg tok/s", "p50 ms", "p99 ms", "identical", "drafted", "advised"
    );
    let f = |r: &Value, k: &str| r[k].as_f64().unwrap_or(0.0);
    for r in rows {
        let advised = r["mean_advised_depth"]
            .as_f64()
            .map_or("-".to_string(), |a| format!("{a:.2}"));
        out.push_str(&format!(
            "{:>8} {:>5} {:>12.1} {:>10.2} {:>10.2} {:>9.2} {:>8.2} {:>8}\n",
            r["sessions"].as_u64().unwrap_or(0),
            r["mode"].as_str().unwrap_or(""),
            f(r, "aggregate_tok_per_s"),
            f(r, "p50_tpot_ms"),
            f(r, "p99_tpot_ms"),
            f(r, "identical_to_alone"),
            f(r, "mean_drafted_depth"),
            advised,
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn tiny_models_share_one_target_and_match_their_outputs_alone() {
        let out = std::env::temp_dir().join(format!("specsplit-load-test-{}", std::process::id()));
        let s = LoadSettings {
            target: "random:tiny:7".into(),
            draft: "random:tiny:8".into(),
            device_target: "cpu".into(),
            device_draft: "cpu".into(),
            dtype: String::new(),
            sessions: vec![1, 2],
            generations: 3,
            modes: vec![Mode::Ar, Mode::Spec],
            prompt_tokens: 12,
            max_tokens: 16,
            synthetic_beta: Some(0.8),
            coverage: vec![0.5],
            widths: vec![1; 4],
            pipeline: Pipeline::Overlapped,
            load_gate: true,
            max_batch_sessions: 64,
            draft_batch_sessions: 64,
            spare_sessions: 1,
            static_draft_chains: true,
            warmup: 0,
            repeats: 2,
            rpc_timeout_ms: 30_000,
            seed: 3,
            client_spin: ClientSpin::Never,
            client_threads: 2,
            first_round_overlap: None,
            out: out.clone(),
            name: "load".into(),
        };
        let returned = run(&s).await.expect("load benchmark");
        let doc: Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("load.json")).unwrap()).unwrap();
        assert_eq!(doc["rows"].as_array().map(Vec::len), Some(4));
        assert_eq!(doc["meta"], returned["meta"]);
        assert_eq!(doc["meta"]["kind"], "load");
        assert_eq!(doc["meta"]["synthetic"], true);
        let rows = doc["rows"].as_array().unwrap();
        let keys: Vec<(u64, &str)> = rows
            .iter()
            .map(|r| (r["sessions"].as_u64().unwrap(), r["mode"].as_str().unwrap()))
            .collect();
        assert_eq!(keys, [(1, "ar"), (1, "spec"), (2, "ar"), (2, "spec")]);
        assert_eq!(doc["meta"]["generations_per_run"], 3);
        for r in rows {
            // Three generations a run, one or two at a time, each matching its prompt alone.
            assert_eq!(r["identical_to_alone"], 1.0, "{r}");
            assert_eq!(r["generations"].as_u64(), Some(3), "{r}");
            assert_eq!(r["tokens"].as_u64(), Some(16 * 3), "{r}");
            for k in ["aggregate_tok_per_s", "p50_tpot_ms", "p99_tpot_ms"] {
                assert!(r[k].as_f64().is_some_and(|v| v > 0.0), "{k}: {r}");
            }
            assert!(
                r["p99_tpot_ms"].as_f64() >= r["p50_tpot_ms"].as_f64(),
                "{r}"
            );
            // Two runs each; the row is the median's (of two, the faster).
            let runs: Vec<f64> = r["aggregate_tok_per_s_runs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_f64().unwrap())
                .collect();
            assert_eq!(runs.len(), 2, "{r}");
            let best = runs.iter().copied().fold(f64::MIN, f64::max);
            assert_eq!(r["aggregate_tok_per_s"].as_f64(), Some(best), "{r}");
            // Each run's mean drafted depth, in the same order: the row's is its run's.
            let depths = r["mean_drafted_depth_runs"].as_array().unwrap();
            assert_eq!(depths.len(), 2, "{r}");
            let at = runs.iter().position(|&v| v == best).unwrap();
            assert_eq!(depths[at], r["mean_drafted_depth"], "{r}");
            for k in PER_RUN {
                let each = r[format!("{k}_runs")].as_array().unwrap();
                assert_eq!(each.len(), 2, "{k}: {r}");
                assert_eq!(each[at], r[k], "{k}: {r}");
            }
            // The latest first token is no earlier than the mean.
            assert!(
                r["max_ttft_ms"].as_f64() >= r["mean_ttft_ms"].as_f64(),
                "{r}"
            );
            let slow = r["slowest_rounds"].as_array().unwrap();
            assert!(!slow.is_empty() && slow.len() <= SLOWEST_ROUNDS, "{r}");
            // The round's parts sum to the mean round, the models' parts to their means.
            let parts = r["round_parts_ms"].as_object().unwrap();
            let sum: f64 = parts.values().map(|v| v.as_f64().unwrap()).sum();
            let round = r["mean_round_ms"].as_f64().unwrap();
            assert!(
                (sum - round).abs() < 1e-6 * round.max(1.0),
                "{sum} vs {round}: {r}"
            );
            assert_eq!(parts["verify_model"], r["mean_verify_model_ms"], "{r}");
            assert!(parts["verify_model"].as_f64().unwrap() > 0.0, "{r}");
            // Each verify pass holds one to `sessions` sessions' rounds; one session alone
            // has a pass to itself every round.
            let n = r["sessions"].as_f64().unwrap();
            let per_pass = r["mean_verify_pass_sessions"].as_f64().unwrap();
            assert!(r["verify_passes"].as_u64().unwrap() > 0, "{r}");
            assert!((1.0..=n).contains(&per_pass), "{r}");
            if n == 1.0 {
                assert_eq!(per_pass, 1.0, "{r}");
            }
            // On the CPU no chains grow together from CUDA graphs: no shape is made.
            assert_eq!(r["draft_chain_shapes_made"].as_u64(), Some(0), "{r}");
            let ms: Vec<f64> = slow
                .iter()
                .map(|x| x["round_ms"].as_f64().unwrap())
                .collect();
            assert!(ms.windows(2).all(|w| w[0] >= w[1]), "{ms:?}");
        }
        assert_eq!(doc["meta"]["repeats"], 2);
        let _ = std::fs::remove_dir_all(&out);
    }
}
