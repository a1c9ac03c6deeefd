//! gRPC services over the engines: request validation, session lookup, status codes,
//! telemetry, the standard health service, TTL sweeping and graceful shutdown.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use specsplit_core::sampling::SamplingParams;
use specsplit_core::tree::{TokenTree, TreeLimits};
use specsplit_proto::convert::{SamplingWire, TreeWire};
use specsplit_proto::draft_service_server::{DraftService, DraftServiceServer};
use specsplit_proto::health::health_check_response::ServingStatus;
use specsplit_proto::health::health_server::HealthServer;
use specsplit_proto::health::{HealthCheckRequest, HealthCheckResponse};
use specsplit_proto::target_service_server::{TargetService, TargetServiceServer};
use specsplit_proto::{
    DraftRequest, DraftResponse, EndSessionRequest, EndSessionResponse, PingRequest, PingResponse,
    TelemetryMetadata, VerifyRequest, VerifyResponse,
};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

use crate::draft::{tree_size, DraftEngine, DraftParams, DraftSession};
use crate::error::CACHE_EVICTED_MARKER;
use crate::session::{SessionHandle, SessionLimits, SessionSecret, SessionStore};
use crate::target::{Prefix, TargetEngine, TargetSession};
use crate::EngineError;

/// Longest `request_id`, `session_id` or `session_secret` accepted, in bytes.
pub const MAX_ID_BYTES: usize = 256;

/// Wire bytes allowed for a message's fields beyond its tokens and tree (ids, sampling
/// parameters, tags and length prefixes).
const MESSAGE_SLACK_BYTES: usize = 64 << 10;

/// Wire bytes of one token id at most (an `int32` varint; negative ones take 10).
const TOKEN_WIRE_BYTES: usize = 10;

/// Wire bytes of one tree node besides its distribution (token, log-probability, nesting).
const NODE_WIRE_BYTES: usize = 64;

/// Largest health-check message accepted (a service name).
const MAX_HEALTH_MESSAGE_BYTES: usize = 4 << 10;

/// Identity and limits a worker reports and enforces.
#[derive(Debug, Clone)]
pub struct WorkerInfo {
    /// Name of the loaded model.
    pub model_name: String,
    /// Vocabulary size (logit rows).
    pub vocab_size: usize,
    /// End-of-sequence token ids.
    pub eos_token_ids: Vec<u32>,
    /// Tokens one session may hold.
    pub max_context: usize,
    /// Most nodes of a draft tree.
    pub max_tree_nodes: usize,
    /// Most tokens on a root-to-leaf path of a draft tree (at most
    /// [`specsplit_proto::codec::MAX_WIRE_TREE_DEPTH`]).
    pub max_tree_depth: usize,
    /// Most tokens one request may carry.
    pub max_prompt_len: usize,
    /// Device label for telemetry, e.g. "cpu" or "cuda:0".
    pub device: String,
}

impl WorkerInfo {
    fn ping(&self, worker_type: &str) -> PingResponse {
        PingResponse {
            status: "ok".into(),
            worker_type: worker_type.into(),
            model_name: self.model_name.clone(),
            vocab_size: self.vocab_size as i32,
            eos_token_ids: self.eos_token_ids.iter().map(|&t| t as i32).collect(),
            max_context: self.max_context as i32,
            max_prompt_len: self.max_prompt_len as i32,
            max_tree_nodes: self.max_tree_nodes as i32,
            max_tree_depth: self.tree_depth() as i32,
        }
    }

    /// The deepest tree drafted or verified: `max_tree_depth`, within the wire's limit and
    /// the tree's node count.
    pub fn tree_depth(&self) -> usize {
        self.max_tree_depth
            .min(specsplit_proto::codec::MAX_WIRE_TREE_DEPTH)
            .min(self.max_tree_nodes)
    }

    /// Wire bytes of the largest draft tree allowed: `max_tree_nodes` nodes and a root, each
    /// with a distribution over the whole vocabulary (sparse at full support: 8 bytes an entry).
    fn tree_wire_bytes(&self) -> usize {
        (self.max_tree_nodes.saturating_add(1)).saturating_mul(
            self.vocab_size
                .saturating_mul(8)
                .saturating_add(NODE_WIRE_BYTES),
        )
    }

