//! The fixed-shape passes a captured CUDA graph replays: the greedy one-token step
//! ([`Transformer::static_step`]) and the exact rows of a chain ([`Transformer::exact_rows`]),
//! with the device buffers they read and write.

use super::linear::Linear;
use super::stack::{FusedLayer, RowsAttention};
use super::{ForwardPath, Pass, Transformer};
use crate::ModelError;
use candle_core::{DType, Tensor};
use specsplit_core::cache::SessionCache;

/// Device buffers of [`Transformer::static_step`]: its inputs, outputs and constants, all at
/// fixed addresses so a captured CUDA graph stays valid.
pub struct StaticStep {
    /// `(1,)` u32: the token to decode; the step overwrites it with its greedy next token.
    pub token: Tensor,
    /// `(1,)` u32: the token's position (= cache slot); the step increments it.
    pub position: Tensor,
    /// `(1,)` u32: the greedy next token, written by the step.
    pub next: Tensor,
    /// `(1,)` f32: the next token's log-probability, written by the step.
    pub next_logprob: Tensor,
    /// `(1, vocab)` in the model's dtype, where the buffers were made with them
    /// ([`Transformer::static_step_buffers_with_logits`]): the step's logits.
    pub logits: Option<Tensor>,
    slots: Tensor,
    visible: Tensor,
    hidden: Tensor,
    one: Tensor,
    capacity: usize,
}

impl StaticStep {
    /// The cache capacity these buffers serve.
    pub fn capacity(&self) -> usize {
        self.capacity
    }
}

/// Device buffers of [`Transformer::exact_rows`] and [`Transformer::static_rows_step`]: a
/// chain of `rows` tokens after the cached sequence, their positions (= cache slots), each
/// row's key count, and the logits the exact pass writes. Its attention is launched over the
/// first `span` slots of the cache, so a chain must end within them.
pub struct ExactRows {
    /// `(4 rows,)` u32: the tokens, their positions, then per row `[position + 1, 0]`; written
    /// together before each pass.
    io: Tensor,
    tokens: Tensor,
    positions: Tensor,
    keys: crate::fused::PassKeys,
    /// `(rows, vocab)` f32: the logits of [`Transformer::exact_rows`].
    pub logits: Tensor,
    rows: usize,
    capacity: usize,
}

impl ExactRows {
    /// Sets the next pass's input: `tokens` (exactly [`ExactRows::rows`] of them) at cache
    /// slots `past..` (one small upload).
    pub fn start(&self, tokens: &[u32], past: usize) -> Result<(), ModelError> {
        let n = self.rows;
        if tokens.len() != n {
            return Err(ModelError::Input(format!(
                "a {n}-row pass was given {} tokens",
                tokens.len()
            )));
        }
        if past + n > self.capacity {
            return Err(specsplit_core::cache::CacheError::CapacityExceeded {
                needed: past + n,
                capacity: self.capacity,
            }
            .into());
        }
        if past + n > self.span() {
            return Err(ModelError::Input(format!(
                "a {n}-row pass after {past} tokens sees more than the {} keys its buffers \
                 were made for",
                self.span()
            )));
        }
        // On the stack: a pass has at most BI_MAX_ROWS rows (no allocation per step).
        let mut io = [0u32; 4 * crate::fused::BI_MAX_ROWS];
        let io = &mut io[..4 * n];
        io[..n].copy_from_slice(tokens);
        for (r, p) in (past..past + n).enumerate() {
            io[n + r] = p as u32;
            io[2 * n + 2 * r] = p as u32 + 1;
        }
        Ok(crate::fused::write_u32(&self.io, io)?)
    }

    /// Rows of the pass.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The cache capacity these buffers serve.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// The slots the attention is launched over (a chain ends within them).
    pub fn span(&self) -> usize {
        self.keys.span()
    }

    /// These buffers with the attention launched over `span` slots instead (at most the
    /// capacity): the same inputs and logits (one upload serves both), other key bounds.
    pub fn with_span(&self, span: usize) -> Result<ExactRows, ModelError> {
        Ok(ExactRows {
            io: self.io.clone(),
            tokens: self.tokens.clone(),
            positions: self.positions.clone(),
            keys: self.keys.with_span(span)?,
            logits: self.logits.clone(),
            rows: self.rows,
            capacity: self.capacity,
        })
    }
}

