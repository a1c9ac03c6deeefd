//! The batch-invariant matrix product ([`bi_matmul`]: each row's result independent of the
//! other rows of the pass) and the cuBLAS product of the wide passes.

use super::{imp, operands_fit, unfit, Launch};
use candle_core::{Result, Tensor};

/// The most rows a pass may have for the model to run it with the batch-invariant kernels
/// ([`bi_matmul`], [`rows_attention`](super::rows_attention)); longer passes (prompt prefills) keep cuBLAS.
pub const BI_MAX_ROWS: usize = 64;

/// The most rows a pass may have for the model to run it as one *wide* fused pass: passes of
/// more than [`BI_MAX_ROWS`] rows (prompt prefills) run the fused layer stack with cuBLAS
/// products ([`cublas_product`]) and [`rows_attention`](super::rows_attention), about eleven launches a layer instead
/// of the twenty-odd of candle's batched ops. Longer passes keep the batched ops, whose
/// attention scores take less memory than [`rows_attention`](super::rows_attention)'s partial sums.
pub const WIDE_MAX_ROWS: usize = 256;

/// `x W^T (+ b)` through candle's matmul (cuBLAS on CUDA): `x` `(m, k)`, `w` `(n, k)`, `b`
/// `(n,)` → `(m, n)`. The product of the wide fused passes, where tensor-core GEMMs over many
/// rows beat [`bi_matmul`] and batch invariance is not needed.
pub fn cublas_product(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    let y = x.matmul(&w.t()?)?;
    match b {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// Whether `bi_matmul(x, w, _)` can run: `w` [`weight_fits`](super::weight_fits) with a width that is a multiple
/// of 32, and `x` a contiguous, 16-byte aligned bf16 `(m, k)` matrix on CUDA with `m >= 1`.
pub fn bi_matmul_fits(x: &Tensor, w: &Tensor) -> bool {
    matches!((x.dims(), w.dims()), ([m, k], [_, kw]) if *m >= 1 && k == kw && k.is_multiple_of(32))
        && operands_fit(x, w)
}

/// `x W^T (+ b)` on tensor cores with each row's result independent of the other rows: `x`
/// `(m, k)`, `w` `(n, k)`, `b` `(n,)` → `(m, n)` bf16. Fails unless [`bi_matmul_fits`].
pub fn bi_matmul(x: &Tensor, w: &Tensor, b: Option<&Tensor>, launch: Launch) -> Result<Tensor> {
    if !bi_matmul_fits(x, w) {
        return Err(unfit("bi_matmul", &[x, w]));
    }
    imp::bi_matmul(x, w, b, launch)
}
