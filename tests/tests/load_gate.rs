//! Speculation gated by the target's load: the orchestrator drafts no deeper than the target
//! advises, a round advised 0 is target-only, and the output stays exactly the target's own.

use std::sync::Arc;
use std::time::Duration;

use specsplit_e2e::{config, prompts, start_draft, start_target_with};
use specsplit_orchestrator::NoDraft;
use specsplit_orchestrator::{GenerateConfig, Mode, Orchestrator, Pipeline};
use specsplit_workers::load_gate::{LoadAdvisor, LoadGate};

/// A gate advising depths up to `max_depth` that has measured enough to advise at once.
fn primed(max_depth: usize) -> LoadGate {
    let mut g = LoadGate::new(max_depth);
    for rows in [1, 64, 1, 64] {
        g.observe_pass(rows, Duration::from_millis(10));
    }
    g.observe_verdict(10, 8);
    g
}

/// Greedy generations of a same-weights pair under a target whose gate advises at most
/// `max_depth`: each round after the first drafts no deeper than advised (none where advised
/// 0), and every output equals target-only decoding. Every generation ends its session, which
/// the gate then no longer counts in the load.
async fn check(max_depth: usize) {
    let advisor = Arc::new(LoadAdvisor::with_gate(primed(max_depth)));
    let gate = advisor.clone();
    let target = start_target_with(&config("random:tiny:7", true), move |w| {
        w.with_load_gate(Some(gate))
    })
    .await;
    let draft = start_draft(&config("random:tiny:7", false)).await;
    let orch = Orchestrator::connect(Some(&draft.url), &target.url)
        .await
        .unwrap();
    let vocab = orch.vocab_size() as u32;
    for (i, prompt) in prompts(4, 3, vocab.min(500)).iter().enumerate() {
        let ar = GenerateConfig {
            mode: Mode::Ar,
            max_tokens: 20,
            ..Default::default()
        };
        let reference = orch.generate(prompt, &ar, |_| {}).await.unwrap();
        for pipeline in [Pipeline::Sequential, Pipeline::Overlapped] {
            let cfg = GenerateConfig {
                mode: Mode::Spec,
                pipeline,
                max_tokens: 20,
                widths: vec![1; 4],
                ..Default::default()
            };
            let g = orch.generate(prompt, &cfg, |_| {}).await.unwrap();
            assert_eq!(g.token_ids, reference.token_ids, "prompt {i} {pipeline:?}");
            assert!(g.rounds.len() > 1, "prompt {i} {pipeline:?}");
            for (n, r) in g.rounds.iter().enumerate().skip(1) {
                let advised = r.advised_depth.expect("every verdict carries advice");
                assert!(advised <= max_depth, "round {n}: advised {advised}");
                assert!(r.drafted <= advised, "round {n}: {r:?}");
                if advised == 0 {
                    assert_eq!(r.no_draft, Some(NoDraft::Load), "round {n}: {r:?}");
                    assert_eq!(r.tree_nodes, 0, "round {n}: {r:?}");
                }
            }
        }
    }
    assert_eq!(advisor.sessions_remembered(), 0, "every session ended");
    target.stop().await;
    draft.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advice_zero_makes_rounds_target_only_and_exact() {
    check(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn advice_caps_the_depth_and_stays_exact() {
    check(2).await;
}

/// With `load_gate` on (the default) a target advises once it has measured enough passes and
/// verdicts; off, it never does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_setting_switches_the_advice() {
    for on in [true, false] {
        let cfg = specsplit_workers::config::WorkerConfig {
            load_gate: on,
            ..config("random:tiny:7", true)
        };
        let target = specsplit_e2e::start_target(&cfg).await;
        let draft = start_draft(&config("random:tiny:7", false)).await;
        let orch = Orchestrator::connect(Some(&draft.url), &target.url)
            .await
            .unwrap();
        // Target-only rounds first: passes of other rows than a verify's (the gate needs two
        // row counts to advise, and prices no pass by a prompt's prefill).
        let prompt: Vec<u32> = (3..43).collect();
        let ar = GenerateConfig {
            mode: Mode::Ar,
            max_tokens: 10,
            ..Default::default()
        };
        orch.generate(&prompt, &ar, |_| {}).await.unwrap();
        let cfg = GenerateConfig {
            mode: Mode::Spec,
            pipeline: Pipeline::Sequential,
            max_tokens: 40,
            widths: vec![1; 4],
            ..Default::default()
        };
        let g = orch.generate(&prompt, &cfg, |_| {}).await.unwrap();
        let advised = g.rounds.iter().any(|r| r.advised_depth.is_some());
        assert_eq!(advised, on, "load_gate {on}: {:?}", g.rounds);
        target.stop().await;
        draft.stop().await;
    }
}
