//! Pre-drafting the outcomes of a verification in flight: while the target verifies a draft
//! path, the draft worker drafts the next round's tree for every likely outcome (accepted
//! length j and the target's token after it) in shared passes, so that the next round finds
//! its tree ready whatever the verdict.
//!
//! One pass first brings the path into the cache and gives the draft's distribution at every
//! position of it; the candidates for the target's token at position j are the draft's best
//! tokens there other than the path's own (which a verdict ending at j rejected), and after the
//! whole path its best bonus tokens. Every candidate starts a branch over the cached prefix and
//! the path's first j tokens; one pass per level then grows all branches' trees together. The
//! cache keeps the committed sequence and the path afterwards; every branch is freed.
//!
//! Where the branches grew from one replayed graph, their rows stay past the sequence
//! ([`GrownBranches`]): when the verdict selects one of them, the next pre-draft's first pass
//! moves that branch's cached rows and their logits into place and computes only the path's
//! last token, the one row the growth did not feed.

use std::time::Instant;

use candle_core::{DType, Tensor};
use specsplit_core::tree::{full_tree_size, TokenTree};
use specsplit_models::fused::MOVE_MAX;

use crate::draft::{
    stepper_over, top_w_on_device, DraftEngine, DraftParams, DraftSession, DraftStats, Forest, Grow,
};
use crate::engine_session::common_prefix;
use crate::EngineError;

/// Which outcomes of a verification to pre-draft.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OutcomeSet {
    /// Tokens of the request's sequence the target has committed; the rest is the path under
    /// verification.
    pub committed: usize,
    /// Candidate tokens per accepted length.
    pub candidates: usize,
    /// Accepted lengths to pre-draft (ascending, each at most the path's length); empty: all.
    pub accepted_lengths: Vec<usize>,
}

impl OutcomeSet {
    /// The accepted lengths pre-drafted for a path of `path_len` tokens.
    pub fn lengths(&self, path_len: usize) -> Vec<usize> {
        if self.accepted_lengths.is_empty() {
            (0..=path_len).collect()
        } else {
            self.accepted_lengths.clone()
        }
    }

    /// Nodes the pre-draft adds after the committed sequence for a path of `path_len` tokens
    /// and trees of `widths`: the path, every candidate and every candidate's tree.
    pub fn nodes(&self, path_len: usize, widths: &[usize]) -> usize {
        let outcomes = self.lengths(path_len).len().saturating_mul(self.candidates);
        path_len.saturating_add(outcomes.saturating_mul(1 + full_tree_size(widths)))
    }
}

/// The tree drafted for one outcome.
#[derive(Debug, Clone, PartialEq)]
pub struct PreDrafted {
    /// Path tokens the outcome accepts.
    pub accepted: usize,
    /// The target's token after them that the outcome assumes.
    pub token: u32,
    /// The tree after committed sequence + accepted path tokens + `token`.
    pub tree: TokenTree,
}

/// What a pre-draft's replayed growth left past the sequence in the session's cache: branch
/// `b`'s node at level `l` (its candidate at level 0, then the chain's tokens) sits at slot
/// `base + l·n + b` of `n` branches, and row `b` of level `l`'s logits is the draft's
/// distribution after it. Valid while the cache's [`SessionCache::generation`] is the one
/// recorded: no pass has written the cache since.
///
/// [`SessionCache::generation`]: specsplit_core::cache::SessionCache::generation
#[derive(Debug)]
pub struct GrownBranches {
    /// The cache's generation when the pre-draft ended.
    generation: u64,
    /// The slot of the first level's first node.
    base: usize,
    /// Per branch: its root's position (the tokens it sees before it), its root, and the
    /// tokens its later levels fed (its chain's first `depth - 1`).
    branches: Vec<(usize, u32, Vec<u32>)>,
    /// `(depth, branches, vocab)`: each level's logits.
    logits: Tensor,
}

impl GrownBranches {
    /// The branch rooted at position `keep` whose nodes continue `tokens` there, and how many
    /// of its nodes do (at most [`MOVE_MAX`], leaving at least the last token to compute).
    fn kept(&self, tokens: &[u32], keep: usize) -> Option<(usize, usize)> {
        let room = tokens.len().checked_sub(keep + 1)?.min(MOVE_MAX);
        self.branches
            .iter()
            .position(|(lead, root, _)| *lead == keep && tokens.get(keep) == Some(root))
            .map(|b| {
                let fed = &self.branches[b].2;
                let later = fed
                    .iter()
                    .zip(&tokens[keep + 1..])
                    .take_while(|(f, t)| f == t)
                    .count();
                (b, (1 + later).min(room))
            })
            .filter(|&(_, rows)| rows > 0)
    }

    /// The cache moves that bring branch `b`'s first `rows` nodes to slots `keep..`.
    fn moves(&self, b: usize, rows: usize, keep: usize) -> Vec<(usize, usize)> {
        let n = self.branches.len();
        (0..rows)
            .map(|l| (self.base + l * n + b, keep + l))
            .collect()
    }
}

