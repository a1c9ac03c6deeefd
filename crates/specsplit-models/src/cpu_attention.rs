//! Batch-invariant attention for the CPU.
//!
//! Speculative greedy decoding must emit exactly what the target alone emits. On the CPU this
//! means a token's attention output must be bit-identical whether the token is decoded alone or
//! verified inside a batch of tree nodes, with other (masked) keys around it. General matmul
//! kernels do not promise that: their rounding depends on the batch shape and on how many keys
//! there are, and quantized models amplify a last-bit difference (their 8-bit activation
//! rounding can turn it into a visible change of the logits).
//!
//! This computes each (query row, head) as its own m = 1 product over exactly the keys the row
//! may see, in increasing cache order — for a tree node: the prefix, then its ancestors, which
//! is the order the same tokens have when decoded one by one. So a token's result depends only
//! on its query and its visible keys' values, never on the batch.

use candle_core::{DType, Tensor};

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

/// The keys one row attends to: a leading range of the cache, or an explicit ascending list.
enum Keys {
    Leading(usize),
    Gather(Vec<u32>),
}

/// The visible keys of every row of one forward pass, computed once per pass (reading a mask
/// costs a device-to-host copy) and shared by all layers.
pub struct RowKeys(Vec<Keys>);

impl RowKeys {
    /// The visible keys of the `n` new rows under `vis`.
    pub fn new(vis: Visibility<'_>, n: usize) -> Result<Self, ModelError> {
        let keys: Vec<Keys> = match vis {
            Visibility::Causal { past } => (0..n).map(|i| Keys::Leading(past + i + 1)).collect(),
            Visibility::Mask(m) => {
                let rows: Vec<Vec<f32>> = m.to_dtype(DType::F32)?.to_vec2()?;
                rows.iter()
                    .map(|r| {
                        let idx: Vec<u32> = r
                            .iter()
                            .enumerate()
                            .filter(|(_, &x)| x == 0.0)
                            .map(|(j, _)| j as u32)
                            .collect();
                        if idx.iter().enumerate().all(|(a, &b)| a as u32 == b) {
                            Keys::Leading(idx.len())
                        } else {
                            Keys::Gather(idx)
                        }
                    })
                    .collect()
            }
        };
        if keys.len() != n {
            return Err(ModelError::Input(format!(
                "mask has {} rows for {n} tokens",
                keys.len()
            )));
        }
        Ok(Self(keys))
    }

    /// Per row: the length `lead` of its leading run of visible slots `0..lead`, and its
    /// visible slots after that run (ascending).
    pub fn split_rows(&self) -> Vec<(usize, &[u32])> {
        self.0
            .iter()
            .map(|k| match k {
                Keys::Leading(len) => (*len, &[][..]),
                Keys::Gather(idx) => {
                    let lead = idx
                        .iter()
                        .enumerate()
                        .take_while(|(a, &b)| *a as u32 == b)
                        .count();
                    (lead, &idx[lead..])
                }
            })
            .collect()
    }
}

