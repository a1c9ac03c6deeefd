//! The pre-draft pipeline over loopback gRPC: greedy output equal to target-only decoding for
//! every number of candidates (fixed or chosen by the cost model), chains and trees; pre-drafts
//! that hold the verdict's outcome are used; and a pre-draft for any other outcome is never
//! used, whatever the draft worker sends.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use specsplit_e2e::{config, prompts, start_draft, start_target};
use specsplit_orchestrator::{GenerateConfig, Mode, Orchestrator, Pipeline};
use specsplit_proto::draft_service_server::{DraftService, DraftServiceServer};
use specsplit_proto::{
    DraftRequest, DraftResponse, EndSessionRequest, EndSessionResponse, PingRequest, PingResponse,
    TokenNode,
};
use specsplit_workers::launch;
use specsplit_workers::service::DraftWorker;
use tonic::{Request, Response, Status};

fn predraft(widths: &[usize], candidates: usize, max_tokens: usize) -> GenerateConfig {
    GenerateConfig {
        mode: Mode::Spec,
        pipeline: Pipeline::Predraft,
        widths: widths.to_vec(),
        candidates,
        max_tokens,
        spec_probe_rounds: 0,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_predraft_matches_target_only_and_uses_its_hits() {
    let target = start_target(&config("random:tiny:7", true)).await;
    for (draft_model, same) in [("random:tiny:7", true), ("random:tiny:8", false)] {
        let draft = start_draft(&config(draft_model, false)).await;
        let orch = Orchestrator::connect(Some(&draft.url), &target.url)
            .await
            .unwrap();
        let (mut hits, mut tried) = (0, 0);
        for (i, prompt) in prompts(8, 3, 500).iter().enumerate() {
            let ar = GenerateConfig {
                mode: Mode::Ar,
                max_tokens: 24,
                ..Default::default()
            };
            let reference = orch.generate(prompt, &ar, |_| {}).await.unwrap();
            let shape: &[usize] = if i % 2 == 0 {
                &[1, 1, 1, 1]
            } else {
                &[2, 1, 1]
            };
            for candidates in [1, 2, 3, 0] {
                let cfg = predraft(shape, candidates, 24);
                let mut streamed = Vec::new();
                let g = orch
                    .generate(prompt, &cfg, |t| streamed.extend_from_slice(t))
                    .await
                    .unwrap();
                assert_eq!(
                    g.token_ids, reference.token_ids,
                    "{draft_model} prompt {i} widths {shape:?} candidates {candidates}"
                );
                assert_eq!(streamed, g.token_ids);
                for (r, next) in g.rounds.iter().zip(g.rounds.iter().skip(1)) {
                    if candidates > 0 && r.predraft_candidates > 0 {
                        assert_eq!(r.predraft_candidates, candidates);
                    }
                    if let Some(hit) = r.predraft_hit {
                        tried += 1;
                        hits += usize::from(hit);
                        // A hit's tree is the next round's; a miss drafts anew.
                        if next.drafted > 0 {
                            assert_eq!(next.overlap_hit, Some(hit), "{draft_model} prompt {i}");
                        }
                    }
                }
            }
        }
        assert!(tried > 0, "{draft_model}: no pre-draft ran");
        if same {
            // A draft equal to the target: the bonus is always its first candidate.
            assert!(
                hits * 10 >= tried * 9,
                "{draft_model}: {hits} hits of {tried}"
            );
        }
        assert_eq!(draft.sessions.len(), 0, "draft sessions leaked");
        draft.stop().await;
    }
    assert_eq!(target.sessions.len(), 0, "target sessions leaked");
    target.stop().await;
}

/// How the lying draft worker corrupts its pre-drafts.
const RELABEL: u8 = 0;
const GARBLE: u8 = 1;

/// A draft worker whose pre-drafts lie: each is relabelled to another outcome (its token
/// shifted by one) or its tree's tokens are replaced by one token.
struct LyingDraft(DraftWorker, Arc<AtomicU8>);

fn garble(nodes: &mut [TokenNode]) {
    for n in nodes {
        n.token_id = 3;
        garble(&mut n.children);
    }
}

#[tonic::async_trait]
impl DraftService for LyingDraft {
    async fn generate_drafts(
        &self,
        r: Request<DraftRequest>,
    ) -> Result<Response<DraftResponse>, Status> {
        let mut answer = self.0.generate_drafts(r).await?;
        let how = self.1.load(Ordering::Relaxed);
        for p in &mut answer.get_mut().predrafts {
            if how == RELABEL {
                p.token_id = (p.token_id + 1) % 500;
            } else {
                garble(&mut p.draft_tree);
            }
        }
        Ok(answer)
    }

    async fn end_session(
        &self,
        r: Request<EndSessionRequest>,
    ) -> Result<Response<EndSessionResponse>, Status> {
        DraftService::end_session(&self.0, r).await
    }

    async fn ping(&self, r: Request<PingRequest>) -> Result<Response<PingResponse>, Status> {
        DraftService::ping(&self.0, r).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pre_draft_for_another_outcome_is_never_used() {
    let target = start_target(&config("random:tiny:7", true)).await;
    // A draft equal to the target: honest pre-drafts would nearly always hit.
    let dcfg = config("random:tiny:7", false);
    let how = Arc::new(AtomicU8::new(RELABEL));
    let lying = LyingDraft(
        launch::draft_worker(&dcfg, launch::load(&dcfg).unwrap()),
        how.clone(),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let server = tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(DraftServiceServer::new(lying))
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener)),
    );
    let orch = Orchestrator::connect(Some(&format!("http://{addr}")), &target.url)
        .await
        .unwrap();
    for (i, prompt) in prompts(4, 3, 500).iter().enumerate() {
        let ar = GenerateConfig {
            mode: Mode::Ar,
            max_tokens: 20,
            ..Default::default()
        };
        let reference = orch.generate(prompt, &ar, |_| {}).await.unwrap();
        // Relabelled: no key matches the verdict's outcome, so every round drafts anew.
        how.store(RELABEL, Ordering::Relaxed);
        let g = orch
            .generate(prompt, &predraft(&[1, 1, 1], 2, 20), |_| {})
            .await
            .unwrap();
        assert_eq!(g.token_ids, reference.token_ids, "prompt {i}");
        let tried = g.rounds.iter().filter(|r| r.predraft_hit.is_some()).count();
        assert!(tried > 0, "prompt {i}: no pre-draft ran");
        for r in &g.rounds {
            assert_ne!(
                r.predraft_hit,
                Some(true),
                "prompt {i}: a relabelled pre-draft hit"
            );
            assert_ne!(
                r.overlap_hit,
                Some(true),
                "prompt {i}: a relabelled tree was used"
            );
        }
        // Garbled trees under the right keys are used, and the verifier rejects them.
        how.store(GARBLE, Ordering::Relaxed);
        let g = orch
            .generate(prompt, &predraft(&[1, 1, 1], 2, 20), |_| {})
            .await
            .unwrap();
        assert_eq!(g.token_ids, reference.token_ids, "prompt {i} garbled");
        assert!(g.rounds.iter().any(|r| r.overlap_hit == Some(true)));
    }
    server.abort();
    target.stop().await;
}