    /// The largest `DraftRequest` a draft worker decodes (a longer message is refused from its
    /// length prefix, before it is read): `max_prompt_len` tokens and `max_tree_depth` widths at
    /// 10 bytes each, plus 64 KiB.
    pub fn max_draft_request_bytes(&self) -> usize {
        self.max_prompt_len
            .saturating_add(self.tree_depth())
            .saturating_mul(TOKEN_WIRE_BYTES)
            .saturating_add(MESSAGE_SLACK_BYTES)
    }

    /// The largest `VerifyRequest` a target worker decodes (a longer message is refused from
    /// its length prefix, before it is read): two token lists of `max_prompt_len` (prompt and
    /// new tokens) at 10 bytes a token, `max_tree_nodes + 1` nodes of 8 bytes per vocabulary
    /// entry plus 64 each, plus 64 KiB. The largest `DraftResponse` a draft worker sends is
    /// bounded the same way.
    pub fn max_verify_request_bytes(&self) -> usize {
        self.max_prompt_len
            .saturating_mul(2 * TOKEN_WIRE_BYTES)
            .saturating_add(self.tree_wire_bytes())
            .saturating_add(MESSAGE_SLACK_BYTES)
    }

    /// The INVALID_ARGUMENT status of a request that asks for a size beyond a limit.
    fn over(field: &str, value: usize, max: usize, setting: &str) -> Status {
        Status::invalid_argument(format!(
            "{field} is {value}; this worker accepts at most {max} ({setting})"
        ))
    }

    fn tokens(&self, ids: &[i32], what: &str) -> Result<Vec<u32>, Status> {
        if ids.len() > self.max_prompt_len {
            return Err(Status::invalid_argument(format!(
                "{what} has {} tokens; this worker accepts at most {} (max_prompt_len)",
                ids.len(),
                self.max_prompt_len
            )));
        }
        ids.iter()
            .enumerate()
            .map(|(i, &t)| {
                if t < 0 || t as usize >= self.vocab_size {
                    Err(Status::invalid_argument(format!(
                        "{what}[{i}] = {t} is outside the vocabulary [0, {})",
                        self.vocab_size
                    )))
                } else {
                    Ok(t as u32)
                }
            })
            .collect()
    }

    fn telemetry(&self, start: Instant, model: Duration, tokens: usize) -> TelemetryMetadata {
        TelemetryMetadata {
            span_id: format!("{:016x}", rand::random::<u64>()),
            wall_time_ms: start.elapsed().as_secs_f64() * 1e3,
            model_time_ms: model.as_secs_f64() * 1e3,
            tokens_processed: tokens as i32,
            device: self.device.clone(),
        }
    }
}

fn sampling_from(
    full: Option<&specsplit_proto::SamplingParams>,
    temperature: f32,
) -> Result<SamplingParams, Status> {
    let p = match full {
        Some(p) => SamplingParams::from_proto(p),
        None => SamplingParams::from_proto(&specsplit_proto::SamplingParams {
            temperature,
            ..Default::default()
        }),
    };
    p.map_err(|e| Status::invalid_argument(format!("sampling parameters: {e}")))
}

/// Refuses identifiers longer than [`MAX_ID_BYTES`] (INVALID_ARGUMENT, naming the field).
fn check_ids(ids: &[(&str, &str)]) -> Result<(), Status> {
    for (field, value) in ids {
        if value.len() > MAX_ID_BYTES {
            return Err(Status::invalid_argument(format!(
                "{field} is {} bytes long; at most {MAX_ID_BYTES} are accepted",
                value.len()
            )));
        }
    }
    Ok(())
}

