//! `forward`: latency of one target forward pass over a cached prefix (decode, chain
//! verification, tree verification) per context length, and the decode memory roofline.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::{json, Value};
use specsplit_core::cache::SessionCache;
use specsplit_core::mask::TreeMask;
use specsplit_core::sampling::SamplingParams;
use specsplit_core::tree::TokenTree;
use specsplit_models::cpu_attention::TreeRows;
use specsplit_models::loader::{load_model, LoadOptions};
use specsplit_models::step::{
    DecodeStepper, ExactStepper, SessionChainsStepper, SessionRowsStepper,
};
use specsplit_models::transformer::{SessionChain, SessionChainRows, Transformer};
use specsplit_models::SessionPass;
use specsplit_workers::engine_session::SessionEngine;
use specsplit_workers::launch::{parse_device, parse_dtype};
use specsplit_workers::target::{Prefix, TargetEngine};

use crate::util::{self, SplitMix};

/// Settings of the `forward` subcommand (lists already resolved against `--quick`).
#[derive(Debug, Clone)]
pub struct ForwardSettings {
    /// Model spec.
    pub model: String,
    /// Device (`cpu`, `cuda:N`).
    pub device: String,
    /// Dtype (`f32`, `f16`, `bf16`, "" = device default).
    pub dtype: String,
    /// Prefix lengths.
    pub contexts: Vec<usize>,
    /// Chain lengths verified.
    pub chains: Vec<usize>,
    /// Tree sizes verified.
    pub trees: Vec<usize>,
    /// Chains grown at once below a forest's roots (pre-draft passes).
    pub growth_rows: Vec<usize>,
    /// Sessions verified together in one multi-session pass.
    pub sessions: Vec<usize>,
    /// Timed iterations per measurement.
    pub iters: usize,
    /// Untimed iterations before them.
    pub warmup: usize,
    /// Size of the bandwidth-test buffer, MiB.
    pub bw_mib: usize,
    /// The kernel paths the model runs.
    pub kernels: specsplit_models::fused::KernelOptions,
    /// Output directory.
    pub out: PathBuf,
    /// Base name of the output files.
    pub name: String,
    /// Whether the engine rounds time each verification pass on the device.
    pub device_timing: bool,
}

/// Steps per timed chain of the fixed-shape step.
const STATIC_CHAIN: usize = 8;

/// Levels of each timed chain growth.
const GROWTH_DEPTH: usize = 4;

/// Chain tokens below each session's new token in the multi-session verify passes.
const SESSION_CHAIN: usize = 4;

/// Prefill chunk: long prefixes are written in pieces to bound the attention scratch.
const PREFILL_CHUNK: usize = 512;

fn dtype_bytes(d: DType) -> u64 {
    d.size_in_bytes() as u64
}

