//! Which path a pass takes through the model: [`Transformer::plan`] names it from the pass,
//! the device, the dtype, the weights and the model's [`crate::fused::KernelOptions`], and the
//! entry points run what it names.

use super::Transformer;
use crate::fused::{BI_MAX_ROWS, GEMV_MAX_ROWS, RA_MAX_REP, WIDE_MAX_ROWS};
use std::sync::atomic::Ordering;

/// A pass the model is asked to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// [`Transformer::forward`] or [`Transformer::forward_tree`] of `rows` new tokens.
    Forward {
        /// New tokens of the pass.
        rows: usize,
    },
    /// [`Transformer::static_step`] over caches of `capacity` slots.
    Step {
        /// Slots of the cache.
        capacity: usize,
    },
    /// [`Transformer::static_rows_step`] of `rows` tokens over caches of `capacity` slots.
    Feed {
        /// Tokens fed.
        rows: usize,
        /// Slots of the cache.
        capacity: usize,
    },
}

/// The path a pass takes through the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForwardPath {
    /// The fused layer stack with the batch-invariant products and rows attention (at most
    /// [`BI_MAX_ROWS`] rows on CUDA): a row's logits do not depend on the pass.
    FusedExact,
    /// candle's ops around the batch-invariant products and rows attention (the fused kernels
    /// off): a row's logits do not depend on the pass.
    ExactUnfused,
    /// The fused layer stack with cuBLAS products and the rows attention (more than
    /// [`BI_MAX_ROWS`] and at most [`WIDE_MAX_ROWS`] rows on CUDA: prompt prefills).
    FusedWide,
    /// candle's ops with cuBLAS products and the rows attention (a wide pass, the fused kernels
    /// off).
    WideUnfused,
    /// candle's ops with attention computed row by row ([`crate::cpu_attention`]): the CPU, and
    /// quantized models on CUDA; batch-invariant.
    PerRow,
    /// candle's batched ops under a mask.
    Batched,
    /// The one-token step through the fused kernels.
    FusedStep,
    /// The one-token step through candle's ops.
    CandleStep,
    /// A feed of a few tokens through the one-token step's kernels, each weight read once for
    /// all rows: every row bit for bit what one step a token gives it.
    StepRows,
    /// A feed through the exact rows pass ([`Transformer::exact_rows`]'s layers).
    ExactRows,
}

impl Transformer {
    /// The path `pass` takes through this model (logged at debug level the first time the
    /// model takes each path).
    pub fn plan(&self, pass: Pass) -> ForwardPath {
        let path = match pass {
            Pass::Forward { rows } if self.gpu_batch_invariant(rows) => {
                if self.fused_enabled() {
                    ForwardPath::FusedExact
                } else {
                    ForwardPath::ExactUnfused
                }
            }
            Pass::Forward { rows } if self.gpu_wide(rows) => {
                if self.fused_enabled() {
                    ForwardPath::FusedWide
                } else {
                    ForwardPath::WideUnfused
                }
            }
            Pass::Forward { .. } if self.exact_attention() => ForwardPath::PerRow,
            Pass::Forward { .. } => ForwardPath::Batched,
            // The fused step indexes the rotary tables by slot: they must cover the capacity.
            Pass::Step { capacity }
                if self.cos.dim(0).is_ok_and(|d| d >= capacity) && self.fused_enabled() =>
            {
                ForwardPath::FusedStep
            }
            Pass::Step { .. } => ForwardPath::CandleStep,
            Pass::Feed { rows, capacity }
                if rows <= GEMV_MAX_ROWS
                    && self.fused_enabled()
                    && self.exact_rows_fit(capacity, rows) =>
            {
                ForwardPath::StepRows
            }
            Pass::Feed { .. } => ForwardPath::ExactRows,
        };
        let bit = 1u16 << path as u16;
        if self.logged_paths.fetch_or(bit, Ordering::Relaxed) & bit == 0 {
            tracing::debug!(?pass, ?path, options = ?self.kernels, "forward path");
        }
        path
    }

    /// Whether the fused layer stack runs for this model:
    /// [`crate::fused::KernelOptions::fused`] on and weights the kernels take.
    pub(super) fn fused_enabled(&self) -> bool {
        self.kernels.fused
            && *self
                .fused_fit
                .get_or_init(|| self.fused_weights().is_some())
    }

    /// Whether attention runs the batch-invariant per-row path: always on the CPU, and on CUDA
    /// for quantized models (whose 8-bit activation rounding turns any last-bit difference of
    /// a batched attention into a visible change of the logits).
    fn exact_attention(&self) -> bool {
        self.device.is_cpu() || self.lm_head.is_quantized()
    }

    /// Whether a CUDA pass of `n` rows runs the batch-invariant kernels end to end (products
    /// and attention): [`crate::fused::KernelOptions::batch_invariant`] on, a dense bf16 model
    /// whose widths the kernels take, and `n` at most [`BI_MAX_ROWS`].
    pub(super) fn gpu_batch_invariant(&self, n: usize) -> bool {
        n <= BI_MAX_ROWS && self.kernels.batch_invariant && self.gpu_rows_kernels_fit()
    }

    /// Whether a CUDA pass of `n` rows runs as one wide fused pass (see [`WIDE_MAX_ROWS`]): more
    /// rows than the batch-invariant passes take, at most the wide limit,
    /// [`crate::fused::KernelOptions::wide_rows`] on, and a model the rows kernels take.
    fn gpu_wide(&self, n: usize) -> bool {
        n > BI_MAX_ROWS
            && n <= WIDE_MAX_ROWS
            && self.kernels.wide_rows
            && self.gpu_rows_kernels_fit()
    }

    /// Whether the rows kernels ([`crate::fused::rows_attention`], the rotary and cache write
    /// of every row) take this model: dense bf16 on CUDA, head size 64 or 128, at most
    /// [`RA_MAX_REP`] query heads a KV head, widths that are multiples of 32.
    fn gpu_rows_kernels_fit(&self) -> bool {
        let c = &self.config;
        crate::fused::applies(&self.norm)
            && matches!(c.head_dim, 64 | 128)
            && c.num_key_value_heads > 0
            && c.num_attention_heads / c.num_key_value_heads <= RA_MAX_REP
            && c.hidden_size.is_multiple_of(32)
            && c.intermediate_size.is_multiple_of(32)
            && (c.num_attention_heads * c.head_dim).is_multiple_of(32)
            && !self.is_quantized()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use candle_core::{DType, Device};

    #[test]
    fn a_cpu_model_takes_the_per_row_and_candle_paths() {
        let cfg = ModelConfig::preset("tiny").unwrap();
        let m = Transformer::random(cfg, 1, DType::F32, &Device::Cpu).unwrap();
        for rows in [1, BI_MAX_ROWS, WIDE_MAX_ROWS + 1] {
            assert_eq!(m.plan(Pass::Forward { rows }), ForwardPath::PerRow);
        }
        assert_eq!(m.plan(Pass::Step { capacity: 16 }), ForwardPath::CandleStep);
        let feed = Pass::Feed {
            rows: 2,
            capacity: 16,
        };
        assert_eq!(m.plan(feed), ForwardPath::ExactRows);
        assert!(!m.fused_enabled() && !m.exact_rows_fit(16, 2));
    }
}
