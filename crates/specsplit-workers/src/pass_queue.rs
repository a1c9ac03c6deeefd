//! The queue and the turn that the batchers of a worker share the device through.
//!
//! A [`PassQueue`] owns what cross-session batching of model passes needs whatever a pass
//! does: the queue of jobs (one session's work each, waiting for a pass), the turn (whose
//! holder assembles and runs the next pass; [`PassQueue::hold`] keeps it), the pass counters
//! ([`BatchStats`]), the gathering of an `Inline` pass ([`GATHER_WINDOW`], [`ACTIVE_WINDOW`], and
//! the sessions out of step that are due: [`PassQueue::gather`]),
//! taking a batch within [`BatchLimits`] and running the pass where its [`WorkPlacement`] says.
//! What a pass does with its members, and how a job completes or fails, is its job type's
//! ([`PassJob`]).
//!
//! There is no batching thread: a caller waits for its answer ([`PassQueue::await_answer`]),
//! and whichever waiting caller finds the turn free runs the next pass. A job whose caller
//! went away leaves the queue at the next pass ([`PassJob::abandon`]); once in a pass, it runs
//! to the end of that pass.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
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

/// Weight of a new interval in a session's running mean of the intervals between its requests.
const INTERVAL_WEIGHT: f64 = 0.25;

/// A pass waits for sessions due within this many times as long as the last pass took (see
/// [`PassQueue::gather`]).
const DUE_PASSES: u32 = 2;

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

/// A session that is no longer held anywhere (ended, evicted) fails to upgrade.
type Alive = Weak<dyn Any + Send + Sync>;

/// When a session last asked for work, and its running mean interval between requests.
#[derive(Clone)]
struct Asked {
    at: Instant,
    /// `None` until a second request within [`ACTIVE_WINDOW`] of the first.
    interval: Option<Duration>,
    /// The session, while it lives: an ended session is neither counted nor waited for.
    alive: Alive,
}

impl Asked {
    /// Whether the session is still held (not ended).
    fn alive(&self) -> bool {
        self.alive.strong_count() > 0
    }
}

/// When each session (by its handle's address) last asked for work, within
/// [`ACTIVE_WINDOW`], and how often it asks.
#[derive(Default)]
struct ActiveSessions(Mutex<HashMap<usize, Asked>>);

impl ActiveSessions {
    /// Notes that the session at `key`, `alive` while it lives, asked for work now.
    fn note(&self, key: usize, alive: Alive) {
        self.note_at(key, alive, Instant::now());
    }

    /// Notes that the session at `key`, `alive` while it lives, asked for work at `now`.
    fn note_at(&self, key: usize, alive: Alive, now: Instant) {
        let mut recent = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let last = recent.get(&key).map(|a| (a.at, a.interval));
        recent.retain(|_, a| now.saturating_duration_since(a.at) < ACTIVE_WINDOW && a.alive());
        let interval = match last {
            Some((at, mean)) if now.saturating_duration_since(at) < ACTIVE_WINDOW => {
                let x = now.saturating_duration_since(at);
                Some(mean.map_or(x, |m| {
                    m.mul_f64(1.0 - INTERVAL_WEIGHT) + x.mul_f64(INTERVAL_WEIGHT)
                }))
            }
            _ => None,
        };
        recent.insert(
            key,
            Asked {
                at: now,
                interval,
                alive,
            },
        );
    }

    /// Sessions that asked for work within the last [`ACTIVE_WINDOW`].
    fn count(&self) -> usize {
        let recent = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        recent
            .values()
            .filter(|a| now.saturating_duration_since(a.at) < ACTIVE_WINDOW && a.alive())
            .count()
    }

