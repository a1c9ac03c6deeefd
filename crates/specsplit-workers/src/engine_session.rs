//! One session of an engine: its KV cache, the sequence the cache holds, the logits after that
//! sequence, its random stream and the stepper (with its CUDA graphs) made over the cache. An
//! ended session hands its cache and stepper to the engine's spares ([`crate::spare`]).
//!
//! A session's cache is sized by use: it starts at the engine's first capacity class
//! ([`CacheClasses`]) and grows by doubling, up to `max_context`, when a round reserves room
//! ([`EngineSession::reserve`]) before any write. The growth is charged to the session's
//! [`KvCharge`] first (the store may refuse it: RESOURCE_EXHAUSTED, the session unchanged),
//! and the stepper made over the old buffers is dropped, to be made (and its graphs captured)
//! again over the new ones at its next use.

use std::sync::Arc;

use candle_core::Tensor;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use specsplit_core::cache::SessionCache;
use specsplit_models::transformer::Transformer;

use crate::session::KvCharge;
use crate::spare::{SessionBody, Spares};
use crate::EngineError;

/// The entries of the smallest KV cache a session starts with, unless the engine is told
/// otherwise (at the Qwen2.5-7B shape in bf16, 256 entries take 14 MiB; 4096, 224 MiB).
pub const DEFAULT_FIRST_CAPACITY: usize = 256;

/// The capacities an engine's session caches take: the first one, doubled as often as needed,
/// capped at `max_context`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheClasses {
    /// Entries of a new session's cache (at most `max_context`).
    pub first: usize,
    /// Entries a cache grows to at most.
    pub max_context: usize,
}

impl CacheClasses {
    /// Classes from `first` (at least 1; at most `max_context`) up to `max_context`.
    pub fn new(first: usize, max_context: usize) -> Self {
        Self {
            first: first.clamp(1, max_context.max(1)),
            max_context,
        }
    }

    /// A new session's cache for `model`.
    pub fn new_cache(&self, model: &Transformer) -> Result<SessionCache, EngineError> {
        Ok(model.new_growable_cache(self.first, self.max_context)?)
    }
}

/// What a worker needs of its engine: fresh sessions and what one costs.
pub trait SessionEngine: Send + Sync + 'static {
    /// One session's state.
    type Session: Send + 'static;
    /// The worker type `Ping` reports (`draft` or `target`).
    const WORKER_TYPE: &'static str;
    /// Bytes a new session's cache takes (what admission charges it).
    fn session_bytes(&self) -> usize;
    /// A fresh session, its random choices seeded by `seed` (0 = from entropy), its cache
    /// growth limited by no store.
    fn new_session(&self, seed: u64) -> Result<Self::Session, EngineError> {
        self.new_charged_session(seed, KvCharge::unlimited(self.session_bytes()))
    }
    /// A fresh session whose cache is charged to `charge` (which starts at
    /// [`SessionEngine::session_bytes`]); it must not raise the charge here (the store that
    /// calls this is locked), only when a round grows the cache.
    fn new_charged_session(
        &self,
        seed: u64,
        charge: KvCharge,
    ) -> Result<Self::Session, EngineError>;
}

/// One session of an engine whose steps replay a stepper `St` over the session's cache.
pub struct EngineSession<St> {
    pub(crate) cache: SessionCache,
    pub(crate) tokens: Vec<u32>,
    pub(crate) last_logits: Option<Tensor>,
    pub(crate) rng: ChaCha8Rng,
    /// The stepper made over `cache`, at the first step that uses one; dropped when the cache
    /// grows (its graphs point at the old buffers).
    pub(crate) stepper: Option<St>,
    /// The session's share of the store's memory budget: at least the cache's bytes once a
    /// round reserved room (a spare body's cache may be larger until then).
    pub(crate) charge: KvCharge,
    /// What a draft session's last pre-draft grew past the sequence, for the next pre-draft
    /// to keep ([`crate::predraft`]); always `None` on a target.
    pub(crate) grown: Option<crate::predraft::GrownBranches>,
    /// Where the cache and stepper go when the session ends (dropped there when it is full).
    spares: Arc<Spares<SessionBody<St>>>,
}

