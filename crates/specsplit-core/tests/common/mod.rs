//! Helpers shared by the integration tests of specsplit-core.
#![allow(dead_code)]

use proptest::prelude::*;
use specsplit_core::tree::{Distribution, TokenTree};
use specsplit_proto::TokenNode;

/// A generated tree plus the parent list it was generated from (the ground truth).
#[derive(Debug, Clone)]
pub struct GenTree {
    /// The built tree.
    pub tree: TokenTree,
    /// Parent of each node, as chosen by the generator.
    pub parents: Vec<Option<usize>>,
}

/// Raw material of a random forest: number of roots and (parent choice, token) per extra node.
pub fn arb_shape(max_extra: usize) -> impl Strategy<Value = (usize, Vec<(u16, u32)>)> {
    (
        1usize..=4,
        prop::collection::vec((any::<u16>(), any::<u32>()), 0..max_extra),
    )
}

/// Builds a breadth-first forest: each extra node picks a parent at or after the previous
/// node's parent (any forest in BFS order arises this way). With `distinct_siblings`, tokens
/// are bumped to differ from earlier siblings (nodes that cannot be made distinct are skipped).
pub fn build_tree(
    n_roots: usize,
    extra: &[(u16, u32)],
    vocab: u32,
    distinct_siblings: bool,
) -> GenTree {
    let mut tree = TokenTree::new();
    let mut parents = Vec::new();
    let mut sibling_tokens: Vec<Vec<u32>> = Vec::new(); // per parent (+1 slot for roots at end)
    let mut roots_tokens: Vec<u32> = Vec::new();
    let pick = |taken: &[u32], t: u32| -> Option<u32> {
        if !distinct_siblings {
            return Some(t % vocab);
        }
        (0..vocab)
            .map(|k| (t % vocab + k) % vocab)
            .find(|c| !taken.contains(c))
    };
    for r in 0..n_roots {
        let raw = extra.get(r).map_or(r as u32, |e| e.1.rotate_left(7));
        if let Some(t) = pick(&roots_tokens, raw) {
            roots_tokens.push(t);
            tree.push_root(t, -(r as f32) * 0.5).unwrap();
            parents.push(None);
            sibling_tokens.push(Vec::new());
        }
    }
    let mut last_parent = 0usize;
    for &(c, t) in extra {
        let len = tree.len();
        let parent = last_parent + (c as usize) % (len - last_parent);
        let Some(tok) = pick(&sibling_tokens[parent], t) else {
            continue;
        };
        let idx = tree.push_child(parent, tok, -0.25).unwrap();
        assert_eq!(idx, len);
        sibling_tokens[parent].push(tok);
        sibling_tokens.push(Vec::new());
        parents.push(Some(parent));
        last_parent = parent;
    }
    GenTree { tree, parents }
}

/// Ancestors of `i` (itself included), root first, from a parent list.
pub fn brute_path(parents: &[Option<usize>], i: usize) -> Vec<usize> {
    let mut path = vec![i];
    let mut cur = i;
    while let Some(p) = parents[cur] {
        path.push(p);
        cur = p;
    }
    path.reverse();
    path
}

/// SplitMix64 finaliser.
pub fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Hash of a seed and a token context.
pub fn hash_ctx(seed: u64, ctx: &[u32]) -> u64 {
    let mut h = mix(seed ^ 0xA5A5_5A5A);
    for &t in ctx {
        h = mix(h ^ u64::from(t).wrapping_mul(0x1000_0000_01B3));
    }
    mix(h ^ ctx.len() as u64)
}

/// Deterministic pseudo-random logits in `[-scale, scale]` for a context.
pub fn ctx_logits(seed: u64, ctx: &[u32], vocab: usize, scale: f32) -> Vec<f32> {
    let h = hash_ctx(seed, ctx);
    (0..vocab)
        .map(|i| {
            let r = mix(h ^ (i as u64 + 1).wrapping_mul(0x9E37)) >> 11;
            let u = r as f64 / (1u64 << 53) as f64;
            ((u * 2.0 - 1.0) * f64::from(scale)) as f32
        })
        .collect()
}

/// A normalised distribution from raw weights (dense when `sparse_ids` is `None`).
pub fn make_dist(weights: &[f32], sparse_ids: Option<Vec<u32>>) -> Distribution {
    let total: f32 = weights.iter().sum();
    let probs: Vec<f32> = weights.iter().map(|w| w / total).collect();
    match sparse_ids {
        Some(ids) => Distribution::Sparse { ids, probs },
        None => Distribution::Dense(probs),
    }
}

/// Drops a nested forest without recursion (deep protos would overflow the stack otherwise).
pub fn drop_deep(roots: Vec<TokenNode>) {
    let mut stack = roots;
    while let Some(mut n) = stack.pop() {
        stack.append(&mut n.children);
    }
}
