//! Greedy chains on the fixed-shape path ([`DraftEngine::with_static_chains`], on by default
//! on CUDA), in three phases: [`DraftEngine::start_chain`] brings the session's cache to the
//! request's sequence but its uncached tail (a long one is prefilled first) and decides the
//! synthetic proposer's tokens; the chain then grows either alone, through the session's own
//! [`DecodeStepper`] ([`DraftEngine::chain_alone`]), or together with the chains of other
//! sessions ready at the same time, all of them in one graph-replayed pass a level
//! ([`DraftEngine::chains_together`], [`SessionChainsStepper`]); the round ends by keeping the
//! chain's fed tokens cached after the sequence (their K/V are valid), so that when the
//! verifier accepts them the next round only feeds the correction.
//!
//! A chain grown together is its session's greedy chain up to bf16 rounding (its products take
//! other kernels than a step alone): a near-tie may break the other way. The verifier decides
//! what is emitted, so the output does not depend on it.

use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};
use specsplit_core::tree::TokenTree;
use specsplit_models::step::SessionChainsStepper;
use specsplit_models::transformer::{SessionChain, CHAIN_FEED_MAX};

use crate::draft::{has_stepper_over, stepper_over, DraftEngine, DraftSession, DraftStats};
use crate::engine_session::common_prefix;
use crate::EngineError;

/// Longest uncached tail fed through the chain's passes; a longer one (a new prompt) goes
/// through one causal forward first, all but its last token.
const STATIC_FEED_MAX: usize = 4;

/// A greedy chain between its phases: the session's uncached tail still to feed and the
/// synthetic proposer's tokens, one per level (decided when the round started).
pub struct ChainRound {
    feed: Vec<u32>,
    forced: Vec<Option<u32>>,
    stats: DraftStats,
}

impl ChainRound {
    /// Tokens in the chain.
    pub fn depth(&self) -> usize {
        self.forced.len()
    }

    /// Rows of the chain's first pass: its uncached tail.
    pub fn feed_rows(&self) -> usize {
        self.feed.len()
    }
}

/// Each level's `(token, log-probability)` of a grown chain.
type Levels = Vec<(u32, f32)>;

impl DraftEngine {
    /// The first phase of a greedy chain of `depth` tokens continuing `tokens`: the session's
    /// cache cut back to its longest common prefix with `tokens` (at most all but the last
    /// token), a long uncached tail prefilled but for its last token, and the synthetic
    /// proposer's tokens decided. The cache must have room for the sequence and the chain.
    pub(crate) fn start_chain(
        &self,
        s: &mut DraftSession,
        tokens: &[u32],
        depth: usize,
        mut stats: DraftStats,
    ) -> Result<ChainRound, EngineError> {
        let started = Instant::now();
        s.last_logits = None;
        let keep = common_prefix(&s.tokens, tokens).min(tokens.len() - 1);
        stats.cache_hit = keep > 0;
        s.cache.truncate(keep)?;
        s.tokens.truncate(keep);
        let mut feed = &tokens[keep..];
        if feed.len() > STATIC_FEED_MAX {
            let head = &feed[..feed.len() - 1];
            let t = Instant::now();
            self.model().prefill(head, &mut s.cache)?;
            tracing::debug!(
                tokens = head.len(),
                cached = keep,
                ms = t.elapsed().as_secs_f64() * 1e3,
                "draft chain: prefilled the uncached tail"
            );
            s.tokens.extend_from_slice(head);
            feed = &feed[feed.len() - 1..];
        }
        stats.tokens_processed += tokens.len() - keep;
        let forced = self.oracle_chain(tokens, depth, &mut s.rng);
        stats.model_time += started.elapsed();
        Ok(ChainRound {
            feed: feed.to_vec(),
            forced,
            stats,
        })
    }

    /// Grows the chain alone through the session's fixed-shape steps: the uncached tail in one
    /// pass where the model can, then one replayed step a level, each step's greedy token (or
    /// the proposer's) feeding the next on the device; the whole chain comes back in one copy.
    pub(crate) fn chain_alone(
        &self,
        s: &mut DraftSession,
        round: ChainRound,
    ) -> Result<(TokenTree, DraftStats), EngineError> {
        let t0 = Instant::now();
        let new_stepper = !has_stepper_over(&s.stepper, s.cache.capacity());
        let grown = self.grow_alone(s, &round);
        tracing::debug!(
            depth = round.depth(),
            fed = round.feed.len(),
            new_stepper,
            ok = grown.is_ok(),
            ms = t0.elapsed().as_secs_f64() * 1e3,
            "draft chain: grown alone"
        );
        let levels = self.or_reset(s, grown)?;
        self.finish_chain(s, round, levels, t0.elapsed())
    }