impl Transformer {
    /// Whether [`Transformer::static_step`] may be captured into a CUDA graph for this model:
    /// dense weights on CUDA (quantized kernels stay on the eager path).
    pub fn graph_capturable(&self) -> bool {
        self.device.is_cuda() && matches!(self.lm_head, Linear::Dense { .. })
    }

    /// Device buffers for [`Transformer::static_step`] over caches of `capacity` entries.
    pub fn static_step_buffers(&self, capacity: usize) -> Result<StaticStep, ModelError> {
        self.step_buffers(capacity, false)
    }

    /// [`Transformer::static_step_buffers`] with a buffer the step copies its logits to
    /// ([`StaticStep::logits`]).
    pub fn static_step_buffers_with_logits(
        &self,
        capacity: usize,
    ) -> Result<StaticStep, ModelError> {
        self.step_buffers(capacity, true)
    }

    fn step_buffers(&self, capacity: usize, logits: bool) -> Result<StaticStep, ModelError> {
        specsplit_core::device::bind_to_thread(&self.device)?;
        let dev = &self.device;
        let slots: Vec<u32> = (0..capacity as u32).collect();
        Ok(StaticStep {
            token: Tensor::zeros(1, DType::U32, dev)?,
            position: Tensor::zeros(1, DType::U32, dev)?,
            next: Tensor::zeros(1, DType::U32, dev)?,
            next_logprob: Tensor::zeros(1, DType::F32, dev)?,
            logits: logits
                .then(|| Tensor::zeros((1, self.config.vocab_size), self.dtype, dev))
                .transpose()?,
            slots: Tensor::new(slots.as_slice(), dev)?,
            visible: Tensor::zeros(capacity, self.dtype, dev)?,
            hidden: Tensor::full(f32::NEG_INFINITY, capacity, dev)?
                .to_dtype(self.dtype)?
                .contiguous()?,
            one: Tensor::new(&[1u32], dev)?,
            capacity,
        })
    }

    /// One greedy decode step in which no shape depends on the cache length, so that it can be
    /// captured once into a CUDA graph and replayed: reads the token and its position from
    /// `b.token` / `b.position`, writes the token's K/V into every layer's cache buffer at that
    /// position (a device-side index), attends over the whole capacity under a mask computed on
    /// the device (slots `0..=position` visible), then writes the greedy next token and its
    /// log-probability to `b.next` / `b.next_logprob`, copies the next token into `b.token` and
    /// increments `b.position`. Nothing is copied to or from the host, and the cache's length
    /// is left alone (the caller owns that bookkeeping).
    ///
    /// In bf16 on CUDA with [`crate::fused::KernelOptions::fused`] on (the default) the step runs the fused
    /// kernels (about 8 launches a layer, attention over the valid slots only); otherwise
    /// candle's ops.
    pub fn static_step(&self, b: &StaticStep, cache: &SessionCache) -> Result<(), ModelError> {
        let c = &self.config;
        let cap = b.capacity;
        if cache.capacity() != cap || *cache.spec() != self.cache_spec(cap) {
            return Err(ModelError::Input(format!(
                "static step buffers are for {cap} entries, the cache is {:?}",
                cache.spec()
            )));
        }
        if self.plan(Pass::Step { capacity: cap }) == ForwardPath::FusedStep {
            return self.static_step_fused(&self.fused_layers()?, b, cache);
        }
        let (heads, kv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let rep = heads / kv;
        let eps = c.rms_norm_eps as f32;
        let scale = 1.0 / (hd as f64).sqrt();
        let pos = &b.position;
        let cos = self.cos.index_select(pos, 0)?;
        let sin = self.sin.index_select(pos, 0)?;
        let mask = b
            .slots
            .broadcast_le(pos)?
            .where_cond(&b.visible, &b.hidden)?
            .reshape((1, 1, 1, cap))?
            // Expanded once per step, so each layer's add needs no broadcast parameters.
            .broadcast_as((1, kv, rep, cap))?
            .contiguous()?;
        let write_at = pos
            .reshape((1, 1, 1, 1))?
            .broadcast_as((1, kv, 1, hd))?
            .contiguous()?;
        let mut x = self.embed.forward(&b.token, self.dtype)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let h = candle_nn::ops::rms_norm(&x, &layer.attn_norm, eps)?;
            let qkv = layer.qkv.forward(&h, &self.kernels)?;
            let q = qkv[0].reshape((1, heads, 1, hd))?.contiguous()?;
            let k = qkv[1].reshape((1, kv, 1, hd))?.contiguous()?;
            let v = qkv[2].reshape((1, kv, 1, hd))?.contiguous()?;
            let (q, k) = (self.rope(&q, &cos, &sin)?, self.rope(&k, &cos, &sin)?);
            let (kb, vb) = cache.buffers(i)?;
            kb.scatter_set(&write_at, &k, 2)?;
            vb.scatter_set(&write_at, &v, 2)?;
            let q = q.reshape((1, kv, rep, hd))?;
            let att = ((q.matmul(&kb.t()?)? * scale)? + &mask)?;
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            let y = att.matmul(vb)?.reshape((1, heads * hd))?;
            x = (x + layer.o.forward(&y, &self.kernels)?)?;
            x = (&x + layer.mlp(&x, eps, &self.kernels)?)?;
        }
        let x = candle_nn::ops::rms_norm(&x, &self.norm, eps)?;
        let logits = self.lm_head.forward(&x, &self.kernels)?;
        if let Some(out) = &b.logits {
            out.slice_set(&logits.to_dtype(self.dtype)?, 0, 0)?;
        }
        let logits = logits.to_dtype(DType::F32)?;
        let next = logits.argmax_keepdim(1)?.reshape(1)?;
        let lp = (logits.max_keepdim(1)? - logits.log_sum_exp(1)?.unsqueeze(1)?)?.reshape(1)?;
        b.next.slice_set(&next, 0, 0)?;
        b.next_logprob.slice_set(&lp, 0, 0)?;
        b.token.slice_set(&next, 0, 0)?;
        b.position.slice_set(&(pos + &b.one)?, 0, 0)?;
        Ok(())
    }

