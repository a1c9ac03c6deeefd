//! Generations that outlive a failing draft, hold their deadlines against a frozen worker, run
//! to the target's context limit, and carry their session secret on every request.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use specsplit_e2e::{config, prompts, start_draft, start_target, Relay, Running};
use specsplit_orchestrator::{GenerateConfig, Mode, NoDraft, Orchestrator, Pipeline, StopReason};
use specsplit_proto::draft_service_server::{DraftService, DraftServiceServer};
use specsplit_proto::target_service_server::{TargetService, TargetServiceServer};
use specsplit_proto::{
    DraftRequest, DraftResponse, EndSessionRequest, EndSessionResponse, PingRequest, PingResponse,
    VerifyRequest, VerifyResponse,
};
use specsplit_workers::draft::DraftSession;
use specsplit_workers::launch;
use specsplit_workers::service::{DraftWorker, TargetWorker};
use tonic::{Request, Response, Status};

const MODEL: &str = "random:tiny:7";

fn ar(max_tokens: usize) -> GenerateConfig {
    GenerateConfig {
        mode: Mode::Ar,
        max_tokens,
        ..Default::default()
    }
}

/// A speculative configuration whose behaviour does not depend on measured speed.
fn spec(max_tokens: usize, pipeline: Pipeline) -> GenerateConfig {
    GenerateConfig {
        max_tokens,
        widths: vec![2, 1, 1],
        pipeline,
        spec_probe_rounds: 0,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draft_killed_mid_generation_is_replaced_by_target_only_rounds_and_used_again() {
    let target = start_target(&config(MODEL, true)).await;
    // The target behind a relay: freezing it holds the round loop while the draft is stopped
    // or restarted, so each happens between two known rounds.
    let relay = Arc::new(Relay::start(target.addr).await);
    let draft = start_draft(&config(MODEL, false)).await;
    let draft_addr = draft.addr;
    let orch = Orchestrator::connect(Some(&draft.url), &relay.url)
        .await
        .unwrap();
    let prompt = &prompts(3, 3, 500)[2];
    let reference = orch.generate(prompt, &ar(80), |_| {}).await.unwrap();
    let cfg = GenerateConfig {
        draft_retry_rounds: 1,
        draft_retry_max_rounds: 2,
        ..spec(80, Pipeline::Sequential)
    };
    let old = Arc::new(Mutex::new(Some(draft)));
    let restarted: Arc<Mutex<Option<tokio::task::JoinHandle<Running<DraftSession>>>>> =
        Arc::new(Mutex::new(None));
    let (stopped, stopped_rx) = tokio::sync::oneshot::channel::<()>();
    let mut stopped = Some(stopped);
    let mut stopped_rx = Some(stopped_rx);
    let mut calls = 0;
    let (r2, o2, relay2) = (restarted.clone(), old.clone(), relay.clone());
    let g = orch
        .generate(prompt, &cfg, move |_| {
            calls += 1;
            if calls == 2 {
                relay2.freeze();
                let (d, relay, done) = (
                    o2.lock().unwrap().take().unwrap(),
                    relay2.clone(),
                    stopped.take().unwrap(),
                );
                tokio::spawn(async move {
                    d.stop().await;
                    relay.thaw();
                    let _ = done.send(());
                });
            }
            if calls == 8 {
                relay2.freeze();
                let (relay, waited) = (relay2.clone(), stopped_rx.take().unwrap());
                *r2.lock().unwrap() = Some(tokio::spawn(async move {
                    let _ = waited.await;
                    let mut c = config(MODEL, false);
                    c.listen = draft_addr.to_string();
                    let d = start_draft(&c).await;
                    relay.thaw();
                    d
                }));
            }
        })
        .await
        .unwrap();
    assert_eq!(g.token_ids, reference.token_ids);
    let failed: Vec<usize> = (0..g.rounds.len())
        .filter(|&i| g.rounds[i].no_draft == Some(NoDraft::DraftFailed))
        .collect();
    assert!(!failed.is_empty(), "no round saw the draft fail");
    assert_eq!(g.stats.draft_failures, failed.len());
    assert!(g
        .rounds
        .iter()
        .any(|r| r.no_draft == Some(NoDraft::Backoff)));
    assert_eq!(
        g.stats.target_only_rounds,
        g.rounds.iter().filter(|r| r.tree_nodes == 0).count()
    );
    assert!(g.stats.target_only_rounds > failed.len());
    for r in &g.rounds {
        assert_eq!(r.no_draft.is_some(), r.tree_nodes == 0, "{r:?}");
    }
    let last_failure = *failed.last().unwrap();
    assert!(
        g.rounds[last_failure..].iter().any(|r| r.tree_nodes > 0),
        "the restarted draft was used again: {:?}",
        g.rounds.iter().map(|r| r.no_draft).collect::<Vec<_>>()
    );
    let h = restarted.lock().unwrap().take().expect("restarted");
    let new_draft = h.await.unwrap();
    assert_eq!(
        new_draft.sessions.len(),
        0,
        "session ended on the new draft"
    );
    assert_eq!(target.sessions.len(), 0);
    new_draft.stop().await;
    target.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_draft_costs_each_round_at_most_the_draft_deadline() {
    let target = start_target(&config(MODEL, true)).await;
    let draft = start_draft(&config(MODEL, false)).await;
    let relay = Relay::start(draft.addr).await;
    let orch = Orchestrator::connect(Some(&relay.url), &target.url)
        .await
        .unwrap();
    let prompt = &prompts(4, 3, 500)[3];
    let reference = orch.generate(prompt, &ar(30), |_| {}).await.unwrap();
    relay.freeze();
    for pipeline in [Pipeline::Sequential, Pipeline::Overlapped] {
        let cfg = GenerateConfig {
            draft_timeout_ms: 200,
            draft_retry_rounds: 1,
            draft_retry_max_rounds: 4,
            ..spec(30, pipeline)
        };
        let t0 = Instant::now();
        let g = tokio::time::timeout(Duration::from_secs(60), orch.generate(prompt, &cfg, |_| {}))
            .await
            .expect("a frozen draft must not stall the generation")
            .unwrap();
        let elapsed = t0.elapsed();
        assert_eq!(g.token_ids, reference.token_ids, "{pipeline:?}");
        assert!(g.rounds.iter().all(|r| r.tree_nodes == 0), "{pipeline:?}");
        let failures = g.stats.draft_failures;
        assert!(failures >= 3, "{pipeline:?}: {failures} failures");
        // Each try waits the draft deadline; the backoff keeps tries to a fraction of rounds.
        assert!(
            failures < g.rounds.len() / 2 + 2,
            "{pipeline:?}: {failures}"
        );
        for r in &g.rounds {
            assert!(
                r.draft_ms < 200.0 + 400.0 && r.predraft_wait_ms < 200.0 + 400.0,
                "{pipeline:?}: a round waited past the draft deadline: {r:?}"
            );
        }
        // The tries, the end of the draft session (500 ms at most) and generous slack.
        let bound = Duration::from_millis(300 * failures as u64 + 500 + 10_000);
        assert!(elapsed < bound, "{pipeline:?}: {elapsed:?}");
    }
    relay.thaw();
    target.stop().await;
    draft.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draft_too_slow_to_pay_is_paused_and_probed_again() {
    let target = start_target(&config(MODEL, true)).await;
    let draft = start_draft(&config(MODEL, false)).await;
    let relay = Relay::start(draft.addr).await;
    let orch = Orchestrator::connect(Some(&relay.url), &target.url)
        .await
        .unwrap();
    let prompt = &prompts(6, 3, 500)[5];
    let reference = orch.generate(prompt, &ar(120), |_| {}).await.unwrap();
    // Each draft request now takes at least 2 × 25 ms, against a few ms per target step.
    relay.set_delay_ms(25);
    let cfg = GenerateConfig {
        spec_probe_rounds: 8,
        ..spec(120, Pipeline::Sequential)
    };
    let g = orch.generate(prompt, &cfg, |_| {}).await.unwrap();
    assert_eq!(g.token_ids, reference.token_ids);
    let sw = &g.stats.speed_switches;
    assert!(sw.len() >= 2, "paused, then probed: {sw:?}");
    assert!(!sw[0].speculate, "{sw:?}");
    assert!(
        sw[0].spec_tokens_per_s < sw[0].target_only_tokens_per_s,
        "{sw:?}"
    );
    assert!(sw[1].speculate && sw[1].round == sw[0].round + 8, "{sw:?}");
    // The paused rounds say why, and speculation resumed after them.
    let paused = &g.rounds[sw[0].round..sw[1].round];
    assert!(
        paused
            .iter()
            .all(|r| matches!(r.no_draft, Some(NoDraft::Slow | NoDraft::LastToken))),
        "{paused:?}"
    );
    assert!(
        g.rounds.get(sw[1].round).is_none_or(|r| r.tree_nodes > 0),
        "the probe speculates"
    );
    assert_eq!(g.stats.draft_failures, 0);
    target.stop().await;
    draft.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_target_returns_by_the_deadline_with_its_tokens() {
    let target = start_target(&config(MODEL, true)).await;
    let draft = start_draft(&config(MODEL, false)).await;
    let relay = Arc::new(Relay::start(target.addr).await);
    let orch = Orchestrator::connect(Some(&draft.url), &relay.url)
        .await
        .unwrap();
    let prompt = &prompts(2, 3, 500)[1];
    let reference = orch.generate(prompt, &ar(400), |_| {}).await.unwrap();
    for mode in [Mode::Ar, Mode::Spec] {
        let cfg = GenerateConfig {
            mode,
            deadline_ms: 1500,
            ..spec(400, Pipeline::Overlapped)
        };
        let mut streamed = Vec::new();
        let mut calls = 0;
        let r2 = relay.clone();
        let t0 = Instant::now();
        let g = tokio::time::timeout(
            Duration::from_secs(30),
            orch.generate(prompt, &cfg, |t| {
                streamed.extend_from_slice(t);
                calls += 1;
                if calls == 2 {
                    r2.freeze();
                }
            }),
        )
        .await
        .expect("the deadline must hold against a frozen target")
        .unwrap();
        let elapsed = t0.elapsed();
        // The deadline, the end of the sessions (500 ms at most), and slack for a busy host.
        assert!(
            elapsed < Duration::from_millis(1500 + 500 + 1000),
            "{mode:?}: {elapsed:?}"
        );
        assert!(
            elapsed >= Duration::from_millis(1500),
            "{mode:?}: {elapsed:?}"
        );
        assert_eq!(g.stop_reason, StopReason::Deadline, "{mode:?}");
        assert_eq!(g.token_ids, streamed);
        assert!(
            g.token_ids.len() >= 2,
            "{mode:?}: the tokens before the freeze"
        );
        assert_eq!(
            g.token_ids[..],
            reference.token_ids[..g.token_ids.len()],
            "{mode:?}"
        );
        relay.thaw();
    }
    target.stop().await;
    draft.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generations_run_to_the_targets_context_in_both_modes() {
    let mut tcfg = config(MODEL, true);
    tcfg.max_context = 64;
    let target = start_target(&tcfg).await;
    let draft = start_draft(&config(MODEL, false)).await;
    let orch = Orchestrator::connect(Some(&draft.url), &target.url)
        .await
        .unwrap();
    let prompt: Vec<u32> = (0..50).map(|i| 3 + (i * 37) % 400).collect();
    let reference = orch.generate(&prompt, &ar(100), |_| {}).await.unwrap();
    assert_eq!(reference.stop_reason, StopReason::Context);
    // Every slot of the context holds a token, and the last token is predicted after them.
    assert_eq!(prompt.len() + reference.token_ids.len(), 64 + 1);
    for pipeline in [Pipeline::Sequential, Pipeline::Overlapped] {
        let cfg = GenerateConfig {
            widths: vec![3, 2, 1],
            ..spec(100, pipeline)
        };
        let g = orch.generate(&prompt, &cfg, |_| {}).await.unwrap();
        assert_eq!(g.token_ids, reference.token_ids, "{pipeline:?}");
        assert_eq!(g.stop_reason, StopReason::Context, "{pipeline:?}");
        assert_eq!(g.stats.draft_failures, 0, "{pipeline:?}");
        assert!(g.rounds.iter().any(|r| r.tree_nodes > 0), "{pipeline:?}");
        // No round sent the target more than its context holds.
        let mut len = prompt.len();
        for r in &g.rounds {
            assert!(len + r.tree_nodes <= 64, "{pipeline:?}: {r:?}");
            len += r.emitted.len();
        }
    }
    // A prompt longer than the context is refused before any request.
    let long: Vec<u32> = (0..65).map(|i| 3 + i).collect();
    let e = orch.generate(&long, &ar(4), |_| {}).await.unwrap_err();
    assert!(e.to_string().contains("max_context"), "{e}");
    assert_eq!(target.sessions.len(), 0);
    target.stop().await;
    draft.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draft_with_smaller_limits_hands_over_to_target_only_rounds() {
    let target = start_target(&config(MODEL, true)).await;
    let mut dcfg = config(MODEL, false);
    dcfg.max_prompt_len = Some(40);
    dcfg.max_context = 48;
    let draft = start_draft(&dcfg).await;
    let orch = Orchestrator::connect(Some(&draft.url), &target.url)
        .await
        .unwrap();
    let prompt: Vec<u32> = (0..20).map(|i| 5 + (i * 53) % 450).collect();
    let reference = orch.generate(&prompt, &ar(60), |_| {}).await.unwrap();
    assert_eq!(reference.stop_reason, StopReason::MaxTokens);
    for pipeline in [Pipeline::Sequential, Pipeline::Overlapped] {
        let g = orch
            .generate(&prompt, &spec(60, pipeline), |_| {})
            .await
            .unwrap();
        assert_eq!(g.token_ids, reference.token_ids, "{pipeline:?}");
        assert_eq!(g.stop_reason, StopReason::MaxTokens);
        assert_eq!(g.stats.draft_failures, 0, "limits are kept, not hit");
        assert!(g.rounds.iter().any(|r| r.tree_nodes > 0), "{pipeline:?}");
        // Once the sequence outgrew the draft, every later round is target-only.
        let first = g
            .rounds
            .iter()
            .position(|r| r.no_draft == Some(NoDraft::Limit))
            .expect("the draft's limits were reached");
        assert!(
            g.rounds[first..]
                .iter()
                .all(|r| matches!(r.no_draft, Some(NoDraft::Limit | NoDraft::LastToken))),
            "{pipeline:?}: {:?}",
            g.rounds.iter().map(|r| r.no_draft).collect::<Vec<_>>()
        );
    }
    assert_eq!(draft.sessions.len(), 0);
    target.stop().await;
    draft.stop().await;
}

/// The session id and secret of each request a worker got, by kind.
type Seen = Arc<Mutex<Vec<(&'static str, String, String)>>>;

/// A target worker that records the secrets of the requests it serves.
struct RecordingTarget(TargetWorker, Seen);

#[tonic::async_trait]
impl TargetService for RecordingTarget {
    async fn verify_drafts(
        &self,
        r: Request<VerifyRequest>,
    ) -> Result<Response<VerifyResponse>, Status> {
        let m = r.get_ref();
        let row = ("verify", m.session_id.clone(), m.session_secret.clone());
        self.1.lock().unwrap().push(row);
        self.0.verify_drafts(r).await
    }

    async fn end_session(
        &self,
        r: Request<EndSessionRequest>,
    ) -> Result<Response<EndSessionResponse>, Status> {
        let m = r.get_ref();
        let row = ("end_target", m.session_id.clone(), m.session_secret.clone());
        self.1.lock().unwrap().push(row);
        self.0.end_session(r).await
    }

    async fn ping(&self, r: Request<PingRequest>) -> Result<Response<PingResponse>, Status> {
        TargetService::ping(&self.0, r).await
    }
}

/// A draft worker that records the secrets of the requests it serves.
struct RecordingDraft(DraftWorker, Seen);

#[tonic::async_trait]
impl DraftService for RecordingDraft {
    async fn generate_drafts(
        &self,
        r: Request<DraftRequest>,
    ) -> Result<Response<DraftResponse>, Status> {
        let m = r.get_ref();
        let row = ("draft", m.session_id.clone(), m.session_secret.clone());
        self.1.lock().unwrap().push(row);
        self.0.generate_drafts(r).await
    }

    async fn end_session(
        &self,
        r: Request<EndSessionRequest>,
    ) -> Result<Response<EndSessionResponse>, Status> {
        let m = r.get_ref();
        let row = ("end_draft", m.session_id.clone(), m.session_secret.clone());
        self.1.lock().unwrap().push(row);
        self.0.end_session(r).await
    }

    async fn ping(&self, r: Request<PingRequest>) -> Result<Response<PingResponse>, Status> {
        DraftService::ping(&self.0, r).await
    }
}

/// Serves `target` and `draft` on loopback ports of their own; returns an orchestrator
/// connected to both and the two servers' tasks (abort them to stop the servers).
async fn serve_both(
    target: impl TargetService,
    draft: impl DraftService,
) -> (
    Orchestrator,
    [tokio::task::JoinHandle<Result<(), tonic::transport::Error>>; 2],
) {
    let tl = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dl = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let (ta, da) = (tl.local_addr().unwrap(), dl.local_addr().unwrap());
    let servers = [
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(TargetServiceServer::new(target))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(tl)),
        ),
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(DraftServiceServer::new(draft))
                .serve_with_incoming(tonic::transport::server::TcpIncoming::from(dl)),
        ),
    ];
    let orch = Orchestrator::connect(Some(&format!("http://{da}")), &format!("http://{ta}"))
        .await
        .unwrap();
    (orch, servers)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_of_a_generation_carries_its_own_secret() {
    let seen: Seen = Arc::default();
    let (tcfg, dcfg) = (config(MODEL, true), config(MODEL, false));
    let t = RecordingTarget(
        launch::target_worker(&tcfg, launch::load(&tcfg).unwrap()),
        seen.clone(),
    );
    let d = RecordingDraft(
        launch::draft_worker(&dcfg, launch::load(&dcfg).unwrap()),
        seen.clone(),
    );
    let (orch, servers) = serve_both(t, d).await;
    let prompt = &prompts(2, 3, 500)[1];
    for pipeline in [Pipeline::Sequential, Pipeline::Overlapped] {
        orch.generate(prompt, &spec(12, pipeline), |_| {})
            .await
            .unwrap();
    }
    let seen = seen.lock().unwrap().clone();
    let mut sessions: Vec<(String, String)> = Vec::new();
    for (kind, session, secret) in &seen {
        assert_eq!(secret.len(), 32, "{kind} of {session}: secret {secret:?}");
        assert!(secret.chars().all(|c| c.is_ascii_hexdigit()), "{secret:?}");
        match sessions.iter().find(|(s, _)| s == session) {
            Some((_, known)) => assert_eq!(known, secret, "{kind}: one secret per session"),
            None => sessions.push((session.clone(), secret.clone())),
        }
    }
    assert_eq!(sessions.len(), 2, "two generations");
    assert_ne!(
        sessions[0].1, sessions[1].1,
        "each generation has its own secret"
    );
    for kind in ["verify", "draft", "end_target", "end_draft"] {
        assert!(seen.iter().any(|(k, _, _)| *k == kind), "no {kind} request");
    }
    for s in servers {
        s.abort();
    }
}

// Slow (about 31 s: the 30 s retry window), so off by default; run it with
// `cargo test -p specsplit-e2e --test resilience -- --ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn a_frozen_target_without_a_deadline_is_a_timeout_error_after_the_retry_window() {
    let target = start_target(&config(MODEL, true)).await;
    let relay = Arc::new(Relay::start(target.addr).await);
    let orch = Orchestrator::connect(None, &relay.url).await.unwrap();
    let cfg = GenerateConfig {
        rpc_timeout_ms: 1000,
        ..ar(400)
    };
    let r2 = relay.clone();
    let t0 = Instant::now();
    let mut calls = 0;
    let r = tokio::time::timeout(
        Duration::from_secs(60),
        orch.generate(&prompts(2, 3, 500)[1], &cfg, |_| {
            calls += 1;
            if calls == 2 {
                r2.freeze();
            }
        }),
    )
    .await
    .expect("a frozen target must not hang the generation");
    let elapsed = t0.elapsed();
    match r {
        Err(specsplit_orchestrator::OrchestratorError::Timeout { worker, after_ms }) => {
            assert_eq!((worker, after_ms), ("target", 1000));
        }
        other => panic!("expected a timeout, got {:?}", other.map(|g| g.stop_reason)),
    }
    assert!(
        elapsed >= Duration::from_secs(30) && elapsed < Duration::from_secs(34),
        "{elapsed:?}"
    );
    relay.thaw();
    target.stop().await;
}

/// A draft worker whose answers report one-off setup where told to.
struct SetupDraft(DraftWorker, bool);

#[tonic::async_trait]
impl DraftService for SetupDraft {
    async fn generate_drafts(
        &self,
        r: Request<DraftRequest>,
    ) -> Result<Response<DraftResponse>, Status> {
        let mut answer = self.0.generate_drafts(r).await?;
        let t = answer.get_mut().telemetry.as_mut().expect("telemetry");
        // The CPU makes no CUDA graphs: the worker itself never reports setup here.
        assert!(!t.one_off_setup);
        t.one_off_setup = self.1;
        Ok(answer)
    }

    async fn end_session(
        &self,
        r: Request<EndSessionRequest>,
    ) -> Result<Response<EndSessionResponse>, Status> {
        self.0.end_session(r).await
    }

    async fn ping(&self, r: Request<PingRequest>) -> Result<Response<PingResponse>, Status> {
        DraftService::ping(&self.0, r).await
    }
}

/// Of each verify request: whether it says the draft included one-off setup (`None` without a
/// draft tree) and how deep its session drafts by itself.
type SeenRounds = Arc<Mutex<Vec<(Option<bool>, u32)>>>;

/// A target worker that records [`SeenRounds`].
struct SetupTarget(TargetWorker, SeenRounds);

#[tonic::async_trait]
impl TargetService for SetupTarget {
    async fn verify_drafts(
        &self,
        r: Request<VerifyRequest>,
    ) -> Result<Response<VerifyResponse>, Status> {
        let m = r.get_ref();
        let setup = (!m.draft_tree.is_empty()).then_some(m.draft_one_off_setup);
        self.1.lock().unwrap().push((setup, m.draft_depth_limit));
        let answer = self.0.verify_drafts(r).await?;
        assert!(!answer.get_ref().telemetry.as_ref().unwrap().one_off_setup);
        Ok(answer)
    }

    async fn end_session(
        &self,
        r: Request<EndSessionRequest>,
    ) -> Result<Response<EndSessionResponse>, Status> {
        self.0.end_session(r).await
    }

    async fn ping(&self, r: Request<PingRequest>) -> Result<Response<PingResponse>, Status> {
        TargetService::ping(&self.0, r).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drafts_one_off_setup_and_its_sessions_own_depth_reach_the_target_with_each_round() {
    for (setup, pipeline) in [
        (true, Pipeline::Sequential),
        (false, Pipeline::Sequential),
        (true, Pipeline::Overlapped),
    ] {
        let seen: SeenRounds = Arc::default();
        let (tcfg, dcfg) = (config(MODEL, true), config(MODEL, false));
        let t = SetupTarget(
            launch::target_worker(&tcfg, launch::load(&tcfg).unwrap()),
            seen.clone(),
        );
        let d = SetupDraft(
            launch::draft_worker(&dcfg, launch::load(&dcfg).unwrap()),
            setup,
        );
        let (orch, servers) = serve_both(t, d).await;
        orch.generate(&prompts(2, 3, 500)[1], &spec(12, pipeline), |_| {})
            .await
            .unwrap();
        let rounds = std::mem::take(&mut *seen.lock().unwrap());
        let drafted: Vec<bool> = rounds.iter().filter_map(|s| s.0).collect();
        assert!(drafted.len() >= 2, "{pipeline:?}: {rounds:?}");
        assert!(
            drafted.iter().all(|&s| s == setup),
            "{pipeline:?}: {rounds:?}"
        );
        // Every round, drafted or not, tells the configured depth (3), however deep the end
        // of the generation let it draft; a target-only generation tells none.
        assert!(rounds.iter().all(|s| s.1 == 3), "{pipeline:?}: {rounds:?}");
        orch.generate(&prompts(2, 3, 500)[0], &ar(6), |_| {})
            .await
            .unwrap();
        let rounds = std::mem::take(&mut *seen.lock().unwrap());
        assert!(!rounds.is_empty());
        assert!(rounds.iter().all(|&s| s == (None, 0)), "{rounds:?}");
        for s in servers {
            s.abort();
        }
    }
}
