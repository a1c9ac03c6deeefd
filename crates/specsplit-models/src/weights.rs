//! Weight files: safetensors shard discovery, GGUF metadata, Hugging Face tensor names and seeded
//! random weights.

use crate::config::ModelConfig;
use crate::ModelError;
use candle_core::quantized::gguf_file;
use candle_core::{DType, Device, Tensor};
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// The safetensors files of a model directory: the shards named by
/// `model.safetensors.index.json` if present, else `model.safetensors`, else every
/// `*.safetensors` file in the directory (sorted).
pub fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let io_err = |path: &Path| {
        let path = path.display().to_string();
        move |source| ModelError::Io { path, source }
    };
    let index = dir.join("model.safetensors.index.json");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(io_err(&index))?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            ModelError::Weights(format!("{} is not valid JSON: {e}", index.display()))
        })?;
        let map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| {
                ModelError::Weights(format!("{} has no `weight_map` object", index.display()))
            })?;
        let mut shards = BTreeSet::new();
        for file in map.values() {
            let file = file.as_str().ok_or_else(|| {
                ModelError::Weights(format!(
                    "{}: weight_map values must be strings",
                    index.display()
                ))
            })?;
            shards.insert(file.to_string());
        }
        let files: Vec<PathBuf> = shards.into_iter().map(|f| dir.join(f)).collect();
        if let Some(missing) = files.iter().find(|f| !f.is_file()) {
            return Err(ModelError::NotFound(format!(
                "shard {} listed in {} does not exist",
                missing.display(),
                index.display()
            )));
        }
        return Ok(files);
    }
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io_err(dir))? {
        let path = entry.map_err(io_err(dir))?.path();
        if path.extension().is_some_and(|e| e == "safetensors") {
            files.push(path);
        }
    }
    files.sort();
    if files.is_empty() {
        return Err(ModelError::NotFound(format!(
            "no .safetensors files in {}",
            dir.display()
        )));
    }
    Ok(files)
}

/// Hugging Face tensor names of a Llama-family checkpoint.
pub mod hf_names {
    /// Token embedding matrix.
    pub const EMBED: &str = "model.embed_tokens.weight";
    /// Final RMSNorm weight.
    pub const NORM: &str = "model.norm.weight";
    /// LM head (absent when tied to the embedding).
    pub const LM_HEAD: &str = "lm_head.weight";

    /// Name of a tensor of layer `i`, e.g. `layer(3, "self_attn.q_proj.weight")`.
    pub fn layer(i: usize, suffix: &str) -> String {
        format!("model.layers.{i}.{suffix}")
    }
}

/// A tiny deterministic generator (splitmix64), so random models are identical everywhere.
struct SplitMix(u64);

impl SplitMix {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 23) as f32) - 1.0
    }
}

/// Seeded random weights with Hugging Face names for `config`, on `device` in `dtype`.
///
/// Scales keep activations and logits non-degenerate: embeddings have unit variance, every
/// projection has standard deviation `1/sqrt(fan_in)`, norms are `1 ± 0.2`, q/k/v biases (when the
/// config has them) have standard deviation 0.2. `lm_head.weight` is omitted when embeddings are
/// tied.
pub fn random_tensors(
    config: &ModelConfig,
    seed: u64,
    dtype: DType,
    device: &Device,
) -> Result<HashMap<String, Tensor>, ModelError> {
    config.validate()?;
    let mut rng = SplitMix(seed ^ 0x05EE_D0F5_BEC5_B117);
    let mut out = HashMap::new();
    let mut put = |name: String, dims: &[usize], std: f32, mean: f32| -> Result<(), ModelError> {
        let n: usize = dims.iter().product();
        let a = std * 3f32.sqrt();
        let data: Vec<f32> = (0..n).map(|_| mean + a * rng.uniform()).collect();
        let t = Tensor::from_vec(data, dims, device)?.to_dtype(dtype)?;
        out.insert(name, t);
        Ok(())
    };
    let (d, ffn) = (config.hidden_size, config.intermediate_size);
    let q_out = config.num_attention_heads * config.head_dim;
    let kv_out = config.num_key_value_heads * config.head_dim;
    let inv = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    put(hf_names::EMBED.into(), &[config.vocab_size, d], 1.0, 0.0)?;
    for i in 0..config.num_hidden_layers {
        let l = |s: &str| hf_names::layer(i, s);
        put(l("input_layernorm.weight"), &[d], 0.2 / 3f32.sqrt(), 1.0)?;
        put(l("self_attn.q_proj.weight"), &[q_out, d], inv(d), 0.0)?;
        put(l("self_attn.k_proj.weight"), &[kv_out, d], inv(d), 0.0)?;
        put(l("self_attn.v_proj.weight"), &[kv_out, d], inv(d), 0.0)?;
        if config.attention_bias {
            put(l("self_attn.q_proj.bias"), &[q_out], 0.2, 0.0)?;
            put(l("self_attn.k_proj.bias"), &[kv_out], 0.2, 0.0)?;
            put(l("self_attn.v_proj.bias"), &[kv_out], 0.2, 0.0)?;
        }
        put(l("self_attn.o_proj.weight"), &[d, q_out], inv(q_out), 0.0)?;
        put(
            l("post_attention_layernorm.weight"),
            &[d],
            0.2 / 3f32.sqrt(),
            1.0,
        )?;
        put(l("mlp.gate_proj.weight"), &[ffn, d], inv(d), 0.0)?;
        put(l("mlp.up_proj.weight"), &[ffn, d], inv(d), 0.0)?;
        put(l("mlp.down_proj.weight"), &[d, ffn], inv(ffn), 0.0)?;
    }
    put(hf_names::NORM.into(), &[d], 0.2 / 3f32.sqrt(), 1.0)?;
    if !config.tie_word_embeddings {
        put(
            hf_names::LM_HEAD.into(),
            &[config.vocab_size, d],
            inv(d),
            0.0,
        )?;
    }
    Ok(out)
}

