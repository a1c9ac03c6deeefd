//! How the kernels launch: programmatic dependent launch, and the launch-shape rules (how many
//! blocks, warps and tiles a kernel gets for a shape). A launch shape changes the speed only,
//! except where a rule says it sets a rounding order.

/// Whether the PTX was built for sm_90 or later (`CUDA_COMPUTE_CAP` ≥ 90), where every kernel
/// waits on the device for the one before it, so [`Launch::pdl`] can take effect.
pub const PDL_AVAILABLE: bool = cfg!(specsplit_pdl);

/// How a kernel wrapper launches its kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    /// Programmatic dependent launch: each kernel may be scheduled while the one before it
    /// still runs and waits on the device for its results (common.cuh, `pdl_wait`), which hides
    /// most of the gap between the small kernels of a step. Takes effect only where
    /// [`PDL_AVAILABLE`]; kernels launched either way may follow each other in a stream.
    pub pdl: bool,
    /// Overrides of [`bi_matmul`](super::bi_matmul)'s launch shape (all `None`: the built-in choice).
    pub bi_tuning: BiTuning,
    /// Override of the query heads a block of [`rows_attention`](super::rows_attention) takes
    /// (1, 2, 4 or 8; `None`: the built-in rule, the fewest that keep the launch within 320
    /// blocks). Changes the speed only, never the bits.
    pub rows_heads: Option<usize>,
    /// Override of the rows of the weight a warp of [`gemv`](super::gemv) and
    /// [`gemv_rows`](super::gemv_rows) takes (1 or 2; `None`: the built-in rule,
    /// `gemv_warp_rows`). Changes the speed only, never the bits.
    pub gemv_warp_rows: Option<usize>,
}

impl Launch {
    /// Programmatic dependent launch on, the built-in launch shapes.
    pub const DEFAULT: Launch = Launch {
        pdl: true,
        bi_tuning: BiTuning {
            depth: None,
            splits: None,
            col_tiles: None,
            x_ahead: None,
        },
        rows_heads: None,
        gemv_warp_rows: None,
    };
}

impl Default for Launch {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Overrides of [`bi_matmul`](super::bi_matmul)'s launch shape, for side-by-side tuning; `None` keeps the
/// built-in choice. `depth` (1 or 2: the weight chunks each lane keeps in flight, base or twice)
/// and `col_tiles` (2 or 4 column tiles of 8 a warp) change the speed only; setting either runs
/// the product through the entry that holds every tiling, never a lean one (`bi_lean`), so the
/// built-in choice and a tuning compare the two side by side. `splits` (warps
/// sharing k) changes the rounding: with it set, a row's result is still the same at every pass
/// size, but differs from the built-in choice's. `x_ahead` (how a lean entry loads the input;
/// `bi_x_ahead` is the built-in rule) changes the speed only.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BiTuning {
    /// Weight chunks in flight per lane: 1 (base) or 2 (twice).
    pub depth: Option<u8>,
    /// Warps sharing each output's k (1..=8, at most k / 32).
    pub splits: Option<usize>,
    /// Column tiles of 8 a warp: 2 or 4.
    pub col_tiles: Option<usize>,
    /// In a lean entry (`bi_lean`): the input's fragments of a group of weight chunks loaded
    /// with the group (`true`) or chunk by chunk as the steps take them (`false`).
    pub x_ahead: Option<bool>,
}

/// Blocks a head of [`decode_attention`](super::decode_attention) splits the slots of caches of `capacity` over: one per
/// 64 slots, at most 16.
pub fn decode_attention_splits(capacity: usize) -> usize {
    capacity.div_ceil(64).clamp(1, 16)
}

/// The fewest keys a replayed pass's attention is launched over ([`replay_span`]).
const SPAN_MIN: usize = 256;

/// Keys a pass replayed from a CUDA graph launches its attention over when its rows see up to
/// `needed` keys of a cache of `capacity` slots: the least of 256, 512, 1024, … that holds
/// `needed` where that is at most half the capacity, else the whole capacity. The speed only,
/// never the bits (the chunks past a row's keys return at once): a graph is captured per span,
/// so a short sequence in a large cache does not launch over every slot of it, while a cache
/// that grows by doubling as it fills (a worker's session) keeps one span and so one graph a
/// row count.
pub fn replay_span(capacity: usize, needed: usize) -> usize {
    let mut span = SPAN_MIN;
    while span < needed {
        span *= 2;
    }
    if 2 * span <= capacity {
        span
    } else {
        capacity
    }
}

