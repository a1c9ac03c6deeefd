//! `kernels`: the batch-invariant CUDA kernels against cuBLAS, per projection of a model shape
//! and per pass size, and the batch-invariant attention per pass size and context. Each figure
//! is the median time of one launch, from `batch` launches enqueued back to back then one
//! synchronisation (the GPU time of a launch that the host keeps fed), over `iters` samples.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use clap::Args;
use serde_json::{json, Map, Value};
use specsplit_models::config::ModelConfig;
use specsplit_models::fused::{self, AttnShape, PassKeys};

use crate::{report, util};

/// Arguments of `kernels`.
#[derive(Args, Debug)]
pub struct KernelArgs {
    /// Model shape preset (qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, …): random weights.
    #[arg(long, default_value = "qwen2.5-7b")]
    shape: String,
    /// Device: cuda or cuda:N.
    #[arg(long, default_value = "cuda:0")]
    device: String,
    /// Rows of a pass (1 = decoding one token, K + 1 = verifying K nodes).
    #[arg(long, value_delimiter = ',', default_value = "1,9,33")]
    rows: Vec<usize>,
    /// Cached tokens before the pass, for attention.
    #[arg(long, value_delimiter = ',', default_value = "512,2048")]
    contexts: Vec<usize>,
    /// Timed samples per figure.
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Launches per sample.
    #[arg(long, default_value_t = 10)]
    batch: usize,
    /// Load depths of the batch-invariant product to compare (1 = base, 2 = twice the weight
    /// chunks in flight; 0 = the built-in choice per shape). A depth or column tiling set runs
    /// the entry that holds every tiling; the built-in choice runs the lean entries where the
    /// shape takes them.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    depths: Vec<u8>,
    /// Warps sharing k to compare (1..=8; 0 = the built-in rule, a function of the shape).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    splits: Vec<usize>,
    /// Column tiles of 8 a warp to compare (2 or 4; 0 = the built-in rule).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    col_tiles: Vec<usize>,
    /// Input loads of the batch-invariant product's lean entries to compare (0 = the built-in
    /// rule, 1 = the input's fragments of a group of weight chunks loaded with the group, 2 =
    /// chunk by chunk).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    x_ahead: Vec<u8>,
    /// Also time each kernel of the one-token graph step (the draft's decode step) at this
    /// shape, per context, and their sum over a step.
    #[arg(long)]
    step: bool,
    /// Also time each kernel of a batch-invariant rows pass (a verify pass, or a level of a
    /// pre-draft's chain growth) at this shape, per row count of `--rows` and per context, in a
    /// graph, and their sum over a pass.
    #[arg(long)]
    rows_pass: bool,
    /// Rows of the weight a warp of the step's GEMV takes, to compare in `--rows-pass` (1 or 2;
    /// 0 = the built-in rule only).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    gemv_warp_rows: Vec<usize>,
    /// Query heads a block of the rows attention takes, to compare in `--rows-pass` (1, 2, 4,
    /// 8; 0 = the built-in rule).
    #[arg(long, value_delimiter = ',', default_value = "0")]
    rows_heads: Vec<usize>,
    /// Output directory.
    #[arg(long, default_value = "bench-out")]
    out: PathBuf,
    /// Base name of the output files.
    #[arg(long, default_value = "kernels")]
    name: String,
}

/// Median milliseconds of one `f` call, `batch` calls a sample, after two warm-up samples.
fn per_launch_ms(
    dev: &Device,
    iters: usize,
    batch: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    let batch = batch.max(1);
    let mut ms = Vec::with_capacity(iters);
    for i in 0..iters.max(1) + 2 {
        let t = std::time::Instant::now();
        for _ in 0..batch {
            f()?;
        }
        dev.synchronize()?;
        if i >= 2 {
            ms.push(t.elapsed().as_secs_f64() * 1e3 / batch as f64);
        }
    }
    Ok(util::summarize(&ms).median)
}

