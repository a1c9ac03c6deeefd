//! Statistical exactness of stochastic tree verification: the joint distribution of the first
//! three emitted tokens must match the target's exact distribution (chi-square goodness of fit
//! at significance 0.001), for chains, trees with and without replacement, temperature, top-k
//! and top-p. Deliberately wrong verifiers must fail the same test (power check).

mod common;
#[path = "common/joint.rs"]
mod joint;

use common::{ctx_logits, gamma_q};
use joint::{emitted_joint_test, SyntheticTarget};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specsplit_core::sampling::{sample, sample_without_replacement, warp, SamplingParams};
use specsplit_core::tree::{Distribution, TokenTree};
use specsplit_core::verify::verify_stochastic;

const V: usize = 6;
const POSITIONS: usize = 3;
const DRAWS: usize = 100_000;
const ALPHA: f64 = 0.001;
const TARGET_SEED: u64 = 11;
const DRAFT_SEED: u64 = 23;
const SCALE: f32 = 2.0;
const TARGET: SyntheticTarget = SyntheticTarget {
    seed: TARGET_SEED,
    vocab: V,
    scale: SCALE,
};

#[test]
fn chi_square_p_values_match_tables() {
    // Critical values of the chi-square distribution (standard tables).
    for (df, x, p) in [
        (1, 3.841_459, 0.05),
        (2, 9.210_340, 0.01),
        (10, 23.209_251, 0.01),
        (100, 149.449_252, 0.001),
        (215, 215.0, 0.4873),
    ] {
        let got = gamma_q(df as f64 / 2.0, x / 2.0);
        assert!(
            (got - p).abs() < 2e-3 * p.max(0.01) + 1e-4,
            "df {df} x {x}: {got} vs {p}"
        );
    }
    assert!((gamma_q(1.0, 2.0) - (-2.0f64).exp()).abs() < 1e-12);
}

// ------------------------------------------------------------------------------------------
// The models: context-dependent target p and draft q over V tokens.
// ------------------------------------------------------------------------------------------

fn draft_dist(ctx: &[u32], params: &SamplingParams) -> Distribution {
    warp(&ctx_logits(DRAFT_SEED, ctx, V, SCALE), params)
}

/// One test case: tree widths per depth, sibling mode and sampling parameters.
struct Case {
    name: &'static str,
    widths: &'static [usize],
    without_replacement: bool,
    params: SamplingParams,
    /// The drafter's own transforms when they differ from the target's (a narrower proposal).
    draft: Option<SamplingParams>,
}

fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        seed: 0,
    }
}

fn draw_siblings(d: &Distribution, k: usize, wr: bool, rng: &mut ChaCha8Rng) -> Vec<u32> {
    if wr {
        sample_without_replacement(d, k, rng)
    } else {
        (0..k).map(|_| sample(d, rng)).collect()
    }
}

/// Drafts a tree from q, level by level, recording the exact distributions used.
fn draft_tree(case: &Case, rng: &mut ChaCha8Rng) -> TokenTree {
    let p = case.draft.as_ref().unwrap_or(&case.params);
    let mut tree = TokenTree::new();
    tree.set_siblings_without_replacement(case.without_replacement);
    let q0 = draft_dist(&[], p);
    for t in draw_siblings(&q0, case.widths[0], case.without_replacement, rng) {
        tree.push_root(t, q0.prob(t).ln()).unwrap();
    }
    tree.set_root_distribution(q0);
    let mut level: Vec<usize> = tree.roots().collect();
    for &w in &case.widths[1..] {
        let mut next = Vec::new();
        for &node in &level {
            let q = draft_dist(&tree.path_tokens(node), p);
            for t in draw_siblings(&q, w, case.without_replacement, rng) {
                next.push(tree.push_child(node, t, q.prob(t).ln()).unwrap());
            }
            tree.set_child_distribution(node, q).unwrap();
        }
        level = next;
    }
    tree
}

/// A verifier under test: emits accepted tokens followed by the next token.
type Verifier = fn(&TokenTree, &[f32], &SamplingParams, &mut ChaCha8Rng) -> Vec<u32>;

fn correct_verifier(
    tree: &TokenTree,
    rows: &[f32],
    p: &SamplingParams,
    rng: &mut ChaCha8Rng,
) -> Vec<u32> {
    verify_stochastic(tree, rows, V, p, rng)
        .unwrap()
        .emitted_tokens()
}