impl DraftEngine {
    /// Pre-drafts the outcomes `set` of verifying the path `tokens[set.committed..]` after the
    /// committed `tokens[..set.committed]`: for each, the tree of `p.widths` an ordinary draft
    /// after that outcome's sequence would propose (the same tokens for greedy drafts; see the
    /// module docs for how the passes are shared). The cache holds `tokens` afterwards.
    pub fn predraft(
        &self,
        s: &mut DraftSession,
        tokens: &[u32],
        set: &OutcomeSet,
        p: &DraftParams,
    ) -> Result<(Vec<PreDrafted>, DraftStats), EngineError> {
        let committed = set.committed;
        if committed == 0 || committed > tokens.len() {
            return Err(EngineError::InvalidArgument(format!(
                "the committed length {committed} must lie in 1..={} (the sequence's length)",
                tokens.len()
            )));
        }
        let path = &tokens[committed..];
        let lengths = set.lengths(path.len());
        if set.candidates == 0
            || lengths.windows(2).any(|w| w[0] >= w[1])
            || lengths.last().is_some_and(|&j| j > path.len())
        {
            return Err(EngineError::InvalidArgument(format!(
                "an outcome set needs at least one candidate and ascending accepted lengths of \
                 at most the path's {} tokens, got {} candidates and lengths {:?}",
                path.len(),
                set.candidates,
                set.accepted_lengths
            )));
        }
        if p.widths.is_empty() || p.widths.contains(&0) {
            return Err(EngineError::InvalidArgument(format!(
                "tree widths must be a non-empty list of positive numbers, got {:?}",
                p.widths
            )));
        }
        let nodes = set.nodes(path.len(), &p.widths);
        if committed.saturating_add(nodes) > self.max_context() {
            return Err(EngineError::InvalidArgument(format!(
                "a sequence of {committed} committed tokens plus {nodes} pre-draft nodes \
                 exceeds the draft context of {} tokens",
                self.max_context()
            )));
        }
        crate::draft::before_deadline(p.deadline, "pre-drafting began")?;
        specsplit_core::device::bind_to_thread(self.model().device())?;
        // Room for every pass before anything is written.
        s.reserve(committed.saturating_add(nodes).max(tokens.len()))?;
        let result = self.predraft_passes(s, tokens, committed, &lengths, set.candidates, p);
        if result.is_err() {
            // Whatever a failed pass left in the cache is not trusted: start over.
            s.cache.truncate(0)?;
            s.tokens.clear();
            s.last_logits = None;
            s.grown = None;
        }
        result
    }

    fn predraft_passes(
        &self,
        s: &mut DraftSession,
        tokens: &[u32],
        committed: usize,
        lengths: &[usize],
        m: usize,
        p: &DraftParams,
    ) -> Result<(Vec<PreDrafted>, DraftStats), EngineError> {
        let mut stats = DraftStats::default();
        let path = &tokens[committed..];

        // Pass 0: the uncached tail of the committed sequence (at least its last token) and the
        // path, causally; its rows from the committed sequence's last token on are the draft's
        // distributions after every accepted length.
        let t0 = Instant::now();
        let keep = common_prefix(&s.tokens, tokens).min(committed - 1);
        stats.cache_hit = keep > 0;
        // The previous pre-draft's rows of the branch this sequence continues, if nothing wrote
        // the cache since.
        let grown = s.grown.take();
        let kept = grown
            .as_ref()
            .filter(|g| g.generation == s.cache.generation())
            .and_then(|g| Some((g, g.kept(tokens, keep)?)));
        s.cache.truncate(keep)?;
        s.tokens.truncate(keep);
        s.last_logits = None;
        let first = committed - 1 - keep;
        let (at_lengths, reused) = match kept {
            Some((g, (b, rows))) => {
                let logits = self.resume_branch(s, tokens, keep, (g, b, rows), first)?;
                (logits, rows)
            }
            None => (self.causal_rows(s, &tokens[keep..], keep, first)?, 0),
        };
        stats.tokens_processed += tokens.len() - keep - reused;
        s.tokens.extend_from_slice(&tokens[keep + reused..]);
        let picks = top_w_on_device(&at_lengths, m + 1, self.fused_launch())?;
        let first_pass = t0.elapsed();
        stats.model_time += first_pass;
        let t_choose = Instant::now();

        // The candidates of every outcome, then one branch per candidate.
        let mut forest = Forest::new(committed);
        let mut parent = None;
        for &t in path {
            parent = Some(forest.push(parent, t));
        }
        let mut outcomes = Vec::new();
        for &j in lengths {
            let own = path.get(j).copied();
            let mut cands: Vec<u32> = picks[j]
                .iter()
                .map(|&(t, _)| t)
                .filter(|&t| Some(t) != own)
                .take(m)
                .collect();
            self.synthetic_candidates(&tokens[..committed + j], own, &mut cands, &mut s.rng);
            for t in cands {
                let node = forest.push(j.checked_sub(1), t);
                outcomes.push((j, t, node));
            }
        }
        let mut trees: Vec<TokenTree> = outcomes
            .iter()
            .map(|_| {
                let mut t = TokenTree::new();
                t.set_siblings_without_replacement(true);
                t
            })
            .collect();
        let greedy_chains = p.sampling.is_greedy() && p.widths.iter().all(|&w| w == 1);
        let depth = p.widths.len();
        let choose = t_choose.elapsed();
        let t_grow = Instant::now();
        if greedy_chains && self.chains_replayable(s, tokens.len(), outcomes.len(), depth) {
            // Every candidate and every level of its chain, replayed from one graph.
            self.grow_chains_replayed(s, tokens, committed, &outcomes, &mut trees, depth)?;
            stats.model_time += t_grow.elapsed();
            stats.tokens_processed += outcomes.len() * depth;
        } else {
            let grown = (&mut forest, &mut trees[..], &mut stats);
            self.grow_outcomes(s, tokens, committed, &outcomes, grown, p)?;
        }
        tracing::trace!(
            rows = tokens.len() - keep - reused,
            reused,
            branches = outcomes.len(),
            first_pass_ms = first_pass.as_secs_f64() * 1e3,
            choose_ms = choose.as_secs_f64() * 1e3,
            growth_ms = t_grow.elapsed().as_secs_f64() * 1e3,
            "pre-draft phases"
        );
        // Keep the committed sequence and the path; free every branch (a replayed growth's
        // rows stay for the next pre-draft until anything else writes the cache).
        s.cache.truncate(tokens.len())?;
        if let Some(g) = &mut s.grown {
            g.generation = s.cache.generation();
        }
        s.last_logits = Some(at_lengths.get(path.len())?);
        let out = outcomes
            .into_iter()
            .zip(trees)
            .map(|((accepted, token, _), tree)| PreDrafted {
                accepted,
                token,
                tree,
            })
            .collect();
        Ok((out, stats))
    }

