//! The target engine: per-session KV cache, the delta protocol, and verification of a whole
//! draft tree in one forward pass followed by rollback/compaction to the accepted path.

use std::sync::Arc;
use std::time::{Duration, Instant};

use candle_core::{DType, Tensor, D};
use rand_chacha::ChaCha8Rng;
use specsplit_core::mask::TreeMask;
use specsplit_core::sampling::{self, SamplingParams};
use specsplit_core::tree::TokenTree;
use specsplit_core::verify::{self, Verdict};
use specsplit_models::cpu_attention::TreeRows;
use specsplit_models::fused::{self, Launch};
use specsplit_models::step::{ExactStepper, SessionRowsStepper};
use specsplit_models::transformer::{SessionChainRows, Transformer};
use specsplit_models::SessionPass;

use crate::engine_session::{
    common_prefix, session_cache_bytes, CacheClasses, EngineSession, SessionEngine,
};
use crate::error::CACHE_EVICTED_MARKER;
use crate::session::KvCharge;
use crate::spare::{SessionBody, Spares};
use crate::EngineError;

/// One target session: the cached sequence, the logits after its last token, and the
/// graph-replayed one-token step over its cache (made at the session's first plain decoding
/// step where the model has one).
pub type TargetSession = EngineSession<ExactStepper>;

impl TargetSession {
    /// Row counts of the passes this session replays from captured CUDA graphs (1: a plain
    /// decoding step; n: a chain of n - 1 draft tokens below the new token).
    pub fn graph_passes(&self) -> Vec<usize> {
        self.stepper
            .as_ref()
            .map_or_else(Vec::new, ExactStepper::chain_graphs)
    }
}

/// Where the sequence before the tree comes from.
#[derive(Debug, Clone)]
pub enum Prefix {
    /// The whole sequence so far; the longest cached common prefix is reused.
    Full(Vec<u32>),
    /// Tokens to append to the session's cached sequence, whose length must be `expected_len`.
    Delta {
        /// Tokens to append (the previous round's correction or bonus token).
        new_tokens: Vec<u32>,
        /// Length the caller believes the cached sequence has.
        expected_len: usize,
    },
}

/// The outcome of one verification round.
#[derive(Debug, Clone)]
pub struct VerifyOutcome {
    /// Accepted path and the target's next token.
    pub verdict: Verdict,
    /// Length of the cached sequence afterwards (prefix + accepted; the next token is not cached).
    pub cached_len: usize,
    /// Whether a cached prefix was reused.
    pub cache_hit: bool,
    /// Time in the forward pass and the verdict's device→host copy.
    pub model_time: Duration,
    /// Of `model_time`, the host's time until the forward pass was enqueued (the rest is the
    /// wait for the device, the verdict's reduction and its copy): close to `model_time`, the
    /// pass is bound by kernel launches, not by the device.
    pub enqueue_time: Duration,
    /// Tokens that went through the model.
    pub tokens_processed: usize,
    /// When asked for: the model's log-probability (log-softmax of its logits, before
    /// temperature and truncation) of each accepted token, then of the next token.
    pub logprobs: Vec<f32>,
}

/// A verification round between [`TargetEngine::prepare`] and [`TargetEngine::finish`]: the
/// session's cache holds the kept prefix and the new tokens its preparation ran (all of a
/// prompt's; none of a single new token, which the round's pass runs).
pub struct PreparedRound {
    /// Cached tokens kept from before the round.
    keep: usize,
    /// The round's new tokens (all of them; those before the pass's tail are in the cache
    /// already).
    new: Vec<u32>,
    /// Whether a cached prefix was reused.
    cache_hit: bool,
    /// The cache's length when the round's pass starts.
    pass_start: usize,
    /// When the round's model work began (moved on by [`TargetEngine::resume`] past the wait
    /// between preparation and pass).
    started: Instant,
    /// The model time of the preparation.
    prepare_time: Duration,
    timer: PassTimer,
}

impl PreparedRound {
    /// The new tokens the round's pass runs: the last one of a single new token, none where
    /// the preparation ran them all (a prompt's prefill) or there are none.
    fn tail(&self) -> &[u32] {
        &self.new[(self.pass_start - self.keep).min(self.new.len())..]
    }

    /// Rows the round's pass runs: its last new token and the tree's nodes.
    pub fn pass_rows(&self, tree: &TokenTree) -> usize {
        self.tail().len() + tree.len()
    }
}

/// The most pass timings a [`TargetEngine`] keeps until they are taken.
const MAX_PASS_TIMINGS: usize = 1 << 16;

/// How long one verification pass took (an engine made [`TargetEngine::with_device_timing`]).
#[derive(Debug, Clone, Copy)]
pub struct PassTiming {
    /// Tokens that went through the model.
    pub rows: usize,
    /// Cached tokens before them.
    pub context: usize,
    /// Device time from CUDA events recorded before the pass's inputs were uploaded and after
    /// it was enqueued (host gaps between the two included).
    pub device_ms: f64,
    /// Host time until the pass was enqueued.
    pub enqueue_ms: f64,
    /// The round's model time (pass, verdict and its copy).
    pub model_ms: f64,
    /// Whether the session holds a captured graph for passes of one new token and this tree.
    pub graph: bool,
}

/// The device time of one verification pass when the engine times passes (else a no-op).
/// Timing is a diagnostic: its failures are logged and drop the timing, never fail the round.
struct PassTimer(Option<specsplit_core::device::DeviceSpan>);

impl PassTimer {
    /// Starts timing on `device` before the pass's inputs are uploaded, if `on`.
    fn start(device: &candle_core::Device, on: bool) -> Self {
        if !on {
            return Self(None);
        }
        Self(specsplit_core::device::DeviceSpan::start(device).unwrap_or_else(Self::failed))
    }

    /// Marks the end, once the pass is enqueued on `device`.
    fn enqueued(&mut self, device: &candle_core::Device) {
        if let Some(Err(e)) = self.0.as_mut().map(|sp| sp.end(device)) {
            self.0 = Self::failed(e);
        }
    }

    /// The pass's device milliseconds (waits for the pass), if timed.
    fn device_ms(self) -> Option<f64> {
        self.0
            .and_then(|sp| sp.elapsed_ms().unwrap_or_else(Self::failed))
    }

    fn failed<T>(e: candle_core::Error) -> Option<T> {
        tracing::warn!("device timing: {e}");
        None
    }
}

