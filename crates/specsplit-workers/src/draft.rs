//! The draft engine: keeps a per-session KV cache that follows the accepted sequence and drafts
//! token trees level by level with tree attention over that cache.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use specsplit_core::cache::SessionCache;
use specsplit_core::mask::TreeMask;
use specsplit_core::sampling::{self, SamplingParams};
use specsplit_core::tree::{Distribution, TokenTree};
use specsplit_models::transformer::Transformer;

use crate::EngineError;

/// One draft session: the cached sequence and the logits after its last token.
pub struct DraftSession {
    cache: SessionCache,
    tokens: Vec<u32>,
    last_logits: Option<Tensor>,
    rng: ChaCha8Rng,
}

impl Drop for DraftSession {
    fn drop(&mut self) {
        // See `TargetSession`'s Drop: free GPU buffers with the context current.
        let _ = specsplit_core::device::bind_to_thread(self.cache.device());
    }
}

impl DraftSession {
    /// Tokens currently in the session's cache.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }
}

/// How to draft one tree.
#[derive(Debug, Clone)]
pub struct DraftParams {
    /// Children per node at each depth (`widths[0]` = number of roots); its length is the depth.
    pub widths: Vec<usize>,
    /// Sampling transforms; greedy drafts take the top-w tokens.
    pub sampling: SamplingParams,
}

/// What drafting one tree cost.
#[derive(Debug, Clone, Default)]
pub struct DraftStats {
    /// Time in model forward passes (including the device→host copies of their logits).
    pub model_time: Duration,
    /// Tokens that went through the model (prefix catch-up plus tree levels).
    pub tokens_processed: usize,
    /// Whether the session's cached prefix was reused.
    pub cache_hit: bool,
}

/// A synthetic proposer for benchmarks: the first child at every expansion is the target's
/// own next token (looked up in reference continuations) with probability `beta`, and a wrong
/// token otherwise, while the draft model's forward passes are still paid for. Its results
/// measure the system's efficiency apart from draft quality and must be labelled synthetic.
#[derive(Debug, Clone)]
pub struct SyntheticOracle {
    references: Vec<Vec<u32>>,
    beta: f64,
}

impl SyntheticOracle {
    /// An oracle over full reference sequences (prompt + target-only continuation).
    pub fn new(references: Vec<Vec<u32>>, beta: f64) -> Self {
        Self {
            references,
            beta: beta.clamp(0.0, 1.0),
        }
    }

    /// The per-token acceptance it simulates.
    pub fn beta(&self) -> f64 {
        self.beta
    }

    /// The reference's next token after `context`, if a reference continues it.
    pub fn next(&self, context: &[u32]) -> Option<u32> {
        self.references
            .iter()
            .find(|r| r.len() > context.len() && r.starts_with(context))
            .map(|r| r[context.len()])
    }
}

/// Drafts token trees with a small model.
pub struct DraftEngine {
    model: Arc<Transformer>,
    eos: Vec<u32>,
    max_context: usize,
    synthetic: Option<SyntheticOracle>,
}

impl DraftEngine {
    /// An engine over `model`; `eos` ends a branch; sessions hold `max_context` tokens.
    pub fn new(model: Arc<Transformer>, eos: Vec<u32>, max_context: usize) -> Self {
        Self {
            model,
            eos,
            max_context,
            synthetic: None,
        }
    }

    /// This engine with a synthetic proposer (benchmarks only).
    pub fn with_synthetic(mut self, oracle: SyntheticOracle) -> Self {
        self.synthetic = Some(oracle);
        self
    }

    /// The synthetic proposer, if any.
    pub fn synthetic(&self) -> Option<&SyntheticOracle> {
        self.synthetic.as_ref()
    }

    /// The model.
    pub fn model(&self) -> &Transformer {
        &self.model
    }

    /// Bytes one session's cache takes.
    pub fn session_bytes(&self) -> usize {
        session_cache_bytes(&self.model, self.max_context)
    }

    /// A fresh session, its random choices seeded by `seed` (0 = from entropy).
    pub fn new_session(&self, seed: u64) -> Result<DraftSession, EngineError> {
        Ok(DraftSession {
            cache: self.model.new_cache(self.max_context)?,
            tokens: Vec::new(),
            last_logits: None,
            rng: seeded_rng(seed),
        })
    }

