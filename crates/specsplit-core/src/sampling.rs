//! Sampling transforms shared bit-for-bit by the draft and the target: temperature, softmax,
//! top-k, top-p and renormalisation ([`warp`]), plus greedy selection and random draws.
//!
//! Everything here is deterministic: the same logits and parameters always give the same
//! distribution, and the same distribution and RNG state always give the same draw.

use std::cmp::Ordering;

use rand::Rng;

use crate::tree::Distribution;

/// Why sampling parameters or logits cannot be used.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// Temperature negative, NaN or infinite.
    #[error("temperature {value} is invalid: it must be finite and >= 0 (0 means greedy)")]
    InvalidTemperature {
        /// The offending value.
        value: f32,
    },
    /// Negative top-k on the wire.
    #[error("top_k {value} is invalid: it must be >= 0 (0 disables top-k)")]
    InvalidTopK {
        /// The offending value.
        value: i64,
    },
    /// top-p outside `[0, 1]` or NaN.
    #[error("top_p {value} is invalid: it must lie in [0, 1] (0 or 1 disables top-p)")]
    InvalidTopP {
        /// The offending value.
        value: f32,
    },
    /// An empty logits row.
    #[error("the logits row is empty")]
    EmptyLogits,
    /// A NaN logit.
    #[error("logit #{index} is NaN")]
    NanLogit {
        /// Token id of the NaN logit.
        index: usize,
    },
    /// Every logit is negative infinity: no token is possible.
    #[error("every logit is -inf: no token has positive probability")]
    NoFiniteLogits,
}

/// Sampling parameters; the default is greedy decoding.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Temperature; 0 means greedy (argmax) and disables the other transforms.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 disables top-k.
    pub top_k: usize,
    /// Nucleus threshold; 0 or 1 disables top-p.
    pub top_p: f32,
    /// Seed of the session's random choices.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding parameters (temperature 0).
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Whether decoding is greedy (temperature not strictly positive).
    pub fn is_greedy(&self) -> bool {
        self.temperature.partial_cmp(&0.0) != Some(Ordering::Greater)
    }

    /// Checks temperature (finite, >= 0) and top-p (in `[0, 1]`).
    pub fn validate(&self) -> Result<(), SamplingError> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(SamplingError::InvalidTemperature {
                value: self.temperature,
            });
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return Err(SamplingError::InvalidTopP { value: self.top_p });
        }
        Ok(())
    }

    /// Whether top-p truncation is active (0 < top_p < 1).
    fn top_p_active(&self) -> bool {
        self.top_p > 0.0 && self.top_p < 1.0
    }
}

/// Whether `x` is strictly positive (false for NaN).
pub(crate) fn is_positive(x: f64) -> bool {
    x > 0.0
}

/// Ordering key of a logit: NaN ranks below everything.
fn logit_key(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x
    }
}

/// Descending by value, ties broken by lower token id.
fn desc_then_id<T: PartialOrd>(va: T, vb: T, a: u32, b: u32) -> Ordering {
    vb.partial_cmp(&va)
        .unwrap_or(Ordering::Equal)
        .then(a.cmp(&b))
}

/// Index of the largest logit; ties go to the lowest id, NaN ranks lowest, empty gives 0.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &x) in logits.iter().enumerate() {
        let k = logit_key(x);
        if k > best_v {
            best = i;
            best_v = k;
        }
    }
    best as u32
}

/// The `w` largest logits' ids, best first (ties → lower id; NaN lowest); greedy siblings.
pub fn top_w(logits: &[f32], w: usize) -> Vec<u32> {
    let w = w.min(logits.len());
    if w == 0 {
        return Vec::new();
    }
    let cmp = |a: &u32, b: &u32| {
        desc_then_id(
            logit_key(logits[*a as usize]),
            logit_key(logits[*b as usize]),
            *a,
            *b,
        )
    };
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    if w < idx.len() {
        idx.select_nth_unstable_by(w - 1, cmp);
        idx.truncate(w);
    }
    idx.sort_unstable_by(cmp);
    idx
}

/// Like [`warp`], but rejects empty rows, NaN logits and rows where every logit is -inf.
pub fn try_warp(logits: &[f32], params: &SamplingParams) -> Result<Distribution, SamplingError> {
    if logits.is_empty() {
        return Err(SamplingError::EmptyLogits);
    }
    if let Some(index) = logits.iter().position(|x| x.is_nan()) {
        return Err(SamplingError::NanLogit { index });
    }
    if logits.iter().all(|&x| x == f32::NEG_INFINITY) {
        return Err(SamplingError::NoFiniteLogits);
    }
    Ok(warp(logits, params))
}

