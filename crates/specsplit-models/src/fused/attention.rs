//! Attention over the K/V cache: the one-token step's split attention ([`decode_attention`])
//! and the batch-invariant attention of a pass's rows ([`rows_attention`]) over the slots
//! [`PassKeys`] gives each row.

use super::{applies, imp, unfit, Launch};
use candle_core::{Result, Tensor};

/// Shapes of one attention layer: query heads, KV heads, head size and cache capacity.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (dividing `heads`).
    pub kv: usize,
    /// Values per head: 64 or 128 for [`decode_attention`].
    pub head_dim: usize,
    /// Slots of the K/V cache buffers.
    pub capacity: usize,
}

/// Attention of the queries `(r, heads * head_dim)` of `r` consecutive tokens
/// (`1 <= r <= GEMV_MAX_ROWS`), row `i` over cache slots `0..=pos + i` of the caches
/// `(1, kv, capacity, head_dim)`, scaled by `scale`: `(r, heads * head_dim)` bf16. `head_dim`
/// must be 64 or 128. The slots are split over [`decode_attention_splits`](super::decode_attention_splits) blocks a head and
/// row, merged by a second kernel; a row's result does not depend on the other rows.
pub fn decode_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    pos: &Tensor,
    shape: AttnShape,
    scale: f32,
    launch: Launch,
) -> Result<Tensor> {
    if !applies(q) || !matches!(shape.head_dim, 64 | 128) {
        return Err(unfit("decode_attention", &[q]));
    }
    imp::decode_attention(q, k_cache, v_cache, pos, shape, scale, launch)
}

/// The most query heads one KV head may serve in [`rows_attention`].
pub const RA_MAX_REP: usize = 8;

/// The cache slots each row of one pass attends to, on the device for [`rows_attention`]:
/// a leading run `0..lead` and then listed slots (a tree node's ancestors), in order.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct PassKeys {
    /// `(rows, 2)` u32: the leading run's length and the number of listed slots, per row.
    pub(super) meta: Tensor,
    /// `(rows, max_extra)` u32: the listed slots of each row (at least one column).
    pub(super) extra: Tensor,
    pub(super) max_extra: usize,
    pub(super) rows: usize,
    /// One past the highest slot any row reads.
    pub(super) end: usize,
    /// The most keys any row sees.
    pub(super) max_len: usize,
}

impl PassKeys {
    /// Uploads `rows` (per row: the leading run's length and the slots after it, ascending and
    /// all at or past the run) to `dev`. Every row must see at least one slot.
    pub fn new(rows: &[(usize, &[u32])], dev: &candle_core::Device) -> Result<Self> {
        let max_extra = rows.iter().map(|(_, e)| e.len()).max().unwrap_or(0).max(1);
        let mut meta = Vec::with_capacity(rows.len() * 2);
        let mut extra = vec![0u32; rows.len() * max_extra];
        let mut end = 0usize;
        let mut max_len = 0usize;
        for (r, (lead, ex)) in rows.iter().enumerate() {
            max_len = max_len.max(lead + ex.len());
            if *lead == 0 && ex.is_empty() {
                return Err(candle_core::Error::Msg(format!("row {r} sees no key")));
            }
            let mut prev = lead.checked_sub(1).map(|p| p as u64);
            for &e in ex.iter() {
                if prev.is_some_and(|p| u64::from(e) <= p) {
                    return Err(candle_core::Error::Msg(format!(
                        "row {r}: listed slot {e} is not after the slots before it"
                    )));
                }
                prev = Some(u64::from(e));
            }
            end = end.max(prev.map_or(0, |p| p as usize + 1));
            meta.extend([*lead as u32, ex.len() as u32]);
            extra[r * max_extra..r * max_extra + ex.len()].copy_from_slice(ex);
        }
        Ok(Self {
            meta: Tensor::from_vec(meta, (rows.len(), 2), dev)?,
            extra: Tensor::from_vec(extra, (rows.len(), max_extra), dev)?,
            max_extra,
            rows: rows.len(),
            end,
            max_len,
        })
    }

    /// Rows of the pass.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// `n` rows whose key counts are read from the device at each use: `meta` is an `(n, 2)`
    /// u32 buffer holding `[lead_r, 0]` per row (row `r` sees slots `0..lead_r`, at most
    /// `span` of a cache of `capacity` slots), written by the caller before each launch (a
    /// captured CUDA graph reads whatever it holds at replay); a chain after `past` cached
    /// tokens has `lead_r = past + r + 1`. The attention is launched over `span` keys and the
    /// chunks past a row's lead return at once, so each row gets the same bits as with
    /// [`PassKeys::new`].
    pub fn device_rows(meta: Tensor, capacity: usize, span: usize) -> Result<Self> {
        let rows = meta.dims().first().copied().unwrap_or(0);
        let extra = Tensor::zeros((rows.max(1), 1), candle_core::DType::U32, meta.device())?;
        Self::device_listed(meta, extra, capacity, span)
    }

    /// The most keys a row sees: the keys the attention is launched over.
    pub fn span(&self) -> usize {
        self.max_len
    }