/// Median time per run of `f` when `batch` runs of it are replayed from one CUDA graph (the
/// fused kernels' outputs carved from a scratch, launched as a step's graph launches them):
/// the kernel's duration plus the gap between dependent kernels, without the host's launches.
#[cfg(feature = "cuda")]
fn in_graph_ms(
    dev: &Device,
    iters: usize,
    batch: usize,
    f: &mut dyn FnMut() -> Result<()>,
) -> Result<f64> {
    let f = std::cell::RefCell::new(f);
    let body =
        || (f.borrow_mut())().map_err(|e| specsplit_models::ModelError::Input(format!("{e:#}")));
    let g = specsplit_models::step::RepeatedGraph::capture(dev, batch.max(1), body)?;
    if g.nodes().memory > 0 {
        eprintln!("    (graph: {})", g.nodes());
    }
    let mut ms = Vec::with_capacity(iters);
    for i in 0..iters.max(1) + 2 {
        let t = std::time::Instant::now();
        g.launch()?;
        dev.synchronize()?;
        if i >= 2 {
            ms.push(t.elapsed().as_secs_f64() * 1e3 / batch.max(1) as f64);
        }
    }
    Ok(util::summarize(&ms).median)
}

#[cfg(not(feature = "cuda"))]
fn in_graph_ms(_: &Device, _: usize, _: usize, _: &mut dyn FnMut() -> Result<()>) -> Result<f64> {
    bail!("in-graph timings need the `cuda` feature")
}

/// `depth D splits S tiles T`, `-` for a built-in choice.
fn tuning_label(t: fused::BiTuning) -> String {
    let f = |v: Option<usize>| v.map_or("-".to_string(), |v| v.to_string());
    format!(
        "depth {} splits {} tiles {} x ahead {}",
        f(t.depth.map(usize::from)),
        f(t.splits),
        f(t.col_tiles),
        t.x_ahead.map_or("-", |b| if b { "yes" } else { "no" })
    )
}

/// A random bf16 tensor of `shape` on `dev`, normal with standard deviation `scale`.
fn random_bf16(dev: &Device, shape: &[usize], scale: f64) -> Result<Tensor> {
    Ok(Tensor::randn(0f32, 1f32, shape, dev)?
        .affine(scale, 0.0)?
        .to_dtype(DType::BF16)?)
}

/// The hidden size, head size, KV heads and query heads of `c`.
fn attention_dims(c: &ModelConfig) -> (usize, usize, usize, usize) {
    (
        c.hidden_size,
        c.head_dim,
        c.num_key_value_heads,
        c.num_attention_heads,
    )
}

/// Random K/V caches and rotary tables of `capacity` slots at shape `c`, and their attention shape.
struct AttentionInputs {
    shape: AttnShape,
    kc: Tensor,
    vc: Tensor,
    cos: Tensor,
    sin: Tensor,
}

/// [`AttentionInputs`] on `dev`.
fn attention_inputs(dev: &Device, c: &ModelConfig, capacity: usize) -> Result<AttentionInputs> {
    let (_, hd, kvh, qh) = attention_dims(c);
    let shape = AttnShape {
        heads: qh,
        kv: kvh,
        head_dim: hd,
        capacity,
    };
    Ok(AttentionInputs {
        shape,
        kc: random_bf16(dev, &[1, kvh, capacity, hd], 1.0)?,
        vc: random_bf16(dev, &[1, kvh, capacity, hd], 1.0)?,
        cos: random_bf16(dev, &[capacity, hd / 2], 1.0)?,
        sin: random_bf16(dev, &[capacity, hd / 2], 1.0)?,
    })
}

/// Every combination of the tunings `a` lists (0 in a list: the built-in choice).
fn tunings(a: &KernelArgs) -> Vec<fused::BiTuning> {
    let mut combos = Vec::new();
    for &depth in &a.depths {
        for &splits in &a.splits {
            for &tiles in &a.col_tiles {
                for &ahead in &a.x_ahead {
                    combos.push(fused::BiTuning {
                        depth: (depth > 0).then_some(depth),
                        splits: (splits > 0).then_some(splits),
                        col_tiles: (tiles > 0).then_some(tiles),
                        x_ahead: (ahead > 0).then_some(ahead == 1),
                    });
                }
            }
        }
    }
    combos
}

