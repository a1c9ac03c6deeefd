//! The round loop over gRPC clients of the two workers.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use specsplit_core::tree::{TokenTree, TreeLimits};
use specsplit_proto::convert::TreeWire;
use specsplit_proto::draft_service_client::DraftServiceClient;
use specsplit_proto::target_service_client::TargetServiceClient;
use specsplit_proto::{DraftRequest, EndSessionRequest, PingRequest, VerifyRequest};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::adaptive::{resize_widths, DepthController, DraftBackoff, SpeedGovernor};
use crate::stats::{GenerationStats, NoDraft, RoundRecord, SpeedSwitch};
use serde::{Deserialize, Serialize};

use crate::{GenerateConfig, Generation, Mode, Pipeline, StopReason};

/// Largest gRPC message sent or accepted (dense draft distributions are large).
const MAX_MESSAGE_BYTES: usize = 512 << 20;
/// How long to keep retrying a worker that is unreachable mid-generation (e.g. restarting).
const RECONNECT_WINDOW: Duration = Duration::from_secs(30);
/// How long ending a session may take (best effort, after the generation's result is known).
const END_SESSION_TIMEOUT: Duration = Duration::from_millis(500);
/// How long connecting to a worker and its first ping may take, each.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Errors of the orchestrator.
#[derive(Debug, thiserror::Error)]
pub enum OrchestratorError {
    /// A worker could not be reached.
    #[error("{worker} worker at {addr} is unreachable: {reason}")]
    Unreachable {
        /// "draft" or "target".
        worker: &'static str,
        /// Its address.
        addr: String,
        /// What failed.
        reason: String,
    },
    /// The draft and target cannot be paired.
    #[error("{0}")]
    Incompatible(String),
    /// A worker refused or failed a request.
    #[error("{worker} worker: {status}")]
    Rpc {
        /// "draft" or "target".
        worker: &'static str,
        /// The gRPC status.
        status: Status,
    },
    /// A worker did not answer in time.
    #[error("{worker} worker did not answer within {after_ms} ms")]
    Timeout {
        /// "draft" or "target".
        worker: &'static str,
        /// The time allowed, in ms.
        after_ms: u64,
    },
    /// The settings are invalid.
    #[error("invalid settings: {0}")]
    Config(String),
    /// A worker sent something that does not make sense.
    #[error("protocol error: {0}")]
    Protocol(String),
    /// The orchestrator's own runtime failed (it could not start, or a task of it panicked).
    #[error("orchestrator runtime: {0}")]
    Runtime(String),
}

fn rpc(worker: &'static str) -> impl Fn(Status) -> OrchestratorError {
    move |status| OrchestratorError::Rpc { worker, status }
}

/// A connection to a target worker and, for speculative decoding, a draft worker.
///
/// Its gRPC channels and its generations' round loops run on a current-thread runtime on a
/// thread of its own (see [`ClientRuntime`]), which stops when the last clone is dropped.
#[derive(Clone)]
pub struct Orchestrator {
    draft: Option<DraftServiceClient<Channel>>,
    target: TargetServiceClient<Channel>,
    target_addr: String,
    eos: Vec<u32>,
    vocab_size: usize,
    /// The limits the target reported.
    target_limits: WorkerLimits,
    /// The limits the draft reported (None without a draft).
    draft_limits: Option<WorkerLimits>,
    /// Dropped after the channels (fields drop in order), though either order is safe.
    rt: Arc<ClientRuntime>,
}

