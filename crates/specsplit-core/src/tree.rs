//! Flattened breadth-first token trees: building and validation. (The nested wire form and its
//! conversions belong to `specsplit-proto`.)
//!
//! A [`TokenTree`] is a forest stored in breadth-first order: all roots first, then the children
//! of node 0, the children of node 1, and so on. Consequently every parent has a smaller index
//! than its children, the children of a node are contiguous and in the order the verifier must
//! try them, and depths never decrease along the index order.

use std::fmt;
use std::ops::Range;

/// Absolute tolerance on the total mass of a probability distribution.
pub const SUM_TOLERANCE: f64 = 1e-3;

/// Largest log-probability accepted for a draft token (a small positive slack for rounding).
pub const LOG_PROB_TOLERANCE: f32 = 1e-3;

/// A probability distribution over the vocabulary.
#[derive(Debug, Clone, PartialEq)]
pub enum Distribution {
    /// `probs[i]` is the probability of token id `i`; the length is the vocabulary size.
    Dense(Vec<f32>),
    /// Probabilities of the listed token ids; every other token has probability zero.
    Sparse {
        /// Token ids of the support (distinct).
        ids: Vec<u32>,
        /// Probabilities aligned with `ids`.
        probs: Vec<f32>,
    },
}

/// Why a [`Distribution`] is not a valid distribution.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum DistributionError {
    /// No probabilities at all.
    #[error("the distribution is empty")]
    Empty,
    /// Sparse encoding with `ids` and `probs` of different lengths.
    #[error("sparse distribution has {ids} token ids but {probs} probabilities; they must align")]
    LengthMismatch {
        /// Number of token ids.
        ids: usize,
        /// Number of probabilities.
        probs: usize,
    },
    /// Dense encoding whose length is not the vocabulary size.
    #[error(
        "dense distribution has {len} probabilities but the vocabulary has {vocab_size} tokens"
    )]
    DenseLength {
        /// Number of probabilities.
        len: usize,
        /// Vocabulary size.
        vocab_size: usize,
    },
    /// A sparse token id outside `0..vocab_size` (negative ids included).
    #[error("token id {token} is outside the vocabulary 0..{vocab_size}")]
    TokenOutOfVocab {
        /// The offending id.
        token: i64,
        /// Vocabulary size.
        vocab_size: usize,
    },
    /// The same token id listed twice in a sparse distribution.
    #[error("token id {token} is listed more than once")]
    DuplicateToken {
        /// The repeated id.
        token: u32,
    },
    /// A probability that is negative, NaN or infinite.
    #[error("probability #{index} is {value}; probabilities must be finite and non-negative")]
    InvalidProbability {
        /// Position in the probability list.
        index: usize,
        /// The offending value.
        value: f32,
    },
    /// Probabilities that do not sum to 1 within [`SUM_TOLERANCE`].
    #[error("probabilities sum to {sum}, not 1 (tolerance {SUM_TOLERANCE})")]
    BadSum {
        /// The actual total.
        sum: f64,
    },
}

impl Distribution {
    /// Probability of `token` (zero when outside the support or the vocabulary).
    pub fn prob(&self, token: u32) -> f32 {
        match self {
            Distribution::Dense(p) => p.get(token as usize).copied().unwrap_or(0.0),
            Distribution::Sparse { ids, probs } => ids
                .iter()
                .position(|&t| t == token)
                .and_then(|j| probs.get(j).copied())
                .unwrap_or(0.0),
        }
    }

