//! The draft worker's gRPC service (`DraftService`).

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use specsplit_proto::convert::TreeWire;
use specsplit_proto::draft_service_server::{DraftService, DraftServiceServer};
use specsplit_proto::{
    DraftRequest, DraftResponse, EndSessionRequest, EndSessionResponse, PingRequest, PingResponse,
    PreDraft,
};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

use super::serve::{serve, ServeOptions};
use super::validate::{check_request_ids, draft_widths, outcome_set, sampling_from};
use super::worker::Worker;
use crate::batcher::BatchLimits;
use crate::draft::{DraftEngine, DraftParams};
use crate::draft_batcher::DraftBatcher;
use crate::engine_session::SessionEngine;
use crate::session::SessionSecret;

/// The draft worker's gRPC service.
pub type DraftWorker = Worker<DraftEngine>;

#[tonic::async_trait]
impl DraftService for DraftWorker {
    async fn generate_drafts(
        &self,
        request: Request<DraftRequest>,
    ) -> Result<Response<DraftResponse>, Status> {
        let start = Instant::now();
        let r = self.generate(request, start).await;
        self.observe("GenerateDrafts", start, &r);
        r
    }

    async fn ping(&self, _: Request<PingRequest>) -> Result<Response<PingResponse>, Status> {
        self.answer_ping()
    }

    async fn end_session(
        &self,
        request: Request<EndSessionRequest>,
    ) -> Result<Response<EndSessionResponse>, Status> {
        self.answer_end_session(request)
    }
}

impl DraftWorker {
    /// This worker running the level passes of concurrent sessions' drafts together, bounded
    /// by `limits` ([`DraftBatcher`]), its model work placed as its [`super::Execution`] says;
    /// without it, each request drafts on its own.
    pub fn with_batching(mut self, limits: BatchLimits) -> Self {
        let placement = self.execution().placement();
        self.draft_batcher = Some(Arc::new(DraftBatcher::new(
            self.engine().clone(),
            limits,
            placement,
        )));
        self
    }

    /// The draft batcher, when the worker batches.
    pub fn batcher(&self) -> Option<&Arc<DraftBatcher>> {
        self.draft_batcher.as_ref()
    }

    /// `GenerateDrafts`, begun at `start`.
    async fn generate(
        &self,
        request: Request<DraftRequest>,
        start: Instant,
    ) -> Result<Response<DraftResponse>, Status> {
        let r = request.into_inner();
        check_request_ids(&r.request_id, &r.session_id, &r.session_secret)?;
        let info = self.info();
        let tokens = info.tokens(&r.prompt_token_ids, "prompt_token_ids")?;
        let widths = draft_widths(info, &r)?;
        let outcomes = outcome_set(info, &r, &widths)?;
        let sampling = sampling_from(r.sampling.as_ref(), r.temperature.unwrap_or(0.0))?;
        let secret = SessionSecret::parse(&r.session_secret)?;
        let seed = sampling.seed;
        let (session, _reservation) = if r.session_id.is_empty() {
            let (session, reservation) = self.anonymous_session(seed).await?;
            (session, Some(reservation))
        } else {
            if r.reset_cache {
                self.drop_session(&r.session_id, secret.as_ref())?;
            }
            (
                self.named_session(&r.session_id, secret.as_ref(), seed)
                    .await?,
                None,
            )
        };
        let params = DraftParams { widths, sampling };
        if let Some(set) = outcomes {
            let (pre, stats) = self
                .run(session, move |engine, s| {
                    engine.predraft(s, &tokens, &set, &params)
                })
                .await?;
            let predrafts = pre
                .into_iter()
                .map(|p| {
                    let (draft_tree, root_distribution) = p.tree.to_proto();
                    PreDraft {
                        accepted_length: p.accepted as i32,
                        token_id: p.token as i32,
                        draft_tree,
                        root_distribution,
                    }
                })
                .collect();
            return Ok(Response::new(DraftResponse {
                request_id: r.request_id,
                telemetry: Some(info.telemetry(start, stats.model_time, stats.tokens_processed)),
                siblings_without_replacement: true,
                predrafts,
                ..DraftResponse::default()
            }));
        }
        let (tree, stats) = match &self.draft_batcher {
            Some(b) => {
                let out = b.draft(session, tokens, params).await;
                self.sessions().room_may_be_free();
                self.execution().answered();
                let out = out?;
                self.metrics()
                    .observe_draft_pass_sessions(out.pass_sessions);
                (out.tree, out.stats)
            }
            None => {
                self.run(session, move |engine, s| engine.draft(s, &tokens, &params))
                    .await?
            }
        };
        let (draft_tree, root_distribution) = tree.to_proto();
        Ok(Response::new(DraftResponse {
            request_id: r.request_id,
            draft_tree,
            telemetry: Some(info.telemetry(start, stats.model_time, stats.tokens_processed)),
            root_distribution,
            siblings_without_replacement: tree.siblings_without_replacement(),
            predrafts: Vec::new(),
        }))
    }
}

/// Serves the draft worker (plus gRPC health) on `listener` until `shutdown` resolves;
/// in-flight requests finish first. A request longer than
/// [`super::WorkerInfo::max_draft_request_bytes`] is refused from its length prefix.
pub async fn serve_draft(
    worker: DraftWorker,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    serve_draft_with(worker, listener, shutdown, ServeOptions::default()).await
}

/// [`serve_draft`] as `opts` say (TLS, a bearer token, draining), for any draft worker (a
/// model's or a model-free one).
pub async fn serve_draft_with<E>(
    worker: Worker<E>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
    opts: ServeOptions,
) -> Result<(), tonic::transport::Error>
where
    E: SessionEngine,
    Worker<E>: DraftService,
{
    let store = worker.sessions();
    let decode = worker.info().max_draft_request_bytes();
    let encode = worker.info().max_verify_request_bytes();
    let svc = DraftServiceServer::new(worker)
        .max_decoding_message_size(decode)
        .max_encoding_message_size(encode);
    serve(svc, store, listener, shutdown, opts).await
}
