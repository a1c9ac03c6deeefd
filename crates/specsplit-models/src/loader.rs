//! One call from a `--model` value to a ready transformer and its tokenizer:
//! [`source::resolve`] → weights → tokenizer, with the end-of-sequence
//! ids of the model configuration merged into the tokenizer.

use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::{DType, Device};

use crate::config::ModelConfig;
use crate::source::{self, ModelFiles, ResolvedModel};
use crate::tokenizer::TextTokenizer;
use crate::transformer::Transformer;
use crate::ModelError;

/// Where and in which precision to load a model.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    /// The device the weights are placed on.
    pub device: Device,
    /// Activation/weight dtype; `None`: f32 on CPU, bf16 on CUDA. GGUF models keep their
    /// quantized weights unless a dtype is given, which dequantizes them to it at load time
    /// (dense weights: more memory, but cuBLAS products and the CUDA-graph draft step).
    pub dtype: Option<DType>,
}

impl Default for LoadOptions {
    fn default() -> Self {
        Self {
            device: Device::Cpu,
            dtype: None,
        }
    }
}

impl LoadOptions {
    /// Default options on `device`.
    pub fn on(device: Device) -> Self {
        Self {
            device,
            dtype: None,
        }
    }

    /// The dtype actually used: the explicit one, else bf16 on CUDA and f32 elsewhere.
    pub fn effective_dtype(&self) -> DType {
        self.dtype.unwrap_or(if self.device.is_cuda() {
            DType::BF16
        } else {
            DType::F32
        })
    }
}

/// A loaded model with its tokenizer.
pub struct LoadedModel {
    /// Display name (alias, file stem, directory or repo name).
    pub name: String,
    /// The transformer.
    pub model: Transformer,
    /// The tokenizer, with the model's EOS ids merged in.
    pub tokenizer: TextTokenizer,
}

/// Resolves `spec` (see [`source::resolve`]) and loads the model and its tokenizer.
pub fn load_model(spec: &str, opts: &LoadOptions) -> Result<LoadedModel, ModelError> {
    load_resolved(&source::resolve(spec)?, opts)
}

/// Loads an already resolved model and its tokenizer.
pub fn load_resolved(
    resolved: &ResolvedModel,
    opts: &LoadOptions,
) -> Result<LoadedModel, ModelError> {
    let (model, mut tokenizer) = match &resolved.files {
        ModelFiles::Safetensors {
            dir,
            config,
            tokenizer,
            weights,
        } => {
            let cfg = read_hf_config(config)?;
            let mut tok = hf_tokenizer(dir, tokenizer, &cfg)?;
            let model =
                Transformer::from_safetensors(cfg, weights, opts.effective_dtype(), &opts.device)?;
            tok.add_eos_token_ids(&model.config().eos_token_ids);
            (model, tok)
        }
        ModelFiles::Gguf { path, tokenizer } => {
            let ct = read_gguf(path)?;
            let mut tok = gguf_tokenizer(&ct, tokenizer.as_deref())?;
            drop(ct);
            let model = match opts.dtype {
                Some(dt) => Transformer::from_gguf_dequantized(path, dt, &opts.device)?,
                None => Transformer::from_gguf(path, &opts.device)?,
            };
            tok.add_eos_token_ids(&model.config().eos_token_ids);
            (model, tok)
        }
        ModelFiles::Random { preset, seed } => {
            let cfg = preset_config(preset)?;
            // Random models use the byte-level tokenizer's own EOS only: the preset's EOS ids
            // mean nothing to a byte-level vocabulary.
            let tok = TextTokenizer::byte_level(cfg.vocab_size)?;
            let model = Transformer::random(cfg, *seed, opts.effective_dtype(), &opts.device)?;
            (model, tok)
        }
    };
    let model_vocab = model.config().vocab_size;
    if tokenizer.vocab_size() > model_vocab {
        return Err(ModelError::Config(format!(
            "{}: the tokenizer has {} ids but the model embeds only {model_vocab}",
            resolved.name,
            tokenizer.vocab_size()
        )));
    }
    if tokenizer.bos_token_id().is_none() {
        tokenizer.set_bos_token_id(model.config().bos_token_id);
    }
    Ok(LoadedModel {
        name: resolved.name.clone(),
        model,
        tokenizer,
    })
}