    /// Iterates over `(token, probability)` pairs of the stored entries.
    pub fn iter(&self) -> Box<dyn Iterator<Item = (u32, f32)> + '_> {
        match self {
            Distribution::Dense(p) => Box::new(p.iter().enumerate().map(|(i, &x)| (i as u32, x))),
            Distribution::Sparse { ids, probs } => {
                Box::new(ids.iter().copied().zip(probs.iter().copied()))
            }
        }
    }

    /// Number of stored entries (vocabulary size for dense, support size for sparse).
    pub fn num_entries(&self) -> usize {
        match self {
            Distribution::Dense(p) => p.len(),
            Distribution::Sparse { ids, .. } => ids.len(),
        }
    }

    /// Sum of the stored probabilities, accumulated in f64.
    pub fn total(&self) -> f64 {
        self.iter().map(|(_, p)| f64::from(p)).sum()
    }

    /// Dense copy of length `vocab_size` (entries outside the vocabulary are dropped).
    pub fn to_dense(&self, vocab_size: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; vocab_size];
        for (t, p) in self.iter() {
            if let Some(slot) = out.get_mut(t as usize) {
                *slot = p;
            }
        }
        out
    }

    /// Checks the distribution: non-empty, aligned lengths, ids in the vocabulary and distinct,
    /// probabilities finite and non-negative, total mass 1 within [`SUM_TOLERANCE`].
    pub fn validate(&self, vocab_size: usize) -> Result<(), DistributionError> {
        let probs = match self {
            Distribution::Dense(p) => {
                if p.is_empty() {
                    return Err(DistributionError::Empty);
                }
                if p.len() != vocab_size {
                    return Err(DistributionError::DenseLength {
                        len: p.len(),
                        vocab_size,
                    });
                }
                p
            }
            Distribution::Sparse { ids, probs } => {
                if ids.len() != probs.len() {
                    return Err(DistributionError::LengthMismatch {
                        ids: ids.len(),
                        probs: probs.len(),
                    });
                }
                if ids.is_empty() {
                    return Err(DistributionError::Empty);
                }
                if let Some(&t) = ids.iter().find(|&&t| t as usize >= vocab_size) {
                    return Err(DistributionError::TokenOutOfVocab {
                        token: i64::from(t),
                        vocab_size,
                    });
                }
                let mut sorted = ids.clone();
                sorted.sort_unstable();
                if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
                    return Err(DistributionError::DuplicateToken { token: w[0] });
                }
                probs
            }
        };
        let mut sum = 0.0f64;
        for (index, &value) in probs.iter().enumerate() {
            if !value.is_finite() || value < 0.0 {
                return Err(DistributionError::InvalidProbability { index, value });
            }
            sum += f64::from(value);
        }
        if (sum - 1.0).abs() > SUM_TOLERANCE {
            return Err(DistributionError::BadSum { sum });
        }
        Ok(())
    }
}

/// Nodes of a full tree with `widths[d]` children per node at depth `d` (saturating).
pub fn full_tree_size(widths: &[usize]) -> usize {
    let mut level = 1usize;
    let mut total = 0usize;
    for &w in widths {
        level = level.saturating_mul(w);
        total = total.saturating_add(level);
    }
    total
}

/// Limits a received tree must respect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeLimits {
    /// Maximum number of nodes in the whole forest.
    pub max_nodes: usize,
    /// Maximum number of tokens on a root-to-leaf path: a node of (0-based) depth `d` needs
    /// `d + 1 <= max_depth`.
    pub max_depth: usize,
    /// Vocabulary size: token ids must lie in `0..vocab_size`.
    pub vocab_size: usize,
}

impl TreeLimits {
    /// Builds limits from their three fields.
    pub fn new(max_nodes: usize, max_depth: usize, vocab_size: usize) -> Self {
        TreeLimits {
            max_nodes,
            max_depth,
            vocab_size,
        }
    }
}

/// Formats an optional node index for error messages (`None` = the roots).
fn node_label(node: &Option<usize>) -> String {
    match node {
        Some(i) => format!("node {i}"),
        None => "the roots".to_string(),
    }
}

/// Describes the node being added for builder error messages.
fn adding_label(parent: &Option<usize>) -> String {
    match parent {
        Some(p) => format!("a child of node {p}"),
        None => "a root".to_string(),
    }
}