/// Blocks a rows attention launch may have before it takes more query heads a block.
const RA_BLOCKS: usize = 320;

/// Query heads a block of [`rows_attention`](super::rows_attention) takes (the speed only,
/// never the bits) for `kv` KV heads of `rep` query heads each, `row_blocks` blocks of rows
/// and `chunks` chunks of 64 keys: the fewest (a power of two) that keep the launch within
/// [`RA_BLOCKS`] blocks, so that small passes spread over the GPU and large ones read each
/// key once for as many heads as they can; never more than `rep` needs. Measured
/// (`specsplit-bench kernels --rows-pass --rows-heads 1,2,4,8`, H200, in a graph): at the
/// Qwen2.5 0.5B shape, 10 rows over 256 cached tokens, 14.9 µs with all 7 heads a block, 9.3
/// with 1; at 7B, 5 rows, 18.3 → 11.3 µs over 256 tokens with 1, 19.8 → 17.0 over 1024 with
/// 4; one row over 1024 tokens 18.3 → 9.5 with 2.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) fn ra_heads(
    kv: usize,
    rep: usize,
    row_blocks: usize,
    chunks: usize,
    rows_override: Option<usize>,
) -> usize {
    let most = rep.max(1).next_power_of_two().min(8);
    if let Some(hb) = rows_override {
        return hb.clamp(1, 8).next_power_of_two().min(most);
    }
    let blocks = |hb: usize| kv * rep.div_ceil(hb) * row_blocks * chunks;
    let mut hb = 1;
    while hb < most && blocks(hb) > RA_BLOCKS {
        hb *= 2;
    }
    hb
}

/// Most 16-byte words of a weight's row for which [`gemv_warp_rows`] gives a warp more than
/// one row: one group of four words a lane (inputs of up to 1024).
const GEMV_TWO_ROWS_MAX_WORDS: usize = 4 * 32;

/// The fewest warps a launch of [`gemv`](super::gemv) keeps when its warps take two rows of
/// the weight each.
const GEMV_TWO_ROWS_MIN_WARPS: usize = 2048;

/// Rows of an `(n, k)` weight a warp of [`gemv`](super::gemv) takes for `rows` rows of input
/// (1 or 2; the speed only, never the bits: a row's sums run in the same order however many
/// rows its warp takes): 2 for one or two rows of input where a lane loads all its words of a
/// weight's row at once (`k` up to 1024) and two rows a warp still leave
/// [`GEMV_TWO_ROWS_MIN_WARPS`] warps, so that a warp has two rows' loads in flight and reads
/// each input word once for both; else 1, where a lane keeps two groups of a row in flight.
/// Measured (`specsplit-bench kernels --shape qwen2.5-0.5b --rows 1,2,3,4 --contexts 256
/// --rows-pass --gemv-warp-rows 1,2,4`, H200, 2026-11-29, µs a launch in a graph, 1 / 2 / 4
/// rows a warp, four through a build that had them): the gate|up product (9728 × 896) 6.2 /
/// 5.3 / 5.8 for one row of input, 9.2 / 7.8 / 10.4 for two, 12.0 / 13.6 / 13.6 for three;
/// the head (151936 × 896) 77.9 / 63.1 / 63.4, 131.8 / 94.0 / 121.9, 162.8 / 186.6 / 160.2;
/// the narrower products (896 to 1152 columns) were slowest with more rows a warp.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) fn gemv_warp_rows(n: usize, k: usize, rows: usize, tuning: Option<usize>) -> usize {
    if let Some(t) = tuning {
        return if t >= 2 { 2 } else { 1 };
    }
    if rows <= 2 && k / 8 <= GEMV_TWO_ROWS_MAX_WORDS && n / 2 >= GEMV_TWO_ROWS_MIN_WARPS {
        2
    } else {
        1
    }
}