/// Loads only the tokenizer of a resolved model (no weights are read), with the EOS ids of its
/// configuration merged in.
pub fn load_tokenizer(resolved: &ResolvedModel) -> Result<TextTokenizer, ModelError> {
    match &resolved.files {
        ModelFiles::Safetensors {
            dir,
            config,
            tokenizer,
            ..
        } => hf_tokenizer(dir, tokenizer, &read_hf_config(config)?),
        ModelFiles::Gguf { path, tokenizer } => {
            gguf_tokenizer(&read_gguf(path)?, tokenizer.as_deref())
        }
        ModelFiles::Random { preset, .. } => {
            TextTokenizer::byte_level(preset_config(preset)?.vocab_size)
        }
    }
}

fn preset_config(preset: &str) -> Result<ModelConfig, ModelError> {
    ModelConfig::preset(preset).ok_or_else(|| {
        ModelError::NotFound(format!(
            "unknown preset `{preset}` in random:{preset}; presets: {}",
            ModelConfig::PRESETS.join(", ")
        ))
    })
}

fn read_to_string(path: &Path) -> Result<String, ModelError> {
    std::fs::read_to_string(path).map_err(|source| ModelError::Io {
        path: path.display().to_string(),
        source,
    })
}

fn read_hf_config(path: &Path) -> Result<ModelConfig, ModelError> {
    ModelConfig::from_hf_json(&read_to_string(path)?).map_err(|e| match e {
        ModelError::Config(msg) => ModelError::Config(format!("{}: {msg}", path.display())),
        other => other,
    })
}

fn read_gguf(path: &Path) -> Result<gguf_file::Content, ModelError> {
    let mut file = std::fs::File::open(path).map_err(|source| ModelError::Io {
        path: path.display().to_string(),
        source,
    })?;
    Ok(gguf_file::Content::read(&mut file)?)
}

/// `tokenizer.json` of a Hugging Face directory, plus the EOS ids of `config.json` and
/// `generation_config.json`.
fn hf_tokenizer(
    dir: &Path,
    tokenizer: &Path,
    cfg: &ModelConfig,
) -> Result<TextTokenizer, ModelError> {
    let mut tok = TextTokenizer::from_file(tokenizer)?;
    tok.add_eos_token_ids(&cfg.eos_token_ids);
    let gen = dir.join("generation_config.json");
    if let Some(json) = std::fs::read_to_string(gen)
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
    {
        let ids: Vec<u32> = match json.get("eos_token_id") {
            Some(serde_json::Value::Array(xs)) => xs
                .iter()
                .filter_map(|x| x.as_u64().map(|n| n as u32))
                .collect(),
            Some(x) => x.as_u64().map(|n| n as u32).into_iter().collect(),
            None => Vec::new(),
        };
        tok.add_eos_token_ids(&ids);
    }
    if tok.bos_token_id().is_none() {
        tok.set_bos_token_id(cfg.bos_token_id);
    }
    Ok(tok)
}

/// A GGUF model's tokenizer: a `tokenizer.json` beside the file when it agrees with the GGUF
/// token table, else the one built from the GGUF metadata. The metadata's special tokens
/// (BOS/EOS, chat template) are used either way.
fn gguf_tokenizer(
    ct: &gguf_file::Content,
    beside: Option<&Path>,
) -> Result<TextTokenizer, ModelError> {
    let from_meta = TextTokenizer::from_gguf(ct);
    let Some(path) = beside else {
        return from_meta;
    };
    let json = TextTokenizer::from_file(path)?;
    let meta = match from_meta {
        Ok(meta) => meta,
        // The GGUF tokenizer type is not buildable here: trust the tokenizer.json.
        Err(ModelError::Unsupported(_)) => return Ok(json),
        Err(e) => return Err(e),
    };
    if agrees(&json, &meta) {
        let mut json = json;
        json.add_eos_token_ids(meta.eos_token_ids());
        if json.bos_token_id().is_none() {
            json.set_bos_token_id(meta.bos_token_id());
        }
        json.set_chat_format(meta.chat_format().clone());
        Ok(json)
    } else {
        tracing::warn!(
            tokenizer = %path.display(),
            "tokenizer.json does not match the GGUF vocabulary; using the GGUF metadata"
        );
        Ok(meta)
    }
}

/// Whether two tokenizers map a sample of ids (every special token and a spread of the rest)
/// to the same strings.
fn agrees(a: &TextTokenizer, b: &TextTokenizer) -> bool {
    let n = b.vocab_size() as u32;
    let step = (n / 4096).max(1) as usize;
    let specials = b.inner().get_added_tokens_decoder();
    (0..n)
        .step_by(step)
        .filter(|&id| b.id_to_token(id).is_some())
        .chain(specials.keys().copied())
        .all(|id| a.id_to_token(id) == b.id_to_token(id))
}