/// Why a token tree is malformed or unusable.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TreeError {
    /// The forest has no node.
    #[error("the draft tree is empty: it needs at least one root")]
    Empty,
    /// More nodes than `TreeLimits::max_nodes`.
    #[error("the draft tree has at least {count} nodes, more than the limit of {max}; send a smaller tree")]
    TooManyNodes {
        /// Nodes counted when the limit was hit (a lower bound for the true count).
        count: usize,
        /// The limit.
        max: usize,
    },
    /// A root-to-leaf path longer than `TreeLimits::max_depth`.
    #[error("the draft tree has a path of {depth} tokens, more than the depth limit of {max}; draft fewer tokens")]
    TooDeep {
        /// Tokens on the offending path (0-based depth + 1).
        depth: usize,
        /// The limit.
        max: usize,
    },
    /// A node token id outside the vocabulary (negative wire ids included).
    #[error("node {node} has token id {token}, outside the vocabulary 0..{vocab_size}; draft and target must share a vocabulary")]
    TokenOutOfVocab {
        /// Breadth-first node index.
        node: usize,
        /// The offending id.
        token: i64,
        /// Vocabulary size.
        vocab_size: usize,
    },
    /// A draft log-probability that is NaN or positive (above [`LOG_PROB_TOLERANCE`]).
    #[error("node {node} has log-probability {log_prob}; it must be a natural log of a probability (<= 0, not NaN)")]
    BadLogProb {
        /// Breadth-first node index.
        node: usize,
        /// The offending value.
        log_prob: f32,
    },
    /// Malformed informational top-k lists of a node.
    #[error("node {node} has malformed top-k information: {reason}")]
    BadTopK {
        /// Breadth-first node index.
        node: usize,
        /// What is wrong.
        reason: String,
    },
    /// An invalid draft distribution (of the roots when `node` is `None`).
    #[error("invalid draft distribution for the children of {}: {reason}", node_label(.node))]
    BadDistribution {
        /// Node whose children the distribution is for; `None` for the roots.
        node: Option<usize>,
        /// What is wrong.
        reason: DistributionError,
    },
    /// Sampled verification needs a draft distribution that is absent.
    #[error("sampled verification needs the draft distribution of the children of {}, which is missing", node_label(.node))]
    MissingDistribution {
        /// Node whose children lack a distribution; `None` for the roots.
        node: Option<usize>,
    },
    /// A drafted token to which its own draft distribution gives probability zero.
    #[error("node {node} (token {token}) has draft probability zero in the distribution it was drawn from (that of {}); the tree is inconsistent", node_label(.parent))]
    DrawnTokenHasZeroDraftProb {
        /// The drafted node.
        node: usize,
        /// Its token.
        token: u32,
        /// Its parent (`None` for a root).
        parent: Option<usize>,
    },
    /// Two siblings with the same token although siblings were drawn without replacement.
    #[error("node {node} repeats token {token} among the children of {} although siblings were drawn without replacement", node_label(.parent))]
    DuplicateSibling {
        /// The second occurrence.
        node: usize,
        /// The repeated token.
        token: u32,
        /// Their parent (`None` for roots).
        parent: Option<usize>,
    },
    /// A builder call that would break breadth-first order.
    #[error("cannot add {} now: after a child of node {last_parent}, only children of node {last_parent} or later nodes may be added (breadth-first order)", adding_label(.parent))]
    NotBreadthFirst {
        /// Parent of the node being added (`None` for a root).
        parent: Option<usize>,
        /// Parent of the last node added.
        last_parent: usize,
    },
    /// A builder call naming a parent that does not exist yet.
    #[error("parent {parent} does not exist: the tree has {len} nodes")]
    ParentOutOfRange {
        /// The named parent.
        parent: usize,
        /// Current node count.
        len: usize,
    },
    /// A builder call naming a node that does not exist.
    #[error("node {node} does not exist: the tree has {len} nodes")]
    NodeOutOfRange {
        /// The named node.
        node: usize,
        /// Current node count.
        len: usize,
    },
}

/// A draft token forest flattened in breadth-first order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct TokenTree {
    tokens: Vec<u32>,
    parents: Vec<Option<usize>>,
    depths: Vec<usize>,
    log_probs: Vec<f32>,
    child_start: Vec<usize>,
    child_count: Vec<usize>,
    child_distributions: Vec<Option<Distribution>>,
    top_k_ids: Vec<Vec<u32>>,
    top_k_probs: Vec<Vec<f32>>,
    num_roots: usize,
    root_distribution: Option<Distribution>,
    siblings_without_replacement: bool,
}