/// Verifies draft trees with the target model.
pub struct TargetEngine {
    model: Arc<Transformer>,
    max_context: usize,
    /// The capacities sessions' caches start at and grow through.
    classes: CacheClasses,
    /// Whether plain decoding steps replay a captured [`ExactStepper`] (bits identical to a
    /// one-token forward) where the model allows it.
    exact_steps: bool,
    /// Ended sessions' caches and graphs, for the next sessions.
    spares: Arc<Spares<SessionBody<ExactStepper>>>,
    /// Whether each verification pass is timed on the device ([`PassTiming`]).
    device_timing: bool,
    /// Per verification pass when `device_timing`.
    device_times: std::sync::Mutex<Vec<PassTiming>>,
    /// Several sessions' chain verifications in one pass, replayed from CUDA graphs where
    /// `exact_steps` holds ([`TargetEngine::pass_sessions`]).
    session_rows: std::sync::Mutex<SessionRowsStepper>,
}

impl SessionEngine for TargetEngine {
    type Session = TargetSession;
    const WORKER_TYPE: &'static str = "target";

    fn session_bytes(&self) -> usize {
        session_cache_bytes(&self.model, self.classes.first)
    }

    fn new_charged_session(
        &self,
        seed: u64,
        charge: KvCharge,
    ) -> Result<TargetSession, EngineError> {
        EngineSession::open(&self.spares, seed, charge, || {
            self.classes.new_cache(&self.model)
        })
    }
}

impl TargetEngine {
    /// An engine over `model` whose sessions hold up to `max_context` tokens, in caches that
    /// start at [`crate::engine_session::DEFAULT_FIRST_CAPACITY`] entries and grow with use.
    pub fn new(model: Arc<Transformer>, max_context: usize) -> Self {
        let exact_steps = model.exact_step_fits(max_context);
        let first = crate::engine_session::DEFAULT_FIRST_CAPACITY;
        Self {
            model,
            max_context,
            classes: CacheClasses::new(first, max_context),
            exact_steps,
            spares: Arc::new(Spares::new(crate::spare::DEFAULT_SPARE_SESSIONS)),
            device_timing: false,
            device_times: std::sync::Mutex::new(Vec::new()),
            session_rows: std::sync::Mutex::new(SessionRowsStepper::new()),
        }
    }

    /// The most rows the sessions of one verification pass share a model pass of (see
    /// [`Transformer::session_group_rows`]): past it, a pass reads the weights once a group.
    pub fn session_group_rows(&self) -> Option<usize> {
        self.model.session_group_rows()
    }

    /// New sessions' caches start at `entries` entries (at most `max_context`) and double
    /// from there as rounds need.
    pub fn with_first_capacity(mut self, entries: usize) -> Self {
        self.classes = CacheClasses::new(entries, self.max_context);
        self
    }

    /// Times each verification pass on the device with two CUDA events when `on` (off by
    /// default: two events a round); [`TargetEngine::take_device_times`] hands the timings out.
    pub fn with_device_timing(mut self, on: bool) -> Self {
        self.device_timing = on;
        self
    }

