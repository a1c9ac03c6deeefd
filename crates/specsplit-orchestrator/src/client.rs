//! The round loop over gRPC clients of the two workers.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use specsplit_core::tree::{TokenTree, TreeLimits};
use specsplit_proto::draft_service_client::DraftServiceClient;
use specsplit_proto::target_service_client::TargetServiceClient;
use specsplit_proto::{DraftRequest, EndSessionRequest, PingRequest, VerifyRequest};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::adaptive::{resize_widths, DepthController};
use crate::stats::{GenerationStats, RoundRecord};
use crate::{GenerateConfig, Generation, Mode, Pipeline, StopReason};

/// Largest gRPC message sent or accepted (dense draft distributions are large).
const MAX_MESSAGE_BYTES: usize = 512 << 20;
/// How long to keep retrying a worker that is unreachable mid-generation (e.g. restarting).
const RECONNECT_WINDOW: Duration = Duration::from_secs(30);

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
    fn start() -> Result<Arc<Self>, OrchestratorError> {
        // Spinning only helps the runtime that runs the channels' tasks.
        Self::start_with(if own_runtime() {
            client_spin()
        } else {
            SpinMode::Never
        })
    }

    /// [`ClientRuntime::start`], busy-polling while RPCs are in flight as `spin` says.
    fn start_with(spin: SpinMode) -> Result<Arc<Self>, OrchestratorError> {
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
        let spin = (spin != SpinMode::Never).then(|| {
            let s = Arc::new(Spin::default());
            let on = spin == SpinMode::Always;
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

    /// Notes the device a worker reported for a request: in [`SpinMode::OnGpu`], a CUDA device
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
/// [`SpinMode`] for when it is on.
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

/// When a client runtime busy-polls while RPCs are in flight ([`Spin`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SpinMode {
    /// Never (`SPECSPLIT_CLIENT_SPIN=0`).
    Never,
    /// For every RPC (`SPECSPLIT_CLIENT_SPIN=1`).
    Always,
    /// Once a worker has reported a CUDA device in a response's telemetry (the default): GPU
    /// hosts have cores to spare, while a CPU worker in the same process needs every core.
    OnGpu,
}

/// The client runtimes' [`SpinMode`], from `SPECSPLIT_CLIENT_SPIN`.
fn client_spin() -> SpinMode {
    static SPIN: std::sync::OnceLock<SpinMode> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| match std::env::var("SPECSPLIT_CLIENT_SPIN").as_deref() {
        Ok("1") => SpinMode::Always,
        Ok("0") => SpinMode::Never,
        _ => SpinMode::OnGpu,
    })
}

/// Whether a speculative generation's first round drafts beside the target's prefill:
/// `SPECSPLIT_FIRST_ROUND_OVERLAP=1` always, `0` never, and by default with the overlapped
/// pipeline only (the one for workers on their own devices: two workers sharing one GPU slow
/// each other's first passes about twofold, H100, thirteenth session). Otherwise the first
/// round drafts first and verifies the tree with the prefill, as later rounds do.
fn first_round_overlap(pipeline: Pipeline) -> bool {
    static SET: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    SET.get_or_init(|| {
        match std::env::var("SPECSPLIT_FIRST_ROUND_OVERLAP")
            .as_deref()
            .map(str::trim)
        {
            Ok("0") => Some(false),
            Ok("1") => Some(true),
            _ => None,
        }
    })
    .unwrap_or(pipeline == Pipeline::Overlapped)
}

/// Whether orchestrators run on their own [`ClientRuntime`] thread (the default);
/// `SPECSPLIT_OWN_RUNTIME=0` keeps the channels and round loops on the caller's runtime
/// instead, for side-by-side measurements of the two.
fn own_runtime() -> bool {
    static OWN: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OWN.get_or_init(|| std::env::var("SPECSPLIT_OWN_RUNTIME").map_or(true, |v| v != "0"))
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
    Endpoint::from_shared(uri)
        .map_err(|e| unreachable(format!("bad address: {e}")))?
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true)
        .connect()
        .await
        .map_err(|e| unreachable(format!("{e} (is the worker running and listening there?)")))
}

