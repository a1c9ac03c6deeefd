//! Faults: a target restarted or evicting mid-generation, unreachable or dying drafts, bad
//! requests, memory exhaustion, and concurrent generations.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use specsplit_e2e::{config, prompts, start_draft, start_target, Running};
use specsplit_orchestrator::{GenerateConfig, Mode, Orchestrator, OrchestratorError, Pipeline};
use specsplit_proto::draft_service_client::DraftServiceClient;
use specsplit_proto::target_service_client::TargetServiceClient;
use specsplit_proto::{DraftRequest, TokenNode, VerifyRequest};
use specsplit_workers::target::TargetSession;
use tonic::Code;

const TARGET: &str = "random:tiny:7";
const DRAFT: &str = "random:tiny:7";

fn spec(max_tokens: usize) -> GenerateConfig {
    GenerateConfig {
        max_tokens,
        widths: vec![2, 1, 1],
        pipeline: Pipeline::Sequential,
        ..Default::default()
    }
}

fn ar(max_tokens: usize) -> GenerateConfig {
    GenerateConfig {
        mode: Mode::Ar,
        max_tokens,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn target_restarted_mid_generation_gives_identical_output() {
    let target = start_target(&config(TARGET, true)).await;
    let draft = start_draft(&config(DRAFT, false)).await;
    let addr = target.addr;
    let url = target.url.clone();
    let orch = Orchestrator::connect(Some(&draft.url), &url).await.unwrap();
    let prompt = &prompts(3, 3, 500)[2];
    let reference = orch.generate(prompt, &ar(40), |_| {}).await.unwrap();

    let slot: Arc<Mutex<Option<Running<TargetSession>>>> = Arc::new(Mutex::new(Some(target)));
    let restarted: Arc<Mutex<Option<tokio::task::JoinHandle<Running<TargetSession>>>>> =
        Arc::new(Mutex::new(None));
    let mut calls = 0;
    let (s2, r2) = (slot.clone(), restarted.clone());
    let g = orch
        .generate(prompt, &spec(40), move |_| {
            calls += 1;
            if calls == 2 {
                // Kill the target now; bring a fresh one up on the same port a little later.
                let old = s2.lock().unwrap().take().unwrap();
                let h = tokio::spawn(async move {
                    old.stop().await;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                    let mut cfg = config(TARGET, true);
                    cfg.listen = addr.to_string();
                    start_target(&cfg).await
                });
                *r2.lock().unwrap() = Some(h);
            }
        })
        .await
        .unwrap();
    assert_eq!(g.token_ids, reference.token_ids);
    let h = restarted
        .lock()
        .unwrap()
        .take()
        .expect("the target was restarted");
    let new_target = h.await.unwrap();
    assert_eq!(
        new_target.sessions.len(),
        0,
        "session ended on the new target"
    );
    new_target.stop().await;
    draft.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn evicted_session_is_rebuilt_with_identical_output() {
    let target = start_target(&config(TARGET, true)).await;
    let draft = start_draft(&config(DRAFT, false)).await;
    let orch = Orchestrator::connect(Some(&draft.url), &target.url)
        .await
        .unwrap();
    let prompt = &prompts(5, 3, 500)[4];
    let reference = orch.generate(prompt, &ar(32), |_| {}).await.unwrap();
    let sessions = target.sessions.clone();
    let mut evictions = 0;
    let g = orch
        .generate(prompt, &spec(32), |_| {
            evictions += sessions.clear();
        })
        .await
        .unwrap();
    assert_eq!(g.token_ids, reference.token_ids);
    assert!(
        evictions >= 2,
        "the session was evicted repeatedly ({evictions})"
    );
    assert_eq!(target.sessions.len(), 0);
    target.stop().await;
    draft.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_or_dying_draft_is_a_clear_error_not_a_hang() {
    let target = start_target(&config(TARGET, true)).await;
    let r = tokio::time::timeout(
        Duration::from_secs(20),
        Orchestrator::connect(Some("http://127.0.0.1:1"), &target.url),
    )
    .await
    .expect("connect must not hang");
    match r {
        Err(OrchestratorError::Unreachable { worker, .. }) => assert_eq!(worker, "draft"),
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("connected to nothing"),
    }

    let draft = start_draft(&config(DRAFT, false)).await;
    let orch = Orchestrator::connect(Some(&draft.url), &target.url)
        .await
        .unwrap();
    let reference = orch.generate(&[5, 6, 7], &ar(64), |_| {}).await.unwrap();
    let draft = Arc::new(Mutex::new(Some(draft)));
    let d2 = draft.clone();
    let r = tokio::time::timeout(
        Duration::from_secs(60),
        orch.generate(&[5, 6, 7], &spec(64), move |_| {
            if let Some(d) = d2.lock().unwrap().take() {
                tokio::spawn(d.stop());
            }
        }),
    )
    .await
    .expect("generation must not hang when the draft dies");
    // The generation goes on with target-only rounds, with the target-only output.
    let g = r.expect("a dying draft does not end the generation");
    assert_eq!(g.token_ids, reference.token_ids);
    assert!(g.stats.draft_failures >= 1, "{:?}", g.stats);
    // The target's session was ended.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(target.sessions.len(), 0);
    target.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_the_right_status_codes() {
    let target = start_target(&config(TARGET, true)).await;
    let draft = start_draft(&config(DRAFT, false)).await;
    let mut t = TargetServiceClient::connect(target.url.clone())
        .await
        .unwrap();
    let mut d = DraftServiceClient::connect(draft.url.clone())
        .await
        .unwrap();
    let node = |id: i32, children: Vec<TokenNode>| TokenNode {
        token_id: id,
        children,
        ..Default::default()
    };
    let verify = |prompt: Vec<i32>, tree: Vec<TokenNode>| VerifyRequest {
        session_id: "s".into(),
        prompt_token_ids: prompt,
        draft_tree: tree,
        ..Default::default()
    };
    fn code<T>(r: Result<tonic::Response<T>, tonic::Status>) -> Code {
        match r {
            Ok(_) => Code::Ok,
            Err(s) => {
                assert!(!s.message().is_empty());
                s.code()
            }
        }
    }
    // Out-of-range and negative token ids, in the prompt and in the tree.
    assert_eq!(
        code(t.verify_drafts(verify(vec![1, 2, 100_000], vec![])).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(t.verify_drafts(verify(vec![1, -2], vec![])).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            t.verify_drafts(verify(vec![1], vec![node(-1, vec![])]))
                .await
        ),
        Code::InvalidArgument
    );
    assert_eq!(
        code(
            t.verify_drafts(verify(vec![1], vec![node(1, vec![node(9999, vec![])])]))
                .await
        ),
        Code::InvalidArgument
    );
    // A tree larger than the limit (128 nodes), wide or deep.
    let wide: Vec<TokenNode> = (0..200).map(|i| node(i % 50, vec![])).collect();
    assert_eq!(
        code(t.verify_drafts(verify(vec![1], wide)).await),
        Code::InvalidArgument
    );
    let mut deep = node(1, vec![]);
    for _ in 0..90 {
        deep = node(1, vec![node(2, vec![]), deep]);
    }
    assert_eq!(
        code(t.verify_drafts(verify(vec![1], vec![deep])).await),
        Code::InvalidArgument
    );
    // Deeper than protobuf's 100 nesting levels: the request cannot even be decoded, and the
    // sender is told so (not INTERNAL).
    let mut deeper = node(1, vec![]);
    for _ in 0..150 {
        deeper = node(1, vec![deeper]);
    }
    let err = t
        .verify_drafts(verify(vec![1], vec![deeper]))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("99 levels deep"),
        "{}",
        err.message()
    );
    // Sampled verification of a tree with no draft distribution at all (the original client's
    // trees) verifies each drafted token as a point-mass proposal; one with the roots'
    // distribution but not that of a node with children is malformed.
    let mut r = verify(vec![1, 2], vec![node(3, vec![node(4, vec![])])]);
    r.temperature = 0.8;
    assert_eq!(code(t.verify_drafts(r.clone()).await), Code::Ok);
    r.root_distribution = Some(specsplit_proto::DraftDistribution {
        token_ids: vec![3],
        probs: vec![1.0],
    });
    let err = t.verify_drafts(r).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument, "{err:?}");
    assert!(
        err.message().contains("or none at all"),
        "{}",
        err.message()
    );
    // Delta requests: unknown session, then a wrong expected length.
    let delta = |sid: &str, len: i32| VerifyRequest {
        session_id: sid.into(),
        new_token_ids: vec![4],
        expected_prefix_length: len,
        ..Default::default()
    };
    let err = t.verify_drafts(delta("nobody", 3)).await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    assert!(
        err.message().contains("CACHE_EVICTED_DELTA_ONLY") && !err.message().contains("nobody"),
        "{}",
        err.message()
    );
    let ok = t
        .verify_drafts(verify(vec![1, 2, 3], vec![node(3, vec![])]))
        .await
        .unwrap()
        .into_inner();
    // The refusal names the caller's length, not the session's (another client may send it).
    let err = t
        .verify_drafts(delta("s", ok.cached_length + 1))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    let msg = err.message();
    assert!(
        msg.contains("CACHE_EVICTED_DELTA_ONLY")
            && msg.contains(&(ok.cached_length + 1).to_string())
            && !msg.contains(&format!("length {}", ok.cached_length)),
        "{msg}"
    );
    assert_eq!(
        code(t.verify_drafts(delta("s", ok.cached_length)).await),
        Code::Ok
    );
    // Draft side.
    let dreq = |ids: Vec<i32>, len: i32| DraftRequest {
        session_id: "s".into(),
        prompt_token_ids: ids,
        max_draft_len: len,
        num_beams: 1,
        ..Default::default()
    };
    assert_eq!(
        code(d.generate_drafts(dreq(vec![1, 70_000], 3)).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(d.generate_drafts(dreq(vec![1, 2], 0)).await),
        Code::InvalidArgument
    );
    assert_eq!(
        code(d.generate_drafts(dreq(vec![], 3)).await),
        Code::InvalidArgument
    );
    assert_eq!(code(d.generate_drafts(dreq(vec![1, 2], 3)).await), Code::Ok);
    target.stop().await;
    draft.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_budget_exhaustion_is_resource_exhausted() {
    let mut cfg = config(TARGET, true);
    cfg.memory_budget_mb = 0;
    let target = start_target(&cfg).await;
    let orch = Orchestrator::connect(None, &target.url).await.unwrap();
    match orch.generate(&[1, 2, 3], &ar(4), |_| {}).await {
        Err(OrchestratorError::Rpc { status, .. }) => {
            assert_eq!(status.code(), Code::ResourceExhausted, "{status}")
        }
        other => panic!(
            "expected RESOURCE_EXHAUSTED, got {:?}",
            other.map(|g| g.token_ids)
        ),
    }
    target.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixteen_concurrent_generations_equal_one_by_one() {
    let target = start_target(&config(TARGET, true)).await;
    let draft = start_draft(&config("random:tiny:8", false)).await;
    let orch = Orchestrator::connect(Some(&draft.url), &target.url)
        .await
        .unwrap();
    let ps = prompts(16, 3, 500);
    let cfg = |i: usize| GenerateConfig {
        max_tokens: 20,
        widths: if i.is_multiple_of(2) {
            vec![1, 1, 1]
        } else {
            vec![3, 2]
        },
        pipeline: if i.is_multiple_of(3) {
            Pipeline::Sequential
        } else {
            Pipeline::Overlapped
        },
        ..Default::default()
    };
    let mut one_by_one = Vec::new();
    for (i, p) in ps.iter().enumerate() {
        one_by_one.push(orch.generate(p, &cfg(i), |_| {}).await.unwrap().token_ids);
    }
    let handles: Vec<_> = ps
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let (o, p, c) = (orch.clone(), p.clone(), cfg(i));
            tokio::spawn(async move { o.generate(&p, &c, |_| {}).await.unwrap().token_ids })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(h.await.unwrap(), one_by_one[i], "generation {i}");
    }
    assert_eq!(target.sessions.len(), 0);
    assert_eq!(draft.sessions.len(), 0);
    target.stop().await;
    draft.stop().await;
}
