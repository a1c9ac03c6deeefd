//! One generation's round loop. Each round chooses the depth of its tree, takes the tree
//! pre-drafted beside the last verify or drafts one now, has the target verify it (beside the
//! pre-draft of the next round's tree), emits the accepted tokens and the target's own cut at a
//! stop, reconciles the pre-draft with what was accepted, and records its statistics.

mod draft;
mod verify;

use std::time::{Duration, Instant};

use specsplit_core::drafter::ngram::NgramDrafter;
use specsplit_core::drafter::suffix::{SuffixConfig, SuffixDrafter};
use specsplit_core::drafter::DraftShape;
use specsplit_core::tree::{TokenTree, TreeLimits};

use specsplit_core::tree::full_tree_size;

use super::tree::{first_child_path, fit_tree_widths, subtree};
use super::worker::{known, ServerTimes};
use super::{Orchestrator, OrchestratorError};
use crate::adaptive::{resize_widths, DepthController, DraftBackoff, SpeedGovernor};
use crate::online_choice::{OnlineChoice, PlayedRound};
use crate::stats::{GenerationStats, NoDraft, RoundRecord, SpeedSwitch};
use crate::{Drafter, DrafterChoice, GenerateConfig, Generation, Mode, Pipeline, StopReason};
use verify::{Verdict, Verified};

/// A draft tree and how long drafting it took.
struct Drafted {
    tree: TokenTree,
    /// Time the round waited for it.
    ms: f64,
    /// What the draft worker reported for the request: its times (0 for a pre-drafted tree)
    /// and whether drafting it included one-off setup (told to the target, whose load gate
    /// then does not price the round's depth by it).
    server: ServerTimes,
}

impl Drafted {
    /// No tree, after `ms` spent waiting for one.
    fn none(ms: f64) -> Self {
        Self {
            tree: TokenTree::new(),
            ms,
            server: ServerTimes::default(),
        }
    }
}

/// How a draft request of a round ended.
enum DraftOutcome {
    /// A tree.
    Tree(Box<Drafted>),
    /// The draft failed (recorded); the round goes on without a tree, after `ms` waiting.
    Failed(f64),
    /// The generation's deadline passed while waiting.
    Deadline,
}

/// The trees pre-drafted for the outcomes of one verification, and what they cost.
struct PreDrafts {
    /// (accepted length, the target's token after it, the next round's tree) per outcome.
    trees: Vec<(usize, u32, TokenTree)>,
    /// Wall time of the request.
    ms: f64,
    /// When it was sent.
    sent: Instant,
    /// What the draft worker reported for it.
    server: ServerTimes,
}

/// A pre-draft's task: `Err(())` when the draft deadline passed first.
type PreDraft = tokio::task::JoinHandle<Result<Result<PreDrafts, OrchestratorError>, ()>>;

/// A pre-draft running beside a verify call, for outcomes along the verified tree's
/// first-child path.
struct PreDraftInFlight {
    task: PreDraft,
    /// The nodes of the verified tree along that path.
    path: Vec<usize>,
    /// Candidates per outcome.
    candidates: usize,
    /// Levels of the pre-drafted trees.
    depth: usize,
    /// Whether it is one bet (an ordinary draft after the whole path), not an outcome set.
    bet: bool,
}

/// What a round's pre-draft cost it and what it held (all 0 / `None` without one).
#[derive(Default)]
struct PreDraftResult {
    /// Time the round waited for it after its verify call returned.
    wait_ms: f64,
    /// Wall time of its call as the orchestrator saw it.
    ms: f64,
    /// When its call started after the round's verify call started, in ms (negative: before).
    lag_ms: f64,
    /// Wall time the draft worker reported for it.
    server_ms: f64,
    /// Of that, the time it reported in its model.
    model_ms: f64,
    /// Candidates per outcome it drafted.
    candidates: usize,
    /// Whether it held the verdict's outcome (`None`: none ran or it failed).
    hit: Option<bool>,
}