/// Refuses a tree whose distributions or top-k lists have more entries than the vocabulary
/// (INVALID_ARGUMENT, naming where), before they are converted.
fn check_distribution_sizes(r: &VerifyRequest, vocab: usize) -> Result<(), Status> {
    let over = |what: &str, n: usize| {
        Status::invalid_argument(format!(
            "{what} has {n} entries; at most the vocabulary size {vocab}"
        ))
    };
    if let Some(d) = &r.root_distribution {
        let n = d.token_ids.len().max(d.probs.len());
        if n > vocab {
            return Err(over("root_distribution", n));
        }
    }
    let mut stack: Vec<&specsplit_proto::TokenNode> = r.draft_tree.iter().collect();
    while let Some(node) = stack.pop() {
        if let Some(d) = &node.child_distribution {
            let n = d.token_ids.len().max(d.probs.len());
            if n > vocab {
                return Err(over("a child_distribution in draft_tree", n));
            }
        }
        let n = node.top_k_token_ids.len().max(node.top_k_probs.len());
        if n > vocab {
            return Err(over("a top-k list in draft_tree", n));
        }
        stack.extend(node.children.iter());
    }
    Ok(())
}

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
    /// The default for a worker whose model runs on `device` (a [`WorkerInfo::device`] label):
    /// `Inline` on CUDA, `Pool` elsewhere.
    pub fn default_for(device: &str) -> Self {
        if on_cuda(device) {
            Self::Inline
        } else {
            Self::Pool
        }
    }
}

