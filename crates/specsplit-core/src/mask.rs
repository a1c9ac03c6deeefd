//! Tree-attention masks and position ids.
//!
//! With a prefix of length `L` already in the KV cache and a tree of `N` nodes appended after
//! it, row `i` of the mask (node `i`) sees every prefix column, the columns `L + j` of its
//! ancestors `j` and its own column `L + i`, and nothing else. Node `i` sits at position
//! `L + depth(i)`, as if its root-to-node path had been appended to the prefix alone.

use candle_core::{DType, Device, Tensor};

use crate::tree::TokenTree;

/// Ancestor structure of one tree, built once per verification round.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TreeMask {
    depths: Vec<usize>,
    /// `path_start[i]..path_start[i + 1]` indexes `paths` with node `i`'s root-to-node path.
    path_start: Vec<usize>,
    /// Concatenated root-to-node paths (ascending node indices, ending with the node itself).
    paths: Vec<usize>,
}

impl TreeMask {
    /// Builds the ancestor structure of `tree` in O(N · depth).
    pub fn new(tree: &TokenTree) -> Self {
        Self::from_parents(tree.parents()).expect("a token tree's parents precede their children")
    }

    /// Builds the ancestor structure of a forest given by each node's parent, in O(N · depth).
    /// Nodes need not be breadth-first (a forest grown pass by pass, whose branches start at
    /// different depths, is not), but every parent must precede its children; `None` when one
    /// does not.
    pub fn from_parents(parents: &[Option<usize>]) -> Option<Self> {
        let n = parents.len();
        let mut depths = Vec::with_capacity(n);
        let mut path_start = Vec::with_capacity(n + 1);
        let mut paths = Vec::new();
        for (i, &parent) in parents.iter().enumerate() {
            path_start.push(paths.len());
            match parent {
                Some(p) if p >= i => return None,
                Some(p) => {
                    paths.extend_from_within(path_start[p]..path_start[p + 1]);
                    depths.push(depths[p] + 1);
                }
                None => depths.push(0),
            }
            paths.push(i);
        }
        path_start.push(paths.len());
        Some(TreeMask {
            depths,
            path_start,
            paths,
        })
    }

    /// Number of tree nodes (mask rows).
    pub fn len(&self) -> usize {
        self.depths.len()
    }

    /// Whether the tree had no node.
    pub fn is_empty(&self) -> bool {
        self.depths.is_empty()
    }

    /// Root-to-node path of node `i` (ascending indices; panics if `i >= len()`).
    pub fn ancestors_and_self(&self, i: usize) -> &[usize] {
        &self.paths[self.path_start[i]..self.path_start[i + 1]]
    }

    /// Whether node `row` attends to node `col` inside the tree block (ancestor or itself).
    /// Prefix columns are always visible. Out-of-range indices give `false`.
    pub fn is_visible(&self, row: usize, col: usize) -> bool {
        row < self.len() && col <= row && self.ancestors_and_self(row).binary_search(&col).is_ok()
    }

    /// Position ids `prefix_len + depth(i)` (saturating at `u32::MAX`).
    pub fn positions(&self, prefix_len: usize) -> Vec<u32> {
        self.depths
            .iter()
            .map(|&d| u32::try_from(prefix_len.saturating_add(d)).unwrap_or(u32::MAX))
            .collect()
    }

    /// Position ids as a `u32` tensor of shape `(N,)` on `device`.
    pub fn positions_tensor(
        &self,
        prefix_len: usize,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let pos = self.positions(prefix_len);
        let n = pos.len();
        Tensor::from_vec(pos, n, device)
    }

    /// Host data of the `N × N` tree block, row-major, additive form (0 visible, -inf hidden).
    pub fn block_data(&self) -> Vec<f32> {
        let n = self.len();
        let mut block = vec![f32::NEG_INFINITY; n * n];
        for i in 0..n {
            let row = &mut block[i * n..(i + 1) * n];
            for &j in self.ancestors_and_self(i) {
                row[j] = 0.0;
            }
        }
        block
    }

    /// The additive mask of shape `(N, prefix_len + N)` in `dtype` on `device`: only the tree
    /// block is uploaded; the prefix columns are zeros created on the device.
    pub fn to_tensor(
        &self,
        prefix_len: usize,
        dtype: DType,
        device: &Device,
    ) -> candle_core::Result<Tensor> {
        let n = self.len();
        let block = Tensor::from_vec(self.block_data(), (n, n), device)?.to_dtype(dtype)?;
        if prefix_len == 0 {
            return Ok(block);
        }
        let prefix = Tensor::zeros((n, prefix_len), dtype, device)?;
        Tensor::cat(&[&prefix, &block], 1)
    }
}

/// Causal prefill mask of shape `(n_new, prefix_len + n_new)`: new token `r` sees the prefix,
/// the new tokens before it and itself (additive form in `dtype`).
pub fn causal_mask(
    n_new: usize,
    prefix_len: usize,
    dtype: DType,
    device: &Device,
) -> candle_core::Result<Tensor> {
    let cols = prefix_len + n_new;
    let mut data = vec![0.0f32; n_new * cols];
    for r in 0..n_new {
        for v in &mut data[r * cols + prefix_len + r + 1..(r + 1) * cols] {
            *v = f32::NEG_INFINITY;
        }
    }
    Tensor::from_vec(data, (n_new, cols), device)?.to_dtype(dtype)
}
