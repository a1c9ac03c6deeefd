//! Tree-attention masks and position ids against brute-force ancestor sets.

mod common;

use candle_core::{DType, Device};
use common::{arb_shape, brute_path, build_tree};
use proptest::prelude::*;
use specsplit_core::mask::{causal_mask, TreeMask};
use specsplit_core::tree::TokenTree;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Every mask cell, the tensor form and the positions agree with explicit ancestor sets.
    #[test]
    fn mask_and_positions_match_brute_force((roots, extra) in arb_shape(48), prefix in 0usize..64) {
        let g = build_tree(roots, &extra, 50, false);
        let n = g.tree.len();
        let mask = TreeMask::new(&g.tree);
        prop_assert_eq!(mask.len(), n);
        let tensor = mask.to_tensor(prefix, DType::F32, &Device::Cpu).unwrap();
        prop_assert_eq!(tensor.dims(), &[n, prefix + n]);
        let rows = tensor.to_vec2::<f32>().unwrap();
        let positions = mask.positions(prefix);
        let pos_t = mask.positions_tensor(prefix, &Device::Cpu).unwrap().to_vec1::<u32>().unwrap();
        prop_assert_eq!(&pos_t, &positions);
        for i in 0..n {
            let anc = brute_path(&g.parents, i);
            prop_assert_eq!(positions[i] as usize, prefix + anc.len() - 1);
            prop_assert_eq!(mask.ancestors_and_self(i), &anc[..]);
            for (col, &v) in rows[i].iter().enumerate() {
                let visible = col < prefix || anc.contains(&(col - prefix));
                prop_assert_eq!(v, if visible { 0.0 } else { f32::NEG_INFINITY }, "row {} col {}", i, col);
                if col >= prefix {
                    prop_assert_eq!(mask.is_visible(i, col - prefix), visible);
                }
            }
        }
        prop_assert!(!mask.is_visible(n, 0));
    }

    /// A forest given by parents in any topological order (not breadth-first) has the
    /// ancestor sets and depths of brute force; a parent that does not precede its child is
    /// refused.
    #[test]
    fn masks_from_parents_match_brute_force(raw in proptest::collection::vec((any::<bool>(), any::<usize>()), 1..40)) {
        let parents: Vec<Option<usize>> = raw
            .iter()
            .enumerate()
            .map(|(i, &(root, p))| (!root && i > 0).then(|| p % i))
            .collect();
        let mask = TreeMask::from_parents(&parents).unwrap();
        prop_assert_eq!(mask.len(), parents.len());
        let positions = mask.positions(7);
        for (i, &pos) in positions.iter().enumerate() {
            let anc = brute_path(&parents, i);
            prop_assert_eq!(mask.ancestors_and_self(i), &anc[..]);
            prop_assert_eq!(pos as usize, 7 + anc.len() - 1);
        }
        let mut bad = parents.clone();
        bad.push(Some(parents.len()));
        prop_assert!(TreeMask::from_parents(&bad).is_none(), "a node cannot be its own parent");
        bad.pop();
        if bad.len() > 1 {
            bad[0] = Some(1);
            prop_assert!(TreeMask::from_parents(&bad).is_none(), "a parent after its child");
        }
    }

    /// Half-precision masks hold the same 0 / -inf pattern.
    #[test]
    fn half_precision_masks_match((roots, extra) in arb_shape(24), prefix in 0usize..16) {
        let g = build_tree(roots, &extra, 50, false);
        let mask = TreeMask::new(&g.tree);
        let f32_rows = mask.to_tensor(prefix, DType::F32, &Device::Cpu).unwrap().to_vec2::<f32>().unwrap();
        for dtype in [DType::BF16, DType::F16] {
            let t = mask.to_tensor(prefix, dtype, &Device::Cpu).unwrap();
            prop_assert_eq!(t.dtype(), dtype);
            let back = t.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
            prop_assert_eq!(&back, &f32_rows);
        }
    }

    /// The prefill mask is causal over prefix + new tokens.
    #[test]
    fn causal_mask_is_causal(n_new in 0usize..20, prefix in 0usize..20) {
        let t = causal_mask(n_new, prefix, DType::F32, &Device::Cpu).unwrap();
        prop_assert_eq!(t.dims(), &[n_new, prefix + n_new]);
        let rows = t.to_vec2::<f32>().unwrap();
        for (r, row) in rows.iter().enumerate() {
            for (c, &v) in row.iter().enumerate() {
                prop_assert_eq!(v, if c <= prefix + r { 0.0 } else { f32::NEG_INFINITY });
            }
        }
    }
}

/// A chain's tree block is lower-triangular and its positions consecutive.
#[test]
fn chain_mask_is_causal() {
    let mask = TreeMask::new(&TokenTree::chain(&[5, 6, 7]));
    assert_eq!(mask.positions(10), vec![10, 11, 12]);
    let b = mask.block_data();
    let ninf = f32::NEG_INFINITY;
    assert_eq!(b, vec![0.0, ninf, ninf, 0.0, 0.0, ninf, 0.0, 0.0, 0.0]);
}

/// An empty tree gives an empty mask without error.
#[test]
fn empty_tree_mask() {
    let mask = TreeMask::new(&TokenTree::new());
    assert!(mask.is_empty());
    let t = mask.to_tensor(4, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(t.dims(), &[0, 4]);
}
