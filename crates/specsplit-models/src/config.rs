//! Model shape and hyper-parameters of a Llama-family decoder (Llama, Mistral, Qwen2, SmolLM).

use crate::ModelError;
use serde_json::Value;

/// Llama 3.1 style ("llama3") rotary frequency scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeScaling {
    /// Overall scaling factor applied to low frequencies.
    pub factor: f64,
    /// Wavelength threshold factor below which frequencies are fully scaled.
    pub low_freq_factor: f64,
    /// Wavelength threshold factor above which frequencies are kept.
    pub high_freq_factor: f64,
    /// The context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
}

/// Everything needed to build a transformer of the Llama family.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Architecture name (`llama`, `mistral`, `qwen2`).
    pub architecture: String,
    /// Vocabulary size (rows of the embedding and of the LM head).
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden_size: usize,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Number of query heads.
    pub num_attention_heads: usize,
    /// Number of key/value heads (GQA).
    pub num_key_value_heads: usize,
    /// Dimension of one attention head.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// Rotary embedding base.
    pub rope_theta: f64,
    /// Optional Llama 3.1 rotary scaling.
    pub rope_scaling: Option<RopeScaling>,
    /// Longest supported context (size of the rotary tables).
    pub max_position_embeddings: usize,
    /// Whether the LM head shares the token embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether the q/k/v projections have a bias (true for Qwen2).
    pub attention_bias: bool,
    /// Beginning-of-sequence token, if any.
    pub bos_token_id: Option<u32>,
    /// End-of-sequence tokens.
    pub eos_token_ids: Vec<u32>,
}

fn get_usize(v: &Value, key: &str) -> Result<Option<usize>, ModelError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_u64()
            .map(|n| Some(n as usize))
            .ok_or_else(|| ModelError::Config(format!("`{key}` must be a non-negative integer"))),
    }
}

fn req_usize(v: &Value, key: &str) -> Result<usize, ModelError> {
    get_usize(v, key)?.ok_or_else(|| ModelError::Config(format!("missing `{key}` in config.json")))
}

fn get_f64(v: &Value, key: &str) -> Result<Option<f64>, ModelError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_f64()
            .map(Some)
            .ok_or_else(|| ModelError::Config(format!("`{key}` must be a number"))),
    }
}

fn get_bool(v: &Value, key: &str) -> Result<Option<bool>, ModelError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_bool()
            .map(Some)
            .ok_or_else(|| ModelError::Config(format!("`{key}` must be a boolean"))),
    }
}

fn token_ids(v: &Value, key: &str) -> Result<Vec<u32>, ModelError> {
    let bad = || ModelError::Config(format!("`{key}` must be a token id or a list of token ids"));
    match v.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(xs)) => xs
            .iter()
            .map(|x| x.as_u64().map(|n| n as u32).ok_or_else(bad))
            .collect(),
        Some(x) => Ok(vec![x.as_u64().ok_or_else(bad)? as u32]),
    }
}

