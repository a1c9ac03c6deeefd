//! Verification of a draft tree against the target's outputs for every tree node.
//!
//! Row convention (for both `target_next` and `target_logits`): row 0 is the target's output
//! after the prefix alone (it scores the roots), row `i + 1` its output after node `i`'s
//! root-to-node path (it scores node `i`'s children, or the bonus token when `i` is a leaf).
//!
//! - [`verify_greedy`] follows, level by level, the first child whose token is the target's
//!   argmax, so the emitted tokens are exactly the target-alone greedy continuation.
//! - [`verify_stochastic`] is lossless multi-step speculative sampling for trees (SpecInfer):
//!   children are tried in order, each accepted with probability `min(1, p(x)/q(x))`; after a
//!   rejection `p ← norm(max(0, p − q))`, and with siblings drawn without replacement also
//!   `q ← q` without `x`, renormalised (recursive rejection sampling). The emitted tokens are
//!   distributed exactly as target-alone sampling.
//! - [`verify_point_mass`] is the same guarantee for trees that carry no draft distributions
//!   (clients that send only the drafted tokens): each drafted token is treated as a point-mass
//!   proposal `δ_x`. Children are tried in order, each accepted with probability `p(x)` under the
//!   current residual `p`; after a rejection `p ← p` without `x`, renormalised; when every child
//!   is rejected the next token is drawn from the final residual. Each step is speculative
//!   sampling with proposal `δ_x`, so the emitted tokens follow target-alone sampling whatever
//!   way the draft chose its tokens.

use rand::Rng;

use crate::sampling::{argmax, draw_index, is_positive, try_warp, SamplingError, SamplingParams};
use crate::tree::{Distribution, DistributionError, TokenTree, TreeError};

/// Outcome of verifying one tree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    /// Accepted node indices, root first (a root-to-node path; empty when the first level is
    /// rejected).
    pub accepted_nodes: Vec<usize>,
    /// Tokens of `accepted_nodes`.
    pub accepted_tokens: Vec<u32>,
    /// The target's own next token after the accepted path (correction or bonus).
    pub next_token: u32,
    /// True when the accepted path ends at a leaf (so `next_token` is a bonus token).
    pub bonus: bool,
}

impl Verdict {
    /// Number of accepted draft tokens.
    pub fn num_accepted(&self) -> usize {
        self.accepted_nodes.len()
    }

    /// Accepted tokens followed by `next_token`: everything this round emits.
    pub fn emitted_tokens(&self) -> Vec<u32> {
        let mut out = self.accepted_tokens.clone();
        out.push(self.next_token);
        out
    }
}

