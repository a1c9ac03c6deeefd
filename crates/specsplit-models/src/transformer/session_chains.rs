//! Greedy chains of several sessions grown together, each in its own cache, every level one
//! pass of all the sessions' rows, with no shape that depends on a cache's length or address:
//! [`Transformer::grow_session_chains`], which a captured CUDA graph replays for any caches (a
//! draft worker drafting the chains of the sessions that are ready together).
//!
//! Session `i` feeds its uncached tail (1 to [`CHAIN_FEED_MAX`] tokens) at slots `len_i..` of
//! its cache, then each level's token at the next slot; every row sees its session's slots up
//! to its own. The first level has the same rows for every session (the buffers' feed width;
//! [`crate::step::SessionChainsStepper`] always takes [`CHAIN_FEED_MAX`]): a shorter feed fills
//! the rows before it with a pad row that writes the slot past the session's chain (left out of
//! the cache's length, never read) and reads slot 0. Every input, cache addresses included, is
//! written in one upload ([`SessionChains::start`]); the chains' tokens and log-probabilities
//! come back in one `(2·depth, sessions)` buffer.

use super::forest::{greedy_level, growth_product};
use super::sessions::cache_table_words;
use super::Transformer;
use crate::fused::{self, PassKeys, SessionTable};
use crate::ModelError;
use candle_core::{DType, Tensor};
use specsplit_core::cache::SessionCache;

/// The most tokens a session feeds before its chain: the last accepted token and the bonus.
pub const CHAIN_FEED_MAX: usize = 2;

/// One session's share of a [`Transformer::grow_session_chains`].
pub struct SessionChain<'a> {
    /// The session's cache: its first `len()` slots hold the sequence before `feed`.
    pub cache: &'a SessionCache,
    /// The sequence's uncached tail, 1 to [`CHAIN_FEED_MAX`] tokens, fed at slots `len()..`.
    pub feed: &'a [u32],
    /// Tokens that replace the greedy ones, one per level (a synthetic proposer's), or empty.
    pub forced: &'a [Option<u32>],
}

/// Device buffers of [`Transformer::grow_session_chains`] for chains of `depth` tokens of
/// `sessions` sessions whose caches hold at most `capacity` slots.
pub struct SessionChains {
    /// u32: everything [`SessionChains::start`] writes, in one upload.
    io: Tensor,
    /// `(feed · sessions,)`: the first level's tokens.
    roots: Tensor,
    /// `(sessions,)`: each session's last first-level row.
    last: Tensor,
    /// Each level's positions.
    positions: Vec<Tensor>,
    /// Each level's rows, caches and visible keys.
    tables: Vec<SessionTable>,
    /// `(depth, sessions)`: a token that replaces the greedy one where `forced_on` is 1.
    forced: Tensor,
    /// `(depth, sessions)`: 1 where `forced` holds.
    forced_on: Tensor,
    /// `(2 depth, sessions)` f32: level `l`'s greedy tokens in row `l` (exact in f32: ids are
    /// below 2^24), their log-probabilities in row `depth + l`.
    pub out: Tensor,
    sessions: usize,
    depth: usize,
    /// First-level rows a session.
    feed: usize,
    capacity: usize,
    layers: usize,
    vocab: usize,
    kv: usize,
    head_dim: usize,
}

impl SessionChains {
    /// Sessions a growth takes.
    pub fn sessions(&self) -> usize {
        self.sessions
    }

    /// Tokens per chain.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// The most tokens a session feeds (the first level's rows a session).
    pub fn feed(&self) -> usize {
        self.feed
    }

