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
//! output. Every kernel wrapper takes a [`Launch`]: how its kernels are launched.

use candle_core::{DType, Result, Tensor};

/// Which fused-kernel paths a model runs (held by
/// [`crate::transformer::Transformer`]; tests and benchmarks turn parts off to compare). All on
/// by default with the `cuda` feature, all off without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KernelOptions {
    /// The fused greedy (draft) step and the fused layer stack of the batch-invariant and wide
    /// passes; off: candle's ops.
    pub fused: bool,
    /// Programmatic dependent launch (see [`Launch::pdl`]).
    pub pdl: bool,
    /// Dense bf16 passes of at most [`BI_MAX_ROWS`] rows on CUDA run the batch-invariant
    /// kernels, so that a token decoded alone and the same token verified among tree nodes get
    /// bit-identical logits (greedy speculation then emits exactly what the target alone
    /// emits); off: cuBLAS and candle's attention.
    pub batch_invariant: bool,
    /// Dense bf16 passes of more than [`BI_MAX_ROWS`] and at most [`WIDE_MAX_ROWS`] rows on
    /// CUDA run as one wide fused pass. Such passes are prompt prefills, which a target runs
    /// the same way whether it decodes alone or verifies drafts, so this changes no output's
    /// exactness.
    pub wide_rows: bool,
}

impl Default for KernelOptions {
    fn default() -> Self {
        let on = cfg!(feature = "cuda");
        Self {
            fused: on,
            pdl: on,
            batch_invariant: on,
            wide_rows: on,
        }
    }
}

impl KernelOptions {
    /// These options with everything the `cuda` feature lacks turned off.
    pub fn available(self) -> Self {
        let on = cfg!(feature = "cuda");
        Self {
            fused: self.fused && on,
            pdl: self.pdl && on,
            batch_invariant: self.batch_invariant && on,
            wide_rows: self.wide_rows && on,
        }
    }

    /// How the model launches its kernels: [`KernelOptions::pdl`] and the built-in
    /// [`bi_matmul`] launch shapes.
    pub fn launch(&self) -> Launch {
        Launch {
            pdl: self.pdl,
            bi_tuning: BiTuning::default(),
        }
    }
}

/// Whether the PTX was built for sm_90 or later (`CUDA_COMPUTE_CAP` ≥ 90), where every kernel
/// waits on the device for the one before it, so [`Launch::pdl`] can take effect.
pub const PDL_AVAILABLE: bool = cfg!(specsplit_pdl);

/// How a kernel wrapper launches its kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Launch {
    /// Programmatic dependent launch: each kernel may be scheduled while the one before it
    /// still runs and waits on the device for its results (kernels.cu, `pdl_wait`), which hides
    /// most of the gap between the small kernels of a step. Takes effect only where
    /// [`PDL_AVAILABLE`]; kernels launched either way may follow each other in a stream.
    pub pdl: bool,
    /// Overrides of [`bi_matmul`]'s launch shape (all `None`: the built-in choice).
    pub bi_tuning: BiTuning,
}

impl Launch {
    /// Programmatic dependent launch on, the built-in launch shapes.
    pub const DEFAULT: Launch = Launch {
        pdl: true,
        bi_tuning: BiTuning {
            depth: None,
            splits: None,
            col_tiles: None,
        },
    };
}

impl Default for Launch {
    fn default() -> Self {
        Self::DEFAULT
    }
}

/// Device memory the fused kernels' outputs are carved from while a step is captured into a
/// CUDA graph ([`carving`]), so that the graph holds no allocation or free nodes between its
/// kernels (kernels next to each other can then overlap under [`pdl`]). Sized by a
/// [`counting`] run of the same step; the graph keeps using it, so it lives as long as the
/// graph.
#[cfg(feature = "cuda")]
#[derive(Debug)]
pub struct Scratch {
    bf16: Tensor,
    f32: Tensor,
}

/// What a [`counting`] run's fused kernels allocated, in elements of each dtype (each output
/// rounded up to 16 bytes).
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScratchNeed {
    /// bf16 elements.
    pub bf16: usize,
    /// f32 elements.
    pub f32: usize,
}

#[cfg(feature = "cuda")]
impl ScratchNeed {
    /// Bytes a [`Scratch`] for this need holds.
    pub fn bytes(&self) -> usize {
        self.bf16.max(8) * 2 + self.f32.max(4) * 4
    }
}

#[cfg(feature = "cuda")]
enum ScratchMode {
    Count(ScratchNeed),
    Carve {
        bf16: (Tensor, usize),
        f32: (Tensor, usize),
    },
}

#[cfg(feature = "cuda")]
thread_local! {
    static SCRATCH: std::cell::RefCell<Option<ScratchMode>> = const { std::cell::RefCell::new(None) };
}

/// Clears this thread's scratch mode when dropped (also on unwinding).
#[cfg(feature = "cuda")]
struct ScratchGuard;

#[cfg(feature = "cuda")]
impl Drop for ScratchGuard {
    fn drop(&mut self) {
        SCRATCH.with(|m| m.borrow_mut().take());
    }
}