    /// Whether a one-row [`Transformer::exact_rows`] (the exact decoding step) runs for this
    /// model over caches of `capacity` slots: exactly when a one-token [`Transformer::forward`]
    /// takes the fused batch-invariant path (bf16 on CUDA, dense weights the kernels take, the
    /// fused kernels and batch invariance on), and the rotary tables cover the capacity.
    pub fn exact_step_fits(&self, capacity: usize) -> bool {
        self.exact_shape_fits(capacity) && self.fused_enabled()
    }

    /// [`Transformer::exact_step_fits`] but for the fused layer stack.
    fn exact_shape_fits(&self, capacity: usize) -> bool {
        capacity > 0 && self.gpu_batch_invariant(1) && self.cos.dim(0).is_ok_and(|d| d >= capacity)
    }

    /// Whether [`Transformer::exact_rows`] and [`Transformer::static_rows_step`] run for this
    /// model over caches of `capacity` slots with `rows` rows: [`Transformer::exact_step_fits`]
    /// and at most [`crate::fused::BI_MAX_ROWS`] rows.
    pub fn exact_rows_fit(&self, capacity: usize, rows: usize) -> bool {
        (1..=crate::fused::BI_MAX_ROWS).contains(&rows)
            && self.gpu_batch_invariant(rows)
            && self.exact_step_fits(capacity)
    }

    /// Device buffers for [`Transformer::exact_rows`] over caches of `capacity` slots and
    /// chains of `rows` tokens ending within the first `span` slots (see
    /// [`crate::fused::replay_span`]; at most `capacity`).
    pub fn exact_rows_buffers(
        &self,
        capacity: usize,
        rows: usize,
        span: usize,
    ) -> Result<ExactRows, ModelError> {
        specsplit_core::device::bind_to_thread(&self.device)?;
        let dev = &self.device;
        let n = rows;
        if n == 0 || n > crate::fused::BI_MAX_ROWS {
            return Err(ModelError::Input(format!(
                "a rows pass takes 1 to {} rows, not {n}",
                crate::fused::BI_MAX_ROWS
            )));
        }
        let io = Tensor::zeros(4 * n, DType::U32, dev)?;
        let keys = crate::fused::PassKeys::device_rows(
            io.narrow(0, 2 * n, 2 * n)?.reshape((n, 2))?,
            capacity,
            span,
        )?;
        Ok(ExactRows {
            tokens: io.narrow(0, 0, n)?,
            positions: io.narrow(0, n, n)?,
            keys,
            io,
            logits: Tensor::zeros((n, self.config.vocab_size), DType::F32, dev)?,
            rows: n,
            capacity,
        })
    }

