//! Which path a pass takes through the model.

use super::Transformer;

impl Transformer {
    /// Whether attention runs the batch-invariant per-row path: always on the CPU, and on CUDA
    /// for quantized models (whose 8-bit activation rounding turns any last-bit difference of
    /// a batched attention into a visible change of the logits).
    pub(super) fn exact_attention(&self) -> bool {
        self.device.is_cpu() || self.lm_head.is_quantized()
    }

    /// Whether a CUDA pass of `n` rows runs the batch-invariant kernels end to end (products
    /// and attention): [`KernelOptions::batch_invariant`] on, a dense bf16 model whose widths
    /// the kernels take, and `n` at most [`crate::fused::BI_MAX_ROWS`].
    pub(super) fn gpu_batch_invariant(&self, n: usize) -> bool {
        n <= crate::fused::BI_MAX_ROWS
            && self.kernels.batch_invariant
            && self.gpu_rows_kernels_fit()
    }

    /// Whether a CUDA pass of `n` rows runs as one wide fused pass (see
    /// [`crate::fused::WIDE_MAX_ROWS`]): more rows than the batch-invariant passes take, at most
    /// the wide limit, [`KernelOptions::wide_rows`] on, and a model the rows kernels take.
    pub(super) fn gpu_wide(&self, n: usize) -> bool {
        n > crate::fused::BI_MAX_ROWS
            && n <= crate::fused::WIDE_MAX_ROWS
            && self.kernels.wide_rows
            && self.gpu_rows_kernels_fit()
    }

    /// Whether the rows kernels ([`crate::fused::rows_attention`], the rotary and cache write
    /// of every row) take this model: dense bf16 on CUDA, head size 64 or 128, at most
    /// [`crate::fused::RA_MAX_REP`] query heads a KV head, widths that are multiples of 32.
    pub(super) fn gpu_rows_kernels_fit(&self) -> bool {
        let c = &self.config;
        crate::fused::applies(&self.norm)
            && matches!(c.head_dim, 64 | 128)
            && c.num_key_value_heads > 0
            && c.num_attention_heads / c.num_key_value_heads <= crate::fused::RA_MAX_REP
            && c.hidden_size.is_multiple_of(32)
            && c.intermediate_size.is_multiple_of(32)
            && (c.num_attention_heads * c.head_dim).is_multiple_of(32)
            && !self.is_quantized()
    }
}
