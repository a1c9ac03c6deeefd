//! Token trees on the wire: exact round-trips, one rejection test per error variant, and no
//! panics on arbitrary wire input.

#[path = "../../specsplit-core/tests/common/mod.rs"]
mod common;

use common::{arb_shape, build_tree, make_dist};
use proptest::prelude::*;
use specsplit_core::tree::{Distribution, DistributionError, TokenTree, TreeError, TreeLimits};
use specsplit_proto::convert::{DistributionWire, TreeWire};
use specsplit_proto::{DraftDistribution, TokenNode};

const V: u32 = 40;

fn limits() -> TreeLimits {
    TreeLimits::new(10_000, 1_000, V as usize)
}

/// A valid wire distribution over `0..V` (dense or sparse).
fn arb_dist() -> impl Strategy<Value = Distribution> {
    prop_oneof![
        prop::collection::vec(0.01f32..1.0, V as usize).prop_map(|w| make_dist(&w, None)),
        prop::sample::subsequence((0..V).collect::<Vec<_>>(), 1..8)
            .prop_shuffle()
            .prop_flat_map(|ids| {
                let n = ids.len();
                (Just(ids), prop::collection::vec(0.01f32..1.0, n))
            })
            .prop_map(|(ids, w)| make_dist(&w, Some(ids))),
    ]
}

/// A valid nested wire node (recursive).
fn arb_valid_node() -> impl Strategy<Value = TokenNode> {
    let leaf = (
        0..V as i32,
        -20.0f32..=0.0,
        prop::collection::vec((0..V as i32, 0.0f32..=1.0), 0..3),
        prop::option::of(arb_dist()),
    )
        .prop_map(|(t, lp, topk, d)| TokenNode {
            token_id: t,
            log_prob: lp,
            children: vec![],
            top_k_token_ids: topk.iter().map(|x| x.0).collect(),
            top_k_probs: topk.iter().map(|x| x.1).collect(),
            child_distribution: d.map(|d| d.to_proto()),
        });
    leaf.prop_recursive(5, 64, 4, |inner| {
        (inner.clone(), prop::collection::vec(inner, 1..4)).prop_map(|(mut n, kids)| {
            n.children = kids;
            n
        })
    })
}

/// A random valid tree with distributions and top-k information on some nodes.
fn arb_tree_with_dists() -> impl Strategy<Value = TokenTree> {
    (
        arb_shape(40),
        any::<bool>(),
        prop::option::of(arb_dist()),
        prop::collection::vec(prop::option::of(arb_dist()), 40),
    )
        .prop_map(|((roots, extra), wr, root_d, dists)| {
            let mut t = build_tree(roots, &extra, V, wr).tree;
            t.set_siblings_without_replacement(wr);
            if let Some(d) = root_d {
                t.set_root_distribution(d);
            }
            for (i, d) in dists.into_iter().enumerate().take(t.len()) {
                if let Some(d) = d {
                    t.set_child_distribution(i, d).unwrap();
                }
                if i % 3 == 0 {
                    t.set_top_k(i, vec![i as u32 % V, 3], vec![0.5, 0.25])
                        .unwrap();
                }
            }
            t
        })
}

/// Mutable access to the node with breadth-first index `i` of a nested forest.
fn node_mut<'a>(roots: &'a mut [TokenNode], tree: &TokenTree, i: usize) -> &'a mut TokenNode {
    let path = tree.path_to(i);
    let mut node = &mut roots[path[0]];
    for w in path.windows(2) {
        let pos = w[1] - tree.children(w[0]).start;
        node = &mut node.children[pos];
    }
    node
}

