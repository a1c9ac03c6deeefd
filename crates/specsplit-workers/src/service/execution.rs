//! How a worker runs a request's model work: where ([`WorkPlacement`]), one request per
//! session at a time, and how long its runtime busy-polls after each answer ([`Execution`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tonic::Status;

use crate::session::SessionHandle;
use crate::EngineError;

/// Where a worker runs its model work for a request.
///
/// Each hand-off between threads costs a wake-up of a parked thread (tens of microseconds on
/// an idle host). `Pool` keeps the server's runtime answering other requests while the model
/// runs, at two hand-offs per request on a current-thread runtime (to the blocking pool and
/// back); `Inline` runs the model on the thread that polls the request, with no hand-off, and
/// that thread serves nothing else meanwhile. On a GPU the work of every session is serialized
/// on the device's stream anyway and a request takes milliseconds, so `Inline` is the default
/// there; on the CPU a request can take seconds and sessions run on several cores, so `Pool`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkPlacement {
    /// On the blocking pool (current-thread runtime) or under `block_in_place` (multi-thread).
    Pool,
    /// On the thread that polls the request.
    Inline,
}

impl WorkPlacement {
    /// The default for a worker whose model runs on `device` (a [`WorkerInfo::device`](super::WorkerInfo::device) label):
    /// `Inline` on CUDA, `Pool` elsewhere.
    pub fn default_for(device: &str) -> Self {
        if on_cuda(device) {
            Self::Inline
        } else {
            Self::Pool
        }
    }
}

/// Whether a [`WorkerInfo::device`](super::WorkerInfo::device) label names a CUDA device (`cuda`, `cuda:N`).
pub fn on_cuda(device: &str) -> bool {
    device.starts_with("cuda") || device.starts_with("Cuda")
}

/// Runs `f` while holding `session`'s lock (one request per session at a time), where
/// `placement` says.
///
/// `Pool` does not block the async runtime's other tasks: on the multi-thread runtime `f` runs
/// right here under `block_in_place` (tokio hands this worker's other tasks to another thread
/// meanwhile), elsewhere (a current-thread runtime, where `block_in_place` is not allowed) on
/// the blocking pool. `Inline` runs `f` right here in every case. A panic in `f` is answered
/// INTERNAL either way.
async fn with_session<S, T>(
    session: SessionHandle<S>,
    placement: WorkPlacement,
    f: impl FnOnce(&mut S) -> Result<T, EngineError> + Send + 'static,
) -> Result<T, Status>
where
    S: Send + 'static,
    T: Send + 'static,
{
    let mut guard = session.lock_owned().await;
    let multi_thread = tokio::runtime::Handle::current().runtime_flavor()
        == tokio::runtime::RuntimeFlavor::MultiThread;
    let out = match placement {
        WorkPlacement::Inline => catching_panics(|| f(&mut guard))?,
        WorkPlacement::Pool if multi_thread => {
            tokio::task::block_in_place(|| catching_panics(|| f(&mut guard)))?
        }
        WorkPlacement::Pool => tokio::task::spawn_blocking(move || f(&mut guard))
            .await
            .map_err(|e| task_failed(&e))?,
    };
    out.map_err(Status::from)
}

/// Runs `f` on this thread; a panic becomes an INTERNAL status.
fn catching_panics<R>(f: impl FnOnce() -> R) -> Result<R, Status> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .map_err(|p| task_failed(&panic_message(&*p)))
}

/// The INTERNAL status of a request whose model work failed outside the engine (a panic).
fn task_failed(e: &dyn std::fmt::Display) -> Status {
    Status::internal(format!("worker task failed: {e}"))
}

/// How a worker runs its requests' model work: where ([`WorkPlacement`]), and how long its
/// runtime busy-polls after each answer.
#[derive(Clone)]
pub struct Execution {
    placement: WorkPlacement,
    linger: Option<Arc<Linger>>,
}

impl Execution {
    /// How a worker on `device` (a [`WorkerInfo::device`](super::WorkerInfo::device) label) runs its work:
    /// [`WorkPlacement::default_for`] it, busy-polling for `spin` after each answer, or when
    /// `None` for [`DEFAULT_SERVER_SPIN`] on CUDA and never elsewhere.
    pub fn for_device(device: &str, spin: Option<Duration>) -> Self {
        let default = if on_cuda(device) {
            DEFAULT_SERVER_SPIN
        } else {
            Duration::ZERO
        };
        Self::new(WorkPlacement::default_for(device), spin.unwrap_or(default))
    }