/// One round as it goes through its steps.
struct Round {
    /// Its index in the generation.
    no: usize,
    /// When it started.
    start: Instant,
    /// Tokens the generation may still emit.
    remaining: usize,
    /// The widths of the tree asked for (empty: none).
    widths: Vec<usize>,
    /// Why the round verifies no tree, where it verifies none.
    no_draft: Option<NoDraft>,
    /// Whether this first round drafts beside the target's prefill.
    first: bool,
    /// The tree to verify (empty: none).
    drafted: Drafted,
    /// Whether a pre-drafted tree was used (`None`: no pre-draft was waiting).
    overlap_hit: Option<bool>,
    /// Whether a pre-draft ran beside its verify call.
    beside: bool,
    /// The drafter chosen for it.
    drafter: Drafter,
    /// The target's load advice in force for it.
    advised_depth: Option<usize>,
}

impl Round {
    /// Levels of the tree to verify (0 without one).
    fn depth(&self) -> usize {
        if self.drafted.tree.is_empty() {
            0
        } else {
            self.drafted.tree.max_depth() + 1
        }
    }
}

/// State of one generation.
pub(super) struct Run<'a> {
    o: &'a Orchestrator,
    session: &'a str,
    /// Sent with every request of the session (the workers refuse the session's requests
    /// without it).
    secret: &'a str,
    cfg: &'a GenerateConfig,
    /// When the generation started.
    start: Instant,
    /// Prompt + emitted tokens.
    seq: Vec<u32>,
    /// Emitted tokens.
    out: Vec<u32>,
    /// One record per round so far.
    rounds: Vec<RoundRecord>,
    /// Time to the first emitted token.
    ttft_ms: f64,
    /// The tree pre-drafted for the next round (empty after a miss).
    next_tree: Option<Drafted>,
    /// Cached length the target reported, and the tokens it has not cached yet.
    target_cached: Option<usize>,
    pending: Vec<u32>,
    depth: DepthController,
    widths: Vec<usize>,
    request_no: u64,
    /// The generation's deadline, if any.
    deadline: Option<Instant>,
    /// Rounds to wait before trying a failing draft again.
    backoff: DraftBackoff,
    /// Whether speculation pays, from measured round times.
    governor: SpeedGovernor,
    /// The draft is not asked again in this generation (the sequence outgrew its limits, or
    /// it refused a request as invalid).
    draft_off: bool,
    draft_failures: usize,
    switches: Vec<SpeedSwitch>,
    /// The depth the pre-draft pipeline's last shape chose for the next round.
    planned_depth: Option<usize>,
    /// The target's log-probability of each token of `out` (with `cfg.logprobs`).
    logprobs: Vec<f32>,
    /// The online choice of a drafter per round (with `DrafterChoice::Auto`).
    choice: Option<OnlineChoice>,
    /// The model-free drafters, run here on the sequence.
    ngram: NgramDrafter,
    suffix: SuffixDrafter,
    /// Whether the suffix drafter was used (its generation then goes to the shared store).
    suffix_used: bool,
    /// Tokens of the prompt.
    prompt_len: usize,
    /// The deepest draft the target advised, from its load, for the next round (`None`: no
    /// advice).
    advised_depth: Option<usize>,
}

/// The tree of model-free drafter `drafter` (of `drafters`: n-gram, suffix) in `widths` after
/// `seq`, and what drafting it took (ms); an empty tree for any other drafter.
fn draft_model_free(
    drafters: (&mut NgramDrafter, &mut SuffixDrafter),
    seq: &[u32],
    drafter: Drafter,
    widths: &[usize],
) -> (TokenTree, f64) {
    let t0 = Instant::now();
    let shape = DraftShape::of_widths(widths);
    let tree = match drafter {
        Drafter::Ngram => drafters.0.draft(seq, shape),
        Drafter::Suffix => drafters.1.draft(seq, shape),
        Drafter::Model | Drafter::None => TokenTree::new(),
    };
    (tree, ms_since(t0))
}

/// Milliseconds from `earlier` to `later` (negative where `later` is the earlier).
fn signed_ms(later: Instant, earlier: Instant) -> f64 {
    match later.checked_duration_since(earlier) {
        Some(d) => d.as_secs_f64() * 1e3,
        None => -(earlier.duration_since(later).as_secs_f64() * 1e3),
    }
}

/// Milliseconds since `t`.
fn ms_since(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e3
}

