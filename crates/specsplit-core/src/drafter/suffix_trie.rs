//! A suffix trie of bounded depth with occurrence counts: every substring of the indexed
//! documents up to `max_depth` tokens long is a path from the root, and each node counts the
//! occurrences of its substring. Appending a token costs O(`max_depth`); memory is capped by
//! `max_nodes` (appends that would exceed it are dropped and reported).

use std::collections::HashMap;

/// Index of the root node.
const ROOT: u32 = 0;
/// No node.
const NONE: u32 = u32::MAX;

/// One substring: its last token, occurrences, length and links.
#[derive(Debug, Clone)]
struct Node {
    token: u32,
    count: u32,
    depth: u32,
    first_child: u32,
    next_sibling: u32,
}

/// A bounded-depth suffix trie with counts.
#[derive(Debug, Clone)]
pub struct SuffixTrie {
    nodes: Vec<Node>,
    /// (parent, token) → child.
    index: HashMap<(u32, u32), u32>,
    /// Nodes of the suffixes of the current document that may still grow (depth < max).
    active: Vec<u32>,
    max_depth: usize,
    max_nodes: usize,
    /// Tokens appended.
    tokens: usize,
}

/// The longest suffix of a context found in a trie: its node and length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrieMatch {
    /// The node of the matched substring.
    pub node: u32,
    /// Its length in tokens.
    pub len: usize,
}

impl SuffixTrie {
    /// An empty trie indexing substrings up to `max_depth` tokens (at least 1) in at most
    /// `max_nodes` nodes (at least 1, the root).
    pub fn new(max_depth: usize, max_nodes: usize) -> Self {
        Self {
            nodes: vec![Node {
                token: 0,
                count: 0,
                depth: 0,
                first_child: NONE,
                next_sibling: NONE,
            }],
            index: HashMap::new(),
            active: Vec::new(),
            max_depth: max_depth.max(1),
            max_nodes: max_nodes.clamp(1, NONE as usize),
            tokens: 0,
        }
    }

    /// Deepest substring indexed.
    pub fn max_depth(&self) -> usize {
        self.max_depth
    }

    /// Nodes held (the root included).
    pub fn num_nodes(&self) -> usize {
        self.nodes.len()
    }

    /// Tokens appended so far.
    pub fn num_tokens(&self) -> usize {
        self.tokens
    }

    /// Starts a new document: later tokens form no substring with earlier ones.
    pub fn start_document(&mut self) {
        self.active.clear();
    }

    /// Appends `token` to the current document; false when the node cap dropped some of its
    /// substrings (the trie stays consistent: counts of what it holds are exact up to then).
    pub fn push(&mut self, token: u32) -> bool {
        self.tokens += 1;
        let mut complete = true;
        let active = std::mem::take(&mut self.active);
        let mut next = Vec::with_capacity(active.len() + 1);
        // The substrings ending at this token: the root's child, and each active one extended.
        let parents = std::iter::once(ROOT).chain(active.iter().copied());
        let mut grown = Vec::with_capacity(active.len() + 1);
        for parent in parents {
            match self.child_or_insert(parent, token) {
                Some(c) => grown.push(c),
                None => {
                    complete = false;
                    break;
                }
            }
        }
        self.nodes[ROOT as usize].count = self.nodes[ROOT as usize].count.saturating_add(1);
        for c in grown {
            let node = &mut self.nodes[c as usize];
            node.count = node.count.saturating_add(1);
            if (node.depth as usize) < self.max_depth {
                next.push(c);
            }
        }
        self.active = next;
        complete
    }

    /// The child of `parent` for `token`, added if missing and the cap allows.
    fn child_or_insert(&mut self, parent: u32, token: u32) -> Option<u32> {
        if let Some(&c) = self.index.get(&(parent, token)) {
            return Some(c);
        }
        if self.nodes.len() >= self.max_nodes {
            return None;
        }
        let c = self.nodes.len() as u32;
        let p = &mut self.nodes[parent as usize];
        let sibling = p.first_child;
        p.first_child = c;
        let depth = p.depth + 1;
        self.nodes.push(Node {
            token,
            count: 0,
            depth,
            first_child: NONE,
            next_sibling: sibling,
        });
        self.index.insert((parent, token), c);
        Some(c)
    }

