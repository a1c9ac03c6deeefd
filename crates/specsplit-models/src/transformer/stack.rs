//! The fused layer stack: every layer through SpecSplit's kernels (add+RMSNorm, products,
//! rotary with the cache write, attention, SwiGLU), shared by the graph step, the
//! batch-invariant passes and the wide passes.

use super::linear::{Linear, Proj};
use super::{Layer, Product, Transformer};
use crate::ModelError;
use candle_core::{DType, Tensor};
use specsplit_core::cache::SessionCache;

/// The attention a pass's rows take.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RowsAttention {
    /// The batch-invariant rows attention: a row gets the exact step's bits.
    Exact,
    /// For passes that only propose tokens: the one-kernel draft attention where the keys'
    /// span is at most [`crate::fused::DRAFT_ATTENTION_MAX_SPAN`], else the rows attention.
    Draft,
}

/// A layer's dense weights and biases for [`Transformer::static_step`]'s fused kernels.
pub(super) struct FusedLayer<'a> {
    layer: &'a Layer,
    qkv: (Tensor, Option<Tensor>),
    o: (Tensor, Option<Tensor>),
    gate_up: (Tensor, Option<Tensor>),
    down: (Tensor, Option<Tensor>),
}

impl Transformer {
    /// [`Transformer::forward`] of a pass with the fused kernels ([`Transformer::fused_stack`]
    /// with `product`, rotary and cache write for all rows, and the rows' attention): about 10
    /// launches a layer instead of about 19. With [`crate::fused::bi_matmul`] every kernel
    /// computes a row from that row alone, so the pass is batch-invariant; a wide pass uses
    /// [`crate::fused::cublas_product`].
    #[allow(clippy::too_many_arguments)]
    pub(super) fn forward_fused_rows(
        &self,
        layers: &[FusedLayer<'_>],
        product: Product<'_>,
        tokens: &Tensor,
        positions: &Tensor,
        keys: &crate::fused::PassKeys,
        cache: &mut SessionCache,
        rows: &Tensor,
    ) -> Result<Tensor, ModelError> {
        let slots = crate::fused::RowSlots::After(cache.len());
        let exact = RowsAttention::Exact;
        let (h, head) = self.rows_stack(
            layers, product, tokens, positions, slots, keys, cache, exact,
        )?;
        cache.advance(tokens.dim(0)?)?;
        let h = h.index_select(rows, 0)?;
        Ok(product(&h, head, None)?.to_dtype(DType::F32)?)
    }

    /// [`Transformer::fused_stack`] of a pass's rows with `product`: rotary at `positions`,
    /// K/V written at `slots`, and each row's `attention` over the slots `keys` give it. The
    /// final-normed hidden rows and the head; the cache's length is left alone.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn rows_stack<'a>(
        &'a self,
        layers: &[FusedLayer<'_>],
        product: Product<'_>,
        tokens: &Tensor,
        positions: &Tensor,
        slots: crate::fused::RowSlots<'_>,
        keys: &crate::fused::PassKeys,
        cache: &SessionCache,
        attention: RowsAttention,
    ) -> Result<(Tensor, &'a Tensor), ModelError> {
        use crate::fused;
        let (shape, scale) = self.fused_attn_shape(cache.capacity());
        let launch = self.kernels.launch();
        self.fused_stack(layers, tokens, product, |i, qkv| {
            let (kb, vb) = cache.buffers(i)?;
            let q = fused::qkv_rope_rows(
                qkv,
                &self.cos,
                &self.sin,
                positions,
                kb,
                vb,
                slots,
                shape,
                self.rope_interleaved,
                launch,
            )?;
            let draft =
                attention == RowsAttention::Draft && keys.span() <= fused::DRAFT_ATTENTION_MAX_SPAN;
            Ok(if draft {
                fused::draft_attention(&q, kb, vb, keys, shape, scale, launch)?
            } else {
                fused::rows_attention(&q, kb, vb, keys, shape, scale, launch)?
            })
        })
    }

    /// The fused layers for a batch-invariant pass of `rows` rows over `cache`, whose
    /// buffers (named `what` in errors) are for caches of `capacity` slots: fails unless the
    /// cache is of that capacity and shape and [`Transformer::exact_rows_fit`] holds.
    pub(super) fn exact_rows_layers(
        &self,
        what: &str,
        capacity: usize,
        rows: usize,
        cache: &SessionCache,
    ) -> Result<Vec<FusedLayer<'_>>, ModelError> {
        if cache.capacity() != capacity || *cache.spec() != self.cache_spec(capacity) {
            return Err(ModelError::Input(format!(
                "{what} buffers are for {capacity} entries, the cache is {:?}",
                cache.spec()
            )));
        }
        match self.fused_layers() {
            Ok(l) if self.exact_rows_fit(capacity, rows) => Ok(l),
            _ => Err(ModelError::Unsupported(format!(
                "no {rows}-row {what} for this model (needs bf16 on CUDA with the fused \
                 batch-invariant kernels)"
            ))),
        }
    }

