//! The queue and the turn that the batchers of a worker share the device through.
//!
//! A [`PassQueue`] owns what cross-session batching of model passes needs whatever a pass
//! does: the queue of jobs (one session's work each, waiting for a pass), the turn (whose
//! holder assembles and runs the next pass; [`PassQueue::hold`] keeps it), the pass counters
//! ([`BatchStats`]), the gathering of an `Inline` pass ([`GATHER_WINDOW`], [`ACTIVE_WINDOW`]),
//! taking a batch within [`BatchLimits`] and running the pass where its [`WorkPlacement`] says.
//! What a pass does with its members, and how a job completes or fails, is its job type's
//! ([`PassJob`]).
//!
//! There is no batching thread: a caller waits for its answer ([`PassQueue::await_answer`]),
//! and whichever waiting caller finds the turn free runs the next pass. A job whose caller
//! went away leaves the queue at the next pass ([`PassJob::abandon`]); once in a pass, it runs
//! to the end of that pass.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, OwnedMutexGuard};
use tonic::Status;

use crate::service::WorkPlacement;
use crate::session::SessionHandle;
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

/// Counts of the passes a batcher ran.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BatchStats {
    /// Passes run (each over one or more queued rounds).
    pub passes: u64,
    /// Of them, passes over the rows of more than one session.
    pub multi_session_passes: u64,
    /// Sessions in the largest pass.
    pub most_sessions: u64,
}

/// Holds every pass of a batcher back until dropped (requests queue up meanwhile).
pub struct PassHold(#[allow(dead_code)] OwnedMutexGuard<()>);

/// Longest wait of a pass for the rounds of the sessions that shared the last pass.
pub const GATHER_WINDOW: Duration = Duration::from_micros(500);

/// How recently a session must have asked for a round to be waited for by a gathering pass.
pub const ACTIVE_WINDOW: Duration = Duration::from_millis(50);

/// One session's work waiting in a [`PassQueue`], and what a pass does with it.
pub(crate) trait PassJob: Sized + Send + 'static {
    /// The engine the passes run on.
    type Engine: Send + Sync + 'static;
    /// What a pass is called in messages ("verification", "draft").
    const PASS: &'static str;

    /// Rows the job's next pass runs.
    fn rows(&self) -> usize;

    /// Whether the job's caller went away (its answer has no receiver).
    fn is_abandoned(&self) -> bool;

    /// Drops a job whose caller went away, its session left as the job found it.
    fn abandon(self, engine: &Self::Engine);

    /// Whether the job ran passes already: no pass waits to gather while such a job is queued.
    fn in_progress(&self) -> bool {
        false
    }

    /// Runs one pass over `members` (counted in `counters`), answers each member it
    /// completes or fails, and returns the others, in order, for the next pass.
    fn run_pass(engine: &Self::Engine, counters: &PassCounters, members: Vec<Self>) -> Vec<Self>;
}

/// The pass counters of a batcher.
#[derive(Default)]
pub(crate) struct PassCounters {
    passes: AtomicU64,
    multi_session_passes: AtomicU64,
    most_sessions: AtomicU64,
    /// Sessions of the last pass.
    last_sessions: AtomicU64,
}

impl PassCounters {
    /// Counts a pass of `sessions` sessions.
    pub(crate) fn pass(&self, sessions: usize) {
        if sessions == 0 {
            return;
        }
        self.passes.fetch_add(1, Ordering::Relaxed);
        self.last_sessions.store(sessions as u64, Ordering::Relaxed);
        if sessions > 1 {
            self.multi_session_passes.fetch_add(1, Ordering::Relaxed);
        }
        self.most_sessions
            .fetch_max(sessions as u64, Ordering::Relaxed);
    }

    /// Sessions of the last pass.
    fn last_sessions(&self) -> usize {
        self.last_sessions.load(Ordering::Relaxed) as usize
    }

    /// The counts so far.
    fn stats(&self) -> BatchStats {
        BatchStats {
            passes: self.passes.load(Ordering::Relaxed),
            multi_session_passes: self.multi_session_passes.load(Ordering::Relaxed),
            most_sessions: self.most_sessions.load(Ordering::Relaxed),
        }
    }
}

/// When each session (by its handle's address) last asked for work, within
/// [`ACTIVE_WINDOW`].
#[derive(Default)]
struct ActiveSessions(Mutex<HashMap<usize, Instant>>);

impl ActiveSessions {
    /// Notes that the session at `key` asked for work now.
    fn note(&self, key: usize) {
        let mut recent = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        recent.retain(|_, &mut t| now.duration_since(t) < ACTIVE_WINDOW);
        recent.insert(key, now);
    }