    /// The outcomes' trees grown op by op (where no replayed graph serves them): one pass
    /// for every candidate over the prefix and its accepted path tokens, then one per level
    /// (greedy chains on the device with one copy back at the end; other trees level by
    /// level).
    fn grow_outcomes(
        &self,
        s: &mut DraftSession,
        tokens: &[u32],
        committed: usize,
        outcomes: &[(usize, u32, usize)],
        (forest, trees, stats): (&mut Forest, &mut [TokenTree], &mut DraftStats),
        p: &DraftParams,
    ) -> Result<(), EngineError> {
        let path = &tokens[committed..];
        let dev = self.model().device().clone();
        // Pass 1: every candidate, each over the prefix and its accepted path tokens.
        let t0 = Instant::now();
        let want: Vec<u32> = (0..outcomes.len() as u32).collect();
        let logits = self.forward_forest(s, forest, path.len(), &want, &dev)?;
        stats.model_time += t0.elapsed();
        stats.tokens_processed += outcomes.len();
        let frontier = outcomes
            .iter()
            .enumerate()
            .filter(|(_, &(_, t, _))| !self.eos().contains(&t))
            .map(|(o, &(_, _, node))| Grow {
                node: Some(node),
                tree: o,
                at: None,
            })
            .collect::<Vec<_>>();
        if !frontier.is_empty() {
            let rows: Vec<u32> = frontier
                .iter()
                .map(|g| (g.node.expect("a candidate node") - path.len()) as u32)
                .collect();
            let rows = Tensor::new(rows.as_slice(), &dev)?;
            let logits = logits.index_select(&rows, 0)?;
            if p.sampling.is_greedy() && p.widths.iter().all(|&w| w == 1) {
                // Greedy chains: every level on the device, one copy back at the end.
                let contexts: Vec<Vec<u32>> = frontier
                    .iter()
                    .map(|g| {
                        let (j, t, _) = outcomes[g.tree];
                        let mut ctx = tokens[..committed + j].to_vec();
                        ctx.push(t);
                        ctx
                    })
                    .collect();
                self.grow_chains(
                    s,
                    forest,
                    trees,
                    &frontier,
                    &contexts,
                    logits,
                    p.widths.len(),
                    stats,
                )?;
            } else {
                // The branches' trees, one pass per level; the session's tokens stand for the
                // forest's prefix while they grow.
                let saved = std::mem::replace(&mut s.tokens, tokens[..committed].to_vec());
                let grown = self.grow(s, forest, trees, frontier, logits, p, stats);
                s.tokens = saved;
                grown?;
            }
        }
        Ok(())
    }

    /// Pass 0: `feed` after the `keep` cached tokens, causally, into the cache; the logits of
    /// its rows `first..`. Replayed from a graph per row count where the model has exact rows
    /// passes (bf16 on CUDA with the fused kernels), else an eager forward.
    pub(crate) fn causal_rows(
        &self,
        s: &mut DraftSession,
        feed: &[u32],
        keep: usize,
        first: usize,
    ) -> Result<Tensor, EngineError> {
        let model = self.model();
        let cap = s.cache.capacity();
        if self.static_chains() && model.exact_rows_fit(cap, feed.len()) {
            let stepper = stepper_over(&mut s.stepper, model, cap)?;
            let logits = stepper
                .exact(model)?
                .step_chain(model, feed, &mut s.cache)?;
            // A copy: the stepper's buffer is overwritten by its next pass of this length.
            return Ok(logits.narrow(0, first, feed.len() - first)?.copy()?);
        }
        let dev = model.device();
        let ids = Tensor::new(feed, dev)?;
        let pos: Vec<u32> = (keep as u32..(keep + feed.len()) as u32).collect();
        let pos = Tensor::new(pos.as_slice(), dev)?;
        let rows: Vec<u32> = (first as u32..feed.len() as u32).collect();
        let rows = Tensor::new(rows.as_slice(), dev)?;
        Ok(model.forward(&ids, &pos, None, &mut s.cache, &rows)?)
    }

    /// Pass 0 from branch `b` of `g`: moves its first `rows` nodes to slots `keep..` (they
    /// are `tokens[keep..keep + rows]`), computes the rest of `tokens` after them (one step
    /// that keeps its logits for the usual single token, else [`DraftEngine::causal_rows`]),
    /// and returns the logits after each token from `keep + first` on: the kept nodes' from
    /// the growth. The caller extends the session's tokens past the kept ones.
    fn resume_branch(
        &self,
        s: &mut DraftSession,
        tokens: &[u32],
        keep: usize,
        (g, b, rows): (&GrownBranches, usize, usize),
        first: usize,
    ) -> Result<Tensor, EngineError> {
        let model = self.model();
        model.move_cache_entries(&s.cache, &g.moves(b, rows, keep))?;
        s.cache.advance(rows)?;
        s.tokens.extend_from_slice(&tokens[keep..keep + rows]);
        let kept = g
            .logits
            .narrow(0, 0, rows)?
            .narrow(1, b, 1)?
            .squeeze(1)?
            .to_dtype(DType::F32)?;
        let feed = &tokens[keep + rows..];
        let computed = if let [token] = feed {
            let cap = s.cache.capacity();
            let stepper = stepper_over(&mut s.stepper, model, cap)?;
            let logits = stepper.step_logits(model, &s.cache, *token, keep + rows)?;
            s.cache.advance(1)?;
            logits.to_dtype(DType::F32)?
        } else {
            self.causal_rows(s, feed, keep + rows, 0)?
        };
        let all = Tensor::cat(&[kept, computed], 0)?;
        Ok(all.narrow(0, first, all.dim(0)? - first)?)
    }

