//! Request checks: identifiers, token ids, sizes against the worker's limits, sampling
//! parameters and draft-tree distributions, each refused INVALID_ARGUMENT naming what is wrong.

use specsplit_core::sampling::SamplingParams;
use specsplit_core::tree::{TokenTree, TreeLimits};
use specsplit_proto::convert::{SamplingWire, TreeWire};
use specsplit_proto::{DraftRequest, VerifyRequest};

use crate::predraft::OutcomeSet;
use tonic::Status;

use super::WorkerInfo;
use crate::target::Prefix;
use specsplit_core::tree::full_tree_size;

/// Longest `request_id`, `session_id` or `session_secret` accepted, in bytes.
pub const MAX_ID_BYTES: usize = 256;

impl WorkerInfo {
    /// The INVALID_ARGUMENT status of a request that asks for a size beyond a limit.
    pub(super) fn over(field: &str, value: usize, max: usize, setting: &str) -> Status {
        Status::invalid_argument(format!(
            "{field} is {value}; this worker accepts at most {max} ({setting})"
        ))
    }

    /// The token ids of request field `what`, each within the vocabulary (any non-negative
    /// id with a vocabulary of 0), at most `max_prompt_len` of them.
    pub(super) fn tokens(&self, ids: &[i32], what: &str) -> Result<Vec<u32>, Status> {
        if ids.len() > self.max_prompt_len {
            return Err(Status::invalid_argument(format!(
                "{what} has {} tokens; this worker accepts at most {} (max_prompt_len)",
                ids.len(),
                self.max_prompt_len
            )));
        }
        ids.iter()
            .enumerate()
            .map(|(i, &t)| {
                if t < 0 || (self.vocab_size > 0 && t as usize >= self.vocab_size) {
                    Err(Status::invalid_argument(format!(
                        "{what}[{i}] = {t} is outside the vocabulary [0, {})",
                        self.vocab_size
                    )))
                } else {
                    Ok(t as u32)
                }
            })
            .collect()
    }
}

/// The sampling parameters of a request: `full` when given, else greedy or plain sampling at
/// `temperature`.
pub(super) fn sampling_from(
    full: Option<&specsplit_proto::SamplingParams>,
    temperature: f32,
) -> Result<SamplingParams, Status> {
    let p = match full {
        Some(p) => SamplingParams::from_proto(p),
        None => SamplingParams::from_proto(&specsplit_proto::SamplingParams {
            temperature,
            ..Default::default()
        }),
    };
    p.map_err(|e| Status::invalid_argument(format!("sampling parameters: {e}")))
}

/// Refuses identifiers longer than [`MAX_ID_BYTES`] (INVALID_ARGUMENT, naming the field).
pub(super) fn check_ids(ids: &[(&str, &str)]) -> Result<(), Status> {
    for (field, value) in ids {
        if value.len() > MAX_ID_BYTES {
            return Err(Status::invalid_argument(format!(
                "{field} is {} bytes long; at most {MAX_ID_BYTES} are accepted",
                value.len()
            )));
        }
    }
    Ok(())
}

/// Refuses a draft or verify request whose `request_id`, `session_id` or `session_secret` is
/// longer than [`MAX_ID_BYTES`].
pub(super) fn check_request_ids(
    request_id: &str,
    session_id: &str,
    session_secret: &str,
) -> Result<(), Status> {
    check_ids(&[
        ("request_id", request_id),
        ("session_id", session_id),
        ("session_secret", session_secret),
    ])
}

