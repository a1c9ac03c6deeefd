//! Shared helpers of the reference / tree-exactness tests: locating (and if needed fetching) the
//! real models, masks, and comparisons.
#![allow(dead_code)]

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use specsplit_models::config::ModelConfig;
use specsplit_models::transformer::Transformer;
use specsplit_models::weights::random_tensors;
use std::path::{Path, PathBuf};
use std::process::Command;

/// SmolLM2-135M-Instruct Q4_1 (llama architecture).
pub const SMOLLM2: (&str, &str) = ("smollm2-135m-instruct-q4_1.gguf", "smollm2");
/// Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2 architecture).
pub const QWEN05: (&str, &str) = ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", "qwen-0.5b");
/// Qwen2.5-Coder-1.5B-Instruct Q4_K_M (qwen2 architecture).
pub const QWEN15: (&str, &str) = ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "qwen-1.5b");

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `$SPECSPLIT_MODELS_DIR`, else `<workspace>/models`.
pub fn models_dir() -> PathBuf {
    std::env::var_os("SPECSPLIT_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| workspace_root().join("models"))
}

/// Path of a real model, fetched with `scripts/fetch-models.sh` when absent. Panics (never skips)
/// when it cannot be had.
pub fn model_path((file, fetch_name): (&str, &str)) -> PathBuf {
    let dir = models_dir();
    let path = dir.join(file);
    if !path.is_file() {
        let script = workspace_root().join("scripts/fetch-models.sh");
        let status = Command::new("bash")
            .arg(&script)
            .arg(fetch_name)
            .env("SPECSPLIT_MODELS_DIR", &dir)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
        assert!(
            status.success() && path.is_file(),
            "fetching {fetch_name} into {} failed ({status})",
            dir.display()
        );
    }
    path
}

/// u32 tensor on `device`.
pub fn u32s(v: &[u32], device: &Device) -> Tensor {
    Tensor::new(v, device).unwrap()
}

/// Consecutive positions `start..start + n`.
pub fn span(start: usize, n: usize, device: &Device) -> Tensor {
    let v: Vec<u32> = (start as u32..(start + n) as u32).collect();
    u32s(&v, device)
}

/// Max |a - b| over two f32 tensors of the same shape.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a = a.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let b = b.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Argmax of every row of an f32 `(rows, vocab)` tensor (or of a 1-D tensor as one row).
pub fn argmax_rows(t: &Tensor) -> Vec<u32> {
    let t = if t.rank() == 1 {
        t.unsqueeze(0).unwrap()
    } else {
        t.clone()
    };
    t.argmax(1).unwrap().to_vec1::<u32>().unwrap()
}

/// A random tree of `n` nodes in topological order: `parent[0] = None`, `parent[i] < i`. The
/// first `chain` nodes form a chain (so the depth is at least `chain - 1`), the rest attach to
/// random earlier nodes.
pub fn random_tree(n: usize, chain: usize, seed: u64) -> Vec<Option<usize>> {
    let mut rng = Lcg(seed);
    (0..n)
        .map(|i| match i {
            0 => None,
            i if i < chain => Some(i - 1),
            i => Some(rng.below(i as u64) as usize),
        })
        .collect()
}

/// Root-to-node path (node indices) of every node.
pub fn paths(parent: &[Option<usize>]) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::with_capacity(parent.len());
    for (i, p) in parent.iter().enumerate() {
        let mut path = match p {
            None => Vec::new(),
            Some(p) => out[*p].clone(),
        };
        path.push(i);
        out.push(path);
    }
    out
}

/// Additive tree mask `(n, prefix + n)`: node i sees the prefix, its ancestors and itself.
pub fn tree_mask(parent: &[Option<usize>], prefix: usize, dtype: DType, device: &Device) -> Tensor {
    let n = parent.len();
    let mut data = vec![f32::NEG_INFINITY; n * (prefix + n)];
    for (i, path) in paths(parent).iter().enumerate() {
        let row = &mut data[i * (prefix + n)..(i + 1) * (prefix + n)];
        row[..prefix].iter_mut().for_each(|x| *x = 0.0);
        for &j in path {
            row[prefix + j] = 0.0;
        }
    }
    Tensor::from_vec(data, (n, prefix + n), device)
        .unwrap()
        .to_dtype(dtype)
        .unwrap()
}

/// Tree positions: `prefix + depth(i)`.
pub fn tree_positions(parent: &[Option<usize>], prefix: usize, device: &Device) -> Tensor {
    let v: Vec<u32> = paths(parent)
        .iter()
        .map(|p| (prefix + p.len() - 1) as u32)
        .collect();
    u32s(&v, device)
}

/// Deterministic pseudo-random numbers for tests.
pub struct Lcg(pub u64);

impl Lcg {
    /// Next value in `0..bound`.
    pub fn below(&mut self, bound: u64) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (self.0 >> 33) % bound
    }

    /// `n` token ids below `vocab`.
    pub fn tokens(&mut self, n: usize, vocab: usize) -> Vec<u32> {
        (0..n).map(|_| self.below(vocab as u64) as u32).collect()
    }
}

/// A small Llama-shaped configuration whose widths are multiples of 256 (the k-quant block).
pub fn small_config() -> ModelConfig {
    ModelConfig {
        vocab_size: 512,
        hidden_size: 256,
        intermediate_size: 512,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 64,
        attention_bias: true,
        tie_word_embeddings: false,
        ..ModelConfig::preset("tiny").unwrap()
    }
}

/// [`small_config`] with random weights (seed 11) quantized to `quant`, on the CPU.
pub fn small_quantized(quant: GgmlDType) -> Transformer {
    let cfg = small_config();
    let tensors = random_tensors(&cfg, 11, DType::F32, &Device::Cpu).unwrap();
    Transformer::from_tensors_quantized(cfg, &tensors, quant, &Device::Cpu).unwrap()
}
