//! Several sessions' verify passes of a chain each (a new token and the chain below it, the same
//! rows for every session) as one batch-invariant pass with no shape that depends on a cache's
//! length or address: [`Transformer::session_rows`], which a captured CUDA graph replays for
//! any caches (a target worker verifying the chain drafts of the sessions that are ready
//! together).
//!
//! Session `i` writes its rows at slots `len_i..len_i + rows` of its cache; row `j` sees its
//! session's slots `0..=len_i + j`. Every input, cache addresses included, is written in one
//! upload ([`SessionRows::start`]); the logits of every row come back in one `(sessions ·
//! rows, vocab)` buffer. Each row gets the bits of its session's pass alone
//! ([`Transformer::forward_sessions`] runs the same kernels eagerly).

use super::sessions::cache_table_words;
use super::Transformer;
use crate::fused::{self, PassKeys, SessionTable};
use crate::ModelError;
use candle_core::{DType, Tensor};
use specsplit_core::cache::SessionCache;

/// One session's share of a [`Transformer::session_rows`] pass.
pub struct SessionChainRows<'a> {
    /// The session's cache: its first `len()` slots hold the sequence before `tokens`.
    pub cache: &'a SessionCache,
    /// The new token and the chain below it, written at slots `len()..`.
    pub tokens: &'a [u32],
}

/// Device buffers of [`Transformer::session_rows`] for `sessions` sessions of `rows` rows each
/// whose caches hold at most `capacity` slots.
pub struct SessionRows {
    /// u32: everything [`SessionRows::start`] writes, in one upload.
    io: Tensor,
    /// `(sessions · rows,)`: the tokens.
    tokens: Tensor,
    /// `(sessions · rows,)`: their positions (= slots).
    positions: Tensor,
    /// The rows' sessions, slots, caches and visible keys.
    table: SessionTable,
    /// `(sessions · rows, vocab)` f32: every row's logits, session by session.
    pub logits: Tensor,
    sessions: usize,
    rows: usize,
    capacity: usize,
    layers: usize,
    vocab: usize,
    kv: usize,
    head_dim: usize,
}

impl SessionRows {
    /// Sessions a pass takes.
    pub fn sessions(&self) -> usize {
        self.sessions
    }

    /// Rows a session.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The largest cache these buffers serve.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Sets the next pass's input (one upload): every session's cache addresses, tokens and
    /// slots. Fails (nothing written) unless there is one part a session, each of
    /// [`SessionRows::rows`] tokens of the vocabulary, and each cache fits the model and these
    /// buffers and has room for the rows.
    pub fn start(&self, parts: &[SessionChainRows<'_>]) -> Result<(), ModelError> {
        let (n, r) = (self.sessions, self.rows);
        if parts.len() != n {
            return Err(ModelError::Input(format!(
                "{n} sessions' rows were given {} sessions",
                parts.len()
            )));
        }
        for (i, p) in parts.iter().enumerate() {
            let (len, cap) = (p.cache.len(), p.cache.capacity());
            let bad = if p.tokens.len() != r {
                Some(format!("has {} tokens, not {r}", p.tokens.len()))
            } else if let Some(t) = p.tokens.iter().find(|&&t| t as usize >= self.vocab) {
                Some(format!(
                    "token {t} is outside the {}-token vocabulary",
                    self.vocab
                ))
            } else if cap > self.capacity || len + r > cap {
                Some(format!(
                    "a cache of {cap} slots holding {len} has no room for {r} rows within {} \
                     slots",
                    self.capacity
                ))
            } else {
                None
            };
            if let Some(why) = bad {
                return Err(ModelError::Input(format!("session rows {i} {why}")));
            }
        }
        let caches: Vec<&SessionCache> = parts.iter().map(|p| p.cache).collect();
        let mut io = Vec::with_capacity(self.io.elem_count());
        io.extend(cache_table_words(
            &caches,
            self.layers,
            self.kv,
            self.head_dim,
        )?);
        io.extend(caches.iter().map(|c| c.capacity() as u32));
        for p in parts {
            io.extend_from_slice(p.tokens);
        }
        let slot = |p: &SessionChainRows<'_>, j: usize| (p.cache.len() + j) as u32;
        for p in parts {
            io.extend((0..r).map(|j| slot(p, j)));
        }
        for (i, p) in parts.iter().enumerate() {
            io.extend((0..r).flat_map(|j| [i as u32, slot(p, j)]));
        }
        for p in parts {
            io.extend((0..r).flat_map(|j| [slot(p, j) + 1, 0]));
        }
        Ok(fused::write_u32(&self.io, &io)?)
    }
}

impl Transformer {
    /// Whether [`Transformer::session_rows`] runs for this model with `sessions` sessions of
    /// `rows` rows whose caches hold at most `capacity` slots: the fused batch-invariant
    /// kernels ([`Transformer::exact_rows_fit`]) for all the rows.
    pub fn session_rows_fit(&self, capacity: usize, sessions: usize, rows: usize) -> bool {
        sessions > 0 && rows > 0 && self.exact_rows_fit(capacity, sessions * rows)
    }