/// A current-thread runtime on a dedicated thread, where an orchestrator's gRPC client tasks
/// (the channels' buffer workers and HTTP/2 connection tasks) and its round loops all run.
///
/// On a multi-thread runtime an RPC's client side is three tasks (the caller's request future,
/// the channel's buffer worker, the connection task) that the scheduler spreads over worker
/// threads, each hand-off between them a wake-up of a parked thread; on one thread of its own
/// they pass the request and the response along within one poll loop, and the one wake-up left
/// per RPC is the socket's. The thread stops (and its runtime drops its remaining tasks) when
/// the last handle, i.e. the last orchestrator clone or running generation, is dropped.
struct ClientRuntime {
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
    fn start(spin: ClientSpin) -> Result<Arc<Self>, OrchestratorError> {
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
    fn spawn<T: Send + 'static>(
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
    async fn in_flight<F: Future>(&self, rpc: F) -> F::Output {
        let _spinning = self
            .spin
            .as_ref()
            .filter(|s| s.enabled.load(std::sync::atomic::Ordering::Acquire))
            .map(|s| s.begin());
        rpc.await
    }

    /// Notes the device a worker reported for a request: in [`ClientSpin::Auto`], a CUDA device
    /// turns spinning on for this runtime's later RPCs.
    fn observe_device(&self, device: Option<&str>) {
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

/// When an orchestrator's client runtime busy-polls its sockets while an RPC is in flight
/// instead of sleeping until the kernel wakes it: one wake-up less per RPC, one busy core per
/// generating client.
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

/// The request limits a worker reported in its ping (0 where it did not say).
#[derive(Debug, Clone, Copy, Default)]
struct WorkerLimits {
    max_context: usize,
    max_prompt_len: usize,
    max_tree_nodes: usize,
    max_tree_depth: usize,
}

impl WorkerLimits {
    fn of(p: &specsplit_proto::PingResponse) -> Self {
        let n = |v: i32| v.max(0) as usize;
        Self {
            max_context: n(p.max_context),
            max_prompt_len: n(p.max_prompt_len),
            max_tree_nodes: n(p.max_tree_nodes),
            max_tree_depth: n(p.max_tree_depth),
        }
    }
}

/// Pings a worker within [`CONNECT_TIMEOUT`].
async fn ping<F, T>(worker: &'static str, addr: &str, call: F) -> Result<T, OrchestratorError>
where
    F: Future<Output = Result<tonic::Response<T>, Status>>,
{
    let unreachable = |reason: String| OrchestratorError::Unreachable {
        worker,
        addr: addr.to_string(),
        reason,
    };
    match tokio::time::timeout(CONNECT_TIMEOUT, call).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(s)) => Err(unreachable(short(s.message()))),
        Err(_) => Err(unreachable(format!(
            "no answer to a ping within {} s",
            CONNECT_TIMEOUT.as_secs()
        ))),
    }
}

async fn channel(worker: &'static str, addr: &str) -> Result<Channel, OrchestratorError> {
    let unreachable = |reason: String| OrchestratorError::Unreachable {
        worker,
        addr: addr.to_string(),
        reason,
    };
    let uri = if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    let endpoint = Endpoint::from_shared(uri)
        .map_err(|e| unreachable(format!("bad address: {e}")))?
        .connect_timeout(CONNECT_TIMEOUT)
        .tcp_nodelay(true);
    tokio::time::timeout(CONNECT_TIMEOUT, endpoint.connect())
        .await
        .map_err(|_| unreachable("no connection within 5 s".into()))?
        .map_err(|e| unreachable(format!("{e} (is the worker running and listening there?)")))
}

impl Orchestrator {
    /// Connects to the workers (no draft for target-only decoding), pings both and checks that
    /// their vocabularies match.
    pub async fn connect(
        draft_addr: Option<&str>,
        target_addr: &str,
    ) -> Result<Self, OrchestratorError> {
        Self::connect_with(draft_addr, target_addr, ClientSpin::default()).await
    }

    /// [`Orchestrator::connect`], with the client runtime busy-polling as `spin` says.
    pub async fn connect_with(
        draft_addr: Option<&str>,
        target_addr: &str,
        spin: ClientSpin,
    ) -> Result<Self, OrchestratorError> {
        let rt = ClientRuntime::start(spin)?;
        // Connected on the client runtime, so that the channels' tasks are spawned there.
        let (draft_addr, target_addr) = (draft_addr.map(str::to_string), target_addr.to_string());
        let rt2 = rt.clone();
        rt.spawn(async move { Self::connect_here(draft_addr.as_deref(), &target_addr, rt2).await })
            .join()
            .await
    }

    /// [`Orchestrator::connect`] on the current runtime, which must be `rt`'s.
    async fn connect_here(
        draft_addr: Option<&str>,
        target_addr: &str,
        rt: Arc<ClientRuntime>,
    ) -> Result<Self, OrchestratorError> {
        let mut target = TargetServiceClient::new(channel("target", target_addr).await?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        let tp = ping("target", target_addr, target.ping(PingRequest {})).await?;
        let mut eos: Vec<u32> = tp.eos_token_ids.iter().map(|&t| t as u32).collect();
        let draft = match draft_addr {
            None => None,
            Some(addr) => {
                let mut d = DraftServiceClient::new(channel("draft", addr).await?)
                    .max_decoding_message_size(MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_MESSAGE_BYTES);
                let dp = ping("draft", addr, d.ping(PingRequest {})).await?;
                if dp.vocab_size != tp.vocab_size {
                    return Err(OrchestratorError::Incompatible(format!(
                        "the draft model '{}' has a vocabulary of {} tokens but the target model \
                         '{}' has {}: speculative decoding needs the same tokenizer on both sides",
                        dp.model_name, dp.vocab_size, tp.model_name, tp.vocab_size
                    )));
                }
                for &t in &dp.eos_token_ids {
                    if !eos.contains(&(t as u32)) {
                        eos.push(t as u32);
                    }
                }
                Some((d, WorkerLimits::of(&dp)))
            }
        };
        let (draft, draft_limits) = match draft {
            Some((d, l)) => (Some(d), Some(l)),
            None => (None, None),
        };
        Ok(Self {
            draft,
            target,
            target_addr: target_addr.to_string(),
            eos,
            vocab_size: tp.vocab_size.max(0) as usize,
            target_limits: WorkerLimits::of(&tp),
            draft_limits,
            rt,
        })
    }

    /// End-of-sequence ids reported by the workers.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }

    /// Vocabulary size reported by the target.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Generates up to `cfg.max_tokens` tokens after `prompt`, calling `on_tokens` with each
    /// round's emitted tokens as soon as they are known (in the caller's task, in order, all
    /// before this returns; the round loop does not wait for it). Both workers' sessions are
    /// ended on every exit path.
    pub async fn generate(
        &self,
        prompt: &[u32],
        cfg: &GenerateConfig,
        on_tokens: impl FnMut(&[u32]),
    ) -> Result<Generation, OrchestratorError> {
        cfg.validate().map_err(OrchestratorError::Config)?;
        if prompt.is_empty() {
            return Err(OrchestratorError::Config(
                "the prompt holds no tokens".into(),
            ));
        }
        if cfg.mode == Mode::Spec && self.draft.is_none() {
            return Err(OrchestratorError::Config(
                "speculative mode needs a draft worker address".into(),
            ));
        }
        let t = &self.target_limits;
        if prompt.len() > known(t.max_context) || prompt.len() > known(t.max_prompt_len) {
            return Err(OrchestratorError::Config(format!(
                "the prompt has {} tokens but the target accepts at most {} (max_prompt_len) \
                 and holds at most {} in a session (max_context)",
                prompt.len(),
                t.max_prompt_len,
                t.max_context
            )));
        }
        let session = format!("gen-{:032x}", rand::random::<u128>());
        let secret = new_secret();
        // The round loop runs on the client runtime's thread, where the channels' tasks run
        // (see `ClientRuntime`), whatever polls the caller. The caller still calls `on_tokens`
        // itself, with every round's tokens, in order, before the result.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u32>>();
        let (o, cfg, prompt) = (self.clone(), cfg.clone(), prompt.to_vec());
        let body = async move {
            run_and_end(&o, &session, &secret, &cfg, &prompt, move |t| {
                // The receiver is gone only when the caller was dropped (and aborts us).
                let _ = tx.send(t.to_vec());
            })
            .await
        };
        let task = self.rt.spawn(body);
        let mut on_tokens = on_tokens;
        // The channel closes when the round loop returns (the sender is dropped with it).
        while let Some(t) = rx.recv().await {
            on_tokens(&t);
        }
        task.join().await
    }

    /// Ends `session` on both workers at once, each within [`END_SESSION_TIMEOUT`] (best
    /// effort: a dead worker holds none anyway, and an idle one drops it after its TTL).
    async fn end_sessions(&self, session: &str, secret: &str) {
        let end = EndSessionRequest {
            session_id: session.to_string(),
            session_secret: secret.to_string(),
        };
        let mut target = self.target.clone();
        let on_target = tokio::time::timeout(END_SESSION_TIMEOUT, target.end_session(end.clone()));
        let on_draft = async {
            if let Some(d) = &self.draft {
                let mut d = d.clone();
                let _ = tokio::time::timeout(END_SESSION_TIMEOUT, d.end_session(end)).await;
            }
        };
        let _ = tokio::join!(on_target, on_draft);
    }
}

/// Runs a generation's round loop, then ends its sessions whatever happened.
async fn run_and_end(
    o: &Orchestrator,
    session: &str,
    secret: &str,
    cfg: &GenerateConfig,
    prompt: &[u32],
    on_tokens: impl FnMut(&[u32]),
) -> Result<Generation, OrchestratorError> {
    let result = Run::new(o, session, secret, cfg)
        .run(prompt, on_tokens)
        .await;
    o.end_sessions(session, secret).await;
    result
}

/// A fresh session secret: 32 random hex digits (128 bits).
fn new_secret() -> String {
    format!("{:032x}", rand::random::<u128>())
}

/// A spawned task (a generation, a connection), aborted when its caller stops waiting for it
/// (e.g. the caller's future was dropped on Ctrl-C), as the loop itself would have stopped
/// before.
struct AbortOnDrop<T>(tokio::task::JoinHandle<Result<T, OrchestratorError>>);

impl<T> AbortOnDrop<T> {
    /// The task's result; a panic of the task becomes an error.
    async fn join(mut self) -> Result<T, OrchestratorError> {
        match (&mut self.0).await {
            Ok(r) => r,
            Err(e) => Err(OrchestratorError::Runtime(format!(
                "the orchestrator's task failed: {e}"
            ))),
        }
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// A draft tree and how long drafting it took.
struct Drafted {
    tree: TokenTree,
    ms: f64,
    /// Wall time the draft worker reported for the request (0 for a pre-drafted tree).
    server_ms: f64,
    /// Of that, the time it reported in its model.
    model_ms: f64,
}

impl Drafted {
    /// No tree, after `ms` spent waiting for one.
    fn none(ms: f64) -> Self {
        Self {
            tree: TokenTree::new(),
            ms,
            server_ms: 0.0,
            model_ms: 0.0,
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

/// A pre-draft running beside a verify call: its task, and when it must have answered.
type PreDraft = tokio::task::JoinHandle<Result<Result<Drafted, OrchestratorError>, ()>>;

/// State of one generation.
struct Run<'a> {
    o: &'a Orchestrator,
    session: &'a str,
    /// Sent with every request of the session (the workers refuse the session's requests
    /// without it).
    secret: &'a str,
    cfg: &'a GenerateConfig,
    /// Prompt + emitted tokens.
    seq: Vec<u32>,
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
}

impl<'a> Run<'a> {
    fn new(
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
            seq: Vec::new(),
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
        }
    }

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

    fn past_deadline(&self) -> bool {
        self.deadline.is_some_and(|d| Instant::now() >= d)
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

    /// Whether the draft accepts a request carrying `ctx_len` tokens and `widths`.
    fn draft_accepts(&self, ctx_len: usize, widths: &[usize]) -> bool {
        let Some(d) = &self.o.draft_limits else {
            return false;
        };
        ctx_len <= known(d.max_prompt_len)
            && ctx_len.saturating_add(tree_size(widths)) <= known(d.max_context)
            && tree_size(widths) <= known(d.max_tree_nodes)
            && widths.len() <= known(d.max_tree_depth)
    }

    /// The widths of this round's tree: `widths` cut to fit the target's room after the
    /// sequence and the draft's limits (empty when no tree fits).
    fn fit_widths(&mut self, widths: &[usize]) -> Vec<usize> {
        let (room, levels) = self.target_room();
        let mut w = fit_tree_widths(widths, room, levels);
        if let Some(d) = &self.o.draft_limits {
            if self.seq.len() > known(d.max_prompt_len) || self.seq.len() >= known(d.max_context) {
                // The sequence only grows: the draft cannot serve this generation any more.
                tracing::info!(
                    tokens = self.seq.len(),
                    "the sequence outgrew the draft worker's limits; target-only rounds from here"
                );
                self.draft_off = true;
                return Vec::new();
            }
            let room = known(d.max_context) - self.seq.len();
            w = fit_tree_widths(
                &w,
                room.min(known(d.max_tree_nodes)),
                known(d.max_tree_depth),
            );
        }
        w
    }

    /// Records a failed draft request of round `round`.
    fn draft_failed(&mut self, round: usize, what: &str) {
        self.draft_failures += 1;
        self.backoff.fail(round);
        tracing::warn!(
            round,
            "draft worker failed ({what}); target-only rounds meanwhile"
        );
    }

    /// Records a draft error of round `round`: a refusal as invalid (an older worker's limits)
    /// turns the draft off for the rest of the generation, anything else backs off.
    fn draft_error(&mut self, round: usize, e: &OrchestratorError) {
        match e {
            OrchestratorError::Rpc { status, .. } if status.code() == Code::InvalidArgument => {
                self.draft_failures += 1;
                self.draft_off = true;
                tracing::warn!(
                    round,
                    "draft worker refused a request ({}); target-only rounds for the rest",
                    short(status.message())
                );
            }
            e => self.draft_failed(round, &short(&e.to_string())),
        }
    }

    /// Asks the draft for a tree after the sequence, within the draft deadline.
    async fn draft(&mut self, round: usize, widths: &[usize]) -> DraftOutcome {
        let no = self.request_no;
        self.request_no += 1;
        let t0 = Instant::now();
        let until = self.bounded(t0 + Duration::from_millis(self.cfg.draft_timeout_ms));
        let limits = self.limits();
        let call = draft_call(
            self.o,
            self.session,
            self.secret,
            self.cfg,
            no,
            &self.seq,
            widths,
            &limits,
        );
        let waited = || t0.elapsed().as_secs_f64() * 1e3;
        match tokio::time::timeout_at(until.into(), call).await {
            Ok(Ok(d)) => {
                self.backoff.succeed();
                DraftOutcome::Tree(Box::new(d))
            }
            Ok(Err(e)) => {
                self.draft_error(round, &e);
                DraftOutcome::Failed(waited())
            }
            Err(_) if self.past_deadline() => DraftOutcome::Deadline,
            Err(_) => {
                let ms = self.cfg.draft_timeout_ms;
                self.draft_failed(round, &format!("no answer within {ms} ms"));
                DraftOutcome::Failed(waited())
            }
        }
    }

    /// Starts a draft after `ctx` with `widths` on its own task, bounded by the draft deadline;
    /// the task answers `Err(())` when that passed.
    fn spawn_predraft(&mut self, ctx: Vec<u32>, widths: Vec<usize>) -> PreDraft {
        let o = self.o.clone();
        let (sess, secret, cfg, no) = (
            self.session.to_string(),
            self.secret.to_string(),
            self.cfg.clone(),
            self.request_no,
        );
        self.request_no += 1;
        let limits = self.limits();
        let until = self.bounded(Instant::now() + Duration::from_millis(cfg.draft_timeout_ms));
        tokio::spawn(async move {
            let call = draft_call(&o, &sess, &secret, &cfg, no, &ctx, &widths, &limits);
            tokio::time::timeout_at(until.into(), call)
                .await
                .map_err(|_| ())
        })
    }

    async fn run(
        mut self,
        prompt: &[u32],
        mut on_tokens: impl FnMut(&[u32]),
    ) -> Result<Generation, OrchestratorError> {
        let start = Instant::now();
        self.deadline =
            (self.cfg.deadline_ms > 0).then(|| start + Duration::from_millis(self.cfg.deadline_ms));
        self.seq = prompt.to_vec();
        let mut out: Vec<u32> = Vec::new();
        let mut rounds: Vec<RoundRecord> = Vec::new();
        let mut ttft_ms = 0.0;
        // The pre-drafted next tree (empty after a miss).
        let mut next_tree: Option<Drafted> = None;
        let target_context = known(self.o.target_limits.max_context);
        let stop = loop {
            if out.len() >= self.cfg.max_tokens {
                break StopReason::MaxTokens;
            }
            if self.past_deadline() {
                break StopReason::Deadline;
            }
            // Even a round without a tree needs the whole sequence in the target's context.
            if self.seq.len() > target_context {
                break StopReason::Context;
            }
            let round_start = Instant::now();
            let round = rounds.len();
            let remaining = self.cfg.max_tokens - out.len();
            let pre_drafted = next_tree.take();
            // Never draft deeper than what may still be emitted (accepted + 1 ≤ remaining).
            let (widths, mut no_draft) = if self.cfg.mode == Mode::Ar {
                (Vec::new(), Some(NoDraft::Mode))
            } else {
                let d = if self.cfg.adaptive_depth {
                    self.depth.depth(self.widths.len())
                } else {
                    self.cfg.widths.len()
                };
                self.widths = resize_widths(&self.cfg.widths, d);
                let wanted = resize_widths(&self.widths, d.min(remaining - 1));
                if wanted.is_empty() {
                    (wanted, Some(NoDraft::LastToken))
                } else if self.draft_off {
                    (Vec::new(), Some(NoDraft::Limit))
                } else if !self.backoff.ready(round) {
                    (Vec::new(), Some(NoDraft::Backoff))
                } else if !self.governor.speculate(round) {
                    (Vec::new(), Some(NoDraft::Slow))
                } else {
                    let w = self.fit_widths(&wanted);
                    let why = w.is_empty().then_some(NoDraft::Limit);
                    (w, why)
                }
            };
            let depth = widths.len();
            // The first round drafts beside the target's prefill: the target's first token
            // needs no draft, so the target decodes it as a plain step while the draft drafts
            // after the prompt (as an overlapped pre-draft does), and the part of that tree
            // below the root the target picked is verified next round.
            let first = rounds.is_empty() && depth > 0 && self.cfg.overlaps_first_round();
            if first {
                no_draft = Some(NoDraft::FirstRound);
            }
            let (mut drafted, overlap_hit) = if depth == 0 || first {
                (Drafted::none(0.0), None)
            } else {
                match pre_drafted {
                    Some(pre) if !pre.tree.is_empty() => {
                        // Never deeper than what may still be emitted.
                        let tree = subtree(&pre.tree, None, depth);
                        (
                            Drafted {
                                tree,
                                ..Drafted::none(0.0)
                            },
                            Some(true),
                        )
                    }
                    pre => match self.draft(round, &widths).await {
                        DraftOutcome::Tree(d) => (*d, pre.map(|_| false)),
                        DraftOutcome::Failed(ms) => {
                            no_draft = Some(NoDraft::DraftFailed);
                            (Drafted::none(ms), None)
                        }
                        DraftOutcome::Deadline => break StopReason::Deadline,
                    },
                }
            };
            // Whatever its source, the tree fits the target's room after the sequence.
            let (room, levels) = self.target_room();
            if !drafted.tree.is_empty()
                && (drafted.tree.len() > room || drafted.tree.max_depth() >= levels)
            {
                let mut l = levels.min(drafted.tree.max_depth() + 1);
                let mut t = subtree(&drafted.tree, None, l);
                while l > 0 && t.len() > room {
                    l -= 1;
                    t = subtree(&drafted.tree, None, l);
                }
                drafted.tree = t;
                if drafted.tree.is_empty() {
                    no_draft = Some(NoDraft::Limit);
                }
            }
            let depth = if drafted.tree.is_empty() {
                0
            } else {
                drafted.tree.max_depth() + 1
            };
            let overlap =
                (self.cfg.pipeline == Pipeline::Overlapped || first) && !widths.is_empty();
            // The guess for the overlapped pre-draft: the tree's first-child path is accepted.
            let guess = first_child_path(&drafted.tree);
            let mut pre = None;
            if overlap && (first || depth > 0) && remaining > guess.len() + 1 {
                let mut ctx = self.seq.clone();
                ctx.extend(guess.iter().map(|&i| drafted.tree.token(i)));
                let mut pre_widths = vec![1];
                pre_widths.extend_from_slice(&widths);
                if self.draft_accepts(ctx.len(), &pre_widths) {
                    pre = Some(self.spawn_predraft(ctx, pre_widths));
                }
            }
            let verdict = match self.verify(&drafted.tree).await {
                Ok(v) => v,
                Err(e) => {
                    // No request outlives the generation.
                    if let Some(p) = pre {
                        p.abort();
                    }
                    return Err(e);
                }
            };
            let Some((v, verify_ms, server)) = verdict else {
                if let Some(p) = pre {
                    p.abort();
                }
                break StopReason::Deadline;
            };
            let mut emitted: Vec<u32> = v.accepted.clone();
            emitted.push(v.next);
            if self.cfg.adaptive_depth && !drafted.tree.is_empty() {
                self.depth
                    .observe(depth, v.accepted.len(), drafted.ms, verify_ms);
            }
            // Cut at a stop token or at max_tokens.
            let mut stop_now = None;
            if let Some(k) = emitted
                .iter()
                .position(|t| self.o.eos.contains(t) || self.cfg.stop_token_ids.contains(t))
            {
                emitted.truncate(k + 1);
                stop_now = Some(StopReason::Eos);
            }
            if out.len() + emitted.len() >= self.cfg.max_tokens {
                emitted.truncate(self.cfg.max_tokens - out.len());
                stop_now.get_or_insert(StopReason::MaxTokens);
            }
            if out.is_empty() {
                ttft_ms = start.elapsed().as_secs_f64() * 1e3;
            }
            // The tokens go out before the wait for a pre-draft running beside the verify.
            on_tokens(&emitted);
            let (mut predraft_wait_ms, mut predraft_server_ms, mut predraft_model_ms) =
                (0.0, 0.0, 0.0);
            if let Some(pre) = pre {
                let waited = Instant::now();
                let answer = pre
                    .await
                    .map_err(|e| OrchestratorError::Runtime(e.to_string()))?;
                predraft_wait_ms = waited.elapsed().as_secs_f64() * 1e3;
                match answer {
                    Ok(Ok(pre)) => {
                        self.backoff.succeed();
                        (predraft_server_ms, predraft_model_ms) = (pre.server_ms, pre.model_ms);
                        // Use the pre-drafted tree when the guess held and its root is the
                        // target's token.
                        let hit = v.accepted_nodes == guess
                            && pre.tree.roots().next().map(|r| pre.tree.token(r)) == Some(v.next);
                        let tree = if hit {
                            subtree(&pre.tree, Some(0), usize::MAX)
                        } else {
                            TokenTree::new()
                        };
                        next_tree = Some(Drafted {
                            tree,
                            ..Drafted::none(0.0)
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
            }
            let full_send = self.target_cached.is_none();
            out.extend_from_slice(&emitted);
            self.seq.extend_from_slice(&emitted);
            self.pending = vec![v.next];
            self.target_cached = Some(v.cached_len);
            let round_ms = round_start.elapsed().as_secs_f64() * 1e3;
            // A round that sent the whole sequence (a prefill) says nothing about the pace.
            if self.cfg.mode == Mode::Spec && !full_send {
                if drafted.tree.is_empty() {
                    self.governor.observe_target_only(emitted.len(), round_ms);
                } else {
                    self.governor
                        .observe_spec(emitted.len(), round_ms, verify_ms);
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
            rounds.push(RoundRecord {
                drafted: depth,
                tree_nodes: drafted.tree.len(),
                accepted: v.accepted.len(),
                emitted,
                draft_ms: drafted.ms,
                draft_server_ms: drafted.server_ms,
                verify_ms,
                verify_server_ms: server.wall_ms,
                draft_model_ms: drafted.model_ms,
                verify_model_ms: server.model_ms,
                round_ms,
                overlap_hit,
                predraft_wait_ms,
                predraft_server_ms,
                predraft_model_ms,
                no_draft: if drafted.tree.is_empty() {
                    no_draft.or(Some(NoDraft::Limit))
                } else {
                    None
                },
            });
            if let Some(s) = stop_now {
                break s;
            }
        };
        let elapsed = start.elapsed().as_secs_f64();
        let mut stats = GenerationStats::from_rounds(&rounds, elapsed, ttft_ms);
        stats.draft_failures = self.draft_failures;
        stats.speed_switches = self.switches;
        Ok(Generation {
            stats,
            token_ids: out,
            stop_reason: stop,
            rounds,
        })
    }

    /// Verifies `tree`, by delta when the target holds the session, else with the full
    /// sequence; a lost session or a restarted target gets the full sequence again. `None`
    /// when the generation's deadline passed first.
    async fn verify(
        &mut self,
        tree: &TokenTree,
    ) -> Result<Option<(Verified, f64, ServerTimes)>, OrchestratorError> {
        // Built once; only a retry builds it again.
        let mut wire = Some(tree.to_proto());
        let give_up = Instant::now() + RECONNECT_WINDOW;
        let mut backoff = Duration::from_millis(50);
        let rpc_timeout = Duration::from_millis(self.cfg.rpc_timeout_ms);
        loop {
            let (draft_tree, root_distribution) = wire.take().unwrap_or_else(|| tree.to_proto());
            let mut req = VerifyRequest {
                request_id: format!("{}-{}", self.session, self.request_no),
                session_id: self.session.to_string(),
                draft_tree,
                root_distribution,
                siblings_without_replacement: tree.siblings_without_replacement(),
                temperature: self.cfg.temperature,
                sampling: Some(self.cfg.sampling()),
                session_secret: self.secret.to_string(),
                ..Default::default()
            };
            self.request_no += 1;
            match self.target_cached {
                Some(len) => {
                    req.new_token_ids = self.pending.iter().map(|&t| t as i32).collect();
                    req.expected_prefix_length = len as i32;
                }
                None => req.prompt_token_ids = self.seq.iter().map(|&t| t as i32).collect(),
            }
            let t0 = Instant::now();
            let mut target = self.o.target.clone();
            let until = self.bounded(t0 + rpc_timeout);
            let call = self.o.rt.in_flight(target.verify_drafts(req));
            let answer = match tokio::time::timeout_at(until.into(), call).await {
                Ok(a) => a,
                Err(_) if self.past_deadline() => return Ok(None),
                Err(_) if Instant::now() < give_up => {
                    tracing::warn!(
                        addr = %self.o.target_addr,
                        "target did not answer within {} ms; retrying",
                        self.cfg.rpc_timeout_ms
                    );
                    // The request may or may not have reached the session.
                    self.target_cached = None;
                    continue;
                }
                Err(_) => {
                    return Err(OrchestratorError::Timeout {
                        worker: "target",
                        after_ms: self.cfg.rpc_timeout_ms,
                    })
                }
            };
            match answer {
                Ok(r) => {
                    let ms = t0.elapsed().as_secs_f64() * 1e3;
                    let r = r.into_inner();
                    self.o
                        .rt
                        .observe_device(r.telemetry.as_ref().map(|t| t.device.as_str()));
                    let server = ServerTimes::of(r.telemetry.as_ref());
                    return Ok(Some((Verified::from_response(&r, tree)?, ms, server)));
                }
                Err(s) if s.code() == Code::FailedPrecondition && self.target_cached.is_some() => {
                    tracing::warn!(
                        "target lost the session ({}); resending the full context",
                        short(s.message())
                    );
                    tracing::debug!(session = self.session, "session lost on the target");
                    self.target_cached = None;
                }
                Err(s)
                    if matches!(s.code(), Code::Unavailable | Code::Unknown)
                        && Instant::now() < give_up =>
                {
                    tracing::warn!(addr = %self.o.target_addr, "target unavailable ({}); retrying", short(s.message()));
                    tokio::time::sleep_until(self.bounded(Instant::now() + backoff).into()).await;
                    if self.past_deadline() {
                        return Ok(None);
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    // A restarted target holds no session: start over with the full context.
                    self.target_cached = None;
                }
                Err(s) => return Err(rpc("target")(s)),
            }
        }
    }
}

/// A limit a worker reported, `usize::MAX` where it did not say (0).
fn known(limit: usize) -> usize {
    if limit == 0 {
        usize::MAX
    } else {
        limit
    }
}

/// Nodes of a full tree with `widths` children per level.
fn tree_size(widths: &[usize]) -> usize {
    let mut level = 1usize;
    let mut total = 0usize;
    for &w in widths {
        level = level.saturating_mul(w);
        total = total.saturating_add(level);
    }
    total
}

/// `widths` cut to at most `levels` levels and at most `nodes` nodes in all: the deepest
/// levels go first, and a single level too wide is narrowed. Empty when no node fits.
fn fit_tree_widths(widths: &[usize], nodes: usize, levels: usize) -> Vec<usize> {
    let mut w: Vec<usize> = widths.iter().copied().take(levels).collect();
    while w.len() > 1 && tree_size(&w) > nodes {
        w.pop();
    }
    if let Some(first) = w.first_mut() {
        *first = (*first).min(nodes);
        if *first == 0 {
            w.clear();
        }
    }
    w
}

/// `text` cut to a length fit for a log line or an error message.
fn short(text: &str) -> String {
    const MAX: usize = 200;
    match text.char_indices().nth(MAX) {
        Some((i, _)) => format!("{}…", &text[..i]),
        None => text.to_string(),
    }
}

#[allow(clippy::too_many_arguments)]
async fn draft_call(
    o: &Orchestrator,
    session: &str,
    secret: &str,
    cfg: &GenerateConfig,
    request_no: u64,
    seq: &[u32],
    widths: &[usize],
    limits: &TreeLimits,
) -> Result<Drafted, OrchestratorError> {
    let Some(draft) = &o.draft else {
        return Err(OrchestratorError::Config("no draft worker".into()));
    };
    let req = DraftRequest {
        request_id: format!("{session}-{request_no}"),
        prompt_token_ids: seq.iter().map(|&t| t as i32).collect(),
        max_draft_len: widths.len() as i32,
        num_beams: widths.first().copied().unwrap_or(1) as i32,
        temperature: Some(cfg.temperature),
        reset_cache: false,
        session_id: session.to_string(),
        tree_widths: widths.iter().map(|&w| w as i32).collect(),
        sampling: Some(cfg.sampling()),
        session_secret: secret.to_string(),
    };
    let t0 = Instant::now();
    let mut d = draft.clone();
    let r =
        o.rt.in_flight(d.generate_drafts(req))
            .await
            .map_err(rpc("draft"))?
            .into_inner();
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    o.rt.observe_device(r.telemetry.as_ref().map(|t| t.device.as_str()));
    let server = ServerTimes::of(r.telemetry.as_ref());
    let tree = TokenTree::from_proto(
        &r.draft_tree,
        r.root_distribution.as_ref(),
        r.siblings_without_replacement,
        limits,
    )
    .map_err(|e| OrchestratorError::Protocol(format!("draft worker sent a bad tree: {e}")))?;
    Ok(Drafted {
        tree,
        ms,
        server_ms: server.wall_ms,
        model_ms: server.model_ms,
    })
}

/// The times a worker reported for one request (0 where it sent no telemetry).
struct ServerTimes {
    wall_ms: f64,
    model_ms: f64,
}

impl ServerTimes {
    fn of(t: Option<&specsplit_proto::TelemetryMetadata>) -> Self {
        Self {
            wall_ms: t.map_or(0.0, |t| t.wall_time_ms),
            model_ms: t.map_or(0.0, |t| t.model_time_ms),
        }
    }
}

/// A verdict as received.
struct Verified {
    accepted: Vec<u32>,
    accepted_nodes: Vec<usize>,
    next: u32,
    cached_len: usize,
}

impl Verified {
    fn from_response(
        r: &specsplit_proto::VerifyResponse,
        tree: &TokenTree,
    ) -> Result<Self, OrchestratorError> {
        let accepted: Vec<u32> = r.accepted_token_ids.iter().map(|&t| t as u32).collect();
        let accepted_nodes: Vec<usize> = if r.accepted_node_indices.len() == accepted.len() {
            r.accepted_node_indices
                .iter()
                .map(|&i| i as usize)
                .collect()
        } else {
            // A peer without node indices: recover the path by walking the tree.
            path_of_tokens(tree, &accepted).ok_or_else(|| {
                OrchestratorError::Protocol("accepted tokens are not a path of the tree".into())
            })?
        };
        if !r.has_correction {
            return Err(OrchestratorError::Protocol(
                "the target returned no next token".into(),
            ));
        }
        Ok(Self {
            accepted,
            accepted_nodes,
            next: r.correction_token_id as u32,
            cached_len: r.cached_length.max(0) as usize,
        })
    }
}

/// Node indices of the path from a root whose tokens are `tokens`, if any.
fn path_of_tokens(tree: &TokenTree, tokens: &[u32]) -> Option<Vec<usize>> {
    let mut path = Vec::with_capacity(tokens.len());
    let mut candidates: Vec<usize> = tree.roots().collect();
    for &t in tokens {
        let n = *candidates.iter().find(|&&i| tree.token(i) == t)?;
        path.push(n);
        candidates = tree.children(n).collect();
    }
    Some(path)
}

/// The path that follows the first child from the first root down to a leaf.
fn first_child_path(tree: &TokenTree) -> Vec<usize> {
    let mut path = Vec::new();
    let mut next = tree.roots().next();
    while let Some(n) = next {
        path.push(n);
        next = tree.children(n).next();
    }
    path
}

/// The part of `tree` below `root` (excluded; `None` = the whole tree) down to `levels` levels,
/// as a tree of its own: `root`'s children become roots and `root`'s child distribution becomes
/// the root distribution.
fn subtree(tree: &TokenTree, root: Option<usize>, levels: usize) -> TokenTree {
    let mut t = TokenTree::new();
    t.set_siblings_without_replacement(tree.siblings_without_replacement());
    let (top, root_dist) = match root {
        Some(r) => (tree.children(r), tree.child_distribution(r)),
        None => (tree.roots(), tree.root_distribution()),
    };
    if let Some(d) = root_dist {
        t.set_root_distribution(d.clone());
    }
    // Breadth-first over the descendants keeps the new tree breadth-first.
    let mut queue: std::collections::VecDeque<(usize, Option<usize>, usize)> =
        top.map(|c| (c, None, 0)).collect();
    while let Some((old, parent, level)) = queue.pop_front() {
        if level >= levels {
            continue;
        }
        let new = match parent {
            None => t.push_root(tree.token(old), tree.log_prob(old)),
            Some(p) => t.push_child(p, tree.token(old), tree.log_prob(old)),
        }
        .expect("breadth-first copy of a valid tree");
        if level + 1 < levels {
            if let Some(d) = tree.child_distribution(old) {
                t.set_child_distribution(new, d.clone())
                    .expect("node just added");
            }
        }
        queue.extend(tree.children(old).map(|c| (c, Some(new), level + 1)));
    }
    t
}

#[cfg(test)]
mod tests {
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

    fn sample_tree() -> TokenTree {
        // roots 10, 11; 10 -> 20, 21; 11 -> 22; 20 -> 30
        let mut t = TokenTree::new();
        t.push_root(10, -0.1).unwrap();
        t.push_root(11, -0.2).unwrap();
        t.push_child(0, 20, -0.3).unwrap();
        t.push_child(0, 21, -0.4).unwrap();
        t.push_child(1, 22, -0.5).unwrap();
        t.push_child(2, 30, -0.6).unwrap();
        t
    }

    #[test]
    fn subtree_reroots_and_prunes() {
        let t = sample_tree();
        let s = subtree(&t, Some(0), usize::MAX);
        assert_eq!(s.tokens(), &[20, 21, 30]);
        assert_eq!(s.parent(2), Some(0));
        let p = subtree(&t, None, 2);
        assert_eq!(p.tokens(), &[10, 11, 20, 21, 22]);
        assert_eq!(p.max_depth(), 1);
        let whole = subtree(&t, None, usize::MAX);
        assert_eq!(whole.tokens(), t.tokens());
    }

    #[test]
    fn trees_are_cut_to_the_room_left() {
        assert_eq!(tree_size(&[4, 2, 1]), 4 + 8 + 8);
        assert_eq!(tree_size(&[]), 0);
        assert_eq!(tree_size(&[usize::MAX, 2]), usize::MAX, "saturates");
        assert_eq!(fit_tree_widths(&[4, 2, 1], 100, usize::MAX), vec![4, 2, 1]);
        assert_eq!(fit_tree_widths(&[4, 2, 1], 19, usize::MAX), vec![4, 2]);
        assert_eq!(fit_tree_widths(&[4, 2, 1], 11, usize::MAX), vec![4]);
        assert_eq!(fit_tree_widths(&[4, 2, 1], 3, usize::MAX), vec![3]);
        assert_eq!(
            fit_tree_widths(&[4, 2, 1], 0, usize::MAX),
            Vec::<usize>::new()
        );
        assert_eq!(fit_tree_widths(&[1, 1, 1, 1], 100, 2), vec![1, 1]);
        assert_eq!(known(0), usize::MAX);
        assert_eq!(known(64), 64);
    }

    #[test]
    fn secrets_are_fresh_128_bit_hex_strings() {
        let (a, b) = (new_secret(), new_secret());
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
        assert_ne!(a, b);
        let long = "x".repeat(1000);
        assert_eq!(short(&long).chars().count(), 201);
        assert_eq!(short("brief"), "brief");
    }

    #[test]
    fn first_child_path_and_token_paths() {
        let t = sample_tree();
        assert_eq!(first_child_path(&t), vec![0, 2, 5]);
        assert_eq!(path_of_tokens(&t, &[11, 22]), Some(vec![1, 4]));
        assert_eq!(path_of_tokens(&t, &[11, 20]), None);
    }
}
