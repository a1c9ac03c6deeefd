//! The long CPU exactness check: greedy speculation with the default Qwen2.5-Coder 0.5B → 1.5B
//! Q4_K_M pair on the CPU emits token for token what the 1.5B target alone emits, over 40
//! prompts × 128 new tokens, for chains and trees, sequential and overlapped.
//!
//! It takes about an hour on a 2-core machine, so it is opt-in:
//! `scripts/exactness-long.sh` (or `cargo test -p specsplit-e2e --test
//! cpu_exactness_long -- --ignored --nocapture`). CI runs the direct check instead: a token's
//! logits are bit-identical whether it is decoded alone or inside passes of every size
//! (crates/specsplit-models/tests).

use std::time::Instant;

use specsplit_e2e::{config, ensure_model, start_draft, start_target};
use specsplit_models::loader::load_tokenizer;
use specsplit_models::source::resolve;
use specsplit_orchestrator::{GenerateConfig, Mode, NoDraft, Orchestrator, Pipeline};

/// Forty prompts of several kinds: code, prose continuations, questions, lists, data.
const PROMPTS: &[&str] = &[
    "The museum opened its doors in 1889, and since then",
    "Write a Python function that checks whether a number is prime.",
    "Explain how a hash map handles collisions.",
    "def quicksort(xs):",
    "Write a Rust function that parses a comma-separated list of integers.",
    "What are the differences between TCP and UDP?",
    "Summarize the causes of the French Revolution in a paragraph.",
    "Write a SQL query that returns the ten most recent orders per customer.",
    "Explain the difference between a process and a thread.",
    "Write a bash script that renames every .jpeg file in a folder to .jpg.",
    "Once upon a time, a lighthouse keeper found a message in a bottle. It said",
    "Describe the water cycle for a ten-year-old.",
    "Implement binary search in JavaScript and explain its complexity.",
    "What is the time complexity of merge sort, and why?",
    "Write a haiku about compilers, then explain its imagery.",
    "class LinkedList:\n    def __init__(self):",
    "Give three tips for writing readable code, with an example each.",
    "Explain what a closure is in Python with an example.",
    "Write a C function that reverses a string in place.",
    "List the planets of the solar system with one fact about each.",
    "How does garbage collection work in Java?",
    "Write a Go program that counts the words in a file.",
    "Explain the CAP theorem.",
    "Convert this JSON to YAML: {\"name\": \"specsplit\", \"version\": 1, \"tags\": [\"a\", \"b\"]}",
    "Write unit tests in pytest for a function add(a, b).",
    "Why do we use virtual environments in Python?",
    "Explain recursion using the example of computing a factorial.",
    "Write a regular expression that matches an email address and explain it.",
    "The history of the printing press begins",
    "What is the difference between git merge and git rebase?",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "Explain Big-O notation with three examples.",
    "fn main() {\n    let v = vec![3, 1, 2];",
    "Describe how HTTPS protects data in transit.",
    "Write a function in TypeScript that debounces another function.",
    "What is a race condition, and how can a mutex prevent it?",
    "Explain the difference between supervised and unsupervised learning.",
    "Write a Dockerfile for a small Python web application.",
    "In the year 2100, cities will",
    "Explain how a B-tree keeps itself balanced.",
];

/// Draft-tree shapes and pipelines the prompts rotate through.
const CONFIGS: &[(&[usize], Pipeline)] = &[
    (&[1, 1, 1, 1], Pipeline::Overlapped),
    (&[1, 1, 1, 1], Pipeline::Sequential),
    (&[3, 2, 1], Pipeline::Overlapped),
    (&[3, 2, 1], Pipeline::Sequential),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "about an hour on 2 cores: run with scripts/exactness-long.sh"]
async fn qwen_coder_pair_is_exact_over_40_prompts_of_128_tokens() {
    ensure_model("qwen-0.5b");
    ensure_model("qwen-1.5b");
    const MAX_TOKENS: usize = 128;
    let tokenizer = load_tokenizer(&resolve("qwen-coder-1.5b").unwrap()).unwrap();
    let target = start_target(&config("qwen-coder-1.5b", true)).await;
    let draft = start_draft(&config("qwen-coder-0.5b", false)).await;
    let orch = Orchestrator::connect(Some(&draft.url), &target.url)
        .await
        .unwrap();
    let mut mismatches = Vec::new();
    let (mut ar_tokens, mut ar_secs) = (0usize, 0f64);
    let (mut spec_tokens, mut spec_secs, mut accepted, mut drafted) = (0usize, 0f64, 0usize, 0);
    for (i, text) in PROMPTS.iter().enumerate() {
        // Half the prompts through the chat template, half as raw text.
        let templated = if i % 2 == 0 {
            tokenizer.apply_chat_template(text)
        } else {
            text.to_string()
        };
        let prompt = tokenizer.encode(&templated, false).unwrap();
        let ar = GenerateConfig {
            mode: Mode::Ar,
            max_tokens: MAX_TOKENS,
            ..Default::default()
        };
        let t = Instant::now();
        let reference = orch.generate(&prompt, &ar, |_| {}).await.unwrap();
        ar_secs += t.elapsed().as_secs_f64();
        ar_tokens += reference.token_ids.len();
        let (widths, pipeline) = CONFIGS[i % CONFIGS.len()];
        let cfg = GenerateConfig {
            max_tokens: MAX_TOKENS,
            widths: widths.to_vec(),
            pipeline,
            // Every round speculates: no switch to target-only rounds when speculation is
            // slower, and a draft deadline no loaded CPU misses.
            spec_probe_rounds: 0,
            draft_timeout_ms: 600_000,
            ..Default::default()
        };
        let t = Instant::now();
        let g = orch.generate(&prompt, &cfg, |_| {}).await.unwrap();
        spec_secs += t.elapsed().as_secs_f64();
        spec_tokens += g.token_ids.len();
        // Only the first round (the draft drafts beside the prefill) and a last single token
        // go without a tree.
        let skipped: Vec<_> = g
            .rounds
            .iter()
            .filter_map(|r| r.no_draft)
            .filter(|w| !matches!(w, NoDraft::FirstRound | NoDraft::LastToken))
            .collect();
        assert!(
            skipped.is_empty(),
            "prompt {i}: rounds without a draft: {skipped:?}"
        );
        accepted += g.rounds.iter().map(|r| r.accepted).sum::<usize>();
        drafted += g.rounds.iter().map(|r| r.drafted).sum::<usize>();
        let same = g.token_ids == reference.token_ids;
        let first_diff = g
            .token_ids
            .iter()
            .zip(&reference.token_ids)
            .position(|(a, b)| a != b);
        eprintln!(
            "prompt {i:2} widths {widths:?} {pipeline:?}: {} tokens, identical: {same}{}",
            g.token_ids.len(),
            first_diff.map_or(String::new(), |d| format!(" (first difference at {d})"))
        );
        if !same {
            mismatches.push((i, widths, pipeline, first_diff));
        }
    }
    eprintln!(
        "target-only {ar_tokens} tokens in {ar_secs:.1} s ({:.2} tok/s); speculative \
         {spec_tokens} tokens in {spec_secs:.1} s ({:.2} tok/s), {accepted} of {drafted} \
         drafted tokens accepted",
        ar_tokens as f64 / ar_secs,
        spec_tokens as f64 / spec_secs
    );
    assert!(
        mismatches.is_empty(),
        "speculative output differs from target-only: {mismatches:?}"
    );
    assert!(accepted > 0, "no draft token was ever accepted");
    target.stop().await;
    draft.stop().await;
}