impl TokenTree {
    /// An empty tree (siblings with replacement, no distributions).
    pub fn new() -> Self {
        Self::default()
    }

    /// A single chain `tokens[0] -> tokens[1] -> ...` with log-probabilities 0.
    pub fn chain(tokens: &[u32]) -> Self {
        let mut tree = Self::new();
        for (i, &t) in tokens.iter().enumerate() {
            let pushed = if i == 0 {
                tree.push_root(t, 0.0)
            } else {
                tree.push_child(i - 1, t, 0.0)
            };
            debug_assert!(pushed.is_ok(), "a chain is breadth-first by construction");
        }
        tree
    }

    /// Adds a root; roots must all come before any child.
    pub fn push_root(&mut self, token: u32, log_prob: f32) -> Result<usize, TreeError> {
        if self.len() > self.num_roots {
            let last_parent = self.parents.last().copied().flatten().unwrap_or(0);
            return Err(TreeError::NotBreadthFirst {
                parent: None,
                last_parent,
            });
        }
        self.num_roots += 1;
        Ok(self.push_node(token, log_prob, None, 0))
    }

    /// Adds a child of `parent`, keeping breadth-first order: `parent` must exist and must not
    /// precede the parent of the last node added.
    pub fn push_child(
        &mut self,
        parent: usize,
        token: u32,
        log_prob: f32,
    ) -> Result<usize, TreeError> {
        let len = self.len();
        if parent >= len {
            return Err(TreeError::ParentOutOfRange { parent, len });
        }
        if let Some(Some(last_parent)) = self.parents.last().copied() {
            if parent < last_parent {
                return Err(TreeError::NotBreadthFirst {
                    parent: Some(parent),
                    last_parent,
                });
            }
        }
        let index = self.push_node(token, log_prob, Some(parent), self.depths[parent] + 1);
        if self.child_count[parent] == 0 {
            self.child_start[parent] = index;
        }
        self.child_count[parent] += 1;
        Ok(index)
    }

    /// Appends a node without any check (callers enforce breadth-first order).
    fn push_node(
        &mut self,
        token: u32,
        log_prob: f32,
        parent: Option<usize>,
        depth: usize,
    ) -> usize {
        let index = self.tokens.len();
        self.tokens.push(token);
        self.parents.push(parent);
        self.depths.push(depth);
        self.log_probs.push(log_prob);
        self.child_start.push(0);
        self.child_count.push(0);
        self.child_distributions.push(None);
        self.top_k_ids.push(Vec::new());
        self.top_k_probs.push(Vec::new());
        index
    }

    /// Sets the draft distribution the roots were drawn from.
    pub fn set_root_distribution(&mut self, dist: Distribution) {
        self.root_distribution = Some(dist);
    }

    /// Sets the draft distribution the children of `node` were (or will be) drawn from.
    pub fn set_child_distribution(
        &mut self,
        node: usize,
        dist: Distribution,
    ) -> Result<(), TreeError> {
        let len = self.len();
        let slot = self
            .child_distributions
            .get_mut(node)
            .ok_or(TreeError::NodeOutOfRange { node, len })?;
        *slot = Some(dist);
        Ok(())
    }

    /// Sets the informational top-k lists of `node` (draft's likeliest next tokens).
    pub fn set_top_k(
        &mut self,
        node: usize,
        ids: Vec<u32>,
        probs: Vec<f32>,
    ) -> Result<(), TreeError> {
        let len = self.len();
        if node >= len {
            return Err(TreeError::NodeOutOfRange { node, len });
        }
        self.top_k_ids[node] = ids;
        self.top_k_probs[node] = probs;
        Ok(())
    }