    /// Model work placed as `placement` says, busy-polling for `spin` after each answer (zero:
    /// never).
    pub fn new(placement: WorkPlacement, spin: Duration) -> Self {
        Self {
            placement,
            linger: (!spin.is_zero()).then(|| Linger::new(spin)),
        }
    }

    /// Where the model work runs.
    pub fn placement(&self) -> WorkPlacement {
        self.placement
    }

    /// How long the runtime busy-polls after each answer (zero: never).
    pub fn spin(&self) -> Duration {
        self.linger.as_ref().map_or(Duration::ZERO, |l| l.window)
    }

    /// Runs `f` on `session` where the placement says (see `with_session`), then busy-polls
    /// for the window.
    pub(super) async fn run<S, T>(
        &self,
        session: SessionHandle<S>,
        f: impl FnOnce(&mut S) -> Result<T, EngineError> + Send + 'static,
    ) -> Result<T, Status>
    where
        S: Send + 'static,
        T: Send + 'static,
    {
        let out = with_session(session, self.placement, f).await?;
        self.answered();
        Ok(out)
    }

    /// Busy-polls for the window from now: a request's model work has ended.
    pub(super) fn answered(&self) {
        if let Some(l) = &self.linger {
            l.extend();
        }
    }
}

/// How long a worker on CUDA busy-polls after each answer unless its configuration says
/// otherwise (`spin_ms`): longer than a draft or verify round of the models it serves, so that the
/// next request of a running generation finds the server polling.
pub const DEFAULT_SERVER_SPIN: Duration = Duration::from_millis(20);

/// Busy-polling of a worker's runtime for a while after each request it answers, so that the
/// next request of a running generation (which usually follows within milliseconds) is picked
/// up from its socket at once, instead of after the kernel wakes the parked server thread (tens
/// of microseconds or more on a virtual machine). It keeps one core busy for `window` after every
/// answer. On by default for workers on CUDA, whose hosts have cores to spare and whose requests
/// take milliseconds ([`DEFAULT_SERVER_SPIN`]); the worker configuration's `spin_ms` sets the
/// window (0: off) for any worker.
struct Linger {
    window: Duration,
    /// Spin until this instant.
    until: std::sync::Mutex<Instant>,
    wake: tokio::sync::Notify,
    started: std::sync::atomic::AtomicBool,
}

