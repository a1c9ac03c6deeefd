//! The `specsplit` binary: in-process workers, `--json`, `--mode ar` as the reference,
//! streaming text, and clear errors for bad input.

use std::process::Command;

use serde_json::Value;

fn specsplit(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_specsplit"))
        .args(args)
        .env("RUST_LOG", "error")
        // These tests are about the draft model's rounds unless they name another drafter
        // (a flag overrides the environment); the default is tested on its own.
        .env("SPECSPLIT_ORCHESTRATOR__DRAFTER", "model")
        .output()
        .expect("run specsplit")
}

/// `specsplit` with `args`, running, its stdout and stderr piped.
fn spawn_streaming(args: &[&str]) -> std::process::Child {
    use std::process::Stdio;
    Command::new(env!("CARGO_BIN_EXE_specsplit"))
        .args(args)
        .env("SPECSPLIT_ORCHESTRATOR__DRAFTER", "model")
        .env("RUST_LOG", "error")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run specsplit")
}

/// `generate --json` on tiny random models with `extra` flags.
fn generate_args<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "generate",
        "Hello, speculative world!",
        "--target-model",
        "random:tiny:7",
        "--draft-model",
        "random:tiny:7",
        "--no-chat-template",
        "--max-tokens",
        "20",
        "--json",
    ];
    args.extend_from_slice(extra);
    args
}