/// Whether a [`WorkerInfo::device`] label names a CUDA device (`cuda`, `cuda:N`).
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
    /// How a worker on `device` (a [`WorkerInfo::device`] label) runs its work:
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
    async fn run<S, T>(
        &self,
        session: SessionHandle<S>,
        f: impl FnOnce(&mut S) -> Result<T, EngineError> + Send + 'static,
    ) -> Result<T, Status>
    where
        S: Send + 'static,
        T: Send + 'static,
    {
        let out = with_session(session, self.placement, f).await?;
        if let Some(l) = &self.linger {
            l.extend();
        }
        Ok(out)
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

/// The draft worker's gRPC service.
pub struct DraftWorker {
    engine: Arc<DraftEngine>,
    store: Arc<SessionStore<DraftSession>>,
    info: WorkerInfo,
    exec: Execution,
}

impl DraftWorker {
    /// A service over `engine` with sessions bounded by `limits`; its model work is placed
    /// by [`WorkPlacement::default_for`] its device.
    pub fn new(engine: Arc<DraftEngine>, limits: SessionLimits, info: WorkerInfo) -> Self {
        Self {
            engine,
            store: Arc::new(SessionStore::new(limits)),
            exec: Execution::for_device(&info.device, None),
            info,
        }
    }

    /// This worker running its model work as `exec` says (the default:
    /// [`Execution::for_device`]).
    pub fn with_execution(mut self, exec: Execution) -> Self {
        self.exec = exec;
        self
    }

    /// How this worker runs its model work.
    pub fn execution(&self) -> &Execution {
        &self.exec
    }

    /// The session store (for inspection and sweeping).
    pub fn sessions(&self) -> Arc<SessionStore<DraftSession>> {
        self.store.clone()
    }

    /// The tree shape a request asks for, each size checked against this worker's limits
    /// before anything is allocated.
    fn widths(&self, r: &DraftRequest) -> Result<Vec<usize>, Status> {
        let max_depth = self.info.tree_depth();
        let max_nodes = self.info.max_tree_nodes;
        let widths: Vec<usize> = if !r.tree_widths.is_empty() {
            if r.tree_widths.len() > max_depth {
                return Err(WorkerInfo::over(
                    "the length of tree_widths",
                    r.tree_widths.len(),
                    max_depth,
                    "max_tree_depth",
                ));
            }
            let mut widths = Vec::with_capacity(r.tree_widths.len());
            for (i, &w) in r.tree_widths.iter().enumerate() {
                if w <= 0 {
                    return Err(Status::invalid_argument(format!(
                        "tree_widths[{i}] is {w}; widths must be positive"
                    )));
                }
                if w as usize > max_nodes {
                    return Err(WorkerInfo::over(
                        &format!("tree_widths[{i}]"),
                        w as usize,
                        max_nodes,
                        "max_tree_nodes",
                    ));
                }
                widths.push(w as usize);
            }
            widths
        } else {
            if r.max_draft_len <= 0 {
                return Err(Status::invalid_argument(format!(
                    "max_draft_len is {}; it must be positive",
                    r.max_draft_len
                )));
            }
            if r.max_draft_len as usize > max_depth {
                return Err(WorkerInfo::over(
                    "max_draft_len",
                    r.max_draft_len as usize,
                    max_depth,
                    "max_tree_depth",
                ));
            }
            if r.num_beams as i64 > max_nodes as i64 {
                return Err(WorkerInfo::over(
                    "num_beams",
                    r.num_beams as usize,
                    max_nodes,
                    "max_tree_nodes",
                ));
            }
            let mut w = vec![1usize; r.max_draft_len as usize];
            w[0] = r.num_beams.max(1) as usize;
            w
        };
        // Each width is at most max_tree_nodes and there are at most 99 levels, but their
        // product can still overflow: tree_size saturates.
        let n = tree_size(&widths);
        if n > max_nodes {
            return Err(Status::invalid_argument(format!(
                "tree_widths describe a tree of {} nodes; this worker drafts at most \
                 {max_nodes} (max_tree_nodes)",
                if n == usize::MAX {
                    "too many".to_string()
                } else {
                    n.to_string()
                }
            )));
        }
        Ok(widths)
    }
}

#[tonic::async_trait]
impl DraftService for DraftWorker {
    async fn generate_drafts(
        &self,
        request: Request<DraftRequest>,
    ) -> Result<Response<DraftResponse>, Status> {
        let start = Instant::now();
        let r = request.into_inner();
        check_ids(&[
            ("request_id", &r.request_id),
            ("session_id", &r.session_id),
            ("session_secret", &r.session_secret),
        ])?;
        let tokens = self.info.tokens(&r.prompt_token_ids, "prompt_token_ids")?;
        let widths = self.widths(&r)?;
        let sampling = sampling_from(r.sampling.as_ref(), r.temperature.unwrap_or(0.0))?;
        let secret = SessionSecret::parse(&r.session_secret)?;
        // A sessionless request holds a session's share of the limits while it runs.
        let mut _reservation = None;
        let session = if r.session_id.is_empty() {
            _reservation = Some(self.store.reserve_anonymous(self.engine.session_bytes())?);
            Arc::new(tokio::sync::Mutex::new(
                self.engine
                    .new_session(sampling.seed)
                    .map_err(Status::from)?,
            ))
        } else {
            if r.reset_cache {
                self.store.remove_owned(&r.session_id, secret.as_ref())?;
            }
            let engine = self.engine.clone();
            let seed = sampling.seed;
            self.store
                .get_or_create_owned(
                    &r.session_id,
                    secret.as_ref(),
                    self.engine.session_bytes(),
                    || engine.new_session(seed),
                )?
                .0
        };
        let engine = self.engine.clone();
        let params = DraftParams { widths, sampling };
        let (tree, stats) = self
            .exec
            .run(session, move |s| engine.draft(s, &tokens, &params))
            .await?;
        let (draft_tree, root_distribution) = tree.to_proto();
        Ok(Response::new(DraftResponse {
            request_id: r.request_id,
            draft_tree,
            telemetry: Some(
                self.info
                    .telemetry(start, stats.model_time, stats.tokens_processed),
            ),
            root_distribution,
            siblings_without_replacement: tree.siblings_without_replacement(),
        }))
    }

    async fn ping(&self, _: Request<PingRequest>) -> Result<Response<PingResponse>, Status> {
        Ok(Response::new(self.info.ping("draft")))
    }

    async fn end_session(
        &self,
        request: Request<EndSessionRequest>,
    ) -> Result<Response<EndSessionResponse>, Status> {
        let r = request.into_inner();
        check_ids(&[
            ("session_id", &r.session_id),
            ("session_secret", &r.session_secret),
        ])?;
        let secret = SessionSecret::parse(&r.session_secret)?;
        let was_active = self.store.remove_owned(&r.session_id, secret.as_ref())?;
        Ok(Response::new(EndSessionResponse {
            session_id: r.session_id,
            was_active,
        }))
    }
}

/// The target worker's gRPC service.
pub struct TargetWorker {
    engine: Arc<TargetEngine>,
    store: Arc<SessionStore<TargetSession>>,
    info: WorkerInfo,
    exec: Execution,
}

impl TargetWorker {
    /// A service over `engine` with sessions bounded by `limits`; its model work is placed
    /// by [`WorkPlacement::default_for`] its device.
    pub fn new(engine: Arc<TargetEngine>, limits: SessionLimits, info: WorkerInfo) -> Self {
        Self {
            engine,
            store: Arc::new(SessionStore::new(limits)),
            exec: Execution::for_device(&info.device, None),
            info,
        }
    }

    /// This worker running its model work as `exec` says (the default:
    /// [`Execution::for_device`]).
    pub fn with_execution(mut self, exec: Execution) -> Self {
        self.exec = exec;
        self
    }

    /// How this worker runs its model work.
    pub fn execution(&self) -> &Execution {
        &self.exec
    }

    /// The session store (for inspection and sweeping).
    pub fn sessions(&self) -> Arc<SessionStore<TargetSession>> {
        self.store.clone()
    }
}

#[tonic::async_trait]
impl TargetService for TargetWorker {
    async fn verify_drafts(
        &self,
        request: Request<VerifyRequest>,
    ) -> Result<Response<VerifyResponse>, Status> {
        let start = Instant::now();
        let r = request.into_inner();
        check_ids(&[
            ("request_id", &r.request_id),
            ("session_id", &r.session_id),
            ("session_secret", &r.session_secret),
        ])?;
        let sampling = sampling_from(r.sampling.as_ref(), r.temperature)?;
        check_distribution_sizes(&r, self.info.vocab_size)?;
        let tree = if r.draft_tree.is_empty() {
            TokenTree::new()
        } else {
            let limits = TreeLimits {
                max_nodes: self.info.max_tree_nodes,
                max_depth: self.info.tree_depth(),
                vocab_size: self.info.vocab_size,
            };
            let tree = TokenTree::from_proto(
                &r.draft_tree,
                r.root_distribution.as_ref(),
                r.siblings_without_replacement,
                &limits,
            )
            .map_err(|e| Status::invalid_argument(format!("draft_tree: {e}")))?;
            // Sampled verification uses the draft distributions when the tree carries them
            // (all of them), and point-mass proposals when it carries none (the original
            // client sends none); a tree with only some is refused.
            if !sampling.is_greedy() && tree.has_any_distribution() {
                tree.require_distributions().map_err(|e| {
                    Status::invalid_argument(format!(
                        "draft_tree: {e}; send a draft distribution for the roots and for every \
                         node with children, or none at all"
                    ))
                })?;
            }
            tree
        };
        let prefix = if !r.prompt_token_ids.is_empty() {
            Prefix::Full(self.info.tokens(&r.prompt_token_ids, "prompt_token_ids")?)
        } else {
            if r.expected_prefix_length < 0 {
                return Err(Status::invalid_argument(
                    "expected_prefix_length must not be negative",
                ));
            }
            Prefix::Delta {
                new_tokens: self.info.tokens(&r.new_token_ids, "new_token_ids")?,
                expected_len: r.expected_prefix_length as usize,
            }
        };
        let secret = SessionSecret::parse(&r.session_secret)?;
        // A sessionless request holds a session's share of the limits while it runs.
        let mut _reservation = None;
        let session = match (&prefix, r.session_id.is_empty()) {
            (Prefix::Delta { .. }, true) => {
                return Err(Status::failed_precondition(format!(
                    "{CACHE_EVICTED_MARKER}: a delta request (no prompt_token_ids) needs a \
                     session_id; send the full prompt"
                )))
            }
            (Prefix::Full(_), true) => {
                _reservation = Some(self.store.reserve_anonymous(self.engine.session_bytes())?);
                Arc::new(tokio::sync::Mutex::new(
                    self.engine
                        .new_session(sampling.seed)
                        .map_err(Status::from)?,
                ))
            }
            (Prefix::Delta { .. }, false) => self
                .store
                .get_owned(&r.session_id, secret.as_ref())?
                .ok_or_else(|| {
                    Status::failed_precondition(format!(
                        "{CACHE_EVICTED_MARKER}: the session is not cached here (evicted, \
                         expired or never started); resend the full prompt"
                    ))
                })?,
            (Prefix::Full(_), false) => {
                let engine = self.engine.clone();
                let seed = sampling.seed;
                self.store
                    .get_or_create_owned(
                        &r.session_id,
                        secret.as_ref(),
                        self.engine.session_bytes(),
                        || engine.new_session(seed),
                    )?
                    .0
            }
        };
        let engine = self.engine.clone();
        let out = self
            .exec
            .run(session, move |s| engine.verify(s, prefix, &tree, &sampling))
            .await?;
        let v = &out.verdict;
        Ok(Response::new(VerifyResponse {
            request_id: r.request_id,
            accepted_token_ids: v.accepted_tokens.iter().map(|&t| t as i32).collect(),
            correction_token_id: v.next_token as i32,
            num_accepted: v.accepted_tokens.len() as i32,
            telemetry: Some(
                self.info
                    .telemetry(start, out.model_time, out.tokens_processed),
            ),
            session_id: r.session_id,
            cache_hit: out.cache_hit,
            has_correction: true,
            cached_length: out.cached_len as i32,
            accepted_node_indices: v.accepted_nodes.iter().map(|&i| i as i32).collect(),
        }))
    }

    async fn end_session(
        &self,
        request: Request<EndSessionRequest>,
    ) -> Result<Response<EndSessionResponse>, Status> {
        let r = request.into_inner();
        check_ids(&[
            ("session_id", &r.session_id),
            ("session_secret", &r.session_secret),
        ])?;
        let secret = SessionSecret::parse(&r.session_secret)?;
        let was_active = self.store.remove_owned(&r.session_id, secret.as_ref())?;
        Ok(Response::new(EndSessionResponse {
            session_id: r.session_id,
            was_active,
        }))
    }

    async fn ping(&self, _: Request<PingRequest>) -> Result<Response<PingResponse>, Status> {
        Ok(Response::new(self.info.ping("target")))
    }
}

/// Sweeps expired sessions of `store` every few seconds until the returned task is aborted.
fn spawn_sweeper<S: Send + 'static>(store: Arc<SessionStore<S>>) -> tokio::task::JoinHandle<()> {
    let period = (store.limits().ttl / 4).clamp(Duration::from_millis(50), Duration::from_secs(5));
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(period);
        loop {
            tick.tick().await;
            let n = store.sweep_expired();
            if n > 0 {
                tracing::info!(expired = n, "dropped idle sessions");
            }
        }
    })
}

