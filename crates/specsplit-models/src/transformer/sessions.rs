//! Several sessions' rows in one call: each session brings its new tokens, their positions,
//! their visibility and its own KV cache.

use candle_core::Tensor;
use specsplit_core::cache::SessionCache;

use super::Transformer;
use crate::cpu_attention::TreeRows;
use crate::ModelError;

/// One session's share of a multi-session pass: what `Transformer::forward_tree` takes for it.
pub struct SessionPass<'a> {
    /// The session's new tokens (host).
    pub tokens: &'a [u32],
    /// Their rotary positions.
    pub positions: &'a [u32],
    /// Their visibility, exactly as for `forward_tree`.
    pub tree: TreeRows<'a>,
    /// The session's own cache (its length grows by `tokens.len()`).
    pub cache: &'a mut SessionCache,
    /// The rows whose logits the session wants.
    pub rows: &'a [u32],
}

impl Transformer {
    /// Runs every session's rows; returns each session's f32 logits `(rows.len(), vocab)`, bit
    /// for bit what [`Transformer::forward_tree`] of that session alone returns, and the same
    /// KV. This version runs the sessions one after another.
    pub fn forward_sessions(
        &self,
        parts: &mut [SessionPass<'_>],
    ) -> Result<Vec<Tensor>, ModelError> {
        let dev = self.device().clone();
        parts
            .iter_mut()
            .map(|p| {
                let ids = Tensor::new(p.tokens, &dev)?;
                let pos = Tensor::new(p.positions, &dev)?;
                let rows = Tensor::new(p.rows, &dev)?;
                self.forward_tree(&ids, &pos, p.tree, p.cache, &rows)
            })
            .collect()
    }
}