/// Warps sharing each output's k in `bi_matmul` for a `(n, k)` weight: a function of the
/// shape only, so that no row's rounding depends on the pass. The larger of: the most (a
/// power of two) that still leaves each warp 48 chunks of 32, and the fewest that give
/// about 896 warps at 16 columns a warp; at most 8 and at most `k / 32`. Measured on the
/// H200 at the Qwen2.5 1.5B and 7B shapes, 1 to 33 rows: within 10% of the best split
/// for every projection, 15% less time than the rule before it at 7B.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) fn bi_splits(n: usize, k: usize) -> usize {
    let chunks = k / 32;
    let tiles = n.div_ceil(16);
    let mut by_chunks = 1;
    while by_chunks < 8 && chunks / (by_chunks * 2) >= 48 {
        by_chunks *= 2;
    }
    let mut by_warps = 1;
    while by_warps < 8 && tiles * by_warps < 896 {
        by_warps *= 2;
    }
    by_chunks.max(by_warps).min(8).min(chunks).max(1)
}

/// The fewest columns of a product that [`bi_lean`] sends to the lean entries.
const BI_LEAN_MIN_COLS: usize = 4096;

/// Products of fewer inputs than this go to the lean entries whatever their columns.
const BI_LEAN_MAX_SHORT_K: usize = 1024;

/// Whether `bi_matmul` runs a `(n, k)` weight through the lean entry of its row tiles (each
/// entry compiled for one tiling: 2 column tiles of 8 a warp, the base load depth, about half
/// the registers of the entry that holds every tiling, so about twice the warps an SM) rather
/// than through that entry with [`bi_col_tiles`] and its load depth: for products of at least
/// [`BI_LEAN_MIN_COLS`] columns or fewer than [`BI_LEAN_MAX_SHORT_K`] inputs, unless `tuning`
/// sets the column tiles or the load depth. The speed only, never the bits. Measured
/// (`specsplit-bench kernels --rows-pass`, H200, 2026-11-28, whole passes replayed in a graph):
/// the 7B's Q|K|V, gate|up and head through the lean entries took a pass of 1 to 10 rows
/// 4.5–4.8% less time, 20 rows 0.5%, 40 rows 2%; the 1.5B's gate|up and head within ±0.6% at 1
/// to 10 rows and 2.7% less at 20; the 0.5B's products but down through them, a pass of 1 to
/// 15 rows 1–2% less than its gate|up and head alone (0.8% more at 20). Most other products were slower through a
/// lean entry (per launch: the 7B's output product 9–48%, the 1.5B's and 0.5B's down products
/// 4–42%).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) fn bi_lean(n: usize, k: usize, tuning: BiTuning) -> bool {
    (n >= BI_LEAN_MIN_COLS || k < BI_LEAN_MAX_SHORT_K)
        && tuning.col_tiles.is_none()
        && tuning.depth.is_none()
}

/// Whether a lean entry of `bi_matmul` over `row_tiles` row tiles of 16 loads the input's
/// fragments of a group of weight chunks with the group, before the group's steps (the speed
/// only, never the bits): for two and three row tiles (17 to 48 rows). Measured (`specsplit-bench
/// kernels --rows 5,16,17,20,32,40,64 --contexts 256 --rows-pass --x-ahead 2,1`, H200,
/// 2026-11-29, the Qwen2.5 0.5B, 1.5B and 7B shapes): the 7B gate|up 0.100 → 0.075 ms at 20
/// rows, 0.162 → 0.119 at 40, the head 0.377 → 0.300 at 20; slower at 64 rows (the 7B gate|up
/// 0.160 → 0.163, the head 0.500 → 0.606), and mixed at 16 rows or fewer (the 7B gate|up 0.071 →
/// 0.076, its head 0.285 → 0.267).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) fn bi_x_ahead(row_tiles: usize) -> bool {
    (2..=3).contains(&row_tiles)
}

/// Column tiles of 8 a warp in `bi_matmul` for `m` rows of a `(n, _)` weight split `splits`
/// ways (the speed only, never the bits): 4 where that still leaves about 560 warps, else 2;
/// but 2 for passes of more than one row tile over a weight split two ways (the 7B gate|up and
/// head: 10% and 2% faster at 32 rows on the H100, `specsplit-bench kernels`; the 1.5B gate|up,
/// split one way, is 8% slower with 2).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(super) fn bi_col_tiles(m: usize, n: usize, splits: usize) -> usize {
    if (m > 16 && splits == 2) || n.div_ceil(32) * splits < 560 {
        2
    } else {
        4
    }
}

