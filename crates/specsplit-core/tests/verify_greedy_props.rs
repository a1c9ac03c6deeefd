//! Greedy verification against brute-force path enumeration and against a simulated target
//! decoding alone.

mod common;

use common::{arb_shape, brute_path, build_tree, ctx_logits, hash_ctx};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specsplit_core::sampling::{argmax, SamplingParams};
use specsplit_core::tree::TokenTree;
use specsplit_core::verify::{verify_greedy, verify_stochastic, Verdict, VerifyError};

/// Longest path whose every token equals the target's choice at its parent, by enumeration of
/// every root-to-node path (siblings distinct, so it is unique).
fn brute_force(parents: &[Option<usize>], tokens: &[u32], target_next: &[u32]) -> Verdict {
    let mut best: Vec<usize> = Vec::new();
    for i in 0..tokens.len() {
        let path = brute_path(parents, i);
        let ok = path.iter().enumerate().all(|(k, &node)| {
            let row = if k == 0 { 0 } else { path[k - 1] + 1 };
            tokens[node] == target_next[row]
        });
        if ok && path.len() > best.len() {
            best = path;
        }
    }
    let next_token = target_next[best.last().map_or(0, |&l| l + 1)];
    let bonus = best.last().is_some_and(|&l| !parents.contains(&Some(l)));
    Verdict {
        accepted_tokens: best.iter().map(|&i| tokens[i]).collect(),
        accepted_nodes: best,
        next_token,
        bonus,
    }
}

/// The target as a deterministic function from context to next token.
fn target_greedy(ctx: &[u32], vocab: u32) -> u32 {
    (hash_ctx(77, ctx) % u64::from(vocab)) as u32
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// The verdict equals the brute-force longest accepted path, next token and bonus flag.
    #[test]
    fn greedy_matches_brute_force((roots, extra) in arb_shape(40), vocab in 2u32..5, table in prop::collection::vec(any::<u32>(), 41 + 4)) {
        let g = build_tree(roots, &extra, vocab, true);
        let n = g.tree.len();
        let target_next: Vec<u32> = table[..n + 1].iter().map(|t| t % vocab).collect();
        let got = verify_greedy(&g.tree, &target_next).unwrap();
        let want = brute_force(&g.parents, g.tree.tokens(), &target_next);
        prop_assert_eq!(got, want);
    }

    /// Rounds of draft + greedy verification emit exactly the target-alone greedy sequence,
    /// whatever the drafts (duplicate siblings allowed).
    #[test]
    fn greedy_rounds_equal_target_alone(seed in any::<u64>(), vocab in 2u32..6) {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let total = 60;
        let mut alone = Vec::new();
        while alone.len() < total {
            alone.push(target_greedy(&alone, vocab));
        }
        let mut seq: Vec<u32> = Vec::new();
        while seq.len() < total {
            // Draft: a random BFS tree whose tokens are right with probability 1/2.
            let mut tree = TokenTree::new();
            let roots = rng.random_range(1..4);
            for _ in 0..roots {
                let t = if rng.random_bool(0.5) { target_greedy(&seq, vocab) } else { rng.random_range(0..vocab) };
                tree.push_root(t, 0.0).unwrap();
            }
            let extra = rng.random_range(0..20);
            let mut lo = 0;
            for _ in 0..extra {
                let parent = rng.random_range(lo..tree.len());
                let mut ctx = seq.clone();
                ctx.extend(tree.path_tokens(parent));
                let t = if rng.random_bool(0.5) { target_greedy(&ctx, vocab) } else { rng.random_range(0..vocab) };
                tree.push_child(parent, t, 0.0).unwrap();
                lo = parent;
            }
            // Target: its argmax after the prefix and after every node's path.
            let mut target_next = vec![target_greedy(&seq, vocab)];
            for i in 0..tree.len() {
                let mut ctx = seq.clone();
                ctx.extend(tree.path_tokens(i));
                target_next.push(target_greedy(&ctx, vocab));
            }
            let v = verify_greedy(&tree, &target_next).unwrap();
            prop_assert_eq!(v.accepted_tokens.clone(), tree_tokens(&tree, &v.accepted_nodes));
            seq.extend(v.emitted_tokens());
        }
        prop_assert_eq!(&seq[..total], &alone[..]);
    }

    /// verify_stochastic with greedy parameters equals verify_greedy on the rows' argmaxes.
    #[test]
    fn stochastic_with_greedy_params_is_greedy((roots, extra) in arb_shape(30), seed in any::<u64>()) {
        let vocab = 5usize;
        let g = build_tree(roots, &extra, vocab as u32, false);
        let n = g.tree.len();
        let logits: Vec<f32> = (0..=n).flat_map(|r| ctx_logits(seed, &[r as u32], vocab, 3.0)).collect();
        let target_next: Vec<u32> = logits.chunks(vocab).map(argmax).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let s = verify_stochastic(&g.tree, &logits, vocab, &SamplingParams::greedy(), &mut rng).unwrap();
        prop_assert_eq!(s, verify_greedy(&g.tree, &target_next).unwrap());
    }
}

fn tree_tokens(tree: &TokenTree, nodes: &[usize]) -> Vec<u32> {
    nodes.iter().map(|&i| tree.token(i)).collect()
}

/// Wrong table lengths are typed errors.
#[test]
fn greedy_rejects_wrong_length() {
    let t = TokenTree::chain(&[1, 2]);
    assert_eq!(
        verify_greedy(&t, &[1, 2]),
        Err(VerifyError::WrongTargetLength {
            expected: 3,
            got: 2
        })
    );
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let p = SamplingParams {
        temperature: 1.0,
        ..SamplingParams::default()
    };
    assert!(matches!(
        verify_stochastic(&t, &[0.0; 5], 2, &p, &mut rng),
        Err(VerifyError::WrongLogitsLength { rows: 3, .. })
    ));
    assert_eq!(
        verify_stochastic(&t, &[], 0, &p, &mut rng),
        Err(VerifyError::ZeroVocab)
    );
}

/// Full acceptance gives a bonus token; an empty tree yields the target's first token.
#[test]
fn greedy_bonus_and_empty_tree() {
    let t = TokenTree::chain(&[4, 5, 6]);
    let v = verify_greedy(&t, &[4, 5, 6, 9]).unwrap();
    assert_eq!(
        v,
        Verdict {
            accepted_nodes: vec![0, 1, 2],
            accepted_tokens: vec![4, 5, 6],
            next_token: 9,
            bonus: true
        }
    );
    let v = verify_greedy(&t, &[4, 7, 6, 9]).unwrap();
    assert_eq!(
        (v.accepted_tokens.clone(), v.next_token, v.bonus),
        (vec![4], 7, false)
    );
    let v = verify_greedy(&TokenTree::new(), &[3]).unwrap();
    assert_eq!((v.num_accepted(), v.next_token, v.bonus), (0, 3, false));
}