/// Runs the `kernels` subcommand.
pub fn main(a: KernelArgs) -> Result<()> {
    let c = ModelConfig::preset(&a.shape)
        .with_context(|| format!("unknown shape preset {:?}", a.shape))?;
    let dev = specsplit_workers::launch::parse_device(&a.device)?;
    if !dev.is_cuda() || !cfg!(feature = "cuda") {
        bail!("kernels needs a CUDA device and a build with the `cuda` feature");
    }
    let bf = |shape: &[usize], scale: f64| random_bf16(&dev, shape, scale);
    let (h, hd, kvh, qh) = attention_dims(&c);
    let projections = [
        ("qkv", (qh + 2 * kvh) * hd, h),
        ("o", h, qh * hd),
        ("gate_up", 2 * c.intermediate_size, h),
        ("down", h, c.intermediate_size),
        ("lm_head", c.vocab_size, h),
    ];
    let mut rows_out: Vec<Map<String, Value>> = Vec::new();
    println!(
        "{} shape, per launch (ms): cuBLAS vs batch-invariant",
        a.shape
    );
    for (name, n, k) in projections {
        let w = bf(&[n, k], 0.02)?;
        for &m in &a.rows {
            let x = bf(&[m, k], 1.0)?;
            let wt = w.t()?;
            let cublas = per_launch_ms(&dev, a.iters, a.batch, || {
                x.matmul(&wt)?;
                Ok(())
            })?;
            let combos = tunings(&a);
            let mut best: Option<(f64, fused::BiTuning)> = None;
            let mut builtin = None;
            for t in combos.iter().copied() {
                let launch = fused::Launch {
                    bi_tuning: t,
                    ..fused::Launch::DEFAULT
                };
                let bi = per_launch_ms(&dev, a.iters, a.batch, || {
                    fused::bi_matmul(&x, &w, None, launch)?;
                    Ok(())
                })?;
                let label = tuning_label(t);
                if combos.len() <= 4 {
                    let gbs = (n * k * 2) as f64 / (bi / 1e3) / 1e9;
                    println!(
                        "  {name:8} {n:6}x{k:5} rows {m:3} {label}: cuBLAS {cublas:.4}  bi {bi:.4}  ({:.2}x; bi {gbs:.0} GB/s of weights)",
                        bi / cublas
                    );
                }
                if t == fused::BiTuning::default() {
                    builtin = Some(bi);
                }
                if best.is_none_or(|(b, _)| bi < b) {
                    best = Some((bi, t));
                }
                let mut r = Map::new();
                r.insert("op".into(), json!(name));
                r.insert("n".into(), json!(n));
                r.insert("k".into(), json!(k));
                r.insert("rows".into(), json!(m));
                r.insert("tuning".into(), json!(label));
                r.insert("cublas_ms".into(), json!(cublas));
                r.insert("bi_ms".into(), json!(bi));
                rows_out.push(r);
            }
            if combos.len() > 4 {
                if let Some((b, t)) = best {
                    let gbs = (n * k * 2) as f64 / (b / 1e3) / 1e9;
                    let base = builtin.map_or(String::new(), |d| format!("built-in {d:.4}, "));
                    println!(
                        "  {name:8} {n:6}x{k:5} rows {m:3}: cuBLAS {cublas:.4}  {base}best {b:.4} ({gbs:.0} GB/s) with {}",
                        tuning_label(t)
                    );
                }
            }
        }
    }
    for &ctx in &a.contexts {
        let cap = ctx + a.rows.iter().copied().max().unwrap_or(1);
        let kc = bf(&[1, kvh, cap, hd], 1.0)?;
        let vc = bf(&[1, kvh, cap, hd], 1.0)?;
        let shape = AttnShape {
            heads: qh,
            kv: kvh,
            head_dim: hd,
            capacity: cap,
        };
        for &m in &a.rows {
            let q = bf(&[1, qh, m, hd], 1.0)?;
            let leads: Vec<(usize, &[u32])> = (0..m).map(|i| (ctx + i + 1, &[][..])).collect();
            let keys = PassKeys::new(&leads, &dev)?;
            let scale = 1.0 / (hd as f32).sqrt();
            let ms = per_launch_ms(&dev, a.iters, a.batch, || {
                fused::rows_attention(&q, &kc, &vc, &keys, shape, scale, fused::Launch::DEFAULT)?;
                Ok(())
            })?;
            println!("  attention ctx {ctx:5} rows {m:3}: bi {ms:.4}");
            let mut r = Map::new();
            r.insert("op".into(), json!("attention"));
            r.insert("context".into(), json!(ctx));
            r.insert("rows".into(), json!(m));
            r.insert("bi_ms".into(), json!(ms));
            rows_out.push(r);
        }
    }
    if a.step {
        step_kernels(&a, &c, &dev, &mut rows_out)?;
    }
    if a.rows_pass {
        rows_pass_kernels(&a, &c, &dev, &mut rows_out)?;
    }
    let doc = json!({
        "meta": { "shape": a.shape, "device": a.device, "iters": a.iters, "batch": a.batch },
        "rows": rows_out,
    });
    let (j, c) = report::write(&a.out, &a.name, &doc)?;
    println!("wrote {} and {}", j.display(), c.display());
    Ok(())
}

