//! The target worker's gRPC service (`TargetService`).

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use specsplit_proto::target_service_server::{TargetService, TargetServiceServer};
use specsplit_proto::{
    EndSessionRequest, EndSessionResponse, PingRequest, PingResponse, TelemetryMetadata,
    VerifyRequest, VerifyResponse,
};
use tokio::net::TcpListener;
use tonic::{Request, Response, Status};

use super::serve::{serve, ServeOptions};
use super::validate::{
    check_distribution_sizes, check_request_ids, draft_tree, prefix, sampling_from,
};
use super::worker::Worker;
use crate::batcher::{BatchLimits, RoundRequest, VerifyBatcher};
use crate::error::CACHE_EVICTED_MARKER;
use crate::load_gate::GateRound;
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
    /// This worker verifying concurrent sessions' rounds in shared passes bounded by `limits`
    /// ([`VerifyBatcher`]), its model work placed as its [`super::Execution`] says; without it,
    /// each request's pass runs on its own.
    pub fn with_batching(mut self, limits: BatchLimits) -> Self {
        let placement = self.execution().placement();
        self.batcher = Some(Arc::new(VerifyBatcher::new(
            self.engine().clone(),
            limits,
            placement,
        )));
        self
    }

    /// The verification batcher, when the worker batches.
    pub fn batcher(&self) -> Option<&Arc<VerifyBatcher>> {
        self.batcher.as_ref()
    }

    /// `VerifyDrafts`, begun at `start`.
    async fn verify(
        &self,
        request: Request<VerifyRequest>,
        start: Instant,
    ) -> Result<Response<VerifyResponse>, Status> {
        let setups = self.engine().model().graph_setups();
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
                let (session, reservation) = self.anonymous_session(seed).await?;
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
            (Prefix::Full(_), false) => {
                (self.named_session(id, secret.as_ref(), seed).await?, None)
            }
        };
        let request = RoundRequest {
            prefix,
            tree,
            params: sampling,
            logprobs: r.return_logprobs,
        };
        let continued = matches!(request.prefix, Prefix::Delta { .. });
        let in_flight = self.load_gate().map(|g| {
            // A draft that made a CUDA graph took longer than drafting costs.
            if continued && !r.draft_one_off_setup {
                g.observe_request(&r.session_id, draft_depth, start);
            }
            g.enter()
        });
        let (out, pass_rows) = match &self.batcher {
            Some(b) => {
                let out = b.verify(session, request).await;
                self.sessions().room_may_be_free();
                self.execution().answered();
                let out = out?;
                self.metrics().observe_pass_sessions(out.pass_sessions);
                (out.outcome, Some(out.pass_rows))
            }
            None => (
                self.run(session, move |engine, s| {
                    engine.verify_scored(
                        s,
                        request.prefix,
                        &request.tree,
                        &request.params,
                        request.logprobs,
                    )
                })
                .await?,
                None,
            ),
        };
        let v = &out.verdict;
        let one_off_setup = self.engine().model().graph_setups() > setups;
        self.metrics()
            .observe_verification(draft_tokens, v.accepted_tokens.len());
        let max_draft_depth = self.load_gate().and_then(|g| {
            // A round's model time is its own preparation (new tokens before its pass's: a
            // prompt's prefill, which the gate does not price as a pass) and its pass, which a
            // shared pass spends on all its sessions' rows.
            let own_pass = 1 + draft_tokens;
            let rows = match pass_rows {
                Some(p) => p + out.tokens_processed.saturating_sub(own_pass),
                None => out.tokens_processed,
            };
            g.observe_and_advise(GateRound {
                session: &r.session_id,
                rows,
                time: out.model_time,
                depth: draft_depth,
                accepted: v.accepted_tokens.len(),
                continued,
                one_off_setup: one_off_setup || r.draft_one_off_setup,
                depth_limit: r.draft_depth_limit as usize,
            })
        });
        drop(in_flight);
        Ok(Response::new(VerifyResponse {
            request_id: r.request_id,
            accepted_token_ids: v.accepted_tokens.iter().map(|&t| t as i32).collect(),
            correction_token_id: v.next_token as i32,
            num_accepted: v.accepted_tokens.len() as i32,
            telemetry: Some(TelemetryMetadata {
                one_off_setup,
                ..info.telemetry(start, out.model_time, out.tokens_processed)
            }),
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use specsplit_core::sampling::SamplingParams;
    use specsplit_core::tree::TokenTree;
    use specsplit_proto::EndSessionRequest;

    use super::*;
    use crate::engine_session::SessionEngine;
    use crate::service::{Execution, WorkPlacement, WorkerInfo};
    use crate::session::SessionLimits;

    fn engine() -> Arc<TargetEngine> {
        Arc::new(TargetEngine::new(crate::test_models::tiny_model(11), 128).with_spare_sessions(0))
    }

    /// A batching target worker over `engine` holding at most `max_sessions` sessions, whose
    /// new sessions wait up to `wait` for room.
    fn worker(engine: &Arc<TargetEngine>, max_sessions: usize, wait: Duration) -> TargetWorker {
        let limits = SessionLimits {
            max_sessions,
            memory_budget_bytes: usize::MAX / 2,
            ttl: Duration::from_secs(600),
        };
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
        TargetWorker::new(engine.clone(), limits, info)
            .with_execution(Execution::new(WorkPlacement::Pool, Duration::ZERO))
            .with_admission_wait(wait)
            .with_batching(BatchLimits {
                max_sessions: 8,
                max_rows: 256,
            })
    }

    fn prompt(i: usize) -> Vec<i32> {
        (0..10 + 3 * i as i32)
            .map(|t| (t * 31 + 7 + 50 * i as i32) % 500)
            .collect()
    }

    /// A target-only round of session `id`: its prompt, or the previous round's token.
    fn round(id: &str, i: usize, last: Option<&VerifyResponse>) -> VerifyRequest {
        let mut r = VerifyRequest {
            session_id: id.into(),
            ..Default::default()
        };
        match last {
            None => r.prompt_token_ids = prompt(i),
            Some(l) => {
                r.new_token_ids = vec![l.correction_token_id];
                r.expected_prefix_length = l.cached_length;
            }
        }
        r
    }

    /// Session `i`'s first `n` tokens decoded by the engine alone.
    fn alone(engine: &TargetEngine, i: usize, n: usize) -> Vec<i32> {
        let mut s = engine.new_session(1).unwrap();
        let greedy = SamplingParams::default();
        let p: Vec<u32> = prompt(i).iter().map(|&t| t as u32).collect();
        let mut prefix = Prefix::Full(p);
        let mut out = Vec::new();
        while out.len() < n {
            let o = engine
                .verify(&mut s, prefix, &TokenTree::new(), &greedy)
                .unwrap();
            out.push(o.verdict.next_token as i32);
            prefix = Prefix::Delta {
                new_tokens: vec![o.verdict.next_token],
                expected_len: o.cached_len,
            };
        }
        out
    }

    #[tokio::test(flavor = "current_thread")]
    async fn sessions_join_and_end_between_shared_passes() {
        let engine = engine();
        let w = Arc::new(worker(&engine, 8, Duration::ZERO));
        let b = w.batcher().unwrap().clone();
        let ids = ["a", "b", "c"];
        let mut last: Vec<Option<VerifyResponse>> = vec![None, None, None];
        let mut tokens: Vec<Vec<i32>> = vec![vec![]; 3];
        for pass in 0..6 {
            // c joins at the third pass; b ends after the fourth.
            let members: Vec<usize> = (0..3)
                .filter(|&i| (i != 2 || pass >= 2) && (i != 1 || pass < 4))
                .collect();
            let hold = b.hold().await;
            let tasks: Vec<_> = members
                .iter()
                .map(|&i| {
                    let (w, r) = (w.clone(), round(ids[i], i, last[i].as_ref()));
                    tokio::spawn(async move { w.verify_drafts(Request::new(r)).await })
                })
                .collect();
            while b.queued() < members.len() {
                tokio::task::yield_now().await;
            }
            drop(hold);
            for (&i, t) in members.iter().zip(tasks) {
                let r = t.await.unwrap().unwrap().into_inner();
                tokens[i].push(r.correction_token_id);
                last[i] = Some(r);
            }
            if pass == 3 {
                let end = EndSessionRequest {
                    session_id: "b".into(),
                    ..Default::default()
                };
                assert!(
                    w.end_session(Request::new(end))
                        .await
                        .unwrap()
                        .into_inner()
                        .was_active
                );
            }
        }
        assert_eq!(tokens[0], alone(&engine, 0, 6));
        assert_eq!(tokens[1], alone(&engine, 1, 4));
        assert_eq!(tokens[2], alone(&engine, 2, 4));
        // The ended session is gone: its next delta must resend the prompt.
        let e = w
            .verify_drafts(Request::new(round("b", 1, last[1].as_ref())))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(e.message().contains(CACHE_EVICTED_MARKER), "{e:?}");
        assert!(b.stats().multi_session_passes >= 6, "{:?}", b.stats());
        assert_eq!(b.stats().most_sessions, 3);
        let text = w.scrape()();
        assert!(
            text.contains("specsplit_verify_pass_sessions_count 14"),
            "{text}"
        );
    }

    #[test]
    fn the_batcher_places_its_passes_as_the_worker_does() {
        let w = worker(&engine(), 4, Duration::ZERO);
        assert_eq!(w.batcher().unwrap().placement(), WorkPlacement::Pool);
        let w = w.with_execution(Execution::new(WorkPlacement::Inline, Duration::ZERO));
        assert_eq!(w.batcher().unwrap().placement(), WorkPlacement::Inline);
        assert_eq!(w.batcher().unwrap().limits().max_sessions, 8);
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_new_session_waits_for_room_then_is_admitted_or_refused() {
        let engine = engine();
        let w = Arc::new(worker(&engine, 1, Duration::from_secs(600)));
        w.verify_drafts(Request::new(round("a", 0, None)))
            .await
            .unwrap();
        // Session a is busy (a request of it holds its handle): b cannot evict it, and waits.
        let busy = w.sessions().get("a").unwrap();
        let waiting = {
            let w = w.clone();
            tokio::spawn(async move { w.verify_drafts(Request::new(round("b", 1, None))).await })
        };
        for _ in 0..50 {
            tokio::task::yield_now().await;
        }
        assert!(
            !waiting.is_finished(),
            "b was admitted while a held the only slot"
        );
        // a ends: b gets its room.
        let end = EndSessionRequest {
            session_id: "a".into(),
            ..Default::default()
        };
        w.end_session(Request::new(end)).await.unwrap();
        drop(busy);
        let r = waiting.await.unwrap().unwrap().into_inner();
        assert_eq!(r.correction_token_id, alone(&engine, 1, 1)[0]);
        // With b busy and a short wait, c is refused once the wait is over, told what to raise.
        let short = Arc::new(worker(&engine, 1, Duration::from_millis(30)));
        short
            .verify_drafts(Request::new(round("b", 1, None)))
            .await
            .unwrap();
        let _busy = short.sessions().get("b").unwrap();
        let e = short
            .verify_drafts(Request::new(round("c", 2, None)))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(
            e.message().contains("raise max_sessions") && e.message().contains("30 ms"),
            "{}",
            e.message()
        );
        // A sessionless request waits and is refused the same way.
        let e = short
            .verify_drafts(Request::new(VerifyRequest {
                prompt_token_ids: prompt(0),
                ..Default::default()
            }))
            .await
            .unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted, "{e:?}");
    }
}
