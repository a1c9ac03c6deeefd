//! Sampled speculative decoding over loopback gRPC reproduces the target's own distribution:
//! the joint distribution of the first two generated tokens passes a chi-square
//! goodness-of-fit test against the exact target probabilities (computed here with the model
//! directly), at significance 0.001.

use std::collections::HashMap;

use candle_core::{Device, Tensor};
use specsplit_core::sampling::{warp, SamplingParams};
use specsplit_e2e::{config, start_draft, start_target};
use specsplit_models::loader::{load_model, LoadOptions};
use specsplit_orchestrator::{DrafterChoice, GenerateConfig, Mode, Orchestrator, Pipeline};

const TARGET: &str = "random:tiny:7";
const PROMPT: &[u32] = &[11, 42, 7, 300];
const DRAWS: u64 = 2500;

fn params() -> SamplingParams {
    SamplingParams {
        temperature: 0.8,
        top_k: 5,
        top_p: 1.0,
        seed: 0,
    }
}

/// Exact probabilities of (x1, x2) under target-only sampling.
fn exact_joint() -> HashMap<(u32, u32), f64> {
    let m = load_model(
        TARGET,
        &LoadOptions {
            device: Device::Cpu,
            dtype: None,
        },
    )
    .unwrap();
    let next = |seq: &[u32]| -> Vec<(u32, f32)> {
        let mut cache = m.model.new_cache(64).unwrap();
        let ids = Tensor::new(seq, &Device::Cpu).unwrap();
        let pos: Vec<u32> = (0..seq.len() as u32).collect();
        let pos = Tensor::new(pos.as_slice(), &Device::Cpu).unwrap();
        let rows = Tensor::new(&[(seq.len() - 1) as u32], &Device::Cpu).unwrap();
        let logits = m
            .model
            .forward(&ids, &pos, None, &mut cache, &rows)
            .unwrap();
        let row: Vec<f32> = logits.squeeze(0).unwrap().to_vec1().unwrap();
        warp(&row, &params())
            .iter()
            .filter(|(_, p)| *p > 0.0)
            .collect()
    };
    let mut joint = HashMap::new();
    for (x1, p1) in next(PROMPT) {
        let mut seq = PROMPT.to_vec();
        seq.push(x1);
        for (x2, p2) in next(&seq) {
            joint.insert((x1, x2), p1 as f64 * p2 as f64);
        }
    }
    joint
}

/// Upper tail probability of the chi-square distribution with `k` degrees of freedom.
fn chi2_sf(x: f64, k: f64) -> f64 {
    // Regularised upper incomplete gamma Q(k/2, x/2) by series / continued fraction.
    let (a, x) = (k / 2.0, x / 2.0);
    let ln_gamma = |z: f64| -> f64 {
        // Lanczos approximation (g = 7).
        const C: [f64; 9] = [
            0.999_999_999_999_809_9,
            676.520_368_121_885_1,
            -1_259.139_216_722_402_8,
            771.323_428_777_653_1,
            -176.615_029_162_140_6,
            12.507_343_278_686_905,
            -0.138_571_095_265_720_12,
            9.984_369_578_019_572e-6,
            1.505_632_735_149_311_6e-7,
        ];
        let z = z - 1.0;
        let mut s = C[0];
        for (i, c) in C.iter().enumerate().skip(1) {
            s += c / (z + i as f64);
        }
        let t = z + 7.5;
        0.5 * (2.0 * std::f64::consts::PI).ln() + (z + 0.5) * t.ln() - t + s.ln()
    };
    if x < a + 1.0 {
        let (mut sum, mut term, mut n) = (1.0 / a, 1.0 / a, a);
        for _ in 0..10_000 {
            n += 1.0;
            term *= x / n;
            sum += term;
            if term < sum * 1e-15 {
                break;
            }
        }
        1.0 - sum * (-x + a * x.ln() - ln_gamma(a)).exp()
    } else {
        let mut b = x + 1.0 - a;
        let mut c = 1e300;
        let mut d = 1.0 / b;
        let mut h = d;
        for i in 1..10_000 {
            let an = -(i as f64) * (i as f64 - a);
            b += 2.0;
            d = an * d + b;
            d = if d.abs() < 1e-300 { 1e-300 } else { d };
            c = b + an / c;
            c = if c.abs() < 1e-300 { 1e-300 } else { c };
            d = 1.0 / d;
            let del = d * c;
            h *= del;
            if (del - 1.0).abs() < 1e-15 {
                break;
            }
        }
        (-x + a * x.ln() - ln_gamma(a)).exp() * h
    }
}

