//! Batch invariance on the CPU: a token's logits are bit-identical whether it is decoded alone
//! (a 1-row pass after its cached prefix) or computed inside a pass of any other size up to the
//! largest verify pass (a tree of 128 drafted nodes plus its root: 129 rows), as a causal chain
//! or as a tree node with siblings. Greedy speculation emits exactly what the target alone
//! emits only if this holds, for every weight format the CPU runs: each GGUF block type, and
//! dense f32 / f16.

mod reference_support;

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use reference_support::*;
use specsplit_core::mask::TreeMask;
use specsplit_core::tree::TokenTree;
use specsplit_models::cpu_attention::TreeRows;
use specsplit_models::transformer::Transformer;

/// The largest pass a verification runs: 128 tree nodes and the root.
const MAX_ROWS: usize = 129;

/// Cached tokens before every pass.
const PREFIX: usize = 5;

/// A cached prefix, a chain of [`MAX_ROWS`] tokens after it, and one sibling token per depth
/// (different from the chain's token there).
struct Case {
    prefix: Vec<u32>,
    chain: Vec<u32>,
    siblings: Vec<u32>,
}

impl Case {
    fn new(vocab: usize, seed: u64) -> Self {
        let mut rng = Lcg(seed);
        let prefix = rng.tokens(PREFIX, vocab);
        let chain = rng.tokens(MAX_ROWS, vocab);
        let siblings = chain
            .iter()
            .take(MAX_ROWS.div_ceil(2))
            .map(|&c| (c + 1 + rng.below(vocab as u64 - 1) as u32) % vocab as u32)
            .collect();
        Self {
            prefix,
            chain,
            siblings,
        }
    }
}

/// One node of the test tree: the chain token or the sibling at a depth.
#[derive(Clone, Copy, Debug)]
enum Node {
    Chain(usize),
    Sibling(usize),
}

/// The first `n` nodes of the breadth-first tree whose level `d` holds the chain token `d` and
/// its sibling (both children of chain token `d - 1`; roots at level 0).
fn tree_nodes(n: usize) -> Vec<Node> {
    (0..n)
        .map(|i| {
            if i % 2 == 0 {
                Node::Chain(i / 2)
            } else {
                Node::Sibling(i / 2)
            }
        })
        .collect()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// A cache holding `case.prefix`.
fn prefilled(model: &Transformer, case: &Case) -> specsplit_core::cache::SessionCache {
    let dev = model.device();
    let mut cache = model.new_cache(PREFIX + MAX_ROWS + 1).unwrap();
    model
        .forward(
            &u32s(&case.prefix, dev),
            &span(0, PREFIX, dev),
            None,
            &mut cache,
            &u32s(&[PREFIX as u32 - 1], dev),
        )
        .unwrap();
    cache
}

/// The logits of every chain token and every sibling decoded alone, one token per pass, after
/// the prefix and the chain tokens before it.
fn alone(model: &Transformer, case: &Case, depth: usize) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let dev = model.device();
    let mut cache = prefilled(model, case);
    let one = |cache: &mut specsplit_core::cache::SessionCache, token: u32, d: usize| {
        let pos = span(PREFIX + d, 1, dev);
        let t = model
            .forward(&u32s(&[token], dev), &pos, None, cache, &u32s(&[0], dev))
            .unwrap();
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    };
    let (mut chain, mut siblings) = (Vec::new(), Vec::new());
    for d in 0..depth {
        if let Some(&s) = case.siblings.get(d) {
            siblings.push(one(&mut cache, s, d));
            cache.truncate(PREFIX + d).unwrap();
        }
        chain.push(one(&mut cache, case.chain[d], d));
    }
    (chain, siblings)
}

/// Checks every row of chain passes and tree passes of each size in `sizes` against the tokens
/// decoded alone; panics listing the passes whose rows differ in any bit.
fn check(model: &Transformer, case: &Case, sizes: &[usize], what: &str) {
    let dev = model.device().clone();
    let depth = sizes.iter().copied().max().unwrap();
    let (want_chain, want_sibling) = alone(model, case, depth);
    let want = |node: Node| match node {
        Node::Chain(d) => &want_chain[d],
        Node::Sibling(d) => &want_sibling[d],
    };
    let mut cache = prefilled(model, case);
    let mut bad = Vec::new();
    let mut compared = 0;
    for &n in sizes {
        let all: Vec<u32> = (0..n as u32).collect();
        // A causal chain of n tokens.
        let got = model
            .forward(
                &u32s(&case.chain[..n], &dev),
                &span(PREFIX, n, &dev),
                None,
                &mut cache,
                &u32s(&all, &dev),
            )
            .unwrap();
        cache.truncate(PREFIX).unwrap();
        let nodes: Vec<Node> = (0..n).map(Node::Chain).collect();
        compare(&got, &nodes, &want, &mut bad, &mut compared, "chain", n);
        // A tree of n nodes: chain tokens and their siblings level by level.
        let nodes = tree_nodes(n);
        let mut tree = TokenTree::new();
        for &node in &nodes {
            match node {
                Node::Chain(0) => tree.push_root(case.chain[0], 0.0),
                Node::Sibling(0) => tree.push_root(case.siblings[0], 0.0),
                // The chain node of level d - 1 is tree node 2 (d - 1).
                Node::Chain(d) => tree.push_child(2 * (d - 1), case.chain[d], 0.0),
                Node::Sibling(d) => tree.push_child(2 * (d - 1), case.siblings[d], 0.0),
            }
            .unwrap();
        }
        let mask = TreeMask::new(&tree);
        let rows = TreeRows {
            mask: &mask,
            prefix: PREFIX,
            first_row: 0,
        };
        let got = model
            .forward_tree(
                &u32s(tree.tokens(), &dev),
                &u32s(&mask.positions(PREFIX), &dev),
                rows,
                &mut cache,
                &u32s(&all, &dev),
            )
            .unwrap();
        cache.truncate(PREFIX).unwrap();
        compare(&got, &nodes, &want, &mut bad, &mut compared, "tree", n);
    }
    assert!(
        bad.is_empty(),
        "{what}: {} of {compared} rows differ from the token decoded alone; first: {}",
        bad.len(),
        bad.iter().take(8).cloned().collect::<Vec<_>>().join("; ")
    );
}