    /// Drafts a tree continuing `tokens` (the whole sequence so far). The cache is first brought
    /// to `tokens` reusing the longest common prefix (rollback of a rejected tail is O(1)); the
    /// tree's own entries are dropped again afterwards.
    pub fn draft(
        &self,
        s: &mut DraftSession,
        tokens: &[u32],
        p: &DraftParams,
    ) -> Result<(TokenTree, DraftStats), EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::InvalidArgument(
                "the draft request holds no tokens: send the prompt (and accepted tokens)".into(),
            ));
        }
        if p.widths.is_empty() || p.widths.contains(&0) {
            return Err(EngineError::InvalidArgument(format!(
                "tree widths must be a non-empty list of positive numbers, got {:?}",
                p.widths
            )));
        }
        let tree_nodes = tree_size(&p.widths);
        if tokens.len() + tree_nodes > self.max_context {
            return Err(EngineError::InvalidArgument(format!(
                "sequence of {} tokens plus a {}-node tree exceeds the draft context of {} tokens",
                tokens.len(),
                tree_nodes,
                self.max_context
            )));
        }
        specsplit_core::device::bind_to_thread(self.model.device())?;
        let mut stats = DraftStats::default();
        let root_logits = self.sync_prefix(s, tokens, &mut stats)?;
        let prefix_len = s.tokens.len();
        let result = self.draft_levels(s, root_logits, prefix_len, p, &mut stats);
        // Drop the tree's entries whatever happened: the cache holds exactly `tokens` again.
        s.cache.truncate(prefix_len)?;
        result.map(|t| (t, stats))
    }

    /// Brings the cache to `tokens`; returns the logits after the last token, shape (vocab,).
    fn sync_prefix(
        &self,
        s: &mut DraftSession,
        tokens: &[u32],
        stats: &mut DraftStats,
    ) -> Result<Tensor, EngineError> {
        let lcp = common_prefix(&s.tokens, tokens);
        if lcp == tokens.len() && lcp == s.tokens.len() {
            if let Some(l) = &s.last_logits {
                stats.cache_hit = true;
                return Ok(l.clone());
            }
        }
        let keep = lcp.min(tokens.len() - 1);
        stats.cache_hit = keep > 0;
        s.cache.truncate(keep)?;
        s.tokens.truncate(keep);
        s.last_logits = None;
        let new = &tokens[keep..];
        let t0 = Instant::now();
        let dev = self.model.device();
        let ids = Tensor::new(new, dev)?;
        let pos: Vec<u32> = (keep as u32..(keep + new.len()) as u32).collect();
        let pos = Tensor::new(pos.as_slice(), dev)?;
        let rows = Tensor::new(&[(new.len() - 1) as u32], dev)?;
        let logits = self.model.forward(&ids, &pos, None, &mut s.cache, &rows)?;
        let logits = logits.squeeze(0)?;
        stats.model_time += t0.elapsed();
        stats.tokens_processed += new.len();
        s.tokens.extend_from_slice(new);
        s.last_logits = Some(logits.clone());
        Ok(logits)
    }

    fn draft_levels(
        &self,
        s: &mut DraftSession,
        root_logits: Tensor,
        prefix_len: usize,
        p: &DraftParams,
        stats: &mut DraftStats,
    ) -> Result<TokenTree, EngineError> {
        let greedy = p.sampling.is_greedy();
        let mut tree = TokenTree::new();
        tree.set_siblings_without_replacement(true);
        let dev = self.model.device().clone();
        // Host copy of the logits rows that are expanded at this level.
        let t0 = Instant::now();
        let mut rows: Vec<Vec<f32>> = vec![root_logits.to_dtype(DType::F32)?.to_vec1()?];
        stats.model_time += t0.elapsed();
        // Parent of each row: None for the roots.
        let mut parents: Vec<Option<usize>> = vec![None];
        for (depth, &width) in p.widths.iter().enumerate() {
            let level_start = tree.len();
            for (row, parent) in rows.iter().zip(&parents) {
                let (mut children, dist) = self.choose(row, width, greedy, &p.sampling, &mut s.rng);
                if let Some(o) = &self.synthetic {
                    let mut ctx = s.tokens.clone();
                    if let Some(par) = parent {
                        ctx.extend(tree.path_tokens(*par));
                    }
                    if let (Some(right), Some(&(old, _))) = (o.next(&ctx), children.first()) {
                        let vocab = row.len() as u32;
                        let new = if rand::Rng::random_bool(&mut s.rng, o.beta) {
                            right
                        } else {
                            (right + 1) % vocab
                        };
                        // Keep siblings distinct: a sibling that already held `new` takes
                        // the displaced token.
                        for c in children.iter_mut().skip(1) {
                            if c.0 == new {
                                c.0 = old;
                            }
                        }
                        children[0].0 = new;
                    }
                }
                for (tok, lp) in children {
                    match parent {
                        None => tree.push_root(tok, lp),
                        Some(par) => tree.push_child(*par, tok, lp),
                    }
                    .map_err(|e| EngineError::InvalidArgument(format!("draft tree: {e}")))?;
                }
                if let Some(d) = dist {
                    match parent {
                        None => tree.set_root_distribution(d),
                        Some(par) => tree.set_child_distribution(*par, d).map_err(|e| {
                            EngineError::InvalidArgument(format!("draft tree: {e}"))
                        })?,
                    }
                }
            }
            let level_end = tree.len();
            if depth + 1 == p.widths.len() || level_end == level_start {
                break;
            }
            // Forward this level's nodes (all of them, so the cache mirrors the tree's
            // breadth-first layout) and keep the rows of the nodes to expand (not EOS).
            let expand: Vec<usize> = (level_start..level_end)
                .filter(|&i| !self.eos.contains(&tree.token(i)))
                .collect();
            if expand.is_empty() {
                break;
            }
            let t0 = Instant::now();
            let mask = TreeMask::new(&tree);
            let full = mask.to_tensor(prefix_len, self.model.dtype(), &dev)?;
            let n = level_end - level_start;
            let level_mask = full.narrow(0, level_start, n)?;
            let positions = mask.positions(prefix_len);
            let pos = Tensor::new(&positions[level_start..level_end], &dev)?;
            let toks: Vec<u32> = (level_start..level_end).map(|i| tree.token(i)).collect();
            let ids = Tensor::new(toks.as_slice(), &dev)?;
            let want: Vec<u32> = expand.iter().map(|&i| (i - level_start) as u32).collect();
            let want = Tensor::new(want.as_slice(), &dev)?;
            let logits = self
                .model
                .forward(&ids, &pos, Some(&level_mask), &mut s.cache, &want)?;
            rows = logits.to_dtype(DType::F32)?.to_vec2()?;
            stats.model_time += t0.elapsed();
            stats.tokens_processed += n;
            parents = expand.into_iter().map(Some).collect();
        }
        Ok(tree)
    }

    /// Picks `width` children from one row of logits: the top-w tokens when greedy, else
    /// distinct draws from the warped distribution (returned, so the verifier can use it).
    fn choose(
        &self,
        logits: &[f32],
        width: usize,
        greedy: bool,
        params: &SamplingParams,
        rng: &mut ChaCha8Rng,
    ) -> (Vec<(u32, f32)>, Option<Distribution>) {
        if greedy {
            let lse = log_sum_exp(logits);
            let toks = sampling::top_w(logits, width);
            let out = toks
                .into_iter()
                .map(|t| (t, logits[t as usize] - lse))
                .collect();
            (out, None)
        } else {
            let dist = sampling::warp(logits, params);
            let toks = sampling::sample_without_replacement(&dist, width, rng);
            let out = toks
                .into_iter()
                .map(|t| (t, dist.prob(t).max(f32::MIN_POSITIVE).ln()))
                .collect();
            (out, Some(dist))
        }
    }
}