/// What `serve` needs of a gRPC service.
trait GrpcService:
    tonic::codegen::Service<
        tonic::codegen::http::Request<tonic::body::Body>,
        Response = tonic::codegen::http::Response<tonic::body::Body>,
        Error = std::convert::Infallible,
        Future: Send + 'static,
    > + tonic::server::NamedService
    + Clone
    + Send
    + Sync
    + 'static
{
}

impl<S> GrpcService for S where
    S: tonic::codegen::Service<
            tonic::codegen::http::Request<tonic::body::Body>,
            Response = tonic::codegen::http::Response<tonic::body::Body>,
            Error = std::convert::Infallible,
            Future: Send + 'static,
        > + tonic::server::NamedService
        + Clone
        + Send
        + Sync
        + 'static
{
}

/// Serves `svc` (plus gRPC health reporting it as serving) on `listener` until `shutdown`
/// resolves, sweeping `store`'s expired sessions meanwhile; in-flight requests finish first.
///
/// The server runs on a current-thread runtime on a thread of its own (the model runs on that
/// runtime's blocking pool, see `with_session`): on a multi-thread runtime each request's
/// connection task, stream task and handler are spread over worker threads, and every hand-off
/// between them is a wake-up of a parked thread, measured at about 0.03 ms per RPC on loopback.
/// If that thread cannot be started, it serves on the caller's
/// runtime instead. Dropping the returned future shuts the server down as `shutdown` would.
async fn serve<S: GrpcService, T: Send + 'static>(
    svc: S,
    store: Arc<SessionStore<T>>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let done = match serve_on_own_thread(svc.clone(), store.clone(), &listener, stopped) {
        Ok(done) => done,
        Err(e) => {
            tracing::warn!("serving on the caller's runtime: cannot start a server thread: {e}");
            return serve_here(svc, store, listener, shutdown).await;
        }
    };
    // The thread serves a duplicate of the listening socket.
    drop(listener);
    tokio::pin!(shutdown, done);
    tokio::select! {
        r = &mut done => return finished(r),
        () = &mut shutdown => {}
    }
    // Dropping `stop` would do as well; the thread finishes in-flight requests first.
    let _ = stop.send(());
    finished(done.await)
}

