//! Model-free drafters measured without playing them: each round, every model-free drafter
//! proposes a tree after the sequence (microseconds of work), and once the sequence has grown
//! far enough the proposal is scored against the tokens the target actually emitted.
//!
//! The score is what the round would have emitted had the target verified that tree: the
//! tokens along the tree's path that the emitted sequence follows, plus the target's next one.
//! For greedy decoding that is exactly the round's outcome. For sampled decoding the emitted
//! sequence follows the target's distribution whatever drafter proposed it, so a point-mass
//! draft token matches it with the target's probability of that token, which is the chance the
//! verifier accepts it: the score is the round's outcome in expectation.

use std::collections::VecDeque;

use specsplit_core::tree::TokenTree;

use crate::drafter::Drafter;

/// Proposals kept awaiting their tokens, at most (the oldest are dropped beyond).
const MAX_PENDING: usize = 64;

/// A proposal scored: what a round of `drafter` would have emitted and sent.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShadowRound {
    /// The drafter that proposed the tree.
    pub drafter: Drafter,
    /// Tokens the round would have emitted (accepted + the target's next).
    pub emitted: usize,
    /// Rows the round's verify would have sent: the tree's nodes and the one pending token.
    pub rows: usize,
    /// What drafting the tree took (ms).
    pub draft_ms: f64,
}

#[derive(Debug, Clone)]
struct Proposal {
    drafter: Drafter,
    /// Length of the sequence the tree continues.
    at: usize,
    tree: TokenTree,
    draft_ms: f64,
}

/// What a proposal's tree accepts of the tokens known after its start.
enum Walk {
    /// The tree's path ends (a mismatch or a leaf) after this many accepted tokens.
    Accepted(usize),
    /// The tokens known so far do not settle it.
    Pending,
}

/// How many of `tree`'s levels the tokens `next` (those emitted after the tree's start) follow.
fn walk(tree: &TokenTree, next: &[u32]) -> Walk {
    let mut level = tree.roots();
    let mut accepted = 0;
    loop {
        if level.is_empty() {
            return Walk::Accepted(accepted);
        }
        let Some(&t) = next.get(accepted) else {
            return Walk::Pending;
        };
        match level.clone().find(|&i| tree.token(i) == t) {
            Some(i) => {
                accepted += 1;
                level = tree.children(i);
            }
            None => return Walk::Accepted(accepted),
        }
    }
}

/// Model-free drafters' proposals awaiting the tokens that score them.
#[derive(Debug, Clone, Default)]
pub struct ShadowDrafts {
    pending: VecDeque<Proposal>,
}

impl ShadowDrafts {
    /// Keeps `drafter`'s `tree`, drafted after a sequence of `at` tokens in `draft_ms`, to be
    /// scored by [`ShadowDrafts::score`]. An empty tree scores as a round without a draft.
    pub fn propose(&mut self, drafter: Drafter, at: usize, tree: TokenTree, draft_ms: f64) {
        if self.pending.len() == MAX_PENDING {
            self.pending.pop_front();
        }
        self.pending.push_back(Proposal {
            drafter,
            at,
            tree,
            draft_ms,
        });
    }

    /// Scores every proposal that `sequence` (the whole sequence so far) settles, and drops it.
    pub fn score(&mut self, sequence: &[u32]) -> Vec<ShadowRound> {
        let mut out = Vec::new();
        self.pending.retain(|p| {
            let next = sequence.get(p.at..).unwrap_or(&[]);
            // The target's next token must be known too: a round emits it after the path.
            if next.is_empty() {
                return true;
            }
            match walk(&p.tree, next) {
                Walk::Accepted(a) => {
                    out.push(ShadowRound {
                        drafter: p.drafter,
                        emitted: a + 1,
                        rows: p.tree.len() + 1,
                        draft_ms: p.draft_ms,
                    });
                    false
                }
                Walk::Pending => true,
            }
        });
        out
    }

    /// Proposals still waiting for tokens.
    pub fn pending(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tree with roots 5 and 6; 5 → 7 → 8; 6 → 9.
    fn branching() -> TokenTree {
        let mut t = TokenTree::new();
        let a = t.push_root(5, 0.0).unwrap();
        let b = t.push_root(6, 0.0).unwrap();
        let c = t.push_child(a, 7, 0.0).unwrap();
        t.push_child(b, 9, 0.0).unwrap();
        t.push_child(c, 8, 0.0).unwrap();
        t
    }

    #[test]
    fn a_proposal_scores_the_path_the_emitted_tokens_follow() {
        let mut s = ShadowDrafts::default();
        let seq = [1, 2, 3];
        s.propose(Drafter::Ngram, 3, branching(), 0.5);
        // Nothing emitted after the start yet.
        assert!(s.score(&seq).is_empty());
        // 5, 7 emitted: the path may go on.
        assert!(s.score(&[1, 2, 3, 5, 7]).is_empty());
        assert_eq!(s.pending(), 1);
        // 5, 7, 4: two accepted, the target's 4 next.
        let r = s.score(&[1, 2, 3, 5, 7, 4]);
        assert_eq!(
            r,
            vec![ShadowRound {
                drafter: Drafter::Ngram,
                emitted: 3,
                rows: 6,
                draft_ms: 0.5
            }]
        );
        assert_eq!(s.pending(), 0);
    }

    #[test]
    fn the_second_root_a_leaf_and_a_miss_settle_early() {
        let mut s = ShadowDrafts::default();
        s.propose(Drafter::Suffix, 1, branching(), 0.0);
        s.propose(Drafter::Ngram, 1, branching(), 0.0);
        // 6, 9: the second root's whole path; a leaf needs no later token.
        let r = s.score(&[0, 6, 9]);
        assert_eq!(r.iter().map(|x| x.emitted).collect::<Vec<_>>(), [3, 3]);
        // A miss at the first token: one emitted (the target's own).
        s.propose(Drafter::Ngram, 1, branching(), 0.0);
        assert_eq!(s.score(&[0, 4])[0].emitted, 1);
        // An empty tree: a round without a draft.
        s.propose(Drafter::Ngram, 2, TokenTree::new(), 0.0);
        let r = s.score(&[0, 4, 4]);
        assert_eq!((r[0].emitted, r[0].rows), (1, 1));
    }

    #[test]
    fn pending_proposals_are_bounded() {
        let mut s = ShadowDrafts::default();
        for i in 0..(MAX_PENDING + 10) {
            s.propose(Drafter::Ngram, 1000 + i, branching(), 0.0);
        }
        assert_eq!(s.pending(), MAX_PENDING);
    }
}
