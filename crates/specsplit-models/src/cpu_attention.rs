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

use candle_core::{DType, Device, Tensor};
use specsplit_core::mask::TreeMask;

use crate::ModelError;

/// Which cached keys each new row may attend to.
#[derive(Clone, Copy)]
pub enum Visibility<'a> {
    /// Row `i` sees keys `0..past + i + 1` (a causal pass after `past` cached tokens).
    Causal {
        /// Tokens in the cache before this pass.
        past: usize,
    },
    /// An additive mask `(n, total)`: 0 where visible, -inf where hidden (read back to the host).
    Mask(&'a Tensor),
    /// Rows of a token tree, described on the host (no device mask is read).
    Tree(TreeRows<'a>),
}

/// The rows `first_row..first_row + n` of a token tree whose nodes sit in the cache right after
/// `prefix` slots, node `j` at slot `prefix + j`: row `i` sees slots `0..prefix` and the slots of
/// node `first_row + i`'s ancestors and itself. A whole tree verified in one pass has
/// `first_row` 0; one level of a tree drafted level by level starts at that level's first node.
#[derive(Debug, Clone, Copy)]
pub struct TreeRows<'a> {
    /// The tree's visibility.
    pub mask: &'a TreeMask,
    /// Cache slots before the tree's first node.
    pub prefix: usize,
    /// The tree node of the pass's first row.
    pub first_row: usize,
}

impl TreeRows<'_> {
    /// The additive mask `(n, prefix + first_row + n)` of these rows, for passes that need one
    /// on the device.
    pub fn to_tensor(&self, n: usize, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.mask
            .to_tensor(self.prefix, dtype, dev)?
            .narrow(0, self.first_row, n)?
            .narrow(1, 0, self.prefix + self.first_row + n)
    }
}

/// The keys one row attends to: slots `0..lead`, then the ascending slots `extra` (each past
/// `lead`).
struct Keys {
    lead: usize,
    extra: Vec<u32>,
}

impl Keys {
    /// From an ascending list of visible slots.
    fn from_slots(idx: Vec<u32>) -> Self {
        let lead = idx
            .iter()
            .enumerate()
            .take_while(|(a, &b)| *a as u32 == b)
            .count();
        Self {
            lead,
            extra: idx[lead..].to_vec(),
        }
    }
}

/// The visible keys of every row of one forward pass, computed once per pass (reading a mask
/// costs a device-to-host copy; a causal pass or a host-side tree costs none) and shared by all
/// layers.
pub struct RowKeys(Vec<Keys>);

impl RowKeys {
    /// The visible keys of the `n` new rows under `vis`.
    pub fn new(vis: Visibility<'_>, n: usize) -> Result<Self, ModelError> {
        let keys: Vec<Keys> = match vis {
            Visibility::Causal { past } => (0..n)
                .map(|i| Keys {
                    lead: past + i + 1,
                    extra: Vec::new(),
                })
                .collect(),
            Visibility::Mask(m) => {
                let rows: Vec<Vec<f32>> = m.to_dtype(DType::F32)?.to_vec2()?;
                rows.iter()
                    .map(|r| {
                        Keys::from_slots(
                            r.iter()
                                .enumerate()
                                .filter(|(_, &x)| x == 0.0)
                                .map(|(j, _)| j as u32)
                                .collect(),
                        )
                    })
                    .collect()
            }
            Visibility::Tree(t) => {
                if t.first_row + n > t.mask.len() {
                    return Err(ModelError::Input(format!(
                        "rows {}..{} of a {}-node tree",
                        t.first_row,
                        t.first_row + n,
                        t.mask.len()
                    )));
                }
                (t.first_row..t.first_row + n)
                    .map(|node| {
                        let anc = t.mask.ancestors_and_self(node);
                        let run = anc.iter().enumerate().take_while(|(a, &b)| *a == b).count();
                        Keys {
                            lead: t.prefix + run,
                            extra: anc[run..].iter().map(|&a| (t.prefix + a) as u32).collect(),
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
        self.0.iter().map(|k| (k.lead, &k.extra[..])).collect()
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
        // Copy the visible keys' maximal contiguous runs, in order: 0..lead, then extra's.
        let mut runs: Vec<(usize, usize)> = Vec::new();
        if ks.lead > 0 {
            runs.push((0, ks.lead));
        }
        let mut start = 0;
        for e in 1..=ks.extra.len() {
            if e == ks.extra.len() || ks.extra[e] != ks.extra[e - 1] + 1 {
                runs.push((ks.extra[start] as usize, e - start));
                start = e;
            }
        }
        if runs.is_empty() {
            return Err(ModelError::Input(format!("row {i} sees no key")));
        }
        if let Some(&(from, len)) = runs.iter().find(|(from, len)| from + len > total) {
            return Err(ModelError::Input(format!(
                "row {i} sees key {} of {total}",
                from + len - 1
            )));
        }
        let (ki, vi) = if let [(0, len)] = runs[..] {
            (k.narrow(2, 0, len)?, v.narrow(2, 0, len)?)
        } else {
            let mut kp = Vec::with_capacity(runs.len());
            let mut vp = Vec::with_capacity(runs.len());
            for &(from, len) in &runs {
                kp.push(k.narrow(2, from, len)?);
                vp.push(v.narrow(2, from, len)?);
            }
            (Tensor::cat(&kp, 2)?, Tensor::cat(&vp, 2)?)
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
