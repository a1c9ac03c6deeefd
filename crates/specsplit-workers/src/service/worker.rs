//! The worker machinery the draft and target services share: an engine behind a bounded
//! session store, the limits it reports and enforces, and how its model work runs.

use std::sync::Arc;
use std::time::Duration;

use specsplit_proto::{EndSessionRequest, EndSessionResponse, PingResponse};
use tonic::{Request, Response, Status};

use super::execution::Execution;
use super::validate::check_ids;
use super::WorkerInfo;
use crate::batcher::VerifyBatcher;
use crate::draft_batcher::DraftBatcher;
use crate::engine_session::SessionEngine;
use crate::load_gate::LoadAdvisor;
use crate::metrics::{StoreUsage, WorkerMetrics};
use crate::session::{Reservation, SessionHandle, SessionLimits, SessionSecret, SessionStore};
use crate::EngineError;

/// A sessionless request's new session and the reservation it holds while it runs.
type AnonymousSession<'a, S> = (SessionHandle<S>, Reservation<'a, S>);

/// A worker: an engine, its sessions (bounded by [`SessionLimits`]), its identity and limits,
/// and how it runs its model work. [`super::DraftWorker`] and [`super::TargetWorker`] are the
/// gRPC services over the two engines.
pub struct Worker<E: SessionEngine> {
    engine: Arc<E>,
    store: Arc<SessionStore<E::Session>>,
    info: WorkerInfo,
    exec: Execution,
    metrics: Arc<WorkerMetrics>,
    /// How long a request for a new session waits for room when every session is busy.
    admission_wait: Duration,
    /// The target's verification batcher; none runs each request's pass on its own.
    pub(super) batcher: Option<Arc<VerifyBatcher>>,
    /// The draft worker's level-pass batcher; none drafts each request on its own.
    pub(super) draft_batcher: Option<Arc<DraftBatcher>>,
    /// The load-gated depth advice this worker answers with (`None`: no advice).
    load_gate: Option<Arc<LoadAdvisor>>,
}

/// Renders a worker's metrics as they stand, for `/metrics`.
pub type Scrape = Arc<dyn Fn() -> String + Send + Sync>;

impl<E: SessionEngine> Worker<E> {
    /// A worker over `engine` with sessions bounded by `limits`; its model work runs as
    /// [`Execution::for_device`] its device says by default.
    pub fn new(engine: Arc<E>, limits: SessionLimits, info: WorkerInfo) -> Self {
        // The target verifies drafts: it keeps the speculative-decoding counters.
        let metrics = WorkerMetrics::new(&info.model_name, E::WORKER_TYPE == "target");
        Self {
            engine,
            store: Arc::new(SessionStore::new(limits)),
            exec: Execution::for_device(&info.device, None),
            info,
            metrics: Arc::new(metrics),
            admission_wait: Duration::ZERO,
            batcher: None,
            draft_batcher: None,
            load_gate: None,
        }
    }

    /// This worker making a request for a new session wait up to `wait` for room when every
    /// session is busy, before it answers RESOURCE_EXHAUSTED (zero: at once).
    pub fn with_admission_wait(mut self, wait: Duration) -> Self {
        self.admission_wait = wait;
        self
    }

    /// How long a request for a new session waits for room.
    pub fn admission_wait(&self) -> Duration {
        self.admission_wait
    }

    /// This worker advising draft depths by load through `advisor` (`None`: no advice).
    pub fn with_load_gate(mut self, advisor: Option<Arc<LoadAdvisor>>) -> Self {
        self.load_gate = advisor;
        self
    }

    /// The load-gated depth advice this worker answers with, if any.
    pub fn load_gate(&self) -> Option<&LoadAdvisor> {
        self.load_gate.as_deref()
    }

    /// This worker's metrics.
    pub fn metrics(&self) -> &WorkerMetrics {
        &self.metrics
    }

    /// Renders this worker's metrics, its session gauges read from the store at each call.
    pub fn scrape(&self) -> Scrape {
        let (metrics, store) = (self.metrics.clone(), self.store.clone());
        Arc::new(move || {
            metrics.render(StoreUsage {
                sessions: store.len(),
                anonymous: store.anonymous(),
                kv_used_bytes: store.bytes(),
                kv_budget_bytes: store.limits().memory_budget_bytes,
            })
        })
    }

    /// Records an answered call of `rpc` begun at `start`.
    pub(super) fn observe<T>(
        &self,
        rpc: &'static str,
        start: std::time::Instant,
        result: &Result<T, Status>,
    ) {
        self.metrics
            .observe(rpc, start.elapsed(), result.as_ref().err());
    }

