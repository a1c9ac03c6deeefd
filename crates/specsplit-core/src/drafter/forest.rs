//! A drafter's tree in the order it grows it (any parent before its children), laid out as a
//! breadth-first [`TokenTree`].

use crate::tree::TokenTree;

/// Nodes added parent first; siblings keep the order they were added in.
#[derive(Debug, Clone, Default)]
pub struct Forest {
    /// (parent, token, log-probability) per node.
    nodes: Vec<(Option<usize>, u32, f32)>,
}

impl Forest {
    /// An empty forest.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a node under `parent` (`None`: a root) and returns its index. A `parent` not yet
    /// added makes the node a root. `log_prob` is clamped to a valid log-probability.
    pub fn add(&mut self, parent: Option<usize>, token: u32, log_prob: f32) -> usize {
        let parent = parent.filter(|&p| p < self.nodes.len());
        let log_prob = if log_prob.is_finite() {
            log_prob.min(0.0)
        } else {
            f32::MIN
        };
        self.nodes.push((parent, token, log_prob));
        self.nodes.len() - 1
    }

    /// Nodes added.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Whether no node was added.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The forest as a breadth-first tree (level by level; within a level, children grouped by
    /// parent in the parents' order, and in the order they were added).
    pub fn into_tree(self) -> TokenTree {
        let n = self.nodes.len();
        let mut children: Vec<Vec<usize>> = vec![Vec::new(); n];
        let mut roots = Vec::new();
        for (i, &(parent, _, _)) in self.nodes.iter().enumerate() {
            match parent {
                Some(p) => children[p].push(i),
                None => roots.push(i),
            }
        }
        let mut tree = TokenTree::new();
        // (old index, new index of its parent)
        let mut queue: std::collections::VecDeque<(usize, Option<usize>)> =
            roots.into_iter().map(|r| (r, None)).collect();
        while let Some((old, parent)) = queue.pop_front() {
            let (_, token, log_prob) = self.nodes[old];
            let added = match parent {
                None => tree.push_root(token, log_prob),
                Some(p) => tree.push_child(p, token, log_prob),
            };
            // Breadth-first order and valid log-probabilities make every push succeed.
            let Ok(new) = added else { continue };
            queue.extend(children[old].iter().map(|&c| (c, Some(new))));
        }
        tree
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_first_growth_is_laid_out_breadth_first() {
        let mut f = Forest::new();
        let a = f.add(None, 1, 0.0);
        let a1 = f.add(Some(a), 2, -0.1);
        f.add(Some(a1), 3, -0.2);
        let b = f.add(None, 4, -1.0);
        f.add(Some(b), 5, f32::NAN);
        f.add(Some(a), 6, 0.5);
        let t = f.into_tree();
        assert_eq!(t.tokens(), &[1, 4, 2, 6, 5, 3]);
        assert_eq!(
            t.parents(),
            &[None, None, Some(0), Some(0), Some(1), Some(2)]
        );
        assert!(t.log_prob(3) <= 0.0 && t.log_prob(4).is_finite());
    }
}