/// Why a tree could not be verified.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum VerifyError {
    /// `target_next` does not have one entry per node plus one.
    #[error(
        "expected {expected} target tokens (one per tree node plus one for the prefix), got {got}"
    )]
    WrongTargetLength {
        /// Nodes + 1.
        expected: usize,
        /// Actual length.
        got: usize,
    },
    /// `target_logits` is not `(nodes + 1) × vocab_size`.
    #[error("expected {rows} logits rows of {vocab_size} ({expected} values; one row per tree node plus one), got {got} values")]
    WrongLogitsLength {
        /// Rows expected (nodes + 1).
        rows: usize,
        /// Vocabulary size.
        vocab_size: usize,
        /// Values expected (saturating).
        expected: usize,
        /// Values received.
        got: usize,
    },
    /// A vocabulary size of zero.
    #[error("the vocabulary size must be positive")]
    ZeroVocab,
    /// Invalid sampling parameters.
    #[error("invalid sampling parameters: {0}")]
    InvalidParams(#[source] SamplingError),
    /// A target logits row that yields no distribution (NaN, all -inf).
    #[error("target logits row {row} is unusable: {source}")]
    BadLogits {
        /// Row index.
        row: usize,
        /// What is wrong.
        #[source]
        source: SamplingError,
    },
    /// The tree lacks what verification needs.
    #[error(transparent)]
    Tree(#[from] TreeError),
}

/// Greedy verification: `target_next[0]` is the target's argmax after the prefix,
/// `target_next[i + 1]` its argmax after node `i`. Emits exactly the target's greedy tokens.
pub fn verify_greedy(tree: &TokenTree, target_next: &[u32]) -> Result<Verdict, VerifyError> {
    let expected = tree.len() + 1;
    if target_next.len() != expected {
        return Err(VerifyError::WrongTargetLength {
            expected,
            got: target_next.len(),
        });
    }
    Ok(greedy_walk(tree, |row| target_next[row]))
}

/// Follows the first child matching the target's choice at each level.
fn greedy_walk(tree: &TokenTree, mut target_at: impl FnMut(usize) -> u32) -> Verdict {
    let mut accepted = Vec::new();
    let mut candidates = tree.roots();
    let mut row = 0;
    loop {
        let want = target_at(row);
        match candidates.clone().find(|&c| tree.token(c) == want) {
            Some(c) => {
                accepted.push(c);
                row = c + 1;
                candidates = tree.children(c);
            }
            None => return finish(tree, accepted, want),
        }
    }
}

/// Assembles a verdict from the accepted path and the next token.
fn finish(tree: &TokenTree, accepted_nodes: Vec<usize>, next_token: u32) -> Verdict {
    let bonus = accepted_nodes.last().is_some_and(|&c| tree.is_leaf(c));
    let accepted_tokens = accepted_nodes.iter().map(|&c| tree.token(c)).collect();
    Verdict {
        accepted_nodes,
        accepted_tokens,
        next_token,
        bonus,
    }
}

/// The checks of a sampled verifier's inputs: valid parameters, a vocabulary, and
/// `tree.len() + 1` rows of `vocab_size` logits.
fn check_logits(
    tree: &TokenTree,
    target_logits: &[f32],
    vocab_size: usize,
    params: &SamplingParams,
) -> Result<(), VerifyError> {
    params.validate().map_err(VerifyError::InvalidParams)?;
    if vocab_size == 0 {
        return Err(VerifyError::ZeroVocab);
    }
    let rows = tree.len() + 1;
    let expected = rows.saturating_mul(vocab_size);
    if target_logits.len() != expected {
        return Err(VerifyError::WrongLogitsLength {
            rows,
            vocab_size,
            expected,
            got: target_logits.len(),
        });
    }
    Ok(())
}

/// Every drafted token lies inside the vocabulary.
fn check_tokens(tree: &TokenTree, vocab_size: usize) -> Result<(), VerifyError> {
    match tree.tokens().iter().position(|&t| t as usize >= vocab_size) {
        Some(node) => Err(TreeError::TokenOutOfVocab {
            node,
            token: i64::from(tree.token(node)),
            vocab_size,
        }
        .into()),
        None => Ok(()),
    }
}

/// Lossless stochastic verification. `target_logits` holds `tree.len() + 1` rows of
/// `vocab_size` raw logits (row convention in the module docs); `params` are the same
/// transforms the draft applied. Greedy parameters reduce to [`verify_greedy`] on the rows'
/// argmaxes. Sampled parameters need [`TokenTree::require_distributions`].
///
/// A rejection whose residual `max(0, p − q)` has no mass (possible only through rounding,
/// when `p ≤ q` everywhere, i.e. `p = q` and the rejection itself had probability ~0) keeps
/// the current `p`, so the emitted token always stays inside the target's support.
pub fn verify_stochastic<R: Rng + ?Sized>(
    tree: &TokenTree,
    target_logits: &[f32],
    vocab_size: usize,
    params: &SamplingParams,
    rng: &mut R,
) -> Result<Verdict, VerifyError> {
    check_logits(tree, target_logits, vocab_size, params)?;
    let row_of = |r: usize| &target_logits[r * vocab_size..(r + 1) * vocab_size];
    if params.is_greedy() {
        return Ok(greedy_walk(tree, |r| argmax(row_of(r))));
    }
    check_tokens(tree, vocab_size)?;
    tree.require_distributions()?;

    let without_replacement = tree.siblings_without_replacement();
    let mut p = vec![0.0f64; vocab_size];
    let mut q = vec![0.0f64; vocab_size];
    let mut residual = vec![0.0f64; vocab_size];
    let mut accepted = Vec::new();
    let mut parent: Option<usize> = None;
    let mut row = 0usize;
    'level: loop {
        let target = try_warp(row_of(row), params)
            .map_err(|source| VerifyError::BadLogits { row, source })?;
        load_dense(&mut p, &target);
        let candidates = match parent {
            None => tree.roots(),
            Some(c) => tree.children(c),
        };
        if !candidates.is_empty() {
            let dist = match parent {
                None => tree.root_distribution(),
                Some(c) => tree.child_distribution(c),
            }
            .ok_or(TreeError::MissingDistribution { node: parent })?;
            load_draft(&mut q, dist).map_err(|reason| TreeError::BadDistribution {
                node: parent,
                reason,
            })?;
            for c in candidates {
                let token = tree.token(c);
                let x = token as usize;
                let (px, qx) = (p[x], q[x]);
                if !is_positive(qx) {
                    return Err(TreeError::DrawnTokenHasZeroDraftProb {
                        node: c,
                        token,
                        parent,
                    }
                    .into());
                }
                // Accept with probability min(1, p(x)/q(x)).
                let u: f64 = rng.random();
                if u * qx < px {
                    accepted.push(c);
                    parent = Some(c);
                    row = c + 1;
                    continue 'level;
                }
                // Rejected: p ← norm(max(0, p − q)) with the q that x was drawn from.
                let mut mass = 0.0f64;
                for ((r, &pv), &qv) in residual.iter_mut().zip(&p).zip(&q) {
                    *r = (pv - qv).max(0.0);
                    mass += *r;
                }
                if mass > 0.0 && mass.is_finite() {
                    for r in &mut residual {
                        *r /= mass;
                    }
                    std::mem::swap(&mut p, &mut residual);
                }
                if without_replacement {
                    q[x] = 0.0;
                    normalize(&mut q);
                }
            }
        }
        let next = match draw_index(&p, rng) {
            Some(j) => j as u32,
            None => argmax(row_of(row)),
        };
        return Ok(finish(tree, accepted, next));
    }
}