impl<'a> Run<'a> {
    /// A generation of `session` on `o`'s workers.
    pub(super) fn new(
        o: &'a Orchestrator,
        session: &'a str,
        secret: &'a str,
        cfg: &'a GenerateConfig,
    ) -> Self {
        Self {
            o,
            session,
            secret,
            cfg,
            start: Instant::now(),
            seq: Vec::new(),
            out: Vec::new(),
            rounds: Vec::new(),
            ttft_ms: 0.0,
            next_tree: None,
            target_cached: None,
            pending: Vec::new(),
            depth: DepthController::new(cfg.min_depth, cfg.max_depth),
            widths: cfg.widths.clone(),
            request_no: 0,
            deadline: None,
            backoff: DraftBackoff::new(cfg.draft_retry_rounds, cfg.draft_retry_max_rounds),
            governor: SpeedGovernor::new(cfg.spec_probe_rounds),
            draft_off: false,
            draft_failures: 0,
            switches: Vec::new(),
            planned_depth: None,
            logprobs: Vec::new(),
            choice: (cfg.drafter == DrafterChoice::Auto && cfg.mode == Mode::Spec).then(|| {
                let memory = o
                    .choice_memory
                    .lock()
                    .map(|m| m.clone())
                    .unwrap_or_default();
                OnlineChoice::new(o.lane.draft.is_some(), &memory)
            }),
            ngram: NgramDrafter::default(),
            suffix: SuffixDrafter::new(
                SuffixConfig::default(),
                cfg.suffix_history.then(|| o.suffix_store.clone()),
            ),
            suffix_used: false,
            prompt_len: 0,
            // Until the target answers this generation, its latest advice to any of them when
            // about as many ran.
            advised_depth: o.advice.for_first_round(),
        }
    }

    /// The drafter of the next round: the configured one, or the online choice's.
    fn choose_drafter(&self) -> Drafter {
        if self.cfg.mode == Mode::Ar {
            return Drafter::None;
        }
        match self.cfg.drafter {
            DrafterChoice::Model => Drafter::Model,
            DrafterChoice::Ngram => Drafter::Ngram,
            DrafterChoice::Suffix => Drafter::Suffix,
            DrafterChoice::Auto => self.choice.as_ref().map_or(Drafter::None, |c| c.choose()),
        }
    }

    /// Generates after `prompt`, round by round, calling `on_tokens` with each round's tokens
    /// and their log-probabilities (empty without `cfg.logprobs`).
    pub(super) async fn run(
        mut self,
        prompt: &[u32],
        mut on_tokens: impl FnMut(&[u32], &[f32]),
    ) -> Result<Generation, OrchestratorError> {
        self.start = Instant::now();
        self.deadline = (self.cfg.deadline_ms > 0)
            .then(|| self.start + Duration::from_millis(self.cfg.deadline_ms));
        self.seq = prompt.to_vec();
        self.prompt_len = prompt.len();
        let stop = loop {
            if let Some(stop) = self.stop_before_round() {
                break stop;
            }
            let mut round = self.choose_depth();
            if let Some(stop) = self.take_or_draft(&mut round).await {
                break stop;
            }
            self.fit_to_target(&mut round);
            let pre = self.predraft_beside_verify(&mut round);
            if pre.is_some() {
                // The pre-draft's request goes out first: it runs longer than the verify.
                tokio::task::yield_now().await;
            }
            let Some(verdict) = self.verify_beside(&round.drafted, pre.as_ref()).await? else {
                break StopReason::Deadline;
            };
            self.adapt_depth(&round, &verdict);
            self.advised_depth = verdict.verified.advised_depth;
            self.o.advice.hear(self.advised_depth);
            let (emitted, stop_now) = self.cut_at_stop(&verdict.verified);
            if self.out.is_empty() {
                self.ttft_ms = ms_since(self.start);
            }
            // The tokens go out before the wait for a pre-draft running beside the verify.
            let lp = &verdict.verified.logprobs;
            on_tokens(&emitted, &lp[..emitted.len().min(lp.len())]);
            let predraft = self.reconcile(round.no, pre, &verdict).await?;
            let prefill = self.advance(&emitted, &verdict.verified);
            self.record(round, &verdict, predraft, emitted, prefill);
            if let Some(stop) = stop_now {
                break stop;
            }
        };
        Ok(self.finish(stop))
    }

    /// Why the generation stops before another round, if it does.
    fn stop_before_round(&self) -> Option<StopReason> {
        if self.out.len() >= self.cfg.max_tokens {
            Some(StopReason::MaxTokens)
        } else if self.past_deadline() {
            Some(StopReason::Deadline)
        } else if self.seq.len() > known(self.o.target_limits.max_context) {
            // Even a round without a tree needs the whole sequence in the target's context.
            Some(StopReason::Context)
        } else {
            None
        }
    }

