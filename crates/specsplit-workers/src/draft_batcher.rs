//! Batching of the draft worker's level passes across sessions.
//!
//! A draft request first prepares its round on its own ([`DraftEngine::prepare`]: its checks,
//! the causal prefill of its prompt or accepted tokens, and its tree's first level picked),
//! where its worker's [`WorkPlacement`] says, so that a bad request fails before it meets any
//! other and a long prompt holds no other session's draft back. A tree that needs no level
//! pass (depth 1, or every first pick an end of sequence) is answered at once, and so is a
//! greedy chain on the fixed-shape path ([`DraftEngine::with_static_chains`], on by default on
//! CUDA): it is drafted whole, alone, in its preparation, exactly as without batching.
//!
//! The other rounds wait in a queue with their next level's nodes. Each pass takes queued
//! rounds (up to [`BatchLimits`]: sessions, and the rows of their pending levels together),
//! runs their pending levels in one model call ([`DraftEngine::level_pass_sessions`]), and
//! picks each round's next level from its own logits with its own session's random stream. A
//! round whose tree is complete (its depth reached, or an end of sequence on every branch)
//! is answered at once; the others go back to the front of the queue, where the next pass
//! takes them together with rounds that arrived meanwhile: sessions join and leave the lock
//! step at any level. A pass of one round runs the one-session path
//! ([`DraftEngine::level_pass`]). Each session's tree is the one it drafts alone:
//! [`specsplit_models::transformer::Transformer::forward_sessions`] gives each session's
//! logits bit for bit as its pass alone does.
//!
//! As in [`crate::batcher`], there is no batching thread: the request that finds the device
//! free runs the next pass (where the placement says) and answers every round it completes;
//! each queued round holds its session's lock. A round whose caller went away leaves the queue
//! at the next pass (or when its caller's request is dropped), its session's cache cut back to
//! the round's tokens. If a shared pass fails, each of its rounds runs that level alone, so
//! only a bad one fails. Before a pass placed `Inline` that would start only new rounds, the
//! batcher gathers as [`crate::batcher::VerifyBatcher`] does (for at most
//! [`crate::batcher::GATHER_WINDOW`]); a round in the middle of its tree never waits.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use candle_core::Tensor;
use specsplit_core::tree::TokenTree;
use tokio::sync::{oneshot, OwnedMutexGuard};
use tonic::Status;

use crate::batcher::GATHER_WINDOW;
use crate::batcher::{placed, ActiveSessions, BatchLimits, BatchStats, Counters, PassHold};
use crate::draft::{DraftEngine, DraftParams, DraftRound, DraftSession, DraftStats, Prepared};
use crate::service::WorkPlacement;
use crate::session::SessionHandle;
use crate::EngineError;

/// A drafted tree and the passes it grew in.
#[derive(Debug, Clone)]
pub struct BatchedDraft {
    /// The tree.
    pub tree: TokenTree,
    /// What drafting it cost (a shared pass's time counts in full for each of its sessions).
    pub stats: DraftStats,
    /// Sessions in the largest level pass the tree grew in (1: alone, or no level pass).
    pub pass_sessions: usize,
}

/// The answer channel of one queued round.
type Answer = oneshot::Sender<Result<BatchedDraft, EngineError>>;

/// One round waiting for its next level pass: its session (locked), the round, where its
/// answer goes, and the passes it ran in so far.
struct Job {
    session: OwnedMutexGuard<DraftSession>,
    round: DraftRound,
    answer: Answer,
    /// Level passes run so far.
    passes: usize,
    /// Sessions in the largest of them.
    pass_sessions: usize,
}

impl Job {
    /// Answers the caller with the complete tree.
    fn complete(mut self, engine: &DraftEngine) {
        let (tree, stats) = engine.finish(&mut self.session, self.round);
        let _ = self.answer.send(Ok(BatchedDraft {
            tree,
            stats,
            pass_sessions: self.pass_sessions.max(1),
        }));
    }

    /// Answers the caller with `e`; the session's cache holds the round's tokens again.
    fn fail(mut self, engine: &DraftEngine, e: EngineError) {
        engine.abandon(&mut self.session, &self.round);
        let _ = self.answer.send(Err(e));
    }
}

/// The rounds waiting for a pass, oldest first (rounds in the middle of their trees ahead).
type Queue = Arc<Mutex<VecDeque<Job>>>;

/// Locks the queue. Every mutation is whole under the lock: a panic elsewhere cannot leave it
/// half-done.
fn lock(queue: &Queue) -> std::sync::MutexGuard<'_, VecDeque<Job>> {
    queue.lock().unwrap_or_else(|e| e.into_inner())
}