/// Reads a GGUF file's header (metadata and tensor index, not the tensor data).
pub fn read_gguf(path: &Path) -> Result<gguf_file::Content, ModelError> {
    let mut file = std::fs::File::open(path).map_err(|source| ModelError::Io {
        path: path.display().to_string(),
        source,
    })?;
    gguf_file::Content::read(&mut file).map_err(|e| {
        ModelError::Weights(format!("{}: not a readable GGUF file: {e}", path.display()))
    })
}

/// The model configuration stored in a GGUF file's metadata (`llama` and `qwen2` architectures).
pub fn gguf_config(content: &gguf_file::Content) -> Result<ModelConfig, ModelError> {
    let md = &content.metadata;
    let arch = md
        .get("general.architecture")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .ok_or_else(|| ModelError::Config("GGUF metadata lacks general.architecture".into()))?;
    if !matches!(arch.as_str(), "llama" | "qwen2") {
        return Err(ModelError::Unsupported(format!(
            "GGUF architecture `{arch}` (supported: llama, qwen2)"
        )));
    }
    let get_u32 = |key: &str| -> Result<Option<u32>, ModelError> {
        match md.get(&format!("{arch}.{key}")) {
            None => Ok(None),
            Some(v) => v
                .to_u32()
                .or_else(|_| v.to_u64().map(|x| x as u32))
                .or_else(|_| v.to_i32().map(|x| x as u32))
                .map(Some)
                .map_err(|e| ModelError::Config(format!("GGUF key {arch}.{key}: {e}"))),
        }
    };
    let req_u32 = |key: &str| -> Result<usize, ModelError> {
        get_u32(key)?
            .map(|x| x as usize)
            .ok_or_else(|| ModelError::Config(format!("GGUF metadata lacks {arch}.{key}")))
    };
    let get_f32 = |key: &str| -> Result<Option<f32>, ModelError> {
        match md.get(&format!("{arch}.{key}")) {
            None => Ok(None),
            Some(v) => v
                .to_f32()
                .map(Some)
                .map_err(|e| ModelError::Config(format!("GGUF key {arch}.{key}: {e}"))),
        }
    };
    if let Some(kind) = md
        .get(&format!("{arch}.rope.scaling.type"))
        .and_then(|v| v.to_string().ok())
    {
        if kind != "none" {
            return Err(ModelError::Unsupported(format!(
                "GGUF rope scaling type `{kind}`"
            )));
        }
    }
    let hidden_size = req_u32("embedding_length")?;
    let num_attention_heads = req_u32("attention.head_count")?;
    let num_key_value_heads = get_u32("attention.head_count_kv")?
        .map(|x| x as usize)
        .unwrap_or(num_attention_heads);
    if num_attention_heads == 0 {
        return Err(ModelError::Config("GGUF head_count is zero".into()));
    }
    let head_dim = get_u32("attention.key_length")?
        .map(|x| x as usize)
        .unwrap_or(hidden_size / num_attention_heads);
    let embd = content
        .tensor_infos
        .get("token_embd.weight")
        .ok_or_else(|| ModelError::Weights("GGUF file lacks token_embd.weight".into()))?;
    let (vocab_size, _) = embd
        .shape
        .dims2()
        .map_err(|e| ModelError::Weights(format!("token_embd.weight: {e}")))?;
    let token = |key: &str| {
        md.get(key).and_then(|v| {
            v.to_u32()
                .ok()
                .or_else(|| v.to_i32().ok().map(|x| x as u32))
        })
    };
    let cfg = ModelConfig {
        vocab_size,
        hidden_size,
        intermediate_size: req_u32("feed_forward_length")?,
        num_hidden_layers: req_u32("block_count")?,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps: get_f32("attention.layer_norm_rms_epsilon")?.unwrap_or(1e-5) as f64,
        rope_theta: get_f32("rope.freq_base")?.unwrap_or(10_000.0) as f64,
        rope_scaling: None,
        max_position_embeddings: req_u32("context_length")?,
        tie_word_embeddings: !content.tensor_infos.contains_key("output.weight"),
        attention_bias: content.tensor_infos.contains_key("blk.0.attn_q.bias"),
        bos_token_id: token("tokenizer.ggml.bos_token_id"),
        eos_token_ids: token("tokenizer.ggml.eos_token_id").into_iter().collect(),
        architecture: arch,
    };
    cfg.validate()?;
    Ok(cfg)
}