    /// Starts the next round with the widths of the tree it asks for, never deeper than what
    /// may still be emitted (accepted + 1 ≤ remaining), or with why it drafts none.
    fn choose_depth(&mut self) -> Round {
        let start = Instant::now();
        let no = self.rounds.len();
        let remaining = self.cfg.max_tokens - self.out.len();
        let advised = self.advised_depth;
        let mut drafter = self.choose_drafter();
        if advised == Some(0) && drafter != Drafter::None {
            // A target-only round, by the target's load. The online choice counts it as its
            // target-only arm; a configured drafter keeps its name, as in its other rounds
            // without a tree.
            if self.choice.is_some() {
                drafter = Drafter::None;
            }
            let widths = Vec::new();
            return Round {
                no,
                start,
                remaining,
                widths,
                no_draft: Some(NoDraft::Load),
                first: false,
                drafted: Drafted::none(0.0),
                overlap_hit: None,
                beside: false,
                drafter,
                advised_depth: advised,
            };
        }
        let (widths, mut no_draft) = if self.cfg.mode == Mode::Ar {
            (Vec::new(), Some(NoDraft::Mode))
        } else {
            let d = if self.cfg.adaptive_depth && self.cfg.pipeline == Pipeline::Predraft {
                self.planned_depth.unwrap_or(self.widths.len())
            } else if self.cfg.adaptive_depth {
                self.depth.depth(self.widths.len())
            } else {
                self.cfg.widths.len()
            };
            self.widths = resize_widths(&self.cfg.widths, d);
            let cap = advised.unwrap_or(usize::MAX);
            let wanted = resize_widths(&self.widths, d.min(remaining - 1).min(cap));
            let auto = self.cfg.drafter == DrafterChoice::Auto;
            if self.choice.is_some() {
                // Every model-free drafter proposes, played or not: the choice scores them all.
                let (room, levels) = self.target_room();
                let w = fit_tree_widths(&wanted, room, levels);
                if let Some(c) = &mut self.choice {
                    let (ngram, suffix, seq) = (&mut self.ngram, &mut self.suffix, &self.seq);
                    c.propose(seq.len(), |d| {
                        draft_model_free((&mut *ngram, &mut *suffix), seq, d, &w)
                    });
                }
            }
            if wanted.is_empty() {
                (wanted, Some(NoDraft::LastToken))
            } else if drafter == Drafter::None {
                (Vec::new(), Some(NoDraft::Chosen))
            } else if drafter == Drafter::Model && self.draft_off {
                (Vec::new(), Some(NoDraft::Limit))
            } else if drafter == Drafter::Model && !self.backoff.ready(no) {
                (Vec::new(), Some(NoDraft::Backoff))
            } else if !auto && !self.governor.speculate(no) {
                // The online choice measures target-only rounds as an arm of its own.
                (Vec::new(), Some(NoDraft::Slow))
            } else if drafter.is_model_free() {
                // Only the target's room bounds a tree drafted here.
                let (room, levels) = self.target_room();
                let w = fit_tree_widths(&wanted, room, levels);
                let why = w.is_empty().then_some(NoDraft::Limit);
                (w, why)
            } else {
                let w = self.fit_widths(&wanted);
                let why = w.is_empty().then_some(NoDraft::Limit);
                (w, why)
            }
        };
        // The first round drafts beside the target's prefill: the target's first token
        // needs no draft, so the target decodes it as a plain step while the draft drafts
        // after the prompt (as an overlapped pre-draft does), and the part of that tree
        // below the root the target picked is verified next round.
        let first = no == 0
            && drafter == Drafter::Model
            && !widths.is_empty()
            && self.cfg.overlaps_first_round()
            && (self.cfg.pipeline != Pipeline::Predraft || self.plan(widths.len()).beside());
        if first {
            no_draft = Some(NoDraft::FirstRound);
        }
        Round {
            no,
            start,
            remaining,
            widths,
            no_draft,
            first,
            drafted: Drafted::none(0.0),
            overlap_hit: None,
            beside: false,
            drafter,
            advised_depth: advised,
        }
    }