/// Runs the draft rounds of concurrent sessions' requests with their levels in shared model
/// passes (see the module documentation).
pub struct DraftBatcher {
    engine: Arc<DraftEngine>,
    limits: BatchLimits,
    placement: WorkPlacement,
    queue: Queue,
    /// Held while a pass is assembled and runs.
    device: Arc<tokio::sync::Mutex<()>>,
    counters: Arc<Counters>,
    /// When each session last asked for a draft.
    recent: ActiveSessions,
}

impl DraftBatcher {
    /// A batcher over `engine`, its passes bounded by `limits`, its model work placed as
    /// `placement` says.
    pub fn new(engine: Arc<DraftEngine>, limits: BatchLimits, placement: WorkPlacement) -> Self {
        Self {
            engine,
            limits: BatchLimits {
                max_sessions: limits.max_sessions.max(1),
                max_rows: limits.max_rows.max(1),
            },
            placement,
            queue: Queue::default(),
            device: Arc::new(tokio::sync::Mutex::new(())),
            counters: Arc::new(Counters::default()),
            recent: ActiveSessions::default(),
        }
    }

    /// A batcher like this one whose model work is placed as `placement` says (a new queue).
    pub fn placed(&self, placement: WorkPlacement) -> Self {
        Self::new(self.engine.clone(), self.limits, placement)
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<DraftEngine> {
        &self.engine
    }

    /// Where its passes run.
    pub fn placement(&self) -> WorkPlacement {
        self.placement
    }

    /// The limits of one pass.
    pub fn limits(&self) -> BatchLimits {
        self.limits
    }

    /// Rounds waiting for a pass.
    pub fn queued(&self) -> usize {
        lock(&self.queue).len()
    }

    /// The level passes run so far.
    pub fn stats(&self) -> BatchStats {
        self.counters.stats()
    }

    /// Waits for the pass in flight, then holds every later pass back until the returned
    /// hold is dropped; rounds queue up meanwhile and the next pass takes them together.
    pub async fn hold(&self) -> PassHold {
        PassHold(self.device.clone().lock_owned().await)
    }

    /// Drafts a tree continuing `tokens` for `session` as `params` say: prepares the round
    /// alone, then runs its levels in the passes that take them.
    pub async fn draft(
        &self,
        session: SessionHandle<DraftSession>,
        tokens: Vec<u32>,
        params: DraftParams,
    ) -> Result<BatchedDraft, Status> {
        self.recent.note(Arc::as_ptr(&session) as usize);
        let session = session.lock_owned().await;
        let engine = self.engine.clone();
        let (session, prepared) = placed(self.placement, move || {
            let mut session = session;
            let prepared = engine.prepare(&mut session, &tokens, params);
            (session, prepared)
        })
        .await?;
        let round = match prepared.map_err(Status::from)? {
            Prepared::Drafted(tree, stats) => {
                return Ok(BatchedDraft {
                    tree,
                    stats,
                    pass_sessions: 1,
                })
            }
            Prepared::Levels(round) => round,
        };
        // Declared before the answer's receiver, so dropped after it: a request dropped while
        // its round waits takes the round out of the queue, freeing its session.
        let _sweep = Sweep(self);
        let (answer, mut answered) = oneshot::channel();
        let job = Job {
            session,
            round,
            answer,
            passes: 0,
            pass_sessions: 0,
        };
        if job.round.is_complete() {
            job.complete(&self.engine);
        } else {
            lock(&self.queue).push_back(job);
        }
        loop {
            tokio::select! {
                biased;
                r = &mut answered => {
                    return r
                        .map_err(|_| Status::internal("worker task failed: the draft pass stopped"))?
                        .map_err(Status::from);
                }
                turn = self.device.clone().lock_owned() => {
                    self.gather().await;
                    self.run_next(turn)
                }
            }
        }
    }

    /// Before a pass placed `Inline` that would start only new rounds: lets the thread read
    /// requests until as many rounds are queued as the last pass held or as sessions asked
    /// for drafts lately (at most the pass limit), for at most [`GATHER_WINDOW`].
    async fn gather(&self) {
        if self.placement != WorkPlacement::Inline {
            return;
        }
        let expected = self
            .counters
            .last_sessions()
            .max(self.recent.count())
            .min(self.limits.max_sessions);
        if expected <= 1 || lock(&self.queue).iter().any(|j| j.passes > 0) {
            return;
        }
        let deadline = Instant::now() + GATHER_WINDOW;
        while self.queued() < expected && Instant::now() < deadline {
            tokio::task::yield_now().await;
        }
    }

    /// The queued rounds of the next pass, in queue order, within the limits (at least one
    /// when any is queued). Rounds whose caller went away are dropped, their sessions' caches
    /// cut back to the rounds' tokens.
    fn take_batch(&self) -> Vec<Job> {
        let mut queue = lock(&self.queue);
        let mut batch: Vec<Job> = Vec::new();
        let mut rows = 0;
        while let Some(job) = queue.front() {
            if job.answer.is_closed() {
                if let Some(mut job) = queue.pop_front() {
                    self.engine.abandon(&mut job.session, &job.round);
                }
                continue;
            }
            let r = job.round.pass_rows();
            let full = batch.len() >= self.limits.max_sessions
                || (!batch.is_empty() && rows + r > self.limits.max_rows);
            if full {
                break;
            }
            rows += r;
            batch.extend(queue.pop_front());
        }
        batch
    }

    /// Runs the next pass, holding `turn` until it ends, where the placement says (as
    /// [`crate::batcher::VerifyBatcher`] does). A panic fails the pass's rounds (INTERNAL) and
    /// nothing else.
    fn run_next(&self, turn: OwnedMutexGuard<()>) {
        let batch = self.take_batch();
        if batch.is_empty() {
            return;
        }
        let (engine, counters, queue) = (
            self.engine.clone(),
            self.counters.clone(),
            self.queue.clone(),
        );
        let work = move || {
            let unfinished = run_pass(&engine, &counters, batch);
            let mut queue = lock(&queue);
            for mut job in unfinished.into_iter().rev() {
                if job.answer.is_closed() {
                    // Its caller went away during the pass.
                    engine.abandon(&mut job.session, &job.round);
                } else {
                    queue.push_front(job);
                }
            }
            drop(queue);
            drop(turn);
        };
        let caught = |work: Box<dyn FnOnce() + Send>| {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).is_err() {
                tracing::error!("a draft pass panicked; its rounds failed");
            }
        };
        let multi_thread = tokio::runtime::Handle::current().runtime_flavor()
            == tokio::runtime::RuntimeFlavor::MultiThread;
        match self.placement {
            WorkPlacement::Inline => caught(Box::new(work)),
            WorkPlacement::Pool if multi_thread => {
                tokio::task::block_in_place(|| caught(Box::new(work)))
            }
            WorkPlacement::Pool => {
                tokio::task::spawn_blocking(move || caught(Box::new(work)));
            }
        }
    }
}

