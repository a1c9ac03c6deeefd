//! Suffix decoding: the longest suffix of the context found in a suffix trie over the session's
//! tokens or, opt-in, over earlier generations (a [`SuffixStore`] shared by a worker's or an
//! orchestrator's sessions), expanded best first by the frequency of each continuation.
//!
//! A node's score is the product of the conditional frequencies along its path
//! (`count(child) / Σ count(children)`); nodes scoring below `min_prob` are not drafted, and the
//! depth is at most `max_spec_factor` times the match's length, so a short or ambiguous match
//! drafts little and a long, consistent one drafts deep.
//!
//! Memory: a trie holds at most `max_tokens · max_depth` nodes (about 50 bytes each with its
//! index entry); the session trie keeps the last `max_tokens` tokens of the context (it
//! re-indexes the newest half when the context outgrows that), the store the newest
//! generations up to `store_max_tokens` tokens in all (oldest evicted first).

use std::collections::{BinaryHeap, VecDeque};
use std::sync::{Arc, Mutex};

use super::forest::Forest;
use super::suffix_trie::{SuffixTrie, TrieMatch};
use super::DraftShape;
use crate::tree::TokenTree;

/// Settings of the suffix drafter and its store.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SuffixConfig {
    /// Deepest substring indexed (matched part plus drafted part), at least 2.
    pub max_depth: usize,
    /// Longest context suffix matched.
    pub max_match: usize,
    /// Most tokens drafted per matched token (depth ≤ ⌈factor · match length⌉).
    pub max_spec_factor: f32,
    /// Least score (product of conditional frequencies along the path) of a drafted node.
    pub min_prob: f32,
    /// Most tokens of the session's context indexed.
    pub max_tokens: usize,
    /// Most tokens of earlier generations a [`SuffixStore`] keeps.
    pub store_max_tokens: usize,
}

impl Default for SuffixConfig {
    fn default() -> Self {
        Self {
            max_depth: 24,
            max_match: 16,
            max_spec_factor: 1.0,
            min_prob: 0.1,
            max_tokens: 8192,
            store_max_tokens: 1 << 16,
        }
    }
}

impl SuffixConfig {
    /// Checks the settings, with a message naming the bad one.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_depth < 2 || self.max_match == 0 {
            return Err(format!(
                "suffix trie depth must be >= 2 and max_match >= 1, got {} and {}",
                self.max_depth, self.max_match
            ));
        }
        if !(self.max_spec_factor > 0.0 && self.max_spec_factor.is_finite()) {
            return Err(format!(
                "max_spec_factor must be positive, got {}",
                self.max_spec_factor
            ));
        }
        if !(0.0..=1.0).contains(&self.min_prob) {
            return Err(format!(
                "min_prob must lie in [0, 1], got {}",
                self.min_prob
            ));
        }
        if self.max_tokens < 2 {
            return Err(format!(
                "the session's token cap must be >= 2, got {}",
                self.max_tokens
            ));
        }
        Ok(())
    }

    /// Node cap of a trie over `tokens` tokens.
    fn node_cap(&self, tokens: usize) -> usize {
        tokens.saturating_mul(self.max_depth).saturating_add(1)
    }
}

/// Earlier generations, indexed for the suffix drafters of many sessions.
#[derive(Debug, Clone)]
pub struct SuffixStore {
    trie: SuffixTrie,
    docs: VecDeque<Vec<u32>>,
    total: usize,
    cfg: SuffixConfig,
}

/// A store shared by sessions.
pub type SharedSuffixStore = Arc<Mutex<SuffixStore>>;

impl SuffixStore {
    /// An empty store with `cfg`'s depth and `store_max_tokens` cap.
    pub fn new(cfg: SuffixConfig) -> Self {
        Self {
            trie: SuffixTrie::new(cfg.max_depth, cfg.node_cap(cfg.store_max_tokens)),
            docs: VecDeque::new(),
            total: 0,
            cfg,
        }
    }

    /// A new store behind a mutex, to share.
    pub fn shared(cfg: SuffixConfig) -> SharedSuffixStore {
        Arc::new(Mutex::new(Self::new(cfg)))
    }

    /// Tokens held.
    pub fn num_tokens(&self) -> usize {
        self.total
    }

    /// Generations held.
    pub fn num_generations(&self) -> usize {
        self.docs.len()
    }

    /// Adds a generation (its newest `store_max_tokens` tokens), evicting the oldest ones
    /// while the store holds more than its cap.
    pub fn record(&mut self, generation: &[u32]) {
        let cap = self.cfg.store_max_tokens;
        let doc = &generation[generation.len().saturating_sub(cap)..];
        if doc.is_empty() {
            return;
        }
        self.docs.push_back(doc.to_vec());
        self.total += doc.len();
        if self.total > cap {
            while self.total > cap {
                let Some(old) = self.docs.pop_front() else {
                    break;
                };
                self.total -= old.len();
            }
            self.rebuild();
        } else {
            self.trie.start_document();
            for &t in doc {
                self.trie.push(t);
            }
        }
    }

