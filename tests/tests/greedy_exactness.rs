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