    /// Device buffers for [`Transformer::session_rows`]: `sessions` sessions of `rows` rows
    /// each (at most [`fused::BI_MAX_ROWS`] in all) over caches of at most `capacity` slots.
    pub fn session_rows_buffers(
        &self,
        sessions: usize,
        rows: usize,
        capacity: usize,
    ) -> Result<SessionRows, ModelError> {
        specsplit_core::device::bind_to_thread(&self.device)?;
        let (n, r) = (sessions, rows);
        if n == 0 || r == 0 || n * r > fused::BI_MAX_ROWS || capacity == 0 {
            return Err(ModelError::Input(format!(
                "session rows take 1 to {} rows in all, at least one a session, over caches \
                 of at least one slot, not {n} sessions of {r} over {capacity}",
                fused::BI_MAX_ROWS
            )));
        }
        let c = &self.config;
        let layers = self.layers.len();
        let all = n * r;
        let io = Tensor::zeros(layers * n * 4 + n + 6 * all, DType::U32, &self.device)?;
        let mut at = 0;
        let mut part = |size: usize| {
            let t = io.narrow(0, at, size);
            at += size;
            t
        };
        // First: the kernels read the cache addresses as u64, so they sit at the buffer's
        // (aligned) start.
        let caches = part(layers * n * 4)?;
        let capacities = part(n)?;
        let tokens = part(all)?;
        let positions = part(all)?;
        let table_rows = part(2 * all)?.reshape((all, 2))?;
        let keys = PassKeys::device_rows(part(2 * all)?.reshape((all, 2))?, capacity, capacity)?;
        let table = SessionTable::on_device(
            table_rows,
            caches,
            capacities,
            keys,
            layers,
            n,
            c.num_key_value_heads,
            c.head_dim,
        )?;
        Ok(SessionRows {
            io,
            tokens,
            positions,
            table,
            logits: Tensor::zeros((all, c.vocab_size), DType::F32, &self.device)?,
            sessions: n,
            rows: r,
            capacity,
            layers,
            vocab: c.vocab_size,
            kv: c.num_key_value_heads,
            head_dim: c.head_dim,
        })
    }

