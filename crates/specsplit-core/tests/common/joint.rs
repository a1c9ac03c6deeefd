//! The harness of the statistical verification tests: a synthetic target and a chi-square test
//! that the tokens a drafter and a verifier emit follow the target's joint distribution.

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use specsplit_core::sampling::{sample, warp, SamplingParams};
use specsplit_core::tree::{Distribution, TokenTree};

use crate::common::{chi_square, ctx_logits};

/// A target model over `vocab` tokens whose logits are deterministic pseudo-random functions of
/// the context ([`ctx_logits`]).
pub struct SyntheticTarget {
    /// Seed of the logits.
    pub seed: u64,
    /// Vocabulary size.
    pub vocab: usize,
    /// Logits lie in `[-scale, scale]`.
    pub scale: f32,
}

impl SyntheticTarget {
    /// The raw logits after `ctx`.
    pub fn logits(&self, ctx: &[u32]) -> Vec<f32> {
        ctx_logits(self.seed, ctx, self.vocab, self.scale)
    }

    /// The warped distribution after `ctx`.
    pub fn dist(&self, ctx: &[u32], params: &SamplingParams) -> Distribution {
        warp(&self.logits(ctx), params)
    }

    /// The rows a verifier receives for `tree`: after the prefix, then after each node's path.
    pub fn rows(&self, tree: &TokenTree) -> Vec<f32> {
        let mut rows = self.logits(&[]);
        for i in 0..tree.len() {
            rows.extend(self.logits(&tree.path_tokens(i)));
        }
        rows
    }
}

/// Runs `draws` rounds of `round` (a draft and its verification, returning the emitted tokens:
/// the accepted ones and the next), completes each round's tokens to `positions` by sampling
/// the target, and returns the chi-square p-value of their joint against the target's exact
/// joint `p(x1) p(x2 | x1) …`, plus the mean number of accepted tokens a round. One generator,
/// seeded by `seed`, serves the rounds and the completions.
pub fn emitted_joint_test(
    label: &str,
    target: &SyntheticTarget,
    params: &SamplingParams,
    positions: usize,
    draws: usize,
    seed: u64,
    mut round: impl FnMut(&mut ChaCha8Rng) -> Vec<u32>,
) -> (f64, f64) {
    let v = target.vocab;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let cells = v.pow(positions as u32);
    let mut observed = vec![0u64; cells];
    let mut accepted_total = 0usize;
    for _ in 0..draws {
        let mut emitted = round(&mut rng);
        accepted_total += emitted.len() - 1;
        while emitted.len() < positions {
            let t = sample(&target.dist(&emitted, params), &mut rng);
            emitted.push(t);
        }
        let cell = emitted[..positions]
            .iter()
            .fold(0usize, |acc, &t| acc * v + t as usize);
        observed[cell] += 1;
    }
    let mut expected = vec![0.0f64; cells];
    for (cell, e) in expected.iter_mut().enumerate() {
        let toks: Vec<u32> = (0..positions)
            .rev()
            .map(|k| ((cell / v.pow(k as u32)) % v) as u32)
            .collect();
        *e = (0..positions)
            .map(|k| f64::from(target.dist(&toks[..k], params).prob(toks[k])))
            .product();
    }
    let (stat, df, pv) = chi_square(&observed, &expected, label);
    let mean_accepted = accepted_total as f64 / draws as f64;
    eprintln!(
        "{label}: chi2 = {stat:.1}, df = {df}, p = {pv:.4}, mean accepted = {mean_accepted:.3}"
    );
    (pv, mean_accepted)
}