    /// [`DraftEngine::chain_alone`]'s passes: each level's token and log-probability.
    fn grow_alone(&self, s: &mut DraftSession, round: &ChainRound) -> Result<Levels, EngineError> {
        let depth = round.depth();
        let DraftSession { cache, stepper, .. } = s;
        let dev = self.model().device();
        let stepper = stepper_over(stepper, self.model(), cache.capacity())?;
        // Two or more tokens (the accepted chain's last token and the bonus) go through in one
        // pass where the model can.
        stepper.feed(self.model(), cache, &round.feed, cache.len())?;
        // Level j's greedy token and log-probability land in slot j of these.
        let out_tok = Tensor::zeros(depth, DType::U32, dev)?;
        let out_lp = Tensor::zeros(depth, DType::F32, dev)?;
        out_tok.slice_set(&stepper.buffers().next, 0, 0)?;
        out_lp.slice_set(&stepper.buffers().next_logprob, 0, 0)?;
        for j in 0..depth - 1 {
            if let Some(t) = round.forced[j] {
                stepper.set_token(t)?;
            }
            // The step reads the cache past its length: the fed tokens and levels so far.
            stepper.step(self.model(), cache)?;
            out_tok.slice_set(&stepper.buffers().next, 0, j + 1)?;
            out_lp.slice_set(&stepper.buffers().next_logprob, 0, j + 1)?;
        }
        let out: Vec<f32> =
            Tensor::cat(&[&out_tok.to_dtype(DType::F32)?, &out_lp], 0)?.to_vec1()?;
        Ok((0..depth)
            .map(|j| (round.forced[j].unwrap_or(out[j] as u32), out[depth + j]))
            .collect())
    }

    /// Whether the chains of `sessions` sessions whose caches hold at most `capacity` slots
    /// grow together on this engine.
    pub(crate) fn chains_together_fit(&self, sessions: usize, capacity: usize) -> bool {
        sessions >= 2 && self.static_chains() && self.model().session_chains_fit(capacity, sessions)
    }

    /// Whether `round`'s chain can grow with others' to `depth` (at least its own) tokens:
    /// at most [`CHAIN_FEED_MAX`] tokens to feed, and room in the session's cache for them, the
    /// chain and the slot past it.
    pub(crate) fn joins_chains(&self, s: &DraftSession, round: &ChainRound, depth: usize) -> bool {
        let fed = round.feed.len();
        (1..=CHAIN_FEED_MAX).contains(&fed)
            && round.depth() <= depth
            && s.cache.len() + fed + depth <= s.cache.capacity()
    }

    /// Grows the chains of several sessions (each one that [`DraftEngine::joins_chains`] at
    /// the deepest of their depths) in one graph-replayed pass a level, all to that depth
    /// (one graph for every depth the sessions ask for; a shallower chain keeps its own
    /// levels); returns each member's tree and what it cost (the shared passes count in full
    /// for each member). If the shared growth fails, nothing was kept: each chain then grows
    /// alone, so only a bad one fails.
    pub(crate) fn chains_together(
        &self,
        members: Vec<(&mut DraftSession, ChainRound)>,
    ) -> Vec<Result<(TokenTree, DraftStats), EngineError>> {
        let t0 = Instant::now();
        let shared = self.grow_together(&members);
        let elapsed = t0.elapsed();
        tracing::debug!(
            sessions = members.len(),
            depth = deepest(&members),
            ok = shared.is_ok(),
            ms = elapsed.as_secs_f64() * 1e3,
            "draft chain: grown together"
        );
        match shared {
            Ok(levels) => members
                .into_iter()
                .zip(levels)
                .map(|((s, round), l)| self.finish_chain(s, round, l, elapsed))
                .collect(),
            Err(e) => {
                tracing::warn!(
                    "a shared draft chain of {} sessions failed ({e}); drafting each alone",
                    members.len()
                );
                members
                    .into_iter()
                    .map(|(s, round)| self.chain_alone(s, round))
                    .collect()
            }
        }
    }

