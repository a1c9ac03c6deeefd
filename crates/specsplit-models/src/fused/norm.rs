//! Residual add with RMSNorm.

use super::{applies, imp, unfit, Launch};
use candle_core::{Result, Tensor};

/// Residual add and RMSNorm of `rows` rows: `s = x + delta` (`s = x` without `delta`), returns
/// `(s, s / rms(s) * weight)`, both `(rows, d)` bf16.
pub fn add_rmsnorm(
    x: &Tensor,
    delta: Option<&Tensor>,
    weight: &Tensor,
    eps: f32,
    launch: Launch,
) -> Result<(Tensor, Tensor)> {
    if !applies(x) {
        return Err(unfit("add_rmsnorm", &[x]));
    }
    imp::add_rmsnorm(x, delta, weight, eps, launch)
}
