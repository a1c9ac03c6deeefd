//! The SwiGLU gate, the greedy head of the one-token step, that of a chain growth's rows, the
//! argmax of rows, and the top logits of a few rows.

use super::{applies, imp, unfit, Launch};
use candle_core::{DType, Result, Tensor};

/// SwiGLU gate of `(rows, 2 n)` = `[gate | up]`: `silu(gate) * up`, `(rows, n)` bf16.
pub fn silu_mul(gate_up: &Tensor, launch: Launch) -> Result<Tensor> {
    if !applies(gate_up) {
        return Err(unfit("silu_mul", &[gate_up]));
    }
    imp::silu_mul(gate_up, launch)
}

/// The greedy head of one token, all on the device: writes `argmax(logits)` (lowest index among
/// equal maxima) to `next` and `token`, its log-probability to `logprob` (f32), and adds one to
/// `pos`. `logits` is `(1, vocab)` bf16; the others are `(1,)` buffers (u32, f32, u32, u32).
pub fn greedy_head(
    logits: &Tensor,
    next: &Tensor,
    logprob: &Tensor,
    token: &Tensor,
    pos: &Tensor,
    launch: Launch,
) -> Result<()> {
    if !applies(logits) {
        return Err(unfit("greedy_head", &[logits]));
    }
    imp::greedy_head(logits, next, logprob, token, pos, launch)
}

/// The greedy heads of the rows of a chain growth level, all on the device: row `r`'s token is
/// `forced[r]` where `forced_on[r]` is nonzero (and `forced[r]` lies in the vocabulary), else
/// `argmax(logits[r])` (lowest index among equal maxima); writes it as f32 to `tok[r]` and its
/// log-probability (logit − logsumexp, f32) to `lp[r]`, and returns the tokens `(rows,)` u32.
/// `logits` is `(rows, vocab)` bf16; `forced`, `forced_on` (u32) and `tok`, `lp` (f32) hold
/// `rows` values each.
pub fn greedy_rows(
    logits: &Tensor,
    forced: &Tensor,
    forced_on: &Tensor,
    tok: &Tensor,
    lp: &Tensor,
    launch: Launch,
) -> Result<Tensor> {
    if !applies(logits) {
        return Err(unfit("greedy_rows", &[logits]));
    }
    imp::greedy_rows(logits, forced, forced_on, tok, lp, launch)
}

/// The index of the largest logit of every row of each of `logits` (each `(rows, vocab)`, bf16
/// or f32 on CUDA, all of one vocabulary, dtype and device), in order, as one `(total rows,)`
/// u32 tensor: the lowest index among equal maxima, 0 for a row with no logit above -inf (NaN
/// never wins), as [`specsplit_core::sampling::argmax`] picks on the host. Two launches a
/// matrix, each row spread over many blocks, so that one copy to the host serves them all.
pub fn argmax_rows(logits: &[&Tensor], launch: Launch) -> Result<Tensor> {
    let fits = |t: &Tensor| {
        cfg!(feature = "cuda")
            && t.device().is_cuda()
            && matches!(t.dtype(), DType::BF16 | DType::F32)
            && t.rank() == 2
    };
    if logits.is_empty() || !logits.iter().all(|t| fits(t)) {
        return Err(unfit("argmax_rows", logits));
    }
    imp::argmax_rows(logits, launch)
}

/// The `width` largest logits of each row of `logits` `(rows, vocab)` (bf16 or f32 on CUDA),
/// in `width` rounds of one blocked argmax over all rows: `(rows, 2 width + 1)` f32 where
/// row `r` holds the picked ids in columns `0..width` (best first, the lowest index among equal
/// logits; -1 once only -inf logits remain), their logits in `width..2 width` (-inf where none)
/// and the row's logsumexp in column `2 width`. A logit minus the logsumexp is its
/// log-probability. Needs `1 <= width <= vocab`.
pub fn top_rows(logits: &Tensor, width: usize, launch: Launch) -> Result<Tensor> {
    let on_cuda = cfg!(feature = "cuda") && logits.device().is_cuda();
    if !on_cuda || !matches!(logits.dtype(), DType::BF16 | DType::F32) {
        return Err(unfit("top_rows", &[logits]));
    }
    imp::top_rows(logits, width, launch)
}