/// Rows of a pass one block of [`rows_attention`](super::rows_attention) takes together, sharing one staged copy of
/// the prefix keys (each row keeps the arithmetic it gets alone, so any value gives the same
/// bits; at most 8, below 2 a block a row).
pub const RA_STAGE: usize = 4;

/// The longest span of keys a draft's pass attends with [`draft_attention`](super::draft_attention);
/// past it, with [`rows_attention`](super::rows_attention). Each block of the draft attention
/// reads its KV head's keys for one query head, so its reads grow with the span times the query
/// heads a KV head serves. Measured (`specsplit-bench forward --model random:qwen2.5-0.5b
/// --contexts 256,1024 --growth-rows 10,20`, H200, 2026-11-28): a pre-draft growth level of 10
/// chains took 0.985 ms against the rows attention's 1.044 over 256 cached tokens, 1.423 against
/// 1.169 over 1024.
pub const DRAFT_ATTENTION_MAX_SPAN: usize = 512;

/// Warps a block of [`draft_attention`](super::draft_attention) takes for rows of at most
/// `span` keys: one for every two of the span's tiles of 32 keys, at least 1 and at most 16. A
/// warp then walks about two tiles; this sets the speed, and a row's bits for that span.
pub fn draft_attention_warps(span: usize) -> usize {
    span.div_ceil(32).div_ceil(2).clamp(1, 16)
}
#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gemv_warp_takes_two_rows_only_of_short_inputs_many_rows_and_up_to_two_inputs() {
        // The Qwen2.5 0.5B draft's products: Q|K|V, output, gate|up, down, head.
        for rows in [1, 2] {
            assert_eq!(gemv_warp_rows(1152, 896, rows, None), 1);
            assert_eq!(gemv_warp_rows(896, 896, rows, None), 1);
            assert_eq!(gemv_warp_rows(9728, 896, rows, None), 2);
            assert_eq!(gemv_warp_rows(896, 4864, rows, None), 1);
            assert_eq!(gemv_warp_rows(151_936, 896, rows, None), 2);
        }
        // Three or four rows of input, fewer than 4096 columns, inputs past 1024: one row.
        assert_eq!(gemv_warp_rows(151_936, 896, 3, None), 1);
        assert_eq!(gemv_warp_rows(9728, 896, 4, None), 1);
        assert_eq!(gemv_warp_rows(4095, 1024, 1, None), 1);
        assert_eq!(gemv_warp_rows(4096, 1024, 1, None), 2);
        assert_eq!(gemv_warp_rows(151_936, 1032, 1, None), 1);
        // An override wins: 2 for 2 or more, else 1.
        assert_eq!(gemv_warp_rows(896, 4864, 4, Some(2)), 2);
        assert_eq!(gemv_warp_rows(896, 4864, 4, Some(4)), 2);
        assert_eq!(gemv_warp_rows(151_936, 896, 1, Some(1)), 1);
        assert_eq!(gemv_warp_rows(151_936, 896, 1, Some(0)), 1);
    }

    #[test]
    fn a_draft_attention_block_takes_a_warp_for_every_two_tiles_of_its_span() {
        assert_eq!(draft_attention_warps(1), 1);
        assert_eq!(draft_attention_warps(64), 1);
        assert_eq!(draft_attention_warps(65), 2);
        assert_eq!(draft_attention_warps(512), 8);
        assert_eq!(draft_attention_warps(1024), 16);
        assert_eq!(draft_attention_warps(32768), 16);
    }

    #[test]
    fn a_replayed_pass_spans_the_least_power_of_two_from_256_holding_its_keys_in_a_large_cache() {
        assert_eq!(replay_span(4096, 1), 256);
        assert_eq!(replay_span(4096, 256), 256);
        assert_eq!(replay_span(4096, 257), 512);
        assert_eq!(replay_span(4096, 2048), 2048);
        assert_eq!(replay_span(1024, 250), 256);
        assert_eq!(replay_span(1024, 300), 512);
        // Past half the capacity, the whole cache: a cache that doubles as it fills keeps it.
        assert_eq!(replay_span(4096, 2049), 4096);
        assert_eq!(replay_span(4004, 1500), 4004);
        assert_eq!(replay_span(560, 300), 560);
        assert_eq!(replay_span(300, 100), 300);
        // Never past the capacity, whatever is asked.
        assert_eq!(replay_span(200, 500), 200);
    }

    #[test]
    fn bi_splits_keep_long_warps_and_enough_of_them() {
        // The shapes it was measured on: (n, k) of Q|K|V, O, gate|up, down, head.
        let seven_b = [
            (4608, 3584),
            (3584, 3584),
            (37888, 3584),
            (3584, 18944),
            (152064, 3584),
        ];
        let got: Vec<usize> = seven_b.iter().map(|&(n, k)| bi_splits(n, k)).collect();
        assert_eq!(got, [4, 4, 2, 8, 2]);
        let one_5b = [
            (2048, 1536),
            (1536, 1536),
            (17920, 1536),
            (1536, 8960),
            (151936, 1536),
        ];
        let got: Vec<usize> = one_5b.iter().map(|&(n, k)| bi_splits(n, k)).collect();
        assert_eq!(got, [8, 8, 1, 8, 1]);
        // Heads a block of the rows attention: the fewest within RA_BLOCKS blocks (7B: 4 KV
        // heads of 7), an override, never more than a KV head's query heads need.
        assert_eq!(ra_heads(4, 7, 1, 5, None), 1);
        assert_eq!(ra_heads(4, 7, 1, 17, None), 2);
        assert_eq!(ra_heads(4, 7, 2, 17, None), 4);
        assert_eq!(ra_heads(4, 7, 16, 5, None), 8);
        assert_eq!(ra_heads(4, 7, 64, 64, None), 8);
        assert_eq!(ra_heads(4, 7, 1, 64, Some(2)), 2);
        assert_eq!(ra_heads(4, 7, 1, 5, Some(3)), 4);
        assert_eq!(ra_heads(2, 1, 64, 64, None), 1);
        assert_eq!(ra_heads(2, 2, 1, 1, Some(8)), 2);
        // Column tiles as measured (H100, `kernels --rows 1,8,32 --col-tiles 2,4`): the 7B
        // gate|up and head take 2 past one row tile, everything else keeps its one-row choice.
        let tiles = |shapes: &[(usize, usize)], m: usize| -> Vec<usize> {
            shapes
                .iter()
                .map(|&(n, k)| bi_col_tiles(m, n, bi_splits(n, k)))
                .collect()
        };
        assert_eq!(tiles(&seven_b, 1), [4, 2, 4, 4, 4]);
        assert_eq!(tiles(&seven_b, 16), [4, 2, 4, 4, 4]);
        assert_eq!(tiles(&seven_b, 32), [4, 2, 2, 4, 2]);
        assert_eq!(tiles(&one_5b, 1), [2, 2, 4, 2, 4]);
        assert_eq!(tiles(&one_5b, 32), [2, 2, 4, 2, 4]);
        // The lean entries: the 7B's Q|K|V, gate|up and head, the 1.5B's gate|up and head, every
        // 0.5B product but down; a tuning of the tiles or the load depth takes the entry
        // that holds every tiling.
        let lean = |shapes: &[(usize, usize)]| -> Vec<bool> {
            shapes
                .iter()
                .map(|&(n, k)| bi_lean(n, k, BiTuning::default()))
                .collect()
        };
        assert_eq!(lean(&seven_b), [true, false, true, false, true]);
        assert_eq!(lean(&one_5b), [false, false, true, false, true]);
        let half_b = [
            (1152, 896),
            (896, 896),
            (9728, 896),
            (896, 4864),
            (151936, 896),
        ];
        assert_eq!(lean(&half_b), [true, true, true, false, true]);
        let tiled = BiTuning {
            col_tiles: Some(2),
            ..BiTuning::default()
        };
        let deep = BiTuning {
            depth: Some(1),
            ..BiTuning::default()
        };
        let split = BiTuning {
            splits: Some(4),
            ..BiTuning::default()
        };
        assert!(
            !bi_lean(37888, 3584, tiled)
                && !bi_lean(37888, 3584, deep)
                && bi_lean(37888, 3584, split)
        );
        for n in [1usize, 7, 16, 100, 1000, 5000, 50_000] {
            for k in [32usize, 64, 96, 512, 4096, 20_000] {
                let s = bi_splits(n, k);
                assert!((1..=8).contains(&s) && s <= k / 32, "{n}x{k}: {s}");
                assert!(s.is_power_of_two() || s == k / 32, "{n}x{k}: {s}");
            }
        }
    }
}