/// The server thread's result; a thread that died without one is logged.
fn finished(
    r: Result<Result<(), tonic::transport::Error>, tokio::sync::oneshot::error::RecvError>,
) -> Result<(), tonic::transport::Error> {
    r.unwrap_or_else(|_| {
        tracing::error!("the server thread ended without a result");
        Ok(())
    })
}

/// Starts `serve_here` on a duplicate of `listener` on a current-thread runtime on a new thread,
/// until `stopped` resolves (or its sender is dropped); the receiver gets its result.
fn serve_on_own_thread<S: GrpcService, T: Send + 'static>(
    svc: S,
    store: Arc<SessionStore<T>>,
    listener: &TcpListener,
    stopped: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<tokio::sync::oneshot::Receiver<Result<(), tonic::transport::Error>>> {
    use std::os::fd::AsFd;
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let dup = std::net::TcpListener::from(listener.as_fd().try_clone_to_owned()?);
    dup.set_nonblocking(true)?;
    let dup = {
        let _in_rt = rt.enter();
        TcpListener::from_std(dup)?
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    std::thread::Builder::new()
        .name(format!("specsplit-{}", S::NAME))
        .spawn(move || {
            let r = rt.block_on(serve_here(svc, store, dup, async {
                let _ = stopped.await;
            }));
            let _ = tx.send(r);
        })?;
    Ok(rx)
}

/// `serve` on the current runtime.
async fn serve_here<S: GrpcService, T: Send + 'static>(
    svc: S,
    store: Arc<SessionStore<T>>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let sweeper = spawn_sweeper(store);
    let health = HealthServer::new(Health { service: S::NAME })
        .max_decoding_message_size(MAX_HEALTH_MESSAGE_BYTES);
    // Accepted connections get TCP_NODELAY: with Nagle's algorithm on, a small response
    // written in pieces waits for the peer's delayed ACK (about 40 ms on Linux) — measured as
    // 40+ ms rounds on loopback before this.
    let incoming = tokio_stream::StreamExt::map(
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        |conn| {
            if let Ok(c) = &conn {
                if let Err(e) = c.set_nodelay(true) {
                    tracing::warn!("could not set TCP_NODELAY on a connection: {e}");
                }
            }
            conn
        },
    );
    let r = tonic::transport::Server::builder()
        .layer(tower::util::MapResponseLayer::new(explain_oversized))
        .add_service(health)
        .add_service(svc)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await;
    sweeper.abort();
    r
}

