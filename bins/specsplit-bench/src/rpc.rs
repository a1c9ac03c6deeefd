//! `rpc`: what one gRPC call between the orchestrator and a worker costs on loopback beyond
//! the worker's own reported handling time (`TelemetryMetadata.wall_time_ms`).
//!
//! The real draft and target services run in-process on loopback (port 0) over a small model
//! (default `random:tiny`, the draft identical to the target so every draft token is
//! accepted); the real orchestrator runs greedy generations and its per-round records give,
//! per RPC, client round trip − server wall time (`draft_ms − draft_server_ms`,
//! `verify_ms − verify_server_ms`) and per round `round_ms − draft_server_ms −
//! verify_server_ms` (what `GenerationStats::round_overhead_ms` averages). A bare `Ping` gives
//! the transport floor (no model, no session, no blocking-pool hop). In-process component
//! timings (protobuf encode/decode of the round's messages, tree conversion, a blocking-pool
//! round trip) break the rest down.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use prost::Message;
use serde_json::{json, Value};
use specsplit_core::tree::{TokenTree, TreeLimits};
use specsplit_orchestrator::{
    ClientSpin, GenerateConfig, Mode, Orchestrator, Pipeline, RoundRecord,
};
use specsplit_proto::convert::TreeWire;
use specsplit_proto::target_service_client::TargetServiceClient;
use specsplit_proto::{
    DraftRequest, PingRequest, TelemetryMetadata, VerifyRequest, VerifyResponse,
};
use specsplit_workers::draft::DraftEngine;
use specsplit_workers::service::{
    serve_draft, serve_target, DraftWorker, Execution, TargetWorker, WorkerInfo,
};
use specsplit_workers::target::TargetEngine;
use tonic::transport::Endpoint;

use crate::e2e::{limits, load, load_draft, spawn_server, Sizing};
use crate::util;

/// Arguments of the `rpc` subcommand.
#[derive(clap::Args, Debug)]
pub struct RpcArgs {
    /// Target model spec.
    #[arg(long, default_value = "random:tiny")]
    target: String,
    /// Draft model spec (a random draft takes the target's vocabulary size).
    #[arg(long, default_value = "random:tiny")]
    draft: String,
    /// Device of both models: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Dtype of both models (default: f32 on CPU, bf16 on CUDA).
    #[arg(long, default_value = "")]
    dtype: String,
    /// Sequence lengths (prompt tokens) at which rounds are measured.
    #[arg(long, value_delimiter = ',', default_value = "32,512,2048")]
    contexts: Vec<usize>,
    /// Measured rounds per generation.
    #[arg(long, default_value_t = 200)]
    rounds: usize,
    /// Rounds dropped at the start of each generation.
    #[arg(long, default_value_t = 10)]
    warmup: usize,
    /// Chain depth of the speculative rounds.
    #[arg(long, default_value_t = 4)]
    depth: usize,
    /// Bare pings timed.
    #[arg(long, default_value_t = 500)]
    pings: usize,
    /// Tokio runtime: multi (the multi-thread runtime, as `e2e` and the CLI use) or current.
    #[arg(long, default_value = "multi")]
    runtime: String,
    /// Worker threads of the multi-thread runtime (0 = one per CPU, tokio's default).
    #[arg(long, default_value_t = 0)]
    worker_threads: usize,
    /// Busy-poll the orchestrator's sockets while a request is in flight: auto (once a worker
    /// reports a CUDA device), always or never.
    #[arg(long, value_name = "auto|always|never", default_value = "auto")]
    client_spin: ClientSpin,
    /// Output directory.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Base name of the output files.
    #[arg(long, default_value = "rpc")]
    name: String,
    /// Milliseconds the in-process workers busy-poll after each answer (0: never)
    /// [default: 20 on CUDA, 0 on the CPU].
    #[arg(long, value_name = "MS")]
    spin_ms: Option<u64>,
}