    /// Whether `n` greedy chains of `depth` tokens grow from one replayed graph
    /// ([`specsplit_models::step::DecodeStepper::grow_chains`]) after a sequence of `len` tokens.
    pub(crate) fn chains_replayable(
        &self,
        s: &DraftSession,
        len: usize,
        n: usize,
        depth: usize,
    ) -> bool {
        let cap = s.cache.capacity();
        self.static_chains()
            && n > 0
            && self.model().grow_chains_fit(cap, n)
            && len.saturating_add(n.saturating_mul(depth)) <= cap
    }

    /// The greedy chain of `depth` tokens below every outcome's candidate, all levels in one
    /// graph replay and one copy back: the candidates' nodes, then each level's, sit after the
    /// sequence `tokens` (committed + path) in the cache, and outcome `(j, t)` sees the
    /// committed tokens and the path's first `j`. A synthetic proposer's tokens (decided on the
    /// host from each outcome's context) replace the model's on the device. A chain is cut
    /// after an end-of-sequence token; a candidate that is one gets no tree.
    pub(crate) fn grow_chains_replayed(
        &self,
        s: &mut DraftSession,
        tokens: &[u32],
        committed: usize,
        outcomes: &[(usize, u32, usize)],
        trees: &mut [TokenTree],
        depth: usize,
    ) -> Result<(), EngineError> {
        let roots: Vec<u32> = outcomes.iter().map(|&(_, t, _)| t).collect();
        let leads: Vec<usize> = outcomes.iter().map(|&(j, _, _)| committed + j).collect();
        let mut forced = Vec::new();
        if self.synthetic().is_some() {
            let decided: Vec<Vec<Option<u32>>> = outcomes
                .iter()
                .map(|&(j, t, _)| {
                    let mut ctx = tokens[..committed + j].to_vec();
                    ctx.push(t);
                    self.oracle_chain(&ctx, depth, &mut s.rng)
                })
                .collect();
            forced = (0..depth)
                .flat_map(|l| decided.iter().map(move |d| d[l]))
                .collect();
        }
        let model = self.model();
        let cap = s.cache.capacity();
        let stepper = stepper_over(&mut s.stepper, model, cap)?;
        let (out, logits) = stepper.grow_chains(
            model,
            &s.cache,
            &roots,
            &leads,
            tokens.len(),
            depth,
            &forced,
        )?;
        // Rows: each level's tokens, then their log-probabilities; one copy for all.
        let packed: Vec<Vec<f32>> = out.to_vec2()?;
        s.grown = Some(GrownBranches {
            generation: s.cache.generation(),
            base: tokens.len(),
            branches: outcomes
                .iter()
                .enumerate()
                .map(|(o, &(j, t, _))| {
                    let fed = (0..depth - 1).map(|l| packed[l][o] as u32).collect();
                    (committed + j, t, fed)
                })
                .collect(),
            logits,
        });
        for (o, &(_, root, _)) in outcomes.iter().enumerate() {
            if self.eos().contains(&root) {
                continue;
            }
            let chain = (0..depth).map(|l| (packed[l][o] as u32, packed[depth + l][o]));
            self.push_chain(&mut trees[o], chain)?;
        }
        Ok(())
    }

    /// Appends a greedy chain of `(token, log-probability)` to the empty `tree`, cut after an
    /// end-of-sequence token.
    pub(crate) fn push_chain(
        &self,
        tree: &mut TokenTree,
        chain: impl Iterator<Item = (u32, f32)>,
    ) -> Result<(), EngineError> {
        let mut parent = None;
        for (tok, lp) in chain {
            let node = match parent {
                None => tree.push_root(tok, lp),
                Some(p) => tree.push_child(p, tok, lp),
            }
            .map_err(|e| EngineError::InvalidArgument(format!("draft tree: {e}")))?;
            if self.eos().contains(&tok) {
                break;
            }
            parent = Some(node);
        }
        Ok(())
    }

