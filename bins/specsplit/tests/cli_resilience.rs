//! The `specsplit` binary's settings for deadlines and failing drafts: layered like every
//! other setting, checked, and reported in `--json` whatever the stop reason.

use std::process::Command;

use serde_json::Value;

fn specsplit(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_specsplit"))
        .args(args)
        .envs(env.iter().copied())
        .env("RUST_LOG", "error")
        .output()
        .expect("run specsplit")
}

#[test]
fn json_is_printed_at_the_deadline_with_the_resilience_settings() {
    let out = specsplit(
        &[
            "generate",
            "abc",
            "--target-model",
            "random:tiny:7",
            "--draft-model",
            "random:tiny:7",
            "--no-chat-template",
            "--max-tokens",
            "3000",
            "--deadline-ms",
            "100",
            "--draft-timeout-ms",
            "1500",
            "--rpc-timeout-ms",
            "4000",
            "--spec-probe-rounds",
            "0",
            "--json",
        ],
        &[
            ("SPECSPLIT_ORCHESTRATOR__DRAFT_RETRY_ROUNDS", "3"),
            ("SPECSPLIT_ORCHESTRATOR__DRAFT_TIMEOUT_MS", "999"),
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("one JSON object on stdout");
    assert_eq!(v["stop_reason"], "deadline", "{v}");
    let n = v["token_ids"].as_array().unwrap().len();
    assert!(n < 3000);
    assert_eq!(v["stats"]["tokens"].as_u64().unwrap() as usize, n);
    for key in ["draft_failures", "target_only_rounds", "speed_switches"] {
        assert!(v["stats"].get(key).is_some(), "stats lack {key}: {v}");
    }
    // Flags win over the environment, which wins over the defaults.
    let c = &v["config"];
    assert_eq!(c["draft_timeout_ms"], 1500);
    assert_eq!(c["rpc_timeout_ms"], 4000);
    assert_eq!(c["draft_retry_rounds"], 3);
    assert_eq!(c["draft_retry_max_rounds"], 64);
    assert_eq!(c["spec_probe_rounds"], 0);
}

#[test]
fn bad_resilience_settings_are_clear_errors_and_documented_in_help() {
    let cases: &[(&[&str], &str)] = &[
        (
            &["generate", "x", "--draft-timeout-ms", "0"],
            "draft_timeout_ms",
        ),
        (
            &["generate", "x", "--rpc-timeout-ms", "0"],
            "rpc_timeout_ms",
        ),
        (
            &[
                "generate",
                "x",
                "--draft-retry-rounds",
                "8",
                "--draft-retry-max-rounds",
                "4",
            ],
            "draft_retry_max_rounds",
        ),
    ];
    for (args, needle) in cases {
        let out = specsplit(args, &[]);
        assert!(!out.status.success(), "{args:?} should fail");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{args:?}: {err}");
    }
    let out = specsplit(&["generate", "--help"], &[]);
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--rpc-timeout-ms",
        "--draft-timeout-ms",
        "--draft-retry-rounds",
        "--draft-retry-max-rounds",
        "--spec-probe-rounds",
    ] {
        assert!(help.contains(flag), "help lacks {flag}");
    }
}
