//! Test support: start draft and target workers in-process on loopback and stop them again,
//! plaintext or as their configuration's security settings say ([`pki`] makes certificates).

pub mod pki;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use specsplit_workers::config::WorkerConfig;
use specsplit_workers::draft::DraftSession;
use specsplit_workers::launch;
use specsplit_workers::model_free::ModelFreeSession;
use specsplit_workers::service::{
    serve_draft, serve_draft_with, serve_model_free_draft, serve_target, serve_target_with,
    DraftWorker, Lifecycle, TargetWorker,
};
use specsplit_workers::session::SessionStore;
use specsplit_workers::target::TargetSession;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// The directory the real models are fetched into (fetching them if missing).
pub fn ensure_model(name: &str) {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let status = std::process::Command::new(root.join("scripts/fetch-models.sh"))
        .arg(name)
        .status()
        .expect("running scripts/fetch-models.sh");
    assert!(status.success(), "fetching model {name} failed");
}

/// A worker configuration for tests: loopback, a free port, the given model. The target gives
/// no load advice (`load_gate` off), so that the rounds a test asserts on do not depend on
/// measured pass times; tests/tests/load_gate.rs tests the advice.
pub fn config(model: &str, target: bool) -> WorkerConfig {
    let base = if target {
        WorkerConfig::target_defaults()
    } else {
        WorkerConfig::draft_defaults()
    };
    WorkerConfig {
        listen: "127.0.0.1:0".into(),
        model: model.into(),
        max_context: 1024,
        memory_budget_mb: 4096,
        load_gate: false,
        ..base
    }
}