fn compare<'a>(
    got: &Tensor,
    nodes: &[Node],
    want: &impl Fn(Node) -> &'a Vec<f32>,
    bad: &mut Vec<String>,
    compared: &mut usize,
    kind: &str,
    n: usize,
) {
    let got: Vec<Vec<f32>> = got.to_vec2().unwrap();
    assert_eq!(got.len(), nodes.len());
    for (row, (g, &node)) in got.iter().zip(nodes).enumerate() {
        let w = want(node);
        *compared += 1;
        if bits(g) != bits(w) {
            bad.push(format!(
                "{kind} pass of {n} rows, row {row} ({node:?}): max |diff| {:e}",
                max_diff(g, w)
            ));
        }
    }
}

/// Every pass size from 1 to [`MAX_ROWS`].
fn every_size() -> Vec<usize> {
    (1..=MAX_ROWS).collect()
}

fn check_quantized(quant: GgmlDType) {
    let model = small_quantized(quant);
    let case = Case::new(small_config().vocab_size, 3);
    check(&model, &case, &every_size(), &format!("{quant:?}"));
}

macro_rules! quantized {
    ($($name:ident => $dtype:ident),* $(,)?) => {$(
        #[test]
        fn $name() {
            check_quantized(GgmlDType::$dtype);
        }
    )*};
}

quantized! {
    q4_0_rows_match_alone => Q4_0,
    q4_1_rows_match_alone => Q4_1,
    q5_0_rows_match_alone => Q5_0,
    q5_1_rows_match_alone => Q5_1,
    q8_0_rows_match_alone => Q8_0,
    q8_1_rows_match_alone => Q8_1,
    q2k_rows_match_alone => Q2K,
    q3k_rows_match_alone => Q3K,
    q4k_rows_match_alone => Q4K,
    q5k_rows_match_alone => Q5K,
    q6k_rows_match_alone => Q6K,
    q8k_rows_match_alone => Q8K,
}

fn check_dense(dtype: DType) {
    let cfg = small_config();
    let model = Transformer::random(cfg.clone(), 11, dtype, &Device::Cpu).unwrap();
    let case = Case::new(cfg.vocab_size, 3);
    check(&model, &case, &every_size(), &format!("dense {dtype:?}"));
}

#[test]
fn dense_f32_rows_match_alone() {
    check_dense(DType::F32);
}

#[test]
fn dense_f16_rows_match_alone() {
    check_dense(DType::F16);
}

/// Pass sizes for the real models: every size a small tree takes, then powers of two plus one
/// up to the largest verify pass.
const REAL_SIZES: [usize; 13] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 17, 33, 65, 129];

/// Pass sizes for the Qwen2.5-Coder 0.5B in CI: every chain and small tree, and the passes
/// where candle's kernels change (a tile of 4 rows, 32 rows).
const CI_SIZES: [usize; 8] = [1, 2, 3, 4, 5, 9, 17, 33];

fn check_gguf(model: (&str, &str), sizes: &[usize]) {
    let path = model_path(model);
    let m = Transformer::from_gguf(&path, &Device::Cpu).unwrap();
    let case = Case::new(m.config().vocab_size, 5);
    check(&m, &case, sizes, model.0);
}

#[test]
fn smollm2_q4_1_rows_match_alone() {
    check_gguf(SMOLLM2, &REAL_SIZES);
}

#[test]
fn qwen_0_5b_q4_k_m_rows_match_alone() {
    check_gguf(QWEN05, &CI_SIZES);
}

#[test]
#[ignore = "several minutes on 2 cores: run with scripts/exactness-long.sh"]
fn qwen_1_5b_q4_k_m_rows_match_alone() {
    check_gguf(QWEN15, &REAL_SIZES);
}