/// Runs the `rpc` subcommand on the runtime its arguments ask for.
pub fn main(a: RpcArgs) -> Result<()> {
    let (mut builder, runtime) = match a.runtime.as_str() {
        "multi" => {
            let mut b = tokio::runtime::Builder::new_multi_thread();
            if a.worker_threads > 0 {
                b.worker_threads(a.worker_threads);
            }
            let n = if a.worker_threads > 0 {
                a.worker_threads.to_string()
            } else {
                "default".into()
            };
            (b, format!("multi_thread (workers: {n})"))
        }
        "current" => (
            tokio::runtime::Builder::new_current_thread(),
            "current_thread".to_string(),
        ),
        other => anyhow::bail!("unknown --runtime '{other}': use multi or current"),
    };
    let s = RpcSettings {
        target: a.target,
        draft: a.draft,
        device: a.device,
        dtype: a.dtype,
        contexts: a.contexts,
        rounds: a.rounds,
        warmup: a.warmup,
        depth: a.depth,
        pings: a.pings,
        runtime,
        client_spin: a.client_spin,
        out: a.out,
        name: a.name,
        spin_ms: a.spin_ms,
    };
    builder.enable_all().build()?.block_on(run(&s))
}

/// Settings of the `rpc` subcommand.
#[derive(Debug, Clone)]
pub struct RpcSettings {
    /// Target model spec.
    pub target: String,
    /// Draft model spec.
    pub draft: String,
    /// Device of both models.
    pub device: String,
    /// Dtype of both models ("" = device default).
    pub dtype: String,
    /// Sequence lengths (prompt tokens) at which rounds are measured.
    pub contexts: Vec<usize>,
    /// Measured rounds per generation.
    pub rounds: usize,
    /// Rounds dropped at the start of each generation (the first one carries the prefill).
    pub warmup: usize,
    /// Chain depth of the speculative rounds.
    pub depth: usize,
    /// Bare pings timed.
    pub pings: usize,
    /// Runtime description for the report (the runtime itself is built by the caller).
    pub runtime: String,
    /// When the orchestrator's client runtime busy-polls.
    pub client_spin: ClientSpin,
    /// Output directory.
    pub out: PathBuf,
    /// Base name of the output files.
    pub name: String,
    /// The workers' busy-polling after each answer, in milliseconds (None: the device's
    /// default).
    pub spin_ms: Option<u64>,
}

/// Minimum, median, 90th percentile and mean of a sample, in milliseconds.
fn stats(xs: &[f64]) -> Value {
    let s = util::summarize(xs);
    let min = xs.iter().copied().fold(f64::INFINITY, f64::min);
    json!({
        "n": xs.len(),
        "min": if xs.is_empty() { 0.0 } else { min },
        "median": s.median,
        "p90": s.p90,
        "mean": s.mean,
    })
}

fn median(xs: &[f64]) -> f64 {
    util::summarize(xs).median
}

/// Per-round samples of one configuration.
#[derive(Default)]
struct Samples {
    draft_rpc: Vec<f64>,
    verify_rpc: Vec<f64>,
    round_overhead: Vec<f64>,
    draft_server: Vec<f64>,
    verify_server: Vec<f64>,
}

impl Samples {
    fn add(&mut self, r: &RoundRecord) {
        if r.drafted > 0 {
            self.draft_rpc.push(r.draft_ms - r.draft_server_ms);
            self.draft_server.push(r.draft_server_ms);
        }
        self.verify_rpc.push(r.verify_ms - r.verify_server_ms);
        self.verify_server.push(r.verify_server_ms);
        self.round_overhead.push(r.overhead_ms());
    }

    fn row(&self) -> Value {
        json!({
            "draft_rpc_overhead_ms": stats(&self.draft_rpc),
            "verify_rpc_overhead_ms": stats(&self.verify_rpc),
            "round_overhead_ms": stats(&self.round_overhead),
            "draft_server_ms": stats(&self.draft_server),
            "verify_server_ms": stats(&self.verify_server),
        })
    }
}

fn worker_info(name: &str, vocab: usize, device: &str, z: &Sizing) -> WorkerInfo {
    WorkerInfo {
        model_name: name.to_string(),
        vocab_size: vocab,
        // No EOS: every generation runs its full length.
        eos_token_ids: Vec::new(),
        max_context: z.max_context,
        max_tree_nodes: z.max_tree_nodes,
        max_tree_depth: specsplit_proto::codec::MAX_WIRE_TREE_DEPTH,
        max_prompt_len: z.max_context,
        device: device.to_string(),
    }
}

