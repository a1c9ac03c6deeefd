//! Pure helpers: statistics, tree shapes, roofline arithmetic, acceptance profiles, argument
//! parsing and deterministic token ids.

use anyhow::{bail, Context, Result};
use serde::Serialize;
use specsplit_core::tree::TokenTree;
use specsplit_models::config::ModelConfig;

/// Median, 10th/90th percentiles and mean of a sample.
#[derive(Debug, Clone, Copy, Serialize, PartialEq)]
pub struct Summary {
    /// 50th percentile.
    pub median: f64,
    /// 10th percentile.
    pub p10: f64,
    /// 90th percentile.
    pub p90: f64,
    /// Arithmetic mean.
    pub mean: f64,
}

/// Linearly interpolated percentile `q` in `[0, 1]` of an ascending-sorted, non-empty slice.
fn percentile_sorted(sorted: &[f64], q: f64) -> f64 {
    let pos = q.clamp(0.0, 1.0) * (sorted.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = pos.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// Linearly interpolated percentile `q` in `[0, 1]` of `xs` (0 for an empty sample).
pub fn percentile(xs: &[f64], q: f64) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let mut s = xs.to_vec();
    s.sort_by(f64::total_cmp);
    percentile_sorted(&s, q)
}

/// Summarises `xs` (all zeros for an empty sample).
pub fn summarize(xs: &[f64]) -> Summary {
    if xs.is_empty() {
        return Summary {
            median: 0.0,
            p10: 0.0,
            p90: 0.0,
            mean: 0.0,
        };
    }
    let mut s = xs.to_vec();
    s.sort_by(f64::total_cmp);
    Summary {
        median: percentile_sorted(&s, 0.5),
        p10: percentile_sorted(&s, 0.1),
        p90: percentile_sorted(&s, 0.9),
        mean: s.iter().sum::<f64>() / s.len() as f64,
    }
}

/// Children per node at each depth of the balanced benchmark trees; deeper levels use 1.
const TREE_LEVEL_WIDTHS: [usize; 6] = [4, 4, 2, 2, 2, 2];

/// A tree of exactly `n` nodes built level by level (4 roots, 4 children each, then 2, 2, …,
/// then chains), filling the last level from its first parents; tokens come from `token(i)`.
pub fn balanced_tree(n: usize, mut token: impl FnMut(usize) -> u32) -> TokenTree {
    let mut tree = TokenTree::new();
    if n == 0 {
        return tree;
    }
    let roots = TREE_LEVEL_WIDTHS[0].min(n);
    let mut level: Vec<usize> = Vec::new();
    for _ in 0..roots {
        let i = tree.len();
        level.push(tree.push_root(token(i), 0.0).expect("roots come first"));
    }
    let mut depth = 1;
    while tree.len() < n {
        let width = TREE_LEVEL_WIDTHS.get(depth).copied().unwrap_or(1);
        let mut next = Vec::new();
        'fill: for &parent in &level {
            for _ in 0..width {
                if tree.len() == n {
                    break 'fill;
                }
                let i = tree.len();
                let child = tree
                    .push_child(parent, token(i), 0.0)
                    .expect("level-by-level order is breadth-first");
                next.push(child);
            }
        }
        level = next;
        depth += 1;
    }
    tree
}

/// Weight bytes of a dense model and the bytes one decode step must stream from memory.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
pub struct ParamBytes {
    /// Number of weight parameters.
    pub params: u64,
    /// All weights, in bytes.
    pub total_bytes: u64,
    /// Weights read per decode token: all but the embedding table, which is only gathered
    /// (unless it is tied to the LM head, which reads it whole).
    pub streamed_bytes: u64,
}

/// Parameter counts from the configuration (dense weights of `dtype_bytes` each).
pub fn param_bytes(c: &ModelConfig, dtype_bytes: u64) -> ParamBytes {
    let h = c.hidden_size as u64;
    let q = (c.num_attention_heads * c.head_dim) as u64;
    let kv = (c.num_key_value_heads * c.head_dim) as u64;
    let inter = c.intermediate_size as u64;
    let bias = if c.attention_bias { q + 2 * kv } else { 0 };
    let per_layer = h * q + 2 * h * kv + q * h + 3 * h * inter + 2 * h + bias;
    let embed = c.vocab_size as u64 * h;
    let head = if c.tie_word_embeddings { 0 } else { embed };
    let params = embed + c.num_hidden_layers as u64 * per_layer + h + head;
    let gathered_only = if c.tie_word_embeddings { 0 } else { embed };
    ParamBytes {
        params,
        total_bytes: params * dtype_bytes,
        streamed_bytes: (params - gathered_only) * dtype_bytes,
    }
}

/// Bytes of K and V cache read by one decode step over `len` cached tokens.
pub fn kv_bytes(c: &ModelConfig, len: usize, dtype_bytes: u64) -> u64 {
    2 * (c.num_hidden_layers * c.num_key_value_heads * c.head_dim * len) as u64 * dtype_bytes
}

/// Upper bound on decode tokens per second when every step streams `bytes_per_token` at
/// `bandwidth` bytes per second.
pub fn roofline_tok_s(bandwidth: f64, bytes_per_token: u64) -> f64 {
    if bytes_per_token == 0 {
        0.0
    } else {
        bandwidth / bytes_per_token as f64
    }
}