/// Lossless stochastic verification of a tree without draft distributions: each drafted token
/// is a point-mass proposal (rule in the module docs). Same inputs, row convention and errors
/// as [`verify_stochastic`], except that the tree's draft distributions (if any) are ignored,
/// so it needs none. Greedy parameters reduce to [`verify_greedy`] on the rows' argmaxes.
///
/// Siblings may repeat a token: a rejected token has no mass left in the residual, so a repeat
/// of it is always rejected.
pub fn verify_point_mass<R: Rng + ?Sized>(
    tree: &TokenTree,
    target_logits: &[f32],
    vocab_size: usize,
    params: &SamplingParams,
    rng: &mut R,
) -> Result<Verdict, VerifyError> {
    check_logits(tree, target_logits, vocab_size, params)?;
    let row_of = |r: usize| &target_logits[r * vocab_size..(r + 1) * vocab_size];
    if params.is_greedy() {
        return Ok(greedy_walk(tree, |r| argmax(row_of(r))));
    }
    check_tokens(tree, vocab_size)?;
    let mut p = vec![0.0f64; vocab_size];
    let mut accepted = Vec::new();
    let mut parent: Option<usize> = None;
    let mut row = 0usize;
    'level: loop {
        let target = try_warp(row_of(row), params)
            .map_err(|source| VerifyError::BadLogits { row, source })?;
        load_dense(&mut p, &target);
        // The residual is kept unnormalised: `mass` is its total.
        let mut mass: f64 = p.iter().sum();
        let candidates = match parent {
            None => tree.roots(),
            Some(c) => tree.children(c),
        };
        for c in candidates {
            let x = tree.token(c) as usize;
            // Accept with probability p(x) / mass (the residual's normalised probability); a
            // token outside the residual's support never.
            let u: f64 = rng.random();
            if p[x] > 0.0 && u * mass < p[x] {
                accepted.push(c);
                parent = Some(c);
                row = c + 1;
                continue 'level;
            }
            // Rejected: remove x's mass from the residual.
            mass -= p[x];
            p[x] = 0.0;
        }
        let next = match draw_index(&p, rng) {
            Some(j) => j as u32,
            None => argmax(row_of(row)),
        };
        return Ok(finish(tree, accepted, next));
    }
}

/// Writes a warped target distribution into a dense f64 buffer.
fn load_dense(buf: &mut [f64], dist: &Distribution) {
    match dist {
        Distribution::Dense(pr) if pr.len() == buf.len() => {
            for (b, &x) in buf.iter_mut().zip(pr) {
                *b = f64::from(x);
            }
        }
        _ => {
            buf.fill(0.0);
            for (t, pr) in dist.iter() {
                if let Some(slot) = buf.get_mut(t as usize) {
                    *slot = f64::from(pr);
                }
            }
        }
    }
}

/// Writes a draft distribution into a dense f64 buffer normalised to total 1, checking that it
/// fits the vocabulary and is a usable distribution.
fn load_draft(buf: &mut [f64], dist: &Distribution) -> Result<(), DistributionError> {
    let vocab_size = buf.len();
    let bad = |value: f32| !value.is_finite() || value < 0.0;
    match dist {
        Distribution::Dense(pr) => {
            if pr.len() != vocab_size {
                return Err(DistributionError::DenseLength {
                    len: pr.len(),
                    vocab_size,
                });
            }
            if let Some(index) = pr.iter().position(|&x| bad(x)) {
                return Err(DistributionError::InvalidProbability {
                    index,
                    value: pr[index],
                });
            }
            for (b, &x) in buf.iter_mut().zip(pr) {
                *b = f64::from(x);
            }
        }
        Distribution::Sparse { ids, probs } => {
            if ids.len() != probs.len() {
                return Err(DistributionError::LengthMismatch {
                    ids: ids.len(),
                    probs: probs.len(),
                });
            }
            buf.fill(0.0);
            for (index, (&t, &value)) in ids.iter().zip(probs).enumerate() {
                if bad(value) {
                    return Err(DistributionError::InvalidProbability { index, value });
                }
                let slot = buf
                    .get_mut(t as usize)
                    .ok_or(DistributionError::TokenOutOfVocab {
                        token: i64::from(t),
                        vocab_size,
                    })?;
                *slot = f64::from(value);
            }
        }
    }
    let total: f64 = buf.iter().sum();
    if !is_positive(total) {
        return Err(DistributionError::BadSum { sum: total });
    }
    for v in buf.iter_mut() {
        *v /= total;
    }
    Ok(())
}

/// Renormalises non-negative weights to total 1 (left as is when the total is zero).
fn normalize(buf: &mut [f64]) {
    let total: f64 = buf.iter().sum();
    if total > 0.0 {
        for v in buf.iter_mut() {
            *v /= total;
        }
    }
}