/// WRONG: on rejection keeps sampling from p instead of the residual max(0, p − q).
fn no_residual_verifier(
    tree: &TokenTree,
    _rows: &[f32],
    p: &SamplingParams,
    rng: &mut ChaCha8Rng,
) -> Vec<u32> {
    let mut out = Vec::new();
    let mut candidates = tree.roots();
    let mut q = tree.root_distribution().unwrap().clone();
    loop {
        let target = TARGET.dist(&out, p);
        let mut accepted = None;
        for c in candidates.clone() {
            let x = tree.token(c);
            if rng.random::<f64>() * f64::from(q.prob(x)) < f64::from(target.prob(x)) {
                accepted = Some(c);
                break;
            }
        }
        match accepted {
            Some(c) => {
                out.push(tree.token(c));
                candidates = tree.children(c);
                if let Some(d) = tree.child_distribution(c) {
                    q = d.clone();
                }
            }
            None => {
                out.push(sample(&target, rng));
                return out;
            }
        }
    }
}

/// WRONG: recursive rejection sampling that removes the rejected token from q *before*
/// computing the residual (the residual must use the q the token was drawn from).
fn late_residual_verifier(
    tree: &TokenTree,
    _rows: &[f32],
    p: &SamplingParams,
    rng: &mut ChaCha8Rng,
) -> Vec<u32> {
    let mut out = Vec::new();
    let mut candidates = tree.roots();
    let mut dist = tree.root_distribution().cloned();
    loop {
        let mut pv: Vec<f64> = (0..V)
            .map(|t| f64::from(TARGET.dist(&out, p).prob(t as u32)))
            .collect();
        let mut qv: Vec<f64> = (0..V)
            .map(|t| dist.as_ref().map_or(0.0, |d| f64::from(d.prob(t as u32))))
            .collect();
        let mut accepted = None;
        for c in candidates.clone() {
            let x = tree.token(c) as usize;
            if rng.random::<f64>() * qv[x] < pv[x] {
                accepted = Some(c);
                break;
            }
            qv[x] = 0.0;
            let qs: f64 = qv.iter().sum();
            qv.iter_mut().for_each(|v| *v /= qs);
            let r: Vec<f64> = pv.iter().zip(&qv).map(|(a, b)| (a - b).max(0.0)).collect();
            let rs: f64 = r.iter().sum();
            if rs > 0.0 {
                pv = r.iter().map(|v| v / rs).collect();
            }
        }
        match accepted {
            Some(c) => {
                out.push(tree.token(c));
                candidates = tree.children(c);
                dist = tree.child_distribution(c).cloned();
            }
            None => {
                let d = Distribution::Dense(pv.iter().map(|&v| v as f32).collect());
                out.push(sample(&d, rng));
                return out;
            }
        }
    }
}

/// WRONG: siblings drafted without replacement but verified with the with-replacement rule
/// (q is not updated after a rejection).
fn mismatched_rule_verifier(
    tree: &TokenTree,
    rows: &[f32],
    p: &SamplingParams,
    rng: &mut ChaCha8Rng,
) -> Vec<u32> {
    let mut t = tree.clone();
    t.set_siblings_without_replacement(!tree.siblings_without_replacement());
    verify_stochastic(&t, rows, V, p, rng)
        .unwrap()
        .emitted_tokens()
}

/// WRONG: accepts every node independently with min(1, p/q), keeps the longest accepted path.
fn independent_verifier(
    tree: &TokenTree,
    _rows: &[f32],
    p: &SamplingParams,
    rng: &mut ChaCha8Rng,
) -> Vec<u32> {
    let mut ok = vec![false; tree.len()];
    let mut best: Option<usize> = None;
    for i in 0..tree.len() {
        let parent_ok = tree.parent(i).is_none_or(|pa| ok[pa]);
        if !parent_ok {
            continue;
        }
        let path = tree.path_tokens(i);
        let ctx = &path[..path.len() - 1];
        let q = match tree.parent(i) {
            None => tree.root_distribution().unwrap(),
            Some(pa) => tree.child_distribution(pa).unwrap(),
        };
        let x = tree.token(i);
        ok[i] = rng.random::<f64>() * f64::from(q.prob(x)) < f64::from(TARGET.dist(ctx, p).prob(x));
        if ok[i] && best.is_none_or(|b| tree.depth(i) > tree.depth(b)) {
            best = Some(i);
        }
    }
    let mut out = best.map_or(Vec::new(), |b| tree.path_tokens(b));
    let next = sample(&TARGET.dist(&out, p), rng);
    out.push(next);
    out
}