    /// The largest cache these buffers serve.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sets the next growth's input (one upload): every session's cache addresses, feed,
    /// slots and forced tokens. Fails (nothing written) unless there is one chain a session,
    /// each feed holds 1 to [`SessionChains::feed`] tokens of the vocabulary, each cache fits the
    /// model and these buffers and has room for its feed, its chain and the pad slot past it
    /// (`len + feed + depth` slots), and `forced` is empty or one entry a level.
    pub fn start(&self, chains: &[SessionChain<'_>]) -> Result<(), ModelError> {
        let (n, d, f) = (self.sessions, self.depth, self.feed);
        if chains.len() != n {
            return Err(ModelError::Input(format!(
                "{n} sessions' chains were given {} sessions",
                chains.len()
            )));
        }
        for (i, c) in chains.iter().enumerate() {
            let (len, cap, fed) = (c.cache.len(), c.cache.capacity(), c.feed.len());
            let bad = if !(1..=f).contains(&fed) {
                Some(format!("feeds {fed} tokens, not 1 to {f}"))
            } else if !(c.forced.is_empty() || c.forced.len() == d) {
                Some(format!(
                    "has {} forced tokens for {d} levels",
                    c.forced.len()
                ))
            } else if let Some(t) = c
                .feed
                .iter()
                .chain(c.forced.iter().flatten())
                .find(|&&t| t as usize >= self.vocab)
            {
                Some(format!(
                    "token {t} is outside the {}-token vocabulary",
                    self.vocab
                ))
            } else if cap > self.capacity || len + fed + d > cap {
                Some(format!(
                    "a cache of {cap} slots holding {len} has no room for {fed} fed tokens, a \
                     chain of {d} and a pad slot within {} slots",
                    self.capacity
                ))
            } else {
                None
            };
            if let Some(why) = bad {
                return Err(ModelError::Input(format!("session chain {i} {why}")));
            }
        }
        let caches: Vec<&SessionCache> = chains.iter().map(|c| c.cache).collect();
        let mut io = Vec::with_capacity(self.io.elem_count());
        io.extend(cache_table_words(
            &caches,
            self.layers,
            self.kv,
            self.head_dim,
        )?);
        // The first level: each session's feed after its pads.
        let pads = |c: &SessionChain<'_>| f - c.feed.len();
        for c in chains {
            io.extend(std::iter::repeat_n(0, pads(c)));
            io.extend_from_slice(c.feed);
        }
        io.extend((0..n).map(|i| (f * i + f - 1) as u32));
        io.extend(caches.iter().map(|c| c.capacity() as u32));
        // The slot (= position) of session i's row at level l (0: its last fed token).
        let slot = |c: &SessionChain<'_>, l: usize| c.cache.len() + c.feed.len() - 1 + l;
        let pad_slot = |c: &SessionChain<'_>| slot(c, d);
        // Level 0: rows, positions, keys ([lead, 0]); then each later level's.
        for (i, c) in chains.iter().enumerate() {
            for r in 0..f {
                let s = match r.checked_sub(pads(c)) {
                    Some(j) => c.cache.len() + j,
                    None => pad_slot(c),
                };
                io.extend([i as u32, s as u32]);
            }
        }
        for c in chains {
            io.extend(std::iter::repeat_n(0, pads(c)));
            io.extend((0..c.feed.len()).map(|j| (c.cache.len() + j) as u32));
        }
        for c in chains {
            io.extend(std::iter::repeat_n([1, 0], pads(c)).flatten());
            io.extend((0..c.feed.len()).flat_map(|j| [(c.cache.len() + j + 1) as u32, 0]));
        }
        for l in 1..d {
            for (i, c) in chains.iter().enumerate() {
                io.extend([i as u32, slot(c, l) as u32]);
            }
            io.extend(chains.iter().map(|c| slot(c, l) as u32));
            io.extend(chains.iter().flat_map(|c| [slot(c, l) as u32 + 1, 0]));
        }
        let forced_at = |c: &SessionChain<'_>, l: usize| c.forced.get(l).copied().flatten();
        for l in 0..d {
            io.extend(chains.iter().map(|c| forced_at(c, l).unwrap_or(0)));
        }
        for l in 0..d {
            io.extend(chains.iter().map(|c| u32::from(forced_at(c, l).is_some())));
        }
        Ok(fused::write_u32(&self.io, &io)?)
    }
}

impl Transformer {
    /// Whether [`Transformer::grow_session_chains`] runs for this model with `sessions`
    /// sessions whose caches hold at most `capacity` slots, feeding up to [`CHAIN_FEED_MAX`]
    /// tokens each: the fused batch-invariant kernels ([`Transformer::exact_rows_fit`]) for the
    /// first level's rows.
    pub fn session_chains_fit(&self, capacity: usize, sessions: usize) -> bool {
        sessions > 0 && self.exact_rows_fit(capacity, CHAIN_FEED_MAX * sessions)
    }

