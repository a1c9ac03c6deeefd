//! Greedy speculation with real models over loopback gRPC equals target-only decoding: the real
//! SmolLM2-135M as target (its own weights as the draft, and a random draft of another
//! vocabulary refused), and the real Qwen2.5-Coder 0.5B → 1.5B pair on a few prompts.

use specsplit_e2e::{config, ensure_model, start_draft, start_target};
use specsplit_models::loader::load_tokenizer;
use specsplit_models::source::resolve;
use specsplit_orchestrator::{GenerateConfig, Mode, Orchestrator, OrchestratorError, Pipeline};

const PROMPTS: &[&str] = &[
    "Write a Python function that reverses a string.",
    "What is the capital of France?",
    "Explain recursion to a child.",
    "List three prime numbers.",
    "def fibonacci(n):",
    "The quick brown fox",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Give me a haiku about the sea.",
    "SELECT * FROM users WHERE",
    "How do I sort a list in Rust?",
    "Once upon a time, in a land far away,",
    "What does HTTP stand for?",
    "Summarize the plot of Hamlet in one sentence.",
    "1, 1, 2, 3, 5, 8,",
    "Name a famous physicist.",
    "int main() {",
    "What is 12 times 12?",
    "Describe a cat.",
    "The meaning of life is",
    "Write a limerick about a programmer.",
];

async fn compare(
    draft_model: &str,
    target_model: &str,
    prompts: &[&str],
    max_tokens: usize,
    shapes: &[&[usize]],
) {
    let tokenizer = load_tokenizer(&resolve(target_model).unwrap()).unwrap();
    let target = start_target(&config(target_model, true)).await;
    let draft = start_draft(&config(draft_model, false)).await;
    let orch = Orchestrator::connect(Some(&draft.url), &target.url)
        .await
        .unwrap();
    let mut accepted = 0;
    for (i, text) in prompts.iter().enumerate() {
        let prompt = tokenizer
            .encode(&tokenizer.apply_chat_template(text), false)
            .unwrap();
        let ar = GenerateConfig {
            mode: Mode::Ar,
            max_tokens,
            ..Default::default()
        };
        let reference = orch.generate(&prompt, &ar, |_| {}).await.unwrap();
        let shape = shapes[i % shapes.len()];
        let pipeline = if i.is_multiple_of(2) {
            Pipeline::Overlapped
        } else {
            Pipeline::Sequential
        };
        let cfg = GenerateConfig {
            max_tokens,
            widths: shape.to_vec(),
            pipeline,
            ..Default::default()
        };
        let g = orch.generate(&prompt, &cfg, |_| {}).await.unwrap();
        assert_eq!(
            g.token_ids, reference.token_ids,
            "prompt {text:?} widths {shape:?} {pipeline:?}"
        );
        accepted += g.rounds.iter().map(|r| r.accepted).sum::<usize>();
    }
    assert!(accepted > 0, "no draft token was ever accepted");
    assert_eq!(target.sessions.len(), 0);
    assert_eq!(draft.sessions.len(), 0);
    target.stop().await;
    draft.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_speculation_equals_target_only_on_21_prompts() {
    ensure_model("smollm2");
    compare(
        "smollm2",
        "smollm2",
        PROMPTS,
        12,
        &[&[1, 1, 1, 1], &[3, 2, 1], &[2, 2, 1, 1]],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn qwen_coder_pair_speculation_equals_target_only() {
    ensure_model("qwen-0.5b");
    ensure_model("qwen-1.5b");
    compare(
        "qwen-coder-0.5b",
        "qwen-coder-1.5b",
        &PROMPTS[..3],
        12,
        &[&[1, 1, 1, 1], &[3, 2, 1]],
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatched_vocabularies_are_refused() {
    ensure_model("smollm2");
    let target = start_target(&config("smollm2", true)).await;
    let draft = start_draft(&config("random:tiny", false)).await;
    match Orchestrator::connect(Some(&draft.url), &target.url).await {
        Err(OrchestratorError::Incompatible(msg)) => {
            assert!(msg.contains("vocabulary"), "{msg}")
        }
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("paired models with different vocabularies"),
    }
    target.stop().await;
    draft.stop().await;
}