impl Orchestrator {
    /// Connects to the workers (no draft for target-only decoding), pings both and checks that
    /// their vocabularies match.
    pub async fn connect(
        draft_addr: Option<&str>,
        target_addr: &str,
    ) -> Result<Self, OrchestratorError> {
        let rt = ClientRuntime::start()?;
        if !own_runtime() {
            return Self::connect_here(draft_addr, target_addr, rt).await;
        }
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
        let tp = target
            .ping(PingRequest {})
            .await
            .map_err(|s| OrchestratorError::Unreachable {
                worker: "target",
                addr: target_addr.into(),
                reason: s.message().to_string(),
            })?
            .into_inner();
        let mut eos: Vec<u32> = tp.eos_token_ids.iter().map(|&t| t as u32).collect();
        let draft = match draft_addr {
            None => None,
            Some(addr) => {
                let mut d = DraftServiceClient::new(channel("draft", addr).await?)
                    .max_decoding_message_size(MAX_MESSAGE_BYTES)
                    .max_encoding_message_size(MAX_MESSAGE_BYTES);
                let dp = d
                    .ping(PingRequest {})
                    .await
                    .map_err(|s| OrchestratorError::Unreachable {
                        worker: "draft",
                        addr: addr.into(),
                        reason: s.message().to_string(),
                    })?
                    .into_inner();
                if dp.vocab_size != tp.vocab_size {
                    return Err(OrchestratorError::Incompatible(format!(
                        "the draft model '{}' has a vocabulary of {} tokens but the target model \
                         '{}' has {}: speculative decoding needs the same tokenizer on both sides",
                        dp.model_name, dp.vocab_size, tp.model_name, tp.vocab_size
                    )));
                }
                for t in dp.eos_token_ids {
                    if !eos.contains(&(t as u32)) {
                        eos.push(t as u32);
                    }
                }
                Some(d)
            }
        };
        Ok(Self {
            draft,
            target,
            target_addr: target_addr.to_string(),
            eos,
            vocab_size: tp.vocab_size.max(0) as usize,
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
        let session = format!("gen-{:032x}", rand::random::<u128>());
        // The round loop runs on the client runtime's thread, where the channels' tasks run
        // (see `ClientRuntime`), whatever polls the caller. The caller still calls `on_tokens`
        // itself, with every round's tokens, in order, before the result.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Vec<u32>>();
        let (o, cfg, prompt) = (self.clone(), cfg.clone(), prompt.to_vec());
        let body = async move {
            run_and_end(&o, &session, &cfg, &prompt, move |t| {
                // The receiver is gone only when the caller was dropped (and aborts us).
                let _ = tx.send(t.to_vec());
            })
            .await
        };
        let task = match tokio::runtime::Handle::try_current() {
            // The earlier arrangement, kept for side-by-side measurements: the loop on the
            // caller's runtime, where `connect` put the channels' tasks.
            Ok(caller) if !own_runtime() => AbortOnDrop(caller.spawn(body)),
            _ => self.rt.spawn(body),
        };
        let mut on_tokens = on_tokens;
        // The channel closes when the round loop returns (the sender is dropped with it).
        while let Some(t) = rx.recv().await {
            on_tokens(&t);
        }
        task.join().await
    }

    /// Ends `session` on both workers (best effort: a dead worker holds none anyway).
    async fn end_sessions(&self, session: &str) {
        let end = EndSessionRequest {
            session_id: session.to_string(),
            ..Default::default()
        };
        let mut target = self.target.clone();
        let _ = tokio::time::timeout(Duration::from_secs(5), target.end_session(end.clone())).await;
        if let Some(d) = &self.draft {
            let mut d = d.clone();
            let _ = tokio::time::timeout(Duration::from_secs(5), d.end_session(end)).await;
        }
    }
}

/// Runs a generation's round loop, then ends its sessions whatever happened.
async fn run_and_end(
    o: &Orchestrator,
    session: &str,
    cfg: &GenerateConfig,
    prompt: &[u32],
    on_tokens: impl FnMut(&[u32]),
) -> Result<Generation, OrchestratorError> {
    let result = Run::new(o, session, cfg).run(prompt, on_tokens).await;
    o.end_sessions(session).await;
    result
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

/// State of one generation.
struct Run<'a> {
    o: &'a Orchestrator,
    session: &'a str,
    cfg: &'a GenerateConfig,
    /// Prompt + emitted tokens.
    seq: Vec<u32>,
    /// Cached length the target reported, and the tokens it has not cached yet.
    target_cached: Option<usize>,
    pending: Vec<u32>,
    depth: DepthController,
    widths: Vec<usize>,
    request_no: u64,
}

impl<'a> Run<'a> {
    fn new(o: &'a Orchestrator, session: &'a str, cfg: &'a GenerateConfig) -> Self {
        Self {
            o,
            session,
            cfg,
            seq: Vec::new(),
            target_cached: None,
            pending: Vec::new(),
            depth: DepthController::new(cfg.min_depth, cfg.max_depth),
            widths: cfg.widths.clone(),
            request_no: 0,
        }
    }

    fn limits(&self) -> TreeLimits {
        TreeLimits {
            max_nodes: 1 << 16,
            max_depth: 1 << 10,
            vocab_size: self.o.vocab_size,
        }
    }

    async fn run(
        mut self,
        prompt: &[u32],
        mut on_tokens: impl FnMut(&[u32]),
    ) -> Result<Generation, OrchestratorError> {
        let start = Instant::now();
        let deadline =
            (self.cfg.deadline_ms > 0).then(|| start + Duration::from_millis(self.cfg.deadline_ms));
        self.seq = prompt.to_vec();
        let mut out: Vec<u32> = Vec::new();
        let mut rounds: Vec<RoundRecord> = Vec::new();
        let mut ttft_ms = 0.0;
        // The pre-drafted next tree (empty after a miss).
        let mut next_tree: Option<Drafted> = None;
        let stop = loop {
            if out.len() >= self.cfg.max_tokens {
                break StopReason::MaxTokens;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                break StopReason::Deadline;
            }
            let round_start = Instant::now();
            let remaining = self.cfg.max_tokens - out.len();
            // Never draft deeper than what may still be emitted (accepted + 1 ≤ remaining).
            let depth = if self.cfg.mode == Mode::Ar {
                0
            } else {
                let d = if self.cfg.adaptive_depth {
                    self.depth.depth(self.widths.len())
                } else {
                    self.cfg.widths.len()
                };
                self.widths = resize_widths(&self.cfg.widths, d);
                d.min(remaining - 1)
            };
            let widths = resize_widths(&self.widths, depth);
            // The first round drafts beside the target's prefill: the target's first token
            // needs no draft, so the target decodes it as a plain step while the draft drafts
            // after the prompt (as an overlapped pre-draft does), and the part of that tree
            // below the root the target picked is verified next round.
            let first = rounds.is_empty() && depth > 0 && first_round_overlap(self.cfg.pipeline);
            let (drafted, overlap_hit) = if depth == 0 || first {
                let empty = Drafted {
                    tree: TokenTree::new(),
                    ms: 0.0,
                    server_ms: 0.0,
                    model_ms: 0.0,
                };
                (empty, None)
            } else {
                match next_tree.take() {
                    Some(pre) if !pre.tree.is_empty() => {
                        // Never deeper than what may still be emitted.
                        let tree = subtree(&pre.tree, None, depth);
                        let pre = Drafted {
                            tree,
                            ms: 0.0,
                            server_ms: 0.0,
                            model_ms: 0.0,
                        };
                        (pre, Some(true))
                    }
                    Some(_) => (self.draft(&widths).await?, Some(false)),
                    None => (self.draft(&widths).await?, None),
                }
            };
            let overlap = (self.cfg.pipeline == Pipeline::Overlapped || first) && depth > 0;
            // The guess for the overlapped pre-draft: the tree's first-child path is accepted.
            let guess = first_child_path(&drafted.tree);
            let (verdict, pre) = if overlap && remaining > guess.len() + 1 {
                let mut ctx = self.seq.clone();
                ctx.extend(guess.iter().map(|&i| drafted.tree.token(i)));
                let mut pre_widths = vec![1];
                pre_widths.extend_from_slice(&widths);
                let o = self.o.clone();
                let (sess, cfg, no) = (self.session.to_string(), self.cfg.clone(), self.request_no);
                self.request_no += 1;
                let limits = self.limits();
                let pre = tokio::spawn(async move {
                    draft_call(&o, &sess, &cfg, no, &ctx, &pre_widths, &limits).await
                });
                match self.verify(&drafted.tree).await {
                    Ok(v) => (v, Some(pre)),
                    Err(e) => {
                        // Wait for the pre-draft even on error so no request outlives the
                        // generation.
                        let _ = pre.await;
                        return Err(e);
                    }
                }
            } else {
                (self.verify(&drafted.tree).await?, None)
            };
            let (v, verify_ms, server) = verdict;
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
                let pre = pre
                    .await
                    .map_err(|e| OrchestratorError::Protocol(e.to_string()))??;
                predraft_wait_ms = waited.elapsed().as_secs_f64() * 1e3;
                (predraft_server_ms, predraft_model_ms) = (pre.server_ms, pre.model_ms);
                // Use the pre-drafted tree when the guess held and its root is the target's
                // token.
                let hit = v.accepted_nodes == guess
                    && pre.tree.roots().next().map(|r| pre.tree.token(r)) == Some(v.next);
                let tree = if hit {
                    subtree(&pre.tree, Some(0), usize::MAX)
                } else {
                    TokenTree::new()
                };
                next_tree = Some(Drafted {
                    tree,
                    ms: 0.0,
                    server_ms: 0.0,
                    model_ms: 0.0,
                });
            }
            out.extend_from_slice(&emitted);
            self.seq.extend_from_slice(&emitted);
            self.pending = vec![v.next];
            self.target_cached = Some(v.cached_len);
            let drafted_depth = if drafted.tree.is_empty() {
                0
            } else {
                drafted.tree.max_depth() + 1
            };
            rounds.push(RoundRecord {
                drafted: drafted_depth,
                tree_nodes: drafted.tree.len(),
                accepted: v.accepted.len(),
                emitted,
                draft_ms: drafted.ms,
                draft_server_ms: drafted.server_ms,
                verify_ms,
                verify_server_ms: server.wall_ms,
                draft_model_ms: drafted.model_ms,
                verify_model_ms: server.model_ms,
                round_ms: round_start.elapsed().as_secs_f64() * 1e3,
                overlap_hit,
                predraft_wait_ms,
                predraft_server_ms,
                predraft_model_ms,
            });
            if let Some(s) = stop_now {
                break s;
            }
        };
        let elapsed = start.elapsed().as_secs_f64();
        Ok(Generation {
            stats: GenerationStats::from_rounds(&rounds, elapsed, ttft_ms),
            token_ids: out,
            stop_reason: stop,
            rounds,
        })
    }

    /// Drafts after the whole sequence (the draft protocol has no delta form).
    async fn draft(&mut self, widths: &[usize]) -> Result<Drafted, OrchestratorError> {
        let no = self.request_no;
        self.request_no += 1;
        draft_call(
            self.o,
            self.session,
            self.cfg,
            no,
            &self.seq,
            widths,
            &self.limits(),
        )
        .await
    }

    /// Verifies `tree`, by delta when the target holds the session, else with the full
    /// sequence; a lost session or a restarted target gets the full sequence again.
    async fn verify(
        &mut self,
        tree: &TokenTree,
    ) -> Result<(Verified, f64, ServerTimes), OrchestratorError> {
        // Built once; only a retry builds it again.
        let mut wire = Some(tree.to_proto());
        let give_up = Instant::now() + RECONNECT_WINDOW;
        let mut backoff = Duration::from_millis(50);
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
            match self.o.rt.in_flight(target.verify_drafts(req)).await {
                Ok(r) => {
                    let ms = t0.elapsed().as_secs_f64() * 1e3;
                    let r = r.into_inner();
                    self.o
                        .rt
                        .observe_device(r.telemetry.as_ref().map(|t| t.device.as_str()));
                    let server = ServerTimes::of(r.telemetry.as_ref());
                    return Ok((Verified::from_response(&r, tree)?, ms, server));
                }
                Err(s) if s.code() == Code::FailedPrecondition && self.target_cached.is_some() => {
                    tracing::warn!(
                        session = self.session,
                        "target lost the session ({}); resending the full context",
                        s.message()
                    );
                    self.target_cached = None;
                }
                Err(s)
                    if matches!(s.code(), Code::Unavailable | Code::Unknown)
                        && Instant::now() < give_up =>
                {
                    tracing::warn!(addr = %self.o.target_addr, "target unavailable ({}); retrying", s.message());
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    // A restarted target holds no session: start over with the full context.
                    self.target_cached = None;
                }
                Err(s) => return Err(rpc("target")(s)),
            }
        }
    }
}