/// Fraction of speculative rounds (`drafted > 0`) whose accepted count is at least `i`, for
/// `i = 1..=depth`; `rounds` holds `(drafted, accepted)` pairs.
pub fn per_position_acceptance(rounds: &[(usize, usize)], depth: usize) -> Vec<f64> {
    let spec: Vec<usize> = rounds
        .iter()
        .filter(|(d, _)| *d > 0)
        .map(|&(_, a)| a)
        .collect();
    (1..=depth)
        .map(|i| {
            if spec.is_empty() {
                0.0
            } else {
                spec.iter().filter(|&&a| a >= i).count() as f64 / spec.len() as f64
            }
        })
        .collect()
}

/// Parses `"4,2,1,1;2,2,2,1"` into tree width lists.
pub fn parse_trees(s: &str) -> Result<Vec<Vec<usize>>> {
    s.split(';')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            let w: Vec<usize> = t
                .split(',')
                .map(|x| x.trim().parse::<usize>())
                .collect::<Result<_, _>>()
                .with_context(|| format!("bad tree widths '{t}' (use e.g. 4,2,1,1)"))?;
            if w.is_empty() || w.contains(&0) {
                bail!("tree widths must be positive, got '{t}'");
            }
            Ok(w)
        })
        .collect()
}

/// Widths formatted as `4,2,1,1`.
pub fn widths_label(widths: &[usize]) -> String {
    widths
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Rates as a comma-separated label, e.g. "0.3,0.45".
pub fn rates_label(values: &[f64]) -> String {
    values
        .iter()
        .map(|v| format!("{v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// A deterministic splitmix64 stream.
pub struct SplitMix(u64);

impl SplitMix {
    /// A stream from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A token id in `0..vocab` that is not in `avoid`.
    pub fn token(&mut self, vocab: usize, avoid: &[u32]) -> u32 {
        loop {
            let t = (self.next_u64() % vocab.max(1) as u64) as u32;
            if !avoid.contains(&t) {
                return t;
            }
        }
    }
}

/// `n` deterministic pseudo-random token ids below `vocab`, none in `avoid`.
pub fn random_ids(seed: u64, n: usize, vocab: usize, avoid: &[u32]) -> Vec<u32> {
    let mut r = SplitMix::new(seed);
    (0..n).map(|_| r.token(vocab, avoid)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn balanced_trees_have_exactly_n_nodes_in_breadth_first_levels() {
        for n in [1, 3, 4, 5, 16, 32, 64, 100] {
            let t = balanced_tree(n, |i| i as u32);
            assert_eq!(t.len(), n, "n = {n}");
        }
        let t = balanced_tree(16, |i| i as u32);
        // 4 roots, then 12 of the 16 possible children.
        assert_eq!(t.roots().len(), 4);
        assert_eq!(t.max_depth(), 1);
        let t = balanced_tree(64, |i| i as u32);
        // 4 + 16 + 32 + 12.
        assert_eq!(t.max_depth(), 3);
        assert_eq!(t.depths().iter().filter(|&&d| d == 2).count(), 32);
    }

    #[test]
    fn param_counts_match_published_qwen_sizes() {
        let p = param_bytes(&ModelConfig::preset("qwen2.5-7b").unwrap(), 2);
        assert_eq!(p.params, 7_615_616_512);
        assert_eq!(p.total_bytes, 2 * 7_615_616_512);
        // Untied: the embedding table is only gathered.
        assert_eq!(p.streamed_bytes, 2 * (7_615_616_512 - 152_064 * 3584));
        let p = param_bytes(&ModelConfig::preset("qwen2.5-0.5b").unwrap(), 2);
        assert_eq!(p.params, 494_032_768);
        assert_eq!(p.streamed_bytes, p.total_bytes);
    }

    #[test]
    fn roofline_is_bandwidth_over_bytes() {
        assert!((roofline_tok_s(3.0e12, 15_000_000_000) - 200.0).abs() < 1e-9);
        assert_eq!(roofline_tok_s(1.0, 0), 0.0);
        let c = ModelConfig::preset("qwen2.5-7b").unwrap();
        // 28 layers x 4 KV heads x 128 dims x 2 (K and V) x 2 bytes per token.
        assert_eq!(kv_bytes(&c, 1, 2), 57_344);
    }

    #[test]
    fn per_position_acceptance_counts_rounds_reaching_each_depth() {
        let rounds = [(4, 0), (4, 2), (4, 4), (0, 0), (4, 1)];
        let p = per_position_acceptance(&rounds, 4);
        assert_eq!(p, vec![0.75, 0.5, 0.25, 0.25]);
        assert_eq!(per_position_acceptance(&[(0, 0)], 2), vec![0.0, 0.0]);
    }

    #[test]
    fn summaries_and_parsers() {
        let s = summarize(&[5.0, 1.0, 3.0, 2.0, 4.0]);
        assert_eq!(s.median, 3.0);
        assert!((s.p10 - 1.4).abs() < 1e-12);
        assert!((s.p90 - 4.6).abs() < 1e-12);
        assert_eq!(s.mean, 3.0);
        assert_eq!(
            parse_trees("4,2,1,1; 2,2,2,1").unwrap(),
            vec![vec![4, 2, 1, 1], vec![2, 2, 2, 1]]
        );
        assert!(parse_trees("4,0").is_err());
        let ids = random_ids(7, 100, 300, &[256]);
        assert!(ids.iter().all(|&t| t < 300 && t != 256));
        assert_eq!(ids, random_ids(7, 100, 300, &[256]));
    }
}