fn generate_json(extra: &[&str]) -> Value {
    let out = specsplit(&generate_args(extra));
    assert!(
        out.status.success(),
        "specsplit failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("one JSON object on stdout")
}

#[test]
fn json_output_has_the_documented_fields_and_matches_target_only() {
    let spec = generate_json(&[
        "--widths",
        "3,2,1",
        "--first-round-overlap",
        "false",
        "--client-spin",
        "never",
    ]);
    let ar = generate_json(&["--mode", "ar"]);
    for key in [
        "text",
        "token_ids",
        "stats",
        "rounds",
        "config",
        "stop_reason",
    ] {
        assert!(spec.get(key).is_some(), "missing {key}: {spec}");
    }
    assert_eq!(spec["token_ids"], ar["token_ids"]);
    // The target's log-probability of each token, the same through a tree as token by token.
    let logprobs = |v: &Value| -> Vec<f64> {
        let lp = v["token_logprobs"].as_array().expect("token_logprobs");
        lp.iter().map(|x| x.as_f64().unwrap()).collect()
    };
    let (spec_lp, ar_lp) = (logprobs(&spec), logprobs(&ar));
    assert_eq!(spec_lp.len(), spec["token_ids"].as_array().unwrap().len());
    assert_eq!(spec_lp.len(), ar_lp.len());
    for (s, a) in spec_lp.iter().zip(&ar_lp) {
        assert!(
            *a <= 0.0 && (s - a).abs() < 1e-4,
            "{spec_lp:?} against {ar_lp:?}"
        );
    }
    let n = spec["token_ids"].as_array().unwrap().len();
    assert!(n > 0 && n <= 20);
    assert_eq!(spec["stats"]["tokens"].as_u64().unwrap() as usize, n);
    assert_eq!(spec["config"]["widths"], serde_json::json!([3, 2, 1]));
    assert_eq!(ar["config"]["mode"], "ar");
    assert_eq!(spec["config"]["first_round_overlap"], false);
    assert_eq!(spec["config"]["client_spin"], "never");
    assert_eq!(ar["config"]["client_spin"], "auto");
    let rounds = spec["rounds"].as_array().unwrap();
    assert_eq!(
        rounds[0]["drafted"], 3,
        "without the first-round overlap the first round verifies a tree"
    );
    let emitted: usize = rounds
        .iter()
        .map(|r| r["emitted"].as_array().unwrap().len())
        .sum();
    assert_eq!(emitted, n);
}

#[test]
fn streaming_prints_the_text_and_a_stats_line() {
    let out = specsplit(&[
        "generate",
        "abc",
        "--target-model",
        "random:tiny:7",
        "--draft-model",
        "random:tiny:7",
        "--no-chat-template",
        "--max-tokens",
        "12",
        "--pipeline",
        "sequential",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    let stats = stderr
        .lines()
        .find(|l| l.starts_with("[stats]"))
        .expect("stats line");
    for key in [
        "tokens=",
        "tok/s=",
        "ttft=",
        "tpot=",
        "acceptance=",
        "mean_accepted_len=",
        "rounds=",
        "overlap_hit_rate=",
    ] {
        assert!(stats.contains(key), "{key} missing in {stats}");
    }
    assert!(!out.stdout.is_empty());
}

#[test]
fn bad_input_is_a_clear_error() {
    let cases: &[(&[&str], &str)] = &[
        (&["generate", "x", "--widths", "2,0"], "widths"),
        (&["generate", "x", "--temperature=-1"], "temperature"),
        (&["generate", "x", "--top-p", "1.5"], "top_p"),
        (&["generate", "x", "--max-tokens", "0"], "max_tokens"),
        (
            &["generate", "x", "--client-spin", "sometimes"],
            "auto, always or never",
        ),
        (
            &[
                "generate",
                "x",
                "--target-addr",
                "http://127.0.0.1:1",
                "--mode",
                "ar",
                "--tokenizer",
                "random:tiny",
            ],
            "unreachable",
        ),
        (
            &["generate", "x", "--target-model", "no-such-model"],
            "no-such-model",
        ),
        (&["generate", "x", "--log-format", "yaml"], "\"yaml\""),
        (
            &[
                "generate",
                "x",
                "--target-addr",
                "ftp://127.0.0.1:1",
                "--mode",
                "ar",
                "--tokenizer",
                "random:tiny",
            ],
            "scheme `ftp`",
        ),
        (
            &[
                "generate",
                "x",
                "--target-addr",
                "http://127.0.0.1:1",
                "--mode",
                "ar",
                "--tokenizer",
                "random:tiny",
            ],
            "Connection refused",
        ),
        (&["generate", "x", "--candidates", "9"], "candidates"),
    ];
    for (args, needle) in cases {
        let out = specsplit(args);
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(needle),
            "{args:?}: stderr lacks {needle:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    }
}

#[test]
fn help_explains_the_flags() {
    let out = specsplit(&["generate", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--draft-addr",
        "--target-addr",
        "--max-tokens",
        "--widths",
        "--depth",
        "--temperature",
        "--top-k",
        "--top-p",
        "--seed",
        "--no-chat-template",
        "--mode",
        "--pipeline",
        "--first-round-overlap",
        "--client-spin",
        "--json",
    ] {
        assert!(help.contains(flag), "help lacks {flag}");
    }
}

#[test]
fn a_misspelt_config_section_is_an_error() {
    let dir = std::env::temp_dir().join(format!("specsplit-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("typo.toml");
    std::fs::write(&file, "[orchestrater]\nmax_tokens = 3\n").unwrap();
    let out = specsplit(&["generate", "x", "--config", file.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown section `orchestrater`"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_closed_stdout_ends_the_output_quietly() {
    use std::io::Read;
    let mut child = spawn_streaming(&[
        "generate",
        "Hello",
        "--target-model",
        "random:tiny:7",
        "--draft-model",
        "random:tiny:7",
        "--no-chat-template",
        "--max-tokens",
        "40",
    ]);
    // Read one byte, then close the pipe, as `| head -c 1` does.
    let mut stdout = child.stdout.take().unwrap();
    let mut one = [0u8; 1];
    let _ = stdout.read(&mut one);
    drop(stdout);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    assert!(out.status.success(), "{:?}: {err}", out.status);
}

#[cfg(unix)]
#[test]
fn an_interrupt_exits_130() {
    use std::io::Read;
    // This seed's generation runs to max-tokens: long enough to be interrupted.
    let mut child = spawn_streaming(&[
        "generate",
        "Hello",
        "--target-model",
        "random:tiny:2",
        "--mode",
        "ar",
        "--no-chat-template",
        "--max-tokens",
        "100000",
    ]);
    // Once text streams out the generation runs; then SIGINT, as Ctrl-C sends.
    let mut stdout = child.stdout.take().unwrap();
    let mut one = [0u8; 1];
    assert_eq!(stdout.read(&mut one).unwrap(), 1, "no output");
    let status = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let mut rest = Vec::new();
    let _ = stdout.read_to_end(&mut rest);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("interrupted"), "{err}");
}

#[test]
fn the_predraft_pipeline_matches_target_only() {
    let spec = generate_json(&["--pipeline", "predraft", "--candidates", "2"]);
    let ar = generate_json(&["--mode", "ar"]);
    assert_eq!(spec["token_ids"], ar["token_ids"]);
    let rounds = spec["rounds"].as_array().unwrap();
    assert!(
        rounds.iter().any(|r| r["predraft_candidates"] == 2),
        "no round pre-drafted: {rounds:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tokenizer_beyond_the_targets_vocabulary_is_refused() {
    let out =
        against_a_remote_target(&["generate", "x", "--tokenizer", "random:qwen2.5-0.5b"]).await;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("set --tokenizer to the target's model"),
        "{err}"
    );
}

#[test]
fn json_logs_make_every_stderr_line_json() {
    let out = specsplit(&[
        "generate",
        "Hello",
        "--target-model",
        "random:tiny:7",
        "--draft-model",
        "random:tiny:7",
        "--no-chat-template",
        "--max-tokens",
        "8",
        "--log-format",
        "json",
    ]);
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    let events: Vec<Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l:?}: {e}")))
        .collect();
    assert!(events.iter().any(|e| e["event"] == "loading"));
    let stats = events
        .iter()
        .find(|e| e["event"] == "stats")
        .expect("stats");
    assert!(stats["stats"]["tokens"].as_u64().unwrap() > 0);
}

#[test]
fn slow_speculation_is_reported() {
    // A draft that never agrees with the target: speculation is measured slower and paused.
    let out = specsplit(&[
        "generate",
        "hi",
        "--target-model",
        "random:tiny:2",
        "--draft-model",
        "random:tiny:8",
        "--no-chat-template",
        "--max-tokens",
        "300",
        "--depth",
        "8",
    ]);
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("note: speculative rounds ran at"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_workers_lend_the_tokenizer_of_the_model_they_serve() {
    // No --tokenizer: the target serves random:tiny:7, whose tokenizer is known here.
    let out = against_a_remote_target(&[
        "generate",
        "Hello, speculative world!",
        "--no-chat-template",
        "--max-tokens",
        "20",
        "--json",
    ])
    .await;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let remote: Value = serde_json::from_slice(&out.stdout).unwrap();
    let local = generate_json(&["--mode", "ar"]);
    assert_eq!(remote["token_ids"], local["token_ids"]);
    assert_eq!(remote["prompt_token_ids"], local["prompt_token_ids"]);
}

/// `specsplit` with `args`, target-only, against a target worker serving random:tiny:7
/// started for the call.
async fn against_a_remote_target(args: &[&str]) -> std::process::Output {
    let target = specsplit_e2e::start_target(&specsplit_e2e::config("random:tiny:7", true)).await;
    let mut args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    args.extend([
        "--mode".into(),
        "ar".into(),
        "--target-addr".into(),
        target.url.clone(),
    ]);
    let out = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        specsplit(&args)
    })
    .await
    .unwrap();
    target.stop().await;
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_workers_over_tls_with_a_token() {
    let pki = specsplit_e2e::pki::Pki::new();
    let cfg = specsplit_workers::config::WorkerConfig {
        tls_cert: Some(pki.path("server.pem")),
        tls_key: Some(pki.path("server-key.pem")),
        auth_token_file: Some(pki.path("token")),
        ..specsplit_e2e::config("random:tiny:7", true)
    };
    let target = specsplit_e2e::start_secured_target(&cfg).await;
    let wrong_token = pki.path("wrong-token");
    std::fs::write(&wrong_token, "not-the-token\n").unwrap();
    let run = |token: std::path::PathBuf, ca: &str| {
        let args: Vec<String> = [
            "generate",
            "Hello, speculative world!",
            "--no-chat-template",
            "--max-tokens",
            "20",
            "--json",
            "--mode",
            "ar",
            "--target-addr",
            &format!("localhost:{}", target.addr.port()),
            "--tls-ca",
            pki.path(ca).to_str().unwrap(),
            "--auth-token-file",
            token.to_str().unwrap(),
        ]
        .iter()
        .map(|a| a.to_string())
        .collect();
        tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            specsplit(&args)
        })
    };
    let out = run(pki.path("token"), "good-ca.pem").await.unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let remote: Value = serde_json::from_slice(&out.stdout).unwrap();
    let local = generate_json(&["--mode", "ar"]);
    assert_eq!(remote["token_ids"], local["token_ids"]);

    let out = run(wrong_token, "good-ca.pem").await.unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("the bearer token does not match"), "{err}");
    let out = run(pki.path("token"), "rogue-ca.pem").await.unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("UnknownIssuer"), "{err}");
    target.stop().await;
}

#[test]
fn model_free_drafters_need_no_draft_model_and_report_each_rounds_drafter() {
    let ar = generate_json(&["--mode", "ar"]);
    // No draft worker is started for ngram: a draft model that does not exist is never loaded.
    let out = specsplit(&[
        "generate",
        "Hello, speculative world!",
        "--target-model",
        "random:tiny:7",
        "--draft-model",
        "no-such-model",
        "--no-chat-template",
        "--max-tokens",
        "20",
        "--json",
        "--drafter",
        "ngram",
    ]);
    assert!(
        out.status.success(),
        "specsplit failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ngram: Value = serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    assert_eq!(ngram["token_ids"], ar["token_ids"]);
    assert_eq!(ngram["config"]["drafter"], "ngram");
    for r in ngram["rounds"].as_array().unwrap() {
        assert_eq!(r["drafter"], "ngram", "{r}");
    }
    let per = ngram["stats"]["per_drafter"].as_array().unwrap();
    assert_eq!(per.len(), 1);
    assert_eq!(per[0]["drafter"], "ngram");
    let auto = generate_json(&["--drafter", "auto", "--widths", "2,1"]);
    assert_eq!(auto["token_ids"], ar["token_ids"]);
    for r in auto["rounds"].as_array().unwrap() {
        let d = r["drafter"].as_str().unwrap();
        assert!(["model", "ngram", "suffix", "none"].contains(&d), "{r}");
    }
}

#[test]
fn the_online_choice_is_the_default_drafter_and_matches_target_only() {
    let run = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_specsplit"))
            .args(generate_args(extra))
            .env("RUST_LOG", "error")
            .env_remove("SPECSPLIT_ORCHESTRATOR__DRAFTER")
            .output()
            .expect("run specsplit");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<Value>(&out.stdout).expect("json")
    };
    let auto = run(&[]);
    assert_eq!(auto["config"]["drafter"], "auto");
    let ar = run(&["--mode", "ar"]);
    assert_eq!(auto["token_ids"], ar["token_ids"]);
}