    /// A chain of tokens after the cached sequence through the model with the same kernels
    /// and the same arithmetic as a batch-invariant [`Transformer::forward`] of those rows
    /// (each row's logits bit-identical to that pass's, so to the token decoded alone), with
    /// no shape that depends on the cache length, so it can be captured once into a CUDA graph
    /// and replayed: reads the tokens and their positions (= slots) from `b` (set by
    /// [`ExactRows::start`]), writes their K/V at those slots, attends row `r` over slots
    /// `0..=position_r` (key counts read on the device) and writes the rows' f32 logits to
    /// `b.logits`. The cache's length is left alone (the caller advances it). Fails unless
    /// [`Transformer::exact_rows_fit`] holds.
    pub fn exact_rows(&self, b: &ExactRows, cache: &SessionCache) -> Result<(), ModelError> {
        let (h, head) = self.exact_rows_stack(b, cache)?;
        let logits =
            crate::fused::bi_matmul(&h, head, None, self.kernels.launch())?.to_dtype(DType::F32)?;
        b.logits.slice_set(&logits, 0, 0)?;
        Ok(())
    }

    /// [`Transformer::exact_rows`] as a greedy decode step of several tokens: the rows go
    /// through the same layers, then the last row's greedy next token and log-probability are
    /// written to `step.next` / `step.next_logprob`, the token into `step.token`, and
    /// `step.position` is incremented, so the caller sets it to the last row's position first
    /// and [`Transformer::static_step`] continues from there. `b.logits` is left alone. Up to
    /// [`crate::fused::GEMV_MAX_ROWS`] rows, the rows go through [`Transformer::static_step`]'s
    /// kernels instead, each over every row at once (each weight read once), so that every row
    /// comes out bit for bit as one step a token would give it: a draft needs no batch invariance,
    /// and those kernels are the shorter pass (0.5B shape, H100: the draft's rounds 0.14 ms
    /// shorter).
    pub fn static_rows_step(
        &self,
        b: &ExactRows,
        step: &StaticStep,
        cache: &SessionCache,
    ) -> Result<(), ModelError> {
        let feed = Pass::Feed {
            rows: b.rows,
            capacity: b.capacity,
        };
        let (h, head) = match self.plan(feed) {
            ForwardPath::StepRows => {
                // The step kernels read the first row's position; the rows follow it.
                let first = b.positions.narrow(0, 0, 1)?;
                self.step_stack(&self.fused_layers()?, &b.tokens, &first, b.capacity, cache)?
            }
            _ => self.exact_rows_stack(b, cache)?,
        };
        let last = h.narrow(0, b.rows - 1, 1)?;
        let launch = self.kernels.launch();
        let logits = crate::fused::gemv(&last, head, None, launch)?;
        crate::fused::greedy_head(
            &logits,
            &step.next,
            &step.next_logprob,
            &step.token,
            &step.position,
            launch,
        )?;
        Ok(())
    }