    /// Device buffers for [`Transformer::grow_session_chains`]: `sessions` sessions' chains
    /// of `depth` tokens, after feeds of up to `feed` tokens (1 to [`CHAIN_FEED_MAX`]), over
    /// caches of at most `capacity` slots.
    pub fn session_chain_buffers(
        &self,
        sessions: usize,
        depth: usize,
        feed: usize,
        capacity: usize,
    ) -> Result<SessionChains, ModelError> {
        specsplit_core::device::bind_to_thread(&self.device)?;
        let (n, d, f) = (sessions, depth, feed);
        let most = fused::BI_MAX_ROWS / CHAIN_FEED_MAX;
        if n == 0 || n > most || d == 0 || capacity == 0 || !(1..=CHAIN_FEED_MAX).contains(&f) {
            return Err(ModelError::Input(format!(
                "session chains take 1 to {most} sessions of at least one token after feeds of \
                 1 to {CHAIN_FEED_MAX} over caches of at least one slot, not {n} of {d} after \
                 {f} over {capacity}"
            )));
        }
        let c = &self.config;
        let layers = self.layers.len();
        let level_rows = |l: usize| if l == 0 { f * n } else { n };
        let len = layers * n * 4
            + f * n
            + n
            + n
            + (0..d).map(|l| 5 * level_rows(l)).sum::<usize>()
            + 2 * d * n;
        let io = Tensor::zeros(len, DType::U32, &self.device)?;
        let mut at = 0;
        let mut part = |size: usize| {
            let t = io.narrow(0, at, size);
            at += size;
            t
        };
        // First: the kernels read the cache addresses as u64, so they sit at the buffer's
        // (aligned) start.
        let caches = part(layers * n * 4)?;
        let roots = part(f * n)?;
        let last = part(n)?;
        let capacities = part(n)?;
        let (mut positions, mut tables) = (Vec::with_capacity(d), Vec::with_capacity(d));
        for l in 0..d {
            let r = level_rows(l);
            let rows = part(2 * r)?.reshape((r, 2))?;
            positions.push(part(r)?);
            let keys = PassKeys::device_rows(part(2 * r)?.reshape((r, 2))?, capacity, capacity)?;
            tables.push(SessionTable::on_device(
                rows,
                caches.clone(),
                capacities.clone(),
                keys,
                layers,
                n,
                c.num_key_value_heads,
                c.head_dim,
            )?);
        }
        let forced = part(d * n)?.reshape((d, n))?;
        let forced_on = part(d * n)?.reshape((d, n))?;
        Ok(SessionChains {
            io,
            roots,
            last,
            positions,
            tables,
            forced,
            forced_on,
            out: Tensor::zeros((2 * d, n), DType::F32, &self.device)?,
            sessions: n,
            depth: d,
            feed: f,
            capacity,
            layers,
            vocab: c.vocab_size,
            kv: c.num_key_value_heads,
            head_dim: c.head_dim,
        })
    }