/// The sampling distribution of a logits row: divide by temperature, softmax (f64), keep the
/// `top_k` most likely tokens (ties → lower id), keep the smallest prefix of the sorted
/// distribution whose mass reaches `top_p` of the kept mass, renormalise.
///
/// Returns [`Distribution::Sparse`] (ids by decreasing probability) when tokens were cut and
/// [`Distribution::Dense`] otherwise. Greedy parameters give a one-hot on [`argmax`]. Never
/// panics: NaN logits count as -inf, a row with no usable logit gives the uniform
/// distribution, `+inf` logits share all the mass, and an empty row gives an empty dense
/// distribution (use [`try_warp`] to reject such rows).
pub fn warp(logits: &[f32], params: &SamplingParams) -> Distribution {
    let v = logits.len();
    if v == 0 {
        return Distribution::Dense(Vec::new());
    }
    if params.is_greedy() {
        return Distribution::Sparse {
            ids: vec![argmax(logits)],
            probs: vec![1.0],
        };
    }
    let p = softmax_f64(logits, f64::from(params.temperature));
    let k = if params.top_k > 0 && params.top_k < v {
        params.top_k
    } else {
        v
    };
    let top_p = params.top_p_active();
    if k == v && !top_p {
        return Distribution::Dense(p.iter().map(|&x| x as f32).collect());
    }
    let cmp = |a: &u32, b: &u32| desc_then_id(p[*a as usize], p[*b as usize], *a, *b);
    let mut idx: Vec<u32> = (0..v as u32).collect();
    if k < v {
        idx.select_nth_unstable_by(k - 1, cmp);
        idx.truncate(k);
        idx.sort_unstable_by(cmp);
        if top_p {
            let kept: f64 = idx.iter().map(|&i| p[i as usize]).sum();
            let threshold = f64::from(params.top_p) * kept;
            let keep = nucleus_len(&idx, &p, threshold).unwrap_or(idx.len());
            idx.truncate(keep);
        }
    } else {
        // Top-p alone: sort only a growing head of the ranking until it holds the nucleus.
        // The comparator is a total order, so the head is exactly a prefix of the full sort.
        let threshold = f64::from(params.top_p) * p.iter().sum::<f64>();
        let mut m = v.min(256);
        idx = loop {
            if m < v {
                idx.select_nth_unstable_by(m - 1, cmp);
            }
            let mut head = idx[..m].to_vec();
            head.sort_unstable_by(cmp);
            match nucleus_len(&head, &p, threshold) {
                Some(keep) => {
                    head.truncate(keep);
                    break head;
                }
                None if m == v => break head,
                None => m = m.saturating_mul(4).min(v),
            }
        };
    }
    let total: f64 = idx.iter().map(|&i| p[i as usize]).sum();
    if idx.len() == v {
        return Distribution::Dense(p.iter().map(|&x| (x / total) as f32).collect());
    }
    let probs = idx
        .iter()
        .map(|&i| (p[i as usize] / total) as f32)
        .collect();
    Distribution::Sparse { ids: idx, probs }
}

/// Mass of the far tail a draft proposal may leave out (see [`proposal`]).
pub const PROPOSAL_TAIL: f32 = 1e-4;

/// The distribution a drafter samples its tokens from: [`warp`] with the far tail cut (top-p at
/// `1 - PROPOSAL_TAIL`, or the caller's own top-p if smaller), so it travels as a short sparse
/// list instead of a vocabulary-sized vector; the full warped distribution when the cut would
/// still keep more than half of the vocabulary (a near-flat row). Speculative sampling stays
/// exact for any proposal as long as the verifier is given the one the tokens were drawn from;
/// leaving out 1e-4 of the mass changes acceptance by at most that much.
pub fn proposal(logits: &[f32], params: &SamplingParams) -> Distribution {
    let cut = SamplingParams {
        top_p: if params.top_p_active() {
            params.top_p.min(1.0 - PROPOSAL_TAIL)
        } else {
            1.0 - PROPOSAL_TAIL
        },
        ..*params
    };
    match warp(logits, &cut) {
        Distribution::Sparse { ids, .. } if ids.len() > logits.len() / 2 => warp(logits, params),
        d => d,
    }
}

/// Length of the shortest prefix of `sorted` whose mass reaches `threshold`, if any.
fn nucleus_len(sorted: &[u32], p: &[f64], threshold: f64) -> Option<usize> {
    let mut cum = 0.0f64;
    for (j, &i) in sorted.iter().enumerate() {
        cum += p[i as usize];
        if cum >= threshold {
            return Some(j + 1);
        }
    }
    None
}

