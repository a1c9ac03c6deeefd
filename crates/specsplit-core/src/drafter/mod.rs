//! Model-free drafters: draft trees proposed from tokens already seen, with no draft model.
//!
//! - [`ngram`]: prompt lookup, the longest n-gram match of the context's tail earlier in the
//!   context, continued as a chain (or a tree where several continuations follow the match).
//! - [`suffix_trie`]: a bounded-depth suffix trie with occurrence counts.
//! - [`suffix`]: the suffix drafter over the session's tokens and, opt-in, a shared
//!   [`SuffixStore`](suffix::SuffixStore) of earlier generations; frequency-weighted branches,
//!   depth from the counts.
//! - [`forest`]: the drafters' trees in the order they grow them, laid out breadth first.
//!
//! Their trees carry no draft distributions: every node is a deterministic (point-mass)
//! proposal, which sampled verification checks with
//! [`verify_point_mass`](crate::verify::verify_point_mass) (exact whatever chose the tokens).
//! Greedy verification needs nothing else either.

pub mod forest;
pub mod ngram;
pub mod suffix;
pub mod suffix_trie;

use crate::tree::{full_tree_size, TokenTree};

/// The room a drafter may fill: at most `depth` levels, `branches` roots and `max_nodes` nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DraftShape {
    /// Most levels (the most tokens one round can accept).
    pub depth: usize,
    /// Most roots (alternatives for the first token).
    pub branches: usize,
    /// Most nodes in all.
    pub max_nodes: usize,
}

impl DraftShape {
    /// The room of a model draft tree of `widths` (children per node at each depth): as deep,
    /// as many roots, as many nodes.
    pub fn of_widths(widths: &[usize]) -> Self {
        Self {
            depth: widths.len(),
            branches: widths.first().copied().unwrap_or(0),
            max_nodes: full_tree_size(widths),
        }
    }

    /// Whether no node fits.
    pub fn is_empty(&self) -> bool {
        self.depth == 0 || self.branches == 0 || self.max_nodes == 0
    }
}

/// A model-free drafter of one session: the context is the whole sequence so far (prompt and
/// generated tokens), passed at every call.
#[derive(Debug, Clone)]
pub enum ModelFreeDrafter {
    /// Prompt lookup ([`ngram::NgramDrafter`]).
    Ngram(ngram::NgramDrafter),
    /// Suffix decoding ([`suffix::SuffixDrafter`]).
    Suffix(suffix::SuffixDrafter),
}

impl ModelFreeDrafter {
    /// A tree continuing `context` within `shape` (empty when nothing matches).
    pub fn draft(&mut self, context: &[u32], shape: DraftShape) -> TokenTree {
        match self {
            Self::Ngram(d) => d.draft(context, shape),
            Self::Suffix(d) => d.draft(context, shape),
        }
    }

    /// Ends the session whose final sequence is `sequence`, with `prompt_len` tokens of prompt
    /// (the suffix drafter records the generation in its shared store, when it has one).
    pub fn finish(&mut self, sequence: &[u32], prompt_len: usize) {
        if let Self::Suffix(d) = self {
            d.finish(sequence, prompt_len);
        }
    }
}