    /// A tree of the round's model-free drafter after the sequence, within the round's widths'
    /// room (timed; `NoDraft::NoMatch` when it finds nothing to continue).
    fn draft_here(&mut self, round: &mut Round) {
        let proposed = self.choice.as_ref().and_then(|c| c.proposal(round.drafter));
        let (tree, ms) = proposed.unwrap_or_else(|| {
            draft_model_free(
                (&mut self.ngram, &mut self.suffix),
                &self.seq,
                round.drafter,
                &round.widths,
            )
        });
        if round.drafter == Drafter::Suffix {
            self.suffix_used = true;
        }
        if tree.is_empty() {
            round.no_draft = Some(NoDraft::NoMatch);
        }
        round.drafted = Drafted {
            tree,
            ..Drafted::none(ms)
        };
    }

    /// Gives the round its tree: none where it drafts none (or drafts beside the prefill),
    /// else the tree pre-drafted beside the last verify if one is waiting, else one drafted
    /// now. `Some` when the generation's deadline passed while drafting.
    async fn take_or_draft(&mut self, round: &mut Round) -> Option<StopReason> {
        let pre_drafted = self.next_tree.take();
        if round.widths.is_empty() || round.first {
            return None;
        }
        if round.drafter.is_model_free() {
            self.draft_here(round);
            return None;
        }
        match pre_drafted {
            Some(pre) if !pre.tree.is_empty() => {
                // Never deeper than what may still be emitted.
                round.drafted.tree = subtree(&pre.tree, None, round.widths.len());
                round.drafted.server.one_off_setup = pre.server.one_off_setup;
                round.overlap_hit = Some(true);
            }
            pre => match self.draft(round.no, &round.widths).await {
                DraftOutcome::Tree(d) => {
                    if d.tree.is_empty() {
                        round.no_draft = Some(NoDraft::NoMatch);
                    }
                    // A first draft also feeds the prompt: not a level's cost.
                    if let (Some(_), Ok(mut p)) = (self.target_cached, self.o.planner.lock()) {
                        p.observe_draft(round.widths.len(), d.ms);
                    }
                    round.drafted = *d;
                    round.overlap_hit = pre.map(|_| false);
                }
                DraftOutcome::Failed(ms) => {
                    round.no_draft = Some(NoDraft::DraftFailed);
                    round.drafted = Drafted::none(ms);
                }
                DraftOutcome::Deadline => return Some(StopReason::Deadline),
            },
        }
        None
    }

    /// Cuts the round's tree, whatever its source, to the target's room after the sequence.
    fn fit_to_target(&self, round: &mut Round) {
        let (room, levels) = self.target_room();
        let tree = &round.drafted.tree;
        if tree.is_empty() || (tree.len() <= room && tree.max_depth() < levels) {
            return;
        }
        let mut l = levels.min(tree.max_depth() + 1);
        let mut t = subtree(tree, None, l);
        while l > 0 && t.len() > room {
            l -= 1;
            t = subtree(tree, None, l);
        }
        round.drafted.tree = t;
        if round.drafted.tree.is_empty() {
            round.no_draft = Some(NoDraft::Limit);
        }
    }

    /// Starts pre-drafting the next round's tree beside this round's verify, for outcomes of
    /// the verdict along the tree's first-child path (after the prompt alone in a first round
    /// that drafts beside the prefill): the overlapped pipeline bets on one outcome (the whole
    /// path accepted, the draft's own next token as the bonus), the pre-draft pipeline covers
    /// every accepted length with the candidates its cost model chooses. Only where tokens
    /// remain beyond the path and the draft accepts the request.
    fn predraft_beside_verify(&mut self, round: &mut Round) -> Option<PreDraftInFlight> {
        let pipeline = self.cfg.pipeline;
        if round.drafter != Drafter::Model
            || round.widths.is_empty()
            || !(pipeline != Pipeline::Sequential || round.first)
        {
            return None;
        }
        let tree = &round.drafted.tree;
        let path = first_child_path(tree);
        if !((round.first || round.depth() > 0) && round.remaining > path.len() + 1) {
            return None;
        }
        let committed = self.seq.len();
        let mut ctx = self.seq.clone();
        ctx.extend(path.iter().map(|&i| tree.token(i)));
        let shape = (pipeline == Pipeline::Predraft).then(|| self.plan(round.widths.len()));
        if let Some(shape) = shape {
            self.planned_depth = Some(shape.depth);
            if !shape.beside() {
                return None;
            }
        }
        let (candidates, set, widths) = if let Some(shape) = shape.filter(|s| s.candidates > 0) {
            let widths = resize_widths(&self.cfg.widths, shape.depth);
            let nodes =
                path.len() + (path.len() + 1) * shape.candidates * (1 + full_tree_size(&widths));
            if !self.draft_accepts(ctx.len(), nodes, widths.len().max(path.len())) {
                return None;
            }
            let set = specsplit_proto::OutcomeSet {
                committed_length: committed as i32,
                candidates: shape.candidates as i32,
                accepted_lengths: Vec::new(),
            };
            (shape.candidates, Some(set), widths)
        } else {
            // One bet (the overlapped pipeline's, or the cost model's choice): an ordinary
            // draft of the bonus and the tree.
            let widths = match shape {
                Some(s) => resize_widths(&self.cfg.widths, s.depth),
                None => round.widths.clone(),
            };
            if !self.draft_accepts(ctx.len(), 1 + full_tree_size(&widths), widths.len() + 1) {
                return None;
            }
            (1, None, widths)
        };
        let depth = widths.len();
        let set_none = set.is_none();
        let task = self.spawn_predraft(ctx, set, widths);
        round.beside = true;
        Some(PreDraftInFlight {
            task,
            path,
            candidates,
            depth,
            bet: set_none,
        })
    }

