//! Statistical exactness of point-mass verification (`verify_point_mass`), the rule for trees
//! that carry no draft distributions (the original SpecSplit client sends only tokens, their
//! log-probabilities and informational top-k lists). The joint distribution of the first three
//! emitted tokens must match the target's exact distribution (chi-square goodness of fit at
//! significance 0.001) whatever way the tokens were drafted: greedily, from the target's
//! least likely tokens, or sampled with repeats. Deliberately wrong verifiers (one trusting the
//! informational probabilities as the proposal, one that keeps a rejected token in the
//! residual) must fail the same test.

mod common;
#[path = "common/joint.rs"]
mod joint;

use common::ctx_logits;
use joint::{emitted_joint_test, SyntheticTarget};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specsplit_core::sampling::{sample, top_w, warp, SamplingParams};
use specsplit_core::tree::{Distribution, TokenTree};
use specsplit_core::verify::verify_point_mass;

const V: usize = 6;
const POSITIONS: usize = 3;
const DRAWS: usize = 60_000;
const ALPHA: f64 = 0.001;
const TARGET_SEED: u64 = 11;
const DRAFT_SEED: u64 = 23;
const SCALE: f32 = 2.0;
const TARGET: SyntheticTarget = SyntheticTarget {
    seed: TARGET_SEED,
    vocab: V,
    scale: SCALE,
};

/// The drafter's own distribution (unrelated to the target's).
fn draft_dist(ctx: &[u32]) -> Distribution {
    warp(&ctx_logits(DRAFT_SEED, ctx, V, SCALE), &params(1.0, 0, 1.0))
}

fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        seed: 0,
    }
}

/// How the drafter picks `w` children after a context.
#[derive(Clone, Copy, Debug)]
enum Drafter {
    /// The draft model's `w` most likely tokens (the original client's greedy drafting).
    DraftGreedy,
    /// The target's `w` least likely tokens, under the target's own parameters (adversarial).
    TargetWorst,
    /// `w` independent samples from the draft model: siblings may repeat.
    DraftSampledWithRepeats,
}

impl Drafter {
    fn pick(self, ctx: &[u32], w: usize, p: &SamplingParams, rng: &mut ChaCha8Rng) -> Vec<u32> {
        match self {
            Drafter::DraftGreedy => top_w(&ctx_logits(DRAFT_SEED, ctx, V, SCALE), w),
            Drafter::TargetWorst => {
                let t = TARGET.dist(ctx, p);
                let mut ids: Vec<u32> = (0..V as u32).collect();
                ids.sort_by(|&a, &b| t.prob(a).total_cmp(&t.prob(b)).then(a.cmp(&b)));
                ids.truncate(w);
                ids
            }
            Drafter::DraftSampledWithRepeats => {
                let q = draft_dist(ctx);
                (0..w).map(|_| sample(&q, rng)).collect()
            }
        }
    }
}

/// One test case: tree widths per depth, drafter and sampling parameters.
struct Case {
    name: &'static str,
    widths: &'static [usize],
    drafter: Drafter,
    params: SamplingParams,
}

/// Drafts a tree without distributions, as the original client sends it: each node carries
/// the draft model's log-probability of its token and, as informational top-k, the draft
/// model's three likeliest next tokens.
fn draft_tree(case: &Case, rng: &mut ChaCha8Rng) -> TokenTree {
    let mut tree = TokenTree::new();
    let q0 = draft_dist(&[]);
    for t in case.drafter.pick(&[], case.widths[0], &case.params, rng) {
        tree.push_root(t, q0.prob(t).ln()).unwrap();
    }
    let mut level: Vec<usize> = tree.roots().collect();
    for depth in 0..case.widths.len() {
        let mut next = Vec::new();
        for &node in &level {
            let ctx = tree.path_tokens(node);
            let q = draft_dist(&ctx);
            let ids = top_w(&ctx_logits(DRAFT_SEED, &ctx, V, SCALE), 3);
            let probs = ids.iter().map(|&t| q.prob(t)).collect();
            tree.set_top_k(node, ids, probs).unwrap();
            if depth + 1 < case.widths.len() {
                let kids = case
                    .drafter
                    .pick(&ctx, case.widths[depth + 1], &case.params, rng);
                for t in kids {
                    next.push(tree.push_child(node, t, q.prob(t).ln()).unwrap());
                }
            }
        }
        level = next;
    }
    assert!(!tree.has_any_distribution());
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
    verify_point_mass(tree, rows, V, p, rng)
        .unwrap()
        .emitted_tokens()
}

