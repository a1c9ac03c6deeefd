//! Batch-invariant attention for the CPU.
//!
//! Speculative greedy decoding must emit exactly what the target alone emits. On the CPU this
//! means a token's attention output must be bit-identical whether the token is decoded alone or
//! verified inside a batch of tree nodes, with other (masked) keys around it. General matmul
//! kernels do not promise that: their rounding depends on the batch shape and on how many keys
//! there are, and quantized models amplify a last-bit difference (their 8-bit activation
//! rounding can turn it into a visible change of the logits).
//!
//! This kernel computes each (head, query row) independently, over exactly the keys the row may
//! see, in increasing cache order — for a tree node: the prefix, then its ancestors, which is
//! the order the same tokens have when decoded one by one — with fixed summation orders. So the
//! result depends only on the query and the visible keys' values, never on the batch.

use candle_core::{CpuStorage, DType, Storage, Tensor};
use rayon::prelude::*;

use crate::ModelError;

/// Which cached keys each new row may attend to.
pub enum Visibility<'a> {
    /// Row `i` sees keys `0..past + i + 1` (a causal pass after `past` cached tokens).
    Causal {
        /// Tokens in the cache before this pass.
        past: usize,
    },
    /// An additive mask `(n, total)`: 0 where visible, -inf where hidden.
    Mask(&'a Tensor),
}

const LANES: usize = 8;

/// Dot product with a fixed association: LANES interleaved partial sums combined in order.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; LANES];
    let chunks = a.len() / LANES;
    for c in 0..chunks {
        for l in 0..LANES {
            acc[l] += a[c * LANES + l] * b[c * LANES + l];
        }
    }
    let mut s = 0f32;
    for v in acc {
        s += v;
    }
    for i in chunks * LANES..a.len() {
        s += a[i] * b[i];
    }
    s
}

fn cpu_f32(t: &Tensor) -> Result<(Vec<usize>, usize), ModelError> {
    let (_, l) = t.storage_and_layout();
    Ok((l.stride().to_vec(), l.start_offset()))
}