/// Bytes of one session cache of `capacity` tokens for `model`.
pub fn session_cache_bytes(model: &Transformer, capacity: usize) -> usize {
    let c = model.config();
    let spec = specsplit_core::cache::CacheSpec {
        num_layers: c.num_hidden_layers,
        num_kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim,
        capacity,
    };
    SessionCache::bytes_for(&spec, model.dtype())
}

/// Number of nodes of a full tree with these widths.
pub fn tree_size(widths: &[usize]) -> usize {
    let mut level = 1usize;
    let mut total = 0usize;
    for &w in widths {
        level = level.saturating_mul(w);
        total = total.saturating_add(level);
    }
    total
}

/// Length of the longest common prefix of two token sequences.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A session RNG: seeded deterministically, or from entropy when `seed` is 0.
pub fn seeded_rng(seed: u64) -> ChaCha8Rng {
    if seed == 0 {
        ChaCha8Rng::from_os_rng()
    } else {
        ChaCha8Rng::seed_from_u64(seed)
    }
}

fn log_sum_exp(x: &[f32]) -> f32 {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let s: f64 = x.iter().map(|&v| ((v - m) as f64).exp()).sum();
    m + s.ln() as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tree_size_counts_every_level() {
        assert_eq!(tree_size(&[4, 2, 1, 1]), 4 + 8 + 8 + 8);
        assert_eq!(tree_size(&[1, 1, 1]), 3);
        assert_eq!(tree_size(&[]), 0);
    }

    #[test]
    fn common_prefix_stops_at_first_difference() {
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2, 4, 5]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
        assert_eq!(common_prefix(&[1, 2], &[1, 2]), 2);
    }
}
