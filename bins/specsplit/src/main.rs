//! `specsplit`: generate text with disaggregated speculative decoding.

mod serve;
mod settings;
mod stop;
mod workers;

use std::io::Write;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use specsplit_models::tokenizer::TextTokenizer;
use specsplit_orchestrator::{GenerateConfig, Orchestrator};
use specsplit_workers::cli::{init_logging, shutdown_signal};

use settings::{OrchestratorArgs, Settings};
use stop::StopText;

/// Speculative decoding split across a draft worker and a target worker.
///
/// With no worker addresses, `generate` and `serve` start a draft and a target worker inside
/// this process on loopback with the default models (fetched on first use), so they work alone.
#[derive(Parser)]
#[command(version, about, long_about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a continuation of PROMPT, streaming text to stdout; a stats line goes to stderr.
    Generate(GenerateArgs),
    /// Serve an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models)
    /// until Ctrl-C or SIGTERM.
    Serve(serve::ServeArgs),
}

/// Flags of `generate`.
#[derive(clap::Args)]
struct GenerateArgs {
    /// The prompt ("-" reads it from stdin).
    prompt: String,
    #[command(flatten)]
    orchestrator: OrchestratorArgs,
    /// Stop before this text (repeatable); it is not printed.
    #[arg(long, value_name = "STRING")]
    stop: Vec<String>,
    /// Print one JSON object (text, token_ids, token_logprobs, stats, rounds, config) instead
    /// of streaming.
    #[arg(long)]
    json: bool,
}

/// The generation was interrupted (Ctrl-C or SIGTERM): the process exits with 130.
#[derive(Debug)]
struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted")
    }
}

impl std::error::Error for Interrupted {}

#[tokio::main]
async fn main() -> Result<()> {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Generate(args) => generate(args).await,
        Command::Serve(args) => serve::serve(args).await,
    };
    if let Err(e) = &result {
        if e.downcast_ref::<Interrupted>().is_some() {
            eprintln!("interrupted");
            std::process::exit(130);
        }
    }
    result
}

/// A line for the person at the terminal on stderr: `text`, or `value` as one JSON line when
/// the log format is JSON.
fn notice(log_format: &str, text: &str, value: serde_json::Value) {
    if log_format == "json" {
        eprintln!("{value}");
    } else {
        eprintln!("{text}");
    }
}

/// Writes `text` to stdout; a reader that went away (`| head`) ends the output quietly.
fn out(text: &str) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

async fn generate(mut args: GenerateArgs) -> Result<()> {
    let s = args.orchestrator.settings(&serde_json::json!({}))?;
    init_logging(&s.log_format);
    let prompt_text = if args.prompt == "-" {
        let mut p = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut p)?;
        p
    } else {
        args.prompt.clone()
    };
    if let Some(bad) = args.stop.iter().find(|s| s.is_empty()) {
        bail!("--stop {bad:?}: a stop string must not be empty");
    }
    let mut gen_cfg = s.generate_config();
    gen_cfg.logprobs = args.json;
    tracing::info!(settings = ?s, "configuration");

    let c = workers::connect(&s).await?;
    let result = run(
        &s,
        &gen_cfg,
        &prompt_text,
        &args.stop,
        &c.tokenizer,
        &c.orch,
        args.json,
    )
    .await;
    if let Some(ip) = c.in_process {
        ip.shutdown().await;
    }
    result
}

