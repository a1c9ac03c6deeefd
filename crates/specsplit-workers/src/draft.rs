//! The draft engine: keeps a per-session KV cache that follows the accepted sequence and drafts
//! token trees level by level with tree attention over that cache.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Tensor};
use rand_chacha::ChaCha8Rng;
use specsplit_core::mask::TreeMask;
use specsplit_core::sampling::{self, SamplingParams};
use specsplit_core::tree::{full_tree_size, Distribution, TokenTree};
use specsplit_models::cpu_attention::TreeRows;
use specsplit_models::step::{DecodeStepper, SessionChainsStepper};
use specsplit_models::transformer::{SessionPass, Transformer};

use crate::draft_chain::ChainRound;
use crate::engine_session::{
    common_prefix, session_cache_bytes, CacheClasses, EngineSession, SessionEngine,
};
use crate::session::KvCharge;
use crate::spare::{SessionBody, Spares};
use crate::EngineError;

/// One draft session: the cached sequence, the logits after its last token, and the
/// fixed-shape greedy steps over its cache for chain drafts (made at the first chain).
pub type DraftSession = EngineSession<DecodeStepper>;

/// How to draft one tree.
#[derive(Debug, Clone)]
pub struct DraftParams {
    /// Children per node at each depth (`widths[0]` = number of roots); its length is the depth.
    pub widths: Vec<usize>,
    /// Sampling transforms; greedy drafts take the top-w tokens.
    pub sampling: SamplingParams,
    /// When nobody waits for the tree any more (the request's deadline): drafting stops at its
    /// next checkpoint after it with [`EngineError::DeadlineExceeded`]. `None`: no limit.
    pub deadline: Option<Instant>,
}

/// Tokens a draft's prefix catch-up forwards at once on a CPU, where a prompt's catch-up
/// takes seconds: between these chunks a draft whose deadline passed stops (on a GPU the
/// whole catch-up is one pass of milliseconds).
pub const CPU_CATCH_UP_CHUNK: usize = 32;