/// Takes the rounds of its batcher's dropped requests out of the queue when dropped.
struct Sweep<'a>(&'a DraftBatcher);

impl Drop for Sweep<'_> {
    fn drop(&mut self) {
        let b = self.0;
        let mut queue = lock(&b.queue);
        let mut kept = VecDeque::with_capacity(queue.len());
        for mut job in queue.drain(..) {
            if job.answer.is_closed() {
                b.engine.abandon(&mut job.session, &job.round);
            } else {
                kept.push_back(job);
            }
        }
        *queue = kept;
    }
}

/// One pass: runs the members' pending levels together, picks each one's next level, answers
/// those whose trees are complete (or failed); returns the others, in order.
fn run_pass(engine: &DraftEngine, counters: &Counters, mut members: Vec<Job>) -> Vec<Job> {
    let sessions = members.len();
    counters.pass(sessions);
    let t0 = Instant::now();
    // Each member's logits, the time of the pass that gave them and its sessions.
    let logits: Vec<(Result<Tensor, EngineError>, Duration, usize)> = if sessions == 1 {
        let m = &mut members[0];
        let l = engine.level_pass(&mut m.session, &m.round);
        vec![(l, t0.elapsed(), 1)]
    } else {
        let shared = {
            let mut parts: Vec<_> = members
                .iter_mut()
                .map(|m| (&mut *m.session, &m.round))
                .collect();
            engine.level_pass_sessions(&mut parts)
        };
        match shared {
            Ok(l) => {
                let elapsed = t0.elapsed();
                l.into_iter().map(|l| (Ok(l), elapsed, sessions)).collect()
            }
            Err(e) => {
                // Which member made the shared pass fail is unknown: each runs again alone, so
                // only a bad one fails.
                tracing::warn!(
                    "a draft pass of {sessions} sessions failed ({e}); running each alone"
                );
                members
                    .iter_mut()
                    .map(|m| {
                        counters.pass(1);
                        let t0 = Instant::now();
                        let l = engine.level_pass(&mut m.session, &m.round);
                        (l, t0.elapsed(), 1)
                    })
                    .collect()
            }
        }
    };
    let mut unfinished = Vec::new();
    for (mut m, (l, elapsed, shared)) in members.into_iter().zip(logits) {
        m.passes += 1;
        m.pass_sessions = m.pass_sessions.max(shared);
        match l.and_then(|l| engine.take_level(&mut m.session, &mut m.round, l, elapsed)) {
            Err(e) => m.fail(engine, e),
            Ok(()) if m.round.is_complete() => m.complete(engine),
            Ok(()) => unfinished.push(m),
        }
    }
    unfinished
}
