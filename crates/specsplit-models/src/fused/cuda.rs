//! The CUDA side of the kernel wrappers: loads the PTX the build script compiles from
//! `src/cuda/kernels.cu`, checks operands and launches the kernels.

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

/// Launches `name` on `dev`'s stream over a `(x, y, z)` grid of `block`-thread blocks with `smem`
/// bytes of dynamic shared memory and `args` in order. With `pdl` (where [`super::PDL_AVAILABLE`])
/// under the programmatic-stream-serialization attribute: the kernel may be scheduled before the
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

pub(super) fn gemv(x: &Tensor, w: &Tensor, b: Option<&Tensor>, l: super::Launch) -> Result<Tensor> {
    let (n, k) = w.dims2()?;
    if let Some(b) = b {
        check(b.dims() == [n] && b.dtype() == DType::BF16, || {
            format!("gemv bias {:?} {:?} for {n} rows", b.dims(), b.dtype())
        })?;
    }
    let r = x.dims2()?.0;
    // By rows of x (1 to 4), then by rows of the weight a warp (1 or 2).
    const NAMES: [[&str; 2]; 4] = [
        ["specsplit_gemv_bf16", "specsplit_gemv_bf16_w2"],
        ["specsplit_gemv_rows2_bf16", "specsplit_gemv_rows2_bf16_w2"],
        ["specsplit_gemv_rows3_bf16", "specsplit_gemv_rows3_bf16_w2"],
        ["specsplit_gemv_rows4_bf16", "specsplit_gemv_rows4_bf16_w2"],
    ];
    let warp_rows = super::launch::gemv_warp_rows(n, k, r, l.gemv_warp_rows);
    let names = r
        .checked_sub(1)
        .and_then(|i| NAMES.get(i))
        .ok_or_else(|| Error::Msg(format!("gemv of {r} rows")))?;
    let name = names[warp_rows - 1];
    let y = empty(&[r, n], DType::BF16, x)?;
    let pb = b.map(ptr).transpose()?.unwrap_or(0);
    const WARPS_PER_BLOCK: usize = 8;
    let args = [
        P(ptr(w)?),
        P(ptr(x)?),
        P(pb),
        P(ptr(&y)?),
        I(n as i32),
        I(k as i32),
    ];
    let grid = n.div_ceil(WARPS_PER_BLOCK * warp_rows) as u32;
    let block = (WARPS_PER_BLOCK * 32) as u32;
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

/// Checks that `cos` and `sin` are bf16 rotary tables of `hd / 2` columns.
fn check_rotary(cos: &Tensor, sin: &Tensor, hd: usize) -> Result<()> {
    for t in [cos, sin] {
        check(
            t.rank() == 2 && t.dim(1)? == hd / 2 && t.dtype() == DType::BF16,
            || format!("rotary table {:?} for head size {hd}", t.dims()),
        )?;
    }
    Ok(())
}

/// The row count of fused QKV rows `qkv`, checked to hold `(heads + 2 kv) * head_dim` values
/// each for an even head size of at most 2048.
fn check_qkv_rows(qkv: &Tensor, s: AttnShape) -> Result<usize> {
    let hd = s.head_dim;
    let (n, width) = qkv.dims2()?;
    check(
        width == (s.heads + 2 * s.kv) * hd && hd.is_multiple_of(2) && hd <= 2048,
        || format!("fused QKV rows {:?} do not match {s:?}", qkv.dims()),
    )?;
    Ok(n)
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
    check_rotary(cos, sin, hd)?;
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
    slots: super::RowSlots<'_>,
    s: AttnShape,
    interleaved: bool,
    l: super::Launch,
) -> Result<Tensor> {
    let hd = s.head_dim;
    let n = check_qkv_rows(qkv, s)?;
    check(
        positions.dims() == [n] && positions.dtype() == DType::U32,
        || format!("positions {:?} for {n} rows", positions.dims()),
    )?;
    // The kernel reads a negative `past` as "the slots are listed".
    let (past, listed) = match slots {
        super::RowSlots::After(p) => {
            check(p + n <= s.capacity, || {
                format!("{n} rows after {p} do not fit {} slots", s.capacity)
            })?;
            (p as i64, positions)
        }
        super::RowSlots::Listed(l) => {
            check(l.dims() == [n] && l.dtype() == DType::U32, || {
                format!("slots {:?} for {n} rows", l.dims())
            })?;
            (-1, l)
        }
    };
    check(past < i64::from(i32::MAX), || format!("slot {past}"))?;
    check_rotary(cos, sin, hd)?;
    check_cache(k_cache, s)?;
    check_cache(v_cache, s)?;
    let q = empty(&[1, s.heads, n, hd], DType::BF16, qkv)?;
    let mut args = pointers(&[qkv, cos, sin, positions, listed, k_cache, v_cache, &q])?;
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

/// bi_matmul.cu's lean entries by row tiles of 16 (1 to 4).
const BI_LEAN: [&str; 4] = [
    "specsplit_bi_matmul_lean_bf16_m1",
    "specsplit_bi_matmul_lean_bf16_m2",
    "specsplit_bi_matmul_lean_bf16_m3",
    "specsplit_bi_matmul_lean_bf16_m4",
];

/// bi_matmul.cu's lean entries with the input loaded ahead, by row tiles of 16 (1 to 4).
const BI_LEAN_X_AHEAD: [&str; 4] = [
    "specsplit_bi_matmul_lean_xa_bf16_m1",
    "specsplit_bi_matmul_lean_xa_bf16_m2",
    "specsplit_bi_matmul_lean_xa_bf16_m3",
    "specsplit_bi_matmul_lean_xa_bf16_m4",
];

pub(super) fn bi_matmul(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    l: super::Launch,
) -> Result<Tensor> {
    // BI_ROWS of bi_matmul.cu.
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
    // The products `bi_lean` picks take the lean entry of their row tiles (2 column tiles a
    // warp, the base load depth); the others the entry that holds every tiling, with its column
    // tiles and load depth. These change no output's arithmetic. Measured (`specsplit-bench kernels --splits …
    // --col-tiles … --depths …`, H200, Qwen2.5 1.5B and 7B shapes): 4 tiles pay when they still
    // leave about 560 warps; twice the loads in flight pay for a single row tile.
    let lean = super::bi_lean(n, k, tune);
    let nt = if lean {
        2
    } else {
        tune.col_tiles
            .unwrap_or_else(|| super::bi_col_tiles(m, n, splits))
    };
    let deep = tune.depth.unwrap_or(if m <= 16 { 2 } else { 1 });
    // Row tiles of 16 of the block with the most: its warps' partial sums take 16 rows a row
    // tile and 8 columns a column tile, and a lean entry is compiled for that many.
    let row_tiles = m.min(ROWS).div_ceil(16);
    let smem = (16 * row_tiles * 8 * nt * std::mem::size_of::<f32>()) as u32;
    let grid = (n.div_ceil(8 * nt) as u32, m.div_ceil(ROWS) as u32);
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
    // A lean entry takes the arguments but the tiling.
    let (name, args) = if lean {
        let ahead = tune.x_ahead.unwrap_or_else(|| super::bi_x_ahead(row_tiles));
        let names = if ahead { BI_LEAN_X_AHEAD } else { BI_LEAN };
        (names[row_tiles - 1], &args[..8])
    } else {
        ("specsplit_bi_matmul_bf16", &args[..])
    };
    launch_2d(
        l.pdl,
        cuda(x)?,
        name,
        grid,
        (splits * 32) as u32,
        smem,
        args,
    )?;
    Ok(y)
}

/// Keys a chunk of the row attention kernels: RA_CHUNK of rows_attention.cu.
const CHUNK: usize = 64;

/// Checks the queries `(1, heads, n, head_dim)` of an `n`-row attention against `s`, and that
/// the row kernels take its query heads a KV head.
fn check_queries(q: &Tensor, n: usize, s: AttnShape) -> Result<()> {
    check(
        q.dims() == [1, s.heads, n, s.head_dim] && s.kv > 0 && s.heads.is_multiple_of(s.kv),
        || format!("queries {:?} for {n} rows do not match {s:?}", q.dims()),
    )?;
    check(s.heads / s.kv <= super::RA_MAX_REP, || {
        format!(
            "{} query heads a KV head (at most {})",
            s.heads / s.kv,
            super::RA_MAX_REP
        )
    })
}

/// Merges each row's per-chunk partial attention `part` into its output `(rows, heads ·
/// head_dim)`, bf16.
fn merge_row_parts(
    part: &Tensor,
    keys: &super::PassKeys,
    s: AttnShape,
    chunks: usize,
    l: super::Launch,
    dev: &CudaDevice,
    q: &Tensor,
) -> Result<Tensor> {
    let (n, hd) = (keys.rows, s.head_dim);
    let y = empty(&[n, s.heads * hd], DType::BF16, q)?;
    let mut args = pointers(&[part, &keys.meta, &y])?;
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

/// Checks the operands of a rows pass's attention: `keys.rows` queries of shape `s`, caches of
/// shape `s` and no key past their capacity.
fn check_rows_pass(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    keys: &super::PassKeys,
    s: AttnShape,
) -> Result<()> {
    check_queries(q, keys.rows, s)?;
    check(keys.end <= s.capacity, || {
        format!(
            "rows read slot {} of a {}-slot cache",
            keys.end - 1,
            s.capacity
        )
    })?;
    check_cache(k_cache, s)?;
    check_cache(v_cache, s)
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
    check_rows_pass(q, k_cache, v_cache, keys, s)?;
    let chunks = keys.max_len.div_ceil(CHUNK);
    let hd = s.head_dim;
    let part = empty(&[n, s.heads, chunks, hd + 2], DType::F32, q)?;
    let mut args = pointers(&[q, k_cache, v_cache, &keys.meta, &keys.extra, &part])?;
    args.extend([s.heads, s.kv, n, s.capacity, keys.max_extra, chunks].map(|v| I(v as i32)));
    args.push(F(scale));
    let dev = cuda(q)?;
    let group = super::RA_STAGE.min(n);
    let row_blocks = if group >= 2 { n.div_ceil(group) } else { n };
    let hb = super::launch::ra_heads(s.kv, s.heads / s.kv, row_blocks, chunks, l.rows_heads);
    let blocks_x = (s.kv * (s.heads / s.kv).div_ceil(hb)) as u32;
    if group >= 2 {
        // Staged K and V rows of a chunk (K padded by RA_KPAD), then per row group its
        // RowScratch: RA_MAX_REP x hd query floats, RA_MAX_REP x CHUNK probabilities,
        // CHUNK slots, 2 x RA_MAX_REP warp results (rows_attention.cu).
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
        args.extend([group, hb].map(|v| I(v as i32)));
        let grid = (blocks_x, n.div_ceil(group) as u32, chunks as u32);
        launch_cfg(l.pdl, dev, name, grid, (group * CHUNK) as u32, smem, &args)?;
    } else {
        let name = if hd == 64 {
            "specsplit_rows_attention_part_bf16_hd64"
        } else {
            "specsplit_rows_attention_part_bf16_hd128"
        };
        args.push(I(hb as i32));
        launch_3d(
            l.pdl,
            dev,
            name,
            (blocks_x, n as u32, chunks as u32),
            CHUNK as u32,
            &args,
        )?;
    }
    merge_row_parts(&part, keys, s, chunks, l, dev, q)
}

pub(super) fn addresses(ts: &[&Tensor]) -> Result<Vec<u64>> {
    ts.iter().map(|t| ptr(t)).collect()
}

/// [`super::move_entries`] of `moves` entries in `buffers` `(1, kv, capacity, head_dim)` bf16
/// buffers, whose addresses and moves `table` holds (checked by the caller).
pub(super) fn move_entries(
    table: &Tensor,
    (buffers, moves, kv, capacity, head_dim): (usize, usize, usize, usize, usize),
    l: super::Launch,
) -> Result<()> {
    let lanes = buffers * kv * head_dim / 2;
    // The addresses (two words a buffer), then the moves.
    let words = ptr(table)?;
    let args = [
        P(words),
        I(buffers as i32),
        P(words + (8 * buffers) as u64),
        I(moves as i32),
        I(kv as i32),
        I(capacity as i32),
        I(head_dim as i32),
    ];
    let grid = lanes.div_ceil(256) as u32;
    launch(
        l.pdl,
        cuda(table)?,
        "specsplit_move_entries_bf16",
        grid,
        256,
        &args,
    )
}

/// Checks `table` against `shape` and `layer`.
fn check_table(table: &super::SessionTable, layer: usize, s: AttnShape) -> Result<()> {
    check(
        layer < table.layers && table.kv == s.kv && table.head_dim == s.head_dim,
        || {
            format!(
                "layer {layer} of a {}-layer session table of {} KV heads of {} values, for {s:?}",
                table.layers, table.kv, table.head_dim
            )
        },
    )
}

#[allow(clippy::too_many_arguments)]
pub(super) fn qkv_rope_sessions(
    qkv: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    positions: &Tensor,
    table: &super::SessionTable,
    layer: usize,
    s: AttnShape,
    interleaved: bool,
    l: super::Launch,
) -> Result<Tensor> {
    let hd = s.head_dim;
    let n = check_qkv_rows(qkv, s)?;
    check(
        n == table.rows() && positions.dims() == [n] && positions.dtype() == DType::U32,
        || {
            format!(
                "positions {:?} for {n} rows of a {}-row table",
                positions.dims(),
                table.rows()
            )
        },
    )?;
    check_table(table, layer, s)?;
    check_rotary(cos, sin, hd)?;
    let q = empty(&[1, s.heads, n, hd], DType::BF16, qkv)?;
    let mut args = pointers(&[
        qkv,
        cos,
        sin,
        positions,
        &table.rows,
        &table.caches,
        &table.capacities,
        &q,
    ])?;
    args.extend([s.heads, s.kv, hd, n, layer, table.sessions].map(|v| I(v as i32)));
    args.push(I(interleaved as i32));
    let grid = ((s.heads + 2 * s.kv) as u32, n as u32);
    launch_2d(
        l.pdl,
        cuda(qkv)?,
        "specsplit_qkv_rope_sessions_bf16",
        grid,
        (hd / 2) as u32,
        0,
        &args,
    )?;
    Ok(q)
}

pub(super) fn sessions_attention(
    q: &Tensor,
    table: &super::SessionTable,
    layer: usize,
    s: AttnShape,
    scale: f32,
    l: super::Launch,
) -> Result<Tensor> {
    let keys = &table.keys;
    let n = keys.rows;
    check_queries(q, n, s)?;
    check_table(table, layer, s)?;
    let chunks = keys.max_len.div_ceil(CHUNK);
    let hd = s.head_dim;
    let part = empty(&[n, s.heads, chunks, hd + 2], DType::F32, q)?;
    let mut args = pointers(&[
        q,
        &table.rows,
        &table.caches,
        &table.capacities,
        &keys.meta,
        &keys.extra,
        &part,
    ])?;
    args.extend([s.heads, s.kv, n, keys.max_extra, chunks].map(|v| I(v as i32)));
    args.push(F(scale));
    let hb = super::launch::ra_heads(s.kv, s.heads / s.kv, n, chunks, l.rows_heads);
    args.extend([layer, table.sessions, hb].map(|v| I(v as i32)));
    let dev = cuda(q)?;
    let name = if hd == 64 {
        "specsplit_sessions_attention_part_bf16_hd64"
    } else {
        "specsplit_sessions_attention_part_bf16_hd128"
    };
    launch_3d(
        l.pdl,
        dev,
        name,
        (
            (s.kv * (s.heads / s.kv).div_ceil(hb)) as u32,
            n as u32,
            chunks as u32,
        ),
        CHUNK as u32,
        &args,
    )?;
    merge_row_parts(&part, keys, s, chunks, l, dev, q)
}

/// Launches draft_attention.cu's kernel `names` (for head size 64, else 128) for `n` rows with
/// `args` (the output's address among them): a block a query head and row, its warps set by
/// the `span` of keys.
fn launch_draft_attention(
    names: [&str; 2],
    args: &[Arg],
    n: usize,
    span: usize,
    s: AttnShape,
    l: super::Launch,
    dev: &CudaDevice,
) -> Result<()> {
    let warps = super::draft_attention_warps(span);
    let name = if s.head_dim == 64 { names[0] } else { names[1] };
    let grid = (s.heads as u32, n as u32, 1);
    launch_cfg(l.pdl, dev, name, grid, (warps * 32) as u32, 0, args)
}

pub(super) fn draft_attention(
    q: &Tensor,
    k_cache: &Tensor,
    v_cache: &Tensor,
    keys: &super::PassKeys,
    s: AttnShape,
    scale: f32,
    l: super::Launch,
) -> Result<Tensor> {
    let n = keys.rows;
    check_rows_pass(q, k_cache, v_cache, keys, s)?;
    let y = empty(&[n, s.heads * s.head_dim], DType::BF16, q)?;
    let mut args = pointers(&[q, k_cache, v_cache, &keys.meta, &keys.extra, &y])?;
    args.extend([s.heads, s.kv, n, s.capacity, keys.max_extra].map(|v| I(v as i32)));
    args.push(F(scale));
    let names = [
        "specsplit_draft_attention_bf16_hd64",
        "specsplit_draft_attention_bf16_hd128",
    ];
    launch_draft_attention(names, &args, n, keys.max_len, s, l, cuda(q)?)?;
    Ok(y)
}

pub(super) fn draft_sessions_attention(
    q: &Tensor,
    table: &super::SessionTable,
    layer: usize,
    s: AttnShape,
    scale: f32,
    l: super::Launch,
) -> Result<Tensor> {
    let keys = &table.keys;
    let n = keys.rows;
    check_queries(q, n, s)?;
    check_table(table, layer, s)?;
    let y = empty(&[n, s.heads * s.head_dim], DType::BF16, q)?;
    let mut args = pointers(&[
        q,
        &table.rows,
        &table.caches,
        &table.capacities,
        &keys.meta,
        &keys.extra,
        &y,
    ])?;
    args.extend([s.heads, s.kv, n, keys.max_extra].map(|v| I(v as i32)));
    args.push(F(scale));
    args.extend([layer, table.sessions].map(|v| I(v as i32)));
    let names = [
        "specsplit_draft_sessions_attention_bf16_hd64",
        "specsplit_draft_sessions_attention_bf16_hd128",
    ];
    launch_draft_attention(names, &args, n, keys.max_len, s, l, cuda(q)?)?;
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

/// Blocks a row of `vocab` logits is spread over by [`head_parts`]: at least 2048 logits each
/// (H100: 52 us in one block for a 150k vocabulary), at most 128.
fn head_blocks(vocab: usize) -> usize {
    vocab.div_ceil(2048).clamp(1, 128)
}

/// The greedy heads' first kernel over every row of `x` `(rows, vocab)` (bf16 or f32):
/// [`head_blocks`] blocks a row, each writing its maximum, the lowest index holding it and its
/// exp-sum to `part` (`3 * blocks` floats a row), for one warp a row to combine.
fn head_parts(x: &Tensor, part: &Tensor, blocks: usize, l: super::Launch) -> Result<()> {
    let rows = x.dims2()?.0;
    check(part.elem_count() >= rows * 3 * blocks, || {
        format!("greedy head parts {:?} for {rows} rows", part.dims())
    })?;
    head_parts_at(x, ptr(part)?, blocks, l)
}

/// [`head_parts`] into the parts at device address `part`, which holds `3 * blocks` floats for
/// each row of `x`.
fn head_parts_at(x: &Tensor, part: u64, blocks: usize, l: super::Launch) -> Result<()> {
    let (rows, vocab) = x.dims2()?;
    let name = match x.dtype() {
        DType::BF16 => "specsplit_greedy_head_part_bf16",
        DType::F32 => "specsplit_greedy_head_part_f32",
        d => return Err(Error::Msg(format!("greedy head over {d:?} logits"))),
    };
    let chunk = vocab.div_ceil(blocks);
    let args = [P(ptr(x)?), I(vocab as i32), I(chunk as i32), P(part)];
    launch_2d(
        l.pdl,
        cuda(x)?,
        name,
        (blocks as u32, rows as u32),
        256,
        0,
        &args,
    )
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
    let blocks = head_blocks(vocab);
    let part = empty(&[3 * blocks], DType::F32, logits)?;
    head_parts(logits, &part, blocks, l)?;
    let mut args = pointers(&[&part])?;
    args.push(I(blocks as i32));
    args.extend(pointers(&[next, logprob, token, pos])?);
    launch(l.pdl, dev, "specsplit_greedy_head_finish", 1, 32, &args)
}

pub(super) fn argmax_rows(logits: &[&Tensor], l: super::Launch) -> Result<Tensor> {
    let Some(first) = logits.first() else {
        return Err(Error::Msg("the argmax of no logits".into()));
    };
    let vocab = first.dims2()?.1;
    let mut total = 0;
    for x in logits {
        let (rows, v) = x.dims2()?;
        check(
            v == vocab && x.dtype() == first.dtype() && x.device().same_device(first.device()),
            || format!("argmax of {:?} beside {:?}", x.dims(), first.dims()),
        )?;
        total += rows;
    }
    let dev = cuda(first)?;
    let blocks = head_blocks(vocab);
    let part = empty(&[total.max(1) * 3 * blocks], DType::F32, first)?;
    let ids = empty(&[total], DType::U32, first)?;
    let (part_at, ids_at) = (ptr(&part)?, ptr(&ids)?);
    let mut row = 0;
    for x in logits {
        let rows = x.dims2()?.0;
        if rows == 0 {
            continue;
        }
        let part_row = part_at + (row * 3 * blocks * std::mem::size_of::<f32>()) as u64;
        head_parts_at(x, part_row, blocks, l)?;
        let args = [
            P(part_row),
            I(blocks as i32),
            I(vocab as i32),
            P(ids_at + (row * std::mem::size_of::<u32>()) as u64),
        ];
        launch(
            l.pdl,
            dev,
            "specsplit_argmax_rows_finish",
            rows as u32,
            32,
            &args,
        )?;
        row += rows;
    }
    Ok(ids)
}

pub(super) fn greedy_rows(
    logits: &Tensor,
    forced: &Tensor,
    forced_on: &Tensor,
    tok: &Tensor,
    lp: &Tensor,
    l: super::Launch,
) -> Result<Tensor> {
    let (rows, vocab) = logits.dims2()?;
    for (t, dt) in [
        (forced, DType::U32),
        (forced_on, DType::U32),
        (tok, DType::F32),
        (lp, DType::F32),
    ] {
        check(t.elem_count() == rows && t.dtype() == dt, || {
            format!(
                "greedy rows buffer {:?} {:?} for {rows} rows",
                t.dims(),
                t.dtype()
            )
        })?;
    }
    let dev = cuda(logits)?;
    let blocks = head_blocks(vocab);
    let part = empty(&[rows * 3 * blocks], DType::F32, logits)?;
    let ids = empty(&[rows], DType::U32, logits)?;
    head_parts(logits, &part, blocks, l)?;
    let args = [
        P(ptr(&part)?),
        I(blocks as i32),
        P(ptr(logits)?),
        I(vocab as i32),
        P(ptr(forced)?),
        P(ptr(forced_on)?),
        P(ptr(&ids)?),
        P(ptr(tok)?),
        P(ptr(lp)?),
    ];
    launch(
        l.pdl,
        dev,
        "specsplit_greedy_rows_finish",
        rows as u32,
        32,
        &args,
    )?;
    Ok(ids)
}

pub(super) fn top_rows(logits: &Tensor, width: usize, l: super::Launch) -> Result<Tensor> {
    let (rows, vocab) = logits.dims2()?;
    check(rows > 0 && (1..=vocab).contains(&width), || {
        format!("top {width} of {:?} logits", logits.dims())
    })?;
    let dev = cuda(logits)?;
    // A private f32 copy: each round masks the logit it picked.
    let x = logits.to_dtype(DType::F32)?.copy()?;
    let blocks = head_blocks(vocab);
    let part = empty(&[rows * 3 * blocks], DType::F32, logits)?;
    let out = empty(&[rows, 2 * width + 1], DType::F32, logits)?;
    for j in 0..width {
        head_parts(&x, &part, blocks, l)?;
        let args = [
            P(ptr(&part)?),
            I(blocks as i32),
            P(ptr(&x)?),
            I(vocab as i32),
            I(width as i32),
            I(j as i32),
            P(ptr(&out)?),
        ];
        launch(
            l.pdl,
            dev,
            "specsplit_top_rows_round_f32",
            rows as u32,
            32,
            &args,
        )?;
    }
    Ok(out)
}