/// A time launched from the host and one replayed from a graph, in ms.
#[derive(Clone, Copy)]
struct Both(f64, f64);

impl std::ops::AddAssign for Both {
    fn add_assign(&mut self, o: Self) {
        self.0 += o.0;
        self.1 += o.1;
    }
}

/// Times each kernel of the fused one-token step ([`specsplit_models::transformer::Transformer::static_step`]
/// on CUDA) at shape `c`, per context of `a`, two ways: launched back to back from the host
/// (for the small kernels that is the host's launch rate) and `batch` launches replayed from one
/// graph (the kernel plus the gap to the next, as in the replayed step); and their sums over a
/// step, to set beside the replayed step's time.
fn step_kernels(
    a: &KernelArgs,
    c: &ModelConfig,
    dev: &Device,
    rows_out: &mut Vec<Map<String, Value>>,
) -> Result<()> {
    let bf = |shape: &[usize], scale: f64| random_bf16(dev, shape, scale);
    let (h, hd, kvh, qh) = attention_dims(c);
    let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<(f64, f64)> {
        Ok((
            per_launch_ms(dev, a.iters, a.batch, &mut *f)?,
            in_graph_ms(dev, a.iters, a.batch, f)?,
        ))
    };
    let mut row = |op: &str, context: usize, (ms, graph_ms): (f64, f64), per_step: usize| -> Both {
        println!(
            "  step {op:14} ctx {context:5}: {ms:.4} ms launched, {graph_ms:.4} ms in a graph x {per_step}"
        );
        let mut r = Map::new();
        r.insert("op".into(), json!(format!("step_{op}")));
        r.insert("context".into(), json!(context));
        r.insert("ms".into(), json!(ms));
        r.insert("graph_ms".into(), json!(graph_ms));
        r.insert("per_step".into(), json!(per_step));
        rows_out.push(r);
        Both(ms * per_step as f64, graph_ms * per_step as f64)
    };

    let layers = c.num_hidden_layers;
    let x = bf(&[1, h], 1.0)?;
    let norm = bf(&[h], 1.0)?;
    let eps = c.rms_norm_eps as f32;
    println!(
        "{} one-token step kernels (per launch: launched from the host / replayed in a graph):",
        a.shape
    );
    for &ctx in &a.contexts {
        let mut total = Both(0.0, 0.0);
        total += row(
            "add_rmsnorm",
            ctx,
            time(&mut || {
                fused::add_rmsnorm(&x, Some(&x), &norm, eps, fused::Launch::DEFAULT)?;
                Ok(())
            })?,
            2 * layers + 1,
        );
        for (name, n, k, bias, per) in [
            ("gemv_qkv", (qh + 2 * kvh) * hd, h, true, layers),
            ("gemv_o", h, qh * hd, false, layers),
            ("gemv_gate_up", 2 * c.intermediate_size, h, false, layers),
            ("gemv_down", h, c.intermediate_size, false, layers),
            ("gemv_head", c.vocab_size, h, false, 1),
        ] {
            let w = bf(&[n, k], 0.02)?;
            let b = if bias { Some(bf(&[n], 0.1)?) } else { None };
            let xi = bf(&[1, k], 1.0)?;
            let ms = time(&mut || {
                fused::gemv(&xi, &w, b.as_ref(), fused::Launch::DEFAULT)?;
                Ok(())
            })?;
            total += row(name, ctx, ms, per);
        }
        let AttentionInputs {
            shape,
            kc,
            vc,
            cos,
            sin,
        } = attention_inputs(dev, c, ctx + 1)?;
        let pos = Tensor::new(&[ctx as u32], dev)?;
        let qkv = bf(&[1, (qh + 2 * kvh) * hd], 1.0)?;
        total += row(
            "qkv_rope_cache",
            ctx,
            time(&mut || {
                fused::qkv_rope_cache(
                    &qkv,
                    &cos,
                    &sin,
                    &pos,
                    &kc,
                    &vc,
                    shape,
                    false,
                    fused::Launch::DEFAULT,
                )?;
                Ok(())
            })?,
            layers,
        );
        let q = bf(&[1, qh * hd], 1.0)?;
        let scale = 1.0 / (hd as f32).sqrt();
        total += row(
            "attention",
            ctx,
            time(&mut || {
                fused::decode_attention(&q, &kc, &vc, &pos, shape, scale, fused::Launch::DEFAULT)?;
                Ok(())
            })?,
            layers,
        );
        let gu = bf(&[1, 2 * c.intermediate_size], 1.0)?;
        total += row(
            "silu_mul",
            ctx,
            time(&mut || {
                fused::silu_mul(&gu, fused::Launch::DEFAULT)?;
                Ok(())
            })?,
            layers,
        );
        let logits = bf(&[1, c.vocab_size], 1.0)?;
        let (next, token, position) = (
            Tensor::zeros(1, DType::U32, dev)?,
            Tensor::zeros(1, DType::U32, dev)?,
            Tensor::zeros(1, DType::U32, dev)?,
        );
        let lp = Tensor::zeros(1, DType::F32, dev)?;
        total += row(
            "greedy_head",
            ctx,
            time(&mut || {
                fused::greedy_head(
                    &logits,
                    &next,
                    &lp,
                    &token,
                    &position,
                    fused::Launch::DEFAULT,
                )?;
                Ok(())
            })?,
            1,
        );
        row("total", ctx, (total.0, total.1), 1);
    }
    Ok(())
}

