//! Batch-invariant quantized products for the CPU.
//!
//! Greedy speculation must emit exactly what the target alone emits, so a token's logits must
//! be bit-identical whether the target decodes it alone (a 1-row pass) or verifies it inside a
//! draft tree (a pass of many rows). candle's `QMatMul` on the CPU does not promise that: it
//! picks its kernel by the number of rows (on x86, Q6K weights use the compact dot products for
//! one row and repacked tiles for several; Q4K switches to AMX tiles from 32 rows where AMX
//! exists; on aarch64 the repacked kernels depend on the row count too), and the kernels sum in
//! different orders, so the same row gets different bits.
//!
//! A [`QuantMatrix`] holds a weight's GGUF blocks as a typed vector and computes `x W^T` with
//! candle's compact kernel (`k_quants::matmul`) for every row count. That kernel quantizes each
//! activation row on its own and computes every output element with the same dot product
//! (four, two or one columns at a time, chosen by the column alone) whatever the number of
//! rows; the row count only changes how the work is spread over threads. So a row's result
//! depends on that row and the weights alone.
//!
//! One exception is faster and just as exact: Q4K weights on x86-64 keep candle's repacked
//! tiles for passes of at most [`Q4K_TILE_ROWS`] rows (longer passes go through in chunks of
//! that many). Those kernels also quantize each row alone and give every row its own
//! accumulators, run through the same instructions whether a tile holds one row or four; the
//! only branch of candle's x86 product that depends on the row count for Q4K is its AMX kernel,
//! taken from 32 rows, which the chunks never reach.

use candle_core::quantized::k_quants::{
    self, BlockQ2K, BlockQ3K, BlockQ4K, BlockQ4_0, BlockQ4_1, BlockQ5K, BlockQ5_0, BlockQ5_1,
    BlockQ6K, BlockQ8K, BlockQ8_0, BlockQ8_1, GgmlType,
};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use std::sync::Arc;

/// The most rows one Q4K product takes on candle's repacked x86 tiles: fewer than the 32 rows
/// from which candle switches to AMX tiles (another summation order) on CPUs that have them.
pub const Q4K_TILE_ROWS: usize = 31;

use crate::ModelError;

/// A quantized weight's blocks, row-major (`rows × cols / block size`).
enum Blocks {
    Q4_0(Vec<BlockQ4_0>),
    Q4_1(Vec<BlockQ4_1>),
    Q5_0(Vec<BlockQ5_0>),
    Q5_1(Vec<BlockQ5_1>),
    Q8_0(Vec<BlockQ8_0>),
    Q8_1(Vec<BlockQ8_1>),
    Q2K(Vec<BlockQ2K>),
    Q3K(Vec<BlockQ3K>),
    Q4K(Vec<BlockQ4K>),
    Q5K(Vec<BlockQ5K>),
    Q6K(Vec<BlockQ6K>),
    Q8K(Vec<BlockQ8K>),
}

/// Runs `$body` with `$v` bound to the typed block vector of `$blocks`.
macro_rules! with_blocks {
    ($blocks:expr, $v:ident => $body:expr) => {
        match $blocks {
            Blocks::Q4_0($v) => $body,
            Blocks::Q4_1($v) => $body,
            Blocks::Q5_0($v) => $body,
            Blocks::Q5_1($v) => $body,
            Blocks::Q8_0($v) => $body,
            Blocks::Q8_1($v) => $body,
            Blocks::Q2K($v) => $body,
            Blocks::Q3K($v) => $body,
            Blocks::Q4K($v) => $body,
            Blocks::Q5K($v) => $body,
            Blocks::Q6K($v) => $body,
            Blocks::Q8K($v) => $body,
        }
    };
}

/// A quantized `(rows, cols)` weight on the CPU whose product `x W^T` gives every row the same
/// bits whatever the number of rows in the pass (see the module documentation).
pub struct QuantMatrix {
    rows: usize,
    cols: usize,
    kernel: Kernel,
}

/// How a [`QuantMatrix`] computes its products.
enum Kernel {
    /// candle's compact kernel over typed blocks.
    Compact(Blocks),
    /// candle's repacked Q4K tiles (x86-64), at most [`Q4K_TILE_ROWS`] rows a call.
    Q4KTiles(Arc<QTensor>),
}