#[cfg(feature = "cuda")]
impl Scratch {
    /// Scratch for `need` on `device` (zero-filled once).
    pub fn new(need: ScratchNeed, device: &candle_core::Device) -> Result<Self> {
        Ok(Self {
            bf16: Tensor::zeros(need.bf16.max(8), DType::BF16, device)?,
            f32: Tensor::zeros(need.f32.max(4), DType::F32, device)?,
        })
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.bf16.elem_count() * 2 + self.f32.elem_count() * 4
    }
}

/// Runs `f` (on this thread) and returns, with its result, what its fused kernels' outputs
/// took: the [`Scratch`] a [`carving`] run of the same step needs.
#[cfg(feature = "cuda")]
pub fn counting<R>(f: impl FnOnce() -> R) -> (R, ScratchNeed) {
    SCRATCH.with(|m| *m.borrow_mut() = Some(ScratchMode::Count(ScratchNeed::default())));
    let guard = ScratchGuard;
    let r = f();
    let need = SCRATCH.with(|m| match m.borrow().as_ref() {
        Some(ScratchMode::Count(n)) => *n,
        _ => ScratchNeed::default(),
    });
    drop(guard);
    (r, need)
}

/// Runs `f` (on this thread) with its fused kernels' outputs carved from `scratch` in order
/// (outputs past its end are allocated as usual).
#[cfg(feature = "cuda")]
pub fn carving<R>(scratch: &Scratch, f: impl FnOnce() -> R) -> R {
    SCRATCH.with(|m| {
        *m.borrow_mut() = Some(ScratchMode::Carve {
            bf16: (scratch.bf16.clone(), 0),
            f32: (scratch.f32.clone(), 0),
        })
    });
    let _guard = ScratchGuard;
    f()
}

/// An output of `shape` and `dtype` from this thread's scratch mode: counted (and `None`),
/// carved, or `None` where no mode is on or the scratch is used up.
#[cfg(feature = "cuda")]
fn scratch_output(shape: &[usize], dtype: DType) -> Result<Option<Tensor>> {
    let n: usize = shape.iter().product();
    SCRATCH.with(|m| {
        let mut m = m.borrow_mut();
        match (m.as_mut(), dtype) {
            (Some(ScratchMode::Count(need)), DType::BF16) => need.bf16 += n.next_multiple_of(8),
            (Some(ScratchMode::Count(need)), DType::F32) => need.f32 += n.next_multiple_of(4),
            (Some(ScratchMode::Carve { bf16: (t, at), .. }), DType::BF16)
            | (Some(ScratchMode::Carve { f32: (t, at), .. }), DType::F32) => {
                let step = if dtype == DType::BF16 { 8 } else { 4 };
                if *at + n <= t.elem_count() {
                    let out = t.narrow(0, *at, n)?.reshape(shape)?;
                    *at += n.next_multiple_of(step);
                    return Ok(Some(out));
                }
            }
            _ => {}
        }
        Ok(None)
    })
}

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

/// Whether `gemv(x, w, _)` can run: `w` [`weight_fits`] and `x` a contiguous, 16-byte aligned
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

/// Whether `gemv_rows(x, w, _)` can run: `w` [`weight_fits`] and `x` a contiguous, 16-byte
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

/// [`qkv_rope_cache`] for the `n` rows of one pass: the fused Q|K|V rows `(n, (heads + 2 kv) *
/// head_dim)`, rotary at the positions `(n,)` u32 (each below the tables' length), K and V
/// written into the caches at slots `past..past + n`, or with `past` `None` at the slots the
/// positions name (read on the device, so a captured graph serves any cache length; the
/// caller keeps them below the capacity); returns the rotated Q as `(1, heads, n, head_dim)`,
/// the layout [`rows_attention`] reads.
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_rows(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    positions: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    past: Option<usize>,
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
        past,
        shape,
        interleaved,
        launch,
    )
}

/// Attention of the queries `(r, heads * head_dim)` of `r` consecutive tokens
/// (`1 <= r <= GEMV_MAX_ROWS`), row `i` over cache slots `0..=pos + i` of the caches
/// `(1, kv, capacity, head_dim)`, scaled by `scale`: `(r, heads * head_dim)` bf16. `head_dim`
/// must be 64 or 128. The slots are split over [`decode_attention_splits`] blocks a head and
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

/// Blocks a head of [`decode_attention`] splits the slots of caches of `capacity` over: one per
/// 64 slots, at most 16.
pub fn decode_attention_splits(capacity: usize) -> usize {
    capacity.div_ceil(64).clamp(1, 16)
}

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

/// The most rows a pass may have for the model to run it with the batch-invariant kernels
/// ([`bi_matmul`], [`rows_attention`]); longer passes (prompt prefills) keep cuBLAS.
pub const BI_MAX_ROWS: usize = 64;

/// The most rows a pass may have for the model to run it as one *wide* fused pass: passes of
/// more than [`BI_MAX_ROWS`] rows (prompt prefills) run the fused layer stack with cuBLAS
/// products ([`cublas_product`]) and [`rows_attention`], about eleven launches a layer instead
/// of the twenty-odd of candle's batched ops. Longer passes keep the batched ops, whose
/// attention scores take less memory than [`rows_attention`]'s partial sums.
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

