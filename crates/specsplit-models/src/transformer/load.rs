//! Building a [`Transformer`] from safetensors, GGUF files, named tensors or random weights.

use super::linear::{quant_linear, Embedding, Linear, Proj};
use super::{Layer, Transformer};
use crate::config::{ModelConfig, RopeScaling};
use crate::fused::KernelOptions;
use crate::weights::{gguf_config, hf_names, random_tensors, read_gguf};
use crate::ModelError;
use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QTensor};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU16, AtomicU64};
use std::sync::{Arc, Mutex, OnceLock};

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
            fused_fit: OnceLock::new(),
            logged_paths: AtomicU16::new(0),
            graph_setups: AtomicU64::new(0),
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
            fused_fit: OnceLock::new(),
            logged_paths: AtomicU16::new(0),
            graph_setups: AtomicU64::new(0),
            config,
        })
    }
}