    /// The attention shape of the fused kernels over caches of `capacity` slots, and the
    /// attention scale.
    pub(super) fn fused_attn_shape(&self, capacity: usize) -> (crate::fused::AttnShape, f32) {
        let c = &self.config;
        let shape = crate::fused::AttnShape {
            heads: c.num_attention_heads,
            kv: c.num_key_value_heads,
            head_dim: c.head_dim,
            capacity,
        };
        (shape, 1.0 / (c.head_dim as f32).sqrt())
    }

    /// The fused layer stack shared by the graph step and the batch-invariant passes: embeds
    /// `tokens`, then per layer add+RMSNorm, the Q|K|V product, `attend(layer, qkv)` (rotary,
    /// cache write and attention), the output product, add+RMSNorm, the gate|up product, the
    /// SwiGLU gate and the down product, with `product` for every dense product. Returns the
    /// final-normed hidden rows and the head's weight.
    pub(super) fn fused_stack<'a>(
        &'a self,
        layers: &[FusedLayer<'_>],
        tokens: &Tensor,
        product: Product<'_>,
        mut attend: impl FnMut(usize, &Tensor) -> Result<Tensor, ModelError>,
    ) -> Result<(Tensor, &'a Tensor), ModelError> {
        use crate::fused;
        let Linear::Dense { w: head, .. } = &self.lm_head else {
            return Err(ModelError::Unsupported(
                "fused kernels with a quantized head".into(),
            ));
        };
        let eps = self.config.rms_norm_eps as f32;
        let launch = self.kernels.launch();
        let x = self.embed.forward(tokens, self.dtype)?;
        let first_norm = layers.first().map_or(&self.norm, |l| &l.layer.attn_norm);
        let (mut x, mut h) = fused::add_rmsnorm(&x, None, first_norm, eps, launch)?;
        for (i, l) in layers.iter().enumerate() {
            let qkv = product(&h, &l.qkv.0, l.qkv.1.as_ref())?;
            let y = attend(i, &qkv)?;
            let a = product(&y, &l.o.0, l.o.1.as_ref())?;
            (x, h) = fused::add_rmsnorm(&x, Some(&a), &l.layer.mlp_norm, eps, launch)?;
            let gu = product(&h, &l.gate_up.0, l.gate_up.1.as_ref())?;
            let m = product(&fused::silu_mul(&gu, launch)?, &l.down.0, l.down.1.as_ref())?;
            let next_norm = layers.get(i + 1).map_or(&self.norm, |n| &n.layer.attn_norm);
            (x, h) = fused::add_rmsnorm(&x, Some(&m), next_norm, eps, launch)?;
        }
        Ok((h, head))
    }

    /// The fused layer stack's weights, where [`Transformer::fused_enabled`]: the path
    /// [`Transformer::plan`] names `Fused…` or `StepRows` for.
    pub(super) fn fused_layers(&self) -> Result<Vec<FusedLayer<'_>>, ModelError> {
        match self.fused_enabled().then(|| self.fused_weights()).flatten() {
            Some(layers) => Ok(layers),
            None => Err(ModelError::Unsupported(
                "the fused layer stack does not take this model".into(),
            )),
        }
    }

    /// The dense weights of every layer where the fused kernels apply to this model (bf16 on
    /// CUDA, fused Q|K|V and gate|up projections, head size 64 or 128, widths that are multiples
    /// of 8), else `None`.
    pub(super) fn fused_weights(&self) -> Option<Vec<FusedLayer<'_>>> {
        let c = &self.config;
        let fits = crate::fused::applies(&self.norm)
            && matches!(c.head_dim, 64 | 128)
            && c.hidden_size.is_multiple_of(8)
            && c.intermediate_size.is_multiple_of(8)
            && (c.num_attention_heads * c.head_dim).is_multiple_of(8)
            && self.cos.is_contiguous()
            && self.sin.is_contiguous()
            && matches!(&self.lm_head, Linear::Dense { w, b: None } if crate::fused::weight_fits(w));
        if !fits {
            return None;
        }
        self.layers
            .iter()
            .map(|l| {
                let dense = |lin: &'_ Linear| match lin {
                    Linear::Dense { w, b } if crate::fused::weight_fits(w) => {
                        Some((w.clone(), b.clone()))
                    }
                    _ => None,
                };
                let fused = |p: &'_ Proj, parts: usize| match p {
                    Proj::Fused { lin, sizes } if sizes.len() == parts => dense(lin),
                    _ => None,
                };
                Some(FusedLayer {
                    layer: l,
                    qkv: fused(&l.qkv, 3)?,
                    o: dense(&l.o)?,
                    gate_up: fused(&l.gate_up, 2)?,
                    down: dense(&l.down)?,
                })
            })
            .collect()
    }
}