/// Median time of one call of `f`, timed over batches of `per_batch` calls.
fn per_op_ms(batches: usize, per_batch: usize, mut f: impl FnMut()) -> f64 {
    let mut xs = Vec::with_capacity(batches);
    for _ in 0..batches {
        let t = Instant::now();
        for _ in 0..per_batch {
            f();
        }
        xs.push(t.elapsed().as_secs_f64() * 1e3 / per_batch as f64);
    }
    median(&xs)
}

fn chain(depth: usize, vocab: usize) -> TokenTree {
    let mut t = TokenTree::new();
    let mut parent = None;
    for i in 0..depth {
        let tok = (i * 7 % vocab) as u32;
        let n = match parent {
            None => t.push_root(tok, -0.5),
            Some(p) => t.push_child(p, tok, -0.5),
        }
        .expect("a chain is breadth-first");
        parent = Some(n);
    }
    t
}

/// In-process costs of the pieces of one round (no network).
async fn components(s: &RpcSettings, vocab: usize) -> Value {
    let mut rows = Vec::new();
    let tree = chain(s.depth, vocab);
    let limits = TreeLimits {
        max_nodes: 1 << 16,
        max_depth: 1 << 10,
        vocab_size: vocab,
    };
    rows.push(
        json!({"what": format!("TokenTree::to_proto, chain {}", s.depth),
        "ms": per_op_ms(21, 2000, || { std::hint::black_box(tree.to_proto()); })}),
    );
    let (nodes, dist) = tree.to_proto();
    rows.push(
        json!({"what": format!("TokenTree::from_proto, chain {}", s.depth),
        "ms": per_op_ms(21, 2000, || {
            std::hint::black_box(TokenTree::from_proto(&nodes, dist.as_ref(), false, &limits).ok());
        })}),
    );
    let verify = VerifyRequest {
        request_id: "gen-00000000000000000000000000000000-17".into(),
        session_id: "gen-00000000000000000000000000000000".into(),
        draft_tree: nodes.clone(),
        new_token_ids: vec![5],
        expected_prefix_length: 1000,
        sampling: Some(Default::default()),
        ..Default::default()
    };
    rows.push(
        json!({"what": format!("VerifyRequest (delta, chain {}) encode+decode", s.depth),
        "bytes": verify.encoded_len(),
        "ms": per_op_ms(21, 2000, || {
            let b = verify.encode_to_vec();
            std::hint::black_box(VerifyRequest::decode(b.as_slice()).ok());
        })}),
    );
    let resp = VerifyResponse {
        request_id: verify.request_id.clone(),
        accepted_token_ids: vec![1; s.depth],
        accepted_node_indices: (0..s.depth as i32).collect(),
        telemetry: Some(TelemetryMetadata {
            span_id: "0123456789abcdef".into(),
            wall_time_ms: 1.0,
            model_time_ms: 1.0,
            tokens_processed: 5,
            device: "cuda:0".into(),
            one_off_setup: false,
        }),
        session_id: verify.session_id.clone(),
        has_correction: true,
        ..Default::default()
    };
    rows.push(json!({"what": "VerifyResponse encode+decode",
    "bytes": resp.encoded_len(),
    "ms": per_op_ms(21, 2000, || {
        let b = resp.encode_to_vec();
        std::hint::black_box(VerifyResponse::decode(b.as_slice()).ok());
    })}));
    for &len in &s.contexts {
        let seq = util::random_ids(1, len, vocab, &[]);
        let req = DraftRequest {
            request_id: verify.request_id.clone(),
            session_id: verify.session_id.clone(),
            prompt_token_ids: seq.iter().map(|&t| t as i32).collect(),
            max_draft_len: s.depth as i32,
            num_beams: 1,
            temperature: Some(0.0),
            tree_widths: vec![1; s.depth],
            sampling: Some(Default::default()),
            ..Default::default()
        };
        rows.push(
            json!({"what": format!("DraftRequest ({len} tokens) build+encode+decode"),
            "bytes": req.encoded_len(),
            "ms": per_op_ms(21, 200, || {
                let r = DraftRequest {
                    prompt_token_ids: seq.iter().map(|&t| t as i32).collect(),
                    ..req.clone()
                };
                let b = r.encode_to_vec();
                std::hint::black_box(DraftRequest::decode(b.as_slice()).ok());
            })}),
        );
    }
    let mut hops = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        let _ = tokio::task::spawn_blocking(|| std::hint::black_box(1)).await;
        hops.push(t.elapsed().as_secs_f64() * 1e3);
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    rows.push(
        json!({"what": "tokio spawn_blocking round trip (idle pool, after 0.2 ms sleep)",
        "ms": median(&hops), "stats": stats(&hops)}),
    );
    let m = Arc::new(tokio::sync::Mutex::new(0u64));
    let mut locks = Vec::new();
    for _ in 0..21 {
        let t = Instant::now();
        for _ in 0..1000 {
            let mut g = m.clone().lock_owned().await;
            *g += 1;
        }
        locks.push(t.elapsed().as_secs_f64() * 1e3 / 1000.0);
    }
    rows.push(json!({"what": "tokio Mutex::lock_owned (uncontended)", "ms": median(&locks)}));
    Value::Array(rows)
}