/// A fully distributed tree (every node with children has a distribution covering them).
fn sampled_tree((roots, extra): (usize, Vec<(u16, u32)>), wr: bool) -> TokenTree {
    let mut t = build_tree(roots, &extra, V, wr).tree;
    t.set_siblings_without_replacement(wr);
    let uniform = make_dist(&[1.0; V as usize], None);
    t.set_root_distribution(uniform.clone());
    for i in 0..t.len() {
        if !t.is_leaf(i) {
            t.set_child_distribution(i, uniform.clone()).unwrap();
        }
    }
    t
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// tree -> proto -> tree is the identity, and the proto validates.
    #[test]
    fn tree_proto_round_trip(t in arb_tree_with_dists()) {
        let (roots, rd) = t.to_proto();
        let back = TokenTree::from_proto(&roots, rd.as_ref(), t.siblings_without_replacement(), &limits()).unwrap();
        prop_assert_eq!(&back, &t);
        t.validate(&limits()).unwrap();
    }

    /// proto -> tree -> proto is the identity for valid wire forests.
    #[test]
    fn proto_tree_round_trip(roots in prop::collection::vec(arb_valid_node(), 1..4), rd in prop::option::of(arb_dist()), wr in any::<bool>()) {
        let rd = rd.map(|d| d.to_proto());
        let t = TokenTree::from_proto(&roots, rd.as_ref(), wr, &limits()).unwrap();
        let (again, rd2) = t.to_proto();
        prop_assert_eq!(again, roots);
        prop_assert_eq!(rd2, rd);
        prop_assert_eq!(t.siblings_without_replacement(), wr);
    }

    /// More nodes than allowed: TooManyNodes, from the wire and from validate().
    #[test]
    fn rejects_too_many_nodes((roots, extra) in arb_shape(40), cut in any::<prop::sample::Index>()) {
        let t = build_tree(roots, &extra, V, false).tree;
        let max = cut.index(t.len());
        let lim = TreeLimits { max_nodes: max, ..limits() };
        let (nested, _) = t.to_proto();
        let err = TokenTree::from_proto(&nested, None, false, &lim);
        prop_assert!(matches!(err, Err(TreeError::TooManyNodes { max: m, .. }) if m == max), "{:?}", err);
        prop_assert_eq!(t.validate(&lim), Err(TreeError::TooManyNodes { count: t.len(), max }));
    }

    /// Deeper than allowed: TooDeep with the path length.
    #[test]
    fn rejects_too_deep((roots, extra) in arb_shape(40), cut in any::<prop::sample::Index>()) {
        let t = build_tree(roots, &extra, V, false).tree;
        let levels = t.max_depth() + 1;
        let max = cut.index(levels);
        let lim = TreeLimits { max_depth: max, ..limits() };
        let (nested, _) = t.to_proto();
        let err = TokenTree::from_proto(&nested, None, false, &lim).unwrap_err();
        prop_assert_eq!(err, TreeError::TooDeep { depth: max + 1, max });
        prop_assert_eq!(t.validate(&lim), Err(TreeError::TooDeep { depth: levels, max }));
    }

    /// Negative or too-large token ids: TokenOutOfVocab naming the node.
    #[test]
    fn rejects_token_out_of_vocab((roots, extra) in arb_shape(30), at in any::<prop::sample::Index>(),
                                  bad in prop_oneof![i32::MIN..0, V as i32..i32::MAX]) {
        let t = build_tree(roots, &extra, V, false).tree;
        let i = at.index(t.len());
        let (mut nested, _) = t.to_proto();
        node_mut(&mut nested, &t, i).token_id = bad;
        let err = TokenTree::from_proto(&nested, None, false, &limits()).unwrap_err();
        prop_assert_eq!(err, TreeError::TokenOutOfVocab { node: i, token: i64::from(bad), vocab_size: V as usize });
    }

    /// NaN or positive log-probabilities: BadLogProb.
    #[test]
    fn rejects_bad_log_prob((roots, extra) in arb_shape(30), at in any::<prop::sample::Index>(),
                            bad in prop_oneof![Just(f32::NAN), Just(f32::INFINITY), 0.01f32..100.0]) {
        let t = build_tree(roots, &extra, V, false).tree;
        let i = at.index(t.len());
        let (mut nested, _) = t.to_proto();
        node_mut(&mut nested, &t, i).log_prob = bad;
        let err = TokenTree::from_proto(&nested, None, false, &limits()).unwrap_err();
        prop_assert!(matches!(err, TreeError::BadLogProb { node, .. } if node == i), "{:?}", err);
    }

    /// Malformed informational top-k lists: BadTopK.
    #[test]
    fn rejects_bad_top_k((roots, extra) in arb_shape(30), at in any::<prop::sample::Index>(), kind in 0u8..3) {
        let t = build_tree(roots, &extra, V, false).tree;
        let i = at.index(t.len());
        let (mut nested, _) = t.to_proto();
        let n = node_mut(&mut nested, &t, i);
        match kind {
            0 => { n.top_k_token_ids = vec![1, 2]; n.top_k_probs = vec![0.5]; }
            1 => { n.top_k_token_ids = vec![-3]; n.top_k_probs = vec![0.5]; }
            _ => { n.top_k_token_ids = vec![1]; n.top_k_probs = vec![f32::NAN]; }
        }
        let err = TokenTree::from_proto(&nested, None, false, &limits()).unwrap_err();
        prop_assert!(matches!(err, TreeError::BadTopK { node, .. } if node == i), "{:?}", err);
    }

    /// Every kind of malformed distribution, at the roots or at a node: BadDistribution.
    #[test]
    fn rejects_bad_distribution((roots, extra) in arb_shape(30), at in prop::option::of(any::<prop::sample::Index>()), kind in 0u8..8) {
        let t = build_tree(roots, &extra, V, false).tree;
        let (bad, expect): (DraftDistribution, fn(&DistributionError) -> bool) = match kind {
            0 => (DraftDistribution { token_ids: vec![], probs: vec![] }, |e| matches!(e, DistributionError::Empty)),
            1 => (DraftDistribution { token_ids: vec![1, 2], probs: vec![1.0] }, |e| matches!(e, DistributionError::LengthMismatch { ids: 2, probs: 1 })),
            2 => (DraftDistribution { token_ids: vec![], probs: vec![0.5, 0.5] }, |e| matches!(e, DistributionError::DenseLength { len: 2, .. })),
            3 => (DraftDistribution { token_ids: vec![-1], probs: vec![1.0] }, |e| matches!(e, DistributionError::TokenOutOfVocab { token: -1, .. })),
            4 => (DraftDistribution { token_ids: vec![V as i32], probs: vec![1.0] }, |e| matches!(e, DistributionError::TokenOutOfVocab { .. })),
            5 => (DraftDistribution { token_ids: vec![3, 3], probs: vec![0.5, 0.5] }, |e| matches!(e, DistributionError::DuplicateToken { token: 3 })),
            6 => (DraftDistribution { token_ids: vec![3, 4], probs: vec![f32::NAN, 1.0] }, |e| matches!(e, DistributionError::InvalidProbability { index: 0, .. })),
            _ => (DraftDistribution { token_ids: vec![3, 4], probs: vec![0.5, 0.6] }, |e| matches!(e, DistributionError::BadSum { .. })),
        };
        let (mut nested, _) = t.to_proto();
        let (root_d, node) = match at {
            Some(ix) => {
                let i = ix.index(t.len());
                node_mut(&mut nested, &t, i).child_distribution = Some(bad);
                (None, Some(i))
            }
            None => (Some(bad), None),
        };
        let err = TokenTree::from_proto(&nested, root_d.as_ref(), false, &limits()).unwrap_err();
        match &err {
            TreeError::BadDistribution { node: n, reason } => {
                prop_assert_eq!(*n, node);
                prop_assert!(expect(reason), "unexpected reason {:?}", reason);
            }
            other => prop_assert!(false, "unexpected error {other:?}"),
        }
    }

    /// A missing distribution (roots or an inner node): MissingDistribution.
    #[test]
    fn rejects_missing_distribution(shape in arb_shape(30), at in prop::option::of(any::<prop::sample::Index>())) {
        let t = sampled_tree(shape, false);
        prop_assert_eq!(t.require_distributions(), Ok(()));
        let (mut nested, rd) = t.to_proto();
        let inner: Vec<usize> = (0..t.len()).filter(|&i| !t.is_leaf(i)).collect();
        let (rd, node) = match at {
            Some(ix) if !inner.is_empty() => {
                let i = inner[ix.index(inner.len())];
                node_mut(&mut nested, &t, i).child_distribution = None;
                (rd, Some(i))
            }
            _ => (None, None),
        };
        let back = TokenTree::from_proto(&nested, rd.as_ref(), false, &limits()).unwrap();
        prop_assert_eq!(back.require_distributions(), Err(TreeError::MissingDistribution { node }));
    }

    /// A drafted token with zero probability in its distribution: DrawnTokenHasZeroDraftProb.
    #[test]
    fn rejects_zero_draft_prob(shape in arb_shape(30), at in any::<prop::sample::Index>()) {
        let mut t = sampled_tree(shape, false);
        let i = at.index(t.len());
        let tok = t.token(i);
        let mut w = vec![1.0f32; V as usize];
        w[tok as usize] = 0.0;
        let parent = t.parent(i);
        // Zero the token's probability in the distribution its sibling group was drawn from.
        match parent {
            None => t.set_root_distribution(make_dist(&w, None)),
            Some(p) => t.set_child_distribution(p, make_dist(&w, None)).unwrap(),
        }
        let group = match parent { None => t.roots(), Some(p) => t.children(p) };
        let first = group.clone().find(|&j| t.token(j) == tok).unwrap();
        let err = t.require_distributions().unwrap_err();
        prop_assert_eq!(err, TreeError::DrawnTokenHasZeroDraftProb { node: first, token: tok, parent });
    }

    /// Repeated sibling tokens when drawn without replacement: DuplicateSibling.
    #[test]
    fn rejects_duplicate_siblings(shape in arb_shape(30)) {
        let mut t = sampled_tree(shape, true);
        prop_assert_eq!(t.require_distributions(), Ok(()));
        let last = t.len() - 1;
        let parent = t.parent(last);
        let dup = t.token(last);
        // Append a sibling of the last node with the same token (keeps BFS order).
        let node = match parent {
            None => t.push_root(dup, 0.0).unwrap(),
            Some(p) => t.push_child(p, dup, 0.0).unwrap(),
        };
        let err = t.require_distributions().unwrap_err();
        prop_assert_eq!(err, TreeError::DuplicateSibling { node, token: dup, parent });
        t.set_siblings_without_replacement(false);
        prop_assert_eq!(t.require_distributions(), Ok(()));
    }
}

