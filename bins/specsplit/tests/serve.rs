//! `specsplit serve` against a real OpenAI client library (async-openai): completions and chat
//! completions, streamed and not, equal to `specsplit generate --mode ar`; stop strings;
//! log-probabilities; errors in OpenAI's shape with their HTTP status; concurrent requests;
//! the API key, `/metrics` against the requests made, `/health` and `/ready`.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

use async_openai::config::OpenAIConfig;
use async_openai::error::OpenAIError;
use async_openai::types::chat::{
    ChatCompletionRequestMessage, ChatCompletionRequestUserMessageArgs, CompletionFinishReason,
    CreateChatCompletionRequestArgs, FinishReason,
};
use async_openai::types::completions::CreateCompletionRequestArgs;
use async_openai::Client;
use serde_json::Value;
use tokio_stream::StreamExt;

const MODEL: &str = "random:tiny:7";
const MAX_TOKENS: u32 = 20;

/// A `specsplit serve` process with in-process workers on random models, killed when dropped.
struct Serve {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    url: String,
}

impl Serve {
    /// Starts `specsplit serve` on a free port with `extra` flags and waits until it serves.
    fn start(extra: &[&str]) -> Serve {
        Self::start_with_env(extra, &[])
    }

    /// [`Serve::start`] with `env` set.
    fn start_with_env(extra: &[&str], env: &[(&str, &str)]) -> Serve {
        let mut child = Command::new(env!("CARGO_BIN_EXE_specsplit"))
            // The speculative counters below count the draft model's trees.
            .env("SPECSPLIT_ORCHESTRATOR__DRAFTER", "model")
            .args([
                "serve",
                "--target-model",
                MODEL,
                "--draft-model",
                MODEL,
                "--http-listen",
                "127.0.0.1:0",
            ])
            .args(extra)
            .envs(env.iter().copied())
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run specsplit serve");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let mut seen = Vec::new();
        let url = loop {
            let Some(Ok(line)) = lines.next() else {
                let _ = child.kill();
                panic!("specsplit serve ended before serving: {seen:?}");
            };
            if let Some(at) = line.find(" on http://") {
                break line[at + 4..].trim().to_string();
            }
            seen.push(line);
        };
        // Keep draining stderr so that the server never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        Serve { child, url }
    }

    fn client(&self) -> Client<OpenAIConfig> {
        self.client_with_key("unused")
    }

    /// A client sending `key` (async-openai sends it as `Authorization: Bearer <key>`).
    fn client_with_key(&self, key: &str) -> Client<OpenAIConfig> {
        Client::with_config(
            OpenAIConfig::new()
                .with_api_base(format!("{}/v1", self.url))
                .with_api_key(key),
        )
    }