    /// Grows a greedy chain of `depth` tokens below each of `branches` (whose logits rows are
    /// `logits`, one per branch) with every level on the device: each level's tokens feed the
    /// next pass without a copy to the host, and all levels come back in one copy at the end
    /// (a chain is cut after an end-of-sequence token there). A synthetic proposer's tokens
    /// (decided on the host beforehand from each branch's context, as for chains drafted with
    /// fixed-shape steps) replace the model's on the device.
    #[allow(clippy::too_many_arguments)]
    fn grow_chains(
        &self,
        s: &mut DraftSession,
        forest: &mut Forest,
        trees: &mut [TokenTree],
        branches: &[Grow],
        contexts: &[Vec<u32>],
        mut logits: Tensor,
        depth: usize,
        stats: &mut DraftStats,
    ) -> Result<(), EngineError> {
        use candle_core::DType;
        let t0 = Instant::now();
        let dev = self.model().device().clone();
        let n = branches.len();
        let decided: Vec<Vec<Option<u32>>> = contexts
            .iter()
            .map(|ctx| self.oracle_chain(ctx, depth, &mut s.rng))
            .collect();
        let mut nodes: Vec<usize> = branches
            .iter()
            .map(|g| g.node.expect("a candidate node"))
            .collect();
        // Every level's inputs go to the device before the first pass (an upload from host
        // memory waits for the device's queue): the rows wanted, each level's positions (a
        // level-l node sits one below its branch's level-(l-1) node) and the synthetic tokens.
        let want = Tensor::new((0..n as u32).collect::<Vec<_>>().as_slice(), &dev)?;
        let first_depth: Vec<usize> = nodes
            .iter()
            .map(|&c| forest.prefix + forest.depth(c) + 1)
            .collect();
        let levels = depth.saturating_sub(1).max(1);
        let positions: Vec<u32> = (0..levels)
            .flat_map(|l| first_depth.iter().map(move |&p| (p + l) as u32))
            .collect();
        let positions = Tensor::from_vec(positions, (levels, n), &dev)?;
        let synthetic = decided.iter().any(|d| d.iter().any(Option::is_some));
        let overrides = if synthetic {
            let forced: Vec<u32> = (0..depth)
                .flat_map(|l| decided.iter().map(move |d| d[l].unwrap_or(0)))
                .collect();
            let on: Vec<u8> = (0..depth)
                .flat_map(|l| decided.iter().map(move |d| u8::from(d[l].is_some())))
                .collect();
            Some((
                Tensor::from_vec(forced, (depth, n), &dev)?,
                Tensor::from_vec(on, (depth, n), &dev)?,
            ))
        } else {
            None
        };
        let (mut toks, mut lps) = (Vec::with_capacity(depth), Vec::with_capacity(depth));
        for level in 0..depth {
            let l = logits.to_dtype(DType::F32)?;
            let lse = l.log_sum_exp(1)?;
            let mut ids = l.argmax(1)?;
            if let Some((forced, on)) = &overrides {
                ids = on.get(level)?.where_cond(&forced.get(level)?, &ids)?;
            }
            let lp = (l.gather(&ids.unsqueeze(1)?, 1)?.squeeze(1)? - lse)?;
            toks.push(ids.clone());
            lps.push(lp);
            if level + 1 == depth {
                break;
            }
            let first = forest.len();
            for node in &mut nodes {
                // The token is on the device; the host copy is filled in below.
                *node = forest.push(Some(*node), 0);
            }
            let pos = positions.get(level)?;
            logits = self.forward_forest_on_device(s, forest, first, &ids, &pos, &want)?;
            stats.tokens_processed += n;
        }
        // Token ids are below 2^24, so f32 carries them exactly: one copy for all levels.
        let ids = Tensor::stack(&toks, 1)?.to_dtype(DType::F32)?;
        let packed: Vec<Vec<f32>> = Tensor::cat(&[&ids, &Tensor::stack(&lps, 1)?], 1)?.to_vec2()?;
        for (g, row) in branches.iter().zip(&packed) {
            let chain = (0..depth).map(|l| (row[l] as u32, row[depth + l]));
            self.push_chain(&mut trees[g.tree], chain)?;
        }
        stats.model_time += t0.elapsed();
        Ok(())
    }

    /// The synthetic proposer's tokens for the first levels of a chain after `context`: each
    /// the reference's next token with probability β, else a wrong one, for as long as the
    /// chain stays on a reference (`None` from there on, and without a synthetic proposer).
    pub(crate) fn oracle_chain(
        &self,
        context: &[u32],
        depth: usize,
        rng: &mut rand_chacha::ChaCha8Rng,
    ) -> Vec<Option<u32>> {
        let mut out = vec![None; depth];
        let Some(o) = self.synthetic() else {
            return out;
        };
        let vocab = self.model().config().vocab_size as u32;
        let mut ctx = context.to_vec();
        for slot in &mut out {
            let Some(right) = o.next(&ctx) else { break };
            let tok = if rand::Rng::random_bool(rng, o.beta()) {
                right
            } else {
                (right + 1) % vocab
            };
            *slot = Some(tok);
            ctx.push(tok);
        }
        out
    }

