//! The `specsplit` binary: in-process workers, `--json`, `--mode ar` as the reference,
//! streaming text, and clear errors for bad input.

use std::process::Command;

use serde_json::Value;

fn specsplit(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_specsplit"))
        .args(args)
        .env("RUST_LOG", "error")
        .output()
        .expect("run specsplit")
}

fn generate_json(extra: &[&str]) -> Value {
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
    let out = specsplit(&args);
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
