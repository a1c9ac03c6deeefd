//! The draft worker's gRPC service (`DraftService`).

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use specsplit_proto::convert::TreeWire;
use specsplit_proto::draft_service_server::{DraftService, DraftServiceServer};
use specsplit_proto::{
    DraftRequest, DraftResponse, EndSessionRequest, EndSessionResponse, PingRequest, PingResponse,
    PreDraft, TelemetryMetadata,
};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

use super::deadline::request_deadline;
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
        let deadline = request_deadline(request.metadata(), start);
        let setups = self.engine().model().graph_setups();
        let one_off = || self.engine().model().graph_setups() > setups;
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
        let params = DraftParams {
            widths,
            sampling,
            deadline,
        };
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
                telemetry: Some(TelemetryMetadata {
                    one_off_setup: one_off(),
                    ..info.telemetry(start, stats.model_time, stats.tokens_processed)
                }),
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
            telemetry: Some(TelemetryMetadata {
                one_off_setup: one_off(),
                ..info.telemetry(start, stats.model_time, stats.tokens_processed)
            }),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::service::{Execution, WorkPlacement, WorkerInfo};
    use crate::session::SessionLimits;
    use std::time::Duration;

    fn engine() -> Arc<DraftEngine> {
        Arc::new(
            DraftEngine::new(crate::test_models::tiny_model(3), vec![], 128).with_spare_sessions(0),
        )
    }

    /// A draft worker over `engine`, its model work on the blocking pool, batching when
    /// `limits` are given.
    fn worker(engine: &Arc<DraftEngine>, limits: Option<BatchLimits>) -> DraftWorker {
        let info = WorkerInfo {
            model_name: "tiny".into(),
            vocab_size: engine.model().config().vocab_size,
            eos_token_ids: vec![],
            max_context: 128,
            max_tree_nodes: 32,
            max_tree_depth: 16,
            max_prompt_len: 128,
            device: "cpu".into(),
        };
        let limits_s = SessionLimits {
            max_sessions: 8,
            memory_budget_bytes: usize::MAX / 2,
            ttl: Duration::from_secs(600),
        };
        let w = DraftWorker::new(engine.clone(), limits_s, info)
            .with_execution(Execution::new(WorkPlacement::Pool, Duration::ZERO));
        match limits {
            Some(l) => w.with_batching(l),
            None => w,
        }
    }

    /// Session `i`'s request: its prompt, a tree of widths [2, 1, 1], sampled (seeded) for odd
    /// `i`.
    fn request(i: usize) -> DraftRequest {
        DraftRequest {
            session_id: format!("s{i}"),
            prompt_token_ids: (0..8 + 3 * i as i32)
                .map(|t| (t * 31 + 7 + 50 * i as i32) % 500)
                .collect(),
            tree_widths: vec![2, 1, 1],
            sampling: Some(specsplit_proto::SamplingParams {
                temperature: if i % 2 == 1 { 0.7 } else { 0.0 },
                seed: 11 + i as u64,
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[tokio::test(flavor = "current_thread")]
    async fn batched_drafts_answer_as_a_worker_without_batching() {
        let engine = engine();
        let limits = BatchLimits {
            max_sessions: 8,
            max_rows: 256,
        };
        let w = Arc::new(worker(&engine, Some(limits)));
        let b = w.batcher().unwrap().clone();
        let hold = b.hold().await;
        let tasks: Vec<_> = (0..3)
            .map(|i| {
                let w = w.clone();
                tokio::spawn(async move { w.generate_drafts(Request::new(request(i))).await })
            })
            .collect();
        while b.queued() < 3 {
            tokio::task::yield_now().await;
        }
        drop(hold);
        let plain = worker(&engine, None);
        for (i, t) in tasks.into_iter().enumerate() {
            let got = t.await.unwrap().unwrap().into_inner();
            let want = plain
                .generate_drafts(Request::new(request(i)))
                .await
                .unwrap()
                .into_inner();
            assert_eq!(got.draft_tree, want.draft_tree, "session {i}");
            assert_eq!(got.root_distribution, want.root_distribution, "session {i}");
        }
        assert_eq!(b.stats().most_sessions, 3);
        let text = w.scrape()();
        assert!(
            text.contains("specsplit_draft_pass_sessions_count 3"),
            "{text}"
        );
        assert!(
            text.contains("specsplit_draft_pass_sessions_sum 9"),
            "{text}"
        );
    }

    #[test]
    fn the_batcher_places_its_passes_as_the_worker_does() {
        let limits = BatchLimits {
            max_sessions: 4,
            max_rows: 64,
        };
        let w = worker(&engine(), Some(limits));
        assert_eq!(w.batcher().unwrap().placement(), WorkPlacement::Pool);
        let w = w.with_execution(Execution::new(WorkPlacement::Inline, Duration::ZERO));
        assert_eq!(w.batcher().unwrap().placement(), WorkPlacement::Inline);
        assert_eq!(w.batcher().unwrap().limits(), limits);
        assert!(worker(&engine(), None).batcher().is_none());
    }

    /// A 4-deep chain after a 100-token prompt of session `s1`, with `timeout` as its
    /// `grpc-timeout` header.
    fn timed_request(timeout: Option<&str>) -> Request<DraftRequest> {
        let mut r = Request::new(DraftRequest {
            request_id: "r".into(),
            session_id: "s1".into(),
            prompt_token_ids: (0..100).map(|t| (t * 37 + 11) % 500).collect(),
            max_draft_len: 4,
            num_beams: 1,
            tree_widths: vec![1; 4],
            ..DraftRequest::default()
        });
        if let Some(t) = timeout {
            r.metadata_mut().insert("grpc-timeout", t.parse().unwrap());
        }
        r
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_draft_past_its_deadline_stops_and_its_session_stays_usable() {
        let late = worker(&engine(), None);
        let e = late
            .generate_drafts(timed_request(Some("1n")))
            .await
            .expect_err("a request whose deadline passed is refused");
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
        // The session answers its next request exactly as a fresh worker does.
        let after = late.generate_drafts(timed_request(None)).await.unwrap();
        let fresh = worker(&engine(), None)
            .generate_drafts(timed_request(None))
            .await
            .unwrap();
        assert_eq!(after.get_ref().draft_tree, fresh.get_ref().draft_tree);
        assert_eq!(fresh.get_ref().draft_tree.len(), 1, "one root of a chain");
        // A deadline far enough away changes nothing.
        let roomy = worker(&engine(), None)
            .generate_drafts(timed_request(Some("60S")))
            .await
            .unwrap();
        assert_eq!(roomy.get_ref().draft_tree, fresh.get_ref().draft_tree);
    }
}