/// A worker running in this process.
pub struct Running<S> {
    /// Its address as a URL.
    pub url: String,
    /// Its bound socket address.
    pub addr: SocketAddr,
    /// Its session store.
    pub sessions: Arc<SessionStore<S>>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl<S> Running<S> {
    /// Stops the worker gracefully and waits for it.
    pub async fn stop(mut self) {
        self.stop_now().await;
    }

    async fn stop_now(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.task.take() {
            let _ = t.await;
        }
    }
}

impl<S> Drop for Running<S> {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

/// Starts a draft worker for `cfg` (loading its model).
pub async fn start_draft(cfg: &WorkerConfig) -> Running<DraftSession> {
    start_draft_with(cfg, |w| w).await
}

/// Starts a target worker for `cfg` (loading its model).
pub async fn start_target(cfg: &WorkerConfig) -> Running<TargetSession> {
    start_target_with(cfg, |w| w).await
}

/// [`start_draft`] with the worker adjusted by `adjust` (placement, busy-polling) first.
pub async fn start_draft_with(
    cfg: &WorkerConfig,
    adjust: impl FnOnce(DraftWorker) -> DraftWorker,
) -> Running<DraftSession> {
    let worker = adjust(launch::draft_worker(
        cfg,
        launch::load(cfg).expect("load draft model"),
    ));
    let sessions = worker.sessions();
    start(cfg, sessions, |l, stop| serve_draft(worker, l, stop)).await
}

/// Starts a model-free draft worker for `cfg` (`cfg.drafter` ngram or suffix; no model is
/// loaded, `cfg.model` is unused).
pub async fn start_model_free_draft(cfg: &WorkerConfig) -> Running<ModelFreeSession> {
    let worker = launch::model_free_draft_worker(cfg).expect("model-free draft worker");
    let sessions = worker.sessions();
    start(cfg, sessions, |l, stop| {
        serve_model_free_draft(worker, l, stop)
    })
    .await
}

/// [`start_target`] with the worker adjusted by `adjust` (placement, busy-polling) first.
pub async fn start_target_with(
    cfg: &WorkerConfig,
    adjust: impl FnOnce(TargetWorker) -> TargetWorker,
) -> Running<TargetSession> {
    let worker = adjust(launch::target_worker(
        cfg,
        launch::load(cfg).expect("load target model"),
    ));
    let sessions = worker.sessions();
    start(cfg, sessions, |l, stop| serve_target(worker, l, stop)).await
}

/// Starts a draft worker for `cfg` serving with its TLS and token settings.
pub async fn start_secured_draft(cfg: &WorkerConfig) -> Running<DraftSession> {
    let opts = launch::serve_options(cfg, Arc::new(Lifecycle::default())).expect("TLS files");
    let worker = launch::draft_worker(cfg, launch::load(cfg).expect("load draft model"));
    let sessions = worker.sessions();
    start(cfg, sessions, |l, stop| {
        serve_draft_with(worker, l, stop, opts)
    })
    .await
}

/// Starts a target worker for `cfg` serving with its TLS and token settings.
pub async fn start_secured_target(cfg: &WorkerConfig) -> Running<TargetSession> {
    let opts = launch::serve_options(cfg, Arc::new(Lifecycle::default())).expect("TLS files");
    let worker = launch::target_worker(cfg, launch::load(cfg).expect("load target model"));
    let sessions = worker.sessions();
    start(cfg, sessions, |l, stop| {
        serve_target_with(worker, l, stop, opts)
    })
    .await
}

/// Binds `cfg.listen` and runs the server `serve` builds until the returned handle stops it.
async fn start<S, F, Fut>(
    cfg: &WorkerConfig,
    sessions: Arc<SessionStore<S>>,
    serve: F,
) -> Running<S>
where
    F: FnOnce(TcpListener, std::pin::Pin<Box<dyn Future<Output = ()> + Send>>) -> Fut,
    Fut: Future<Output = Result<(), tonic::transport::Error>> + Send + 'static,
{
    let listener = TcpListener::bind(&cfg.listen).await.expect("bind");
    let addr = listener.local_addr().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let server = serve(
        listener,
        Box::pin(async {
            let _ = rx.await;
        }),
    );
    let task = tokio::spawn(async move { server.await.expect("server") });
    Running {
        url: format!("http://{addr}"),
        addr,
        sessions,
        stop: Some(tx),
        task: Some(task),
    }
}

/// Deterministic varied prompts of token ids in `[lo, hi)`.
pub fn prompts(n: usize, lo: u32, hi: u32) -> Vec<Vec<u32>> {
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    (0..n)
        .map(|i| {
            let len = 1 + (i * 7) % 23;
            (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    lo + (x % (hi - lo) as u64) as u32
                })
                .collect()
        })
        .collect()
}

/// A TCP relay in front of a worker that a test can freeze: while frozen it accepts
/// connections and reads what arrives but passes nothing on in either direction, as a stopped
/// (SIGSTOP) or black-holed worker would; thawed, it passes everything held and what follows.
pub struct Relay {
    /// Its address as a URL.
    pub url: String,
    frozen: tokio::sync::watch::Sender<bool>,
    delay_ms: Arc<std::sync::atomic::AtomicU64>,
    task: JoinHandle<()>,
}

impl Relay {
    /// Starts a relay on a free loopback port to `upstream`.
    pub async fn start(upstream: SocketAddr) -> Relay {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind relay");
        let addr = listener.local_addr().unwrap();
        let (frozen, watch) = tokio::sync::watch::channel(false);
        let delay_ms = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let delay = delay_ms.clone();
        let task = tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                let watch = watch.clone();
                let delay = delay.clone();
                tokio::spawn(async move {
                    let Ok(up) = tokio::net::TcpStream::connect(upstream).await else {
                        return;
                    };
                    let _ = down.set_nodelay(true);
                    let _ = up.set_nodelay(true);
                    let (dr, dw) = down.into_split();
                    let (ur, uw) = up.into_split();
                    tokio::join!(
                        pass(dr, uw, watch.clone(), delay.clone()),
                        pass(ur, dw, watch, delay)
                    );
                });
            }
        });
        Relay {
            url: format!("http://{addr}"),
            frozen,
            delay_ms,
            task,
        }
    }

    /// Holds everything from now on.
    pub fn freeze(&self) {
        self.frozen.send_replace(true);
    }

    /// Passes on what was held and everything after.
    pub fn thaw(&self) {
        self.frozen.send_replace(false);
    }

    /// Holds each chunk this many milliseconds before passing it on (a slow link or worker).
    pub fn set_delay_ms(&self, ms: u64) {
        self.delay_ms
            .store(ms, std::sync::atomic::Ordering::Relaxed);
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Copies `from` to `to`, holding each chunk while `frozen` says so, and `delay_ms` first.
async fn pass(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut frozen: tokio::sync::watch::Receiver<bool>,
    delay_ms: Arc<std::sync::atomic::AtomicU64>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let delay = delay_ms.load(std::sync::atomic::Ordering::Relaxed);
        if delay > 0 {
            tokio::time::sleep(std::time::Duration::from_millis(delay)).await;
        }
        while *frozen.borrow_and_update() {
            if frozen.changed().await.is_err() {
                return;
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