/// Refuses a tree whose distributions or top-k lists have more entries than the vocabulary
/// (INVALID_ARGUMENT, naming where), before they are converted.
pub(super) fn check_distribution_sizes(r: &VerifyRequest, vocab: usize) -> Result<(), Status> {
    let over = |what: &str, n: usize| {
        Status::invalid_argument(format!(
            "{what} has {n} entries; at most the vocabulary size {vocab}"
        ))
    };
    if let Some(d) = &r.root_distribution {
        let n = d.token_ids.len().max(d.probs.len());
        if n > vocab {
            return Err(over("root_distribution", n));
        }
    }
    let mut stack: Vec<&specsplit_proto::TokenNode> = r.draft_tree.iter().collect();
    while let Some(node) = stack.pop() {
        if let Some(d) = &node.child_distribution {
            let n = d.token_ids.len().max(d.probs.len());
            if n > vocab {
                return Err(over("a child_distribution in draft_tree", n));
            }
        }
        let n = node.top_k_token_ids.len().max(node.top_k_probs.len());
        if n > vocab {
            return Err(over("a top-k list in draft_tree", n));
        }
        stack.extend(node.children.iter());
    }
    Ok(())
}

/// The tree shape a draft request asks for, each size checked against the worker's limits
/// before anything is allocated.
pub(super) fn draft_widths(info: &WorkerInfo, r: &DraftRequest) -> Result<Vec<usize>, Status> {
    let max_depth = info.tree_depth();
    let max_nodes = info.max_tree_nodes;
    let widths: Vec<usize> = if !r.tree_widths.is_empty() {
        if r.tree_widths.len() > max_depth {
            return Err(WorkerInfo::over(
                "the length of tree_widths",
                r.tree_widths.len(),
                max_depth,
                "max_tree_depth",
            ));
        }
        let mut widths = Vec::with_capacity(r.tree_widths.len());
        for (i, &w) in r.tree_widths.iter().enumerate() {
            if w <= 0 {
                return Err(Status::invalid_argument(format!(
                    "tree_widths[{i}] is {w}; widths must be positive"
                )));
            }
            if w as usize > max_nodes {
                return Err(WorkerInfo::over(
                    &format!("tree_widths[{i}]"),
                    w as usize,
                    max_nodes,
                    "max_tree_nodes",
                ));
            }
            widths.push(w as usize);
        }
        widths
    } else {
        if r.max_draft_len <= 0 {
            return Err(Status::invalid_argument(format!(
                "max_draft_len is {}; it must be positive",
                r.max_draft_len
            )));
        }
        if r.max_draft_len as usize > max_depth {
            return Err(WorkerInfo::over(
                "max_draft_len",
                r.max_draft_len as usize,
                max_depth,
                "max_tree_depth",
            ));
        }
        if r.num_beams as i64 > max_nodes as i64 {
            return Err(WorkerInfo::over(
                "num_beams",
                r.num_beams as usize,
                max_nodes,
                "max_tree_nodes",
            ));
        }
        let mut w = vec![1usize; r.max_draft_len as usize];
        w[0] = r.num_beams.max(1) as usize;
        w
    };
    // Each width is at most max_tree_nodes and there are at most 99 levels, but their
    // product can still overflow: full_tree_size saturates.
    let n = full_tree_size(&widths);
    if n > max_nodes {
        return Err(Status::invalid_argument(format!(
            "tree_widths describe a tree of {} nodes; this worker drafts at most \
             {max_nodes} (max_tree_nodes)",
            if n == usize::MAX {
                "too many".to_string()
            } else {
                n.to_string()
            }
        )));
    }
    Ok(widths)
}

