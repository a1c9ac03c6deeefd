//! Rotary embedding of the fused Q|K|V rows with the K/V cache write.

use super::{applies, imp, unfit, AttnShape, Launch};
use candle_core::{Result, Tensor};

/// Splits the fused Q|K|V rows `(r, (heads + 2 kv) * head_dim)` of `r` consecutive tokens
/// (`1 <= r <= GEMV_MAX_ROWS`), row `i` at the device-side position `pos + i` (`pos` a `(1,)`
/// u32 buffer): applies rotary with the `(positions, head_dim / 2)` tables to Q and K, writes K
/// and V into the caches `(1, kv, capacity, head_dim)` at slot `pos + i`, and returns the
/// rotated Q `(r, heads * head_dim)`. `interleaved` selects the `(2i, 2i + 1)` pair layout.
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_cache(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    pos: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    shape: AttnShape,
    interleaved: bool,
    launch: Launch,
) -> Result<Tensor> {
    if !applies(qkv) {
        return Err(unfit("qkv_rope_cache", &[qkv]));
    }
    imp::qkv_rope_cache(
        qkv,
        cos,
        sin,
        pos,
        k_cache,
        v_cache,
        shape,
        interleaved,
        launch,
    )
}

/// Where the K/V of a pass's rows are written in the caches.
#[derive(Debug, Clone, Copy)]
pub enum RowSlots<'a> {
    /// Slots `past..past + n`, after `past` cached entries.
    After(usize),
    /// The slots a `(n,)` u32 device buffer lists (read on the device, so a captured graph
    /// serves any cache length; the caller keeps them below the capacity).
    Listed(&'a Tensor),
}

/// [`qkv_rope_cache`] for the `n` rows of one pass: the fused Q|K|V rows `(n, (heads + 2 kv) *
/// head_dim)`, rotary at the positions `(n,)` u32 (each below the tables' length), K and V
/// written into the caches at `slots`; returns the rotated Q as `(1, heads, n, head_dim)`, the
/// layout [`rows_attention`](super::rows_attention) reads.
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_rows(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    positions: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    slots: RowSlots<'_>,
    shape: AttnShape,
    interleaved: bool,
    launch: Launch,
) -> Result<Tensor> {
    if !applies(qkv) {
        return Err(unfit("qkv_rope_rows", &[qkv]));
    }
    imp::qkv_rope_rows(
        qkv,
        cos,
        sin,
        positions,
        k_cache,
        v_cache,
        slots,
        shape,
        interleaved,
        launch,
    )
}
