//! `coverage`: how often the target's token lies among the draft's best alternatives.
//!
//! For each prompt the target's greedy continuation is generated (target alone), then the draft
//! is teacher-forced over prompt + continuation in one causal pass, and at every generated
//! position the rank of the target's token in the draft's logits is taken (0 = the draft's
//! argmax, ties broken by the lower token id as [`specsplit_core::sampling::argmax`] does).
//! From the ranks: `top1` = P(r = 0), the greedy per-token acceptance β of the pair, and for
//! `a = 1..=max_alternatives` the conditional coverage P(1 ≤ r ≤ a | r ≠ 0) (the target's
//! token among the draft's next `a` choices when its first choice was wrong) and the
//! unconditional P(r ≤ a).

use std::path::PathBuf;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use serde_json::{json, Value};
use specsplit_core::sampling::argmax;
use specsplit_models::loader::{load_model, LoadOptions, LoadedModel};
use specsplit_models::transformer::Transformer;
use specsplit_workers::launch::{parse_device, parse_dtype};

/// Settings of the `coverage` subcommand.
#[derive(clap::Args, Debug, Clone)]
pub struct CoverageArgs {
    /// Target model spec (an alias, a directory or a .gguf file).
    #[arg(long, default_value = "qwen-coder-1.5b")]
    pub target: String,
    /// Draft model spec (same vocabulary as the target).
    #[arg(long, default_value = "qwen-coder-0.5b")]
    pub draft: String,
    /// Device of both models: cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// Dtype of both models: f32, f16 or bf16 (default: f32 on CPU, bf16 on CUDA).
    #[arg(long, default_value = "")]
    pub dtype: String,
    /// Number of prompts (cycling through the prompt set).
    #[arg(long, default_value_t = 8)]
    pub num_prompts: usize,
    /// New tokens of the target's greedy continuation of each prompt (fewer at EOS).
    #[arg(long, default_value_t = 64)]
    pub max_tokens: usize,
    /// Text prompts, one per line (default: the built-in prompts of `e2e`).
    #[arg(long)]
    pub prompts_file: Option<PathBuf>,
    /// Largest number `a` of the draft's alternatives after its first choice that is reported.
    #[arg(long, default_value_t = 8)]
    pub max_alternatives: usize,
    /// Output directory.
    #[arg(long, default_value = "bench-out")]
    pub out: PathBuf,
    /// Base name of the output files.
    #[arg(long, default_value = "coverage")]
    pub name: String,
}

/// The ordering key of a logit: NaN ranks lowest, as in the greedy argmax.
fn key(x: f32) -> f32 {
    if x.is_nan() {
        f32::NEG_INFINITY
    } else {
        x
    }
}

/// Rank of `token` in `logits` (0 = the argmax): the number of ids whose logit is larger, or
/// equal with a lower id. `None` if `token` is outside the vocabulary.
pub fn rank_of(logits: &[f32], token: u32) -> Option<usize> {
    let t = token as usize;
    let v = key(*logits.get(t)?);
    Some(
        logits
            .iter()
            .enumerate()
            .filter(|&(j, &x)| {
                let k = key(x);
                k > v || (k == v && j < t)
            })
            .count(),
    )
}

/// The statistics of a set of ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct Coverage {
    /// Positions counted.
    pub n: usize,
    /// P(r = 0): the draft's first choice is the target's token.
    pub top1: f64,
    /// `conditional[a - 1]` = P(1 ≤ r ≤ a | r ≠ 0), `a = 1..=max_alternatives`; `None` when
    /// the draft's first choice was never wrong.
    pub conditional: Vec<Option<f64>>,
    /// `unconditional[a - 1]` = P(r ≤ a) = P(r < a + 1), `a = 1..=max_alternatives`.
    pub unconditional: Vec<f64>,
    /// `rank_counts[r]` = positions of rank `r` for `r = 0..=max_alternatives`; the last entry
    /// counts every rank above `max_alternatives`.
    pub rank_counts: Vec<usize>,
}