/// The outcome set of a pre-draft request (`None`: an ordinary draft), its sizes checked
/// against the worker's limits before anything is allocated: the path under verification is at
/// most `max_tree_depth` tokens and the pre-draft's nodes in all (path, candidates and their
/// trees of `widths`) at most `max_tree_nodes`.
pub(super) fn outcome_set(
    info: &WorkerInfo,
    r: &DraftRequest,
    widths: &[usize],
) -> Result<Option<OutcomeSet>, Status> {
    let Some(o) = &r.outcomes else {
        return Ok(None);
    };
    let len = r.prompt_token_ids.len();
    if o.committed_length <= 0 || o.committed_length as usize > len {
        return Err(Status::invalid_argument(format!(
            "outcomes.committed_length is {}; it must lie in 1..={len} (prompt_token_ids holds \
             the committed sequence and then the path under verification)",
            o.committed_length
        )));
    }
    let path = len - o.committed_length as usize;
    if path > info.tree_depth() {
        return Err(WorkerInfo::over(
            "the path under verification",
            path,
            info.tree_depth(),
            "max_tree_depth",
        ));
    }
    if o.candidates <= 0 {
        return Err(Status::invalid_argument(format!(
            "outcomes.candidates is {}; it must be positive",
            o.candidates
        )));
    }
    let mut lengths = Vec::with_capacity(o.accepted_lengths.len());
    for (i, &j) in o.accepted_lengths.iter().enumerate() {
        if j < 0 || j as usize > path || lengths.last().is_some_and(|&l| l >= j as usize) {
            return Err(Status::invalid_argument(format!(
                "outcomes.accepted_lengths[{i}] is {j}; lengths must ascend and lie in \
                 0..={path} (the path's length)"
            )));
        }
        lengths.push(j as usize);
    }
    let set = OutcomeSet {
        committed: o.committed_length as usize,
        candidates: (o.candidates as usize).min(info.max_tree_nodes + 1),
        accepted_lengths: lengths,
    };
    let nodes = set.nodes(path, widths);
    if nodes > info.max_tree_nodes {
        return Err(Status::invalid_argument(format!(
            "the outcome set asks for {nodes} pre-draft nodes (the path, {} outcomes and their \
             trees); this worker drafts at most {} (max_tree_nodes)",
            set.lengths(path).len().saturating_mul(set.candidates),
            info.max_tree_nodes
        )));
    }
    Ok(Some(set))
}

/// The draft tree of a verify request (empty: a plain decoding step), within the worker's
/// node, depth and vocabulary limits; a sampled request's tree carries all of its draft
/// distributions or none.
pub(super) fn draft_tree(
    info: &WorkerInfo,
    r: &VerifyRequest,
    sampling: &SamplingParams,
) -> Result<TokenTree, Status> {
    if r.draft_tree.is_empty() {
        return Ok(TokenTree::new());
    }
    let limits = TreeLimits {
        max_nodes: info.max_tree_nodes,
        max_depth: info.tree_depth(),
        vocab_size: info.vocab_size,
    };
    let tree = TokenTree::from_proto(
        &r.draft_tree,
        r.root_distribution.as_ref(),
        r.siblings_without_replacement,
        &limits,
    )
    .map_err(|e| Status::invalid_argument(format!("draft_tree: {e}")))?;
    // Sampled verification uses the draft distributions when the tree carries them (all of
    // them), and point-mass proposals when it carries none (the original client sends none);
    // a tree with only some is refused.
    if !sampling.is_greedy() && tree.has_any_distribution() {
        tree.require_distributions().map_err(|e| {
            Status::invalid_argument(format!(
                "draft_tree: {e}; send a draft distribution for the roots and for every node \
                 with children, or none at all"
            ))
        })?;
    }
    Ok(tree)
}

/// The sequence before a verify request's tree: the full prompt when it carries one, else the
/// new tokens to append to a session's cached sequence of `expected_prefix_length` tokens.
pub(super) fn prefix(info: &WorkerInfo, r: &VerifyRequest) -> Result<Prefix, Status> {
    if !r.prompt_token_ids.is_empty() {
        return Ok(Prefix::Full(
            info.tokens(&r.prompt_token_ids, "prompt_token_ids")?,
        ));
    }
    if r.expected_prefix_length < 0 {
        return Err(Status::invalid_argument(
            "expected_prefix_length must not be negative",
        ));
    }
    Ok(Prefix::Delta {
        new_tokens: info.tokens(&r.new_token_ids, "new_token_ids")?,
        expected_len: r.expected_prefix_length as usize,
    })
}