/// The standard gRPC health service (`grpc.health.v1.Health`): the worker's service and the
/// server as a whole (`""`) are serving while the server runs; other names are NOT_FOUND.
/// Generated with [`specsplit_proto::codec::SpecCodec`], so an undecodable request is
/// INVALID_ARGUMENT like on the worker's own service.
#[derive(Debug, Clone, Copy)]
struct Health {
    service: &'static str,
}

impl Health {
    fn status(&self, service: &str) -> Option<HealthCheckResponse> {
        (service.is_empty() || service == self.service).then_some(HealthCheckResponse {
            status: ServingStatus::Serving as i32,
        })
    }
}

#[tonic::async_trait]
impl specsplit_proto::health::health_server::Health for Health {
    async fn check(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<HealthCheckResponse>, Status> {
        self.status(&request.into_inner().service)
            .map(Response::new)
            .ok_or_else(|| Status::not_found("no such service on this worker"))
    }

    type WatchStream = std::pin::Pin<
        Box<dyn tokio_stream::Stream<Item = Result<HealthCheckResponse, Status>> + Send>,
    >;

    async fn watch(
        &self,
        request: Request<HealthCheckRequest>,
    ) -> Result<Response<Self::WatchStream>, Status> {
        // The status never changes while the server runs: send it once, then keep the call
        // open until the server stops.
        let first = self
            .status(&request.into_inner().service)
            .unwrap_or(HealthCheckResponse {
                status: ServingStatus::ServiceUnknown as i32,
            });
        let stream =
            tokio_stream::StreamExt::chain(tokio_stream::once(Ok(first)), tokio_stream::pending());
        Ok(Response::new(Box::pin(stream)))
    }
}

/// Answers a request refused for its length (tonic's OUT_OF_RANGE "decoded message length
/// too large", decided from the length prefix before the message is read) INVALID_ARGUMENT,
/// saying which limit it is derived from. Other responses pass unchanged.
fn explain_oversized(
    mut resp: tonic::codegen::http::Response<tonic::body::Body>,
) -> tonic::codegen::http::Response<tonic::body::Body> {
    use tonic::codegen::http::HeaderValue;
    let headers = resp.headers_mut();
    if headers.get("grpc-status").is_none_or(|v| v != "11") {
        return resp;
    }
    let msg = headers
        .get("grpc-message")
        .and_then(|v| v.to_str().ok())
        .map(percent_decode)
        .unwrap_or_default();
    let Some(rest) = msg.strip_prefix("Error, decoded message length too large: found ") else {
        return resp;
    };
    // "<found> bytes, the limit is: <limit> bytes"
    let mut numbers = rest
        .split(|c: char| !c.is_ascii_digit())
        .filter(|w| !w.is_empty());
    let (Some(found), Some(limit)) = (numbers.next(), numbers.next()) else {
        return resp;
    };
    let text = format!(
        "the request is {found} bytes; this worker accepts at most {limit} (derived from \
         max_prompt_len, max_tree_nodes, max_tree_depth and the vocabulary size)"
    );
    if let Ok(v) = HeaderValue::from_str(&percent_encode(&text)) {
        headers.insert("grpc-status", HeaderValue::from_static("3"));
        headers.insert("grpc-message", v);
    }
    resp
}

/// Decodes gRPC's percent-encoded status message.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = (b[i] == b'%' && i + 2 < b.len())
            .then(|| std::str::from_utf8(&b[i + 1..i + 3]).ok())
            .flatten()
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match hex {
            Some(v) => {
                out.push(v);
                i += 3;
            }
            None => {
                out.push(b[i]);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Percent-encodes a status message for the `grpc-message` header.
fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == b' ' {
                (c as char).to_string()
            } else {
                format!("%{c:02X}")
            }
        })
        .collect()
}