/// Numerically stable softmax of `logits / temperature`, in f64, with the edge cases of
/// [`warp`] (NaN as -inf, uniform when nothing is usable, `+inf` sharing the mass).
fn softmax_f64(logits: &[f32], temperature: f64) -> Vec<f64> {
    let v = logits.len();
    let n_pos_inf = logits.iter().filter(|&&x| x == f32::INFINITY).count();
    if n_pos_inf > 0 {
        let share = 1.0 / n_pos_inf as f64;
        return logits
            .iter()
            .map(|&x| if x == f32::INFINITY { share } else { 0.0 })
            .collect();
    }
    let scaled = |x: f32| -> f64 {
        if x.is_finite() {
            f64::from(x) / temperature
        } else {
            f64::NEG_INFINITY
        }
    };
    let m = logits
        .iter()
        .map(|&x| scaled(x))
        .fold(f64::NEG_INFINITY, f64::max);
    if !m.is_finite() {
        return vec![1.0 / v as f64; v];
    }
    let mut p: Vec<f64> = logits.iter().map(|&x| (scaled(x) - m).exp()).collect();
    let sum: f64 = p.iter().sum();
    for x in &mut p {
        *x /= sum;
    }
    p
}

/// Draws an index from non-negative weights (normalised by their f64 total). A zero-weight
/// entry is never drawn; when the total is not positive, returns `None`.
pub(crate) fn draw_index<R: Rng + ?Sized>(weights: &[f64], rng: &mut R) -> Option<usize> {
    let total: f64 = weights.iter().sum();
    if !is_positive(total) || !total.is_finite() {
        return None;
    }
    let u = rng.random::<f64>() * total;
    let mut cum = 0.0f64;
    let mut last_positive = None;
    for (i, &w) in weights.iter().enumerate() {
        if w > 0.0 {
            cum += w;
            last_positive = Some(i);
            if cum > u {
                return Some(i);
            }
        }
    }
    last_positive
}

/// Token id of entry `j` of a distribution's stored entries.
fn entry_token(dist: &Distribution, j: usize) -> u32 {
    match dist {
        Distribution::Dense(_) => j as u32,
        Distribution::Sparse { ids, .. } => ids[j],
    }
}

/// Non-negative f64 weights of a distribution's stored entries (invalid entries weigh 0).
fn entry_weights(dist: &Distribution) -> Vec<f64> {
    let probs = match dist {
        Distribution::Dense(p) => p,
        Distribution::Sparse { probs, .. } => probs,
    };
    probs
        .iter()
        .map(|&p| {
            if p.is_finite() && p > 0.0 {
                f64::from(p)
            } else {
                0.0
            }
        })
        .collect()
}

/// Draws one token from `dist` (normalised by its total; one uniform f64 from `rng`).
/// A distribution without positive mass yields its first stored id (or 0).
pub fn sample<R: Rng + ?Sized>(dist: &Distribution, rng: &mut R) -> u32 {
    let probs = match dist {
        Distribution::Dense(p) => p,
        Distribution::Sparse { probs, .. } => probs,
    };
    let weight = |p: f32| {
        if p.is_finite() && p > 0.0 {
            f64::from(p)
        } else {
            0.0
        }
    };
    let total: f64 = probs.iter().map(|&p| weight(p)).sum();
    if !is_positive(total) || !total.is_finite() {
        return if dist.num_entries() > 0 {
            entry_token(dist, 0)
        } else {
            0
        };
    }
    // Same arithmetic as `draw_index`, without materialising the weights.
    let u = rng.random::<f64>() * total;
    let mut cum = 0.0f64;
    let mut last_positive = 0;
    for (j, &p) in probs.iter().enumerate() {
        let w = weight(p);
        if w > 0.0 {
            cum += w;
            last_positive = j;
            if cum > u {
                return entry_token(dist, j);
            }
        }
    }
    entry_token(dist, last_positive)
}