async fn run(
    s: &Settings,
    gen_cfg: &GenerateConfig,
    prompt_text: &str,
    stops: &[String],
    tokenizer: &TextTokenizer,
    orch: &Orchestrator,
    json: bool,
) -> Result<()> {
    let text_in = if s.chat_template {
        tokenizer.apply_chat_template(prompt_text)
    } else {
        prompt_text.to_string()
    };
    let prompt = tokenizer
        .encode(&text_in, !s.chat_template)
        .context("tokenizing the prompt")?;
    let mut decoder = tokenizer.stream_decoder(true);
    let mut stop = StopText::new(stops);
    let mut ends_with_newline = true;
    let mut stdout = std::io::stdout();
    let mut print = |text: &str| {
        if !json && !text.is_empty() {
            ends_with_newline = text.ends_with('\n');
            let _ = stdout.write_all(text.as_bytes());
            let _ = stdout.flush();
        }
    };
    let on_tokens = |toks: &[u32]| {
        if let Ok(piece) = decoder.push(tokenizer, toks) {
            print(&stop.push(&piece));
        }
        !stop.stopped()
    };
    let gen = tokio::select! {
        r = orch.generate_until(&prompt, gen_cfg, on_tokens) => r?,
        _ = shutdown_signal() => return Err(Interrupted.into()),
    };
    if !stop.stopped() {
        let rest = decoder.finish(tokenizer).unwrap_or_default();
        let mut tail = stop.push(&rest);
        tail.push_str(&stop.finish());
        print(&tail);
    }
    let text = if stop.stopped() {
        stop.emitted().to_string()
    } else {
        tokenizer.decode(&gen.token_ids, true).unwrap_or_default()
    };
    if json {
        let obj = serde_json::json!({
            "text": text,
            "token_ids": gen.token_ids,
            "token_logprobs": gen.token_logprobs,
            "prompt_token_ids": prompt,
            "stop_reason": gen.stop_reason,
            "stats": gen.stats,
            "rounds": gen.rounds,
            "config": s,
        });
        out(&format!("{}\n", serde_json::to_string(&obj)?))?;
    } else {
        if !ends_with_newline {
            out("\n")?;
        }
        let st = &gen.stats;
        let stop = serde_json::to_value(gen.stop_reason)
            .ok()
            .and_then(|v| v.as_str().map(str::to_string))
            .unwrap_or_default();
        notice(
            &s.log_format,
            &format!(
                "[stats] tokens={} tok/s={:.2} ttft={:.1}ms tpot={:.1}ms acceptance={:.1}% mean_accepted_len={:.2} rounds={} overlap_hit_rate={:.1}% draft_failures={} target_only_rounds={} speed_switches={} drafters={} stop={stop}",
                st.tokens,
                st.tokens_per_s,
                st.ttft_ms,
                st.tpot_ms,
                st.acceptance_rate * 100.0,
                st.mean_accepted_len,
                st.rounds,
                st.overlap_hit_rate * 100.0,
                st.draft_failures,
                st.target_only_rounds,
                st.speed_switches.len(),
                drafter_summary(&st.per_drafter),
            ),
            serde_json::json!({"event": "stats", "stats": st, "stop_reason": stop}),
        );
        if let Some(slow) = st.speed_switches.iter().find(|w| !w.speculate) {
            notice(
                &s.log_format,
                &format!(
                    "note: speculative rounds ran at {:.1} tok/s against {:.1} tok/s for the \
                     target alone, so {} rounds ran target-only. With both models on the same \
                     CPU or GPU they take turns; --mode ar runs the target alone, and a draft \
                     worker on its own device (--draft-addr) can pay.",
                    slow.spec_tokens_per_s, slow.target_only_tokens_per_s, st.target_only_rounds
                ),
                serde_json::json!({"event": "speculation_slower", "switch": slow}),
            );
        }
    }
    Ok(())
}

/// Rounds, tokens and tokens per second of each drafter, e.g.
/// `ngram:12r/40t/85.3tok/s,none:3r/3t/20.1tok/s`.
fn drafter_summary(per: &[specsplit_orchestrator::DrafterStats]) -> String {
    per.iter()
        .map(|d| {
            format!(
                "{}:{}r/{}t/{:.1}tok/s",
                d.drafter.name(),
                d.rounds,
                d.tokens,
                d.tokens_per_s
            )
        })
        .collect::<Vec<_>>()
        .join(",")
}
