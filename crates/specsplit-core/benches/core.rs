//! Host-side costs of one verification round on a 64-node tree: building the tree mask and
//! verifying greedily and stochastically (32k vocabulary).

use criterion::{criterion_group, criterion_main, Criterion};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use specsplit_core::mask::TreeMask;
use specsplit_core::sampling::{sample, sample_without_replacement, warp, SamplingParams};
use specsplit_core::tree::TokenTree;
use specsplit_core::verify::{verify_greedy, verify_stochastic};
use std::hint::black_box;

const VOCAB: usize = 32_000;
const WIDTHS: [usize; 5] = [4, 2, 2, 2, 1]; // 4 + 8 + 16 + 32 + 4 = 64 nodes (last level capped)
const NODES: usize = 64;

fn random_logits(rng: &mut ChaCha8Rng, rows: usize) -> Vec<f32> {
    (0..rows * VOCAB)
        .map(|_| rng.random_range(-8.0f32..8.0))
        .collect()
}

/// A 64-node tree drafted from random logits with `params`, carrying draft distributions.
fn drafted_tree(params: &SamplingParams, rng: &mut ChaCha8Rng) -> TokenTree {
    let mut tree = TokenTree::new();
    tree.set_siblings_without_replacement(true);
    let q0 = warp(&random_logits(rng, 1), params);
    for t in sample_without_replacement(&q0, WIDTHS[0], rng) {
        tree.push_root(t, q0.prob(t).ln()).unwrap();
    }
    tree.set_root_distribution(q0);
    let mut level: Vec<usize> = tree.roots().collect();
    for &w in &WIDTHS[1..] {
        let mut next = Vec::new();
        for &node in &level {
            if tree.len() >= NODES {
                break;
            }
            let q = warp(&random_logits(rng, 1), params);
            let w = w.min(NODES - tree.len());
            for t in sample_without_replacement(&q, w, rng) {
                next.push(tree.push_child(node, t, q.prob(t).ln()).unwrap());
            }
            tree.set_child_distribution(node, q).unwrap();
        }
        level = next;
    }
    assert_eq!(tree.len(), NODES);
    tree
}

fn bench_mask(c: &mut Criterion) {
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let tree = drafted_tree(
        &SamplingParams {
            temperature: 1.0,
            top_k: 50,
            ..Default::default()
        },
        &mut rng,
    );
    c.bench_function("mask/new+block_data (64 nodes)", |b| {
        b.iter(|| {
            let m = TreeMask::new(black_box(&tree));
            black_box((m.block_data(), m.positions(1000)))
        })
    });
    c.bench_function("mask/to_tensor cpu f32 (64 nodes, prefix 1024)", |b| {
        let m = TreeMask::new(&tree);
        b.iter(|| {
            black_box(
                m.to_tensor(1024, candle_core::DType::F32, &candle_core::Device::Cpu)
                    .unwrap(),
            )
        })
    });
}

fn bench_verify(c: &mut Criterion) {
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    let tree = drafted_tree(
        &SamplingParams {
            temperature: 1.0,
            ..Default::default()
        },
        &mut rng,
    );
    let target_next: Vec<u32> = (0..=NODES)
        .map(|i| tree.tokens().get(i).copied().unwrap_or(0))
        .collect();
    c.bench_function("verify/greedy (64 nodes)", |b| {
        b.iter(|| black_box(verify_greedy(black_box(&tree), &target_next).unwrap()))
    });

    let logits = random_logits(&mut rng, NODES + 1);
    for (name, params) in [
        (
            "verify/stochastic T=1 dense q (64 nodes, V=32k)",
            SamplingParams {
                temperature: 1.0,
                ..Default::default()
            },
        ),
        (
            "verify/stochastic T=0.8 top-p=0.9 (64 nodes, V=32k)",
            SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                ..Default::default()
            },
        ),
        (
            "verify/stochastic T=0.8 top-k=50 (64 nodes, V=32k)",
            SamplingParams {
                temperature: 0.8,
                top_k: 50,
                ..Default::default()
            },
        ),
    ] {
        let tree = drafted_tree(&params, &mut rng);
        let mut vrng = ChaCha8Rng::seed_from_u64(3);
        c.bench_function(name, |b| {
            b.iter(|| {
                black_box(
                    verify_stochastic(black_box(&tree), &logits, VOCAB, &params, &mut vrng)
                        .unwrap(),
                )
            })
        });
    }
    let p = SamplingParams {
        temperature: 0.8,
        top_p: 0.9,
        ..Default::default()
    };
    let row = &logits[..VOCAB];
    c.bench_function("sampling/warp T=0.8 top-p=0.9 (V=32k)", |b| {
        b.iter(|| black_box(warp(black_box(row), &p)))
    });
    let d = warp(
        row,
        &SamplingParams {
            temperature: 1.0,
            ..Default::default()
        },
    );
    c.bench_function("sampling/sample dense (V=32k)", |b| {
        b.iter(|| black_box(sample(&d, &mut rng)))
    });
}

criterion_group!(benches, bench_mask, bench_verify);
criterion_main!(benches);
