//! A Llama-family decoder (Llama, Mistral, Qwen2, SmolLM) whose forward pass takes explicit
//! position ids, an additive attention mask (causal or tree) and a session KV cache, and returns
//! logits only for the requested rows.
//!
//! Attention never materialises repeated K/V heads: the query heads that share a KV head are
//! folded into the row dimension (`(1, kv_heads, n_rep * n, head_dim)`) and multiplied directly
//! against the cache's strided views, which both candle's CPU gemm and cuBLAS accept without a
//! copy (the inner dimension of the K/V views is contiguous). Nothing in the forward pass reads
//! values back to the host.

use crate::config::{ModelConfig, RopeScaling};
use crate::cpu_attention::{RowKeys, TreeRows, Visibility};
use crate::fused::KernelOptions;
use crate::weights::{gguf_config, hf_names, random_tensors, read_gguf};
use crate::ModelError;
use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QTensor};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Module, Tensor};
use specsplit_core::cache::{CacheSpec, SessionCache};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// A projection `y = x W^T (+ b)` with dense or GGUF-quantized weights.
#[derive(Debug, Clone)]
enum Linear {
    Dense {
        w: Tensor,
        b: Option<Tensor>,
    },
    /// candle's quantized product (CUDA).
    Quant {
        w: QMatMul,
        b: Option<Tensor>,
    },
    /// The batch-invariant quantized product of the CPU ([`crate::cpu_quant`]).
    QuantCpu {
        w: Arc<crate::cpu_quant::QuantMatrix>,
        b: Option<Tensor>,
    },
}

impl Linear {
    /// `x`: `(n, in)` → `(n, out)`, with the kernels `k` allows.
    fn forward(&self, x: &Tensor, k: &KernelOptions) -> candle_core::Result<Tensor> {
        let (y, b) = match self {
            // A pass of a few rows on CUDA in bf16: the batch-invariant product, so a row's
            // result does not depend on how many rows share the pass.
            Self::Dense { w, b } if k.batch_invariant && bi_wanted(x, w) => {
                return crate::fused::bi_matmul(&x.contiguous()?, w, b.as_ref(), k.launch())
            }
            // Several rows on the CPU: one product per row (see `dense_rows_cpu`).
            Self::Dense { w, b } if x.device().is_cpu() && x.dim(0)? > 1 => {
                (dense_rows_cpu(x, w)?, b)
            }
            Self::Dense { w, b } => (x.matmul(&w.t()?)?, b),
            Self::Quant { w, b } if x.device().is_cuda() => (quant_fixed_width(w, x)?, b),
            Self::Quant { w, b } => (w.forward(x)?, b),
            Self::QuantCpu { w, b } => (w.forward(x)?, b),
        };
        match b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// `x W^T` on the CPU for `x` of several rows, as one single-row product per row. candle's CPU
/// gemm sums a row in a different order when the pass has one row (a matrix-vector product)
/// than when it has several, so a token decoded alone and the same token verified inside a
/// tree would get different bits; computing every row as the one-row product makes a row's
/// result independent of the number of rows in its pass.
fn dense_rows_cpu(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let wt = w.t()?;
    let x = x.contiguous()?;
    let rows = (0..x.dim(0)?)
        .map(|r| x.narrow(0, r, 1)?.matmul(&wt))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Tensor::cat(&rows, 0)
}

impl Linear {
    /// Whether the weights are quantized.
    fn is_quantized(&self) -> bool {
        matches!(self, Self::Quant { .. } | Self::QuantCpu { .. })
    }
}

/// Whether `x W^T` can run [`crate::fused::bi_matmul`] (with batch invariance on): a bf16 CUDA
/// pass of at most [`crate::fused::BI_MAX_ROWS`] rows, and a weight whose width is a multiple
/// of 32.
fn bi_wanted(x: &Tensor, w: &Tensor) -> bool {
    crate::fused::applies(x)
        && matches!((x.dims(), w.dims()), ([m, k], [_, kw]) if *m <= crate::fused::BI_MAX_ROWS && k == kw && k.is_multiple_of(32))
        && crate::fused::weight_fits(w)
}

/// Several projections of the same input: fused into one matrix when every part is dense (one
/// matmul and one bias add instead of one each per part), kept apart otherwise.
#[derive(Debug, Clone)]
enum Proj {
    /// `[W_1; W_2; …]` stacked by rows; the output columns split back by `sizes`.
    Fused { lin: Linear, sizes: Vec<usize> },
    /// One projection per part.
    Split(Vec<Linear>),
}

impl Proj {
    /// Fuses `parts` when all are dense (biases all present or all absent).
    fn new(parts: Vec<Linear>) -> candle_core::Result<Self> {
        let dense: Option<Vec<(&Tensor, Option<&Tensor>)>> = parts
            .iter()
            .map(|l| match l {
                Linear::Dense { w, b } => Some((w, b.as_ref())),
                Linear::Quant { .. } | Linear::QuantCpu { .. } => None,
            })
            .collect();
        let Some(dense) = dense else {
            return Ok(Self::Split(parts));
        };
        let with_bias = dense.iter().filter(|(_, b)| b.is_some()).count();
        if parts.len() < 2 || (with_bias != 0 && with_bias != dense.len()) {
            return Ok(Self::Split(parts));
        }
        let sizes = dense
            .iter()
            .map(|(w, _)| w.dim(0))
            .collect::<Result<_, _>>()?;
        let ws: Vec<&Tensor> = dense.iter().map(|(w, _)| *w).collect();
        let w = Tensor::cat(&ws, 0)?;
        let b = if with_bias == 0 {
            None
        } else {
            let bs: Vec<&Tensor> = dense.iter().filter_map(|(_, b)| *b).collect();
            Some(Tensor::cat(&bs, 0)?)
        };
        Ok(Self::Fused {
            lin: Linear::Dense { w, b },
            sizes,
        })
    }

    /// `x`: `(n, in)` → one `(n, out_i)` output per part (column views of one product when
    /// fused).
    fn forward(&self, x: &Tensor, k: &KernelOptions) -> candle_core::Result<Vec<Tensor>> {
        match self {
            Self::Split(parts) => parts.iter().map(|l| l.forward(x, k)).collect(),
            Self::Fused { lin, sizes } => {
                let y = lin.forward(x, k)?;
                let mut out = Vec::with_capacity(sizes.len());
                let mut at = 0;
                for &s in sizes {
                    out.push(y.narrow(1, at, s)?);
                    at += s;
                }
                Ok(out)
            }
        }
    }
}

/// A quantized projection of `q` (weights `(out, in)`) on `device`: on the CPU the blocks move
/// into a batch-invariant [`crate::cpu_quant::QuantMatrix`] (`q` is dropped when this was its
/// last reference) and F32/F16/BF16 tensors become dense f32 matrices; on CUDA candle's
/// `QMatMul`.
fn quant_linear(q: Arc<QTensor>, b: Option<Tensor>, device: &Device) -> Result<Linear, ModelError> {
    if device.is_cpu() {
        let dense = match q.dtype() {
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
                Some(q.dequantize(device)?.to_dtype(DType::F32)?)
            }
            _ => None,
        };
        return Ok(match dense {
            Some(w) => Linear::Dense { w, b },
            None => match crate::cpu_quant::QuantMatrix::from_qtensor(q)? {
                Some(w) => Linear::QuantCpu { w: Arc::new(w), b },
                None => return Err(ModelError::Weights("a dense GGUF weight".into())),
            },
        });
    }
    Ok(Linear::Quant {
        w: QMatMul::from_arc(q)?,
        b,
    })
}

/// Rows per quantized CUDA matmul: candle picks its CUDA kernel (and launch shape, which changes
/// rounding) by batch size, so every pass uses this one width.
const QUANT_CUDA_ROWS: usize = 8;

/// A quantized projection on CUDA computed in chunks of exactly [`QUANT_CUDA_ROWS`] rows (the
/// last chunk padded with zeros), so a row's result never depends on how many rows share the
/// pass: decoding one token and verifying it inside a tree give identical logits.
fn quant_fixed_width(w: &QMatMul, x: &Tensor) -> candle_core::Result<Tensor> {
    let (n, d) = x.dims2()?;
    let mut outs = Vec::with_capacity(n.div_ceil(QUANT_CUDA_ROWS));
    let mut start = 0;
    while start < n {
        let len = QUANT_CUDA_ROWS.min(n - start);
        let chunk = x.narrow(0, start, len)?;
        let chunk = if len < QUANT_CUDA_ROWS {
            let pad = Tensor::zeros((QUANT_CUDA_ROWS - len, d), x.dtype(), x.device())?;
            Tensor::cat(&[&chunk, &pad], 0)?
        } else {
            chunk.contiguous()?
        };
        outs.push(w.forward(&chunk)?.narrow(0, 0, len)?);
        start += len;
    }
    if outs.len() == 1 {
        Ok(outs.pop().expect("one chunk"))
    } else {
        Tensor::cat(&outs, 0)
    }
}

/// The token embedding: a dense matrix or a quantized one (rows dequantized on lookup).
#[derive(Debug, Clone)]
enum Embedding {
    Dense(Tensor),
    Quant(Arc<QTensor>),
    /// Blocks shared with a tied CPU head.
    QuantCpu(Arc<crate::cpu_quant::QuantMatrix>),
}

impl Embedding {
    fn forward(&self, tokens: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(e) => e.index_select(tokens, 0),
            Self::Quant(q) => q.embedding(tokens)?.to_dtype(dtype),
            Self::QuantCpu(q) => q.embedding(tokens)?.to_dtype(dtype),
        }
    }
}

