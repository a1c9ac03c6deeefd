//! Device memory the fused kernels' outputs are carved from while a step is captured into a
//! CUDA graph: a [`counting`] run sizes it, a [`carving`] run (the capture) takes its outputs
//! from it in order.

use candle_core::{DType, Result, Tensor};

/// Device memory the fused kernels' outputs are carved from while a step is captured into a
/// CUDA graph ([`carving`]), so that the graph holds no allocation or free nodes between its
/// kernels (kernels next to each other can then overlap under [`pdl`]). Sized by a
/// [`counting`] run of the same step; the graph keeps using it, so it lives as long as the
/// graph.
#[derive(Debug)]
pub struct Scratch {
    bf16: Tensor,
    f32: Tensor,
}

/// What a [`counting`] run's fused kernels allocated, in elements of each dtype (each output
/// rounded up to 16 bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ScratchNeed {
    /// bf16 elements.
    pub bf16: usize,
    /// f32 elements.
    pub f32: usize,
}

impl ScratchNeed {
    /// Bytes a [`Scratch`] for this need holds.
    pub fn bytes(&self) -> usize {
        self.bf16.max(8) * 2 + self.f32.max(4) * 4
    }
}

enum ScratchMode {
    Count(ScratchNeed),
    Carve {
        bf16: (Tensor, usize),
        f32: (Tensor, usize),
    },
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Option<ScratchMode>> = const { std::cell::RefCell::new(None) };
}

/// Clears this thread's scratch mode when dropped (also on unwinding).
struct ScratchGuard;

impl Drop for ScratchGuard {
    fn drop(&mut self) {
        SCRATCH.with(|m| m.borrow_mut().take());
    }
}

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
pub(super) fn scratch_output(shape: &[usize], dtype: DType) -> Result<Option<Tensor>> {
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
