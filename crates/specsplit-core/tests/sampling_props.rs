//! `warp` against a straightforward full-sort reference (same arithmetic), and sampling sanity.

use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use specsplit_core::sampling::{argmax, sample_without_replacement, top_w, warp, SamplingParams};
use specsplit_core::tree::Distribution;

/// Reference: softmax in f64, full sort by (prob desc, id asc), top-k, then top-p on the kept mass.
fn reference(logits: &[f32], params: &SamplingParams) -> Vec<(u32, f32)> {
    let t = f64::from(params.temperature);
    let m = logits
        .iter()
        .map(|&x| f64::from(x) / t)
        .fold(f64::NEG_INFINITY, f64::max);
    let mut p: Vec<f64> = logits
        .iter()
        .map(|&x| (f64::from(x) / t - m).exp())
        .collect();
    let s: f64 = p.iter().sum();
    p.iter_mut().for_each(|x| *x /= s);
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    idx.sort_by(|&a, &b| {
        p[b as usize]
            .partial_cmp(&p[a as usize])
            .unwrap()
            .then(a.cmp(&b))
    });
    let v = logits.len();
    let k = if params.top_k > 0 && params.top_k < v {
        params.top_k
    } else {
        v
    };
    idx.truncate(k);
    if params.top_p > 0.0 && params.top_p < 1.0 {
        let kept: f64 = if k < v {
            idx.iter().map(|&i| p[i as usize]).sum()
        } else {
            p.iter().sum()
        };
        let thr = f64::from(params.top_p) * kept;
        let mut cum = 0.0;
        let mut keep = idx.len();
        for (j, &i) in idx.iter().enumerate() {
            cum += p[i as usize];
            if cum >= thr {
                keep = j + 1;
                break;
            }
        }
        idx.truncate(keep);
    }
    let total: f64 = idx.iter().map(|&i| p[i as usize]).sum();
    idx.iter()
        .map(|&i| (i, (p[i as usize] / total) as f32))
        .collect()
}

fn as_pairs(d: &Distribution) -> Vec<(u32, f32)> {
    match d {
        Distribution::Dense(p) => {
            let mut v: Vec<(u32, f32)> =
                p.iter().enumerate().map(|(i, &x)| (i as u32, x)).collect();
            v.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap().then(a.0.cmp(&b.0)));
            v
        }
        Distribution::Sparse { ids, probs } => {
            ids.iter().copied().zip(probs.iter().copied()).collect()
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// warp equals the full-sort reference exactly (quantised logits give many ties).
    #[test]
    fn warp_matches_reference(raw in prop::collection::vec(-40i32..40, 1..3000), t in 0.2f32..2.0,
                              k in prop_oneof![Just(0usize), 1usize..50, 1usize..4000],
                              top_p in prop_oneof![Just(1.0f32), Just(0.0f32), 0.01f32..1.0]) {
        let logits: Vec<f32> = raw.iter().map(|&x| x as f32 / 4.0).collect();
        let params = SamplingParams { temperature: t, top_k: k, top_p, seed: 0 };
        let d = warp(&logits, &params);
        let want = reference(&logits, &params);
        let truncated = want.len() < logits.len();
        prop_assert_eq!(matches!(d, Distribution::Sparse { .. }), truncated);
        let got = as_pairs(&d);
        if truncated {
            prop_assert_eq!(got, want);
        } else {
            // Dense: same probabilities per id.
            let mut g = got.clone();
            let mut w = want.clone();
            g.sort_by_key(|x| x.0);
            w.sort_by_key(|x| x.0);
            prop_assert_eq!(g.iter().map(|x| x.0).collect::<Vec<_>>(), w.iter().map(|x| x.0).collect::<Vec<_>>());
            for (a, b) in g.iter().zip(&w) {
                prop_assert!((a.1 - b.1).abs() <= 1e-6 * b.1.max(1e-30), "{a:?} vs {b:?}");
            }
        }
        prop_assert!((d.total() - 1.0).abs() < 1e-4);
        prop_assert_eq!(warp(&logits, &params), d);
    }

    /// Greedy helpers agree with each other; draws without replacement are distinct and in the support.
    #[test]
    fn greedy_helpers_and_distinct_draws(raw in prop::collection::vec(-5i32..5, 1..50), w in 0usize..60, seed in any::<u64>()) {
        let logits: Vec<f32> = raw.iter().map(|&x| x as f32).collect();
        let top = top_w(&logits, w);
        prop_assert_eq!(top.len(), w.min(logits.len()));
        if !top.is_empty() {
            prop_assert_eq!(top[0], argmax(&logits));
        }
        let d = warp(&logits, &SamplingParams { temperature: 1.0, top_k: 5, top_p: 1.0, seed: 0 });
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let s = sample_without_replacement(&d, w, &mut rng);
        let mut sorted = s.clone();
        sorted.sort_unstable();
        sorted.dedup();
        prop_assert_eq!(sorted.len(), s.len());
        prop_assert!(s.iter().all(|&t| d.prob(t) > 0.0));
    }
}