    /// Sessions that asked for work within the last [`ACTIVE_WINDOW`].
    fn count(&self) -> usize {
        let recent = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        recent
            .values()
            .filter(|&&t| now.duration_since(t) < ACTIVE_WINDOW)
            .count()
    }
}

/// The jobs waiting for a pass, oldest first (jobs in the middle of their work ahead).
type Queue<J> = Arc<Mutex<VecDeque<J>>>;

/// Locks a queue. Every mutation is whole under the lock: a panic elsewhere cannot leave it
/// half-done.
fn lock<J>(queue: &Queue<J>) -> MutexGuard<'_, VecDeque<J>> {
    queue.lock().unwrap_or_else(|e| e.into_inner())
}

/// Jobs of concurrent sessions waiting for shared passes on one engine, and the turn to run
/// the next pass (see the module documentation).
pub(crate) struct PassQueue<J: PassJob> {
    engine: Arc<J::Engine>,
    limits: BatchLimits,
    placement: WorkPlacement,
    queue: Queue<J>,
    /// Held while a pass is assembled and runs.
    turn: Arc<tokio::sync::Mutex<()>>,
    counters: Arc<PassCounters>,
    /// When each session last asked for work.
    recent: ActiveSessions,
}

impl<J: PassJob> PassQueue<J> {
    /// A queue for passes on `engine`, bounded by `limits` (each at least 1), placed as
    /// `placement` says.
    pub(crate) fn new(
        engine: Arc<J::Engine>,
        limits: BatchLimits,
        placement: WorkPlacement,
    ) -> Self {
        Self {
            engine,
            limits: BatchLimits {
                max_sessions: limits.max_sessions.max(1),
                max_rows: limits.max_rows.max(1),
            },
            placement,
            queue: Queue::default(),
            turn: Arc::new(tokio::sync::Mutex::new(())),
            counters: Arc::new(PassCounters::default()),
            recent: ActiveSessions::default(),
        }
    }

    /// A queue like this one (engine and limits) placed as `placement` says: a new queue.
    pub(crate) fn placed(&self, placement: WorkPlacement) -> Self {
        Self::new(self.engine.clone(), self.limits, placement)
    }

    /// The engine.
    pub(crate) fn engine(&self) -> &Arc<J::Engine> {
        &self.engine
    }

    /// Where its passes run.
    pub(crate) fn placement(&self) -> WorkPlacement {
        self.placement
    }

    /// The limits of one pass.
    pub(crate) fn limits(&self) -> BatchLimits {
        self.limits
    }

    /// Jobs waiting for a pass.
    pub(crate) fn queued(&self) -> usize {
        self.lock().len()
    }

    /// The passes run so far.
    pub(crate) fn stats(&self) -> BatchStats {
        self.counters.stats()
    }

    /// Waits for the pass in flight, then holds every later pass back until the returned
    /// hold is dropped; jobs queue up meanwhile and the next pass takes them together.
    pub(crate) async fn hold(&self) -> PassHold {
        PassHold(self.turn.clone().lock_owned().await)
    }

    /// Prepares a job of `session` alone: notes that the session asked for work, locks it
    /// (its job holds the lock until answered) and runs `prepare` on it where the placement
    /// says. A panic in `prepare` is answered INTERNAL.
    pub(crate) async fn prepare<S, R>(
        &self,
        session: SessionHandle<S>,
        prepare: impl FnOnce(&J::Engine, &mut S) -> R + Send + 'static,
    ) -> Result<(OwnedMutexGuard<S>, R), Status>
    where
        S: Send + 'static,
        R: Send + 'static,
    {
        self.recent.note(Arc::as_ptr(&session) as usize);
        let mut session = session.lock_owned().await;
        let engine = self.engine.clone();
        placed(self.placement, move || {
            let prepared = prepare(&engine, &mut session);
            (session, prepared)
        })
        .await
    }

