//! Continuous batching of verification across sessions.
//!
//! Verification requests of different sessions that become ready while a pass runs wait in a
//! queue; the next pass takes every queued request (up to [`BatchLimits`]), prepares each
//! session alone ([`TargetEngine::prepare`]: its checks, and a prompt's causal prefill), runs
//! the round's rows of all of them in one model call ([`TargetEngine::pass_sessions`]), then
//! finishes each ([`TargetEngine::finish`]) and answers each request on its own. A pass of one
//! session runs the one-session path ([`TargetEngine::pass`], with its captured graphs).
//!
//! There is no batching thread: the request that finds the device free runs the next pass
//! (where its worker's [`WorkPlacement`] says) and answers every request in it; the others
//! wait for their answer or for their turn to run the next pass. Each queued request holds its
//! session's lock, so one session has at most one request in a pass. A request whose caller
//! went away before its pass is dropped from the queue untouched; once in a pass, its round
//! runs to the end (the session stays whole) and the answer is discarded.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use specsplit_core::sampling::SamplingParams;
use specsplit_core::tree::TokenTree;
use tokio::sync::{oneshot, OwnedMutexGuard};
use tonic::Status;

use crate::service::WorkPlacement;
use crate::session::SessionHandle;
use crate::target::{Prefix, PreparedRound, TargetEngine, TargetSession, VerifyOutcome};
use crate::EngineError;

/// How much one multi-session pass takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// Most sessions in one pass (1: every session's pass runs alone, one after another).
    pub max_sessions: usize,
    /// Most rows in one pass (each session's last new token and tree nodes); a request with
    /// more rows than this runs alone.
    pub max_rows: usize,
}

/// What a verification round asks for (a `VerifyDrafts` request, checked).
#[derive(Debug, Clone)]
pub struct RoundRequest {
    /// The sequence before the tree.
    pub prefix: Prefix,
    /// The draft tree.
    pub tree: TokenTree,
    /// How the target's tokens are chosen.
    pub params: SamplingParams,
    /// Whether to return the emitted tokens' log-probabilities.
    pub logprobs: bool,
}

impl RoundRequest {
    /// Rows the request's pass runs at most: its last new token and the tree's nodes (a
    /// prompt's earlier tokens are prefilled alone).
    fn pass_rows(&self) -> usize {
        let new = match &self.prefix {
            Prefix::Full(_) => 1,
            Prefix::Delta { new_tokens, .. } => usize::from(!new_tokens.is_empty()),
        };
        new + self.tree.len()
    }
}

/// A verified round and the pass it ran in.
#[derive(Debug, Clone)]
pub struct BatchedOutcome {
    /// The round's outcome.
    pub outcome: VerifyOutcome,
    /// Sessions whose rows ran in the same model pass (1: alone).
    pub pass_sessions: usize,
}

/// Counts of the passes a [`VerifyBatcher`] ran.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Model passes run (a round answered from pending logits runs none).
    pub passes: u64,
    /// Of them, passes over the rows of more than one session.
    pub multi_session_passes: u64,
    /// Sessions in the largest pass.
    pub most_sessions: u64,
}

#[derive(Default)]
struct Counters {
    passes: AtomicU64,
    multi_session_passes: AtomicU64,
    most_sessions: AtomicU64,
}

impl Counters {
    fn pass(&self, sessions: usize) {
        if sessions == 0 {
            return;
        }
        self.passes.fetch_add(1, Ordering::Relaxed);
        if sessions > 1 {
            self.multi_session_passes.fetch_add(1, Ordering::Relaxed);
        }
        self.most_sessions
            .fetch_max(sessions as u64, Ordering::Relaxed);
    }
}

/// The answer channel of one queued request.
type Answer = oneshot::Sender<Result<BatchedOutcome, EngineError>>;

/// One queued request: its session (locked), what it asks, where its answer goes.
struct Job {
    session: OwnedMutexGuard<TargetSession>,
    request: RoundRequest,
    answer: Answer,
}

/// A request whose round is prepared, waiting for its pass.
struct Member {
    session: OwnedMutexGuard<TargetSession>,
    request: RoundRequest,
    answer: Answer,
    round: PreparedRound,
}

/// Runs the verification rounds of concurrent sessions in shared model passes (see the
/// module documentation).
pub struct VerifyBatcher {
    engine: Arc<TargetEngine>,
    limits: BatchLimits,
    placement: WorkPlacement,
    queue: Mutex<VecDeque<Job>>,
    /// Held while a pass is assembled and runs.
    device: Arc<tokio::sync::Mutex<()>>,
    counters: Arc<Counters>,
}

