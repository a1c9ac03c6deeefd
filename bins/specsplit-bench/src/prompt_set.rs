//! Prompt sets of several kinds of work (`e2e --prompt-set`): a text file where each prompt
//! starts with a line `## <kind>` and runs to the next such line; lines starting with `# `
//! before the first prompt are comments. `prompts/drafters.md` holds code editing that repeats
//! the prompt, free-form questions and summaries of a given text.

use std::path::Path;

use anyhow::{bail, Context, Result};

/// One prompt and its kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KindedPrompt {
    /// The kind of work, e.g. `code-edit`.
    pub kind: String,
    /// The prompt text (surrounding blank lines removed).
    pub text: String,
}

/// Parses a prompt set.
pub fn parse(text: &str) -> Result<Vec<KindedPrompt>> {
    let mut out: Vec<KindedPrompt> = Vec::new();
    for line in text.lines() {
        if let Some(kind) = line.strip_prefix("## ") {
            let kind = kind.trim();
            if kind.is_empty() {
                bail!("a `## ` line names no kind");
            }
            out.push(KindedPrompt {
                kind: kind.to_string(),
                text: String::new(),
            });
        } else if let Some(p) = out.last_mut() {
            p.text.push_str(line);
            p.text.push('\n');
        } else if !(line.trim().is_empty() || line.starts_with("# ")) {
            bail!("text before the first `## <kind>` line: {line:?}");
        }
    }
    for p in &mut out {
        p.text = p.text.trim_matches('\n').to_string();
        if p.text.trim().is_empty() {
            bail!("an empty prompt of kind {}", p.kind);
        }
    }
    if out.is_empty() {
        bail!("no prompts (each starts with a line `## <kind>`)");
    }
    Ok(out)
}

/// Reads and parses the prompt set in `path`.
pub fn read(path: &Path) -> Result<Vec<KindedPrompt>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    parse(&text).with_context(|| format!("prompt set {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prompts_run_to_the_next_kind_line() {
        let set =
            parse("# a comment\n\n## edit\nline one\n\nline two\n\n## question\nwhy?\n").unwrap();
        assert_eq!(set.len(), 2);
        assert_eq!(set[0].kind, "edit");
        assert_eq!(set[0].text, "line one\n\nline two");
        assert_eq!(set[1].text, "why?");
        assert!(parse("stray\n## a\nx").is_err());
        assert!(parse("## a\n\n## b\nx").is_err());
        assert!(parse("# only comments\n").is_err());
    }

    #[test]
    fn the_shipped_set_has_three_kinds() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("prompts/drafters.md");
        let set = read(&path).unwrap();
        let kinds: Vec<&str> = set.iter().map(|p| p.kind.as_str()).collect();
        // Alternating, so that any first three prompts hold one of each kind.
        assert_eq!(kinds[..3], ["code-edit", "question", "summary"]);
        let mut distinct = kinds.clone();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(distinct, vec!["code-edit", "question", "summary"]);
    }
}