    /// The queued jobs, locked.
    pub(crate) fn lock(&self) -> MutexGuard<'_, VecDeque<J>> {
        lock(&self.queue)
    }

    /// Queues `job` behind the others.
    pub(crate) fn push(&self, job: J) {
        self.lock().push_back(job);
    }

    /// Takes the jobs whose callers went away out of the queue.
    pub(crate) fn drop_abandoned(&self) {
        let mut queue = self.lock();
        let mut kept = VecDeque::with_capacity(queue.len());
        for job in queue.drain(..) {
            if job.is_abandoned() {
                job.abandon(&self.engine);
            } else {
                kept.push_back(job);
            }
        }
        *queue = kept;
    }

    /// Waits for `answered`, running the next pass whenever the turn is free meanwhile.
    pub(crate) async fn await_answer<T>(
        &self,
        answered: &mut oneshot::Receiver<Result<T, EngineError>>,
    ) -> Result<T, Status> {
        loop {
            tokio::select! {
                biased;
                r = &mut *answered => {
                    return r
                        .map_err(|_| {
                            Status::internal(format!("worker task failed: the {} pass stopped", J::PASS))
                        })?
                        .map_err(Status::from);
                }
                turn = self.turn.clone().lock_owned() => {
                    self.gather().await;
                    self.run_next(turn)
                }
            }
        }
    }

    /// Before a pass placed `Inline` (elsewhere requests are read while a pass runs) that
    /// would start only new jobs: lets the thread read requests until as many jobs are queued
    /// as the last pass held or as sessions asked for work lately (at most the pass limit),
    /// for at most [`GATHER_WINDOW`]. Jobs of sessions that shared the last pass arrive just
    /// after its answers.
    async fn gather(&self) {
        if self.placement != WorkPlacement::Inline {
            return;
        }
        let expected = self
            .counters
            .last_sessions()
            .max(self.recent.count())
            .min(self.limits.max_sessions);
        if expected <= 1 || self.lock().iter().any(J::in_progress) {
            return;
        }
        let deadline = Instant::now() + GATHER_WINDOW;
        while self.queued() < expected && Instant::now() < deadline {
            tokio::task::yield_now().await;
        }
    }

    /// The queued jobs of the next pass, in queue order, within the limits (at least one when
    /// any is queued). Jobs whose callers went away are abandoned.
    fn take_batch(&self) -> Vec<J> {
        let mut queue = self.lock();
        let mut batch: Vec<J> = Vec::new();
        let mut rows = 0;
        while let Some(job) = queue.front() {
            if job.is_abandoned() {
                if let Some(job) = queue.pop_front() {
                    job.abandon(&self.engine);
                }
                continue;
            }
            let r = job.rows();
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
    /// blocking pool (`Pool` on a current-thread runtime), whose pass answers its jobs itself.
    /// The jobs the pass leaves unfinished go back to the front of the queue, in order (those
    /// whose callers went away meanwhile are abandoned). A panic fails the pass's jobs
    /// (INTERNAL) and nothing else.
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
            let unfinished = J::run_pass(&engine, &counters, batch);
            if !unfinished.is_empty() {
                let mut queue = lock(&queue);
                for job in unfinished.into_iter().rev() {
                    if job.is_abandoned() {
                        job.abandon(&engine);
                    } else {
                        queue.push_front(job);
                    }
                }
            }
            drop(turn);
        };
        let caught = |work: Box<dyn FnOnce() + Send>| {
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(work)).is_err() {
                tracing::error!("a {} pass panicked; its requests failed", J::PASS);
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

/// Runs `f` where `placement` says: here (`Inline`), under `block_in_place` (`Pool` on a
/// multi-thread runtime) or on the blocking pool (`Pool` on a current-thread runtime). A panic
/// in `f` is answered INTERNAL.
async fn placed<T: Send + 'static>(
    placement: WorkPlacement,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Status> {
    let failed = |e: &dyn std::fmt::Display| Status::internal(format!("worker task failed: {e}"));
    let caught = |f: Box<dyn FnOnce() -> T + Send>| {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
            .map_err(|_| failed(&"the model work panicked"))
    };
    let multi_thread = tokio::runtime::Handle::current().runtime_flavor()
        == tokio::runtime::RuntimeFlavor::MultiThread;
    match placement {
        WorkPlacement::Inline => caught(Box::new(f)),
        WorkPlacement::Pool if multi_thread => tokio::task::block_in_place(|| caught(Box::new(f))),
        WorkPlacement::Pool => tokio::task::spawn_blocking(f).await.map_err(|e| failed(&e)),
    }
}

/// The public accessors of a batcher whose field `queue` is a [`PassQueue`] over `$engine`:
/// `engine`, `placement`, `limits`, `queued`, `stats` and `hold`. Invoked in the batcher's
/// `impl` block.
macro_rules! batcher_methods {
    ($engine:ty) => {
        /// The engine.
        pub fn engine(&self) -> &std::sync::Arc<$engine> {
            self.queue.engine()
        }

        /// Where its passes run.
        pub fn placement(&self) -> $crate::service::WorkPlacement {
            self.queue.placement()
        }

        /// The limits of one pass.
        pub fn limits(&self) -> $crate::pass_queue::BatchLimits {
            self.queue.limits()
        }

        /// Requests waiting for a pass.
        pub fn queued(&self) -> usize {
            self.queue.queued()
        }

        /// The passes run so far.
        pub fn stats(&self) -> $crate::pass_queue::BatchStats {
            self.queue.stats()
        }

        /// Waits for the pass in flight, then holds every later pass back until the returned
        /// hold is dropped; requests queue up meanwhile and the next pass takes them together.
        pub async fn hold(&self) -> $crate::pass_queue::PassHold {
            self.queue.hold().await
        }
    };
}
pub(crate) use batcher_methods;