/// Overrides of [`bi_matmul`]'s launch shape, for side-by-side tuning; `None` keeps the
/// built-in choice. `depth` (1 or 2: the weight chunks each lane keeps in flight, base or twice)
/// and `col_tiles` (2 or 4 column tiles of 8 a warp) change the speed only. `splits` (warps
/// sharing k) changes the rounding: with it set, a row's result is still the same at every pass
/// size, but differs from the built-in choice's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BiTuning {
    /// Weight chunks in flight per lane: 1 (base) or 2 (twice).
    pub depth: Option<u8>,
    /// Warps sharing each output's k (1..=8, at most k / 32).
    pub splits: Option<usize>,
    /// Column tiles of 8 a warp: 2 or 4.
    pub col_tiles: Option<usize>,
}

/// Warps sharing each output's k in `bi_matmul` for a `(n, k)` weight: a function of the
/// shape only, so that no row's rounding depends on the pass. The larger of: the most (a
/// power of two) that still leaves each warp 48 chunks of 32, and the fewest that give
/// about 896 warps at 16 columns a warp; at most 8 and at most `k / 32`. Measured on the
/// H200 at the Qwen2.5 1.5B and 7B shapes, 1 to 33 rows: within 10% of the best split
/// for every projection, 15% less time than the rule before it at 7B.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn bi_splits(n: usize, k: usize) -> usize {
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

/// Column tiles of 8 a warp in `bi_matmul` for `m` rows of a `(n, _)` weight split `splits`
/// ways (the speed only, never the bits): 4 where that still leaves about 560 warps, else 2;
/// but 2 for passes of more than one row tile over a weight split two ways (the 7B gate|up and
/// head: 10% and 2% faster at 32 rows on the H100, `specsplit-bench kernels`; the 1.5B gate|up,
/// split one way, is 8% slower with 2).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn bi_col_tiles(m: usize, n: usize, splits: usize) -> usize {
    if (m > 16 && splits == 2) || n.div_ceil(32) * splits < 560 {
        2
    } else {
        4
    }
}

/// Whether `bi_matmul(x, w, _)` can run: `w` [`weight_fits`] with a width that is a multiple
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

/// The most query heads one KV head may serve in [`rows_attention`].
pub const RA_MAX_REP: usize = 8;

/// The cache slots each row of one pass attends to, on the device for [`rows_attention`]:
/// a leading run `0..lead` and then listed slots (a tree node's ancestors), in order.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub struct PassKeys {
    /// `(rows, 2)` u32: the leading run's length and the number of listed slots, per row.
    meta: Tensor,
    /// `(rows, max_extra)` u32: the listed slots of each row (at least one column).
    extra: Tensor,
    max_extra: usize,
    rows: usize,
    /// One past the highest slot any row reads.
    end: usize,
    /// The most keys any row sees.
    max_len: usize,
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
    /// `capacity`), written by the caller before each launch (a captured CUDA graph reads
    /// whatever it holds at replay); a chain after `past` cached tokens has `lead_r = past + r
    /// + 1`. The attention is launched over the whole capacity and the chunks past a row's
    /// lead return at once, so each row gets the same bits as with [`PassKeys::new`].
    pub fn device_rows(meta: Tensor, capacity: usize) -> Result<Self> {
        let rows = meta.dims().first().copied().unwrap_or(0);
        if meta.dims() != [rows, 2]
            || rows == 0
            || meta.dtype() != candle_core::DType::U32
            || capacity == 0
        {
            return Err(candle_core::Error::Msg(format!(
                "device rows need an (n, 2) u32 meta buffer and a capacity, got {:?} {:?} and {capacity}",
                meta.dims(),
                meta.dtype()
            )));
        }
        let extra = Tensor::zeros((rows, 1), candle_core::DType::U32, meta.device())?;
        Ok(Self {
            meta,
            extra,
            max_extra: 1,
            rows,
            end: capacity,
            max_len: capacity,
        })
    }
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

/// Rows of a pass one block of [`rows_attention`] takes together, sharing one staged copy of
/// the prefix keys (each row keeps the arithmetic it gets alone, so any value gives the same
/// bits; at most 8, below 2 a block a row).
pub const RA_STAGE: usize = 4;

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

#[cfg(feature = "cuda")]
mod imp {
    use super::AttnShape;
    use candle_core::cuda_backend::cudarc::driver::sys::CUfunction_attribute;
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    use candle_core::cuda_backend::CudaDevice;
    use candle_core::{DType, Device, Error, Result, Storage, Tensor};
    use Arg::{F, I, P};

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/specsplit_kernels.ptx"));
    const MODULE: &str = "specsplit_fused";

    fn cuda(t: &Tensor) -> Result<&CudaDevice> {
        match t.device() {
            Device::Cuda(d) => Ok(d),
            d => Err(Error::Msg(format!("fused kernel on {:?}", d.location()))),
        }
    }