/// Times `f` `iters` times after `warmup` untimed calls; `f` must synchronise the device.
fn time_ms(iters: usize, warmup: usize, mut f: impl FnMut() -> Result<()>) -> Result<Vec<f64>> {
    for _ in 0..warmup {
        f()?;
    }
    let mut ms = Vec::with_capacity(iters);
    for _ in 0..iters.max(1) {
        let t = Instant::now();
        f()?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(ms)
}

/// Device copy bandwidth in bytes/s (read + write counted, as for a D2D memcpy): a `mib` MiB
/// buffer copied into another preallocated one with `Tensor::slice_set` (a contiguous
/// device-to-device memcpy on CUDA, a memcpy on CPU; no allocation inside the timing).
fn copy_bandwidth(dev: &Device, mib: usize, iters: usize) -> Result<(f64, util::Summary)> {
    let bytes = mib.max(1) << 20;
    // `ones`, not `zeros`: both buffers must be really backed by memory.
    let src = Tensor::ones(bytes / 4, DType::F32, dev)?;
    let dst = Tensor::ones(bytes / 4, DType::F32, dev)?;
    dev.synchronize()?;
    let ms = time_ms(iters.max(3), 2, || {
        dst.slice_set(&src, 0, 0)?;
        dev.synchronize()?;
        Ok(())
    })?;
    let s = util::summarize(&ms);
    Ok((2.0 * bytes as f64 / (s.median / 1e3), s))
}

/// Device-to-device `cuMemcpyDtoDAsync` bandwidth in bytes/s (read + written counted, like
/// PyTorch's `copy_`), between two raw `mib` MiB allocations; `None` off CUDA.
fn memcpy_bandwidth(
    dev: &Device,
    mib: usize,
    iters: usize,
) -> Result<Option<(f64, util::Summary)>> {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(d) = dev {
        let bytes = mib.max(1) << 20;
        let stream = d.cuda_stream();
        let src = stream.alloc_zeros::<u8>(bytes)?;
        let mut dst = stream.alloc_zeros::<u8>(bytes)?;
        stream.synchronize()?;
        let ms = time_ms(iters.max(3), 2, || {
            stream.memcpy_dtod(&src, &mut dst)?;
            stream.synchronize()?;
            Ok(())
        })?;
        let s = util::summarize(&ms);
        return Ok(Some((2.0 * bytes as f64 / (s.median / 1e3), s)));
    }
    let _ = (dev, mib, iters);
    Ok(None)
}

fn u32s(v: &[u32], dev: &Device) -> Result<Tensor> {
    Ok(Tensor::new(v, dev)?)
}

/// Prefills `ids` into an emptied `cache`, in chunks; returns the wall time in ms.
fn prefill(m: &Transformer, cache: &mut SessionCache, ids: &[u32]) -> Result<f64> {
    let dev = m.device();
    cache.truncate(0)?;
    let t = Instant::now();
    for (c, chunk) in ids.chunks(PREFILL_CHUNK).enumerate() {
        let start = c * PREFILL_CHUNK;
        let pos: Vec<u32> = (start as u32..(start + chunk.len()) as u32).collect();
        let rows = u32s(&[chunk.len() as u32 - 1], dev)?;
        m.forward(&u32s(chunk, dev)?, &u32s(&pos, dev)?, None, cache, &rows)?;
    }
    dev.synchronize()?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

/// One verification-style forward of `tree` after `len` cached tokens (mask built and uploaded
/// inside, as the target engine does each round), all rows' logits, then rollback.
fn verify_once(
    m: &Transformer,
    cache: &mut SessionCache,
    len: usize,
    tree: &TokenTree,
) -> Result<()> {
    let dev = m.device();
    let mask = TreeMask::new(tree);
    let mask_t = mask.to_tensor(len, m.dtype(), dev)?;
    let pos = u32s(&mask.positions(len), dev)?;
    let rows: Vec<u32> = (0..tree.len() as u32).collect();
    m.forward(
        &u32s(tree.tokens(), dev)?,
        &pos,
        Some(&mask_t),
        cache,
        &u32s(&rows, dev)?,
    )?;
    cache.truncate(len)?;
    dev.synchronize()?;
    Ok(())
}

/// Runs the forward benchmark and writes its report.
pub fn run(s: &ForwardSettings) -> Result<()> {
    let device = parse_device(&s.device)?;
    let opts = LoadOptions {
        device: device.clone(),
        dtype: parse_dtype(&s.dtype)?,
    };
    eprintln!("loading {} on {} ({:?}) ...", s.model, s.device, s.kernels);
    let mut loaded = load_model(&s.model, &opts).with_context(|| format!("loading {}", s.model))?;
    loaded.model.set_kernel_options(s.kernels);
    let kernels = loaded.model.kernel_options();
    let model_name = loaded.name.clone();
    let model = std::sync::Arc::new(loaded.model);
    let m = &*model;
    let cfg = m.config().clone();
    let dsize = dtype_bytes(m.dtype());
    let pb = util::param_bytes(&cfg, dsize);
    let max_new = s
        .chains
        .iter()
        .chain(&s.trees)
        .copied()
        .chain(s.growth_rows.iter().map(|&n| n * GROWTH_DEPTH))
        .max()
        .unwrap_or(1)
        .max(1);
    let mut contexts: Vec<usize> = Vec::new();
    for &l in &s.contexts {
        if l == 0 || l + max_new > cfg.max_position_embeddings {
            eprintln!(
                "skipping context {l}: must be in 1..={}",
                cfg.max_position_embeddings - max_new
            );
        } else {
            contexts.push(l);
        }
    }
    if contexts.is_empty() {
        bail!("no usable context length");
    }
    let max_ctx = *contexts.iter().max().unwrap_or(&1);

    eprintln!("measuring copy bandwidth over {} MiB ...", s.bw_mib);
    let (kernel_bw, kernel_ms) = copy_bandwidth(&device, s.bw_mib, s.iters)?;
    eprintln!(
        "  slice_set copy kernel: {:.1} GB/s (median {:.3} ms)",
        kernel_bw / 1e9,
        kernel_ms.median
    );
    let memcpy = memcpy_bandwidth(&device, s.bw_mib, s.iters)?;
    if let Some((b, ms)) = &memcpy {
        eprintln!(
            "  cuMemcpyDtoD: {:.1} GB/s (median {:.3} ms)",
            b / 1e9,
            ms.median
        );
    }
    // The roofline uses the faster of the two: the device's real copy bandwidth.
    let (bw, bw_ms, bw_method) = match memcpy {
        Some((b, ms)) if b > kernel_bw => (
            b,
            ms,
            "cuMemcpyDtoDAsync between two raw allocations, median; bytes read + written",
        ),
        _ => (
            kernel_bw,
            kernel_ms,
            "Tensor::slice_set of an f32 buffer into a preallocated one, median; bytes read + written",
        ),
    };

    let mut cache = m.new_cache(max_ctx + max_new)?;
    let mut rng = SplitMix::new(0x5eed);
    let prefix = util::random_ids(1, max_ctx, cfg.vocab_size, &[]);
    let mut rows: Vec<Value> = Vec::new();
    let base = json!({
        "model": model_name,
        "spec": s.model,
        "device": s.device,
        "dtype": format!("{:?}", m.dtype()).to_lowercase(),
    });
    let row = |extra: Value| -> Value {
        let mut r = base.clone();
        if let (Some(r), Some(e)) = (r.as_object_mut(), extra.as_object()) {
            r.extend(e.clone());
        }
        r
    };
    let mut roofline_summary = Vec::new();
    for &l in &contexts {
        let prefill_ms = prefill(m, &mut cache, &prefix[..l])?;
        eprintln!("context {l}: prefill {prefill_ms:.1} ms");
        rows.push(row(json!({
            "context": l, "kind": "prefill", "tokens": l, "depth": 0,
            "median_ms": prefill_ms, "p10_ms": prefill_ms, "p90_ms": prefill_ms,
            "mean_ms": prefill_ms, "iters": 1,
            "tok_per_s": l as f64 / (prefill_ms / 1e3),
        })));

        // (a) decode one token.
        let tok = rng.token(cfg.vocab_size, &[]);
        let dev = device.clone();
        // Host time until forward() returns, before the device is synchronised: when it is close
        // to the whole step, the step is bound by kernel launches, not by the GPU.
        let mut enqueue_ms = Vec::new();
        let ms = time_ms(s.iters, s.warmup, || {
            let t = Instant::now();
            m.forward(
                &u32s(&[tok], &dev)?,
                &u32s(&[l as u32], &dev)?,
                None,
                &mut cache,
                &u32s(&[0], &dev)?,
            )?;
            enqueue_ms.push(t.elapsed().as_secs_f64() * 1e3);
            cache.truncate(l)?;
            dev.synchronize()?;
            Ok(())
        })?;
        let enqueue = util::summarize(&enqueue_ms[s.warmup.min(enqueue_ms.len())..]);
        let sm = util::summarize(&ms);
        let tok_s = 1e3 / sm.median;
        let roof_w = util::roofline_tok_s(bw, pb.streamed_bytes);
        let roof_kv = util::roofline_tok_s(bw, pb.streamed_bytes + util::kv_bytes(&cfg, l, dsize));
        eprintln!(
            "  decode {:.3} ms = {tok_s:.1} tok/s (host enqueue {:.3} ms); roofline {roof_kv:.1} tok/s ({:.1}%)",
            sm.median,
            enqueue.median,
            100.0 * tok_s / roof_kv
        );
        rows.push(row(json!({
            "context": l, "kind": "decode", "tokens": 1, "depth": 1,
            "median_ms": sm.median, "p10_ms": sm.p10, "p90_ms": sm.p90, "mean_ms": sm.mean,
            "iters": ms.len(), "tok_per_s": tok_s,
            "roofline_tok_s": roof_kv, "roofline_weights_only_tok_s": roof_w,
            "roofline_pct": 100.0 * tok_s / roof_kv,
            "host_enqueue_median_ms": enqueue.median,
        })));
        // (a'') the target's graph-replayed one-token step: the same bits as (a), one launch.
        let mut exact = json!({});
        if m.exact_step_fits(cache.capacity()) {
            let mut stepper = ExactStepper::new(m, cache.capacity())?;
            let ms = time_ms(s.iters, s.warmup.max(2), || {
                stepper.step(m, tok, &mut cache)?;
                cache.truncate(l)?;
                dev.synchronize()?;
                Ok(())
            })?;
            let ex = util::summarize(&ms);
            let ex_tok_s = 1e3 / ex.median;
            eprintln!(
                "  exact step {:.3} ms = {ex_tok_s:.1} tok/s ({}); roofline {:.1}%",
                ex.median,
                if stepper.uses_graph() {
                    "CUDA graph"
                } else {
                    "eager"
                },
                100.0 * ex_tok_s / roof_kv
            );
            if let Some(n) = stepper.graph_nodes(1) {
                eprintln!("    exact step graph: {n}");
            }
            rows.push(row(json!({
                "context": l, "kind": "exact_step", "tokens": 1, "depth": 1,
                "median_ms": ex.median, "p10_ms": ex.p10, "p90_ms": ex.p90, "mean_ms": ex.mean,
                "iters": ms.len(), "tok_per_s": ex_tok_s,
                "roofline_tok_s": roof_kv, "roofline_pct": 100.0 * ex_tok_s / roof_kv,
                "cuda_graph": stepper.uses_graph(),
            })));
            exact = json!({
                "exact_step_tok_s": ex_tok_s,
                "exact_step_roofline_pct": 100.0 * ex_tok_s / roof_kv,
            });
            // (a''') the target's verify pass of a chain draft as the worker runs it: a new
            // token and the chain below it, replayed from the stepper's graph for that row count.
            for &k in &s.chains {
                let n = k + 1;
                if l + n > cache.capacity() || !stepper.chain_fits(m, n) {
                    continue;
                }
                let chain: Vec<u32> = (0..n).map(|_| rng.token(cfg.vocab_size, &[])).collect();
                let ms = time_ms(s.iters, s.warmup.max(2), || {
                    stepper.step_chain(m, &chain, &mut cache)?;
                    cache.truncate(l)?;
                    dev.synchronize()?;
                    Ok(())
                })?;
                let ec = util::summarize(&ms);
                eprintln!(
                    "  exact chain {n:>2} rows: {:.3} ms ({:.3}x the exact step)",
                    ec.median,
                    ec.median / ex.median
                );
                rows.push(row(json!({
                    "context": l, "kind": "exact_chain", "tokens": n, "depth": k,
                    "median_ms": ec.median, "p10_ms": ec.p10, "p90_ms": ec.p90,
                    "mean_ms": ec.mean, "iters": ms.len(),
                    "cuda_graph": stepper.chain_graphs().contains(&n),
                })));
            }
        }
        let mut summary = json!({
            "context": l, "decode_tok_s": tok_s, "roofline_tok_s": roof_kv,
            "roofline_pct": 100.0 * tok_s / roof_kv,
        });
        if let (Some(a), Some(b)) = (summary.as_object_mut(), exact.as_object()) {
            a.extend(b.clone());
        }
        roofline_summary.push(summary);

        // (a') the fixed-shape greedy step that drafts chains (a CUDA graph replay on CUDA for
        // dense models): chains of STATIC_CHAIN steps, reported per step.
        let mut stepper = DecodeStepper::new(m, cache.capacity())?;
        let ms = time_ms(s.iters, s.warmup.max(2), || {
            stepper.start(tok, l)?;
            for _ in 0..STATIC_CHAIN {
                stepper.step(m, &cache)?;
            }
            dev.synchronize()?;
            Ok(())
        })?;
        let per_step: Vec<f64> = ms.iter().map(|x| x / STATIC_CHAIN as f64).collect();
        let st = util::summarize(&per_step);
        eprintln!(
            "  static step {:.3} ms ({}; {:.2}x the decode step)",
            st.median,
            if stepper.uses_graph() {
                "CUDA graph"
            } else {
                "eager"
            },
            sm.median / st.median
        );
        if let Some(n) = stepper.graph_nodes() {
            eprintln!("    static step graph: {n}");
        }
        rows.push(row(json!({
            "context": l, "kind": "static_step", "tokens": 1, "depth": 1,
            "median_ms": st.median, "p10_ms": st.p10, "p90_ms": st.p90, "mean_ms": st.mean,
            "iters": ms.len(), "tok_per_s": 1e3 / st.median,
            "cuda_graph": stepper.uses_graph(), "chain_steps": STATIC_CHAIN,
            "cache_capacity": cache.capacity(),
        })));

        // (a''') greedy chains grown below a forest's roots, every level one pass of all the
        // chains (a pre-draft's passes), reported per level.
        for &n in &s.growth_rows {
            if n == 0 || l + n * GROWTH_DEPTH > cache.capacity() || !stepper.grow_chains_fit(m, n) {
                continue;
            }
            let roots: Vec<u32> = (0..n).map(|_| rng.token(cfg.vocab_size, &[])).collect();
            let leads = vec![l; n];
            let ms = time_ms(s.iters, s.warmup.max(2), || {
                stepper.grow_chains(m, &cache, &roots, &leads, l, GROWTH_DEPTH, &[])?;
                dev.synchronize()?;
                Ok(())
            })?;
            let per_level: Vec<f64> = ms.iter().map(|x| x / GROWTH_DEPTH as f64).collect();
            let g = util::summarize(&per_level);
            eprintln!(
                "  chain growth {n:>2} rows: {:.3} ms a level ({:.2}x the static step)",
                g.median,
                g.median / st.median
            );
            rows.push(row(json!({
                "context": l, "kind": "chain_growth", "tokens": n, "depth": GROWTH_DEPTH,
                "median_ms": g.median, "p10_ms": g.p10, "p90_ms": g.p90, "mean_ms": g.mean,
                "iters": ms.len(), "per": "level",
            })));
        }

        // (b) chains and (c) trees.
        let mut shapes: Vec<(&str, TokenTree)> = Vec::new();
        for &k in &s.chains {
            let ids: Vec<u32> = (0..k).map(|_| rng.token(cfg.vocab_size, &[])).collect();
            shapes.push(("chain", TokenTree::chain(&ids)));
        }
        for &n in &s.trees {
            shapes.push((
                "tree",
                util::balanced_tree(n, |_| rng.token(cfg.vocab_size, &[])),
            ));
        }
        for (kind, tree) in &shapes {
            if tree.is_empty() {
                continue;
            }
            let ms = time_ms(s.iters, s.warmup, || verify_once(m, &mut cache, l, tree))?;
            let sm = util::summarize(&ms);
            eprintln!(
                "  {kind} {:>3} (depth {}): {:.3} ms (p10 {:.3}, p90 {:.3})",
                tree.len(),
                tree.max_depth() + 1,
                sm.median,
                sm.p10,
                sm.p90
            );
            rows.push(row(json!({
                "context": l, "kind": kind, "tokens": tree.len(), "depth": tree.max_depth() + 1,
                "median_ms": sm.median, "p10_ms": sm.p10, "p90_ms": sm.p90, "mean_ms": sm.mean,
                "iters": ms.len(), "tok_per_s": tree.len() as f64 / (sm.median / 1e3),
            })));
        }

        // (c') several sessions' verify rounds (a new token and a chain of SESSION_CHAIN) in one
        // multi-session pass, as the target's batched verification runs them: each session
        // its own cache of the same capacity holding the same prefix.
        for &ns in &s.sessions {
            let n = 1 + SESSION_CHAIN;
            if ns == 0 || l + n > cache.capacity() {
                continue;
            }
            let mut caches = (0..ns)
                .map(|_| m.new_cache(cache.capacity()))
                .collect::<Result<Vec<_>, _>>()?;
            for c in &mut caches {
                prefill(m, c, &prefix[..l])?;
            }
            let ids: Vec<u32> = (0..n).map(|_| rng.token(cfg.vocab_size, &[])).collect();
            let chain = TokenTree::chain(&ids);
            let mask = TreeMask::new(&chain);
            let positions = mask.positions(l);
            let want: Vec<u32> = (0..n as u32).collect();
            let mut enqueue_ms = Vec::new();
            let ms = time_ms(s.iters, s.warmup.max(2), || {
                let t = Instant::now();
                let mut parts: Vec<SessionPass<'_>> = caches
                    .iter_mut()
                    .map(|cache| SessionPass {
                        tokens: chain.tokens(),
                        positions: &positions,
                        tree: TreeRows {
                            mask: &mask,
                            prefix: l,
                            first_row: 0,
                        },
                        cache,
                        rows: &want,
                    })
                    .collect();
                m.forward_sessions(&mut parts)?;
                enqueue_ms.push(t.elapsed().as_secs_f64() * 1e3);
                for c in &mut caches {
                    c.truncate(l)?;
                }
                dev.synchronize()?;
                Ok(())
            })?;
            let sp = util::summarize(&ms);
            let enqueue = util::summarize(&enqueue_ms[s.warmup.max(2).min(enqueue_ms.len())..]);
            eprintln!(
                "  sessions pass {ns:>2} x {n} rows: {:.3} ms (host until it returns {:.3} ms)",
                sp.median, enqueue.median
            );
            rows.push(row(json!({
                "context": l, "kind": "sessions_pass", "tokens": ns * n, "depth": SESSION_CHAIN,
                "sessions": ns,
                "median_ms": sp.median, "p10_ms": sp.p10, "p90_ms": sp.p90, "mean_ms": sp.mean,
                "iters": ms.len(), "host_enqueue_median_ms": enqueue.median,
            })));
            // The same pass replayed from the target's graph of that shape.
            if m.session_rows_fit(cache.capacity(), ns, n) {
                let mut stepper = SessionRowsStepper::new();
                let ms = time_ms(s.iters, s.warmup.max(2), || {
                    let parts: Vec<SessionChainRows<'_>> = caches
                        .iter()
                        .map(|cache| SessionChainRows {
                            cache,
                            tokens: chain.tokens(),
                        })
                        .collect();
                    stepper.pass(m, &parts, cache.capacity())?;
                    dev.synchronize()?;
                    Ok(())
                })?;
                let sg = util::summarize(&ms);
                eprintln!(
                    "  sessions pass {ns:>2} x {n} rows from its graph: {:.3} ms ({:.2}x the \
                     eager pass)",
                    sg.median,
                    sg.median / sp.median
                );
                rows.push(row(json!({
                    "context": l, "kind": "sessions_graph", "tokens": ns * n,
                    "depth": SESSION_CHAIN, "sessions": ns,
                    "median_ms": sg.median, "p10_ms": sg.p10, "p90_ms": sg.p90,
                    "mean_ms": sg.mean, "iters": ms.len(),
                    "cuda_graph": stepper.uses_graph(ns, n, cache.capacity()),
                })));
            }
            // The same sessions' draft chains grown together as the draft worker grows them:
            // each session feeds two tokens (the last accepted and the bonus), then a chain of
            // SESSION_CHAIN, one graph-replayed pass a level, the chains copied to the host.
            let feed = [
                rng.token(cfg.vocab_size, &[]),
                rng.token(cfg.vocab_size, &[]),
            ];
            if l + feed.len() + SESSION_CHAIN <= cache.capacity()
                && m.session_chains_fit(cache.capacity(), ns)
            {
                let mut stepper = SessionChainsStepper::new();
                let ms = time_ms(s.iters, s.warmup.max(2), || {
                    let chains: Vec<SessionChain<'_>> = caches
                        .iter()
                        .map(|cache| SessionChain {
                            cache,
                            feed: &feed,
                            forced: &[],
                        })
                        .collect();
                    let out = stepper.grow(m, &chains, SESSION_CHAIN, cache.capacity())?;
                    out.to_vec2::<f32>()?;
                    Ok(())
                })?;
                let sc = util::summarize(&ms);
                eprintln!(
                    "  session chains {ns:>2} x (feed {} + {SESSION_CHAIN} levels) grown together: \
                     {:.3} ms ({:.3} ms a level)",
                    feed.len(),
                    sc.median,
                    sc.median / SESSION_CHAIN as f64
                );
                rows.push(row(json!({
                    "context": l, "kind": "session_chains", "tokens": ns * SESSION_CHAIN,
                    "depth": SESSION_CHAIN, "sessions": ns, "feed": feed.len(),
                    "median_ms": sc.median, "p10_ms": sc.p10, "p90_ms": sc.p90,
                    "mean_ms": sc.mean, "iters": ms.len(),
                    "cuda_graph": stepper.uses_graph(ns, SESSION_CHAIN, cache.capacity()),
                })));
            }
        }
        // One session's draft chain alone, as the draft worker grows it: the two fed tokens in
        // one pass of its step's graphs, then one replayed step a level, the chain copied back.
        if !s.sessions.is_empty() && l + 2 + SESSION_CHAIN <= cache.capacity() {
            let feed = [
                rng.token(cfg.vocab_size, &[]),
                rng.token(cfg.vocab_size, &[]),
            ];
            let mut stepper = DecodeStepper::new(m, cache.capacity())?;
            let ms = time_ms(s.iters, s.warmup.max(2), || {
                stepper.feed(m, &cache, &feed, l)?;
                let out = Tensor::zeros(SESSION_CHAIN, DType::U32, &dev)?;
                out.slice_set(&stepper.buffers().next, 0, 0)?;
                for j in 1..SESSION_CHAIN {
                    stepper.step(m, &cache)?;
                    out.slice_set(&stepper.buffers().next, 0, j)?;
                }
                out.to_vec1::<u32>()?;
                Ok(())
            })?;
            let ca = util::summarize(&ms);
            eprintln!(
                "  chain alone (feed {} + {SESSION_CHAIN} levels): {:.3} ms ({:.3} ms a level)",
                feed.len(),
                ca.median,
                ca.median / SESSION_CHAIN as f64
            );
            rows.push(row(json!({
                "context": l, "kind": "chain_alone", "tokens": SESSION_CHAIN,
                "depth": SESSION_CHAIN, "sessions": 1, "feed": feed.len(),
                "median_ms": ca.median, "p10_ms": ca.p10, "p90_ms": ca.p90,
                "mean_ms": ca.mean, "iters": ms.len(),
                "cuda_graph": stepper.uses_graph(),
            })));
        }

        // (d) whole verification rounds as the target worker runs them: the previous round's
        // token plus a chain (none = a plain decoding step), the greedy verdict, compaction.
        let engine = TargetEngine::new(model.clone(), max_ctx + max_new + 1)
            .with_device_timing(s.device_timing);
        let mut sess = engine.new_session(1)?;
        let mut seq = prefix[..l].to_vec();
        engine.verify(
            &mut sess,
            Prefix::Full(seq.clone()),
            &TokenTree::new(),
            &SamplingParams::greedy(),
        )?;
        seq.push(tok);
        let mut engine_shapes = vec![TokenTree::new()];
        engine_shapes.extend(
            shapes
                .iter()
                .filter(|(k, _)| *k == "chain")
                .map(|(_, t)| t.clone()),
        );
        // Two last tokens taken in turn: each round resends the `l` cached tokens and a last
        // token the session does not hold, so every round runs the model from `l` cached slots.
        let other = (tok + 1) % cfg.vocab_size as u32;
        for tree in &engine_shapes {
            let (mut model_ms, mut enqueue_ms) = (Vec::new(), Vec::new());
            let ms = time_ms(s.iters, s.warmup.max(2), || {
                seq[l] = if seq[l] == tok { other } else { tok };
                let o = engine.verify(
                    &mut sess,
                    Prefix::Full(seq.clone()),
                    tree,
                    &SamplingParams::greedy(),
                )?;
                model_ms.push(o.model_time.as_secs_f64() * 1e3);
                enqueue_ms.push(o.enqueue_time.as_secs_f64() * 1e3);
                Ok(())
            })?;
            let graph = sess.graph_passes().contains(&(tree.len() + 1));
            let skip = s.warmup.max(2);
            // With --device-timing: the passes' device time, from CUDA events.
            let device: Vec<f64> = engine
                .take_device_times()
                .iter()
                .map(|t| t.device_ms)
                .collect();
            if device.len() > skip {
                eprintln!(
                    "  engine round, chain {:>2}: device time {:.3} ms",
                    tree.len(),
                    util::summarize(&device[skip..]).median
                );
            }
            let (wall, model_s, enq) = (
                util::summarize(&ms),
                util::summarize(&model_ms[skip.min(model_ms.len())..]),
                util::summarize(&enqueue_ms[skip.min(enqueue_ms.len())..]),
            );
            eprintln!(
                "  engine round, chain {:>2}: {:.3} ms (model {:.3}, host enqueue {:.3}; {})",
                tree.len(),
                wall.median,
                model_s.median,
                enq.median,
                if graph { "graph" } else { "eager pass" }
            );
            rows.push(row(json!({
                "context": l, "kind": "engine_round", "tokens": tree.len() + 1,
                "depth": tree.len(),
                "median_ms": wall.median, "p10_ms": wall.p10, "p90_ms": wall.p90,
                "mean_ms": wall.mean, "iters": ms.len(),
                "model_median_ms": model_s.median, "host_enqueue_median_ms": enq.median,
                "exact_step": tree.is_empty() && engine.uses_exact_steps(),
                "graph": graph,
            })));
        }
    }
    let doc = json!({
        "meta": {
            "kind": "forward",
            "model": model_name,
            "spec": s.model,
            "device": s.device,
            "dtype": format!("{:?}", m.dtype()).to_lowercase(),
            "fused_kernels": kernels.fused,
            "batch_invariant": kernels.batch_invariant,
            "wide_rows": kernels.wide_rows,
            "pdl": kernels.pdl && specsplit_models::fused::PDL_AVAILABLE,
            "config": {
                "layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size,
                "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                "ffn": cfg.intermediate_size, "vocab": cfg.vocab_size,
                "tied_embeddings": cfg.tie_word_embeddings,
            },
            "params": pb.params,
            "param_bytes": pb.total_bytes,
            "decode_streamed_bytes": pb.streamed_bytes,
            "param_bytes_note": "dense estimate from the configuration (not valid for GGUF-quantized weights)",
            "copy_bandwidth_gb_s": bw / 1e9,
            "copy_bandwidth_mib": s.bw_mib,
            "copy_ms": bw_ms,
            "bandwidth_method": bw_method,
            "slice_set_bandwidth_gb_s": kernel_bw / 1e9,
            "iters": s.iters,
            "warmup": s.warmup,
            "timing": "median/p10/p90 wall ms of one forward incl. input upload and tree-mask build, then O(1) cache.truncate and device.synchronize()",
            "sessions_pass": "Transformer::forward_sessions of `sessions` sessions' verify rounds (a new token and a chain of `depth` each, every session its own cache holding the same prefix) as one multi-session pass, then O(1) truncates and device.synchronize(); host_enqueue_median_ms: host time until it returned",
            "sessions_graph": "the `sessions_pass` rounds through the target's SessionRowsStepper: one pass replayed from the CUDA graph of its shape (sessions, rows, capacity), then device.synchronize()",
            "session_chains": "SessionChainsStepper::grow of `sessions` sessions' draft chains (each feeding `feed` tokens, then `depth` levels) over their own caches holding the same prefix, replayed from the graph of its shape, then the chains copied to the host: a draft worker's chains grown together",
            "chain_alone": "one session's draft chain as the draft worker grows it alone: DecodeStepper::feed of `feed` tokens, then `depth` - 1 replayed steps, the chain copied to the host",
            "exact_chain": "ExactStepper::step_chain of `tokens` rows (a new token and a chain of `depth`) replayed from its graph for that row count, then O(1) cache.truncate and device.synchronize(): the verify pass of a chain draft without the engine's host work",
            "engine_round": "TargetEngine::verify of the sequence plus one new token (two taken in turn, so the model runs every time) and a chain of `depth` random tokens (depth 0 = a plain decoding step): wall ms, the model time it reports and its host time until the pass was enqueued; the greedy verdict is copied back, the accepted path compacted",
            "tree_shape": "balanced: 4 roots, 4 children each, then 2 per node, filled level by level to exactly N nodes",
        },
        "roofline": roofline_summary,
        "rows": rows,
    });
    let (j, c) = crate::report::write(&s.out, &s.name, &doc)?;
    eprintln!("wrote {} and {}", j.display(), c.display());
    Ok(())
}