/// Attention of `q` (1, heads, n, hd) over the cache views `k`, `v` (1, kv, total, hd), f32 on
/// the CPU, with `heads / kv` query heads per key head. Returns (1, heads, n, hd).
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    vis: Visibility<'_>,
    scale: f32,
) -> Result<Tensor, ModelError> {
    let (_, heads, n, hd) = q.dims4()?;
    let (_, kv, total, khd) = k.dims4()?;
    if khd != hd || v.dims() != k.dims() || heads % kv != 0 {
        return Err(ModelError::Input(format!(
            "attention shapes q {:?} k {:?} v {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    if q.dtype() != DType::F32 || k.dtype() != DType::F32 || v.dtype() != DType::F32 {
        return Err(ModelError::Input("exact CPU attention needs f32".into()));
    }
    let rep = heads / kv;
    let qv: Vec<f32> = q.flatten_all()?.to_vec1()?;
    // Visible key indices of each row, ascending.
    let visible: Vec<Vec<u32>> = match vis {
        Visibility::Causal { past } => (0..n).map(|i| (0..(past + i + 1) as u32).collect()).collect(),
        Visibility::Mask(m) => {
            let rows: Vec<Vec<f32>> = m.to_dtype(DType::F32)?.to_vec2()?;
            rows.iter()
                .map(|r| {
                    r.iter()
                        .enumerate()
                        .filter(|(_, &x)| x == 0.0)
                        .map(|(j, _)| j as u32)
                        .collect()
                })
                .collect()
        }
    };
    if visible.len() != n || visible.iter().any(|r| r.last().is_some_and(|&j| j as usize >= total)) {
        return Err(ModelError::Input("mask does not match the attention shape".into()));
    }
    let (ks, ko) = cpu_f32(k)?;
    let (vs, vo) = cpu_f32(v)?;
    if ks[3] != 1 || vs[3] != 1 {
        return Err(ModelError::Input("cache rows must be contiguous".into()));
    }
    let k_guard = k.storage_and_layout().0;
    let v_guard = v.storage_and_layout().0;
    let (kd, vd) = match (&*k_guard, &*v_guard) {
        (Storage::Cpu(CpuStorage::F32(kd)), Storage::Cpu(CpuStorage::F32(vd))) => (kd, vd),
        _ => return Err(ModelError::Input("exact CPU attention needs CPU f32 storage".into())),
    };
    let mut out = vec![0f32; heads * n * hd];
    out.par_chunks_mut(hd)
        .enumerate()
        .for_each(|(hi, o)| {
            let (h, i) = (hi / n, hi % n);
            let g = h / rep;
            let qrow = &qv[hi * hd..(hi + 1) * hd];
            let keys = &visible[i];
            if keys.is_empty() {
                return;
            }
            let krow = |j: usize| &kd[ko + g * ks[1] + j * ks[2]..][..hd];
            let vrow = |j: usize| &vd[vo + g * vs[1] + j * vs[2]..][..hd];
            let scores: Vec<f32> = keys.iter().map(|&j| dot(qrow, krow(j as usize)) * scale).collect();
            let max = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            let weights: Vec<f32> = scores
                .iter()
                .map(|&s| {
                    let e = (s - max).exp();
                    sum += e;
                    e
                })
                .collect();
            for (&j, &w) in keys.iter().zip(&weights) {
                let vr = vrow(j as usize);
                for d in 0..hd {
                    o[d] += w * vr[d];
                }
            }
            let inv = 1.0 / sum;
            for x in o.iter_mut() {
                *x *= inv;
            }
        });
    drop(k_guard);
    drop(v_guard);
    Ok(Tensor::from_vec(out, (1, heads, n, hd), q.device())?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Reference: plain attention of one row over an explicit list of keys.
    fn naive(q: &[f32], keys: &[&[f32]], vals: &[&[f32]], scale: f32) -> Vec<f32> {
        let s: Vec<f64> = keys
            .iter()
            .map(|k| q.iter().zip(*k).map(|(a, b)| (a * b) as f64).sum::<f64>() * scale as f64)
            .collect();
        let m = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = e.iter().sum();
        (0..q.len())
            .map(|d| (e.iter().zip(vals).map(|(w, v)| w * v[d] as f64).sum::<f64>() / z) as f32)
            .collect()
    }

    #[test]
    fn matches_naive_attention_and_is_batch_invariant() {
        let dev = Device::Cpu;
        let (heads, kv, hd, cap) = (4, 2, 12, 16);
        let kc = Tensor::randn(0f32, 1.0, (1, kv, cap, hd), &dev).unwrap();
        let vc = Tensor::randn(0f32, 1.0, (1, kv, cap, hd), &dev).unwrap();
        let total = 9;
        let (k, v) = (kc.narrow(2, 0, total).unwrap(), vc.narrow(2, 0, total).unwrap());
        let q = Tensor::randn(0f32, 1.0, (1, heads, 3, hd), &dev).unwrap();
        // Rows: a causal pass of 3 tokens after 6 cached ones.
        let batch = attention(&q, &k, &v, Visibility::Causal { past: 6 }, 0.3).unwrap();
        let kv_rows: Vec<Vec<Vec<f32>>> = k.squeeze(0).unwrap().to_vec3().unwrap();
        let vv_rows: Vec<Vec<Vec<f32>>> = v.squeeze(0).unwrap().to_vec3().unwrap();
        let qs: Vec<Vec<Vec<f32>>> = q.squeeze(0).unwrap().to_vec3().unwrap();
        let b: Vec<Vec<Vec<f32>>> = batch.squeeze(0).unwrap().to_vec3().unwrap();
        for h in 0..heads {
            for i in 0..3 {
                let g = h / (heads / kv);
                let keys: Vec<&[f32]> = (0..7 + i).map(|j| kv_rows[g][j].as_slice()).collect();
                let vals: Vec<&[f32]> = (0..7 + i).map(|j| vv_rows[g][j].as_slice()).collect();
                let want = naive(&qs[h][i], &keys, &vals, 0.3);
                for d in 0..hd {
                    assert!((b[h][i][d] - want[d]).abs() < 1e-5);
                }
                // The same row alone, over a shorter cache view, is bit-identical.
                let alone = attention(
                    &q.narrow(2, i, 1).unwrap(),
                    &kc.narrow(2, 0, 7 + i).unwrap(),
                    &vc.narrow(2, 0, 7 + i).unwrap(),
                    Visibility::Causal { past: 6 + i },
                    0.3,
                )
                .unwrap();
                let a: Vec<Vec<Vec<f32>>> = alone.squeeze(0).unwrap().to_vec3().unwrap();
                assert_eq!(a[h][0], b[h][i]);
            }
        }
    }
}
