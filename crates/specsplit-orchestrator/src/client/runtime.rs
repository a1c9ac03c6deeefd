//! The client runtime: a current-thread tokio runtime on a thread of its own, where an
//! orchestrator's gRPC channels and round loops run, with optional busy-polling while RPCs are
//! in flight.

use std::future::Future;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::OrchestratorError;

/// A current-thread runtime on a dedicated thread, where an orchestrator's gRPC client tasks
/// (the channels' buffer workers and HTTP/2 connection tasks) and its round loops all run.
///
/// On a multi-thread runtime an RPC's client side is three tasks (the caller's request future,
/// the channel's buffer worker, the connection task) that the scheduler spreads over worker
/// threads, each hand-off between them a wake-up of a parked thread; on one thread of its own
/// they pass the request and the response along within one poll loop, and the one wake-up left
/// per RPC is the socket's. The thread stops (and its runtime drops its remaining tasks) when
/// the last handle, i.e. the last orchestrator clone or running generation, is dropped.
pub(super) struct ClientRuntime {
    handle: tokio::runtime::Handle,
    /// Busy-polling while RPCs are in flight, where asked for (see [`Spin`]).
    spin: Option<Arc<Spin>>,
    /// Resolves the thread's `block_on` when dropped (sent or not).
    _stop: tokio::sync::oneshot::Sender<()>,
    /// Dropped by the thread once its runtime is gone (tests watch it through a `Weak`).
    #[cfg(test)]
    alive: std::sync::Weak<()>,
}

impl ClientRuntime {
    /// Starts the runtime's thread, busy-polling while RPCs are in flight as `spin` says.
    pub(super) fn start(spin: ClientSpin) -> Result<Arc<Self>, OrchestratorError> {
        let failed = |e: std::io::Error| {
            OrchestratorError::Runtime(format!("cannot start the client runtime: {e}"))
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(failed)?;
        let handle = rt.handle().clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let alive = Arc::new(());
        #[cfg(test)]
        let weak = Arc::downgrade(&alive);
        std::thread::Builder::new()
            .name("specsplit-orchestrator".into())
            .spawn(move || {
                // Err (the sender dropped) is the normal way to stop.
                let _ = rt.block_on(stopped);
                drop(rt);
                drop(alive);
            })
            .map_err(failed)?;
        let spin = (spin != ClientSpin::Never).then(|| {
            let s = Arc::new(Spin::default());
            let on = spin == ClientSpin::Always;
            s.enabled.store(on, std::sync::atomic::Ordering::Release);
            handle.spawn(s.clone().run());
            s
        });
        Ok(Arc::new(Self {
            handle,
            spin,
            _stop: stop,
            #[cfg(test)]
            alive: weak,
        }))
    }

    /// Starts `fut` on this runtime; the returned handle can be awaited from any executor and
    /// aborts the task when dropped. The task keeps the runtime running until it ends, even if
    /// every orchestrator is dropped first.
    pub(super) fn spawn<T: Send + 'static>(
        self: &Arc<Self>,
        fut: impl Future<Output = Result<T, OrchestratorError>> + Send + 'static,
    ) -> AbortOnDrop<T> {
        let keep = self.clone();
        AbortOnDrop(self.handle.spawn(async move {
            let r = fut.await;
            drop(keep);
            r
        }))
    }

    /// Awaits `rpc`, busy-polling the runtime meanwhile if this runtime spins.
    pub(super) async fn in_flight<F: Future>(&self, rpc: F) -> F::Output {
        let _spinning = self
            .spin
            .as_ref()
            .filter(|s| s.enabled.load(std::sync::atomic::Ordering::Acquire))
            .map(|s| s.begin());
        rpc.await
    }

    /// Notes the device a worker reported for a request: in [`ClientSpin::Auto`], a CUDA device
    /// turns spinning on for this runtime's later RPCs.
    pub(super) fn observe_device(&self, device: Option<&str>) {
        if let (Some(s), Some(d)) = (&self.spin, device) {
            if d.starts_with("cuda") || d.starts_with("Cuda") {
                s.enabled.store(true, std::sync::atomic::Ordering::Release);
            }
        }
    }
}

/// Busy-polling of a [`ClientRuntime`] while at least one RPC is in flight: a task that yields
/// in a loop, so that the runtime polls its sockets without blocking and runs the response's
/// tasks as soon as it arrives, instead of parking its thread and being woken by the kernel
/// (a wake-up of an idle CPU, tens of microseconds or more on a virtual machine). It costs one
/// busy core while a generation waits for a worker; with no RPC in flight it sleeps. See
/// [`ClientSpin`] for when it is on.
#[derive(Default)]
struct Spin {
    /// Whether RPCs are counted (and so spun for) at all.
    enabled: std::sync::atomic::AtomicBool,
    in_flight: std::sync::atomic::AtomicUsize,
    wake: tokio::sync::Notify,
}

impl Spin {
    /// Counts an RPC in flight until the returned guard is dropped.
    fn begin(self: &Arc<Self>) -> SpinGuard {
        self.in_flight
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        self.wake.notify_one();
        SpinGuard(self.clone())
    }

    /// The spinning task: yields while RPCs are in flight, sleeps otherwise. It ends with its
    /// runtime.
    async fn run(self: Arc<Self>) {
        loop {
            if self.in_flight.load(std::sync::atomic::Ordering::Acquire) == 0 {
                // A `begin` since the check left a permit: this returns at once then.
                self.wake.notified().await;
            } else {
                tokio::task::yield_now().await;
            }
        }
    }
}

/// One RPC in flight of a [`Spin`].
struct SpinGuard(Arc<Spin>);