    /// The timings of the passes verified since the last call (the first 65536 of them), when
    /// the engine times passes ([`TargetEngine::with_device_timing`]; else none).
    pub fn take_device_times(&self) -> Vec<PassTiming> {
        std::mem::take(&mut *self.device_times.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Keeps `t` for [`TargetEngine::take_device_times`]; a server nobody collects from keeps
    /// only its first [`MAX_PASS_TIMINGS`] passes.
    fn keep_timing(&self, t: PassTiming) {
        let mut times = self.device_times.lock().unwrap_or_else(|e| e.into_inner());
        if times.len() < MAX_PASS_TIMINGS {
            times.push(t);
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

    /// Whether plain decoding steps replay a captured one-token step (see [`ExactStepper`]).
    pub fn uses_exact_steps(&self) -> bool {
        self.exact_steps
    }

    /// The model.
    pub fn model(&self) -> &Transformer {
        &self.model
    }

    /// Verifies `tree` after the sequence given by `prefix`, in one forward pass over the
    /// uncached tail of the sequence and every tree node; then keeps only the accepted path in
    /// the cache. An empty tree is a plain decoding step (the target alone).
    pub fn verify(
        &self,
        s: &mut TargetSession,
        prefix: Prefix,
        tree: &TokenTree,
        params: &SamplingParams,
    ) -> Result<VerifyOutcome, EngineError> {
        self.verify_scored(s, prefix, tree, params, false)
    }

    /// [`TargetEngine::verify`], with [`VerifyOutcome::logprobs`] filled in when `logprobs`:
    /// [`TargetEngine::prepare`], [`TargetEngine::pass`], then [`TargetEngine::finish`].
    pub fn verify_scored(
        &self,
        s: &mut TargetSession,
        prefix: Prefix,
        tree: &TokenTree,
        params: &SamplingParams,
        logprobs: bool,
    ) -> Result<VerifyOutcome, EngineError> {
        let round = self.prepare(s, prefix, tree)?;
        let logits = self.pass(s, &round, tree)?;
        self.finish(s, round, tree, &logits, params, logprobs, None)
    }

    /// The first phase of a verification round: checks `prefix` and `tree` against the
    /// session and the context, keeps the reusable cached prefix, and runs a long uncached
    /// tail (a prompt) through the model causally, alone, leaving at most one new token for
    /// the round's pass. A round its checks refuse leaves the session as it was.
    pub fn prepare(
        &self,
        s: &mut TargetSession,
        prefix: Prefix,
        tree: &TokenTree,
    ) -> Result<PreparedRound, EngineError> {
        let (keep, new, cache_hit) = match prefix {
            Prefix::Full(seq) => {
                if seq.is_empty() {
                    return Err(EngineError::InvalidArgument(
                        "prompt_token_ids is empty: send the prompt, or use new_token_ids with \
                         expected_prefix_length on an existing session"
                            .into(),
                    ));
                }
                let lcp = common_prefix(&s.tokens, &seq);
                let reusable = lcp == seq.len() && lcp == s.tokens.len() && s.last_logits.is_some();
                let keep = if reusable {
                    lcp
                } else {
                    lcp.min(seq.len() - 1)
                };
                (keep, seq[keep..].to_vec(), keep > 0)
            }
            Prefix::Delta {
                new_tokens,
                expected_len,
            } => {
                if expected_len != s.tokens.len() {
                    // The session's own length stays out of the message: a session created
                    // without a secret is open to any client that knows its id.
                    return Err(EngineError::FailedPrecondition(format!(
                        "{CACHE_EVICTED_MARKER}: expected_prefix_length {expected_len} does not \
                         match the session's cached sequence; resend the full prompt"
                    )));
                }
                if new_tokens.is_empty() && s.last_logits.is_none() {
                    return Err(EngineError::FailedPrecondition(format!(
                        "{CACHE_EVICTED_MARKER}: the session has no pending logits and no new \
                         tokens were sent; resend the full prompt"
                    )));
                }
                (s.tokens.len(), new_tokens, true)
            }
        };
        specsplit_core::device::bind_to_thread(self.model.device())?;
        let needed = keep + new.len() + tree.len();
        if needed > self.max_context {
            return Err(EngineError::InvalidArgument(format!(
                "sequence of {} tokens plus a {}-node tree exceeds the target context of {} tokens",
                keep + new.len(),
                tree.len(),
                self.max_context
            )));
        }
        // Room for the whole round before anything is written: growth (and its charge) never
        // happens inside a pass, and a refused growth leaves the session as it was.
        s.reserve(needed)?;
        s.cache.truncate(keep)?;
        s.tokens.truncate(keep);
        if !new.is_empty() {
            s.last_logits = None;
        }
        let timer = PassTimer::start(self.model.device(), self.device_timing);
        let started = Instant::now();
        let pass_start = self.prefill_head(s, keep, &new)?;
        Ok(PreparedRound {
            keep,
            new,
            cache_hit,
            pass_start,
            started,
            prepare_time: started.elapsed(),
            timer,
        })
    }

    /// Several new tokens (a prompt) go through the model causally in one pass after `keep`
    /// cached ones, alone, and the logits after the last become the session's pending logits
    /// (the round's row 0), so that the round's pass holds only its tree. Every mode takes its
    /// first token after a prompt from this pass, so speculative and target-only decoding
    /// agree; one new token is left to the round's pass. Returns the cache's length after it.
    fn prefill_head(
        &self,
        s: &mut TargetSession,
        keep: usize,
        new: &[u32],
    ) -> Result<usize, EngineError> {
        if new.len() <= 1 {
            return Ok(keep);
        }
        let dev = self.model.device();
        // One pass (not `Transformer::prefill`'s chunks): at the 7B shape the chunked
        // prefill of a 127-token prompt took 27.6 ms against 19.0–19.4 ms in one pass
        // (target-only TTFT, H100, 2026-11-25, `specsplit-bench e2e`); and the prompt's last
        // token in it rather than in a pass of its own saves that pass (a 7B step).
        let ids = Tensor::new(new, dev)?;
        let pos: Vec<u32> = (keep as u32..(keep + new.len()) as u32).collect();
        let pos = Tensor::new(pos.as_slice(), dev)?;
        let rows = Tensor::new(&[new.len() as u32 - 1], dev)?;
        let logits = self.model.forward(&ids, &pos, None, &mut s.cache, &rows)?;
        s.last_logits = Some(logits.get(0)?);
        Ok(keep + new.len())
    }

    /// Marks the start of `round`'s pass after a wait since its preparation: the round's model
    /// time counts its preparation and its pass, not the wait. The pass is timed on the device
    /// ([`TargetEngine::with_device_timing`]) only when it runs `alone`: a pass shared by
    /// several sessions is no one round's.
    pub fn resume(&self, round: &mut PreparedRound, alone: bool) {
        let now = Instant::now();
        round.started = now.checked_sub(round.prepare_time).unwrap_or(now);
        round.timer = PassTimer::start(self.model.device(), alone && self.device_timing);
    }

    /// Gives up a prepared round that will not run: the session keeps the round's kept prefix
    /// (its tokens and its cache agree again), as a round refused at its pass would leave it.
    pub fn abandon(&self, s: &mut TargetSession, round: &PreparedRound) {
        // Within the cache's length: prepare truncated it to `keep` and only appended since.
        let _ = s.cache.truncate(round.keep);
        // Pending logits a prefill left belong to tokens the session no longer holds.
        if !round.new.is_empty() {
            s.last_logits = None;
        }
    }

    /// The second phase, for one session alone: the round's pass over its last new token and
    /// the tree nodes (each seeing the whole sequence, its ancestors and itself). Returns the
    /// logits rows (tree.len() + 1, vocab): row 0 after the sequence, row i+1 after node i.
    pub fn pass(
        &self,
        s: &mut TargetSession,
        round: &PreparedRound,
        tree: &TokenTree,
    ) -> Result<Tensor, EngineError> {
        // A failed multi-session pass may have left its rows in the cache.
        s.cache.truncate(round.pass_start)?;
        self.forward_round(s, round.pass_start, round.tail(), tree)
    }

    /// The second phase for several sessions in one model call
    /// ([`Transformer::forward_sessions`]): each member's logits rows as
    /// [`TargetEngine::pass`] returns them alone. A member with nothing to run (no new token,
    /// no tree) answers from its pending logits. On an error, the members' caches may hold
    /// rows of the failed pass: [`TargetEngine::pass`] of a member alone starts over from
    /// [`PreparedRound`]'s cached length.
    pub fn pass_sessions(
        &self,
        members: &mut [(&mut TargetSession, &PreparedRound, &TokenTree)],
    ) -> Result<Vec<Tensor>, EngineError> {
        specsplit_core::device::bind_to_thread(self.model.device())?;
        if let Some(out) = self.pass_session_chains(members)? {
            return Ok(out);
        }
        // What each member runs: its combined chain+tree, mask, positions and wanted rows.
        struct Rows {
            member: usize,
            combined: TokenTree,
            mask: TreeMask,
            prefix: usize,
            positions: Vec<u32>,
            want: Vec<u32>,
        }
        let mut runs = Vec::new();
        for (i, (s, round, tree)) in members.iter_mut().enumerate() {
            s.cache.truncate(round.pass_start)?;
            let new = round.tail();
            if new.is_empty() && tree.is_empty() {
                continue;
            }
            let combined = chain_then_tree(new, tree)?;
            let mask = TreeMask::new(&combined);
            let positions = mask.positions(round.pass_start);
            let want = (0..combined.len() as u32).collect();
            runs.push(Rows {
                member: i,
                combined,
                mask,
                prefix: round.pass_start,
                positions,
                want,
            });
        }
        let mut passed: Vec<Option<Tensor>> = vec![None; members.len()];
        {
            let mut caches: Vec<Option<&mut specsplit_core::cache::SessionCache>> = members
                .iter_mut()
                .map(|(s, _, _)| Some(&mut s.cache))
                .collect();
            let mut parts: Vec<SessionPass<'_>> = runs
                .iter()
                .map(|r| SessionPass {
                    tokens: r.combined.tokens(),
                    positions: &r.positions,
                    tree: TreeRows {
                        mask: &r.mask,
                        prefix: r.prefix,
                        first_row: 0,
                    },
                    cache: caches[r.member].take().expect("one part per member"),
                    rows: &r.want,
                })
                .collect();
            // Members with nothing to run (a prompt's first round without a tree) answer from
            // their pending logits alone.
            if !parts.is_empty() {
                let logits = self.model.forward_sessions(&mut parts)?;
                for (r, l) in runs.iter().zip(logits) {
                    passed[r.member] = Some(l);
                }
            }
        }
        members
            .iter()
            .zip(passed)
            .map(|((s, round, _), l)| {
                let pending = || {
                    s.last_logits.as_ref().ok_or_else(|| {
                        EngineError::FailedPrecondition(format!(
                            "{CACHE_EVICTED_MARKER}: no pending logits; resend the full prompt"
                        ))
                    })
                };
                match l {
                    None => Ok(pending()?.unsqueeze(0)?),
                    Some(l) if round.tail().is_empty() => {
                        Ok(Tensor::cat(&[&pending()?.unsqueeze(0)?, &l], 0)?)
                    }
                    Some(l) => Ok(l),
                }
            })
            .collect()
    }

    /// [`TargetEngine::pass_sessions`] from a CUDA graph of the shape
    /// ([`SessionRowsStepper`]) where every member verifies a chain (or nothing) below one new
    /// token, each session's cache has room for the longest, and the model takes the pass;
    /// `None` (nothing run) otherwise. A shorter chain is padded to the longest with copies of
    /// its last token: the pad rows come after the member's own, which never see them (each
    /// row attends to its session's slots up to its own, and no product mixes rows), and their
    /// K/V land past the slots its cache keeps. Each member's logits (its own rows) are copied
    /// out of the stepper's buffer, which its next pass overwrites.
    fn pass_session_chains(
        &self,
        members: &mut [(&mut TargetSession, &PreparedRound, &TokenTree)],
    ) -> Result<Option<Vec<Tensor>>, EngineError> {
        let rows = members
            .iter()
            .map(|(_, _, tree)| 1 + tree.len())
            .max()
            .unwrap_or(0);
        let fits = members.iter().all(|(s, round, tree)| {
            round.tail().len() == 1
                && is_chain(tree)
                && round.pass_start + rows <= s.cache.capacity()
        });
        let capacity = members
            .iter()
            .map(|(s, _, _)| s.cache.capacity())
            .max()
            .unwrap_or(0);
        if !self.exact_steps
            || members.len() < 2
            || !fits
            || !self.model.session_rows_fit(capacity, members.len(), rows)
        {
            return Ok(None);
        }
        let tokens: Vec<Vec<u32>> = members
            .iter()
            .map(|(_, round, tree)| {
                let mut t = Vec::with_capacity(rows);
                t.extend_from_slice(round.tail());
                t.extend((0..tree.len()).map(|i| tree.token(i)));
                let last = t[t.len() - 1];
                t.resize(rows, last);
                t
            })
            .collect();
        for (s, round, _) in members.iter_mut() {
            s.cache.truncate(round.pass_start)?;
        }
        // Held until the logits are copied out of the stepper's buffer.
        let mut stepper = self.session_rows.lock().unwrap_or_else(|e| e.into_inner());
        let logits = {
            let parts: Vec<SessionChainRows<'_>> = members
                .iter()
                .zip(&tokens)
                .map(|((s, _, _), tokens)| SessionChainRows {
                    cache: &s.cache,
                    tokens,
                })
                .collect();
            stepper.pass(&self.model, &parts, capacity)?
        };
        let mut out = Vec::with_capacity(members.len());
        for (i, (s, _, tree)) in members.iter_mut().enumerate() {
            let own = 1 + tree.len();
            s.cache.advance(own)?;
            out.push(logits.narrow(0, i * rows, own)?.copy()?);
        }
        drop(stepper);
        Ok(Some(out))
    }

    /// The last phase: the verdict from the pass's `logits`, then the cache keeps only the
    /// accepted path and the session the logits after it. `argmax`: each row's argmax of
    /// `logits` where the caller already has them ([`TargetEngine::argmaxes`]), for a greedy
    /// verdict without another copy from the device.
    #[allow(clippy::too_many_arguments)]
    pub fn finish(
        &self,
        s: &mut TargetSession,
        round: PreparedRound,
        tree: &TokenTree,
        logits: &Tensor,
        params: &SamplingParams,
        logprobs: bool,
        argmax: Option<Vec<u32>>,
    ) -> Result<VerifyOutcome, EngineError> {
        let PreparedRound {
            keep,
            new,
            cache_hit,
            started,
            mut timer,
            ..
        } = round;
        let enqueue_time = started.elapsed();
        timer.enqueued(self.model.device());
        let verdict = self.decide(tree, logits, params, &mut s.rng, argmax)?;
        let model_time = started.elapsed();
        if let Some(device_ms) = timer.device_ms() {
            self.keep_timing(PassTiming {
                rows: new.len() + tree.len(),
                context: keep,
                device_ms,
                enqueue_ms: enqueue_time.as_secs_f64() * 1e3,
                model_ms: model_time.as_secs_f64() * 1e3,
                graph: s.graph_passes().contains(&(1 + tree.len())),
            });
        }

        // Keep the accepted path: the prefix and the new tokens stay, the accepted tree nodes
        // move down next to them, the rest is dropped.
        let base = keep + new.len();
        let kept: Vec<usize> = verdict.accepted_nodes.iter().map(|&i| base + i).collect();
        keep_path(&self.model, &mut s.cache, base, &kept)?;
        s.tokens.extend_from_slice(&new);
        s.tokens.extend_from_slice(&verdict.accepted_tokens);
        let last_row = verdict.accepted_nodes.last().map_or(0, |&i| i + 1);
        s.last_logits = Some(logits.get(last_row)?);
        let logprobs = if logprobs {
            emitted_logprobs(logits, &verdict)?
        } else {
            Vec::new()
        };
        Ok(VerifyOutcome {
            cached_len: s.tokens.len(),
            cache_hit,
            model_time,
            enqueue_time,
            tokens_processed: new.len() + tree.len(),
            verdict,
            logprobs,
        })
    }

    /// One forward pass over `new` (causal, after `keep` cached tokens) and the tree nodes (each
    /// seeing the whole sequence, its ancestors and itself). Returns the logits rows
    /// (tree.len() + 1, vocab): row 0 after the sequence, row i+1 after node i.
    fn forward_round(
        &self,
        s: &mut TargetSession,
        keep: usize,
        new: &[u32],
        tree: &TokenTree,
    ) -> Result<Tensor, EngineError> {
        let dev = self.model.device().clone();
        if new.is_empty() && tree.is_empty() {
            let l = s.last_logits.as_ref().ok_or_else(|| {
                EngineError::FailedPrecondition(format!(
                    "{CACHE_EVICTED_MARKER}: no pending logits; resend the full prompt"
                ))
            })?;
            return Ok(l.unsqueeze(0)?);
        }
        if tree.is_empty() && new.len() == 1 && self.exact_steps {
            // A plain decoding step from a captured graph: one launch instead of a few hundred,
            // the same bits as the one-token forward below. The logits are the stepper's own
            // buffer, not a copy: its next step runs only for a new token, and `verify` drops
            // `last_logits` (the one view kept past this round) before that.
            let st = self.stepper(&mut s.stepper, s.cache.capacity())?;
            return Ok(st.step(&self.model, new[0], &mut s.cache)?);
        }
        if tree.is_empty() && new.len() == 1 {
            // A plain decoding step: causal attention needs no mask (an all-zero mask would add
            // exactly 0.0 to every score), so none is built, uploaded or added per layer.
            let ids = Tensor::new(new, &dev)?;
            let pos = Tensor::new(&[keep as u32], &dev)?;
            let rows = Tensor::new(&[0u32], &dev)?;
            return Ok(self.model.forward(&ids, &pos, None, &mut s.cache, &rows)?);
        }
        if new.len() == 1 && self.exact_steps && is_chain(tree) {
            // One new token and a chain below it (a chain draft): the rows pass of the eager
            // forward below, replayed from a graph captured for this chain length.
            let st = self.stepper(&mut s.stepper, s.cache.capacity())?;
            if st.chain_fits(&self.model, 1 + tree.len()) {
                let mut chain = Vec::with_capacity(1 + tree.len());
                chain.push(new[0]);
                chain.extend((0..tree.len()).map(|i| tree.token(i)));
                return Ok(st.step_chain(&self.model, &chain, &mut s.cache)?);
            }
        }
        // The new tokens form a chain and the tree hangs below its last token: one combined
        // tree gives the mask and positions of the whole pass.
        let combined = chain_then_tree(new, tree)?;
        let mask = TreeMask::new(&combined);
        let pos = Tensor::new(mask.positions(keep).as_slice(), &dev)?;
        let ids = Tensor::new(combined.tokens(), &dev)?;
        let first_row = new.len().saturating_sub(1);
        let want: Vec<u32> = (first_row..combined.len()).map(|r| r as u32).collect();
        let want = Tensor::new(want.as_slice(), &dev)?;
        let rows_of = TreeRows {
            mask: &mask,
            prefix: keep,
            first_row: 0,
        };
        let logits = self
            .model
            .forward_tree(&ids, &pos, rows_of, &mut s.cache, &want)?;
        if new.is_empty() {
            let l = s.last_logits.as_ref().ok_or_else(|| {
                EngineError::FailedPrecondition(format!(
                    "{CACHE_EVICTED_MARKER}: no pending logits; resend the full prompt"
                ))
            })?;
            Ok(Tensor::cat(&[&l.unsqueeze(0)?, &logits], 0)?)
        } else {
            Ok(logits)
        }
    }

    /// The session's graph-replayed stepper over its cache of `capacity` entries, made at its
    /// first use and again after the cache grew (a stepper for another capacity holds graphs
    /// over buffers the cache no longer has: it is dropped, never replayed).
    fn stepper<'s>(
        &self,
        slot: &'s mut Option<ExactStepper>,
        capacity: usize,
    ) -> Result<&'s mut ExactStepper, EngineError> {
        if slot.as_ref().is_some_and(|st| st.capacity() != capacity) {
            *slot = None;
        }
        Ok(match slot {
            Some(st) => st,
            none => none.insert(ExactStepper::new(&self.model, capacity)?),
        })
    }

    /// Each row's argmax of each of `logits` (`(rows, vocab)` matrices of one model's pass),
    /// with one copy from the device for all of them: on CUDA through
    /// [`fused::argmax_rows`], each row spread over many blocks (the lowest index among equal
    /// maxima, as [`specsplit_core::sampling::argmax`] picks on the host), elsewhere through
    /// the tensor's own argmax.
    pub fn argmaxes(&self, logits: &[&Tensor]) -> Result<Vec<Vec<u32>>, EngineError> {
        if logits.is_empty() {
            return Ok(Vec::new());
        }
        if !logits[0].device().is_cuda() {
            return logits
                .iter()
                .map(|l| Ok(l.argmax(D::Minus1)?.to_vec1()?))
                .collect();
        }
        // The kernel reads each matrix's rows in place: views are copied first (none are in
        // the passes' own logits).
        let owned = logits
            .iter()
            .map(|l| l.contiguous())
            .collect::<Result<Vec<_>, _>>()?;
        let views: Vec<&Tensor> = owned.iter().collect();
        let flat: Vec<u32> = fused::argmax_rows(&views, Launch::DEFAULT)?.to_vec1()?;
        let mut rest = flat.as_slice();
        let mut out = Vec::with_capacity(logits.len());
        for l in logits {
            let (head, tail) = rest.split_at(l.dims2()?.0);
            out.push(head.to_vec());
            rest = tail;
        }
        Ok(out)
    }

    /// The verdict from the logits rows: greedy compares argmaxes copied from the device
    /// (`argmax` where the caller has them), sampling copies the rows and runs lossless
    /// multi-step speculative sampling.
    fn decide(
        &self,
        tree: &TokenTree,
        logits: &Tensor,
        params: &SamplingParams,
        rng: &mut ChaCha8Rng,
        argmax: Option<Vec<u32>>,
    ) -> Result<Verdict, EngineError> {
        if params.is_greedy() {
            let next = match argmax {
                Some(next) => next,
                None => self.argmaxes(&[logits])?.pop().unwrap_or_default(),
            };
            if next.len() != tree.len() + 1 {
                return Err(EngineError::Tensor(candle_core::Error::Msg(format!(
                    "{} argmaxes for a tree of {} nodes",
                    next.len(),
                    tree.len()
                ))));
            }
            if tree.is_empty() {
                return Ok(Verdict {
                    accepted_nodes: vec![],
                    accepted_tokens: vec![],
                    next_token: next[0],
                    bonus: false,
                });
            }
            return verify::verify_greedy(tree, &next)
                .map_err(|e| EngineError::InvalidArgument(e.to_string()));
        }
        let rows: Vec<Vec<f32>> = logits.to_dtype(DType::F32)?.to_vec2()?;
        if tree.is_empty() {
            let dist = sampling::warp(&rows[0], params);
            return Ok(Verdict {
                accepted_nodes: vec![],
                accepted_tokens: vec![],
                next_token: sampling::sample(&dist, rng),
                bonus: false,
            });
        }
        let vocab = rows[0].len();
        let flat: Vec<f32> = rows.into_iter().flatten().collect();
        // A tree without any draft distribution (a client that sends only tokens) is verified
        // with point-mass proposals; the service refuses trees with only some distributions.
        let verified = if tree.has_any_distribution() {
            verify::verify_stochastic(tree, &flat, vocab, params, rng)
        } else {
            verify::verify_point_mass(tree, &flat, vocab, params, rng)
        };
        verified.map_err(|e| EngineError::InvalidArgument(e.to_string()))
    }
}

/// The log-probability of each token `verdict` emits (the accepted ones, then the next) under
/// the logits rows that predicted it: row 0 (after the sequence) for the first, the row of
/// each accepted node for the token after it. Computed on the device; only the values are
/// copied.
fn emitted_logprobs(logits: &Tensor, verdict: &Verdict) -> Result<Vec<f32>, EngineError> {
    let rows: Vec<u32> = std::iter::once(0)
        .chain(verdict.accepted_nodes.iter().map(|&i| i as u32 + 1))
        .collect();
    let mut tokens = verdict.accepted_tokens.clone();
    tokens.push(verdict.next_token);
    let dev = logits.device();
    let x = logits
        .index_select(&Tensor::new(rows.as_slice(), dev)?, 0)?
        .to_dtype(DType::F32)?;
    let shifted = x.broadcast_sub(&x.max_keepdim(D::Minus1)?)?;
    let log_total = shifted.exp()?.sum_keepdim(D::Minus1)?.log()?;
    let ids = Tensor::new(tokens.as_slice(), dev)?.unsqueeze(1)?;
    let picked = shifted.gather(&ids, 1)?.broadcast_sub(&log_total)?;
    Ok(picked.squeeze(1)?.to_vec1()?)
}

/// Keeps the cache entries `kept` (ascending, from `base` on: a verdict's accepted nodes) right
/// after `base` and drops every entry past them. Up to [`fused::MOVE_MAX`] entries that move go
/// in one [`Transformer::move_cache_entries`] (one launch for every layer on CUDA); more, or
/// `kept` out of order, go through [`SessionCache::compact`] (a copy per layer, or its error).
pub(crate) fn keep_path(
    model: &Transformer,
    cache: &mut specsplit_core::cache::SessionCache,
    base: usize,
    kept: &[usize],
) -> Result<(), EngineError> {
    let ordered = kept.windows(2).all(|w| w[0] < w[1])
        && kept.first().is_none_or(|&p| p >= base)
        && kept.last().is_none_or(|&p| p < cache.len());
    let moves: Vec<(usize, usize)> = (base..)
        .zip(kept)
        .filter(|(to, from)| *from != to)
        .map(|(to, &from)| (from, to))
        .collect();
    if !ordered || moves.len() > fused::MOVE_MAX {
        cache.compact(base, kept)?;
        return Ok(());
    }
    // A chain's accepted nodes are in place already: nothing to gather or launch.
    if !moves.is_empty() {
        model.move_cache_entries(cache, &moves)?;
    }
    cache.truncate(base + kept.len())?;
    Ok(())
}

/// Whether `tree` is one chain: a single root, each later node the child of the one before.
fn is_chain(tree: &TokenTree) -> bool {
    (0..tree.len()).all(|i| tree.parent(i) == i.checked_sub(1))
}

/// A tree made of `chain` (roots first, each the parent of the next) with `tree`'s roots hung
/// below the chain's last token; just `tree` when the chain is empty.
fn chain_then_tree(chain: &[u32], tree: &TokenTree) -> Result<TokenTree, EngineError> {
    let mut t = TokenTree::new();
    let mut parent: Option<usize> = None;
    let bad = |e: specsplit_core::tree::TreeError| EngineError::InvalidArgument(e.to_string());
    for &tok in chain {
        parent = Some(
            match parent {
                None => t.push_root(tok, 0.0),
                Some(p) => t.push_child(p, tok, 0.0),
            }
            .map_err(bad)?,
        );
    }
    let offset = t.len();
    for i in 0..tree.len() {
        let par = match tree.parent(i) {
            Some(p) => Some(p + offset),
            None => parent,
        };
        match par {
            None => t.push_root(tree.token(i), 0.0),
            Some(p) => t.push_child(p, tree.token(i), 0.0),
        }
        .map_err(bad)?;
    }
    Ok(t)
}

/// The target's own greedy continuation of `prompt`, `n` tokens, one plain step at a time in a
/// new session seeded `seed` (a reference for tests).
#[cfg(test)]
pub(crate) fn greedy_continuation(
    engine: &TargetEngine,
    seed: u64,
    prompt: Vec<u32>,
    n: usize,
) -> Vec<u32> {
    let mut s = engine.new_session(seed).unwrap();
    let greedy = SamplingParams::default();
    let none = TokenTree::new();
    let mut o = engine
        .verify(&mut s, Prefix::Full(prompt), &none, &greedy)
        .unwrap();
    let mut cont = Vec::new();
    while cont.len() < n {
        cont.push(o.verdict.next_token);
        let next = Prefix::Delta {
            new_tokens: vec![o.verdict.next_token],
            expected_len: o.cached_len,
        };
        o = engine.verify(&mut s, next, &none, &greedy).unwrap();
    }
    cont
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::{SessionLimits, SessionStore};

    #[test]
    fn keeping_a_path_moves_its_entries_as_the_caches_compaction_does() {
        let m = crate::test_models::tiny_model(3);
        let dev = candle_core::Device::Cpu;
        // A cache of 12 entries, each entry's values its own slot number.
        let filled = || {
            let mut c = m.new_cache(16).unwrap();
            for layer in 0..m.config().num_hidden_layers {
                let (k, _) = c.buffers(layer).unwrap();
                let (_, kv, _, hd) = k.dims4().unwrap();
                let x = Tensor::arange(0f32, 12.0, &dev)
                    .unwrap()
                    .reshape((1, 1, 12, 1))
                    .unwrap()
                    .broadcast_as((1, kv, 12, hd))
                    .unwrap()
                    .to_dtype(k.dtype())
                    .unwrap();
                let v = (&x + 100.0).unwrap();
                c.append(layer, &x, &v).unwrap();
            }
            c.advance(12).unwrap();
            c
        };
        let contents = |c: &specsplit_core::cache::SessionCache| -> Vec<Vec<f32>> {
            (0..m.config().num_hidden_layers)
                .flat_map(|l| {
                    let (k, v) = c.layer(l);
                    [k, v].map(|t| {
                        t.flatten_all()
                            .unwrap()
                            .to_dtype(DType::F32)
                            .unwrap()
                            .to_vec1()
                            .unwrap()
                    })
                })
                .collect()
        };
        // A path with a node in place, nodes that move, none, and more than one launch moves.
        let many: Vec<usize> = (3..12).collect();
        let spread: Vec<usize> = vec![4, 6, 7, 9, 10, 11];
        let cases = [
            (4, vec![]),
            (4, vec![4]),
            (4, vec![4, 7, 9]),
            (4, vec![5, 8]),
            (4, spread),
            (2, many),
        ];
        for (base, kept) in cases {
            let (mut a, mut b) = (filled(), filled());
            keep_path(&m, &mut a, base, &kept).unwrap();
            b.compact(base, &kept).unwrap();
            assert_eq!(a.len(), base + kept.len(), "{kept:?}");
            assert_eq!(contents(&a), contents(&b), "{kept:?}");
            // Head 0's first value of every entry: the slot it came from.
            let slots: Vec<f32> = a
                .layer(0)
                .0
                .get(0)
                .unwrap()
                .get(0)
                .unwrap()
                .narrow(1, 0, 1)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec1()
                .unwrap();
            let want: Vec<f32> = (0..base)
                .chain(kept.iter().copied())
                .map(|p| p as f32)
                .collect();
            assert_eq!(slots, want, "{kept:?}");
        }
        // A path out of order is refused as the compaction refuses it.
        let mut c = filled();
        assert!(keep_path(&m, &mut c, 4, &[7, 5]).is_err());
        assert!(keep_path(&m, &mut c, 4, &[3]).is_err());
    }

    fn tiny_engine(spares: usize) -> TargetEngine {
        TargetEngine::new(crate::test_models::tiny_model(11), 128).with_spare_sessions(spares)
    }

    /// A chain of `tokens`, or a root with two children when `fork`.
    fn tree(tokens: &[u32], fork: bool) -> TokenTree {
        let mut t = TokenTree::new();
        let mut parent = None;
        for (i, &tok) in tokens.iter().enumerate() {
            let node = match parent {
                None => t.push_root(tok, 0.0),
                Some(p) => t.push_child(p, tok, 0.0),
            }
            .unwrap();
            if !(fork && i > 0) {
                parent = Some(node);
            }
        }
        t
    }

    /// Rounds of verification as an orchestrator sends them: the prompt, then deltas with the
    /// previous round's next token, drafts guessing the target's own continuation `cont` (its
    /// greedy tokens after the prompt) with a wrong token in some rounds.
    fn rounds(e: &TargetEngine, s: &mut TargetSession, cont: &[u32]) -> Vec<(Verdict, usize)> {
        let params = SamplingParams::default();
        let prompt = prompt();
        let p = prompt.len();
        let mut out = Vec::new();
        let o = e
            .verify(s, Prefix::Full(prompt), &tree(&[], false), &params)
            .unwrap();
        let mut next = o.verdict.next_token;
        out.push((o.verdict, o.cached_len));
        for round in 0..6usize {
            // The sequence is prompt + cont[..done] + next; the draft guesses what follows.
            let done = out.last().unwrap().1 - p + 1;
            let mut guess = [cont[done], cont[done + 1], cont[done + 2]];
            guess[round % 3] += u32::from(round % 2 == 1);
            let o = e
                .verify(
                    s,
                    Prefix::Delta {
                        new_tokens: vec![next],
                        expected_len: out.last().unwrap().1,
                    },
                    &tree(&guess, round == 4),
                    &params,
                )
                .unwrap();
            next = o.verdict.next_token;
            out.push((o.verdict, o.cached_len));
        }
        out
    }

    fn prompt() -> Vec<u32> {
        (0..20).map(|i| (i * 37 + 5) % 500).collect()
    }

    #[test]
    fn a_session_whose_cache_grew_verifies_exactly_like_a_full_size_one() {
        // Caches of 4 entries that double as rounds need, against 128 entries up front.
        let grown = tiny_engine(0).with_first_capacity(4);
        let full = tiny_engine(0).with_first_capacity(128);
        assert!(grown.session_bytes() * 32 == full.session_bytes());
        // Target-only greedy decoding: 20 + 60 tokens grow the cache 4 -> 32 -> 64 -> 128.
        let cont = greedy_continuation(&full, 9, prompt(), 60);
        assert_eq!(greedy_continuation(&grown, 9, prompt(), 60), cont);
        // Speculative rounds (chains, a forked tree, rejections) on a growing cache.
        let mut s = grown.new_session(2).unwrap();
        assert_eq!(s.cache.capacity(), 4);
        let a = rounds(&grown, &mut s, &cont);
        assert_eq!(s.cache.capacity(), 64, "the cache grew to the rounds' need");
        assert_eq!(s.charge.bytes(), s.cache.memory_bytes());
        let b = rounds(&full, &mut full.new_session(2).unwrap(), &cont);
        assert_eq!(a, b, "the growing session verified differently");
        assert!(a.iter().any(|(v, _)| !v.accepted_tokens.is_empty()));
    }

    /// A store with room for `sessions` sessions and `budget` bytes.
    fn store(sessions: usize, budget: usize) -> SessionStore<TargetSession> {
        SessionStore::new(SessionLimits {
            max_sessions: sessions,
            memory_budget_bytes: budget,
            ttl: Duration::from_secs(600),
        })
    }

    #[test]
    fn sessions_are_charged_what_their_caches_hold_not_max_context() {
        let e = tiny_engine(0).with_first_capacity(32);
        let full = session_cache_bytes(e.model(), 128);
        assert_eq!(e.session_bytes() * 4, full);
        // A budget of 3 sessions at max_context holds 12 sessions at their first capacity.
        let store = store(100, 3 * full);
        let params = SamplingParams::default();
        let held: Vec<_> = (0..12)
            .map(|i| {
                let (h, created) = store
                    .get_or_create(&format!("s{i}"), e.session_bytes(), |c| {
                        e.new_charged_session(i + 1, c)
                    })
                    .unwrap();
                assert!(created);
                let mut s = h.try_lock().unwrap();
                e.verify(&mut s, Prefix::Full(prompt()), &TokenTree::new(), &params)
                    .unwrap();
                drop(s);
                h
            })
            .collect();
        assert_eq!(store.bytes(), 12 * e.session_bytes());
        // All 12 are busy: a 13th does not fit, and nothing was evicted for it.
        let err = store
            .get_or_create("s12", e.session_bytes(), |c| e.new_charged_session(1, c))
            .map(|_| ())
            .unwrap_err();
        assert!(matches!(err, EngineError::ResourceExhausted(_)), "{err}");
        assert_eq!(store.len(), held.len());
    }

    #[test]
    fn a_spare_larger_than_the_first_capacity_is_charged_at_the_first_request() {
        let e = tiny_engine(1).with_first_capacity(8);
        let small = e.session_bytes();
        let params = SamplingParams::default();
        // A session grows to 32 entries and ends: its body is kept.
        let mut s = e.new_session(1).unwrap();
        e.verify(&mut s, Prefix::Full(prompt()), &TokenTree::new(), &params)
            .unwrap();
        assert_eq!(s.cache_capacity(), 32);
        drop(s);
        assert_eq!(e.spare_sessions(), 1);
        // With room, the next session takes it and is charged its 32 entries at its first
        // request.
        let roomy = store(10, 100 * small);
        let (h, _) = roomy
            .get_or_create("a", small, |c| e.new_charged_session(9, c))
            .unwrap();
        let mut s = h.try_lock().unwrap();
        assert_eq!((s.cache_capacity(), s.charged_bytes()), (32, small));
        e.verify(
            &mut s,
            Prefix::Full(prompt()[..5].to_vec()),
            &TokenTree::new(),
            &params,
        )
        .unwrap();
        assert_eq!((s.cache_capacity(), s.charged_bytes()), (32, 4 * small));
        assert_eq!(roomy.bytes(), 4 * small);
        drop(s);
        drop(h);
        roomy.clear();
        // Without room for it, the session takes a fresh cache its charge covers.
        assert_eq!(e.spare_sessions(), 1);
        let tight = store(10, 2 * small);
        let (h, _) = tight
            .get_or_create("b", small, |c| e.new_charged_session(9, c))
            .unwrap();
        let (_busy, _) = tight
            .get_or_create("c", small, |c| e.new_charged_session(8, c))
            .unwrap();
        let mut s = h.try_lock().unwrap();
        assert_eq!(s.cache_capacity(), 32);
        let o = e
            .verify(&mut s, Prefix::Full(prompt()), &TokenTree::new(), &params)
            .unwrap_err();
        assert!(
            matches!(o, EngineError::ResourceExhausted(_)),
            "20 entries need 32: {o}"
        );
        let o = e
            .verify(
                &mut s,
                Prefix::Full(prompt()[..6].to_vec()),
                &TokenTree::new(),
                &params,
            )
            .unwrap();
        assert_eq!((s.cache_capacity(), s.charged_bytes()), (8, small));
        assert_eq!(tight.bytes(), 2 * small);
        let full = greedy_continuation(&tiny_engine(0), 9, prompt()[..6].to_vec(), 1);
        assert_eq!(o.verdict.next_token, full[0]);
    }

    #[test]
    fn growth_refused_at_the_budget_leaves_the_session_usable_at_its_old_size() {
        let e = tiny_engine(0).with_first_capacity(16);
        let small = e.session_bytes();
        let cont = greedy_continuation(&tiny_engine(0), 9, prompt()[..10].to_vec(), 4);
        // Room for two 16-entry sessions, not for one of them at 32 entries.
        let store = store(10, 2 * small + small / 2);
        let open = |id: &str, seed| {
            store
                .get_or_create(id, small, |c| e.new_charged_session(seed, c))
                .unwrap()
                .0
        };
        let (a, b) = (open("a", 9), open("b", 8));
        let params = SamplingParams::default();
        let mut s = a.try_lock().unwrap();
        let o = e
            .verify(
                &mut s,
                Prefix::Full(prompt()[..10].to_vec()),
                &TokenTree::new(),
                &params,
            )
            .unwrap();
        assert_eq!(o.verdict.next_token, cont[0]);
        // A round of 10 + 1 + 6 entries needs 32; "b" is busy, so the growth is refused.
        let delta = |len| Prefix::Delta {
            new_tokens: vec![cont[len - 10]],
            expected_len: len,
        };
        let err = e
            .verify(
                &mut s,
                delta(10),
                &tree(&[1, 2, 3, 4, 5, 6], false),
                &params,
            )
            .unwrap_err();
        let EngineError::ResourceExhausted(m) = &err else {
            panic!("expected RESOURCE_EXHAUSTED, got {err}");
        };
        assert!(m.contains("raise memory_budget_mb"), "{m}");
        assert_eq!((s.cache.capacity(), s.charge.bytes()), (16, small));
        assert_eq!(store.bytes(), 2 * small);
        // The session still verifies at its old size, exactly.
        let o = e
            .verify(&mut s, delta(10), &TokenTree::new(), &params)
            .unwrap();
        assert_eq!((o.verdict.next_token, o.cached_len), (cont[1], 11));
        // Once "b" is idle, the growth evicts it.
        drop(b);
        // A chain of 6 whose second token is wrong: 11 + 1 + 6 entries.
        let chain = [cont[2], (cont[3] + 1) % 500, 1, 2, 3, 4];
        let o = e
            .verify(&mut s, delta(11), &tree(&chain, false), &params)
            .unwrap();
        assert_eq!(o.verdict.accepted_tokens, [cont[2]]);
        assert_eq!(s.cache.capacity(), 32);
        assert_eq!(
            store.len(),
            1,
            "the idle session was evicted for the growth"
        );
        assert_eq!(store.bytes(), s.cache.memory_bytes());
    }

    #[test]
    fn a_recycled_session_verifies_exactly_like_a_fresh_one() {
        let kept = tiny_engine(1);
        let fresh = tiny_engine(0);
        let cont = greedy_continuation(&fresh, 9, prompt(), 40);
        // A first session fills the cache with another sequence, then ends.
        let mut first = kept.new_session(1).unwrap();
        let long: Vec<u32> = (0..90).map(|i| (i * 11 + 2) % 500).collect();
        kept.verify(
            &mut first,
            Prefix::Full(long),
            &tree(&[1, 2, 3], false),
            &SamplingParams::default(),
        )
        .unwrap();
        drop(first);
        assert_eq!(
            kept.spare_sessions(),
            1,
            "the ended session's body was kept"
        );
        let mut again = kept.new_session(2).unwrap();
        assert_eq!(kept.spare_sessions(), 0);
        assert!(again.tokens().is_empty());
        // A delta on the recycled session finds no sequence: the old one is gone.
        let err = kept
            .verify(
                &mut again,
                Prefix::Delta {
                    new_tokens: vec![5],
                    expected_len: 90,
                },
                &tree(&[], false),
                &SamplingParams::default(),
            )
            .unwrap_err();
        assert!(matches!(err, EngineError::FailedPrecondition(_)), "{err}");
        let a = rounds(&kept, &mut again, &cont);
        let b = rounds(&fresh, &mut fresh.new_session(2).unwrap(), &cont);
        assert_eq!(a, b, "the recycled session verified differently");
        assert!(a.iter().any(|(v, _)| !v.accepted_tokens.is_empty()));
    }
}