/// Aggregates `ranks` into [`Coverage`] for `a = 1..=max_alternatives`; `None` for no ranks.
pub fn aggregate(ranks: &[usize], max_alternatives: usize) -> Option<Coverage> {
    let n = ranks.len();
    if n == 0 {
        return None;
    }
    let mut rank_counts = vec![0usize; max_alternatives + 2];
    for &r in ranks {
        rank_counts[r.min(max_alternatives + 1)] += 1;
    }
    let wrong = n - rank_counts[0];
    let mut conditional = Vec::with_capacity(max_alternatives);
    let mut unconditional = Vec::with_capacity(max_alternatives);
    let mut within = 0usize;
    for a in 1..=max_alternatives {
        within += rank_counts[a];
        conditional.push((wrong > 0).then(|| within as f64 / wrong as f64));
        unconditional.push((rank_counts[0] + within) as f64 / n as f64);
    }
    Some(Coverage {
        n,
        top1: rank_counts[0] as f64 / n as f64,
        conditional,
        unconditional,
        rank_counts,
    })
}

/// A u32 vector on the model's device.
fn ids(m: &Transformer, v: &[u32]) -> Result<Tensor> {
    Ok(Tensor::new(v, m.device())?)
}

/// The target's greedy continuation of `prompt`: up to `max_tokens` tokens, ending at the
/// first EOS (kept).
fn greedy_continuation(
    target: &Transformer,
    prompt: &[u32],
    max_tokens: usize,
    eos: &[u32],
) -> Result<Vec<u32>> {
    if prompt.is_empty() {
        bail!("empty prompt");
    }
    let mut cache = target.new_cache(prompt.len() + max_tokens)?;
    let positions: Vec<u32> = (0..prompt.len() as u32).collect();
    let mut logits = target.forward(
        &ids(target, prompt)?,
        &ids(target, &positions)?,
        None,
        &mut cache,
        &ids(target, &[prompt.len() as u32 - 1])?,
    )?;
    let mut out = Vec::with_capacity(max_tokens);
    while out.len() < max_tokens {
        let row: Vec<f32> = logits.squeeze(0)?.to_vec1()?;
        let next = argmax(&row);
        out.push(next);
        if eos.contains(&next) || out.len() == max_tokens {
            break;
        }
        let pos = cache.len() as u32;
        logits = target.forward(
            &ids(target, &[next])?,
            &ids(target, &[pos])?,
            None,
            &mut cache,
            &ids(target, &[0])?,
        )?;
    }
    Ok(out)
}

/// Ranks of each `continuation` token in the draft's logits, teacher-forced over `prompt` +
/// `continuation` in one causal pass.
fn draft_ranks(draft: &Transformer, prompt: &[u32], continuation: &[u32]) -> Result<Vec<usize>> {
    if prompt.is_empty() || continuation.is_empty() {
        return Ok(Vec::new());
    }
    // The last continuation token predicts nothing that is scored.
    let fed: Vec<u32> = prompt
        .iter()
        .chain(&continuation[..continuation.len() - 1])
        .copied()
        .collect();
    let positions: Vec<u32> = (0..fed.len() as u32).collect();
    let first = prompt.len() as u32 - 1;
    let rows: Vec<u32> = (first..first + continuation.len() as u32).collect();
    let mut cache = draft.new_cache(fed.len())?;
    let logits: Vec<Vec<f32>> = draft
        .forward(
            &ids(draft, &fed)?,
            &ids(draft, &positions)?,
            None,
            &mut cache,
            &ids(draft, &rows)?,
        )?
        .to_vec2()?;
    logits
        .iter()
        .zip(continuation)
        .map(|(row, &y)| {
            rank_of(row, y).with_context(|| {
                format!("token {y} outside the draft's vocabulary of {}", row.len())
            })
        })
        .collect()
}

