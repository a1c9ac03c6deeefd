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
//! unfused path. Where the model uses them is set by `SPECSPLIT_FUSED_KERNELS` (read once):
//!
//! - unset or `step` (default): the fixed-shape greedy step ([`enabled`]), which only drafts
//!   (its tokens are proposals the target verifies), so it cannot change any output;
//! - `all`: also every one-row dense projection ([`rows_enabled`]): the target's plain decode
//!   steps then run the GEMV while verify passes keep cuBLAS, so bf16 near-ties can break
//!   differently between target-only decoding and speculation (measured in docs/benchmarks.md);
//! - `0`: nowhere.

use candle_core::{DType, Result, Tensor};
use std::sync::atomic::{AtomicU8, Ordering};

/// 0: not decided yet, else 1 + the [`Scope`] index.
static SCOPE: AtomicU8 = AtomicU8::new(0);

/// Where the model uses the fused kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// Nowhere.
    Off,
    /// The fixed-shape greedy (draft) step only.
    Step,
    /// The step and every one-row dense projection.
    All,
}

impl Scope {
    const ALL: [Scope; 3] = [Scope::Off, Scope::Step, Scope::All];

    /// The scope `SPECSPLIT_FUSED_KERNELS` asks for (`0`, `step` or `1`, `all`; unset: step).
    fn from_env() -> Self {
        match std::env::var("SPECSPLIT_FUSED_KERNELS")
            .as_deref()
            .map(str::trim)
        {
            Ok("0") | Ok("off") => Scope::Off,
            Ok("all") => Scope::All,
            _ => Scope::Step,
        }
    }
}

/// The scope in force: [`set_scope`]'s, else the environment's; always off without `cuda`.
pub fn scope() -> Scope {
    if !cfg!(feature = "cuda") {
        return Scope::Off;
    }
    match SCOPE.load(Ordering::Relaxed) {
        0 => {
            let s = Scope::from_env();
            set_scope(s);
            s
        }
        v => Scope::ALL[(v - 1) as usize],
    }
}

/// Sets where the model uses the fused kernels from here on (overrides the environment).
pub fn set_scope(s: Scope) {
    let i = Scope::ALL.iter().position(|&x| x == s).unwrap_or(0);
    SCOPE.store(i as u8 + 1, Ordering::Relaxed);
}

/// Whether the fixed-shape greedy step uses the fused kernels.
pub fn enabled() -> bool {
    scope() != Scope::Off
}

/// Whether one-row dense projections use the fused GEMV.
pub fn rows_enabled() -> bool {
    scope() == Scope::All
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

/// Whether `gemv(x, w, _)` can run: `w` [`weight_fits`] and `x` a contiguous, 16-byte aligned
/// bf16 `(1, k)` row on CUDA of the same width.
pub fn gemv_fits(x: &Tensor, w: &Tensor) -> bool {
    applies(x)
        && matches!((x.dims(), w.dims()), ([1, k], [_, kw]) if k == kw)
        && x.is_contiguous()
        && imp::aligned16(x)
        && weight_fits(w)
}

/// `x W^T (+ b)` for one row: `x` `(1, k)`, `w` `(n, k)`, `b` `(n,)` → `(1, n)` bf16.
/// Fails unless [`gemv_fits`].
pub fn gemv(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
    if !gemv_fits(x, w) {
        return Err(unfit("gemv", &[x, w]));
    }
    imp::gemv(x, w, b)
}

/// Residual add and RMSNorm of `rows` rows: `s = x + delta` (`s = x` without `delta`), returns
/// `(s, s / rms(s) * weight)`, both `(rows, d)` bf16.
pub fn add_rmsnorm(
    x: &Tensor,
    delta: Option<&Tensor>,
    weight: &Tensor,
    eps: f32,
) -> Result<(Tensor, Tensor)> {
    if !applies(x) {
        return Err(unfit("add_rmsnorm", &[x]));
    }
    imp::add_rmsnorm(x, delta, weight, eps)
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

/// Splits one token's fused Q|K|V row `(1, (heads + 2 kv) * head_dim)`: applies rotary at the
/// device-side position `pos` (`(1,)` u32) with the `(positions, head_dim / 2)` tables to Q and
/// K, writes K and V into the caches `(1, kv, capacity, head_dim)` at slot `pos`, and returns
/// the rotated Q `(1, heads * head_dim)`. `interleaved` selects the `(2i, 2i + 1)` pair layout.
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
) -> Result<Tensor> {
    if !applies(qkv) {
        return Err(unfit("qkv_rope_cache", &[qkv]));
    }
    imp::qkv_rope_cache(qkv, cos, sin, pos, k_cache, v_cache, shape, interleaved)
}

/// Attention of one query `(1, heads * head_dim)` over cache slots `0..=pos` of the caches
/// `(1, kv, capacity, head_dim)`, scaled by `scale`: `(1, heads * head_dim)` bf16. `head_dim`
/// must be 64 or 128.
pub fn decode_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    pos: &Tensor,
    shape: AttnShape,
    scale: f32,
) -> Result<Tensor> {
    if !applies(q) || !matches!(shape.head_dim, 64 | 128) {
        return Err(unfit("decode_attention", &[q]));
    }
    imp::decode_attention(q, k_cache, v_cache, pos, shape, scale)
}

