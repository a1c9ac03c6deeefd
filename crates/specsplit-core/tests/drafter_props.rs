//! Model-free drafters on random token streams: the n-gram match equals a brute-force search,
//! and every drafted tree is valid, within its shape, and made of continuations that occur in
//! what the drafter indexed, whatever the input (no panics).

use proptest::prelude::*;
use specsplit_core::drafter::ngram::{longest_match, NgramConfig, NgramDrafter};
use specsplit_core::drafter::suffix::{SuffixConfig, SuffixDrafter, SuffixStore};
use specsplit_core::drafter::DraftShape;
use specsplit_core::tree::{TokenTree, TreeLimits};

/// The longest n (from `max_n` down) whose tail n-gram occurs earlier within the window with a
/// token after it, and the starts of those occurrences, most recent first.
fn brute_match(ctx: &[u32], cfg: &NgramConfig) -> Option<(usize, Vec<usize>)> {
    let len = ctx.len();
    let lo = len.saturating_sub(cfg.window);
    for n in (cfg.min_n..=cfg.max_n).rev() {
        if n >= len {
            continue;
        }
        let tail = &ctx[len - n..];
        let starts: Vec<usize> = (lo..len - n)
            .rev()
            .filter(|&s| &ctx[s..s + n] == tail)
            .collect();
        if !starts.is_empty() {
            return Some((n, starts));
        }
    }
    None
}

fn is_substring(text: &[u32], pat: &[u32]) -> bool {
    pat.is_empty() || text.windows(pat.len()).any(|w| w == pat)
}

/// The tree is valid and fits `shape`.
fn check_shape(t: &TokenTree, shape: DraftShape) -> Result<(), TestCaseError> {
    if t.is_empty() {
        return Ok(());
    }
    t.validate(&TreeLimits::new(1 << 16, 1 << 10, 1 << 20))
        .map_err(|e| TestCaseError::fail(e.to_string()))?;
    prop_assert!(t.len() <= shape.max_nodes);
    prop_assert!(t.roots().count() <= shape.branches);
    prop_assert!(t.max_depth() < shape.depth);
    prop_assert!(!t.has_any_distribution());
    Ok(())
}

fn arb_shape() -> impl Strategy<Value = DraftShape> {
    (0usize..6, 0usize..4, 0usize..12).prop_map(|(depth, branches, max_nodes)| DraftShape {
        depth,
        branches,
        max_nodes,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn ngram_match_equals_brute_force(
        ctx in prop::collection::vec(0u32..4, 0..120),
        min_n in 1usize..4,
        extra in 0usize..5,
        window in 1usize..150,
    ) {
        let cfg = NgramConfig { min_n, max_n: min_n + extra, window };
        let got = longest_match(&ctx, &cfg).map(|m| (m.n, m.starts));
        prop_assert_eq!(got, brute_match(&ctx, &cfg));
    }

    #[test]
    fn ngram_trees_fit_and_copy_the_context(
        ctx in prop::collection::vec(0u32..5, 0..120),
        shape in arb_shape(),
    ) {
        let d = NgramDrafter::new(NgramConfig::default());
        let t = d.draft(&ctx, shape);
        check_shape(&t, shape)?;
        for i in 0..t.len() {
            prop_assert!(is_substring(&ctx, &t.path_tokens(i)));
        }
        // A match drafts at least one token where there is room.
        if !shape.is_empty() && longest_match(&ctx, d.config()).is_some() {
            prop_assert!(!t.is_empty());
        }
    }

    #[test]
    fn suffix_trees_fit_and_continue_what_was_seen(
        steps in prop::collection::vec((prop::collection::vec(0u32..5, 0..30), any::<bool>()), 1..8),
        shape in arb_shape(),
        max_tokens in 2usize..64,
        factor in 0.5f32..4.0,
        use_store in any::<bool>(),
    ) {
        let cfg = SuffixConfig {
            max_tokens,
            max_spec_factor: factor,
            store_max_tokens: 40,
            ..SuffixConfig::default()
        };
        let store = use_store.then(|| SuffixStore::shared(cfg));
        let mut d = SuffixDrafter::new(cfg, store.clone());
        let mut ctx: Vec<u32> = Vec::new();
        let mut seen: Vec<Vec<u32>> = Vec::new();
        for (tokens, extend) in steps {
            if !extend {
                // A new session over the same store.
                if !ctx.is_empty() {
                    d.finish(&ctx, 0);
                    seen.push(ctx.clone());
                }
                d = SuffixDrafter::new(cfg, store.clone());
                ctx.clear();
            }
            ctx.extend(tokens);
            let t = d.draft(&ctx, shape);
            check_shape(&t, shape)?;
            if let Some(s) = &store {
                prop_assert!(s.lock().unwrap().num_tokens() <= 40);
            }
            for i in 0..t.len() {
                let path = t.path_tokens(i);
                let here = is_substring(&ctx, &path);
                let earlier = use_store && seen.iter().any(|s| is_substring(s, &path));
                prop_assert!(here || earlier, "path {:?} seen nowhere", path);
            }
        }
    }
}