    /// Where the engine has a synthetic proposer and it knows the target's token after
    /// `context` (a rejected path token `own`, or the bonus when `own` is `None`): makes the
    /// candidates hold it with the measured chance (see [`crate::draft::SyntheticOracle`]) and
    /// not hold it otherwise. The bonus's first candidate is the draft's own next token, right
    /// with the oracle's β like any drafted token.
    fn synthetic_candidates(
        &self,
        context: &[u32],
        own: Option<u32>,
        cands: &mut [u32],
        rng: &mut rand_chacha::ChaCha8Rng,
    ) {
        use rand::Rng;
        let Some(o) = self.synthetic() else { return };
        let Some(right) = o.next(context) else { return };
        if own == Some(right) || cands.is_empty() {
            // The target accepts the path's token here: this outcome cannot happen.
            return;
        }
        let vocab = self.model().config().vocab_size as u32;
        let m = cands.len();
        // Slots that may hold the right token, and whether it goes there.
        let (first, holds) = if own.is_none() {
            if rng.random_bool(o.beta()) {
                (0, true)
            } else {
                (1, rng.random_bool(o.coverage(m - 1)))
            }
        } else {
            (0, rng.random_bool(o.coverage(m)))
        };
        // A token the candidates do not hold, for a slot that must not hold the right one.
        let mut other = right;
        let mut fresh = |cands: &[u32]| loop {
            other = (other + 1) % vocab;
            if other != right && Some(other) != own && !cands.contains(&other) {
                return other;
            }
        };
        for i in 0..m {
            if cands[i] == right && (!holds || i < first) {
                cands[i] = fresh(cands);
            }
        }
        if holds && first < m && !cands[first..].contains(&right) {
            let slot = rng.random_range(first..m);
            cands[slot] = right;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use candle_core::{DType, Device};
    use specsplit_core::sampling::SamplingParams;
    use specsplit_models::transformer::Transformer;

    use super::*;
    use crate::draft::SyntheticOracle;
    use crate::engine_session::SessionEngine;

    #[test]
    fn a_grown_branch_is_kept_where_the_sequence_continues_it() {
        // Three branches of a growth of depth 4 from slot 10: one rooted after 8 tokens (a
        // rejection outcome), two after all 10 (the bonus outcomes).
        let g = GrownBranches {
            generation: 0,
            base: 10,
            branches: vec![
                (8, 50, vec![51, 52, 53]),
                (10, 60, vec![61, 62, 63]),
                (10, 70, vec![71, 72, 73]),
            ],
            logits: Tensor::zeros((4, 3, 2), DType::F32, &Device::Cpu).unwrap(),
        };
        let seq = |lead: u32, tail: &[u32]| {
            let mut t: Vec<u32> = (0..lead).collect();
            t.extend(tail);
            t
        };
        // The third branch's whole chain and the token after it: its four nodes are kept.
        assert_eq!(g.kept(&seq(10, &[70, 71, 72, 73, 74]), 10), Some((2, 4)));
        assert_eq!(
            g.moves(2, 4, 10),
            vec![(12, 10), (15, 11), (18, 12), (21, 13)]
        );
        // A path that leaves the branch after its second node keeps two.
        assert_eq!(g.kept(&seq(10, &[60, 61, 99, 63]), 10), Some((1, 2)));
        // The last token is always computed, so a sequence ending at the root keeps nothing.
        assert_eq!(g.kept(&seq(10, &[60, 61]), 10), Some((1, 1)));
        assert_eq!(g.kept(&seq(10, &[60]), 10), None);
        // A root no branch has, or a branch rooted elsewhere, keeps nothing.
        assert_eq!(g.kept(&seq(10, &[61, 62]), 10), None);
        assert_eq!(g.kept(&seq(8, &[50, 51, 52, 53, 54]), 8), Some((0, 4)));
        assert_eq!(g.kept(&seq(8, &[50, 51, 52, 53, 54]), 7), None);
        assert_eq!(g.moves(0, 4, 8), vec![(10, 8), (13, 9), (16, 10), (19, 11)]);
    }

    #[test]
    fn no_rows_are_kept_off_the_replayed_growth() {
        // On the CPU the branches grow op by op: nothing stays for the next pre-draft.
        let e = engine(true);
        let mut s = e.new_session(1).unwrap();
        let tokens: Vec<u32> = (1..12).collect();
        e.predraft(&mut s, &tokens, &all(8, 2), &params(&[1, 1]))
            .unwrap();
        assert!(s.grown.is_none());
    }

    fn engine(static_chains: bool) -> DraftEngine {
        let mut cfg = specsplit_models::config::ModelConfig::preset("tiny").unwrap();
        cfg.max_position_embeddings = 512;
        let m = Transformer::random(cfg, 11, DType::F32, &Device::Cpu).unwrap();
        DraftEngine::new(Arc::new(m), vec![], 400).with_static_chains(static_chains)
    }

    fn params(widths: &[usize]) -> DraftParams {
        DraftParams {
            widths: widths.to_vec(),
            sampling: SamplingParams::default(),
            deadline: None,
        }
    }

    fn all(committed: usize, candidates: usize) -> OutcomeSet {
        OutcomeSet {
            committed,
            candidates,
            accepted_lengths: Vec::new(),
        }
    }

    #[test]
    fn every_greedy_pre_draft_is_the_draft_its_outcome_would_get() {
        let e = engine(false);
        let seq: Vec<u32> = vec![5, 99, 41, 7, 300, 12];
        for widths in [vec![1, 1, 1], vec![2, 1]] {
            let mut s = e.new_session(1).unwrap();
            // The path under verification: the draft's own chain after `seq`.
            let path = e.draft(&mut s, &seq, &params(&[1; 4])).unwrap().0;
            let mut tokens = seq.clone();
            tokens.extend_from_slice(path.tokens());
            let (pre, _) = e
                .predraft(&mut s, &tokens, &all(seq.len(), 3), &params(&widths))
                .unwrap();
            assert_eq!(
                pre.len(),
                5 * 3,
                "every accepted length 0..=4, 3 candidates each"
            );
            // The candidates are the draft's best tokens other than the rejected one.
            let fresh = engine(false);
            for j in 0..=4 {
                let mut ctx = seq.clone();
                ctx.extend_from_slice(&path.tokens()[..j]);
                let top = fresh
                    .draft(&mut fresh.new_session(1).unwrap(), &ctx, &params(&[4]))
                    .unwrap()
                    .0;
                let want: Vec<u32> = top
                    .tokens()
                    .iter()
                    .copied()
                    .filter(|&t| path.tokens().get(j) != Some(&t))
                    .take(3)
                    .collect();
                let got: Vec<u32> = pre
                    .iter()
                    .filter(|p| p.accepted == j)
                    .map(|p| p.token)
                    .collect();
                assert_eq!(got, want, "accepted length {j}");
            }
            // Each tree is what an ordinary draft after its outcome proposes, token for token.
            for p in &pre {
                let mut ctx = seq.clone();
                ctx.extend_from_slice(&path.tokens()[..p.accepted]);
                ctx.push(p.token);
                let want = fresh
                    .draft(&mut fresh.new_session(1).unwrap(), &ctx, &params(&widths))
                    .unwrap()
                    .0;
                assert_eq!(
                    p.tree.tokens(),
                    want.tokens(),
                    "outcome ({}, {})",
                    p.accepted,
                    p.token
                );
                assert_eq!(p.tree.parents(), want.parents());
                for i in 0..want.len() {
                    assert!((p.tree.log_prob(i) - want.log_prob(i)).abs() < 1e-4);
                }
            }
            // The cache keeps the committed sequence and the path, every branch freed.
            assert_eq!(s.tokens(), &tokens[..]);
            assert_eq!(s.cache.len(), tokens.len());
        }
    }

    #[test]
    fn after_a_pre_draft_the_selected_outcome_drafts_as_a_fresh_session_would() {
        for static_chains in [false, true] {
            let e = engine(static_chains);
            let mut s = e.new_session(1).unwrap();
            let mut seq: Vec<u32> = vec![8, 16, 300, 2];
            for round in 0..4 {
                let path = e.draft(&mut s, &seq, &params(&[1; 3])).unwrap().0;
                let mut tokens = seq.clone();
                tokens.extend_from_slice(path.tokens());
                let (pre, _) = e
                    .predraft(&mut s, &tokens, &all(seq.len(), 2), &params(&[1, 1, 1]))
                    .unwrap();
                // The verdict: `round % 4` tokens accepted, the outcome's first candidate.
                let pick = pre.iter().find(|p| p.accepted == round % 4).unwrap();
                seq.extend_from_slice(&path.tokens()[..pick.accepted]);
                seq.push(pick.token);
                let fresh = engine(static_chains);
                let want = fresh
                    .draft(&mut fresh.new_session(1).unwrap(), &seq, &params(&[1; 3]))
                    .unwrap()
                    .0;
                assert_eq!(pick.tree.tokens(), want.tokens(), "round {round}");
                let again = e.draft(&mut s, &seq, &params(&[1; 3])).unwrap().0;
                assert_eq!(
                    again.tokens(),
                    want.tokens(),
                    "the session's cache is intact"
                );
            }
        }
    }

    #[test]
    fn chosen_lengths_only_and_bad_outcome_sets_are_refused() {
        let e = engine(false);
        let mut s = e.new_session(1).unwrap();
        let tokens: Vec<u32> = vec![1, 2, 3, 4, 5, 6];
        let set = OutcomeSet {
            committed: 3,
            candidates: 1,
            accepted_lengths: vec![3],
        };
        let (pre, _) = e.predraft(&mut s, &tokens, &set, &params(&[1, 1])).unwrap();
        assert_eq!(pre.len(), 1);
        assert_eq!(pre[0].accepted, 3);
        let bad = |committed, candidates, lengths: Vec<usize>| OutcomeSet {
            committed,
            candidates,
            accepted_lengths: lengths,
        };
        for set in [
            bad(0, 1, vec![]),
            bad(7, 1, vec![]),
            bad(3, 0, vec![]),
            bad(3, 1, vec![2, 1]),
            bad(3, 1, vec![4]),
        ] {
            let err = e
                .predraft(&mut s, &tokens, &set, &params(&[1]))
                .unwrap_err();
            assert!(
                matches!(err, EngineError::InvalidArgument(_)),
                "{set:?}: {err}"
            );
        }
        // More nodes than the session holds.
        let err = e
            .predraft(&mut s, &tokens, &all(3, 4), &params(&[1; 40]))
            .unwrap_err();
        assert!(matches!(err, EngineError::InvalidArgument(_)), "{err}");
    }

    #[test]
    fn the_synthetic_drafter_holds_a_rejected_token_only_as_often_as_its_coverage() {
        let seq: Vec<u32> = vec![4, 8, 15, 16];
        let reference: Vec<u32> = seq.iter().copied().chain([23, 42, 99, 100, 101]).collect();
        // A path whose every token is wrong: the target's token at accepted length j is
        // reference[4 + j] only for j = 0 (later lengths leave the reference).
        let path = [400u32, 401, 402];
        let mut tokens = seq.clone();
        tokens.extend_from_slice(&path);
        for (coverage, want) in [(1.0, 1.0), (0.0, 0.0), (0.5, 0.5)] {
            let oracle =
                SyntheticOracle::new(vec![reference.clone()], 0.8).with_coverage(vec![coverage]);
            let e = engine(false).with_synthetic(oracle);
            let mut held = 0;
            let n = 200;
            for seed in 0..n {
                let mut s = e.new_session(seed).unwrap();
                let set = OutcomeSet {
                    committed: seq.len(),
                    candidates: 2,
                    accepted_lengths: vec![0],
                };
                let (pre, _) = e.predraft(&mut s, &tokens, &set, &params(&[1])).unwrap();
                assert_eq!(pre.len(), 2);
                held += usize::from(pre.iter().any(|p| p.token == 23));
            }
            let rate = held as f64 / n as f64;
            assert!(
                (rate - want).abs() < 0.12,
                "coverage {coverage}: held {rate}"
            );
        }
        // The bonus after a right path: its first candidate is right with β.
        let oracle = SyntheticOracle::new(vec![reference.clone()], 1.0).with_coverage(vec![0.0]);
        let e = engine(false).with_synthetic(oracle);
        let mut right = seq.clone();
        right.extend_from_slice(&[23, 42]);
        let set = OutcomeSet {
            committed: seq.len(),
            candidates: 1,
            accepted_lengths: vec![2],
        };
        let (pre, _) = e
            .predraft(
                &mut e.new_session(3).unwrap(),
                &right,
                &set,
                &params(&[1, 1]),
            )
            .unwrap();
        assert_eq!(pre[0].token, 99);
        assert_eq!(
            pre[0].tree.tokens(),
            &[100, 101],
            "its tree follows the reference"
        );
    }
}

/// On a GPU: a pre-draft that keeps the rows its predecessor grew for the selected branch
/// leaves the cache and drafts as one that computes the whole sequence. Needs the `cuda`
/// feature and a GPU; without a GPU the test says so and returns.
#[cfg(all(test, feature = "cuda"))]
mod gpu_tests {
    use std::sync::Arc;

    use candle_core::{DType, Device, Tensor};
    use specsplit_core::sampling::SamplingParams;
    use specsplit_models::config::ModelConfig;
    use specsplit_models::transformer::Transformer;

    use super::{OutcomeSet, PreDrafted};
    use crate::draft::{DraftEngine, DraftParams, DraftSession};
    use crate::engine_session::SessionEngine;

    /// The largest difference between `a` and `b` relative to `b`'s largest magnitude.
    fn rel_diff(a: &Tensor, b: &Tensor) -> f32 {
        let host = |t: &Tensor| -> Vec<f32> {
            let t = t.to_dtype(DType::F32).and_then(|t| t.flatten_all());
            t.and_then(|t| t.to_vec1()).unwrap()
        };
        let (a, b) = (host(a), host(b));
        assert_eq!(a.len(), b.len());
        let scale = b.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        a.iter()
            .zip(&b)
            .fold(0f32, |m, (x, y)| m.max((x - y).abs()))
            / scale
    }

    fn keyed(p: &[PreDrafted]) -> Vec<(usize, u32, Vec<u32>)> {
        p.iter()
            .map(|o| {
                let toks = o.tree.tokens().to_vec();
                (o.accepted, o.token, toks)
            })
            .collect()
    }

    /// A random bf16 model of the 0.5B shape cut to three layers and an 8192-token
    /// vocabulary, on the first GPU (`None`, after saying so, without one).
    fn small_gpu_model() -> Option<Arc<Transformer>> {
        let dev = match Device::new_cuda(0) {
            Ok(d) => d,
            Err(e) => {
                eprintln!("no GPU, skipping: {e}");
                return None;
            }
        };
        let mut cfg = ModelConfig::preset("qwen2.5-0.5b").unwrap();
        cfg.num_hidden_layers = 3;
        cfg.vocab_size = 8192;
        cfg.max_position_embeddings = 2048;
        Some(Arc::new(
            Transformer::random(cfg, 7, DType::BF16, &dev).unwrap(),
        ))
    }

    #[test]
    fn a_pre_draft_keeping_its_branch_drafts_as_one_that_computes_it() {
        let Some(model) = small_gpu_model() else {
            return;
        };
        let e = DraftEngine::new(model, vec![], 1024);
        let p = DraftParams {
            widths: vec![1; 4],
            sampling: SamplingParams::default(),
            deadline: None,
        };
        let set = |committed| OutcomeSet {
            committed,
            candidates: 2,
            accepted_lengths: Vec::new(),
        };
        let mut tokens: Vec<u32> = (0..12).map(|i| (i * 89 + 3) % 8192).collect();
        let committed = tokens.len();
        tokens.extend([17, 4000, 123, 77]);
        let (mut same, mut outcomes) = (0, 0);
        // The bonus outcomes and two rejections; each selected on a session of its own.
        for pick in [0usize, 1, 2, 3, 8, 9] {
            let mut kept: DraftSession = e.new_session(1).unwrap();
            // Three rounds first, so that the growth's graph is captured and replayed.
            let mut first = Vec::new();
            for _ in 0..3 {
                first = e
                    .predraft(&mut kept, &tokens, &set(committed), &p)
                    .unwrap()
                    .0;
            }
            assert!(kept.grown.is_some());
            let o = &first[first.len() - 1 - pick.min(first.len() - 1)];
            let mut next = tokens[..committed + o.accepted].to_vec();
            next.push(o.token);
            let chain = o.tree.tokens().to_vec();
            assert_eq!(chain.len(), 4);
            next.extend(&chain);
            let c = committed + o.accepted + 1;
            let (with, stats) = e.predraft(&mut kept, &next, &set(c), &p).unwrap();
            assert_eq!(
                stats.tokens_processed,
                1 + with.len() * 4,
                "one row computed"
            );
            let mut fresh: DraftSession = e.new_session(1).unwrap();
            let (without, stats) = e.predraft(&mut fresh, &next, &set(c), &p).unwrap();
            assert_eq!(stats.tokens_processed, next.len() + without.len() * 4);
            // The same cache (bf16 rounding of two kernel paths apart) and the same logits after
            // the path.
            assert_eq!(kept.cache.len(), fresh.cache.len());
            for l in 0..3 {
                let (a, b) = (kept.cache.layer(l), fresh.cache.layer(l));
                assert!(
                    rel_diff(&a.0, &b.0) < 0.05 && rel_diff(&a.1, &b.1) < 0.05,
                    "layer {l}"
                );
            }
            let (a, b) = (kept.last_logits.as_ref(), fresh.last_logits.as_ref());
            let d = rel_diff(a.unwrap(), b.unwrap());
            assert!(d < 0.05, "logits after the path differ by {d}");
            let (with, without) = (keyed(&with), keyed(&without));
            outcomes += without.len();
            same += with.iter().filter(|o| without.contains(o)).count();
        }
        // A near-tie may break the other way between the two kernel paths; a kept row in the
        // wrong place would change nearly every outcome.
        assert!(
            same * 10 >= outcomes * 8,
            "{same} of {outcomes} outcomes the same"
        );
    }

    #[test]
    fn a_tree_of_rooted_chains_grown_in_one_replay_drafts_as_its_level_passes() {
        let Some(model) = small_gpu_model() else {
            return;
        };
        let replayed = DraftEngine::new(model.clone(), vec![], 1024).with_static_chains(true);
        let levels = DraftEngine::new(model, vec![], 1024).with_static_chains(false);
        let (mut same, mut trees) = (0, 0);
        for widths in [vec![2, 1, 1, 1], vec![3, 1, 1], vec![4, 1, 1, 1, 1]] {
            let p = DraftParams {
                widths: widths.clone(),
                sampling: SamplingParams::default(),
                deadline: None,
            };
            let mut a: DraftSession = replayed.new_session(1).unwrap();
            let mut b: DraftSession = levels.new_session(1).unwrap();
            let mut seq: Vec<u32> = (0..20).map(|i| (i * 131 + 7) % 8192).collect();
            for round in 0..6 {
                let (x, sx) = replayed.draft(&mut a, &seq, &p).unwrap();
                let (y, _) = levels.draft(&mut b, &seq, &p).unwrap();
                // The same shape, breadth-first; the cache holds the sequence alone after.
                assert_eq!(x.parents(), y.parents(), "{widths:?} round {round}");
                assert_eq!(x.len(), specsplit_core::tree::full_tree_size(&widths));
                assert_eq!(a.cache.len(), seq.len());
                assert!(a.grown.is_none());
                assert!(sx.tokens_processed >= widths[0] * (widths.len() - 1));
                trees += 1;
                same += usize::from(x.tokens() == y.tokens());
                // Accept the second root and its child, then a token of the verifier's.
                seq.extend([
                    x.token(1),
                    x.token(widths[0] + 1),
                    (round as u32 * 97 + 5) % 8192,
                ]);
            }
        }
        // A near-tie may break the other way between the two kernel paths.
        assert!(same * 10 >= trees * 8, "{same} of {trees} trees the same");
    }
}