    /// Device address of `t`'s first element; `t` must be contiguous and on CUDA.
    fn ptr(t: &Tensor) -> Result<u64> {
        if !t.is_contiguous() {
            return Err(Error::Msg(format!(
                "fused kernel operand {:?} is not contiguous",
                t.dims()
            )));
        }
        let (storage, layout) = t.storage_and_layout();
        let Storage::Cuda(s) = &*storage else {
            return Err(Error::Msg("fused kernel operand is not on CUDA".into()));
        };
        let stream = s.device.cuda_stream();
        let base = match t.dtype() {
            DType::BF16 => s.as_cuda_slice::<half::bf16>()?.device_ptr(&stream).0,
            DType::U32 => s.as_cuda_slice::<u32>()?.device_ptr(&stream).0,
            DType::F32 => s.as_cuda_slice::<f32>()?.device_ptr(&stream).0,
            d => return Err(Error::Msg(format!("fused kernel operand of dtype {d:?}"))),
        };
        Ok(base + (layout.start_offset() * t.dtype().size_in_bytes()) as u64)
    }

    fn pointers(ts: &[&Tensor]) -> Result<Vec<Arg>> {
        ts.iter().map(|t| ptr(t).map(P)).collect()
    }

    pub(super) fn aligned16(t: &Tensor) -> bool {
        ptr(t).is_ok_and(|p| p % 16 == 0)
    }

    pub(super) fn write_u32(dst: &Tensor, values: &[u32]) -> Result<()> {
        let p = ptr(dst)?;
        let stream = cuda(dst)?.cuda_stream();
        // SAFETY: `p` addresses `values.len()` u32 of `dst`'s live, contiguous storage. A copy
        // from pageable host memory returns once `values` is staged, so it may be dropped then.
        unsafe {
            candle_core::cuda_backend::cudarc::driver::result::memcpy_htod_async(
                p,
                values,
                stream.cu_stream(),
            )
        }
        .map_err(|e| Error::Msg(format!("host-to-device copy: {e:?}")))
    }

    /// One kernel argument: a device address, an int or a float.
    enum Arg {
        P(u64),
        I(i32),
        F(f32),
    }

    /// Launches `name` on `dev`'s stream with `grid` × `block` threads and `args` in order.
    fn launch(
        pdl: bool,
        dev: &CudaDevice,
        name: &str,
        grid: u32,
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        launch_2d(pdl, dev, name, (grid, 1), block, 0, args)
    }

    /// [`launch`] over a `(x, y)` grid with `smem` bytes of dynamic shared memory a block.
    fn launch_2d(
        pdl: bool,
        dev: &CudaDevice,
        name: &str,
        grid: (u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        launch_cfg(pdl, dev, name, (grid.0, grid.1, 1), block, smem, args)
    }

    /// [`launch`] over a `(x, y, z)` grid.
    fn launch_3d(
        pdl: bool,
        dev: &CudaDevice,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &[Arg],
    ) -> Result<()> {
        launch_cfg(pdl, dev, name, grid, block, 0, args)
    }

    /// Lets `name` take `smem` bytes of dynamic shared memory a block (past the default 48 KiB).
    fn allow_smem(dev: &CudaDevice, name: &str, smem: u32) -> Result<()> {
        if smem <= 48 * 1024 {
            return Ok(());
        }
        let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            smem as i32,
        )
        .map_err(|e| Error::Msg(format!("{name}: {smem} bytes of shared memory: {e:?}")))
    }

    /// Most arguments a kernel of kernels.cu takes.
    const MAX_ARGS: usize = 20;

