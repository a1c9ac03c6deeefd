//! The model-free draft worker's gRPC service: the same `DraftService`, answered by the n-gram
//! or suffix drafter over each session's tokens.

use std::future::Future;
use std::time::Instant;

use specsplit_proto::convert::TreeWire;
use specsplit_proto::draft_service_server::DraftService;
use specsplit_proto::{
    DraftRequest, DraftResponse, EndSessionRequest, EndSessionResponse, PingRequest, PingResponse,
};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

use super::serve::ServeOptions;
use super::validate::{check_request_ids, draft_widths, sampling_from};
use super::worker::Worker;
use crate::model_free::ModelFreeEngine;
use crate::session::SessionSecret;

/// The model-free draft worker's gRPC service.
pub type ModelFreeDraftWorker = Worker<ModelFreeEngine>;

#[tonic::async_trait]
impl DraftService for ModelFreeDraftWorker {
    async fn generate_drafts(
        &self,
        request: Request<DraftRequest>,
    ) -> Result<Response<DraftResponse>, Status> {
        let start = Instant::now();
        let r = request.into_inner();
        check_request_ids(&r.request_id, &r.session_id, &r.session_secret)?;
        let info = self.info();
        let tokens = info.tokens(&r.prompt_token_ids, "prompt_token_ids")?;
        let widths = draft_widths(info, &r)?;
        if r.outcomes.is_some() {
            return Err(Status::invalid_argument(
                "this draft worker runs a model-free drafter and does not pre-draft outcome \
                 sets; use the sequential or overlapped pipeline",
            ));
        }
        let sampling = sampling_from(r.sampling.as_ref(), r.temperature.unwrap_or(0.0))?;
        let secret = SessionSecret::parse(&r.session_secret)?;
        let (session, _reservation) = if r.session_id.is_empty() {
            let (session, reservation) = self.anonymous_session(sampling.seed).await?;
            (session, Some(reservation))
        } else {
            if r.reset_cache {
                self.drop_session(&r.session_id, secret.as_ref())?;
            }
            (
                self.named_session(&r.session_id, secret.as_ref(), sampling.seed)
                    .await?,
                None,
            )
        };
        let (tree, stats) = self
            .run(session, move |engine, s| engine.draft(s, &tokens, &widths))
            .await?;
        let (draft_tree, root_distribution) = tree.to_proto();
        Ok(Response::new(DraftResponse {
            request_id: r.request_id,
            draft_tree,
            telemetry: Some(info.telemetry(start, stats.draft_time, stats.tokens)),
            root_distribution,
            siblings_without_replacement: false,
            predrafts: Vec::new(),
        }))
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

/// Serves the model-free draft worker (plus gRPC health) on `listener` until `shutdown`.
pub async fn serve_model_free_draft(
    worker: ModelFreeDraftWorker,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    super::draft::serve_draft_with(worker, listener, shutdown, ServeOptions::default()).await
}