impl std::fmt::Debug for QuantMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QuantMatrix")
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .field("dtype", &self.dtype())
            .finish()
    }
}

/// Copies `bytes` (candle's storage of a `rows × cols` weight of block type `T`) into a typed
/// vector, after checking that the widths are whole blocks and the byte count is exactly that
/// many blocks.
///
/// Only called with the GGUF block types of [`Blocks`]: `#[repr(C)]` structs of integer and
/// f16 fields without padding (candle asserts their sizes), for which every byte pattern is a
/// valid value.
fn typed<T: GgmlType>(bytes: &[u8], rows: usize, cols: usize) -> Result<Vec<T>, ModelError> {
    if cols == 0 || !cols.is_multiple_of(T::BLCK_SIZE) {
        return Err(ModelError::Weights(format!(
            "a {:?} weight needs a width that is a multiple of {}, got {cols}",
            T::DTYPE,
            T::BLCK_SIZE
        )));
    }
    let count = rows * (cols / T::BLCK_SIZE);
    let expected = count * std::mem::size_of::<T>();
    if bytes.len() != expected {
        return Err(ModelError::Weights(format!(
            "a {rows}×{cols} {:?} weight holds {} bytes, expected {expected}",
            T::DTYPE,
            bytes.len()
        )));
    }
    let mut blocks = vec![T::zeros(); count];
    // SAFETY: `blocks` owns exactly `expected` = `bytes.len()` bytes, aligned for `T`; the copy
    // is byte-wise (no alignment needed on the source) and the two buffers are distinct. The
    // result is a valid `T` for every byte pattern (see above).
    unsafe {
        std::ptr::copy_nonoverlapping(
            bytes.as_ptr(),
            blocks.as_mut_ptr().cast::<u8>(),
            bytes.len(),
        );
    }
    Ok(blocks)
}

impl QuantMatrix {
    /// A CPU `QTensor` of shape `(rows, cols)` (rows = output features) as a batch-invariant
    /// matrix: its blocks copied into a typed vector (the `QTensor` is dropped with the last
    /// reference to `q`), or, for Q4K on x86-64, kept for candle's repacked tiles. `Ok(None)` for
    /// F32/F16/BF16 tensors, which are plain matrices (load them dense).
    pub fn from_qtensor(q: Arc<QTensor>) -> Result<Option<Self>, ModelError> {
        let (rows, cols) = q
            .shape()
            .dims2()
            .map_err(|e| ModelError::Weights(format!("a quantized weight must be 2-D: {e}")))?;
        if cfg!(target_arch = "x86_64") && q.dtype() == GgmlDType::Q4K {
            // Whole blocks, as the compact kernel checks.
            if cols == 0 || !cols.is_multiple_of(GgmlDType::Q4K.block_size()) {
                return Err(ModelError::Weights(format!(
                    "a Q4K weight needs a width that is a multiple of {}, got {cols}",
                    GgmlDType::Q4K.block_size()
                )));
            }
            if !q.device().is_cpu() {
                return Err(ModelError::Weights("a QuantMatrix is for the CPU".into()));
            }
            return Ok(Some(Self {
                rows,
                cols,
                kernel: Kernel::Q4KTiles(q),
            }));
        }
        let bytes = q.data()?;
        let b = bytes.as_ref();
        let blocks = match q.dtype() {
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => return Ok(None),
            GgmlDType::Q4_0 => Blocks::Q4_0(typed(b, rows, cols)?),
            GgmlDType::Q4_1 => Blocks::Q4_1(typed(b, rows, cols)?),
            GgmlDType::Q5_0 => Blocks::Q5_0(typed(b, rows, cols)?),
            GgmlDType::Q5_1 => Blocks::Q5_1(typed(b, rows, cols)?),
            GgmlDType::Q8_0 => Blocks::Q8_0(typed(b, rows, cols)?),
            GgmlDType::Q8_1 => Blocks::Q8_1(typed(b, rows, cols)?),
            GgmlDType::Q2K => Blocks::Q2K(typed(b, rows, cols)?),
            GgmlDType::Q3K => Blocks::Q3K(typed(b, rows, cols)?),
            GgmlDType::Q4K => Blocks::Q4K(typed(b, rows, cols)?),
            GgmlDType::Q5K => Blocks::Q5K(typed(b, rows, cols)?),
            GgmlDType::Q6K => Blocks::Q6K(typed(b, rows, cols)?),
            GgmlDType::Q8K => Blocks::Q8K(typed(b, rows, cols)?),
        };
        Ok(Some(Self {
            rows,
            cols,
            kernel: Kernel::Compact(blocks),
        }))
    }

