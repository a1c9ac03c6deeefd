//! The matrix-vector products of the one-token step: one row ([`gemv`]) or a few rows sharing
//! each weight read ([`gemv_rows`]).

use super::{imp, operands_fit, unfit, Launch};
use candle_core::{Result, Tensor};

/// Whether `gemv(x, w, _)` can run: `w` [`weight_fits`](super::weight_fits) and `x` a contiguous, 16-byte aligned
/// bf16 `(1, k)` row on CUDA of the same width.
pub fn gemv_fits(x: &Tensor, w: &Tensor) -> bool {
    matches!((x.dims(), w.dims()), ([1, k], [_, kw]) if k == kw) && operands_fit(x, w)
}

/// `x W^T (+ b)` for one row: `x` `(1, k)`, `w` `(n, k)`, `b` `(n,)` → `(1, n)` bf16.
/// Fails unless [`gemv_fits`].
pub fn gemv(x: &Tensor, w: &Tensor, b: Option<&Tensor>, launch: Launch) -> Result<Tensor> {
    if !gemv_fits(x, w) {
        return Err(unfit("gemv", &[x, w]));
    }
    imp::gemv(x, w, b, launch)
}

/// The most rows of `x` one [`gemv_rows`] takes.
pub const GEMV_MAX_ROWS: usize = 4;

/// Whether `gemv_rows(x, w, _)` can run: `w` [`weight_fits`](super::weight_fits) and `x` a contiguous, 16-byte
/// aligned bf16 `(r, k)` matrix on CUDA of the same width with `1 <= r <= GEMV_MAX_ROWS`.
pub fn gemv_rows_fits(x: &Tensor, w: &Tensor) -> bool {
    matches!((x.dims(), w.dims()), ([r, k], [_, kw]) if k == kw && (1..=GEMV_MAX_ROWS).contains(r))
        && operands_fit(x, w)
}

/// `x W^T (+ b)` for a few rows: `x` `(r, k)`, `w` `(n, k)`, `b` `(n,)` → `(r, n)` bf16, each
/// weight read once for all rows. Row `j` of the result is [`gemv`] of row `j` alone, bit for
/// bit. Fails unless [`gemv_rows_fits`].
pub fn gemv_rows(x: &Tensor, w: &Tensor, b: Option<&Tensor>, launch: Launch) -> Result<Tensor> {
    if !gemv_rows_fits(x, w) {
        return Err(unfit("gemv_rows", &[x, w]));
    }
    imp::gemv(x, w, b, launch)
}