/// Runs the benchmark and writes its report.
pub async fn run(s: &RpcSettings) -> Result<()> {
    anyhow::ensure!(s.depth > 0, "--depth must be positive");
    anyhow::ensure!(s.rounds > 0, "--rounds must be positive");
    eprintln!("loading target {} and draft {} ...", s.target, s.draft);
    let target = load(s.target.clone(), s.device.clone(), s.dtype.clone()).await?;
    let draft = load_draft(&s.draft, &s.device, &s.dtype, &target).await?;
    let vocab = target.model.config().vocab_size;
    let per_gen = (s.warmup + s.rounds) * (s.depth + 1);
    let longest = s.contexts.iter().copied().max().unwrap_or(0);
    let z = Sizing {
        max_context: longest + per_gen + s.depth + 16,
        max_tree_nodes: s.depth + 8,
    };
    let exec = Execution::for_device(&s.device, s.spin_ms.map(Duration::from_millis));
    let t_worker = TargetWorker::new(
        Arc::new(TargetEngine::new(Arc::new(target.model), z.max_context)),
        limits(),
        worker_info(&target.name, vocab, &s.device, &z),
    )
    .with_execution(exec.clone());
    let d_worker = DraftWorker::new(
        Arc::new(DraftEngine::new(
            Arc::new(draft.model),
            Vec::new(),
            z.max_context,
        )),
        limits(),
        worker_info(&draft.name, vocab, &s.device, &z),
    )
    .with_execution(exec.clone());
    let t_server = spawn_server("target", move |l, sd| serve_target(t_worker, l, sd)).await?;
    let d_server = spawn_server("draft", move |l, sd| serve_draft(d_worker, l, sd)).await?;

    // Transport floor: a bare Ping (no model, session or blocking pool), same channel settings
    // as the orchestrator's.
    let channel = Endpoint::from_shared(format!("http://{}", t_server.addr))?
        .tcp_nodelay(true)
        .connect()
        .await
        .context("connecting to the target")?;
    let mut client = TargetServiceClient::new(channel);
    let mut pings = Vec::with_capacity(s.pings);
    for i in 0..s.pings + s.pings / 10 + 1 {
        let t = Instant::now();
        client.ping(PingRequest {}).await?;
        if i > s.pings / 10 {
            pings.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    eprintln!("ping round trip: median {:.3} ms", median(&pings));
    let mut rows = vec![json!({
        "label": "ping", "context": 0, "rpc_ms": stats(&pings),
    })];

    let ar_orch = Orchestrator::connect_with(None, &t_server.addr, s.client_spin).await?;
    let spec_orch =
        Orchestrator::connect_with(Some(&d_server.addr), &t_server.addr, s.client_spin).await?;
    for &len in &s.contexts {
        let prompt = util::random_ids(42 + len as u64, len.max(1), vocab, &[]);
        let configs = [
            ("target-only", Mode::Ar, s.warmup + s.rounds),
            ("spec-sequential", Mode::Spec, per_gen),
        ];
        for (label, mode, max_tokens) in configs {
            let cfg = GenerateConfig {
                mode,
                pipeline: Pipeline::Sequential,
                widths: vec![1; s.depth],
                max_tokens,
                temperature: 0.0,
                seed: 1,
                ..GenerateConfig::default()
            };
            let o = if mode == Mode::Ar {
                &ar_orch
            } else {
                &spec_orch
            };
            let g = o.generate(&prompt, &cfg, |_| {}).await?;
            let mut smp = Samples::default();
            for r in g.rounds.iter().skip(s.warmup) {
                smp.add(r);
            }
            eprintln!(
                "{label:>16} ctx {len:>5}: per RPC client−server median draft {:.3} ms, verify \
                 {:.3} ms; round overhead median {:.3} ms (mean {:.3}); server draft {:.3} ms, \
                 verify {:.3} ms",
                median(&smp.draft_rpc),
                median(&smp.verify_rpc),
                median(&smp.round_overhead),
                util::summarize(&smp.round_overhead).mean,
                median(&smp.draft_server),
                median(&smp.verify_server),
            );
            let mut row = json!({
                "label": label, "context": len, "depth": if mode == Mode::Ar { 0 } else { s.depth },
                "rounds": smp.verify_rpc.len(),
                "acceptance_rate": g.stats.acceptance_rate,
            });
            if let (Some(a), Value::Object(b)) = (row.as_object_mut(), smp.row()) {
                a.extend(b);
            }
            rows.push(row);
        }
    }
    d_server.stop().await;
    t_server.stop().await;
    let components = components(s, vocab).await;
    for c in components.as_array().into_iter().flatten() {
        eprintln!(
            "  {:<64} {:.4} ms",
            c["what"].as_str().unwrap_or(""),
            c["ms"].as_f64().unwrap_or(0.0)
        );
    }
    let doc = json!({
        "meta": {
            "kind": "rpc",
            "target": target.name, "draft": draft.name, "device": s.device,
            "dtype": if s.dtype.is_empty() { "default" } else { s.dtype.as_str() },
            "runtime": s.runtime, "client_spin": s.client_spin,
            "work_placement": format!("{:?}", exec.placement()).to_lowercase(),
            "server_spin_ms": exec.spin().as_secs_f64() * 1e3,
            "depth": s.depth, "rounds": s.rounds, "warmup": s.warmup,
            "cpus": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
            "transport": "gRPC over loopback, workers in-process",
            "definition": "rpc overhead = client round trip - server wall_time_ms; round \
                           overhead = round_ms - draft_server_ms - verify_server_ms - predraft_wait_ms",
        },
        "rows": rows,
        "components": components,
    });
    let (j, c) = crate::report::write(&s.out, &s.name, &doc)?;
    eprintln!("wrote {} and {}", j.display(), c.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_split_rounds_into_rpc_and_round_overheads() {
        let mut s = Samples::default();
        s.add(&RoundRecord {
            drafted: 4,
            tree_nodes: 4,
            accepted: 4,
            emitted: vec![1; 5],
            draft_ms: 3.0,
            draft_server_ms: 2.5,
            verify_ms: 5.0,
            verify_server_ms: 4.0,
            draft_model_ms: 0.0,
            verify_model_ms: 0.0,
            round_ms: 8.75,
            overlap_hit: None,
            predraft_wait_ms: 0.0,
            predraft_ms: 0.0,
            predraft_lag_ms: 0.0,
            predraft_server_ms: 0.0,
            predraft_model_ms: 0.0,
            no_draft: None,
            ..RoundRecord::default()
        });
        s.add(&RoundRecord {
            drafted: 0,
            tree_nodes: 0,
            accepted: 0,
            emitted: vec![1],
            draft_ms: 0.0,
            draft_server_ms: 0.0,
            verify_ms: 2.0,
            verify_server_ms: 1.5,
            draft_model_ms: 0.0,
            verify_model_ms: 0.0,
            round_ms: 2.25,
            overlap_hit: None,
            predraft_wait_ms: 0.0,
            predraft_ms: 0.0,
            predraft_lag_ms: 0.0,
            predraft_server_ms: 0.0,
            predraft_model_ms: 0.0,
            no_draft: None,
            ..RoundRecord::default()
        });
        assert_eq!(s.draft_rpc, vec![0.5]);
        assert_eq!(s.verify_rpc, vec![1.0, 0.5]);
        assert_eq!(s.round_overhead, vec![2.25, 0.75]);
        let r = s.row();
        assert_eq!(r["draft_rpc_overhead_ms"]["n"], 1);
        assert_eq!(r["verify_rpc_overhead_ms"]["min"], 0.5);
    }

    #[test]
    fn chains_have_the_requested_depth() {
        let t = chain(4, 10);
        assert_eq!(t.len(), 4);
        assert_eq!(t.max_depth(), 3);
        assert_eq!(t.tokens(), &[0, 7, 4, 1]);
    }
}
