//! Which fused-kernel paths a model runs.

use super::{BiTuning, Launch};

/// Which fused-kernel paths a model runs (held by
/// [`crate::transformer::Transformer`]; tests and benchmarks turn parts off to compare). All on
/// by default with the `cuda` feature, all off without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelOptions {
    /// The fused greedy (draft) step and the fused layer stack of the batch-invariant and wide
    /// passes; off: candle's ops.
    pub fused: bool,
    /// Programmatic dependent launch (see [`Launch::pdl`]).
    pub pdl: bool,
    /// Dense bf16 passes of at most [`super::BI_MAX_ROWS`] rows on CUDA run the batch-invariant
    /// kernels, so that a token decoded alone and the same token verified among tree nodes get
    /// bit-identical logits (greedy speculation then emits exactly what the target alone
    /// emits); off: cuBLAS and candle's attention.
    pub batch_invariant: bool,
    /// Dense bf16 passes of more than [`super::BI_MAX_ROWS`] and at most [`super::WIDE_MAX_ROWS`]
    /// rows on CUDA run as one wide fused pass. Such passes are prompt prefills, which a target
    /// runs the same way whether it decodes alone or verifies drafts, so this changes no output's
    /// exactness.
    pub wide_rows: bool,
}

impl Default for KernelOptions {
    fn default() -> Self {
        let on = cfg!(feature = "cuda");
        Self {
            fused: on,
            pdl: on,
            batch_invariant: on,
            wide_rows: on,
        }
    }
}

impl KernelOptions {
    /// These options with everything the `cuda` feature lacks turned off.
    pub fn available(self) -> Self {
        let on = cfg!(feature = "cuda");
        Self {
            fused: self.fused && on,
            pdl: self.pdl && on,
            batch_invariant: self.batch_invariant && on,
            wide_rows: self.wide_rows && on,
        }
    }

    /// How the model launches its kernels: [`KernelOptions::pdl`] and the built-in
    /// [`bi_matmul`](super::bi_matmul) launch shapes.
    pub fn launch(&self) -> Launch {
        Launch {
            pdl: self.pdl,
            bi_tuning: BiTuning::default(),
            rows_heads: None,
            gemv_warp_rows: None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::bi_matmul;
    use crate::fused::bi_matmul_fits;
    use candle_core::{DType, Device, Tensor};

    #[test]
    fn kernel_options_need_the_cuda_feature() {
        let on = cfg!(feature = "cuda");
        let all = KernelOptions {
            fused: true,
            pdl: true,
            batch_invariant: true,
            wide_rows: true,
        };
        assert_eq!(KernelOptions::default(), all.available());
        let got = all.available();
        assert_eq!(
            (got.fused, got.pdl, got.batch_invariant, got.wide_rows),
            (on, on, on, on)
        );
        assert_eq!(all.launch(), Launch::DEFAULT);
        let x = Tensor::zeros((2, 64), DType::BF16, &Device::Cpu).unwrap();
        let w = Tensor::zeros((16, 64), DType::BF16, &Device::Cpu).unwrap();
        assert!(!bi_matmul_fits(&x, &w));
        assert!(bi_matmul(&x, &w, None, Launch::DEFAULT).is_err());
    }
}