    /// The pre-draft pipeline's shape for a round whose tree has `depth` levels.
    fn plan(&self, depth: usize) -> crate::Shape {
        let depths = if self.cfg.adaptive_depth {
            self.cfg.min_depth..=self.cfg.max_depth
        } else {
            depth..=depth
        };
        self.o.planner.lock().map_or(
            crate::Shape {
                depth,
                candidates: 0,
                bet: false,
            },
            |p| {
                p.choose(
                    depths,
                    (self.cfg.candidates > 0).then_some(self.cfg.candidates),
                )
            },
        )
    }

    /// Verifies `tree` (see [`Run::verify`]); when that fails or the deadline passes first,
    /// the pre-draft beside it is aborted: no request outlives the generation.
    async fn verify_beside(
        &mut self,
        drafted: &Drafted,
        pre: Option<&PreDraftInFlight>,
    ) -> Result<Option<Verdict>, OrchestratorError> {
        let verdict = self
            .verify(&drafted.tree, drafted.server.one_off_setup)
            .await;
        if !matches!(verdict, Ok(Some(_))) {
            if let Some(p) = pre {
                p.task.abort();
            }
        }
        verdict
    }

    /// Feeds the adaptive depth controller (and the pre-draft pipeline's cost model) a
    /// speculative round's acceptance and timings.
    fn adapt_depth(&mut self, round: &Round, verdict: &Verdict) {
        // A round that sends the whole sequence (a prefill) says nothing about a verify's cost.
        let model = round.drafter == Drafter::Model;
        if model && !round.drafted.tree.is_empty() && self.target_cached.is_some() {
            if let Ok(mut p) = self.o.planner.lock() {
                let accepted = verdict.verified.accepted.len();
                p.observe_verify(round.depth(), accepted, verdict.ms, round.beside);
            }
        }
        // Its acceptance and draft cost are one drafter's: the online choice's mix of drafters
        // would blend them, so under it the depth stays as configured.
        let one_drafter = self.cfg.drafter != DrafterChoice::Auto;
        if self.cfg.adaptive_depth && one_drafter && !round.drafted.tree.is_empty() {
            self.depth.observe(
                round.depth(),
                verdict.verified.accepted.len(),
                round.drafted.ms,
                verdict.ms,
            );
        }
    }

    /// The round's tokens (the accepted ones and the target's next) cut after the first stop
    /// token and at `max_tokens`, and why the generation stops with them, if it does.
    fn cut_at_stop(&self, v: &Verified) -> (Vec<u32>, Option<StopReason>) {
        let mut emitted = v.accepted.clone();
        emitted.push(v.next);
        let mut stop = None;
        if let Some(k) = emitted
            .iter()
            .position(|t| self.o.eos.contains(t) || self.cfg.stop_token_ids.contains(t))
        {
            emitted.truncate(k + 1);
            stop = Some(StopReason::Eos);
        }
        if self.out.len() + emitted.len() >= self.cfg.max_tokens {
            emitted.truncate(self.cfg.max_tokens - self.out.len());
            stop.get_or_insert(StopReason::MaxTokens);
        }
        (emitted, stop)
    }