    /// The layers of [`Transformer::exact_rows`]: the final-normed hidden rows and the head.
    fn exact_rows_stack<'a>(
        &'a self,
        b: &ExactRows,
        cache: &SessionCache,
    ) -> Result<(Tensor, &'a Tensor), ModelError> {
        use crate::fused;
        let layers = self.exact_rows_layers("exact rows pass", b.capacity, b.rows, cache)?;
        let launch = self.kernels.launch();
        let product =
            |x: &Tensor, w: &Tensor, b: Option<&Tensor>| fused::bi_matmul(x, w, b, launch);
        // A chain's slots are its positions, read on the device.
        let slots = fused::RowSlots::Listed(&b.positions);
        self.rows_stack(
            &layers,
            &product,
            &b.tokens,
            &b.positions,
            slots,
            &b.keys,
            cache,
            RowsAttention::Exact,
        )
    }

    /// [`Transformer::static_step`] with the fused kernels ([`Transformer::fused_stack`] with
    /// the GEMV, rotary and cache write at the device-side position, and single-query
    /// attention); then the head and the greedy pick, which also advances `b.token` /
    /// `b.position`.
    fn static_step_fused(
        &self,
        layers: &[FusedLayer<'_>],
        b: &StaticStep,
        cache: &SessionCache,
    ) -> Result<(), ModelError> {
        use crate::fused;
        let (h, head) = self.step_stack(layers, &b.token, &b.position, b.capacity, cache)?;
        let launch = self.kernels.launch();
        let logits = fused::gemv(&h, head, None, launch)?;
        if let Some(out) = &b.logits {
            out.slice_set(&logits, 0, 0)?;
        }
        fused::greedy_head(
            &logits,
            &b.next,
            &b.next_logprob,
            &b.token,
            &b.position,
            launch,
        )?;
        Ok(())
    }

    /// The layers of the fused step ([`Transformer::fused_stack`] with the GEMV, rotary and
    /// cache write at device-side positions and decode attention) for one to
    /// [`crate::fused::GEMV_MAX_ROWS`] consecutive tokens, the first at cache slot `position`
    /// (a `(1,)` u32 buffer) over caches of `capacity` slots: the final-normed rows and the head.
    fn step_stack<'a>(
        &'a self,
        layers: &[FusedLayer<'_>],
        tokens: &Tensor,
        position: &Tensor,
        capacity: usize,
        cache: &SessionCache,
    ) -> Result<(Tensor, &'a Tensor), ModelError> {
        use crate::fused;
        let (shape, scale) = self.fused_attn_shape(capacity);
        let launch = self.kernels.launch();
        let product =
            |x: &Tensor, w: &Tensor, b: Option<&Tensor>| fused::gemv_rows(x, w, b, launch);
        self.fused_stack(layers, tokens, &product, |i, qkv| {
            let (kb, vb) = cache.buffers(i)?;
            let q = fused::qkv_rope_cache(
                qkv,
                &self.cos,
                &self.sin,
                position,
                kb,
                vb,
                shape,
                self.rope_interleaved,
                launch,
            )?;
            Ok(fused::decode_attention(
                &q, kb, vb, position, shape, scale, launch,
            )?)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use candle_core::Device;

    #[test]
    fn exact_rows_inputs_are_tokens_then_positions_then_key_counts() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let m = Transformer::random(cfg, 1, DType::F32, &Device::Cpu).unwrap();
        let b = m.exact_rows_buffers(16, 3, 16).unwrap();
        b.start(&[7, 8, 9], 5).unwrap();
        let io: Vec<u32> = b.io.to_vec1().unwrap();
        assert_eq!(io, [7, 8, 9, 5, 6, 7, 6, 0, 7, 0, 8, 0]);
        assert_eq!(b.tokens.to_vec1::<u32>().unwrap(), [7, 8, 9]);
        assert_eq!(b.positions.to_vec1::<u32>().unwrap(), [5, 6, 7]);
        // Wrong token counts and chains past the capacity are refused.
        assert!(b.start(&[1, 2], 0).is_err());
        assert!(b.start(&[1, 2, 3], 14).is_err());
        b.start(&[1, 2, 3], 13).unwrap();
        assert!(m.exact_rows_buffers(16, 0, 16).is_err());
        assert!(m
            .exact_rows_buffers(16, crate::fused::BI_MAX_ROWS + 1, 16)
            .is_err());
        m.exact_rows_buffers(16, crate::fused::BI_MAX_ROWS, 16)
            .unwrap();
        // A span past the capacity, or none, is refused.
        assert!(m.exact_rows_buffers(16, 3, 17).is_err());
        assert!(m.exact_rows_buffers(16, 3, 0).is_err());
    }

    #[test]
    fn rows_buffers_of_another_span_share_the_inputs_and_refuse_chains_past_it() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let m = Transformer::random(cfg, 1, DType::F32, &Device::Cpu).unwrap();
        let wide = m.exact_rows_buffers(64, 3, 64).unwrap();
        let short = wide.with_span(8).unwrap();
        assert_eq!((short.span(), short.capacity(), short.rows()), (8, 64, 3));
        // One upload serves both: the inputs are the same buffer.
        short.start(&[7, 8, 9], 5).unwrap();
        assert_eq!(
            wide.io.to_vec1::<u32>().unwrap(),
            [7, 8, 9, 5, 6, 7, 6, 0, 7, 0, 8, 0]
        );
        // A chain that ends past the span is refused with a message, within the cache or not.
        let e = short.start(&[1, 2, 3], 6).unwrap_err().to_string();
        assert!(e.contains("8 keys"), "{e}");
        assert!(short.start(&[1, 2, 3], 62).is_err());
        wide.start(&[1, 2, 3], 6).unwrap();
        assert!(wide.with_span(65).is_err());
        assert!(wide.with_span(0).is_err());
    }
}
