//! The orchestrator's own runtime threads and the workers' server threads: generations through
//! them, one at a time or several at once over the client threads, match target-only decoding
//! whatever runtime the caller is on, a generation dropped midway and its orchestrator leave no
//! thread behind, and stopped workers leave none either.
//!
//! One test in this file: it counts the process's threads by name.

use std::time::{Duration, Instant};

use specsplit_e2e::{config, prompts, start_draft, start_target};
use specsplit_orchestrator::{
    ConnectOptions, GenerateConfig, Mode, Orchestrator, OrchestratorError, Pipeline,
    MAX_CLIENT_THREADS,
};

const MODEL: &str = "random:tiny:7";

/// Threads of this process whose name starts with `prefix` (Linux truncates names to 15 bytes).
fn threads_named(prefix: &str) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim_end().starts_with(prefix))
        .count()
}

/// Waits up to 5 s for the count of threads named `prefix` to become `n`.
async fn settles(prefix: &str, n: usize) -> usize {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let k = threads_named(prefix);
        if k == n || Instant::now() > until {
            return k;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "current_thread")]
async fn client_and_server_threads_generate_exactly_and_stop_cleanly() {
    if std::fs::read_dir("/proc/self/task").is_err() {
        return; // thread names are read from Linux's procfs
    }
    const CLIENT: &str = "specsplit-orche";
    const SERVER: &str = "specsplit-specs";
    let target = start_target(&config(MODEL, true)).await;
    let draft = start_draft(&config(MODEL, false)).await;
    assert_eq!(settles(SERVER, 2).await, 2, "one server thread per worker");
    // More client threads than the bound are refused before any starts.
    let too_many = ConnectOptions {
        client_threads: MAX_CLIENT_THREADS + 1,
        ..Default::default()
    };
    let refused =
        Orchestrator::connect_with_options(Some(&draft.url), &target.url, &too_many).await;
    assert!(
        matches!(refused, Err(OrchestratorError::Config(ref m)) if m.contains("client_threads")),
        "{:?}",
        refused.err()
    );
    assert_eq!(threads_named(CLIENT), 0);
    let opts = ConnectOptions {
        client_threads: 2,
        ..Default::default()
    };
    let orch = Orchestrator::connect_with_options(Some(&draft.url), &target.url, &opts)
        .await
        .unwrap();
    assert_eq!(threads_named(CLIENT), 2, "two client runtime threads");
    assert_eq!(orch.client_threads(), 2);
    let vocab = orch.vocab_size() as u32;
    let mut references = Vec::new();
    for prompt in prompts(3, 3, vocab.min(500)) {
        let ar = GenerateConfig {
            mode: Mode::Ar,
            max_tokens: 16,
            ..Default::default()
        };
        let reference = orch.generate(&prompt, &ar, |_| {}).await.unwrap();
        for pipeline in [Pipeline::Sequential, Pipeline::Overlapped] {
            let cfg = GenerateConfig {
                pipeline,
                max_tokens: 16,
                widths: vec![1, 1, 1],
                ..Default::default()
            };
            let mut streamed = Vec::new();
            let g = orch
                .generate(&prompt, &cfg, |t| streamed.extend_from_slice(t))
                .await
                .unwrap();
            assert_eq!(g.token_ids, reference.token_ids, "{pipeline:?}");
            assert_eq!(streamed, g.token_ids);
        }
        references.push((prompt, reference.token_ids));
    }
    // Three generations at once run over both client threads, each as it ran alone.
    let cfg = GenerateConfig {
        max_tokens: 16,
        widths: vec![1, 1, 1],
        ..Default::default()
    };
    let runs = references
        .iter()
        .map(|(prompt, _)| orch.generate(prompt, &cfg, |_| {}));
    let (a, b, c) = {
        let mut runs = runs;
        let (a, b, c) = (
            runs.next().unwrap(),
            runs.next().unwrap(),
            runs.next().unwrap(),
        );
        tokio::join!(a, b, c)
    };
    for ((_, want), got) in references.iter().zip([a, b, c]) {
        assert_eq!(&got.unwrap().token_ids, want);
    }

    // A clone keeps the threads; a generation dropped after its first round, then every
    // orchestrator dropped, stop them.
    let other = orch.clone();
    drop(orch);
    assert_eq!(threads_named(CLIENT), 2);
    let cfg = GenerateConfig {
        max_tokens: 100_000,
        widths: vec![1, 1, 1],
        ..Default::default()
    };
    let (first, got_first) = tokio::sync::oneshot::channel::<()>();
    let mut first = Some(first);
    let generation = other.generate(&[5, 6, 7], &cfg, move |_| {
        if let Some(f) = first.take() {
            let _ = f.send(());
        }
    });
    tokio::select! {
        r = generation => panic!("a 100k-token generation ended early: {:?}", r.map(|g| g.stop_reason)),
        _ = got_first => {}
    }
    drop(other);
    assert_eq!(
        settles(CLIENT, 0).await,
        0,
        "a client runtime thread outlived its users"
    );

    // Stopped workers' server threads end too.
    target.stop().await;
    draft.stop().await;
    assert_eq!(
        settles(SERVER, 0).await,
        0,
        "a server thread outlived its worker"
    );
}
