//! The SwiGLU gate, the greedy head of the one-token step and that of a chain growth's rows.

use super::{applies, imp, unfit, Launch};
use candle_core::{Result, Tensor};

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