    /// Launches `name` on `dev`'s stream over a `(x, y, z)` grid of `block`-thread blocks with
    /// `smem` bytes of dynamic shared memory and `args` in order. With `pdl` (where
    /// [`super::PDL_AVAILABLE`]) under the programmatic-stream-serialization attribute: the kernel may be scheduled before the
    /// previous kernel in the stream finishes, and waits for it on the device (every kernel of
    /// kernels.cu starts with `pdl_enter`).
    fn launch_cfg(
        pdl: bool,
        dev: &CudaDevice,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &[Arg],
    ) -> Result<()> {
        use candle_core::cuda_backend::cudarc::driver::sys;
        use std::ffi::c_void;
        let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        check(args.len() <= MAX_ARGS, || {
            format!("{name}: {} kernel arguments", args.len())
        })?;
        let mut params = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
        for (p, a) in params.iter_mut().zip(args) {
            *p = match a {
                Arg::P(v) => v as *const u64 as *mut c_void,
                Arg::I(v) => v as *const i32 as *mut c_void,
                Arg::F(v) => v as *const f32 as *mut c_void,
            };
        }
        let stream = dev.cuda_stream();
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| Error::Msg(format!("launching {name}: {e:?}")))?;
        // SAFETY: an all-zero launch attribute is a valid value of the C struct; its id and
        // value are set next.
        let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: smem,
            hStream: stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: u32::from(pdl && super::PDL_AVAILABLE),
        };
        // SAFETY: every kernel of kernels.cu takes exactly the arguments its caller below
        // passes, in order, with addresses of live allocations of the sizes it indexes;
        // `params` points at them for the duration of the call, which copies them.
        unsafe {
            sys::cuLaunchKernelEx(
                &cfg,
                func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| Error::Msg(format!("launching {name}: {e:?}")))
    }

    fn empty(shape: &[usize], dtype: DType, like: &Tensor) -> Result<Tensor> {
        if let Some(t) = super::scratch_output(shape, dtype)? {
            return Ok(t);
        }
        // SAFETY: every element is written by the kernel that fills it before any read.
        unsafe { Tensor::empty(shape, dtype, like.device()) }
    }

    fn check(ok: bool, what: impl FnOnce() -> String) -> Result<()> {
        if ok {
            Ok(())
        } else {
            Err(Error::Msg(what()))
        }
    }

    pub(super) fn gemv(
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        l: super::Launch,
    ) -> Result<Tensor> {
        let (n, k) = w.dims2()?;
        if let Some(b) = b {
            check(b.dims() == [n] && b.dtype() == DType::BF16, || {
                format!("gemv bias {:?} {:?} for {n} rows", b.dims(), b.dtype())
            })?;
        }
        let r = x.dims2()?.0;
        let name = match r {
            1 => "specsplit_gemv_bf16",
            2 => "specsplit_gemv_rows2_bf16",
            3 => "specsplit_gemv_rows3_bf16",
            4 => "specsplit_gemv_rows4_bf16",
            _ => return Err(Error::Msg(format!("gemv of {r} rows"))),
        };
        let y = empty(&[r, n], DType::BF16, x)?;
        let pb = b.map(ptr).transpose()?.unwrap_or(0);
        const ROWS_PER_BLOCK: usize = 8;
        let args = [
            P(ptr(w)?),
            P(ptr(x)?),
            P(pb),
            P(ptr(&y)?),
            I(n as i32),
            I(k as i32),
        ];
        let grid = n.div_ceil(ROWS_PER_BLOCK) as u32;
        let block = (ROWS_PER_BLOCK * 32) as u32;
        launch(l.pdl, cuda(x)?, name, grid, block, &args)?;
        Ok(y)
    }

    pub(super) fn add_rmsnorm(
        x: &Tensor,
        delta: Option<&Tensor>,
        weight: &Tensor,
        eps: f32,
        l: super::Launch,
    ) -> Result<(Tensor, Tensor)> {
        let (rows, d) = x.dims2()?;
        check(
            weight.dims() == [d] && weight.dtype() == DType::BF16,
            || format!("rmsnorm weight {:?} for width {d}", weight.dims()),
        )?;
        if let Some(delta) = delta {
            check(
                delta.dims() == x.dims() && delta.dtype() == DType::BF16,
                || format!("residual {:?} plus {:?}", x.dims(), delta.dims()),
            )?;
        }
        let out = empty(&[2, rows, d], DType::BF16, x)?;
        let pd = delta.map(ptr).transpose()?.unwrap_or(0);
        let args = [
            P(ptr(x)?),
            P(pd),
            P(ptr(weight)?),
            P(ptr(&out)?),
            I(rows as i32),
            I(d as i32),
            F(eps),
        ];
        let block = (d.div_ceil(32) * 32).clamp(32, 1024) as u32;
        launch(
            l.pdl,
            cuda(x)?,
            "specsplit_add_rmsnorm_bf16",
            rows as u32,
            block,
            &args,
        )?;
        Ok((out.get(0)?, out.get(1)?))
    }

    fn check_cache(c: &Tensor, s: AttnShape) -> Result<()> {
        check(
            c.dims() == [1, s.kv, s.capacity, s.head_dim] && c.dtype() == DType::BF16,
            || {
                format!(
                    "K/V cache {:?} {:?} does not match {s:?}",
                    c.dims(),
                    c.dtype()
                )
            },
        )
    }

    fn check_pos(pos: &Tensor) -> Result<()> {
        check(pos.dims() == [1] && pos.dtype() == DType::U32, || {
            format!(
                "position buffer {:?} {:?}, expected (1,) u32",
                pos.dims(),
                pos.dtype()
            )
        })
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn qkv_rope_cache(
        qkv: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        pos: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        s: AttnShape,
        interleaved: bool,
        l: super::Launch,
    ) -> Result<Tensor> {
        let hd = s.head_dim;
        let rows = qkv.dim(0)?;
        check(
            qkv.dims() == [rows, (s.heads + 2 * s.kv) * hd]
                && (1..=super::GEMV_MAX_ROWS).contains(&rows)
                && hd.is_multiple_of(2)
                && hd <= 2048,
            || format!("fused QKV rows {:?} do not match {s:?}", qkv.dims()),
        )?;
        for t in [cos, sin] {
            check(
                t.rank() == 2 && t.dim(1)? == hd / 2 && t.dtype() == DType::BF16,
                || format!("rotary table {:?} for head size {hd}", t.dims()),
            )?;
        }
        check_pos(pos)?;
        check_cache(k_cache, s)?;
        check_cache(v_cache, s)?;
        let q = empty(&[rows, s.heads * hd], DType::BF16, qkv)?;
        let mut args = pointers(&[qkv, cos, sin, pos, k_cache, v_cache, &q])?;
        args.extend([s.heads, s.kv, hd, s.capacity, interleaved as usize].map(|v| I(v as i32)));
        let grid = ((s.heads + 2 * s.kv) as u32, rows as u32);
        launch_2d(
            l.pdl,
            cuda(qkv)?,
            "specsplit_qkv_rope_cache_bf16",
            grid,
            (hd / 2) as u32,
            0,
            &args,
        )?;
        Ok(q)
    }

    #[allow(clippy::too_many_arguments)]
    pub(super) fn qkv_rope_rows(
        qkv: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        positions: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        past: Option<usize>,
        s: AttnShape,
        interleaved: bool,
        l: super::Launch,
    ) -> Result<Tensor> {
        let hd = s.head_dim;
        let (n, width) = qkv.dims2()?;
        check(
            width == (s.heads + 2 * s.kv) * hd && hd.is_multiple_of(2) && hd <= 2048,
            || format!("fused QKV rows {:?} do not match {s:?}", qkv.dims()),
        )?;
        check(
            positions.dims() == [n] && positions.dtype() == DType::U32,
            || format!("positions {:?} for {n} rows", positions.dims()),
        )?;
        check(past.is_none_or(|p| p + n <= s.capacity), || {
            format!("{n} rows after {past:?} do not fit {} slots", s.capacity)
        })?;
        // The kernel reads a negative `past` as "the slots are the positions".
        let past = past.map_or(-1, |p| p as i64);
        check(past < i64::from(i32::MAX), || format!("slot {past}"))?;
        for t in [cos, sin] {
            check(
                t.rank() == 2 && t.dim(1)? == hd / 2 && t.dtype() == DType::BF16,
                || format!("rotary table {:?} for head size {hd}", t.dims()),
            )?;
        }
        check_cache(k_cache, s)?;
        check_cache(v_cache, s)?;
        let q = empty(&[1, s.heads, n, hd], DType::BF16, qkv)?;
        let mut args = pointers(&[qkv, cos, sin, positions, k_cache, v_cache, &q])?;
        args.extend([s.heads, s.kv, hd, s.capacity, n].map(|v| I(v as i32)));
        args.extend([I(past as i32), I(interleaved as i32)]);
        let grid = ((s.heads + 2 * s.kv) as u32, n as u32);
        launch_2d(
            l.pdl,
            cuda(qkv)?,
            "specsplit_qkv_rope_rows_bf16",
            grid,
            (hd / 2) as u32,
            0,
            &args,
        )?;
        Ok(q)
    }

    pub(super) fn decode_attention(
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        pos: &Tensor,
        s: AttnShape,
        scale: f32,
        l: super::Launch,
    ) -> Result<Tensor> {
        let rows = q.dim(0)?;
        check(
            q.dims() == [rows, s.heads * s.head_dim]
                && (1..=super::GEMV_MAX_ROWS).contains(&rows)
                && s.kv > 0
                && s.heads.is_multiple_of(s.kv),
            || format!("queries {:?} do not match {s:?}", q.dims()),
        )?;
        check_pos(pos)?;
        check_cache(k_cache, s)?;
        check_cache(v_cache, s)?;
        let hd = s.head_dim;
        let splits = super::decode_attention_splits(s.capacity);
        let part = empty(&[rows, s.heads, splits, hd + 2], DType::F32, q)?;
        let mut args = pointers(&[q, k_cache, v_cache, pos, &part])?;
        args.extend([s.heads, s.kv, s.capacity, splits].map(|v| I(v as i32)));
        args.push(F(scale));
        let name = if hd == 64 {
            "specsplit_decode_attention_split_bf16_hd64"
        } else {
            "specsplit_decode_attention_split_bf16_hd128"
        };
        let dev = cuda(q)?;
        let grid = (s.heads as u32, splits as u32, rows as u32);
        launch_3d(l.pdl, dev, name, grid, 256, &args)?;
        let y = empty(&[rows, s.heads * hd], DType::BF16, q)?;
        let mut args = pointers(&[&part, &y])?;
        args.extend([splits, hd].map(|v| I(v as i32)));
        launch(
            l.pdl,
            dev,
            "specsplit_decode_attention_merge_bf16",
            (rows * s.heads) as u32,
            hd as u32,
            &args,
        )?;
        Ok(y)
    }

    pub(super) fn bi_matmul(
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        l: super::Launch,
    ) -> Result<Tensor> {
        // BI_ROWS of kernels.cu.
        const ROWS: usize = 64;
        let (n, k) = w.dims2()?;
        let m = x.dim(0)?;
        if let Some(b) = b {
            check(b.dims() == [n] && b.dtype() == DType::BF16, || {
                format!("matmul bias {:?} {:?} for {n} columns", b.dims(), b.dtype())
            })?;
        }
        let y = empty(&[m, n], DType::BF16, x)?;
        let pb = b.map(ptr).transpose()?.unwrap_or(0);
        let tune = l.bi_tuning;
        let splits = tune
            .splits
            .unwrap_or_else(|| super::bi_splits(n, k))
            .min(k / 32)
            .max(1);
        // Column tiles of 8 a warp and the loads in flight: these change no output's
        // arithmetic. Measured (`specsplit-bench kernels --splits … --col-tiles … --depths …`,
        // H200, Qwen2.5 1.5B and 7B shapes): 4 tiles pay when they still leave about 560 warps;
        // twice the loads in flight pay for a single row tile.
        let nt = tune
            .col_tiles
            .unwrap_or_else(|| super::bi_col_tiles(m, n, splits));
        let deep = tune.depth.unwrap_or(if m <= 16 { 2 } else { 1 });
        // The warps' partial sums of the block with the most row tiles: 16 rows a row tile, 8
        // columns a column tile.
        let smem = (16 * m.min(ROWS).div_ceil(16) * 8 * nt * std::mem::size_of::<f32>()) as u32;
        let args = [
            P(ptr(x)?),
            P(ptr(w)?),
            P(pb),
            P(ptr(&y)?),
            I(m as i32),
            I(n as i32),
            I(k as i32),
            I(splits as i32),
            I(nt as i32),
            I(i32::from(deep)),
        ];
        let grid = (n.div_ceil(8 * nt) as u32, m.div_ceil(ROWS) as u32);
        launch_2d(
            l.pdl,
            cuda(x)?,
            "specsplit_bi_matmul_bf16",
            grid,
            (splits * 32) as u32,
            smem,
            &args,
        )?;
        Ok(y)
    }

    pub(super) fn rows_attention(
        q: &Tensor,
        k_cache: &Tensor,
        v_cache: &Tensor,
        keys: &super::PassKeys,
        s: AttnShape,
        scale: f32,
        l: super::Launch,
    ) -> Result<Tensor> {
        let n = keys.rows;
        check(
            q.dims() == [1, s.heads, n, s.head_dim] && s.kv > 0 && s.heads.is_multiple_of(s.kv),
            || format!("queries {:?} for {n} rows do not match {s:?}", q.dims()),
        )?;
        check(keys.end <= s.capacity, || {
            format!(
                "rows read slot {} of a {}-slot cache",
                keys.end - 1,
                s.capacity
            )
        })?;
        check_cache(k_cache, s)?;
        check_cache(v_cache, s)?;
        check(s.heads / s.kv <= super::RA_MAX_REP, || {
            format!(
                "{} query heads a KV head (at most {})",
                s.heads / s.kv,
                super::RA_MAX_REP
            )
        })?;
        // Keys a chunk: RA_CHUNK of kernels.cu.
        const CHUNK: usize = 64;
        let chunks = keys.max_len.div_ceil(CHUNK);
        let hd = s.head_dim;
        let part = empty(&[n, s.heads, chunks, hd + 2], DType::F32, q)?;
        let mut args = pointers(&[q, k_cache, v_cache, &keys.meta, &keys.extra, &part])?;
        args.extend([s.heads, s.kv, n, s.capacity, keys.max_extra, chunks].map(|v| I(v as i32)));
        args.push(F(scale));
        let dev = cuda(q)?;
        let group = super::RA_STAGE.min(n);
        if group >= 2 {
            // Staged K and V rows of a chunk (K padded by RA_KPAD), then per row group its
            // RowScratch: RA_MAX_REP x hd query floats, RA_MAX_REP x CHUNK probabilities,
            // CHUNK slots, 2 x RA_MAX_REP warp results (kernels.cu).
            let rep = super::RA_MAX_REP;
            let staged = 2 * CHUNK * (hd + 8) + 2 * CHUNK * hd;
            let scratch = 4 * (rep * hd + rep * CHUNK + CHUNK + 2 * rep);
            let smem = (staged + group * scratch) as u32;
            let name = if hd == 64 {
                "specsplit_rows_attention_staged_bf16_hd64"
            } else {
                "specsplit_rows_attention_staged_bf16_hd128"
            };
            allow_smem(dev, name, smem)?;
            args.push(I(group as i32));
            let grid = (s.kv as u32, n.div_ceil(group) as u32, chunks as u32);
            launch_cfg(l.pdl, dev, name, grid, (group * CHUNK) as u32, smem, &args)?;
        } else {
            let name = if hd == 64 {
                "specsplit_rows_attention_part_bf16_hd64"
            } else {
                "specsplit_rows_attention_part_bf16_hd128"
            };
            launch_3d(
                l.pdl,
                dev,
                name,
                (s.kv as u32, n as u32, chunks as u32),
                CHUNK as u32,
                &args,
            )?;
        }
        let y = empty(&[n, s.heads * hd], DType::BF16, q)?;
        let mut args = pointers(&[&part, &keys.meta, &y])?;
        args.extend([s.heads, chunks, hd].map(|v| I(v as i32)));
        launch_2d(
            l.pdl,
            dev,
            "specsplit_rows_attention_merge_bf16",
            (s.heads as u32, n as u32),
            hd as u32,
            0,
            &args,
        )?;
        Ok(y)
    }

    pub(super) fn silu_mul(gate_up: &Tensor, l: super::Launch) -> Result<Tensor> {
        let (rows, two_n) = gate_up.dims2()?;
        check(two_n.is_multiple_of(2), || {
            format!("gate|up width {two_n} is odd")
        })?;
        let n = two_n / 2;
        let out = empty(&[rows, n], DType::BF16, gate_up)?;
        let args = [P(ptr(gate_up)?), P(ptr(&out)?), I(rows as i32), I(n as i32)];
        let grid = (rows * n).div_ceil(256) as u32;
        launch(
            l.pdl,
            cuda(gate_up)?,
            "specsplit_silu_mul_bf16",
            grid,
            256,
            &args,
        )?;
        Ok(out)
    }

    pub(super) fn greedy_head(
        logits: &Tensor,
        next: &Tensor,
        logprob: &Tensor,
        token: &Tensor,
        pos: &Tensor,
        l: super::Launch,
    ) -> Result<()> {
        let (one, vocab) = logits.dims2()?;
        check(one == 1, || format!("greedy head over {one} rows"))?;
        for (t, dt) in [
            (next, DType::U32),
            (logprob, DType::F32),
            (token, DType::U32),
            (pos, DType::U32),
        ] {
            check(t.dims() == [1] && t.dtype() == dt, || {
                format!("greedy head buffer {:?} {:?}", t.dims(), t.dtype())
            })?;
        }
        let dev = cuda(logits)?;
        // Spread over blocks of at least 2048 logits each (H100: 52 us in one block for a
        // 150k vocabulary), then combined by one warp.
        let blocks = vocab.div_ceil(2048).clamp(1, 128);
        let chunk = vocab.div_ceil(blocks);
        let part = empty(&[3 * blocks], DType::F32, logits)?;
        let args = [
            P(ptr(logits)?),
            I(vocab as i32),
            I(chunk as i32),
            P(ptr(&part)?),
        ];
        launch(
            l.pdl,
            dev,
            "specsplit_greedy_head_part_bf16",
            blocks as u32,
            256,
            &args,
        )?;
        let mut args = pointers(&[&part])?;
        args.push(I(blocks as i32));
        args.extend(pointers(&[next, logprob, token, pos])?);
        launch(l.pdl, dev, "specsplit_greedy_head_finish", 1, 32, &args)
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    //! Without `cuda` nothing applies: [`super::applies`] is false, so these are unreachable
    //! through the public functions, which check it first.
    use super::AttnShape;
    use candle_core::{Error, Result, Tensor};

    fn off() -> Error {
        Error::Msg("fused kernels need the `cuda` feature".into())
    }
    pub(super) fn aligned16(_: &Tensor) -> bool {
        false
    }
    pub(super) fn write_u32(_: &Tensor, _: &[u32]) -> Result<()> {
        Err(off())
    }
    pub(super) fn gemv(
        _: &Tensor,
        _: &Tensor,
        _: Option<&Tensor>,
        _: super::Launch,
    ) -> Result<Tensor> {
        Err(off())
    }
    pub(super) fn add_rmsnorm(
        _: &Tensor,
        _: Option<&Tensor>,
        _: &Tensor,
        _: f32,
        _: super::Launch,
    ) -> Result<(Tensor, Tensor)> {
        Err(off())
    }
    #[allow(clippy::too_many_arguments)]
    pub(super) fn qkv_rope_cache(
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: AttnShape,
        _: bool,
        _: super::Launch,
    ) -> Result<Tensor> {
        Err(off())
    }
    #[allow(clippy::too_many_arguments)]
    pub(super) fn qkv_rope_rows(
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: Option<usize>,
        _: AttnShape,
        _: bool,
        _: super::Launch,
    ) -> Result<Tensor> {
        Err(off())
    }
    pub(super) fn decode_attention(
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: AttnShape,
        _: f32,
        _: super::Launch,
    ) -> Result<Tensor> {
        Err(off())
    }
    pub(super) fn bi_matmul(
        _: &Tensor,
        _: &Tensor,
        _: Option<&Tensor>,
        _: super::Launch,
    ) -> Result<Tensor> {
        Err(off())
    }
    pub(super) fn rows_attention(
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &super::PassKeys,
        _: AttnShape,
        _: f32,
        _: super::Launch,
    ) -> Result<Tensor> {
        Err(off())
    }
    pub(super) fn silu_mul(_: &Tensor, _: super::Launch) -> Result<Tensor> {
        Err(off())
    }
    pub(super) fn greedy_head(
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: super::Launch,
    ) -> Result<()> {
        Err(off())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        for n in [1usize, 7, 16, 100, 1000, 5000, 50_000] {
            for k in [32usize, 64, 96, 512, 4096, 20_000] {
                let s = bi_splits(n, k);
                assert!((1..=8).contains(&s) && s <= k / 32, "{n}x{k}: {s}");
                assert!(s.is_power_of_two() || s == k / 32, "{n}x{k}: {s}");
            }
        }
    }
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

    #[test]
    fn kernel_options_need_the_cuda_feature() {
        let on = cfg!(feature = "cuda");
        let all = KernelOptions {
            fused: true,
            pdl: true,
            batch_invariant: true,
            wide_rows: true,
        };
        assert_eq!(KernelOptions::default(), all.available());
        let got = all.available();
        assert_eq!(
            (got.fused, got.pdl, got.batch_invariant, got.wide_rows),
            (on, on, on, on)
        );
        assert_eq!(all.launch(), Launch::DEFAULT);
        let x = Tensor::zeros((2, 64), DType::BF16, &Device::Cpu).unwrap();
        let w = Tensor::zeros((16, 64), DType::BF16, &Device::Cpu).unwrap();
        assert!(!bi_matmul_fits(&x, &w));
        assert!(bi_matmul(&x, &w, None, Launch::DEFAULT).is_err());
    }
}