/// Empty forests: Empty.
#[test]
fn rejects_empty() {
    assert_eq!(
        TokenTree::from_proto(&[], None, false, &limits()),
        Err(TreeError::Empty)
    );
    assert_eq!(TokenTree::new().validate(&limits()), Err(TreeError::Empty));
}

/// A huge flat forest and a very deep chain are rejected quickly and without stack overflow;
/// with generous limits the deep chain converts both ways.
#[test]
fn hostile_sizes_do_not_blow_up() {
    let wide: Vec<TokenNode> = (0..200_000)
        .map(|i| TokenNode {
            token_id: i % 7,
            ..Default::default()
        })
        .collect();
    let lim = TreeLimits::new(256, 16, V as usize);
    assert!(matches!(
        TokenTree::from_proto(&wide, None, false, &lim),
        Err(TreeError::TooManyNodes {
            count: 200_000,
            max: 256
        })
    ));
    let one = vec![TokenNode {
        token_id: 1,
        children: wide,
        ..Default::default()
    }];
    assert!(matches!(
        TokenTree::from_proto(&one, None, false, &lim),
        Err(TreeError::TooManyNodes { max: 256, .. })
    ));
    drop_deep(one);

    let depth = 20_000;
    let mut chain = TokenNode {
        token_id: 2,
        ..Default::default()
    };
    for _ in 1..depth {
        chain = TokenNode {
            token_id: 3,
            children: vec![chain],
            ..Default::default()
        };
    }
    let roots = vec![chain];
    assert_eq!(
        TokenTree::from_proto(&roots, None, false, &lim),
        Err(TreeError::TooDeep { depth: 17, max: 16 })
    );
    let big = TreeLimits::new(depth, depth, V as usize);
    let t = TokenTree::from_proto(&roots, None, false, &big).unwrap();
    assert_eq!(t.len(), depth);
    assert_eq!(t.max_depth(), depth - 1);
    let (again, _) = t.to_proto();
    drop_deep(again);
    drop_deep(roots);
}