/// JSON of [`Coverage`], keyed by `a`.
fn coverage_json(c: &Coverage) -> Value {
    let by_a = |v: Vec<Value>| -> Value {
        v.into_iter()
            .enumerate()
            .map(|(i, x)| ((i + 1).to_string(), x))
            .collect::<serde_json::Map<_, _>>()
            .into()
    };
    json!({
        "n": c.n,
        "top1": c.top1,
        "coverage": by_a(c.conditional.iter().map(|x| json!(x)).collect()),
        "top_a_plus_1": by_a(c.unconditional.iter().map(|x| json!(x)).collect()),
        "rank_counts": c.rank_counts,
    })
}

/// UTC date and time of `secs` since the Unix epoch, ISO 8601.
fn iso_utc(secs: u64) -> String {
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

fn load(spec: &str, a: &CoverageArgs) -> Result<LoadedModel> {
    let opts = LoadOptions {
        device: parse_device(&a.device)?,
        dtype: parse_dtype(&a.dtype)?,
    };
    load_model(spec, &opts).with_context(|| format!("loading {spec}"))
}

/// Runs the measurement, prints a table and writes `<out>/<name>.json`.
pub fn main(a: CoverageArgs) -> Result<()> {
    if a.num_prompts == 0 || a.max_tokens == 0 {
        bail!("--num-prompts and --max-tokens must be positive");
    }
    let started = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
    eprintln!("loading target {} and draft {} ...", a.target, a.draft);
    let target = load(&a.target, &a)?;
    let draft = load(&a.draft, &a)?;
    let (tv, dv) = (
        target.model.config().vocab_size,
        draft.model.config().vocab_size,
    );
    if tv != dv {
        bail!("the target's vocabulary ({tv}) and the draft's ({dv}) differ");
    }
    let prompts = crate::e2e::text_prompts(a.prompts_file.as_deref(), a.num_prompts, &target)?;
    let eos = target.tokenizer.eos_token_ids().to_vec();

    let mut all_ranks = Vec::new();
    let mut per_prompt = Vec::new();
    for (i, prompt) in prompts.iter().enumerate() {
        let t0 = Instant::now();
        let continuation = greedy_continuation(&target.model, prompt, a.max_tokens, &eos)
            .with_context(|| format!("target continuation of prompt {i}"))?;
        let gen_s = t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        let ranks = draft_ranks(&draft.model, prompt, &continuation)
            .with_context(|| format!("draft ranks of prompt {i}"))?;
        let draft_s = t1.elapsed().as_secs_f64();
        let c = aggregate(&ranks, a.max_alternatives).context("no generated positions")?;
        eprintln!(
            "prompt {i}: {} prompt tokens, {} generated, top1 {:.3} (target {gen_s:.1} s, \
             draft {draft_s:.1} s)",
            prompt.len(),
            continuation.len(),
            c.top1
        );
        per_prompt.push(json!({
            "prompt": i,
            "prompt_tokens": prompt.len(),
            "generated": continuation.len(),
            "ended_at_eos": continuation.last().is_some_and(|t| eos.contains(t)),
            "top1": c.top1,
            "ranks": ranks,
            "continuation": target.tokenizer.decode(&continuation, false).unwrap_or_default(),
        }));
        all_ranks.extend(ranks);
    }
    let total = aggregate(&all_ranks, a.max_alternatives).context("no generated positions")?;

    println!(
        "{} positions over {} prompts: top1 (greedy acceptance) = {:.4}",
        total.n,
        prompts.len(),
        total.top1
    );
    println!("{:>3}  {:>24}  {:>12}", "a", "P(1<=r<=a | r!=0)", "P(r<=a)");
    for (i, (c, u)) in total
        .conditional
        .iter()
        .zip(&total.unconditional)
        .enumerate()
    {
        let c = c.map_or_else(|| "-".to_string(), |x| format!("{x:.4}"));
        println!("{:>3}  {c:>24}  {u:>12.4}", i + 1);
    }
    let top1s: Vec<f64> = per_prompt
        .iter()
        .filter_map(|p| p["top1"].as_f64())
        .collect();
    println!(
        "per-prompt top1: {}",
        top1s
            .iter()
            .map(|x| format!("{x:.3}"))
            .collect::<Vec<_>>()
            .join(" ")
    );

    let doc = json!({
        "meta": {
            "kind": "coverage",
            "target": target.name, "target_spec": a.target,
            "draft": draft.name, "draft_spec": a.draft,
            "device": a.device,
            "dtype": if a.dtype.is_empty() { "default" } else { a.dtype.as_str() },
            "date": iso_utc(started),
            "command_line": std::env::args().collect::<Vec<_>>(),
            "num_prompts": prompts.len(),
            "max_tokens": a.max_tokens,
            "max_alternatives": a.max_alternatives,
            "prompts_file": a.prompts_file.as_ref().map(|p| p.display().to_string()),
            "greedy": true,
            "rank_ties": "lower token id first",
        },
        "total": coverage_json(&total),
        "per_prompt": per_prompt,
    });
    std::fs::create_dir_all(&a.out).with_context(|| format!("creating {}", a.out.display()))?;
    let path = a.out.join(format!("{}.json", a.name));
    std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    eprintln!("wrote {}", path.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_count_larger_logits_and_equal_ones_of_lower_id() {
        // Ids 1 and 3 tie at the top: 1 is the argmax (rank 0), 3 comes second.
        let logits = [0.5, 2.0, -1.0, 2.0, 1.0, f32::NAN];
        assert_eq!(argmax(&logits), 1);
        assert_eq!(rank_of(&logits, 1), Some(0));
        assert_eq!(rank_of(&logits, 3), Some(1));
        assert_eq!(rank_of(&logits, 4), Some(2));
        assert_eq!(rank_of(&logits, 0), Some(3));
        assert_eq!(rank_of(&logits, 2), Some(4));
        // NaN ranks below every number.
        assert_eq!(rank_of(&logits, 5), Some(5));
        assert_eq!(rank_of(&logits, 6), None);
        // Every id gets a distinct rank.
        let mut all: Vec<usize> = (0..6).filter_map(|t| rank_of(&logits, t)).collect();
        all.sort_unstable();
        assert_eq!(all, vec![0, 1, 2, 3, 4, 5]);
    }

    #[test]
    fn coverage_is_conditional_on_a_wrong_first_choice() {
        // 10 positions: 6 at rank 0, wrong ones at ranks 1, 1, 2, 5.
        let ranks = [0, 1, 0, 0, 2, 0, 1, 5, 0, 0];
        let c = aggregate(&ranks, 3).unwrap();
        assert_eq!(c.n, 10);
        assert_eq!(c.top1, 0.6);
        // a = 1: 2 of 4 wrong; a = 2: 3 of 4; a = 3: still 3 of 4 (rank 5 is beyond).
        assert_eq!(c.conditional, vec![Some(0.5), Some(0.75), Some(0.75)]);
        assert_eq!(c.unconditional, vec![0.8, 0.9, 0.9]);
        assert_eq!(c.rank_counts, vec![6, 2, 1, 0, 1]);
        // P(r <= a) = top1 + (1 - top1) * coverage[a].
        for (u, cond) in c.unconditional.iter().zip(&c.conditional) {
            let expect = c.top1 + (1.0 - c.top1) * cond.unwrap();
            assert!((u - expect).abs() < 1e-12);
        }
    }

    #[test]
    fn coverage_is_undefined_without_a_wrong_first_choice() {
        let c = aggregate(&[0, 0, 0], 2).unwrap();
        assert_eq!(c.top1, 1.0);
        assert_eq!(c.conditional, vec![None, None]);
        assert_eq!(c.unconditional, vec![1.0, 1.0]);
        assert!(aggregate(&[], 2).is_none());
    }

    #[test]
    fn iso_dates_follow_the_civil_calendar() {
        assert_eq!(iso_utc(0), "1970-01-01T00:00:00Z");
        // 2000-02-29 12:34:56 UTC (a leap day).
        assert_eq!(iso_utc(951_827_696), "2000-02-29T12:34:56Z");
    }
}
