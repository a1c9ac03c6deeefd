//! Statistical exactness of sampled verification for model-free drafts: the n-gram and suffix
//! drafters propose deterministic trees (point masses, no draft distributions) from a history
//! of tokens, here random per round, and `verify_point_mass` must emit tokens distributed as
//! the target's own sampling (chi-square goodness of fit of the first three emitted tokens at
//! significance 0.001). A deliberately wrong verifier, speculative sampling that takes the
//! drafter's branch frequencies as the proposal q, must fail the same test.

mod common;
#[path = "common/joint.rs"]
mod joint;

use joint::{emitted_joint_test, SyntheticTarget};
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use specsplit_core::drafter::ngram::{NgramConfig, NgramDrafter};
use specsplit_core::drafter::suffix::{SuffixConfig, SuffixDrafter};
use specsplit_core::drafter::DraftShape;
use specsplit_core::sampling::SamplingParams;
use specsplit_core::tree::{Distribution, TokenTree};
use specsplit_core::verify::{verify_point_mass, verify_stochastic};

const V: usize = 4;
const POSITIONS: usize = 3;
const DRAWS: usize = 60_000;
const ALPHA: f64 = 0.001;
const TARGET: SyntheticTarget = SyntheticTarget {
    seed: 31,
    vocab: V,
    scale: 2.0,
};
const SHAPE: DraftShape = DraftShape {
    depth: 3,
    branches: 3,
    max_nodes: 9,
};

fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        seed: 0,
    }
}

#[derive(Clone, Copy, Debug)]
enum Kind {
    Ngram,
    Suffix,
}

/// A random history of 24 tokens and the drafter's tree after it.
fn draft(kind: Kind, rng: &mut ChaCha8Rng) -> TokenTree {
    let history: Vec<u32> = (0..24).map(|_| rng.random_range(0..V as u32)).collect();
    match kind {
        Kind::Ngram => NgramDrafter::new(NgramConfig::default()).draft(&history, SHAPE),
        Kind::Suffix => {
            let cfg = SuffixConfig {
                max_spec_factor: 3.0,
                min_prob: 0.05,
                ..SuffixConfig::default()
            };
            SuffixDrafter::new(cfg, None).draft(&history, SHAPE)
        }
    }
}

/// WRONG for deterministic drafts: the tree with each parent's children weighted by the
/// drafter's branch frequencies (`exp(log_prob)`, renormalised) as the proposal q, verified as
/// if the children had been sampled from q.
fn with_frequencies_as_proposal(tree: &TokenTree) -> TokenTree {
    let mut t = tree.clone();
    let weights = |nodes: std::ops::Range<usize>| {
        let ids: Vec<u32> = nodes.clone().map(|c| tree.token(c)).collect();
        let probs: Vec<f32> = nodes.map(|c| tree.log_prob(c).exp().max(1e-3)).collect();
        let total: f32 = probs.iter().sum();
        Distribution::Sparse {
            ids,
            probs: probs.iter().map(|p| p / total).collect(),
        }
    };
    t.set_root_distribution(weights(tree.roots()));
    for i in 0..tree.len() {
        let kids = tree.children(i);
        let d = if kids.is_empty() {
            Distribution::Dense(vec![1.0 / V as f32; V])
        } else {
            weights(kids)
        };
        t.set_child_distribution(i, d).unwrap();
    }
    t.set_siblings_without_replacement(true);
    t
}

fn run(kind: Kind, p: &SamplingParams, broken: bool, seed: u64) -> (f64, f64) {
    emitted_joint_test(
        &format!("{kind:?} broken={broken}"),
        &TARGET,
        p,
        POSITIONS,
        DRAWS,
        seed,
        |rng| {
            let tree = draft(kind, rng);
            let rows = TARGET.rows(&tree);
            let v = if broken {
                verify_stochastic(&with_frequencies_as_proposal(&tree), &rows, V, p, rng)
            } else {
                verify_point_mass(&tree, &rows, V, p, rng)
            };
            v.unwrap().emitted_tokens()
        },
    )
}

fn assert_exact(kind: Kind, p: SamplingParams, seed: u64) {
    let (pv, mean_accepted) = run(kind, &p, false, seed);
    assert!(pv >= ALPHA, "{kind:?}: p-value {pv} < {ALPHA}");
    assert!(
        mean_accepted > 0.05,
        "{kind:?}: suspiciously few acceptances ({mean_accepted})"
    );
}

#[test]
fn exact_ngram_trees() {
    assert_exact(Kind::Ngram, params(1.0, 0, 1.0), 1);
}

#[test]
fn exact_suffix_trees_with_top_p() {
    assert_exact(Kind::Suffix, params(0.8, 0, 0.9), 2);
}

#[test]
fn model_free_trees_branch() {
    // The power test below needs siblings: the drafters do branch on these histories.
    let mut rng = <ChaCha8Rng as rand::SeedableRng>::seed_from_u64(5);
    for kind in [Kind::Ngram, Kind::Suffix] {
        let branching = (0..200)
            .filter(|_| draft(kind, &mut rng).roots().count() > 1)
            .count();
        assert!(
            branching > 20,
            "{kind:?}: only {branching} of 200 trees branch"
        );
    }
}

#[test]
fn power_detects_frequencies_taken_as_the_proposal() {
    for (kind, seed) in [(Kind::Ngram, 3), (Kind::Suffix, 4)] {
        let (pv, _) = run(kind, &params(1.0, 0, 1.0), true, seed);
        assert!(
            pv < ALPHA,
            "{kind:?}: the chi-square test missed a wrong verifier (p = {pv})"
        );
    }
}