    /// Re-indexes the generations held.
    fn rebuild(&mut self) {
        self.trie = SuffixTrie::new(
            self.cfg.max_depth,
            self.cfg.node_cap(self.cfg.store_max_tokens),
        );
        for doc in &self.docs {
            self.trie.start_document();
            for &t in doc {
                self.trie.push(t);
            }
        }
    }
}

/// The suffix drafter of one session.
#[derive(Debug, Clone)]
pub struct SuffixDrafter {
    cfg: SuffixConfig,
    trie: SuffixTrie,
    /// Where in the context the indexed tokens start, and the tokens indexed.
    offset: usize,
    indexed: Vec<u32>,
    store: Option<SharedSuffixStore>,
}

/// A candidate node of the best-first expansion.
#[derive(Debug, PartialEq)]
struct Candidate {
    score: f32,
    /// Its trie node.
    node: u32,
    /// Its parent in the forest.
    parent: Option<usize>,
    /// Its level (0: a root).
    level: usize,
}

impl Eq for Candidate {}

impl Ord for Candidate {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.score
            .total_cmp(&other.score)
            // Earlier-pushed (lower node index on ties) first: deterministic trees.
            .then(other.node.cmp(&self.node))
    }
}

impl PartialOrd for Candidate {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl SuffixDrafter {
    /// A drafter over the session's tokens alone (`store: None`) or also over `store`'s.
    pub fn new(cfg: SuffixConfig, store: Option<SharedSuffixStore>) -> Self {
        Self {
            cfg,
            trie: SuffixTrie::new(cfg.max_depth, cfg.node_cap(cfg.max_tokens)),
            offset: 0,
            indexed: Vec::new(),
            store,
        }
    }

    /// Its settings.
    pub fn config(&self) -> &SuffixConfig {
        &self.cfg
    }

    /// Brings the session trie up to `context`: appends what is new when `context` extends
    /// what is indexed, else (or past the token cap) re-indexes its newest tokens.
    fn sync(&mut self, context: &[u32]) {
        let end = self.offset + self.indexed.len();
        let extends = context.len() >= end && context[self.offset..end] == self.indexed[..];
        let cap = self.cfg.max_tokens.max(2);
        if !extends || context.len() - self.offset > cap {
            // Past the cap, keep the newest half so re-indexing is amortised.
            let keep = if context.len() > cap {
                cap / 2
            } else {
                context.len()
            };
            self.offset = context.len() - keep;
            self.indexed.clear();
            self.trie = SuffixTrie::new(self.cfg.max_depth, self.cfg.node_cap(cap));
        }
        let from = self.offset + self.indexed.len();
        for &t in &context[from..] {
            self.trie.push(t);
        }
        self.indexed.extend_from_slice(&context[from..]);
    }

    /// A tree after `context` within `shape` (empty when nothing matches).
    pub fn draft(&mut self, context: &[u32], shape: DraftShape) -> TokenTree {
        if shape.is_empty() || context.is_empty() {
            return TokenTree::new();
        }
        self.sync(context);
        let own = self.trie.longest_suffix(context, self.cfg.max_match);
        let store = self.store.clone();
        let guard = store.as_ref().and_then(|s| s.lock().ok());
        let theirs = guard
            .as_ref()
            .and_then(|s| s.trie.longest_suffix(context, self.cfg.max_match));
        match (own, theirs, guard.as_ref()) {
            (Some(a), Some(b), Some(s)) if b.len > a.len => expand(&s.trie, b, shape, &self.cfg),
            (Some(a), _, _) => expand(&self.trie, a, shape, &self.cfg),
            (None, Some(b), Some(s)) => expand(&s.trie, b, shape, &self.cfg),
            _ => TokenTree::new(),
        }
    }

