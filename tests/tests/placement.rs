//! Where the workers run their model work, and their busy-polling: a worker that runs requests
//! on its server thread and spins after each answer (the CUDA defaults) must give exactly what a
//! worker on the blocking pool gives, one generation at a time and many at once.

use std::time::Duration;

use specsplit_e2e::{config, prompts, start_draft_with, start_target_with};
use specsplit_orchestrator::{GenerateConfig, Mode, Orchestrator, Pipeline};
use specsplit_workers::service::{Execution, WorkPlacement};

const MODEL: &str = "random:tiny:7";
const DRAFT: &str = "random:tiny:8";

fn configs() -> Vec<GenerateConfig> {
    let base = GenerateConfig {
        max_tokens: 18,
        ..Default::default()
    };
    vec![
        GenerateConfig {
            mode: Mode::Ar,
            ..base.clone()
        },
        GenerateConfig {
            widths: vec![1, 1, 1],
            pipeline: Pipeline::Sequential,
            ..base.clone()
        },
        GenerateConfig {
            widths: vec![3, 2],
            pipeline: Pipeline::Overlapped,
            ..base
        },
    ]
}

/// Every configuration's output for every prompt, one generation at a time, then all of them
/// at once (which must agree), from workers set up by `placement` and `spin`.
async fn outputs(placement: WorkPlacement, spin: Duration) -> Vec<Vec<u32>> {
    let target = start_target_with(&config(MODEL, true), |w| {
        w.with_execution(Execution::new(placement, spin))
    })
    .await;
    let draft = start_draft_with(&config(DRAFT, false), |w| {
        w.with_execution(Execution::new(placement, spin))
    })
    .await;
    let orch = Orchestrator::connect(Some(&draft.url), &target.url)
        .await
        .unwrap();
    let jobs: Vec<(Vec<u32>, GenerateConfig)> = prompts(4, 3, 500)
        .into_iter()
        .flat_map(|p| configs().into_iter().map(move |c| (p.clone(), c)))
        .collect();
    let mut one_by_one = Vec::new();
    for (p, c) in &jobs {
        one_by_one.push(orch.generate(p, c, |_| {}).await.unwrap().token_ids);
    }
    let handles: Vec<_> = jobs
        .iter()
        .map(|(p, c)| {
            let (o, p, c) = (orch.clone(), p.clone(), c.clone());
            tokio::spawn(async move { o.generate(&p, &c, |_| {}).await.unwrap().token_ids })
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let at_once = tokio::time::timeout(Duration::from_secs(120), h)
            .await
            .expect("a concurrent generation hung")
            .unwrap();
        assert_eq!(at_once, one_by_one[i], "job {i}: concurrent != one by one");
    }
    assert_eq!(target.sessions.len(), 0);
    assert_eq!(draft.sessions.len(), 0);
    target.stop().await;
    draft.stop().await;
    one_by_one
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inline_spinning_workers_equal_pool_workers() {
    let pool = outputs(WorkPlacement::Pool, Duration::ZERO).await;
    let inline = outputs(WorkPlacement::Inline, Duration::from_millis(5)).await;
    assert_eq!(inline.len(), 12);
    assert!(
        inline.iter().all(|t| t.len() == 18),
        "every generation ran its length"
    );
    assert_eq!(inline, pool);
}