#[derive(Debug, Clone)]
struct Layer {
    attn_norm: Tensor,
    /// Q, K and V projections.
    qkv: Proj,
    o: Linear,
    mlp_norm: Tensor,
    /// Gate and up projections.
    gate_up: Proj,
    down: Linear,
}

/// Device buffers of [`Transformer::static_step`]: its inputs, outputs and constants, all at
/// fixed addresses so a captured CUDA graph stays valid.
pub struct StaticStep {
    /// `(1,)` u32: the token to decode; the step overwrites it with its greedy next token.
    pub token: Tensor,
    /// `(1,)` u32: the token's position (= cache slot); the step increments it.
    pub position: Tensor,
    /// `(1,)` u32: the greedy next token, written by the step.
    pub next: Tensor,
    /// `(1,)` f32: the next token's log-probability, written by the step.
    pub next_logprob: Tensor,
    slots: Tensor,
    visible: Tensor,
    hidden: Tensor,
    one: Tensor,
    capacity: usize,
}

impl StaticStep {
    /// The cache capacity these buffers serve.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

/// Device buffers of [`Transformer::exact_rows`] and [`Transformer::static_rows_step`]: a
/// chain of `rows` tokens after the cached sequence, their positions (= cache slots), each
/// row's key count, and the logits the exact pass writes.
pub struct ExactRows {
    /// `(4 rows,)` u32: the tokens, their positions, then per row `[position + 1, 0]`; written
    /// together before each pass.
    io: Tensor,
    tokens: Tensor,
    positions: Tensor,
    keys: crate::fused::PassKeys,
    /// `(rows, vocab)` f32: the logits of [`Transformer::exact_rows`].
    pub logits: Tensor,
    rows: usize,
    capacity: usize,
}

impl ExactRows {
    /// Sets the next pass's input: `tokens` (exactly [`ExactRows::rows`] of them) at cache
    /// slots `past..` (one small upload).
    pub fn start(&self, tokens: &[u32], past: usize) -> Result<(), ModelError> {
        let n = self.rows;
        if tokens.len() != n {
            return Err(ModelError::Input(format!(
                "a {n}-row pass was given {} tokens",
                tokens.len()
            )));
        }
        if past + n > self.capacity {
            return Err(specsplit_core::cache::CacheError::CapacityExceeded {
                needed: past + n,
                capacity: self.capacity,
            }
            .into());
        }
        // On the stack: a pass has at most BI_MAX_ROWS rows (no allocation per step).
        let mut io = [0u32; 4 * crate::fused::BI_MAX_ROWS];
        let io = &mut io[..4 * n];
        io[..n].copy_from_slice(tokens);
        for (r, p) in (past..past + n).enumerate() {
            io[n + r] = p as u32;
            io[2 * n + 2 * r] = p as u32 + 1;
        }
        Ok(crate::fused::write_u32(&self.io, io)?)
    }

