//! Greedy speculative decoding over loopback gRPC equals target-only decoding token for token,
//! for sequential and overlapped pipelines, chains and trees, and drafts that agree with the
//! target (every token accepted) or not (frequent corrections).

use specsplit_e2e::{config, prompts, start_draft, start_target};
use specsplit_orchestrator::{GenerateConfig, Mode, Orchestrator, Pipeline};

const SHAPES: &[&[usize]] = &[&[1, 1, 1, 1], &[3, 2, 1], &[2, 2, 2, 1], &[1; 7]];

async fn check(
    draft_model: &str,
    target_model: &str,
    n_prompts: usize,
    max_tokens: usize,
    same: bool,
) {
    let target = start_target(&config(target_model, true)).await;
    let draft = start_draft(&config(draft_model, false)).await;
    let orch = Orchestrator::connect(Some(&draft.url), &target.url)
        .await
        .unwrap();
    let vocab = orch.vocab_size() as u32;
    let mut accepted_any = false;
    let mut rejected_any = false;
    for (i, prompt) in prompts(n_prompts, 3, vocab.min(500)).iter().enumerate() {
        let ar = GenerateConfig {
            mode: Mode::Ar,
            max_tokens,
            ..Default::default()
        };
        let reference = orch.generate(prompt, &ar, |_| {}).await.unwrap();
        assert!(!reference.token_ids.is_empty());
        for pipeline in [Pipeline::Sequential, Pipeline::Overlapped] {
            let shape = SHAPES[i % SHAPES.len()];
            let cfg = GenerateConfig {
                mode: Mode::Spec,
                pipeline,
                max_tokens,
                widths: shape.to_vec(),
                ..Default::default()
            };
            let mut streamed = Vec::new();
            let g = orch
                .generate(prompt, &cfg, |t| streamed.extend_from_slice(t))
                .await
                .unwrap();
            assert_eq!(
                g.token_ids, reference.token_ids,
                "prompt {i} {pipeline:?} widths {shape:?}"
            );
            assert_eq!(streamed, g.token_ids, "streamed tokens equal the result");
            for r in &g.rounds {
                accepted_any |= r.accepted > 0;
                rejected_any |= r.drafted > 0 && r.accepted < r.drafted;
            }
        }
    }
    if same {
        assert!(accepted_any, "an identical draft must get tokens accepted");
    } else {
        assert!(rejected_any, "a different draft must get tokens rejected");
    }
    assert_eq!(target.sessions.len(), 0, "target sessions leaked");
    assert_eq!(draft.sessions.len(), 0, "draft sessions leaked");
    target.stop().await;
    draft.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_same_weights_draft_matches_target_only() {
    check("random:tiny:7", "random:tiny:7", 20, 24, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiny_different_draft_matches_target_only() {
    check("random:tiny:8", "random:tiny:7", 20, 24, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_round_drafts_beside_the_targets_prefill() {
    // A draft identical to the target: its tree's root is always the target's first token, so
    // the second round verifies the tree drafted during the first, without a draft call.
    let target = start_target(&config("random:tiny:7", true)).await;
    let draft = start_draft(&config("random:tiny:7", false)).await;
    let orch = Orchestrator::connect(Some(&draft.url), &target.url)
        .await
        .unwrap();
    let prompt = &prompts(1, 3, 500)[0];
    let ar = GenerateConfig {
        mode: Mode::Ar,
        max_tokens: 12,
        ..Default::default()
    };
    let reference = orch.generate(prompt, &ar, |_| {}).await.unwrap();
    let cfg = GenerateConfig {
        mode: Mode::Spec,
        pipeline: Pipeline::Overlapped,
        max_tokens: 12,
        widths: vec![1, 1, 1],
        ..Default::default()
    };
    // By default only the overlapped pipeline overlaps the first round.
    let sequential = GenerateConfig {
        pipeline: Pipeline::Sequential,
        ..cfg.clone()
    };
    let s = orch.generate(prompt, &sequential, |_| {}).await.unwrap();
    assert_eq!(s.token_ids, reference.token_ids);
    assert_eq!(
        s.rounds[0].drafted, 3,
        "sequential: the first round verifies a tree"
    );
    assert_eq!(s.rounds[0].predraft_server_ms, 0.0);
    // The setting overrides the default rule either way, with the same output.
    for (pipeline, overlap) in [(Pipeline::Sequential, true), (Pipeline::Overlapped, false)] {
        let forced = GenerateConfig {
            pipeline,
            first_round_overlap: Some(overlap),
            ..cfg.clone()
        };
        let f = orch.generate(prompt, &forced, |_| {}).await.unwrap();
        assert_eq!(f.token_ids, reference.token_ids);
        let drafted = if overlap { 0 } else { 3 };
        assert_eq!(
            f.rounds[0].drafted, drafted,
            "{pipeline:?}, overlap {overlap}"
        );
        if overlap {
            assert!(
                f.rounds[0].predraft_server_ms > 0.0,
                "drafted beside the prefill"
            );
        }
    }
    let g = orch.generate(prompt, &cfg, |_| {}).await.unwrap();
    assert_eq!(g.token_ids, reference.token_ids);
    let (r1, r2) = (&g.rounds[0], &g.rounds[1]);
    assert_eq!(r1.drafted, 0, "the first round verifies no tree");
    assert_eq!(r1.emitted, reference.token_ids[..1]);
    assert_eq!(r1.overlap_hit, None);
    assert!(
        r1.predraft_server_ms > 0.0 && r1.predraft_model_ms <= r1.predraft_server_ms,
        "the pre-draft's times are recorded: {r1:?}"
    );
    // The first token goes out before the round waits for the pre-draft.
    assert!(
        g.stats.ttft_ms <= r1.round_ms - r1.predraft_wait_ms + 0.5,
        "{r1:?}"
    );
    assert_eq!(r2.overlap_hit, Some(true), "the pre-drafted tree is used");
    assert_eq!(r2.draft_ms, 0.0, "no draft call in the second round");
    assert_eq!((r2.drafted, r2.accepted), (3, 3));
    // Later rounds of the overlapped pipeline pre-draft beside their verify as usual.
    assert!(g.rounds[2..g.rounds.len() - 1]
        .iter()
        .all(|r| r.overlap_hit.is_some() && r.predraft_server_ms > 0.0));
    target.stop().await;
    draft.stop().await;
}
