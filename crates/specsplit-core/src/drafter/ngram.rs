//! Prompt lookup: the longest n-gram at the end of the context (n from `max_n` down to `min_n`)
//! that also occurs earlier in it, continued with the tokens that followed it there.

use super::forest::Forest;
use super::DraftShape;
use crate::tree::TokenTree;

/// Settings of the n-gram drafter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NgramConfig {
    /// Shortest n-gram matched (at least 1).
    pub min_n: usize,
    /// Longest n-gram matched (at least `min_n`).
    pub max_n: usize,
    /// Most tokens at the end of the context searched for matches (memory and time bound:
    /// a draft costs O(`window` · `max_n`) and allocates nothing proportional to it).
    pub window: usize,
}

impl Default for NgramConfig {
    fn default() -> Self {
        Self {
            min_n: 1,
            max_n: 4,
            window: 1 << 16,
        }
    }
}

impl NgramConfig {
    /// Checks the settings, with a message naming the bad one.
    pub fn validate(&self) -> Result<(), String> {
        if self.min_n == 0 || self.min_n > self.max_n {
            return Err(format!(
                "n-gram sizes must satisfy 1 <= min_n <= max_n, got {}..{}",
                self.min_n, self.max_n
            ));
        }
        if self.window <= self.max_n {
            return Err(format!(
                "the n-gram window ({}) must exceed max_n ({})",
                self.window, self.max_n
            ));
        }
        Ok(())
    }
}

/// The longest match of the context's tail: its length and where it occurs earlier.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NgramMatch {
    /// The n-gram's length.
    pub n: usize,
    /// Start of every earlier occurrence followed by at least one token (the tail itself
    /// excluded), most recent first.
    pub starts: Vec<usize>,
}

/// The longest n in `min_n..=max_n` whose last n tokens of `context` occur earlier in it with
/// a token after them, searching only the last `window` tokens; `None` when no n matches.
pub fn longest_match(context: &[u32], cfg: &NgramConfig) -> Option<NgramMatch> {
    let len = context.len();
    if cfg.min_n == 0 || cfg.min_n > cfg.max_n || len <= cfg.min_n {
        return None;
    }
    let lo = len.saturating_sub(cfg.window);
    let max_n = cfg.max_n.min(len - 1);
    // One backward scan: for each end position e (the occurrence is context[e - n..e], followed
    // by context[e]), the common length of the tails ending at e and at len.
    let mut best_n = 0usize;
    let mut starts = Vec::new();
    for e in (lo + 1..len).rev() {
        let mut k = 0;
        while k < max_n && e > k + lo && context[e - 1 - k] == context[len - 1 - k] {
            k += 1;
        }
        if k < cfg.min_n || k < best_n {
            continue;
        }
        if k > best_n {
            best_n = k;
            starts.clear();
        }
        starts.push(e - k);
    }
    (best_n > 0).then_some(NgramMatch { n: best_n, starts })
}

/// The n-gram (prompt lookup) drafter. Stateless: the context holds everything it uses.
#[derive(Debug, Clone, Default)]
pub struct NgramDrafter {
    cfg: NgramConfig,
}

impl NgramDrafter {
    /// A drafter with `cfg` (invalid settings find no match).
    pub fn new(cfg: NgramConfig) -> Self {
        Self { cfg }
    }

    /// Its settings.
    pub fn config(&self) -> &NgramConfig {
        &self.cfg
    }

    /// A tree after `context` within `shape`: one root per distinct token that followed the
    /// longest match (most frequent first, then most recent; at most `shape.branches`), each
    /// continued as a chain copied from its most recent occurrence. Empty without a match.
    pub fn draft(&self, context: &[u32], shape: DraftShape) -> TokenTree {
        if shape.is_empty() {
            return TokenTree::new();
        }
        let Some(m) = longest_match(context, &self.cfg) else {
            return TokenTree::new();
        };
        // Distinct next tokens: (token, count, most recent continuation start).
        let mut next: Vec<(u32, usize, usize)> = Vec::new();
        for &s in &m.starts {
            let at = s + m.n;
            let t = context[at];
            match next.iter_mut().find(|(tok, _, _)| *tok == t) {
                Some(entry) => entry.1 += 1,
                None => next.push((t, 1, at)),
            }
        }
        let total = m.starts.len() as f32;
        // Stable: equal counts keep the most recent first.
        next.sort_by_key(|n| std::cmp::Reverse(n.1));
        next.truncate(shape.branches);
        // The likeliest branch first, as deep as the node budget lets it.
        let mut forest = Forest::new();
        let mut budget = shape.max_nodes;
        for &(_, count, at) in &next {
            if budget == 0 {
                break;
            }
            let log_p = (count as f32 / total).ln();
            let depth = shape.depth.min(budget).min(context.len() - at);
            let mut parent = None;
            for (i, &t) in context[at..at + depth].iter().enumerate() {
                parent = Some(forest.add(parent, t, if i == 0 { log_p } else { 0.0 }));
            }
            budget -= depth;
        }
        forest.into_tree()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(depth: usize, branches: usize, max_nodes: usize) -> DraftShape {
        DraftShape {
            depth,
            branches,
            max_nodes,
        }
    }

    #[test]
    fn copies_what_followed_the_longest_match() {
        // "1 2 3 4 5 ... 1 2 3" -> 4 5 6
        let ctx = [1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3];
        let d = NgramDrafter::default();
        let m = longest_match(&ctx, d.config()).unwrap();
        assert_eq!((m.n, m.starts.clone()), (3, vec![0]));
        let t = d.draft(&ctx, shape(3, 1, 3));
        assert_eq!(t.tokens(), &[4, 5, 6]);
        assert_eq!(t.max_depth(), 2);
    }

    #[test]
    fn several_continuations_branch_most_frequent_first() {
        // After "7": 1 (twice), 2 (once, most recent) -> roots 1 then 2.
        let ctx = [7, 1, 5, 7, 1, 6, 7, 2, 8, 7];
        let d = NgramDrafter::default();
        let t = d.draft(&ctx, shape(2, 2, 4));
        assert_eq!(t.roots().count(), 2);
        assert_eq!(t.token(0), 1);
        assert_eq!(t.token(1), 2);
        // The first branch continues as its most recent occurrence did (7 1 6).
        assert_eq!(t.path_tokens(2), vec![1, 6]);
        assert!(t.len() <= 4);
    }

    #[test]
    fn no_match_no_tree_and_bounded_inputs() {
        let d = NgramDrafter::default();
        assert!(d.draft(&[], shape(4, 1, 4)).is_empty());
        assert!(d.draft(&[1], shape(4, 1, 4)).is_empty());
        assert!(d.draft(&[1, 2, 3, 4], shape(4, 1, 4)).is_empty());
        assert!(d.draft(&[1, 1, 1], shape(0, 1, 4)).is_empty());
        // The match's continuation runs into the tail: never past the context's end.
        let t = d.draft(&[5, 5], shape(8, 1, 8));
        assert_eq!(t.tokens(), &[5]);
    }

    #[test]
    fn the_window_bounds_the_search() {
        let mut ctx = vec![1, 2, 3];
        ctx.extend(std::iter::repeat_n(0, 50));
        ctx.extend([1, 2]);
        let narrow = NgramConfig {
            window: 10,
            ..NgramConfig::default()
        };
        assert_eq!(longest_match(&ctx, &NgramConfig::default()).unwrap().n, 2);
        assert!(longest_match(&ctx, &narrow).is_none());
    }
}