    /// Records whether siblings were drawn without replacement (distinct tokens).
    pub fn set_siblings_without_replacement(&mut self, without_replacement: bool) {
        self.siblings_without_replacement = without_replacement;
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    /// Whether the tree has no node.
    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// Token of node `i` (panics if `i >= len()`).
    pub fn token(&self, i: usize) -> u32 {
        self.tokens[i]
    }

    /// All node tokens in breadth-first order.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Parent of node `i` (`None` for roots; panics if `i >= len()`).
    pub fn parent(&self, i: usize) -> Option<usize> {
        self.parents[i]
    }

    /// Parents of all nodes in breadth-first order.
    pub fn parents(&self) -> &[Option<usize>] {
        &self.parents
    }

    /// Depth of node `i` (roots are 0; panics if `i >= len()`).
    pub fn depth(&self, i: usize) -> usize {
        self.depths[i]
    }

    /// Depths of all nodes in breadth-first order.
    pub fn depths(&self) -> &[usize] {
        &self.depths
    }

    /// Largest node depth (0 for an empty tree or roots only).
    pub fn max_depth(&self) -> usize {
        self.depths.last().copied().unwrap_or(0)
    }

    /// Draft log-probability of node `i` (panics if `i >= len()`).
    pub fn log_prob(&self, i: usize) -> f32 {
        self.log_probs[i]
    }

    /// Indices of the children of node `i`, in verification order (panics if `i >= len()`).
    pub fn children(&self, i: usize) -> Range<usize> {
        let start = self.child_start[i];
        start..start + self.child_count[i]
    }

    /// Whether node `i` has no children (panics if `i >= len()`).
    pub fn is_leaf(&self, i: usize) -> bool {
        self.child_count[i] == 0
    }

    /// Indices of the roots.
    pub fn roots(&self) -> Range<usize> {
        0..self.num_roots
    }

    /// Node indices of the path from a root down to node `i`, inclusive (panics if `i >= len()`).
    pub fn path_to(&self, i: usize) -> Vec<usize> {
        let mut path = Vec::with_capacity(self.depths[i] + 1);
        let mut cur = Some(i);
        while let Some(c) = cur {
            path.push(c);
            cur = self.parents[c];
        }
        path.reverse();
        path
    }

    /// Tokens of the path from a root down to node `i`, inclusive (panics if `i >= len()`).
    pub fn path_tokens(&self, i: usize) -> Vec<u32> {
        self.path_to(i)
            .into_iter()
            .map(|j| self.tokens[j])
            .collect()
    }

    /// Draft distribution the roots were drawn from.
    pub fn root_distribution(&self) -> Option<&Distribution> {
        self.root_distribution.as_ref()
    }

    /// Draft distribution the children of node `i` were drawn from (panics if `i >= len()`).
    pub fn child_distribution(&self, i: usize) -> Option<&Distribution> {
        self.child_distributions[i].as_ref()
    }

    /// Whether the tree carries any draft distribution (of the roots or of some node's
    /// children). A tree with none can only be verified by
    /// [`verify_point_mass`](crate::verify::verify_point_mass) when sampled.
    pub fn has_any_distribution(&self) -> bool {
        self.root_distribution.is_some() || self.child_distributions.iter().any(Option::is_some)
    }

    /// Informational top-k ids and probabilities of node `i` (panics if `i >= len()`).
    pub fn top_k(&self, i: usize) -> (&[u32], &[f32]) {
        (&self.top_k_ids[i], &self.top_k_probs[i])
    }

    /// Whether siblings were drawn without replacement.
    pub fn siblings_without_replacement(&self) -> bool {
        self.siblings_without_replacement
    }

    /// Checks the tree against `limits`: non-empty, size, depth, token ids, log-probabilities,
    /// top-k lists and every present distribution.
    pub fn validate(&self, limits: &TreeLimits) -> Result<(), TreeError> {
        if self.is_empty() {
            return Err(TreeError::Empty);
        }
        if self.len() > limits.max_nodes {
            return Err(TreeError::TooManyNodes {
                count: self.len(),
                max: limits.max_nodes,
            });
        }
        if self.max_depth() + 1 > limits.max_depth {
            return Err(TreeError::TooDeep {
                depth: self.max_depth() + 1,
                max: limits.max_depth,
            });
        }
        if let Some(d) = &self.root_distribution {
            d.validate(limits.vocab_size)
                .map_err(|reason| TreeError::BadDistribution { node: None, reason })?;
        }
        for i in 0..self.len() {
            check_token(i, i64::from(self.tokens[i]), limits.vocab_size)?;
            check_log_prob(i, self.log_probs[i])?;
            check_top_k(
                i,
                self.top_k_ids[i].iter().map(|&t| i64::from(t)),
                self.top_k_ids[i].len(),
                &self.top_k_probs[i],
                limits.vocab_size,
            )?;
            if let Some(d) = &self.child_distributions[i] {
                d.validate(limits.vocab_size)
                    .map_err(|reason| TreeError::BadDistribution {
                        node: Some(i),
                        reason,
                    })?;
            }
        }
        Ok(())
    }

    /// Checks what sampled verification needs: the roots and every node with children carry a
    /// distribution in which each of those children has positive probability, and, when
    /// siblings were drawn without replacement, siblings are distinct.
    pub fn require_distributions(&self) -> Result<(), TreeError> {
        if self.is_empty() {
            return Ok(());
        }
        self.check_sibling_group(None, self.roots())?;
        for i in 0..self.len() {
            if self.child_count[i] > 0 {
                self.check_sibling_group(Some(i), self.children(i))?;
            }
        }
        Ok(())
    }

    /// Checks one group of siblings against the distribution they were drawn from.
    fn check_sibling_group(
        &self,
        parent: Option<usize>,
        group: Range<usize>,
    ) -> Result<(), TreeError> {
        let dist = match parent {
            None => self.root_distribution.as_ref(),
            Some(p) => self.child_distributions[p].as_ref(),
        }
        .ok_or(TreeError::MissingDistribution { node: parent })?;
        for node in group.clone() {
            let token = self.tokens[node];
            if dist.prob(token).partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
                return Err(TreeError::DrawnTokenHasZeroDraftProb {
                    node,
                    token,
                    parent,
                });
            }
            if self.siblings_without_replacement && self.tokens[group.start..node].contains(&token)
            {
                return Err(TreeError::DuplicateSibling {
                    node,
                    token,
                    parent,
                });
            }
        }
        Ok(())
    }
}