impl Linger {
    fn new(window: Duration) -> Arc<Self> {
        Arc::new(Self {
            window,
            until: std::sync::Mutex::new(Instant::now()),
            wake: tokio::sync::Notify::new(),
            started: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Spins for the window from now on, starting the spinning task on the current runtime
    /// the first time.
    fn extend(self: &Arc<Self>) {
        *self.until.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now() + self.window;
        if !self.started.swap(true, std::sync::atomic::Ordering::AcqRel) {
            tokio::spawn(self.clone().run());
        }
        self.wake.notify_one();
    }

    fn spinning(&self) -> bool {
        Instant::now() < *self.until.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Yields while the window lasts, sleeps otherwise; ends with its runtime.
    async fn run(self: Arc<Self>) {
        loop {
            if self.spinning() {
                tokio::task::yield_now().await;
            } else {
                // An `extend` since the check left a permit: this returns at once then.
                self.wake.notified().await;
            }
        }
    }
}

/// The text of a panic payload.
fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    match (p.downcast_ref::<&str>(), p.downcast_ref::<String>()) {
        (Some(s), _) => format!("panicked: {s}"),
        (_, Some(s)) => format!("panicked: {s}"),
        _ => "panicked".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn session(v: u32) -> SessionHandle<u32> {
        Arc::new(tokio::sync::Mutex::new(v))
    }

    /// Runs one request under `placement`; whether it ran on the calling thread (the session
    /// holds its write either way).
    async fn runs_on_the_caller(placement: WorkPlacement) -> bool {
        let s = session(1);
        let caller = std::thread::current().id();
        let ran_on = with_session(s.clone(), placement, |v| {
            *v += 1;
            Ok(std::thread::current().id())
        })
        .await
        .unwrap();
        assert_eq!(*s.lock().await, 2);
        ran_on == caller
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn multi_thread_runs_the_work_on_the_calling_thread() {
        assert!(
            runs_on_the_caller(WorkPlacement::Pool).await,
            "no hop to the blocking pool"
        );
        assert!(runs_on_the_caller(WorkPlacement::Inline).await);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn current_thread_runs_the_work_on_the_blocking_pool() {
        assert!(
            !runs_on_the_caller(WorkPlacement::Pool).await,
            "the single runtime thread must not block"
        );
    }

    #[tokio::test(flavor = "current_thread")]
    async fn inline_runs_the_work_on_the_polling_thread() {
        assert!(
            runs_on_the_caller(WorkPlacement::Inline).await,
            "no hop to the blocking pool"
        );
    }

    async fn errors_and_panics_become_statuses(placement: WorkPlacement) {
        let s = session(0);
        let e = with_session(s.clone(), placement, |_| -> Result<(), _> {
            Err(EngineError::InvalidArgument("bad".into()))
        })
        .await
        .unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        let e = with_session(s.clone(), placement, |_| -> Result<(), _> {
            panic!("boom")
        })
        .await
        .unwrap_err();
        assert_eq!(e.code(), tonic::Code::Internal);
        assert!(e.message().contains("boom"), "{}", e.message());
        // The lock was released: the session serves the next request.
        assert_eq!(with_session(s, placement, |v| Ok(*v)).await.unwrap(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn errors_and_panics_become_statuses_multi_thread() {
        errors_and_panics_become_statuses(WorkPlacement::Pool).await;
        errors_and_panics_become_statuses(WorkPlacement::Inline).await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn errors_and_panics_become_statuses_current_thread() {
        errors_and_panics_become_statuses(WorkPlacement::Pool).await;
        errors_and_panics_become_statuses(WorkPlacement::Inline).await;
    }

    #[tokio::test(flavor = "current_thread")]
    async fn inline_keeps_one_request_per_session() {
        // Two requests of one session, the first holding the lock across an await point of the
        // caller: the second waits for it and sees its write.
        let s = session(0);
        let held = s.clone().lock_owned().await;
        let second = tokio::spawn(with_session(s.clone(), WorkPlacement::Inline, |v| {
            *v += 1;
            Ok(*v)
        }));
        tokio::task::yield_now().await;
        assert!(
            !second.is_finished(),
            "the second request must wait for the lock"
        );
        drop(held);
        assert_eq!(second.await.unwrap().unwrap(), 1);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn linger_spins_for_its_window_then_sleeps() {
        let l = Linger::new(Duration::from_millis(30));
        assert!(!l.spinning());
        l.extend();
        assert!(l.spinning());
        // The spinning task yields, so this thread's other tasks still run meanwhile.
        let other = tokio::spawn(async { 5 });
        assert_eq!(other.await.unwrap(), 5);
        tokio::time::sleep(Duration::from_millis(40)).await;
        assert!(!l.spinning(), "the window has passed");
        // A later answer opens a new window; the task was started once.
        l.extend();
        assert!(l.spinning());
        assert!(l.started.load(std::sync::atomic::Ordering::Acquire));
    }

    #[test]
    fn placement_defaults_by_device() {
        assert_eq!(WorkPlacement::default_for("cpu"), WorkPlacement::Pool);
        assert_eq!(Execution::for_device("cpu", None).spin(), Duration::ZERO);
        assert_eq!(
            Execution::for_device("cuda:1", None).spin(),
            DEFAULT_SERVER_SPIN
        );
        let set = Execution::for_device("cpu", Some(Duration::from_millis(3)));
        assert_eq!(set.spin(), Duration::from_millis(3));
        assert_eq!(set.placement(), WorkPlacement::Pool);
        assert_eq!(
            Execution::for_device("cuda:0", Some(Duration::ZERO)).spin(),
            Duration::ZERO
        );
        assert_eq!(WorkPlacement::default_for("cuda:0"), WorkPlacement::Inline);
        assert_eq!(
            WorkPlacement::default_for("Cuda(CudaDevice(DeviceId(1)))"),
            WorkPlacement::Inline
        );
    }
}