fn dense(d: &Distribution) -> Vec<f64> {
    (0..V as u32).map(|t| f64::from(d.prob(t))).collect()
}

fn draw(weights: &[f64], rng: &mut ChaCha8Rng) -> u32 {
    let d = Distribution::Dense(weights.iter().map(|&w| w as f32).collect());
    sample(&d, rng)
}

/// WRONG: speculative sampling with the informational numbers as the proposal q: the roots'
/// `exp(log_prob)` and, below a node, that node's top-k probabilities. Accepts with
/// `min(1, p/q)` and moves to `norm(max(0, p − q))` after a rejection.
fn informational_q_verifier(
    tree: &TokenTree,
    _rows: &[f32],
    p: &SamplingParams,
    rng: &mut ChaCha8Rng,
) -> Vec<u32> {
    let mut out = Vec::new();
    let mut parent: Option<usize> = None;
    loop {
        let mut pv = dense(&TARGET.dist(&out, p));
        let candidates = parent.map_or(tree.roots(), |c| tree.children(c));
        let mut q = vec![0.0f64; V];
        match parent {
            None => {
                for c in candidates.clone() {
                    q[tree.token(c) as usize] = f64::from(tree.log_prob(c).exp());
                }
            }
            Some(c) => {
                let (ids, probs) = tree.top_k(c);
                for (&t, &pr) in ids.iter().zip(probs) {
                    q[t as usize] = f64::from(pr);
                }
            }
        }
        let mut accepted = None;
        for c in candidates {
            let x = tree.token(c) as usize;
            if rng.random::<f64>() * q[x] < pv[x] {
                accepted = Some(c);
                break;
            }
            let r: Vec<f64> = pv.iter().zip(&q).map(|(a, b)| (a - b).max(0.0)).collect();
            let rs: f64 = r.iter().sum();
            if rs > 0.0 {
                pv = r.iter().map(|v| v / rs).collect();
            }
        }
        match accepted {
            Some(c) => {
                out.push(tree.token(c));
                parent = Some(c);
            }
            None => {
                out.push(draw(&pv, rng));
                return out;
            }
        }
    }
}

/// WRONG: the point-mass rule without removing a rejected token from the residual (every
/// sibling is accepted with its plain target probability, and the next token is drawn from the
/// unchanged target distribution).
fn keeps_rejected_verifier(
    tree: &TokenTree,
    _rows: &[f32],
    p: &SamplingParams,
    rng: &mut ChaCha8Rng,
) -> Vec<u32> {
    let mut out = Vec::new();
    let mut parent: Option<usize> = None;
    loop {
        let pv = dense(&TARGET.dist(&out, p));
        let candidates = parent.map_or(tree.roots(), |c| tree.children(c));
        let accepted = candidates
            .into_iter()
            .find(|&c| rng.random::<f64>() < pv[tree.token(c) as usize]);
        match accepted {
            Some(c) => {
                out.push(tree.token(c));
                parent = Some(c);
            }
            None => {
                out.push(draw(&pv, rng));
                return out;
            }
        }
    }
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
        mean_accepted > 0.01,
        "{}: suspiciously few acceptances ({mean_accepted})",
        case.name
    );
}

fn assert_detected(case: Case, verifier: Verifier, seed: u64) {
    let (pv, _) = run_case(&case, verifier, seed);
    assert!(
        pv < ALPHA,
        "{}: the chi-square test missed a wrong verifier (p = {pv})",
        case.name
    );
}

#[test]
fn exact_chain_drafted_greedily() {
    assert_exact(
        Case {
            name: "chain/draft greedy",
            widths: &[1, 1, 1],
            drafter: Drafter::DraftGreedy,
            params: params(1.0, 0, 1.0),
        },
        1,
    );
}

#[test]
fn exact_chain_of_the_targets_least_likely_tokens() {
    assert_exact(
        Case {
            name: "chain/target worst",
            widths: &[1, 1, 1],
            drafter: Drafter::TargetWorst,
            params: params(1.0, 0, 1.0),
        },
        2,
    );
}