    /// Output features (rows of `W`).
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features (columns of `W`).
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The GGUF block type.
    pub fn dtype(&self) -> GgmlDType {
        let blocks = match &self.kernel {
            Kernel::Compact(b) => b,
            Kernel::Q4KTiles(_) => return GgmlDType::Q4K,
        };
        match blocks {
            Blocks::Q4_0(_) => GgmlDType::Q4_0,
            Blocks::Q4_1(_) => GgmlDType::Q4_1,
            Blocks::Q5_0(_) => GgmlDType::Q5_0,
            Blocks::Q5_1(_) => GgmlDType::Q5_1,
            Blocks::Q8_0(_) => GgmlDType::Q8_0,
            Blocks::Q8_1(_) => GgmlDType::Q8_1,
            Blocks::Q2K(_) => GgmlDType::Q2K,
            Blocks::Q3K(_) => GgmlDType::Q3K,
            Blocks::Q4K(_) => GgmlDType::Q4K,
            Blocks::Q5K(_) => GgmlDType::Q5K,
            Blocks::Q6K(_) => GgmlDType::Q6K,
            Blocks::Q8K(_) => GgmlDType::Q8K,
        }
    }

    /// `x W^T` for `x` of shape `(m, cols)` (f32, or converted to f32) on the CPU: f32
    /// `(m, rows)`, each row computed from that row of `x` alone.
    pub fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let (m, k) = x.dims2()?;
        if k != self.cols {
            candle_core::bail!(
                "a product with a {}×{} weight got rows of width {k}",
                self.rows,
                self.cols
            );
        }
        if !x.device().is_cpu() {
            candle_core::bail!("QuantMatrix runs on the CPU only");
        }
        let x = x.to_dtype(DType::F32)?.contiguous()?;
        let blocks = match &self.kernel {
            Kernel::Compact(b) => b,
            Kernel::Q4KTiles(q) => {
                let q: &QTensor = q;
                if m <= Q4K_TILE_ROWS {
                    return x.apply_op1_no_bwd(q);
                }
                let parts = (0..m)
                    .step_by(Q4K_TILE_ROWS)
                    .map(|r| {
                        x.narrow(0, r, Q4K_TILE_ROWS.min(m - r))?
                            .contiguous()?
                            .apply_op1_no_bwd(q)
                    })
                    .collect::<candle_core::Result<Vec<_>>>()?;
                return Tensor::cat(&parts, 0);
            }
        };
        let n = self.rows;
        let mut dst = vec![0f32; m * n];
        {
            let (storage, layout) = x.storage_and_layout();
            let candle_core::Storage::Cpu(cpu) = &*storage else {
                candle_core::bail!("QuantMatrix runs on the CPU only");
            };
            let start = layout.start_offset();
            let lhs = &cpu.as_slice::<f32>()?[start..start + m * k];
            with_blocks!(blocks, w => k_quants::matmul((m, k, n), lhs, w.as_slice(), &mut dst)?);
        }
        Tensor::from_vec(dst, (m, n), &Device::Cpu)
    }

    /// The dequantized rows `ids` (a 1-D u32 tensor): f32 `(ids.len(), cols)`, as an embedding
    /// lookup. An id past the last row is an error.
    pub fn embedding(&self, ids: &Tensor) -> candle_core::Result<Tensor> {
        let blocks = match &self.kernel {
            Kernel::Compact(b) => b,
            Kernel::Q4KTiles(q) => {
                let n = ids.dims1()?;
                if let Some(&id) = ids
                    .to_vec1::<u32>()?
                    .iter()
                    .find(|&&i| i as usize >= self.rows)
                {
                    candle_core::bail!("token id {id} is past the {} embedding rows", self.rows);
                }
                return q.embedding(ids)?.reshape((n, self.cols));
            }
        };
        let ids = ids.to_device(&Device::Cpu)?.to_vec1::<u32>()?;
        let cols = self.cols;
        let mut out = vec![0f32; ids.len() * cols];
        with_blocks!(blocks, w => {
            let per_row = w.len() / self.rows.max(1);
            for (dst, &id) in out.chunks_exact_mut(cols).zip(&ids) {
                let id = id as usize;
                if id >= self.rows {
                    candle_core::bail!("token id {id} is past the {} embedding rows", self.rows);
                }
                GgmlType::to_float(&w[id * per_row..(id + 1) * per_row], dst);
            }
        });
        Tensor::from_vec(out, (ids.len(), cols), &Device::Cpu)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn weight(rows: usize, cols: usize) -> Tensor {
        let data: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0) - 0.5)
            .collect();
        Tensor::from_vec(data, (rows, cols), &Device::Cpu).unwrap()
    }

    #[test]
    fn products_and_rows_match_candles_compact_kernel() {
        let w = weight(48, 256);
        // More rows than one Q4K tile call takes.
        let x = weight(Q4K_TILE_ROWS + 3, 256);
        for dtype in [
            GgmlDType::Q4_0,
            GgmlDType::Q4K,
            GgmlDType::Q6K,
            GgmlDType::Q8K,
        ] {
            let q = QTensor::quantize(&w, dtype).unwrap();
            let q = Arc::new(q);
            let m = QuantMatrix::from_qtensor(q.clone()).unwrap().unwrap();
            assert_eq!((m.rows(), m.cols(), m.dtype()), (48, 256, dtype));
            let y = m.forward(&x).unwrap();
            assert_eq!(y.dims(), [Q4K_TILE_ROWS + 3, 48]);
            // Every row equals the same row's product alone, and is close to the dense product.
            let y: Vec<Vec<f32>> = y.to_vec2().unwrap();
            for (r, row) in y.iter().enumerate() {
                let alone: Vec<Vec<f32>> = m
                    .forward(&x.narrow(0, r, 1).unwrap())
                    .unwrap()
                    .to_vec2()
                    .unwrap();
                assert_eq!(&alone[0], row, "{dtype:?} row {r}");
            }
            let dense: Vec<Vec<f32>> = x
                .matmul(&q.dequantize(&Device::Cpu).unwrap().t().unwrap())
                .unwrap()
                .to_vec2()
                .unwrap();
            let err = y
                .iter()
                .flatten()
                .zip(dense.iter().flatten())
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(
                err < 0.5,
                "{dtype:?}: max error {err} against the dense product"
            );
            // Embedding rows are the dequantized weight rows.
            let e: Vec<Vec<f32>> = m
                .embedding(&Tensor::new(&[5u32, 0], &Device::Cpu).unwrap())
                .unwrap()
                .to_vec2()
                .unwrap();
            let d: Vec<Vec<f32>> = q.dequantize(&Device::Cpu).unwrap().to_vec2().unwrap();
            assert_eq!(e, vec![d[5].clone(), d[0].clone()]);
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        let q = QTensor::quantize(&weight(16, 256), GgmlDType::Q8_0).unwrap();
        let m = QuantMatrix::from_qtensor(Arc::new(q)).unwrap().unwrap();
        assert!(m.forward(&weight(2, 128)).is_err());
        let e = m
            .embedding(&Tensor::new(&[16u32], &Device::Cpu).unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("past the 16"), "{e}");
        let q4k = QTensor::quantize(&weight(16, 256), GgmlDType::Q4K).unwrap();
        let m = QuantMatrix::from_qtensor(Arc::new(q4k)).unwrap().unwrap();
        assert!(m.forward(&weight(2, 512)).is_err());
        let e = m
            .embedding(&Tensor::new(&[3u32, 16], &Device::Cpu).unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("past the 16"), "{e}");
        // A byte count that is not whole blocks of the shape is refused.
        assert!(typed::<BlockQ8_0>(&[0u8; 33], 1, 32).is_err());
        assert!(typed::<BlockQ8_0>(&[0u8; 34], 1, 16).is_err());
        assert_eq!(typed::<BlockQ8_0>(&[0u8; 68], 2, 32).unwrap().len(), 2);
        // Dense GGUF types are not block matrices.
        let f = QTensor::quantize(&weight(4, 32), GgmlDType::F32).unwrap();
        assert!(QuantMatrix::from_qtensor(Arc::new(f)).unwrap().is_none());
    }
}