/// Serves the draft worker (plus gRPC health) on `listener` until `shutdown` resolves;
/// in-flight requests finish first. A request longer than
/// [`WorkerInfo::max_draft_request_bytes`] is refused from its length prefix.
pub async fn serve_draft(
    worker: DraftWorker,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let store = worker.sessions();
    let decode = worker.info.max_draft_request_bytes();
    let encode = worker.info.max_verify_request_bytes();
    let svc = DraftServiceServer::new(worker)
        .max_decoding_message_size(decode)
        .max_encoding_message_size(encode);
    serve(svc, store, listener, shutdown).await
}

/// Serves the target worker (plus gRPC health) on `listener` until `shutdown` resolves;
/// in-flight requests finish first. A request longer than
/// [`WorkerInfo::max_verify_request_bytes`] is refused from its length prefix.
pub async fn serve_target(
    worker: TargetWorker,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let store = worker.sessions();
    let decode = worker.info.max_verify_request_bytes();
    let svc = TargetServiceServer::new(worker)
        .max_decoding_message_size(decode)
        .max_encoding_message_size(decode);
    serve(svc, store, listener, shutdown).await
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
    fn oversized_requests_become_invalid_argument_naming_the_limit() {
        use tonic::codegen::http::Response;
        let tonic_status = Status::out_of_range(
            "Error, decoded message length too large: found 125829120 bytes, the limit is: \
             76416 bytes",
        );
        let resp = explain_oversized(tonic_status.into_http());
        let got = Status::from_header_map(resp.headers()).unwrap();
        assert_eq!(got.code(), tonic::Code::InvalidArgument);
        assert_eq!(
            got.message(),
            "the request is 125829120 bytes; this worker accepts at most 76416 (derived from \
             max_prompt_len, max_tree_nodes, max_tree_depth and the vocabulary size)"
        );
        // Everything else passes unchanged.
        let other = Status::out_of_range("something else").into_http();
        let resp = explain_oversized(other);
        assert_eq!(resp.headers()["grpc-status"], "11");
        let ok = explain_oversized(Response::new(tonic::body::Body::empty()));
        assert!(ok.headers().get("grpc-status").is_none());
        assert_eq!(percent_decode(&percent_encode("a%b: é(1)")), "a%b: é(1)");
        assert_eq!(percent_decode("50%"), "50%");
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