/// Arbitrary nested wire node: any ids, any floats (NaN included), any distributions.
fn arb_wild_node() -> impl Strategy<Value = TokenNode> {
    let dist = (
        prop::collection::vec(any::<i32>(), 0..4),
        prop::collection::vec(any::<f32>(), 0..5),
    )
        .prop_map(|(token_ids, probs)| DraftDistribution { token_ids, probs });
    let leaf = (
        prop_oneof![any::<i32>(), -2i32..50],
        any::<f32>(),
        prop::collection::vec(any::<i32>(), 0..3),
        prop::collection::vec(any::<f32>(), 0..3),
        prop::option::of(dist),
    )
        .prop_map(
            |(token_id, log_prob, top_k_token_ids, top_k_probs, child_distribution)| TokenNode {
                token_id,
                log_prob,
                children: vec![],
                top_k_token_ids,
                top_k_probs,
                child_distribution,
            },
        );
    leaf.prop_recursive(8, 128, 6, |inner| {
        (inner.clone(), prop::collection::vec(inner, 0..6)).prop_map(|(mut n, kids)| {
            n.children = kids;
            n
        })
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// from_proto never panics; whatever it accepts validates, round-trips and is sampled-checkable.
    #[test]
    fn from_proto_never_panics(roots in prop::collection::vec(arb_wild_node(), 0..5),
                               rd in prop::option::of((prop::collection::vec(-1i32..45, 0..4), prop::collection::vec(any::<f32>(), 0..41))
                                    .prop_map(|(token_ids, probs)| DraftDistribution { token_ids, probs })),
                               max_nodes in 0usize..200, max_depth in 0usize..10, wr in any::<bool>()) {
        let lim = TreeLimits::new(max_nodes, max_depth, V as usize);
        if let Ok(t) = TokenTree::from_proto(&roots, rd.as_ref(), wr, &lim) {
            prop_assert_eq!(t.validate(&lim), Ok(()));
            let (again, rd2) = t.to_proto();
            prop_assert_eq!(again, roots);
            prop_assert_eq!(rd2, rd);
            let _ = t.require_distributions();
        }
    }
}

/// Drops a nested forest without recursion (deep protos would overflow the stack otherwise).
fn drop_deep(roots: Vec<TokenNode>) {
    let mut stack = roots;
    while let Some(mut n) = stack.pop() {
        stack.append(&mut n.children);
    }
}