/// Checks a node token id against the vocabulary.
pub fn check_token(node: usize, token: i64, vocab_size: usize) -> Result<(), TreeError> {
    if token < 0 || token as u64 >= vocab_size as u64 {
        return Err(TreeError::TokenOutOfVocab {
            node,
            token,
            vocab_size,
        });
    }
    Ok(())
}

/// Checks a draft log-probability: not NaN and not above [`LOG_PROB_TOLERANCE`].
pub fn check_log_prob(node: usize, log_prob: f32) -> Result<(), TreeError> {
    if log_prob.is_nan() || log_prob > LOG_PROB_TOLERANCE {
        return Err(TreeError::BadLogProb { node, log_prob });
    }
    Ok(())
}

/// Checks the informational top-k lists of a node.
pub fn check_top_k(
    node: usize,
    mut ids: impl Iterator<Item = i64>,
    num_ids: usize,
    probs: &[f32],
    vocab_size: usize,
) -> Result<(), TreeError> {
    if num_ids != probs.len() {
        return Err(TreeError::BadTopK {
            node,
            reason: format!("{num_ids} token ids but {} probabilities", probs.len()),
        });
    }
    if let Some(t) = ids.find(|&t| t < 0 || t as u64 >= vocab_size as u64) {
        return Err(TreeError::BadTopK {
            node,
            reason: format!("token id {t} is outside the vocabulary 0..{vocab_size}"),
        });
    }
    if let Some(p) = probs
        .iter()
        .find(|p| !(0.0..=1.0 + SUM_TOLERANCE as f32).contains(*p))
    {
        return Err(TreeError::BadTopK {
            node,
            reason: format!("probability {p} is not in [0, 1]"),
        });
    }
    Ok(())
}

impl fmt::Display for TokenTree {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "TokenTree({} nodes, {} roots, tokens {:?})",
            self.len(),
            self.num_roots,
            self.tokens
        )
    }
}