    /// Rows of the pass.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The cache capacity these buffers serve.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

/// The dense product `x W^T (+ b)` of a fused layer stack.
type Product<'a> = &'a dyn Fn(&Tensor, &Tensor, Option<&Tensor>) -> candle_core::Result<Tensor>;

/// How one pass computes attention.
enum AttnPath<'a> {
    /// Batched matmuls under an optional additive mask (cuBLAS or candle's CPU gemm).
    Batched(Option<&'a Tensor>),
    /// One product per row over its visible keys ([`crate::cpu_attention`]).
    PerRow(&'a RowKeys),
    /// The batch-invariant CUDA kernel over each row's visible slots.
    Fused(&'a crate::fused::PassKeys),
}

/// A layer's dense weights and biases for [`Transformer::static_step`]'s fused kernels.
struct FusedLayer<'a> {
    layer: &'a Layer,
    qkv: (Tensor, Option<Tensor>),
    o: (Tensor, Option<Tensor>),
    gate_up: (Tensor, Option<Tensor>),
    down: (Tensor, Option<Tensor>),
}

impl Layer {
    /// The SwiGLU block of the layer on the residual stream `x` (its output, before the
    /// residual add).
    fn mlp(&self, x: &Tensor, eps: f32, k: &KernelOptions) -> candle_core::Result<Tensor> {
        let h = candle_nn::ops::rms_norm(x, &self.mlp_norm, eps)?;
        let gu = self.gate_up.forward(&h, k)?;
        self.down
            .forward(&(candle_nn::ops::silu(&gu[0])? * &gu[1])?, k)
    }
}

/// A Llama-family transformer with tree-capable forward over a [`SessionCache`].
pub struct Transformer {
    config: ModelConfig,
    device: Device,
    dtype: DType,
    embed: Embedding,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    /// Rotary tables `(max_position_embeddings, head_dim / 2)` in the model dtype.
    cos: Tensor,
    sin: Tensor,
    /// llama.cpp's llama-arch GGUFs store Q/K rows permuted for interleaved-pair rotary; applying
    /// the interleaved rotary to them is exactly the half-split rotary on the original weights.
    rope_interleaved: bool,
    /// Causal `(n, n)` triangles (0 / -inf) by `n`, built once per size.
    causal: Mutex<HashMap<usize, Tensor>>,
    /// Which fused-kernel paths the passes run.
    kernels: KernelOptions,
}

impl std::fmt::Debug for Transformer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Transformer")
            .field("config", &self.config)
            .field("device", &self.device.location())
            .field("dtype", &self.dtype)
            .field("quantized", &self.lm_head.is_quantized())
            .finish()
    }
}

/// Inverse rotary frequencies (`head_dim / 2` of them), computed in f32 like the reference
/// implementations, with optional Llama 3.1 scaling and per-frequency divisors (GGUF
/// `rope_freqs.weight`).
fn inv_freqs(config: &ModelConfig, freq_factors: Option<&[f32]>) -> Vec<f32> {
    let d = config.head_dim;
    let theta = config.rope_theta as f32;
    let mut freqs: Vec<f32> = (0..d)
        .step_by(2)
        .map(|i| 1f32 / theta.powf(i as f32 / d as f32))
        .collect();
    if let Some(RopeScaling {
        factor,
        low_freq_factor,
        high_freq_factor,
        original_max_position_embeddings,
    }) = config.rope_scaling
    {
        let (factor, low, high) = (
            factor as f32,
            low_freq_factor as f32,
            high_freq_factor as f32,
        );
        let orig = original_max_position_embeddings as f32;
        let low_freq_wavelen = orig / low;
        let high_freq_wavelen = orig / high;
        for f in freqs.iter_mut() {
            let wavelen = 2. * std::f32::consts::PI / *f;
            *f = if wavelen < high_freq_wavelen {
                *f
            } else if wavelen > low_freq_wavelen {
                *f / factor
            } else {
                let smooth = (orig / wavelen - low) / (high - low);
                (1. - smooth) * *f / factor + smooth * *f
            };
        }
    }
    if let Some(ff) = freq_factors {
        for (f, k) in freqs.iter_mut().zip(ff) {
            *f /= *k;
        }
    }
    freqs
}

/// `(cos, sin)` tables of shape `(max_pos, head_dim / 2)`.
fn rotary_tables(
    config: &ModelConfig,
    freq_factors: Option<&[f32]>,
    dtype: DType,
    device: &Device,
) -> Result<(Tensor, Tensor), ModelError> {
    let freqs = inv_freqs(config, freq_factors);
    let max_pos = config.max_position_embeddings;
    let half = freqs.len();
    let mut cos = Vec::with_capacity(max_pos * half);
    let mut sin = Vec::with_capacity(max_pos * half);
    for p in 0..max_pos {
        for &f in &freqs {
            let a = p as f32 * f;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    let cos = Tensor::from_vec(cos, (max_pos, half), device)?.to_dtype(dtype)?;
    let sin = Tensor::from_vec(sin, (max_pos, half), device)?.to_dtype(dtype)?;
    Ok((cos, sin))
}

/// Where dense weights come from while building a model.
enum DenseSource<'a> {
    Mmap(&'a MmapedSafetensors, HashSet<String>),
    Map(&'a HashMap<String, Tensor>),
}

impl DenseSource<'_> {
    fn get(
        &self,
        name: &str,
        dims: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Option<Tensor>, ModelError> {
        let t = match self {
            Self::Mmap(st, names) => {
                if !names.contains(name) {
                    return Ok(None);
                }
                st.load(name, device)?
            }
            Self::Map(m) => match m.get(name) {
                None => return Ok(None),
                Some(t) => t.to_device(device)?,
            },
        };
        if t.dims() != dims {
            return Err(ModelError::Weights(format!(
                "tensor {name} has shape {:?}, expected {dims:?}",
                t.dims()
            )));
        }
        Ok(Some(t.to_dtype(dtype)?))
    }

    fn req(
        &self,
        name: &str,
        dims: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor, ModelError> {
        self.get(name, dims, dtype, device)?
            .ok_or_else(|| ModelError::Weights(format!("missing tensor {name}")))
    }
}

fn check_dtype(dtype: DType, device: &Device) -> Result<(), ModelError> {
    match dtype {
        DType::F32 | DType::F16 => Ok(()),
        DType::BF16 if !device.is_cpu() => Ok(()),
        DType::BF16 => Err(ModelError::Unsupported(
            "bf16 weights on CPU (candle's CPU matmul lacks bf16); use f32 or f16".into(),
        )),
        other => Err(ModelError::Unsupported(format!(
            "model dtype {other:?} (use f32, f16 or bf16)"
        ))),
    }
}

impl Transformer {
    /// Loads Hugging Face safetensors weights (memory-mapped; one file or all shards, see
    /// [`crate::weights::safetensors_files`]) converted to `dtype` on `device`.
    pub fn from_safetensors(
        config: ModelConfig,
        files: &[PathBuf],
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ModelError> {
        if files.is_empty() {
            return Err(ModelError::NotFound("no safetensors files given".into()));
        }
        if let Some(missing) = files.iter().find(|f| !f.is_file()) {
            return Err(ModelError::NotFound(format!(
                "safetensors file {} does not exist",
                missing.display()
            )));
        }
        // SAFETY: the files are memory-mapped read-only; like every mmap-based loader we rely on
        // them not being modified while the model is being built (tensors are copied out).
        let st = unsafe { MmapedSafetensors::multi(files) }
            .map_err(|e| ModelError::Weights(format!("reading safetensors: {e}")))?;
        let names = st.tensors().into_iter().map(|(n, _)| n).collect();
        Self::from_dense(config, &DenseSource::Mmap(&st, names), dtype, device, None)
    }

    /// A model with seeded random weights (see [`crate::weights::random_tensors`]).
    pub fn random(
        config: ModelConfig,
        seed: u64,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ModelError> {
        check_dtype(dtype, device)?;
        let tensors = random_tensors(&config, seed, dtype, device)?;
        Self::from_tensors(config, &tensors, dtype, device)
    }

    /// Builds a model from Hugging Face named tensors already in memory.
    pub fn from_tensors(
        config: ModelConfig,
        tensors: &HashMap<String, Tensor>,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ModelError> {
        Self::from_dense(config, &DenseSource::Map(tensors), dtype, device, None)
    }

    /// Builds a model from Hugging Face named tensors with every projection and the head
    /// quantized to `quant` (candle's `QTensor::quantize`), the embedding and norms dense, and
    /// f32 activations: the arithmetic of a GGUF file of that type. Every projection's input
    /// width must be a multiple of `quant`'s block size.
    pub fn from_tensors_quantized(
        config: ModelConfig,
        tensors: &HashMap<String, Tensor>,
        quant: GgmlDType,
        device: &Device,
    ) -> Result<Self, ModelError> {
        Self::from_dense(
            config,
            &DenseSource::Map(tensors),
            DType::F32,
            device,
            Some(quant),
        )
    }

    fn from_dense(
        config: ModelConfig,
        src: &DenseSource<'_>,
        dtype: DType,
        device: &Device,
        quant: Option<GgmlDType>,
    ) -> Result<Self, ModelError> {
        config.validate()?;
        check_dtype(dtype, device)?;
        let to_linear = |w: Tensor, b: Option<Tensor>| -> Result<Linear, ModelError> {
            match quant {
                None => Ok(Linear::Dense { w, b }),
                Some(q) => {
                    let qt = QTensor::quantize(&w, q)
                        .map_err(|e| ModelError::Weights(format!("quantizing to {q:?}: {e}")))?;
                    quant_linear(Arc::new(qt), b, device)
                }
            }
        };
        let c = &config;
        let (d, ffn) = (c.hidden_size, c.intermediate_size);
        let q_out = c.num_attention_heads * c.head_dim;
        let kv_out = c.num_key_value_heads * c.head_dim;
        let get = |name: &str, dims: &[usize]| src.req(name, dims, dtype, device);
        let lin =
            |name: String, out: usize, inp: usize, bias: bool| -> Result<Linear, ModelError> {
                let w = get(&format!("{name}.weight"), &[out, inp])?;
                let b = if bias {
                    Some(get(&format!("{name}.bias"), &[out])?)
                } else {
                    None
                };
                to_linear(w, b)
            };
        let embed = get(hf_names::EMBED, &[c.vocab_size, d])?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let l = |s: &str| hf_names::layer(i, s);
            let bias = c.attention_bias;
            layers.push(Layer {
                attn_norm: get(&l("input_layernorm.weight"), &[d])?,
                qkv: Proj::new(vec![
                    lin(l("self_attn.q_proj"), q_out, d, bias)?,
                    lin(l("self_attn.k_proj"), kv_out, d, bias)?,
                    lin(l("self_attn.v_proj"), kv_out, d, bias)?,
                ])?,
                o: lin(l("self_attn.o_proj"), d, q_out, false)?,
                mlp_norm: get(&l("post_attention_layernorm.weight"), &[d])?,
                gate_up: Proj::new(vec![
                    lin(l("mlp.gate_proj"), ffn, d, false)?,
                    lin(l("mlp.up_proj"), ffn, d, false)?,
                ])?,
                down: lin(l("mlp.down_proj"), d, ffn, false)?,
            });
        }
        let norm = get(hf_names::NORM, &[d])?;
        let lm_head = if c.tie_word_embeddings {
            embed.clone()
        } else {
            src.get(hf_names::LM_HEAD, &[c.vocab_size, d], dtype, device)?
                .unwrap_or_else(|| embed.clone())
        };
        let (cos, sin) = rotary_tables(c, None, dtype, device)?;
        Ok(Self {
            device: device.clone(),
            dtype,
            embed: Embedding::Dense(embed),
            layers,
            norm,
            lm_head: to_linear(lm_head, None)?,
            cos,
            sin,
            rope_interleaved: false,
            causal: Mutex::new(HashMap::new()),
            kernels: KernelOptions::default(),
            config,
        })
    }

    /// Loads a GGUF model (`llama` or `qwen2` architecture); the configuration comes from the GGUF
    /// metadata, projections stay quantized (candle `QMatMul`), activations are f32.
    pub fn from_gguf(path: &Path, device: &Device) -> Result<Self, ModelError> {
        let content = read_gguf(path)?;
        let config = gguf_config(&content)?;
        let mut file = std::fs::File::open(path).map_err(|source| ModelError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_gguf_content(config, &content, &mut file, device, None)
    }

    /// Loads a GGUF model like [`Transformer::from_gguf`] but dequantizes every weight to a dense
    /// `dtype` matrix (f32/f16, or bf16 on GPU): the same weights, without the 8-bit activation
    /// quantization of the quantized matmul kernels.
    pub fn from_gguf_dequantized(
        path: &Path,
        dtype: DType,
        device: &Device,
    ) -> Result<Self, ModelError> {
        check_dtype(dtype, device)?;
        let content = read_gguf(path)?;
        let config = gguf_config(&content)?;
        let mut file = std::fs::File::open(path).map_err(|source| ModelError::Io {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_gguf_content(config, &content, &mut file, device, Some(dtype))
    }

    fn from_gguf_content<R: std::io::Read + std::io::Seek>(
        config: ModelConfig,
        ct: &gguf_file::Content,
        reader: &mut R,
        device: &Device,
        dense: Option<DType>,
    ) -> Result<Self, ModelError> {
        let c = &config;
        let dtype = dense.unwrap_or(DType::F32);
        let to_linear = |q: Arc<QTensor>, b: Option<Tensor>| -> Result<Linear, ModelError> {
            Ok(match dense {
                Some(dt) => Linear::Dense {
                    w: q.dequantize(device)?.to_dtype(dt)?,
                    b,
                },
                None => quant_linear(q, b, device)?,
            })
        };
        let (d, ffn) = (c.hidden_size, c.intermediate_size);
        let q_out = c.num_attention_heads * c.head_dim;
        let kv_out = c.num_key_value_heads * c.head_dim;
        let mut qt = |name: &str, dims: &[usize]| -> Result<QTensor, ModelError> {
            let t = ct
                .tensor(reader, name, device)
                .map_err(|e| ModelError::Weights(format!("GGUF tensor {name}: {e}")))?;
            if t.shape().dims() != dims {
                return Err(ModelError::Weights(format!(
                    "GGUF tensor {name} has shape {:?}, expected {dims:?}",
                    t.shape().dims()
                )));
            }
            Ok(t)
        };
        let embed = Arc::new(qt("token_embd.weight", &[c.vocab_size, d])?);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for i in 0..c.num_hidden_layers {
            let mut dense = |s: &str, dims: &[usize]| -> Result<Tensor, ModelError> {
                Ok(qt(&format!("blk.{i}.{s}"), dims)?
                    .dequantize(device)?
                    .to_dtype(dtype)?)
            };
            let attn_norm = dense("attn_norm.weight", &[d])?;
            let mlp_norm = dense("ffn_norm.weight", &[d])?;
            let (bq, bk, bv) = if c.attention_bias {
                (
                    Some(dense("attn_q.bias", &[q_out])?),
                    Some(dense("attn_k.bias", &[kv_out])?),
                    Some(dense("attn_v.bias", &[kv_out])?),
                )
            } else {
                (None, None, None)
            };
            let mut lin = |s: &str, out: usize, inp: usize, b: Option<Tensor>| {
                to_linear(
                    Arc::new(qt(&format!("blk.{i}.{s}.weight"), &[out, inp])?),
                    b,
                )
            };
            layers.push(Layer {
                attn_norm,
                qkv: Proj::new(vec![
                    lin("attn_q", q_out, d, bq)?,
                    lin("attn_k", kv_out, d, bk)?,
                    lin("attn_v", kv_out, d, bv)?,
                ])?,
                o: lin("attn_output", d, q_out, None)?,
                mlp_norm,
                gate_up: Proj::new(vec![
                    lin("ffn_gate", ffn, d, None)?,
                    lin("ffn_up", ffn, d, None)?,
                ])?,
                down: lin("ffn_down", d, ffn, None)?,
            });
        }
        let norm = qt("output_norm.weight", &[d])?
            .dequantize(device)?
            .to_dtype(dtype)?;
        let freq_factors = if ct.tensor_infos.contains_key("rope_freqs.weight") {
            let f = qt("rope_freqs.weight", &[c.head_dim / 2])?;
            Some(
                f.dequantize(device)?
                    .to_device(&Device::Cpu)?
                    .to_vec1::<f32>()?,
            )
        } else {
            None
        };
        let (embed, lm_head) = match dense {
            Some(dt) => {
                let e = embed.dequantize(device)?.to_dtype(dt)?;
                let head = if c.tie_word_embeddings {
                    e.clone()
                } else {
                    qt("output.weight", &[c.vocab_size, d])?
                        .dequantize(device)?
                        .to_dtype(dt)?
                };
                (Embedding::Dense(e), Linear::Dense { w: head, b: None })
            }
            None if device.is_cpu() => {
                // One copy of the blocks, shared by a tied head.
                let e = match embed.dtype() {
                    GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
                        Embedding::Dense(embed.dequantize(device)?.to_dtype(dtype)?)
                    }
                    _ => match crate::cpu_quant::QuantMatrix::from_qtensor(embed)? {
                        Some(q) => Embedding::QuantCpu(Arc::new(q)),
                        None => return Err(ModelError::Weights("a dense GGUF embedding".into())),
                    },
                };
                let head = match (&e, c.tie_word_embeddings) {
                    (Embedding::QuantCpu(q), true) => Linear::QuantCpu {
                        w: q.clone(),
                        b: None,
                    },
                    (Embedding::Dense(w), true) => Linear::Dense {
                        w: w.clone(),
                        b: None,
                    },
                    _ => to_linear(Arc::new(qt("output.weight", &[c.vocab_size, d])?), None)?,
                };
                (e, head)
            }
            None => {
                let head = if c.tie_word_embeddings {
                    embed.clone()
                } else {
                    Arc::new(qt("output.weight", &[c.vocab_size, d])?)
                };
                let e = match QMatMul::from_arc(embed)? {
                    // F32/F16/BF16 GGUF embeddings are plain matrices.
                    QMatMul::Tensor(t) | QMatMul::TensorF16(t) => {
                        Embedding::Dense(t.to_dtype(dtype)?)
                    }
                    QMatMul::QTensor(q) => Embedding::Quant(q),
                };
                (e, to_linear(head, None)?)
            }
        };
        let (cos, sin) = rotary_tables(c, freq_factors.as_deref(), dtype, device)?;
        Ok(Self {
            device: device.clone(),
            dtype,
            embed,
            layers,
            norm,
            lm_head,
            cos,
            sin,
            rope_interleaved: config.architecture == "llama",
            causal: Mutex::new(HashMap::new()),
            kernels: KernelOptions::default(),
            config,
        })
    }

    /// The model's configuration.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Which fused-kernel paths the passes run ([`KernelOptions::default`] at load).
    pub fn kernel_options(&self) -> KernelOptions {
        self.kernels
    }

    /// Sets which fused-kernel paths the passes run from here on; those the build lacks stay
    /// off ([`KernelOptions::available`]).
    pub fn set_kernel_options(&mut self, options: KernelOptions) {
        self.kernels = options.available();
    }

    /// The device the weights live on.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The activation (and KV cache) dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The KV cache shape this model needs for `capacity` entries.
    pub fn cache_spec(&self, capacity: usize) -> CacheSpec {
        CacheSpec {
            num_layers: self.config.num_hidden_layers,
            num_kv_heads: self.config.num_key_value_heads,
            head_dim: self.config.head_dim,
            capacity,
        }
    }

    /// Allocates a session KV cache for this model holding up to `capacity` entries.
    pub fn new_cache(&self, capacity: usize) -> Result<SessionCache, ModelError> {
        Ok(SessionCache::new(
            self.cache_spec(capacity),
            self.dtype,
            &self.device,
        )?)
    }

    /// The causal mask over `n` new tokens after `past` cached ones: `(n, past + n)`.
    fn causal_mask(&self, n: usize, past: usize) -> Result<Tensor, ModelError> {
        let tri = {
            let mut masks = self.causal.lock().unwrap_or_else(|e| e.into_inner());
            match masks.get(&n) {
                Some(t) => t.clone(),
                None => {
                    let data: Vec<f32> = (0..n)
                        .flat_map(|i| {
                            (0..n).map(move |j| if j <= i { 0.0 } else { f32::NEG_INFINITY })
                        })
                        .collect();
                    let t = Tensor::from_vec(data, (n, n), &self.device)?.to_dtype(self.dtype)?;
                    masks.insert(n, t.clone());
                    t
                }
            }
        };
        if past == 0 {
            return Ok(tri);
        }
        let zeros = Tensor::zeros((n, past), self.dtype, &self.device)?;
        Ok(Tensor::cat(&[&zeros, &tri], 1)?)
    }

    /// Appends `tokens` to the end of `cache` (causal, positions following the cached ones),
    /// computing no logits a caller needs: a draft's prefill. Where the model runs wide fused
    /// passes (bf16 on CUDA, [`KernelOptions::wide_rows`]), the tokens go through in passes of
    /// up to [`crate::fused::WIDE_MAX_ROWS`] rows; else, where it runs the batch-invariant rows
    /// kernels, in passes of [`crate::fused::BI_MAX_ROWS`] rows, about ten launches a layer
    /// each, instead of one pass of candle's batched ops (several times the launches): faster
    /// for a small, launch-bound model (0.5B shape, 127 tokens: 9.8–10.6 → 7.2 ms with the
    /// draft's first chain).
    pub fn prefill(&self, tokens: &[u32], cache: &mut SessionCache) -> Result<(), ModelError> {
        let (wide, rows) = (crate::fused::WIDE_MAX_ROWS, crate::fused::BI_MAX_ROWS);
        let size = if self.gpu_wide(tokens.len().min(wide)) {
            wide
        } else if self.exact_rows_fit(cache.capacity(), rows) {
            rows
        } else {
            tokens.len().max(1)
        };
        for part in tokens.chunks(size) {
            let at = cache.len() as u32;
            let pos: Vec<u32> = (at..at + part.len() as u32).collect();
            self.forward(
                &Tensor::new(part, &self.device)?,
                &Tensor::new(pos.as_slice(), &self.device)?,
                None,
                cache,
                &Tensor::new(&[part.len() as u32 - 1], &self.device)?,
            )?;
        }
        Ok(())
    }

    /// Runs `n` new tokens through the model.
    ///
    /// - `tokens`: u32 `(n,)`; `positions`: u32 `(n,)` rotary position ids (any order, any values
    ///   below `max_position_embeddings`);
    /// - `mask`: additive `(n, cache.len() + n)` in the model dtype (0 = visible, -inf = hidden),
    ///   or `None` for causal attention over the new tokens with the whole cached prefix visible;
    /// - appends the tokens' K/V to `cache` (its length grows by `n`);
    /// - returns f32 logits `(rows.len(), vocab)` for the row indices `rows` (u32, in `0..n`).
    pub fn forward(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        mask: Option<&Tensor>,
        cache: &mut SessionCache,
        rows: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let vis = mask.map_or(Visibility::Causal { past: cache.len() }, Visibility::Mask);
        self.forward_pass(tokens, positions, vis, cache, rows)
    }

    /// [`Transformer::forward`] of the rows of a token tree described on the host (`tree`'s
    /// prefix must be the cached slots before its first node, `tree.prefix + tree.first_row ==
    /// cache.len()`): what `forward` computes with `tree.to_tensor` as the mask, without reading
    /// a device mask back to the host; the mask is only built on the device for the passes that
    /// use one.
    pub fn forward_tree(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        tree: TreeRows<'_>,
        cache: &mut SessionCache,
        rows: &Tensor,
    ) -> Result<Tensor, ModelError> {
        if tree.prefix + tree.first_row != cache.len() {
            return Err(ModelError::Input(format!(
                "the tree's rows start after {} + {} slots but the cache holds {}",
                tree.prefix,
                tree.first_row,
                cache.len()
            )));
        }
        self.forward_pass(tokens, positions, Visibility::Tree(tree), cache, rows)
    }

    fn forward_pass(
        &self,
        tokens: &Tensor,
        positions: &Tensor,
        vis: Visibility<'_>,
        cache: &mut SessionCache,
        rows: &Tensor,
    ) -> Result<Tensor, ModelError> {
        specsplit_core::device::bind_to_thread(&self.device)?;
        let c = &self.config;
        let n = tokens.dims1().map_err(|_| {
            ModelError::Input(format!("tokens must be 1-D, got {:?}", tokens.dims()))
        })?;
        if n == 0 {
            return Err(ModelError::Input("no tokens given".into()));
        }
        if positions.dims() != [n] {
            return Err(ModelError::Input(format!(
                "positions have shape {:?}, expected ({n},)",
                positions.dims()
            )));
        }
        if rows.rank() != 1 {
            return Err(ModelError::Input(format!(
                "rows must be 1-D, got {:?}",
                rows.dims()
            )));
        }
        for (what, t) in [("tokens", tokens), ("positions", positions), ("rows", rows)] {
            if t.dtype() != DType::U32 {
                return Err(ModelError::Input(format!(
                    "{what} must be u32, got {:?}",
                    t.dtype()
                )));
            }
        }
        let spec = cache.spec();
        if *spec != self.cache_spec(spec.capacity) || cache.dtype() != self.dtype {
            return Err(ModelError::Input(format!(
                "cache {spec:?} ({:?}) does not fit this model ({:?}, {:?}); create it with \
                 Transformer::new_cache",
                cache.dtype(),
                self.cache_spec(spec.capacity),
                self.dtype
            )));
        }
        let past = cache.len();
        let total = past + n;
        let gpu_exact = self.gpu_batch_invariant(n);
        // Never both: a wide pass has more rows than a batch-invariant one may.
        let gpu_wide = self.gpu_wide(n);
        if total > cache.capacity() {
            return Err(specsplit_core::cache::CacheError::CapacityExceeded {
                needed: total,
                capacity: cache.capacity(),
            }
            .into());
        }
        if let Visibility::Mask(m) = &vis {
            if m.dims() != [n, total] {
                return Err(ModelError::Input(format!(
                    "mask has shape {:?}, expected ({n}, {total}) = (new tokens, cached + new)",
                    m.dims()
                )));
            }
        }
        // The batch-invariant paths need each row's visible keys (computed once per pass) and
        // no device mask; the batched path needs the mask.
        let per_row = self.exact_attention() || gpu_exact || gpu_wide;
        let mask = match vis {
            _ if per_row => None,
            Visibility::Mask(m) => Some(m.to_dtype(self.dtype)?),
            Visibility::Tree(t) => Some(t.to_tensor(n, self.dtype, &self.device)?),
            Visibility::Causal { .. } if n == 1 => None,
            Visibility::Causal { .. } => Some(self.causal_mask(n, past)?),
        };
        let eps = c.rms_norm_eps as f32;
        let row_keys = if per_row {
            Some(RowKeys::new(vis, n)?)
        } else {
            None
        };
        let pass_keys = match &row_keys {
            Some(keys) if gpu_exact || gpu_wide => Some(crate::fused::PassKeys::new(
                &keys.split_rows(),
                &self.device,
            )?),
            _ => None,
        };
        if let Some(keys) = &pass_keys {
            if let Some(layers) = self.fused_layers() {
                // A wide pass (a prompt's prefill) needs no batch invariance: cuBLAS products.
                let launch = self.kernels.launch();
                let bi = |x: &Tensor, w: &Tensor, b: Option<&Tensor>| {
                    crate::fused::bi_matmul(x, w, b, launch)
                };
                let product: Product<'_> = if gpu_exact {
                    &bi
                } else {
                    &crate::fused::cublas_product
                };
                return self
                    .forward_fused_rows(&layers, product, tokens, positions, keys, cache, rows);
            }
        }
        let cos = self.cos.index_select(positions, 0)?;
        let sin = self.sin.index_select(positions, 0)?;
        let path = match (&pass_keys, &row_keys) {
            (Some(keys), _) => AttnPath::Fused(keys),
            (None, Some(keys)) => AttnPath::PerRow(keys),
            (None, None) => AttnPath::Batched(mask.as_ref()),
        };
        let mut x = self.embed.forward(tokens, self.dtype)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let a = self.attention(i, layer, &h, (&cos, &sin), &path, cache)?;
            x = (x + a)?;
            x = (&x + layer.mlp(&x, eps, &self.kernels)?)?;
        }
        cache.advance(n)?;
        let x = x.index_select(rows, 0)?;
        let x = candle_nn::ops::rms_norm(&x, &self.norm, eps)?;
        Ok(self
            .lm_head
            .forward(&x, &self.kernels)?
            .to_dtype(DType::F32)?)
    }

    /// [`Transformer::forward`] of a pass with the fused kernels ([`Transformer::fused_stack`]
    /// with `product`, rotary and cache write for all rows, and the rows' attention): about 10
    /// launches a layer instead of about 19. With [`crate::fused::bi_matmul`] every kernel
    /// computes a row from that row alone, so the pass is batch-invariant; a wide pass uses
    /// [`crate::fused::cublas_product`].
    #[allow(clippy::too_many_arguments)]
    fn forward_fused_rows(
        &self,
        layers: &[FusedLayer<'_>],
        product: Product<'_>,
        tokens: &Tensor,
        positions: &Tensor,
        keys: &crate::fused::PassKeys,
        cache: &mut SessionCache,
        rows: &Tensor,
    ) -> Result<Tensor, ModelError> {
        use crate::fused;
        let past = cache.len();
        let (shape, scale) = self.fused_attn_shape(cache.capacity());
        let store: &SessionCache = cache;
        let launch = self.kernels.launch();
        let (h, head) = self.fused_stack(layers, tokens, product, |i, qkv| {
            let (kb, vb) = store.buffers(i)?;
            let q = fused::qkv_rope_rows(
                qkv,
                &self.cos,
                &self.sin,
                positions,
                kb,
                vb,
                Some(past),
                shape,
                self.rope_interleaved,
                launch,
            )?;
            Ok(fused::rows_attention(
                &q, kb, vb, keys, shape, scale, launch,
            )?)
        })?;
        cache.advance(tokens.dim(0)?)?;
        let h = h.index_select(rows, 0)?;
        Ok(product(&h, head, None)?.to_dtype(DType::F32)?)
    }

    /// The attention shape of the fused kernels over caches of `capacity` slots, and the
    /// attention scale.
    fn fused_attn_shape(&self, capacity: usize) -> (crate::fused::AttnShape, f32) {
        let c = &self.config;
        let shape = crate::fused::AttnShape {
            heads: c.num_attention_heads,
            kv: c.num_key_value_heads,
            head_dim: c.head_dim,
            capacity,
        };
        (shape, 1.0 / (c.head_dim as f32).sqrt())
    }

    /// The fused layer stack shared by the graph step and the batch-invariant passes: embeds
    /// `tokens`, then per layer add+RMSNorm, the Q|K|V product, `attend(layer, qkv)` (rotary,
    /// cache write and attention), the output product, add+RMSNorm, the gate|up product, the
    /// SwiGLU gate and the down product, with `product` for every dense product. Returns the
    /// final-normed hidden rows and the head's weight.
    fn fused_stack<'a>(
        &'a self,
        layers: &[FusedLayer<'_>],
        tokens: &Tensor,
        product: Product<'_>,
        mut attend: impl FnMut(usize, &Tensor) -> Result<Tensor, ModelError>,
    ) -> Result<(Tensor, &'a Tensor), ModelError> {
        use crate::fused;
        let Linear::Dense { w: head, .. } = &self.lm_head else {
            return Err(ModelError::Unsupported(
                "fused kernels with a quantized head".into(),
            ));
        };
        let eps = self.config.rms_norm_eps as f32;
        let launch = self.kernels.launch();
        let x = self.embed.forward(tokens, self.dtype)?;
        let first_norm = layers.first().map_or(&self.norm, |l| &l.layer.attn_norm);
        let (mut x, mut h) = fused::add_rmsnorm(&x, None, first_norm, eps, launch)?;
        for (i, l) in layers.iter().enumerate() {
            let qkv = product(&h, &l.qkv.0, l.qkv.1.as_ref())?;
            let y = attend(i, &qkv)?;
            let a = product(&y, &l.o.0, l.o.1.as_ref())?;
            (x, h) = fused::add_rmsnorm(&x, Some(&a), &l.layer.mlp_norm, eps, launch)?;
            let gu = product(&h, &l.gate_up.0, l.gate_up.1.as_ref())?;
            let m = product(&fused::silu_mul(&gu, launch)?, &l.down.0, l.down.1.as_ref())?;
            let next_norm = layers.get(i + 1).map_or(&self.norm, |n| &n.layer.attn_norm);
            (x, h) = fused::add_rmsnorm(&x, Some(&m), next_norm, eps, launch)?;
        }
        Ok((h, head))
    }

    /// Rotary embedding of `x` `(1, heads, n, head_dim)` with gathered `(n, head_dim / 2)`
    /// tables, in the pair layout the weights were stored in.
    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> candle_core::Result<Tensor> {
        if self.rope_interleaved {
            candle_nn::rotary_emb::rope_i(x, cos, sin)
        } else {
            candle_nn::rotary_emb::rope(x, cos, sin)
        }
    }

    /// Whether [`Transformer::static_step`] may be captured into a CUDA graph for this model:
    /// dense weights on CUDA (quantized kernels stay on the eager path).
    pub fn graph_capturable(&self) -> bool {
        self.device.is_cuda() && matches!(self.lm_head, Linear::Dense { .. })
    }

    /// Whether any projection keeps quantized (GGUF) weights.
    pub fn is_quantized(&self) -> bool {
        let quant = |l: &Linear| l.is_quantized();
        let proj = |p: &Proj| match p {
            Proj::Fused { lin, .. } => quant(lin),
            Proj::Split(ls) => ls.iter().any(quant),
        };
        quant(&self.lm_head)
            || self
                .layers
                .iter()
                .any(|l| proj(&l.qkv) || proj(&l.gate_up) || quant(&l.o) || quant(&l.down))
    }

    /// Device buffers for [`Transformer::static_step`] over caches of `capacity` entries.
    pub fn static_step_buffers(&self, capacity: usize) -> Result<StaticStep, ModelError> {
        specsplit_core::device::bind_to_thread(&self.device)?;
        let dev = &self.device;
        let slots: Vec<u32> = (0..capacity as u32).collect();
        Ok(StaticStep {
            token: Tensor::zeros(1, DType::U32, dev)?,
            position: Tensor::zeros(1, DType::U32, dev)?,
            next: Tensor::zeros(1, DType::U32, dev)?,
            next_logprob: Tensor::zeros(1, DType::F32, dev)?,
            slots: Tensor::new(slots.as_slice(), dev)?,
            visible: Tensor::zeros(capacity, self.dtype, dev)?,
            hidden: Tensor::full(f32::NEG_INFINITY, capacity, dev)?
                .to_dtype(self.dtype)?
                .contiguous()?,
            one: Tensor::new(&[1u32], dev)?,
            capacity,
        })
    }

    /// One greedy decode step in which no shape depends on the cache length, so that it can be
    /// captured once into a CUDA graph and replayed: reads the token and its position from
    /// `b.token` / `b.position`, writes the token's K/V into every layer's cache buffer at that
    /// position (a device-side index), attends over the whole capacity under a mask computed on
    /// the device (slots `0..=position` visible), then writes the greedy next token and its
    /// log-probability to `b.next` / `b.next_logprob`, copies the next token into `b.token` and
    /// increments `b.position`. Nothing is copied to or from the host, and the cache's length
    /// is left alone (the caller owns that bookkeeping).
    ///
    /// In bf16 on CUDA with [`KernelOptions::fused`] on (the default) the step runs the fused
    /// kernels (about 8 launches a layer, attention over the valid slots only); otherwise
    /// candle's ops.
    pub fn static_step(&self, b: &StaticStep, cache: &SessionCache) -> Result<(), ModelError> {
        let c = &self.config;
        let cap = b.capacity;
        if cache.capacity() != cap || *cache.spec() != self.cache_spec(cap) {
            return Err(ModelError::Input(format!(
                "static step buffers are for {cap} entries, the cache is {:?}",
                cache.spec()
            )));
        }
        // The fused step indexes the rotary tables by slot: they must cover the capacity.
        if self.cos.dim(0)? >= cap {
            if let Some(layers) = self.fused_layers() {
                return self.static_step_fused(&layers, b, cache);
            }
        }
        let (heads, kv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let rep = heads / kv;
        let eps = c.rms_norm_eps as f32;
        let scale = 1.0 / (hd as f64).sqrt();
        let pos = &b.position;
        let cos = self.cos.index_select(pos, 0)?;
        let sin = self.sin.index_select(pos, 0)?;
        let mask = b
            .slots
            .broadcast_le(pos)?
            .where_cond(&b.visible, &b.hidden)?
            .reshape((1, 1, 1, cap))?
            // Expanded once per step, so each layer's add needs no broadcast parameters.
            .broadcast_as((1, kv, rep, cap))?
            .contiguous()?;
        let write_at = pos
            .reshape((1, 1, 1, 1))?
            .broadcast_as((1, kv, 1, hd))?
            .contiguous()?;
        let mut x = self.embed.forward(&b.token, self.dtype)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let qkv = layer.qkv.forward(&h, &self.kernels)?;
            let q = qkv[0].reshape((1, heads, 1, hd))?.contiguous()?;
            let k = qkv[1].reshape((1, kv, 1, hd))?.contiguous()?;
            let v = qkv[2].reshape((1, kv, 1, hd))?.contiguous()?;
            let (q, k) = (self.rope(&q, &cos, &sin)?, self.rope(&k, &cos, &sin)?);
            let (kb, vb) = cache.buffers(i)?;
            kb.scatter_set(&write_at, &k, 2)?;
            vb.scatter_set(&write_at, &v, 2)?;
            let q = q.reshape((1, kv, rep, hd))?;
            let att = ((q.matmul(&kb.t()?)? * scale)? + &mask)?;
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            let y = att.matmul(vb)?.reshape((1, heads * hd))?;
            x = (x + layer.o.forward(&y, &self.kernels)?)?;
            x = (&x + layer.mlp(&x, eps, &self.kernels)?)?;
        }
        let x = candle_nn::ops::rms_norm(&x, &self.norm, eps)?;
        let logits = self
            .lm_head
            .forward(&x, &self.kernels)?
            .to_dtype(DType::F32)?;
        let next = logits.argmax_keepdim(1)?.reshape(1)?;
        let lp = (logits.max_keepdim(1)? - logits.log_sum_exp(1)?.unsqueeze(1)?)?.reshape(1)?;
        b.next.slice_set(&next, 0, 0)?;
        b.next_logprob.slice_set(&lp, 0, 0)?;
        b.token.slice_set(&next, 0, 0)?;
        b.position.slice_set(&(pos + &b.one)?, 0, 0)?;
        Ok(())
    }

    /// Whether a one-row [`Transformer::exact_rows`] (the exact decoding step) runs for this
    /// model over caches of `capacity` slots: exactly when a one-token [`Transformer::forward`]
    /// takes the fused batch-invariant path (bf16 on CUDA, dense weights the kernels take, the
    /// fused kernels and batch invariance on), and the rotary tables cover the capacity.
    pub fn exact_step_fits(&self, capacity: usize) -> bool {
        self.exact_shape_fits(capacity) && self.fused_layers().is_some()
    }

    /// [`Transformer::exact_step_fits`] but for the fused layer stack.
    fn exact_shape_fits(&self, capacity: usize) -> bool {
        capacity > 0 && self.gpu_batch_invariant(1) && self.cos.dim(0).is_ok_and(|d| d >= capacity)
    }

    /// Whether [`Transformer::exact_rows`] and [`Transformer::static_rows_step`] run for this
    /// model over caches of `capacity` slots with `rows` rows: [`Transformer::exact_step_fits`]
    /// and at most [`crate::fused::BI_MAX_ROWS`] rows.
    pub fn exact_rows_fit(&self, capacity: usize, rows: usize) -> bool {
        (1..=crate::fused::BI_MAX_ROWS).contains(&rows)
            && self.gpu_batch_invariant(rows)
            && self.exact_step_fits(capacity)
    }

    /// Device buffers for [`Transformer::exact_rows`] over caches of `capacity` slots and
    /// chains of `rows` tokens.
    pub fn exact_rows_buffers(
        &self,
        capacity: usize,
        rows: usize,
    ) -> Result<ExactRows, ModelError> {
        specsplit_core::device::bind_to_thread(&self.device)?;
        let dev = &self.device;
        let n = rows;
        if n == 0 || n > crate::fused::BI_MAX_ROWS {
            return Err(ModelError::Input(format!(
                "a rows pass takes 1 to {} rows, not {n}",
                crate::fused::BI_MAX_ROWS
            )));
        }
        let io = Tensor::zeros(4 * n, DType::U32, dev)?;
        let keys = crate::fused::PassKeys::device_rows(
            io.narrow(0, 2 * n, 2 * n)?.reshape((n, 2))?,
            capacity,
        )?;
        Ok(ExactRows {
            tokens: io.narrow(0, 0, n)?,
            positions: io.narrow(0, n, n)?,
            keys,
            io,
            logits: Tensor::zeros((n, self.config.vocab_size), DType::F32, dev)?,
            rows: n,
            capacity,
        })
    }

    /// A chain of tokens after the cached sequence through the model with the same kernels
    /// and the same arithmetic as a batch-invariant [`Transformer::forward`] of those rows
    /// (each row's logits bit-identical to that pass's, so to the token decoded alone), with
    /// no shape that depends on the cache length, so it can be captured once into a CUDA graph
    /// and replayed: reads the tokens and their positions (= slots) from `b` (set by
    /// [`ExactRows::start`]), writes their K/V at those slots, attends row `r` over slots
    /// `0..=position_r` (key counts read on the device) and writes the rows' f32 logits to
    /// `b.logits`. The cache's length is left alone (the caller advances it). Fails unless
    /// [`Transformer::exact_rows_fit`] holds.
    pub fn exact_rows(&self, b: &ExactRows, cache: &SessionCache) -> Result<(), ModelError> {
        let (h, head) = self.exact_rows_stack(b, cache)?;
        let logits =
            crate::fused::bi_matmul(&h, head, None, self.kernels.launch())?.to_dtype(DType::F32)?;
        b.logits.slice_set(&logits, 0, 0)?;
        Ok(())
    }

    /// [`Transformer::exact_rows`] as a greedy decode step of several tokens: the rows go
    /// through the same layers, then the last row's greedy next token and log-probability are
    /// written to `step.next` / `step.next_logprob`, the token into `step.token`, and
    /// `step.position` is incremented, so the caller sets it to the last row's position first
    /// and [`Transformer::static_step`] continues from there. `b.logits` is left alone. Up to
    /// [`crate::fused::GEMV_MAX_ROWS`] rows, the rows go through [`Transformer::static_step`]'s kernels instead, each over every row at once
    /// (each weight read once), so that every row comes out bit for bit as one step a token
    /// would give it: a draft needs no batch invariance, and those kernels are the shorter
    /// pass (0.5B shape, H100: the draft's rounds 0.14 ms shorter).
    pub fn static_rows_step(
        &self,
        b: &ExactRows,
        step: &StaticStep,
        cache: &SessionCache,
    ) -> Result<(), ModelError> {
        let (h, head) = match self.fused_layers() {
            Some(layers)
                if b.rows <= crate::fused::GEMV_MAX_ROWS
                    && self.exact_rows_fit(b.capacity, b.rows) =>
            {
                // The step kernels read the first row's position; the rows follow it.
                let first = b.positions.narrow(0, 0, 1)?;
                self.step_stack(&layers, &b.tokens, &first, b.capacity, cache)?
            }
            _ => self.exact_rows_stack(b, cache)?,
        };
        let last = h.narrow(0, b.rows - 1, 1)?;
        let launch = self.kernels.launch();
        let logits = crate::fused::gemv(&last, head, None, launch)?;
        crate::fused::greedy_head(
            &logits,
            &step.next,
            &step.next_logprob,
            &step.token,
            &step.position,
            launch,
        )?;
        Ok(())
    }

    /// The layers of [`Transformer::exact_rows`]: the final-normed hidden rows and the head.
    fn exact_rows_stack<'a>(
        &'a self,
        b: &ExactRows,
        cache: &SessionCache,
    ) -> Result<(Tensor, &'a Tensor), ModelError> {
        use crate::fused;
        let cap = b.capacity;
        if cache.capacity() != cap || *cache.spec() != self.cache_spec(cap) {
            return Err(ModelError::Input(format!(
                "exact rows buffers are for {cap} entries, the cache is {:?}",
                cache.spec()
            )));
        }
        let layers = match self.fused_layers() {
            Some(l) if self.exact_rows_fit(cap, b.rows) => l,
            _ => {
                return Err(ModelError::Unsupported(format!(
                    "no exact {}-row pass for this model (needs bf16 on CUDA with the fused \
                     batch-invariant kernels)",
                    b.rows
                )))
            }
        };
        let (shape, scale) = self.fused_attn_shape(cap);
        let launch = self.kernels.launch();
        let product =
            |x: &Tensor, w: &Tensor, b: Option<&Tensor>| fused::bi_matmul(x, w, b, launch);
        self.fused_stack(&layers, &b.tokens, &product, |i, qkv| {
            let (kb, vb) = cache.buffers(i)?;
            // The rows kernel of a pass, with the slots read from the positions.
            let q = fused::qkv_rope_rows(
                qkv,
                &self.cos,
                &self.sin,
                &b.positions,
                kb,
                vb,
                None,
                shape,
                self.rope_interleaved,
                launch,
            )?;
            Ok(fused::rows_attention(
                &q, kb, vb, &b.keys, shape, scale, launch,
            )?)
        })
    }

    /// The dense weights of every layer when the fused one-token kernels are enabled and apply
    /// to this model (bf16 on CUDA, fused Q|K|V and gate|up projections, head size 64 or 128, widths that
    /// are multiples of 8), else `None`.
    fn fused_layers(&self) -> Option<Vec<FusedLayer<'_>>> {
        let c = &self.config;
        let fits = self.kernels.fused
            && crate::fused::applies(&self.norm)
            && matches!(c.head_dim, 64 | 128)
            && c.hidden_size.is_multiple_of(8)
            && c.intermediate_size.is_multiple_of(8)
            && (c.num_attention_heads * c.head_dim).is_multiple_of(8)
            && self.cos.is_contiguous()
            && self.sin.is_contiguous()
            && matches!(&self.lm_head, Linear::Dense { w, b: None } if crate::fused::weight_fits(w));
        if !fits {
            return None;
        }
        self.layers
            .iter()
            .map(|l| {
                let dense = |lin: &'_ Linear| match lin {
                    Linear::Dense { w, b } if crate::fused::weight_fits(w) => {
                        Some((w.clone(), b.clone()))
                    }
                    _ => None,
                };
                let fused = |p: &'_ Proj, parts: usize| match p {
                    Proj::Fused { lin, sizes } if sizes.len() == parts => dense(lin),
                    _ => None,
                };
                Some(FusedLayer {
                    layer: l,
                    qkv: fused(&l.qkv, 3)?,
                    o: dense(&l.o)?,
                    gate_up: fused(&l.gate_up, 2)?,
                    down: dense(&l.down)?,
                })
            })
            .collect()
    }

    /// [`Transformer::static_step`] with the fused kernels ([`Transformer::fused_stack`] with
    /// the GEMV, rotary and cache write at the device-side position, and single-query
    /// attention); then the head and the greedy pick, which also advances `b.token` /
    /// `b.position`.
    fn static_step_fused(
        &self,
        layers: &[FusedLayer<'_>],
        b: &StaticStep,
        cache: &SessionCache,
    ) -> Result<(), ModelError> {
        use crate::fused;
        let (h, head) = self.step_stack(layers, &b.token, &b.position, b.capacity, cache)?;
        let launch = self.kernels.launch();
        let logits = fused::gemv(&h, head, None, launch)?;
        fused::greedy_head(
            &logits,
            &b.next,
            &b.next_logprob,
            &b.token,
            &b.position,
            launch,
        )?;
        Ok(())
    }

    /// The layers of the fused step ([`Transformer::fused_stack`] with the GEMV, rotary and
    /// cache write at device-side positions and decode attention) for one to
    /// [`crate::fused::GEMV_MAX_ROWS`] consecutive tokens, the first at cache slot `position`
    /// (a `(1,)` u32 buffer) over caches of `capacity` slots: the final-normed rows and the head.
    fn step_stack<'a>(
        &'a self,
        layers: &[FusedLayer<'_>],
        tokens: &Tensor,
        position: &Tensor,
        capacity: usize,
        cache: &SessionCache,
    ) -> Result<(Tensor, &'a Tensor), ModelError> {
        use crate::fused;
        let (shape, scale) = self.fused_attn_shape(capacity);
        let launch = self.kernels.launch();
        let product =
            |x: &Tensor, w: &Tensor, b: Option<&Tensor>| fused::gemv_rows(x, w, b, launch);
        self.fused_stack(layers, tokens, &product, |i, qkv| {
            let (kb, vb) = cache.buffers(i)?;
            let q = fused::qkv_rope_cache(
                qkv,
                &self.cos,
                &self.sin,
                position,
                kb,
                vb,
                shape,
                self.rope_interleaved,
                launch,
            )?;
            Ok(fused::decode_attention(
                &q, kb, vb, position, shape, scale, launch,
            )?)
        })
    }

    /// Whether attention runs the batch-invariant per-row path: always on the CPU, and on CUDA
    /// for quantized models (whose 8-bit activation rounding turns any last-bit difference of
    /// a batched attention into a visible change of the logits).
    fn exact_attention(&self) -> bool {
        self.device.is_cpu() || self.lm_head.is_quantized()
    }

    /// Whether a CUDA pass of `n` rows runs the batch-invariant kernels end to end (products
    /// and attention): [`KernelOptions::batch_invariant`] on, a dense bf16 model whose widths
    /// the kernels take, and `n` at most [`crate::fused::BI_MAX_ROWS`].
    fn gpu_batch_invariant(&self, n: usize) -> bool {
        n <= crate::fused::BI_MAX_ROWS
            && self.kernels.batch_invariant
            && self.gpu_rows_kernels_fit()
    }

    /// Whether a CUDA pass of `n` rows runs as one wide fused pass (see
    /// [`crate::fused::WIDE_MAX_ROWS`]): more rows than the batch-invariant passes take, at most
    /// the wide limit, [`KernelOptions::wide_rows`] on, and a model the rows kernels take.
    fn gpu_wide(&self, n: usize) -> bool {
        n > crate::fused::BI_MAX_ROWS
            && n <= crate::fused::WIDE_MAX_ROWS
            && self.kernels.wide_rows
            && self.gpu_rows_kernels_fit()
    }

    /// Whether the rows kernels ([`crate::fused::rows_attention`], the rotary and cache write
    /// of every row) take this model: dense bf16 on CUDA, head size 64 or 128, at most
    /// [`crate::fused::RA_MAX_REP`] query heads a KV head, widths that are multiples of 32.
    fn gpu_rows_kernels_fit(&self) -> bool {
        let c = &self.config;
        crate::fused::applies(&self.norm)
            && matches!(c.head_dim, 64 | 128)
            && c.num_key_value_heads > 0
            && c.num_attention_heads / c.num_key_value_heads <= crate::fused::RA_MAX_REP
            && c.hidden_size.is_multiple_of(32)
            && c.intermediate_size.is_multiple_of(32)
            && (c.num_attention_heads * c.head_dim).is_multiple_of(32)
            && !self.is_quantized()
    }

    fn attention(
        &self,
        index: usize,
        layer: &Layer,
        h: &Tensor,
        (cos, sin): (&Tensor, &Tensor),
        path: &AttnPath<'_>,
        cache: &mut SessionCache,
    ) -> Result<Tensor, ModelError> {
        let c = &self.config;
        let n = h.dim(0)?;
        let (heads, kv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let rep = heads / kv;
        let qkv = layer.qkv.forward(h, &self.kernels)?;
        let (q, k, v) = (&qkv[0], &qkv[1], &qkv[2]);
        let q = q
            .reshape((1, n, heads, hd))?
            .transpose(1, 2)?
            .contiguous()?;
        let k = k.reshape((1, n, kv, hd))?.transpose(1, 2)?.contiguous()?;
        let v = v.reshape((1, n, kv, hd))?.transpose(1, 2)?;
        let (q, k) = (self.rope(&q, cos, sin)?, self.rope(&k, cos, sin)?);
        let (k_all, v_all) = cache.append(index, &k, &v)?;
        let total = k_all.dim(2)?;
        let scale = 1.0 / (hd as f64).sqrt();
        let (mask, row_keys) = match path {
            AttnPath::Fused(keys) => {
                let (kb, vb) = cache.buffers(index)?;
                let shape = crate::fused::AttnShape {
                    heads,
                    kv,
                    head_dim: hd,
                    capacity: cache.capacity(),
                };
                let y = crate::fused::rows_attention(
                    &q.contiguous()?,
                    kb,
                    vb,
                    keys,
                    shape,
                    scale as f32,
                    self.kernels.launch(),
                )?;
                return Ok(layer.o.forward(&y, &self.kernels)?);
            }
            AttnPath::PerRow(keys) => (None, Some(*keys)),
            AttnPath::Batched(mask) => (*mask, None),
        };
        let k_t = k_all.t()?;
        let y = if let Some(keys) = row_keys {
            // Batch-invariant attention (CPU; quantized models on CUDA): a token is computed
            // bit-identically whether it is decoded alone or verified inside a tree (see
            // `cpu_attention`). Causal and chain rows read the cache in place; a tree node
            // gathers its prefix and ancestors.
            crate::cpu_attention::attention(&q, &k_all, &v_all, keys, scale)?
        } else {
            // Fold the query heads sharing a KV head into rows: (1, kv, rep * n, hd).
            let q = q.reshape((1, kv, rep * n, hd))?;
            let att = (q.matmul(&k_t)? * scale)?;
            let att = match mask {
                Some(m) => att.reshape((1, heads, n, total))?.broadcast_add(m)?,
                None => att,
            };
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            att.reshape((1, kv, rep * n, total))?.matmul(&v_all)?
        };
        let y = y
            .reshape((1, heads, n, hd))?
            .transpose(1, 2)?
            .reshape((n, heads * hd))?;
        Ok(layer.o.forward(&y, &self.kernels)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_rows_inputs_are_tokens_then_positions_then_key_counts() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let m = Transformer::random(cfg, 1, DType::F32, &Device::Cpu).unwrap();
        let b = m.exact_rows_buffers(16, 3).unwrap();
        b.start(&[7, 8, 9], 5).unwrap();
        let io: Vec<u32> = b.io.to_vec1().unwrap();
        assert_eq!(io, [7, 8, 9, 5, 6, 7, 6, 0, 7, 0, 8, 0]);
        assert_eq!(b.tokens.to_vec1::<u32>().unwrap(), [7, 8, 9]);
        assert_eq!(b.positions.to_vec1::<u32>().unwrap(), [5, 6, 7]);
        // Wrong token counts and chains past the capacity are refused.
        assert!(b.start(&[1, 2], 0).is_err());
        assert!(b.start(&[1, 2, 3], 14).is_err());
        b.start(&[1, 2, 3], 13).unwrap();
        assert!(m.exact_rows_buffers(16, 0).is_err());
        assert!(m
            .exact_rows_buffers(16, crate::fused::BI_MAX_ROWS + 1)
            .is_err());
        m.exact_rows_buffers(16, crate::fused::BI_MAX_ROWS).unwrap();
    }
}