    /// Waits for the pre-draft beside the verify and keeps, for the next round, the tree it
    /// drafted for the verdict's outcome (the accepted length along its path and the target's
    /// token after it), an empty tree (a miss) when it drafted none for that outcome; a failed
    /// pre-draft counts as a failed draft of round `round`.
    async fn reconcile(
        &mut self,
        round: usize,
        pre: Option<PreDraftInFlight>,
        verdict: &Verdict,
    ) -> Result<PreDraftResult, OrchestratorError> {
        let v = &verdict.verified;
        let mut out = PreDraftResult::default();
        let Some(pre) = pre else {
            return Ok(out);
        };
        out.candidates = pre.candidates;
        let waited = Instant::now();
        let answer = pre
            .task
            .await
            .map_err(|e| OrchestratorError::Runtime(e.to_string()))?;
        out.wait_ms = ms_since(waited);
        match answer {
            Ok(Ok(d)) => {
                self.backoff.succeed();
                (out.ms, out.server_ms, out.model_ms) = (d.ms, d.server.wall_ms, d.server.model_ms);
                out.lag_ms = signed_ms(d.sent, verdict.sent);
                let j = v.accepted.len();
                let on_path = pre.path.get(..j) == Some(&v.accepted_nodes[..]);
                let tree = d
                    .trees
                    .into_iter()
                    .find(|&(a, t, _)| on_path && a == j && t == v.next)
                    .map(|(_, _, tree)| tree);
                let hit = tree.is_some();
                if self.cfg.pipeline == Pipeline::Predraft {
                    if let Ok(mut p) = self.o.planner.lock() {
                        let bonus = j == pre.path.len();
                        if pre.bet {
                            // A first round's bet also feeds the prompt: not a bet's cost.
                            if !pre.path.is_empty() {
                                p.observe_bet(pre.depth + 1, d.ms);
                            }
                            // One bet holds only the bonus outcome: the draft's own next token.
                            if on_path && bonus {
                                p.observe_outcome(1, true, hit);
                            }
                        } else {
                            // A first round's pre-draft also feeds the prompt: not a pass cost.
                            if !pre.path.is_empty() {
                                p.observe_predraft(pre.path.len(), pre.candidates, pre.depth, d.ms);
                            }
                            if on_path {
                                p.observe_outcome(pre.candidates, bonus, hit);
                            }
                        }
                    }
                }
                out.hit = Some(hit);
                self.next_tree = Some(Drafted {
                    tree: tree.unwrap_or_default(),
                    server: ServerTimes {
                        one_off_setup: d.server.one_off_setup,
                        ..ServerTimes::default()
                    },
                    ms: 0.0,
                });
            }
            Ok(Err(e)) => self.draft_error(round, &e),
            // The generation's deadline: the next round stops.
            Err(()) if self.past_deadline() => {}
            Err(()) => {
                let ms = self.cfg.draft_timeout_ms;
                self.draft_failed(round, &format!("no answer within {ms} ms"));
            }
        }
        Ok(out)
    }

    /// Appends the round's tokens to the output and the sequence, and notes what the target
    /// caches of it: all but its own next token, which the next verify sends. True when the
    /// round sent the whole sequence (a prefill).
    fn advance(&mut self, emitted: &[u32], v: &Verified) -> bool {
        let prefill = self.target_cached.is_none();
        self.out.extend_from_slice(emitted);
        self.logprobs
            .extend(v.logprobs.iter().take(emitted.len()).copied());
        self.seq.extend_from_slice(emitted);
        self.pending = vec![v.next];
        self.target_cached = Some(v.cached_len);
        prefill
    }