    /// The sessions' rows set by [`SessionRows::start`] through the model in one pass of the
    /// fused batch-invariant kernels (each row's rotary, K/V write and attention on its own
    /// session's cache, read through the table on the device), every row's f32 logits written
    /// to `b.logits`: bit for bit what [`Transformer::forward_tree`] of each session's rows
    /// alone gives, and the same K/V at their slots (the caches' lengths are left alone).
    /// Fails unless [`Transformer::session_rows_fit`] holds.
    pub fn session_rows(&self, b: &SessionRows) -> Result<(), ModelError> {
        if !self.session_rows_fit(b.capacity, b.sessions, b.rows) {
            return Err(ModelError::Unsupported(format!(
                "no pass of {} sessions of {} rows for this model (needs bf16 on CUDA with the \
                 fused batch-invariant kernels)",
                b.sessions, b.rows
            )));
        }
        let layers = self.fused_layers()?;
        let launch = self.kernels.launch();
        let product =
            |x: &Tensor, w: &Tensor, bias: Option<&Tensor>| fused::bi_matmul(x, w, bias, launch);
        let (shape, scale) = self.fused_attn_shape(b.capacity);
        let (h, head) = self.fused_stack(&layers, &b.tokens, &product, |i, qkv| {
            let q = fused::qkv_rope_sessions(
                qkv,
                &self.cos,
                &self.sin,
                &b.positions,
                &b.table,
                i,
                shape,
                self.rope_interleaved,
                launch,
            )?;
            Ok(fused::sessions_attention(
                &q, &b.table, i, shape, scale, launch,
            )?)
        })?;
        let logits = product(&h, head, None)?.to_dtype(DType::F32)?;
        b.logits.slice_set(&logits, 0, 0)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use candle_core::Device;

    #[test]
    fn session_rows_buffers_are_bounded_and_off_cuda_there_is_no_pass() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let m = Transformer::random(cfg, 1, DType::F32, &Device::Cpu).unwrap();
        assert!(m.session_rows_buffers(0, 5, 64).is_err());
        assert!(m.session_rows_buffers(2, 0, 64).is_err());
        assert!(m.session_rows_buffers(13, 5, 64).is_err(), "65 rows");
        assert!(m.session_rows_buffers(2, 5, 0).is_err());
        let b = m.session_rows_buffers(2, 3, 16).unwrap();
        assert_eq!((b.sessions(), b.rows(), b.capacity()), (2, 3, 16));
        assert_eq!(b.logits.dims(), [6, m.config().vocab_size]);
        assert!(!m.session_rows_fit(16, 2, 3));
        assert!(m.session_rows(&b).is_err());
        // Wrong counts, tokens and room are refused before any address is read.
        let mut caches: Vec<SessionCache> = (0..2).map(|_| m.new_cache(16).unwrap()).collect();
        caches[0].advance(5).unwrap();
        caches[1].advance(13).unwrap();
        fn part<'a>(cache: &'a SessionCache, tokens: &'a [u32]) -> SessionChainRows<'a> {
            SessionChainRows { cache, tokens }
        }
        let e = b.start(&[part(&caches[0], &[1, 2, 3])]).unwrap_err();
        assert!(e.to_string().contains("2 sessions"), "{e}");
        let e = b
            .start(&[part(&caches[0], &[1, 2]), part(&caches[1], &[1, 2, 3])])
            .unwrap_err();
        assert!(e.to_string().contains("rows 0 has 2 tokens"), "{e}");
        let e = b
            .start(&[
                part(&caches[0], &[1, 2, 3]),
                part(&caches[1], &[1, 99_999, 3]),
            ])
            .unwrap_err();
        assert!(e.to_string().contains("vocabulary"), "{e}");
        // 13 cached + 3 rows fill 16 slots: fits; 14 cached do not.
        caches[1].advance(1).unwrap();
        let e = b
            .start(&[part(&caches[0], &[1, 2, 3]), part(&caches[1], &[1, 2, 3])])
            .unwrap_err();
        assert!(e.to_string().contains("rows 1"), "{e}");
        let big = m.new_cache(32).unwrap();
        let e = b
            .start(&[part(&caches[0], &[1, 2, 3]), part(&big, &[1, 2, 3])])
            .unwrap_err();
        assert!(e.to_string().contains("within 16"), "{e}");
        // A CPU cache has no device addresses.
        caches[1].truncate(13).unwrap();
        let e = b
            .start(&[part(&caches[0], &[1, 2, 3]), part(&caches[1], &[1, 2, 3])])
            .unwrap_err();
        assert!(e.to_string().contains("CUDA"), "{e}");
    }
}
