//! One session of an engine: its KV cache, the sequence the cache holds, the logits after that
//! sequence, its random stream and the stepper (with its CUDA graphs) made over the cache. An
//! ended session hands its cache and stepper to the engine's spares ([`crate::spare`]).

use std::sync::Arc;

use candle_core::Tensor;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use specsplit_core::cache::SessionCache;
use specsplit_models::transformer::Transformer;

use crate::spare::{SessionBody, Spares};
use crate::EngineError;

/// What a worker needs of its engine: fresh sessions and what one costs.
pub trait SessionEngine: Send + Sync + 'static {
    /// One session's state.
    type Session: Send + 'static;
    /// The worker type `Ping` reports (`draft` or `target`).
    const WORKER_TYPE: &'static str;
    /// Bytes one session's cache takes.
    fn session_bytes(&self) -> usize;
    /// A fresh session, its random choices seeded by `seed` (0 = from entropy).
    fn new_session(&self, seed: u64) -> Result<Self::Session, EngineError>;
}

/// One session of an engine whose steps replay a stepper `St` over the session's cache.
pub struct EngineSession<St> {
    pub(crate) cache: SessionCache,
    pub(crate) tokens: Vec<u32>,
    pub(crate) last_logits: Option<Tensor>,
    pub(crate) rng: ChaCha8Rng,
    /// The stepper made over `cache`, at the first step that uses one.
    pub(crate) stepper: Option<St>,
    /// Where the cache and stepper go when the session ends (dropped there when it is full).
    spares: Arc<Spares<SessionBody<St>>>,
}

impl<St> EngineSession<St> {
    /// A fresh session, its random choices seeded by `seed` (0 = from entropy), over a kept
    /// body of `spares`, else over the cache `new_cache` makes.
    pub(crate) fn open(
        spares: &Arc<Spares<SessionBody<St>>>,
        seed: u64,
        new_cache: impl FnOnce() -> Result<SessionCache, EngineError>,
    ) -> Result<Self, EngineError> {
        let body = spares.body_or(new_cache)?;
        Ok(Self {
            cache: body.cache,
            tokens: Vec::new(),
            last_logits: None,
            rng: seeded_rng(seed),
            stepper: body.stepper,
            spares: spares.clone(),
        })
    }

    /// Tokens currently in the session's cache.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

impl<St> Drop for EngineSession<St> {
    fn drop(&mut self) {
        // The session's GPU buffers are freed (or kept) on whatever thread drops it (an
        // eviction, the TTL sweeper, EndSession): make the context current there first.
        let _ = specsplit_core::device::bind_to_thread(self.cache.device());
        // The clone shares the cache's buffers, so the stepper's graphs stay valid.
        self.spares.put(SessionBody {
            cache: self.cache.clone(),
            stepper: self.stepper.take(),
        });
    }
}

/// Bytes of one session cache of `capacity` tokens for `model`.
pub fn session_cache_bytes(model: &Transformer, capacity: usize) -> usize {
    let c = model.config();
    let spec = specsplit_core::cache::CacheSpec {
        num_layers: c.num_hidden_layers,
        num_kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        capacity,
    };
    SessionCache::bytes_for(&spec, model.dtype())
}

/// Length of the longest common prefix of two token sequences.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A session RNG: seeded deterministically, or from entropy when `seed` is 0.
pub fn seeded_rng(seed: u64) -> ChaCha8Rng {
    if seed == 0 {
        ChaCha8Rng::from_os_rng()
    } else {
        ChaCha8Rng::seed_from_u64(seed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_prefix_stops_at_first_difference() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
        assert_eq!(common_prefix(&[1, 2], &[1, 2]), 2);
    }
}