    /// These device-read keys ([`PassKeys::device_rows`], [`PassKeys::device_listed`]) with
    /// the attention launched over `span` keys instead, within the same cache: the same
    /// buffers, so one write serves both. No row may see more than `span` keys.
    pub fn with_span(&self, span: usize) -> Result<Self> {
        if span == 0 || span > self.end {
            return Err(candle_core::Error::Msg(format!(
                "keys within {} slots cannot span {span}",
                self.end
            )));
        }
        Ok(Self {
            max_len: span,
            ..self.clone()
        })
    }

    /// [`PassKeys::device_rows`] with listed slots: `meta` `(n, 2)` u32 holds `[lead_r,
    /// listed_r]` per row and `extra` `(n, max_extra)` u32 row `r`'s `listed_r` slots after its
    /// lead (ascending, at or past it, below `capacity`), both written by the caller before
    /// each launch: the rows of a tree or a forest whose nodes sit at slots apart from the
    /// sequence. No row may see more than `span` keys (its lead and its listed slots), the keys
    /// the attention is launched over. A row's bits are those [`PassKeys::new`] gives it.
    pub fn device_listed(
        meta: Tensor,
        extra: Tensor,
        capacity: usize,
        span: usize,
    ) -> Result<Self> {
        let rows = meta.dims().first().copied().unwrap_or(0);
        let max_extra = extra.dims().get(1).copied().unwrap_or(0);
        if meta.dims() != [rows, 2]
            || rows == 0
            || meta.dtype() != candle_core::DType::U32
            || extra.dims() != [rows, max_extra]
            || max_extra == 0
            || extra.dtype() != candle_core::DType::U32
            || capacity == 0
            || span == 0
            || span > capacity
        {
            return Err(candle_core::Error::Msg(format!(
                "device rows need (n, 2) and (n, listed) u32 buffers, a capacity and a span of \
                 keys within it, got {:?} {:?}, {:?} {:?}, {capacity} and {span}",
                meta.dims(),
                meta.dtype(),
                extra.dims(),
                extra.dtype()
            )));
        }
        Ok(Self {
            meta,
            extra,
            max_extra,
            rows,
            end: capacity,
            max_len: span,
        })
    }
}

/// Batch-invariant attention of the `n` rows of one pass: `q` `(1, heads, n, head_dim)`
/// (rotated, contiguous) over the caches `(1, kv, capacity, head_dim)`, row `r` over the slots
/// `keys` gives it, scaled by `scale`: `(n, heads * head_dim)` bf16. A row's result depends
/// only on its query and its visible keys, in order, so a token decoded alone and the same
/// token inside a tree get the same bits. `head_dim` must be 64 or 128, and a KV head may serve
/// at most [`RA_MAX_REP`] query heads.
pub fn rows_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    keys: &PassKeys,
    shape: AttnShape,
    scale: f32,
    launch: Launch,
) -> Result<Tensor> {
    if !applies(q) || !matches!(shape.head_dim, 64 | 128) {
        return Err(unfit("rows_attention", &[q]));
    }
    imp::rows_attention(q, k_cache, v_cache, keys, shape, scale, launch)
}

/// Attention of the `n` rows of a draft's pass in one kernel: the arguments and result of
/// [`rows_attention`], but each query head of each row computed by one block that walks all
/// the row's keys, where the rows attention cuts them into chunks and merges them in a second
/// kernel. A row's bits depend only on its query, its keys and the launch's span (never on the
/// other rows), but they are not the exact step's: for passes that only propose tokens (a
/// pre-draft's growth), over spans of at most
/// [`DRAFT_ATTENTION_MAX_SPAN`](super::DRAFT_ATTENTION_MAX_SPAN) keys, where it is the faster.
pub fn draft_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    keys: &PassKeys,
    shape: AttnShape,
    scale: f32,
    launch: Launch,
) -> Result<Tensor> {
    if !applies(q) || !matches!(shape.head_dim, 64 | 128) {
        return Err(unfit("draft_attention", &[q]));
    }
    imp::draft_attention(q, k_cache, v_cache, keys, shape, scale, launch)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn pass_keys_refuse_rows_that_see_nothing_or_slots_out_of_order() {
        let dev = Device::Cpu;
        let ok =
            PassKeys::new(&[(3, &[][..]), (2, &[5u32, 9][..]), (0, &[4u32][..])], &dev).unwrap();
        assert_eq!(ok.rows(), 3);
        assert_eq!((ok.end, ok.max_len, ok.max_extra), (10, 4, 2));
        assert_eq!(ok.extra.to_vec2::<u32>().unwrap(), [[0, 0], [5, 9], [4, 0]]);
        assert_eq!(ok.meta.to_vec2::<u32>().unwrap(), [[3, 0], [2, 2], [0, 1]]);
        let e = PassKeys::new(&[(0, &[][..])], &dev)
            .unwrap_err()
            .to_string();
        assert!(e.contains("sees no key"), "{e}");
        // A listed slot inside the leading run, or a repeated slot.
        assert!(PassKeys::new(&[(5, &[4u32][..])], &dev).is_err());
        assert!(PassKeys::new(&[(0, &[7u32, 7][..])], &dev).is_err());
    }
}
