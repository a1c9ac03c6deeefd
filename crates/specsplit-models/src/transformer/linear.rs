//! The projections and the embedding of the model: dense, CUDA-quantized or CPU-quantized
//! weights, and the fused Q|K|V and gate|up matrices.

use crate::fused::KernelOptions;
use crate::ModelError;
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Device, Module, Tensor};
use std::sync::Arc;

/// A projection `y = x W^T (+ b)` with dense or GGUF-quantized weights.
#[derive(Debug, Clone)]
pub(super) enum Linear {
    Dense {
        w: Tensor,
        b: Option<Tensor>,
    },
    /// candle's quantized product (CUDA).
    Quant {
        w: QMatMul,
        b: Option<Tensor>,
    },
    /// The batch-invariant quantized product of the CPU ([`crate::cpu_quant`]).
    QuantCpu {
        w: Arc<crate::cpu_quant::QuantMatrix>,
        b: Option<Tensor>,
    },
}

impl Linear {
    /// `x`: `(n, in)` → `(n, out)`, with the kernels `k` allows.
    pub(super) fn forward(&self, x: &Tensor, k: &KernelOptions) -> candle_core::Result<Tensor> {
        let (y, b) = match self {
            // A pass of a few rows on CUDA in bf16: the batch-invariant product, so a row's
            // result does not depend on how many rows share the pass.
            Self::Dense { w, b } if k.batch_invariant && bi_wanted(x, w) => {
                return crate::fused::bi_matmul(&x.contiguous()?, w, b.as_ref(), k.launch())
            }
            // Several rows on the CPU: one product per row (see `dense_rows_cpu`).
            Self::Dense { w, b } if x.device().is_cpu() && x.dim(0)? > 1 => {
                (dense_rows_cpu(x, w)?, b)
            }
            Self::Dense { w, b } => (x.matmul(&w.t()?)?, b),
            Self::Quant { w, b } if x.device().is_cuda() => (quant_fixed_width(w, x)?, b),
            Self::Quant { w, b } => (w.forward(x)?, b),
            Self::QuantCpu { w, b } => (w.forward(x)?, b),
        };
        match b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }
}

/// `x W^T` on the CPU for `x` of several rows, as one single-row product per row. candle's CPU
/// gemm sums a row in a different order when the pass has one row (a matrix-vector product)
/// than when it has several, so a token decoded alone and the same token verified inside a
/// tree would get different bits; computing every row as the one-row product makes a row's
/// result independent of the number of rows in its pass.
fn dense_rows_cpu(x: &Tensor, w: &Tensor) -> candle_core::Result<Tensor> {
    let wt = w.t()?;
    let x = x.contiguous()?;
    let rows = (0..x.dim(0)?)
        .map(|r| x.narrow(0, r, 1)?.matmul(&wt))
        .collect::<candle_core::Result<Vec<_>>>()?;
    Tensor::cat(&rows, 0)
}

impl Linear {
    /// Whether the weights are quantized.
    pub(super) fn is_quantized(&self) -> bool {
        matches!(self, Self::Quant { .. } | Self::QuantCpu { .. })
    }
}

/// Whether `x W^T` can run [`crate::fused::bi_matmul`] (with batch invariance on): a bf16 CUDA
/// pass of at most [`crate::fused::BI_MAX_ROWS`] rows, and a weight whose width is a multiple
/// of 32.
fn bi_wanted(x: &Tensor, w: &Tensor) -> bool {
    crate::fused::applies(x)
        && matches!((x.dims(), w.dims()), ([m, k], [_, kw]) if *m <= crate::fused::BI_MAX_ROWS && k == kw && k.is_multiple_of(32))
        && crate::fused::weight_fits(w)
}

/// Several projections of the same input: fused into one matrix when every part is dense (one
/// matmul and one bias add instead of one each per part), kept apart otherwise.
#[derive(Debug, Clone)]
pub(super) enum Proj {
    /// `[W_1; W_2; …]` stacked by rows; the output columns split back by `sizes`.
    Fused { lin: Linear, sizes: Vec<usize> },
    /// One projection per part.
    Split(Vec<Linear>),
}

