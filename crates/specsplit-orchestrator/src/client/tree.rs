//! Draft-tree shapes and paths: sizing a tree to the room left, cutting and re-rooting trees.

use specsplit_core::tree::TokenTree;

use specsplit_core::tree::full_tree_size;

/// `widths` cut to at most `levels` levels and at most `nodes` nodes in all: the deepest
/// levels go first, and a single level too wide is narrowed. Empty when no node fits.
pub(super) fn fit_tree_widths(widths: &[usize], nodes: usize, levels: usize) -> Vec<usize> {
    let mut w: Vec<usize> = widths.iter().copied().take(levels).collect();
    while w.len() > 1 && full_tree_size(&w) > nodes {
        w.pop();
    }
    if let Some(first) = w.first_mut() {
        *first = (*first).min(nodes);
        if *first == 0 {
            w.clear();
        }
    }
    w
}

/// Node indices of the path from a root whose tokens are `tokens`, if any.
pub(super) fn path_of_tokens(tree: &TokenTree, tokens: &[u32]) -> Option<Vec<usize>> {
    let mut path = Vec::with_capacity(tokens.len());
    let mut candidates: Vec<usize> = tree.roots().collect();
    for &t in tokens {
        let n = *candidates.iter().find(|&&i| tree.token(i) == t)?;
        path.push(n);
        candidates = tree.children(n).collect();
    }
    Some(path)
}

/// The path that follows the first child from the first root down to a leaf.
pub(super) fn first_child_path(tree: &TokenTree) -> Vec<usize> {
    let mut path = Vec::new();
    let mut next = tree.roots().next();
    while let Some(n) = next {
        path.push(n);
        next = tree.children(n).next();
    }
    path
}

/// The part of `tree` below `root` (excluded; `None` = the whole tree) down to `levels` levels,
/// as a tree of its own: `root`'s children become roots and `root`'s child distribution becomes
/// the root distribution.
pub(super) fn subtree(tree: &TokenTree, root: Option<usize>, levels: usize) -> TokenTree {
    let mut t = TokenTree::new();
    t.set_siblings_without_replacement(tree.siblings_without_replacement());
    let (top, root_dist) = match root {
        Some(r) => (tree.children(r), tree.child_distribution(r)),
        None => (tree.roots(), tree.root_distribution()),
    };
    if let Some(d) = root_dist {
        t.set_root_distribution(d.clone());
    }
    // Breadth-first over the descendants keeps the new tree breadth-first.
    let mut queue: std::collections::VecDeque<(usize, Option<usize>, usize)> =
        top.map(|c| (c, None, 0)).collect();
    while let Some((old, parent, level)) = queue.pop_front() {
        if level >= levels {
            continue;
        }
        let new = match parent {
            None => t.push_root(tree.token(old), tree.log_prob(old)),
            Some(p) => t.push_child(p, tree.token(old), tree.log_prob(old)),
        }
        .expect("breadth-first copy of a valid tree");
        if level + 1 < levels {
            if let Some(d) = tree.child_distribution(old) {
                t.set_child_distribution(new, d.clone())
                    .expect("node just added");
            }
        }
        queue.extend(tree.children(old).map(|c| (c, Some(new), level + 1)));
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_tree() -> TokenTree {
        // roots 10, 11; 10 -> 20, 21; 11 -> 22; 20 -> 30
        let mut t = TokenTree::new();
        t.push_root(10, -0.1).unwrap();
        t.push_root(11, -0.2).unwrap();
        t.push_child(0, 20, -0.3).unwrap();
        t.push_child(0, 21, -0.4).unwrap();
        t.push_child(1, 22, -0.5).unwrap();
        t.push_child(2, 30, -0.6).unwrap();
        t
    }

    #[test]
    fn subtree_reroots_and_prunes() {
        let t = sample_tree();
        let s = subtree(&t, Some(0), usize::MAX);
        assert_eq!(s.tokens(), &[20, 21, 30]);
        assert_eq!(s.parent(2), Some(0));
        let p = subtree(&t, None, 2);
        assert_eq!(p.tokens(), &[10, 11, 20, 21, 22]);
        assert_eq!(p.max_depth(), 1);
        let whole = subtree(&t, None, usize::MAX);
        assert_eq!(whole.tokens(), t.tokens());
    }

    #[test]
    fn trees_are_cut_to_the_room_left() {
        assert_eq!(fit_tree_widths(&[4, 2, 1], 100, usize::MAX), vec![4, 2, 1]);
        assert_eq!(fit_tree_widths(&[4, 2, 1], 19, usize::MAX), vec![4, 2]);
        assert_eq!(fit_tree_widths(&[4, 2, 1], 11, usize::MAX), vec![4]);
        assert_eq!(fit_tree_widths(&[4, 2, 1], 3, usize::MAX), vec![3]);
        assert_eq!(
            fit_tree_widths(&[4, 2, 1], 0, usize::MAX),
            Vec::<usize>::new()
        );
        assert_eq!(fit_tree_widths(&[1, 1, 1, 1], 100, 2), vec![1, 1]);
    }

    #[test]
    fn first_child_path_and_token_paths() {
        let t = sample_tree();
        assert_eq!(first_child_path(&t), vec![0, 2, 5]);
        assert_eq!(path_of_tokens(&t, &[11, 22]), Some(vec![1, 4]));
        assert_eq!(path_of_tokens(&t, &[11, 20]), None);
    }
}
