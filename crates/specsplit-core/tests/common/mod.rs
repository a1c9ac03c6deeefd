//! Helpers shared by the integration tests of specsplit-core.
#![allow(dead_code)]

use proptest::prelude::*;
use specsplit_core::tree::{Distribution, TokenTree};

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

// ------------------------------------------------------------------------------------------
// Chi-square p-value: Q(df/2, x/2), the regularised upper incomplete gamma function.
// ------------------------------------------------------------------------------------------

/// ln Γ(a) for a positive multiple of 1/2 (exact recurrence down to Γ(1) = 1 or Γ(1/2) = √π).
pub fn ln_gamma_half_integer(a: f64) -> f64 {
    assert!(
        a > 0.0 && (a * 2.0).fract() == 0.0,
        "a = {a} must be a positive multiple of 1/2"
    );
    let mut acc = if a.fract() == 0.0 {
        0.0
    } else {
        0.5 * std::f64::consts::PI.ln()
    };
    let mut z = if a.fract() == 0.0 { 1.0 } else { 0.5 };
    while z < a {
        acc += z.ln();
        z += 1.0;
    }
    acc
}

/// Regularised upper incomplete gamma Q(a, x): power series for P when x < a + 1, else a
/// continued fraction for Q (evaluated with the modified Lentz method).
pub fn gamma_q(a: f64, x: f64) -> f64 {
    if x <= 0.0 {
        return 1.0;
    }
    let log_prefactor = -x + a * x.ln() - ln_gamma_half_integer(a);
    if x < a + 1.0 {
        // P(a, x) = e^{-x} x^a / Γ(a) · Σ_n x^n / (a (a+1) ... (a+n)).
        let mut term = 1.0 / a;
        let mut sum = term;
        let mut denom = a;
        for _ in 0..10_000 {
            denom += 1.0;
            term *= x / denom;
            sum += term;
            if term.abs() < sum.abs() * 1e-15 {
                break;
            }
        }
        1.0 - sum * log_prefactor.exp()
    } else {
        // Q(a, x) = e^{-x} x^a / Γ(a) · 1/(x+1-a - 1(1-a)/(x+3-a - 2(2-a)/(x+5-a - ...))).
        let tiny = 1e-300;
        let mut b = x + 1.0 - a;
        let mut c = 1.0 / tiny;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..10_000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            if d.abs() < tiny {
                d = tiny;
            }
            c = b + an / c;
            if c.abs() < tiny {
                c = tiny;
            }
            d = 1.0 / d;
            let delta = d * c;
            h *= delta;
            if (delta - 1.0).abs() < 1e-15 {
                break;
            }
        }
        log_prefactor.exp() * h
    }
}

/// Chi-square goodness of fit: cells with zero expected probability must be empty (asserted);
/// cells with expected count < 5 are merged (smallest first). Returns (statistic, df, p-value).
pub fn chi_square(observed: &[u64], expected_prob: &[f64], label: &str) -> (f64, usize, f64) {
    let n: u64 = observed.iter().sum();
    let total_p: f64 = expected_prob.iter().sum();
    let mut cells: Vec<(f64, f64)> = Vec::new();
    for (o, &p) in observed.iter().zip(expected_prob) {
        if p == 0.0 {
            assert_eq!(
                *o, 0,
                "{label}: emitted a sequence the target can never produce"
            );
            continue;
        }
        cells.push((p / total_p * n as f64, *o as f64));
    }
    cells.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut merged: Vec<(f64, f64)> = Vec::new();
    let mut pool = (0.0, 0.0);
    for (e, o) in cells {
        pool.0 += e;
        pool.1 += o;
        if pool.0 >= 5.0 {
            merged.push(pool);
            pool = (0.0, 0.0);
        }
    }
    if pool.0 > 0.0 {
        match merged.last_mut() {
            Some(last) => {
                last.0 += pool.0;
                last.1 += pool.1;
            }
            None => merged.push(pool),
        }
    }
    let stat: f64 = merged.iter().map(|(e, o)| (o - e) * (o - e) / e).sum();
    let df = merged.len().saturating_sub(1).max(1);
    (stat, df, gamma_q(df as f64 / 2.0, stat / 2.0))
}