impl Drop for SpinGuard {
    fn drop(&mut self) {
        self.0
            .in_flight
            .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }
}

/// When an orchestrator's client runtimes busy-poll their sockets while an RPC is in flight
/// instead of sleeping until the kernel wakes them: one wake-up less per RPC, one busy core per
/// client runtime with generations running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClientSpin {
    /// Once a worker has reported a CUDA device in a response's telemetry: GPU hosts have
    /// cores to spare, while a CPU worker in the same process needs every core.
    #[default]
    Auto,
    /// For every RPC.
    Always,
    /// Never.
    Never,
}

impl std::str::FromStr for ClientSpin {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(Self::Auto),
            "always" => Ok(Self::Always),
            "never" => Ok(Self::Never),
            other => Err(format!(
                "unknown client spin '{other}': use auto, always or never"
            )),
        }
    }
}

/// A spawned task (a generation, a connection), aborted when its caller stops waiting for it
/// (e.g. the caller's future was dropped on Ctrl-C), as the loop itself would have stopped
/// before.
pub(super) struct AbortOnDrop<T>(tokio::task::JoinHandle<Result<T, OrchestratorError>>);

impl<T> AbortOnDrop<T> {
    /// The task's result; a panic of the task becomes an error.
    pub(super) async fn join(mut self) -> Result<T, OrchestratorError> {
        match (&mut self.0).await {
            Ok(r) => r,
            Err(e) => Err(OrchestratorError::Runtime(format!(
                "the orchestrator's task failed: {e}"
            ))),
        }
    }

    /// Aborts the task and waits until it is gone (its pending requests dropped).
    pub(super) async fn cancel(mut self) {
        self.0.abort();
        let _ = (&mut self.0).await;
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    /// Waits until the client runtime's thread is gone (its runtime dropped).
    fn thread_exits(alive: std::sync::Weak<()>) -> bool {
        let until = Instant::now() + Duration::from_secs(5);
        while alive.upgrade().is_some() {
            if Instant::now() > until {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        true
    }

    #[test]
    fn client_runtime_runs_tasks_on_its_thread_and_stops_with_the_last_handle() {
        let rt = ClientRuntime::start(ClientSpin::default()).unwrap();
        let alive = rt.alive.clone();
        let caller = std::thread::current().id();
        // Awaited with no tokio runtime around the caller at all.
        let waiter = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let ran_on = waiter
            .block_on(rt.spawn(async { Ok(std::thread::current().id()) }).join())
            .unwrap();
        assert_ne!(ran_on, caller);
        // A running task keeps the runtime alive after the last handle is dropped.
        let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
        let task = rt.spawn(async move { Ok(rx.await.unwrap_or(0) + 1) });
        drop(rt);
        assert!(alive.upgrade().is_some());
        tx.send(41).unwrap();
        assert_eq!(waiter.block_on(task.join()).unwrap(), 42);
        assert!(thread_exits(alive), "the runtime thread did not stop");
    }

    #[test]
    fn a_spinning_runtime_spins_only_while_rpcs_are_in_flight() {
        let rt = ClientRuntime::start(ClientSpin::Always).unwrap();
        let spin = rt.spin.clone().expect("asked to spin");
        let alive = rt.alive.clone();
        let waiter = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        // An "RPC" that completes from another thread, as a socket's readiness would.
        let (tx, rx) = tokio::sync::oneshot::channel::<u32>();
        let rt2 = rt.clone();
        let task = rt.spawn(async move { Ok(rt2.in_flight(rx).await.unwrap_or(0)) });
        let until = Instant::now() + Duration::from_secs(5);
        while spin.in_flight.load(std::sync::atomic::Ordering::Acquire) == 0 {
            assert!(Instant::now() < until, "the RPC was never counted");
            std::thread::yield_now();
        }
        tx.send(7).unwrap();
        assert_eq!(waiter.block_on(task.join()).unwrap(), 7);
        assert_eq!(
            spin.in_flight.load(std::sync::atomic::Ordering::Acquire),
            0,
            "the finished RPC is no longer counted"
        );
        // The spinning task does not keep the runtime's thread alive.
        drop((rt, spin));
        assert!(thread_exits(alive), "the runtime thread did not stop");
    }

    #[test]
    fn on_gpu_spinning_starts_once_a_worker_reports_cuda() {
        let rt = ClientRuntime::start(ClientSpin::Auto).unwrap();
        let spin = rt.spin.clone().expect("the spinner waits for a GPU worker");
        let enabled = || spin.enabled.load(std::sync::atomic::Ordering::Acquire);
        assert!(!enabled());
        rt.observe_device(Some("cpu"));
        rt.observe_device(None);
        assert!(!enabled(), "CPU workers need every core");
        rt.observe_device(Some("cuda:0"));
        assert!(enabled());
        assert!(ClientRuntime::start(ClientSpin::Never)
            .unwrap()
            .spin
            .is_none());
    }

    #[test]
    fn dropping_a_task_handle_aborts_it_and_lets_the_thread_stop() {
        let rt = ClientRuntime::start(ClientSpin::default()).unwrap();
        let alive = rt.alive.clone();
        let task = rt.spawn(std::future::pending::<Result<(), OrchestratorError>>());
        drop(rt);
        drop(task);
        assert!(
            thread_exits(alive),
            "an aborted task kept the runtime thread"
        );
    }

    #[test]
    fn a_panicking_task_is_an_error() {
        let rt = ClientRuntime::start(ClientSpin::default()).unwrap();
        let waiter = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let r = waiter.block_on(rt.spawn(async { panic!("boom") as Result<(), _> }).join());
        assert!(matches!(r, Err(OrchestratorError::Runtime(_))), "{r:?}");
    }
}
