//! The target worker's gRPC service (`TargetService`).

use std::future::Future;
use std::time::Instant;

use specsplit_proto::target_service_server::{TargetService, TargetServiceServer};
use specsplit_proto::{
    EndSessionRequest, EndSessionResponse, PingRequest, PingResponse, VerifyRequest, VerifyResponse,
};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

use super::serve::{serve, ServeOptions};
use super::validate::{
    check_distribution_sizes, check_request_ids, draft_tree, prefix, sampling_from,
};
use super::worker::Worker;
use crate::error::CACHE_EVICTED_MARKER;
use crate::session::SessionSecret;
use crate::target::{Prefix, TargetEngine};

/// The target worker's gRPC service.
pub type TargetWorker = Worker<TargetEngine>;

#[tonic::async_trait]
impl TargetService for TargetWorker {
    async fn verify_drafts(
        &self,
        request: Request<VerifyRequest>,
    ) -> Result<Response<VerifyResponse>, Status> {
        let start = Instant::now();
        let r = self.verify(request, start).await;
        self.observe("VerifyDrafts", start, &r);
        r
    }

    async fn end_session(
        &self,
        request: Request<EndSessionRequest>,
    ) -> Result<Response<EndSessionResponse>, Status> {
        self.answer_end_session(request)
    }

    async fn ping(&self, _: Request<PingRequest>) -> Result<Response<PingResponse>, Status> {
        self.answer_ping()
    }
}

impl TargetWorker {
    /// `VerifyDrafts`, begun at `start`.
    async fn verify(
        &self,
        request: Request<VerifyRequest>,
        start: Instant,
    ) -> Result<Response<VerifyResponse>, Status> {
        let r = request.into_inner();
        check_request_ids(&r.request_id, &r.session_id, &r.session_secret)?;
        let info = self.info();
        let sampling = sampling_from(r.sampling.as_ref(), r.temperature)?;
        check_distribution_sizes(&r, info.vocab_size)?;
        let tree = draft_tree(info, &r, &sampling)?;
        let prefix = prefix(info, &r)?;
        let secret = SessionSecret::parse(&r.session_secret)?;
        let (id, seed) = (r.session_id.as_str(), sampling.seed);
        let draft_tokens = tree.len();
        let draft_depth = if tree.is_empty() {
            0
        } else {
            tree.max_depth() + 1
        };
        let (session, _reservation) = match (&prefix, id.is_empty()) {
            (Prefix::Delta { .. }, true) => {
                return Err(Status::failed_precondition(format!(
                    "{CACHE_EVICTED_MARKER}: a delta request (no prompt_token_ids) needs a \
                     session_id; send the full prompt"
                )))
            }
            (Prefix::Full(_), true) => {
                let (session, reservation) = self.anonymous_session(seed)?;
                (session, Some(reservation))
            }
            (Prefix::Delta { .. }, false) => {
                let session = self.cached_session(id, secret.as_ref())?.ok_or_else(|| {
                    Status::failed_precondition(format!(
                        "{CACHE_EVICTED_MARKER}: the session is not cached here (evicted, \
                         expired or never started); resend the full prompt"
                    ))
                })?;
                (session, None)
            }
            (Prefix::Full(_), false) => (self.named_session(id, secret.as_ref(), seed)?, None),
        };
        let logprobs = r.return_logprobs;
        let in_flight = self.load_gate().map(|g| g.enter());
        let out = self
            .run(session, move |engine, s| {
                engine.verify_scored(s, prefix, &tree, &sampling, logprobs)
            })
            .await?;
        let v = &out.verdict;
        self.metrics()
            .observe_verification(draft_tokens, v.accepted_tokens.len());
        let max_draft_depth = self.load_gate().and_then(|g| {
            let (rows, time) = (out.tokens_processed, out.model_time);
            g.observe_and_advise(rows, time, draft_depth, v.accepted_tokens.len())
        });
        drop(in_flight);
        Ok(Response::new(VerifyResponse {
            request_id: r.request_id,
            accepted_token_ids: v.accepted_tokens.iter().map(|&t| t as i32).collect(),
            correction_token_id: v.next_token as i32,
            num_accepted: v.accepted_tokens.len() as i32,
            telemetry: Some(info.telemetry(start, out.model_time, out.tokens_processed)),
            session_id: r.session_id,
            cache_hit: out.cache_hit,
            has_correction: true,
            cached_length: out.cached_len as i32,
            accepted_node_indices: v.accepted_nodes.iter().map(|&i| i as i32).collect(),
            token_logprobs: out.logprobs,
            max_draft_depth: max_draft_depth.map(|d| d.min(i32::MAX as usize) as i32),
        }))
    }
}

/// Serves the target worker (plus gRPC health) on `listener` until `shutdown` resolves;
/// in-flight requests finish first. A request longer than
/// [`super::WorkerInfo::max_verify_request_bytes`] is refused from its length prefix.
pub async fn serve_target(
    worker: TargetWorker,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    serve_target_with(worker, listener, shutdown, ServeOptions::default()).await
}

/// [`serve_target`] as `opts` say (TLS, a bearer token, draining).
pub async fn serve_target_with(
    worker: TargetWorker,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
    opts: ServeOptions,
) -> Result<(), tonic::transport::Error> {
    let store = worker.sessions();
    let decode = worker.info().max_verify_request_bytes();
    let svc = TargetServiceServer::new(worker)
        .max_decoding_message_size(decode)
        .max_encoding_message_size(decode);
    serve(svc, store, listener, shutdown, opts).await
}
