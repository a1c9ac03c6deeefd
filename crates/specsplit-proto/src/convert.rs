//! Conversions between the wire messages and the core's types ([`TokenTree`], [`Distribution`],
//! [`SamplingParams`]). The core knows no wire format; these extension traits give its types
//! `from_proto` / `to_proto` where the services and the orchestrator need them (bring the trait
//! into scope: `use specsplit_proto::convert::TreeWire;`).

use std::collections::VecDeque;

use specsplit_core::sampling::{SamplingError, SamplingParams};
use specsplit_core::tree::{
    check_log_prob, check_token, check_top_k, Distribution, DistributionError, TokenTree,
    TreeError, TreeLimits,
};

use crate::{DraftDistribution, TokenNode};

/// Wire conversions of a [`Distribution`] ([`DraftDistribution`]: dense when `token_ids` is
/// empty, else sparse).
pub trait DistributionWire: Sized {
    /// Converts a wire distribution and validates it against `vocab_size`.
    fn from_proto(proto: &DraftDistribution, vocab_size: usize) -> Result<Self, DistributionError>;
    /// Converts to the wire form (dense: empty `token_ids`).
    fn to_proto(&self) -> DraftDistribution;
}

impl DistributionWire for Distribution {
    /// Converts a wire distribution and validates it against `vocab_size`.
    fn from_proto(
        proto: &DraftDistribution,
        vocab_size: usize,
    ) -> Result<Distribution, DistributionError> {
        let dist = if proto.token_ids.is_empty() {
            Distribution::Dense(proto.probs.clone())
        } else {
            let mut ids = Vec::with_capacity(proto.token_ids.len());
            for &t in &proto.token_ids {
                match u32::try_from(t) {
                    Ok(u) => ids.push(u),
                    Err(_) => {
                        return Err(DistributionError::TokenOutOfVocab {
                            token: i64::from(t),
                            vocab_size,
                        })
                    }
                }
            }
            Distribution::Sparse {
                ids,
                probs: proto.probs.clone(),
            }
        };
        dist.validate(vocab_size)?;
        Ok(dist)
    }

    /// Converts to the wire form (dense: empty `token_ids`).
    fn to_proto(&self) -> DraftDistribution {
        match self {
            Distribution::Dense(p) => DraftDistribution {
                token_ids: Vec::new(),
                probs: p.clone(),
            },
            Distribution::Sparse { ids, probs } => DraftDistribution {
                token_ids: ids.iter().map(|&t| id_to_wire(t)).collect(),
                probs: probs.clone(),
            },
        }
    }
}

impl From<&Distribution> for DraftDistribution {
    fn from(d: &Distribution) -> Self {
        d.to_proto()
    }
}

/// Converts an internal token id to the wire's `int32` (saturating; valid ids always fit).
fn id_to_wire(t: u32) -> i32 {
    i32::try_from(t).unwrap_or(i32::MAX)
}

/// Wire conversions of a [`TokenTree`] (a nested forest of [`TokenNode`]s and the roots'
/// distribution).
pub trait TreeWire: Sized {
    /// Flattens a wire forest breadth-first and validates it against `limits`. Never recurses
    /// and stops as soon as a size or depth limit is exceeded, so hostile input is cheap.
    fn from_proto(
        roots: &[TokenNode],
        root_distribution: Option<&DraftDistribution>,
        without_replacement: bool,
        limits: &TreeLimits,
    ) -> Result<Self, TreeError>;
    /// Converts to the nested wire form: the root list and the root distribution. Builds
    /// bottom-up without recursion; `from_proto(to_proto(t))` reproduces `t` exactly.
    fn to_proto(&self) -> (Vec<TokenNode>, Option<DraftDistribution>);
}