    /// Grows each session's greedy chain of `b.depth()` tokens after its feed (set by
    /// [`SessionChains::start`]), one pass a level for all sessions (the fused layers with each
    /// row's rotary, K/V write and attention on its own session's cache, the one-kernel draft
    /// attention up to [`fused::DRAFT_ATTENTION_MAX_SPAN`] keys; the products by their rows
    /// through `growth_product`: each session's logits
    /// those of its chain decoded alone up to bf16 rounding) and one greedy head for all rows
    /// (`greedy_level`), every input read on the device, so a
    /// captured CUDA graph serves every round whatever the caches: writes each row's K/V at its
    /// slot (the caches' lengths are left alone) and the chains' tokens and log-probabilities
    /// to `b.out`. Fails unless [`Transformer::session_chains_fit`] holds.
    pub fn grow_session_chains(&self, b: &SessionChains) -> Result<(), ModelError> {
        if !self.session_chains_fit(b.capacity, b.sessions) {
            return Err(ModelError::Unsupported(format!(
                "no chains of {} sessions for this model (needs bf16 on CUDA with the fused \
                 batch-invariant kernels)",
                b.sessions
            )));
        }
        let layers = self.fused_layers()?;
        let launch = self.kernels.launch();
        let product =
            |x: &Tensor, w: &Tensor, bias: Option<&Tensor>| growth_product(x, w, bias, launch);
        let (shape, scale) = self.fused_attn_shape(b.capacity);
        let mut ids = b.roots.clone();
        for level in 0..b.depth {
            let (table, positions) = (&b.tables[level], &b.positions[level]);
            let (h, head) = self.fused_stack(&layers, &ids, &product, |i, qkv| {
                let q = fused::qkv_rope_sessions(
                    qkv,
                    &self.cos,
                    &self.sin,
                    positions,
                    table,
                    i,
                    shape,
                    self.rope_interleaved,
                    launch,
                )?;
                Ok(if table.span() <= fused::DRAFT_ATTENTION_MAX_SPAN {
                    fused::draft_sessions_attention(&q, table, i, shape, scale, launch)?
                } else {
                    fused::sessions_attention(&q, table, i, shape, scale, launch)?
                })
            })?;
            let h = match (level, b.feed) {
                (0, 2..) => h.index_select(&b.last, 0)?,
                _ => h,
            };
            let logits = product(&h, head, None)?;
            let head_io = (&b.forced, &b.forced_on, &b.out);
            ids = greedy_level(&logits, head_io, b.depth, level, launch)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use candle_core::Device;

    #[test]
    fn session_chain_buffers_are_bounded_and_off_cuda_there_is_no_growth() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let m = Transformer::random(cfg, 1, DType::F32, &Device::Cpu).unwrap();
        assert!(m.session_chain_buffers(0, 3, 2, 64).is_err());
        assert!(m.session_chain_buffers(33, 3, 2, 64).is_err());
        assert!(m.session_chain_buffers(2, 0, 2, 64).is_err());
        assert!(m.session_chain_buffers(2, 3, 0, 64).is_err());
        assert!(m.session_chain_buffers(2, 3, 3, 64).is_err());
        let one = m.session_chain_buffers(2, 3, 1, 64).unwrap();
        let b = m.session_chain_buffers(2, 3, 2, 64).unwrap();
        assert_eq!(
            (b.sessions(), b.depth(), b.feed(), b.capacity()),
            (2, 3, 2, 64)
        );
        assert!(!m.session_chains_fit(64, 2));
        assert!(m.grow_session_chains(&b).is_err());
        // Wrong counts and feeds are refused before any address is read.
        let mut caches: Vec<SessionCache> = (0..2).map(|_| m.new_cache(16).unwrap()).collect();
        caches[0].advance(5).unwrap();
        caches[1].advance(9).unwrap();
        fn chain<'a>(cache: &'a SessionCache, feed: &'a [u32]) -> SessionChain<'a> {
            SessionChain {
                cache,
                feed,
                forced: &[],
            }
        }
        let e = b.start(&[chain(&caches[0], &[1])]).unwrap_err();
        assert!(e.to_string().contains("2 sessions"), "{e}");
        let e = b
            .start(&[chain(&caches[0], &[1, 2, 3]), chain(&caches[1], &[1])])
            .unwrap_err();
        assert!(e.to_string().contains("chain 0 feeds 3"), "{e}");
        let e = one
            .start(&[chain(&caches[0], &[1]), chain(&caches[1], &[1, 2])])
            .unwrap_err();
        assert!(e.to_string().contains("chain 1 feeds 2"), "{e}");
        let e = b
            .start(&[chain(&caches[0], &[1]), chain(&caches[1], &[99_999])])
            .unwrap_err();
        assert!(e.to_string().contains("vocabulary"), "{e}");
        // 9 cached + 2 fed + 3 levels + the pad slot need 15 of 16: fits; 14 cached do not.
        caches[1].advance(5).unwrap();
        let e = b
            .start(&[chain(&caches[0], &[1]), chain(&caches[1], &[1])])
            .unwrap_err();
        assert!(e.to_string().contains("chain 1"), "{e}");
        // A CPU cache has no device addresses.
        caches[1].truncate(9).unwrap();
        let e = b
            .start(&[chain(&caches[0], &[1]), chain(&caches[1], &[1, 2])])
            .unwrap_err();
        assert!(e.to_string().contains("CUDA"), "{e}");
    }
}