/// Holds every pass of a [`VerifyBatcher`] back until dropped (requests queue up meanwhile).
pub struct PassHold(#[allow(dead_code)] OwnedMutexGuard<()>);

impl VerifyBatcher {
    /// A batcher over `engine`, its passes bounded by `limits`, its model work placed as
    /// `placement` says.
    pub fn new(engine: Arc<TargetEngine>, limits: BatchLimits, placement: WorkPlacement) -> Self {
        Self {
            engine,
            limits: BatchLimits {
                max_sessions: limits.max_sessions.max(1),
                max_rows: limits.max_rows.max(1),
            },
            placement,
            queue: Mutex::new(VecDeque::new()),
            device: Arc::new(tokio::sync::Mutex::new(())),
            counters: Arc::new(Counters::default()),
        }
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<TargetEngine> {
        &self.engine
    }

    /// The limits of one pass.
    pub fn limits(&self) -> BatchLimits {
        self.limits
    }

    /// Requests waiting for a pass.
    pub fn queued(&self) -> usize {
        self.lock_queue().len()
    }

    /// The passes run so far.
    pub fn stats(&self) -> BatchStats {
        let c = &self.counters;
        BatchStats {
            passes: c.passes.load(Ordering::Relaxed),
            multi_session_passes: c.multi_session_passes.load(Ordering::Relaxed),
            most_sessions: c.most_sessions.load(Ordering::Relaxed),
        }
    }

    /// Waits for the pass in flight, then holds every later pass back until the returned
    /// hold is dropped; requests queue up meanwhile and the next pass takes them together.
    pub async fn hold(&self) -> PassHold {
        PassHold(self.device.clone().lock_owned().await)
    }

    fn lock_queue(&self) -> std::sync::MutexGuard<'_, VecDeque<Job>> {
        // Every mutation is one push or pop: a panic elsewhere cannot leave it half-done.
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Verifies one round of `session` in the next pass that takes it.
    pub async fn verify(
        &self,
        session: SessionHandle<TargetSession>,
        request: RoundRequest,
    ) -> Result<BatchedOutcome, Status> {
        let session = session.lock_owned().await;
        let (answer, mut answered) = oneshot::channel();
        self.lock_queue().push_back(Job {
            session,
            request,
            answer,
        });
        loop {
            tokio::select! {
                biased;
                r = &mut answered => {
                    return r
                        .map_err(|_| Status::internal("worker task failed: the verification pass stopped"))?
                        .map_err(Status::from);
                }
                turn = self.device.clone().lock_owned() => self.run_next(turn),
            }
        }
    }

    /// The queued requests of the next pass, oldest first, within the limits (at least one
    /// when any is queued). Requests whose caller went away are dropped, their sessions
    /// untouched.
    fn take_batch(&self) -> Vec<Job> {
        let mut queue = self.lock_queue();
        let mut batch: Vec<Job> = Vec::new();
        let mut rows = 0;
        while let Some(job) = queue.front() {
            if job.answer.is_closed() {
                queue.pop_front();
                continue;
            }
            let r = job.request.pass_rows();
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

    /// Runs the next pass, holding `turn` until it ends, where the placement says: here
    /// (`Inline`, or `Pool` under `block_in_place` on a multi-thread runtime) or on the
    /// blocking pool (`Pool` on a current-thread runtime), whose pass answers its requests
    /// itself. A panic fails the pass's requests (INTERNAL) and nothing else.
    fn run_next(&self, turn: OwnedMutexGuard<()>) {
        let batch = self.take_batch();
        if batch.is_empty() {
            return;
        }
        let (engine, counters) = (self.engine.clone(), self.counters.clone());
        let work = move || {
            run_pass(&engine, &counters, batch);
            drop(turn);
        };
        let caught = |work: Box<dyn FnOnce() + Send>| {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).is_err() {
                tracing::error!("a verification pass panicked; its requests failed");
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

/// One pass: prepares each job's round alone (a refused one is answered at once), runs the
/// prepared rounds' rows together, finishes and answers each.
fn run_pass(engine: &TargetEngine, counters: &Counters, batch: Vec<Job>) {
    let mut members = Vec::with_capacity(batch.len());
    for job in batch {
        let Job {
            mut session,
            request,
            answer,
        } = job;
        match engine.prepare(&mut session, request.prefix.clone(), &request.tree) {
            Ok(round) => members.push(Member {
                session,
                request,
                answer,
                round,
            }),
            Err(e) => {
                let _ = answer.send(Err(e));
            }
        }
    }
    let sessions = members.len();
    counters.pass(sessions);
    if sessions == 1 {
        let logits = {
            let m = &mut members[0];
            engine.pass(&mut m.session, &m.round, &m.request.tree)
        };
        finish(engine, members.pop().expect("one member"), logits, 1);
        return;
    }
    let logits = {
        let mut parts: Vec<_> = members
            .iter_mut()
            .map(|m| (&mut *m.session, &m.round, &m.request.tree))
            .collect();
        engine.pass_sessions(&mut parts)
    };
    match logits {
        Ok(logits) => {
            for (m, l) in members.into_iter().zip(logits) {
                finish(engine, m, Ok(l), sessions);
            }
        }
        Err(e) => {
            // Which member made the shared pass fail is unknown: each runs again alone, so
            // only a bad one fails.
            tracing::warn!("a pass of {sessions} sessions failed ({e}); running each alone");
            for mut m in members {
                let logits = engine.pass(&mut m.session, &m.round, &m.request.tree);
                counters.pass(1);
                finish(engine, m, logits, 1);
            }
        }
    }
}

/// Finishes `m`'s round with the logits of its pass (of `sessions` sessions) and answers it.
fn finish(
    engine: &TargetEngine,
    mut m: Member,
    logits: Result<candle_core::Tensor, EngineError>,
    sessions: usize,
) {
    let out = logits.and_then(|l| {
        engine.finish(
            &mut m.session,
            m.round,
            &m.request.tree,
            &l,
            &m.request.params,
            m.request.logprobs,
        )
    });
    let _ = m.answer.send(out.map(|outcome| BatchedOutcome {
        outcome,
        pass_sessions: sessions,
    }));
}