impl TreeWire for TokenTree {
    /// Flattens a wire forest breadth-first and validates it against `limits`. Never recurses
    /// and stops as soon as a size or depth limit is exceeded, so hostile input is cheap.
    fn from_proto(
        roots: &[TokenNode],
        root_distribution: Option<&DraftDistribution>,
        without_replacement: bool,
        limits: &TreeLimits,
    ) -> Result<TokenTree, TreeError> {
        if roots.is_empty() {
            return Err(TreeError::Empty);
        }
        if roots.len() > limits.max_nodes {
            return Err(TreeError::TooManyNodes {
                count: roots.len(),
                max: limits.max_nodes,
            });
        }
        if limits.max_depth == 0 {
            return Err(TreeError::TooDeep { depth: 1, max: 0 });
        }
        let mut tree = TokenTree::new();
        tree.set_siblings_without_replacement(without_replacement);
        if let Some(d) = root_distribution {
            let dist = DistributionWire::from_proto(d, limits.vocab_size)
                .map_err(|reason| TreeError::BadDistribution { node: None, reason })?;
            tree.set_root_distribution(dist);
        }
        let mut queue: VecDeque<(&TokenNode, Option<usize>)> =
            roots.iter().map(|r| (r, None)).collect();
        while let Some((node, parent)) = queue.pop_front() {
            let index = tree.len();
            check_token(index, i64::from(node.token_id), limits.vocab_size)?;
            check_log_prob(index, node.log_prob)?;
            check_top_k(
                index,
                node.top_k_token_ids.iter().map(|&t| i64::from(t)),
                node.top_k_token_ids.len(),
                &node.top_k_probs,
                limits.vocab_size,
            )?;
            let token = node.token_id as u32; // non-negative: checked above
            let pushed = match parent {
                None => tree.push_root(token, node.log_prob)?,
                Some(p) => tree.push_child(p, token, node.log_prob)?,
            };
            if let Some(d) = &node.child_distribution {
                let dist =
                    DistributionWire::from_proto(d, limits.vocab_size).map_err(|reason| {
                        TreeError::BadDistribution {
                            node: Some(pushed),
                            reason,
                        }
                    })?;
                tree.set_child_distribution(pushed, dist)?;
            }
            tree.set_top_k(
                pushed,
                node.top_k_token_ids.iter().map(|&t| t as u32).collect(),
                node.top_k_probs.clone(),
            )?;
            if !node.children.is_empty() {
                let child_depth = tree.depth(pushed) + 1;
                if child_depth + 1 > limits.max_depth {
                    return Err(TreeError::TooDeep {
                        depth: child_depth + 1,
                        max: limits.max_depth,
                    });
                }
                let count = tree.len() + queue.len() + node.children.len();
                if count > limits.max_nodes {
                    return Err(TreeError::TooManyNodes {
                        count,
                        max: limits.max_nodes,
                    });
                }
                queue.extend(node.children.iter().map(|c| (c, Some(pushed))));
            }
        }
        Ok(tree)
    }

    /// Converts to the nested wire form: the root list and the root distribution.
    /// Builds bottom-up without recursion; `from_proto(to_proto(t))` reproduces `t` exactly.
    fn to_proto(&self) -> (Vec<TokenNode>, Option<DraftDistribution>) {
        let mut built: Vec<Option<TokenNode>> = Vec::with_capacity(self.len());
        for i in 0..self.len() {
            built.push(Some(TokenNode {
                token_id: id_to_wire(self.token(i)),
                log_prob: self.log_prob(i),
                children: Vec::new(),
                top_k_token_ids: self.top_k(i).0.iter().map(|&t| id_to_wire(t)).collect(),
                top_k_probs: self.top_k(i).1.to_vec(),
                child_distribution: self.child_distribution(i).map(DistributionWire::to_proto),
            }));
        }
        // Children always have larger indices than their parent: fill parents from the back.
        for i in (0..self.len()).rev() {
            let children: Vec<TokenNode> =
                self.children(i).filter_map(|c| built[c].take()).collect();
            if let Some(node) = built[i].as_mut() {
                node.children = children;
            }
        }
        let roots = self.roots().filter_map(|r| built[r].take()).collect();
        (
            roots,
            self.root_distribution().map(DistributionWire::to_proto),
        )
    }
}

/// Wire conversions of [`SamplingParams`].
pub trait SamplingWire: Sized {
    /// Converts and validates wire parameters.
    fn from_proto(p: &crate::SamplingParams) -> Result<Self, SamplingError>;
    /// Converts to wire parameters (top-k saturates at `i32::MAX`).
    fn to_proto(&self) -> crate::SamplingParams;
}

impl SamplingWire for SamplingParams {
    fn from_proto(p: &crate::SamplingParams) -> Result<Self, SamplingError> {
        let top_k = usize::try_from(p.top_k).map_err(|_| SamplingError::InvalidTopK {
            value: i64::from(p.top_k),
        })?;
        let params = SamplingParams {
            temperature: p.temperature,
            top_k,
            top_p: p.top_p,
            seed: p.seed,
        };
        params.validate()?;
        Ok(params)
    }

    fn to_proto(&self) -> crate::SamplingParams {
        crate::SamplingParams {
            temperature: self.temperature,
            top_k: i32::try_from(self.top_k).unwrap_or(i32::MAX),
            top_p: self.top_p,
            seed: self.seed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_params_validate_and_round_trip() {
        let bad = |t: f32, k: i32, p: f32| {
            <SamplingParams as SamplingWire>::from_proto(&crate::SamplingParams {
                temperature: t,
                top_k: k,
                top_p: p,
                seed: 0,
            })
        };
        assert!(matches!(
            bad(-1.0, 0, 1.0),
            Err(SamplingError::InvalidTemperature { .. })
        ));
        assert!(matches!(
            bad(1.0, -2, 1.0),
            Err(SamplingError::InvalidTopK { .. })
        ));
        assert!(matches!(
            bad(1.0, 0, 1.5),
            Err(SamplingError::InvalidTopP { .. })
        ));
        let p = SamplingParams {
            temperature: 0.7,
            top_k: 5,
            top_p: 0.9,
            seed: 11,
        };
        assert_eq!(SamplingParams::from_proto(&p.to_proto()), Ok(p));
        let huge = SamplingParams {
            top_k: usize::MAX,
            ..p
        };
        assert_eq!(huge.to_proto().top_k, i32::MAX);
    }
}