/// Runs `DRAWS` draft+verify rounds and returns the chi-square p-value of the joint of the
/// first `POSITIONS` emitted tokens, plus the mean number of accepted tokens.
fn run_case(case: &Case, verifier: Verifier, seed: u64) -> (f64, f64) {
    emitted_joint_test(
        case.name,
        &TARGET,
        &case.params,
        POSITIONS,
        DRAWS,
        seed,
        |rng| {
            let tree = draft_tree(case, rng);
            verifier(&tree, &TARGET.rows(&tree), &case.params, rng)
        },
    )
}

fn assert_exact(case: Case, seed: u64) {
    let (pv, mean_accepted) = run_case(&case, correct_verifier, seed);
    assert!(
        pv >= ALPHA,
        "{}: p-value {pv} < {ALPHA}: emitted tokens do not follow the target",
        case.name
    );
    assert!(
        mean_accepted > 0.3,
        "{}: suspiciously few acceptances ({mean_accepted})",
        case.name
    );
}

#[test]
fn exact_chain_depth_3() {
    assert_exact(
        Case {
            name: "chain",
            widths: &[1, 1, 1],
            without_replacement: false,
            params: params(1.0, 0, 1.0),
            draft: None,
        },
        1,
    );
}

#[test]
fn exact_tree_with_replacement() {
    assert_exact(
        Case {
            name: "tree/with-replacement",
            widths: &[3, 2, 1],
            without_replacement: false,
            params: params(1.0, 0, 1.0),
            draft: None,
        },
        2,
    );
}

#[test]
fn exact_tree_without_replacement() {
    assert_exact(
        Case {
            name: "tree/without-replacement",
            widths: &[3, 2, 1],
            without_replacement: true,
            params: params(1.0, 0, 1.0),
            draft: None,
        },
        3,
    );
}

#[test]
fn exact_temperature_and_top_k() {
    // Three roots drawn without replacement from a top-3 draft exhaust its support.
    assert_exact(
        Case {
            name: "tree/T=0.7,top-k=3",
            widths: &[3, 2, 1],
            without_replacement: true,
            params: params(0.7, 3, 1.0),
            draft: None,
        },
        4,
    );
}

#[test]
fn exact_top_p() {
    assert_exact(
        Case {
            name: "tree/T=1.3,top-p=0.8",
            widths: &[2, 2, 1],
            without_replacement: false,
            params: params(1.3, 0, 0.8),
            draft: None,
        },
        5,
    );
}

#[test]
fn exact_with_a_narrower_proposal() {
    // The drafter samples from a top-2 cut of its distribution while the target keeps every
    // token (as a draft proposal with its far tail cut does): the tokens the proposal never
    // offers must still come out at the target's rate, through the residual.
    assert_exact(
        Case {
            name: "chain/proposal top-k=2",
            widths: &[1, 1, 1],
            without_replacement: false,
            params: params(1.0, 0, 1.0),
            draft: Some(params(1.0, 2, 1.0)),
        },
        6,
    );
}

/// Runs a deliberately wrong verifier and asserts the chi-square test rejects it.
fn assert_detected(case: Case, verifier: Verifier, seed: u64) {
    let (pv, _) = run_case(&case, verifier, seed);
    assert!(
        pv < ALPHA,
        "{}: the chi-square test missed a wrong verifier (p = {pv})",
        case.name
    );
}

#[test]
fn power_detects_missing_residual() {
    let case = Case {
        name: "WRONG no residual (chain)",
        widths: &[1, 1, 1],
        without_replacement: false,
        params: params(1.0, 0, 1.0),
        draft: None,
    };
    assert_detected(case, no_residual_verifier, 6);
}

#[test]
fn power_detects_independent_acceptance() {
    let case = Case {
        name: "WRONG independent acceptance (tree)",
        widths: &[3, 2, 1],
        without_replacement: false,
        params: params(1.0, 0, 1.0),
        draft: None,
    };
    assert_detected(case, independent_verifier, 7);
}