    /// The node of `path` from the root, if indexed.
    pub fn find(&self, path: &[u32]) -> Option<u32> {
        path.iter()
            .try_fold(ROOT, |n, &t| self.index.get(&(n, t)).copied())
    }

    /// The longest suffix of `context` of at most `max_len` tokens that is indexed and has at
    /// least one continuation (`None` when not even its last token has one).
    pub fn longest_suffix(&self, context: &[u32], max_len: usize) -> Option<TrieMatch> {
        let longest = max_len.min(context.len()).min(self.max_depth - 1);
        (1..=longest).rev().find_map(|len| {
            let node = self.find(&context[context.len() - len..])?;
            (self.nodes[node as usize].first_child != NONE).then_some(TrieMatch { node, len })
        })
    }

    /// Occurrences of `node`'s substring.
    pub fn count(&self, node: u32) -> u32 {
        self.nodes.get(node as usize).map_or(0, |n| n.count)
    }

    /// `node`'s token (the last of its substring).
    pub fn token(&self, node: u32) -> u32 {
        self.nodes.get(node as usize).map_or(0, |n| n.token)
    }

    /// `node`'s children as (child, token, count), most frequent first (ties: smaller token
    /// first).
    pub fn children(&self, node: u32) -> Vec<(u32, u32, u32)> {
        let mut out = Vec::new();
        let mut c = self
            .nodes
            .get(node as usize)
            .map_or(NONE, |n| n.first_child);
        while c != NONE {
            let n = &self.nodes[c as usize];
            out.push((c, n.token, n.count));
            c = n.next_sibling;
        }
        out.sort_by(|a, b| b.2.cmp(&a.2).then(a.1.cmp(&b.1)));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn occurrences(text: &[u32], pat: &[u32]) -> usize {
        text.windows(pat.len()).filter(|w| *w == pat).count()
    }

    #[test]
    fn counts_are_substring_occurrences() {
        let text = [1, 2, 1, 2, 3, 1, 2, 1];
        let mut t = SuffixTrie::new(3, 1 << 10);
        for &x in &text {
            assert!(t.push(x));
        }
        for pat in [&[1][..], &[1, 2], &[2, 1], &[1, 2, 1], &[2, 3, 1], &[3]] {
            let n = t.find(pat).unwrap();
            assert_eq!(t.count(n) as usize, occurrences(&text, pat), "{pat:?}");
        }
        // Deeper than max_depth is not indexed.
        assert!(t.find(&[1, 2, 1, 2]).is_none());
        let kids = t.children(t.find(&[1]).unwrap());
        assert_eq!(
            kids.iter().map(|k| (k.1, k.2)).collect::<Vec<_>>(),
            vec![(2, 3)]
        );
    }

    #[test]
    fn documents_do_not_join_and_the_cap_holds() {
        let mut t = SuffixTrie::new(4, 1 << 10);
        for x in [1, 2] {
            t.push(x);
        }
        t.start_document();
        for x in [3, 4] {
            t.push(x);
        }
        assert!(t.find(&[2, 3]).is_none());
        assert!(t.find(&[3, 4]).is_some());
        let mut small = SuffixTrie::new(8, 4);
        let complete: Vec<bool> = (0..6).map(|x| small.push(x)).collect();
        assert!(complete.contains(&false));
        assert!(small.num_nodes() <= 4);
    }

    #[test]
    fn longest_suffix_needs_a_continuation() {
        let mut t = SuffixTrie::new(8, 1 << 10);
        for x in [5, 6, 7, 5, 6] {
            t.push(x);
        }
        // "5 6" continues with 7; the context's own end "7 5 6" has no continuation.
        let m = t.longest_suffix(&[7, 5, 6], 8).unwrap();
        assert_eq!(m.len, 2);
        assert_eq!(t.children(m.node)[0].1, 7);
        assert!(t.longest_suffix(&[9], 8).is_none());
        assert!(t.longest_suffix(&[], 8).is_none());
    }
}