/// Times each kernel of a batch-invariant rows pass ([`specsplit_models::transformer::Transformer::grow_chains`]'s
/// levels and the exact verify passes) at shape `c`, per row count and context of `a`, replayed
/// from a graph, beside cuBLAS for each product and the step's GEMV for up to
/// [`fused::GEMV_MAX_ROWS`] rows; and their sum over a pass.
fn rows_pass_kernels(
    a: &KernelArgs,
    c: &ModelConfig,
    dev: &Device,
    rows_out: &mut Vec<Map<String, Value>>,
) -> Result<()> {
    let bf = |shape: &[usize], scale: f64| random_bf16(dev, shape, scale);
    let (h, hd, kvh, qh) = attention_dims(c);
    let layers = c.num_hidden_layers;
    let eps = c.rms_norm_eps as f32;
    let launch = fused::Launch::DEFAULT;
    let graph = |f: &mut dyn FnMut() -> Result<()>| in_graph_ms(dev, a.iters, a.batch, f);
    println!(
        "{} rows-pass kernels (per launch, replayed in a graph; x per pass):",
        a.shape
    );
    let weights: Vec<(&str, Tensor, Option<Tensor>, usize)> = vec![
        (
            "qkv",
            bf(&[(qh + 2 * kvh) * hd, h], 0.02)?,
            Some(bf(&[(qh + 2 * kvh) * hd], 0.1)?),
            layers,
        ),
        ("o", bf(&[h, qh * hd], 0.02)?, None, layers),
        (
            "gate_up",
            bf(&[2 * c.intermediate_size, h], 0.02)?,
            None,
            layers,
        ),
        ("down", bf(&[h, c.intermediate_size], 0.02)?, None, layers),
        ("lm_head", bf(&[c.vocab_size, h], 0.02)?, None, 1),
    ];
    let norm = bf(&[h], 1.0)?;
    for &m in &a.rows {
        for &ctx in &a.contexts {
            let mut record = |op: &str, ms: f64, per: usize| -> f64 {
                println!("  rows {m:3} ctx {ctx:5} {op:18} {ms:.4} ms x {per}");
                let mut r = Map::new();
                r.insert("op".into(), json!(format!("rows_{op}")));
                r.insert("rows".into(), json!(m));
                r.insert("context".into(), json!(ctx));
                r.insert("graph_ms".into(), json!(ms));
                r.insert("per_pass".into(), json!(per));
                rows_out.push(r);
                ms * per as f64
            };
            let (mut total, mut total_cublas, mut total_gemv) = (0.0, 0.0, 0.0);
            let x = bf(&[m, h], 1.0)?;
            let t = graph(&mut || {
                fused::add_rmsnorm(&x, Some(&x), &norm, eps, launch)?;
                Ok(())
            })?;
            let norms = record("add_rmsnorm", t, 2 * layers + 1);
            total += norms;
            total_cublas += norms;
            total_gemv += norms;
            for (name, w, b, per) in &weights {
                let xi = bf(&[m, w.dim(1)?], 1.0)?;
                let t = graph(&mut || {
                    fused::bi_matmul(&xi, w, b.as_ref(), launch)?;
                    Ok(())
                })?;
                total += record(&format!("bi_{name}"), t, *per);
                for tuning in tunings(a)
                    .into_iter()
                    .filter(|t| *t != fused::BiTuning::default())
                {
                    let tuned = fused::Launch {
                        bi_tuning: tuning,
                        ..launch
                    };
                    let t = graph(&mut || {
                        fused::bi_matmul(&xi, w, b.as_ref(), tuned)?;
                        Ok(())
                    })?;
                    record(&format!("bi_{name} {}", tuning_label(tuning)), t, *per);
                }
                let wt = w.t()?;
                let t = graph(&mut || {
                    let y = xi.matmul(&wt)?;
                    if let Some(b) = b {
                        y.broadcast_add(b)?;
                    }
                    Ok(())
                })?;
                total_cublas += record(&format!("cublas_{name}"), t, *per);
                if m <= fused::GEMV_MAX_ROWS {
                    let t = graph(&mut || {
                        fused::gemv_rows(&xi, w, b.as_ref(), launch)?;
                        Ok(())
                    })?;
                    total_gemv += record(&format!("gemv_{name}"), t, *per);
                    for &nr in a.gemv_warp_rows.iter().filter(|&&nr| nr > 0) {
                        let tuned = fused::Launch {
                            gemv_warp_rows: Some(nr),
                            ..launch
                        };
                        let t = graph(&mut || {
                            fused::gemv_rows(&xi, w, b.as_ref(), tuned)?;
                            Ok(())
                        })?;
                        record(&format!("gemv_{name} warp rows {nr}"), t, *per);
                    }
                }
            }
            let AttentionInputs {
                shape,
                kc,
                vc,
                cos,
                sin,
            } = attention_inputs(dev, c, ctx + m + 1)?;
            let positions: Vec<u32> = (0..m as u32).map(|i| ctx as u32 + i).collect();
            let positions = Tensor::new(positions.as_slice(), dev)?;
            let qkv = bf(&[m, (qh + 2 * kvh) * hd], 1.0)?;
            let t = graph(&mut || {
                fused::qkv_rope_rows(
                    &qkv,
                    &cos,
                    &sin,
                    &positions,
                    &kc,
                    &vc,
                    fused::RowSlots::After(ctx),
                    shape,
                    false,
                    launch,
                )?;
                Ok(())
            })?;
            let rope = record("qkv_rope_rows", t, layers);
            let q = bf(&[1, qh, m, hd], 1.0)?;
            let leads: Vec<(usize, &[u32])> = (0..m).map(|i| (ctx + i + 1, &[][..])).collect();
            let keys = PassKeys::new(&leads, dev)?;
            let scale = 1.0 / (hd as f32).sqrt();
            let t = graph(&mut || {
                fused::rows_attention(&q, &kc, &vc, &keys, shape, scale, launch)?;
                Ok(())
            })?;
            let attention = record("rows_attention", t, layers);
            for &hb in a.rows_heads.iter().filter(|&&hb| hb > 0) {
                let tuned = fused::Launch {
                    rows_heads: Some(hb),
                    ..launch
                };
                let t = graph(&mut || {
                    fused::rows_attention(&q, &kc, &vc, &keys, shape, scale, tuned)?;
                    Ok(())
                })?;
                record(&format!("rows_attention heads {hb}"), t, layers);
            }
            let gu = bf(&[m, 2 * c.intermediate_size], 1.0)?;
            let t = graph(&mut || {
                fused::silu_mul(&gu, launch)?;
                Ok(())
            })?;
            let silu = record("silu_mul", t, layers);
            let logits = Tensor::zeros((m, c.vocab_size), DType::BF16, dev)?;
            let forced = Tensor::zeros(m, DType::U32, dev)?;
            let (tok, lp) = (
                Tensor::zeros(m, DType::F32, dev)?,
                Tensor::zeros(m, DType::F32, dev)?,
            );
            let t = graph(&mut || {
                fused::greedy_rows(&logits, &forced, &forced, &tok, &lp, launch)?;
                Ok(())
            })?;
            let head = record("greedy_rows", t, 1);
            let rest = rope + attention + silu + head;
            total += rest;
            total_cublas += rest;
            total_gemv += rest;
            record("total_bi", total, 1);
            record("total_cublas", total_cublas, 1);
            if m <= fused::GEMV_MAX_ROWS {
                record("total_gemv", total_gemv, 1);
            }
        }
    }
    Ok(())
}
