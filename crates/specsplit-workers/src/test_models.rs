//! Models the unit tests build their engines over.

use candle_core::{DType, Device};
use specsplit_models::config::ModelConfig;
use specsplit_models::transformer::Transformer;
use std::sync::Arc;

/// The "tiny" preset with a 256-position context and random f32 weights from `seed`, on the CPU.
pub(crate) fn tiny_model(seed: u64) -> Arc<Transformer> {
    let mut cfg = ModelConfig::preset("tiny").unwrap();
    cfg.max_position_embeddings = 256;
    Arc::new(Transformer::random(cfg, seed, DType::F32, &Device::Cpu).unwrap())
}
