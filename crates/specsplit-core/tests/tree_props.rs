//! Token trees: structural invariants and builder misuse (the wire conversions are tested in
//! specsplit-proto).

mod common;

use common::{arb_shape, brute_path, build_tree};
use proptest::prelude::*;
use specsplit_core::tree::{full_tree_size, Distribution, TokenTree, TreeError};

const V: u32 = 40;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Structural invariants: BFS order, parent < child, contiguous ordered children, depths, paths.
    #[test]
    fn bfs_invariants_hold((roots, extra) in arb_shape(64)) {
        let g = build_tree(roots, &extra, V, false);
        let t = &g.tree;
        prop_assert_eq!(t.parents(), &g.parents[..]);
        let mut seen_children = 0;
        for i in 0..t.len() {
            let path = brute_path(&g.parents, i);
            prop_assert_eq!(t.path_to(i), path.clone());
            prop_assert_eq!(t.depth(i), path.len() - 1);
            if let Some(p) = t.parent(i) {
                prop_assert!(p < i);
                prop_assert!(t.children(p).contains(&i));
            } else {
                prop_assert!(t.roots().contains(&i));
            }
            if i > 0 {
                prop_assert!(t.depth(i) >= t.depth(i - 1));
            }
            let kids: Vec<usize> = (0..t.len()).filter(|&j| g.parents[j] == Some(i)).collect();
            prop_assert_eq!(t.children(i).collect::<Vec<_>>(), kids.clone());
            seen_children += kids.len();
        }
        prop_assert_eq!(seen_children + t.roots().len(), t.len());
        prop_assert_eq!(t.max_depth(), t.depths().iter().copied().max().unwrap_or(0));
    }
}

/// Builder misuse: NotBreadthFirst, ParentOutOfRange, NodeOutOfRange.
#[test]
fn builder_rejects_out_of_order() {
    let mut t = TokenTree::new();
    t.push_root(1, 0.0).unwrap();
    t.push_root(2, 0.0).unwrap();
    assert_eq!(
        t.push_child(5, 3, 0.0),
        Err(TreeError::ParentOutOfRange { parent: 5, len: 2 })
    );
    t.push_child(1, 3, 0.0).unwrap();
    assert_eq!(
        t.push_child(0, 4, 0.0),
        Err(TreeError::NotBreadthFirst {
            parent: Some(0),
            last_parent: 1
        })
    );
    assert_eq!(
        t.push_root(9, 0.0),
        Err(TreeError::NotBreadthFirst {
            parent: None,
            last_parent: 1
        })
    );
    t.push_child(2, 4, 0.0).unwrap();
    assert_eq!(
        t.set_child_distribution(9, Distribution::Dense(vec![1.0])),
        Err(TreeError::NodeOutOfRange { node: 9, len: 4 })
    );
    assert!(t.set_top_k(4, vec![], vec![]).is_err());
    assert_eq!(t.tokens(), &[1, 2, 3, 4]);
    assert_eq!(t.children(1), 2..3);
    assert_eq!(t.children(2), 3..4);
    let msg = TreeError::NotBreadthFirst {
        parent: Some(0),
        last_parent: 1,
    }
    .to_string();
    assert!(msg.contains("a child of node 0"), "{msg}");
}

/// Full-tree sizes count every level and saturate instead of overflowing.
#[test]
fn full_tree_size_counts_every_level() {
    assert_eq!(full_tree_size(&[4, 2, 1, 1]), 4 + 8 + 8 + 8);
    assert_eq!(full_tree_size(&[1, 1, 1]), 3);
    assert_eq!(full_tree_size(&[]), 0);
    assert_eq!(full_tree_size(&[usize::MAX, 2]), usize::MAX);
}