/// SwiGLU gate of `(rows, 2 n)` = `[gate | up]`: `silu(gate) * up`, `(rows, n)` bf16.
pub fn silu_mul(gate_up: &Tensor) -> Result<Tensor> {
    if !applies(gate_up) {
        return Err(unfit("silu_mul", &[gate_up]));
    }
    imp::silu_mul(gate_up)
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
) -> Result<()> {
    if !applies(logits) {
        return Err(unfit("greedy_head", &[logits]));
    }
    imp::greedy_head(logits, next, logprob, token, pos)
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
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
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

    /// One kernel argument: a device address, an int or a float.
    enum Arg {
        P(u64),
        I(i32),
        F(f32),
    }

    /// Launches `name` on `dev`'s stream with `grid` × `block` threads and `args` in order.
    fn launch(dev: &CudaDevice, name: &str, grid: u32, block: u32, args: &[Arg]) -> Result<()> {
        let func = dev.get_or_load_custom_func(name, MODULE, PTX)?;
        let mut b = func.builder();
        for a in args {
            match a {
                Arg::P(v) => b.arg(v),
                Arg::I(v) => b.arg(v),
                Arg::F(v) => b.arg(v),
            };
        }
        let cfg = LaunchConfig {
            grid_dim: (grid, 1, 1),
            block_dim: (block, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: every kernel of kernels.cu takes exactly the arguments its caller below
        // passes, in order, with addresses of live allocations of the sizes it indexes.
        unsafe { b.launch(cfg) }
            .map(|_| ())
            .map_err(|e| Error::Msg(format!("launching {name}: {e:?}")))
    }

    fn empty(shape: &[usize], dtype: DType, like: &Tensor) -> Result<Tensor> {
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

    pub(super) fn gemv(x: &Tensor, w: &Tensor, b: Option<&Tensor>) -> Result<Tensor> {
        let (n, k) = w.dims2()?;
        if let Some(b) = b {
            check(b.dims() == [n] && b.dtype() == DType::BF16, || {
                format!("gemv bias {:?} {:?} for {n} rows", b.dims(), b.dtype())
            })?;
        }
        let y = empty(&[1, n], DType::BF16, x)?;
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
        launch(cuda(x)?, "specsplit_gemv_bf16", grid, block, &args)?;
        Ok(y)
    }

    pub(super) fn add_rmsnorm(
        x: &Tensor,
        delta: Option<&Tensor>,
        weight: &Tensor,
        eps: f32,
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
    ) -> Result<Tensor> {
        let hd = s.head_dim;
        check(
            qkv.dims() == [1, (s.heads + 2 * s.kv) * hd] && hd.is_multiple_of(2) && hd <= 2048,
            || format!("fused QKV row {:?} does not match {s:?}", qkv.dims()),
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
        let q = empty(&[1, s.heads * hd], DType::BF16, qkv)?;
        let mut args = pointers(&[qkv, cos, sin, pos, k_cache, v_cache, &q])?;
        args.extend([s.heads, s.kv, hd, s.capacity, interleaved as usize].map(|v| I(v as i32)));
        let grid = (s.heads + 2 * s.kv) as u32;
        launch(
            cuda(qkv)?,
            "specsplit_qkv_rope_cache_bf16",
            grid,
            (hd / 2) as u32,
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
    ) -> Result<Tensor> {
        check(
            q.dims() == [1, s.heads * s.head_dim] && s.kv > 0 && s.heads.is_multiple_of(s.kv),
            || format!("query {:?} does not match {s:?}", q.dims()),
        )?;
        check_pos(pos)?;
        check_cache(k_cache, s)?;
        check_cache(v_cache, s)?;
        let y = empty(&[1, s.heads * s.head_dim], DType::BF16, q)?;
        let mut args = pointers(&[q, k_cache, v_cache, pos, &y])?;
        args.extend([s.heads, s.kv, s.capacity].map(|v| I(v as i32)));
        args.push(F(scale));
        let name = if s.head_dim == 64 {
            "specsplit_decode_attention_bf16_hd64"
        } else {
            "specsplit_decode_attention_bf16_hd128"
        };
        launch(cuda(q)?, name, s.heads as u32, 256, &args)?;
        Ok(y)
    }

    pub(super) fn silu_mul(gate_up: &Tensor) -> Result<Tensor> {
        let (rows, two_n) = gate_up.dims2()?;
        check(two_n.is_multiple_of(2), || {
            format!("gate|up width {two_n} is odd")
        })?;
        let n = two_n / 2;
        let out = empty(&[rows, n], DType::BF16, gate_up)?;
        let args = [P(ptr(gate_up)?), P(ptr(&out)?), I(rows as i32), I(n as i32)];
        let grid = (rows * n).div_ceil(256) as u32;
        launch(cuda(gate_up)?, "specsplit_silu_mul_bf16", grid, 256, &args)?;
        Ok(out)
    }

    pub(super) fn greedy_head(
        logits: &Tensor,
        next: &Tensor,
        logprob: &Tensor,
        token: &Tensor,
        pos: &Tensor,
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
        let mut args = pointers(&[logits])?;
        args.push(I(vocab as i32));
        args.extend(pointers(&[next, logprob, token, pos])?);
        launch(cuda(logits)?, "specsplit_greedy_head_bf16", 1, 1024, &args)
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
    pub(super) fn gemv(_: &Tensor, _: &Tensor, _: Option<&Tensor>) -> Result<Tensor> {
        Err(off())
    }
    pub(super) fn add_rmsnorm(
        _: &Tensor,
        _: Option<&Tensor>,
        _: &Tensor,
        _: f32,
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
    ) -> Result<Tensor> {
        Err(off())
    }
    pub(super) fn silu_mul(_: &Tensor) -> Result<Tensor> {
        Err(off())
    }
    pub(super) fn greedy_head(
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
        _: &Tensor,
    ) -> Result<()> {
        Err(off())
    }
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
        let e = gemv(&x, &w, None).unwrap_err().to_string();
        assert!(e.contains("needs bf16 on CUDA"), "{e}");
        assert!(silu_mul(&x).is_err());
        assert!(add_rmsnorm(&x, None, &w.get(0).unwrap(), 1e-6).is_err());
    }

    #[test]
    fn the_scope_needs_the_cuda_feature() {
        set_scope(Scope::All);
        assert_eq!(rows_enabled(), cfg!(feature = "cuda"));
        assert_eq!(enabled(), cfg!(feature = "cuda"));
        set_scope(Scope::Step);
        assert!(!rows_enabled());
        assert_eq!(enabled(), cfg!(feature = "cuda"));
        set_scope(Scope::Off);
        assert!(!enabled() && !rows_enabled());
    }
}
