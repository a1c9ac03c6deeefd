//! Model-free drafters end to end: greedy generation with the n-gram, suffix and online-chosen
//! drafters, run in the orchestrator or by a draft worker that loads no model, equals
//! target-only decoding token for token; round records name each round's drafter.

use specsplit_e2e::{config, prompts, start_draft, start_model_free_draft, start_target};
use specsplit_orchestrator::{
    Drafter, DrafterChoice, GenerateConfig, Generation, Mode, Orchestrator, Pipeline,
};
use specsplit_workers::model_free::DrafterKind;

const TARGET: &str = "random:tiny:7";

/// Prompts that repeat themselves (a passage twice), so the drafters find matches, and plain
/// random ones.
fn test_prompts(vocab: u32) -> Vec<Vec<u32>> {
    let mut out = Vec::new();
    for (i, p) in prompts(6, 3, vocab.min(500)).into_iter().enumerate() {
        if i % 2 == 0 {
            let mut twice = p.clone();
            twice.extend(&p);
            twice.truncate(p.len() * 2 - p.len() / 2);
            out.push(twice);
        } else {
            out.push(p);
        }
    }
    out
}

async fn reference(orch: &Orchestrator, prompt: &[u32], max_tokens: usize) -> Vec<u32> {
    let ar = GenerateConfig {
        mode: Mode::Ar,
        max_tokens,
        ..Default::default()
    };
    orch.generate(prompt, &ar, |_| {}).await.unwrap().token_ids
}

/// Checks `g` against the reference and returns how many draft tokens it got accepted.
fn check(g: &Generation, want: &[u32], what: &str, allowed: &[Drafter]) -> usize {
    assert_eq!(g.token_ids, want, "{what}");
    for r in &g.rounds {
        assert!(
            allowed.contains(&r.drafter),
            "{what}: round by {:?}",
            r.drafter
        );
        assert!(r.drafter != Drafter::None || r.tree_nodes == 0, "{what}");
    }
    let per: usize = g.stats.per_drafter.iter().map(|d| d.rounds).sum();
    assert_eq!(per, g.rounds.len(), "{what}: per-drafter rounds add up");
    g.rounds.iter().map(|r| r.accepted).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drafters_in_the_orchestrator_match_target_only() {
    let target = start_target(&config(TARGET, true)).await;
    let draft = start_draft(&config("random:tiny:8", false)).await;
    // No draft worker: the model-free drafters and the online choice need none.
    let alone = Orchestrator::connect(None, &target.url).await.unwrap();
    let with_draft = Orchestrator::connect(Some(&draft.url), &target.url)
        .await
        .unwrap();
    let vocab = alone.vocab_size() as u32;
    let max_tokens = 40;
    let mut accepted = [0usize; 2];
    for (i, prompt) in test_prompts(vocab).iter().enumerate() {
        let want = reference(&alone, prompt, max_tokens).await;
        for pipeline in [Pipeline::Sequential, Pipeline::Overlapped] {
            let widths = if i % 3 == 0 {
                vec![2, 2, 1]
            } else {
                vec![1; 5]
            };
            let cfg = |drafter| GenerateConfig {
                drafter,
                pipeline,
                max_tokens,
                widths: widths.clone(),
                ..Default::default()
            };
            let what = |d: &str| format!("prompt {i} {pipeline:?} {d}");
            for (k, (choice, drafter)) in [
                (DrafterChoice::Ngram, Drafter::Ngram),
                (DrafterChoice::Suffix, Drafter::Suffix),
            ]
            .into_iter()
            .enumerate()
            {
                let g = alone.generate(prompt, &cfg(choice), |_| {}).await.unwrap();
                accepted[k] += check(&g, &want, &what(drafter.name()), &[drafter]);
            }
            let model_free = [Drafter::Ngram, Drafter::Suffix, Drafter::None];
            let g = alone
                .generate(prompt, &cfg(DrafterChoice::Auto), |_| {})
                .await
                .unwrap();
            check(&g, &want, &what("auto"), &model_free);
            let all = [
                Drafter::Model,
                Drafter::Ngram,
                Drafter::Suffix,
                Drafter::None,
            ];
            let g = with_draft
                .generate(prompt, &cfg(DrafterChoice::Auto), |_| {})
                .await
                .unwrap();
            check(&g, &want, &what("auto with a draft worker"), &all);
        }
    }
    assert!(
        accepted[0] > 0,
        "the n-gram drafter never got a token accepted"
    );
    assert!(
        accepted[1] > 0,
        "the suffix drafter never got a token accepted"
    );
    // The model drafter still needs its worker.
    let model = GenerateConfig::default();
    assert!(alone.generate(&[1, 2, 3], &model, |_| {}).await.is_err());
    assert_eq!(target.sessions.len(), 0, "target sessions leaked");
    assert_eq!(draft.sessions.len(), 0, "draft sessions leaked");
    target.stop().await;
    draft.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_free_draft_worker_needs_no_model_and_matches_target_only() {
    let target = start_target(&config(TARGET, true)).await;
    for kind in [DrafterKind::Ngram, DrafterKind::Suffix] {
        let mut cfg = config("no-such-model-anywhere", false);
        cfg.drafter = kind;
        cfg.suffix_history = true;
        let draft = start_model_free_draft(&cfg).await;
        let orch = Orchestrator::connect(Some(&draft.url), &target.url)
            .await
            .unwrap();
        let vocab = orch.vocab_size() as u32;
        let mut accepted = 0;
        for (i, prompt) in test_prompts(vocab).iter().enumerate() {
            let want = reference(&orch, prompt, 32).await;
            for pipeline in [Pipeline::Sequential, Pipeline::Overlapped] {
                let g = orch
                    .generate(
                        prompt,
                        &GenerateConfig {
                            pipeline,
                            max_tokens: 32,
                            widths: vec![2, 1, 1, 1],
                            ..Default::default()
                        },
                        |_| {},
                    )
                    .await
                    .unwrap();
                let what = format!("{kind:?} worker, prompt {i} {pipeline:?}");
                accepted += check(&g, &want, &what, &[Drafter::Model]);
                assert_eq!(g.stats.draft_failures, 0, "{what}");
            }
        }
        assert!(accepted > 0, "{kind:?}: no draft token accepted");
        assert_eq!(draft.sessions.len(), 0, "draft sessions leaked");
        draft.stop().await;
    }
    target.stop().await;
}