    /// This worker running its model work as `exec` says.
    pub fn with_execution(mut self, exec: Execution) -> Self {
        if let Some(b) = &self.batcher {
            self.batcher = Some(Arc::new(b.placed(exec.placement())));
        }
        if let Some(b) = &self.draft_batcher {
            self.draft_batcher = Some(Arc::new(b.placed(exec.placement())));
        }
        self.exec = exec;
        self
    }

    /// The engine.
    pub fn engine(&self) -> &Arc<E> {
        &self.engine
    }

    /// How this worker runs its model work.
    pub fn execution(&self) -> &Execution {
        &self.exec
    }

    /// The session store (for inspection and sweeping).
    pub fn sessions(&self) -> Arc<SessionStore<E::Session>> {
        self.store.clone()
    }

    /// The identity and limits this worker reports and enforces.
    pub fn info(&self) -> &WorkerInfo {
        &self.info
    }

    /// A new session for a request without a `session_id`, and the reservation of one
    /// session's share of the limits that it holds while it runs.
    pub(super) async fn anonymous_session(
        &self,
        seed: u64,
    ) -> Result<AnonymousSession<'_, E::Session>, Status> {
        let reservation = self
            .store
            .admit_anonymous(self.engine.session_bytes(), self.admission_wait)
            .await?;
        let session = self
            .engine
            .new_charged_session(seed, reservation.charge().clone())
            .map_err(Status::from)?;
        Ok((Arc::new(tokio::sync::Mutex::new(session)), reservation))
    }

    /// The session `id` names, created (bound to `secret`, seeded by `seed`) if absent.
    pub(super) async fn named_session(
        &self,
        id: &str,
        secret: Option<&SessionSecret>,
        seed: u64,
    ) -> Result<SessionHandle<E::Session>, Status> {
        let (session, _) = self
            .store
            .admit_owned(
                id,
                secret,
                self.engine.session_bytes(),
                self.admission_wait,
                |charge| self.engine.new_charged_session(seed, charge),
            )
            .await?;
        Ok(session)
    }

    /// The session `id` names, if this worker holds it.
    pub(super) fn cached_session(
        &self,
        id: &str,
        secret: Option<&SessionSecret>,
    ) -> Result<Option<SessionHandle<E::Session>>, Status> {
        Ok(self.store.get_owned(id, secret)?)
    }

    /// Drops the session `id` names; whether it was held.
    pub(super) fn drop_session(
        &self,
        id: &str,
        secret: Option<&SessionSecret>,
    ) -> Result<bool, Status> {
        Ok(self.store.remove_owned(id, secret)?)
    }

    /// Runs `f` with the engine on `session` as this worker's [`Execution`] says.
    pub(super) async fn run<T: Send + 'static>(
        &self,
        session: SessionHandle<E::Session>,
        f: impl FnOnce(&E, &mut E::Session) -> Result<T, EngineError> + Send + 'static,
    ) -> Result<T, Status> {
        let engine = self.engine.clone();
        let out = self.exec.run(session, move |s| f(&engine, s)).await;
        // The session is idle again: a request waiting for room may evict it now.
        self.store.room_may_be_free();
        out
    }

    /// Answers `Ping` (counted in the metrics), for every kind of worker.
    pub(super) fn answer_ping(&self) -> Result<Response<PingResponse>, Status> {
        let start = std::time::Instant::now();
        let r = Ok(Response::new(self.info.ping(E::WORKER_TYPE)));
        self.observe("Ping", start, &r);
        r
    }

    /// Answers `EndSession` (counted in the metrics), for every kind of worker.
    pub(super) fn answer_end_session(
        &self,
        request: Request<EndSessionRequest>,
    ) -> Result<Response<EndSessionResponse>, Status> {
        let start = std::time::Instant::now();
        let r = self.end_session(request.into_inner()).map(Response::new);
        self.observe("EndSession", start, &r);
        r
    }

    /// Ends the session a request names (`EndSession`).
    fn end_session(&self, r: EndSessionRequest) -> Result<EndSessionResponse, Status> {
        check_ids(&[
            ("session_id", &r.session_id),
            ("session_secret", &r.session_secret),
        ])?;
        let secret = SessionSecret::parse(&r.session_secret)?;
        let was_active = self.drop_session(&r.session_id, secret.as_ref())?;
        // An ended session no longer counts in the load the target's gate advises for.
        if let Some(g) = self.load_gate() {
            g.forget(&r.session_id);
        }
        Ok(EndSessionResponse {
            session_id: r.session_id,
            was_active,
        })
    }
}