async fn draft_call(
    o: &Orchestrator,
    session: &str,
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
        ..Default::default()
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
        let rt = ClientRuntime::start().unwrap();
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
        let rt = ClientRuntime::start_with(SpinMode::Always).unwrap();
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
        let rt = ClientRuntime::start_with(SpinMode::OnGpu).unwrap();
        let spin = rt.spin.clone().expect("the spinner waits for a GPU worker");
        let enabled = || spin.enabled.load(std::sync::atomic::Ordering::Acquire);
        assert!(!enabled());
        rt.observe_device(Some("cpu"));
        rt.observe_device(None);
        assert!(!enabled(), "CPU workers need every core");
        rt.observe_device(Some("cuda:0"));
        assert!(enabled());
        assert!(ClientRuntime::start_with(SpinMode::Never)
            .unwrap()
            .spin
            .is_none());
    }

    #[test]
    fn dropping_a_task_handle_aborts_it_and_lets_the_thread_stop() {
        let rt = ClientRuntime::start().unwrap();
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
        let rt = ClientRuntime::start().unwrap();
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
    fn first_child_path_and_token_paths() {
        let t = sample_tree();
        assert_eq!(first_child_path(&t), vec![0, 2, 5]);
        assert_eq!(path_of_tokens(&t, &[11, 22]), Some(vec![1, 4]));
        assert_eq!(path_of_tokens(&t, &[11, 20]), None);
    }
}