impl<St> EngineSession<St> {
    /// A fresh session, its random choices seeded by `seed` (0 = from entropy), over a kept
    /// body of `spares`, else over the cache `new_cache` makes.
    pub(crate) fn open(
        spares: &Arc<Spares<SessionBody<St>>>,
        seed: u64,
        charge: KvCharge,
        new_cache: impl FnOnce() -> Result<SessionCache, EngineError>,
    ) -> Result<Self, EngineError> {
        let body = spares.body_or(new_cache)?;
        Ok(Self {
            cache: body.cache,
            tokens: Vec::new(),
            last_logits: None,
            rng: seeded_rng(seed),
            stepper: body.stepper,
            charge,
            grown: None,
            spares: spares.clone(),
        })
    }

    /// Makes room in the cache for `entries` entries in all, before a round writes any: grows
    /// it to the next capacity class that holds them, charging the growth first. A refused
    /// charge (RESOURCE_EXHAUSTED, saying what to raise) or a failed allocation leaves the
    /// session as it was, usable at its old size. Growth drops the stepper. A spare body's
    /// cache larger than the charge is charged here, at the session's first request (once a
    /// raise succeeded, the charge covers the cache for good); if the budget has no room for
    /// it, the new session takes a fresh cache that holds `entries` within its charge instead.
    pub fn reserve(&mut self, entries: usize) -> Result<(), EngineError> {
        let target = self.cache.capacity_for(entries)?;
        let bytes = bytes_at(&self.cache, target);
        let before = self.charge.bytes();
        if let Err(refused) = self.charge.raise_to(bytes) {
            return self.refit(entries, refused);
        }
        if target == self.cache.capacity() {
            return Ok(());
        }
        let t = std::time::Instant::now();
        match self.cache.reserve(entries) {
            Ok(_) => {
                self.stepper = None;
                tracing::debug!(
                    entries,
                    capacity = self.cache.capacity(),
                    ms = t.elapsed().as_secs_f64() * 1e3,
                    "session cache grown"
                );
                Ok(())
            }
            Err(e) => {
                self.charge.lower_to(before.max(self.cache.memory_bytes()));
                Err(e.into())
            }
        }
    }

    /// After a refused charge: a cache larger than the charge (a spare body) is swapped for a
    /// fresh one of the power of two that holds `entries` when the charge covers that; else
    /// `refused`.
    fn refit(&mut self, entries: usize, refused: EngineError) -> Result<(), EngineError> {
        if self.cache.memory_bytes() <= self.charge.bytes() {
            return Err(refused);
        }
        let max = self.cache.max_capacity();
        let target = entries.max(1).next_power_of_two().min(max);
        let bytes = bytes_at(&self.cache, target);
        if entries > max || bytes > self.charge.bytes() {
            return Err(refused);
        }
        let spec = specsplit_core::cache::CacheSpec {
            capacity: target,
            ..*self.cache.spec()
        };
        self.cache = SessionCache::growable(spec, max, self.cache.dtype(), self.cache.device())?;
        self.charge.lower_to(bytes);
        self.stepper = None;
        self.tokens.clear();
        self.last_logits = None;
        Ok(())
    }

    /// Tokens currently in the session's cache.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Entries the session's cache holds room for now (it grows with use).
    pub fn cache_capacity(&self) -> usize {
        self.cache.capacity()
    }

    /// Bytes the session is charged against its store's memory budget.
    pub fn charged_bytes(&self) -> usize {
        self.charge.bytes()
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

/// Bytes `cache` would take at `capacity` entries.
fn bytes_at(cache: &SessionCache, capacity: usize) -> usize {
    let spec = specsplit_core::cache::CacheSpec {
        capacity,
        ..*cache.spec()
    };
    SessionCache::bytes_for(&spec, cache.dtype())
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