    /// [`DraftEngine::chains_together`]'s passes: each member's levels.
    fn grow_together(
        &self,
        members: &[(&mut DraftSession, ChainRound)],
    ) -> Result<Vec<Levels>, EngineError> {
        let depth = deepest(members);
        let capacity = members.iter().map(|(s, _)| s.cache.capacity()).max();
        let capacity = capacity.unwrap_or(0);
        if !members.iter().all(|(s, r)| self.joins_chains(s, r, depth))
            || !self.chains_together_fit(members.len(), capacity)
        {
            return Err(EngineError::InvalidArgument(
                "chains with long feeds, without room or on a model without shared chains".into(),
            ));
        }
        specsplit_core::device::bind_to_thread(self.model().device())?;
        // Every chain grows to the deepest: the proposer decides no level past a chain's own.
        let forced: Vec<Vec<Option<u32>>> = members
            .iter()
            .map(|(_, r)| {
                let mut f = r.forced.clone();
                f.resize(depth, None);
                f
            })
            .collect();
        let chains: Vec<SessionChain<'_>> = members
            .iter()
            .zip(&forced)
            .map(|((s, r), forced)| SessionChain {
                cache: &s.cache,
                feed: &r.feed,
                forced,
            })
            .collect();
        let out = {
            let mut stepper = self.chain_stepper();
            stepper.grow(self.model(), &chains, depth, capacity)?
        };
        // Rows: each level's tokens, then their log-probabilities; one copy for all.
        let packed: Vec<Vec<f32>> = out.to_vec2()?;
        Ok(members
            .iter()
            .enumerate()
            .map(|(i, (_, r))| {
                (0..r.depth())
                    .map(|l| (packed[l][i] as u32, packed[depth + l][i]))
                    .collect()
            })
            .collect())
    }

    /// Shapes of chains grown together made so far (each costs an eager pass and a capture).
    pub fn chain_shapes_made(&self) -> u64 {
        self.chain_stepper().shapes_made()
    }

    /// Host time spent so far in shared chain growths that made a shape, ran it eagerly or
    /// captured it.
    pub fn chain_shapes_time(&self) -> Duration {
        self.chain_stepper().making_time()
    }

    /// The engine's shared-chain graphs, locked (only the holder of the draft pass's turn
    /// grows chains together, so the lock is never contended).
    fn chain_stepper(&self) -> std::sync::MutexGuard<'_, SessionChainsStepper> {
        self.chains
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A failed chain leaves nothing in the cache that is trusted: the session starts over.
    fn or_reset<T>(
        &self,
        s: &mut DraftSession,
        r: Result<T, EngineError>,
    ) -> Result<T, EngineError> {
        if r.is_err() {
            let _ = s.cache.truncate(0);
            s.tokens.clear();
            s.last_logits = None;
        }
        r
    }

    /// The last phase: the fed tokens and every level but the last (they went through the
    /// model) stay cached after the sequence, and the chain, cut after an end of sequence,
    /// becomes the tree. `passes` is the time of the chain's passes (in full where shared).
    fn finish_chain(
        &self,
        s: &mut DraftSession,
        round: ChainRound,
        levels: Levels,
        passes: Duration,
    ) -> Result<(TokenTree, DraftStats), EngineError> {
        let ChainRound {
            feed, mut stats, ..
        } = round;
        let depth = levels.len();
        let kept = s
            .cache
            .advance(feed.len() + depth - 1)
            .map_err(EngineError::from);
        self.or_reset(s, kept)?;
        s.tokens.extend_from_slice(&feed);
        s.tokens.extend(levels[..depth - 1].iter().map(|l| l.0));
        stats.tokens_processed += depth - 1;
        let mut tree = TokenTree::new();
        tree.set_siblings_without_replacement(true);
        self.push_chain(&mut tree, levels.iter().copied())?;
        stats.model_time += passes;
        Ok((tree, stats))
    }
}

/// The deepest chain among `members` (all grow to it together).
fn deepest(members: &[(&mut DraftSession, ChainRound)]) -> usize {
    members.iter().map(|(_, r)| r.depth()).max().unwrap_or(0)
}