/// Chi-square p-value of `counts` against `probs`, merging cells expected below 5.
fn p_value(counts: &HashMap<(u32, u32), u64>, probs: &HashMap<(u32, u32), f64>, n: u64) -> f64 {
    let unexpected: u64 = counts
        .iter()
        .filter(|(k, _)| !probs.contains_key(k))
        .map(|(_, c)| *c)
        .sum();
    assert_eq!(
        unexpected, 0,
        "tokens outside the target's support were emitted"
    );
    let mut cells: Vec<(f64, f64)> = probs
        .iter()
        .map(|(k, p)| (p * n as f64, *counts.get(k).unwrap_or(&0) as f64))
        .collect();
    cells.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut merged: Vec<(f64, f64)> = Vec::new();
    let mut acc = (0.0, 0.0);
    for c in cells {
        acc = (acc.0 + c.0, acc.1 + c.1);
        if acc.0 >= 5.0 {
            merged.push(acc);
            acc = (0.0, 0.0);
        }
    }
    if acc.0 > 0.0 {
        if let Some(last) = merged.last_mut() {
            *last = (last.0 + acc.0, last.1 + acc.1);
        }
    }
    let stat: f64 = merged.iter().map(|(e, o)| (o - e) * (o - e) / e).sum();
    chi2_sf(stat, (merged.len() - 1) as f64)
}

async fn sample_joint(orch: &Orchestrator, cfg: GenerateConfig) -> HashMap<(u32, u32), u64> {
    let mut counts = HashMap::new();
    let mut seed = 1;
    while seed <= DRAWS {
        let batch: Vec<_> = (seed..(seed + 8).min(DRAWS + 1))
            .map(|s| {
                let (o, c) = (
                    orch.clone(),
                    GenerateConfig {
                        seed: s,
                        ..cfg.clone()
                    },
                );
                tokio::spawn(async move { o.generate(PROMPT, &c, |_| {}).await.unwrap().token_ids })
            })
            .collect();
        seed += batch.len() as u64;
        for h in batch {
            let t = h.await.unwrap();
            *counts.entry((t[0], t[1])).or_insert(0) += 1;
        }
    }
    counts
}

#[test]
fn chi2_sf_matches_known_quantiles() {
    assert!((chi2_sf(3.841_458_8, 1.0) - 0.05).abs() < 1e-6);
    assert!((chi2_sf(18.307_038, 10.0) - 0.05).abs() < 1e-6);
    assert!((chi2_sf(66.618_9, 35.0) - 0.001).abs() < 2e-5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sampled_speculation_matches_target_distribution() {
    let target = start_target(&config(TARGET, true)).await;
    let draft = start_draft(&config("random:tiny:8", false)).await;
    let orch = Orchestrator::connect(Some(&draft.url), &target.url)
        .await
        .unwrap();
    let exact = exact_joint();
    assert!(exact.len() >= 10, "support of the joint: {}", exact.len());
    let p = params();
    let base = GenerateConfig {
        max_tokens: 2,
        temperature: p.temperature,
        top_k: p.top_k,
        ..Default::default()
    };
    let cases = [
        (
            "target only",
            GenerateConfig {
                mode: Mode::Ar,
                ..base.clone()
            },
        ),
        (
            "chain, sequential",
            GenerateConfig {
                widths: vec![1, 1],
                pipeline: Pipeline::Sequential,
                ..base.clone()
            },
        ),
        (
            "chain, pre-drafted for every outcome",
            GenerateConfig {
                widths: vec![1, 1],
                pipeline: Pipeline::Predraft,
                candidates: 2,
                ..base.clone()
            },
        ),
        (
            "tree, overlapped",
            GenerateConfig {
                widths: vec![3, 2],
                pipeline: Pipeline::Overlapped,
                ..base.clone()
            },
        ),
        // Model-free drafts (point-mass trees without distributions), drafted here.
        (
            "n-gram tree",
            GenerateConfig {
                widths: vec![3, 2],
                drafter: DrafterChoice::Ngram,
                ..base.clone()
            },
        ),
        (
            "online choice",
            GenerateConfig {
                widths: vec![3, 2],
                drafter: DrafterChoice::Auto,
                ..base.clone()
            },
        ),
    ];
    for (name, cfg) in cases {
        let counts = sample_joint(&orch, cfg).await;
        let pv = p_value(&counts, &exact, DRAWS);
        assert!(pv > 0.001, "{name}: chi-square p-value {pv}");
    }
    assert_eq!(target.sessions.len(), 0);
    target.stop().await;
    draft.stop().await;
}
