//! `warp` against a straightforward full-sort reference (same arithmetic), and sampling sanity.

use proptest::prelude::*;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use specsplit_core::sampling::{
    argmax, proposal, sample_without_replacement, top_w, warp, SamplingParams, PROPOSAL_TAIL,
};
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

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// A draft proposal is the warped distribution minus at most `PROPOSAL_TAIL` of its mass,
    /// renormalised, over the most likely tokens; or the whole warped distribution when the cut
    /// would keep more than half of the vocabulary.
    #[test]
    fn proposal_cuts_only_the_far_tail(raw in prop::collection::vec(-400i32..40, 2..4000),
                                       t in prop_oneof![Just(0.5f32), Just(1.0f32), Just(1.5f32)],
                                       top_k in prop_oneof![Just(0usize), Just(50usize)]) {
        let logits: Vec<f32> = raw.iter().map(|&x| x as f32 / 10.0).collect();
        let params = SamplingParams { temperature: t, top_k, top_p: 1.0, seed: 1 };
        let full = as_pairs(&warp(&logits, &params));
        let q = proposal(&logits, &params);
        let got = as_pairs(&q);
        let support = got.iter().filter(|p| p.1 > 0.0).count();
        let full_support = full.iter().filter(|p| p.1 > 0.0).count();
        if support > logits.len() / 2 || support == full_support {
            prop_assert_eq!(&got, &full);
        } else {
            // The kept tokens are the most likely ones, and hold ≥ 1 - tail of the mass.
            let mut by_prob = full.clone();
            by_prob.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            let kept: f64 = by_prob[..support].iter().map(|p| f64::from(p.1)).sum();
            prop_assert!(kept >= 1.0 - f64::from(PROPOSAL_TAIL) - 1e-5, "kept mass {kept}");
            let lookup = |id: u32| full.iter().find(|p| p.0 == id).map_or(0.0, |p| p.1);
            for &(id, pr) in &got {
                prop_assert!(pr > 0.0);
                // Renormalised: each kept probability is its full one divided by the kept mass.
                prop_assert!((f64::from(pr) - f64::from(lookup(id)) / kept).abs() < 1e-5);
            }
        }
    }
}

#[test]
fn proposal_of_a_peaked_large_vocabulary_row_is_short() {
    // 150k tokens, a handful of likely ones: the proposal lists only those.
    let mut logits = vec![-20.0f32; 150_000];
    for (i, l) in [3.0f32, 2.5, 2.0, 1.0].iter().enumerate() {
        logits[1000 * i + 7] = *l;
    }
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 0,
        top_p: 1.0,
        seed: 1,
    };
    match proposal(&logits, &params) {
        Distribution::Sparse { ids, probs } => {
            assert!(ids.len() < 100, "{} tokens", ids.len());
            let s: f32 = probs.iter().sum();
            assert!((s - 1.0).abs() < 1e-5);
        }
        d => panic!(
            "expected a sparse proposal, got {} entries dense",
            d.num_entries()
        ),
    }
    // A flat row stays dense: cutting its tail would keep almost every token anyway.
    let flat = vec![0.0f32; 1000];
    assert!(matches!(proposal(&flat, &params), Distribution::Dense(_)));
}