impl Proj {
    /// Fuses `parts` when all are dense (biases all present or all absent).
    pub(super) fn new(parts: Vec<Linear>) -> candle_core::Result<Self> {
        let dense: Option<Vec<(&Tensor, Option<&Tensor>)>> = parts
            .iter()
            .map(|l| match l {
                Linear::Dense { w, b } => Some((w, b.as_ref())),
                Linear::Quant { .. } | Linear::QuantCpu { .. } => None,
            })
            .collect();
        let Some(dense) = dense else {
            return Ok(Self::Split(parts));
        };
        let with_bias = dense.iter().filter(|(_, b)| b.is_some()).count();
        if parts.len() < 2 || (with_bias != 0 && with_bias != dense.len()) {
            return Ok(Self::Split(parts));
        }
        let sizes = dense
            .iter()
            .map(|(w, _)| w.dim(0))
            .collect::<Result<_, _>>()?;
        let ws: Vec<&Tensor> = dense.iter().map(|(w, _)| *w).collect();
        let w = Tensor::cat(&ws, 0)?;
        let b = if with_bias == 0 {
            None
        } else {
            let bs: Vec<&Tensor> = dense.iter().filter_map(|(_, b)| *b).collect();
            Some(Tensor::cat(&bs, 0)?)
        };
        Ok(Self::Fused {
            lin: Linear::Dense { w, b },
            sizes,
        })
    }

    /// `x`: `(n, in)` → one `(n, out_i)` output per part (column views of one product when
    /// fused).
    pub(super) fn forward(
        &self,
        x: &Tensor,
        k: &KernelOptions,
    ) -> candle_core::Result<Vec<Tensor>> {
        match self {
            Self::Split(parts) => parts.iter().map(|l| l.forward(x, k)).collect(),
            Self::Fused { lin, sizes } => {
                let y = lin.forward(x, k)?;
                let mut out = Vec::with_capacity(sizes.len());
                let mut at = 0;
                for &s in sizes {
                    out.push(y.narrow(1, at, s)?);
                    at += s;
                }
                Ok(out)
            }
        }
    }
}

/// A quantized projection of `q` (weights `(out, in)`) on `device`: on the CPU the blocks move
/// into a batch-invariant [`crate::cpu_quant::QuantMatrix`] (`q` is dropped when this was its
/// last reference) and F32/F16/BF16 tensors become dense f32 matrices; on CUDA candle's
/// `QMatMul`.
pub(super) fn quant_linear(
    q: Arc<QTensor>,
    b: Option<Tensor>,
    device: &Device,
) -> Result<Linear, ModelError> {
    if device.is_cpu() {
        let dense = match q.dtype() {
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
                Some(q.dequantize(device)?.to_dtype(DType::F32)?)
            }
            _ => None,
        };
        return Ok(match dense {
            Some(w) => Linear::Dense { w, b },
            None => match crate::cpu_quant::QuantMatrix::from_qtensor(q)? {
                Some(w) => Linear::QuantCpu { w: Arc::new(w), b },
                None => return Err(ModelError::Weights("a dense GGUF weight".into())),
            },
        });
    }
    Ok(Linear::Quant {
        w: QMatMul::from_arc(q)?,
        b,
    })
}

/// Rows per quantized CUDA matmul: candle picks its CUDA kernel (and launch shape, which changes
/// rounding) by batch size, so every pass uses this one width.
const QUANT_CUDA_ROWS: usize = 8;

/// A quantized projection on CUDA computed in chunks of exactly [`QUANT_CUDA_ROWS`] rows (the
/// last chunk padded with zeros), so a row's result never depends on how many rows share the
/// pass: decoding one token and verifying it inside a tree give identical logits.
fn quant_fixed_width(w: &QMatMul, x: &Tensor) -> candle_core::Result<Tensor> {
    let (n, d) = x.dims2()?;
    let mut outs = Vec::with_capacity(n.div_ceil(QUANT_CUDA_ROWS));
    let mut start = 0;
    while start < n {
        let len = QUANT_CUDA_ROWS.min(n - start);
        let chunk = x.narrow(0, start, len)?;
        let chunk = if len < QUANT_CUDA_ROWS {
            let pad = Tensor::zeros((QUANT_CUDA_ROWS - len, d), x.dtype(), x.device())?;
            Tensor::cat(&[&chunk, &pad], 0)?
        } else {
            chunk.contiguous()?
        };
        outs.push(w.forward(&chunk)?.narrow(0, 0, len)?);
        start += len;
    }
    if outs.len() == 1 {
        Ok(outs.pop().expect("one chunk"))
    } else {
        Tensor::cat(&outs, 0)
    }
}

/// The token embedding: a dense matrix or a quantized one (rows dequantized on lookup).
#[derive(Debug, Clone)]
pub(super) enum Embedding {
    Dense(Tensor),
    Quant(Arc<QTensor>),
    /// Blocks shared with a tied CPU head.
    QuantCpu(Arc<crate::cpu_quant::QuantMatrix>),
}

impl Embedding {
    pub(super) fn forward(&self, tokens: &Tensor, dtype: DType) -> candle_core::Result<Tensor> {
        match self {
            Self::Dense(e) => e.index_select(tokens, 0),
            Self::Quant(q) => q.embedding(tokens)?.to_dtype(dtype),
            Self::QuantCpu(q) => q.embedding(tokens)?.to_dtype(dtype),
        }
    }
}