/// Attention of `q` (1, heads, n, hd) over the cache views `k`, `v` (1, kv, total, hd), with
/// `heads / kv` query heads per key head and each row's visible keys in `keys`. Returns
/// (1, heads, n, hd).
///
/// Every (row, head) is one m = 1 product over exactly its visible keys — the computation a
/// token gets when it is decoded alone (and the one candle's reference models do per decoded
/// token) — so results do not depend on the batch. Rows whose visible keys are a leading range
/// of the cache read it in place; a tree node's prefix-plus-ancestors set is gathered.
pub fn attention(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    keys: &RowKeys,
    scale: f64,
) -> Result<Tensor, ModelError> {
    let (_, heads, n, hd) = q.dims4()?;
    let (_, kv, total, khd) = k.dims4()?;
    if khd != hd || v.dims() != k.dims() || heads % kv != 0 || keys.0.len() != n {
        return Err(ModelError::Input(format!(
            "attention shapes q {:?} k {:?} v {:?} for {} rows of keys",
            q.dims(),
            k.dims(),
            v.dims(),
            keys.0.len()
        )));
    }
    let rep = heads / kv;
    let mut rows = Vec::with_capacity(n);
    for (i, ks) in keys.0.iter().enumerate() {
        let (ki, vi) = match ks {
            Keys::Leading(0) => {
                return Err(ModelError::Input(format!("row {i} sees no key")));
            }
            Keys::Leading(len) if *len <= total => (k.narrow(2, 0, *len)?, v.narrow(2, 0, *len)?),
            Keys::Leading(len) => {
                return Err(ModelError::Input(format!(
                    "row {i} sees {len} keys of {total}"
                )));
            }
            Keys::Gather(idx) => {
                // Copy the visible keys' maximal contiguous runs, in order.
                let mut ks = Vec::new();
                let mut vs = Vec::new();
                let mut start = 0;
                for e in 1..=idx.len() {
                    if e == idx.len() || idx[e] != idx[e - 1] + 1 {
                        let (from, len) = (idx[start] as usize, e - start);
                        if from + len > total {
                            return Err(ModelError::Input(format!(
                                "row {i} sees key {} of {total}",
                                from + len - 1
                            )));
                        }
                        ks.push(k.narrow(2, from, len)?);
                        vs.push(v.narrow(2, from, len)?);
                        start = e;
                    }
                }
                if ks.is_empty() {
                    return Err(ModelError::Input(format!("row {i} sees no key")));
                }
                (Tensor::cat(&ks, 2)?, Tensor::cat(&vs, 2)?)
            }
        };
        let kt = ki.t()?;
        let qi = q.narrow(2, i, 1)?.reshape((1, kv, rep, hd))?;
        let mut ys = Vec::with_capacity(rep);
        for r in 0..rep {
            let att = (qi.narrow(2, r, 1)?.matmul(&kt)? * scale)?;
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            ys.push(att.matmul(&vi)?);
        }
        rows.push(Tensor::cat(&ys, 2)?.reshape((1, heads, 1, hd))?);
    }
    Ok(Tensor::cat(&rows, 2)?)
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
            .map(|d| {
                (e.iter()
                    .zip(vals)
                    .map(|(w, v)| w * v[d] as f64)
                    .sum::<f64>()
                    / z) as f32
            })
            .collect()
    }

    #[test]
    fn split_rows_gives_each_rows_leading_run_and_the_slots_after_it() {
        let dev = Device::Cpu;
        let ninf = f32::NEG_INFINITY;
        // Three cached tokens, then a tree: node 0, node 1 (child of 0), node 2 (sibling of 0).
        let mask = Tensor::new(
            &[
                [0f32, 0., 0., 0., ninf, ninf],
                [0., 0., 0., 0., 0., ninf],
                [0., 0., 0., ninf, ninf, 0.],
            ],
            &dev,
        )
        .unwrap();
        let keys = RowKeys::new(Visibility::Mask(&mask), 3).unwrap();
        let rows = keys.split_rows();
        assert_eq!(rows, vec![(4, &[][..]), (5, &[][..]), (3, &[5u32][..])]);
        let causal = RowKeys::new(Visibility::Causal { past: 2 }, 2).unwrap();
        assert_eq!(causal.split_rows(), vec![(3, &[][..]), (4, &[][..])]);
    }

    #[test]
    fn matches_naive_attention_and_is_batch_invariant() {
        let dev = Device::Cpu;
        let (heads, kv, hd, cap) = (4, 2, 12, 16);
        let kc = Tensor::randn(0f32, 1.0, (1, kv, cap, hd), &dev).unwrap();
        let vc = Tensor::randn(0f32, 1.0, (1, kv, cap, hd), &dev).unwrap();
        let total = 9;
        let (k, v) = (
            kc.narrow(2, 0, total).unwrap(),
            vc.narrow(2, 0, total).unwrap(),
        );
        let q = Tensor::randn(0f32, 1.0, (1, heads, 3, hd), &dev).unwrap();
        // Rows: a causal pass of 3 tokens after 6 cached ones.
        let batch = attention(
            &q,
            &k,
            &v,
            &RowKeys::new(Visibility::Causal { past: 6 }, 3).unwrap(),
            0.3f64,
        )
        .unwrap();
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
                    &RowKeys::new(Visibility::Causal { past: 6 + i }, 1).unwrap(),
                    0.3,
                )
                .unwrap();
                let a: Vec<Vec<Vec<f32>>> = alone.squeeze(0).unwrap().to_vec3().unwrap();
                assert_eq!(a[h][0], b[h][i]);
            }
        }
    }
}