/// Draws up to `k` distinct tokens sequentially, each from `dist` restricted to the tokens not
/// yet drawn and renormalised. Returns fewer than `k` when the support runs out.
pub fn sample_without_replacement<R: Rng + ?Sized>(
    dist: &Distribution,
    k: usize,
    rng: &mut R,
) -> Vec<u32> {
    let mut weights = entry_weights(dist);
    let mut out = Vec::with_capacity(k.min(weights.len()));
    while out.len() < k {
        match draw_index(&weights, rng) {
            Some(j) => {
                out.push(entry_token(dist, j));
                weights[j] = 0.0;
            }
            None => break,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn sampled(t: f32, k: usize, p: f32) -> SamplingParams {
        SamplingParams {
            temperature: t,
            top_k: k,
            top_p: p,
            seed: 1,
        }
    }

    #[test]
    fn argmax_and_top_w_break_ties_by_lower_id() {
        let l = [1.0, 3.0, f32::NAN, 3.0, 2.0];
        assert_eq!(argmax(&l), 1);
        assert_eq!(top_w(&l, 3), vec![1, 3, 4]);
        assert_eq!(top_w(&l, 10), vec![1, 3, 4, 0, 2]);
        assert_eq!(argmax(&[]), 0);
    }

    #[test]
    fn warp_dense_when_untruncated_and_sums_to_one() {
        let d = warp(&[0.0, 1.0, 2.0], &sampled(1.0, 0, 1.0));
        let Distribution::Dense(p) = &d else {
            panic!("expected dense")
        };
        assert!((p.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(p[2] > p[1] && p[1] > p[0]);
    }

    #[test]
    fn warp_top_k_ties_and_top_p() {
        let d = warp(&[1.0, 2.0, 2.0, 0.0], &sampled(1.0, 2, 1.0));
        let Distribution::Sparse { ids, probs } = &d else {
            panic!("expected sparse")
        };
        assert_eq!(ids, &vec![1, 2]);
        assert!((probs[0] - 0.5).abs() < 1e-6);
        // p ~ [0.0871, 0.2369, 0.6439, 0.0321]: top-p 0.7 keeps {2, 1}.
        let d = warp(&[1.0, 2.0, 3.0, 0.0], &sampled(1.0, 0, 0.7));
        let Distribution::Sparse { ids, .. } = &d else {
            panic!("expected sparse")
        };
        assert_eq!(ids, &vec![2, 1]);
        // top-p is measured on the top-k renormalised mass: top-2 {2: .731, 1: .269}.
        let d = warp(&[1.0, 2.0, 3.0, 0.0], &sampled(1.0, 2, 0.72));
        assert_eq!(
            d,
            Distribution::Sparse {
                ids: vec![2],
                probs: vec![1.0]
            }
        );
    }

    #[test]
    fn warp_edge_cases_never_panic() {
        assert_eq!(
            warp(&[], &sampled(1.0, 0, 1.0)),
            Distribution::Dense(vec![])
        );
        let d = warp(&[f32::NEG_INFINITY; 4], &sampled(1.0, 0, 1.0));
        assert_eq!(d, Distribution::Dense(vec![0.25; 4]));
        let d = warp(&[0.0, f32::INFINITY, 1.0], &sampled(0.5, 0, 1.0));
        assert_eq!(d.prob(1), 1.0);
        let d = warp(&[1e30, -1e30, 0.0], &sampled(1e-30, 0, 1.0));
        assert_eq!(d.prob(0), 1.0);
        assert_eq!(
            try_warp(&[0.0, f32::NAN], &sampled(1.0, 0, 1.0)),
            Err(SamplingError::NanLogit { index: 1 })
        );
        assert_eq!(warp(&[0.0, 5.0], &SamplingParams::greedy()).prob(1), 1.0);
    }

    #[test]
    fn params_validation() {
        let bad = |t: f32, p: f32| sampled(t, 0, p).validate();
        assert!(matches!(
            bad(-1.0, 1.0),
            Err(SamplingError::InvalidTemperature { .. })
        ));
        assert!(matches!(
            bad(f32::NAN, 1.0),
            Err(SamplingError::InvalidTemperature { .. })
        ));
        assert!(matches!(
            bad(1.0, 1.5),
            Err(SamplingError::InvalidTopP { .. })
        ));
        assert!(matches!(
            bad(1.0, f32::NAN),
            Err(SamplingError::InvalidTopP { .. })
        ));
        assert!(sampled(0.7, 5, 0.9).validate().is_ok());
        assert!(SamplingParams::default().is_greedy());
    }

    #[test]
    fn without_replacement_draws_distinct_tokens_until_support_ends() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let d = Distribution::Sparse {
            ids: vec![7, 2, 9],
            probs: vec![0.5, 0.5, 0.0],
        };
        for _ in 0..100 {
            let mut s = sample_without_replacement(&d, 5, &mut rng);
            s.sort_unstable();
            assert_eq!(s, vec![2, 7]);
            assert_ne!(sample(&d, &mut rng), 9);
        }
    }
}