/// [`EngineError::DeadlineExceeded`] once `deadline` has passed, before `what`.
pub(crate) fn before_deadline(deadline: Option<Instant>, what: &str) -> Result<(), EngineError> {
    match deadline {
        Some(d) if Instant::now() >= d => Err(EngineError::DeadlineExceeded(format!(
            "the request's deadline passed before {what}; nothing waits for its answer"
        ))),
        _ => Ok(()),
    }
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
/// token otherwise, while the draft model's forward passes are still paid for. Where the first
/// child is wrong, the target's token is the draft's `a`-th alternative with the measured
/// chance (see [`SyntheticOracle::alternative_rank`]), so a tree's further children hold it as
/// often as a real draft's would. Its results measure the system's efficiency apart from draft
/// quality and must be labelled synthetic.
///
/// Clones share one reference set, so a benchmark can add continuations it observed (the
/// target's verification path may break a near-tie differently than its single-token decode).
/// The latest reference that continues a context wins.
///
/// For pre-drafts it also decides whether the target's token at a rejected position lies among
/// the draft's alternatives there: with probability [`SyntheticOracle::coverage`] of their
/// number, as measured on a real pair, and never otherwise (a random-weight draft's own
/// alternatives would almost never hold it, a perfect oracle's always would).
#[derive(Debug, Clone)]
pub struct SyntheticOracle {
    references: Arc<std::sync::RwLock<Vec<Vec<u32>>>>,
    beta: f64,
    coverage: Vec<f64>,
}

/// The chance that the target's token at a position where the draft's first choice was wrong
/// lies among the draft's next `a` likeliest tokens, for a = 1, 2, …, measured on the
/// Qwen2.5-Coder 0.5B → 1.5B pair (greedy, CPU, 8 built-in prompts × 128 tokens, 1017
/// positions of which 106 had the draft's first choice wrong: `specsplit-bench coverage
/// --max-tokens 128`, 2026-11-26); the default of the synthetic drafter's
/// [`SyntheticOracle::coverage`].
pub const MEASURED_COVERAGE: [f64; 8] = [0.71, 0.85, 0.94, 0.97, 0.98, 0.98, 0.99, 1.0];

impl SyntheticOracle {
    /// An oracle over full reference sequences (prompt + target-only continuation).
    pub fn new(references: Vec<Vec<u32>>, beta: f64) -> Self {
        Self {
            references: Arc::new(std::sync::RwLock::new(references)),
            beta: beta.clamp(0.0, 1.0),
            coverage: MEASURED_COVERAGE.to_vec(),
        }
    }

    /// This oracle with `coverage[a - 1]` the chance that a rejected position's target token
    /// lies among `a` alternatives (each clamped to [0, 1]; beyond the list, its last value).
    pub fn with_coverage(mut self, coverage: Vec<f64>) -> Self {
        self.coverage = coverage.into_iter().map(|c| c.clamp(0.0, 1.0)).collect();
        self
    }

    /// The chance that the target's token at a position where the draft's first choice was
    /// wrong lies among `alternatives` other candidates (0 for none).
    pub fn coverage(&self, alternatives: usize) -> f64 {
        match alternatives {
            0 => 0.0,
            a => self
                .coverage
                .get(a - 1)
                .or(self.coverage.last())
                .copied()
                .unwrap_or(0.0),
        }
    }

    /// Where the draft's first choice is wrong, the rank among its alternatives (1: the
    /// second likeliest token) at which the target's token lies, for a uniform draw `u` in
    /// [0, 1): `a` with probability `coverage(a) - coverage(a - 1)`; `None` past the list's
    /// last value (a rank too deep to matter, or none).
    pub fn alternative_rank(&self, u: f64) -> Option<usize> {
        self.coverage.iter().position(|&c| u < c).map(|i| i + 1)
    }

    /// The coverage list (see [`SyntheticOracle::with_coverage`]).
    pub fn coverage_list(&self) -> &[f64] {
        &self.coverage
    }

    /// The per-token acceptance it simulates.
    pub fn beta(&self) -> f64 {
        self.beta
    }

    /// Adds a full sequence (prompt + continuation) unless a reference already holds it;
    /// returns whether it was added.
    pub fn add_reference(&self, sequence: Vec<u32>) -> bool {
        let mut refs = self.references.write().unwrap_or_else(|e| e.into_inner());
        if refs.iter().any(|r| r.starts_with(&sequence)) {
            return false;
        }
        refs.push(sequence);
        true
    }

    /// Number of reference sequences.
    pub fn num_references(&self) -> usize {
        self.references
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// The next token after `context` of the latest reference that continues it, if any.
    pub fn next(&self, context: &[u32]) -> Option<u32> {
        self.references
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .rev()
            .find(|r| r.len() > context.len() && r.starts_with(context))
            .map(|r| r[context.len()])
    }
}

/// Draft nodes grown in shared passes over one session's cache: node `i` sits in the cache at
/// slot `prefix + i`, sees the prefix and its ancestors, and sits at position `prefix + depth`.
/// Unlike a [`TokenTree`] its nodes are in pass order, not breadth-first (branches may start at
/// different depths), so one pass can hold the nodes of many trees.
pub(crate) struct Forest {
    /// Cache slots before the first node.
    pub(crate) prefix: usize,
    parents: Vec<Option<usize>>,
    depths: Vec<usize>,
    tokens: Vec<u32>,
}

impl Forest {
    /// An empty forest after `prefix` cached tokens.
    pub(crate) fn new(prefix: usize) -> Self {
        Self {
            prefix,
            parents: Vec::new(),
            depths: Vec::new(),
            tokens: Vec::new(),
        }
    }

    /// Number of nodes.
    pub(crate) fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Adds a node holding `token` below `parent` (`None`: right after the prefix).
    pub(crate) fn push(&mut self, parent: Option<usize>, token: u32) -> usize {
        self.depths.push(parent.map_or(0, |p| self.depths[p] + 1));
        self.parents.push(parent);
        self.tokens.push(token);
        self.tokens.len() - 1
    }

    /// Levels above `node` (0 for a node right after the prefix).
    pub(crate) fn depth(&self, node: usize) -> usize {
        self.depths[node]
    }

    /// Tokens from the first node after the prefix down to `node`, inclusive (none for `None`).
    pub(crate) fn path_tokens(&self, node: Option<usize>) -> Vec<u32> {
        let mut out = Vec::new();
        let mut cur = node;
        while let Some(n) = cur {
            out.push(self.tokens[n]);
            cur = self.parents[n];
        }
        out.reverse();
        out
    }
}

/// A node whose children the next level picks.
pub(crate) struct Grow {
    /// Its forest node (`None`: the prefix's last token).
    pub(crate) node: Option<usize>,
    /// The tree its children go to.
    pub(crate) tree: usize,
    /// Their parent in that tree (`None`: they are its roots).
    pub(crate) at: Option<usize>,
}

/// The rows of `next` (grown nodes, each a forest node from `first` on) relative to `first`.
fn want_rows(next: &[Grow], first: usize) -> Vec<u32> {
    next.iter()
        .map(|g| (g.node.expect("a grown node") - first) as u32)
        .collect()
}

/// The synthetic proposer's alternatives where its first child `children[0]` is wrong: the
/// target's token `right` goes to the child at the rank the oracle draws (when the expansion
/// has that many children) and no other child holds it; the children stay distinct.
fn place_alternative(
    children: &mut [(u32, f32)],
    right: u32,
    o: &SyntheticOracle,
    vocab: u32,
    rng: &mut ChaCha8Rng,
) {
    let rank = o
        .alternative_rank(rand::Rng::random::<f64>(rng))
        .filter(|&r| r < children.len());
    if let Some(i) = rank {
        if children[i].0 != right {
            // A sibling that held `right` takes this child's token.
            let old = children[i].0;
            if let Some(c) = children.iter_mut().find(|c| c.0 == right) {
                c.0 = old;
            }
            children[i].0 = right;
        }
    }
    let mut other = right;
    for i in 1..children.len() {
        if Some(i) != rank && children[i].0 == right {
            other = loop {
                other = (other + 1) % vocab;
                if other != right && !children.iter().any(|c| c.0 == other) {
                    break other;
                }
            };
            children[i].0 = other;
        }
    }
}

/// What [`DraftEngine::prepare`] leaves: a greedy chain on the fixed-shape path, or a round
/// whose levels go on.
pub enum Prepared {
    /// A greedy chain on the fixed-shape path ([`crate::draft_chain`]), waiting to grow alone
    /// or with other sessions' chains.
    Chain(ChainRound),
    /// A round waiting for its level passes (or complete, when it has none pending).
    Levels(DraftRound),
}

/// A level's nodes waiting for their pass: forest nodes `first..`, of which the rows `want`
/// (relative to `first`) grow on.
struct LevelRows {
    first: usize,
    want: Vec<u32>,
}

/// One session's draft between its phases: the tree grown so far over the session's cache,
/// the frontier whose children the next level picks, and the level waiting for its pass.
pub struct DraftRound {
    params: DraftParams,
    forest: Forest,
    /// The one tree being drafted (in a slice, as [`DraftEngine::grow`] takes it).
    trees: Vec<TokenTree>,
    frontier: Vec<Grow>,
    /// Logits rows of the frontier's nodes, (frontier, vocab).
    logits: Tensor,
    /// The level whose children were picked last.
    level: usize,
    pending: Option<LevelRows>,
    stats: DraftStats,
}

impl DraftRound {
    /// Whether the tree is complete (no level waits for a pass).
    pub fn is_complete(&self) -> bool {
        self.pending.is_none()
    }

    /// Puts a token outside every vocabulary into the pending level, so that its pass fails.
    #[cfg(test)]
    pub(crate) fn spoil(&mut self) {
        if let Some(t) = self.forest.tokens.last_mut() {
            *t = u32::MAX / 2;
        }
    }

    /// Rows of the pending level's pass (0 when the tree is complete).
    pub fn pass_rows(&self) -> usize {
        self.pending
            .as_ref()
            .map_or(0, |r| self.forest.len() - r.first)
    }
}

/// Drafts token trees with a small model.
pub struct DraftEngine {
    model: Arc<Transformer>,
    eos: Vec<u32>,
    max_context: usize,
    /// The capacities sessions' caches start at and grow through.
    classes: CacheClasses,
    synthetic: Option<SyntheticOracle>,
    static_chains: bool,
    /// The graphs of chains grown for several sessions together.
    pub(crate) chains: std::sync::Mutex<SessionChainsStepper>,
    /// Ended sessions' caches and graphs, for the next sessions.
    spares: Arc<Spares<SessionBody<DecodeStepper>>>,
}

impl SessionEngine for DraftEngine {
    type Session = DraftSession;
    const WORKER_TYPE: &'static str = "draft";

    fn session_bytes(&self) -> usize {
        session_cache_bytes(&self.model, self.classes.first)
    }

    fn new_charged_session(
        &self,
        seed: u64,
        charge: KvCharge,
    ) -> Result<DraftSession, EngineError> {
        EngineSession::open(&self.spares, seed, charge, || {
            self.classes.new_cache(&self.model)
        })
    }
}

impl DraftEngine {
    /// An engine over `model`; `eos` ends a branch; sessions hold up to `max_context` tokens,
    /// in caches that start at [`crate::engine_session::DEFAULT_FIRST_CAPACITY`] entries and
    /// grow with use.
    pub fn new(model: Arc<Transformer>, eos: Vec<u32>, max_context: usize) -> Self {
        let static_chains = model.graph_capturable();
        let first = crate::engine_session::DEFAULT_FIRST_CAPACITY;
        Self {
            model,
            eos,
            max_context,
            classes: CacheClasses::new(first, max_context),
            synthetic: None,
            static_chains,
            chains: Default::default(),
            spares: Arc::new(Spares::new(crate::spare::DEFAULT_SPARE_SESSIONS)),
        }
    }

    /// Keeps at most `n` ended sessions' caches and captured graphs for new sessions (see
    /// [`crate::spare`]; the default is [`crate::spare::DEFAULT_SPARE_SESSIONS`]).
    pub fn with_spare_sessions(mut self, n: usize) -> Self {
        self.spares = Arc::new(Spares::new(n));
        self
    }

    /// Ended sessions' bodies kept now for new sessions.
    pub fn spare_sessions(&self) -> usize {
        self.spares.len()
    }

    /// New sessions' caches start at `entries` entries (at most `max_context`) and double
    /// from there as requests need.
    pub fn with_first_capacity(mut self, entries: usize) -> Self {
        self.classes = CacheClasses::new(entries, self.max_context);
        self
    }

    /// Whether greedy chains are drafted with fixed-shape steps ([`DecodeStepper`]: one CUDA
    /// graph launch per token and a single device→host copy per chain). On by default for
    /// dense models on CUDA; settable so the CPU tests can exercise the same path.
    pub fn with_static_chains(mut self, on: bool) -> Self {
        self.static_chains = on;
        self
    }

    /// Whether greedy chains are drafted with fixed-shape steps replayed from CUDA graphs
    /// (see [`DraftEngine::with_static_chains`]).
    pub fn static_chains(&self) -> bool {
        self.static_chains
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

    /// How the model launches its fused kernels, where it runs them (`None`: candle's ops).
    pub(crate) fn fused_launch(&self) -> Option<specsplit_models::fused::Launch> {
        let k = self.model.kernel_options();
        k.fused.then(|| k.launch())
    }

    /// Tokens a session holds at most.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// The tokens that end a branch.
    pub fn eos(&self) -> &[u32] {
        &self.eos
    }

    /// Drafts a tree continuing `tokens` (the whole sequence so far). The cache is first brought
    /// to `tokens` reusing the longest common prefix (rollback of a rejected tail is O(1)); the
    /// tree's own entries are dropped again afterwards.
    ///
    /// It runs the phases a [`crate::draft_batcher::DraftBatcher`] runs with other sessions'
    /// rounds, alone: [`DraftEngine::prepare`], then [`DraftEngine::level_pass`] and
    /// [`DraftEngine::take_level`] until the tree is complete, then [`DraftEngine::finish`].
    pub fn draft(
        &self,
        s: &mut DraftSession,
        tokens: &[u32],
        p: &DraftParams,
    ) -> Result<(TokenTree, DraftStats), EngineError> {
        let mut round = match self.prepare(s, tokens, p.clone())? {
            Prepared::Chain(round) => return self.chain_alone(s, round),
            Prepared::Levels(round) => round,
        };
        while round.pending.is_some() {
            let t0 = Instant::now();
            let stepped = self
                .level_pass(s, &round)
                .and_then(|logits| self.take_level(s, &mut round, logits, t0.elapsed()));
            if let Err(e) = stepped {
                self.abandon(s, &round);
                return Err(e);
            }
        }
        Ok(self.finish(s, round))
    }

    /// The first phase of a draft, for one session alone: the request's checks, the cache
    /// brought to `tokens` (a new prompt's causal prefill, or the accepted tokens) and the
    /// tree's first level picked. A greedy chain on the fixed-shape path
    /// ([`DraftEngine::with_static_chains`]) is only started here ([`crate::draft_chain`]).
    pub fn prepare(
        &self,
        s: &mut DraftSession,
        tokens: &[u32],
        params: DraftParams,
    ) -> Result<Prepared, EngineError> {
        if tokens.is_empty() {
            return Err(EngineError::InvalidArgument(
                "the draft request holds no tokens: send the prompt (and accepted tokens)".into(),
            ));
        }
        let p = &params;
        if p.widths.is_empty() || p.widths.contains(&0) {
            return Err(EngineError::InvalidArgument(format!(
                "tree widths must be a non-empty list of positive numbers, got {:?}",
                p.widths
            )));
        }
        let tree_nodes = full_tree_size(&p.widths);
        if tokens.len() + tree_nodes > self.max_context {
            return Err(EngineError::InvalidArgument(format!(
                "sequence of {} tokens plus a {}-node tree exceeds the draft context of {} tokens",
                tokens.len(),
                tree_nodes,
                self.max_context
            )));
        }
        before_deadline(p.deadline, "drafting began")?;
        specsplit_core::device::bind_to_thread(self.model.device())?;
        // Room for the sequence and the whole tree before anything is written.
        s.reserve(tokens.len() + tree_nodes)?;
        let mut stats = DraftStats::default();
        if self.drafts_static_chain(p) {
            let round = self.start_chain(s, tokens, p.widths.len(), stats)?;
            return Ok(Prepared::Chain(round));
        }
        let replayed = self.drafts_rooted_chains(p);
        let root_logits = self.sync_prefix(s, tokens, p.deadline, replayed, &mut stats)?;
        let prefix_len = s.tokens.len();
        let mut trees = vec![TokenTree::new()];
        trees[0].set_siblings_without_replacement(true);
        let mut round = DraftRound {
            params,
            forest: Forest::new(prefix_len),
            trees,
            frontier: vec![Grow {
                node: None,
                tree: 0,
                at: None,
            }],
            logits: root_logits.unsqueeze(0)?,
            level: 0,
            pending: None,
            stats,
        };
        if let Err(e) = self
            .pick(s, &mut round)
            .and_then(|()| self.grow_rooted_chains(s, tokens, &mut round))
        {
            self.abandon(s, &round);
            return Err(e);
        }
        Ok(Prepared::Levels(round))
    }

    /// A greedy tree of several roots with a chain below each (widths `[w, 1, …, 1]`, `w` ≥ 2)
    /// on the fixed-shape path, its roots picked: grows every root's chain in one graph
    /// replay ([`specsplit_models::step::DecodeStepper::grow_chains`], as a pre-draft grows
    /// its branches) instead of a level pass a level, and completes the round. Other rounds,
    /// and shapes the model does not replay, are left to their level passes.
    fn grow_rooted_chains(
        &self,
        s: &mut DraftSession,
        tokens: &[u32],
        round: &mut DraftRound,
    ) -> Result<(), EngineError> {
        let depth = round.params.widths.len() - 1;
        let n = round.frontier.len();
        if !self.drafts_rooted_chains(&round.params)
            || round.pending.is_none()
            || !self.chains_replayable(s, tokens.len(), n, depth)
        {
            return Ok(());
        }
        let t0 = Instant::now();
        let outcomes: Vec<(usize, u32, usize)> = round
            .frontier
            .iter()
            .enumerate()
            .map(|(i, g)| (0, round.forest.tokens[g.node.expect("a root")], i))
            .collect();
        let mut chains = vec![TokenTree::new(); n];
        self.grow_chains_replayed(s, tokens, tokens.len(), &outcomes, &mut chains, depth)?;
        // Nothing keeps these rows: the cache holds the request's tokens again.
        s.grown = None;
        s.cache.truncate(tokens.len())?;
        round.stats.model_time += t0.elapsed();
        round.stats.tokens_processed += n * depth;
        // Level by level, so that the tree stays breadth-first.
        let tree = &mut round.trees[0];
        let mut parents: Vec<Option<usize>> = round.frontier.iter().map(|g| g.at).collect();
        for level in 0..depth {
            for (chain, parent) in chains.iter().zip(parents.iter_mut()) {
                let (Some(p), true) = (*parent, level < chain.len()) else {
                    *parent = None;
                    continue;
                };
                let node = tree
                    .push_child(p, chain.token(level), chain.log_prob(level))
                    .map_err(|e| EngineError::InvalidArgument(format!("draft tree: {e}")))?;
                *parent = Some(node);
            }
        }
        round.pending = None;
        round.frontier.clear();
        Ok(())
    }

    /// Whether a draft with `p` is a greedy tree of several roots with a chain below each
    /// (widths `[w, 1, …, 1]`, `w` ≥ 2) on the fixed-shape path: its chains grow in one replay
    /// ([`DraftEngine::prepare`]) where the model replays them.
    fn drafts_rooted_chains(&self, p: &DraftParams) -> bool {
        let w = &p.widths;
        self.static_chains
            && p.sampling.is_greedy()
            && w.len() >= 2
            && w[0] >= 2
            && w[1..].iter().all(|&x| x == 1)
    }

    /// Whether a draft with `p` goes through the fixed-shape chain path, drafted whole by
    /// [`DraftEngine::prepare`].
    fn drafts_static_chain(&self, p: &DraftParams) -> bool {
        self.static_chains && p.sampling.is_greedy() && p.widths.iter().all(|&w| w == 1)
    }

    /// Picks the children of the round's frontier at its current level; when the tree goes
    /// on, the level's nodes wait for their pass in `round.pending`.
    fn pick(&self, s: &mut DraftSession, round: &mut DraftRound) -> Result<(), EngineError> {
        let first = round.forest.len();
        let width = round.params.widths[round.level];
        let next = self.pick_level(
            s,
            &mut round.forest,
            &mut round.trees,
            &round.frontier,
            &round.logits,
            width,
            &round.params,
            &mut round.stats,
        )?;
        round.pending = None;
        if round.level + 1 == round.params.widths.len() || next.is_empty() {
            round.frontier.clear();
            return Ok(());
        }
        round.pending = Some(LevelRows {
            first,
            want: want_rows(&next, first),
        });
        round.frontier = next;
        Ok(())
    }

    /// The pass of the round's pending level, for one session alone: its logits rows, one per
    /// frontier node.
    pub fn level_pass(
        &self,
        s: &mut DraftSession,
        round: &DraftRound,
    ) -> Result<Tensor, EngineError> {
        let rows = round.pending.as_ref().ok_or_else(|| {
            EngineError::InvalidArgument("the draft round has no level waiting for a pass".into())
        })?;
        // A failed multi-session pass may have left its rows in the cache.
        s.cache.truncate(round.forest.prefix + rows.first)?;
        let dev = self.model.device().clone();
        self.forward_forest(s, &round.forest, rows.first, &rows.want, &dev)
    }

    /// The pending levels of several sessions' rounds in one model call
    /// ([`Transformer::forward_sessions`]): each member's logits rows, bit for bit what
    /// [`DraftEngine::level_pass`] of that member alone gives, and the same K/V in its cache.
    pub fn level_pass_sessions(
        &self,
        members: &mut [(&mut DraftSession, &DraftRound)],
    ) -> Result<Vec<Tensor>, EngineError> {
        specsplit_core::device::bind_to_thread(self.model.device())?;
        // What each member runs: its level's nodes, their positions and the forest's mask.
        let mut shapes = Vec::with_capacity(members.len());
        for (i, (s, round)) in members.iter_mut().enumerate() {
            let rows = round.pending.as_ref().ok_or_else(|| {
                EngineError::InvalidArgument(format!(
                    "draft round {i} has no level waiting for a pass"
                ))
            })?;
            let forest = &round.forest;
            s.cache.truncate(forest.prefix + rows.first)?;
            let positions: Vec<u32> = (rows.first..forest.len())
                .map(|n| (forest.prefix + forest.depth(n)) as u32)
                .collect();
            let mask = TreeMask::from_parents(&forest.parents)
                .expect("a forest node's parent is added before it");
            shapes.push((positions, mask));
        }
        let mut parts: Vec<SessionPass<'_>> = members
            .iter_mut()
            .zip(&shapes)
            .map(|((s, round), (positions, mask))| {
                let rows = round.pending.as_ref().expect("checked above");
                SessionPass {
                    tokens: &round.forest.tokens[rows.first..],
                    positions,
                    tree: TreeRows {
                        mask,
                        prefix: round.forest.prefix,
                        first_row: rows.first,
                    },
                    cache: &mut s.cache,
                    rows: &rows.want,
                }
            })
            .collect();
        Ok(self.model.forward_sessions(&mut parts)?)
    }

    /// Takes the logits of the round's pending level (from a pass that took `elapsed`) and
    /// picks the next level's children.
    pub fn take_level(
        &self,
        s: &mut DraftSession,
        round: &mut DraftRound,
        logits: Tensor,
        elapsed: Duration,
    ) -> Result<(), EngineError> {
        let rows = round.pending.take().ok_or_else(|| {
            EngineError::InvalidArgument("the draft round has no level waiting for a pass".into())
        })?;
        round.stats.model_time += elapsed;
        round.stats.tokens_processed += round.forest.len() - rows.first;
        round.logits = logits;
        round.level += 1;
        self.pick(s, round)
    }

    /// The last phase: drops the tree's entries from the cache (it holds exactly the
    /// request's tokens again) and returns the tree and what drafting it cost.
    pub fn finish(&self, s: &mut DraftSession, mut round: DraftRound) -> (TokenTree, DraftStats) {
        self.abandon(s, &round);
        (
            round.trees.pop().expect("a round grows one tree"),
            round.stats,
        )
    }

    /// Gives up a round that will not go on: the cache holds exactly the request's tokens
    /// again.
    pub fn abandon(&self, s: &mut DraftSession, round: &DraftRound) {
        // Within the cache's length: the round only appended after its prefix.
        if s.cache.len() > round.forest.prefix {
            let _ = s.cache.truncate(round.forest.prefix);
        }
    }

    /// Brings the cache to `tokens`; returns the logits after the last token, shape (vocab,).
    /// On a CPU the uncached tokens go through in chunks of [`CPU_CATCH_UP_CHUNK`], and a
    /// `deadline` that passes between two stops the catch-up there: the session keeps the
    /// chunks already cached (its tokens and cache agree) for the next request. With
    /// `replayed`, uncached tokens that fit the model's exact rows passes go through in one
    /// pass replayed from a graph per row count (a tree of rooted chains catches up so).
    fn sync_prefix(
        &self,
        s: &mut DraftSession,
        tokens: &[u32],
        deadline: Option<Instant>,
        replayed: bool,
        stats: &mut DraftStats,
    ) -> Result<Tensor, EngineError> {
        let lcp = common_prefix(&s.tokens, tokens);
        if lcp == tokens.len() && lcp == s.tokens.len() && s.cache.len() == lcp {
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
        let dev = self.model.device();
        let new = &tokens[keep..];
        if replayed && self.model.exact_rows_fit(s.cache.capacity(), new.len()) {
            before_deadline(deadline, "the draft caught up with the sequence")?;
            let t0 = Instant::now();
            let logits = self.causal_rows(s, new, keep, new.len() - 1)?.squeeze(0)?;
            stats.model_time += t0.elapsed();
            stats.tokens_processed += new.len();
            s.tokens.extend_from_slice(new);
            s.last_logits = Some(logits.clone());
            return Ok(logits);
        }
        let chunk = if dev.is_cpu() {
            CPU_CATCH_UP_CHUNK
        } else {
            new.len()
        };
        let mut logits = None;
        for part in new.chunks(chunk) {
            before_deadline(deadline, "the draft caught up with the sequence")?;
            let t0 = Instant::now();
            let at = s.tokens.len();
            let ids = Tensor::new(part, dev)?;
            let pos: Vec<u32> = (at as u32..(at + part.len()) as u32).collect();
            let pos = Tensor::new(pos.as_slice(), dev)?;
            let rows = Tensor::new(&[(part.len() - 1) as u32], dev)?;
            let out = self.model.forward(&ids, &pos, None, &mut s.cache, &rows)?;
            logits = Some(out.squeeze(0)?);
            stats.model_time += t0.elapsed();
            stats.tokens_processed += part.len();
            s.tokens.extend_from_slice(part);
        }
        let logits = logits.expect("at least one uncached token");
        s.last_logits = Some(logits.clone());
        Ok(logits)
    }

    /// Grows `trees` level by level by `p.widths` from the nodes of `frontier`, whose logits
    /// rows are `logits` (rows, vocab): each level picks every frontier node's children, adds
    /// them to its tree and to `forest`, and forwards the level's nodes (all of them, so the
    /// cache mirrors the forest's order) in one pass over the session's cache, which holds the
    /// forest's nodes after its prefix. Nodes holding an end-of-sequence token are not expanded.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn grow(
        &self,
        s: &mut DraftSession,
        forest: &mut Forest,
        trees: &mut [TokenTree],
        mut frontier: Vec<Grow>,
        mut logits: Tensor,
        p: &DraftParams,
        stats: &mut DraftStats,
    ) -> Result<(), EngineError> {
        let dev = self.model.device().clone();
        for (depth, &width) in p.widths.iter().enumerate() {
            let level_start = forest.len();
            let next = self.pick_level(s, forest, trees, &frontier, &logits, width, p, stats)?;
            if depth + 1 == p.widths.len() || next.is_empty() {
                break;
            }
            let t0 = Instant::now();
            let want = want_rows(&next, level_start);
            logits = self.forward_forest(s, forest, level_start, &want, &dev)?;
            stats.model_time += t0.elapsed();
            stats.tokens_processed += forest.len() - level_start;
            frontier = next;
        }
        Ok(())
    }

    /// Picks `width` children of every node of `frontier` from its row of `logits`, adds them
    /// to its tree and to `forest`; returns the new nodes that grow on (not an end of
    /// sequence).
    #[allow(clippy::too_many_arguments)]
    fn pick_level(
        &self,
        s: &mut DraftSession,
        forest: &mut Forest,
        trees: &mut [TokenTree],
        frontier: &[Grow],
        logits: &Tensor,
        width: usize,
        p: &DraftParams,
        stats: &mut DraftStats,
    ) -> Result<Vec<Grow>, EngineError> {
        let greedy = p.sampling.is_greedy();
        let vocab = self.model.config().vocab_size as u32;
        let bad = |e: specsplit_core::tree::TreeError| {
            EngineError::InvalidArgument(format!("draft tree: {e}"))
        };
        let t0 = Instant::now();
        let picks = self.choose(logits, width, greedy, &p.sampling, &mut s.rng)?;
        stats.model_time += t0.elapsed();
        let mut next = Vec::new();
        for (g, (mut children, dist)) in frontier.iter().zip(picks) {
            if let Some(o) = &self.synthetic {
                let mut ctx = s.tokens[..forest.prefix].to_vec();
                ctx.extend(forest.path_tokens(g.node));
                if let (Some(right), Some(&(old, _))) = (o.next(&ctx), children.first()) {
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
                    if new != right && children.len() > 1 {
                        place_alternative(&mut children, right, o, vocab, &mut s.rng);
                    }
                }
            }
            let tree = &mut trees[g.tree];
            for (tok, lp) in children {
                let at = match g.at {
                    None => tree.push_root(tok, lp),
                    Some(par) => tree.push_child(par, tok, lp),
                }
                .map_err(bad)?;
                let node = forest.push(g.node, tok);
                if !self.eos.contains(&tok) {
                    next.push(Grow {
                        node: Some(node),
                        tree: g.tree,
                        at: Some(at),
                    });
                }
            }
            if let Some(d) = dist {
                match g.at {
                    None => tree.set_root_distribution(d),
                    Some(par) => tree.set_child_distribution(par, d).map_err(bad)?,
                }
            }
        }
        Ok(next)
    }

    /// Forwards the forest's nodes `first..` in one pass over the session's cache (which holds
    /// the nodes before `first`) and returns the logits of the rows `want` (relative to `first`).
    pub(crate) fn forward_forest(
        &self,
        s: &mut DraftSession,
        forest: &Forest,
        first: usize,
        want: &[u32],
        dev: &candle_core::Device,
    ) -> Result<Tensor, EngineError> {
        let ids = Tensor::new(&forest.tokens[first..], dev)?;
        let positions: Vec<u32> = (first..forest.len())
            .map(|i| (forest.prefix + forest.depth(i)) as u32)
            .collect();
        let pos = Tensor::new(positions.as_slice(), dev)?;
        let want = Tensor::new(want, dev)?;
        self.forward_forest_on_device(s, forest, first, &ids, &pos, &want)
    }

    /// [`DraftEngine::forward_forest`] with the nodes' tokens `ids`, their positions `pos` and
    /// the rows `want` already on the device (the forest's own tokens for these nodes need not
    /// be known on the host).
    pub(crate) fn forward_forest_on_device(
        &self,
        s: &mut DraftSession,
        forest: &Forest,
        first: usize,
        ids: &Tensor,
        pos: &Tensor,
        want: &Tensor,
    ) -> Result<Tensor, EngineError> {
        let mask = TreeMask::from_parents(&forest.parents)
            .expect("a forest node's parent is added before it");
        let rows = TreeRows {
            mask: &mask,
            prefix: forest.prefix,
            first_row: first,
        };
        Ok(self
            .model
            .forward_tree(ids, pos, rows, &mut s.cache, want)?)
    }

    /// Picks `width` children for each row of `logits` (rows, vocab): the top-w tokens when
    /// greedy (found on the device; only the ids and log-probabilities are copied back), else
    /// distinct draws from each row's warped distribution (returned, so the verifier can use it).
    #[allow(clippy::type_complexity)]
    fn choose(
        &self,
        logits: &Tensor,
        width: usize,
        greedy: bool,
        params: &SamplingParams,
        rng: &mut ChaCha8Rng,
    ) -> Result<Vec<(Vec<(u32, f32)>, Option<Distribution>)>, EngineError> {
        if greedy {
            return Ok(top_w_on_device(logits, width, self.fused_launch())?
                .into_iter()
                .map(|c| (c, None))
                .collect());
        }
        let rows: Vec<Vec<f32>> = logits.to_dtype(DType::F32)?.to_vec2()?;
        Ok(rows
            .iter()
            .map(|row| {
                let dist = sampling::proposal(row, params);
                let toks = sampling::sample_without_replacement(&dist, width, rng);
                let out = toks
                    .into_iter()
                    .map(|t| (t, dist.prob(t).max(f32::MIN_POSITIVE).ln()))
                    .collect();
                (out, Some(dist))
            })
            .collect())
    }
}

/// The `width` largest logits of each row of `logits` (rows, vocab), best first, with their
/// log-probabilities under the row's softmax. Runs on the logits' device (`width` rounds of
/// argmax, gather and masking; with `fused`, the launch of a model that runs the fused kernels,
/// on CUDA [`specsplit_models::fused::top_rows`]) and copies back only `rows × width` ids and
/// values, in one transfer. Siblings are always distinct; a row with fewer than `width` finite logits yields
/// fewer.
pub fn top_w_on_device(
    logits: &Tensor,
    width: usize,
    fused: Option<specsplit_models::fused::Launch>,
) -> candle_core::Result<Vec<Vec<(u32, f32)>>> {
    let (rows, vocab) = logits.dims2()?;
    let width = width.min(vocab);
    if rows == 0 || width == 0 {
        return Ok(vec![Vec::new(); rows]);
    }
    if let Some(launch) = fused.filter(|_| logits.device().is_cuda()) {
        // One blocked argmax over all rows a round (candle's reductions take a block a row).
        let packed: Vec<Vec<f32>> =
            specsplit_models::fused::top_rows(logits, width, launch)?.to_vec2()?;
        return Ok(packed
            .into_iter()
            .map(|r| {
                let lse = r[2 * width];
                (0..width)
                    .filter(|&j| r[width + j].is_finite() && r[j] >= 0.0)
                    .map(|j| (r[j] as u32, r[width + j] - lse))
                    .collect()
            })
            .collect());
    }
    // A private copy when the masking below will write into it.
    let x = logits.to_dtype(DType::F32)?;
    let x = if width > 1 { x.copy()? } else { x };
    let lse = x.log_sum_exp(1)?.unsqueeze(1)?;
    let hidden = Tensor::full(f32::NEG_INFINITY, (rows, 1), x.device())?;
    let mut ids = Vec::with_capacity(width);
    let mut vals = Vec::with_capacity(width);
    for j in 0..width {
        let idx = x.argmax_keepdim(1)?;
        vals.push(x.gather(&idx, 1)?);
        if j + 1 < width {
            x.scatter_set(&idx, &hidden, 1)?;
        }
        ids.push(idx);
    }
    // Token ids are below 2^24, so f32 carries them exactly: one copy for ids and values.
    let ids = Tensor::cat(&ids, 1)?.to_dtype(DType::F32)?;
    let lps = Tensor::cat(&vals, 1)?.broadcast_sub(&lse)?;
    let packed: Vec<Vec<f32>> = Tensor::cat(&[&ids, &lps], 1)?.to_vec2()?;
    Ok(packed
        .into_iter()
        .map(|r| {
            let mut out: Vec<(u32, f32)> = Vec::with_capacity(width);
            for j in 0..width {
                let (tok, lp) = (r[j] as u32, r[width + j]);
                // Once only -inf logits remain, argmax may return a token already taken.
                if lp.is_finite() && out.iter().all(|&(t, _)| t != tok) {
                    out.push((tok, lp));
                }
            }
            out
        })
        .collect())
}

/// Whether `slot` holds a stepper over a cache of `capacity` entries, which
/// [`stepper_over`] keeps; otherwise it makes a new one.
pub(crate) fn has_stepper_over(slot: &Option<DecodeStepper>, capacity: usize) -> bool {
    slot.as_ref().is_some_and(|st| st.capacity() == capacity)
}

/// The session's fixed-shape stepper over its cache of `capacity` entries, made at its first
/// use and again after the cache grew (a stepper for another capacity holds graphs over
/// buffers the cache no longer has: it is dropped, never replayed).
pub(crate) fn stepper_over<'s>(
    slot: &'s mut Option<DecodeStepper>,
    model: &Transformer,
    capacity: usize,
) -> Result<&'s mut DecodeStepper, EngineError> {
    if !has_stepper_over(slot, capacity) {
        *slot = None;
    }
    Ok(match slot {
        Some(st) => st,
        none => none.insert(DecodeStepper::new(model, capacity)?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_w_on_device_matches_host_top_w_and_log_softmax() {
        use rand::{Rng, SeedableRng};
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let (rows, vocab) = (5, 3000);
        let data: Vec<f32> = (0..rows * vocab)
            .map(|_| rng.random_range(-12.0f32..12.0))
            .collect();
        let t = Tensor::from_vec(data.clone(), (rows, vocab), &candle_core::Device::Cpu).unwrap();
        for width in [1, 2, 4, 7] {
            let got = top_w_on_device(&t, width, None).unwrap();
            assert_eq!(got.len(), rows);
            for (r, picks) in got.iter().enumerate() {
                let row = &data[r * vocab..(r + 1) * vocab];
                let want = sampling::top_w(row, width);
                let ids: Vec<u32> = picks.iter().map(|p| p.0).collect();
                assert_eq!(ids, want, "row {r}, width {width}");
                let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let lse = m + row.iter().map(|&v| (v as f64 - m).exp()).sum::<f64>().ln();
                for &(tok, lp) in picks {
                    let exact = row[tok as usize] as f64 - lse;
                    assert!((lp as f64 - exact).abs() < 1e-4, "{lp} vs {exact}");
                }
            }
        }
        // The input is not modified by the masking.
        assert_eq!(t.flatten_all().unwrap().to_vec1::<f32>().unwrap(), data);
    }

    #[test]
    fn top_w_on_device_never_repeats_a_token() {
        let row = [0.0f32, f32::NEG_INFINITY, f32::NEG_INFINITY, 1.0];
        let t = Tensor::new(&row, &candle_core::Device::Cpu)
            .unwrap()
            .unsqueeze(0)
            .unwrap();
        let got = top_w_on_device(&t, 4, None).unwrap();
        let ids: Vec<u32> = got[0].iter().map(|p| p.0).collect();
        assert_eq!(ids, vec![3, 0]);
        assert_eq!(top_w_on_device(&t, 0, None).unwrap(), vec![Vec::new()]);
    }

    fn tiny_engine(eos: Vec<u32>, static_chains: bool) -> DraftEngine {
        DraftEngine::new(crate::test_models::tiny_model(7), eos, 128)
            .with_static_chains(static_chains)
    }

    fn chain(e: &DraftEngine, s: &mut DraftSession, seq: &[u32], depth: usize) -> TokenTree {
        let p = DraftParams {
            widths: vec![1; depth],
            sampling: SamplingParams::default(),
            deadline: None,
        };
        e.draft(s, seq, &p).unwrap().0
    }

    #[test]
    fn a_recycled_session_drafts_exactly_like_a_fresh_one() {
        // Chains (the fixed-shape stepper, kept with the cache) and trees, greedy and sampled.
        let kept = tiny_engine(vec![], true).with_spare_sessions(1);
        let fresh = tiny_engine(vec![], true).with_spare_sessions(0);
        let run = |e: &DraftEngine, s: &mut DraftSession| -> Vec<(Vec<u32>, Vec<f32>)> {
            let mut seq: Vec<u32> = vec![9, 120, 33, 7];
            let mut out = Vec::new();
            for round in 0..5 {
                let p = DraftParams {
                    widths: if round % 2 == 0 {
                        vec![1; 3]
                    } else {
                        vec![2, 1]
                    },
                    sampling: if round == 3 {
                        SamplingParams {
                            temperature: 0.8,
                            ..SamplingParams::default()
                        }
                    } else {
                        SamplingParams::default()
                    },
                    deadline: None,
                };
                let t = e.draft(s, &seq, &p).unwrap().0;
                out.push((
                    t.tokens().to_vec(),
                    (0..t.len()).map(|i| t.log_prob(i)).collect(),
                ));
                seq.extend_from_slice(&t.tokens()[..1]);
                seq.push(40 + round);
            }
            out
        };
        // A first session leaves a full cache and a captured stepper behind.
        let mut first = kept.new_session(3).unwrap();
        let mut other: Vec<u32> = (0..60).map(|i| (i * 13 + 1) % 500).collect();
        for _ in 0..3 {
            let t = chain(&kept, &mut first, &other, 4);
            other.extend_from_slice(t.tokens());
        }
        assert_eq!(kept.spare_sessions(), 0);
        drop(first);
        assert_eq!(
            kept.spare_sessions(),
            1,
            "the ended session's body was kept"
        );
        let mut again = kept.new_session(5).unwrap();
        assert_eq!(kept.spare_sessions(), 0, "the new session took it");
        assert!(again.tokens().is_empty());
        let a = run(&kept, &mut again);
        let b = run(&fresh, &mut fresh.new_session(5).unwrap());
        assert_eq!(a, b, "the recycled session drafted differently");
        drop(again);
        let _ = fresh.new_session(1).unwrap();
        assert_eq!(
            fresh.spare_sessions(),
            0,
            "an engine with no spares keeps none"
        );
    }

    /// A drafted tree's tokens, parents and log-probabilities (as bits).
    type Drafted = (Vec<u32>, Vec<Option<usize>>, Vec<u32>);

    #[test]
    fn a_session_whose_cache_grew_drafts_exactly_like_a_full_size_one() {
        for static_chains in [false, true] {
            let grown = tiny_engine(vec![], static_chains).with_first_capacity(4);
            let full = tiny_engine(vec![], static_chains).with_first_capacity(128);
            let trees = |e: &DraftEngine| {
                let mut s = e.new_session(3).unwrap();
                let mut seq: Vec<u32> = (0..10).map(|i| (i * 41 + 7) % 500).collect();
                let mut out: Vec<Drafted> = Vec::new();
                let mut caps = vec![s.cache_capacity()];
                for round in 0..12u32 {
                    // Chains, and every third round a tree of 2 x 2 x 1.
                    let widths = if round % 3 == 2 {
                        vec![2, 2, 1]
                    } else {
                        vec![1; 4]
                    };
                    let p = DraftParams {
                        widths,
                        sampling: SamplingParams::default(),
                        deadline: None,
                    };
                    let (t, _) = e.draft(&mut s, &seq, &p).unwrap();
                    let lps: Vec<u32> = (0..t.len()).map(|i| t.log_prob(i).to_bits()).collect();
                    out.push((t.tokens().to_vec(), t.parents().to_vec(), lps));
                    seq.extend(t.tokens().iter().take(2));
                    seq.push((round * 53 + 1) % 500);
                    caps.push(s.cache_capacity());
                }
                caps.dedup();
                (out, caps)
            };
            let (a, caps) = trees(&grown);
            let (b, _) = trees(&full);
            assert_eq!(caps, [4, 16, 32, 64], "static chains {static_chains}");
            if static_chains {
                // The eager fixed-shape step (candle's ops, off the fused bf16 kernels) sums
                // its attention over the whole capacity, so its rounding follows the capacity:
                // the same tokens, log-probabilities a few ulps apart.
                let tokens =
                    |t: &[Drafted]| -> Vec<Vec<u32>> { t.iter().map(|d| d.0.clone()).collect() };
                assert_eq!(
                    tokens(&a),
                    tokens(&b),
                    "static chains: the grown session drafted differently"
                );
            } else {
                assert_eq!(a, b, "the grown session drafted differently");
            }
        }
    }

    #[test]
    fn static_chains_equal_level_by_level_chains() {
        let eager = tiny_engine(vec![], false);
        let fixed = tiny_engine(vec![], true);
        let (mut se, mut sf) = (eager.new_session(1).unwrap(), fixed.new_session(1).unwrap());
        let mut seq: Vec<u32> = vec![11, 250, 3, 77, 400];
        let mut eos_seen = None;
        for round in 0..6 {
            // Depth 1 included: the orchestrator cuts chains that short near max-tokens.
            let depth = 1 + round % 6;
            let a = chain(&eager, &mut se, &seq, depth);
            let b = chain(&fixed, &mut sf, &seq, depth);
            assert_eq!(a.tokens(), b.tokens(), "round {round}");
            assert_eq!(a.parents(), b.parents());
            for i in 0..a.len() {
                assert!((a.log_prob(i) - b.log_prob(i)).abs() < 1e-4);
            }
            eos_seen.get_or_insert(a.token(a.len() / 2));
            // Accept half the chain and a correction, like a verifier would.
            seq.extend_from_slice(&a.tokens()[..a.len() / 2]);
            seq.push((round as u32 * 31) % 500);
        }
        // Both cut a chain at an EOS token the same way.
        let stop = eos_seen.unwrap();
        let eager = tiny_engine(vec![stop], false);
        let fixed = tiny_engine(vec![stop], true);
        let probe = vec![11, 250, 3, 77, 400];
        let a = chain(&eager, &mut eager.new_session(1).unwrap(), &probe, 6);
        let b = chain(&fixed, &mut fixed.new_session(1).unwrap(), &probe, 6);
        assert_eq!(a.tokens(), b.tokens());
    }

    #[test]
    fn static_chains_follow_the_synthetic_proposer() {
        let seq: Vec<u32> = vec![4, 8, 15, 16];
        let reference: Vec<u32> = seq.iter().copied().chain([23, 42, 99, 100, 101]).collect();
        for beta in [1.0, 0.0, 0.5] {
            let oracle = SyntheticOracle::new(vec![reference.clone()], beta);
            let eager = tiny_engine(vec![], false).with_synthetic(oracle.clone());
            let fixed = tiny_engine(vec![], true).with_synthetic(oracle);
            for seed in 1..6 {
                let a = chain(&eager, &mut eager.new_session(seed).unwrap(), &seq, 4);
                let b = chain(&fixed, &mut fixed.new_session(seed).unwrap(), &seq, 4);
                assert_eq!(a.tokens(), b.tokens(), "beta {beta} seed {seed}");
                if beta == 1.0 {
                    assert_eq!(a.tokens(), &reference[4..8]);
                }
            }
        }
    }

    #[test]
    fn the_synthetic_proposers_alternatives_hold_the_targets_token_at_the_measured_ranks() {
        let seq: Vec<u32> = vec![4, 8, 15, 16];
        let right = 23;
        let reference: Vec<u32> = seq.iter().copied().chain([right, 42]).collect();
        let roots = DraftParams {
            widths: vec![3],
            sampling: SamplingParams::default(),
            deadline: None,
        };
        // First child always wrong: the second holds the target's token half the time, the
        // third a quarter of the time (coverage 0.5 and 0.75 for one and two alternatives).
        let oracle =
            SyntheticOracle::new(vec![reference.clone()], 0.0).with_coverage(vec![0.5, 0.75]);
        let e = tiny_engine(vec![], false).with_synthetic(oracle);
        let mut s = e.new_session(3).unwrap();
        let n = 800;
        let mut at = [0usize; 3];
        for _ in 0..n {
            let (t, _) = e.draft(&mut s, &seq, &roots).unwrap();
            assert_eq!(t.len(), 3);
            let mut distinct = t.tokens().to_vec();
            distinct.sort_unstable();
            distinct.dedup();
            assert_eq!(
                distinct.len(),
                3,
                "siblings stay distinct: {:?}",
                t.tokens()
            );
            for (i, &tok) in t.tokens().iter().enumerate() {
                at[i] += usize::from(tok == right);
            }
        }
        assert_eq!(at[0], 0, "the first child is wrong at beta 0");
        let rate = |k: usize| at[k] as f64 / n as f64;
        assert!(
            (rate(1) - 0.5).abs() < 0.06,
            "second child held it at {}",
            rate(1)
        );
        assert!(
            (rate(2) - 0.25).abs() < 0.05,
            "third child held it at {}",
            rate(2)
        );
        // A first child that is right leaves no alternative holding it.
        let oracle = SyntheticOracle::new(vec![reference], 1.0).with_coverage(vec![1.0]);
        let e = tiny_engine(vec![], false).with_synthetic(oracle);
        let mut s = e.new_session(3).unwrap();
        for _ in 0..50 {
            let (t, _) = e.draft(&mut s, &seq, &roots).unwrap();
            assert_eq!(t.token(0), right);
            assert!(!t.tokens()[1..].contains(&right));
        }
    }

    #[test]
    fn an_alternatives_rank_follows_the_coverage_steps() {
        let o = SyntheticOracle::new(vec![], 0.8).with_coverage(vec![0.5, 0.75, 0.75, 1.0]);
        assert_eq!(o.alternative_rank(0.0), Some(1));
        assert_eq!(o.alternative_rank(0.49), Some(1));
        assert_eq!(o.alternative_rank(0.5), Some(2));
        assert_eq!(o.alternative_rank(0.74), Some(2));
        assert_eq!(
            o.alternative_rank(0.75),
            Some(4),
            "a rank of no mass is skipped"
        );
        assert_eq!(o.alternative_rank(0.999), Some(4));
        let short = SyntheticOracle::new(vec![], 0.8).with_coverage(vec![0.3]);
        assert_eq!(
            short.alternative_rank(0.31),
            None,
            "past the list's last value: none"
        );
    }

    #[test]
    fn oracle_prefers_the_latest_reference_and_skips_known_ones() {
        let o = SyntheticOracle::new(vec![vec![1, 2, 3, 4]], 1.0);
        assert_eq!(o.next(&[1, 2]), Some(3));
        assert!(
            !o.add_reference(vec![1, 2, 3]),
            "a prefix of a reference is known"
        );
        assert!(o.add_reference(vec![1, 2, 9, 9]));
        let shared = o.clone();
        assert_eq!(shared.num_references(), 2);
        assert_eq!(shared.next(&[1, 2]), Some(9), "the latest reference wins");
        assert_eq!(shared.next(&[1, 2, 3]), Some(4));
        assert_eq!(shared.next(&[5]), None);
    }
}