    /// `GET path` with `headers`: the status and the body.
    async fn get(&self, path: &str, headers: &[(&str, &str)]) -> (u16, String) {
        let mut req = reqwest::Client::new().get(format!("{}{path}", self.url));
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let r = req.send().await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `specsplit generate PROMPT --mode ar --json` with `extra` flags: the reference output.
fn reference(prompt: &str, extra: &[&str]) -> Value {
    let max = MAX_TOKENS.to_string();
    let out = Command::new(env!("CARGO_BIN_EXE_specsplit"))
        .args([
            "generate",
            prompt,
            "--target-model",
            MODEL,
            "--mode",
            "ar",
            "--max-tokens",
            &max,
            "--json",
        ])
        .args(extra)
        .env("RUST_LOG", "error")
        .output()
        .expect("run specsplit generate");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object")
}

fn text_of(v: &Value) -> String {
    v["text"].as_str().unwrap().to_string()
}

fn count(v: &Value, key: &str) -> u32 {
    v[key].as_array().unwrap().len() as u32
}

/// A completion of `prompt`: its text, finish reason and usage (prompt, completion tokens).
async fn complete(
    client: &Client<OpenAIConfig>,
    prompt: &str,
    stop: &[&str],
) -> Result<(String, Option<CompletionFinishReason>, (u32, u32)), OpenAIError> {
    let mut req = CreateCompletionRequestArgs::default();
    req.model(MODEL)
        .prompt(prompt)
        .max_tokens(MAX_TOKENS)
        .temperature(0.0);
    if !stop.is_empty() {
        req.stop(stop.iter().map(|s| s.to_string()).collect::<Vec<_>>());
    }
    let r = client.completions().create(req.build()?).await?;
    let usage = r.usage.expect("usage");
    Ok((
        r.choices[0].text.clone(),
        r.choices[0].finish_reason,
        (usage.prompt_tokens, usage.completion_tokens),
    ))
}

/// A streamed completion of `prompt`: the concatenated text and the last finish reason.
async fn complete_streaming(
    client: &Client<OpenAIConfig>,
    prompt: &str,
    stop: &[&str],
) -> (String, Option<CompletionFinishReason>) {
    let mut req = CreateCompletionRequestArgs::default();
    req.model(MODEL)
        .prompt(prompt)
        .max_tokens(MAX_TOKENS)
        .temperature(0.0);
    if !stop.is_empty() {
        req.stop(stop.iter().map(|s| s.to_string()).collect::<Vec<_>>());
    }
    let mut stream = client
        .completions()
        .create_stream(req.build().unwrap())
        .await
        .unwrap();
    let (mut text, mut finish) = (String::new(), None);
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.expect("a chunk");
        for c in chunk.choices {
            text.push_str(&c.text);
            finish = c.finish_reason.or(finish);
        }
    }
    (text, finish)
}

fn user(text: &str) -> ChatCompletionRequestMessage {
    ChatCompletionRequestUserMessageArgs::default()
        .content(text)
        .build()
        .unwrap()
        .into()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_chat_equal_target_only_generation_streamed_or_not() {
    let prompt = "The quick brown fox";
    let raw = reference(prompt, &["--no-chat-template"]);
    let chat_ref = reference(prompt, &[]);
    let serve = Serve::start(&[]);
    let client = serve.client();

    let models = client.models().list().await.unwrap();
    assert_eq!(models.data.len(), 1);
    assert_eq!(models.data[0].id, MODEL);

    let (text, finish, usage) = complete(&client, prompt, &[]).await.unwrap();
    assert!(!text.is_empty());
    assert_eq!(text, text_of(&raw));
    assert_eq!(
        usage,
        (count(&raw, "prompt_token_ids"), count(&raw, "token_ids"))
    );
    let want_finish = if raw["stop_reason"] == "max_tokens" {
        CompletionFinishReason::Length
    } else {
        CompletionFinishReason::Stop
    };
    assert_eq!(finish, Some(want_finish));
    let (streamed, finish) = complete_streaming(&client, prompt, &[]).await;
    assert_eq!(streamed, text);
    assert_eq!(finish, Some(want_finish));

    let req = CreateChatCompletionRequestArgs::default()
        .model(MODEL)
        .messages(vec![user(prompt)])
        .max_completion_tokens(MAX_TOKENS)
        .temperature(0.0)
        .build()
        .unwrap();
    let r = client.chat().create(req.clone()).await.unwrap();
    let answer = r.choices[0].message.content.clone().unwrap_or_default();
    assert_eq!(answer, text_of(&chat_ref));
    let usage = r.usage.unwrap();
    assert_eq!(usage.completion_tokens, count(&chat_ref, "token_ids"));
    assert_eq!(
        usage.total_tokens,
        usage.prompt_tokens + usage.completion_tokens
    );
    let want_finish = if chat_ref["stop_reason"] == "max_tokens" {
        FinishReason::Length
    } else {
        FinishReason::Stop
    };
    assert_eq!(r.choices[0].finish_reason, Some(want_finish));

    let mut stream = client.chat().create_stream(req).await.unwrap();
    let (mut streamed, mut finish) = (String::new(), None);
    while let Some(chunk) = stream.next().await {
        for c in chunk.expect("a chunk").choices {
            streamed.push_str(c.delta.content.as_deref().unwrap_or_default());
            finish = c.finish_reason.or(finish);
        }
    }
    assert_eq!(streamed, answer);
    assert_eq!(finish, Some(want_finish));
}

/// A stop string from `text` past its start that does not occur earlier: two characters where
/// such a pair holds no replacement character, else one.
fn stop_in_middle(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let fresh = |s: &String| !s.contains('\u{fffd}') && text.find(s.as_str()).unwrap() > 0;
    let pairs = (1..chars.len() - 1).map(|i| chars[i..i + 2].iter().collect::<String>());
    let singles = (1..chars.len()).map(|i| chars[i].to_string());
    pairs
        .chain(singles)
        .find(fresh)
        .expect("a stop string in the reference text")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_strings_end_the_text_before_them() {
    let prompt = "The quick brown fox";
    let full = text_of(&reference(prompt, &["--no-chat-template"]));
    let stop = stop_in_middle(&full);
    let want = &full[..full.find(&stop).unwrap()];
    assert!(!want.is_empty() && want.len() < full.len());

    let serve = Serve::start(&[]);
    let client = serve.client();
    let (text, finish, _) = complete(&client, prompt, &["never-generated", &stop])
        .await
        .unwrap();
    assert_eq!(text, want);
    assert_eq!(finish, Some(CompletionFinishReason::Stop));
    let (streamed, finish) = complete_streaming(&client, prompt, &[&stop]).await;
    assert_eq!(streamed, want);
    assert_eq!(finish, Some(CompletionFinishReason::Stop));

    // `generate --stop` cuts the same text, in JSON and streamed to stdout.
    let cut = reference(prompt, &["--no-chat-template", "--stop", &stop]);
    assert_eq!(text_of(&cut), want);
    assert_eq!(cut["stop_reason"], "stopped");
    let out = Command::new(env!("CARGO_BIN_EXE_specsplit"))
        .args([
            "generate",
            prompt,
            "--target-model",
            MODEL,
            "--draft-model",
            MODEL,
        ])
        .args(["--no-chat-template", "--max-tokens", "20", "--stop", &stop])
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    assert!(out.status.success());
    assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{want}\n"));
}

/// Posts `body` to `path`; returns the status and the JSON answer.
async fn post(url: &str, path: &str, body: String) -> (u16, Value) {
    let r = reqwest::Client::new()
        .post(format!("{url}{path}"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    (status, r.json().await.unwrap())
}

fn close(got: &[f32], want: &Value) {
    let want: Vec<f64> = want
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(got.len(), want.len(), "{got:?} against {want:?}");
    for (g, w) in got.iter().zip(&want) {
        assert!(
            *w <= 0.0 && (*g as f64 - w).abs() < 1e-4,
            "{got:?} against {want:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logprobs_are_the_targets_for_each_generated_token() {
    let prompt = "The quick brown fox";
    let raw = reference(prompt, &["--no-chat-template"]);
    let chat_ref = reference(prompt, &[]);
    // `generate --json` holds one log-probability per token.
    assert_eq!(count(&raw, "token_logprobs"), count(&raw, "token_ids"));
    let serve = Serve::start(&[]);
    let client = serve.client();

    let req = CreateCompletionRequestArgs::default()
        .model(MODEL)
        .prompt(prompt)
        .max_tokens(MAX_TOKENS)
        .temperature(0.0)
        .logprobs(0u8)
        .build()
        .unwrap();
    let r = client.completions().create(req.clone()).await.unwrap();
    let lp = r.choices[0].logprobs.clone().expect("logprobs");
    let values: Vec<f32> = lp.token_logprobs.iter().map(|v| v.unwrap()).collect();
    close(&values, &raw["token_logprobs"]);
    assert_eq!(lp.tokens.len(), values.len());
    assert_eq!(r.usage.unwrap().completion_tokens, values.len() as u32);

    let mut stream = client.completions().create_stream(req).await.unwrap();
    let mut streamed = Vec::new();
    while let Some(chunk) = stream.next().await {
        for c in chunk.expect("a chunk").choices {
            if let Some(lp) = c.logprobs {
                streamed.extend(lp.token_logprobs.iter().map(|v| v.unwrap()));
            }
        }
    }
    close(&streamed, &raw["token_logprobs"]);

    let req = CreateChatCompletionRequestArgs::default()
        .model(MODEL)
        .messages(vec![user(prompt)])
        .max_completion_tokens(MAX_TOKENS)
        .temperature(0.0)
        .logprobs(true)
        .build()
        .unwrap();
    let r = client.chat().create(req).await.unwrap();
    let content = r.choices[0].logprobs.clone().unwrap().content.unwrap();
    let values: Vec<f32> = content.iter().map(|t| t.logprob).collect();
    close(&values, &chat_ref["token_logprobs"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn errors_have_openais_shape_and_status() {
    let serve = Serve::start(&["--http-max-body-bytes", "4096"]);
    let client = serve.client();

    // An unknown model, through the client library: 404, code model_not_found.
    let req = CreateCompletionRequestArgs::default()
        .model("no-such-model")
        .prompt("hi")
        .build()
        .unwrap();
    match client.completions().create(req).await {
        Err(OpenAIError::ApiError(e)) => {
            assert_eq!(e.status_code.as_u16(), 404);
            assert_eq!(e.api_error.code.as_deref(), Some("model_not_found"));
            assert_eq!(e.api_error.param.as_deref(), Some("model"));
            assert!(e.api_error.message.contains("no-such-model"));
        }
        other => panic!("expected a 404 API error, got {other:?}"),
    }

    let cases: &[(&str, String, u16, Option<&str>)] = &[
        ("/v1/completions", "{not json".into(), 400, None),
        (
            "/v1/completions",
            format!(r#"{{"model":"{MODEL}"}}"#),
            400,
            None,
        ),
        (
            "/v1/completions",
            format!(r#"{{"model":"{MODEL}","prompt":"hi","max_tokens":100000000}}"#),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            format!(r#"{{"model":"{MODEL}","prompt":"hi","temperature":-1}}"#),
            400,
            None,
        ),
        (
            "/v1/completions",
            format!(r#"{{"model":"{MODEL}","prompt":"hi","logprobs":1}}"#),
            400,
            Some("logprobs"),
        ),
        (
            "/v1/chat/completions",
            format!(
                r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"hi"}}],"logprobs":true,"top_logprobs":2}}"#
            ),
            400,
            Some("top_logprobs"),
        ),
        (
            "/v1/chat/completions",
            format!(r#"{{"model":"{MODEL}","messages":[]}}"#),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            r#"{"model":"x","messages":[{"role":"user","content":"hi"}]}"#.to_string(),
            404,
            Some("model"),
        ),
        (
            "/v1/completions",
            format!(r#"{{"model":"{MODEL}","prompt":"{}"}}"#, "a".repeat(5000)),
            413,
            None,
        ),
        ("/v1/nothing", "{}".into(), 404, None),
    ];
    // A known path with the wrong method.
    let r = reqwest::get(format!("{}/v1/completions", serve.url))
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 405);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
    for (path, body, status, param) in cases {
        let (got, v) = post(&serve.url, path, body.clone()).await;
        let short: String = body.chars().take(60).collect();
        assert_eq!(got, *status, "{path} {short}: {v}");
        let e = &v["error"];
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e["type"].is_string(), "{v}");
        assert!(e.get("code").is_some() && e.get("param").is_some(), "{v}");
        if let Some(p) = param {
            assert_eq!(e["param"], *p, "{path} {short}: {v}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_all_complete_with_correct_outputs() {
    let prompts = ["The quick brown fox", "abc", "Hello there", "1 2 3 4"];
    let want: Vec<String> = prompts
        .iter()
        .map(|p| text_of(&reference(p, &["--no-chat-template"])))
        .collect();
    // Fewer generations at once than requests: the rest wait their turn.
    let serve = Serve::start(&["--max-concurrent", "3"]);
    let client = serve.client();
    let mut tasks = Vec::new();
    for i in 0..8 {
        let client = client.clone();
        let prompt = prompts[i % prompts.len()];
        tasks.push(tokio::spawn(async move {
            if i % 2 == 0 {
                complete(&client, prompt, &[]).await.unwrap().0
            } else {
                complete_streaming(&client, prompt, &[]).await.0
            }
        }));
    }
    for (i, t) in tasks.into_iter().enumerate() {
        assert_eq!(t.await.unwrap(), want[i % prompts.len()], "request {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_target_keeps_no_session_and_its_loss_is_a_503() {
    let target = specsplit_e2e::start_target(&specsplit_e2e::config(MODEL, true)).await;
    let serve = Serve::start(&["--mode", "ar", "--target-addr", &target.url]);
    assert_eq!(serve.get("/ready", &[]).await, (200, "ready\n".into()));
    let client = serve.client();
    let prompt = "The quick brown fox";
    let full = text_of(&reference(prompt, &["--no-chat-template"]));
    let (text, _, _) = complete(&client, prompt, &[]).await.unwrap();
    assert_eq!(text, full);
    // A stop string cancels the generation: its session is ended all the same.
    let stop = stop_in_middle(&full);
    let (text, finish, _) = complete(&client, prompt, &[&stop]).await.unwrap();
    assert_eq!(text, full[..full.find(&stop).unwrap()]);
    assert_eq!(finish, Some(CompletionFinishReason::Stop));
    let (streamed, _) = complete_streaming(&client, prompt, &[&stop]).await;
    assert_eq!(streamed, text);
    assert_eq!(target.sessions.len(), 0, "a session was left on the target");

    // Without its target the server answers 503 in OpenAI's shape (after the orchestrator's
    // reconnect window).
    target.stop().await;
    let body = format!(r#"{{"model":"{MODEL}","prompt":"hi","max_tokens":4}}"#);
    let (status, v) = post(&serve.url, "/v1/completions", body).await;
    assert_eq!(status, 503, "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("target"),
        "{v}"
    );
    // `/ready` answers 503 once its cached ping is renewed; `/health` stays 200.
    let mut ready = serve.get("/ready", &[]).await;
    for _ in 0..60 {
        if ready.0 == 503 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        ready = serve.get("/ready", &[]).await;
    }
    assert_eq!(ready.0, 503, "{ready:?}");
    assert!(ready.1.contains("target"), "{ready:?}");
    assert_eq!(serve.get("/health", &[]).await, (200, "live\n".into()));
}

#[test]
fn serve_takes_the_worker_flags_of_generate_and_refuses_bad_settings() {
    let run = |args: &[&str]| {
        Command::new(env!("CARGO_BIN_EXE_specsplit"))
            .args(args)
            .env("RUST_LOG", "error")
            .output()
            .unwrap()
    };
    let help = run(&["serve", "--help"]);
    let text = String::from_utf8_lossy(&help.stdout);
    for flag in [
        "--http-listen",
        "--http-max-body-bytes",
        "--max-concurrent",
        "--draft-addr",
        "--target-addr",
        "--target-model",
        "--mode",
        "--max-tokens",
        "--api-key-file",
        "--insecure",
    ] {
        assert!(
            text.contains(flag),
            "{flag} missing in serve --help:\n{text}"
        );
    }
    let cases: &[(&[&str], &str)] = &[
        (&["--max-concurrent", "0"], "max_concurrent"),
        (&["--http-listen", "not-an-address"], "not-an-address"),
        (&["--temperature=-1"], "temperature"),
    ];
    for (args, want) in cases {
        let mut all = vec!["serve", "--target-model", MODEL, "--mode", "ar"];
        all.extend_from_slice(args);
        let out = run(&all);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} was accepted");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// The value of the sample `name` whose labels include `labels` (0 when there is none); the
/// sum where several match.
fn sample(scrape: &prometheus_parse::Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    use prometheus_parse::Value;
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .filter(|s| labels.iter().all(|(k, v)| s.labels.get(k) == Some(*v)))
        .map(|s| match s.value {
            Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
            ref other => panic!("{name}: unexpected {other:?}"),
        })
        .sum()
}

/// The count of the histogram `name`.
fn histogram_count(scrape: &prometheus_parse::Scrape, name: &str) -> u64 {
    use prometheus_parse::Value;
    scrape
        .samples
        .iter()
        .filter(|s| s.metric == name)
        .map(|s| match &s.value {
            Value::Histogram(buckets) => buckets.last().map_or(0.0, |b| b.count) as u64,
            other => panic!("{name}: unexpected {other:?}"),
        })
        .sum()
}

async fn scrape(serve: &Serve) -> prometheus_parse::Scrape {
    let (status, body) = serve.get("/metrics", &[]).await;
    assert_eq!(status, 200, "{body}");
    prometheus_parse::Scrape::parse(body.lines().map(|l| Ok(l.to_string())))
        .expect("Prometheus text")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_key_guards_v1_and_not_the_probes() {
    const KEY: &str = "sk-test-0123456789";
    let file = std::env::temp_dir().join(format!("specsplit-api-key-{}", std::process::id()));
    std::fs::write(&file, format!("{KEY}\n")).unwrap();
    let serve = Serve::start(&["--api-key-file", file.to_str().unwrap()]);
    let _ = std::fs::remove_file(&file);

    for headers in [
        &[][..],
        &[("authorization", "Bearer sk-test-0123456780")][..],
        &[("authorization", KEY)][..],
    ] {
        let (status, body) = serve.get("/v1/models", headers).await;
        assert_eq!(status, 401, "{headers:?}: {body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["error"]["code"], "invalid_api_key", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        assert!(v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()));
        assert!(v["error"].get("param").is_some(), "{v}");
    }
    // POSTs are refused before their body is read; unknown /v1 paths too.
    let body = format!(r#"{{"model":"{MODEL}","prompt":"hi","max_tokens":2}}"#);
    assert_eq!(post(&serve.url, "/v1/completions", body).await.0, 401);
    assert_eq!(serve.get("/v1/nothing", &[]).await.0, 401);

    // A wrong key through the client library: its API error, 401 invalid_api_key.
    match serve.client_with_key("wrong").models().list().await {
        Err(OpenAIError::ApiError(e)) => {
            assert_eq!(e.status_code.as_u16(), 401);
            assert_eq!(e.api_error.code.as_deref(), Some("invalid_api_key"));
        }
        other => panic!("expected a 401 API error, got {other:?}"),
    }
    // The right key: the client library's bearer header passes.
    let client = serve.client_with_key(KEY);
    assert_eq!(client.models().list().await.unwrap().data[0].id, MODEL);
    let (text, _, (_, generated)) = complete(&client, "The quick brown fox", &[]).await.unwrap();
    assert!(!text.is_empty() && generated > 0);

    assert_eq!(serve.get("/health", &[]).await, (200, "live\n".into()));
    assert_eq!(serve.get("/ready", &[]).await, (200, "ready\n".into()));
    let m = scrape(&serve).await;
    let unauthorized = [("endpoint", "/v1/models"), ("status", "401")];
    assert_eq!(
        sample(&m, "specsplit_http_requests_total", &unauthorized),
        4.0
    );
    assert_eq!(
        sample(&m, "specsplit_http_request_errors_total", &unauthorized),
        4.0
    );
}

#[test]
fn a_non_loopback_address_without_an_api_key_needs_insecure() {
    let out = Command::new(env!("CARGO_BIN_EXE_specsplit"))
        .args(["serve", "--target-model", MODEL, "--mode", "ar"])
        .args(["--http-listen", "0.0.0.0:0"])
        .env("RUST_LOG", "error")
        .env_remove("SPECSPLIT_ORCHESTRATOR__API_KEY")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "served without a key: {err}");
    assert!(
        err.contains("not loopback") && err.contains("--insecure"),
        "{err}"
    );

    // A key from the environment and one from a file: one too many.
    let out = Command::new(env!("CARGO_BIN_EXE_specsplit"))
        .args(["serve", "--target-model", MODEL, "--mode", "ar"])
        .args([
            "--http-listen",
            "127.0.0.1:0",
            "--api-key-file",
            "/nonexistent",
        ])
        .env("RUST_LOG", "error")
        .env("SPECSPLIT_ORCHESTRATOR__API_KEY", "k")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("api_key and api_key_file are both set"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_key_from_the_environment_is_taken_as_written() {
    // Digits only: the environment layer must not read it as a number.
    let serve = Serve::start_with_env(&[], &[("SPECSPLIT_ORCHESTRATOR__API_KEY", "0012345")]);
    assert_eq!(serve.get("/v1/models", &[]).await.0, 401);
    let (status, _) = serve
        .get("/v1/models", &[("authorization", "Bearer 12345")])
        .await;
    assert_eq!(status, 401);
    let (status, body) = serve
        .get("/v1/models", &[("authorization", "Bearer 0012345")])
        .await;
    assert_eq!(status, 200, "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_agree_with_the_requests_made() {
    let serve = Serve::start(&[]);
    let client = serve.client();
    let before = scrape(&serve).await;
    assert_eq!(sample(&before, "specsplit_num_requests_running", &[]), 0.0);
    assert_eq!(
        sample(&before, "specsplit_generation_tokens_total", &[]),
        0.0
    );

    let (mut prompt_tokens, mut generated) = (0, 0);
    for prompt in ["The quick brown fox", "abc", "Hello there"] {
        let (_, _, (p, g)) = complete(&client, prompt, &[]).await.unwrap();
        prompt_tokens += p;
        generated += g;
    }
    let req = CreateChatCompletionRequestArgs::default()
        .model(MODEL)
        .messages(vec![user("Hello")])
        .max_completion_tokens(MAX_TOKENS)
        .temperature(0.0)
        .build()
        .unwrap();
    let usage = client.chat().create(req).await.unwrap().usage.unwrap();
    prompt_tokens += usage.prompt_tokens;
    generated += usage.completion_tokens;
    let bad = format!(r#"{{"model":"{MODEL}","prompt":"hi","temperature":-1}}"#);
    assert_eq!(post(&serve.url, "/v1/completions", bad).await.0, 400);

    let m = scrape(&serve).await;
    let ok = |endpoint| [("endpoint", endpoint), ("status", "200")];
    assert_eq!(
        sample(&m, "specsplit_http_requests_total", &ok("/v1/completions")),
        3.0
    );
    assert_eq!(
        sample(
            &m,
            "specsplit_http_requests_total",
            &ok("/v1/chat/completions")
        ),
        1.0
    );
    let refused = [("endpoint", "/v1/completions"), ("status", "400")];
    assert_eq!(sample(&m, "specsplit_http_requests_total", &refused), 1.0);
    assert_eq!(
        sample(&m, "specsplit_http_request_errors_total", &refused),
        1.0
    );
    assert_eq!(sample(&m, "specsplit_http_request_errors_total", &[]), 1.0);
    assert_eq!(
        sample(
            &m,
            "specsplit_request_success_total",
            &[("model_name", MODEL)]
        ),
        4.0
    );
    assert_eq!(
        sample(&m, "specsplit_prompt_tokens_total", &[]),
        f64::from(prompt_tokens)
    );
    assert_eq!(
        sample(&m, "specsplit_generation_tokens_total", &[]),
        f64::from(generated)
    );
    assert_eq!(
        histogram_count(&m, "specsplit_time_to_first_token_seconds"),
        4
    );
    assert_eq!(sample(&m, "specsplit_num_requests_running", &[]), 0.0);
    assert_eq!(sample(&m, "specsplit_num_requests_waiting", &[]), 0.0);
    // The speculative counters: draft trees were verified, and what was accepted is counted
    // once per position of the accepted paths.
    let drafts = sample(&m, "specsplit_spec_decode_num_drafts_total", &[]);
    let draft_tokens = sample(&m, "specsplit_spec_decode_num_draft_tokens_total", &[]);
    let accepted = sample(&m, "specsplit_spec_decode_num_accepted_tokens_total", &[]);
    let per_pos = sample(
        &m,
        "specsplit_spec_decode_num_accepted_tokens_per_pos_total",
        &[],
    );
    assert!(drafts >= 1.0, "no draft tree counted");
    assert!(draft_tokens >= drafts && accepted <= draft_tokens);
    assert_eq!(per_pos, accepted);
}