#[test]
fn power_detects_sibling_rule_mismatch() {
    let case = Case {
        name: "WRONG with-replacement rule on distinct siblings",
        widths: &[3, 2, 1],
        without_replacement: true,
        params: params(1.0, 0, 1.0),
        draft: None,
    };
    assert_detected(case, mismatched_rule_verifier, 8);
}

#[test]
fn power_detects_residual_with_updated_q() {
    let case = Case {
        name: "WRONG residual after removing x from q",
        widths: &[3, 2, 1],
        without_replacement: true,
        params: params(1.0, 0, 1.0),
        draft: None,
    };
    assert_detected(case, late_residual_verifier, 9);
}

/// When the draft distribution equals the target's, every drafted token is accepted.
#[test]
fn identical_draft_is_always_accepted() {
    let params = params(0.9, 4, 0.95);
    let mut rng = ChaCha8Rng::seed_from_u64(10);
    for _ in 0..2_000 {
        let mut tree = TokenTree::new();
        let mut ctx: Vec<u32> = Vec::new();
        for d in 0..4 {
            let q = TARGET.dist(&ctx, &params);
            let t = sample(&q, &mut rng);
            if d == 0 {
                tree.push_root(t, 0.0).unwrap();
                tree.set_root_distribution(q);
            } else {
                tree.push_child(d - 1, t, 0.0).unwrap();
                tree.set_child_distribution(d - 1, q).unwrap();
            }
            ctx.push(t);
        }
        let v = verify_stochastic(&tree, &TARGET.rows(&tree), V, &params, &mut rng).unwrap();
        assert_eq!(v.accepted_tokens, ctx);
        assert!(v.bonus);
        assert!(TARGET.dist(&ctx, &params).prob(v.next_token) > 0.0);
    }
}

/// Unusable inputs are typed errors, never panics.
#[test]
fn stochastic_rejects_unusable_inputs() {
    use specsplit_core::sampling::SamplingError;
    use specsplit_core::tree::TreeError;
    use specsplit_core::verify::VerifyError;
    let p = params(1.0, 0, 1.0);
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let mut tree = TokenTree::chain(&[1, 2]);
    let rows = vec![0.0f32; 3 * V];
    assert_eq!(
        verify_stochastic(&tree, &rows, V, &p, &mut rng),
        Err(VerifyError::Tree(TreeError::MissingDistribution {
            node: None
        }))
    );
    tree.set_root_distribution(Distribution::Dense(vec![1.0 / V as f32; V]));
    assert_eq!(
        verify_stochastic(&tree, &rows, V, &p, &mut rng),
        Err(VerifyError::Tree(TreeError::MissingDistribution {
            node: Some(0)
        }))
    );
    tree.set_child_distribution(
        0,
        Distribution::Sparse {
            ids: vec![3],
            probs: vec![1.0],
        },
    )
    .unwrap();
    assert!(matches!(
        verify_stochastic(&tree, &rows, V, &p, &mut rng),
        Err(VerifyError::Tree(TreeError::DrawnTokenHasZeroDraftProb {
            node: 1,
            token: 2,
            parent: Some(0)
        }))
    ));
    tree.set_child_distribution(
        0,
        Distribution::Sparse {
            ids: vec![2],
            probs: vec![1.0],
        },
    )
    .unwrap();
    assert!(verify_stochastic(&tree, &rows, V, &p, &mut rng).is_ok());
    let mut nan_rows = rows.clone();
    nan_rows[2] = f32::NAN;
    assert_eq!(
        verify_stochastic(&tree, &nan_rows, V, &p, &mut rng),
        Err(VerifyError::BadLogits {
            row: 0,
            source: SamplingError::NanLogit { index: 2 }
        })
    );
    let bad = SamplingParams {
        temperature: -1.0,
        ..p
    };
    assert!(matches!(
        verify_stochastic(&tree, &rows, V, &bad, &mut rng),
        Err(VerifyError::InvalidParams(_))
    ));
    let big = TokenTree::chain(&[V as u32]);
    assert!(matches!(
        verify_stochastic(&big, &rows[..2 * V], V, &p, &mut rng),
        Err(VerifyError::Tree(TreeError::TokenOutOfVocab {
            node: 0,
            ..
        }))
    ));
}