    /// Records the session's generated tokens (`sequence` after its `prompt_len` prompt
    /// tokens) in the shared store, if any.
    pub fn finish(&mut self, sequence: &[u32], prompt_len: usize) {
        if let (Some(store), Some(generated)) = (&self.store, sequence.get(prompt_len..)) {
            if let Ok(mut s) = store.lock() {
                s.record(generated);
            }
        }
    }
}

/// The best-first tree below match `m` of `trie` within `shape` and `cfg`'s bounds.
fn expand(trie: &SuffixTrie, m: TrieMatch, shape: DraftShape, cfg: &SuffixConfig) -> TokenTree {
    let spec = (cfg.max_spec_factor * m.len as f32).ceil().max(1.0) as usize;
    let depth = shape.depth.min(spec);
    let mut forest = Forest::new();
    let mut heap = BinaryHeap::new();
    push_children(trie, m.node, None, 0, 1.0, shape.branches, &mut heap);
    while let Some(c) = heap.pop() {
        if forest.len() >= shape.max_nodes {
            break;
        }
        if c.score < cfg.min_prob {
            // Every other candidate scores no higher.
            break;
        }
        if c.level >= depth {
            continue;
        }
        let id = forest.add(c.parent, trie.token(c.node), c.score.ln());
        push_children(
            trie,
            c.node,
            Some(id),
            c.level + 1,
            c.score,
            shape.branches,
            &mut heap,
        );
    }
    forest.into_tree()
}

/// Queues `node`'s `branches` most frequent children, scored `score · count / Σ counts`.
fn push_children(
    trie: &SuffixTrie,
    node: u32,
    parent: Option<usize>,
    level: usize,
    score: f32,
    branches: usize,
    heap: &mut BinaryHeap<Candidate>,
) {
    let kids = trie.children(node);
    let total: u64 = kids.iter().map(|k| u64::from(k.2)).sum();
    if total == 0 {
        return;
    }
    for &(child, _, count) in kids.iter().take(branches) {
        heap.push(Candidate {
            score: score * (count as f32 / total as f32),
            node: child,
            parent,
            level,
        });
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
    fn continues_a_repeated_passage() {
        let mut d = SuffixDrafter::new(SuffixConfig::default(), None);
        let ctx = [10, 11, 12, 13, 14, 15, 1, 2, 10, 11, 12];
        let t = d.draft(&ctx, shape(3, 1, 3));
        assert_eq!(t.tokens(), &[13, 14, 15]);
        // Incremental: the next token extends the index.
        let mut more = ctx.to_vec();
        more.push(13);
        assert_eq!(d.draft(&more, shape(2, 1, 2)).tokens(), &[14, 15]);
    }

    #[test]
    fn branches_follow_frequency_and_depth_follows_the_match() {
        let mut d = SuffixDrafter::new(SuffixConfig::default(), None);
        // After 7: 1 three times, 2 once.
        let ctx = [7, 1, 7, 1, 7, 1, 7, 2, 7];
        let t = d.draft(&ctx, shape(4, 2, 8));
        assert_eq!(t.token(0), 1);
        assert_eq!(t.token(1), 2);
        // A one-token match drafts one level with the default factor.
        assert_eq!(t.max_depth(), 0);
        let deep = SuffixConfig {
            max_spec_factor: 4.0,
            ..SuffixConfig::default()
        };
        let t = SuffixDrafter::new(deep, None).draft(&ctx, shape(4, 2, 8));
        assert!(t.max_depth() > 0);
    }

    #[test]
    fn unlikely_branches_are_not_drafted() {
        let cfg = SuffixConfig {
            min_prob: 0.3,
            ..SuffixConfig::default()
        };
        let mut d = SuffixDrafter::new(cfg, None);
        // After 7: 1 four times, 2 once (0.2 < 0.3).
        let ctx = [7, 1, 7, 1, 7, 1, 7, 1, 7, 2, 7];
        let t = d.draft(&ctx, shape(1, 4, 4));
        assert_eq!(t.tokens(), &[1]);
    }

    #[test]
    fn the_store_serves_earlier_generations_and_stays_capped() {
        let cfg = SuffixConfig {
            store_max_tokens: 8,
            ..SuffixConfig::default()
        };
        let store = SuffixStore::shared(cfg);
        let mut first = SuffixDrafter::new(cfg, Some(store.clone()));
        let seq = [1, 2, 3, 4, 5, 6];
        first.finish(&seq, 1);
        assert_eq!(store.lock().unwrap().num_tokens(), 5);
        // A new session whose context ends like that generation.
        let mut second = SuffixDrafter::new(cfg, Some(store.clone()));
        let t = second.draft(&[9, 2, 3], shape(2, 1, 2));
        assert_eq!(t.tokens(), &[4, 5]);
        // Without the store nothing matches.
        let mut alone = SuffixDrafter::new(cfg, None);
        assert!(alone.draft(&[9, 2, 3], shape(2, 1, 2)).is_empty());
        second.finish(&[0, 7, 7, 7, 7, 7], 1);
        let s = store.lock().unwrap();
        assert!(s.num_tokens() <= 8);
        assert_eq!(s.num_generations(), 1);
    }

    #[test]
    fn a_rewritten_or_long_context_is_reindexed_within_the_cap() {
        let cfg = SuffixConfig {
            max_tokens: 16,
            ..SuffixConfig::default()
        };
        let mut d = SuffixDrafter::new(cfg, None);
        let a: Vec<u32> = (0..12).chain(0..4).collect();
        assert_eq!(d.draft(&a, shape(1, 1, 1)).tokens(), &[4]);
        // A different context (not an extension) is indexed afresh.
        let b = [50, 51, 52, 50, 51];
        assert_eq!(d.draft(&b, shape(1, 1, 1)).tokens(), &[52]);
        let long: Vec<u32> = (0..100).map(|i| i % 7).collect();
        assert!(!d.draft(&long, shape(4, 1, 4)).is_empty());
        assert!(d.indexed.len() <= 16);
    }
}