#[test]
fn exact_tree_of_the_targets_least_likely_siblings() {
    assert_exact(
        Case {
            name: "tree/target worst",
            widths: &[3, 2, 1],
            drafter: Drafter::TargetWorst,
            params: params(1.0, 0, 1.0),
        },
        3,
    );
}

#[test]
fn exact_tree_drafted_greedily_with_top_p() {
    assert_exact(
        Case {
            name: "tree/draft greedy, T=1.3 top-p=0.8",
            widths: &[3, 2, 1],
            drafter: Drafter::DraftGreedy,
            params: params(1.3, 0, 0.8),
        },
        4,
    );
}

#[test]
fn exact_tree_with_repeated_siblings_and_top_k() {
    // The drafter ignores the target's top-3 cut: drafted tokens outside the target's support
    // must never be emitted (chi_square asserts that zero-probability cells stay empty), and
    // repeated siblings must not be accepted twice as likely.
    assert_exact(
        Case {
            name: "tree/sampled with repeats, T=0.7 top-k=3",
            widths: &[4, 3, 1],
            drafter: Drafter::DraftSampledWithRepeats,
            params: params(0.7, 3, 1.0),
        },
        5,
    );
}

#[test]
fn power_detects_informational_proposal() {
    assert_detected(
        Case {
            name: "WRONG informational q (tree, draft greedy)",
            widths: &[3, 2, 1],
            drafter: Drafter::DraftGreedy,
            params: params(1.0, 0, 1.0),
        },
        informational_q_verifier,
        6,
    );
}

#[test]
fn power_detects_rejected_token_kept_in_residual() {
    assert_detected(
        Case {
            name: "WRONG rejected token kept (chain, target worst)",
            widths: &[1, 1, 1],
            drafter: Drafter::TargetWorst,
            params: params(1.0, 0, 1.0),
        },
        keeps_rejected_verifier,
        7,
    );
}

#[test]
fn power_detects_rejected_token_kept_in_residual_tree() {
    assert_detected(
        Case {
            name: "WRONG rejected token kept (tree, draft greedy)",
            widths: &[3, 2, 1],
            drafter: Drafter::DraftGreedy,
            params: params(1.0, 0, 1.0),
        },
        keeps_rejected_verifier,
        8,
    );
}

/// Greedy parameters follow the rows' argmaxes; bad inputs are typed errors.
#[test]
fn greedy_and_unusable_inputs() {
    use specsplit_core::tree::TreeError;
    use specsplit_core::verify::VerifyError;
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    let tree = TokenTree::chain(&[1, 2]);
    let mut rows = vec![0.0f32; 3 * V];
    rows[1] = 5.0; // row 0 argmax 1: root accepted
    rows[V + 4] = 5.0; // row 1 argmax 4: child 2 rejected, correction 4
    let v = verify_point_mass(&tree, &rows, V, &params(0.0, 0, 1.0), &mut rng).unwrap();
    assert_eq!(v.emitted_tokens(), vec![1, 4]);
    let p = params(1.0, 0, 1.0);
    assert!(matches!(
        verify_point_mass(&tree, &rows[..2 * V], V, &p, &mut rng),
        Err(VerifyError::WrongLogitsLength { .. })
    ));
    let big = TokenTree::chain(&[V as u32]);
    assert!(matches!(
        verify_point_mass(&big, &rows[..2 * V], V, &p, &mut rng),
        Err(VerifyError::Tree(TreeError::TokenOutOfVocab {
            node: 0,
            ..
        }))
    ));
    let mut nan_rows = rows.clone();
    nan_rows[0] = f32::NAN;
    assert!(matches!(
        verify_point_mass(&tree, &nan_rows, V, &p, &mut rng),
        Err(VerifyError::BadLogits { row: 0, .. })
    ));
    // A token the target gives probability zero (top-k = 1 keeps only the argmax) is never
    // accepted.
    for _ in 0..200 {
        let v = verify_point_mass(
            &TokenTree::chain(&[0]),
            &rows[..2 * V],
            V,
            &params(1.0, 1, 1.0),
            &mut rng,
        )
        .unwrap();
        assert_eq!(v.emitted_tokens(), vec![1]);
    }
}