    /// Records the round: its pace for the speed governor (except a prefill's) and its
    /// [`RoundRecord`].
    fn record(
        &mut self,
        round: Round,
        verdict: &Verdict,
        predraft: PreDraftResult,
        emitted: Vec<u32>,
        prefill: bool,
    ) {
        let round_ms = ms_since(round.start);
        // A round that sent the whole sequence (a prefill) says nothing about the pace.
        if let Some(c) = &mut self.choice {
            let sent = if prefill {
                self.seq.len() - emitted.len()
            } else {
                1
            };
            let played = PlayedRound {
                drafter: round.drafter,
                rows: sent + round.drafted.tree.len(),
                emitted: emitted.len(),
                verify_ms: verdict.ms,
                draft_ms: round.drafted.ms,
                round_ms,
                prefill,
            };
            c.record(played, &self.seq);
        } else if self.cfg.mode == Mode::Spec && !prefill {
            let target_only = round.drafted.tree.is_empty();
            self.observe_pace(round.no, target_only, emitted.len(), round_ms, verdict.ms);
        }
        let tree = &round.drafted.tree;
        self.rounds.push(RoundRecord {
            drafted: round.depth(),
            tree_nodes: tree.len(),
            accepted: verdict.verified.accepted.len(),
            emitted,
            draft_ms: round.drafted.ms,
            draft_server_ms: round.drafted.server.wall_ms,
            verify_ms: verdict.ms,
            verify_server_ms: verdict.server.wall_ms,
            draft_model_ms: round.drafted.server.model_ms,
            verify_model_ms: verdict.server.model_ms,
            round_ms,
            overlap_hit: round.overlap_hit,
            predraft_wait_ms: predraft.wait_ms,
            predraft_ms: predraft.ms,
            predraft_lag_ms: predraft.lag_ms,
            predraft_server_ms: predraft.server_ms,
            predraft_model_ms: predraft.model_ms,
            predraft_candidates: predraft.candidates,
            predraft_hit: predraft.hit,
            no_draft: if tree.is_empty() {
                round.no_draft.or(Some(NoDraft::Limit))
            } else {
                None
            },
            drafter: round.drafter,
            advised_depth: round.advised_depth,
        });
    }

    /// Feeds the speed governor one round's pace; it may pause speculation or probe it again
    /// from the next round.
    fn observe_pace(
        &mut self,
        round: usize,
        target_only: bool,
        tokens: usize,
        round_ms: f64,
        verify_ms: f64,
    ) {
        if target_only {
            self.governor.observe_target_only(tokens, round_ms);
        } else {
            self.governor.observe_spec(tokens, round_ms, verify_ms);
        }
        if let Some(s) = self.governor.review(round) {
            tracing::info!(
                spec_tokens_per_s = s.spec_tokens_per_s,
                target_only_tokens_per_s = s.target_only_tokens_per_s,
                "{}",
                if s.speculate {
                    "probing speculation again"
                } else {
                    "speculation measured slower than target-only decoding; pausing it"
                }
            );
            self.switches.push(s);
        }
    }

    /// The generation's result, stopped for `stop`.
    fn finish(mut self, stop: StopReason) -> Generation {
        if let Some(c) = &self.choice {
            if let Ok(mut m) = self.o.choice_memory.lock() {
                c.finish(&mut m);
            }
        }
        if self.suffix_used {
            self.suffix.finish(&self.seq, self.prompt_len);
        }
        let elapsed = self.start.elapsed().as_secs_f64();
        let mut stats = GenerationStats::from_rounds(&self.rounds, elapsed, self.ttft_ms);
        stats.draft_failures = self.draft_failures;
        stats.speed_switches = self.switches;
        Generation {
            stats,
            token_ids: self.out,
            token_logprobs: self.logprobs,
            stop_reason: stop,
            rounds: self.rounds,
        }
    }

    /// Limits of the trees accepted from the draft worker.
    fn limits(&self) -> TreeLimits {
        TreeLimits {
            max_nodes: 1 << 16,
            max_depth: 1 << 10,
            vocab_size: self.o.vocab_size,
        }
    }

    /// `at`, or the generation's deadline if that comes first.
    fn bounded(&self, at: Instant) -> Instant {
        self.deadline.map_or(at, |d| d.min(at))
    }

    /// Whether the generation's deadline has passed.
    fn past_deadline(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
    }

    /// How deep this generation drafts by itself, as its verify requests tell the target's load
    /// gate: its current depth before the target's advice and the end of the generation cap a
    /// round (0 for target-only generations).
    fn depth_limit(&self) -> u32 {
        match self.cfg.mode {
            Mode::Spec => u32::try_from(self.widths.len()).unwrap_or(u32::MAX),
            Mode::Ar => 0,
        }
    }

    /// The most tree nodes and levels the target accepts after the current sequence.
    fn target_room(&self) -> (usize, usize) {
        let t = &self.o.target_limits;
        let mut nodes =
            known(t.max_tree_nodes).min(known(t.max_context).saturating_sub(self.seq.len()));
        if t.max_context == 0 {
            nodes = known(t.max_tree_nodes);
        }
        (nodes, known(t.max_tree_depth))
    }
}