fn rope_scaling(v: &Value) -> Result<Option<RopeScaling>, ModelError> {
    let rs = match v.get("rope_scaling") {
        None | Some(Value::Null) => return Ok(None),
        Some(rs) => rs,
    };
    let kind = rs
        .get("rope_type")
        .or_else(|| rs.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    match kind {
        "default" => Ok(None),
        "llama3" => {
            let num = |k: &str| {
                get_f64(rs, k)?
                    .ok_or_else(|| ModelError::Config(format!("rope_scaling is missing `{k}`")))
            };
            Ok(Some(RopeScaling {
                factor: num("factor")?,
                low_freq_factor: num("low_freq_factor")?,
                high_freq_factor: num("high_freq_factor")?,
                original_max_position_embeddings: get_usize(
                    rs,
                    "original_max_position_embeddings",
                )?
                .ok_or_else(|| {
                    ModelError::Config(
                        "rope_scaling is missing `original_max_position_embeddings`".into(),
                    )
                })?,
            }))
        }
        other => Err(ModelError::Unsupported(format!(
            "rope_scaling type `{other}` (only `llama3` is supported)"
        ))),
    }
}

impl ModelConfig {
    /// Parses a Hugging Face `config.json` of a llama / mistral / qwen2 (SmolLM) model.
    pub fn from_hf_json(json: &str) -> Result<Self, ModelError> {
        let v: Value = serde_json::from_str(json)
            .map_err(|e| ModelError::Config(format!("config.json is not valid JSON: {e}")))?;
        let architecture = v
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| ModelError::Config("missing `model_type` in config.json".into()))?
            .to_string();
        if !matches!(architecture.as_str(), "llama" | "mistral" | "qwen2") {
            return Err(ModelError::Unsupported(format!(
                "model_type `{architecture}` (supported: llama, mistral, qwen2)"
            )));
        }
        if let Some(act) = v.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(ModelError::Unsupported(format!(
                    "hidden_act `{act}` (only silu)"
                )));
            }
        }
        let hidden_size = req_usize(&v, "hidden_size")?;
        let num_attention_heads = req_usize(&v, "num_attention_heads")?;
        if num_attention_heads == 0 {
            return Err(ModelError::Config(
                "num_attention_heads must be positive".into(),
            ));
        }
        let is_qwen2 = architecture == "qwen2";
        let cfg = Self {
            vocab_size: req_usize(&v, "vocab_size")?,
            hidden_size,
            intermediate_size: req_usize(&v, "intermediate_size")?,
            num_hidden_layers: req_usize(&v, "num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: get_usize(&v, "num_key_value_heads")?
                .unwrap_or(num_attention_heads),
            head_dim: get_usize(&v, "head_dim")?.unwrap_or(hidden_size / num_attention_heads),
            rms_norm_eps: get_f64(&v, "rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta: get_f64(&v, "rope_theta")?.unwrap_or(10_000.0),
            rope_scaling: rope_scaling(&v)?,
            max_position_embeddings: get_usize(&v, "max_position_embeddings")?.unwrap_or(4096),
            tie_word_embeddings: get_bool(&v, "tie_word_embeddings")?.unwrap_or(false),
            attention_bias: is_qwen2 || get_bool(&v, "attention_bias")?.unwrap_or(false),
            bos_token_id: token_ids(&v, "bos_token_id")?.first().copied(),
            eos_token_ids: token_ids(&v, "eos_token_id")?,
            architecture,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks that the dimensions are consistent (positive, heads divide evenly, even head_dim).
    pub fn validate(&self) -> Result<(), ModelError> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, value) in positive {
            if value == 0 {
                return Err(ModelError::Config(format!("{name} must be positive")));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return Err(ModelError::Config(format!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads, self.num_key_value_heads
            )));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(ModelError::Config(format!(
                "head_dim ({}) must be even for rotary embeddings",
                self.head_dim
            )));
        }
        Ok(())
    }

    /// Number of query heads sharing one key/value head.
    pub fn num_kv_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// A named model shape: `tiny` (tests), `smollm2-135m`, `qwen2.5-0.5b`, `qwen2.5-1.5b`,
    /// `qwen2.5-7b`, `llama3-8b`, `llama3.1-8b`.
    pub fn preset(name: &str) -> Option<Self> {
        let llama = |vocab, hidden, inter, layers, heads, kv, theta, max_pos, tie| Self {
            architecture: "llama".into(),
            vocab_size: vocab,
            hidden_size: hidden,
            intermediate_size: inter,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv,
            head_dim: hidden / heads,
            rms_norm_eps: 1e-5,
            rope_theta: theta,
            rope_scaling: None,
            max_position_embeddings: max_pos,
            tie_word_embeddings: tie,
            attention_bias: false,
            bos_token_id: None,
            eos_token_ids: Vec::new(),
        };
        let qwen = |vocab, hidden, inter, layers, heads, kv, tie| Self {
            architecture: "qwen2".into(),
            rms_norm_eps: 1e-6,
            attention_bias: true,
            bos_token_id: Some(151_643),
            eos_token_ids: vec![151_645, 151_643],
            ..llama(vocab, hidden, inter, layers, heads, kv, 1e6, 32_768, tie)
        };
        let cfg = match name {
            "tiny" => llama(512, 64, 160, 3, 4, 2, 10_000.0, 4096, false),
            "smollm2-135m" => Self {
                bos_token_id: Some(1),
                eos_token_ids: vec![2],
                ..llama(49_152, 576, 1536, 30, 9, 3, 100_000.0, 8192, true)
            },
            "qwen2.5-0.5b" => qwen(151_936, 896, 4864, 24, 14, 2, true),
            "qwen2.5-1.5b" => qwen(151_936, 1536, 8960, 28, 12, 2, true),
            "qwen2.5-7b" => qwen(152_064, 3584, 18_944, 28, 28, 4, false),
            "llama3-8b" => Self {
                bos_token_id: Some(128_000),
                eos_token_ids: vec![128_001, 128_009],
                ..llama(128_256, 4096, 14_336, 32, 32, 8, 500_000.0, 8192, false)
            },
            "llama3.1-8b" => Self {
                bos_token_id: Some(128_000),
                eos_token_ids: vec![128_001, 128_008, 128_009],
                rope_scaling: Some(RopeScaling {
                    factor: 8.0,
                    low_freq_factor: 1.0,
                    high_freq_factor: 4.0,
                    original_max_position_embeddings: 8192,
                }),
                ..llama(128_256, 4096, 14_336, 32, 32, 8, 500_000.0, 131_072, false)
            },
            _ => return None,
        };
        Some(cfg)
    }

    /// Names accepted by [`ModelConfig::preset`].
    pub const PRESETS: &'static [&'static str] = &[
        "tiny",
        "smollm2-135m",
        "qwen2.5-0.5b",
        "qwen2.5-1.5b",
        "qwen2.5-7b",
        "llama3-8b",
        "llama3.1-8b",
    ];
}