    /// The latest instant, within `horizon` after `now`, at which a session that last asked
    /// before `since` is due to ask again (its last request plus its mean interval); `None`
    /// where none is.
    fn due(&self, since: Instant, now: Instant, horizon: Duration) -> Option<Instant> {
        let recent = self.0.lock().unwrap_or_else(|e| e.into_inner());
        recent
            .values()
            .filter(|a| a.at < since && a.alive())
            .filter_map(|a| a.interval.map(|i| a.at + i))
            .filter(|&t| t > now && t <= now + horizon)
            .max()
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
    /// When the last pass was taken from the queue, and how long it ran (zero until it ends).
    last_pass: Arc<Mutex<Option<(Instant, Duration)>>>,
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
            last_pass: Arc::default(),
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
        let alive: Weak<tokio::sync::Mutex<S>> = Arc::downgrade(&session);
        self.recent.note(Arc::as_ptr(&session) as usize, alive);
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
    /// for at most [`GATHER_WINDOW`] (jobs of sessions that shared the last pass arrive just
    /// after its answers), or, where sessions that asked before the last pass are due to ask
    /// again (their last request plus their mean interval) within twice as long as the last
    /// pass took, until the last of them is due (and [`GATHER_WINDOW`] more). Sessions that
    /// fell out of step, one group drafting while the other verifies, so meet again in one
    /// pass: waiting costs at most two passes once, where each group on its own would cost a
    /// pass more every round.
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
        let now = Instant::now();
        let mut deadline = now + GATHER_WINDOW;
        let last_pass = *self.last_pass.lock().unwrap_or_else(|e| e.into_inner());
        let due = last_pass.and_then(|(taken, took)| {
            self.recent
                .due(taken, now, (DUE_PASSES * took).min(ACTIVE_WINDOW))
        });
        if let Some(due) = due {
            deadline = deadline.max(due + GATHER_WINDOW);
        }
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
        let taken = Instant::now();
        *self.last_pass.lock().unwrap_or_else(|e| e.into_inner()) = Some((taken, Duration::ZERO));
        let (engine, counters, queue, last_pass) = (
            self.engine.clone(),
            self.counters.clone(),
            self.queue.clone(),
            self.last_pass.clone(),
        );
        let work = move || {
            let unfinished = J::run_pass(&engine, &counters, batch);
            *last_pass.lock().unwrap_or_else(|e| e.into_inner()) = Some((taken, taken.elapsed()));
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A pass that takes [`FAKE_PASS`] and answers every member with the pass's sessions.
    struct Sleeper(oneshot::Sender<Result<usize, EngineError>>);

    const FAKE_PASS: Duration = Duration::from_millis(10);

    impl PassJob for Sleeper {
        type Engine = ();
        const PASS: &'static str = "test";

        fn rows(&self) -> usize {
            1
        }

        fn is_abandoned(&self) -> bool {
            self.0.is_closed()
        }

        fn abandon(self, _: &()) {}

        fn run_pass(_: &(), counters: &PassCounters, members: Vec<Self>) -> Vec<Self> {
            let n = members.len();
            counters.pass(n);
            std::thread::sleep(FAKE_PASS);
            for m in members {
                let _ = m.0.send(Ok(n));
            }
            Vec::new()
        }
    }

    /// Rounds of `sessions` sessions that each spend `away` between their answer and their
    /// next request, the odd ones starting `offset` later: each session's passes' sessions.
    async fn passes_of_sessions(
        sessions: usize,
        rounds: usize,
        away: Duration,
        offset: Duration,
    ) -> Vec<Vec<usize>> {
        let limits = BatchLimits {
            max_sessions: 64,
            max_rows: 64,
        };
        let q = Arc::new(PassQueue::<Sleeper>::new(
            Arc::new(()),
            limits,
            WorkPlacement::Inline,
        ));
        let mut tasks = Vec::new();
        for key in 0..sessions {
            let q = q.clone();
            tasks.push(tokio::spawn(async move {
                if key % 2 == 1 {
                    tokio::time::sleep(offset).await;
                }
                let session: Arc<dyn Any + Send + Sync> = Arc::new(key);
                let mut shared = Vec::new();
                for _ in 0..rounds {
                    q.recent.note(key, Arc::downgrade(&session));
                    let (tx, mut rx) = oneshot::channel();
                    q.push(Sleeper(tx));
                    shared.push(q.await_answer(&mut rx).await.unwrap());
                    tokio::time::sleep(away).await;
                }
                shared
            }));
        }
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.unwrap());
        }
        out
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sessions_out_of_step_meet_in_one_pass() {
        // Four sessions away 15 ms between 10 ms passes, started 7 ms apart or together (the
        // first alone in the first pass): without waiting, the groups each run their own pass
        // every round; a pass waits for the sessions due within twice the last pass, and the
        // groups meet within a few rounds: in the second half, rounds of every session share
        // one pass with all four (none would without the wait; a loaded machine's timers may
        // split them again now and then).
        const ROUNDS: usize = 16;
        let ms = Duration::from_millis;
        for offset in [ms(7), Duration::ZERO] {
            let shared = passes_of_sessions(4, ROUNDS, ms(15), offset).await;
            for s in &shared {
                let all = s[ROUNDS / 2..].iter().filter(|&&n| n == 4).count();
                assert!(all >= 3, "{shared:?}, offset {offset:?}");
            }
        }
    }

    #[test]
    fn a_session_is_due_its_mean_interval_after_its_last_request() {
        let s = ActiveSessions::default();
        let sessions: Vec<Arc<dyn Any + Send + Sync>> = (0..4).map(|k| Arc::new(k) as _).collect();
        let alive = |k: usize| Arc::downgrade(&sessions[k]);
        let t0 = Instant::now();
        let ms = |x: u64| Duration::from_millis(x);
        // Session 1 asks every 10 ms, session 2 every 4 ms; session 3 once.
        for k in 0..4 {
            s.note_at(1, alive(1), t0 + ms(10 * k));
        }
        s.note_at(2, alive(2), t0 + ms(22));
        s.note_at(2, alive(2), t0 + ms(26));
        s.note_at(3, alive(3), t0 + ms(25));
        assert_eq!(s.count(), 3);
        let pass = t0 + ms(27);
        // At 28 ms: session 1 (last at 30) asked after the pass; session 2 (26 + 4) is due
        // at 30; session 3 has no interval yet.
        assert_eq!(s.due(pass, t0 + ms(28), ms(8)), Some(t0 + ms(30)));
        // Not before the pass: nobody.
        assert_eq!(s.due(t0 + ms(20), t0 + ms(28), ms(8)), None);
        // Beyond the horizon, or already past: nobody.
        assert_eq!(s.due(pass, t0 + ms(28), ms(1)), None);
        assert_eq!(s.due(pass, t0 + ms(31), ms(8)), None);
        // The interval is a running mean: a 12 ms gap moves session 1's from 10 ms.
        s.note_at(1, alive(1), t0 + ms(42));
        let due = s.due(t0 + ms(43), t0 + ms(43), ms(20)).unwrap();
        assert_eq!(
            due,
            t0 + ms(42) + ms(10).mul_f64(0.75) + ms(12).mul_f64(0.25)
        );
        // A request after ACTIVE_WINDOW starts its interval over.
        s.note_at(1, alive(1), t0 + ms(42) + ACTIVE_WINDOW * 2);
        let later = t0 + ms(43) + ACTIVE_WINDOW * 2;
        assert_eq!(s.due(later, later, ms(50)), None);
        // An ended session is neither counted nor waited for.
        let t = t0 + ms(100);
        s.note_at(2, alive(2), t);
        s.note_at(2, alive(2), t + ms(5));
        assert_eq!(s.due(t + ms(6), t + ms(7), ms(8)), Some(t + ms(10)));
        assert!(s.count() > 0);
        drop(sessions);
        assert_eq!(s.due(t + ms(6), t + ms(7), ms(8)), None);
        assert_eq!(s.count(), 0);
    }
}
