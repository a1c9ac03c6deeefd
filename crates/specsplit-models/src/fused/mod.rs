//! Fused bf16 CUDA kernels for one-token decode steps (`src/cuda/kernels.cu`, compiled to PTX by
//! the build script when the `cuda` feature is on): a matrix-vector product, residual add with
//! RMSNorm, rotary on Q and K with the K/V cache write, single-query attention, the SwiGLU gate
//! and the greedy head.
//!
//! A one-token step built from them launches about 8 kernels a layer instead of about 23, reads
//! the token's position from device memory (so it can be captured into a CUDA graph), and
//! attends only over the valid cache slots. Each kernel rounds to bf16 where the unfused candle
//! ops round; results agree with them within bf16 rounding, not bit for bit.
//!
//! Off CUDA, or for tensors that are not bf16, [`applies`] is false and the callers keep the
//! unfused path. Where a model uses them is its [`KernelOptions`]: with `fused` on (the
//! default) the fixed-shape greedy step, which only drafts (its tokens are proposals the target
//! verifies), so it cannot change any output, and the passes that run the batch-invariant
//! kernels below (whose fused kernels compute each row from that row alone, so they stay
//! batch-invariant).
//!
//! The same PTX holds the batch-invariant kernels ([`bi_matmul`], [`rows_attention`]) that every
//! dense bf16 pass of at most [`BI_MAX_ROWS`] rows runs while the model's `batch_invariant`
//! option is on (the default): a token's logits are then bit-identical whether it is decoded
//! alone or verified among tree nodes, so greedy speculation emits exactly the target-only
//! output. A draft's passes that only propose tokens (a pre-draft's growth, the sessions'
//! shared chains) attend with [`draft_attention`] instead: one kernel where the rows attention
//! takes two, and not the exact step's bits. Every kernel wrapper takes a [`Launch`]: how its
//! kernels are launched.
//!
//! The wrappers, by kernel family: `gemv`, `bi_matmul`, `norm`, `rope`, `attention` and
//! `elementwise` check their operands (`sessions` those of a multi-session pass, `cache` the
//! moves of cache entries); `launch` holds the launch-shape rules, `scratch` the
//! graph-capture output carving, and `cuda` (`off` without the feature) loads the PTX and
//! launches.

mod attention;
mod bi_matmul;
mod cache;
mod elementwise;
mod gemv;
#[cfg(feature = "cuda")]
#[path = "cuda.rs"]
mod imp;
#[cfg(not(feature = "cuda"))]
#[path = "off.rs"]
mod imp;
mod launch;
mod norm;
mod options;
mod rope;
#[cfg(feature = "cuda")]
mod scratch;
mod sessions;

pub use attention::{
    decode_attention, draft_attention, rows_attention, AttnShape, PassKeys, RA_MAX_REP,
};
pub use bi_matmul::{bi_matmul, bi_matmul_fits, cublas_product, BI_MAX_ROWS, WIDE_MAX_ROWS};
pub use cache::{move_entries, MOVE_MAX};
pub use elementwise::{argmax_rows, greedy_head, greedy_rows, silu_mul, top_rows};
pub use gemv::{gemv, gemv_fits, gemv_rows, gemv_rows_fits, GEMV_MAX_ROWS};
pub use launch::{
    decode_attention_splits, draft_attention_warps, replay_span, BiTuning, Launch,
    DRAFT_ATTENTION_MAX_SPAN, PDL_AVAILABLE, RA_STAGE,
};
pub use norm::add_rmsnorm;
pub use options::KernelOptions;
pub use rope::{qkv_rope_cache, qkv_rope_rows, RowSlots};
#[cfg(feature = "cuda")]
pub use scratch::{carving, counting, Scratch, ScratchNeed};
pub use sessions::{
    address_words, cache_words, draft_sessions_attention, qkv_rope_sessions, sessions_attention,
    RowKeyList, SessionRows, SessionTable, TableSession,
};

#[cfg(feature = "cuda")]
use launch::{bi_col_tiles, bi_lean, bi_splits, bi_x_ahead};
#[cfg(feature = "cuda")]
use scratch::scratch_output;

use candle_core::{DType, Result, Tensor};

/// Whether the fused kernels can run on `t`: built with `cuda`, on CUDA, in bf16.
pub fn applies(t: &Tensor) -> bool {
    cfg!(feature = "cuda") && t.device().is_cuda() && t.dtype() == DType::BF16
}

/// Whether `w` can be a [`gemv`] weight: a contiguous, 16-byte aligned bf16 `(n, k)` matrix on
/// CUDA with `k` a multiple of 8.
pub fn weight_fits(w: &Tensor) -> bool {
    applies(w)
        && matches!(w.dims(), [_, k] if k.is_multiple_of(8))
        && w.is_contiguous()
        && imp::aligned16(w)
}

/// Whether `x` (an input whose shape the caller checks) and `w` can feed a product kernel:
/// `x` contiguous, 16-byte aligned bf16 on CUDA, and `w` [`weight_fits`].
fn operands_fit(x: &Tensor, w: &Tensor) -> bool {
    applies(x) && x.is_contiguous() && imp::aligned16(x) && weight_fits(w)
}

/// Writes `values` from the host into the contiguous u32 device buffer `dst` (one
/// host-to-device copy on `dst`'s stream, no allocation): how a captured step's inputs are set.
pub fn write_u32(dst: &Tensor, values: &[u32]) -> Result<()> {
    if dst.dtype() != candle_core::DType::U32 || dst.elem_count() != values.len() {
        return Err(candle_core::Error::Msg(format!(
            "write_u32 of {} values into {:?} {:?}",
            values.len(),
            dst.dims(),
            dst.dtype()
        )));
    }
    if !dst.device().is_cuda() {
        let src = Tensor::new(values, dst.device())?.reshape(dst.shape())?;
        return dst.slice_set(&src, 0, 0);
    }
    imp::write_u32(dst, values)
}

fn unfit(kernel: &str, ts: &[&Tensor]) -> candle_core::Error {
    let what: Vec<String> = ts
        .iter()
        .map(|t| {
            format!(
                "{:?} {:?} on {:?}",
                t.dims(),
                t.dtype(),
                t.device().location()
            )
        })
        .collect();
    candle_core::Error::Msg(format!(
        "fused kernel {kernel} does not apply to {} (needs bf16 on CUDA, built with `cuda`)",
        what.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn cpu_tensors_are_refused_with_a_message() {
        let x = Tensor::zeros((1, 16), DType::BF16, &Device::Cpu).unwrap();
        let w = Tensor::zeros((4, 16), DType::BF16, &Device::Cpu).unwrap();
        assert!(!applies(&x));
        assert!(!gemv_fits(&x, &w));
        let e = gemv(&x, &w, None, Launch::DEFAULT).unwrap_err().to_string();
        assert!(e.contains("needs bf16 on CUDA"), "{e}");
        let rows = Tensor::zeros((2, 16), DType::BF16, &Device::Cpu).unwrap();
        assert!(!gemv_rows_fits(&rows, &w));
        let e = gemv_rows(&rows, &w, None, Launch::DEFAULT)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("gemv_rows") && e.contains("needs bf16 on CUDA"),
            "{e}"
        );
        assert!(silu_mul(&x, Launch::DEFAULT).is_err());
        assert!(add_rmsnorm(&x, None, &w.get(0).unwrap(), 1e-6, Launch::DEFAULT).is_err());
    }
}
